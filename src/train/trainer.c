/* The training loop (include/ddp/train.h, docs/train.md): epochs of shuffled
 * batches, forward and backward through the strategy, the optimizer and the
 * lr schedule, the global batch's loss, evaluation, early stopping,
 * checkpoints and resumption, the log, callbacks, and the figures of the
 * result. One loop for every strategy. */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/tape.h" /* ddp__basic_kernels_for */
#include "train/trace.h"
#include "train/train_internal.h"

/* Steps left out of the steady figures, as PyTorch's reference script
 * leaves out its 10 warm-up steps (first touch of the activations, the
 * wrapper's one-time bucket relayout). */
#define WARMUP_STEPS 10

ddp_train_options ddp_train_defaults(void) {
  ddp_train_options o = {0};
  o.epochs = 1;
  o.batch_size = 100;
  o.optim = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.optim.lr = 0.01;
  o.step_lr_gamma = 0.1;
  o.seed = 1;
  o.workers = -1;
  return o;
}

const char *ddp_train_stop_name(ddp_train_stop stop) {
  switch (stop) {
  case DDP_TRAIN_STOP_EPOCHS: return "epochs";
  case DDP_TRAIN_STOP_MAX_STEPS: return "max_steps";
  case DDP_TRAIN_STOP_PATIENCE: return "patience";
  case DDP_TRAIN_STOP_CALLBACK: return "callback";
  }
  return "unknown";
}

void ddp_train_result_free(ddp_train_result *r) {
  if (!r) return;
  ddp_free(r->steady_preempted_ms_per_rank);
  r->steady_preempted_ms_per_rank = NULL;
  ddp_free((void *)r->stages);
  r->stages = NULL;
  r->n_stages = 0;
}

ddp_optimizer *ddp_trainer_optimizer(ddp_trainer *t) { return t->opt; }

/* ---- Creation ------------------------------------------------------------ */

static ddp_status check_options(const ddp_train_options *o, const ddp_process_group *pg) {
  if (o->epochs < 0) return ddp_error(DDP_ERR_INVALID, "epochs is %lld (>= 0)", (long long)o->epochs);
  if (o->max_steps < 0)
    return ddp_error(DDP_ERR_INVALID, "max_steps is %lld (>= 0)", (long long)o->max_steps);
  if (o->batch_size < 1)
    return ddp_error(DDP_ERR_INVALID, "batch_size is %lld (>= 1)", (long long)o->batch_size);
  if (o->eval_batch_size < 0 || o->eval_every < 0 || o->patience < 0 || o->save_every < 0 ||
      o->step_lr_size < 0)
    return ddp_error(DDP_ERR_INVALID, "eval_batch_size, eval_every, patience, save_every and "
                                      "step_lr_size are counts (>= 0)");
  if (o->workers < -1) return ddp_error(DDP_ERR_INVALID, "workers is %d (-1 or >= 0)", o->workers);
  if (!(o->bucket_cap_mb >= 0))
    return ddp_error(DDP_ERR_INVALID, "bucket_cap_mb is %g (> 0 MiB, or 0 for the default)",
                     o->bucket_cap_mb);
  if (o->trace_path && !o->trace_path[0])
    return ddp_error(DDP_ERR_INVALID, "trace_path is empty (NULL: no trace)");
  if (o->microbatches < 0)
    return ddp_error(DDP_ERR_INVALID, "microbatches is %d (>= 1, or 0 for the whole batch)",
                     (int)o->microbatches);
  if (o->microbatches > 1 && (o->device.type != DDP_DEVICE_CPU || o->cuda_graph))
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "microbatches %d: gradient accumulation runs on the CPU (the 1/M scaling "
                     "of the gradients has no device kernel yet); drop --microbatches or train "
                     "on the CPU",
                     (int)o->microbatches);
  if (o->pipeline) DDP_TRY(ddp__train_pipeline_check(o, pg));
  if (o->param_server) DDP_TRY(ddp__train_ps_check(o, pg));
  if (o->save_every && !o->save_path)
    return ddp_error(DDP_ERR_INVALID, "save_every %lld needs save_path", (long long)o->save_every);
  if (o->strategy == DDP_TRAIN_DATA_PARALLEL && !pg)
    return ddp_error(DDP_ERR_INVALID, "the data-parallel strategy needs a process group");
  if (o->strategy < DDP_TRAIN_AUTO || o->strategy > DDP_TRAIN_DATA_PARALLEL)
    return ddp_error(DDP_ERR_INVALID, "unknown strategy %d", (int)o->strategy);
  if (o->sync_bn && o->strategy == DDP_TRAIN_SINGLE && pg)
    return ddp_error(DDP_ERR_INVALID, "sync_bn needs the data-parallel strategy");
  if (o->device.type != DDP_DEVICE_CPU) {
    char name[DDP_DEVICE_STR_BYTES];
    ddp_device_str(o->device, name, sizeof name);
    ddp_status s = ddp_device_check(o->device); /* its message names the device */
    if (s != DDP_OK) return s;
    if (o->save_path || o->resume_path)
      return ddp_error(DDP_ERR_UNSUPPORTED,
                       "device %s: checkpoints (save_path, resume_path) are written from the "
                       "CPU; train on the CPU to save, or save the model yourself after moving "
                       "it back (ddp_model_to)",
                       name);
    if (o->strategy == DDP_TRAIN_DATA_PARALLEL || (o->strategy == DDP_TRAIN_AUTO && pg))
      return ddp_error(DDP_ERR_UNSUPPORTED,
                       "device %s: data parallelism over GPUs needs the NCCL backend, which ddp "
                       "does not have yet; train one process per GPU with --strategy single, or "
                       "on the CPU",
                       name);
  }
  return DDP_OK;
}

/* Checks that the data's samples fit the model, before the first forward. */
static ddp_status check_shapes(const ddp_model *model, const ddp_dataset *ds) {
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  int64_t shape[DDP_MAX_DIMS];
  int nd = ddp_model_sample_shape(model, shape);
  int64_t numel = 1;
  for (int i = 0; i < nd; i++) numel *= shape[i];
  bool classify = ddp_model_loss_kind(model) != DDP_LOSS_MSE;
  if (nd && numel != info->input_numel)
    return ddp_error(DDP_ERR_SHAPE,
                     "the model takes samples of %lld values but %s has %lld; pick matching "
                     "data (image models take 28x28 images)",
                     (long long)numel, info->name, (long long)info->input_numel);
  if (classify != (info->target_dtype == DDP_INT64))
    return ddp_error(DDP_ERR_SHAPE, "the model needs %s targets but %s has %s",
                     classify ? "class-label" : "real-valued", info->name,
                     info->target_dtype == DDP_INT64 ? "class labels" : "real-valued targets");
  return DDP_OK;
}

int64_t ddp__train_eval_batch_size(const ddp_train_options *o) {
  return o->eval_batch_size ? o->eval_batch_size : o->batch_size > 1000 ? o->batch_size : 1000;
}

/* Loader threads only where cores are left over: with as many ranks on
 * this host as cores, a loader thread per rank would steal compute. */
static int automatic_workers(int group_size) {
  int64_t local = group_size;
  if (ddp_env_int("LOCAL_WORLD_SIZE", group_size, &local) != DDP_OK || local < 1)
    local = group_size;
  int cpus = 1;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
    cpus = CPU_COUNT(&set);
  } else {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n > 0) cpus = (int)n;
  }
  return 2 * local <= cpus ? 1 : 0;
}

/* The samplers and loaders. PyTorch's DistributedSampler: each epoch is
 * torch.randperm(N) from a generator seeded with seed + epoch, padded to a
 * multiple of the group's size (drop_last false) and dealt out to the ranks
 * in turn; the test set is dealt out without padding. Under a pipeline the
 * replicas take the ranks' place: every rank of a replica reads the same
 * batches. */
static ddp_status create_loaders(ddp_trainer *t, int workers) {
  const ddp_train_options *o = &t->o;
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(t->replicas, t->replica);
  so.seed = o->seed;
  ddp_status s = ddp_sampler_create_distributed(&t->train_sampler,
                                                ddp_dataset_size(t->train_ds), &so);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the sampler");
  ddp_loader_config lc = ddp_loader_config_default();
  lc.batch_size = o->batch_size;
  lc.sampler = t->train_sampler;
  lc.num_workers = workers;
  s = ddp_loader_create(&t->train_loader, t->train_ds, &lc);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the training loader");
  s = ddp_sampler_create_distributed_eval(&t->test_sampler, ddp_dataset_size(t->test_ds),
                                          t->replicas, t->replica);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the test sampler");
  ddp_loader_config tc = ddp_loader_config_default();
  tc.batch_size = ddp__train_eval_batch_size(o);
  tc.num_workers = workers;
  tc.sampler = t->test_sampler;
  s = ddp_loader_create(&t->test_loader, t->test_ds, &tc);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the test loader");
  return DDP_OK;
}

static ddp_status create_parts(ddp_trainer *t) {
  const ddp_train_options *o = &t->o;
  ddp_status s = check_shapes(t->model, t->train_ds);
  if (s != DDP_OK) return s;
  /* SyncBatchNorm needs a group; with one process it is BatchNorm itself. */
  if (o->sync_bn && t->pg && t->strategy == &ddp__train_data_parallel) {
    s = ddp_model_convert_sync_batchnorm(t->model, t->pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "converting to SyncBatchNorm");
  }
  if (o->device.type != DDP_DEVICE_CPU) {
    s = ddp_model_to(t->model, o->device);
    if (s != DDP_OK) return ddp_error_wrap(s, "moving the model");
  }
  /* The pipeline builds this rank's stage first: the optimizer steps it. */
  if (o->pipeline) DDP_TRY(ddp__train_pipeline_prepare(t));
  ddp_optim_options optim = o->optim;
  optim.device = o->device;
  s = ddp_optimizer_create(&t->opt, &optim, ddp_model_params_flat(t->step_model),
                           ddp_model_grads_flat(t->step_model),
                           (size_t)ddp_model_num_param_elements(t->step_model));
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the optimizer");
  if (o->step_lr_size > 0) {
    ddp_step_lr_options so = {0};
    so.step_size = o->step_lr_size;
    so.gamma = o->step_lr_gamma;
    so.last_epoch = -1;
    s = ddp_scheduler_create_step_lr(&t->sched, t->opt, &so);
    if (s != DDP_OK) return ddp_error_wrap(s, "creating StepLR");
  }
  s = t->strategy->create(t);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "setting up the %s strategy", t->strategy->name);
  DDP_TRY(create_loaders(t, o->workers >= 0 ? o->workers : automatic_workers(t->size)));
  s = ddp_tape_create(&t->tape, 16 << 20);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the tape");
  if (o->cuda_graph) DDP_TRY(ddp__train_graph_create(t));
  if (o->log_path && t->rank == 0) {
    t->log = fopen(o->log_path, "w");
    if (!t->log)
      return ddp_error(DDP_ERR_IO, "cannot write the log %s: %s", o->log_path, strerror(errno));
    setvbuf(t->log, NULL, _IOLBF, 0); /* one line at a time, so a reader can follow it */
  }
  return DDP_OK;
}

ddp_status ddp_trainer_create(ddp_trainer **out, ddp_model *model, ddp_dataset *train,
                              ddp_dataset *test, ddp_process_group *pg,
                              const ddp_train_options *options) {
  if (!out || !model || !train || !test || !options)
    return ddp_error(DDP_ERR_INVALID, "ddp_trainer_create: out, model, train, test and options "
                                      "must not be NULL");
  *out = NULL;
  DDP_TRY(check_options(options, pg));
  if (options->cuda_graph) DDP_TRY(ddp__train_graph_check(options, model, pg));
  ddp_trainer *t = ddp_calloc(1, sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "ddp_trainer_create: out of memory");
  t->o = *options;
  t->model = model;
  t->train_ds = train;
  t->test_ds = test;
  t->pg = pg;
  t->rank = pg ? ddp_process_group_rank(pg) : 0;
  t->size = pg ? ddp_process_group_size(pg) : 1;
  t->step_model = model;
  t->replicas = t->size;
  t->replica = t->rank;
  const bool parallel = options->strategy == DDP_TRAIN_DATA_PARALLEL ||
                        (options->strategy == DDP_TRAIN_AUTO && pg);
  t->strategy = options->pipeline ? &ddp__train_pipeline
                : parallel        ? &ddp__train_data_parallel
                                  : &ddp__train_single;
  if (options->param_server) ddp__train_ps_place(t); /* the strategy, the data's shard */
  ddp_status s = create_parts(t);
  if (s != DDP_OK) {
    ddp_trainer_destroy(t);
    return s;
  }
  *out = t;
  return DDP_OK;
}

void ddp_trainer_destroy(ddp_trainer *t) {
  if (!t) return;
  if (t->strategy) t->strategy->destroy(t);
  if (t->log) fclose(t->log);
  ddp__train_graph_destroy(t);
  ddp_tape_destroy(t->tape);
  ddp__train_device_free(t);
  ddp_loader_destroy(t->test_loader);
  ddp_loader_destroy(t->train_loader);
  ddp_sampler_destroy(t->test_sampler);
  ddp_sampler_destroy(t->train_sampler);
  ddp_scheduler_destroy(t->sched);
  ddp_optimizer_destroy(t->opt);
  ddp_free(t);
}

/* ---- Checkpoints and early stopping --------------------------------------- */

/* Early stopping: patience evaluations in a row without a better test loss. */
typedef struct patience {
  int64_t limit; /* 0 = never stop */
  int64_t without_better;
  double best_loss;
} patience;

/* Logs an evaluation and returns true when patience has run out. */
static bool record_eval(patience *p, FILE *log, double loss, double accuracy, int64_t step,
                        int64_t epoch) {
  if (log) ddp__train_log_eval(log, step, epoch, loss, accuracy);
  if (loss < p->best_loss) {
    p->best_loss = loss;
    p->without_better = 0;
    return false;
  }
  return p->limit && ++p->without_better >= p->limit;
}

/* Rank 0 writes the checkpoint; every rank waits at a barrier until it is
 * on disk, so none can go on (exit, or load it) before. */
static ddp_status save_checkpoint(ddp_trainer *t, int64_t step, int64_t epoch,
                                  int64_t epoch_batches, const patience *pat) {
  ddp_train_state ts = {.step = step, .epoch = epoch, .epoch_batches = epoch_batches,
                        .sampler_seed = t->o.seed, .world_size = t->replicas,
                        .best_test_loss = pat->best_loss,
                        .evals_without_better = pat->without_better};
  if (t->strategy->save) {
    DDP_TRY(t->strategy->save(t, &ts));
  } else if (t->rank == 0) {
    ddp_status s = ddp_checkpoint_save(t->o.save_path, t->model, t->opt, t->sched, &ts,
                                       t->o.checkpoint_meta, t->o.checkpoint_meta_count);
    if (s != DDP_OK) return ddp_error_wrap(s, "saving the checkpoint");
  }
  if (t->pg) {
    ddp_status s = ddp_barrier(t->pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "waiting for rank 0 to save the checkpoint");
  }
  return DDP_OK;
}

/* Loads resume_path into the model, optimizer and schedule (every rank reads
 * the files) and fills where training continues. A checkpoint taken
 * mid-epoch by another number of ranks is refused: the epoch's order
 * depends on the group's size. */
static ddp_status resume(ddp_trainer *t, ddp_train_state *start) {
  *start = (ddp_train_state){.world_size = t->replicas, .best_test_loss = INFINITY};
  if (!t->o.resume_path) return DDP_OK;
  ddp_status s = t->pp ? ddp__train_pipeline_resume(t, start)
                       : ddp_checkpoint_load(t->o.resume_path, t->model, t->opt, t->sched, start,
                                             t->o.checkpoint_meta, t->o.checkpoint_meta_count);
  if (s != DDP_OK) return ddp_error_wrap(s, "resuming");
  /* The data's shards: ranks, or a pipeline's replicas. */
  if (start->world_size != t->replicas && start->epoch_batches > 0)
    return ddp_error(DDP_ERR_INVALID,
                     "%s was saved by %lld %s in the middle of epoch %lld; this run has %d "
                     "%s, which split that epoch differently (resume with %lld %s, or from a "
                     "checkpoint taken at the end of an epoch)",
                     t->o.resume_path, (long long)start->world_size,
                     t->pp ? "data-parallel replicas" : "ranks", (long long)start->epoch + 1,
                     t->replicas, t->pp ? "replicas" : "ranks", (long long)start->world_size,
                     t->pp ? "replicas" : "ranks");
  return DDP_OK;
}

/* ---- The loop ------------------------------------------------------------ */

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

static double per_second(int64_t count, double seconds) {
  return seconds > 0 ? (double)count / seconds : 0;
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

/* Everything the loop keeps between steps. Phases are in seconds while they
 * accumulate and become milliseconds only in what callers see. */
typedef struct run_state {
  ddp_train_state start;
  int64_t per_epoch, total_steps;
  int64_t step, samples, epochs_done;
  /* The position a checkpoint records: the epoch in progress and the
   * batches of it consumed; (next epoch, 0) once an epoch's end is
   * processed. */
  int64_t pos_epoch, pos_batches;
  double train_seconds;
  /* The same rate without this process's first WARMUP_STEPS steps. */
  double steady_seconds;
  int64_t steady_samples, steps_here;
  ddp_train_phases steady; /* seconds, summed */
  ddp_preempt_clock preempt_clock;
  double epoch_loss_sum, all_loss_sum;
  int64_t epoch_steps;  /* batches of this epoch consumed (also before a resume) */
  int64_t epoch_losses; /* of those, steps run by this process */
  patience pat;
  double last_loss, last_accuracy;
  bool evaluated_now, stop;
  ddp_train_stop stopped;
} run_state;

/* ddp__train_evaluate, on the timeline when tracing. */
static ddp_status evaluate_traced(ddp_trainer *t, run_state *r) {
  int64_t t0 = t->trace ? ddp_time_ns() : 0;
  DDP_TRY(ddp__train_evaluate(t, &r->last_loss, &r->last_accuracy));
  if (t->trace) ddp__trace_add(t->trace, DDP__TRACE_EVALUATE, r->step, t0, ddp_time_ns());
  return DDP_OK;
}

/* Evaluates, tells on_eval, and returns in *stop whether patience ran out
 * or a callback asked (agreed over the group). `counts` false: the
 * evaluation is the end of training's, made where a run going on would not
 * make one, so early stopping's saved position leaves it out. */
static ddp_status evaluate_now(ddp_trainer *t, run_state *r, int64_t epoch,
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
  patience after = r->pat;
  bool out_of_patience =
      record_eval(counts ? &r->pat : &after, t->log, r->last_loss, r->last_accuracy, r->step, epoch);
  *stop = out_of_patience || by_callback;
  if (by_callback) r->stopped = DDP_TRAIN_STOP_CALLBACK;
  else if (out_of_patience) r->stopped = DDP_TRAIN_STOP_PATIENCE;
  return DDP_OK;
}

/* Rows [first, first + rows) of a batch tensor (N, ...) as a view: no copy,
 * on the tensor's device. */
static void microbatch_view(const ddp_tensor *x, int64_t first, int64_t rows, ddp_tensor *view) {
  *view = *x;
  const int64_t row = x->shape[0] > 0 ? x->numel / x->shape[0] : 0;
  view->shape[0] = rows;
  view->numel = rows * row;
  view->data = (char *)x->data + (size_t)(first * row) * ddp_dtype_size(x->dtype);
  view->grad = NULL;
}

/* How many micro-batches a batch of `rows` goes in: options.microbatches,
 * or one a row when it has fewer rows (torch.tensor_split would make empty
 * ones, which a mean loss cannot take). */
static int64_t microbatch_count(int64_t rows, int32_t microbatches) {
  int64_t m = microbatches > 1 ? microbatches : 1;
  return rows < m ? (rows > 0 ? rows : 1) : m;
}

/* One micro-batch's forward and loss: *loss_value read back. */
static ddp_status microbatch_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                                     ddp_tensor **loss, float *loss_value) {
  ddp_tensor *out;
  ddp_status s = t->strategy->forward(t, tape, x, &out);
  if (s != DDP_OK) return ddp_error_wrap(s, "forward");
  s = ddp_model_loss(t->model, tape, out, y, loss);
  if (s != DDP_OK) return ddp_error_wrap(s, "loss");
  s = ddp__train_scalar(*loss, loss_value);
  if (s != DDP_OK) return ddp_error_wrap(s, "reading the loss");
  return DDP_OK;
}

/* Gradient accumulation (options.microbatches): the batch in m micro-batches
 * of torch.tensor_split's sizes, forward and backward each (the
 * data-parallel wrapper under no_sync but for the last), the gradients
 * scaled by 1/m for a mean loss. *loss_value: the micro-batches' mean loss
 * (what PyTorch's accumulation loop reports: the sum of loss_i / m). */
static ddp_status accumulate(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                             int64_t m, float *loss_value, int64_t *t_forward_sum) {
  const int64_t n = x->shape[0], base = n / m, extra = n % m;
  double loss_sum = 0;
  int64_t first = 0;
  for (int64_t i = 0; i < m; i++) {
    const int64_t rows = base + (i < extra);
    ddp_tensor xi, yi, *loss;
    microbatch_view(x, first, rows, &xi);
    microbatch_view(y, first, rows, &yi);
    first += rows;
    if (t->dp) ddp_dp_set_no_sync(t->dp, i + 1 < m);
    int64_t t0 = ddp_time_ns();
    ddp_tape_reset(tape);
    float li;
    ddp_status s = microbatch_forward(t, tape, &xi, &yi, &loss, &li);
    if (s != DDP_OK) return ddp_error_wrap(s, "micro-batch %lld of %lld", (long long)i + 1, (long long)m);
    loss_sum += li;
    *t_forward_sum += ddp_time_ns() - t0;
    s = t->strategy->backward(t, tape, loss);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "backward of micro-batch %lld of %lld", (long long)i + 1, (long long)m);
  }
  if (!t->o.microbatch_sum) {
    /* After the reduction (linear: the same as scaling each loss by 1/m,
     * but one pass over the gradients instead of m). */
    ddp__basic_kernels_for(t->o.device)->scale(ddp_model_grads_flat(t->model), 1.0f / (float)m,
                                               ddp_model_num_param_elements(t->model));
  }
  *loss_value = (float)(loss_sum / (double)m);
  return DDP_OK;
}

ddp_status ddp__train_eager_step(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                                 float *loss_value, ddp_train_phases *p) {
  int64_t t0 = ddp_time_ns();
  ddp_tensor *loss;
  ddp_model_zero_grad(t->model);
  const int64_t m = microbatch_count(x->shape[0], t->o.microbatches);
  int64_t t_forward;
  if (t->o.microbatches > 1) {
    int64_t forward_sum = 0;
    DDP_TRY(accumulate(t, tape, x, y, m, loss_value, &forward_sum));
    /* The phases as sums over the micro-batches, laid end to end for the
     * timeline. */
    t_forward = t0 + forward_sum;
  } else {
    ddp_tape_reset(tape);
    DDP_TRY(microbatch_forward(t, tape, x, y, &loss, loss_value));
    t_forward = ddp_time_ns();
    ddp_status s = t->strategy->backward(t, tape, loss);
    if (s != DDP_OK) return ddp_error_wrap(s, "backward");
  }
  int64_t t_opt = ddp_time_ns();
  ddp_status s = ddp_optimizer_step(t->opt);
  if (s != DDP_OK) return ddp_error_wrap(s, "optimizer step");
  int64_t t_end = ddp_time_ns();
  p->forward_ms = 1e-9 * (double)(t_forward - t0);
  p->backward_compute_ms = 1e-9 * (double)(t_opt - t_forward);
  p->backward_comm_ms = 0;
  p->optimizer_ms = 1e-9 * (double)(t_end - t_opt);
  t->step_marks[0] = t0;
  t->step_marks[1] = t_forward;
  t->step_marks[2] = t_opt;
  t->step_marks[3] = t_end;
  return DDP_OK;
}

/* The timeline of step `step` (t->trace): the step from t0 to t_end, its
 * load to t_loaded, the eager step's phases from its marks, the loss's
 * reduction from t_loss, and under data parallelism the wrapper's own
 * record of the backward: autograd, each bucket's reduction from launch to
 * completion, and the waits for them. A step through a CUDA graph shows
 * the step, its load and the loss only (its phases are not separate
 * readings). */
static void trace_step(ddp_trainer *t, int64_t step, bool eager, int64_t t0, int64_t t_loaded,
                       int64_t t_loss, int64_t t_end) {
  ddp__trace *tr = t->trace;
  const int64_t *m = t->step_marks;
  ddp__trace_add(tr, DDP__TRACE_STEP, step, t0, t_end);
  ddp__trace_add(tr, DDP__TRACE_LOAD, step, t0, t_loaded);
  if (eager) {
    ddp__trace_add(tr, DDP__TRACE_FORWARD, step, m[0], m[1]);
    ddp__trace_add(tr, DDP__TRACE_BACKWARD, step, m[1], m[2]);
    ddp__trace_add(tr, DDP__TRACE_OPTIMIZER, step, m[2], m[3]);
  }
  ddp__trace_add(tr, DDP__TRACE_LOSS, step, t_loss, t_end);
  if (!t->dp) return;
  ddp_dp_trace dt;
  ddp_dp_get_trace(t->dp, &dt);
  ddp__trace_add(tr, DDP__TRACE_AUTOGRAD, step, dt.backward_start_ns, dt.backward_end_ns);
  for (int b = 0; b < dt.n_buckets; b++) {
    const ddp_dp_bucket_trace *bt = &dt.buckets[b];
    if (!bt->done_ns) continue; /* nothing was reduced */
    ddp__trace_add_bucket(tr, DDP__TRACE_ALLREDUCE, step, b, (int64_t)bt->numel,
                          bt->params_not_ready, bt->launch_ns, bt->done_ns);
    if (bt->wait_start_ns)
      ddp__trace_add_bucket(tr, DDP__TRACE_WAIT, step, b, (int64_t)bt->numel, 0,
                            bt->wait_start_ns, bt->done_ns);
    else
      ddp__trace_add_bucket(tr, DDP__TRACE_BLOCKING, step, b, (int64_t)bt->numel, 0,
                            bt->launch_ns, bt->done_ns);
  }
}

/* One optimizer step on the next batch; *done when the epoch has none left. */
static ddp_status train_step(ddp_trainer *t, run_state *r, int64_t epoch, bool *done) {
  int64_t t0 = ddp_time_ns();
  int64_t preempted0 = ddp_preempt_clock_ns(&r->preempt_clock);
  ddp_batch b;
  ddp_status s = ddp_loader_next(t->train_loader, &b);
  if (s != DDP_OK) return ddp_error_wrap(s, "loading a batch");
  if (b.size == 0) {
    *done = true;
    return DDP_OK;
  }
  float loss0;
  ddp_train_phases ph = {0}; /* seconds */
  int64_t t_loaded;
  const bool graph = ddp__train_graph_takes(t, &b);
  /* Under a pipeline only the last stage has the loss: the others add
   * nothing to the group's sums. */
  bool counts = true;
  if (t->strategy->step) {
    t_loaded = ddp_time_ns();
    ph.load_ms = 1e-9 * (double)(t_loaded - t0);
    double loss = NAN;
    DDP_TRY(t->strategy->step(t, &b, &loss, &ph));
    counts = !t->pp || ddp_pipeline_is_last(t->pp);
    loss0 = (float)loss;
  } else if (graph) {
    /* Loading: the loader's part here, the copy's inside. */
    t_loaded = ddp_time_ns();
    ph.load_ms = 1e-9 * (double)(t_loaded - t0);
    DDP_TRY(ddp__train_graph_step(t, &b, &loss0, &ph));
  } else {
    ddp_tensor x, y;
    s = ddp__train_batch_on_device(t, &b, &x, &y);
    if (s != DDP_OK) return ddp_error_wrap(s, "copying a batch to the device");
    t_loaded = ddp_time_ns();
    ph.load_ms = 1e-9 * (double)(t_loaded - t0);
    DDP_TRY(ddp__train_eager_step(t, t->tape, &x, &y, &loss0, &ph));
  }
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
  if (t->trace) trace_step(t, r->step, !graph, t0, t_loaded, t_loss, t_end);
  r->samples += (int64_t)loss_sums[1]; /* every rank's samples */
  const ddp_train_phases phases = {load, forward, backward_compute, backward_comm, optimizer,
                                   step_seconds, preempted};
  if (++r->steps_here > WARMUP_STEPS) {
    r->steady_seconds += step_seconds;
    r->steady_samples += (int64_t)loss_sums[1];
    phases_add(&r->steady, &phases);
  }
  r->epoch_steps++;
  r->epoch_losses++;
  r->pos_epoch = epoch;
  r->pos_batches = r->epoch_steps;
  r->epoch_loss_sum += loss_value;
  r->all_loss_sum += loss_value;
  ddp_train_step_info info = {
      .step = r->step, .epoch = epoch, .total_steps = r->total_steps, .loss = loss_value,
      .lr = ddp_optimizer_get_lr(t->opt), .samples_per_s = per_second(r->samples, r->train_seconds),
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
static ddp_status train_epoch(ddp_trainer *t, run_state *r, int64_t epoch) {
  const ddp_train_options *o = &t->o;
  ddp_status s = ddp_loader_start_epoch(t->train_loader, epoch);
  if (s != DDP_OK) return ddp_error_wrap(s, "starting an epoch");
  r->epoch_loss_sum = 0;
  r->epoch_steps = 0;
  r->epoch_losses = 0;
  /* Resuming in the middle of an epoch: the same order (seed + epoch), less
   * the batches the saved run already consumed. */
  for (int64_t k = 0; epoch == r->start.epoch && k < r->start.epoch_batches; k++) {
    ddp_batch b;
    s = ddp_loader_next(t->train_loader, &b);
    if (s != DDP_OK) return ddp_error_wrap(s, "skipping to the resumed batch");
    if (b.size == 0) break;
    r->epoch_steps++;
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
      DDP_TRY(save_checkpoint(t, r->step, epoch, r->epoch_steps, &r->pat));
  }
  if (r->epoch_steps == r->per_epoch) {
    r->epochs_done++;
    if (t->sched) {
      s = ddp_scheduler_step(t->sched);
      if (s != DDP_OK) return ddp_error_wrap(s, "StepLR");
    }
    r->pos_epoch = epoch + 1;
    r->pos_batches = 0;
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

/* The figures of the result, after the loop. Collective: gathers every
 * rank's preempted time. */
static ddp_status fill_result(ddp_trainer *t, run_state *r, ddp_train_result *res) {
  int64_t steps_run = r->step - r->start.step;
  double steady_steps =
      r->steps_here > WARMUP_STEPS ? (double)(r->steps_here - WARMUP_STEPS) : 0;
  res->samples_per_s = per_second(r->samples, r->train_seconds);
  res->steady_samples_per_s =
      r->steady_samples ? per_second(r->steady_samples, r->steady_seconds) : NAN;
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
  if (t->pp) DDP_TRY(ddp__train_pipeline_stats(t, res));
  return DDP_OK;
}

/* The most events a trace keeps (48 bytes each: 96 MiB); later ones are
 * counted as dropped. */
#define TRACE_MAX_EVENTS ((size_t)1 << 21)

/* Sizes the timeline's buffer for the whole run, so that no step
 * allocates: per step the step, its five phases, autograd, and two events
 * per bucket (a bucket per parameter at most); per evaluation one. */
static ddp_status open_trace(ddp_trainer *t, run_state *r) {
  const ddp_train_options *o = &t->o;
  int64_t steps = r->total_steps - r->start.step + 1;
  int64_t per_step = 8 + 2 * ((int64_t)ddp_model_num_params(t->model) + 1);
  int64_t evals = (o->eval_every ? steps / o->eval_every : 0) + o->epochs + 2;
  double want = (double)(steps > 0 ? steps : 0) * (double)per_step + (double)evals;
  size_t capacity = want < (double)TRACE_MAX_EVENTS ? (size_t)want : TRACE_MAX_EVENTS;
  ddp_status s = ddp__trace_create(&t->trace, o->trace_path, t->rank, t->size, capacity);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "tracing (trace_path)");
}

static ddp_status run(ddp_trainer *t, run_state *r, ddp_train_result *res) {
  const ddp_train_options *o = &t->o;
  r->per_epoch = ddp_loader_num_batches(t->train_loader);
  r->total_steps = o->epochs * r->per_epoch;
  if (o->max_steps && o->max_steps < r->total_steps) r->total_steps = o->max_steps;
  /* Where training starts: the beginning, or where the checkpoint stopped. */
  DDP_TRY(resume(t, &r->start));
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
  /* Early stopping goes on from where a resumed run left it. */
  r->pat = (patience){.limit = o->patience, .best_loss = r->start.best_test_loss,
                      .without_better = r->start.evals_without_better};
  r->last_loss = r->last_accuracy = NAN;
  r->stopped = DDP_TRAIN_STOP_EPOCHS;
  for (int64_t epoch = r->start.epoch; epoch < o->epochs && !r->stop; epoch++) {
    ddp_status s = train_epoch(t, r, epoch);
    if (s != DDP_OK && t->pp) { /* which rank holds which stage, for a peer's failure */
      char mesh[512];
      return ddp_error_wrap(s, "epoch %lld, after step %lld (%s)", (long long)epoch + 1,
                            (long long)r->step, ddp__train_pipeline_mesh(t, mesh, sizeof mesh));
    }
    if (s != DDP_OK)
      return ddp_error_wrap(s, "epoch %lld, after step %lld", (long long)epoch + 1,
                            (long long)r->step);
  }
  /* Under a pipeline the caller's model gets the trained stages back. */
  if (t->pp) DDP_TRY(ddp__train_pipeline_gather(t));
  if (o->save_path) DDP_TRY(save_checkpoint(t, r->step, r->pos_epoch, r->pos_batches, &r->pat));
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
  DDP_TRY(fill_result(t, r, res));
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
  run_state r = {0};
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
