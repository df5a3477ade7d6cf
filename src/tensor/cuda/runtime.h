/* The CUDA runtime of the tensor layer: devices, the compute stream, the
 * cuBLAS handle, device memory (a caching allocator) and pinned host
 * staging. Compiled only in a CUDA build (DDP_HAVE_CUDA; src/tensor/cuda/
 * is left out of the others); device-neutral code reaches it through
 * src/tensor/device.c, never directly.
 *
 * The model (docs/cuda.md):
 *   - one compute stream per device, created on first use; every kernel of
 *     the tensor layer runs on the stream of the *current* device, which
 *     ddp__kernels_for(device) sets (cudaSetDevice) before an op computes;
 *   - kernels are asynchronous: a launch error or a fault surfaces at the
 *     next synchronizing call (a copy to the host, ddp__cuda_synchronize),
 *     which reports it with the device's name;
 *   - device memory comes from ddp__cuda_malloc (cached: a freed block is
 *     kept for the next request of its size class, never given back to the
 *     driver while the process runs, so a steady-state step calls no
 *     cudaMalloc); never managed memory;
 *   - float32 as PyTorch computes it with TF32 off: the cuBLAS handle's
 *     math mode is CUBLAS_DEFAULT_MATH with CUBLAS_MATH_DISALLOW_REDUCED_
 *     PRECISION_REDUCTION, atomics not allowed (deterministic).
 * Callable from C and CUDA C++ (extern "C"). */
#ifndef DDP__TENSOR_CUDA_RUNTIME_H
#define DDP__TENSOR_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies:
 * the driver numbers the visible ones from 0). 0 when there is no driver,
 * no device or the runtime fails to start; the reason is then in
 * ddp__cuda_unavailable_reason(). Never aborts. Thread-safe; the answer is
 * found once. */
int ddp__cuda_device_count(void);
/* Why ddp__cuda_device_count() is 0 ("no CUDA device", "CUDA driver
 * version is insufficient ...", ...), or NULL when devices exist. */
const char *ddp__cuda_unavailable_reason(void);

/* Makes `device` current for this thread (cudaSetDevice). Fails with
 * DDP_ERR_INVALID naming the device when it does not exist. */
ddp_status ddp__cuda_set_device(int device);
/* This thread's current device. */
int ddp__cuda_current_device(void);

/* The compute stream of the current device (created on first use). */
cudaStream_t ddp__cuda_stream(void);
/* The cuBLAS handle of the current device, bound to its stream, math mode
 * as above (created on first use). NULL only when cuBLAS fails to start;
 * the kernels then report it at the next synchronize. */
cublasHandle_t ddp__cuda_cublas(void);

/* Waits for the current device's stream; DDP_ERR_IO naming the device and
 * the CUDA error when a kernel or copy before it failed. */
ddp_status ddp__cuda_synchronize(void);
/* Turns a CUDA runtime error into a ddp error "cuda:<dev>: <what>: <CUDA's
 * name and string>"; DDP_OK for cudaSuccess. It also clears CUDA's
 * per-thread last error, so ddp__cuda_synchronize does not report a
 * handled error again (code that handles a CUDA error without this
 * function clears it with cudaGetLastError()). DDP_ERR_NOMEM for an
 * allocation failure, DDP_ERR_INVALID for an invalid argument,
 * DDP_ERR_UNSUPPORTED for a missing driver or device, else DDP_ERR_IO. */
ddp_status ddp__cuda_check(cudaError_t err, const char *what);
/* The same for cuBLAS statuses ("cuda:<dev>: <what>: CUBLAS_STATUS_...:
 * <cuBLAS's string>"). */
ddp_status ddp__cublas_check(cublasStatus_t st, const char *what);
/* For code that cannot return a status (void kernels, frees): when status
 * is an error, keeps the calling thread's last error message as the
 * current device's pending error, which the next ddp__cuda_synchronize
 * (ddp_device_synchronize) reports, as it does a failed kernel. The first
 * pending error is kept; later ones (usually its consequences) are not.
 * Typical use: ddp__cuda_defer(ddp__cublas_check(st, "linear: gemm")). */
void ddp__cuda_defer(ddp_status status);

/* Device memory on the current device from the caching allocator: `bytes`
 * (may be 0: a unique non-NULL pointer), 256-byte aligned, not zeroed.
 * NULL with DDP_ERR_NOMEM set when the device is full even after the
 * cache was emptied. */
void *ddp__cuda_malloc(size_t bytes);
/* Returns a block from ddp__cuda_malloc to its device's cache (NULL ok;
 * any current device). Work already queued on the stream may still use
 * it: the cache hands a block out again only to work queued later on the
 * same stream. A pointer that is not such a block becomes the current
 * device's pending error (ddp__cuda_defer). */
void ddp__cuda_free(void *ptr);
/* Statistics of the current device's cache, for tests and reports. */
typedef struct ddp__cuda_mem_stats {
  uint64_t driver_allocs;  /* cudaMalloc calls so far */
  uint64_t bytes_reserved; /* held from the driver */
  uint64_t bytes_in_use;   /* handed out and not freed */
} ddp__cuda_mem_stats;
void ddp__cuda_mem_stats_get(ddp__cuda_mem_stats *out);

/* An arena whose chunks are device memory of the current device (for the
 * tape's op outputs and kernels' scratch): alloc and free are
 * ddp__cuda_malloc/free, zero a cudaMemsetAsync on the current device's
 * stream (its failure a pending error). The arena's user keeps its device
 * current while it allocates and zeroes. */
const ddp_arena_backing *ddp__cuda_arena_backing(void);

/* Pinned host memory (cudaMallocHost) for transfers; ddp__cuda_free_host. */
void *ddp__cuda_malloc_host(size_t bytes);
void ddp__cuda_free_host(void *ptr);

/* Copies between host and device memory of the current device on its
 * stream; host memory that is not pinned makes the copy synchronous.
 * kind is cudaMemcpyHostToDevice, DeviceToHost, DeviceToDevice. A copy to
 * the host waits for it (the caller reads the result next). */
ddp_status ddp__cuda_copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
/* Copies between the memory of two different devices (cudaMemcpyPeerAsync,
 * staged by the driver when there is no peer access), ordered on both
 * streams: it starts after the work queued on src_device's stream and
 * before any later work on either stream, so the source may be freed
 * (and its block reused) and the destination read by later work of
 * either device without further synchronization. Leaves dst_device
 * current. Returns once queued. */
ddp_status ddp__cuda_copy_peer(void *dst, int dst_device, const void *src, int src_device,
                               size_t bytes);

/* Grid size for a 1-D launch of n elements at `block` threads a block,
 * capped so grid-stride loops cover the rest. */
static inline unsigned ddp__cuda_blocks(int64_t n, unsigned block) {
  int64_t g = (n + block - 1) / block;
  if (g < 1) g = 1;
  if (g > 65535 * 8) g = 65535 * 8;
  return (unsigned)g;
}

#ifdef __cplusplus
}
#endif

#endif /* DDP__TENSOR_CUDA_RUNTIME_H */
