"""What a consumer built on vLLM reads from us: the KV events of a real engine decoded by vLLM's
structs (mirrored in tests/vllm_wire.py, and, where vLLM is installed, its own classes).

The checks against the installed vLLM run its interpreter in a subprocess (tests/vllm_compat_check.py),
named by KVSTRATA_VLLM_PYTHON: vLLM pins its own torch, so it lives in an environment of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.serving.events import decode_batch
from kvstrata.tiers.block_events import AllBlocksCleared
from server_process import free_ports
from vllm_wire import VllmKVEventBatch

VLLM_PYTHON = os.environ.get("KVSTRATA_VLLM_PYTHON")
CHECK = Path(__file__).resolve().parent / "vllm_compat_check.py"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="KVSTRATA_VLLM_PYTHON is unset: set it to the python of "
                                "an environment with vLLM installed to check against vLLM's own code")


def run_vllm_check(*args: str) -> dict:
    done = subprocess.run([VLLM_PYTHON, str(CHECK), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def replayed_payloads(replay_endpoint: str) -> list[bytes]:
    """Every batch the publisher still keeps, as sent (raw msgpack), through its replay socket."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    payloads = []
    while dealer.poll(2000):
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:
            break
        payloads.append(payload)
    dealer.close(linger=0)
    return payloads


def engine_stream(tmp_path: Path, remote_url: str | None = None, **events) -> list[bytes]:
    """The KV events of a real engine (random weights) whose blocks are stored on the device, written
    down to the CPU tier (and the remote tier at `remote_url`), spilled to disk, evicted, and finally
    cleared in every tier."""
    pub, replay = free_ports(2)
    tiers = {"device": {"size": 4}, "cpu": {"size": 4}, "disk": {"path": str(tmp_path / "kv"), "size": "16MiB"}}
    if remote_url is not None:
        tiers["remote"] = {"url": remote_url}
    config = load_config({
        "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "threads": 1},
        "cache": {"tiers": tiers},
        "events": {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}", **events}})
    with LLM(config) as llm:
        for doc in (range(1000, 1050), range(2000, 2050), range(1000, 1050)):
            llm.generate([list(doc)], SamplingParams(max_tokens=1, temperature=0.0))
        llm.engine.hierarchy.wait_for_write_downs()
        llm.engine.hierarchy.disk.flush()
        llm.reset_prefix_cache(reset_external=True)
        deadline = time.monotonic() + 30
        while True:  # the publisher thread sends what the engine queued: wait for the disk tier's clear
            payloads = replayed_payloads(config.events.replay_endpoint)
            if AllBlocksCleared("disk") in [e for p in payloads for e in decode_batch(p)[1]]:
                return payloads
            assert time.monotonic() < deadline, "the engine's events never reached the replay buffer"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> list[bytes]:
    return engine_stream(tmp_path_factory.mktemp("stream"))


def test_every_batch_of_a_real_engine_decodes_with_vllms_structs(stream):
    batches = [msgspec.msgpack.Decoder(VllmKVEventBatch).decode(p) for p in stream]
    seen = {(type(e).__name__.removeprefix("Vllm"), getattr(e, "medium", None), getattr(e, "locality", None))
            for b in batches for e in b.events}
    assert {("BlockStored", "GPU", None), ("BlockRemoved", "GPU", None), ("BlockStored", "CPU", None),
            ("BlockStored", "STORAGE", "LOCAL"), ("AllBlocksCleared", None, None)} <= seen
    assert all(b.data_parallel_rank == 0 for b in batches)


@needs_vllm
@pytest.mark.parametrize("events", [{}, {"medium_names": "kvstrata"}, {"int_hashes": True}])
def test_installed_vllm_decodes_every_batch_of_a_real_engine(tmp_path, events):
    from valkey_server import ValkeyServer

    with ValkeyServer() as server:
        payloads = engine_stream(tmp_path, server.url, **events)
    frames = tmp_path / "frames.msgpack"
    frames.write_bytes(msgspec.msgpack.encode(payloads))
    result = run_vllm_check("events", str(frames))
    print(f"\nvLLM {result['vllm']} decoded {result['decoded']}/{result['total']} batches ({events or 'defaults'})")
    assert result["decoded"] == result["total"] > 0, result["errors"]
    ours = [e for p in payloads for e in decode_batch(p)[1]]
    assert len(result["events"]) == len(ours)
    assert [e["type"] for e in result["events"]] == [type(e).__name__ for e in ours]
    assert [e["hashes"] for e in result["events"]] == \
        [[h.hex() if isinstance(h, bytes) else h for h in getattr(e, "block_hashes", [])] for e in ours]
    disk, remote = ("DISK", "REMOTE") if events.get("medium_names") == "kvstrata" else ("STORAGE", "STORAGE")
    assert {(e["medium"], e["locality"]) for e in result["events"] if e["type"] == "BlockStored"} == \
        {("GPU", None), ("CPU", None), (disk, "LOCAL"), (remote, "REMOTE")}
    assert {e.medium for e in ours} == {"device", "cpu", "disk", "remote"}  # and we read them back apart


@needs_vllm
def test_installed_vllm_cannot_read_the_legacy_form_which_is_for_older_routers(tmp_path):
    """`events.format: vllm_legacy` is for routers still on vLLM's pre-0.26 arrays, not for vLLM's own classes."""
    frames = tmp_path / "frames.msgpack"
    frames.write_bytes(msgspec.msgpack.encode(engine_stream(tmp_path, format="vllm_legacy")))
    result = run_vllm_check("events", str(frames))
    assert result["decoded"] == 0 < result["total"]
    assert "Expected `object`, got `array`" in result["errors"][0]


# -- metrics ------------------------------------------------------------------------------------

VLLM_METRICS = json.loads((Path(__file__).resolve().parent / "data" / "vllm_0_32_metrics.json").read_text())
# The series a vLLM dashboard or autoscaler reads that have a meaning here (docs/metrics.md says why the
# others are left out).
EXPORTED = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:num_preemptions", "vllm:time_to_first_token_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:request_success", "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:iteration_tokens_total", "vllm:prompt_tokens_cached",
            "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source", "vllm:cache_config_info"}
TINY = {"model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32", "threads": 1},
        # always_load: the load policy, left to measured speeds, may recompute a short prefix instead
        "cache": {"load_policy": "always_load", "tiers": {"device": {"size": 4}, "cpu": {"size": 64}}}}


def vllm_families(metrics) -> dict[str, dict]:
    """Our `vllm:` families as vllm_compat_check.py reports vLLM's: type, label names, buckets."""
    families = {}
    for family in metrics.registry.collect():
        if family.name.startswith("vllm:"):
            labels = sorted({n for s in family.samples for n in s.labels} - {"le"})
            buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
                             - {float("inf")})
            families[family.name] = {"type": family.type, "labels": labels, "buckets": buckets}
    return families


@pytest.fixture(scope="module")
def served():
    """A real engine (random weights) behind the engine thread, its metrics the listener, after four
    requests: document A, document B (which takes A's device blocks), A again (served by the CPU
    tier), A once more (served by the device tier)."""
    import asyncio

    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.serving.metrics import ServingMetrics

    async_engine = AsyncEngine(LLMEngine(load_config(TINY)))
    metrics = async_engine.listener = ServingMetrics(lambda: async_engine.snapshot, model_name="m",
                                                     max_model_len=2048)
    doc_a, doc_b = list(range(1000, 1050)), list(range(2000, 2050))

    async def one(prompt):
        async for output in async_engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0)):
            last = output
        return last

    try:
        outputs = [asyncio.run(one(p)) for p in (doc_a, doc_b, doc_a, doc_a)]
        deadline = time.monotonic() + 30  # the snapshot after the last request
        while async_engine.snapshot.stats["prefix_cache"]["query_tokens"] < 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield metrics, outputs, metrics.render().decode()
    finally:
        async_engine.shutdown()


def sample(text: str, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"engine": "0", "model_name": "m", **labels}.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{wanted}}}")


def test_every_vllm_series_has_vllms_name_type_labels_and_buckets(served):
    metrics, _, _ = served
    ours = vllm_families(metrics)
    assert set(ours) == EXPORTED
    vllm = VLLM_METRICS["families"]
    for name, family in ours.items():
        if name == "vllm:cache_config_info":  # the CacheConfig fields that mean something here
            assert family["type"] == vllm[name]["type"] and set(family["labels"]) <= set(vllm[name]["labels"])
        else:
            assert family == vllm[name], name


def test_vllm_token_counts_are_the_requests_measured_ones(served):
    _, outputs, text = served
    by_tier = [o.receipt.cached_tokens_by_tier for o in outputs]
    device = sum(t.get("device", 0) for t in by_tier)
    lower = sum(n for t in by_tier for tier, n in t.items() if tier != "device")
    generated = sum(len(o.token_ids) for o in outputs)
    assert device > 0 and lower > 0  # the scenario served tokens from both
    assert sample(text, "vllm:prompt_tokens_total") == 200
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == device
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == lower
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 200 - device - lower
    assert sample(text, "vllm:prompt_tokens_cached_total") == device + lower
    assert sample(text, "vllm:prompt_tokens_cached_by_source_total", source="host") == lower  # the CPU tier
    assert sample(text, "vllm:generation_tokens_total") == generated
    assert sample(text, "vllm:request_generation_tokens_sum") == generated
    assert sample(text, "vllm:request_prompt_tokens_sum") == 200
    assert sum(sample(text, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error", "repetition")) == 4
    # Every prompt token not served from a cache, and every generated token but each request's last,
    # is computed in exactly one step.
    assert sample(text, "vllm:iteration_tokens_total_sum") == (200 - device - lower) + (generated - 4)


def test_vllm_request_phases_are_the_receipts_and_the_decodes_measured(served):
    _, outputs, text = served
    queue = sample(text, "vllm:request_queue_time_seconds_sum")
    prefill = sample(text, "vllm:request_prefill_time_seconds_sum")
    assert queue + prefill == pytest.approx(sum(o.receipt.ttft_ms for o in outputs) / 1e3, rel=1e-3)
    assert sample(text, "vllm:request_decode_time_seconds_count") == 4
    assert sample(text, "vllm:inter_token_latency_seconds_count") == sum(len(o.token_ids) - 1 for o in outputs)
    decode = sample(text, "vllm:request_decode_time_seconds_sum")
    assert 0 < decode < sample(text, "vllm:e2e_request_latency_seconds_sum")
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="float32",enable_prefix_caching="True",engine="",'
            'num_cpu_blocks="64",num_gpu_blocks="4",prefix_caching_hash_algo="xxh3_128"} 1.0') in text


@needs_vllm
def test_installed_vllm_defines_our_vllm_series_as_we_export_them(served):
    metrics, _, _ = served
    vllm = run_vllm_check("metrics")
    print(f"\nvLLM {vllm['vllm']}: {len(vllm['families'])} families, {len(EXPORTED)} exported here")
    for name, family in vllm_families(metrics).items():
        theirs = vllm["families"][name]
        if name == "vllm:cache_config_info":
            assert set(family["labels"]) <= set(theirs["labels"])
        else:
            assert family == theirs, name


def test_vllms_own_dashboard_finds_every_series_it_queries_that_has_a_meaning_here(served):
    _, _, text = served
    dashboard = json.loads((Path(__file__).resolve().parent / "data" / "vllm_grafana_series.json").read_text())
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    empty = dashboard["empty"]
    for panel, series in dashboard["panels"].items():
        for name in series:
            family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            assert name in exported or family in empty, (panel, name)
            assert not (name in exported and family in empty), (panel, name)
