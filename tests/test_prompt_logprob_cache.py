"""The cache of prompt log-probabilities by block (engine/prompt_logprobs.py), without a model: which
entries a block holds, where a request's entries may be extended from, and what is evicted."""
from __future__ import annotations

from kvstrata.engine.prompt_logprobs import PromptLogprobCache
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs

BS = 4


def entry(token_id: int) -> TokenLogprobs:
    """A made-up entry whose numbers say which token it is for (exact in float32, as stored)."""
    return TokenLogprobs(token_id, -token_id / 8, tuple((token_id + i, -i / 4) for i in range(MAX_LOGPROBS)), token_id + 3)


def request(token_ids: list[int], salt: str = "") -> Request:
    r = Request(f"r{salt}{token_ids}", token_ids, SamplingParams(prompt_logprobs=2))
    # stand-in chain hashes: each covers every token up to its block's end, as the real ones do
    r.block_hashes = [f"{salt}{token_ids[:(j + 1) * BS]}".encode() for j in range(len(token_ids) // BS)]
    return r


def scored(token_ids: list[int], salt: str = "") -> Request:
    r = request(token_ids, salt)
    r.prompt_logprobs = [entry(t) for t in token_ids[1:]]  # entry k: token k+1's
    return r


def test_a_request_takes_the_entries_of_the_blocks_it_shares_with_one_scored_before():
    cache = PromptLogprobCache(capacity_blocks=100, block_size=BS)
    cache.store(scored(list(range(10))))  # blocks 0 and 1 are whole prompt blocks; tokens 8, 9 are not
    assert len(cache) == 2
    later = request([0, 1, 2, 3, 4, 5, 6, 7, 42, 43, 44, 45])
    cache.extend(later)
    # tokens 1..7: block 0 gives three (token 0 has none), block 1 four; block 2 differs
    assert later.prompt_logprobs == [entry(t) for t in range(1, 8)]
    assert cache.blocks_served == 2


def test_no_entries_cross_a_block_that_differs_or_another_salt():
    cache = PromptLogprobCache(capacity_blocks=100, block_size=BS)
    cache.store(scored(list(range(12))))
    first_block_differs = request([9, 1, 2, 3, 4, 5, 6, 7, 8])
    cache.extend(first_block_differs)
    assert first_block_differs.prompt_logprobs == []
    other_tenant = request(list(range(12)), salt="tenant-b")
    cache.extend(other_tenant)
    assert other_tenant.prompt_logprobs == []


def test_entries_that_stop_mid_block_are_not_extended_and_partial_blocks_not_stored():
    cache = PromptLogprobCache(capacity_blocks=100, block_size=BS)
    partial = request(list(range(12)))
    partial.prompt_logprobs = [entry(t) for t in range(1, 6)]  # tokens 1..5: block 1 incomplete
    cache.store(partial)
    assert len(cache) == 1  # block 0 only
    cache.store(scored(list(range(12))))
    preempted_mid_block = request(list(range(12)))
    preempted_mid_block.prompt_logprobs = [entry(t) for t in range(1, 6)]
    cache.extend(preempted_mid_block)
    assert len(preempted_mid_block.prompt_logprobs) == 5  # it computes from where it stands


def test_the_least_recently_used_blocks_go_first():
    cache = PromptLogprobCache(capacity_blocks=2, block_size=BS)
    cache.store(scored(list(range(8))))           # blocks A0, A1
    cache.extend(request(list(range(4)) + [9]))   # A0 used again
    cache.store(scored([7, 7, 7, 7, 8]))          # B0 evicts A1, the least recently used
    kept = request(list(range(8)) + [9])
    cache.extend(kept)
    assert len(kept.prompt_logprobs) == 3 and len(cache) == 2
