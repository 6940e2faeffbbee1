"""The tier hierarchy: walks a hash chain across device, CPU and disk, promotes hits, writes blocks down.

Mechanism lives in the tiers (how bytes move); this file holds the policy:

- Lookup walks a chain once: for each block hash ask the device pool, then the CPU tier, then disk,
  and stops at the first hash no tier holds.
- Promotion allocates device blocks for hits found below the device and copies them up
  (disk -> host -> device), then caches them in the device map like any computed block. A block that
  arrives from disk is also put in the CPU tier, so the next miss on the device is a cheap one.
- Write-down, chosen in config:
  * `write_through`: a block that becomes full and cached on the device is queued for the CPU tier
    (or disk when there is no CPU tier). The queue is written in one batch after the model step that
    computed those blocks (`flush_pending`), never before: the K/V do not exist until then. CPU-tier
    LRU evictions cascade to disk.
  * `on_evict`: nothing is copied until the device pool is about to reuse a cached block; the block
    is then copied down before its slot is handed out.
  Either way a block is never overwritten while a copy from it is pending: the pool calls
  `_on_device_evict` before it returns a reused block, and that drains the block's pending copy first.
- `persist()` (on close) writes every block still held only above the disk down to it, so a later
  process on the same disk path finds what this one computed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kvstrata.tiers.base import LowerTier, TierStats, as_bytes
from kvstrata.tiers.block_pool import BlockPool, KVCacheBlock

OFFLOAD_POLICIES = ("write_through", "on_evict")
PERSIST_BATCH_BLOCKS = 64


@dataclass
class PrefixHit:
    """The cached prefix of a request, held (ref-counted) on the device."""

    blocks: list[KVCacheBlock]
    blocks_by_tier: dict[str, int]   # how many of `blocks` each tier supplied

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class HierarchyCounters:
    query_blocks: int = 0            # blocks looked up
    hit_blocks: dict[str, int] = field(default_factory=lambda: {"device": 0, "cpu": 0, "disk": 0})
    promotions: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    promotion_failures: int = 0      # lower-tier blocks that vanished or failed verification mid-promotion
    write_downs: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    device_evictions: int = 0


class TierHierarchy:
    """Composes the device block pool and its KV tensor with the optional CPU and disk tiers."""

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, cpu: LowerTier | None = None,
                 disk: LowerTier | None = None, offload: str = "write_through"):
        if offload not in OFFLOAD_POLICIES:
            raise ValueError(f"cache.offload: unknown policy {offload!r} (use one of {', '.join(OFFLOAD_POLICIES)})")
        assert kv_cache.shape[0] == pool.num_blocks
        self.pool = pool
        self.kv_cache = kv_cache
        self.cpu = cpu
        self.disk = disk
        self.offload = offload
        self.counters = HierarchyCounters()
        # Token ids of every block cached on the device (lower tiers verify them on read).
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        # write_through: blocks cached on the device whose content is not yet below (block_id -> hash).
        self._pending: dict[int, bytes] = {}
        # Something was cached since the disk tier last held everything (see `persist`).
        self._unpersisted = False
        pool.on_evict = self._on_device_evict
        if cpu is not None and disk is not None:
            cpu.on_evict = self._on_cpu_evict

    # ------------------------------------------------------------------ lookup and promotion

    @property
    def lower_tiers(self) -> list[LowerTier]:
        return [t for t in (self.cpu, self.disk) if t is not None]

    def _walk(self, block_hashes: Sequence[bytes]) -> list[tuple[str, KVCacheBlock | None]]:
        """For each leading block of the chain, the first tier that holds it (and the device block if
        that tier is the device); stops at the first block no tier holds."""
        found: list[tuple[str, KVCacheBlock | None]] = []
        for h in block_hashes:
            block = self.pool.get_cached_block(h)
            tier = "device" if block is not None else next(
                (t.name for t in self.lower_tiers if t.contains(h)), None)
            if tier is None:
                break
            found.append((tier, block))
        return found

    def lookup(self, block_hashes: Sequence[bytes]) -> list[str]:
        """For each leading block of the chain, the name of the first tier that holds it."""
        return [tier for tier, _ in self._walk(block_hashes)]

    def acquire_prefix(self, block_hashes: Sequence[bytes],
                       block_tokens: Sequence[Sequence[int]]) -> PrefixHit:
        """Find the longest cached prefix of the chain in any tier and hold it on the device.

        Every device hit is held (touched) before anything is allocated, so that the promotions'
        new blocks can never evict a hit further along the prefix; then each run of lower-tier hits
        is promoted as one batch. If a lower-tier block turns out to be gone or corrupt, the prefix
        ends just before it and the device hits after it are released again.
        """
        found = self._walk(block_hashes)
        self.counters.query_blocks += len(block_hashes)
        self.pool.touch([block for _, block in found if block is not None])
        blocks: list[KVCacheBlock] = []
        by_tier = {"device": 0, "cpu": 0, "disk": 0}
        i = 0
        while i < len(found):
            _, block = found[i]
            if block is not None:
                blocks.append(block)
                by_tier["device"] += 1
                i += 1
                continue
            j = i
            while j < len(found) and found[j][1] is None:
                j += 1
            promoted, from_tier = self._promote(block_hashes[i:j], block_tokens[i:j])
            blocks.extend(promoted)
            for name in from_tier:
                by_tier[name] += 1
            if len(promoted) < j - i:
                unused = [b for _, b in found[j:] if b is not None]
                self.pool.free_blocks(list(reversed(unused)))
                break
            i = j
        for name, n in by_tier.items():
            self.counters.hit_blocks[name] += n
        return PrefixHit(blocks=blocks, blocks_by_tier=by_tier)

    def _promote(self, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]]
                 ) -> tuple[list[KVCacheBlock], list[str]]:
        """Copy a run of lower-tier blocks into fresh device blocks; returns the leading run that made it."""
        n = min(len(hashes), self.pool.num_free_blocks)
        if n == 0:
            return [], []
        new_blocks = self.pool.get_new_blocks(n)
        served_from: list[str | None] = [None] * n
        # Ask each tier in order for what is still missing: a block evicted from the CPU tier
        # between lookup and now has cascaded to disk and is found there.
        for tier in self.lower_tiers:
            missing = [k for k in range(n) if served_from[k] is None]
            if not missing:
                break
            ok = tier.get([hashes[k] for k in missing], [tokens[k] for k in missing],
                          [as_bytes(self.kv_cache[new_blocks[k].block_id]) for k in missing])
            for k, served in zip(missing, ok):
                if served:
                    served_from[k] = tier.name
        n_ok = next((k for k in range(n) if served_from[k] is None), n)
        if n_ok < n:
            self.counters.promotion_failures += 1
            # The blocks that found no content go back to the free queue, uncached.
            self.pool.free_blocks(list(reversed(new_blocks[n_ok:])))
        promoted = new_blocks[:n_ok]
        names = [s for s in served_from[:n_ok]]  # type: ignore[misc]
        self._cache_on_device(promoted, hashes[:n_ok], tokens[:n_ok])
        for name in names:
            self.counters.promotions[name] += 1
        from_disk = [k for k in range(n_ok) if names[k] == "disk"]
        if from_disk and self.cpu is not None:
            self.cpu.put([hashes[k] for k in from_disk], [tokens[k] for k in from_disk],
                         [as_bytes(self.kv_cache[promoted[k].block_id]) for k in from_disk])
        return promoted, names  # type: ignore[return-value]

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
        for k in range(num_cached_blocks, num_full_blocks):
            block = blocks[k]
            if block.block_id not in newly_ids:
                continue  # the same content is already cached in another block
            self._block_tokens[block.block_id] = tuple(block_tokens[k - num_cached_blocks])
            if self.offload == "write_through" and self.lower_tiers:
                self._pending[block.block_id] = block.block_hash
        return newly

    def _cache_on_device(self, blocks: list[KVCacheBlock], hashes: Sequence[bytes],
                         tokens: Sequence[Sequence[int]]) -> None:
        """Promoted blocks are already below: cache them without queueing a write-down."""
        self.pool.cache_full_blocks(blocks, list(hashes), 0, len(blocks))
        self._unpersisted |= bool(blocks)
        for block, toks in zip(blocks, tokens):
            self._block_tokens[block.block_id] = tuple(toks)

    def flush_pending(self) -> int:
        """Write the queued write-through blocks down in one batch (call after the model step)."""
        if not self._pending:
            return 0
        items = [(bid, h) for bid, h in self._pending.items()]
        self._pending.clear()
        self._write_down([bid for bid, _ in items], [h for _, h in items])
        return len(items)

    def _write_down(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        target = self.cpu if self.cpu is not None else self.disk
        if target is None:
            return
        target.put(list(hashes), [self._block_tokens[b] for b in block_ids],
                   [as_bytes(self.kv_cache[b]) for b in block_ids])
        self.counters.write_downs[target.name] += len(block_ids)

    def _on_device_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool is about to hand out a cached block: make sure its content is safe below first."""
        self.counters.device_evictions += 1
        pending = self._pending.pop(block_id, None)
        if pending is not None or self.offload == "on_evict":
            self._write_down([block_id], [block_hash])
        self._block_tokens.pop(block_id, None)

    def _on_cpu_evict(self, block_hash: bytes, token_ids: Sequence[int], payload: torch.Tensor) -> None:
        """CPU-tier LRU eviction cascades to disk (the disk tier copies the payload before returning)."""
        assert self.disk is not None
        if not self.disk.contains(block_hash):
            self.disk.put([block_hash], [token_ids], [payload])
            self.counters.write_downs["disk"] += 1

    def persist(self, max_blocks: int | None = None, wait: bool = True) -> int:
        """Write cached blocks that the disk tier lacks down to it, device first, then CPU.

        Returns how many were handed to the disk tier. With `max_blocks`, at most that many: an idle
        server calls this repeatedly, in small chunks, so that a new request never waits long
        behind it. `wait` waits until the disk tier has committed them.
        """
        self.flush_pending()
        if self.disk is None or not self._unpersisted:
            return 0
        missing = itertools.islice(self._blocks_missing_on_disk(), max_blocks)
        written = 0
        # batches of a bounded size: the disk tier encodes a whole batch before queueing it
        while batch := list(itertools.islice(missing, PERSIST_BATCH_BLOCKS)):
            hashes, tokens, payloads = zip(*batch)
            self.disk.put(hashes, tokens, payloads)
            written += len(batch)
        self.counters.write_downs["disk"] += written
        if not written:
            self._unpersisted = False  # everything cached is on disk now
        if wait:
            self.disk.flush()
        return written

    def _blocks_missing_on_disk(self) -> Iterator[tuple[bytes, tuple[int, ...], torch.Tensor]]:
        """(hash, token ids, payload) of cached blocks the disk tier lacks: device first, then CPU.
        Lazy, so that a small chunk stops asking the disk tier as soon as it is full."""
        seen: set[bytes] = set()
        device = ((h, self._block_tokens[b.block_id], as_bytes(self.kv_cache[b.block_id]))
                  for h, b in list(self.pool.cached_block_hash_to_block.items()) if b.block_id in self._block_tokens)
        cpu = self.cpu.blocks() if self.cpu is not None else ()
        for h, t, p in itertools.chain(device, cpu):
            if h not in seen and not self.disk.contains(h):
                seen.add(h)
                yield h, t, p

    def clear_device_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self._block_tokens.clear()
            self._pending.clear()
        return ok

    def stats(self) -> dict:
        """Per-tier usage and counters, plus the hierarchy's own counters."""
        dev = TierStats(name="device", capacity_blocks=self.pool.num_blocks,
                        capacity_bytes=self.kv_cache.numel() * self.kv_cache.element_size())
        dev.used_blocks = self.pool.num_blocks - self.pool.num_free_blocks
        dev.used_bytes = dev.used_blocks * (dev.capacity_bytes // max(self.pool.num_blocks, 1))
        dev.hits = self.counters.hit_blocks["device"]
        dev.misses = self.counters.query_blocks - dev.hits
        dev.evictions = self.counters.device_evictions
        dev.extra = {"cached_blocks": len(self.pool.cached_block_hash_to_block)}
        tiers = {"device": dev}
        for tier in self.lower_tiers:
            tiers[tier.name] = tier.stats()
        return {"tiers": tiers, "counters": self.counters}

    def close(self) -> None:
        self.persist()
        for tier in self.lower_tiers:
            tier.close()
