/* The engine's objects: the agent, its connections, futures and the pool's
 * tasks. Shared by agent.c (init, shutdown), conn.c (frames, readers),
 * thread_pool.c (threads, timer), call.c (calls, serving) and future.c. */
#ifndef DDP_RPC_ENGINE_H
#define DDP_RPC_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "rpc/rpc_internal.h"

typedef enum {
  DDP__RPC_LINK_SELF = 0,
  DDP__RPC_LINK_UNIX = 1,
  DDP__RPC_LINK_TCP = 2,
} ddp__rpc_link;

typedef enum {
  DDP__RPC_CONN_OPEN = 0,
  DDP__RPC_CONN_LEFT = 1,   /* the worker said BYE (graceful), then closed; or this
                             * worker is stopping */
  DDP__RPC_CONN_FAILED = 2, /* closed without a graceful BYE (a death, an abrupt
                             * shutdown), or a broken stream */
} ddp__rpc_conn_state;

/* What the worker at the other end said about its own ending (DDP__RPC_BYE). */
typedef enum {
  DDP__RPC_BYE_NONE = 0,
  DDP__RPC_BYE_ABRUPT = 1,   /* ddp_rpc_shutdown(graceful = false) */
  DDP__RPC_BYE_GRACEFUL = 2, /* a graceful shutdown, every DONE exchanged */
} ddp__rpc_bye;

/* A connection to one worker (both directions). */
typedef struct ddp__rpc_conn {
  struct ddp_rpc_agent *agent;
  int32_t rank;
  ddp__rpc_link link;
  int fd;                       /* -1 for self */
  pthread_mutex_t write_mu;     /* one frame at a time */
  struct ddp__rpc_conn *handoff_next; /* in the agent's list of roles to take */
  /* Cross-memory attach (Unix links whose peer can read this process's
   * memory): large tensors are not written to the socket; the peer reads
   * them from here (process_vm_readv, one copy) and acknowledges each such
   * frame in order (PULLED), after which the sender may reuse the memory. */
  atomic_bool peer_pulls;       /* the peer can read our memory */
  int32_t peer_pid;
  uint64_t cma_sent;            /* frames sent for pulling (under write_mu) */
  uint64_t cma_pulled;          /* acknowledged by the peer (under agent->mu) */
  uint64_t cma_received;        /* frames pulled from the peer (reader only) */
  /* Acknowledgements: the reader never waits for the write lock (a reader
   * waiting for a writer stuck on a full socket, while the peer's reader
   * waits for the peer's writer stuck on ours, would be a cycle). It posts
   * the count in ack_due and sends it only if the lock is free; otherwise
   * the lock's holder sends it before letting go. */
  _Atomic uint64_t ack_due;     /* PULLED count to send */
  _Atomic uint64_t ack_sent;    /* PULLED count sent (written under write_mu) */
  pthread_cond_t pulled_cv;     /* cma_pulled grew or the conn ended (agent->mu) */
  /* Replies sent for pulling whose memory is released when the peer has
   * read it (under agent->mu), so the serving thread need not wait. */
  struct ddp__rpc_held *held_head, *held_tail;
  /* Under agent->mu: */
  ddp__rpc_conn_state state;
  bool done_received;           /* DONE arrived (graceful shutdown) */
  ddp__rpc_bye bye;             /* BYE arrived: the close that follows is no death */
  char error[320];              /* why FAILED / LEFT */
  /* The reader's buffer (the thread holding the reader role only). */
  char *rbuf;
  size_t rpos, rlen;
} ddp__rpc_conn;

/* A pool task: an inbound request, or a future's callbacks to run. */
typedef struct ddp__rpc_task {
  struct ddp__rpc_task *next;
  int kind; /* TASK_REQUEST, TASK_CALLBACKS */
} ddp__rpc_task;
enum { DDP__RPC_TASK_REQUEST = 1, DDP__RPC_TASK_CALLBACKS = 2 };

/* An inbound request: kept in its block's extra bytes. */
struct ddp_rpc_call {
  ddp__rpc_task task;
  struct ddp_rpc_agent *agent;
  ddp__rpc_block *block;    /* the args; NULL once taken */
  int32_t from;             /* caller's rank */
  uint64_t call_id;
  int64_t deadline_ns;
  bool deferred;
  char fn[DDP_RPC_MAX_NAME_BYTES];
};

struct ddp_rpc_reply {
  struct ddp_rpc_agent *agent;
  int32_t to;
  uint64_t call_id;
  char fn[DDP_RPC_MAX_NAME_BYTES];
};

typedef struct ddp__rpc_callback {
  struct ddp__rpc_callback *next;
  ddp_rpc_future_callback cb;
  void *user;
} ddp__rpc_callback;

struct ddp_rpc_future {
  _Atomic int refs;
  struct ddp_rpc_agent *agent;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  _Atomic bool done;
  ddp_status status;
  char *error;                  /* ddp_alloc'd, "" when ok */
  ddp_rpc_message result;
  bool has_result;
  ddp__rpc_callback *callbacks; /* under mu; run in order */
  ddp__rpc_task cb_task;        /* queues the callbacks on the pool */
  /* A pending call (under agent->mu while in the table): */
  bool is_call;
  bool in_table;
  struct ddp_rpc_future *hnext;
  uint64_t call_id;
  int32_t to;
  int64_t deadline_ns;
  double timeout_s;
  char fn[DDP_RPC_MAX_NAME_BYTES];
};

#define DDP__RPC_PENDING_BUCKETS 256

typedef enum {
  DDP__RPC_RUNNING = 0,
  DDP__RPC_DRAINING = 1, /* graceful shutdown: serving, no new calls from this worker's user */
  DDP__RPC_STOPPING = 2, /* pool and readers stopping */
} ddp__rpc_agent_state;

struct ddp_rpc_agent {
  ddp_rpc_worker_info *workers; /* [world] */
  ddp__rpc_conn *conns;         /* [world]; conns[rank] is self */
  int32_t world;
  int32_t rank;
  int64_t default_timeout_ns;
  ddp_store *store;
  ddp_rendezvous_info rdzv;     /* when init ran a rendezvous */
  bool have_rdzv;

  pthread_mutex_t mu;
  pthread_cond_t work_cv;       /* pool: tasks, stop; helpers: futures completing */
  ddp__rpc_task *queue_head, *queue_tail;
  int helpers;                  /* pool threads waiting in a helping wait */
  ddp__rpc_agent_state state;
  /* The threads: num_threads for handlers plus one per connection, all
   * alike: each either holds a connection's reader role or serves the
   * queue. A reader that reads a request hands its role to an idle thread
   * and runs the handler itself (no wake-up between reading a request and
   * serving it); with no idle thread it queues the request instead. */
  pthread_t *threads;
  int num_threads;              /* for handlers (options.num_threads) */
  int threads_started;
  int idle;                     /* threads waiting in the pool for work */
  int handoffs;                 /* roles waiting for an idle thread */
  struct ddp__rpc_conn *handoff_head, *handoff_tail;

  /* Pending calls by id. */
  uint64_t next_call_id;
  struct ddp_rpc_future *pending[DDP__RPC_PENDING_BUCKETS];
  int64_t outstanding;          /* calls in the table */
  pthread_cond_t outstanding_cv;/* outstanding dropped, a DONE arrived, a conn failed */

  /* The timer failing calls past their deadline. */
  pthread_t timer;
  bool timer_started;
  pthread_cond_t timer_cv;
  int64_t timer_wake_ns;        /* when the timer will look next; INT64_MAX: idle */

  void *module_state[DDP__RPC_MAX_MODULES];
  /* Threads outside the pool inside an engine call that touches the agent
   * (a deferred reply sent from a thread of the user's): the agent's end
   * waits for them, since the reply it sends may be what let the other
   * workers finish their shutdown. */
  _Atomic int outside_users;
};

/* ---- conn.c ---- */
/* Writes one frame (header, fn, the message's descriptors, payload, tensor
 * data, straight from their memory) under the connection's write lock,
 * giving up at deadline_ns (the connection is then failed: half a frame
 * cannot be taken back). */
ddp_status ddp__rpc_send_frame(ddp__rpc_conn *c, uint8_t kind, uint64_t call_id,
                               ddp_status status, const char *fn, int64_t timeout_ms,
                               const ddp_rpc_message *msg, int64_t deadline_ns);
/* The same; with pull_seq non-NULL, a frame sent for pulling returns at once
 * with its sequence number in *pull_seq (0: not sent for pulling), and the
 * caller must ddp__rpc_wait_pulled before reusing the message's memory. */
ddp_status ddp__rpc_send_frame_ex(ddp__rpc_conn *c, uint8_t kind, uint64_t call_id,
                                  ddp_status status, const char *fn, int64_t timeout_ms,
                                  const ddp_rpc_message *msg, int64_t deadline_ns,
                                  uint64_t *pull_seq);
/* Takes msg (released) and block (freed; may be NULL) and keeps them until
 * the peer has read frame `seq`, then frees them (at once if it has). */
void ddp__rpc_hold_until_pulled(ddp__rpc_conn *c, uint64_t seq, ddp_rpc_message *msg,
                                ddp__rpc_block *block);
/* Frees what c still holds (the agent's end). */
void ddp__rpc_release_held(ddp__rpc_conn *c);
/* Waits until the peer has read frame `seq` (0: returns at once); past the
 * deadline the connection is failed (the peer could read reused memory). */
ddp_status ddp__rpc_wait_pulled(ddp__rpc_conn *c, uint64_t seq, int64_t deadline_ns);
/* Holds c's reader role on the calling thread: reads frames until it
 * hands the role on to serve a request itself (returns true, after serving)
 * or the connection ends (false). */
bool ddp__rpc_read_loop(ddp__rpc_conn *c);
/* Allocates c's read buffer (before its first read loop). */
ddp_status ddp__rpc_conn_prepare(ddp__rpc_conn *c);
/* Marks c failed (or left, when the worker's graceful BYE came first or
 * this worker is stopping) with the reason, fails its pending calls with
 * it, and, when it failed, calls the modules' worker_failed. Takes
 * agent->mu itself. */
void ddp__rpc_conn_lost(ddp__rpc_conn *c, const char *why);
/* Tells the worker at the other end of c that this one is closing on
 * purpose (DDP__RPC_BYE), so that it reports a shutdown, not a death. Best
 * effort and bounded: skipped when another thread holds the write lock
 * past ~100 ms (the peer then reports the close as a death). */
void ddp__rpc_send_bye(ddp__rpc_conn *c, bool graceful);
/* "worker 'ps' (rank 0)" into buf. */
const char *ddp__rpc_worker_str(const struct ddp_rpc_agent *a, int32_t rank, char *buf,
                                size_t bytes);

/* ---- thread_pool.c ---- */
/* Starts the threads (one reader per connection, num_threads more) and the timer. */
ddp_status ddp__rpc_pool_start(struct ddp_rpc_agent *a);
/* Under a->mu: whether an idle thread can take a reader role now; if so,
 * queues c's role for it. */
bool ddp__rpc_handoff_locked(struct ddp_rpc_agent *a, ddp__rpc_conn *c);
/* Stops the threads (after the queue drains; the caller has shut the
 * sockets down) and the timer; joins them. */
void ddp__rpc_pool_stop(struct ddp_rpc_agent *a);
/* Under a->mu: appends a task and wakes a thread. */
void ddp__rpc_enqueue_locked(struct ddp_rpc_agent *a, ddp__rpc_task *t);
void ddp__rpc_enqueue(struct ddp_rpc_agent *a, ddp__rpc_task *t);
/* Under a->mu: the timer must look at deadline_ns at the latest. */
void ddp__rpc_timer_note_locked(struct ddp_rpc_agent *a, int64_t deadline_ns);
/* Runs one task (on a pool thread, or a helping waiter). */
void ddp__rpc_run_task(struct ddp_rpc_agent *a, ddp__rpc_task *t);
/* Under a->mu: pops the queue's first task and runs it with a->mu released
 * (held again on return); false when the queue was empty. The one way a
 * pool thread and a helping waiter take work. */
bool ddp__rpc_run_queued_locked(struct ddp_rpc_agent *a);

/* ---- call.c ---- */
/* Serves an inbound request (runs the handler, sends the reply). */
void ddp__rpc_serve(struct ddp_rpc_agent *a, struct ddp_rpc_call *call);
/* The reader's side of a REPLY / ERROR: completes the pending call with
 * that id (block taken; dropped when no call waits for it). */
void ddp__rpc_deliver(struct ddp_rpc_agent *a, int32_t from, uint64_t call_id, ddp_status status,
                      ddp__rpc_block *block);
/* Under a->mu: removes a pending call from the table (false if not there). */
bool ddp__rpc_pending_remove_locked(struct ddp_rpc_agent *a, struct ddp_rpc_future *f);

/* ---- future.c ---- */
ddp_status ddp__rpc_future_new(struct ddp_rpc_agent *a, ddp_rpc_future **out);
ddp_rpc_future *ddp__rpc_future_ref(ddp_rpc_future *f);
/* Completes f once (later completions release `result` and return false):
 * with result (taken; may be NULL for an error) or an error message. Wakes
 * waiters and helpers, queues the callbacks. */
bool ddp__rpc_future_finish(ddp_rpc_future *f, ddp_status status, ddp_rpc_message *result,
                            const char *error);
/* Runs a completed future's callbacks in order, then drops the reference
 * finish took for them (a pool task). */
void ddp__rpc_future_run_callbacks(ddp_rpc_future *f);

#endif /* DDP_RPC_ENGINE_H */
