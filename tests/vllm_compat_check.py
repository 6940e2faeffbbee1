"""Checks kvstrata's wire and metrics against an installed vLLM's own code; run with a vLLM environment's
interpreter (it imports vllm, never kvstrata), by tests/test_vllm_compat.py:

    python tests/vllm_compat_check.py events FILE    # FILE: msgpack list of KV event payloads
    python tests/vllm_compat_check.py metrics        # the series vLLM's Prometheus logger defines

Each prints one JSON object on stdout.

`events` decodes every payload with vLLM's `msgspec.msgpack.Decoder(type=KVEventBatch)`, as a router
built on vLLM's classes does, and reports how many decoded and what they held. `metrics` builds
vLLM's `PrometheusStatLogger` for one engine of a plain decoder model (no speculative decoding, LoRA,
KV connector or watermarking: their series are only made when configured) and reports each `vllm:`
family's type, label names and histogram buckets.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def check_events(path: str) -> dict:
    import msgspec
    import vllm
    from vllm.distributed.kv_events import KVEventBatch

    with open(path, "rb") as f:
        payloads = msgspec.msgpack.decode(f.read())
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    decoded, errors, events = 0, [], []
    for payload in payloads:
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError as exc:
            errors.append(str(exc))
            continue
        decoded += 1
        for event in batch.events:
            kind = type(event).__name__
            hashes = [h.hex() if isinstance(h, bytes) else h for h in getattr(event, "block_hashes", [])]
            events.append({"type": kind, "medium": getattr(event, "medium", None),
                           "locality": getattr(event, "locality", None), "hashes": hashes,
                           "dp_rank": batch.data_parallel_rank})
    return {"vllm": vllm.__version__, "total": len(payloads), "decoded": decoded, "errors": errors[:3],
            "events": events}


def check_metrics() -> dict:
    import prometheus_client
    import vllm
    from vllm.config import CacheConfig, ObservabilityConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    cache_config = CacheConfig(block_size=16)
    config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="m", max_model_len=2048, is_diffusion=False),
        observability_config=ObservabilityConfig(), cache_config=cache_config, speculative_config=None,
        kv_transfer_config=None, ec_transfer_config=None, lora_config=None, watermark_config=None,
        device_config=SimpleNamespace(device_type="cpu"), parallel_config=SimpleNamespace(data_parallel_size=1))
    logger = PrometheusStatLogger(config, [0])
    logger.log_metrics_info("cache_config", cache_config)
    families = {}
    for family in prometheus_client.REGISTRY.collect():
        if not family.name.startswith("vllm:"):
            continue
        labels = sorted({name for sample in family.samples for name in sample.labels} - {"le"})
        buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})
        families[family.name] = {"type": family.type, "labels": labels, "buckets": buckets}
    return {"vllm": vllm.__version__, "families": families}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "events":
        result = check_events(argv[1])
    elif argv == ["metrics"]:
        result = check_metrics()
    else:
        print("usage: vllm_compat_check.py events FILE | metrics", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
