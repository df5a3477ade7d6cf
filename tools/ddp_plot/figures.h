/* ddp-plot's two figures, each one SVG document:
 *  - train: for one or more runs' logs, loss (training and test) against
 *    steps and against training time, test accuracy against both,
 *    samples/s against steps, and for each run the step's phases as
 *    stacked areas against steps;
 *  - scaling: samples/s and efficiency against world size, a group of bars
 *    per world with one bar per side (ddp, PyTorch), each run a dot.
 * Panel ids and series names are what tests/tools/check_svg.py looks up
 * (docs/train.md, "Plots"). */
#ifndef DDP_TOOLS_PLOT_FIGURES_H
#define DDP_TOOLS_PLOT_FIGURES_H

#include <stdio.h>

#include "ddp_plot/runlog.h"
#include "ddp_plot/scaling.h"

/* Most points a phases panel draws per layer: longer runs are averaged
 * over bins of ceil(n / FIGURE_MAX_BINS) consecutive steps. */
#define FIGURE_MAX_BINS 200

/* labels[i] names runs[i] in legends and series. */
void figure_train(FILE *out, const runlog *runs, const char *const *labels, int n,
                  const char *title);
void figure_scaling(FILE *out, const scaling *sc, const char *title);

#endif
