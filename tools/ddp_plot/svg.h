/* ddp-plot's SVG output: a document written element by element to a
 * FILE, with text escaped and coordinates rounded to 1/100 pixel. Knows
 * nothing of charts (chart.c draws with it). SVG 1.1, viewable in any
 * browser and on GitHub. */
#ifndef DDP_TOOLS_PLOT_SVG_H
#define DDP_TOOLS_PLOT_SVG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* A document being written; `f` is borrowed. */
typedef struct svg {
  FILE *f;
  int depth; /* open groups */
} svg;

/* The <svg> element (width x height pixels) with the figure's stylesheet:
 * classes for frames, axes, ticks, grid lines, labels and legends, so the
 * drawing code names what a thing is and the look stays in one place. */
void svg_begin(svg *s, FILE *f, double width, double height);
void svg_end(svg *s);

/* <g class="cls" [attrs]>: attrs is written as is (may be NULL; built
 * with svg_attr_printf's care for escaping). */
void svg_group_begin(svg *s, const char *cls, const char *attrs);
void svg_group_end(svg *s);

void svg_line(svg *s, const char *cls, double x1, double y1, double x2, double y2);
void svg_rect(svg *s, const char *cls, double x, double y, double w, double h,
              const char *style);
void svg_circle(svg *s, const char *cls, double cx, double cy, double r, const char *style);
/* anchor: "start", "middle" or "end"; rotate: degrees about (x, y). */
void svg_text(svg *s, const char *cls, double x, double y, const char *anchor, double rotate,
              const char *text);

/* A <path>: begin, then points (the first moves, the rest draw lines;
 * svg_path_move starts a new subpath), svg_path_close closes a subpath,
 * and svg_path_end writes the attributes after d. Points are absolute,
 * written "M x y" / "L x y". */
void svg_path_begin(svg *s);
void svg_path_move(svg *s, double x, double y);
void svg_path_line(svg *s, double x, double y);
void svg_path_close(svg *s);
void svg_path_end(svg *s, const char *cls, const char *style, const char *series);

/* Writes text with &, <, >, " escaped. */
void svg_escape(FILE *f, const char *text);

#endif
