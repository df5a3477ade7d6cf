/* The clock table of one server (ps_internal.h): steps finished per trainer
 * and the rule that decides when a pull may be answered in each mode. Pure:
 * the server calls it under its lock, the tests directly. */
#include <stdlib.h>

#include "ps/ps_internal.h"

ddp_status ddp__ps_clock_init(ddp__ps_clock *c, int32_t n, ddp_ps_mode mode, int32_t staleness,
                              int64_t start) {
  *c = (ddp__ps_clock){.n = n, .mode = mode, .staleness = staleness};
  c->clock = ddp_calloc((size_t)(n > 0 ? n : 1), sizeof *c->clock);
  c->state = ddp_calloc((size_t)(n > 0 ? n : 1), sizeof *c->state);
  if (!c->clock || !c->state) {
    ddp__ps_clock_free(c);
    return ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory for %d trainers' clocks", n);
  }
  for (int32_t t = 0; t < n; t++) c->clock[t] = start;
  return DDP_OK;
}

void ddp__ps_clock_free(ddp__ps_clock *c) {
  ddp_free(c->clock);
  ddp_free(c->state);
  c->clock = NULL;
  c->state = NULL;
}

int64_t ddp__ps_clock_min(const ddp__ps_clock *c) {
  int64_t m = INT64_MAX;
  for (int32_t t = 0; t < c->n; t++)
    if (c->state[t] == DDP__PS_LIVE && c->clock[t] < m) m = c->clock[t];
  return m;
}

int32_t ddp__ps_clock_live(const ddp__ps_clock *c) {
  int32_t k = 0;
  for (int32_t t = 0; t < c->n; t++) k += c->state[t] == DDP__PS_LIVE;
  return k;
}

bool ddp__ps_clock_may_pull(const ddp__ps_clock *c, int32_t t, int64_t s) {
  if (t < 0 || t >= c->n || c->clock[t] < s) return false; /* its own step first */
  switch (c->mode) {
  case DDP_PS_SYNC: return ddp__ps_clock_min(c) >= s;
  case DDP_PS_SSP: return ddp__ps_clock_min(c) >= s - c->staleness;
  case DDP_PS_ASYNC: return true;
  }
  return false;
}
