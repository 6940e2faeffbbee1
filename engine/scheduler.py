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
once. When the device pool cannot hold a running request's next tokens, the newest running request
is preempted (its blocks freed, to be recomputed later, mostly from the cache).

`scheduler.policy` (engine/scheduling_policy.py) orders the waiting requests and sizes the step:
`fcfs` in arrival order with the whole budget, `uncached_first` (the default) short uncached work
first, with aging, under a step cap.

The KV cache manager (engine/kv_manager.py) is asked only these, each a whole operation; the scheduler
never reads the device pool or what the manager keeps per request (tests/test_scheduler_interface.py
checks it):

- `estimate_uncached_many(requests)`: each waiting request's work left after a lookup that holds nothing
  (for ordering; the manager keeps the one cache of lookups);
- `is_loading(request)`: its prefix is being copied up;
- `start_load(request)`: look it up, hold its prefix and start its load (while the device computes a step;
  none while the device has had no room since the last refusal);
- `get_computed_blocks(request)`: its cached prefix, held on the device, or None while it loads or has no room;
- `allocate_slots(request, num_new_tokens, new_computed_blocks=None)`: device slots for its next tokens
  (with the prefix blocks: its admission, its hits counted);
- `free(request)`: let go of everything held for it;
- `barrier(request)`: the token its computing stops at until its tail has landed;
- `land_tail(request)`: join its landed tail once it has computed up to its barrier;
- `blocks_to_come(requests)`: the blocks on their way to the device, which a request waits for;
- `finish_landed_loads()`: finish the loads that have landed, release those of requests let go;
- `step_cost`: the measured step cost (engine/costs.py), which the manager owns and prices recomputing with.

An internal error while one request is handled on its own (its lookup and load start, its admission, its
blocks for the step, its tail landing) fails that request alone (`fail`): everything held for it is let go as
an abort's is, it ends with `FINISHED_ERROR`, and the engine takes it from `take_failed` to tell its caller;
the other requests go on.

Receipts (engine/receipt.py): the KV manager's lookup starts a request's lookup phase (and its load
phase, when it loads); admission here starts its prefill phase; a request sent back (its admission
found the device full, or it was preempted) returns to the queue phase.
"""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvstrata.engine.costs import attention_pairs, kv_reads
from kvstrata.engine.kv_manager import ComputedBlocks, KVCacheManager, UncachedEstimate
from kvstrata.engine.request import Request, RequestStatus
from kvstrata.engine.scheduling_policy import (AGING, ARRIVALS_MEMORY_S, LONG_STEP_TARGETS, MIN_AGE_S,  # noqa: F401
                                              POLICIES, make_policy)

logger = logging.getLogger("kvstrata")


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


@dataclass
class _Budget:
    """What is left of a step's tokens, and of the share the long prefills (those it cannot finish) have."""

    tokens: int
    long_chunk: int

    def spend(self, scheduled: ScheduledRequest) -> None:
        """A chunk that does not reach the end of its request's tokens (a long prefill's) comes out of both."""
        self.tokens -= scheduled.num_new_tokens
        self.long_chunk -= 0 if scheduled.samples else scheduled.num_new_tokens

    def chunk(self, remaining: int, min_long_chunk: int = 0) -> int:
        """A request's tokens this step: all that fit, but a prefill this step cannot finish (a long one) gets
        at most what is left of the long chunk (and at least `min_long_chunk`)."""
        if remaining <= self.tokens:
            return remaining
        return min(max(self.long_chunk, min_long_chunk), self.tokens)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "uncached_first", step_target: float = 0.25, long_prefill_share: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter):
        self.policy = make_policy(policy, step_target, long_prefill_share)
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # This step's estimates of the waiting requests (`estimate`), each asked of the KV manager once a step.
        self._estimates: dict[str, UncachedEstimate] = {}
        self._step_span = (0.0, 0.0)  # when the last step was scheduled and when its compute ended
        self.last_arrival_mid_step = -float("inf")  # the latest arrival that found a step running
        self._failed: list[Request] = []  # ended by an internal error, not yet taken by the engine (`fail`)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.LOADING)

    def observe_step(self, out: SchedulerOutput, seconds: float, replayed: bool = False) -> None:
        """The engine reports how long a scheduled step took (it prices work and caps steps); `replayed`: as a
        recorded CUDA graph."""
        self.kv.step_cost.observe(out.num_tokens, seconds, out.num_attention_pairs, out.num_kv_reads,
                                  replayed=replayed)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """One step: the running requests first, in the policy's order, then the waiting ones it admits."""
        out = SchedulerOutput()
        self.kv.finish_landed_loads()
        self._land_tails()
        self._estimates = {}  # each waiting request is estimated afresh once a step (the KV manager keeps lookups)
        self._note_arrivals_during_last_step()
        self._step_span = (self.clock(), self._step_span[1])  # this step starts; update_after_step ends it
        to_come = self._blocks_to_come()
        plan = self.policy.plan_step(self, self._candidates(to_come))
        budget = _Budget(plan.budget, plan.long_chunk)
        self._schedule_running(out, plan.running, budget)
        admit = functools.partial(self._admit, budget=budget, out=out, to_come=to_come)
        # admissions end with the step's budget, or once a running request had to give way for room
        self._admission_pass(plan.candidates, to_come, admit, stop=lambda: budget.tokens <= 0 or bool(out.preempted))
        return out

    def prepare_next_step(self) -> None:
        """The next step's admission work that does not depend on the step now running, which the engine has
        this do while the device computes that step: finish the loads that have landed (their blocks cached
        on the device), look up the requests that arrived, and start the loads of the first ones in order
        (while sequence slots last) whose prefix is found below the device. Nothing is admitted to run: the
        next `schedule` admits, from what this found. Done here, the host's work (a long document's lookup, or
        caching its landed blocks) is hidden behind the device's compute instead of delaying the next step."""
        self.kv.finish_landed_loads()
        if (not self.waiting or len(self.running) + self.num_loading >= self.max_num_seqs
                or all(r.status == RequestStatus.LOADING for r in self.waiting)):
            return  # no sequence slot to start a load in, or nobody to look up (a landed load is admitted next)
        to_come = self._blocks_to_come()
        candidates = self._candidates(to_come)
        if not any(r.status != RequestStatus.LOADING and self.estimate(r).loads_below for r in candidates):
            return  # no load to start: ordering a queue of misses behind a full device at every step costs host time
        start_load = functools.partial(self._start_load, to_come=to_come)
        self._admission_pass(self.policy.order(self, candidates), to_come, start_load)

    # ------------------------------------------------------------------ the waiting requests

    def _blocks_to_come(self) -> set[bytes]:
        return self.kv.blocks_to_come([r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens])

    def _candidates(self, to_come: set[bytes]) -> list[Request]:
        """The waiting requests this step may admit, in queue order: those whose load is not in flight, or,
        while every sequence slot is taken, only the landed loads (each holds its slot already). The others
        cannot start, and ordering them would look each one up at every step for as long as the slots stay
        full, which is when requests queue (and each lookup lengthened every decode step)."""
        free_slots = self.max_num_seqs - len(self.running) - self.num_loading
        eligible = [r for r in self.waiting if not self.kv.is_loading(r)
                    and (free_slots > 0 or r.status == RequestStatus.LOADING)]
        # Each is priced (to order them, or to see whether it waits for a block to come) or, first come first
        # served, each that a free slot may admit: all in one batch, which their admissions then start from.
        self._estimate_all(eligible if self.policy.prices_every_candidate or to_come else eligible[:max(free_slots, 0)])
        # Landed loads first, under either policy: each holds device blocks and a sequence slot, and a request
        # ahead of it that the device has no room for may fit only once they have run (first come first
        # served, a preempted request at the head, refused for room that two landed loads behind it held,
        # waited for ever, and so did they).
        return sorted((r for r in eligible if not self._waits_for(r, to_come)),
                      key=lambda r: r.status != RequestStatus.LOADING)

    def _estimate_all(self, requests: list[Request]) -> None:
        """Estimate the requests not estimated yet in this step together: the lower tiers are asked once for all
        of them (a burst of arrivals, looked up one by one, cost one round trip each to a remote server)."""
        new = [r for r in requests if r.request_id not in self._estimates]
        if new:
            self._estimates.update(zip((r.request_id for r in new), self.kv.estimate_uncached_many(new)))

    def estimate(self, request: Request) -> UncachedEstimate:
        """The request's work left after a lookup, asked once per step."""
        if request.request_id not in self._estimates:
            self._estimate_all([request])
        return self._estimates[request.request_id]

    def _waits_for(self, request: Request, to_come: set[bytes]) -> bool:
        """The first block the request would compute or load is one a running prefill is computing or
        another request's load is bringing up: it waits for it (then finds it on the device) rather
        than computing or loading the same K/V a second time."""
        return bool(to_come) and self.estimate(request).next_hash in to_come

    def _admission_pass(self, candidates: list[Request], to_come: set[bytes],
                        take: Callable[[Request, bool], int | None], stop: Callable[[], bool] = lambda: False) -> None:
        """The one walk over the candidates, for admitting them (`schedule`) and for starting their loads ahead
        (`prepare_next_step`): in order while sequence slots last (loading ones count: they hold device blocks;
        a landed one holds its slot already) and `stop` is false, passing over a request that waits for blocks
        to come (`_waits_for`). `take(request, landed)` handles one: the sequence slots it took (1), gave back
        (-1) or neither, or None to end the walk."""
        num_seqs = len(self.running) + self.num_loading
        for request in candidates:
            if stop():
                break
            landed = request.status == RequestStatus.LOADING  # its prefix is held already
            if not landed and num_seqs >= self.max_num_seqs:
                break
            if self._waits_for(request, to_come):
                continue
            taken = take(request, landed)
            if taken is None:
                break
            num_seqs += taken

    def _start_load(self, request: Request, landed: bool, to_come: set[bytes]) -> int | None:
        """Ahead of the next step: start the load of a request whose prefix is found below the device."""
        if landed:
            return 0  # the next step admits it first
        if not self.estimate(request).loads_below:
            return None  # the next step decides: it may compute (which takes its budget), or wait for a slot
        try:
            started = self.kv.start_load(request)
        except Exception as exc:
            self.fail(request, exc, "looking up its prefix")
            return 0
        if not started:  # no room yet: the next step asks again once this one's finished requests have freed theirs
            return None
        request.status = RequestStatus.LOADING
        to_come |= self.kv.blocks_to_come([request])
        return 1

    def _admit(self, request: Request, landed: bool, budget: _Budget, out: SchedulerOutput,
               to_come: set[bytes]) -> int | None:
        """Admit a waiting request: look its prefix up (holding it, starting its load) and, once it is on the
        device, give it slots for its first chunk and start it running."""
        try:
            computed = self.kv.get_computed_blocks(request)  # the lookup and load phases start there
        except Exception as exc:
            self.fail(request, exc, "looking up its prefix")
            return -landed
        if computed is None and self.kv.is_loading(request):  # found below the device: it waits while its blocks
            request.status = RequestStatus.LOADING             # are copied up
            to_come |= self.kv.blocks_to_come([request])
            return 1
        if computed is None:  # found below the device, which cannot hold its prompt now: wait for requests to finish
            request.enter_phase("queue")
            return None
        try:
            admitted = self._start_running(request, computed, budget, out)
        except Exception as exc:
            self.fail(request, exc, "being admitted")
            return -landed
        if not admitted:
            request.enter_phase("queue")
            if landed:  # its prefix was just released (still cached on the device): retried later
                request.status = RequestStatus.WAITING
                return -1
            return None  # the device pool is full: wait for running requests to finish
        budget.spend(out.scheduled[-1])
        if request.needs_prompt_logprobs:  # the requests behind it scoring the same prefix wait for it
            to_come |= self.kv.blocks_to_come([request])
        return 0 if landed else 1

    def _start_running(self, request: Request, computed: ComputedBlocks, budget: _Budget,
                       out: SchedulerOutput) -> bool:
        """Give a looked-up request device slots for its first chunk (its admission) and start it running."""
        blocks, num_cached, _ = computed
        # at least a token: a long request admitted when the long prefills have used their share starts small
        num_new = budget.chunk(self._computable_end(request) - num_cached, min_long_chunk=1)
        if self.kv.allocate_slots(request, num_new, blocks) is None:
            return False
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.enter_phase("prefill")
        self.running.append(request)
        out.scheduled.append(self._scheduled(request, num_new))
        return True

    def _note_arrivals_during_last_step(self) -> None:
        """Remember when a waiting request last arrived while a step was running (engine/scheduling_policy.py).
        A request added between steps (a batch, or a client answered at a step's end) waited for none."""
        started, ended = self._step_span
        arrived = [r.arrival_time for r in self.waiting if started < r.arrival_time < ended]
        self.last_arrival_mid_step = max([self.last_arrival_mid_step, *arrived])

    # ------------------------------------------------------------------ the running requests

    def prefill_context(self) -> int:
        """The context the step's long prefill chunk follows (the furthest running prefill): its tokens
        cost more the more they attend to, and the step cap must price them so."""
        return max((r.num_computed_tokens for r in self.running if r.num_computed_tokens < r.num_prompt_tokens),
                   default=0)

    def _land_tails(self) -> None:
        """Running requests that computed the head of their prefix while its tail loaded: the tail's
        blocks join them once it has landed; until then they wait in their load phase."""
        for request in list(self.running):
            try:
                self.kv.land_tail(request)
            except Exception as exc:
                self.fail(request, exc, "landing its prefix's tail")

    def _computable_end(self, request: Request) -> int:
        """The token the request can compute up to now: the end of its known tokens, or its barrier."""
        barrier = self.kv.barrier(request)
        return request.num_tokens if barrier is None else barrier

    def remaining(self, request: Request) -> int:
        """Tokens the request can compute now: up to the end of its prompt, or to its barrier."""
        return self._computable_end(request) - request.num_computed_tokens

    def _schedule_running(self, out: SchedulerOutput, running: list[Request], budget: _Budget) -> None:
        """Running requests in `running` order; long prefills (those the step cannot finish) get at most
        the budget's long chunk between them. When the device cannot hold a request's next tokens, the newest
        running request not yet scheduled this step gives way."""
        scheduled: set[str] = set()
        for request in list(running):  # (a copy: a request that fails leaves `self.running`)
            if budget.tokens <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted to make room earlier in this step
                continue
            num_new = budget.chunk(self.remaining(request))
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
            budget.spend(out.scheduled[-1])

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

    # ------------------------------------------------------------------ ending requests

    def fail(self, request: Request, error: BaseException, doing: str) -> None:
        """An internal error while handling `request` alone (`doing` says what): it ends with `FINISHED_ERROR`,
        everything held for it let go as an abort's is (prefix blocks handed to it that it does not own yet
        too), and waits in `take_failed` for the engine to tell its caller. Logged once, with the traceback."""
        logger.error("kvstrata: request %s failed while %s; the other requests go on", request.request_id, doing,
                     exc_info=error)
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
