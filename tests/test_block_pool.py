"""The device block pool: prefix-cache hits, lazy LRU eviction order, ref counts, the free queue."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.engine.hashing import block_hashes, make_namespace
from kvstrata.tiers.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock

BLOCK_SIZE = 4
NAMESPACE = make_namespace("test-model", "float32", BLOCK_SIZE, 1, "xxh3_128")


def ids(blocks):
    return [block.block_id for block in blocks]


def free_queue_ids(pool: BlockPool):
    return ids(pool.free_block_queue.get_all_free_blocks())


# --- A tiny request bookkeeper, as the KV cache manager does it on top of the pool -------------------

@dataclass
class Request:
    token_ids: list[int]
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0


class PrefixCachingRequests:
    """Allocation with prefix caching: look up the chain, touch the hits, allocate the rest, cache
    blocks as they fill, free tail first."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def add(self, token_ids: list[int]) -> tuple[Request, int]:
        """Admit a request; returns it and its number of prefix-cache hit blocks."""
        request = self.touch_cached_prefix(token_ids)
        num_hits = request.num_cached_blocks
        self.allocate_rest(request)
        return request, num_hits

    def touch_cached_prefix(self, token_ids: list[int]) -> Request:
        """Walk the chain through the pool until the first miss and take a reference to the hits."""
        request = Request(list(token_ids))
        request.block_hashes = block_hashes(request.token_ids, block_size=BLOCK_SIZE, namespace=NAMESPACE)
        hits = self._find_cached_prefix(request)
        self.pool.touch(hits)
        request.blocks = hits
        request.num_cached_blocks = len(hits)
        return request

    def allocate_rest(self, request: Request) -> None:
        """New blocks for the tokens the hits do not cover; cache those that are full."""
        num_blocks_needed = -(-len(request.token_ids) // BLOCK_SIZE)
        request.blocks = request.blocks + self.pool.get_new_blocks(num_blocks_needed - len(request.blocks))
        self._cache_full_blocks(request)

    def append_token(self, request: Request, token_id: int) -> None:
        """One decode step: a new block when the last is full, cache blocks that became full."""
        request.token_ids.append(token_id)
        if len(request.token_ids) > len(request.blocks) * BLOCK_SIZE:
            request.blocks += self.pool.get_new_blocks(1)
        request.block_hashes = block_hashes(request.token_ids, block_size=BLOCK_SIZE, namespace=NAMESPACE)
        self._cache_full_blocks(request)

    def finish(self, request: Request) -> None:
        self.pool.free_blocks(reversed(request.blocks))

    def _find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        # The last prompt token is always computed (its logits are needed), hence the cap.
        max_hit_blocks = (len(request.token_ids) - 1) // BLOCK_SIZE
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _cache_full_blocks(self, request: Request) -> None:
        num_full_blocks = len(request.token_ids) // BLOCK_SIZE
        self.pool.cache_full_blocks(request.blocks, request.block_hashes,
                                    request.num_cached_blocks, num_full_blocks)
        request.num_cached_blocks = max(request.num_cached_blocks, num_full_blocks)


def test_reference_scenario_prefix_hits_and_lazy_lru_eviction_order():
    evictions: list[tuple[int, bytes]] = []
    pool = BlockPool(10, on_evict=lambda block_id, block_hash: evictions.append((block_id, block_hash)))
    requests = PrefixCachingRequests(pool)
    assert free_queue_ids(pool) == list(range(10))

    # 1. Request 0, 15 prompt tokens: blocks 0..3; 0, 1, 2 full and cached; 3 holds 3 tokens.
    request_0, num_hits = requests.add(list(range(15)))
    assert num_hits == 0
    assert ids(request_0.blocks) == [0, 1, 2, 3]
    assert [b.block_hash for b in request_0.blocks[:3]] == request_0.block_hashes[:3]
    assert request_0.blocks[3].block_hash is None
    assert pool.num_cached_blocks == 3
    assert [block.ref_cnt for block in request_0.blocks] == [1, 1, 1, 1]
    assert free_queue_ids(pool) == [4, 5, 6, 7, 8, 9]

    # 2. One decode token fills block 3, which gets cached; decoding on, block 4 is allocated.
    requests.append_token(request_0, 100)
    assert request_0.blocks[3].block_hash == request_0.block_hashes[3]
    assert pool.get_cached_block(request_0.block_hashes[3]) is request_0.blocks[3]
    requests.append_token(request_0, 101)
    assert ids(request_0.blocks) == [0, 1, 2, 3, 4]
    assert pool.num_cached_blocks == 4

    # 3. Request 1, 14 tokens, first 10 equal: hits 0 and 1 only (8 tokens), new blocks 5 and 6.
    request_1, num_hits = requests.add(list(range(10)) + [200, 201, 202, 203])
    assert num_hits == 2
    assert request_1.block_hashes[2] != request_0.block_hashes[2]  # 2 of its 4 tokens differ
    assert ids(request_1.blocks) == [0, 1, 5, 6]
    assert [pool.blocks[i].ref_cnt for i in range(7)] == [2, 2, 1, 1, 1, 1, 1]
    assert pool.blocks[5].block_hash == request_1.block_hashes[2]  # its own third block, now full

    # 4. Request 0 finishes: 4, 3, 2 join the queue in that order, 2 and 3 still cached.
    requests.finish(request_0)
    assert free_queue_ids(pool) == [7, 8, 9, 4, 3, 2]
    assert pool.blocks[2].block_hash == request_0.block_hashes[2]
    assert pool.blocks[3].block_hash == request_0.block_hashes[3]
    assert pool.get_cached_block(request_0.block_hashes[3]) is pool.blocks[3]
    assert [pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 0, 0]

    # 5. Request 1 finishes.
    requests.finish(request_1)
    assert free_queue_ids(pool) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.num_cached_blocks == 5  # 0, 1, 2, 3 from request 0 and 5 from request 1
    assert evictions == []

    # 6. Request 2, 29 tokens, first 12 equal: hits 0, 1, 2 are taken out of the queue first, then
    #    7 8 9 4 3 are allocated; block 3's old hash is evicted, with on_evict told first.
    block_3_hash = pool.blocks[3].block_hash
    request_2 = requests.touch_cached_prefix(list(range(12)) + list(range(300, 317)))
    assert ids(request_2.blocks) == [0, 1, 2]
    assert [block.ref_cnt for block in request_2.blocks] == [1, 1, 1]
    assert free_queue_ids(pool) == [7, 8, 9, 4, 3, 6, 5]
    assert evictions == []
    requests.allocate_rest(request_2)
    assert ids(request_2.blocks) == [0, 1, 2, 7, 8, 9, 4, 3]
    assert evictions == [(3, block_3_hash)]
    assert pool.get_cached_block(block_3_hash) is None
    assert free_queue_ids(pool) == [6, 5]
    assert all(block.ref_cnt == 1 for block in request_2.blocks)
    # Its 7 full blocks are cached now: 0, 1, 2 (hits) and 7, 8, 9, 4 (new); 3 holds the partial block.
    assert [block.block_hash for block in request_2.blocks[:7]] == request_2.block_hashes
    assert pool.blocks[3].block_hash is None
    assert pool.blocks[5].block_hash is not None  # free and still cached: request 1's third block


def test_on_evict_is_called_before_the_block_is_returned():
    pool = BlockPool(2)
    seen_ref_cnt_during_evict = []
    pool.on_evict = lambda block_id, block_hash: seen_ref_cnt_during_evict.append(
        (block_id, block_hash, pool.blocks[block_id].ref_cnt, pool.get_cached_block(block_hash)))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h0"], 0, 1)
    pool.free_blocks([block])
    pool.get_new_blocks(2)
    # Called for block 0 only, while it was still unreferenced and already gone from the map.
    assert seen_ref_cnt_during_evict == [(0, b"h0", 0, None)]


def test_duplicate_hash_keeps_the_first_block_and_leaves_the_second_uncached():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([first], [b"same"], 0, 1) == [first]
    assert pool.cache_full_blocks([second], [b"same"], 0, 1) == []
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None


def test_caching_disabled_never_caches():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    assert pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], 0, 3) == []
    assert pool.get_cached_block(b"a") is None
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in blocks)


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(0) == []


def test_freeing_a_free_block_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block 1 freed more times"):
        pool.free_blocks([a, b, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert free_queue_ids(pool) == [2]


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)


def test_free_block_count_follows_allocation_and_free():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 1
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# --- Free queue ----------------------------------------------------------------------------------

def make_queue(n):
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def queue_ids(queue):
    return ids(queue.get_all_free_blocks())


def test_free_queue_remove_from_middle_and_ends():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert queue_ids(queue) == [0, 1, 3, 4] and queue.num_free_blocks == 4
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue_ids(queue) == [1, 3] and queue.num_free_blocks == 2
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    with pytest.raises(ValueError, match="block 2 is not in the free queue"):
        queue.remove(blocks[2])


def test_free_queue_popleft_n_and_append_n_keep_order():
    blocks, queue = make_queue(6)
    assert ids(queue.popleft_n(2)) == [0, 1]
    assert queue.popleft().block_id == 2
    queue.append_n([blocks[1], blocks[0]])
    queue.append(blocks[2])
    assert queue_ids(queue) == [3, 4, 5, 1, 0, 2] and queue.num_free_blocks == 6
    assert ids(queue.popleft_n(6)) == [3, 4, 5, 1, 0, 2]
    assert queue.num_free_blocks == 0 and queue_ids(queue) == []
    queue.append_n([])
    assert queue.num_free_blocks == 0
    queue.append(blocks[4])
    assert queue_ids(queue) == [4]


def test_free_queue_pops_from_empty_raise():
    _, queue = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    with pytest.raises(ValueError, match="cannot pop 1 blocks"):
        queue.popleft_n(1)
    assert queue.popleft_n(0) == []


def test_block_repr_names_neighbours_without_recursing():
    blocks, _ = make_queue(20_000)
    text = repr(blocks[5])
    assert "block_id=5" in text and "prev_free_block=4" in text and "next_free_block=6" in text


# --- Property test: random allocate / cache / touch / free against a plain model ------------------

# A small pool and few hashes, so that cached blocks come round to the head of the free queue
# (and get reallocated), duplicates and hits are all common within 50 steps.
HASH_UNIVERSE = [bytes([i]) * 16 for i in range(4)]
NUM_POOL_BLOCKS = 5


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a list-and-dict model of it side by side and compares them."""

    @initialize()
    def setup(self):
        self.evictions = []
        self.pool = BlockPool(NUM_POOL_BLOCKS, on_evict=lambda i, h: self.evictions.append((i, h)))
        self.model_queue = list(range(NUM_POOL_BLOCKS))
        self.model_ref_cnt = [0] * NUM_POOL_BLOCKS
        self.model_hash: dict[int, bytes] = {}
        self.model_map: dict[bytes, int] = {}
        self.holdings: list[tuple[list[KVCacheBlock], list[int]]] = []  # (blocks, [num_cached])

    @rule(num_blocks=st.integers(0, 3))
    def allocate(self, num_blocks):
        if num_blocks > len(self.model_queue):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num_blocks)
            return
        self.evictions.clear()
        blocks = self.pool.get_new_blocks(num_blocks)
        expected_ids = self.model_queue[:num_blocks]
        assert ids(blocks) == expected_ids
        expected_evictions = [(i, self.model_hash[i]) for i in expected_ids if i in self.model_hash]
        assert self.evictions == expected_evictions  # exactly the cached blocks reallocated
        del self.model_queue[:num_blocks]
        for block_id, block_hash in expected_evictions:
            del self.model_hash[block_id]
            del self.model_map[block_hash]
        for block_id in expected_ids:
            self.model_ref_cnt[block_id] = 1
        self.holdings.append((blocks, [0]))

    @precondition(lambda self: self.holdings)
    @rule(which=st.integers(0, 100), count=st.integers(1, 4), hashes=st.lists(st.sampled_from(HASH_UNIVERSE), min_size=4, max_size=4))
    def cache(self, which, count, hashes):
        blocks, cached = self.holdings[which % len(self.holdings)]
        num_cached = cached[0]
        num_full = min(len(blocks), num_cached + count)
        chain = [b""] * num_cached + hashes[:num_full - num_cached]
        newly = self.pool.cache_full_blocks(blocks, chain, num_cached, num_full)
        expected_newly = []
        for block, block_hash in zip(blocks[num_cached:num_full], chain[num_cached:num_full]):
            if block_hash not in self.model_map:
                self.model_map[block_hash] = block.block_id
                self.model_hash[block.block_id] = block_hash
                expected_newly.append(block.block_id)
        assert ids(newly) == expected_newly
        cached[0] = max(num_cached, num_full)

    @rule(block_hash=st.sampled_from(HASH_UNIVERSE))
    def touch_cached_block(self, block_hash):
        block = self.pool.get_cached_block(block_hash)
        assert (block.block_id if block else None) == self.model_map.get(block_hash)
        if block is None:
            return
        self.pool.touch([block])
        if self.model_ref_cnt[block.block_id] == 0:
            self.model_queue.remove(block.block_id)
        self.model_ref_cnt[block.block_id] += 1
        self.holdings.append(([block], [1]))

    @precondition(lambda self: self.holdings)
    @rule(which=st.integers(0, 100))
    def free(self, which):
        blocks, _ = self.holdings.pop(which % len(self.holdings))
        self.pool.free_blocks(reversed(blocks))
        for block in reversed(blocks):
            self.model_ref_cnt[block.block_id] -= 1
            if self.model_ref_cnt[block.block_id] == 0:
                self.model_queue.append(block.block_id)

    @rule(which=st.integers(0, NUM_POOL_BLOCKS - 1))
    def double_free_is_refused(self, which):
        block = self.pool.blocks[which]
        if block.ref_cnt == 0:
            with pytest.raises(ValueError):
                self.pool.free_blocks([block])

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll:  # rarely: a reset wipes the cached state the other rules build up
            return
        nothing_in_use = not any(self.model_ref_cnt)
        assert self.pool.reset_prefix_cache() == nothing_in_use
        if nothing_in_use:
            self.model_map.clear()
            self.model_hash.clear()

    @invariant()
    def pool_matches_model(self):
        assert free_queue_ids(self.pool) == self.model_queue
        assert [block.ref_cnt for block in self.pool.blocks] == self.model_ref_cnt
        assert {i: b.block_hash for i, b in enumerate(self.pool.blocks) if b.block_hash} == self.model_hash
        assert {h: b.block_id for h, b in self.pool.cached_block_hash_to_block.items()} == self.model_map

    @invariant()
    def free_queue_holds_exactly_unreferenced_blocks(self):
        free_ids = set(free_queue_ids(self.pool))
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0
            assert (block.block_id in free_ids) == (block.ref_cnt == 0)

    @invariant()
    def hash_map_names_only_blocks_with_that_hash(self):
        for block_hash, block in self.pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash

    @invariant()
    def queue_links_agree_both_ways(self):
        queue = self.pool.free_block_queue
        forward = queue.get_all_free_blocks()
        backward = []
        block = queue.fake_free_list_tail.prev_free_block
        while block is not queue.fake_free_list_head:
            backward.append(block)
            block = block.prev_free_block
        assert backward[::-1] == forward
        assert len(forward) == queue.num_free_blocks == self.pool.num_free_blocks


BlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_block_pool_matches_its_model_under_random_operations = BlockPoolMachine.TestCase
