/* Decisions of the NCCL backend that need no GPU, as pure functions so that
 * the CPU tests them (tests/comm/test_gpu_policy.c): whether ranks of an
 * NCCL group share a GPU (placement), and what the watchdog does with what
 * it polled (a communicator's asynchronous error, a dead peer, the oldest
 * pending operation's deadline). Compiled in every build; the NCCL backend
 * (src/comm/nccl/) feeds them. Not installed. */
#ifndef DDP__COMM_GPU_POLICY_H
#define DDP__COMM_GPU_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

/* Where one rank of a group runs its GPU work, as it publishes it. */
typedef struct ddp__gpu_place {
  int32_t host;          /* host index: equal values share a host */
  int device;            /* the CUDA ordinal in its own process */
  char uuid[48];         /* the GPU's UUID ("GPU-..."), the same whatever CUDA_VISIBLE_DEVICES */
  char nccl_hostid[64];  /* $NCCL_HOSTID, "" when unset */
  int32_t pid;           /* its process, for the watchdog's check of peers on this host */
} ddp__gpu_place;

/* DDP_OK unless two ranks of one host use one GPU with the same NCCL host
 * id (NCCL refuses them: "Duplicate GPU detected"); then DDP_ERR_INVALID
 * naming both ranks, their host, the GPU and what to do (a GPU per rank, or
 * backend "ddp", which stages GPU buffers through host memory). Ranks with
 * distinct NCCL_HOSTID pass: NCCL takes them for two hosts (the one-GPU
 * test arrangement, docs/comm.md). host_names: per rank, for the message. */
ddp_status ddp__gpu_placement_check(const ddp__gpu_place *ranks, int n,
                                    const char *const *host_names);

/* What the watchdog polled for one communicator. */
typedef struct ddp__watch_input {
  int64_t now_ns;
  int rank, size;       /* this rank in the group */
  /* The oldest operation not yet complete (none: op NULL). */
  const char *op;       /* "allreduce" */
  uint64_t seq;
  int64_t deadline_ns;  /* when it times out */
  int64_t started_ns;   /* when it was enqueued */
  /* Where that operation stands on its GPU, from its CUDA events (the
   * start event recorded before its kernels, the end event after):
   * DDP__DEVICE_UNKNOWN (no events: a host engine), DDP__DEVICE_QUEUED (the
   * start event has not passed: work queued before it on the
   * communication stream has not finished), DDP__DEVICE_RUNNING (started
   * at device_started_ns, not ended: its kernels wait for the peers). */
  int device_state;
  int64_t device_started_ns;
  int device;           /* its CUDA ordinal, for the message */
  /* ncclCommGetAsyncError: 0 ncclSuccess, 7 ncclInProgress (not an
   * error), else the failure, with NCCL's string for it. */
  int async_error;
  const char *async_error_str;
  /* A peer known dead (the store's or the launcher's word): its group rank,
   * -1 none, and why. */
  int dead_peer;
  const char *dead_why;
} ddp__watch_input;

enum { DDP__DEVICE_UNKNOWN = 0, DDP__DEVICE_QUEUED = 1, DDP__DEVICE_RUNNING = 2 };

typedef enum ddp__watch_action {
  DDP__WATCH_CONTINUE = 0, /* nothing wrong: poll again */
  DDP__WATCH_ABORT,        /* abort the communicator and fail every operation */
} ddp__watch_action;

/* The watchdog's decision. On ABORT, *status (DDP_ERR_IO for NCCL's own
 * error, DDP_ERR_PEER for a dead peer, DDP_ERR_TIMEOUT for a deadline) and
 * msg name the operation (or "no operation pending") and the rank; a
 * timeout also says where the operation stood on its GPU (never started:
 * stuck behind earlier work on the stream; running: waiting for peers). An
 * asynchronous error comes first (it is NCCL's own diagnosis), then a dead
 * peer, then the deadline. */
ddp__watch_action ddp__watch_decide(const ddp__watch_input *in, ddp_status *status, char *msg,
                                    size_t bytes);

#endif /* DDP__COMM_GPU_POLICY_H */
