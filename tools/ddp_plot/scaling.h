/* ddp-plot scaling's input: a tab-separated table with a header naming at
 * least the columns side, world and samples_per_s (any order, others
 * ignored), one row per run: scripts/bench-ddp.sh writes every round's
 * figure for each side (ddp, PyTorch, ...) and world size. */
#ifndef DDP_TOOLS_PLOT_SCALING_H
#define DDP_TOOLS_PLOT_SCALING_H

#include <stdbool.h>
#include <stddef.h>

#define SCALING_MAX_SIDES 8
#define SCALING_MAX_WORLDS 32

/* The table by side (in order of first appearance) and world (ascending):
 * every run's samples/s, their median (the lower one for an even count,
 * as bench-ddp.sh takes it) and the efficiency against world 1,
 * median(W) / (W x median(1)), in percent (NaN without a world-1 row). */
typedef struct scaling {
  int n_sides, n_worlds;
  char side[SCALING_MAX_SIDES][64];
  int world[SCALING_MAX_WORLDS];
  double *runs[SCALING_MAX_SIDES][SCALING_MAX_WORLDS]; /* n_runs[s][w] values each */
  int n_runs[SCALING_MAX_SIDES][SCALING_MAX_WORLDS];
  double median[SCALING_MAX_SIDES][SCALING_MAX_WORLDS];     /* NaN: no run */
  double efficiency[SCALING_MAX_SIDES][SCALING_MAX_WORLDS]; /* percent */
} scaling;

/* Reads `path`; on error false with "PATH:LINE: what" in err and nothing
 * allocated. */
bool scaling_read(scaling *sc, const char *path, char *err, size_t err_size);
void scaling_free(scaling *sc);

#endif
