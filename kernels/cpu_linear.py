"""A linear layer on a CPU as one compiled kernel (kernels/cpu_linear.c), with `F.linear`'s signature and result,
batch-invariant by construction: each output element is one reduction over K in order, computed wholly by one
thread, so a row's bits never depend on how many rows share the call, its place in it, or the thread count (see
the C file). It needs no padding and no fixed tiles, and is the same code on every CPU family.

What it makes fast is the CPU decoder's layout: a weight stored `[in, out]` row-major and passed as its transposed
view (`weight.t().is_contiguous()`, engine/decoder.py `pack`). Weights of float32, bfloat16 or float16 (x of the
same dtype) are computed here, in float32, the result rounded to the dtype; a weight stored `[out, in]`, another
dtype, or a CPU where the kernel cannot be built takes `fallback` (`F.linear`, or the caller's invariant reference).

Threads: the C code splits (row block, column chunk) items over `torch.get_num_threads()` threads of the pool it
keeps (kernels/cpu_threads.h; not OpenMP: a second OpenMP runtime beside torch's can clash); each output element
is computed wholly by one thread.
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvstrata.kernels import cpu_build, cpu_features

SOURCE = Path(__file__).with_name("cpu_linear.c")
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C file's DTYPE_* codes
_ERRORS = {-2: "out of memory", -4: "unsupported shape"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, loaded; None (and one line logged, once) where it cannot be built or loaded."""
    lib = cpu_build.load(SOURCE, "linear")
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the C functions' signatures declared (any build of this file's interface, older ones included)."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.kvs_linear.restype = ctypes.c_int
    lib.kvs_linear.argtypes = [p, i64, i64, i64,          # x, its row stride, M, K
                               p, ctypes.c_int, i64, i64,  # weight [K, N], dtype, row stride, N
                               p, p, i64, ctypes.c_int]    # bias, out, its row stride, threads
    if hasattr(lib, "kvs_linear_16"):  # 16-bit x and out (a kernel built from an older source lacks it)
        lib.kvs_linear_16.restype, lib.kvs_linear_16.argtypes = ctypes.c_int, lib.kvs_linear.argtypes
    return lib


def available() -> bool:
    """Whether the compiled kernel runs here (built, or buildable now)."""
    return library() is not None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the compiled kernel computes this call (else `fallback` does): CPU tensors of one dtype among float32,
    bfloat16 and float16, the weight stored `[in, out]` (its transposed view contiguous), the kernel built."""
    return (weight.dtype in WEIGHT_DTYPES and x.dtype == weight.dtype and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.stride(0) == 1
            and weight.stride(1) >= max(weight.shape[0], 1) and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fallback=F.linear) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: `x [..., K]`, `weight [N, K]`, `bias [N]` -> `[..., N]` in x's dtype, computed
    by the compiled kernel where `supports` says so (float32 accumulation, the bias added after the reduction,
    then rounded to the dtype), else by `fallback(x, weight, bias)`.

    A decode step makes over a hundred calls, so the common case (2-D float32 x, a weight stored [in, out]) is
    checked in a few attribute reads, each read once; anything else goes through `_check` and `supports`."""
    lib, code = library(), WEIGHT_DTYPES.get(x.dtype)
    x_shape, w_shape, w_stride = x.shape, weight.shape, weight.stride()
    if (code is None or weight.dtype != x.dtype or not (x.is_cpu and weight.is_cpu) or len(w_shape) != 2
            or not x_shape or x_shape[-1] != w_shape[1] or w_stride[0] != 1 or w_stride[1] < w_shape[0]
            or (bias is not None and not _plain_bias(bias, w_shape[0])) or lib is None):
        _check(x, weight, bias)  # bad input: a ValueError before any read
        if not supports(x, weight):
            return fallback(x, weight, bias)
    N, K = w_shape
    # 16-bit x and out are converted in C: as torch ops, their OpenMP threads spin after each conversion and take
    # a core from the product's threads (two threads then gained far less over one in bfloat16 than in float32)
    keep = x.dtype if code and hasattr(lib, "kvs_linear_16") else torch.float32
    if len(x_shape) == 2 and x.dtype is keep and x.stride(1) == 1 and x.stride(0) >= K:
        rows, M, ldx = x, x_shape[0], x.stride(0)
    else:
        rows = x.reshape(math.prod(x_shape[:-1]), K).to(keep, memory_format=torch.contiguous_format)
        if rows.stride(-1) != 1 or rows.stride(0) != K:
            rows = rows.contiguous()
        M, ldx = rows.shape[0], K
    out = torch.empty((M, N), dtype=keep)
    if bias is not None and (bias.dtype is not torch.float32 or bias.stride(0) != 1):
        bias = bias.to(torch.float32).contiguous()
    product = lib.kvs_linear_16 if keep is not torch.float32 else lib.kvs_linear
    status = product(rows.data_ptr(), ldx, M, K, weight.data_ptr(), code, w_stride[1], N,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), N, torch.get_num_threads())
    if status:
        raise RuntimeError(f"linear: the CPU linear kernel failed: {_ERRORS.get(status, status)}")
    if out.dtype is not x.dtype:
        out = out.to(x.dtype)
    return out if len(x_shape) == 2 else out.view(*x_shape[:-1], N)


# The dtypes whose products the default mode (not only the invariant one) computes here, by CPU family, and up to how
# many rows a call (None: any). AVX2: bfloat16 products of every row count (this kernel beat `F.linear` at every
# product of the embedded model, 1 to 2,048 rows, torch having no bfloat16 GEMM for AVX2 there); float32 stays MKL's,
# faster for one row. AVX-512 and AMX: torch's bfloat16 GEMM (oneDNN, with the CPU's bfloat16 dot products or tiles)
# for a prefill's many rows; a decode's or a short question's few rows (up to FEW_ROWS; this kernel reads bfloat16
# weights where they lie up to twice as many) here, since such a step is bound by reading the weights, which this
# kernel reads once, in place, at half float32's bytes, while torch's bfloat16 decode step was reported slower there
# than its float32 one.
FEW_ROWS = 16
MODEL_DTYPES = {"avx2": {torch.bfloat16: None},
                "avx512": {torch.bfloat16: FEW_ROWS},
                "amx": {torch.bfloat16: FEW_ROWS}}


@functools.cache
def _model_dtypes() -> dict[torch.dtype, int | None]:
    return MODEL_DTYPES.get(cpu_features.cpu_matrix_family(), {})


def takes_default_products(dtype: torch.dtype) -> bool:
    """Whether `model_linear` computes all of `dtype`'s products with this kernel on the host's CPU (`MODEL_DTYPES`)."""
    limits = _model_dtypes()
    return dtype in limits and limits[dtype] is None


def model_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The default mode's products on a CPU (the "cpu" backend's `model_linear`): `linear` for the dtypes, and row
    counts, the host's CPU family computes faster (`MODEL_DTYPES`), `F.linear` for the others."""
    limits = _model_dtypes()
    if x.dtype in limits:
        most = limits[x.dtype]
        if most is None or x.numel() <= most * x.shape[-1]:
            return linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _plain_bias(bias: torch.Tensor, n: int) -> bool:
    return isinstance(bias, torch.Tensor) and bias.is_cpu and bias.shape == (n,) and bias.is_floating_point()


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The properties the C code relies on, checked, so that bad input is a ValueError and never a bad read."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x {_shape(x)} does not fit weight {_shape(weight)} (expected x [..., K], "
                         f"weight [N, K])")
    if x.dtype != weight.dtype or not x.is_floating_point() or x.device != weight.device:
        raise ValueError(f"linear: x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must "
                         f"be floating point, of one dtype, on one device")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)
                             or bias.device != weight.device or not bias.is_floating_point()):
        raise ValueError(f"linear: bias {_shape(bias)} must be a floating-point vector of {weight.shape[0]} on "
                         f"{weight.device}")


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
