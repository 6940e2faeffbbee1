/* The per-row parts of a decoder layer on a CPU: residual-add-and-RMSNorm, rotary embedding, SiLU-and-multiply and
 * the K/V store into the paged cache (kernels/cpu_layer_ops.py builds and calls this; kernels/layer_ops.py and
 * kernels/kv_store.py hold the torch references, whose operations and roundings these follow one for one).
 *
 * Each row is computed by one thread, from its own values, in an order fixed by the row's width alone: its bits do
 * not depend on the other rows of the call, on the number of threads, or on the build. Built with
 * -ffp-contract=off and written without fused multiply-adds, so the AVX2 build (8-wide loops for float32 and
 * bfloat16 rows; float16 rows, and every row's last width % 8 values, take the scalar loops) and the portable one
 * (scalar loops only) do the same IEEE operations on every element and give the same bits.
 *
 * Arithmetic is in float32; values of a bfloat16 or float16 tensor are rounded back to it (round to nearest even,
 * as torch rounds) exactly where torch's op on that dtype rounds:
 * - RMSNorm: the add in the dtype; the squares summed in float32 by LANES partial sums (value i goes to sum
 *   i % LANES) added by one fixed tree, divided by the width; 1 / sqrt(variance + eps); the row times it, rounded
 *   to the dtype, then times the weight, rounded.
 * - rotary: each product rounded to the dtype, then their sum (or difference), rounded: torch's bits exactly.
 * - SiLU: g / (1 + exp(-g)) with this file's exp (`silu_f32`), rounded to the dtype, times up, rounded.
 * - store: a copy where the cache has the values' dtype; else each value (clamped to `bound` and rounded back to
 *   its own dtype, where the cache is narrower) rounded to the cache's dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"
#include "cpu_threads.h"

#define LANES 8
#define MIN_VALUES_PER_THREAD 32768  /* fewer than this per thread: waking a thread costs more than it saves */

enum { OK = 0, ERR_SHAPE = -4 };

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------------ conversions */

INLINE float load_value(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float *)base)[i];
    if (dtype == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return f16_to_f32(((const uint16_t *)base)[i]);
}

INLINE void store_value(void *base, int64_t i, int dtype, float v) {
    if (dtype == DTYPE_F32) ((float *)base)[i] = v;
    else if (dtype == DTYPE_BF16) ((uint16_t *)base)[i] = f32_to_bf16(v);
    else ((uint16_t *)base)[i] = f32_to_f16(v);
}

/* v rounded to `dtype` (where torch's op on that dtype rounds), as a float32 again. */
INLINE float round_to(float v, int dtype) {
    if (dtype == DTYPE_F32) return v;
    if (dtype == DTYPE_BF16) return bf16_to_f32(f32_to_bf16(v));
    return f16_to_f32(f32_to_f16(v));
}

static size_t dtype_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

#if defined(__AVX2__)
#include <immintrin.h>
#define VECTOR 1

/* Eight values of a float32 or bfloat16 row, and back; the same roundings as `load_value` / `store_value` /
 * `round_to` (float16 rows take the scalar loops). */
INLINE __m256 load8(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return _mm256_loadu_ps((const float *)base + i);
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* bfloat16 bits (in the low half of each 32-bit lane) of v, rounded to nearest even, NaN as 0x7fc0. */
INLINE __m256i bf16_bits8(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

INLINE void store8(void *base, int64_t i, int dtype, __m256 v) {
    if (dtype == DTYPE_F32) {
        _mm256_storeu_ps((float *)base + i, v);
        return;
    }
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(v), _mm256_setzero_si256()), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)base + i), _mm256_castsi256_si128(packed));
}

INLINE __m256 round8(__m256 v, int dtype) {
    if (dtype == DTYPE_F32) return v;
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
#endif

/* ---------------------------------------------------------------------------------------------------- threads */

/* A call's rows [0, rows) split into contiguous runs, one per thread; `run(problem, first, end)` computes a run. */
typedef void (*RowRun)(const void *problem, int64_t first, int64_t end);

typedef struct {
    RowRun run;
    const void *problem;
    int64_t rows;
} RowCall;

static int run_share(void *arg, int index, int count) {
    const RowCall *call = (const RowCall *)arg;
    call->run(call->problem, call->rows * index / count, call->rows * (index + 1) / count);
    return OK;
}

/* Runs every row, on up to `num_threads` threads where the call is big enough to repay them. Which thread computes a
 * row changes nothing in it. */
static int run_rows(RowRun run, const void *problem, int64_t rows, int64_t values_per_row, int num_threads) {
    int64_t by_size = rows * values_per_row / MIN_VALUES_PER_THREAD;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > by_size) threads = by_size < 1 ? 1 : (int)by_size;
    if (threads > rows) threads = rows < 1 ? 1 : (int)rows;
    if (rows == 0) return OK;
    RowCall call = {run, problem, rows};
    return run_parallel(run_share, &call, threads);
}

/* ---------------------------------------------------------------------------------------------------- RMSNorm */

typedef struct {
    const void *x, *residual, *weight;
    void *out, *summed;
    int dtype;
    int64_t heads, n, x_stride_token, x_stride_head, r_stride_token;
    float eps;
} NormProblem;

/* The number of leading values of a row the vector loops take (a multiple of LANES; float16 rows: none). The
 * scalar loops then do the rest, the same operations on each value. */
INLINE int64_t vector_part(int64_t n, int dtype) {
#ifdef VECTOR
    if (dtype != DTYPE_F16) return n / LANES * LANES;
#endif
    (void)n, (void)dtype;
    return 0;
}

/* The sum of the squares of `n` values, by LANES partial sums (value i into sum i % LANES) added by a fixed tree. */
INLINE float sum_squares(const void *row, int64_t n, int dtype) {
    float acc[LANES] = {0};
    int64_t i = vector_part(n, dtype);
#ifdef VECTOR
    if (i) {
        __m256 sums = _mm256_setzero_ps();
        for (int64_t j = 0; j < i; j += LANES) {
            __m256 v = load8(row, j, dtype);
            sums = _mm256_add_ps(sums, _mm256_mul_ps(v, v));
        }
        _mm256_storeu_ps(acc, sums);
    }
#endif
    for (; i < n; i++) {
        float v = load_value(row, i, dtype);
        acc[i % LANES] += v * v;
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

INLINE void norm_rows(const NormProblem *p, int64_t first, int64_t end, const int dtype) {
    const int64_t n = p->n;
    const size_t size = dtype_size(dtype);
    for (int64_t r = first; r < end; r++) {
        const char *x = (const char *)p->x
                        + ((r / p->heads) * p->x_stride_token + (r % p->heads) * p->x_stride_head) * size;
        const void *row = x;
        if (p->residual) {   /* x is [T, n]: the sum residual + x, rounded to the dtype, is the row to normalise */
            const char *res = (const char *)p->residual + r * p->r_stride_token * size;
            char *summed = (char *)p->summed + r * n * size;
            int64_t i = 0;
#ifdef VECTOR
            for (const int64_t vectored = vector_part(n, dtype); i < vectored; i += LANES)
                store8(summed, i, dtype, _mm256_add_ps(load8(res, i, dtype), load8(x, i, dtype)));
#endif
            for (; i < n; i++)
                store_value(summed, i, dtype, load_value(res, i, dtype) + load_value(x, i, dtype));
            row = summed;
        }
        float variance = sum_squares(row, n, dtype) / (float)n;
        float inv = 1.0f / sqrtf(variance + p->eps);
        char *out = (char *)p->out + r * n * size;
        int64_t i = 0;
#ifdef VECTOR
        __m256 inv8 = _mm256_set1_ps(inv);
        for (const int64_t vectored = vector_part(n, dtype); i < vectored; i += LANES) {
            __m256 normalised = round8(_mm256_mul_ps(load8(row, i, dtype), inv8), dtype);
            store8(out, i, dtype, _mm256_mul_ps(load8(p->weight, i, dtype), normalised));
        }
#endif
        for (; i < n; i++) {
            float normalised = round_to(load_value(row, i, dtype) * inv, dtype);
            store_value(out, i, dtype, load_value(p->weight, i, dtype) * normalised);
        }
    }
}

static void norm_run(const void *problem, int64_t first, int64_t end) {
    const NormProblem *p = (const NormProblem *)problem;
    switch (p->dtype) {   /* one specialised copy of the loops per dtype */
    case DTYPE_F32: norm_rows(p, first, end, DTYPE_F32); break;
    case DTYPE_BF16: norm_rows(p, first, end, DTYPE_BF16); break;
    default: norm_rows(p, first, end, DTYPE_F16); break;
    }
}

/* x: rows = tokens * heads rows of n values (row r is token r / heads, head r % heads; strides in elements, the
 * last axis contiguous); residual: NULL, or [tokens, n] (heads 1) whose sum with x goes to `summed` [tokens, n];
 * out [rows, n] contiguous; weight [n]. */
int kvs_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *summed, int dtype,
                 int64_t rows, int64_t heads, int64_t n, int64_t x_stride_token, int64_t x_stride_head,
                 int64_t r_stride_token, float eps, int num_threads) {
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16 || heads < 1 || n < 1 || rows < 0 || (residual && heads != 1))
        return ERR_SHAPE;
    NormProblem p = {x, residual, weight, out, summed, dtype, heads, n, x_stride_token, x_stride_head,
                     r_stride_token, eps};
    return run_rows(norm_run, &p, rows, n, num_threads);
}

/* ----------------------------------------------------------------------------------------------------- rotary */

typedef struct {
    const void *x, *cos, *sin;
    void *out;
    int dtype;
    int64_t heads, head_dim, x_stride_token, x_stride_head, cos_stride, sin_stride;
} RotaryProblem;

INLINE void rotary_rows(const RotaryProblem *p, int64_t first, int64_t end, const int dtype) {
    const int64_t half = p->head_dim / 2;
    const size_t size = dtype_size(dtype);
    for (int64_t r = first; r < end; r++) {   /* row r: token r / heads, head r % heads */
        int64_t t = r / p->heads;
        const char *x = (const char *)p->x + (t * p->x_stride_token + (r % p->heads) * p->x_stride_head) * size;
        const char *c = (const char *)p->cos + t * p->cos_stride * size;
        const char *s = (const char *)p->sin + t * p->sin_stride * size;
        char *out = (char *)p->out + r * p->head_dim * size;
        int64_t d = 0;
#ifdef VECTOR
        for (const int64_t vectored = vector_part(half, dtype); d < vectored; d += LANES) {
            __m256 x1 = load8(x, d, dtype), x2 = load8(x, d + half, dtype);
            __m256 first_half = _mm256_sub_ps(round8(_mm256_mul_ps(x1, load8(c, d, dtype)), dtype),
                                              round8(_mm256_mul_ps(x2, load8(s, d, dtype)), dtype));
            __m256 second_half = _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c, d + half, dtype)), dtype),
                                               round8(_mm256_mul_ps(x1, load8(s, d + half, dtype)), dtype));
            store8(out, d, dtype, first_half);
            store8(out, d + half, dtype, second_half);
        }
#endif
        for (; d < half; d++) {
            float x1 = load_value(x, d, dtype), x2 = load_value(x, d + half, dtype);
            float first_half = round_to(x1 * load_value(c, d, dtype), dtype)
                               - round_to(x2 * load_value(s, d, dtype), dtype);
            float second_half = round_to(x2 * load_value(c, d + half, dtype), dtype)
                                + round_to(x1 * load_value(s, d + half, dtype), dtype);
            store_value(out, d, dtype, first_half);
            store_value(out, d + half, dtype, second_half);
        }
    }
}

static void rotary_run(const void *problem, int64_t first, int64_t end) {
    const RotaryProblem *p = (const RotaryProblem *)problem;
    switch (p->dtype) {
    case DTYPE_F32: rotary_rows(p, first, end, DTYPE_F32); break;
    case DTYPE_BF16: rotary_rows(p, first, end, DTYPE_BF16); break;
    default: rotary_rows(p, first, end, DTYPE_F16); break;
    }
}

/* x [tokens, heads, head_dim] (strides in elements, last axis contiguous); cos, sin [tokens, head_dim] (rows
 * `*_stride` apart); out [tokens, heads, head_dim] contiguous. */
int kvs_rotary(const void *x, const void *cos, const void *sin, void *out, int dtype, int64_t tokens, int64_t heads,
               int64_t head_dim, int64_t x_stride_token, int64_t x_stride_head, int64_t cos_stride,
               int64_t sin_stride, int num_threads) {
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16 || heads < 1 || head_dim < 2 || head_dim % 2 || tokens < 0)
        return ERR_SHAPE;
    RotaryProblem p = {x, cos, sin, out, dtype, heads, head_dim, x_stride_token, x_stride_head, cos_stride,
                       sin_stride};
    return run_rows(rotary_run, &p, tokens * heads, head_dim, num_threads);
}

/* ----------------------------------------------------------------------------------------------- SiLU-and-mul */

/* SiLU, g / (1 + exp(-g)), with exp(v) of its own: v clamped to [-86, ln(FLT_MAX)] (1 + e^-86 rounds to 1, so a
 * larger g gives g, as torch's does), v = k ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact enough),
 * e^r by its Taylor polynomial to degree 7 (truncation ~1e-8 relative) in Horner form, times 2^k built from exponent
 * bits. Where exp(-g) overflows (g below -ln(FLT_MAX)) torch's g / inf is -0 (NaN for -inf): so is g * 0 here. A NaN
 * g gives NaN. Mul and add apart, never fused; the scalar and vector versions do the same operations on each value:
 * the same bits in every build. Within 4 ulp of torch's (its exp is SLEEF's): tests/test_kernels_cpu_layer_ops.py. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187045e-06f
#define EXP_LOW (-86.0f)
#define EXP_HIGH 88.72283935546875f

INLINE float silu_f32(float g) {
    float v = -g;
    v = v > EXP_LOW ? v : EXP_LOW;                       /* a NaN becomes EXP_LOW: g / (...) is NaN anyway */
    v = v < EXP_HIGH ? v : EXP_HIGH;
    float k = rintf(v * EXP_LOG2E);                      /* -124 ..= 128 */
    float r = v - k * EXP_LN2_HI;
    r = r - k * EXP_LN2_LO;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    float half_scale = bits_to_f32((uint32_t)((int32_t)k + 126) << 23);   /* 2^(k-1): a normal float for k = 128 */
    float e = (p * half_scale) * 2.0f;
    return g < -EXP_HIGH ? g * 0.0f : g / (1.0f + e);
}

#ifdef VECTOR
INLINE __m256 silu8(__m256 g) {
    __m256 v = _mm256_max_ps(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(EXP_LOW));
    v = _mm256_min_ps(v, _mm256_set1_ps(EXP_HIGH));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(k, _mm256_set1_ps(EXP_LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(EXP_LN2_LO)));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    __m256i ki = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(126));
    __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(ki, 23))), _mm256_set1_ps(2.0f));
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    __m256 overflow = _mm256_cmp_ps(g, _mm256_set1_ps(-EXP_HIGH), _CMP_LT_OQ);
    return _mm256_blendv_ps(silu, _mm256_mul_ps(g, _mm256_setzero_ps()), overflow);
}
#endif

typedef struct {
    const void *x;
    void *out;
    int dtype;
    int64_t n, x_stride_token;
} SiluProblem;

INLINE void silu_rows(const SiluProblem *p, int64_t first, int64_t end, const int dtype) {
    const int64_t n = p->n;
    const size_t size = dtype_size(dtype);
    for (int64_t t = first; t < end; t++) {
        const char *gate = (const char *)p->x + t * p->x_stride_token * size, *up = gate + n * size;
        char *out = (char *)p->out + t * n * size;
        int64_t i = 0;
#ifdef VECTOR
        for (const int64_t vectored = vector_part(n, dtype); i < vectored; i += LANES)
            store8(out, i, dtype, _mm256_mul_ps(round8(silu8(load8(gate, i, dtype)), dtype), load8(up, i, dtype)));
#endif
        for (; i < n; i++) {
            float silu = round_to(silu_f32(load_value(gate, i, dtype)), dtype);
            store_value(out, i, dtype, silu * load_value(up, i, dtype));
        }
    }
}

static void silu_run(const void *problem, int64_t first, int64_t end) {
    const SiluProblem *p = (const SiluProblem *)problem;
    switch (p->dtype) {
    case DTYPE_F32: silu_rows(p, first, end, DTYPE_F32); break;
    case DTYPE_BF16: silu_rows(p, first, end, DTYPE_BF16); break;
    default: silu_rows(p, first, end, DTYPE_F16); break;
    }
}

/* x [tokens, 2n]: gate then up, rows x_stride_token apart; out [tokens, n] contiguous. */
int kvs_silu_and_mul(const void *x, void *out, int dtype, int64_t tokens, int64_t n, int64_t x_stride_token,
                     int num_threads) {
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16 || n < 1 || tokens < 0) return ERR_SHAPE;
    SiluProblem p = {x, out, dtype, n, x_stride_token};
    return run_rows(silu_run, &p, tokens, 2 * n, num_threads);
}

/* --------------------------------------------------------------------------------------------------- K/V store */

/* The first token whose slot is neither padding (negative) nor one of the cache's `num_slots`, plus one; 0 when
 * every slot is good. */
int64_t kvs_check_slots(const void *slots, int slots_int32, int64_t tokens, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots_int32 ? ((const int32_t *)slots)[t] : ((const int64_t *)slots)[t];
        if (slot >= num_slots) return t + 1;
    }
    return 0;
}

/* One head's row of `head_dim` values into the cache's row: a copy, or converted (clamped first where bound > 0). */
static void store_row(char *dst, int cache_dtype, const char *src, int dtype, int64_t head_dim, float bound) {
    if (cache_dtype == dtype) {
        memcpy(dst, src, (size_t)head_dim * dtype_size(dtype));
        return;
    }
    for (int64_t i = 0; i < head_dim; i++) {
        float v = load_value(src, i, dtype);
        if (bound > 0.0f) v = round_to(v < -bound ? -bound : v > bound ? bound : v, dtype);  /* NaN stays NaN */
        store_value(dst, i, cache_dtype, v);
    }
}

/* key, value [tokens, kv_heads, head_dim] of `dtype` (strides in elements, last axis contiguous) into
 * cache[slot / block_size, layer, 0 or 1, slot % block_size] (strides: block, layer, part, slot, head). Every slot
 * is checked first: on a bad one nothing is written and the return is that token + 1; else 0. */
int64_t kvs_store_kv(const void *key, const void *value, int dtype, int64_t k_stride_token, int64_t k_stride_head,
                     int64_t v_stride_token, int64_t v_stride_head, void *cache, int cache_dtype,
                     const int64_t *cache_strides, int64_t num_blocks, int64_t layer, int64_t block_size,
                     const void *slots, int slots_int32, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                     float bound) {
    int64_t bad = kvs_check_slots(slots, slots_int32, tokens, num_blocks * block_size);
    if (bad) return bad;
    size_t size = dtype_size(dtype), cache_size = dtype_size(cache_dtype);
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots_int32 ? ((const int32_t *)slots)[t] : ((const int64_t *)slots)[t];
        if (slot < 0) continue;   /* padding */
        char *row = (char *)cache + ((slot / block_size) * cache_strides[0] + layer * cache_strides[1]
                                     + (slot % block_size) * cache_strides[3]) * cache_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            char *dst = row + h * cache_strides[4] * cache_size;
            store_row(dst, cache_dtype, (const char *)key + (t * k_stride_token + h * k_stride_head) * size, dtype,
                      head_dim, bound);
            store_row(dst + cache_strides[2] * cache_size, cache_dtype,
                      (const char *)value + (t * v_stride_token + h * v_stride_head) * size, dtype, head_dim, bound);
        }
    }
    return 0;
}
