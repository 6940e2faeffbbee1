"""A tier's reader processes (tiers/reader_process.py: the disk tier's, tiers/disk_reader.py, and the remote
tier's, tiers/remote_reader.py), as the tier sees them: a pool that runs a read in an idle one and returns its
reply.

Mechanism only: the tier builds each request and decides what a reply means. A reader that dies (its store's
file cut short under it, a kill) costs the read it was serving, which the tier then does in-process, and is
replaced; after `MAX_RESTARTS` replacements the pool gives up and the tier reads in-process from then on.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Callable

from kvstrata.tiers.reader_process import recv_message, send_message
from kvstrata.tiers.shared_memory import is_live, locate, segment_fd

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3
# The longest a reader may take to take a request or answer it. A read of a batch from a warm page cache takes
# milliseconds, from a slow disk seconds; beyond this the reader is taken for stuck (stopped, wedged), killed, and
# its read done in-process: a load never waits on a reader for ever.
READ_TIMEOUT_S = 30.0


def block_read(keys: list, token_ids, dests, codec) -> tuple[dict, set[int]] | None:
    """A reader's `read` of the blocks `keys` (records of `codec`'s layout, with `token_ids`) into `dests`, and the
    shared segments it writes to; None where a destination is private memory, or a block's token ids do not fill
    it (the tier's own read then says why). The tier adds the fields that say where to read from."""
    places = [locate(d) for d in dests]
    tokens = codec.pack_token_ids(token_ids)
    if any(p is None for p in places) or tokens is None:
        return None
    request = {"op": "read", "keys": keys, "tokens": tokens, "places": [(p.segment, p.offset) for p in places],
               **codec.reader_fields}
    return request, {p.segment for p in places}


class _Reader:
    """One reader process (running module `module`) and the end of its socket; the segments it maps."""

    def __init__(self, module: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # A session of its own: a terminal's Ctrl-C goes to the engine's process, which closes the socket.
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(READ_TIMEOUT_S)
        self.sock = ours
        self.segments: set[int] = set()

    def share(self, segment_ids: set[int]) -> list[int]:
        """Ask the reader to map `segment_ids` (those it lacks) and to unmap the segments that are gone; returns
        the segments asked for, whose mapping `mapped` waits for."""
        gone = {s for s in self.segments if not is_live(s)}
        if gone:
            send_message(self.sock, {"op": "forget", "ids": sorted(gone)})
            self.segments -= gone
        asked = sorted(segment_ids - self.segments)
        for segment_id in asked:
            fd = segment_fd(segment_id)
            if fd is None:
                raise ValueError(f"shared segment {segment_id} is gone")
            send_message(self.sock, {"op": "segment", "id": segment_id, "nbytes": os.fstat(fd).st_size}, [fd])
            self.segments.add(segment_id)
        return asked

    def mapped(self, asked: list[int]) -> None:
        """Wait until the reader has mapped the segments `share` asked it to."""
        for segment_id in asked:
            if self._reply() != {"mapped": segment_id}:
                raise ValueError("a reader answered out of turn")

    def prepare(self, segment_ids: set[int], store: dict) -> list[int]:
        """`share`, and ask the reader to open the tier's store (`store`: the fields of its `open`, a path or a
        server) too; `ready` waits."""
        asked = self.share(segment_ids)
        send_message(self.sock, {"op": "open", **store})
        return asked

    def ready(self, asked: list[int]) -> None:
        self.mapped(asked)
        if "opened" not in self._reply():
            raise ValueError("a reader answered out of turn")

    def read(self, request: dict, segment_ids: set[int]) -> dict:
        self.mapped(self.share(segment_ids))
        send_message(self.sock, request)
        return self._reply()

    def _reply(self) -> dict:
        reply, fds = recv_message(self.sock)
        if fds:
            raise ValueError("a reader sent descriptors")
        return reply

    def close(self, kill: bool = False) -> None:
        """Stop the reader: it sees the end of its socket and exits (killed at once if `kill`: it failed)."""
        self.sock.close()
        if kill:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ReaderPool:
    """`processes` reader processes, each running module `module` and serving one read at a time, for the tier
    named `tier` (in what is logged). Thread-safe."""

    def __init__(self, processes: int, module: str, tier: str, on_replaced: Callable[[], None] | None = None):
        if processes < 1:
            raise ValueError(f"a reader pool needs at least one process, got {processes}")
        self.processes = processes
        self.module = module
        self.tier = tier
        self.on_replaced = on_replaced  # called once a dead reader is gone (the tier clears what it left held)
        self._idle: queue.SimpleQueue[_Reader] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._restarts = 0
        self._closed = False
        self._broken = False
        self._running: list[_Reader] = []
        try:
            for _ in range(processes):
                self._running.append(_Reader(module))
        except BaseException:  # none left running
            for reader in self._running:
                reader.close()
            raise
        for reader in self._running:
            self._idle.put(reader)

    @property
    def pids(self) -> list[int]:
        """The reader processes running now."""
        with self._lock:
            return [r.process.pid for r in self._running]

    @property
    def usable(self) -> bool:
        """False once closed, or given up on (readers kept dying)."""
        return not (self._closed or self._broken)

    def prepare(self, segment_ids: set[int], store: dict) -> None:
        """Have every idle reader map `segment_ids` and open the tier's store (`store`: its `open` fields) now,
        ahead of the reads, all at once; returns when they have. A reader maps a segment whole, page tables
        included, which takes a while for a large one (a host KV cache): paid here, at start-up, not by the first
        read (nor by the load policy's timed probe)."""
        taken = []
        while len(taken) < self.processes:
            try:
                taken.append(self._idle.get_nowait())
            except queue.Empty:
                break
        asked: list[tuple[_Reader, list[int]]] = []  # every reader is asked before any is waited for
        for reader in taken:
            try:
                asked.append((reader, reader.prepare(segment_ids, store)))
            except (OSError, ValueError) as e:
                self._back_or_replace(reader, e)
        for reader, segments in asked:
            try:
                reader.ready(segments)
            except (OSError, EOFError, ValueError) as e:
                self._back_or_replace(reader, e)
            else:
                self._give_back(reader)

    def _back_or_replace(self, reader: _Reader, error: BaseException) -> None:
        replacement = self._replace(reader, error)
        if replacement is not None:
            self._give_back(replacement)

    def read(self, request: dict, segment_ids: set[int]) -> dict | None:
        """The reply of an idle reader to `request` (waiting for one if all are busy), its places in segments
        `segment_ids`; None if the reader died meanwhile or the pool is not usable."""
        reader = self._take()
        if reader is None:
            return None
        try:
            return reader.read(request, segment_ids)
        except (OSError, EOFError, ValueError) as e:
            reader = self._replace(reader, e)
            return None
        finally:
            if reader is not None:
                self._give_back(reader)

    def _take(self) -> _Reader | None:
        while self.usable:  # (a pool given up on may have no reader left to wait for)
            try:
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def _replace(self, reader: _Reader, error: BaseException) -> _Reader | None:
        stuck, timeout_s = isinstance(error, TimeoutError), reader.sock.gettimeout()
        reader.close(kill=stuck)
        with self._lock:
            self._running.remove(reader)
            self._restarts += 1
            self._broken = self._broken or self._restarts > MAX_RESTARTS
            broken, closed = self._broken, self._closed
        what = (f"did not answer in {timeout_s:g} s and was killed" if stuck
                else f"ended (exit status {reader.process.returncode})")
        logger.warning("%s tier: a reader process %s (%s); its blocks are read in this process%s", self.tier, what,
                       error or type(error).__name__, ", and every read from now on" if broken else "")
        if self.on_replaced is not None:
            try:
                self.on_replaced()
            except Exception:  # noqa: BLE001 - the pool goes on reading whatever the tier's clean-up did
                logger.warning("%s tier: cleaning up after a reader process failed", self.tier, exc_info=True)
        if broken or closed:
            return None
        replacement = _Reader(self.module)
        with self._lock:
            self._running.append(replacement)
        return replacement

    def _give_back(self, reader: _Reader) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.put(reader)
        if closed:
            self._stop(reader)

    def close(self) -> None:
        """Stop the readers (those busy now stop when their read returns)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                reader = self._idle.get_nowait()
            except queue.Empty:
                return
            self._stop(reader)

    def _stop(self, reader: _Reader) -> None:
        reader.close()
        with self._lock:
            self._running.remove(reader)


def start_readers(processes: int, module: str, tier: str,
                  on_replaced: Callable[[], None] | None = None) -> ReaderPool | None:
    """A pool of `processes` readers running `module` for the tier named `tier` (`on_replaced`: see ReaderPool), or
    None (no processes asked for, or they could not be started: the tier reads in its own process)."""
    if processes < 1:
        return None
    try:
        return ReaderPool(processes, module, tier, on_replaced)
    except OSError as e:
        logger.warning("%s tier: cannot start its reader processes (%s); blocks are read in this process", tier, e)
        return None
