/* Prefix-prefill attention on a CPU, read straight from the paged KV cache (kernels/cpu_attention.py builds and
 * calls this; kernels/prefix_prefill.py documents the inputs).
 *
 * Batch-invariant by construction: each (query token, query head) output is computed by one thread, from its own
 * query and the keys it may see (positions 0 ..= its own), walked in tiles of KEY_TILE positions counted from
 * position 0, with a float32 online softmax. Nothing of that order depends on the other rows of the call, the
 * number of threads, or where the step began (after a cached prefix or not), so a row's bits never do either.
 *
 * Determinism of the arithmetic: built with -ffp-contract=off, so the compiler fuses no multiply-add on its own;
 * fused ones are explicit (MADD, or the intrinsics). Every reduction has a fixed order: a score q.k is summed along
 * head_dim in order, one fused multiply-add at a time; a tile's softmax sum keeps LANES partial sums (lane i takes
 * keys i, i + LANES, ...) added by one fixed tree; its weighted values are added key by key in position order.
 * Vectorised or not, the operations on each element are the same (the AVX2 build and the portable one differ
 * from each other only where FMA is absent, never from call to call).
 *
 * Speed: K is transposed per tile so a score vector holds 8 keys (no horizontal sums); rows that see the same keys
 * (the heads of one GQA group; the tokens of a query, on every tile before the causal limit) take them in register
 * tiles of up to MAX_ROWS rows, so that each K column and V row loaded feeds several rows' multiply-adds. A short query
 * (a decode row, a question) is bound by reading K/V from memory: its work item takes every KV head and copies a
 * tile's rows in the order they lie in the cache (software prefetch of the next tile, tried instead, gained
 * nothing).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"
#include "cpu_threads.h"

#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define LANES 8
#define KEY_TILE 32
/* New tokens of a long query's item: its KV head's tiles (K transposed once a tile) feed QUERY_BLOCK x group rows */
#define QUERY_BLOCK 32
#define MAX_GROUP 64
#define MAX_HEAD_DIM 512
/* New tokens up to which a sequence's item takes all of them (and its KV heads): a question after a cached document
 * then reads the document's K/V once, not once per QUERY_BLOCK of its tokens. */
#define SHORT_QUERY 64
#define MAX_ROWS 5       /* rows a register tile takes at most (scores_rows, accumulate_rows): 4, 6 measured slower */
#define MAX_VECS 8       /* vectors of 8 columns a register tile takes at most */

enum { OK = 0, ERR_BLOCK_ID = -1, ERR_ALLOC = -2, ERR_SHAPE = -4 };

typedef struct {
    const void *query;         /* [T, num_heads, head_dim], strides below (elements), last axis contiguous */
    int query_dtype;
    int64_t q_stride_token, q_stride_head;
    const void *cache;         /* [num_blocks, num_layers, 2, block_size, num_kv_heads, row] */
    int cache_dtype;
    int64_t c_stride_block, c_stride_layer, c_stride_part, c_stride_slot, c_stride_head;
    int64_t num_blocks;
    int layer, block_size;
    const void *block_tables;      /* [B, max_blocks] int32 or int64 (bt_int32), rows bt_stride apart */
    int64_t bt_stride;
    int bt_int32;
    const int64_t *query_start;    /* [B + 1] */
    const int64_t *seq_lens;       /* [B] */
    int num_seqs, num_heads, num_kv_heads, head_dim;
    float scale;
    float *out;                    /* [T, num_heads, head_dim] float32, strides below */
    int64_t o_stride_token, o_stride_head;
    /* work items: (sequence, KV-head range, block of new tokens), numbered in that order (run_item); `item_start[b]`
     * is sequence b's first */
    const int64_t *item_start;
    int64_t num_items;
    int short_heads;               /* KV heads per item of a short query (heads_per_item) */
    int64_t next_item;             /* shared counter, taken atomically by the threads */
} Problem;

static inline int64_t table_entry(const void *tables, int int32, int64_t index) {
    return int32 ? ((const int32_t *)tables)[index] : ((const int64_t *)tables)[index];
}

/* exp(x) for x <= 0 (scores minus their running maximum), elementwise: x = k ln2 + r, |r| <= ln2 / 2, e^r by a
 * degree-6 polynomial (relative error ~2e-7), times 2^k from the exponent bits. Below -87 (and -inf, nan) the
 * result is 0 (e^-87 ~ 1.6e-38, under float32's normals). The AVX2 and the portable versions do the same
 * operations on every element. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187045e-06f
#define EXP_FLOOR (-87.0f)

static inline float exp_nonpositive(float v) {
    int underflow = !(v >= EXP_FLOOR);
    v = underflow ? EXP_FLOOR : v;
    float k = rintf(v * EXP_LOG2E);
    float r = MADD(k, -EXP_LN2_HI, v);
    r = MADD(k, -EXP_LN2_LO, r);
    float p = 1.0f / 720.0f;
    p = MADD(p, r, 1.0f / 120.0f);
    p = MADD(p, r, 1.0f / 24.0f);
    p = MADD(p, r, 1.0f / 6.0f);
    p = MADD(p, r, 0.5f);
    p = MADD(p, r, 1.0f);
    p = MADD(p, r, 1.0f);
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return underflow ? 0.0f : p * two_k;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 exp8_nonpositive(__m256 v) {
    __m256 ok = _mm256_cmp_ps(v, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);   /* false for nan */
    v = _mm256_blendv_ps(_mm256_set1_ps(EXP_FLOOR), v, ok);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(-EXP_LN2_HI), v);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), ok);
}

/* The LANES partial sums of a, b, c, d reduced by the fixed tree ((0+1)+(2+3))+((4+5)+(6+7)), as 4 floats. */
static inline __m128 tree4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);   /* pairs (0+1), (2+3) | (4+5), (6+7) */
    __m256 abcd = _mm256_hadd_ps(ab, cd);                         /* (0+1)+(2+3) | (4+5)+(6+7), per input */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Register tiles: R rows (up to MAX_ROWS) times V vectors of 8 columns, R * V accumulators, V loaded vectors and
 * one broadcast within the 16 ymm registers. Each vector loaded feeds R fused multiply-adds and each broadcast V,
 * so more rows a tile means fewer loads a multiply-add. */
static inline __attribute__((always_inline)) void fma_tile(const int R, const int V, __m256 acc[MAX_ROWS][MAX_VECS],
                                                           const float *a, int64_t a_stride, const float *const *b,
                                                           int64_t b_offset, int n) {
    /* acc[r][c] = fma(a[r * a_stride + i], b[i][b_offset + 8c ..], acc[r][c]) for i = 0 .. n - 1 in order: each
     * element one fused multiply-add per i. R and V are constants where this is inlined, so the loops unroll and
     * the accumulators live in registers. */
    for (int i = 0; i < n; i++) {
        const float *bi = b[i] + b_offset;
        __m256 x[MAX_VECS];
        _Pragma("GCC unroll 8")
        for (int c = 0; c < V; c++) x[c] = _mm256_loadu_ps(bi + 8 * c);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            const __m256 w = _mm256_broadcast_ss(a + r * a_stride + i);
            _Pragma("GCC unroll 8")
            for (int c = 0; c < V; c++) acc[r][c] = _mm256_fmadd_ps(w, x[c], acc[r][c]);
        }
    }
}

/* Vectors of keys a scores tile of R rows takes at once (a divisor of KEY_TILE / 8). */
static inline __attribute__((always_inline)) int score_vecs(const int R) { return R <= 2 ? 4 : 2; }

/* Vectors of head_dim an accumulate tile of R rows takes at once; one row takes 8 (its loads folded into the
 * multiply-adds), so that its 8 sums in flight hide the multiply-add's latency. */
static inline __attribute__((always_inline)) int acc_vecs(const int R) { return R == 1 ? 8 : R <= 2 ? 4 : 2; }

/* scores[r][j] = dot(q_r, k[j]) * scale for R rows (queries D apart, scores KEY_TILE apart) and every key j of the
 * tile, from K transposed (kt_cols[d] = its column d, KEY_TILE keys): each dot summed along head_dim in order, one
 * fused multiply-add at a time. Keys past a row's limit get a score too, which the row never uses. */
static inline __attribute__((always_inline)) void scores_tile(const int R, float *scores, const float *q,
                                                              const float *const *kt_cols, int D, float scale) {
    const int V = score_vecs(R);
    const __m256 vs = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < KEY_TILE; j0 += 8 * V) {
        __m256 acc[MAX_ROWS][MAX_VECS];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 8")
            for (int c = 0; c < V; c++) acc[r][c] = _mm256_setzero_ps();
        fma_tile(R, V, acc, q, D, kt_cols, j0, D);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 8")
            for (int c = 0; c < V; c++)
                _mm256_storeu_ps(scores + r * KEY_TILE + j0 + 8 * c, _mm256_mul_ps(acc[r][c], vs));
    }
}

/* acc_r[d0 .. d0 + 8V) = acc_r * correction[r] + sum_j p_r[j] v[j], the keys folded in order, for j < m, R rows
 * (sums D apart, weights KEY_TILE apart). */
static inline __attribute__((always_inline)) void accumulate_tile(const int R, const int V, float *acc, const float *p,
                                                                  const float *correction,
                                                                  const float *const *v, int m, int D, int d0) {
    __m256 sums[MAX_ROWS][MAX_VECS];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < V; c++)
            sums[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * c), _mm256_set1_ps(correction[r]));
    fma_tile(R, V, sums, p, KEY_TILE, v, d0, m);
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < V; c++) _mm256_storeu_ps(acc + r * D + d0 + 8 * c, sums[r][c]);
}

static inline __attribute__((always_inline)) void accumulate_rows_of(const int R, float *acc, const float *p,
                                                                     const float *correction,
                                                                     const float *const *v, int m, int D) {
    const int V = acc_vecs(R);
    int d0 = 0;
    for (; d0 + 8 * V <= D; d0 += 8 * V) accumulate_tile(R, V, acc, p, correction, v, m, D, d0);
    for (; d0 < D; d0 += 8) accumulate_tile(R, 1, acc, p, correction, v, m, D, d0);   /* what is left: 8 at a time */
}

/* `call` (a function-like macro of a constant row count) for `rows`, 1 .. MAX_ROWS */
_Static_assert(MAX_ROWS == 5, "WITH_ROWS names every row count up to MAX_ROWS");
#define WITH_ROWS(rows, call) \
    switch (rows) { \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
        default: call(5); break; \
    }

/* The tile's scores for `rows` rows (1 .. MAX_ROWS): scores_tile. */
static __attribute__((noinline)) void scores_rows(int rows, float *scores, const float *q,
                                                  const float *const *kt_cols, int D, float scale) {
#define SCORES(R) scores_tile(R, scores, q, kt_cols, D, scale)
    WITH_ROWS(rows, SCORES)
#undef SCORES
}

/* acc_r = acc_r * correction[r] + sum_{j < m} p_r[j] v[j] for `rows` rows (1 .. MAX_ROWS): each element's operations
 * are the one-row loop's, whichever tile takes it. */
static __attribute__((noinline)) void accumulate_rows(int rows, float *acc, const float *p, const float *correction,
                                                      const float *const *v, int m, int D) {
#define ACCUMULATE(R) accumulate_rows_of(R, acc, p, correction, v, m, D)
    WITH_ROWS(rows, ACCUMULATE)
#undef ACCUMULATE
}

/* 8 values (from d) of 8 K rows transposed into 8 columns [at dst, row stride dst_stride]. */
static inline void transpose8(const float *const *k, int d, float *dst, int64_t dst_stride) {
    __m256 r0 = _mm256_loadu_ps(k[0] + d), r1 = _mm256_loadu_ps(k[1] + d), r2 = _mm256_loadu_ps(k[2] + d),
           r3 = _mm256_loadu_ps(k[3] + d), r4 = _mm256_loadu_ps(k[4] + d), r5 = _mm256_loadu_ps(k[5] + d),
           r6 = _mm256_loadu_ps(k[6] + d), r7 = _mm256_loadu_ps(k[7] + d);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + dst_stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * dst_stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * dst_stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* kt [D, KEY_TILE] = the tile's K rows (krow[j], KEY_TILE of them) transposed. */
static void transpose_tile(float *kt, const float *const *krow, int D) {
    for (int j = 0; j < KEY_TILE; j += 8)
        for (int d = 0; d < D; d += 8) transpose8(krow + j, d, kt + (int64_t)d * KEY_TILE + j, KEY_TILE);
}

/* scores[j] = exp(scores[j] - shift) for j < m, 0 up to the next multiple of LANES; returns their sum: LANES
 * partial sums over the groups of LANES keys in order, then the tree. */
static float tile_exp_sum(float *scores, int m, float shift) {
    __m256 vshift = _mm256_set1_ps(shift), sum = _mm256_setzero_ps();
    for (int j = 0; j < m; j += LANES) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(scores + j), vshift);
        if (m - j < LANES) {   /* keys past the row's limit: exp(-inf) = 0 */
            __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m - j), lane));
            v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, live);
        }
        v = exp8_nonpositive(v);
        _mm256_storeu_ps(scores + j, v);
        sum = _mm256_add_ps(sum, v);
    }
    __m128 s = tree4(sum, sum, sum, sum);
    return _mm_cvtss_f32(s);
}

/* x[i] = exp(x[i]) for i < n <= LANES, x[i] <= 0: exp8_nonpositive on each. */
static void exp_rows(float *x, int n) {
    float lanes[LANES] = {0};
    memcpy(lanes, x, (size_t)n * sizeof(float));
    _mm256_storeu_ps(lanes, exp8_nonpositive(_mm256_loadu_ps(lanes)));
    memcpy(x, lanes, (size_t)n * sizeof(float));
}

/* The largest of scores[0..m) (exact in any order). */
static float tile_max(const float *scores, int m) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + LANES <= m; j += LANES) best = _mm256_max_ps(best, _mm256_loadu_ps(scores + j));
    float lanes[LANES], result = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int i = 0; i < LANES; i++) result = lanes[i] > result ? lanes[i] : result;
    for (; j < m; j++) result = scores[j] > result ? scores[j] : result;
    return result;
}
#else
/* Portable versions of the functions above: the same operations, element by element. */
static void transpose_tile(float *kt, const float *const *krow, int D) {
    for (int j = 0; j < KEY_TILE; j++)
        for (int d = 0; d < D; d++) kt[(int64_t)d * KEY_TILE + j] = krow[j][d];
}

static float tile_exp_sum(float *scores, int m, float shift) {
    float lane[LANES] = {0};
    for (int j = 0; j < m; j++) {
        scores[j] = exp_nonpositive(scores[j] - shift);
        lane[j % LANES] += scores[j];
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static void exp_rows(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = exp_nonpositive(x[i]);
}

static void scores_rows(int rows, float *scores, const float *q, const float *const *kt_cols, int D, float scale) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < KEY_TILE; j++) {
            float acc = 0.0f;
            for (int d = 0; d < D; d++) acc = MADD(q[r * D + d], kt_cols[d][j], acc);
            scores[r * KEY_TILE + j] = acc * scale;
        }
}

static void accumulate_rows(int rows, float *acc, const float *p, const float *correction, const float *const *v,
                            int m, int D) {
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < D; d++) {
            float sum = acc[r * D + d] * correction[r];
            for (int j = 0; j < m; j++) sum = MADD(p[r * KEY_TILE + j], v[j][d], sum);
            acc[r * D + d] = sum;
        }
}

static float tile_max(const float *scores, int m) {
    float result = -INFINITY;
    for (int j = 0; j < m; j++) result = scores[j] > result ? scores[j] : result;
    return result;
}
#endif

typedef struct {
    float *q;        /* [rows, head_dim] the block's queries in float32 */
    float *acc;      /* [rows, head_dim] */
    float *row_max, *row_sum;
    float *scores;   /* [MAX_ROWS, KEY_TILE]: a register tile's rows' */
    float *kbuf, *vbuf;   /* [kv heads, KEY_TILE, head_dim] the tile's K and V rows in float32 (where copied) */
    float *kt;            /* [head_dim, KEY_TILE] its K transposed */
    const float *kt_cols[MAX_HEAD_DIM];   /* kt's columns: kt + d * KEY_TILE */
    float *kzero;         /* [KEY_TILE, head_dim] zeros: a partial tile's missing K rows */
} Scratch;

/* Keys of a tile (from position `start`, n of them) that the row at position `pos` >= start sees. */
static inline int keys_seen(int64_t pos, int64_t start, int n) {
    return pos - start + 1 < n ? (int)(pos - start + 1) : n;
}

/* One tile for `rows` consecutive rows from r (at most MAX_ROWS) that see its first m keys (values v[j]): their
 * scores, the online softmax's step, then their weighted values. Each row's operations are the same whichever
 * rows share its tile. This function, scores_rows and accumulate_rows stay out of attend_block: all of them inlined
 * into one measured 5-15% slower (a 10-token question, a 512-token prefill). */
static __attribute__((noinline)) void tile_rows(Scratch *s, int r, int rows, int m, const float *const *v, int D,
                                                float scale) {
    float *scores = s->scores, new_max[MAX_ROWS], correction[MAX_ROWS];
    scores_rows(rows, scores, s->q + (int64_t)r * D, s->kt_cols, D, scale);
    for (int i = 0; i < rows; i++) {
        float old_max = s->row_max[r + i], tile = tile_max(scores + i * KEY_TILE, m);
        new_max[i] = tile > old_max ? tile : old_max;
        correction[i] = old_max - new_max[i];   /* -inf - new_max on the row's first tile: its correction is 0 */
    }
    exp_rows(correction, rows);
    for (int i = 0; i < rows; i++) {
        s->row_sum[r + i] = s->row_sum[r + i] * correction[i] + tile_exp_sum(scores + i * KEY_TILE, m, new_max[i]);
        s->row_max[r + i] = new_max[i];
    }
    accumulate_rows(rows, s->acc + (int64_t)r * D, scores, correction, v, m, D);
}

/* One work item: query tokens [t0, t1) of sequence `seq` (positions ctx + i), every head of KV heads [h0, h1)'s
 * groups. Row r: KV head h0 + r / per_head; within it, token t0 + (r % per_head) / group, query head h * group +
 * r % group. The heads of an item walk the tiles together, so a tile's K and V rows of all its heads (adjacent in
 * the cache) are read at once. */
static void attend_block(const Problem *p, Scratch *s, int seq, int h0, int h1, int64_t t0, int64_t t1) {
    const int D = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t q_first = p->query_start[seq], q_len = p->query_start[seq + 1] - q_first;
    const int64_t ctx = p->seq_lens[seq] - q_len;
    const int per_head = (int)(t1 - t0) * group, rows = per_head * (h1 - h0);
    const int64_t table = (int64_t)seq * p->bt_stride;   /* the sequence's row of the block tables */
    const float *krow[KEY_TILE], *vrow[KEY_TILE];
    int64_t offset[KEY_TILE];   /* the tile's positions' rows, in bytes from the layer's KV head 0 */
    const size_t qsize = p->query_dtype == DTYPE_F32 ? 4 : 2, csize = p->cache_dtype == DTYPE_F32 ? 4 : 2;
    const char *layer_base = (const char *)p->cache + (int64_t)p->layer * p->c_stride_layer * (int64_t)csize;
    const int64_t v_offset = p->c_stride_part * (int64_t)csize, head_bytes = p->c_stride_head * (int64_t)csize;

    for (int r = 0; r < rows; r++) {
        int h = h0 + r / per_head, rr = r % per_head;
        int64_t token = q_first + t0 + rr / group;
        int head = h * group + rr % group;
        const char *src = (const char *)p->query + (token * p->q_stride_token + head * p->q_stride_head) * qsize;
        row_to_float(s->q + (int64_t)r * D, src, p->query_dtype, D);
        memset(s->acc + (int64_t)r * D, 0, (size_t)D * sizeof(float));
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
    }
    const int64_t last_pos = ctx + t1 - 1;   /* the furthest any row sees */
    int64_t block_index = 0;
    int slot = 0;
    for (int64_t start = 0; start <= last_pos; start += KEY_TILE) {
        int n = (int)(last_pos - start + 1 < KEY_TILE ? last_pos - start + 1 : KEY_TILE);
        for (int j = 0; j < n; j++) {   /* position start + j lies in block table[block_index], at `slot` */
            int64_t block = table_entry(p->block_tables, p->bt_int32, table + block_index);
            offset[j] = (block * p->c_stride_block + (int64_t)slot * p->c_stride_slot) * (int64_t)csize;
            if (++slot == p->block_size) { slot = 0; block_index++; }
        }
        /* An item of several KV heads first copies (16-bit rows: converts) the tile's K and V rows of all its heads
         * into scratch, in the order they lie in the cache: slot by slot, a slot's heads side by side. Read so, the
         * rows stream from memory faster than one head's rows at a time (every KV-head stride), which is
         * what bounds a decode row. A one-head item (a long query, whose tile many rows reuse) reads float32
         * rows where they lie and converts 16-bit ones as it goes. */
        const int staged = h1 - h0 > 1;
        if (staged)
            for (int j = 0; j < n; j++)
                for (int h = h0; h < h1; h++) {
                    const char *k = layer_base + offset[j] + h * head_bytes;
                    int64_t at = ((int64_t)(h - h0) * KEY_TILE + j) * D;
                    row_to_float(s->kbuf + at, k, p->cache_dtype, D);
                    row_to_float(s->vbuf + at, k + v_offset, p->cache_dtype, D);
                }
        for (int h = h0; h < h1; h++) {
            for (int j = 0; j < n; j++) {
                int64_t at = ((int64_t)(h - h0) * KEY_TILE + j) * D;
                const char *k = layer_base + offset[j] + h * head_bytes;
                if (!staged && p->cache_dtype != DTYPE_F32) {
                    row_to_float(s->kbuf + at, k, p->cache_dtype, D);
                    row_to_float(s->vbuf + at, k + v_offset, p->cache_dtype, D);
                }
                int direct = !staged && p->cache_dtype == DTYPE_F32;
                krow[j] = direct ? (const float *)k : s->kbuf + at;
                vrow[j] = direct ? (const float *)(k + v_offset) : s->vbuf + at;
            }
            /* K is transposed into kt (scores take 8 keys a vector); a partial tile's missing rows are zero rows,
             * whose scores no row uses */
            for (int j = n; j < KEY_TILE; j++) krow[j] = s->kzero + (int64_t)j * D;
            transpose_tile(s->kt, krow, D);
            /* The head's rows (first + k, k < per_head; token k / group of the item) that see this tile, a run of
             * rows that see the same keys at a time (one token's, or those of every token that sees the whole
             * tile), in near-equal register tiles of at most MAX_ROWS rows. Tokens before the first are past the
             * tile's causal limit (it adds exact zeros to them). */
            const int first = (h - h0) * per_head, tokens = (int)(t1 - t0);
            for (int token = start > ctx + t0 ? (int)(start - ctx - t0) : 0; token < tokens;) {
                int m = keys_seen(ctx + t0 + token, start, n);
                int end = m == n ? tokens : token + 1;   /* the tokens after one that sees the whole tile do too */
                int run = (end - token) * group, tiles = (run + MAX_ROWS - 1) / MAX_ROWS;
                for (int k = token * group, i = 0; i < tiles; i++) {
                    int rows = run / tiles + (i < run % tiles);
                    tile_rows(s, first + k, rows, m, vrow, D, p->scale);
                    k += rows;
                }
                token = end;
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        int h = h0 + r / per_head, rr = r % per_head;
        int64_t token = q_first + t0 + rr / group;
        int head = h * group + rr % group;
        float *dst = p->out + token * p->o_stride_token + head * p->o_stride_head;
        const float *acc = s->acc + (int64_t)r * D, inv = s->row_sum[r];
        for (int d = 0; d < D; d++) dst[d] = acc[d] / inv;
    }
}

/* A sequence's items: its query blocks times its KV-head ranges. A short query's item takes `short_heads` KV heads
 * (all of them unless the call has fewer sequences than threads), read in one pass over the cache; a long one's,
 * one KV head, whose tiles its many rows reuse. Which rows share an item never changes a row's operations. */
static int heads_per_item(int64_t q_len, int short_heads) {
    return q_len <= SHORT_QUERY ? short_heads : 1;
}

/* The new tokens an item takes: a short query's all of them (its K/V rows read once), a long one's QUERY_BLOCK. */
static int64_t tokens_per_item(int64_t q_len) {
    return q_len <= SHORT_QUERY ? SHORT_QUERY : QUERY_BLOCK;
}

static void run_item(const Problem *p, Scratch *s, int64_t item) {
    int lo = 0, hi = p->num_seqs;   /* the last sequence whose first item is <= item */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (p->item_start[mid] <= item) lo = mid; else hi = mid;
    }
    int64_t q_len = p->query_start[lo + 1] - p->query_start[lo];
    int64_t tokens = tokens_per_item(q_len), blocks = (q_len + tokens - 1) / tokens, local = item - p->item_start[lo];
    int hpi = heads_per_item(q_len, p->short_heads);
    int h0 = (int)(local / blocks) * hpi;
    /* a sequence's last tokens first: they see the most keys, and threads that take the longest items first finish
     * together */
    int64_t t0 = (blocks - 1 - local % blocks) * tokens, t1 = t0 + tokens < q_len ? t0 + tokens : q_len;
    attend_block(p, s, lo, h0, h0 + hpi, t0, t1);
}

static int scratch_alloc(Scratch *s, int head_dim, int num_heads, int num_kv_heads) {
    size_t rows = (size_t)(SHORT_QUERY > QUERY_BLOCK ? SHORT_QUERY : QUERY_BLOCK) * num_heads, D = (size_t)head_dim;
    size_t floats = 2 * rows * D + 2 * rows + MAX_ROWS * KEY_TILE + (2 * (size_t)num_kv_heads + 2) * KEY_TILE * D;
    float *mem = (float *)malloc(floats * sizeof(float));
    if (!mem) return ERR_ALLOC;
    s->q = mem;
    s->acc = s->q + rows * D;
    s->row_max = s->acc + rows * D;
    s->row_sum = s->row_max + rows;
    s->scores = s->row_sum + rows;
    s->kbuf = s->scores + MAX_ROWS * KEY_TILE;
    s->vbuf = s->kbuf + (size_t)num_kv_heads * KEY_TILE * D;
    s->kt = s->vbuf + (size_t)num_kv_heads * KEY_TILE * D;
    s->kzero = s->kt + KEY_TILE * D;
    for (int d = 0; d < head_dim; d++) s->kt_cols[d] = s->kt + (size_t)d * KEY_TILE;
    /* a partial tile's missing K rows: transposed and scored too (their scores unused), so finite */
    memset(s->kzero, 0, KEY_TILE * D * sizeof(float));
    return OK;
}

/* One thread's share of a call (run_parallel): items taken from the shared counter until none is left. */
static int worker(void *arg, int index, int count) {
    (void)index, (void)count;
    Problem *p = (Problem *)arg;
    Scratch s;
    if (scratch_alloc(&s, p->head_dim, p->num_heads, p->num_kv_heads) != OK) return ERR_ALLOC;
    for (;;) {
        int64_t item = __atomic_fetch_add(&p->next_item, 1, __ATOMIC_RELAXED);
        if (item >= p->num_items) break;
        run_item(p, &s, item);
    }
    free(s.q);
    return OK;
}

/* Every block id a sequence's first seq_len positions use must name a block of the cache. Returns the first
 * offending sequence's index, or -1. */
long kvs_check_block_tables(const void *block_tables, int bt_int32, int64_t bt_stride, const int64_t *seq_lens,
                            int num_seqs, int block_size, int64_t num_blocks) {
    for (int b = 0; b < num_seqs; b++) {
        int64_t used = (seq_lens[b] + block_size - 1) / block_size;
        for (int64_t i = 0; i < used; i++) {
            int64_t id = table_entry(block_tables, bt_int32, (int64_t)b * bt_stride + i);
            if (id < 0 || id >= num_blocks) return b;
        }
    }
    return -1;
}

int kvs_prefix_prefill(
        const void *query, int query_dtype, int64_t q_stride_token, int64_t q_stride_head,
        const void *cache, int cache_dtype, const int64_t *cache_strides /* block, layer, part, slot, head */,
        int64_t num_blocks, int layer, int block_size,
        const void *block_tables, int bt_int32, int64_t bt_stride, const int64_t *query_start, const int64_t *seq_lens,
        int num_seqs, int num_heads, int num_kv_heads, int head_dim, float scale,
        float *out, int64_t o_stride_token, int64_t o_stride_head, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || head_dim % LANES || block_size <= 0 || num_seqs < 0)
        return ERR_SHAPE;
    if (kvs_check_block_tables(block_tables, bt_int32, bt_stride, seq_lens, num_seqs, block_size, num_blocks) >= 0)
        return ERR_BLOCK_ID;
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!item_start) return ERR_ALLOC;
    int threads = num_threads < 1 ? 1 : num_threads;
    int short_heads = num_seqs >= threads ? num_kv_heads : 1;
    int64_t items = 0;
    for (int b = 0; b < num_seqs; b++) {
        item_start[b] = items;
        int64_t q_len = query_start[b + 1] - query_start[b];
        int64_t tokens = tokens_per_item(q_len);
        items += (q_len + tokens - 1) / tokens * (num_kv_heads / heads_per_item(q_len, short_heads));
    }
    item_start[num_seqs] = items;
    Problem p = {query, query_dtype, q_stride_token, q_stride_head, cache, cache_dtype,
                 cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_strides[4],
                 num_blocks, layer, block_size, block_tables, bt_stride, bt_int32, query_start, seq_lens,
                 num_seqs, num_heads, num_kv_heads, head_dim, scale, out, o_stride_token, o_stride_head,
                 item_start, items, short_heads, 0};
    if (threads > items) threads = (int)items;
    int status = items > 0 ? run_parallel(worker, &p, threads) : OK;
    free(item_start);
    return status;
}
