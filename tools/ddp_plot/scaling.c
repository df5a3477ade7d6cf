/* Reading bench-ddp.sh's scaling table (scaling.h). */
#include "ddp_plot/scaling.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_plot/errors.h"

/* Splits line at tabs into at most `max` fields (the line is modified; a
 * trailing newline dropped). */
static int split(char *line, char **fields, int max) {
  line[strcspn(line, "\r\n")] = '\0';
  int n = 0;
  for (char *p = line;;) {
    if (n == max) return max + 1;
    fields[n++] = p;
    char *tab = strchr(p, '\t');
    if (!tab) break;
    *tab = '\0';
    p = tab + 1;
  }
  return n;
}

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int compare_int(const void *a, const void *b) {
  return *(const int *)a - *(const int *)b;
}

/* Finds or adds a side; -1 when there are too many. */
static int side_index(scaling *sc, const char *name) {
  for (int i = 0; i < sc->n_sides; i++)
    if (!strcmp(sc->side[i], name)) return i;
  if (sc->n_sides == SCALING_MAX_SIDES) return -1;
  snprintf(sc->side[sc->n_sides], sizeof sc->side[0], "%s", name);
  return sc->n_sides++;
}

static int world_index(scaling *sc, int world) {
  for (int i = 0; i < sc->n_worlds; i++)
    if (sc->world[i] == world) return i;
  if (sc->n_worlds == SCALING_MAX_WORLDS) return -1;
  sc->world[sc->n_worlds] = world;
  return sc->n_worlds++;
}

static bool add_run(scaling *sc, int s, int w, double v) {
  double *p = realloc(sc->runs[s][w], (size_t)(sc->n_runs[s][w] + 1) * sizeof(double));
  if (!p) return false;
  p[sc->n_runs[s][w]++] = v;
  sc->runs[s][w] = p;
  return true;
}

/* Worlds ascending (their runs moved along), medians, efficiencies. */
static void summarize(scaling *sc) {
  int order[SCALING_MAX_WORLDS];
  memcpy(order, sc->world, sizeof order);
  qsort(order, (size_t)sc->n_worlds, sizeof(int), compare_int);
  for (int s = 0; s < sc->n_sides; s++) {
    double *runs[SCALING_MAX_WORLDS] = {0};
    int n[SCALING_MAX_WORLDS] = {0};
    for (int k = 0; k < sc->n_worlds; k++) {
      int from = world_index(sc, order[k]);
      runs[k] = sc->runs[s][from];
      n[k] = sc->n_runs[s][from];
    }
    memcpy(sc->runs[s], runs, sizeof runs);
    memcpy(sc->n_runs[s], n, sizeof n);
  }
  memcpy(sc->world, order, sizeof order);
  for (int s = 0; s < sc->n_sides; s++) {
    for (int w = 0; w < sc->n_worlds; w++) {
      int n = sc->n_runs[s][w];
      double *sorted = n ? malloc((size_t)n * sizeof(double)) : NULL;
      if (sorted) {
        memcpy(sorted, sc->runs[s][w], (size_t)n * sizeof(double));
        qsort(sorted, (size_t)n, sizeof(double), compare_double);
      }
      sc->median[s][w] = sorted ? sorted[(n + 1) / 2 - 1] : NAN;
      free(sorted);
    }
    double base = sc->n_worlds && sc->world[0] == 1 ? sc->median[s][0] : NAN;
    for (int w = 0; w < sc->n_worlds; w++)
      sc->efficiency[s][w] = 100 * sc->median[s][w] / (sc->world[w] * base);
  }
}

bool scaling_read(scaling *sc, const char *path, char *err, size_t err_size) {
  memset(sc, 0, sizeof *sc);
  FILE *f = fopen(path, "r");
  if (!f) return plot_fail(err, err_size, "%s: %s", path, strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  long lineno = 0;
  int col_side = -1, col_world = -1, col_rate = -1, n_cols = 0;
  bool ok = true;
  while (ok && getline(&line, &cap, f) >= 0) {
    lineno++;
    char *fields[64];
    int n = split(line, fields, 64);
    if (n == 1 && !fields[0][0]) continue; /* blank */
    if (n > 64) {
      ok = plot_fail(err, err_size, "%s:%ld: more than 64 columns", path, lineno);
    } else if (col_side < 0) { /* the header */
      for (int i = 0; i < n; i++) {
        if (!strcmp(fields[i], "side")) col_side = i;
        else if (!strcmp(fields[i], "world")) col_world = i;
        else if (!strcmp(fields[i], "samples_per_s")) col_rate = i;
      }
      n_cols = n;
      if (col_side < 0 || col_world < 0 || col_rate < 0)
        ok = plot_fail(err, err_size, "%s:%ld: the header must name the columns side, world and "
                  "samples_per_s (tab-separated)", path, lineno);
    } else if (n != n_cols) {
      ok = plot_fail(err, err_size, "%s:%ld: %d fields, the header has %d", path, lineno, n, n_cols);
    } else {
      char *world_end, *rate_end;
      long world = strtol(fields[col_world], &world_end, 10);
      double rate = strtod(fields[col_rate], &rate_end);
      int s = side_index(sc, fields[col_side]);
      int w = world >= 1 && world <= 1 << 20 ? world_index(sc, (int)world) : -2;
      if (!*fields[col_world] || *world_end || w == -2)
        ok = plot_fail(err, err_size, "%s:%ld: world '%s' is not a positive integer", path, lineno,
                  fields[col_world]);
      else if (!*fields[col_rate] || *rate_end || !isfinite(rate) || rate <= 0)
        ok = plot_fail(err, err_size, "%s:%ld: samples_per_s '%s' is not a positive number", path,
                  lineno, fields[col_rate]);
      else if (!*fields[col_side])
        ok = plot_fail(err, err_size, "%s:%ld: an empty side", path, lineno);
      else if (s < 0 || w < 0)
        ok = plot_fail(err, err_size, "%s:%ld: more than %d sides or %d worlds", path, lineno,
                  SCALING_MAX_SIDES, SCALING_MAX_WORLDS);
      else if (!add_run(sc, s, w, rate))
        ok = plot_fail(err, err_size, "%s:%ld: out of memory", path, lineno);
    }
  }
  free(line);
  fclose(f);
  if (ok && col_side < 0) ok = plot_fail(err, err_size, "%s: empty (no header)", path);
  if (ok && sc->n_sides == 0) ok = plot_fail(err, err_size, "%s: a header but no rows", path);
  if (!ok) {
    scaling_free(sc);
    return false;
  }
  summarize(sc);
  return true;
}

void scaling_free(scaling *sc) {
  for (int s = 0; s < SCALING_MAX_SIDES; s++)
    for (int w = 0; w < SCALING_MAX_WORLDS; w++) free(sc->runs[s][w]);
  memset(sc, 0, sizeof *sc);
}
