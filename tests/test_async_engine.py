"""The engine thread and the tokenizer threads that the server drives, without a model."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from kvstrata.engine.async_engine import AsyncEngine
from kvstrata.serving.tokenizer_pool import TokenizerPool


class IdleEngine:
    """An LLMEngine with no requests whose tier usage changes on its own (a disk writer committing,
    another process sharing the store): each stats() call sees one more used block."""

    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.used_blocks = 0
        self.closed = False

    def stats(self) -> dict:
        if not self.closed:
            self.used_blocks += 1
        return {"tiers": {"disk": {"used_blocks": self.used_blocks}}}

    def has_unfinished_requests(self) -> bool:
        return False

    def write_down_idle(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def _wait_until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_idle_engine_thread_keeps_publishing_fresh_stats():
    async_engine = AsyncEngine(IdleEngine())
    try:
        first = async_engine.snapshot.stats["tiers"]["disk"]["used_blocks"]
        # no request, no command: the snapshot must still follow the tiers
        _wait_until(lambda: async_engine.snapshot.stats["tiers"]["disk"]["used_blocks"] >= first + 2)
    finally:
        async_engine.shutdown()


class DecodingEngine(IdleEngine):
    """An LLMEngine answering one request a token per step, counting the stats walks."""

    def __init__(self):
        super().__init__()
        self.request = None
        self.stats_calls = 0

    def stats(self) -> dict:
        self.stats_calls += 1
        return {"finished": self.request is not None and self.request.is_finished}

    def validate_request(self, prompt_token_ids, params) -> None:
        pass

    def add_request(self, request_id, prompt_token_ids, params, *args, **kwargs):
        from kvstrata.engine.request import Request

        self.request = Request(request_id, list(prompt_token_ids), params)
        return self.request

    def has_unfinished_requests(self) -> bool:
        return self.request is not None and not self.request.is_finished

    def step(self) -> list:
        from kvstrata.engine.request import RequestStatus

        self.request.output_token_ids.append(5)
        if len(self.request.output_token_ids) == self.request.sampling_params.max_tokens:
            self.request.status = RequestStatus.FINISHED_LENGTH
        return [self.request]

    def release(self, request_id: str) -> None:
        pass


def test_a_busy_engine_thread_publishes_stats_now_and_then_and_always_before_an_answer():
    from kvstrata.engine.sampling import SamplingParams

    engine = DecodingEngine()
    async_engine = AsyncEngine(engine)

    async def answer():
        outputs = [o async for o in async_engine.generate([1, 2, 3], SamplingParams(max_tokens=500))]
        return outputs[-1], async_engine.snapshot.stats

    try:
        last, stats = asyncio.run(answer())
    finally:
        async_engine.shutdown()
    assert last.finished and len(last.token_ids) == 500
    assert stats["finished"]  # the client with its answer finds it counted
    # not a stats walk (every tier's) after each of the 500 steps
    assert engine.stats_calls < 50


def test_after_shutdown_the_stats_as_of_the_close_are_kept():
    engine = IdleEngine()
    async_engine = AsyncEngine(engine)
    assert async_engine.final_stats is None
    async_engine.shutdown()
    assert engine.closed
    assert async_engine.final_stats == engine.stats()


def test_each_tokenizer_thread_tokenizes_with_its_own_copy():
    original = SimpleNamespace(name="tokenizer")
    pool = TokenizerPool(original, num_threads=2)
    both_running = threading.Barrier(2, timeout=30)

    def which(tokenizer) -> int:
        both_running.wait()  # two calls at once: they must be on two threads
        return id(tokenizer)

    async def twice():
        return await asyncio.gather(pool.run(which), pool.run(which))

    try:
        first, second = asyncio.run(twice())
    finally:
        pool.close()
    assert first != second
    assert id(original) not in (first, second)  # the engine thread keeps the original

