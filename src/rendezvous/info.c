/* Small helpers of the rendezvous that talk to no one: source names, option
 * defaults and the compact rank lists used in error messages. */
#include <stdio.h>
#include <string.h>

#include "rendezvous/rdzv_internal.h"

const char *ddp_rendezvous_source_name(ddp_rendezvous_source source) {
  switch (source) {
    case DDP_RENDEZVOUS_SOURCE_NONE: return "none";
    case DDP_RENDEZVOUS_SOURCE_OPTIONS: return "options";
    case DDP_RENDEZVOUS_SOURCE_URL: return "url";
    case DDP_RENDEZVOUS_SOURCE_ENV: return "env";
    case DDP_RENDEZVOUS_SOURCE_SLURM: return "slurm";
    case DDP_RENDEZVOUS_SOURCE_MPI: return "mpi";
    case DDP_RENDEZVOUS_SOURCE_HOSTS: return "hosts";
    case DDP_RENDEZVOUS_SOURCE_DEFAULT: return "default";
  }
  return "unknown";
}

void ddp_rendezvous_options_init(ddp_rendezvous_options *opts) {
  memset(opts, 0, sizeof *opts);
  opts->rank = -1;
  opts->world_size = -1;
}

void ddp__rdzv_format_ranks(const int32_t *ranks, int32_t count, int max_items, char *out,
                            size_t bytes) {
  size_t len = 0;
  int items = 0;
  out[0] = '\0';
  for (int32_t i = 0; i < count;) {
    int32_t j = i;
    while (j + 1 < count && ranks[j + 1] == ranks[j] + 1) j++;
    if (items == max_items) {
      snprintf(out + len, bytes - len, ", ... (%d more)", (int)(count - i));
      return;
    }
    int n;
    const char *sep = items ? ", " : "";
    if (j == i)
      n = snprintf(out + len, bytes - len, "%s%d", sep, (int)ranks[i]);
    else
      n = snprintf(out + len, bytes - len, "%s%d-%d", sep, (int)ranks[i], (int)ranks[j]);
    if (n < 0 || (size_t)n >= bytes - len) return; /* truncated: out stays terminated */
    len += (size_t)n;
    items++;
    i = j + 1;
  }
}
