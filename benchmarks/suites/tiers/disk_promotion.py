"""Promotion from a warm disk tier through the transfer engine (benchmarks/suites/tiers/promotion.py's `measure`), this commit's
tiers against `--baseline`'s, each in a process of its own, in turn: a document's blocks read on the fill threads
(and on one), verified and copied into the KV cache, for SmolLM2-135M's blocks and Llama-3-8B-shaped ones.

On a CPU the KV cache is in host memory, so the figure is the tier's read alone; on a GPU the same reads fill the
pinned staging that the host-to-device copies drain (the GPU report's `bandwidth` section).

    python benchmarks/tiers.py disk-promotion --baseline REV --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import in_turn  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402

BLOCKS = {"SmolLM2-135M": ((30, 3, 64), 8192), "Llama-3-8B": ((32, 8, 128), 4096)}  # (layers, KV heads, dims), tokens


def worker(_: str) -> dict:
    import torch

    import kvstrata.tiers
    from kvstrata.tiers.base import BlockLayout

    from benchmarks.suites.tiers.promotion import measure

    measured = {"tiers_code": list(kvstrata.tiers.__path__)[0]}
    for name, ((layers, kv_heads, head_dim), tokens) in BLOCKS.items():
        layout = BlockLayout(num_layers=layers, block_size=16, num_kv_heads=kv_heads, head_dim=head_dim,
                             dtype=torch.bfloat16)
        with tempfile.TemporaryDirectory(prefix="kvstrata-disk-") as store_dir:
            row = measure(tokens, torch.device("cpu"), store_dir, 5, lambda: None, layout=layout)
        measured[name] = {"gbps": row["disk_gbps"], "gbps_one_thread": row["disk_gbps_one_thread"],
                          "gbps_in_process": row.get("disk_gbps_in_process"),
                          "fill_threads": row["fill_threads"], "mb": row["bytes"] / 1e6}
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.in_turn(parser, "disk_promotion")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    runs = in_turn.runs_in_turn(__file__, "-", args, lambda measured: ", ".join(
        f"{name} {measured[name]['gbps']:.2f} GB/s (one thread {measured[name]['gbps_one_thread']:.2f})"
        for name in BLOCKS))
    result = results.record("disk_promotion", baseline=args.baseline, repeats=args.repeats, runs=runs)
    results.publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline, runs = result["baseline"], result["runs"]
    any_run = runs["this"][0]
    lines = ["# Promotion from a warm disk tier", "", *provenance_lines(result), "",
             "A document's blocks promoted from a warm disk tier into a block-major KV cache in host memory through "
             f"the transfer engine ({any_run[next(iter(BLOCKS))]['fill_threads']} fill threads), as the engine reads "
             "them (by the disk tier's reader processes, where the code has them; in brackets: the same reads in the "
             "engine's process on the fill threads) and in parentheses on one fill thread in-process; random bytes, "
             "bf16 blocks of 16 tokens; best of 5 promotions after a warm-up (benchmarks/suites/tiers/promotion.py's "
             "`measure`). Each run in a process of its own"
             + (f", this commit and {baseline} in turn" if baseline else "") + "; every run listed, GB/s.", "",
             "| side | run | " + " | ".join(f"{name} ({any_run[name]['mb']:.0f} MB)" for name in BLOCKS) + " |",
             "|---|---:|" + "---:|" * len(BLOCKS)]
    for side, side_runs in runs.items():
        label = "this commit" if side == "this" else baseline
        for k, r in enumerate(side_runs):
            lines.append(f"| {label} | {k + 1} | " + " | ".join(
                f"{r[name]['gbps']:.2f}" + (f" [{r[name]['gbps_in_process']:.2f}]" if r[name].get("gbps_in_process")
                                            else "") + f" ({r[name]['gbps_one_thread']:.2f})"
                for name in BLOCKS) + " |")
    if baseline:
        lines += ["", "Best run of each side, this commit over the baseline: " + "; ".join(
            f"{name} {best(runs['this'], name, 'gbps') / best(runs['baseline'], name, 'gbps'):.2f}x "
            f"(one thread {best(runs['this'], name, 'gbps_one_thread') / best(runs['baseline'], name, 'gbps_one_thread'):.2f}x)"
            for name in BLOCKS) + "."]
    return lines


def best(runs: list[dict], name: str, key: str) -> float:
    return max(r[name][key] for r in runs)
