/* Reduction kernels shared by every backend: dst op= src for the six comm
 * dtypes, and the float16 / bfloat16 <-> float32 conversions they compute
 * through. Loops are plain and branch-free so that GCC vectorises them
 * (-O2 -fvect-cost-model=dynamic -march=native). */
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "comm/backend.h"

/* ---- float16 / bfloat16 conversions ---------------------------------------
 * Bit manipulation after Fabian Giesen's half conversions: exact widening
 * (subnormals included, via one multiply by 2^112), narrowing with round to
 * nearest even; overflow gives infinity; NaNs stay NaN with their sign and
 * top payload bits, quieted (bit for bit what F16C's vcvtph2ps / vcvtps2ph
 * do; the tests compare). */

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float f32_from(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  /* Exponent rebias by scaling: (em << 13) read as a float is the half value
   * times 2^-112, also for subnormals (they become float subnormals). */
  uint32_t scaled = f32_bits(f32_from(em << 13) * 0x1p112f);
  /* Inf stays Inf; a NaN keeps its payload and becomes quiet. */
  uint32_t special = (em << 13) | 0x7f800000u | (em > 0x7c00u ? 0x400000u : 0u);
  uint32_t bits = em >= 0x7c00u ? special : scaled;
  return f32_from(bits | sign);
}

static inline uint16_t float_to_half(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= 0x47800000u) { /* >= 65536 (rounds to Inf), Inf or NaN */
    uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);
    out = u > 0x7f800000u ? nan : 0x7c00u;
  } else if (u < 0x38800000u) { /* below the smallest normal half, 2^-14 */
    /* Adding 0.5 makes the FPU round the mantissa (to nearest even) at the
     * subnormal half's last bit; the low bits are then the result. */
    const uint32_t magic = (127u - 15u + 23u - 10u + 1u) << 23;
    out = f32_bits(f32_from(u) + f32_from(magic)) - magic;
  } else {
    uint32_t mant_odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd;
    out = u >> 13; /* a carry into the exponent rounds up to Inf correctly */
  }
  return (uint16_t)(out | (sign >> 16));
}

static inline float bf16_to_float(uint16_t h) { return f32_from((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

float ddp__half_to_float(uint16_t h) { return half_to_float(h); }
uint16_t ddp__float_to_half(float f) { return float_to_half(f); }
float ddp__bf16_to_float(uint16_t h) { return bf16_to_float(h); }
uint16_t ddp__float_to_bf16(float f) { return float_to_bf16(f); }

/* ---- Elementwise ops -------------------------------------------------------
 * MIN and MAX propagate NaN (torch.minimum / maximum): the result is NaN when
 * either input is. Integer SUM and PRODUCT wrap around (two's complement), as
 * in PyTorch, computed unsigned so overflow is defined. */

#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
#define OP_FMIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define OP_FMAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define OP_IMIN(a, b) ((a) < (b) ? (a) : (b))
#define OP_IMAX(a, b) ((a) > (b) ? (a) : (b))

/* dst may alias a or b exactly (never partially): each element is read
 * before it is written. */
#define DEFINE_LOOP(name, T, OP)                                               \
  static void name(T *dst, const T *a, const T *b, size_t n) {                 \
    for (size_t i = 0; i < n; i++) {                                           \
      T x = a[i], y = b[i];                                                    \
      dst[i] = OP(x, y);                                                       \
    }                                                                          \
  }

#define DEFINE_WRAP_LOOP(name, T, U, OP)                                       \
  static void name(T *dst, const T *a, const T *b, size_t n) {                 \
    for (size_t i = 0; i < n; i++) dst[i] = (T)OP((U)a[i], (U)b[i]);           \
  }

#define DEFINE_16_LOOP(name, TO_F, FROM_F, OP)                                 \
  static void name(uint16_t *dst, const uint16_t *a, const uint16_t *b,       \
                   size_t n) {                                                 \
    for (size_t i = 0; i < n; i++) {                                           \
      float x = TO_F(a[i]), y = TO_F(b[i]);                                    \
      dst[i] = FROM_F(OP(x, y));                                               \
    }                                                                          \
  }

DEFINE_LOOP(f32_sum, float, OP_SUM)
DEFINE_LOOP(f32_prod, float, OP_PROD)
DEFINE_LOOP(f32_min, float, OP_FMIN)
DEFINE_LOOP(f32_max, float, OP_FMAX)
DEFINE_LOOP(f64_sum, double, OP_SUM)
DEFINE_LOOP(f64_prod, double, OP_PROD)
DEFINE_LOOP(f64_min, double, OP_FMIN)
DEFINE_LOOP(f64_max, double, OP_FMAX)
DEFINE_WRAP_LOOP(i32_sum, int32_t, uint32_t, OP_SUM)
DEFINE_WRAP_LOOP(i32_prod, int32_t, uint32_t, OP_PROD)
DEFINE_LOOP(i32_min, int32_t, OP_IMIN)
DEFINE_LOOP(i32_max, int32_t, OP_IMAX)
DEFINE_WRAP_LOOP(i64_sum, int64_t, uint64_t, OP_SUM)
DEFINE_WRAP_LOOP(i64_prod, int64_t, uint64_t, OP_PROD)
DEFINE_LOOP(i64_min, int64_t, OP_IMIN)
DEFINE_LOOP(i64_max, int64_t, OP_IMAX)
#if defined(__F16C__) && defined(__AVX__)
/* With F16C the conversions are instructions (bit-identical to the code
 * above: the tests compare them), 8 elements at a time; the tail goes
 * through the portable code. */
static inline __m256 v_sum(__m256 x, __m256 y) { return _mm256_add_ps(x, y); }
static inline __m256 v_prod(__m256 x, __m256 y) { return _mm256_mul_ps(x, y); }
/* min_ps(x, y) is x < y ? x : y, as OP_FMIN when x is not NaN; a NaN x wins. */
static inline __m256 v_min(__m256 x, __m256 y) {
  return _mm256_blendv_ps(_mm256_min_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
static inline __m256 v_max(__m256 x, __m256 y) {
  return _mm256_blendv_ps(_mm256_max_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#define DEFINE_F16C_LOOP(name, VOP, OP)                                        \
  static void name(uint16_t *dst, const uint16_t *a, const uint16_t *b,       \
                   size_t n) {                                                 \
    size_t i = 0;                                                              \
    for (; i + 8 <= n; i += 8) {                                               \
      __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));  \
      __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));  \
      _mm_storeu_si128((__m128i *)(dst + i),                                   \
                       _mm256_cvtps_ph(VOP(x, y), _MM_FROUND_TO_NEAREST_INT)); \
    }                                                                          \
    for (; i < n; i++) {                                                       \
      float x = half_to_float(a[i]), y = half_to_float(b[i]);                  \
      dst[i] = float_to_half(OP(x, y));                                        \
    }                                                                          \
  }
DEFINE_F16C_LOOP(f16_sum, v_sum, OP_SUM)
DEFINE_F16C_LOOP(f16_prod, v_prod, OP_PROD)
DEFINE_F16C_LOOP(f16_min, v_min, OP_FMIN)
DEFINE_F16C_LOOP(f16_max, v_max, OP_FMAX)
#else
DEFINE_16_LOOP(f16_sum, half_to_float, float_to_half, OP_SUM)
DEFINE_16_LOOP(f16_prod, half_to_float, float_to_half, OP_PROD)
DEFINE_16_LOOP(f16_min, half_to_float, float_to_half, OP_FMIN)
DEFINE_16_LOOP(f16_max, half_to_float, float_to_half, OP_FMAX)
#endif
DEFINE_16_LOOP(bf16_sum, bf16_to_float, float_to_bf16, OP_SUM)
DEFINE_16_LOOP(bf16_prod, bf16_to_float, float_to_bf16, OP_PROD)
DEFINE_16_LOOP(bf16_min, bf16_to_float, float_to_bf16, OP_FMIN)
DEFINE_16_LOOP(bf16_max, bf16_to_float, float_to_bf16, OP_FMAX)

typedef void (*pair_fn)(void *dst, const void *a, const void *b, size_t n);

/* [dtype][op]; AVG reduces as SUM. */
#define ROW(p)                                                                             \
  {(pair_fn)p##_sum, (pair_fn)p##_sum, (pair_fn)p##_min, (pair_fn)p##_max,                 \
   (pair_fn)p##_prod}
static const pair_fn pair_table[6][DDP_REDUCE_OP_COUNT] = {
    [DDP_FLOAT32] = ROW(f32), [DDP_FLOAT64] = ROW(f64),   [DDP_INT32] = ROW(i32),
    [DDP_INT64] = ROW(i64),   [DDP_FLOAT16] = ROW(f16),   [DDP_BFLOAT16] = ROW(bf16),
};

static pair_fn lookup(ddp_dtype dtype, ddp_reduce_op op) {
  DDP_ASSERT((unsigned)dtype < 6 && (unsigned)op < DDP_REDUCE_OP_COUNT);
  return pair_table[dtype][op];
}

void ddp__reduce_pair(void *dst, const void *a, const void *b, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op) {
  if (count) lookup(dtype, op)(dst, a, b, count);
}

void ddp__reduce_into(void *dst, const void *src, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op) {
  if (count) lookup(dtype, op)(dst, dst, src, count);
}

/* Division, not multiplication by 1/divisor, so that a sum of equal values
 * averages back to exactly that value. float16 / bfloat16 are rounded twice:
 * once when the sum was stored, once here. */
void ddp__reduce_scale(void *dst, size_t count, ddp_dtype dtype, int divisor) {
  DDP_ASSERT(divisor > 0);
  switch (dtype) {
  case DDP_FLOAT32: {
    float *d = dst, div = (float)divisor;
    for (size_t i = 0; i < count; i++) d[i] /= div;
    break;
  }
  case DDP_FLOAT64: {
    double *d = dst, div = (double)divisor;
    for (size_t i = 0; i < count; i++) d[i] /= div;
    break;
  }
  case DDP_FLOAT16: {
    uint16_t *d = dst;
    float div = (float)divisor;
    for (size_t i = 0; i < count; i++) d[i] = float_to_half(half_to_float(d[i]) / div);
    break;
  }
  case DDP_BFLOAT16: {
    uint16_t *d = dst;
    float div = (float)divisor;
    for (size_t i = 0; i < count; i++) d[i] = float_to_bf16(bf16_to_float(d[i]) / div);
    break;
  }
  default:
    DDP_ASSERT(!"ddp__reduce_scale on an integer dtype");
  }
}
