"""A decoder layer's per-row ops on a CPU, one call at a time: each torch reference (kernels/layer_ops.py,
kernels/kv_store.py) against its compiled version (kernels/cpu_layer_ops.py), on the embedded model's shapes
(SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536), at a decode row, a 10-token question after a
cached document and a 512-token prefill chunk, in the views the decoder passes (q+k and v strided in the qkv
product). One thread; each figure is the best, over rounds, of a loop's process CPU time per call, the two sides
alternating within each round, so a busy machine slows both alike.

`--steps` also times whole model steps of the embedded model (a decode row and a 10-token question over a
2048-token cached context, float32): the "cpu" backend's ops as they are against the same ops with the torch
references in place of the compiled layer ops (the backend before them), in one process, alternating.

    python benchmarks/kernels.py layer-ops --out-dir benchmarks/results
"""
from __future__ import annotations

import time

import torch

from benchmarks.lib.cpu_timing import best_cpu_times
from benchmarks.lib.machine import provenance_lines
from benchmarks.lib import options
from benchmarks.lib import results

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, BLOCK_SIZE = 576, 9, 3, 64, 1536, 30, 16
TOKENS = {"decode row": 1, "10-token hit": 10, "512-token prefill": 512}
CALLS_PER_STEP = {"rms_norm": 2 * LAYERS + 1, "rotary": LAYERS, "silu_and_mul": LAYERS, "store_kv": LAYERS}


def op_calls(num_tokens: int, dtype: torch.dtype) -> dict[str, tuple]:
    """Each op's (reference call, compiled call) on one step's inputs of `num_tokens` tokens."""
    from kvstrata.kernels import cpu_layer_ops
    from kvstrata.kernels.kv_store import reference_store_kv
    from kvstrata.kernels.layer_ops import reference_rms_norm, reference_rotary, reference_silu_and_mul

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, residual, weight = randn(num_tokens, HIDDEN), randn(num_tokens, HIDDEN), randn(HIDDEN)
    qkv = randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(num_tokens, HEADS + KV_HEADS, HEAD_DIM)
    value = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(num_tokens, KV_HEADS, HEAD_DIM)
    key = qk[:, HEADS:]
    cos, sin = randn(num_tokens, HEAD_DIM), randn(num_tokens, HEAD_DIM)
    gate_up = randn(num_tokens, 2 * MLP)
    num_blocks = 4 + num_tokens // BLOCK_SIZE
    kv_cache = torch.zeros(num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = torch.arange(num_tokens) + 2 * BLOCK_SIZE + 3  # after a cached prefix, not block-aligned
    return {
        "rms_norm": (lambda: reference_rms_norm(x, weight, 1e-5, residual),
                     lambda: cpu_layer_ops.rms_norm(x, weight, 1e-5, residual)),
        "rotary": (lambda: reference_rotary(qk, cos, sin), lambda: cpu_layer_ops.rotary(qk, cos, sin)),
        "silu_and_mul": (lambda: reference_silu_and_mul(gate_up), lambda: cpu_layer_ops.silu_and_mul(gate_up)),
        "store_kv": (lambda: reference_store_kv(key, value, kv_cache, 7, slots),
                     lambda: cpu_layer_ops.store_kv(key, value, kv_cache, 7, slots)),
    }


def per_call_s(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def measure(dtype: torch.dtype, rounds: int, budget_s: float) -> list[dict]:
    rows = []
    for case, num_tokens in TOKENS.items():
        for op, (reference, compiled) in op_calls(num_tokens, dtype).items():
            calls = max(3, min(2000, int(budget_s / max(per_call_s(reference, 3), 1e-6))))
            best = best_cpu_times({"torch": reference, "compiled": compiled}, rounds, calls)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "case": case, "tokens": num_tokens, "op": op,
                         "calls_per_round": calls, "torch_us": best["torch"] * 1e6,
                         "compiled_us": best["compiled"] * 1e6, "speedup": best["torch"] / best["compiled"]})
            print(f"{rows[-1]['dtype']} {case} {op}: torch {rows[-1]['torch_us']:.1f} us, compiled "
                  f"{rows[-1]['compiled_us']:.1f} us ({rows[-1]['speedup']:.1f}x)", flush=True)
    return rows


def measure_steps(rounds: int, context: int = 2048) -> list[dict]:
    """Model steps of the embedded model, float32: the cpu backend's ops against them with the torch layer ops."""
    import dataclasses

    from benchmarks.suites.kernels.decoder_step import Case, step_input
    from kvstrata.engine.model_loader import load_model, resolve_model
    from kvstrata.engine.model_runner import ModelRunner
    from kvstrata.kernels.backends import get_ops
    from kvstrata.kernels.kv_store import reference_store_kv
    from kvstrata.kernels.layer_ops import reference_rms_norm, reference_rotary, reference_silu_and_mul
    from kvstrata.tiers.base import BlockLayout

    loaded = load_model(resolve_model("smollm2-135m-instruct"), torch.float32, "cpu")
    cfg = loaded.model_config
    compiled = get_ops("cpu")
    references = dataclasses.replace(compiled, rms_norm=reference_rms_norm, rotary=reference_rotary,
                                     silu_and_mul=reference_silu_and_mul, store_kv=reference_store_kv)
    rows = []
    for case in (Case("decode row", 1, 1), Case("10-token hit", 1, 10)):
        step, num_blocks = step_input(case, context, cfg.vocab_size)
        kv_cache = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, loaded.dtype).allocate(
            num_blocks, "cpu").normal_(generator=torch.Generator().manual_seed(0))
        runners = {"torch": ModelRunner(loaded, kv_cache, references),
                   "compiled": ModelRunner(loaded, kv_cache, compiled)}
        logits = {side: runner.execute(step) for side, runner in runners.items()}
        best = best_cpu_times({side: lambda runner=runner: runner.execute(step) for side, runner in runners.items()},
                              rounds)
        rows.append({"case": case.name, "context": context, "torch_ms": best["torch"] * 1e3,
                     "compiled_ms": best["compiled"] * 1e3, "speedup": best["torch"] / best["compiled"],
                     "max_logit_difference": float((logits["torch"] - logits["compiled"]).abs().max()),
                     "same_top_token": bool(torch.equal(logits["torch"].argmax(-1), logits["compiled"].argmax(-1)))})
        print(f"step {case.name}: {rows[-1]}", flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = ["# The CPU layer ops: torch references against the compiled kernels, per call", "",
             *provenance_lines(result), "",
             f"Load average (1, 5, 15 min) at the end: {result['load_average']}", "",
             "One thread; process CPU time per call, best of the rounds (sides alternating within each round). "
             "Shapes of the embedded model (SmolLM2-135M); rotary and the K/V store on the decoder's strided views "
             "of the qkv product.", "",
             "| dtype | step | op | torch reference | compiled | speed-up |", "|---|---|---|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['dtype']} | {row['case']} | {row['op']} | {row['torch_us']:.1f} us | "
                     f"{row['compiled_us']:.1f} us | {row['speedup']:.1f}x |")
    lines += ["", "Per decode step (calls a step makes: 61 norms, 30 of each other op):", "",
              "| dtype | torch references | compiled | saved |", "|---|---:|---:|---:|"]
    for dtype in dict.fromkeys(row["dtype"] for row in result["rows"]):
        decode = [r for r in result["rows"] if r["dtype"] == dtype and r["tokens"] == 1]
        ref = sum(r["torch_us"] * CALLS_PER_STEP[r["op"]] for r in decode) / 1e3
        ours = sum(r["compiled_us"] * CALLS_PER_STEP[r["op"]] for r in decode) / 1e3
        lines.append(f"| {dtype} | {ref:.2f} ms | {ours:.2f} ms | {ref - ours:.2f} ms |")
    if result.get("steps"):
        lines += ["", "Whole model steps (`--steps`): the embedded model, float32, one thread, the backend \"cpu\" "
                  "with the torch layer ops (as before) and with the compiled ones, one process, alternating; process "
                  "CPU time, best of the rounds. The logits of the two compared on the step (a random-normal cache).",
                  "",
                  "| step | context | torch layer ops | compiled layer ops | speed-up | largest logit difference "
                  "| same top token |", "|---|---:|---:|---:|---:|---:|---|"]
        for row in result["steps"]:
            lines.append(f"| {row['case']} | {row['context']} | {row['torch_ms']:.1f} ms | {row['compiled_ms']:.1f} ms "
                         f"| {row['speedup']:.2f}x | {row['max_logit_difference']:.1e} | {row['same_top_token']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import os

    parser = options.parser(__doc__)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=0.05, help="time of one side's loop in a round, about")
    parser.add_argument("--steps", action="store_true", help="also time whole model steps of the embedded model")
    options.out_dir(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.dtypes.split(","):
        rows += measure(getattr(torch, name), args.rounds, args.budget_s)
    steps = measure_steps(args.rounds) if args.steps else []
    result = results.record("cpu_layer_ops", load_average=", ".join(f"{v:.1f}" for v in os.getloadavg()),
                            rows=rows, steps=steps)
    results.publish(result, markdown(result), args.out_dir, "cpu_layer_ops")
    return 0
