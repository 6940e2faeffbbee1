"""torch threads against request time: what `model.threads: auto` should pick on this machine.

For each thread count, the same requests on one engine (the embedded model, the config's dtype):
a short cold prompt (about 64 tokens, a miss), a device hit (a question after a document already
cached) and a cold document (a miss of `--doc-tokens` tokens). Thread counts alternate within every
round, so that a change in the machine's load falls on all of them alike. Reported per kind and
thread count: the median, p90 and the swing (slowest / fastest) of TTFT.

    python benchmarks/threads.py [--threads 1,2] [--rounds 8] [--doc-tokens 1000] [--set key=value ...]

Writes `<out-dir>/threads.json` and `threads.md`. Run it on the machine as it is normally used (a
laptop with its usual load, a busy shared box): the swing is what one thread count costs there.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import ask, render_chat, save_result  # noqa: E402
from benchmarks.machine import command_line, machine_line  # noqa: E402
from benchmarks.lib.ttft_stats import percentile  # noqa: E402
from benchmarks.lib.ttft_workload import cut_document, load_document  # noqa: E402

KINDS = ("short_miss", "device_hit", "document_miss")
SHORT_PROMPT = ("You are a helpful assistant. Answer in one sentence: why does a cache make repeated work "
                "cheaper, and what does it cost in memory?")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "default.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", default="1,2", help="thread counts to compare, comma separated")
    p.add_argument("--rounds", type=int, default=8, help="requests of each kind per thread count")
    p.add_argument("--doc-tokens", type=int, default=1000, help="length of the document (tokens)")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvstrata import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    config = load_config(args.config, [*args.overrides, "cache.tiers.cpu=null", "cache.tiers.disk=null"])
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    document = cut_document(load_document("pydoc_data.topics:try"), args.doc_tokens, encode, tokenizer.decode)
    short = render_chat(tokenizer, SHORT_PROMPT)
    ask(engine, render_chat(tokenizer, f"{document}\n\nQuestion: warm-up"))  # caches the document
    samples = {t: {kind: [] for kind in KINDS} for t in thread_counts}
    load = []
    for i in range(args.rounds):
        for threads in thread_counts if i % 2 == 0 else reversed(thread_counts):
            torch.set_num_threads(threads)
            salt = f"threads-{i}-{threads}-{time.time_ns()}"
            samples[threads]["short_miss"].append(ask(engine, short, cache_salt=salt)["ttft_s"])
            hit = ask(engine, render_chat(tokenizer, f"{document}\n\nQuestion: what is question {i}-{threads}?"))
            assert hit["cached_tokens"] > 0
            samples[threads]["device_hit"].append(hit["ttft_s"])
            samples[threads]["document_miss"].append(
                ask(engine, render_chat(tokenizer, document), cache_salt=salt)["ttft_s"])
            load.append(os.getloadavg()[0])
        print(f"round {i + 1}/{args.rounds}", flush=True)
    engine.close()

    result = {"benchmark": "threads", "command": command_line(),
              "machine": machine_line(), "dtype": engine.dtype_name, "doc_tokens": args.doc_tokens,
              "short_prompt_tokens": len(short), "rounds": args.rounds,
              "load_average_1min": {"min": min(load), "max": max(load), "mean": sum(load) / len(load)},
              "ttft_s": {str(t): s for t, s in samples.items()},
              "summary": {str(t): {kind: summarise(s[kind]) for kind in KINDS} for t, s in samples.items()}}
    save_result(args.out_dir, "threads", result, markdown(result))
    return 0


def summarise(values: list[float]) -> dict:
    return {"p50_s": percentile(values, 50), "p90_s": percentile(values, 90), "min_s": min(values),
            "max_s": max(values), "swing": max(values) / min(values)}


def markdown(result: dict) -> str:
    load = result["load_average_1min"]
    lines = ["# torch threads against TTFT", "",
             f"Machine: {result['machine']}.  ",
             f"Load average (1 min) while it ran: {load['min']:.2f} to {load['max']:.2f} "
             f"(mean {load['mean']:.2f}).  ",
             f"Command: `{result['command']}`; {result['dtype']}, {result['rounds']} requests of each kind per "
             f"thread count, thread counts alternating within each round.", "",
             f"Kinds: `short_miss`, a {result['short_prompt_tokens']}-token prompt computed in full; "
             f"`device_hit`, a question after a {result['doc_tokens']}-token document already on the device; "
             f"`document_miss`, that document computed in full. Swing = slowest / fastest request.", "",
             "| threads | kind | p50 | p90 | fastest | slowest | swing |", "|---|---|---|---|---|---|---|"]
    for threads, kinds in result["summary"].items():
        for kind, s in kinds.items():
            lines.append(f"| {threads} | {kind} | {s['p50_s'] * 1000:.0f} ms | {s['p90_s'] * 1000:.0f} ms | "
                         f"{s['min_s'] * 1000:.0f} ms | {s['max_s'] * 1000:.0f} ms | {s['swing']:.1f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
