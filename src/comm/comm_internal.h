/* Internals of the process-group layer shared by its files: the group
 * object, the description of one queued operation, the queue and progress
 * thread (work.c), sticky errors (group.c), running one op against the
 * backend (collectives.c) and debug fingerprints (debug.c). Not installed. */
#ifndef DDP__COMM_INTERNAL_H
#define DDP__COMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "comm/backend.h"
#include "comm/bias.h"
#include "comm/op.h"
#include "ddp/comm.h"

typedef struct ddp__flight ddp__flight; /* flight.h */

/* A batch of point-to-point requests on the lane (p2p_lane.c), kept with
 * its work handle and reused with it: reqs grows to the largest batch the
 * handle carried and is freed with the group. */
typedef struct ddp__p2p_batch {
  struct ddp__p2p_batch *next; /* the lane's pending list */
  ddp_work *work;
  ddp__p2p_req *reqs;          /* (cap) */
  ddp__op_args *args;          /* (cap) each request's flight record and number */
  int n, cap;
  bool done;                   /* finished or failed (under pg->p2p_mu) */
  int64_t deadline_ns;
  const char *name;            /* "batch_isend_irecv", "isend", ... */
} ddp__p2p_batch;

struct ddp_work {
  ddp_process_group *pg;
  ddp__p2p_batch *batch; /* point-to-point lane handles; NULL until first used so */
  ddp_work *next;   /* queue or free-list link */
  ddp__op_args args;
  ddp_status status;
  bool done;        /* under pg->mu */
  bool queued;      /* in the queue, not yet taken by the progress thread */
  bool orphaned;    /* freed by its owner before it finished: recycled on completion */
  ddp_work *all_next; /* every work of the group, for destroy */
  /* A DDP__OP_P2P_BATCH's copy of the caller's operations (args.batch
   * points here): grown to the largest batch the handle carried, freed
   * with the group, so a pipeline posting the same batches allocates
   * nothing after the first. */
  ddp_p2p_op *p2p_ops;
  size_t p2p_ops_cap;
  /* While the progress thread runs it: its context and its completion in
   * the backend (backend.h), which stay here until it completes. */
  ddp__op_ctx ctx;
  ddp__completion completion;
};

struct ddp_process_group {
  int rank;
  int size;
  ddp_store *store;        /* this group's namespace (a prefix store); owned */
  ddp__backend *backend;
  /* The backend for host buffers: `backend` itself, or, where staged.c
   * wraps ddp's own backend for CUDA buffers, the wrapped one, so an op on
   * host memory keeps the inline path (no wrapper, no indirect call) on a
   * machine with a GPU as on one without. Borrowed from `backend`. */
  ddp__backend *host_backend;
  int32_t *host_of;        /* (size) */
  int32_t *process_of;     /* (size) */
  char **host_names;       /* (size) strings in one block with the pointers */
  int64_t timeout_ns;      /* default per-operation timeout */
  bool force_tcp;          /* options.transport "tcp"; subgroups inherit it */
  ddp__backend_kind backend_kind; /* options.backend; subgroups inherit it */
  bool debug_detail;       /* DDP_DEBUG=detail: fingerprints checked */
  ddp_rendezvous_info *rdzv; /* ddp_init_process_group's; destroyed last */
  /* What the group's maker keeps alive with it (the MPI backend's bootstrap
   * store and its server), released after everything else; NULL: none. */
  void *owned;
  void (*owned_release)(void *owned);
  /* Its namespace in the user's store ("pg/1/", "pg/1/sub/2/c0/"), the same
   * on every rank: how dumps of one group are matched across ranks. */
  char name[128];
  ddp__flight *flight;     /* the flight recorder's ring; NULL when off */

  atomic_bool aborted;
  /* Sticky error: set once under err_mu, then read lock-free after `failed`. */
  pthread_mutex_t err_mu;
  atomic_bool failed;
  ddp_status err_status;
  char err_msg[1024];

  /* Queue and progress thread (work.c). */
  pthread_mutex_t mu;
  pthread_cond_t work_cv;  /* the progress thread waits for work / the executor */
  pthread_cond_t done_cv;  /* waiters wait for completions */
  ddp_work *head, *tail;   /* queued, in submission order */
  /* Started on the backend by the progress thread and not yet completed,
   * oldest first (at most the backend's caps.max_in_flight); only the
   * progress thread touches them. */
  ddp_work *inflight_head, *inflight_tail;
  int inflight;
  /* Queued + running operations, plus DDP__INLINE_BIT while a blocking call
   * runs inline: a blocking call may run inline only by swapping 0 for the
   * bit (no lock on that path); the progress thread runs nothing while the
   * bit is set. */
  atomic_uint_fast64_t active;
  atomic_int drainers;     /* threads waiting for active to reach 0 */
  /* While biased, one thread's blocking calls run inline without touching
   * `active`; anything else revokes the bias before it touches `active`
   * (bias.h: why that excludes). */
  ddp__bias bias;
  bool stopping;
  bool thread_started;
  pthread_t thread;
  ddp_work *free_works;    /* pool */
  ddp_work *all_works;     /* every work allocated (all_next) */
  /* Operations executed so far; only the executing thread touches them
   * (one at a time), so numbers follow execution order = submission order. */
  uint64_t next_seq;       /* collectives */
  uint64_t next_p2p_seq;
  /* The point-to-point lane (p2p_lane.c): batches pending in submission
   * order (under p2p_mu). One thread at a time drives the lane (holds
   * p2p_driver, taken and given back under p2p_mu): a thread waiting for
   * its batch, or the lane thread when nobody waits. Only the driver
   * touches the batches' requests, p2p_run, p2p_active and the backend's
   * lane state. */
  pthread_mutex_t p2p_mu;
  pthread_cond_t p2p_cv;   /* batches finished, the driver let go, new batches */
  ddp__p2p_batch *p2p_head, *p2p_tail; /* submitted, not yet taken by a driver */
  int p2p_outstanding;     /* submitted and not finished (under p2p_mu) */
  int p2p_driver;          /* DDP__P2P_NOBODY / _LANE / _CALLER (under p2p_mu) */
  int p2p_waiters;         /* callers waiting for the driver to let go (under p2p_mu) */
  bool p2p_started, p2p_stopping;
  pthread_t p2p_thread;
  ddp__p2p_batch *p2p_run; /* driver only: the batches it progresses */
  ddp__p2p_req **p2p_active; /* driver only: pointers handed to the backend */
  int p2p_active_cap;
  uint64_t subgroups;      /* subgroups created from this group (ids) */
  /* ddp_process_group_host_group's companion on ddp's own backend (NULL
   * until asked for, and for groups whose backend takes host memory); owned. */
  struct ddp_process_group *host_group;
  uint64_t monitored_barriers;
  /* A blocking call run inline (one at a time: DDP__INLINE_BIT) keeps its
   * op's context and completion here; last, so that the fields every call
   * touches above stay on the lines they shared before. */
  /* The direct path of a blocking allreduce (collectives.c), set when the
   * group is made: the host backend's allreduce_direct (NULL: none, or
   * DDP_DEBUG=detail, whose fingerprint check the direct path skips); per
   * dtype, the most elements it takes (0: none: the caps refuse the dtype)
   * and the reduce ops it takes (the caps', less AVG on integers); whether
   * a buffer's device must be asked (the process sees a GPU). */
  ddp_status (*direct_allreduce)(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op);
  size_t direct_count[DDP_DTYPE_COUNT];
  uint32_t direct_rops[DDP_DTYPE_COUNT];
  bool direct_ask_device;
  ddp__op_ctx inline_ctx;
  ddp__completion inline_completion;
};

/* ---- group.c -------------------------------------------------------------- */
/* Records the group's first failure (status + the calling thread's last
 * error); later calls keep the first. */
void ddp__group_fail(ddp_process_group *pg, ddp_status status, const char *msg);
/* When the group has failed: sets the calling thread's last error to the
 * sticky message and returns the sticky status; else DDP_OK. */
ddp_status ddp__group_check(ddp_process_group *pg);

/* Test hook: when set, groups of more than one rank are built on this
 * backend instead of the one chosen from the ranks' identities (the tests of
 * the asynchronous interface use an engine of their own). NULL otherwise. */
extern ddp__backend_create_fn ddp__backend_override;
/* Tests: answers in place of ddp_pointer_device, so that the CPU can play
 * buffers on a GPU (NULL: ask the tensor layer). Set before groups run. */
extern ddp_device (*ddp__pointer_device_hook)(const void *ptr);
/* The device of an operation's buffers (ddp__op_device_pick over
 * ddp_pointer_device, or the hook). */
ddp_status ddp__buffers_device(const char *call, const void *send, const void *buf,
                               ddp_device *out);


/* ---- work.c --------------------------------------------------------------- */
ddp_status ddp__queue_init(ddp_process_group *pg);
/* Waits (bounded) for queued work, stops the progress thread, frees the pool. */
void ddp__queue_destroy(ddp_process_group *pg);
#define DDP__INLINE_BIT (UINT64_C(1) << 62)
/* Drops the inline bit a blocking call run on its caller took (a
 * compare-and-swap of pg->active from 0), waking the progress thread and
 * any drainer when work was queued meanwhile or someone waits for idle. */
void ddp__inline_release(ddp_process_group *pg);

/* Runs `args` in submission order: inline when nothing is queued or running
 * and `work` is NULL (blocking call); otherwise queued. With work != NULL,
 * *work receives the handle (async). args->device: left at the CPU (the
 * zero value), it is found from the buffers' pointers (ddp__buffers_device,
 * which refuses buffers on two devices); another device is taken as given. */
ddp_status ddp__submit(ddp_process_group *pg, ddp__op_args *args, ddp_work **work);
/* batch_isend_irecv's device rule for ops[i] on `device` (ops[0]'s is
 * `first`): a backend that runs batches on its lane (engine false) takes
 * host memory only (DDP_ERR_UNSUPPORTED, saying what to do); an engine that
 * groups batches (NCCL) takes one device per batch (DDP_ERR_INVALID naming
 * both). Pure: tested on the CPU with made-up devices. */
ddp_status ddp__p2p_batch_device_check(const char *call, size_t i, ddp_device first,
                                       ddp_device device, bool engine, const char *backend);
/* Waits until every operation submitted so far has finished (bounded). */
ddp_status ddp__queue_drain(ddp_process_group *pg);
/* Fails every queued (not running) work with the sticky error and wakes
 * every waiter. */
void ddp__queue_fail_all(ddp_process_group *pg);

/* A handle from the pool, not queued (the lane's); under no lock. NULL on
 * allocation failure (with the error set). */
ddp_work *ddp__work_take(ddp_process_group *pg);
/* Marks a handle taken with ddp__work_take finished and wakes its waiters. */
void ddp__work_complete(ddp_process_group *pg, ddp_work *w, ddp_status status);

/* ---- p2p_lane.c ----------------------------------------------------------- */
ddp_status ddp__p2p_lane_init(ddp_process_group *pg);
/* Waits (bounded) for pending batches, then stops the lane's thread. */
void ddp__p2p_lane_destroy(ddp_process_group *pg);
/* Wakes the lane (abort): it fails what is pending with the sticky error. */
void ddp__p2p_lane_wake(ddp_process_group *pg);
/* Who drives the lane (pg->p2p_driver). */
enum { DDP__P2P_NOBODY = 0, DDP__P2P_LANE = 1, DDP__P2P_CALLER = 2 };
/* ddp_work_wait's first step for a handle of the lane: the waiting thread
 * drives the lane itself (when nobody else does) until w's batch finishes
 * or deadline_ns (ddp_time_ns) passes, so that a completion reaches it
 * without a hand-off between threads. Returns at once for any other handle
 * (a collective's, or one already finished). The caller then collects the
 * status as for any handle. */
void ddp__p2p_wait(ddp_work *w, int64_t deadline_ns);
/* Submits ops[0..n) (checked by the caller; copied) as one handle on the
 * lane; blocking when work is NULL (waits for completion and returns its
 * status). `name` is the call's, for messages. */
ddp_status ddp__p2p_submit(ddp_process_group *pg, const char *name, const ddp_p2p_op *ops,
                           size_t n, ddp_work **work);

/* ---- execute.c: one operation on the backend ---------------------------- */
/* Refuses what the group's backend does not declare in its caps (the
 * operation, dtype, reduce op or device) with DDP_ERR_UNSUPPORTED naming the
 * backend; `call` names the user's call in the message. */
ddp_status ddp__caps_check(const ddp_process_group *pg, const char *call, ddp__op_kind kind,
                           ddp_dtype dtype, ddp_reduce_op rop, ddp_device device);
/* The check's fast path, without a message: true when the caps allow the
 * operation (every call of a blocking collective passes here). */
static inline bool ddp__caps_allow(const ddp__backend_caps *c, ddp__op_kind kind, ddp_dtype dtype,
                                   ddp_reduce_op rop, ddp_device device) {
  return (c->ops >> kind & 1u) && (kind == DDP__OP_BARRIER || (c->dtypes >> dtype & 1u)) &&
         (!ddp__op_reduces(kind) || (c->reduce_ops >> rop & 1u)) &&
         (kind == DDP__OP_BARRIER || /* no buffer: any backend meets the ranks */
          ((unsigned)device.type < DDP_DEVICE_TYPE_COUNT && (c->devices >> device.type & 1u)));
}
/* Resets what a completion must start with (not done, DDP_OK, no message);
 * the backend's state is its enqueue's to set. */
void ddp__completion_reset(ddp__completion *c);
/* Starts one operation: numbers it in args->seq, checks the sticky error,
 * fills *ctx, records the start, runs the debug check, enqueues it on the
 * backend with completion c (ctx and c stay where they are until
 * ddp__op_finish). On failure the op is over (recorded, sticky). Called by
 * one thread at a time per group, in submission order. caller_blocked: the
 * op runs inline on the thread that waits for it (ddp__op_ctx). */
ddp_status ddp__op_start(ddp_process_group *pg, ddp__op_args *args, bool caller_blocked,
                         ddp__op_ctx *ctx, ddp__completion *c);
/* Completes a started op (the backend's wait, or polling its test, bounded
 * by ctx's deadline and the abort flag), records its end, and makes a
 * failure the group's sticky error (a timeout also aborts the backend). */
ddp_status ddp__op_finish(ddp_process_group *pg, ddp__op_args *args, const ddp__op_ctx *ctx,
                          ddp__completion *c);
/* ddp__op_start, then ddp__op_finish, on this thread. */
ddp_status ddp__op_execute(ddp_process_group *pg, ddp__op_args *args, bool caller_blocked,
                           ddp__op_ctx *ctx, ddp__completion *c);
/* Runs args on backend b outside the group's numbering (the debug check's
 * own allgather): enqueue, then complete; a timeout or abort aborts b. */
ddp_status ddp__backend_run(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *args,
                            ddp__completion *c);
/* Waits for an enqueued c on b (wait or polling test, bounded by ctx);
 * DDP_OK when c is done and succeeded, else its failure as the last error. */
ddp_status ddp__backend_complete(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c);

/* ---- debug.c -------------------------------------------------------------- */
/* DDP_DEBUG=detail: exchanges this collective's fingerprint and fails with a
 * message naming the diverging rank when ranks disagree. */
ddp_status ddp__debug_check(ddp_process_group *pg, const ddp__op_args *args,
                            const ddp__op_ctx *ctx);

/* ---- Argument checks shared by collectives.c and p2p.c ----------------- */

/* The call's name for messages: "allreduce", or "allreduce_async" when async. */
typedef struct ddp__call {
  const char *name;
  bool async;
} ddp__call;

#define DDP__CALL_NAME_BYTES 40
const char *ddp__call_name(const ddp__call *c, char *buf);
/* pg, its sticky error, the work pointer (async calls), dtype, and that
 * blocks * count elements fit in size_t bytes. Clears *work first. */
ddp_status ddp__check_common(ddp_process_group *pg, const ddp__call *c, ddp_dtype dtype,
                             size_t count, size_t blocks, ddp_work **work);
/* `what` may be NULL only with count 0. */
ddp_status ddp__check_buf(const ddp__call *c, const char *what, const void *p, size_t count);

#endif /* DDP__COMM_INTERNAL_H */
