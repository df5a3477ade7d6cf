/* ZeRO stage 3's unit gathers as asynchronous work, and what to prefetch
 * (src/parallel/zero_prefetch.h; docs/sharding.md, "Prefetch"). A unit's
 * gather is one broadcast per rank whose range meets the unit's region,
 * each in place into the flat parameter buffer (an allgather whose pieces
 * need not be equal), enqueued on the group's queue without waiting: the
 * progress thread moves the bytes while the caller computes, and a wait
 * before the unit's first use completes it. Everything the steady state
 * touches is allocated at creation (the work slots, two orders, the log);
 * the group's pool of handles is reserved by zero.c. */
#include <string.h>

#include "parallel/zero_prefetch.h"

struct ddp__zero_prefetch {
  ddp__zero_prefetch_config c;
  ddp_work **works;   /* (n_units * world) each unit's broadcasts in flight */
  int *n_works;       /* (n_units) */
  bool *ahead;        /* (n_units) its gather in flight was a prefetch */
  int *prev_seq;      /* (n_units) the previous forward's order of the units */
  int prev_n;
  ddp_zero_event *log; /* (log_cap) this step's events */
  int log_cap, log_n, log_lost;
  int max_held;
  int64_t gathers, prefetched, ready_when_needed;
};

ddp_status ddp__zero_prefetch_create(ddp__zero_prefetch **out, const ddp__zero_prefetch_config *c) {
  *out = NULL;
  ddp__zero_prefetch *pf = ddp_calloc(1, sizeof *pf);
  if (!pf) return ddp_error(DDP_ERR_NOMEM, "zero: stage 3: out of memory for the prefetch");
  pf->c = *c;
  const size_t units = (size_t)(c->n_units > 0 ? c->n_units : 1);
  /* Per unit a gather and a prefetch can both be logged twice (forward and
   * backward), with its forward's and backward's end and two releases:
   * ten per unit covers a step; more are counted as lost. */
  pf->log_cap = 10 * (int)units + 16;
  pf->works = ddp_calloc(units * (size_t)c->world, sizeof(ddp_work *));
  pf->n_works = ddp_calloc(units, sizeof(int));
  pf->ahead = ddp_calloc(units, sizeof(bool));
  pf->prev_seq = ddp_calloc(units, sizeof(int));
  pf->log = ddp_calloc((size_t)pf->log_cap, sizeof(ddp_zero_event));
  if (!pf->works || !pf->n_works || !pf->ahead || !pf->prev_seq || !pf->log) {
    ddp__zero_prefetch_destroy(pf);
    return ddp_error(DDP_ERR_NOMEM, "zero: stage 3: out of memory for the prefetch of %d units",
                     c->n_units);
  }
  *out = pf;
  return DDP_OK;
}

void ddp__zero_prefetch_destroy(ddp__zero_prefetch *pf) {
  if (!pf) return;
  if (pf->works && pf->n_works) (void)ddp__zero_gather_drain(pf);
  ddp_free(pf->works);
  ddp_free(pf->n_works);
  ddp_free(pf->ahead);
  ddp_free(pf->prev_seq);
  ddp_free(pf->log);
  ddp_free(pf);
}

void ddp__zero_prefetch_log(ddp__zero_prefetch *pf, ddp_zero_event_kind kind, int unit) {
  if (pf->log_n == pf->log_cap) {
    pf->log_lost++;
    return;
  }
  pf->log[pf->log_n].kind = (int32_t)kind;
  pf->log[pf->log_n].unit = unit;
  pf->log_n++;
}

bool ddp__zero_gather_in_flight(const ddp__zero_prefetch *pf, int k) { return pf->n_works[k] > 0; }

ddp_status ddp__zero_gather_issue(ddp__zero_prefetch *pf, int k, bool ahead) {
  if (pf->n_works[k] > 0) return DDP_OK;
  const ddp__zero_prefetch_config *c = &pf->c;
  const int64_t a = c->unit_lo[k], b = c->unit_hi[k];
  ddp_work **w = pf->works + (size_t)k * (size_t)c->world;
  for (int r = 0; r < c->world; r++) {
    const int64_t from = a > c->lo[r] ? a : c->lo[r], to = b < c->lo[r + 1] ? b : c->lo[r + 1];
    if (from >= to) continue;
    ddp_work *one = NULL;
    ddp_status s = ddp_broadcast_async(c->pg, c->params + from, (size_t)(to - from), DDP_FLOAT32,
                                       r, &one);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "zero (rank %d): gathering floats [%lld, %lld) from rank %d",
                            c->rank, (long long)from, (long long)to, r);
    w[pf->n_works[k]++] = one;
  }
  pf->ahead[k] = ahead;
  pf->gathers++;
  if (ahead) pf->prefetched++;
  ddp__zero_prefetch_log(pf, DDP_ZERO_EVENT_GATHER_ISSUED, k);
  return DDP_OK;
}

ddp_status ddp__zero_gather_wait(ddp__zero_prefetch *pf, int k, bool needed) {
  if (needed) ddp__zero_prefetch_log(pf, DDP_ZERO_EVENT_GATHER_NEEDED, k);
  if (pf->n_works[k] == 0) return DDP_OK;
  ddp_work **w = pf->works + (size_t)k * (size_t)pf->c.world;
  if (needed && pf->ahead[k]) {
    /* Whether the prefetch had finished by the time it was needed: how
     * much of the gather the compute hid (a figure, not a contract). */
    bool done = true;
    for (int i = 0; i < pf->n_works[k]; i++) done = done && ddp_work_test(w[i], NULL);
    if (done) pf->ready_when_needed++;
  }
  ddp_status first = DDP_OK;
  for (int i = 0; i < pf->n_works[k]; i++) {
    ddp_status s = ddp_work_wait(w[i], -1);
    if (s != DDP_OK && first == DDP_OK)
      first = ddp_error_wrap(s, "zero (rank %d): gathering top-level module %d", pf->c.rank, k);
    ddp_work_free(w[i]);
    w[i] = NULL;
  }
  pf->n_works[k] = 0;
  return first;
}

ddp_status ddp__zero_gather_drain(ddp__zero_prefetch *pf) {
  ddp_status first = DDP_OK;
  for (int k = 0; k < pf->c.n_units; k++) {
    ddp_status s = ddp__zero_gather_wait(pf, k, false);
    if (s != DDP_OK && first == DDP_OK) first = s;
  }
  return first;
}

void ddp__zero_prefetch_new_forward(ddp__zero_prefetch *pf, const int *seq, int n) {
  if (n > 0) {
    memcpy(pf->prev_seq, seq, (size_t)n * sizeof(int));
    pf->prev_n = n;
  }
  pf->log_n = 0;
  pf->log_lost = 0;
  pf->max_held = 0;
}

int ddp__zero_prefetch_forward_next(const ddp__zero_prefetch *pf, int k, int at) {
  if (!pf->c.enabled || at + 1 >= pf->prev_n || pf->prev_seq[at] != k) return -1;
  return pf->prev_seq[at + 1];
}

bool ddp__zero_prefetch_enabled(const ddp__zero_prefetch *pf) { return pf->c.enabled; }

void ddp__zero_prefetch_note_held(ddp__zero_prefetch *pf, int held) {
  if (held > pf->max_held) pf->max_held = held;
}

int ddp__zero_prefetch_events(const ddp__zero_prefetch *pf, ddp_zero_event *out, int cap) {
  const int n = pf->log_n < cap ? pf->log_n : cap;
  if (n > 0) memcpy(out, pf->log, (size_t)n * sizeof *out);
  return pf->log_n;
}

void ddp__zero_prefetch_stats(const ddp__zero_prefetch *pf, ddp_zero_prefetch_stats *out) {
  memset(out, 0, sizeof *out);
  out->gathers = pf->gathers;
  out->prefetched = pf->prefetched;
  out->ready_when_needed = pf->ready_when_needed;
  out->max_units_held = pf->max_held;
  out->events_lost = pf->log_lost;
  out->enabled = pf->c.enabled;
}
