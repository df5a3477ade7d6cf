/* The tensor layer's device-neutral door to device memory (src/tensor/
 * device.c): device-neutral code (tensor.c, ops) allocates, frees and
 * copies device memory through these, never through the CUDA runtime
 * directly, so it compiles in every build. And the pure placement rule of
 * ddp_default_cuda_device, testable without a GPU. */
#ifndef DDP__TENSOR_DEVICE_INTERNAL_H
#define DDP__TENSOR_DEVICE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "ddp/tensor.h"

/* The device of local rank `local_rank` among `local_world` ranks on a
 * node with `device_count` devices: local_rank % device_count; *shared
 * tells whether ranks share a device (local_world > device_count).
 * DDP_ERR_INVALID, saying why, when device_count < 1, local_world < 1 or
 * local_rank is not in [0, local_world). */
ddp_status ddp__device_placement(int local_rank, int local_world, int device_count, int *index,
                                 bool *shared);

/* `bytes` of zeroed memory on `device` into *out: the heap for the CPU,
 * the caching allocator for a GPU (zeroed on its stream: later work on the
 * device sees zeros). A distinct pointer even for 0 bytes. On failure
 * *out is NULL and the status says why (no such device, out of memory).
 * Free with ddp__device_free on the same device. */
ddp_status ddp__device_calloc(ddp_device device, size_t bytes, void **out);
/* Frees memory from ddp__device_calloc (NULL ok). On a GPU the memory may
 * still be in use by queued work: it is reused only by work queued later
 * on the same stream. */
void ddp__device_free(ddp_device device, void *ptr);
/* Copies `bytes` from src on src_device to dst on dst_device, any two
 * devices (checked by the caller). A copy to the host is complete on
 * return; one to a GPU is queued on that GPU's stream (from the host:
 * pageable memory is staged before return, pinned memory must stay
 * untouched until the stream has passed the copy). Overlapping ranges are
 * allowed only on the CPU. */
ddp_status ddp__device_copy(ddp_device dst_device, void *dst, ddp_device src_device,
                            const void *src, size_t bytes);

#endif /* DDP__TENSOR_DEVICE_INTERNAL_H */
