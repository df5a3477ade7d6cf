/* Futures: a call's result (or a user's), completed once; waits with a
 * deadline (helping the pool when the waiter is a pool thread, so nested
 * calls cannot starve it), then-callbacks run on the pool. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc/engine.h"

ddp_status ddp__rpc_future_new(ddp_rpc_agent *a, ddp_rpc_future **out) {
  ddp_rpc_future *f = ddp_calloc(1, sizeof *f);
  if (!f) return ddp_error(DDP_ERR_NOMEM, "rpc: cannot allocate a future");
  atomic_init(&f->refs, 1);
  atomic_init(&f->done, false);
  f->agent = a;
  f->status = DDP_ERR_STATE;
  pthread_mutex_init(&f->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&f->cv, &ca);
  pthread_condattr_destroy(&ca);
  f->cb_task.kind = DDP__RPC_TASK_CALLBACKS;
  *out = f;
  return DDP_OK;
}

ddp_rpc_future *ddp__rpc_future_ref(ddp_rpc_future *f) {
  atomic_fetch_add(&f->refs, 1);
  return f;
}

void ddp_rpc_future_destroy(ddp_rpc_future *f) {
  if (!f) return;
  if (atomic_fetch_sub(&f->refs, 1) != 1) return;
  ddp_rpc_message_free(&f->result);
  ddp_free(f->error);
  for (ddp__rpc_callback *c = f->callbacks, *n; c; c = n) {
    n = c->next;
    ddp_free(c);
  }
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  ddp_free(f);
}

bool ddp__rpc_future_finish(ddp_rpc_future *f, ddp_status status, ddp_rpc_message *result,
                            const char *error) {
  char *err_copy = ddp_strdup(status == DDP_OK ? "" : (error ? error : ddp_strerror(status)));
  pthread_mutex_lock(&f->mu);
  if (atomic_load(&f->done)) {
    pthread_mutex_unlock(&f->mu);
    ddp_free(err_copy);
    ddp_rpc_message_free(result);
    return false;
  }
  f->status = status;
  f->error = err_copy; /* NULL on allocation failure: reported as "" */
  if (result) {
    f->result = *result;
    f->has_result = true;
    memset(result, 0, sizeof *result);
  }
  atomic_store(&f->done, true);
  pthread_cond_broadcast(&f->cv);
  bool callbacks = f->callbacks != NULL;
  if (callbacks) ddp__rpc_future_ref(f); /* dropped after the callbacks ran */
  pthread_mutex_unlock(&f->mu);
  ddp_rpc_agent *a = f->agent;
  pthread_mutex_lock(&a->mu);
  if (callbacks) ddp__rpc_enqueue_locked(a, &f->cb_task);
  if (a->helpers > 0) pthread_cond_broadcast(&a->work_cv);
  pthread_mutex_unlock(&a->mu);
  return true;
}

void ddp__rpc_future_run_callbacks(ddp_rpc_future *f) {
  for (;;) {
    pthread_mutex_lock(&f->mu);
    ddp__rpc_callback *c = f->callbacks;
    if (c) f->callbacks = c->next;
    pthread_mutex_unlock(&f->mu);
    if (!c) break;
    c->cb(f, c->user);
    ddp_free(c);
  }
  ddp_rpc_future_destroy(f);
}

ddp_status ddp_rpc_future_then(ddp_rpc_future *f, ddp_rpc_future_callback cb, void *user) {
  if (!f || !cb) return ddp_error(DDP_ERR_INVALID, "rpc future then: NULL future or callback");
  ddp__rpc_callback *c = ddp_calloc(1, sizeof *c);
  if (!c) return ddp_error(DDP_ERR_NOMEM, "rpc future then: out of memory");
  c->cb = cb;
  c->user = user;
  pthread_mutex_lock(&f->mu);
  bool done = atomic_load(&f->done);
  if (!done) {
    ddp__rpc_callback **tail = &f->callbacks;
    while (*tail) tail = &(*tail)->next;
    *tail = c;
  }
  pthread_mutex_unlock(&f->mu);
  if (done) {
    /* Completed: at once, here (after any callbacks still queued? they were
     * added before completion and run on the pool; this one is later). */
    cb(f, user);
    ddp_free(c);
  }
  return DDP_OK;
}

bool ddp_rpc_future_done(const ddp_rpc_future *f) { return f && atomic_load(&f->done); }

ddp_status ddp_rpc_future_status(const ddp_rpc_future *f) {
  if (!f || !atomic_load(&f->done)) return DDP_ERR_STATE;
  return f->status;
}

const char *ddp_rpc_future_error(const ddp_rpc_future *f) {
  if (!f || !atomic_load(&f->done) || !f->error) return "";
  return f->error;
}

/* The status of a done future with its message as the last error. */
static ddp_status done_status(const ddp_rpc_future *f) {
  if (f->status == DDP_OK) return DDP_OK;
  return ddp_error(f->status, "%s", f->error ? f->error : ddp_strerror(f->status));
}

static int64_t deadline_after(double timeout_s) {
  if (timeout_s > 1e9) timeout_s = 1e9;
  return ddp_time_ns() + (int64_t)(timeout_s * 1e9);
}

static void abs_timespec(int64_t deadline_ns, struct timespec *ts) {
  ts->tv_sec = (time_t)(deadline_ns / 1000000000);
  ts->tv_nsec = (long)(deadline_ns % 1000000000);
}

ddp_status ddp_rpc_future_wait(ddp_rpc_future *f, double timeout_s) {
  if (!f) return ddp_error(DDP_ERR_INVALID, "rpc future wait: NULL future");
  ddp_rpc_agent *a = f->agent;
  int64_t deadline;
  if (timeout_s >= 0) deadline = deadline_after(timeout_s);
  else if (f->is_call) deadline = f->deadline_ns + 100 * 1000000LL; /* the timer fails it first */
  else deadline = ddp_time_ns() + a->default_timeout_ns;
  if (atomic_load(&f->done)) return done_status(f);
  if (ddp__rpc_current_pool_agent() == a) {
    /* A pool thread: serve queued tasks while waiting, so a pool of n
     * threads all waiting on nested calls still serves the requests those
     * calls depend on. Completions broadcast work_cv while helpers > 0. */
    pthread_mutex_lock(&a->mu);
    a->helpers++;
    while (!atomic_load(&f->done)) {
      if (ddp__rpc_run_queued_locked(a)) continue;
      if (ddp_time_ns() >= deadline) break;
      struct timespec ts;
      abs_timespec(deadline, &ts);
      pthread_cond_timedwait(&a->work_cv, &a->mu, &ts);
    }
    a->helpers--;
    pthread_mutex_unlock(&a->mu);
  } else {
    pthread_mutex_lock(&f->mu);
    while (!atomic_load(&f->done) && ddp_time_ns() < deadline) {
      struct timespec ts;
      abs_timespec(deadline, &ts);
      pthread_cond_timedwait(&f->cv, &f->mu, &ts);
    }
    pthread_mutex_unlock(&f->mu);
  }
  if (atomic_load(&f->done)) return done_status(f);
  if (f->is_call)
    return ddp_error(DDP_ERR_TIMEOUT,
                     "rpc to worker '%s' (rank %d), function '%s': the wait timed out after "
                     "%.3g s (the call is still pending)",
                     a->workers[f->to].name, f->to, f->fn, timeout_s);
  return ddp_error(DDP_ERR_TIMEOUT, "rpc future: the wait timed out after %.3g s",
                   timeout_s >= 0 ? timeout_s : (double)a->default_timeout_ns / 1e9);
}

ddp_status ddp_rpc_future_result(ddp_rpc_future *f, const ddp_rpc_message **out) {
  *out = NULL;
  if (!f || !atomic_load(&f->done))
    return ddp_error(DDP_ERR_STATE, "rpc future result: the future has not completed");
  if (f->status != DDP_OK) return done_status(f);
  if (!f->has_result)
    return ddp_error(DDP_ERR_STATE, "rpc future result: the result was taken already");
  *out = &f->result;
  return DDP_OK;
}

ddp_status ddp_rpc_future_take(ddp_rpc_future *f, ddp_rpc_message *out) {
  memset(out, 0, sizeof *out);
  const ddp_rpc_message *r;
  pthread_mutex_lock(&f->mu);
  ddp_status st = ddp_rpc_future_result(f, &r);
  if (st == DDP_OK) {
    *out = f->result;
    memset(&f->result, 0, sizeof f->result);
    f->has_result = false;
  }
  pthread_mutex_unlock(&f->mu);
  return st;
}

ddp_status ddp_rpc_future_create(ddp_rpc_agent *agent, ddp_rpc_future **out) {
  *out = NULL;
  if (!agent) return ddp_error(DDP_ERR_INVALID, "rpc future create: NULL agent");
  return ddp__rpc_future_new(agent, out);
}

ddp_status ddp_rpc_future_complete(ddp_rpc_future *f, ddp_rpc_message *result) {
  if (!f) {
    ddp_rpc_message_free(result);
    return ddp_error(DDP_ERR_INVALID, "rpc future complete: NULL future");
  }
  ddp_rpc_message empty = {0};
  if (!ddp__rpc_future_finish(f, DDP_OK, result ? result : &empty, NULL))
    return ddp_error(DDP_ERR_STATE, "rpc future complete: the future has completed already");
  return DDP_OK;
}

ddp_status ddp_rpc_future_fail(ddp_rpc_future *f, ddp_status status, const char *fmt, ...) {
  if (!f) return ddp_error(DDP_ERR_INVALID, "rpc future fail: NULL future");
  if (status == DDP_OK) status = DDP_ERR_INTERNAL;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!ddp__rpc_future_finish(f, status, NULL, msg))
    return ddp_error(DDP_ERR_STATE, "rpc future fail: the future has completed already");
  return DDP_OK;
}
