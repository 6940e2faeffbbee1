"""Load or recompute: which blocks of a cached prefix found below the device to load, which to compute
again (`cache.load_policy`).

A lookup finds, for each leading block of a request, the tier that holds it. Loading a block from a
slow tier can take longer than computing it again (a remote or network-disk tier, a fast GPU), so the
policy makes a plan of three parts after the device hits (the first `device_run` blocks, used as they are):

- the head, blocks `[device_run, head_end)`: computed again, *while* the tail loads (they attend only
  to what comes before them, so they need nothing that is still loading);
- the tail, blocks `[head_end, cut)`: loaded from their tiers in the background;
- everything from `cut` on: computed once head and tail are in place.

A block's K/V depend on every token before it, so nothing past a recomputed block can be loaded: the
cut is a prefix boundary, and so is the end of the head.

- `always_load`: no head, the cut at the end of the prefix.
- `always_recompute`: no tail; the device hits are kept and everything after them is computed.
- `auto`: the plan with the smallest estimated time to the prompt's end:
  `max(head_step, load(tail)) + rest_step`, the load a sum over tiers of `ReadCost.load_s` and each
  step `StepCost.step_s` at its context, all from measured speeds. The head is a step of its own
  before the one that computes the rest, and each costs a step's fixed cost besides its compute: the
  replayed one where the step is small enough to be replayed as a CUDA graph, the eager one otherwise
  (an order of magnitude apart on a GPU). So where an eager step costs more than a load, a head never
  pays, and recomputing a whole document pays only where its load is slower than an eager step. Ties
  go to loading more.

Where a head's step is not counted on to run while its tail loads (`overlap=False`: the KV cache on a GPU),
the plan is priced `head_step + load(tail) + rest_step`: a head then pays only where computing its blocks beats
loading them. On a GPU no head chosen beside a load was seen to pay for itself: an eager head took longer than
the load beside it, and a replayed head waited for its tail after its step, spending what a faster load had
saved. Why that tail did not land during the head's step is not known (benchmarks/suites/gpu/diag.py part d times
it); until it is, a head on a GPU is priced as if it did not overlap. On a CPU a head beside its tail's load
gives the first token sooner.

Only cuts at the ends of runs (maximal stretches of blocks held by one tier) need pricing: within a run,
each further block adds the same load time, while the compute it saves grows with its position (its
tokens attend to more context), so the total is concave along a run and least at one of its ends. For
a cut, the head's compute grows and the tail's load shrinks as the head grows, so their maximum is least
where they cross: found by bisection. A step's fixed cost jumps where it grows too large to be replayed,
so the longest replayed head and the first cut whose rest is replayed are priced as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from kvstrata.engine.costs import ReadCost, StepCost

LOAD_POLICIES = ("auto", "always_load", "always_recompute")


@dataclass(frozen=True)
class LoadPlan:
    """Blocks `[0, device_run)` used on the device, `[device_run, head_end)` recomputed while
    `[head_end, cut)` load, and everything from `cut` computed after."""

    device_run: int
    head_end: int
    cut: int

    @property
    def overlaps(self) -> bool:
        """Some blocks are recomputed while others load."""
        return self.device_run < self.head_end < self.cut


def choose_plan(policy: str, found_in: Sequence[str], num_tokens: int, block_size: int,
                step_cost: StepCost, read_costs: Mapping[str, ReadCost], overlap: bool = True) -> LoadPlan:
    """The plan for the prefix `found_in` (the tier of each leading block) of a `num_tokens`-token request;
    `overlap`: whether a head's step runs while its tail loads (see the module doc)."""
    n = len(found_in)
    device_run = next((k for k, tier in enumerate(found_in) if tier != "device"), n)
    if policy == "always_load" or device_run == n:
        return LoadPlan(device_run, device_run, n)
    if policy == "always_recompute":
        return LoadPlan(device_run, device_run, device_run)
    assert policy == "auto", policy
    tiers = sorted(set(found_in[device_run:]) - {"device"})
    # blocks of each tier among the first k: a tail's load is priced in O(tiers)
    counts = {t: [0] * (n + 1) for t in tiers}
    for k, tier in enumerate(found_in):
        for t in tiers:
            counts[t][k + 1] = counts[t][k] + (tier == t)

    def load_s(start: int, stop: int) -> float:
        return sum(read_costs[t].load_s(counts[t][stop] - counts[t][start]) for t in tiers)

    def head_step_s(head_end: int) -> float:  # a head is computed in a step of its own
        return step_cost.step_s((head_end - device_run) * block_size, device_run * block_size)

    def estimated_s(head_end: int, cut: int) -> float:
        rest = step_cost.step_s(num_tokens - cut * block_size, cut * block_size)
        head, tail = head_step_s(head_end), load_s(head_end, cut)
        return (max(head, tail) if overlap else head + tail) + rest

    # the longest head whose step is replayed as a CUDA graph: past it the head's fixed cost jumps to an eager step's
    longest_replayed = device_run + step_cost.replay_tokens // block_size
    # where each run of blocks held by one tier starts, after the device hits (and the prefix's end)
    run_ends = [k for k in range(device_run, n + 1) if k == n or k == device_run or found_in[k] != found_in[k - 1]]

    def best_head_end(cut: int) -> int:
        """The head end where computing the head and loading the tail take the same time (or the
        nearest block boundary on either side of it), or the longest replayed head, whichever is faster;
        without overlap, the end of a run (along one, each block adds the same load time to one side and a
        growing compute time to the other) or the longest replayed head."""
        replayed = [longest_replayed] if device_run < longest_replayed < cut else []
        if not overlap:
            return min([*(k for k in run_ends if k < cut), *replayed], key=lambda h: (estimated_s(h, cut), h))
        lo, hi = device_run, cut  # the crossing lies in (lo, hi]: the head is free at lo and the tail at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if head_step_s(mid) >= load_s(mid, cut):
                hi = mid
            else:
                lo = mid
        return min([lo, hi, *replayed], key=lambda h: (estimated_s(h, cut), h))

    cuts = list(run_ends)
    first_replayed_rest = -(-(num_tokens - step_cost.replay_tokens) // block_size)
    if step_cost.replay_tokens and device_run < first_replayed_rest < n:
        cuts.append(first_replayed_rest)
    plans = [LoadPlan(device_run, best_head_end(cut) if cut > device_run else device_run, cut) for cut in cuts]
    # a head reaching the cut loads nothing: that is computing everything after the device hits
    plans = [LoadPlan(device_run, device_run, device_run) if p.head_end == p.cut else p for p in plans]
    return min(plans, key=lambda p: (estimated_s(p.head_end, p.cut), p.head_end - p.device_run, -p.cut))


def recomputed_by_tier(found_in: Sequence[str], plan: LoadPlan, block_size: int,
                       tiers: Sequence[str], within: range | None = None) -> dict[str, int]:
    """Tokens found in each tier but computed again (the head, and everything past the cut); with
    `within`, only those of the blocks it numbers."""
    counts = {t: 0 for t in tiers}
    for k in [*range(plan.device_run, plan.head_end), *range(plan.cut, len(found_in))]:
        if within is None or k in within:
            counts[found_in[k]] += block_size
    return counts
