"""Writing a whole (not streamed) answer as JSON: FastAPI's default against the server's own writer.

A non-streamed answer is written once it is complete. FastAPI, given a returned model, runs
`jsonable_encoder` (a recursive walk in Python) and then `json.dumps`, on the event loop, where
every other client waits meanwhile. The server instead writes it with pydantic's compiled serializer
(`kvstrata.serving.responses._json_bytes`, run on a pool thread by `json_response`). Both are timed
here on the same answers, side by side, and checked to give the same JSON:

- a plain answer (16 generated tokens, no log-probabilities);
- answers with `prompt_logprobs` for N prompt tokens with K alternatives each (what a client scoring
  answers asks for: evaluation harnesses send long prompts).

Each figure is the median of `--repeats` timed runs of process CPU time. Run:

    python benchmarks/answer_json.py        # prints the table, writes benchmarks/results/answer_json.{md,json}
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import provenance_lines, results_record, write_results  # noqa: E402

VOCAB = 49152


def answer(prompt_tokens: int, alternatives: int, seed: int = 0):
    """A completion answer as the server builds it, with prompt log-probabilities when asked."""
    from kvstrata.serving.schemas import CompletionChoice, CompletionResponse, PromptTokensDetails, Usage

    rng = random.Random(seed)
    entries = None
    if prompt_tokens:
        entries = [None] + [{str(rng.randrange(VOCAB)): {"logprob": -rng.random() * 10, "rank": rank + 1,
                                                         "decoded_token": f" tok{rng.randrange(1000)}"}
                             for rank in range(alternatives + 1)} for _ in range(prompt_tokens - 1)]
    choice = CompletionChoice(index=0, text=" an answer of sixteen tokens or so, as a model writes it.",
                              finish_reason="length", prompt_logprobs=entries)
    usage = Usage(prompt_tokens=max(prompt_tokens, 1), completion_tokens=16,
                  total_tokens=max(prompt_tokens, 1) + 16,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    return CompletionResponse(id="cmpl-bench", created=0, model="bench", choices=[choice], usage=usage)


def fastapi_default(model) -> bytes:
    """What FastAPI does with a returned model (no response_model): encode, then Starlette's dumps."""
    from fastapi.encoders import jsonable_encoder

    return json.dumps(jsonable_encoder(model), ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def ours(model) -> bytes:
    from kvstrata.serving.responses import _json_bytes

    return _json_bytes(None, model)


def cpu_seconds(fn, arg, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn(arg)
        times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="0x0,1000x5,3500x20,8000x20",
                   help="prompt tokens x alternatives per answer, comma separated (0x0: a plain answer)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    args = p.parse_args()

    rows = []
    for shape in args.shapes.split(","):
        tokens, alternatives = (int(x) for x in shape.split("x"))
        model = answer(tokens, alternatives)
        same = json.loads(fastapi_default(model)) == json.loads(ours(model))
        default_s, ours_s = cpu_seconds(fastapi_default, model, args.repeats), cpu_seconds(ours, model, args.repeats)
        rows.append({"prompt_tokens": tokens, "alternatives": alternatives, "bytes": len(ours(model)),
                     "fastapi_default_s": default_s, "ours_s": ours_s, "ratio": default_s / max(ours_s, 1e-9),
                     "same_json": same})
        print(f"{tokens} tokens x {alternatives}: FastAPI's default {default_s * 1000:.2f} ms, ours "
              f"{ours_s * 1000:.2f} ms ({rows[-1]['ratio']:.1f}x), same JSON: {same}", flush=True)

    result = results_record("answer_json", repeats=args.repeats, rows=rows)
    lines = ["# Writing a whole answer as JSON", "", *provenance_lines(result), "",
             "Process CPU time to write one answer, median of "
             f"{args.repeats} runs: FastAPI's default for a returned model (`jsonable_encoder` then `json.dumps`, "
             "on the event loop) against the server's writer (pydantic's compiled serializer, on a pool "
             "thread). Answers with `prompt_logprobs` carry one entry per prompt token after the first, "
             "each with its alternatives.", "",
             "| prompt tokens | alternatives | JSON bytes | FastAPI default | ours | default / ours | same JSON |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['alternatives']} | {r['bytes']:,} | "
                     f"{r['fastapi_default_s'] * 1000:.2f} ms | {r['ours_s'] * 1000:.2f} ms | {r['ratio']:.1f}x | "
                     f"{'yes' if r['same_json'] else 'NO'} |")
    write_results(args.out_dir, result, lines)
    return 0 if all(r["same_json"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
