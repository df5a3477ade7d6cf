/* The SVG writer (svg.h). */
#include "ddp_plot/svg.h"

#include <math.h>

/* Coordinates to 1/100 pixel: exact enough for any screen, and a 2000-
 * point series stays small. -0 is written as 0. */
static void num(FILE *f, double v) {
  double r = round(v * 100) / 100;
  if (r == 0) r = 0;
  fprintf(f, "%.2f", r);
}

void svg_escape(FILE *f, const char *text) {
  for (const char *p = text; *p; p++) {
    switch (*p) {
    case '&': fputs("&amp;", f); break;
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '"': fputs("&quot;", f); break;
    default: fputc(*p, f);
    }
  }
}

void svg_begin(svg *s, FILE *f, double width, double height) {
  s->f = f;
  s->depth = 0;
  fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%.0f\" "
             "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"Helvetica, Arial, "
             "sans-serif\">\n", width, height, width, height);
  fprintf(f,
          "<style>\n"
          ".background { fill: #ffffff; }\n"
          ".title { font-size: 16px; font-weight: bold; fill: #222222; }\n"
          ".panel-title { font-size: 13px; font-weight: bold; fill: #222222; }\n"
          ".frame { fill: none; stroke: #bbbbbb; stroke-width: 1; }\n"
          ".grid { stroke: #eeeeee; stroke-width: 1; }\n"
          ".domain { stroke: #444444; stroke-width: 1; }\n"
          ".tick line { stroke: #444444; stroke-width: 1; }\n"
          ".tick text { font-size: 10px; fill: #444444; }\n"
          ".label { font-size: 11px; fill: #222222; }\n"
          ".note { font-size: 11px; fill: #888888; font-style: italic; }\n"
          ".legend text { font-size: 10px; fill: #222222; }\n"
          ".line { fill: none; stroke-width: 1.5; stroke-linejoin: round; }\n"
          ".dashed { stroke-dasharray: 5 3; }\n"
          ".area { stroke: none; fill-opacity: 0.85; }\n"
          ".bars { stroke: none; }\n"
          ".reference { stroke: #888888; stroke-width: 1; stroke-dasharray: 3 3; }\n"
          "</style>\n");
  svg_rect(s, "background", 0, 0, width, height, NULL);
}

void svg_end(svg *s) {
  while (s->depth > 0) svg_group_end(s);
  fprintf(s->f, "</svg>\n");
}

void svg_group_begin(svg *s, const char *cls, const char *attrs) {
  fprintf(s->f, "<g class=\"%s\"%s%s>\n", cls, attrs ? " " : "", attrs ? attrs : "");
  s->depth++;
}

void svg_group_end(svg *s) {
  fprintf(s->f, "</g>\n");
  s->depth--;
}

/* ` name="v"` with v rounded as num() does. */
static void attr(FILE *f, const char *name, double v) {
  fprintf(f, " %s=\"", name);
  num(f, v);
  fputc('"', f);
}

static void style_attr(FILE *f, const char *style) {
  if (style) fprintf(f, " style=\"%s\"", style);
}

void svg_line(svg *s, const char *cls, double x1, double y1, double x2, double y2) {
  fprintf(s->f, "<line class=\"%s\"", cls);
  attr(s->f, "x1", x1);
  attr(s->f, "y1", y1);
  attr(s->f, "x2", x2);
  attr(s->f, "y2", y2);
  fputs("/>\n", s->f);
}

void svg_rect(svg *s, const char *cls, double x, double y, double w, double h,
              const char *style) {
  fprintf(s->f, "<rect class=\"%s\"", cls);
  attr(s->f, "x", x);
  attr(s->f, "y", y);
  attr(s->f, "width", w);
  attr(s->f, "height", h);
  style_attr(s->f, style);
  fputs("/>\n", s->f);
}

void svg_circle(svg *s, const char *cls, double cx, double cy, double r, const char *style) {
  fprintf(s->f, "<circle class=\"%s\"", cls);
  attr(s->f, "cx", cx);
  attr(s->f, "cy", cy);
  attr(s->f, "r", r);
  style_attr(s->f, style);
  fputs("/>\n", s->f);
}

void svg_text(svg *s, const char *cls, double x, double y, const char *anchor, double rotate,
              const char *text) {
  fprintf(s->f, "<text class=\"%s\"", cls);
  attr(s->f, "x", x);
  attr(s->f, "y", y);
  fprintf(s->f, " text-anchor=\"%s\"", anchor);
  if (rotate != 0) {
    fprintf(s->f, " transform=\"rotate(%.0f ", rotate);
    num(s->f, x);
    fputc(' ', s->f);
    num(s->f, y);
    fputs(")\"", s->f);
  }
  fputc('>', s->f);
  svg_escape(s->f, text);
  fputs("</text>\n", s->f);
}

void svg_path_begin(svg *s) {
  fputs("<path d=\"", s->f);
}

static void point(svg *s, char op, double x, double y) {
  fprintf(s->f, "%c", op);
  num(s->f, x);
  fputc(' ', s->f);
  num(s->f, y);
  fputc(' ', s->f);
}

void svg_path_move(svg *s, double x, double y) {
  point(s, 'M', x, y);
}

void svg_path_line(svg *s, double x, double y) {
  point(s, 'L', x, y);
}

void svg_path_close(svg *s) {
  fputs("Z ", s->f);
}

void svg_path_end(svg *s, const char *cls, const char *style, const char *series) {
  fprintf(s->f, "\" class=\"%s\"", cls);
  style_attr(s->f, style);
  if (series) {
    fputs(" data-series=\"", s->f);
    svg_escape(s->f, series);
    fputc('"', s->f);
  }
  fputs("/>\n", s->f);
}
