"""Two replicas (two engines, each with its own device and CPU tiers) sharing one valkey-server: a
document asked on replica A is served to replica B from the remote tier, and B's answer is the one
an engine with caching off gives (float32: identical tokens). The server's password shows nowhere."""
from __future__ import annotations

import pytest
from valkey_server import ValkeyServer

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.async_engine import EngineSnapshot
from kvstrata.serving.metrics import ServingMetrics

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PASSWORD = "replica-secret-never-shown"


def replica_config(remote_url: str | None, caching: bool = True) -> dict:
    tiers = {"device": {"size": 64}, "cpu": {"size": 32}}
    if remote_url is not None:
        tiers["remote"] = {"url": remote_url, "timeout": "500ms"}
    return {"model": {"dtype": "float32", "device": "cpu"},
            "cache": {"enable_prefix_caching": caching, "tiers": tiers}}


def test_a_document_asked_on_one_replica_is_a_remote_hit_on_the_other(embedded_model_fp32):
    from pydoc_data.topics import topics
    messages = [{"role": "user", "content": f"{topics['try'][:900]}\n\nAnswer briefly. What is this about?"}]
    with LLM(load_config(replica_config(None, caching=False)), loaded_model=embedded_model_fp32) as plain:
        expected = plain.chat(messages, GREEDY)[0]
    with ValkeyServer(password=PASSWORD) as server:
        with LLM(load_config(replica_config(server.url)), loaded_model=embedded_model_fp32) as a, \
                LLM(load_config(replica_config(server.url)), loaded_model=embedded_model_fp32) as b:
            on_a = a.chat(messages, GREEDY)[0]
            a.engine.hierarchy.remote.flush()  # A's write-through has reached the server
            on_b = b.chat(messages, GREEDY)[0]
            b_stats = b.stats()
        cacheable = (len(on_b.prompt_token_ids) - 1) // 16 * 16
        assert on_a.cached_tokens == 0
        assert on_b.cached_tokens_by_tier["remote"] == cacheable > 0
        assert on_b.token_ids == on_a.token_ids == expected.token_ids
        assert b_stats["tiers"]["remote"]["hits"] == cacheable // 16
        assert b_stats["promotions"]["remote"] == cacheable // 16
        metrics = ServingMetrics(lambda: EngineSnapshot(stats=b_stats, num_running=0, num_waiting=0)).render().decode()
        assert f'kvstrata_prefix_cache_hits_tokens_total{{tier="remote"}} {float(cacheable)}' in metrics
        assert "kvstrata_cache_remote_faults_total 0.0" in metrics
        assert PASSWORD not in metrics and PASSWORD not in str(b_stats)
