"""The compiled CPU linear layer (kernels/cpu_linear.py) against `F.linear` (MKL here) and the invariant torch
reference (`reference_linear`, the batch-invariant mode's products before it), on the CPU decoder's stored layout
(weights `[in, out]`, passed as their transposed view), for the embedded model's five products at the row counts
of a decode (1), a short question (4-16) and prefill chunks (64-2048).

    python benchmarks/kernels.py cpu-linear --threads 1 --dtypes float32 bfloat16 --out benchmarks/results/cpu_linear.md

    python benchmarks/kernels.py cpu-linear --baseline-kernel ../other/kernels/cpu_linear.c --rows 1 4 10 16 17 64 \
        --shapes qkv o gate_up down   # another checkout's kernel beside this one, and a cache hit's products

With `--baseline-kernel`, the sides are this checkout's kernel and the one built from that source (its directory
holding the headers it includes), every timed product first checked to give the baseline's bits; and a device cache
hit's whole set of products is timed too: `--hit-rows` rows through the model's 30 layers x 4 products, each layer
its own weights, so they come from memory as in the model (14 MB a layer in float32, more than the L3 cache).

Each figure is the best of `--repeats` timings, by process CPU time on one thread (a shared machine slows a run,
never speeds it) and by the wall clock on several (`benchmarks/lib/cpu_timing.py`), the sides taking turns within
every round of every shape, so that load drifts over all alike. One call's Python overhead is timed too, on a
product too small to matter (1 x 8 x 8).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib.cpu_timing import best_cpu_times, clock_for
from benchmarks.lib.kernel_builds import wrapper_over
from benchmarks.lib.machine import machine_line
from kvstrata.kernels import cpu_linear
from kvstrata.kernels.batch_invariant import reference_linear
from benchmarks.lib import options
from benchmarks.lib import results

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152)]  # SmolLM2-135M: (name, K = in, N = out)
ROWS = [1, 4, 10, 16, 64, 256, 2048]
SIDES = {"F.linear": F.linear, "cpu_linear": cpu_linear.linear, "reference_linear": reference_linear}
LAYERS = 30  # SmolLM2-135M's; a hit's products are SHAPES[:4] once a layer


def kernel_built_from(source: Path):
    """`cpu_linear.linear` computed by the kernel built from `source` (the same C signature)."""
    return wrapper_over(cpu_linear, cpu_linear.linear, source, cpu_linear.declare)


def same_bits(sides: dict, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Time nothing that computes something else: every side gives the first side's bits on this very problem."""
    first, *others = sides.items()
    want = first[1](x, weight)
    for name, fn in others:
        if not torch.equal(fn(x, weight), want):
            raise SystemExit(f"cpu-linear: {name} differs from {first[0]} at {tuple(x.shape)} x {tuple(weight.shape)}")


def measure(dtype: torch.dtype, threads: int, repeats: int, max_flops: float, sides: dict, shapes: list,
            row_counts: list[int]) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, K, N in shapes:
        weight = (torch.randn(K, N, generator=gen) / K ** 0.5).to(dtype).t()  # stored [in, out]
        for M in row_counts:
            if 2 * M * K * N > max_flops:
                continue
            x = torch.randn(M, K, generator=gen).to(dtype)
            if "baseline" in sides:
                same_bits(sides, x, weight)
            calls = max(1, int(2e7 / (2 * M * K * N)))  # ~10 ms of work a try
            times = best_cpu_times({side: lambda fn=fn: fn(x, weight) for side, fn in sides.items()}, repeats, calls,
                                   clock_for(threads))
            rows.append({"shape": name, "K": K, "N": N, "M": M, **times})
            print(f"{dtype} {threads}t {name:8s} M={M:5d} " + "  ".join(f"{s} {t * 1e3:8.3f} ms" for s, t in
                                                                      times.items()), flush=True)
    return rows


def overhead_us(threads: int, sides: dict) -> dict:
    torch.set_num_threads(threads)
    x, weight = torch.randn(1, 8), torch.randn(8, 8).t()
    times = best_cpu_times({side: lambda fn=fn: fn(x, weight) for side, fn in sides.items()}, 5, 20000)
    return {side: 1e6 * t for side, t in times.items()}


def measure_hit(dtype: torch.dtype, M: int, repeats: int, sides: dict) -> dict:
    """One thread's time for a cache hit's products: M rows through LAYERS layers of SHAPES[:4], each layer its own
    weights (so read from memory, not cache), best of `repeats` by process CPU time, the sides in turn."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    layers = [[(torch.randn(M, K, generator=gen).to(dtype), (torch.randn(K, N, generator=gen) / K ** 0.5).to(dtype).t())
               for _, K, N in SHAPES[:4]] for _ in range(LAYERS)]
    for x, weight in layers[0]:
        same_bits(sides, x, weight)

    def hit(fn) -> None:
        for layer in layers:
            for x, weight in layer:
                fn(x, weight)
    times = best_cpu_times({side: lambda fn=fn: hit(fn) for side, fn in sides.items()}, repeats, 1)
    flops = LAYERS * sum(2 * M * K * N for _, K, N in SHAPES[:4])
    print(f"{dtype} hit M={M} " + "  ".join(f"{s} {t * 1e3:8.1f} ms" for s, t in times.items()), flush=True)
    return {"dtype": str(dtype).removeprefix("torch."), "M": M, "flops": flops, **times}


TIMED_BY = "one thread by process CPU time, several by the wall clock"


def baseline_report(results: dict, hits: list[dict], overhead: dict, argv: str) -> str:
    lines = ["## This kernel against a baseline build of another source", "",
             f"`{argv}`", "", machine_line(), "",
             f"Best of the repeats per call, {TIMED_BY}, the two kernels taking turns within every round, each "
             "timed product first checked to give the baseline's bits. Speedup: baseline's time over this "
             "kernel's (> 1: this kernel is faster).", "",
             "One call's Python cost, a 1 x 8 x 8 product: " + ", ".join(f"{s} {t:.1f} us" for s, t in
                                                                         overhead.items()), "",
             f"A cache hit's products ({LAYERS} layers x qkv, o, gate_up, down, each layer its own weights, one "
             "thread):", "", "| dtype | M | baseline ms | cpu_linear ms | speedup | baseline GFLOP/s | "
             "cpu_linear GFLOP/s |", "|---|---|---|---|---|---|---|"]
    for h in hits:
        lines.append(f"| {h['dtype']} | {h['M']} | {h['baseline'] * 1e3:.1f} | {h['cpu_linear'] * 1e3:.1f} | "
                     f"{h['baseline'] / h['cpu_linear']:.2f} | {h['flops'] / h['baseline'] / 1e9:.1f} | "
                     f"{h['flops'] / h['cpu_linear'] / 1e9:.1f} |")
    lines.append("")
    for (dtype, threads), rows in results.items():
        lines += [f"### {dtype}, {threads} thread(s), one weight per product (in cache when it fits)", "",
                  "| product | K -> N | M | baseline ms | cpu_linear ms | speedup | baseline GFLOP/s | "
                  "cpu_linear GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            flops = 2 * r["M"] * r["K"] * r["N"]
            lines.append(f"| {r['shape']} | {r['K']} -> {r['N']} | {r['M']} | {r['baseline'] * 1e3:.3f} | "
                         f"{r['cpu_linear'] * 1e3:.3f} | {r['baseline'] / r['cpu_linear']:.2f} | "
                         f"{flops / r['baseline'] / 1e9:.1f} | {flops / r['cpu_linear'] / 1e9:.1f} |")
        lines.append("")
    return "\n".join(lines)


def report(results: dict, overhead: dict, argv: str) -> str:
    lines = ["# The compiled CPU linear layer against F.linear", "",
             f"`{argv}`", "", machine_line(), "",
             f"Best of the repeats per call, {TIMED_BY}, the sides taking turns within every round; weights "
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
    parser = options.parser(__doc__, prog="kernels.py cpu-linear")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    options.threads(parser, [1], many=True)
    options.repeats(parser, 5)
    parser.add_argument("--max-gflop", type=float, default=60.0, help="skip products of more work than this")
    parser.add_argument("--max-gflop-bfloat16", type=float, default=1.0,
                        help="the same for bfloat16, whose F.linear has no fast kernel on AVX2 (~1 GFLOP/s)")
    parser.add_argument("--rows", nargs="+", type=int, default=ROWS, help="row counts (M) to time")
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    parser.add_argument("--baseline-kernel", type=Path,
                        help="another source of kernels/cpu_linear.c (e.g. main's checkout): time it beside this one "
                             "instead of F.linear and reference_linear, plus a cache hit's products")
    parser.add_argument("--hit-rows", nargs="+", type=int, default=[10], help="rows of the timed cache hits")
    options.out(parser, help="write the markdown report here")
    args = parser.parse_args(argv)
    if not cpu_linear.available():
        raise SystemExit("cpu-linear: the CPU linear kernel cannot be built here (no C compiler)")
    sides = SIDES
    if args.baseline_kernel:
        if not args.baseline_kernel.is_file():
            raise SystemExit(f"cpu-linear: no kernel source at {args.baseline_kernel}")
        sides = {"cpu_linear": cpu_linear.linear, "baseline": kernel_built_from(args.baseline_kernel)}
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    measured = {(dtype, threads): measure(getattr(torch, dtype), threads, args.repeats,
                                         (args.max_gflop_bfloat16 if dtype == "bfloat16" else args.max_gflop) * 1e9,
                                         sides, shapes, args.rows)
               for threads in args.threads for dtype in args.dtypes}
    command = "python benchmarks/kernels.py cpu-linear " + " ".join(argv or [])
    hits = []
    if args.baseline_kernel:
        hits = [measure_hit(getattr(torch, dtype), M, args.repeats, sides) for dtype in args.dtypes
                for M in args.hit_rows]
        text = baseline_report(measured, hits, overhead_us(1, sides), command)
    else:
        text = report(measured, overhead_us(1, sides), command)
    out = Path(args.out) if args.out else None
    # the figures as the tables give them, seconds a call per side
    products = [{"dtype": dtype, "threads": threads, **row} for (dtype, threads), rows in measured.items()
                for row in rows]
    result = results.record(out.stem if out else "cpu_linear", dtypes=args.dtypes, threads=args.threads,
                            repeats=args.repeats, seconds_per_call=products, hits=hits)
    results.publish(result, text + "\n", out and out.parent, out and out.stem)
    return 0
