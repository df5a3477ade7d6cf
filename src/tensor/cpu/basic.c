/* CPU basic kernels: plain loops the compiler vectorises. */
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/kernels_basic.h"

static void cpu_copy(float *dst, const float *src, int64_t n) {
  memcpy(dst, src, (size_t)n * sizeof(float));
}

static void cpu_fill(float *dst, float value, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = value;
}

static void cpu_add(float *restrict y, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

static void cpu_axpy(float *restrict y, float alpha, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

static double cpu_sum_squares(const float *x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  return s;
}

static void cpu_scale(float *x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] *= alpha;
}

static void cpu_mul(float *y, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = a[i] * b[i];
}

static void cpu_div(float *x, float d, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] /= d;
}

/* Through tensor.h's buffer conversions (src/tensor/convert.c, the one
 * implementation, vectorised); with a divisor, a stack block at a time, so
 * that the quotient is rounded once to float32 and once to the 16-bit type
 * as before. */
static void cpu_to_half(uint16_t *restrict dst, const float *restrict src, float d, int64_t n,
                        bool bf16) {
  void (*convert)(uint16_t *, const float *, size_t) =
      bf16 ? ddp_convert_f32_to_bf16 : ddp_convert_f32_to_f16;
  if (d == 1.0f) {
    convert(dst, src, (size_t)n);
    return;
  }
  float block[512];
  for (int64_t i = 0; i < n; i += 512) {
    const int64_t len = n - i < 512 ? n - i : 512;
    for (int64_t j = 0; j < len; j++) block[j] = src[i + j] / d;
    convert(dst + i, block, (size_t)len);
  }
}

static void cpu_from_half(float *restrict dst, const uint16_t *restrict src, int64_t n, bool bf16) {
  if (bf16)
    ddp_convert_bf16_to_f32(dst, src, (size_t)n);
  else
    ddp_convert_f16_to_f32(dst, src, (size_t)n);
}

static void cpu_round_low(float *dst, const float *src, int64_t n, bool bf16) {
  ddp_convert_round_f32(dst, src, (size_t)n, bf16 ? DDP_BFLOAT16 : DDP_FLOAT16);
}

/* PyTorch's _amp_foreach_non_finite_check_and_unscale_ on the CPU: the
 * exponent test on the bits (no floating-point compare for NaN), the
 * multiply skipped when inv is 1. */
static bool cpu_unscale_check(float *x, float inv, int64_t n) {
  uint32_t found = 0;
  for (int64_t i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, &x[i], sizeof bits);
    found |= (bits & 0x7f800000u) == 0x7f800000u;
    if (inv != 1.0f) x[i] *= inv;
  }
  return found != 0;
}

const ddp__basic_kernels ddp__cpu_basic_kernels = {
    .copy = cpu_copy,
    .fill = cpu_fill,
    .add = cpu_add,
    .axpy = cpu_axpy,
    .sum_squares = cpu_sum_squares,
    .scale = cpu_scale,
    .mul = cpu_mul,
    .div = cpu_div,
    .to_half = cpu_to_half,
    .from_half = cpu_from_half,
    .round_low = cpu_round_low,
    .unscale_check = cpu_unscale_check,
};
