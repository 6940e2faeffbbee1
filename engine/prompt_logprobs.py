"""Prompt log-probabilities by block, so that a cached prefix need not be recomputed to score what follows.

A request asking for its prompt's log-probabilities (`SamplingParams.prompt_logprobs`; `echo` with
`logprobs` over HTTP) needs, for every prompt token, the model's distribution at the position before
it: the logits of every prompt row. A cached block's K/V carry no logits, so vLLM computes such a
prompt whole. Evaluating a model on long documents (many questions, each scored against several
answers, as lm-evaluation-harness does) would then recompute every document for every answer.

This cache keeps, for each block whose tokens' log-probabilities were computed, those entries
(each token's log-probability and the `MAX_LOGPROBS` likeliest alternatives at its position), keyed
by the block's chain hash: the entries of a block's tokens depend on exactly the tokens its chain
hash covers (the model identity and `cache_salt` included), as its K/V do. A request takes from here
the entries of its prompt's leading blocks, then may use a cached K/V prefix ending one block before
them: the first token after the prefix is predicted by the prefix's last position, which is not
computed again, so its entry must already be known.

Entry k of a request's `prompt_logprobs` is prompt token k+1's (token 0 has no position before it):
block j (tokens j*bs .. j*bs+bs-1) holds entries j*bs-1 .. j*bs+bs-2, block 0 one fewer.
Stored compactly (two small tensors a block); least recently used blocks go first.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from kvstrata.engine.request import Request
from kvstrata.engine.sampling import MAX_LOGPROBS, TokenLogprobs


class PromptLogprobCache:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        # block hash -> (ids [bs, 2 + MAX_LOGPROBS] int32: the token, its rank, then its alternatives;
        # values [bs, 1 + MAX_LOGPROBS] float32: the token's log-probability, then its alternatives').
        # Block 0's first row is unused.
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.blocks_served = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()

    def store(self, request: Request) -> None:
        """Keep the entries of the request's prompt blocks that it has all of and this cache lacks."""
        bs, entries = self.block_size, request.prompt_logprobs
        complete = min((len(entries) + 1) // bs, request.num_prompt_tokens // bs, len(request.block_hashes))
        for j in range(complete):
            block_hash = request.block_hashes[j]
            if block_hash in self._blocks:
                continue
            self._blocks[block_hash] = _pack(entries[max(j * bs - 1, 0):j * bs + bs - 1], first_block=j == 0)
            if len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)

    def extend(self, request: Request) -> None:
        """Give the request the entries of its next prompt blocks, as far as this cache holds them
        (from where its entries end at a block's end: a request recomputed after a preemption, which
        stopped mid-block, takes none)."""
        bs, entries = self.block_size, request.prompt_logprobs
        if entries and (len(entries) + 1) % bs:
            return
        for j in range((len(entries) + 1) // bs, min(request.num_prompt_tokens // bs, len(request.block_hashes))):
            packed = self._blocks.get(request.block_hashes[j])
            if packed is None:
                return
            self._blocks.move_to_end(request.block_hashes[j])
            entries.extend(_unpack(*packed, first_block=j == 0))
            self.blocks_served += 1


def _pack(entries: Sequence[TokenLogprobs], first_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = len(entries) + first_block
    ids = torch.zeros(rows, 2 + MAX_LOGPROBS, dtype=torch.int32)
    values = torch.zeros(rows, 1 + MAX_LOGPROBS, dtype=torch.float32)
    for row, entry in enumerate(entries, start=int(first_block)):
        assert len(entry.top) == MAX_LOGPROBS, "stored entries carry every alternative a request may ask for"
        ids[row] = torch.tensor([entry.token_id, entry.rank, *(t for t, _ in entry.top)], dtype=torch.int32)
        values[row] = torch.tensor([entry.logprob, *(v for _, v in entry.top)], dtype=torch.float32)
    return ids, values


def _unpack(ids: torch.Tensor, values: torch.Tensor, first_block: bool) -> list[TokenLogprobs]:
    out = []
    for row_ids, row_values in zip(ids.tolist()[int(first_block):], values.tolist()[int(first_block):]):
        out.append(TokenLogprobs(row_ids[0], row_values[0], tuple(zip(row_ids[2:], row_values[1:])), row_ids[1]))
    return out
