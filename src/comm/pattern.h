/* Element access by dtype and the closed-form value pattern that the
 * collectives' tests and `ddp-bench -c 1` fill buffers with and check
 * results against. Rank r contributes (r + 1) * (i % 7 + 1) to element i of
 * a reduction (PRODUCT: 2 where i % 3 == r % 3, else 1): small integers,
 * exact in every dtype at small world sizes. Header-only (static inline). */
#ifndef DDP__COMM_PATTERN_H
#define DDP__COMM_PATTERN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/tensor.h"

/* buf[i] = v, converted to dtype (float16 / bfloat16 rounded to nearest even). */
static inline void ddp__elem_set(void *buf, ddp_dtype dt, size_t i, double v) {
  switch (dt) {
    case DDP_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case DDP_FLOAT64: ((double *)buf)[i] = v; break;
    case DDP_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DDP_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case DDP_FLOAT16: ((uint16_t *)buf)[i] = ddp_float_to_half((float)v); break;
    case DDP_BFLOAT16: ((uint16_t *)buf)[i] = ddp_float_to_bf16((float)v); break;
    default: break;
  }
}

/* buf[i] as a double; NAN for a dtype collectives do not carry. */
static inline double ddp__elem_get(const void *buf, ddp_dtype dt, size_t i) {
  switch (dt) {
    case DDP_FLOAT32: return ((const float *)buf)[i];
    case DDP_FLOAT64: return ((const double *)buf)[i];
    case DDP_INT32: return ((const int32_t *)buf)[i];
    case DDP_INT64: return (double)((const int64_t *)buf)[i];
    case DDP_FLOAT16: return ddp_half_to_float(((const uint16_t *)buf)[i]);
    case DDP_BFLOAT16: return ddp_bf16_to_float(((const uint16_t *)buf)[i]);
    default: return NAN;
  }
}

/* Rank r's contribution to element i of a reduction with `op`. */
static inline double ddp__pattern_contrib(int r, size_t i, ddp_reduce_op op) {
  if (op == DDP_REDUCE_PRODUCT) return (i % 3) == (size_t)(r % 3) ? 2.0 : 1.0;
  return (double)(r + 1) * (double)(i % 7 + 1);
}

/* The reduction of ddp__pattern_contrib over ranks 0..P-1, in closed form. */
static inline double ddp__pattern_reduced(ddp_reduce_op op, int P, size_t i) {
  double k = (double)(i % 7 + 1);
  switch (op) {
    case DDP_REDUCE_SUM: return (double)P * (P + 1) / 2.0 * k;
    case DDP_REDUCE_AVG: return (double)(P + 1) / 2.0 * k;
    case DDP_REDUCE_MIN: return k;
    case DDP_REDUCE_MAX: return (double)P * k;
    case DDP_REDUCE_PRODUCT: {
      int m = (int)(i % 3);
      return ldexp(1.0, m < P ? (P - m + 2) / 3 : 0); /* ranks r < P with r % 3 == m */
    }
    default: return NAN;
  }
}

#endif /* DDP__COMM_PATTERN_H */
