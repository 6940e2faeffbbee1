"""The watchdog (`scheduler.watchdog_timeout`): a step or a prefix load that makes no progress for the timeout is
named in the log, once per stall, and nothing else changes."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

from test_admission import fake_step, new_request
from test_async_engine import DecodingEngine
from test_hierarchy import BS, doc, make_stack, run_request

from kvstrata.engine.async_engine import AsyncEngine
from kvstrata.engine.request import RequestStatus
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.scheduler import Scheduler
from kvstrata.engine.watchdog import Watchdog


def warnings_of(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and fragment in r.getMessage()]


class StallingEngine(DecodingEngine):
    """A DecodingEngine whose steps wait for `gate` while `stall` is set (a step that hangs)."""

    def __init__(self):
        super().__init__()
        self.kv_manager = SimpleNamespace(loads_in_flight=lambda: [])
        self.gate = threading.Event()
        self.stall = threading.Event()
        self.stalled = threading.Event()

    def step(self) -> list:
        if self.stall.is_set():
            self.stalled.set()
            assert self.gate.wait(30), "the test never opened the gate"
            self.stall.clear()
        return super().step()


def test_a_step_running_past_the_timeout_is_named_in_the_log_once_per_stall(caplog):
    engine = StallingEngine()
    async_engine = AsyncEngine(engine, watchdog_timeout=0.2)

    async def answer():
        return [o async for o in async_engine.generate([1, 2, 3], SamplingParams(max_tokens=3))][-1]

    def answer_with_a_stall(seconds: float):
        """A request whose first step hangs for `seconds` (the watchdog looks every 50 ms: many looks at it)."""
        engine.gate.clear()
        engine.stalled.clear()
        engine.stall.set()
        outputs = []
        client = threading.Thread(target=lambda: outputs.append(asyncio.run(answer())))
        client.start()
        assert engine.stalled.wait(30)
        time.sleep(seconds)
        engine.gate.set()
        client.join(30)
        return outputs[0]

    caplog.set_level(logging.WARNING, logger="kvstrata")
    try:
        assert answer_with_a_stall(1.0).finished  # the request still ends
        warned = warnings_of(caplog, "step has been running for")
        assert len(warned) == 1 and "(scheduler.watchdog_timeout: 0.2 s)" in warned[0]
        assert answer_with_a_stall(1.0).finished  # a second stall is a second warning
        assert len(warnings_of(caplog, "step has been running for")) == 2
        assert asyncio.run(answer()).finished
        time.sleep(0.3)
        assert len(warnings_of(caplog, "step has been running for")) == 2  # quick steps: no more
    finally:
        engine.gate.set()
        async_engine.shutdown()


def test_a_watchdog_timeout_of_0_starts_no_thread_and_says_nothing(caplog):
    before = {t.name for t in threading.enumerate()}
    watchdog = Watchdog(0.0)
    watchdog.step_started()
    watchdog.check_step()
    watchdog.check_loads(["q"])
    assert "kvstrata-watchdog" not in {t.name for t in threading.enumerate()} - before
    assert not caplog.records


def test_a_prefix_load_in_flight_past_the_timeout_is_named_once_and_the_others_go_on(caplog):
    """The real KV manager with a CPU tier whose reads wait at a gate: the load stays in flight while another
    request decodes; the watchdog (checked after every step, as the engine thread does) names it once."""
    kv = make_stack(device_blocks=32, cpu_blocks=16, gate_cpu=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    document = doc(5, 6 * BS + 1)
    run_request(kv, document)
    kv.hierarchy.wait_for_write_downs()
    assert kv.hierarchy.clear_device_cache()  # the document now only below the device
    decoding = new_request(doc(6, 2 * BS), max_tokens=20)
    scheduler.add_request(decoding)
    fake_step(kv, scheduler)
    now = [0.0]
    watchdog = Watchdog(60.0, clock=lambda: now[0])
    watchdog.stop()  # steps are not watched here: only loads, from this thread

    kv.hierarchy.cpu.gate.clear()
    loading = new_request(document)
    scheduler.add_request(loading)
    caplog.set_level(logging.WARNING, logger="kvstrata")
    for _ in range(6):  # 100 s of steps, 20 s apart
        assert fake_step(kv, scheduler) == [decoding]
        watchdog.check_loads(kv.loads_in_flight())
        now[0] += 20.0
    assert loading.status == RequestStatus.LOADING
    warned = warnings_of(caplog, "prefix load of request")
    assert len(warned) == 1 and loading.request_id in warned[0] and "waiting for 60.0 s" in warned[0]
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    assert kv.loads_in_flight() == []
    sampled = fake_step(kv, scheduler)
    assert loading in sampled
    watchdog.check_loads(kv.loads_in_flight())
    now[0] += 100.0
    watchdog.check_loads(kv.loads_in_flight())
    assert len(warnings_of(caplog, "prefix load of request")) == 1
