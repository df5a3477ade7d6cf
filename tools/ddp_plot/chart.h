/* ddp-plot's charts: a panel with a frame, grid, two axes with round ticks,
 * a title, a legend, and series drawn in data coordinates (lines, stacked
 * areas, bars, markers). A panel is an SVG group that says where it maps
 * what, so a reader (tests/tools/check_svg.py) can take a drawing back to
 * data:
 *   <g class="panel" id="ID" data-domain="x0 x1 y0 y1" data-plot="left top width height">
 * x maps [x0, x1] onto [left, left + width], y maps [y0, y1] onto
 * [top + height, top]; each series is one <path class="series ..."
 * data-series="NAME">. */
#ifndef DDP_TOOLS_PLOT_CHART_H
#define DDP_TOOLS_PLOT_CHART_H

#include <stdbool.h>
#include <stddef.h>

#include "ddp_plot/svg.h"

#define CHART_MAX_LEGEND 32

typedef struct chart_legend_entry {
  char label[96];
  char color[16];
  int kind; /* 0 line, 1 dashed line, 2 filled box */
} chart_legend_entry;

typedef struct chart {
  svg *s;
  double left, top, width, height; /* the plot area, pixels */
  double x0, x1, y0, y1;           /* the data domain it shows */
  double legend_top, panel_left, panel_width;
  chart_legend_entry legend[CHART_MAX_LEGEND];
  int legend_count;
} chart;

/* What a panel shows: the data's extent on each axis (NaN: none, the axis
 * shows [0, 1]), axis labels, whether y starts at zero, and, for bar
 * charts, category names on x (then x is the category's index, 0..n-1). */
typedef struct chart_spec {
  const char *id, *title, *x_label, *y_label;
  double x_min, x_max, y_min, y_max;
  bool y_from_zero;
  const char *const *categories;
  int category_count;
  int legend_entries; /* room to reserve below the axis */
} chart_spec;

/* The height a panel of plot height `plot_height` takes with its title,
 * axes and a legend of `legend_entries` entries. */
double chart_panel_height(double plot_height, int legend_entries);

/* Starts a panel whose box is (x, y, w) wide with a plot `plot_height`
 * high: rounds the domain out to ticks, draws frame, grid, axes, title. */
void chart_begin(chart *c, svg *s, const chart_spec *spec, double x, double y, double w,
                 double plot_height);
/* The legend, then the group's end. */
void chart_end(chart *c);

double chart_px(const chart *c, double x);
double chart_py(const chart *c, double y);

/* A polyline through the points with finite x and y (a NaN point ends a
 * piece; the next finite one starts another). */
void chart_line(chart *c, const double *x, const double *y, size_t n, const char *color,
                bool dashed, const char *series);
/* A small circle at each finite point (not a series: it marks a line's
 * points where they are few, e.g. evaluations). */
void chart_markers(chart *c, const double *x, const double *y, size_t n, const char *color);
/* The band between lo[i] and hi[i] over x[i]: one closed path. */
void chart_band(chart *c, const double *x, const double *lo, const double *hi, size_t n,
                const char *color, const char *series);
/* Bars from 0 to value[i], centred on center[i], `width` data units wide:
 * one path of rectangles (a bar for a NaN value is left out). */
void chart_bars(chart *c, const double *center, const double *value, size_t n, double width,
                const char *color, const char *series);
/* A dashed horizontal line at y (e.g. 100 % efficiency). */
void chart_reference(chart *c, double y);
/* A grey line of text in the plot area's middle ("no accuracy in these
 * logs"). */
void chart_note(chart *c, const char *text);
void chart_legend_add(chart *c, const char *label, const char *color, int kind);

/* Tick spacing for [lo, hi] with about `count` ticks: 1, 2 or 5 times a
 * power of ten. */
double chart_tick_step(double lo, double hi, int count);

#endif
