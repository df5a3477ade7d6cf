/* The agent's threads: one per connection holding its reader role and
 * num_threads more, all alike (a reader that reads a request hands its role
 * to an idle thread and serves the request itself), serving requests and
 * then-callbacks from one FIFO queue; and a timer failing calls past their
 * deadline. */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc/engine.h"

static _Thread_local ddp_rpc_agent *pool_agent;

ddp_rpc_agent *ddp__rpc_current_pool_agent(void) { return pool_agent; }

void ddp__rpc_enqueue_locked(ddp_rpc_agent *a, ddp__rpc_task *t) {
  t->next = NULL;
  if (a->queue_tail) a->queue_tail->next = t;
  else a->queue_head = t;
  a->queue_tail = t;
  /* Helpers wait on the same condition: wake them all so an idle thread or
   * a helper takes it (a signal could go to a helper whose own future is
   * what it waits for, and which may take the task too: either is fine). */
  if (a->helpers > 0) pthread_cond_broadcast(&a->work_cv);
  else pthread_cond_signal(&a->work_cv);
}

void ddp__rpc_enqueue(ddp_rpc_agent *a, ddp__rpc_task *t) {
  pthread_mutex_lock(&a->mu);
  ddp__rpc_enqueue_locked(a, t);
  pthread_mutex_unlock(&a->mu);
}

bool ddp__rpc_run_queued_locked(ddp_rpc_agent *a) {
  ddp__rpc_task *t = a->queue_head;
  if (!t) return false;
  a->queue_head = t->next;
  if (!a->queue_head) a->queue_tail = NULL;
  pthread_mutex_unlock(&a->mu);
  ddp__rpc_run_task(a, t);
  pthread_mutex_lock(&a->mu);
  return true;
}

void ddp__rpc_run_task(ddp_rpc_agent *a, ddp__rpc_task *t) {
  if (t->kind == DDP__RPC_TASK_REQUEST) {
    ddp__rpc_serve(a, (ddp_rpc_call *)t);
  } else {
    DDP_ASSERT(t->kind == DDP__RPC_TASK_CALLBACKS);
    ddp_rpc_future *f = (ddp_rpc_future *)((char *)t - offsetof(ddp_rpc_future, cb_task));
    ddp__rpc_future_run_callbacks(f);
  }
}

bool ddp__rpc_handoff_locked(ddp_rpc_agent *a, ddp__rpc_conn *c) {
  if (a->idle <= a->handoffs || a->state == DDP__RPC_STOPPING) return false;
  c->handoff_next = NULL;
  if (a->handoff_tail) a->handoff_tail->handoff_next = c;
  else a->handoff_head = c;
  a->handoff_tail = c;
  a->handoffs++;
  if (a->helpers > 0) pthread_cond_broadcast(&a->work_cv);
  else pthread_cond_signal(&a->work_cv);
  return true;
}

typedef struct thread_start {
  ddp_rpc_agent *agent;
  ddp__rpc_conn *conn; /* the reader role it starts with, or NULL */
} thread_start;

static void *thread_main(void *arg) {
  thread_start *ts = arg;
  ddp_rpc_agent *a = ts->agent;
  ddp__rpc_conn *role = ts->conn;
  ddp_free(ts);
  pool_agent = a;
  for (;;) {
    if (role) {
      ddp__rpc_read_loop(role);
      role = NULL;
    }
    pthread_mutex_lock(&a->mu);
    for (;;) {
      /* A reader role first: a connection nobody reads delays every reply
       * on it. */
      if (a->handoff_head) {
        role = a->handoff_head;
        a->handoff_head = role->handoff_next;
        if (!a->handoff_head) a->handoff_tail = NULL;
        a->handoffs--;
        break;
      }
      if (ddp__rpc_run_queued_locked(a)) continue;
      if (a->state == DDP__RPC_STOPPING) break;
      /* Idle: woken by a task, a role or the stop. */
      a->idle++;
      pthread_cond_wait(&a->work_cv, &a->mu);
      a->idle--;
    }
    bool stop = role == NULL;
    pthread_mutex_unlock(&a->mu);
    if (stop) return NULL;
  }
}

void ddp__rpc_timer_note_locked(ddp_rpc_agent *a, int64_t deadline_ns) {
  if (deadline_ns < a->timer_wake_ns) {
    a->timer_wake_ns = deadline_ns;
    pthread_cond_signal(&a->timer_cv);
  }
}

/* Fails every pending call whose deadline has passed; returns the earliest
 * deadline still pending (INT64_MAX: none). Under a->mu, released around the
 * completions. */
static int64_t expire_locked(ddp_rpc_agent *a) {
  for (;;) {
    int64_t now = ddp_time_ns(), next = INT64_MAX;
    ddp_rpc_future *expired = NULL;
    for (int b = 0; b < DDP__RPC_PENDING_BUCKETS && !expired; b++)
      for (ddp_rpc_future *f = a->pending[b]; f; f = f->hnext) {
        if (f->deadline_ns <= now) {
          expired = f;
          break;
        }
        if (f->deadline_ns < next) next = f->deadline_ns;
      }
    if (!expired) return next;
    ddp__rpc_pending_remove_locked(a, expired);
    pthread_mutex_unlock(&a->mu);
    char msg[512];
    snprintf(msg, sizeof msg,
             "rpc to worker '%s' (rank %d), function '%s': timed out after %.3g s (no reply; "
             "raise the call's timeout_s, or see whether the worker is stuck)",
             a->workers[expired->to].name, expired->to, expired->fn, expired->timeout_s);
    ddp__rpc_future_finish(expired, DDP_ERR_TIMEOUT, NULL, msg);
    ddp_rpc_future_destroy(expired); /* the table's reference */
    pthread_mutex_lock(&a->mu);
  }
}

static void *timer_main(void *arg) {
  ddp_rpc_agent *a = arg;
  pthread_mutex_lock(&a->mu);
  while (a->state != DDP__RPC_STOPPING) {
    int64_t next = expire_locked(a);
    if (a->state == DDP__RPC_STOPPING) break;
    /* Sleep until the earliest deadline, at most a second (a safety net:
     * every new earlier deadline signals). */
    int64_t now = ddp_time_ns();
    int64_t wake = next < now + 1000000000LL ? next : now + 1000000000LL;
    a->timer_wake_ns = next;
    struct timespec ts = {.tv_sec = (time_t)(wake / 1000000000), .tv_nsec = (long)(wake % 1000000000)};
    pthread_cond_timedwait(&a->timer_cv, &a->mu, &ts);
  }
  pthread_mutex_unlock(&a->mu);
  return NULL;
}

ddp_status ddp__rpc_pool_start(ddp_rpc_agent *a) {
  int total = a->num_threads + a->world - 1;
  a->threads = ddp_calloc((size_t)total, sizeof *a->threads);
  if (!a->threads) return ddp_error(DDP_ERR_NOMEM, "rpc: cannot allocate %d threads", total);
  for (int i = 0, r = 0; i < total; i++) {
    thread_start *ts = ddp_calloc(1, sizeof *ts);
    if (!ts) return ddp_error(DDP_ERR_NOMEM, "rpc: cannot start thread %d", i);
    ts->agent = a;
    if (r == a->rank) r++;
    if (r < a->world) ts->conn = &a->conns[r++];
    int rc = pthread_create(&a->threads[i], NULL, thread_main, ts);
    if (rc != 0) {
      ddp_free(ts);
      return ddp_error(DDP_ERR_SYS, "rpc: cannot start thread %d: %s", i, strerror(rc));
    }
    a->threads_started++;
  }
  a->timer_wake_ns = INT64_MAX;
  int rc = pthread_create(&a->timer, NULL, timer_main, a);
  if (rc != 0) return ddp_error(DDP_ERR_SYS, "rpc: cannot start the timer thread: %s", strerror(rc));
  a->timer_started = true;
  return DDP_OK;
}

void ddp__rpc_pool_stop(ddp_rpc_agent *a) {
  pthread_mutex_lock(&a->mu);
  a->state = DDP__RPC_STOPPING;
  pthread_cond_broadcast(&a->work_cv);
  pthread_cond_signal(&a->timer_cv);
  pthread_mutex_unlock(&a->mu);
  for (int i = 0; i < a->threads_started; i++) pthread_join(a->threads[i], NULL);
  a->threads_started = 0;
  if (a->timer_started) pthread_join(a->timer, NULL);
  a->timer_started = false;
}
