"""Continuous batching with chunked prefill (vLLM v1's shape, one path).

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (decodes and
the rest of chunked prefills), then waiting requests are admitted in arrival order: at admission
their prefix is looked up across every tier, and only the uncached suffix is scheduled. A request
whose prefix was found below the device waits in the loading state (vLLM's WAITING_FOR_REMOTE_KVS)
while its blocks are copied up, and the scheduler admits the requests behind it meanwhile; it is
admitted in its turn once the copy has landed. When the device pool cannot hold a running
request's next tokens, the newest running request is preempted (its blocks freed, to be recomputed
later, mostly from the cache).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvstrata.engine.kv_manager import KVCacheManager
from kvstrata.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step reaches the end of the request's known tokens: a token is sampled.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.LOADING)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.kv.release_abandoned()

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest request gives way
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it can run either

        # 2. Waiting requests, in arrival order, while budget and sequence slots last. Loading ones
        # count towards the sequence slots (they hold device blocks) and are passed over.
        num_seqs = len(self.running) + self.num_loading
        for request in list(self.waiting):
            if budget <= 0 or out.preempted:
                break
            if self.kv.is_loading(request):
                continue
            loaded = request.status == RequestStatus.LOADING  # landed: its prefix is held already
            if not loaded and num_seqs >= self.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(request)
            if computed is None:  # found below the device: it waits while its blocks are copied up
                request.status = RequestStatus.LOADING
                num_seqs += 1
                continue
            if not self._admit(request, computed, budget, out):
                if loaded:  # its prefix was just released (still cached on the device): retried later
                    request.status = RequestStatus.WAITING
                    num_seqs -= 1
                    continue
                break  # the device pool is full: wait for running requests to finish
            budget -= out.scheduled[-1].num_new_tokens
            num_seqs += not loaded
        return out

    def _admit(self, request: Request, computed, budget: int, out: SchedulerOutput) -> bool:
        """Give a looked-up request device slots for its first chunk and start it running."""
        blocks, num_cached, by_tier = computed
        num_new = min(request.num_tokens - num_cached, budget)
        if self.kv.allocate_slots(request, num_new, blocks) is None:
            return False
        self.waiting.remove(request)
        if request.cached_tokens_by_tier is None:  # first admission: what the user is told, and counted
            request.cached_tokens_by_tier = by_tier
            self.kv.record_admission(request, by_tier)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(self._scheduled(request, num_new))
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new,
                                samples=request.num_computed_tokens + num_new == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by the tokens this step computed."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
