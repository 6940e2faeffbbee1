"""The compiled CPU linear layer (kernels/cpu_linear.py) against `F.linear` (MKL here) and the invariant torch
reference (`reference_linear`, the batch-invariant mode's products before it), on the CPU decoder's stored layout
(weights `[in, out]`, passed as their transposed view), for the embedded model's five products at the row counts
of a decode (1), a short question (4-16) and prefill chunks (64-2048).

    python benchmarks/kernels.py cpu-linear --threads 1 --dtypes float32 bfloat16 --out benchmarks/results/cpu_linear.md

Each figure is the best of `--repeats` timings by process CPU time (a shared machine slows a run, never speeds
it), the three sides timed in turn, shape by shape, so that load drifts over all alike. One call's Python overhead
is timed too, on a product too small to matter (1 x 8 x 8).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import machine_line
from kvstrata.kernels import cpu_linear
from kvstrata.kernels.batch_invariant import reference_linear

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152)]  # SmolLM2-135M: (name, K = in, N = out)
ROWS = [1, 4, 10, 16, 64, 256, 2048]
SIDES = {"F.linear": F.linear, "cpu_linear": cpu_linear.linear, "reference_linear": reference_linear}


def best_cpu_time(fn, repeats: int, calls: int) -> float:
    """The least process CPU time of `calls` calls, over `repeats` tries, per call (one untimed call first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best


def measure(dtype: torch.dtype, threads: int, repeats: int, max_flops: float) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, K, N in SHAPES:
        weight = (torch.randn(K, N, generator=gen) / K ** 0.5).to(dtype).t()  # stored [in, out]
        for M in ROWS:
            if 2 * M * K * N > max_flops:
                continue
            x = torch.randn(M, K, generator=gen).to(dtype)
            calls = max(1, int(2e7 / (2 * M * K * N)))  # ~10 ms of work a try
            times = {side: best_cpu_time(lambda fn=fn: fn(x, weight), repeats, calls) for side, fn in SIDES.items()}
            rows.append({"shape": name, "K": K, "N": N, "M": M, **times})
            print(f"{dtype} {threads}t {name:8s} M={M:5d} " + "  ".join(f"{s} {t * 1e3:8.3f} ms" for s, t in
                                                                      times.items()), flush=True)
    return rows


def overhead_us(threads: int) -> dict:
    torch.set_num_threads(threads)
    x, weight = torch.randn(1, 8), torch.randn(8, 8).t()
    return {side: 1e6 * best_cpu_time(lambda fn=fn: fn(x, weight), 5, 20000) for side, fn in SIDES.items()}


def report(results: dict, overhead: dict, argv: str) -> str:
    lines = ["# The compiled CPU linear layer against F.linear", "",
             f"`{argv}`", "", machine_line(), "",
             "Best of the repeats by process CPU time per call, the sides timed in turn shape by shape; weights "
             "stored `[in, out]` as the CPU decoder keeps them. `reference_linear` is the invariant mode's product "
             "before this kernel (float32 on AVX2: MKL with the rows padded to a multiple of 4). Ratios: "
             "cpu_linear's time over the other's (< 1: cpu_linear is faster).", "",
             "One call's Python cost, a 1 x 8 x 8 product: " + ", ".join(f"{s} {t:.1f} us" for s, t in
                                                                         overhead.items()), ""]
    for (dtype, threads), rows in results.items():
        lines += [f"## {dtype}, {threads} thread(s)", "",
                  "| product | K -> N | M | F.linear ms | cpu_linear ms | reference_linear ms | vs F.linear | "
                  "vs reference_linear | cpu_linear GFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            flops = 2 * r["M"] * r["K"] * r["N"]
            lines.append(f"| {r['shape']} | {r['K']} -> {r['N']} | {r['M']} | {r['F.linear'] * 1e3:.3f} | "
                         f"{r['cpu_linear'] * 1e3:.3f} | {r['reference_linear'] * 1e3:.3f} | "
                         f"{r['cpu_linear'] / r['F.linear']:.2f} | {r['cpu_linear'] / r['reference_linear']:.2f} | "
                         f"{flops / r['cpu_linear'] / 1e9:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernels.py cpu-linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-gflop", type=float, default=60.0, help="skip products of more work than this")
    parser.add_argument("--max-gflop-bfloat16", type=float, default=1.0,
                        help="the same for bfloat16, whose F.linear has no fast kernel on AVX2 (~1 GFLOP/s)")
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    if not cpu_linear.available():
        raise SystemExit("cpu-linear: the CPU linear kernel cannot be built here (no C compiler)")
    results = {(dtype, threads): measure(getattr(torch, dtype), threads, args.repeats,
                                         (args.max_gflop_bfloat16 if dtype == "bfloat16" else args.max_gflop) * 1e9)
               for threads in args.threads for dtype in args.dtypes}
    text = report(results, overhead_us(1), "python benchmarks/kernels.py cpu-linear " + " ".join(argv or []))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
