/* CUDA batch-norm kernels (see cuda/pointwise.h); cpu/norm.c is the
 * reference, quantity by quantity: which sums are double, the order of the
 * per-element arithmetic, the running update.
 *
 * x is (N, C, HW). For HW > 1 a channel's sums are split over S blocks
 * (S from the shape alone, channel_splits), each reducing whole planes of
 * samples [s N / S, (s + 1) N / S) by a fixed tree in double; one thread
 * per channel then adds its S partial sums in order. For HW == 1 ((N, C),
 * BatchNorm1d) one thread per channel walks the rows in order, as the CPU
 * does (the sums are then the CPU's, bit for bit), reading a row's channels
 * side by side. No atomics: every result is the same on every run.
 *
 * The gradient reaching batch norm's output (ddp__bn_grad) is dense, or
 * pooled: each element of the dense one is then gathered, where it is
 * needed, from the windows that contain it (summed in window order, those
 * whose argmax points at it), which is exactly what max pooling's backward
 * would have scattered there; the dense gradient is never formed and
 * bn_grad's host-side `scratch` is not used. */
#include "tensor/cuda/pointwise.h"

#include <math.h>
#include <string.h>

/* Threads per channel-finishing block (one thread a channel). */
#define CHANNEL_BLOCK 128

/* Threads for a block that walks planes of HW floats: 256, or HW rounded
 * up to whole warps when the plane is smaller. */
static unsigned plane_threads(int64_t HW) {
  return HW >= 256 ? 256u : (unsigned)((HW + 31) / 32 * 32);
}

/* Blocks each channel's reduction is split into: about 512 blocks in all
 * (an H100 has 132 SMs), at most one per sample. A function of the shape
 * only, so the order of the sums is fixed for a shape. */
static int64_t channel_splits(int64_t N, int64_t C) {
  int64_t s = (512 + C - 1) / C;
  if (s > N) s = N;
  return s < 1 ? 1 : s;
}

static unsigned channel_blocks(int64_t C) {
  return (unsigned)((C + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK);
}

/* ---- the incoming gradient, element by element ---- */

/* ddp__bn_grad as the kernels take it (by value), the pooling geometry in
 * int: a plane's index fits (checked by grad_src_of). */
typedef struct grad_src {
  const float *dense;  /* (N, C, HW), or NULL: pooled */
  const float *pooled; /* (N, C, oh, ow) */
  const void *argmax;  /* (N, C, oh, ow), arg_bytes each */
  int h, w, kernel, stride, oh, ow, arg_bytes;
} grad_src;

static grad_src grad_src_of(const ddp__bn_grad *dy, int64_t HW) {
  grad_src g;
  memset(&g, 0, sizeof g);
  g.dense = dy->dense;
  if (dy->dense) return g;
  DDP_ASSERT(dy->h * dy->w == HW && HW <= INT32_MAX && dy->oh * dy->ow <= INT32_MAX);
  DDP_ASSERT(dy->kernel > 0 && dy->kernel <= INT32_MAX && dy->stride > 0 &&
             dy->stride <= INT32_MAX);
  g.pooled = dy->pooled;
  g.argmax = dy->argmax;
  g.h = (int)dy->h, g.w = (int)dy->w, g.kernel = (int)dy->kernel, g.stride = (int)dy->stride;
  g.oh = (int)dy->oh, g.ow = (int)dy->ow;
  g.arg_bytes = (int)ddp__pool_arg_bytes(dy->kernel);
  return g;
}

/* For the reductions that read no gradient. */
static grad_src no_grad(void) {
  grad_src g;
  memset(&g, 0, sizeof g);
  return g;
}

/* Element i of plane p of the dense gradient. Pooled: the sum, in the
 * windows' row-major order from 0, of the pooled gradient of each window
 * that contains (y, x) = (i / w, i % w) and whose argmax (a * kernel + b
 * within the window; -1 where relu closed it) is that position: the value
 * and rounding max_pool2d_backward's scatter gives (it adds the windows
 * into a zeroed plane in the same order). Windows have no padding: window
 * (wy, wx) covers rows wy * stride .. wy * stride + kernel - 1. */
static __device__ __forceinline__ float grad_at(const grad_src &g, int64_t p, int64_t HW,
                                                int64_t i) {
  if (g.dense) return g.dense[p * HW + i];
  const int y = (int)i / g.w, x = (int)i % g.w, k = g.kernel, st = g.stride;
  const int wy0 = y < k ? 0 : (y - k) / st + 1, wy1 = min(y / st, g.oh - 1);
  const int wx0 = x < k ? 0 : (x - k) / st + 1, wx1 = min(x / st, g.ow - 1);
  const int64_t base = p * g.oh * g.ow;
  float sum = 0.0f;
  for (int wy = wy0; wy <= wy1; wy++)
    for (int wx = wx0; wx <= wx1; wx++) {
      const int64_t at = base + wy * g.ow + wx;
      const int arg = g.arg_bytes == 1 ? ((const int8_t *)g.argmax)[at]
                                       : ((const int32_t *)g.argmax)[at];
      if (arg == (y - wy * st) * k + (x - wx * st)) sum += g.pooled[at];
    }
  return sum;
}

/* ---- per-channel sums ---- */

/* What a reduction sums over a channel's elements v (and gradient g):
 *   SUM       v                          (the mean, in double)
 *   SQDEV     (float)(v - mean)^2        (the variance about the float mean)
 *   SUMS2     v and v^2 in double        (the synchronized forward's sums)
 *   BACKWARD  g and (float)(g (v - mean)) (the backward's sums) */
enum quantity { Q_SUM, Q_SQDEV, Q_SUMS2, Q_BACKWARD };

/* Block b = c * S + s sums channel c over samples [s N / S, (s + 1) N / S):
 * part[b] and, for the two-sum quantities, part[gridDim.x + b]. */
template <int q>
static __global__ void channel_partials_kernel(double *part, grad_src g, const float *x,
                                               const float *mean, int64_t N, int64_t C,
                                               int64_t HW, int64_t S) {
  const int64_t c = blockIdx.x / S, s = blockIdx.x % S;
  const int64_t n0 = s * N / S, n1 = (s + 1) * N / S;
  const float m = q == Q_SQDEV || q == Q_BACKWARD ? mean[c] : 0.0f;
  double a1 = 0, a2 = 0;
  for (int64_t n = n0; n < n1; n++) {
    const int64_t p = n * C + c;
    const float *plane = x + p * HW;
    for (int64_t i = threadIdx.x; i < HW; i += blockDim.x) {
      const float v = plane[i];
      if (q == Q_SUM) {
        a1 += v;
      } else if (q == Q_SQDEV) {
        const float d = v - m;
        a1 += (double)(d * d);
      } else if (q == Q_SUMS2) {
        const double dv = v;
        a1 += dv;
        a2 += dv * dv;
      } else {
        const float gv = grad_at(g, p, HW, i);
        a1 += gv;
        a2 += (double)(gv * (v - m));
      }
    }
  }
  a1 = ddp__block_sum(a1);
  if (q == Q_SUMS2 || q == Q_BACKWARD) a2 = ddp__block_sum(a2);
  if (threadIdx.x == 0) {
    part[blockIdx.x] = a1;
    if (q == Q_SUMS2 || q == Q_BACKWARD) part[gridDim.x + blockIdx.x] = a2;
  }
}

/* Channel c's total of S partial sums, in order. */
static __device__ __forceinline__ double channel_total(const double *part, int64_t c, int64_t S) {
  double t = 0;
  for (int64_t s = 0; s < S; s++) t += part[c * S + s];
  return t;
}

/* The per-channel sums of quantity q for HW > 1 into part (C S doubles; 2 C
 * S for the two-sum quantities), S from channel_splits. */
template <int q>
static void channel_partials(double *part, const grad_src &g, const float *x, const float *mean,
                             int64_t N, int64_t C, int64_t HW, int64_t S) {
  DDP_ASSERT(C * S <= INT32_MAX);
  channel_partials_kernel<q><<<(unsigned)(C * S), plane_threads(HW), 0, ddp__cuda_stream()>>>(
      part, g, x, mean, N, C, HW, S);
}

/* As cpu/norm.c's running_update. */
static __device__ __forceinline__ void running_update(float *running_mean, float *running_var,
                                                      int64_t c, double mean, double var,
                                                      int64_t count, float momentum) {
  if (!running_mean) return;
  double unbiased = count > 1 ? var * (double)count / (double)(count - 1) : var;
  running_mean[c] = (float)((1.0 - momentum) * running_mean[c] + momentum * mean);
  running_var[c] = (float)((1.0 - momentum) * running_var[c] + momentum * unbiased);
}

/* ---- statistics ---- */

/* HW > 1, after the SUM partials: the mean in double (kept for the running
 * update) and rounded to float (the one the variance is taken about and
 * the forward uses), as the CPU. */
static __global__ void stats_mean_kernel(float *mean, double *mean_exact, const double *part,
                                         int64_t C, int64_t S, int64_t count) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double m = channel_total(part, c, S) / (double)count;
  mean[c] = (float)m;
  mean_exact[c] = m;
}

/* HW > 1, after the SQDEV partials: invstd from the biased variance, and
 * the running update. */
static __global__ void stats_var_kernel(float *invstd, float *running_mean, float *running_var,
                                        const double *part, const double *mean_exact, int64_t C,
                                        int64_t S, int64_t count, float momentum, float eps) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double var = channel_total(part, c, S) / (double)count;
  invstd[c] = (float)(1.0 / sqrt(var + eps));
  running_update(running_mean, running_var, c, mean_exact[c], var, count, momentum);
}

/* HW == 1: one pass of double sums shifted by the first row, row by row
 * (the CPU's formula and order). */
static __global__ void rows_stats_kernel(float *mean, float *invstd, float *running_mean,
                                         float *running_var, const float *x, int64_t N, int64_t C,
                                         float momentum, float eps) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float shift = N > 0 ? x[c] : 0.0f;
  double s1 = 0, s2 = 0;
  for (int64_t n = 0; n < N; n++) {
    double d = (double)x[n * C + c] - shift;
    s1 += d;
    s2 += d * d;
  }
  double m = s1 / (double)N;
  double var = s2 / (double)N - m * m;
  var = var > 0 ? var : 0;
  mean[c] = (float)(shift + m);
  invstd[c] = (float)(1.0 / sqrt(var + eps));
  running_update(running_mean, running_var, c, shift + m, var, N, momentum);
}

extern "C" ddp_status ddp__cuda_batch_norm_stats(float *mean, float *invstd,
                                                 float *running_mean, float *running_var,
                                                 const float *x, int64_t N, int64_t C,
                                                 int64_t HW, float momentum, float eps,
                                                 ddp_arena *arena) {
  if (C <= 0) return DDP_OK;
  cudaStream_t stream = ddp__cuda_stream();
  if (HW == 1) {
    rows_stats_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(
        mean, invstd, running_mean, running_var, x, N, C, momentum, eps);
    return DDP_OK;
  }
  const int64_t S = channel_splits(N, C), count = N * HW;
  double *part = (double *)ddp_arena_alloc(arena, (size_t)(C * S + C) * sizeof(double));
  if (!part)
    return ddp_error(DDP_ERR_NOMEM, "batch_norm: no device scratch for %lld channels",
                     (long long)C);
  double *mean_exact = part + C * S;
  const grad_src none = no_grad();
  /* The mean is summed in double: it decides the sign of every normalised
   * value near it, and images hold many equal values (cpu/norm.c, issue 19). */
  channel_partials<Q_SUM>(part, none, x, NULL, N, C, HW, S);
  stats_mean_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(mean, mean_exact, part, C,
                                                                     S, count);
  channel_partials<Q_SQDEV>(part, none, x, mean, N, C, HW, S);
  stats_var_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(
      invstd, running_mean, running_var, part, mean_exact, C, S, count, momentum, eps);
  return DDP_OK;
}

static __global__ void running_stats_kernel(float *mean, float *invstd,
                                            const float *running_mean, const float *running_var,
                                            int64_t C, float eps) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  mean[c] = running_mean[c];
  invstd[c] = (float)(1.0 / sqrt((double)running_var[c] + eps));
}

extern "C" void ddp__cuda_batch_norm_running(float *mean, float *invstd,
                                             const float *running_mean,
                                             const float *running_var, int64_t C, float eps) {
  if (C <= 0) return;
  running_stats_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, ddp__cuda_stream()>>>(
      mean, invstd, running_mean, running_var, C, eps);
}

/* ---- forward: y = (x - mean) * (invstd * weight) + bias ---- */

/* One block a plane (n, c). */
static __global__ void forward_planes_kernel(float *y, const float *x, const float *mean,
                                             const float *invstd, const float *weight,
                                             const float *bias, int64_t C, int64_t HW) {
  const int64_t p = blockIdx.x, c = p % C;
  const float a = invstd[c] * (weight ? weight[c] : 1.0f);
  const float b = bias ? bias[c] : 0.0f, m = mean[c];
  const float *plane = x + p * HW;
  float *out = y + p * HW;
  for (int64_t i = threadIdx.x; i < HW; i += blockDim.x) out[i] = (plane[i] - m) * a + b;
}

/* (N, C) rows: element i is channel i % C. */
static __global__ void forward_rows_kernel(float *y, const float *x, const float *mean,
                                           const float *invstd, const float *weight,
                                           const float *bias, int64_t n, int64_t C) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = i % C;
    const float a = invstd[c] * (weight ? weight[c] : 1.0f);
    y[i] = (x[i] - mean[c]) * a + (bias ? bias[c] : 0.0f);
  }
}

extern "C" void ddp__cuda_batch_norm_forward(float *y, const float *x, const float *mean,
                                             const float *invstd, const float *weight,
                                             const float *bias, int64_t N, int64_t C,
                                             int64_t HW) {
  if (N <= 0 || C <= 0 || HW <= 0) return;
  cudaStream_t stream = ddp__cuda_stream();
  if (HW == 1) {
    forward_rows_kernel<<<ddp__cuda_blocks(N * C, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, stream>>>(
        y, x, mean, invstd, weight, bias, N * C, C);
    return;
  }
  DDP_ASSERT(N * C <= INT32_MAX);
  forward_planes_kernel<<<(unsigned)(N * C), plane_threads(HW), 0, stream>>>(
      y, x, mean, invstd, weight, bias, C, HW);
}

/* ---- backward ----
 * With M = N * HW, as cpu/norm.c: dbias += sum(dy), dweight += sum(dy (x -
 * mean)) invstd, and dx = kdy dy + kx (x - mean) + k0 with per-channel
 * coefficients from the two sums, in double (bn_dx_coefficients). */

/* HW == 1: the backward sums of channel c, row by row (the CPU's order),
 * into sums[c] and sums[C + c]. */
static __global__ void rows_backward_sums_kernel(double *sums, grad_src g, const float *x,
                                                 const float *mean, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float m = mean[c];
  double sdy = 0, sdyx = 0;
  for (int64_t n = 0; n < N; n++) {
    const float gv = grad_at(g, n * C + c, 1, 0);
    sdy += gv;
    sdyx += gv * (x[n * C + c] - m);
  }
  sums[c] = sdy;
  sums[C + c] = sdyx;
}

/* From channel c's backward sums (the totals of S partials each, in the
 * layout of channel_partials; S == 1 for sums already whole): copies them
 * to sums_out[c], sums_out[C + c] when not NULL, adds the weight and bias
 * gradients when wanted, and, when kdy is not NULL, the dx coefficients
 * kdy[c], kx[c], k0[c] over `count` elements. */
static __global__ void backward_channel_kernel(double *sums_out, float *dweight, float *dbias,
                                               float *kdy, float *kx, float *k0,
                                               const double *part, int64_t S,
                                               const float *invstd, const float *weight,
                                               int64_t C, double count, bool batch_stats) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double sdy = channel_total(part, c, S), sdyx = channel_total(part + C * S, c, S);
  if (sums_out) sums_out[c] = sdy, sums_out[C + c] = sdyx;
  if (dbias) dbias[c] += (float)sdy;
  if (dweight) dweight[c] += (float)(sdyx * invstd[c]);
  if (!kdy) return;
  const float is = invstd[c];
  double a = (double)(weight ? weight[c] : 1.0f) * is;
  double kxd = 0, k0d = 0;
  if (batch_stats) {
    kxd = -a * (double)is * is * sdyx / count;
    k0d = -a * sdy / count;
  }
  kdy[c] = (float)a;
  kx[c] = (float)kxd;
  k0[c] = (float)k0d;
}

/* dx = kdy dy + kx (x - mean) + k0, one block a plane; += when accumulate.
 * dx may be x: each element is read before its gradient is written. */
static __global__ void dx_planes_kernel(float *dx, grad_src g, const float *x, const float *mean,
                                        const float *kdy, const float *kx, const float *k0,
                                        int64_t C, int64_t HW, bool accumulate) {
  const int64_t p = blockIdx.x, c = p % C;
  const float m = mean[c], a = kdy[c], b = kx[c], z = k0[c];
  const float *plane = x + p * HW;
  float *d = dx + p * HW;
  for (int64_t i = threadIdx.x; i < HW; i += blockDim.x) {
    const float v = a * grad_at(g, p, HW, i) + b * (plane[i] - m) + z;
    d[i] = accumulate ? d[i] + v : v;
  }
}

/* (N, C) rows, as cpu/norm.c's rows_dx: d = (d or 0) + kdy g + kx (x - m) + k0. */
static __global__ void dx_rows_kernel(float *dx, grad_src g, const float *x, const float *mean,
                                      const float *kdy, const float *kx, const float *k0,
                                      int64_t n, int64_t C, bool accumulate) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = i % C;
    dx[i] = (accumulate ? dx[i] : 0.0f) + kdy[c] * grad_at(g, i, 1, 0) +
            kx[c] * (x[i] - mean[c]) + k0[c];
  }
}

static void launch_dx(float *dx, const grad_src &g, const float *x, const float *mean,
                      const float *k, int64_t N, int64_t C, int64_t HW, bool accumulate) {
  cudaStream_t stream = ddp__cuda_stream();
  if (HW == 1) {
    dx_rows_kernel<<<ddp__cuda_blocks(N * C, DDP__PW_BLOCK), DDP__PW_BLOCK, 0, stream>>>(
        dx, g, x, mean, k, k + C, k + 2 * C, N * C, C, accumulate);
    return;
  }
  DDP_ASSERT(N * C <= INT32_MAX);
  dx_planes_kernel<<<(unsigned)(N * C), plane_threads(HW), 0, stream>>>(
      dx, g, x, mean, k, k + C, k + 2 * C, C, HW, accumulate);
}

/* This rank's backward sums into `part` (2 C S doubles, S returned; for
 * HW == 1 S is 1 and part holds the sums themselves). */
static int64_t backward_sums(double *part, const grad_src &g, const float *x, const float *mean,
                             int64_t N, int64_t C, int64_t HW) {
  if (HW == 1) {
    rows_backward_sums_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, ddp__cuda_stream()>>>(
        part, g, x, mean, N, C);
    return 1;
  }
  const int64_t S = channel_splits(N, C);
  channel_partials<Q_BACKWARD>(part, g, x, mean, N, C, HW, S);
  return S;
}

static size_t backward_part_bytes(int64_t N, int64_t C, int64_t HW) {
  return (size_t)(2 * C * (HW == 1 ? 1 : channel_splits(N, C))) * sizeof(double);
}

extern "C" ddp_status ddp__cuda_batch_norm_backward(float *dx, float *dweight, float *dbias,
                                                    const ddp__bn_grad *dy, const float *x,
                                                    const float *mean, const float *invstd,
                                                    const float *weight, int64_t N, int64_t C,
                                                    int64_t HW, bool batch_stats,
                                                    bool accumulate, ddp_arena *arena) {
  if (C <= 0 || N <= 0 || HW <= 0) return DDP_OK;
  const grad_src g = grad_src_of(dy, HW);
  double *part = (double *)ddp_arena_alloc(arena, backward_part_bytes(N, C, HW));
  float *k = (float *)ddp_arena_alloc(arena, (size_t)(3 * C) * sizeof(float));
  if (!part || !k)
    return ddp_error(DDP_ERR_NOMEM, "batch_norm backward: no device scratch for %lld channels",
                     (long long)C);
  const int64_t S = backward_sums(part, g, x, mean, N, C, HW);
  backward_channel_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, ddp__cuda_stream()>>>(
      NULL, dweight, dbias, k, k + C, k + 2 * C, part, S, invstd, weight, C, (double)(N * HW),
      batch_stats);
  if (dx) launch_dx(dx, g, x, mean, k, N, C, HW, accumulate);
  return DDP_OK;
}

/* ---- synchronized batch norm: the phases apart ----
 * `sums` are host memory (they go through the caller's reduction across
 * ranks): computed here on the device and copied back synchronously, or
 * copied to the device before use. These entries take no arena, so their
 * device scratch comes from the caching allocator (no cudaMalloc after the
 * first step) and goes back to it when the work is queued; should it fail,
 * the outputs are NaN and the error is pending for the next synchronize
 * (ddp__cuda_defer). */

/* Sums whose computation failed (status, with the thread's last error
 * saying why): NaN, and the error pending for the next synchronize. */
static void poison_sums(double *sums, int64_t n, ddp_status status) {
  for (int64_t i = 0; i < n; i++) sums[i] = NAN;
  ddp__cuda_defer(status);
}

/* After the SUMS2 partials: the totals into sums (2C, device). */
static __global__ void sums_total_kernel(double *sums, const double *part, int64_t C, int64_t S) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  sums[c] = channel_total(part, c, S);
  sums[C + c] = channel_total(part + C * S, c, S);
}

/* HW == 1: sum and sum of squares of channel c in double, row by row. */
static __global__ void rows_sums_kernel(double *sums, const float *x, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s1 = 0, s2 = 0;
  for (int64_t n = 0; n < N; n++) {
    double v = x[n * C + c];
    s1 += v;
    s2 += v * v;
  }
  sums[c] = s1;
  sums[C + c] = s2;
}

extern "C" void ddp__cuda_batch_norm_sums(double *sums, const float *x, int64_t N, int64_t C,
                                          int64_t HW) {
  if (C <= 0) return;
  cudaStream_t stream = ddp__cuda_stream();
  const int64_t S = HW == 1 ? 1 : channel_splits(N, C);
  double *dev = (double *)ddp__cuda_malloc((size_t)(2 * C + (HW == 1 ? 0 : 2 * C * S)) *
                                           sizeof(double));
  if (!dev) {
    poison_sums(sums, 2 * C, DDP_ERR_NOMEM);
    return;
  }
  if (HW == 1) {
    rows_sums_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(dev, x, N, C);
  } else {
    double *part = dev + 2 * C;
    const grad_src none = no_grad();
    channel_partials<Q_SUMS2>(part, none, x, NULL, N, C, HW, S);
    sums_total_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(dev, part, C, S);
  }
  ddp_status s = ddp__cuda_copy(sums, dev, (size_t)(2 * C) * sizeof(double),
                                cudaMemcpyDeviceToHost);
  if (s != DDP_OK) poison_sums(sums, 2 * C, s);
  ddp__cuda_free(dev);
}

/* From the sums over every rank, as cpu/norm.c (sums on the device: the
 * layout of channel_partials with S == 1). */
static __global__ void stats_from_sums_kernel(float *mean, float *invstd, float *running_mean,
                                              float *running_var, const double *sums,
                                              int64_t count, int64_t C, float momentum,
                                              float eps) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  double m = sums[c] / (double)count;
  double var = sums[C + c] / (double)count - m * m;
  var = var > 0 ? var : 0;
  mean[c] = (float)m;
  invstd[c] = (float)(1.0 / sqrt(var + eps));
  running_update(running_mean, running_var, c, m, var, count, momentum);
}

extern "C" void ddp__cuda_batch_norm_stats_from_sums(float *mean, float *invstd,
                                                     float *running_mean, float *running_var,
                                                     const double *sums, int64_t count,
                                                     int64_t C, float momentum, float eps) {
  if (C <= 0) return;
  cudaStream_t stream = ddp__cuda_stream();
  double *dev = (double *)ddp__cuda_malloc((size_t)(2 * C) * sizeof(double));
  ddp_status s = dev ? ddp__cuda_copy(dev, sums, (size_t)(2 * C) * sizeof(double),
                                      cudaMemcpyHostToDevice)
                     : DDP_ERR_NOMEM;
  if (s != DDP_OK) {
    /* pending for the next synchronize; and all-ones bytes are a NaN, so
     * the failure also shows in every result made from these statistics */
    ddp__cuda_defer(s);
    cudaMemsetAsync(mean, 0xff, (size_t)C * sizeof(float), stream);
    cudaMemsetAsync(invstd, 0xff, (size_t)C * sizeof(float), stream);
    ddp__cuda_free(dev);
    return;
  }
  stats_from_sums_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, stream>>>(
      mean, invstd, running_mean, running_var, dev, count, C, momentum, eps);
  ddp__cuda_free(dev);
}

extern "C" void ddp__cuda_batch_norm_backward_reduce(double *sums, float *dweight, float *dbias,
                                                     const ddp__bn_grad *dy, const float *x,
                                                     const float *mean, const float *invstd,
                                                     int64_t N, int64_t C, int64_t HW) {
  if (C <= 0) return;
  const grad_src g = grad_src_of(dy, HW);
  const size_t part_bytes = backward_part_bytes(N, C, HW);
  double *dev = (double *)ddp__cuda_malloc((size_t)(2 * C) * sizeof(double) + part_bytes);
  if (!dev) {
    poison_sums(sums, 2 * C, DDP_ERR_NOMEM);
    return;
  }
  double *part = dev + 2 * C;
  const int64_t S = backward_sums(part, g, x, mean, N, C, HW);
  backward_channel_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, ddp__cuda_stream()>>>(
      dev, dweight, dbias, NULL, NULL, NULL, part, S, invstd, NULL, C, (double)(N * HW), true);
  ddp_status s = ddp__cuda_copy(sums, dev, (size_t)(2 * C) * sizeof(double),
                                cudaMemcpyDeviceToHost);
  if (s != DDP_OK) poison_sums(sums, 2 * C, s);
  ddp__cuda_free(dev);
}

extern "C" ddp_status ddp__cuda_batch_norm_backward_dx(float *dx, const ddp__bn_grad *dy,
                                                       const float *x, const float *mean,
                                                       const float *invstd, const float *weight,
                                                       const double *sums, int64_t count,
                                                       int64_t N, int64_t C, int64_t HW,
                                                       bool accumulate, ddp_arena *arena) {
  if (C <= 0 || N <= 0 || HW <= 0) return DDP_OK;
  const grad_src g = grad_src_of(dy, HW);
  double *dev = (double *)ddp_arena_alloc(arena, (size_t)(2 * C) * sizeof(double));
  float *k = (float *)ddp_arena_alloc(arena, (size_t)(3 * C) * sizeof(float));
  if (!dev || !k)
    return ddp_error(DDP_ERR_NOMEM,
                     "sync_batch_norm backward: no device scratch for %lld channels",
                     (long long)C);
  DDP_TRY(ddp__cuda_copy(dev, sums, (size_t)(2 * C) * sizeof(double), cudaMemcpyHostToDevice));
  backward_channel_kernel<<<channel_blocks(C), CHANNEL_BLOCK, 0, ddp__cuda_stream()>>>(
      NULL, NULL, NULL, k, k + C, k + 2 * C, dev, 1, invstd, weight, C, (double)count, true);
  launch_dx(dx, g, x, mean, k, N, C, HW, accumulate);
  return DDP_OK;
}
