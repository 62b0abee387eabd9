/*
 * test_reduce.c - tcc__reduce_n against a straightforward reference, plus
 * the support matrix and the enum names.
 *
 * The reference decodes every element into double / int64 with code that
 * shares nothing with reduce.c (ldexp-based half decoding, rounding by
 * nearbyint on a scaled double), folds in the documented order and type,
 * and compares values (NaN-ness, value, sign of zero) or exact bits.
 *
 * The whole suite runs twice: once with the kernels cpuid picks, then in a
 * re-executed child with TCCOMM_REDUCE_ISA=generic, so both kernel sets
 * are checked against the same reference.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "core/internal.h"

/* ---- random numbers ---------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static unsigned rng_below(unsigned n) { return (unsigned)(rng_next() % n); }

/* ---- independent decoding / rounding ----------------------------------- */

static double half_value(uint16_t h) {
  int exponent = (h >> 10) & 31, mantissa = h & 1023;
  double v;
  if (exponent == 31) v = mantissa ? NAN : INFINITY;
  else if (exponent == 0) v = ldexp(mantissa, -24);
  else v = ldexp(mantissa + 1024, exponent - 25);
  return (h & 0x8000) ? -v : v;
}

static double bf16_value(uint16_t b) {
  int exponent = (b >> 7) & 255, mantissa = b & 127;
  double v;
  if (exponent == 255) v = mantissa ? NAN : INFINITY;
  else if (exponent == 0) v = ldexp(mantissa, -133);
  else v = ldexp(mantissa + 128, exponent - 134);
  return (b & 0x8000) ? -v : v;
}

/* Rounds v to nearest-even in a binary format with `precision` significand
 * bits, smallest normal exponent min_exp and largest exponent max_exp. */
static double round_to_format(double v, int precision, int min_exp, int max_exp) {
  if (isnan(v) || isinf(v) || v == 0) return v;
  double magnitude = fabs(v);
  int frexp_exp;
  frexp(magnitude, &frexp_exp);
  int exponent = frexp_exp - 1;
  if (exponent < min_exp) exponent = min_exp; /* subnormals share one quantum */
  double quantum = ldexp(1.0, exponent - (precision - 1));
  double rounded = nearbyint(magnitude / quantum) * quantum;
  if (rounded >= ldexp(1.0, max_exp + 1)) rounded = INFINITY;
  return copysign(rounded, v);
}

static double round_half(double v) { return round_to_format(v, 11, -14, 15); }
static double round_bf16(double v) { return round_to_format(v, 8, -126, 127); }

/* ---- element access ------------------------------------------------------ */

static int is_float_dtype(tcc_dtype_t dt) {
  return dt == TCC_FLOAT32 || dt == TCC_FLOAT64 || dt == TCC_FLOAT16 || dt == TCC_BFLOAT16;
}

static double float_elem(tcc_dtype_t dt, const void *p, size_t i) {
  switch (dt) {
    case TCC_FLOAT32: return ((const float *)p)[i];
    case TCC_FLOAT64: return ((const double *)p)[i];
    case TCC_FLOAT16: return half_value(((const uint16_t *)p)[i]);
    case TCC_BFLOAT16: return bf16_value(((const uint16_t *)p)[i]);
    default: return NAN;
  }
}

/* Integer element, sign- or zero-extended as its dtype says. */
static int64_t int_elem(tcc_dtype_t dt, const void *p, size_t i) {
  switch (dt) {
    case TCC_INT8: return ((const int8_t *)p)[i];
    case TCC_INT16: return ((const int16_t *)p)[i];
    case TCC_INT32: return ((const int32_t *)p)[i];
    case TCC_INT64: return ((const int64_t *)p)[i];
    case TCC_UINT8: return ((const uint8_t *)p)[i];
    case TCC_BOOL: return ((const uint8_t *)p)[i];
    default: return 0;
  }
}

/* Raw bits of element i, zero-extended. */
static uint64_t elem_bits(tcc_dtype_t dt, const void *p, size_t i) {
  size_t size = tcc_dtype_size(dt);
  uint64_t bits = 0;
  memcpy(&bits, (const char *)p + i * size, size); /* little-endian host */
  return bits;
}

static uint64_t width_mask(tcc_dtype_t dt) {
  size_t size = tcc_dtype_size(dt);
  return size == 8 ? ~0ull : (1ull << (8 * size)) - 1;
}

/* ---- the reference --------------------------------------------------------- */

/* acc op x in the accumulation type; MIN/MAX keep a NaN from either side. */
#define REF_FOLD(ACC, acc, x, op, premul)                          \
  do {                                                             \
    switch (op) {                                                  \
      case TCC_SUM:                                                \
      case TCC_AVG: acc = acc + x; break;                          \
      case TCC_PREMUL_SUM: acc = acc + x * premul; break;          \
      case TCC_PRODUCT: acc = acc * x; break;                      \
      case TCC_MIN:                                                \
        if (isnan(acc)) break;                                     \
        if (isnan(x) || x < acc) acc = x;                          \
        break;                                                     \
      case TCC_MAX:                                                \
        if (isnan(acc)) break;                                     \
        if (isnan(x) || x > acc) acc = x;                          \
        break;                                                     \
      default: acc = (ACC)NAN; break;                              \
    }                                                              \
  } while (0)

static double ref_float(tcc_dtype_t dt, const void *const *srcs, int nsrc, size_t i,
                        tcc_redop_t op, double premul) {
  if (dt == TCC_FLOAT64) {
    double acc = float_elem(dt, srcs[0], i);
    if (op == TCC_PREMUL_SUM) acc = acc * premul;
    for (int s = 1; s < nsrc; s++) {
      double x = float_elem(dt, srcs[s], i);
      REF_FOLD(double, acc, x, op, premul);
    }
    if (op == TCC_AVG) acc = acc / nsrc;
    return acc;
  }
  /* float32, float16, bfloat16: accumulate in float32. */
  float premul_f = (float)premul;
  float acc = (float)float_elem(dt, srcs[0], i);
  if (op == TCC_PREMUL_SUM) acc = acc * premul_f;
  for (int s = 1; s < nsrc; s++) {
    float x = (float)float_elem(dt, srcs[s], i);
    REF_FOLD(float, acc, x, op, premul_f);
  }
  if (op == TCC_AVG) acc = acc / (float)nsrc;
  if (dt == TCC_FLOAT16) return round_half(acc);
  if (dt == TCC_BFLOAT16) return round_bf16(acc);
  return acc;
}

/* Expected bits of an integer / bool element. */
static uint64_t ref_int(tcc_dtype_t dt, const void *const *srcs, int nsrc, size_t i,
                        tcc_redop_t op) {
  uint64_t mask = width_mask(dt);
  if (dt == TCC_BOOL) {
    int any = 0, all = 1, parity = 0;
    for (int s = 0; s < nsrc; s++) {
      int truth = int_elem(dt, srcs[s], i) != 0;
      any |= truth;
      all &= truth;
      parity ^= truth;
    }
    switch (op) {
      case TCC_SUM: case TCC_MAX: case TCC_BOR: return (uint64_t)any;
      case TCC_PRODUCT: case TCC_MIN: case TCC_BAND: return (uint64_t)all;
      case TCC_BXOR: return (uint64_t)parity;
      default: return 0xDEAD;
    }
  }
  /* Wide arithmetic in uint64 wraps modulo 2^64, hence modulo 2^width. */
  uint64_t wide = (uint64_t)int_elem(dt, srcs[0], i);
  int64_t extreme = int_elem(dt, srcs[0], i);
  for (int s = 1; s < nsrc; s++) {
    int64_t x = int_elem(dt, srcs[s], i);
    switch (op) {
      case TCC_SUM: case TCC_AVG: wide += (uint64_t)x; break;
      case TCC_PRODUCT: wide *= (uint64_t)x; break;
      case TCC_BAND: wide &= (uint64_t)x; break;
      case TCC_BOR: wide |= (uint64_t)x; break;
      case TCC_BXOR: wide ^= (uint64_t)x; break;
      case TCC_MIN: if (x < extreme) extreme = x; break;
      case TCC_MAX: if (x > extreme) extreme = x; break;
      default: break;
    }
  }
  if (op == TCC_MIN || op == TCC_MAX) return (uint64_t)extreme & mask;
  if (op == TCC_AVG) {
    /* The wrapped sum, reinterpreted in the dtype, truncating division. */
    uint64_t wrapped_bits = wide & mask;
    int64_t wrapped;
    if (dt == TCC_UINT8) {
      wrapped = (int64_t)wrapped_bits;
    } else {
      int shift = 64 - 8 * (int)tcc_dtype_size(dt);
      wrapped = (int64_t)(wrapped_bits << shift) >> shift; /* sign-extend */
    }
    return (uint64_t)(wrapped / nsrc) & mask;
  }
  return wide & mask;
}

/* ---- input generation --------------------------------------------------------- */

enum { MODE_PLAIN = 0, MODE_SPECIAL = 1, MODE_COUNT = 2 };

static void fill_random(tcc_dtype_t dt, void *p, size_t count, int mode) {
  for (size_t i = 0; i < count; i++) {
    uint64_t r = rng_next();
    int special = mode == MODE_SPECIAL && rng_below(8) == 0;
    switch (dt) {
      case TCC_FLOAT32: {
        static const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN,
                                         FLT_MIN / 4, FLT_TRUE_MIN, FLT_MAX, -FLT_MAX, 1e30f};
        double mag = ldexp((double)(r >> 11) * 0x1p-53 + 0.5, (int)rng_below(17) - 8);
        ((float *)p)[i] = special ? specials[rng_below(11)] : (float)((r & 1) ? -mag : mag);
        break;
      }
      case TCC_FLOAT64: {
        static const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN,
                                          DBL_MIN / 4, DBL_TRUE_MIN, DBL_MAX, -DBL_MAX, 1e300};
        double mag = ldexp((double)(r >> 11) * 0x1p-53 + 0.5, (int)rng_below(17) - 8);
        ((double *)p)[i] = special ? specials[rng_below(11)] : ((r & 1) ? -mag : mag);
        break;
      }
      case TCC_FLOAT16: {
        static const uint16_t specials[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01,
                                            0x7C01, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x0400};
        uint16_t bits = (uint16_t)((r & 0x8000) | ((8 + rng_below(15)) << 10) | (r >> 20 & 0x3FF));
        if (special) bits = (rng_below(2) ? specials[rng_below(12)] : (uint16_t)(r >> 40));
        ((uint16_t *)p)[i] = bits;
        break;
      }
      case TCC_BFLOAT16: {
        static const uint16_t specials[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1,
                                            0x7F81, 0x0001, 0x007F, 0x7F7F, 0xFF7F, 0x0080};
        uint16_t bits = (uint16_t)((r & 0x8000) | ((120 + rng_below(15)) << 7) | (r >> 20 & 0x7F));
        if (special) bits = (rng_below(2) ? specials[rng_below(12)] : (uint16_t)(r >> 40));
        ((uint16_t *)p)[i] = bits;
        break;
      }
      case TCC_BOOL:
        /* Mostly 0/1, as torch stores them, and some other truthy bytes. */
        ((uint8_t *)p)[i] = (uint8_t)(special ? r >> 56 : (r >> 33) & 1);
        break;
      default: {
        /* Plain: small signed values; special: full-width random bits (wraps). */
        uint64_t bits = mode == MODE_PLAIN ? (uint64_t)((int64_t)rng_below(41) - 20) : r;
        if (dt == TCC_UINT8 && mode == MODE_PLAIN) bits = rng_below(41);
        memcpy((char *)p + i * tcc_dtype_size(dt), &bits, tcc_dtype_size(dt));
        break;
      }
    }
  }
}

/* ---- one case ------------------------------------------------------------------ */

enum placement {
  OUT_OF_PLACE,
  IN_PLACE_FIRST,
  IN_PLACE_LAST,
  IN_PLACE_MIDDLE,
  ALIASED_SOURCES,          /* srcs[2j] == srcs[2j+1] */
  ALIASED_SOURCES_IN_PLACE, /* and dst == srcs[0] == srcs[1] */
  PLACEMENT_COUNT
};

static const char *const placement_names[] = {"out-of-place", "in-place[0]", "in-place[last]",
                                              "in-place[mid]", "aliased", "aliased+in-place"};

#define GUARD_ELEMS 8
#define GUARD_BYTE 0x5A

static long cases_run;

static void run_case(tcc_dtype_t dt, tcc_redop_t op, int nsrc, size_t count, int mode,
                     enum placement placement, double premul) {
  size_t esize = tcc_dtype_size(dt);
  void *bufs[5] = {0};
  for (int s = 0; s < nsrc; s++) {
    bufs[s] = malloc(count ? count * esize : 1); /* exact size: ASan flags any overrun */
    fill_random(dt, bufs[s], count, mode);
  }
  const void *srcs[5];
  for (int s = 0; s < nsrc; s++) {
    int aliased = placement == ALIASED_SOURCES || placement == ALIASED_SOURCES_IN_PLACE;
    srcs[s] = bufs[aliased ? s / 2 * 2 : s];
  }

  /* The expectation is computed before the call can overwrite a source. */
  double *want_value = malloc((count + 1) * sizeof *want_value);
  uint64_t *want_bits = malloc((count + 1) * sizeof *want_bits);
  for (size_t i = 0; i < count; i++) {
    if (is_float_dtype(dt)) want_value[i] = ref_float(dt, srcs, nsrc, i, op, premul);
    else want_bits[i] = ref_int(dt, srcs, nsrc, i, op);
  }

  unsigned char *guarded = NULL;
  void *dst;
  switch (placement) {
    case IN_PLACE_FIRST: case ALIASED_SOURCES_IN_PLACE: dst = (void *)srcs[0]; break;
    case IN_PLACE_LAST: dst = (void *)srcs[nsrc - 1]; break;
    case IN_PLACE_MIDDLE: dst = (void *)srcs[nsrc / 2]; break;
    default:
      guarded = malloc((count + 2 * GUARD_ELEMS) * esize);
      memset(guarded, GUARD_BYTE, (count + 2 * GUARD_ELEMS) * esize);
      dst = guarded + GUARD_ELEMS * esize;
      break;
  }

  tcc__reduce_n(dst, srcs, nsrc, count, dt, op, premul);
  cases_run++;

  long bad = 0;
  for (size_t i = 0; i < count && bad < 3; i++) {
    if (is_float_dtype(dt)) {
      double got = float_elem(dt, dst, i), want = want_value[i];
      int ok = isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want));
      if (!ok) bad++;
      CHECK(ok, "%s %s nsrc=%d count=%zu mode=%d %s premul=%g: [%zu] got %.17g want %.17g",
            tcc_dtype_name(dt), tcc_redop_name(op), nsrc, count, mode,
            placement_names[placement], premul, i, got, want);
    } else {
      uint64_t got = elem_bits(dt, dst, i);
      if (got != want_bits[i]) bad++;
      CHECK(got == want_bits[i],
            "%s %s nsrc=%d count=%zu mode=%d %s: [%zu] got 0x%llx want 0x%llx",
            tcc_dtype_name(dt), tcc_redop_name(op), nsrc, count, mode,
            placement_names[placement], i, (unsigned long long)got,
            (unsigned long long)want_bits[i]);
    }
  }
  if (guarded != NULL) {
    size_t guard_bytes = GUARD_ELEMS * esize;
    int intact = 1;
    for (size_t b = 0; b < guard_bytes; b++)
      intact &= guarded[b] == GUARD_BYTE && guarded[guard_bytes + count * esize + b] == GUARD_BYTE;
    CHECK(intact, "%s %s nsrc=%d count=%zu: wrote outside dst", tcc_dtype_name(dt),
          tcc_redop_name(op), nsrc, count);
    free(guarded);
  }
  free(want_value);
  free(want_bits);
  for (int s = 0; s < nsrc; s++) free(bufs[s]);
}

static void test_matrix(void) {
  static const size_t sizes[] = {0, 1, 7, 255, 256, 257, 513, 1000, 4099};
  static const double premuls[] = {0.5, -1.25, 3.0, 0.1, 1.0 / 3.0};
  int premul_index = 0;
  for (int dt = 0; dt < TCC_DTYPE_COUNT; dt++) {
    for (int op = 0; op < TCC_REDOP_COUNT; op++) {
      if (tcc_redop_supported((tcc_dtype_t)dt, (tcc_redop_t)op) != TCC_OK) continue;
      for (int nsrc = 1; nsrc <= 5; nsrc++) {
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
          for (int mode = 0; mode < MODE_COUNT; mode++) {
            for (int pl = 0; pl < PLACEMENT_COUNT; pl++) {
              if (nsrc == 1 && pl >= ALIASED_SOURCES) continue;
              double premul = premuls[premul_index++ % 5];
              run_case((tcc_dtype_t)dt, (tcc_redop_t)op, nsrc, sizes[si], mode,
                       (enum placement)pl, premul);
            }
          }
        }
      }
    }
  }
}

/* ---- targeted cases ------------------------------------------------------------ */

/* Reduces SPREAD copies of one scalar per source into out_scalar, and
 * checks that every element has the same bits (vector body and scalar
 * tail alike, NaN payloads included). */
#define SPREAD 1031 /* two full blocks and a tail */

static void reduce_spread(tcc_dtype_t dt, tcc_redop_t op, int nsrc, const void *scalars,
                          double premul, void *out_scalar) {
  size_t esize = tcc_dtype_size(dt);
  void *bufs[8];
  const void *srcs[8];
  for (int s = 0; s < nsrc; s++) {
    bufs[s] = malloc(SPREAD * esize);
    for (size_t i = 0; i < SPREAD; i++)
      memcpy((char *)bufs[s] + i * esize, (const char *)scalars + s * esize, esize);
    srcs[s] = bufs[s];
  }
  unsigned char *dst = malloc(SPREAD * esize);
  tcc__reduce_n(dst, srcs, nsrc, SPREAD, dt, op, premul);
  int uniform = 1;
  for (size_t i = 1; i < SPREAD; i++) uniform &= memcmp(dst, dst + i * esize, esize) == 0;
  CHECK(uniform, "%s %s: elements of identical inputs differ", tcc_dtype_name(dt),
        tcc_redop_name(op));
  memcpy(out_scalar, dst, esize);
  free(dst);
  for (int s = 0; s < nsrc; s++) free(bufs[s]);
}

static float reduce_f32(tcc_redop_t op, int nsrc, const float *in, double premul) {
  float out;
  reduce_spread(TCC_FLOAT32, op, nsrc, in, premul, &out);
  return out;
}

static void test_float_order(void) {
  /* float32 is a left fold: (1e8 + 1) rounds back to 1e8. */
  float a[3] = {1e8f, 1.0f, -1e8f};
  float b[3] = {1e8f, -1e8f, 1.0f};
  CHECK(reduce_f32(TCC_SUM, 3, a, 0) == 0.0f, "left fold {1e8,1,-1e8}");
  CHECK(reduce_f32(TCC_SUM, 3, b, 0) == 1.0f, "left fold {1e8,-1e8,1}");
  float p[3] = {1, 2, 3};
  CHECK(reduce_f32(TCC_PREMUL_SUM, 3, p, 0.5) == 3.0f, "premul 0.5 of 1+2+3");
  CHECK(reduce_f32(TCC_AVG, 3, p, 0) == 2.0f, "avg of 1,2,3");
  double d[2] = {1, 2}, d_out;
  reduce_spread(TCC_FLOAT64, TCC_PREMUL_SUM, 2, d, 0.1, &d_out);
  CHECK(d_out == 1 * 0.1 + 2 * 0.1, "f64 premul 0.1: %.17g", d_out);
}

static void test_nan_propagation(void) {
  float with_nan[3][3] = {{NAN, 1, 3}, {1, NAN, 3}, {1, 3, NAN}};
  for (int k = 0; k < 3; k++) {
    CHECK(isnan(reduce_f32(TCC_MIN, 3, with_nan[k], 0)), "f32 min NaN at %d", k);
    CHECK(isnan(reduce_f32(TCC_MAX, 3, with_nan[k], 0)), "f32 max NaN at %d", k);
  }
  float plain[3] = {2, -1, 3};
  CHECK(reduce_f32(TCC_MIN, 3, plain, 0) == -1.0f, "f32 min");
  CHECK(reduce_f32(TCC_MAX, 3, plain, 0) == 3.0f, "f32 max");
  double d[2] = {1, NAN}, d_out;
  reduce_spread(TCC_FLOAT64, TCC_MIN, 2, d, 0, &d_out);
  CHECK(isnan(d_out), "f64 min NaN");
  uint16_t h[2] = {0x3C00, 0x7E00}, h_out; /* 1.0, NaN */
  reduce_spread(TCC_FLOAT16, TCC_MAX, 2, h, 0, &h_out);
  CHECK(isnan(half_value(h_out)), "f16 max NaN: 0x%04x", h_out);
  uint16_t b[2] = {0x7FC0, 0x3F80}, b_out; /* NaN, 1.0 */
  reduce_spread(TCC_BFLOAT16, TCC_MIN, 2, b, 0, &b_out);
  CHECK(isnan(bf16_value(b_out)), "bf16 min NaN: 0x%04x", b_out);
}

static void test_half_rounding(void) {
  uint16_t out;
  /* Accumulated in float32 and rounded once: 2048+1+1 = 2050 (spacing 2
   * there); rounding after each add would give 2048. */
  uint16_t h[3] = {0x6800, 0x3C00, 0x3C00};
  reduce_spread(TCC_FLOAT16, TCC_SUM, 3, h, 0, &out);
  CHECK(half_value(out) == 2050.0, "f16 round once: %g", half_value(out));
  uint16_t b[3] = {0x4380, 0x3F80, 0x3F80}; /* 256, 1, 1 */
  reduce_spread(TCC_BFLOAT16, TCC_SUM, 3, b, 0, &out);
  CHECK(bf16_value(out) == 258.0, "bf16 round once: %g", bf16_value(out));
  /* 2048 + 1 is a tie between 2048 and 2050: the even one wins. */
  reduce_spread(TCC_FLOAT16, TCC_SUM, 2, h, 0, &out);
  CHECK(half_value(out) == 2048.0, "f16 tie to even: %g", half_value(out));
  /* Overflow: 65504 + 16 = 65520 is the tie with 65536, which is inf. */
  uint16_t big[2] = {0x7BFF, 0x4C00}; /* 65504, 16 */
  reduce_spread(TCC_FLOAT16, TCC_SUM, 2, big, 0, &out);
  CHECK(out == 0x7C00, "65504+16 -> inf: 0x%04x", out);
  uint16_t under[2] = {0x7BFF, 0x4B80}; /* 65504, 15 */
  reduce_spread(TCC_FLOAT16, TCC_SUM, 2, under, 0, &out);
  CHECK(out == 0x7BFF, "65504+15 -> 65504: 0x%04x", out);
  uint16_t tiny[2] = {0x0001, 0x0001}; /* 2^-24 twice */
  reduce_spread(TCC_FLOAT16, TCC_SUM, 2, tiny, 0, &out);
  CHECK(out == 0x0002, "subnormal sum: 0x%04x", out);
  uint16_t avg[2] = {0x0001, 0x0000}; /* 2^-25 is a tie with 0: even */
  reduce_spread(TCC_FLOAT16, TCC_AVG, 2, avg, 0, &out);
  CHECK(out == 0x0000, "2^-25 -> 0: 0x%04x", out);
}

/* PREMUL_SUM of 1.0 by a factor turns any float32 into the value to round,
 * which reaches the float32 -> half / bfloat16 conversion with exact
 * inputs: boundaries, ties and NaN payloads. */
static void test_conversion_boundaries(void) {
  static const uint32_t floats[] = {
      0x477FEFFF, 0x477FF000, 0x477FE000, 0x47800000, /* around half max / inf */
      0x33000000, 0x33000001, 0x32FFFFFF, 0x33C00000, /* around 2^-25 */
      0x387FFFFF, 0x38800000, 0x387FC000, 0x387FE000, /* subnormal/normal edge */
      0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, /* bf16 ties */
      0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x00000001,
      0x7F800000, 0xFF800000, 0x80000000, 0x00000000,
      /* NaNs: signalling, and payloads whose rounding increment would carry */
      0x7FA00000, 0xFFC00001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7F80FFFF,
  };
  for (size_t k = 0; k < sizeof floats / sizeof floats[0]; k++) {
    float factor;
    memcpy(&factor, &floats[k], sizeof factor);
    uint16_t one_half = 0x3C00, one_bf16 = 0x3F80, out;
    reduce_spread(TCC_FLOAT16, TCC_PREMUL_SUM, 1, &one_half, factor, &out);
    double want = round_half(factor), got = half_value(out);
    CHECK(isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want)),
          "f16 of float 0x%08x: got %.17g want %.17g", floats[k], got, want);
    reduce_spread(TCC_BFLOAT16, TCC_PREMUL_SUM, 1, &one_bf16, factor, &out);
    want = round_bf16(factor);
    got = bf16_value(out);
    CHECK(isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want)),
          "bf16 of float 0x%08x: got %.17g want %.17g", floats[k], got, want);
  }
}

/* Every half / bfloat16 pattern survives a one-source sum unchanged (a
 * NaN made quiet, its sign and payload kept, as IEEE 754 conversions do),
 * and random patterns times random factors round like the reference. */
static void test_conversion_sweep(void) {
  static uint16_t all[65536], out[65536];
  for (unsigned i = 0; i < 65536; i++) all[i] = (uint16_t)i;
  const void *srcs[1] = {all};
  for (int dt = TCC_FLOAT16; dt <= TCC_BFLOAT16; dt++) {
    tcc__reduce_n(out, srcs, 1, 65536, (tcc_dtype_t)dt, TCC_SUM, 0);
    long bad = 0;
    const uint16_t quiet_bit = dt == TCC_FLOAT16 ? 0x0200 : 0x0040; /* the mantissa's top bit */
    for (unsigned i = 0; i < 65536; i++) {
      double in = float_elem((tcc_dtype_t)dt, all, i);
      int ok = out[i] == (isnan(in) ? all[i] | quiet_bit : all[i]);
      if (!ok && bad++ < 3)
        CHECK(ok, "%s identity 0x%04x -> 0x%04x", tcc_dtype_name(dt), i, out[i]);
    }
  }
  for (int round = 0; round < 64; round++) {
    for (unsigned i = 0; i < 4099; i++) all[i] = (uint16_t)rng_next();
    /* Factors over a wide exponent range, so products land everywhere
     * from the subnormals to past the largest finite value. */
    uint32_t factor_bits = (uint32_t)((rng_next() & 0x807FFFFFu) | ((100u + rng_below(60)) << 23));
    float factor;
    memcpy(&factor, &factor_bits, sizeof factor);
    for (int dt = TCC_FLOAT16; dt <= TCC_BFLOAT16; dt++) {
      tcc__reduce_n(out, srcs, 1, 4099, (tcc_dtype_t)dt, TCC_PREMUL_SUM, factor);
      long bad = 0;
      for (unsigned i = 0; i < 4099 && bad < 3; i++) {
        double want = ref_float((tcc_dtype_t)dt, srcs, 1, i, TCC_PREMUL_SUM, factor);
        double got = float_elem((tcc_dtype_t)dt, out, i);
        int ok = isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want));
        if (!ok) bad++;
        CHECK(ok, "%s 0x%04x * %.9g: got %.17g want %.17g", tcc_dtype_name(dt), all[i],
              (double)factor, got, want);
      }
    }
  }
}

/* A signalling NaN alone among finite values, at every position of two
 * vector steps: the vector kernels look for NaNs per step, and one in any
 * lane must come back quiet with its payload while its neighbours stay
 * exact. (The sweep above has NaNs only in runs, never one alone.) */
static void test_lone_nan(void) {
  for (int dt = TCC_FLOAT16; dt <= TCC_BFLOAT16; dt++) {
    const uint16_t one = dt == TCC_FLOAT16 ? 0x3C00 : 0x3F80;
    const uint16_t signalling = dt == TCC_FLOAT16 ? 0x7C01 : 0x7F81;
    const uint16_t quiet = dt == TCC_FLOAT16 ? 0x7E01 : 0x7FC1;
    for (int at = 0; at < 32; at++) {
      uint16_t in[32], out[32];
      for (int i = 0; i < 32; i++) in[i] = i == at ? signalling : one;
      const void *srcs[1] = {in};
      tcc__reduce_n(out, srcs, 1, 32, (tcc_dtype_t)dt, TCC_SUM, 0);
      for (int i = 0; i < 32; i++)
        CHECK(out[i] == (i == at ? quiet : one), "%s NaN alone at %d: element %d is 0x%04x",
              tcc_dtype_name(dt), at, i, out[i]);
    }
  }
}

/* tcc__half_widen / tcc__half_narrow (the float32 phases of a half
 * allreduce): every pattern widens to its exact value, and floats from
 * every range, the boundaries above, NaNs and infinities round like the
 * reference; lengths that leave a tail after the vector loop. */
static void test_half_arrays(void) {
  static uint16_t all[65536], back[65536];
  static float wide[65536];
  for (unsigned i = 0; i < 65536; i++) all[i] = (uint16_t)i;
  for (int dt = TCC_FLOAT16; dt <= TCC_BFLOAT16; dt++) {
    tcc__half_widen(wide, all, 65535, (tcc_dtype_t)dt); /* odd: a tail */
    long bad = 0;
    for (unsigned i = 0; i < 65535 && bad < 3; i++) {
      const double want = float_elem((tcc_dtype_t)dt, all, i), got = wide[i];
      const int ok = isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want));
      if (!ok) bad++;
      CHECK(ok, "%s widen 0x%04x: got %.17g want %.17g", tcc_dtype_name(dt), i, got, want);
    }
    tcc__half_narrow(back, wide, 65535, (tcc_dtype_t)dt);
    for (unsigned i = 0; i < 65535 && bad < 3; i++) {
      const int ok = isnan(wide[i]) ? isnan(float_elem((tcc_dtype_t)dt, back, i)) : back[i] == all[i];
      if (!ok) bad++;
      CHECK(ok, "%s widen+narrow 0x%04x -> 0x%04x", tcc_dtype_name(dt), i, back[i]);
    }
  }
  for (int round = 0; round < 16; round++) {
    const size_t n = 4096 + (size_t)rng_below(31);
    for (size_t i = 0; i < n; i++) {
      /* exponents from below the half subnormals to past float16's range */
      uint32_t bits = (uint32_t)((rng_next() & 0x807FFFFFu) | ((90u + rng_below(60)) << 23));
      if (i % 97 == 0) bits = (uint32_t)rng_next(); /* anything: NaNs, infinities, huge */
      memcpy(&wide[i], &bits, sizeof bits);
    }
    for (int dt = TCC_FLOAT16; dt <= TCC_BFLOAT16; dt++) {
      tcc__half_narrow(back, wide, n, (tcc_dtype_t)dt);
      long bad = 0;
      for (size_t i = 0; i < n && bad < 3; i++) {
        const double want = dt == TCC_FLOAT16 ? round_half(wide[i]) : round_bf16(wide[i]);
        const double got = float_elem((tcc_dtype_t)dt, back, i);
        const int ok = isnan(want) ? isnan(got) : (got == want && !signbit(got) == !signbit(want));
        if (!ok) bad++;
        CHECK(ok, "%s narrow %.9g: got %.17g want %.17g", tcc_dtype_name(dt), (double)wide[i], got, want);
      }
    }
  }
}

static void test_integer_wrap(void) {
  int8_t i8[2] = {100, 100}, i8_out;
  reduce_spread(TCC_INT8, TCC_SUM, 2, i8, 0, &i8_out);
  CHECK(i8_out == -56, "int8 100+100: %d", i8_out);
  reduce_spread(TCC_INT8, TCC_AVG, 2, i8, 0, &i8_out);
  CHECK(i8_out == -28, "int8 avg of wrapped sum: %d", i8_out);
  uint8_t u8[2] = {200, 100}, u8_out;
  reduce_spread(TCC_UINT8, TCC_SUM, 2, u8, 0, &u8_out);
  CHECK(u8_out == 44, "uint8 200+100: %u", u8_out);
  uint8_t u8max[2] = {255, 255};
  reduce_spread(TCC_UINT8, TCC_AVG, 2, u8max, 0, &u8_out);
  CHECK(u8_out == 127, "uint8 avg 255,255 (wrapped 254): %u", u8_out);
  int16_t i16[2] = {300, 300}, i16_out;
  reduce_spread(TCC_INT16, TCC_PRODUCT, 2, i16, 0, &i16_out);
  CHECK(i16_out == 24464, "int16 300*300: %d", i16_out);
  int16_t i16max[2] = {-32768, -32768};
  reduce_spread(TCC_INT16, TCC_PRODUCT, 2, i16max, 0, &i16_out);
  CHECK(i16_out == 0, "int16 -32768^2: %d", i16_out);
  int32_t i32[2] = {INT32_MAX, 1}, i32_out;
  reduce_spread(TCC_INT32, TCC_SUM, 2, i32, 0, &i32_out);
  CHECK(i32_out == INT32_MIN, "int32 max+1: %d", i32_out);
  int32_t i32sq[2] = {65536, 65536};
  reduce_spread(TCC_INT32, TCC_PRODUCT, 2, i32sq, 0, &i32_out);
  CHECK(i32_out == 0, "int32 2^16*2^16: %d", i32_out);
  int64_t i64[2] = {INT64_MAX, 1}, i64_out;
  reduce_spread(TCC_INT64, TCC_SUM, 2, i64, 0, &i64_out);
  CHECK(i64_out == INT64_MIN, "int64 max+1");
  int64_t i64neg[2] = {INT64_MIN, -1};
  reduce_spread(TCC_INT64, TCC_PRODUCT, 2, i64neg, 0, &i64_out);
  CHECK(i64_out == INT64_MIN, "int64 min*-1");
  reduce_spread(TCC_INT64, TCC_AVG, 2, i64neg, 0, &i64_out); /* wrapped to INT64_MAX */
  CHECK(i64_out == INT64_MAX / 2, "int64 avg of min,-1: %lld", (long long)i64_out);
  /* AVG truncates toward zero, also for negatives. */
  int32_t neg[3] = {-3, -4, 0};
  reduce_spread(TCC_INT32, TCC_AVG, 2, neg, 0, &i32_out);
  CHECK(i32_out == -3, "int32 avg -3,-4: %d", i32_out);
  int32_t neg3[3] = {-7, 0, 0};
  reduce_spread(TCC_INT32, TCC_AVG, 3, neg3, 0, &i32_out);
  CHECK(i32_out == -2, "int32 avg -7,0,0: %d", i32_out);
}

static void test_bool_semantics(void) {
  /* Columns: (0,0) (0,1) (1,0) (1,1) and (2,1) where 2 is also true. */
  static const uint8_t a[5] = {0, 0, 1, 1, 2}, b[5] = {0, 1, 0, 1, 1};
  static const struct { tcc_redop_t op; uint8_t want[5]; } table[] = {
      {TCC_SUM, {0, 1, 1, 1, 1}},  {TCC_PRODUCT, {0, 0, 0, 1, 1}}, {TCC_MIN, {0, 0, 0, 1, 1}},
      {TCC_MAX, {0, 1, 1, 1, 1}},  {TCC_BAND, {0, 0, 0, 1, 1}},    {TCC_BOR, {0, 1, 1, 1, 1}},
      {TCC_BXOR, {0, 1, 1, 0, 0}},
  };
  const void *srcs[2] = {a, b};
  for (size_t t = 0; t < sizeof table / sizeof table[0]; t++) {
    uint8_t out[5];
    tcc__reduce_n(out, srcs, 2, 5, TCC_BOOL, table[t].op, 0);
    CHECK(memcmp(out, table[t].want, 5) == 0, "bool %s: %d%d%d%d%d", tcc_redop_name(table[t].op),
          out[0], out[1], out[2], out[3], out[4]);
  }
}

static void test_empty_and_unsupported(void) {
  /* Zero elements: no pointer is touched, NULL ones included. */
  const void *null_srcs[2] = {NULL, NULL};
  tcc__reduce_n(NULL, null_srcs, 2, 0, TCC_FLOAT32, TCC_SUM, 0);
  tcc__reduce_n(NULL, null_srcs, 2, 0, TCC_BFLOAT16, TCC_MAX, 0);
  /* Combinations the caller should have rejected leave dst alone. */
  float dst = 7, one = 1;
  const void *one_src[1] = {&one};
  tcc__reduce_n(&dst, one_src, 1, 1, TCC_FLOAT32, TCC_BXOR, 0);
  CHECK(dst == 7, "float32 bxor wrote %g", dst);
  tcc__reduce_n(&dst, one_src, 1, 1, (tcc_dtype_t)99, TCC_SUM, 0);
  CHECK(dst == 7, "dtype 99 wrote %g", dst);
  tcc__reduce_n(&dst, one_src, 0, 1, TCC_FLOAT32, TCC_SUM, 0);
  CHECK(dst == 7, "nsrc 0 wrote %g", dst);
}

/* ---- support matrix and names ---------------------------------------------------- */

static void test_support_matrix(void) {
  /* Columns in tcc_redop_t order: sum avg product min max band bor bxor premul_sum */
  static const char *const expected[TCC_DTYPE_COUNT] = {
      [TCC_FLOAT32] = "111110001", [TCC_FLOAT64] = "111110001", [TCC_FLOAT16] = "111110001",
      [TCC_BFLOAT16] = "111110001", [TCC_INT8] = "111111110",   [TCC_INT16] = "111111110",
      [TCC_INT32] = "111111110",   [TCC_INT64] = "111111110",   [TCC_UINT8] = "111111110",
      [TCC_BOOL] = "101111110",
  };
  for (int dt = 0; dt < TCC_DTYPE_COUNT; dt++) {
    for (int op = 0; op < TCC_REDOP_COUNT; op++) {
      tcc_result_t want = expected[dt][op] == '1' ? TCC_OK : TCC_ERR_UNSUPPORTED;
      tcc_result_t got = tcc_redop_supported((tcc_dtype_t)dt, (tcc_redop_t)op);
      CHECK(got == want, "supported(%s, %s) = %d", tcc_dtype_name(dt), tcc_redop_name(op), got);
    }
  }
  CHECK(tcc_redop_supported(TCC_DTYPE_COUNT, TCC_SUM) == TCC_ERR_UNSUPPORTED, "bad dtype");
  CHECK(tcc_redop_supported((tcc_dtype_t)-1, TCC_SUM) == TCC_ERR_UNSUPPORTED, "negative dtype");
  CHECK(tcc_redop_supported(TCC_FLOAT32, TCC_REDOP_COUNT) == TCC_ERR_UNSUPPORTED, "bad op");
  CHECK(tcc_redop_supported(TCC_FLOAT32, (tcc_redop_t)99) == TCC_ERR_UNSUPPORTED, "op 99");
}

static void test_names(void) {
  static const char *const dtype_names[TCC_DTYPE_COUNT] = {
      "float32", "float64", "float16", "bfloat16", "int8",
      "int16",   "int32",   "int64",   "uint8",    "bool"};
  static const size_t dtype_sizes[TCC_DTYPE_COUNT] = {4, 8, 2, 2, 1, 2, 4, 8, 1, 1};
  static const char *const op_names[TCC_REDOP_COUNT] = {
      "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"};
  for (int dt = 0; dt < TCC_DTYPE_COUNT; dt++) {
    CHECK(strcmp(tcc_dtype_name((tcc_dtype_t)dt), dtype_names[dt]) == 0, "dtype %d: %s", dt,
          tcc_dtype_name((tcc_dtype_t)dt));
    CHECK(tcc_dtype_size((tcc_dtype_t)dt) == dtype_sizes[dt], "size of %s", dtype_names[dt]);
  }
  for (int op = 0; op < TCC_REDOP_COUNT; op++)
    CHECK(strcmp(tcc_redop_name((tcc_redop_t)op), op_names[op]) == 0, "op %d: %s", op,
          tcc_redop_name((tcc_redop_t)op));
  CHECK(strcmp(tcc_dtype_name(TCC_DTYPE_COUNT), "unknown") == 0, "bad dtype name");
  CHECK(strcmp(tcc_dtype_name((tcc_dtype_t)-3), "unknown") == 0, "negative dtype name");
  CHECK(tcc_dtype_size((tcc_dtype_t)77) == 0, "bad dtype size");
  CHECK(strcmp(tcc_redop_name((tcc_redop_t)42), "unknown") == 0, "bad op name");
  for (int r = TCC_OK; r <= TCC_ERR_INPROGRESS; r++) {
    const char *s = tcc_result_string((tcc_result_t)r);
    CHECK(s != NULL && s[0] != '\0' && strcmp(s, "unknown") != 0, "result %d: %s", r, s);
    for (int other = TCC_OK; other < r; other++)
      CHECK(strcmp(s, tcc_result_string((tcc_result_t)other)) != 0, "results %d/%d share", r,
            other);
  }
  CHECK(strcmp(tcc_result_string((tcc_result_t)1234), "unknown") == 0, "bad result");
}

/* ---- main ---------------------------------------------------------------------- */

/* Runs this binary again with the portable kernels forced. */
static int rerun_with_generic_kernels(char **argv) {
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    setenv("TCCOMM_REDUCE_ISA", "generic", 1);
    execv("/proc/self/exe", argv);
    _exit(127);
  }
  int status = 0;
  if (waitpid(child, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

int main(int argc, char **argv) {
  (void)argc;
  const char *forced_isa = getenv("TCCOMM_REDUCE_ISA");
  test_names();
  test_support_matrix();
  test_empty_and_unsupported();
  test_float_order();
  test_nan_propagation();
  test_half_rounding();
  test_conversion_boundaries();
  test_conversion_sweep();
  test_lone_nan();
  test_half_arrays();
  test_integer_wrap();
  test_bool_semantics();
  test_matrix();
  printf("test_reduce: %ld matrix cases, kernels=%s, %ld failures\n", cases_run,
         forced_isa ? forced_isa : "auto", check_failures);
  if (forced_isa == NULL) {
    int child_status = rerun_with_generic_kernels(argv);
    CHECK(child_status == 0, "run with TCCOMM_REDUCE_ISA=generic exited %d", child_status);
  }
  CHECK_DONE();
}
