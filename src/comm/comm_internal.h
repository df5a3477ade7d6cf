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
#include "ddp/comm.h"

typedef struct ddp__flight ddp__flight; /* flight.h */

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
  DDP__OP_KIND_COUNT
} ddp__op_kind;

/* "allreduce", "send", ... */
const char *ddp__op_kind_name(ddp__op_kind kind);
/* Collectives (every rank takes part) versus point-to-point. */
static inline bool ddp__op_is_collective(ddp__op_kind kind) {
  return kind != DDP__OP_SEND && kind != DDP__OP_RECV;
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
  uint64_t seq;     /* collectives: the group's collective number; p2p: own counter */
  uint64_t flight;  /* its flight recorder record's id + 1; 0: none yet (flight.h) */
} ddp__op_args;

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
};

struct ddp_process_group {
  int rank;
  int size;
  ddp_store *store;        /* this group's namespace (a prefix store); owned */
  ddp__backend *backend;
  int32_t *host_of;        /* (size) */
  int32_t *process_of;     /* (size) */
  char **host_names;       /* (size) strings in one block with the pointers */
  int64_t timeout_ns;      /* default per-operation timeout */
  bool force_tcp;          /* options.transport "tcp"; subgroups inherit it */
  bool debug_detail;       /* DDP_DEBUG=detail: fingerprints checked */
  ddp_rendezvous_info *rdzv; /* ddp_init_process_group's; destroyed last */
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
  /* Queued + running operations, plus DDP__INLINE_BIT while a blocking call
   * runs inline: a blocking call may run inline only by swapping 0 for the
   * bit (no lock on that path); the progress thread runs nothing while the
   * bit is set. */
  atomic_uint_fast64_t active;
  atomic_int drainers;     /* threads waiting for active to reach 0 */
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
  uint64_t monitored_barriers;
};

/* ---- group.c -------------------------------------------------------------- */
/* Records the group's first failure (status + the calling thread's last
 * error); later calls keep the first. */
void ddp__group_fail(ddp_process_group *pg, ddp_status status, const char *msg);
/* When the group has failed: sets the calling thread's last error to the
 * sticky message and returns the sticky status; else DDP_OK. */
ddp_status ddp__group_check(ddp_process_group *pg);

/* ---- work.c --------------------------------------------------------------- */
ddp_status ddp__queue_init(ddp_process_group *pg);
/* Waits (bounded) for queued work, stops the progress thread, frees the pool. */
void ddp__queue_destroy(ddp_process_group *pg);
#define DDP__INLINE_BIT (UINT64_C(1) << 62)

/* Runs `args` in submission order: inline when nothing is queued or running
 * and `work` is NULL (blocking call); otherwise queued. With work != NULL,
 * *work receives the handle (async). */
ddp_status ddp__submit(ddp_process_group *pg, ddp__op_args *args, ddp_work **work);
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

/* ---- collectives.c -------------------------------------------------------- */
/* Runs one operation on the backend on the calling thread (numbering it in
 * args->seq, debug check, backend call); on failure records the sticky
 * error. Called by one thread at a time per group. caller_blocked: the op
 * runs inline on the thread that waits for it (ddp__op_ctx). */
ddp_status ddp__op_execute(ddp_process_group *pg, ddp__op_args *args, bool caller_blocked);

/* ---- debug.c -------------------------------------------------------------- */
/* DDP_DEBUG=detail: exchanges this collective's fingerprint and fails with a
 * message naming the diverging rank when ranks disagree. */
ddp_status ddp__debug_check(ddp_process_group *pg, const ddp__op_args *args,
                            const ddp__op_ctx *ctx);
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
