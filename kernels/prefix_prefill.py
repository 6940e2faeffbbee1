"""Prefix prefill: the new tokens of a batch of sequences attend, causally, to their cached context plus themselves,
reading K/V from the paged cache through each sequence's block table.

Inputs (vLLM's names): `query [T, num_heads, head_dim]` holds every sequence's new tokens packed back to back;
`query_start_loc [B+1]` their cumulative counts; `seq_lens [B]` each sequence's total KV length including the new
tokens, whose K/V `store_kv` has already written; `block_tables [B, max_blocks]` the device block of each logical
block. New token i of a sequence with q_len new tokens sits at position `seq_len - q_len + i` and sees keys
`0 ..= seq_len - q_len + i`. Query head h reads KV head `h // (num_heads // num_kv_heads)` (GQA).
Decode is the case q_len == 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels.triton_compat import tl, triton


def gather_sequence_kv(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` positions, `[num_kv_heads, seq_len, head_dim]` each:
    whole blocks are selected at once, then the tail of the last (partial) block is cut off."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    blocks = kv_cache[:, layer].index_select(0, block_ids)  # [n, 2, block_size, kv_heads, head_dim]
    key = blocks[:, 0].reshape(num_blocks * block_size, *blocks.shape[-2:])[:seq_len]
    value = blocks[:, 1].reshape(num_blocks * block_size, *blocks.shape[-2:])[:seq_len]
    return key.transpose(0, 1), value.transpose(0, 1)


def causal_suffix_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask `[q_len, kv_len]`, True where query i (at position kv_len - q_len + i) may see key j.
    SDPA's own `is_causal` aligns the diagonal top-left, which is wrong whenever q_len < kv_len."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]


def reference_prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference and CPU path: per sequence, gather its K/V blocks and call SDPA once."""
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    for seq, kv_len in enumerate(kv_lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        key, value = gather_sequence_kv(kv_cache, layer, block_tables[seq], kv_len)
        q = query[q_start:q_end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        mask, is_causal = None, False
        if q_len == kv_len:
            is_causal = True  # no cached context: top-left causal is the right one
        elif q_len > 1:
            mask = causal_suffix_mask(q_len, kv_len, query.device)
        attn = F.scaled_dot_product_attention(q.unsqueeze(0), key.unsqueeze(0).to(q.dtype),
                                              value.unsqueeze(0).to(q.dtype), attn_mask=mask,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[0] != key.shape[0])
        out[q_start:q_end] = attn[0].transpose(0, 1)
    return out
