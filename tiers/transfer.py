"""The transfer engine: moves runs of device blocks to and from host memory off the step thread.

Mechanism only: the hierarchy decides which blocks move and which tier serves or keeps them; this
module supplies host buffers, worker threads and (on CUDA) streams and events. Two directions, each
with its own worker thread (and CUDA stream), each running its jobs in submission order:

- load: where the blocks of a chunk are all in host memory already, `lend(start, n)` (the CPU tier's
  slab) lends them and they are copied straight from there (on CUDA the slab is pinned: no staging
  copy, one host-to-device copy per run of neighbouring slots, all queued in one call, released once
  landed). Otherwise `fill(start, host_views)` (the hierarchy's reads from the CPU slab or the disk tier) writes each
  block's payload into a host buffer; the run is then copied to the device blocks. A large run is
  filled in contiguous parts by several threads at once (`fill_threads`): one core's memcpy, and the
  disk tier's copy plus checksum, move fewer bytes a second than a host-to-device link does. On CUDA the
  buffer is a bounded pinned staging area, split in two halves so that filling one overlaps the
  copy of the other, and a run moves as one host-to-device copy into a device staging area plus one
  scatter into the KV cache. With the KV cache in host memory the views are the device blocks
  themselves (no staging: the tier's read is the only copy).
- store: the blocks are copied out of the KV cache (gather plus one device-to-host copy on CUDA,
  after the compute stream's work so far), then `drain(start, host_views)` hands them to a lower tier.

Completion: a job is done when its worker has seen its last copy complete (a CUDA event, waited on
by the worker, never a device-wide synchronize and never on the step thread). The step thread only
polls `done`; it waits (`wait`, `wait_copied`) only for a job it needs now.

Invariants the caller relies on:
- a store job's device blocks are not read after `copied` is set, so a block may be reused once
  `wait_copied()` returns;
- a load job writes only its own device blocks, and nothing after `done` is set;
- the caller hands a load only blocks that no step queued on the device still reads or writes (free
  blocks, freed once their step was read back): on CUDA a load does not wait for the compute stream, so
  one started while a step computes copies beside it;
- a failure inside `fill` or `drain` is logged and ends the job: a load then reports the failed
  chunk's blocks and every later one as not served; nothing is raised on the step thread;
- `fill` may run on several threads at once, for disjoint parts of a job (the tiers' reads are
  thread-safe); a job ends only when all of its parts have returned;
- lent rows are released once, after every copy from them has landed, also when the job fails.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from kvstrata.tiers.base import as_bytes
from kvstrata.tiers.shared_memory import pin, shared_empty, unpin

logger = logging.getLogger("kvstrata")

# fill(start, host_views) -> served per view; drain(start, host_views) -> None. The views hold the
# job's blocks start, start + 1, ... (a job moves in chunks). Both run on a worker thread and must
# copy what they keep before returning: the views are reused for the next chunk.
Fill = Callable[[int, list[torch.Tensor]], list[bool]]
Drain = Callable[[int, list[torch.Tensor]], None]


@dataclass(eq=False)
class LentBlocks:
    """Blocks lent out of a tier's host memory to be copied straight from there: the i-th block is row
    `rows[i]` of `slab` (`[slots, block_nbytes]` bytes). Until `release()`, called once after the
    copies have landed, the rows are neither evicted nor reused."""

    slab: torch.Tensor
    rows: list[int]
    release: Callable[[], None]


# lend(start, n) -> the job's blocks start .. start + n - 1, all lent, or None (then they are filled).
Lend = Callable[[int, int], "LentBlocks | None"]


def contiguous_runs(block_ids: Sequence[int], rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first block id, first row, length) of each run where both the block ids and the rows count up
    by one: one copy moves a run."""
    runs: list[tuple[int, int, int]] = []
    for block_id, row in zip(block_ids, rows):
        if runs and block_id == runs[-1][0] + runs[-1][2] and row == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block_id, row, 1))
    return runs

# Host copies through numpy, one call each, when there are at most this many (see copy_each).
FEW_COPIES = 4


def copy_each(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    """`dests[i].copy_(srcs[i])` for every i, giving up the interpreter lock as few times as it can.

    Every copy call lets go of the lock and must take it back, and a transfer thread that takes it back
    beside a busy step thread makes the step thread wait (a wake-up and a switch on every copy: a promotion
    in many runs made the step that admitted it several times longer than its own work on a CPU; a GPU's step
    thread lets go of the lock at every kernel launch). So copies go in one call, `torch._foreach_copy_` (each
    copy made in C++ as `copy_` makes it, on the current CUDA stream too), except host copies where that loses:
    a few (a long run of neighbouring blocks moves faster through numpy's memcpy than through torch's copy, on
    a CPU), and any while torch has several CPU threads (torch would split each copy over its intra-op threads
    from this thread, beside the step's own: measured slower, and at a multiple of the CPU time)."""
    if not dests:
        return
    on_host = dests[0].device.type == "cpu" and srcs[0].device.type == "cpu"
    if on_host and (len(dests) <= FEW_COPIES or torch.get_num_threads() > 1):
        for dest, src in zip(dests, srcs):
            np.copyto(dest.numpy(), src.numpy())
        return
    torch._foreach_copy_(list(dests), list(srcs), non_blocking=non_blocking)


def copy_rows(dest: torch.Tensor, dest_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int],
              non_blocking: bool = False) -> None:
    """`dest[dest_rows[i]] = src[src_rows[i]]` for every i, a run of neighbours (`contiguous_runs`) per copy."""
    runs = contiguous_runs(dest_rows, src_rows)
    copy_each([dest[d:d + n] for d, _, n in runs], [src[s:s + n] for _, s, n in runs], non_blocking)


# Fill threads: one per core this process may run on (a container's CPU set, not the machine's count), at most 16
# with the KV cache on a GPU, at most 4 with it in host memory, where the model's own threads run on those cores. A
# disk reader copies and checksums at one core's memory rate, which is low on some GPU hosts: there, warm disk
# promotions of large blocks were far faster with 16 fill threads (and readers) and more staging than with 4.
MAX_FILL_THREADS = 16
MAX_FILL_THREADS_ON_HOST = 4
USABLE_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_fill_threads(on_gpu: bool) -> int:
    """The fill threads (and each lower tier's reader processes) of a transfer engine whose KV cache is on a GPU
    (`on_gpu`) or in host memory."""
    return min(MAX_FILL_THREADS if on_gpu else MAX_FILL_THREADS_ON_HOST, USABLE_CORES)


MIN_FILL_PART_BYTES = 4 << 20  # a part read by another thread: large enough to outweigh the handoff
# Pinned staging per direction, on CUDA only: each half holds a part of 8 MB or more for every fill thread, so that
# they all read at once (with 64 MB, 8 readers or 16 moved SmolLM2's blocks no faster than 4 did).
MIN_STAGING_BYTES = 64 << 20
STAGING_BYTES_PER_FILL_THREAD = 16 << 20


def default_staging_bytes(fill_threads: int) -> int:
    """The pinned staging of each direction for `fill_threads` fill threads (see STAGING_BYTES_PER_FILL_THREAD)."""
    return max(MIN_STAGING_BYTES, fill_threads * STAGING_BYTES_PER_FILL_THREAD)


@dataclass(eq=False)
class Transfer:
    """One job. `served` (loads) holds, per block, whether it now holds its payload."""

    block_ids: list[int]
    served: list[bool] = field(default_factory=list)
    failed: bool = False
    seconds: float = 0.0  # how long the job took on its worker, from its start to its completion
    _after: object = None  # CUDA, stores: an event on the compute stream that the job's copies wait for
    _copied: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def copied(self) -> bool:
        """The job's device blocks are no longer read (stores) or written (loads)."""
        return self._copied.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def wait_copied(self) -> None:
        self._copied.wait()


class TransferEngine:
    """Asynchronous batched block copies between the KV cache and host memory (see module doc)."""

    def __init__(self, kv_cache: torch.Tensor, staging_bytes: int | None = None,
                 fill_threads: int | None = None, shared_staging: bool = False):
        self.kv_cache = kv_cache
        self.on_cuda = kv_cache.device.type == "cuda"
        fill_threads = default_fill_threads(self.on_cuda) if fill_threads is None else fill_threads
        block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        # Completions wake `wait_any`; one condition for both directions.
        self._completed = threading.Condition()
        self._closed = False
        self._filler = filler = _Filler(fill_threads, max(1, MIN_FILL_PART_BYTES // block_nbytes))
        if self.on_cuda:
            staging_bytes = default_staging_bytes(fill_threads) if staging_bytes is None else staging_bytes
            chunk = max(1, staging_bytes // (2 * block_nbytes))  # blocks per half of a staging area
            # Shared staging: the disk tier's reader processes fill it (tiers/shared_memory.py).
            self._loads = _CudaDirection("load", kv_cache, chunk, self._completed, filler, shared_staging)
            self._stores = _CudaDirection("store", kv_cache, chunk, self._completed)
        else:
            self._loads = _HostDirection("load", kv_cache, self._completed, filler)
            self._stores = _HostDirection("store", kv_cache, self._completed)

    @property
    def fill_threads(self) -> int:
        return self._filler.threads

    @property
    def parallel_load_blocks(self) -> int:
        """The fewest blocks a load needs for every fill thread to read a part of it (1: loads are
        read by one thread whatever their size)."""
        return self._filler.threads * self._filler.min_part_blocks if self._filler.threads > 1 else 1

    def load(self, block_ids: Sequence[int], fill: Fill, lend: Lend | None = None) -> Transfer:
        """Fill device blocks `block_ids`, in the background: each chunk from the blocks `lend` lends,
        else with what `fill` writes into host views."""
        return self._loads.submit(Transfer(list(block_ids)), (fill, lend))

    def store(self, block_ids: Sequence[int], drain: Drain) -> Transfer:
        """Copy device blocks `block_ids` out (as computed so far) and hand them to `drain`, in the background."""
        transfer = Transfer(list(block_ids))
        if self.on_cuda and transfer.block_ids:
            # A store must come after the work queued on the compute stream so far: it reads blocks the last step
            # computed. A load need not: it writes free blocks only, and no queued step touches one (the caller's
            # invariant: a block is freed only once the step that used it has been read back). So a load started
            # while a step computes copies beside it instead of after it.
            transfer._after = torch.cuda.current_stream(self.kv_cache.device).record_event()
        return self._stores.submit(transfer, drain)

    def allocate_staging(self) -> None:
        """Allocate (and page-lock) both directions' staging now, on the calling thread, if not yet: otherwise the
        first job of each direction allocates it on its worker. Page-locking holds the CUDA driver, so every CUDA
        call of the step thread waited for it: on a GPU the first write-down of a fresh engine stalled the step
        beside it. No-op with the KV cache in host memory (no staging)."""
        self._loads.allocate_staging()
        self._stores.allocate_staging()

    def shared_host_buffers(self) -> list[torch.Tensor]:
        """The host memory that loads are filled into and that other processes may write (the shared pinned
        staging on CUDA, allocated now), for a tier's reader processes to map ahead of their reads; none with the
        KV cache in host memory (the fills go straight into it) or without shared staging."""
        return self._loads.shared_host_buffers()

    def wait_any(self, transfers: Sequence[Transfer], timeout: float) -> bool:
        """Wait until one of `transfers` is done (True) or `timeout` seconds pass (False)."""
        with self._completed:
            return self._completed.wait_for(lambda: any(t.done for t in transfers), timeout)

    def wait_stores(self) -> None:
        """Wait until every store submitted so far is done: its blocks are in their lower tier."""
        self._stores.wait_idle()

    def wait_idle(self) -> None:
        """Wait until every job submitted so far is done (shutdown, tests)."""
        self._loads.wait_idle()
        self._stores.wait_idle()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loads.stop()
        self._stores.stop()


class _Filler:
    """Runs a load's `fill` over contiguous parts of its views on several threads at once: the
    calling worker reads the first part, helper threads the others."""

    def __init__(self, threads: int, min_part_blocks: int):
        self.threads = max(1, threads)
        self.min_part_blocks = min_part_blocks
        self._helpers: ThreadPoolExecutor | None = None  # started by the first load large enough

    def __call__(self, fill: Fill, start: int, views: list[torch.Tensor]) -> list[bool]:
        return self.in_parts(lambda a, b: fill(start + a, views[a:b]), len(views))

    def in_parts(self, read: Callable[[int, int], list[bool]], num_blocks: int) -> list[bool]:
        """`read(a, b)` (blocks a .. b - 1 served or not) over contiguous parts of `num_blocks` blocks at once."""
        parts = min(self.threads, num_blocks // self.min_part_blocks)
        if parts <= 1:
            return list(read(0, num_blocks))
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvstrata-fill")
        bounds = [num_blocks * k // parts for k in range(parts + 1)]
        helped = [self._helpers.submit(read, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        try:
            served = list(read(0, bounds[1]))
        finally:
            wait(helped)  # every part has stopped writing before the job may end, even on a failure
        for part in helped:
            served += part.result()  # raises a part's failure: the job's chunk is then unserved
        return served

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown()


class _Direction:
    """A worker thread running one direction's jobs in submission order (loads: filled by `filler`)."""

    def __init__(self, name: str, kv_cache: torch.Tensor, completed: threading.Condition,
                 filler: _Filler | None = None):
        self.name = name
        self.kv_cache = kv_cache
        self._flat_blocks = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)  # [blocks, block bytes]
        self._completed = completed
        self._fill = filler or _Filler(1, 1)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Transfer | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvstrata-{name}", daemon=True)
        self._thread.start()

    def submit(self, transfer: Transfer, work) -> Transfer:
        if not transfer.block_ids:
            self._finish(transfer)
            return transfer
        self._last = transfer
        self._jobs.put((transfer, work))
        return transfer

    def wait_idle(self) -> None:
        last = self._last
        if last is not None:
            last.wait()

    def stop(self) -> None:
        self.wait_idle()
        self._jobs.put(None)
        self._thread.join()
        self._fill.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            transfer, work = job
            started = time.perf_counter()
            try:
                if self.name == "load":
                    self._load(transfer, work)
                else:
                    self._store(transfer, work)
            except Exception:  # a tier's fault is a miss, never a crashed engine
                logger.exception("kvstrata: a block %s failed", self.name)
                transfer.failed = True
                transfer.served += [False] * (len(transfer.block_ids) - len(transfer.served))
            transfer.seconds = time.perf_counter() - started
            self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        transfer._copied.set()
        with self._completed:
            transfer._done.set()
            self._completed.notify_all()

    # Subclasses: how a job's bytes move.
    def allocate_staging(self) -> None:
        """Allocate the direction's staging now, if it has any and has not yet."""

    def shared_host_buffers(self) -> list[torch.Tensor]:
        return []

    def _load(self, transfer: Transfer, work: tuple[Fill, Lend | None]) -> None:
        raise NotImplementedError

    def _store(self, transfer: Transfer, drain: Drain) -> None:
        raise NotImplementedError


class _HostDirection(_Direction):
    """The KV cache is in host memory: the tiers read into and write from the device blocks directly.

    A job runs beside the step thread and needs the interpreter lock for each Python operation: while the
    engine steps other requests it gets a share of the lock, not all of it, so lent blocks are copied a run of
    neighbours at a time, the runs in one call (`copy_rows`)."""

    def _views(self, transfer: Transfer) -> list[torch.Tensor]:
        return [self._flat_blocks[b] for b in transfer.block_ids]

    def _load(self, transfer: Transfer, work: tuple[Fill, Lend | None]) -> None:
        fill, lend = work
        lent = lend(0, len(transfer.block_ids)) if lend is not None else None
        if lent is None:
            transfer.served = self._fill(fill, 0, self._views(transfer))
            return
        ids = transfer.block_ids

        def copy_lent(a: int, b: int) -> list[bool]:  # what the tier's read copies, in one call or few
            copy_rows(self._flat_blocks, ids[a:b], lent.slab, lent.rows[a:b])
            return [True] * (b - a)

        try:
            transfer.served = self._fill.in_parts(copy_lent, len(ids))
        finally:
            lent.release()

    def _store(self, transfer: Transfer, drain: Drain) -> None:
        drain(0, self._views(transfer))  # the tier copies the payloads before returning


class _CudaDirection(_Direction):
    """Pinned host staging in two halves, a device staging area, a side stream and events."""

    def __init__(self, name: str, kv_cache: torch.Tensor, chunk_blocks: int, completed: threading.Condition,
                 filler: _Filler | None = None, shared_staging: bool = False):
        self.chunk = chunk_blocks
        self.shared_staging = shared_staging
        self._registered: list[torch.Tensor] = []  # shared staging page-locked by us: unpinned at stop
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        # Staging is allocated by `allocate_staging`, else by the first job (an engine without lower tiers never
        # pins any).
        self.host: list[torch.Tensor] = []
        self.device: torch.Tensor | None = None
        # An event per host half: recorded after the last copy that read or wrote it.
        self.host_free: list[torch.cuda.Event | None] = [None, None]
        # Blocks move as bytes: the same copies whatever the cache's dtype (fp8 included, which some
        # indexing ops do not take).
        super().__init__(name, kv_cache.view(torch.uint8), completed, filler)

    def allocate_staging(self) -> None:
        if self.device is None:
            self._allocate_staging()  # on the calling (step) thread, before any job: none is using it

    def shared_host_buffers(self) -> list[torch.Tensor]:
        if self.shared_staging:
            self.allocate_staging()
        return list(self._registered)

    def _allocate_staging(self) -> None:
        shape = (self.chunk, *self.kv_cache.shape[1:])
        self.host = [self._host_half(shape) for _ in range(2)]
        self.device = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)

    def _host_half(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.shared_staging:
            try:
                half = shared_empty(shape, self.kv_cache.dtype)
            except OSError as e:
                half, why = None, str(e)
            else:
                why = "CUDA would not page-lock it"
            if half is not None and pin(half):
                self._registered.append(half)
                return half
            logger.warning("kvstrata: no shared staging (%s); the disk tier's blocks are read in this process", why)
        return torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=True)

    def stop(self) -> None:
        super().stop()
        while self._registered:
            unpin(self._registered.pop())

    def _chunks(self, transfer: Transfer):
        if self.device is None:
            self._allocate_staging()
        ids = transfer.block_ids
        for k, start in enumerate(range(0, len(ids), self.chunk)):
            half = k % 2
            if self.host_free[half] is not None:
                self.host_free[half].synchronize()  # this worker waits, not the step thread
            yield half, start, ids[start:start + self.chunk]

    def _host_views(self, half: int, n: int) -> list[torch.Tensor]:
        return [as_bytes(self.host[half][i]) for i in range(n)]

    def _load(self, transfer: Transfer, work: tuple[Fill, Lend | None]) -> None:
        fill, lend = work
        lent_chunks: list[LentBlocks] = []
        try:
            for half, start, ids in self._chunks(transfer):
                lent = lend(start, len(ids)) if lend is not None else None
                if lent is not None:
                    lent_chunks.append(lent)
                    self._copy_lent(ids, lent)
                    transfer.served += [True] * len(ids)
                    continue
                transfer.served += self._fill(fill, start, self._host_views(half, len(ids)))
                with torch.cuda.stream(self.stream):
                    index = torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)
                    staged = self.device[:len(ids)]
                    staged.copy_(self.host[half][:len(ids)], non_blocking=True)  # one host-to-device copy
                    self.kv_cache.index_copy_(0, index, staged)
                    self.host_free[half] = self.stream.record_event()
        finally:
            # The worker waits for its own stream: the job has landed, and no copy reads a lent row any
            # more (after a failure too), so the rows may go back.
            self.stream.synchronize()
            for lent in lent_chunks:
                lent.release()

    def _copy_lent(self, block_ids: list[int], lent: LentBlocks) -> None:
        """Host-to-device copies straight from the lent (pinned) rows, one per run of neighbours, queued in one call."""
        with torch.cuda.stream(self.stream):
            copy_rows(self._flat_blocks, block_ids, lent.slab, lent.rows, non_blocking=True)

    def _store(self, transfer: Transfer, drain: Drain) -> None:
        self.stream.wait_event(transfer._after)
        for half, start, ids in self._chunks(transfer):
            with torch.cuda.stream(self.stream):
                index = torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)
                staged = self.device[:len(ids)]
                torch.index_select(self.kv_cache, 0, index, out=staged)
                self.host[half][:len(ids)].copy_(staged, non_blocking=True)  # one device-to-host copy
                copied = self.stream.record_event()
            copied.synchronize()
            drain(start, self._host_views(half, len(ids)))
        transfer._copied.set()
