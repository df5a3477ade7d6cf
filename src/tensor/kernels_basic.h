/* Basic memory kernels every backend provides. n counts float32 elements. */
#ifndef DDP__TENSOR_KERNELS_BASIC_H
#define DDP__TENSOR_KERNELS_BASIC_H

#include <stdbool.h>
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
  /* x /= d: the DDP wrapper's average, a correctly rounded quotient (not
   * x * (1/d), which rounds twice) as parallel/hooks.c's host loop */
  void (*div)(float *x, float d, int64_t n);
  /* dst = float16 (bf16: bfloat16) of src / d, rounded to nearest even with
   * the bits of ddp_float_to_half / ddp_float_to_bf16 (NaN payloads too):
   * the compression hooks' send side */
  void (*to_half)(uint16_t *dst, const float *src, float d, int64_t n, bool bf16);
  /* dst = the float of each float16 (bf16: bfloat16), as ddp_half_to_float /
   * ddp_bf16_to_float: the compression hooks' receive side */
  void (*from_half)(float *dst, const uint16_t *src, int64_t n, bool bf16);
  /* dst = src rounded to float16 (bf16: bfloat16) values, kept as float32
   * (to_half then from_half in one pass; dst may be src): autocast's
   * rounding of operands, outputs and gradients (tensor/autocast.c) */
  void (*round_low)(float *dst, const float *src, int64_t n, bool bf16);
  /* Autocast's GradScaler on a device (optim/grad_scaler.c): x *= inv
   * (left as it is when inv is 1, as PyTorch's kernel), and whether any
   * element was inf/NaN before, in one pass over x; the answer is read on
   * the host (waits for the device). True when the device failed (the
   * answer is unknown: no step may use x), the failure pending for the
   * next synchronize. */
  bool (*unscale_check)(float *x, float inv, int64_t n);
} ddp__basic_kernels;

extern const ddp__basic_kernels ddp__cpu_basic_kernels;

#endif
