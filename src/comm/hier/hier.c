/* The hierarchical backend: a group whose ranks live on several hosts, some
 * of them co-located (DESIGN.md, "Transports are chosen per pair"). Bytes
 * between ranks of one host go through shared memory, bytes between hosts
 * through TCP, and no pair uses both:
 *
 *   local  per host with more than one rank, a local backend over that
 *          host's ranks (processes: shm; threads of one process: threads),
 *          in the store namespace hier/local/<host>/
 *   tcp    one tcp backend over the whole group that connects only pairs of
 *          ranks on different hosts (skip_colocated), in hier/tcp/; its
 *          collectives run over a view of one rank per host (the host's
 *          representative: its lowest rank, or the root on the root's host)
 *
 * Collectives compose the two (docs/comm.md, "Hierarchical backend"):
 *   allreduce       local reduce to the leader -> leaders' tcp allreduce ->
 *                   local broadcast
 *   broadcast       local broadcast on the root's host -> representatives'
 *                   tcp broadcast -> local broadcast on the other hosts
 *   reduce          local reduce to each representative -> their tcp reduce
 *   allgather       local gather -> leaders exchange host blocks over tcp ->
 *                   local broadcast of the whole
 *   gather/scatter  local gather / scatter around tcp transfers of whole
 *                   host blocks between the representatives and the root
 *   reduce_scatter  local reduce of the whole -> leaders' tcp allreduce ->
 *                   local scatter of the host's blocks
 *   all_to_all      tcp transfers with every rank of other hosts, then a
 *                   local all_to_all of the host's blocks
 *   barrier         local barrier -> leaders' tcp barrier -> local barrier
 *   send / recv     the pair's transport
 *
 * Failure: a sub-backend's error becomes this backend's sticky error and is
 * passed to the other part with the rank it blames (ddp__local_fail_external
 * marks this rank failed in the host's region, naming the rank;
 * ddp__tcp_fail_external sends BYE with it as the cause), so every rank of
 * every host fails within milliseconds naming the rank that died. */
#include <stdio.h>
#include <string.h>

#include "comm/hier/hier.h"
#include "comm/local/local.h"
#include "comm/tcp/tcp.h"

typedef struct hier_backend {
  ddp__backend base;
  int rank, size;
  int nhosts, my_host;
  const int32_t *host_of;  /* (size) the group's table (borrowed) */
  int *host_first;         /* (nhosts + 1) start of host h in by_host */
  int *by_host;            /* (size) ranks grouped by host, each host's in rank order */
  int *local_index;        /* (size) index of each rank within its host */
  int *reps;               /* (nhosts) the view of the running op */
  int li, ls;              /* this rank's index and its host's size */
  ddp__backend *local;     /* NULL when this host has one rank */
  ddp__tcp_backend *tcp;
  ddp_store *local_store, *tcp_store;
  ddp__hier_scratch scratch[2];
  ddp_status failed;       /* sticky */
  char failed_msg[512];
  ddp__hier_lane lane;      /* the point-to-point lane's split (lane thread only) */
} hier_backend;

static hier_backend *as_hier(ddp__backend *b) { return (hier_backend *)b; }

/* ---- Failure ------------------------------------------------------------------ */

/* An error of one part: records it, tells the other part (naming the rank
 * to blame) and returns it. */
static ddp_status hier_fail(hier_backend *h, ddp_status st, int blame) {
  if (h->failed == DDP_OK) {
    h->failed = st;
    snprintf(h->failed_msg, sizeof h->failed_msg, "%s", ddp_last_error());
    if (h->local) ddp__local_fail_external(h->local, st, blame);
    ddp__tcp_fail_external(h->tcp, st, blame);
    ddp_error(st, "%s", h->failed_msg);
  }
  return st;
}

#define LOCAL_TRY(h, expr)                                                        \
  do {                                                                            \
    ddp_status hier__s = (expr);                                                  \
    if (hier__s != DDP_OK) return hier_fail(h, hier__s, ddp__local_blamed((h)->local)); \
  } while (0)
#define TCP_TRY(h, expr)                                                          \
  do {                                                                            \
    ddp_status hier__s = (expr);                                                  \
    if (hier__s != DDP_OK) return hier_fail(h, hier__s, (h)->tcp->failed_peer);   \
  } while (0)

static ddp_status check_failed(hier_backend *h) {
  return h->failed ? ddp_error(h->failed, "%s", h->failed_msg) : DDP_OK;
}

/* ---- Helpers ------------------------------------------------------------------ */

static void *scratch(hier_backend *h, int which, size_t bytes) {
  return ddp__hier_scratch_get(&h->scratch[which], bytes, "hier backend");
}

#define SCRATCH(h, var, which, bytes)                                  \
  do {                                                                 \
    var = scratch(h, which, bytes);                                    \
    if (!var) return hier_fail(h, DDP_ERR_NOMEM, -1);                  \
  } while (0)

static int host_size(const hier_backend *h, int host) {
  return h->host_first[host + 1] - h->host_first[host];
}

/* The representatives of the running op: each host's lowest rank, except
 * `root` (-1: none) on its host. Returns whether this rank is one. */
static bool set_reps(hier_backend *h, int root) {
  for (int g = 0; g < h->nhosts; g++) h->reps[g] = h->by_host[h->host_first[g]];
  if (root >= 0) h->reps[h->host_of[root]] = root;
  return h->reps[h->my_host] == h->rank;
}

/* Runs a tcp collective over the representatives (only they call it). */
#define TCP_VIEW(h, call)                                \
  do {                                                   \
    ddp__tcp_view_set((h)->tcp, (h)->nhosts, (h)->reps); \
    ddp_status hv__s = (call);                           \
    ddp__tcp_view_clear((h)->tcp);                       \
    TCP_TRY(h, hv__s);                                   \
  } while (0)

static ddp__backend *tcpb(hier_backend *h) { return &h->tcp->base; }

/* Copies blocks between rank order (dst or src indexed by group rank) and
 * host order (by_host). */
static void to_rank_order(const hier_backend *h, char *dst, const char *by_host, size_t bytes) {
  for (int i = 0; i < h->size; i++)
    if (bytes) memcpy(dst + (size_t)h->by_host[i] * bytes, by_host + (size_t)i * bytes, bytes);
}

static void to_host_order(const hier_backend *h, char *by_host, const char *src, size_t bytes) {
  for (int i = 0; i < h->size; i++)
    if (bytes) memcpy(by_host + (size_t)i * bytes, src + (size_t)h->by_host[i] * bytes, bytes);
}

/* ---- Collectives ----------------------------------------------------------------- */

static ddp_status hier_allreduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf,
                                 size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, buf, count, dtype, rop, 0));
  if (set_reps(h, -1)) {
    TCP_VIEW(h, ddp__tcp_allreduce(tcpb(h), ctx, buf, count, dtype, rop));
    if (op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, h->size);
  }
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, 0));
  return DDP_OK;
}

static ddp_status hier_broadcast(ddp__backend *be, const ddp__op_ctx *ctx, void *buf,
                                 size_t count, ddp_dtype dtype, int root) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  int root_host = h->host_of[root];
  bool rep = set_reps(h, root);
  if (h->local && h->my_host == root_host)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, h->local_index[root]));
  if (rep) TCP_VIEW(h, ddp__tcp_broadcast(tcpb(h), ctx, buf, count, dtype, root_host));
  if (h->local && h->my_host != root_host)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, buf, count, dtype, 0));
  return DDP_OK;
}

static ddp_status hier_reduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op, int root) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  bool rep = set_reps(h, root);
  size_t bytes = count * ddp_dtype_size(dtype);
  /* A representative other than the root reduces in a copy: its buffer is
   * an input that must stay as it was. */
  void *work = buf;
  if (rep && h->rank != root) {
    SCRATCH(h, work, 0, bytes);
    if (bytes) memcpy(work, buf, bytes);
  }
  int rep_index = h->local_index[h->reps[h->my_host]];
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, work, count, dtype, rop, rep_index));
  if (rep) TCP_VIEW(h, ddp__tcp_reduce(tcpb(h), ctx, work, count, dtype, rop, h->host_of[root]));
  if (h->rank == root && op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, h->size);
  return DDP_OK;
}

/* Between representatives, over tcp, whole host blocks of `bytes` per rank
 * in host order (`all`, size * bytes, this host's block already in place):
 * to == -1: every representative gets every block (allgather); else only
 * representative of host `to` gets them (gather). */
static ddp_status exchange_blocks(hier_backend *h, const ddp__op_ctx *ctx, char *all,
                                  size_t bytes, int to) {
  ddp__tcp_xfer *x = ddp__tcp_xfers(h->tcp, 2 * h->nhosts);
  if (!x) return hier_fail(h, DDP_ERR_NOMEM, -1);
  int n = 0;
  char *mine = all + (size_t)h->host_first[h->my_host] * bytes;
  for (int g = 0; g < h->nhosts; g++) {
    if (g == h->my_host) continue;
    char *theirs = all + (size_t)h->host_first[g] * bytes;
    if (to < 0 || to == g)
      ddp__tcp_post_send(&x[n++], h->reps[g], mine, (size_t)h->ls * bytes);
    if (to < 0 || to == h->my_host)
      ddp__tcp_post_recv(&x[n++], h->reps[g], theirs, (size_t)host_size(h, g) * bytes);
  }
  TCP_TRY(h, ddp__tcp_run(h->tcp, ctx, x, n));
  return DDP_OK;
}

static ddp_status hier_allgather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                                 void *recv, size_t count, ddp_dtype dtype) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  size_t bytes = count * ddp_dtype_size(dtype);
  bool leader = set_reps(h, -1);
  char *all = NULL;
  if (leader) SCRATCH(h, all, 0, (size_t)h->size * bytes);
  char *mine = leader ? all + (size_t)h->host_first[h->my_host] * bytes : NULL;
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->gather(h->local, ctx, send, mine, count, dtype, 0));
  else if (bytes)
    memcpy(mine, send, bytes);
  if (leader) {
    DDP_TRY(exchange_blocks(h, ctx, all, bytes, -1));
    to_rank_order(h, recv, all, bytes);
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->broadcast(h->local, ctx, recv, count * (size_t)h->size, dtype, 0));
  return DDP_OK;
}

static ddp_status hier_gather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                              void *recv, size_t count, ddp_dtype dtype, int root) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  size_t bytes = count * ddp_dtype_size(dtype);
  bool rep = set_reps(h, root);
  char *all = NULL;
  if (rep) SCRATCH(h, all, 0, (size_t)h->size * bytes);
  char *mine = rep ? all + (size_t)h->host_first[h->my_host] * bytes : NULL;
  int rep_index = h->local_index[h->reps[h->my_host]];
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->gather(h->local, ctx, send, mine, count, dtype, rep_index));
  else if (bytes)
    memcpy(mine, send, bytes);
  if (rep) DDP_TRY(exchange_blocks(h, ctx, all, bytes, h->host_of[root]));
  if (h->rank == root) to_rank_order(h, recv, all, bytes);
  return DDP_OK;
}

static ddp_status hier_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype, int root) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  size_t bytes = count * ddp_dtype_size(dtype);
  bool rep = set_reps(h, root);
  int root_host = h->host_of[root];
  char *all = NULL;
  if (rep) SCRATCH(h, all, 0, (size_t)h->size * bytes);
  char *mine = rep ? all + (size_t)h->host_first[h->my_host] * bytes : NULL;
  if (h->rank == root) to_host_order(h, all, send, bytes);
  if (rep) {
    ddp__tcp_xfer *x = ddp__tcp_xfers(h->tcp, h->nhosts);
    if (!x) return hier_fail(h, DDP_ERR_NOMEM, -1);
    int n = 0;
    for (int g = 0; g < h->nhosts; g++) {
      if (g == root_host) continue;
      if (h->rank == root)
        ddp__tcp_post_send(&x[n++], h->reps[g], all + (size_t)h->host_first[g] * bytes,
                           (size_t)host_size(h, g) * bytes);
      else if (g == h->my_host)
        ddp__tcp_post_recv(&x[n++], root, mine, (size_t)h->ls * bytes);
    }
    TCP_TRY(h, ddp__tcp_run(h->tcp, ctx, x, n));
  }
  int rep_index = h->local_index[h->reps[h->my_host]];
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->scatter(h->local, ctx, mine, recv, count, dtype, rep_index));
  else if (bytes)
    memcpy(recv, mine, bytes);
  return DDP_OK;
}

static ddp_status hier_reduce_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                                      void *recv, size_t count, ddp_dtype dtype,
                                      ddp_reduce_op op) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  ddp_reduce_op rop = op == DDP_REDUCE_AVG ? DDP_REDUCE_SUM : op;
  size_t bytes = count * ddp_dtype_size(dtype), total = count * (size_t)h->size;
  bool leader = set_reps(h, -1);
  /* The leader reduces the whole input in a copy; the others' input is read
   * only (a non-root's buffer of a local reduce is left as it was). */
  char *whole = (char *)send, *mine = NULL;
  if (leader) {
    SCRATCH(h, whole, 0, total * ddp_dtype_size(dtype));
    if (bytes) memcpy(whole, send, total * ddp_dtype_size(dtype));
  }
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->reduce(h->local, ctx, whole, total, dtype, rop, 0));
  if (leader) {
    TCP_VIEW(h, ddp__tcp_allreduce(tcpb(h), ctx, whole, total, dtype, rop));
    if (op == DDP_REDUCE_AVG) ddp__reduce_scale(whole, total, dtype, h->size);
    /* This host's blocks, in its local order, for the local scatter. */
    SCRATCH(h, mine, 1, (size_t)h->ls * bytes);
    for (int j = 0; j < h->ls; j++)
      if (bytes)
        memcpy(mine + (size_t)j * bytes,
               whole + (size_t)h->by_host[h->host_first[h->my_host] + j] * bytes, bytes);
  }
  if (h->local)
    LOCAL_TRY(h, h->local->ops->blocking->scatter(h->local, ctx, mine, recv, count, dtype, 0));
  else if (bytes)
    memcpy(recv, mine, bytes);
  return DDP_OK;
}

static ddp_status hier_all_to_all(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                                  void *recv, size_t count, ddp_dtype dtype) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  size_t bytes = count * ddp_dtype_size(dtype);
  const char *s = send;
  char *r = recv;
  /* Every rank of another host: straight over tcp. */
  int remote = h->size - h->ls;
  ddp__tcp_xfer *x = ddp__tcp_xfers(h->tcp, 2 * remote);
  if (!x) return hier_fail(h, DDP_ERR_NOMEM, -1);
  int n = 0;
  for (int i = 1; i < h->size; i++) {
    int q = (h->rank + i) % h->size;
    if (h->host_of[q] == h->my_host) continue;
    ddp__tcp_post_send(&x[n++], q, s + (size_t)q * bytes, bytes);
    ddp__tcp_post_recv(&x[n++], q, r + (size_t)q * bytes, bytes);
  }
  TCP_TRY(h, ddp__tcp_run(h->tcp, ctx, x, n));
  /* This host's ranks: a local all_to_all of their blocks, in local order. */
  const int *mates = h->by_host + h->host_first[h->my_host];
  if (!h->local) {
    if (bytes) memcpy(r + (size_t)h->rank * bytes, s + (size_t)h->rank * bytes, bytes);
    return DDP_OK;
  }
  char *packed, *got;
  SCRATCH(h, packed, 0, (size_t)h->ls * bytes);
  SCRATCH(h, got, 1, (size_t)h->ls * bytes);
  for (int j = 0; j < h->ls; j++)
    if (bytes) memcpy(packed + (size_t)j * bytes, s + (size_t)mates[j] * bytes, bytes);
  LOCAL_TRY(h, h->local->ops->blocking->all_to_all(h->local, ctx, packed, got, count, dtype));
  for (int j = 0; j < h->ls; j++)
    if (bytes) memcpy(r + (size_t)mates[j] * bytes, got + (size_t)j * bytes, bytes);
  return DDP_OK;
}

static ddp_status hier_barrier(ddp__backend *be, const ddp__op_ctx *ctx) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->barrier(h->local, ctx));
  if (set_reps(h, -1)) TCP_VIEW(h, ddp__tcp_barrier(tcpb(h), ctx));
  if (h->local) LOCAL_TRY(h, h->local->ops->blocking->barrier(h->local, ctx));
  return DDP_OK;
}

/* ---- Point to point ----------------------------------------------------------- */

static ddp_status hier_send(ddp__backend *be, const ddp__op_ctx *ctx, const void *buf,
                            size_t bytes, int dst) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  if (h->host_of[dst] == h->my_host)
    LOCAL_TRY(h, h->local->ops->blocking->send(h->local, ctx, buf, bytes, h->local_index[dst]));
  else
    TCP_TRY(h, tcpb(h)->ops->blocking->send(tcpb(h), ctx, buf, bytes, dst));
  return DDP_OK;
}

static ddp_status hier_recv(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                            int src) {
  hier_backend *h = as_hier(be);
  DDP_TRY(check_failed(h));
  if (h->host_of[src] == h->my_host)
    LOCAL_TRY(h, h->local->ops->blocking->recv(h->local, ctx, buf, bytes, h->local_index[src]));
  else
    TCP_TRY(h, tcpb(h)->ops->blocking->recv(tcpb(h), ctx, buf, bytes, src));
  return DDP_OK;
}

/* The lane (hier.h's ddp__hier_lane_progress, shared with mpi/leaders.c):
 * host mates over the local backend, the others over tcp. A failure is the
 * lane's, not this backend's sticky one (the lane fails the group, whose
 * abort reaches both parts). */
static ddp_status hier_p2p_progress(ddp__backend *be, const ddp__op_ctx *ctx,
                                    ddp__p2p_req *const *reqs, int n, int64_t wait_ns,
                                    int *culprit) {
  hier_backend *h = as_hier(be);
  ddp__hier_layout at = {.host_of = h->host_of, .my_host = h->my_host, .local_index = h->local_index,
                         .mates = h->by_host + h->host_first[h->my_host]};
  return ddp__hier_lane_progress(&h->lane, &at, h->local, tcpb(h), ctx, reqs, n, wait_ns, culprit);
}

static void hier_p2p_wake(ddp__backend *be) {
  hier_backend *h = as_hier(be);
  if (h->local) h->local->ops->p2p_wake(h->local);
  tcpb(h)->ops->p2p_wake(tcpb(h));
}

/* ---- Lifecycle -------------------------------------------------------------------- */

static const char *hier_transport(const ddp__backend *be, int peer) {
  const hier_backend *h = (const hier_backend *)be;
  if (peer == h->rank) return "self";
  if (h->host_of[peer] != h->my_host) return "tcp";
  return h->local->ops->transport(h->local, h->local_index[peer]);
}

static void hier_counters(const ddp__backend *be, ddp_comm_counters *acc) {
  const hier_backend *h = (const hier_backend *)be;
  if (h->local) h->local->ops->counters(h->local, acc);
  h->tcp->base.ops->counters(&h->tcp->base, acc);
}

static void hier_abort(ddp__backend *be) {
  hier_backend *h = as_hier(be);
  if (h->local) h->local->ops->abort(h->local);
  if (h->tcp) h->tcp->base.ops->abort(&h->tcp->base);
}

static void hier_destroy(ddp__backend *be) {
  hier_backend *h = as_hier(be);
  if (!h) return;
  if (h->local) h->local->ops->destroy(h->local);
  if (h->tcp) h->tcp->base.ops->destroy(&h->tcp->base);
  ddp_store_destroy(h->local_store);
  ddp_store_destroy(h->tcp_store);
  ddp_free(h->host_first);
  ddp_free(h->by_host);
  ddp_free(h->local_index);
  ddp_free(h->reps);
  ddp__hier_scratch_free(&h->scratch[0]);
  ddp__hier_scratch_free(&h->scratch[1]);
  ddp__hier_lane_free(&h->lane);
  ddp_free(h);
}

static const ddp__blocking_ops hier_blocking = {
    .allreduce = hier_allreduce,
    .broadcast = hier_broadcast,
    .reduce = hier_reduce,
    .allgather = hier_allgather,
    .gather = hier_gather,
    .scatter = hier_scatter,
    .reduce_scatter = hier_reduce_scatter,
    .all_to_all = hier_all_to_all,
    .barrier = hier_barrier,
    .send = hier_send,
    .recv = hier_recv,
};

static const ddp__backend_ops hier_ops = {
    .name = "hier",
    .caps = DDP__CAPS_HOST_BLOCKING,
    .enqueue = ddp__blocking_enqueue,
    .blocking = &hier_blocking,
    .p2p_progress = hier_p2p_progress,
    .p2p_wake = hier_p2p_wake,
    .transport = hier_transport,
    .counters = hier_counters,
    .abort = hier_abort,
    .destroy = hier_destroy,
};

/* The host tables (hier.h) and the view of the running op. */
static ddp_status build_tables(hier_backend *h, const ddp__backend_config *cfg) {
  DDP_TRY(ddp__hier_host_tables(cfg, &h->nhosts, &h->host_first, &h->by_host, &h->local_index));
  h->my_host = cfg->host_of[cfg->rank];
  h->reps = ddp_calloc((size_t)h->nhosts, sizeof *h->reps);
  if (!h->reps) return ddp_error(DDP_ERR_NOMEM, "hier backend: out of memory");
  h->li = h->local_index[cfg->rank];
  h->ls = host_size(h, h->my_host);
  return DDP_OK;
}

/* ---- Shared with mpi/leaders.c (hier.h): host tables, scratch, the lane ------------ */

ddp_status ddp__hier_host_tables(const ddp__backend_config *cfg, int *nhosts_out, int **host_first_out,
                                 int **by_host_out, int **local_index_out) {
  int size = cfg->size, nhosts = 0;
  for (int r = 0; r < size; r++)
    if (cfg->host_of[r] + 1 > nhosts) nhosts = cfg->host_of[r] + 1;
  *nhosts_out = nhosts;
  int *host_first = *host_first_out = ddp_calloc((size_t)nhosts + 1, sizeof *host_first);
  int *by_host = *by_host_out = ddp_calloc((size_t)size, sizeof *by_host);
  int *local_index = *local_index_out = ddp_calloc((size_t)size, sizeof *local_index);
  int *fill = ddp_calloc((size_t)nhosts, sizeof *fill);
  if (!host_first || !by_host || !local_index || !fill) {
    ddp_free(fill);
    return ddp_error(DDP_ERR_NOMEM, "hierarchy (rank %d of %d): out of memory for the host tables", cfg->rank,
                     size);
  }
  for (int r = 0; r < size; r++) host_first[cfg->host_of[r] + 1]++;
  for (int g = 0; g < nhosts; g++) host_first[g + 1] += host_first[g];
  for (int r = 0; r < size; r++) {
    int g = cfg->host_of[r];
    local_index[r] = fill[g];
    by_host[host_first[g] + fill[g]++] = r;
  }
  ddp_free(fill);
  return DDP_OK;
}

void *ddp__hier_scratch_get(ddp__hier_scratch *s, size_t bytes, const char *who) {
  if (s->buf && bytes <= s->bytes) return s->buf;
  ddp__hier_scratch_free(s);
  s->buf = ddp_alloc(bytes ? bytes : 1);
  if (!s->buf) {
    ddp_error(DDP_ERR_NOMEM, "%s: no memory for a %zu-byte scratch buffer", who, bytes);
    return NULL;
  }
  s->bytes = bytes;
  return s->buf;
}

void ddp__hier_scratch_free(ddp__hier_scratch *s) {
  ddp_free(s->buf);
  *s = (ddp__hier_scratch){0};
}


#define HIER_LANE_SLICE_NS 1000000LL

/* Room for n requests (at first DDP__P2P_FIRST_CAP: with room for just
 * twice the first steps' need, test_p2p_batch's hierarchy steady state
 * allocated in about 1 run of 15, when timing left more unfinished). */
static ddp_status lane_reserve(ddp__hier_lane *lane, int n) {
  if (n <= lane->cap) return DDP_OK;
  int cap = n < DDP__P2P_FIRST_CAP ? DDP__P2P_FIRST_CAP : 2 * n;
  ddp__p2p_req **l = ddp_calloc((size_t)cap, sizeof *l), **r = ddp_calloc((size_t)cap, sizeof *r);
  int *la = ddp_calloc((size_t)cap, sizeof *la), *ra = ddp_calloc((size_t)cap, sizeof *ra);
  if (!l || !r || !la || !ra) {
    ddp_free(l), ddp_free(r), ddp_free(la), ddp_free(ra);
    return ddp_error(DDP_ERR_NOMEM, "hierarchy: no memory for %d point-to-point requests", n);
  }
  ddp__hier_lane_free(lane);
  *lane = (ddp__hier_lane){.local = l, .remote = r, .local_at = la, .remote_at = ra, .cap = cap};
  return DDP_OK;
}

ddp_status ddp__hier_lane_progress(ddp__hier_lane *lane, const ddp__hier_layout *at, ddp__backend *local,
                                   ddp__backend *remote, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs,
                                   int n, int64_t wait_ns, int *culprit) {
  *culprit = -1;
  DDP_TRY(lane_reserve(lane, n));
  int nl = 0, nr = 0;
  for (int i = 0; i < n; i++) {
    if (at->host_of[reqs[i]->peer] == at->my_host) {
      lane->local_at[nl] = i;
      lane->local[nl++] = reqs[i];
    } else {
      lane->remote_at[nr] = i;
      lane->remote[nr++] = reqs[i];
    }
  }
  int64_t slice = nl && nr && wait_ns > HIER_LANE_SLICE_NS ? HIER_LANE_SLICE_NS : wait_ns;
  ddp_status st = DDP_OK;
  int c = -1;
  if (nl) {
    for (int i = 0; i < nl; i++) lane->local[i]->peer = at->local_index[lane->local[i]->peer];
    st = local->ops->p2p_progress(local, ctx, lane->local, nl, nr ? 0 : slice, &c);
    for (int i = 0; i < nl; i++) lane->local[i]->peer = at->mates[lane->local[i]->peer];
    if (st != DDP_OK) {
      *culprit = c >= 0 ? lane->local_at[c] : -1;
      return st;
    }
  }
  if (nr) {
    st = remote->ops->p2p_progress(remote, ctx, lane->remote, nr, slice, &c);
    if (st != DDP_OK) *culprit = c >= 0 ? lane->remote_at[c] : -1;
  }
  return st;
}

void ddp__hier_lane_free(ddp__hier_lane *lane) {
  ddp_free(lane->local);
  ddp_free(lane->remote);
  ddp_free(lane->local_at);
  ddp_free(lane->remote_at);
  *lane = (ddp__hier_lane){0};
}

/* The local backend over one host's ranks (hier.h). */
ddp_status ddp__hier_local_create(const ddp__backend_config *cfg, const char *ns, const int *mates, int ls,
                                  int li, ddp_store **store, ddp__backend **out) {
  *out = NULL;
  DDP_TRY(ddp_store_prefix(cfg->store, ns, store));
  int32_t *host_of = ddp_calloc((size_t)ls, sizeof *host_of);
  int32_t *process_of = ddp_calloc((size_t)ls, sizeof *process_of);
  const char **names = ddp_calloc((size_t)ls, sizeof *names);
  ddp_status st = DDP_OK;
  if (!host_of || !process_of || !names) {
    st = ddp_error(DDP_ERR_NOMEM, "hier backend: out of memory");
  } else {
    for (int j = 0; j < ls; j++) {
      process_of[j] = cfg->process_of[mates[j]];
      names[j] = cfg->host_names ? cfg->host_names[mates[j]] : NULL;
    }
    ddp__backend_config lc = {
        .store = *store,
        .rank = li,
        .size = ls,
        .host_of = host_of,
        .process_of = process_of,
        .host_names = cfg->host_names ? names : NULL,
        .timeout_ns = cfg->timeout_ns,
        .group_ranks = mates,
        .group_size = cfg->size,
        .group_host_names = cfg->host_names,
    };
    st = ddp__backend_local_create(&lc, out);
  }
  ddp_free(host_of);
  ddp_free(process_of);
  ddp_free(names);
  return st;
}

/* The local backend over this host's ranks, in hier/local/<host>/. */
static ddp_status create_local(hier_backend *h, const ddp__backend_config *cfg) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "hier/local/%d/", h->my_host);
  return ddp__hier_local_create(cfg, prefix, h->by_host + h->host_first[h->my_host], h->ls, h->li,
                                &h->local_store, &h->local);
}

ddp_status ddp__backend_hier_create(const ddp__backend_config *cfg, ddp__backend **out) {
  *out = NULL;
  if (!cfg || !cfg->store || !cfg->host_of || !cfg->process_of || cfg->size < 2 ||
      cfg->rank < 0 || cfg->rank >= cfg->size)
    return ddp_error(DDP_ERR_INVALID, "hier backend: bad configuration (rank %d of %d)",
                     cfg ? cfg->rank : -1, cfg ? cfg->size : 0);
  hier_backend *h = ddp_calloc(1, sizeof *h);
  if (!h) return ddp_error(DDP_ERR_NOMEM, "hier backend: out of memory");
  h->base.ops = &hier_ops;
  h->rank = cfg->rank;
  h->size = cfg->size;
  h->host_of = cfg->host_of;
  ddp_status st = build_tables(h, cfg);
  /* The host's shared memory first (among its ranks only), then the TCP
   * pairs between hosts. */
  if (st == DDP_OK && h->ls > 1) st = create_local(h, cfg);
  if (st == DDP_OK) st = ddp_store_prefix(cfg->store, "hier/tcp/", &h->tcp_store);
  if (st == DDP_OK) {
    ddp__backend_config tc = *cfg;
    tc.store = h->tcp_store;
    tc.skip_colocated = true;
    ddp__backend *t = NULL;
    st = ddp__backend_tcp_create(&tc, &t);
    h->tcp = (ddp__tcp_backend *)t;
  }
  if (st != DDP_OK) {
    hier_destroy(&h->base);
    return st;
  }
  *out = &h->base;
  return DDP_OK;
}
