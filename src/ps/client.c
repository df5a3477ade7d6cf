/* A trainer's side of the parameter server (include/ddp/ps.h,
 * ps_internal.h): the push of each gradient as backward makes it final,
 * the pull of fresh parameters at the end of a step (with server 0 the
 * buffers' deltas), meetings at server 0 (evaluation, sums, saves), and the
 * answer to the servers' watches. Buffers are sized once at bind: a step
 * allocates nothing here (the RPC engine allocates its futures and received
 * messages). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ps_internal.h"

typedef struct push_payload {
  ddp__ps_header h;
  int32_t param;
} push_payload;

struct ddp_ps_client {
  ddp_ps_options o;
  int32_t index;
  char name[DDP_RPC_MAX_NAME_BYTES];
  char (*servers)[DDP_RPC_MAX_NAME_BYTES]; /* S names */
  ddp_rpc_agent *agent;
  ddp_model *model;
  int32_t np;
  int32_t *owner;                /* np: the server holding each parameter */
  bool *pushed;                  /* np: pushed this step */
  ddp_rpc_future **push_futures; /* np */
  push_payload *push_payloads;   /* np */
  ddp_tensor *grad_views;        /* np: each parameter's gradient */
  ddp_tensor **grad_ptrs;
  ddp_rpc_future **pull_futures; /* S */
  ddp__ps_header *pull_headers;  /* S */
  /* Server 0's buffers as last pulled, and this step's deltas from them. */
  int64_t nb, nc;
  float *pulled_buf, *delta_buf;
  int64_t *pulled_ctr, *delta_ctr;
  ddp_tensor delta_tensors[2];
  ddp_tensor *delta_ptrs[2];
  int32_t n_deltas;
  ddp_status error; /* the first push error of the step */
  char error_msg[512];
  int64_t meet_seq;
  int64_t step; /* the step in progress: the servers' base step + 1, then one more each end */
  bool ending;  /* in end_step: pushes from here on did not overlap backward */
  int64_t pushes_in_backward, pushes_after, first_push_param;
  double push_wait_s, pull_wait_s;
  pthread_mutex_t mu; /* the watches (pool threads) */
  ddp_rpc_reply **watch_replies; /* S */
  bool finished, registered;
};

/* ---- The watch: servers learn of this trainer's death when it fails ---- */

static ddp_status fn_watch(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                           void *user) {
  (void)args;
  (void)reply;
  (void)user;
  ddp_ps_client *c = ddp__ps_registry_find(call);
  if (!c) return DDP_OK; /* no trainer here (any more): nothing to watch */
  int32_t server = ddp_rpc_call_caller(call)->rank;
  if (server < 0 || server >= c->o.num_servers)
    return ddp_error(DDP_ERR_INVALID, "a watch from rank %d, not a server", server);
  pthread_mutex_lock(&c->mu);
  ddp_status s = DDP_OK;
  if (!c->finished && !c->watch_replies[server]) {
    ddp_rpc_reply *r;
    s = ddp_rpc_call_defer(call, &r);
    if (s == DDP_OK) c->watch_replies[server] = r;
  }
  pthread_mutex_unlock(&c->mu);
  return s; /* finished: answered at once */
}

/* ---- Life ---- */

ddp_status ddp_ps_client_create(ddp_ps_client **out, const ddp_ps_options *o,
                                int32_t trainer_index) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_ps_client_create: out is NULL");
  *out = NULL;
  DDP_TRY(ddp_ps_options_check(o));
  if (trainer_index < 0 || trainer_index >= o->num_trainers)
    return ddp_error(DDP_ERR_INVALID, "trainer index %d of %d", trainer_index, o->num_trainers);
  ddp_ps_client *c = ddp_calloc(1, sizeof *c);
  if (!c) return ddp_error(DDP_ERR_NOMEM, "ddp_ps_client_create: out of memory");
  c->o = *o;
  c->index = trainer_index;
  pthread_mutex_init(&c->mu, NULL);
  ddp_ps_worker_name(o, o->num_servers + trainer_index, c->name);
  c->servers = ddp_calloc((size_t)o->num_servers, sizeof *c->servers);
  c->pull_futures = ddp_calloc((size_t)o->num_servers, sizeof *c->pull_futures);
  c->pull_headers = ddp_calloc((size_t)o->num_servers, sizeof *c->pull_headers);
  c->watch_replies = ddp_calloc((size_t)o->num_servers, sizeof *c->watch_replies);
  ddp_status s = DDP_OK;
  if (!c->servers || !c->pull_futures || !c->pull_headers || !c->watch_replies) {
    s = ddp_error(DDP_ERR_NOMEM, "ddp_ps_client_create: out of memory");
    goto err;
  }
  for (int32_t j = 0; j < o->num_servers; j++) ddp_ps_worker_name(o, j, c->servers[j]);
  if ((s = ddp__ps_registry_add(c->name, c)) != DDP_OK) goto err;
  c->registered = true;
  if ((s = ddp_rpc_register(DDP__PS_FN_WATCH, fn_watch, NULL)) != DDP_OK) goto err;
  *out = c;
  return DDP_OK;
err:
  ddp_ps_client_destroy(c);
  return s;
}

ddp_status ddp_ps_client_attach(ddp_ps_client *c, ddp_rpc_agent *agent) {
  if (!c || !agent) return ddp_error(DDP_ERR_INVALID, "ddp_ps_client_attach: NULL argument");
  c->agent = agent;
  return DDP_OK;
}

int32_t ddp_ps_client_trainer_index(const ddp_ps_client *c) { return c->index; }
const ddp_ps_options *ddp_ps_client_options(const ddp_ps_client *c) { return &c->o; }

void ddp_ps_client_destroy(ddp_ps_client *c) {
  if (!c) return;
  if (c->registered) ddp__ps_registry_remove(c);
  for (int32_t i = 0; c->push_futures && i < c->np; i++) ddp_rpc_future_destroy(c->push_futures[i]);
  for (int32_t j = 0; c->pull_futures && j < c->o.num_servers; j++)
    ddp_rpc_future_destroy(c->pull_futures[j]);
  /* Watches still deferred (finish was not called) fail: the servers then
   * take this trainer as gone. */
  for (int32_t j = 0; c->watch_replies && j < c->o.num_servers; j++)
    if (c->watch_replies[j])
      (void)ddp_rpc_reply_fail(c->watch_replies[j], DDP_ERR_CLOSED, "trainer %s left", c->name);
  ddp_free(c->servers);
  ddp_free(c->pull_futures);
  ddp_free(c->pull_headers);
  ddp_free(c->watch_replies);
  ddp_free(c->owner);
  ddp_free(c->pushed);
  ddp_free(c->push_futures);
  ddp_free(c->push_payloads);
  ddp_free(c->grad_views);
  ddp_free(c->grad_ptrs);
  ddp_free(c->pulled_buf);
  ddp_free(c->delta_buf);
  ddp_free(c->pulled_ctr);
  ddp_free(c->delta_ctr);
  pthread_mutex_destroy(&c->mu);
  ddp_free(c);
}

/* ---- Pulls ---- */

/* Copies server j's pull reply into the model: its parameters in index
 * order, then (server 0) the buffers and counters, also kept as the base
 * of the next step's deltas. */
static ddp_status absorb_pull(ddp_ps_client *c, int32_t j, const ddp_rpc_message *m,
                              int64_t *base_step) {
  const ddp__ps_header *h;
  DDP_TRY(ddp__ps_header_check(m, DDP__PS_PULL, 0, "a pull reply", &h));
  float *params = ddp_model_params_flat(c->model);
  int32_t k = 0;
  for (int32_t i = 0; i < c->np; i++) {
    if (c->owner[i] != j) continue;
    const ddp_tensor *p = ddp_model_param(c->model, i);
    if (k >= m->num_tensors || m->tensors[k]->numel != p->numel ||
        m->tensors[k]->dtype != DDP_FLOAT32)
      return ddp_error(DDP_ERR_SHAPE, "server '%s' sent %d tensors, not %s's (%lld values) at "
                                      "%d: do the servers run the same model?",
                       c->servers[j], m->num_tensors, ddp_model_param_name(c->model, i),
                       (long long)p->numel, k);
    memcpy(params + ddp_model_param_offset(c->model, i), ddp_tensor_f32(m->tensors[k]),
           (size_t)p->numel * sizeof(float));
    k++;
  }
  if (j == 0 && c->nb > 0) {
    if (k >= m->num_tensors || m->tensors[k]->numel != c->nb)
      return ddp_error(DDP_ERR_SHAPE, "server '%s' sent no buffers", c->servers[j]);
    memcpy(c->pulled_buf, ddp_tensor_f32(m->tensors[k++]), (size_t)c->nb * sizeof(float));
    memcpy(ddp_model_buffers_flat(c->model), c->pulled_buf, (size_t)c->nb * sizeof(float));
  }
  if (j == 0 && c->nc > 0) {
    if (k >= m->num_tensors || m->tensors[k]->numel != c->nc || m->tensors[k]->dtype != DDP_INT64)
      return ddp_error(DDP_ERR_SHAPE, "server '%s' sent no counters", c->servers[j]);
    memcpy(c->pulled_ctr, ddp_tensor_i64(m->tensors[k++]), (size_t)c->nc * sizeof(int64_t));
    memcpy(ddp_model_counters(c->model), c->pulled_ctr, (size_t)c->nc * sizeof(int64_t));
  }
  if (k != m->num_tensors)
    return ddp_error(DDP_ERR_SHAPE, "server '%s' sent %d tensors, expected %d", c->servers[j],
                     m->num_tensors, k);
  if (base_step) *base_step = h->base_step;
  return DDP_OK;
}

/* Sends every server the pull for `step` (DDP__PS_PULL_NOW: the current
 * parameters); the futures wait in c->pull_futures. */
static ddp_status pull_send(ddp_ps_client *c, int64_t step) {
  const double timeout = ddp__ps_timeout(&c->o);
  for (int32_t j = 0; j < c->o.num_servers; j++) {
    c->pull_headers[j] = (ddp__ps_header){.magic = DDP__PS_MAGIC, .kind = DDP__PS_PULL,
                                          .trainer = c->index, .step = step};
    ddp_rpc_message m = {.payload = &c->pull_headers[j], .payload_bytes = sizeof(ddp__ps_header)};
    if (j == 0 && step != DDP__PS_PULL_NOW) {
      m.tensors = c->delta_ptrs;
      m.num_tensors = c->n_deltas;
    }
    ddp_status s =
        ddp_rpc_async(c->agent, c->servers[j], DDP__PS_FN_PULL, &m, timeout, &c->pull_futures[j]);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "%s: pulling from server '%s' (rank %d)", c->name, c->servers[j], j);
  }
  return DDP_OK;
}

/* Waits for the pulls sent and copies the replies in; after a failure (or
 * with drop) the rest are dropped unread. The first error is returned. */
static ddp_status pull_wait(ddp_ps_client *c, int64_t *base_step, bool drop) {
  ddp_status s = drop ? DDP_ERR_ABORTED : DDP_OK;
  for (int32_t j = 0; j < c->o.num_servers; j++) {
    ddp_rpc_future *f = c->pull_futures[j];
    c->pull_futures[j] = NULL;
    if (!f) continue;
    ddp_status w = s == DDP_OK ? ddp_rpc_future_wait(f, -1) : DDP_OK;
    ddp_rpc_message m = {0};
    if (s == DDP_OK && w == DDP_OK) w = ddp_rpc_future_take(f, &m);
    if (s == DDP_OK && w == DDP_OK) w = absorb_pull(c, j, &m, j == 0 ? base_step : NULL);
    ddp_rpc_message_free(&m);
    ddp_rpc_future_destroy(f); /* a pending one's result is dropped */
    if (w != DDP_OK && s == DDP_OK)
      s = ddp_error_wrap(w, "%s: pulling from server '%s' (rank %d)", c->name, c->servers[j], j);
  }
  return s;
}

static ddp_status pull_all(ddp_ps_client *c, int64_t step, int64_t *base_step) {
  ddp_status s = pull_send(c, step);
  ddp_status w = pull_wait(c, base_step, false);
  return s != DDP_OK ? s : w;
}

ddp_status ddp_ps_client_bind(ddp_ps_client *c, ddp_model *model, int64_t *base_step) {
  if (!c->agent) return ddp_error(DDP_ERR_STATE, "%s: ddp_ps_client_attach was not called", c->name);
  c->model = model;
  c->np = ddp_model_num_params(model);
  const size_t np = (size_t)(c->np > 0 ? c->np : 1);
  int64_t *numel = ddp_alloc(np * sizeof *numel);
  c->owner = ddp_alloc(np * sizeof *c->owner);
  c->pushed = ddp_calloc(np, sizeof *c->pushed);
  c->push_futures = ddp_calloc(np, sizeof *c->push_futures);
  c->push_payloads = ddp_calloc(np, sizeof *c->push_payloads);
  c->grad_views = ddp_calloc(np, sizeof *c->grad_views);
  c->grad_ptrs = ddp_calloc(np, sizeof *c->grad_ptrs);
  c->nb = ddp_model_num_buffer_elements(model);
  c->nc = ddp_model_num_counters(model);
  c->pulled_buf = ddp_calloc((size_t)c->nb + 1, sizeof(float));
  c->delta_buf = ddp_calloc((size_t)c->nb + 1, sizeof(float));
  c->pulled_ctr = ddp_calloc((size_t)c->nc + 1, sizeof(int64_t));
  c->delta_ctr = ddp_calloc((size_t)c->nc + 1, sizeof(int64_t));
  ddp_status s = DDP_OK;
  if (!numel || !c->owner || !c->pushed || !c->push_futures || !c->push_payloads ||
      !c->grad_views || !c->grad_ptrs || !c->pulled_buf || !c->delta_buf || !c->pulled_ctr ||
      !c->delta_ctr) {
    ddp_free(numel);
    return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for the push buffers", c->name);
  }
  float *grads = ddp_model_grads_flat(model);
  for (int32_t i = 0; i < c->np; i++) {
    const ddp_tensor *p = ddp_model_param(model, i);
    numel[i] = p->numel;
    s = ddp_tensor_wrap(&c->grad_views[i], DDP_FLOAT32, p->ndim, p->shape,
                        grads + ddp_model_param_offset(model, i));
    if (s != DDP_OK) break;
    c->grad_ptrs[i] = &c->grad_views[i];
  }
  if (s == DDP_OK) s = ddp_ps_shard(numel, c->np, c->o.num_servers, c->owner);
  ddp_free(numel);
  if (s != DDP_OK) return s;
  c->n_deltas = 0;
  if (c->nb > 0) {
    int64_t shape[1] = {c->nb};
    DDP_TRY(ddp_tensor_wrap(&c->delta_tensors[c->n_deltas], DDP_FLOAT32, 1, shape, c->delta_buf));
    c->delta_ptrs[c->n_deltas] = &c->delta_tensors[c->n_deltas];
    c->n_deltas++;
  }
  if (c->nc > 0) {
    int64_t shape[1] = {c->nc};
    DDP_TRY(ddp_tensor_wrap(&c->delta_tensors[c->n_deltas], DDP_INT64, 1, shape, c->delta_ctr));
    c->delta_ptrs[c->n_deltas] = &c->delta_tensors[c->n_deltas];
    c->n_deltas++;
  }
  int64_t base = 0;
  DDP_TRY(pull_all(c, DDP__PS_PULL_NOW, &base));
  c->step = base + 1;
  if (base_step) *base_step = base;
  return DDP_OK;
}

int64_t ddp_ps_client_step(const ddp_ps_client *c) { return c->step; }

/* ---- Pushes ---- */

void ddp_ps_client_push(ddp_ps_client *c, int32_t param, int64_t step, double lr) {
  if (param < 0 || param >= c->np || c->pushed[param]) return;
  c->pushed[param] = true;
  if (c->ending) c->pushes_after++;
  else if (c->pushes_in_backward++ == 0) c->first_push_param = param;
  if (c->error != DDP_OK) return;
  push_payload *pp = &c->push_payloads[param];
  *pp = (push_payload){.h = {.magic = DDP__PS_MAGIC, .kind = DDP__PS_PUSH, .trainer = c->index,
                             .count = 1, .step = step, .lr = lr},
                       .param = param};
  ddp_rpc_message m = {.payload = pp, .payload_bytes = sizeof pp->h + sizeof pp->param,
                       .tensors = &c->grad_ptrs[param], .num_tensors = 1};
  const int32_t j = c->owner[param];
  ddp_status s = ddp_rpc_async(c->agent, c->servers[j], DDP__PS_FN_PUSH, &m,
                               ddp__ps_timeout(&c->o), &c->push_futures[param]);
  if (s != DDP_OK) {
    c->error = ddp_error_wrap(s, "%s: step %lld: pushing %s to server '%s' (rank %d)", c->name,
                              (long long)step, ddp_model_param_name(c->model, param),
                              c->servers[j], j);
    snprintf(c->error_msg, sizeof c->error_msg, "%s", ddp_last_error());
  }
}

ddp_status ddp_ps_client_end_step(ddp_ps_client *c, double lr) {
  const int64_t step = c->step++;
  /* Parameters backward gave no gradient push their zeroed gradients, so
   * every server hears of every tensor each step. */
  c->ending = true;
  for (int32_t i = 0; i < c->np; i++)
    if (!c->pushed[i]) ddp_ps_client_push(c, i, step, lr);
  c->ending = false;
  for (int64_t e = 0; e < c->nb; e++)
    c->delta_buf[e] = ddp_model_buffers_flat(c->model)[e] - c->pulled_buf[e];
  for (int64_t e = 0; e < c->nc; e++)
    c->delta_ctr[e] = ddp_model_counters(c->model)[e] - c->pulled_ctr[e];
  /* Pulls go out at once (each server answers a pull only once this
   * trainer's pushes of the step are in); the pushes' acknowledgements are
   * waited for first, so a refused push fails the step at once instead of
   * leaving its pull unanswered. */
  const int64_t t0 = ddp_time_ns();
  ddp_status s = c->error;
  if (s != DDP_OK) ddp_error(s, "%s", c->error_msg);
  if (s == DDP_OK) s = pull_send(c, step);
  for (int32_t i = 0; i < c->np; i++) {
    ddp_rpc_future *f = c->push_futures[i];
    c->push_futures[i] = NULL;
    c->pushed[i] = false;
    if (!f) continue;
    ddp_status w = s == DDP_OK ? ddp_rpc_future_wait(f, -1) : DDP_OK;
    if (w != DDP_OK && s == DDP_OK) {
      s = ddp_error(w, "%s: step %lld: pushing %s to server '%s' (rank %d): %s", c->name,
                    (long long)step, ddp_model_param_name(c->model, i), c->servers[c->owner[i]],
                    c->owner[i], ddp_rpc_future_done(f) ? ddp_rpc_future_error(f) : ddp_last_error());
    }
    ddp_rpc_future_destroy(f);
  }
  c->error = DDP_OK;
  const int64_t t1 = ddp_time_ns();
  if (s != DDP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
    (void)pull_wait(c, NULL, true); /* after an error: drops them */
    return ddp_error(s, "%s", msg);
  }
  s = pull_wait(c, NULL, false);
  c->push_wait_s = 1e-9 * (double)(t1 - t0);
  c->pull_wait_s = 1e-9 * (double)(ddp_time_ns() - t1);
  return s;
}

void ddp__ps_client_push_counts(const ddp_ps_client *c, int64_t *in_backward, int64_t *after,
                                int32_t *first_param) {
  *in_backward = c->pushes_in_backward;
  *after = c->pushes_after;
  *first_param = (int32_t)c->first_push_param;
}

void ddp__ps_client_last_wait(const ddp_ps_client *c, double *push_wait_s, double *pull_wait_s) {
  *push_wait_s = c->push_wait_s;
  *pull_wait_s = c->pull_wait_s;
}

/* ---- Meetings at server 0 ---- */

static ddp_status meet(ddp_ps_client *c, int32_t kind, const void *data, int32_t count,
                       size_t elem, double *sums) {
  char payload[sizeof(ddp__ps_header) + sizeof(ddp_ps_save_info) + 16 * sizeof(double)];
  if ((size_t)count * elem > sizeof payload - sizeof(ddp__ps_header))
    return ddp_error(DDP_ERR_RANGE, "%s: a meeting of %d values", c->name, count);
  ddp__ps_header h = {.magic = DDP__PS_MAGIC, .kind = DDP__PS_MEET, .trainer = c->index,
                      .count = count, .step = ++c->meet_seq, .meet_kind = kind};
  memcpy(payload, &h, sizeof h);
  if (count) memcpy(payload + sizeof h, data, (size_t)count * elem);
  ddp_rpc_message m = {.payload = payload, .payload_bytes = sizeof h + (size_t)count * elem};
  ddp_rpc_message r = {0};
  ddp_status s = ddp_rpc_sync(c->agent, c->servers[0], DDP__PS_FN_MEET, &m, ddp__ps_timeout(&c->o), &r);
  if (s == DDP_OK && sums) {
    const ddp__ps_header *rh;
    s = ddp__ps_header_check(&r, DDP__PS_MEET, sizeof(double), "a meeting's reply", &rh);
    if (s == DDP_OK && rh->count != count)
      s = ddp_error(DDP_ERR_FORMAT, "a sum of %d values came back for %d", rh->count, count);
    if (s == DDP_OK) memcpy(sums, rh + 1, (size_t)count * sizeof(double));
  }
  ddp_rpc_message_free(&r);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "%s: meeting %lld at server '%s' (rank 0)", c->name,
                          (long long)c->meet_seq, c->servers[0]);
  return DDP_OK;
}

ddp_status ddp_ps_client_eval_begin(ddp_ps_client *c) {
  DDP_TRY(meet(c, DDP__PS_MEET_BARRIER, NULL, 0, 0, NULL));
  return pull_all(c, DDP__PS_PULL_NOW, NULL);
}

ddp_status ddp_ps_client_sum(ddp_ps_client *c, double *values, int n) {
  return meet(c, DDP__PS_MEET_SUM, values, n, sizeof(double), values);
}

ddp_status ddp_ps_client_save(ddp_ps_client *c, const ddp_ps_save_info *info) {
  return meet(c, DDP__PS_MEET_SAVE, info, 1, sizeof *info, NULL);
}

ddp_status ddp_ps_client_finish(ddp_ps_client *c) {
  if (!c) return DDP_OK;
  ddp_status first = DDP_OK;
  if (c->agent) {
    ddp__ps_header h = {.magic = DDP__PS_MAGIC, .kind = DDP__PS_DONE, .trainer = c->index};
    ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
    for (int32_t j = 0; j < c->o.num_servers; j++) {
      ddp_status s = ddp_rpc_sync(c->agent, c->servers[j], DDP__PS_FN_DONE, &m, ddp__ps_timeout(&c->o), NULL);
      if (s != DDP_OK && first == DDP_OK)
        first = ddp_error_wrap(s, "%s: telling server '%s' (rank %d) it is done", c->name,
                               c->servers[j], j);
    }
  }
  pthread_mutex_lock(&c->mu);
  c->finished = true;
  ddp_rpc_reply *replies[c->o.num_servers];
  for (int32_t j = 0; j < c->o.num_servers; j++) {
    replies[j] = c->watch_replies[j];
    c->watch_replies[j] = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  for (int32_t j = 0; j < c->o.num_servers; j++)
    if (replies[j]) (void)ddp_rpc_reply_send(replies[j], NULL);
  return first;
}
