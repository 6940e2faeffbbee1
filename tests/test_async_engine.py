"""The engine thread and the tokenizer threads that the server drives, without a model."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from kvstrata.engine.async_engine import AsyncEngine, _Abort, _Add, _Stream
from kvstrata.serving.tokenizer_pool import TokenizerPool


class IdleEngine:
    """An LLMEngine with no requests whose tier usage changes on its own (a disk writer committing,
    another process sharing the store): each stats() call sees one more used block."""

    last_step_tokens = last_step_generated_tokens = 0  # what LLMEngine.step() says it computed: nothing here

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

    def validate_request(self, prompt_token_ids, params) -> list[int]:
        return list(prompt_token_ids)

    def add_validated_request(self, request_id, prompt_token_ids, params, *args, **kwargs):
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


class FaultyAddEngine(DecodingEngine):
    """A DecodingEngine whose first request fails while it is being added (not a refusal: a fault)."""

    def __init__(self):
        super().__init__()
        self.faults = 1

    def add_validated_request(self, request_id, prompt_token_ids, params, *args, **kwargs):
        if self.faults:
            self.faults -= 1
            raise RuntimeError("the generator could not be seeded")
        return super().add_validated_request(request_id, prompt_token_ids, params, *args, **kwargs)


def test_a_request_that_fails_while_it_is_added_is_told_so_and_the_engine_serves_the_next():
    import pytest

    from kvstrata.engine.sampling import SamplingParams

    async_engine = AsyncEngine(FaultyAddEngine())

    async def ask() -> list:
        return [o async for o in async_engine.generate([1, 2, 3], SamplingParams(max_tokens=3))]

    try:
        with pytest.raises(RuntimeError, match="could not be seeded"):
            asyncio.run(asyncio.wait_for(ask(), timeout=30))  # before, the engine thread died and the caller hung
        assert async_engine.is_running
        assert len(asyncio.run(asyncio.wait_for(ask(), timeout=30))[-1].token_ids) == 3
    finally:
        async_engine.shutdown()


class ManyDecodingEngine(DecodingEngine):
    """An LLMEngine answering any number of requests together, a token each per step; each request's
    tokens are its prompt's first token, so that an output found in another request's stream shows."""

    def __init__(self):
        super().__init__()
        self.requests: dict = {}
        self.steps = 0

    def add_validated_request(self, request_id, prompt_token_ids, params, *args, **kwargs):
        from kvstrata.engine.request import Request

        self.requests[request_id] = Request(request_id, list(prompt_token_ids), params)

    def has_unfinished_requests(self) -> bool:
        return any(not r.is_finished for r in self.requests.values())

    def step(self) -> list:
        from kvstrata.engine.request import RequestStatus

        self.steps += 1
        updated = [r for r in self.requests.values() if not r.is_finished]
        for request in updated:
            request.output_token_ids.append(request.prompt_token_ids[0])
            if len(request.output_token_ids) == request.sampling_params.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
        return updated


def test_each_step_reaches_each_event_loop_in_one_wake_up_with_every_stream_its_own_outputs():
    """Callers on two event loops (two server threads), three streams each: every stream gets all its own
    tokens and no other's, and a step wakes each loop once, not once per stream (each wake-up competes with
    the engine thread for the interpreter lock)."""
    from kvstrata.engine.sampling import SamplingParams

    engine = ManyDecodingEngine()
    async_engine = AsyncEngine(engine)
    wake_ups: list[int] = []

    def caller(first_token: int, results: dict) -> None:
        async def answer(token: int):
            outputs = [o async for o in async_engine.generate([token, 9], SamplingParams(max_tokens=200))]
            results[token] = outputs

        async def main():
            loop = asyncio.get_running_loop()
            wake = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *args: (wake_ups.append(1), wake(*args))[1]
            await asyncio.gather(*(answer(first_token + k) for k in range(3)))

        asyncio.run(main())

    results: dict = {}
    threads = [threading.Thread(target=caller, args=(token, results)) for token in (10, 20)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        async_engine.shutdown()
    assert sorted(results) == [10, 11, 12, 20, 21, 22]
    for token, outputs in results.items():
        assert outputs[-1].finished and outputs[-1].token_ids == [token] * 200
        assert all(o.token_ids == [token] * len(o.token_ids) for o in outputs)
    assert len(wake_ups) <= 2 * engine.steps + 20  # a few more for the requests' adds and the shutdown


class ArrivalsDuringAStepEngine(ManyDecodingEngine):
    """Requests arrive while its third step computes: an add, an abort of the running request, another add.
    It takes its arrivals then (`LLMEngine.take_arrivals`, which the AsyncEngine sets)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop = loop
        self.async_engine: AsyncEngine | None = None
        self.take_arrivals = None
        self.aborted: list[tuple[str, int]] = []  # (request id, steps run before its abort)
        self.mid_step: tuple[list[str], list] | None = None  # the requests and aborts seen within the third step

    def abort_request(self, request_id: str) -> None:
        from kvstrata.engine.request import RequestStatus

        self.requests[request_id].status = RequestStatus.FINISHED_ABORTED
        self.aborted.append((request_id, self.steps))

    def step(self) -> list:
        if self.steps == 2:
            for command in (self.add("b"), _Abort("a"), self.add("c")):
                self.async_engine._submit(command)
            self.take_arrivals()  # the device computes the step meanwhile
            self.mid_step = (sorted(self.requests), list(self.aborted))
        return super().step()

    def add(self, request_id: str) -> _Add:
        from kvstrata.engine.sampling import SamplingParams

        return _Add(request_id, [1], SamplingParams(max_tokens=5), None, None, time.perf_counter(), _Stream(self.loop))


def test_requests_arriving_during_a_step_are_added_in_it_and_any_other_command_waits_for_its_end():
    """A request queued while a step computes joins the engine within that step (its lookup and load start in
    the step's shadow); an abort waits for the step's end, and so does every command behind it, in order."""
    loop = asyncio.new_event_loop()
    engine = ArrivalsDuringAStepEngine(loop)
    async_engine = engine.async_engine = AsyncEngine(engine)
    try:
        async_engine._submit(engine.add("a"))
        _wait_until(lambda: engine.mid_step is not None and "c" in engine.requests)
    finally:
        async_engine.shutdown()
        loop.close()
    assert engine.mid_step == (["a", "b"], [])
    assert engine.aborted == [("a", 3)]  # after the third step, before the fourth


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

