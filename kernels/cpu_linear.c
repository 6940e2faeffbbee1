/* A linear layer's product on a CPU, out[M, N] = x[M, K] @ w[K, N] (+ bias), with the weight stored [in, out] row
 * by row as the CPU decoder keeps it (kernels/cpu_linear.py builds and calls this).
 *
 * Batch-invariant by construction: each output element is computed wholly by one thread as one reduction over K in
 * order, acc = fma(x[i, k], w[k, j], acc) for k = 0, 1, ..., K - 1 from acc = 0, then the bias added. K is walked in
 * blocks of KC, and between two blocks the accumulator is stored to `out` (float32) and reloaded, which is exact:
 * the order never changes and K is never split into partial sums. Which tile, lane, thread or row group computes an
 * element changes nothing of its operations, so a row's bits never depend on how many rows share the call, its
 * place in it, or the thread count.
 *
 * Determinism of the arithmetic: built with -ffp-contract=off, so the compiler fuses no multiply-add on its own;
 * fused ones are explicit (MADD, or the intrinsics). The AVX2 build and the portable one differ from each other
 * only where FMA is absent (a * b + c rounds twice), never from call to call.
 *
 * Speed (BLIS's blocking, simplified): a register tile of up to MR rows x NR columns (12 vector accumulators) is
 * fed by broadcasting x[i, k] and loading w[k, j:j + NR]; the KC x NR panel of w it walks is converted to float32
 * and packed contiguously when many row groups reuse it (or it is float16), so it is read from cache while the rows
 * of x stream past. A work item of many rows packs its columns of w once, each K block as its first MC rows reach
 * it, and its other row blocks find them packed: packing anew for every MC rows read the weight's strided rows from
 * memory again each time, which was most of what a prefill's products lost to a vendor BLAS. Up to direct_rows()
 * rows (a decode, a question after a cached document) read w where it lies instead, since packing a panel costs
 * more than so few rows gain from it: fewer than DIRECT_GROUP_ROWS rows take DIRECT_KC rows of it at a time across
 * their share of the columns, so the weight is one pass of a few long streams; more rows take it a DIRECT_MULTI_KC x
 * NR strip at a time, each row group (of up to MR) finding the strip in L1, so the accumulators are stored and
 * reloaded once a DIRECT_MULTI_KC, while the first group prefetches the next strip (prefetches change no
 * arithmetic). Threads take (rows, column chunk) items from a shared counter.
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

#define MR 6          /* rows of a register tile */
#define NR 16         /* columns of a register tile (two vectors of 8) */
#define KC 256        /* K block: a packed panel is KC x NR floats (16 KiB), read from L2 by every row group */
#define MC 96         /* rows of a row block: its MC x CHUNK outputs (96 KiB) stay in L2 across K blocks */
#define DIRECT_KC 8   /* K block of 1-3 rows reading the weights in place: 8 rows streamed at once, item-wide */
#define DIRECT_GROUP_ROWS 4   /* items of this many rows or more (up to direct_rows()) take the weights a strip at a time */
#define DIRECT_MULTI_KC 48   /* their K block (<= KC): a strip of w, 48 rows x 64 bytes, stays in L1 for all rows */
#define CHUNK 256     /* most columns of a packed work item: a K block of them packed (256 KiB) stays in L2 */
#define MIN_WORK_PER_THREAD (1 << 18)   /* multiply-adds below which another thread costs more than it saves */

enum { OK = 0, ERR_ALLOC = -2, ERR_SHAPE = -4 };

/* Items of up to this many rows read the weights in place, each row group rereading a strip from L1; larger ones
 * pack them. bfloat16 weights are widened by every row group that reads them in place (once when packed), so
 * packing pays from fewer rows; float16 ones are always packed (a tile reads only float32 and bfloat16 in place). */
static inline int64_t direct_rows(int w_dtype) {
    return w_dtype == DTYPE_F32 ? 64 : w_dtype == DTYPE_BF16 ? 32 : 0;
}

/* Weights a tile reading w in place prefetches while it runs, one line a k: row k of them at `at + k * ld` (bytes),
 * for k < rows (0: none). run_rows points it at the strip it takes next, which the hardware prefetchers do not
 * foresee. */
typedef struct {
    const char *at;
    int64_t ld;
    int rows;
} Ahead;
static const Ahead NO_AHEAD = {NULL, 0, 0};

typedef struct {
    const float *x;        /* [M, K], rows ldx apart */
    int64_t ldx, M, K;
    const void *w;         /* [K, N] of w_dtype, rows ldw apart */
    int w_dtype;
    int64_t ldw, N;
    const float *bias;     /* [N] or NULL */
    float *out;            /* [M, N], rows ldo apart */
    int64_t ldo;
    int64_t chunk, col_chunks, num_items;   /* columns per work item (a multiple of NR), their count, items */
    int64_t item_rows;     /* rows per work item */
    size_t packed_floats;  /* each thread's packing buffer */
    int64_t next_item;     /* shared counter, taken atomically by the threads */
} Problem;

/* The block w[k0 .. k0 + kc, j0 .. j0 + nc) as float32 panels of NR columns (exact: every bf16 and f16 value is a
 * float32): panel q holds columns j0 + q * NR .., at packed + q * KC * NR, row k at + k * NR; columns past nc are
 * zero. Each row of w is read along its nc columns, in order (contiguous reads, whatever the weight's width). */
static void pack_block(float *packed, const Problem *p, int64_t k0, int kc, int64_t j0, int nc) {
    const int panels = (nc + NR - 1) / NR;
    for (int k = 0; k < kc; k++) {
        const int64_t row = (k0 + k) * p->ldw + j0;
        for (int q = 0; q < panels; q++) {
            float *dst = packed + (int64_t)q * KC * NR + (int64_t)k * NR;
            const int n = nc - q * NR < NR ? nc - q * NR : NR;
            const int64_t src = row + q * NR;
            row_to_float(dst, (const char *)p->w + src * (p->w_dtype == DTYPE_F32 ? 4 : 2), p->w_dtype, n);
            for (int j = n; j < NR; j++) dst[j] = 0.0f;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256i tail_mask(int n) {   /* lanes 0 .. n - 1 on (n may be <= 0 or >= 8) */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Where a tile reads its weights: packed float32 panels (KC * NR apart, rows NR apart), or the weight itself,
 * float32 or bfloat16, rows ldw apart (every column of the tile there). */
enum { FROM_PACKED = 0, FROM_F32 = 1, FROM_BF16 = 2 };

static inline __attribute__((always_inline)) __m256 load_w(const int src, const void *w, int64_t ldw, int k, int v) {
    if (src == FROM_PACKED) return _mm256_load_ps((const float *)w + (v / 2) * KC * NR + k * NR + (v % 2) * 8);
    if (src == FROM_F32) return _mm256_loadu_ps((const float *)w + k * ldw + v * 8);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k * ldw + v * 8));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));   /* exact */
}

/* c[i, j] for i < mr, j < nc (np panels of NR columns, nc <= np * NR): continued (or begun, `first`) over kc values
 * of K, from x (rows ldx apart) and w (`src`), each element by one fused multiply-add per k in order; `bias`
 * (NULL, or where the reduction ends) added last. `mr`, `np` and `src` are constants where it is inlined, so the
 * 2 * mr * np <= 12 accumulators live in registers (the loops unrolled before the compiler places them). */
static inline __attribute__((always_inline)) void tile(const int mr, const int np, const int src, int nc, int kc,
                                                       const float *x, int64_t ldx, const void *w, int64_t ldw,
                                                       float *c, int64_t ldc, int first, const float *bias,
                                                       Ahead ahead) {
    __m256 acc[MR][12];
    const int full = nc == np * NR;   /* masked loads and stores only for the last columns: they are slow on some CPUs */
    _Pragma("GCC unroll 12")
    for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 12")
        for (int v = 0; v < 2 * np; v++)
            acc[i][v] = first ? _mm256_setzero_ps()
                      : full ? _mm256_loadu_ps(c + i * ldc + 8 * v)
                      : _mm256_maskload_ps(c + i * ldc + 8 * v, tail_mask(nc - 8 * v));
    for (int k = 0; k < kc; k++) {
        if (src != FROM_PACKED && k < ahead.rows)   /* packed tiles (many rows) never prefetch: not even a test */
            _mm_prefetch(ahead.at + k * ahead.ld, _MM_HINT_T0);
        __m256 wv[12];
        _Pragma("GCC unroll 12")
        for (int v = 0; v < 2 * np; v++) wv[v] = load_w(src, w, ldw, k, v);
        _Pragma("GCC unroll 12")
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(x + i * ldx + k);
            _Pragma("GCC unroll 12")
            for (int v = 0; v < 2 * np; v++) acc[i][v] = _mm256_fmadd_ps(b, wv[v], acc[i][v]);
        }
    }
    _Pragma("GCC unroll 12")
    for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 12")
        for (int v = 0; v < 2 * np; v++) {
            const __m256i mask = tail_mask(nc - 8 * v);   /* computed here: no register held over the loop */
            __m256 r = acc[i][v];
            if (bias) r = _mm256_add_ps(r, full ? _mm256_loadu_ps(bias + 8 * v) : _mm256_maskload_ps(bias + 8 * v, mask));
            if (full)
                _mm256_storeu_ps(c + i * ldc + 8 * v, r);
            else
                _mm256_maskstore_ps(c + i * ldc + 8 * v, mask, r);
        }
}

#define TILE(m, n) \
    case m * 8 + n: \
        if (src == FROM_PACKED) tile(m, n, FROM_PACKED, nc, kc, x, ldx, w, ldw, c, ldc, first, bias, ahead); \
        else if (src == FROM_F32) tile(m, n, FROM_F32, nc, kc, x, ldx, w, ldw, c, ldc, first, bias, ahead); \
        else tile(m, n, FROM_BF16, nc, kc, x, ldx, w, ldw, c, ldc, first, bias, ahead); \
        break;

/* Panels a tile of mr rows takes at once: 12 accumulators, or as near as the rows allow. */
static inline int panels_at_once(int mr) { return mr <= 6 ? 6 / mr : 1; }

static void run_tile(int mr, int np, int src, int nc, int kc, const float *x, int64_t ldx, const void *w,
                     int64_t ldw, float *c, int64_t ldc, int first, const float *bias, Ahead ahead) {
    switch (mr * 8 + np) {
        TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4) TILE(1, 5) TILE(1, 6)
        TILE(2, 1) TILE(2, 2) TILE(2, 3) TILE(3, 1) TILE(3, 2) TILE(4, 1) TILE(5, 1) TILE(6, 1)
    }
}
#else
enum { FROM_PACKED = 0, FROM_F32 = 1, FROM_BF16 = 2 };

static inline int panels_at_once(int mr) { (void)mr; return 1; }

/* Portable version: the same operations on every element. */
static void run_tile(int mr, int np, int src, int nc, int kc, const float *x, int64_t ldx, const void *w,
                     int64_t ldw, float *c, int64_t ldc, int first, const float *bias, Ahead ahead) {
    (void)np, (void)ahead;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) {
            float acc = first ? 0.0f : c[i * ldc + j];
            for (int k = 0; k < kc; k++) {
                float wkj = src == FROM_PACKED ? ((const float *)w)[(j / NR) * KC * NR + k * NR + j % NR]
                          : src == FROM_F32 ? ((const float *)w)[k * ldw + j]
                          : bf16_to_f32(((const uint16_t *)w)[k * ldw + j]);
                acc = MADD(x[i * ldx + k], wkj, acc);
            }
            c[i * ldc + j] = bias ? acc + bias[j] : acc;
        }
}
#endif

/* The strip run_rows takes after the one of K block k0 ending before panel q (of the item's `panels` from column
 * j0): panel q of the same block, else the first of the next block, else none. Its first cache line of each row is
 * what the first tile of the strip before it prefetches: a strip is one line a row (64 bytes of w) for the rows
 * run_rows takes, DIRECT_MULTI_KC rows ldw apart, a pattern the hardware prefetchers do not follow far enough: a
 * hit's products (the model's weights, from memory) ran 10 rows at ~22 GFLOP/s against ~30 with the weights in
 * cache, and 4 rows at ~12. */
static Ahead next_strip(const Problem *p, int64_t k0, int q, int64_t j0, int panels) {
    if (q >= panels) {
        k0 += DIRECT_MULTI_KC;
        q = 0;
    }
    if (k0 >= p->K) return NO_AHEAD;
    const size_t wsize = p->w_dtype == DTYPE_F32 ? 4 : 2;
    const int rows = (int)(p->K - k0 < DIRECT_MULTI_KC ? p->K - k0 : DIRECT_MULTI_KC);
    const Ahead next = {(const char *)p->w + (size_t)(k0 * p->ldw + j0 + (int64_t)q * NR) * wsize,
                        (int64_t)(p->ldw * wsize), rows};
    return next;
}

/* Group g's share of `ahead` (of `groups`): the groups' first tiles each prefetch their rows of the next strip, so
 * that the misses are spread over the whole strip's time rather than crowding the first group's (a core has few
 * misses in flight at once). */
static Ahead share(Ahead ahead, int g, int groups) {
    const int r0 = ahead.rows * g / groups, r1 = ahead.rows * (g + 1) / groups;
    const Ahead part = {ahead.at + r0 * ahead.ld, ahead.ld, r1 - r0};
    return part;
}

/* Rows [i0, i0 + rows) x columns [j0, j0 + width) of an item of DIRECT_GROUP_ROWS to direct_rows() rows, the weights
 * read where they lie: the rows split into near-equal groups of at most MR (10 rows: two of 5, each a 5 x 16 tile),
 * and each K block of DIRECT_MULTI_KC takes the columns a strip (whole cache lines) at a time, every group after the
 * first finding the strip in L1. The long K block makes the accumulators' stores and reloads rare (run_item's
 * DIRECT_KC stores and reloads them every 8 multiply-adds). A function of its own, not inlined: with this loop and
 * run_item's merged, a decode (one row) measured ~5% slower. */
static __attribute__((noinline)) void run_rows(const Problem *p, float *packed, int64_t i0, int rows, int64_t j0,
                                               int width) {
    const int panels = (width + NR - 1) / NR;
    const int groups = (rows + MR - 1) / MR, small = rows / groups, more = rows % groups;
    const int big = small + (more > 0), step = panels_at_once(big), block = DIRECT_MULTI_KC;
    const int src = p->w_dtype == DTYPE_F32 ? FROM_F32 : FROM_BF16;
    const size_t wsize = p->w_dtype == DTYPE_F32 ? 4 : 2;
    const int strip = step * (int)(64 / (NR * wsize));   /* panels of a strip: whole cache lines of w (bf16: 2) */
    const int tail = (panels - 1) / step * step;   /* the last tile's first panel; it is partial if width % NR */
    for (int64_t k0 = 0; k0 < p->K; k0 += block) {
        const int kc = (int)(p->K - k0 < block ? p->K - k0 : block);
        const int last = k0 + kc == p->K;
        for (int q0 = 0; q0 < panels; q0 += strip) {
            const int q1 = q0 + strip < panels ? q0 + strip : panels;
            const Ahead ahead = next_strip(p, k0, q0 + strip, j0, panels);
            if (q1 == panels && width % NR)   /* the last columns: packed zero-padded, never read past N */
                pack_block(packed, p, k0, kc, j0 + tail * NR, width - tail * NR);
            for (int g = 0, i = 0; g < groups; i += small + (g < more), g++) {   /* the first `more` take a row more */
                for (int q = q0; q < q1; q += step) {
                    const int np = panels - q < step ? panels - q : step;
                    const int nc = width - q * NR < np * NR ? width - q * NR : np * NR;
                    const int64_t j = j0 + q * NR;
                    const float *bias = last && p->bias ? p->bias + j : NULL, *x = p->x + (i0 + i) * p->ldx + k0;
                    float *c = p->out + (i0 + i) * p->ldo + j;
                    const Ahead fetch = q == q0 ? share(ahead, g, groups) : NO_AHEAD;
                    if (nc == np * NR)
                        run_tile(small + (g < more), np, src, nc, kc, x, p->ldx,
                                 (const char *)p->w + (size_t)(k0 * p->ldw + j) * wsize, p->ldw, c, p->ldo, k0 == 0,
                                 bias, fetch);
                    else
                        run_tile(small + (g < more), np, FROM_PACKED, nc, kc, x, p->ldx, packed, NR, c, p->ldo,
                                 k0 == 0, bias, fetch);
                }
            }
        }
    }
}

/* K block [k0, k0 + kc) of rows [i0, i1) x columns [j0, j0 + width): every row group of MR rows against np panels at
 * a time, reading w from `block` (the K block's columns packed by pack_block), or, where `block` is NULL, where it
 * lies (a tile's last columns, fewer than it takes, packed into `scratch` first, zero-padded: never read past N). */
static void run_block(const Problem *p, int64_t i0, int64_t i1, int64_t j0, int width, int64_t k0, int kc,
                      const float *block, float *scratch) {
    const int panels = (width + NR - 1) / NR, last = k0 + kc == p->K;
    const int src = p->w_dtype == DTYPE_F32 ? FROM_F32 : FROM_BF16;
    const size_t wsize = p->w_dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t i = i0; i < i1; i += MR) {
        const int mr = (int)(i1 - i < MR ? i1 - i : MR), step = panels_at_once(mr);
        for (int q = 0; q < panels; q += step) {
            const int np = panels - q < step ? panels - q : step;
            const int nc = width - q * NR < np * NR ? width - q * NR : np * NR;
            const int64_t j = j0 + q * NR;
            const float *x = p->x + i * p->ldx + k0, *bias = last && p->bias ? p->bias + j : NULL;
            float *c = p->out + i * p->ldo + j;
            if (block) {
                run_tile(mr, np, FROM_PACKED, nc, kc, x, p->ldx, block + (int64_t)q * KC * NR, NR, c, p->ldo, k0 == 0,
                         bias, NO_AHEAD);
            } else if (nc == np * NR) {
                const char *w = (const char *)p->w + (size_t)(k0 * p->ldw + j) * wsize;
                run_tile(mr, np, src, nc, kc, x, p->ldx, w, p->ldw, c, p->ldo, k0 == 0, bias, NO_AHEAD);
            } else {
                pack_block(scratch, p, k0, kc, j, nc);
                run_tile(mr, np, FROM_PACKED, nc, kc, x, p->ldx, scratch, NR, c, p->ldo, k0 == 0, bias, NO_AHEAD);
            }
        }
    }
}

/* Rows [i0, i1) x columns [j0, j0 + width) against w packed, MC rows at a time. The first row block packs each K
 * block of the columns into its own place in `packed` as it reaches it (fresh in cache for its use); the others find
 * them there. */
static void run_packed(const Problem *p, float *packed, int64_t i0, int64_t i1, int64_t j0, int width) {
    for (int64_t b0 = i0; b0 < i1; b0 += MC)
        for (int64_t k0 = 0; k0 < p->K; k0 += KC) {
            const int kc = (int)(p->K - k0 < KC ? p->K - k0 : KC);
            float *block = packed + k0 * p->chunk;   /* K block k0 / KC: KC x chunk floats */
            if (b0 == i0) pack_block(block, p, k0, kc, j0, width);
            run_block(p, b0, b0 + MC < i1 ? b0 + MC : i1, j0, width, k0, kc, block, NULL);
        }
}

/* Rows [i0, i1) (fewer than DIRECT_GROUP_ROWS: a decode) x columns [j0, j0 + width), the weights read where they
 * lie, DIRECT_KC rows of them at a time across the item's width. */
static void run_few_rows(const Problem *p, float *packed, int64_t i0, int64_t i1, int64_t j0, int width) {
    for (int64_t k0 = 0; k0 < p->K; k0 += DIRECT_KC)
        run_block(p, i0, i1, j0, width, k0, (int)(p->K - k0 < DIRECT_KC ? p->K - k0 : DIRECT_KC), NULL, packed);
}

/* Work item: rows [i0, i0 + item_rows) x columns [j0, j0 + chunk), clipped. Up to direct_rows() rows read the weights
 * where they lie (fewer than DIRECT_GROUP_ROWS: run_few_rows, more: run_rows); more rows pack them (run_packed). */
static void run_item(const Problem *p, float *packed, int64_t item) {
    const int64_t i0 = item / p->col_chunks * p->item_rows, j0 = item % p->col_chunks * p->chunk;
    const int64_t i1 = i0 + p->item_rows < p->M ? i0 + p->item_rows : p->M;
    const int width = (int)(j0 + p->chunk < p->N ? p->chunk : p->N - j0);
    if (i1 - i0 > direct_rows(p->w_dtype))
        run_packed(p, packed, i0, i1, j0, width);
    else if (i1 - i0 >= DIRECT_GROUP_ROWS)
        run_rows(p, packed, i0, (int)(i1 - i0), j0, width);
    else
        run_few_rows(p, packed, i0, i1, j0, width);
}

/* One thread's share of a call (run_parallel): items taken from the shared counter until none is left. */
static int worker(void *arg, int index, int count) {
    (void)index, (void)count;
    Problem *p = (Problem *)arg;
    float *packed = (float *)aligned_alloc(64, sizeof(float) * p->packed_floats);
    if (!packed) return ERR_ALLOC;
    for (;;) {
        int64_t item = __atomic_fetch_add(&p->next_item, 1, __ATOMIC_RELAXED);
        if (item >= p->num_items) break;
        run_item(p, packed, item);
    }
    free(packed);
    return OK;
}

/* Parts to split the rows of a packed call into (at most `most`): the fewest that make (parts x column chunks) a
 * multiple of the thread count, so that the threads get equal shares of equal items. */
static int64_t row_splits(int64_t col_chunks, int64_t threads, int64_t most) {
    int64_t a = col_chunks, b = threads;   /* their greatest common divisor */
    while (b) {
        const int64_t r = a % b;
        a = b;
        b = r;
    }
    return threads / a < most ? threads / a : most;
}

/* out = x @ w (+ bias), float32 out. Returns OK, or ERR_SHAPE for sizes the caller should have refused. */
int kvs_linear(const float *x, int64_t ldx, int64_t M, int64_t K, const void *w, int w_dtype, int64_t ldw,
               int64_t N, const float *bias, float *out, int64_t ldo, int num_threads) {
    if (M < 0 || K < 0 || N < 0 || ldx < K || ldw < N || ldo < N || w_dtype < DTYPE_F32 || w_dtype > DTYPE_F16)
        return ERR_SHAPE;
    if (M == 0 || N == 0) return OK;
    if (K == 0) {   /* an empty sum: zeros, plus the bias */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) out[i * ldo + j] = bias ? 0.0f + bias[j] : 0.0f;
        return OK;
    }
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    const int64_t work = M * N * K / MIN_WORK_PER_THREAD;
    if (threads > work) threads = work < 1 ? 1 : work;
    Problem p = {.x = x, .ldx = ldx, .M = M, .K = K, .w = w, .w_dtype = w_dtype, .ldw = ldw, .N = N, .bias = bias,
                 .out = out, .ldo = ldo, .item_rows = MC, .packed_floats = KC * CHUNK, .next_item = 0};
    if (M <= direct_rows(w_dtype)) {
        /* Rows few enough to read the weights in place: an item takes whole rows' share of the columns (N / threads),
         * so each K block is read row after row across the weight's width, streams the prefetchers follow, instead
         * of short pieces of many rows. */
        const int64_t tile = NR * 6;
        p.chunk = ((N + threads - 1) / threads + tile - 1) / tile * tile;
    } else {
        /* Packed: N split into near-equal chunks of at most CHUNK columns, and the rows into as few parts as give
         * every thread the same number of equal items (each part packs its chunk's columns once). */
        const int64_t pieces = (N + CHUNK - 1) / CHUNK, splits = row_splits(pieces, threads, (M + MR - 1) / MR);
        p.chunk = ((N + pieces - 1) / pieces + NR - 1) / NR * NR;
        p.item_rows = ((M + splits - 1) / splits + MR - 1) / MR * MR;
        p.packed_floats = (size_t)((K + KC - 1) / KC * KC * p.chunk);
    }
    p.col_chunks = (N + p.chunk - 1) / p.chunk;
    p.num_items = (M + p.item_rows - 1) / p.item_rows * p.col_chunks;
    if (threads > p.num_items) threads = p.num_items;
    return run_parallel(worker, &p, (int)threads);
}

/* ------------------------------------------------------------------------------- 16-bit x and out, in C */

/* A block of rows converted between float32 and a 16-bit dtype (exact one way, rounded to nearest even the other,
 * as torch rounds), split over threads by rows. */
typedef struct {
    const void *src;
    void *dst;
    int to_float;     /* 1: 16-bit src -> float32 dst; 0: float32 src -> 16-bit dst */
    int dtype;        /* the 16-bit side's */
    int64_t rows, cols, ld_src, ld_dst;
} Convert;

static int convert_share(void *arg, int index, int count) {
    const Convert *c = (const Convert *)arg;
    for (int64_t i = c->rows * index / count; i < c->rows * (index + 1) / count; i++) {
        if (c->to_float)
            row_to_float((float *)c->dst + i * c->ld_dst, (const uint16_t *)c->src + i * c->ld_src, c->dtype, c->cols);
        else
            row_from_float((uint16_t *)c->dst + i * c->ld_dst, (const float *)c->src + i * c->ld_src, c->dtype, c->cols);
    }
    return OK;
}

static int convert_rows(Convert c, int num_threads) {
    int64_t threads = num_threads < 1 ? 1 : num_threads, by_size = c.rows * c.cols / (1 << 15);
    if (threads > by_size) threads = by_size < 1 ? 1 : by_size;
    return run_parallel(convert_share, &c, (int)threads);
}

/* out = x @ w (+ bias) with x, w and out all bfloat16 or float16 (`dtype`): x's rows taken to float32, the product
 * as kvs_linear's, the result rounded to the dtype, all here. Done in Python, the two conversions were torch ops,
 * whose OpenMP threads spin for a while after each and took a core from the product's threads. */
int kvs_linear_16(const void *x, int64_t ldx, int64_t M, int64_t K, const void *w, int dtype, int64_t ldw, int64_t N,
                  const float *bias, void *out, int64_t ldo, int num_threads) {
    if (M < 0 || K < 0 || N < 0 || ldx < K || ldo < N || (dtype != DTYPE_BF16 && dtype != DTYPE_F16)) return ERR_SHAPE;
    if (M == 0 || N == 0) return OK;
    float *x32 = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    float *out32 = (float *)malloc(sizeof(float) * (size_t)(M * N));
    int status = x32 && out32 ? OK : ERR_ALLOC;
    if (status == OK) status = convert_rows((Convert){x, x32, 1, dtype, M, K, ldx, K}, num_threads);
    if (status == OK) status = kvs_linear(x32, K, M, K, w, dtype, ldw, N, bias, out32, N, num_threads);
    if (status == OK) status = convert_rows((Convert){out32, out, 0, dtype, M, N, N, ldo}, num_threads);
    free(x32);
    free(out32);
    return status;
}
