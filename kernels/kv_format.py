"""What one row of the paged KV cache holds: one token's K (or V) for one KV head.

A row is `head_dim` values of the cache dtype, except for `int8` (`cache.kv_cache_dtype: int8`), whose rows are
scaled: `head_dim` int8 values followed by their scale, a float32 in the row's last SCALE_BYTES bytes, so that
value i is `int8[i] * scale`. The scale is the row's largest magnitude / 127, so each token and head keeps its own
range (llama.cpp's q8_0 scales groups of 32 values the same way). A block stays one contiguous extent, so every
tier moves it as bytes, unaware of the scales.

Why per-row int8 and not scaled fp8: fp8 is already relative, so its 3-bit mantissa sets its error and a scale
per row barely lowers it; int8 with a scale per row changes a fraction of what e4m3 does (docs/dtype.md has the
errors measured on SmolLM2's K/V).

Torch-free (the config sizes blocks without importing torch): dtypes are named as torch names them.
"""
from __future__ import annotations

SCALE_BYTES = 4  # a float32 scale at the end of each row
SCALED_DTYPES = frozenset({"int8"})
INT8_MAX = 127


def is_scaled(dtype_name: str) -> bool:
    """Whether rows of a cache of this dtype (a torch dtype name, e.g. "int8") end with a scale."""
    return dtype_name.removeprefix("torch.") in SCALED_DTYPES


def row_width(head_dim: int, dtype_name: str) -> int:
    """Elements (of the cache dtype) in one row: head_dim, plus the scale's bytes for a scaled dtype.
    The scale must be 4-byte aligned: a scaled cache needs head_dim a multiple of 4 (every model we know)."""
    if not is_scaled(dtype_name):
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(f"a {dtype_name.removeprefix('torch.')} KV cache needs head_dim a multiple of "
                         f"{SCALE_BYTES}, not {head_dim}")
    return head_dim + SCALE_BYTES
