"""What `kvstrata serve` logs beside its answers: an access line per request when `server.access_log` is on,
never a prompt or a key; and a stats line every `server.stats_interval` while busy, read from /metrics' counters."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstrata.engine.config import load_config
from kvstrata.serving.stats_log import (CAPACITY_BLOCKS, GENERATION_TOKENS, HIT_TOKENS, PROMOTED_BLOCKS, PROMPT_TOKENS, RUNNING,
                                        WAITING, Reading, StatsLogger, stats_line)
from serving_fakes import MODEL, client, fake_app

KEY = "sk-very-secret"
PROMPT = "the confidential prompt text"


def post_completion(app, headers: dict) -> object:
    async def go():
        async with client(app) as http:
            return await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                                   headers=headers)
    return asyncio.run(go())


def test_access_log_is_a_line_per_request_with_its_id_and_never_the_prompt_or_key(caplog):
    app = fake_app(api_key=KEY, access_log=True)
    with caplog.at_level(logging.INFO, logger="kvstrata.access"):
        ok = post_completion(app, {"Authorization": f"Bearer {KEY}", "X-Request-Id": "client-42"})
        refused = post_completion(app, {})
    assert ok.headers["x-request-id"] == "client-42" and len(refused.headers["x-request-id"]) == 32
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstrata.access"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("POST /v1/completions 200 ") and lines[0].endswith(" ms id=client-42")
    assert lines[1].startswith("POST /v1/completions 401 ")  # refused before any route: logged all the same
    assert PROMPT not in caplog.text and KEY not in caplog.text


def test_access_log_is_off_unless_asked(caplog):
    assert load_config().server.access_log is False
    with caplog.at_level(logging.INFO, logger="kvstrata.access"):
        post_completion(fake_app(), {})
    assert not [r for r in caplog.records if r.name == "kvstrata.access"]


def reading(at: float, **fields) -> Reading:
    return Reading(taken_at=at, **fields)


def test_stats_line_gives_rates_and_per_tier_hits_and_promoted_bytes_over_the_interval():
    before = reading(0.0, prompt_tokens=1000, generation_tokens=10,
                     hit_tokens={"device": 100, "cpu": 0, "disk": 0, "remote": 0},
                     promoted_blocks={"cpu": 1, "disk": 0, "remote": 0})
    after = reading(2.0, running=2, waiting=1, prompt_tokens=1400, generation_tokens=30,
                    hit_tokens={"device": 200, "cpu": 200, "disk": 0, "remote": 0},
                    promoted_blocks={"cpu": 5, "disk": 2, "remote": 0})
    line = stats_line(before, after, block_bytes=1024)
    assert line == ("stats: 2 running, 1 waiting; prompt 200.0 tokens/s, generation 10.0 tokens/s; prefix hits "
                    "device 25.0%, cpu 50.0%, disk 0.0%, remote 0.0%; promoted cpu 4.0 KiB, disk 2.0 KiB, remote 0 B")


def test_an_idle_interval_logs_nothing():
    same = dict(prompt_tokens=50, generation_tokens=5, hit_tokens={"device": 16})
    assert stats_line(reading(0.0, **same), reading(10.0, **same), block_bytes=1024) is None
    assert stats_line(reading(0.0, **same), reading(10.0, waiting=1, **same), block_bytes=1024) is not None


def test_stats_logger_logs_from_the_registry_every_interval_while_busy(caplog):
    registry = CollectorRegistry()
    running = Gauge(RUNNING, "", registry=registry)
    Gauge(WAITING, "", registry=registry)
    prompt = Counter(PROMPT_TOKENS.removesuffix("_total"), "", registry=registry)
    Counter(GENERATION_TOKENS.removesuffix("_total"), "", registry=registry)
    hits = Counter(HIT_TOKENS.removesuffix("_total"), "", ["tier"], registry=registry)
    Counter(PROMOTED_BLOCKS.removesuffix("_total"), "", ["tier"], registry=registry)
    Gauge(CAPACITY_BLOCKS, "", ["tier"], registry=registry).labels(tier="device").set(64)  # the only tier on
    with caplog.at_level(logging.INFO, logger="kvstrata.stats"):
        logger = StatsLogger(registry, block_bytes=1024, interval=0.05).start()
        try:
            time.sleep(0.3)  # idle: no line
            assert not [r for r in caplog.records if r.name == "kvstrata.stats"]
            running.set(1)
            prompt.inc(64)
            hits.labels(tier="device").inc(32)
            deadline = time.monotonic() + 5
            while not [r for r in caplog.records if r.name == "kvstrata.stats"] and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            logger.stop()
    (first, *_) = [r.getMessage() for r in caplog.records if r.name == "kvstrata.stats"]
    assert first.startswith("stats: 1 running, 0 waiting; prompt ") and first.endswith("prefix hits device 50.0%")


@pytest.mark.parametrize("value, expected", [("0", 0.0), ("2s", 2.0), ("500ms", 0.5)])
def test_stats_interval_takes_a_duration_and_0_turns_it_off(value, expected):
    assert load_config(None, [f"server.stats_interval={value}"]).server.stats_interval == expected
    assert load_config().server.stats_interval == 10.0
