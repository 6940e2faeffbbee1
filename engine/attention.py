"""Attention over the paged KV cache, plugged into transformers' attention interface.

Per step, the model runner builds one `AttentionMetadata` and passes it to the model as the keyword
argument `attn_metadata`; transformers hands every keyword it does not know to the attention function
of every layer, so the metadata reaches all layers without globals (nano-vllm's context object).

Each layer stores the step's new K/V into their slots first, then runs prefix prefill: every new
token attends, causally, to its sequence's cached context plus the new tokens, all read through the
block table. Decode is the case of one new token per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_NAME = "kvstrata"


@dataclass
class AttentionMetadata:
    """One step's view of the paged KV cache; the tokens of all sequences are packed back to back.

    Invariants: `slot_mapping[i]` is where token i's K/V go (`block_id * block_size + offset`);
    `query_start_loc[b]:query_start_loc[b+1]` are sequence b's new tokens; `seq_lens[b]` counts its
    cached context plus those new tokens; `block_tables[b]` covers `seq_lens[b]` positions.
    """

    slot_mapping: torch.Tensor     # [T] int64
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    kv_cache: torch.Tensor         # [num_blocks, num_layers, 2, block_size, num_kv_heads, row] (kernels/kv_format.py)
    ops: object                    # kvstrata.kernels.KernelOps
    scale: float | None = None     # softmax scale; None = the layer's own (1/sqrt(head_dim))


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            attn_metadata: AttentionMetadata | None = None, **kwargs):
    """transformers attention function: `query [1, H, T, D]`, `key/value [1, Hkv, T, D]` (RoPE applied)
    -> `([1, T, H, D], None)`. The mask is ignored: causality comes from the metadata."""
    if attn_metadata is None:
        raise ValueError("kvstrata attention needs `attn_metadata`: run the model through ModelRunner")
    assert query.shape[0] == 1, "sequences are packed into one row"
    meta = attn_metadata
    layer = module.layer_idx
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()    # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    scale = meta.scale if meta.scale is not None else (scaling if scaling is not None else q.shape[-1] ** -0.5)
    meta.ops.store_kv(k, v, meta.kv_cache, layer, meta.slot_mapping)
    out = meta.ops.prefix_prefill(q, meta.kv_cache, layer, meta.block_tables,
                                  meta.query_start_loc, meta.seq_lens, scale)
    return out.unsqueeze(0), None


def _no_dense_mask(*args, **kwargs) -> None:
    """The paged kernels apply causality themselves: never build a dense [T, T] mask."""
    return None


def register_attention() -> None:
    """Make `attn_implementation="kvstrata"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_dense_mask)
