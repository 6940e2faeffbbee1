"""Prefix-prefill attention on a CPU as one compiled kernel (kernels/cpu_attention.c), with the signature of
`prefix_prefill.reference_prefix_prefill`: K/V read straight from the paged cache by the block table (no gather),
and batch-invariant by construction (a row's bits depend only on its own query and the keys it sees, never on the
other rows of the call, the thread count, or a cached prefix; see the C file).

The C source is built on first use, in about a second (kernels/cpu_build.py). Where there is no compiler, or the
build fails, one line is logged and `available()` is False; `prefix_prefill` then runs the torch reference. Caches whose
rows are not float32, bfloat16 or float16 (int8 with a scale per row, fp8) also take the reference.

On AVX-512 and AMX CPUs the default mode (not the batch-invariant one) computes long prefills with ATen's CPU flash
attention instead (`flash_prefix_prefill`: K/V gathered, two parts merged by their log-sum-exps), since that picks
the CPU's widest vectors when it runs while the C code runs AVX2 instructions; its rows are then not batch-invariant.

Threads: the C code splits (sequence, KV head, query block) items over `torch.get_num_threads()` threads of the
pool it keeps (kernels/cpu_threads.h; not OpenMP: a second OpenMP runtime beside torch's can clash); each output is
computed wholly by one thread.
"""
from __future__ import annotations

import ctypes
import functools
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.kernels import cpu_build, cpu_features
from kvstrata.kernels.prefix_prefill import reference_prefix_prefill

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_HEAD_DIM = 512  # the C file's limits: head_dim a multiple of LANES up to this, GQA groups up to MAX_GROUP
HEAD_DIM_MULTIPLE = 8
MAX_GROUP = 64
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C file's DTYPE_* codes
_ERRORS = {-2: "out of memory", -4: "unsupported shape"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, loaded; None (and one line logged, once) where it cannot be built or loaded."""
    lib = cpu_build.load(SOURCE, "attention")
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the C functions' signatures declared (any build of this file's interface)."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.kvs_prefix_prefill.restype = ctypes.c_int
    lib.kvs_prefix_prefill.argtypes = [
        p, ctypes.c_int, i64, i64,                      # query, dtype, strides
        p, ctypes.c_int, p, i64, ctypes.c_int, ctypes.c_int,  # cache, dtype, strides, num_blocks, layer, block_size
        p, ctypes.c_int, i64, p, p,                     # block tables, int32?, row stride, query starts, seq lens
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,  # seqs, heads, kv heads, dim, scale
        p, i64, i64, ctypes.c_int]                      # out, strides, threads
    lib.kvs_check_block_tables.restype = ctypes.c_long
    lib.kvs_check_block_tables.argtypes = [p, ctypes.c_int, i64, p, ctypes.c_int, ctypes.c_int, i64]
    return lib


def available() -> bool:
    """Whether the compiled kernel runs here (built, or buildable now)."""
    return library() is not None


def supports(kv_cache: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether the compiled kernel computes this call (else the torch reference does): CPU tensors, a cache and
    query of float32, bfloat16 or float16, head_dim a multiple of 8 (every model we know), and the kernel built."""
    return (kv_cache.is_cpu and query.is_cpu and kv_cache.dtype in CACHE_DTYPES
            and query.dtype in CACHE_DTYPES and query.shape[-1] % HEAD_DIM_MULTIPLE == 0 and available())


# CPU families whose default mode computes a long prefill's attention with ATen's CPU flash attention
# (`flash_prefix_prefill`), which picks its vector width when it runs: AVX-512 and AMX CPUs, where this file's kernel
# runs AVX2 code. On AVX2 the two measured alike, and this kernel's bits hold in both modes: it stays.
FLASH_FAMILIES = ("avx512", "amx")
FLASH_MIN_NEW_TOKENS = 128  # fewer new tokens (a decode, a question after a cached document) stay on this kernel


@functools.cache
def flash_here() -> bool:
    """Whether the host CPU's default mode takes long prefills to ATen's flash attention (`FLASH_FAMILIES`)."""
    return cpu_features.cpu_matrix_family() in FLASH_FAMILIES


def prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None, *, batch_invariant: bool = False) -> torch.Tensor:
    """`reference_prefix_prefill`, computed by the compiled kernel where `supports` says so, its results
    batch-invariant. In the default mode (`batch_invariant` False) on `FLASH_FAMILIES`, the sequences with at least
    `FLASH_MIN_NEW_TOKENS` new tokens are computed by `flash_prefix_prefill` instead."""
    if not supports(kv_cache, query):
        return reference_prefix_prefill(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, scale, out,
                                        batch_invariant=batch_invariant)
    call = _checked_call(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, out)  # before any read
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if not batch_invariant and flash_here() and query.dtype == kv_cache.dtype and query.shape[0] >= FLASH_MIN_NEW_TOKENS:
        starts = call.query_start
        long = [b for b in range(len(call.seq_lens)) if starts[b + 1] - starts[b] >= FLASH_MIN_NEW_TOKENS]
        if long:
            for b in long:
                flash_prefix_prefill(query[starts[b]:starts[b + 1]], kv_cache, layer, call.block_tables[b],
                                     call.seq_lens[b], scale, out[starts[b]:starts[b + 1]])
            short = [b for b in range(len(call.seq_lens)) if b not in long]
            for first, last in _runs(short):  # the other sequences' rows, a run of neighbours at a time
                rows = slice(starts[first], starts[last + 1])
                prefix_prefill(query[rows], kv_cache, layer, call.block_tables[first:last + 1],
                               query_start_loc[first:last + 2] - starts[first], seq_lens[first:last + 1], scale,
                               out[rows], batch_invariant=True)
            return out
    direct = out.dtype == torch.float32 and out.stride()[-1] == 1
    result = out if direct else torch.empty(query.shape, dtype=torch.float32)
    query_strides, result_strides, table_stride = call.query_strides, result.stride(), call.block_tables.stride()[0]
    lib = library()
    tables = call.block_tables
    status = lib.kvs_prefix_prefill(
        query.data_ptr(), CACHE_DTYPES[query.dtype], query_strides[0], query_strides[1],
        kv_cache.data_ptr(), CACHE_DTYPES[kv_cache.dtype], call.cache_strides.buffer_info()[0], kv_cache.shape[0],
        layer, kv_cache.shape[3], tables.data_ptr(), tables.dtype == torch.int32, table_stride,
        call.query_start.buffer_info()[0], call.seq_lens.buffer_info()[0], len(call.seq_lens), query.shape[1],
        kv_cache.shape[4], query.shape[2], float(scale), result.data_ptr(), result_strides[0], result_strides[1],
        torch.get_num_threads())
    if status == -1:
        seq = lib.kvs_check_block_tables(tables.data_ptr(), tables.dtype == torch.int32, table_stride,
                                         call.seq_lens.buffer_info()[0], len(call.seq_lens), kv_cache.shape[3],
                                         kv_cache.shape[0])
        raise ValueError(f"prefix_prefill: sequence {seq}'s block table names a block outside the cache's "
                         f"{kv_cache.shape[0]}")
    if status != 0:
        raise RuntimeError(f"prefix_prefill: the CPU attention kernel failed: {_ERRORS.get(status, status)}")
    if not direct:
        out.copy_(result)
    return out


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive indices as (first, last) pairs: [0, 1, 3] -> [(0, 1), (3, 3)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def flash_prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                         seq_len: int, scale: float, out: torch.Tensor) -> torch.Tensor:
    """One sequence's attention, `reference_prefix_prefill`'s, by ATen's CPU flash attention: its `n` new tokens
    (`query [n, heads, head_dim]`, the last `n` of its `seq_len` positions) over the cached prefix (every key, no
    mask) and over themselves (causal), the two parts merged by their log-sum-exps:
    `out = (o1 * e^(l1 - m) + o2 * e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m))`, `m = max(l1, l2)`. ATen's flash
    kernel takes a causal mask only where queries and keys start at the same position, hence two parts. K/V are
    gathered from the paged cache first (ATen reads contiguous keys); GQA heads share their K/V head as ATen's
    flash kernel groups them (head h reads KV head h // group). Written into `out` (rows `[n, heads, head_dim]`)."""
    n = query.shape[0]
    block_size = kv_cache.shape[3]
    blocks = block_table[:(seq_len + block_size - 1) // block_size].long()
    if len(blocks) and not 0 <= int(blocks.min()) <= int(blocks.max()) < kv_cache.shape[0]:
        raise ValueError(f"prefix_prefill: a block table names a block outside the cache's {kv_cache.shape[0]}")
    kv = kv_cache[blocks, layer]                                         # [blocks, 2, block_size, kv_heads, dim]
    keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[:seq_len].transpose(0, 1).unsqueeze(0)   # [1, kv_heads, L, dim]
    values = kv[:, 1].reshape(-1, *kv.shape[-2:])[:seq_len].transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0)                               # [1, heads, n, dim]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached = seq_len - n
    new_out, new_lse = flash(q, keys[:, :, cached:], values[:, :, cached:], 0.0, True, scale=scale)[:2]
    if cached == 0:
        out.copy_(new_out[0].transpose(0, 1))
        return out
    old_out, old_lse = flash(q, keys[:, :, :cached], values[:, :, :cached], 0.0, False, scale=scale)[:2]
    top = torch.maximum(new_lse, old_lse)
    w_new, w_old = torch.exp(new_lse - top), torch.exp(old_lse - top)   # [1, heads, n], float32
    total = w_new + w_old
    merged = (new_out.float() * (w_new / total).unsqueeze(-1) + old_out.float() * (w_old / total).unsqueeze(-1))
    out.copy_(merged[0].transpose(0, 1))
    return out


@dataclass(frozen=True)
class _Call:
    """A call's index arguments in the forms the C code reads: the block tables as given (int32 or int64, rows
    contiguous), the rest as int64 arrays."""

    block_tables: torch.Tensor
    query_start: array
    seq_lens: array
    cache_strides: array
    query_strides: tuple[int, ...]


TABLE_DTYPES = (torch.int32, torch.int64)


def _index_list(name: str, tensor: torch.Tensor) -> list[int]:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.dtype not in TABLE_DTYPES:
        raise ValueError(f"prefix_prefill: {name} must be a 1-D int32 or int64 tensor")
    return tensor.tolist()


def _checked_call(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None) -> _Call:
    """Every property the C code relies on, checked, so that bad input is a ValueError and never a bad read.
    (The block ids themselves are checked by the C code, before it reads anything, against the cache's size.)
    Plain Python over the lengths: a call's few sequences cost less so than in tensor operations; each tensor's
    strides are read once, as a tuple (`stride(i)` costs as much as the whole tuple), and `is_cpu` rather than
    `device.type`: the checks run in every layer of every step."""
    if query.dim() != 3 or (query_strides := query.stride())[-1] != 1:
        raise ValueError(f"prefix_prefill: query must be [tokens, heads, head_dim] with a contiguous last axis, "
                         f"got shape {tuple(query.shape)} strides {query.stride()}")
    if kv_cache.dim() != 6 or (cache_strides := kv_cache.stride())[-1] != 1:
        raise ValueError(f"prefix_prefill: kv_cache must be [blocks, layers, 2, block_size, kv_heads, head_dim] "
                         f"with a contiguous last axis, got shape {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, num_layers, parts, block_size, num_kv_heads, row = kv_cache.shape
    if parts != 2 or row != head_dim:
        raise ValueError(f"prefix_prefill: kv_cache rows of {row} do not fit query's head_dim {head_dim}")
    if not 0 < head_dim <= MAX_HEAD_DIM or num_kv_heads == 0 or num_heads % num_kv_heads \
            or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"prefix_prefill: {num_heads} query heads over {num_kv_heads} KV heads of {head_dim} "
                         f"values is not supported")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"prefix_prefill: layer {layer!r} is not one of the cache's {num_layers}")
    if out is not None and (out.shape != query.shape or not out.is_cpu):
        raise ValueError(f"prefix_prefill: out {tuple(out.shape)} does not match query {tuple(query.shape)}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 \
            or block_tables.dtype not in TABLE_DTYPES or not block_tables.is_cpu:
        raise ValueError("prefix_prefill: block_tables must be a 2-D int32 or int64 CPU tensor")
    tables = block_tables if block_tables.stride()[1] == 1 else block_tables.contiguous()
    starts = _index_list("query_start_loc", query_start_loc)
    lengths = _index_list("seq_lens", seq_lens)
    if len(starts) != len(lengths) + 1 or tables.shape[0] < len(lengths):
        raise ValueError(f"prefix_prefill: {len(lengths)} seq_lens need {len(lengths) + 1} query_start_loc and as "
                         f"many block table rows, got {len(starts)} and {tables.shape[0]}")
    capacity = tables.shape[1] * block_size
    if starts[0] != 0 or starts[-1] != num_tokens or any(
            not 0 <= starts[b + 1] - starts[b] <= length <= capacity for b, length in enumerate(lengths)):
        raise ValueError(f"prefix_prefill: query_start_loc {starts} and seq_lens {lengths} do not describe "
                         f"{num_tokens} query tokens (each sequence's new tokens within its length, its length "
                         f"within the block table's {tables.shape[1]} blocks of {block_size})")
    return _Call(tables, array("q", starts), array("q", lengths), array("q", cache_strides[:5]), query_strides)
