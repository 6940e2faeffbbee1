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
 * and packed contiguously when several row groups reuse it (or it is 16-bit), so it stays in L1 while MC rows of x
 * (in L2) stream past; a lone row group reads w where it lies (one pass over the weight, the decode case). Threads
 * take (row block, column chunk) items from a shared counter. Measured in benchmarks/results/cpu_linear.md.
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

#define MR 6          /* rows of a register tile */
#define NR 16         /* columns of a register tile (two vectors of 8) */
#define KC 256        /* K block: a packed panel is KC x NR floats, 16 KiB */
#define MC 96         /* rows of a row block (MC x KC of x, 96 KiB, stays in L2) */
#define CHUNK 64      /* columns of a work item */
#define MIN_WORK_PER_THREAD (1 << 18)   /* multiply-adds below which another thread costs more than it saves */

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
enum { OK = 0, ERR_THREAD = -3, ERR_SHAPE = -4 };

typedef struct {
    const float *x;        /* [M, K], rows ldx apart */
    int64_t ldx, M, K;
    const void *w;         /* [K, N] of w_dtype, rows ldw apart */
    int w_dtype;
    int64_t ldw, N;
    const float *bias;     /* [N] or NULL */
    float *out;            /* [M, N], rows ldo apart */
    int64_t ldo;
    int64_t col_chunks, num_items;
    int64_t next_item;     /* shared counter, taken atomically by the threads */
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

/* panel[k * NR + j] = w[k0 + k, j0 + j] as float32 for k < kc, j < nc (exact: every bf16 and f16 value is a
 * float32); columns nc..NR zero. */
static void pack_panel(float *panel, const Problem *p, int64_t k0, int kc, int64_t j0, int nc) {
    for (int k = 0; k < kc; k++) {
        float *dst = panel + (int64_t)k * NR;
        int64_t row = (k0 + k) * p->ldw + j0;
        if (p->w_dtype == DTYPE_F32) {
            memcpy(dst, (const float *)p->w + row, (size_t)nc * sizeof(float));
        } else if (p->w_dtype == DTYPE_BF16) {
            const uint16_t *s = (const uint16_t *)p->w + row;
            for (int j = 0; j < nc; j++) dst[j] = bf16_to_f32(s[j]);
        } else {
            const uint16_t *s = (const uint16_t *)p->w + row;
            for (int j = 0; j < nc; j++) dst[j] = f16_to_f32(s[j]);
        }
        for (int j = nc; j < NR; j++) dst[j] = 0.0f;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256i tail_mask(int n) {   /* lanes 0 .. n - 1 on (n may be <= 0 or >= 8) */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* c[i, j] for i < mr, j < nc (nc <= NR): continued (or begun, `first`) over kc values of K, from x (rows ldx apart)
 * and w (rows ldw apart, NR columns readable when nc == NR, else nc), each element by one fused multiply-add per k
 * in order; `bias` (NULL, or where the reduction ends) added last. `mr` and `full` are constants where it is
 * inlined, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const int mr, const int full, int nc, int kc,
                                                       const float *x, int64_t ldx, const float *w, int64_t ldw,
                                                       float *c, int64_t ldc, int first, const float *bias) {
    __m256 acc[MR][2];
    const __m256i m0 = tail_mask(nc), m1 = tail_mask(nc - 8);
    for (int i = 0; i < mr; i++) {
        if (first) {
            acc[i][0] = _mm256_setzero_ps();
            acc[i][1] = _mm256_setzero_ps();
        } else if (full) {
            acc[i][0] = _mm256_loadu_ps(c + i * ldc);
            acc[i][1] = _mm256_loadu_ps(c + i * ldc + 8);
        } else {
            acc[i][0] = _mm256_maskload_ps(c + i * ldc, m0);
            acc[i][1] = _mm256_maskload_ps(c + i * ldc + 8, m1);
        }
    }
    for (int k = 0; k < kc; k++) {
        const float *wk = w + (int64_t)k * ldw;
        __m256 w0, w1;
        if (full) {
            w0 = _mm256_loadu_ps(wk);
            w1 = _mm256_loadu_ps(wk + 8);
        } else {
            w0 = _mm256_maskload_ps(wk, m0);
            w1 = _mm256_maskload_ps(wk + 8, m1);
        }
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(b, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, w1, acc[i][1]);
        }
    }
    __m256 b0 = _mm256_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = full ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, m0);
        b1 = full ? _mm256_loadu_ps(bias + 8) : _mm256_maskload_ps(bias + 8, m1);
    }
    for (int i = 0; i < mr; i++) {
        if (bias) {
            acc[i][0] = _mm256_add_ps(acc[i][0], b0);
            acc[i][1] = _mm256_add_ps(acc[i][1], b1);
        }
        if (full) {
            _mm256_storeu_ps(c + i * ldc, acc[i][0]);
            _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
        } else {
            _mm256_maskstore_ps(c + i * ldc, m0, acc[i][0]);
            _mm256_maskstore_ps(c + i * ldc + 8, m1, acc[i][1]);
        }
    }
}

#define TILE_CASE(n) \
    case n: if (nc == NR) tile(n, 1, NR, kc, x, ldx, w, ldw, c, ldc, first, bias); \
            else tile(n, 0, nc, kc, x, ldx, w, ldw, c, ldc, first, bias); break;

static void run_tile(int mr, int nc, int kc, const float *x, int64_t ldx, const float *w, int64_t ldw, float *c,
                     int64_t ldc, int first, const float *bias) {
    switch (mr) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) }
}
#else
/* Portable version: the same operations on every element. */
static void run_tile(int mr, int nc, int kc, const float *x, int64_t ldx, const float *w, int64_t ldw, float *c,
                     int64_t ldc, int first, const float *bias) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) {
            float acc = first ? 0.0f : c[i * ldc + j];
            for (int k = 0; k < kc; k++) acc = MADD(x[i * ldx + k], w[(int64_t)k * ldw + j], acc);
            c[i * ldc + j] = bias ? acc + bias[j] : acc;
        }
}
#endif

/* Work item: rows [i0, i0 + MC) x columns [j0, j0 + CHUNK), clipped. */
static void run_item(const Problem *p, float *panel, int64_t item) {
    const int64_t i0 = item / p->col_chunks * MC, j0 = item % p->col_chunks * CHUNK;
    const int64_t i1 = i0 + MC < p->M ? i0 + MC : p->M, j1 = j0 + CHUNK < p->N ? j0 + CHUNK : p->N;
    /* a panel is packed where it is 16-bit, or where more than one row group reads it */
    const int pack = p->w_dtype != DTYPE_F32 || i1 - i0 > MR;
    for (int64_t j = j0; j < j1; j += NR) {
        const int nc = (int)(j1 - j < NR ? j1 - j : NR);
        for (int64_t k0 = 0; k0 < p->K; k0 += KC) {
            const int kc = (int)(p->K - k0 < KC ? p->K - k0 : KC);
            const float *w;
            int64_t ldw;
            if (pack) {
                pack_panel(panel, p, k0, kc, j, nc);
                w = panel;
                ldw = NR;
            } else {
                w = (const float *)p->w + k0 * p->ldw + j;
                ldw = p->ldw;
            }
            const float *bias = p->bias && k0 + kc == p->K ? p->bias + j : NULL;
            for (int64_t i = i0; i < i1; i += MR) {
                const int mr = (int)(i1 - i < MR ? i1 - i : MR);
                run_tile(mr, nc, kc, p->x + i * p->ldx + k0, p->ldx, w, ldw, p->out + i * p->ldo + j, p->ldo,
                         k0 == 0, bias);
            }
        }
    }
}

static void *worker(void *arg) {
    Problem *p = (Problem *)arg;
    float panel[KC * NR] __attribute__((aligned(64)));
    for (;;) {
        int64_t item = __atomic_fetch_add(&p->next_item, 1, __ATOMIC_RELAXED);
        if (item >= p->num_items) break;
        run_item(p, panel, item);
    }
    return NULL;
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
    const int64_t col_chunks = (N + CHUNK - 1) / CHUNK, items = (M + MC - 1) / MC * col_chunks;
    Problem p = {x, ldx, M, K, w, w_dtype, ldw, N, bias, out, ldo, col_chunks, items, 0};
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    const int64_t work = M * N * K / MIN_WORK_PER_THREAD;
    if (threads > work) threads = work < 1 ? 1 : work;
    if (threads > items) threads = items;
    if (threads <= 1) {
        worker(&p);
        return OK;
    }
    pthread_t ids[threads - 1];
    int64_t started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &p) != 0) break;
    worker(&p);   /* the calling thread works too; if a thread could not start, the others take its share */
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    return OK;
}
