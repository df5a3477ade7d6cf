/* The training loop (include/ddp/train.h, docs/train.md): epochs of shuffled
 * batches, each a step of the trainer's strategy, the global batch's loss,
 * evaluation, early stopping, checkpoints at their steps, callbacks and the
 * timeline. One loop for every strategy: nothing here names one. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/trace.h"
#include "train/train_internal.h"

/* Whether any rank of the group asked to stop: a callback may decide on one
 * rank only (the search prunes on its lead), and the group must stop
 * together. Collective when the group has more than one rank. */
static ddp_status agree_to_stop(ddp_trainer *t, bool *stop) {
  if (!t->pg || t->size == 1) return DDP_OK;
  double any = *stop ? 1 : 0;
  ddp_status s = ddp__train_sum(t, &any, 1);
  if (s != DDP_OK) return ddp_error_wrap(s, "agreeing on a callback's stop over the ranks");
  *stop = any > 0;
  return DDP_OK;
}

static void phases_add(ddp_train_phases *sum, const ddp_train_phases *p) {
  sum->load_ms += p->load_ms;
  sum->forward_ms += p->forward_ms;
  sum->backward_compute_ms += p->backward_compute_ms;
  sum->backward_comm_ms += p->backward_comm_ms;
  sum->optimizer_ms += p->optimizer_ms;
  sum->step_ms += p->step_ms;
  sum->preempted_ms += p->preempted_ms;
}

/* Logs an evaluation and returns true when patience has run out. */
static bool record_eval(ddp__train_patience *p, FILE *log, double loss, double accuracy,
                        int64_t step, int64_t epoch) {
  if (log) ddp__train_log_eval(log, step, epoch, loss, accuracy);
  if (loss < p->best_loss) {
    p->best_loss = loss;
    p->without_better = 0;
    return false;
  }
  return p->limit && ++p->without_better >= p->limit;
}

/* ddp__train_evaluate, on the timeline when tracing. */
static ddp_status evaluate_traced(ddp_trainer *t, ddp__train_run *r) {
  int64_t t0 = t->trace ? ddp_time_ns() : 0;
  DDP_TRY(ddp__train_evaluate(t, &r->last_loss, &r->last_accuracy));
  if (t->trace) ddp__trace_add(t->trace, DDP__TRACE_EVALUATE, r->step, t0, ddp_time_ns());
  return DDP_OK;
}

/* Evaluates, tells on_eval, and returns in *stop whether patience ran out
 * or a callback asked (agreed over the group). `counts` false: the
 * evaluation is the end of training's, made where a run going on would not
 * make one, so early stopping's saved position leaves it out. */
static ddp_status evaluate_now(ddp_trainer *t, ddp__train_run *r, int64_t epoch,
                               ddp_train_eval_kind kind, bool counts, bool *stop) {
  DDP_TRY(evaluate_traced(t, r));
  r->evaluated_now = true;
  bool by_callback = false;
  if (t->o.callbacks.on_eval) {
    ddp_train_eval_info info = {.step = r->step, .epoch = epoch, .test_loss = r->last_loss,
                                .test_accuracy = r->last_accuracy, .kind = kind};
    by_callback = t->o.callbacks.on_eval(&info, t->o.callbacks.user);
    DDP_TRY(agree_to_stop(t, &by_callback));
  }
  ddp__train_patience after = r->pat;
  bool out_of_patience =
      record_eval(counts ? &r->pat : &after, t->log, r->last_loss, r->last_accuracy, r->step, epoch);
  *stop = out_of_patience || by_callback;
  if (by_callback) r->stopped = DDP_TRAIN_STOP_CALLBACK;
  else if (out_of_patience) r->stopped = DDP_TRAIN_STOP_PATIENCE;
  return DDP_OK;
}

/* The timeline of step `step` (t->trace): the step from t0 to t_end, its
 * load to t_loaded, the step's phases from its marks when it made them,
 * the loss's reduction from t_loss, and the strategy's own events (the
 * data-parallel wrapper's buckets). A step through a CUDA graph shows the
 * step, its load and the loss only (its phases are not separate
 * readings). */
static void trace_step(ddp_trainer *t, int64_t step, bool marked, int64_t t0, int64_t t_loaded,
                       int64_t t_loss, int64_t t_end) {
  ddp__trace *tr = t->trace;
  const int64_t *m = t->step_marks;
  ddp__trace_add(tr, DDP__TRACE_STEP, step, t0, t_end);
  ddp__trace_add(tr, DDP__TRACE_LOAD, step, t0, t_loaded);
  if (marked) {
    ddp__trace_add(tr, DDP__TRACE_FORWARD, step, m[0], m[1]);
    ddp__trace_add(tr, DDP__TRACE_BACKWARD, step, m[1], m[2]);
    ddp__trace_add(tr, DDP__TRACE_OPTIMIZER, step, m[2], m[3]);
  }
  ddp__trace_add(tr, DDP__TRACE_LOSS, step, t_loss, t_end);
  if (t->strategy->trace) t->strategy->trace(t, step);
}

/* One optimizer step on the next batch; *done when the epoch has none left. */
static ddp_status train_step(ddp_trainer *t, ddp__train_run *r, int64_t epoch, bool *done) {
  int64_t t0 = ddp_time_ns();
  int64_t preempted0 = ddp_preempt_clock_ns(&r->preempt_clock);
  ddp_batch b;
  ddp_status s = ddp_loader_next(t->train_loader, &b);
  if (s != DDP_OK) return ddp_error_wrap(s, "loading a batch");
  if (b.size == 0) {
    *done = true;
    return DDP_OK;
  }
  /* The strategy's step; the load so far is the loader's, to which a step
   * that copies the batch to a device adds the copy. */
  ddp__train_step_out out = {.counts = true, .marked = true};
  out.phases.load_ms = 1e-9 * (double)(ddp_time_ns() - t0);
  DDP_TRY(t->strategy->step(t, &b, &out));
  const ddp_train_phases ph = out.phases; /* seconds */
  const int64_t t_loaded = t0 + (int64_t)(1e9 * ph.load_ms);
  const float loss0 = out.loss;
  const bool counts = out.counts;
  double loss_sums[2] = {counts ? (double)loss0 * (double)b.size : 0, counts ? (double)b.size : 0};
  double load = ph.load_ms, forward = ph.forward_ms, backward_compute = ph.backward_compute_ms,
         backward_comm = 0, optimizer = ph.optimizer_ms;
  if (t->strategy->split_backward) t->strategy->split_backward(t, &backward_compute, &backward_comm);
  /* The loss of the global batch, reduced on this thread after the step:
   * the ranks have just met in the gradients' allreduce, so it waits for no
   * one, whereas an async reduction during backward handed to the progress
   * thread cost 2-3% of a world-2 step (BENCHMARKS.md). */
  const int64_t t_loss = t->trace ? ddp_time_ns() : 0;
  s = ddp__train_sum(t, loss_sums, 2);
  if (s != DDP_OK) return ddp_error_wrap(s, "reducing the loss");
  /* The preemption clock is read inside [t0, t_end]: the kernel adds a wait
   * when the thread runs again, so one read after t_end could count a
   * preemption between the two, and the step's preempted time exceed it. */
  int64_t preempted1 = ddp_preempt_clock_ns(&r->preempt_clock);
  const int64_t t_end = ddp_time_ns();
  double step_seconds = 1e-9 * (double)(t_end - t0);
  double preempted =
      preempted0 >= 0 && preempted1 >= 0 ? 1e-9 * (double)(preempted1 - preempted0) : NAN;
  r->train_seconds += step_seconds;
  float loss_value = (float)(loss_sums[0] / loss_sums[1]);
  if (!isfinite(loss_value)) /* the same value on every rank: all stop here */
    return ddp_error(DDP_ERR_RANGE, "the loss became %f at step %lld; try a smaller learning rate",
                     loss_value, (long long)r->step + 1);
  r->step++;
  if (t->trace) trace_step(t, r->step, out.marked, t0, t_loaded, t_loss, t_end);
  r->samples += (int64_t)loss_sums[1]; /* every rank's samples */
  const ddp_train_phases phases = {load, forward, backward_compute, backward_comm, optimizer,
                                   step_seconds, preempted};
  if (++r->steps_here > DDP__TRAIN_WARMUP_STEPS) {
    r->steady_seconds += step_seconds;
    r->steady_samples += (int64_t)loss_sums[1];
    phases_add(&r->steady, &phases);
  }
  if (t->sample_log) /* this shard's samples sit at epoch_pos + replica + i * replicas */
    ddp__train_log_samples(t, r->step, epoch, r->start.step, r->epoch_pos + t->replica, &b);
  r->epoch_steps++;
  r->epoch_losses++;
  r->epoch_pos += (int64_t)b.size * t->replicas; /* every shard took b.size positions */
  r->pos_epoch = epoch;
  r->pos_batches = r->epoch_steps;
  r->pos_samples = r->epoch_pos;
  r->epoch_loss_sum += loss_value;
  r->all_loss_sum += loss_value;
  ddp_train_step_info info = {
      .step = r->step, .epoch = epoch, .total_steps = r->total_steps, .loss = loss_value,
      .lr = ddp_optimizer_get_lr(t->opt),
      .samples_per_s = ddp__train_per_second(r->samples, r->train_seconds),
      .train_seconds = r->train_seconds,
      .phases = {1e3 * load, 1e3 * forward, 1e3 * backward_compute, 1e3 * backward_comm,
                 1e3 * optimizer, 1e3 * step_seconds, 1e3 * preempted}};
  if (t->log) ddp__train_log_step(t->log, &info);
  if (t->o.callbacks.on_step) {
    bool stop = t->o.callbacks.on_step(&info, t->o.callbacks.user);
    DDP_TRY(agree_to_stop(t, &stop));
    if (stop) {
      r->stop = true;
      r->stopped = DDP_TRAIN_STOP_CALLBACK;
    }
  }
  return DDP_OK;
}

/* One epoch: resumes mid-epoch where the checkpoint stopped, trains until
 * the epoch or a limit ends, then the schedule and the epoch's
 * evaluation. */
static ddp_status train_epoch(ddp_trainer *t, ddp__train_run *r, int64_t epoch) {
  const ddp_train_options *o = &t->o;
  /* Resuming in the middle of an epoch at another world (or one that
   * changed worlds before): the sampler deals out the rest of the epoch's
   * order from the saved position in samples. */
  const bool by_samples = epoch == r->start.epoch && ddp__train_resume_by_samples(t, &r->start);
  if (by_samples) {
    ddp_status s = ddp_sampler_distributed_resume(t->train_sampler, epoch, r->start.epoch_samples);
    if (s != DDP_OK) return ddp_error_wrap(s, "resuming epoch %lld at another world size", (long long)epoch + 1);
  }
  ddp_status s = ddp_loader_start_epoch(t->train_loader, epoch);
  if (s != DDP_OK) return ddp_error_wrap(s, "starting an epoch");
  r->epoch_loss_sum = 0;
  r->epoch_steps = 0;
  r->epoch_losses = 0;
  r->epoch_pos = 0;
  if (by_samples) {
    /* The epoch's end is still per_epoch steps: count the steps taken
     * before as whatever this world's per_epoch leaves to the rest. */
    int64_t left = ddp_loader_num_batches(t->train_loader);
    r->epoch_steps = r->per_epoch > left ? r->per_epoch - left : 0;
    r->epoch_pos = r->start.epoch_samples;
  }
  /* Resuming in the middle of an epoch at its own world: the same order
   * (seed + epoch), less the batches the saved run already consumed. */
  for (int64_t k = 0; !by_samples && epoch == r->start.epoch && k < r->start.epoch_batches; k++) {
    ddp_batch b;
    s = ddp_loader_next(t->train_loader, &b);
    if (s != DDP_OK) return ddp_error_wrap(s, "skipping to the resumed batch");
    if (b.size == 0) break;
    r->epoch_steps++;
    r->epoch_pos += (int64_t)b.size * t->replicas;
  }
  for (;;) {
    if (r->stop) break; /* a callback asked after the last step */
    if (o->max_steps && r->step >= o->max_steps) {
      r->stop = true;
      r->stopped = DDP_TRAIN_STOP_MAX_STEPS;
      break;
    }
    bool done = false;
    DDP_TRY(train_step(t, r, epoch, &done));
    if (done) break;
    r->evaluated_now = false;
    if (o->eval_every && r->step % o->eval_every == 0) {
      bool stop;
      DDP_TRY(evaluate_now(t, r, epoch, DDP_TRAIN_EVAL_PERIODIC, true, &stop));
      if (stop) {
        r->stop = true;
        break;
      }
    }
    /* After this step's evaluation, which a resumed run does not repeat:
     * the checkpoint's early-stopping position counts it. (Evaluation
     * changes nothing else that is saved.) */
    if (o->save_every && r->step % o->save_every == 0)
      DDP_TRY(ddp__train_save(t, r->step, epoch, r->epoch_steps, r->epoch_pos, &r->pat));
  }
  if (r->epoch_steps == r->per_epoch) {
    r->epochs_done++;
    if (t->sched) {
      s = ddp_scheduler_step(t->sched);
      if (s != DDP_OK) return ddp_error_wrap(s, "StepLR");
    }
    r->pos_epoch = epoch + 1;
    r->pos_batches = 0;
    r->pos_samples = 0;
  }
  /* eval_every 0: evaluate at the end of each epoch (and of training), also
   * when this run resumed exactly there (from a save_every checkpoint of the
   * epoch's last step, taken before this evaluation), as the run that saved
   * it went on to do. Stopped mid-epoch, this evaluation is the end of
   * training's, which a run going on would not make here. */
  const bool epoch_end = r->epoch_steps == r->per_epoch && r->per_epoch > 0;
  if (!o->eval_every && !r->evaluated_now && (r->epoch_losses > 0 || epoch_end)) {
    bool stop;
    DDP_TRY(evaluate_now(t, r, epoch, DDP_TRAIN_EVAL_EPOCH, epoch_end, &stop));
    if (stop) r->stop = true;
  }
  return DDP_OK;
}

/* The most events a trace keeps (48 bytes each: 96 MiB); later ones are
 * counted as dropped. */
#define TRACE_MAX_EVENTS ((size_t)1 << 21)

/* Sizes the timeline's buffer for the whole run, so that no step
 * allocates: per step the step, its five phases, autograd, and two events
 * per bucket (a bucket per parameter at most); per evaluation one. */
static ddp_status open_trace(ddp_trainer *t, ddp__train_run *r) {
  const ddp_train_options *o = &t->o;
  int64_t steps = r->total_steps - r->start.step + 1;
  int64_t per_step = 8 + 2 * ((int64_t)ddp_model_num_params(t->model) + 1);
  int64_t evals = (o->eval_every ? steps / o->eval_every : 0) + o->epochs + 2;
  double want = (double)(steps > 0 ? steps : 0) * (double)per_step + (double)evals;
  size_t capacity = want < (double)TRACE_MAX_EVENTS ? (size_t)want : TRACE_MAX_EVENTS;
  ddp_status s = ddp__trace_create(&t->trace, o->trace_path, t->rank, t->size, capacity);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "tracing (trace_path)");
}

static ddp_status run(ddp_trainer *t, ddp__train_run *r, ddp_train_result *res) {
  const ddp_train_options *o = &t->o;
  r->per_epoch = ddp_loader_num_batches(t->train_loader);
  r->total_steps = o->epochs * r->per_epoch;
  if (o->max_steps && o->max_steps < r->total_steps) r->total_steps = o->max_steps;
  /* Where training starts: the beginning, or where the checkpoint stopped. */
  DDP_TRY(ddp__train_resume(t, &r->start));
  if (o->trace_path) DDP_TRY(open_trace(t, r));
  if (o->callbacks.on_start) {
    ddp_train_start_info info = {.step = r->start.step, .epoch = r->start.epoch,
                                 .epoch_batches = r->start.epoch_batches,
                                 .steps_per_epoch = r->per_epoch, .total_steps = r->total_steps,
                                 .resumed = o->resume_path != NULL};
    o->callbacks.on_start(&info, o->callbacks.user);
  }
  r->step = r->start.step;
  r->epochs_done = r->start.epoch;
  r->pos_epoch = r->start.epoch;
  r->pos_batches = r->start.epoch_batches;
  r->pos_samples = r->start.epoch_samples >= 0 ? r->start.epoch_samples
                                               : r->start.epoch_batches * o->batch_size * r->start.world_size;
  /* Early stopping goes on from where a resumed run left it. */
  r->pat = (ddp__train_patience){.limit = o->patience, .best_loss = r->start.best_test_loss,
                      .without_better = r->start.evals_without_better};
  r->last_loss = r->last_accuracy = NAN;
  r->stopped = DDP_TRAIN_STOP_EPOCHS;
  for (int64_t epoch = r->start.epoch; epoch < o->epochs && !r->stop; epoch++) {
    ddp_status s = train_epoch(t, r, epoch);
    if (s != DDP_OK && t->strategy->where) { /* e.g. which rank holds which stage */
      char where[512];
      return ddp_error_wrap(s, "epoch %lld, after step %lld (%s)", (long long)epoch + 1,
                            (long long)r->step, t->strategy->where(t, where, sizeof where));
    }
    if (s != DDP_OK)
      return ddp_error_wrap(s, "epoch %lld, after step %lld", (long long)epoch + 1,
                            (long long)r->step);
  }
  /* The strategy's end (a pipeline gives the caller's model the trained
   * stages back). */
  if (t->strategy->finish) DDP_TRY(t->strategy->finish(t));
  if (o->save_path)
    DDP_TRY(ddp__train_save(t, r->step, r->pos_epoch, r->pos_batches, r->pos_samples, &r->pat));
  /* The end of training is always evaluated. */
  if (!r->evaluated_now && (r->step > 0 || o->epochs == 0)) {
    DDP_TRY(evaluate_traced(t, r));
    record_eval(&r->pat, t->log, r->last_loss, r->last_accuracy, r->step, r->epochs_done);
    if (o->callbacks.on_eval) {
      ddp_train_eval_info info = {.step = r->step, .epoch = r->epochs_done,
                                  .test_loss = r->last_loss, .test_accuracy = r->last_accuracy,
                                  .kind = DDP_TRAIN_EVAL_FINAL};
      (void)o->callbacks.on_eval(&info, o->callbacks.user); /* training is over: no stop */
    }
  }
  DDP_TRY(ddp__train_fill_result(t, r, res));
  if (t->log && fflush(t->log) != 0)
    return ddp_error(DDP_ERR_IO, "writing the log %s: %s", o->log_path, strerror(errno));
  return DDP_OK;
}

ddp_status ddp_trainer_run(ddp_trainer *t, ddp_train_result *result) {
  if (!t || !result) return ddp_error(DDP_ERR_INVALID, "ddp_trainer_run: t or result is NULL");
  *result = (ddp_train_result){.samples_per_s = NAN, .steady_samples_per_s = NAN,
                               .train_loss = NAN, .test_loss = NAN, .test_accuracy = NAN,
                               .world_size = t->size};
  if (t->ran) return ddp_error(DDP_ERR_STATE, "ddp_trainer_run: this trainer has run already");
  t->ran = true;
  ddp__train_run r = {0};
  ddp_preempt_clock_open(&r.preempt_clock);
  ddp_status s = run(t, &r, result);
  ddp_preempt_clock_close(&r.preempt_clock);
  /* The timeline is written however the run ended (an error's steps are
   * what one wants to see); a run's own error comes first. */
  if (t->trace) {
    char error[512] = "";
    if (s != DDP_OK) snprintf(error, sizeof error, "%s", ddp_last_error());
    ddp_status ws = ddp__trace_write(t->trace);
    if (s == DDP_OK) s = ws;
    else ddp_error(s, "%s", error); /* the run's message, not the write's */
    ddp__trace_destroy(t->trace);
    t->trace = NULL;
  }
  return s;
}
