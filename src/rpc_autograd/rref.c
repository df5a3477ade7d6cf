/* Remote references (PyTorch's RRef protocol, docs/rpc.md "Remote
 * references"): the owner's table of values and the forks that reach them,
 * users' references, and the messages between them (create, fork request,
 * child acceptance, delete, fetch, method call). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc_autograd/rpc_autograd_internal.h"

#define RREF_MAGIC 0x46455252u /* "RREF" */
#define RREF_VERSION 1u

enum { PENDING = 0, READY = 1, FAILED = 2 };

/* ---- Registries of ctors and methods (process-wide: rpc's named tables) --- */

static ddp__name_table ctors = DDP__NAME_TABLE_INIT("rref ctor");
static ddp__name_table methods = DDP__NAME_TABLE_INIT("rref method");

ddp_status ddp_rref_register_ctor(const char *name, ddp_rref_ctor fn, void *user) {
  return ddp__name_table_set(&ctors, name, (void *)fn, user, true);
}
ddp_status ddp_rref_register_method(const char *name, ddp_rref_method fn, void *user) {
  return ddp__name_table_set(&methods, name, (void *)fn, user, true);
}

/* ---- State ------------------------------------------------------------- */

typedef struct fork_rec {
  ddp__rref_id id;
  int32_t holder; /* the rank holding it; -1 while in flight from the owner */
} fork_rec;

typedef struct rref_state rref_state;

/* A value on its owner and every fork that reaches it. */
typedef struct owner_ref {
  struct owner_ref *next;
  rref_state *st;
  ddp__rref_id id;
  char name[112];
  int state;
  ddp_rref_value value;
  ddp_status error_status;
  char error[384];
  fork_rec *forks;
  int n_forks, cap_forks;
  ddp_tensor *tensor[1]; /* the value as a reply's tensor list, when it is one */
  int local_handles; /* references held on the owner itself */
  int pins;          /* uses in progress (a fetch being sent, a method running) */
} owner_ref;

struct ddp_rref {
  struct ddp_rref *next; /* st->users (user references) */
  ddp_rpc_agent *agent;
  rref_state *st;
  ddp__rref_id id, fork;
  int32_t owner;
  bool is_owner;
  bool confirmed;      /* the owner knows this fork */
  bool confirm_failed; /* it never will (owner gone): nothing to delete */
  bool released, delete_sent;
  int inflight; /* messages about it not yet answered: it is freed only after */
  ddp__rref_id *children; /* forks passed on, not yet known to the owner */
  int n_children, cap_children;
  char name[112];
};

struct rref_state {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  owner_ref *owned;
  ddp_rref *users;
  int64_t next_local;
  int64_t outstanding; /* messages sent, not yet acknowledged */
  ddp_rpc_agent *agent;
};

extern const ddp__rpc_module ddp__rref_module; /* at the end of this file */

static rref_state *state_of(ddp_rpc_agent *agent) {
  /* The slot is a constant of the module list, not a global that each
   * agent's init would write (agents on several threads would race). */
  return *(rref_state **)ddp__rpc_module_slot(agent, ddp__rpc_module_index(&ddp__rref_module));
}

static bool id_eq(ddp__rref_id a, ddp__rref_id b) {
  return a.worker == b.worker && a.local == b.local;
}

static const char *self_name(ddp_rpc_agent *agent) { return ddp_rpc_self(agent)->name; }

static const char *rank_name(ddp_rpc_agent *agent, int32_t rank, ddp_rpc_worker_info *buf) {
  if (ddp_rpc_get_worker_info(agent, NULL, rank, buf) != DDP_OK) return "?";
  return buf->name;
}

static void make_name(char *dst, size_t bytes, ddp_rpc_agent *agent, ddp__rref_id id,
                      const char *label, int32_t owner) {
  ddp_rpc_worker_info w;
  snprintf(dst, bytes, "rref %d:%lld (%s) on '%s'", id.worker, (long long)id.local,
           label && label[0] ? label : "value", rank_name(agent, owner, &w));
}

/* The wire header of every reference message; a user payload may follow. */
typedef struct rref_hdr {
  uint32_t magic, version;
  ddp__rref_id id, fork;
  int32_t parent;
  int32_t reserved;
  char fn[DDP_RPC_MAX_NAME_BYTES]; /* ctor or method; the label in a token */
} rref_hdr;

typedef struct rref_token {
  rref_hdr h;
  int32_t owner;
  int32_t reserved2;
} rref_token;
_Static_assert(sizeof(rref_token) <= DDP_RREF_TOKEN_BYTES, "token too large");

static ddp_status parse_hdr(const ddp_rpc_message *args, rref_hdr *h, const char *what) {
  if (args->payload_bytes < sizeof *h)
    return ddp_error(DDP_ERR_INVALID, "rref %s: payload of %zu bytes, expected at least %zu",
                     what, args->payload_bytes, sizeof *h);
  memcpy(h, args->payload, sizeof *h);
  if (h->magic != RREF_MAGIC || h->version != RREF_VERSION)
    return ddp_error(DDP_ERR_INVALID, "rref %s: bad magic or version (%08x v%u)", what, h->magic,
                     h->version);
  h->fn[sizeof h->fn - 1] = '\0';
  return DDP_OK;
}

/* The user's part of a message past the header. */
static ddp_rpc_message user_part(const ddp_rpc_message *args) {
  ddp_rpc_message m = *args;
  m.payload = args->payload_bytes > sizeof(rref_hdr)
                  ? (const char *)args->payload + sizeof(rref_hdr) : NULL;
  m.payload_bytes = args->payload_bytes - sizeof(rref_hdr);
  m.release = NULL;
  return m;
}

/* ---- The owner's table --------------------------------------------------- */

static owner_ref *owner_find(rref_state *st, ddp__rref_id id) {
  for (owner_ref *e = st->owned; e; e = e->next)
    if (id_eq(e->id, id)) return e;
  return NULL;
}

static owner_ref *owner_get(rref_state *st, ddp__rref_id id, const char *label) {
  owner_ref *e = owner_find(st, id);
  if (e) return e;
  e = ddp_calloc(1, sizeof *e);
  if (!e) return NULL;
  e->st = st;
  e->id = id;
  make_name(e->name, sizeof e->name, st->agent, id, label, ddp_rpc_self(st->agent)->rank);
  e->next = st->owned;
  st->owned = e;
  return e;
}

static bool fork_add(owner_ref *e, ddp__rref_id fork, int32_t holder) {
  if (e->n_forks == e->cap_forks) {
    int cap = e->cap_forks ? 2 * e->cap_forks : 4;
    fork_rec *f = ddp_calloc((size_t)cap, sizeof *f);
    if (!f) return false;
    if (e->n_forks) memcpy(f, e->forks, (size_t)e->n_forks * sizeof *f);
    ddp_free(e->forks);
    e->forks = f;
    e->cap_forks = cap;
  }
  e->forks[e->n_forks++] = (fork_rec){fork, holder};
  return true;
}

static bool fork_remove(owner_ref *e, ddp__rref_id fork) {
  for (int i = 0; i < e->n_forks; i++)
    if (id_eq(e->forks[i].id, fork)) {
      e->forks[i] = e->forks[--e->n_forks];
      return true;
    }
  return false;
}

/* Under st->mu: unlinks e if nothing reaches it any more; the caller then
 * frees it with owner_free outside the lock (destroy may take locks). */
static bool owner_unlink_if_dead(rref_state *st, owner_ref *e) {
  if (e->state == PENDING || e->n_forks || e->local_handles || e->pins) return false;
  for (owner_ref **p = &st->owned; *p; p = &(*p)->next)
    if (*p == e) {
      *p = e->next;
      return true;
    }
  return false;
}

static void owner_free(owner_ref *e) {
  if (!e) return;
  if (e->state == READY && e->value.destroy) e->value.destroy(e->value.ptr, e->value.user);
  ddp_free(e->forks);
  ddp_free(e);
}

ddp_status ddp__rref_pin(ddp_rpc_agent *agent, ddp__rref_id id, int64_t deadline_ns,
                         ddp_rref_value *out) {
  rref_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_find(st, id);
  /* A use can overtake the create (or fork) that tells the owner of the
   * reference: the user holds it, so the owner will learn of it. Wait. */
  while (!e || e->state == PENDING) {
    int64_t now = ddp_time_ns();
    if (now >= deadline_ns) break;
    /* The condvar runs on CLOCK_REALTIME: wait in slices, re-checking the
     * monotonic deadline. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t slice = deadline_ns - now < 50000000 ? deadline_ns - now : 50000000;
    ts.tv_nsec += slice;
    ts.tv_sec += ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    pthread_cond_timedwait(&st->cv, &st->mu, &ts);
    e = owner_find(st, id);
  }
  ddp_status s = DDP_OK;
  if (!e)
    s = ddp_error(DDP_ERR_NOTFOUND, "rref %d:%lld: worker '%s' owns no such reference (not "
                  "created here before the deadline, or freed)", id.worker, (long long)id.local,
                  self_name(agent));
  else if (e->state == PENDING)
    s = ddp_error(DDP_ERR_TIMEOUT, "%s: its value is still being made (timed out waiting)",
                  e->name);
  else if (e->state == FAILED)
    s = ddp_error(e->error_status, "%s: %s", e->name, e->error);
  else {
    e->pins++;
    *out = e->value;
  }
  pthread_mutex_unlock(&st->mu);
  return s;
}

static void unpin_entry(rref_state *st, owner_ref *e) {
  pthread_mutex_lock(&st->mu);
  e->pins--;
  bool dead = owner_unlink_if_dead(st, e);
  pthread_mutex_unlock(&st->mu);
  if (dead) owner_free(e);
}

void ddp__rref_unpin(ddp_rpc_agent *agent, ddp__rref_id id) {
  rref_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_find(st, id);
  pthread_mutex_unlock(&st->mu);
  if (e) unpin_entry(st, e);
}

/* ---- Sending reference messages ------------------------------------------ */

typedef enum { MSG_CREATE, MSG_FORK, MSG_ACCEPT, MSG_DELETE } msg_kind;
static const char *const msg_fn[] = {"__ddp.rref.create", "__ddp.rref.fork",
                                     "__ddp.rref.accept", "__ddp.rref.delete"};

typedef struct pending_msg {
  rref_state *st;
  ddp_rref *rref; /* the user reference it is about (NULL for accepts) */
  msg_kind kind;
  int32_t parent; /* MSG_FORK: whom to tell once the owner knows */
} pending_msg;

static void after_message(ddp_rpc_future *f, void *user);

/* Sends a reference message (counted until acknowledged). */
static ddp_status send_msg(rref_state *st, int32_t to, msg_kind kind, ddp_rref *rref,
                           const rref_hdr *h, const ddp_rpc_message *user_args,
                           double timeout_s, int32_t parent) {
  pending_msg *pm = ddp_calloc(1, sizeof *pm);
  if (!pm) return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  *pm = (pending_msg){st, rref, kind, parent};
  size_t extra = user_args ? user_args->payload_bytes : 0;
  char stackbuf[512];
  char *buf = sizeof *h + extra <= sizeof stackbuf ? stackbuf : ddp_calloc(1, sizeof *h + extra);
  if (!buf) {
    ddp_free(pm);
    return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  }
  memcpy(buf, h, sizeof *h);
  if (extra) memcpy(buf + sizeof *h, user_args->payload, extra);
  ddp_rpc_message m = {.payload = buf, .payload_bytes = sizeof *h + extra};
  if (user_args) m.tensors = user_args->tensors, m.num_tensors = user_args->num_tensors;
  pthread_mutex_lock(&st->mu);
  st->outstanding++;
  if (rref) rref->inflight++;
  pthread_mutex_unlock(&st->mu);
  ddp_rpc_future *f = NULL;
  ddp_status s = ddp__rpc_async_rank(st->agent, to, msg_fn[kind], &m, timeout_s, &f);
  if (buf != stackbuf) ddp_free(buf);
  if (s == DDP_OK) s = ddp_rpc_future_then(f, after_message, pm);
  if (s != DDP_OK) {
    /* The callback never runs: account here as a failed delivery. */
    if (f) {
      ddp_rpc_future_fail(f, s, "%s", ddp_last_error());
      ddp_rpc_future_destroy(f);
      return s;
    }
    after_message(NULL, pm);
    return s;
  }
  ddp_rpc_future_destroy(f);
  return DDP_OK;
}

static void user_unlink_free(rref_state *st, ddp_rref *r) {
  for (ddp_rref **p = &st->users; *p; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      break;
    }
  ddp_free(r->children);
  ddp_free(r);
}

/* Under st->mu: what a user reference needs next. Returns true when a
 * delete must be sent (outside the lock); frees r when nothing is left. */
static bool user_progress_locked(rref_state *st, ddp_rref *r) {
  if (!r->released || r->n_children || r->inflight) return false;
  if (r->confirm_failed) {
    user_unlink_free(st, r);
    return false;
  }
  if (!r->confirmed || r->delete_sent) return false;
  r->delete_sent = true;
  return true;
}

/* A failure to send is reported (and r freed) by after_message. */
static void send_delete(rref_state *st, ddp_rref *r) {
  rref_hdr h = {.magic = RREF_MAGIC, .version = RREF_VERSION, .id = r->id, .fork = r->fork};
  (void)send_msg(st, r->owner, MSG_DELETE, r, &h, NULL, -1, -1);
}

static void after_message(ddp_rpc_future *f, void *user) {
  pending_msg *pm = user;
  rref_state *st = pm->st;
  ddp_status s = f ? ddp_rpc_future_status(f) : DDP_ERR_CLOSED;
  ddp_rref *r = pm->rref;
  bool del = false, accept = false;
  pthread_mutex_lock(&st->mu);
  if (r) r->inflight--;
  switch (pm->kind) {
  case MSG_CREATE:
  case MSG_FORK:
    if (s == DDP_OK) {
      r->confirmed = true;
      accept = pm->kind == MSG_FORK && pm->parent >= 0;
    } else {
      r->confirm_failed = true;
      DDP_WARN("rpc: worker '%s': %s: the owner did not confirm it: %s", self_name(st->agent),
               r->name, f ? ddp_rpc_future_error(f) : ddp_last_error());
    }
    del = user_progress_locked(st, r);
    break;
  case MSG_DELETE:
    if (s != DDP_OK && !r->confirm_failed)
      DDP_WARN("rpc: worker '%s': %s: delete failed: %s", self_name(st->agent), r->name,
               f ? ddp_rpc_future_error(f) : ddp_last_error());
    user_unlink_free(st, r);
    r = NULL;
    break;
  case MSG_ACCEPT:
    if (s != DDP_OK)
      DDP_WARN("rpc: worker '%s': telling a parent that a reference arrived failed: %s",
               self_name(st->agent), f ? ddp_rpc_future_error(f) : ddp_last_error());
    break;
  }
  rref_hdr h = {0};
  if (accept) h = (rref_hdr){.magic = RREF_MAGIC, .version = RREF_VERSION, .id = r->id,
                             .fork = r->fork};
  pthread_mutex_unlock(&st->mu);
  /* The child is known to the owner: its parent may now let go (G2). */
  if (accept) send_msg(st, pm->parent, MSG_ACCEPT, NULL, &h, NULL, -1, -1);
  if (del) send_delete(st, r);
  pthread_mutex_lock(&st->mu);
  st->outstanding--;
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
  ddp_free(pm);
}

/* ---- Handlers (on the owner, or on a parent for accepts) ----------------- */

static ddp_status h_create(ddp_rpc_call *call, const ddp_rpc_message *args,
                           ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "create"));
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  rref_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_get(st, h.id, h.fn);
  /* The creator's fork first, so that a delete racing the ctor finds it. */
  bool ok = e && (h.fork.worker < 0 || fork_add(e, h.fork, ddp_rpc_call_caller(call)->rank));
  pthread_mutex_unlock(&st->mu);
  if (!ok) return ddp_error(DDP_ERR_NOMEM, "rref create: out of memory");

  void *fn = NULL, *fn_user = NULL;
  ddp_rref_value v = {0};
  ddp_status s;
  if (!ddp__name_table_get(&ctors, h.fn, &fn, &fn_user)) {
    s = ddp_error(DDP_ERR_NOTFOUND, "ctor '%s' is not registered on worker '%s' "
                  "(ddp_rref_register_ctor before ddp_rpc_init)", h.fn, self_name(agent));
  } else {
    ddp_rpc_message u = user_part(args);
    s = ((ddp_rref_ctor)fn)(call, &u, &v, fn_user);
  }
  pthread_mutex_lock(&st->mu);
  if (s == DDP_OK) {
    e->value = v;
    e->tensor[0] = v.is_tensor ? v.ptr : NULL;
    e->state = READY;
  } else {
    e->state = FAILED;
    e->error_status = s;
    snprintf(e->error, sizeof e->error, "ctor '%s' failed on worker '%s': %s", h.fn,
             self_name(agent), ddp_last_error());
  }
  pthread_cond_broadcast(&st->cv);
  bool dead = owner_unlink_if_dead(st, e);
  pthread_mutex_unlock(&st->mu);
  if (dead) owner_free(e);
  /* Confirms the fork whatever the ctor did: its error is the value's. */
  return DDP_OK;
}

/* Fault injection for tests: DDP_RREF_TEST_FORK_DELAY_MS holds each fork
 * request that long before the owner registers it, so that a parent's
 * release races it (test_rref shows G2 holds). Read once. */
static int64_t fork_delay_ms(void) {
  static _Atomic int64_t cached = -1;
  int64_t v = atomic_load(&cached);
  if (v < 0) {
    if (ddp_env_int("DDP_RREF_TEST_FORK_DELAY_MS", 0, &v) != DDP_OK || v < 0) v = 0;
    atomic_store(&cached, v);
  }
  return v;
}

static ddp_status h_fork(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)reply, (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "fork"));
  int64_t delay = fork_delay_ms();
  if (delay > 0) {
    struct timespec ts = {(time_t)(delay / 1000), (long)(delay % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  rref_state *st = state_of(ddp_rpc_call_agent(call));
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_get(st, h.id, h.fn);
  bool ok = e && fork_add(e, h.fork, ddp_rpc_call_caller(call)->rank);
  pthread_mutex_unlock(&st->mu);
  return ok ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "rref fork: out of memory");
}

static ddp_status h_delete(ddp_rpc_call *call, const ddp_rpc_message *args,
                           ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "delete"));
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  rref_state *st = state_of(agent);
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_find(st, h.id);
  bool known = e && fork_remove(e, h.fork);
  bool dead = known && owner_unlink_if_dead(st, e);
  pthread_mutex_unlock(&st->mu);
  if (dead) owner_free(e);
  if (!known)
    return ddp_error(DDP_ERR_NOTFOUND, "rref %d:%lld: worker '%s' knows no fork %d:%lld of it "
                     "(deleted twice?)", h.id.worker, (long long)h.id.local, self_name(agent),
                     h.fork.worker, (long long)h.fork.local);
  return DDP_OK;
}

static ddp_status h_accept(ddp_rpc_call *call, const ddp_rpc_message *args,
                           ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "accept"));
  rref_state *st = state_of(ddp_rpc_call_agent(call));
  ddp_rref *found = NULL;
  bool del = false;
  pthread_mutex_lock(&st->mu);
  for (ddp_rref *r = st->users; r && !found; r = r->next)
    for (int i = 0; i < r->n_children; i++)
      if (id_eq(r->children[i], h.fork)) {
        r->children[i] = r->children[--r->n_children];
        found = r;
        del = user_progress_locked(st, r);
        break;
      }
  pthread_mutex_unlock(&st->mu);
  if (del) send_delete(st, found);
  if (!found)
    return ddp_error(DDP_ERR_NOTFOUND, "rref accept: worker '%s' passed on no fork %d:%lld",
                     self_name(st->agent), h.fork.worker, (long long)h.fork.local);
  return DDP_OK;
}

static void release_fetch(void *ctx) {
  owner_ref *e = ctx;
  unpin_entry(e->st, e);
}

static int64_t call_deadline(ddp_rpc_call *call) {
  double left = ddp_rpc_call_time_left_s(call);
  return ddp_time_ns() + (int64_t)((left > 0 ? left : 0) * 1e9);
}

static ddp_status h_fetch(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "fetch"));
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  rref_state *st = state_of(agent);
  ddp_rref_value v;
  DDP_TRY(ddp__rref_pin(agent, h.id, call_deadline(call), &v));
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_find(st, h.id);
  pthread_mutex_unlock(&st->mu);
  if (!v.is_tensor) {
    unpin_entry(st, e);
    return ddp_error(DDP_ERR_INVALID, "%s holds an object, not a tensor: to_here copies tensors; "
                     "call a method on it (ddp_rref_rpc_sync)", e->name);
  }
  /* Sent straight from the value, which stays pinned until it is sent. */
  reply->tensors = e->tensor; /* set when the value was made */
  reply->num_tensors = 1;
  reply->release = release_fetch;
  reply->release_ctx = e;
  return DDP_OK;
}

static ddp_status h_call(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)user;
  rref_hdr h;
  DDP_TRY(parse_hdr(args, &h, "call"));
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  void *fn = NULL, *fn_user = NULL;
  if (!ddp__name_table_get(&methods, h.fn, &fn, &fn_user))
    return ddp_error(DDP_ERR_NOTFOUND, "method '%s' is not registered on worker '%s' "
                     "(ddp_rref_register_method before ddp_rpc_init)", h.fn, self_name(agent));
  ddp_rref_value v;
  DDP_TRY(ddp__rref_pin(agent, h.id, call_deadline(call), &v));
  ddp_rpc_message u = user_part(args);
  ddp_status s = ((ddp_rref_method)fn)(call, v.ptr, &u, reply, fn_user);
  ddp__rref_unpin(agent, h.id);
  return s;
}

/* ---- The user's API -------------------------------------------------------- */

static ddp__rref_id new_id(rref_state *st) {
  pthread_mutex_lock(&st->mu);
  ddp__rref_id id = {ddp_rpc_self(st->agent)->rank, 0, ++st->next_local};
  pthread_mutex_unlock(&st->mu);
  return id;
}

static ddp_rref *handle_new(rref_state *st, ddp__rref_id id, int32_t owner, const char *label) {
  ddp_rref *r = ddp_calloc(1, sizeof *r);
  if (!r) return NULL;
  r->agent = st->agent;
  r->st = st;
  r->id = id;
  r->owner = owner;
  r->is_owner = owner == ddp_rpc_self(st->agent)->rank;
  make_name(r->name, sizeof r->name, st->agent, id, label, owner);
  return r;
}

ddp_status ddp_rref_remote(ddp_rpc_agent *agent, const char *to, const char *ctor,
                           const ddp_rpc_message *args, double timeout_s, ddp_rref **out) {
  *out = NULL;
  if (!ctor || strlen(ctor) >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_INVALID, "rref remote: a ctor name of 1..%d bytes is required",
                     DDP_RPC_MAX_NAME_BYTES - 1);
  ddp_rpc_worker_info w;
  DDP_TRY(ddp_rpc_get_worker_info(agent, to, -1, &w));
  rref_state *st = state_of(agent);
  ddp__rref_id id = new_id(st);
  ddp_rref *r = handle_new(st, id, w.rank, ctor);
  if (!r) return ddp_error(DDP_ERR_NOMEM, "rref remote: out of memory");
  rref_hdr h = {.magic = RREF_MAGIC, .version = RREF_VERSION, .id = id, .fork = {-1, 0, 0}};
  snprintf(h.fn, sizeof h.fn, "%s", ctor);
  if (r->is_owner) {
    /* On ourselves: an owner's handle; the ctor runs on the pool. */
    pthread_mutex_lock(&st->mu);
    owner_ref *e = owner_get(st, id, ctor);
    if (e) e->local_handles++;
    pthread_mutex_unlock(&st->mu);
    if (!e) {
      ddp_free(r);
      return ddp_error(DDP_ERR_NOMEM, "rref remote: out of memory");
    }
    ddp_status s = send_msg(st, w.rank, MSG_CREATE, NULL, &h, args, timeout_s, -1);
    if (s != DDP_OK) {
      ddp_rref_release(r);
      return s;
    }
    *out = r;
    return DDP_OK;
  }
  r->fork = new_id(st);
  h.fork = r->fork;
  pthread_mutex_lock(&st->mu);
  r->next = st->users;
  st->users = r;
  pthread_mutex_unlock(&st->mu);
  ddp_status s = send_msg(st, w.rank, MSG_CREATE, r, &h, args, timeout_s, -1);
  if (s != DDP_OK) {
    /* after_message marked it confirm_failed; drop it. */
    ddp_rref_release(r);
    return s;
  }
  *out = r;
  return DDP_OK;
}

ddp_status ddp_rref_create_local(ddp_rpc_agent *agent, const ddp_rref_value *value,
                                 const char *name, ddp_rref **out) {
  *out = NULL;
  rref_state *st = state_of(agent);
  ddp__rref_id id = new_id(st);
  ddp_rref *r = handle_new(st, id, ddp_rpc_self(agent)->rank, name);
  if (!r) return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  pthread_mutex_lock(&st->mu);
  owner_ref *e = owner_get(st, id, name);
  if (e) {
    e->value = *value;
    e->tensor[0] = value->is_tensor ? value->ptr : NULL;
    e->state = READY;
    e->local_handles = 1;
  }
  pthread_mutex_unlock(&st->mu);
  if (!e) {
    ddp_free(r);
    return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  }
  *out = r;
  return DDP_OK;
}

static int64_t deadline_after(ddp_rpc_agent *agent, double timeout_s) {
  (void)agent;
  if (timeout_s <= 0) timeout_s = DDP_RPC_DEFAULT_TIMEOUT_S;
  return ddp_time_ns() + (int64_t)(timeout_s * 1e9);
}

/* A call to the owner with a reference header, waited for. */
static ddp_status owner_call(ddp_rref *r, const char *fn, const char *label,
                             const ddp_rpc_message *args, double timeout_s,
                             ddp_rpc_message *out) {
  rref_hdr h = {.magic = RREF_MAGIC, .version = RREF_VERSION, .id = r->id, .fork = r->fork};
  if (label) snprintf(h.fn, sizeof h.fn, "%s", label);
  size_t extra = args ? args->payload_bytes : 0;
  char *buf = ddp_calloc(1, sizeof h + extra);
  if (!buf) return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  memcpy(buf, &h, sizeof h);
  if (extra) memcpy(buf + sizeof h, args->payload, extra);
  ddp_rpc_message m = {.payload = buf, .payload_bytes = sizeof h + extra};
  if (args) m.tensors = args->tensors, m.num_tensors = args->num_tensors;
  ddp_rpc_future *f = NULL;
  ddp_status s = ddp__rpc_async_rank(r->agent, r->owner, fn, &m, timeout_s, &f);
  ddp_free(buf);
  if (s == DDP_OK) s = ddp_rpc_future_wait(f, -1);
  if (s == DDP_OK) s = ddp_rpc_future_take(f, out);
  else if (f && ddp_rpc_future_done(f)) ddp_error(s, "%s", ddp_rpc_future_error(f));
  ddp_rpc_future_destroy(f);
  if (s != DDP_OK) return ddp_error_wrap(s, "%s", r->name);
  return DDP_OK;
}

ddp_status ddp_rref_to_here(ddp_rref *r, double timeout_s, ddp_rpc_message *out) {
  memset(out, 0, sizeof *out);
  if (!r->is_owner) return owner_call(r, "__ddp.rref.fetch", NULL, NULL, timeout_s, out);
  ddp_rref_value v;
  DDP_TRY(ddp__rref_pin(r->agent, r->id, deadline_after(r->agent, timeout_s), &v));
  ddp_status s;
  if (!v.is_tensor) {
    s = ddp_error(DDP_ERR_INVALID, "%s holds an object, not a tensor: to_here copies tensors",
                  r->name);
  } else {
    ddp_tensor *t[1] = {v.ptr};
    ddp_rpc_message m = {.tensors = t, .num_tensors = 1};
    ddp__rpc_block *b;
    s = ddp__rpc_message_copy(&m, 0, &b);
    if (s == DDP_OK) *out = b->msg;
  }
  ddp__rref_unpin(r->agent, r->id);
  return s;
}

ddp_status ddp_rref_local_value(ddp_rref *r, void **out) {
  *out = NULL;
  if (!r->is_owner) {
    ddp_rpc_worker_info w;
    return ddp_error(DDP_ERR_STATE, "%s: local_value on worker '%s', which is not its owner "
                     "('%s'); use to_here or a method call", r->name, self_name(r->agent),
                     rank_name(r->agent, r->owner, &w));
  }
  ddp_rref_value v;
  DDP_TRY(ddp__rref_pin(r->agent, r->id, deadline_after(r->agent, -1), &v));
  *out = v.ptr;
  /* The owner's own handle keeps the value alive: no pin needed past this. */
  ddp__rref_unpin(r->agent, r->id);
  return DDP_OK;
}

ddp_status ddp_rref_rpc_sync(ddp_rref *r, const char *method, const ddp_rpc_message *args,
                             double timeout_s, ddp_rpc_message *out) {
  memset(out, 0, sizeof *out);
  if (!method || strlen(method) >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_INVALID, "%s: a method name of 1..%d bytes is required", r->name,
                     DDP_RPC_MAX_NAME_BYTES - 1);
  return owner_call(r, "__ddp.rref.call", method, args, timeout_s, out);
}

int32_t ddp_rref_owner(const ddp_rref *r) { return r->owner; }
bool ddp_rref_is_owner(const ddp_rref *r) { return r->is_owner; }
const char *ddp_rref_name(const ddp_rref *r) { return r->name; }
const char *ddp_rref_owner_name(const ddp_rref *r) {
  static _Thread_local ddp_rpc_worker_info w;
  return rank_name(r->agent, r->owner, &w);
}
ddp__rref_id ddp__rref_get_id(const ddp_rref *r) { return r->id; }
ddp_rpc_agent *ddp__rref_agent(const ddp_rref *r) { return r->agent; }

ddp_status ddp_rref_fork(ddp_rref *r, void *token) {
  if (!r || !token) return ddp_error(DDP_ERR_INVALID, "rref fork: a reference and a token buffer "
                                     "are required");
  rref_state *st = r->st;
  rref_token t = {0};
  t.h.magic = RREF_MAGIC;
  t.h.version = RREF_VERSION;
  t.h.id = r->id;
  t.h.parent = ddp_rpc_self(r->agent)->rank;
  t.owner = r->owner;
  /* The label: what the name says between parentheses. */
  const char *lp = strchr(r->name, '('), *rp = lp ? strchr(lp, ')') : NULL;
  if (lp && rp) snprintf(t.h.fn, sizeof t.h.fn, "%.*s", (int)(rp - lp - 1), lp + 1);
  ddp__rref_id fork = new_id(st);
  t.h.fork = fork;
  ddp_status s = DDP_OK;
  pthread_mutex_lock(&st->mu);
  if (r->released) {
    s = ddp_error(DDP_ERR_STATE, "%s: passed on after ddp_rref_release", r->name);
  } else if (r->is_owner) {
    /* The owner knows the child at once. */
    owner_ref *e = owner_find(st, r->id);
    if (!e || !fork_add(e, fork, -1)) s = ddp_error(DDP_ERR_NOMEM, "rref fork: out of memory");
  } else {
    /* G2: this reference stays until the owner has the child. */
    if (r->n_children == r->cap_children) {
      int cap = r->cap_children ? 2 * r->cap_children : 4;
      ddp__rref_id *c = ddp_calloc((size_t)cap, sizeof *c);
      if (!c) s = ddp_error(DDP_ERR_NOMEM, "rref fork: out of memory");
      else {
        if (r->n_children) memcpy(c, r->children, (size_t)r->n_children * sizeof *c);
        ddp_free(r->children);
        r->children = c;
        r->cap_children = cap;
      }
    }
    if (s == DDP_OK) r->children[r->n_children++] = fork;
  }
  pthread_mutex_unlock(&st->mu);
  if (s == DDP_OK) {
    memset(token, 0, DDP_RREF_TOKEN_BYTES);
    memcpy(token, &t, sizeof t);
  }
  return s;
}

ddp_status ddp_rref_from_token(ddp_rpc_agent *agent, const void *token, ddp_rref **out) {
  *out = NULL;
  rref_token t;
  memcpy(&t, token, sizeof t);
  if (t.h.magic != RREF_MAGIC || t.h.version != RREF_VERSION)
    return ddp_error(DDP_ERR_INVALID, "rref token: bad magic or version (%08x v%u)", t.h.magic,
                     t.h.version);
  t.h.fn[sizeof t.h.fn - 1] = '\0';
  rref_state *st = state_of(agent);
  int32_t me = ddp_rpc_self(agent)->rank;
  ddp_rref *r = handle_new(st, t.h.id, t.owner, t.h.fn);
  if (!r) return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  rref_hdr h = t.h;
  if (t.owner == me) {
    /* Back on the owner: a local handle; the fork in flight ends here. */
    pthread_mutex_lock(&st->mu);
    owner_ref *e = owner_find(st, t.h.id);
    if (e) {
      e->local_handles++;
      if (t.h.parent == me) fork_remove(e, t.h.fork);
    }
    pthread_mutex_unlock(&st->mu);
    if (!e) {
      ddp_free(r);
      return ddp_error(DDP_ERR_NOTFOUND, "rref token: worker '%s' owns no reference %d:%lld",
                       self_name(agent), t.h.id.worker, (long long)t.h.id.local);
    }
    if (t.h.parent != me) send_msg(st, t.h.parent, MSG_ACCEPT, NULL, &h, NULL, -1, -1);
    *out = r;
    return DDP_OK;
  }
  r->fork = t.h.fork;
  pthread_mutex_lock(&st->mu);
  r->next = st->users;
  st->users = r;
  /* From the owner: it registered the fork when it made the token. */
  if (t.h.parent == t.owner) r->confirmed = true;
  pthread_mutex_unlock(&st->mu);
  if (t.h.parent != t.owner) {
    ddp_status s = send_msg(st, t.owner, MSG_FORK, r, &h, NULL, -1, t.h.parent);
    if (s != DDP_OK) {
      ddp_rref_release(r);
      return s;
    }
  }
  *out = r;
  return DDP_OK;
}

void ddp_rref_release(ddp_rref *r) {
  if (!r) return;
  rref_state *st = r->st;
  if (r->is_owner) {
    pthread_mutex_lock(&st->mu);
    owner_ref *e = owner_find(st, r->id);
    bool dead = false;
    if (e) {
      e->local_handles--;
      dead = owner_unlink_if_dead(st, e);
    }
    pthread_mutex_unlock(&st->mu);
    if (dead) owner_free(e);
    ddp_free(r);
    return;
  }
  pthread_mutex_lock(&st->mu);
  r->released = true;
  bool del = user_progress_locked(st, r);
  pthread_mutex_unlock(&st->mu);
  if (del) send_delete(st, r);
}

ddp_status ddp_rref_flush(ddp_rpc_agent *agent, double timeout_s) {
  rref_state *st = state_of(agent);
  int64_t deadline = deadline_after(agent, timeout_s);
  pthread_mutex_lock(&st->mu);
  while (st->outstanding > 0 && ddp_time_ns() < deadline) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 20000000;
    ts.tv_sec += ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    pthread_cond_timedwait(&st->cv, &st->mu, &ts);
  }
  int64_t left = st->outstanding;
  pthread_mutex_unlock(&st->mu);
  if (left)
    return ddp_error(DDP_ERR_TIMEOUT, "rref flush on worker '%s': %lld reference messages not "
                     "acknowledged within %.1f s", self_name(agent), (long long)left,
                     timeout_s > 0 ? timeout_s : DDP_RPC_DEFAULT_TIMEOUT_S);
  return DDP_OK;
}

int64_t ddp_rref_owned_count(ddp_rpc_agent *agent) {
  rref_state *st = state_of(agent);
  int64_t n = 0;
  pthread_mutex_lock(&st->mu);
  for (owner_ref *e = st->owned; e; e = e->next) n++;
  pthread_mutex_unlock(&st->mu);
  return n;
}

/* ---- The module -------------------------------------------------------------- */

static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;
static ddp_status builtins_status;
static void register_builtins(void) {
  static const struct {
    const char *name;
    ddp_rpc_handler fn;
  } b[] = {{"__ddp.rref.create", h_create}, {"__ddp.rref.fork", h_fork},
           {"__ddp.rref.accept", h_accept}, {"__ddp.rref.delete", h_delete},
           {"__ddp.rref.fetch", h_fetch},   {"__ddp.rref.call", h_call}};
  for (size_t i = 0; i < sizeof b / sizeof b[0] && builtins_status == DDP_OK; i++)
    builtins_status = ddp__rpc_register_builtin(b[i].name, b[i].fn, NULL);
}

static ddp_status mod_init(ddp_rpc_agent *agent, int slot) {
  pthread_once(&builtins_once, register_builtins);
  DDP_TRY(builtins_status);
  rref_state *st = ddp_calloc(1, sizeof *st);
  if (!st) return ddp_error(DDP_ERR_NOMEM, "rref: out of memory");
  pthread_mutex_init(&st->mu, NULL);
  pthread_cond_init(&st->cv, NULL);
  st->agent = agent;
  *(rref_state **)ddp__rpc_module_slot(agent, slot) = st;
  return DDP_OK;
}

/* Graceful: waits for this worker's reference messages to be answered, so
 * owners free what they can before the workers meet. References still held
 * are named at destroy, not here: a handler may still be running (a
 * trainer's whole loop runs in one) and release its references later. */
static void mod_before_shutdown(ddp_rpc_agent *agent, int slot, bool graceful) {
  rref_state *st = *(rref_state **)ddp__rpc_module_slot(agent, slot);
  if (st && graceful && ddp_rref_flush(agent, -1) != DDP_OK) DDP_WARN("rpc: %s", ddp_last_error());
}

/* Names every reference this worker still holds (the pool has stopped:
 * nothing will release them any more). */
static void report_held(ddp_rpc_agent *agent, rref_state *st) {
  for (ddp_rref *r = st->users; r; r = r->next) {
    if (!r->released)
      DDP_WARN("rpc: worker '%s': %s still held at shutdown (never released: call "
               "ddp_rref_release)", self_name(agent), r->name);
    else if (r->n_children)
      DDP_WARN("rpc: worker '%s': %s: passed on %d time(s) but never received "
               "(ddp_rref_from_token)", self_name(agent), r->name, r->n_children);
  }
  for (owner_ref *e = st->owned; e; e = e->next)
    if (e->local_handles)
      DDP_WARN("rpc: worker '%s': %s still held by its owner at shutdown (%d reference(s) "
               "never released)", self_name(agent), e->name, e->local_handles);
}

static void mod_worker_failed(ddp_rpc_agent *agent, int slot, int32_t rank) {
  rref_state *st = *(rref_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  /* Forks held by a dead worker will never be deleted: drop them. */
  owner_ref *dead_list = NULL;
  pthread_mutex_lock(&st->mu);
  /* A dead owner cannot be told: its references are released silently. */
  for (ddp_rref *r = st->users; r; r = r->next)
    if (r->owner == rank) r->confirm_failed = true;
  for (owner_ref *e = st->owned, *next; e; e = next) {
    next = e->next;
    for (int i = 0; i < e->n_forks;)
      if (e->forks[i].holder == rank) e->forks[i] = e->forks[--e->n_forks];
      else i++;
    if (owner_unlink_if_dead(st, e)) {
      e->next = dead_list;
      dead_list = e;
    }
  }
  pthread_mutex_unlock(&st->mu);
  while (dead_list) {
    owner_ref *next = dead_list->next;
    owner_free(dead_list);
    dead_list = next;
  }
}

static void mod_destroy(ddp_rpc_agent *agent, int slot) {
  rref_state *st = *(rref_state **)ddp__rpc_module_slot(agent, slot);
  if (!st) return;
  report_held(agent, st);
  for (owner_ref *e = st->owned, *next; e; e = next) {
    next = e->next;
    if (e->n_forks) {
      char holders[160] = "";
      size_t len = 0;
      for (int i = 0; i < e->n_forks && len < sizeof holders - 16; i++)
        len += e->forks[i].holder >= 0
                   ? (size_t)snprintf(holders + len, sizeof holders - len, "%s%d", i ? "," : "",
                                      e->forks[i].holder)
                   : (size_t)snprintf(holders + len, sizeof holders - len, "%s? (passed on by "
                                      "the owner)", i ? "," : "");
      DDP_WARN("rpc: worker '%s': %s freed at shutdown while %d reference(s) to it were never "
               "released (held on rank(s) %s)", self_name(agent), e->name, e->n_forks, holders);
    }
    owner_free(e);
  }
  while (st->users) user_unlink_free(st, st->users);
  pthread_mutex_destroy(&st->mu);
  pthread_cond_destroy(&st->cv);
  ddp_free(st);
  *(rref_state **)ddp__rpc_module_slot(agent, slot) = NULL;
}

const ddp__rpc_module ddp__rref_module = {
    .name = "rref",
    .init = mod_init,
    .before_shutdown = mod_before_shutdown,
    .worker_failed = mod_worker_failed,
    .destroy = mod_destroy,
};
