/* Internal to the CPU pointwise kernels, split by subject: activations and
 * dropout (cpu/pointwise.c, which assembles ddp__cpu_pointwise_kernels),
 * batch norm (cpu/norm.c), log_softmax and the losses (cpu/loss.c). Holds
 * the helpers they share: a vectorisable exp and a lane-parallel sum.
 *
 * Loops are plain loops over restrict pointers; reductions keep LANES
 * independent float lanes (so they vectorise without -ffast-math) and add the
 * lanes up in double. GCC 12 at -O2 uses the "very-cheap" vectoriser cost
 * model, which leaves any loop whose trip count is not a known multiple of the
 * vector width scalar (all of ours); this header switches the three files to
 * the dynamic model, which vectorises them with an epilogue. Include it first. */
#ifndef DDP__TENSOR_CPU_POINTWISE_H
#define DDP__TENSOR_CPU_POINTWISE_H

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic")
#endif

#include <math.h>
#include <string.h>

#include "tensor/kernels_pointwise.h"

#define LANES 16

/* ---- vectorisable exp / tanh ---------------------------------------------
 * exp_f32: Cephes expf, relative error about 1 ulp on [-87.3, 88]. Below
 * -87.3 it returns 0 (the true value is subnormal or 0); above 88 it returns
 * exp(88) (about 1.65e38), which the callers (sigmoid, tanh) only ever add 1
 * to and divide by. */
static inline float exp_f32(float x) {
  /* Comparisons, not fminf/floorf: GCC vectorises selects but not those calls. */
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  xc = xc != xc ? 0.0f : xc;
  /* n = round(xc / ln 2): adding 1.5 * 2^23 rounds to an integer. */
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  /* 2^n through the exponent bits; n is in [-126, 127] here. */
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  float y = x < -87.3f ? 0.0f : p * scale;
  return x != x ? x : y; /* NaN in, NaN out */
}

/* sum(x) over n contiguous floats, lane-parallel, returned in double. */
static inline double sum_f32(const float *restrict x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
  double s = 0;
  for (; i < n; i++) s += x[i];
  for (int j = 0; j < LANES; j++) s += acc[j];
  return s;
}

/* sum(x) over n contiguous floats in double lanes: the rounding error is
 * about n * 2^-53 of sum|x|, far below float's last place for any plane
 * a network holds, where sum_f32's float lanes drift by units in it. */
static inline double sum_f32_in_double(const float *restrict x, int64_t n) {
  enum { DLANES = 8 };
  double acc[DLANES] = {0};
  int64_t i = 0;
  for (; i + DLANES <= n; i += DLANES)
    for (int j = 0; j < DLANES; j++) acc[j] += x[i + j];
  double s = 0;
  for (; i < n; i++) s += x[i];
  for (int j = 0; j < DLANES; j++) s += acc[j];
  return s;
}

/* cpu/norm.c */
ddp_status ddp__cpu_batch_norm_stats(float *mean, float *invstd, float *running_mean,
                                     float *running_var, const float *x, int64_t N, int64_t C,
                                     int64_t HW, float momentum, float eps, ddp_arena *arena);
void ddp__cpu_batch_norm_running(float *mean, float *invstd, const float *running_mean,
                                 const float *running_var, int64_t C, float eps);
void ddp__cpu_batch_norm_forward(float *y, const float *x, const float *mean, const float *invstd,
                                 const float *weight, const float *bias, int64_t N, int64_t C,
                                 int64_t HW);
ddp_status ddp__cpu_batch_norm_backward(float *dx, float *dweight, float *dbias,
                                        const ddp__bn_grad *dy, const float *x, const float *mean,
                                        const float *invstd, const float *weight, int64_t N,
                                        int64_t C, int64_t HW, bool batch_stats, bool accumulate,
                                        ddp_arena *arena);
ddp_status ddp__cpu_batch_norm_backward_conv(float *dweight, float *dbias, const ddp__bn_grad *dy,
                                             const float *argval, const float *mean,
                                             const float *invstd, const float *weight, int64_t N,
                                             int64_t C, int64_t HW, bool batch_stats,
                                             const ddp__conv2d_geom *g, const float *conv_x,
                                             const float *conv_w, const float *conv_b,
                                             float *conv_dw, float *conv_db, ddp_arena *arena);
void ddp__cpu_batch_norm_sums(double *sums, const float *x, int64_t N, int64_t C, int64_t HW);
void ddp__cpu_batch_norm_stats_from_sums(float *mean, float *invstd, float *running_mean,
                                         float *running_var, const double *sums, int64_t count,
                                         int64_t C, float momentum, float eps);
void ddp__cpu_batch_norm_backward_reduce(double *sums, float *dweight, float *dbias,
                                         const ddp__bn_grad *dy, const float *x,
                                         const float *mean, const float *invstd, int64_t N,
                                         int64_t C, int64_t HW);
ddp_status ddp__cpu_batch_norm_backward_dx(float *dx, const ddp__bn_grad *dy, const float *x,
                                           const float *mean, const float *invstd,
                                           const float *weight, const double *sums, int64_t count,
                                           int64_t N, int64_t C, int64_t HW, bool accumulate,
                                           ddp_arena *arena);

/* cpu/loss.c */
void ddp__cpu_log_softmax(float *y, const float *x, int64_t rows, int64_t C);
void ddp__cpu_log_softmax_backward(float *dx, const float *dy, const float *y, int64_t rows,
                                   int64_t C);
void ddp__cpu_mse_loss(float *loss, const float *input, const float *target, int64_t n);
void ddp__cpu_mse_loss_backward(float *dinput, float *dtarget, const float *dloss,
                                const float *input, const float *target, int64_t n);
int64_t ddp__cpu_nll_loss(float *loss, const float *logp, const int64_t *target, int64_t N,
                          int64_t C, int64_t *bad_target);
void ddp__cpu_nll_loss_backward(float *dlogp, const float *dloss, const int64_t *target, int64_t N,
                                int64_t C);
int64_t ddp__cpu_cross_entropy(float *loss, float *stats, const float *logits,
                               const int64_t *target, int64_t N, int64_t C, int64_t *bad_target);
void ddp__cpu_cross_entropy_backward(float *dlogits, const float *dloss, const float *logits,
                                     const float *stats, const int64_t *target, int64_t N,
                                     int64_t C);

#endif
