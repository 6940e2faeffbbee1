"""KVCacheManager: a request's view of the tiered cache (vLLM v1 names).

The scheduler asks it three things: how much of a request's prefix is cached anywhere
(`get_computed_blocks`, which also promotes lower-tier hits to the device), for device slots for the
tokens it is about to compute (`allocate_slots`), and to let a request go (`free`).
"""
from __future__ import annotations

from kvstrata.engine.hashing import BlockHasher
from kvstrata.engine.request import Request
from kvstrata.tiers.block_pool import KVCacheBlock
from kvstrata.tiers.hierarchy import TierHierarchy

TIER_NAMES = ("device", "cpu", "disk")


class KVCacheManager:
    def __init__(self, hierarchy: TierHierarchy, hasher: BlockHasher, block_size: int,
                 enable_caching: bool = True):
        self.hierarchy = hierarchy
        self.pool = hierarchy.pool
        self.hasher = hasher
        self.block_size = block_size
        self.enable_caching = enable_caching
        # request_id -> the device blocks it holds, in position order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its blocks are cached (hashed into the device map) so far.
        self.num_cached_block: dict[str, int] = {}
        self.query_tokens = 0
        self.hit_tokens = {t: 0 for t in TIER_NAMES}

    # ----------------------------------------------------------------- hashing

    def _update_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (prompt and output tokens alike)."""
        if not self.enable_caching:
            return
        if not request.block_hashes:
            request.block_hashes = self.hasher.hash(request.all_token_ids, cache_salt=request.cache_salt)
        else:
            self.hasher.extend(request.block_hashes, request.all_token_ids, cache_salt=request.cache_salt)

    def _block_tokens(self, request: Request, start: int, stop: int) -> list[list[int]]:
        tokens = request.all_token_ids
        bs = self.block_size
        return [tokens[i * bs:(i + 1) * bs] for i in range(start, stop)]

    # ----------------------------------------------------------------- the scheduler's calls

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int, dict[str, int]]:
        """The longest cached prefix of the request in any tier, held on the device.

        Returns (blocks, num_computed_tokens, tokens per tier). The hit is capped so that at least
        the last token is computed (its logits are needed). The blocks are ref-counted for the
        request: pass them to `allocate_slots`, which keeps or releases them.
        """
        by_tier = {t: 0 for t in TIER_NAMES}
        if not self.enable_caching:
            return [], 0, by_tier
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        hit = self.hierarchy.acquire_prefix(hashes, self._block_tokens(request, 0, len(hashes)))
        by_tier = {t: hit.blocks_by_tier.get(t, 0) * self.block_size for t in TIER_NAMES}
        return hit.blocks, hit.num_blocks * self.block_size, by_tier

    def record_admission(self, request: Request, tokens_by_tier: dict[str, int]) -> None:
        """Count one admitted request's prefix query (a retried admission is counted once)."""
        self.query_tokens += request.num_tokens
        for t in TIER_NAMES:
            self.hit_tokens[t] += tokens_by_tier.get(t, 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of the request (after its computed ones).

        `new_computed_blocks` are the prefix blocks from `get_computed_blocks` (first scheduling
        only). Returns the newly allocated blocks, or None if the device pool cannot hold them; then
        nothing changes for the request except that `new_computed_blocks` are released (they stay
        cached on the device, findable again). Blocks that will be full once this step's tokens are
        computed are cached right away, as vLLM does: in a step, every sequence's new K/V are stored
        before any attention reads them, so another request in the same step may already share them.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_needed > self.pool.num_free_blocks:
            if new_computed_blocks:
                self.pool.free_blocks(list(reversed(new_computed_blocks)))
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        blocks.extend(new_computed_blocks)
        # prefix blocks come only at a request's first scheduling, and they are all cached already
        self.num_cached_block.setdefault(request.request_id, len(new_computed_blocks))
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        self._update_hashes(request)
        num_cached = self.num_cached_block[request.request_id]
        # Only tokens the request already knows are hashable (a decode step computes one it knows).
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes))
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.hierarchy.cache_blocks(blocks, request.block_hashes, self._block_tokens(request, num_cached, num_full),
                                    num_cached, num_full)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its unique suffix is evicted before shared roots."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def stats(self) -> dict:
        return {"query_tokens": self.query_tokens, "hit_tokens": dict(self.hit_tokens)}
