"""The tier hierarchy: walks a hash chain across device, CPU, disk and remote, promotes hits, writes blocks down.

What to find where and what to write down where is the tier policy's (tiers/policy.py, torch-free, which
`kvstrata plan` replays); how bytes are stored is the tiers', how they move (off the step thread) the transfer
engine's. This file applies the policy's answers to the bytes:

- Lookup is the policy's walk (`locate`, `locate_many`, `relocate_on_device`), each lower tier asked with
  one `count_prefixes` per run (one lock or read transaction, one remote round trip for many chains).
- Promotion is asynchronous and has two halves. `acquire_prefix` holds every block of the prefix
  (device hits ref-counted, lower-tier hits held in their tier so that no write-down evicts them),
  allocates device blocks for the lower-tier hits and starts one load of all of them. The request
  waits; `finish_prefix`, called once the load has landed, caches the arrived blocks on the device,
  releases the holds and returns the prefix, which ends at the first block that could not be
  served (gone or failing verification): the rest is recomputed. A block that arrives from disk or
  the remote tier is also put in the CPU tier, so the next miss on the device is a cheap, local one.
- Write-down (`offload`, decided by the policy): `write_through` queues each block computed and cached
  on the device, and the queue is handed to the transfer engine in one batch after the model step that
  computed those blocks (`flush_pending`), never before: the K/V do not exist until then. `on_evict`
  copies a block down only when the device pool is about to reuse its slot. CPU-tier LRU evictions
  cascade to disk. Either way a block is never overwritten while a copy from it is in flight: the pool calls
  `_on_device_evict` before it returns a reused block, and that waits for the block's copy. A block
  being loaded into is held by its request until the load has landed, so it is never reused either.
- `persist()` (idle time, close) writes every block still held only above the disk down to it, so a
  later process on the same disk path finds what this one computed.
- Pins (pinned documents): `pin` copies an owner's blocks into every lower tier that lacks them and
  pins them there, so no LRU eviction below the device drops them; on the device they stay ordinary
  cached blocks (evicted down to the CPU tier, which keeps them). What may be pinned is the
  caller's policy (engine/documents.py).
- Block events (tiers/block_events.py), when a listener is given: the hierarchy reports the device
  tier's (a block cached, a cached block's slot reused, the device cache cleared) and hands the
  listener to each lower tier, which reports its own puts, evictions, drops and clears.
"""
from __future__ import annotations

import atexit
import copy
import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kvstrata.tiers.base import LOWER_TIER_NAMES, TIER_NAMES, LowerTier, Pin, TierStats, close_at_exit
from kvstrata.tiers.block_events import AllBlocksCleared, BlockEventListener, BlockRemoved, BlockStored
from kvstrata.tiers.block_pool import BlockPool, KVCacheBlock
from kvstrata.tiers.policy import OFFLOAD_POLICIES, TierPolicy  # noqa: F401 - OFFLOAD_POLICIES re-exported
from kvstrata.tiers.transfer import LentBlocks, Transfer, TransferEngine

logger = logging.getLogger("kvstrata")
PERSIST_BATCH_BLOCKS = 64


@dataclass
class PrefixHit:
    """The cached prefix of a request, held (ref-counted) on the device."""

    blocks: list[KVCacheBlock]
    tiers: list[str]   # per block, the tier that supplied it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def blocks_by_tier(self) -> dict[str, int]:
        """How many of `blocks` each tier supplied."""
        return {t: self.tiers.count(t) for t in TIER_NAMES}


@dataclass(eq=False)
class PrefixLoad:
    """A prefix between lookup and landing. Every block in it is held: device hits by their
    ref count, lower-tier hits in their tier and by the device block they are being copied into."""

    block_hashes: list[bytes]
    block_tokens: list[Sequence[int] | None]  # per leading block; None for some device hits (never read)
    found_in: list[str]                 # per leading block, the tier the walk found it in
    blocks: list[KVCacheBlock]          # per leading block, the device block holding or receiving it
    below: list[int]                    # positions of the blocks found below the device
    served_from: list[str | None]       # per position in `below`: the tier that served it (set by the load)
    transfer: Transfer | None = None
    # seconds each lower tier spent in its reads for this load (set by the load; splits the request's load
    # time in its receipt and prices later loads)
    read_s: dict[str, float] = field(default_factory=dict)
    # the hash of the block before the first one (a tail's head ends there): its KV events' parent
    parent: bytes | None = None
    hit: PrefixHit | None = None  # what `finish_prefix` made of it, once called

    @property
    def ready(self) -> bool:
        """Nothing is in flight any more: `finish_prefix` may be called."""
        return self.transfer is None or self.transfer.done


@dataclass
class HierarchyCounters:
    """Blocks, each; see `LLMEngine.stats` for what the engine exports."""

    # Blocks copied up to the device from each lower tier, and used in a request's prefix.
    promotions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIER_NAMES, 0))
    # Blocks found below the device at lookup that could not be served at load (gone, corrupt, a fault).
    promotion_failures: int = 0
    # Blocks handed down to each lower tier (write-through, on_evict, CPU-tier cascade, persist).
    write_downs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIER_NAMES, 0))
    # Cached device blocks whose slot was reused for other content.
    device_evictions: int = 0


class TierHierarchy:
    """Composes the device block pool and its KV tensor with the optional CPU, disk and remote tiers."""

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, cpu: LowerTier | None = None,
                 disk: LowerTier | None = None, offload: str = "write_through",
                 transfers: TransferEngine | None = None, remote: LowerTier | None = None,
                 event_listener: BlockEventListener | None = None):
        self.policy = TierPolicy(pool, cpu, disk, remote, offload)
        assert kv_cache.shape[0] == pool.num_blocks
        self.pool = pool
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]  # block-major: [num_blocks, num_layers, 2, block_size, heads, head_dim]
        self.cpu = cpu
        self.disk = disk
        self.remote = remote
        self.offload = offload
        self.transfers = transfers or TransferEngine(kv_cache)
        self.counters = HierarchyCounters()
        # Counters the transfer workers update too (the CPU tier's cascade to disk runs on them).
        self._counters_lock = threading.Lock()
        # Every block cached on the device: its token ids (lower tiers verify them on read) and the hash
        # of the block before it in its chain (None: the chain's first), which block events name.
        self._cached: dict[int, _CachedBlock] = {}
        # device block id -> the store job last copying it down; waited for before the slot is reused.
        self._stores_in_flight: dict[int, Transfer] = {}
        # those jobs, in submission order (the order they finish in): let go of from the front once copied,
        # so that a step does not scan every block of a backlog of write-downs
        self._store_jobs: deque[Transfer] = deque()
        # Something was cached since the disk tier last held everything (see `persist`).
        self._unpersisted = False
        pool.on_evict = self._on_device_evict
        if cpu is not None and disk is not None:
            cpu.on_evict = self._on_cpu_evict
        self.event_listener = event_listener
        for tier in self.lower_tiers:
            tier.event_listener = event_listener
        # A process that exits without closing still writes its cached blocks down, before the tiers close
        # themselves (a write-down in flight then failed on a closed disk tier, and its blocks were lost).
        self._closed = False
        self._atexit = close_at_exit(self)

    # ------------------------------------------------------------------ lookup and promotion

    @property
    def lower_tiers(self) -> list[LowerTier]:
        return [t for t in (self.cpu, self.disk, self.remote) if t is not None]

    def locate(self, block_hashes: Sequence[bytes]) -> list[str]:
        """`TierPolicy.locate`: for each leading block of the chain, the first tier that holds it."""
        return self.policy.locate(block_hashes)

    def locate_many(self, chains: Sequence[Sequence[bytes]]) -> list[list[str]]:
        """`TierPolicy.locate_many`: `locate` of each chain, each lower tier asked once a round for all of them."""
        return self.policy.locate_many(chains)

    def relocate_on_device(self, block_hashes: Sequence[bytes], found: Sequence[str]) -> list[str]:
        """`TierPolicy.relocate_on_device`: an earlier `locate` with the device's part read again."""
        return self.policy.relocate_on_device(block_hashes, found)

    def acquire_prefix(self, block_hashes: Sequence[bytes], block_tokens: Sequence[Sequence[int]],
                       found_in: Sequence[str] | None = None, parent: bytes | None = None) -> PrefixLoad:
        """Find the longest cached prefix of the chain in any tier, hold all of it and start loading
        the part found below the device. Call `finish_prefix` once the result is `ready`.
        `found_in` is a `locate` of the same chain just made (the caller chose where to cut it), or None.
        `block_tokens` need only be given (not None) for the blocks found below the device: only theirs are read.
        `parent` is the hash of the block before the chain's first when it does not start the chain.

        Order of operations: device hits are held first and lower-tier hits are held in their tier,
        so that the allocation for the load (which may evict device blocks and write them down,
        which may evict CPU blocks) can take neither. A prefix needing more device blocks than are
        free ends where the room ends.
        """
        found_in = list(self.locate(block_hashes) if found_in is None else found_in)
        blocks: list[KVCacheBlock | None] = [
            block if t == "device" else None for block, t in zip(self.pool.get_cached_blocks(block_hashes), found_in)]
        self.pool.touch([b for b in blocks if b is not None])
        below = [k for k, t in enumerate(found_in) if t != "device"]
        room = self.pool.num_free_blocks
        if len(below) > room:
            end = below[room]
            self.pool.free_blocks(list(reversed([b for b in blocks[end:] if b is not None])))
            found_in, blocks, below = found_in[:end], blocks[:end], below[:room]
        load = PrefixLoad(list(block_hashes[:len(found_in)]), list(block_tokens[:len(found_in)]), found_in,
                          blocks, below, [None] * len(below), parent=parent)  # type: ignore[arg-type]
        if not below:
            return load
        self._hold_below(load, hold=True)
        for k, block in zip(below, self.policy.blocks_for_load(len(below))):
            load.blocks[k] = block
        load.transfer = self.transfers.load([load.blocks[k].block_id for k in below],
                                            functools.partial(self._read_below, load),
                                            functools.partial(self._lend_below, load))
        return load

    def probe_loads(self, tier: LowerTier, sizes: Sequence[int]) -> list[tuple[int, float]]:
        """(blocks, seconds) of one load per size in `sizes` from `tier` to the device, timed as a
        promotion moves them: throwaway blocks (random keys) are put into the tier, loaded into free
        device blocks and dropped again. A size that cannot be measured (more blocks than the device
        or the tier has free, blocks the tier does not serve back, a fault) is left out. The probe
        never costs the tier a block of the user's: only free room is used (a full tier, or one sized
        by its server, as the remote tier is, is not probed), and the throwaway blocks are no block events."""
        stats = tier.stats()
        room = min(self.pool.num_free_blocks, stats.capacity_blocks - stats.used_blocks)
        num_blocks = max((s for s in sizes if s <= room), default=0)
        if num_blocks < 1:
            return []
        device_blocks = self.pool.get_new_blocks(num_blocks)
        block_ids = [b.block_id for b in device_blocks]
        hashes = [os.urandom(16) for _ in block_ids]
        tokens = [tuple(range(self.kv_cache.shape[3]))] * num_blocks  # [blocks, layers, 2, block_size, ...]

        def fill(start: int, dests: list[torch.Tensor]) -> list[bool]:
            return tier.get(hashes[start:start + len(dests)], tokens[start:start + len(dests)], dests)

        def lend(start: int, n: int) -> LentBlocks | None:  # as a promotion from the CPU tier moves them
            return self.cpu.lend(hashes[start:start + n], tokens[start:start + n]) if tier is self.cpu else None

        timed = []
        listener, tier.event_listener = tier.event_listener, None
        try:
            # tiers are given host payloads, as write-downs give them (the KV cache may be on a GPU)
            payload = torch.zeros(self.kv_cache[0].numel() * self.kv_cache.element_size(), dtype=torch.uint8)
            tier.put(hashes, tokens, [payload] * num_blocks)
            tier.flush()
            for n in sorted(s for s in sizes if s <= num_blocks):
                job = self.transfers.load(block_ids[:n], fill, lend)
                job.wait()
                if job.failed or not all(job.served):
                    break
                timed.append((n, job.seconds))
        except Exception:  # noqa: BLE001 - a tier that cannot be probed is priced when it is used
            logger.warning("kvstrata: could not time reads from the %s tier at start-up", tier.name, exc_info=True)
        finally:
            for h in hashes:
                tier.discard(h)
            tier.flush()  # the discards are done before anyone listens again
            tier.event_listener = listener
            self.pool.free_blocks(device_blocks)
        return timed

    def _hold_below(self, load: PrefixLoad, hold: bool) -> None:
        self.policy.hold_below([load.block_hashes[k] for k in load.below], [load.found_in[k] for k in load.below],
                               hold)

    def _lend_below(self, load: PrefixLoad, start: int, n: int) -> LentBlocks | None:
        """On the load worker: the blocks `load.below[start:start + n]` lent by the CPU tier, if it
        has them all (the transfer engine copies them straight from its slab), else None."""
        if self.cpu is None:
            return None
        positions = load.below[start:start + n]
        started = time.perf_counter()
        lent = self.cpu.lend([load.block_hashes[k] for k in positions], [load.block_tokens[k] for k in positions])
        if lent is not None:
            with self._counters_lock:
                load.read_s["cpu"] = load.read_s.get("cpu", 0.0) + time.perf_counter() - started
            load.served_from[start:start + n] = ["cpu"] * n
        return lent

    def _read_below(self, load: PrefixLoad, start: int, dests: list[torch.Tensor]) -> list[bool]:
        """On the load worker: fill `dests` with the blocks `load.below[start:]` from the lower tiers.

        Each tier in order is asked for what is still missing: a block evicted from the CPU tier
        since the lookup has cascaded to disk and is found there. (What disk and the remote tier
        serve goes to the CPU tier once the load has landed: `finish_prefix`.)
        """
        positions = load.below[start:start + len(dests)]
        hashes = [load.block_hashes[k] for k in positions]
        tokens = [load.block_tokens[k] for k in positions]
        served_from: list[str | None] = [None] * len(positions)
        for tier in self.lower_tiers:
            missing = [m for m, s in enumerate(served_from) if s is None]
            if not missing:
                break
            started = time.perf_counter()
            ok = tier.get([hashes[m] for m in missing], [tokens[m] for m in missing], [dests[m] for m in missing])
            with self._counters_lock:  # the parts of one load are read on several threads at once
                load.read_s[tier.name] = load.read_s.get(tier.name, 0.0) + time.perf_counter() - started
            for m, served in zip(missing, ok):
                if served:
                    served_from[m] = tier.name
        load.served_from[start:start + len(dests)] = served_from
        return [s is not None for s in served_from]

    def finish_prefix(self, load: PrefixLoad) -> PrefixHit:
        """The prefix of a landed load, held on the device: it ends at the first block not served.

        Every block that arrived is cached on the device (it is verified), also past the end, so a
        later request finds it; the blocks past the end are released, the lower-tier holds too. The
        blocks that came from disk or the remote tier are copied into the CPU tier too, the next
        request's closer tier, by a store job in the background: copied there on the load's path, with
        the evictions to disk that it cascades into, they took 10-120 ms of each 62-block part of a
        2000-token hit's load under memory pressure.
        """
        assert load.ready, "finish_prefix before the load has landed"
        if load.hit is not None:  # finished already: as soon as it landed, while the device computed a step
            return load.hit
        served = dict(zip(load.below, load.served_from))
        if None in load.served_from:
            end = next(k for k in load.below if served[k] is None)
            arrived = [k for k in load.below if served[k] is not None]
        else:  # (the usual case: every block arrived)
            end, arrived = len(load.found_in), load.below
        newly = self._cache_on_device([load.blocks[k] for k in arrived], [load.block_hashes[k] for k in arrived],
                                      [load.block_tokens[k] for k in arrived],
                                      [load.block_hashes[k - 1] if k else load.parent for k in arrived])
        # the holds go before the copy up is queued: its puts then never race them (the load has read the blocks)
        self._hold_below(load, hold=False)
        up = [k for k in arrived if self.policy.copy_up_target(served[k]) is not None
              and load.blocks[k].block_id in newly]
        if up:
            self._write_down([load.blocks[k].block_id for k in up], [load.block_hashes[k] for k in up],
                             targets=[self.cpu])
        self.pool.free_blocks(list(reversed(load.blocks[end:])))
        tiers = ["device"] * end
        for k in arrived:
            if k < end:
                tiers[k] = served[k]
        hit = load.hit = PrefixHit(blocks=load.blocks[:end], tiers=tiers)
        by_tier = hit.blocks_by_tier
        with self._counters_lock:
            for name in LOWER_TIER_NAMES:
                self.counters.promotions[name] += by_tier[name]
            self.counters.promotion_failures += len(load.below) - len(arrived)
        return hit

    # ------------------------------------------------------------------ caching and write-down

    def cache_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                     block_tokens: Sequence[Sequence[int]], num_cached_blocks: int,
                     num_full_blocks: int) -> list[KVCacheBlock]:
        """Cache a request's newly full blocks on the device (their K/V are computed in this step).

        `block_tokens` holds the token ids of blocks[num_cached_blocks:num_full_blocks] only.
        """
        newly = self.pool.cache_full_blocks(list(blocks), list(block_hashes), num_cached_blocks, num_full_blocks)
        newly_ids = {b.block_id for b in newly}
        self._unpersisted |= bool(newly)
        self.policy.block_computed(newly)
        stored = []
        for k in range(num_cached_blocks, num_full_blocks):
            block = blocks[k]
            if block.block_id not in newly_ids:
                continue  # the same content is already cached in another block
            self._cached[block.block_id] = _CachedBlock(tuple(block_tokens[k - num_cached_blocks]),
                                                        block_hashes[k - 1] if k else None)
            if self.event_listener is not None:
                stored.append((block_hashes[k], block_hashes[k - 1] if k else None, block_tokens[k - num_cached_blocks]))
        if stored:
            self._report_device_stored(stored)
        return newly

    def uncache_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Forget the device cache entries of `blocks`, cached at allocation (as a step's blocks are) by a step that
        then failed: their K/V were never computed, so nothing of them is served or written down."""
        forgotten = self.pool.uncache_blocks(blocks)
        for block_id, _ in forgotten:
            self.policy.block_forgotten(block_id)
            self._cached.pop(block_id, None)
        if forgotten and self.event_listener is not None:
            self.event_listener(BlockRemoved([h for _, h in forgotten], "device"))

    def _cache_on_device(self, blocks: list[KVCacheBlock], hashes: Sequence[bytes],
                         tokens: Sequence[Sequence[int]], parents: Sequence[bytes | None]) -> set[int]:
        """Promoted blocks are already below: cache them without queueing a write-through. Returns the ids of
        those newly cached (a block whose content another device block caches already is not)."""
        newly = {b.block_id for b in self.pool.cache_full_blocks(blocks, list(hashes), 0, len(blocks))}
        self._unpersisted |= bool(newly)
        stored = []
        for block, h, toks, parent in zip(blocks, hashes, tokens, parents):
            if block.block_id in newly:
                self._cached[block.block_id] = _CachedBlock(tuple(toks), parent)
                if self.event_listener is not None:
                    stored.append((h, parent, toks))
        if stored:
            self._report_device_stored(stored)
        return newly

    def _report_device_stored(self, stored: list[tuple[bytes, bytes | None, Sequence[int]]]) -> None:
        """One BlockStored per run of (hash, parent hash, tokens) in which each block's parent is the
        block before it, as vLLM reports a request's newly cached blocks."""
        run: BlockStored | None = None
        for block_hash, parent, tokens in stored:
            if run is None or parent != run.block_hashes[-1]:
                if run is not None:
                    self.event_listener(run)
                run = BlockStored([], parent, [], self.block_size, "device")
            run.block_hashes.append(block_hash)
            run.token_ids.extend(tokens)
        self.event_listener(run)

    def flush_pending(self) -> int:
        """Hand the queued write-through blocks to the transfer engine in one batch (call after the
        model step that computed them); returns how many."""
        while self._store_jobs and self._store_jobs[0].copied:
            job = self._store_jobs.popleft()
            for b in job.block_ids:
                if self._stores_in_flight.get(b) is job:  # (not a later job copying the reused block down)
                    del self._stores_in_flight[b]
        block_ids, hashes = self.policy.take_pending()
        if block_ids:
            self._write_down(block_ids, hashes)
        return len(block_ids)

    def _write_down(self, block_ids: list[int], hashes: list[bytes], targets: list[LowerTier] | None = None) -> None:
        """Copy device blocks down, in one store job, to `targets`: by default the policy's write-down targets (the
        CPU tier, or disk without one, and the remote tier, which shares them with other replicas)."""
        if targets is None:
            targets = self.policy.write_down_targets
        if not targets:
            return
        tokens = [self._cached[b].tokens for b in block_ids]
        parents = [self._cached[b].parent for b in block_ids]
        job = self.transfers.store(block_ids, functools.partial(_put_run, targets, hashes, tokens, parents))
        for b in block_ids:
            self._stores_in_flight[b] = job
        self._store_jobs.append(job)
        with self._counters_lock:
            for target in targets:
                self.counters.write_downs[target.name] += len(block_ids)

    def _put_down(self, tier: LowerTier, hashes: list[bytes], tokens: list[Sequence[int]],
                  payloads: list[torch.Tensor], parents: list[bytes | None]) -> None:
        """Put host payloads into a lower tier (it copies them before returning), counted as write-downs."""
        tier.put(hashes, tokens, payloads, parents)
        with self._counters_lock:
            self.counters.write_downs[tier.name] += len(hashes)

    def wait_for_write_downs(self) -> None:
        """Wait until every block handed down so far is in its lower tier."""
        self.transfers.wait_stores()

    def _on_device_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool is about to hand out a cached block: its content must be safe below first, and
        no copy may still be reading it when the slot is overwritten."""
        self.counters.device_evictions += 1
        if self.event_listener is not None:
            self.event_listener(BlockRemoved([block_hash], "device"))
        if self.policy.device_evicting(block_id):
            self._write_down([block_id], [block_hash])
        job = self._stores_in_flight.pop(block_id, None)
        if job is not None:
            job.wait_copied()  # the step needs this slot now: the one wait on a transfer it makes
        self._cached.pop(block_id, None)

    def _on_cpu_evict(self, block_hash: bytes, token_ids: Sequence[int], payload: torch.Tensor,
                      parent: bytes | None) -> None:
        """CPU-tier LRU eviction cascades to disk (the disk tier copies the payload before returning).
        Runs on whichever thread put into the CPU tier (a transfer worker, mostly)."""
        target = self.policy.cascade_target(block_hash)
        if target is not None:
            self._put_down(target, [block_hash], [token_ids], [payload], [parent])

    def persist(self, max_blocks: int | None = None, wait: bool = True) -> int:
        """Write cached blocks that the disk tier lacks down to it, device first, then CPU.

        Returns how many were handed to the disk tier. With `max_blocks`, at most that many: an idle
        server calls this repeatedly, in small chunks, so that a new request never waits long
        behind it. `wait` waits until the disk tier has committed them.
        """
        self.flush_pending()
        self.wait_for_write_downs()  # what was handed down is below before the disk tier is asked
        if self.disk is None or not self._unpersisted:
            return 0
        missing = itertools.islice(self._blocks_missing_on_disk(), max_blocks)
        written = 0
        # batches of a bounded size: the disk tier encodes a whole batch before queueing it
        while batch := list(itertools.islice(missing, PERSIST_BATCH_BLOCKS)):
            on_device = [(h, src) for h, _, src, _ in batch if isinstance(src, int)]
            if on_device:  # one store job: a batched copy off the device, on the transfer worker
                self._write_down([b for _, b in on_device], [h for h, _ in on_device], targets=[self.disk])
            in_host = [item for item in batch if not isinstance(item[2], int)]
            if in_host:
                hashes, tokens, payloads, parents = map(list, zip(*in_host))
                self._put_down(self.disk, hashes, tokens, payloads, parents)
            written += len(batch)
        if not written:
            self._unpersisted = False  # everything cached is on disk now
        if wait:
            self.wait_for_write_downs()
            self.disk.flush()
        return written

    def _blocks_missing_on_disk(self) -> Iterator[tuple[bytes, tuple[int, ...], int | torch.Tensor, bytes | None]]:
        """(hash, token ids, device block id or host payload, parent) of cached blocks the disk tier lacks:
        device first, then CPU. Lazy, so that a small chunk stops asking the disk tier as soon as it
        is full."""
        seen: set[bytes] = set()
        device = ((h, self._cached[b.block_id].tokens, b.block_id, self._cached[b.block_id].parent)
                  for h, b in list(self.pool.cached_block_hash_to_block.items())
                  if b.block_id in self._cached)
        cpu = self.cpu.blocks() if self.cpu is not None else ()
        for h, t, p, parent in itertools.chain(device, cpu):
            if h not in seen and not self.disk.contains(h):
                seen.add(h)
                yield h, t, p, parent

    # ------------------------------------------------------------------ pins

    def pin(self, owner: str, block_hashes: Sequence[bytes], block_tokens: Sequence[Sequence[int]],
            info: dict) -> None:
        """Pin the blocks for `owner` in every lower tier, first copying in those a tier lacks (from
        the device, or another lower tier). Raises ValueError if no lower tier keeps pins (CPU or
        disk), or if a tier did not take the pin (a disk write that failed)."""
        if not any(tier.keeps_pins for tier in self.lower_tiers):
            raise ValueError("pinning needs a CPU or disk tier (cache.tiers.cpu or cache.tiers.disk)")
        self.flush_pending()
        self.wait_for_write_downs()  # write-through copies land first: fewer blocks to copy here
        for tier in self.lower_tiers:
            tier.pin(owner, block_hashes, info)  # first, so that the copies below cannot evict each other
            missing = [k for k, held in enumerate(tier.held(block_hashes)) if not held]
            self._copy_into(tier, [block_hashes[k] for k in missing], [block_tokens[k] for k in missing],
                            [block_hashes[k - 1] if k else None for k in missing])
            tier.flush()
            if owner not in tier.pins():
                raise ValueError(f"the {tier.name} tier could not record the pin of {owner} (see its write errors)")

    def _copy_into(self, tier: LowerTier, hashes: list[bytes], tokens: list[Sequence[int]],
                   parents: list[bytes | None]) -> None:
        """Copy blocks into `tier` from wherever they are: device blocks in one store job (a batched
        copy on the transfer worker, as persist does), the rest in one read per other lower tier.
        Returns once they are in; a block no tier holds is left out."""
        on_device, elsewhere = [], []
        parent_of = dict(zip(hashes, parents))
        for h, toks in zip(hashes, tokens):
            block = self.pool.get_cached_block(h)
            if block is not None and block.block_id in self._cached:
                on_device.append((block.block_id, h))
            else:
                elsewhere.append((h, toks))
        if on_device:
            block_ids, device_hashes = zip(*on_device)
            self._write_down(list(block_ids), list(device_hashes), targets=[tier])
        for source in self.lower_tiers:
            if source is tier or not elsewhere:
                continue
            held = [(h, toks) for (h, toks), ok in zip(elsewhere, source.held([h for h, _ in elsewhere])) if ok]
            if not held:
                continue
            dests = [torch.empty(source.layout.block_nbytes, dtype=torch.uint8) for _ in held]
            served = source.get([h for h, _ in held], [t for _, t in held], dests)
            found = [(h, toks, dest) for (h, toks), dest, ok in zip(held, dests, served) if ok]
            if found:
                found_hashes, found_tokens, payloads = map(list, zip(*found))
                self._put_down(tier, found_hashes, found_tokens, payloads, [parent_of[h] for h in found_hashes])
            copied = {h for h, _, _ in found}
            elsewhere = [(h, toks) for h, toks in elsewhere if h not in copied]
        self.wait_for_write_downs()

    def unpin(self, owner: str) -> bool:
        """Drop the owner's pin in every lower tier; True if any tier had it."""
        return any([tier.unpin(owner) for tier in self.lower_tiers])

    def pins(self) -> dict[str, Pin]:
        """Every owner's pin in any lower tier (the disk tier's survive restarts)."""
        pins: dict[str, Pin] = {}
        for tier in self.lower_tiers:
            pins.update(tier.pins())
        return pins

    def restore_pins(self) -> None:
        """Pin in every lower tier what another one pins (after a restart the CPU tier starts empty
        while the disk tier kept its pins): the blocks are pinned there as they arrive."""
        pins = self.pins()
        for tier in self.lower_tiers:
            held = tier.pins()
            for owner, pin in pins.items():
                if owner not in held:
                    tier.pin(owner, pin.block_hashes, pin.info)

    def blocks_by_tier(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of the blocks each tier holds now."""
        counts = {"device": sum(self.pool.get_cached_block(h) is not None for h in block_hashes)}
        for tier in self.lower_tiers:
            counts[tier.name] = sum(tier.held(block_hashes))
        return counts

    def clear_device_cache(self) -> bool:
        """Forget every cached device block, if none is in use; False, with nothing changed, if one is.
        As eviction would, `on_evict` first writes them down (write-through did already), so the tiers
        below serve them next; write-downs in flight finish first: a cleared block is reused without
        passing through `_on_device_evict`."""
        return self._forget_device_blocks(write_down=self.offload == "on_evict")

    def clear_every_tier(self) -> list[str] | None:
        """Forget every cached block in every tier, pins included, if no device block is in use (None,
        with nothing changed, if one is). Returns the lower tiers that could not be cleared (a remote
        server that is down keeps its blocks); the others are empty. A shared tier (disk, remote) is
        emptied for every process that shares it."""
        if not self._forget_device_blocks(write_down=False):
            return None
        return [tier.name for tier in self.lower_tiers if not tier.clear()]

    def _forget_device_blocks(self, write_down: bool) -> bool:
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.flush_pending()
        if write_down:
            cached = [(b.block_id, h) for h, b in self.pool.cached_block_hash_to_block.items()
                      if b.block_id in self._cached]
            if cached:
                self._write_down(*map(list, zip(*cached)))
        self.wait_for_write_downs()  # nothing lands below after a clear, nor reads a reused slot
        ok = self.pool.reset_prefix_cache()
        if ok:
            self._cached.clear()
            self.policy.device_cache_cleared()
            self._stores_in_flight.clear()
            self._store_jobs.clear()
            if self.event_listener is not None:
                self.event_listener(AllBlocksCleared("device"))
        return ok

    def stats(self) -> dict:
        """Per-tier usage and counters, plus the hierarchy's own counters. The device tier's hits and
        misses are the KV manager's (counted per admitted request); they are left 0 here."""
        dev = TierStats(name="device", capacity_blocks=self.pool.num_blocks,
                        capacity_bytes=self.kv_cache.numel() * self.kv_cache.element_size())
        dev.used_blocks = self.pool.num_blocks - self.pool.num_free_blocks
        dev.used_bytes = dev.used_blocks * (dev.capacity_bytes // max(self.pool.num_blocks, 1))
        dev.evictions = self.counters.device_evictions
        dev.extra = {"cached_blocks": len(self.pool.cached_block_hash_to_block)}
        tiers = {"device": dev}
        for tier in self.lower_tiers:
            tiers[tier.name] = tier.stats()
        with self._counters_lock:
            counters = copy.deepcopy(self.counters)
        return {"tiers": tiers, "counters": counters}

    def close(self) -> None:
        """Write every cached block down, then close the transfer engine and the tiers. Safe to call twice, and
        called at interpreter exit if the owner did not."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self.persist()
        self.transfers.close()
        for tier in self.lower_tiers:
            tier.close()



@dataclass(slots=True)
class _CachedBlock:
    """What the hierarchy keeps of a block cached on the device, for writing it down (replaced whole, never
    changed; not frozen: a frozen dataclass is built 2.5x slower, and one is built per block cached, 437 for
    a 7k-token document, on the step's path)."""

    tokens: tuple[int, ...]
    parent: bytes | None  # the hash of the block before it in its chain; None for a chain's first

def _put_run(tiers: list[LowerTier], hashes: list[bytes], tokens: list[tuple[int, ...]],
             parents: list[bytes | None], start: int, srcs: list[torch.Tensor]) -> None:
    """A store job's drain: put the blocks `start, start + 1, ...` of the job into each of `tiers`
    (each copies the payloads before returning)."""
    stop = start + len(srcs)
    for tier in tiers:
        tier.put(hashes[start:stop], tokens[start:stop], srcs, parents[start:stop])
