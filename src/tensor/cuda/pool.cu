/* CUDA max pooling (no padding, floor mode) and its backward, with the CPU
 * kernel's semantics to the bit (cpu/pool.c): the comparison is
 * `v > max || isnan(v)` in row-major window order, so the first maximum
 * wins a tie and a NaN propagates; relu applies to the window's max and a
 * window it closes (y not > 0) gets argmax -1; the affine map is
 * (x - center) * scale + shift with three roundings (no fma, as the CPU and
 * batch_norm_forward compute it), so argmax is the CPU's exactly.
 * The backward gathers: each input element sums, in window order, the
 * gradients of the windows whose argmax points at it, which gives the CPU's
 * scatter-add result bit for bit with overlapping windows too, and needs no
 * atomics. */
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/dense.h"

/* Index arithmetic in I: int32_t when every index fits, which makes the
 * divisions several times cheaper, else int64_t. */
template <typename I>
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    pool_forward_kernel(float *y, void *argmax, int arg_bytes, float *argval, const float *x,
                        I planes, I h, I w, I kernel, I stride, I oh, I ow, bool relu,
                        const float *center, const float *scale, const float *shift,
                        I channels) {
  const I windows = planes * oh * ow;
  for (I o = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; o < windows;
       o += (I)gridDim.x * (I)blockDim.x) {
    const I j = o % ow, i = (o / ow) % oh, p = o / ow / oh;
    const float *xw = x + (p * h + i * stride) * w + j * stride; /* the window's top left */
    float ctr = 0.0f, sc = 0.0f, sh = 0.0f;
    if (center) {
      const I c = p % channels;
      ctr = center[c], sc = scale[c], sh = shift[c];
    }
    float m = -INFINITY, raw = xw[0];
    int32_t at = 0; /* the max's place in the window */
    for (I a = 0; a < kernel; a++)
      for (I b = 0; b < kernel; b++) {
        const float xv = xw[a * w + b];
        float v = xv;
        if (center) v = __fadd_rn(__fmul_rn(__fsub_rn(v, ctr), sc), sh);
        if (v > m || isnan(v)) {
          m = v;
          raw = xv;
          at = (int32_t)(a * kernel + b);
        }
      }
    if (relu && m < 0.0f) m = 0.0f;
    if (relu && !(m > 0.0f)) at = -1; /* closed by relu */
    y[o] = m;
    if (argmax) {
      if (arg_bytes == 1)
        ((int8_t *)argmax)[o] = (int8_t)at;
      else
        ((int32_t *)argmax)[o] = at;
    }
    if (argval) argval[o] = raw;
  }
}

/* One thread per input element (plane p, row r, column c). The windows
 * holding it are rows i with i*stride <= r < i*stride + kernel, likewise
 * columns j; it receives window (i, j)'s gradient when that window's argmax
 * is its place there, (r - i*stride)*kernel + (c - j*stride) (-1, a closed
 * window, matches no place). Windows in row-major order, the CPU scatter's,
 * starting from dx (accumulate) or 0. */
template <typename I>
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    pool_backward_kernel(float *dx, const float *dy, const void *argmax, int arg_bytes, I planes,
                         I h, I w, I kernel, I stride, I oh, I ow, bool accumulate) {
  const I elements = planes * h * w;
  for (I e = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; e < elements;
       e += (I)gridDim.x * (I)blockDim.x) {
    const I c = e % w, r = (e / w) % h, p = e / w / h;
    const I i_lo = r >= kernel ? (r - kernel) / stride + 1 : 0;
    const I j_lo = c >= kernel ? (c - kernel) / stride + 1 : 0;
    I i_hi = r / stride, j_hi = c / stride; /* inclusive */
    if (i_hi > oh - 1) i_hi = oh - 1;
    if (j_hi > ow - 1) j_hi = ow - 1;
    float s = accumulate ? dx[e] : 0.0f;
    for (I i = i_lo; i <= i_hi; i++)
      for (I j = j_lo; j <= j_hi; j++) {
        const I win = (p * oh + i) * ow + j;
        const int32_t code = arg_bytes == 1 ? (int32_t)((const int8_t *)argmax)[win]
                                            : ((const int32_t *)argmax)[win];
        if (code == (int32_t)((r - i * stride) * kernel + (c - j * stride))) s += dy[win];
      }
    dx[e] = s;
  }
}

/* Whether every index of a launch over these sizes fits in int32 (with
 * room for the grid-stride step past the end). */
static bool fits_int32(int64_t elements) { return elements < ((int64_t)1 << 30); }

void ddp__cuda_max_pool2d_forward(float *y, void *argmax, float *argval, const float *x,
                                  int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                  int64_t stride, int64_t oh, int64_t ow, bool relu,
                                  const ddp__pool_affine *affine) {
  const int64_t windows = planes * oh * ow;
  if (windows <= 0) return;
  const int bytes = (int)ddp__pool_arg_bytes(kernel);
  const float *center = affine ? affine->center : NULL, *scale = affine ? affine->scale : NULL,
              *shift = affine ? affine->shift : NULL;
  const int64_t channels = affine ? affine->channels : 1;
  const unsigned grid = ddp__cuda_blocks(windows, DDP__CUDA_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  if (fits_int32(planes * h * w) && fits_int32(windows))
    pool_forward_kernel<int32_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        y, argmax, bytes, argval, x, (int32_t)planes, (int32_t)h, (int32_t)w, (int32_t)kernel,
        (int32_t)stride, (int32_t)oh, (int32_t)ow, relu, center, scale, shift,
        (int32_t)channels);
  else
    pool_forward_kernel<int64_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        y, argmax, bytes, argval, x, planes, h, w, kernel, stride, oh, ow, relu, center, scale,
        shift, channels);
}

void ddp__cuda_max_pool2d_backward(float *dx, const float *dy, const void *argmax,
                                   int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                   int64_t stride, int64_t oh, int64_t ow, bool accumulate) {
  const int64_t elements = planes * h * w;
  if (elements <= 0) return;
  const int bytes = (int)ddp__pool_arg_bytes(kernel);
  const unsigned grid = ddp__cuda_blocks(elements, DDP__CUDA_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  if (fits_int32(elements) && fits_int32(planes * oh * ow))
    pool_backward_kernel<int32_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        dx, dy, argmax, bytes, (int32_t)planes, (int32_t)h, (int32_t)w, (int32_t)kernel,
        (int32_t)stride, (int32_t)oh, (int32_t)ow, accumulate);
  else
    pool_backward_kernel<int64_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        dx, dy, argmax, bytes, planes, h, w, kernel, stride, oh, ow, accumulate);
}
