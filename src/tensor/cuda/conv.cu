/* CUDA 2-D convolution (NCHW, zero padding, dilation 1, groups 1), forward
 * and backward: the table's entries, which send each call to cuDNN
 * (cuda/conv_cudnn.c) or to im2col + cuBLAS over groups of samples (here),
 * as DDP_CUDA_CONV chooses (cuda/cudnn.h), and the im2col implementation.
 *
 * The column matrix of a group of g samples is laid out side by side,
 * col (C*KH*KW, g*OH*OW): sample s's columns are col[:, s*OH*OW ...], so
 * that
 *   - the forward is one strided batched gemm over the group, y_s (O, OH*OW)
 *     = w (O, K) @ col_s, whose outputs land straight in the NCHW y (no
 *     transpose, no scratch for the product), the bias broadcast into y
 *     first and added by beta = 1;
 *   - dW is one gemm over the whole group, dw (O, K) += dy_g (O, g*OH*OW) @
 *     col^T, with dy_g dy's group permuted to the same side-by-side layout:
 *     the sum over samples happens inside one gemm, in cuBLAS's fixed
 *     order, and groups are added in order, so dW is deterministic (no
 *     atomics, no per-sample launches: a batch of 1024 is a few launches);
 *   - dX is one gemm into columns, dcol (K, g*OH*OW) = w^T @ dy_g (into the
 *     column buffer, free once dW has read it), then col2im in gather form:
 *     each input pixel sums its (kh, kw) contributions in order (no atomics).
 * Groups rather than the whole batch at once because scratch grows with the
 * samples: a group is as many samples as fit in SCRATCH_FLOATS (128 MiB) of
 * columns (and permuted dy), which holds a batch of 100 of every seed's
 * convolution in one group and splits the ConvNet's conv2 at batch 1024
 * into three. db: sums per channel over (n, oh, ow) in two fixed-order
 * stages. Scratch comes from the arena (device memory). */
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/dense.h"
#include "tensor/cuda/reduce.cuh"

/* Floats of per-call scratch a group may use: columns and permuted dy. */
#define SCRATCH_FLOATS ((int64_t)1 << 25)

/* Samples per group when each costs `per_sample` floats of scratch. */
static int64_t group_size(int64_t n, int64_t per_sample) {
  int64_t g = per_sample > 0 ? SCRATCH_FLOATS / per_sample : n;
  if (g > n) g = n;
  return g < 1 ? 1 : g;
}

static bool fits_int32(int64_t elements) { return elements < ((int64_t)1 << 30); }

#define GRID_LOOP(I, i, n)                                                                 \
  for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < (n);                      \
       i += (I)gridDim.x * (I)blockDim.x)

/* The geometry as kernel arguments, in the index type I. */
template <typename I> struct conv_dims {
  I c, h, w, o, kh, kw, stride, pad, oh, ow;
};

template <typename I> static conv_dims<I> dims_of(const ddp__conv2d_geom *g) {
  return conv_dims<I>{(I)g->c,  (I)g->h,      (I)g->w,   (I)g->o,  (I)g->kh,
                      (I)g->kw, (I)g->stride, (I)g->pad, (I)g->oh, (I)g->ow};
}

/* col (K, s*P) for the `samples` samples of x (samples, C, H, W), P = OH*OW:
 * col[(c*KH + a)*KW + b][s*P + i*OW + j] = x_s[c][i*stride - pad + a]
 * [j*stride - pad + b], zero outside the image. One thread per element of
 * col, consecutive threads along a row of it. */
template <typename I>
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    im2col_kernel(float *col, const float *x, I samples, conv_dims<I> d) {
  const I p_per = d.oh * d.ow, row = samples * p_per;
  const I total = d.c * d.kh * d.kw * row;
  GRID_LOOP(I, e, total) {
    const I k = e / row, q = e % row;
    const I s = q / p_per, p = q % p_per;
    const I i = p / d.ow, j = p % d.ow;
    const I b = k % d.kw, a = (k / d.kw) % d.kh, c = k / d.kw / d.kh;
    const I ih = i * d.stride - d.pad + a, iw = j * d.stride - d.pad + b;
    col[e] = ih >= 0 && ih < d.h && iw >= 0 && iw < d.w
                 ? x[((s * d.c + c) * d.h + ih) * d.w + iw]
                 : 0.0f;
  }
}

/* dx (samples, C, H, W) (+)= col2im(dcol (K, s*P)): input pixel (c, ih, iw)
 * of sample s takes, for each kernel tap (a, b) in order, dcol's element of
 * the output (i, j) with i*stride - pad + a = ih and j*stride - pad + b = iw,
 * where one exists. Starts from dx (accumulate) or 0. */
template <typename I>
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    col2im_kernel(float *dx, const float *dcol, I samples, conv_dims<I> d, bool accumulate) {
  const I p_per = d.oh * d.ow, row = samples * p_per;
  const I total = samples * d.c * d.h * d.w;
  GRID_LOOP(I, e, total) {
    const I iw = e % d.w, ih = (e / d.w) % d.h, c = (e / d.w / d.h) % d.c;
    const I s = e / d.w / d.h / d.c;
    float sum = accumulate ? dx[e] : 0.0f;
    for (I a = 0; a < d.kh; a++) {
      const I ti = ih + d.pad - a; /* i * stride */
      if (ti < 0 || ti % d.stride != 0 || ti / d.stride >= d.oh) continue;
      const I i = ti / d.stride;
      for (I b = 0; b < d.kw; b++) {
        const I tj = iw + d.pad - b;
        if (tj < 0 || tj % d.stride != 0 || tj / d.stride >= d.ow) continue;
        const I j = tj / d.stride;
        sum += dcol[((c * d.kh + a) * d.kw + b) * row + s * p_per + i * d.ow + j];
      }
    }
    dx[e] = sum;
  }
}

/* dyp (O, s*P) = dy (s, O, P) with the samples side by side per channel. */
template <typename I>
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    permute_kernel(float *dyp, const float *dy, I samples, I o, I p_per) {
  const I row = samples * p_per, total = o * row;
  GRID_LOOP(I, e, total) {
    const I ch = e / row, q = e % row;
    const I s = q / p_per, p = q % p_per;
    dyp[e] = dy[(s * o + ch) * p_per + p];
  }
}

/* y (N, O, P) = b[o] along each plane */
static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    bias_planes_kernel(float *y, const float *b, int64_t n, int64_t o, int64_t p_per) {
  GRID_LOOP(int64_t, e, n * o * p_per) y[e] = b[(e / p_per) % o];
}

/* ---- db: per-channel sums of dy (N, O, P) over n and p -------------------
 * Stage 1: block (ch, part) sums part `part` of channel ch's N*P elements
 * (thread t takes elements t, t + BLOCK, ... of the part, in order) and
 * reduces them along a fixed tree into parts[ch * n_parts + part]. Stage 2:
 * one thread per channel adds its parts in order into db. */
#define DB_MAX_PARTS 64

static __global__ void __launch_bounds__(DDP__CUDA_BLOCK)
    channel_parts_kernel(float *parts, const float *dy, int64_t n, int64_t o, int64_t p_per,
                         int64_t n_parts) {
  const int64_t ch = blockIdx.x, part = blockIdx.y, count = n * p_per;
  const int64_t per_part = (count + n_parts - 1) / n_parts;
  const int64_t lo = part * per_part, hi = lo + per_part < count ? lo + per_part : count;
  float s = 0.0f;
  for (int64_t e = lo + threadIdx.x; e < hi; e += DDP__CUDA_BLOCK)
    s += dy[((e / p_per) * o + ch) * p_per + e % p_per];
  s = ddp__block_sum(s);
  if (threadIdx.x == 0) parts[ch * n_parts + part] = s;
}

static __global__ void channel_sums_add_kernel(float *db, const float *parts, int64_t o,
                                               int64_t n_parts) {
  GRID_LOOP(int64_t, ch, o) {
    float s = parts[ch * n_parts];
    for (int64_t t = 1; t < n_parts; t++) s += parts[ch * n_parts + t];
    db[ch] += s;
  }
}

static float *scratch(ddp_arena *arena, int64_t floats, const char *what, ddp_status *status) {
  float *p = (float *)ddp_arena_alloc(arena, (size_t)floats * sizeof(float));
  if (!p)
    *status = ddp_error(DDP_ERR_NOMEM, "conv2d on cuda: cannot allocate %lld floats of %s",
                        (long long)floats, what);
  return p;
}

static ddp_status cublas_status(cublasStatus_t st, const char *what) {
  return st == CUBLAS_STATUS_SUCCESS ? DDP_OK : ddp__cublas_check(st, what);
}

static ddp_status bias_grad(float *db, const float *dy, const ddp__conv2d_geom *g,
                            ddp_arena *arena) {
  const int64_t p_per = g->oh * g->ow, count = g->n * p_per;
  int64_t n_parts = (count + DDP__CUDA_BLOCK * 8 - 1) / (DDP__CUDA_BLOCK * 8);
  if (n_parts > DB_MAX_PARTS) n_parts = DB_MAX_PARTS;
  if (n_parts < 1) n_parts = 1;
  ddp_status status = DDP_OK;
  float *parts = scratch(arena, g->o * n_parts, "bias-gradient partial sums", &status);
  if (!parts) return status;
  cudaStream_t stream = ddp__cuda_stream();
  channel_parts_kernel<<<dim3((unsigned)g->o, (unsigned)n_parts), DDP__CUDA_BLOCK, 0, stream>>>(
      parts, dy, g->n, g->o, p_per, n_parts);
  channel_sums_add_kernel<<<ddp__cuda_blocks(g->o, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK, 0,
                            stream>>>(db, parts, g->o, n_parts);
  return DDP_OK;
}

/* col (K, samples*P) from x (samples, C, H, W) */
static void im2col(float *col, const float *x, int64_t samples, const ddp__conv2d_geom *g) {
  const int64_t total = g->c * g->kh * g->kw * samples * g->oh * g->ow;
  const unsigned grid = ddp__cuda_blocks(total, DDP__CUDA_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  if (fits_int32(total) && fits_int32(samples * g->c * g->h * g->w))
    im2col_kernel<int32_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(col, x, (int32_t)samples,
                                                                 dims_of<int32_t>(g));
  else
    im2col_kernel<int64_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(col, x, samples,
                                                                 dims_of<int64_t>(g));
}

/* dx (samples, C, H, W) (+)= col2im(dcol (K, samples*P)) */
static void col2im(float *dx, const float *dcol, int64_t samples, const ddp__conv2d_geom *g,
                   bool accumulate) {
  const int64_t total = samples * g->c * g->h * g->w;
  const unsigned grid = ddp__cuda_blocks(total, DDP__CUDA_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  if (fits_int32(total) && fits_int32(g->c * g->kh * g->kw * samples * g->oh * g->ow))
    col2im_kernel<int32_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        dx, dcol, (int32_t)samples, dims_of<int32_t>(g), accumulate);
  else
    col2im_kernel<int64_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(dx, dcol, samples,
                                                                 dims_of<int64_t>(g), accumulate);
}

/* dyp (O, samples*P) from dy (samples, O, P) */
static void permute(float *dyp, const float *dy, int64_t samples, const ddp__conv2d_geom *g) {
  const int64_t p_per = g->oh * g->ow, total = g->o * samples * p_per;
  const unsigned grid = ddp__cuda_blocks(total, DDP__CUDA_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  if (fits_int32(total))
    permute_kernel<int32_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(
        dyp, dy, (int32_t)samples, (int32_t)g->o, (int32_t)p_per);
  else
    permute_kernel<int64_t><<<grid, DDP__CUDA_BLOCK, 0, stream>>>(dyp, dy, samples, g->o,
                                                                  p_per);
}

ddp_status ddp__cuda_conv2d_forward_im2col(float *y, const float *x, const float *w,
                                           const float *b, const ddp__conv2d_geom *g,
                                           ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, p_per = g->oh * g->ow, chw = g->c * g->h * g->w;
  if (g->n <= 0 || g->o <= 0 || p_per <= 0) return DDP_OK;
  cudaStream_t stream = ddp__cuda_stream();
  if (b)
    bias_planes_kernel<<<ddp__cuda_blocks(g->n * g->o * p_per, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK,
                         0, stream>>>(y, b, g->n, g->o, p_per);
  if (k <= 0) { /* an empty kernel: y is the bias, or 0 */
    if (b) return DDP_OK;
    return ddp__cuda_check(
        cudaMemsetAsync(y, 0, (size_t)(g->n * g->o * p_per) * sizeof(float), stream),
        "conv2d forward: clearing y");
  }
  cublasHandle_t handle = ddp__cuda_cublas();
  if (!handle) return cublas_status(CUBLAS_STATUS_NOT_INITIALIZED, "conv2d forward");
  const int64_t group = group_size(g->n, k * p_per);
  ddp_status status = DDP_OK;
  float *col = scratch(arena, k * group * p_per, "columns", &status);
  if (!col) return status;
  const float alpha = 1.0f, beta = b ? 1.0f : 0.0f;
  for (int64_t n0 = 0; n0 < g->n; n0 += group) {
    const int64_t s = g->n - n0 < group ? g->n - n0 : group;
    im2col(col, x + n0 * chw, s, g);
    /* For each sample i of the group, y_i (O, P) = w (O, K) @ col_i (K, P;
     * row stride s*P). Column-major, as cuBLAS reads it: y_i^T (P, O) =
     * col_i^T (P, K; ld s*P, next sample P further) @ w^T (K, O; ld K, the
     * same for every sample: stride 0), into ld P, next sample O*P further. */
    DDP_TRY(cublas_status(cublasSgemmStridedBatched_64(
                              handle, CUBLAS_OP_N, CUBLAS_OP_N, p_per, g->o, k, &alpha, col,
                              s * p_per, p_per, w, k, 0, &beta, y + n0 * g->o * p_per, p_per,
                              g->o * p_per, s),
                          "conv2d forward: gemm"));
  }
  return DDP_OK;
}

ddp_status ddp__cuda_conv2d_backward_im2col(float *dx, float *dw, float *db, const float *dy,
                                            const float *x, const float *w,
                                            const ddp__conv2d_geom *g, bool dx_accumulate,
                                            ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, p_per = g->oh * g->ow, chw = g->c * g->h * g->w;
  if (g->n <= 0) return DDP_OK;
  if (db && g->o > 0 && p_per > 0) DDP_TRY(bias_grad(db, dy, g, arena));
  if (!dx && !dw) return DDP_OK;
  if (g->o <= 0 || p_per <= 0 || k <= 0) {
    /* no output or no kernel taps: nothing reaches dw (an empty one, or
     * one with no term) and dx receives nothing */
    if (!dx || dx_accumulate) return DDP_OK;
    return ddp__cuda_check(
        cudaMemsetAsync(dx, 0, (size_t)(g->n * chw) * sizeof(float), ddp__cuda_stream()),
        "conv2d backward: clearing dx");
  }
  const int64_t group = group_size(g->n, (k + g->o) * p_per);
  ddp_status status = DDP_OK;
  float *col = scratch(arena, k * group * p_per, "columns", &status); /* col, then dcol */
  if (!col) return status;
  float *dyp = scratch(arena, g->o * group * p_per, "permuted dy", &status);
  if (!dyp) return status;
  for (int64_t n0 = 0; n0 < g->n; n0 += group) {
    const int64_t s = g->n - n0 < group ? g->n - n0 : group, cols = s * p_per;
    permute(dyp, dy + n0 * g->o * p_per, s, g); /* (O, s*P) */
    if (dw) {
      /* x's group is read here, before its dx is written below: dx may be
       * x (the contract), and later groups read only their own samples */
      im2col(col, x + n0 * chw, s, g);
      /* dw (O, K) += dyp (O, s*P) @ col^T (s*P, K) */
      DDP_TRY(cublas_status(ddp__cuda_gemm_status(false, true, g->o, k, cols, 1.0f, dyp, cols,
                                                  col, cols, 1.0f, dw, k),
                            "conv2d backward: weight gemm"));
    }
    if (dx) {
      /* dcol (K, s*P) = w^T (K, O) @ dyp (O, s*P), into col (dw has read it) */
      DDP_TRY(cublas_status(ddp__cuda_gemm_status(true, false, k, cols, g->o, 1.0f, w, k, dyp,
                                                  cols, 0.0f, col, cols),
                            "conv2d backward: input gemm"));
      col2im(dx + n0 * chw, col, s, g, dx_accumulate);
    }
  }
  return DDP_OK;
}

/* ---- The table's entries: cuDNN or im2col, per call ---------------------- */

ddp_status ddp__cuda_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                    const ddp__conv2d_geom *g, ddp_arena *arena) {
  bool use_cudnn;
  DDP_TRY(ddp__cuda_conv_pick_pass(false, false, g, &use_cudnn));
#ifdef DDP_HAVE_CUDNN
  if (use_cudnn) return ddp__cudnn_conv2d_forward(y, x, w, b, g, arena);
#endif
  return ddp__cuda_conv2d_forward_im2col(y, x, w, b, g, arena);
}

ddp_status ddp__cuda_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                     const float *x, const float *w, const ddp__conv2d_geom *g,
                                     bool dx_accumulate, ddp_arena *arena) {
  bool use_cudnn;
  DDP_TRY(ddp__cuda_conv_pick_pass(true, dx != NULL, g, &use_cudnn));
#ifdef DDP_HAVE_CUDNN
  if (use_cudnn) return ddp__cudnn_conv2d_backward(dx, dw, db, dy, x, w, g, dx_accumulate, arena);
#endif
  return ddp__cuda_conv2d_backward_im2col(dx, dw, db, dy, x, w, g, dx_accumulate, arena);
}

/* Autocast's 16-bit convolution: cuDNN when the choice (DDP_CUDA_CONV)
 * allows it and the build has it; im2col has no 16-bit path, so
 * otherwise *done stays false and the op layer computes on rounded
 * float32 operands (the same values within the bound, float32's speed). */
extern "C" ddp_status ddp__cuda_conv2d_forward_low(bool bf16, float *y, const uint16_t *x,
                                                   const uint16_t *w, const float *b,
                                                   const ddp__conv2d_geom *g, ddp_arena *arena,
                                                   bool *done) {
  *done = false;
#ifdef DDP_HAVE_CUDNN
  bool use_cudnn = false;
  if (ddp__cuda_conv_pick(&use_cudnn) == DDP_OK && use_cudnn)
    return ddp__cudnn_conv2d_forward_low(bf16, y, x, w, b, g, arena, done);
#else
  (void)bf16, (void)y, (void)x, (void)w, (void)b, (void)g, (void)arena;
#endif
  return DDP_OK;
}

extern "C" ddp_status ddp__cuda_conv2d_backward_low(bool bf16, float *dx, float *dw,
                                                    const uint16_t *dy, const uint16_t *x,
                                                    const uint16_t *w, const ddp__conv2d_geom *g,
                                                    ddp_arena *arena, bool *done) {
  *done = false;
#ifdef DDP_HAVE_CUDNN
  bool use_cudnn = false;
  if (ddp__cuda_conv_pick(&use_cudnn) == DDP_OK && use_cudnn)
    return ddp__cudnn_conv2d_backward_low(bf16, dx, dw, dy, x, w, g, arena, done);
#else
  (void)bf16, (void)dx, (void)dw, (void)dy, (void)x, (void)w, (void)g, (void)arena;
#endif
  return DDP_OK;
}
