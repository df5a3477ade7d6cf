/* Internal to the CUDA pointwise kernels, split by subject as the CPU's:
 * activations and dropout (cuda/pointwise.cu, which assembles
 * ddp__cuda_pointwise_kernels), batch norm (cuda/norm.cu), log_softmax and
 * the losses (cuda/loss.cu). CUDA C++ only (device code): included by those
 * three files, never by C.
 *
 * Determinism: every reduction is a fixed tree (warp butterflies, then the
 * warps' results in shared memory summed by warp 0), and values are never
 * combined with atomics, so a kernel gives the same bits on every run. */
#ifndef DDP__TENSOR_CUDA_POINTWISE_H
#define DDP__TENSOR_CUDA_POINTWISE_H

#include "tensor/cuda/kernels_cuda.h" /* first: it prepares core.h for C++ */
#include "tensor/cuda/runtime.h"

#include <stdint.h>

/* Threads a block for the 1-D elementwise kernels (grid-stride loops). */
#define DDP__PW_BLOCK 256

#include "tensor/cuda/reduce.cuh" /* the fixed-order reductions */

/* ---- cuda/norm.cu ---- */
extern "C" {
ddp_status ddp__cuda_batch_norm_stats(float *mean, float *invstd, float *running_mean,
                                      float *running_var, const float *x, int64_t N, int64_t C,
                                      int64_t HW, float momentum, float eps, ddp_arena *arena);
void ddp__cuda_batch_norm_running(float *mean, float *invstd, const float *running_mean,
                                  const float *running_var, int64_t C, float eps);
void ddp__cuda_batch_norm_forward(float *y, const float *x, const float *mean,
                                  const float *invstd, const float *weight, const float *bias,
                                  int64_t N, int64_t C, int64_t HW);
ddp_status ddp__cuda_batch_norm_backward(float *dx, float *dweight, float *dbias,
                                         const ddp__bn_grad *dy, const float *x,
                                         const float *mean, const float *invstd,
                                         const float *weight, int64_t N, int64_t C, int64_t HW,
                                         bool batch_stats, bool accumulate, ddp_arena *arena);
void ddp__cuda_batch_norm_sums(double *sums, const float *x, int64_t N, int64_t C, int64_t HW);
void ddp__cuda_batch_norm_stats_from_sums(float *mean, float *invstd, float *running_mean,
                                          float *running_var, const double *sums,
                                          int64_t count, int64_t C, float momentum, float eps);
void ddp__cuda_batch_norm_backward_reduce(double *sums, float *dweight, float *dbias,
                                          const ddp__bn_grad *dy, const float *x,
                                          const float *mean, const float *invstd, int64_t N,
                                          int64_t C, int64_t HW);
ddp_status ddp__cuda_batch_norm_backward_dx(float *dx, const ddp__bn_grad *dy, const float *x,
                                            const float *mean, const float *invstd,
                                            const float *weight, const double *sums,
                                            int64_t count, int64_t N, int64_t C, int64_t HW,
                                            bool accumulate, ddp_arena *arena);

/* ---- cuda/loss.cu ---- */
void ddp__cuda_log_softmax(float *y, const float *x, int64_t rows, int64_t C);
void ddp__cuda_log_softmax_backward(float *dx, const float *dy, const float *y, int64_t rows,
                                    int64_t C);
void ddp__cuda_mse_loss(float *loss, const float *input, const float *target, int64_t n);
void ddp__cuda_mse_loss_backward(float *dinput, float *dtarget, const float *dloss,
                                 const float *input, const float *target, int64_t n);
int64_t ddp__cuda_nll_loss(float *loss, const float *logp, const int64_t *target, int64_t N,
                           int64_t C, int64_t *bad_target);
void ddp__cuda_nll_loss_backward(float *dlogp, const float *dloss, const int64_t *target,
                                 int64_t N, int64_t C);
int64_t ddp__cuda_cross_entropy(float *loss, float *stats, const float *logits,
                                const int64_t *target, int64_t N, int64_t C,
                                int64_t *bad_target);
void ddp__cuda_cross_entropy_backward(float *dlogits, const float *dloss, const float *logits,
                                      const float *stats, const int64_t *target, int64_t N,
                                      int64_t C);
}

#endif /* DDP__TENSOR_CUDA_POINTWISE_H */
