"""Timing loads from a lower tier at start-up, so the load policy prices a tier before its first promotion: throwaway
blocks are put into the tier, loaded into free device blocks as a promotion moves them, and dropped again."""
from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.transfer import LentBlocks, TransferEngine

logger = logging.getLogger("kvstrata")


def probe_loads(pool: BlockPool, kv_cache: torch.Tensor, transfers: TransferEngine, tier: LowerTier,
                sizes: Sequence[int], cpu: LowerTier | None = None) -> list[tuple[int, float]]:
    """(blocks, seconds) of one load per size in `sizes` from `tier` to the device. A size that cannot be measured
    (more blocks than the device or the tier has free, blocks the tier does not serve back, a fault) is left out.
    The probe never costs the tier a block of the user's: only free room is used (a full tier, or one sized by its
    server, as the remote tier is, is not probed), and the throwaway blocks are no block events. `cpu`: the CPU
    tier, which lends its blocks to a load (a probe of it is lent them too)."""
    stats = tier.stats()
    room = min(pool.num_free_blocks, stats.capacity_blocks - stats.used_blocks)
    num_blocks = max((s for s in sizes if s <= room), default=0)
    if num_blocks < 1:
        return []
    device_blocks = pool.get_new_blocks(num_blocks)
    block_ids = [b.block_id for b in device_blocks]
    hashes = [os.urandom(16) for _ in block_ids]
    tokens = [tuple(range(kv_cache.shape[3]))] * num_blocks  # [blocks, layers, 2, block_size, ...]

    def fill(start: int, dests: list[torch.Tensor]) -> list[bool]:
        return tier.get(hashes[start:start + len(dests)], tokens[start:start + len(dests)], dests)

    def lend(start: int, n: int) -> LentBlocks | None:  # as a promotion from the CPU tier moves them
        return cpu.lend(hashes[start:start + n], tokens[start:start + n]) if tier is cpu else None

    timed = []
    listener, tier.event_listener = tier.event_listener, None
    try:
        # tiers are given host payloads, as write-downs give them (the KV cache may be on a GPU)
        payload = torch.zeros(kv_cache[0].numel() * kv_cache.element_size(), dtype=torch.uint8)
        tier.put(hashes, tokens, [payload] * num_blocks)
        tier.flush()
        for n in sorted(s for s in sizes if s <= num_blocks):
            job = transfers.load(block_ids[:n], fill, lend)
            job.wait()
            if job.failed or not all(job.served):
                break
            timed.append((n, job.seconds))
    except Exception:  # noqa: BLE001 - a tier that cannot be probed is priced when it is used
        logger.warning("kvstrata: could not time reads from the %s tier at start-up", tier.name, exc_info=True)
    finally:
        tier.discard_many(hashes)
        tier.flush()  # the discards are done before anyone listens again
        tier.event_listener = listener
        pool.free_blocks(device_blocks)
    return timed
