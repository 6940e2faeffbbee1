"""Pins across the lower tiers (pinned documents): an owner's blocks are copied into every lower tier that lacks them
and pinned there, so that no LRU eviction below the device drops them; on the device they stay ordinary cached
blocks (evicted down to the CPU tier, which keeps them). What may be pinned is the caller's policy
(engine/documents.py); how a tier keeps a pin is the tier's (`LowerTier.pin`)."""
from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.tiers.base import LowerTier, Pin
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.write_down import WriteDowns


class TierPins:
    """The pins of one engine's lower tiers."""

    def __init__(self, pool: BlockPool, lower_tiers: Sequence[LowerTier], write_downs: WriteDowns) -> None:
        self.pool = pool
        self.lower_tiers = list(lower_tiers)
        self.write_downs = write_downs

    def pin(self, owner: str, block_hashes: Sequence[bytes], block_tokens: Sequence[Sequence[int]],
            info: dict) -> None:
        """Pin the blocks for `owner` in every lower tier, first copying in those a tier lacks (from the device, or
        another lower tier). Raises ValueError if a tier did not take the pin (a disk write that failed)."""
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
        """Copy blocks into `tier` from wherever they are: device blocks in one store job (a batched copy on the
        transfer worker), the rest in one read per other lower tier. Returns once they are in; a block no tier holds
        is left out."""
        on_device, elsewhere = [], []
        parent_of = dict(zip(hashes, parents))
        for h, toks in zip(hashes, tokens):
            block = self.pool.get_cached_block(h)
            if block is not None and block.block_id in self.write_downs.cached:
                on_device.append((block.block_id, h))
            else:
                elsewhere.append((h, toks))
        if on_device:
            block_ids, device_hashes = zip(*on_device)
            self.write_downs.store(list(block_ids), list(device_hashes), [tier])
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
                self.write_downs.put(tier, found_hashes, found_tokens, payloads, [parent_of[h] for h in found_hashes])
            copied = {h for h, _, _ in found}
            elsewhere = [(h, toks) for h, toks in elsewhere if h not in copied]
        self.write_downs.wait()

    def unpin(self, owner: str) -> bool:
        """Drop the owner's pin in every lower tier; True if any tier had it."""
        return any([tier.unpin(owner) for tier in self.lower_tiers])

    def pins(self) -> dict[str, Pin]:
        """Every owner's pin in any lower tier (the disk tier's survive restarts)."""
        pins: dict[str, Pin] = {}
        for tier in self.lower_tiers:
            pins.update(tier.pins())
        return pins

    def restore(self) -> None:
        """Pin in every lower tier what another one pins (after a restart the CPU tier starts empty while the disk
        tier kept its pins): the blocks are pinned there as they arrive."""
        pins = self.pins()
        for tier in self.lower_tiers:
            held = tier.pins()
            for owner, pin in pins.items():
                if owner not in held:
                    tier.pin(owner, pin.block_hashes, pin.info)
