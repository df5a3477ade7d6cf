/* rendezvous_demo: meet the other ranks and print who is who, and where each
 * value came from. Run it as a launcher would, e.g. two ranks on this host:
 *
 *   export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2
 *   RANK=0 ./build/bin/rendezvous_demo & RANK=1 ./build/bin/rendezvous_demo; wait
 *
 * or with an init URL:   ./rendezvous_demo 'tcp://127.0.0.1:29500?rank=0&world_size=2'
 *                        ./rendezvous_demo 'file:///tmp/rdzv?rank=1&world_size=2'
 * Under srun or mpirun it needs no variables at all (see docs/rendezvous.md).
 * DDP_LOG_LEVEL=debug shows the rendezvous step by step. */
#include <stdio.h>

#include "ddp/ddp.h"

/* Rank 0 may host the store, so it leaves last: every other rank says
 * goodbye through the store and rank 0 waits for all of them. */
static ddp_status leave_together(const ddp_rendezvous_info *info) {
  char key[64];
  if (info->rank != 0) {
    snprintf(key, sizeof key, "demo/bye/%d", (int)info->rank);
    return ddp_store_set(info->store, key, "", 0);
  }
  for (int r = 1; r < info->world_size; r++) {
    snprintf(key, sizeof key, "demo/bye/%d", r);
    const char *keys[1] = {key};
    DDP_TRY(ddp_store_wait(info->store, keys, 1, -1));
  }
  return DDP_OK;
}

int main(int argc, char **argv) {
  const char *url = argc > 1 ? argv[1] : "env://";
  ddp_rendezvous_info info;
  if (ddp_rendezvous(url, NULL, &info) != DDP_OK) {
    fprintf(stderr, "rendezvous_demo: %s\n", ddp_last_error());
    return 1;
  }
  printf("rank %d of %d, local rank %d of %d, host %d of %d (%s)\n"
         "  store %s%s, init %s://, timeout %g s\n"
         "  from: rank=%s world_size=%s local_rank=%s local_world_size=%s master=%s\n",
         (int)info.rank, (int)info.world_size, (int)info.local_rank, (int)info.local_world_size,
         (int)info.host_index, (int)info.num_hosts, info.host_id, info.store_addr,
         info.server ? " (hosted here)" : info.store_is_external ? " (launcher's)" : "",
         info.init_method, info.timeout_s, ddp_rendezvous_source_name(info.rank_source),
         ddp_rendezvous_source_name(info.world_size_source),
         ddp_rendezvous_source_name(info.local_rank_source),
         ddp_rendezvous_source_name(info.local_world_size_source),
         ddp_rendezvous_source_name(info.master_source));
  fflush(stdout);
  int rc = 0;
  if (leave_together(&info) != DDP_OK) {
    fprintf(stderr, "rendezvous_demo: rank %d: %s\n", (int)info.rank, ddp_last_error());
    rc = 1;
  }
  ddp_rendezvous_info_destroy(&info);
  return rc;
}
