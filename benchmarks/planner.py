"""`kvstrata plan` against an independent LRU replay, its speed, and a sweep's plot.

    python benchmarks/planner.py sample benchmarks/data/traces/sample_trace.jsonl   # the shipped sample
    python benchmarks/planner.py longdoc longdoc_trace.jsonl                         # long-document QA, Zipf reuse
    python benchmarks/planner.py accuracy --trace conversation_trace.jsonl            # -> results/planner.{json,md}
    python benchmarks/planner.py serve-check                                          # -> results/planner_serve.json

`serve-check` plays a tiny trace (token ids synthesized from its ids) against `kvstrata serve` on this machine,
one request after another, with `server.trace_log` on, and compares the TTFT the server measures with the TTFT
`kvstrata plan` projects for the same trace from a profile `kvstrata plan --measure` wrote with the same config.

`accuracy` replays a Mooncake-format trace (the FAST'25 conversation trace: kvcache-ai/Mooncake,
FAST25-release/traces/conversation_trace.jsonl, Apache-2.0; not shipped here) through the planner with a
device tier of 10,000 trace blocks, and with a device + CPU tier (`offload: on_evict`) of 10k + 40k trace
blocks, and compares each hit ratio with `lru_hit_ratio`, a plain LRU of trace ids of the whole capacity
(the Mooncake paper's Table 1 policy). It does so with each id one 16-token block (`--trace-block-tokens 16`)
and with each id its 512 tokens (32 blocks of 16). Then it plans eight replicas routed round-robin and by
prefix, and sweeps the CPU and device tiers' sizes of eight prefix-routed replicas, with a plot.
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose
    sys.path[0] = str(ROOT)  # kernels.py would stand for the installed `kernels`

from benchmarks.lib import options, results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BLOCK_SIZE = 16


def lru_hit_ratio(requests: Sequence, capacity_ids: int, block_tokens: int, block_size: int = BLOCK_SIZE) -> float:
    """Share of prompt tokens found by a plain LRU of `capacity_ids` trace ids: a request hits its leading ids
    held (at most all but its last token, rounded down to a block), then every id of it becomes the most recently
    used, the least recently used going when full. Nothing of kvstrata is used: it is the oracle."""
    lru: OrderedDict = OrderedDict()
    hit = total = 0
    for r in requests:
        n = len(r.hash_ids)
        tokens = min(max(r.input_length, (n - 1) * block_tokens + 1), n * block_tokens) if n else r.input_length
        k = 0
        for i in r.hash_ids:
            if i not in lru:
                break
            k += 1
        hit += min(k * block_tokens, (tokens - 1) // block_size * block_size)
        total += tokens
        for i in r.hash_ids:
            if i in lru:
                lru.move_to_end(i)
            else:
                lru[i] = None
                if len(lru) > capacity_ids:
                    lru.popitem(last=False)
    return hit / total


def make_sample(num_requests: int = 400, seed: int = 0) -> list[dict]:
    """A Mooncake-format trace of multi-turn conversations: a few system prompts shared by many sessions,
    each turn's prompt the previous turn's context plus the answer and a new message (ids extend the
    previous turn's), sessions interleaved, arrivals about 300 ms apart. Deterministic in `seed`."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [new_ids(rng.randint(1, 4)) for _ in range(6)]
    sessions: list[dict] = []
    records = []
    t = 0
    while len(records) < num_requests:
        t += int(rng.expovariate(1 / 300))
        if not sessions or rng.random() < 0.3:
            sessions.append({"ids": list(rng.choice(systems)), "turns": rng.randint(1, 8)})
        s = rng.choice(sessions)
        s["ids"] += new_ids(rng.randint(1, 6))
        input_length = (len(s["ids"]) - 1) * 512 + rng.randint(1, 512)
        output_length = rng.randint(20, 600)
        records.append({"timestamp": t, "input_length": input_length, "output_length": output_length,
                        "hash_ids": list(s["ids"])})
        s["turns"] -= 1
        if s["turns"] == 0:
            sessions.remove(s)
        else:
            s["ids"] += new_ids(1)  # the answer becomes part of the next turn's context
    return records


def make_longdoc(num_docs: int = 60, num_requests: int = 3000, zipf: float = 0.9, doc_ids: int = 4,
                 seed: int = 1, answer_tokens: int = 16) -> list[dict]:
    """A Mooncake-format trace of long-document QA: each request one of `num_docs` documents of `doc_ids` ids, drawn
    with Zipf(`zipf`) popularity, and a question of its own (one id), a prompt just short of the ids' span,
    `answer_tokens` output tokens, 3 s apart (no queueing). Deterministic in `seed`."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf for k in range(num_docs)]
    next_question = num_docs * doc_ids
    records = []
    for k in range(num_requests):
        doc = rng.choices(range(num_docs), weights)[0]
        ids = list(range(doc * doc_ids, (doc + 1) * doc_ids)) + [next_question + k]
        records.append({"timestamp": 3000 * k, "input_length": len(ids) * 512 - 400, "output_length": answer_tokens,
                        "hash_ids": ids})
    return records


def plan_json(trace: str, config: str, *args: str) -> tuple[dict, float]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvstrata", "plan", "--config", config, "--trace", trace, "--json",
                          *args], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1]), time.perf_counter() - started


def accuracy(trace: str, config: str) -> dict:
    from kvstrata.trace import read_trace

    requests = read_trace(trace)
    rows = []
    for block_tokens in (16, 512):
        per_id = block_tokens // BLOCK_SIZE
        for name, device, cpu in (("device 10k", 10_000, 0), ("device 10k + cpu 40k (on_evict)", 10_000, 40_000)):
            sets = [f"cache.tiers.device.size={device * per_id}", f"cache.tiers.cpu.size={cpu * per_id}",
                    "cache.offload=on_evict"]
            args = [a for s in sets for a in ("--set", s)]
            result, wall_s = plan_json(trace, config, "--trace-block-tokens", str(block_tokens), *args)
            oracle = lru_hit_ratio(requests, device + cpu, block_tokens)
            rows.append({"case": name, "trace_block_tokens": block_tokens, "planner": result["hit_ratio"],
                         "by_tier": result["by_tier"], "lru_oracle": oracle,
                         "difference": result["hit_ratio"] - oracle, "replay_s": result["replay_s"],
                         "wall_s": wall_s, "requests": result["requests"]})
            print(json.dumps(rows[-1]), flush=True)
    replicas = []
    for route in ("round_robin", "prefix"):
        result, wall_s = plan_json(trace, config, "--replicas", "8", "--route", route, *REPLICA_SETS)
        replicas.append({"route": route, "hit_ratio": result["hit_ratio"], "by_tier": result["by_tier"],
                         "ttft_ms": result["ttft_ms"], "replay_s": result["replay_s"], "wall_s": wall_s})
        print(json.dumps(replicas[-1]), flush=True)
    return {"trace": Path(trace).name, "requests": len(requests), "rows": rows, "replicas": replicas}


REPLICA_SETS = ("--set", "cache.tiers.device.size=40GiB", "--set", "cache.tiers.cpu.size=256GiB")


def write_results(data: dict, plot: str) -> None:
    lines = ["# kvstrata plan: accuracy and speed", "",
             f"Trace: `{data['trace']}` ({data['requests']} requests), the Mooncake FAST'25 conversation trace "
             "(kvcache-ai/Mooncake, Apache-2.0; not shipped). Config: `model: llama-3-8b` (dummy weights, "
             "bfloat16), 16-token blocks, sizes as block counts. Oracle: a plain LRU of trace ids of the same "
             "total capacity (`lru_hit_ratio` in benchmarks/planner.py).", "",
             "Command: `python benchmarks/planner.py accuracy --trace conversation_trace.jsonl`", "",
             "| case | tokens per id | planner hit ratio | LRU oracle | difference | replay (s) | wall (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["rows"]:
        lines.append(f"| {r['case']} | {r['trace_block_tokens']} | {r['planner']:.4f} | {r['lru_oracle']:.4f} | "
                     f"{r['difference']:+.4f} | {r['replay_s']:.1f} | {r['wall_s']:.1f} |")
    if data.get("replicas"):
        lines += ["", "Eight replicas, each with a 40GiB device tier and a 256GiB CPU tier (`--replicas 8 --route R "
                      + " ".join(REPLICA_SETS) + "`), assumed default speeds:", "",
                  "| route | hit ratio | device | cpu | projected mean TTFT (ms) | p90 (ms) | replay (s) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in data["replicas"]:
            lines.append(f"| {r['route']} | {r['hit_ratio']:.3f} | {r['by_tier']['device']:.3f} | "
                         f"{r['by_tier']['cpu']:.3f} | {r['ttft_ms']['mean']:.0f} | {r['ttft_ms']['p90']:.0f} | "
                         f"{r['replay_s']:.1f} |")
    if data.get("sweep"):
        lines += ["", f"Sweep (`{data['sweep']['command']}`):", "", "```", data["sweep"]["table"], "```", "",
                  f"![sweep]({Path(plot).name})"]
    serve_path = RESULTS / "planner_serve.json"
    if serve_path.exists():
        lines += ["", *serve_report(json.loads(serve_path.read_text()))]
    results.write(RESULTS, {"benchmark": "planner", **data}, lines)


def serve_report(d: dict) -> list[str]:
    """serve-check's report: the TTFT `kvstrata serve` measured against the TTFT the planner projected."""
    return ["## Projected against served TTFT (this machine: 2 shared CPU cores)", "",
            f"Command: `python benchmarks/planner.py serve-check`. {d['requests']} requests of a tiny generated "
            f"trace ({d['block_tokens']} tokens an id, token ids synthesized from the ids, 4 tokens answered), "
            "played one after another against `kvstrata serve` (the embedded model, "
            + ", ".join(f"`{x}`" for x in d["settings"] if "path" not in x)
            + ", `server.trace_log` on); the planner replays the same trace from a profile `kvstrata plan "
            "--measure` wrote with the same config just before.", "",
            "| | hit ratio | mean TTFT (ms) | median TTFT (ms) |", "| --- | ---: | ---: | ---: |",
            f"| served (measured) | {d['served']['hit_ratio']:.3f} | {d['served']['ttft_ms_mean']:.0f} | "
            f"{d['served']['ttft_ms_p50']:.0f} |",
            f"| planned (projected) | {d['planned']['hit_ratio']:.3f} | {d['planned']['ttft_ms_mean']:.0f} | "
            f"{d['planned']['ttft_ms_p50']:.0f} |", "",
            f"Projected / served mean TTFT: {d['ttft_mean_ratio']:.2f}. One run on a shared machine: the "
            "profile's step cost moves with the other work on it. The server's own trace "
            f"(`server.trace_log`, file mode {d['trace_log']['mode']}) held {d['trace_log']['requests']} "
            f"requests; replayed at its 512 tokens an id it gives a hit ratio of "
            f"{d['trace_log']['hit_ratio']:.3f} (coarser ids: a prompt's last, partly shared span counts "
            "as a miss)."]


SERVE_BLOCK_TOKENS = 32  # tokens an id stands for in the serve check: short prompts for a shared 2-core CPU
SERVE_SETTINGS = ("model.dtype=float32", "cache.tiers.device.size=48", "cache.tiers.cpu.size=256",
                  "cache.offload=write_through")


def tiny_trace(num_requests: int = 16, max_ids: int = 8, output_length: int = 4) -> list[dict]:
    """The sample's conversations cut to their first `max_ids` ids, each id `SERVE_BLOCK_TOKENS` tokens,
    requests 30 s apart (played one after another: no queueing, which the planner does not project)."""
    records = []
    for k, r in enumerate(make_sample(num_requests, seed=1)):
        ids = r["hash_ids"][:max_ids]
        records.append({"timestamp": 30_000 * k, "input_length": len(ids) * SERVE_BLOCK_TOKENS,
                        "output_length": output_length, "hash_ids": ids})
    return records


def synthesized_tokens(hash_ids: Sequence[int], block_tokens: int, vocab: int = 49152) -> list[int]:
    """Token ids for a trace request: each id's tokens a function of the id alone, so equal ids give equal
    tokens and a shared run of leading ids a shared prefix."""
    tokens = []
    for i in hash_ids:
        rng = random.Random(i)
        tokens += [rng.randrange(100, vocab) for _ in range(block_tokens)]
    return tokens


def write_trace(path: Path, records: list[dict]) -> None:
    """A trace file: one JSON record a line (the Mooncake format)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def serve_check(work: Path) -> dict:
    import httpx

    from tests.server_process import DEFAULT_CONFIG, ServerProcess

    shutil.rmtree(work, ignore_errors=True)  # a disk tier left by an earlier run would serve this one's prompts
    work.mkdir(parents=True)
    trace = work / "tiny_trace.jsonl"
    records = tiny_trace()
    write_trace(trace, records)
    disk = work / "kvstore"
    settings = [*SERVE_SETTINGS, f"cache.tiers.disk.path={disk}", "cache.tiers.disk.size=256MiB"]
    sets = [a for s in settings for a in ("--set", s)]
    profile = work / "profile.json"
    subprocess.run([sys.executable, "-m", "kvstrata", "plan", "--measure", str(profile), "--config",
                    str(DEFAULT_CONFIG), *sets], check=True, cwd=ROOT, capture_output=True)
    recorded = work / "served_trace.jsonl"
    recorded.unlink(missing_ok=True)
    server = ServerProcess(work / "kvstore_serve", *SERVE_SETTINGS[1:], f"server.trace_log={recorded}")
    measured = []
    try:
        for r in records:
            body = {"prompt": synthesized_tokens(r["hash_ids"], SERVE_BLOCK_TOKENS), "max_tokens": r["output_length"],
                    "min_tokens": r["output_length"], "temperature": 0.0}
            answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300).json()
            measured.append({"ttft_ms": answer["kvstrata"]["ttft_ms"],
                             "cached_tokens_by_tier": answer["kvstrata"]["cached_tokens_by_tier"]})
    finally:
        server.terminate()
    planned, _ = plan_json(str(trace), str(DEFAULT_CONFIG), "--profile", str(profile), "--trace-block-tokens",
                           str(SERVE_BLOCK_TOKENS), *[a for s in settings for a in ("--set", s)])
    from_log, _ = plan_json(str(recorded), str(DEFAULT_CONFIG), "--profile", str(profile), *sets)
    ttfts = sorted(m["ttft_ms"] for m in measured)
    prompt_tokens = sum(r["input_length"] for r in records)
    served_hit = sum(sum(m["cached_tokens_by_tier"].values()) for m in measured) / prompt_tokens
    mean = sum(ttfts) / len(ttfts)
    return {"requests": len(records), "block_tokens": SERVE_BLOCK_TOKENS, "settings": settings,
            "profile": json.loads(profile.read_text()),
            "served": {"ttft_ms_mean": mean, "ttft_ms_p50": ttfts[len(ttfts) // 2], "hit_ratio": served_hit},
            "planned": {"ttft_ms_mean": planned["ttft_ms"]["mean"], "ttft_ms_p50": planned["ttft_ms"]["p50"],
                        "hit_ratio": planned["hit_ratio"], "by_tier": planned["by_tier"]},
            "ttft_mean_ratio": planned["ttft_ms"]["mean"] / mean,
            "trace_log": {"requests": from_log["requests"], "hit_ratio": from_log["hit_ratio"],
                          "mode": oct(recorded.stat().st_mode & 0o777)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = options.parser(__doc__, whole_doc=True)
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="write the generated sample trace")
    sample.add_argument("out")
    sample.add_argument("--requests", type=options.positive_int, default=400)
    longdoc = commands.add_parser("longdoc", help="write a long-document QA trace (Zipf reuse of documents)")
    longdoc.add_argument("out")
    longdoc.add_argument("--docs", type=options.positive_int, default=60)
    longdoc.add_argument("--requests", type=options.positive_int, default=3000)
    longdoc.add_argument("--zipf", type=float, default=0.9)
    longdoc.add_argument("--answer-tokens", type=options.non_negative_int, default=16,
                         help="each request's output tokens")
    options.seed(longdoc, default=1)
    acc = commands.add_parser("accuracy", help="planner against the LRU oracle, its speed, and a sweep's plot")
    acc.add_argument("--trace", required=True)
    options.config(acc, default=str(ROOT / "benchmarks" / "data" / "traces" / "plan_llama3_8b.yaml"))
    acc.add_argument("--plot", default=str(RESULTS / "planner.png"))
    commands.add_parser("report", help="write results/planner.md again from the JSON results")
    check = commands.add_parser("serve-check", help="projected against served TTFT on a tiny trace")
    check.add_argument("--work", default="/tmp/kvstrata_plan_check")
    args = parser.parse_args(argv)
    if args.command == "serve-check":
        data = serve_check(Path(args.work))
        results.write(RESULTS, {"benchmark": "planner_serve", **data}, serve_report(data))
        print(json.dumps({k: data[k] for k in ("served", "planned", "ttft_mean_ratio", "trace_log")}, indent=2))
        return 0
    if args.command == "report":
        write_results(json.loads((RESULTS / "planner.json").read_text()), str(RESULTS / "planner.png"))
        return 0
    if args.command == "sample":
        write_trace(Path(args.out), make_sample(args.requests))
        return 0
    if args.command == "longdoc":
        write_trace(Path(args.out), make_longdoc(args.docs, args.requests, args.zipf, seed=args.seed,
                                                      answer_tokens=args.answer_tokens))
        return 0
    data = accuracy(args.trace, args.config)
    sweep_args = ["--replicas", "8", "--route", "prefix", "--sweep", "cache.tiers.cpu.size=0,64GiB,256GiB,1TiB",
                  "--sweep", "cache.tiers.device.size=40GiB,60GiB"]
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvstrata", "plan", "--config", args.config, "--trace", args.trace,
                          *sweep_args, "--plot", args.plot], check=True, capture_output=True, text=True,
                         cwd=ROOT).stdout
    data["sweep"] = {"command": "kvstrata plan --config plan_llama3_8b.yaml --trace conversation_trace.jsonl "
                                + " ".join(sweep_args) + " --plot planner.png",
                     # (the plot's path, this machine's, left out)
                     "table": "\n".join(line for line in out.strip().splitlines() if not line.startswith("wrote ")),
                     "wall_s": time.perf_counter() - started}
    print(out)
    write_results(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
