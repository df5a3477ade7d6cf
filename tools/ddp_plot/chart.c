/* ddp-plot's charts (chart.h). */
#include "ddp_plot/chart.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define TITLE_H 24.0  /* above the plot area */
#define AXIS_H 40.0   /* below it: tick labels and the x label */
#define MARGIN_L 62.0 /* tick labels and the y label */
#define MARGIN_R 16.0
#define LEGEND_ROW 15.0
#define LEGEND_COLUMNS 3

double chart_panel_height(double plot_height, int legend_entries) {
  int rows = (legend_entries + LEGEND_COLUMNS - 1) / LEGEND_COLUMNS;
  return TITLE_H + plot_height + AXIS_H + (rows ? 10 + rows * LEGEND_ROW : 0) + 4;
}

double chart_tick_step(double lo, double hi, int count) {
  double raw = (hi - lo) / count;
  if (!(raw > 0) || !isfinite(raw)) return 1;
  double p = pow(10, floor(log10(raw)));
  double m = raw / p;
  return p * (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10);
}

/* The domain rounded out to whole ticks; an empty extent gets a width. */
static void nice_domain(double min, double max, bool from_zero, double *lo, double *hi,
                        double *step) {
  if (!isfinite(min) || !isfinite(max)) min = 0, max = 1;
  if (from_zero) {
    if (min > 0) min = 0;
    if (max < 0) max = 0;
  }
  if (max == min) {
    double pad = min == 0 ? 1 : fabs(min) * 0.1;
    min -= from_zero && min == 0 ? 0 : pad;
    max += pad;
  }
  *step = chart_tick_step(min, max, 5);
  *lo = floor(min / *step + 1e-9) * *step;
  *hi = ceil(max / *step - 1e-9) * *step;
}

/* A tick label with as many decimals as the spacing needs; thousands and
 * millions as k and M once ticks are that far apart (samples/s). */
static void tick_label(char *buf, size_t n, double v, double step) {
  if (fabs(v) < step * 1e-9) v = 0;
  const char *suffix = "";
  if (step >= 1e5) {
    v /= 1e6, step /= 1e6, suffix = "M";
  } else if (step >= 1e3 && fabs(v) >= 1e4) {
    v /= 1e3, step /= 1e3, suffix = "k";
  }
  int decimals = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
  snprintf(buf, n, "%.*f%s", decimals, v, v == 0 ? "" : suffix);
}

double chart_px(const chart *c, double x) {
  return c->left + c->width * (x - c->x0) / (c->x1 - c->x0);
}

double chart_py(const chart *c, double y) {
  return c->top + c->height * (1 - (y - c->y0) / (c->y1 - c->y0));
}

void chart_begin(chart *c, svg *s, const chart_spec *spec, double x, double y, double w,
                 double plot_height) {
  memset(c, 0, sizeof *c);
  c->s = s;
  c->panel_left = x;
  c->panel_width = w;
  c->left = x + MARGIN_L;
  c->top = y + TITLE_H;
  c->width = w - MARGIN_L - MARGIN_R;
  c->height = plot_height;
  c->legend_top = c->top + c->height + AXIS_H + 10; /* below the x label */
  double xstep, ystep;
  if (spec->category_count > 0) {
    c->x0 = -0.5;
    c->x1 = spec->category_count - 0.5;
    xstep = 1;
  } else {
    nice_domain(spec->x_min, spec->x_max, false, &c->x0, &c->x1, &xstep);
  }
  nice_domain(spec->y_min, spec->y_max, spec->y_from_zero, &c->y0, &c->y1, &ystep);

  char attrs[512];
  snprintf(attrs, sizeof attrs,
           "id=\"%s\" data-domain=\"%.17g %.17g %.17g %.17g\" data-plot=\"%.17g %.17g %.17g %.17g\"",
           spec->id, c->x0, c->x1, c->y0, c->y1, c->left, c->top, c->width, c->height);
  svg_group_begin(s, "panel", attrs);
  svg_text(s, "panel-title", c->left, y + 15, "start", 0, spec->title);

  /* Grid first, so the data draws over it. */
  char buf[64];
  svg_group_begin(s, "grid-lines", NULL);
  for (double v = c->y0; v <= c->y1 + ystep * 1e-6; v += ystep)
    svg_line(s, "grid", c->left, chart_py(c, v), c->left + c->width, chart_py(c, v));
  svg_group_end(s);
  svg_rect(s, "frame", c->left, c->top, c->width, c->height, NULL);

  svg_group_begin(s, "axis x", NULL);
  double base = c->top + c->height;
  svg_line(s, "domain", c->left, base, c->left + c->width, base);
  if (spec->category_count > 0) {
    for (int i = 0; i < spec->category_count; i++) {
      svg_group_begin(s, "tick", NULL);
      svg_line(s, "tick-mark", chart_px(c, i), base, chart_px(c, i), base + 4);
      svg_text(s, "tick-label", chart_px(c, i), base + 15, "middle", 0, spec->categories[i]);
      svg_group_end(s);
    }
  } else {
    for (double v = c->x0; v <= c->x1 + xstep * 1e-6; v += xstep) {
      tick_label(buf, sizeof buf, v, xstep);
      svg_group_begin(s, "tick", NULL);
      svg_line(s, "tick-mark", chart_px(c, v), base, chart_px(c, v), base + 4);
      svg_text(s, "tick-label", chart_px(c, v), base + 15, "middle", 0, buf);
      svg_group_end(s);
    }
  }
  svg_text(s, "label", c->left + c->width / 2, base + 32, "middle", 0, spec->x_label);
  svg_group_end(s);

  svg_group_begin(s, "axis y", NULL);
  svg_line(s, "domain", c->left, c->top, c->left, base);
  for (double v = c->y0; v <= c->y1 + ystep * 1e-6; v += ystep) {
    tick_label(buf, sizeof buf, v, ystep);
    svg_group_begin(s, "tick", NULL);
    svg_line(s, "tick-mark", c->left - 4, chart_py(c, v), c->left, chart_py(c, v));
    svg_text(s, "tick-label", c->left - 6, chart_py(c, v) + 3.5, "end", 0, buf);
    svg_group_end(s);
  }
  svg_text(s, "label", x + 14, c->top + c->height / 2, "middle", -90, spec->y_label);
  svg_group_end(s);
}

void chart_legend_add(chart *c, const char *label, const char *color, int kind) {
  if (c->legend_count == CHART_MAX_LEGEND) return;
  chart_legend_entry *e = &c->legend[c->legend_count++];
  snprintf(e->label, sizeof e->label, "%s", label);
  snprintf(e->color, sizeof e->color, "%s", color);
  e->kind = kind;
}

void chart_end(chart *c) {
  svg *s = c->s;
  if (c->legend_count > 0) {
    svg_group_begin(s, "legend", NULL);
    double col_w = (c->panel_width - MARGIN_L) / LEGEND_COLUMNS;
    for (int i = 0; i < c->legend_count; i++) {
      const chart_legend_entry *e = &c->legend[i];
      double x = c->left + (i % LEGEND_COLUMNS) * col_w;
      double y = c->legend_top + (i / LEGEND_COLUMNS) * LEGEND_ROW;
      char style[64];
      if (e->kind == 2) {
        snprintf(style, sizeof style, "fill: %s", e->color);
        svg_rect(s, "swatch", x, y - 8, 16, 9, style);
      } else {
        snprintf(style, sizeof style, "stroke: %s", e->color);
        fprintf(s->f, "<line class=\"line%s\" x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" "
                      "style=\"%s\"/>\n", e->kind == 1 ? " dashed" : "", x, y - 3.5, x + 16,
                y - 3.5, style);
      }
      svg_text(s, "legend-label", x + 21, y, "start", 0, e->label);
    }
    svg_group_end(s);
  }
  svg_group_end(s);
}

void chart_line(chart *c, const double *x, const double *y, size_t n, const char *color,
                bool dashed, const char *series) {
  svg *s = c->s;
  svg_path_begin(s);
  bool drawing = false;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(x[i]) || !isfinite(y[i])) {
      drawing = false;
      continue;
    }
    if (drawing) svg_path_line(s, chart_px(c, x[i]), chart_py(c, y[i]));
    else svg_path_move(s, chart_px(c, x[i]), chart_py(c, y[i]));
    drawing = true;
  }
  char style[64];
  snprintf(style, sizeof style, "stroke: %s", color);
  svg_path_end(s, dashed ? "series line dashed" : "series line", style, series);
}

void chart_markers(chart *c, const double *x, const double *y, size_t n, const char *color) {
  char style[64];
  snprintf(style, sizeof style, "fill: %s", color);
  for (size_t i = 0; i < n; i++)
    if (isfinite(x[i]) && isfinite(y[i]))
      svg_circle(c->s, "marker", chart_px(c, x[i]), chart_py(c, y[i]), 2.5, style);
}

void chart_band(chart *c, const double *x, const double *lo, const double *hi, size_t n,
                const char *color, const char *series) {
  svg *s = c->s;
  svg_path_begin(s);
  for (size_t i = 0; i < n; i++) {
    if (i == 0) svg_path_move(s, chart_px(c, x[i]), chart_py(c, hi[i]));
    else svg_path_line(s, chart_px(c, x[i]), chart_py(c, hi[i]));
  }
  for (size_t i = n; i-- > 0;) svg_path_line(s, chart_px(c, x[i]), chart_py(c, lo[i]));
  if (n) svg_path_close(s);
  char style[64];
  snprintf(style, sizeof style, "fill: %s", color);
  svg_path_end(s, "series area", style, series);
}

void chart_bars(chart *c, const double *center, const double *value, size_t n, double width,
                const char *color, const char *series) {
  svg *s = c->s;
  svg_path_begin(s);
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(value[i])) continue;
    double l = chart_px(c, center[i] - width / 2), r = chart_px(c, center[i] + width / 2);
    double b = chart_py(c, 0), t = chart_py(c, value[i]);
    svg_path_move(s, l, b);
    svg_path_line(s, l, t);
    svg_path_line(s, r, t);
    svg_path_line(s, r, b);
    svg_path_close(s);
  }
  char style[64];
  snprintf(style, sizeof style, "fill: %s", color);
  svg_path_end(s, "series bars", style, series);
}

void chart_reference(chart *c, double y) {
  svg_line(c->s, "reference", c->left, chart_py(c, y), c->left + c->width, chart_py(c, y));
}

void chart_note(chart *c, const char *text) {
  svg_text(c->s, "note", c->left + c->width / 2, c->top + c->height / 2, "middle", 0, text);
}
