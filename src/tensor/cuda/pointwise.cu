/* CUDA activation and dropout kernels, and the pointwise kernel table, whose
 * batch-norm and loss entries live in cuda/norm.cu and cuda/loss.cu (see
 * cuda/pointwise.h). The CPU kernels (cpu/pointwise.c) are the reference:
 * the same contracts, the same formulas in the same order, with CUDA's
 * expf and tanhf where the CPU has its vectorisable Cephes versions (both
 * within an ulp or two of the exact value). */
#include "tensor/cuda/pointwise.h"

/* ---- activations: grid-stride loops over n elements ---- */

static __global__ void relu_kernel(float *y, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    y[i] = v < 0.0f ? 0.0f : v; /* NaN propagates, as torch.relu does */
  }
}

static __global__ void sigmoid_kernel(float *y, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = 1.0f / (1.0f + expf(-x[i]));
}

static __global__ void tanh_kernel(float *y, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = tanhf(x[i]);
}

/* The activations' backward from y: dx += g (accumulate) or dx = g, where
 * g is the local gradient times dy. The assigning form never reads dx. */
enum activation { ACT_RELU, ACT_SIGMOID, ACT_TANH };

template <int act>
static __global__ void activation_backward_kernel(float *dx, const float *dy, const float *y,
                                                  int64_t n, bool accumulate) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float yi = y[i], g = dy[i];
    float d;
    if (act == ACT_RELU)
      d = yi > 0.0f ? g : 0.0f; /* y > 0 exactly where x > 0 */
    else if (act == ACT_SIGMOID)
      d = g * yi * (1.0f - yi);
    else
      d = g * (1.0f - yi * yi);
    dx[i] = accumulate ? dx[i] + d : d;
  }
}

static void cuda_relu(float *y, const float *x, int64_t n) {
  if (n <= 0) return;
  relu_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, ddp__cuda_stream()>>>(y, x,
                                                                                           n);
}

static void cuda_sigmoid(float *y, const float *x, int64_t n) {
  if (n <= 0) return;
  sigmoid_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, ddp__cuda_stream()>>>(
      y, x, n);
}

static void cuda_tanh(float *y, const float *x, int64_t n) {
  if (n <= 0) return;
  tanh_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, ddp__cuda_stream()>>>(y, x,
                                                                                           n);
}

template <int act>
static void activation_backward(float *dx, const float *dy, const float *y, int64_t n,
                                bool accumulate) {
  if (n <= 0) return;
  activation_backward_kernel<act>
      <<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, ddp__cuda_stream()>>>(
          dx, dy, y, n, accumulate);
}

static void cuda_relu_backward(float *dx, const float *dy, const float *y, int64_t n,
                               bool accumulate) {
  activation_backward<ACT_RELU>(dx, dy, y, n, accumulate);
}

static void cuda_sigmoid_backward(float *dx, const float *dy, const float *y, int64_t n,
                                  bool accumulate) {
  activation_backward<ACT_SIGMOID>(dx, dy, y, n, accumulate);
}

static void cuda_tanh_backward(float *dx, const float *dy, const float *y, int64_t n,
                               bool accumulate) {
  activation_backward<ACT_TANH>(dx, dy, y, n, accumulate);
}

/* ---- dropout ---- */

/* The mask is drawn on the host, by the CPU kernel itself, a chunk at a
 * time into a stack buffer that is then copied to the device mask: the
 * draws are the CPU's in the CPU's order, so for the same rng state the
 * masks are bitwise equal and the rng ends in the same state. Each chunk's
 * copy is from pageable memory, hence synchronous with the host (the
 * buffer is reused for the next chunk): a (100, 64, 12, 12) dropout mask
 * is 15 such copies. A device generator could not reproduce xoshiro256**'s
 * sequence without running it serially. */
#define MASK_CHUNK ((int64_t)64 * 1024)

static void cuda_dropout_mask(uint8_t *mask, int64_t groups, float p, ddp_rng *rng) {
  if (groups <= 0) return;
  if (p >= 1.0f) { /* draws nothing, as the CPU kernel */
    ddp__cuda_defer(ddp__cuda_check(cudaMemsetAsync(mask, 0, (size_t)groups, ddp__cuda_stream()),
                                    "dropout: zeroing the mask"));
    return;
  }
  uint8_t chunk[MASK_CHUNK];
  for (int64_t at = 0; at < groups; at += MASK_CHUNK) {
    const int64_t n = groups - at < MASK_CHUNK ? groups - at : MASK_CHUNK;
    ddp__cpu_pointwise_kernels.dropout_mask(chunk, n, p, rng);
    /* a failed copy is reported by the next synchronize, like a kernel's */
    ddp__cuda_defer(ddp__cuda_copy(mask + at, chunk, (size_t)n, cudaMemcpyHostToDevice));
  }
}

/* y = x * (mask[group] * scale): a multiply, not a store of 0, so NaN and
 * inf stay NaN, as in PyTorch. */
static __global__ void dropout_apply_kernel(float *y, const float *x, const uint8_t *mask,
                                            int64_t n, int64_t group_size, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = group_size == 1 ? i : i / group_size;
    y[i] = x[i] * ((float)mask[g] * scale);
  }
}

/* dx += dy * mask[group] * scale. As on the CPU: element-wise dropout
 * (group_size 1) adds dy * 0 where the mask drops (NaN stays NaN), while
 * dropout2d leaves a dropped group's dx untouched. */
static __global__ void dropout_backward_kernel(float *dx, const float *dy, const uint8_t *mask,
                                               int64_t n, int64_t group_size, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    if (group_size == 1) {
      dx[i] += dy[i] * ((float)mask[i] * scale);
    } else if (mask[i / group_size]) {
      dx[i] += dy[i] * scale;
    }
  }
}

static void cuda_dropout_apply(float *y, const float *x, const uint8_t *mask, int64_t groups,
                               int64_t group_size, float scale) {
  const int64_t n = groups * group_size;
  if (n <= 0) return;
  dropout_apply_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0,
                         ddp__cuda_stream()>>>(y, x, mask, n, group_size, scale);
}

static void cuda_dropout_backward(float *dx, const float *dy, const uint8_t *mask, int64_t groups,
                                  int64_t group_size, float scale) {
  const int64_t n = groups * group_size;
  if (n <= 0) return;
  dropout_backward_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0,
                            ddp__cuda_stream()>>>(dx, dy, mask, n, group_size, scale);
}

/* batch_norm_backward_conv is NULL: folding the convolution's backward into
 * batch norm's is a CPU cache optimisation (x is let go after pooling and
 * the convolution's gradient is formed from patches). On CUDA the op layer
 * sees the NULL entry, keeps x and runs the plain backward of both ops. */
extern "C" const ddp__pointwise_kernels ddp__cuda_pointwise_kernels = {
    .relu = cuda_relu,
    .relu_backward = cuda_relu_backward,
    .sigmoid = cuda_sigmoid,
    .sigmoid_backward = cuda_sigmoid_backward,
    .tanh = cuda_tanh,
    .tanh_backward = cuda_tanh_backward,
    .dropout_mask = cuda_dropout_mask,
    .dropout_apply = cuda_dropout_apply,
    .dropout_backward = cuda_dropout_backward,
    .batch_norm_stats = ddp__cuda_batch_norm_stats,
    .batch_norm_running = ddp__cuda_batch_norm_running,
    .batch_norm_forward = ddp__cuda_batch_norm_forward,
    .batch_norm_backward = ddp__cuda_batch_norm_backward,
    .batch_norm_backward_conv = NULL,
    .batch_norm_sums = ddp__cuda_batch_norm_sums,
    .batch_norm_stats_from_sums = ddp__cuda_batch_norm_stats_from_sums,
    .batch_norm_backward_reduce = ddp__cuda_batch_norm_backward_reduce,
    .batch_norm_backward_dx = ddp__cuda_batch_norm_backward_dx,
    .log_softmax = ddp__cuda_log_softmax,
    .log_softmax_backward = ddp__cuda_log_softmax_backward,
    .mse_loss = ddp__cuda_mse_loss,
    .mse_loss_backward = ddp__cuda_mse_loss_backward,
    .nll_loss = ddp__cuda_nll_loss,
    .nll_loss_backward = ddp__cuda_nll_loss_backward,
    .cross_entropy = ddp__cuda_cross_entropy,
    .cross_entropy_backward = ddp__cuda_cross_entropy_backward,
};
