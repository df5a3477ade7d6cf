/* CUDA basic kernels (kernels_basic.h): copies, fills and elementwise
 * arithmetic as grid-stride loops on the current device's stream, and the
 * sum of squares, reduced in double along a fixed tree so that it gives the
 * same bits every run (no atomics), then copied to the host. */
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/reduce.cuh"
#include "tensor/cuda/runtime.h"

#include <math.h>
#include <pthread.h>
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

/* IEEE division (nvcc's default -prec-div=true; __fdiv_rn says so
 * whatever the flags): the CPU loop's quotient, bit for bit. */
static __global__ void div_kernel(float *x, float d, int64_t n) {
  GRID_LOOP(i, n) x[i] = __fdiv_rn(x[i], d);
}

/* ddp_float_to_half / _bf16 and back (include/ddp/tensor.h), bit for bit:
 * the same integer steps, and the subnormal path's float add rounded to
 * nearest as on the CPU (__fadd_rn, __fmul_rn: no flush to zero either
 * way, nvcc's default -ftz=false). */
static __device__ uint16_t to_half_bits(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= 0x47800000u) {
    uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);
    out = u > 0x7f800000u ? nan : 0x7c00u;
  } else if (u < 0x38800000u) {
    const uint32_t magic = (127u - 15u + 23u - 10u + 1u) << 23;
    out = __float_as_uint(__fadd_rn(__uint_as_float(u), __uint_as_float(magic))) - magic;
  } else {
    uint32_t mant_odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd;
    out = u >> 13;
  }
  return (uint16_t)(out | (sign >> 16));
}

static __device__ float from_half_bits(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  uint32_t scaled =
      __float_as_uint(__fmul_rn(__uint_as_float(em << 13), 5192296858534827628530496329220096.0f));
  uint32_t special = (em << 13) | 0x7f800000u | (em > 0x7c00u ? 0x400000u : 0u);
  uint32_t bits = em >= 0x7c00u ? special : scaled;
  return __uint_as_float(bits | sign);
}

static __device__ uint16_t to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static __global__ void to_half_kernel(uint16_t *dst, const float *src, float d, int64_t n,
                                      bool bf16) {
  GRID_LOOP(i, n) {
    float q = __fdiv_rn(src[i], d);
    dst[i] = bf16 ? to_bf16_bits(q) : to_half_bits(q);
  }
}

static __global__ void from_half_kernel(float *dst, const uint16_t *src, int64_t n, bool bf16) {
  GRID_LOOP(i, n) dst[i] = bf16 ? __uint_as_float((uint32_t)src[i] << 16) : from_half_bits(src[i]);
}

/* Autocast's rounding: each float to the nearest float16 (bfloat16) value,
 * ties to even, kept as float32: from_half(to_half(x)) bit for bit. */
static __global__ void round_low_kernel(float *dst, const float *src, int64_t n, bool bf16) {
  GRID_LOOP(i, n) {
    const float v = src[i];
    dst[i] = bf16 ? __uint_as_float((uint32_t)to_bf16_bits(v) << 16)
                  : from_half_bits(to_half_bits(v));
  }
}

/* The GradScaler's unscale and inf/NaN check in one pass: the exponent
 * test on the bits, x *= inv (skipped when inv is 1, as PyTorch's
 * _amp_foreach_non_finite_check_and_unscale_), and *found set to 1 by any
 * thread that saw a non-finite value (a plain store of 1 from any number
 * of threads: the result does not depend on their order). */
static __global__ void unscale_check_kernel(float *x, float inv, int64_t n, int *found) {
  bool any = false;
  GRID_LOOP(i, n) {
    const float v = x[i];
    any |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    if (inv != 1.0f) x[i] = __fmul_rn(v, inv);
  }
  if (__syncthreads_or(any) && threadIdx.x == 0) *found = 1;
}

static unsigned blocks(int64_t n) { return ddp__cuda_blocks(n, BLOCK); }

static void cuda_round_low(float *dst, const float *src, int64_t n, bool bf16) {
  if (n <= 0) return;
  round_low_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(dst, src, n, bf16);
}

/* Each device's flag: one int of device memory, made on the first unscale
 * on that device and kept (a steady step allocates nothing). */
#define UNSCALE_DEVICES 64
static int *unscale_flags[UNSCALE_DEVICES];
static pthread_mutex_t unscale_lock = PTHREAD_MUTEX_INITIALIZER;

static int *unscale_flag(void) {
  const int dev = ddp__cuda_current_device();
  if (dev < 0 || dev >= UNSCALE_DEVICES) return NULL;
  pthread_mutex_lock(&unscale_lock);
  if (!unscale_flags[dev]) unscale_flags[dev] = (int *)ddp__cuda_malloc(sizeof(int));
  int *flag = unscale_flags[dev];
  pthread_mutex_unlock(&unscale_lock);
  return flag;
}

/* The flag is zeroed, set by the kernel and read back on the host (one
 * small copy, which waits: the optimizer step's decision needs it). Two
 * threads unscaling on one device at once would share the flag: the
 * trainer unscales once per step on its thread. */
static bool cuda_unscale_check(float *x, float inv, int64_t n) {
  if (n <= 0) return false;
  int *flag = unscale_flag();
  if (!flag) {
    ddp__cuda_defer(ddp_error(DDP_ERR_NOMEM, "cuda:%d: unscale: no device memory for the "
                              "inf/NaN flag", ddp__cuda_current_device()));
    return true; /* unknown: the caller must not step on these gradients */
  }
  cudaStream_t stream = ddp__cuda_stream();
  ddp_status s = ddp__cuda_check(cudaMemsetAsync(flag, 0, sizeof(int), stream), "unscale");
  int found = 0;
  if (s == DDP_OK) {
    unscale_check_kernel<<<blocks(n), BLOCK, 0, stream>>>(x, inv, n, flag);
    s = ddp__cuda_copy(&found, flag, sizeof found, cudaMemcpyDeviceToHost);
  }
  if (s != DDP_OK) {
    ddp__cuda_defer(s);
    return true; /* unknown: the caller must not step on these gradients */
  }
  return found != 0;
}

static void cuda_div(float *x, float d, int64_t n) {
  if (n <= 0) return;
  div_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(x, d, n);
}

static void cuda_to_half(uint16_t *dst, const float *src, float d, int64_t n, bool bf16) {
  if (n <= 0) return;
  to_half_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(dst, src, d, n, bf16);
}

static void cuda_from_half(float *dst, const uint16_t *src, int64_t n, bool bf16) {
  if (n <= 0) return;
  from_half_kernel<<<blocks(n), BLOCK, 0, ddp__cuda_stream()>>>(dst, src, n, bf16);
}

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
    .div = cuda_div,
    .to_half = cuda_to_half,
    .from_half = cuda_from_half,
    .round_low = cuda_round_low,
    .unscale_check = cuda_unscale_check,
};
