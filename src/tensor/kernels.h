/* Per-device kernel tables. An op validates and records in device-neutral
 * code, then computes through the table of its tensors' device, so a CUDA
 * backend plugs in by providing the same tables (DESIGN.md: "devices are a
 * field, not a fork of the code"). Each sub-table has its own header and its
 * own CPU implementation file:
 *   basic      — kernels_basic.h,     cpu/basic.c      (copy, add, axpy, scale)
 *   dense      — kernels_dense.h,     cpu/dense.c      (gemm, linear, conv, pooling)
 *   pointwise  — kernels_pointwise.h, cpu/pointwise.c  (activations, batch norm,
 *                                                       dropout, softmax, losses)
 * Kernels take raw pointers and sizes, never tensors or the tape; scratch
 * memory they need comes from the arena they are given. */
#ifndef DDP__TENSOR_KERNELS_H
#define DDP__TENSOR_KERNELS_H

#include "ddp/tensor.h"
#include "tensor/kernels_basic.h"
#include "tensor/kernels_dense.h"
#include "tensor/kernels_pointwise.h"

typedef struct ddp__kernels {
  const char *name; /* "cpu" */
  const ddp__basic_kernels *basic;
  const ddp__dense_kernels *dense;
  const ddp__pointwise_kernels *pointwise;
} ddp__kernels;

/* The kernel table for a device, or NULL when this build has no backend for
 * it (an op then fails with DDP_ERR_UNSUPPORTED naming the device). */
const ddp__kernels *ddp__kernels_for(ddp_device device);

/* Checks that the (possibly NULL) tensors are float32 on one device with a
 * backend, and returns that backend's table in *k. Errors name `op`. */
ddp_status ddp__kernels_check(const char *op, int n, ddp_tensor *const *tensors,
                              const ddp__kernels **k);

#endif /* DDP__TENSOR_KERNELS_H */
