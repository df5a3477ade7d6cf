/* Pipeline schedules as data: each rank's list of forwards, backwards and the
 * transfers between them, built for GPipe, 1F1B (PyTorch's Schedule1F1B),
 * Megatron's interleaved 1F1B and forward-only evaluation, or taken from the
 * caller; and printed. check.c proves a schedule before it runs. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"

static const char *const kind_names[DDP_PIPELINE_SCHEDULE_KIND_COUNT] = {
    "gpipe", "1f1b", "interleaved", "forward", "custom"};

const char *ddp_pipeline_schedule_name(ddp_pipeline_schedule_kind kind) {
  return (unsigned)kind < DDP_PIPELINE_SCHEDULE_KIND_COUNT ? kind_names[kind] : "unknown";
}

ddp_status ddp_pipeline_schedule_parse(const char *name, ddp_pipeline_schedule_kind *out) {
  for (int k = 0; name && k <= DDP_PIPELINE_INTERLEAVED; k++)
    if (strcmp(name, kind_names[k]) == 0) {
      *out = (ddp_pipeline_schedule_kind)k;
      return DDP_OK;
    }
  return ddp_error(DDP_ERR_INVALID, "pipeline: unknown schedule '%s' (gpipe, 1f1b, interleaved)",
                   name ? name : "(null)");
}

/* One compute of a rank's order, before the transfers are added. */
typedef struct {
  bool backward;
  int stage, mb;
} compute;

/* Megatron's interleaved order: forward unit k of a rank is chunk
 * (k / p) % v of micro-batch (k / (p v)) p + k % p; backward units walk the
 * chunks in reverse. Groups of p micro-batches go through all chunks before
 * the next group starts. */
static compute interleaved_unit(int p, int v, int rank, int k, bool backward) {
  int within = k % (p * v);
  int chunk = within / p;
  if (backward) chunk = v - 1 - chunk;
  compute c = {backward, chunk * p + rank, (k / (p * v)) * p + k % p};
  return c;
}

/* Megatron's warmup: forwards a rank runs before its first backward. */
static int interleaved_warmup(int p, int v, int m, int rank) {
  int w = 2 * (p - rank - 1) + (v - 1) * p;
  return w < m * v ? w : m * v;
}

int ddp__pp_promised_stage(const ddp_pipeline_schedule *s, int stage) {
  int p = s->n_ranks, m = s->n_microbatches;
  switch (s->kind) {
  case DDP_PIPELINE_GPIPE: return m;
  case DDP_PIPELINE_1F1B: return m < p - stage ? m : p - stage;
  case DDP_PIPELINE_FORWARD_ONLY: return 0;
  default: return -1;
  }
}

int ddp__pp_promised_rank(const ddp_pipeline_schedule *s, int rank) {
  int p = s->n_ranks, m = s->n_microbatches, v = s->virtual_stages;
  switch (s->kind) {
  case DDP_PIPELINE_GPIPE: return v * m;
  case DDP_PIPELINE_1F1B: return m < p - rank ? m : p - rank;
  case DDP_PIPELINE_INTERLEAVED: {
    int w = interleaved_warmup(p, v, m, rank) + 1;
    return w < v * m ? w : v * m;
  }
  case DDP_PIPELINE_FORWARD_ONLY: return 0;
  default: return -1;
  }
}

/* Rank r's computes in order; returns how many (<= 2 v M). */
static int compute_order(ddp_pipeline_schedule_kind kind, int p, int m, int v, int r,
                         compute *out) {
  int n = 0;
  switch (kind) {
  case DDP_PIPELINE_FORWARD_ONLY:
  case DDP_PIPELINE_GPIPE:
    /* Chunk by chunk, micro-batches in order: the forwards in increasing
     * (stage, micro-batch) order on every rank, backwards in decreasing
     * stage order, so no rank waits for a later item of its own list. */
    for (int c = 0; c < v; c++)
      for (int i = 0; i < m; i++) out[n++] = (compute){false, c * p + r, i};
    if (kind == DDP_PIPELINE_GPIPE)
      for (int c = v - 1; c >= 0; c--)
        for (int i = 0; i < m; i++) out[n++] = (compute){true, c * p + r, i};
    break;
  case DDP_PIPELINE_1F1B: {
    /* PyTorch's Schedule1F1B: p - r forwards, then a backward and a
     * forward in turn, then the remaining backwards. Stage r never holds
     * more than p - r micro-batches. */
    int warmup = m < p - r ? m : p - r, f = 0, b = 0;
    while (f < warmup) out[n++] = (compute){false, r, f++};
    while (f < m) {
      out[n++] = (compute){true, r, b++};
      out[n++] = (compute){false, r, f++};
    }
    while (b < m) out[n++] = (compute){true, r, b++};
    break;
  }
  case DDP_PIPELINE_INTERLEAVED: {
    /* Megatron's (and PyTorch's ScheduleInterleaved1F1B): warmup forwards,
     * then forward and backward in turn, then the remaining backwards. */
    int total = m * v, warmup = interleaved_warmup(p, v, m, r);
    for (int k = 0; k < warmup; k++) out[n++] = interleaved_unit(p, v, r, k, false);
    for (int k = 0; k < total - warmup; k++) {
      out[n++] = interleaved_unit(p, v, r, warmup + k, false);
      out[n++] = interleaved_unit(p, v, r, k, true);
    }
    for (int k = total - warmup; k < total; k++) out[n++] = interleaved_unit(p, v, r, k, true);
    break;
  }
  default:
    break;
  }
  return n;
}

static void schedule_free(ddp_pipeline_schedule *s) {
  if (!s) return;
  if (s->lists)
    for (int r = 0; r < s->n_ranks; r++) ddp_free(s->lists[r]);
  ddp_free(s->lists);
  ddp_free(s->counts);
  ddp_free(s);
}

void ddp_pipeline_schedule_destroy(ddp_pipeline_schedule *sched) { schedule_free(sched); }

static ddp_status schedule_alloc(ddp_pipeline_schedule **out, ddp_pipeline_schedule_kind kind,
                                 int p, int m, int v) {
  ddp_pipeline_schedule *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "pipeline schedule: out of memory");
  s->kind = kind;
  s->n_ranks = p;
  s->n_microbatches = m;
  s->virtual_stages = v;
  s->counts = ddp_calloc((size_t)p, sizeof *s->counts);
  s->lists = ddp_calloc((size_t)p, sizeof *s->lists);
  if (!s->counts || !s->lists) {
    schedule_free(s);
    return ddp_error(DDP_ERR_NOMEM, "pipeline schedule: out of memory");
  }
  *out = s;
  return DDP_OK;
}

static ddp_status check_shape(const char *what, int p, int m, int v) {
  if (p < 1 || m < 1 || v < 1)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule %s: ranks (%d), micro-batches (%d) and virtual stages "
                     "(%d) must be >= 1", what, p, m, v);
  if (v > DDP_PIPELINE_MAX_VIRTUAL || p * v > DDP_PIPELINE_MAX_STAGES)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule %s: %d ranks x %d virtual stages is more than %d stages "
                     "(or v > %d)", what, p, v, DDP_PIPELINE_MAX_STAGES, DDP_PIPELINE_MAX_VIRTUAL);
  if (p == 1 && v > 1)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule %s: %d virtual stages on one rank would pass activations "
                     "to itself; use v = 1 with one rank", what, v);
  return DDP_OK;
}

ddp_status ddp_pipeline_schedule_create(ddp_pipeline_schedule **out,
                                        ddp_pipeline_schedule_kind kind, int p, int m, int v) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "pipeline schedule: out is NULL");
  *out = NULL;
  const char *name = ddp_pipeline_schedule_name(kind);
  if (kind > DDP_PIPELINE_FORWARD_ONLY)
    return ddp_error(DDP_ERR_INVALID, "pipeline schedule: kind %d is not a built-in schedule",
                     (int)kind);
  DDP_TRY(check_shape(name, p, m, v));
  if (kind == DDP_PIPELINE_1F1B && v != 1)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule 1f1b: one stage per rank (v = %d); use interleaved", v);
  if (kind == DDP_PIPELINE_1F1B && m < p)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule 1f1b: needs at least as many micro-batches as stages "
                     "(M = %d < p = %d)", m, p);
  if (kind == DDP_PIPELINE_INTERLEAVED && (v < 2 || m % p != 0))
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline schedule interleaved: needs v >= 2 (got %d) and M a multiple of "
                     "p (M = %d, p = %d)", v, m, p);

  ddp_pipeline_schedule *s = NULL;
  DDP_TRY(schedule_alloc(&s, kind, p, m, v));
  int last = p * v - 1;
  compute *order = ddp_alloc(sizeof(compute) * (size_t)(2 * m * v));
  if (!order) {
    schedule_free(s);
    return ddp_error(DDP_ERR_NOMEM, "pipeline schedule: out of memory");
  }
  for (int r = 0; r < p; r++) {
    int n = compute_order(kind, p, m, v, r, order);
    /* Each compute brings at most one receive and one send. */
    ddp_pipeline_action *list = ddp_alloc(sizeof *list * (size_t)(3 * n + 1));
    if (!list) {
      ddp_free(order);
      schedule_free(s);
      return ddp_error(DDP_ERR_NOMEM, "pipeline schedule: out of memory");
    }
    s->lists[r] = list;
    int k = 0;
    /* The receive a compute needs is posted one compute early, so it
     * arrives while the previous compute runs; the first compute's at the
     * start. `prev` is where the previous compute sits in the list. */
    int prev = 0;
    for (int i = 0; i < n; i++) {
      compute c = order[i];
      bool needs = c.backward ? c.stage < last : c.stage > 0;
      if (needs) {
        ddp_pipeline_action recv = {
            c.backward ? DDP_PIPELINE_RECV_GRAD : DDP_PIPELINE_RECV_ACT, c.stage, c.mb,
            ddp__pp_rank_of(p, c.backward ? c.stage + 1 : c.stage - 1)};
        memmove(&list[prev + 1], &list[prev], sizeof *list * (size_t)(k - prev));
        list[prev] = recv;
        k++;
      }
      prev = k;
      list[k++] = (ddp_pipeline_action){c.backward ? DDP_PIPELINE_BACKWARD : DDP_PIPELINE_FORWARD,
                                        c.stage, c.mb, -1};
      bool sends = c.backward ? c.stage > 0 : c.stage < last;
      if (sends)
        list[k++] = (ddp_pipeline_action){
            c.backward ? DDP_PIPELINE_SEND_GRAD : DDP_PIPELINE_SEND_ACT, c.stage, c.mb,
            ddp__pp_rank_of(p, c.backward ? c.stage - 1 : c.stage + 1)};
    }
    s->counts[r] = k;
  }
  ddp_free(order);
  *out = s;
  return DDP_OK;
}

ddp_status ddp_pipeline_schedule_from_lists(ddp_pipeline_schedule **out, int p, int m, int v,
                                            const ddp_pipeline_action *const *lists,
                                            const int *counts) {
  if (!out || !lists || !counts)
    return ddp_error(DDP_ERR_INVALID, "pipeline schedule: out, lists and counts must be given");
  *out = NULL;
  DDP_TRY(check_shape("custom", p, m, v));
  ddp_pipeline_schedule *s = NULL;
  DDP_TRY(schedule_alloc(&s, DDP_PIPELINE_CUSTOM, p, m, v));
  for (int r = 0; r < p; r++) {
    if (counts[r] < 0 || (counts[r] > 0 && !lists[r])) {
      schedule_free(s);
      return ddp_error(DDP_ERR_INVALID, "pipeline schedule: rank %d's list is missing", r);
    }
    s->lists[r] = ddp_alloc(sizeof(ddp_pipeline_action) * (size_t)(counts[r] + 1));
    if (!s->lists[r]) {
      schedule_free(s);
      return ddp_error(DDP_ERR_NOMEM, "pipeline schedule: out of memory");
    }
    if (counts[r]) memcpy(s->lists[r], lists[r], sizeof(ddp_pipeline_action) * (size_t)counts[r]);
    s->counts[r] = counts[r];
  }
  *out = s;
  return DDP_OK;
}

ddp_pipeline_schedule_kind ddp_pipeline_schedule_kind_of(const ddp_pipeline_schedule *s) {
  return s->kind;
}
int ddp_pipeline_schedule_num_ranks(const ddp_pipeline_schedule *s) { return s->n_ranks; }
int ddp_pipeline_schedule_num_microbatches(const ddp_pipeline_schedule *s) {
  return s->n_microbatches;
}
int ddp_pipeline_schedule_virtual_stages(const ddp_pipeline_schedule *s) {
  return s->virtual_stages;
}

const ddp_pipeline_action *ddp_pipeline_schedule_actions(const ddp_pipeline_schedule *s, int rank,
                                                         int *count) {
  if (!s || rank < 0 || rank >= s->n_ranks) {
    if (count) *count = 0;
    return NULL;
  }
  if (count) *count = s->counts[rank];
  return s->lists[rank];
}

/* ---- Printing ---------------------------------------------------------------- */

typedef struct {
  char *buf;
  size_t bytes, len;
} sink;

static void put(sink *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sink *o, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  for (int i = 0; i < n; i++, o->len++)
    if (o->len + 1 < o->bytes) o->buf[o->len] = tmp[i];
}

static void print_rank(const ddp_pipeline_schedule *s, int r, sink *o) {
  static const char *const tok[] = {"F", "B", "sa", "ra", "sg", "rg"};
  put(o, "rank %d:", r);
  for (int i = 0; i < s->counts[r]; i++) {
    const ddp_pipeline_action *a = &s->lists[r][i];
    const char *t = (unsigned)a->kind < DDP_PIPELINE_ACTION_KIND_COUNT ? tok[a->kind] : "?";
    put(o, " %s%d.%d", t, a->stage, a->microbatch);
    if (a->kind == DDP_PIPELINE_SEND_ACT || a->kind == DDP_PIPELINE_SEND_GRAD)
      put(o, ">%d", a->peer);
    else if (a->kind == DDP_PIPELINE_RECV_ACT || a->kind == DDP_PIPELINE_RECV_GRAD)
      put(o, "<%d", a->peer);
  }
  put(o, "\n");
}

size_t ddp_pipeline_schedule_print(const ddp_pipeline_schedule *s, int rank, char *buf,
                                   size_t bytes) {
  sink o = {buf, bytes, 0};
  if (buf && bytes) buf[0] = '\0';
  if (!s) return 0;
  for (int r = 0; r < s->n_ranks; r++)
    if (rank < 0 || rank == r) print_rank(s, r, &o);
  if (buf && bytes) buf[o.len < bytes ? o.len : bytes - 1] = '\0';
  return o.len;
}
