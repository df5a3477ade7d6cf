/* The NCCL backend (docs/comm.md, "The NCCL backend"): a group's operations
 * on CUDA buffers run as NCCL kernels on a communication stream of the
 * group's own, ordered after the work already queued on the buffers'
 * device (the tensor layer's compute stream and the legacy default stream)
 * by CUDA events; each completes when its end event has passed, which the
 * group layer polls through test. The communicator is made at the group's
 * first operation, on that operation's device (PyTorch's lazy init): the
 * ranks publish where they run, are checked for a shared GPU
 * (ddp__gpu_placement_check), and rank 0's unique id travels through the
 * group's store. A subgroup is a group of its own here, with its own
 * communicator made the same way in its own namespace. A watchdog thread
 * polls the communicator's asynchronous error and the oldest operation's
 * deadline (ddp__watch_decide) and aborts the communicator (ncclCommAbort)
 * when it must, failing every pending operation and every later one. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comm/backend.h"
#include "comm/flight/flight.h"
#include "comm/gpu_policy.h"
#include "comm/nccl/nccl_api.h"
#include "core/core_internal.h"
#include "tensor/cuda/runtime.h"

/* In flight at once per group: the ring of pending completions. */
#define NCCL_IN_FLIGHT 64
/* How often the watchdog polls (ms). */
#define WATCH_PERIOD_MS 100

/* One pending operation: its two CUDA events (PyTorch's ncclStartEvent_
 * and ncclEndEvent_), from which the watchdog knows where it stands on the
 * GPU and the flight recorder its started and completed states. */
typedef struct op_state {
  cudaEvent_t start;  /* recorded on the communication stream before its kernels */
  cudaEvent_t done;   /* recorded on the communication stream after them */
  int64_t deadline_ns;
  int64_t started_ns; /* enqueued (host clock) */
  int64_t device_started_ns; /* when the start event was seen passed; -1 not yet */
  const char *op;     /* static names only */
  uint64_t seq;
  struct ddp__flight *flight; /* the group's recorder (NULL: off) */
  uint64_t flight_record;     /* the op's record in it (ctx->flight_record) */
} op_state;
_Static_assert(sizeof(op_state) <= sizeof(((ddp__completion *)0)->state), "op_state fits");

typedef struct nccl_backend {
  ddp__backend base;
  const ddp__nccl_api *api;
  ddp_store *store; /* the group's namespace, borrowed (the group outlives us) */
  int rank, size;
  int32_t *host_of;   /* size entries, copied */
  /* Peers' processes on this host (0: another host, or this rank), from the
   * placement exchange: the watchdog sees a peer die while an operation
   * waits for it (NCCL's sockets may not say so for a long time). */
  int32_t *peer_pid;
  int dead_seen, dead_seen_rank; /* consecutive watchdog periods a peer was seen gone */
  uint64_t dead_seen_seq;
  char **host_names;  /* size entries, copied */
  int64_t timeout_ns;
  /* Made at the first operation (comm == NULL before). */
  atomic_bool ready;
  int device;
  ncclComm_t comm;
  cudaStream_t stream;  /* the communication stream */
  cudaEvent_t produced; /* scratch: the producing streams' point before an op */
  cudaEvent_t produced_legacy;
  int32_t *barrier_buf; /* one int on the device for barrier */
  /* Pending completions in enqueue order (they complete in that order). */
  pthread_mutex_t mu;
  ddp__completion *pending[NCCL_IN_FLIGHT];
  int head, count;
  /* Once failed (watchdog, abort, an NCCL error): every later op fails so. */
  atomic_bool failed;
  ddp_status fail_status;
  char fail_msg[1024];
  atomic_bool aborted_comm; /* ncclCommAbort called (never destroy then) */
  pthread_t watchdog;
  bool watchdog_running;
  atomic_bool stop;
} nccl_backend;

static nccl_backend *nb(ddp__backend *b) { return (nccl_backend *)b; }

/* ---- Errors ---------------------------------------------------------------- */

static ddp_status nccl_fail(nccl_backend *n, ncclResult_t r, const char *what, const ddp__op_ctx *ctx) {
  const char *last = n->api->GetLastError ? n->api->GetLastError(n->comm) : "";
  return ddp_error(r == ncclInvalidArgument || r == ncclInvalidUsage ? DDP_ERR_INVALID : DDP_ERR_IO,
                   "nccl: %s #%llu (rank %d of %d, cuda:%d): %s: %s%s%s", ctx ? ctx->op : "setup",
                   ctx ? (unsigned long long)ctx->seq : 0ULL, n->rank, n->size, n->device, what,
                   n->api->GetErrorString(r), last && last[0] ? ": " : "", last ? last : "");
}

static ddp_status cuda_fail(nccl_backend *n, cudaError_t e, const char *what, const ddp__op_ctx *ctx) {
  (void)cudaGetLastError();
  return ddp_error(e == cudaErrorMemoryAllocation ? DDP_ERR_NOMEM : DDP_ERR_IO,
                   "nccl: %s #%llu (rank %d of %d, cuda:%d): %s: %s (%s)", ctx ? ctx->op : "setup",
                   ctx ? (unsigned long long)ctx->seq : 0ULL, n->rank, n->size, n->device, what,
                   cudaGetErrorName(e), cudaGetErrorString(e));
}

#define NCCL_TRY(n, call, what, ctx)                          \
  do {                                                        \
    ncclResult_t r_ = (call);                                 \
    if (r_ != ncclSuccess) return nccl_fail(n, r_, what, ctx); \
  } while (0)
#define CUDA_TRY(n, call, what, ctx)                          \
  do {                                                        \
    cudaError_t e_ = (call);                                  \
    if (e_ != cudaSuccess) return cuda_fail(n, e_, what, ctx); \
  } while (0)

/* Marks the backend failed (first failure kept) and returns its status. */
static void set_failed(nccl_backend *n, ddp_status st, const char *msg) {
  pthread_mutex_lock(&n->mu);
  if (!atomic_load(&n->failed)) {
    n->fail_status = st;
    snprintf(n->fail_msg, sizeof n->fail_msg, "%s", msg);
    atomic_store(&n->failed, true);
  }
  pthread_mutex_unlock(&n->mu);
}

static ddp_status failed_status(nccl_backend *n) {
  return ddp_error(n->fail_status, "%s", n->fail_msg);
}

/* ---- Types ------------------------------------------------------------------ */

static ncclDataType_t nccl_dtype(ddp_dtype d) {
  switch (d) {
  case DDP_FLOAT32: return ncclFloat32;
  case DDP_FLOAT64: return ncclFloat64;
  case DDP_INT32: return ncclInt32;
  case DDP_INT64: return ncclInt64;
  case DDP_FLOAT16: return ncclFloat16;
  case DDP_BFLOAT16: return ncclBfloat16;
  default: return ncclUint8;
  }
}

static ncclRedOp_t nccl_op(ddp_reduce_op op) {
  switch (op) {
  case DDP_REDUCE_AVG: return ncclAvg; /* NCCL >= 2.10: divides in the kernel */
  case DDP_REDUCE_MIN: return ncclMin;
  case DDP_REDUCE_MAX: return ncclMax;
  case DDP_REDUCE_PRODUCT: return ncclProd;
  default: return ncclSum;
  }
}

/* ---- The communicator, at the first operation -------------------------------- */

static void uuid_str(const cudaUUID_t *u, char *out, size_t bytes) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  snprintf(out, bytes,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
           b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int64_t remaining_ms(const ddp__op_ctx *ctx, int64_t fallback_ns) {
  int64_t left = ctx ? ctx->deadline_ns - ddp_time_ns() : fallback_ns;
  return left <= 0 ? 1 : left / 1000000;
}

/* Every rank publishes where it runs; all check for a shared GPU. */
static ddp_status check_placement(nccl_backend *n, const ddp__op_ctx *ctx) {
  ddp__gpu_place me = {.host = n->host_of[n->rank], .device = n->device, .pid = (int32_t)getpid()};
  struct cudaDeviceProp prop;
  CUDA_TRY(n, cudaGetDeviceProperties(&prop, n->device), "cudaGetDeviceProperties", ctx);
  uuid_str(&prop.uuid, me.uuid, sizeof me.uuid);
  snprintf(me.nccl_hostid, sizeof me.nccl_hostid, "%s", ddp_env_str("NCCL_HOSTID", ""));
  char key[48];
  snprintf(key, sizeof key, "nccl/place/%d", n->rank);
  DDP_TRY(ddp_store_set(n->store, key, &me, sizeof me));
  ddp__gpu_place *all = ddp_calloc((size_t)n->size, sizeof *all);
  if (!all) return ddp_error(DDP_ERR_NOMEM, "nccl: placement table of %d ranks", n->size);
  ddp_status st = DDP_OK;
  for (int r = 0; r < n->size && st == DDP_OK; r++) {
    void *v = NULL;
    size_t bytes = 0;
    snprintf(key, sizeof key, "nccl/place/%d", r);
    st = ddp_store_get(n->store, key, remaining_ms(ctx, n->timeout_ns), &v, &bytes);
    if (st == DDP_OK && bytes == sizeof *all) memcpy(&all[r], v, sizeof *all);
    else if (st == DDP_OK)
      st = ddp_error(DDP_ERR_FORMAT, "nccl: rank %d's placement is %zu bytes, not %zu (another "
                     "ddp version?)", r, bytes, sizeof *all);
    else
      st = ddp_error_wrap(st, "nccl: rank %d (of %d) waiting for rank %d's GPU", n->rank, n->size, r);
    ddp_free(v);
  }
  if (st == DDP_OK) st = ddp__gpu_placement_check(all, n->size, (const char *const *)n->host_names);
  if (st == DDP_OK && !n->peer_pid) {
    n->peer_pid = ddp_calloc((size_t)n->size, sizeof *n->peer_pid);
    for (int r = 0; n->peer_pid && r < n->size; r++)
      if (r != n->rank && all[r].host == me.host && all[r].pid > 0) n->peer_pid[r] = all[r].pid;
  }
  ddp_free(all);
  return st;
}

static ddp_status make_comm(nccl_backend *n, int device, const ddp__op_ctx *ctx) {
  n->device = device;
  DDP_TRY(ddp__cuda_set_device(device));
  DDP_TRY(check_placement(n, ctx));
  ncclUniqueId id;
  if (n->rank == 0) {
    NCCL_TRY(n, n->api->GetUniqueId(&id), "ncclGetUniqueId", ctx);
    DDP_TRY(ddp_store_set(n->store, "nccl/uid", &id, sizeof id));
  } else {
    void *v = NULL;
    size_t bytes = 0;
    ddp_status st = ddp_store_get(n->store, "nccl/uid", remaining_ms(ctx, n->timeout_ns), &v, &bytes);
    if (st != DDP_OK) return ddp_error_wrap(st, "nccl: rank %d waiting for rank 0's unique id", n->rank);
    if (bytes != sizeof id) {
      ddp_free(v);
      return ddp_error(DDP_ERR_FORMAT, "nccl: the unique id in the store is %zu bytes, not %zu", bytes,
                       sizeof id);
    }
    memcpy(&id, v, sizeof id);
    ddp_free(v);
  }
  NCCL_TRY(n, n->api->CommInitRank(&n->comm, n->size, id, n->rank), "ncclCommInitRank", ctx);
  /* Non-blocking: the legacy default stream does not serialise with it;
   * the events below order it after the producers instead. */
  CUDA_TRY(n, cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking), "cudaStreamCreate", ctx);
  CUDA_TRY(n, cudaEventCreateWithFlags(&n->produced, cudaEventDisableTiming), "cudaEventCreate", ctx);
  CUDA_TRY(n, cudaEventCreateWithFlags(&n->produced_legacy, cudaEventDisableTiming), "cudaEventCreate", ctx);
  CUDA_TRY(n, cudaMalloc((void **)&n->barrier_buf, sizeof(int32_t)), "cudaMalloc (barrier)", ctx);
  CUDA_TRY(n, cudaMemsetAsync(n->barrier_buf, 0, sizeof(int32_t), n->stream), "cudaMemsetAsync", ctx);
  char v[32];
  ddp__nccl_version_str(n->api->version, v, sizeof v);
  ddp_log(DDP_LOG_INFO, "nccl: rank %d of %d on cuda:%d, NCCL %s (%s)", n->rank, n->size, device, v,
          n->api->path);
  atomic_store(&n->ready, true);
  return DDP_OK;
}

/* ---- Launching ---------------------------------------------------------------- */

static size_t esize(ddp_dtype d) { return ddp_dtype_size(d); }

/* batch_isend_irecv: every send and receive of the batch between
 * ncclGroupStart and ncclGroupEnd, so NCCL launches them as one and no
 * send waits for a receive queued behind it (PyTorch's batch_isend_irecv on
 * NCCL; the batch's tags are not NCCL's to match: messages between a pair
 * match in posting order, docs/comm.md). A send to or receive from this
 * rank is NCCL's own self copy. */
static ddp_status launch_batch(nccl_backend *n, const ddp__op_ctx *ctx, const ddp__op_args *a) {
  const ddp__nccl_api *api = n->api;
  NCCL_TRY(n, api->GroupStart(), "ncclGroupStart", ctx);
  ncclResult_t r = ncclSuccess;
  size_t i = 0;
  for (; i < a->count && r == ncclSuccess; i++) {
    const ddp_p2p_op *o = &a->batch[i];
    if (o->kind == DDP_P2P_SEND)
      r = api->Send(o->buf, o->count, nccl_dtype(o->dtype), o->peer, n->comm, n->stream);
    else
      r = api->Recv(o->buf, o->count, nccl_dtype(o->dtype), o->peer, n->comm, n->stream);
  }
  ncclResult_t end = api->GroupEnd();
  if (r != ncclSuccess) {
    char what[64];
    snprintf(what, sizeof what, "ops[%zu] (%s rank %d)", i - 1,
             a->batch[i - 1].kind == DDP_P2P_SEND ? "ncclSend to" : "ncclRecv from", a->batch[i - 1].peer);
    return nccl_fail(n, r, what, ctx);
  }
  if (end != ncclSuccess) return nccl_fail(n, end, "ncclGroupEnd", ctx);
  return DDP_OK;
}

/* The NCCL calls of one operation, on n->stream (inside a group where it
 * takes several). */
static ddp_status launch(nccl_backend *n, const ddp__op_ctx *ctx, const ddp__op_args *a) {
  const ddp__nccl_api *api = n->api;
  ncclComm_t c = n->comm;
  cudaStream_t s = n->stream;
  ncclDataType_t dt = nccl_dtype(a->dtype);
  size_t block = a->count * esize(a->dtype);
  const char *send = a->send;
  char *recv = a->buf;
  switch (a->kind) {
  case DDP__OP_ALLREDUCE:
    NCCL_TRY(n, api->AllReduce(recv, recv, a->count, dt, nccl_op(a->reduce_op), c, s), "ncclAllReduce", ctx);
    return DDP_OK;
  case DDP__OP_BROADCAST:
    NCCL_TRY(n, api->Broadcast(recv, recv, a->count, dt, a->root, c, s), "ncclBroadcast", ctx);
    return DDP_OK;
  case DDP__OP_REDUCE:
    NCCL_TRY(n, api->Reduce(recv, recv, a->count, dt, nccl_op(a->reduce_op), a->root, c, s), "ncclReduce", ctx);
    return DDP_OK;
  case DDP__OP_ALLGATHER:
    NCCL_TRY(n, api->AllGather(send, recv, a->count, dt, c, s), "ncclAllGather", ctx);
    return DDP_OK;
  case DDP__OP_REDUCE_SCATTER:
    NCCL_TRY(n, api->ReduceScatter(send, recv, a->count, dt, nccl_op(a->reduce_op), c, s),
             "ncclReduceScatter", ctx);
    return DDP_OK;
  case DDP__OP_BARRIER:
    NCCL_TRY(n, api->AllReduce(n->barrier_buf, n->barrier_buf, 1, ncclInt32, ncclSum, c, s),
             "ncclAllReduce (barrier)", ctx);
    return DDP_OK;
  case DDP__OP_SEND:
    NCCL_TRY(n, api->Send(send, a->count, dt, a->root, c, s), "ncclSend", ctx);
    return DDP_OK;
  case DDP__OP_RECV:
    NCCL_TRY(n, api->Recv(recv, a->count, dt, a->root, c, s), "ncclRecv", ctx);
    return DDP_OK;
  case DDP__OP_P2P_BATCH:
    return launch_batch(n, ctx, a);
  default:
    break;
  }
  /* all_to_all, gather and scatter: send/recv pairs in one NCCL group, so
   * that no rank's send waits for a receive queued behind it (NCCL's own
   * ncclAlltoAll/Gather/Scatter are 2.28 and later; these run on older). */
  NCCL_TRY(n, api->GroupStart(), "ncclGroupStart", ctx);
  ncclResult_t r = ncclSuccess;
  const char *what = "ncclSend/ncclRecv";
  for (int p = 0; p < n->size && r == ncclSuccess; p++) {
    size_t off = (size_t)p * block;
    if (a->kind == DDP__OP_ALL_TO_ALL) {
      r = api->Send(send + off, a->count, dt, p, c, s);
      if (r == ncclSuccess) r = api->Recv(recv + off, a->count, dt, p, c, s);
    } else if (a->kind == DDP__OP_GATHER) {
      if (p == n->rank) r = api->Send(send, a->count, dt, a->root, c, s);
      if (r == ncclSuccess && n->rank == a->root) r = api->Recv(recv + off, a->count, dt, p, c, s);
    } else { /* scatter */
      if (n->rank == a->root) r = api->Send(send + off, a->count, dt, p, c, s);
      if (r == ncclSuccess && p == n->rank) r = api->Recv(recv, a->count, dt, a->root, c, s);
    }
  }
  ncclResult_t end = api->GroupEnd();
  if (r != ncclSuccess) return nccl_fail(n, r, what, ctx);
  if (end != ncclSuccess) return nccl_fail(n, end, "ncclGroupEnd", ctx);
  return DDP_OK;
}

/* ---- The backend's table --------------------------------------------------------- */

static void finish_locked(nccl_backend *n, ddp__completion *c, ddp_status st) {
  op_state *s = (op_state *)c->state;
  if (s->done) cudaEventDestroy(s->done);
  if (s->start) cudaEventDestroy(s->start);
  s->done = s->start = NULL;
  (void)n;
  ddp__completion_finish(c, st);
}

static ddp_status nccl_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *a,
                               ddp__completion *c) {
  nccl_backend *n = nb(b);
  if (atomic_load(&n->failed)) return failed_status(n);
  /* A barrier has no buffer (its device is the CPU): it runs on the
   * communicator's GPU, or, before the first op, this thread's current one
   * (as PyTorch's NCCL barrier guesses the device). */
  ddp__op_args barrier_args;
  if (a->kind == DDP__OP_BARRIER && a->device.type != DDP_DEVICE_CUDA) {
    barrier_args = *a;
    barrier_args.device = DDP_CUDA(atomic_load(&n->ready) ? n->device : ddp__cuda_current_device());
    a = &barrier_args;
  }
  if (a->device.type != DDP_DEVICE_CUDA)
    return ddp_error(DDP_ERR_INVALID, "nccl: %s #%llu (rank %d of %d): buffers on the CPU; the nccl "
                     "backend takes CUDA buffers (use backend \"ddp\" for host memory)",
                     ctx->op, (unsigned long long)ctx->seq, n->rank, n->size);
  if (!atomic_load(&n->ready)) {
    ddp_status st = make_comm(n, a->device.index, ctx);
    if (st != DDP_OK) { /* half made: nothing later can use it */
      set_failed(n, st, ddp_last_error());
      return st;
    }
  }
  if (a->device.index != n->device)
    return ddp_error(DDP_ERR_INVALID, "nccl: %s #%llu (rank %d of %d): buffers on cuda:%d, but this "
                     "group's communicator is on cuda:%d (its first operation's device): one group "
                     "serves one GPU per rank", ctx->op, (unsigned long long)ctx->seq, n->rank,
                     n->size, (int)a->device.index, n->device);
  DDP_TRY(ddp__cuda_set_device(n->device));
  op_state *s = (op_state *)c->state;
  memset(s, 0, sizeof *s);
  /* After the work that produced the buffers: the tensor layer's stream,
   * and the legacy default stream (plain cudaMemcpy, other libraries). */
  CUDA_TRY(n, cudaEventRecord(n->produced, ddp__cuda_stream()), "cudaEventRecord", ctx);
  CUDA_TRY(n, cudaEventRecord(n->produced_legacy, cudaStreamLegacy), "cudaEventRecord", ctx);
  CUDA_TRY(n, cudaStreamWaitEvent(n->stream, n->produced, 0), "cudaStreamWaitEvent", ctx);
  CUDA_TRY(n, cudaStreamWaitEvent(n->stream, n->produced_legacy, 0), "cudaStreamWaitEvent", ctx);
  /* The completion's state comes from the work pool uninitialized: no
   * handle of an earlier op may be destroyed on this op's error path. */
  s->start = NULL;
  s->done = NULL;
  CUDA_TRY(n, cudaEventCreateWithFlags(&s->start, cudaEventDisableTiming), "cudaEventCreate", ctx);
  cudaError_t e = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
  ddp_status st = e == cudaSuccess ? DDP_OK : cuda_fail(n, e, "cudaEventCreate", ctx);
  if (st == DDP_OK) {
    e = cudaEventRecord(s->start, n->stream);
    if (e != cudaSuccess) st = cuda_fail(n, e, "cudaEventRecord (start)", ctx);
  }
  if (st == DDP_OK) st = launch(n, ctx, a);
  if (st == DDP_OK) {
    e = cudaEventRecord(s->done, n->stream);
    if (e != cudaSuccess) st = cuda_fail(n, e, "cudaEventRecord", ctx);
  }
  if (st != DDP_OK) {
    cudaEventDestroy(s->start);
    if (s->done) cudaEventDestroy(s->done);
    s->start = NULL;
    s->done = NULL;
    return st;
  }
  s->deadline_ns = ctx->deadline_ns;
  s->started_ns = ddp_time_ns();
  s->device_started_ns = -1;
  s->op = ctx->op;
  s->seq = ctx->seq;
  s->flight = ctx->flight;
  s->flight_record = ctx->flight_record;
  pthread_mutex_lock(&n->mu);
  if (n->count == NCCL_IN_FLIGHT) { /* the group layer keeps to caps.max_in_flight */
    pthread_mutex_unlock(&n->mu);
    DDP_ASSERT(!"nccl: more operations in flight than caps.max_in_flight");
  }
  n->pending[(n->head + n->count++) % NCCL_IN_FLIGHT] = c;
  pthread_mutex_unlock(&n->mu);
  return DDP_OK;
}

/* The op's start event has passed (first seen now): recorded, and marked
 * started in the flight recorder (before the op completes, so the group
 * layer's end write comes after this one). */
static void note_started_locked(op_state *s) {
  if (s->device_started_ns >= 0 || cudaEventQuery(s->start) != cudaSuccess) return;
  s->device_started_ns = ddp_time_ns();
  if (s->flight) ddp__flight_mark_started(s->flight, s->flight_record, ddp__now_coarse_ns());
}

/* Completes, in order, every pending op whose end event has passed (the
 * ops of one stream start and end in order, so only the oldest can be
 * started and not ended). */
static void reap_locked(nccl_backend *n) {
  while (n->count > 0) {
    ddp__completion *c = n->pending[n->head];
    op_state *s = (op_state *)c->state;
    note_started_locked(s);
    cudaError_t e = cudaEventQuery(s->done);
    if (e == cudaErrorNotReady) return;
    if (e == cudaSuccess) note_started_locked(s); /* passed too, if just now */
    ddp_status st = DDP_OK;
    if (e != cudaSuccess) {
      ddp__op_ctx named = {.op = s->op, .seq = s->seq}; /* for the message */
      st = cuda_fail(n, e, "the operation's kernels", &named);
      atomic_store(&n->failed, true);
      n->fail_status = st;
      snprintf(n->fail_msg, sizeof n->fail_msg, "%s", ddp_last_error());
    }
    n->head = (n->head + 1) % NCCL_IN_FLIGHT;
    n->count--;
    finish_locked(n, c, st);
  }
}

/* Fails every pending op with the backend's failure. */
static void fail_pending_locked(nccl_backend *n) {
  while (n->count > 0) {
    ddp__completion *c = n->pending[n->head];
    n->head = (n->head + 1) % NCCL_IN_FLIGHT;
    n->count--;
    ddp_error(n->fail_status, "%s", n->fail_msg);
    finish_locked(n, c, n->fail_status);
  }
}

static bool nccl_test(ddp__backend *b, ddp__completion *c) {
  nccl_backend *n = nb(b);
  if (atomic_load_explicit(&c->done, memory_order_acquire)) return true;
  pthread_mutex_lock(&n->mu);
  if (atomic_load(&n->failed)) fail_pending_locked(n);
  else reap_locked(n);
  pthread_mutex_unlock(&n->mu);
  return atomic_load_explicit(&c->done, memory_order_acquire);
}

static void abort_comm(nccl_backend *n) {
  if (atomic_load(&n->ready) && !atomic_exchange(&n->aborted_comm, true)) n->api->CommAbort(n->comm);
}

static void nccl_abort(ddp__backend *b) {
  nccl_backend *n = nb(b);
  set_failed(n, DDP_ERR_ABORTED, "nccl: the group was aborted");
  abort_comm(n);
  pthread_mutex_lock(&n->mu);
  fail_pending_locked(n);
  pthread_mutex_unlock(&n->mu);
}

/* The watchdog: NCCL's asynchronous error and the oldest op's deadline
 * (the group layer also times out what it waits for; this covers async
 * work nobody waits on), decided by ddp__watch_decide. */
static void *watchdog_main(void *arg) {
  nccl_backend *n = arg;
  while (!atomic_load(&n->stop)) {
    struct timespec ts = {0, WATCH_PERIOD_MS * 1000000L};
    nanosleep(&ts, NULL);
    if (!atomic_load(&n->ready) || atomic_load(&n->failed)) continue;
    ddp__watch_input in = {.now_ns = ddp_time_ns(), .rank = n->rank, .size = n->size, .dead_peer = -1};
    ncclResult_t async = ncclSuccess;
    if (n->api->CommGetAsyncError(n->comm, &async) == ncclSuccess && async != ncclSuccess) {
      in.async_error = (int)async;
      in.async_error_str = n->api->GetErrorString(async);
    }
    pthread_mutex_lock(&n->mu);
    reap_locked(n); /* what has completed is not waiting for anyone */
    if (n->count > 0) {
      const op_state *s = (const op_state *)n->pending[n->head]->state;
      in.op = s->op;
      in.seq = s->seq;
      in.deadline_ns = s->deadline_ns;
      in.started_ns = s->started_ns;
      in.device = n->device;
      in.device_state = s->device_started_ns >= 0 ? DDP__DEVICE_RUNNING : DDP__DEVICE_QUEUED;
      in.device_started_ns = s->device_started_ns;
    }
    pthread_mutex_unlock(&n->mu);
    /* A peer on this host whose process is gone while an operation waits:
     * seen twice in a row on the same operation (a peer that finished its
     * part and exited, while ours completes in this instant, is not dead
     * to it). Idle, nothing is checked: peers may exit at the end. */
    char why[64];
    int gone = -1;
    for (int r = 0; in.op && n->peer_pid && r < n->size && gone < 0; r++)
      if (n->peer_pid[r] > 0 && kill(n->peer_pid[r], 0) != 0 && errno == ESRCH) gone = r;
    if (gone >= 0 && n->dead_seen_rank == gone && n->dead_seen_seq == in.seq) {
      n->dead_seen++;
    } else {
      n->dead_seen = gone >= 0;
      n->dead_seen_rank = gone;
      n->dead_seen_seq = in.seq;
    }
    if (gone >= 0 && n->dead_seen >= 2) {
      snprintf(why, sizeof why, "process %d is gone", (int)n->peer_pid[gone]);
      in.dead_peer = gone;
      in.dead_why = why;
    }
    ddp_status st = DDP_OK;
    char msg[512];
    if (ddp__watch_decide(&in, &st, msg, sizeof msg) == DDP__WATCH_ABORT) {
      ddp_log(DDP_LOG_ERROR, "%s", msg);
      set_failed(n, st, msg);
      abort_comm(n);
      pthread_mutex_lock(&n->mu);
      fail_pending_locked(n);
      pthread_mutex_unlock(&n->mu);
    }
  }
  return NULL;
}

static const char *nccl_transport(const ddp__backend *b, int peer) {
  (void)b;
  (void)peer;
  return "nccl";
}

static void nccl_destroy(ddp__backend *b) {
  nccl_backend *n = nb(b);
  if (!n) return;
  atomic_store(&n->stop, true);
  if (n->watchdog_running) pthread_join(n->watchdog, NULL);
  if (atomic_load(&n->ready)) {
    cudaSetDevice(n->device);
    if (!atomic_load(&n->aborted_comm)) {
      /* Idle (the group layer destroys after its work is done): wait
       * for the stream at most the group's timeout, else abort. */
      int64_t give_up = ddp_time_ns() + n->timeout_ns;
      while (cudaStreamQuery(n->stream) == cudaErrorNotReady && ddp_time_ns() < give_up) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
      }
      if (cudaStreamQuery(n->stream) == cudaSuccess) n->api->CommDestroy(n->comm);
      else abort_comm(n);
    }
    pthread_mutex_lock(&n->mu);
    fail_pending_locked(n);
    pthread_mutex_unlock(&n->mu);
    cudaFree(n->barrier_buf);
    cudaEventDestroy(n->produced);
    cudaEventDestroy(n->produced_legacy);
    cudaStreamDestroy(n->stream);
    (void)cudaGetLastError();
  }
  for (int r = 0; n->host_names && r < n->size; r++) ddp_free(n->host_names[r]);
  ddp_free(n->host_names);
  ddp_free(n->host_of);
  ddp_free(n->peer_pid);
  pthread_mutex_destroy(&n->mu);
  ddp_free(n);
}

static ddp_status nccl_stream_wait(ddp__backend *b, ddp__completion *c) {
  nccl_backend *n = nb(b);
  pthread_mutex_lock(&n->mu);
  ddp_status st = DDP_OK;
  bool pending = false;
  for (int i = 0; i < n->count && !pending; i++) pending = n->pending[(n->head + i) % NCCL_IN_FLIGHT] == c;
  if (!atomic_load_explicit(&c->done, memory_order_acquire) && !pending) {
    st = DDP_ERR_STATE; /* not enqueued yet: its event does not exist */
  } else if (!atomic_load_explicit(&c->done, memory_order_acquire)) {
    op_state *s = (op_state *)c->state;
    cudaError_t e = cudaSetDevice(n->device);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(ddp__cuda_stream(), s->done, 0);
    if (e != cudaSuccess) st = cuda_fail(n, e, "cudaStreamWaitEvent (work wait on the stream)", NULL);
  } else if (c->status != DDP_OK) {
    st = ddp_error(c->status, "%s", c->msg);
  }
  pthread_mutex_unlock(&n->mu);
  return st;
}

static const ddp__backend_ops nccl_ops = {
    .name = "nccl",
    .caps = {.ops = DDP__CAPS_ALL_OPS | 1u << DDP__OP_P2P_BATCH, .dtypes = DDP__CAPS_ALL_DTYPES,
             .reduce_ops = DDP__CAPS_ALL_REDUCE_OPS, .devices = 1u << DDP_DEVICE_CUDA,
             .subgroups = true, .max_in_flight = NCCL_IN_FLIGHT, .device_start = true},
    .enqueue = nccl_enqueue,
    .test = nccl_test,
    .transport = nccl_transport,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
    .stream_wait = nccl_stream_wait,
};

ddp_status ddp__backend_nccl_create(const ddp__backend_config *cfg, ddp__backend **out) {
  *out = NULL;
  const ddp__nccl_api *api = NULL;
  DDP_TRY(ddp__nccl_api_get(&api));
  if (ddp_cuda_device_count() == 0)
    return ddp_error(DDP_ERR_UNSUPPORTED, "nccl: rank %d of %d has no CUDA device (%s); the nccl "
                     "backend needs a GPU per rank (use backend \"ddp\" for the CPU)", cfg->rank,
                     cfg->size, ddp_cuda_unavailable_reason());
  nccl_backend *n = ddp_calloc(1, sizeof *n);
  if (!n) return ddp_error(DDP_ERR_NOMEM, "nccl: backend");
  n->base.ops = &nccl_ops;
  n->api = api;
  n->store = cfg->store;
  n->rank = cfg->rank;
  n->size = cfg->size;
  n->timeout_ns = cfg->timeout_ns;
  n->device = -1;
  pthread_mutex_init(&n->mu, NULL);
  n->host_of = ddp_calloc((size_t)cfg->size, sizeof *n->host_of);
  n->host_names = ddp_calloc((size_t)cfg->size, sizeof *n->host_names);
  bool ok = n->host_of && n->host_names;
  for (int r = 0; ok && r < cfg->size; r++) {
    n->host_of[r] = cfg->host_of ? cfg->host_of[r] : 0;
    const char *h = cfg->host_names && cfg->host_names[r] ? cfg->host_names[r] : "?";
    n->host_names[r] = ddp_alloc(strlen(h) + 1);
    ok = n->host_names[r] != NULL;
    if (ok) memcpy(n->host_names[r], h, strlen(h) + 1);
  }
  if (!ok) {
    nccl_destroy(&n->base);
    return ddp_error(DDP_ERR_NOMEM, "nccl: backend tables for %d ranks", cfg->size);
  }
  if (pthread_create(&n->watchdog, NULL, watchdog_main, n) != 0) {
    nccl_destroy(&n->base);
    return ddp_error(DDP_ERR_IO, "nccl: cannot start the watchdog thread");
  }
  n->watchdog_running = true;
  *out = &n->base;
  return DDP_OK;
}
