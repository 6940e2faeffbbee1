"""LRU order without payloads: the victim choice the CPU tier evicts by, and `LruIndex`, a tier's LRU
bookkeeping alone (which hashes it holds, in what order), for replaying traffic without moving bytes
(`kvstrata plan`).

The order is an OrderedDict, least recently used first: a read or a put of a held block moves it to
the end; a put into a full tier evicts from the front, skipping blocks that must stay.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Hashable, Sequence

Key = Hashable


def lru_victim(order: OrderedDict, must_stay: Callable[[Key], bool]) -> Key | None:
    """The least recently used key of `order` that may go (`must_stay` false), or None when every key must
    stay. Keys skipped on the way are moved to the end, out of the next scan's way: a pinned block is never
    evicted, so its place does not matter; a held or read one is being promoted, which makes it the most
    recently used."""
    victim, kept = None, []
    for candidate in order:
        if must_stay(candidate):
            kept.append(candidate)
        else:
            victim = candidate
            break
    for k in kept:
        order.move_to_end(k)
    return victim


class LruIndex:
    """A lower tier's hashes in LRU order, without payloads: the interface the hierarchy's lookup asks
    (`name`, `count_prefixes`), reads (`touch`) and writes (`put`) as a tier's `get` and `put` order them.

    `capacity_blocks` None: unbounded (a remote server sized by its own memory). `on_evict(hash)` is
    called before an evicted hash leaves (a CPU tier's eviction cascades to disk there). `keeps_holds` False:
    `hold` does nothing, as in a tier whose eviction other processes share (disk, remote)."""

    def __init__(self, name: str, capacity_blocks: int | None,
                 on_evict: Callable[[Key], None] | None = None, keeps_holds: bool = True) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.on_evict = on_evict
        self.keeps_holds = keeps_holds
        self.order: OrderedDict[Key, None] = OrderedDict()
        self._holds: Counter[Key] = Counter()  # blocks a promotion will read: never evicted meanwhile
        self.hits = self.puts = self.evictions = self.rejected_puts = 0

    def contains(self, block_hash: Key) -> bool:
        return block_hash in self.order

    def count_prefix(self, block_hashes: Sequence[Key]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.order:
                break
            n += 1
        return n

    def count_prefixes(self, chains: Sequence[Sequence[Key]]) -> list[int]:
        return [self.count_prefix(chain) for chain in chains]

    def hold(self, block_hashes: Sequence[Key]) -> None:
        """Keep these blocks from eviction until `release` (holds nest), as a tier's `hold` does."""
        if self.keeps_holds:
            self._holds.update(block_hashes)

    def release(self, block_hashes: Sequence[Key]) -> None:
        if not self.keeps_holds:
            return
        self._holds.subtract(block_hashes)
        for h in block_hashes:
            if self._holds[h] <= 0:
                del self._holds[h]

    def touch(self, block_hashes: Sequence[Key]) -> None:
        """Blocks read (served): the most recently used, each a hit."""
        move_to_end = self.order.move_to_end
        for h in block_hashes:
            move_to_end(h)
        self.hits += len(block_hashes)

    def put(self, block_hashes: Sequence[Key]) -> None:
        """Store the blocks not held (a held one is only touched), evicting the least recently used."""
        order = self.order
        for h in block_hashes:
            if h in order:
                order.move_to_end(h)
                continue
            if self.capacity_blocks is not None and len(order) >= self.capacity_blocks:
                victim = lru_victim(order, self._holds.__contains__)
                if victim is None:  # every block is held: nothing is stored (a tier's rejected put)
                    self.rejected_puts += 1
                    continue
                if self.on_evict is not None:
                    self.on_evict(victim)
                del order[victim]
                self.evictions += 1
            order[h] = None
            self.puts += 1
