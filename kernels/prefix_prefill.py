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

import bisect
import functools

import torch
import torch.nn.functional as F

from kvstrata.kernels.kv_format import is_scaled, row_width
from kvstrata.kernels.kv_store import dequantize_rows
from kvstrata.kernels.triton_compat import check_launchable, jit, tl, triton, triton_interpreted


def gather_sequence_kv(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` positions, `[num_kv_heads, seq_len, head_dim]` each:
    whole blocks are selected at once, then the tail of the last (partial) block is cut off. Scaled
    (int8) rows come back as float32 values."""
    return gather_sequence_part(kv_cache, layer, 0, block_table, seq_len), \
        gather_sequence_part(kv_cache, layer, 1, block_table, seq_len)


def gather_sequence_part(kv_cache: torch.Tensor, layer: int, part: int, block_table: torch.Tensor,
                         seq_len: int) -> torch.Tensor:
    """K (`part` 0) or V (1) of `gather_sequence_kv`."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    # K and V apart, each one index_select over the layer's strided view: each comes out contiguous
    # ([n, block_size, kv_heads, row]), so the reshape copies nothing. Advanced indexing of both at once
    # was slower, and its K and V halves were then copied again. Never index_select over all layers: that
    # copies them all.
    rows = (num_blocks * block_size, *kv_cache.shape[-2:])
    gathered = kv_cache[:, layer, part].index_select(0, block_ids).reshape(rows)[:seq_len]
    if is_scaled(str(kv_cache.dtype)):
        gathered = dequantize_rows(gathered)
    return gathered.transpose(0, 1)


def causal_suffix_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask `[q_len, kv_len]`, True where query i (at position kv_len - q_len + i) may see key j.
    SDPA's own `is_causal` aligns the diagonal top-left, which is wrong whenever q_len < kv_len."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token attending to all `kv_len` keys: `query [num_heads, head_dim]`, `key/value [num_kv_heads,
    kv_len, head_dim]`. Plain fp32 matmuls over the query heads grouped by KV head: on a CPU, SDPA's one-row
    path was measured several times slower in bf16 (and no faster in fp32)."""
    num_kv_heads, _, head_dim = key.shape
    grouped = query.reshape(num_kv_heads, -1, head_dim).float()  # [kv_heads, group, head_dim]
    scores = torch.matmul(grouped, key.float().transpose(1, 2)) * scale
    attn = torch.matmul(scores.softmax(dim=-1), value.float())
    return attn.reshape(query.shape).to(query.dtype)


def reads_values_in_place(kv_cache: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether `decode_attention_in_place` can read this cache's V rows where they lie: float32 rows (the
    bag sum takes weights of the table's dtype) in one contiguous cache."""
    return kv_cache.dtype == torch.float32 and query.dtype == torch.float32 and kv_cache.is_contiguous()


def decode_attention_in_place(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                              block_table: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """`decode_attention` with V read from the paged cache where it lies: the probabilities weigh V's rows in
    one `embedding_bag` sum per query head, which reads each row by its number in the cache, so the sequence's V
    is never gathered into a copy (half of a decode step's gather, and the write of it). K is gathered as before
    (`key`)."""
    num_kv_heads, _, head_dim = key.shape
    grouped = query.reshape(num_kv_heads, -1, head_dim)  # [kv_heads, group, head_dim]
    probs = (torch.matmul(grouped, key.transpose(1, 2)) * scale).softmax(dim=-1)  # [kv_heads, group, kv_len]
    rows = value_rows(kv_cache, layer, block_table, kv_len)  # [kv_heads, kv_len]
    bags = rows[:, None, :].expand(-1, grouped.shape[1], -1).reshape(-1)
    offsets = torch.arange(0, bags.numel(), kv_len, device=query.device)
    out = F.embedding_bag(bags, kv_cache.view(-1, head_dim), offsets, mode="sum",
                          per_sample_weights=probs.reshape(-1))
    return out.view(query.shape)


def value_rows(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`[num_kv_heads, kv_len]`: where V of each KV head and position lies, as a row of `kv_cache.view(-1, row)`
    (the cache is `[num_blocks, num_layers, 2, block_size, num_kv_heads, row]`, kernels/kv_format.py)."""
    _, num_layers, _, block_size, num_kv_heads, _ = kv_cache.shape
    positions = torch.arange(kv_len, device=kv_cache.device)
    blocks = block_table[:-(-kv_len // block_size)].to(device=kv_cache.device, dtype=torch.long)
    slots = ((blocks * num_layers + layer) * 2 + 1) * block_size
    first = (slots.repeat_interleave(block_size)[:kv_len] + positions % block_size) * num_kv_heads
    return first[None, :] + torch.arange(num_kv_heads, device=kv_cache.device)[:, None]


def reference_prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None, *, batch_invariant: bool = False) -> torch.Tensor:
    """Torch reference and CPU path: per sequence, gather its K/V blocks, then one SDPA call (prefill) or two
    matmuls (decode). `batch_invariant`: `invariant_attention` for every sequence instead, whose bits do not
    depend on how the sequence was cut into steps or batched."""
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    for seq, kv_len in enumerate(kv_lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len == 1 and not batch_invariant and reads_values_in_place(kv_cache, query):
            key = gather_sequence_part(kv_cache, layer, 0, block_tables[seq], kv_len)
            out[q_start] = decode_attention_in_place(query[q_start], key, kv_cache, layer, block_tables[seq],
                                                     kv_len, scale)
            continue
        key, value = gather_sequence_kv(kv_cache, layer, block_tables[seq], kv_len)
        if batch_invariant:
            out[q_start:q_end] = invariant_attention(query[q_start:q_end], key, value, scale)
            continue
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
    is dropped: faster than an explicit mask. With a long context and few new tokens (a
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


# Batch-invariant attention (torch path). A query row's bits must depend only on its own query and the keys it may
# see, never on how many rows share the call, where its step began (after a cached prefix or not) or which other
# sequences are batched with it. So keys are folded in tiles of INVARIANT_KEY_TILE positions counted from position
# 0, in order, by an online softmax in float32; and every matmul has one fixed shape, whatever the step:
# [INVARIANT_QUERY_ROWS, head_dim] x [head_dim, INVARIANT_KEY_TILE] for the scores and back for the values, issued
# as a batch of such products (bmm) so that the library runs the same instructions for every product. A tile past
# a row's causal limit adds exact zeros (its probabilities are exp(-inf) = 0 and its correction exp(0) = 1), so
# rows may share tiles with rows that see more. Elementwise steps (scale, mask, exp, max, the online update) are
# per element; the row sums reduce one tile row of fixed length.
INVARIANT_KEY_TILE = 256
INVARIANT_QUERY_ROWS = 16


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """`prefill_attention`'s contract (`query [q_len, heads, head_dim]` at the last q_len of `key/value [kv_heads,
    kv_len, head_dim]`), computed in the batch-invariant order above. Decode (q_len 1) takes the same path."""
    q_len, num_heads, head_dim = query.shape
    num_kv_heads, kv_len, _ = key.shape
    group = num_heads // num_kv_heads
    rows, tile, chunk_rows = q_len * group, INVARIANT_KEY_TILE, INVARIANT_QUERY_ROWS
    num_chunks, num_tiles = -(-rows // chunk_rows), -(-kv_len // tile)
    # Rows (new token, head of the GQA group) per KV head, cut into chunks of fixed height. Padding rows take the
    # last position, so that they see key 0 like every row (no empty softmax); their output is dropped.
    q = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, rows,
                                                                                             head_dim)
    q = F.pad(q, (0, 0, 0, num_chunks * chunk_rows - rows)).view(num_kv_heads, num_chunks, chunk_rows, head_dim)
    row_pos = torch.arange(num_chunks * chunk_rows, device=query.device) // group + (kv_len - q_len)
    row_pos = row_pos.clamp_(max=kv_len - 1).view(num_chunks, chunk_rows, 1)
    chunk_last_pos = row_pos[:, -1, 0].tolist()  # nondecreasing
    key_tiles = _float_tiles(key, num_tiles * tile).view(num_kv_heads, num_tiles, tile, head_dim)
    value_tiles = _float_tiles(value, num_tiles * tile).view(num_kv_heads, num_tiles, tile, head_dim)

    acc = q.new_zeros(num_kv_heads, num_chunks, chunk_rows, head_dim)
    row_max = q.new_full((num_kv_heads, num_chunks, chunk_rows, 1), float("-inf"))
    row_sum = q.new_zeros(num_kv_heads, num_chunks, chunk_rows, 1)
    key_offsets = torch.arange(tile, device=query.device)
    for t in range(num_tiles):
        start = t * tile
        first = bisect.bisect_left(chunk_last_pos, start)  # chunks before it see none of this tile
        live = num_chunks - first
        scores = q.new_empty(num_kv_heads, live, chunk_rows, tile)
        for h in range(num_kv_heads):
            torch.bmm(q[h, first:], key_tiles[h, t].t().expand(live, head_dim, tile), out=scores[h])
        scores.mul_(scale)
        scores.masked_fill_(start + key_offsets > row_pos[first:], float("-inf"))
        new_max = torch.maximum(row_max[:, first:], scores.amax(dim=-1, keepdim=True))
        probs = torch.exp(scores.sub_(new_max))
        correction = torch.exp(row_max[:, first:] - new_max)
        row_sum[:, first:] = row_sum[:, first:] * correction + probs.sum(dim=-1, keepdim=True)
        weighted = torch.empty_like(acc[:, first:])
        for h in range(num_kv_heads):
            torch.bmm(probs[h], value_tiles[h, t].expand(live, tile, head_dim), out=weighted[h])
        acc[:, first:] = acc[:, first:] * correction + weighted
        row_max[:, first:] = new_max
    out = (acc / row_sum).view(num_kv_heads, num_chunks * chunk_rows, head_dim)[:, :rows]
    return out.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(q_len, num_heads,
                                                                                  head_dim).to(query.dtype)


def _float_tiles(kv: torch.Tensor, padded_len: int) -> torch.Tensor:
    """`kv [kv_heads, kv_len, head_dim]` in float32, zero-padded to `padded_len` positions (finite padding: a
    masked key's probability is 0, and 0 times the padding must stay 0)."""
    tiles = kv.new_empty(kv.shape[0], padded_len, kv.shape[2], dtype=torch.float32)
    tiles[:, :kv.shape[1]] = kv
    tiles[:, kv.shape[1]:] = 0
    return tiles


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel.
#
# Layout of the work: the grid is flattened over the whole batch, (query tiles, kv heads, key splits). A query tile
# holds BLOCK_Q consecutive new tokens of ONE sequence times the GROUP query heads that share a KV head, packed as
# BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, so every K/V tile is loaded once for the whole GQA group.
# Sequence b's tiles are numbered from `query_start_loc[b] // BLOCK_Q + b`; these starts leave room for every
# tile of every sequence, so `T // BLOCK_Q + B` programs cover the batch without reading lengths on the host.
# A program finds its sequence by binary search over those starts; programs past their sequence's last tile exit.
#
# Each program walks keys in TILE_N-position tiles in block-table order (a tile may span several cache blocks:
# each position looks up its own block), with an online softmax in base 2 and fp32 accumulation. Keys up to the
# tile's first query position are visible to every row, so only the tiles after it mask.
#
# Split-KV (flash-decoding): a few query tiles over a long context would leave most SMs idle while each program
# walks thousands of keys in turn. The third grid axis then cuts each sequence's key tiles into up to `num_splits`
# consecutive ranges (`_key_tiles_per_split`, from the sequence's length alone); program (tile, head, split) folds
# its range into a partial output, normalised by its own softmax sum, and that sum's log-sum-exp (fp32, base 2),
# and writes both for every row of its tile, also when its range is empty (a sequence too short for that many
# splits, or keys past the causal limit of some rows): then 0 and an LSE of -inf, which weigh nothing.
# `_merge_splits_kernel` weighs the partials by their LSEs into the output. With one split (the choice whenever
# the query tiles fill the GPU) the kernel is a single pass into the output: no scratch, no merge launch.
#
# Batch-invariant mode fixes every choice that the batch would otherwise make: query tiles of the prefill height at
# absolute positions (multiples of BLOCK_Q, so `+ 2b` spare tiles per sequence), splits of INVARIANT_KEYS_PER_SPLIT
# keys from position 0, always the split path, and the merge's sequential order. A tile past a row's causal limit
# adds exact zeros to it (probabilities 2^-inf, correction 2^0), so which tiles a program walks does not matter.
# ---------------------------------------------------------------------------------------------------------------


@jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q: tl.constexpr, SEQ_SLACK: tl.constexpr):
    """The last sequence b whose first tile `query_start_loc[b] // BLOCK_Q + b * SEQ_SLACK` is <= tile_index."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid * SEQ_SLACK
        if first_tile <= tile_index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _key_tiles_per_split(kv_len, num_splits, min_tiles_per_split, TILE_N: tl.constexpr,
                         FIXED_TILES_PER_SPLIT: tl.constexpr):
    """Split s of a sequence of kv_len keys holds its key tiles [s * n, (s + 1) * n) for the n returned: as even a
    cut into at most `num_splits` ranges as whole tiles allow, each of at least `min_tiles_per_split` tiles but
    the last (which holds at least one), fewer ranges when the sequence is too short (one: not split). Splits
    past the last range are empty. FIXED_TILES_PER_SPLIT > 0 (batch-invariant mode) is n whatever the lengths:
    split boundaries then sit at fixed key positions."""
    if FIXED_TILES_PER_SPLIT > 0:
        return FIXED_TILES_PER_SPLIT
    num_key_tiles = tl.maximum(tl.cdiv(kv_len, TILE_N), 1)
    seq_splits = tl.maximum(tl.minimum(num_splits, num_key_tiles // min_tiles_per_split), 1)
    return tl.cdiv(num_key_tiles, seq_splits)


@jit
def _attend_tile(acc, row_max, row_sum, q, key_start, query_pos, block_table_ptr, k_base, v_base, kv_len,
                 stride_cb, stride_cs, qk_scale, head_dim,
                 offs_n, offs_d, d_mask, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr):
    """Fold keys [key_start, key_start + TILE_N) into the running softmax state (acc, row_max, row_sum).
    SCALED: the cache's rows are int8 values followed by their float32 scale (kernels/kv_format.py)."""
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
    if SCALED:  # the values times their row's scale, in float32 (as `dequantize_rows`)
        k_scale = tl.load((k_base + token_offsets + head_dim).to(tl.pointer_type(tl.float32), bitcast=True),
                          mask=key_ok, other=0.0)
        v_scale = tl.load((v_base + token_offsets + head_dim).to(tl.pointer_type(tl.float32), bitcast=True),
                          mask=key_ok, other=0.0)
        k = k.to(tl.float32) * k_scale[None, :]
        v = v.to(tl.float32) * v_scale[:, None]
    scores = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2
    if MASKED:
        scores = tl.where(key_pos[None, :] <= query_pos[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if MASKED:
        # A row may have seen no key yet (a split starting past its causal limit): its max stays -inf and it is
        # shifted by 0 instead, so its probabilities and correction are 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        shift = new_max
    probs = tl.math.exp2(scores - shift[:, None])
    correction = tl.math.exp2(row_max - shift)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                             input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@jit
def _prefix_prefill_kernel(
        query_ptr, cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        layer, qk_scale, num_seqs, num_heads, head_dim, num_splits, min_tiles_per_split, num_rows,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cl, stride_ckv, stride_cs, stride_ch, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, FIXED_TILES_PER_SPLIT: tl.constexpr, ALIGNED: tl.constexpr, SCALED: tl.constexpr):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q, 1 + ALIGNED)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile_index - (q_start // BLOCK_Q + seq * (1 + ALIGNED))
    kv_len = tl.load(seq_lens_ptr + seq)
    context_len = kv_len - q_len
    # ALIGNED (batch-invariant mode): query tiles sit at absolute positions, multiples of BLOCK_Q, so a query keeps
    # its row in its tile however its sequence was cut into steps; the first tile then starts `lead` positions
    # before the step's first new token (rows not stored), and a sequence may need one tile more (SEQ_SLACK 2).
    if ALIGNED:
        lead = context_len % BLOCK_Q
    else:
        lead = 0
    if tile_in_seq * BLOCK_Q - lead >= q_len:  # a spare program past this sequence's last tile
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < head_dim
    token_in_seq = tile_in_seq * BLOCK_Q - lead + offs_m // GROUP  # which new token each row is
    head = kv_head * GROUP + offs_m % GROUP                          # which query head each row is
    row_ok = (offs_m // GROUP < BLOCK_Q) & (token_in_seq >= 0) & (token_in_seq < q_len)
    query_pos = context_len + token_in_seq  # absolute position; rows outside the step stay >= 0

    token = (q_start + tl.maximum(token_in_seq, 0)).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + layer * stride_cl + kv_head * stride_ch
    v_base = k_base + stride_ckv

    # Keys 0..first_query_pos are visible to every row of the tile: whole tiles among them need no mask. This
    # program walks the key tiles of its split's range, [first_tile, end_tile), that the tile's rows may see.
    first_query_pos = context_len - lead + tile_in_seq * BLOCK_Q
    last_query_pos = tl.minimum(first_query_pos + BLOCK_Q, kv_len) - 1
    num_open_tiles = (first_query_pos + 1) // TILE_N
    tiles_per_split = _key_tiles_per_split(kv_len, num_splits, min_tiles_per_split, TILE_N, FIXED_TILES_PER_SPLIT)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(last_query_pos + 1, TILE_N))
    for tile in range(first_tile, tl.minimum(end_tile, num_open_tiles)):
        acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, tile * TILE_N, query_pos, block_table_ptr,
                                             k_base, v_base, kv_len, stride_cb, stride_cs, qk_scale, head_dim,
                                             offs_n, offs_d, d_mask, BLOCK_SIZE, False, DOT_DTYPE, DOT_PRECISION,
                                             SCALED)
    for tile in range(tl.maximum(first_tile, num_open_tiles), end_tile):
        acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, tile * TILE_N, query_pos, block_table_ptr,
                                             k_base, v_base, kv_len, stride_cb, stride_cs, qk_scale, head_dim,
                                             offs_n, offs_d, d_mask, BLOCK_SIZE, True, DOT_DTYPE, DOT_PRECISION,
                                             SCALED)

    # Every row sees key 0, so only a split's rows can end with an empty sum: they store 0 and an LSE of -inf.
    seen = row_sum > 0
    safe_sum = tl.where(seen, row_sum, 1.0)
    out = acc / safe_sum[:, None]
    row_mask = row_ok[:, None] & d_mask[None, :]
    if SPLIT:  # row (token, head) of split s in the contiguous scratch [num_splits, num_rows (, head_dim)]
        row = split.to(tl.int64) * num_rows + token * num_heads + head
        tl.store(partial_out_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=row_mask)
        tl.store(partial_lse_ptr + row, tl.where(seen, row_max + tl.math.log2(safe_sum), float("-inf")), mask=row_ok)
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)


@jit
def _merge_splits_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, num_splits, num_heads, head_dim, num_rows,
                         stride_ot, stride_oh, CHUNK: tl.constexpr):
    """Program c merges elements [c * CHUNK, (c + 1) * CHUNK) of the output read as one flat run of rows (token,
    head) of head_dim: each is sum_s w_s * partial_s / sum_s w_s with w_s = 2^(lse_s - max_s lse_s), from the
    contiguous scratch `partial_out [num_splits, num_rows, head_dim]` and `partial_lse [num_splits, num_rows]`.
    Split 0 holds key 0, which every query sees, so the max is finite; splits a row saw nothing of weigh 0.
    The sums run over the splits one after another in order, so splits a row saw nothing of add exact zeros
    wherever they are: a row's bits depend on the splits it saw, not on how many the launch had (batch-invariant
    mode relies on this)."""
    num_elements = num_rows * head_dim
    offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_elements
    offs = tl.minimum(offs, num_elements - 1)  # the tail repeats the last element (not stored) rather than mask
    row = offs // head_dim
    max_lse = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        max_lse = tl.maximum(max_lse, tl.load(partial_lse_ptr + split * num_rows + row))
    numerator = tl.zeros([CHUNK], dtype=tl.float32)
    denominator = tl.zeros([CHUNK], dtype=tl.float32)
    for split in range(num_splits):
        weight = tl.math.exp2(tl.load(partial_lse_ptr + split * num_rows + row) - max_lse)
        numerator += weight * tl.load(partial_out_ptr + split * num_elements + offs)
        denominator += weight
    merged = numerator / denominator
    token = row // num_heads
    head = row % num_heads
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs % head_dim,
             merged.to(out_ptr.dtype.element_ty), mask=in_range)


_LOG2E = 1.4426950408889634
_MERGE_CHUNK = 1024  # output elements per merge program
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a cache may be kept narrower than the queries (`cache.kv_cache_dtype`): its tiles are cast up on load (int8 rows
# times their scales)
_KV_DTYPES = (*_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# Split-KV policy. A split shorter than this many keys would spend more on its fixed cost (loading its queries,
# writing and merging a partial output) than on keys; the cap bounds the merge's vector of splits.
MIN_KEYS_PER_SPLIT = 256
MAX_NUM_SPLITS = 64
# SM count assumed for CPU tensors (the interpreter): a small GPU's, so that the tests' small shapes split.
INTERPRETER_NUM_SMS = 16
# Batch-invariant mode: every sequence's keys are cut at multiples of this many positions, whatever the batch, and
# every launch takes the split path (one split's merge is then the single pass's division, in the same order).
INVARIANT_KEYS_PER_SPLIT = 512


def _check_prefill_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, out, num_splits) -> None:
    if query.dim() != 3 or kv_cache.dim() != 6:
        raise ValueError(f"prefix_prefill: query must be [T, heads, head_dim] and kv_cache 6-d, got "
                         f"{tuple(query.shape)} and {tuple(kv_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[4]
    if kv_cache.shape[5] != row_width(head_dim, str(kv_cache.dtype)) or num_heads % num_kv_heads:
        raise ValueError(f"prefix_prefill: {num_heads} query heads of dim {head_dim} cannot read kv_cache "
                         f"{tuple(kv_cache.shape)} (heads must be a multiple of kv heads)")
    if query.dtype not in _DTYPES or kv_cache.dtype not in _KV_DTYPES:
        raise ValueError(f"prefix_prefill: query {query.dtype} must be one of {_DTYPES} and kv_cache "
                         f"{kv_cache.dtype} one of {_KV_DTYPES}")
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
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= MAX_NUM_SPLITS):
        raise ValueError(f"prefix_prefill: num_splits must be None or an int in 1..{MAX_NUM_SPLITS}, "
                         f"got {num_splits!r}")


def _query_tiling(num_tokens: int, num_seqs: int, group: int, batch_invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a query tile and the new tokens it holds. Decode batches (one new token per
    sequence) get short tiles; prefill gets tall ones, and so does every batch in batch-invariant mode, so that a
    row's dot products have one shape whether it decodes or not. A tile's rows are BLOCK_Q tokens x the GQA
    group."""
    decode = num_tokens <= num_seqs and not batch_invariant
    block_m = max(16 if decode else 64, triton.next_power_of_2(group))
    return block_m, block_m // group


def _key_tile(head_dim: int) -> int:
    """TILE_N, keys per inner step: shorter for wide heads, to bound the K/V tiles' registers."""
    return 64 if head_dim <= 64 else 32


def choose_num_splits(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """How many parts to cut each sequence's keys into. One (a single pass) when the batch's query tiles already
    give every SM a program; otherwise as many as give each SM about one program, but no split shorter than
    MIN_KEYS_PER_SPLIT keys of the longest sequence and at most MAX_NUM_SPLITS. Host arithmetic only."""
    _, block_q = _query_tiling(num_tokens, num_seqs, num_heads // num_kv_heads)
    # Query tiles that carry work: at least one per sequence, and the tokens fill at least cdiv(T, BLOCK_Q).
    num_query_tiles = max(-(-num_tokens // block_q), num_seqs)
    programs = num_query_tiles * num_kv_heads
    return max(1, min(num_sms // programs, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_NUM_SPLITS))


@functools.cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (read once per device); INTERPRETER_NUM_SMS for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def prefix_prefill(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None, *, num_splits: int | None = None,
                   batch_invariant: bool = False) -> torch.Tensor:
    """Triton version of `reference_prefix_prefill`: one launch for the whole batch, two with split-KV, no host
    sync.

    `num_splits`: None chooses it (`choose_num_splits`) from shapes alone. The longest sequence is bounded by
    the block table's width, which the engine pads to the batch's longest: a wider table costs only idle
    programs, since each sequence is cut by its own length. 1 forces the single pass; N cuts every sequence's
    keys into up to N ranges of at least one key tile each.

    `batch_invariant`: a row's bits depend only on its query and the keys it sees, never on the batch: one query
    tiling for prefill and decode, splits of INVARIANT_KEYS_PER_SPLIT keys from position 0 (as many as the block
    table's width needs) and the merge's fixed order. Excludes `num_splits`."""
    _check_prefill_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, out, num_splits)
    if batch_invariant and num_splits is not None:
        raise ValueError("prefix_prefill: batch_invariant fixes the splits itself; leave num_splits None")
    check_launchable("prefix_prefill", query, kv_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[4], kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q = _query_tiling(num_tokens, num_seqs, group, batch_invariant)
    tile_n = _key_tile(head_dim)
    min_tiles_per_split = 1
    fixed_tiles_per_split = 0
    if batch_invariant:
        fixed_tiles_per_split = INVARIANT_KEYS_PER_SPLIT // tile_n
        num_splits = -(-block_tables.shape[1] * block_size // INVARIANT_KEYS_PER_SPLIT)
    elif num_splits is None:
        num_splits = choose_num_splits(num_tokens, num_seqs, num_heads, num_kv_heads,
                                       block_tables.shape[1] * block_size, sm_count(query.device))
        min_tiles_per_split = max(1, MIN_KEYS_PER_SPLIT // tile_n)
    split = num_splits > 1 or batch_invariant
    num_rows = num_tokens * num_heads
    if split:  # every split program writes all its rows, so the merge reads no uninitialised scratch
        partial_out = query.new_empty(num_splits, num_rows, head_dim, dtype=torch.float32)
        partial_lse = query.new_empty(num_splits, num_rows, dtype=torch.float32)
    else:
        partial_out = partial_lse = out  # not read: the single pass writes `out` directly
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    dot_dtype = _dot_dtype(query.dtype)
    seq_slack = 2 if batch_invariant else 1  # query tiles a sequence may need beyond num_tokens // block_q
    _prefix_prefill_kernel[(num_tokens // block_q + seq_slack * num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, out, partial_out, partial_lse, block_tables, query_start_loc, seq_lens,
        layer, scale * _LOG2E, num_seqs, num_heads, head_dim, num_splits, min_tiles_per_split, num_rows,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        HEAD_DIM=head_dim_padded, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        SPLIT=split, FIXED_TILES_PER_SPLIT=fixed_tiles_per_split, ALIGNED=batch_invariant,
        SCALED=is_scaled(str(kv_cache.dtype)))
    if split:
        _merge_splits_kernel[(triton.cdiv(num_rows * head_dim, _MERGE_CHUNK),)](
            out, partial_out, partial_lse, num_splits, num_heads, head_dim, num_rows,
            out.stride(0), out.stride(1), CHUNK=_MERGE_CHUNK)
    return out


def _dot_dtype(dtype: torch.dtype):
    """The dtype tiles enter `tl.dot` in. On a GPU, the input dtype (fp16/bf16 tensor cores; fp32 dots run at IEEE
    precision, since TF32 would cost the 1e-4 agreement fp32 users expect). The CPU interpreter keeps bf16 as raw uint16 bits,
    so its `tl.dot` (a numpy matmul) would multiply bit patterns: there, bf16 tiles are upcast to fp32 first."""
    if dtype == torch.bfloat16 and triton_interpreted():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
