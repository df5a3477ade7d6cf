/* The MPI backend across hosts (docs/comm.md, "MPI backend", "Hierarchy"):
 * a group started under MPI whose ranks span several hosts, some of them
 * sharing one, composes ddp's shared memory inside each host with MPI
 * between the hosts' leaders, as hier/hier.c composes it with ddp's TCP:
 *
 *   local    per host with more than one rank, ddp's local backend (shm)
 *            over that host's ranks, store namespace mpihier/local/<host>/
 *   leaders  on each host's leader (its lowest rank), an mpi backend over
 *            the leaders (leaders' rank = host index), mpihier/leaders/
 *   all      an mpi backend over the whole group, mpihier/all/: the flat
 *            path (below), all_to_all, and point-to-point between hosts
 *
 * Which ops compose (the rule, docs/comm.md): a collective whose vector is
 * at least DDP_MPI_HIER_BYTES per rank (default 4 MiB) runs in stages,
 *   allreduce       local reduce to the leader -> leaders' MPI allreduce ->
 *                   local broadcast
 *   broadcast       local broadcast on the root's host -> leaders' MPI
 *                   broadcast -> local broadcast on the other hosts
 *   reduce          local reduce to the leader -> leaders' MPI reduce to the
 *                   root's leader (-> local broadcast on the root's host
 *                   where the root is not its leader)
 *   allgather       local gather -> leaders' MPI allgather of host blocks ->
 *                   local broadcast of the whole
 *   gather/scatter  local gather / scatter around the leaders' MPI gather /
 *                   scatter of host blocks (plus one local broadcast on the
 *                   root's host where the root is not its leader)
 *   reduce_scatter  local reduce of the whole -> leaders' MPI allreduce ->
 *                   local scatter of the host's blocks
 *   barrier         local barrier -> leaders' MPI barrier -> local barrier
 * and a smaller one runs flat on `all` (MPI's own algorithms, whose latency
 * a three-stage composition cannot beat). all_to_all always runs flat: it
 * reduces nothing, so every byte crosses between hosts once either way,
 * and Open MPI moves host mates' blocks through its own shared memory.
 * Host blocks between leaders are padded to the largest host's size (MPI
 * collectives of ddp's op set take equal blocks); hosts of equal size, the
 * usual case, pad nothing.
 *
 * The leaders' and the flat ops are the mpi backend's own (enqueue + wait),
 * with the op's blocking_call, so a blocking call of the program runs MPI's
 * blocking collective between the leaders as it would flat, and the mpi
 * backend's watchdog, timeouts and abort apply.
 *
 * Failure: an error of one part becomes this backend's sticky error and is
 * passed to the other: the local backend fails this rank in the host's
 * region (host mates waiting fail at once), the mpi parts are aborted (so
 * ddp ends the job with MPI_Abort at exit, MPI's unit of failure). */
#include <stdio.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "comm/hier/hier.h"
#include "comm/local/local.h"
#include "comm/mpi/mpi_internal.h"
#include "core/core_internal.h"

/* Ops in flight at once, as the mpi backend's (flat ones: a composed op
 * runs to its end in enqueue). */
#define MH_MAX_IN_FLIGHT 4

typedef struct mh_backend {
  ddp__backend base;
  int rank, size;
  int nhosts, my_host, li, ls, maxls;
  const int32_t *host_of; /* (size) the group's table (borrowed) */
  int *host_first;        /* (nhosts + 1) start of host h in by_host */
  int *by_host;           /* (size) ranks grouped by host, each host's in rank order */
  int *local_index;       /* (size) index of each rank within its host */
  ddp__backend *local;    /* NULL when this host has one rank */
  ddp__backend *leaders;  /* NULL unless this rank is its host's leader */
  ddp__backend *all;
  ddp_store *local_store, *leaders_store, *all_store;
  size_t hier_bytes;      /* ops of at least this many bytes per rank compose */
  bool blocking_call;     /* the running composed op's (for the leaders' ops) */
  ddp__completion inner;  /* the leaders' op running now */
  /* Flat ops enqueued and maybe not yet done, oldest first (the enqueuing
   * thread's only): a composed op waits for them before it starts. The
   * group layer recycles completions, resetting one only just before it
   * enqueues an op with it here, so enqueue first drops the entries that
   * are done or name its own completion: the rest are ops in flight. */
  ddp__completion *flat[MH_MAX_IN_FLIGHT];
  int nflat;
  ddp__hier_scratch scratch[3];
  ddp_status failed;      /* sticky */
  char failed_msg[512];
  ddp__hier_lane lane;    /* the point-to-point lane's split (lane thread only) */
} mh_backend;

static mh_backend *as_mh(ddp__backend *b) { return (mh_backend *)b; }

/* ---- Failure ------------------------------------------------------------------ */

static ddp_status mh_fail(mh_backend *h, ddp_status st, int blame) {
  if (h->failed == DDP_OK) {
    h->failed = st;
    snprintf(h->failed_msg, sizeof h->failed_msg, "%s", ddp_last_error());
    if (h->local) ddp__local_fail_external(h->local, st, blame);
    if (h->leaders) h->leaders->ops->abort(h->leaders);
    h->all->ops->abort(h->all);
    ddp_error(st, "%s", h->failed_msg);
  }
  return st;
}

#define LOCAL_TRY(h, expr)                                                                \
  do {                                                                                    \
    ddp_status mh__s = (expr);                                                            \
    if (mh__s != DDP_OK) return mh_fail(h, mh__s, ddp__local_blamed((h)->local));         \
  } while (0)

static ddp_status check_failed(mh_backend *h) {
  return h->failed ? ddp_error(h->failed, "%s", h->failed_msg) : DDP_OK;
}

/* ---- Helpers ------------------------------------------------------------------ */

static void *scratch(mh_backend *h, int which, size_t bytes) {
  return ddp__hier_scratch_get(&h->scratch[which], bytes, "mpi backend (hierarchy)");
}

#define SCRATCH(h, var, which, bytes)                     \
  do {                                                    \
    var = scratch(h, which, bytes);                       \
    if (!var) return mh_fail(h, DDP_ERR_NOMEM, -1);       \
  } while (0)

static int host_size(const mh_backend *h, int host) { return h->host_first[host + 1] - h->host_first[host]; }

/* Runs one op of the leaders' mpi backend (only leaders call it) to its end. */
static ddp_status leaders_run(mh_backend *h, const ddp__op_ctx *ctx, ddp__op_args a) {
  a.blocking_call = h->blocking_call;
  a.device = (ddp_device){.type = DDP_DEVICE_CPU};
  ddp_status st = ddp__backend_run(h->leaders, ctx, &a, &h->inner);
  return st == DDP_OK ? DDP_OK : mh_fail(h, st, -1);
}

/* Host-order blocks (host g's at g * pb, its ranks' blocks of `bytes` in
 * local order) to and from rank order. */
static void padded_to_rank_order(const mh_backend *h, char *dst, const char *all, size_t pb, size_t bytes) {
  if (!bytes) return;
  for (int g = 0; g < h->nhosts; g++)
    for (int j = 0; j < host_size(h, g); j++)
      memcpy(dst + (size_t)h->by_host[h->host_first[g] + j] * bytes, all + (size_t)g * pb + (size_t)j * bytes, bytes);
}

static void rank_to_padded_order(const mh_backend *h, char *all, const char *src, size_t pb, size_t bytes) {
  if (!bytes) return;
  for (int g = 0; g < h->nhosts; g++)
    for (int j = 0; j < host_size(h, g); j++)
      memcpy(all + (size_t)g * pb + (size_t)j * bytes, src + (size_t)h->by_host[h->host_first[g] + j] * bytes, bytes);
}

/* The root's host, where the root is not its leader: the leader's `from`
 * (elems of dtype) reaches the root's `to` by a local broadcast; the other
 * mates receive into a scratch buffer (slot 2). Called by every rank of
 * that host. */
static ddp_status leader_to_root(mh_backend *h, const ddp__op_ctx *ctx, int root, const void *from, void *to,
                                 size_t elems, ddp_dtype dtype) {
  void *mine = h->rank == root ? to : (void *)from;
  if (h->li != 0 && h->rank != root) SCRATCH(h, mine, 2, elems * ddp_dtype_size(dtype));
  LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, mine, elems, dtype, 0));
  return DDP_OK;
}

/* ---- Composed collectives -------------------------------------------------------- */

static ddp_status mh_allreduce(mh_backend *h, const ddp__op_ctx *ctx, void *buf, size_t count, ddp_dtype dtype,
                               ddp_reduce_op op) {
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, buf, count, dtype, rop, 0));
  if (h->leaders) {
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_ALLREDUCE, .buf = buf, .count = count,
                                               .dtype = dtype, .reduce_op = rop}));
    if (op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, h->size);
  }
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, 0));
  return DDP_OK;
}

static ddp_status mh_broadcast(mh_backend *h, const ddp__op_ctx *ctx, void *buf, size_t count, ddp_dtype dtype,
                               int root) {
  int root_host = h->host_of[root];
  if (h->local && h->my_host == root_host)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, h->local_index[root]));
  if (h->leaders)
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_BROADCAST, .buf = buf, .count = count,
                                               .dtype = dtype, .root = root_host}));
  if (h->local && h->my_host != root_host)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, 0));
  return DDP_OK;
}

static ddp_status mh_reduce(mh_backend *h, const ddp__op_ctx *ctx, void *buf, size_t count, ddp_dtype dtype,
                            ddp_reduce_op op, int root) {
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  int root_host = h->host_of[root];
  size_t bytes = count * ddp_dtype_size(dtype);
  /* A leader other than the root reduces in a copy: its buffer is an input
   * that must stay as it was. */
  void *work = buf;
  if (h->leaders && h->rank != root) {
    SCRATCH(h, work, 0, bytes);
    if (bytes) memcpy(work, buf, bytes);
  }
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, work, count, dtype, rop, 0));
  if (h->leaders)
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_REDUCE, .buf = work, .count = count,
                                               .dtype = dtype, .reduce_op = rop, .root = root_host}));
  if (h->my_host == root_host && h->local_index[root] != 0)
    DDP_TRY(leader_to_root(h, ctx, root, work, buf, count, dtype));
  if (h->rank == root && op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, h->size);
  return DDP_OK;
}

/* The first stage of allgather and gather: this host's blocks (count
 * elements of each rank, in local order) reach its leader's slot *mine of
 * the host-order buffer *all (scratch 0, nhosts blocks of pb bytes; leaders
 * only, both stay NULL elsewhere). */
static ddp_status gather_to_leader(mh_backend *h, const ddp__op_ctx *ctx, const void *send, size_t count,
                                   ddp_dtype dtype, size_t pb, char **all, char **mine) {
  size_t bytes = count * ddp_dtype_size(dtype);
  if (h->leaders) {
    SCRATCH(h, *all, 0, (size_t)h->nhosts * pb);
    *mine = *all + (size_t)h->my_host * pb;
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->gather(h->local, ctx, send, *mine, count, dtype, 0));
  else if (bytes)
    memcpy(*mine, send, bytes);
  return DDP_OK;
}

static ddp_status mh_allgather(mh_backend *h, const ddp__op_ctx *ctx, const void *send, void *recv, size_t count,
                               ddp_dtype dtype) {
  size_t bytes = count * ddp_dtype_size(dtype), pb = (size_t)h->maxls * bytes;
  char *all = NULL, *mine = NULL;
  DDP_TRY(gather_to_leader(h, ctx, send, count, dtype, pb, &all, &mine));
  if (h->leaders) {
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_ALLGATHER, .send = mine, .buf = all,
                                               .count = count * (size_t)h->maxls, .dtype = dtype}));
    padded_to_rank_order(h, recv, all, pb, bytes);
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, recv, count * (size_t)h->size, dtype, 0));
  return DDP_OK;
}

static ddp_status mh_gather(mh_backend *h, const ddp__op_ctx *ctx, const void *send, void *recv, size_t count,
                            ddp_dtype dtype, int root) {
  size_t bytes = count * ddp_dtype_size(dtype), pb = (size_t)h->maxls * bytes;
  int root_host = h->host_of[root];
  char *all = NULL, *mine = NULL, *result = NULL;
  DDP_TRY(gather_to_leader(h, ctx, send, count, dtype, pb, &all, &mine));
  if (h->leaders) {
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_GATHER, .send = mine, .buf = all,
                                               .count = count * (size_t)h->maxls, .dtype = dtype,
                                               .root = root_host}));
    if (h->my_host == root_host) {
      result = h->rank == root ? recv : NULL;
      if (!result) SCRATCH(h, result, 1, (size_t)h->size * bytes);
      padded_to_rank_order(h, result, all, pb, bytes);
    }
  }
  if (h->my_host == root_host && h->local_index[root] != 0)
    DDP_TRY(leader_to_root(h, ctx, root, result, recv, count * (size_t)h->size, dtype));
  return DDP_OK;
}

static ddp_status mh_scatter(mh_backend *h, const ddp__op_ctx *ctx, const void *send, void *recv, size_t count,
                             ddp_dtype dtype, int root) {
  size_t bytes = count * ddp_dtype_size(dtype), pb = (size_t)h->maxls * bytes;
  int root_host = h->host_of[root];
  const char *whole = send; /* the root's send, on the root's leader */
  if (h->my_host == root_host && h->local_index[root] != 0) {
    /* The root's host first: its send reaches the leader. */
    void *got = (void *)send;
    if (h->rank != root) SCRATCH(h, got, 1, (size_t)h->size * bytes);
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, got, count * (size_t)h->size, dtype,
                                                    h->local_index[root]));
    whole = got;
  }
  char *all = NULL, *mine = NULL;
  if (h->leaders) {
    SCRATCH(h, mine, 2, pb);
    if (h->my_host == root_host) {
      SCRATCH(h, all, 0, (size_t)h->nhosts * pb);
      rank_to_padded_order(h, all, whole, pb, bytes);
    }
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_SCATTER, .send = all, .buf = mine,
                                               .count = count * (size_t)h->maxls, .dtype = dtype,
                                               .root = root_host}));
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->scatter(h->local, ctx, mine, recv, count, dtype, 0));
  else if (bytes)
    memcpy(recv, mine, bytes);
  return DDP_OK;
}

static ddp_status mh_reduce_scatter(mh_backend *h, const ddp__op_ctx *ctx, const void *send, void *recv,
                                    size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  size_t es = ddp_dtype_size(dtype), bytes = count * es, total = count * (size_t)h->size;
  /* The leader reduces the whole input in a copy; the others' input is read
   * only (a non-root's buffer of a local reduce is left as it was). */
  char *whole = (char *)send, *mine = NULL;
  if (h->leaders) {
    SCRATCH(h, whole, 0, total * es);
    if (bytes) memcpy(whole, send, total * es);
  }
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, whole, total, dtype, rop, 0));
  if (h->leaders) {
    DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_ALLREDUCE, .buf = whole, .count = total,
                                               .dtype = dtype, .reduce_op = rop}));
    if (op == DDP_REDUCE_AVG) ddp__reduce_scale(whole, total, dtype, h->size);
    /* This host's blocks, in its local order, for the local scatter. */
    SCRATCH(h, mine, 1, (size_t)h->ls * bytes);
    for (int j = 0; j < h->ls && bytes; j++)
      memcpy(mine + (size_t)j * bytes, whole + (size_t)h->by_host[h->host_first[h->my_host] + j] * bytes, bytes);
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->scatter(h->local, ctx, mine, recv, count, dtype, 0));
  else if (bytes)
    memcpy(recv, mine, bytes);
  return DDP_OK;
}

static ddp_status mh_barrier(mh_backend *h, const ddp__op_ctx *ctx) {
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->barrier(h->local, ctx));
  if (h->leaders) DDP_TRY(leaders_run(h, ctx, (ddp__op_args){.kind = DDP__OP_BARRIER, .dtype = DDP_FLOAT32}));
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->barrier(h->local, ctx));
  return DDP_OK;
}

static ddp_status run_composed(mh_backend *h, const ddp__op_ctx *ctx, const ddp__op_args *a) {
  h->blocking_call = a->blocking_call;
  switch (a->kind) {
  case DDP__OP_ALLREDUCE: return mh_allreduce(h, ctx, a->buf, a->count, a->dtype, a->reduce_op);
  case DDP__OP_BROADCAST: return mh_broadcast(h, ctx, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_REDUCE: return mh_reduce(h, ctx, a->buf, a->count, a->dtype, a->reduce_op, a->root);
  case DDP__OP_ALLGATHER: return mh_allgather(h, ctx, a->send, a->buf, a->count, a->dtype);
  case DDP__OP_GATHER: return mh_gather(h, ctx, a->send, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_SCATTER: return mh_scatter(h, ctx, a->send, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_REDUCE_SCATTER: return mh_reduce_scatter(h, ctx, a->send, a->buf, a->count, a->dtype, a->reduce_op);
  case DDP__OP_BARRIER: return mh_barrier(h, ctx);
  default: return ddp_error(DDP_ERR_INTERNAL, "%s: not a composed operation", ctx->op);
  }
}

/* Whether op `a` runs in stages: a collective other than all_to_all whose
 * vector (a rank's whole input or output) is at least hier_bytes. The same
 * on every rank: it reads only the op's arguments, which agree. */
static bool composes(const mh_backend *h, const ddp__op_args *a) {
  size_t v = a->count * ddp_dtype_size(a->dtype);
  switch (a->kind) {
  case DDP__OP_ALLREDUCE:
  case DDP__OP_BROADCAST:
  case DDP__OP_REDUCE: break;
  case DDP__OP_ALLGATHER:
  case DDP__OP_GATHER:
  case DDP__OP_SCATTER:
  case DDP__OP_REDUCE_SCATTER: v *= (size_t)h->size; break;
  case DDP__OP_BARRIER: v = 0; break;
  default: return false;
  }
  return v >= h->hier_bytes;
}

static bool completion_done(const ddp__completion *c) {
  return atomic_load_explicit(&c->done, memory_order_acquire);
}

/* Drops the entries that are done or stale copies of c (the completion of
 * the op being enqueued, just reset for it): what stays are ops in flight
 * before this one, fewer than MH_MAX_IN_FLIGHT. */
static void prune_flat(mh_backend *h, const ddp__completion *c) {
  int n = 0;
  for (int i = 0; i < h->nflat; i++)
    if (h->flat[i] != c && !completion_done(h->flat[i])) h->flat[n++] = h->flat[i];
  h->nflat = n;
}

/* Before a composed op: the flat ops still in MPI complete first (in
 * order), so the composition never overtakes one. Waited under the
 * composed op's deadline. */
static ddp_status drain_flat(mh_backend *h, const ddp__op_ctx *ctx) {
  for (int i = 0; i < h->nflat; i++) {
    ddp__completion *f = h->flat[i];
    if (completion_done(f)) continue;
    ddp_status st = h->all->ops->wait(h->all, ctx, f);
    if (st != DDP_OK) return mh_fail(h, st, -1);
  }
  h->nflat = 0;
  return DDP_OK;
}

/* A flat op (below the threshold) is the mpi backend's over the whole
 * group as it would be on flat MPI: a blocking call of the program runs
 * MPI's blocking collective on the caller, an async one is MPI's
 * nonblocking one, up to MH_MAX_IN_FLIGHT of them in flight, completing in
 * its test / wait. A composed op runs to its end here, after the flat ones
 * before it. */
static ddp_status mh_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *a, ddp__completion *c) {
  mh_backend *h = as_mh(b);
  if (h->nflat) prune_flat(h, c);
  DDP_TRY(check_failed(h));
  if (!composes(h, a)) {
    DDP_TRY(h->all->ops->enqueue(h->all, ctx, a, c));
    if (!completion_done(c)) {
      DDP_ASSERT(h->nflat < MH_MAX_IN_FLIGHT);
      h->flat[h->nflat++] = c;
    }
    return DDP_OK;
  }
  ddp_status st = h->nflat ? drain_flat(h, ctx) : DDP_OK;
  ddp__completion_finish(c, st == DDP_OK ? run_composed(h, ctx, a) : st);
  return DDP_OK;
}

/* The group layer's direct path of a small blocking allreduce (backend.h,
 * allreduce_direct): below the threshold the flat mpi backend's own, so a
 * call there costs what it costs on flat MPI. The group layer takes it only
 * with the group idle (no flat op in flight). */
static ddp_status mh_allreduce_direct(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                      ddp_dtype dtype, ddp_reduce_op op) {
  mh_backend *h = as_mh(b);
  DDP_TRY(check_failed(h));
  return h->all->ops->allreduce_direct(h->all, ctx, buf, count, dtype, op);
}

/* What the direct path takes: the flat backend's limit, below the
 * threshold (an allreduce of hier_bytes or more composes). */
static size_t mh_direct_bytes(const ddp__backend *b) {
  const mh_backend *h = (const mh_backend *)b;
  const ddp__backend_ops *flat = h->all->ops;
  if (!flat->allreduce_direct || !flat->allreduce_direct_bytes || h->hier_bytes == 0) return 0;
  size_t n = flat->allreduce_direct_bytes(h->all);
  return n < h->hier_bytes - 1 ? n : h->hier_bytes - 1;
}

/* A completion not done is a flat op's (composed ones finish in enqueue). */
static bool mh_test(ddp__backend *b, ddp__completion *c) {
  if (completion_done(c)) return true;
  return as_mh(b)->all->ops->test(as_mh(b)->all, c);
}

static ddp_status mh_wait(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  if (completion_done(c)) return DDP_OK;
  mh_backend *h = as_mh(b);
  return h->all->ops->wait(h->all, ctx, c);
}

/* ---- Point to point: the lane ----------------------------------------------------
 * hier.h's, as hier.c's: host mates over the local backend, the others over
 * the flat mpi backend. */
static ddp_status mh_p2p_progress(ddp__backend *be, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs, int n,
                                  int64_t wait_ns, int *culprit) {
  mh_backend *h = as_mh(be);
  ddp__hier_layout at = {.host_of = h->host_of, .my_host = h->my_host, .local_index = h->local_index,
                         .mates = h->by_host + h->host_first[h->my_host]};
  return ddp__hier_lane_progress(&h->lane, &at, h->local, h->all, ctx, reqs, n, wait_ns, culprit);
}

static void mh_p2p_wake(ddp__backend *be) {
  mh_backend *h = as_mh(be);
  if (h->local) h->local->ops->p2p_wake(h->local);
  h->all->ops->p2p_wake(h->all);
}

/* ---- Lifecycle ------------------------------------------------------------------- */

static const char *mh_transport(const ddp__backend *be, int peer) {
  const mh_backend *h = (const mh_backend *)be;
  if (peer == h->rank) return "self";
  if (h->host_of[peer] != h->my_host) return "mpi";
  return h->local->ops->transport(h->local, h->local_index[peer]);
}

static void mh_counters(const ddp__backend *be, ddp_comm_counters *acc) {
  const mh_backend *h = (const mh_backend *)be;
  if (h->local) h->local->ops->counters(h->local, acc);
}

static void mh_abort(ddp__backend *be) {
  mh_backend *h = as_mh(be);
  if (h->local) h->local->ops->abort(h->local);
  if (h->leaders) h->leaders->ops->abort(h->leaders);
  if (h->all) h->all->ops->abort(h->all);
}

static void mh_destroy(ddp__backend *be) {
  mh_backend *h = as_mh(be);
  if (!h) return;
  if (h->local) h->local->ops->destroy(h->local);
  if (h->leaders) h->leaders->ops->destroy(h->leaders);
  if (h->all) h->all->ops->destroy(h->all);
  ddp_store_destroy(h->local_store);
  ddp_store_destroy(h->leaders_store);
  ddp_store_destroy(h->all_store);
  ddp_free(h->host_first);
  ddp_free(h->by_host);
  ddp_free(h->local_index);
  for (int i = 0; i < 3; i++) ddp__hier_scratch_free(&h->scratch[i]);
  ddp__hier_lane_free(&h->lane);
  ddp_free(h);
}

static const ddp__backend_ops mh_ops = {
    .name = "mpi",
    /* As many in flight as flat MPI (async ops below the threshold
     * overlap as they would there); a composed op runs to its end inside
     * enqueue, after the flat ones before it (drain_flat). */
    .caps = {.ops = DDP__CAPS_ALL_OPS, .dtypes = DDP__CAPS_ALL_DTYPES, .reduce_ops = DDP__CAPS_ALL_REDUCE_OPS,
             .devices = DDP__CAPS_CPU, .subgroups = true, .max_in_flight = MH_MAX_IN_FLIGHT},
    .enqueue = mh_enqueue,
    .test = mh_test,
    .wait = mh_wait,
    .p2p_progress = mh_p2p_progress,
    .p2p_wake = mh_p2p_wake,
    .transport = mh_transport,
    .counters = mh_counters,
    .abort = mh_abort,
    .destroy = mh_destroy,
    .allreduce_direct = mh_allreduce_direct,
    .allreduce_direct_bytes = mh_direct_bytes,
};

/* The host tables (hier.h: host g's first rank in by_host is its
 * leader) and this rank's place in them. */
static ddp_status build_tables(mh_backend *h, const ddp__backend_config *cfg) {
  DDP_TRY(ddp__hier_host_tables(cfg, &h->nhosts, &h->host_first, &h->by_host, &h->local_index));
  h->my_host = cfg->host_of[cfg->rank];
  h->li = h->local_index[cfg->rank];
  h->ls = host_size(h, h->my_host);
  for (int g = 0; g < h->nhosts; g++)
    if (host_size(h, g) > h->maxls) h->maxls = host_size(h, g);
  return DDP_OK;
}

/* The leaders' mpi backend (leaders only): rank = host index. Its
 * communicator is made from MPI_COMM_WORLD's ranks through the store, not
 * from the program's communicator a group of from_mpi_comm starts from
 * (which every rank, not only the leaders, would have to split). */
static ddp_status create_leaders(mh_backend *h, const ddp__backend_config *cfg) {
  DDP_TRY(ddp_store_prefix(cfg->store, "mpihier/leaders/", &h->leaders_store));
  int n = h->nhosts;
  int32_t *ids = ddp_calloc((size_t)n, sizeof *ids);
  const char **names = ddp_calloc((size_t)n, sizeof *names);
  int *ranks = ddp_calloc((size_t)n, sizeof *ranks);
  ddp_status st = DDP_OK;
  if (!ids || !names || !ranks) {
    st = ddp_error(DDP_ERR_NOMEM, "mpi backend (hierarchy): out of memory");
  } else {
    for (int g = 0; g < n; g++) {
      ids[g] = g;
      ranks[g] = h->by_host[h->host_first[g]];
      names[g] = cfg->host_names ? cfg->host_names[ranks[g]] : NULL;
    }
    ddp__backend_config lc = {
        .store = h->leaders_store,
        .rank = h->my_host,
        .size = n,
        .host_of = ids,
        .process_of = ids,
        .host_names = cfg->host_names ? names : NULL,
        .timeout_ns = cfg->timeout_ns,
        .group_ranks = ranks,
        .group_size = cfg->size,
        .group_host_names = cfg->host_names,
    };
    MPI_Comm base = ddp__mpi_base_comm;
    ddp__mpi_base_comm = MPI_COMM_NULL;
    st = ddp__backend_mpi_create(&lc, &h->leaders);
    ddp__mpi_base_comm = base;
  }
  ddp_free(ids);
  ddp_free(names);
  ddp_free(ranks);
  return st;
}

static ddp_status hier_bytes_setting(size_t *out) {
  int64_t v = (int64_t)DDP__MPI_HIER_DEFAULT_BYTES;
  ddp_status st = ddp_env_int("DDP_MPI_HIER_BYTES", (int64_t)DDP__MPI_HIER_DEFAULT_BYTES, &v);
  if (st != DDP_OK || v < 0)
    return ddp_error(DDP_ERR_INVALID, "mpi backend: DDP_MPI_HIER_BYTES \"%s\" is not a byte count (collectives of "
                     "at least this many bytes per rank compose shared memory inside hosts with MPI between "
                     "them; 0: all of them)", ddp_env_str("DDP_MPI_HIER_BYTES", ""));
  *out = (size_t)v;
  return DDP_OK;
}

ddp_status ddp__backend_mpi_hier_create(const ddp__backend_config *cfg, ddp__backend **out) {
  *out = NULL;
  if (!cfg || !cfg->store || !cfg->host_of || !cfg->process_of || cfg->size < 2 || cfg->rank < 0 ||
      cfg->rank >= cfg->size)
    return ddp_error(DDP_ERR_INVALID, "mpi backend (hierarchy): bad configuration (rank %d of %d)",
                     cfg ? cfg->rank : -1, cfg ? cfg->size : 0);
  mh_backend *h = ddp_calloc(1, sizeof *h);
  if (!h) return ddp_error(DDP_ERR_NOMEM, "mpi backend (hierarchy): out of memory");
  h->base.ops = &mh_ops;
  h->rank = cfg->rank;
  h->size = cfg->size;
  h->host_of = cfg->host_of;
  ddp_status st = hier_bytes_setting(&h->hier_bytes);
  if (st == DDP_OK) st = build_tables(h, cfg);
  /* The host's shared memory first (among its ranks only), then MPI over
   * the whole group (every rank), then the leaders' (leaders only). */
  if (st == DDP_OK && h->ls > 1) {
    char ns[64];
    snprintf(ns, sizeof ns, "mpihier/local/%d/", h->my_host);
    st = ddp__hier_local_create(cfg, ns, h->by_host + h->host_first[h->my_host], h->ls, h->li, &h->local_store,
                                &h->local);
  }
  if (st == DDP_OK) st = ddp_store_prefix(cfg->store, "mpihier/all/", &h->all_store);
  if (st == DDP_OK) {
    ddp__backend_config ac = *cfg;
    ac.store = h->all_store;
    st = ddp__backend_mpi_create(&ac, &h->all);
  }
  if (st == DDP_OK && h->li == 0) st = create_leaders(h, cfg);
  if (st != DDP_OK) {
    mh_destroy(&h->base);
    return st;
  }
  *out = &h->base;
  return DDP_OK;
}

/* The rule (docs/comm.md, "Hierarchy"): the composition where the group's
 * ranks span several hosts and at least two share one, unless
 * DDP_MPI_HIER=0; pure MPI otherwise. */
ddp__backend_create_fn ddp__backend_mpi_choose(const ddp__backend_config *cfg) {
  if (cfg->size < 2 || strcmp(ddp_env_str("DDP_MPI_HIER", "auto"), "0") == 0) return ddp__backend_mpi_create;
  bool one_host = true, colocated = false;
  for (int r = 0; r < cfg->size; r++) {
    one_host = one_host && cfg->host_of[r] == cfg->host_of[0];
    for (int q = 0; q < r && !colocated; q++) colocated = cfg->host_of[q] == cfg->host_of[r];
  }
  return !one_host && colocated ? ddp__backend_mpi_hier_create : ddp__backend_mpi_create;
}
