/* The MPI backend (docs/comm.md, "MPI backend"): every operation is MPI's
 * nonblocking call on a communicator of the group's own (MPI_Iallreduce,
 * MPI_Isend, ...), completed by MPI_Test. Open MPI moves no byte of a
 * nonblocking collective outside MPI_Test / MPI_Wait, so whoever waits
 * polls: a caller blocked in the op spins on MPI_Test (as MPI_Wait would),
 * the progress thread polls between its submissions with the group layer's
 * back-off (20-200 us), which costs a one-core rank little CPU while
 * backward runs and delays each step of a long collective by at most that.
 *
 * Collectives and point-to-point use two duplicates of the group's
 * communicator, so that neither matches the other's messages, nor the
 * program's own MPI traffic. */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/mpi/mpi_internal.h"
#include "core/core_internal.h"

_Thread_local MPI_Comm ddp__mpi_base_comm = MPI_COMM_NULL;
atomic_bool ddp__mpi_failed;

typedef struct mpi_backend {
  ddp__backend base;
  MPI_Comm coll; /* collectives */
  MPI_Comm p2p;  /* point to point */
  int rank, size;
  atomic_bool aborted;
  atomic_bool p2p_woken; /* p2p_wake: the lane's wait returns early */
  /* Blocking calls of at most this many bytes per rank run as MPI's
   * blocking collective (DDP_MPI_BLOCKING_BYTES; see mpi_enqueue). */
  size_t blocking_bytes;
  /* Blocking collectives of at least this many bytes per rank first wait
   * for every rank at a nonblocking barrier, polled spin-then-sleep (see
   * await_arrival; DDP_MPI_ARRIVAL_BYTES, SIZE_MAX: never). */
  size_t arrival_bytes;
  /* MPI's datatype and reduce op of each ddp dtype and op, and each
   * dtype's size, looked up once at create: the blocking allreduce's path
   * indexes them instead of calling ddp__mpi_datatype / ddp__mpi_op (whose
   * user ops sit behind a pthread_once) and ddp_dtype_size. */
  MPI_Datatype types[DDP_DTYPE_COUNT];
  MPI_Op ops[DDP_DTYPE_COUNT][DDP_REDUCE_OP_COUNT];
  uint8_t elem[DDP_DTYPE_COUNT];
  /* The blocking call running now: its deadline (0: none), op and number,
   * which the watchdog reads. */
  _Atomic int64_t blocking_deadline;
  const char *_Atomic blocking_op;
  _Atomic uint64_t blocking_seq;
  atomic_bool stopping;
  bool watchdog_running;
  pthread_t watchdog;
  /* Blocking allreduces of at most this many bytes per rank run as ddp's
   * recursive doubling over MPI point-to-point (small_allreduce; 0: never,
   * see small_rule), receiving into small_tmp. */
  size_t small_bytes;
  _Alignas(64) unsigned char small_tmp[DDP__MPI_SMALL_MAX];
} mpi_backend;

/* A blocking MPI call cannot be interrupted: when one outlives its op's
 * deadline (a peer alive but never arriving; a dead peer ends the job
 * through mpirun), the watchdog names the op and ends the job with
 * MPI_Abort, as a hang is the one outcome ddp never gives. It looks every
 * 50 ms. */
static void *watchdog_main(void *arg) {
  mpi_backend *m = arg;
  while (!atomic_load(&m->stopping)) {
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
    int64_t deadline = atomic_load_explicit(&m->blocking_deadline, memory_order_acquire);
    if (deadline && ddp_time_ns() >= deadline) {
      const char *op = atomic_load_explicit(&m->blocking_op, memory_order_relaxed);
      ddp_log(DDP_LOG_ERROR, "%s #%" PRIu64 " (rank %d of %d) did not complete in time on the mpi backend; MPI cannot "
                "interrupt its blocking call, so this ends the job (MPI_Abort). DDP_MPI_BLOCKING_BYTES=0 runs "
                "every collective nonblocking, which fails the group instead", op ? op : "operation",
                atomic_load_explicit(&m->blocking_seq, memory_order_relaxed), m->rank, m->size);
      MPI_Abort(m->coll, 1);
    }
  }
  return NULL;
}

/* What an enqueued op keeps in its completion until MPI_Test says done. */
typedef struct pending {
  MPI_Request req;
  void *scale_buf; /* AVG: divide this by the group size when done */
  size_t scale_count;
  void *tmp;       /* a copy of send (in-place all_to_all); ddp_free'd when done */
  int32_t dtype;
  int32_t peer;    /* p2p: the peer, for messages; else -1 */
  int32_t kind;    /* ddp__op_kind, and */
  uint64_t seq;    /* the op's number, for messages */
} pending;
_Static_assert(sizeof(pending) <= sizeof(((ddp__completion *)0)->state), "pending fits a completion");

static pending *pending_of(ddp__completion *c) { return (pending *)(void *)c->state; }

static ddp_status mpi_failed(const mpi_backend *m, const ddp__op_ctx *ctx, int code, int peer) {
  char text[MPI_MAX_ERROR_STRING + 64];
  ddp__mpi_error_string(code, text, sizeof text);
  if (peer >= 0)
    return ddp_error(DDP_ERR_PEER, "%s #%" PRIu64 " (rank %d of %d, peer %d) on the mpi backend: %s",
                     ctx->op, ctx->seq, m->rank, m->size, peer, text);
  return ddp_error(DDP_ERR_PEER, "%s #%" PRIu64 " (rank %d of %d) on the mpi backend: %s", ctx->op,
                   ctx->seq, m->rank, m->size, text);
}

static void finish(mpi_backend *m, ddp__completion *c, int rc, const MPI_Status *status);

/* send aliases this rank's block of recv: MPI wants MPI_IN_PLACE then. */
static const void *in_place(const void *send, const void *recv, size_t block_bytes, int index) {
  return send == (const char *)recv + block_bytes * (size_t)index ? MPI_IN_PLACE : send;
}

/* The watchdog's view of a blocking call: op and number, then the deadline
 * published after them (release; the watchdog reads it with acquire), and
 * 0 when the call returns. Plain stores on x86, where seq_cst ones are
 * locked exchanges (4 of them cost about a tenth of an 8-byte allreduce). */
static inline void blocking_begin(mpi_backend *m, const ddp__op_ctx *ctx) {
  atomic_store_explicit(&m->blocking_op, ctx->op, memory_order_relaxed);
  atomic_store_explicit(&m->blocking_seq, ctx->seq, memory_order_relaxed);
  atomic_store_explicit(&m->blocking_deadline, ctx->deadline_ns, memory_order_release);
}

static inline void blocking_end(mpi_backend *m) {
  atomic_store_explicit(&m->blocking_deadline, 0, memory_order_release);
}

static void sleep_ns(int64_t ns);
static void mpi_abort(ddp__backend *b);

/* Polling the arrival barrier: MPI_Test back to back for ARRIVAL_SPIN_NS
 * (ranks that arrive together pass in a microsecond or two), then a sleep
 * between polls, 5 us doubling to 50 us. */
#define ARRIVAL_SPIN_NS 50000LL
#define ARRIVAL_PAUSE_MIN_NS 5000LL
#define ARRIVAL_PAUSE_MAX_NS 50000LL

/* Waits, sleeping, until every rank of the group has reached this blocking
 * collective (MPI_Ibarrier on the collectives' communicator, polled).
 * Inside MPI's blocking call a rank that arrives early spins (Open MPI's
 * wait loop, with sched_yield at best) for as long as its peers are late:
 * in training, the gradient allreduce waiting out the ranks' skew,
 * milliseconds a step. On a host where other programs want the CPU, the
 * kernel shares it between sessions (autogroups, cgroups), and a spinning
 * rank spends its job's share on nothing while its peer, still computing,
 * gets less; ddp's own backend sleeps in a futex there. Measured: the
 * ConvNet at world 2 against a steady competing load, three goes: 0.92,
 * 0.955, 0.927 of ddp's backend without this wait, 0.97, 0.95, 0.952 with
 * it; on an idle host MPI and ddp were equal (docs/comm.md, "Training").
 * A sleep between polls is not a futex: the rest of the gap stays.
 * Interruptible, unlike the
 * blocking call: past ctx's deadline or on abort it fails the op. Every
 * rank takes it or not alike (the same size and form of call), so the
 * barriers match. */
static ddp_status await_arrival(mpi_backend *m, const ddp__op_ctx *ctx) {
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Ibarrier(m->coll, &req);
  if (rc != MPI_SUCCESS) return mpi_failed(m, ctx, rc, -1);
  int64_t spin_end = ddp_time_ns() + ARRIVAL_SPIN_NS;
  int64_t pause = ARRIVAL_PAUSE_MIN_NS;
  bool sleeping = false; /* past the spin: one poll per sleep */
  for (uint32_t i = 1;; i++) {
    int flag = 0;
    rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_failed(m, ctx, rc, -1);
    if (flag) return DDP_OK;
    if (!sleeping && (i & 15) != 0) continue; /* the clock every 16 polls while spinning */
    int64_t now = ddp_time_ns();
    bool late = now >= ctx->deadline_ns;
    if (late || (ctx->aborted && atomic_load_explicit(ctx->aborted, memory_order_relaxed)) ||
        atomic_load_explicit(&m->aborted, memory_order_relaxed)) {
      /* The barrier's request stays with MPI (it cannot be cancelled): the
       * backend counts as aborted, so that exit ends the job instead of
       * MPI_Finalize waiting for the late peer (ddp__mpi_failed). */
      mpi_abort(&m->base);
      if (late)
        return ddp_error(DDP_ERR_TIMEOUT, "%s #%" PRIu64 " (rank %d of %d) did not complete in time on the mpi "
                         "backend: waiting for every rank to reach it (MPI does not say which rank is late; the "
                         "flight recorder's dump does)", ctx->op, ctx->seq, m->rank, m->size);
      return ddp_error(DDP_ERR_ABORTED, "%s #%" PRIu64 " (rank %d of %d): the group was aborted", ctx->op,
                       ctx->seq, m->rank, m->size);
    }
    if (sleeping || now >= spin_end) {
      sleeping = true;
      sleep_ns(pause);
      pause = pause * 2 > ARRIVAL_PAUSE_MAX_NS ? ARRIVAL_PAUSE_MAX_NS : pause * 2;
    }
  }
}

/* ddp's own allreduce for the smallest blocking calls (docs/comm.md, MPI,
 * "Small allreduces over point-to-point"): recursive doubling over MPI
 * point-to-point on the collectives' communicator (which carries no other
 * point-to-point traffic; tag DDP__MPI_SMALL_TAG), each step a receive
 * posted, a send, a wait and a local reduction (commutative, and the
 * lower rank's operand first anyway), so every rank computes the same
 * bits; a peer with another count fails the call by name. Open MPI's
 * MPI_Allreduce of 8 bytes at world 2 on one host takes about 235 ns,
 * this about 210 (its recursive doubling allocates and frees a buffer a
 * call, and its collective framework dispatches; ours does neither); from
 * about 1 KiB MPI's is faster. Chosen by small_rule for a power-of-two
 * group on one host only: between hosts a site's MPI may reduce in the
 * network. Same on every rank for the same call (bytes, group), as
 * matching requires; only blocking calls (bytes <= m->small_bytes), never
 * beside an MPI collective on the same communicator (the group runs one
 * op at a time, and nonblocking calls stay MPI_Iallreduce). */
static ddp_status small_steps(mpi_backend *m, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op) {
  int bytes = (int)(count * m->elem[dtype]);
  for (int mask = 1; mask < m->size; mask <<= 1) {
    int peer = m->rank ^ mask;
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Status status;
    int got = -1;
    int rc = MPI_Irecv(m->small_tmp, DDP__MPI_SMALL_MAX, MPI_BYTE, peer, DDP__MPI_SMALL_TAG, m->coll, &req);
    if (rc == MPI_SUCCESS) rc = MPI_Send(buf, bytes, MPI_BYTE, peer, DDP__MPI_SMALL_TAG, m->coll);
    if (rc == MPI_SUCCESS) rc = MPI_Wait(&req, &status);
    if (rc != MPI_SUCCESS) {
      if (req != MPI_REQUEST_NULL) { /* a receive left posted into small_tmp: withdraw it */
        MPI_Cancel(&req);
        MPI_Request_free(&req);
      }
      return mpi_failed(m, ctx, rc, peer);
    }
    /* A peer that reduces another count is the program's error (MPI calls
     * it erroneous); say so rather than reduce stale bytes. */
    if (MPI_Get_count(&status, MPI_BYTE, &got) != MPI_SUCCESS || got != bytes)
      return ddp_error(DDP_ERR_INVALID, "%s #%" PRIu64 " (rank %d of %d): rank %d reduces %d bytes, this rank %d: "
                       "every rank must pass the same count and dtype", ctx->op, ctx->seq, m->rank, m->size, peer,
                       got, bytes);
    if (peer < m->rank)
      ddp__reduce_pair(buf, m->small_tmp, buf, count, dtype, op);
    else
      ddp__reduce_into(buf, m->small_tmp, count, dtype, op);
  }
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, m->size);
  return DDP_OK;
}

/* Whether a blocking allreduce of `bytes` per rank takes small_allreduce. */
static inline bool takes_small(const mpi_backend *m, size_t bytes) {
  return m->small_bytes && bytes <= m->small_bytes;
}

/* small_steps as a blocking call: the watchdog's view around it. */
static ddp_status small_allreduce(mpi_backend *m, const ddp__op_ctx *ctx, void *buf, size_t count,
                                  ddp_dtype dtype, ddp_reduce_op op) {
  blocking_begin(m, ctx);
  ddp_status st = small_steps(m, ctx, buf, count, dtype, op);
  blocking_end(m);
  return st;
}

/* The hot case on its own path: a blocking allreduce of the program's (the
 * DDP wrapper's last bucket, a loss, a metric). It is done on return, so
 * no pending state is written; a small one costs MPI_Allreduce plus this
 * and the group layer's bookkeeping (docs/comm.md, "Speed"). */
static inline ddp_status blocking_allreduce(mpi_backend *m, const ddp__op_ctx *ctx, const ddp__op_args *a,
                                            size_t bytes, ddp__completion *c) {
  MPI_Datatype t = m->types[a->dtype];
  MPI_Op op = m->ops[a->dtype][a->reduce_op];
  if (bytes >= m->arrival_bytes) DDP_TRY(await_arrival(m, ctx)); /* DDP_MPI_ARRIVAL_BYTES=0: small ones too */
  if (takes_small(m, bytes)) {
    DDP_TRY(small_allreduce(m, ctx, a->buf, a->count, a->dtype, a->reduce_op));
    ddp__completion_finish(c, DDP_OK);
    return DDP_OK;
  }
  blocking_begin(m, ctx);
  int rc = MPI_Allreduce(MPI_IN_PLACE, a->buf, (int)a->count, t, op, m->coll);
  blocking_end(m);
  if (rc != MPI_SUCCESS) return mpi_failed(m, ctx, rc, -1);
  if (a->reduce_op == DDP_REDUCE_AVG) ddp__reduce_scale(a->buf, a->count, a->dtype, m->size);
  ddp__completion_finish(c, DDP_OK);
  return DDP_OK;
}

/* The group layer's direct path (backend.h, allreduce_direct): the same
 * MPI_Allreduce as blocking_allreduce, for sizes below the arrival
 * barrier's (mpi_direct_bytes), without a completion. */
static ddp_status mpi_allreduce_direct(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                       ddp_dtype dtype, ddp_reduce_op op) {
  mpi_backend *m = (mpi_backend *)b;
  if (atomic_load_explicit(&m->aborted, memory_order_relaxed))
    return ddp_error(DDP_ERR_ABORTED, "%s #%" PRIu64 ": the mpi backend of this group (rank %d of %d) was aborted",
                     ctx->op, ctx->seq, m->rank, m->size);
  if (takes_small(m, count * m->elem[dtype])) return small_allreduce(m, ctx, buf, count, dtype, op);
  blocking_begin(m, ctx);
  int rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, m->types[dtype], m->ops[dtype][op], m->coll);
  blocking_end(m);
  if (rc != MPI_SUCCESS) return mpi_failed(m, ctx, rc, -1);
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, m->size);
  return DDP_OK;
}

/* What the direct path takes: what runs as MPI's blocking call
 * (DDP_MPI_BLOCKING_BYTES), below the arrival barrier's size
 * (DDP_MPI_ARRIVAL_BYTES: that wait stays on the general path), in counts
 * an int holds. */
static size_t mpi_direct_bytes(const ddp__backend *b) {
  const mpi_backend *m = (const mpi_backend *)b;
  size_t n = m->blocking_bytes;
  if (m->arrival_bytes == 0) return 0;
  if (n > m->arrival_bytes - 1) n = m->arrival_bytes - 1;
  if (n > (size_t)INT_MAX) n = (size_t)INT_MAX;
  return n;
}

static ddp_status mpi_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *a,
                              ddp__completion *c) {
  mpi_backend *m = (mpi_backend *)b;
  bool aborted = atomic_load_explicit(&m->aborted, memory_order_relaxed);
  size_t bytes = a->count * m->elem[a->dtype]; /* dtype checked by the group layer */
  if (!aborted && a->kind == DDP__OP_ALLREDUCE && a->blocking_call && a->count <= (size_t)INT_MAX &&
      bytes <= m->blocking_bytes)
    return blocking_allreduce(m, ctx, a, bytes, c);
  if (aborted)
    return ddp_error(DDP_ERR_ABORTED, "%s #%" PRIu64 ": the mpi backend of this group (rank %d of %d) was aborted",
                     ctx->op, ctx->seq, m->rank, m->size);
  size_t es = ddp_dtype_size(a->dtype);
  /* MPI counts are ints; a block count of the blocked ops times the group
   * size stays within what MPI addresses as long as one block does. */
  if (a->count > (size_t)INT_MAX || (a->kind == DDP__OP_SEND || a->kind == DDP__OP_RECV ? a->count * es > (size_t)INT_MAX : false))
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s #%" PRIu64 " (rank %d of %d): %zu elements exceed what one MPI call "
                     "takes (INT_MAX); split the buffer", ctx->op, ctx->seq, m->rank, m->size, a->count);
  pending *p = pending_of(c);
  *p = (pending){.req = MPI_REQUEST_NULL, .dtype = (int32_t)a->dtype, .peer = -1, .kind = (int32_t)a->kind,
                .seq = ctx->seq};
  int n = (int)a->count;
  MPI_Datatype t = ddp__mpi_datatype(a->dtype);
  MPI_Op op = ddp__op_reduces(a->kind) ? ddp__mpi_op(a->dtype, a->reduce_op) : MPI_OP_NULL;
  bool avg = ddp__op_reduces(a->kind) && a->reduce_op == DDP_REDUCE_AVG;
  size_t block = a->count * es;
  /* A blocking call of the program's, up to DDP_MPI_BLOCKING_BYTES per
   * rank, runs as MPI's blocking collective (a nonblocking one costs its
   * schedule and the polling; the thread that runs it has nothing else to
   * do, as the program waits for it). Async ones stay nonblocking, so the
   * progress thread polls them with back-off instead of spinning on a core
   * backward computes on. Chosen from what every rank of the program does
   * alike (blocking_call, the size), never from where the op runs: MPI
   * matches a blocking collective only with a blocking one. */
  bool blocking = ddp__op_is_collective(a->kind) && a->blocking_call && block <= m->blocking_bytes;
  if (blocking && block >= m->arrival_bytes) DDP_TRY(await_arrival(m, ctx));
  if (blocking) blocking_begin(m, ctx);
  int rc = MPI_SUCCESS;
  switch (a->kind) {
  case DDP__OP_ALLREDUCE:
    rc = blocking ? MPI_Allreduce(MPI_IN_PLACE, a->buf, n, t, op, m->coll) : MPI_Iallreduce(MPI_IN_PLACE, a->buf, n, t, op, m->coll, &p->req);
    if (avg) p->scale_buf = a->buf, p->scale_count = a->count;
    break;
  case DDP__OP_BROADCAST:
    rc = blocking ? MPI_Bcast(a->buf, n, t, a->root, m->coll) : MPI_Ibcast(a->buf, n, t, a->root, m->coll, &p->req);
    break;
  case DDP__OP_REDUCE:
    if (m->rank == a->root) {
      rc = blocking ? MPI_Reduce(MPI_IN_PLACE, a->buf, n, t, op, a->root, m->coll) : MPI_Ireduce(MPI_IN_PLACE, a->buf, n, t, op, a->root, m->coll, &p->req);
      if (avg) p->scale_buf = a->buf, p->scale_count = a->count;
    } else {
      rc = blocking ? MPI_Reduce(a->buf, NULL, n, t, op, a->root, m->coll) : MPI_Ireduce(a->buf, NULL, n, t, op, a->root, m->coll, &p->req);
    }
    break;
  case DDP__OP_ALLGATHER:
    rc = blocking ? MPI_Allgather(in_place(a->send, a->buf, block, m->rank), n, t, a->buf, n, t, m->coll) : MPI_Iallgather(in_place(a->send, a->buf, block, m->rank), n, t, a->buf, n, t, m->coll, &p->req);
    break;
  case DDP__OP_GATHER:
    if (m->rank == a->root)
      rc = blocking ? MPI_Gather(in_place(a->send, a->buf, block, m->rank), n, t, a->buf, n, t, a->root, m->coll) : MPI_Igather(in_place(a->send, a->buf, block, m->rank), n, t, a->buf, n, t, a->root, m->coll, &p->req);
    else
      rc = blocking ? MPI_Gather(a->send, n, t, NULL, n, t, a->root, m->coll) : MPI_Igather(a->send, n, t, NULL, n, t, a->root, m->coll, &p->req);
    break;
  case DDP__OP_SCATTER:
    if (m->rank == a->root && a->buf == (const char *)a->send + block * (size_t)m->rank)
      rc = blocking ? MPI_Scatter(a->send, n, t, MPI_IN_PLACE, n, t, a->root, m->coll) : MPI_Iscatter(a->send, n, t, MPI_IN_PLACE, n, t, a->root, m->coll, &p->req);
    else
      rc = blocking ? MPI_Scatter(a->send, n, t, a->buf, n, t, a->root, m->coll) : MPI_Iscatter(a->send, n, t, a->buf, n, t, a->root, m->coll, &p->req);
    break;
  case DDP__OP_REDUCE_SCATTER:
    rc = blocking ? MPI_Reduce_scatter_block(a->send, a->buf, n, t, op, m->coll) : MPI_Ireduce_scatter_block(a->send, a->buf, n, t, op, m->coll, &p->req);
    if (avg) p->scale_buf = a->buf, p->scale_count = a->count;
    break;
  case DDP__OP_ALL_TO_ALL: {
    /* Open MPI's nonblocking all-to-all takes no MPI_IN_PLACE: a copy. */
    const void *send = a->send;
    if (send == a->buf && block) {
      p->tmp = ddp_alloc(block * (size_t)m->size);
      if (!p->tmp) {
        if (blocking) blocking_end(m); /* nothing for the watchdog to wait for */
        return ddp_error(DDP_ERR_NOMEM, "%s #%" PRIu64 " (rank %d of %d): out of memory for an in-place copy",
                         ctx->op, ctx->seq, m->rank, m->size);
      }
      memcpy(p->tmp, send, block * (size_t)m->size);
      send = p->tmp;
    }
    rc = blocking ? MPI_Alltoall(send, n, t, a->buf, n, t, m->coll) : MPI_Ialltoall(send, n, t, a->buf, n, t, m->coll, &p->req);
    break;
  }
  case DDP__OP_BARRIER:
    rc = blocking ? MPI_Barrier(m->coll) : MPI_Ibarrier(m->coll, &p->req);
    break;
  case DDP__OP_SEND:
    p->peer = a->root;
    rc = MPI_Isend(a->send, n * (int)es, MPI_BYTE, a->root, a->tag, m->p2p, &p->req);
    break;
  case DDP__OP_RECV:
    p->peer = a->root;
    rc = MPI_Irecv(a->buf, n * (int)es, MPI_BYTE, a->root, a->tag, m->p2p, &p->req);
    break;
  default:
    if (blocking) blocking_end(m);
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: not an operation of the mpi backend", ctx->op);
  }
  if (blocking) blocking_end(m);
  if (rc != MPI_SUCCESS) {
    ddp_free(p->tmp);
    p->tmp = NULL;
    return mpi_failed(m, ctx, rc, p->peer);
  }
  if (blocking) {
    MPI_Status none = {0};
    finish(m, c, rc, &none);
  }
  return DDP_OK;
}

/* Completes c from its request's end (MPI_Test said done, with rc). */
static void finish(mpi_backend *m, ddp__completion *c, int rc, const MPI_Status *status) {
  pending *p = pending_of(c);
  ddp_free(p->tmp);
  p->tmp = NULL;
  if (rc == MPI_ERR_IN_STATUS) rc = status->MPI_ERROR;
  if (rc != MPI_SUCCESS) {
    ddp__op_ctx ctx = {.op = ddp__op_kind_name((ddp__op_kind)p->kind), .seq = p->seq};
    ddp__completion_finish(c, mpi_failed(m, &ctx, rc, p->peer));
    return;
  }
  if (p->scale_buf) ddp__reduce_scale(p->scale_buf, p->scale_count, (ddp_dtype)p->dtype, m->size);
  ddp__completion_finish(c, DDP_OK);
}

static bool mpi_test(ddp__backend *b, ddp__completion *c) {
  if (atomic_load_explicit(&c->done, memory_order_acquire)) return true;
  mpi_backend *m = (mpi_backend *)b;
  pending *p = pending_of(c);
  if (atomic_load(&m->aborted)) {
    /* MPI cannot cancel a collective (MPI_Cancel and MPI_Request_free are
     * erroneous on one): the request is left to MPI, and its buffers may
     * still be written until the job ends (docs/comm.md). */
    p->tmp = NULL; /* MPI may still read it: leaked on purpose */
    ddp__completion_finish(c, ddp_error(DDP_ERR_ABORTED, "the mpi backend of this group (rank %d of %d) was aborted",
                                        m->rank, m->size));
    return true;
  }
  int flag = 0;
  MPI_Status status;
  int rc = MPI_Test(&p->req, &flag, &status);
  if (!flag && rc == MPI_SUCCESS) return false;
  finish(m, c, rc, &status);
  return true;
}

static void sleep_ns(int64_t ns) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ns};
  nanosleep(&ts, NULL);
}

/* A caller blocked in the op spins on MPI_Test as MPI_Wait does (Open MPI
 * progresses only inside MPI's calls, and a sleep between polls would stall
 * every step of the collective); it looks at the clock every 256 polls. The
 * progress thread (caller not blocked) spins briefly, then sleeps 2 to 100
 * us between polls, leaving the core to the caller's computation. */
static ddp_status mpi_wait(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  mpi_backend *m = (mpi_backend *)b;
  int64_t pause = 2000;
  for (uint64_t i = 1;; i++) {
    if (mpi_test(b, c)) return DDP_OK;
    if (ctx->aborted && atomic_load_explicit(ctx->aborted, memory_order_relaxed))
      return ddp_error(DDP_ERR_ABORTED, "%s #%" PRIu64 " (rank %d of %d): the group was aborted", ctx->op,
                       ctx->seq, m->rank, m->size);
    if (ctx->caller_blocked ? (i & 255) == 0 : i > 64) {
      if (ddp_time_ns() >= ctx->deadline_ns) {
        pending *p = pending_of(c);
        if (p->peer >= 0)
          return ddp_error(DDP_ERR_TIMEOUT, "%s #%" PRIu64 " (rank %d of %d) with peer %d did not complete in time "
                           "on the mpi backend (MPI does not say which rank is late)",
                           ctx->op, ctx->seq, m->rank, m->size, p->peer);
        return ddp_error(DDP_ERR_TIMEOUT, "%s #%" PRIu64 " (rank %d of %d) did not complete in time on the mpi "
                         "backend (MPI does not say which rank is late; the flight recorder's dump does)",
                         ctx->op, ctx->seq, m->rank, m->size);
      }
      if (!ctx->caller_blocked) {
        sleep_ns(pause);
        pause = pause * 2 > 100000 ? 100000 : pause * 2;
      }
    }
  }
}

/* ---- The point-to-point lane -------------------------------------------------------
 * Each request is posted (MPI_Isend / MPI_Irecv on the p2p communicator) the
 * first time the lane sees it, in posting order, then tested: MPI's
 * non-overtaking rule keeps the order per (peer, tag). */
typedef struct p2p_state {
  bool posted;
  MPI_Request req;
} p2p_state;
_Static_assert(sizeof(p2p_state) <= sizeof(((ddp__p2p_req *)0)->state), "p2p state fits a request");

static ddp_status mpi_p2p_progress(ddp__backend *b, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs, int n,
                                   int64_t wait_ns, int *culprit) {
  mpi_backend *m = (mpi_backend *)b;
  *culprit = -1;
  int64_t end = ddp_time_ns() + wait_ns;
  int64_t pause = 1000;
  int polls = 0;
  for (;;) {
    bool progressed = false;
    for (int i = 0; i < n; i++) {
      ddp__p2p_req *r = reqs[i];
      p2p_state *s = (p2p_state *)(void *)r->state;
      if (r->finished) continue;
      int rc = MPI_SUCCESS;
      if (!s->posted) {
        if (r->bytes > (size_t)INT_MAX) {
          *culprit = i;
          return ddp_error(DDP_ERR_UNSUPPORTED, "%s (rank %d of %d, peer %d): %zu bytes exceed what one MPI "
                           "message takes (INT_MAX)", ctx->op, m->rank, m->size, r->peer, r->bytes);
        }
        rc = r->is_send ? MPI_Isend(r->buf, (int)r->bytes, MPI_BYTE, r->peer, r->tag, m->p2p, &s->req)
                        : MPI_Irecv(r->buf, (int)r->bytes, MPI_BYTE, r->peer, r->tag, m->p2p, &s->req);
        s->posted = rc == MPI_SUCCESS;
        progressed = true;
      }
      int flag = 0;
      if (rc == MPI_SUCCESS) rc = MPI_Test(&s->req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        *culprit = i;
        return mpi_failed(m, ctx, rc, r->peer);
      }
      if (flag) {
        r->finished = true;
        progressed = true;
      }
    }
    if (progressed || atomic_exchange(&m->p2p_woken, false) || atomic_load(&m->aborted)) return DDP_OK;
    if (ddp_time_ns() >= end) return DDP_OK;
    /* MPI moves bytes only inside MPI_Test: 128 polls back to back (a
     * large message's rendezvous takes several), then short sleeps, which
     * keep it moving without holding the core. */
    if (++polls > 128) {
      sleep_ns(pause);
      pause = pause * 2 > 50000 ? 50000 : pause * 2;
    }
  }
}

static void mpi_p2p_wake(ddp__backend *b) { atomic_store(&((mpi_backend *)b)->p2p_woken, true); }

static const char *mpi_transport(const ddp__backend *b, int peer) { return "mpi"; }

static void mpi_abort(ddp__backend *b) {
  mpi_backend *m = (mpi_backend *)b;
  atomic_store(&m->aborted, true);
  atomic_store(&ddp__mpi_failed, true);
}

static void mpi_destroy(ddp__backend *b) {
  mpi_backend *m = (mpi_backend *)b;
  atomic_store(&m->stopping, true);
  if (m->watchdog_running) pthread_join(m->watchdog, NULL);
  int finalized = 0;
  MPI_Finalized(&finalized);
  /* MPI_Comm_free after MPI_Finalize is erroneous; after an abort the
   * communicators may hold requests MPI will not give back. */
  if (!finalized && !atomic_load(&m->aborted)) {
    if (m->coll != MPI_COMM_NULL) MPI_Comm_free(&m->coll);
    if (m->p2p != MPI_COMM_NULL) MPI_Comm_free(&m->p2p);
  }
  ddp_free(m);
}

static const ddp__backend_ops mpi_ops = {
    .name = "mpi",
    /* Every operation, dtype and reduce op on host memory; subgroups; a few
     * operations in flight so that the DDP wrapper's buckets overlap. */
    .caps = {.ops = DDP__CAPS_ALL_OPS, .dtypes = DDP__CAPS_ALL_DTYPES,
             .reduce_ops = DDP__CAPS_ALL_REDUCE_OPS, .devices = DDP__CAPS_CPU, .subgroups = true,
             .max_in_flight = 4},
    .enqueue = mpi_enqueue,
    .test = mpi_test,
    .wait = mpi_wait,
    .p2p_progress = mpi_p2p_progress,
    .p2p_wake = mpi_p2p_wake,
    .transport = mpi_transport,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
    .allreduce_direct = mpi_allreduce_direct,
    .allreduce_direct_bytes = mpi_direct_bytes,
};

MPI_Comm ddp__mpi_backend_comm(const ddp__backend *b) {
  return b && b->ops == &mpi_ops ? ((const mpi_backend *)b)->coll : MPI_COMM_NULL;
}

size_t ddp__mpi_small_bytes(const ddp__backend *b) {
  return b && b->ops == &mpi_ops ? ((const mpi_backend *)b)->small_bytes : 0;
}

/* The group's communicator: a duplicate of the program's (from_mpi_comm),
 * or the group's ranks of MPI_COMM_WORLD, whose world ranks every rank
 * publishes in the group's store (a subgroup or a group made through
 * ddp_process_group_create under mpirun). */
static ddp_status group_comm(const ddp__backend_config *cfg, const char *who, MPI_Comm *out) {
  int rc;
  if (ddp__mpi_base_comm != MPI_COMM_NULL) {
    int size = 0;
    MPI_Comm_size(ddp__mpi_base_comm, &size);
    if (size != cfg->size)
      return ddp_error(DDP_ERR_INVALID, "%s: the MPI communicator has %d ranks, the group %d", who, size, cfg->size);
    rc = MPI_Comm_dup(ddp__mpi_base_comm, out);
  } else {
    int wrank = 0, wsize = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    if (cfg->size > wsize)
      return ddp_error(DDP_ERR_INVALID, "%s: the group has %d ranks but MPI's world only %d processes: start "
                       "the job with mpirun -np %d (or srun --mpi=pmix -n %d), one process per rank",
                       who, cfg->size, wsize, cfg->size, cfg->size);
    for (int r = 0; r < cfg->size; r++)
      for (int q = 0; q < r; q++)
        if (cfg->process_of[q] == cfg->process_of[r])
          return ddp_error(DDP_ERR_INVALID, "%s: ranks %d and %d are threads of one process; the mpi backend "
                           "needs one process per rank", who, q, r);
    char key[32], value[32];
    snprintf(key, sizeof key, "mpi/wrank/%d", cfg->rank);
    int vn = snprintf(value, sizeof value, "%d", wrank);
    DDP_TRY(ddp_store_set(cfg->store, key, value, (size_t)vn));
    int *wranks = ddp_calloc((size_t)cfg->size, sizeof *wranks);
    if (!wranks) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
    int64_t ms = cfg->timeout_ns / 1000000 > 0 ? cfg->timeout_ns / 1000000 : 1;
    ddp_status st = DDP_OK;
    for (int r = 0; r < cfg->size && st == DDP_OK; r++) {
      snprintf(key, sizeof key, "mpi/wrank/%d", r);
      void *v = NULL;
      size_t vb = 0;
      st = ddp_store_get(cfg->store, key, ms, &v, &vb);
      if (st == DDP_OK) {
        char text[32];
        snprintf(text, sizeof text, "%.*s", (int)(vb < sizeof text ? vb : sizeof text - 1), (char *)v);
        if (sscanf(text, "%d", &wranks[r]) != 1 || wranks[r] < 0 || wranks[r] >= wsize)
          st = ddp_error(DDP_ERR_FORMAT, "%s: rank %d's MPI rank \"%s\" is malformed", who, r, text);
        ddp_free(v);
      } else {
        st = ddp_error_wrap(st, "%s: reading rank %d's MPI rank", who, r);
      }
    }
    if (st != DDP_OK) {
      ddp_free(wranks);
      return st;
    }
    MPI_Group world, members;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_incl(world, cfg->size, wranks, &members);
    /* Collective over the members only, so disjoint subgroups form at once. */
    rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, 0x0dd9, out);
    MPI_Group_free(&members);
    MPI_Group_free(&world);
    ddp_free(wranks);
  }
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING + 64];
    ddp__mpi_error_string(rc, text, sizeof text);
    return ddp_error(DDP_ERR_PEER, "%s: making the group's MPI communicator: %s", who, text);
  }
  int r = -1;
  MPI_Comm_rank(*out, &r);
  if (r != cfg->rank) {
    MPI_Comm_free(out);
    return ddp_error(DDP_ERR_INVALID, "%s: this process is rank %d of the MPI communicator but rank %d of the "
                     "group; give the group MPI's ranks", who, r, cfg->rank);
  }
  return DDP_OK;
}

/* Where small_allreduce may run: a group of a power of two ranks, all on
 * one host (cfg->host_of; between hosts MPI's own collective may use the
 * network's reduction), and then for calls of at most `bytes` per rank.
 * The same on every rank: the layout is the group's. */
static size_t small_rule(const ddp__backend_config *cfg, size_t bytes) {
  if (cfg->size < 1 || (cfg->size & (cfg->size - 1)) != 0) return 0;
  for (int r = 1; r < cfg->size; r++)
    if (!cfg->host_of || cfg->host_of[r] != cfg->host_of[0]) return 0;
  return bytes;
}

ddp_status ddp__backend_mpi_create(const ddp__backend_config *cfg, ddp__backend **out) {
  *out = NULL;
  char who[96];
  snprintf(who, sizeof who, "mpi backend (rank %d of %d)", cfg->rank, cfg->size);
  DDP_TRY(ddp__mpi_ensure_init(who));
  mpi_backend *m = ddp_calloc(1, sizeof *m);
  if (!m) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
  m->base.ops = &mpi_ops;
  m->rank = cfg->rank;
  m->size = cfg->size;
  m->coll = m->p2p = MPI_COMM_NULL;
  atomic_init(&m->aborted, false);
  atomic_init(&m->p2p_woken, false);
  atomic_init(&m->blocking_deadline, 0);
  atomic_init(&m->blocking_op, NULL);
  atomic_init(&m->blocking_seq, 0);
  atomic_init(&m->stopping, false);
  /* Default -1: every blocking call of the program as MPI's blocking
   * collective, like with like against MPI_Allreduce at every size
   * (Open MPI's blocking algorithms are its tuned ones; its nonblocking
   * ones, libnbc's, are other algorithms). */
  int64_t bb = -1;
  ddp_status est = ddp_env_int("DDP_MPI_BLOCKING_BYTES", -1, &bb);
  if (est != DDP_OK || bb < -1) {
    ddp_free(m);
    return ddp_error(DDP_ERR_INVALID, "%s: DDP_MPI_BLOCKING_BYTES \"%s\" is not a byte count (0: every collective "
                     "nonblocking; -1, the default: every blocking call blocking)", who, ddp_env_str("DDP_MPI_BLOCKING_BYTES", ""));
  }
  m->blocking_bytes = bb < 0 ? SIZE_MAX : (size_t)bb;
  /* Default -1, none (opt-in: quietly it gained nothing for training and
   * cost the 64 KiB allreduce 0.87x against 1.01x; docs/comm.md, "The
   * arrival barrier"). */
  int64_t ab = -1;
  est = ddp_env_int("DDP_MPI_ARRIVAL_BYTES", -1, &ab);
  if (est != DDP_OK || ab < -1) {
    ddp_free(m);
    return ddp_error(DDP_ERR_INVALID, "%s: DDP_MPI_ARRIVAL_BYTES \"%s\" is not a byte count (blocking collectives of "
                     "at least that many bytes per rank wait for every rank, sleeping, before MPI's call; 0: "
                     "every one; -1: none, the default)", who, ddp_env_str("DDP_MPI_ARRIVAL_BYTES", ""));
  }
  m->arrival_bytes = ab < 0 ? SIZE_MAX : (size_t)ab;
  /* Default 256 (measured, world 2, one host: ddp's recursive doubling
   * 205-280 ns against MPI_Allreduce's 230-300 from 8 to 256 bytes, 487
   * against 437 at 1 KiB); 0 turns it off. */
  int64_t sb = 256;
  est = ddp_env_int("DDP_MPI_SMALL_BYTES", 256, &sb);
  if (est != DDP_OK || sb < 0 || sb > DDP__MPI_SMALL_MAX) {
    ddp_free(m);
    return ddp_error(DDP_ERR_INVALID, "%s: DDP_MPI_SMALL_BYTES \"%s\" is not a byte count from 0 to %d (blocking "
                     "allreduces of at most that many bytes per rank run as ddp's recursive doubling over MPI "
                     "point-to-point on a group of 2^k ranks on one host; 0: never)", who,
                     ddp_env_str("DDP_MPI_SMALL_BYTES", ""), DDP__MPI_SMALL_MAX);
  }
  m->small_bytes = small_rule(cfg, (size_t)sb);
  for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
    m->types[d] = ddp__mpi_datatype((ddp_dtype)d);
    m->elem[d] = (uint8_t)ddp_dtype_size((ddp_dtype)d);
    for (int o = 0; o < DDP_REDUCE_OP_COUNT; o++) m->ops[d][o] = ddp__mpi_op((ddp_dtype)d, (ddp_reduce_op)o);
  }
  m->coll = m->p2p = MPI_COMM_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  ddp_status st = group_comm(cfg, who, &comm);
  if (st == DDP_OK) {
    m->coll = comm;
    /* Errors come back to ddp (named, sticky) instead of killing the job. */
    MPI_Comm_set_errhandler(m->coll, MPI_ERRORS_RETURN);
    if (MPI_Comm_dup(m->coll, &m->p2p) != MPI_SUCCESS)
      st = ddp_error(DDP_ERR_PEER, "%s: duplicating the group's MPI communicator", who);
  }
  if (st == DDP_OK && m->blocking_bytes > 0) {
    if (pthread_create(&m->watchdog, NULL, watchdog_main, m) != 0)
      st = ddp_error(DDP_ERR_SYS, "%s: starting the watchdog of blocking calls", who);
    else
      m->watchdog_running = true;
  }
  if (st != DDP_OK) {
    mpi_destroy(&m->base);
    return st;
  }
  *out = &m->base;
  return DDP_OK;
}
