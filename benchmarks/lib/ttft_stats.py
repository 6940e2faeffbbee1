"""Percentiles, per-request classification and the goals of the TTFT benchmark (pure functions)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from kvstrata.tiers.names import TIER_NAMES as TIERS  # re-exported for the benchmark and its report

MISS = "miss"
# A request counts as a hit when at least this share of its prompt came from the cache; the tier
# that served most of the cached tokens names the hit.
HIT_SHARE = 0.5


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> dict | None:
    """n, p50, p90, p99, mean, min and max of a list of seconds; None for an empty list."""
    if not values:
        return None
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "mean": sum(values) / len(values), "min": min(values),
            "max": max(values)}


def hit_tier(cached_tokens_by_tier: Mapping[str, int], prompt_tokens: int) -> str:
    """A tier name ("device", "cpu", "disk", "remote") for a hit (most cached tokens from that tier), else "miss"."""
    cached = sum(cached_tokens_by_tier.get(t, 0) for t in TIERS)
    if prompt_tokens <= 0 or cached < HIT_SHARE * prompt_tokens:
        return MISS
    return max(TIERS, key=lambda t: cached_tokens_by_tier.get(t, 0))


def mean_cached_by_tier(records: Iterable[Mapping]) -> dict[str, float]:
    rows = list(records)
    if not rows:
        return {t: 0.0 for t in TIERS}
    return {t: sum(r["cached_tokens_by_tier"].get(t, 0) for r in rows) / len(rows) for t in TIERS}


def receipt_error(receipt: Mapping) -> float:
    """|queue + lookup + load + prefill - ttft| / ttft of one receipt (engine/receipt.py, as a dict)."""
    parts = receipt["queue_ms"] + receipt["lookup_ms"] + sum(receipt["load_ms_by_tier"].values()) + receipt["prefill_ms"]
    return abs(parts - receipt["ttft_ms"]) / receipt["ttft_ms"]


def worst_receipt_error(records: Iterable[Mapping]) -> float | None:
    """The largest `receipt_error` among records that carry a receipt (None when none does)."""
    errors = [receipt_error(r["receipt"]) for r in records if r.get("receipt")]
    return max(errors) if errors else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


@dataclass
class Goal:
    """One figure we hold ourselves to: `value` compared with `target` by `direction`."""

    name: str
    value: float | None
    target: float
    direction: str          # ">=" (at least) or "<=" (at most) or "<"
    numerator: str          # what was divided, in words
    denominator: str

    @property
    def status(self) -> str:
        if self.value is None:
            return "N/A"
        passed = {">=": self.value >= self.target, "<=": self.value <= self.target,
                  "<": self.value < self.target}[self.direction]
        return "PASS" if passed else "MISS"

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "target": self.target, "direction": self.direction,
                "numerator": self.numerator, "denominator": self.denominator, "status": self.status}


def p50_of(records: Iterable[Mapping], **where) -> float | None:
    """p50 TTFT of the records whose fields equal `where` (None when none match)."""
    values = [r["ttft_s"] for r in records if all(r.get(k) == v for k, v in where.items())]
    return percentile(values, 50) if values else None
