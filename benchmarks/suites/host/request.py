"""What one request costs the host before its first token, outside the model, by prompt length and where its
prefix is: a cold 64-token prompt, and a 7000-token document plus a question, missed, found on the device and
found in the CPU tier.

On a GPU a question over a cached document is one step of few tokens, replayed as a CUDA graph in 1.5-6 ms
(benchmarks/results/graph_steps.md); the engine's own work for the request (validating its token ids, hashing its
blocks, walking the tiers, holding its hits, building the step, sampling, releasing the blocks) comes on top of it,
and that work grows with the prompt's blocks. The goal that a device hit costs at most 1.5x a cold 64-token prompt
(the context length no longer shows) is met only if it stays small. Here the model is replaced by a table of fixed
logits (benchmarks/suites/host/engine.py's thin engine, one torch thread), with a CPU and a disk tier as configs/gpu.yaml
has them, so that only the engine's work is timed: a request's time to first token, from before `add_request` to
its first token, as its cache receipt (engine/receipt.py) measures it.

`--baseline REV` times the same requests on the engine of another commit, in turn with this one.

    python benchmarks/host.py request --baseline 0776041 --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import in_turn  # noqa: E402
from benchmarks.suites.host.engine import VOCAB, build_engine  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402

DOC_TOKENS = 7072      # 442 blocks of 16
QUESTION_TOKENS = 18
SHORT_TOKENS = 64
ASKS = 40              # requests timed per kind and run, after as many again as a warm-up
KINDS = {"cold": "cold 64-token prompt", "miss": "7090-token prompt, missed",
         "device": "7090-token prompt, document on the device", "cpu": "7090-token prompt, document in the CPU tier"}
PHASES = ("queue", "lookup", "load", "prefill")


def prompts(kind: str, n: int, salt: str) -> tuple[list[int], str]:
    """The n-th prompt of a kind and its cache salt: a miss and a cold prompt are salted apart each time (nothing
    of theirs is cached), the hits share the document and ask a new question each."""
    if kind == "cold":
        return [100 + (n * 31 + j) % (VOCAB - 100) for j in range(SHORT_TOKENS)], f"{salt}-cold-{n}"
    document = [100 + (j * 7919) % (VOCAB - 100) for j in range(DOC_TOKENS)]
    question = [100 + (n * 17 + j) % (VOCAB - 100) for j in range(QUESTION_TOKENS)]
    return document + question, (f"{salt}-miss-{n}" if kind == "miss" else f"{salt}-doc")


def ask_kind(engine, kind: str, n: int, salt: str) -> dict:
    """One request of `kind` alone through the engine; its record (benchmarks/suites/ttft/pressure.py `ask`)."""
    from benchmarks.lib.harness import ask

    engine.hierarchy.wait_for_write_downs()  # the request runs alone: nothing written down beside it
    if kind == "cpu" and not engine.hierarchy.clear_device_cache():
        raise RuntimeError("the device cache could not be cleared")
    token_ids, cache_salt = prompts(kind, n, salt)
    record = ask(engine, token_ids, cache_salt=cache_salt)
    expected = "miss" if kind in ("cold", "miss") else kind
    if record["hit_tier"] != expected:
        raise RuntimeError(f"a {kind} request was served as {record['hit_tier']}")
    return record


def phase_ms(receipt: dict, phase: str) -> float:
    return sum(receipt["load_ms_by_tier"].values()) if phase == "load" else receipt[f"{phase}_ms"]


def worker(_: str) -> dict:
    """Every kind's requests in this process (whose `kvstrata` is the code under test): median TTFT and phases."""
    import torch

    import kvstrata.engine

    from benchmarks.lib.harness import ask

    torch.set_num_threads(1)
    measured = {}
    with tempfile.TemporaryDirectory() as work_dir:
        cache = {"tiers": {"cpu": {"size": "256MiB"}, "disk": {"path": str(Path(work_dir) / "disk"), "size": "1GiB"}},
                 "load_policy": "always_load"}
        engine = build_engine(Path(work_dir), cache=cache)
        try:
            for kind in KINDS:
                ask(engine, *prompts("device", -1, "run"))  # the document, cached again for the hits
                for n in range(ASKS):  # a warm-up: its requests are not timed
                    ask_kind(engine, kind, ASKS + n, "run")
                records = [ask_kind(engine, kind, n, "run") for n in range(ASKS)]
                measured[kind] = {"ttft_ms": statistics.median(r["ttft_s"] * 1e3 for r in records),
                                  **{phase: statistics.median(phase_ms(r["receipt"], phase) for r in records)
                                     for phase in PHASES}}
        finally:
            engine.close()
    return {"engine_code": list(kvstrata.engine.__path__)[0], "kinds": measured}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.in_turn(parser, "request_host")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    runs = in_turn.runs_in_turn(__file__, "run", args, lambda m: ", ".join(
        f"{kind} {v['ttft_ms']:.3f}" for kind, v in m["kinds"].items()) + " ms")
    # each kind's best run (least TTFT) of each side, with its phases
    best = {side: {kind: min((r["kinds"][kind] for r in side_runs), key=lambda v: v["ttft_ms"]) for kind in KINDS}
            for side, side_runs in runs.items()}
    result = results.record("request_host", baseline=args.baseline, repeats=args.repeats, asks=ASKS,
                            doc_tokens=DOC_TOKENS, question_tokens=QUESTION_TOKENS, short_tokens=SHORT_TOKENS,
                            best=best, runs=runs)
    results.publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline = result["baseline"]
    sides = ["this"] + (["baseline"] if baseline else [])
    label = {"this": "this commit", "baseline": baseline}
    lines = ["# What a request costs the host before its first token", "", *provenance_lines(result), "",
             "One request at a time through the thin engine (benchmarks/suites/host/engine.py: the model replaced by fixed "
             "logits, one torch thread), with a CPU and a disk tier; time to first token from before `add_request`, "
             f"and its phases (engine/receipt.py), median of {result['asks']} requests, best of {result['repeats']} "
             "runs of each side" + (f", this commit and {baseline} in turn." if baseline else "."), "",
             "| request | " + " | ".join(f"{label[s]} TTFT ms (queue / lookup / load / prefill)" for s in sides)
             + (f" | {baseline} / this |" if baseline else " |"),
             "|---|" + "---:|" * len(sides) + ("---:|" if baseline else "")]
    for kind, name in KINDS.items():
        cells = []
        for side in sides:
            v = result["best"][side][kind]
            cells.append(f"{v['ttft_ms']:.3f} (" + " / ".join(f"{v[p]:.2f}" for p in PHASES) + ")")
        ratio = (f" | {result['best']['baseline'][kind]['ttft_ms'] / result['best']['this'][kind]['ttft_ms']:.2f}x"
                 if baseline else "")
        lines.append(f"| {name} | " + " | ".join(cells) + ratio + " |")
    lines += ["", "A cached document against a cold 64-token prompt (host work only; the goal on a GPU, model included, "
              "is 1.5x):", ""]
    for side in sides:
        best = result["best"][side]
        lines.append(f"- {label[side]}: device hit / cold prompt {best['device']['ttft_ms'] / best['cold']['ttft_ms']:.2f}x, "
                     f"CPU-tier hit / cold prompt {best['cpu']['ttft_ms'] / best['cold']['ttft_ms']:.2f}x, "
                     f"miss / cold prompt {best['miss']['ttft_ms'] / best['cold']['ttft_ms']:.2f}x")
    return lines
