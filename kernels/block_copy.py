"""Move whole blocks between the device pool and a staging buffer. A block is one contiguous extent
`kv_cache[block_id]` of shape `[num_layers, 2, block_size, num_kv_heads, head_dim]`, so a block moves as one copy."""
from __future__ import annotations

import torch

from kvstrata.kernels.triton_compat import check_launchable, jit, tl, triton


def reference_gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = kv_cache[block_ids[i]]; returns out."""
    torch.index_select(kv_cache, 0, block_ids.to(device=kv_cache.device, dtype=torch.long), out=out)
    return out


def reference_scatter_blocks(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[block_ids[i]] = src[i]. Block ids must be distinct (each names a different destination)."""
    kv_cache.index_copy_(0, block_ids.to(device=kv_cache.device, dtype=torch.long), src.to(kv_cache.dtype))


@jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_index_ptr, dst_index_ptr, src_stride, dst_stride, block_numel,
                        GATHER: tl.constexpr, CHUNK: tl.constexpr):
    """Program (i, c) copies chunk c of block i. Gather reads block `src_index[i]` into row i; scatter writes row i
    into block `dst_index[i]`. A block is contiguous in both tensors, so a chunk is one flat run of elements."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    if GATHER:
        src_row = tl.load(src_index_ptr + i).to(tl.int64)
        dst_row = i.to(tl.int64)
    else:
        src_row = i.to(tl.int64)
        dst_row = tl.load(dst_index_ptr + i).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    data = tl.load(src_ptr + src_row * src_stride + offsets, mask=mask)
    tl.store(dst_ptr + dst_row * dst_stride + offsets, data, mask=mask)


_COPY_CHUNK = 4096


def _check_block_pair(name: str, kv_cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor) -> None:
    if staging.shape[1:] != kv_cache.shape[1:] or staging.shape[0] != block_ids.shape[0]:
        raise ValueError(f"{name}: staging shape {tuple(staging.shape)} is not [{block_ids.shape[0]}, "
                         f"*{tuple(kv_cache.shape[1:])}]")
    if staging.dtype != kv_cache.dtype or staging.device != kv_cache.device:
        raise ValueError(f"{name}: staging is {staging.dtype} on {staging.device}, "
                         f"kv_cache is {kv_cache.dtype} on {kv_cache.device}")
    if not (kv_cache[0].is_contiguous() and staging[0].is_contiguous()):
        raise ValueError(f"{name}: each block must be one contiguous extent in kv_cache and staging")


def _launch_copy(src, dst, block_ids, gather: bool) -> None:
    block_ids = block_ids.to(device=src.device)  # block ids may come from the host-side block pool
    check_launchable("gather_blocks" if gather else "scatter_blocks", src, dst, block_ids)
    num_blocks = block_ids.shape[0]
    if num_blocks == 0:
        return
    block_numel = src[0].numel()
    grid = (num_blocks, triton.cdiv(block_numel, _COPY_CHUNK))
    _copy_blocks_kernel[grid](src, dst, block_ids, block_ids, src.stride(0), dst.stride(0), block_numel,
                              GATHER=gather, CHUNK=_COPY_CHUNK)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference_gather_blocks`."""
    _check_block_pair("gather_blocks", kv_cache, out, block_ids)
    _launch_copy(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton version of `reference_scatter_blocks`."""
    _check_block_pair("scatter_blocks", kv_cache, src, block_ids)
    _launch_copy(src, kv_cache, block_ids, gather=False)
