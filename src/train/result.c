/* The result of a training run (ddp_train_result): its figures from the
 * loop's state once the loop is over, and their release. */
#include <math.h>
#include <stdlib.h>
#include <sys/resource.h>

#include "tensor/tape.h" /* ddp__tape_arena_on: the arenas' high water */
#include "train/train_internal.h"

#define MEMORY_FIGURES 7

/* The bytes a tape's arenas held at most: the host arena, and the device's
 * when the model is on a GPU. */
static double tape_high_water(ddp_tape *tape, ddp_device device) {
  if (!tape) return 0;
  double bytes = (double)ddp__tape_arena(tape)->high_water;
  if (device.type != DDP_DEVICE_CPU) {
    ddp_arena *a = ddp__tape_arena_on(tape, device);
    if (a && a != ddp__tape_arena(tape)) bytes += (double)a->high_water;
  }
  return bytes;
}

double ddp__train_per_second(int64_t count, double seconds) {
  return seconds > 0 ? (double)count / seconds : 0;
}

/* Every rank's memory figures (ddp_train_memory): its own entry filled,
 * then summed over the group (float64 sums of byte counts below 2^53 are
 * exact). */
static ddp_status memory_figures(ddp_trainer *t, ddp_train_result *res) {
  const int n = t->size > 0 ? t->size : 1, me = t->size > 0 ? t->rank : 0;
  double *sums = ddp_calloc((size_t)n * MEMORY_FIGURES, sizeof(double));
  ddp_train_memory *mem = ddp_calloc((size_t)n, sizeof *mem);
  if (!sums || !mem) {
    ddp_free(sums);
    ddp_free(mem);
    return ddp_error(DDP_ERR_NOMEM, "out of memory for %d ranks' figures", n);
  }
  double flat = 4.0 * (double)ddp_model_num_param_elements(t->step_model);
  double state = 0;
  for (size_t k = 0; t->opt && k < ddp_optimizer_state_count(t->opt); k++) {
    ddp_optim_state st;
    if (ddp_optimizer_state_get(t->opt, k, &st) == DDP_OK && !st.is_scalar)
      state += 4.0 * (double)st.numel;
  }
  double *mine = sums + MEMORY_FIGURES * me;
  int64_t param_bytes = (int64_t)flat, grad_bytes = (int64_t)flat, ring = 0, reduced = (int64_t)flat;
  if (t->strategy->memory) t->strategy->memory(t, &param_bytes, &grad_bytes, &ring, &reduced);
  mine[0] = (double)param_bytes;
  mine[1] = (double)grad_bytes;
  mine[2] = state;
  mine[3] = (double)reduced;
  mine[4] = mine[0] + mine[1] + state + tape_high_water(t->tape, t->o.device);
  if (t->graph) mine[4] += tape_high_water(ddp__train_graph_tape(t), t->o.device);
  struct rusage ru;
  mine[5] = getrusage(RUSAGE_SELF, &ru) == 0 ? 1024.0 * (double)ru.ru_maxrss : 0;
  mine[6] = (double)ring;
  ddp_status s = ddp__train_sum(t, sums, MEMORY_FIGURES * n);
  for (int r = 0; r < n; r++) {
    const double *f = sums + MEMORY_FIGURES * r;
    mem[r] = (ddp_train_memory){(int64_t)f[0], (int64_t)f[1], (int64_t)f[2],
                                (int64_t)f[3], (int64_t)f[4], (int64_t)f[5], (int64_t)f[6]};
  }
  ddp_free(sums);
  res->memory_per_rank = mem;
  if (s != DDP_OK) return ddp_error_wrap(s, "gathering the ranks' memory figures");
  return DDP_OK;
}

ddp_status ddp__train_fill_result(ddp_trainer *t, const ddp__train_run *r, ddp_train_result *res) {
  int64_t steps_run = r->step - r->start.step;
  const int64_t warmup = DDP__TRAIN_WARMUP_STEPS;
  double steady_steps = r->steps_here > warmup ? (double)(r->steps_here - warmup) : 0;
  res->samples_per_s = ddp__train_per_second(r->samples, r->train_seconds);
  res->steady_samples_per_s =
      r->steady_samples ? ddp__train_per_second(r->steady_samples, r->steady_seconds) : NAN;
  /* Mean over the last epoch's steps, or over all steps when fewer than an
   * epoch ran. */
  res->train_loss = steps_run == 0             ? NAN
                    : steps_run < r->per_epoch ? r->all_loss_sum / (double)steps_run
                    : r->epoch_losses          ? r->epoch_loss_sum / (double)r->epoch_losses
                                               : NAN;
  res->test_loss = r->last_loss;
  res->test_accuracy = r->last_accuracy;
  res->steps = r->step;
  res->steps_run = steps_run;
  res->epochs = r->per_epoch ? (double)r->step / (double)r->per_epoch : 0;
  res->world_size = t->size;
  res->stopped = r->stopped;
  const ddp_train_phases *p = &r->steady;
  const double n = steady_steps;
  res->steady_phases = (ddp_train_phases){1e3 * p->load_ms / n, 1e3 * p->forward_ms / n,
                                          1e3 * p->backward_compute_ms / n,
                                          1e3 * p->backward_comm_ms / n, 1e3 * p->optimizer_ms / n,
                                          1e3 * p->step_ms / n, 1e3 * p->preempted_ms / n};
  /* Every rank's mean preempted time over its steady steps: in a
   * synchronous step one rank's preemption stalls them all. */
  res->steady_preempted_ms_per_rank = ddp_calloc((size_t)t->size, sizeof(double));
  if (!res->steady_preempted_ms_per_rank)
    return ddp_error(DDP_ERR_NOMEM, "out of memory for %d ranks' figures", t->size);
  res->steady_preempted_ms_per_rank[t->rank] =
      steady_steps > 0 ? 1e3 * p->preempted_ms / steady_steps : NAN;
  ddp_status s = ddp__train_sum(t, res->steady_preempted_ms_per_rank, t->size);
  if (s != DDP_OK) return ddp_error_wrap(s, "gathering the ranks' preempted time");
  DDP_TRY(memory_figures(t, res));
  if (t->strategy->figures) DDP_TRY(t->strategy->figures(t, res));
  return DDP_OK;
}

void ddp_train_result_free(ddp_train_result *r) {
  if (!r) return;
  ddp_free(r->steady_preempted_ms_per_rank);
  r->steady_preempted_ms_per_rank = NULL;
  ddp_free((void *)r->stages);
  r->stages = NULL;
  ddp_free((void *)r->memory_per_rank);
  r->memory_per_rank = NULL;
  r->n_stages = 0;
}
