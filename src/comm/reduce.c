/* Reduction kernels shared by every backend: dst op= src for the six comm
 * dtypes; float16 and bfloat16 compute through tensor.h's conversions
 * (ddp_half_to_float and friends, inline). Loops are plain and branch-free
 * so that GCC vectorises them (-O2 -fvect-cost-model=dynamic -march=native). */
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "comm/backend.h"

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
      float x = ddp_half_to_float(a[i]), y = ddp_half_to_float(b[i]);                  \
      dst[i] = ddp_float_to_half(OP(x, y));                                        \
    }                                                                          \
  }
DEFINE_F16C_LOOP(f16_sum, v_sum, OP_SUM)
DEFINE_F16C_LOOP(f16_prod, v_prod, OP_PROD)
DEFINE_F16C_LOOP(f16_min, v_min, OP_FMIN)
DEFINE_F16C_LOOP(f16_max, v_max, OP_FMAX)
#else
DEFINE_16_LOOP(f16_sum, ddp_half_to_float, ddp_float_to_half, OP_SUM)
DEFINE_16_LOOP(f16_prod, ddp_half_to_float, ddp_float_to_half, OP_PROD)
DEFINE_16_LOOP(f16_min, ddp_half_to_float, ddp_float_to_half, OP_FMIN)
DEFINE_16_LOOP(f16_max, ddp_half_to_float, ddp_float_to_half, OP_FMAX)
#endif
DEFINE_16_LOOP(bf16_sum, ddp_bf16_to_float, ddp_float_to_bf16, OP_SUM)
DEFINE_16_LOOP(bf16_prod, ddp_bf16_to_float, ddp_float_to_bf16, OP_PROD)
DEFINE_16_LOOP(bf16_min, ddp_bf16_to_float, ddp_float_to_bf16, OP_FMIN)
DEFINE_16_LOOP(bf16_max, ddp_bf16_to_float, ddp_float_to_bf16, OP_FMAX)

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
    for (size_t i = 0; i < count; i++) d[i] = ddp_float_to_half(ddp_half_to_float(d[i]) / div);
    break;
  }
  case DDP_BFLOAT16: {
    uint16_t *d = dst;
    float div = (float)divisor;
    for (size_t i = 0; i < count; i++) d[i] = ddp_float_to_bf16(ddp_bf16_to_float(d[i]) / div);
    break;
  }
  default:
    DDP_ASSERT(!"ddp__reduce_scale on an integer dtype");
  }
}
