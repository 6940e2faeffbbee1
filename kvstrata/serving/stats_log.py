"""The stats line `kvstrata serve` logs every `server.stats_interval` seconds while busy, as vLLM logs its own:

    stats: 2 running, 1 waiting; prompt 812.3 tokens/s, generation 14.0 tokens/s; prefix hits device 45.0%,
    cpu 10.0%, disk 0.0%, remote 0.0%; promoted cpu 1.2 MiB, disk 0 B, remote 0 B

Every figure is read from the server's own metrics registry, what /metrics shows, as a difference
between two readings: so the line and a dashboard agree. Prompt tokens are those admitted (looked up
in the cache, as `kvstrata_prefix_cache_queries_tokens_total`), generated tokens those of the requests
that ended in the interval (`kvstrata_generation_tokens_total`); a hit rate is the share of the
interval's prompt tokens served from that tier; promoted bytes are blocks copied up from the tier
times the block's size. An idle interval (nothing running or waiting, no counter moved) logs nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvstrata.tiers.names import LOWER_TIER_NAMES, TIER_NAMES
from kvstrata.tiers.storage import format_bytes

stats_logger = logging.getLogger("kvstrata.stats")
# The /metrics series a line is made of (kvstrata/serving/metrics.py); per tier where the label says so.
RUNNING = "kvstrata_requests_running"
WAITING = "kvstrata_requests_waiting"
PROMPT_TOKENS = "kvstrata_prefix_cache_queries_tokens_total"
GENERATION_TOKENS = "kvstrata_generation_tokens_total"
HIT_TOKENS = "kvstrata_prefix_cache_hits_tokens_total"
PROMOTED_BLOCKS = "kvstrata_cache_promotions_blocks_total"
CAPACITY_BLOCKS = "kvstrata_cache_capacity_blocks"  # exported for the tiers that are on: the line names only those
SERIES = (RUNNING, WAITING, PROMPT_TOKENS, GENERATION_TOKENS, HIT_TOKENS, PROMOTED_BLOCKS, CAPACITY_BLOCKS)


@dataclass(frozen=True)
class Reading:
    """The counters a stats line is made of, at one moment."""

    taken_at: float
    running: float = 0.0
    waiting: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    hit_tokens: dict[str, float] = field(default_factory=dict)
    promoted_blocks: dict[str, float] = field(default_factory=dict)


def read_registry(registry: CollectorRegistry, now: float | None = None) -> Reading:
    """One pass over the registry's samples (a scrape's worth of work, every interval)."""
    values: dict[tuple[str, str], float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            values[(sample.name, sample.labels.get("tier", ""))] = sample.value
    return Reading(
        taken_at=time.monotonic() if now is None else now,
        running=values.get((RUNNING, ""), 0.0),
        waiting=values.get((WAITING, ""), 0.0),
        prompt_tokens=values.get((PROMPT_TOKENS, ""), 0.0),
        generation_tokens=values.get((GENERATION_TOKENS, ""), 0.0),
        hit_tokens={t: values.get((HIT_TOKENS, t), 0.0) for t in TIER_NAMES if (CAPACITY_BLOCKS, t) in values},
        promoted_blocks={t: values.get((PROMOTED_BLOCKS, t), 0.0) for t in LOWER_TIER_NAMES
                         if (CAPACITY_BLOCKS, t) in values})


def stats_line(before: Reading, after: Reading, block_bytes: int) -> str | None:
    """The line for the interval between two readings; None when it was idle."""
    seconds = max(after.taken_at - before.taken_at, 1e-9)
    prompt = after.prompt_tokens - before.prompt_tokens
    generated = after.generation_tokens - before.generation_tokens
    hits = {t: n - before.hit_tokens.get(t, 0.0) for t, n in after.hit_tokens.items()}
    promoted = {t: n - before.promoted_blocks.get(t, 0.0) for t, n in after.promoted_blocks.items()}
    if not (after.running or after.waiting or prompt or generated or any(promoted.values())):
        return None
    rates = ", ".join(f"{t} {100 * n / prompt:.1f}%" if prompt else f"{t} -" for t, n in hits.items())
    moved = ", ".join(f"{t} {format_bytes(n * block_bytes)}" for t, n in promoted.items())
    return (f"stats: {after.running:.0f} running, {after.waiting:.0f} waiting; prompt {prompt / seconds:.1f} tokens/s, "
            f"generation {generated / seconds:.1f} tokens/s; prefix hits {rates}" + (f"; promoted {moved}" if moved else ""))


class StatsLogger:
    """A daemon thread logging `stats_line` every `interval` seconds until `stop()`."""

    def __init__(self, registry: CollectorRegistry, block_bytes: int, interval: float):
        self.registry = registry
        self.block_bytes = block_bytes
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-stats", daemon=True)

    def start(self) -> StatsLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        before = read_registry(self.registry)
        while not self._stopped.wait(self.interval):
            try:
                after = read_registry(self.registry)
                line = stats_line(before, after, self.block_bytes)
            except Exception:  # a stats line is never worth the server: say so once per interval and go on
                stats_logger.exception("stats: could not read the metrics")
                continue
            if line is not None:
                stats_logger.info(line)
            before = after
