/* CUDA basic kernels (kernels_basic.h): copies, fills and elementwise
 * arithmetic as grid-stride loops on the current device's stream, and the
 * sum of squares, reduced in double along a fixed tree so that it gives the
 * same bits every run (no atomics), then copied to the host. */
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/reduce.cuh"
#include "tensor/cuda/runtime.h"

#include <math.h>
#include <string.h>

#define BLOCK 256

/* Index of this thread in a 1-D grid-stride loop, and the loop's step. */
#define GRID_LOOP(i, n)                                                                    \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);               \
       i += (int64_t)gridDim.x * blockDim.x)

static __global__ void fill_kernel(float *dst, float value, int64_t n) {
  GRID_LOOP(i, n) dst[i] = value;
}

static __global__ void add_kernel(float *y, const float *a, const float *b, int64_t n) {
  GRID_LOOP(i, n) y[i] = a[i] + b[i];
}

static __global__ void mul_kernel(float *y, const float *a, const float *b, int64_t n) {
  GRID_LOOP(i, n) y[i] = a[i] * b[i];
}

/* y += alpha * x, rounded twice as the CPU loop is (no fma contraction). */
static __global__ void axpy_kernel(float *y, float alpha, const float *x, int64_t n) {
  GRID_LOOP(i, n) y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}

static __global__ void scale_kernel(float *x, float alpha, int64_t n) {
  GRID_LOOP(i, n) x[i] *= alpha;
}

static unsigned blocks(int64_t n) { return ddp__cuda_blocks(n, BLOCK); }

static void cuda_copy(float *dst, const float *src, int64_t n) {
  if (n <= 0 || dst == src) return;
  ddp__cuda_defer(ddp__cuda_check(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float),
                                                  cudaMemcpyDeviceToDevice, ddp__cuda_stream()),
                                  "copy"));
}

static void cuda_fill(float *dst, float value, int64_t n) {
  if (n <= 0) return;
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  if (bits == 0) { /* +0.0f is all zero bytes: the copy engine's memset does it */
    ddp__cuda_defer(ddp__cuda_check(
        cudaMemsetAsync(dst, 0, (size_t)n * sizeof(float), ddp__cuda_stream()), "fill"));
    return;
  }
  fill_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(dst, value, n);
}

static void cuda_add(float *y, const float *a, const float *b, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(y, a, b, n);
}

static void cuda_mul(float *y, const float *a, const float *b, int64_t n) {
  if (n <= 0) return;
  mul_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(y, a, b, n);
}

static void cuda_axpy(float *y, float alpha, const float *x, int64_t n) {
  if (n <= 0) return;
  axpy_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(y, alpha, x, n);
}

static void cuda_scale(float *x, float alpha, int64_t n) {
  if (n <= 0) return;
  scale_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(x, alpha, n);
}

/* ---- sum of squares --------------------------------------------------------
 * Two launches: SSQ_PARTS blocks at most each sum a fixed, strided share of
 * x in double (thread t of block b takes elements b*BLOCK + t + k*grid*BLOCK
 * in order) and reduce it along the block's tree into parts[b]; one block
 * then sums the parts the same way. The grid depends on n only, so a given
 * x gives the same bits on every run. */
#define SSQ_PARTS 1024

static __global__ void __launch_bounds__(BLOCK) ssq_parts_kernel(double *parts, const float *x,
                                                          int64_t n) {
  double s = 0.0;
  GRID_LOOP(i, n) s += (double)x[i] * (double)x[i];
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) parts[blockIdx.x] = s;
}

static __global__ void __launch_bounds__(BLOCK) ssq_total_kernel(double *total, const double *parts,
                                                          int64_t n_parts) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n_parts; i += BLOCK) s += parts[i];
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) *total = s;
}

/* Waits for the stream (the result is read on the host). NaN when the device
 * fails, with the error recorded (ddp_last_error): the caller, gradient-norm
 * clipping, then sees a non-finite norm rather than a made-up one. */
static double cuda_sum_squares(const float *x, int64_t n) {
  if (n <= 0) return 0.0;
  int64_t grid = (n + BLOCK * 8 - 1) / (BLOCK * 8); /* ~8 elements a thread */
  if (grid > SSQ_PARTS) grid = SSQ_PARTS;
  double *parts = (double *)ddp__cuda_malloc((size_t)(grid + 1) * sizeof(double));
  if (!parts) return NAN;
  cudaStream_t stream = ddp__cuda_stream();
  ssq_parts_kernel<<<(unsigned)grid, BLOCK, 0, stream>>>(parts, x, n);
  ssq_total_kernel<<<1, BLOCK, 0, stream>>>(parts + grid, parts, grid);
  double total = NAN;
  if (ddp__cuda_copy(&total, parts + grid, sizeof total, cudaMemcpyDeviceToHost) != DDP_OK)
    total = NAN;
  ddp__cuda_free(parts);
  return total;
}

extern "C" const ddp__basic_kernels ddp__cuda_basic_kernels = {
    .copy = cuda_copy,
    .fill = cuda_fill,
    .add = cuda_add,
    .axpy = cuda_axpy,
    .sum_squares = cuda_sum_squares,
    .scale = cuda_scale,
    .mul = cuda_mul,
};
