"""The remote tier: block records (tiers/record.py) in a Valkey or Redis server, or a cluster of them,
shared by every replica that names the same server and key prefix.

Keys are `<key_prefix>:<chain hash in hex>`. The chain hash already folds in the model identity,
dtype, block size, KV layout version and `cache_salt`, so two models, two dtypes or two tenants never
share a key; the prefix only keeps kvstrata's keys apart from anything else stored on the server.
Values are the same self-verifying records the disk tier stores: a value that does not verify (damaged,
written for another layout, another token sequence, or not ours at all) is a miss, counted as
corrupt, and deleted.

Eviction is the server's own: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (docs/tiers.md,
"Replicas sharing a remote tier"); with `ttl` every stored block also expires that long after it
was last written or read. The tier therefore keeps no capacity and holds nothing against eviction:
a block found at lookup and gone at load is a miss, and the prefix ends there.

Round trips: a lookup (`count_prefix`) is one round trip for the whole run of hashes: on one server a
script that walks the chain there and stops at the first block it lacks (one command, however long the
chain); in a cluster, whose keys lie in many slots, a pipelined EXISTS per hash (one round trip per node
holding some of them). A read (`get`) is one pipelined round trip too, made by a reader process
(tiers/remote_reader.py) where the blocks go to shared host memory, so that the replies' parsing and
the records' checks do not take the engine's interpreter lock; else, or when no reader answers, in
this process. Writes leave the caller at once: `put` encodes the records and queues them for a
writer thread that sends them in pipelined batches. The queue is bounded: a put that finds it full
is dropped and counted (a block not shared is only a recompute for another replica), never waited for.

Faults are misses. The server down or restarting, a timeout, a reset connection, a cluster node
failing over, a full server refusing writes (OOM with `noeviction`): the operation answers "not
held", the fault is counted and logged once per outage (the URL's password masked), and the tier
waits a growing backoff before it tries the server again, reconnecting then. No caller waits longer
than `timeout` for a lookup: `count_prefix` runs on a lookup thread and is abandoned (a miss) past it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional, Sequence

import redis
import torch

from kvstrata.tiers.base import BlockLayout, LowerTier, Pin, TierStats, parents_or_unknown
from kvstrata.tiers.batch_writer import BatchWriter
from kvstrata.tiers.block_events import AllBlocksCleared, BlockRemoved
from kvstrata.tiers.reader_pool import block_read, start_readers
from kvstrata.tiers.reader_process import CORRUPT, SERVED
from kvstrata.tiers.record import RecordCodec, RecordError
from kvstrata.tiers.remote_reader import FAULTS, connect, nodes_of, pipeline, read_values
from kvstrata.tiers.remote_url import DEFAULT_QUEUE_BYTES, check_url, masked_url, scrub
from kvstrata.tiers.shared_memory import locate

logger = logging.getLogger(__name__)

WRITE_BATCH_BYTES = 8 << 20       # records per pipelined write: about this many bytes
BROKEN_CHAINS_KEPT = 1 << 16      # hashes of dropped blocks remembered, so that their children are dropped too
DRAIN_S = 2.0                     # the longest close() spends sending what is still queued
BACKOFF_FIRST_S = 0.25            # after a fault, the server is left alone this long, doubling ...
BACKOFF_MAX_S = 8.0               # ... up to this
SCRIPT_RETRY_S = 60.0             # a server that refused the lookup script is offered it again after this
# A lookup on one server: how many of the keys, in order, it holds, stopping at the first it lacks. One
# command, where a pipeline of one EXISTS per hash costs the client a command's packing and its reply per
# hash, milliseconds for a long document's hundreds of hashes. Read-only
# (`no-writes`): a full server (OOM) and a read-only replica run it too.
PREFIX_SCRIPT = """#!lua flags=no-writes
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then return i - 1 end
end
return #KEYS
"""
PREFIX_SCRIPT_SHA = hashlib.sha1(PREFIX_SCRIPT.encode(), usedforsecurity=False).hexdigest()  # its name


def _is_full(error: BaseException) -> bool:
    """The server refused a write because it is at `maxmemory` and may not evict (OOM)."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("OOM")


class _Health:
    """Whether the server may be asked now. A fault starts an outage (logged once) and a backoff;
    the first success after it ends the outage (logged once). Thread-safe."""

    def __init__(self, shown_url: str):
        self.shown_url = shown_url
        self.faults = 0          # operations that failed on a fault
        self.outages = 0
        self._lock = threading.Lock()
        self._down = False
        self._backoff_s = BACKOFF_FIRST_S
        self._retry_at = 0.0

    @property
    def down(self) -> bool:
        return self._down

    def usable(self) -> bool:
        """Not in a backoff: the next operation may try the server (and is the probe, in an outage)."""
        return time.monotonic() >= self._retry_at

    def fault(self, what: str, message: str) -> None:
        with self._lock:
            self.faults += 1
            if not self._down:
                self._down = True
                self.outages += 1
                self._backoff_s = BACKOFF_FIRST_S
                logger.warning("remote tier: %s on %s failed (%s); serving misses and retrying with backoff",
                               what, self.shown_url, message)
            else:
                self._backoff_s = min(2 * self._backoff_s, BACKOFF_MAX_S)
            self._retry_at = time.monotonic() + self._backoff_s

    def ok(self) -> None:
        if not self._down:
            return
        with self._lock:
            if self._down:
                self._down = False
                self._retry_at = 0.0
                logger.warning("remote tier: %s answers again", self.shown_url)


@dataclass
class _Op:
    kind: str                       # "put" | "delete"
    key: bytes
    value: Optional[bytearray] = None
    block_hash: bytes = b""         # for its block event, when a listener is set
    token_ids: Sequence[int] = ()   # "put": the block's tokens, for its BlockStored event
    parent: Optional[bytes] = None  # "put": its parent's hash, for the same event (None: unknown)


class RemoteTier(LowerTier):
    """Blocks of `layout` on the Valkey/Redis server (or cluster, `cluster=True`) at `url`.

    `timeout` (seconds) bounds every round trip and every lookup; `ttl` (seconds, 0: none) makes
    stored blocks expire that long after their last write or read; `queue_bytes` bounds the records waiting to
    be written (beyond it, puts are dropped and counted); `read_processes` reader processes read the blocks that go
    to shared host memory (0: every read in this process). Thread-safe.
    """

    name = "remote"
    keeps_pins = False  # the server evicts by its own policy (see "pins" below)

    def __init__(self, layout: BlockLayout, url: str, *, cluster: bool = False, key_prefix: str = "kvstrata",
                 timeout: float = 0.05, ttl: float = 0.0, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 read_processes: int = 0):
        try:
            self.url = check_url(url, cluster)
        except ValueError as e:
            raise ValueError(f"cache.tiers.remote.url: {e}") from None
        if timeout <= 0:
            raise ValueError(f"cache.tiers.remote.timeout: must be positive, got {timeout}")
        if queue_bytes < 1:
            raise ValueError(f"cache.tiers.remote.queue_size: must be positive, got {queue_bytes}")
        self.layout = layout
        self.codec = RecordCodec(layout)
        self.cluster = cluster
        self.key_prefix = key_prefix
        self.timeout = float(timeout)
        self.ttl_ms = int(ttl * 1000) or None
        self.shown_url = masked_url(self.url)
        self.health = _Health(self.shown_url)
        self._client_lock = threading.Lock()
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._known_nodes: list[tuple[str, int]] = []  # a cluster's nodes, as last learned: where to reconnect
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-remote-lookup")
        self._script_refused_at: float | None = None  # when the server last refused the lookup script

        # records the queue holds at most (at least one: a smaller bound would drop every put)
        self._max_queued = max(1, queue_bytes // self.codec.record_nbytes)
        self._queued_puts = 0                 # records appended and not yet sent (or given up on)
        self._queue_full = False              # puts are being dropped for room (logged once, until one fits)
        self._broken = _RecentKeys(BROKEN_CHAINS_KEPT)  # hashes of blocks dropped lately: their children are too
        self._closed = False
        self._drain_deadline = float("inf")
        self._writes_refused = False          # since the last write the server took (log once)
        self._stats = TierStats(name=self.name)
        self._dropped_puts = 0                # queue full, or the server unreachable
        self._write_errors = 0                # the server refused them (full: OOM)
        self._writer: BatchWriter[_Op] = BatchWriter("kvstrata-remote-writer", _take_batch, self._send,
                                                     on_finished=self._sent)
        self._cond = self._writer.cond
        self._pins: dict[str, Pin] = {}
        self._readers = start_readers(read_processes, "kvstrata.tiers.remote_reader", self.name)
        self._blocks_read_by_processes = 0
        # Connect now, in the background: the first lookup then pays one round trip, not a connection.
        self._lookups.submit(self._warm_up)

    # -- the connection ----------------------------------------------------------------------

    def _connection(self) -> redis.Redis | redis.RedisCluster | None:
        """The client, created on first use and again after a fault; None while backing off."""
        if not self.health.usable():
            return None
        with self._client_lock:
            if self._client is not None:
                return self._client
            try:
                self._client, nodes = connect(self.url, self.cluster, self.timeout, self._known_nodes)
                self._known_nodes = nodes or self._known_nodes
                return self._client
            except FAULTS as e:
                error = e
        self._fault("connecting", error)  # outside the lock: a fault takes it to drop the client
        return None

    def _warm_up(self) -> None:
        client = self._connection()
        if client is not None:
            try:
                client.ping()
            except FAULTS as e:
                self._fault("connecting", e)

    def _fault(self, what: str, error: BaseException | str, reconnect: bool = True) -> None:
        """Count and (once per outage) log a fault (an error, or what a reader said of one); unless the client is
        only slow (`reconnect` False), drop it so that the next try reconnects (a cluster relearns its slots)."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.health.fault(what, scrub(message, self.url))
        if reconnect:
            self._disconnect()

    def _disconnect(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
            if client is not None:  # a cluster's nodes it knows now, failed-over ones included
                self._known_nodes = nodes_of(client) or self._known_nodes
        if client is not None:
            try:
                client.close()
            except FAULTS:
                pass

    def _key(self, block_hash: bytes) -> bytes:
        return f"{self.key_prefix}:{block_hash.hex()}".encode()

    # -- pins --------------------------------------------------------------------------------
    # The server evicts by its own policy, which a client cannot suspend per key: a pin is only
    # remembered here (so that `pins()` answers), and the blocks stay pinned in the tiers above.

    def pin(self, owner: str, block_hashes: Sequence[bytes], info: dict | None = None) -> None:
        self._pins[owner] = Pin(tuple(block_hashes), dict(info or {}))

    def unpin(self, owner: str) -> bool:
        return self._pins.pop(owner, None) is not None

    def pins(self) -> dict[str, Pin]:
        return dict(self._pins)

    # -- reads -------------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        return self.count_prefix([block_hash]) == 1

    def count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """One round trip (see the module's docstring); 0 when the answer does not come within `timeout`
        (the lookup is then abandoned and the fault counted)."""
        return self.count_prefixes([block_hashes])[0]

    def count_prefixes(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """`count_prefix` of each chain, all in one round trip, with its timeout."""
        self._check_open()
        chains = [list(chain) for chain in chains]
        if not any(chains):
            return [0] * len(chains)
        return self._ask(self._count_prefixes_now, chains, [0] * len(chains))

    def held(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """One pipelined EXISTS per hash, in one round trip, with `count_prefix`'s timeout."""
        self._check_open()
        return self._ask(self._exists_now, list(block_hashes), [False] * len(block_hashes))

    def _ask(self, lookup, items: list, missed):
        """`lookup(items)`, run on the lookup thread; `missed` when the answer does not come within `timeout`
        (the lookup is then abandoned and the fault counted) or the server is backing off."""
        if not items or not self.health.usable():
            return missed
        future = self._lookups.submit(lookup, items)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            # The lookup thread goes on and leaves its connection usable: only slow, not broken.
            future.cancel()
            self._fault("a lookup", TimeoutError(f"no answer within {self.timeout * 1000:g} ms"), reconnect=False)
            return missed

    def _count_prefixes_now(self, chains: list[list[bytes]]) -> list[int]:
        if self.cluster or not self._scripts_allowed():
            return self._count_by_exists(chains)
        client = self._connection()
        if client is None:
            return [0] * len(chains)
        try:
            counts = self._run_prefix_script(client, chains)
        except redis.ResponseError as e:  # scripting off, not permitted, or too old a server for its flags
            self._refuse_scripts(e)
            return self._count_prefixes_now(chains)
        except Exception as e:  # whatever else the client raises is a miss, never the caller's error
            self._fault("a lookup", e)
            return [0] * len(chains)
        self.health.ok()
        return [min(int(count), len(chain)) for count, chain in zip(counts, chains)]

    def _run_prefix_script(self, client, chains: list[list[bytes]]) -> list:
        """The script's answer for each chain, in one pipelined round trip (a server that does not know the script,
        a new or restarted one, is sent it once more and asked again)."""
        answers = self._prefix_pipeline(client, chains)
        if any(isinstance(a, redis.exceptions.NoScriptError) for a in answers):
            client.script_load(PREFIX_SCRIPT)
            answers = self._prefix_pipeline(client, chains)
        error = next((a for a in answers if isinstance(a, Exception)), None)
        if error is not None:
            raise error
        return answers

    def _prefix_pipeline(self, client, chains: list[list[bytes]]) -> list:
        pipe = pipeline(client)
        for chain in chains:
            pipe.evalsha(PREFIX_SCRIPT_SHA, len(chain), *map(self._key, chain))
        return pipe.execute(raise_on_error=False)

    def _count_by_exists(self, chains: list[list[bytes]]) -> list[int]:
        """`count_prefixes` by one EXISTS per hash of every chain, all in one pipelined round trip."""
        found = self._exists_now([h for chain in chains for h in chain])
        counts, start = [], 0
        for chain in chains:
            held = found[start:start + len(chain)]
            counts.append(held.index(False) if False in held else len(held))
            start += len(chain)
        return counts

    def _scripts_allowed(self) -> bool:
        refused_at = self._script_refused_at
        return refused_at is None or time.monotonic() - refused_at >= SCRIPT_RETRY_S

    def _refuse_scripts(self, error: BaseException) -> None:
        """Look up one EXISTS per hash for a while: the answers are the same, at more of the client's time."""
        if self._script_refused_at is None:  # logged once: a server that refuses it goes on refusing it
            logger.warning("remote tier: %s refused the lookup script (%s); looking blocks up one by one",
                           self.shown_url, scrub(str(error), self.url))
        self._script_refused_at = time.monotonic()

    def _exists_now(self, block_hashes: list[bytes]) -> list[bool]:
        client = self._connection()
        if client is None:
            return [False] * len(block_hashes)
        pipe = pipeline(client)
        for h in block_hashes:
            pipe.exists(self._key(h))
        try:
            found = pipe.execute()
        except Exception as e:  # whatever the client raises is a miss, never the caller's error
            self._fault("a lookup", e)
            return [False] * len(block_hashes)
        self.health.ok()
        return [bool(n) for n in found]

    def get(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            dests: Sequence[torch.Tensor]) -> list[bool]:
        """One pipelined GET (GETEX with a ttl, which restarts it) for all the blocks; each value is
        verified as it is copied into its destination. In a reader process where every destination is
        shared memory, else (or when no reader answers) here."""
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(dests)
        served = [False] * len(block_hashes)
        corrupt: list[int] = []
        todo = list(range(len(block_hashes)))
        if self._readers is not None:
            todo = self._read_in_reader(block_hashes, token_ids, dests, served, corrupt)
        if todo:
            self._read_here(todo, block_hashes, token_ids, dests, served, corrupt)
        hits = sum(served)
        with self._cond:  # reads of one load may run on several threads at once
            self._stats.hits += hits
            self._stats.misses += len(served) - hits
            self._stats.corrupt += len(corrupt)
        for i in corrupt:  # a cache never serves what it cannot verify
            logger.debug("remote tier: block %s does not verify; deleting it", block_hashes[i].hex())
        self._enqueue([_Op("delete", self._key(block_hashes[i]), block_hash=block_hashes[i]) for i in corrupt])
        return served

    def _read_here(self, todo: list[int], block_hashes, token_ids, dests, served: list[bool],
                   corrupt: list[int]) -> None:
        for i, record in zip(todo, self._read([self._key(block_hashes[i]) for i in todo])):
            if record is None:
                continue
            try:
                self.codec.decode_into(record, token_ids[i], dests[i])
                served[i] = True
            except RecordError:
                corrupt.append(i)

    def _read(self, keys: list[bytes]) -> list[bytes | None]:
        client = self._connection()
        if client is None:
            return [None] * len(keys)
        try:
            values = read_values(client, keys, self.ttl_ms)
        except Exception as e:  # likewise
            self._fault("a read", e)
            return [None] * len(keys)
        self.health.ok()
        return values

    def _read_in_reader(self, block_hashes, token_ids, dests, served: list[bool], corrupt: list[int]) -> list[int]:
        """Read the blocks through a reader process, where every destination is shared memory; returns those still
        to read here (all of them where a destination is private, or no reader answered)."""
        todo = list(range(len(block_hashes)))
        read = block_read([self._key(h) for h in block_hashes], token_ids, dests, self.codec)
        if read is None or not self._readers.usable:
            return todo
        if not self.health.usable():  # backing off: misses, as here
            return []
        request, segments = read
        reply = self._readers.read({**request, **self._reader_fields()}, segments)
        if reply is None:
            return todo
        with self._cond:
            self._blocks_read_by_processes += reply["codes"].count(SERVED)
        for i, code in enumerate(reply["codes"]):
            if code == SERVED:
                served[i] = True
            elif code == CORRUPT:
                corrupt.append(i)
        if reply["error"] is None:
            self.health.ok()
        else:
            kind, message = reply["error"]
            if kind == "fault":
                self._fault("a read", message)
            else:
                logger.warning("remote tier: a reader's read failed (%s); treating the blocks as misses",
                               scrub(message, self.url))
        return []

    def _reader_fields(self) -> dict:
        """What a reader needs to reach the server (tiers/remote_reader.py): sent with every read, so that a reader
        started in place of a dead one needs no other message. The URL travels over a private socket only."""
        return {"url": self.url, "cluster": self.cluster, "timeout": self.timeout, "ttl_ms": self.ttl_ms}

    def share(self, *dests: torch.Tensor) -> None:
        """Where `dests` (the memory reads will fill: a host KV cache, pinned staging) are shared memory, have the
        reader processes map them, and connect, now rather than at the first read."""
        segments = {place.segment for place in map(locate, dests) if place is not None}
        if self._readers is not None and segments:
            self._readers.prepare(segments, self._reader_fields())

    # -- writes ------------------------------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            srcs: Sequence[torch.Tensor], parents: Sequence[bytes | None] | None = None) -> None:
        """Queue the blocks' records for the writer; what does not fit in the queue, arrives while the server
        is unreachable, or follows a block dropped so (`_unbroken`), is dropped and counted in `dropped_puts`."""
        self._check_open()
        assert len(block_hashes) == len(token_ids) == len(srcs)
        parents = parents_or_unknown(parents, len(block_hashes))
        if not self.health.usable():
            self._dropped_puts += len(block_hashes)
            with self._cond:
                self._broken.add(block_hashes)
            return
        with self._cond:
            room = max(0, self._max_queued - self._queued_puts)
            kept = self._unbroken(block_hashes, parents)
            self._broken.add([block_hashes[i] for i in kept[room:]])
        self._note_room(len(kept) - room)
        self._dropped_puts += len(block_hashes) - len(kept)
        listening = self.event_listener is not None
        ops = [_Op("put", self._key(block_hashes[i]), self.codec.encode(token_ids[i], srcs[i]), block_hashes[i],
                   tuple(token_ids[i]) if listening else (), parents[i]) for i in kept[:room]]
        self._enqueue(ops)

    def _unbroken(self, block_hashes: Sequence[bytes], parents: Sequence[bytes | None]) -> list[int]:
        """The positions of the blocks whose chain is not broken (under `_cond`). A block whose parent was dropped
        here (no room, or no server) is found by no replica, since a lookup walks the chain from its start: sending
        it would only take the server's memory, and the writer's time when it is behind. It is dropped too, and
        remembered, so that its own children are."""
        kept = []
        for i, (block_hash, parent) in enumerate(zip(block_hashes, parents)):
            if parent is not None and parent in self._broken:
                self._broken.add([block_hash])
            else:
                self._broken.discard([block_hash])  # (sent again: its children may follow)
                kept.append(i)
        return kept

    def _enqueue(self, ops: list[_Op]) -> None:
        if not ops:
            return
        with self._cond:
            if self._writer.stopping:
                self._dropped_puts += sum(op.kind == "put" for op in ops)
                return
            for op in ops:
                if op.kind == "put":
                    if self._queued_puts >= self._max_queued:
                        self._dropped_puts += 1  # a racing put took the room: dropped, never waited for
                        continue
                    self._queued_puts += 1
                self._writer.append_locked(op)
            self._cond.notify_all()

    def _note_room(self, num_dropped: int) -> None:
        """Count the puts dropped for a full queue; say so once when it starts, and once when puts fit again."""
        if num_dropped > 0:
            self._dropped_puts += num_dropped
            if not self._queue_full:
                self._queue_full = True
                logger.warning("remote tier: the write queue for %s is full (%d blocks waiting); dropping writes, "
                               "counted in dropped_puts (cache.tiers.remote.queue_size bounds it)", self.shown_url,
                               self._max_queued)
        elif self._queue_full:
            self._queue_full = False
            logger.warning("remote tier: the write queue for %s has room again", self.shown_url)

    def _sent(self, batch: list[_Op]) -> None:
        """Under the writer's lock, once a batch is sent or given up on: its records leave the queue's bound."""
        self._queued_puts -= sum(op.kind == "put" for op in batch)

    def discard(self, block_hash: bytes) -> bool:
        client = self._connection()
        if client is None:
            return False
        try:
            deleted = bool(client.delete(self._key(block_hash)))
        except FAULTS as e:
            self._fault("a delete", e)
            return False
        if deleted and self.event_listener is not None:
            self.event_listener(BlockRemoved([block_hash], self.name))
        return deleted

    def clear(self) -> bool:
        """Delete every key under this tier's prefix (every replica's blocks, every model's), and forget
        the pins remembered here."""
        self._check_open()
        self.flush()
        self._pins.clear()
        client = self._connection()
        if client is None:
            return False
        try:
            _scan_keys(client, self.key_prefix, _unlink)
        except FAULTS as e:
            self._fault("clearing", e)
            return False
        if self.event_listener is not None:
            self.event_listener(AllBlocksCleared(self.name))
        return True

    def flush(self) -> None:
        """Wait until every record queued so far has been sent (or dropped and counted)."""
        self._writer.flush()

    def close(self) -> None:
        """Send what is queued, for at most `DRAIN_S` (what is left then is dropped and counted), stop
        the writer and disconnect. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._drain_deadline = time.monotonic() + DRAIN_S
        self._writer.stop(timeout=DRAIN_S + 2 * self.timeout + 1.0)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._readers is not None:
            self._readers.close()
        self._disconnect()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"remote tier at {self.shown_url} is closed")

    # -- the writer thread -------------------------------------------------------------------

    def _send(self, batch: list[_Op]) -> None:
        """One pipelined round trip; a fault drops the batch (counted), a full server refuses some puts.
        Past close()'s drain deadline, what is left is dropped without trying."""
        num_puts = sum(op.kind == "put" for op in batch)
        client = None if time.monotonic() > self._drain_deadline else self._connection()
        if client is None:
            self._dropped_puts += num_puts
            return
        pipe = pipeline(client)
        for op in batch:
            if op.kind == "put":
                pipe.set(op.key, memoryview(op.value), px=self.ttl_ms)  # sent as it is, not copied
            else:
                pipe.unlink(op.key)
        try:
            results = pipe.execute(raise_on_error=False)
        except Exception as e:  # likewise: the writer thread never dies
            self._fault("a write", e)
            self._dropped_puts += num_puts
            return
        self.health.ok()
        refused = [r for op, r in zip(batch, results) if op.kind == "put" and isinstance(r, Exception)]
        self._report_events(batch, results)
        self._stats.puts += num_puts - len(refused)
        if refused:
            self._write_errors += len(refused)
            if not self._writes_refused:
                self._writes_refused = True
                full = " (the server is full and may not evict: see maxmemory-policy)" if _is_full(refused[0]) else ""
                logger.warning("remote tier: %s refused %d of %d writes%s: %s; counting the ones that follow in "
                               "write_errors", self.shown_url, len(refused), num_puts, full,
                               scrub(str(refused[0]), self.url))
        elif num_puts and self._writes_refused:
            self._writes_refused = False
            logger.warning("remote tier: %s takes writes again", self.shown_url)

    def _report_events(self, batch: list[_Op], results: list) -> None:
        """What the server took: BlockStored for each record written, BlockRemoved for each key deleted
        (what the server evicts itself is never seen: its maxmemory policy does not tell)."""
        events = self._events()
        if events is None:
            return
        for op, result in zip(batch, results):
            if isinstance(result, Exception):
                continue
            if op.kind == "put":
                events.stored(op.block_hash, op.token_ids, op.parent)
            elif result:
                events.removed(op.block_hash)
        events.emit(self.event_listener)

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        """Counters only, never a round trip (the server's own usage: `INFO memory` on it)."""
        with self._cond:
            queued = self._queued_puts
        extra = {"url": self.shown_url, "cluster": self.cluster, "key_prefix": self.key_prefix,
                 "reachable": not self.health.down, "faults": self.health.faults, "outages": self.health.outages,
                 "queued_puts": queued, "dropped_puts": self._dropped_puts, "write_errors": self._write_errors,
                 "read_processes": self._readers.processes if self._readers and self._readers.usable else 0,
                 "blocks_read_by_processes": self._blocks_read_by_processes}
        return dataclasses.replace(self._stats, extra=extra)


class _RecentKeys:
    """The most recently added keys, at most `limit` of them."""

    def __init__(self, limit: int):
        self.limit = limit
        self._keys: dict[bytes, None] = {}  # in the order added

    def add(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._keys.pop(key, None)
            self._keys[key] = None
        for oldest in list(itertools.islice(self._keys, max(0, len(self._keys) - self.limit))):
            del self._keys[oldest]

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys


def _take_batch(ops: deque[_Op]) -> list[_Op]:
    """Records for one pipelined write: about `WRITE_BATCH_BYTES` of them, in queue order."""
    batch, nbytes = [], 0
    while ops and nbytes < WRITE_BATCH_BYTES:
        op = ops.popleft()
        batch.append(op)
        nbytes += len(op.value) if op.value is not None else 0
    return batch


# -- administration (`kvstrata cache stats|clear`): the blocks under a key prefix, on every node ---------------

ADMIN_TIMEOUT_S = 5.0   # a command-line scan waits longer than a serving lookup may
SCAN_BATCH = 1000       # keys per SCAN step and per pipelined round trip


@dataclass
class PrefixUsage:
    """The blocks a server (every primary of a cluster) holds under a key prefix."""

    blocks: int
    bytes: int


def prefix_usage(url: str, *, cluster: bool, key_prefix: str, timeout: float = ADMIN_TIMEOUT_S) -> PrefixUsage:
    """Count the keys under `key_prefix` and their value bytes (SCAN, then pipelined STRLEN). Raises
    ValueError, in one line with the password masked, if the server cannot be asked."""
    usage = PrefixUsage(0, 0)

    def count(client, keys: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        usage.bytes += sum(pipe.execute())
        usage.blocks += len(keys)

    _scan_prefix(url, cluster, key_prefix, timeout, count)
    return usage


def clear_prefix(url: str, *, cluster: bool, key_prefix: str, timeout: float = ADMIN_TIMEOUT_S) -> int:
    """Unlink every key under `key_prefix` (only those: the server may hold others'); returns how many.
    Raises ValueError, in one line with the password masked, if the server cannot be asked."""
    removed = 0

    def unlink(client, keys: list[bytes]) -> None:
        nonlocal removed
        removed += _unlink(client, keys)

    _scan_prefix(url, cluster, key_prefix, timeout, unlink)
    return removed


def _unlink(client, keys: list[bytes]) -> int:
    """Unlink `keys` in one pipeline (a cluster splits it by node); how many were there."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.unlink(k)
    return sum(pipe.execute())


def _scan_prefix(url: str, cluster: bool, key_prefix: str, timeout: float, each_batch) -> None:
    """`_scan_keys` through a client of its own for `url`; ValueError, in one line with the password
    masked, if the server cannot be asked."""
    url = check_url(url, cluster)
    options = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client = (redis.RedisCluster if cluster else redis.Redis).from_url(url, **options)
        try:
            _scan_keys(client, key_prefix, each_batch)
        finally:
            client.close()
    except FAULTS as e:
        message = " ".join(scrub(f"{type(e).__name__}: {e}", url).split())
        raise ValueError(f"remote tier {masked_url(url)}: {message}") from None


def _scan_keys(client, key_prefix: str, each_batch) -> None:
    """`each_batch(client, keys)` for the keys under `key_prefix`, `SCAN_BATCH` at a time (a cluster's
    SCAN visits every primary)."""
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", key_prefix) + ":*"  # the prefix matched literally
    batch = []
    for key in client.scan_iter(match=pattern, count=SCAN_BATCH):
        batch.append(key)
        if len(batch) == SCAN_BATCH:
            each_batch(client, batch)
            batch = []
    if batch:
        each_batch(client, batch)
