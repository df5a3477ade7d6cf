/* CUDA buffers over ddp's own backends (docs/comm.md, "CUDA buffers on the
 * CPU backends"), gloo's way: an operation on a GPU's buffers copies its
 * inputs into pinned host memory, runs on the host backend, and copies its
 * outputs back. A wrapper around a blocking backend, put on ddp's own
 * backends where the process has a CUDA device, so a GPU job runs where
 * NCCL cannot (no NCCL, ranks sharing a GPU) and CPU and GPU buffers mix
 * on one group. Not installed. */
#ifndef DDP__COMM_STAGED_H
#define DDP__COMM_STAGED_H

#include <stdbool.h>
#include <stddef.h>

#include "comm/backend.h"

/* Which of an operation's buffers travel, and how many bytes (on this rank
 * of a group of `size`): send is copied to the host before the op (inputs
 * only); buf is copied to the host before when it holds input (buf_in),
 * and back after when this rank receives into it (buf_out). A buffer that
 * is NULL or not touched on this rank has 0 bytes. Pure. */
typedef struct ddp__staged_plan {
  size_t send_bytes;
  size_t buf_bytes;
  bool buf_in;
  bool buf_out;
} ddp__staged_plan;
void ddp__staged_plan_of(const ddp__op_args *a, int rank, int size, ddp__staged_plan *out);

/* How the wrapper moves bytes: the tensor layer's pinned memory and copies
 * (a GPU run), or a test's own (the CPU playing a GPU). */
typedef struct ddp__staged_copier {
  ddp_status (*host_alloc)(ddp_device device, size_t bytes, void **out);
  void (*host_free)(void *ptr);
  /* Both wait until the copy is done. */
  ddp_status (*to_host)(void *host, ddp_device device, const void *src, size_t bytes);
  ddp_status (*to_device)(ddp_device device, void *dst, const void *host, size_t bytes);
} ddp__staged_copier;

/* Tests: a copier to use instead of the tensor layer's, and whether groups
 * are wrapped (0: where there is a CUDA device; 1: always, the CPU playing
 * a GPU; -1: never, to see ddp's own backends refuse GPU buffers). Set
 * before groups are made. */
extern const ddp__staged_copier *ddp__staged_copier_hook;
extern int ddp__staged_mode;

/* Whether ddp's own backend of a new group is wrapped (ddp__staged_mode). */
bool ddp__staged_wanted(void);

/* Wraps *b in place when it is a blocking backend (its enqueue completes
 * inside; any other, a test's engine, is left as it is): on success *b is
 * the wrapper, which owns and destroys the original; on failure *b is
 * untouched. */
ddp_status ddp__backend_staged_wrap(ddp__backend **b, int rank, int size);
/* The backend a wrapper wraps (b itself when b is not one): the group
 * layer runs ops on host buffers on it directly (comm_internal.h,
 * host_backend). */
ddp__backend *ddp__staged_inner(ddp__backend *b);
/* Tests: ops on host buffers that reached the wrapper (the group layer
 * should send none there). */
extern _Atomic long ddp__staged_host_passes;

#endif /* DDP__COMM_STAGED_H */
