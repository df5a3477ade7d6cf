/* ddp-plot's input: the JSON-lines log of a training run (ddp-train --log,
 * or a trainer's log_path; src/train/train_log.c writes it): one object per
 * step {step, epoch, loss, lr, samples_per_s, load_ms, forward_ms,
 * backward_compute_ms, backward_comm_ms, optimizer_ms, step_ms,
 * preempted_ms} and one per evaluation {step, epoch, test_loss,
 * test_accuracy}, null for a value that does not exist. */
#ifndef DDP_TOOLS_PLOT_RUNLOG_H
#define DDP_TOOLS_PLOT_RUNLOG_H

#include <stdbool.h>
#include <stddef.h>

/* A step record's values, in the log's key order. */
enum {
  RUNLOG_LOSS, RUNLOG_LR, RUNLOG_SAMPLES_PER_S, RUNLOG_LOAD_MS, RUNLOG_FORWARD_MS,
  RUNLOG_BACKWARD_COMPUTE_MS, RUNLOG_BACKWARD_COMM_MS, RUNLOG_OPTIMIZER_MS, RUNLOG_STEP_MS,
  RUNLOG_PREEMPTED_MS, RUNLOG_STEP_FIELDS
};
/* The key of a step field ("loss", ...). */
const char *runlog_step_key(int field);

/* A run: arrays of n_steps step records and n_evals evaluations, in the
 * file's order. NaN where the log has null. Time is training time, the
 * sum of step_ms up to and including a step, in seconds (what the
 * trainer's train_seconds counts: steps, not evaluations); an evaluation's
 * is that of the step record before it. */
typedef struct runlog {
  char *path;
  size_t n_steps, n_evals;
  double *step, *time_s;           /* n_steps each */
  double *value[RUNLOG_STEP_FIELDS]; /* n_steps each */
  double *eval_step, *eval_time_s, *test_loss, *test_accuracy; /* n_evals each */
  size_t cap_steps, cap_evals;
} runlog;

/* Reads `path` into *log (zeroed first). Every line must be a JSON object
 * with an integer "step" and either "loss" (a step) or "test_loss" (an
 * evaluation); values numbers or null; blank lines are skipped. On error
 * returns false with "PATH:LINE: what" (or "PATH: what") in err and
 * nothing allocated. */
bool runlog_read(runlog *log, const char *path, char *err, size_t err_size);
void runlog_free(runlog *log);

#endif
