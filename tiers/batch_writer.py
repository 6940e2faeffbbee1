"""A queue of write operations applied in order, in batches, by one background thread: the writer that
the disk tier (LMDB transactions) and the remote tier (pipelined round trips) share.

Callers append under `cond` (which a tier may also use to keep its own state, such as a map of
queued values, consistent with the queue) and notify, or leave operations that can wait for the next
notify (a flush notifies, and stopping does); the thread takes a batch under `cond`, applies
it outside, then counts it as finished. `flush()` waits until everything appended before it was
applied (or given up on: `apply` counts its own failures and never raises).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, Optional, TypeVar

Op = TypeVar("Op")


class BatchWriter(Generic[Op]):
    def __init__(self, name: str, take_batch: Callable[[deque], list], apply: Callable[[list], None],
                 on_finished: Optional[Callable[[list], None]] = None):
        """`take_batch(ops)` pops one batch off the queue (called under `cond`); `apply(batch)` runs on
        the thread; `on_finished(batch)`, if given, runs under `cond` once the batch is applied."""
        self.cond = threading.Condition()
        self.ops: deque = deque()
        self.enqueued = 0     # operations ever appended
        self.finished = 0     # operations ever applied or given up on
        self.stopping = False
        self._take_batch = take_batch
        self._apply = apply
        self._on_finished = on_finished
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def append_locked(self, op: Op) -> None:
        """Queue one operation; the caller holds `cond` (and notifies once it has appended them all)."""
        self.ops.append(op)
        self.enqueued += 1

    def flush(self) -> None:
        """Wait until every operation appended so far is finished (those queued without a notify too)."""
        with self.cond:
            target = self.enqueued
            self.cond.notify_all()
            while self.finished < target and self.alive:
                self.cond.wait(0.1)

    def stop(self, timeout: float | None = None) -> None:
        """Let the thread finish what is queued, then end; wait for it up to `timeout` seconds."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.ops and not self.stopping:
                    self.cond.wait()
                if not self.ops:
                    return  # stopping and drained
                batch = self._take_batch(self.ops)
            self._apply(batch)
            with self.cond:
                if self._on_finished is not None:
                    self._on_finished(batch)
                self.finished += len(batch)
                self.cond.notify_all()
