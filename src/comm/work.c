/* Work handles, the per-group operation queue and its progress thread.
 *
 * Operations run one at a time on the backend, in submission order. A
 * blocking call issued while nothing is queued or running runs inline on the
 * caller's thread (no hand-off); anything else is queued for the group's
 * progress thread, started on first use. Work objects come from a per-group
 * pool, so the steady state allocates nothing. Every wait is bounded: a
 * running op gives up at its own deadline (the backend's rule), so a queued
 * op finishes within (ops ahead of it + 1) timeouts. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/comm_internal.h"
#include "comm/flight/flight.h"

/* Slack added to derived bounds, for the backend to notice its deadline. */
#define SLACK_NS (5LL * 1000000000LL)

static void timespec_at(struct timespec *ts, int64_t ns) {
  ts->tv_sec = (time_t)(ns / 1000000000LL);
  ts->tv_nsec = (long)(ns % 1000000000LL);
}

/* Waits on cv until signalled or deadline; false once the deadline passed. */
static bool cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns) {
  if (ddp_time_ns() >= deadline_ns) return false;
  struct timespec ts;
  timespec_at(&ts, deadline_ns);
  pthread_cond_timedwait(cv, mu, &ts);
  return true;
}

/* The bound on waiting for a work submitted now, with `ahead` ops before it. */
static int64_t queue_deadline(const ddp_process_group *pg, size_t ahead) {
  int64_t per = pg->timeout_ns;
  int64_t total = per > (INT64_MAX - SLACK_NS) / (int64_t)(ahead + 2) ? INT64_MAX - SLACK_NS
                                                                     : per * (int64_t)(ahead + 1);
  return ddp__deadline_after(total + SLACK_NS);
}

/* ---- Pool ------------------------------------------------------------------ */

/* Every work ever allocated for the group is on pg->all_works (linked
 * through all_next), so destroy frees the ones the user never freed. Under
 * pg->mu. */
static ddp_work *work_get(ddp_process_group *pg) {
  ddp_work *w = pg->free_works;
  if (w) {
    pg->free_works = w->next;
  } else {
    w = ddp_calloc(1, sizeof *w);
    if (!w) return NULL;
    w->all_next = pg->all_works;
    pg->all_works = w;
  }
  memset(&w->args, 0, sizeof w->args);
  w->pg = pg;
  w->next = NULL;
  w->status = DDP_OK;
  w->done = false;
  w->queued = false;
  w->orphaned = false;
  return w;
}

static void work_put(ddp_process_group *pg, ddp_work *w) {
  w->next = pg->free_works;
  pg->free_works = w;
}

/* Marks w finished (under pg->mu) and recycles it if its owner let go. */
static void work_finish(ddp_process_group *pg, ddp_work *w, ddp_status status) {
  w->status = status;
  w->done = true;
  w->queued = false;
  if (w->orphaned) work_put(pg, w);
  pthread_cond_broadcast(&pg->done_cv);
}

ddp_work *ddp__work_take(ddp_process_group *pg) {
  pthread_mutex_lock(&pg->mu);
  ddp_work *w = work_get(pg);
  pthread_mutex_unlock(&pg->mu);
  if (!w) ddp_error(DDP_ERR_NOMEM, "process group (rank %d of %d): cannot allocate a work handle",
                    pg->rank, pg->size);
  return w;
}

void ddp__work_complete(ddp_process_group *pg, ddp_work *w, ddp_status status) {
  pthread_mutex_lock(&pg->mu);
  work_finish(pg, w, status);
  pthread_mutex_unlock(&pg->mu);
}

/* ---- Progress thread -------------------------------------------------------- */

static bool inline_running(ddp_process_group *pg) {
  return (atomic_load(&pg->active) & DDP__INLINE_BIT) != 0;
}

/* Starts the oldest queued work on the backend (pg->mu held; released
 * around the start). A work whose start failed, or that completed inside
 * enqueue with a backend that keeps several in flight, is finished at once;
 * the rest join the in-flight list. */
static void start_next(ddp_process_group *pg) {
  ddp_work *w = pg->head;
  pg->head = w->next;
  if (!pg->head) pg->tail = NULL;
  w->queued = false;
  w->next = NULL;
  ddp__op_args args = w->args;
  pthread_mutex_unlock(&pg->mu);
  ddp_status st = ddp__op_start(pg, &args, false, &w->ctx, &w->completion);
  pthread_mutex_lock(&pg->mu);
  w->args.seq = args.seq;
  w->args.flight = args.flight;
  if (st != DDP_OK) {
    atomic_fetch_sub(&pg->active, 1);
    work_finish(pg, w, st);
    return;
  }
  if (pg->inflight_tail)
    pg->inflight_tail->next = w;
  else
    pg->inflight_head = w;
  pg->inflight_tail = w;
  pg->inflight++;
}

/* Completes the oldest in-flight work (pg->mu held; released while it
 * waits on the backend). */
static void finish_oldest(ddp_process_group *pg) {
  ddp_work *w = pg->inflight_head;
  ddp__op_args args = w->args;
  pthread_mutex_unlock(&pg->mu);
  ddp_status st = ddp__op_finish(pg, &args, &w->ctx, &w->completion);
  pthread_mutex_lock(&pg->mu);
  pg->inflight_head = w->next;
  if (!pg->inflight_head) pg->inflight_tail = NULL;
  w->next = NULL;
  pg->inflight--;
  atomic_fetch_sub(&pg->active, 1);
  work_finish(pg, w, st);
}

/* Whether the oldest in-flight work can be finished without blocking: its
 * backend completed it, or its deadline or the group's abort means
 * ddp__op_finish gives up on it at once. Under pg->mu; test() never blocks. */
static bool oldest_finishable(ddp_process_group *pg) {
  ddp_work *w = pg->inflight_head;
  ddp__backend *b = pg->backend;
  if (atomic_load_explicit(&w->completion.done, memory_order_acquire)) return true;
  if (!b->ops->test || b->ops->test(b, &w->completion)) return true;
  return atomic_load(&pg->aborted) || ddp_time_ns() >= w->ctx.deadline_ns;
}

/* Polling an engine whose oldest op is still running, while waiting for new
 * work: from MIN, doubling to MAX (a submission wakes the thread at once). */
#define INFLIGHT_POLL_MIN_NS 20000LL
#define INFLIGHT_POLL_MAX_NS 200000LL

/* The progress thread: starts queued works in order and completes them in
 * order. With a backend that keeps one op in flight (ddp's own: enqueue
 * completes it) this is start, finish, next. With more, it starts works
 * while there is room and the oldest is not done, polls the oldest (test)
 * between new submissions, and finishes it once done, so an engine such as
 * MPI or NCCL holds several at once. A backend without test is waited on. */
static void *progress_main(void *arg) {
  ddp_process_group *pg = arg;
  int max_in_flight = pg->backend->ops->caps.max_in_flight;
  if (max_in_flight < 1) max_in_flight = 1;
  int64_t pause = INFLIGHT_POLL_MIN_NS;
  pthread_mutex_lock(&pg->mu);
  for (;;) {
    while (!pg->stopping && pg->inflight == 0 && (pg->head == NULL || inline_running(pg)))
      cond_wait_until(&pg->work_cv, &pg->mu, ddp__deadline_after(1000000000LL));
    bool can_start = pg->head != NULL && !inline_running(pg) && pg->inflight < max_in_flight;
    if (pg->inflight == 0 && !can_start) break; /* stopping, nothing left to run */
    bool finishable = pg->inflight > 0 && oldest_finishable(pg);
    if (can_start && !finishable) {
      start_next(pg);
      pause = INFLIGHT_POLL_MIN_NS;
      continue;
    }
    if (finishable) {
      finish_oldest(pg);
      pause = INFLIGHT_POLL_MIN_NS;
      continue;
    }
    /* The oldest is running and nothing can start: wait for a submission or
     * the next poll. */
    cond_wait_until(&pg->work_cv, &pg->mu, ddp__deadline_after(pause));
    pause = pause * 2 > INFLIGHT_POLL_MAX_NS ? INFLIGHT_POLL_MAX_NS : pause * 2;
  }
  pthread_mutex_unlock(&pg->mu);
  return NULL;
}

static ddp_status ensure_thread(ddp_process_group *pg) {
  if (pg->thread_started) return DDP_OK;
  int rc = pthread_create(&pg->thread, NULL, progress_main, pg);
  if (rc != 0)
    return ddp_error(DDP_ERR_SYS, "process group (rank %d of %d): cannot start the progress thread: %s",
                     pg->rank, pg->size, strerror(rc));
  char name[16];
  snprintf(name, sizeof name, "ddp-pg-r%d", pg->rank);
  pthread_setname_np(pg->thread, name);
  pg->thread_started = true;
  return DDP_OK;
}

ddp_status ddp_process_group_reserve_works(ddp_process_group *pg, int n) {
  if (!pg) return ddp_error(DDP_ERR_INVALID, "process group: reserve_works on a NULL group");
  pthread_mutex_lock(&pg->mu);
  int have = 0;
  for (ddp_work *w = pg->all_works; w; w = w->all_next) have++;
  ddp_status s = DDP_OK;
  for (; have < n; have++) {
    ddp_work *w = ddp_calloc(1, sizeof *w); /* work_get sets it up when taken */
    if (!w) {
      s = ddp_error(DDP_ERR_NOMEM, "process group: cannot reserve %d work handles", n);
      break;
    }
    w->all_next = pg->all_works;
    pg->all_works = w;
    work_put(pg, w);
  }
  pthread_mutex_unlock(&pg->mu);
  return s;
}

/* ---- Queue ------------------------------------------------------------------ */

ddp_status ddp__queue_init(ddp_process_group *pg) {
  pthread_condattr_t attr;
  if (pthread_condattr_init(&attr) != 0) return ddp_error(DDP_ERR_SYS, "process group: condattr");
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_mutex_init(&pg->mu, NULL);
  pthread_cond_init(&pg->work_cv, &attr);
  pthread_cond_init(&pg->done_cv, &attr);
  pthread_condattr_destroy(&attr);
  atomic_init(&pg->active, 0);
  atomic_init(&pg->drainers, 0);
  ddp__bias_init(&pg->bias);
  /* Two works in the pool from the start: the common steady state of a
   * training loop is one async op in flight (e.g. the loss's allreduce) while
   * a blocking one (the DDP wrapper reduces its last bucket inline) finds it
   * still running and queues behind it. Grown on demand, the pool would
   * reach that depth the first time the timing allows, possibly mid-training
   * (test_train_dp_alloc saw one allocation there under ASan). */
  ddp_work *w[2] = {NULL, NULL};
  pthread_mutex_lock(&pg->mu);
  for (int i = 0; i < 2; i++) w[i] = work_get(pg);
  for (int i = 0; i < 2; i++)
    if (w[i]) work_put(pg, w[i]);
  pthread_mutex_unlock(&pg->mu);
  if (!w[0] || !w[1]) return ddp_error(DDP_ERR_NOMEM, "process group: cannot allocate work handles");
  return DDP_OK;
}

/* The message of a failed work: the group's sticky error when there is one. */
static ddp_status work_error(ddp_process_group *pg, ddp_status status) {
  ddp_status sticky = ddp__group_check(pg);
  if (sticky != DDP_OK) return sticky;
  return ddp_error(status, "process group (rank %d of %d): operation failed: %s", pg->rank,
                   pg->size, ddp_strerror(status));
}

/* Gives up on `w` after a wait ran out: the group fails with a timeout naming
 * the op, and the running op is aborted so that nothing waits on it. */
static ddp_status wait_timed_out(ddp_process_group *pg, const ddp__op_args *args, double waited_s) {
  char msg[256];
  char num[32] = " (still queued)";
  if (args->seq) snprintf(num, sizeof num, " #%llu", (unsigned long long)args->seq);
  snprintf(msg, sizeof msg, "%s%s (rank %d of %d) did not complete within %.3g s",
           ddp__op_kind_name(args->kind), num, pg->rank, pg->size, waited_s);
  ddp__group_fail(pg, DDP_ERR_TIMEOUT, msg);
  atomic_store(&pg->aborted, true);
  if (pg->backend && pg->backend->ops->abort) pg->backend->ops->abort(pg->backend);
  ddp__queue_fail_all(pg);
  ddp__p2p_lane_wake(pg);
  return ddp__group_check(pg);
}

/* Operations ahead of a new one (queued or running). */
static size_t ops_ahead(ddp_process_group *pg) {
  uint64_t a = atomic_load(&pg->active);
  return (size_t)(a & ~DDP__INLINE_BIT) + ((a & DDP__INLINE_BIT) ? 1 : 0);
}

void ddp__inline_release(ddp_process_group *pg) {
  uint_fast64_t left = atomic_fetch_sub(&pg->active, DDP__INLINE_BIT) - DDP__INLINE_BIT;
  if (left != 0 || atomic_load(&pg->drainers) != 0) {
    /* Work was queued meanwhile (the progress thread waits for the bit to
     * clear), or someone waits for the group to go idle. */
    pthread_mutex_lock(&pg->mu);
    pthread_cond_broadcast(&pg->work_cv);
    pthread_cond_broadcast(&pg->done_cv);
    pthread_mutex_unlock(&pg->mu);
  }
}

ddp_status ddp__submit(ddp_process_group *pg, ddp__op_args *args, ddp_work **work) {
  /* The buffers' device, asked of the pointers, unless the caller (an
   * internal one) already named a device other than the CPU. */
  if (args->device.type == DDP_DEVICE_CPU)
    DDP_TRY(ddp__buffers_device(ddp__op_kind_name(args->kind), args->send, args->buf, &args->device));
  args->blocking_call = work == NULL;
  if (!ddp__caps_allow(&pg->backend->ops->caps, args->kind, args->dtype, args->reduce_op,
                       args->device)) /* the message only where refused */
    return ddp__caps_check(pg, ddp__op_kind_name(args->kind), args->kind, args->dtype,
                           args->reduce_op, args->device);
  if (!work && ddp__bias_enter(&pg->bias)) {
    /* The group is biased to this thread (bias.h): nothing else can be
     * queued or running, and nobody waits for this call to end but a
     * revoker, which polls `busy`. */
    ddp_status st = ddp__op_execute(pg, args, true, &pg->inline_ctx, &pg->inline_completion);
    ddp__bias_exit(&pg->bias);
    return st;
  }
  /* Anything else touches `active`: the bias, if any, ends first. */
  DDP_TRY(ddp__bias_revoke(&pg->bias, pg->timeout_ns));
  if (!work) {
    /* The fast path: nothing queued or running, so run here, now. */
    uint_fast64_t idle = 0;
    if (atomic_compare_exchange_strong(&pg->active, &idle, DDP__INLINE_BIT)) {
      ddp_status st = ddp__op_execute(pg, args, true, &pg->inline_ctx, &pg->inline_completion);
      ddp__inline_release(pg);
      return st;
    }
  }
  pthread_mutex_lock(&pg->mu);
  ddp_work *w = work_get(pg);
  ddp_status st = w ? ensure_thread(pg) : DDP_ERR_NOMEM;
  if (st != DDP_OK) {
    if (w) work_put(pg, w);
    pthread_mutex_unlock(&pg->mu);
    return st == DDP_ERR_NOMEM ? ddp_error(st, "%s: cannot allocate a work handle",
                                           ddp__op_kind_name(args->kind))
                               : st;
  }
  if (args->kind == DDP__OP_P2P_BATCH && args->count > 0) {
    /* The caller's array lives only through the call: the handle keeps a
     * copy (grown, never shrunk) until the op completes. */
    if (w->p2p_ops_cap < args->count) {
      ddp_p2p_op *ops = ddp_calloc(args->count, sizeof *ops);
      if (!ops) {
        work_put(pg, w);
        pthread_mutex_unlock(&pg->mu);
        return ddp_error(DDP_ERR_NOMEM, "%s: no memory for %zu operations",
                         ddp__op_kind_name(args->kind), args->count);
      }
      ddp_free(w->p2p_ops);
      w->p2p_ops = ops;
      w->p2p_ops_cap = args->count;
    }
    memcpy(w->p2p_ops, args->batch, args->count * sizeof *w->p2p_ops);
    args->batch = w->p2p_ops;
  }
  /* Recorded as scheduled now, under the mutex, so the ring keeps
   * submission order; it is numbered when it starts. */
  if (pg->flight) ddp__flight_new(pg->flight, args, DDP__FLIGHT_SCHEDULED, ddp__now_coarse_ns());
  w->args = *args;
  w->queued = true;
  size_t ahead = ops_ahead(pg);
  atomic_fetch_add(&pg->active, 1);
  if (pg->tail)
    pg->tail->next = w;
  else
    pg->head = w;
  pg->tail = w;
  pthread_cond_signal(&pg->work_cv);
  if (work) {
    *work = w;
    pthread_mutex_unlock(&pg->mu);
    return DDP_OK;
  }
  /* A blocking call behind queued work: wait for its turn and its result. */
  int64_t start = ddp_time_ns(), deadline = queue_deadline(pg, ahead);
  while (!w->done && cond_wait_until(&pg->done_cv, &pg->mu, deadline)) {
  }
  if (!w->done) {
    w->orphaned = true;
    ddp__op_args copy = w->args;
    pthread_mutex_unlock(&pg->mu);
    return wait_timed_out(pg, &copy, (double)(ddp_time_ns() - start) / 1e9);
  }
  st = w->status;
  work_put(pg, w);
  pthread_mutex_unlock(&pg->mu);
  return st == DDP_OK ? DDP_OK : work_error(pg, st);
}

ddp_status ddp__queue_drain(ddp_process_group *pg) {
  /* A biased call in progress is not counted in `active`: end the bias
   * (waiting for that call) first. */
  DDP_TRY(ddp__bias_revoke(&pg->bias, pg->timeout_ns));
  pthread_mutex_lock(&pg->mu);
  atomic_fetch_add(&pg->drainers, 1);
  int64_t deadline = queue_deadline(pg, ops_ahead(pg));
  while (atomic_load(&pg->active) != 0 && cond_wait_until(&pg->done_cv, &pg->mu, deadline)) {
  }
  bool idle = atomic_load(&pg->active) == 0;
  atomic_fetch_sub(&pg->drainers, 1);
  pthread_mutex_unlock(&pg->mu);
  if (!idle)
    return ddp_error(DDP_ERR_TIMEOUT, "process group (rank %d of %d): queued operations did not finish in time",
                     pg->rank, pg->size);
  return DDP_OK;
}

void ddp__queue_fail_all(ddp_process_group *pg) {
  pthread_mutex_lock(&pg->mu);
  ddp_status st = atomic_load(&pg->failed) ? pg->err_status : DDP_ERR_ABORTED;
  for (ddp_work *w = pg->head, *next; w; w = next) {
    next = w->next;
    w->next = NULL;
    if (pg->flight) ddp__flight_end(pg->flight, &w->args, st, ddp__now_coarse_ns());
    atomic_fetch_sub(&pg->active, 1);
    work_finish(pg, w, st);
  }
  pg->head = pg->tail = NULL;
  pthread_cond_broadcast(&pg->done_cv);
  pthread_cond_broadcast(&pg->work_cv);
  pthread_mutex_unlock(&pg->mu);
}

void ddp__queue_destroy(ddp_process_group *pg) {
  if (ddp__queue_drain(pg) != DDP_OK) {
    DDP_WARN("%s; aborting them", ddp_last_error());
    ddp_process_group_abort(pg);
    ddp__queue_drain(pg);
  }
  pthread_mutex_lock(&pg->mu);
  pg->stopping = true;
  pthread_cond_broadcast(&pg->work_cv);
  bool started = pg->thread_started;
  pthread_mutex_unlock(&pg->mu);
  if (started) pthread_join(pg->thread, NULL);
  for (ddp_work *w = pg->all_works, *next; w; w = next) {
    next = w->all_next;
    if (w->batch) {
      ddp_free(w->batch->reqs);
      ddp_free(w->batch->args);
      ddp_free(w->batch);
    }
    ddp_free(w->p2p_ops);
    ddp_free(w);
  }
  pg->all_works = NULL;
  pg->free_works = NULL;
  pthread_cond_destroy(&pg->work_cv);
  pthread_cond_destroy(&pg->done_cv);
  pthread_mutex_destroy(&pg->mu);
  ddp__bias_destroy(&pg->bias);
}

/* ---- Public work API ------------------------------------------------------- */

ddp_status ddp_work_wait(ddp_work *work, double timeout_s) {
  if (!work) return ddp_error(DDP_ERR_INVALID, "work_wait: work is NULL");
  ddp_process_group *pg = work->pg;
  /* < 0: the operation's own deadline governs (the group's timeout from when
   * it starts); the wait is bounded by the ops ahead of it, so a handle
   * queued behind others is not given up on before its turn. */
  int64_t start = ddp_time_ns();
  int64_t deadline =
      timeout_s < 0 ? queue_deadline(pg, ops_ahead(pg))
                    : ddp__deadline_after(timeout_s > 9e9 ? INT64_MAX / 2 : (int64_t)(timeout_s * 1e9));
  /* A point-to-point handle: this thread drives the lane until it is done. */
  if (work->batch) ddp__p2p_wait(work, deadline);
  pthread_mutex_lock(&pg->mu);
  while (!work->done && cond_wait_until(&pg->done_cv, &pg->mu, deadline)) {
  }
  bool done = work->done;
  ddp_status st = work->status;
  ddp__op_args args = work->args;
  pthread_mutex_unlock(&pg->mu);
  if (!done) return wait_timed_out(pg, &args, (double)(ddp_time_ns() - start) / 1e9);
  return st == DDP_OK ? DDP_OK : work_error(pg, st);
}

ddp_status ddp_work_wait_stream(ddp_work *work, double timeout_s) {
  if (!work) return ddp_error(DDP_ERR_INVALID, "work_wait_stream: work is NULL");
  ddp_process_group *pg = work->pg;
  ddp__backend *b = pg->backend;
  if (b->ops->stream_wait && !work->batch) {
    pthread_mutex_lock(&pg->mu);
    ddp_status st = DDP_ERR_STATE;
    if (work->done)
      st = work->status;
    else if (!work->queued)
      st = b->ops->stream_wait(b, &work->completion);
    pthread_mutex_unlock(&pg->mu);
    if (st == DDP_OK) return DDP_OK;
    if (st != DDP_ERR_STATE) return work_error(pg, st);
  }
  return ddp_work_wait(work, timeout_s);
}

bool ddp_work_test(ddp_work *work, ddp_status *status) {
  if (!work) {
    if (status) *status = ddp_error(DDP_ERR_INVALID, "work_test: work is NULL");
    return true;
  }
  ddp_process_group *pg = work->pg;
  pthread_mutex_lock(&pg->mu);
  bool done = work->done;
  ddp_status st = work->status;
  pthread_mutex_unlock(&pg->mu);
  if (status) *status = done && st != DDP_OK ? work_error(pg, st) : DDP_OK;
  return done;
}

void ddp_work_free(ddp_work *work) {
  if (!work) return;
  ddp_process_group *pg = work->pg;
  pthread_mutex_lock(&pg->mu);
  int64_t deadline = queue_deadline(pg, ops_ahead(pg));
  while (!work->done && cond_wait_until(&pg->done_cv, &pg->mu, deadline)) {
  }
  if (work->done)
    work_put(pg, work);
  else
    work->orphaned = true; /* the progress thread recycles it */
  pthread_mutex_unlock(&pg->mu);
}
