"""Chain-hashing speed: ns per token for kvstrata's block hashes against a vLLM-style baseline.

Measured in one run, on the same token lists (random ids below the SmolLM2 vocabulary size), block
size 16, full chains from the namespace seed:

- ours, xxh3_128 and sha256: `block_hashes(list_of_ints, ...)`, the call the engine makes (the
  list -> bytes conversion is included); xxh3_128 also from a numpy uint32 array;
- baseline: what vLLM's sha256_cbor hashing does per block,
  `sha256(cbor2.dumps((parent, tuple(tokens), extra_keys))).digest()`, in a Python loop.

Each figure is the best of `--repeats` timed repeats (each repeat runs the call enough times to
last >= 20 ms of CPU); the medians are in the JSON. Time is the process's CPU time
(`time.process_time_ns`), not wall-clock: the code is single-threaded, and CPU time does not count
the time other processes on a busy machine hold the core. Run:

    python benchmarks/tiers.py hashing            # prints the table, writes benchmarks/results/hashing.{md,json}
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import cbor2
import numpy as np
import xxhash

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib.machine import machine_line  # noqa: E402
from kvstrata.engine.hashing import block_hashes, make_namespace  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

BLOCK_SIZE = 16
INPUT_LENGTHS = (2048, 8192, 32768)
VOCAB_SIZE = 49152
GOAL_NS_PER_TOKEN = 25.0
GOAL_SPEEDUP = 5.0
RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


@dataclass
class Row:
    num_tokens: int
    xxh3_ns: float             # ours, xxh3_128, list input
    xxh3_numpy_ns: float       # ours, xxh3_128, numpy uint32 input
    sha256_ns: float           # ours, sha256, list input
    baseline_ns: float         # vLLM-style sha256 over cbor2((parent, tuple(tokens), extra))
    xxh3_median_ns: float
    sha256_median_ns: float
    baseline_median_ns: float
    xxh3_wall_ns: float        # best wall-clock, for reference (inflated when the machine is busy)
    baseline_wall_ns: float

    @property
    def speedup_xxh3(self) -> float:
        return self.baseline_ns / self.xxh3_ns

    @property
    def speedup_sha256(self) -> float:
        return self.baseline_ns / self.sha256_ns


def vllm_style_block_hashes(token_ids: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """The baseline: one CBOR serialisation of (parent, tokens tuple, extra keys) per block, then sha256."""
    hashes = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(token_ids[start:start + block_size]), None))).digest()
        hashes.append(parent)
    return hashes


@dataclass
class Timing:
    cpu_ns: list[float]   # per-call process CPU time, one sample per repeat
    wall_ns: list[float]  # per-call wall-clock time of the same repeats


def time_per_call_ns(fn: Callable[[], object], repeats: int) -> Timing:
    """Per-call times (ns) of `repeats` repeats, each long enough (>= 20 ms CPU) to be above clock noise."""
    loops = 1
    while True:
        start = time.process_time_ns()
        for _ in range(loops):
            fn()
        if time.process_time_ns() - start >= 20_000_000:
            break
        loops *= 2
    timing = Timing([], [])
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time_ns(), time.perf_counter_ns()
        for _ in range(loops):
            fn()
        timing.cpu_ns.append((time.process_time_ns() - cpu_start) / loops)
        timing.wall_ns.append((time.perf_counter_ns() - wall_start) / loops)
    return timing


def measure(num_tokens: int, repeats: int, rng: random.Random) -> Row:
    tokens = [rng.randrange(VOCAB_SIZE) for _ in range(num_tokens)]
    tokens_np = np.asarray(tokens, dtype="<u4")
    ns_xxh3 = make_namespace("bench-model", "bfloat16", BLOCK_SIZE, 1, "xxh3_128")
    ns_sha = make_namespace("bench-model", "bfloat16", BLOCK_SIZE, 1, "sha256")
    seed = hashlib.sha256(ns_sha).digest()

    def ours(token_ids, namespace, algo):
        return lambda: block_hashes(token_ids, block_size=BLOCK_SIZE, namespace=namespace, algo=algo)

    num_blocks = num_tokens // BLOCK_SIZE
    assert len(ours(tokens, ns_xxh3, "xxh3_128")()) == num_blocks
    assert len(vllm_style_block_hashes(tokens, BLOCK_SIZE, seed)) == num_blocks

    xxh3 = time_per_call_ns(ours(tokens, ns_xxh3, "xxh3_128"), repeats)
    xxh3_np = time_per_call_ns(ours(tokens_np, ns_xxh3, "xxh3_128"), repeats)
    sha = time_per_call_ns(ours(tokens, ns_sha, "sha256"), repeats)
    baseline = time_per_call_ns(lambda: vllm_style_block_hashes(tokens, BLOCK_SIZE, seed), repeats)
    best = lambda samples: min(samples) / num_tokens
    median = lambda samples: statistics.median(samples) / num_tokens
    return Row(num_tokens, best(xxh3.cpu_ns), best(xxh3_np.cpu_ns), best(sha.cpu_ns), best(baseline.cpu_ns),
               median(xxh3.cpu_ns), median(sha.cpu_ns), median(baseline.cpu_ns),
               best(xxh3.wall_ns), best(baseline.wall_ns))


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| tokens | ours xxh3_128 (list) | ours xxh3_128 (numpy) | ours sha256 (list) | baseline sha256+cbor2 "
        "| baseline / ours xxh3_128 | baseline / ours sha256 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.num_tokens} | {r.xxh3_ns:.1f} | {r.xxh3_numpy_ns:.1f} | {r.sha256_ns:.1f} "
                     f"| {r.baseline_ns:.1f} | {r.speedup_xxh3:.1f}x | {r.speedup_sha256:.1f}x |")
    return "\n".join(lines)


def goal_lines(rows: list[Row]) -> list[str]:
    worst_ns = max(r.xxh3_ns for r in rows)
    worst_speedup = min(r.speedup_xxh3 for r in rows)
    verdict = lambda ok: "met" if ok else "NOT met"
    return [
        f"- xxh3_128 <= {GOAL_NS_PER_TOKEN:.0f} ns/token (list input, every size): worst {worst_ns:.1f} ns/token, "
        f"{verdict(worst_ns <= GOAL_NS_PER_TOKEN)}.",
        f"- xxh3_128 >= {GOAL_SPEEDUP:.0f}x faster than the baseline (every size): worst {worst_speedup:.1f}x, "
        f"{verdict(worst_speedup >= GOAL_SPEEDUP)}.",
    ]


def write_results(rows: list[Row], command: str, machine: str, repeats: int, load_average: str,
                  out_dir: str) -> None:
    report = "\n".join([
        "# Chain hashing: ns per token",
        "",
        f"Block size {BLOCK_SIZE}, random token ids below {VOCAB_SIZE}, whole chains from the namespace seed. "
        f"Figures are ns/token of process CPU time, best of {repeats} repeats (medians in `hashing.json`). "
        "\"ours\" is `kvstrata.engine.hashing.block_hashes`, list -> bytes conversion included; "
        "the baseline is vLLM-style `sha256(cbor2.dumps((parent, tuple(tokens), None)))` per block.",
        "",
        markdown_table(rows),
        "",
        "Goals:",
        "",
        *goal_lines(rows),
        "",
        f"Load average (1, 5, 15 min) at the end of the run: {load_average}. Best wall-clock figures are "
        "in `hashing.json` (`*_wall_ns`).",
        "",
    ])
    payload = {
        "benchmark": "hashing",
        "block_size": BLOCK_SIZE,
        "repeats": repeats,
        "unit": "ns/token",
        "command": command,
        "machine": machine,
        "load_average": load_average,
        "rows": [asdict(r) | {"speedup_xxh3": r.speedup_xxh3, "speedup_sha256": r.speedup_sha256} for r in rows],
    }
    results.write(out_dir, payload, report)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.repeats(parser, 15, help="timed repeats per figure (the best is reported)")
    options.out(parser, default=RESULTS_DIR, help="folder for hashing.md and hashing.json")
    options.seed(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    rng = random.Random(args.seed)
    rows = [measure(n, args.repeats, rng) for n in INPUT_LENGTHS]
    command = "python benchmarks/tiers.py hashing" + ("" if argv is None and len(sys.argv) == 1 else
                                                " " + " ".join(sys.argv[1:] if argv is None else argv))
    machine = machine_line(xxhash=xxhash.VERSION, cbor2=importlib.metadata.version("cbor2"), numpy=np.__version__)
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(markdown_table(rows))
    print()
    print("\n".join(goal_lines(rows)))
    print(f"\nMachine: {machine}")
    print(f"Load average: {load_average}")
    write_results(rows, command, machine, args.repeats, load_average, args.out)
    return 0
