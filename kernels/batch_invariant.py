"""Row reductions whose bits do not depend on how many rows share the call: the linear layers' products and the
mean over the last axis (RMSNorm's). The batch-invariant mode (`model.batch_invariant`) routes a model's own calls
here, so a token's hidden state is the same whether it was computed in a long prefill, a short suffix after a
cached prefix, a decode step or beside other requests.

Why the default calls are not enough: a GEMM library picks its kernel, and with it the order in which a row's
products are summed, from the problem's shape. On an AVX2 CPU, float32 `x @ W.T` gives other bits for a row when the
call has 1-3 rows than when it has more (MKL's small-M path), and OpenBLAS' (numpy's) bits depend on a row's place
in a product of fixed shape; cuBLAS picks tiles and split-K from M. A CUDA reduction picks its threads per row
from the row count.

The cures, each with a torch reference beside the Triton kernel:
- `linear`: rows in tiles of a fixed height, every tile one [T, K] x [K, N] product, K never split (torch: one
  batched product over the tiles, the weight shared, T chosen by CPU family and dtype in `LINEAR_TILE_ROWS`; or,
  where the family's BLAS keeps rows alike in calls of a multiple of some row count, one product padded to it,
  `LINEAR_ROW_MULTIPLE`; Triton: fixed BLOCK_M x BLOCK_N tiles walking K in fixed BLOCK_K steps, never split-K,
  whatever M is).
  Backend "cpu" computes its products with neither: kernels/cpu_linear.py, one in-order reduction over K per output
  element, batch-invariant by construction on every CPU family; these stay the "torch" backend's, and its fallback.
- `mean_last_dim`: each row reduced alone in a fixed order (torch's CPU reduction already reduces an inner axis
  row by row whatever their number; Triton: one program per row).
"""
from __future__ import annotations

import functools

import torch

from kvstrata.kernels import cpu_features
from kvstrata.kernels.triton_compat import check_launchable, jit, tl, triton


# Rows per fixed-shape product of `reference_linear`, by the CPU's widest matrix unit and the dtype. A product of
# one shape runs one kernel, so a row's bits depend only on its own values whatever else is in the call (checked in
# tests/test_batch_invariant_outputs.py for every tile here). Measured on AVX2 (one thread, [M, 576] x [576, 1536]):
# bfloat16 costs the same per row alone as in any tile (its kernel computes one row at a time anyway), so 1; float32
# a row at a time forgoes MKL's GEMM and costs more than in 16-row tiles, though a lone decode row padded to 16 costs
# several times its own product. AVX-512 and AMX were not measured: their tiles follow the units' shapes (AMX: 16
# rows a tile register) and must be re-measured on such a CPU.
LINEAR_TILE_ROWS = {
    ("amx", torch.bfloat16): 32, ("amx", torch.float32): 16,
    ("avx512", torch.bfloat16): 16, ("avx512", torch.float32): 16,
    ("avx2", torch.bfloat16): 1, ("avx2", torch.float32): 16,
}


# Families whose BLAS gives a row the same bits in every call whose row count is a multiple of this, whatever the
# count or the row's place. Measured on AVX2 (MKL's float32 GEMM, one and two threads, every linear shape of the
# embedded model, calls of 4 to 1,160 rows at any offset; counts not a multiple of 4 differ, and with one thread
# only counts under 4). There a product needs at most 3 padding rows, not
# fixed tiles, and costs about F.linear's own time. Each shape is checked once per process before it is trusted
# (`_library_keeps_rows_alike`); where the library does otherwise, the tiles above are used.
LINEAR_ROW_MULTIPLE = {("avx2", torch.float32): 4}


def cpu_matrix_isa() -> str:
    """'amx', 'avx512' or 'avx2' (anything narrower counts as avx2): the widest unit a CPU GEMM may use, by the
    probe the engine's `dtype: auto` asks too (kernels/cpu_features.py; `KVSTRATA_CPU_AMX` forces its AMX answer).
    Tests patch this to check every tile's invariance on any CPU."""
    return cpu_features.cpu_matrix_family()


def linear_tile_rows(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """Rows per product for `reference_linear` on this device; 1 (one product per row) off the CPU and for dtypes
    the table does not name."""
    if torch.device(device).type != "cpu":
        return 1
    return LINEAR_TILE_ROWS.get((cpu_matrix_isa(), dtype), 1)


def linear_row_multiple(x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The row multiple `reference_linear` pads to for this product on the host's CPU, or None where it cuts tiles (a
    family `LINEAR_ROW_MULTIPLE` does not name, another device, or a shape whose check failed)."""
    if x.device.type != "cpu":
        return None
    multiple = LINEAR_ROW_MULTIPLE.get((cpu_matrix_isa(), x.dtype))
    if multiple is None or not _library_keeps_rows_alike(x.shape[-1], weight.shape[0], x.dtype, multiple,
                                                         weight.t().is_contiguous(), torch.get_num_threads()):
        return None
    return multiple


@functools.cache
def _library_keeps_rows_alike(K: int, N: int, dtype: torch.dtype, multiple: int, weight_in_out: bool,
                              threads: int) -> bool:
    """Whether this process's BLAS gives rows the same bits in calls of several multiples of `multiple` rows at
    several offsets, for a [K, N] product with the weight laid out as the engine's (`weight_in_out`: stored
    [in, out]) on `threads` threads: the property `LINEAR_ROW_MULTIPLE` relies on, checked on random values."""
    gen = torch.Generator().manual_seed(K * 7919 + N)
    x = torch.randn(24 * multiple, K, generator=gen).to(dtype)
    weight = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    weight_t = weight.t().contiguous() if weight_in_out else weight.t()
    whole = x @ weight_t
    calls = [(0, multiple), (3, multiple), (1, 2 * multiple), (5, 3 * multiple), (2, 8 * multiple), (7, 16 * multiple)]
    return all(torch.equal(x[start:start + rows] @ weight_t, whole[start:start + rows]) for start, rows in calls)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed so that a row's bits cannot depend on how many rows share the call:
    where the CPU's BLAS keeps rows alike in calls of a multiple of some row count (`LINEAR_ROW_MULTIPLE`), one
    product with the rows padded to that multiple; otherwise the rows cut into tiles of `tile_rows` (the last padded
    with zeros), every tile one [tile_rows, K] x [K, N] product of one batched call, the weight broadcast, not
    copied, K never split. `tile_rows` (given: always tiles) defaults to `linear_tile_rows`."""
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    multiple = None if tile_rows else linear_row_multiple(x, weight)
    if multiple:
        pad = -M % multiple
        padded = torch.cat([rows, rows.new_zeros(pad, K)]) if pad else rows
        out = (padded @ weight.t())[:M].view(*x.shape[:-1], N)
        return out + bias if bias is not None else out
    tile = tile_rows or linear_tile_rows(x.dtype, x.device)
    pad = -M % tile
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, K)])
    tiles = rows.view(-1, tile, K)
    out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], -1, -1)).view(-1, N)
    out = (out[:M] if pad else out).view(*x.shape[:-1], N)
    return out + bias if bias is not None else out


def reference_mean_last_dim(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`x.mean(-1)`: torch's CPU reduction of a contiguous inner axis reduces each row by itself, the same way for
    any number of rows (checked in tests/test_kernels_batch_invariant.py)."""
    return x.mean(dim=-1, keepdim=keepdim)


# Fixed tiles: M never changes a tile's shape or the order K is walked in (no split-K).
LINEAR_BLOCK_M = 64
LINEAR_BLOCK_N = 64
LINEAR_BLOCK_K = 32
MEAN_BLOCK = 1024


@jit
def _linear_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (m, n) computes out[m-tile, n-tile] = x[m-tile] @ weight[n-tile].T, K in BLOCK_K steps, in order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = k_start + offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weight_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@jit
def _mean_last_dim_kernel(x_ptr, out_ptr, N, stride_xm, BLOCK: tl.constexpr):
    """Program r: the mean of row r, summed in BLOCK-wide lanes along the row, then across the lanes."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lanes = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        lanes += tl.load(x_ptr + row * stride_xm + start + offs, mask=start + offs < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(lanes, axis=0) / N).to(out_ptr.dtype.element_ty))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `reference_linear`: `x [..., K]`, `weight [N, K]` -> `[..., N]` in x's dtype, float32
    accumulation, one tiling for every M."""
    from kvstrata.kernels.prefix_prefill import _dot_dtype

    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    check_launchable("linear", x, weight, *(() if bias is None else (bias,)))
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (M, K), N = rows.shape, weight.shape[0]
    out = rows.new_empty(M, N)
    dot_dtype = _dot_dtype(x.dtype)
    _linear_kernel[(triton.cdiv(M, LINEAR_BLOCK_M), triton.cdiv(N, LINEAR_BLOCK_N))](
        rows, weight, bias if bias is not None else out, out, M, N, K, rows.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N,
        BLOCK_K=LINEAR_BLOCK_K, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")
    return out.view(*x.shape[:-1], N)


def mean_last_dim(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Triton version of `reference_mean_last_dim`."""
    check_launchable("mean_last_dim", x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0])
    if rows.shape[0]:
        _mean_last_dim_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=MEAN_BLOCK)
    return out.view(*x.shape[:-1], 1) if keepdim else out.view(x.shape[:-1])
