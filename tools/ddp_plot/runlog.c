/* Reading a training run's JSON-lines log (runlog.h) with the library's
 * JSON parser (src/io/json.c: strict RFC 8259, offsets in its errors). */
#include "ddp_plot/runlog.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/core.h"
#include "io/io_internal.h"
#include "ddp_plot/errors.h"

static const char *const step_keys[RUNLOG_STEP_FIELDS] = {
    "loss", "lr", "samples_per_s", "load_ms", "forward_ms", "backward_compute_ms",
    "backward_comm_ms", "optimizer_ms", "step_ms", "preempted_ms"};

const char *runlog_step_key(int field) {
  return step_keys[field];
}

/* Grows every array of `count` to hold one more element (capacity
 * doubling); false when memory runs out. */
static bool grow(double **arrays[], int count, size_t len, size_t *cap) {
  if (len < *cap) return true;
  size_t cap2 = *cap ? 2 * *cap : 256;
  for (int i = 0; i < count; i++) {
    double *p = realloc(*arrays[i], cap2 * sizeof(double));
    if (!p) return false;
    *arrays[i] = p;
  }
  *cap = cap2;
  return true;
}

/* A member that must be a number or null: its value, NaN for null or
 * absent. */
static bool number(const ddp__json *obj, const char *key, double *out, const char *where,
                   char *err, size_t n) {
  const ddp__json *v = ddp__json_get(obj, key);
  *out = NAN;
  if (!v || v->kind == DDP__JSON_NULL) return true;
  if (v->kind != DDP__JSON_NUMBER)
    return plot_fail(err, n, "%s: \"%s\" is %s %s, expected a number or null", where, key,
                v->kind == DDP__JSON_ARRAY || v->kind == DDP__JSON_OBJECT ? "an" : "a",
                ddp__json_kind_name(v->kind));
  *out = v->number;
  return true;
}

/* One line's object into the log. */
static bool add_record(runlog *log, const ddp__json *obj, const char *where, double *clock_s,
                       char *err, size_t n) {
  if (obj->kind != DDP__JSON_OBJECT)
    return plot_fail(err, n, "%s: a record must be a JSON object, not %s %s", where,
                obj->kind == DDP__JSON_ARRAY ? "an" : "a", ddp__json_kind_name(obj->kind));
  const ddp__json *step = ddp__json_get(obj, "step");
  if (!step || step->kind != DDP__JSON_NUMBER || !step->is_integer)
    return plot_fail(err, n, "%s: a record needs an integer \"step\"", where);
  if (ddp__json_get(obj, "loss")) {
    double **arrays[RUNLOG_STEP_FIELDS + 2] = {&log->step, &log->time_s};
    for (int f = 0; f < RUNLOG_STEP_FIELDS; f++) arrays[2 + f] = &log->value[f];
    if (!grow(arrays, RUNLOG_STEP_FIELDS + 2, log->n_steps, &log->cap_steps))
      return plot_fail(err, n, "%s: out of memory", where);
    size_t i = log->n_steps;
    for (int f = 0; f < RUNLOG_STEP_FIELDS; f++)
      if (!number(obj, step_keys[f], &log->value[f][i], where, err, n)) return false;
    double ms = log->value[RUNLOG_STEP_MS][i];
    if (!isfinite(ms) || ms < 0)
      return plot_fail(err, n, "%s: a step record needs \"step_ms\" >= 0", where);
    *clock_s += ms / 1000;
    log->step[i] = (double)step->integer;
    log->time_s[i] = *clock_s;
    log->n_steps++;
    return true;
  }
  if (ddp__json_get(obj, "test_loss")) {
    double **arrays[4] = {&log->eval_step, &log->eval_time_s, &log->test_loss,
                          &log->test_accuracy};
    if (!grow(arrays, 4, log->n_evals, &log->cap_evals))
      return plot_fail(err, n, "%s: out of memory", where);
    size_t i = log->n_evals;
    if (!number(obj, "test_loss", &log->test_loss[i], where, err, n) ||
        !number(obj, "test_accuracy", &log->test_accuracy[i], where, err, n))
      return false;
    log->eval_step[i] = (double)step->integer;
    log->eval_time_s[i] = *clock_s;
    log->n_evals++;
    return true;
  }
  return plot_fail(err, n, "%s: neither a step record (no \"loss\") nor an evaluation (no "
                      "\"test_loss\")", where);
}

bool runlog_read(runlog *log, const char *path, char *err, size_t err_size) {
  memset(log, 0, sizeof *log);
  FILE *f = fopen(path, "r");
  if (!f) return plot_fail(err, err_size, "%s: %s", path, strerror(errno));
  log->path = strdup(path);
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  long number_of_line = 0;
  double clock_s = 0;
  bool ok = log->path != NULL;
  if (!ok) plot_fail(err, err_size, "%s: out of memory", path);
  while (ok && (len = getline(&line, &cap, f)) >= 0) {
    number_of_line++;
    if (strspn(line, " \t\r\n") == (size_t)len) continue;
    char where[4200];
    snprintf(where, sizeof where, "%s:%ld", path, number_of_line);
    ddp__json_doc doc;
    if (ddp__json_parse(line, (size_t)len, 0, &doc) != DDP_OK) {
      ok = plot_fail(err, err_size, "%s: %s", where, ddp_last_error());
      break;
    }
    ok = add_record(log, doc.root, where, &clock_s, err, err_size);
    ddp__json_free(&doc);
  }
  if (ok && ferror(f)) ok = plot_fail(err, err_size, "%s: %s", path, strerror(errno));
  free(line);
  fclose(f);
  if (ok && log->n_steps == 0 && log->n_evals == 0)
    ok = plot_fail(err, err_size, "%s: no records (an empty log)", path);
  if (!ok) runlog_free(log);
  return ok;
}

void runlog_free(runlog *log) {
  free(log->path);
  free(log->step);
  free(log->time_s);
  for (int f = 0; f < RUNLOG_STEP_FIELDS; f++) free(log->value[f]);
  free(log->eval_step);
  free(log->eval_time_s);
  free(log->test_loss);
  free(log->test_accuracy);
  memset(log, 0, sizeof *log);
}
