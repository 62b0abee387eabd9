/*
 * reduce.c - elementwise reductions of n sources: every dtype x every op.
 *
 * Determinism: sources are folded strictly in index order and every
 * element uses the same scalar formula whatever the ISA, so every rank that
 * runs the same call gets the same bits. Nothing is reassociated and no
 * FMA contraction can happen (the AVX2 variants do not enable FMA, and the
 * build uses -std=c11, which implies -ffp-contract=off).
 *
 * Speed: work proceeds in blocks of REDUCE_BLOCK elements. Each block is
 * folded into a local accumulator array and stored at the end, so dst may
 * be one of the sources while the inner loops still see non-aliasing
 * pointers and vectorize. Full blocks have a compile-time trip count,
 * which GCC's -O2 ("very cheap") vectorizer requires.
 *
 * ISA dispatch: every kernel is compiled twice, once for the baseline ISA
 * and once for AVX2 (+F16C for float16 conversions); the choice is made
 * once from cpuid. TCCOMM_REDUCE_ISA=generic forces the baseline kernels
 * (for tests and for debugging).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define REDUCE_HAVE_X86_VARIANTS 1
#else
#define REDUCE_HAVE_X86_VARIANTS 0
#endif

#define REDUCE_BLOCK 512
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define TARGET_GENERIC /* baseline ISA */

typedef void (*reduce_kernel_fn)(void *dst, const void *const *srcs, int nsrc, size_t count,
                                 tcc_redop_t op, double premul);

/* ---- float16 / bfloat16 <-> float32, portable -------------------------- */
/* These match the x86 F16C instructions bit for bit (NaNs included: quieted,
 * sign and top payload bits kept), so both kernel variants agree. */

ALWAYS_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

ALWAYS_INLINE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

ALWAYS_INLINE float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) /* Inf, or NaN made quiet */
    return bits_float(sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0));
  if (exponent == 0) {
    /* Zero or subnormal: mantissa * 2^-24 is exact and a normal float32. */
    float magnitude = (float)mantissa * 0x1p-24f;
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

/* Round to nearest, ties to even. */
ALWAYS_INLINE uint16_t f32_to_f16(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) /* NaN: keep the top payload bits, make it quiet */
    return (uint16_t)(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));
  if (magnitude >= 0x477FF000u) /* >= 65520: rounds past the largest half, 65504 */
    return (uint16_t)(sign | 0x7C00u);
  if (magnitude >= 0x38800000u) { /* >= 2^-14: a normal half */
    uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    /* A carry out of the mantissa correctly bumps the exponent. */
    return (uint16_t)(sign | ((rounded >> 13) - ((127u - 15u) << 10)));
  }
  if (magnitude < 0x33000000u) /* <= 2^-25 (ties to the even zero) */
    return (uint16_t)sign;
  /* Subnormal half: the value in units of 2^-24, rounded. */
  uint32_t exponent = magnitude >> 23;            /* 102 .. 112 */
  uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - exponent;               /* 14 .. 24 */
  uint32_t quotient = significand >> shift;
  uint32_t remainder = significand & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (remainder > half || (remainder == half && (quotient & 1u))) quotient++;
  return (uint16_t)(sign | quotient); /* 0x400 on carry: the smallest normal, correctly */
}

ALWAYS_INLINE float bf16_to_f32(uint16_t b) { return bits_float((uint32_t)b << 16); }

ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t x = float_bits(f);
  uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (x >> 16) | 0x0040u;
  return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

/* ---- block loaders / storers --------------------------------------------- */
/* A loader returns a pointer to n accumulation-type values of one source:
 * the source itself when no conversion is needed, else `scratch`. */

ALWAYS_INLINE const float *load_f32(float *restrict scratch, const float *restrict src,
                                    size_t n) {
  (void)scratch;
  (void)n;
  return src;
}

ALWAYS_INLINE void store_f32(float *restrict dst, const float *restrict acc, size_t n) {
  memcpy(dst, acc, n * sizeof *dst);
}

ALWAYS_INLINE const double *load_f64(double *restrict scratch, const double *restrict src,
                                     size_t n) {
  (void)scratch;
  (void)n;
  return src;
}

ALWAYS_INLINE void store_f64(double *restrict dst, const double *restrict acc, size_t n) {
  memcpy(dst, acc, n * sizeof *dst);
}

ALWAYS_INLINE const float *load_bf16(float *restrict scratch, const uint16_t *restrict src,
                                     size_t n) {
  for (size_t i = 0; i < n; i++) scratch[i] = bf16_to_f32(src[i]);
  return scratch;
}

ALWAYS_INLINE void store_bf16(uint16_t *restrict dst, const float *restrict acc, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = f32_to_bf16(acc[i]);
}

ALWAYS_INLINE const float *load_f16(float *restrict scratch, const uint16_t *restrict src,
                                    size_t n) {
  for (size_t i = 0; i < n; i++) scratch[i] = f16_to_f32(src[i]);
  return scratch;
}

ALWAYS_INLINE void store_f16(uint16_t *restrict dst, const float *restrict acc, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = f32_to_f16(acc[i]);
}

#if REDUCE_HAVE_X86_VARIANTS
/* F16C converts 8 halves per instruction; the portable code above handles
 * the tail and produces identical bits. */
TARGET_AVX2 ALWAYS_INLINE const float *load_f16_f16c(float *restrict scratch,
                                                     const uint16_t *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i halves = _mm_loadu_si128((const __m128i *)(src + i));
    _mm256_storeu_ps(scratch + i, _mm256_cvtph_ps(halves));
  }
  for (; i < n; i++) scratch[i] = f16_to_f32(src[i]);
  return scratch;
}

TARGET_AVX2 ALWAYS_INLINE void store_f16_f16c(uint16_t *restrict dst,
                                              const float *restrict acc, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(acc + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(dst + i), halves);
  }
  for (; i < n; i++) dst[i] = f32_to_f16(acc[i]);
}
#endif

/* ---- floating-point folds --------------------------------------------------- */
/* acc = first source (times premul); then acc = acc op x per further source;
 * then AVG divides. MIN/MAX propagate NaN like torch.amin/amax: a NaN
 * source replaces acc, and a NaN acc is never replaced by a number. */

#define DEFINE_FLOAT_FOLDS(ACC)                                                          \
  ALWAYS_INLINE void fold_first_##ACC(ACC *restrict acc, const ACC *restrict x, size_t n, \
                                      tcc_redop_t op, ACC premul) {                       \
    if (op == TCC_PREMUL_SUM) {                                                           \
      for (size_t i = 0; i < n; i++) acc[i] = x[i] * premul;                              \
    } else {                                                                              \
      for (size_t i = 0; i < n; i++) acc[i] = x[i];                                       \
    }                                                                                     \
  }                                                                                       \
  ALWAYS_INLINE void fold_next_##ACC(ACC *restrict acc, const ACC *restrict x, size_t n,  \
                                     tcc_redop_t op, ACC premul) {                        \
    switch (op) {                                                                         \
      case TCC_SUM:                                                                       \
      case TCC_AVG:                                                                       \
        for (size_t i = 0; i < n; i++) acc[i] = acc[i] + x[i];                            \
        break;                                                                            \
      case TCC_PREMUL_SUM:                                                                \
        for (size_t i = 0; i < n; i++) acc[i] = acc[i] + x[i] * premul;                   \
        break;                                                                            \
      case TCC_PRODUCT:                                                                   \
        for (size_t i = 0; i < n; i++) acc[i] = acc[i] * x[i];                            \
        break;                                                                            \
      case TCC_MIN:                                                                       \
        for (size_t i = 0; i < n; i++)                                                    \
          acc[i] = (x[i] < acc[i] || x[i] != x[i]) ? x[i] : acc[i];                       \
        break;                                                                            \
      case TCC_MAX:                                                                       \
        for (size_t i = 0; i < n; i++)                                                    \
          acc[i] = (x[i] > acc[i] || x[i] != x[i]) ? x[i] : acc[i];                       \
        break;                                                                            \
      default: break; /* not a float op: tcc_reduce_n filtered it out */                  \
    }                                                                                     \
  }                                                                                       \
  ALWAYS_INLINE void fold_finish_##ACC(ACC *restrict acc, size_t n, tcc_redop_t op,       \
                                       int nsrc) {                                        \
    if (op == TCC_AVG) {                                                                  \
      const ACC divisor = (ACC)nsrc;                                                      \
      for (size_t i = 0; i < n; i++) acc[i] = acc[i] / divisor;                           \
    }                                                                                     \
  }

DEFINE_FLOAT_FOLDS(float)
DEFINE_FLOAT_FOLDS(double)

/* One kernel per (element type, ISA): ELEM is the stored type, ACC the
 * accumulation type, LOAD/STORE convert a block between them. */
#define DEFINE_FLOAT_KERNEL(NAME, TARGET, ELEM, ACC, LOAD, STORE)                           \
  TARGET ALWAYS_INLINE void NAME##_block(ELEM *dst, const void *const *srcs, size_t base,   \
                                         int nsrc, size_t n, tcc_redop_t op, ACC premul) {  \
    ACC acc[REDUCE_BLOCK];                                                                  \
    ACC scratch[REDUCE_BLOCK];                                                              \
    fold_first_##ACC(acc, LOAD(scratch, (const ELEM *)srcs[0] + base, n), n, op, premul);   \
    for (int s = 1; s < nsrc; s++)                                                          \
      fold_next_##ACC(acc, LOAD(scratch, (const ELEM *)srcs[s] + base, n), n, op, premul);  \
    fold_finish_##ACC(acc, n, op, nsrc);                                                    \
    STORE(dst, acc, n);                                                                     \
  }                                                                                         \
  TARGET static void NAME(void *dst, const void *const *srcs, int nsrc, size_t count,       \
                          tcc_redop_t op, double premul) {                                  \
    const ACC premul_acc = (ACC)premul;                                                     \
    size_t base = 0;                                                                        \
    /* Constant trip count for full blocks, so the inner loops vectorize. */                \
    for (; base + REDUCE_BLOCK <= count; base += REDUCE_BLOCK)                              \
      NAME##_block((ELEM *)dst + base, srcs, base, nsrc, REDUCE_BLOCK, op, premul_acc);     \
    if (base < count)                                                                       \
      NAME##_block((ELEM *)dst + base, srcs, base, nsrc, count - base, op, premul_acc);     \
  }

/* ---- integer folds ------------------------------------------------------------ */
/* SUM and PRODUCT wrap (two's complement) by computing in an unsigned type
 * at least as wide as int, which has defined overflow and is not promoted
 * to signed int; converting back to T truncates (GCC defines this as
 * modular). AVG is C's truncating division of the wrapped sum. */

#define DEFINE_INT_KERNEL(NAME, TARGET, T, WIDE_UNSIGNED)                                     \
  TARGET ALWAYS_INLINE void NAME##_block(T *dst, const void *const *srcs, size_t base,        \
                                         int nsrc, size_t n, tcc_redop_t op) {                \
    T acc[REDUCE_BLOCK];                                                                      \
    memcpy(acc, (const T *)srcs[0] + base, n * sizeof(T));                                    \
    for (int s = 1; s < nsrc; s++) {                                                          \
      const T *restrict x = (const T *)srcs[s] + base;                                        \
      switch (op) {                                                                           \
        case TCC_SUM:                                                                         \
        case TCC_AVG:                                                                         \
          for (size_t i = 0; i < n; i++)                                                      \
            acc[i] = (T)((WIDE_UNSIGNED)acc[i] + (WIDE_UNSIGNED)x[i]);                        \
          break;                                                                              \
        case TCC_PRODUCT:                                                                     \
          for (size_t i = 0; i < n; i++)                                                      \
            acc[i] = (T)((WIDE_UNSIGNED)acc[i] * (WIDE_UNSIGNED)x[i]);                        \
          break;                                                                              \
        case TCC_MIN:                                                                         \
          for (size_t i = 0; i < n; i++) acc[i] = x[i] < acc[i] ? x[i] : acc[i];              \
          break;                                                                              \
        case TCC_MAX:                                                                         \
          for (size_t i = 0; i < n; i++) acc[i] = x[i] > acc[i] ? x[i] : acc[i];              \
          break;                                                                              \
        case TCC_BAND:                                                                        \
          for (size_t i = 0; i < n; i++) acc[i] = (T)(acc[i] & x[i]);                         \
          break;                                                                              \
        case TCC_BOR:                                                                         \
          for (size_t i = 0; i < n; i++) acc[i] = (T)(acc[i] | x[i]);                         \
          break;                                                                              \
        case TCC_BXOR:                                                                        \
          for (size_t i = 0; i < n; i++) acc[i] = (T)(acc[i] ^ x[i]);                         \
          break;                                                                              \
        default: break;                                                                       \
      }                                                                                       \
    }                                                                                         \
    if (op == TCC_AVG) {                                                                      \
      /* Division by nsrc >= 1 cannot overflow, even for the most negative T. */              \
      for (size_t i = 0; i < n; i++) acc[i] = (T)(acc[i] / nsrc);                             \
    }                                                                                         \
    memcpy(dst, acc, n * sizeof(T));                                                          \
  }                                                                                           \
  TARGET static void NAME(void *dst, const void *const *srcs, int nsrc, size_t count,         \
                          tcc_redop_t op, double premul) {                                    \
    (void)premul;                                                                             \
    size_t base = 0;                                                                          \
    for (; base + REDUCE_BLOCK <= count; base += REDUCE_BLOCK)                                \
      NAME##_block((T *)dst + base, srcs, base, nsrc, REDUCE_BLOCK, op);                      \
    if (base < count) NAME##_block((T *)dst + base, srcs, base, nsrc, count - base, op);      \
  }

/* bool: bytes are read as false (0) / true (anything else) and written as
 * 0/1. SUM and MAX are OR, PRODUCT and MIN are AND (torch's NCCL semantics). */
#define DEFINE_BOOL_KERNEL(NAME, TARGET)                                                      \
  TARGET ALWAYS_INLINE void NAME##_block(uint8_t *dst, const void *const *srcs, size_t base,  \
                                         int nsrc, size_t n, tcc_redop_t op) {                \
    uint8_t acc[REDUCE_BLOCK];                                                                \
    const uint8_t *restrict first = (const uint8_t *)srcs[0] + base;                          \
    for (size_t i = 0; i < n; i++) acc[i] = first[i] != 0;                                    \
    for (int s = 1; s < nsrc; s++) {                                                          \
      const uint8_t *restrict x = (const uint8_t *)srcs[s] + base;                            \
      switch (op) {                                                                           \
        case TCC_SUM:                                                                         \
        case TCC_MAX:                                                                         \
        case TCC_BOR:                                                                         \
          for (size_t i = 0; i < n; i++) acc[i] = acc[i] | (x[i] != 0);                       \
          break;                                                                              \
        case TCC_PRODUCT:                                                                     \
        case TCC_MIN:                                                                         \
        case TCC_BAND:                                                                        \
          for (size_t i = 0; i < n; i++) acc[i] = acc[i] & (x[i] != 0);                       \
          break;                                                                              \
        case TCC_BXOR:                                                                        \
          for (size_t i = 0; i < n; i++) acc[i] = acc[i] ^ (x[i] != 0);                       \
          break;                                                                              \
        default: break;                                                                       \
      }                                                                                       \
    }                                                                                         \
    memcpy(dst, acc, n);                                                                      \
  }                                                                                           \
  TARGET static void NAME(void *dst, const void *const *srcs, int nsrc, size_t count,         \
                          tcc_redop_t op, double premul) {                                    \
    (void)premul;                                                                             \
    size_t base = 0;                                                                          \
    for (; base + REDUCE_BLOCK <= count; base += REDUCE_BLOCK)                                \
      NAME##_block((uint8_t *)dst + base, srcs, base, nsrc, REDUCE_BLOCK, op);                \
    if (base < count) NAME##_block((uint8_t *)dst + base, srcs, base, nsrc, count - base, op);\
  }

/* ---- the kernels, per ISA ------------------------------------------------------- */

#define DEFINE_ALL_KERNELS(SUFFIX, TARGET, LOAD_F16, STORE_F16)                         \
  DEFINE_FLOAT_KERNEL(reduce_f32_##SUFFIX, TARGET, float, float, load_f32, store_f32)   \
  DEFINE_FLOAT_KERNEL(reduce_f64_##SUFFIX, TARGET, double, double, load_f64, store_f64) \
  DEFINE_FLOAT_KERNEL(reduce_f16_##SUFFIX, TARGET, uint16_t, float, LOAD_F16, STORE_F16) \
  DEFINE_FLOAT_KERNEL(reduce_bf16_##SUFFIX, TARGET, uint16_t, float, load_bf16,         \
                      store_bf16)                                                       \
  DEFINE_INT_KERNEL(reduce_i8_##SUFFIX, TARGET, int8_t, unsigned)                       \
  DEFINE_INT_KERNEL(reduce_i16_##SUFFIX, TARGET, int16_t, unsigned)                     \
  DEFINE_INT_KERNEL(reduce_i32_##SUFFIX, TARGET, int32_t, uint32_t)                     \
  DEFINE_INT_KERNEL(reduce_i64_##SUFFIX, TARGET, int64_t, uint64_t)                     \
  DEFINE_INT_KERNEL(reduce_u8_##SUFFIX, TARGET, uint8_t, unsigned)                      \
  DEFINE_BOOL_KERNEL(reduce_bool_##SUFFIX, TARGET)                                      \
  static const reduce_kernel_fn kernels_##SUFFIX[TCC_DTYPE_COUNT] = {                   \
      [TCC_FLOAT32] = reduce_f32_##SUFFIX,  [TCC_FLOAT64] = reduce_f64_##SUFFIX,         \
      [TCC_FLOAT16] = reduce_f16_##SUFFIX,  [TCC_BFLOAT16] = reduce_bf16_##SUFFIX,       \
      [TCC_INT8] = reduce_i8_##SUFFIX,      [TCC_INT16] = reduce_i16_##SUFFIX,           \
      [TCC_INT32] = reduce_i32_##SUFFIX,    [TCC_INT64] = reduce_i64_##SUFFIX,           \
      [TCC_UINT8] = reduce_u8_##SUFFIX,     [TCC_BOOL] = reduce_bool_##SUFFIX,           \
  };

DEFINE_ALL_KERNELS(generic, TARGET_GENERIC, load_f16, store_f16)
#if REDUCE_HAVE_X86_VARIANTS
DEFINE_ALL_KERNELS(avx2, TARGET_AVX2, load_f16_f16c, store_f16_f16c)
#endif

/* ---- dispatch ----------------------------------------------------------------------- */

static const reduce_kernel_fn *choose_kernels(void) {
  const char *forced = getenv("TCCOMM_REDUCE_ISA");
  if (forced != NULL && strcmp(forced, "generic") == 0) return kernels_generic;
#if REDUCE_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return kernels_avx2;
#endif
  return kernels_generic;
}

/* Chosen on first use; a race only makes two threads compute the same answer. */
static _Atomic(const reduce_kernel_fn *) active_kernels;

void tcc_reduce_n(void *dst, const void *const *srcs, int nsrc, size_t count,
                  tcc_dtype_t dtype, tcc_redop_t op, double premul) {
  if (count == 0 || nsrc <= 0) return;
  /* The caller checked this; re-checking keeps a bad enum from indexing
   * past the table. It costs a few compares per call, not per element. */
  if (tcc_redop_supported(dtype, op) != TCC_OK) return;
  const reduce_kernel_fn *kernels = atomic_load_explicit(&active_kernels, memory_order_acquire);
  if (kernels == NULL) {
    kernels = choose_kernels();
    atomic_store_explicit(&active_kernels, kernels, memory_order_release);
  }
  kernels[dtype](dst, srcs, nsrc, count, op, premul);
}
