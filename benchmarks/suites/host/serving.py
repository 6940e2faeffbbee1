"""What serving a decode step costs the engine's thread: the same decoding sequences stepped by the engine alone,
through `AsyncEngine` to readers on an event loop, and through the HTTP server to streaming clients.

The engine steps on one thread of the server's process; the event loop that streams every client's tokens
(uvicorn and FastAPI: a server-sent event per token per client) runs on another, and both need Python's
interpreter lock. Pure Python beside the step thread slows it (benchmarks/results/archive/background_threads.md), so the
serving layer's work per token is paid by every step, by every client. The model is replaced by fixed logits
(benchmarks/suites/host/engine.py's engine), so that the host's work is all there is to time: on a GPU this is the work
between two model steps.

For each number of sequences, while all of them decode:

- `engine`: `LLMEngine.step` in a loop (engine_host's figure, here as a period);
- `async`: the same requests through `AsyncEngine`, each read by a coroutine on an event loop of this process;
- `http`: through the app served by uvicorn on a loopback port, read by streaming clients in another process
  (`/v1/completions`, `stream: true`: what an OpenAI client does).

The figures are the step period (the time from one step's start to the next: the inter-token gap every client
sees) and the step itself (the time inside `LLMEngine.step`). Best of `--repeats`. Run:

    python benchmarks/host.py serving --out-dir benchmarks/results
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import in_turn  # noqa: E402
from benchmarks.suites.host.engine import VOCAB, build_engine  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402

PROMPT_TOKENS = 64
ANSWER_TOKENS = 200
WAYS = ("engine", "async", "http")

# The streaming clients, run in a process of their own: argv is the URL, the number of clients and the
# prompts' JSON. Each client streams one completion and reads every event to the end.
CLIENTS = r"""
import asyncio, json, sys
import httpx

async def client(http, url, prompt, max_tokens):
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return

async def main(url, prompts, max_tokens):
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http, url, p, max_tokens) for p in prompts))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
"""


@dataclass
class StepTimes:
    """The start and end of every step taken while all the case's sequences decoded."""
    starts: list[float]
    ends: list[float]

    @property
    def period_s(self) -> float:
        if len(self.starts) < 2:
            raise SystemExit("serving_host: the sequences never decoded all together (more than max_num_seqs?)")
        return statistics.mean(b - a for a, b in zip(self.starts, self.starts[1:]))

    @property
    def inside_s(self) -> float:
        return statistics.mean(e - s for s, e in zip(self.starts, self.ends))


def prompts(num_seqs: int) -> list[list[int]]:
    """Distinct prompts: nothing is shared between the sequences."""
    return [[100 + (i * 7919 + j) % (VOCAB - 100) for j in range(PROMPT_TOKENS)] for i in range(num_seqs)]


def time_decode_steps(engine, num_seqs: int) -> StepTimes:
    """Wrap `engine.step` to note the steps in which `num_seqs` sequences all decode."""
    times = StepTimes([], [])
    step = engine.step

    def timed_step():
        started = time.perf_counter()
        updated = step()
        running = engine.scheduler.running
        if len(running) == num_seqs and all(len(r.output_token_ids) > 1 for r in running) and not any(
                r.is_finished for r in updated):
            times.starts.append(started)
            times.ends.append(time.perf_counter())
        return updated

    engine.step = timed_step
    return times


def run_engine(engine, num_seqs: int) -> StepTimes:
    from kvstrata.engine.sampling import SamplingParams

    times = time_decode_steps(engine, num_seqs)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    ids = [f"engine-{num_seqs}-{i}" for i in range(num_seqs)]
    for request_id, prompt in zip(ids, prompts(num_seqs)):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in ids:
        engine.release(request_id)
    del engine.step  # the class's again
    return times


def run_async(engine, num_seqs: int) -> StepTimes:
    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.engine.sampling import SamplingParams

    times = time_decode_steps(engine, num_seqs)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    async_engine = AsyncEngine(engine)

    async def read(prompt: list[int]) -> None:
        async for _ in async_engine.generate(prompt, params):
            pass

    async def main(argv: list[str] | None = None) -> None:
        await asyncio.gather(*(read(p) for p in prompts(num_seqs)))

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    return times


def run_http(engine, num_seqs: int) -> StepTimes:
    import uvicorn

    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.serving.app import build_app
    from kvstrata.serving.metrics import ServingMetrics
    from kvstrata.serving.tokenizer_pool import TokenizerPool

    times = time_decode_steps(engine, num_seqs)
    tokenizers = TokenizerPool(engine.tokenizer)
    async_engine = AsyncEngine(engine)
    metrics = ServingMetrics(lambda: async_engine.snapshot)
    async_engine.listener = metrics
    app = build_app(async_engine, "bench", metrics=metrics, tokenizers=tokenizers, max_request_body=64 << 20)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise SystemExit("serving_host: the HTTP server did not start")
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        subprocess.run([sys.executable, "-c", CLIENTS, url, json.dumps(prompts(num_seqs)), str(ANSWER_TOKENS)],
                       check=True)
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
        async_engine.shutdown()
        tokenizers.close()
    return times


def worker(seq_counts: list[int]) -> dict:
    """Every count of sequences every way once, after a warm-up, in this process (whose `kvstrata` is the code
    under test). A fresh engine each time: `AsyncEngine.shutdown` closes it."""
    import torch

    import kvstrata.engine

    torch.set_num_threads(1)
    runs = {"engine": run_engine, "async": run_async, "http": run_http}
    figures: dict[str, dict[str, list[float]]] = {way: {"period": [], "inside": []} for way in WAYS}
    with tempfile.TemporaryDirectory() as work_dir:
        warm = build_engine(Path(work_dir))
        run_engine(warm, 2)
        warm.close()
        for num_seqs in seq_counts:
            for way in WAYS:
                engine = build_engine(Path(work_dir))
                times = runs[way](engine, num_seqs)
                if way == "engine":
                    engine.close()
                figures[way]["period"].append(times.period_s)
                figures[way]["inside"].append(times.inside_s)
    return {"engine_code": list(kvstrata.engine.__path__)[0], **figures}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.in_turn(parser, "serving_host")
    parser.add_argument("--seqs", default="4,16,32", help="numbers of sequences decoding together (at most the "
                        "default scheduler.max_num_seqs, 32)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    seq_counts = [int(n) for n in args.seqs.split(",")]
    best: dict[str, dict] = {}
    for repeat, side, measured in in_turn.each_side_in_turn(__file__, json.dumps(seq_counts), args.baseline,
                                                            args.repeats):
        kept = best.setdefault(side, {way: {k: [float("inf")] * len(seq_counts) for k in ("period", "inside")}
                                      for way in WAYS})
        for way in WAYS:
            for k in ("period", "inside"):
                kept[way][k] = [min(a, b) for a, b in zip(kept[way][k], measured[way][k])]
        print(f"run {repeat + 1}, {side} ({measured['engine_code']}): periods "
              + "; ".join(f"{way} " + ", ".join(f"{s * 1e3:.3f}" for s in measured[way]["period"]) for way in WAYS)
              + " ms", flush=True)
    rows = [{"num_seqs": n, **{f"{side}_{way}_{k}_ms": best[side][way][k][i] * 1e3 for side in best for way in WAYS
                               for k in ("period", "inside")}} for i, n in enumerate(seq_counts)]
    result = results.record("serving_host", baseline=args.baseline, repeats=args.repeats,
                            prompt_tokens=PROMPT_TOKENS, answer_tokens=ANSWER_TOKENS, rows=rows)
    results.publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    sides = ["this"] + (["baseline"] if result["baseline"] else [])
    names = {"this": "this commit", "baseline": result["baseline"]}
    lines = ["# What serving a decode step costs the engine's thread", "", *provenance_lines(result), "",
             f"{result['prompt_tokens']}-token prompts, {result['answer_tokens']}-token answers (greedy), the model "
             "replaced by fixed logits (benchmarks/suites/host/engine.py's engine, one torch thread); every figure is the "
             "mean over the steps in which all the sequences decode, best of "
             f"{result['repeats']} runs. Period: from one step's start to the next (the gap between two tokens of a "
             "stream). Inside: the time in `LLMEngine.step`.", ""]
    for side in sides:
        lines += [f"## {names[side]}", "",
                  "| sequences | engine period ms | async period ms | http period ms | http / engine | "
                  "engine inside ms | http inside ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in result["rows"]:
            get = lambda way, k: row[f"{side}_{way}_{k}_ms"]  # noqa: E731
            lines.append(f"| {row['num_seqs']} | {get('engine', 'period'):.3f} | {get('async', 'period'):.3f} | "
                         f"{get('http', 'period'):.3f} | {get('http', 'period') / get('engine', 'period'):.2f}x | "
                         f"{get('engine', 'inside'):.3f} | {get('http', 'inside'):.3f} |")
        lines.append("")
    if result["baseline"]:
        lines += [f"http period, {result['baseline']} / this commit: " + ", ".join(
            f"{row['num_seqs']} sequences {row['baseline_http_period_ms'] / row['this_http_period_ms']:.2f}x"
            for row in result["rows"]) + "."]
    return lines
