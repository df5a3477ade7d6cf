/* A parameter server on RPC (include/ddp/ps.h, docs/ps.md): its functions
 * (push, pull, meet, done, state), the deferred pulls and meetings, the
 * watch on every trainer that tells a death, and the serve loop. The
 * update logic is update.c's and the rule for answering pulls clock.c's;
 * this file holds the lock and puts them on the wire. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps/ps_internal.h"
#include "ps/server_internal.h"

/* How long a server's watch on a trainer stays pending before it is
 * renewed (its only purpose is to fail when the trainer's connection
 * closes). */
#define WATCH_S 3600.0

/* ---- Replies from snapshots -------------------------------------------------- */

/* Fills trainer t's snapshot (owned parameters, then on server 0 the
 * buffers and counters) from the model, under the lock, and points *m at
 * it. Each trainer has one pull outstanding at most, so its snapshot is
 * free again by the time it can ask for the next. */
static void snapshot(ddp_ps_server *s, int32_t t, int64_t base_step, ddp_rpc_message *m) {
  ddp__ps_snap *sn = &s->snaps[t];
  ddp__ps_trainer *tr = &s->trainers[t];
  const float *params = ddp_model_params_flat(s->model);
  for (int32_t k = 0; k < s->shard.n; k++) {
    const ddp__ps_tensor *x = &s->shard.tensors[k];
    memcpy(sn->tensors[k].data, params + x->offset, (size_t)x->numel * sizeof(float));
    tr->pulled_version[k] = x->version;
  }
  tr->pulled_min = ddp__ps_clock_min(&s->clock);
  int32_t n = s->shard.n;
  if (s->nb > 0) memcpy(sn->tensors[n++].data, ddp_model_buffers_flat(s->model), (size_t)s->nb * sizeof(float));
  if (s->nc > 0)
    memcpy(sn->tensors[n++].data, ddp_model_counters(s->model), (size_t)s->nc * sizeof(int64_t));
  sn->header = (ddp__ps_header){.magic = DDP__PS_MAGIC, .kind = DDP__PS_PULL, .trainer = t,
                                .count = n, .base_step = base_step};
  *m = (ddp_rpc_message){.payload = &sn->header, .payload_bytes = sizeof sn->header,
                         .tensors = sn->ptrs, .num_tensors = n};
}

/* A reply decided under the lock, sent after it is released (a send may
 * block on the socket). */
typedef struct outgoing {
  ddp_rpc_reply *reply;
  ddp_rpc_message msg;
  bool has_msg;
  ddp_status fail;
  const char *error; /* with fail: stays valid while sent (the server's failure) */
} outgoing;

static void send_all(outgoing *out, int n) {
  for (int i = 0; i < n; i++) {
    if (out[i].fail != DDP_OK)
      (void)ddp_rpc_reply_fail(out[i].reply, out[i].fail, "%s", out[i].error);
    else
      (void)ddp_rpc_reply_send(out[i].reply, out[i].has_msg ? &out[i].msg : NULL);
  }
}

/* ---- Progress: clocks, buffers, pulls, meetings ------------------------------ */

static void write_snapshot(ddp_ps_server *s); /* DDP_PS_SNAPSHOT, below */

/* Trainer t's step is finished on this server once every owned tensor's
 * push and its pull are in. */
static void maybe_finish_step(ddp_ps_server *s, int32_t t) {
  ddp__ps_trainer *tr = &s->trainers[t];
  if (tr->pushes < s->shard.n || !tr->pull_in) return;
  tr->pushes = 0;
  tr->pull_in = false;
  s->clock.clock[t]++;
  if (s->clock.clock[t] > s->max_step) s->max_step = s->clock.clock[t];
  if (s->snapshot_step && !s->snapshot_written && ddp__ps_clock_min(&s->clock) >= s->snapshot_step)
    write_snapshot(s);
  if (!s->all_training_over) {
    const int64_t now = ddp_time_ns();
    if (!s->window_steps++) s->window_first_ns = now;
    s->window_last_ns = now;
  }
}

/* sync on server 0: once every live trainer finished step s, the mean of
 * their buffer deltas (in trainer order) joins the buffers. */
static void apply_buffer_means(ddp_ps_server *s) {
  if (s->o.ps.mode != DDP_PS_SYNC || !s->buffer_deltas_pending) return;
  if (ddp__ps_clock_min(&s->clock) < s->buffer_step) return;
  float *buf = ddp_model_buffers_flat(s->model);
  int64_t *ctr = ddp_model_counters(s->model);
  int32_t count = 0;
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++) count += s->trainers[t].delta_in;
  for (int64_t e = 0; e < s->nb; e++) {
    float sum = 0;
    for (int32_t t = 0; t < s->o.ps.num_trainers; t++)
      if (s->trainers[t].delta_in) sum += s->delta_slots[(int64_t)t * s->nb + e];
    buf[e] += sum / (float)(count ? count : 1);
  }
  for (int64_t e = 0; e < s->nc; e++) {
    int64_t sum = 0;
    for (int32_t t = 0; t < s->o.ps.num_trainers; t++)
      if (s->trainers[t].delta_in) sum += s->counter_slots[(int64_t)t * s->nc + e];
    ctr[e] += count ? sum / count : 0;
  }
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++) s->trainers[t].delta_in = false;
  s->buffer_deltas_pending = false;
}

/* A meeting at server 0 completes once every live trainer is in it. */
static bool meeting_complete(const ddp_ps_server *s) {
  if (!s->meet.active) return false;
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++)
    if (s->clock.state[t] == DDP__PS_LIVE && !s->trainers[t].meet_reply) return false;
  return true;
}

/* Moves what can be answered now into out[] (at most 2 per trainer). On a
 * completed save meeting, *save is set and the replies are left for the
 * caller, who writes the checkpoint outside the lock first. */
static int progress(ddp_ps_server *s, outgoing *out, bool *save) {
  int n = 0;
  apply_buffer_means(s);
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++) {
    ddp__ps_trainer *tr = &s->trainers[t];
    if (!tr->pull_reply || !ddp__ps_clock_may_pull(&s->clock, t, tr->pull_step)) continue;
    out[n] = (outgoing){.reply = tr->pull_reply, .has_msg = true};
    snapshot(s, t, s->clock.clock[t], &out[n].msg);
    tr->pull_reply = NULL;
    n++;
  }
  if (meeting_complete(s)) {
    if (s->meet.kind == DDP__PS_MEET_SAVE) {
      *save = true;
      return n;
    }
    /* The sums in trainer order, the same bits for everyone. */
    for (int32_t v = 0; v < s->meet.count; v++) {
      double sum = 0;
      for (int32_t t = 0; t < s->o.ps.num_trainers; t++)
        if (s->trainers[t].meet_reply) sum += s->meet.values[(int64_t)t * DDP__PS_MAX_SUM + v];
      s->meet.sums[v] = sum;
    }
    s->meet.header = (ddp__ps_header){.magic = DDP__PS_MAGIC, .kind = DDP__PS_MEET,
                                      .count = s->meet.kind == DDP__PS_MEET_SUM ? s->meet.count : 0,
                                      .step = s->meet.seq, .meet_kind = s->meet.kind};
    for (int32_t t = 0; t < s->o.ps.num_trainers; t++) {
      ddp__ps_trainer *tr = &s->trainers[t];
      if (!tr->meet_reply) continue;
      out[n] = (outgoing){.reply = tr->meet_reply, .has_msg = true};
      out[n].msg = (ddp_rpc_message){
          .payload = &s->meet.reply_payload,
          .payload_bytes = sizeof(ddp__ps_header) + (size_t)s->meet.header.count * sizeof(double)};
      tr->meet_reply = NULL;
      n++;
    }
    memcpy(s->meet.reply_payload, &s->meet.header, sizeof s->meet.header);
    memcpy(s->meet.reply_payload + sizeof s->meet.header, s->meet.sums,
           (size_t)s->meet.header.count * sizeof(double));
    s->meet.active = false;
  }
  return n;
}

/* Fails every deferred reply with the server's failure (sync after a death). */
static int fail_everything(ddp_ps_server *s, outgoing *out) {
  int n = 0;
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++) {
    ddp__ps_trainer *tr = &s->trainers[t];
    ddp_rpc_reply **r[2] = {&tr->pull_reply, &tr->meet_reply};
    for (int k = 0; k < 2; k++) {
      if (!*r[k]) continue;
      /* s->failure is written once, before failed is set, and never again. */
      out[n] = (outgoing){.reply = *r[k], .fail = s->failed, .error = s->failure};
      *r[k] = NULL;
      n++;
    }
  }
  s->meet.active = false;
  return n;
}

/* Runs progress and sends; writes the checkpoint first when a save meeting
 * completed. Called with the lock held; returns with it released. */
static void progress_and_unlock(ddp_ps_server *s) {
  bool save = false;
  /* On this thread's stack: several threads may be sending at once. At most
   * a pull and a meeting per trainer. */
  outgoing mine[2 * s->o.ps.num_trainers + 2];
  int n = s->failed != DDP_OK ? fail_everything(s, mine) : progress(s, mine, &save);
  if (save) {
    s->saving = true;
    pthread_mutex_unlock(&s->mu);
    send_all(mine, n);
    ddp_status st = ddp__ps_server_save(s);
    char error[512];
    snprintf(error, sizeof error, "%s", st == DDP_OK ? "" : ddp_last_error());
    pthread_mutex_lock(&s->mu);
    int m = 0;
    for (int32_t t = 0; t < s->o.ps.num_trainers; t++) {
      ddp__ps_trainer *tr = &s->trainers[t];
      if (!tr->meet_reply) continue;
      mine[m] = (outgoing){.reply = tr->meet_reply, .fail = st, .error = error};
      tr->meet_reply = NULL;
      m++;
    }
    s->meet.active = false;
    s->saving = false;
    pthread_mutex_unlock(&s->mu);
    send_all(mine, m);
    return;
  }
  pthread_mutex_unlock(&s->mu);
  send_all(mine, n);
}

/* Counts the staleness of trainer t's gradient for `step` of a tensor
 * updated `updates` times since its last pull (server_internal.h). */
static void count_staleness(ddp_ps_server *s, int32_t t, int64_t step, int64_t updates) {
  ddp__ps_staleness *st = &s->staleness;
  const int64_t steps = step - s->trainers[t].pulled_min;
  st->steps[steps < 0 ? 0 : steps < DDP__PS_STALE_BINS ? steps : DDP__PS_STALE_BINS - 1]++;
  st->updates[updates < 0 ? 0 : updates < DDP__PS_STALE_BINS ? updates : DDP__PS_STALE_BINS - 1]++;
  st->pushes++;
  if (steps > st->max_steps) st->max_steps = steps;
  if (updates > st->max_updates) st->max_updates = updates;
}

void ddp__ps_server_staleness(ddp_ps_server *s, ddp__ps_staleness *out) {
  pthread_mutex_lock(&s->mu);
  *out = s->staleness;
  pthread_mutex_unlock(&s->mu);
}

/* DDP_PS_STALENESS=1: the histograms on stderr when the server stops. */
static void print_staleness(const ddp_ps_server *s) {
  const char *env = ddp_env_str("DDP_PS_STALENESS", "");
  if (!*env || !strcmp(env, "0")) return;
  const ddp__ps_staleness *st = &s->staleness;
  const int64_t *bins[2] = {st->steps, st->updates};
  const char *what[2] = {"steps", "updates"};
  for (int h = 0; h < 2; h++) {
    char line[1024];
    int at = snprintf(line, sizeof line, "ddp ps: %s (%s): staleness in %s over %lld pushes:",
                      s->name, ddp_ps_mode_name(s->o.ps.mode), what[h], (long long)st->pushes);
    for (int b = 0; b < DDP__PS_STALE_BINS && at < (int)sizeof line - 32; b++)
      if (bins[h][b])
        at += snprintf(line + at, sizeof line - (size_t)at, " %s%d:%lld",
                       b == DDP__PS_STALE_BINS - 1 ? ">=" : "", b, (long long)bins[h][b]);
    fprintf(stderr, "%s (max %lld)\n", line, (long long)(h ? st->max_updates : st->max_steps));
  }
  fprintf(stderr, "ddp ps: %s (%s): when a trainer first stopped stepping, the live trainers' "
                  "clocks spanned %lld..%lld\n",
          s->name, ddp_ps_mode_name(s->o.ps.mode), (long long)st->stop_min, (long long)st->stop_max);
}

/* DDP_PS_SNAPSHOT: the server's model (parameters and buffers) as it is
 * when a trainer first stops stepping (or, with DDP_PS_SNAPSHOT_STEP, when
 * the slowest live trainer first finished that step), written once, under
 * the lock (no push is applied meanwhile). A debugging aid: a failure is said on stderr and
 * training goes on. */
static void write_snapshot(ddp_ps_server *s) {
  s->snapshot_written = true;
  char clocks[64];
  snprintf(clocks, sizeof clocks, "%lld..%lld", (long long)ddp__ps_clock_min(&s->clock),
           (long long)s->max_step);
  const ddp_kv meta[2] = {{"ddp.ps_mode", ddp_ps_mode_name(s->o.ps.mode)},
                          {"ddp.ps_clocks", clocks}};
  if (ddp_model_save(s->model, s->snapshot_path, meta, 2) == DDP_OK)
    fprintf(stderr, "ddp ps: %s (%s): DDP_PS_SNAPSHOT: the model %s (live trainers' clocks %s, "
                    "%lld updates) written to %s\n",
            s->name, ddp_ps_mode_name(s->o.ps.mode),
            s->snapshot_step ? "when the slowest trainer finished DDP_PS_SNAPSHOT_STEP"
                             : "when a trainer first stopped stepping",
            clocks, (long long)s->shard.updates, s->snapshot_path);
  else
    fprintf(stderr, "ddp ps: %s: DDP_PS_SNAPSHOT: %s (training goes on)\n", s->name,
            ddp_last_error());
}

/* A trainer stopped stepping (a meeting, done, dropped): the rate's window
 * closes, and the live trainers' clocks then are kept (in async the others
 * may still have many steps to make, alone). */
static void training_over(ddp_ps_server *s) {
  if (s->all_training_over) return;
  s->all_training_over = true;
  s->staleness.stop_min = ddp__ps_clock_min(&s->clock);
  s->staleness.stop_max = s->max_step;
  if (s->snapshot_path[0] && !s->snapshot_step && !s->snapshot_written) write_snapshot(s);
}

/* ---- Functions ------------------------------------------------------------------- */

static ddp_ps_server *server_of(ddp_rpc_call *call) {
  return (ddp_ps_server *)ddp__ps_registry_find(call);
}

/* The trainer index of the caller, checked against the header's. */
static ddp_status caller_trainer(ddp_ps_server *s, ddp_rpc_call *call, int32_t claimed,
                                 int32_t *t) {
  int32_t rank = ddp_rpc_call_caller(call)->rank;
  *t = rank - s->o.ps.num_servers;
  if (*t < 0 || *t >= s->o.ps.num_trainers || *t != claimed)
    return ddp_error(DDP_ERR_INVALID, "a parameter-server request from rank %d (%s) claiming "
                                      "trainer %d; trainers are ranks %d..%d",
                     rank, ddp_rpc_call_caller(call)->name, claimed, s->o.ps.num_servers,
                     s->o.ps.num_servers + s->o.ps.num_trainers - 1);
  return DDP_OK;
}

/* The state a request meets: the server's failure, or a trainer that is no
 * longer live. */
static ddp_status check_live(ddp_ps_server *s, int32_t t) {
  if (s->failed != DDP_OK) return ddp_error(s->failed, "%s", s->failure);
  if (s->clock.state[t] != DDP__PS_LIVE)
    return ddp_error(DDP_ERR_STATE, "trainer %d was %s", t,
                     s->clock.state[t] == DDP__PS_FINISHED ? "finished" : "dropped");
  return DDP_OK;
}

/* Every request's start: this worker's server, the payload's header
 * checked (kind, size: header + count elements of elem bytes) and the
 * calling trainer, checked against the header's. */
static ddp_status request(ddp_rpc_call *call, const ddp_rpc_message *args, uint32_t kind,
                          size_t elem, const char *what, ddp_ps_server **s,
                          const ddp__ps_header **h, int32_t *t) {
  *s = server_of(call);
  if (!*s) return ddp_error(DDP_ERR_STATE, "no parameter server on this worker");
  DDP_TRY(ddp__ps_header_check(args, kind, elem, what, h));
  return caller_trainer(*s, call, (*h)->trainer, t);
}

static ddp_status fn_push(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  (void)reply;
  ddp_ps_server *s = NULL;
  const ddp__ps_header *h = NULL;
  int32_t t = -1;
  DDP_TRY(request(call, args, DDP__PS_PUSH, sizeof(int32_t), "push", &s, &h, &t));
  if (args->num_tensors != h->count)
    return ddp_error(DDP_ERR_FORMAT, "push of %d gradients with %d tensors", h->count,
                     args->num_tensors);
  const int32_t *params = (const int32_t *)(h + 1);
  pthread_mutex_lock(&s->mu);
  s->last_heard_ns = ddp_time_ns();
  ddp_status st = check_live(s, t);
  if (st == DDP_OK && h->step != s->clock.clock[t] + 1)
    st = ddp_error(DDP_ERR_STATE, "trainer %d pushed for step %lld while its step %lld is in "
                                  "progress",
                   t, (long long)h->step, (long long)s->clock.clock[t] + 1);
  for (int32_t k = 0; st == DDP_OK && k < h->count; k++) {
    const ddp_tensor *g = args->tensors[k];
    int32_t p = params[k];
    if (p < 0 || p >= ddp_model_num_params(s->model) || g->dtype != DDP_FLOAT32 ||
        g->numel != ddp_model_param(s->model, p)->numel) {
      st = ddp_error(DDP_ERR_SHAPE, "trainer %d pushed a gradient of %lld values for parameter "
                                    "%d",
                     t, (long long)g->numel, p);
      break;
    }
    const int32_t local = s->shard.local_of[p];
    const int64_t missed = local < 0 ? 0
                                     : s->shard.tensors[local].version -
                                           s->trainers[t].pulled_version[local];
    bool updated;
    st = ddp__ps_shard_push(&s->shard, t, p, h->step, ddp_tensor_f32(g), h->lr,
                            ddp__ps_clock_live(&s->clock), &updated);
    if (st == DDP_OK) {
      s->trainers[t].pushes++;
      count_staleness(s, t, h->step, missed);
    }
  }
  s->stats.pushes++;
  if (st != DDP_OK) {
    pthread_mutex_unlock(&s->mu);
    return st;
  }
  maybe_finish_step(s, t);
  progress_and_unlock(s);
  return DDP_OK;
}

/* Server 0: trainer t's buffer deltas for its step (async/ssp: added now;
 * sync: kept for the step's mean). */
static ddp_status take_deltas(ddp_ps_server *s, int32_t t, const ddp_rpc_message *args,
                              int64_t step) {
  int32_t want = (s->nb > 0) + (s->nc > 0);
  if (args->num_tensors != want)
    return ddp_error(DDP_ERR_FORMAT, "pull with %d tensors, expected %d (buffer deltas)",
                     args->num_tensors, want);
  const float *db = NULL;
  const int64_t *dc = NULL;
  int32_t k = 0;
  if (s->nb > 0) {
    const ddp_tensor *x = args->tensors[k++];
    if (x->dtype != DDP_FLOAT32 || x->numel != s->nb)
      return ddp_error(DDP_ERR_SHAPE, "buffer deltas of %lld values, expected %lld",
                       (long long)x->numel, (long long)s->nb);
    db = ddp_tensor_f32(x);
  }
  if (s->nc > 0) {
    const ddp_tensor *x = args->tensors[k++];
    if (x->dtype != DDP_INT64 || x->numel != s->nc)
      return ddp_error(DDP_ERR_SHAPE, "counter deltas of %lld values, expected %lld",
                       (long long)x->numel, (long long)s->nc);
    dc = ddp_tensor_i64(x);
  }
  if (s->o.ps.mode != DDP_PS_SYNC) {
    float *buf = ddp_model_buffers_flat(s->model);
    int64_t *ctr = ddp_model_counters(s->model);
    for (int64_t e = 0; e < s->nb; e++) buf[e] += db[e];
    for (int64_t e = 0; e < s->nc; e++) ctr[e] += dc[e];
    return DDP_OK;
  }
  if (s->nb > 0) memcpy(s->delta_slots + (int64_t)t * s->nb, db, (size_t)s->nb * sizeof *db);
  if (s->nc > 0) memcpy(s->counter_slots + (int64_t)t * s->nc, dc, (size_t)s->nc * sizeof *dc);
  s->trainers[t].delta_in = true;
  s->buffer_deltas_pending = true;
  s->buffer_step = step;
  return DDP_OK;
}

static ddp_status fn_pull(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  ddp_ps_server *s = NULL;
  const ddp__ps_header *h = NULL;
  int32_t t = -1;
  DDP_TRY(request(call, args, DDP__PS_PULL, 0, "pull", &s, &h, &t));
  pthread_mutex_lock(&s->mu);
  s->last_heard_ns = ddp_time_ns();
  s->stats.pulls++;
  ddp_status st = check_live(s, t);
  if (st == DDP_OK && h->step == DDP__PS_PULL_NOW) {
    /* The current parameters, at once (the first pull, an evaluation's). */
    snapshot(s, t, s->clock.clock[t], reply);
    pthread_mutex_unlock(&s->mu);
    return DDP_OK;
  }
  if (st == DDP_OK && (h->step != s->clock.clock[t] + 1 || s->trainers[t].pull_in))
    st = ddp_error(DDP_ERR_STATE, "trainer %d pulled after step %lld while its step %lld is in "
                                  "progress",
                   t, (long long)h->step, (long long)s->clock.clock[t] + 1);
  if (st == DDP_OK && s->o.index == 0) st = take_deltas(s, t, args, h->step);
  ddp_rpc_reply *r = NULL;
  if (st == DDP_OK) st = ddp_rpc_call_defer(call, &r);
  if (st != DDP_OK) {
    pthread_mutex_unlock(&s->mu);
    return st;
  }
  ddp__ps_trainer *tr = &s->trainers[t];
  tr->pull_reply = r;
  tr->pull_step = h->step;
  tr->pull_in = true;
  maybe_finish_step(s, t);
  progress_and_unlock(s);
  return DDP_OK;
}

static ddp_status fn_meet(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  (void)reply;
  if (args->payload_bytes < sizeof(ddp__ps_header))
    return ddp_error(DDP_ERR_FORMAT, "meet: a payload of %zu bytes", args->payload_bytes);
  const ddp__ps_header *h0 = args->payload; /* its kind sizes the rest */
  size_t elem = h0->meet_kind == DDP__PS_MEET_SAVE ? sizeof(ddp_ps_save_info)
                : h0->meet_kind == DDP__PS_MEET_SUM ? sizeof(double)
                                                    : 0;
  ddp_ps_server *s = NULL;
  const ddp__ps_header *h = NULL;
  int32_t t = -1;
  DDP_TRY(request(call, args, DDP__PS_MEET, elem, "meet", &s, &h, &t));
  if (s->o.index != 0) return ddp_error(DDP_ERR_INVALID, "meetings are held at server 0");
  if (h->meet_kind == DDP__PS_MEET_SUM && h->count > DDP__PS_MAX_SUM)
    return ddp_error(DDP_ERR_RANGE, "a sum of %d values (at most %d)", h->count, DDP__PS_MAX_SUM);
  if (h->meet_kind == DDP__PS_MEET_SAVE && (h->count != 1 || !s->o.save_path))
    return ddp_error(DDP_ERR_INVALID, "a save, but %s", s->o.save_path ? "no state came with it"
                                                                       : "the servers were given no save path");
  pthread_mutex_lock(&s->mu);
  s->last_heard_ns = ddp_time_ns();
  ddp_status st = check_live(s, t);
  if (st == DDP_OK && s->meet.active &&
      (s->meet.seq != h->step || s->meet.kind != h->meet_kind || s->saving))
    st = ddp_error(DDP_ERR_STATE, "trainer %d came to meeting %lld (kind %d) while meeting %lld "
                                  "(kind %d) is open: the trainers disagree on their schedule",
                   t, (long long)h->step, h->meet_kind, (long long)s->meet.seq, s->meet.kind);
  if (st == DDP_OK && s->trainers[t].meet_reply)
    st = ddp_error(DDP_ERR_STATE, "trainer %d came to meeting %lld twice", t, (long long)h->step);
  ddp_rpc_reply *r = NULL;
  if (st == DDP_OK) st = ddp_rpc_call_defer(call, &r);
  if (st != DDP_OK) {
    pthread_mutex_unlock(&s->mu);
    return st;
  }
  training_over(s); /* the rate counts steps while every trainer steps */
  if (!s->meet.active) {
    s->meet.active = true;
    s->meet.seq = h->step;
    s->meet.kind = h->meet_kind;
    s->meet.count = h->meet_kind == DDP__PS_MEET_SUM ? h->count : 0;
  }
  if (h->meet_kind == DDP__PS_MEET_SUM)
    memcpy(s->meet.values + (int64_t)t * DDP__PS_MAX_SUM, h + 1, (size_t)h->count * sizeof(double));
  if (h->meet_kind == DDP__PS_MEET_SAVE) memcpy(&s->meet.save, h + 1, sizeof s->meet.save);
  s->trainers[t].meet_reply = r;
  progress_and_unlock(s);
  return DDP_OK;
}

static ddp_status fn_done(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  (void)reply;
  ddp_ps_server *s = NULL;
  const ddp__ps_header *h = NULL;
  int32_t t = -1;
  DDP_TRY(request(call, args, DDP__PS_DONE, 0, "done", &s, &h, &t));
  pthread_mutex_lock(&s->mu);
  s->last_heard_ns = ddp_time_ns();
  if (s->clock.state[t] == DDP__PS_LIVE) {
    s->clock.state[t] = DDP__PS_FINISHED;
    s->stats.trainers_done++;
    training_over(s);
    /* A pull it left pending is answered as the others' are. */
    (void)ddp__ps_shard_flush(&s->shard, ddp__ps_clock_live(&s->clock));
  }
  pthread_cond_broadcast(&s->cv);
  progress_and_unlock(s);
  return DDP_OK;
}

/* ---- Watching the trainers ------------------------------------------------------- */

static void watch_done(ddp_rpc_future *f, void *user);

static void arm_watch(ddp_ps_server *s, int32_t t) {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(&s->o.ps, s->o.ps.num_servers + t, name);
  ddp__ps_header h = {.magic = DDP__PS_MAGIC, .kind = DDP__PS_DONE, .trainer = t};
  ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
  ddp_rpc_future *f = NULL;
  ddp_status st = ddp_rpc_async(s->agent, name, DDP__PS_FN_WATCH, &m, WATCH_S, &f);
  if (st != DDP_OK) {
    ddp__ps_server_trainer_lost(s, t, ddp_last_error());
    return;
  }
  s->trainers[t].watch_user = (ddp__ps_watch){.s = s, .t = t};
  /* Renewed from the old watch's callback, which must not destroy its own
   * future: it retires, and the one retired before it (long finished) goes. */
  ddp_rpc_future_destroy(s->trainers[t].retired);
  s->trainers[t].retired = s->trainers[t].watch;
  s->trainers[t].watch = f;
  if (ddp_rpc_future_then(f, watch_done, &s->trainers[t].watch_user) != DDP_OK)
    ddp__ps_server_trainer_lost(s, t, "out of memory for its watch");
}

static void watch_done(ddp_rpc_future *f, void *user) {
  ddp__ps_watch *w = user;
  ddp_status st = ddp_rpc_future_status(f);
  if (st == DDP_OK) return; /* it finished and said so */
  if (st == DDP_ERR_TIMEOUT) {
    pthread_mutex_lock(&w->s->mu);
    bool rearm = w->s->clock.state[w->t] == DDP__PS_LIVE && !w->s->stopping;
    pthread_mutex_unlock(&w->s->mu);
    if (rearm) arm_watch(w->s, w->t);
    return;
  }
  ddp__ps_server_trainer_lost(w->s, w->t, ddp_rpc_future_error(f));
}

void ddp__ps_server_trainer_lost(ddp_ps_server *s, int32_t t, const char *why) {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(&s->o.ps, s->o.ps.num_servers + t, name);
  const int32_t rank = s->o.ps.num_servers + t;
  pthread_mutex_lock(&s->mu);
  if (s->clock.state[t] != DDP__PS_LIVE || s->stopping) {
    pthread_mutex_unlock(&s->mu);
    return;
  }
  s->clock.state[t] = DDP__PS_DROPPED;
  s->stats.trainers_dropped++;
  training_over(s);
  if (s->o.ps.mode == DDP_PS_SYNC) {
    if (s->failed == DDP_OK) {
      snprintf(s->failure, sizeof s->failure,
               "trainer '%s' (rank %d) died after finishing step %lld (%s); sync training "
               "cannot go on without it (async or ssp:K drop a dead trainer)",
               name, rank, (long long)s->clock.clock[t], why);
      s->failed = DDP_ERR_PEER;
    }
    fprintf(stderr, "ddp ps: %s: %s\n", s->name, s->failure);
  } else {
    fprintf(stderr,
            "ddp ps: %s: trainer '%s' (rank %d) died after finishing step %lld (%s); dropped, "
            "going on with %d trainers\n",
            s->name, name, rank, (long long)s->clock.clock[t], why,
            ddp__ps_clock_live(&s->clock));
    /* Its half-pushed step is forgotten; the others' no longer wait for it. */
    s->trainers[t].pushes = 0;
    s->trainers[t].pull_in = false;
    s->trainers[t].delta_in = false;
  }
  pthread_cond_broadcast(&s->cv);
  progress_and_unlock(s);
}

/* ---- Life ------------------------------------------------------------------------ */

static ddp_status fn_state(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                           void *user);

static ddp_status register_functions(void) {
  static const struct {
    const char *name;
    ddp_rpc_handler fn;
  } fns[] = {{DDP__PS_FN_PUSH, fn_push}, {DDP__PS_FN_PULL, fn_pull}, {DDP__PS_FN_MEET, fn_meet},
             {DDP__PS_FN_DONE, fn_done}, {DDP__PS_FN_STATE, fn_state}};
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
    DDP_TRY(ddp_rpc_register(fns[i].name, fns[i].fn, NULL));
  return DDP_OK;
}

static ddp_status fn_state(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                           void *user) {
  (void)user;
  (void)args;
  ddp_ps_server *s = server_of(call);
  if (!s) return ddp_error(DDP_ERR_STATE, "no parameter server on this worker");
  pthread_mutex_lock(&s->mu);
  ddp__ps_server_export(s, reply);
  pthread_mutex_unlock(&s->mu);
  return DDP_OK;
}

static ddp_status alloc_snaps(ddp_ps_server *s) {
  const int32_t N = s->o.ps.num_trainers;
  const int32_t n_out = s->shard.n + (s->nb > 0) + (s->nc > 0);
  s->snaps = ddp_calloc((size_t)N, sizeof *s->snaps);
  if (!s->snaps) return ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory");
  for (int32_t t = 0; t < N; t++) {
    ddp__ps_snap *sn = &s->snaps[t];
    sn->tensors = ddp_calloc((size_t)n_out, sizeof *sn->tensors);
    sn->ptrs = ddp_calloc((size_t)n_out, sizeof *sn->ptrs);
    size_t bytes = (size_t)s->shard.owned_numel * sizeof(float) + (size_t)s->nb * sizeof(float) +
                   (size_t)s->nc * sizeof(int64_t) + 64;
    sn->data = ddp_alloc(bytes);
    if (!sn->tensors || !sn->ptrs || !sn->data)
      return ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory for snapshots");
    char *at = sn->data;
    for (int32_t k = 0; k < s->shard.n; k++) {
      const ddp_tensor *p = ddp_model_param(s->model, s->shard.tensors[k].param);
      DDP_TRY(ddp_tensor_wrap(&sn->tensors[k], DDP_FLOAT32, p->ndim, p->shape, at));
      at += (size_t)p->numel * sizeof(float);
    }
    int32_t k = s->shard.n;
    if (s->nb > 0) {
      int64_t shape[1] = {s->nb};
      DDP_TRY(ddp_tensor_wrap(&sn->tensors[k++], DDP_FLOAT32, 1, shape, at));
      at += (size_t)s->nb * sizeof(float);
    }
    if (s->nc > 0) {
      int64_t shape[1] = {s->nc};
      DDP_TRY(ddp_tensor_wrap(&sn->tensors[k++], DDP_INT64, 1, shape, at));
    }
    for (int32_t j = 0; j < n_out; j++) sn->ptrs[j] = &sn->tensors[j];
  }
  return DDP_OK;
}

ddp_ps_server_options ddp_ps_server_defaults(void) {
  ddp_ps_server_options o = {0};
  o.ps = ddp_ps_defaults();
  o.optim = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.step_lr_gamma = 0.1;
  return o;
}

ddp_status ddp_ps_server_create(ddp_ps_server **out, ddp_model *model,
                                const ddp_ps_server_options *o) {
  if (!out || !model || !o)
    return ddp_error(DDP_ERR_INVALID, "ddp_ps_server_create: NULL argument");
  *out = NULL;
  DDP_TRY(ddp_ps_options_check(&o->ps));
  if (o->index < 0 || o->index >= o->ps.num_servers)
    return ddp_error(DDP_ERR_INVALID, "server index %d of %d", o->index, o->ps.num_servers);
  ddp_ps_server *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "ddp_ps_server_create: out of memory");
  s->o = *o;
  s->model = model;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  ddp_ps_worker_name(&o->ps, o->index, s->name);
  const int32_t N = o->ps.num_trainers;
  int64_t start = 0;
  ddp_status st = ddp__ps_shard_init(&s->shard, model, o->index, o->ps.num_servers, N, o->ps.mode,
                                     &o->optim);
  if (st == DDP_OK && o->resume_path) st = ddp__ps_server_resume(s, &start);
  if (st == DDP_OK) st = ddp__ps_clock_init(&s->clock, N, o->ps.mode, o->ps.staleness, start);
  if (st != DDP_OK) goto err;
  for (int32_t k = 0; k < s->shard.n; k++) s->shard.tensors[k].version = start;
  s->max_step = start;
  if (o->index == 0) {
    s->nb = ddp_model_num_buffer_elements(model);
    s->nc = ddp_model_num_counters(model);
  }
  s->trainers = ddp_calloc((size_t)N, sizeof *s->trainers);
  s->meet.values = ddp_calloc((size_t)N * DDP__PS_MAX_SUM, sizeof(double));
  s->delta_slots = ddp_calloc((size_t)N * (size_t)(s->nb ? s->nb : 1), sizeof(float));
  s->counter_slots = ddp_calloc((size_t)N * (size_t)(s->nc ? s->nc : 1), sizeof(int64_t));
  s->pulled_versions = ddp_calloc((size_t)N * (size_t)(s->shard.n ? s->shard.n : 1), sizeof(int64_t));
  if (!s->trainers || !s->meet.values || !s->delta_slots || !s->counter_slots ||
      !s->pulled_versions) {
    st = ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory for %d trainers", N);
    goto err;
  }
  for (int32_t t = 0; t < N; t++) {
    s->trainers[t].pulled_version = s->pulled_versions + (int64_t)t * s->shard.n;
    s->trainers[t].pulled_min = start;
  }
  if ((st = alloc_snaps(s)) != DDP_OK) goto err;
  const char *snapshot = ddp_env_str("DDP_PS_SNAPSHOT", "");
  if (o->index == 0 && *snapshot) {
    if (o->ps.num_servers != 1 || strlen(snapshot) >= sizeof s->snapshot_path) {
      st = ddp_error(DDP_ERR_INVALID, "DDP_PS_SNAPSHOT=%s: %s", snapshot,
                     o->ps.num_servers != 1 ? "needs --param-servers 1 (server 0 holds only its "
                                              "shard of the parameters)"
                                            : "the path is too long");
      goto err;
    }
    strcpy(s->snapshot_path, snapshot);
    if ((st = ddp_env_int("DDP_PS_SNAPSHOT_STEP", 0, &s->snapshot_step)) != DDP_OK) goto err;
    if (s->snapshot_step < 0) {
      st = ddp_error(DDP_ERR_INVALID, "DDP_PS_SNAPSHOT_STEP=%lld: a step, 1 or more (0 or unset: "
                                      "when a trainer first stops)", (long long)s->snapshot_step);
      goto err;
    }
  }
  if (o->index == 0 && o->save_path && (st = ddp__ps_server_save_init(s)) != DDP_OK) goto err;
  if ((st = ddp__ps_registry_add(s->name, s)) != DDP_OK) goto err;
  s->registered = true;
  if ((st = register_functions()) != DDP_OK) goto err;
  *out = s;
  return DDP_OK;
err:
  ddp_ps_server_destroy(s);
  return st;
}

ddp_status ddp_ps_server_serve(ddp_ps_server *s, ddp_rpc_agent *agent, ddp_ps_server_stats *stats) {
  if (!s || !agent) return ddp_error(DDP_ERR_INVALID, "ddp_ps_server_serve: NULL argument");
  s->agent = agent;
  const double timeout = ddp__ps_timeout(&s->o.ps);
  pthread_mutex_lock(&s->mu);
  s->last_heard_ns = ddp_time_ns();
  pthread_mutex_unlock(&s->mu);
  for (int32_t t = 0; t < s->o.ps.num_trainers; t++) arm_watch(s, t);
  pthread_mutex_lock(&s->mu);
  ddp_status st = DDP_OK;
  for (;;) {
    if (s->failed != DDP_OK) {
      st = ddp_error(s->failed, "%s: %s", s->name, s->failure);
      break;
    }
    if (ddp__ps_clock_live(&s->clock) == 0) break;
    if (1e-9 * (double)(ddp_time_ns() - s->last_heard_ns) > timeout) {
      st = ddp_error(DDP_ERR_TIMEOUT, "%s: no trainer was heard from for %.0f s (DDP_TIMEOUT); "
                                      "%d trainers still live",
                     s->name, timeout, ddp__ps_clock_live(&s->clock));
      break;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 200 * 1000 * 1000;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&s->cv, &s->mu, &until);
  }
  if (st == DDP_OK && s->stats.trainers_done == 0)
    st = ddp_error(DDP_ERR_PEER, "%s: every trainer died (%d dropped)", s->name,
                   s->stats.trainers_dropped);
  s->stopping = true;
  s->stats.updates = s->shard.updates;
  s->stats.max_step = s->max_step;
  s->stats.steps_per_s = s->window_steps >= 2 && s->window_last_ns > s->window_first_ns
                             ? (double)(s->window_steps - 1) /
                                   (1e-9 * (double)(s->window_last_ns - s->window_first_ns))
                             : NAN;
  if (stats) *stats = s->stats;
  print_staleness(s);
  pthread_mutex_unlock(&s->mu);
  return st;
}

void ddp_ps_server_destroy(ddp_ps_server *s) {
  if (!s) return;
  if (s->registered) ddp__ps_registry_remove(s);
  for (int32_t t = 0; s->trainers && t < s->o.ps.num_trainers; t++)
  {
    ddp_rpc_future_destroy(s->trainers[t].watch);
    ddp_rpc_future_destroy(s->trainers[t].retired);
  }
  for (int32_t t = 0; s->snaps && t < s->o.ps.num_trainers; t++) {
    ddp_free(s->snaps[t].tensors);
    ddp_free(s->snaps[t].ptrs);
    ddp_free(s->snaps[t].data);
  }
  ddp__ps_server_save_free(s);
  ddp_free(s->snaps);
  ddp_free(s->trainers);
  ddp_free(s->meet.values);
  ddp_free(s->delta_slots);
  ddp_free(s->counter_slots);
  ddp_free(s->pulled_versions);
  ddp__ps_clock_free(&s->clock);
  ddp__ps_shard_free(&s->shard);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  ddp_free(s);
}
