/* The parameter server's roles and layout: the modes' names, the workers'
 * names by rank, and the sharding of the parameters over the servers
 * (whole tensors, balanced by size, the same on every rank). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ps_internal.h"

ddp_status ddp_ps_mode_parse(const char *text, ddp_ps_mode *mode, int32_t *staleness) {
  if (!text || !mode || !staleness)
    return ddp_error(DDP_ERR_INVALID, "ddp_ps_mode_parse: NULL argument");
  *staleness = 0;
  if (!strcmp(text, "sync")) {
    *mode = DDP_PS_SYNC;
    return DDP_OK;
  }
  if (!strcmp(text, "async")) {
    *mode = DDP_PS_ASYNC;
    return DDP_OK;
  }
  if (!strncmp(text, "ssp:", 4)) {
    char *end;
    errno = 0;
    long k = strtol(text + 4, &end, 10);
    if (!errno && end != text + 4 && !*end && k >= 0 && k <= 1000000) {
      *mode = DDP_PS_SSP;
      *staleness = (int32_t)k;
      return DDP_OK;
    }
  }
  return ddp_error(DDP_ERR_INVALID,
                   "parameter-server mode '%s': expected sync, async or ssp:K (K >= 0 steps "
                   "a trainer may run ahead of the slowest)",
                   text);
}

const char *ddp_ps_mode_name(ddp_ps_mode mode) {
  switch (mode) {
  case DDP_PS_SYNC: return "sync";
  case DDP_PS_ASYNC: return "async";
  case DDP_PS_SSP: return "ssp";
  }
  return "?";
}

ddp_ps_options ddp_ps_defaults(void) {
  ddp_ps_options o = {0};
  o.num_servers = 1;
  o.num_trainers = 1;
  o.mode = DDP_PS_SYNC;
  return o;
}

ddp_status ddp_ps_options_check(const ddp_ps_options *o) {
  if (!o) return ddp_error(DDP_ERR_INVALID, "parameter server: options are NULL");
  if (o->num_servers < 1)
    return ddp_error(DDP_ERR_INVALID, "parameter server: %d servers (need >= 1)", o->num_servers);
  if (o->num_trainers < 1)
    return ddp_error(DDP_ERR_INVALID,
                     "parameter server: %d trainers (the world must hold more ranks than the "
                     "%d servers)",
                     o->num_trainers, o->num_servers);
  if (o->mode < DDP_PS_SYNC || o->mode > DDP_PS_SSP)
    return ddp_error(DDP_ERR_INVALID, "parameter server: unknown mode %d", (int)o->mode);
  if (o->staleness < 0)
    return ddp_error(DDP_ERR_INVALID, "parameter server: staleness %d (>= 0)", o->staleness);
  return DDP_OK;
}

void ddp_ps_worker_name(const ddp_ps_options *o, int32_t rank, char out[DDP_RPC_MAX_NAME_BYTES]) {
  if (rank < o->num_servers) snprintf(out, DDP_RPC_MAX_NAME_BYTES, "ps%d", rank);
  else snprintf(out, DDP_RPC_MAX_NAME_BYTES, "trainer%d", rank - o->num_servers);
}

ddp_status ddp_ps_shard(const int64_t *numel, int32_t n, int32_t num_servers, int32_t *owner) {
  if (num_servers < 1 || n < 0 || (n > 0 && (!numel || !owner)))
    return ddp_error(DDP_ERR_INVALID, "ddp_ps_shard: %d tensors over %d servers", n, num_servers);
  if (n < num_servers)
    return ddp_error(DDP_ERR_INVALID,
                     "the model has %d parameter tensors, fewer than the %d servers: a server "
                     "would hold nothing (sharding is by whole tensors); use at most %d servers",
                     n, num_servers, n);
  int32_t *order = ddp_alloc((size_t)n * sizeof *order);
  int64_t *load = ddp_calloc((size_t)num_servers, sizeof *load);
  if (!order || !load) {
    ddp_free(order);
    ddp_free(load);
    return ddp_error(DDP_ERR_NOMEM, "ddp_ps_shard: out of memory for %d tensors", n);
  }
  /* Largest first, ties by index: a stable insertion sort (a model has tens
   * of tensors, and qsort is not stable). */
  for (int32_t i = 0; i < n; i++) {
    int32_t j = i;
    while (j > 0 && numel[order[j - 1]] < numel[i]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
  for (int32_t k = 0; k < n; k++) {
    int32_t best = 0;
    for (int32_t s = 1; s < num_servers; s++)
      if (load[s] < load[best]) best = s;
    owner[order[k]] = best;
    load[best] += numel[order[k]];
  }
  /* Longest-processing-time first gives every server a tensor when n >=
   * S only if no server got two before another got one: the first S
   * tensors go to S distinct empty servers (an empty server has the least
   * load), so yes. */
  ddp_free(order);
  ddp_free(load);
  return DDP_OK;
}
