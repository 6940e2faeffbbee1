"""The LMDB store behind the disk tier: its files, how it is opened safely, and its LRU bookkeeping.

It knows values as bytes only (no torch, no block layout), so `kvstrata cache stats|clear` use it
without importing torch. One LMDB environment in a directory, six named sub-databases:

    blocks  hash -> value (a block record, tiers/record.py)
    atime   hash -> u64 BE sequence of its last use | u64 BE value size
    lru     u64 BE sequence | hash -> b""   (so a cursor's first key is the least recently used block)
    meta    "format", "used_bytes", "next_seq", "capacity_bytes"
    pins    owner (UTF-8) -> JSON {"block_hashes": [hex, ...], "info": {...}}
    pinned  hash -> u64 BE number of owners pinning it

The LRU order and the pins live in LMDB itself, so every process that opens the path shares them
and they survive restarts. A pinned block stays out of `lru`, so eviction never sees it. The directory
is 0700 and its files 0600 (tiers/storage.py): stored token ids decode back to prompt text.

LMDB trusts its pages, and a damaged file can kill the process (SIGBUS, SIGSEGV) instead of raising
an error. Hence: a store is walked by an integrity check in a child process before it is opened,
and one that fails is moved aside (`quarantine`); and before every transaction the data file's size
is checked against the last page LMDB's meta page says is in use, because a file truncated under
a running process turns the next read of a page past its new end into SIGBUS (`StoreDamaged`).
"""
from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import logging
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import lmdb

from kvstrata.tiers.storage import PRIVATE_DIR_MODE, make_private

logger = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
REPLACE_LOCK_FILE = "replace.lock"  # ours, beside LMDB's: held while a damaged store is moved aside
STORE_FORMAT = b"kvstrata-disk-v2"   # v2: values are block records (tiers/record.py)
STORE_FORMAT_FAMILY = "kvstrata-disk-"
SUBDBS = (b"blocks", b"atime", b"lru", b"meta", b"pins", b"pinned", b"parents")
# Added within format v2: a store written before them lacks them (opened for writing, it gets them).
OPTIONAL_SUBDBS = (b"pins", b"pinned", b"parents")
_U64 = struct.Struct(">Q")
_ATIME = struct.Struct(">QQ")  # sequence, value size

# LMDB errors that mean the file itself is damaged: retrying cannot help, only a fresh store can.
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)


class StoreDamaged(ValueError):
    """The store's files are damaged (truncated, unreadable pages); the message says how."""


def data_file(path: str) -> str:
    return os.path.join(path, DATA_FILE)


def store_exists(path: str | os.PathLike) -> bool:
    return os.path.isfile(data_file(os.fspath(path)))


def data_file_bytes(path: str) -> int:
    try:
        return os.path.getsize(data_file(path))
    except OSError:
        return 0


# ---------------------------------------------------------------------------------- integrity


def _truncation(env: lmdb.Environment, file_bytes: Callable[[], int], psize: int) -> Optional[str]:
    """Why the data file (`file_bytes()` its size now) cannot hold the pages `env`'s meta page says are
    in use, or None.

    The meta pages are read through the map, so the file is first checked to hold them at all. The
    size compared with the pages in use is read after them: a writer (a thread, another process) may
    commit in between, and a commit writes its pages before the meta page that counts them, so a size
    read before could be short of a count read after without anything being wrong.
    """
    size = file_bytes()
    if size < 2 * psize:
        return f"{DATA_FILE} is truncated: {size} bytes, less than its two meta pages"
    needed = (env.info()["last_pgno"] + 1) * psize
    size = file_bytes()
    if size < needed:
        return f"{DATA_FILE} is truncated: {size} bytes, LMDB uses {needed}"
    return None


def _walk_store(path: str, writable: bool) -> None:
    """The integrity check proper. It runs in a child process whose script is built from this
    function's source and `_truncation`'s.

    Checks the file holds every page in use, walks every B-tree page of the store, looks every key
    up again by search (the path a read takes), touches the first and last byte of every value
    (never the rest of the payload) and, for a store that will be written, tries a write
    transaction (an insert and a delete in every sub-database) that it aborts, so the page
    allocator and the freelist are exercised too. Exits non-zero, the reason on stderr's last line.
    """
    import os
    import sys

    import lmdb

    data = os.path.join(path, DATA_FILE)
    if os.path.getsize(data) == 0:
        sys.exit(f"{DATA_FILE} is empty (0 bytes): nothing was ever committed to it")
    try:
        env = lmdb.open(path, max_dbs=len(SUBDBS), map_size=0, subdir=True, readonly=not writable)
    except lmdb.Error:
        if writable:
            raise
        # A store this user may not write: its lock file cannot be opened for writing either.
        env = lmdb.open(path, max_dbs=len(SUBDBS), map_size=0, subdir=True, readonly=True, lock=False)
    psize = os.sysconf("SC_PAGE_SIZE")
    problem = _truncation(env, lambda: os.path.getsize(data), psize)
    if problem:
        sys.exit(problem)
    with env.begin(buffers=True) as txn:
        for name in SUBDBS:
            try:
                db = env.open_db(name, txn=txn, create=False)
            except lmdb.NotFoundError:  # a store from before the pin and parent sub-databases
                continue
            for key in [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False)]:
                value = txn.get(key, db=db)
                if value is not None and len(value):
                    value[0], value[len(value) - 1]
    if writable:
        with env.begin(write=True) as txn:
            for name in SUBDBS:
                try:
                    db = env.open_db(name, txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue
                cursor = txn.cursor(db=db)
                first = bytes(cursor.key()) if cursor.first() else None
                txn.put(b"\xff" * 32, bytes(1 << 16), db=db)
                if first:
                    txn.delete(first, db=db)
            txn.abort()
    env.close()


_INTEGRITY_CHECK = "\n".join([
    "from __future__ import annotations", "import sys", f"DATA_FILE = {DATA_FILE!r}", f"SUBDBS = {SUBDBS!r}",
    inspect.getsource(_truncation), inspect.getsource(_walk_store), "_walk_store(sys.argv[1], sys.argv[2] == 'write')"])


def check_store_integrity(path: str, writable: bool = True, timeout_s: float = 120.0) -> Optional[str]:
    """None if the store at `path` can be used safely (read, and written if `writable`), else why not.

    Runs in a child process. Values damaged inside their payload are not this check's business:
    reads catch those by checksum.
    """
    if not store_exists(path):
        return None
    try:
        result = subprocess.run([sys.executable, "-c", _INTEGRITY_CHECK, path, "write" if writable else "read"],
                                capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"integrity check did not finish in {timeout_s:.0f} s"
    if result.returncode < 0:
        return f"walking its pages killed the process with signal {-result.returncode}"
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return lines[-1] if lines else f"integrity check exited with {result.returncode}"
    return None


def quarantine(path: str, reason) -> str:
    """Move a damaged store's data file aside (renamed with a timestamp) so that a fresh store can
    start at `path` (the cache is only a cache); returns where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = f"{data_file(path)}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{data_file(path)}.corrupt-{stamp}-{n}"
    os.replace(data_file(path), target)
    remove_lock_file(path)
    logger.warning("disk tier: the store at '%s' is damaged (%s); moved its data to '%s' and started empty",
                   path, reason, target)
    return target


@contextlib.contextmanager
def replacing(path: str):
    """Held while a store is found damaged and moved aside. Processes sharing the store take turns, so
    that one that finds it damaged at the same moment as another then sees the fresh store the other
    started, instead of moving that one aside too (and losing what is written to it) or failing to
    start. Without a lock file (a store this user cannot write) there is nothing to replace anyway."""
    try:
        fd = os.open(os.path.join(path, REPLACE_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def file_id(path: str) -> tuple[int, int] | None:
    """Which file `path` names now (device, inode), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _move_aside(path: str, reason) -> None:
    """`quarantine` when opening: a damaged store that cannot be moved aside is a one-line error."""
    try:
        quarantine(path, reason)
    except OSError as e:
        raise ValueError(f"cache.tiers.disk.path: the store at '{path}' is damaged ({reason}) and could not be "
                         f"moved aside: {e}") from None


def remove_lock_file(path: str) -> None:
    try:
        os.remove(os.path.join(path, LOCK_FILE))
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------- bookkeeping


@dataclass
class Meta:
    """The store-wide counters, read at the start of a write transaction and written at its end."""

    used_bytes: int
    next_seq: int

    @classmethod
    def read(cls, txn: lmdb.Transaction, db) -> "Meta":
        return cls(used_bytes=read_u64(txn, db, b"used_bytes"), next_seq=read_u64(txn, db, b"next_seq"))

    def write(self, txn: lmdb.Transaction, db) -> None:
        txn.put(b"used_bytes", _U64.pack(max(self.used_bytes, 0)), db=db)
        txn.put(b"next_seq", _U64.pack(self.next_seq), db=db)


def read_u64(txn: lmdb.Transaction, db, key: bytes) -> int:
    raw = txn.get(key, db=db)
    return _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == _U64.size else 0


class LmdbStore:
    """An opened store: its environment and sub-databases, and the LRU bookkeeping of write txns.

    Every method taking `txn` runs inside a write transaction the caller owns; they keep the
    invariants: a hash is in `blocks` iff it is in `atime`; it is in `lru` (as (seq, hash)) iff it is
    in `atime` and not in `pinned`; `pinned[h]` counts the owners in `pins` naming `h`; meta's
    used_bytes is the sum of the sizes recorded in `atime`; a hash in `parents` (each block's parent as
    its put named it, b"" for none) is in `blocks`. A store opened read-only that predates the pin and
    parent sub-databases has `pins`, `pinned` and `parents` None: it pins nothing and names no parents.
    """

    def __init__(self, path: str, env: lmdb.Environment, create: bool):
        self.path = path
        self.env = env
        self.evictions = 0
        self._psize = os.sysconf("SC_PAGE_SIZE")
        # The size check asks the file LMDB mapped, not whatever the path names by then.
        self._data_fd = os.open(data_file(path), os.O_RDONLY)
        try:
            self.check_size()  # opening the sub-databases reads pages already
            self.blocks, self.atime, self.lru, self.meta, self.pins, self.pinned, self.parents = (
                self._open_db(name, create) for name in SUBDBS)
        except BaseException:
            os.close(self._data_fd)
            raise

    def _open_db(self, name: bytes, create: bool):
        try:
            return self.env.open_db(name, create=create)
        except lmdb.NotFoundError:
            if name in OPTIONAL_SUBDBS and not create:
                return None
            raise

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, map_size: int, capacity_bytes: int, check_integrity: bool = True) -> "LmdbStore":
        """Open (or create) the store in the directory `path` for writing, stamp its format and
        capacity, and trim it to the capacity.

        A store that fails the integrity check, or that proves damaged on opening, is quarantined
        and a fresh one started. Raises ValueError, one line naming the key, if not even that works.
        """
        if check_integrity:
            with replacing(path):
                problem = check_store_integrity(path)
                if problem is not None:
                    _move_aside(path, problem)
        for attempt in range(2):
            opened = file_id(data_file(path))  # the data file this attempt opens (None: it starts one)
            try:
                return cls._open_writable(path, map_size, capacity_bytes)
            except (StoreDamaged, lmdb.VersionMismatchError, *DAMAGE_ERRORS) as e:
                if attempt or not store_exists(path):
                    raise ValueError(f"cache.tiers.disk.path: cannot open the store at '{path}': {e}") from None
                with replacing(path):
                    if file_id(data_file(path)) == opened:  # else another process replaced it already
                        _move_aside(path, e)
            except (lmdb.Error, OSError) as e:  # not the files' fault (already open here, permissions, ...)
                raise ValueError(f"cache.tiers.disk.path: cannot open the store at '{path}': {e}") from None
        raise AssertionError("unreachable")

    @classmethod
    def _open_writable(cls, path: str, map_size: int, capacity_bytes: int) -> "LmdbStore":
        env = lmdb.open(path, map_size=map_size, max_dbs=len(SUBDBS), subdir=True, meminit=False,
                        mode=PRIVATE_DIR_MODE)  # files get the mode without execute bits: 0600
        try:
            for name in (DATA_FILE, LOCK_FILE):
                make_private(os.path.join(path, name))
            store = cls(path, env, create=True)
            store.clear_stale_readers()  # a process that died reading (a crash, a killed reader) held pages back
            with store.begin(write=True) as txn:
                fmt = txn.get(b"format", db=store.meta)
                if fmt is not None and bytes(fmt) != STORE_FORMAT:
                    logger.warning("disk tier: '%s' holds format %r; clearing it", path, bytes(fmt))
                    store.clear(txn)
                txn.put(b"format", STORE_FORMAT, db=store.meta)
                txn.put(b"capacity_bytes", _U64.pack(capacity_bytes), db=store.meta)
                meta = Meta.read(txn, store.meta)
                while meta.used_bytes > capacity_bytes and store.evict_oldest(txn, meta) is not None:
                    pass
                meta.write(txn, store.meta)
            return store
        except BaseException:
            env.close()
            raise

    @classmethod
    def open_existing(cls, path: str, readonly: bool) -> "LmdbStore":
        """Open a store that already exists, with the size it was created with, for inspection or clearing.

        Raises ValueError (one line) if there is none at `path`, or StoreDamaged if it does not
        pass the integrity check: then nothing of it was mapped into this process.
        """
        if not store_exists(path):
            raise ValueError(f"'{path}' is not a kvstrata disk store (no {DATA_FILE} in it)")
        problem = check_store_integrity(path, writable=not readonly)
        if problem is not None:
            raise StoreDamaged(f"the disk store at '{path}' is damaged: {problem}")
        try:
            try:
                env = lmdb.open(path, max_dbs=len(SUBDBS), subdir=True, readonly=readonly, map_size=0)
            except lmdb.Error:
                if not readonly:
                    raise
                # A store this user may not write: its lock file cannot be opened for writing either.
                env = lmdb.open(path, max_dbs=len(SUBDBS), subdir=True, readonly=True, map_size=0, lock=False)
            store = cls(path, env, create=False)
        except lmdb.Error as e:
            raise ValueError(f"'{path}' is not a readable kvstrata disk store: {e}") from None
        if not readonly:
            for name in (DATA_FILE, LOCK_FILE):
                make_private(os.path.join(path, name))
        if not store.format().startswith(STORE_FORMAT_FAMILY):
            store.close()
            raise ValueError(f"'{path}' is not a kvstrata disk store")
        return store

    def format(self) -> str:
        """The format stamped in the store ("" if none): older formats are cleared when a tier opens them."""
        with self.begin() as txn:
            fmt = txn.get(b"format", db=self.meta)
            return bytes(fmt).decode("ascii", "replace") if fmt is not None else ""

    def close(self) -> None:
        self.env.close()
        os.close(self._data_fd)

    def is_at_path(self) -> bool:
        """True while the path still names the data file this store mapped (nobody replaced it)."""
        ours = self.file_id()
        return ours is not None and file_id(data_file(self.path)) == ours

    def file_id(self) -> tuple[int, int] | None:
        """The data file this store mapped (device, inode), whatever the path names now."""
        try:
            st = os.fstat(self._data_fd)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    # -- transactions --------------------------------------------------------------------------

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died (LMDB's reader check); returns how many. A process killed
        inside a read transaction leaves its snapshot registered: until cleared, the writer cannot reuse a page freed
        after it, and the file grows towards a full map with every write."""
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0

    def check_size(self) -> None:
        """Raise StoreDamaged if the data file no longer holds every page LMDB uses (it was
        truncated under this process): any read of the map could then end the process."""
        problem = _truncation(self.env, lambda: os.fstat(self._data_fd).st_size, self._psize)
        if problem is not None:
            raise StoreDamaged(problem)

    def begin(self, write: bool = False, db=None) -> lmdb.Transaction:
        """A transaction, once the data file is known to hold every page in use. Reads get zero-copy
        buffers, valid only inside the transaction."""
        self.check_size()
        return self.env.begin(write=write, db=db, buffers=not write)

    def adopt_map_size(self) -> None:
        """Take the map size another process grew the store to (after lmdb.MapResizedError). No
        transaction of this process may be open."""
        self.env.set_mapsize(0)

    # -- LRU bookkeeping, inside a write transaction --------------------------------------------

    def insert(self, txn, meta: Meta, block_hash: bytes, value, capacity_bytes: int,
               evicted: list[bytes] | None = None, parent: bytes | None = None,
               spare: Callable[[bytes], bool] | None = None) -> bool:
        """Store a value, evicting least recently used ones to stay within capacity (their hashes are
        appended to `evicted`, if given; those `spare` says yes to are passed over), and the block's parent as the
        put named it (None: the chain's first, or not told). False if already held."""
        if txn.get(block_hash, db=self.atime) is not None:
            self.touch(txn, meta, block_hash)
            return False
        while meta.used_bytes + len(value) > capacity_bytes:
            oldest = self.evict_oldest(txn, meta, spare)
            if oldest is None:
                break
            if evicted is not None:
                evicted.append(oldest)
        txn.put(block_hash, value, db=self.blocks)
        if self.parents is not None:
            txn.put(block_hash, parent or b"", db=self.parents)
        self._record_use(txn, meta, block_hash, len(value))
        meta.used_bytes += len(value)
        return True

    def touch(self, txn, meta: Meta, block_hash: bytes) -> None:
        raw = txn.get(block_hash, db=self.atime)
        if raw is None or len(raw) != _ATIME.size:
            return
        seq, size = _ATIME.unpack(bytes(raw))
        txn.delete(_U64.pack(seq) + block_hash, db=self.lru)
        self._record_use(txn, meta, block_hash, size)

    def _record_use(self, txn, meta: Meta, block_hash: bytes, size: int) -> None:
        seq = meta.next_seq
        meta.next_seq += 1
        if not self.is_pinned(txn, block_hash):
            txn.put(_U64.pack(seq) + block_hash, b"", db=self.lru)
        txn.put(block_hash, _ATIME.pack(seq, size), db=self.atime)

    def delete(self, txn, meta: Meta, block_hash: bytes) -> bool:
        raw = txn.get(block_hash, db=self.atime)
        if raw is not None and len(raw) == _ATIME.size:
            seq, size = _ATIME.unpack(bytes(raw))
            txn.delete(_U64.pack(seq) + block_hash, db=self.lru)
            meta.used_bytes -= size
        txn.delete(block_hash, db=self.atime)
        if self.parents is not None:
            txn.delete(block_hash, db=self.parents)
        return txn.delete(block_hash, db=self.blocks)

    def evict_oldest(self, txn, meta: Meta, spare: Callable[[bytes], bool] | None = None) -> bytes | None:
        """Drop the least recently used block that `spare` (if given) does not keep and return its hash; None
        when nothing is left to drop."""
        cursor = txn.cursor(db=self.lru)
        if not cursor.first():
            if not txn.stat(self.atime)["entries"]:
                meta.used_bytes = 0  # nothing is held: whatever the counter said, nothing is used
            return None  # (or every block left is pinned)
        block_hash = bytes(cursor.key())[_U64.size:]
        while spare is not None and spare(block_hash):
            if not cursor.next():
                return None  # every block left is spared or pinned
            block_hash = bytes(cursor.key())[_U64.size:]
        cursor.delete()
        self.delete(txn, meta, block_hash)
        self.evictions += 1
        return block_hash

    # -- pins, inside a write transaction ------------------------------------------------------

    def is_pinned(self, txn, block_hash: bytes) -> bool:
        return self.pinned is not None and txn.get(block_hash, db=self.pinned) is not None

    def pin(self, txn, meta: Meta, owner: str, block_hashes, info: dict) -> None:
        """Pin blocks for `owner` (replacing its pin): they leave the LRU order until unpinned."""
        self.unpin(txn, meta, owner)
        block_hashes = list(dict.fromkeys(block_hashes))
        record = {"block_hashes": [h.hex() for h in block_hashes], "info": info}
        txn.put(owner.encode("utf-8"), json.dumps(record).encode("utf-8"), db=self.pins)
        for h in block_hashes:
            count = read_u64(txn, self.pinned, h)
            txn.put(h, _U64.pack(count + 1), db=self.pinned)
            raw = txn.get(h, db=self.atime)
            if count == 0 and raw is not None and len(raw) == _ATIME.size:
                txn.delete(_U64.pack(_ATIME.unpack(bytes(raw))[0]) + h, db=self.lru)

    def unpin(self, txn, meta: Meta, owner: str) -> bool:
        """Drop `owner`'s pin; blocks no other owner pins rejoin the LRU order as most recently used."""
        raw = txn.get(owner.encode("utf-8"), db=self.pins)
        if raw is None:
            return False
        for h in _pin_record(bytes(raw))[0]:
            count = read_u64(txn, self.pinned, h)
            if count > 1:
                txn.put(h, _U64.pack(count - 1), db=self.pinned)
                continue
            txn.delete(h, db=self.pinned)
            self.touch(txn, meta, h)
        txn.delete(owner.encode("utf-8"), db=self.pins)
        return True

    def read_pins(self, txn) -> dict[str, tuple[list[bytes], dict]]:
        """owner -> (block hashes, info) of every pin; works in a read transaction too."""
        if self.pins is None:
            return {}
        pins = {}
        for owner, raw in txn.cursor(db=self.pins):
            try:
                pins[bytes(owner).decode("utf-8")] = _pin_record(bytes(raw))
            except ValueError:
                logger.warning("disk tier: ignoring a damaged pin record in '%s'", self.path)
        return pins

    def clear(self, txn) -> int:
        """Drop every block and every pin."""
        entries = txn.stat(self.blocks)["entries"]
        for db in (self.blocks, self.atime, self.lru, self.pins, self.pinned, self.parents):
            if db is not None:
                txn.drop(db, delete=False)
        Meta(used_bytes=0, next_seq=read_u64(txn, self.meta, b"next_seq")).write(txn, self.meta)
        return entries


def _pin_record(raw: bytes) -> tuple[list[bytes], dict]:
    """(block hashes, info) of a stored pin; ValueError if it is not one."""
    try:
        record = json.loads(raw)
        return [bytes.fromhex(h) for h in record["block_hashes"]], dict(record["info"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a pin record: {exc}") from None


# ---------------------------------------------------------------------------------- administration


def read_store_stats(path: str) -> dict:
    """Entries, used bytes, capacity and file size of the store at `path`, without knowing its layout.

    Needs only read access. Raises StoreDamaged (one line) for a store that is not safe to read.
    """
    path = os.path.abspath(os.path.expanduser(str(path)))
    store = LmdbStore.open_existing(path, readonly=True)
    try:
        fmt = store.format()
        with store.begin() as txn:
            return {
                "path": path,
                "format": fmt,
                "entries": txn.stat(store.blocks)["entries"],
                "used_bytes": read_u64(txn, store.meta, b"used_bytes"),
                "capacity_bytes": read_u64(txn, store.meta, b"capacity_bytes"),
                "file_bytes": data_file_bytes(path),
                "pins": len(store.read_pins(txn)),
                "pinned_blocks": txn.stat(store.pinned)["entries"] if store.pinned is not None else 0,
            }
    finally:
        store.close()


@dataclass
class ClearedStore:
    blocks: int                    # blocks removed from a healthy store
    damage: Optional[str] = None   # why the store's files were removed instead (it was damaged)


def clear_store(path: str) -> ClearedStore:
    """Remove every block from the store at `path`. A damaged store (one that does not pass the
    integrity check) cannot be opened safely: its files are removed instead, leaving no store."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        store = LmdbStore.open_existing(path, readonly=False)
    except StoreDamaged as e:
        os.remove(data_file(path))
        remove_lock_file(path)
        return ClearedStore(blocks=0, damage=str(e))
    try:
        with store.begin(write=True) as txn:
            return ClearedStore(blocks=store.clear(txn))
    finally:
        store.close()
