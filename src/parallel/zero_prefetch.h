/* ZeRO stage 3's gathers of top-level modules ("units") as asynchronous
 * work, and the choice of the unit to prefetch (FSDP's forward_prefetch
 * and backward_prefetch=BACKWARD_PRE; docs/sharding.md, "Prefetch").
 * zero.c decides when a unit is needed and when it is released; this file
 * owns the work handles of the gathers in flight, the order the previous
 * forward ran the units in, and the event log the tests read. Not
 * installed. */
#ifndef DDP__PARALLEL_ZERO_PREFETCH_H
#define DDP__PARALLEL_ZERO_PREFETCH_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/zero.h"

typedef struct ddp__zero_prefetch ddp__zero_prefetch;

/* What the gathers need, borrowed from the zero (which outlives this). */
typedef struct ddp__zero_prefetch_config {
  ddp_process_group *pg;
  float *params;               /* the model's flat parameter buffer */
  const int64_t *lo;           /* (world + 1) the ranks' range starts */
  int world, rank;
  const int64_t *unit_lo, *unit_hi; /* (n_units) each unit's region */
  int n_units;
  bool enabled;                /* false: a unit is gathered only when needed */
} ddp__zero_prefetch_config;

/* Allocates everything the steady state uses (work handle slots, the
 * orders, the event log). *out NULL on failure. */
ddp_status ddp__zero_prefetch_create(ddp__zero_prefetch **out, const ddp__zero_prefetch_config *c);
/* Waits for what is in flight, then frees. NULL ok. */
void ddp__zero_prefetch_destroy(ddp__zero_prefetch *pf);

/* Enqueues unit k's gather (one broadcast per owner of a piece of its
 * region, asynchronous, in place) unless it is in flight already; `ahead`:
 * a prefetch (counted apart). The caller marks the unit gathered. */
ddp_status ddp__zero_gather_issue(ddp__zero_prefetch *pf, int k, bool ahead);
/* Waits for unit k's gather if it is in flight (logged as the unit being
 * needed when `needed`); afterwards its region holds the parameters. */
ddp_status ddp__zero_gather_wait(ddp__zero_prefetch *pf, int k, bool needed);
/* Waits for every gather in flight; the first failure is returned. */
ddp_status ddp__zero_gather_drain(ddp__zero_prefetch *pf);
bool ddp__zero_gather_in_flight(const ddp__zero_prefetch *pf, int k);

/* A training forward begins: the order of the last one (seq[0..n), the
 * units as they ran) becomes the order forward prefetch follows, when n
 * is not 0; the event log starts afresh. */
void ddp__zero_prefetch_new_forward(ddp__zero_prefetch *pf, const int *seq, int n);
/* The unit to prefetch while unit k, the at-th unit of this forward, runs
 * its forward: the one after k in the previous forward's order, when that
 * order agrees with this one at `at` (FSDP records the order of the first
 * iteration and prefetches from the second); -1 when none or disabled. */
int ddp__zero_prefetch_forward_next(const ddp__zero_prefetch *pf, int k, int at);
bool ddp__zero_prefetch_enabled(const ddp__zero_prefetch *pf);

/* Event log of the current step (include/ddp/zero.h, ddp_zero_events). */
void ddp__zero_prefetch_log(ddp__zero_prefetch *pf, ddp_zero_event_kind kind, int unit);
/* Units gathered or in flight now, by the caller's count; the step's
 * most is kept. */
void ddp__zero_prefetch_note_held(ddp__zero_prefetch *pf, int held);
int ddp__zero_prefetch_events(const ddp__zero_prefetch *pf, ddp_zero_event *out, int cap);
void ddp__zero_prefetch_stats(const ddp__zero_prefetch *pf, ddp_zero_prefetch_stats *out);

#endif /* DDP__PARALLEL_ZERO_PREFETCH_H */
