/* Pointwise and per-channel kernels: activations, batch norm, dropout,
 * log_softmax, losses. Raw pointers and sizes; n counts elements. Every
 * *_backward kernel accumulates (+=) into its gradient outputs, except that
 * those taking `accumulate` assign (=) the input gradient when it is false
 * (a fresh buffer, ddp__tape_grad_out); a NULL gradient output means "not
 * wanted". Scalars that live on the device (a
 * loss, its incoming gradient) are passed as pointers. */
#ifndef DDP__TENSOR_KERNELS_POINTWISE_H
#define DDP__TENSOR_KERNELS_POINTWISE_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"
#include "tensor/kernels_dense.h" /* ddp__conv2d_geom */

/* The gradient reaching batch norm's output, for its backward kernels:
 * dense, (N, C, HW); or, when batch norm feeds a fused relu and max
 * pooling (batch_norm_relu_max_pool2d), the pooling's, from which the
 * dense one follows: zero except at each window's argmax, which receives
 * the window's gradient unless relu closed it (argmax -1; summed where
 * windows overlap), exactly as max_pool2d_backward scatters it. The
 * kernels then scatter one (n, c) plane at a time into `scratch` (in
 * cache) and never write, keep or read back the dense gradient, four
 * times the pooled one's size. */
typedef struct ddp__bn_grad {
  const float *dense; /* (N, C, HW); NULL: pooled */
  /* pooled: (N, C, oh, ow) each; planes of h x w (h * w = HW) */
  const float *pooled;
  const void *argmax; /* ddp__pool_arg_bytes(kernel) a window */
  int64_t h, w, kernel, stride, oh, ow;
  float *scratch; /* pooled: HW floats, or N * C when HW == 1 */
} ddp__bn_grad;

typedef struct ddp__pointwise_kernels {
  /* ---- activations: y = f(x); backward from y (the op's output) ---- */
  void (*relu)(float *y, const float *x, int64_t n);
  void (*relu_backward)(float *dx, const float *dy, const float *y, int64_t n, bool accumulate);
  void (*sigmoid)(float *y, const float *x, int64_t n);
  void (*sigmoid_backward)(float *dx, const float *dy, const float *y, int64_t n,
                           bool accumulate);
  void (*tanh)(float *y, const float *x, int64_t n);
  void (*tanh_backward)(float *dx, const float *dy, const float *y, int64_t n, bool accumulate);

  /* ---- dropout. The mask has one byte per group (1 keep, 0 drop); a group
   * is `group_size` consecutive elements (1 for dropout, a feature map for
   * dropout2d). ---- */
  /* mask[i] = !(ddp_rng_uniform(rng) < p), drawn in order i = 0..groups-1;
   * p >= 1 draws nothing and zeroes the mask. */
  void (*dropout_mask)(uint8_t *mask, int64_t groups, float p, ddp_rng *rng);
  /* y = x * mask[group] * scale */
  void (*dropout_apply)(float *y, const float *x, const uint8_t *mask, int64_t groups,
                        int64_t group_size, float scale);
  /* dx += dy * mask[group] * scale */
  void (*dropout_backward)(float *dx, const float *dy, const uint8_t *mask, int64_t groups,
                           int64_t group_size, float scale);

  /* ---- batch norm over x (N, C, HW); per-channel vectors are (C) ---- */
  /* Batch statistics: mean and invstd = 1/sqrt(biased var + eps). When
   * running_mean/running_var are not NULL they are updated in place:
   * running = (1 - momentum) * running + momentum * stat, with the unbiased
   * variance for running_var (the biased one when N*HW == 1). */
  ddp_status (*batch_norm_stats)(float *mean, float *invstd, float *running_mean,
                                 float *running_var, const float *x, int64_t N, int64_t C,
                                 int64_t HW, float momentum, float eps, ddp_arena *arena);
  /* Evaluation statistics: mean = running_mean, invstd = 1/sqrt(running_var + eps). */
  void (*batch_norm_running)(float *mean, float *invstd, const float *running_mean,
                             const float *running_var, int64_t C, float eps);
  /* y = (x - mean) * invstd * weight + bias; weight/bias NULL mean 1/0. */
  void (*batch_norm_forward)(float *y, const float *x, const float *mean, const float *invstd,
                             const float *weight, const float *bias, int64_t N, int64_t C,
                             int64_t HW);
  /* Gradients of batch_norm_forward. With batch_stats the mean and invstd
   * are functions of x (training); without, constants (eval). dx is
   * assigned when !accumulate, and may then be x itself (each element is
   * read before its gradient is written: ddp__tape_grad_reusing_data). */
  ddp_status (*batch_norm_backward)(float *dx, float *dweight, float *dbias,
                                    const ddp__bn_grad *dy, const float *x, const float *mean,
                                    const float *invstd, const float *weight, int64_t N,
                                    int64_t C, int64_t HW, bool batch_stats, bool accumulate,
                                    ddp_arena *arena);
  /* batch_norm_backward (HW > 1) for an x that a stride-1 convolution of
   * geometry g (g->o == C) made from conv_x with conv_w and conv_b (or
   * NULL), when nothing but that convolution's weight and bias need dx and
   * x itself is no longer kept: dy is pooled, and argval holds x at each
   * window's max (max_pool2d_forward's). dx is never formed: conv_dw (C,
   * g->c*KH*KW) += and conv_db (C) += (either may be NULL) what the
   * convolution's backward would compute from it. With dx = kdy dy +
   * kx (x - mean) + k0, the dy term folds the scattered gradient planes
   * against the input patches; the other two are affine in x = conv(conv_x),
   * so they follow from the patches' sums and Gram matrix. */
  ddp_status (*batch_norm_backward_conv)(float *dweight, float *dbias, const ddp__bn_grad *dy,
                                         const float *argval, const float *mean,
                                         const float *invstd, const float *weight, int64_t N,
                                         int64_t C, int64_t HW, bool batch_stats,
                                         const ddp__conv2d_geom *g, const float *conv_x,
                                         const float *conv_w, const float *conv_b,
                                         float *conv_dw, float *conv_db, ddp_arena *arena);
  /* ---- synchronized batch norm: the same maths in phases, so that the
   * per-channel sums can be summed across ranks between them. Sums are
   * double, in host memory (they go through the caller's reduction). ---- */
  /* sums (2C): [c] = sum of x over channel c, [C + c] = sum of x^2. */
  void (*batch_norm_sums)(double *sums, const float *x, int64_t N, int64_t C, int64_t HW);
  /* From sums summed over every rank and the total count (> 1): mean,
   * invstd and, when not NULL, the running update (as batch_norm_stats). */
  void (*batch_norm_stats_from_sums)(float *mean, float *invstd, float *running_mean,
                                     float *running_var, const double *sums, int64_t count,
                                     int64_t C, float momentum, float eps);
  /* This rank's backward sums (2C): [c] = sum(dy), [C + c] = sum(dy * (x - mean));
   * and from them dweight += sum(dy * (x - mean)) * invstd, dbias += sum(dy)
   * (this rank's share; NULL: not wanted). */
  void (*batch_norm_backward_reduce)(double *sums, float *dweight, float *dbias,
                                     const ddp__bn_grad *dy, const float *x, const float *mean,
                                     const float *invstd, int64_t N, int64_t C, int64_t HW);
  /* dx += (= when !accumulate) the training-mode input gradient, from sums
   * summed over every rank and the total count. dx may be x, as above. */
  ddp_status (*batch_norm_backward_dx)(float *dx, const ddp__bn_grad *dy, const float *x,
                                       const float *mean, const float *invstd, const float *weight,
                                       const double *sums, int64_t count, int64_t N, int64_t C,
                                       int64_t HW, bool accumulate, ddp_arena *arena);

  /* ---- log_softmax over rows of length C ---- */
  void (*log_softmax)(float *y, const float *x, int64_t rows, int64_t C);
  /* dx += dy - exp(y) * sum(dy) per row */
  void (*log_softmax_backward)(float *dx, const float *dy, const float *y, int64_t rows, int64_t C);

  /* ---- losses, mean reduction; *loss is one float; *dloss the incoming gradient ---- */
  /* *loss = mean((input - target)^2) */
  void (*mse_loss)(float *loss, const float *input, const float *target, int64_t n);
  /* dinput += 2 (input - target) / n * dloss; dtarget -= the same */
  void (*mse_loss_backward)(float *dinput, float *dtarget, const float *dloss, const float *input,
                            const float *target, int64_t n);
  /* *loss = -mean_i logp[i, target[i]] over logp (N, C). Returns -1, or the
   * first sample i whose target is outside [0, C) (its value in *bad_target;
   * *loss is then unspecified). A table whose device runs asynchronously
   * may instead always return -1 and report the first bad sample, its
   * value and C at the device's next synchronize, with *loss NaN: CUDA's
   * does (its check must not wait for the device; docs/cuda.md). Either
   * way no bad target is used as an index. */
  int64_t (*nll_loss)(float *loss, const float *logp, const int64_t *target, int64_t N, int64_t C,
                      int64_t *bad_target);
  /* dlogp[i, target[i]] -= dloss / N */
  void (*nll_loss_backward)(float *dlogp, const float *dloss, const int64_t *target, int64_t N,
                            int64_t C);
  /* log_softmax + nll fused: *loss = mean_i -log softmax(logits)[i, target[i]].
   * Saves each row's max and log sum exp(logits - max) in stats (N, 2) for
   * backward. Target errors as nll_loss. */
  int64_t (*cross_entropy)(float *loss, float *stats, const float *logits, const int64_t *target,
                           int64_t N, int64_t C, int64_t *bad_target);
  /* dlogits += (softmax(logits) - onehot(target)) * dloss / N */
  void (*cross_entropy_backward)(float *dlogits, const float *dloss, const float *logits,
                                 const float *stats, const int64_t *target, int64_t N, int64_t C);
} ddp__pointwise_kernels;

extern const ddp__pointwise_kernels ddp__cpu_pointwise_kernels;

#endif
