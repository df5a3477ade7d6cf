/* CPU activation and dropout kernels, and the pointwise kernel table, whose
 * batch-norm and loss entries live in cpu/norm.c and cpu/loss.c (see
 * cpu/pointwise.h for what they share). exp and tanh are our own branch-free
 * versions (Cephes polynomials) so that the loops vectorise. */
#include "tensor/cpu/pointwise.h"

/* Cephes tanhf: an odd polynomial for |x| < 0.625, 1 - 2 / (exp(2|x|) + 1)
 * above it; both computed, one selected, so the loop stays branch-free. */
static inline float tanh_f32(float x) {
  float a = x < 0 ? -x : x;
  float e = exp_f32(a + a);
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = x < 0 ? -big : big;
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * x + x;
  return a < 0.625f ? small : big;
}

/* ---- activations ---- */

static void cpu_relu(float *restrict y, const float *restrict x, int64_t n) {
  /* NaN propagates, as torch.relu does. */
  for (int64_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

/* The activations' backward: dx += g (accumulate) or dx = g, one loop each
 * so the assigning one never reads dx. */
#define ACTIVATION_BACKWARD(dx, n, accumulate, g)               \
  do {                                                          \
    if (accumulate)                                             \
      for (int64_t i = 0; i < (n); i++) (dx)[i] += (g);         \
    else                                                        \
      for (int64_t i = 0; i < (n); i++) (dx)[i] = (g);          \
  } while (0)

static void cpu_relu_backward(float *restrict dx, const float *restrict dy, const float *restrict y,
                              int64_t n, bool accumulate) {
  /* y > 0 exactly where x > 0: the gradient is 0 at x <= 0. dy is loaded
   * unconditionally: a select, not a masked load. */
  ACTIVATION_BACKWARD(dx, n, accumulate, y[i] > 0.0f ? dy[i] : 0.0f);
}

static void cpu_sigmoid(float *restrict y, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + exp_f32(-x[i]));
}

static void cpu_sigmoid_backward(float *restrict dx, const float *restrict dy,
                                 const float *restrict y, int64_t n, bool accumulate) {
  ACTIVATION_BACKWARD(dx, n, accumulate, dy[i] * y[i] * (1.0f - y[i]));
}

static void cpu_tanh(float *restrict y, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = tanh_f32(x[i]);
}

static void cpu_tanh_backward(float *restrict dx, const float *restrict dy, const float *restrict y,
                              int64_t n, bool accumulate) {
  ACTIVATION_BACKWARD(dx, n, accumulate, dy[i] * (1.0f - y[i] * y[i]));
}

/* ---- dropout ---- */

static void cpu_dropout_mask(uint8_t *restrict mask, int64_t groups, float p, ddp_rng *rng) {
  if (p >= 1.0f) {
    memset(mask, 0, (size_t)groups);
    return;
  }
  /* ddp_rng_uniform(rng) is k * 2^-24 with k = ddp_rng_next(rng) >> 40, and
   * k * 2^-24 < p exactly when k < ceil(p * 2^24): the same mask as comparing
   * uniforms, without the float conversion or the second call. */
  uint64_t threshold = (uint64_t)ceilf(p * 16777216.0f);
  for (int64_t i = 0; i < groups; i++) mask[i] = (ddp_rng_next(rng) >> 40) >= threshold;
}

static void cpu_dropout_apply(float *restrict y, const float *restrict x,
                              const uint8_t *restrict mask, int64_t groups, int64_t group_size,
                              float scale) {
  if (group_size == 1) {
    for (int64_t i = 0; i < groups; i++) y[i] = x[i] * ((float)mask[i] * scale);
    return;
  }
  for (int64_t g = 0; g < groups; g++) {
    /* A multiply, not a store of 0: NaN and inf stay NaN, as in PyTorch. */
    float s = (float)mask[g] * scale;
    const float *xg = x + g * group_size;
    float *yg = y + g * group_size;
    for (int64_t i = 0; i < group_size; i++) yg[i] = xg[i] * s;
  }
}

static void cpu_dropout_backward(float *restrict dx, const float *restrict dy,
                                 const uint8_t *restrict mask, int64_t groups, int64_t group_size,
                                 float scale) {
  if (group_size == 1) {
    for (int64_t i = 0; i < groups; i++) dx[i] += dy[i] * ((float)mask[i] * scale);
    return;
  }
  for (int64_t g = 0; g < groups; g++) {
    if (!mask[g]) continue;
    const float *dyg = dy + g * group_size;
    float *dxg = dx + g * group_size;
    for (int64_t i = 0; i < group_size; i++) dxg[i] += dyg[i] * scale;
  }
}
const ddp__pointwise_kernels ddp__cpu_pointwise_kernels = {
    .relu = cpu_relu,
    .relu_backward = cpu_relu_backward,
    .sigmoid = cpu_sigmoid,
    .sigmoid_backward = cpu_sigmoid_backward,
    .tanh = cpu_tanh,
    .tanh_backward = cpu_tanh_backward,
    .dropout_mask = cpu_dropout_mask,
    .dropout_apply = cpu_dropout_apply,
    .dropout_backward = cpu_dropout_backward,
    .batch_norm_stats = ddp__cpu_batch_norm_stats,
    .batch_norm_running = ddp__cpu_batch_norm_running,
    .batch_norm_forward = ddp__cpu_batch_norm_forward,
    .batch_norm_backward = ddp__cpu_batch_norm_backward,
    .batch_norm_backward_conv = ddp__cpu_batch_norm_backward_conv,
    .batch_norm_sums = ddp__cpu_batch_norm_sums,
    .batch_norm_stats_from_sums = ddp__cpu_batch_norm_stats_from_sums,
    .batch_norm_backward_reduce = ddp__cpu_batch_norm_backward_reduce,
    .batch_norm_backward_dx = ddp__cpu_batch_norm_backward_dx,
    .log_softmax = ddp__cpu_log_softmax,
    .log_softmax_backward = ddp__cpu_log_softmax_backward,
    .mse_loss = ddp__cpu_mse_loss,
    .mse_loss_backward = ddp__cpu_mse_loss_backward,
    .nll_loss = ddp__cpu_nll_loss,
    .nll_loss_backward = ddp__cpu_nll_loss_backward,
    .cross_entropy = ddp__cpu_cross_entropy,
    .cross_entropy_backward = ddp__cpu_cross_entropy_backward,
};
