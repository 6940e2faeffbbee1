"""The disk tier: block records (tiers/record.py) in an LMDB store (tiers/lmdb_store.py), keyed by
chain hash, LRU within a byte budget that every process opening the path shares; pinned blocks
(kept in the store, so they survive restarts) are never evicted.

Reads open one short read transaction per batch with zero-copy buffers and decode each record
straight into the caller's tensor inside the transaction, verifying it on the way. Anything that
does not verify is a miss, counted as corrupt, and deleted; nothing unverified is ever served.

Writes go through ONE background writer thread (tiers/batch_writer.py) that applies many queued
operations (puts, touches from reads, deletes) in one write transaction. A put is visible at once: until its transaction
commits, the encoded record is served from the pending map. A read's touches (the LRU order) wait in the queue
without waking the writer: they only matter to an eviction, and evictions happen in a write that comes after them in
the queue, so they are applied first; a flush, a close or a long queue of them applies them too. A promotion's
reads thus cost no write transaction (a commit and an fsync) beside them. Crash safety is LMDB's: a transaction
is all or nothing, so after kill -9 a reader sees the last committed state and never a torn value.

A put of a block the store already holds (a CPU-tier eviction, mostly: tiers/policy.py) queues a touch, not the
record, and like a read's it waits for the next write. The block must then count as the most recent one: eviction
passes over it until that touch is applied, since the puts queued before the touch would otherwise evict it as the
oldest, and its caller has just let go of it. A put of a block that the transaction in flight has just evicted stores
the record again. Another process sharing the store evicts by its own queue.

No storage fault escapes the tier; each is a miss or a counted, dropped write:
- the map is full (pages pinned by readers, fragmentation): the oldest blocks are evicted and the
  batch retried; what still does not fit is dropped and counted in `write_errors`;
- another process grew the map (it opened the store with a larger size): the size is adopted;
- the store is damaged under us (its file truncated, pages that fail LMDB's checks): reads are
  misses, and the writer moves the store aside and starts a fresh one, logged once. Should not even
  that work, the tier holds nothing until restarted: every read a miss, every put dropped.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import lmdb
import torch

from kvstrata.tiers.base import BlockLayout, LowerTier, Pin, TierStats, close_at_exit, parents_or_unknown
from kvstrata.tiers.batch_writer import BatchWriter
from kvstrata.tiers.block_events import AllBlocksCleared
from kvstrata.tiers.lmdb_store import (DAMAGE_ERRORS, LmdbStore, Meta, StoreDamaged, data_file_bytes, quarantine,
                                       read_u64, replacing)
from kvstrata.tiers.reader_pool import block_read, start_readers
from kvstrata.tiers.reader_process import CORRUPT, SERVED
from kvstrata.tiers.record import RecordCodec, RecordError
from kvstrata.tiers.shared_memory import locate
from kvstrata.tiers.storage import check_room, format_bytes, prepare_private_dir

logger = logging.getLogger(__name__)

_MiB = 1 << 20
_T = TypeVar("_T")
# touches queued without waking the writer, at most (beyond, the writer takes them): the queue's memory stays bounded
MAX_LAZY_OPS = 4096


def _map_size(capacity_bytes: int, writer_batch: int, record_nbytes: int) -> int:
    """LMDB's map must hold the capacity plus page overhead, the free pages still pinned by readers
    and the batch in flight (freed pages become reusable only a transaction later)."""
    return capacity_bytes + capacity_bytes // 4 + 4 * writer_batch * record_nbytes + 64 * _MiB


class _EnvGate:
    """Transactions share the LMDB environment; remapping it (another process grew the map) or
    replacing it (damage) needs it alone, because LMDB unmaps the file then and a buffer still
    being read would fault. Waiting exclusive use goes first, so that readers cannot starve it.

    `with gate.shared:` is on every read's path, so it is a plain object, not a generator.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users = 0
        self._exclusive = False  # held or wanted
        self.shared = _SharedUse(self)

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._users += 1

    def exit_shared(self) -> None:
        with self._cond:
            self._users -= 1
            if not self._users and self._exclusive:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._users:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _SharedUse:
    __slots__ = ("_gate",)

    def __init__(self, gate: _EnvGate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        self._gate.enter_shared()

    def __exit__(self, *exc) -> None:
        self._gate.exit_shared()


@dataclass
class _Op:
    kind: str  # "put" | "touch" | "delete" | "clear" | "pin" | "unpin" | "replace" (a damaged store)
    block_hash: bytes = b""
    value: Optional[bytearray] = None
    owner: str = ""                 # "pin", "unpin": whose pin
    pin: Optional[Pin] = None
    token_ids: Sequence[int] = ()       # "put": the block's tokens, for its BlockStored event
    parent: Optional[bytes] = None      # "put": its parent's hash, for the same event (None: unknown)
    damaged: Optional[LmdbStore] = None  # "replace": the store a reader found damaged, and why
    reason: str = ""
    kept: bool = False                  # "touch": a put's, whose block eviction passes over until it is applied


class DiskTier(LowerTier):
    """Blocks in an LMDB store at `path`, at most `capacity_bytes` of records, LRU shared across processes.

    Thread-safe. `put` returns once the records are encoded (copied); a background writer commits
    them, `writer_batch` puts per transaction. At most `4 * writer_batch` puts wait in memory: a put
    beyond that blocks until the writer catches up.

    `check_integrity` walks the store's pages in a child process before opening it (a fraction of
    a second for a few thousand blocks): LMDB can crash the process on a damaged page, so a store
    that does not pass is moved aside and the tier starts empty.
    """

    name = "disk"

    def __init__(self, layout: BlockLayout, path: str, capacity_bytes: int, *, writer_batch: int = 64,
                 check_integrity: bool = True, read_processes: int = 0):
        if writer_batch < 1:
            raise ValueError(f"writer_batch must be >= 1, got {writer_batch}")
        self.layout = layout
        self.codec = RecordCodec(layout)
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.capacity_bytes = int(capacity_bytes)
        self.writer_batch = writer_batch
        record_nbytes = self.codec.record_nbytes
        if self.capacity_bytes < record_nbytes:
            raise ValueError(f"cache.tiers.disk.size: {format_bytes(self.capacity_bytes)} is smaller than one "
                             f"block ({format_bytes(record_nbytes)})")
        for key, check in (("path", prepare_private_dir), ("size", lambda p: check_room(p, self.capacity_bytes))):
            try:
                check(self.path)
            except ValueError as e:
                raise ValueError(f"cache.tiers.disk.{key}: {e}") from None
        self._map_size = _map_size(self.capacity_bytes, writer_batch, record_nbytes)
        self._store: Optional[LmdbStore] = LmdbStore.open(self.path, self._map_size, self.capacity_bytes,
                                                          check_integrity)
        self._gate = _EnvGate()

        self._pending: dict[bytes, bytearray] = {}    # queued puts not yet committed, servable
        self._kept: Counter[bytes] = Counter()        # blocks eviction passes over: a put's touch is queued for each
        self._evicting: set[bytes] = set()            # evicted by the batch in flight, committed or not yet
        self._max_pending = 4 * writer_batch
        self._closed = False
        self._damage_reported = False                 # since the store was last (re)opened
        self._writes_failing = False                  # since the last batch that committed
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes,
                                capacity_blocks=self.capacity_bytes // record_nbytes)
        self._write_errors = 0
        self._writer: BatchWriter[_Op] = BatchWriter("kvstrata-disk-writer", self._take_batch, self._write,
                                                     on_finished=self._forget_committed)
        self._cond = self._writer.cond  # guards the pending map too, so that it always matches the queue
        # Reads into shared host memory go to these processes (tiers/disk_reader.py); others run here.
        self._readers = start_readers(read_processes, "kvstrata.tiers.disk_reader", self.name,
                                      on_replaced=self._clear_stale_readers)
        self._blocks_read_by_processes = 0  # served by them
        self._atexit = close_at_exit(self)

    # -- reads -------------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        return self.count_prefix([block_hash]) == 1

    def count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        return self.count_prefixes([block_hashes])[0]

    def count_prefixes(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """All the chains in one read snapshot."""
        pending = self._pending_flags(*chains)

        def count(store, txn) -> list[int]:
            counts = []
            for chain, queued in zip(chains, pending):
                n = 0
                while n < len(chain) and (queued[n] or txn.get(chain[n]) is not None):
                    n += 1
                counts.append(n)
            return counts

        return self._in_snapshot("atime", count, default=lambda: [_leading_true(queued) for queued in pending])

    def held(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Each hash, in one snapshot (as `count_prefix`)."""
        (pending,) = self._pending_flags(block_hashes)

        def each(store, txn) -> list[bool]:
            return [p or txn.get(h) is not None for h, p in zip(block_hashes, pending)]

        return self._in_snapshot("atime", each, default=lambda: pending)

    def _pending_flags(self, *chains: Sequence[bytes]) -> list[list[bool]]:
        """Which hashes of each chain wait in the writer's queue, under one taking of its lock. Taken before the
        snapshot that looks up the rest: a put that commits in between is in the snapshot."""
        self._check_open()
        with self._cond:
            return [[h in self._pending for h in chain] for chain in chains]

    def get(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            dests: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(dests)
        served = [False] * len(block_hashes)
        corrupt: list[bytes] = []
        # Pending records first, then one read snapshot: a record committed (and leaving the pending
        # map) after our look at the map is in the snapshot, so no held block is ever missed.
        with self._cond:
            pending = [self._pending.get(h) for h in block_hashes]
        from_store = [i for i, v in enumerate(pending) if v is None]
        for i, record in enumerate(pending):
            if record is not None:
                served[i] = self._serve(record, block_hashes[i], token_ids[i], dests[i], corrupt)
        if from_store and self._readers is not None:
            from_store = self._read_in_reader(from_store, block_hashes, token_ids, dests, served, corrupt)
        while from_store:
            from_store = self._read_from_store(from_store, block_hashes, token_ids, dests, served, corrupt)
        hits = sum(served)
        with self._cond:  # reads of one load may run on several threads at once
            self._stats.hits += hits
            self._stats.misses += len(served) - hits
            self._stats.corrupt += len(corrupt)
        self._enqueue([_Op("touch", h) for h, ok in zip(block_hashes, served) if ok], wake=False)
        self._enqueue([_Op("delete", h) for h in corrupt])
        return served

    def _read_from_store(self, todo: list[int], block_hashes, token_ids, dests, served: list[bool],
                         corrupt: list[bytes]) -> list[int]:
        """Serve blocks `todo` from one read snapshot; returns those still to try.

        An LMDB error on one key (a damaged page on its path) marks that key corrupt; it also
        invalidates the transaction, so the rest is returned to be read in a fresh one.
        """
        def read(store, txn) -> list[int]:
            for n, i in enumerate(todo):
                try:
                    record = txn.get(block_hashes[i])
                except lmdb.Error as e:
                    logger.debug("disk tier: reading block %s failed (%s); dropping it", block_hashes[i].hex(), e)
                    corrupt.append(block_hashes[i])
                    return todo[n + 1:]
                if record is not None:
                    served[i] = self._serve(record, block_hashes[i], token_ids[i], dests[i], corrupt)
            return []

        return self._in_snapshot("blocks", read, default=list)

    def share(self, *dests: torch.Tensor) -> None:
        """Where `dests` (the memory reads will fill: a host KV cache, pinned staging) are shared memory, have the
        reader processes map them, and open the store, now rather than at the first read."""
        segments = {place.segment for place in map(locate, dests) if place is not None}
        if self._readers is None or not segments:
            return
        with self._gate.shared:
            store = self._store
            if store is not None:
                self._readers.prepare(segments, {"path": store.path, "file": store.file_id()})

    def _read_in_reader(self, todo: list[int], block_hashes, token_ids, dests, served: list[bool],
                        corrupt: list[bytes]) -> list[int]:
        """Serve blocks `todo` through a reader process, where every destination is shared memory; returns those
        still to read here (all of them where a destination is private, or no reader answered)."""
        read = block_read([block_hashes[i] for i in todo], [token_ids[i] for i in todo], [dests[i] for i in todo],
                          self.codec)
        if read is None or not self._readers.usable:
            return todo
        request, segments = read
        with self._gate.shared:  # the store is not replaced while a reader reads it
            store = self._store
            if store is None:
                return []
            reply = self._readers.read({**request, "path": store.path, "file": store.file_id()}, segments)
        if reply is None:
            return todo
        with self._cond:
            self._blocks_read_by_processes += reply["codes"].count(SERVED)
        for i, code in zip(todo, reply["codes"]):
            if code == SERVED:
                served[i] = True
            elif code == CORRUPT:
                logger.debug("disk tier: block %s does not verify; dropping it", block_hashes[i].hex())
                corrupt.append(block_hashes[i])
        if reply["error"] is not None:
            kind, message = reply["error"]
            if kind == "damaged":
                self._report_damage(store, StoreDamaged(message))
            elif kind == "failed":
                logger.warning("disk tier: a reader's read failed (%s); treating the blocks as misses", message)
        return []

    def _serve(self, record, block_hash: bytes, expected, dest: torch.Tensor, corrupt: list) -> bool:
        try:
            self.codec.decode_into(record, expected, dest)
            return True
        except RecordError as e:  # a cache never serves what it cannot verify
            logger.debug("disk tier: block %s does not verify: %s", block_hash.hex(), e)
            corrupt.append(block_hash)
            return False

    def _in_snapshot(self, db_name: str, read: Callable[[LmdbStore, lmdb.Transaction], _T],
                     default: Callable[[], _T]) -> _T:
        """`read(store, txn)` in one read snapshot of the sub-database `db_name`, or `default()` if the store
        cannot be read now: the reason is logged (once, for damage), never raised."""
        for attempt in range(2):
            store = None
            try:
                with self._gate.shared:
                    store = self._store
                    if store is None:
                        return default()
                    with store.begin(db=getattr(store, db_name)) as txn:
                        return read(store, txn)
            except lmdb.MapResizedError as e:
                if attempt == 0:
                    self._adopt_map_size()
                    continue
                self._log_read_error(e)
            except (StoreDamaged, *DAMAGE_ERRORS) as e:
                self._report_damage(store, e)
            except lmdb.Error as e:
                self._log_read_error(e)
            return default()
        raise AssertionError("unreachable")

    def _log_read_error(self, error: lmdb.Error) -> None:
        logger.warning("disk tier: read transaction failed (%s); treating the blocks as misses", error)

    def _report_damage(self, store: LmdbStore, error: Exception) -> None:
        """A reader found the store damaged: have the writer replace it (it logs that, once)."""
        with self._cond:
            if self._damage_reported:
                return
            self._damage_reported = True
        self._enqueue([_Op("replace", damaged=store, reason=f"{type(error).__name__}: {error}")])

    def _adopt_map_size(self) -> None:
        with self._gate.exclusive():
            if self._store is not None:
                logger.info("disk tier: another process grew the store at '%s'; adopting its map size", self.path)
                self._store.adopt_map_size()

    def report_contents(self) -> None:
        """Report every block the store holds as stored, in runs of one chain with the parent each put named (the
        store keeps it): a store reopened by a restarted process holds blocks that no listener of this process has
        heard of, and a router following its events would otherwise never send it their prompts. A block stored
        before the store kept parents is left out: an event must not name a parent it does not know."""
        events = self._events()
        if events is None:
            return

        def held(store, txn) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
            found = {}
            if store.parents is None:
                return found
            for block_hash, parent in txn.cursor(db=store.parents):
                block_hash, parent = bytes(block_hash), bytes(parent)
                record = txn.get(block_hash, db=store.blocks)
                token_ids = None if record is None else self.codec.token_ids(record)
                # another layout's record is a miss for every read, and a parent not a hash is no parent: not held
                if token_ids is not None and len(parent) in (0, len(block_hash)):
                    found[block_hash] = (parent or None, token_ids)
            return found

        blocks = self._in_snapshot("blocks", held, default=dict)
        for block_hash in parents_first(blocks):
            parent, token_ids = blocks[block_hash]
            events.stored(block_hash, token_ids, parent)
        events.emit(self.event_listener)

    # -- writes ------------------------------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            srcs: Sequence[torch.Tensor], parents: Sequence[bytes | None] | None = None) -> None:
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(srcs)
        parents = parents_or_unknown(parents, len(block_hashes))
        held = self._keep_held(block_hashes)
        ops = []
        for h, ids, src, parent, is_held in zip(block_hashes, token_ids, srcs, parents, held):
            if is_held:
                ops.append(_Op("touch", h, kept=True))
            else:
                ops.append(_Op("put", h, self.codec.encode(ids, src), token_ids=ids, parent=parent))
        self._enqueue(ops, wake=not all(held))  # touches alone wait for the next write, as a read's do

    def _keep_held(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Which blocks are held; those that are stay kept from eviction until their touch is applied.

        Each is kept before it is looked up, under the lock the writer takes to evict: an eviction decided before
        that is in `_evicting` (the block counts as not held, whatever a snapshot still says), one decided after
        passes over it. Those found not held are let go at once."""
        with self._cond:
            self._kept.update(block_hashes)
            pending = [h in self._pending for h in block_hashes]
            evicting = [h in self._evicting for h in block_hashes]
        held = self._in_snapshot(
            "atime", lambda store, txn: [not e and (p or txn.get(h) is not None)
                                         for h, p, e in zip(block_hashes, pending, evicting)],
            default=lambda: [p and not e for p, e in zip(pending, evicting)])
        seen: set[bytes] = set()
        for k, h in enumerate(block_hashes):  # a hash twice in one batch is stored once
            held[k] = held[k] or h in seen
            seen.add(h)
        with self._cond:
            self._let_go(h for h, is_held in zip(block_hashes, held) if not is_held)
        return held

    def _let_go(self, block_hashes: Iterator[bytes]) -> None:
        """Under the lock: one keeping of each block ends."""
        kept = self._kept
        for h in block_hashes:
            if kept[h] > 1:
                kept[h] -= 1
            else:
                kept.pop(h, None)

    def _spare(self, block_hash: bytes) -> bool:
        """The writer's question before it evicts a block (see `_keep_held`)."""
        with self._cond:
            if self._kept[block_hash] > 0:
                return True
            self._evicting.add(block_hash)
            return False

    def _enqueue(self, ops: list[_Op], wake: bool = True) -> None:
        """Queue `ops` for the writer; `wake=False` (touches) leaves them for its next batch (see the module doc)."""
        if not ops:
            return
        with self._cond:
            for op in ops:
                if op.kind == "put":
                    while len(self._pending) >= self._max_pending and not self._writer.stopping:
                        self._cond.notify_all()  # the writer must see what is queued so far
                        self._cond.wait()
                    self._pending[op.block_hash] = op.value
                    self._stats.puts += 1
                elif op.kind == "delete":
                    self._pending.pop(op.block_hash, None)
                elif op.kind == "clear":
                    self._pending.clear()
                self._writer.append_locked(op)
            if wake or len(self._writer.ops) > MAX_LAZY_OPS:
                self._cond.notify_all()

    def pin(self, owner: str, block_hashes: Sequence[bytes], info: dict | None = None) -> None:
        """Pin in the store itself (committed before this returns): the pin survives restarts, and
        every process sharing the path keeps the blocks too."""
        self._check_open()
        self._enqueue([_Op("pin", owner=owner, pin=Pin(tuple(block_hashes), dict(info or {})))])
        self.flush()

    def unpin(self, owner: str) -> bool:
        self._check_open()
        had = owner in self.pins()
        self._enqueue([_Op("unpin", owner=owner)])
        self.flush()
        return had

    def pins(self) -> dict[str, Pin]:
        self._check_open()
        records = self._in_snapshot("pins", lambda store, txn: store.read_pins(txn), default=dict)
        return {owner: Pin(tuple(hashes), info) for owner, (hashes, info) in records.items()}

    def discard(self, block_hash: bytes) -> bool:
        return self.discard_many([block_hash]) == 1

    def discard_many(self, block_hashes: Sequence[bytes]) -> int:
        """Committed before this returns, in one transaction rather than one per block."""
        held = sum(self.contains(h) for h in block_hashes)
        self._enqueue([_Op("delete", h) for h in block_hashes])
        self.flush()
        return held

    def clear(self) -> bool:
        """Drop every block and every pin, for every process sharing the store; False if the write
        failed (counted in write_errors)."""
        self._check_open()
        errors_before = self._write_errors
        self._enqueue([_Op("clear")])
        self.flush()
        return self._write_errors == errors_before

    def flush(self) -> None:
        """Wait until every operation queued so far is committed (or given up on, and counted)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush, stop the writer and close the store. Safe to call twice and at interpreter exit."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._readers is not None:
            self._readers.close()
        self._writer.stop()
        if self._store is not None:
            self._store.close()
        atexit.unregister(self._atexit)

    def _clear_stale_readers(self) -> None:
        """A reader process died, maybe inside a read transaction: clear what it left registered in the store (see
        `LmdbStore.clear_stale_readers`). Called by the reader pool from inside a read or a prepare, both under the
        gate, so the store is not replaced meanwhile."""
        store = self._store
        if store is not None and (cleared := store.clear_stale_readers()):
            logger.info("disk tier at '%s': cleared %d reader slot(s) left by dead processes", self.path, cleared)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier at '{self.path}' is closed")

    # -- the writer thread -------------------------------------------------------------------

    def _write(self, batch: list[_Op]) -> None:
        try:
            self._commit(batch)
        except Exception as e:  # never let the writer die: dropped writes are only lost cache
            self._count_dropped(len(batch), len(batch), e)

    def _forget_committed(self, batch: list[_Op]) -> None:
        """Under the lock, once a batch is committed: its records are served from the store now."""
        for op in batch:
            if op.kind == "put" and self._pending.get(op.block_hash) is op.value:
                del self._pending[op.block_hash]
        self._let_go(op.block_hash for op in batch if op.kind == "touch" and op.kept)
        self._evicting.clear()  # committed (or given up on): a snapshot now says what the batch left

    def _take_batch(self, ops: deque[_Op]) -> list[_Op]:
        """Up to `writer_batch` puts and whatever cheap ops sit between them, in queue order."""
        batch, puts = [], 0
        while ops and puts < self.writer_batch:
            op = ops.popleft()
            batch.append(op)
            puts += op.kind == "put"
        return batch

    def _commit(self, batch: list[_Op]) -> None:
        """Commit a batch in one transaction; if it cannot be, its operations one by one, so that only
        those that cannot be applied (a full map, a store that cannot be written) are dropped."""
        for op in batch:
            if op.kind == "replace" and op.damaged is self._store:
                self._replace_store(op.reason)
        batch = [op for op in batch if op.kind != "replace"]
        if not batch:
            return
        if self._store is not None and not self._store.is_at_path():
            self._adopt_replacement()
        error = self._try_commit(batch)
        if error is not None and len(batch) > 1:
            failed = [op for op in batch if self._try_commit([op]) is not None]
        else:
            failed = batch if error is not None else []
        if failed:
            self._count_dropped(len(failed), len(batch), error)
        elif self._writes_failing:
            self._writes_failing = False
            logger.warning("disk tier: writes to '%s' succeed again", self.path)

    def _count_dropped(self, num_failed: int, num_ops: int, error: BaseException) -> None:
        """Count dropped operations; log the first failure of a run of them (once per outage)."""
        self._write_errors += num_failed
        if not self._writes_failing:
            self._writes_failing = True
            logger.error("disk tier: dropped %d of %d operations on '%s' (%s: %s); counting the ones that "
                         "follow in write_errors", num_failed, num_ops, self.path, type(error).__name__, error)

    def _try_commit(self, ops: list[_Op]) -> Optional[BaseException]:
        """Apply `ops` in one transaction, adopting a map another process grew, making room in a full
        one and replacing a damaged store as needed. Returns the error if they still fail."""
        error: Optional[BaseException] = None
        replaced = False
        attempts = 4
        for attempt in range(attempts):
            if self._store is None:
                return error or StoreDamaged("no store: a damaged one could not be replaced")
            try:
                self._apply(ops)
                return None
            except lmdb.MapResizedError as e:
                error = e
                self._adopt_map_size()
            except lmdb.MapFullError as e:
                error = e
                if attempt < attempts - 1:  # down to 3/4, 1/2, then 1/4 of the capacity, retrying each time
                    self._make_room(keep_bytes=self.capacity_bytes * (attempts - 1 - attempt) // attempts)
            except (StoreDamaged, *DAMAGE_ERRORS) as e:
                if replaced:
                    return e
                error, replaced = e, True
                self._replace_store(f"{type(e).__name__}: {e}")
            except lmdb.Error as e:
                return e
        return error

    def _apply(self, ops: list[_Op]) -> None:
        """Apply `ops` in one transaction; their events are reported once it has committed."""
        store = self._store
        evictions_before = store.evictions
        events = self._events()
        evicted: list[bytes] | None = None if events is None else []
        try:  # one transaction: all of the batch commits, or none of it
            with self._gate.shared, store.begin(write=True) as txn:
                meta = Meta.read(txn, store.meta)
                for op in ops:
                    if op.kind == "put":
                        stored = store.insert(txn, meta, op.block_hash, op.value, self.capacity_bytes, evicted,
                                              op.parent, self._spare)
                        if events is not None:
                            for h in evicted:
                                events.removed(h)
                            evicted.clear()
                            if stored:
                                events.stored(op.block_hash, op.token_ids, op.parent)
                    elif op.kind == "touch":
                        store.touch(txn, meta, op.block_hash)
                    elif op.kind == "delete":
                        if store.delete(txn, meta, op.block_hash) and events is not None:
                            events.removed(op.block_hash)
                    elif op.kind == "pin":
                        store.pin(txn, meta, op.owner, op.pin.block_hashes, op.pin.info)
                    elif op.kind == "unpin":
                        store.unpin(txn, meta, op.owner)
                    elif op.kind == "clear":
                        store.clear(txn)
                        meta = Meta.read(txn, store.meta)
                        if events is not None:
                            events.cleared()
                meta.write(txn, store.meta)
        except BaseException:
            store.evictions = evictions_before  # the transaction was aborted: nothing was evicted
            raise
        self._stats.evictions += store.evictions - evictions_before
        if events is not None:
            events.emit(self.event_listener)

    def _make_room(self, keep_bytes: int) -> None:
        """Evict the oldest blocks down to `keep_bytes` after LMDB's map filled up (pages pinned by
        readers, fragmentation); if even that fails, the next attempt will say so."""
        logger.debug("disk tier: LMDB map full; evicting down to %s", format_bytes(keep_bytes))
        store = self._store
        before = store.evictions
        events = self._events()
        try:
            with self._gate.shared, store.begin(write=True) as txn:
                meta = Meta.read(txn, store.meta)
                while meta.used_bytes > keep_bytes:
                    oldest = store.evict_oldest(txn, meta, self._spare)
                    if oldest is None:
                        break
                    if events is not None:
                        events.removed(oldest)
                meta.write(txn, store.meta)
        except lmdb.Error:
            store.evictions = before
            return
        self._stats.evictions += store.evictions - before
        if events is not None:
            events.emit(self.event_listener)

    def _adopt_replacement(self) -> None:
        """Another process sharing the store found it damaged and moved it aside: write to (and read
        from) the fresh store it started at the path, not to a file nobody else will open again."""
        with self._gate.exclusive():
            orphan, self._store = self._store, None
            try:
                orphan.close()
            except lmdb.Error:
                pass
            try:  # the process that replaced it checked it; a fresh store needs no walk
                self._store = LmdbStore.open(self.path, self._map_size, self.capacity_bytes, check_integrity=False)
                logger.warning("disk tier: another process replaced the damaged store at '%s'; using the new one",
                               self.path)
                if self.event_listener is not None:  # what the old store held is not in the new one
                    self.event_listener(AllBlocksCleared(self.name))
            except ValueError as e:
                logger.error("disk tier: could not open the store another process started at '%s' (%s); the "
                             "disk tier holds nothing until restarted", self.path, e)

    def _replace_store(self, reason: str) -> None:
        """Move the damaged store aside and start a fresh one at the same path (in the writer thread,
        with the environment to itself). Pending puts stay pending and go to the fresh store."""
        with self._gate.exclusive():
            damaged, self._store = self._store, None
            try:
                with replacing(self.path):  # processes sharing the store take turns
                    ours = damaged.is_at_path()  # else another process replaced it already
                    try:
                        damaged.close()
                    except lmdb.Error:
                        pass
                    if ours:
                        quarantine(self.path, reason)
                self._store = LmdbStore.open(self.path, self._map_size, self.capacity_bytes)
                if self.event_listener is not None:  # what the damaged store held is gone
                    self.event_listener(AllBlocksCleared(self.name))
            except (OSError, ValueError) as e:
                logger.error("disk tier: could not start a fresh store at '%s' (%s); the disk tier holds "
                             "nothing until restarted", self.path, e)
        with self._cond:
            self._damage_reported = False

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        self._check_open()
        entries, used_bytes, pinned = self._in_snapshot(
            "meta", lambda store, txn: (txn.stat(store.blocks)["entries"], read_u64(txn, store.meta, b"used_bytes"),
                                        txn.stat(store.pinned)["entries"]),
            default=lambda: (0, 0, 0))
        with self._cond:
            pending = list(self._pending.values())
        return dataclasses.replace(
            self._stats,
            used_blocks=entries + len(pending),
            used_bytes=used_bytes + sum(len(v) for v in pending),
            pinned_blocks=pinned,
            extra={"path": self.path, "file_bytes": data_file_bytes(self.path), "pending_puts": len(pending),
                   "write_errors": self._write_errors,
                   "read_processes": self._readers.processes if self._readers and self._readers.usable else 0,
                   "blocks_read_by_processes": self._blocks_read_by_processes},
        )


def parents_first(blocks: dict[bytes, tuple[bytes | None, object]]) -> list[bytes]:
    """The hashes of `blocks` (hash -> (parent hash, ...)) in an order where each chain runs from its first block
    held to its last, depth first, so that a block right after its parent joins its run."""
    children: dict[bytes | None, list[bytes]] = {}
    for block_hash, (parent, _) in blocks.items():
        children.setdefault(parent if parent in blocks else None, []).append(block_hash)
    order, stack = [], list(reversed(children.get(None, [])))
    while stack:
        block_hash = stack.pop()
        order.append(block_hash)
        stack.extend(reversed(children.get(block_hash, [])))
    return order


def _leading_true(flags: Sequence[bool]) -> int:
    return next((k for k, flag in enumerate(flags) if not flag), len(flags))
