"""vLLM's rows of the TTFT-under-pressure benchmark (`ttft.py pressure --peers vllm`): the same prompts (token ids),
the same weights, dtype and threads, vLLM's offline engine in a process and venv of its own (peers.py `VLLMPeer`).

    vllm_recompute        prefix caching off: every prompt computed in full
    vllm_device_budget    prefix caching on, its KV cache the bytes of our device tier (the pressure we are under)
    vllm_cache_all        prefix caching on, its KV cache holding the whole working set
    vllm_after_restart    a new vLLM process sized as vllm_cache_all, after that one exited: its cache went with it

Each row is a process of its own, started, sent one cold request (a prompt the workload never sends) and then the
workload, every figure the wall time of a `generate(max_tokens=1)` call. A request counts as a device hit when vLLM
reports at least half of its prompt cached (as our hits are classified), else a miss. Where vLLM cannot run here
(`PeerUnavailable`) the rows are one entry saying why in one line, and the benchmark goes on.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

from benchmarks.lib.ttft_stats import MISS, p50_of, ratio, summarize

ROWS = ("vllm_recompute", "vllm_device_budget", "vllm_cache_all", "vllm_after_restart")
# ours beside vLLM's: which of our configurations answers the same question as each vLLM row
COUNTERPARTS = {"vllm_recompute": "recompute", "vllm_device_budget": "device_only",
                "vllm_cache_all": "device_cpu", "vllm_after_restart": "disk_after_restart"}
VLLM_LARGEST_BLOCK = 256
UNAVAILABLE = "vllm"  # the results key of the one entry that says why vLLM did not run


def row_specs(device_bytes: int, working_set_bytes: int, min_bytes: int) -> dict[str, dict]:
    """Each row's prefix caching and KV cache bytes; no cache is smaller than one prompt (vLLM refuses to start
    with less than `max_model_len` of cache)."""
    device = max(device_bytes, min_bytes)
    everything = max(working_set_bytes, min_bytes)
    return {"vllm_recompute": {"prefix_caching": False, "kv_cache_bytes": device},
            "vllm_device_budget": {"prefix_caching": True, "kv_cache_bytes": device},
            "vllm_cache_all": {"prefix_caching": True, "kv_cache_bytes": everything},
            "vllm_after_restart": {"prefix_caching": True, "kv_cache_bytes": everything}}


def record(index: int, prompt, reply: dict) -> dict:
    cached = int(reply.get("cached_tokens") or 0)
    prompt_tokens = len(prompt.token_ids)
    return {"index": index, "phase": prompt.phase, "doc": prompt.doc, "repeat": prompt.repeat,
            "question_index": prompt.question_index, "prompt_tokens": prompt_tokens, "ttft_s": reply["seconds"],
            "cached_tokens": cached, "hit_tier": "device" if 2 * cached >= prompt_tokens else MISS}


def summarise_row(records: list[dict]) -> dict:
    def of(rows):
        return summarize([r["ttft_s"] for r in rows])

    return {"summary": of(records), "first_seen": of([r for r in records if not r["repeat"]]),
            "repeat": of([r for r in records if r["repeat"]]),
            "device_hit": of([r for r in records if r["hit_tier"] == "device"]),
            "miss": of([r for r in records if r["hit_tier"] == MISS]),
            "hits": sum(r["hit_tier"] == "device" for r in records)}


def run_vllm_rows(loaded, prompts: list, dtype: str, threads: int, device_blocks: int, working_set: int,
                  block_size: int, block_nbytes: int, log_dir: Path, log=print, rows=ROWS, make_peer=None) -> dict:
    """The vLLM rows on `prompts`, or `{UNAVAILABLE: {"available": False, "reason": ...}}` where vLLM cannot run.
    `make_peer(spec) -> peer` stands in for starting vLLM (tests)."""
    from benchmarks.lib.peers import PeerUnavailable

    max_model_len = max(len(p.token_ids) for p in prompts) + 16
    # vLLM's blocks are larger than ours (up to 256 tokens): one prompt in whole blocks of that size at least
    one_prompt = -(-max_model_len // VLLM_LARGEST_BLOCK) * VLLM_LARGEST_BLOCK * (block_nbytes // block_size)
    specs = row_specs(device_blocks * block_nbytes, working_set * block_nbytes, one_prompt)
    try:
        if make_peer is None:
            make_peer = _starter(loaded, dtype, threads, max_model_len, log_dir, log)
    except PeerUnavailable as why:
        log(f"vLLM rows skipped: {why}")
        return {UNAVAILABLE: {"available": False, "reason": str(why)}}
    results = {}
    for name in rows:
        spec = {**specs[name], "name": name}
        log(f"peer {name} (vLLM, prefix caching {'on' if spec['prefix_caching'] else 'off'}, "
            f"KV cache {spec['kv_cache_bytes'] >> 20} MiB) ...")
        try:
            started = time.perf_counter()
            peer = make_peer(spec)
            start_s = time.perf_counter() - started
        except PeerUnavailable as why:
            log(f"vLLM rows skipped: {why}")
            return {**results, UNAVAILABLE: {"available": False, "reason": str(why)}}
        try:
            cold_s = peer.first_token_latency(prompts[0].token_ids[:-1])  # a prompt the workload never sends
            records = [record(i, p, peer.generate(p.token_ids, 1)) for i, p in enumerate(prompts)]
        finally:
            peer.close()
        results[name] = {"available": True, "cold_ttft_s": cold_s, "records": records, "start_s": start_s,
                         "cache_bytes": spec["kv_cache_bytes"], "prefix_caching": spec["prefix_caching"],
                         "info": dict(getattr(peer, "info", {}) or {}), **summarise_row(records)}
        s = results[name]
        log(f"  p50 {s['summary']['p50']:.3f} s, {s['hits']} of {len(records)} device hits")
        gc.collect()
    return results


def _starter(loaded, dtype: str, threads: int, max_model_len: int, log_dir: Path, log):
    """A function that starts vLLM for a row's spec: the venv made (once) and the model folder written first, so
    that a vLLM that cannot run here says so before any row."""
    from benchmarks.lib.peers import PeerUnavailable, VLLMPeer, vllm_model_dir, vllm_python
    from kvstrata.engine.converted_model import converted_dir
    from kvstrata.engine.model_loader import model_identity

    source = loaded.source
    if source.load_format == "dummy":
        raise PeerUnavailable("vLLM not measured: the model has random weights (load_format: dummy)")
    python = vllm_python(log)
    folder = converted_dir(model_identity(source))
    if not (folder / dtype).is_dir():
        raise PeerUnavailable(f"vLLM not measured: no converted {dtype} weights to give it")
    model_dir = vllm_model_dir(folder / dtype, folder / "tokenizer", dtype)

    def start(spec: dict):
        return VLLMPeer(python, model_dir, dtype, threads, max_model_len, spec["kv_cache_bytes"],
                        log_path=log_dir / f"vllm-{spec['name']}.log", prefix_caching=spec["prefix_caching"])
    return start


# ---------------------------------------------------------------------------------------------- report

def _ms(summary: dict | None, key: str = "p50") -> str:
    if not summary or summary.get(key) is None:
        return "–"
    return f"{1e3 * summary[key]:.0f} ms"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def side_by_side(result: dict) -> list[str]:
    """The report's section: each vLLM row beside our configuration that answers the same question, p50s and
    ours / vLLM (below 1: we are faster)."""
    peers = result.get("peers") or {}
    missing = peers.get(UNAVAILABLE)
    if missing and not missing.get("available"):
        return [f"vLLM was not run: {missing['reason']}"]
    if not any(name in peers for name in ROWS):
        return ["vLLM was not run (`--peers vllm` runs it)."]
    configurations = result.get("configurations") or {}
    lines = ["| vLLM row | KV cache | vLLM p50 | p90 | device hits | vLLM device-hit p50 | ours | ours p50 | p90 | "
             "ours / vLLM p50 | ours / vLLM p90 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ROWS:
        row = peers.get(name)
        if not row or not row.get("available"):
            continue
        ours_name = COUNTERPARTS[name]
        ours = configurations.get(ours_name) or {}
        s, o = row["summary"], ours.get("summary")
        p50 = ratio((o or {}).get("p50"), s["p50"])
        p90 = ratio((o or {}).get("p90"), s["p90"])
        lines.append(f"| {name} | {row['cache_bytes'] / (1 << 20):.0f} MiB | {_ms(s)} | {_ms(s, 'p90')} | "
                     f"{row['hits']} / {len(row['records'])} | {_ms(row.get('device_hit'))} | {ours_name} | "
                     f"{_ms(o)} | {_ms(o, 'p90')} | {_x(p50)} | {_x(p90)} |")
    ours_device, theirs_device = device_hit_p50s(result)
    headline = headline_ratios(result)
    lines += ["", f"A miss (recompute p50): ours / vLLM {_x(headline['miss'])}; a device hit (p50 over "
              f"every row's device hits): ours {_s(ours_device)}, vLLM {_s(theirs_device)}, ours / vLLM "
              f"{_x(headline['device_hit'])}. vLLM's KV block is "
              f"{_info(peers, 'block_size')} tokens (its CPU default), ours 16: a vLLM hit computes the rest of "
              "its last partly cached block too."]
    return lines


def device_hit_p50s(result: dict) -> tuple[float | None, float | None]:
    """The p50 of every device hit, ours over all our configurations and vLLM's over all its rows."""
    configurations, peers = result.get("configurations") or {}, result.get("peers") or {}
    ours = p50_of([r for c in configurations.values() for r in c.get("records", [])], hit_tier="device")
    theirs = p50_of([r for n in ROWS for r in (peers.get(n) or {}).get("records", [])], hit_tier="device")
    return ours, theirs


def _our_p50(result: dict, configuration: str) -> float | None:
    return p50_of(((result.get("configurations") or {}).get(configuration) or {}).get("records", []))


def _peer_p50(result: dict, peer: str) -> float | None:
    row = (result.get("peers") or {}).get(peer) or {}
    return p50_of(row.get("records", [])) if row.get("available") else None


def headline_ratios(result: dict) -> dict[str, float | None]:
    """Ours / vLLM's p50 (None where a side is missing): `miss` (recompute against vLLM's recompute), `device_hit`
    (every device hit), `pressure` (our device and CPU tiers against vLLM's prefix caching in the same device bytes)
    and `restart` (our disk tier after a restart against a new vLLM process)."""
    return {"miss": ratio(_our_p50(result, "recompute"), _peer_p50(result, "vllm_recompute")),
            "device_hit": ratio(*device_hit_p50s(result)),
            "pressure": ratio(_our_p50(result, "device_cpu"), _peer_p50(result, "vllm_device_budget")),
            "restart": ratio(_our_p50(result, "disk_after_restart"), _peer_p50(result, "vllm_after_restart"))}


def floor_ratios(result: dict) -> dict[str, float | None] | None:
    """`headline_ratios`' four, each against transformers' `generate` (the `hf_generate` peer: every prompt prefilled
    in full, so one p50 for all four), the floor where vLLM cannot run; None where that peer did not run."""
    theirs = _peer_p50(result, "hf_generate")
    if theirs is None:
        return None
    return {"miss": ratio(_our_p50(result, "recompute"), theirs),
            "device_hit": ratio(device_hit_p50s(result)[0], theirs),
            "pressure": ratio(_our_p50(result, "device_cpu"), theirs),
            "restart": ratio(_our_p50(result, "disk_after_restart"), theirs)}


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1e3 * seconds:.0f} ms"


def _info(peers: dict, key: str):
    for name in ROWS:
        value = ((peers.get(name) or {}).get("info") or {}).get(key)
        if value is not None:
            return value
    return "?"
