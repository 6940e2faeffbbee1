"""What a consumer built on vLLM reads from us: the KV events of a real engine decoded by vLLM's
structs (mirrored in tests/vllm_wire.py, and, where vLLM is installed, its own classes).

The checks against the installed vLLM run its interpreter in a subprocess (tests/vllm_compat_check.py),
named by KVSTRATA_VLLM_PYTHON: vLLM pins its own torch, so it lives in an environment of its own."""
from __future__ import annotations

import json
import os
import socket
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
from vllm_wire import VllmKVEventBatch

VLLM_PYTHON = os.environ.get("KVSTRATA_VLLM_PYTHON")
CHECK = Path(__file__).resolve().parent / "vllm_compat_check.py"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="KVSTRATA_VLLM_PYTHON is unset: set it to the python of an "
                                                        "environment with vLLM installed to check against vLLM's own code")


def run_vllm_check(*args: str) -> dict:
    done = subprocess.run([VLLM_PYTHON, str(CHECK), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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


def engine_stream(tmp_path: Path, **events) -> list[bytes]:
    """The KV events of a real engine (random weights) whose blocks are stored on the device, written
    down to the CPU tier, spilled to disk, evicted, and finally cleared in every tier."""
    pub, replay = free_ports(2)
    config = load_config({
        "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "threads": 1},
        "cache": {"tiers": {"device": {"size": 4}, "cpu": {"size": 4},
                            "disk": {"path": str(tmp_path / "kv"), "size": "16MiB"}}},
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
    payloads = engine_stream(tmp_path, **events)
    frames = tmp_path / "frames.msgpack"
    frames.write_bytes(msgspec.msgpack.encode(payloads))
    result = run_vllm_check("events", str(frames))
    print(f"\nvLLM {result['vllm']} decoded {result['decoded']}/{result['total']} batches ({events or 'defaults'})")
    assert result["decoded"] == result["total"] > 0, result["errors"]
    ours = [e for p in payloads for e in decode_batch(p)[1]]
    assert len(result["events"]) == len(ours)
    assert [e["type"] for e in result["events"]] == [type(e).__name__ for e in ours]
    storage = "DISK" if events.get("medium_names") == "kvstrata" else "STORAGE"
    assert {(e["medium"], e["locality"]) for e in result["events"] if e["type"] == "BlockStored"} == \
        {("GPU", None), ("CPU", None), (storage, "LOCAL")}


@needs_vllm
def test_installed_vllm_cannot_read_the_legacy_form_which_is_for_older_routers(tmp_path):
    """`events.format: vllm_legacy` is for routers still on vLLM's pre-0.26 arrays, not for vLLM's own classes."""
    frames = tmp_path / "frames.msgpack"
    frames.write_bytes(msgspec.msgpack.encode(engine_stream(tmp_path, format="vllm_legacy")))
    result = run_vllm_check("events", str(frames))
    assert result["decoded"] == 0 < result["total"]
    assert "Expected `object`, got `array`" in result["errors"][0]
