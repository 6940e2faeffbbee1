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
  cascade to disk. The store jobs are tiers/write_down.py's. Either way a block is never overwritten while a
  copy from it is in flight: the pool calls `_on_device_evict` before it returns a reused block, and that
  waits for the block's copy. A block being loaded into is held by its request until the load has landed,
  so it is never reused either.
- `persist()` (idle time, close) writes every block still held only above the disk down to it
  (tiers/persist.py), so a later process on the same disk path finds what this one computed.
- Pins (pinned documents, tiers/pins.py): `pin` copies an owner's blocks into every lower tier that
  lacks them and pins them there, so no LRU eviction below the device drops them.
- `probe_loads` times loads from a lower tier at start-up (tiers/load_probe.py).
- Block events (tiers/block_events.py), when a listener is given: the hierarchy reports the device
  tier's (a block cached, a cached block's slot reused, the device cache cleared) and hands the
  listener to each lower tier, which reports its own puts, evictions, drops and clears.
"""
from __future__ import annotations

import atexit
import copy
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvstrata.tiers.base import LOWER_TIER_NAMES, TIER_NAMES, LowerTier, Pin, TierStats, close_at_exit
from kvstrata.tiers.block_events import AllBlocksCleared, BlockEventListener, BlockRemoved, stored_runs
from kvstrata.tiers.block_pool import BlockPool, KVCacheBlock
from kvstrata.tiers.load_probe import probe_loads
from kvstrata.tiers.persist import write_missing_to_disk
from kvstrata.tiers.pins import TierPins
from kvstrata.tiers.policy import OFFLOAD_POLICIES, TierPolicy  # noqa: F401 - OFFLOAD_POLICIES re-exported
from kvstrata.tiers.transfer import LentBlocks, Transfer, TransferEngine
from kvstrata.tiers.write_down import CachedBlock, WriteDowns


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
                 event_listener: BlockEventListener | None = None, offload_answers: bool = False):
        self.policy = TierPolicy(pool, cpu, disk, remote, offload, offload_answers)
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
        self.write_downs = WriteDowns(self.transfers, self._count_write_downs)
        self._pins = TierPins(pool, self.lower_tiers, self.write_downs)
        # Something was cached since the disk tier last held everything (see `persist`).
        self._unpersisted = False
        pool.on_evict = self._on_device_evict
        if cpu is not None and disk is not None:
            cpu.on_evict = self._on_cpu_evict
        self.event_listener = event_listener
        for tier in self.lower_tiers:
            tier.event_listener = event_listener
            if event_listener is not None:  # a disk store reopened holds blocks this listener has not heard of
                tier.report_contents()
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
                       found_in: Sequence[str] | None = None, parent: bytes | None = None,
                       prompt_blocks: int | None = None) -> PrefixLoad:
        """Find the longest cached prefix of the chain in any tier, hold all of it and start loading
        the part found below the device. Call `finish_prefix` once the result is `ready`.
        `found_in` is a `locate` of the same chain just made (the caller chose where to cut it), or None.
        `block_tokens` need only be given (not None) for the blocks found below the device: only theirs are read.
        `parent` is the hash of the block before the chain's first when it does not start the chain.
        `prompt_blocks`: how many leading blocks of the chain are its request's prompt (None: all); device hits
        past them are the request's own answer, found again after a preemption: no later prompt's reuse.

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
        self.policy.device_blocks_reused(b for b in blocks[:prompt_blocks] if b is not None)
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
        """(blocks, seconds) of one load per size in `sizes` from `tier` to the device, timed as a promotion moves
        them (tiers/load_probe.py): throwaway blocks, only in free room, no block events."""
        return probe_loads(self.pool, self.kv_cache, self.transfers, tier, sizes, self.cpu)

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
        request's closer tier, by a store job in the background: on the load's path, that copy and the
        evictions to disk it cascades into cost the load much of its time under memory pressure.
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
                     num_full_blocks: int, num_prompt_blocks: int | None = None) -> list[KVCacheBlock]:
        """Cache a request's newly full blocks on the device (their K/V are computed in this step).

        `block_tokens` holds the token ids of blocks[num_cached_blocks:num_full_blocks] only. Blocks from
        `num_prompt_blocks` on hold a generated token (None: none does): the policy keeps them on the device.
        """
        newly = self.pool.cache_full_blocks(list(blocks), list(block_hashes), num_cached_blocks, num_full_blocks)
        newly_ids = {b.block_id for b in newly}
        self._unpersisted |= bool(newly)
        first_answer = num_full_blocks if num_prompt_blocks is None else num_prompt_blocks
        answer_ids = {b.block_id for b in blocks[first_answer:num_full_blocks]}
        self.policy.block_computed([b for b in newly if b.block_id not in answer_ids],
                                   [b for b in newly if b.block_id in answer_ids])
        stored = []
        for k in range(num_cached_blocks, num_full_blocks):
            block = blocks[k]
            if block.block_id not in newly_ids:
                continue  # the same content is already cached in another block
            self.write_downs.cached[block.block_id] = CachedBlock(tuple(block_tokens[k - num_cached_blocks]),
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
            self.write_downs.cached.pop(block_id, None)
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
                self.write_downs.cached[block.block_id] = CachedBlock(tuple(toks), parent)
                if self.event_listener is not None:
                    stored.append((h, parent, toks))
        if stored:
            self._report_device_stored(stored)
        return newly

    def _report_device_stored(self, stored: list[tuple[bytes, bytes | None, Sequence[int]]]) -> None:
        for run in stored_runs(stored, self.block_size, "device"):
            self.event_listener(run)

    def flush_pending(self) -> int:
        """Hand the queued write-through blocks to the transfer engine in one batch (call after the
        model step that computed them); returns how many."""
        self.write_downs.let_go_of_copied()
        block_ids, hashes = self.policy.take_pending()
        if block_ids:
            self._write_down(block_ids, hashes)
        return len(block_ids)

    def _write_down(self, block_ids: list[int], hashes: list[bytes], targets: list[LowerTier] | None = None) -> None:
        """Copy device blocks down, in one store job, to `targets`: by default the policy's write-down targets (the
        CPU tier, or disk without one, and the remote tier, which shares them with other replicas)."""
        self.write_downs.store(block_ids, hashes, self.policy.write_down_targets if targets is None else targets)

    def _count_write_downs(self, tier_name: str, num_blocks: int) -> None:
        with self._counters_lock:  # (the CPU tier's cascade to disk runs on a transfer worker)
            self.counters.write_downs[tier_name] += num_blocks

    def wait_for_write_downs(self) -> None:
        """Wait until every block handed down so far is in its lower tier."""
        self.write_downs.wait()

    def _on_device_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool is about to hand out a cached block: its content must be safe below first, and
        no copy may still be reading it when the slot is overwritten."""
        self.counters.device_evictions += 1
        if self.event_listener is not None:
            self.event_listener(BlockRemoved([block_hash], "device"))
        if self.policy.device_evicting(block_id):
            self._write_down([block_id], [block_hash])
        self.write_downs.wait_before_reuse(block_id)

    def _on_cpu_evict(self, block_hash: bytes, token_ids: Sequence[int], payload: torch.Tensor,
                      parent: bytes | None) -> None:
        """CPU-tier LRU eviction cascades to disk (the disk tier copies the payload before returning).
        Runs on whichever thread put into the CPU tier (a transfer worker, mostly)."""
        target, held = self.policy.cascade_target(block_hash)
        if target is not None:
            self.write_downs.put(target, [block_hash], [token_ids], [payload], [parent], counted=not held)

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
        written = write_missing_to_disk(self.write_downs, self._device_blocks_for_below(), self.cpu, self.disk,
                                        max_blocks)
        if not written:
            self._unpersisted = False  # everything cached is on disk now
        if wait:
            self.wait_for_write_downs()
            self.disk.flush()
        return written

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
        self._pins.pin(owner, block_hashes, block_tokens, info)

    def unpin(self, owner: str) -> bool:
        """Drop the owner's pin in every lower tier; True if any tier had it."""
        return self._pins.unpin(owner)

    def pins(self) -> dict[str, Pin]:
        """Every owner's pin in any lower tier (the disk tier's survive restarts)."""
        return self._pins.pins()

    def restore_pins(self) -> None:
        """Pin in every lower tier what another one pins (after a restart the CPU tier starts empty
        while the disk tier kept its pins): the blocks are pinned there as they arrive."""
        self._pins.restore()

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

    def _device_blocks_for_below(self) -> list[tuple[bytes, int]]:
        """(hash, block id) of the device's cached blocks whose content belongs below, for persist and a reset
        that writes the device down: those computed here (`write_downs.cached`) but an answer the policy keeps
        on the device."""
        cached, writes_down = self.write_downs.cached, self.policy.writes_down
        return [(h, b.block_id) for h, b in list(self.pool.cached_block_hash_to_block.items())
                if b.block_id in cached and writes_down(b.block_id)]

    def _forget_device_blocks(self, write_down: bool) -> bool:
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.flush_pending()
        if write_down:
            cached = self._device_blocks_for_below()
            if cached:
                hashes, block_ids = map(list, zip(*cached))
                self._write_down(block_ids, hashes)
        self.wait_for_write_downs()  # nothing lands below after a clear, nor reads a reused slot
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.write_downs.forget_all()
            self.policy.device_cache_cleared()
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
