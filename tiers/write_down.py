"""Write-down, the mechanism: copies device blocks into lower tiers in store jobs on the transfer engine, and host
payloads by a put. Which blocks go where is the tier policy's (tiers/policy.py); this only moves them.

Invariants: a device block is never overwritten while a store job still reads it (`wait_before_reuse`, called by the
pool's eviction hook before a slot is handed out); every block cached on the device has its record here (token ids,
parent hash) from its caching until its slot is reused or the device cache is reset, so it can be written down
whenever the policy says.
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.transfer import Transfer, TransferEngine

# count(tier name, blocks): a write-down handed to that tier (may run on a transfer worker)
CountWriteDowns = Callable[[str, int], None]


@dataclass(slots=True)
class CachedBlock:
    """What is kept of a block cached on the device, for writing it down (replaced whole, never changed; not frozen:
    one is built per block cached, on the step's path, where a frozen dataclass's slower construction showed)."""

    tokens: tuple[int, ...]
    parent: bytes | None  # the hash of the block before it in its chain; None for a chain's first


class WriteDowns:
    """The store jobs of one device's blocks, and what each cached device block needs to be written down."""

    def __init__(self, transfers: TransferEngine, count: CountWriteDowns) -> None:
        self.transfers = transfers
        self._count = count
        # Every block cached on the device: its token ids (lower tiers verify them on read) and the hash of the block
        # before it in its chain (None: the chain's first), which block events name.
        self.cached: dict[int, CachedBlock] = {}
        # device block id -> the store job last copying it down; waited for before the slot is reused.
        self._in_flight: dict[int, Transfer] = {}
        # those jobs, in submission order (the order they finish in): let go of from the front once copied, so that a
        # step does not scan every block of a backlog of write-downs
        self._jobs: deque[Transfer] = deque()

    def store(self, block_ids: list[int], hashes: list[bytes], targets: Sequence[LowerTier]) -> None:
        """Copy device blocks down to `targets`, in one store job (a batched copy on the transfer worker)."""
        if not targets:
            return
        tokens = [self.cached[b].tokens for b in block_ids]
        parents = [self.cached[b].parent for b in block_ids]
        job = self.transfers.store(block_ids, functools.partial(_put_run, list(targets), hashes, tokens, parents))
        for b in block_ids:
            self._in_flight[b] = job
        self._jobs.append(job)
        for target in targets:
            self._count(target.name, len(block_ids))

    def put(self, tier: LowerTier, hashes: list[bytes], tokens: list[Sequence[int]], payloads: list[torch.Tensor],
            parents: list[bytes | None], counted: bool = True) -> None:
        """Put host payloads into a lower tier (it copies them before returning), counted as write-downs unless
        `counted` is False (blocks the tier holds already, which the put only touches)."""
        tier.put(hashes, tokens, payloads, parents)
        if counted:
            self._count(tier.name, len(hashes))

    def let_go_of_copied(self) -> None:
        """Forget the store jobs whose blocks are copied off the device (their slots may be reused without a wait)."""
        while self._jobs and self._jobs[0].copied:
            job = self._jobs.popleft()
            for b in job.block_ids:
                if self._in_flight.get(b) is job:  # (not a later job copying the reused block down)
                    del self._in_flight[b]

    def wait_before_reuse(self, block_id: int) -> None:
        """The device is about to reuse this block's slot: wait until no store job reads it, and forget its record."""
        job = self._in_flight.pop(block_id, None)
        if job is not None:
            job.wait_copied()  # the step needs this slot now: the one wait on a transfer it makes
        self.cached.pop(block_id, None)

    def wait(self) -> None:
        """Wait until every block handed down so far is in its lower tier."""
        self.transfers.wait_stores()

    def forget_all(self) -> None:
        """The device cache was reset (every store job has finished): no record is kept."""
        self.cached.clear()
        self._in_flight.clear()
        self._jobs.clear()


def _put_run(tiers: list[LowerTier], hashes: list[bytes], tokens: list[tuple[int, ...]],
             parents: list[bytes | None], start: int, srcs: list[torch.Tensor]) -> None:
    """A store job's drain: put the blocks `start, start + 1, ...` of the job into each of `tiers`
    (each copies the payloads before returning)."""
    stop = start + len(srcs)
    for tier in tiers:
        tier.put(hashes[start:stop], tokens[start:stop], srcs, parents[start:stop])
