/* The CUDA kernel tables (a CUDA build only: DDP_HAVE_CUDA). Every pointer
 * they take is device memory of the current device, every kernel runs on
 * ddp__cuda_stream() and returns once it is queued (launch errors and faults
 * surface at the next synchronize), and each honours the contract of the
 * table's header word for word, as the CPU tables do:
 *   basic      — kernels_basic.h      (cuda/basic.cu)
 *   dense      — kernels_dense.h      (cuda/dense.cu, cuda/conv.cu, cuda/pool.cu)
 *   pointwise  — kernels_pointwise.h  (cuda/pointwise*.cu)
 * Scratch comes from the arena argument, which is then a device arena
 * (ddp__cuda_arena_backing()): its memory is never touched on the host. */
#ifndef DDP__TENSOR_CUDA_KERNELS_CUDA_H
#define DDP__TENSOR_CUDA_KERNELS_CUDA_H

/* ddp/core.h spells a C11 `_Noreturn`, which nvcc's C++ front end does not
 * know; CUDA sources include this header first, so it is defined here for
 * them (until core.h spells it for both languages). */
#if defined(__cplusplus) && !defined(_Noreturn)
#define _Noreturn [[noreturn]]
#endif

#ifdef __cplusplus
extern "C" { /* the C headers too: their tables and functions have C linkage */
#endif

#include "tensor/kernels_basic.h"
#include "tensor/kernels_dense.h"
#include "tensor/kernels_pointwise.h"

extern const ddp__basic_kernels ddp__cuda_basic_kernels;
extern const ddp__dense_kernels ddp__cuda_dense_kernels;
extern const ddp__pointwise_kernels ddp__cuda_pointwise_kernels;

#ifdef __cplusplus
}
#endif

#endif /* DDP__TENSOR_CUDA_KERNELS_CUDA_H */
