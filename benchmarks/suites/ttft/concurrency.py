"""TTFT under concurrency: cached questions and new documents at once, `fcfs` against `uncached_first`.

    python benchmarks/ttft.py concurrency [--config configs/pressure.yaml] [--streams 4 | --rate 0.5]
    kvstrata bench concurrency --config configs/pressure.yaml [options]

Long-document QA under load: each request is one document plus a question; documents are drawn
Zipf-like (the first documents are asked about most), so most requests find their document cached
(hits) while the first request on each document computes it (misses). The same workload runs once
per scheduling policy, each on a fresh engine over the same loaded model, and a request counts as a
hit when at least half of its prompt came from the cache (as in the TTFT-under-pressure benchmark).

Arrivals: `--streams N` closed-loop clients, each sending its next request as soon as its previous
one has finished (what `guidellm --rate-type concurrent` does), or `--rate R` Poisson arrivals at R
requests per second. Reported per policy: hit and miss TTFT p50 / p90 / p99, throughput (prompt and
generated tokens per second of wall time), and the hits' TTFT when each is sent alone on a warm cache.
Goals (issue "schedule by uncached work"): under `uncached_first`, hit p50 within 2x of alone and p90
within 4x; miss p50 at most 25% worse than under `fcfs`; throughput within 10% of `fcfs`.

`--guidellm kvstrata,vllm` measures something else: `kvstrata serve` and vLLM's OpenAI server, each in turn,
under guidellm with `--streams` concurrent streams, `--requests` requests on `--docs` shared prefixes of
`--doc-tokens` tokens with a `--suffix-tokens` suffix and `--max-tokens` output tokens (defaults: the workload of
issue 62, on configs/default.yaml), written as `<out-dir>/<name>.md` and `.json` (benchmarks/lib/served_vs_vllm.py).
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import OrderedDict, deque
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib.harness import LoadSampler, load, render_chat  # noqa: E402
from benchmarks.lib.ttft_stats import MISS, hit_tier, summarize  # noqa: E402
from benchmarks.lib.ttft_workload import (DOC_PREFIX, REPHRASINGS, cut_document, load_document,  # noqa: E402
                                      load_questions, zipf_order)
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

POLICIES = ("fcfs", "uncached_first")
DEFAULT_CONFIG = REPO_ROOT / "configs" / "pressure.yaml"
# Without --data: the longest sections of Python's own documentation (shipped with CPython) and
# questions any of them can be asked.
BUILTIN_DOCS = ("specialnames", "compound", "types", "formatstrings", "string-methods", "typesseq", "debugger",
                "attribute-access", "customization", "typesmapping")
BUILTIN_QUESTIONS = ("What is this section about?", "Name one keyword it explains.",
                     "What does the first paragraph say?", "Which example does it give?",
                     "What error can occur, according to it?", "Summarize the last paragraph.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.parser("TTFT under concurrency: fcfs against uncached_first")
    options.config(p, default=None,
                   help="kvstrata YAML config (default configs/pressure.yaml; with --guidellm configs/default.yaml)")
    options.overrides(p, help="override a config key (repeatable)")
    options.data(p, None, help="longdoc QA jsonl (doc, question per line); default: built in")
    p.add_argument("--docs", type=options.positive_int, default=6,
                   help=f"documents in the workload (built in: at most {len(BUILTIN_DOCS)})")
    p.add_argument("--doc-tokens", type=options.positive_int, default=2000,
                   help="cut each document to this many tokens")
    p.add_argument("--requests", type=options.positive_int, default=None,
                   help="requests in the workload (default 32; with --guidellm 60)")
    p.add_argument("--zipf-exponent", type=float, default=1.2)
    options.seed(p)
    arrivals = p.add_mutually_exclusive_group()
    arrivals.add_argument("--streams", type=options.positive_int, default=4, help="closed-loop clients (default 4)")
    arrivals.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    p.add_argument("--max-tokens", type=options.positive_int, default=None,
                   help="tokens generated per request (default 8; with --guidellm 16)")
    served = p.add_argument_group("servers under guidellm (--guidellm)")
    served.add_argument("--guidellm", default=None, metavar="SIDES",
                        help="comma separated, some of kvstrata,vllm: the servers under guidellm, in turn, instead "
                             "of fcfs against uncached_first in this process")
    served.add_argument("--suffix-tokens", type=options.non_negative_int, default=60,
                        help="each prompt's own tokens after its prefix")
    options.dtype(served, default="float32", help="both servers' dtype")
    served.add_argument("--kv-cache-mib", type=options.positive_int, default=512,
                        help="KV cache on the device, each: our device tier, vLLM's --kv-cache-memory-bytes")
    served.add_argument("--max-model-len", type=options.positive_int, default=4096, help="vLLM's --max-model-len")
    options.name(served, "guidellm_vs_vllm", help="stem of the --guidellm output files")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies to compare, comma separated")
    options.threads(p, default=None, help="torch threads (default: torch's choice)")
    options.out_dir(p, help="write ttft_concurrency.md and .json here")
    args = p.parse_args(argv)
    if args.guidellm is not None:
        from benchmarks.lib.served_vs_vllm import SIDES

        args.guidellm = [x.strip() for x in args.guidellm.split(",") if x.strip()]
        if not args.guidellm or set(args.guidellm) - set(SIDES):
            p.error(f"--guidellm: expected some of {', '.join(SIDES)}, got {args.guidellm}")
        if args.rate is not None:
            p.error("--guidellm runs closed-loop streams (--streams), not --rate")
        defaults = {"config": REPO_ROOT / "configs" / "default.yaml", "requests": 60, "max_tokens": 16}
        if args.threads is None:
            args.threads = 1
    else:
        defaults = {"config": DEFAULT_CONFIG, "requests": 32, "max_tokens": 8}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, str(value) if key == "config" else value)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = set(args.policies) - set(POLICIES)
    if unknown or not args.policies:
        p.error(f"--policies: expected some of {', '.join(POLICIES)}, got {args.policies}")
    return args


# ---------------------------------------------------------------------------------------------- workload

def build_requests(args, tokenizer) -> list[dict]:
    """`args.requests` prompts: Zipf-drawn documents, each draw asking the document's next question
    (rephrased once its questions run out), so no two prompts are equal."""
    if args.data:
        questions = load_questions(args.data)
    else:
        questions = OrderedDict((f"{DOC_PREFIX}{name}", list(BUILTIN_QUESTIONS)) for name in BUILTIN_DOCS)
    names = list(questions)[:args.docs]
    if len(names) < args.docs:
        raise SystemExit(f"--docs {args.docs}: only {len(names)} documents are known")

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    documents = OrderedDict((n, cut_document(load_document(n), args.doc_tokens, encode, tokenizer.decode))
                            for n in names)
    num_questions = min(len(questions[n]) for n in names)
    asked = [0] * len(names)
    requests = []
    for d, q in zipf_order(len(names), num_questions, args.requests, args.zipf_exponent, args.seed):
        question = questions[names[d]][q]
        rounds = asked[d] // num_questions
        if rounds:
            question = REPHRASINGS[(rounds - 1) % len(REPHRASINGS)].format(question=question)
        asked[d] += 1
        content = f"{documents[names[d]]}\n\nQuestion: {question}"
        requests.append({"index": len(requests), "doc": d, "token_ids": render_chat(tokenizer, content)})
    return requests


def arrival_plan(args, num_requests: int) -> list[float] | None:
    """Poisson arrival offsets in seconds (None: closed-loop streams)."""
    if args.rate is None:
        return None
    rng = random.Random(args.seed)
    t, plan = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(args.rate)
        plan.append(t)
    return plan


# ---------------------------------------------------------------------------------------------- driving

class Driver:
    """Feeds one engine the workload and records every request as it finishes."""

    def __init__(self, engine, params):
        self.engine = engine
        self.params = params
        self.records: dict[str, dict] = {}
        self._token_times: dict[str, list[float]] = {}  # when each request's tokens came out
        self._ids = 0
        self.started = time.perf_counter()

    def submit(self, spec: dict, stream: int | None = None, arrival_time: float | None = None) -> str:
        """Send one request; `arrival_time` (perf_counter seconds) when it was due earlier than now."""
        request_id = f"c{self._ids}"
        self._ids += 1
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.engine.add_request(request_id, spec["token_ids"], self.params, arrival_time=arrival_time)
        self.records[request_id] = {"index": spec["index"], "doc": spec["doc"], "stream": stream,
                                    "arrival_s": arrival_time - self.started}
        return request_id

    def step(self) -> list[str]:
        """One engine step; the ids of the requests that finished in it."""
        finished = []
        stepped = self.engine.step()
        now = time.perf_counter()
        for request in stepped:
            times = self._token_times.setdefault(request.request_id, [])
            times.append(now)
            if request.is_finished:
                by_tier = dict(request.cached_tokens_by_tier or {})
                self.records[request.request_id].update(
                    ttft_s=request.ttft_s, prompt_tokens=request.num_prompt_tokens,
                    output_tokens=len(request.output_token_ids), cached_tokens_by_tier=by_tier,
                    hit_tier=hit_tier(by_tier, request.num_prompt_tokens), token_ids=list(request.output_token_ids),
                    receipt=_receipt_ms(request.receipt),
                    # between a request's tokens: how long a streaming answer stalled
                    token_gaps_s=[b - a for a, b in zip(times, times[1:])])
                del self._token_times[request.request_id]
                self.engine.release(request.request_id)
                finished.append(request.request_id)
        return finished


def _receipt_ms(receipt) -> dict | None:
    """Where a request's TTFT went (queue, lookup, load, prefill), in ms, for the JSON."""
    if receipt is None:
        return None
    return {"queue_ms": receipt.queue_ms, "lookup_ms": receipt.lookup_ms, "load_ms": receipt.load_ms,
            "prefill_ms": receipt.prefill_ms}


def run_streams(driver: Driver, requests: list[dict], streams: int) -> None:
    queues = [deque(requests[i::streams]) for i in range(streams)]
    owner = {}
    for s, q in enumerate(queues):
        if q:
            owner[driver.submit(q.popleft(), s)] = s
    while driver.engine.has_unfinished_requests():
        for request_id in driver.step():
            s = owner.pop(request_id)
            if queues[s]:
                owner[driver.submit(queues[s].popleft(), s)] = s


def run_poisson(driver: Driver, requests: list[dict], plan: list[float]) -> None:
    start = time.perf_counter()
    pending = deque(zip(plan, requests))

    def submit_due() -> None:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            # due while a step ran: its TTFT counts from when it was due, as a server's would
            due, spec = pending.popleft()
            driver.submit(spec, arrival_time=start + due)

    # as the server does, the engine takes those due while a step computes within that step
    driver.engine.take_arrivals = submit_due
    while pending or driver.engine.has_unfinished_requests():
        submit_due()
        if driver.engine.has_unfinished_requests():
            driver.step()
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))


def make_engine(config, loaded, policy: str):
    from kvstrata import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    return LLMEngine(load_config(config, {"scheduler.policy": policy}), loaded=loaded)



def warm_up(engine, params, token_ids) -> None:
    """One request under a unique salt: torch's first-call costs stay out of the figures."""
    engine.add_request("warm-up", list(token_ids), params, cache_salt=f"warm-{time.time_ns()}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.release("warm-up")


def run_policy(policy: str, config, loaded, requests: list[dict], args) -> dict:
    from kvstrata.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = make_engine(config, loaded, policy)
    try:
        warm_up(engine, params, requests[0]["token_ids"])
        driver = Driver(engine, params)
        started = time.perf_counter()
        plan = arrival_plan(args, len(requests))
        if plan is None:
            run_streams(driver, requests, args.streams)
        else:
            run_poisson(driver, requests, plan)
        wall_s = time.perf_counter() - started
    finally:
        engine.close()
    records = mark_joined(list(driver.records.values()))
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in records)
    return {"policy": policy, "wall_s": wall_s, "throughput_tok_s": tokens / wall_s, "records": records,
            "hit": summarize([r["ttft_s"] for r in records if r["hit_tier"] != MISS and not r["joined"]]),
            "miss": summarize([r["ttft_s"] for r in records if r["hit_tier"] == MISS]),
            "joined": summarize([r["ttft_s"] for r in records if r["joined"]]),
            "token_gap": summarize([gap for r in records for gap in r["token_gaps_s"]])}


def mark_joined(records: list[dict]) -> list[dict]:
    """Mark the questions that arrived while their document was being read for another request (a
    miss on it had arrived and not yet given its first token): they wait for that reading, then
    compute only their own tokens, so they are neither hits (a document cached when they came)
    nor misses (a document computed for them), and are reported apart."""
    misses = [r for r in records if r["hit_tier"] == MISS]
    for r in records:
        r["joined"] = r["hit_tier"] != MISS and any(
            m["doc"] == r["doc"] and m["arrival_s"] <= r["arrival_s"] < m["arrival_s"] + m["ttft_s"] for m in misses)
    return records


def run_hits_alone(config, loaded, requests: list[dict], hit_indices: list[int], args) -> dict | None:
    """Each hit's TTFT when sent alone, its document computed just before by another question."""
    from kvstrata.engine.sampling import SamplingParams

    if not hit_indices:
        return None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = make_engine(config, loaded, "fcfs")
    first_of_doc = {}
    for i, spec in enumerate(requests):
        first_of_doc.setdefault(spec["doc"], i)
    times = []
    try:
        warm_up(engine, params, requests[0]["token_ids"])
        driver = Driver(engine, params)
        for i in hit_indices:
            for index in (first_of_doc[requests[i]["doc"]], i):  # the document, then the hit alone
                request_id = driver.submit(requests[index])
                while engine.has_unfinished_requests():
                    driver.step()
                if index == i:
                    times.append(driver.records[request_id]["ttft_s"])
    finally:
        engine.close()
    return summarize(times)


# ---------------------------------------------------------------------------------------------- report

def goals(results: dict, alone: dict | None) -> list[tuple[str, str]]:
    """(goal, measured ratio and PASS or MISS) for each goal the results can tell."""
    fcfs, ours = results.get("fcfs"), results.get("uncached_first")
    rows = []

    def row(name: str, value: float, limit: float, at_most: bool = True) -> None:
        ok = value <= limit if at_most else value >= limit
        rows.append((name, f"{value:.2f}x ({'PASS' if ok else 'MISS'})"))

    if ours and ours["hit"] and alone:
        row("uncached_first hit p50 / alone hit p50, at most 2x", ours["hit"]["p50"] / alone["p50"], 2.0)
        row("uncached_first hit p90 / alone hit p90, at most 4x", ours["hit"]["p90"] / alone["p90"], 4.0)
    if ours and fcfs and ours["miss"] and fcfs["miss"]:
        row("uncached_first miss p50 / fcfs miss p50, at most 1.25x", ours["miss"]["p50"] / fcfs["miss"]["p50"], 1.25)
    if ours and fcfs:
        row("uncached_first throughput / fcfs throughput, at least 0.9x",
            ours["throughput_tok_s"] / fcfs["throughput_tok_s"], 0.9, at_most=False)
    return rows


def _ms(summary: dict | None, key: str) -> str:
    return "n/a" if not summary else f"{1000 * summary[key]:.0f}"


def markdown(result: dict) -> str:
    load = result["load_average_1min"]
    lines = ["# TTFT under concurrency", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"Code: commit {result['source']['commit']}"
             + (f" (engine sources modified: {', '.join(result['source']['engine_sources_modified'])})"
                if result['source']['engine_sources_modified'] else "") + "  ",
             f"Load average (1 min) during the run: min {load['min']:.2f}, mean {load['mean']:.2f}, "
             f"max {load['max']:.2f}; the machine was shared, so absolute times are noisy.  ",
             f"Started {result['started']}, took {result['took_s']:.0f} s.", "",
             f"Workload: {result['workload']}.", "",
             "| policy | hits | hit p50 ms | hit p90 ms | hit p99 ms | misses | miss p50 ms | miss p90 ms "
             "| miss p99 ms | token gap p90 ms | token gap max ms | throughput tok/s | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["policies"].items():
        lines.append(f"| {name} | {r['hit']['n'] if r['hit'] else 0} | {_ms(r['hit'], 'p50')} | {_ms(r['hit'], 'p90')} "
                     f"| {_ms(r['hit'], 'p99')} | {r['miss']['n'] if r['miss'] else 0} | {_ms(r['miss'], 'p50')} "
                     f"| {_ms(r['miss'], 'p90')} | {_ms(r['miss'], 'p99')} | {_ms(r.get('token_gap'), 'p90')} "
                     f"| {_ms(r.get('token_gap'), 'max')} | {r['throughput_tok_s']:.0f} "
                     f"| {r['wall_s']:.1f} |")
    alone = result["hits_alone"]
    joined = [f"{name} {r['joined']['n']}, p50 {_ms(r['joined'], 'p50')} ms" for name, r in result["policies"].items()
              if r.get("joined")]
    if joined:
        lines += ["", "Not counted as hits: questions that arrived while their document was being read for "
                      "another request (they wait for that reading, then compute only their own tokens): "
                      + "; ".join(joined) + "."]
    lines += ["", f"Hits sent alone (document cached, nothing else running): p50 {_ms(alone, 'p50')} ms, "
                  f"p90 {_ms(alone, 'p90')} ms.", "", "| goal | measured |", "|---|---|"]
    lines += [f"| {name} | {status} |" for name, status in result["goals"]]
    if result["outputs_equal"] is not None:
        lines += ["", "Greedy outputs identical under every policy: "
                  f"{'yes' if result['outputs_equal'] else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.guidellm:
        return run_guidellm(args)
    from kvstrata import load_config

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_config(args.config, args.overrides)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvstrata-concurrency-") as tmp, LoadSampler() as load_sampler:

        def fresh_config(run: str):
            """The config with an empty disk tier of the run's own, if the config has one."""
            if base.cache.tiers.disk is None:
                return base
            return load_config(base, {"cache.tiers.disk.path": f"{tmp}/{run}"})

        loaded, _ = load(base)
        requests = build_requests(args, loaded.tokenizer)
        by_policy = {}
        for policy in args.policies:
            print(f"policy {policy} ...", flush=True)
            by_policy[policy] = run_policy(policy, fresh_config(policy), loaded, requests, args)
        first = by_policy[args.policies[0]]["records"]
        hit_indices = sorted(r["index"] for r in first if r["hit_tier"] != MISS and not r["joined"])
        print("hits alone ...", flush=True)
        alone = run_hits_alone(fresh_config("alone"), loaded, requests, hit_indices, args)
    outputs = [[r["token_ids"] for r in sorted(res["records"], key=lambda r: r["index"])] for res in by_policy.values()]
    arrivals = f"{args.streams} closed-loop streams" if args.rate is None else f"Poisson arrivals at {args.rate}/s"
    result = {**results.record("ttft_concurrency"), "load_average_1min": load_sampler.summary(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "took_s": time.time() - started,
              "workload": f"{args.requests} requests on {args.docs} documents of up to {args.doc_tokens} tokens "
                          f"(Zipf exponent {args.zipf_exponent}), {arrivals}, {args.max_tokens} tokens generated each, "
                          f"{base.resolved_dtype()}, {torch.get_num_threads()} torch threads",
              "policies": {name: {k: v for k, v in r.items() if k != "records"} for name, r in by_policy.items()},
              "hits_alone": alone, "goals": goals(by_policy, alone),
              "outputs_equal": all(o == outputs[0] for o in outputs) if len(outputs) > 1 else None,
              "records": {name: r["records"] for name, r in by_policy.items()}}
    results.publish(result, markdown(result), args.out_dir, "ttft_concurrency")
    return 0


def run_guidellm(args) -> int:
    """`--guidellm`: the servers side by side under guidellm (benchmarks/lib/served_vs_vllm.py)."""
    from benchmarks.lib import served_vs_vllm

    result = served_vs_vllm.run(args, log=lambda line: print(line, flush=True))
    results.publish(result, served_vs_vllm.markdown(result), args.out_dir)
    return 0
