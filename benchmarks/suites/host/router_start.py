"""How long `kvstrata route` takes to start, and what it holds, this commit's against `--baseline`'s: each start in
a process of its own (nothing imported before it), the sides in turn. Timed: the imports and `load_router` (the
embedded model's tokenizer, read from its converted copy, and the router's threads, up to its first round of
health checks against one replica nobody listens for), as `kvstrata route` runs them before it listens; then the
process's peak memory and whether it imported torch.

    python benchmarks/host.py router-start --baseline REV --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import socket
import statistics
import sys
import time

from benchmarks.lib import in_turn, options, results
from benchmarks.lib.machine import provenance_lines


def worker(replica_url: str) -> dict:
    started = time.perf_counter()
    import kvstrata
    from kvstrata.engine.config import load_config
    from kvstrata.serving.router import load_router

    imported = time.perf_counter()
    router = load_router(load_config({"router": {"replicas": [{"url": replica_url}]}}))
    loaded = time.perf_counter()
    router.close()
    import resource

    return {"engine_code": list(kvstrata.__path__)[0], "import_s": imported - started, "load_s": loaded - imported,
            "start_s": loaded - started, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "torch_imported": "torch" in sys.modules}


def report(result: dict) -> list[str]:
    baseline, runs = result["baseline"], result["runs"]
    median = {side: {key: statistics.median(r[key] for r in side_runs) for key in ("import_s", "load_s", "start_s",
                                                                                   "max_rss_mb")}
              for side, side_runs in runs.items()}
    lines = ["# Starting the router", "", *provenance_lines(result), "",
             "`kvstrata route`'s start in a process of its own: its imports, then `load_router` (the embedded model's "
             "tokenizer from its converted copy, the router's threads, its first round of health checks against one "
             "replica nobody listens for); medians of "
             f"{result['repeats']} runs per side" + (f", this commit and {baseline} in turn" if baseline else "")
             + " (benchmarks/suites/host/router_start.py), every run in `router_start.json`.", "",
             "| side | imports s | load_router s | start s | peak memory MB | imports torch |",
             "|---|---:|---:|---:|---:|---|"]
    for side, m in median.items():
        label = "this commit" if side == "this" else baseline
        torch_imported = {r["torch_imported"] for r in runs[side]}
        imports_torch = {frozenset({True}): "yes", frozenset({False}): "no"}.get(frozenset(torch_imported), "varies")
        lines.append(f"| {label} | {m['import_s']:.2f} | {m['load_s']:.2f} | {m['start_s']:.2f} | "
                     f"{m['max_rss_mb']:.0f} | {imports_torch} |")
    if "baseline" in median:
        this, base = median["this"], median["baseline"]
        lines += ["", f"This commit against {baseline}: start {base['start_s'] / this['start_s']:.2f}x faster, "
                      f"{base['max_rss_mb'] / this['max_rss_mb']:.2f}x less peak memory."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.in_turn(parser, "router_start")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    with socket.socket() as sock:  # a port nobody listens on: the health check is refused at once
        sock.bind(("127.0.0.1", 0))
        replica_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    runs = in_turn.runs_in_turn(__file__, replica_url, args, lambda m: (
        f"start {m['start_s']:.2f} s (imports {m['import_s']:.2f}), {m['max_rss_mb']:.0f} MB, "
        f"torch {'imported' if m['torch_imported'] else 'not imported'}"))
    result = results.record("router_start", baseline=args.baseline, repeats=args.repeats, runs=runs)
    results.publish(result, report(result), args.out_dir)
    return 0
