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
 *   - CUDA graphs (graph.c) capture a step's work once and replay it;
 *   - float32 as PyTorch computes it with TF32 off: the cuBLAS handle's
 *     math mode is CUBLAS_DEFAULT_MATH with CUBLAS_MATH_DISALLOW_REDUCED_
 *     PRECISION_REDUCTION, atomics not allowed (deterministic).
 * Callable from C and CUDA C++ (extern "C"). */
#ifndef DDP__TENSOR_CUDA_RUNTIME_H
#define DDP__TENSOR_CUDA_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "ddp/core.h"
#include "tensor/block_cache.h"

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
/* cudaDeviceGetPCIBusId of device ("0000:3B:00.0" as CUDA writes it). */
ddp_status ddp__cuda_pci_bus_id(int device, char *buf, int bytes);

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

/* The device ordinal `ptr` belongs to (cudaPointerGetAttributes: device
 * or managed memory), or -1 for host memory and pointers CUDA does not
 * know. Clears the error CUDA sets for an unknown pointer. */
int ddp__cuda_pointer_device(const void *ptr);
/* Waits for the current device's stream; DDP_ERR_IO naming the device and
 * the CUDA error when a kernel or copy before it failed; DDP_ERR_RANGE
 * when a loss kernel found a target out of range since the last report
 * (ddp__cuda_target_error_slot). Refused (DDP_ERR_STATE) while this thread
 * captures a CUDA graph. */
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
/* The block cache of `device` (graph.c gives a graph's blocks back to it),
 * or NULL when the device has not been used. */
ddp__block_cache *ddp__cuda_cache(int device);
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

/* Pinned host memory (cudaMallocHost) for transfers; ddp__cuda_free_host.
 * The runtime remembers each allocation, so that copies can tell pinned
 * memory from pageable (ddp__cuda_is_pinned). Both refused while this
 * thread captures a CUDA graph (they synchronize). */
void *ddp__cuda_malloc_host(size_t bytes);
void ddp__cuda_free_host(void *ptr);
/* Whether [ptr, ptr + bytes) lies in one ddp__cuda_malloc_host block. */
bool ddp__cuda_is_pinned(const void *ptr, size_t bytes);

/* Copies between host and device memory of the current device on its
 * stream; host memory that is not pinned makes the copy synchronous.
 * kind is cudaMemcpyHostToDevice, DeviceToHost, DeviceToDevice. A copy to
 * the host waits for it (the caller reads the result next). While this
 * thread captures a CUDA graph, a copy to the host and one from pageable
 * memory are refused (DDP_ERR_STATE): the one waits, the other would be
 * replayed from memory the host has since rewritten. */
ddp_status ddp__cuda_copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
/* The same queued on the current device's stream without ever waiting:
 * the host side must be pinned (ddp__cuda_is_pinned; DDP_ERR_INVALID
 * otherwise), and the host reads a copy to it, or rewrites a copy's
 * source, only after a synchronize. Allowed in a CUDA graph capture (the
 * copy is replayed with the graph). */
ddp_status ddp__cuda_copy_async(void *dst, const void *src, size_t bytes,
                                enum cudaMemcpyKind kind);
/* Copies between the memory of two different devices (cudaMemcpyPeerAsync,
 * staged by the driver when there is no peer access), ordered on both
 * streams: it starts after the work queued on src_device's stream and
 * before any later work on either stream, so the source may be freed
 * (and its block reused) and the destination read by later work of
 * either device without further synchronization. Leaves dst_device
 * current. Returns once queued. */
ddp_status ddp__cuda_copy_peer(void *dst, int dst_device, const void *src, int src_device,
                               size_t bytes);

/* ---- Host-to-device staging -----------------------------------------------
 * Batches go to the device through pinned buffers, so their copies are
 * asynchronous (PyTorch's pin_memory with non_blocking copies): each
 * upload fills the next of two pinned buffers and queues its copies on the
 * stream; a buffer is refilled only once the stream has passed the copies
 * out of it (an event per buffer), so the host prepares batch k + 1 while
 * the device still copies batch k. Buffers grow to the largest upload. */
typedef struct ddp__cuda_stage ddp__cuda_stage;
/* A stage for the current device; *out NULL on failure. */
ddp_status ddp__cuda_stage_create(ddp__cuda_stage **out);
/* Copies src[i] (host, any memory, bytes[i]) to dst[i] (the stage's
 * device) for i < n through one pinned buffer; returns once queued (the
 * sources may be reused at once). Makes the stage's device current.
 * Refused in a graph capture. */
ddp_status ddp__cuda_stage_upload(ddp__cuda_stage *stage, int n, void *const *dst,
                                  const void *const *src, const size_t *bytes);
/* Waits for the stage's copies and frees it (NULL ok). */
void ddp__cuda_stage_destroy(ddp__cuda_stage *stage);

/* ---- The losses' target check -------------------------------------------
 * nll_loss and cross_entropy check their targets on the device and never
 * wait for the result (a wait per loss would stall every step, and a CUDA
 * graph cannot contain one): a loss kernel that finds a target outside
 * [0, C) writes the first such sample into its device's slot, unless the
 * slot holds one already, and makes the loss NaN; the next
 * ddp__cuda_synchronize (every copy to the host, ddp_device_synchronize)
 * reports it ("cuda:0: nll_loss: target[37] = 10 is out of range for 10
 * classes") and empties the slot. The slot is pinned host memory mapped
 * into the device: kernels write it directly, and the host reads it after
 * the stream's wait, with no copy. Replays of a captured loss write the
 * same slot. */
typedef struct ddp__cuda_target_error {
  int64_t sample; /* the first bad sample since the last report, or -1 */
  int64_t value;  /* its target */
  int64_t classes;
  int64_t op;     /* DDP__CUDA_TARGET_NLL or DDP__CUDA_TARGET_CROSS_ENTROPY */
} ddp__cuda_target_error;
#define DDP__CUDA_TARGET_NLL 0
#define DDP__CUDA_TARGET_CROSS_ENTROPY 1
/* The current device's slot, as the device addresses it; NULL (error set)
 * when the device cannot be used. */
ddp__cuda_target_error *ddp__cuda_target_error_slot(void);

/* ---- CUDA graph capture (graph.c) ------------------------------------------
 * The public API is ddp_cuda_graph_* (include/ddp/tensor.h); these are its
 * internals and the hooks through which the runtime keeps a capture
 * correct (docs/cuda.md, "CUDA graphs"). A capture records the work this
 * thread queues on one device's stream (cudaStreamCaptureModeThreadLocal);
 * while it runs, this thread may not synchronize, copy to the host or from
 * pageable memory, or call cudaMalloc/cudaFree: the runtime refuses each
 * (DDP_ERR_STATE, saying what and why) and the refusal fails the capture.
 *
 * Memory: a block the captured work uses is written by every replay, so
 * while its graph lives it must not be handed to anyone else. Every block
 * allocated during the capture, and every block freed during it, belongs
 * to the graph's private pool: a free puts it on the pool's free list
 * (the capture itself reuses those first, as eager work would reuse the
 * cache), never back in the cache, until the graph is destroyed. Blocks
 * made before the capture and still held by their owners (parameters, a
 * tape's arena, input buffers) are the caller's to keep alive. */
typedef struct ddp_cuda_graph ddp_cuda_graph; /* as include/ddp/tensor.h */
ddp_status ddp__cuda_graph_begin(int device);
ddp_status ddp__cuda_graph_end(int device, ddp_cuda_graph **out);
ddp_status ddp__cuda_graph_replay(ddp_cuda_graph *graph);
void ddp__cuda_graph_destroy(ddp_cuda_graph *graph);
/* The device this thread is capturing on, or -1. */
int ddp__cuda_capturing(void);
/* Refuses `what` in this thread's capture: sets the error ("cuda:N: <what>
 * during a CUDA graph capture: <why>"), keeps it as the capture's first
 * failure, returns DDP_ERR_STATE. */
ddp_status ddp__cuda_capture_refuse(const char *what, const char *why);
/* Keeps `status` with the calling thread's last error as the capture's
 * first failure (errors that would be deferred to the next synchronize
 * belong to the capture instead). */
void ddp__cuda_capture_note(ddp_status status);
/* An allocation on the capturing device: a fitting block of the capture's
 * pool, else a block of `cache` (a hit; a miss would be cudaMalloc, which
 * the backend refuses during a capture), owned by the pool from then on.
 * NULL, with the failure kept for the capture, when neither has one. */
void *ddp__cuda_capture_alloc(ddp__block_cache *cache, size_t bytes);
/* Whether a graph's pool took the freed block `ptr` of device's `cache`
 * (one allocated or freed during a capture whose graph lives, or any
 * block freed during this thread's capture). */
bool ddp__cuda_pool_take(int device, ddp__block_cache *cache, void *ptr);
/* A cudaFree the cache asks for during this thread's capture: kept, and
 * done when the capture ends. */
void ddp__cuda_capture_defer_free(int device, void *ptr);

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
