/* Pointwise and per-channel kernels: activations, batch norm, dropout,
 * log_softmax, losses. */
#ifndef DDP__TENSOR_KERNELS_POINTWISE_H
#define DDP__TENSOR_KERNELS_POINTWISE_H

#include <stdint.h>

#include "ddp/core.h"

typedef struct ddp__pointwise_kernels {
  int reserved; /* the pointwise-ops work fills this table */
} ddp__pointwise_kernels;

extern const ddp__pointwise_kernels ddp__cpu_pointwise_kernels;

#endif
