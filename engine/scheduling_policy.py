"""`scheduler.policy`: the order in which waiting requests are admitted and how a step's tokens are shared.

A policy is an object with two calls the scheduler makes (engine/scheduler.py): `order` (the candidates
for admission, in the order to try them) and `plan_step` (that order, the running requests' order, the
step's token budget and the chunk the long prefills share). Both read the scheduler; neither changes it.

- `fcfs`: arrival order (preempted requests first); the budget is `max_num_batched_tokens`.
- `uncached_first` (default):
  * Order by uncached work. Each waiting request is priced by what is left after a lookup that
    holds nothing (one `count_prefix` per tier): the tokens to compute, plus its lower-tier hits at
    their measured load time (in tokens of prefill time). Short work first, ties in arrival order.
  * Aging. A request that has waited `AGING` times its own estimated cost (in seconds at the
    measured prefill speed, and at least `MIN_AGE_S`) is overdue; overdue requests go before all
    others, in arrival order. Bound: a request's wait exceeds max(AGING x its cost, MIN_AGE_S) by at
    most the time the engine takes to admit the overdue requests that arrived before it, which is
    the wait first-come-first-served would give it.
  * Step cap. While a first token is at stake (a waiting request whose uncached work fits in one
    step, or a prefill in progress that the step finishes), a step computes at most the tokens that
    `step_target` allows at the measured prefill speed (at the context of the furthest running prefill:
    a token costs more the more it attends to), so short work never waits long for a step;
    but at least `MIN_STEP_TOKENS`, and enough that the step's fixed cost stays under
    `MAX_OVERHEAD_SHARE` of it (throughput first where a step's overhead is large against the
    target). Otherwise (long prefills and decodes) a step may last `LONG_STEP_TARGETS` step targets,
    so that long prefills lose little to step overheads, but only while nobody arrives during steps:
    once a request has arrived while a step was running (it had to wait for that step) within the
    last `ARRIVALS_MEMORY_S`, every step keeps to the cap. Online serving, where requests come at
    any moment, thus gets steps near the target (a question arriving mid-step waits for one of
    them, not for several); a batch given at once, or clients that send between steps, gets long
    steps, as nobody waits for them.
  * Bounded share. While short work waits, the step holds the short work (the waiting requests
    that fit in a step, and the running prefills and decodes whose rest fits in what the step target
    buys) and, between the long prefills in progress, at most `long_prefill_share` of what the
    target buys (priced as the cap is, without its overhead floor), within the cap: a step that
    serves a question stays near its target instead of finishing a document's last few hundred
    tokens beside it. With nothing short waiting, long prefills get the whole step. Several requests
    may be mid-prefill at once; the long ones are given the budget least work left first, so that one
    finishes before the next instead of all finishing late.

Under either policy landed loads go first (engine/scheduler.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstrata.engine.costs import MIN_STEP_TOKENS, StepCost
from kvstrata.engine.kv_state import UncachedEstimate
from kvstrata.engine.request import Request, RequestStatus

AGING = 4.0              # a request is overdue once it has waited this many times its own estimated cost
MIN_AGE_S = 1.0          # ... and at least this long: a near-free request is not overdue at once
LONG_STEP_TARGETS = 8    # with no first token at stake a step may last this many step targets (see the module doc)
ARRIVALS_MEMORY_S = 10.0  # ... unless a request arrived while a step was running within this many seconds


class _CostOwner(Protocol):
    step_cost: StepCost


class SchedulerView(Protocol):
    """What a policy reads of the scheduler (engine/scheduler.py), and all it reads."""

    kv: _CostOwner  # the KV cache manager, which owns the measured step cost
    running: list[Request]
    max_num_batched_tokens: int
    max_num_seqs: int
    num_loading: int
    last_arrival_mid_step: float

    def clock(self) -> float: ...

    def estimate(self, request: Request) -> UncachedEstimate: ...

    def remaining(self, request: Request) -> int: ...

    def prefill_context(self) -> int: ...


@dataclass
class StepPlan:
    """A policy's plan for one step: the candidates for admission and the running requests, each in the order
    to serve them, the step's token budget, and the tokens the long prefills (those the step cannot finish)
    share between them."""

    candidates: list[Request]
    running: list[Request]
    budget: int
    long_chunk: int


class FirstComeFirstServed:
    """`fcfs`: arrival order, the whole budget."""

    name = "fcfs"
    # Only the requests a free sequence slot may admit are looked up ahead of their admission.
    prices_every_candidate = False

    def order(self, scheduler: SchedulerView, candidates: list[Request]) -> list[Request]:
        return candidates

    def plan_step(self, scheduler: SchedulerView, candidates: list[Request]) -> StepPlan:
        budget = scheduler.max_num_batched_tokens
        return StepPlan(candidates, scheduler.running, budget, budget)


class UncachedFirst:
    """`uncached_first`: short uncached work first, with aging, under a step cap (see the module doc)."""

    name = "uncached_first"
    prices_every_candidate = True  # ordering prices them all

    def __init__(self, step_target: float, long_prefill_share: float):
        self.step_target = step_target
        self.long_prefill_share = long_prefill_share

    def order(self, scheduler: SchedulerView, candidates: list[Request]) -> list[Request]:
        """Landed loads first, then overdue requests in arrival order, then the rest by uncached work."""
        now, per_token_s = scheduler.clock(), scheduler.kv.step_cost.per_token_s
        work = {r.request_id: self.uncached_work(scheduler, r) for r in candidates}

        def key(r: Request):
            landed = r.status == RequestStatus.LOADING
            overdue = now - r.arrival_time >= max(AGING * work[r.request_id] * per_token_s, MIN_AGE_S)
            return (not landed, not overdue, 0 if overdue else work[r.request_id], r.arrival_time)

        return sorted(candidates, key=key)

    @staticmethod
    def uncached_work(scheduler: SchedulerView, request: Request) -> float:
        """Tokens left to compute after a lookup, plus lower-tier hits priced at their load time."""
        estimate = scheduler.estimate(request)
        return estimate.tokens + estimate.load_s / max(scheduler.kv.step_cost.per_token_s, 1e-9)

    def plan_step(self, scheduler: SchedulerView, candidates: list[Request]) -> StepPlan:
        running, max_tokens = scheduler.running, scheduler.max_num_batched_tokens
        if not candidates and len(running) <= MIN_STEP_TOKENS and all(scheduler.remaining(r) <= 1 for r in running):
            # Decodes alone, fewer than any cap: every budget holds them, so the step cost is not asked (asked,
            # it refits after every step: a large share of a decode step's host work, for an answer that
            # changes nothing).
            return StepPlan(candidates, list(running), max_tokens, max_tokens)
        cost, context = scheduler.kv.step_cost, scheduler.prefill_context()
        capped = min(max_tokens, cost.tokens_within(self.step_target, context))
        candidates = self.order(scheduler, candidates)
        short_tokens = sum(scheduler.estimate(r).tokens for r in candidates
                           if self.uncached_work(scheduler, r) <= capped)
        # Short work (decodes, prefills this step finishes) first, in admission order; then long prefills,
        # least work left first: finishing one before the next gives each the TTFT it would have had first
        # come first served, or better, where sharing the step evenly would delay them all.
        running = sorted(running, key=lambda r: (0, 0) if scheduler.remaining(r) <= capped
                         else (1, scheduler.remaining(r)))
        if len(scheduler.running) + scheduler.num_loading >= scheduler.max_num_seqs:
            short_tokens = 0  # short requests wait for a sequence slot, not for this step: none holds long ones back
        if short_tokens:
            # The step holds the short work and the long prefills' share of what the step target buys
            # (without the cap's overhead floor, which is for throughput): padded to the cap, a step
            # that serves a question would run long, e.g. finishing a document beside it.
            target = max(MIN_STEP_TOKENS, cost.tokens_for(self.step_target - cost.overhead_s, context))
            long_chunk = max(1, int(self.long_prefill_share * min(capped, target)))
            short_running = sum(n for n in map(scheduler.remaining, running) if n <= target)
            return StepPlan(candidates, running, min(capped, short_tokens + short_running + long_chunk), long_chunk)
        if any(r.num_computed_tokens < r.num_prompt_tokens and 0 < scheduler.remaining(r) <= capped for r in running):
            return StepPlan(candidates, running, capped, capped)  # a prefill this step finishes: its first token
        if scheduler.clock() - scheduler.last_arrival_mid_step < ARRIVALS_MEMORY_S:
            # requests arrive mid-step: they would wait for a long one
            return StepPlan(candidates, running, capped, capped)
        long_step = min(max_tokens, cost.tokens_within(LONG_STEP_TARGETS * self.step_target, context))
        return StepPlan(candidates, running, long_step, long_step)


def make_policy(name: str, step_target: float, long_prefill_share: float) -> FirstComeFirstServed | UncachedFirst:
    if name == FirstComeFirstServed.name:
        return FirstComeFirstServed()
    if name == UncachedFirst.name:
        return UncachedFirst(step_target, long_prefill_share)
    raise ValueError(f"scheduler.policy: unknown policy {name!r} (use one of {', '.join(POLICIES)})")


POLICIES = (FirstComeFirstServed.name, UncachedFirst.name)
