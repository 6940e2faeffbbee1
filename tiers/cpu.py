"""The CPU tier: a preallocated (optionally pinned) host slab of block slots with LRU eviction.

One slot holds one block's payload (`layout.block_nbytes` bytes) and the block's token ids, which
every read checks against the ones the caller expects. The LRU order lives in an OrderedDict
(hash -> slot, least recently used first); free slots sit in a stack. When a put finds no free
slot, the least recently used block is handed to `on_evict` (so the hierarchy can write it down to
disk) *before* its slot is overwritten. Pinned blocks (`pin`) are skipped by eviction, like held ones.
"""
from __future__ import annotations

import dataclasses
import heapq
import threading
from collections import Counter, OrderedDict
from typing import Callable, Optional, Sequence

import torch

from kvstrata.tiers.base import BlockLayout, LowerTier, Pin, TierStats, parents_or_unknown, token_tuple
from kvstrata.tiers.block_events import TierEvents
from kvstrata.tiers.lru import lru_victim
from kvstrata.tiers.transfer import LentBlocks, copy_each

_NEXT_ROUND = object()  # a put's block that must wait for the put's earlier blocks to be written (see `put`)

# on_evict(block_hash, token_ids, payload_view, parent_hash): the view aliases the slot about to be
# reused, so the callback must copy what it keeps before returning. It runs on the putting thread outside
# the tier's lock (a cascade to disk copies and checksums the block: lookups do not wait for it); the block
# is still found here meanwhile, and leaves once the callback has returned (so a lookup never misses a block
# that is on its way down). The parent hash is the one the block was put with (or None).
EvictCallback = Callable[[bytes, tuple, torch.Tensor, Optional[bytes]], None]


class CpuTier(LowerTier):
    """Host-memory tier of `capacity_blocks` block slots.

    Invariants (all under `_lock`): every slot is either in `_free_slots`, the value of exactly one
    entry of `_slot_of`, dropped while a `get` copies out of it (`_dropped_while_read`), or being
    written by a `put` (`_writing`: not found, not evicted, until its payload is copied); a slot a put
    takes by eviction stays the evicted block's, found and readable, while it is handed down
    (`_handing_down`, and counted as read, so nothing else evicts or reuses it);
    `_token_ids[slot]` is the token tuple of the block in that slot (`_parents[slot]` its parent's
    hash, where the put gave it: for events and write-downs); a held or pinned block is never
    evicted by LRU (a put that finds every slot held or pinned stores nothing, counted in
    `stats().extra['rejected_puts']`); a slot in `_readers` is neither evicted nor reused;
    `_pin_count[h]` is the number of owners in `_pins` whose pin names `h`. Pins live in memory
    only: this tier starts empty.
    Payloads are host tensors on both sides: a GPU is reached through the transfer engine.
    A read that finds a block whose token ids differ from the expected ones counts it as a miss
    *and* as corrupt, and drops the entry.
    """

    name = "cpu"

    def __init__(self, layout: BlockLayout, capacity_blocks: int, pin_memory: bool = False,
                 on_evict: Optional[EvictCallback] = None):
        if capacity_blocks <= 0:
            raise ValueError(f"cache.tiers.cpu.size: the CPU tier needs at least one block, got {capacity_blocks} "
                             "(leave the tier out to turn it off)")
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        self.on_evict = on_evict
        # Pinned memory only helps (and only exists) with CUDA; without it a plain slab is the same thing.
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._slab = torch.empty((capacity_blocks, layout.block_nbytes), dtype=torch.uint8,
                                 pin_memory=self.pinned)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._token_ids: list[Optional[tuple[int, ...]]] = [None] * capacity_blocks
        self._parents: list[Optional[bytes]] = [None] * capacity_blocks
        # A heap: a put takes the lowest free slot, so that blocks written one after another (a document) sit in
        # neighbouring rows, which a promotion lends and copies a run at a time (a slot given back, by the start-up
        # probe's throwaway blocks for one, would otherwise come back first and send the next document's first
        # hundreds of blocks to rows in descending order: one copy each).
        self._free_slots: list[int] = list(range(capacity_blocks))
        self._writing: dict[bytes, int] = {}  # hash -> its slot, while a put copies its payload there (unlocked)
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified when a put's blocks are written (or given back)
        # hash -> how many promotions in flight will read it: never evicted while held (see `hold`).
        # held blocks' hold counts (a Counter: holding a long document's blocks counts them in C)
        self._holds: Counter[bytes] = Counter()
        # slot -> how many `get` calls are copying out of it now (outside the lock): never reused meanwhile
        self._readers: dict[int, int] = {}
        self._dropped_while_read: set[int] = set()  # dropped slots that return to the free stack once read
        self._handing_down: set[int] = set()  # slots whose evicted block is still found there (see `_put_round`)
        self._pins: dict[str, Pin] = {}
        self._pin_count: dict[bytes, int] = {}
        self._rejected_puts = 0
        self._stats = TierStats(name=self.name, capacity_blocks=capacity_blocks,
                                capacity_bytes=capacity_blocks * layout.block_nbytes)

    # -- lookups -----------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._slot_of

    def count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        return self.count_prefixes([block_hashes])[0]

    def count_prefixes(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Under one taking of the lock, for all the chains."""
        with self._lock:
            return [self._count_prefix(chain) for chain in chains]

    def _count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self._slot_of:
                break
            n += 1
        return n

    def get(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            dests: Sequence[torch.Tensor]) -> list[bool]:
        """Copy payloads into host tensors `dests` (the transfer engine moves them on to a GPU).

        The copies run outside the lock, so that the parts of one load are copied by several threads
        at once; a slot being read is neither evicted nor reused until its reads end."""
        assert len(block_hashes) == len(token_ids) == len(dests)
        events = self._events()
        with self._lock:
            slots = [self._start_read(h, expected, events) for h, expected in zip(block_hashes, token_ids)]
            if events is not None:
                events.emit(self.event_listener)
        try:
            found = [(dest, self._slab[slot]) for slot, dest in zip(slots, dests) if slot is not None]
            copy_each([dest for dest, _ in found], [row for _, row in found])
        finally:
            with self._lock:
                for slot in slots:
                    if slot is not None:
                        self._end_read(slot)
        return [slot is not None for slot in slots]

    def lend(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]]) -> LentBlocks | None:
        """The blocks' slots, lent to be copied straight out of the slab (pinned on a GPU host: a
        host-to-device copy needs no staging copy first), if every block is here with its token ids;
        else None, with nothing counted (the caller reads them with `get`). Each lent block counts as a
        hit and as being read: it is neither evicted nor its slot reused until `release()`."""
        # One pass of plain loops over the blocks, under one taking of the lock: it runs on a transfer thread
        # beside the step thread, and holds the interpreter lock throughout.
        with self._lock:
            slots = [self._slot_of.get(h) for h in block_hashes]
            if None in slots or any(self._token_ids[slot] != _as_tuple(expected)
                                    for slot, expected in zip(slots, token_ids)):
                return None
            self._count_reads(block_hashes, slots)
        unreleased = list(slots)

        def release() -> None:  # once: a second call finds nothing left to release
            with self._lock:
                for slot in unreleased:
                    self._end_read(slot)
                unreleased.clear()

        return LentBlocks(self._slab, slots, release)

    def _start_read(self, block_hash: bytes, expected: Sequence[int], events: TierEvents | None) -> int | None:
        """The slot of a block to be read (now counted as read), or None for a miss."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            self._stats.misses += 1
            return None
        if self._token_ids[slot] != token_tuple(expected):
            self._stats.misses += 1
            self._stats.corrupt += 1
            self._drop(block_hash, events)
            return None
        self._count_read(block_hash, slot)
        return slot

    def _count_read(self, block_hash: bytes, slot: int) -> None:
        """A verified block's read begins: a hit, the most recently used, its slot kept until `_end_read`."""
        self._count_reads((block_hash,), (slot,))

    def _count_reads(self, block_hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """`_count_read` of each block, in one loop."""
        move_to_end, readers = self._slot_of.move_to_end, self._readers
        for block_hash, slot in zip(block_hashes, slots):
            move_to_end(block_hash)
            readers[slot] = readers.get(slot, 0) + 1
        self._stats.hits += len(slots)

    def _end_read(self, slot: int) -> None:
        n = self._readers.pop(slot) - 1
        if n > 0:
            self._readers[slot] = n
        elif slot in self._handing_down:  # a put waits to write it (`_finish_hand_downs`)
            self._written.notify_all()
        elif slot in self._dropped_while_read:  # dropped mid-read: free for reuse only now
            self._dropped_while_read.remove(slot)
            heapq.heappush(self._free_slots, slot)

    def hold(self, block_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self._holds.update(block_hashes)

    def release(self, block_hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in block_hashes:
                n = self._holds.pop(h, 0) - 1
                if n > 0:
                    self._holds[h] = n

    def pin(self, owner: str, block_hashes: Sequence[bytes], info: dict | None = None) -> None:
        with self._lock:
            self._unpin(owner)
            pin = Pin(tuple(dict.fromkeys(block_hashes)), dict(info or {}))
            self._pins[owner] = pin
            for h in pin.block_hashes:
                self._pin_count[h] = self._pin_count.get(h, 0) + 1

    def unpin(self, owner: str) -> bool:
        with self._lock:
            return self._unpin(owner)

    def _unpin(self, owner: str) -> bool:
        pin = self._pins.pop(owner, None)
        if pin is None:
            return False
        for h in pin.block_hashes:
            n = self._pin_count.pop(h) - 1
            if n > 0:
                self._pin_count[h] = n
        return True

    def pins(self) -> dict[str, Pin]:
        with self._lock:
            return dict(self._pins)

    # -- writes ------------------------------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            srcs: Sequence[torch.Tensor], parents: Sequence[bytes | None] | None = None) -> None:
        """Store the blocks this tier lacks. Their slots are taken under the lock, their payloads copied outside
        it, and they are found once all are copied: a lookup, a hold or a lend on the step's path waits for no
        write-down's copies (a document's blocks are tens of megabytes). A put of more blocks than there are
        slots to take goes in rounds, a round's blocks evicting the earlier rounds' as any put evicts."""
        assert len(block_hashes) == len(token_ids) == len(srcs)
        assert all(src.numel() == self.layout.block_nbytes and src.dtype == torch.uint8 for src in srcs), \
            "a payload is a flat uint8 tensor of layout.block_nbytes bytes"
        parents = parents_or_unknown(parents, len(block_hashes))
        blocks = list(zip(block_hashes, token_ids, srcs, parents))
        while blocks:
            blocks = self._put_round(blocks)

    def _put_round(self, blocks: list[tuple[bytes, Sequence[int], torch.Tensor, bytes | None]]) -> list:
        """Put the blocks, in order, until one finds every slot taken by blocks being written, this round's among
        them; those left are returned, for the next round."""
        events = self._events()
        taken: list[tuple[bytes, Sequence[int], torch.Tensor, bytes | None, int]] = []
        evicted: list[tuple[bytes, tuple, bytes | None, int]] = []  # (hash, token ids, parent, slot) of each
        left: list = []
        # Events are handed over under the lock, so that they reach the listener in the order of the changes.
        with self._lock:
            for k, (h, ids, src, parent) in enumerate(blocks):
                slot = self._take_slot(h, events, evicted, may_wait=not taken)
                if slot is _NEXT_ROUND:
                    left = blocks[k:]
                    break
                if slot is not None:
                    taken.append((h, ids, src, parent, slot))
            if events is not None:
                events.emit(self.event_listener)
        copied = handed_down = False
        try:
            if self.on_evict is not None:  # each evicted block goes down before its slot is written
                for h, ids, parent, slot in evicted:
                    self.on_evict(h, ids, self._slab[slot], parent)
            with self._lock:
                self._finish_hand_downs(evicted, events)
                handed_down = True
            copy_each([self._slab[slot] for *_, slot in taken], [src for _, _, src, _, _ in taken])
            copied = True
        finally:
            with self._lock:
                if not handed_down:
                    self._finish_hand_downs(evicted, events)
                for h, ids, _, parent, slot in taken:
                    if copied:
                        self._publish(h, ids, slot, parent, events)
                    else:
                        self._give_back(h, slot)
                self._written.notify_all()
                if events is not None:
                    events.emit(self.event_listener)
        return left

    def _take_slot(self, block_hash: bytes, events: TierEvents | None, evicted: list,
                   may_wait: bool) -> int | object | None:
        """A slot for a block to be put, kept for it (`_writing`) until its payload is copied (a block evicted for
        it is added to `evicted`); None when the block is here already (now the most recently used) or being put,
        or every slot is held by a promotion or pinned. When every slot is held or being written: a put that holds
        no slot yet (`may_wait`) waits for those writes to end; one that does gets `_NEXT_ROUND`, and writes its
        own first (so puts never wait for one another in a circle). A block found here whose slot is being handed
        down (evicted, by this put among others) is leaving: it is put again, in a slot of its own."""
        slot = self._slot_of.get(block_hash)
        if slot is not None and slot not in self._handing_down:
            self._slot_of.move_to_end(block_hash)
            return None
        if block_hash in self._writing:
            return None
        while True:
            slot = heapq.heappop(self._free_slots) if self._free_slots else self._evict_lru(events, evicted)
            if slot is not None:
                self._writing[block_hash] = slot
                return slot
            if not self._writing:
                self._rejected_puts += 1
                return None
            if not may_wait:
                return _NEXT_ROUND
            self._written.wait()  # blocks being written are evictable once written

    def _publish(self, block_hash: bytes, token_ids: Sequence[int], slot: int, parent: bytes | None,
                 events: TierEvents | None) -> None:
        del self._writing[block_hash]
        self._token_ids[slot] = token_tuple(token_ids)
        self._parents[slot] = parent
        self._slot_of[block_hash] = slot
        self._stats.puts += 1
        if events is not None:
            events.stored(block_hash, self._token_ids[slot], parent)

    def _give_back(self, block_hash: bytes, slot: int) -> None:
        """A put that failed before its copies were done: its slots are free again, its blocks not stored."""
        del self._writing[block_hash]
        heapq.heappush(self._free_slots, slot)

    def _evict_lru(self, events: TierEvents | None, evicted: list) -> int | None:
        """Free the least recently used slot that no promotion holds and no owner pins, its block added to
        `evicted` (for `on_evict`, before the slot is written); returns the slot, or None when every block is
        held or pinned."""
        h = lru_victim(self._slot_of, lambda candidate: (candidate in self._pin_count or candidate in self._holds
                                                         or self._slot_of[candidate] in self._readers))
        if h is None:
            return None
        slot = self._slot_of[h]
        evicted.append((h, self._token_ids[slot], self._parents[slot], slot))
        self._handing_down.add(slot)  # still found, and read (by the hand-down): see `_finish_hand_downs`
        self._readers[slot] = self._readers.get(slot, 0) + 1
        self._stats.evictions += 1
        return slot

    def _finish_hand_downs(self, evicted: list, events: TierEvents | None) -> None:
        """Under the lock, once the evicted blocks are handed down (or their hand-down failed): each leaves, and its
        slot is the put's once the reads begun meanwhile (a lend found it) have ended."""
        for h, _, _, slot in evicted:
            if self._slot_of.get(h) == slot:  # (not dropped meanwhile)
                del self._slot_of[h]
                if events is not None:
                    events.removed(h)
            self._token_ids[slot] = None
            self._parents[slot] = None
            self._end_read(slot)  # the hand-down's own read
        for _, _, _, slot in evicted:
            while slot in self._readers:
                self._written.wait()
            self._handing_down.remove(slot)

    def _drop(self, block_hash: bytes, events: TierEvents | None) -> None:
        slot = self._slot_of.pop(block_hash)
        self._token_ids[slot] = None
        self._parents[slot] = None
        if slot in self._handing_down:
            pass  # the put that took the slot writes it once the hand-down is over
        elif slot in self._readers:
            self._dropped_while_read.add(slot)
        else:
            heapq.heappush(self._free_slots, slot)
        if events is not None:
            events.removed(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        events = self._events()
        with self._lock:
            if block_hash not in self._slot_of:
                return False
            self._drop(block_hash, events)
            if events is not None:
                events.emit(self.event_listener)
            return True

    def clear(self) -> bool:
        """Drop every block and every pin."""
        events = self._events()
        with self._lock:
            for h in list(self._slot_of):
                self._drop(h, None)
            self._pins.clear()
            self._pin_count.clear()
            if events is not None:
                events.cleared()
                events.emit(self.event_listener)
        return True

    def blocks(self) -> list[tuple[bytes, tuple[int, ...], torch.Tensor, bytes | None]]:
        """A snapshot of every held block as (hash, token ids, payload view, parent hash or None), least
        recently used first.

        The views alias the slots: read them before the next put can reuse a slot (the hierarchy
        uses this on close, to write everything still held here down to disk).
        """
        with self._lock:
            return [(h, self._token_ids[slot], self._slab[slot], self._parents[slot])
                    for h, slot in self._slot_of.items()]

    def stats(self) -> TierStats:
        with self._lock:
            used = len(self._slot_of)
            self._stats.used_blocks = used
            self._stats.used_bytes = used * self.layout.block_nbytes
            self._stats.pinned_blocks = len(self._pin_count)
            return dataclasses.replace(self._stats, extra={"pinned": self.pinned, "rejected_puts": self._rejected_puts})


def _as_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple to compare with a stored one: a tuple is compared as it is (its ints, or int-likes, compare
    equal to the stored ints), anything else converted (`token_tuple`)."""
    return token_ids if type(token_ids) is tuple else token_tuple(token_ids)
