"""Continuous batching with chunked prefill (vLLM v1's shape, one path).

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (decodes and
the rest of chunked prefills), then waiting requests are admitted in arrival order: at admission
their prefix is looked up across every tier and promoted to the device, and only the uncached
suffix is scheduled. When the device pool cannot hold a running request's next tokens, the newest
running request is preempted (its blocks freed, to be recomputed later, mostly from the cache).
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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

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

        # 2. Waiting requests, in arrival order, while budget and sequence slots last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            blocks, num_cached, by_tier = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request, num_new, blocks) is None:
                break  # the device pool is full: wait for running requests to finish
            self.waiting.popleft()
            self.kv.record_admission(request, by_tier)
            if request.cached_tokens_by_tier is None:  # first admission: what the user is told
                request.cached_tokens_by_tier = by_tier
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return out

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
