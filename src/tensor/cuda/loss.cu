/* CUDA log_softmax and loss kernels (see cuda/pointwise.h); cpu/loss.c is
 * the reference: the same row statistics (max, then log of the sum of
 * exp(x - max) taken in double), the same order of operations per element.
 *
 * A row of log_softmax or cross-entropy is one warp's (rows of a
 * classifier are short: 10 classes in the seeds). The losses' sums over a
 * batch are one block's fixed tree: a batch's outputs are small, and one
 * block needs no second pass.
 *
 * Targets: nll_loss and cross_entropy must find a sample whose target is
 * outside [0, C) before anything indexes with it. The check runs on the
 * device (the first such sample by a min-reduction) and nobody waits for
 * it: a bad target makes the loss NaN and goes into the device's
 * target-check slot (runtime.h), which the next synchronize reports. So
 * the kernels return -1 at once, a step has no wait in its loss, and the
 * loss can be captured in a CUDA graph. */
#include "tensor/cuda/pointwise.h"

#include <math.h>

/* Rows a block for the warp-per-row kernels. */
#define ROWS_PER_BLOCK 8
/* Threads of the one-block loss kernels. */
#define LOSS_BLOCK 1024

static unsigned row_blocks(int64_t rows) {
  return (unsigned)((rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK);
}

/* One row's softmax statistics, computed by the 32 lanes of a warp (each
 * gets the result): its max m (NaN never wins, as the CPU's comparison) and
 * log_sum = log sum_j exp(x[j] - m), the sum in double. Callers form
 * log-probabilities as (x - m) - log_sum. An infinite max gives log_sum 0,
 * so the row comes out NaN / -inf as in PyTorch. */
static __device__ void row_softmax_stats(const float *xr, int64_t C, unsigned lane, float *max,
                                         float *log_sum) {
  float m = -INFINITY;
  for (int64_t j = lane; j < C; j += 32) {
    const float v = xr[j];
    m = v > m ? v : m;
  }
  m = ddp__warp_max(m);
  *max = m;
  *log_sum = 0.0f;
  if (m == -INFINITY || m == INFINITY) return; /* the whole warp: m is the same in every lane */
  double s = 0;
  for (int64_t j = lane; j < C; j += 32) s += expf(xr[j] - m);
  s = ddp__warp_sum(s);
  *log_sum = (float)log(s);
}

/* ---- log_softmax ---- */

static __global__ void log_softmax_kernel(float *y, const float *x, int64_t rows, int64_t C) {
  const int64_t r = (int64_t)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const unsigned lane = threadIdx.x & 31;
  if (r >= rows) return; /* a whole warp */
  const float *xr = x + r * C;
  float *yr = y + r * C;
  float m, log_sum;
  row_softmax_stats(xr, C, lane, &m, &log_sum);
  for (int64_t j = lane; j < C; j += 32) yr[j] = (xr[j] - m) - log_sum;
}

/* dx += dy - exp(y) * sum(dy), the row's sum rounded to float as the CPU's. */
static __global__ void log_softmax_backward_kernel(float *dx, const float *dy, const float *y,
                                                   int64_t rows, int64_t C) {
  const int64_t r = (int64_t)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const unsigned lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float *g = dy + r * C, *yr = y + r * C;
  float *d = dx + r * C;
  double partial = 0;
  for (int64_t j = lane; j < C; j += 32) partial += g[j];
  const float s = (float)ddp__warp_sum(partial);
  for (int64_t j = lane; j < C; j += 32) d[j] += g[j] - expf(yr[j]) * s;
}

extern "C" void ddp__cuda_log_softmax(float *y, const float *x, int64_t rows, int64_t C) {
  if (rows <= 0 || C <= 0) return;
  log_softmax_kernel<<<row_blocks(rows), ROWS_PER_BLOCK * 32, 0, ddp__cuda_stream()>>>(y, x,
                                                                                       rows, C);
}

extern "C" void ddp__cuda_log_softmax_backward(float *dx, const float *dy, const float *y,
                                               int64_t rows, int64_t C) {
  if (rows <= 0 || C <= 0) return;
  log_softmax_backward_kernel<<<row_blocks(rows), ROWS_PER_BLOCK * 32, 0, ddp__cuda_stream()>>>(
      dx, dy, y, rows, C);
}

/* ---- mse ---- */

/* *loss = mean((input - target)^2): each difference and square in float,
 * as the CPU, summed in double. */
static __global__ void mse_loss_kernel(float *loss, const float *input, const float *target,
                                       int64_t n) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = input[i] - target[i];
    s += (double)(d * d);
  }
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) *loss = (float)(s / (double)n);
}

static __global__ void mse_loss_backward_kernel(float *dinput, float *dtarget, const float *dloss,
                                                const float *input, const float *target,
                                                int64_t n) {
  const float k = 2.0f * *dloss / (float)n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = k * (input[i] - target[i]);
    if (dinput) dinput[i] += v;
    if (dtarget) dtarget[i] -= v;
  }
}

extern "C" void ddp__cuda_mse_loss(float *loss, const float *input, const float *target,
                                   int64_t n) {
  /* n == 0 gives NaN, as the CPU's 0 / 0 (the op refuses an empty input) */
  mse_loss_kernel<<<1, LOSS_BLOCK, 0, ddp__cuda_stream()>>>(loss, input, target, n);
}

extern "C" void ddp__cuda_mse_loss_backward(float *dinput, float *dtarget, const float *dloss,
                                            const float *input, const float *target,
                                            int64_t n) {
  if (n <= 0 || (!dinput && !dtarget)) return;
  mse_loss_backward_kernel<<<ddp__cuda_blocks(n, DDP__PW_BLOCK), DDP__PW_BLOCK, 0,
                             ddp__cuda_stream()>>>(dinput, dtarget, dloss, input, target, n);
}

/* ---- nll and cross-entropy ---- */

/* The first sample whose target is outside [0, C), or N when none, in
 * every thread of the (one) block. */
static __device__ long long first_bad_target(const int64_t *target, int64_t N, int64_t C) {
  long long bad = N;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    if (target[i] < 0 || target[i] >= C) {
      bad = i; /* this thread's first: its smallest */
      break;
    }
  return ddp__block_min_i64(bad);
}

/* Whether a target is bad (every thread); if so, thread 0 makes the loss
 * NaN and records the sample in the slot unless it holds an earlier
 * report (the first bad target since the last synchronize is the one
 * reported). One block, and the losses of a stream run one after the
 * other, so the slot needs no atomics. */
static __device__ bool report_targets(ddp__cuda_target_error *slot, float *loss,
                                      const int64_t *target, long long bad, int64_t N,
                                      int64_t C, int64_t op) {
  if (bad >= N) return false;
  if (threadIdx.x == 0) {
    *loss = __int_as_float(0x7fffffff); /* NaN: the value is meaningless */
    if (slot->sample < 0) {
      slot->value = target[bad];
      slot->classes = C;
      slot->op = op;
      __threadfence_system(); /* the fields before the sample that says they are set */
      slot->sample = bad;
    }
  }
  return true;
}

/* *loss = -mean_i logp[i, target[i]] unless a target is bad. */
static __global__ void nll_loss_kernel(float *loss, ddp__cuda_target_error *slot,
                                       const float *logp, const int64_t *target, int64_t N,
                                       int64_t C) {
  const long long bad = first_bad_target(target, N, C);
  if (report_targets(slot, loss, target, bad, N, C, DDP__CUDA_TARGET_NLL))
    return; /* the whole block */
  double s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) s += logp[i * C + target[i]];
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) *loss = (float)(-s / (double)N);
}

/* Each row's (max, log_sum) into stats (N, 2). */
static __global__ void softmax_stats_kernel(float *stats, const float *logits, int64_t N,
                                            int64_t C) {
  const int64_t r = (int64_t)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const unsigned lane = threadIdx.x & 31;
  if (r >= N) return;
  float m, log_sum;
  row_softmax_stats(logits + r * C, C, lane, &m, &log_sum);
  if (lane == 0) stats[2 * r] = m, stats[2 * r + 1] = log_sum;
}

/* *loss = mean_i (log_sum_i - (x[i, target[i]] - max_i)) from the rows'
 * stats, unless a target is bad. */
static __global__ void cross_entropy_kernel(float *loss, ddp__cuda_target_error *slot,
                                            const float *stats, const float *logits,
                                            const int64_t *target, int64_t N, int64_t C) {
  const long long bad = first_bad_target(target, N, C);
  if (report_targets(slot, loss, target, bad, N, C, DDP__CUDA_TARGET_CROSS_ENTROPY)) return;
  double s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    s += (double)stats[2 * i + 1] - (logits[i * C + target[i]] - stats[2 * i]);
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) *loss = (float)(s / (double)N);
}

/* The device's target-check slot, or NULL: the kernels cannot run then
 * (the device is unusable), and why is pending for the next synchronize. */
static ddp__cuda_target_error *target_slot(void) {
  ddp__cuda_target_error *slot = ddp__cuda_target_error_slot();
  if (!slot) ddp__cuda_defer(DDP_ERR_UNSUPPORTED);
  return slot;
}

/* The kernel table's contract (kernels_pointwise.h): -1 always on CUDA; a
 * bad target is reported by the next synchronize. *bad_target untouched. */
extern "C" int64_t ddp__cuda_nll_loss(float *loss, const float *logp, const int64_t *target,
                                      int64_t N, int64_t C, int64_t *bad_target) {
  (void)bad_target;
  ddp__cuda_target_error *slot = target_slot();
  if (!slot) return -1;
  nll_loss_kernel<<<1, LOSS_BLOCK, 0, ddp__cuda_stream()>>>(loss, slot, logp, target, N, C);
  return -1;
}

static __global__ void nll_loss_backward_kernel(float *dlogp, const float *dloss,
                                                const int64_t *target, int64_t N, int64_t C) {
  const float g = -*dloss / (float)N;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = target[i];
    if (t >= 0 && t < C) dlogp[i * C + t] += g; /* checked by the forward */
  }
}

extern "C" void ddp__cuda_nll_loss_backward(float *dlogp, const float *dloss,
                                            const int64_t *target, int64_t N, int64_t C) {
  if (N <= 0) return;
  nll_loss_backward_kernel<<<ddp__cuda_blocks(N, DDP__PW_BLOCK), DDP__PW_BLOCK, 0,
                             ddp__cuda_stream()>>>(dlogp, dloss, target, N, C);
}

extern "C" int64_t ddp__cuda_cross_entropy(float *loss, float *stats, const float *logits,
                                           const int64_t *target, int64_t N, int64_t C,
                                           int64_t *bad_target) {
  (void)bad_target;
  ddp__cuda_target_error *slot = target_slot();
  if (!slot) return -1;
  cudaStream_t stream = ddp__cuda_stream();
  /* The rows' stats do not depend on the targets, so they are formed
   * first, in parallel; with a bad target they are left unused. */
  if (N > 0 && C > 0)
    softmax_stats_kernel<<<row_blocks(N), ROWS_PER_BLOCK * 32, 0, stream>>>(stats, logits, N, C);
  cross_entropy_kernel<<<1, LOSS_BLOCK, 0, stream>>>(loss, slot, stats, logits, target, N, C);
  return -1;
}

/* dlogits += softmax(logits) * dloss / N, then -= dloss / N at the target
 * (two roundings there, as the CPU's two statements). */
static __global__ void cross_entropy_backward_kernel(float *dlogits, const float *dloss,
                                                     const float *logits, const float *stats,
                                                     const int64_t *target, int64_t N,
                                                     int64_t C) {
  const float g = *dloss / (float)N;
  const int64_t n = N * C;
  for (int64_t at = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; at < n;
       at += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = at / C, j = at - i * C;
    const float m = stats[2 * i], log_sum = stats[2 * i + 1];
    float d = dlogits[at] + g * expf((logits[at] - m) - log_sum);
    if (j == target[i]) d -= g;
    dlogits[at] = d;
  }
}

extern "C" void ddp__cuda_cross_entropy_backward(float *dlogits, const float *dloss,
                                                 const float *logits, const float *stats,
                                                 const int64_t *target, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  cross_entropy_backward_kernel<<<ddp__cuda_blocks(N * C, DDP__PW_BLOCK), DDP__PW_BLOCK, 0,
                                  ddp__cuda_stream()>>>(dlogits, dloss, logits, stats, target,
                                                        N, C);
}
