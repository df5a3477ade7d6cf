/* ddp-plot's figures (figures.h): the panels' layout, domains and series. */
#include "ddp_plot/figures.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_plot/chart.h"

#define FIG_WIDTH 1100.0
#define PANEL_W 540.0
#define GAP 10.0
#define PLOT_H 240.0
#define TOP 40.0 /* the figure's title */

static const char *const run_colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
#define RUN_COLOR(i) run_colors[(i) % (int)(sizeof run_colors / sizeof *run_colors)]

/* The stacked parts of a step, bottom to top; "other" is step_ms less the
 * others (the loss's reduction, bookkeeping). preempted_ms is a cause, not
 * a part, and is not stacked. */
static const struct {
  int field;
  const char *name, *color;
} phases[] = {
    {RUNLOG_LOAD_MS, "load", "#8dd3c7"},
    {RUNLOG_FORWARD_MS, "forward", "#80b1d3"},
    {RUNLOG_BACKWARD_COMPUTE_MS, "backward compute", "#fb8072"},
    {RUNLOG_BACKWARD_COMM_MS, "backward comm", "#fdb462"},
    {RUNLOG_OPTIMIZER_MS, "optimizer", "#b3de69"},
    {-1, "other", "#d9d9d9"},
};
#define N_PHASES (int)(sizeof phases / sizeof *phases)

/* Extent of the finite values of v[0..n) into [*lo, *hi]. */
static void extent(const double *v, size_t n, double *lo, double *hi) {
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(v[i])) continue;
    if (isnan(*lo) || v[i] < *lo) *lo = v[i];
    if (isnan(*hi) || v[i] > *hi) *hi = v[i];
  }
}

static void series_name(char *buf, size_t n, const char *label, const char *what) {
  snprintf(buf, n, "%s/%s", label, what);
}

/* Panels fill two columns, left to right, top to bottom. */
typedef struct layout {
  int index;
  double row_top, row_height;
} layout;

static void place(layout *l, double height, double *x, double *y) {
  int col = l->index % 2;
  if (col == 0 && l->index > 0) l->row_top += l->row_height + GAP;
  if (col == 0) l->row_height = 0;
  if (height > l->row_height) l->row_height = height;
  *x = GAP + col * (PANEL_W + GAP);
  *y = l->row_top;
  l->index++;
}

/* ---- train ------------------------------------------------------------------ */

typedef enum { X_STEPS, X_TIME } x_kind;

static void loss_panel(svg *s, layout *l, const runlog *runs, const char *const *labels, int n,
                       x_kind xk) {
  chart_spec spec = {.id = xk == X_STEPS ? "loss-steps" : "loss-time",
                     .title = xk == X_STEPS ? "Loss against steps" : "Loss against training time",
                     .x_label = xk == X_STEPS ? "step" : "training time (s)",
                     .y_label = "loss", .x_min = NAN, .x_max = NAN, .y_min = NAN, .y_max = NAN,
                     .legend_entries = 2 * n};
  for (int r = 0; r < n; r++) {
    extent(xk == X_STEPS ? runs[r].step : runs[r].time_s, runs[r].n_steps, &spec.x_min, &spec.x_max);
    extent(xk == X_STEPS ? runs[r].eval_step : runs[r].eval_time_s, runs[r].n_evals, &spec.x_min,
           &spec.x_max);
    extent(runs[r].value[RUNLOG_LOSS], runs[r].n_steps, &spec.y_min, &spec.y_max);
    extent(runs[r].test_loss, runs[r].n_evals, &spec.y_min, &spec.y_max);
  }
  double x, y;
  place(l, chart_panel_height(PLOT_H, spec.legend_entries), &x, &y);
  chart c;
  chart_begin(&c, s, &spec, x, y, PANEL_W, PLOT_H);
  char name[256];
  for (int r = 0; r < n; r++) {
    const runlog *g = &runs[r];
    series_name(name, sizeof name, labels[r], "loss");
    chart_line(&c, xk == X_STEPS ? g->step : g->time_s, g->value[RUNLOG_LOSS], g->n_steps,
               RUN_COLOR(r), false, name);
    series_name(name, sizeof name, labels[r], "test_loss");
    const double *ex = xk == X_STEPS ? g->eval_step : g->eval_time_s;
    chart_line(&c, ex, g->test_loss, g->n_evals, RUN_COLOR(r), true, name);
    chart_markers(&c, ex, g->test_loss, g->n_evals, RUN_COLOR(r));
    snprintf(name, sizeof name, "%s training", labels[r]);
    chart_legend_add(&c, name, RUN_COLOR(r), 0);
    snprintf(name, sizeof name, "%s test", labels[r]);
    chart_legend_add(&c, name, RUN_COLOR(r), 1);
  }
  chart_end(&c);
}

static bool has_finite(const double *v, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (isfinite(v[i])) return true;
  return false;
}

static void accuracy_panel(svg *s, layout *l, const runlog *runs, const char *const *labels,
                           int n, x_kind xk) {
  chart_spec spec = {.id = xk == X_STEPS ? "accuracy-steps" : "accuracy-time",
                     .title = xk == X_STEPS ? "Test accuracy against steps"
                                            : "Test accuracy against training time",
                     .x_label = xk == X_STEPS ? "step" : "training time (s)",
                     .y_label = "test accuracy (%)", .x_min = NAN, .x_max = NAN, .y_min = NAN,
                     .y_max = NAN};
  int shown = 0;
  for (int r = 0; r < n; r++) {
    if (!has_finite(runs[r].test_accuracy, runs[r].n_evals)) continue;
    shown++;
    extent(xk == X_STEPS ? runs[r].eval_step : runs[r].eval_time_s, runs[r].n_evals, &spec.x_min,
           &spec.x_max);
    for (size_t i = 0; i < runs[r].n_evals; i++) {
      double pct = 100 * runs[r].test_accuracy[i];
      extent(&pct, 1, &spec.y_min, &spec.y_max);
    }
  }
  spec.legend_entries = shown;
  double x, y;
  place(l, chart_panel_height(PLOT_H, shown), &x, &y);
  chart c;
  chart_begin(&c, s, &spec, x, y, PANEL_W, PLOT_H);
  if (!shown) chart_note(&c, "no test accuracy in these logs (a regression model)");
  char name[256];
  for (int r = 0; r < n; r++) {
    const runlog *g = &runs[r];
    if (!has_finite(g->test_accuracy, g->n_evals)) continue;
    double *pct = malloc((g->n_evals ? g->n_evals : 1) * sizeof(double));
    if (!pct) continue;
    for (size_t i = 0; i < g->n_evals; i++) pct[i] = 100 * g->test_accuracy[i];
    const double *ex = xk == X_STEPS ? g->eval_step : g->eval_time_s;
    series_name(name, sizeof name, labels[r], "test_accuracy");
    chart_line(&c, ex, pct, g->n_evals, RUN_COLOR(r), false, name);
    chart_markers(&c, ex, pct, g->n_evals, RUN_COLOR(r));
    chart_legend_add(&c, labels[r], RUN_COLOR(r), 0);
    free(pct);
  }
  chart_end(&c);
}

static void samples_panel(svg *s, layout *l, const runlog *runs, const char *const *labels,
                          int n) {
  chart_spec spec = {.id = "samples-steps", .title = "Samples per second (mean so far)",
                     .x_label = "step", .y_label = "samples/s", .x_min = NAN, .x_max = NAN,
                     .y_min = NAN, .y_max = NAN, .y_from_zero = true, .legend_entries = n};
  for (int r = 0; r < n; r++) {
    extent(runs[r].step, runs[r].n_steps, &spec.x_min, &spec.x_max);
    extent(runs[r].value[RUNLOG_SAMPLES_PER_S], runs[r].n_steps, &spec.y_min, &spec.y_max);
  }
  double x, y;
  place(l, chart_panel_height(PLOT_H, n), &x, &y);
  chart c;
  chart_begin(&c, s, &spec, x, y, PANEL_W, PLOT_H);
  char name[256];
  for (int r = 0; r < n; r++) {
    series_name(name, sizeof name, labels[r], "samples_per_s");
    chart_line(&c, runs[r].step, runs[r].value[RUNLOG_SAMPLES_PER_S], runs[r].n_steps,
               RUN_COLOR(r), false, name);
    chart_legend_add(&c, labels[r], RUN_COLOR(r), 0);
  }
  chart_end(&c);
}

/* A run's phases stacked: bins of k steps (figures.h), each bin at its
 * steps' mean, each layer the bin's mean (a NaN phase counts 0). */
static void phases_panel(svg *s, layout *l, const runlog *g, const char *label, int index) {
  size_t n = g->n_steps;
  size_t k = n > FIGURE_MAX_BINS ? (n + FIGURE_MAX_BINS - 1) / FIGURE_MAX_BINS : 1;
  size_t bins = (n + k - 1) / k;
  double *x = calloc(bins + 1, sizeof(double));
  double *level = calloc((size_t)(N_PHASES + 1) * (bins + 1), sizeof(double)); /* boundaries */
  char id[64], title[256], ylabel[96], name[256];
  snprintf(id, sizeof id, "phases-%d", index);
  snprintf(title, sizeof title, "Where a step's time went: %s", label);
  if (k > 1) snprintf(ylabel, sizeof ylabel, "ms per step (mean of %zu)", k);
  else snprintf(ylabel, sizeof ylabel, "ms per step");
  chart_spec spec = {.id = id, .title = title, .x_label = "step", .y_label = ylabel,
                     .x_min = NAN, .x_max = NAN, .y_min = 0, .y_max = NAN, .y_from_zero = true,
                     .legend_entries = N_PHASES};
  if (!x || !level) {
    free(x);
    free(level);
    return;
  }
  for (size_t b = 0; b < bins; b++) {
    size_t lo = b * k, hi = lo + k < n ? lo + k : n;
    double sum_step = 0, part[N_PHASES] = {0};
    for (size_t i = lo; i < hi; i++) {
      sum_step += g->step[i];
      double parts = 0;
      for (int p = 0; p < N_PHASES; p++) {
        double v;
        if (phases[p].field >= 0) {
          v = g->value[phases[p].field][i];
          if (!isfinite(v)) v = 0;
          parts += v;
        } else {
          v = g->value[RUNLOG_STEP_MS][i] - parts;
          if (v < 0) v = 0;
        }
        part[p] += v;
      }
    }
    x[b] = sum_step / (double)(hi - lo);
    for (int p = 0; p < N_PHASES; p++)
      level[(size_t)(p + 1) * bins + b] = level[(size_t)p * bins + b] + part[p] / (double)(hi - lo);
  }
  extent(x, bins, &spec.x_min, &spec.x_max);
  extent(level + (size_t)N_PHASES * bins, bins, &spec.y_min, &spec.y_max);
  double px, py;
  place(l, chart_panel_height(PLOT_H, N_PHASES), &px, &py);
  chart c;
  chart_begin(&c, s, &spec, px, py, PANEL_W, PLOT_H);
  for (int p = 0; p < N_PHASES; p++) {
    snprintf(name, sizeof name, "%s/%s", label, phases[p].name);
    chart_band(&c, x, level + (size_t)p * bins, level + (size_t)(p + 1) * bins, bins,
               phases[p].color, name);
    chart_legend_add(&c, phases[p].name, phases[p].color, 2);
  }
  if (n == 0) chart_note(&c, "no steps in this log");
  chart_end(&c);
  free(x);
  free(level);
}

/* The panels' total height, for the <svg> element: laid out once dry. */
static double train_height(const runlog *runs, int n) {
  layout l = {0};
  double x, y;
  int shown = 0;
  for (int r = 0; r < n; r++) shown += has_finite(runs[r].test_accuracy, runs[r].n_evals);
  place(&l, chart_panel_height(PLOT_H, 2 * n), &x, &y);
  place(&l, chart_panel_height(PLOT_H, 2 * n), &x, &y);
  place(&l, chart_panel_height(PLOT_H, shown), &x, &y);
  place(&l, chart_panel_height(PLOT_H, shown), &x, &y);
  place(&l, chart_panel_height(PLOT_H, n), &x, &y);
  for (int r = 0; r < n; r++) place(&l, chart_panel_height(PLOT_H, N_PHASES), &x, &y);
  return l.row_top + l.row_height + GAP;
}

void figure_train(FILE *out, const runlog *runs, const char *const *labels, int n,
                  const char *title) {
  svg s;
  svg_begin(&s, out, FIG_WIDTH, TOP + train_height(runs, n));
  svg_text(&s, "title", GAP, 26, "start", 0, title);
  layout l = {.row_top = TOP};
  loss_panel(&s, &l, runs, labels, n, X_STEPS);
  loss_panel(&s, &l, runs, labels, n, X_TIME);
  accuracy_panel(&s, &l, runs, labels, n, X_STEPS);
  accuracy_panel(&s, &l, runs, labels, n, X_TIME);
  samples_panel(&s, &l, runs, labels, n);
  for (int r = 0; r < n; r++) phases_panel(&s, &l, &runs[r], labels[r], r);
  svg_end(&s);
}

/* ---- scaling ------------------------------------------------------------------ */

static void scaling_panel(svg *s, layout *l, const scaling *sc, bool efficiency) {
  char cats[SCALING_MAX_WORLDS][16];
  const char *cat_ptr[SCALING_MAX_WORLDS];
  for (int w = 0; w < sc->n_worlds; w++) {
    snprintf(cats[w], sizeof cats[w], "%d", sc->world[w]);
    cat_ptr[w] = cats[w];
  }
  chart_spec spec = {.id = efficiency ? "efficiency-world" : "samples-world",
                     .title = efficiency ? "Scaling efficiency: samples/s(W) / (W x samples/s(1))"
                                         : "Samples per second against world size",
                     .x_label = "world size (ranks)",
                     .y_label = efficiency ? "efficiency (%)" : "samples/s (all ranks)",
                     .x_min = NAN, .x_max = NAN, .y_min = NAN, .y_max = NAN, .y_from_zero = true,
                     .categories = cat_ptr, .category_count = sc->n_worlds,
                     .legend_entries = sc->n_sides};
  for (int side = 0; side < sc->n_sides; side++) {
    for (int w = 0; w < sc->n_worlds; w++) {
      if (efficiency) extent(&sc->efficiency[side][w], 1, &spec.y_min, &spec.y_max);
      else extent(sc->runs[side][w], (size_t)sc->n_runs[side][w], &spec.y_min, &spec.y_max);
    }
  }
  if (efficiency) {
    double hundred = 100;
    extent(&hundred, 1, &spec.y_min, &spec.y_max);
  }
  double x, y;
  place(l, chart_panel_height(PLOT_H, sc->n_sides), &x, &y);
  chart c;
  chart_begin(&c, s, &spec, x, y, PANEL_W, PLOT_H);
  if (efficiency) chart_reference(&c, 100);
  double bar_w = 0.8 / sc->n_sides;
  for (int side = 0; side < sc->n_sides; side++) {
    double center[SCALING_MAX_WORLDS];
    for (int w = 0; w < sc->n_worlds; w++) center[w] = w + (side - (sc->n_sides - 1) / 2.0) * bar_w;
    const char *color = RUN_COLOR(side);
    chart_bars(&c, center, efficiency ? sc->efficiency[side] : sc->median[side],
               (size_t)sc->n_worlds, bar_w * 0.9, color, sc->side[side]);
    if (!efficiency) { /* each run, over its bar */
      for (int w = 0; w < sc->n_worlds; w++) {
        for (int k = 0; k < sc->n_runs[side][w]; k++) {
          double cx = center[w], v = sc->runs[side][w][k];
          svg_circle(s, "run", chart_px(&c, cx), chart_py(&c, v), 2.2,
                     "fill: #222222; fill-opacity: 0.6");
        }
      }
    }
    chart_legend_add(&c, sc->side[side], color, 2);
  }
  chart_end(&c);
}

void figure_scaling(FILE *out, const scaling *sc, const char *title) {
  svg s;
  double h = chart_panel_height(PLOT_H, sc->n_sides);
  svg_begin(&s, out, FIG_WIDTH, TOP + h + GAP);
  svg_text(&s, "title", GAP, 26, "start", 0, title);
  layout l = {.row_top = TOP};
  scaling_panel(&s, &l, sc, false);
  scaling_panel(&s, &l, sc, true);
  svg_end(&s);
}
