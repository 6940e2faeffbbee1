"""Load or recompute: where a cached prefix found below the device should end (`cache.load_policy`).

A lookup finds, for each leading block of a request, the tier that holds it. Loading a block from a
slow tier can take longer than computing it again (a remote or network-disk tier, a fast GPU), so the
policy chooses a cut: the blocks before it are used (device hits as they are, lower-tier hits loaded),
the blocks after it are recomputed with the rest of the prompt. The cut is a prefix boundary: a
block's K/V depend on every token before it, so nothing past the cut can be used.

- `always_load`: use every block found (the cut is the end of the prefix).
- `always_recompute`: use the device hits before the first lower-tier block; recompute from there.
- `auto`: the cut with the smallest estimated time to the prompt's end, load plus compute:
  sum over tiers of `ReadCost.load_s(blocks loaded from it)` plus `StepCost.prefill_s(tokens after
  the cut, context = tokens before it)`, both from measured speeds. Ties go to loading.

Only cuts at the ends of runs (maximal stretches of blocks held by one tier) need pricing: within a
run, each further block adds the same load time, while the compute it saves grows with its position
(its tokens attend to more context), so the total is concave along a run and least at one of its ends.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from kvstrata.engine.costs import ReadCost, StepCost

LOAD_POLICIES = ("auto", "always_load", "always_recompute")


def choose_cut(policy: str, found_in: Sequence[str], num_tokens: int, block_size: int,
               step_cost: StepCost, read_costs: Mapping[str, ReadCost]) -> int:
    """How many leading blocks of the prefix `found_in` (the tier of each) to use; the rest is recomputed.

    `num_tokens` is the request's length: every token after the cut is computed.
    """
    n = len(found_in)
    device_run = next((k for k, tier in enumerate(found_in) if tier != "device"), n)
    if policy == "always_load" or device_run == n:
        return n
    if policy == "always_recompute":
        return device_run
    assert policy == "auto", policy
    cuts = [k for k in range(device_run, n + 1) if k == n or k == device_run or found_in[k] != found_in[k - 1]]

    def estimated_s(cut: int) -> float:
        loaded: dict[str, int] = {}
        for tier in found_in[device_run:cut]:
            loaded[tier] = loaded.get(tier, 0) + 1
        load_s = sum(read_costs[t].load_s(k) for t, k in loaded.items() if t != "device")
        context = cut * block_size
        return load_s + step_cost.prefill_s(num_tokens - context, context)

    return min(cuts, key=lambda cut: (estimated_s(cut), -cut))


def recomputed_by_tier(found_in: Sequence[str], cut: int, block_size: int, tiers: Sequence[str]) -> dict[str, int]:
    """Tokens found in each tier but past the cut: recomputed instead of loaded (or reused)."""
    counts = {t: 0 for t in tiers}
    for tier in found_in[cut:]:
        counts[tier] += block_size
    return counts
