/* CUDA dense kernels: gemm through cuBLAS (float32, TF32 off: the handle's
 * math mode, src/tensor/cuda/runtime.h; TF32 only when a run opts in,
 * ddp_cuda_allow_tf32; autocast's 16-bit GEMMs below), linear layers on top of it, and
 * the table that also holds convolution (cuda/conv.cu) and pooling
 * (cuda/pool.cu). Bias gradients are column sums reduced in a fixed order
 * by one kernel, never with atomics, so every run gives the same bits. */
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/dense.h"

extern "C" {
#include "ddp/tensor.h" /* ddp_cuda_tf32_allowed */
}

/* c (m, n; row stride ldc) *= beta, where beta 0 clears c, NaN included
 * (BLAS's rule, and the CPU path's memset). */
static __global__ void scale_rows_kernel(float *c, float beta, int64_t m, int64_t n, int64_t ldc) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m * n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float *at = c + (i / n) * ldc + i % n;
    *at = beta == 0.0f ? 0.0f : *at * beta;
  }
}

/* Our matrices are row-major, cuBLAS's column-major. A row-major (r, c)
 * matrix with row stride ld is, read column-major, its transpose (c, r)
 * with leading dimension ld. So c = op(a) @ op(b) row-major is
 * c^T = op(b)^T @ op(a)^T column-major: cuBLAS gets b first and a second,
 * each with its own transpose flag, m and n swapped, the strides as they
 * are. The 64-bit interface takes our int64 sizes as they are. */
cublasStatus_t ddp__cuda_gemm_status(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                     float alpha, const float *a, int64_t lda, const float *b,
                                     int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m <= 0 || n <= 0) return CUBLAS_STATUS_SUCCESS;
  cublasHandle_t handle = ddp__cuda_cublas();
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (k <= 0) { /* the product is empty: c = beta * c */
    scale_rows_kernel<<<ddp__cuda_blocks(m * n, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK, 0,
                        ddp__cuda_stream()>>>(c, beta, m, n, ldc);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (ddp_cuda_tf32_allowed()) /* the opt-in (ddp_cuda_allow_tf32): tensor cores on TF32 */
    return cublasGemmEx_64(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                           trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, CUDA_R_32F,
                           ldb, a, CUDA_R_32F, lda, &beta, c, CUDA_R_32F, ldc,
                           CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
  return cublasSgemm_64(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                        trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, ldb, a, lda,
                        &beta, c, ldc);
}

/* The table's entry returns nothing: a failure (bad arguments, which the op
 * layer's shape checks rule out, or a handle that never started) becomes
 * the device's pending error, reported by the next synchronize. */
static void cuda_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                      float *c, int64_t ldc) {
  cublasStatus_t st =
      ddp__cuda_gemm_status(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (st != CUBLAS_STATUS_SUCCESS) ddp__cuda_defer(ddp__cublas_check(st, "gemm"));
}

/* y (rows, out) = broadcast of b (out) along the rows */
static __global__ void rows_from_bias_kernel(float *y, const float *b, int64_t rows, int64_t out) {
  const int64_t n = rows * out;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = b[i % out];
}

/* y (rows, out) = x (rows, in) @ w^T (in, out) + b: the bias broadcast into
 * y, then the gemm with beta 1 (the CPU's order). */
static void cuda_linear_forward(float *y, const float *x, const float *w, const float *b,
                                int64_t rows, int64_t in, int64_t out) {
  if (rows <= 0 || out <= 0) return;
  if (b)
    rows_from_bias_kernel<<<ddp__cuda_blocks(rows * out, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK, 0,
                            ddp__cuda_stream()>>>(y, b, rows, out);
  cuda_gemm(false, true, rows, out, in, 1.0f, x, in, w, in, b ? 1.0f : 0.0f, y, out);
}

/* db (cols) += the column sums of dy (rows, cols). A block takes COLSUM_X
 * columns; its thread (tx, ty) sums rows ty, ty + COLSUM_Y, ... of column
 * tx in order (consecutive tx read consecutive floats), and row ty == 0
 * adds the COLSUM_Y partial sums in order of ty. Fixed order, no atomics. */
#define COLSUM_X 32
#define COLSUM_Y 16
static __global__ void __launch_bounds__(COLSUM_X * COLSUM_Y)
    column_sums_add_kernel(float *db, const float *dy, int64_t rows, int64_t cols) {
  __shared__ float part[COLSUM_Y][COLSUM_X + 1];
  const int64_t col = (int64_t)blockIdx.x * COLSUM_X + threadIdx.x;
  float s = 0.0f;
  if (col < cols)
    for (int64_t r = threadIdx.y; r < rows; r += COLSUM_Y) s += dy[r * cols + col];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = part[0][threadIdx.x];
    for (int t = 1; t < COLSUM_Y; t++) total += part[t][threadIdx.x];
    db[col] += total;
  }
}

static void cuda_linear_backward(float *dx, bool dx_accumulate, float *dw, float *db,
                                 const float *dy, const float *x, const float *w, int64_t rows,
                                 int64_t in, int64_t out) {
  /* dw before dx: dx may be x's own memory, and the stream runs them in
   * the order queued (see the table's contract) */
  if (dw) /* dw (out, in) += dy^T (out, rows) @ x (rows, in) */
    cuda_gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (dx) /* dx (rows, in) (+)= dy (rows, out) @ w (out, in) */
    cuda_gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, dx_accumulate ? 1.0f : 0.0f, dx,
              in);
  if (db && out > 0) {
    const dim3 block(COLSUM_X, COLSUM_Y);
    const int64_t grid = (out + COLSUM_X - 1) / COLSUM_X;
    column_sums_add_kernel<<<(unsigned)grid, block, 0, ddp__cuda_stream()>>>(db, dy, rows, out);
  }
}

/* ---- autocast: 16-bit operands, float32 accumulation ----------------------
 * cublasGemmEx with CUDA_R_16BF (CUDA_R_16F) inputs, a CUDA_R_32F output
 * and CUBLAS_COMPUTE_32F: the tensor cores multiply the 16-bit values
 * exactly and add in float32, as PyTorch's autocast matmul does (whose
 * cuBLAS call writes a bf16 output, rounded once from the same float32
 * accumulator: the op layer rounds ours once). The handle's math mode
 * (DISALLOW_REDUCED_PRECISION_REDUCTION) and CUBLAS_ATOMICS_NOT_ALLOWED
 * hold here too: the same inputs give the same bits every run. */
static ddp_status cuda_gemm_low(bool bf16, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                int64_t k, const uint16_t *a, int64_t lda, const uint16_t *b,
                                int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m <= 0 || n <= 0) return DDP_OK;
  cublasHandle_t handle = ddp__cuda_cublas();
  if (!handle) return ddp__cublas_check(CUBLAS_STATUS_NOT_INITIALIZED, "autocast gemm");
  if (k <= 0) {
    scale_rows_kernel<<<ddp__cuda_blocks(m * n, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK, 0,
                        ddp__cuda_stream()>>>(c, beta, m, n, ldc);
    return DDP_OK;
  }
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  /* row-major as column-major: b first, a second (ddp__cuda_gemm_status) */
  return ddp__cublas_check(
      cublasGemmEx_64(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, type, ldb, a,
                      type, lda, &beta, c, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT),
      bf16 ? "autocast gemm (bf16)" : "autocast gemm (fp16)");
}

static ddp_status cuda_linear_forward_low(bool bf16, float *y, const uint16_t *x,
                                          const uint16_t *w, const float *b, int64_t rows,
                                          int64_t in, int64_t out) {
  if (rows <= 0 || out <= 0) return DDP_OK;
  if (b)
    rows_from_bias_kernel<<<ddp__cuda_blocks(rows * out, DDP__CUDA_BLOCK), DDP__CUDA_BLOCK, 0,
                            ddp__cuda_stream()>>>(y, b, rows, out);
  return cuda_gemm_low(bf16, false, true, rows, out, in, x, in, w, in, b ? 1.0f : 0.0f, y, out);
}

static ddp_status cuda_linear_backward_low(bool bf16, float *dx, float *dw, float *db,
                                           const float *dy, const uint16_t *dy16,
                                           const uint16_t *x, const uint16_t *w, int64_t rows,
                                           int64_t in, int64_t out) {
  if (dw) /* dw (out, in) = dy^T (out, rows) @ x (rows, in) */
    DDP_TRY(cuda_gemm_low(bf16, true, false, out, in, rows, dy16, out, x, in, 0.0f, dw, in));
  if (dx) /* dx (rows, in) = dy (rows, out) @ w (out, in) */
    DDP_TRY(cuda_gemm_low(bf16, false, false, rows, in, out, dy16, out, w, in, 0.0f, dx, in));
  if (db && out > 0) {
    const dim3 block(COLSUM_X, COLSUM_Y);
    const int64_t grid = (out + COLSUM_X - 1) / COLSUM_X;
    column_sums_add_kernel<<<(unsigned)grid, block, 0, ddp__cuda_stream()>>>(db, dy, rows, out);
  }
  return DDP_OK;
}

extern "C" const ddp__dense_kernels ddp__cuda_dense_kernels = {
    .gemm = cuda_gemm,
    .linear_forward = cuda_linear_forward,
    .linear_backward = cuda_linear_backward,
    .conv2d_forward = ddp__cuda_conv2d_forward,
    .conv2d_backward = ddp__cuda_conv2d_backward,
    .max_pool2d_forward = ddp__cuda_max_pool2d_forward,
    .max_pool2d_backward = ddp__cuda_max_pool2d_backward,
    .gemm_low = cuda_gemm_low,
    .linear_forward_low = cuda_linear_forward_low,
    .linear_backward_low = cuda_linear_backward_low,
    .conv2d_forward_low = ddp__cuda_conv2d_forward_low,
    .conv2d_backward_low = ddp__cuda_conv2d_backward_low,
};
