/* Dense kernels: gemm, linear, convolution, pooling. Layout NCHW, row-major.
 * Kernels take raw pointers and sizes; the op layer (ops_dense.c, ops_conv.c)
 * has validated every shape before calling. Gradient outputs accumulate (+=)
 * unless an `accumulate` flag says to assign (a fresh buffer), and a NULL
 * gradient pointer means "not wanted": the kernel skips that work.
 * Scratch memory comes from the arena argument (the tape's, reset each step),
 * so a steady-state step allocates nothing. Kernels never change the BLAS
 * thread count; the caller owns that (openblas_set_num_threads). */
#ifndef DDP__TENSOR_KERNELS_DENSE_H
#define DDP__TENSOR_KERNELS_DENSE_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"

/* The geometry of one 2-D convolution, all sizes in elements:
 * x (n, c, h, w), weight (o, c, kh, kw), y (n, o, oh, ow),
 * oh = (h + 2*pad - kh) / stride + 1, likewise ow. */
typedef struct ddp__conv2d_geom {
  int64_t n, c, h, w;
  int64_t o, kh, kw;
  int64_t stride, pad;
  int64_t oh, ow;
  /* Autocast's rounding, fused (CPU kernels; only CPU ops set it):
   * DDP_BFLOAT16 / DDP_FLOAT16 rounds the forward's y, the backward's dy as
   * it is read, and its dx to that dtype, a sample at a time while it is
   * in cache (the backward must then be called with dx_accumulate false);
   * DDP_FLOAT32 (0, a zeroed geometry) rounds nothing. The caller passes
   * x, w and b already holding values of that dtype (autocast's rounded
   * operands): with DDP_BFLOAT16 the CPU may run bfloat16 dot products,
   * which read only the upper halves of x, w and dy (cpu/conv_bf16.c).
   * A ddp_dtype held as int: this header does not include ddp/tensor.h. */
  int round;
} ddp__conv2d_geom;

/* A per-channel affine map applied to the input of max pooling (batch
 * norm's normalisation, fused): plane p is channel p % channels, and its
 * values are (x - center[c]) * scale[c] + shift[c], in that order of
 * operations (batch_norm_forward's, so the results are bitwise the same). */
typedef struct ddp__pool_affine {
  const float *center, *scale, *shift;
  int64_t channels;
} ddp__pool_affine;

/* Max pooling's argmax, one per window: where in the window its maximum
 * is, a * kernel + b for the window's row a and column b, or -1 where relu
 * closed the window (the fused forms). Stored in ddp__pool_arg_bytes
 * bytes a window: one (int8_t) for kernels up to 11 x 11, four (int32_t)
 * beyond. For the usual 2 x 2 that is a quarter of a plane index's memory,
 * written in forward and read in backward every step. */
static inline int64_t ddp__pool_arg_bytes(int64_t kernel) { return kernel <= 11 ? 1 : 4; }
/* Window i's argmax code from an array of `bytes`-wide ones. */
static inline int32_t ddp__pool_arg_get(const void *argmax, int64_t i, int64_t bytes) {
  return bytes == 1 ? ((const int8_t *)argmax)[i] : ((const int32_t *)argmax)[i];
}

typedef struct ddp__dense_kernels {
  /* c (m, n) = alpha * op(a) @ op(b) + beta * c, row-major. op(a) is (m, k):
   * a is stored (m, k) with row stride lda, or (k, m) when trans_a. Likewise b
   * is (k, n), or stored (n, k) when trans_b. Any size may be 0. */
  void (*gemm)(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
               int64_t ldc);
  /* y (rows, out) = x (rows, in) @ w^T + b; w (out, in), b (out) or NULL. */
  void (*linear_forward)(float *y, const float *x, const float *w, const float *b, int64_t rows,
                         int64_t in, int64_t out);
  /* From dy (rows, out): dx (rows, in) += dy @ w (= when !dx_accumulate:
   * dx is a fresh buffer, ddp__tape_grad_out), dw (out, in) += dy^T @ x,
   * db (out) += column sums of dy. Each of dx, dw, db may be NULL. With
   * !dx_accumulate dx may be x itself: x is read (for dw) before dx is
   * written. */
  void (*linear_backward)(float *dx, bool dx_accumulate, float *dw, float *db, const float *dy,
                          const float *x, const float *w, int64_t rows, int64_t in, int64_t out);
  /* y (n, o, oh, ow) = conv(x, w) + b; b (o) or NULL. Fails only when the
   * arena cannot supply scratch (DDP_ERR_NOMEM). */
  ddp_status (*conv2d_forward)(float *y, const float *x, const float *w, const float *b,
                               const ddp__conv2d_geom *g, ddp_arena *arena);
  /* From dy (n, o, oh, ow): dx (n, c, h, w) += (= when !dx_accumulate: dx
   * is a fresh buffer, ddp__tape_grad_out), dw (o, c, kh, kw) +=, db (o) +=.
   * Each of dx, dw, db may be NULL (skipped). With !dx_accumulate dx may be
   * x itself: sample n's input is read (copied, or used for dw) before
   * sample n's dx is written, and no later sample reads it. */
  ddp_status (*conv2d_backward)(float *dx, float *dw, float *db, const float *dy,
                                const float *x, const float *w, const ddp__conv2d_geom *g,
                                bool dx_accumulate, ddp_arena *arena);
  /* Max pooling without padding over `planes` (= N*C) planes of (h, w):
   * y (planes, oh, ow). argmax (planes, oh, ow, ddp__pool_arg_bytes each),
   * or NULL when not needed, receives where in each window its maximum is;
   * ties go to the first maximum in row-major window order, NaN wins (as
   * PyTorch). With relu, y = relu(max) (= the max pooling of relu(x)) and
   * argmax is that of x, or -1 where relu closes the window (y not > 0:
   * relu's backward, fused, passes nothing there). With affine (or NULL),
   * x is mapped by it first. argval (planes, oh, ow), or NULL, receives
   * x's own value (before the map) at each window's max, closed windows'
   * included. */
  void (*max_pool2d_forward)(float *y, void *argmax, float *argval, const float *x,
                             int64_t planes, int64_t h, int64_t w, int64_t kernel,
                             int64_t stride, int64_t oh, int64_t ow, bool relu,
                             const ddp__pool_affine *affine);
  /* dx (planes, h, w) += dy scattered to the argmax positions (windows of
   * argmax -1 pass nothing); with !accumulate dx is first set to zero (a
   * fresh buffer). kernel and stride are the forward's. */
  void (*max_pool2d_backward)(float *dx, const float *dy, const void *argmax, int64_t planes,
                              int64_t h, int64_t w, int64_t kernel, int64_t stride, int64_t oh,
                              int64_t ow, bool accumulate);
  /* Autocast's bfloat16 GEMM (cpu/gemm_bf16.c; NULL where a table has
   * none): c (m, n) = op(a) @ op(b) as gemm's, the operands rounded to
   * bfloat16, products summed in float32, c written (not accumulated);
   * b_packed (bf16_pack_b's layout of op(b)) used in place of b when not
   * NULL. Scratch from `arena`. false, writing nothing, when this CPU has
   * no bfloat16 dot products (or scratch ran out): compute otherwise. */
  bool (*gemm_bf16)(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                    int64_t lda, const float *b, int64_t ldb, const uint16_t *b_packed, float *c,
                    int64_t ldc, ddp_arena *arena);
  /* Whether gemm_bf16 runs on this CPU now (the kernel family and the CPU). */
  bool (*has_bf16_dot)(void);
  /* Bytes of op(b) (k, n) packed, and the packing (b stored (k, n) with row
   * stride ldb, or (n, k) when trans_b). */
  size_t (*bf16_pack_bytes)(int64_t k, int64_t n);
  void (*bf16_pack_b)(uint16_t *dst, bool trans_b, int64_t k, int64_t n, const float *b,
                      int64_t ldb);
  /* Autocast on a GPU (cuda/dense.cu; NULL in the CPU tables): operands
   * held as 16-bit values (bfloat16 when bf16, else float16; the tensor
   * layer's conversion, round to nearest even), products accumulated in
   * float32 on the tensor cores (cuBLAS's CUBLAS_COMPUTE_32F), float32
   * results, which the op layer rounds to the low dtype.
   *   gemm_low: c (m, n) = op(a) @ op(b) + beta * c as gemm's layout (beta
   *     0: c is not read).
   *   linear_forward_low: y (rows, out) = x (rows, in) @ w^T + b, b (out)
   *     float32 (holding low values) or NULL, added before the single
   *     rounding as PyTorch's addmm with a bias does.
   *   linear_backward_low: from dy (rows, out; float32 of low values) and
   *     dy16 (the same values, 16-bit): dx (rows, in) = dy @ w, dw (out,
   *     in) = dy^T @ x (written, not accumulated), db (out) += column sums
   *     of dy. Each of dx, dw, db may be NULL.
   * Each returns the cuBLAS failure as a status. */
  ddp_status (*gemm_low)(bool bf16, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                         const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,
                         float beta, float *c, int64_t ldc);
  ddp_status (*linear_forward_low)(bool bf16, float *y, const uint16_t *x, const uint16_t *w,
                                   const float *b, int64_t rows, int64_t in, int64_t out);
  ddp_status (*linear_backward_low)(bool bf16, float *dx, float *dw, float *db, const float *dy,
                                    const uint16_t *dy16, const uint16_t *x, const uint16_t *w,
                                    int64_t rows, int64_t in, int64_t out);
  /* Autocast's convolution on a GPU (NULL in the CPU tables): x and w as
   * 16-bit values (bf16 when bf16, else float16), cuDNN with 16-bit data
   * and float compute.
   *   conv2d_forward_low: y (float32) = the convolution rounded to the low
   *     dtype (by cuDNN), + b (float32 holding low values, or NULL) added in
   *     float32 and not rounded again (the op layer rounds: PyTorch's
   *     convolution then add_ of the bias).
   *   conv2d_backward_low: from dy16 (the rounded gradient, 16-bit): dx
   *     (n, c, h, w) and dw (o, c, kh, kw), float32 holding low values,
   *     written (not accumulated); either may be NULL; no bias gradient
   *     (the op layer's fixed-order sums through conv2d_backward).
   * *done false (DDP_OK, nothing written) when this device cannot (no
   * cuDNN, DDP_CUDA_CONV=im2col, a geometry cuDNN refuses in 16 bits): the
   * op layer then computes on rounded float32 operands. */
  ddp_status (*conv2d_forward_low)(bool bf16, float *y, const uint16_t *x, const uint16_t *w,
                                   const float *b, const ddp__conv2d_geom *g, ddp_arena *arena,
                                   bool *done);
  ddp_status (*conv2d_backward_low)(bool bf16, float *dx, float *dw, const uint16_t *dy,
                                    const uint16_t *x, const uint16_t *w,
                                    const ddp__conv2d_geom *g, ddp_arena *arena, bool *done);
} ddp__dense_kernels;

extern const ddp__dense_kernels ddp__cpu_dense_kernels;

#endif
