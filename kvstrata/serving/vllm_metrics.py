"""The `vllm:*` series, as vLLM's Prometheus logger defines them (vllm/v1/metrics/loggers.py): its names,
label names, buckets and units, so that a dashboard, alert or autoscaler written for vLLM reads ours.

Every series is labelled `model_name` and `engine` ("0": one engine). vLLM's terms mapped to ours:
its "prefix cache" (local) is our device tier; what its KV connector loads ("external") is our CPU,
disk and remote tiers. Every value is measured: request phases and token counts as each request
reaches them (this object hears them from `ServingMetrics`), the rest from the engine's snapshots.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstrata.tiers.names import LOWER_TIER_NAMES as LOWER_TIERS

if TYPE_CHECKING:
    from kvstrata.engine.async_engine import EngineSnapshot, FinishedRequest
    from kvstrata.engine.receipt import CacheReceipt

LABELS = ("model_name", "engine")
ENGINE = "0"

# vLLM's bucket families (vllm/v1/metrics/buckets.py): a dashboard's quantiles over ours and vLLM's
# agree only if the buckets do.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# vLLM's finish reasons, every one exported from the start at 0 (ours are a subset: never `repetition`).
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# Where a prompt's tokens came from (vLLM's PromptTokenStats): computed here, served by the device
# tier, or loaded from a lower tier.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Which tier served cached tokens, in vLLM's CacheHitSource names; the remote tier, shared by replicas
# but not another engine handing over its KV, is none of vLLM's named sources.
CACHE_HIT_SOURCE_OF_TIER = {"device": "device", "cpu": "host", "disk": "disk", "remote": "external_unspecified"}
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length, for the per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmSeries:
    """The `vllm:*` series of one served engine, in `registry`: the observed ones as objects here,
    the snapshot ones from `collect`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        values = (model_name, ENGINE)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time from a request's arrival until its "
                                    "prompt is computed: queue, cache lookup and load from lower tiers.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Time from a request's admission to "
                                      "compute until its first token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Time from a request's first token to "
                                     "its end.", REQUEST_LATENCY_BUCKETS)
        token_buckets = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKENS_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            (*LABELS, "source"), registry=registry)
        self.prompt_tokens_by_source = {s: by_source.labels(*values, s) for s in PROMPT_SOURCES}
        cached_by_source = Counter("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by the tier that "
                                   "served them: device, host (the CPU tier), disk, external_unspecified (the "
                                   "remote tier).", (*LABELS, "source"), registry=registry)
        self.prompt_tokens_cached_by_source = {s: cached_by_source.labels(*values, s) for s in CACHE_HIT_SOURCES}
        success = Counter("vllm:request_success", "Count of processed requests, by why they finished.",
                          (*LABELS, "finished_reason"), registry=registry)
        self.request_success = {r: success.labels(*values, r) for r in FINISHED_REASONS}

    # Heard as requests go, on the engine thread.
    def on_first_token(self, receipt: CacheReceipt, num_prompt_tokens: int) -> None:
        """The prompt is computed: its phases and where its tokens came from (vLLM counts a prompt's
        tokens when its prefill ends)."""
        self.ttft.observe(receipt.ttft_ms / 1e3)
        self.queue_time.observe((receipt.queue_ms + receipt.lookup_ms + receipt.load_ms) / 1e3)
        self.prefill_time.observe(receipt.prefill_ms / 1e3)
        by_tier = receipt.cached_tokens_by_tier
        device = by_tier.get("device", 0)
        lower = sum(by_tier.get(t, 0) for t in LOWER_TIERS)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_cached.inc(device + lower)
        self.prompt_tokens_by_source["local_compute"].inc(num_prompt_tokens - device - lower)
        self.prompt_tokens_by_source["local_cache_hit"].inc(device)
        self.prompt_tokens_by_source["external_kv_transfer"].inc(lower)
        for tier, tokens in by_tier.items():
            if tokens:
                self.prompt_tokens_cached_by_source[CACHE_HIT_SOURCE_OF_TIER[tier]].inc(tokens)

    def on_token_gap(self, gap_s: float) -> None:
        self.inter_token.observe(gap_s)

    def on_step(self, num_tokens: int, num_generated_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)
        self.generation_tokens.inc(num_generated_tokens)

    def on_finished(self, finished: FinishedRequest) -> None:
        self.request_success[finished.finish_reason].inc()
        self.e2e.observe(finished.e2e_s)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generated_tokens)
        if finished.decode_s is not None:
            self.decode_time.observe(finished.decode_s)

    # Read from the latest snapshot at scrape time.
    def collect(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        stats = snapshot.stats
        prefix = stats["prefix_cache"]
        device_hits = prefix["hit_tokens"].get("device", 0)
        lower_hits = sum(prefix["hit_tokens"].get(t, 0) for t in LOWER_TIERS)
        device = stats["tiers"]["device"]

        def one(family_type, name: str, help_text: str, value: float) -> Metric:
            family = family_type(name, help_text, labels=LABELS)
            family.add_metric([self.model_name, ENGINE], value)
            return family

        yield one(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                  "queried tokens.", prefix["query_tokens"])
        yield one(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                  "tokens (the device tier).", device_hits)
        yield one(CounterMetricFamily, "vllm:external_prefix_cache_queries", "External prefix cache queries, in "
                  "tokens: those the device tier did not hold, looked up in the lower tiers.",
                  prefix["query_tokens"] - device_hits)
        yield one(CounterMetricFamily, "vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens: "
                  "served from the CPU, disk and remote tiers.", lower_hits)
        capacity = device["capacity_blocks"]
        yield one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  device["used_blocks"] / capacity if capacity else 0.0)
        yield one(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                  stats["num_preemptions"])
        yield one(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                  snapshot.num_running)
        yield one(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  snapshot.num_waiting)
        yield _cache_config_info(stats)


def _cache_config_info(stats: dict) -> Metric:
    """vLLM's CacheConfig fields that have a meaning here, as labels of a gauge at 1 (an info series that
    Prometheus's multiprocess mode can hold, as vLLM makes it); block counts are the tiers' capacities
    as the engine sized them. `engine` is empty, as vLLM leaves it on this series."""
    tiers = stats["tiers"]
    cpu = tiers.get("cpu")
    labels = {"block_size": str(stats["block_size"]), "cache_dtype": str(stats["kv_cache_dtype"]),
              "enable_prefix_caching": str(bool(stats["prefix_caching"])),
              "prefix_caching_hash_algo": str(stats["hash"]),
              "num_gpu_blocks": str(tiers["device"]["capacity_blocks"]),
              "num_cpu_blocks": str(cpu["capacity_blocks"]) if cpu is not None else "None",
              "engine": ""}
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=list(labels))
    family.add_metric(list(labels.values()), 1.0)
    return family
