/* The trainer's JSON-lines log (ddp-train --log): one object per step and
 * one per evaluation, a line at a time so a reader can follow it. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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
  fputs("}\n", log);
}

void ddp__train_log_eval(FILE *log, int64_t step, int64_t epoch, double loss, double accuracy) {
  fprintf(log, "{\"step\": %lld, \"epoch\": %lld, ", (long long)step, (long long)epoch);
  ddp__train_json_number(log, "test_loss", loss, true);
  ddp__train_json_number(log, "test_accuracy", accuracy, false);
  fputs("}\n", log);
}

/* The sample log: a line per step and rank,
 *   {"step": 7, "epoch": 0, "start": 5, "rank": 1, "replicas": 3,
 *    "first": 145, "samples": [812, 3, ...]}
 * where start is the step this process resumed from (0: a fresh run), so a
 * reader can tell which steps a later round redid (docs/launch.md, "Each
 * sample once"). Every rank writes its own file: ranks of several rounds
 * and nodes never share one. Line-buffered, so a killed worker leaves every
 * line of the steps it finished. */
ddp_status ddp__train_open_sample_log(ddp_trainer *t) {
  const char *dir = ddp_env_str("DDP_TRAIN_SAMPLE_LOG", NULL);
  if (!dir || !*dir) return DDP_OK;
  char path[4096];
  snprintf(path, sizeof path, "%s/samples.%ld.jsonl", dir, (long)getpid());
  t->sample_log = fopen(path, "w");
  if (!t->sample_log)
    return ddp_error(DDP_ERR_IO, "cannot write the sample log %s (DDP_TRAIN_SAMPLE_LOG): %s", path,
                     strerror(errno));
  setvbuf(t->sample_log, NULL, _IOLBF, 0);
  return DDP_OK;
}

void ddp__train_log_samples(ddp_trainer *t, int64_t step, int64_t epoch, int64_t start_step,
                            int64_t first_position, const ddp_batch *b) {
  FILE *f = t->sample_log;
  fprintf(f,
          "{\"step\": %lld, \"epoch\": %lld, \"start\": %lld, \"rank\": %d, \"replicas\": %d, "
          "\"first\": %lld, \"samples\": [",
          (long long)step, (long long)epoch, (long long)start_step, t->replica, t->replicas,
          (long long)first_position);
  for (int64_t i = 0; i < (int64_t)b->size; i++)
    fprintf(f, "%s%lld", i ? ", " : "", (long long)b->indices[i]);
  fputs("]}\n", f);
}
