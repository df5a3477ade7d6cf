/* The search's cost per generation as the population grows (issue 22):
 * one worker on the 2-D sphere (an objective that costs nothing) for N
 * generations; the time per generation is the gap between consecutive
 * evaluations' starts, averaged over the 1,000 generations after the
 * first 1,000 and over the last 1,000. Propulate sorts its whole population
 * each generation, so its cost grows with it; ddp keeps the best pop_size as
 * individuals arrive. Median of --repeats runs.
 *   build/bin/bench_hpo [--generations 100000] [--repeats 5] [--checkpoint DIR]
 * Prints one line: "hpo generations=N early_us=... late_us=... late/early=..." */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

static double sphere(const ddp_hpo_space *s, const double *v, ddp_process_group *w, void *u) {
  (void)s, (void)w, (void)u;
  return 0.0 + v[0] * v[0] + v[1] * v[1];
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int64_t gens = 100000;
  int repeats = 5;
  const char *ckpt = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--generations") && i + 1 < argc) gens = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--checkpoint") && i + 1 < argc) ckpt = argv[++i];
    else {
      fprintf(stderr, "usage: bench_hpo [--generations N] [--repeats R] [--checkpoint DIR]\n");
      return 2;
    }
  }
  if (gens < 4000 || repeats < 1) {
    fprintf(stderr, "bench_hpo: --generations >= 4000 and --repeats >= 1\n");
    return 2;
  }
  ddp_hpo_space *space;
  if (ddp_hpo_space_parse("a=float:-5.12:5.12,b=float:-5.12:5.12", &space) != DDP_OK) return 1;
  double early[64], late[64], ratio[64];
  if (repeats > 64) repeats = 64;
  for (int r = 0; r < repeats; r++) {
    ddp_hpo_options o = ddp_hpo_defaults();
    o.generations = gens;
    o.seed = r;
    char dir[4200];
    if (ckpt) {
      snprintf(dir, sizeof dir, "%s/run-%d", ckpt, r);
      o.checkpoint_dir = dir;
    }
    ddp_hpo_result res;
    if (ddp_hpo_search(space, &o, sphere, NULL, &res) != DDP_OK) {
      fprintf(stderr, "bench_hpo: %s\n", ddp_last_error());
      return 1;
    }
    const ddp_hpo_individual *ind = res.individuals;
    early[r] = 1e6 * (ind[2000].start_s - ind[1000].start_s) / 1000;
    late[r] = 1e6 * (ind[gens - 1].start_s - ind[gens - 1001].start_s) / 1000;
    ratio[r] = late[r] / early[r];
    ddp_hpo_result_free(&res);
  }
  qsort(early, (size_t)repeats, sizeof *early, cmp);
  qsort(late, (size_t)repeats, sizeof *late, cmp);
  qsort(ratio, (size_t)repeats, sizeof *ratio, cmp);
  printf("hpo generations=%lld early_us=%.3f late_us=%.3f late/early=%.3f (medians of %d)%s\n",
         (long long)gens, early[repeats / 2], late[repeats / 2], ratio[repeats / 2], repeats,
         ckpt ? " checkpoints on" : "");
  ddp_hpo_space_destroy(space);
  return 0;
}
