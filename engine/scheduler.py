"""Continuous batching with chunked prefill (vLLM v1's shape, one path), admission by uncached work.

Each step has a token budget. Running requests go first (decodes and the rest of chunked
prefills), then waiting requests are admitted: at admission a request's prefix is looked up across
every tier, and only the uncached suffix is scheduled. A request whose prefix was found below the
device waits in the loading state (vLLM's WAITING_FOR_REMOTE_KVS) while its blocks are copied up,
and the scheduler admits the requests behind it meanwhile; a landed request is admitted first. A
request whose next block not on the device is one a running prefill is about to compute (a second
question on a document still being read), or one another request is loading, waits for it, under
either policy, rather than computing or loading the same K/V a second time; the others go ahead of
it. So does a request asking for its prompt's log-probabilities whose next block's entries another
request is computing (engine/prompt_logprobs.py): answers scored at once on one document compute it
once. When
the device pool cannot hold a running request's next tokens, the newest running request is
preempted (its blocks freed, to be recomputed later, mostly from the cache).

`scheduler.policy` decides the order of admission and the step's budget:

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
    them, not for eight); a batch given at once, or clients that send between steps, gets long
    steps, as nobody waits for them.
  * Bounded share. While short work waits, the step holds the short work (the waiting requests
    that fit in a step, and the running prefills and decodes whose rest fits in what the step target
    buys) and, between the long prefills in progress, at most `long_prefill_share` of what the
    target buys (priced as the cap is, without its overhead floor), within the cap: a step that
    serves a question stays near its target instead of finishing a document's last few hundred
    tokens beside it. With nothing short waiting, long prefills get the whole step. Several requests
    may be mid-prefill at once; the long ones are given the budget least work left first, so that one
    finishes before the next instead of all finishing late.

An internal error while one request is handled on its own (its lookup and load start, its admission, its
blocks for the step, its tail landing) fails that request alone (`fail`): its blocks and holds are let go as an
abort's are, it ends with `FINISHED_ERROR`, and the engine takes it from `take_failed` to tell its caller; the
other requests go on.

Receipts (engine/receipt.py): the KV manager's lookup starts a request's lookup phase (and its load
phase, when it loads); admission here starts its prefill phase; a request sent back (its admission
found the device full, or it was preempted) returns to the queue phase.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstrata.engine.costs import MIN_STEP_TOKENS, StepCost, attention_pairs, kv_reads
from kvstrata.engine.kv_manager import KVCacheManager, UncachedEstimate
from kvstrata.engine.request import Request, RequestStatus
from kvstrata.tiers.block_pool import KVCacheBlock

logger = logging.getLogger("kvstrata")

POLICIES = ("fcfs", "uncached_first")
AGING = 4.0              # a request is overdue once it has waited this many times its own estimated cost
MIN_AGE_S = 1.0          # ... and at least this long: a near-free request is not overdue at once
LONG_STEP_TARGETS = 8    # with no first token at stake a step may last this many step targets (see the module doc)
ARRIVALS_MEMORY_S = 10.0  # ... unless a request arrived while a step was running within this many seconds


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step reaches the end of the request's known tokens: a token is sampled.
    samples: bool
    context: int = 0  # the request's computed tokens before this step (its new tokens attend to them)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    computed: bool = False  # the step's K/V are computed (`update_after_step` has run)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_attention_pairs(self) -> int:
        return sum(attention_pairs(s.num_new_tokens, s.context) for s in self.scheduled)

    @property
    def num_kv_reads(self) -> int:
        return sum(kv_reads(s.num_new_tokens, s.context) for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "uncached_first", step_target: float = 0.25, long_prefill_share: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"scheduler.policy: unknown policy {policy!r} (use one of {', '.join(POLICIES)})")
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.step_target = step_target
        self.long_prefill_share = long_prefill_share
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # lookups of waiting requests: this step's, or kept from earlier ones (see `_lookups_hold`)
        self._estimates: dict[str, UncachedEstimate] = {}
        self._refused: Request | None = None  # the request whose refusal for room ended the last admissions
        self._step_span = (0.0, 0.0)  # when the last step was scheduled and when its compute ended
        self._last_waiting_arrival = -float("inf")  # the latest arrival that found a step running
        self._failed: list[Request] = []  # ended by an internal error, not yet taken by the engine (`fail`)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.LOADING)

    @property
    def cost(self) -> StepCost:
        """The engine's measured step cost: kept by the KV manager, whose load policy prices recomputing with it."""
        return self.kv.step_cost

    @cost.setter
    def cost(self, cost: StepCost) -> None:
        self.kv.step_cost = cost

    def observe_step(self, out: SchedulerOutput, seconds: float, replayed: bool = False) -> None:
        """The engine reports how long a scheduled step took (it prices work and caps steps); `replayed`: as a
        recorded CUDA graph."""
        self.cost.observe(out.num_tokens, seconds, out.num_attention_pairs, out.num_kv_reads, replayed=replayed)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.release_abandoned()
        self._land_tails()
        if not self._lookups_hold():
            self._estimates = {}
        self._note_arrivals_during_last_step()
        self._step_span = (self.clock(), self._step_span[1])  # this step starts; update_after_step ends it
        budget = self.max_num_batched_tokens
        to_come = self.kv.blocks_to_come([r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens])
        candidates = self._candidates(to_come)
        running, long_chunk = self.running, budget
        if self.policy == "uncached_first":
            candidates, running, budget, long_chunk = self._uncached_first_step(candidates)
        budget, long_chunk = self._schedule_running(out, running, budget, long_chunk)
        self._admit_waiting(out, candidates, budget, long_chunk, to_come)
        return out

    def prepare_next_step(self) -> None:
        """The next step's admission work that does not depend on the step now running, which the engine has
        this do while the device computes that step: finish the loads that have landed (their blocks cached
        on the device), look up the requests that arrived, and start the loads of the first ones in order
        (while sequence slots last) whose prefix is found below the device. Nothing is admitted to run: the
        next `schedule` admits, from what this found. On one H200 this work cost the next step 2.4 ms of
        host time at a 7k-token CPU-tier hit's lookup and 1.7 ms at its landing, beside decodes whose device
        took about 1.6 ms a step (benchmarks/results/gpu_diag_h200.md): done here, most of it is hidden."""
        self.kv.finish_landed_loads()
        if (not self.waiting or len(self.running) + self.num_loading >= self.max_num_seqs
                or all(r.status == RequestStatus.LOADING for r in self.waiting)):
            return  # no sequence slot to start a load in, or nobody to look up (a landed load is admitted next)
        if self._refused is not None and self.kv.is_refused(self._refused):
            return  # the device had no room for the last admissions, and has none now: the next step asks again
        to_come = self.kv.blocks_to_come([r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens])
        candidates = self._candidates(to_come)
        if not any(r.status != RequestStatus.LOADING and self._loads_below(r) for r in candidates):
            return  # no load to start: ordering a queue of misses behind a full device at every step cost 0.1 ms
        if self.policy == "uncached_first":
            candidates, _ = self._order(candidates, self.max_num_batched_tokens)
        num_seqs = len(self.running) + self.num_loading
        for request in candidates:
            if request.status == RequestStatus.LOADING:
                continue  # landed: the next step admits it first
            if num_seqs >= self.max_num_seqs or not self._loads_below(request):
                break  # the next step decides: it may compute (which takes its budget), or wait for a slot
            if self._waits_for(request, to_come):
                continue
            try:
                started = self.kv.start_prefix(request, refuse=False)
            except Exception as exc:
                self.fail(request, exc, "looking up its prefix")
                continue
            if not started:  # no room yet: the next step asks again once this one's finished requests have freed theirs
                break
            request.status = RequestStatus.LOADING
            num_seqs += 1
            to_come |= self.kv.blocks_loading_for(request)

    def _loads_below(self, request: Request) -> bool:
        """Its lookup found part of the prefix it would use below the device: admitted, it would wait for a load."""
        return any(n for tier, n in self._estimate(request).hit_blocks.items() if tier != "device")

    def _candidates(self, to_come: set[bytes]) -> list[Request]:
        """The waiting requests this step may admit, in queue order: those whose load is not in flight, or,
        while every sequence slot is taken, only the landed loads (each holds its slot already). The others
        cannot start, and ordering them would look each one up at every step for as long as the slots stay
        full, which is when requests queue (16 waiting made a decode step several times longer)."""
        free_slots = self.max_num_seqs - len(self.running) - self.num_loading
        eligible = [r for r in self.waiting if not self.kv.is_loading(r)
                    and (free_slots > 0 or r.status == RequestStatus.LOADING)]
        # Each is priced (to order them, or to see whether it waits for a block to come) or, first come first
        # served, each that a free slot may admit: all in one batch, which their admissions then start from.
        self._price(eligible if self.policy == "uncached_first" or to_come else eligible[:max(free_slots, 0)])
        # Landed loads first, under either policy: each holds device blocks and a sequence slot, and a request
        # ahead of it that the device has no room for may fit only once they have run (first come first
        # served, a preempted request at the head, refused for room that two landed loads behind it held,
        # waited for ever, and so did they).
        return sorted((r for r in eligible if not self._waits_for(r, to_come)),
                      key=lambda r: r.status != RequestStatus.LOADING)

    def _price(self, requests: list[Request]) -> None:
        """Look up the requests not priced yet in this step together: the lower tiers are asked once for all of them
        (a burst of arrivals, looked up one by one, cost one round trip each to a remote server in one step)."""
        unpriced = [r for r in requests if r.request_id not in self._estimates]
        self._estimates.update(zip((r.request_id for r in unpriced), self.kv.estimate_uncached_many(unpriced)))

    def _uncached_first_step(self, candidates: list[Request]) -> tuple[list[Request], list[Request], int, int]:
        """`uncached_first`'s order and budgets (see the module doc): the candidates and the running
        requests in order, the step's token budget, and the chunk the long prefills share."""
        if not candidates and len(self.running) <= MIN_STEP_TOKENS and all(
                self._remaining(r) <= 1 for r in self.running):
            # Decodes alone, fewer than any cap: every budget holds them, so the step cost is not asked. (Asked, it
            # refits after every step: a fifth of a decode step's host work, for an answer that changes nothing.)
            return candidates, list(self.running), self.max_num_batched_tokens, self.max_num_batched_tokens
        context = self._prefill_context()
        capped = min(self.max_num_batched_tokens, self.cost.tokens_within(self.step_target, context))
        candidates, short_tokens = self._order(candidates, capped)
        running = sorted(self.running, key=lambda r: self._running_key(r, capped))
        if len(self.running) + self.num_loading >= self.max_num_seqs:
            short_tokens = 0  # short requests wait for a sequence slot, not for this step: none holds long ones back
        if short_tokens:
            # The step holds the short work and the long prefills' share of what the step target buys
            # (without the cap's overhead floor, which is for throughput): padded to the cap, a step
            # that serves a question would run long, e.g. finishing a document beside it.
            target = max(MIN_STEP_TOKENS, self.cost.tokens_for(self.step_target - self.cost.overhead_s, context))
            long_chunk = max(1, int(self.long_prefill_share * min(capped, target)))
            short_running = sum(n for n in map(self._remaining, running) if n <= target)
            return candidates, running, min(capped, short_tokens + short_running + long_chunk), long_chunk
        if any(r.num_computed_tokens < r.num_prompt_tokens and 0 < self._remaining(r) <= capped for r in running):
            return candidates, running, capped, capped  # a prefill this step finishes: its first token
        if self.clock() - self._last_waiting_arrival < ARRIVALS_MEMORY_S:
            return candidates, running, capped, capped  # requests arrive mid-step: they would wait for a long one
        long_step = min(self.max_num_batched_tokens,
                        self.cost.tokens_within(LONG_STEP_TARGETS * self.step_target, context))
        return candidates, running, long_step, long_step

    def _note_arrivals_during_last_step(self) -> None:
        """Remember when a waiting request last arrived while a step was running (see the module doc).
        A request added between steps (a batch, or a client answered at a step's end) waited for none."""
        started, ended = self._step_span
        arrived = [r.arrival_time for r in self.waiting if started < r.arrival_time < ended]
        self._last_waiting_arrival = max([self._last_waiting_arrival, *arrived])

    def _prefill_context(self) -> int:
        """The context the step's long prefill chunk follows (the furthest running prefill): its tokens
        cost more the more they attend to, and the step cap must price them so."""
        return max((r.num_computed_tokens for r in self.running if r.num_computed_tokens < r.num_prompt_tokens),
                   default=0)

    def _land_tails(self) -> None:
        """Running requests that computed the head of their prefix while its tail loaded: the tail's
        blocks join them once it has landed; until then they wait in their load phase."""
        for request in list(self.running):
            barrier = self.kv.barrier(request)
            if barrier is None or request.num_computed_tokens < barrier:
                continue
            try:
                if self.kv.tail_ready(request):
                    self.kv.land_tail(request)
                    request.enter_phase("prefill")
                elif request.phases.phase != "load":
                    self.kv.wait_for_tail(request)
            except Exception as exc:
                self.fail(request, exc, "landing its prefix's tail")

    def _remaining(self, request: Request) -> int:
        """Tokens the request can compute now: up to the end of its prompt, or to its barrier."""
        barrier = self.kv.barrier(request)
        return (request.num_tokens if barrier is None else barrier) - request.num_computed_tokens

    def _running_key(self, request: Request, budget: int) -> tuple:
        """Short work (decodes, prefills this step finishes) first, in admission order; then long
        prefills, least work left first: finishing one before the next gives each the TTFT it would
        have had first come first served, or better, where sharing the step evenly would delay them all."""
        remaining = self._remaining(request)
        return (0, 0) if remaining <= budget else (1, remaining)

    def _order(self, candidates: list[Request], budget: int) -> tuple[list[Request], int]:
        """Landed loads first, then overdue requests in arrival order, then the rest by uncached work;
        and the tokens the short candidates (their uncached work fits in one step) have to compute."""
        now = self.clock()
        work = {r.request_id: self._uncached_work(r) for r in candidates}

        def key(r: Request):
            landed = r.status == RequestStatus.LOADING
            cost_s = work[r.request_id] * self.cost.per_token_s
            overdue = now - r.arrival_time >= max(AGING * cost_s, MIN_AGE_S)
            return (not landed, not overdue, 0 if overdue else work[r.request_id], r.arrival_time)

        short_tokens = sum(self._estimate(r).tokens for r in candidates if work[r.request_id] <= budget)
        return sorted(candidates, key=key), short_tokens

    def _lookups_hold(self) -> bool:
        """Whether the waiting requests' lookups of earlier steps still price them: the request refused for
        room at the last admissions would be refused again now (no device block freed, its prefix unchanged:
        `KVCacheManager.is_refused`). Admissions end at that request, so only requests that arrived since, and
        those ordered before it (landed loads, overdue ones), can start before it; nothing has made room
        that a new price could use. Looking every waiting request up again at every step made a step's host
        work grow with the queue behind a full device (benchmarks/results/engine_host.md). A price that
        changes meanwhile is seen once the refusal ends, within `LOWER_LOOKUP_REFRESH_S`."""
        refused, self._refused = self._refused, None
        return refused is not None and self.kv.is_refused(refused)

    def _estimate(self, request: Request) -> UncachedEstimate:
        """The request's work left after a lookup, looked up once per step."""
        if request.request_id not in self._estimates:
            self._price([request])
        return self._estimates[request.request_id]

    def _waits_for(self, request: Request, to_come: set[bytes]) -> bool:
        """The first block the request would compute or load is one a running prefill is computing or
        another request's load is bringing up: it waits for it (then finds it on the device) rather
        than computing or loading the same K/V a second time."""
        return bool(to_come) and self._estimate(request).next_hash in to_come

    def _uncached_work(self, request: Request) -> float:
        """Tokens left to compute after a lookup, plus lower-tier hits priced at their load time."""
        estimate = self._estimate(request)
        load_s = sum(self.kv.read_costs[t].load_s(n) for t, n in estimate.hit_blocks.items() if t != "device")
        return estimate.tokens + load_s / max(self.cost.per_token_s, 1e-9)

    def _schedule_running(self, out: SchedulerOutput, running: list[Request], budget: int,
                          long_chunk: int) -> tuple[int, int]:
        """Running requests in `running` order; long prefills (those the step cannot finish) get at most
        `long_chunk` between them. When the device cannot hold a request's next tokens, the newest
        running request not yet scheduled this step gives way. Returns the budget and long chunk left."""
        scheduled: set[str] = set()
        for request in list(running):  # (a copy: a request that fails leaves `self.running`)
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted to make room earlier in this step
                continue
            num_new = self._chunk(self._remaining(request), budget, long_chunk)
            if num_new <= 0:
                continue
            try:
                fits = self._make_room(out, request, num_new, scheduled)
            except Exception as exc:
                self.fail(request, exc, "allocating its blocks")
                continue
            if not fits:
                break  # the request itself was preempted: the device is full
            out.scheduled.append(self._scheduled(request, num_new))
            scheduled.add(request.request_id)
            budget, long_chunk = self._spend(out.scheduled[-1], budget, long_chunk)
        return budget, long_chunk

    def _make_room(self, out: SchedulerOutput, request: Request, num_new: int, scheduled: set[str]) -> bool:
        """Give a running request slots for `num_new` more tokens, preempting the newest running requests not
        scheduled this step while the device cannot hold them; False once the request itself gave way."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    @staticmethod
    def _spend(scheduled: ScheduledRequest, budget: int, long_chunk: int) -> tuple[int, int]:
        """The budget and long chunk left after `scheduled`: a chunk that does not reach the end of its
        request's tokens (a long prefill's) comes out of both."""
        n = scheduled.num_new_tokens
        return budget - n, long_chunk - (0 if scheduled.samples else n)

    @staticmethod
    def _chunk(remaining: int, budget: int, long_chunk: int) -> int:
        """A request's tokens this step: all that fit, but a prefill this step cannot finish (a long
        one) gets at most what is left of `long_chunk`."""
        return min(remaining, budget) if remaining <= budget else min(long_chunk, budget)

    def _admit_waiting(self, out: SchedulerOutput, candidates: list[Request], budget: int, long_chunk: int,
                       to_come: set[bytes]) -> None:
        """Admit waiting requests in `candidates` order while budget and sequence slots last. Loading
        ones count towards the sequence slots (they hold device blocks); a request that waits for
        blocks a load started here brings up is passed over (`_waits_for`)."""
        num_seqs = len(self.running) + self.num_loading
        for request in candidates:
            if budget <= 0 or out.preempted:
                break
            landed = request.status == RequestStatus.LOADING  # its prefix is held already
            if not landed and num_seqs >= self.max_num_seqs:
                break
            if self._waits_for(request, to_come):
                continue
            try:
                computed = self.kv.get_computed_blocks(request)  # the lookup and load phases start there
            except Exception as exc:
                self.fail(request, exc, "looking up its prefix")
                num_seqs -= landed
                continue
            if computed is None and not self.kv.holds_prefix(request):
                request.enter_phase("queue")
                self._refused = request
                break  # found below the device, which cannot hold its prompt now: wait for requests to finish
            if computed is None:  # found below the device: it waits while its blocks are copied up
                request.status = RequestStatus.LOADING
                num_seqs += 1
                to_come |= self.kv.blocks_loading_for(request)
                continue
            try:
                admitted = self._admit(request, computed, budget, long_chunk, out)
            except Exception as exc:
                self.fail(request, exc, "being admitted", held=computed[0])
                num_seqs -= landed
                continue
            if not admitted:
                request.enter_phase("queue")
                if landed:  # its prefix was just released (still cached on the device): retried later
                    request.status = RequestStatus.WAITING
                    num_seqs -= 1
                    continue
                self._refused = request
                break  # the device pool is full: wait for running requests to finish
            budget, long_chunk = self._spend(out.scheduled[-1], budget, long_chunk)
            num_seqs += not landed
            if request.needs_prompt_logprobs:  # the requests behind it scoring the same prefix wait for it
                to_come |= self.kv.prompt_blocks_to_come(request)

    def _admit(self, request: Request, computed, budget: int, long_chunk: int, out: SchedulerOutput) -> bool:
        """Give a looked-up request device slots for its first chunk and start it running."""
        blocks, num_cached, by_tier = computed
        # at least a token: a long request admitted when the long prefills have used their share starts small
        barrier = self.kv.barrier(request)
        end = request.num_tokens if barrier is None else barrier
        num_new = self._chunk(end - num_cached, budget, max(long_chunk, 1))
        if self.kv.allocate_slots(request, num_new, blocks) is None:
            return False
        self.waiting.remove(request)
        if request.cached_tokens_by_tier is None:  # first admission: computing its prefix from scratch
            request.prefill_saved_s_estimate = self.cost.prefill_s(num_cached, 0)
        self.kv.record_admission(request, by_tier)  # what the user is told, and counted (once)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.enter_phase("prefill")
        self.running.append(request)
        out.scheduled.append(self._scheduled(request, num_new))
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new, samples=request.num_computed_tokens + num_new == request.num_tokens,
                                context=request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.enter_phase("queue")
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by the tokens this step computed."""
        self._step_span = (self._step_span[0], self.clock())
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        out.computed = True

    def fail(self, request: Request, error: BaseException, doing: str, held: Sequence[KVCacheBlock] = ()) -> None:
        """An internal error while handling `request` alone (`doing` says what): it ends with `FINISHED_ERROR`, its
        blocks, holds and loads let go as an abort's are (and `held`: prefix blocks handed to it that it does not own
        yet), and waits in `take_failed` for the engine to tell its caller. Logged once, with the traceback."""
        logger.error("kvstrata: request %s failed while %s; the other requests go on", request.request_id, doing,
                     exc_info=error)
        owned = {id(b) for b in self.kv.req_to_blocks.get(request.request_id, ())}
        unowned = [b for b in held if id(b) not in owned]
        if unowned:
            self.kv.pool.free_blocks(reversed(unowned))
        request.error = f"internal error while {doing} ({type(error).__name__})"
        self.finish(request, RequestStatus.FINISHED_ERROR)
        self._failed.append(request)

    def take_failed(self) -> list[Request]:
        """The requests `fail` ended since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
