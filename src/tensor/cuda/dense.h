/* CUDA dense kernels, split by subject as on the CPU: gemm and linear
 * (cuda/dense.cu, which assembles ddp__cuda_dense_kernels), convolution
 * (cuda/conv.cu), pooling (cuda/pool.cu). CUDA C++ only: included by those
 * files after tensor/cuda/kernels_cuda.h. Contracts: kernels_dense.h. */
#ifndef DDP__TENSOR_CUDA_DENSE_H
#define DDP__TENSOR_CUDA_DENSE_H

#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/runtime.h"

extern "C" {

/* The table's gemm (row-major, as kernels_dense.h), returning cuBLAS's
 * status so that callers that return a ddp_status can report it; the
 * table's own entry drops it after recording the error. */
cublasStatus_t ddp__cuda_gemm_status(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                     float alpha, const float *a, int64_t lda, const float *b,
                                     int64_t ldb, float beta, float *c, int64_t ldc);

ddp_status ddp__cuda_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                    const ddp__conv2d_geom *g, ddp_arena *arena);
ddp_status ddp__cuda_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                     const float *x, const float *w, const ddp__conv2d_geom *g,
                                     bool dx_accumulate, ddp_arena *arena);
ddp_status ddp__cuda_conv2d_forward_low(bool bf16, float *y, const uint16_t *x, const uint16_t *w,
                                        const float *b, const ddp__conv2d_geom *g,
                                        ddp_arena *arena, bool *done);
ddp_status ddp__cuda_conv2d_backward_low(bool bf16, float *dx, float *dw, const uint16_t *dy,
                                         const uint16_t *x, const uint16_t *w,
                                         const ddp__conv2d_geom *g, ddp_arena *arena, bool *done);
void ddp__cuda_max_pool2d_forward(float *y, void *argmax, float *argval, const float *x,
                                  int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                  int64_t stride, int64_t oh, int64_t ow, bool relu,
                                  const ddp__pool_affine *affine);
void ddp__cuda_max_pool2d_backward(float *dx, const float *dy, const void *argmax,
                                   int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                   int64_t stride, int64_t oh, int64_t ow, bool accumulate);

} /* extern "C" */

/* Threads a block for the elementwise and gather kernels of these files. */
#define DDP__CUDA_BLOCK 256

#endif /* DDP__TENSOR_CUDA_DENSE_H */
