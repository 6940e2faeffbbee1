"""Move whole blocks between the device pool and a staging buffer. A block is one contiguous extent
`kv_cache[block_id]` of shape `[num_layers, 2, block_size, num_kv_heads, head_dim]`, so a block moves as one copy."""
from __future__ import annotations

import torch

from kvstrata.kernels.triton_compat import tl, triton


def reference_gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = kv_cache[block_ids[i]]; returns out."""
    torch.index_select(kv_cache, 0, block_ids.to(device=kv_cache.device, dtype=torch.long), out=out)
    return out


def reference_scatter_blocks(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[block_ids[i]] = src[i]. Block ids must be distinct (each names a different destination)."""
    kv_cache.index_copy_(0, block_ids.to(device=kv_cache.device, dtype=torch.long), src.to(kv_cache.dtype))
