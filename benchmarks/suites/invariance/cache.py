"""Do cache hits change outputs? Greedy answers with a cached document against the same prompts with
prefix caching off, per dtype, on the long-document QA development set.

For each document (cut to `--doc-tokens`) a first question is asked to cache the document, then each
further question is asked and its greedy answer (`--max-tokens`) is compared with the answer an
engine with prefix caching off gives to the same prompt. Both engines share one loaded model, so the
only difference is where the document's K/V came from: computed in this prompt's prefill, or
computed earlier (in another pass, cut into other chunks) and read from the cache.

    python benchmarks/invariance.py cache [--dtype float32,bfloat16] [--docs 4] [--doc-tokens 1000]

Writes `<out-dir>/<name>.json` and `.md` (`--name`, default `cache_invariance`): per dtype, how many
answers differ and where the first differing token is. This measures outputs, not time: a busy
machine does not change it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib.harness import render_chat  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib.ttft_workload import DEFAULT_DATA, cut_document, load_document, load_questions  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = options.parser(__doc__)
    options.config(p)
    options.overrides(p)
    options.dtype(p, "float32,bfloat16", help="dtypes to compare, comma separated")
    options.data(p, str(DEFAULT_DATA))
    p.add_argument("--docs", type=int, default=4, help="documents (each gives all but its first question)")
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    options.out_dir(p, options.RESULTS_DIR)
    options.name(p, "cache_invariance")
    return p.parse_args(argv)


def measure(config, questions, args) -> dict:
    """Every compared prompt of one dtype: the uncached and the cached answer's tokens."""
    from kvstrata import LLM, SamplingParams, load_config

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    no_cache = LLM(load_config(config, {"cache.enable_prefix_caching": False}))
    cache = LLM(config, loaded_model=no_cache.engine.loaded)
    tokenizer = cache.tokenizer

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = []
    for doc, doc_questions in list(questions.items())[:args.docs]:
        document = cut_document(load_document(doc), args.doc_tokens, encode, tokenizer.decode)
        prompts = [render_chat(tokenizer, f"{document}\n\nQuestion: {q}") for q in doc_questions]
        cache.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))  # caches the document
        for question, prompt in zip(doc_questions[1:], prompts[1:]):
            cached = cache.generate(prompt, greedy)[0]
            uncached = no_cache.generate(prompt, greedy)[0]
            assert uncached.cached_tokens == 0 and cached.cached_tokens > 0
            first_difference = next((i for i, (a, b) in enumerate(zip(cached.token_ids, uncached.token_ids))
                                     if a != b), None)
            rows.append({"doc": doc, "question": question, "prompt_tokens": len(prompt),
                         "cached_tokens": cached.cached_tokens, "same": cached.token_ids == uncached.token_ids,
                         "first_difference": first_difference, "cached_text": cached.text,
                         "uncached_text": uncached.text, "uncached_token_ids": uncached.token_ids,
                         "uncached_first_logprob": uncached.logprobs[0].logprob,
                         "cached_ttft_s": cached.ttft_s, "uncached_ttft_s": uncached.ttft_s})
            print(f"  {doc} {question!r}: {'same' if rows[-1]['same'] else f'differs at token {first_difference}'}",
                  flush=True)
    block_bytes = cache.stats()["block_bytes"]
    cache.close()
    no_cache.close()
    return {"prompts": rows, "differ": sum(not r["same"] for r in rows), "total": len(rows),
            "block_bytes": block_bytes}


def measure_each(args, key: str, values: str, label) -> tuple:
    """`measure` once per comma-separated value of config `key` (the lower tiers off: every hit is a
    device hit), keyed by `label(config, value)`. Returns the base config, the questions and the rows."""
    from kvstrata import load_config

    base = load_config(args.config, [*args.overrides, "cache.tiers.cpu=null", "cache.tiers.disk=null"])
    questions = load_questions(args.data)
    measured = {}
    for value in [v.strip() for v in values.split(",") if v.strip()]:
        config = load_config(base, {key: value})
        name = label(config, value)
        print(f"{name}:", flush=True)
        measured[name] = measure(config, questions, args)
    return base, questions, measured


def main(argv=None) -> int:
    args = parse_args(argv)
    base, _, by_dtype = measure_each(args, "model.dtype", args.dtype, lambda config, _: config.resolved_dtype())
    result = results.record("cache_invariance", model=base.model.name, doc_tokens=args.doc_tokens,
                            max_tokens=args.max_tokens, by_dtype=by_dtype)
    results.publish(result, markdown(result), args.out_dir, args.name)
    return 0


def markdown(result: dict) -> str:
    lines = ["# Do cache hits change greedy outputs?", "",
             *provenance_lines(result), "",
             f"Model: {result['model']}; documents of the development set cut to {result['doc_tokens']} tokens, "
             f"each cached by its first question; each further question's greedy answer "
             f"({result['max_tokens']} tokens, end of sequence ignored) compared with prefix caching off. "
             "The document is a device hit; a CPU or disk hit would hold the same bytes.", "",
             "| dtype | answers that differ | first differing token (of those that differ) |", "|---|---|---|"]
    for dtype, m in result["by_dtype"].items():
        where = [str(r["first_difference"]) for r in m["prompts"] if not r["same"]]
        lines.append(f"| {dtype} | {m['differ']} of {m['total']} | {', '.join(where) or '–'} |")
    return "\n".join(lines) + "\n"
