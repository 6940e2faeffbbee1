"""Prometheus metrics for `GET /metrics`, fed from the engine thread's snapshots.

The engine thread publishes an `EngineSnapshot` (a copy of `LLMEngine.stats()` plus the scheduler's
queue lengths) after each step and every second while idle; a scrape reads the latest one. Nothing
here ever reads engine state, so a scrape never races a step. Cumulative engine counters are exposed
as Prometheus counters straight from the snapshot (they only grow); observations that the snapshot
cannot carry (each request's time to first token, each finish) arrive as they happen: this object
is the `AsyncEngine`'s `RequestListener`. Each request's cache receipt, at its first token, feeds a
histogram per part of its TTFT (queue, lookup, load per tier, prefill) and the per-tier counters of
receipts, so each series' sum is the sum of the receipts the server has handed out.

Every metric lives in this object's own `CollectorRegistry`: two servers in one process (tests)
never collide, and the process-wide default registry stays untouched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.tiers import LOWER_TIER_NAMES as LOWER_TIERS
from kvstrata.tiers import TIER_NAMES as TIERS

if TYPE_CHECKING:  # the engine imports torch: `kvstrata serve` reports a port in use before that
    from kvstrata.engine.async_engine import EngineSnapshot
    from kvstrata.engine.receipt import CacheReceipt
    from kvstrata.serving.events import KVEventPublisher

PREFIX = "kvstrata"
# From a device hit on a small model (milliseconds) to a cold multi-thousand-token CPU prefill (a minute).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# The parts of a TTFT go lower: a lookup or a load from the CPU tier takes well under a millisecond.
PART_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *TTFT_BUCKETS)


class ServingMetrics:
    """The metrics of one served engine: `snapshot` returns the engine's latest `EngineSnapshot`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], events: KVEventPublisher | None = None) -> None:
        self.registry = CollectorRegistry()
        self.snapshot = snapshot
        self.events = events
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished_total", "Requests that ended, by why they ended (stop, length, abort).",
            ["finish_reason"], registry=self.registry)
        self.queue_time = self._part("queue", "queue (arrival to lookup)")
        self.lookup_time = self._part("lookup", "lookup (the tier walk)")
        self.load_time = self._part("load", "load, by the tier read (observed for the tiers that served it),",
                                    ["tier"])
        self.prefill_time = self._part("prefill", "prefill (admission to first token)")
        self.receipt_cached_tokens = Counter(
            f"{PREFIX}_request_cached_tokens", "Prompt tokens served from each tier, summed over the receipts of "
                                               "requests that got a first token.", ["tier"], registry=self.registry)
        self.prefill_saved_estimate = Counter(
            f"{PREFIX}_request_prefill_saved_seconds_estimate", "Prefill time the cached tokens saved, estimated "
                                                                "at the measured cost per token, summed over receipts.",
            registry=self.registry)
        for tier in TIERS:  # every tier's series from the start, at 0
            self.receipt_cached_tokens.labels(tier=tier)
        for tier in LOWER_TIERS:
            self.load_time.labels(tier=tier)
        self.registry.register(_SnapshotCollector(self))

    def _part(self, part: str, what: str, labels: tuple[str, ...] | list[str] = ()) -> Histogram:
        return Histogram(f"{PREFIX}_request_{part}_time_seconds",
                         f"The {what} part of each request's time to first token (its cache receipt).",
                         labels, buckets=PART_BUCKETS, registry=self.registry)

    # The RequestListener side, called from the engine thread.
    def on_first_token(self, receipt: CacheReceipt) -> None:
        self.time_to_first_token.observe(receipt.ttft_ms / 1e3)
        self.queue_time.observe(receipt.queue_ms / 1e3)
        self.lookup_time.observe(receipt.lookup_ms / 1e3)
        self.prefill_time.observe(receipt.prefill_ms / 1e3)
        for tier, load_ms in receipt.load_ms_by_tier.items():
            if load_ms > 0 or receipt.cached_tokens_by_tier.get(tier):
                self.load_time.labels(tier=tier).observe(load_ms / 1e3)
        for tier, tokens in receipt.cached_tokens_by_tier.items():
            self.receipt_cached_tokens.labels(tier=tier).inc(tokens)
        self.prefill_saved_estimate.inc(receipt.prefill_saved_ms_estimate / 1e3)

    def on_finished(self, finish_reason: str) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()

    # Called from the HTTP side.
    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Turns the latest snapshot into metric families at scrape time."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self.metrics.snapshot()
        if snapshot is None:
            return
        yield _engine_info(snapshot.stats)
        yield from _cache_metrics(snapshot.stats)
        yield _gauge("requests_running", "Requests scheduled on the engine now.", snapshot.num_running)
        yield _gauge("requests_waiting", "Requests queued for admission (or preempted).", snapshot.num_waiting)
        events = self.metrics.events
        if events is not None:
            yield _counter("kv_events_published_batches", "KV event batches published.", events.published_batches)
            yield _counter("kv_events_dropped", "KV events dropped because the publisher's queue was full.",
                           events.dropped_events)


def _engine_info(stats: dict) -> Metric:
    """What the engine runs, as resolved at start-up (`dtype: auto` shows what it picked)."""
    labels = {key: str(stats[key])
              for key in ("model", "dtype", "kv_cache_dtype", "device", "threads", "attention_backend")}
    return InfoMetricFamily(f"{PREFIX}_engine", "The model, dtype, K/V cache dtype, device, torch threads and "
                                                "attention backend the engine runs.", value=labels)


def _cache_metrics(stats: dict) -> Iterator[Metric]:
    prefix = stats["prefix_cache"]
    yield _counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
                   prefix["query_tokens"])
    yield _per_tier(CounterMetricFamily, "prefix_cache_hits_tokens",
                    "Prompt tokens served from the cache, by the tier that held them.", prefix["hit_tokens"], TIERS)
    yield _per_tier(CounterMetricFamily, "prefix_cache_recomputed_tokens",
                    "Prompt tokens found in a tier but recomputed, by the load policy's choice (cache.load_policy).",
                    prefix["recomputed_tokens"], TIERS)
    yield _per_tier(GaugeMetricFamily, "cache_read_bandwidth_bytes_per_second",
                    "Each lower tier's delivered read bandwidth to the device as the load policy estimates it "
                    "(measured: a start-up probe, then promotions; 0 until measured).",
                    stats["load_policy"]["read_bytes_per_s"], LOWER_TIERS)
    tiers = stats["tiers"]
    enabled = [name for name in TIERS if name in tiers]
    for field_name, metric, help_text in (
            ("used_blocks", "cache_usage_blocks", "KV blocks held by each tier."),
            ("used_bytes", "cache_usage_bytes", "Bytes of KV blocks held by each tier."),
            ("capacity_blocks", "cache_capacity_blocks", "KV blocks each tier can hold."),
            ("capacity_bytes", "cache_capacity_bytes", "Bytes of KV blocks each tier can hold."),
            ("pinned_blocks", "cache_pinned_blocks",
             "KV blocks pinned documents keep in each tier (none on the device).")):
        yield _per_tier(GaugeMetricFamily, metric, help_text, {n: tiers[n][field_name] for n in enabled}, enabled)
    yield _per_tier(CounterMetricFamily, "cache_evictions_blocks",
                    "Cached blocks each tier dropped by LRU to make room (device: slots reused).",
                    {n: tiers[n]["evictions"] for n in enabled}, enabled)
    yield _per_tier(CounterMetricFamily, "cache_promotions_blocks",
                    "Blocks copied up to the device from each lower tier.", stats["promotions"], LOWER_TIERS)
    yield _counter("cache_promotion_failures_blocks",
                   "Lower-tier blocks that vanished or failed verification while being promoted.",
                   stats["promotion_failures"])
    yield _per_tier(CounterMetricFamily, "cache_write_downs_blocks",
                    "Blocks written down into each lower tier.", stats["write_downs"], LOWER_TIERS)
    yield _per_tier(CounterMetricFamily, "cache_corrupt_blocks",
                    "Stored blocks that failed verification (served as misses, never as output).",
                    stats["corrupt"], enabled)
    logprobs = stats["prompt_logprob_cache"]
    yield _gauge("prompt_logprob_cache_blocks", "Blocks whose prompt log-probabilities are kept "
                                                "(engine/prompt_logprobs.py).", logprobs["blocks"])
    yield _counter("prompt_logprob_cache_served_blocks", "Blocks of prompt log-probabilities given to requests "
                                                         "asking for their prompt's (not computed again).",
                   logprobs["blocks_served"])
    remote = tiers.get("remote")
    if remote is not None:  # the server's address is not exported: it may carry a password
        extra = remote["extra"]
        yield _counter("cache_remote_faults", "Remote-tier operations that failed (server down, timeout, reset, "
                                              "failover): served as misses.", extra["faults"])
        yield _counter("cache_remote_dropped_writes_blocks", "Blocks not written to the remote tier: the write "
                                                             "queue full, the server unreachable or full.",
                       extra["dropped_puts"] + extra["write_errors"])


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    # CounterMetricFamily appends `_total` to the exposed sample name.
    return CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _per_tier(family_type, name: str, help_text: str, values: dict, tiers) -> Metric:
    family = family_type(f"{PREFIX}_{name}", help_text, labels=["tier"])
    for tier in tiers:
        family.add_metric([tier], values.get(tier, 0))
    return family
