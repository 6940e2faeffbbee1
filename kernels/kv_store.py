"""Write the new tokens' K and V into their slots of the paged KV cache (vLLM's `reshape_and_cache`).

The cache is block-major `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; slot
`s = block_id * block_size + offset` of one layer is `kv_cache[block_id, layer, 0 or 1, offset]`.
A negative slot marks a padding token whose K/V must not be written.

The cache may be kept in a narrower dtype than the model computes in (fp8, float16: `cache.kv_cache_dtype`).
Values beyond its range are saturated to its largest finite value on the way in (as vLLM's fp8 cache
does), never stored as inf or NaN. An int8 cache holds scaled rows (kernels/kv_format.py): each token's
K and V of each head are rounded to multiples of their own scale.
"""
from __future__ import annotations

import torch

from kvstrata.kernels.kv_format import INT8_MAX, SCALE_BYTES, is_scaled, row_width
from kvstrata.kernels.triton_compat import check_launchable, jit, tl, triton


def saturation(source: torch.dtype, cache: torch.dtype) -> float | None:
    """The bound values of `source` are clamped to before they are kept as `cache`: its largest finite
    value where it is far narrower (fp8, float16), None where every finite value fits (or nearly)."""
    bound = torch.finfo(cache).max
    return bound if bound < 1e30 and bound < torch.finfo(source).max else None


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Scaled int8 rows of `x [..., head_dim]`: `[..., head_dim + 4]` int8, the values rounded
    (half up) to multiples of the row's scale, amax / 127, then the scale's float32 bytes. The Triton store
    computes the same float32 operations in the same order, so both give the same bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # divided by a tensor, not by the number: CUDA computes `tensor / number` as a product with the
    # number's reciprocal (an ulp off at times), where the CPU and the Triton store (div_rn) divide
    scale = amax / torch.full_like(amax, INT8_MAX)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: zeros, scale 0
    values = torch.floor(x / divisor + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Float32 values `[..., head_dim]` of scaled int8 rows `[..., head_dim + 4]` (`quantize_rows`' inverse)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return rows[..., :head_dim].float() * scale


def reference_store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                       slot_mapping: torch.Tensor) -> None:
    """Torch reference and CPU path: one indexed assignment for K and one for V."""
    block_size = kv_cache.shape[3]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_ids, offsets = slots // block_size, slots % block_size
    if is_scaled(str(kv_cache.dtype)):
        kv_cache[block_ids, layer, 0, offsets] = quantize_rows(key)
        kv_cache[block_ids, layer, 1, offsets] = quantize_rows(value)
        return
    bound = saturation(key.dtype, kv_cache.dtype)
    if bound is not None:
        key, value = key.clamp(-bound, bound), value.clamp(-bound, bound)
    kv_cache[block_ids, layer, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, layer, 1, offsets] = value.to(kv_cache.dtype)


@jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, layer,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cl, stride_ckv, stride_cs, stride_ch,
                     num_kv_heads, head_dim, block_size,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BOUND: tl.constexpr, SCALED: tl.constexpr):
    """One program per token: copy its [num_kv_heads, head_dim] K and V into slot `slot_mapping[token]`
    (SCALED: as `quantize_rows`, each head's row followed by its scale)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // block_size
    offset = slot % block_size
    head_index = tl.arange(0, HEADS)
    heads = head_index[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    rows = cache_ptr + block_id * stride_cb + layer * stride_cl + offset * stride_cs + head_index * stride_ch
    if SCALED:
        _store_scaled_rows(key, rows, dims, mask, head_index < num_kv_heads, head_dim)
        _store_scaled_rows(value, rows + stride_ckv, dims, mask, head_index < num_kv_heads, head_dim)
        return
    if BOUND > 0:  # a narrower cache (see `saturation`)
        stored_key = tl.minimum(tl.maximum(key.to(tl.float32), -BOUND), BOUND).to(cache_ptr.dtype.element_ty)
        stored_value = tl.minimum(tl.maximum(value.to(tl.float32), -BOUND), BOUND).to(cache_ptr.dtype.element_ty)
    else:
        stored_key = key.to(cache_ptr.dtype.element_ty)
        stored_value = value.to(cache_ptr.dtype.element_ty)
    tl.store(rows[:, None] + dims, stored_key, mask=mask)
    tl.store(rows[:, None] + stride_ckv + dims, stored_value, mask=mask)


@jit
def _store_scaled_rows(x, rows, dims, mask, head_ok, head_dim):
    """`quantize_rows` of x [HEADS, HEAD_DIM] (zero past head_dim) into the int8 rows starting at `rows`
    [HEADS]: the values, then each row's float32 scale in the row's last bytes (4-byte aligned)."""
    # div_rn: IEEE division as torch's (`/` compiles to an approximate one on NVIDIA GPUs, up to 2 ulp off)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [HEADS]
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))  # INT8_MAX: jit reads constexpr globals only
    divisor = tl.where(scale > 0, scale, 1.0)
    values = tl.math.div_rn(x, tl.broadcast_to(divisor[:, None], x.shape))
    values = tl.minimum(tl.maximum(tl.floor(values + 0.5), -127.0), 127.0)
    tl.store(rows[:, None] + dims, values.to(tl.int8), mask=mask)
    tl.store((rows + head_dim).to(tl.pointer_type(tl.float32), bitcast=True), scale, mask=head_ok)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """Triton version of `reference_store_kv`: writes in place, one program per token, no host sync."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"store_kv: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[4:] != (num_kv_heads, row_width(head_dim, str(kv_cache.dtype))):
        raise ValueError(f"store_kv: kv_cache shape {tuple(kv_cache.shape)} does not hold "
                         f"{num_kv_heads} kv heads of dim {head_dim} as {kv_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(5) != 1:
        raise ValueError("store_kv: key, value and kv_cache need a contiguous last (head_dim) axis")
    check_launchable("store_kv", key, value, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    scaled = is_scaled(str(kv_cache.dtype))
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, layer,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        num_kv_heads, head_dim, kv_cache.shape[3],
        HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=triton.next_power_of_2(head_dim),
        BOUND=0.0 if scaled else saturation(key.dtype, kv_cache.dtype) or 0.0, SCALED=scaled)
