/* One collective or point-to-point operation as the comm layer describes it
 * everywhere: its kind and arguments, their names for messages, and the
 * clocks its deadline is read from. A leaf of comm: the group layer, the
 * backends and the flight recorder all include it, and it includes nothing
 * of theirs. Not installed. */
#ifndef DDP__COMM_OP_H
#define DDP__COMM_OP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "ddp/comm.h"
#include "ddp/tensor.h" /* ddp_device */

/* The operations the queue can hold. */
typedef enum ddp__op_kind {
  DDP__OP_ALLREDUCE = 0,
  DDP__OP_BROADCAST,
  DDP__OP_REDUCE,
  DDP__OP_ALLGATHER,
  DDP__OP_GATHER,
  DDP__OP_SCATTER,
  DDP__OP_REDUCE_SCATTER,
  DDP__OP_ALL_TO_ALL,
  DDP__OP_BARRIER,
  DDP__OP_SEND,
  DDP__OP_RECV,
  /* batch_isend_irecv as one operation of the queue, for an engine that
   * groups the batch's sends and receives itself (NCCL: ncclGroupStart/End
   * around them, docs/comm.md); ddp's own backends run batches on the
   * point-to-point lane instead and never see this kind. */
  DDP__OP_P2P_BATCH,
  DDP__OP_KIND_COUNT
} ddp__op_kind;

/* "allreduce", "send", ... */
const char *ddp__op_kind_name(ddp__op_kind kind);
/* Collectives (every rank takes part) versus point-to-point. */
static inline bool ddp__op_is_collective(ddp__op_kind kind) {
  return kind != DDP__OP_SEND && kind != DDP__OP_RECV && kind != DDP__OP_P2P_BATCH;
}

/* Operations that reduce (and so take a reduce op). */
static inline bool ddp__op_reduces(ddp__op_kind kind) {
  return kind == DDP__OP_ALLREDUCE || kind == DDP__OP_REDUCE || kind == DDP__OP_REDUCE_SCATTER;
}

/* One operation's arguments, as the user gave them (after validation). */
typedef struct ddp__op_args {
  ddp__op_kind kind;
  const void *send; /* allgather, gather, scatter, reduce_scatter, all_to_all, send */
  void *buf;        /* in place ops' buffer, or the receive buffer */
  size_t count;     /* elements of dtype */
  ddp_dtype dtype;
  ddp_reduce_op reduce_op;
  int root;         /* root, or the peer of send / recv */
  int tag;
  /* Where send and buf are (both on one device); DDP_CPU for every call of
   * comm.h today. A backend refuses a device its caps do not list. */
  ddp_device device;
  /* The program called the blocking form (no work handle). Unlike where
   * the op runs (inline or on the progress thread, which depends on this
   * rank's queue), it is the same on every rank of an SPMD program: a
   * backend may choose by it what every rank must choose alike (MPI's
   * blocking collectives match only blocking ones). Set by ddp__submit. */
  bool blocking_call;
  /* DDP__OP_P2P_BATCH: the batch's operations (count of them), owned by
   * the work handle that carries the op (ddp__submit copies the caller's);
   * dtype is batch[0]'s, for the caps check. NULL otherwise. */
  const ddp_p2p_op *batch;
  uint64_t seq;     /* collectives: the group's collective number; p2p: own counter */
  uint64_t flight;  /* its flight recorder record's id + 1; 0: none yet (flight.h) */
} ddp__op_args;

/* The one device an operation's buffers are on (docs/comm.md, "Buffers on
 * devices"), from the devices of its send and receive buffers as
 * ddp_pointer_device found them (a NULL buffer is absent and says
 * nothing; none at all: the CPU). Buffers on two devices are refused
 * (DDP_ERR_INVALID naming the call, both buffers and both devices): no
 * backend moves data between devices inside a collective. Pure: tested on
 * the CPU with made-up devices. */
ddp_status ddp__op_device_pick(const char *call, const void *send, ddp_device send_device,
                               const void *buf, ddp_device buf_device, ddp_device *out);

/* "allreduce(count=10, float32, sum)" */
void ddp__op_describe(const ddp__op_args *args, int group_size, char *out, size_t bytes);

/* Deadline helper: now + ns, saturating. */
static inline int64_t ddp__deadline_after(int64_t ns) {
  int64_t now = ddp_time_ns();
  return ns > INT64_MAX - now ? INT64_MAX : now + ns;
}

/* CLOCK_MONOTONIC's coarse reading (the same clock, read from the last
 * tick: at most a few ms behind, so a deadline from it is at most that
 * early). Every operation reads it once, for its deadline and the flight
 * recorder; where the precise clock costs ~100 ns (no vDSO), the coarse one
 * costs ~5. */
static inline int64_t ddp__now_coarse_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* now + ns, saturating (now from either clock above). */
static inline int64_t ddp__deadline_from(int64_t now, int64_t ns) {
  return ns > INT64_MAX - now ? INT64_MAX : now + ns;
}

#endif /* DDP__COMM_OP_H */
