/* Prefix-prefill attention on a CPU, read straight from the paged KV cache (kernels/cpu_attention.py builds and
 * calls this; kernels/prefix_prefill.py documents the inputs).
 *
 * Batch-invariant by construction: each (query token, query head) output is computed by one thread, from its own
 * query and the keys it may see (positions 0 ..= its own), walked in tiles of KEY_TILE positions counted from
 * position 0, with a float32 online softmax. Nothing of that order depends on the other rows of the call, the
 * number of threads, or where the step began (after a cached prefix or not), so a row's bits never do either.
 *
 * Determinism of the arithmetic: built with -ffp-contract=off, so the compiler fuses no multiply-add on its own;
 * fused ones are explicit (MADD). Every reduction has a fixed order: a dot product keeps LANES partial sums (lane
 * i takes the elements i, i + LANES, ...) summed in one fixed tree; a tile's softmax sum and its weighted values
 * are summed key by key in position order. Vectorised or not, the operations on each element are the same.
 *
 * Several query rows (the heads of one GQA group, QUERY_BLOCK consecutive tokens) share each key tile, so each
 * K/V row is read (and converted to float32) once per tile for all of them; the rows' arithmetic is unchanged.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define LANES 8
#define KEY_TILE 64
#define QUERY_BLOCK 8
#define MAX_GROUP 64
#define MAX_HEAD_DIM 512

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
enum { OK = 0, ERR_BLOCK_ID = -1, ERR_ALLOC = -2, ERR_THREAD = -3, ERR_SHAPE = -4 };

typedef struct {
    const void *query;         /* [T, num_heads, head_dim], strides below (elements), last axis contiguous */
    int query_dtype;
    int64_t q_stride_token, q_stride_head;
    const void *cache;         /* [num_blocks, num_layers, 2, block_size, num_kv_heads, row] */
    int cache_dtype;
    int64_t c_stride_block, c_stride_layer, c_stride_part, c_stride_slot, c_stride_head;
    int64_t num_blocks;
    int layer, block_size;
    const int64_t *block_tables;   /* [B, max_blocks] */
    int64_t bt_stride;
    const int64_t *query_start;    /* [B + 1] */
    const int64_t *seq_lens;       /* [B] */
    int num_seqs, num_heads, num_kv_heads, head_dim;
    float scale;
    float *out;                    /* [T, num_heads, head_dim] float32, strides below */
    int64_t o_stride_token, o_stride_head;
    /* work items: (sequence, kv head, query block), numbered in that order; `item_start[b]` is the first of b */
    const int64_t *item_start;
    int64_t num_items;
    int64_t next_item;             /* shared counter, taken atomically by the threads */
} Problem;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);                 /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);          /* normal */
    } else if (mant == 0) {
        bits = sign;                                               /* zero */
    } else {                                                       /* subnormal: normalise */
        int shift = 0;
        while (!(mant & 0x400)) { mant <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* `n` values of `dtype` at `src` as float32 into `dst` (exact: every bf16 and f16 value is a float32). */
static void to_float(float *dst, const void *src, int dtype, int n) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
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

/* scores[j] = dot(q, k[j]) * scale for j < m: each dot in LANES partial sums along head_dim, then the tree. */
static void tile_scores(float *scores, const float *q, const float *const *k, int m, int D, float scale) {
    const __m128 vscale = _mm_set1_ps(scale);
    int j = 0;
    for (; j < m; j += 4) {
        const float *k0 = k[j], *k1 = j + 1 < m ? k[j + 1] : k0, *k2 = j + 2 < m ? k[j + 2] : k0,
                    *k3 = j + 3 < m ? k[j + 3] : k0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d = 0; d < D; d += LANES) {
            __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k3 + d), a3);
        }
        _mm_storeu_ps(scores + j, _mm_mul_ps(tree4(a0, a1, a2, a3), vscale));
    }
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

static float exp1_nonpositive(float v) {
    return _mm256_cvtss_f32(exp8_nonpositive(_mm256_set1_ps(v)));
}

/* acc = acc * correction + sum_j p[j] v[j], the keys folded in order, for j < m. */
static void tile_accumulate(float *acc, const float *p, const float *const *v, int m, int D, float correction) {
    const __m256 c = _mm256_set1_ps(correction);
    for (int d0 = 0; d0 < D; d0 += 8 * LANES) {
        int width = D - d0 < 8 * LANES ? D - d0 : 8 * LANES;
        if (width == 8 * LANES) {
            __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0), c), r1 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8), c),
                   r2 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 16), c), r3 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 24), c),
                   r4 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 32), c), r5 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 40), c),
                   r6 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 48), c), r7 = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 56), c);
            for (int j = 0; j < m; j++) {
                const __m256 w = _mm256_set1_ps(p[j]);
                const float *row = v[j] + d0;
                r0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), r0);
                r1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), r1);
                r2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), r2);
                r3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), r3);
                r4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 32), r4);
                r5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 40), r5);
                r6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 48), r6);
                r7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 56), r7);
            }
            _mm256_storeu_ps(acc + d0, r0); _mm256_storeu_ps(acc + d0 + 8, r1);
            _mm256_storeu_ps(acc + d0 + 16, r2); _mm256_storeu_ps(acc + d0 + 24, r3);
            _mm256_storeu_ps(acc + d0 + 32, r4); _mm256_storeu_ps(acc + d0 + 40, r5);
            _mm256_storeu_ps(acc + d0 + 48, r6); _mm256_storeu_ps(acc + d0 + 56, r7);
        } else {   /* fewer than 64 values left: one vector at a time, the same operations */
            for (int d = d0; d < d0 + width; d += LANES) {
                __m256 r = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
                for (int j = 0; j < m; j++) r = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d), r);
                _mm256_storeu_ps(acc + d, r);
            }
        }
    }
}
#else
/* Portable versions of the four above: the same operations, element by element. */
static void tile_scores(float *scores, const float *q, const float *const *k, int m, int D, float scale) {
    for (int j = 0; j < m; j++) {
        float lane[LANES] = {0};
        for (int d = 0; d < D; d += LANES)
            for (int i = 0; i < LANES; i++) lane[i] = MADD(q[d + i], k[j][d + i], lane[i]);
        scores[j] = (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) * scale;
    }
}

static float tile_exp_sum(float *scores, int m, float shift) {
    float lane[LANES] = {0};
    for (int j = 0; j < m; j++) {
        scores[j] = exp_nonpositive(scores[j] - shift);
        lane[j % LANES] += scores[j];
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static float exp1_nonpositive(float v) { return exp_nonpositive(v); }

static void tile_accumulate(float *acc, const float *p, const float *const *v, int m, int D, float correction) {
    for (int d = 0; d < D; d++) {
        float r = acc[d] * correction;
        for (int j = 0; j < m; j++) r = MADD(p[j], v[j][d], r);
        acc[d] = r;
    }
}
#endif

typedef struct {
    float *q;        /* [rows, head_dim] the block's queries in float32 */
    float *acc;      /* [rows, head_dim] */
    float *row_max, *row_sum;
    float *scores;   /* [KEY_TILE] */
    float *kbuf, *vbuf;   /* [KEY_TILE, head_dim] converted rows (16-bit caches) */
} Scratch;

/* One work item: query tokens [t0, t1) of sequence `seq` (positions ctx + i), every head of kv head `kvh`'s group. */
static void attend_block(const Problem *p, Scratch *s, int seq, int kvh, int64_t t0, int64_t t1) {
    const int D = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t q_first = p->query_start[seq], q_len = p->query_start[seq + 1] - q_first;
    const int64_t ctx = p->seq_lens[seq] - q_len;
    const int64_t *table = p->block_tables + (int64_t)seq * p->bt_stride;
    const int rows = (int)(t1 - t0) * group;
    const float *krow[KEY_TILE], *vrow[KEY_TILE];
    const size_t qsize = p->query_dtype == DTYPE_F32 ? 4 : 2, csize = p->cache_dtype == DTYPE_F32 ? 4 : 2;
    const char *layer_base = (const char *)p->cache +
        ((int64_t)p->layer * p->c_stride_layer + (int64_t)kvh * p->c_stride_head) * (int64_t)csize;
    const int64_t v_offset = p->c_stride_part * (int64_t)csize;

    for (int r = 0; r < rows; r++) {   /* row r: token t0 + r / group, head kvh * group + r % group */
        int64_t token = q_first + t0 + r / group;
        int head = kvh * group + r % group;
        const char *src = (const char *)p->query + (token * p->q_stride_token + head * p->q_stride_head) * qsize;
        to_float(s->q + (int64_t)r * D, src, p->query_dtype, D);
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
            const char *k = layer_base + (table[block_index] * p->c_stride_block + (int64_t)slot * p->c_stride_slot)
                            * (int64_t)csize;
            if (p->cache_dtype == DTYPE_F32) {
                krow[j] = (const float *)k;
                vrow[j] = (const float *)(k + v_offset);
            } else {
                to_float(s->kbuf + (int64_t)j * D, k, p->cache_dtype, D);
                to_float(s->vbuf + (int64_t)j * D, k + v_offset, p->cache_dtype, D);
                krow[j] = s->kbuf + (int64_t)j * D;
                vrow[j] = s->vbuf + (int64_t)j * D;
            }
            if (++slot == p->block_size) { slot = 0; block_index++; }
        }
        for (int r = 0; r < rows; r++) {
            int64_t pos = ctx + t0 + r / group;
            if (pos < start) continue;   /* this tile is past the row's causal limit: it would add exact zeros */
            int m = (int)(pos - start + 1 < n ? pos - start + 1 : n);   /* keys of this tile the row sees */
            tile_scores(s->scores, s->q + (int64_t)r * D, krow, m, D, p->scale);
            float tile_max = -INFINITY;
            for (int j = 0; j < m; j++) tile_max = s->scores[j] > tile_max ? s->scores[j] : tile_max;
            float new_max = tile_max > s->row_max[r] ? tile_max : s->row_max[r];
            /* -inf - new_max on the row's first tile: its correction is 0 (and multiplies zeros) */
            float correction = exp1_nonpositive(s->row_max[r] - new_max);
            float tile_sum = tile_exp_sum(s->scores, m, new_max);
            s->row_sum[r] = s->row_sum[r] * correction + tile_sum;
            s->row_max[r] = new_max;
            tile_accumulate(s->acc + (int64_t)r * D, s->scores, vrow, m, D, correction);
        }
    }
    for (int r = 0; r < rows; r++) {
        int64_t token = q_first + t0 + r / group;
        int head = kvh * group + r % group;
        float *dst = p->out + token * p->o_stride_token + head * p->o_stride_head;
        const float *acc = s->acc + (int64_t)r * D, inv = s->row_sum[r];
        for (int d = 0; d < D; d++) dst[d] = acc[d] / inv;
    }
}

static void run_item(const Problem *p, Scratch *s, int64_t item) {
    int lo = 0, hi = p->num_seqs;   /* the last sequence whose first item is <= item */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (p->item_start[mid] <= item) lo = mid; else hi = mid;
    }
    int64_t q_len = p->query_start[lo + 1] - p->query_start[lo];
    int64_t blocks = (q_len + QUERY_BLOCK - 1) / QUERY_BLOCK, local = item - p->item_start[lo];
    int kvh = (int)(local / blocks);
    int64_t t0 = (local % blocks) * QUERY_BLOCK, t1 = t0 + QUERY_BLOCK < q_len ? t0 + QUERY_BLOCK : q_len;
    attend_block(p, s, lo, kvh, t0, t1);
}

static int scratch_alloc(Scratch *s, int head_dim, int group) {
    size_t rows = (size_t)QUERY_BLOCK * group, D = (size_t)head_dim;
    float *mem = (float *)malloc(sizeof(float) * (2 * rows * D + 2 * rows + KEY_TILE + 2 * KEY_TILE * D));
    if (!mem) return ERR_ALLOC;
    s->q = mem;
    s->acc = s->q + rows * D;
    s->row_max = s->acc + rows * D;
    s->row_sum = s->row_max + rows;
    s->scores = s->row_sum + rows;
    s->kbuf = s->scores + KEY_TILE;
    s->vbuf = s->kbuf + KEY_TILE * D;
    return OK;
}

static void *worker(void *arg) {
    Problem *p = (Problem *)arg;
    Scratch s;
    if (scratch_alloc(&s, p->head_dim, p->num_heads / p->num_kv_heads) != OK) return (void *)1;
    for (;;) {
        int64_t item = __atomic_fetch_add(&p->next_item, 1, __ATOMIC_RELAXED);
        if (item >= p->num_items) break;
        run_item(p, &s, item);
    }
    free(s.q);
    return NULL;
}

/* Every block id a sequence's first seq_len positions use must name a block of the cache. Returns the first
 * offending sequence's index, or -1. */
long kvs_check_block_tables(const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, int num_seqs,
                            int block_size, int64_t num_blocks) {
    for (int b = 0; b < num_seqs; b++) {
        int64_t used = (seq_lens[b] + block_size - 1) / block_size;
        for (int64_t i = 0; i < used; i++) {
            int64_t id = block_tables[(int64_t)b * bt_stride + i];
            if (id < 0 || id >= num_blocks) return b;
        }
    }
    return -1;
}

int kvs_prefix_prefill(
        const void *query, int query_dtype, int64_t q_stride_token, int64_t q_stride_head,
        const void *cache, int cache_dtype, const int64_t *cache_strides /* block, layer, part, slot, head */,
        int64_t num_blocks, int layer, int block_size,
        const int64_t *block_tables, int64_t bt_stride, const int64_t *query_start, const int64_t *seq_lens,
        int num_seqs, int num_heads, int num_kv_heads, int head_dim, float scale,
        float *out, int64_t o_stride_token, int64_t o_stride_head, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || head_dim % LANES || block_size <= 0 || num_seqs < 0)
        return ERR_SHAPE;
    if (kvs_check_block_tables(block_tables, bt_stride, seq_lens, num_seqs, block_size, num_blocks) >= 0)
        return ERR_BLOCK_ID;
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!item_start) return ERR_ALLOC;
    int64_t items = 0;
    for (int b = 0; b < num_seqs; b++) {
        item_start[b] = items;
        int64_t q_len = query_start[b + 1] - query_start[b];
        items += (q_len + QUERY_BLOCK - 1) / QUERY_BLOCK * num_kv_heads;
    }
    item_start[num_seqs] = items;
    Problem p = {query, query_dtype, q_stride_token, q_stride_head, cache, cache_dtype,
                 cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_strides[4],
                 num_blocks, layer, block_size, block_tables, bt_stride, query_start, seq_lens,
                 num_seqs, num_heads, num_kv_heads, head_dim, scale, out, o_stride_token, o_stride_head,
                 item_start, items, 0};
    int status = OK;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > items) threads = (int)items;
    if (threads <= 1) {
        if (items > 0 && worker(&p) != NULL) status = ERR_ALLOC;
    } else {
        pthread_t ids[threads - 1];
        int started = 0;
        for (; started < threads - 1; started++)
            if (pthread_create(&ids[started], NULL, worker, &p) != 0) break;
        /* the calling thread works too; if a thread could not start, the others take its share */
        if (worker(&p) != NULL) status = ERR_ALLOC;
        for (int i = 0; i < started; i++) {
            void *result;
            pthread_join(ids[i], &result);
            if (result != NULL) status = ERR_ALLOC;
        }
    }
    free(item_start);
    return status;
}
