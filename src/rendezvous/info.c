/* Small helpers of the rendezvous that talk to no one: source names and
 * option defaults. */
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

ddp_rendezvous_options ddp_rendezvous_defaults(void) {
  ddp_rendezvous_options opts;
  memset(&opts, 0, sizeof opts);
  opts.rank = -1;
  opts.world_size = -1;
  return opts;
}
