"""Tokenizing off the event loop: a few threads, each with its own copy of the tokenizer.

Tokenizing a long prompt (or rendering a long chat) takes seconds; on the event loop it would stall
every client, `/health` included. The fast tokenizer releases the GIL while it encodes, so a thread
pool keeps the loop free. Each thread owns a copy: one fast tokenizer used by two threads at once
fails ("Already borrowed"), and the engine thread keeps the original for decoding.
"""
from __future__ import annotations

import asyncio
import copy
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def default_num_threads() -> int:
    """Two, so that a second request is not stuck behind one huge prompt; four on larger machines."""
    return max(2, min(4, (os.cpu_count() or 1) // 2))


class TokenizerPool:
    """`await pool.run(fn, *args)` calls `fn(tokenizer, *args)` on a pool thread, with that thread's
    own tokenizer."""

    def __init__(self, tokenizer, num_threads: int | None = None):
        num_threads = num_threads or default_num_threads()
        # Copied here, before any request: the original is the engine thread's from then on.
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(num_threads):
            self._copies.put(copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvstrata-tokenizer",
                                            initializer=self._take_a_copy)

    def _take_a_copy(self) -> None:
        self._local.tokenizer = self._copies.get_nowait()

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        return fn(self._local.tokenizer, *args)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
