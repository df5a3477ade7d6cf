/* The trainer's JSON-lines log (ddp-train --log): one object per step and
 * one per evaluation, a line at a time so a reader can follow it. */
#include <math.h>

#include "train/train_internal.h"

/* %.17g: a number reads back as the very value (the loss a float32, the
 * rest doubles), so the log, TensorBoard's event files and a re-run can be
 * compared exactly. */
void ddp__train_json_number(FILE *f, const char *key, double v, bool comma) {
  if (isfinite(v))
    fprintf(f, "\"%s\": %.17g%s", key, v, comma ? ", " : "");
  else
    fprintf(f, "\"%s\": null%s", key, comma ? ", " : "");
}

void ddp__train_log_step(FILE *log, const ddp_train_step_info *s) {
  const ddp_train_phases *p = &s->phases;
  fprintf(log, "{\"step\": %lld, \"epoch\": %lld, ", (long long)s->step, (long long)s->epoch);
  ddp__train_json_number(log, "loss", s->loss, true);
  ddp__train_json_number(log, "lr", s->lr, true);
  ddp__train_json_number(log, "samples_per_s", s->samples_per_s, true);
  ddp__train_json_number(log, "load_ms", p->load_ms, true);
  ddp__train_json_number(log, "forward_ms", p->forward_ms, true);
  ddp__train_json_number(log, "backward_compute_ms", p->backward_compute_ms, true);
  ddp__train_json_number(log, "backward_comm_ms", p->backward_comm_ms, true);
  ddp__train_json_number(log, "optimizer_ms", p->optimizer_ms, true);
  ddp__train_json_number(log, "step_ms", p->step_ms, true);
  ddp__train_json_number(log, "preempted_ms", p->preempted_ms, false);
  /* With a gradient scaler only, so an fp32 run's records stay as they were. */
  if (!isnan(s->loss_scale)) {
    fputs(", ", log);
    ddp__train_json_number(log, "loss_scale", s->loss_scale, false);
    fprintf(log, ", \"skipped\": %s, \"skipped_steps\": %lld", s->skipped ? "true" : "false",
            (long long)s->skipped_steps);
  }
  fputs("}\n", log);
}

void ddp__train_log_eval(FILE *log, int64_t step, int64_t epoch, double loss, double accuracy) {
  fprintf(log, "{\"step\": %lld, \"epoch\": %lld, ", (long long)step, (long long)epoch);
  ddp__train_json_number(log, "test_loss", loss, true);
  ddp__train_json_number(log, "test_accuracy", accuracy, false);
  fputs("}\n", log);
}
