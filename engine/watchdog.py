"""The engine's watchdog: says in the log, once per stall, when a step or a prefix load has made no progress for
`scheduler.watchdog_timeout` seconds.

It only watches: it never stops, retries or waits for anything of the engine's, so it cannot itself hang it. A
step is watched from a thread of its own (a stuck step holds the engine thread); loads are watched from the
engine thread after each step, which goes on stepping the other requests while a load is in flight."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

logger = logging.getLogger("kvstrata")


class Watchdog:
    """`step_started` / `step_ended` around each step and `check_loads` after it, from the engine thread;
    `stop` at shutdown. A timeout of 0 watches nothing (and starts no thread)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._step_started: float | None = None  # when the step now running began (one assignment: thread-safe)
        self._warned_step: float | None = None   # the start of the step last warned of
        self._loads_since: dict[str, float] = {}  # request id -> when its load was first seen in flight
        self._warned_loads: set[str] = set()
        self._stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="kvstrata-watchdog", daemon=True).start()

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def step_started(self) -> None:
        self._step_started = self.clock()

    def step_ended(self) -> None:
        self._step_started = None

    def check_step(self) -> None:
        """Warn once if the step now running began at least the timeout ago."""
        started = self._step_started
        if not self.enabled or started is None or started == self._warned_step:
            return
        running_s = self.clock() - started
        if running_s >= self.timeout_s:
            self._warned_step = started
            logger.warning("kvstrata: watchdog: the engine's step has been running for %.1f s without returning "
                           "(scheduler.watchdog_timeout: %g s); every request waits for it", running_s, self.timeout_s)

    def check_loads(self, loading: Iterable[str]) -> None:
        """`loading`: the requests whose prefix load (or tail) is in flight now. Warn once for each whose load has
        been in flight for at least the timeout."""
        if not self.enabled:
            return
        now = self.clock()
        since = {request_id: self._loads_since.get(request_id, now) for request_id in loading}
        for request_id, started in since.items():
            if now - started >= self.timeout_s and request_id not in self._warned_loads:
                self._warned_loads.add(request_id)
                logger.warning("kvstrata: watchdog: the prefix load of request %s has been waiting for %.1f s "
                               "(scheduler.watchdog_timeout: %g s); the other requests go on", request_id,
                               now - started, self.timeout_s)
        self._loads_since = since
        self._warned_loads &= since.keys()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while not self._stopped.wait(interval):
            self.check_step()

    def stop(self) -> None:
        self._stopped.set()
