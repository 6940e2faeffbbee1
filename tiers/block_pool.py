"""The device block pool with automatic prefix caching (the vLLM v1 design and names).

Every device KV block is a `KVCacheBlock` with a reference count. A block is in one of three
states:

- in use: `ref_cnt > 0`; held by one or more requests; never in the free queue.
- free and cached: `ref_cnt == 0` with a `block_hash`; in the free queue AND findable through
  `cached_block_hash_to_block`, so a later request with the same prefix can take it back
  (`touch`) without recomputing it.
- free and empty: `ref_cnt == 0`, no hash; in the free queue.

Eviction is lazy LRU: freeing a block never drops its hash. The free queue is ordered from
"evict first" (head) to "evict last" (tail); `get_new_blocks` pops from the head and only then,
when a popped block still holds a hash, evicts that hash (calling `on_evict` first, so the
content can be written down to a lower tier before the slot is reused). Requests free their
blocks tail first (`free_blocks(reversed(blocks))`), so the end of a prefix, the least likely to
be shared, is evicted before its beginning.

Invariants (checked by the property tests):
- a block is in the free queue exactly when its `ref_cnt == 0`;
- `cached_block_hash_to_block[h].block_hash == h` for every key; one block per hash;
- `num_free_blocks` equals the length of the queue, whose forward and backward links agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

BlockHash = bytes
OnEvict = Callable[[int, BlockHash], None]


@dataclass(eq=False)
class KVCacheBlock:
    """One device block. The free-queue links live on the block itself, so queue operations
    allocate nothing. Blocks compare by identity (`eq=False`): two blocks are never "equal"."""

    block_id: int
    ref_cnt: int = 0
    # The chain hash of the block's tokens, set only once the block is full and cached.
    block_hash: BlockHash | None = None
    # Neighbours in FreeKVCacheBlockQueue; None when the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        # Print neighbours by id only: following the links would walk (and recurse through) the queue.
        prev_id = self.prev_free_block.block_id if self.prev_free_block is not None else None
        next_id = self.next_free_block.block_id if self.next_free_block is not None else None
        block_hash = self.block_hash.hex() if self.block_hash is not None else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={block_hash}, "
                f"prev_free_block={prev_id}, next_free_block={next_id})")


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list with sentinel head and tail: every operation is O(1).

    A deque could not remove a block from the middle in O(1), which `touch` needs when a request
    takes back a free cached block. Order: head = evicted first (least recently freed), tail =
    evicted last. Sentinels mean no operation special-cases an empty queue or the ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict first. ValueError if the queue is empty."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("no free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks in queue order. ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} free")
        popped = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            popped.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        # Splice the head sentinel onto the first block that stays.
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue. ValueError if it is not in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: it will be evicted last."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the tail in the order given (the first of them is evicted first)."""
        last = self.fake_free_list_tail.prev_free_block
        count = 0
        for block in blocks:
            assert block.prev_free_block is None and block.next_free_block is None, (
                f"block {block.block_id} is already in the free queue")
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            count += 1
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (evicted first) to tail. O(n): for tests and stats only."""
        free = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            free.append(block)
            block = block.next_free_block
        return free


class BlockPool:
    """The device blocks `0..num_blocks-1`, their free queue and the prefix-cache map.

    `on_evict(block_id, block_hash)`, if given, is called when a cached block's hash is dropped
    because its slot is being reallocated, BEFORE `get_new_blocks` returns the block, while the
    slot still holds the block's KV: the hierarchy writes it down to a lower tier there. It must
    not raise (the pool does not roll back an allocation half way). `reset_prefix_cache` drops
    hashes without calling it: that is a deliberate clear, not an eviction.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, on_evict: OnEvict | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        # Initially every block is free, in id order: block 0 is allocated first.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> the one block caching it. A block may be in use or free (lazy LRU).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """How many blocks are findable by hash (in use or free)."""
        return len(self.cached_block_hash_to_block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block caching `block_hash`, in use or free, or None. Does not touch it."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock | None]:
        """`get_cached_block` of each hash, in one pass (a long document's chain is looked up several times an
        admission, on the step thread)."""
        get = self.cached_block_hash_to_block.get
        return [get(h) for h in block_hashes]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each returned with ref_cnt 1.

        Order of operations per block: pop from the queue; if it still caches a hash, drop the
        hash from the map and the block and call `on_evict(block_id, old_hash)`; then ref_cnt = 1.
        ValueError if fewer than `num_blocks` blocks are free (nothing is taken then).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return new_blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block`'s hash (map entry first, then the block's field), then report it to
        `on_evict`. Returns whether the block was cached."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        assert self.cached_block_hash_to_block.get(block_hash) is block, (
            f"block {block.block_id} holds a hash the map gives to another block")
        del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block_hash)
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request takes (another) reference to each block, typically a prefix-cache hit.

        A free block (ref_cnt 0) leaves the free queue first, so it can no longer be evicted.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the tail of the free queue
        in the order given, which is therefore the eviction order among them. Pass a request's
        blocks reversed (tail first) so its last blocks are evicted first. Cached blocks keep
        their hash (lazy LRU). ValueError, with nothing changed, if a block would go below 0."""
        blocks = list(ordered_blocks)
        for i, block in enumerate(blocks):
            if block.ref_cnt <= 0:
                for done in blocks[:i]:  # undo, so a bad call changes nothing
                    done.ref_cnt += 1
                raise ValueError(f"block {block.block_id} freed more times than it was allocated or touched")
            block.ref_cnt -= 1
        # `prev_free_block is None` skips a block listed twice (it was appended at its first listing).
        self.free_block_queue.append_n(
            block for block in blocks if block.ref_cnt == 0 and block.prev_free_block is None)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> list[KVCacheBlock]:
        """Make `blocks[num_cached_blocks:num_full_blocks]` findable by `block_hashes[i]`.

        `blocks` are a request's blocks in order, `block_hashes` its chain hashes (at least
        `num_full_blocks` of them); blocks before `num_cached_blocks` were cached (or hit) earlier.
        If a hash is already mapped to another block (two requests computed the same prefix at
        once), the existing mapping wins and this duplicate block simply stays uncached: it is
        freed like any other block and never found. Returns the blocks newly cached.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return []
        if len(block_hashes) < num_full_blocks or len(blocks) < num_full_blocks:
            raise ValueError(f"cache_full_blocks needs {num_full_blocks} blocks and hashes, "
                             f"got {len(blocks)} blocks and {len(block_hashes)} hashes")
        newly_cached = []
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks],
                                     block_hashes[num_cached_blocks:num_full_blocks]):
            assert block.ref_cnt > 0, f"block {block.block_id} is cached while free"
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            newly_cached.append(block)
        return newly_cached

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> list[tuple[int, BlockHash]]:
        """Forget the hash of each of `blocks` that has one (their K/V will never be computed: the step that was
        to compute them failed), so that nobody is served them; `on_evict` is not called. Returns the
        (block id, hash) of each forgotten."""
        forgotten = []
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                forgotten.append((block.block_id, block.block_hash))
                block.block_hash = None
        return forgotten

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, if no block is in use (else do nothing and return False).

        Used after weights change or to clear the device tier: only safe when no running request
        relies on a cached block. `on_evict` is not called.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
