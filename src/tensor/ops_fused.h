/* What the fused ops share across the op files: batch_norm_relu_max_pool2d
 * (ops_norm.c) records batch norm's node and then this pooling (ops_dense.c). */
#ifndef DDP__TENSOR_OPS_FUSED_H
#define DDP__TENSOR_OPS_FUSED_H

#include "tensor/kernels.h"
#include "tensor/tape.h"

/* relu_max_pool2d of x, whose values are read from `data` (x's shape)
 * mapped through `affine`: x is batch norm's output, recorded but never
 * written (neither backward reads it), data its input. Validates and
 * records like ddp_relu_max_pool2d. */
ddp_status ddp__relu_max_pool2d_affine(ddp_tape *tape, ddp_tensor *x, const float *data,
                                       const ddp__pool_affine *affine, int kernel, int stride,
                                       ddp_tensor **out);

#endif
