/* What the fused ops share across the op files: batch_norm_relu_max_pool2d
 * (ops_norm.c) computes batch norm's statistics and then this pooling
 * (ops_dense.c), and records one node for both. */
#ifndef DDP__TENSOR_OPS_FUSED_H
#define DDP__TENSOR_OPS_FUSED_H

#include "tensor/kernels.h"
#include "tensor/tape.h"

/* Max pooling's stride: 0 stands for the kernel size, as PyTorch's None.
 * (Validated by the pooling: negative strides are refused there.) */
static inline int ddp__pool_stride(int kernel, int stride) { return stride ? stride : kernel; }

/* relu_max_pool2d of x, whose values are read from `data` (x's shape)
 * mapped through `affine`: x is batch norm's output, never written, data
 * its input. Validates like ddp_relu_max_pool2d and computes y and, when
 * `argmax` is not NULL, each window's argmax (tape scratch), but records
 * nothing: the caller records one node for the whole block, whose backward
 * hands batch norm's the pooled gradient (ddp__bn_grad). */
ddp_status ddp__relu_max_pool2d_affine(ddp_tape *tape, ddp_tensor *x, const float *data,
                                       const ddp__pool_affine *affine, int kernel, int stride,
                                       ddp_tensor **out, int32_t **argmax);

#endif
