/* Distributed autograd (PyTorch's FAST mode, docs/rpc.md "Distributed
 * autograd"): contexts, the calls made and served within them with the
 * tensors that need gradients, the backward pass that runs each worker's
 * tape and sends gradients back along the calls, and the gate that keeps
 * parameters from being stepped while another context's backward still
 * needs their values. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc_autograd/memory_pool.h"
#include "rpc_autograd/rpc_autograd_internal.h"
#include "tensor/tape.h"

#define DIST_MAGIC 0x54534944u /* "DIST" */
#define DIST_VERSION 1u
#define MAX_GRAD_TENSORS 64 /* tensors of one call that can carry gradients (a mask) */

/* ---- Registry of dist functions (process-wide: rpc's named tables) -------- */

static ddp__name_table handlers = DDP__NAME_TABLE_INIT("dist_autograd function");

ddp_status ddp_dist_register(const char *name, ddp_dist_handler fn, void *user) {
  return ddp__name_table_set(&handlers, name, (void *)fn, user, true);
}

static bool find_handler(const char *name, ddp_dist_handler *fn, void **user) {
  void *value;
  if (!ddp__name_table_get(&handlers, name, &value, user)) return false;
  *fn = (ddp_dist_handler)value;
  return true;
}

/* ---- Records ----------------------------------------------------------------- */

/* A call this worker made within a context (the caller's side). */
typedef struct out_call {
  struct out_call *next;
  int64_t id;
  int32_t to;
  int n_req;
  ddp_tensor *req[MAX_GRAD_TENSORS]; /* request tensors needing grad (sends), in order */
  uint64_t req_mask;                 /* which of the request's tensors they were */
  ddp_tape *req_tape;                /* the tape they were made on */
  ddp_rpc_message result;            /* owned; its tensors (recv leaves) live here */
  ddp_rpc_message view;              /* what the user sees: payload past our header */
  uint64_t res_mask;                 /* result tensors needing grad */
  float *res_grad[MAX_GRAD_TENSORS];
  bool reached;                      /* a local pass gave its receives gradients */
} out_call;

/* A call served here within a context (the callee's side). */
typedef struct in_call {
  struct in_call *next;
  int32_t caller;
  int64_t id; /* the caller's out_call id */
  ddp_tape *tape;
  ddp_rpc_message args; /* taken from the engine; recv leaves live here */
  uint64_t arg_mask;
  float *arg_grad[MAX_GRAD_TENSORS];
  int n_sends;
  ddp_tensor *sends[MAX_GRAD_TENSORS]; /* reply tensors needing grad */
  uint64_t send_mask;
  void *reply_buf; /* our header + the handler's payload */
  size_t reply_bytes;
  bool pinned;     /* a backward through here is still due (the gate) */
  bool reached;
} in_call;

typedef struct grad_entry {
  struct grad_entry *next;
  const ddp_tensor *t;
  float *g;
  size_t bytes; /* of g */
} grad_entry;

typedef struct da_state da_state;

struct ddp_dist_context {
  struct ddp_dist_context *next;
  da_state *st;
  ddp_rpc_agent *agent;
  int64_t id;
  pthread_mutex_t mu;
  ddp_tape *tape;
  out_call *outs;
  in_call *ins;
  grad_entry *grads;
  int64_t next_call;
  int32_t known[64]; /* workers this one called within the context */
  int n_known;
  int pins; /* in_calls pinned */
  bool ending;
};

struct ddp_dist_call {
  ddp_dist_context *ctx;
  in_call *in;
  ddp_rpc_call *call;
  void *value;
};

struct da_state {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ddp_dist_context *contexts;
  int64_t next_id;
  ddp_tape *free_tapes[16];
  int n_free_tapes;
  /* Records and buffers of ended contexts, for the next ones. */
  ddp__dist_pool pool;
  /* The gate (docs/rpc.md "Parameters a backward needs"). */
  int writers_waiting;
  bool writer_active;
  int64_t writer_ctx;
  /* One local backward pass at a time: passes redirect shared leaves'
   * grad pointers to their context's buffers. */
  pthread_mutex_t backward_mu;
  ddp_rpc_agent *agent;
  /* What the gate cost (logged at info when the agent ends): */
  int64_t steps, steps_waited, step_wait_ns; /* optimizer steps through the gate */
  int64_t calls_waited, call_wait_ns;        /* dist calls held for a step */
};

extern const ddp__rpc_module ddp__dist_autograd_module; /* at the end of this file */
static _Thread_local ddp_dist_call *current_call;

static da_state *state_of(ddp_rpc_agent *agent) {
  /* The slot is a constant of the module list, not a global that each
   * agent's init would write (agents on several threads would race). */
  return *(da_state **)ddp__rpc_module_slot(agent, ddp__rpc_module_index(&ddp__dist_autograd_module));
}

static const char *self_name(ddp_rpc_agent *agent) { return ddp_rpc_self(agent)->name; }

typedef struct call_hdr {
  uint32_t magic, version;
  int64_t ctx_id;
  int64_t call_id;
  uint64_t mask;
  ddp__rref_id rref; /* worker -1: not a reference call */
  char fn[DDP_RPC_MAX_NAME_BYTES];
} call_hdr;

typedef struct reply_hdr {
  uint32_t magic, version;
  uint64_t mask;
} reply_hdr;

enum { GRADS_OF_REPLY = 0, GRADS_OF_REQUEST = 1 };
typedef struct backward_hdr {
  uint32_t magic, version;
  int64_t ctx_id;
  int64_t call_id;
  int32_t direction;
  int32_t caller; /* GRADS_OF_REPLY: the caller's rank (keys the in_call) */
  uint64_t mask;
} backward_hdr;

typedef struct release_hdr {
  uint32_t magic, version;
  int64_t ctx_id;
} release_hdr;

static ddp_status check_hdr(const ddp_rpc_message *m, size_t bytes, const char *what) {
  if (m->payload_bytes < bytes)
    return ddp_error(DDP_ERR_INVALID, "dist_autograd %s: payload of %zu bytes, expected at "
                     "least %zu", what, m->payload_bytes, bytes);
  uint32_t mv[2];
  memcpy(mv, m->payload, sizeof mv);
  if (mv[0] != DIST_MAGIC || mv[1] != DIST_VERSION)
    return ddp_error(DDP_ERR_INVALID, "dist_autograd %s: bad magic or version (%08x v%u)", what,
                     mv[0], mv[1]);
  return DDP_OK;
}

/* ---- Tapes (kept for reuse: a step allocates none once warm) ------------- */

static ddp_status tape_get(da_state *st, ddp_tape **out) {
  pthread_mutex_lock(&st->mu);
  *out = st->n_free_tapes ? st->free_tapes[--st->n_free_tapes] : NULL;
  pthread_mutex_unlock(&st->mu);
  if (*out) return DDP_OK;
  return ddp_tape_create(out, (size_t)1 << 20);
}

static void tape_put(da_state *st, ddp_tape *t) {
  if (!t) return;
  ddp_tape_reset(t);
  pthread_mutex_lock(&st->mu);
  if (st->n_free_tapes < (int)(sizeof st->free_tapes / sizeof st->free_tapes[0])) {
    st->free_tapes[st->n_free_tapes++] = t;
    t = NULL;
  }
  pthread_mutex_unlock(&st->mu);
  ddp_tape_destroy(t);
}

/* ---- Contexts ---------------------------------------------------------------- */

static ddp_dist_context *ctx_find_locked(da_state *st, int64_t id) {
  for (ddp_dist_context *c = st->contexts; c; c = c->next)
    if (c->id == id) return c;
  return NULL;
}

static ddp_dist_context *ctx_new_locked(da_state *st, int64_t id) {
  ddp_dist_context *c = ddp__dist_pool_get(&st->pool, sizeof *c);
  if (!c) return NULL;
  c->st = st;
  c->agent = st->agent;
  c->id = id;
  pthread_mutex_init(&c->mu, NULL);
  c->next = st->contexts;
  st->contexts = c;
  return c;
}

static ddp_status ctx_get(da_state *st, int64_t id, ddp_dist_context **out) {
  pthread_mutex_lock(&st->mu);
  ddp_dist_context *c = ctx_find_locked(st, id);
  if (!c) c = ctx_new_locked(st, id);
  pthread_mutex_unlock(&st->mu);
  *out = c;
  return c ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
}

/* Hands a received message's gradient buffers (made by make_leaves, sized
 * by its tensors) back to the pool, before the message itself is freed. */
static void put_leaf_grads(da_state *st, const ddp_rpc_message *m, float **grads) {
  for (int i = 0; i < MAX_GRAD_TENSORS; i++) {
    if (!grads[i]) continue;
    ddp__dist_pool_put(&st->pool, grads[i], (size_t)m->tensors[i]->numel * sizeof(float));
    grads[i] = NULL;
  }
}

static void put_in_call(da_state *st, in_call *in) {
  put_leaf_grads(st, &in->args, in->arg_grad);
  ddp_rpc_message_free(&in->args);
  ddp__dist_pool_put(&st->pool, in->reply_buf, in->reply_bytes);
  ddp__dist_pool_put(&st->pool, in, sizeof *in);
}

/* Unlinks and frees a context (its pins released); its records and buffers
 * go back to the worker's pool. */
static void ctx_free(da_state *st, ddp_dist_context *c) {
  pthread_mutex_lock(&st->mu);
  for (ddp_dist_context **p = &st->contexts; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  if (c->pins) pthread_cond_broadcast(&st->cv);
  c->pins = 0;
  pthread_mutex_unlock(&st->mu);
  /* Tapes first: a reset clears the counts on their leaves, and receives
   * are leaves living in the messages freed below. */
  for (in_call *in = c->ins; in; in = in->next) {
    tape_put(st, in->tape);
    in->tape = NULL;
  }
  tape_put(st, c->tape);
  c->tape = NULL;
  for (out_call *o = c->outs, *next; o; o = next) {
    next = o->next;
    put_leaf_grads(st, &o->result, o->res_grad);
    ddp_rpc_message_free(&o->result);
    ddp__dist_pool_put(&st->pool, o, sizeof *o);
  }
  for (in_call *in = c->ins, *next; in; in = next) {
    next = in->next;
    put_in_call(st, in);
  }
  for (grad_entry *g = c->grads, *next; g; g = next) {
    next = g->next;
    ddp__dist_pool_put(&st->pool, g->g, g->bytes);
    ddp__dist_pool_put(&st->pool, g, sizeof *g);
  }
  pthread_mutex_destroy(&c->mu);
  ddp__dist_pool_put(&st->pool, c, sizeof *c);
}

ddp_status ddp_dist_context_begin(ddp_rpc_agent *agent, ddp_dist_context **out) {
  *out = NULL;
  da_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  int64_t id = ((int64_t)ddp_rpc_self(agent)->rank << 40) | ++st->next_id;
  ddp_dist_context *c = ctx_new_locked(st, id);
  pthread_mutex_unlock(&st->mu);
  if (!c) return ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
  *out = c;
  return DDP_OK;
}

int64_t ddp_dist_context_id(const ddp_dist_context *ctx) { return ctx->id; }

ddp_tape *ddp_dist_context_tape(ddp_dist_context *ctx) {
  pthread_mutex_lock(&ctx->mu);
  if (!ctx->tape && tape_get(ctx->st, &ctx->tape) != DDP_OK) ctx->tape = NULL;
  ddp_tape *t = ctx->tape;
  pthread_mutex_unlock(&ctx->mu);
  return t;
}

ddp_status ddp_dist_context_retrieve(ddp_rpc_agent *agent, int64_t id, ddp_dist_context **out) {
  da_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  *out = ctx_find_locked(st, id);
  pthread_mutex_unlock(&st->mu);
  if (!*out)
    return ddp_error(DDP_ERR_NOTFOUND, "dist_autograd: worker '%s' has no context %lld (ended, "
                     "or never reached here)", self_name(agent), (long long)id);
  return DDP_OK;
}

/* Tells every worker this context reached to free it, and waits. */
static ddp_status release_known(ddp_dist_context *c) {
  release_hdr h = {DIST_MAGIC, DIST_VERSION, c->id};
  ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
  ddp_rpc_future *f[64] = {0};
  ddp_status first = DDP_OK;
  int n = c->n_known;
  for (int i = 0; i < n; i++) {
    ddp_status s = ddp__rpc_async_rank(c->agent, c->known[i], "__ddp.dist.release", &m, -1, &f[i]);
    if (s != DDP_OK && first == DDP_OK) first = s;
  }
  for (int i = 0; i < n; i++) {
    if (!f[i]) continue;
    ddp_status s = ddp_rpc_future_wait(f[i], -1);
    if (s != DDP_OK && first == DDP_OK)
      first = ddp_error(s, "dist_autograd: releasing context %lld: %s", (long long)c->id,
                        ddp_rpc_future_error(f[i]));
    ddp_rpc_future_destroy(f[i]);
  }
  return first;
}

ddp_status ddp_dist_context_end(ddp_dist_context *ctx) {
  if (!ctx) return DDP_OK;
  pthread_mutex_lock(&ctx->mu);
  ctx->ending = true;
  pthread_mutex_unlock(&ctx->mu);
  ddp_status s = release_known(ctx);
  ctx_free(ctx->st, ctx);
  return s;
}

static ddp_status h_release(ddp_rpc_call *call, const ddp_rpc_message *args,
                            ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  DDP_TRY(check_hdr(args, sizeof(release_hdr), "release"));
  release_hdr h;
  memcpy(&h, args->payload, sizeof h);
  da_state *st = state_of(ddp_rpc_call_agent(call));
  pthread_mutex_lock(&st->mu);
  ddp_dist_context *c = ctx_find_locked(st, h.ctx_id);
  bool mine = c && !c->ending;
  if (mine) c->ending = true;
  pthread_mutex_unlock(&st->mu);
  if (!mine) return DDP_OK; /* never reached here, or already ending */
  ddp_status s = release_known(c);
  ctx_free(st, c);
  return s;
}

/* ---- The gate ------------------------------------------------------------- */

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns) {
  int64_t left = deadline_ns - ddp_time_ns();
  if (left > 50000000) left = 50000000;
  if (left < 0) left = 0;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += left;
  ts.tv_sec += ts.tv_nsec / 1000000000;
  ts.tv_nsec %= 1000000000;
  pthread_cond_timedwait(cv, mu, &ts);
}

/* A dist call enters: waits while a step is waiting or running, unless its
 * context holds pins here already (it must reach its backward, which the
 * step is waiting for). Pins the call. */
static ddp_status gate_enter(da_state *st, ddp_dist_context *c, in_call *in, int64_t deadline) {
  pthread_mutex_lock(&st->mu);
  int64_t t0 = 0;
  while ((st->writer_active || st->writers_waiting) && c->pins == 0 &&
         !(st->writer_active && st->writer_ctx == c->id) && ddp_time_ns() < deadline) {
    if (!t0) t0 = ddp_time_ns();
    timed_wait(&st->cv, &st->mu, deadline);
  }
  if (t0) {
    st->calls_waited++;
    st->call_wait_ns += ddp_time_ns() - t0;
  }
  bool blocked = (st->writer_active || st->writers_waiting) && c->pins == 0 &&
                 !(st->writer_active && st->writer_ctx == c->id);
  if (!blocked) {
    in->pinned = true;
    c->pins++;
  }
  pthread_mutex_unlock(&st->mu);
  if (blocked)
    return ddp_error(DDP_ERR_TIMEOUT, "dist_autograd: worker '%s': context %lld waited past its "
                     "deadline for an optimizer step here to finish", self_name(st->agent),
                     (long long)c->id);
  return DDP_OK;
}

static void unpin(da_state *st, ddp_dist_context *c, in_call *in) {
  pthread_mutex_lock(&st->mu);
  if (in->pinned) {
    in->pinned = false;
    c->pins--;
    pthread_cond_broadcast(&st->cv);
  }
  pthread_mutex_unlock(&st->mu);
}

static bool others_pinned_locked(da_state *st, int64_t ctx_id, char *who, size_t bytes) {
  bool any = false;
  size_t len = 0;
  for (ddp_dist_context *c = st->contexts; c; c = c->next)
    if (c->id != ctx_id && c->pins > 0) {
      any = true;
      if (who && len < bytes)
        len += (size_t)snprintf(who + len, bytes - len, "%s%lld (from rank %lld)",
                                len ? ", " : "", (long long)c->id, (long long)(c->id >> 40));
    }
  return any;
}

ddp_status ddp__dist_gate_write_begin(ddp_rpc_agent *agent, int64_t ctx_id, int64_t deadline_ns) {
  da_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  st->writers_waiting++;
  int64_t t0 = 0;
  while ((st->writer_active || others_pinned_locked(st, ctx_id, NULL, 0)) &&
         ddp_time_ns() < deadline_ns) {
    if (!t0) t0 = ddp_time_ns();
    timed_wait(&st->cv, &st->mu, deadline_ns);
  }
  st->writers_waiting--;
  st->steps++;
  if (t0) {
    st->steps_waited++;
    st->step_wait_ns += ddp_time_ns() - t0;
  }
  char who[256] = "";
  bool blocked = st->writer_active || others_pinned_locked(st, ctx_id, who, sizeof who);
  if (!blocked) {
    st->writer_active = true;
    st->writer_ctx = ctx_id;
  }
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
  if (blocked)
    return ddp_error(DDP_ERR_TIMEOUT, "worker '%s': a step for context %lld timed out waiting "
                     "for the backward of context(s) %s", self_name(agent), (long long)ctx_id,
                     who[0] ? who : "(another step)");
  return DDP_OK;
}

void ddp__dist_gate_write_end(ddp_rpc_agent *agent) {
  da_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  st->writer_active = false;
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
}

/* ---- Receives and gradients ------------------------------------------------- */

/* Makes the tensors of a received message leaves; those in mask require
 * grad, with a zeroed gradient buffer of their own. */
static ddp_status make_leaves(da_state *st, const ddp_rpc_message *m, uint64_t mask,
                              float **grads) {
  for (int i = 0; i < m->num_tensors; i++) {
    ddp_tensor *t = m->tensors[i];
    t->node = -1;
    t->pending = 0;
    t->param_index = -1;
    t->flags &= ~(DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM | DDP_TENSOR_OWNS_GRAD);
    t->grad = NULL;
    if (i < MAX_GRAD_TENSORS && (mask >> i & 1)) {
      if (t->dtype != DDP_FLOAT32)
        return ddp_error(DDP_ERR_INVALID, "dist_autograd: tensor %d needs grad but is %s", i,
                         ddp_dtype_name(t->dtype));
      grads[i] = ddp__dist_pool_get(&st->pool, (size_t)t->numel * sizeof(float));
      if (!grads[i]) return ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
      t->grad = grads[i];
      t->flags |= DDP_TENSOR_REQUIRES_GRAD;
    }
  }
  return DDP_OK;
}

static uint64_t grad_mask(const ddp_rpc_message *m) {
  uint64_t mask = 0;
  for (int i = 0; m && i < m->num_tensors && i < MAX_GRAD_TENSORS; i++)
    if (m->tensors[i]->flags & DDP_TENSOR_REQUIRES_GRAD && m->tensors[i]->dtype == DDP_FLOAT32)
      mask |= 1ull << i;
  return mask;
}

/* Under c->mu: the context's gradient buffer for leaf t. */
static float *ctx_grad_locked(ddp_dist_context *c, const ddp_tensor *t) {
  for (grad_entry *g = c->grads; g; g = g->next)
    if (g->t == t) return g->g;
  size_t bytes = (size_t)t->numel * sizeof(float);
  grad_entry *g = ddp__dist_pool_get(&c->st->pool, sizeof *g);
  float *buf = g ? ddp__dist_pool_get(&c->st->pool, bytes) : NULL;
  if (!buf) {
    ddp__dist_pool_put(&c->st->pool, g, sizeof *g);
    return NULL;
  }
  g->t = t;
  g->g = buf;
  g->bytes = bytes;
  g->next = c->grads;
  c->grads = g;
  return buf;
}

const float *ddp_dist_get_gradient(ddp_dist_context *ctx, const ddp_tensor *t) {
  pthread_mutex_lock(&ctx->mu);
  const float *r = NULL;
  for (grad_entry *g = ctx->grads; g && !r; g = g->next)
    if (g->t == t) r = g->g;
  pthread_mutex_unlock(&ctx->mu);
  return r;
}

/* Under c->mu: marks the record owning receive t reached; true if t is one. */
static bool mark_receive_locked(ddp_dist_context *c, const ddp_tensor *t) {
  for (out_call *o = c->outs; o; o = o->next)
    for (int i = 0; i < o->result.num_tensors && i < MAX_GRAD_TENSORS; i++)
      if ((o->res_mask >> i & 1) && o->result.tensors[i] == t) return o->reached = true;
  for (in_call *in = c->ins; in; in = in->next)
    for (int i = 0; i < in->args.num_tensors && i < MAX_GRAD_TENSORS; i++)
      if ((in->arg_mask >> i & 1) && in->args.tensors[i] == t) return in->reached = true;
  return false;
}

static void add_into(float *dst, const float *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

/* One local pass: adds seeds[i] (the gradient of tensors[i]) and runs `tape`
 * backward from them, leaves' gradients going to the context (receives to
 * their own buffers, marked reached for propagation). */
static ddp_status local_pass(ddp_dist_context *c, ddp_tape *tape, int n, ddp_tensor *const *tensors,
                             const float *const *seeds) {
  da_state *st = c->st;
  pthread_mutex_lock(&st->backward_mu);
  pthread_mutex_lock(&c->mu);
  ddp_status s = DDP_OK;
  /* Leaves first: a sent leaf gets its gradient directly. */
  ddp_tensor *from = NULL;
  const float *from_seed = NULL;
  for (int i = 0; i < n && s == DDP_OK; i++) {
    ddp_tensor *t = tensors[i];
    if (t->node >= 0) {
      if (!from || t->node > from->node) from = t, from_seed = seeds[i];
      continue;
    }
    if (mark_receive_locked(c, t)) {
      add_into(t->grad, seeds[i], t->numel);
    } else {
      float *g = ctx_grad_locked(c, t);
      if (!g) s = ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
      else add_into(g, seeds[i], t->numel);
    }
  }
  if (s == DDP_OK && from) {
    if (!tape) {
      s = ddp_error(DDP_ERR_STATE, "dist_autograd: no tape holds the tensor sent");
      goto out;
    }
    /* Redirect the leaves' gradients: receives keep their buffers, every
     * other leaf (parameters) accumulates in the context. */
    enum { MAX_LEAVES = 256 };
    ddp_tensor *leaves[MAX_LEAVES];
    float *saved[MAX_LEAVES];
    int n_leaves = ddp__tape_num_leaves(tape);
    if (n_leaves > MAX_LEAVES) {
      s = ddp_error(DDP_ERR_RANGE, "dist_autograd: %d leaves on one tape, at most %d", n_leaves,
                    MAX_LEAVES);
      n_leaves = 0;
    }
    for (int k = 0; k < n_leaves; k++) {
      ddp_tensor *in = leaves[k] = ddp__tape_leaf(tape, k);
      saved[k] = in->grad;
      if (s != DDP_OK || mark_receive_locked(c, in)) continue;
      float *g = ctx_grad_locked(c, in);
      if (!g) s = ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
      else in->grad = g;
    }
    for (int i = 0; i < n && s == DDP_OK; i++)
      if (tensors[i]->node >= 0 && tensors[i] != from) {
        float *g = ddp__tape_grad(tape, tensors[i], &s);
        if (g) add_into(g, seeds[i], tensors[i]->numel);
      }
    if (s == DDP_OK) s = ddp__backward_from(tape, from, from_seed);
    for (int k = 0; k < n_leaves; k++)
      if (!mark_receive_locked(c, leaves[k])) leaves[k]->grad = saved[k];
  }
out:
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&st->backward_mu);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "dist_autograd: worker '%s', context %lld", self_name(c->agent),
                          (long long)c->id);
  return DDP_OK;
}

/* Sends the gradients of every reached receive back to its sender, and
 * waits for their passes (and theirs) to finish. */
static ddp_status propagate(ddp_dist_context *c) {
  enum { MAX_SENDS = 64 };
  ddp_rpc_future *f[MAX_SENDS];
  out_call *outs[MAX_SENDS];
  in_call *ins[MAX_SENDS];
  int n_outs = 0, n_ins = 0, n = 0;
  ddp_status first = DDP_OK;
  /* Which records were reached, under the lock; the sends outside it (a
   * message to this worker itself is served by a handler that takes it). */
  pthread_mutex_lock(&c->mu);
  for (out_call *o = c->outs; o; o = o->next)
    if (o->reached) {
      o->reached = false;
      if (n_outs + n_ins < MAX_SENDS) outs[n_outs++] = o;
      else first = ddp_error(DDP_ERR_RANGE, "dist_autograd: more than %d gradient messages in "
                             "one pass", MAX_SENDS);
    }
  for (in_call *in = c->ins; in; in = in->next)
    if (in->reached) {
      in->reached = false;
      if (n_outs + n_ins < MAX_SENDS) ins[n_ins++] = in;
      else first = ddp_error(DDP_ERR_RANGE, "dist_autograd: more than %d gradient messages in "
                             "one pass", MAX_SENDS);
    }
  pthread_mutex_unlock(&c->mu);
  for (int r = 0; r < n_outs + n_ins; r++) {
    out_call *o = r < n_outs ? outs[r] : NULL;
    in_call *in = r < n_outs ? NULL : ins[r - n_outs];
    const ddp_rpc_message *m = o ? &o->result : &in->args;
    uint64_t mask = o ? o->res_mask : in->arg_mask;
    backward_hdr h = {DIST_MAGIC, DIST_VERSION, c->id, o ? o->id : in->id,
                      o ? GRADS_OF_REPLY : GRADS_OF_REQUEST, ddp_rpc_self(c->agent)->rank, mask};
    ddp_tensor grads[MAX_GRAD_TENSORS];
    ddp_tensor *gp[MAX_GRAD_TENSORS];
    int k = 0;
    for (int i = 0; i < m->num_tensors && i < MAX_GRAD_TENSORS; i++)
      if (mask >> i & 1) {
        ddp_tensor *t = m->tensors[i];
        ddp_tensor_wrap(&grads[k], DDP_FLOAT32, t->ndim, t->shape, t->grad);
        gp[k] = &grads[k];
        k++;
      }
    ddp_rpc_message msg = {.payload = &h, .payload_bytes = sizeof h, .tensors = gp,
                           .num_tensors = k};
    ddp_status s = ddp__rpc_async_rank(c->agent, o ? o->to : in->caller, "__ddp.dist.backward",
                                       &msg, -1, &f[n]);
    if (s == DDP_OK) n++;
    else if (first == DDP_OK) first = s;
  }
  for (int i = 0; i < n; i++) {
    ddp_status s = ddp_rpc_future_wait(f[i], -1);
    if (s != DDP_OK && first == DDP_OK)
      first = ddp_error(s, "dist_autograd: backward of context %lld: %s", (long long)c->id,
                        ddp_rpc_future_error(f[i]));
    ddp_rpc_future_destroy(f[i]);
  }
  return first;
}

ddp_status ddp_dist_backward(ddp_dist_context *ctx, ddp_tensor *loss) {
  if (loss->numel != 1 || loss->dtype != DDP_FLOAT32)
    return ddp_error(DDP_ERR_SHAPE, "dist_autograd backward: the loss must be one float32 value");
  static const float one = 1.0f;
  const float *seed = &one;
  DDP_TRY(local_pass(ctx, ctx->tape, 1, &loss, &seed));
  return propagate(ctx);
}

static ddp_status h_backward(ddp_rpc_call *call, const ddp_rpc_message *args,
                             ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  DDP_TRY(check_hdr(args, sizeof(backward_hdr), "backward"));
  backward_hdr h;
  memcpy(&h, args->payload, sizeof h);
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  da_state *st = state_of(agent);
  ddp_dist_context *c;
  DDP_TRY(ddp_dist_context_retrieve(agent, h.ctx_id, &c));
  ddp_tensor *targets[MAX_GRAD_TENSORS];
  const float *seeds[MAX_GRAD_TENSORS];
  int n = 0;
  ddp_tape *tape = NULL;
  in_call *pinned = NULL;
  pthread_mutex_lock(&c->mu);
  ddp_status s = DDP_OK;
  if (h.direction == GRADS_OF_REPLY) {
    in_call *in = c->ins;
    while (in && !(in->caller == h.caller && in->id == h.call_id)) in = in->next;
    if (!in) {
      s = ddp_error(DDP_ERR_NOTFOUND, "dist_autograd: worker '%s' served no call %lld of rank %d "
                    "in context %lld", self_name(agent), (long long)h.call_id, h.caller,
                    (long long)h.ctx_id);
    } else {
      tape = in->tape;
      pinned = in;
      for (int i = 0; i < in->n_sends; i++) targets[n++] = in->sends[i];
      if (h.mask != in->send_mask) s = ddp_error(DDP_ERR_INVALID, "dist_autograd: gradients "
                                                 "for tensors %llx of a reply that sent %llx",
                                                 (unsigned long long)h.mask,
                                                 (unsigned long long)in->send_mask);
    }
  } else {
    out_call *o = c->outs;
    while (o && o->id != h.call_id) o = o->next;
    if (!o) {
      s = ddp_error(DDP_ERR_NOTFOUND, "dist_autograd: worker '%s' made no call %lld in context "
                    "%lld", self_name(agent), (long long)h.call_id, (long long)h.ctx_id);
    } else {
      tape = o->req_tape;
      for (int i = 0; i < o->n_req; i++) targets[n++] = o->req[i];
      if (h.mask != o->req_mask) s = ddp_error(DDP_ERR_INVALID, "dist_autograd: gradients for "
                                               "tensors %llx of a request that sent %llx",
                                               (unsigned long long)h.mask,
                                               (unsigned long long)o->req_mask);
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (s == DDP_OK && args->num_tensors != n)
    s = ddp_error(DDP_ERR_INVALID, "dist_autograd: %d gradients for %d tensors", args->num_tensors,
                  n);
  for (int i = 0; s == DDP_OK && i < n; i++) {
    if (args->tensors[i]->numel != targets[i]->numel || args->tensors[i]->dtype != DDP_FLOAT32)
      s = ddp_error(DDP_ERR_SHAPE, "dist_autograd: gradient %d has %lld values for a tensor of "
                    "%lld", i, (long long)args->tensors[i]->numel, (long long)targets[i]->numel);
    seeds[i] = ddp_tensor_f32(args->tensors[i]);
  }
  if (s == DDP_OK) s = local_pass(c, tape, n, targets, seeds);
  if (pinned) unpin(st, c, pinned);
  if (s == DDP_OK) s = propagate(c);
  return s;
}

/* ---- Calls within a context ------------------------------------------------- */

static ddp_status dist_call(ddp_dist_context *ctx, int32_t to, const char *fn, ddp__rref_id rref,
                            const ddp_rpc_message *args, double timeout_s,
                            const ddp_rpc_message **result) {
  *result = NULL;
  if (!fn || strlen(fn) >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_INVALID, "dist_autograd: a function name of 1..%d bytes is required",
                     DDP_RPC_MAX_NAME_BYTES - 1);
  out_call *o = ddp__dist_pool_get(&ctx->st->pool, sizeof *o);
  if (!o) return ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
  o->to = to;
  o->req_mask = grad_mask(args);
  for (int i = 0; args && i < args->num_tensors && i < MAX_GRAD_TENSORS; i++)
    if (o->req_mask >> i & 1) o->req[o->n_req++] = args->tensors[i];
  ddp_dist_call *cur = current_call;
  o->req_tape = cur && cur->ctx == ctx ? cur->in->tape : ddp_dist_context_tape(ctx);
  pthread_mutex_lock(&ctx->mu);
  o->id = ++ctx->next_call;
  pthread_mutex_unlock(&ctx->mu);

  call_hdr h = {DIST_MAGIC, DIST_VERSION, ctx->id, o->id, o->req_mask, rref, ""};
  snprintf(h.fn, sizeof h.fn, "%s", fn);
  size_t extra = args ? args->payload_bytes : 0;
  char stackbuf[1024];
  char *buf = sizeof h + extra <= sizeof stackbuf ? stackbuf : ddp_alloc(sizeof h + extra);
  if (!buf) {
    ddp__dist_pool_put(&ctx->st->pool, o, sizeof *o);
    return ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
  }
  memcpy(buf, &h, sizeof h);
  if (extra) memcpy(buf + sizeof h, args->payload, extra);
  ddp_rpc_message m = {.payload = buf, .payload_bytes = sizeof h + extra};
  if (args) m.tensors = args->tensors, m.num_tensors = args->num_tensors;
  ddp_rpc_future *f = NULL;
  ddp_status s = ddp__rpc_async_rank(ctx->agent, to, "__ddp.dist.call", &m, timeout_s, &f);
  if (buf != stackbuf) ddp_free(buf);
  if (s == DDP_OK) {
    s = ddp_rpc_future_wait(f, -1);
    if (s == DDP_OK) s = ddp_rpc_future_take(f, &o->result);
    else if (ddp_rpc_future_done(f)) ddp_error(s, "%s", ddp_rpc_future_error(f));
  }
  ddp_rpc_future_destroy(f);
  if (s == DDP_OK) s = check_hdr(&o->result, sizeof(reply_hdr), "reply");
  if (s == DDP_OK) {
    reply_hdr rh;
    memcpy(&rh, o->result.payload, sizeof rh);
    o->res_mask = rh.mask;
    s = make_leaves(ctx->st, &o->result, rh.mask, o->res_grad);
    o->view = o->result;
    o->view.payload = o->result.payload_bytes > sizeof rh
                          ? (const char *)o->result.payload + sizeof rh : NULL;
    o->view.payload_bytes = o->result.payload_bytes - sizeof rh;
    o->view.release = NULL;
  }
  pthread_mutex_lock(&ctx->mu);
  int k = 0;
  while (k < ctx->n_known && ctx->known[k] != to) k++;
  if (k == ctx->n_known && k < (int)(sizeof ctx->known / sizeof ctx->known[0]))
    ctx->known[ctx->n_known++] = to;
  /* Kept even when it failed: the callee may hold state for it. */
  o->next = ctx->outs;
  ctx->outs = o;
  pthread_mutex_unlock(&ctx->mu);
  if (s != DDP_OK) return s;
  *result = &o->view;
  return DDP_OK;
}

ddp_status ddp_dist_rpc_sync(ddp_dist_context *ctx, const char *to, const char *fn,
                             const ddp_rpc_message *args, double timeout_s,
                             const ddp_rpc_message **result) {
  ddp_rpc_worker_info w;
  *result = NULL;
  DDP_TRY(ddp_rpc_get_worker_info(ctx->agent, to, -1, &w));
  return dist_call(ctx, w.rank, fn, (ddp__rref_id){-1, 0, 0}, args, timeout_s, result);
}

ddp_status ddp_dist_rref_call(ddp_dist_context *ctx, ddp_rref *rref, const char *fn,
                              const ddp_rpc_message *args, double timeout_s,
                              const ddp_rpc_message **result) {
  return dist_call(ctx, ddp_rref_owner(rref), fn, ddp__rref_get_id(rref), args, timeout_s, result);
}

ddp_tape *ddp_dist_call_tape(ddp_dist_call *call) { return call->in->tape; }
ddp_dist_context *ddp_dist_call_context(ddp_dist_call *call) { return call->ctx; }
ddp_rpc_call *ddp_dist_call_rpc(ddp_dist_call *call) { return call->call; }
void *ddp_dist_call_value(ddp_dist_call *call) { return call->value; }

static ddp_status h_call(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)user;
  DDP_TRY(check_hdr(args, sizeof(call_hdr), "call"));
  call_hdr h;
  memcpy(&h, args->payload, sizeof h);
  h.fn[sizeof h.fn - 1] = '\0';
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  da_state *st = state_of(agent);
  ddp_dist_handler fn;
  void *fn_user;
  if (!find_handler(h.fn, &fn, &fn_user))
    return ddp_error(DDP_ERR_NOTFOUND, "dist function '%s' is not registered on worker '%s' "
                     "(ddp_dist_register before ddp_rpc_init)", h.fn, self_name(agent));
  ddp_dist_context *c;
  DDP_TRY(ctx_get(st, h.ctx_id, &c));
  double left = ddp_rpc_call_time_left_s(call);
  int64_t deadline = ddp_time_ns() + (int64_t)((left > 0 ? left : 0) * 1e9);
  ddp_rref_value value = {0};
  if (h.rref.worker >= 0) DDP_TRY(ddp__rref_pin(agent, h.rref, deadline, &value));

  in_call *in = ddp__dist_pool_get(&st->pool, sizeof *in);
  ddp_status s = in ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
  if (s == DDP_OK) {
    in->caller = ddp_rpc_call_caller(call)->rank;
    in->id = h.call_id;
    in->arg_mask = h.mask;
    s = ddp_rpc_call_take_args(call, &in->args);
  }
  if (s == DDP_OK) s = make_leaves(st, &in->args, h.mask, in->arg_grad);
  if (s == DDP_OK) s = tape_get(st, &in->tape);
  if (s == DDP_OK) {
    pthread_mutex_lock(&c->mu);
    in->next = c->ins;
    c->ins = in;
    pthread_mutex_unlock(&c->mu);
  } else if (in) {
    tape_put(st, in->tape);
    put_in_call(st, in);
    in = NULL;
  }
  if (s == DDP_OK) s = gate_enter(st, c, in, deadline);
  ddp_rpc_message user_reply = {0};
  if (s == DDP_OK) {
    ddp_rpc_message u = in->args;
    u.payload = u.payload_bytes > sizeof h ? (const char *)u.payload + sizeof h : NULL;
    u.payload_bytes -= sizeof h;
    u.release = NULL;
    ddp_dist_call dc = {c, in, call, value.ptr};
    ddp_dist_call *prev = current_call;
    current_call = &dc;
    s = fn(&dc, &u, &user_reply, fn_user);
    current_call = prev;
    if (s != DDP_OK) s = ddp_error_wrap(s, "dist function '%s'", h.fn);
  }
  if (s == DDP_OK) {
    in->send_mask = grad_mask(&user_reply);
    for (int i = 0; i < user_reply.num_tensors && i < MAX_GRAD_TENSORS; i++)
      if (in->send_mask >> i & 1) in->sends[in->n_sends++] = user_reply.tensors[i];
    reply_hdr rh = {DIST_MAGIC, DIST_VERSION, in->send_mask};
    in->reply_bytes = sizeof rh + user_reply.payload_bytes;
    in->reply_buf = ddp__dist_pool_get(&st->pool, in->reply_bytes);
    if (!in->reply_buf) {
      s = ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
    } else {
      memcpy(in->reply_buf, &rh, sizeof rh);
      if (user_reply.payload_bytes)
        memcpy((char *)in->reply_buf + sizeof rh, user_reply.payload, user_reply.payload_bytes);
      *reply = user_reply;
      reply->payload = in->reply_buf;
      reply->payload_bytes = sizeof rh + user_reply.payload_bytes;
    }
  }
  if (s != DDP_OK && user_reply.release) user_reply.release(user_reply.release_ctx);
  /* Nothing will flow back through a call that sent nothing needing grad. */
  if (in && (s != DDP_OK || in->n_sends == 0)) unpin(st, c, in);
  if (h.rref.worker >= 0) ddp__rref_unpin(agent, h.rref);
  return s;
}

/* ---- The module --------------------------------------------------------------- */

static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;
static ddp_status builtins_status;
static void register_builtins(void) {
  builtins_status = ddp__rpc_register_builtin("__ddp.dist.call", h_call, NULL);
  if (builtins_status == DDP_OK)
    builtins_status = ddp__rpc_register_builtin("__ddp.dist.backward", h_backward, NULL);
  if (builtins_status == DDP_OK)
    builtins_status = ddp__rpc_register_builtin("__ddp.dist.release", h_release, NULL);
}

static ddp_status mod_init(ddp_rpc_agent *agent, int slot) {
  pthread_once(&builtins_once, register_builtins);
  DDP_TRY(builtins_status);
  da_state *st = ddp_calloc(1, sizeof *st);
  if (!st) return ddp_error(DDP_ERR_NOMEM, "dist_autograd: out of memory");
  pthread_mutex_init(&st->mu, NULL);
  pthread_mutex_init(&st->backward_mu, NULL);
  pthread_cond_init(&st->cv, NULL);
  ddp__dist_pool_init(&st->pool);
  st->agent = agent;
  *(da_state **)ddp__rpc_module_slot(agent, slot) = st;
  return DDP_OK;
}

/* A dead worker's contexts will never run their backward or end: their
 * pins go, so steps waiting on them proceed. */
static void mod_worker_failed(ddp_rpc_agent *agent, int slot, int32_t rank) {
  da_state *st = *(da_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  pthread_mutex_lock(&st->mu);
  for (ddp_dist_context *c = st->contexts; c; c = c->next)
    if ((c->id >> 40) == rank && c->pins) {
      for (in_call *in = c->ins; in; in = in->next) in->pinned = false;
      c->pins = 0;
    }
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
}

static void mod_destroy(ddp_rpc_agent *agent, int slot) {
  da_state *st = *(da_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  if (st->steps)
    DDP_INFO("rpc: worker '%s': %lld optimizer steps here, %lld of them waited for other "
             "contexts' backward passes (%.1f ms in all, %.3f ms a step); %lld dist calls waited "
             "for a step (%.1f ms in all)", self_name(agent), (long long)st->steps,
             (long long)st->steps_waited, (double)st->step_wait_ns / 1e6,
             (double)st->step_wait_ns / 1e6 / (double)st->steps, (long long)st->calls_waited,
             (double)st->call_wait_ns / 1e6);
  while (st->contexts) ctx_free(st, st->contexts);
  for (int i = 0; i < st->n_free_tapes; i++) ddp_tape_destroy(st->free_tapes[i]);
  ddp__dist_pool_destroy(&st->pool);
  pthread_mutex_destroy(&st->mu);
  pthread_mutex_destroy(&st->backward_mu);
  pthread_cond_destroy(&st->cv);
  ddp_free(st);
  *(da_state **)ddp__rpc_module_slot(agent, slot) = NULL;
}

uint64_t ddp__dist_pool_misses_of(ddp_rpc_agent *agent) {
  return ddp__dist_pool_misses(&state_of(agent)->pool);
}

const ddp__rpc_module ddp__dist_autograd_module = {
    .name = "dist_autograd",
    .init = mod_init,
    .worker_failed = mod_worker_failed,
    .destroy = mod_destroy,
};
