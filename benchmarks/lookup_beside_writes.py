"""What a CPU-tier lookup costs while write-downs fill the tier: the step's lookups (`count_prefix`) against a
thread that puts documents' blocks into the tier, as the transfer engine's write-downs do.

With write-through every computed block is written down after its step, a document's blocks (tens of megabytes)
in one put; a request's lookup, its hold and the lend of its blocks take the tier's lock meanwhile, on the path of
the step. Figures: the lookup's latency (median, 99th percentile, longest) and the writer's rate, side by side with
`--baseline`'s tier, each in a process of its own, in turn.

    python benchmarks/lookup_beside_writes.py --baseline REV --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable, after
    sys.path.append(str(REPO_ROOT))  # PYTHONPATH, where a baseline's `kvstrata` comes first (see --baseline)

from benchmarks.engine_host import in_turn_parser, runs_in_turn  # noqa: E402
from benchmarks.machine import provenance_lines, publish, results_record  # noqa: E402

DOC_BLOCKS = 437       # a 7000-token document in 16-token blocks
SLOTS = 2048           # the tier: 755 MB of SmolLM2-135M bf16 blocks
SECONDS = 3.0          # of lookups, one every LOOKUP_EVERY_S, while the writer puts documents
LOOKUP_EVERY_S = 0.001


def worker(_: str) -> dict:
    import torch

    import kvstrata.tiers
    from kvstrata.tiers.base import BlockLayout
    from kvstrata.tiers.cpu import CpuTier

    torch.set_num_threads(1)
    layout = BlockLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    tier = CpuTier(layout, SLOTS)
    payloads = [torch.randint(0, 256, (layout.block_nbytes,), dtype=torch.uint8) for _ in range(DOC_BLOCKS)]
    tokens = [list(range(16))] * DOC_BLOCKS
    looked_up = [os.urandom(16) for _ in range(DOC_BLOCKS)]
    tier.put(looked_up, tokens, payloads)
    tier.hold(looked_up)  # the looked-up document stays while others come and go
    stop, written = threading.Event(), []

    def write() -> None:  # documents, one put each, evicting older ones once the tier is full
        while not stop.is_set():
            started = time.perf_counter()
            tier.put([os.urandom(16) for _ in range(DOC_BLOCKS)], tokens, payloads)
            written.append(time.perf_counter() - started)

    writer = threading.Thread(target=write)
    writer.start()
    latencies = []
    deadline = time.perf_counter() + SECONDS
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        assert tier.count_prefix(looked_up) == DOC_BLOCKS
        latencies.append(time.perf_counter() - started)
        time.sleep(LOOKUP_EVERY_S)
    stop.set()
    writer.join()
    latencies.sort()
    return {"tiers_code": str(Path(kvstrata.tiers.__file__).parent), "median_s": statistics.median(latencies),
            "p99_s": latencies[int(0.99 * (len(latencies) - 1))], "max_s": latencies[-1], "lookups": len(latencies),
            "write_gbps": DOC_BLOCKS * layout.block_nbytes * len(written) / sum(written) / 1e9}


def main() -> int:
    args = in_turn_parser(__doc__, "lookup_beside_writes").parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    runs = runs_in_turn(__file__, "-", args, lambda measured: (
        f"median {measured['median_s'] * 1e3:.3f} ms, p99 {measured['p99_s'] * 1e3:.3f} ms, "
        f"max {measured['max_s'] * 1e3:.3f} ms, writes {measured['write_gbps']:.2f} GB/s"))
    result = results_record("lookup_beside_writes", baseline=args.baseline, repeats=args.repeats, runs=runs)
    publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline = result["baseline"]
    lines = ["# A CPU-tier lookup beside write-downs", "", *provenance_lines(result), "",
             f"`count_prefix` of a {DOC_BLOCKS}-block document (held) every {LOOKUP_EVERY_S * 1e3:g} ms for "
             f"{SECONDS:g} s, while another thread puts {DOC_BLOCKS}-block documents into the same {SLOTS}-slot tier "
             "(SmolLM2-135M bf16 blocks, 368,640 bytes; it evicts once full). Each run in a process of its own"
             + (f", this commit and {baseline} in turn" if baseline else "") + "; every run listed.", "",
             "| side | run | lookup median ms | p99 ms | longest ms | lookups | writer GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for side, runs in result["runs"].items():
        name = "this commit" if side == "this" else baseline
        for k, r in enumerate(runs):
            lines.append(f"| {name} | {k + 1} | {r['median_s'] * 1e3:.3f} | {r['p99_s'] * 1e3:.3f} | "
                         f"{r['max_s'] * 1e3:.3f} | {r['lookups']} | {r['write_gbps']:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
