"""A request's cache receipt: where its time to first token went, measured, and what the cache saved it.

Four phases partition the time from a request's arrival to its first token. At every moment until
then the request is in exactly one of them, and each boundary is one timestamp that ends a phase
and starts the next, so queue + lookup + load + prefill is the TTFT (up to rounding):

- queue: from arrival until the scheduler starts looking its prefix up. It includes the wait for
  earlier steps (the server's inbox, other requests' model steps) and the scheduler's ordering of
  the waiting queue, which prices every waiting request with a lookup that holds nothing.
- lookup: the tier walk: hashing the prompt's blocks, walking device, CPU and disk, holding the
  hits and, for hits below the device, allocating device blocks and submitting their load. For a
  prefix on the device (or a miss) it ends when the request is admitted (its slots allocated).
- load: from the load's submission until the request is admitted with its landed blocks. It
  includes waiting behind other loads on the transfer worker and, once the blocks have landed,
  waiting for the step in progress (other requests' work) to end, since only the next step admits
  it. Split among the lower tiers in proportion to the time the transfer worker spent reading each
  tier's blocks for this request.
- prefill: from admission until the first token is sampled: every step that computes the request's
  uncached tokens (chunked prefill takes several), including the other requests' tokens computed
  in the same steps and any step in between that gives it no tokens.

A request that is sent back (an admission that found the device full, a preemption before its
first token) returns to the queue phase; its phases add up over each pass.

A request that recomputes the head of its prefix while the tail loads (engine/load_policy.py) is
admitted at once: the load overlapping its head's steps counts as prefill, and only what is left of
the load once the head is computed counts as load (each moment is counted once).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from kvstrata.engine.load_policy import LoadPlan, recomputed_by_tier
from kvstrata.tiers.base import TIER_NAMES

PHASES = ("queue", "lookup", "load", "prefill")
LOWER_TIERS = tuple(t for t in TIER_NAMES if t != "device")


@dataclass
class PhaseTimes:
    """A request's phases as they go (see the module doc); `finish` at the first token freezes them."""

    phase: str = "queue"
    since: float | None = None  # when `phase` began; None: at the request's arrival
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    load_s_by_tier: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0.0))
    # How the load in progress is split among tiers (relative weights), set when it lands.
    load_split: dict[str, float] = field(default_factory=dict)
    finished: bool = False

    def enter(self, phase: str, now: float, arrival: float) -> None:
        """End the current phase at `now` and start `phase`; nothing changes once finished."""
        assert phase in PHASES, phase
        if self.finished:
            return
        elapsed = now - (arrival if self.since is None else self.since)
        self.seconds[self.phase] += elapsed
        if self.phase == "load":
            self._split_load(elapsed)
        self.phase, self.since = phase, now

    def finish(self, now: float, arrival: float) -> None:
        """The first token is sampled at `now`: the phase in progress (prefill) ends there."""
        self.enter(self.phase, now, arrival)
        self.finished = True

    def _split_load(self, elapsed: float) -> None:
        total = sum(self.load_split.values())
        assert total > 0, "a load ended without saying which tiers it read"
        for tier, weight in self.load_split.items():
            self.load_s_by_tier[tier] += elapsed * weight / total
        self.load_split = {}


@dataclass
class HitAccount:
    """What the cache served a request, counted once however often it is admitted (engine/kv_manager.py keeps it).

    Set at its first admission: the prompt tokens each tier served, those found in a tier that the load policy
    chose to recompute, and what computing the served ones would have cost. A tail planned at that admission to
    load beside the prefix counts when it lands or, when the request is preempted before, wherever its next
    admission finds it (each block once)."""

    cached_tokens_by_tier: dict[str, int] | None = None  # None until the first admission
    recomputed_tokens_by_tier: dict[str, int] | None = None
    prefill_saved_s_estimate: float = 0.0
    tail_to_count: range | None = None  # the tail's blocks not counted yet
    # of those, the tokens a retried lookup found in each tier but chose to recompute: counted at that admission
    tail_recomputed: dict[str, int] | None = None

    @property
    def admitted(self) -> bool:
        return self.cached_tokens_by_tier is not None

    def plan(self, found_in: Sequence[str], plan: LoadPlan, block_size: int) -> None:
        """Take the plan an admission starts from (its lookup found block k in tier `found_in[k]`): at the first,
        the tokens found in each tier and recomputed, and the tail to count when it lands; at a retry (after a
        preemption), what this lookup found of the first admission's tail still to count and chose to recompute."""
        if not self.admitted:
            self.recomputed_tokens_by_tier = recomputed_by_tier(found_in, plan, block_size, TIER_NAMES)
            self.tail_to_count = range(plan.head_end, plan.cut) if plan.overlaps else None
        elif self.tail_to_count is not None:
            self.tail_recomputed = recomputed_by_tier(found_in, plan, block_size, TIER_NAMES,
                                                      within=self.tail_to_count)

    def admit(self, tiers: Sequence[str], block_size: int, prefill_saved_s: float,
              tail: range | None) -> TierBlocks:
        """The request is admitted with a prefix whose block k the tier `tiers[k]` served, and `tail` (the blocks of
        a tail still loading, or None). Its first admission reports that prefix, and `prefill_saved_s` (what
        computing it would cost); a later one (after a preemption while a tail loaded) counts only the blocks of
        the first admission's tail that had not landed, wherever this prefix found them. Returns the blocks newly
        counted."""
        if not self.admitted:
            self.prefill_saved_s_estimate = prefill_saved_s
            self.cached_tokens_by_tier = tokens_by_tier(tiers, block_size)
            counted = TierBlocks(_in_blocks(self.cached_tokens_by_tier, block_size),
                                 _in_blocks(self.recomputed_tokens_by_tier or {}, block_size))
        else:
            recomputed = self.tail_recomputed or {}
            for t, n in recomputed.items():
                self.recomputed_tokens_by_tier[t] += n
            counted = TierBlocks(self._count_tail(tiers, 0, block_size), _in_blocks(recomputed, block_size))
        self.tail_recomputed = None
        self.tail_to_count = _overlap(self.tail_to_count, tail)
        return counted

    def land_tail(self, tiers: Sequence[str], start: int, block_size: int, prefill_saved_s: float) -> TierBlocks:
        """The tail loading beside the prefix has landed at block `start`, its block k served by `tiers[k]`: what
        it saved is added, and its blocks still to count are counted (what did not arrive, the request computes).
        Returns the blocks newly counted."""
        self.prefill_saved_s_estimate += prefill_saved_s
        counted = TierBlocks(self._count_tail(tiers, start, block_size), {})
        self.tail_to_count = None
        return counted

    def _count_tail(self, tiers: Sequence[str], start: int, block_size: int) -> dict[str, int]:
        """Count the blocks `start..` (served by `tiers`) that are in the tail still to count; returns how many
        each tier served."""
        served = dict.fromkeys(TIER_NAMES, 0)
        if self.tail_to_count is not None:
            for k, tier in enumerate(tiers, start):
                if k in self.tail_to_count:
                    self.cached_tokens_by_tier[tier] = self.cached_tokens_by_tier.get(tier, 0) + block_size
                    served[tier] += 1
        return served


@dataclass
class TierBlocks:
    """Blocks per tier that one step of a request's `HitAccount` counted: served, and found but recomputed."""

    served: dict[str, int]
    recomputed: dict[str, int]


def tokens_by_tier(tiers: Sequence[str], block_size: int) -> dict[str, int]:
    """The tokens each tier served, from the tier of each block of a prefix."""
    return {t: tiers.count(t) * block_size for t in TIER_NAMES}


def _in_blocks(tokens: dict[str, int], block_size: int) -> dict[str, int]:
    return {t: n // block_size for t, n in tokens.items()}


def _overlap(a: range | None, b: range | None) -> range | None:
    """The blocks in both ranges (None: none)."""
    if a is None or b is None or max(a.start, b.start) >= min(a.stop, b.stop):
        return None
    return range(max(a.start, b.start), min(a.stop, b.stop))


@dataclass(frozen=True)
class CacheReceipt:
    """Measured, in milliseconds: the request's TTFT and the phases it went to (they add up to it),
    the prompt tokens each tier served, and an estimate of the prefill time those tokens saved."""

    ttft_ms: float
    queue_ms: float
    lookup_ms: float
    load_ms_by_tier: dict[str, float]   # lower tiers only: the device needs no load
    prefill_ms: float
    cached_tokens_by_tier: dict[str, int]
    recomputed_tokens_by_tier: dict[str, int]  # found in a tier, recomputed by the load policy's choice
    # What computing the cached tokens from scratch would cost by the engine's fitted step-cost model
    # (engine/costs.py) when the request was admitted: an estimate, not a measurement; the net saving
    # subtracts lookup and load.
    prefill_saved_ms_estimate: float

    @property
    def load_ms(self) -> float:
        return sum(self.load_ms_by_tier.values())

    @property
    def parts_ms(self) -> float:
        """queue + lookup + load + prefill: the TTFT, up to rounding."""
        return self.queue_ms + self.lookup_ms + self.load_ms + self.prefill_ms

    @classmethod
    def measured(cls, ttft_s: float, phases: PhaseTimes, cached_tokens_by_tier: dict[str, int],
                 recomputed_tokens_by_tier: dict[str, int], prefill_saved_s_estimate: float) -> "CacheReceipt":
        assert phases.finished, "a receipt is written at the first token"
        ms = {phase: s * 1e3 for phase, s in phases.seconds.items()}
        return cls(ttft_ms=ttft_s * 1e3, queue_ms=ms["queue"], lookup_ms=ms["lookup"],
                   load_ms_by_tier={t: s * 1e3 for t, s in phases.load_s_by_tier.items()},
                   prefill_ms=ms["prefill"], cached_tokens_by_tier=dict(cached_tokens_by_tier),
                   recomputed_tokens_by_tier=dict(recomputed_tokens_by_tier),
                   prefill_saved_ms_estimate=prefill_saved_s_estimate * 1e3)

    def to_dict(self, decimals: int | None = None) -> dict:
        """The receipt as plain data; with `decimals`, every time rounded to that many decimals of a ms."""
        data = asdict(self)
        if decimals is not None:
            data = {k: _rounded(v, decimals) for k, v in data.items()}
            data["cached_tokens_by_tier"] = dict(self.cached_tokens_by_tier)
            data["recomputed_tokens_by_tier"] = dict(self.recomputed_tokens_by_tier)
        return data


def _rounded(value, decimals: int):
    if isinstance(value, dict):
        return {k: round(v, decimals) for k, v in value.items()}
    return round(value, decimals)
