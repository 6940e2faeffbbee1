"""The elementwise and per-row parts of a decoder layer, each fused into one kernel: RMSNorm (with the residual add
before it), rotary position embedding, and SiLU-and-multiply.

transformers runs each of them as a chain of small ops (its RMSNorm alone is eight kernels in bf16: a cast, a
square, a mean, an add, a reciprocal square root, a product, a cast back, the weight), so a layer launches about 45
kernels; with these, about 11 (engine/decoder.py). On a GPU the launches and the Python around them, not the
arithmetic, set the time of a step with few tokens (a decode, a question after a cached document).

Each torch reference is transformers' own code for the part (the CPU path computes exactly what transformers
computes). The Triton versions compute the same operations in the same order, rounding to the input dtype where
torch does, so they match the references to the dtype's rounding; a row's bits never depend on the other rows, so
they serve the batch-invariant mode as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels.triton_compat import check_launchable, jit, tl, triton

MAX_ROW = 1 << 16  # the widest row one program of the norm holds in registers (hidden sizes go to 16k)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis of `residual + x` (or of `x`): returns the normalised rows and the summed input,
    which the next residual add starts from. transformers' LlamaRMSNorm: the mean square in float32, the rows cast
    back to x's dtype before the weight multiplies them."""
    summed = x if residual is None else residual + x
    rows = summed.to(torch.float32)
    variance = rows.pow(2).mean(-1, keepdim=True)
    normalised = rows * torch.rsqrt(variance + eps)
    return weight * normalised.to(summed.dtype), summed


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x [T, heads, head_dim]` at each token's position: `cos` and `sin [T, head_dim]` as
    transformers' rotary module gives them (its frequencies twice over, scaled, in x's dtype), applied as its
    `apply_rotary_pos_emb` does (the two halves of each head rotated as one complex number each)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `x [T, 2 * n]`, gate and up side by side (a gated MLP's one product for both)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, N, heads, stride_xt, stride_xh,
                     stride_rt, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program r normalises row r, which is (token r // heads, head r % heads) of x (heads is 1 for [T, N] rows):
    rows are read through their strides, written contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (row // heads) * stride_xt + (row % heads) * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rt + offs, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(dtype)
        tl.store(summed_ptr + row * N + offs, x, mask=mask)
    rows = x.to(tl.float32)
    variance = tl.sum(rows * rows, axis=0) / N
    normalised = (rows * tl.math.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + offs, (weight.to(tl.float32) * normalised.to(tl.float32)).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference_rms_norm`, one program per row. `x` is `[T, N]` or `[T, heads, N]` (a norm
    over each head, Qwen3's), read through its strides; `residual` is `[T, N]` with a contiguous last axis. The
    outputs are contiguous."""
    n = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} (contiguous last axis) does not fit weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or x.dim() != 2
                                 or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must be x's shape "
                         f"{tuple(x.shape)} and dtype, two axes, contiguous last")
    if n > MAX_ROW:
        raise ValueError(f"rms_norm: rows of {n} values exceed {MAX_ROW}")
    check_launchable("rms_norm", x, weight, *(() if residual is None else (residual,)))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * heads
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, summed, n, heads, x.stride(0),
            x.stride(1) if x.dim() == 3 else 0, residual.stride(0) if residual is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, summed


@jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """Program t rotates every head of token t: [HEADS, HALF_BLOCK] tiles of each half, every product rounded to
    x's dtype before the sum as torch rounds it. Arithmetic is in float32 (the interpreter holds bf16 as raw
    bits), rounded to the dtype where torch's bf16 and fp16 ops round."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS)
    offs_d = tl.arange(0, HALF_BLOCK)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    d_ok = offs_d < HALF
    cos1 = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_ct + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_st + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    dest = out_ptr + token * heads * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dest, out1.to(dtype), mask=mask)
    tl.store(dest + HALF, out2.to(dtype), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference_rotary`, one program per token for all its heads; `x` is read through its
    strides (q and k heads side by side in the qkv product), the output is contiguous."""
    num_tokens, heads, head_dim = x.shape if x.dim() == 3 else (None, None, None)
    if x.dim() != 3 or head_dim % 2 or x.stride(2) != 1:
        raise ValueError(f"rotary: x must be [T, heads, head_dim] with an even, contiguous head_dim, got "
                         f"{tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, head_dim) or t.dtype != x.dtype or t.stride(1) != 1:
            raise ValueError(f"rotary: {name} must be [{num_tokens}, {head_dim}] {x.dtype}, got {tuple(t.shape)} "
                             f"{t.dtype}")
    check_launchable("rotary", x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                      sin.stride(0), HALF=half, HEADS=triton.next_power_of_2(heads),
                                      HALF_BLOCK=triton.next_power_of_2(half))
    return out


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_xt, BLOCK: tl.constexpr):
    """Program (t, c) computes elements [c * BLOCK, (c + 1) * BLOCK) of token t's output."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + token * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + n + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + token * n + offs, (silu.to(tl.float32) * up).to(dtype), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference_silu_and_mul` for `x [T, 2 * n]` with a contiguous last axis."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul: x must be [T, 2 * n] with a contiguous last axis, got {tuple(x.shape)}")
    check_launchable("silu_and_mul", x)
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] and n:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, _SILU_BLOCK))](x, out, n, x.stride(0), BLOCK=_SILU_BLOCK)
    return out
