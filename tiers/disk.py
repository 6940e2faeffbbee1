"""The disk tier: an LMDB store of blocks keyed by chain hash, LRU within a byte budget.

Store layout (one LMDB environment, four named sub-databases):

    blocks  hash -> value: u32 little-endian header length | canonical CBOR header | payload
            header = {"version", "dtype", "shape", "tokens", "xxh3"} (xxh3 = xxh3_64 of the payload)
    atime   hash -> u64 BE sequence of its last use | u64 BE value size
    lru     u64 BE sequence | hash -> b""   (so a cursor's first key is the least recently used block)
    meta    "format", "used_bytes", "next_seq", "capacity_bytes"

The LRU order lives in LMDB itself, so every process that opens the path shares it.

Reads open one short read transaction per batch with zero-copy buffers, verify each value (format
version, dtype, shape, token ids, checksum, length) and copy the payload straight into the caller's
tensor inside the transaction. Anything that does not verify is a miss, counted as corrupt, and
deleted; nothing unverified is ever served and no storage error escapes the tier.

Writes go through ONE background writer thread that applies many queued operations (puts, touches
from reads, deletes) in one write transaction. A put is visible at once: until its transaction
commits, the encoded value is served from the pending map. Crash safety is LMDB's: a transaction is
all or nothing, so after kill -9 a reader sees the last committed state and never a torn value.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import cbor2
import lmdb
import numpy as np
import torch
import xxhash

from kvstrata.tiers.base import BlockLayout, LowerTier, TierStats
from kvstrata.tiers.cpu import token_tuple

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STORE_FORMAT = b"kvstrata-disk-v1"
_SUBDBS = (b"blocks", b"atime", b"lru", b"meta")
_HEADER_LEN = struct.Struct("<I")
_U64 = struct.Struct(">Q")
_ATIME = struct.Struct(">QQ")  # sequence, value size
_MiB = 1 << 20


class CorruptBlock(Exception):
    """A stored value that does not verify; the message says why."""


# ---------------------------------------------------------------------------------- value format


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_block(layout: BlockLayout, token_ids: Sequence[int], payload: torch.Tensor) -> bytearray:
    """One disk value for a block: header length, CBOR header, then a copy of the payload bytes."""
    assert payload.dtype == torch.uint8 and payload.numel() == layout.block_nbytes, \
        "a payload is a flat uint8 tensor of layout.block_nbytes bytes"
    src = payload.detach().cpu().contiguous().numpy()
    header = cbor2.dumps({
        "version": FORMAT_VERSION,
        "dtype": dtype_name(layout.dtype),
        "shape": list(layout.block_shape),
        "tokens": list(token_tuple(token_ids)),
        "xxh3": xxhash.xxh3_64_intdigest(src),
    }, canonical=True)
    offset = _HEADER_LEN.size + len(header)
    value = bytearray(offset + layout.block_nbytes)
    _HEADER_LEN.pack_into(value, 0, len(header))
    value[_HEADER_LEN.size:offset] = header
    np.copyto(np.frombuffer(value, dtype=np.uint8, offset=offset), src)
    return value


def _read_header(value: memoryview, layout: BlockLayout) -> tuple[dict, int]:
    """The decoded header and the payload's offset; raises CorruptBlock unless it describes this layout."""
    if len(value) < _HEADER_LEN.size:
        raise CorruptBlock("value shorter than its header length field")
    (header_len,) = _HEADER_LEN.unpack_from(value, 0)
    offset = _HEADER_LEN.size + header_len
    if offset + layout.block_nbytes != len(value):
        raise CorruptBlock(f"value is {len(value)} bytes, expected {offset + layout.block_nbytes}")
    header = cbor2.loads(bytes(value[_HEADER_LEN.size:offset]))
    if not isinstance(header, dict):
        raise CorruptBlock("header is not a map")
    if header.get("version") != FORMAT_VERSION:
        raise CorruptBlock(f"format version {header.get('version')!r}, expected {FORMAT_VERSION}")
    if header.get("dtype") != dtype_name(layout.dtype) or header.get("shape") != list(layout.block_shape):
        raise CorruptBlock("dtype or shape differs from this model's block layout")
    return header, offset


def decode_block_into(value: memoryview, layout: BlockLayout, expected_tokens: tuple[int, ...],
                      dest: torch.Tensor) -> None:
    """Verify a stored value against the expected token ids and copy its payload into `dest`.

    Raises CorruptBlock (or whatever a mangled header makes cbor2 raise) if anything is off; `dest`
    is then undefined (the interface's contract for a miss). On the host the checksum is taken of
    `dest` right after the copy, while the block is still in cache: one pass over the stored bytes
    instead of two. It checks exactly the bytes the caller will use.
    """
    header, offset = _read_header(value, layout)
    if header.get("tokens") != list(expected_tokens):
        raise CorruptBlock("token ids differ from the expected ones")
    payload = value[offset:]
    if dest.device.type == "cpu":
        dest_np = dest.numpy()
        np.copyto(dest_np, np.frombuffer(payload, dtype=np.uint8))
        if xxhash.xxh3_64_intdigest(dest_np) != header.get("xxh3"):
            raise CorruptBlock("payload checksum mismatch")
    else:
        if xxhash.xxh3_64_intdigest(payload) != header.get("xxh3"):
            raise CorruptBlock("payload checksum mismatch")
        # LMDB's buffer is read-only and valid only inside the read transaction: torch warns about the
        # former, and the copy is synchronous (pageable source), so it is done before the latter ends.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dest.copy_(torch.frombuffer(payload, dtype=torch.uint8))


def encoded_size(layout: BlockLayout) -> int:
    """Bytes of one stored value for this layout (the header of a typical block)."""
    probe = encode_block(layout, [0] * layout.block_size, torch.zeros(layout.block_nbytes, dtype=torch.uint8))
    return len(probe) + 8 * layout.block_size  # token ids up to 2**32 take 4 more bytes each in CBOR; be generous


# ---------------------------------------------------------------------------------- store bookkeeping


@dataclass
class _Meta:
    """The store-wide counters, read at the start of a write transaction and written at its end."""

    used_bytes: int
    next_seq: int

    @classmethod
    def read(cls, txn: lmdb.Transaction, db) -> "_Meta":
        return cls(used_bytes=_read_u64(txn, db, b"used_bytes"), next_seq=_read_u64(txn, db, b"next_seq"))

    def write(self, txn: lmdb.Transaction, db) -> None:
        txn.put(b"used_bytes", _U64.pack(max(self.used_bytes, 0)), db=db)
        txn.put(b"next_seq", _U64.pack(self.next_seq), db=db)


def _read_u64(txn: lmdb.Transaction, db, key: bytes) -> int:
    raw = txn.get(key, db=db)
    return _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == _U64.size else 0


class _Store:
    """The opened LMDB environment and its sub-databases, with the LRU bookkeeping done in write txns.

    Every method taking `txn` runs inside a write transaction the caller owns; they keep the
    invariant: a hash is in `blocks` iff it is in `atime` iff its (seq, hash) is in `lru`, and
    meta's used_bytes is the sum of the sizes recorded in `atime`.
    """

    def __init__(self, env: lmdb.Environment, create: bool = True):
        self.env = env
        self.blocks, self.atime, self.lru, self.meta = (env.open_db(name, create=create) for name in _SUBDBS)
        self.evictions = 0

    def insert(self, txn, meta: _Meta, block_hash: bytes, value, capacity_bytes: int) -> bool:
        """Store a block, evicting least recently used ones to stay within capacity. False if already held."""
        if txn.get(block_hash, db=self.atime) is not None:
            self.touch(txn, meta, block_hash)
            return False
        while meta.used_bytes + len(value) > capacity_bytes and self.evict_oldest(txn, meta):
            pass
        txn.put(block_hash, value, db=self.blocks)
        self._record_use(txn, meta, block_hash, len(value))
        meta.used_bytes += len(value)
        return True

    def touch(self, txn, meta: _Meta, block_hash: bytes) -> None:
        raw = txn.get(block_hash, db=self.atime)
        if raw is None or len(raw) != _ATIME.size:
            return
        seq, size = _ATIME.unpack(bytes(raw))
        txn.delete(_U64.pack(seq) + block_hash, db=self.lru)
        self._record_use(txn, meta, block_hash, size)

    def _record_use(self, txn, meta: _Meta, block_hash: bytes, size: int) -> None:
        seq = meta.next_seq
        meta.next_seq += 1
        txn.put(_U64.pack(seq) + block_hash, b"", db=self.lru)
        txn.put(block_hash, _ATIME.pack(seq, size), db=self.atime)

    def delete(self, txn, meta: _Meta, block_hash: bytes) -> bool:
        raw = txn.get(block_hash, db=self.atime)
        if raw is not None and len(raw) == _ATIME.size:
            seq, size = _ATIME.unpack(bytes(raw))
            txn.delete(_U64.pack(seq) + block_hash, db=self.lru)
            meta.used_bytes -= size
        txn.delete(block_hash, db=self.atime)
        return txn.delete(block_hash, db=self.blocks)

    def evict_oldest(self, txn, meta: _Meta) -> bool:
        """Drop the least recently used block; False when nothing is left to drop."""
        cursor = txn.cursor(db=self.lru)
        if not cursor.first():
            meta.used_bytes = 0  # nothing is held: whatever the counter said, nothing is used
            return False
        block_hash = bytes(cursor.key())[_U64.size:]
        cursor.delete()
        self.delete(txn, meta, block_hash)
        self.evictions += 1
        return True

    def clear(self, txn) -> int:
        entries = txn.stat(self.blocks)["entries"]
        for db in (self.blocks, self.atime, self.lru):
            txn.drop(db, delete=False)
        _Meta(used_bytes=0, next_seq=_read_u64(txn, self.meta, b"next_seq")).write(txn, self.meta)
        return entries


# ---------------------------------------------------------------------------------- opening


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cache.tiers.disk.path: cannot write to '{path}': {e.strerror or e}") from None


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _check_capacity(path: str, capacity_bytes: int, value_bytes: int) -> None:
    if capacity_bytes < value_bytes:
        raise ValueError(f"cache.tiers.disk.size: {_format_bytes(capacity_bytes)} is smaller than one block "
                         f"({_format_bytes(value_bytes)})")
    data_file = os.path.join(path, "data.mdb")
    reusable = os.path.getsize(data_file) if os.path.exists(data_file) else 0
    available = shutil.disk_usage(path).free + reusable
    if capacity_bytes > available:
        raise ValueError(f"cache.tiers.disk.size: {_format_bytes(capacity_bytes)} exceeds the "
                         f"{_format_bytes(available)} free on '{path}'")


def _map_size(capacity_bytes: int, writer_batch: int, value_bytes: int) -> int:
    """LMDB's map must hold the capacity plus page overhead, the free pages still pinned by readers
    and the batch in flight (freed pages become reusable only a transaction later)."""
    return capacity_bytes + capacity_bytes // 4 + 4 * writer_batch * value_bytes + 64 * _MiB


def _open_env(path: str, map_size: int) -> lmdb.Environment:
    return lmdb.open(path, map_size=map_size, max_dbs=len(_SUBDBS), subdir=True, meminit=False)


def _quarantine(path: str, reason) -> None:
    """Move an unreadable store aside so the tier can start empty (the cache is only a cache)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = os.path.join(path, f"data.mdb.corrupt-{stamp}")
    os.replace(os.path.join(path, "data.mdb"), target)
    lock = os.path.join(path, "lock.mdb")
    if os.path.exists(lock):
        os.remove(lock)
    logger.warning("disk tier: store at '%s' could not be opened (%s); moved it to '%s' and started empty",
                   path, reason, target)


# Walks every B-tree page of the store, looks every key up again by search (the path a read takes),
# touches the first and last byte of every value (never the rest of the payload) and tries a write
# transaction (an insert and a delete in every sub-database) that it aborts, so the page allocator
# and the freelist are exercised too. It runs in a separate process: LMDB
# trusts its pages, and a damaged one can kill the process (SIGBUS/SIGSEGV) instead of erroring.
_INTEGRITY_CHECK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=4, map_size=0, subdir=True)
with env.begin(buffers=True) as txn:
    for name in (b"blocks", b"atime", b"lru", b"meta"):
        db = env.open_db(name, txn=txn, create=False)
        for key in [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False)]:
            value = txn.get(key, db=db)
            if value is not None and len(value):
                value[0], value[len(value) - 1]
with env.begin(write=True) as txn:
    for name in (b"blocks", b"atime", b"lru", b"meta"):
        db = env.open_db(name, txn=txn, create=False)
        cursor = txn.cursor(db=db)
        first = bytes(cursor.key()) if cursor.first() else None
        txn.put(b"\\xff" * 32, bytes(1 << 16), db=db)
        if first:
            txn.delete(first, db=db)
    txn.abort()
env.close()
"""


def check_store_integrity(path: str, timeout_s: float = 120.0) -> Optional[str]:
    """None if the store at `path` can be walked safely, else why not (run in a child process).

    Values damaged inside their payload are not this check's business: reads catch those by checksum.
    """
    data_file = os.path.join(path, "data.mdb")
    if not os.path.exists(data_file):
        return None
    try:
        result = subprocess.run([sys.executable, "-c", _INTEGRITY_CHECK, path], capture_output=True,
                                text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"integrity check did not finish in {timeout_s:.0f} s"
    if result.returncode < 0:
        return f"walking its pages killed the process with signal {-result.returncode}"
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return lines[-1] if lines else f"integrity check exited with {result.returncode}"
    return None


def _open_store(path: str, map_size: int, capacity_bytes: int, check_integrity: bool) -> _Store:
    """Open (or create) the store, stamp its format and capacity, and trim it to the capacity.

    A store that fails the integrity check, or that LMDB refuses to open, is quarantined
    (moved aside) and the tier starts empty."""
    if check_integrity:
        problem = check_store_integrity(path)
        if problem is not None:
            _quarantine(path, problem)
    for attempt in range(2):
        try:
            env = _open_env(path, map_size)
            try:
                store = _Store(env)
                with env.begin(write=True) as txn:
                    fmt = txn.get(b"format", db=store.meta)
                    if fmt is not None and bytes(fmt) != STORE_FORMAT:
                        logger.warning("disk tier: '%s' holds format %r; clearing it", path, bytes(fmt))
                        store.clear(txn)
                    txn.put(b"format", STORE_FORMAT, db=store.meta)
                    txn.put(b"capacity_bytes", _U64.pack(capacity_bytes), db=store.meta)
                    meta = _Meta.read(txn, store.meta)
                    while meta.used_bytes > capacity_bytes and store.evict_oldest(txn, meta):
                        pass
                    meta.write(txn, store.meta)
                return store
            except BaseException:
                env.close()
                raise
        except lmdb.Error as e:
            if attempt or not os.path.exists(os.path.join(path, "data.mdb")):
                raise ValueError(f"cache.tiers.disk.path: cannot open the store at '{path}': {e}") from None
            _quarantine(path, e)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------- the tier


@dataclass
class _Op:
    kind: str                       # "put" | "touch" | "delete" | "clear"
    block_hash: bytes = b""
    value: Optional[bytearray] = None


class DiskTier(LowerTier):
    """Blocks in an LMDB store at `path`, at most `capacity_bytes` of values, LRU shared across processes.

    Thread-safe. `put` returns once the values are encoded (copied); a background writer commits
    them, `writer_batch` puts per transaction. At most `4 * writer_batch` puts wait in memory: a put
    beyond that blocks until the writer catches up.

    `check_integrity` walks the store's pages in a child process before opening it (a fraction of
    a second for a few thousand blocks): LMDB can crash the process on a damaged page, so a store
    that does not pass is moved aside and the tier starts empty.
    """

    name = "disk"

    def __init__(self, layout: BlockLayout, path: str, capacity_bytes: int, *, writer_batch: int = 64,
                 check_integrity: bool = True):
        if writer_batch < 1:
            raise ValueError(f"writer_batch must be >= 1, got {writer_batch}")
        self.layout = layout
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.capacity_bytes = int(capacity_bytes)
        self.writer_batch = writer_batch
        self.value_bytes = encoded_size(layout)
        _check_writable(self.path)
        _check_capacity(self.path, self.capacity_bytes, self.value_bytes)
        self._store = _open_store(self.path, _map_size(self.capacity_bytes, writer_batch, self.value_bytes),
                                  self.capacity_bytes, check_integrity)
        self._env = self._store.env

        self._cond = threading.Condition()
        self._ops: deque[_Op] = deque()
        self._pending: dict[bytes, bytearray] = {}    # queued puts not yet committed, servable
        self._enqueued = 0                            # ops ever queued
        self._committed = 0                           # ops ever applied (committed or given up on)
        self._max_pending = 4 * writer_batch
        self._stopping = False
        self._closed = False
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes,
                                capacity_blocks=self.capacity_bytes // self.value_bytes)
        self._write_errors = 0
        self._writer = threading.Thread(target=self._writer_loop, name="kvstrata-disk-writer", daemon=True)
        self._writer.start()
        self._atexit = _close_at_exit(weakref.ref(self))
        atexit.register(self._atexit)

    # -- reads -------------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        return self.count_prefix([block_hash]) == 1

    def count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        self._check_open()
        # The pending map first, then one snapshot: a put that commits in between is in the snapshot.
        with self._cond:
            pending = [h in self._pending for h in block_hashes]
        n = 0
        try:
            with self._env.begin(db=self._store.atime, buffers=True) as txn:
                while n < len(block_hashes) and (pending[n] or txn.get(block_hashes[n]) is not None):
                    n += 1
        except lmdb.Error as e:
            self._log_read_error(e)
        return n

    def get(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            dests: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(dests)
        served = [False] * len(block_hashes)
        corrupt: list[bytes] = []
        # Pending values first, then one read snapshot: a value committed (and leaving the pending
        # map) after our look at the map is in the snapshot, so no held block is ever missed.
        with self._cond:
            pending = [self._pending.get(h) for h in block_hashes]
        from_store = [i for i, v in enumerate(pending) if v is None]
        for i, value in enumerate(pending):
            if value is not None:
                served[i] = self._serve(memoryview(value), block_hashes[i], token_ids[i], dests[i], corrupt)
        while from_store:
            from_store = self._read_from_store(from_store, block_hashes, token_ids, dests, served, corrupt)
        hits = sum(served)
        self._stats.hits += hits
        self._stats.misses += len(served) - hits
        self._stats.corrupt += len(corrupt)
        self._enqueue([_Op("touch", h) for h, ok in zip(block_hashes, served) if ok]
                      + [_Op("delete", h) for h in corrupt])
        return served

    def _read_from_store(self, todo: list[int], block_hashes, token_ids, dests, served: list[bool],
                         corrupt: list[bytes]) -> list[int]:
        """Serve blocks `todo` from one read snapshot; returns those still to try.

        An LMDB error on one key (a damaged page on its path) marks that key corrupt; it also
        invalidates the transaction, so the rest is returned to be read in a fresh one.
        """
        try:
            with self._env.begin(db=self._store.blocks, buffers=True) as txn:
                for n, i in enumerate(todo):
                    try:
                        value = txn.get(block_hashes[i])
                    except lmdb.Error as e:
                        logger.warning("disk tier: reading block %s failed (%s); dropping it", block_hashes[i].hex(), e)
                        corrupt.append(block_hashes[i])
                        return todo[n + 1:]
                    if value is not None:
                        served[i] = self._serve(value, block_hashes[i], token_ids[i], dests[i], corrupt)
        except lmdb.Error as e:  # the snapshot itself could not be taken: all misses, none corrupt
            self._log_read_error(e)
        return []

    def _serve(self, value: memoryview, block_hash: bytes, expected, dest: torch.Tensor, corrupt: list) -> bool:
        try:
            decode_block_into(value, self.layout, token_tuple(expected), dest)
            return True
        except Exception as e:  # any decode failure is a miss: a cache never serves what it cannot verify
            logger.debug("disk tier: block %s does not verify: %s", block_hash.hex(), e)
            corrupt.append(block_hash)
            return False

    def _log_read_error(self, error: lmdb.Error) -> None:
        logger.warning("disk tier: read transaction failed (%s); treating the blocks as misses", error)

    # -- writes ------------------------------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            srcs: Sequence[torch.Tensor]) -> None:
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(srcs)
        held = self._held(block_hashes)
        ops = []
        for h, ids, src, is_held in zip(block_hashes, token_ids, srcs, held):
            if is_held:
                ops.append(_Op("touch", h))
            else:
                ops.append(_Op("put", h, encode_block(self.layout, ids, src)))
        self._enqueue(ops)

    def _held(self, block_hashes: Sequence[bytes]) -> list[bool]:
        with self._cond:
            held = [h in self._pending for h in block_hashes]
        try:
            with self._env.begin(db=self._store.atime, buffers=True) as txn:
                held = [is_held or txn.get(h) is not None for h, is_held in zip(block_hashes, held)]
        except lmdb.Error as e:
            self._log_read_error(e)
        seen: set[bytes] = set()
        for k, h in enumerate(block_hashes):  # a hash twice in one batch is stored once
            held[k] = held[k] or h in seen
            seen.add(h)
        return held

    def _enqueue(self, ops: list[_Op]) -> None:
        if not ops:
            return
        with self._cond:
            for op in ops:
                if op.kind == "put":
                    while len(self._pending) >= self._max_pending and not self._stopping:
                        self._cond.notify_all()  # the writer must see what is queued so far
                        self._cond.wait()
                    self._pending[op.block_hash] = op.value
                    self._stats.puts += 1
                elif op.kind == "delete":
                    self._pending.pop(op.block_hash, None)
                elif op.kind == "clear":
                    self._pending.clear()
                self._ops.append(op)
                self._enqueued += 1
            self._cond.notify_all()

    def discard(self, block_hash: bytes) -> bool:
        held = self.contains(block_hash)
        self._enqueue([_Op("delete", block_hash)])
        self.flush()
        return held

    def clear(self) -> None:
        self._check_open()
        self._enqueue([_Op("clear")])
        self.flush()

    def flush(self) -> None:
        """Wait until every operation queued so far is committed."""
        with self._cond:
            target = self._enqueued
            while self._committed < target and self._writer.is_alive():
                self._cond.wait()

    def close(self) -> None:
        """Flush, stop the writer and close the store. Safe to call twice and at interpreter exit."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._cond.notify_all()
        self._writer.join()
        self._env.close()
        atexit.unregister(self._atexit)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier at '{self.path}' is closed")

    # -- the writer thread -------------------------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._stopping:
                    self._cond.wait()
                if not self._ops:
                    return  # stopping and drained
                batch = self._take_batch()
            try:
                self._apply_with_room(batch)
            except Exception as e:  # never let the writer die: dropped writes are only lost cache
                self._write_errors += 1
                logger.error("disk tier: writing %d operations to '%s' failed (%s); they are dropped",
                             len(batch), self.path, e)
            with self._cond:
                for op in batch:
                    if op.kind == "put" and self._pending.get(op.block_hash) is op.value:
                        del self._pending[op.block_hash]
                self._committed += len(batch)
                self._cond.notify_all()

    def _take_batch(self) -> list[_Op]:
        """Up to `writer_batch` puts and whatever cheap ops sit between them, in queue order."""
        batch, puts = [], 0
        while self._ops and puts < self.writer_batch:
            op = self._ops.popleft()
            batch.append(op)
            puts += op.kind == "put"
        return batch

    def _apply_with_room(self, batch: list[_Op]) -> None:
        """Commit a batch; if LMDB's map is full (fragmentation, pages pinned by readers), evict
        more of the oldest blocks and retry instead of failing. If the batch fails otherwise (a
        damaged page under one of its keys), apply its operations one by one so that only the
        ones that cannot be applied are lost."""
        for attempt in range(4):
            try:
                self._apply(batch)
                return
            except lmdb.MapFullError:
                if len(batch) > 1 and attempt == 3:
                    break
                keep = self.capacity_bytes * (3 - attempt) // 4
                logger.warning("disk tier: LMDB map full; evicting down to %s and retrying", _format_bytes(keep))
                self._evict_down_to(keep)
            except lmdb.Error as e:
                if len(batch) == 1:
                    raise
                logger.warning("disk tier: a batch of %d operations failed (%s); applying them one by one",
                               len(batch), e)
                break
        for op in batch:
            try:
                self._apply([op])
            except lmdb.Error as e:
                self._write_errors += 1
                logger.error("disk tier: dropping a %s of block %s: %s", op.kind, op.block_hash.hex(), e)

    def _apply(self, batch: list[_Op]) -> None:
        store = self._store
        evictions_before = store.evictions
        try:  # one transaction: all of the batch commits, or none of it
            with self._env.begin(write=True) as txn:
                meta = _Meta.read(txn, store.meta)
                for op in batch:
                    if op.kind == "put":
                        store.insert(txn, meta, op.block_hash, op.value, self.capacity_bytes)
                    elif op.kind == "touch":
                        store.touch(txn, meta, op.block_hash)
                    elif op.kind == "delete":
                        store.delete(txn, meta, op.block_hash)
                    elif op.kind == "clear":
                        store.clear(txn)
                        meta = _Meta.read(txn, store.meta)
                meta.write(txn, store.meta)
        except BaseException:
            store.evictions = evictions_before  # the transaction was aborted: nothing was evicted
            raise
        self._stats.evictions += store.evictions - evictions_before

    def _evict_down_to(self, keep_bytes: int) -> None:
        with self._env.begin(write=True) as txn:
            meta = _Meta.read(txn, self._store.meta)
            before = self._store.evictions
            while meta.used_bytes > keep_bytes and self._store.evict_oldest(txn, meta):
                pass
            meta.write(txn, self._store.meta)
        self._stats.evictions += self._store.evictions - before

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        self._check_open()
        with self._env.begin() as txn:
            entries = txn.stat(self._store.blocks)["entries"]
            used_bytes = _read_u64(txn, self._store.meta, b"used_bytes")
        with self._cond:
            pending = list(self._pending.values())
        return dataclasses.replace(
            self._stats,
            used_blocks=entries + len(pending),
            used_bytes=used_bytes + sum(len(v) for v in pending),
            extra={"path": self.path, "file_bytes": _file_bytes(self.path), "pending_puts": len(pending),
                   "write_errors": self._write_errors},
        )


def _close_at_exit(tier_ref: "weakref.ReferenceType[DiskTier]"):
    def close() -> None:
        tier = tier_ref()
        if tier is not None:
            tier.close()
    return close


def _file_bytes(path: str) -> int:
    data_file = os.path.join(path, "data.mdb")
    return os.path.getsize(data_file) if os.path.exists(data_file) else 0


# ---------------------------------------------------------------------------------- admin helpers


def _open_existing(path: str, readonly: bool) -> _Store:
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise ValueError(f"'{path}' is not a kvstrata disk store (no data.mdb in it)")
    try:
        # map_size=0 adopts the size the store was created with.
        env = lmdb.open(path, max_dbs=len(_SUBDBS), subdir=True, readonly=readonly, map_size=0)
        store = _Store(env, create=False)
    except lmdb.Error as e:
        raise ValueError(f"'{path}' is not a readable kvstrata disk store: {e}") from None
    with env.begin() as txn:
        fmt = txn.get(b"format", db=store.meta)
    if fmt != STORE_FORMAT:
        env.close()
        raise ValueError(f"'{path}' is not a kvstrata disk store (format {fmt!r})")
    return store


def read_store_stats(path: str) -> dict:
    """Entries, used bytes, capacity and file size of the store at `path`, without knowing its layout."""
    store = _open_existing(path, readonly=True)
    try:
        with store.env.begin() as txn:
            return {
                "path": os.path.abspath(path),
                "entries": txn.stat(store.blocks)["entries"],
                "used_bytes": _read_u64(txn, store.meta, b"used_bytes"),
                "capacity_bytes": _read_u64(txn, store.meta, b"capacity_bytes"),
                "file_bytes": _file_bytes(path),
            }
    finally:
        store.env.close()


def clear_store(path: str) -> int:
    """Remove every block from the store at `path`; returns how many were removed."""
    store = _open_existing(path, readonly=False)
    try:
        with store.env.begin(write=True) as txn:
            return store.clear(txn)
    finally:
        store.env.close()
