/* Basic memory kernels every backend provides. n counts float32 elements. */
#ifndef DDP__TENSOR_KERNELS_BASIC_H
#define DDP__TENSOR_KERNELS_BASIC_H

#include <stdint.h>

typedef struct ddp__basic_kernels {
  void (*copy)(float *dst, const float *src, int64_t n);
  void (*fill)(float *dst, float value, int64_t n);
  /* y = a + b */
  void (*add)(float *y, const float *a, const float *b, int64_t n);
  /* y += alpha * x: gradient accumulation */
  void (*axpy)(float *y, float alpha, const float *x, int64_t n);
  /* sum of squares, in double (gradient-norm clipping) */
  double (*sum_squares)(const float *x, int64_t n);
  /* x *= alpha */
  void (*scale)(float *x, float alpha, int64_t n);
  /* y = a * b elementwise (y may be a or b) */
  void (*mul)(float *y, const float *a, const float *b, int64_t n);
} ddp__basic_kernels;

extern const ddp__basic_kernels ddp__cpu_basic_kernels;

#endif
