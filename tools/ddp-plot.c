/* ddp-plot: draws training runs' JSON-lines logs (ddp-train --log) and
 * bench-ddp.sh's scaling table as SVG, written by our own code
 * (tools/ddp_plot/: the SVG writer, charts, the two readers, the figures), so
 * there is no plotting stack to install. docs/train.md, "Plots". Tools are
 * the only code that calls exit(). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "ddp/core.h"
#include "ddp_plot/figures.h"
#include "ddp_plot/runlog.h"
#include "ddp_plot/scaling.h"
#include "io/io_internal.h"

#define MAX_LOGS 16

static void usage(FILE *f) {
  fprintf(f,
"usage: ddp-plot [train] [options] LOG.jsonl ...\n"
"       ddp-plot scaling [options] TABLE.tsv\n"
"\n"
"Draws SVG from ddp's own output; open it in a browser or put it in a README.\n"
"\n"
"train (the default): one or more JSON-lines logs of ddp-train --log (or a trainer's\n"
"  log_path), several to compare: loss (training, and test at each evaluation) against\n"
"  steps and against training time (the sum of step_ms: evaluation not counted), test\n"
"  accuracy against both, samples/s against steps, and for each log where a step's time\n"
"  went (load, forward, backward compute, backward comm, optimizer, other) as stacked\n"
"  areas, averaged over bins of steps past 200 steps.\n"
"scaling: a tab-separated table with columns side, world, samples_per_s (a row per run,\n"
"  as scripts/bench-ddp.sh writes it): samples/s and scaling efficiency\n"
"  (samples/s(W) / (W x samples/s(1)), medians of the runs) against world size, the sides\n"
"  (ddp, PyTorch, ...) side by side.\n"
"\n"
"Options\n"
"  -o, --output FILE    write the SVG to FILE (default: standard output)\n"
"  --log FILE           a log to draw (the same as naming it; train only)\n"
"  --label NAME         the name of the next log in legends (default: its file name\n"
"                       without directory and .jsonl/.json/.log)\n"
"  --title TEXT         the figure's title\n"
"  -h, --help           this text\n"
"  --version            print \"ddp-plot (ddp) VERSION\"\n"
"\n"
"Examples:\n"
"  ddp-train --model convnet --epochs 3 --log run.jsonl && ddp-plot run.jsonl -o run.svg\n"
"  ddp-plot --label lr=0.01 a.jsonl --label lr=0.1 b.jsonl -o compare.svg\n"
"  ddp-plot scaling build/bench-ddp/scaling.tsv -o scaling.svg\n");
}

static _Noreturn void die(const char *message) {
  fprintf(stderr, "ddp-plot: error: %s\n", message);
  exit(1);
}

typedef struct plot_args {
  bool scaling;
  const char *output, *title;
  const char *inputs[MAX_LOGS];
  const char *labels[MAX_LOGS]; /* NULL: from the file name */
  int n_inputs;
} plot_args;

static void parse_args(int argc, char **argv, plot_args *a) {
  *a = (plot_args){0};
  const char *pending_label = NULL;
  int i = 1;
  if (i < argc && !strcmp(argv[i], "scaling")) a->scaling = true, i++;
  else if (i < argc && !strcmp(argv[i], "train")) i++;
  for (; i < argc; i++) {
    const char *f = argv[i];
    cli_help_or_version(f, usage);
    const char *v = NULL;
    bool valued = !strcmp(f, "-o") || !strcmp(f, "--output") || !strcmp(f, "--log") ||
                  !strcmp(f, "--label") || !strcmp(f, "--title");
    if (valued) {
      v = cli_option_value(argc, argv, &i, NULL);
    } else if (f[0] == '-' && f[1] != '\0') {
      cli_die_usage("unknown option '%s'", f);
    }
    if (!strcmp(f, "-o") || !strcmp(f, "--output")) a->output = v;
    else if (!strcmp(f, "--title")) a->title = v;
    else if (!strcmp(f, "--label")) pending_label = v;
    else {
      if (!strcmp(f, "--log") && a->scaling) cli_die_usage("%s is for training logs, not scaling", f);
      if (a->n_inputs == MAX_LOGS) cli_die_usage("at most 16 logs, got more at '%s'", v ? v : f);
      a->labels[a->n_inputs] = pending_label;
      a->inputs[a->n_inputs++] = v ? v : f;
      pending_label = NULL;
    }
  }
  if (pending_label) cli_die_usage("--label '%s' names no log after it", pending_label);
  if (a->n_inputs == 0)
    cli_die_usage("%s", a->scaling ? "scaling needs a table (TABLE.tsv)" : "no log given (LOG.jsonl)");
  if (a->scaling && a->n_inputs > 1) cli_die_usage("scaling draws one table, got also '%s'", a->inputs[1]);
}

/* "runs/a.jsonl" -> "a". */
static void default_label(const char *path, char *buf, size_t n) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  snprintf(buf, n, "%s", base);
  static const char *const ext[] = {".jsonl", ".json", ".log"};
  for (size_t k = 0; k < sizeof ext / sizeof *ext; k++) {
    size_t lb = strlen(buf), le = strlen(ext[k]);
    if (lb > le && !strcmp(buf + lb - le, ext[k])) {
      buf[lb - le] = '\0';
      break;
    }
  }
}

/* Where the SVG goes: standard output, or memory that close_output writes
 * over `output` atomically once complete (io's writer: a failed run leaves
 * no half picture). */
typedef struct output {
  FILE *f;
  char *text; /* open_memstream's (malloc) */
  size_t len;
} output;

static void open_output(output *o, const char *path) {
  *o = (output){.f = stdout};
  if (!path) return;
  o->f = open_memstream(&o->text, &o->len);
  if (!o->f) die("out of memory");
}

static void close_output(output *o, const char *path) {
  if (!path) {
    if (fflush(o->f) != 0 || ferror(o->f)) die("writing to standard output failed");
    return;
  }
  if (fclose(o->f) != 0) die("out of memory");
  ddp_status s = ddp__atomic_write_file(path, o->text, o->len);
  free(o->text);
  if (s != DDP_OK) die(ddp_last_error());
}

int main(int argc, char **argv) {
  cli_init("ddp-plot");
  plot_args a;
  parse_args(argc, argv, &a);
  char err[4400];
  if (a.scaling) {
    scaling sc;
    if (!scaling_read(&sc, a.inputs[0], err, sizeof err)) die(err);
    for (int s = 0; s < sc.n_sides; s++) {
      if (isnan(sc.efficiency[s][0])) {
        snprintf(err, sizeof err, "%s: side '%s' has no world-1 runs, the base of its "
                 "efficiency", a.inputs[0], sc.side[s]);
        die(err);
      }
    }
    output out;
    open_output(&out, a.output);
    figure_scaling(out.f, &sc, a.title ? a.title : "Data-parallel scaling");
    close_output(&out, a.output);
    scaling_free(&sc);
    return 0;
  }
  runlog runs[MAX_LOGS];
  char label_buf[MAX_LOGS][256];
  const char *labels[MAX_LOGS];
  for (int i = 0; i < a.n_inputs; i++) {
    if (!runlog_read(&runs[i], a.inputs[i], err, sizeof err)) die(err);
    if (a.labels[i]) snprintf(label_buf[i], sizeof label_buf[i], "%s", a.labels[i]);
    else default_label(a.inputs[i], label_buf[i], sizeof label_buf[i]);
    labels[i] = label_buf[i];
  }
  char title[1024];
  if (a.title) {
    snprintf(title, sizeof title, "%s", a.title);
  } else {
    size_t pos = (size_t)snprintf(title, sizeof title, "Training: ");
    for (int i = 0; i < a.n_inputs && pos < sizeof title; i++)
      pos += (size_t)snprintf(title + pos, sizeof title - pos, "%s%s", i ? ", " : "", labels[i]);
  }
  output out;
  open_output(&out, a.output);
  figure_train(out.f, runs, labels, a.n_inputs, title);
  close_output(&out, a.output);
  for (int i = 0; i < a.n_inputs; i++) runlog_free(&runs[i]);
  return 0;
}
