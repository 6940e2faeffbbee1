"""What the tiers report as blocks come and go: stored, removed, cleared, each with its medium.

The names and fields are vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared), so the
serving layer can put them on the wire as vLLM does; the medium is the tier's name (one of
`TIER_NAMES`), so a new tier reports under its own name with nothing added here.

Reporting is off unless someone listens: every producer holds an `event_listener` that is None by
default and builds no event while it is. A listener is called from several threads (the step
thread for the device tier, the transfer workers and the disk writer for the lower tiers), in the
order in which each thread changed its tier; it must be thread-safe, must not block and must not
call back into a tier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union


@dataclass(slots=True)
class BlockStored:
    """Blocks now held in `medium`, as vLLM reports them: a run of one chain, each block the parent
    of the next. `token_ids` are the blocks' tokens, concatenated in order (`block_size` per block).
    `parent_block_hash` is the hash of the block before the first one; None for a chain's first
    block, and for a block whose parent the tier was not told (it is then reported alone)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    """Blocks no longer held in `medium` (evicted, discarded, or found corrupt and dropped)."""

    block_hashes: list[bytes]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of `medium` is gone."""

    medium: str


BlockEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
BlockEventListener = Callable[[BlockEvent], None]


def stored_runs(stored: Sequence[tuple[bytes, bytes | None, Sequence[int]]], block_size: int,
                medium: str) -> list[BlockStored]:
    """One BlockStored per run of (hash, parent hash, tokens) in which each block's parent is the block before it,
    as vLLM reports a request's newly cached blocks."""
    runs: list[BlockStored] = []
    for block_hash, parent, tokens in stored:
        if not runs or parent != runs[-1].block_hashes[-1]:
            runs.append(BlockStored([], parent, [], block_size, medium))
        runs[-1].block_hashes.append(block_hash)
        runs[-1].token_ids.extend(tokens)
    return runs


class TierEvents:
    """The events of one batched tier operation, in the order they happened, neighbours of one kind
    merged into one event: removals always, stored blocks when each is the child of the one before
    (a put of a 64-block run of one chain is one BlockStored, unless an eviction came between).
    Build one only when a listener is set; `emit` hands the events over."""

    __slots__ = ("medium", "block_size", "events")

    def __init__(self, medium: str, block_size: int):
        self.medium = medium
        self.block_size = block_size
        self.events: list[BlockEvent] = []

    def stored(self, block_hash: bytes, token_ids: Sequence[int], parent: bytes | None) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent == last.block_hashes[-1]:  # None never is
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self.events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, self.medium))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared(self.medium))

    def emit(self, listener: BlockEventListener | None) -> None:
        if listener is not None:
            for event in self.events:
                listener(event)
        self.events = []
