/* elastic_worker: the program test_elastic.sh runs under elastic ddprun
 * agents. It prints what torchrun's variables say, then "trains": --steps
 * allreduces, one every --step-ms, each checked against its closed form for
 * the world it is in, so a rank of a group that a node left fails in its
 * next collective (as a training step would) and a group that re-formed must
 * agree on its new world.
 *   elastic_worker [--steps N] [--step-ms MS] [--fail-rank R] [--fail-restart C]
 *   --fail-rank R: global rank R writes a torchrun error record to
 *   $TORCHELASTIC_ERROR_FILE and exits 3 after its first step (only while
 *   TORCHELASTIC_RESTART_COUNT is --fail-restart, default 0).
 * Output: "elastic_worker rank R/W local L/LW group G/GW restart C" once;
 * "elastic_worker rank R/W step S ok" per step; "elastic_worker rank R/W done". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"

static int env_int(const char *name) {
  const char *v = getenv(name);
  return v ? atoi(v) : -1;
}

static void write_error_record(int rank) {
  const char *path = getenv("TORCHELASTIC_ERROR_FILE");
  if (!path) return;
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  /* torchrun's @record format (torch/distributed/elastic/multiprocessing/errors). */
  fprintf(f, "{\"message\": {\"message\": \"ValueError: rank %d found a bad batch\\nat step 1\", "
             "\"extraInfo\": {\"py_callstack\": \"Traceback ...\", \"timestamp\": \"%lld\"}}}\n",
          rank, (long long)time(NULL));
  fclose(f);
  rename(tmp, path); /* whole or absent for the launcher */
}

int main(int argc, char **argv) {
  int steps = 20, step_ms = 100, fail_rank = -1, fail_restart = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--steps") == 0) steps = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--step-ms") == 0) step_ms = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--fail-rank") == 0) fail_rank = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--fail-restart") == 0) fail_restart = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "elastic_worker: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), restart = env_int("TORCHELASTIC_RESTART_COUNT");
  printf("elastic_worker rank %d/%d local %d/%d group %d/%d restart %d\n", rank, world, env_int("LOCAL_RANK"),
         env_int("LOCAL_WORLD_SIZE"), env_int("GROUP_RANK"), env_int("GROUP_WORLD_SIZE"), restart);
  fflush(stdout);
  ddp_process_group *pg;
  if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) {
    fprintf(stderr, "elastic_worker rank %d: %s\n", rank, ddp_last_error());
    return 1;
  }
  double tri = world * (world + 1) / 2.0;
  for (int s = 0; s < steps; s++) {
    double x = rank + 1;
    if (ddp_allreduce(pg, &x, 1, DDP_FLOAT64, DDP_REDUCE_SUM) != DDP_OK) {
      fprintf(stderr, "elastic_worker rank %d: step %d: %s\n", rank, s, ddp_last_error());
      return 1;
    }
    if (x != tri) {
      fprintf(stderr, "elastic_worker rank %d: step %d: sum %g, expected %g for world %d\n", rank, s, x, tri, world);
      return 1;
    }
    printf("elastic_worker rank %d/%d step %d ok\n", rank, world, s);
    fflush(stdout);
    if (rank == fail_rank && restart == fail_restart) {
      write_error_record(rank);
      return 3;
    }
    usleep((useconds_t)step_ms * 1000);
  }
  int ok = ddp_barrier(pg) == DDP_OK;
  ddp_process_group_destroy(pg);
  if (!ok) return 1;
  printf("elastic_worker rank %d/%d done\n", rank, world);
  return 0;
}
