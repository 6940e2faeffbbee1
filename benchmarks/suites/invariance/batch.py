"""Where and how often caching changes bfloat16 outputs, and what `model.batch_invariant` costs (CPU, torch path).

    python benchmarks/invariance.py batch ops         # which ops give a row other bits when the call's shape changes
    python benchmarks/invariance.py batch trace       # the first op whose bits differ, prompt whole vs. cut in two
    python benchmarks/invariance.py batch tiles       # the invariant linear's cost by rows per tile (its table)
    python benchmarks/invariance.py batch cost        # prefill TTFT and decode step time, both modes (--backend)

Results and their reading: benchmarks/results/batch_invariance.md. How often greedy answers differ cached vs.
uncached is benchmarks/suites/invariance/cache.py's measure (with `--set model.batch_invariant=true` for the mode). The
prompts here are the Python reference manual's topics (shipped with Python: `pydoc_data.topics`).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvstrata import LLM, SamplingParams, load_config  # noqa: E402
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model  # noqa: E402
from kvstrata.engine.model_runner import ModelRunner, StepInput  # noqa: E402
from kvstrata.kernels.backends import get_ops, resolve_backend  # noqa: E402
from kvstrata.kernels.batch_invariant import cpu_matrix_isa, linear_tile_rows, reference_linear  # noqa: E402
from kvstrata.tiers.base import BlockLayout  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

BLOCK_SIZE = 16


def document(topic: str, chars: int) -> str:
    from pydoc_data.topics import topics
    return topics[topic][:chars]


# ---------------------------------------------------------------------------------------------------------------
# ops: does one op give a row the same bits whatever else shares the call? (random inputs, SmolLM2's shapes)

def ops(args) -> None:
    import torch.nn.functional as F
    from kvstrata.kernels.prefix_prefill import prefill_attention

    gen = torch.Generator().manual_seed(0)
    print("| op | dtype | rows whose bits change with the call's shape |")
    print("|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(300, 576, generator=gen).to(dtype)
        weight = (torch.randn(1536, 576, generator=gen) / 24).to(dtype)
        whole = F.linear(x, weight)
        changed = [m for m in (1, 2, 3, 4, 8, 16, 64, 255) if not torch.equal(F.linear(x[5:5 + m], weight),
                                                                                whole[5:5 + m])]
        print(f"| F.linear [M, 576] x [576, 1536], M rows of 300 | {dtype} | M in {changed or 'none'} |")
        whole = reference_linear(x, weight)
        changed = [m for m in (1, 2, 3, 4, 8, 16, 64, 255) if not torch.equal(reference_linear(x[5:5 + m], weight),
                                                                                whole[5:5 + m])]
        print(f"| invariant linear ({linear_tile_rows(dtype)}-row tiles), same shapes | {dtype} | "
              f"M in {changed or 'none'} |")
        squares = x.float().pow(2)
        changed = [m for m in (1, 2, 7, 64) if not torch.equal(squares[5:5 + m].mean(-1), squares.mean(-1)[5:5 + m])]
        print(f"| RMSNorm's mean over 576 | {dtype} | M in {changed or 'none'} |")
        q, k, v = (torch.randn(9 if i == 0 else 3, 200, 64, generator=gen).to(dtype) for i in range(3))
        whole = prefill_attention(q.transpose(0, 1), k, v, 0.125)
        changed = [n for n in (32, 96, 160, 192) if not torch.equal(
            prefill_attention(q[:, :n].transpose(0, 1), k[:, :n], v[:, :n], 0.125), whole[:n])]
        print(f"| attention (SDPA is_causal) of a prompt's first n rows, alone vs. in 200 | {dtype} | "
              f"n in {changed or 'none'} |")
        changed = [c for c in (96, 112, 160, 192) if not torch.equal(
            prefill_attention(q[:, c:].transpose(0, 1), k, v, 0.125), whole[c:])]
        print(f"| attention of rows c.. after a cached prefix of c (padded or masked SDPA) vs. whole | {dtype} | "
              f"c in {changed or 'none'} |")


# ---------------------------------------------------------------------------------------------------------------
# tiles: what the invariant linear costs against F.linear for each rows-per-tile, a decode row and a prefill.

def tiles(args) -> None:
    import torch.nn.functional as F

    print(f"CPU: {cpu_matrix_isa()} (torch capability {torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} thread(s); [M, 576] x [576, 1536], median of {args.repeats}\n")
    print("| dtype | rows per tile | 1 row | 1 row vs F.linear | 512 rows | 512 rows vs F.linear | chosen |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(512, 576, generator=gen).to(dtype)
        weight = (torch.randn(1536, 576, generator=gen) / 24).to(dtype)
        base = [_median_s(lambda m=m: F.linear(x[:m], weight), args.repeats) for m in (1, 512)]
        for tile in (1, 4, 8, 16, 32, 64):
            t = [_median_s(lambda m=m: reference_linear(x[:m], weight, tile_rows=tile), args.repeats) for m in (1, 512)]
            print(f"| {dtype} | {tile} | {t[0] * 1e3:.3f} ms | {t[0] / base[0]:.2f}x | {t[1] * 1e3:.1f} ms | "
                  f"{t[1] / base[1]:.2f}x | {'yes' if tile == linear_tile_rows(dtype) else ''} |")


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# trace: run one prompt whole, and as a prefix step then a suffix step; name the first op whose rows differ.

class Recorder:
    """Records, in forward order, the output of every op the decoder calls (engine/decoder.py runs the layers through
    its kernel ops, never through the model's modules): each named by the op and its call's number in the step, the
    K/V, q and attention by their layer."""

    def __init__(self, ops):
        self.records: list[tuple[str, torch.Tensor]] = []
        self.calls: dict[str, int] = {}
        linear = ops.model_linear or torch.nn.functional.linear
        self.ops = dataclasses.replace(
            ops, store_kv=self._store_kv(ops.store_kv), prefix_prefill=self._prefill(ops.prefix_prefill),
            rms_norm=self._numbered("rms_norm", ops.rms_norm), rotary=self._numbered("rotary", ops.rotary),
            silu_and_mul=self._numbered("silu_and_mul", ops.silu_and_mul),
            model_linear=self._numbered("linear", linear))

    def clear(self) -> None:
        self.records.clear()
        self.calls.clear()

    def _record(self, name, tensor):
        tensor = tensor[0] if isinstance(tensor, tuple) else tensor  # rms_norm's (out, residual): its out
        self.records.append((name, tensor.detach().reshape(tensor.shape[0], -1).clone()))  # a row per token

    def _numbered(self, op, run):
        def recording(*args, **kwargs):
            out = run(*args, **kwargs)
            self.calls[op] = self.calls.get(op, 0) + 1
            self._record(f"{op} #{self.calls[op]}", out)
            return out
        return recording

    def _store_kv(self, store_kv):
        def recording(key, value, kv_cache, layer, slot_mapping):
            self._record(f"L{layer}.k (after RoPE)", key.flatten(1))
            self._record(f"L{layer}.v", value.flatten(1))
            return store_kv(key, value, kv_cache, layer, slot_mapping)
        return recording

    def _prefill(self, prefix_prefill):
        def recording(query, *args, **kwargs):
            self._record(f"L{int(args[1])}.q (after RoPE)", query.flatten(1))
            out = prefix_prefill(query, *args, **kwargs)
            self._record(f"L{int(args[1])}.attention", out.flatten(1))
            return out
        return recording


def run_steps(loaded, recorder, tokens, cuts):
    """Prefill `tokens` in steps ending at `cuts`; returns each step's records and the last step's logits."""
    layout = BlockLayout(loaded.model_config.num_layers, BLOCK_SIZE, loaded.model_config.num_kv_heads,
                         loaded.model_config.head_dim, loaded.dtype)
    runner = ModelRunner(loaded, layout.allocate(-(-len(tokens) // BLOCK_SIZE), "cpu"), recorder.ops)
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    steps, start, logits = [], 0, None
    for end in cuts:
        recorder.clear()
        pos = list(range(start, end))
        logits = runner.execute(StepInput(tokens[start:end], pos, [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                                                    for p in pos], [table], [0, end - start], [end],
                                          [end - start - 1]))
        steps.append(list(recorder.records))
        start = end
    return steps, logits


def first_difference(reference, records, rows: slice) -> str:
    """The first op whose rows for the step's tokens differ from the same rows of the whole prompt's (the product
    for the sampled row only, a row per step rather than per token, is left to the logits' column)."""
    tokens = reference[0][1].shape[0]  # the whole prompt's: its first op (a norm) has a row per token
    for (name, ref), (_, got) in zip(reference, records, strict=True):
        if ref.shape[0] != tokens:
            continue
        if not torch.equal(ref[rows], got):
            diff = (ref[rows].float() - got.float()).abs()
            return f"{name} ({int((diff > 0).sum())} values, max {float(diff.max()):.2g})"
    return "none"


def trace(args) -> None:
    loaded = load_model(resolve_model(EMBEDDED_MODEL), torch.bfloat16, "cpu")
    tokens = loaded.tokenizer.encode(document("execmodel", 4000))[:args.length]
    print(f"prompt of {len(tokens)} tokens, bfloat16, {args.backend} backend; cut = the cached prefix's length\n")
    print("| mode | cut | prefix step vs. same rows of the whole | suffix step vs. same rows of the whole | "
          "last logits equal |")
    print("|---|---|---|---|---|")
    for invariant in (False, True):
        recorder = Recorder(get_ops(args.backend, batch_invariant=invariant))
        (whole,), whole_logits = run_steps(loaded, recorder, tokens, [len(tokens)])
        for cut in args.cuts:
            (prefix, suffix), logits = run_steps(loaded, recorder, tokens, [cut, len(tokens)])
            print(f"| {'invariant' if invariant else 'default'} | {cut} | "
                  f"{first_difference(whole, prefix, slice(0, cut))} | "
                  f"{first_difference(whole, suffix, slice(cut, len(tokens)))} | "
                  f"{torch.equal(logits, whole_logits)} |")


# ---------------------------------------------------------------------------------------------------------------
# cost: prefill TTFT of a cold prompt and the decode step time after it, both modes, median of repeats.

def cost(args) -> None:
    lines = [f"CPU: {cpu_matrix_isa()} (torch capability {torch.backends.cpu.get_cpu_capability()}), "
             f"{torch.get_num_threads()} thread(s), attention_backend {args.backend} "
             f"({resolve_backend(args.backend, 'cpu')}), median of {args.repeats}", "",
             "| dtype | mode | prefill TTFT | decode step | TTFT ratio | step ratio |", "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    runs = []
    for dtype in args.dtypes:
        loaded = load_model(resolve_model(EMBEDDED_MODEL), getattr(torch, dtype), "cpu")
        tokens = loaded.tokenizer.encode(document("execmodel", 20000))[:args.length]
        rows = [(invariant, *_prefill_and_step(loaded, tokens, dtype, invariant, args)) for invariant in (False, True)]
        base_ttft, base_step = rows[0][1], rows[0][2]
        for invariant, ttft, step in rows:
            lines.append(f"| {dtype} | {'invariant' if invariant else 'default'} | {ttft * 1e3:.0f} ms | "
                         f"{step * 1e3:.1f} ms | {ttft / base_ttft:.2f}x | {step / base_step:.2f}x |")
            print(lines[-1])
        (_, ttft, step) = rows[1]
        runs.append({"dtype": dtype, "prompt_tokens": len(tokens), "default_ttft_s": base_ttft,
                     "default_step_s": base_step, "invariant_ttft_s": ttft, "invariant_step_s": step,
                     "ttft_ratio": ttft / base_ttft, "step_ratio": step / base_step})
    lines += ["", f"prompt of {len(tokens)} tokens, {args.tokens} tokens decoded"]
    print(lines[-1])
    if args.out_dir:
        result = results.record(args.name, cpu_matrix_isa=cpu_matrix_isa(), threads=torch.get_num_threads(),
                                backend=resolve_backend(args.backend, "cpu"), repeats=args.repeats,
                                decode_tokens=args.tokens, runs=runs)
        results.write(args.out_dir, result, ["# The batch-invariant mode's cost", "", *lines])


def _prefill_and_step(loaded, tokens, dtype: str, invariant: bool, args) -> tuple[float, float]:
    """Median TTFT of a cold prompt and median decode step after it."""
    # the engine sets torch's threads from model.threads (`auto`: 1 on two cores): the run's own count, said
    llm = LLM(load_config({"model": {"dtype": dtype, "device": "cpu", "attention_backend": args.backend,
                                     "batch_invariant": invariant, "threads": torch.get_num_threads()},
                           "cache": {"enable_prefix_caching": False}}), loaded_model=loaded)
    ttfts, steps = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = llm.generate(tokens, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))[0]
        total = time.perf_counter() - start
        ttfts.append(out.ttft_s)
        steps.append((total - out.ttft_s) / (args.tokens - 1))
    llm.close()
    return statistics.median(ttfts), statistics.median(steps)


def main(argv=None) -> None:
    parser = options.parser(__doc__)
    options.threads(parser, default=None, help="torch threads (default: torch's)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops")
    options.repeats(sub.add_parser("tiles"), default=7)
    p = sub.add_parser("trace")
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--cuts", type=int, nargs="+", default=[96, 160, 192])
    p.add_argument("--backend", default="torch", choices=["cpu", "torch"],
                   help="the attention kernels traced (cpu: the compiled CPU kernel; torch: the references)")
    p = sub.add_parser("cost")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--tokens", type=int, default=17)
    options.repeats(p, 3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch"],
                   help="model.attention_backend (auto: the compiled CPU kernel where it builds; torch: the references)")
    options.out_dir(p, None, help="where to write the table and its figures (<name>.md, .json); none: printed only")
    options.name(p, "batch_invariance_cost")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"$ python benchmarks/invariance.py batch {' '.join(argv or sys.argv[1:])}\n")
    {"ops": ops, "tiles": tiles, "trace": trace, "cost": cost}[args.command](args)
