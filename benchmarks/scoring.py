"""Scoring answers on long documents: each answer's log-likelihood given the document and question.

This is how evaluation harnesses (lm-evaluation-harness's multiple choice) use an engine: one
request per answer, `prompt` = context + answer as token ids, the prompt's log-probabilities asked
(`echo` with `logprobs` over HTTP; `SamplingParams(prompt_logprobs=...)` here), one token generated.
The context (a document and a question) is the same for every answer of a question, and the
document for every question on it.

Two engines on the same requests, one after the other, sharing one loaded model:

- `recompute`: prompt log-probabilities from computing every prompt token, as vLLM does (a cached
  block's K/V carry no logits, so vLLM turns prefix caching off for such a request): kvstrata with
  its cache of prompt log-probabilities emptied (capacity 0);
- `cached`: kvstrata as it runs: the entries of blocks scored before come from its cache of them
  (engine/prompt_logprobs.py), and their K/V from the tiers, so an answer computes only what follows
  the shared context's last full block but one;
- `cached_batched`: the same, with each question's answers sent at once (one `generate` call, as a
  harness sends a batch): one answer computes the context while the others wait for its blocks'
  log-probabilities. Each answer is charged its batch's time divided by the answers.

Reported: the time per request for the first answer to a document's first question (nothing
cached), and for the other answers; the ratios to recompute; and whether the engines gave the same
scores (the answers' summed log-probabilities within 1e-3, the same best answer).

    python benchmarks/scoring.py [--docs 2] [--questions 2] [--doc-tokens 1500] [--set key=value ...]

Writes `<out-dir>/scoring.json` and `scoring.md`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose
    sys.path[0] = str(REPO_ROOT)  # kernels.py would stand for the installed `kernels`

from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib.harness import load  # noqa: E402
from benchmarks.lib.ttft_workload import DEFAULT_DATA, cut_document, load_document, load_questions  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

ANSWERS = (" It runs once the loop ends without a break.", " It is never executed.",
           " Only when an exception is raised.", " It depends on the interpreter.")
CONFIGURATIONS = ("recompute", "cached", "cached_batched")


def parse_args(argv=None) -> argparse.Namespace:
    p = options.parser(__doc__)
    options.config(p)
    options.overrides(p)
    p.add_argument("--docs", type=options.positive_int, default=2)
    p.add_argument("--questions", type=options.positive_int, default=2, help="questions per document")
    p.add_argument("--doc-tokens", type=options.positive_int, default=1500)
    options.out_dir(p, options.RESULTS_DIR)
    return p.parse_args(argv)


def build_requests(tokenizer, args) -> list[dict]:
    """Token ids of every (document, question, answer) request, in the order an evaluation sends them."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    requests = []
    for d, (doc, questions) in enumerate(list(load_questions(DEFAULT_DATA).items())[:args.docs]):
        text = cut_document(load_document(doc), args.doc_tokens, encode, tokenizer.decode)
        for q, question in enumerate(questions[:args.questions]):
            context = tokenizer(f"Document:\n{text}\n\nQuestion: {question}\nAnswer:")["input_ids"]
            for a, answer in enumerate(ANSWERS):
                requests.append({"doc": d, "question": q, "answer": a, "context_tokens": len(context),
                                 "token_ids": list(context) + encode(answer)})
    return requests


def score(llm, requests: list[dict]) -> list[dict]:
    """Requests sent at once: each one's share of the wall time, its answer's summed log-probability,
    the tokens the cache served it."""
    from kvstrata import SamplingParams

    started = time.perf_counter()
    outs = llm.generate([r["token_ids"] for r in requests],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    seconds = (time.perf_counter() - started) / len(requests)
    results = []
    for request, out in zip(requests, outs):
        answer_entries = out.prompt_logprobs[request["context_tokens"] - 1:]  # entry k is prompt token k+1's
        results.append({**{k: request[k] for k in ("doc", "question", "answer")}, "seconds": seconds,
                        "score": sum(e.logprob for e in answer_entries), "cached_tokens": out.cached_tokens})
    return results


def run_configuration(name: str, config, loaded, requests: list[dict]) -> list[dict]:
    from kvstrata import LLM
    from kvstrata.engine.prompt_logprobs import PromptLogprobCache

    if name == "cached_batched":  # each question's answers at once
        sends = [[r for r in requests if (r["doc"], r["question"]) == key]
                 for key in dict.fromkeys((r["doc"], r["question"]) for r in requests)]
    else:
        sends = [[r] for r in requests]
    with LLM(config, loaded_model=loaded) as llm:
        if name == "recompute":
            llm.engine.kv_manager.prompt_logprobs = PromptLogprobCache(0, config.cache.block_size)
        results = []
        for send in sends:
            results += score(llm, send)
            print(f"  {name}: doc {send[0]['doc']} question {send[0]['question']}, {len(send)} answers: "
                  f"{results[-1]['seconds'] * 1000:.0f} ms each, cached tokens "
                  f"{[r['cached_tokens'] for r in results[-len(send):]]}", flush=True)
    return results


def summarise(results: list[dict]) -> dict:
    first = [r["seconds"] for r in results if r["question"] == 0 and r["answer"] == 0]
    others = [r["seconds"] for r in results if not (r["question"] == 0 and r["answer"] == 0)]
    return {"requests": len(results), "total_s": sum(r["seconds"] for r in results),
            "new_document_p50_s": statistics.median(first), "other_answers_p50_s": statistics.median(others),
            "other_answers_mean_cached_tokens": statistics.mean(r["cached_tokens"] for r in results
                                                                if not (r["question"] == 0 and r["answer"] == 0))}


def compare_scores(by_config: dict[str, list[dict]]) -> dict:
    """Every engine's scores against recompute's."""
    recompute = by_config["recompute"]

    def best_answers(results):
        questions = {}
        for r in results:
            questions.setdefault((r["doc"], r["question"]), []).append(r["score"])
        return [max(range(len(s)), key=s.__getitem__) for s in questions.values()]

    others = [results for name, results in by_config.items() if name != "recompute"]
    worst = max(abs(a["score"] - b["score"]) for results in others for a, b in zip(recompute, results))
    return {"max_abs_score_difference": worst,
            "same_best_answers": all(best_answers(results) == best_answers(recompute) for results in others)}


def report(result: dict) -> str:
    s, cmp = result["summary"], result["scores"]
    lines = ["# Scoring answers on long documents (prompt log-probabilities)", "",
             *provenance_lines(result), "",
             f"Workload: {result['workload']}", "",
             "| engine | requests | total s | new document p50 ms | other answers p50 ms "
             "| other answers' cached tokens (mean) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in CONFIGURATIONS:
        x = s[name]
        lines.append(f"| {name} | {x['requests']} | {x['total_s']:.1f} | {x['new_document_p50_s'] * 1000:.0f} | "
                     f"{x['other_answers_p50_s'] * 1000:.0f} | {x['other_answers_mean_cached_tokens']:.0f} |")
    lines.append("")
    for name in CONFIGURATIONS[1:]:
        ratio = s["recompute"]["other_answers_p50_s"] / s[name]["other_answers_p50_s"]
        total = s["recompute"]["total_s"] / s[name]["total_s"]
        lines.append(f"recompute / {name}: other answers (p50) {ratio:.1f}x; whole workload {total:.1f}x.  ")
    lines += ["", f"Same scores: largest difference between recompute's answer log-likelihoods and the others' "
              f"{cmp['max_abs_score_difference']:.2e}; the same best answer for every question: "
              f"{'yes' if cmp['same_best_answers'] else 'NO'}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from kvstrata import load_config

    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    loaded, _ = load(config)
    requests = build_requests(loaded.tokenizer, args)
    by_config = {}
    for name in CONFIGURATIONS:
        with tempfile.TemporaryDirectory(prefix="kvstrata-scoring-") as tmp:  # each engine its own disk tier
            by_config[name] = run_configuration(name, load_config(args.config, [*args.overrides,
                                                f"cache.tiers.disk.path={tmp}/kv"]), loaded, requests)
    workload = (f"{args.docs} documents cut to {args.doc_tokens} tokens, {args.questions} questions each, "
                f"{len(ANSWERS)} answers per question (context + answer as token "
                f"ids, prompt_logprobs=1, max_tokens=1), {config.resolved_dtype()}, "
                f"{torch.get_num_threads()} torch threads")
    result = {**results.record("scoring"), "workload": workload,
              "results": by_config, "summary": {n: summarise(r) for n, r in by_config.items()},
              "scores": compare_scores(by_config)}
    results.publish(result, report(result), args.out_dir, "scoring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
