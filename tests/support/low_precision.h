/* Bounds and checks for tests of bf16/fp16 results (the autocast tests on
 * the CPU and the GPU): float32's unit roundoff and gamma_k, the spacing of
 * a low dtype's values, rounding to it, and whether values are exact in it. */
#ifndef DDP_TESTS_SUPPORT_LOW_PRECISION_H
#define DDP_TESTS_SUPPORT_LOW_PRECISION_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "ddp/tensor.h"

static const double U32 = 0x1p-24; /* float32's unit roundoff */

/* k u / (1 - k u): the relative bound of a k-term float32 sum. */
static inline double gamma_k(int64_t k) { return (double)k * U32 / (1.0 - (double)k * U32); }

/* The spacing of `dtype` values at |v| (the larger neighbour's side). */
static inline double ulp_of(double v, ddp_dtype dtype) {
  const double a = fabs(v);
  int e = a > 0 ? ilogb(a) : -1000;
  if (dtype == DDP_BFLOAT16) return ldexp(1.0, (e < -126 ? -126 : e) - 7);
  if (dtype == DDP_FLOAT16) return ldexp(1.0, (e < -14 ? -14 : e) - 10);
  return ldexp(1.0, (e < -126 ? -126 : e) - 23);
}

/* v rounded to `dtype` (round to nearest even), as a float. */
static inline float round_to(float v, ddp_dtype dtype) {
  if (dtype == DDP_BFLOAT16) return ddp_bf16_to_float(ddp_float_to_bf16(v));
  if (dtype == DDP_FLOAT16) return ddp_half_to_float(ddp_float_to_half(v));
  return v;
}

/* Every one of the n values is exactly a `dtype` value. */
static inline bool exact_in(const float *v, int64_t n, ddp_dtype dtype) {
  for (int64_t i = 0; i < n; i++)
    if (round_to(v[i], dtype) != v[i]) return false;
  return true;
}

#endif
