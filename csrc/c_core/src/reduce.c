/*
 * reduce.c - elementwise reductions of n sources: every dtype x every op.
 *
 * Determinism: sources are folded strictly in index order and every
 * element goes through the same scalar formula whatever the ISA, so every
 * rank that runs the same call gets the same bits. Nothing is reassociated
 * and nothing is contracted into an FMA (the AVX2 variants do not enable
 * FMA, and -std=c11 implies -ffp-contract=off). The FPU is assumed to be in
 * its default round-to-nearest-even mode.
 *
 * Speed: work proceeds in blocks of REDUCE_BLOCK elements; full blocks have
 * a compile-time trip count, which GCC's -O2 ("very cheap") vectorizer
 * needs. One and two sources go straight from the sources to dst; more
 * sources fold into a local accumulator block first. Writing dst while
 * reading the sources is safe because dst is either disjoint from every
 * source or exactly one of them, and element i only reads element i: there
 * is no loop-carried dependence, which NO_LOOP_CARRIED_DEPS tells the
 * vectorizer so that it does not give up over possible aliasing.
 *
 * ISA dispatch: the elementwise kernels are compiled twice, for the baseline ISA
 * and for AVX2, and float16 / bfloat16 also get hand-written AVX2 (+F16C)
 * kernels, because their conversions, not memory, bound them. The choice
 * is made once from cpuid; every variant produces identical bits.
 * TCCOMM_REDUCE_ISA=generic forces the baseline kernels (the tests use it
 * to check both).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/base.h"
#include "core/mutation.h"

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

#if defined(__clang__)
#define NO_LOOP_CARRIED_DEPS _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define NO_LOOP_CARRIED_DEPS _Pragma("GCC ivdep")
#else
#define NO_LOOP_CARRIED_DEPS
#endif

typedef void (*reduce_kernel_fn)(void *dst, const void *const *srcs, int nsrc, size_t count,
                                 tcc_redop_t op, double premul);

/* ---- float16 / bfloat16 <-> float32, portable ------------------------- */
/* Branch-free (selects through bit masks, so that GCC's if-conversion has
 * nothing to give up on) and therefore vectorizable. They match the x86
 * F16C instructions bit for bit, NaNs included (made quiet, sign and top
 * payload bits kept), so the generic and the F16C kernels agree. */

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

/* All ones when cond holds, else zero. */
ALWAYS_INLINE uint32_t mask_if(int cond) { return 0u - (uint32_t)cond; }

ALWAYS_INLINE uint32_t select_bits(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

ALWAYS_INLINE float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  int32_t magnitude = h & 0x7FFF;
  uint32_t shifted = (uint32_t)magnitude << 13;
  uint32_t normal = shifted + ((127u - 15u) << 23); /* rebias the exponent */
  uint32_t inf_or_nan = shifted | 0x7F800000u | (mask_if(magnitude > 0x7C00) & 0x00400000u);
  /* Subnormal: mantissa * 2^-24 is exact and a normal float32. */
  uint32_t subnormal = float_bits((float)magnitude * 0x1p-24f);
  uint32_t bits = select_bits(mask_if(magnitude >= 0x7C00), inf_or_nan,
                              select_bits(mask_if(magnitude < 0x0400), subnormal, normal));
  return bits_float(sign | bits);
}

/* Round to nearest, ties to even. */
ALWAYS_INLINE uint16_t f32_to_f16(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7FFFFFFFu;
  int32_t m = (int32_t)magnitude; /* signed compares vectorize everywhere */
  uint32_t quiet_nan = 0x7E00u | ((magnitude >> 13) & 0x3FFu);
  /* A carry out of the mantissa correctly bumps the exponent. */
  uint32_t normal =
      ((magnitude + 0xFFFu + ((magnitude >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
  /* Below 2^-14, adding 0.5 leaves a float whose last mantissa bit is worth
   * 2^-24, the half subnormal step: the FPU rounds to nearest-even for us,
   * and a carry to 0x400 is the smallest normal half, as it should be. */
  uint32_t subnormal = float_bits(bits_float(magnitude) + 0.5f) - 0x3F000000u;
  uint32_t bits =
      select_bits(mask_if(m > 0x7F800000), quiet_nan,
                  select_bits(mask_if(m >= 0x477FF000), 0x7C00u, /* >= 65520: past 65504 */
                              select_bits(mask_if(m >= 0x38800000), normal, subnormal)));
  return (uint16_t)(sign | bits);
}

ALWAYS_INLINE float bf16_to_f32(uint16_t b) { return bits_float((uint32_t)b << 16); }

/* Round to nearest, ties to even; a NaN gets no rounding increment (which
 * could carry it into Inf) and its quiet bit set. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t x = float_bits(f);
  uint32_t is_nan = mask_if((int32_t)(x & 0x7FFFFFFFu) > 0x7F800000);
  uint32_t increment = ~is_nan & (0x7FFFu + ((x >> 16) & 1u));
  return (uint16_t)(((x | (is_nan & 0x00400000u)) + increment) >> 16);
}

/* ---- per-element operations ---------------------------------------------- */
/* first(x): the first source's contribution; combine(acc, x): fold in the
 * next source; finish(acc): the final value. `op` is a compile-time
 * constant wherever these are inlined, so the switches disappear. */

#define IDENTITY(x) (x)

/* Floats. MIN/MAX propagate NaN like torch.amin/amax: a NaN source
 * replaces acc, and a NaN acc is never replaced by a number. */
#define DEFINE_FLOAT_OPS(K, ACC)                                                  \
  ALWAYS_INLINE ACC first_##K(ACC x, tcc_redop_t op, ACC premul) {                \
    return op == TCC_PREMUL_SUM ? x * premul : x;                                 \
  }                                                                               \
  ALWAYS_INLINE ACC combine_##K(ACC acc, ACC x, tcc_redop_t op, ACC premul) {     \
    switch (op) {                                                                 \
      case TCC_PREMUL_SUM: return acc + x * premul;                               \
      case TCC_PRODUCT: return acc * x;                                           \
      case TCC_MIN: return (x < acc || x != x) ? x : acc;                         \
      case TCC_MAX: return (x > acc || x != x) ? x : acc;                         \
      default: return acc + x; /* SUM, AVG */                                     \
    }                                                                             \
  }                                                                               \
  ALWAYS_INLINE ACC finish_##K(ACC acc, tcc_redop_t op, int nsrc) {               \
    return op == TCC_AVG ? acc / (ACC)nsrc : acc;                                 \
  }

DEFINE_FLOAT_OPS(f32, float)
DEFINE_FLOAT_OPS(f64, double)

/* Integers. SUM and PRODUCT wrap (two's complement) by computing in an
 * unsigned type at least as wide as int: its overflow is defined and it is
 * not promoted to signed int. Converting back to T truncates (GCC defines
 * this as modular). AVG is C's truncating division of the wrapped sum;
 * dividing by nsrc >= 1 cannot overflow, even for the most negative T. */
#define DEFINE_INT_OPS(K, T, WIDE_UNSIGNED)                                       \
  ALWAYS_INLINE T first_##K(T x, tcc_redop_t op, int unused) {                    \
    (void)op;                                                                     \
    (void)unused;                                                                 \
    return x;                                                                     \
  }                                                                               \
  ALWAYS_INLINE T combine_##K(T acc, T x, tcc_redop_t op, int unused) {           \
    (void)unused;                                                                 \
    switch (op) {                                                                 \
      case TCC_PRODUCT: return (T)((WIDE_UNSIGNED)acc * (WIDE_UNSIGNED)x);        \
      case TCC_MIN: return x < acc ? x : acc;                                     \
      case TCC_MAX: return x > acc ? x : acc;                                     \
      case TCC_BAND: return (T)(acc & x);                                         \
      case TCC_BOR: return (T)(acc | x);                                          \
      case TCC_BXOR: return (T)(acc ^ x);                                         \
      default: return (T)((WIDE_UNSIGNED)acc + (WIDE_UNSIGNED)x); /* SUM, AVG */  \
    }                                                                             \
  }                                                                               \
  ALWAYS_INLINE T finish_##K(T acc, tcc_redop_t op, int nsrc) {                   \
    return op == TCC_AVG ? (T)(acc / nsrc) : acc;                                 \
  }

DEFINE_INT_OPS(i8, int8_t, unsigned)
DEFINE_INT_OPS(i16, int16_t, unsigned)
DEFINE_INT_OPS(i32, int32_t, uint32_t)
DEFINE_INT_OPS(i64, int64_t, uint64_t)
DEFINE_INT_OPS(u8, uint8_t, unsigned)

/* bool: bytes read as false (0) / true (anything else), written as 0/1.
 * SUM, MAX and BOR are OR; PRODUCT, MIN and BAND are AND (torch's NCCL
 * semantics); the kernel maps them onto BOR and BAND. */
ALWAYS_INLINE uint8_t to_bool(uint8_t x) { return x != 0; }
ALWAYS_INLINE uint8_t first_bool(uint8_t x, tcc_redop_t op, int unused) {
  (void)op;
  (void)unused;
  return x;
}
ALWAYS_INLINE uint8_t combine_bool(uint8_t acc, uint8_t x, tcc_redop_t op, int unused) {
  (void)unused;
  switch (op) {
    case TCC_BAND: return acc & x;
    case TCC_BXOR: return acc ^ x;
    default: return acc | x; /* BOR */
  }
}
ALWAYS_INLINE uint8_t finish_bool(uint8_t acc, tcc_redop_t op, int nsrc) {
  (void)op;
  (void)nsrc;
  return acc;
}

/* ---- op dispatch: one instantiation per supported op -------------------------- */

#define FLOAT_OP_SWITCH(op, RUN, ...)                                \
  switch (op) {                                                      \
    case TCC_SUM: RUN(TCC_SUM, __VA_ARGS__); break;                  \
    case TCC_AVG: RUN(TCC_AVG, __VA_ARGS__); break;                  \
    case TCC_PREMUL_SUM: RUN(TCC_PREMUL_SUM, __VA_ARGS__); break;    \
    case TCC_PRODUCT: RUN(TCC_PRODUCT, __VA_ARGS__); break;          \
    case TCC_MIN: RUN(TCC_MIN, __VA_ARGS__); break;                  \
    case TCC_MAX: RUN(TCC_MAX, __VA_ARGS__); break;                  \
    default: break;                                                  \
  }

#define INT_OP_SWITCH(op, RUN, ...)                                  \
  switch (op) {                                                      \
    case TCC_SUM: RUN(TCC_SUM, __VA_ARGS__); break;                  \
    case TCC_AVG: RUN(TCC_AVG, __VA_ARGS__); break;                  \
    case TCC_PRODUCT: RUN(TCC_PRODUCT, __VA_ARGS__); break;          \
    case TCC_MIN: RUN(TCC_MIN, __VA_ARGS__); break;                  \
    case TCC_MAX: RUN(TCC_MAX, __VA_ARGS__); break;                  \
    case TCC_BAND: RUN(TCC_BAND, __VA_ARGS__); break;                \
    case TCC_BOR: RUN(TCC_BOR, __VA_ARGS__); break;                  \
    case TCC_BXOR: RUN(TCC_BXOR, __VA_ARGS__); break;                \
    default: break;                                                  \
  }

#define BOOL_OP_SWITCH(op, RUN, ...)                                 \
  switch (op) {                                                      \
    case TCC_SUM: case TCC_MAX: case TCC_BOR:                        \
      RUN(TCC_BOR, __VA_ARGS__); break;                              \
    case TCC_PRODUCT: case TCC_MIN: case TCC_BAND:                   \
      RUN(TCC_BAND, __VA_ARGS__); break;                             \
    case TCC_BXOR: RUN(TCC_BXOR, __VA_ARGS__); break;                \
    default: break;                                                  \
  }

/* ---- elementwise kernels ---------------------------------------------------------- */
/* NAME: the kernel; K: which first/combine/finish; ELEM: stored type; ACC:
 * accumulation type; PREMUL_T / PREMUL_FROM_DOUBLE: the premul factor in
 * the accumulation type; TO_ACC / FROM_ACC: per-element conversions. */

#define DEFINE_KERNEL(NAME, TARGET, K, ELEM, ACC, PREMUL_T, PREMUL_FROM_DOUBLE, TO_ACC,     \
                      FROM_ACC, OP_SWITCH)                                                 \
  TARGET ALWAYS_INLINE void NAME##_block(ELEM *dst, const void *const *srcs, size_t base,  \
                                         int nsrc, size_t n, tcc_redop_t op,               \
                                         PREMUL_T premul) {                                \
    const ELEM *x0 = (const ELEM *)srcs[0] + base;                                         \
    if (nsrc == 1) {                                                                       \
      NO_LOOP_CARRIED_DEPS                                                                 \
      for (size_t i = 0; i < n; i++)                                                       \
        dst[i] = FROM_ACC(finish_##K(first_##K(TO_ACC(x0[i]), op, premul), op, nsrc));     \
      return;                                                                              \
    }                                                                                      \
    const ELEM *x1 = (const ELEM *)srcs[1] + base;                                         \
    if (nsrc == 2) {                                                                       \
      NO_LOOP_CARRIED_DEPS                                                                 \
      for (size_t i = 0; i < n; i++)                                                       \
        dst[i] = FROM_ACC(finish_##K(                                                      \
            combine_##K(first_##K(TO_ACC(x0[i]), op, premul), TO_ACC(x1[i]), op, premul),  \
            op, nsrc));                                                                    \
      return;                                                                              \
    }                                                                                      \
    ACC acc[REDUCE_BLOCK];                                                                 \
    for (size_t i = 0; i < n; i++)                                                         \
      acc[i] = combine_##K(first_##K(TO_ACC(x0[i]), op, premul), TO_ACC(x1[i]), op, premul); \
    for (int s = 2; s < nsrc - 1; s++) {                                                   \
      const ELEM *x = (const ELEM *)srcs[s] + base;                                        \
      for (size_t i = 0; i < n; i++) acc[i] = combine_##K(acc[i], TO_ACC(x[i]), op, premul); \
    }                                                                                      \
    const ELEM *x_last = (const ELEM *)srcs[nsrc - 1] + base;                              \
    NO_LOOP_CARRIED_DEPS                                                                   \
    for (size_t i = 0; i < n; i++)                                                         \
      dst[i] = FROM_ACC(finish_##K(combine_##K(acc[i], TO_ACC(x_last[i]), op, premul), op, \
                                   nsrc));                                                 \
  }                                                                                        \
  TARGET ALWAYS_INLINE void NAME##_run(tcc_redop_t op, void *dst, const void *const *srcs, \
                                       int nsrc, size_t count, PREMUL_T premul) {          \
    size_t base = 0;                                                                       \
    for (; base + REDUCE_BLOCK <= count; base += REDUCE_BLOCK)                             \
      NAME##_block((ELEM *)dst + base, srcs, base, nsrc, REDUCE_BLOCK, op, premul);        \
    if (base < count)                                                                      \
      NAME##_block((ELEM *)dst + base, srcs, base, nsrc, count - base, op, premul);        \
  }                                                                                        \
  TARGET static void NAME(void *dst, const void *const *srcs, int nsrc, size_t count,      \
                          tcc_redop_t op, double premul) {                                 \
    PREMUL_T premul_acc = PREMUL_FROM_DOUBLE(premul);                                      \
    (void)premul;                                                                          \
    OP_SWITCH(op, NAME##_run, dst, srcs, nsrc, count, premul_acc)                          \
  }

#define TO_FLOAT(x) ((float)(x))
#define TO_DOUBLE(x) ((double)(x))
#define NO_PREMUL(x) 0

/* ---- float16 / bfloat16 with AVX2 intrinsics ------------------------------------------ */

#if REDUCE_HAVE_X86_VARIANTS
/* The 16-bit floats are compute-bound (the conversions cost more than the
 * memory traffic), so on AVX2 they get register-resident kernels: 16
 * elements of every source are folded in registers and stored once, with
 * F16C for float16 and shifts for bfloat16. Each vector step computes
 * exactly what the scalar first/combine/finish of f32 compute per element
 * (same IEEE operations, no FMA), and the tail uses those scalar functions,
 * so results match the generic kernels bit for bit. */

TARGET_AVX2 ALWAYS_INLINE __m256 first_v8(__m256 x, tcc_redop_t op, __m256 premul) {
  return op == TCC_PREMUL_SUM ? _mm256_mul_ps(x, premul) : x;
}

TARGET_AVX2 ALWAYS_INLINE __m256 combine_v8(__m256 acc, __m256 x, tcc_redop_t op,
                                             __m256 premul) {
  switch (op) {
    case TCC_PREMUL_SUM: return _mm256_add_ps(acc, _mm256_mul_ps(x, premul));
    case TCC_PRODUCT: return _mm256_mul_ps(acc, x);
    case TCC_MIN: /* x < acc || x is NaN ? x : acc */
      return _mm256_blendv_ps(acc, x, _mm256_or_ps(_mm256_cmp_ps(x, acc, _CMP_LT_OQ),
                                                   _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    case TCC_MAX:
      return _mm256_blendv_ps(acc, x, _mm256_or_ps(_mm256_cmp_ps(x, acc, _CMP_GT_OQ),
                                                   _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    default: return _mm256_add_ps(acc, x); /* SUM, AVG */
  }
}

TARGET_AVX2 ALWAYS_INLINE __m256 finish_v8(__m256 acc, tcc_redop_t op, __m256 divisor) {
  return op == TCC_AVG ? _mm256_div_ps(acc, divisor) : acc;
}

/* 16 float16 values <-> two vectors of 8 floats, in element order. */
TARGET_AVX2 ALWAYS_INLINE void load16_f16(const uint16_t *src, __m256 *lo, __m256 *hi) {
  *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
  *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 8)));
}

TARGET_AVX2 ALWAYS_INLINE void store16_f16(uint16_t *dst, __m256 lo, __m256 hi) {
  const int round_nearest_even = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128((__m128i *)dst, _mm256_cvtps_ph(lo, round_nearest_even));
  _mm_storeu_si128((__m128i *)(dst + 8), _mm256_cvtps_ph(hi, round_nearest_even));
}

/* 16 bfloat16 values <-> two vectors of 8 floats: the even elements (each
 * 32-bit word's low half shifted up) and the odd ones (its high half kept
 * in place). Every source is loaded the same way and the store puts each
 * half back where it came from, so no lane crosses a shuffle: shifts and
 * masks only, which keeps the kernel off the shuffle unit that bounded it
 * (unpacking and packing took 5 shuffles per 16 elements). */
TARGET_AVX2 ALWAYS_INLINE void load16_bf16(const uint16_t *src, __m256 *even, __m256 *odd) {
  __m256i words = _mm256_loadu_si256((const __m256i *)src);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* f32_to_bf16 on 8 lanes that hold no NaN (infinities round to
 * themselves, the largest finites to infinity, as in f32_to_bf16); the
 * result is in the low half of each lane. */
TARGET_AVX2 ALWAYS_INLINE __m256i round8_bf16_no_nan(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

/* f32_to_bf16 on 8 lanes: a NaN keeps its top bits, made quiet. */
TARGET_AVX2 ALWAYS_INLINE __m256i round8_bf16(__m256 v) {
  __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x0040));
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(round8_bf16_no_nan(v), quiet_nan, is_nan);
}

/* The rounding is most of a bfloat16 kernel's work: one compare finds
 * whether either vector holds a NaN, and only then are NaNs blended in. */
TARGET_AVX2 ALWAYS_INLINE void store16_bf16(uint16_t *dst, __m256 even, __m256 odd) {
  __m256i words;
  if (_mm256_movemask_ps(_mm256_cmp_ps(even, odd, _CMP_UNORD_Q)) == 0) {
    /* The odd lanes' rounded value is the top half of their sum: masked, not shifted. */
    __m256i bits = _mm256_castps_si256(odd);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i odd_up = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb),
                                      _mm256_set1_epi32((int)0xFFFF0000u));
    words = _mm256_or_si256(round8_bf16_no_nan(even), odd_up);
  } else {
    words = _mm256_or_si256(round8_bf16(even), _mm256_slli_epi32(round8_bf16(odd), 16));
  }
  _mm256_storeu_si256((__m256i *)dst, words);
}

#define DEFINE_HALF_AVX2_KERNEL(NAME, LOAD16, STORE16, TO_F32, FROM_F32)                      \
  TARGET_AVX2 ALWAYS_INLINE void NAME##_run(tcc_redop_t op, void *dst_v,                      \
                                            const void *const *srcs, int nsrc, size_t count,  \
                                            float premul) {                                   \
    uint16_t *dst = dst_v;                                                                    \
    const __m256 premul_v = _mm256_set1_ps(premul);                                           \
    const __m256 divisor_v = _mm256_set1_ps((float)nsrc);                                     \
    /* Separate loops up to vec_end: each keeps a plain trip count. */                        \
    const size_t vec_end = count - count % 16;                                                \
    /* In locals: the compiler cannot tell that a store to dst leaves srcs[] alone. */        \
    const uint16_t *a = srcs[0], *b = srcs[nsrc > 1 ? 1 : 0];                                 \
    if (nsrc == 2) /* 2 ranks, or a pairwise step: no loop over the sources */                \
      for (size_t i = 0; i < vec_end; i += 16) {                                              \
        __m256 lo, hi, x_lo, x_hi;                                                            \
        LOAD16(a + i, &lo, &hi);                                                              \
        LOAD16(b + i, &x_lo, &x_hi);                                                          \
        lo = combine_v8(first_v8(lo, op, premul_v), x_lo, op, premul_v);                      \
        hi = combine_v8(first_v8(hi, op, premul_v), x_hi, op, premul_v);                      \
        STORE16(dst + i, finish_v8(lo, op, divisor_v), finish_v8(hi, op, divisor_v));         \
      }                                                                                       \
    else                                                                                      \
      for (size_t i = 0; i < vec_end; i += 16) {                                              \
        __m256 lo, hi, x_lo, x_hi;                                                            \
        LOAD16(a + i, &lo, &hi);                                                              \
        lo = first_v8(lo, op, premul_v);                                                      \
        hi = first_v8(hi, op, premul_v);                                                      \
        for (int s = 1; s < nsrc; s++) {                                                      \
          LOAD16((const uint16_t *)srcs[s] + i, &x_lo, &x_hi);                                \
          lo = combine_v8(lo, x_lo, op, premul_v);                                            \
          hi = combine_v8(hi, x_hi, op, premul_v);                                            \
        }                                                                                     \
        /* Every source's elements i..i+15 were read above: dst may be one of them. */        \
        STORE16(dst + i, finish_v8(lo, op, divisor_v), finish_v8(hi, op, divisor_v));         \
      }                                                                                       \
    for (size_t i = vec_end; i < count; i++) {                                               \
      float acc = first_f32(TO_F32(((const uint16_t *)srcs[0])[i]), op, premul);              \
      for (int s = 1; s < nsrc; s++)                                                          \
        acc = combine_f32(acc, TO_F32(((const uint16_t *)srcs[s])[i]), op, premul);           \
      dst[i] = FROM_F32(finish_f32(acc, op, nsrc));                                           \
    }                                                                                         \
  }                                                                                           \
  TARGET_AVX2 static void NAME(void *dst, const void *const *srcs, int nsrc, size_t count,    \
                               tcc_redop_t op, double premul) {                               \
    float premul_f = (float)premul;                                                           \
    FLOAT_OP_SWITCH(op, NAME##_run, dst, srcs, nsrc, count, premul_f)                         \
  }

DEFINE_HALF_AVX2_KERNEL(reduce_f16_f16c, load16_f16, store16_f16, f16_to_f32, f32_to_f16)
DEFINE_HALF_AVX2_KERNEL(reduce_bf16_avx2, load16_bf16, store16_bf16, bf16_to_f32, f32_to_bf16)
#endif

/* ---- the kernels, per ISA ----------------------------------------------------------- */

#define DEFINE_COMMON_KERNELS(SUFFIX, TARGET)                                                 \
  DEFINE_KERNEL(reduce_f32_##SUFFIX, TARGET, f32, float, float, float, TO_FLOAT, IDENTITY,    \
                IDENTITY, FLOAT_OP_SWITCH)                                                    \
  DEFINE_KERNEL(reduce_f64_##SUFFIX, TARGET, f64, double, double, double, TO_DOUBLE,          \
                IDENTITY, IDENTITY, FLOAT_OP_SWITCH)                                          \
  DEFINE_KERNEL(reduce_i8_##SUFFIX, TARGET, i8, int8_t, int8_t, int, NO_PREMUL, IDENTITY,     \
                IDENTITY, INT_OP_SWITCH)                                                      \
  DEFINE_KERNEL(reduce_i16_##SUFFIX, TARGET, i16, int16_t, int16_t, int, NO_PREMUL, IDENTITY, \
                IDENTITY, INT_OP_SWITCH)                                                      \
  DEFINE_KERNEL(reduce_i32_##SUFFIX, TARGET, i32, int32_t, int32_t, int, NO_PREMUL, IDENTITY, \
                IDENTITY, INT_OP_SWITCH)                                                      \
  DEFINE_KERNEL(reduce_i64_##SUFFIX, TARGET, i64, int64_t, int64_t, int, NO_PREMUL, IDENTITY, \
                IDENTITY, INT_OP_SWITCH)                                                      \
  DEFINE_KERNEL(reduce_u8_##SUFFIX, TARGET, u8, uint8_t, uint8_t, int, NO_PREMUL, IDENTITY,   \
                IDENTITY, INT_OP_SWITCH)                                                      \
  DEFINE_KERNEL(reduce_bool_##SUFFIX, TARGET, bool, uint8_t, uint8_t, int, NO_PREMUL,         \
                to_bool, IDENTITY, BOOL_OP_SWITCH)

#define KERNEL_TABLE(SUFFIX, F16_KERNEL, BF16_KERNEL)                             \
  static const reduce_kernel_fn kernels_##SUFFIX[TCC_DTYPE_COUNT] = {             \
      [TCC_FLOAT32] = reduce_f32_##SUFFIX, [TCC_FLOAT64] = reduce_f64_##SUFFIX,   \
      [TCC_FLOAT16] = F16_KERNEL,          [TCC_BFLOAT16] = BF16_KERNEL,          \
      [TCC_INT8] = reduce_i8_##SUFFIX,     [TCC_INT16] = reduce_i16_##SUFFIX,     \
      [TCC_INT32] = reduce_i32_##SUFFIX,   [TCC_INT64] = reduce_i64_##SUFFIX,     \
      [TCC_UINT8] = reduce_u8_##SUFFIX,    [TCC_BOOL] = reduce_bool_##SUFFIX,     \
  };

DEFINE_COMMON_KERNELS(generic, TARGET_GENERIC)
DEFINE_KERNEL(reduce_f16_generic, TARGET_GENERIC, f32, uint16_t, float, float, TO_FLOAT,
              f16_to_f32, f32_to_f16, FLOAT_OP_SWITCH)
DEFINE_KERNEL(reduce_bf16_generic, TARGET_GENERIC, f32, uint16_t, float, float, TO_FLOAT,
              bf16_to_f32, f32_to_bf16, FLOAT_OP_SWITCH)
KERNEL_TABLE(generic, reduce_f16_generic, reduce_bf16_generic)

#if REDUCE_HAVE_X86_VARIANTS
DEFINE_COMMON_KERNELS(avx2, TARGET_AVX2)
KERNEL_TABLE(avx2, reduce_f16_f16c, reduce_bf16_avx2)
#endif

/* ---- dispatch ------------------------------------------------------------------------ */

static const reduce_kernel_fn *choose_kernels(void) {
  const char *forced = getenv("TCCOMM_REDUCE_ISA");
  if (forced != NULL && strcmp(forced, "generic") == 0) return kernels_generic;
#if REDUCE_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return kernels_avx2;
#endif
  return kernels_generic;
}

#define AVERAGE(K, T)                                          \
  do {                                                         \
    T *p = buf;                                                \
    for (size_t i = 0; i < count; i++) p[i] = finish_##K(p[i], TCC_AVG, n); \
  } while (0)

void tcc__reduce_average(void *buf, size_t count, tcc_dtype_t dtype, int n) {
  if (n <= 0) return;
  switch (dtype) {
    case TCC_FLOAT32: AVERAGE(f32, float); break;
    case TCC_FLOAT64: AVERAGE(f64, double); break;
    case TCC_INT8: AVERAGE(i8, int8_t); break;
    case TCC_INT16: AVERAGE(i16, int16_t); break;
    case TCC_INT32: AVERAGE(i32, int32_t); break;
    case TCC_INT64: AVERAGE(i64, int64_t); break;
    case TCC_UINT8: AVERAGE(u8, uint8_t); break;
    default: break;
  }
}

/* Chosen on first use; a race only makes two threads compute the same answer. */
static _Atomic(const reduce_kernel_fn *) active_kernels;

static const reduce_kernel_fn *kernels_in_use(void) {
  const reduce_kernel_fn *kernels = atomic_load_explicit(&active_kernels, memory_order_acquire);
  if (kernels == NULL) {
    kernels = choose_kernels();
    atomic_store_explicit(&active_kernels, kernels, memory_order_release);
  }
  return kernels;
}

/* ---- float16 / bfloat16 <-> float32 arrays --------------------------------------------- */
/* With the AVX2 kernels, 8 elements at a time with the same conversions
 * (F16C; bfloat16 by shifts and round8_bf16), the rest one by one. */

#if REDUCE_HAVE_X86_VARIANTS
TARGET_AVX2 static size_t widen_avx2(float *dst, const uint16_t *src, size_t count, tcc_dtype_t half) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
    const __m256 v = half == TCC_FLOAT16 ? _mm256_cvtph_ps(h)
                                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(dst + i, v);
  }
  return i;
}

TARGET_AVX2 static size_t narrow_avx2(uint16_t *dst, const float *src, size_t count, tcc_dtype_t half) {
  const int round_nearest_even = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  size_t i = 0;
  if (half == TCC_FLOAT16)
    for (; i + 8 <= count; i += 8)
      _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), round_nearest_even));
  else
    for (; i + 16 <= count; i += 16) {
      /* packus interleaves the two vectors' 128-bit lanes: the permute puts them back in order. */
      const __m256i packed = _mm256_packus_epi32(round8_bf16(_mm256_loadu_ps(src + i)),
                                                 round8_bf16(_mm256_loadu_ps(src + i + 8)));
      _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permute4x64_epi64(packed, 0xD8));
    }
  return i;
}
#endif

void tcc__half_widen(float *dst, const void *half_src, size_t count, tcc_dtype_t half) {
  const uint16_t *src = half_src;
  if (half != TCC_FLOAT16 && half != TCC_BFLOAT16) return;
  size_t i = 0;
#if REDUCE_HAVE_X86_VARIANTS
  if (kernels_in_use() == kernels_avx2) i = widen_avx2(dst, src, count, half);
#endif
  for (; i < count; i++) dst[i] = half == TCC_FLOAT16 ? f16_to_f32(src[i]) : bf16_to_f32(src[i]);
}

void tcc__half_narrow(void *half_dst, const float *src, size_t count, tcc_dtype_t half) {
  uint16_t *dst = half_dst;
  if (half != TCC_FLOAT16 && half != TCC_BFLOAT16) return;
  size_t i = 0;
#if REDUCE_HAVE_X86_VARIANTS
  if (kernels_in_use() == kernels_avx2) i = narrow_avx2(dst, src, count, half);
#endif
  for (; i < count; i++) dst[i] = half == TCC_FLOAT16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
}

void tcc__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t count,
                  tcc_dtype_t dtype, tcc_redop_t op, double premul) {
  if (count == 0 || nsrc <= 0) return;
  /* The caller checked this; checking again keeps a bad enum from indexing
   * past the table. Sum, product, min and max reduce every dtype: the
   * full check only for the others. */
  const bool any_dtype = op == TCC_SUM || op == TCC_PRODUCT || op == TCC_MIN || op == TCC_MAX;
  if ((unsigned)dtype >= TCC_DTYPE_COUNT || (!any_dtype && tcc_redop_supported(dtype, op) != TCC_OK)) return;
  const reduce_kernel_fn *kernels = kernels_in_use();
  if (TCC_MUTANT(AVG_DIVISOR) && op == TCC_AVG) op = TCC_SUM; /* MUTATION SITE: divisor 1 */
  kernels[dtype](dst, srcs, nsrc, count, op, premul);
}
