/* Dense kernels: gemm, linear, convolution, pooling. Layout NCHW, row-major. */
#ifndef DDP__TENSOR_KERNELS_DENSE_H
#define DDP__TENSOR_KERNELS_DENSE_H

#include <stdint.h>

#include "ddp/core.h"

typedef struct ddp__dense_kernels {
  int reserved; /* the dense-ops work fills this table */
} ddp__dense_kernels;

extern const ddp__dense_kernels ddp__cpu_dense_kernels;

#endif
