"""Write the new tokens' K and V into their slots of the paged KV cache (vLLM's `reshape_and_cache`).

The cache is block-major `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; slot
`s = block_id * block_size + offset` of one layer is `kv_cache[block_id, layer, 0 or 1, offset]`.
A negative slot marks a padding token whose K/V must not be written.
"""
from __future__ import annotations

import torch

from kvstrata.kernels.triton_compat import tl, triton


def reference_store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                       slot_mapping: torch.Tensor) -> None:
    """Torch reference and CPU path: one indexed assignment for K and one for V."""
    block_size = kv_cache.shape[3]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_ids, offsets = slots // block_size, slots % block_size
    kv_cache[block_ids, layer, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, layer, 1, offsets] = value.to(kv_cache.dtype)
