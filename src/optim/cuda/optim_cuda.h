/* The optimizers on a CUDA device (optim_kernels.cu): the state in the
 * device's memory, host copies of it for checkpoints, and one fused kernel
 * per step. Compiled only in a CUDA build; optimizer.c calls it behind
 * DDP_HAVE_CUDA for an optimizer whose options.device is a GPU. Every
 * function makes that device current first (the runtime works on the
 * current device's stream and cache), and runs on its compute stream. */
#ifndef DDP__OPTIM_CUDA_H
#define DDP__OPTIM_CUDA_H

#include <stddef.h>

/* ddp/core.h spells a C11 `_Noreturn`, which nvcc's C++ front end does not
 * know (as in tensor/cuda/kernels_cuda.h, until core.h spells it for both). */
#if defined(__cplusplus) && !defined(_Noreturn)
#define _Noreturn [[noreturn]]
#endif

#include "optim/optim_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DDP_OK when opt->params and opt->grads are memory of opt's device
 * (cudaMalloc'd or managed), else DDP_ERR_INVALID naming the buffer: a
 * host pointer would fault the kernel and lose the device's context. */
ddp_status ddp__optim_cuda_check_buffers(const ddp_optimizer *opt);

/* Allocates `floats` floats of opt's device memory into *out (caching
 * allocator) and queues zeroing it on the stream. *out is NULL on failure
 * (DDP_ERR_NOMEM or the CUDA error, naming the optimizer). */
ddp_status ddp__optim_cuda_state_alloc(const ddp_optimizer *opt, size_t floats, float **out);
/* Returns memory from ddp__optim_cuda_state_alloc; NULL ok. */
void ddp__optim_cuda_state_free(const ddp_optimizer *opt, float *mem);

/* Copies `floats` floats of opt's device memory to the host, after the work
 * queued before it; complete on return. */
ddp_status ddp__optim_cuda_download(const ddp_optimizer *opt, float *host, const float *device,
                                    size_t floats);
/* Copies `floats` host floats to opt's device memory, queued after the work
 * before it; `host` may be reused on return. */
ddp_status ddp__optim_cuda_upload(const ddp_optimizer *opt, float *device, const float *host,
                                  size_t floats);

/* One step of opt's algorithm: derives the scalars on the host as the CPU
 * step does (ddp__<algo>_scalars: Adam's step count advances here) and
 * queues one kernel over opt->n elements. Fails only when the device cannot
 * be made current; a failed launch surfaces at the next synchronize. */
ddp_status ddp__optim_cuda_step(ddp_optimizer *opt);

#ifdef __cplusplus
}
#endif

#endif /* DDP__OPTIM_CUDA_H */
