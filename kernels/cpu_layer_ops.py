"""A decoder layer's per-row parts on a CPU as compiled kernels (kernels/cpu_layer_ops.c): residual-add-and-RMSNorm,
rotary embedding, SiLU-and-multiply, and the K/V store, each with the signature of its torch reference
(kernels/layer_ops.py, kernels/kv_store.py). Why: a decode step calls them 150 times, and each reference is a chain
of small torch ops paying torch's dispatch per op, which costs more than a decode row's arithmetic; here a call is
its checks, its outputs' allocation, one ctypes call and the arithmetic, several times less.

What they compute: the reference's operations in its order, rounded to the dtype where torch rounds, so rotary and
the store give the reference's bits exactly; RMSNorm sums a row's squares in a fixed order of its own (within an ulp
or so of torch's mean: float32 sums in another order), and SiLU takes its exp from the C file (within a few ulp
of torch's). A row's bits depend only on its own values: never on the other rows of the call, the thread count or
the build (AVX2 or portable), so the batch-invariant mode needs no interception of these ops.

Where the kernel is not built (no compiler, a failed build: one line logged) and for inputs it does not take
(tensors off the CPU, dtypes other than float32 / bfloat16 / float16, a weight or table of another dtype than x, an
int8 or fp8 KV cache), each op runs its reference. Bad shapes are a one-line ValueError, checked before the C code
reads anything.
"""
from __future__ import annotations

import ctypes
import functools
from array import array
from pathlib import Path

import torch

from kvstrata.kernels import cpu_build
from kvstrata.kernels.kv_store import reference_store_kv, saturation
from kvstrata.kernels.layer_ops import reference_rms_norm, reference_rotary, reference_silu_and_mul

SOURCE = Path(__file__).with_name("cpu_layer_ops.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C file's DTYPE_* codes
SLOT_DTYPES = (torch.int32, torch.int64)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, loaded; None (and one line logged, once) where they cannot be built or loaded."""
    lib = cpu_build.load(SOURCE, "layer ops")
    if lib is None:
        return None
    i64, p, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.kvs_rms_norm.restype = c_int
    lib.kvs_rms_norm.argtypes = [p, p, p, p, p, c_int, i64, i64, i64, i64, i64, i64, c_float, c_int]
    lib.kvs_rotary.restype = c_int
    lib.kvs_rotary.argtypes = [p, p, p, p, c_int, i64, i64, i64, i64, i64, i64, i64, c_int]
    lib.kvs_silu_and_mul.restype = c_int
    lib.kvs_silu_and_mul.argtypes = [p, p, c_int, i64, i64, i64, c_int]
    lib.kvs_store_kv.restype = i64
    lib.kvs_store_kv.argtypes = [p, p, c_int, i64, i64, i64, i64, p, c_int, p, i64, i64, i64, p, c_int, i64, i64,
                                 i64, c_float]
    return lib


def available() -> bool:
    """Whether the compiled kernels run here (built, or buildable now)."""
    return library() is not None


def _failed(op: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"{op}: the CPU layer-ops kernel failed with status {status}")


# Each op's Python is written for its cost: a decode step makes ~150 of these calls, so what the call does besides the
# C code (checks, allocating its outputs, the ctypes call) is most of its time. `is_cpu` and `new_empty(*sizes)` are the
# cheap forms (`device.type` and `torch.empty(shape, dtype=...)` cost several times more).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_rms_norm`: the rows of `x` (`[T, N]`, or `[T, heads, N]` for a norm over each head; any strides
    but a contiguous last axis), plus `residual` (`[T, N]`) where given, normalised; returns the normalised rows and
    the summed input, both contiguous (the summed input is `x` itself without a residual)."""
    dtype = x.dtype
    lib = library()
    if dtype not in DTYPES or weight.dtype != dtype or not (x.is_cpu and weight.is_cpu) or lib is None or (
            residual is not None and (residual.dtype != dtype or not residual.is_cpu)):
        return reference_rms_norm(x, weight, eps, residual)
    shape, strides = x.shape, x.stride()
    n = shape[-1]
    if len(shape) not in (2, 3) or strides[-1] != 1 or weight.shape != (n,):
        raise ValueError(f"rms_norm: x {tuple(shape)} (2 or 3 axes, the last contiguous) does not fit weight "
                         f"{tuple(weight.shape)}")
    out = x.new_empty(*shape)
    if residual is None:
        summed, residual_ptr, residual_stride = x, None, 0
    else:
        if residual.shape != shape or len(shape) != 2 or residual.stride(1) != 1:
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must be x's shape {tuple(shape)}, two "
                             f"axes, its last contiguous")
        summed, residual_ptr, residual_stride = x.new_empty(*shape), residual.data_ptr(), residual.stride(0)
    heads = shape[1] if len(shape) == 3 else 1
    if shape[0] and heads and n:
        if weight.stride(0) != 1:
            weight = weight.contiguous()
        _failed("rms_norm", lib.kvs_rms_norm(
            x.data_ptr(), residual_ptr, weight.data_ptr(), out.data_ptr(), summed.data_ptr(), DTYPES[dtype],
            shape[0] * heads, heads, n, strides[0], strides[1] if heads > 1 else 0, residual_stride, eps,
            torch.get_num_threads()))
    return out, summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`reference_rotary` of `x [T, heads, head_dim]` (any strides but a contiguous last axis: q and k as views of
    the qkv product) by `cos` and `sin [T, head_dim]`; the output is contiguous."""
    dtype = x.dtype
    lib = library()
    if dtype not in DTYPES or cos.dtype != dtype or sin.dtype != dtype or lib is None or not (
            x.is_cpu and cos.is_cpu and sin.is_cpu):
        return reference_rotary(x, cos, sin)
    shape, strides = x.shape, x.stride()
    if len(shape) != 3 or shape[2] % 2 or strides[2] != 1:
        raise ValueError(f"rotary: x must be [T, heads, head_dim] with an even, contiguous head_dim, got "
                         f"{tuple(shape)}")
    num_tokens, heads, head_dim = shape
    cos_strides, sin_strides = cos.stride(), sin.stride()
    if cos.shape != (num_tokens, head_dim) or sin.shape != (num_tokens, head_dim) or head_dim and (
            cos_strides[1] != 1 or sin_strides[1] != 1):
        raise ValueError(f"rotary: cos and sin must be [{num_tokens}, {head_dim}] with a contiguous last axis, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    out = x.new_empty(num_tokens, heads, head_dim)
    if num_tokens and heads and head_dim:
        _failed("rotary", lib.kvs_rotary(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), DTYPES[dtype], num_tokens, heads,
            head_dim, strides[0], strides[1], cos_strides[0], sin_strides[0], torch.get_num_threads()))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference_silu_and_mul` of `x [T, 2 * n]` (rows any distance apart, each contiguous); out `[T, n]`."""
    lib = library()
    if x.dtype not in DTYPES or not x.is_cpu or lib is None:
        return reference_silu_and_mul(x)
    shape, strides = x.shape, x.stride()
    if len(shape) != 2 or shape[1] % 2 or strides[1] != 1:
        raise ValueError(f"silu_and_mul: x must be [T, 2 * n] with a contiguous last axis, got {tuple(shape)}")
    n = shape[1] // 2
    out = x.new_empty(shape[0], n)
    if shape[0] and n:
        _failed("silu_and_mul", lib.kvs_silu_and_mul(x.data_ptr(), out.data_ptr(), DTYPES[x.dtype], shape[0], n,
                                                     strides[0], torch.get_num_threads()))
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """`reference_store_kv`: each token's K and V `[T, kv_heads, head_dim]` (any strides but a contiguous last axis)
    into its slot of one layer of the cache, converted to the cache's dtype; negative slots are padding. Every slot
    is checked before anything is written: one outside the cache is a ValueError."""
    dtype = key.dtype
    lib = library()
    if dtype not in DTYPES or value.dtype != dtype or kv_cache.dtype not in DTYPES or lib is None or not (
            key.is_cpu and value.is_cpu and kv_cache.is_cpu):
        return reference_store_kv(key, value, kv_cache, layer, slot_mapping)
    shape, key_strides, value_strides = key.shape, key.stride(), value.stride()
    if len(shape) != 3 or value.shape != shape or key_strides[2] != 1 or value_strides[2] != 1:
        raise ValueError(f"store_kv: key {tuple(shape)} and value {tuple(value.shape)} must be one shape "
                         f"[T, kv_heads, head_dim] with a contiguous last axis")
    num_tokens, kv_heads, head_dim = shape
    cache_shape = kv_cache.shape
    if len(cache_shape) != 6 or cache_shape[2] != 2 or cache_shape[4:] != shape[1:] or kv_cache.stride(5) != 1:
        raise ValueError(f"store_kv: kv_cache shape {tuple(cache_shape)} does not hold {kv_heads} kv heads of "
                         f"dim {head_dim} (a contiguous last axis)")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache_shape[1]:
        raise ValueError(f"store_kv: layer {layer!r} is not one of the cache's {cache_shape[1]}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (num_tokens,) \
            or slot_mapping.dtype not in SLOT_DTYPES or not slot_mapping.is_cpu:
        raise ValueError(f"store_kv: slot_mapping must be a [{num_tokens}] int32 or int64 CPU tensor")
    if num_tokens == 0:
        return
    slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
    num_blocks, block_size = cache_shape[0], cache_shape[3]
    cache_strides = array("q", kv_cache.stride()[:5])  # held here: the C code reads it through its address
    bad = lib.kvs_store_kv(
        key.data_ptr(), value.data_ptr(), DTYPES[dtype], key_strides[0], key_strides[1], value_strides[0],
        value_strides[1], kv_cache.data_ptr(), DTYPES[kv_cache.dtype], cache_strides.buffer_info()[0], num_blocks,
        layer, block_size, slots.data_ptr(), slots.dtype == torch.int32, num_tokens, kv_heads, head_dim,
        saturation(dtype, kv_cache.dtype) or 0.0)
    if bad:
        raise ValueError(f"store_kv: token {bad - 1}'s slot {int(slots[bad - 1])} is outside the cache's "
                         f"{num_blocks * block_size} slots")


OPS = {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul, "store_kv": store_kv}  # KernelOps fields
