/* The contract between the process-group layer (src/comm/group.c, work.c,
 * collectives.c: validation, ordering, the progress thread, timeouts, sticky
 * errors, debug fingerprints) and a backend (the algorithms and transports
 * that move bytes). As in gloo, algorithms and transports know nothing of
 * queues or work handles: a backend op runs one collective to completion on
 * the calling thread, or fails.
 *
 * Backends (chosen per group from the ranks' identities, exchanged through
 * the group's store; docs/comm.md):
 *   local  — every rank on one host: ranks read and reduce straight from each
 *            other's buffers. Two memory providers: "threads" (ranks are
 *            threads of one process: plain pointers) and "shm" (processes:
 *            shared-memory segments / cross-memory attach), src/comm/local*.c
 *   tcp    — otherwise: a pair (socket) per peer; pipelined segmented ring
 *            for large messages, recursive halving-doubling for small ones,
 *            src/comm/tcp*.c
 *   hier   — ranks on several hosts, some of them co-located: per host a
 *            local backend (shared memory), and a tcp backend connecting
 *            only ranks of different hosts; collectives compose the two
 *            (local reduce -> tcp among one rank per host -> local
 *            broadcast, ...), point-to-point picks per pair,
 *            src/comm/hier.c
 *   self   — a group of one: copies (src/comm/self.c)
 *
 * Rules every backend keeps:
 *   - Every wait checks ctx->deadline_ns (DDP_ERR_TIMEOUT, naming ctx->op and
 *     ctx->seq and the peer waited for) and ctx->aborted (DDP_ERR_ABORTED).
 *   - A peer's death is detected independently of the deadline (closed
 *     socket, lost heartbeat) within 5 s and reported as DDP_ERR_PEER with
 *     "rank R (host) died (why)" in the message.
 *   - Ops are called in the same order on every rank (the group layer
 *     guarantees it), one at a time per backend (never concurrently).
 *   - abort() may be called from any thread while an op runs: it must make
 *     that op return promptly.
 *   - count == 0 is valid and completes (still synchronising where the
 *     collective implies it, e.g. barrier). */
#ifndef DDP__COMM_BACKEND_H
#define DDP__COMM_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"

typedef struct ddp__backend ddp__backend;

/* Per-operation context, filled by the group layer. */
typedef struct ddp__op_ctx {
  const char *op;          /* "allreduce", "broadcast", ... for messages */
  uint64_t seq;            /* the group's operation number, from 1 */
  int64_t deadline_ns;     /* ddp_time_ns() after which waits give up */
  atomic_bool *aborted;    /* set by ddp_process_group_abort */
  int tag;                 /* point-to-point only */
  /* The thread that needs the result is blocked in this op (a blocking
   * call run inline on it): nothing else of this process is waiting for
   * the CPU the op runs on, so a backend may spin longer before it sleeps
   * (a sleeping rank wakes tens of microseconds late on a VM). False for
   * ops on the progress thread, which may share a core with the caller's
   * ongoing work (backward, overlapped with bucket allreduces). */
  bool caller_blocked;
} ddp__op_ctx;

/* One send or receive of the point-to-point lane (src/comm/p2p_lane.c).
 * The group's p2p thread progresses every pending request through the
 * backend's p2p_progress, concurrently with the collective the progress
 * thread may be running: a backend keeps what p2p_progress touches apart
 * from what its collectives touch (its own channels, sockets, counters). */
typedef struct ddp__p2p_req {
  bool is_send;
  bool finished;     /* set by p2p_progress */
  void *buf;         /* read for sends, written for receives */
  size_t bytes;
  int peer;          /* group rank, never this rank */
  int tag;
  /* The backend's progress state: zeroed when the request is posted. */
  _Alignas(16) unsigned char state[160];
} ddp__p2p_req;

typedef struct ddp__backend_ops {
  const char *name; /* "local", "tcp", "self" */
  ddp_status (*allreduce)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                          ddp_dtype dtype, ddp_reduce_op op);
  ddp_status (*broadcast)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                          ddp_dtype dtype, int root);
  ddp_status (*reduce)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                       ddp_dtype dtype, ddp_reduce_op op, int root);
  ddp_status (*allgather)(ddp__backend *b, const ddp__op_ctx *ctx, const void *send, void *recv,
                          size_t count, ddp_dtype dtype);
  ddp_status (*gather)(ddp__backend *b, const ddp__op_ctx *ctx, const void *send, void *recv,
                       size_t count, ddp_dtype dtype, int root);
  ddp_status (*scatter)(ddp__backend *b, const ddp__op_ctx *ctx, const void *send, void *recv,
                        size_t count, ddp_dtype dtype, int root);
  ddp_status (*reduce_scatter)(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype, ddp_reduce_op op);
  ddp_status (*all_to_all)(ddp__backend *b, const ddp__op_ctx *ctx, const void *send, void *recv,
                           size_t count, ddp_dtype dtype);
  ddp_status (*barrier)(ddp__backend *b, const ddp__op_ctx *ctx);
  /* Point to point: bytes, matched in order per (peer, tag). */
  ddp_status (*send)(ddp__backend *b, const ddp__op_ctx *ctx, const void *buf, size_t bytes,
                     int dst);
  ddp_status (*recv)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t bytes, int src);
  /* The point-to-point lane (NULL: p2p goes through the op queue, one op at
   * a time, with send/recv above). Progresses reqs[0..n), given in posting
   * order: sends to one peer go out in that order, receives from one peer
   * match its messages in order per tag. Sets `finished` on each request
   * that completes; when nothing progressed, waits at most wait_ns for a
   * peer's post or p2p_wake. A dead or departed peer with a pending request
   * fails it (DDP_ERR_PEER naming the rank) within about 5 s; a rank that
   * died fails every pending request. On failure returns the status with
   * the message as the last error, and *culprit the index of the request it
   * concerns (-1: none in particular). Deadlines and abort are the caller's.
   * Called by one thread at a time: whoever drives the lane (the waiting
   * caller or the lane's thread, p2p_lane.c). */
  ddp_status (*p2p_progress)(ddp__backend *b, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs,
                             int n, int64_t wait_ns, int *culprit);
  /* Ends a p2p_progress wait early (new requests, abort); any thread. */
  void (*p2p_wake)(ddp__backend *b);
  /* The transport towards `peer`: "self", "threads", "shm", "tcp". */
  const char *(*transport)(const ddp__backend *b, int peer);
  /* Adds what this backend's transports carried so far to *acc (NULL: the
   * backend keeps no counters). Thread-safe (relaxed reads). */
  void (*counters)(const ddp__backend *b, ddp_comm_counters *acc);
  /* Makes a running op return promptly; thread-safe; idempotent. */
  void (*abort)(ddp__backend *b);
  /* Releases everything (after abort or when idle). */
  void (*destroy)(ddp__backend *b);
} ddp__backend_ops;

struct ddp__backend {
  const ddp__backend_ops *ops;
};

/* What a backend constructor needs to know about its group. */
typedef struct ddp__backend_config {
  ddp_store *store;   /* the group's own namespace (a prefix store); borrowed */
  int rank;
  int size;
  /* Per rank (size entries): host index (ranks with equal values share a
   * host) and process index (equal values: threads of one process). */
  const int32_t *host_of;
  const int32_t *process_of;
  const char *const *host_names; /* per rank, for messages */
  int64_t timeout_ns;            /* for connecting */
  bool force_tcp;
  /* tcp: leave pairs on one host (equal host_of) unconnected (hier.c). */
  bool skip_colocated;
  /* When the backend serves part of a larger group (hier.c's per-host local
   * backend): the group rank of each of its ranks (size entries), and the
   * group's size and host names (borrowed; they outlive the backend), so
   * messages and blame name group ranks. NULL / 0: the backend is the group. */
  const int *group_ranks;
  int group_size;
  const char *const *group_host_names;
} ddp__backend_config;

ddp_status ddp__backend_self_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_local_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_tcp_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_hier_create(const ddp__backend_config *cfg, ddp__backend **out);

/* ---- Reduction kernels (src/comm/reduce.c), shared by every backend ----- */

/* dst[i] = dst[i] op src[i] for count elements. float16 / bfloat16 compute
 * in float32 and round once when stored. AVG reduces as SUM (the caller
 * finishes with ddp__reduce_scale). */
void ddp__reduce_into(void *dst, const void *src, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op);
/* dst[i] = a[i] op b[i] (out of place; dst may alias a or b). */
void ddp__reduce_pair(void *dst, const void *a, const void *b, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op);
/* For AVG: dst[i] /= divisor (floating types). */
void ddp__reduce_scale(void *dst, size_t count, ddp_dtype dtype, int divisor);

#endif /* DDP__COMM_BACKEND_H */
