/* The contract between the process-group layer (src/comm/group.c, work.c,
 * collectives.c: validation, ordering, the progress thread, timeouts, sticky
 * errors, debug fingerprints) and a backend (the algorithms and transports
 * that move bytes), in a folder of its own under src/comm/. As in gloo,
 * backends know nothing of queues or work handles.
 *
 * The interface is asynchronous, so that engines which complete later fit
 * it as well as ddp's own, which run an operation to completion on the
 * calling thread:
 *   enqueue   starts one operation (ddp__op_args: kind, buffers, count,
 *             dtype, reduce op, root, and the device the buffers are on)
 *             and fills a completion object that the group layer owns;
 *   test      polls a completion; never blocks;
 *   wait      blocks until a completion is done or the op's deadline or
 *             abort flag says stop (optional: without it the group layer
 *             polls test, spinning briefly, then sleeping 20-200 us between
 *             polls);
 *   abort     from any thread, makes every enqueued operation complete
 *             promptly (DDP_ERR_ABORTED) and every later one fail;
 *   caps      what the backend supports (operations, dtypes, reduce ops,
 *             devices, subgroups, how many operations may be in flight);
 *             the group layer refuses anything else with
 *             DDP_ERR_UNSUPPORTED naming the backend, before the backend
 *             sees it.
 * A backend whose operations run to completion on the caller (ddp's own:
 * self, local, tcp, hier) fills a ddp__blocking_ops table and uses
 * ddp__blocking_enqueue, which completes the op inside enqueue; an engine
 * with requests (MPI: MPI_Iallreduce + MPI_Test) or streams (NCCL: a kernel
 * on a stream + an event) returns from enqueue at once and completes in test
 * or wait. docs/comm.md ("The backend interface") has what a backend must and
 * may do.
 *
 * Backends (chosen per group from the ranks' identities, exchanged through
 * the group's store; docs/comm.md):
 *   local/ — every rank on one host: ranks read and reduce straight from each
 *            other's buffers. Two memory providers: "threads" (ranks are
 *            threads of one process: plain pointers) and "shm" (processes:
 *            shared-memory segments / cross-memory attach)
 *   tcp/   — otherwise: a pair (socket) per peer; pipelined segmented ring
 *            for large messages, recursive halving-doubling for small ones
 *   hier/  — ranks on several hosts, some of them co-located: per host a
 *            local backend (shared memory), and a tcp backend connecting
 *            only ranks of different hosts; collectives compose the two
 *            (local reduce -> tcp among one rank per host -> local
 *            broadcast, ...), point-to-point picks per pair
 *   self/  — a group of one: copies
 *
 * Rules every backend keeps:
 *   - Every wait checks ctx->deadline_ns (DDP_ERR_TIMEOUT, naming ctx->op and
 *     ctx->seq and the peer waited for) and ctx->aborted (DDP_ERR_ABORTED).
 *   - A peer's death is detected independently of the deadline (closed
 *     socket, lost heartbeat) within 5 s and reported as DDP_ERR_PEER with
 *     "rank R (host) died (why)" in the message.
 *   - Ops are enqueued in the same order on every rank (the group layer
 *     guarantees it), from one thread at a time, at most caps.max_in_flight
 *     of them incomplete at once; they complete in the order they were
 *     enqueued.
 *   - abort() may be called from any thread while an op runs: it must make
 *     that op return (or complete) promptly.
 *   - count == 0 is valid and completes (still synchronising where the
 *     collective implies it, e.g. barrier). */
#ifndef DDP__COMM_BACKEND_H
#define DDP__COMM_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/op.h"
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
  /* The group's flight recorder (NULL: off) and this op's record in it
   * (its a->flight: id + 1; 0 none), for a backend whose caps say
   * device_start: it marks the record started (ddp__flight_mark_started)
   * when the op starts on its device, before it completes the op. */
  struct ddp__flight *flight;
  uint64_t flight_record;
} ddp__op_ctx;

/* The first capacity of the arrays that list the lane's unfinished
 * requests (p2p_lane.c, hier.c), grown to twice the need past it: room
 * for a pipeline's usual requests in flight from the start, since how
 * many are unfinished at once depends on timing and a steady state must
 * not allocate. */
#define DDP__P2P_FIRST_CAP 64

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

/* The operations of a backend that runs each to completion on the calling
 * thread (ddp's own backends): ddp__blocking_enqueue dispatches to them, and
 * a backend that composes others (hier) calls them directly. Each returns
 * once the operation is complete on this rank, or failed. */
typedef struct ddp__blocking_ops {
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
} ddp__blocking_ops;

/* What a backend supports, declared once in its table. */
typedef struct ddp__backend_caps {
  uint32_t ops;        /* bit (1u << ddp__op_kind) per operation it runs */
  uint32_t dtypes;     /* bit (1u << ddp_dtype) */
  uint32_t reduce_ops; /* bit (1u << ddp_reduce_op) */
  uint32_t devices;    /* bit (1u << ddp_device_type): where buffers may be */
  /* Subgroups (ddp_process_group_new / _split) of a group on this backend
   * may be made; without it they are refused naming the backend. */
  bool subgroups;
  /* Operations that may be enqueued and incomplete at once (>= 1). With 1
   * the group layer completes each before it enqueues the next. */
  int max_in_flight;
  /* The backend's ops start later on a device stream (NCCL): the group
   * layer records each as enqueued (flight.h) and the backend marks it
   * started when its start event passes; otherwise an op is recorded
   * started when it is handed to the backend. */
  bool device_start;
} ddp__backend_caps;

/* Every operation of comm.h; DDP__OP_P2P_BATCH (the last kind) only where a
 * backend names it: an engine that groups a batch's sends and receives. */
#define DDP__CAPS_ALL_OPS ((1u << DDP__OP_P2P_BATCH) - 1u)
#define DDP__CAPS_ALL_DTYPES ((1u << (DDP_BFLOAT16 + 1)) - 1u)
#define DDP__CAPS_ALL_REDUCE_OPS ((1u << DDP_REDUCE_OP_COUNT) - 1u)
#define DDP__CAPS_CPU (1u << DDP_DEVICE_CPU)

/* One enqueued operation's completion: owned by the group layer (in the
 * work handle, or in the group for the blocking call it runs inline), reset
 * (not done, DDP_OK) before enqueue, and not moved until done. The backend sets status, then done
 * (release); whoever reads status first reads done (acquire). */
typedef struct ddp__completion {
  atomic_bool done;
  ddp_status status; /* valid once done; the message is the last error of
                        the thread that completed it, copied into msg */
  char msg[1024];    /* the failure's message ("" when status is DDP_OK) */
  /* The backend's own state for this operation (an MPI_Request, a CUDA
   * event, ...): not initialised before enqueue; the backend's enqueue
   * sets what it will read. */
  _Alignas(16) unsigned char state[96];
} ddp__completion;

/* Marks c done with status (and, on failure, the calling thread's last
 * error as its message). For backends; any thread. */
void ddp__completion_finish(ddp__completion *c, ddp_status status);

typedef struct ddp__backend_ops {
  const char *name; /* "local", "tcp", "hier", "self" */
  ddp__backend_caps caps;
  /* Starts `op` (its pointers stay valid until c is done; ctx likewise).
   * Returns DDP_OK once started (c may already be done) or a failure to
   * start (c untouched: the op was not enqueued). */
  ddp_status (*enqueue)(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *op,
                        ddp__completion *c);
  /* Polls c without blocking: true once done. NULL: enqueue always
   * completes (blocking backends). Called by one thread at a time. */
  bool (*test)(ddp__backend *b, ddp__completion *c);
  /* Blocks until c is done, or until ctx's deadline passes or its abort
   * flag is set (then returns DDP_ERR_TIMEOUT / DDP_ERR_ABORTED with c
   * still pending; the group layer fails the group and aborts the backend).
   * NULL: the group layer polls test. */
  ddp_status (*wait)(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c);
  /* Blocking backends: their operations (ddp__blocking_enqueue runs them). */
  const ddp__blocking_ops *blocking;
  /* The point-to-point lane (NULL: p2p goes through the op queue, one op at
   * a time, as DDP__OP_SEND / DDP__OP_RECV operations). Progresses reqs[0..n), given in posting
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
  /* Makes every enqueued op complete (DDP_ERR_ABORTED), and a blocking op
   * running on another thread return, promptly; later ops fail. Any
   * thread; idempotent. */
  void (*abort)(ddp__backend *b);
  /* Releases everything (after abort or when idle). */
  void (*destroy)(ddp__backend *b);
  /* Engines on CUDA streams (nccl): makes the compute stream of the
   * operation's device wait for c without blocking the host (PyTorch's
   * work.wait() on a GPU). DDP_ERR_STATE when c was not enqueued yet (the
   * caller then waits on the host); c's failure when it failed. NULL: the
   * caller waits on the host. */
  ddp_status (*stream_wait)(ddp__backend *b, ddp__completion *c);
  /* Optional (NULL: none; mpi only): a blocking allreduce of host memory,
   * in place, run to its end on the caller, for the group layer's direct
   * path of ddp_allreduce (collectives.c): no op record, completion or
   * work. The group layer calls it only with nothing else of the group
   * queued or running (its inline bit held), after its checks (dtype,
   * reduce op, caps, count from 1 to allreduce_direct_bytes's bytes) and
   * with ctx numbered and its deadline set; the backend keeps its own
   * timeout rule for blocking calls. A failure returns the status with the
   * message as the last error, as enqueue's. */
  ddp_status (*allreduce_direct)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op);
  /* The most bytes per rank allreduce_direct takes; asked once, when the
   * group is made (0: none). */
  size_t (*allreduce_direct_bytes)(const ddp__backend *b);
} ddp__backend_ops;

struct ddp__backend {
  const ddp__backend_ops *ops;
};

/* The engines a group can run on, by the names of options.backend
 * (docs/comm.md, "Backends"): DDP is ddp's own (self, local, tcp, hier,
 * chosen per pair); MPI and NCCL exist only in builds that found them
 * (DDP_HAVE_MPI, DDP_HAVE_NCCL). */
typedef enum ddp__backend_kind {
  DDP__BACKEND_DDP = 0,
  DDP__BACKEND_MPI,
  DDP__BACKEND_NCCL,
} ddp__backend_kind;

const char *ddp__backend_kind_name(ddp__backend_kind kind);

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
  /* tcp: leave pairs on one host (equal host_of) unconnected (hier/hier.c). */
  bool skip_colocated;
  /* When the backend serves part of a larger group (hier/hier.c's per-host local
   * backend): the group rank of each of its ranks (size entries), and the
   * group's size and host names (borrowed; they outlive the backend), so
   * messages and blame name group ranks. NULL / 0: the backend is the group. */
  const int *group_ranks;
  int group_size;
  const char *const *group_host_names;
} ddp__backend_config;

/* enqueue for a backend with a ddp__blocking_ops table: runs op to
 * completion on the calling thread and completes c with its status. */
ddp_status ddp__blocking_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *op,
                                 ddp__completion *c);

/* Every caps field of ddp's own CPU backends: all operations, dtypes and
 * reduce ops, host memory, subgroups, one op at a time. */
#define DDP__CAPS_HOST_BLOCKING                                                     \
  {.ops = DDP__CAPS_ALL_OPS, .dtypes = DDP__CAPS_ALL_DTYPES,                        \
   .reduce_ops = DDP__CAPS_ALL_REDUCE_OPS, .devices = DDP__CAPS_CPU, .subgroups = true, \
   .max_in_flight = 1}

/* A backend constructor (each backend's folder has one). */
typedef ddp_status (*ddp__backend_create_fn)(const ddp__backend_config *cfg, ddp__backend **out);

ddp_status ddp__backend_self_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_local_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_tcp_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp_status ddp__backend_hier_create(const ddp__backend_config *cfg, ddp__backend **out);
#ifdef DDP_HAVE_NCCL
/* src/comm/nccl/: CUDA buffers through NCCL (loaded at run time). */
ddp_status ddp__backend_nccl_create(const ddp__backend_config *cfg, ddp__backend **out);
#endif
#ifdef DDP_HAVE_MPI
ddp_status ddp__backend_mpi_create(const ddp__backend_config *cfg, ddp__backend **out);
/* src/comm/mpi/leaders.c: shared memory inside each host, MPI between the
 * hosts' leaders; and the rule that picks it or flat MPI for a group on
 * backend "mpi" (docs/comm.md, "MPI backend", "Hierarchy"). */
ddp_status ddp__backend_mpi_hier_create(const ddp__backend_config *cfg, ddp__backend **out);
ddp__backend_create_fn ddp__backend_mpi_choose(const ddp__backend_config *cfg);
#endif

/* The error for a backend asked for by name that this build lacks: what it
 * is and how to get it (group.c). */
ddp_status ddp__backend_absent(ddp__backend_kind kind);

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
