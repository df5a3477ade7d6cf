/* The distributed optimizer (PyTorch's DistributedOptimizer, docs/rpc.md
 * "Distributed optimizer"): a local optimizer per parameter on each owner,
 * stepped from the gradients a distributed autograd context accumulated
 * there; steps on one worker are serialised and wait for other contexts'
 * pending backward passes (the gate in dist_autograd.c). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "rpc_autograd/rpc_autograd_internal.h"

#define OPTIM_MAGIC 0x4d54504fu /* "OPTM" */
#define OPTIM_VERSION 1u
#define MAX_OWNERS 256

typedef struct opt_rec {
  struct opt_rec *next;
  int64_t id;
  int n;
  ddp_rref **handles;  /* this worker's references to the parameters */
  ddp_tensor **params;
  float **grads;       /* each parameter's gradient for the step (copied from the context) */
  ddp_optimizer **opts;
  pthread_mutex_t mu;  /* one step at a time */
} opt_rec;

typedef struct optim_state {
  pthread_mutex_t mu;
  opt_rec *recs;
  int64_t next_id;
} optim_state;

extern const ddp__rpc_module ddp__dist_optim_module; /* at the end of this file */

static optim_state *state_of(ddp_rpc_agent *agent) {
  /* The slot is a constant of the module list, not a global that each
   * agent's init would write (agents on several threads would race). */
  return *(optim_state **)ddp__rpc_module_slot(agent, ddp__rpc_module_index(&ddp__dist_optim_module));
}

typedef struct create_hdr {
  uint32_t magic, version;
  ddp_optim_options options;
  int32_t n;
  int32_t reserved;
} create_hdr; /* then n reference tokens */

typedef struct step_hdr {
  uint32_t magic, version;
  int64_t opt_id;
  int64_t ctx_id;
} step_hdr;

static ddp_status check(const ddp_rpc_message *m, size_t bytes, const char *what) {
  if (m->payload_bytes < bytes)
    return ddp_error(DDP_ERR_INVALID, "dist optimizer %s: payload of %zu bytes, expected %zu",
                     what, m->payload_bytes, bytes);
  uint32_t mv[2];
  memcpy(mv, m->payload, sizeof mv);
  if (mv[0] != OPTIM_MAGIC || mv[1] != OPTIM_VERSION)
    return ddp_error(DDP_ERR_INVALID, "dist optimizer %s: bad magic or version", what);
  return DDP_OK;
}

static void rec_free(opt_rec *r) {
  if (!r) return;
  for (int i = 0; i < r->n; i++) {
    if (r->opts) ddp_optimizer_destroy(r->opts[i]);
    if (r->grads) ddp_free(r->grads[i]);
    if (r->handles) ddp_rref_release(r->handles[i]);
  }
  ddp_free(r->opts);
  ddp_free(r->grads);
  ddp_free(r->handles);
  ddp_free(r->params);
  pthread_mutex_destroy(&r->mu);
  ddp_free(r);
}

static ddp_status h_create(ddp_rpc_call *call, const ddp_rpc_message *args,
                           ddp_rpc_message *reply, void *user) {
  (void)user;
  DDP_TRY(check(args, sizeof(create_hdr), "create"));
  create_hdr h;
  memcpy(&h, args->payload, sizeof h);
  if (h.n <= 0 || args->payload_bytes != sizeof h + (size_t)h.n * DDP_RREF_TOKEN_BYTES)
    return ddp_error(DDP_ERR_INVALID, "dist optimizer create: %d parameters in %zu bytes", h.n,
                     args->payload_bytes);
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  opt_rec *r = ddp_calloc(1, sizeof *r);
  if (!r) return ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
  pthread_mutex_init(&r->mu, NULL);
  r->n = h.n;
  r->handles = ddp_calloc((size_t)h.n, sizeof *r->handles);
  r->params = ddp_calloc((size_t)h.n, sizeof *r->params);
  r->grads = ddp_calloc((size_t)h.n, sizeof *r->grads);
  r->opts = ddp_calloc((size_t)h.n, sizeof *r->opts);
  ddp_status s = r->handles && r->params && r->grads && r->opts
                     ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
  const char *tokens = (const char *)args->payload + sizeof h;
  for (int i = 0; i < h.n && s == DDP_OK; i++) {
    s = ddp_rref_from_token(agent, tokens + (size_t)i * DDP_RREF_TOKEN_BYTES, &r->handles[i]);
    void *v = NULL;
    if (s == DDP_OK) s = ddp_rref_local_value(r->handles[i], &v);
    ddp_tensor *t = v;
    if (s == DDP_OK && (!t || t->dtype != DDP_FLOAT32 || t->device.type != DDP_DEVICE_CPU))
      s = ddp_error(DDP_ERR_INVALID, "%s is not a float32 CPU tensor",
                    ddp_rref_name(r->handles[i]));
    if (s == DDP_OK) {
      r->params[i] = t;
      r->grads[i] = ddp_calloc((size_t)t->numel, sizeof(float));
      if (!r->grads[i]) s = ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
    }
    if (s == DDP_OK)
      s = ddp_optimizer_create(&r->opts[i], &h.options, ddp_tensor_f32(t), r->grads[i],
                               (size_t)t->numel);
  }
  if (s != DDP_OK) {
    rec_free(r);
    return ddp_error_wrap(s, "dist optimizer create on worker '%s'", ddp_rpc_self(agent)->name);
  }
  optim_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  r->id = ++st->next_id;
  r->next = st->recs;
  st->recs = r;
  pthread_mutex_unlock(&st->mu);
  /* The id travels in a buffer the reply owns: the rec's own field. */
  reply->payload = &r->id;
  reply->payload_bytes = sizeof r->id;
  return DDP_OK;
}

static opt_rec *find(optim_state *st, int64_t id) {
  pthread_mutex_lock(&st->mu);
  opt_rec *r = st->recs;
  while (r && r->id != id) r = r->next;
  pthread_mutex_unlock(&st->mu);
  return r;
}

static ddp_status h_step(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)reply, (void)user;
  DDP_TRY(check(args, sizeof(step_hdr), "step"));
  step_hdr h;
  memcpy(&h, args->payload, sizeof h);
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  opt_rec *r = find(state_of(agent), h.opt_id);
  if (!r)
    return ddp_error(DDP_ERR_NOTFOUND, "dist optimizer %lld: not on worker '%s' (destroyed?)",
                     (long long)h.opt_id, ddp_rpc_self(agent)->name);
  double left = ddp_rpc_call_time_left_s(call);
  DDP_TRY(ddp__dist_gate_write_begin(agent, h.ctx_id,
                                     ddp_time_ns() + (int64_t)((left > 0 ? left : 0) * 1e9)));
  pthread_mutex_lock(&r->mu);
  ddp_dist_context *ctx = NULL;
  /* A context that never reached this worker left no gradients here. */
  if (ddp_dist_context_retrieve(agent, h.ctx_id, &ctx) != DDP_OK) ctx = NULL;
  ddp_status s = DDP_OK;
  for (int i = 0; ctx && i < r->n && s == DDP_OK; i++) {
    const float *g = ddp_dist_get_gradient(ctx, r->params[i]);
    if (!g) continue; /* PyTorch skips a parameter whose grad is None */
    memcpy(r->grads[i], g, (size_t)r->params[i]->numel * sizeof(float));
    s = ddp_optimizer_step(r->opts[i]);
  }
  pthread_mutex_unlock(&r->mu);
  ddp__dist_gate_write_end(agent);
  return s;
}

static ddp_status h_destroy(ddp_rpc_call *call, const ddp_rpc_message *args,
                            ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  DDP_TRY(check(args, sizeof(step_hdr), "destroy"));
  step_hdr h;
  memcpy(&h, args->payload, sizeof h);
  optim_state *st = state_of(ddp_rpc_call_agent(call));
  pthread_mutex_lock(&st->mu);
  opt_rec *r = NULL;
  for (opt_rec **p = &st->recs; *p; p = &(*p)->next)
    if ((*p)->id == h.opt_id) {
      r = *p;
      *p = r->next;
      break;
    }
  pthread_mutex_unlock(&st->mu);
  rec_free(r);
  return DDP_OK;
}

/* ---- The caller's side -------------------------------------------------------- */

struct ddp_dist_optimizer {
  ddp_rpc_agent *agent;
  int n_owners;
  int32_t owners[MAX_OWNERS];
  int64_t ids[MAX_OWNERS];
};

static ddp_status call_owner(ddp_rpc_agent *agent, int32_t to, const char *fn,
                             const ddp_rpc_message *m, ddp_rpc_future **out) {
  return ddp__rpc_async_rank(agent, to, fn, m, -1, out);
}

static ddp_status wait_all(int n, ddp_rpc_future **f, const char *what) {
  ddp_status first = DDP_OK;
  for (int i = 0; i < n; i++) {
    if (!f[i]) continue;
    ddp_status s = ddp_rpc_future_wait(f[i], -1);
    if (s != DDP_OK && first == DDP_OK)
      first = ddp_error(s, "dist optimizer %s: %s", what, ddp_rpc_future_error(f[i]));
  }
  return first;
}

ddp_status ddp_dist_optimizer_create(ddp_rpc_agent *agent, const ddp_optim_options *options,
                                     int num_params, ddp_rref *const *params,
                                     ddp_dist_optimizer **out) {
  *out = NULL;
  if (num_params <= 0)
    return ddp_error(DDP_ERR_INVALID, "dist optimizer: no parameters given");
  ddp_dist_optimizer *o = ddp_calloc(1, sizeof *o);
  if (!o) return ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
  o->agent = agent;
  for (int i = 0; i < num_params; i++) {
    int32_t owner = ddp_rref_owner(params[i]);
    int k = 0;
    while (k < o->n_owners && o->owners[k] != owner) k++;
    if (k == o->n_owners) {
      if (k == MAX_OWNERS) {
        ddp_free(o);
        return ddp_error(DDP_ERR_RANGE, "dist optimizer: parameters on more than %d workers",
                         MAX_OWNERS);
      }
      o->owners[o->n_owners++] = owner;
    }
  }
  ddp_rpc_future *f[MAX_OWNERS] = {0};
  ddp_status s = DDP_OK;
  for (int k = 0; k < o->n_owners && s == DDP_OK; k++) {
    int n = 0;
    for (int i = 0; i < num_params; i++) n += ddp_rref_owner(params[i]) == o->owners[k];
    size_t bytes = sizeof(create_hdr) + (size_t)n * DDP_RREF_TOKEN_BYTES;
    char *buf = ddp_calloc(1, bytes);
    if (!buf) {
      s = ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
      break;
    }
    create_hdr h = {OPTIM_MAGIC, OPTIM_VERSION, *options, n, 0};
    memcpy(buf, &h, sizeof h);
    int j = 0;
    for (int i = 0; i < num_params && s == DDP_OK; i++)
      if (ddp_rref_owner(params[i]) == o->owners[k])
        s = ddp_rref_fork(params[i], buf + sizeof h + (size_t)j++ * DDP_RREF_TOKEN_BYTES);
    ddp_rpc_message m = {.payload = buf, .payload_bytes = bytes};
    if (s == DDP_OK) s = call_owner(agent, o->owners[k], "__ddp.optim.create", &m, &f[k]);
    ddp_free(buf);
  }
  if (s == DDP_OK) s = wait_all(o->n_owners, f, "create");
  for (int k = 0; k < o->n_owners; k++) {
    const ddp_rpc_message *r;
    if (f[k] && ddp_rpc_future_status(f[k]) == DDP_OK &&
        ddp_rpc_future_result(f[k], &r) == DDP_OK && r->payload_bytes == sizeof(int64_t))
      memcpy(&o->ids[k], r->payload, sizeof(int64_t));
    ddp_rpc_future_destroy(f[k]);
  }
  if (s != DDP_OK) {
    ddp_dist_optimizer_destroy(o);
    return s;
  }
  *out = o;
  return DDP_OK;
}

static ddp_status to_all(ddp_dist_optimizer *o, const char *fn, int64_t ctx_id, const char *what) {
  ddp_rpc_future *f[MAX_OWNERS] = {0};
  ddp_status s = DDP_OK;
  for (int k = 0; k < o->n_owners; k++) {
    if (!o->ids[k]) continue;
    step_hdr h = {OPTIM_MAGIC, OPTIM_VERSION, o->ids[k], ctx_id};
    ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
    ddp_status e = call_owner(o->agent, o->owners[k], fn, &m, &f[k]);
    if (e != DDP_OK && s == DDP_OK) s = e;
  }
  ddp_status w = wait_all(o->n_owners, f, what);
  for (int k = 0; k < o->n_owners; k++) ddp_rpc_future_destroy(f[k]);
  return s != DDP_OK ? s : w;
}

ddp_status ddp_dist_optimizer_step(ddp_dist_optimizer *opt, ddp_dist_context *ctx) {
  return to_all(opt, "__ddp.optim.step", ddp_dist_context_id(ctx), "step");
}

void ddp_dist_optimizer_destroy(ddp_dist_optimizer *opt) {
  if (!opt) return;
  if (to_all(opt, "__ddp.optim.destroy", 0, "destroy") != DDP_OK)
    DDP_WARN("rpc: %s", ddp_last_error());
  ddp_free(opt);
}

/* ---- The module ------------------------------------------------------------------ */

static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;
static ddp_status builtins_status;
static void register_builtins(void) {
  builtins_status = ddp__rpc_register_builtin("__ddp.optim.create", h_create, NULL);
  if (builtins_status == DDP_OK)
    builtins_status = ddp__rpc_register_builtin("__ddp.optim.step", h_step, NULL);
  if (builtins_status == DDP_OK)
    builtins_status = ddp__rpc_register_builtin("__ddp.optim.destroy", h_destroy, NULL);
}

static ddp_status mod_init(ddp_rpc_agent *agent, int slot) {
  pthread_once(&builtins_once, register_builtins);
  DDP_TRY(builtins_status);
  optim_state *st = ddp_calloc(1, sizeof *st);
  if (!st) return ddp_error(DDP_ERR_NOMEM, "dist optimizer: out of memory");
  pthread_mutex_init(&st->mu, NULL);
  *(optim_state **)ddp__rpc_module_slot(agent, slot) = st;
  return DDP_OK;
}

/* Optimizers still alive at shutdown hold references to their parameters:
 * free them before the references are checked. */
static void mod_before_shutdown(ddp_rpc_agent *agent, int slot, bool graceful) {
  (void)graceful;
  optim_state *st = *(optim_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  pthread_mutex_lock(&st->mu);
  opt_rec *r = st->recs;
  st->recs = NULL;
  pthread_mutex_unlock(&st->mu);
  while (r) {
    opt_rec *next = r->next;
    rec_free(r);
    r = next;
  }
}

static void mod_destroy(ddp_rpc_agent *agent, int slot) {
  optim_state *st = *(optim_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  while (st->recs) {
    opt_rec *next = st->recs->next;
    rec_free(st->recs);
    st->recs = next;
  }
  pthread_mutex_destroy(&st->mu);
  ddp_free(st);
  *(optim_state **)ddp__rpc_module_slot(agent, slot) = NULL;
}

const ddp__rpc_module ddp__dist_optim_module = {
    .name = "dist_optim",
    .init = mod_init,
    .before_shutdown = mod_before_shutdown,
    .destroy = mod_destroy,
};
