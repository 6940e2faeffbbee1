"""What `cache.kv_cache_dtype` trades: the bytes of a block (so the blocks every tier holds and every
promotion moves) against the answers, on the long-document QA development set.

For each KV dtype (the model's dtype fixed), `cache_invariance.measure`: documents cut to `--doc-tokens`,
each cached by a first question; each further question answered greedily from the cache (a device hit)
and by an engine with prefix caching off. Reported per KV dtype: a block's bytes and the blocks 1 GiB
holds; how many uncached answers equal those of the first KV dtype listed (`auto`: the model's own
dtype), where the first differing token is, and how far the first token's log-probability moved (what
the narrower K/V change); cached against uncached within the KV dtype (what caching changes); and the
median TTFT of the uncached and the cached prompts, side by side in one run (a busy machine moves
these, not the answers).

Then what each format does to the model's own K/V (`kv_errors`): the documents' K and V as the model
computes them (an `auto` cache), kept in each format and read back, as a relative error (the norm of the
difference over the norm, per layer, K and V apart), beside fp8 with a scale of its own per row (what a
scaled fp8 cache could at best do; not an option) to show where fp8 loses.

    python benchmarks/invariance.py kv-dtype [--kv-dtypes auto,bfloat16,int8,fp8,fp8_e5m2] [--docs 4] [--doc-tokens 1000]

Writes `<out-dir>/kv_cache_dtype.json` and `.md`.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.suites.invariance.cache import measure_each  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib.harness import render_chat  # noqa: E402
from benchmarks.lib.ttft_workload import DEFAULT_DATA, cut_document, load_document  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

GIB = 1024**3


def parse_args(argv=None) -> argparse.Namespace:
    p = options.parser(__doc__)
    options.config(p)
    options.overrides(p)
    p.add_argument("--kv-dtypes", default="auto,bfloat16,int8,fp8,fp8_e5m2",
                   help="cache.kv_cache_dtype values, comma separated; the first is the reference")
    options.data(p, str(DEFAULT_DATA))
    p.add_argument("--docs", type=int, default=4, help="documents (each gives all but its first question)")
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    options.out_dir(p, options.RESULTS_DIR)
    options.name(p, "kv_cache_dtype")
    return p.parse_args(argv)


def compare(reference: dict, measured: dict) -> dict:
    """How the uncached answers of one KV dtype differ from the reference KV dtype's, prompt by prompt."""
    first_differences, logprob_moves = [], []
    for ref, row in zip(reference["prompts"], measured["prompts"]):
        assert (ref["doc"], ref["question"]) == (row["doc"], row["question"])
        ours, theirs = row["uncached_token_ids"], ref["uncached_token_ids"]
        first_differences.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None))
        logprob_moves.append(abs(row["uncached_first_logprob"] - ref["uncached_first_logprob"]))
    return {"same_answers": sum(d is None for d in first_differences), "first_differences": first_differences,
            "first_token_logprob_move_mean": statistics.fmean(logprob_moves),
            "first_token_logprob_move_max": max(logprob_moves)}


def held_in_formats():
    """How each format keeps a float32 tensor `x [..., head_dim]` and gives it back (what the engine's
    store and attention do), by the name the table shows."""
    import torch

    from kvstrata.kernels.kv_store import dequantize_rows, quantize_rows

    def cast(dtype):
        bound = torch.finfo(dtype).max
        return lambda x: x.clamp(-bound, bound).to(dtype).float()

    def fp8_scaled_per_row(x):
        scale = (x.abs().amax(dim=-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-30)
        return (x / scale).to(torch.float8_e4m3fn).float() * scale

    return {"bfloat16": cast(torch.bfloat16), "int8": lambda x: dequantize_rows(quantize_rows(x)),
            "fp8": cast(torch.float8_e4m3fn), "fp8, scaled per row (not an option)": fp8_scaled_per_row,
            "fp8_e5m2": cast(torch.float8_e5m2)}


def kv_errors(config, questions, args) -> dict:
    """Relative error of the documents' K/V (as an `auto` cache holds them) in each format: per layer,
    K and V apart, the norm of what the format changes over the norm; mean and worst over layers."""
    from kvstrata import LLM, SamplingParams, load_config

    llm = LLM(load_config(config, {"cache.kv_cache_dtype": "auto"}))
    encode = lambda text: llm.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for doc in list(questions)[:args.docs]:
        document = cut_document(load_document(doc), args.doc_tokens, encode, llm.tokenizer.decode)
        llm.generate(render_chat(llm.tokenizer, f"{document}\n\nQuestion: {questions[doc][0]}"),
                     SamplingParams(max_tokens=1, temperature=0.0))
    hierarchy = llm.engine.hierarchy
    cached = [b.block_id for b in hierarchy.pool.blocks if b.block_hash is not None]
    kv = hierarchy.kv_cache[cached].float()  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    llm.close()
    errors = {}
    for name, held_as in held_in_formats().items():
        per_layer = {}
        for index, part in enumerate(("key", "value")):
            x = kv[:, :, index].transpose(0, 1).flatten(1)  # [layers, tokens x heads x dims]
            held = held_as(kv[:, :, index]).transpose(0, 1).flatten(1)
            per_layer[part] = ((held - x).norm(dim=1) / x.norm(dim=1)).tolist()
        errors[name] = {part: {"mean": statistics.fmean(v), "max": max(v)} for part, v in per_layer.items()}
    return {"blocks": len(cached), "errors": errors}


def main(argv=None) -> int:
    args = parse_args(argv)
    base, questions, by_kv_dtype = measure_each(args, "cache.kv_cache_dtype", args.kv_dtypes,
                                                lambda config, kv_dtype: kv_dtype)
    reference = next(iter(by_kv_dtype.values()))
    for measured in by_kv_dtype.values():
        measured["against_reference"] = compare(reference, measured)
    print("K/V error of each format:", flush=True)
    result = results.record("kv_cache_dtype", model=base.model.name, dtype=base.resolved_dtype(),
                            doc_tokens=args.doc_tokens, max_tokens=args.max_tokens, by_kv_dtype=by_kv_dtype,
                            kv_errors=kv_errors(base, questions, args))
    results.publish(result, markdown(result), args.out_dir, args.name)
    return 0


def markdown(result: dict) -> str:
    names = list(result["by_kv_dtype"])
    lines = ["# KV cache dtype: bytes against answers", "",
             *provenance_lines(result), "",
             f"Model: {result['model']} in {result['dtype']}; documents of the development set cut to "
             f"{result['doc_tokens']} tokens, each cached by its first question; each further question's greedy "
             f"answer ({result['max_tokens']} tokens, end of sequence ignored) with prefix caching off "
             f"(against `{names[0]}`'s) and from the cache (against its own uncached answer).", "",
             f"| kv_cache_dtype | block bytes | blocks in 1 GiB | answers as `{names[0]}`'s | first differing token "
             "| first-token logprob moved, mean / max | cached answers as uncached | TTFT uncached p50 ms "
             "| TTFT cached p50 ms |",
             "|---|---:|---:|---|---|---|---|---:|---:|"]
    for name, m in result["by_kv_dtype"].items():
        against = m["against_reference"]
        where = ", ".join(str(d) for d in against["first_differences"] if d is not None) or "–"
        uncached = statistics.median(r["uncached_ttft_s"] for r in m["prompts"]) * 1000
        cached = statistics.median(r["cached_ttft_s"] for r in m["prompts"]) * 1000
        lines.append(f"| {name} | {m['block_bytes']} | {GIB // m['block_bytes']} | {against['same_answers']} of "
                     f"{m['total']} | {where} | {against['first_token_logprob_move_mean']:.4f} / "
                     f"{against['first_token_logprob_move_max']:.4f} | {m['total'] - m['differ']} of {m['total']} "
                     f"| {uncached:.0f} | {cached:.0f} |")
    kv_errors = result["kv_errors"]
    lines += ["", f"What each format changes in the model's own K/V ({kv_errors['blocks']} blocks of the documents "
              f"above, as the {result['dtype']} model computes them): norm of the change over the norm, per layer, "
              "mean / worst over layers.", "",
              "| format | K error mean / worst | V error mean / worst |", "|---|---|---|"]
    for name, e in kv_errors["errors"].items():
        lines.append(f"| {name} | {e['key']['mean']:.4f} / {e['key']['max']:.4f} | "
                     f"{e['value']['mean']:.4f} / {e['value']['max']:.4f} |")
    return "\n".join(lines) + "\n"
