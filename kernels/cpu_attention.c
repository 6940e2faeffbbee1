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

/* exp(x) for x <= 0 (scores minus their running maximum), elementwise and the same instructions for every element
 * (vectorised or not): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error ~2e-7), times
 * 2^n from the exponent bits. Below -87 the result is flushed to 0 (e^-87 ~ 1.6e-38, under float32's normals). */
static void exp_nonpositive(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i];
        int underflow = !(v >= -87.0f);   /* also -inf and nan */
        v = underflow ? -87.0f : v;
        float k = rintf(v * 1.44269504088896341f);
        float r = MADD(k, -0.693145751953125f, v);   /* ln2 in two parts (Cody-Waite) */
        r = MADD(k, -1.428606765330187045e-06f, r);
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
        x[i] = underflow ? 0.0f : p * two_k;
    }
}

/* sum_d a[d] * b[d] in LANES partial sums, then a fixed tree. */
static inline float dot(const float *a, const float *b, int n) {
    float lane[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) lane[i] = MADD(a[d + i], b[d + i], lane[i]);
    for (int i = 0; d + i < n; i++) lane[i] = MADD(a[d + i], b[d + i], lane[i]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

typedef struct {
    float *q;        /* [rows, head_dim] the block's queries in float32 */
    float *acc;      /* [rows, head_dim] */
    float *row_max, *row_sum;
    float *scores;   /* [KEY_TILE] */
    float *kbuf, *vbuf;   /* [KEY_TILE, head_dim] converted rows (16-bit caches) */
} Scratch;

static const void *cache_row(const Problem *p, int64_t block, int part, int slot, int kv_head) {
    size_t esize = p->cache_dtype == DTYPE_F32 ? 4 : 2;
    int64_t offset = block * p->c_stride_block + (int64_t)p->layer * p->c_stride_layer + part * p->c_stride_part +
                     (int64_t)slot * p->c_stride_slot + (int64_t)kv_head * p->c_stride_head;
    return (const char *)p->cache + offset * (int64_t)esize;
}

/* One work item: query tokens [t0, t1) of sequence `seq` (positions ctx + i), every head of kv head `kvh`'s group. */
static void attend_block(const Problem *p, Scratch *s, int seq, int kvh, int64_t t0, int64_t t1) {
    const int D = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t q_first = p->query_start[seq], q_len = p->query_start[seq + 1] - q_first;
    const int64_t ctx = p->seq_lens[seq] - q_len;
    const int64_t *table = p->block_tables + (int64_t)seq * p->bt_stride;
    const int rows = (int)(t1 - t0) * group;
    const float *krow[KEY_TILE], *vrow[KEY_TILE];
    size_t qsize = p->query_dtype == DTYPE_F32 ? 4 : 2;

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
    for (int64_t start = 0; start <= last_pos; start += KEY_TILE) {
        int n = (int)(last_pos - start + 1 < KEY_TILE ? last_pos - start + 1 : KEY_TILE);
        for (int j = 0; j < n; j++) {
            int64_t pos = start + j;
            int64_t block = table[pos / p->block_size];
            int slot = (int)(pos % p->block_size);
            const void *k = cache_row(p, block, 0, slot, kvh), *v = cache_row(p, block, 1, slot, kvh);
            if (p->cache_dtype == DTYPE_F32) {
                krow[j] = (const float *)k;
                vrow[j] = (const float *)v;
            } else {
                to_float(s->kbuf + (int64_t)j * D, k, p->cache_dtype, D);
                to_float(s->vbuf + (int64_t)j * D, v, p->cache_dtype, D);
                krow[j] = s->kbuf + (int64_t)j * D;
                vrow[j] = s->vbuf + (int64_t)j * D;
            }
        }
        for (int r = 0; r < rows; r++) {
            int64_t pos = ctx + t0 + r / group;
            if (pos < start) continue;   /* this tile is past the row's causal limit: it would add exact zeros */
            int m = (int)(pos - start + 1 < n ? pos - start + 1 : n);   /* keys of this tile the row sees */
            const float *q = s->q + (int64_t)r * D;
            float tile_max = -INFINITY;
            for (int j = 0; j < m; j++) {
                float score = dot(q, krow[j], D) * p->scale;
                s->scores[j] = score;
                tile_max = score > tile_max ? score : tile_max;
            }
            float new_max = tile_max > s->row_max[r] ? tile_max : s->row_max[r];
            float correction = s->row_max[r] - new_max;   /* -inf on the row's first tile: exp gives 0 */
            for (int j = 0; j < m; j++) s->scores[j] -= new_max;
            exp_nonpositive(s->scores, m);
            exp_nonpositive(&correction, 1);
            float tile_sum = 0.0f;
            for (int j = 0; j < m; j++) tile_sum += s->scores[j];
            s->row_sum[r] = s->row_sum[r] * correction + tile_sum;
            s->row_max[r] = new_max;
            float *acc = s->acc + (int64_t)r * D;
            for (int d = 0; d < D; d++) acc[d] *= correction;
            for (int j = 0; j < m; j++) {
                const float w = s->scores[j], *v = vrow[j];
                for (int d = 0; d < D; d++) acc[d] = MADD(w, v[d], acc[d]);
            }
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
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 || num_seqs < 0)
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
