/* CPU dense kernels: gemm through OpenBLAS, linear layers on top of it, and
 * the table that also holds convolution (cpu/conv.c) and pooling (cpu/pool.c). */
#include <cblas.h>
#include <string.h>

#include "tensor/cpu/dense.h"

void ddp__cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                   float *c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    /* OpenBLAS rejects some empty shapes; the result is beta * c either way. */
    for (int64_t i = 0; i < m; i++) {
      float *row = c + i * ldc;
      if (beta == 0.0f)
        memset(row, 0, (size_t)n * sizeof(float));
      else
        for (int64_t j = 0; j < n; j++) row[j] *= beta;
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, (blasint)m, (blasint)n, (blasint)k, alpha, a,
              (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

/* y (rows, out) = x (rows, in) @ w^T (in, out) + b */
static void cpu_linear_forward(float *y, const float *x, const float *w, const float *b,
                               int64_t rows, int64_t in, int64_t out) {
  if (b) {
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * out, b, (size_t)out * sizeof(float));
  }
  ddp__cpu_gemm(false, true, rows, out, in, 1.0f, x, in, w, in, b ? 1.0f : 0.0f, y, out);
}

static void cpu_linear_backward(float *dx, bool dx_accumulate, float *dw, float *db,
                                const float *dy, const float *x, const float *w, int64_t rows,
                                int64_t in, int64_t out) {
  /* dw before dx: dx may be x's own memory (see the table's contract) */
  if (dw) /* dw (out, in) += dy^T (out, rows) @ x (rows, in) */
    ddp__cpu_gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (dx) /* dx (rows, in) (+)= dy (rows, out) @ w (out, in) */
    ddp__cpu_gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, dx_accumulate ? 1.0f : 0.0f,
                  dx, in);
  if (db)
    for (int64_t r = 0; r < rows; r++) {
      const float *row = dy + r * out;
      for (int64_t j = 0; j < out; j++) db[j] += row[j];
    }
}

const ddp__dense_kernels ddp__cpu_dense_kernels = {
    .gemm = ddp__cpu_gemm,
    .linear_forward = cpu_linear_forward,
    .linear_backward = cpu_linear_backward,
    .conv2d_forward = ddp__cpu_conv2d_forward,
    .conv2d_backward = ddp__cpu_conv2d_backward,
    .max_pool2d_forward = ddp__cpu_max_pool2d_forward,
    .max_pool2d_backward = ddp__cpu_max_pool2d_backward,
    .gemm_bf16 = ddp__cpu_gemm_bf16,
    .has_bf16_dot = ddp__cpu_has_bf16_dot,
    .bf16_pack_bytes = ddp__cpu_bf16_pack_bytes,
    .bf16_pack_b = ddp__cpu_bf16_pack_b,
};
