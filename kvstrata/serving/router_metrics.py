"""Prometheus metrics of `kvstrata route` (`GET /metrics` on the router): where requests went and what placed them,
how much of their prompts the chosen replica held, what failed over to another replica, and each replica's state as
the router sees it.

The router counts as it places requests (`RoutingCounts`, one per replica, written on the event loop alone); a scrape
reads those counts and the replicas' state then, so nothing here lags or races a placement. Every metric lives in
this object's own registry: two routers in one process (tests) never collide.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.serving.router import Replica, ReplicaSet

# Rendering, tokenizing and hashing a prompt: a short chat (well under a millisecond) to a long document (tens of ms).
PLACEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class RoutingCounts:
    """What the router did with one replica's requests, since it started."""

    placed: Counter = field(default_factory=Counter)  # forwarded requests by what placed them (`ReplicaSet.placed_by`)
    prompt_blocks: int = 0  # cacheable blocks of the prompts forwarded there, as it names blocks
    held_blocks: int = 0    # of those, the leading blocks it held in its own tiers when chosen
    failovers: Counter = field(default_factory=Counter)  # tries given up on it before the client got anything, by why
    streams_cut: int = 0    # answers it left unfinished (it died or hung mid-stream): ended with an error event


class RouterMetrics:
    """The router's metrics over `replicas`; `refused()` counts the requests no replica could take."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, replicas: ReplicaSet, refused: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.placement_seconds = Histogram(
            "kvstrata_router_placement_seconds", "Time to place a request: render, tokenize and hash its prompt, "
            "then choose its replica", buckets=PLACEMENT_BUCKETS, registry=self.registry)
        self.registry.register(_RoutingCollector(replicas, refused))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RoutingCollector(Collector):
    def __init__(self, replicas: ReplicaSet, refused: Callable[[], int]) -> None:
        self.replicas, self.refused = replicas, refused

    def collect(self) -> Iterator[Metric]:
        families = _families()
        with self.replicas.lock:  # the event thread writes the indexes
            for replica in self.replicas.replicas:
                _add_replica(families, replica)
        families["refused"].add_metric([], self.refused())
        yield from families.values()


def _families() -> dict[str, Metric]:
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    return {
        "requests": counter(
            "kvstrata_router_requests", "Requests forwarded to a replica, by what placed them: prefix (it held at least "
            "half of the prompt's cacheable blocks), load (the fewest in flight), or the policy round_robin or random",
            labels=["replica", "placement"]),
        "prompt_blocks": counter(
            "kvstrata_router_prompt_blocks", "Cacheable blocks of the prompts forwarded to a replica",
            labels=["replica"]),
        "held_blocks": counter(
            "kvstrata_router_prompt_blocks_held", "Of those, the leading blocks the replica held in its own tiers "
            "(device, CPU or disk) when it was chosen", labels=["replica"]),
        "failovers": counter(
            "kvstrata_router_failovers", "Tries given up on a replica before the client got anything, the request going "
            "to the next (reason: unreachable, hung, http_<status>, died_before_first_event)",
            labels=["replica", "reason"]),
        "streams_cut": counter(
            "kvstrata_router_streams_cut", "Streamed answers a replica left unfinished (it died or hung mid-answer), "
            "ended with an error event", labels=["replica"]),
        "refused": counter("kvstrata_router_refused", "Requests answered 503: no replica could take them"),
        "healthy": gauge("kvstrata_router_replica_healthy", "1 while the replica is routed to", labels=["replica"]),
        "matched": gauge("kvstrata_router_replica_matched", "1 while the replica's block naming is known (its prompts "
                         "can be matched to its cache; 0: it gets requests by load)", labels=["replica"]),
        "in_flight": gauge("kvstrata_router_replica_in_flight", "Requests forwarded to the replica and not yet answered "
                           "in full", labels=["replica"]),
        "blocks": gauge("kvstrata_router_replica_blocks", "Blocks the replica holds per tier, as its KV events told the "
                        "router", labels=["replica", "tier"]),
    }


def _add_replica(families: dict[str, Metric], replica: Replica) -> None:
    url, counts = replica.url, replica.counts
    for placement, n in sorted(counts.placed.items()):
        families["requests"].add_metric([url, placement], n)
    families["prompt_blocks"].add_metric([url], counts.prompt_blocks)
    families["held_blocks"].add_metric([url], counts.held_blocks)
    for reason, n in sorted(counts.failovers.items()):
        families["failovers"].add_metric([url, reason], n)
    families["streams_cut"].add_metric([url], counts.streams_cut)
    families["healthy"].add_metric([url], float(replica.healthy))
    families["matched"].add_metric([url], float(replica.naming is not None))
    families["in_flight"].add_metric([url], replica.in_flight)
    for tier, held in sorted(replica.index.by_medium.items()):
        families["blocks"].add_metric([url, tier], len(held))
