/* What the fused ops share across the op files: batch_norm_relu_max_pool2d
 * (ops_norm.c) computes batch norm's statistics and then this pooling
 * (ops_dense.c), and records one node for both; its backward may also do
 * the convolution's before it (ops_conv.c). */
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
 * `argmax` is not NULL, each window's argmax (tape scratch), and when
 * `argval` is not NULL data's value there (tape scratch), but records
 * nothing: the caller records one node for the whole block, whose backward
 * hands batch norm's the pooled gradient (ddp__bn_grad). */
ddp_status ddp__relu_max_pool2d_affine(ddp_tape *tape, ddp_tensor *x, const float *data,
                                       const ddp__pool_affine *affine, int kernel, int stride,
                                       ddp_tensor **out, void **argmax, float **argval);

/* When intermediate `t` is the output of a stride-1 conv2d (more than one
 * output element per plane) whose input needs no gradient and whose weight
 * does: the convolution's geometry, else NULL. Its backward then only
 * turns t's gradient into dw and db, which batch norm's backward can do
 * itself without t's gradient ever being formed, and without t
 * (batch_norm_backward_conv): the block keeps t's values at the pooling
 * windows' maxima and releases t's memory once it has pooled it; the
 * conv2d node then finds no gradient and is skipped. The caller must own
 * t (DDP__TENSOR_REUSABLE: no one else reads it or its gradient).
 * A conv2d recorded under autocast folds too where the CPU kernels rounded
 * its output (docs/tensor.md, "Mixed precision": where the folded
 * backward rounds). */
const ddp__conv2d_geom *ddp__conv2d_foldable(ddp_tape *tape, const ddp_tensor *t);

/* What a folded convolution's backward reads: the values its forward
 * computed from (input, weight, bias (NULL when none); under autocast as
 * rounded to `low`), and `low`, the dtype its weight and bias gradients
 * are rounded to before they reach the float32 gradients (DDP_FLOAT32:
 * none). For a t that ddp__conv2d_foldable accepted. */
typedef struct ddp__conv2d_fold_in {
  const float *x, *w, *b;
  ddp_dtype low;
} ddp__conv2d_fold_in;
ddp_status ddp__conv2d_fold_operands(ddp_tape *tape, const ddp_tensor *t,
                                     ddp__conv2d_fold_in *in);

#endif
