"""What structured outputs cost a step: the grammar mask against the decode step it rides on.

A structured request's row is masked before sampling at every step (engine/structured_outputs.py):
its matcher fills a bitmask of the tokens its grammar allows next, and the batch's bitmask is
applied to the logits at once. Both are timed here on the embedded model's vocabulary for batches of
B structured rows, side by side with the decode step of B plain requests measured in the same run
(the embedded model, greedy, `ignore_eos`), so the mask's share of a step is read directly:

- rows inside a JSON string (`{"answer": "`): nearly every token is allowed, the widest mask;
- rows after a key and colon of a schema (`{"answer": "yes", "year": `): only digits and a minus.

Each mask figure is the median of `--repeats` steps; the decode step is the median step of generating
`--tokens` tokens for B prompts at once. Run:

    python benchmarks/host.py structured-outputs     # writes benchmarks/results/structured_outputs.{md,json}
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib import options  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["answer", "year"]}
STATES = {"inside a string": '{"answer": "', "before an integer": '{"answer": "yes", "year": '}


def mask_seconds(llm, batch: int, prefix: str, repeats: int) -> float:
    """Median seconds of one step's mask for `batch` rows whose answers so far are `prefix`."""
    import torch

    from kvstrata import StructuredOutputsParams
    from kvstrata.engine.structured_outputs import mask_logits

    engine = llm.engine
    params = StructuredOutputsParams(json=SCHEMA)
    prefix_ids = engine.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    vocab = engine.loaded.model_config.vocab_size
    times = []
    for _ in range(repeats):
        matchers = [engine.grammars.matcher(params) for _ in range(batch)]
        for matcher in matchers:
            assert all(matcher.accept(t) for t in prefix_ids), "the prefix must follow the schema"
        logits = torch.randn(batch, vocab, device=engine.device)
        synchronize(engine.device)
        started = time.perf_counter()
        mask_logits(logits, matchers, raw=logits)
        synchronize(engine.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def synchronize(device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after their launch returns)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_seconds(llm, batch: int, tokens: int) -> float:
    """Median seconds of a decode step of `batch` plain requests (their prefill steps left out)."""
    from kvstrata import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for k in range(batch):
        engine.add_request(f"bench-{batch}-{k}", engine.tokenize(f"Item {k}: the weather today is"), params)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    for k in range(batch):
        engine.release(f"bench-{batch}-{k}")
    return statistics.median(steps[1:])


def main(argv: list[str] | None = None) -> int:
    p = options.parser(__doc__)
    p.add_argument("--batches", default="1,8,32", help="structured rows per step, comma separated")
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per request for the decode step")
    options.repeats(p, 30)
    options.device(p, "cpu", help="cpu or cuda")
    options.dtype(p, "float32")
    options.out_dir(p, options.RESULTS_DIR)
    args = p.parse_args(argv)

    import torch

    from kvstrata import LLM

    torch.set_num_threads(1)
    llm = LLM({"model": {"dtype": args.dtype, "device": args.device}, "cache": {"tiers": {"device": {"size": 1024}}}})
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        step_s = decode_step_seconds(llm, batch, args.tokens)
        for state, prefix in STATES.items():
            mask_s = mask_seconds(llm, batch, prefix, args.repeats)
            rows.append({"batch": batch, "state": state, "mask_s": mask_s, "decode_step_s": step_s,
                         "share": mask_s / step_s})
            print(f"B={batch} {state}: mask {mask_s * 1000:.2f} ms, decode step {step_s * 1000:.1f} ms "
                  f"({rows[-1]['share']:.1%})", flush=True)
    llm.close()

    result = results.record("structured_outputs", repeats=args.repeats, tokens=args.tokens, rows=rows)
    lines = ["# What structured outputs cost a step", "", *provenance_lines(result), "",
             "The grammar mask of B structured rows (xgrammar fills each row's bitmask, then applies the batch's "
             f"at once; median of {args.repeats} steps) against the median decode step of B plain requests "
             f"(the embedded model, {args.dtype} on {args.device}, 1 torch thread, {args.tokens} tokens each, greedy), "
             "in the same run.",
             "", "| rows | where the answers are | mask | decode step | mask / step |", "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['state']} | {r['mask_s'] * 1000:.2f} ms | "
                     f"{r['decode_step_s'] * 1000:.1f} ms | {r['share']:.1%} |")
    results.write(args.out_dir, result, lines)
    return 0
