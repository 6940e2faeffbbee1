"""The tier policy: where a chain's blocks are found and where blocks go down, decided over block hashes alone.

No torch and no I/O: the policy sees the device `BlockPool` (what the device caches, its free queue in LRU order)
and each lower tier through the small interface every tier shares (`name`, `contains`, `count_prefixes`, `hold`,
`release`), which both a real tier (tiers/cpu.py, disk.py, remote.py) and a tier's LRU bookkeeping alone
(`LruIndex`, tiers/lru.py) give. `TierHierarchy` asks it and moves the bytes its answers name; `kvstrata plan`
replays the same class over `LruIndex` tiers (kvstrata/planner.py), so the plan answers for the cache we ship.
What a tier holds, and in what LRU order, is read from the tier itself, never mirrored here: the disk tier is
shared by processes and the remote tier evicts by its server's policy, so a copy kept beside them would drift.

What it decides:

- Lookup walks a chain run by run: device hits are map lookups; each run of blocks the device lacks is asked of
  the lower tiers in turn, each from where the blocks found so far end, until every tier has said that it lacks
  the next block: the walk stops at the first block no tier holds. Relocation walks the same runs, the lower
  tiers' part answered by an earlier lookup.
- Write-down (`offload`): `write_through` queues every block computed and cached on the device (`block_computed`)
  until the step that computed it is over (`take_pending`), then copies it to the CPU tier (or disk without one)
  and the remote tier; `on_evict` copies a cached block to the same tiers only when the device reuses its slot.
  A block still queued when its slot is reused is written down then, under either policy. Blocks promoted from a
  lower tier are below already and are not queued.
- An answer stays on the device (`offload_answers` off, as LMCache's `save_decode_cache` is by default): a block
  holding a generated token is cached on the device, but written down by neither policy, nor by persist. In
  long-document QA an answer is asked for once; written down, each answer would take lower-tier room (and network,
  for the remote tier) from the documents asked about again. A later prompt that reuses it (the next turn of a
  chat) makes it a prompt block: it is written down then, as one computed (`device_blocks_reused`).
- A block served from disk or the remote tier is copied up into the CPU tier: the next miss is a local one.
- A CPU-tier eviction cascades to disk (the remote tier, written through, has the block already). A block the
  disk holds already is only made its most recent there: the disk's LRU order is the order blocks left the CPU tier,
  whichever of them it held before. Left at its older place (where its last disk read or write put it), a document
  read back from disk and used since would be evicted before the colder blocks that left the CPU tier after that
  read.
"""
from __future__ import annotations

import itertools
from typing import Generator, Hashable, Iterable, Protocol, Sequence

from kvstrata.tiers.block_pool import BlockPool, KVCacheBlock

OFFLOAD_POLICIES = ("write_through", "on_evict")

BlockHash = Hashable
# (tier, hashes): a walk's question to a lower tier; it is sent how many of those hashes the tier holds in a row
Question = tuple["TierIndex", Sequence[BlockHash]]


class TierIndex(Protocol):
    """What the policy reads and holds of a lower tier."""

    name: str

    def contains(self, block_hash: BlockHash) -> bool: ...

    def count_prefixes(self, chains: Sequence[Sequence[BlockHash]]) -> list[int]: ...

    def hold(self, block_hashes: Sequence[BlockHash]) -> None: ...

    def release(self, block_hashes: Sequence[BlockHash]) -> None: ...


def run_end(flags: list[bool], start: int) -> int:
    """Where the run of equal flags from `start` ends: a search in C (a long document is looked up several times an
    admission, on the step thread, where a Python step per block showed)."""
    try:
        return flags.index(not flags[start], start)
    except ValueError:
        return len(flags)


class TierPolicy:
    """The policy of one engine's tiers: the device pool and the lower tiers it has, in tier order."""

    def __init__(self, pool: BlockPool, cpu: TierIndex | None = None, disk: TierIndex | None = None,
                 remote: TierIndex | None = None, offload: str = "write_through", offload_answers: bool = False
                 ) -> None:
        if offload not in OFFLOAD_POLICIES:
            raise ValueError(f"cache.offload: unknown policy {offload!r} (use one of {', '.join(OFFLOAD_POLICIES)})")
        self.pool = pool
        self.cpu, self.disk, self.remote = cpu, disk, remote
        self.offload = offload
        self.offload_answers = offload_answers
        self.lower_tiers: list[TierIndex] = [t for t in (cpu, disk, remote) if t is not None]
        # Write-downs go to the CPU tier (or disk without one) and to the remote tier, which shares them with other
        # replicas; the CPU tier's evictions reach disk by the cascade.
        self.write_down_targets: list[TierIndex] = [t for t in (cpu if cpu is not None else disk, remote)
                                                    if t is not None]
        # write_through: device blocks cached since the last `take_pending`, not yet written down (id -> hash)
        self.pending: dict[int, BlockHash] = {}
        # answers kept on the device only (`offload_answers` off): cached blocks holding a generated token that no
        # later prompt has reused (id -> hash)
        self.answers: dict[int, BlockHash] = {}

    # ------------------------------------------------------------------ lookup

    def locate(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """For each leading block of the chain, the first tier that holds it; stops at the first block no tier
        holds. Each run of blocks the device lacks costs one `count_prefixes` per lower tier (a run that
        alternates between the CPU tier and disk costs more: each tier is asked again wherever another one's
        blocks end)."""
        return self.locate_many([block_hashes])[0]

    def locate_many(self, chains: Sequence[Sequence[BlockHash]]) -> list[list[str]]:
        """`locate` of each chain, the chains' questions to a lower tier asked together: one `count_prefixes` per
        tier and round (a burst of arrivals is looked up in one step, one round trip to a remote server)."""
        walks = [self.walk(chain) for chain in chains]
        found: list[list[str]] = [[] for _ in chains]
        asks: dict[int, Question] = {}  # chain -> the question its walk waits on

        def advance(i: int, answer: int | None) -> None:
            try:
                asks[i] = walks[i].send(answer)
            except StopIteration as walked:
                found[i] = walked.value
                asks.pop(i, None)

        for i in range(len(walks)):
            advance(i, None)
        while asks:
            for tier in self.lower_tiers:  # in tier order: a walk's next question is often the next tier's
                waiting = [i for i, (asked, _) in asks.items() if asked is tier]
                if waiting:
                    for i, count in zip(waiting, tier.count_prefixes([asks[i][1] for i in waiting])):
                        advance(i, count)
        return found

    def walk(self, block_hashes: Sequence[BlockHash]) -> Generator[Question, int, list[str]]:
        """`locate` of one chain, as a generator: it yields each question for a lower tier and returns the tiers."""
        return self._walk_runs(block_hashes, lambda start, end: self._ask_below(block_hashes, start, end))

    def relocate_on_device(self, block_hashes: Sequence[BlockHash], found: Sequence[str]) -> list[str]:
        """`found`, an earlier `locate` of the same chain, with the device's part read again (a dict lookup per
        block, no lower tier asked): a block the device holds now is a device hit; one it no longer holds ends the
        prefix unless the earlier lookup placed it in a lower tier."""
        walk = self._walk_runs(block_hashes, lambda start, end: _earlier_below(found, start, end))
        try:
            next(walk)
        except StopIteration as walked:
            return walked.value
        raise AssertionError("a relocation asks no lower tier")

    def _walk_runs(self, block_hashes: Sequence[BlockHash], place_below) -> Generator[Question, int, list[str]]:
        """The one walk of a chain, run by run: a run the device holds is device hits; a run it lacks is placed by
        `place_below(start, end)` (a generator returning the run's tiers, fewer than the run's blocks where no
        tier holds the next one: the walk stops there)."""
        found: list[str] = []
        on_device = [block is not None for block in self.pool.get_cached_blocks(block_hashes)]
        while len(found) < len(on_device):
            start = len(found)
            end = run_end(on_device, start)
            if on_device[start]:
                found += ["device"] * (end - start)
                continue
            placed = yield from place_below(start, end)
            found += placed
            if len(placed) < end - start:
                break
        return found

    def _ask_below(self, block_hashes: Sequence[BlockHash], start: int, end: int
                   ) -> Generator[Question, int, list[str]]:
        """The tiers of the run `start:end` the device lacks: the lower tiers in turn, each asked from where the
        run's blocks found so far end, until every tier has said that it lacks the next block (one question each
        for most runs, more where tiers alternate)."""
        placed: list[str] = []
        tiers, turn = self.lower_tiers, 0
        lacks_at: dict[str, int] = {}  # tier -> where the run's next block is one it lacks
        while start + len(placed) < end:
            at = start + len(placed)
            tier = next((t for t in tiers[turn:] + tiers[:turn] if lacks_at.get(t.name) != at), None)
            if tier is None:  # no tier holds the next block
                break
            k = yield tier, block_hashes[at:end]
            placed += [tier.name] * k
            lacks_at[tier.name] = start + len(placed)
            turn = (tiers.index(tier) + 1) % len(tiers)
        return placed

    # ------------------------------------------------------------------ promotion

    def hold_below(self, block_hashes: Sequence[BlockHash], found_in: Sequence[str], hold: bool) -> None:
        """Hold (or release) in its tier each block found below the device, so that no write-down evicts it before
        its promotion has read it."""
        for tier in self.lower_tiers:
            hashes = [h for h, t in zip(block_hashes, found_in) if t == tier.name]
            if hashes:
                (tier.hold if hold else tier.release)(hashes)

    def blocks_for_load(self, num_blocks: int) -> list[KVCacheBlock]:
        """Device blocks to load a prefix's lower-tier hits into, in ascending ids: blocks come off the free queue
        as requests freed them, tail first, so that in this order every block of a document freed whole is next
        to its neighbour, and a run of neighbouring rows below is one copy."""
        return sorted(self.pool.get_new_blocks(num_blocks), key=lambda b: b.block_id)

    def copy_up_target(self, served_from: str) -> TierIndex | None:
        """Where a block promoted from `served_from` is copied, beside the device: the CPU tier for a disk or remote
        hit (the next miss on the device is a cheap, local one); None when it came from the CPU tier or there is
        none."""
        return self.cpu if served_from in ("disk", "remote") else None

    # ------------------------------------------------------------------ write-down

    def block_computed(self, blocks: Iterable[KVCacheBlock], answers: Iterable[KVCacheBlock] = ()) -> None:
        """Blocks newly cached on the device whose K/V this engine computed: write_through queues them. `answers`
        hold a generated token: they stay on the device unless `offload_answers`."""
        if self.offload_answers:
            blocks = itertools.chain(blocks, answers)
        else:
            self.answers.update((block.block_id, block.block_hash) for block in answers)
        self._queue(blocks)

    def device_blocks_reused(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Device hits of a prompt's prefix: an answer among them is a prompt's block now, written down as one
        computed (queued by write_through, by on_evict when it leaves the device)."""
        if self.answers:
            reused = [block for block in blocks if self.answers.pop(block.block_id, None) is not None]
            self._queue(reused)

    def _queue(self, blocks: Iterable[KVCacheBlock]) -> None:
        if self.offload == "write_through" and self.write_down_targets:
            for block in blocks:
                self.pending[block.block_id] = block.block_hash

    def writes_down(self, block_id: int) -> bool:
        """Whether a cached device block's content belongs below (for persist and a reset that writes down what
        the device holds): every one but an answer kept on the device."""
        return block_id not in self.answers

    def block_forgotten(self, block_id: int) -> None:
        """A device block's cache entry was dropped without eviction (its K/V were never computed, or the device
        cache was reset): nothing of it is written down."""
        self.pending.pop(block_id, None)
        self.answers.pop(block_id, None)

    def device_cache_cleared(self) -> None:
        """The device cache was reset: nothing queued is written down (what had to be was, before the reset)."""
        self.pending.clear()
        self.answers.clear()

    def take_pending(self) -> tuple[list[int], list[BlockHash]]:
        """The queued write-through blocks (ids, hashes), handed over once the step that computed them is done."""
        block_ids, hashes = list(self.pending), list(self.pending.values())
        self.pending.clear()
        return block_ids, hashes

    def device_evicting(self, block_id: int) -> bool:
        """The pool is reusing a cached block's slot: whether its content must be written down first (on_evict, or
        still queued by write_through)."""
        if self.answers.pop(block_id, None) is not None:
            return False
        return self.pending.pop(block_id, None) is not None or self.offload == "on_evict"

    def cascade_target(self, block_hash: BlockHash) -> tuple[TierIndex | None, bool]:
        """Where a block the CPU tier evicts goes (disk, if there is one), and whether that tier holds it already: a
        put then only makes it the most recent there, and counts as no write-down."""
        if self.disk is None:
            return None, False
        return self.disk, self.disk.contains(block_hash)


def _earlier_below(found: Sequence[str], start: int, end: int) -> Generator[Question, int, list[str]]:
    """A relocation's placing of a run the device lacks now: where the earlier lookup placed its blocks, up to one
    it found on the device (which has left it since); nothing is asked."""
    yield from ()  # a generator, as the lookup's placing is
    earlier = list(found[start:end])
    return earlier[:earlier.index("device")] if "device" in earlier else earlier
