/* Calls: sending a request (to another worker, or to this one through its
 * own pool), the table of pending calls, completing them from replies, and
 * serving a request (the handler, its reply or error, deferred replies). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "rpc/engine.h"
#include "rpc/registry.h"

/* ---- The pending table (under a->mu) ------------------------------------------ */

static unsigned bucket_of(uint64_t call_id) { return (unsigned)(call_id % DDP__RPC_PENDING_BUCKETS); }

static void pending_insert_locked(ddp_rpc_agent *a, ddp_rpc_future *f) {
  unsigned b = bucket_of(f->call_id);
  f->hnext = a->pending[b];
  a->pending[b] = f;
  f->in_table = true;
  a->outstanding++;
}

bool ddp__rpc_pending_remove_locked(ddp_rpc_agent *a, ddp_rpc_future *f) {
  if (!f->in_table) return false;
  for (ddp_rpc_future **p = &a->pending[bucket_of(f->call_id)]; *p; p = &(*p)->hnext)
    if (*p == f) {
      *p = f->hnext;
      f->hnext = NULL;
      f->in_table = false;
      if (--a->outstanding == 0) pthread_cond_broadcast(&a->outstanding_cv);
      return true;
    }
  DDP_ASSERT(!"a pending call marked in the table was not found");
  return false;
}

void ddp__rpc_deliver(ddp_rpc_agent *a, int32_t from, uint64_t call_id, ddp_status status,
                      ddp__rpc_block *block) {
  pthread_mutex_lock(&a->mu);
  ddp_rpc_future *f = a->pending[bucket_of(call_id)];
  while (f && !(f->call_id == call_id && f->to == from)) f = f->hnext;
  if (f) ddp__rpc_pending_remove_locked(a, f);
  pthread_mutex_unlock(&a->mu);
  if (!f) {
    /* Its caller gave up (timeout) or is gone: nothing waits for it. */
    DDP_DEBUG("rpc: dropping a reply from rank %d for call %llu that no one waits for", from,
              (unsigned long long)call_id);
    ddp__rpc_block_free(block);
    return;
  }
  if (status == DDP_OK) {
    ddp_rpc_message result = block->msg;
    ddp__rpc_future_finish(f, DDP_OK, &result, NULL);
  } else {
    char who[128];
    ddp__rpc_worker_str(a, from, who, sizeof who);
    size_t n = block->msg.payload_bytes;
    char *msg = ddp_alloc(n + 256 + sizeof f->fn);
    if (msg) {
      int k = snprintf(msg, 256 + sizeof f->fn, "rpc to %s, function '%s': ", who, f->fn);
      memcpy(msg + k, block->msg.payload, n);
      msg[k + (int)n] = '\0';
    }
    ddp__rpc_future_finish(f, status, NULL, msg ? msg : "remote error (no memory for its message)");
    ddp_free(msg);
    ddp__rpc_block_free(block);
  }
  ddp_rpc_future_destroy(f); /* the table's reference */
}

/* ---- Calling ------------------------------------------------------------------ */

static double effective_timeout(const ddp_rpc_agent *a, double timeout_s) {
  if (timeout_s <= 0) return (double)a->default_timeout_ns / 1e9;
  return timeout_s > 1e9 ? 1e9 : timeout_s;
}

/* Starts a call; pull_seq as ddp__rpc_send_frame_ex's (NULL: the args are
 * free to reuse on return). */
static ddp_status start_call(ddp_rpc_agent *a, int32_t to, const char *fn,
                             const ddp_rpc_message *args, double timeout_s, uint64_t *pull_seq,
                             ddp_rpc_future **out) {
  *out = NULL;
  if (!a) return ddp_error(DDP_ERR_INVALID, "rpc: NULL agent");
  if (to < 0 || to >= a->world)
    return ddp_error(DDP_ERR_NOTFOUND, "rpc: no worker of rank %d (world size %d)", to, a->world);
  char who[128];
  ddp__rpc_worker_str(a, to, who, sizeof who);
  if (!fn || !*fn || strlen(fn) >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_INVALID, "rpc to %s: bad function name", who);
  ddp_status st = ddp__rpc_message_check(args);
  if (st != DDP_OK) return ddp_error_wrap(st, "rpc to %s, function '%s'", who, fn);
  double timeout = effective_timeout(a, timeout_s);
  ddp__rpc_conn *c = &a->conns[to];

  ddp_rpc_future *f;
  DDP_TRY(ddp__rpc_future_new(a, &f));
  f->is_call = true;
  f->to = to;
  f->timeout_s = timeout;
  f->deadline_ns = ddp_time_ns() + (int64_t)(timeout * 1e9);
  snprintf(f->fn, sizeof f->fn, "%s", fn);
  ddp__rpc_block *self_block = NULL;
  if (c->link == DDP__RPC_LINK_SELF) {
    /* The caller may reuse its buffers on return: the request gets a copy. */
    st = ddp__rpc_message_copy(args, sizeof(ddp_rpc_call), &self_block);
    if (st != DDP_OK) {
      ddp_rpc_future_destroy(f);
      return ddp_error_wrap(st, "rpc to %s, function '%s'", who, fn);
    }
  }

  pthread_mutex_lock(&a->mu);
  if (a->state == DDP__RPC_STOPPING || c->state != DDP__RPC_CONN_OPEN) {
    char why[sizeof c->error];
    snprintf(why, sizeof why, "%s",
             a->state == DDP__RPC_STOPPING ? "the agent is shut down" : c->error);
    bool stopping = a->state == DDP__RPC_STOPPING;
    pthread_mutex_unlock(&a->mu);
    ddp_free(self_block);
    ddp_rpc_future_destroy(f);
    return ddp_error(stopping ? DDP_ERR_STATE : DDP_ERR_CLOSED, "rpc to %s, function '%s': %s",
                     who, fn, why);
  }
  f->call_id = ++a->next_call_id;
  ddp__rpc_future_ref(f); /* the table's */
  pending_insert_locked(a, f);
  ddp__rpc_timer_note_locked(a, f->deadline_ns);
  if (self_block) {
    ddp_rpc_call *call = self_block->extra;
    call->task.kind = DDP__RPC_TASK_REQUEST;
    call->agent = a;
    call->block = self_block;
    call->from = a->rank;
    call->call_id = f->call_id;
    call->deadline_ns = f->deadline_ns;
    snprintf(call->fn, sizeof call->fn, "%s", fn);
    ddp__rpc_enqueue_locked(a, &call->task);
  }
  uint64_t call_id = f->call_id;
  pthread_mutex_unlock(&a->mu);

  if (!self_block) {
    st = ddp__rpc_send_frame_ex(c, DDP__RPC_REQUEST, call_id, DDP_OK, fn,
                                (int64_t)(timeout * 1000.0) + 1, args,
                                ddp_time_ns() + a->default_timeout_ns, pull_seq);
    if (st != DDP_OK) {
      /* The connection is failed now, which failed f too (if still pending). */
      char msg[512];
      snprintf(msg, sizeof msg, "%s", ddp_last_error());
      pthread_mutex_lock(&a->mu);
      bool mine = ddp__rpc_pending_remove_locked(a, f);
      pthread_mutex_unlock(&a->mu);
      if (mine) ddp_rpc_future_destroy(f);
      ddp_rpc_future_destroy(f);
      return ddp_error(st, "rpc to %s, function '%s': %s", who, fn, msg);
    }
  }
  *out = f;
  return DDP_OK;
}

ddp_status ddp__rpc_async_rank(ddp_rpc_agent *a, int32_t to, const char *fn,
                               const ddp_rpc_message *args, double timeout_s,
                               ddp_rpc_future **out) {
  return start_call(a, to, fn, args, timeout_s, NULL, out);
}

static ddp_status lookup_worker(const ddp_rpc_agent *a, const char *to, int32_t *rank) {
  if (!a) return ddp_error(DDP_ERR_INVALID, "rpc: NULL agent");
  if (!to) return ddp_error(DDP_ERR_INVALID, "rpc: NULL worker name");
  for (int32_t r = 0; r < a->world; r++)
    if (strcmp(a->workers[r].name, to) == 0) {
      *rank = r;
      return DDP_OK;
    }
  return ddp_error(DDP_ERR_NOTFOUND, "rpc: no worker named '%s' (world of %d workers: '%s'%s)",
                   to, a->world, a->workers[0].name, a->world > 1 ? ", ..." : "");
}

ddp_status ddp_rpc_async(ddp_rpc_agent *agent, const char *to, const char *fn,
                         const ddp_rpc_message *args, double timeout_s, ddp_rpc_future **out) {
  *out = NULL;
  int32_t rank = -1;
  DDP_TRY(lookup_worker(agent, to, &rank));
  return ddp__rpc_async_rank(agent, rank, fn, args, timeout_s, out);
}

ddp_status ddp_rpc_sync(ddp_rpc_agent *agent, const char *to, const char *fn,
                        const ddp_rpc_message *args, double timeout_s, ddp_rpc_message *result) {
  if (result) memset(result, 0, sizeof *result);
  int32_t rank = -1;
  DDP_TRY(lookup_worker(agent, to, &rank));
  /* The caller waits anyway: its args need not be read before the request
   * is sent (one wake-up less for large tensors read across processes);
   * they are by the time the reply comes, checked below. */
  uint64_t pull_seq = 0;
  ddp_rpc_future *f;
  DDP_TRY(start_call(agent, rank, fn, args, timeout_s, &pull_seq, &f));
  ddp_status st = ddp_rpc_future_wait(f, -1);
  if (st == DDP_OK && result) st = ddp_rpc_future_take(f, result);
  ddp_rpc_future_destroy(f);
  if (pull_seq) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
    ddp_status pst = ddp__rpc_wait_pulled(&agent->conns[rank], pull_seq,
                                          ddp_time_ns() + agent->default_timeout_ns);
    if (st == DDP_OK && pst != DDP_OK) {
      if (result) ddp_rpc_message_free(result);
      return pst;
    }
    if (st != DDP_OK) return ddp_error(st, "%s", msg);
  }
  return st;
}

/* ---- Serving ------------------------------------------------------------------ */

/* Sends a reply or error for call_id to rank `to`: through the connection, or
 * straight to this agent's pending call (a self call; the reply is copied,
 * since it may point into args that are about to be freed). */
static ddp_status send_result(ddp_rpc_agent *a, int32_t to, uint64_t call_id, ddp_status status,
                              const ddp_rpc_message *reply, const char *error) {
  ddp_rpc_message err = {0};
  if (status != DDP_OK) {
    err.payload = error;
    err.payload_bytes = strlen(error);
    reply = &err;
  }
  ddp__rpc_conn *c = &a->conns[to];
  if (c->link == DDP__RPC_LINK_SELF) {
    ddp__rpc_block *b;
    ddp_status st = ddp__rpc_message_copy(reply, 0, &b);
    if (st != DDP_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "cannot copy the reply: %s", ddp_last_error());
      err.payload = msg;
      err.payload_bytes = strlen(msg);
      status = st;
      if (ddp__rpc_message_copy(&err, 0, &b) != DDP_OK) return st;
    }
    ddp__rpc_deliver(a, to, call_id, status, b);
    return DDP_OK;
  }
  pthread_mutex_lock(&a->mu);
  bool open = c->state == DDP__RPC_CONN_OPEN;
  pthread_mutex_unlock(&a->mu);
  if (!open) return ddp_error(DDP_ERR_CLOSED, "rpc: the caller (rank %d) is gone", to);
  ddp_status st = ddp__rpc_send_frame(c, status == DDP_OK ? DDP__RPC_REPLY : DDP__RPC_ERROR,
                                      call_id, status, NULL, 0, reply,
                                      ddp_time_ns() + a->default_timeout_ns);
  return st;
}

/* Sends a successful reply, taking reply (released) and args (freed; may
 * be NULL): once sent, or, when the worker reads its tensors across
 * processes, once it has read them, without this thread waiting for that. */
static ddp_status send_reply_owned(ddp_rpc_agent *a, int32_t to, uint64_t call_id,
                                   ddp_rpc_message *reply, ddp__rpc_block *args) {
  ddp__rpc_conn *c = &a->conns[to];
  ddp_status st;
  if (c->link == DDP__RPC_LINK_SELF) {
    st = send_result(a, to, call_id, DDP_OK, reply, NULL);
  } else {
    pthread_mutex_lock(&a->mu);
    bool open = c->state == DDP__RPC_CONN_OPEN;
    pthread_mutex_unlock(&a->mu);
    uint64_t seq = 0;
    st = open ? ddp__rpc_send_frame_ex(c, DDP__RPC_REPLY, call_id, DDP_OK, NULL, 0, reply,
                                       ddp_time_ns() + a->default_timeout_ns, &seq)
              : ddp_error(DDP_ERR_CLOSED, "rpc: the caller (rank %d) is gone", to);
    if (st == DDP_OK && seq) {
      ddp__rpc_hold_until_pulled(c, seq, reply, args);
      return DDP_OK;
    }
  }
  ddp_rpc_message_free(reply);
  ddp__rpc_block_free(args);
  return st;
}

void ddp__rpc_serve(ddp_rpc_agent *a, ddp_rpc_call *call) {
  /* The call lives in its args' block, which the handler may take: keep
   * what is needed after the handler in locals. */
  ddp__rpc_block *args_block = call->block;
  int32_t from = call->from;
  uint64_t call_id = call->call_id;
  char fn[DDP_RPC_MAX_NAME_BYTES];
  memcpy(fn, call->fn, sizeof fn);
  const char *self_name = a->workers[a->rank].name;

  ddp_rpc_handler handler;
  void *user;
  if (!ddp__rpc_lookup(fn, &handler, &user)) {
    char names[256], msg[512];
    ddp__rpc_registered_names(names, sizeof names);
    snprintf(msg, sizeof msg, "function '%s' is not registered on worker '%s' (registered: %s)",
             fn, self_name, names);
    send_result(a, from, call_id, DDP_ERR_NOTFOUND, NULL, msg);
    ddp__rpc_block_free(args_block);
    return;
  }
  ddp_rpc_message reply = {0};
  ddp_clear_error();
  ddp_status st = handler(call, &args_block->msg, &reply, user);
  bool deferred = call->deferred && st == DDP_OK;
  bool taken = call->block == NULL;
  if (!deferred) {
    if (st == DDP_OK) {
      ddp_status check = ddp__rpc_message_check(&reply);
      if (check != DDP_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "worker '%s': the handler's reply is malformed: %s", self_name,
                 ddp_last_error());
        send_result(a, from, call_id, check, NULL, msg);
      } else {
        /* The reply may point into the args: both go together. */
        send_reply_owned(a, from, call_id, &reply, taken ? NULL : args_block);
        return;
      }
    } else {
      char msg[1024];
      const char *detail = ddp_last_error();
      snprintf(msg, sizeof msg, "the handler failed on worker '%s' (%s): %s", self_name,
               ddp_status_name(st), *detail ? detail : ddp_strerror(st));
      send_result(a, from, call_id, st, NULL, msg);
    }
  }
  ddp_rpc_message_free(&reply);
  if (!taken) ddp__rpc_block_free(args_block);
}

/* ---- Inside a handler ----------------------------------------------------------- */

ddp_rpc_agent *ddp_rpc_call_agent(const ddp_rpc_call *call) { return call->agent; }

const ddp_rpc_worker_info *ddp_rpc_call_caller(const ddp_rpc_call *call) {
  return &call->agent->workers[call->from];
}

const char *ddp_rpc_call_function(const ddp_rpc_call *call) { return call->fn; }

double ddp_rpc_call_time_left_s(const ddp_rpc_call *call) {
  return (double)(call->deadline_ns - ddp_time_ns()) / 1e9;
}

ddp_status ddp_rpc_call_take_args(ddp_rpc_call *call, ddp_rpc_message *out) {
  memset(out, 0, sizeof *out);
  if (!call->block)
    return ddp_error(DDP_ERR_STATE, "rpc call '%s': the args were taken already", call->fn);
  *out = call->block->msg;
  call->block = NULL;
  return DDP_OK;
}

ddp_status ddp_rpc_call_defer(ddp_rpc_call *call, ddp_rpc_reply **out) {
  *out = NULL;
  if (call->deferred)
    return ddp_error(DDP_ERR_STATE, "rpc call '%s': the reply is deferred already", call->fn);
  ddp_rpc_reply *r = ddp_calloc(1, sizeof *r);
  if (!r) return ddp_error(DDP_ERR_NOMEM, "rpc call '%s': cannot defer the reply", call->fn);
  r->agent = call->agent;
  r->to = call->from;
  r->call_id = call->call_id;
  memcpy(r->fn, call->fn, sizeof r->fn);
  call->deferred = true;
  *out = r;
  return DDP_OK;
}

static ddp_status reply_send(ddp_rpc_reply *r, ddp_rpc_message *reply);

ddp_status ddp_rpc_reply_send(ddp_rpc_reply *r, ddp_rpc_message *reply) {
  if (!r) {
    ddp_rpc_message_free(reply);
    return ddp_error(DDP_ERR_INVALID, "rpc reply send: NULL reply handle");
  }
  ddp_rpc_agent *a = r->agent;
  atomic_fetch_add(&a->outside_users, 1);
  ddp_status st = reply_send(r, reply);
  atomic_fetch_sub(&a->outside_users, 1);
  return st;
}

static ddp_status reply_send(ddp_rpc_reply *r, ddp_rpc_message *reply) {
  ddp_status st = ddp__rpc_message_check(reply);
  if (st == DDP_OK) {
    ddp_rpc_message empty = {0};
    st = send_reply_owned(r->agent, r->to, r->call_id, reply ? reply : &empty, NULL);
    ddp_free(r);
    return st;
  } else {
    char msg[512];
    snprintf(msg, sizeof msg, "worker '%s': the deferred reply is malformed: %s",
             r->agent->workers[r->agent->rank].name, ddp_last_error());
    send_result(r->agent, r->to, r->call_id, st, NULL, msg);
  }
  ddp_rpc_message_free(reply);
  ddp_free(r);
  return st;
}

ddp_status ddp_rpc_reply_fail(ddp_rpc_reply *r, ddp_status status, const char *fmt, ...) {
  if (!r) return ddp_error(DDP_ERR_INVALID, "rpc reply fail: NULL reply handle");
  ddp_rpc_agent *a = r->agent;
  atomic_fetch_add(&a->outside_users, 1);
  if (status == DDP_OK) status = DDP_ERR_INTERNAL;
  char detail[768], msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  snprintf(msg, sizeof msg, "the handler failed on worker '%s' (%s): %s",
           r->agent->workers[r->agent->rank].name, ddp_status_name(status), detail);
  ddp_status st = send_result(r->agent, r->to, r->call_id, status, NULL, msg);
  ddp_free(r);
  atomic_fetch_sub(&a->outside_users, 1);
  return st;
}
