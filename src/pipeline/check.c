/* The schedule checker: runs every rank's action list together in a
 * simulation and proves, before anything runs, that the lists are complete,
 * that every transfer has its match in the same order on both sides, that no
 * rank can wait forever, and that each stage holds no more micro-batches than
 * its kind promises. The simulation's rules are the executor's: posting a
 * transfer never blocks, a forward or backward waits only for its inputs. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"

/* A one-way, one-kind channel: the k-th send matches the k-th receive. The
 * key of a transfer is the receiving stage and micro-batch. */
typedef struct {
  int *send_keys, *recv_keys; /* (capacity) stage * M + mb */
  int n_send, n_recv, capacity;
} channel;

typedef struct {
  const ddp_pipeline_schedule *s;
  int p, m, n_stages, last;
  /* Per (stage, micro-batch), index stage * M + mb. */
  bool *f_done, *b_done, *act_posted, *act_arrived, *grad_posted, *grad_arrived, *act_sent,
      *grad_sent;
  channel *channels; /* (p * p * 2), index (src * p + dst) * 2 + kind */
  int *pc;           /* (p) next action per rank */
  int live[DDP_PIPELINE_MAX_STAGES];
  int rank_live[DDP_PIPELINE_MAX_STAGES];
  ddp_pipeline_schedule_report rep;
} sim;

static const char *const kind_tok[] = {"F", "B", "sa", "ra", "sg", "rg"};

static const char *tok(const ddp_pipeline_action *a, char *buf, size_t bytes) {
  const char *t = (unsigned)a->kind < DDP_PIPELINE_ACTION_KIND_COUNT ? kind_tok[a->kind] : "?";
  snprintf(buf, bytes, "%s%d.%d", t, a->stage, a->microbatch);
  return buf;
}

static ddp_status bad(int rank, int index, const ddp_pipeline_action *a, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static ddp_status bad(int rank, int index, const ddp_pipeline_action *a, const char *fmt, ...) {
  char what[512], t[32];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return ddp_error(DDP_ERR_INVALID, "pipeline schedule check: rank %d, action %d (%s): %s", rank,
                   index, a ? tok(a, t, sizeof t) : "-", what);
}

static ddp_status post(sim *z, int rank, int index, const ddp_pipeline_action *a) {
  int g = a->stage, mb = a->microbatch, p = z->p, m = z->m;
  bool send = a->kind == DDP_PIPELINE_SEND_ACT || a->kind == DDP_PIPELINE_SEND_GRAD;
  int kind = (a->kind == DDP_PIPELINE_SEND_ACT || a->kind == DDP_PIPELINE_RECV_ACT) ? DDP__PP_ACT
                                                                                    : DDP__PP_GRAD;
  if (a->peer < 0 || a->peer >= p || a->peer == rank)
    return bad(rank, index, a, "peer %d is not another rank of the %d", a->peer, p);
  /* The stage at the other end, and the key (receiving stage, mb). */
  int other = (kind == DDP__PP_ACT) == send ? g + 1 : g - 1;
  if (other < 0 || other > z->last)
    return bad(rank, index, a, "stage %d has no %s stage to %s", g, other < 0 ? "previous" : "next",
               send ? "send to" : "receive from");
  if (a->peer != ddp__pp_rank_of(p, other))
    return bad(rank, index, a, "stage %d lives on rank %d, not rank %d", other,
               ddp__pp_rank_of(p, other), a->peer);
  int i = g * m + mb;
  int key = send ? other * m + mb : i;
  if (a->kind == DDP_PIPELINE_SEND_ACT) {
    if (!z->f_done[i]) return bad(rank, index, a, "sends the output of F%d.%d before it ran", g, mb);
    if (z->act_sent[i]) return bad(rank, index, a, "sends the same activation twice");
    z->act_sent[i] = true;
  } else if (a->kind == DDP_PIPELINE_SEND_GRAD) {
    if (!z->b_done[i]) return bad(rank, index, a, "sends the gradient of B%d.%d before it ran", g, mb);
    if (z->grad_sent[i]) return bad(rank, index, a, "sends the same gradient twice");
    z->grad_sent[i] = true;
  } else if (a->kind == DDP_PIPELINE_RECV_ACT) {
    if (z->act_posted[i]) return bad(rank, index, a, "receives the same activation twice");
    z->act_posted[i] = true;
  } else {
    if (z->grad_posted[i]) return bad(rank, index, a, "receives the same gradient twice");
    z->grad_posted[i] = true;
  }
  int src = send ? rank : a->peer, dst = send ? a->peer : rank;
  channel *c = &z->channels[(src * p + dst) * 2 + kind];
  if (!c->send_keys) {
    c->capacity = z->n_stages * m;
    c->send_keys = ddp_alloc(sizeof(int) * (size_t)c->capacity);
    c->recv_keys = ddp_alloc(sizeof(int) * (size_t)c->capacity);
    if (!c->send_keys || !c->recv_keys)
      return ddp_error(DDP_ERR_NOMEM, "pipeline schedule check: out of memory");
  }
  int *keys = send ? c->send_keys : c->recv_keys;
  int *n = send ? &c->n_send : &c->n_recv;
  if (*n >= c->capacity) return bad(rank, index, a, "more transfers than (stage, micro-batch) pairs");
  keys[(*n)++] = key;
  int k = *n - 1;
  int *mine = send ? c->send_keys : c->recv_keys, *theirs = send ? c->recv_keys : c->send_keys;
  int n_theirs = send ? c->n_recv : c->n_send;
  if (k < n_theirs) {
    if (mine[k] != theirs[k])
      return bad(rank, index, a,
                 "transfer #%d of %s from rank %d to rank %d is (stage %d, micro-batch %d) on "
                 "the sender and (stage %d, micro-batch %d) on the receiver: the two ranks post "
                 "in different orders", k, kind == DDP__PP_ACT ? "activations" : "gradients", src,
                 dst, c->send_keys[k] / m, c->send_keys[k] % m, c->recv_keys[k] / m,
                 c->recv_keys[k] % m);
    int at = c->recv_keys[k];
    if (kind == DDP__PP_ACT) z->act_arrived[at] = true;
    else z->grad_arrived[at] = true;
  }
  return DDP_OK;
}

/* Runs rank's compute at pc if its inputs are there: 1 ran, 0 waits, or an
 * error for a list that can never be right. */
static ddp_status compute(sim *z, int rank, int index, const ddp_pipeline_action *a, int *ran) {
  int g = a->stage, mb = a->microbatch, m = z->m, i = g * m + mb;
  bool forward_only = z->s->kind == DDP_PIPELINE_FORWARD_ONLY;
  *ran = 0;
  if (a->kind == DDP_PIPELINE_FORWARD) {
    if (z->f_done[i]) return bad(rank, index, a, "forward of stage %d, micro-batch %d runs twice", g, mb);
    if (g > 0 && !z->act_posted[i])
      return bad(rank, index, a, "no receive of its input (ra%d.%d) is posted before it", g, mb);
    if (g > 0 && !z->act_arrived[i]) return DDP_OK;
    z->f_done[i] = true;
    if (!forward_only) {
      int c = g / z->p;
      (void)c;
      z->live[g]++;
      z->rank_live[rank]++;
      if (z->live[g] > z->rep.live_high_water[g]) z->rep.live_high_water[g] = z->live[g];
      if (z->rank_live[rank] > z->rep.rank_live_high_water[rank])
        z->rep.rank_live_high_water[rank] = z->rank_live[rank];
    }
  } else {
    if (forward_only) return bad(rank, index, a, "a forward-only schedule has a backward");
    if (!z->f_done[i]) return bad(rank, index, a, "backward before the forward of micro-batch %d", mb);
    if (z->b_done[i]) return bad(rank, index, a, "backward of stage %d, micro-batch %d runs twice", g, mb);
    if (g < z->last && !z->grad_posted[i])
      return bad(rank, index, a, "no receive of its output's gradient (rg%d.%d) is posted before it",
                 g, mb);
    if (g < z->last && !z->grad_arrived[i]) return DDP_OK;
    z->b_done[i] = true;
    z->live[g]--;
    z->rank_live[rank]--;
  }
  *ran = 1;
  return DDP_OK;
}

static ddp_status validate(const sim *z, int rank, int index, const ddp_pipeline_action *a) {
  if ((unsigned)a->kind >= DDP_PIPELINE_ACTION_KIND_COUNT)
    return bad(rank, index, NULL, "unknown action kind %d", (int)a->kind);
  if (a->stage < 0 || a->stage > z->last)
    return bad(rank, index, a, "stage %d out of range [0, %d]", a->stage, z->last);
  if (ddp__pp_rank_of(z->p, a->stage) != rank)
    return bad(rank, index, a, "stage %d lives on rank %d, not here", a->stage,
               ddp__pp_rank_of(z->p, a->stage));
  if (a->microbatch < 0 || a->microbatch >= z->m)
    return bad(rank, index, a, "micro-batch %d out of range [0, %d)", a->microbatch, z->m);
  return DDP_OK;
}

/* Why a rank cannot go on, for the deadlock message. */
static void waiting_for(const sim *z, int r, char *buf, size_t bytes) {
  const ddp_pipeline_action *a = &z->s->lists[r][z->pc[r]];
  char t[32];
  bool fwd = a->kind == DDP_PIPELINE_FORWARD;
  int other = fwd ? a->stage - 1 : a->stage + 1;
  snprintf(buf, bytes, "rank %d at action %d (%s) waits for the %s of stage %d (rank %d)", r,
           z->pc[r], tok(a, t, sizeof t), fwd ? "activation" : "gradient", other,
           ddp__pp_rank_of(z->p, other));
}

static ddp_status run(sim *z) {
  const ddp_pipeline_schedule *s = z->s;
  for (int r = 0; r < z->p; r++)
    for (int i = 0; i < s->counts[r]; i++) DDP_TRY(validate(z, r, i, &s->lists[r][i]));
  for (int round = 0;; round++) {
    bool progress = false, finished = true;
    /* Transfers first: what a compute of the last round produced can be
     * posted now and consumed this round. */
    for (int r = 0; r < z->p; r++)
      while (z->pc[r] < s->counts[r]) {
        const ddp_pipeline_action *a = &s->lists[r][z->pc[r]];
        if (a->kind == DDP_PIPELINE_FORWARD || a->kind == DDP_PIPELINE_BACKWARD) break;
        DDP_TRY(post(z, r, z->pc[r], a));
        z->pc[r]++;
        progress = true;
      }
    bool computed = false;
    for (int r = 0; r < z->p; r++) {
      if (z->pc[r] >= s->counts[r]) continue;
      finished = false;
      int ran;
      DDP_TRY(compute(z, r, z->pc[r], &s->lists[r][z->pc[r]], &ran));
      if (ran) {
        z->pc[r]++;
        progress = computed = true;
      }
    }
    if (computed) z->rep.makespan = round + 1;
    if (finished) {
      bool more = false;
      for (int r = 0; r < z->p; r++) more |= z->pc[r] < s->counts[r];
      if (!more) return DDP_OK;
    }
    if (!progress) {
      char msg[1024];
      size_t len = 0;
      msg[0] = '\0';
      for (int r = 0; r < z->p && len + 1 < sizeof msg; r++) {
        if (z->pc[r] >= s->counts[r]) continue;
        char one[200];
        waiting_for(z, r, one, sizeof one);
        len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%s", len ? "; " : "", one);
      }
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline schedule check: deadlock after %d rounds: %s", round, msg);
    }
  }
}

static ddp_status finish(sim *z) {
  const ddp_pipeline_schedule *s = z->s;
  bool forward_only = s->kind == DDP_PIPELINE_FORWARD_ONLY;
  for (int g = 0; g <= z->last; g++)
    for (int mb = 0; mb < z->m; mb++) {
      int i = g * z->m + mb, r = ddp__pp_rank_of(z->p, g);
      if (!z->f_done[i])
        return ddp_error(DDP_ERR_INVALID,
                         "pipeline schedule check: rank %d never runs the forward of stage %d, "
                         "micro-batch %d", r, g, mb);
      if (!forward_only && !z->b_done[i])
        return ddp_error(DDP_ERR_INVALID,
                         "pipeline schedule check: rank %d never runs the backward of stage %d, "
                         "micro-batch %d", r, g, mb);
      if (g < z->last && !z->act_sent[i])
        return ddp_error(DDP_ERR_INVALID,
                         "pipeline schedule check: rank %d never sends the output of stage %d, "
                         "micro-batch %d", r, g, mb);
      if (!forward_only && g > 0 && !z->grad_sent[i])
        return ddp_error(DDP_ERR_INVALID,
                         "pipeline schedule check: rank %d never sends the input gradient of "
                         "stage %d, micro-batch %d", r, g, mb);
    }
  for (int src = 0; src < z->p; src++)
    for (int dst = 0; dst < z->p; dst++)
      for (int kind = 0; kind < 2; kind++) {
        const channel *c = &z->channels[(src * z->p + dst) * 2 + kind];
        if (c->n_send != c->n_recv)
          return ddp_error(DDP_ERR_INVALID,
                           "pipeline schedule check: rank %d sends %d %s to rank %d, which "
                           "receives %d", src, c->n_send,
                           kind == DDP__PP_ACT ? "activations" : "gradients", dst, c->n_recv);
      }
  z->rep.n_stages = z->n_stages;
  for (int g = 0; g < z->n_stages; g++) {
    int promised = ddp__pp_promised_stage(s, g);
    z->rep.live_promised[g] = promised;
    if (promised >= 0 && z->rep.live_high_water[g] > promised)
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline schedule check: stage %d holds %d micro-batches at once, more "
                       "than the %d %s promises", g, z->rep.live_high_water[g], promised,
                       ddp_pipeline_schedule_name(s->kind));
  }
  for (int r = 0; r < z->p; r++) {
    int promised = ddp__pp_promised_rank(s, r);
    z->rep.rank_live_promised[r] = promised;
    if (promised >= 0 && z->rep.rank_live_high_water[r] > promised)
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline schedule check: rank %d holds %d micro-batches at once, more "
                       "than the %d %s promises", r, z->rep.rank_live_high_water[r], promised,
                       ddp_pipeline_schedule_name(s->kind));
  }
  return DDP_OK;
}

ddp_status ddp_pipeline_schedule_check(const ddp_pipeline_schedule *s,
                                       ddp_pipeline_schedule_report *report) {
  if (!s) return ddp_error(DDP_ERR_INVALID, "pipeline schedule check: no schedule");
  sim z;
  memset(&z, 0, sizeof z);
  z.s = s;
  z.p = s->n_ranks;
  z.m = s->n_microbatches;
  z.n_stages = s->n_ranks * s->virtual_stages;
  z.last = z.n_stages - 1;
  size_t items = (size_t)z.n_stages * (size_t)z.m;
  bool *flags = ddp_calloc(items * 8, sizeof(bool));
  z.channels = ddp_calloc((size_t)(z.p * z.p * 2), sizeof(channel));
  z.pc = ddp_calloc((size_t)z.p, sizeof(int));
  ddp_status st = DDP_OK;
  if (!flags || !z.channels || !z.pc) {
    st = ddp_error(DDP_ERR_NOMEM, "pipeline schedule check: out of memory");
  } else {
    z.f_done = flags;
    z.b_done = flags + items;
    z.act_posted = flags + 2 * items;
    z.act_arrived = flags + 3 * items;
    z.grad_posted = flags + 4 * items;
    z.grad_arrived = flags + 5 * items;
    z.act_sent = flags + 6 * items;
    z.grad_sent = flags + 7 * items;
    st = run(&z);
    if (st == DDP_OK) st = finish(&z);
  }
  if (st == DDP_OK && report) *report = z.rep;
  if (z.channels)
    for (int c = 0; c < z.p * z.p * 2; c++) {
      ddp_free(z.channels[c].send_keys);
      ddp_free(z.channels[c].recv_keys);
    }
  ddp_free(z.channels);
  ddp_free(z.pc);
  ddp_free(flags);
  return st;
}
