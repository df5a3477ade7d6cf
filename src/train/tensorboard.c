/* The trainer's curves in a TensorBoard event file
 * (ddp_train_tensorboard_attach, include/ddp/train.h; the writer is io's,
 * include/ddp/tensorboard.h): callbacks that
 * write a step's and an evaluation's figures, then call the ones they
 * replaced. Tags are "<group>/<the JSON log's key>", so a curve and a log
 * column are found by the same name. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ddp/optim.h"
#include "ddp/tensorboard.h"
#include "ddp/train.h"

struct ddp_train_tensorboard {
  ddp_summary_writer *writer; /* rank 0 only; NULL elsewhere */
  bool writing;                /* rank 0 until a write fails */
  ddp_train_callbacks chained; /* what options->callbacks held before */
  char *options_text;          /* Markdown, written at the start (rank 0) */
  ddp_status error;            /* the first write error, after which nothing is written */
  char *error_message;
};

/* ---- The options as a Markdown table ------------------------------------ */

/* A string that grows; `failed` once memory ran out. */
typedef struct text {
  char *s;
  size_t len, cap;
  bool failed;
} text;

static void text_printf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_printf(text *t, const char *fmt, ...) {
  if (t->failed) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->s ? t->s + t->len : NULL, t->s ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->failed = true;
      return;
    }
    if (t->s && t->len + (size_t)n < t->cap) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap ? 2 * t->cap : 1024;
    while (cap <= t->len + (size_t)n) cap *= 2;
    char *s = ddp_alloc(cap);
    if (!s) {
      t->failed = true;
      return;
    }
    if (t->s) memcpy(s, t->s, t->len + 1);
    ddp_free(t->s);
    t->s = s;
    t->cap = cap;
  }
}

/* One table row: `key` | `value`, a pipe in the value escaped (GitHub
 * tables end a cell at any unescaped pipe, code span or not). */
static void row(text *t, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void row(text *t, const char *key, const char *fmt, ...) {
  char value[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(value, sizeof value, fmt, ap);
  va_end(ap);
  text_printf(t, "| `%s` | `", key);
  for (const char *p = value; *p; p++) {
    const char *pipe = strchr(p, '|');
    size_t n = pipe ? (size_t)(pipe - p) : strlen(p);
    text_printf(t, "%.*s%s", (int)n, p, pipe ? "\\|" : "");
    if (!pipe) break;
    p = pipe;
  }
  text_printf(t, "` |\n");
}

static const char *strategy_name(ddp_train_strategy s) {
  switch (s) {
  case DDP_TRAIN_AUTO: return "auto";
  case DDP_TRAIN_SINGLE: return "single";
  case DDP_TRAIN_DATA_PARALLEL: return "data_parallel";
  case DDP_TRAIN_PIPELINE: return "pipeline";
  case DDP_TRAIN_PARAM_SERVER: return "param_server";
  case DDP_TRAIN_ZERO: return "zero";
  }
  return "unknown";
}

static const char *yes_no(bool b) {
  return b ? "true" : "false";
}

/* Every field of the options that shapes the run, by its ddp_train_options
 * name, then the caller's checkpoint_meta (ddp-train's model, data and
 * flags). */
static void options_table(text *t, const ddp_train_options *o, int world_size) {
  const ddp_optim_options *op = &o->optim;
  text_printf(t, "| option | value |\n|---|---|\n");
  row(t, "world_size", "%d", world_size);
  row(t, "epochs", "%lld", (long long)o->epochs);
  row(t, "max_steps", "%lld", (long long)o->max_steps);
  row(t, "batch_size", "%lld", (long long)o->batch_size);
  row(t, "eval_batch_size", "%lld", (long long)o->eval_batch_size);
  row(t, "optim.kind", "%s", ddp_optim_kind_name(op->kind));
  row(t, "optim.lr", "%.9g", op->lr);
  row(t, "optim.weight_decay", "%.9g", op->weight_decay);
  row(t, "optim.maximize", "%s", yes_no(op->maximize));
  if (op->kind == DDP_OPTIM_SGD) {
    row(t, "optim.sgd.momentum", "%.9g", op->sgd.momentum);
    row(t, "optim.sgd.dampening", "%.9g", op->sgd.dampening);
    row(t, "optim.sgd.nesterov", "%s", yes_no(op->sgd.nesterov));
  } else if (op->kind == DDP_OPTIM_ADAM) {
    row(t, "optim.adam.betas", "%.9g, %.9g", op->adam.beta1, op->adam.beta2);
    row(t, "optim.adam.eps", "%.9g", op->adam.eps);
    row(t, "optim.adam.amsgrad", "%s", yes_no(op->adam.amsgrad));
  } else if (op->kind == DDP_OPTIM_ADADELTA) {
    row(t, "optim.adadelta.rho", "%.9g", op->adadelta.rho);
    row(t, "optim.adadelta.eps", "%.9g", op->adadelta.eps);
  }
  row(t, "step_lr_size", "%lld", (long long)o->step_lr_size);
  if (o->step_lr_size > 0) row(t, "step_lr_gamma", "%.9g", o->step_lr_gamma);
  row(t, "seed", "%llu", (unsigned long long)o->seed);
  row(t, "workers", "%d", o->workers);
  row(t, "strategy", "%s", strategy_name(o->strategy));
  row(t, "sync_bn", "%s", yes_no(o->sync_bn));
  row(t, "eval_every", "%lld", (long long)o->eval_every);
  row(t, "patience", "%lld", (long long)o->patience);
  char dev[DDP_DEVICE_STR_BYTES];
  row(t, "device", "%s", ddp_device_str(o->device, dev, sizeof dev));
  if (o->log_path) row(t, "log_path", "%s", o->log_path);
  if (o->save_path) {
    row(t, "save_path", "%s", o->save_path);
    row(t, "save_every", "%lld", (long long)o->save_every);
  }
  if (o->resume_path) row(t, "resume_path", "%s", o->resume_path);
  for (size_t i = 0; i < o->checkpoint_meta_count; i++)
    row(t, o->checkpoint_meta[i].key, "%s", o->checkpoint_meta[i].value);
}

/* ---- The callbacks ---------------------------------------------------------- */

/* After a failed write: remember it, say it once, write nothing more. */
static void write_failed(ddp_train_tensorboard *tb, ddp_status s) {
  tb->error = s;
  tb->error_message = ddp_strdup(ddp_last_error());
  tb->writing = false;
  DDP_WARN("%s; no more TensorBoard events are written", ddp_last_error());
}

static void tb_start(const ddp_train_start_info *info, void *user) {
  ddp_train_tensorboard *tb = user;
  if (tb->writing) {
    ddp_status s = ddp_summary_writer_add_text(tb->writer, "options", tb->options_text,
                                               info->step, NAN);
    if (s != DDP_OK) write_failed(tb, s);
  }
  if (tb->chained.on_start) tb->chained.on_start(info, tb->chained.user);
}

/* Appends tag = v when v is finite (the log writes null otherwise). */
static void add(const char **tags, float *values, size_t *n, const char *tag, double v) {
  if (!isfinite(v)) return;
  tags[*n] = tag;
  values[*n] = (float)v;
  (*n)++;
}

/* One event with the n scalars (none: no event). */
static void write_scalars(ddp_train_tensorboard *tb, size_t n, const char **tags,
                          const float *values, int64_t step) {
  if (n == 0) return;
  ddp_status s = ddp_summary_writer_add_scalars(tb->writer, n, tags, values, step, NAN);
  if (s != DDP_OK) write_failed(tb, s);
}

static bool tb_step(const ddp_train_step_info *info, void *user) {
  ddp_train_tensorboard *tb = user;
  if (tb->writing) {
    const char *tags[11];
    float values[11];
    size_t n = 0;
    const ddp_train_phases *p = &info->phases;
    add(tags, values, &n, "train/loss", info->loss);
    add(tags, values, &n, "train/lr", info->lr);
    add(tags, values, &n, "train/samples_per_s", info->samples_per_s);
    add(tags, values, &n, "phases/load_ms", p->load_ms);
    add(tags, values, &n, "phases/forward_ms", p->forward_ms);
    add(tags, values, &n, "phases/backward_compute_ms", p->backward_compute_ms);
    add(tags, values, &n, "phases/backward_comm_ms", p->backward_comm_ms);
    add(tags, values, &n, "phases/optimizer_ms", p->optimizer_ms);
    add(tags, values, &n, "phases/step_ms", p->step_ms);
    add(tags, values, &n, "phases/preempted_ms", p->preempted_ms);
    /* NaN, so left out, without a gradient scaler. */
    add(tags, values, &n, "train/loss_scale", info->loss_scale);
    write_scalars(tb, n, tags, values, info->step);
  }
  return tb->chained.on_step ? tb->chained.on_step(info, tb->chained.user) : false;
}

static bool tb_eval(const ddp_train_eval_info *info, void *user) {
  ddp_train_tensorboard *tb = user;
  if (tb->writing) {
    const char *tags[2];
    float values[2];
    size_t n = 0;
    add(tags, values, &n, "test/loss", info->test_loss);
    add(tags, values, &n, "test/accuracy", info->test_accuracy);
    write_scalars(tb, n, tags, values, info->step);
  }
  return tb->chained.on_eval ? tb->chained.on_eval(info, tb->chained.user) : false;
}

/* ---- Attaching ---------------------------------------------------------------- */

ddp_status ddp_train_tensorboard_attach(ddp_train_tensorboard **out,
                                        ddp_train_options *options, const char *dir,
                                        const ddp_process_group *pg) {
  *out = NULL;
  if (!dir || !*dir)
    return ddp_error(DDP_ERR_INVALID, "tensorboard: no directory given for the event file");
  ddp_train_tensorboard *tb = ddp_calloc(1, sizeof *tb);
  if (!tb) return ddp_error(DDP_ERR_NOMEM, "tensorboard: out of memory");
  if (!pg || ddp_process_group_rank(pg) == 0) {
    text t = {0};
    options_table(&t, options, pg ? ddp_process_group_size(pg) : 1);
    if (t.failed) {
      ddp_free(t.s);
      ddp_free(tb);
      return ddp_error(DDP_ERR_NOMEM, "tensorboard: out of memory describing the options");
    }
    tb->options_text = t.s;
    ddp_status s = ddp_summary_writer_create(&tb->writer, dir, NULL);
    if (s != DDP_OK) {
      ddp_free(tb->options_text);
      ddp_free(tb);
      return s;
    }
    tb->writing = true;
  }
  tb->chained = options->callbacks;
  options->callbacks = (ddp_train_callbacks){tb_start, tb_step, tb_eval, tb};
  *out = tb;
  return DDP_OK;
}

const char *ddp_train_tensorboard_path(const ddp_train_tensorboard *tb) {
  return tb && tb->writer ? ddp_summary_writer_path(tb->writer) : NULL;
}

ddp_status ddp_train_tensorboard_close(ddp_train_tensorboard *tb) {
  if (!tb) return DDP_OK;
  ddp_status s = tb->error;
  if (s != DDP_OK)
    ddp_error(s, "%s", tb->error_message ? tb->error_message : "writing TensorBoard events");
  ddp_summary_writer_destroy(tb->writer);
  ddp_free(tb->error_message);
  ddp_free(tb->options_text);
  ddp_free(tb);
  return s;
}
