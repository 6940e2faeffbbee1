"""Prefix prefill: the new tokens of a batch of sequences attend, causally, to their cached context plus themselves,
reading K/V from the paged cache through each sequence's block table.

Inputs (vLLM's names): `query [T, num_heads, head_dim]` holds every sequence's new tokens packed back to back;
`query_start_loc [B+1]` their cumulative counts; `seq_lens [B]` each sequence's total KV length including the new
tokens, whose K/V `store_kv` has already written; `block_tables [B, max_blocks]` the device block of each logical
block. New token i of a sequence with q_len new tokens sits at position `seq_len - q_len + i` and sees keys
`0 ..= seq_len - q_len + i`. Query head h reads KV head `h // (num_heads // num_kv_heads)` (GQA).
Decode is the case q_len == 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels.triton_compat import check_launchable, tl, triton


def gather_sequence_kv(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` positions, `[num_kv_heads, seq_len, head_dim]` each:
    whole blocks are selected at once, then the tail of the last (partial) block is cut off."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    # advanced indexing, not index_select on the strided layer view: the latter is ~100x slower on CPU
    blocks = kv_cache[block_ids, layer]  # [n, 2, block_size, kv_heads, head_dim]
    key = blocks[:, 0].reshape(num_blocks * block_size, *blocks.shape[-2:])[:seq_len]
    value = blocks[:, 1].reshape(num_blocks * block_size, *blocks.shape[-2:])[:seq_len]
    return key.transpose(0, 1), value.transpose(0, 1)


def causal_suffix_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask `[q_len, kv_len]`, True where query i (at position kv_len - q_len + i) may see key j.
    SDPA's own `is_causal` aligns the diagonal top-left, which is wrong whenever q_len < kv_len."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token attending to all `kv_len` keys: `query [num_heads, head_dim]`, `key/value [num_kv_heads,
    kv_len, head_dim]`. Plain fp32 matmuls over the query heads grouped by KV head: on a CPU, SDPA's one-row
    path measured 6-9x slower in bf16 (and no faster in fp32), see benchmarks/results/kernels.md."""
    num_kv_heads, _, head_dim = key.shape
    grouped = query.reshape(num_kv_heads, -1, head_dim).float()  # [kv_heads, group, head_dim]
    scores = torch.matmul(grouped, key.float().transpose(1, 2)) * scale
    attn = torch.matmul(scores.softmax(dim=-1), value.float())
    return attn.reshape(query.shape).to(query.dtype)


def reference_prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference and CPU path: per sequence, gather its K/V blocks, then one SDPA call (prefill) or two
    matmuls (decode)."""
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    for seq, kv_len in enumerate(kv_lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        key, value = gather_sequence_kv(kv_cache, layer, block_tables[seq], kv_len)
        if q_len == 1:
            out[q_start] = decode_attention(query[q_start], key, value, scale)
            continue
        out[q_start:q_end] = prefill_attention(query[q_start:q_end], key, value, scale)
    return out


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """New tokens `query [q_len, num_heads, head_dim]` attending causally to `key/value [num_kv_heads, kv_len,
    head_dim]`, whose last q_len positions are the new tokens themselves. Returns `[q_len, num_heads, head_dim]`.

    SDPA's `is_causal` (its fast path on a CPU) aligns the diagonal top-left, right only when q_len == kv_len.
    With a short cached context (a shared system prompt before a new document, the common miss), the queries
    are padded at the front with `ctx_len` zero rows, which makes `is_causal` exact, and the padding's output
    is dropped: measured ~40% faster than an explicit mask. With a long context and few new tokens (a
    question after a cached document) the explicit mask is the cheaper one."""
    q_len, kv_len = query.shape[0], key.shape[1]
    ctx_len = kv_len - q_len
    q = query.transpose(0, 1)  # [num_heads, q_len, head_dim]
    mask = None
    if 0 < ctx_len < q_len:
        q = torch.cat([q.new_zeros(q.shape[0], ctx_len, q.shape[2]), q], dim=1)
    elif ctx_len >= q_len:
        mask = causal_suffix_mask(q_len, kv_len, query.device)
    attn = F.scaled_dot_product_attention(q.unsqueeze(0), key.unsqueeze(0).to(q.dtype),
                                          value.unsqueeze(0).to(q.dtype), attn_mask=mask,
                                          is_causal=mask is None, scale=scale,
                                          enable_gqa=q.shape[0] != key.shape[0])
    return attn[0, :, kv_len - q_len:].transpose(0, 1) if mask is None else attn[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel.
#
# Layout of the work: the grid is flattened over the whole batch, (query tiles, kv heads). A query tile holds
# BLOCK_Q consecutive new tokens of ONE sequence times the GROUP query heads that share a KV head, packed as
# BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, so every K/V tile is loaded once for the whole GQA group.
# Sequence b's tiles are numbered from `query_start_loc[b] // BLOCK_Q + b`; these starts leave room for every
# tile of every sequence, so `T // BLOCK_Q + B` programs cover the batch without reading lengths on the host.
# A program finds its sequence by binary search over those starts; programs past their sequence's last tile exit.
#
# Each program walks its sequence's keys in TILE_N-position tiles in block-table order (a tile may span several
# cache blocks: each position looks up its own block), with an online softmax in base 2 and fp32 accumulation.
# Keys up to the tile's first query position are visible to every row, so only the tiles after it mask.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile `query_start_loc[b] // BLOCK_Q + b` is <= tile_index."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(acc, row_max, row_sum, q, key_start, query_pos, block_table_ptr, k_base, v_base, kv_len,
                 stride_cb, stride_cs, qk_scale,
                 offs_n, offs_d, d_mask, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Fold keys [key_start, key_start + TILE_N) into the running softmax state (acc, row_max, row_sum)."""
    key_pos = key_start + offs_n
    if MASKED:
        key_ok = key_pos < kv_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        key_ok = offs_n >= 0  # every key of an unmasked tile exists
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE).to(tl.int64)
    token_offsets = block_ids * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs  # [TILE_N]
    kv_mask = key_ok[None, :] & d_mask[:, None]
    k = tl.load(k_base + token_offsets[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)  # [HEAD_DIM, TILE_N]
    v = tl.load(v_base + token_offsets[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)
    scores = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2
    if MASKED:
        scores = tl.where(key_pos[None, :] <= query_pos[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    probs = tl.math.exp2(scores - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                             input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _prefix_prefill_kernel(
        query_ptr, cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        layer, qk_scale, num_seqs, head_dim,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cl, stride_ckv, stride_cs, stride_ch, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile_index - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:  # a spare program past this sequence's last tile
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    context_len = kv_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < head_dim
    token_in_seq = tile_in_seq * BLOCK_Q + offs_m // GROUP  # which new token each row is
    head = kv_head * GROUP + offs_m % GROUP                   # which query head each row is
    row_ok = (offs_m // GROUP < BLOCK_Q) & (token_in_seq < q_len)
    query_pos = context_len + token_in_seq                   # absolute position; rows past q_len stay >= 0

    token = (q_start + token_in_seq).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + layer * stride_cl + kv_head * stride_ch
    v_base = k_base + stride_ckv

    # Keys 0..first_query_pos are visible to every row of the tile: whole tiles among them need no mask.
    first_query_pos = context_len + tile_in_seq * BLOCK_Q
    last_query_pos = tl.minimum(first_query_pos + BLOCK_Q, kv_len) - 1
    num_open_tiles = (first_query_pos + 1) // TILE_N
    num_tiles = tl.cdiv(last_query_pos + 1, TILE_N)
    for tile in range(0, num_open_tiles):
        acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, tile * TILE_N, query_pos, block_table_ptr,
                                             k_base, v_base, kv_len, stride_cb, stride_cs, qk_scale,
                                             offs_n, offs_d, d_mask, BLOCK_SIZE, False, DOT_DTYPE, DOT_PRECISION)
    for tile in range(num_open_tiles, num_tiles):
        acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, tile * TILE_N, query_pos, block_table_ptr,
                                             k_base, v_base, kv_len, stride_cb, stride_cs, qk_scale,
                                             offs_n, offs_d, d_mask, BLOCK_SIZE, True, DOT_DTYPE, DOT_PRECISION)

    out = acc / row_sum[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_prefill_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, out) -> None:
    if query.dim() != 3 or kv_cache.dim() != 6:
        raise ValueError(f"prefix_prefill: query must be [T, heads, head_dim] and kv_cache 6-d, got "
                         f"{tuple(query.shape)} and {tuple(kv_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[4]
    if kv_cache.shape[5] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"prefix_prefill: {num_heads} query heads of dim {head_dim} cannot read kv_cache "
                         f"{tuple(kv_cache.shape)} (heads must be a multiple of kv heads)")
    if query.dtype not in _DTYPES or kv_cache.dtype != query.dtype:
        raise ValueError(f"prefix_prefill: query {query.dtype} and kv_cache {kv_cache.dtype} must share one of "
                         f"{_DTYPES}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"prefix_prefill: layer {layer} out of range for {kv_cache.shape[1]} layers")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"prefix_prefill: {num_seqs} seq_lens need query_start_loc [{num_seqs + 1}] and "
                         f"block_tables [{num_seqs}, max_blocks], got {tuple(query_start_loc.shape)} and "
                         f"{tuple(block_tables.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"prefix_prefill: {name} must be int32, got {t.dtype}")
    if block_tables.stride(1) != 1 or query.stride(2) != 1 or kv_cache.stride(5) != 1:
        raise ValueError("prefix_prefill: query, kv_cache and block_tables need a contiguous last axis")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1):
        raise ValueError(f"prefix_prefill: out must be {tuple(query.shape)} {query.dtype} with contiguous head_dim")


def prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `reference_prefix_prefill`: one launch for the whole batch, no host sync."""
    _check_prefill_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, out)
    check_launchable("prefix_prefill", query, kv_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[4]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    # Decode batches (one new token per sequence) get short tiles; prefill gets tall ones.
    block_m = max(16, triton.next_power_of_2(group)) if num_tokens <= num_seqs else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    dot_dtype = _dot_dtype(query.dtype)
    _prefix_prefill_kernel[grid](
        query, kv_cache, out, block_tables, query_start_loc, seq_lens,
        layer, scale * _LOG2E, num_seqs, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0),
        BLOCK_SIZE=kv_cache.shape[3], GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE_N=64 if head_dim <= 64 else 32, HEAD_DIM=max(16, triton.next_power_of_2(head_dim)),
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")
    return out


def _dot_dtype(dtype: torch.dtype):
    """The dtype tiles enter `tl.dot` in. On a GPU, the input dtype (fp16/bf16 tensor cores; fp32 dots run at IEEE
    precision, since TF32 would cost the 1e-4 agreement fp32 users expect). The CPU interpreter keeps bf16 as raw uint16 bits,
    so its `tl.dot` (a numpy matmul) would multiply bit patterns: there, bf16 tiles are upcast to fp32 first."""
    from kvstrata.kernels import triton_interpreted

    if dtype == torch.bfloat16 and triton_interpreted():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
