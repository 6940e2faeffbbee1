"""What a burst of arrivals costs the step it arrives in: many requests at once, beside decoding sequences, with a
CPU, a disk and a remote tier (a Valkey server on a loopback port).

The step that a burst arrives in looks every new request up in every tier, to order them, and then admits as
many as the step can take, each looked up again for its admission. A remote tier's lookup is a round trip; made
one request at a time, they add up on the path of the step, and every decoding sequence waits for them. The model
is replaced by fixed logits (benchmarks/engine_host.py's engine), so that the step's host work is what is timed.

Figures per burst size: the step that the burst arrives in, the longest step after it until every request of the
burst has its first token (the decoding sequences' longest gap meanwhile), and the median decode step before it
(ms); median of `--bursts` bursts, best of `--repeats` runs of each side, this commit's engine and `--baseline`'s in
turn.

    python benchmarks/burst_lookup.py --baseline REV --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable, after
    sys.path.append(str(REPO_ROOT))  # PYTHONPATH, where a baseline's `kvstrata` comes first (see --baseline)

from benchmarks.engine_host import (VOCAB, Case, add_requests, build_engine, in_turn_parser,  # noqa: E402
                                    runs_in_turn)
from benchmarks.machine import provenance_lines, publish, results_record  # noqa: E402

BURSTS = (4, 16, 64)          # requests arriving at once
PROMPT_TOKENS = 2000          # each burst request's prompt: 125 blocks, found in no tier
DECODING = Case(4, 64, 400, 0.0)  # the sequences decoding while a burst arrives
FIGURES = ("arrival_s", "after_s", "decode_s")


def add_burst(engine, size: int, tag: str) -> list[str]:
    from kvstrata.engine.sampling import SamplingParams

    ids = [f"{tag}-{i}" for i in range(size)]
    for i, request_id in enumerate(ids):  # salted by the tag: what an earlier burst computed is no hit
        engine.add_request(request_id, [100 + (i * 104729 + j * 13) % (VOCAB - 100) for j in range(PROMPT_TOKENS)],
                           SamplingParams(max_tokens=1), cache_salt=tag)
    return ids


def timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def one_burst(engine, size: int, tag: str) -> tuple[float, float, float]:
    """(the step the burst arrives in, the longest step after it until every request of the burst has its first
    token, the median decode step before it), in seconds."""
    decoding = add_requests(engine, DECODING, f"{tag}-decoding")
    while not all(engine.requests[r].output_token_ids for r in decoding):
        engine.step()
    before = statistics.median(timed_step(engine) for _ in range(10))
    burst = add_burst(engine, size, tag)
    arrival = timed_step(engine)
    after = 0.0
    while not all(engine.requests[r].output_token_ids for r in burst):
        after = max(after, timed_step(engine))
    for request_id in decoding:  # let the decoding ones go: the burst is served to its end
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in decoding + burst:
        engine.release(request_id)
    return arrival, after, before


def worker(arg: str) -> dict:
    import torch

    import kvstrata.engine

    from tests.valkey_server import ValkeyServer

    bursts = json.loads(arg)["bursts"]
    torch.set_num_threads(1)
    figures = []
    with tempfile.TemporaryDirectory() as work_dir, ValkeyServer() as server:
        cache = {"tiers": {"cpu": {"size": "256MiB"}, "disk": {"path": str(Path(work_dir) / "disk"), "size": "1GiB"},
                           "remote": {"url": server.url}}}
        engine = build_engine(Path(work_dir), cache=cache)
        one_burst(engine, 4, "warm-up")
        for size in BURSTS:
            runs = [one_burst(engine, size, f"burst{size}-{k}") for k in range(bursts)]
            figures.append({"size": size, "arrival_s": statistics.median(a for a, _, _ in runs),
                            "after_s": statistics.median(m for _, m, _ in runs),
                            "decode_s": statistics.median(d for _, _, d in runs)})
        engine.close()
    return {"engine_code": str(Path(kvstrata.engine.__file__).parent), "figures": figures}


def main() -> int:
    parser = in_turn_parser(__doc__, "burst_lookup")
    parser.add_argument("--bursts", type=int, default=5, help="bursts of each size per run; the median counts")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    measured_runs = runs_in_turn(__file__, json.dumps({"bursts": args.bursts}), args, lambda measured: ", ".join(
        f"{f['size']}: {f['arrival_s'] * 1e3:.1f} / {f['after_s'] * 1e3:.1f} ms" for f in measured["figures"]))
    runs = {side: [measured["figures"] for measured in side_runs] for side, side_runs in measured_runs.items()}
    best = {side: [{"size": size, **{figure: min(run[k][figure] for run in side_runs) for figure in FIGURES}}
                   for k, size in enumerate(BURSTS)] for side, side_runs in runs.items()}
    result = results_record("burst_lookup", baseline=args.baseline, repeats=args.repeats, bursts=args.bursts,
                            sides=best, runs=runs)
    publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline, sides = result["baseline"], result["sides"]
    lines = ["# A burst of arrivals: the steps it costs the decoding sequences", "", *provenance_lines(result), "",
             f"Bursts of requests ({PROMPT_TOKENS}-token prompts, found in no tier) arriving at once while "
             f"{DECODING.num_seqs} sequences decode, with a CPU, a disk and a remote tier (valkey-server on a loopback "
             "port); the model replaced by fixed logits (benchmarks/engine_host.py's engine, one torch thread). The "
             "step the burst arrives in, the longest step after it until every request of the burst has its first "
             f"token, and the median decode step before it; median of {result['bursts']} bursts, best of "
             f"{result['repeats']} runs of each side" + (f", this commit and {baseline} in turn." if baseline else "."),
             ""]
    names = ["this commit"] + ([baseline] if baseline else [])
    keys = ["this"] + (["baseline"] if baseline else [])
    lines.append("| burst | " + " | ".join(f"{n}: arrival step ms | longest after ms | decode step ms" for n in names)
                 + (f" | arrival, {baseline} / this | longest after, {baseline} / this |" if baseline else " |"))
    lines.append("|---:|" + "---:|---:|---:|" * len(names) + ("---:|---:|" if baseline else ""))
    for k, size in enumerate(BURSTS):
        row = [sides[key][k] for key in keys]
        cells = " | ".join(f"{f['arrival_s'] * 1e3:.1f} | {f['after_s'] * 1e3:.1f} | {f['decode_s'] * 1e3:.2f}"
                           for f in row)
        ratios = " |"
        if baseline:
            ratios = (f" | {row[1]['arrival_s'] / row[0]['arrival_s']:.2f}x"
                      f" | {row[1]['after_s'] / row[0]['after_s']:.2f}x |")
        lines.append(f"| {size} | {cells}{ratios}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
