/* spawn_demo: torch.multiprocessing.spawn in C. This process starts N workers
 * with ddp_spawn; each joins the job with ddp_init_process_group("env://")
 * (the store is hosted by this process), sums rank+1 over every rank and
 * checks it against N(N+1)/2.
 *
 *   ./build/bin/spawn_demo 4            # 4 workers, exit 0
 *   ./build/bin/spawn_demo 4 --fail 2   # rank 2 exits with code 3: the others
 *                                       # are stopped, a summary names rank 2
 *
 * The same program under ddprun is allreduce_demo: ddprun forks and executes,
 * ddp_spawn forks and calls a function. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

typedef struct demo_args {
  int fail_rank; /* -1: nobody fails */
} demo_args;

static int worker(int rank, void *arg) {
  const demo_args *args = arg;
  ddp_process_group *pg;
  if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error());
    return 1;
  }
  int world = ddp_process_group_size(pg);
  int64_t sum = rank + 1;
  int rc = 0;
  if (ddp_allreduce(pg, &sum, 1, DDP_INT64, DDP_REDUCE_SUM) != DDP_OK) {
    fprintf(stderr, "rank %d: allreduce: %s\n", rank, ddp_last_error());
    rc = 1;
  } else {
    printf("rank %d of %d: sum of rank+1 = %lld (want %d)\n", rank, world, (long long)sum,
           world * (world + 1) / 2);
    if (sum != (int64_t)world * (world + 1) / 2) rc = 1;
  }
  if (rank == args->fail_rank) {
    fprintf(stderr, "rank %d: failing on purpose\n", rank);
    return 3;
  }
  /* The others wait here and see rank fail_rank die (or get stopped). Their
   * error names the dead rank, which tells the supervisor they failed as a
   * consequence when all exits reach it at once (docs/launch.md). */
  if (rc == 0 && ddp_barrier(pg) != DDP_OK) {
    fprintf(stderr, "rank %d: barrier: %s\n", rank, ddp_last_error());
    rc = 1;
  }
  ddp_process_group_destroy(pg);
  return rc;
}

int main(int argc, char **argv) {
  int nprocs = argc > 1 ? atoi(argv[1]) : 4;
  demo_args args = {.fail_rank = -1};
  if (argc > 3 && strcmp(argv[2], "--fail") == 0) args.fail_rank = atoi(argv[3]);
  ddp_spawn_options opts = ddp_spawn_defaults();
  opts.timeout_s = 60;
  opts.grace_s = 2;
  if (ddp_spawn(nprocs, worker, &args, &opts) != DDP_OK) {
    fprintf(stderr, "spawn_demo: %s\n", ddp_last_error());
    return 1;
  }
  printf("spawn_demo: all %d workers succeeded\n", nprocs);
  return 0;
}
