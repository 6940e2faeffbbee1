/* The 16-bit float formats the compiled CPU kernels read and write, converted to and from float32 the way torch
 * does, and the dtype codes their Python wrappers pass (kernels/cpu_*.py). Included by every kernels/cpu_*.c
 * (kernels/cpu_build.py keys each build by this header too). */
#ifndef KVSTRATA_CPU_DTYPES_H
#define KVSTRATA_CPU_DTYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

static inline float bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

/* Exact: every bfloat16 and float16 value is a float32. */
static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));            /* inf, nan */
    if (exp != 0) return bits_to_f32(sign | ((exp + 112) << 23) | (mant << 13));         /* normal */
    return sign ? -(float)mant * 0x1p-24f : (float)mant * 0x1p-24f;                      /* zero, subnormal: exact */
}

/* Round to nearest even; any NaN becomes 0x7fc0 (torch's c10::BFloat16 does the same). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits = f32_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Round to nearest even, overflow to inf, NaN to 0x7e00 with its sign (as c10::Half). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t bits = f32_to_bits(f), sign = (bits >> 16) & 0x8000u, mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* >= 65520: halfway past 65504 and up */
    if (mag >= 0x38800000u) {                                             /* a normal half, >= 2^-14 */
        mag += 0xfffu + ((mag >> 13) & 1u);
        return (uint16_t)(sign | ((mag - 0x38000000u) >> 13));            /* rebias 127 -> 15 */
    }
    /* a subnormal half (or zero): the count of 2^-24 steps, rounded to nearest even by rintf */
    return (uint16_t)(sign | (uint32_t)rintf(bits_to_f32(mag) * 0x1p24f));
}

/* `n` values of `dtype` at `src` as float32 into `dst` (exact: every bfloat16 and float16 value is a float32). */
static inline void row_to_float(float *dst, const void *src, int dtype, int64_t n) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
}

/* `n` float32 values at `src` rounded to the 16-bit `dtype` into `dst`, as torch rounds. */
static inline void row_from_float(void *dst, const float *src, int dtype, int64_t n) {
    uint16_t *d = (uint16_t *)dst;
    if (dtype == DTYPE_BF16)
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    else
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
}

#endif
