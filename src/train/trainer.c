/* The trainer's life (include/ddp/train.h, docs/train.md): the options
 * checked, the strategy chosen (strategy.c) and made around the optimizer,
 * the schedule, the samplers and loaders, the tape and the log; and their
 * release. The loop is loop.c, the step step.c, checkpoints checkpoint.c,
 * the result's figures result.c. */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/train_internal.h"

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

ddp_train_pipeline ddp_train_pipeline_defaults(void) {
  ddp_train_pipeline p = {0};
  p.stages = 2;
  p.schedule = DDP_PIPELINE_1F1B;
  p.virtual_stages = 1;
  return p;
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

ddp_optimizer *ddp_trainer_optimizer(ddp_trainer *t) { return t->opt; }

/* ---- Creation ------------------------------------------------------------ */

/* The options that concern every strategy, then the strategy's own
 * (ops->check). */
static ddp_status check_options(const ddp_train_options *o, const ddp_process_group *pg,
                                const ddp__train_strategy_ops *ops) {
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
  /* On a GPU the 1/M scaling is the device's scale kernel (step.c); a CUDA
   * graph replays one whole batch's forward and backward. */
  if (o->microbatches > 1 && o->cuda_graph)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "microbatches %d: gradient accumulation does not run under a CUDA graph "
                     "(a graph replays one whole batch); drop --microbatches or --cuda-graph",
                     (int)o->microbatches);
  DDP_TRY(ddp__train_check_comm_hook(o, ops));
  if (!(o->clip_grad_norm >= 0) || isinf(o->clip_grad_norm))
    return ddp_error(DDP_ERR_INVALID, "clip_grad_norm is %g (a finite max_norm > 0, or 0 for "
                     "no clipping)", o->clip_grad_norm);
  /* Where no rank holds the whole model's final gradients: the pipeline's
   * stages each hold theirs (the norm would be a sum over stages and
   * replicas), the parameter server's workers push theirs to the servers,
   * which step. */
  if (o->clip_grad_norm > 0 &&
      (ops->kind == DDP_TRAIN_PIPELINE || ops->kind == DDP_TRAIN_PARAM_SERVER))
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "clip_grad_norm %g under the %s strategy: no rank holds the whole model's "
                     "gradients there; gradient clipping runs under single, data parallel and "
                     "ZeRO",
                     o->clip_grad_norm, ops->name);
  /* Mixed precision (grad_scaling.c). */
  DDP_TRY(ddp__train_precision_check(o));
  if (ops->check) DDP_TRY(ops->check(o, pg));
  if (o->save_every && !o->save_path)
    return ddp_error(DDP_ERR_INVALID, "save_every %lld needs save_path", (long long)o->save_every);
  /* Checkpoints of a model on a GPU go through the host (io's model state:
   * the same files as from the CPU). */
  if (o->device.type != DDP_DEVICE_CPU) return ddp_device_check(o->device); /* names the device */
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
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = o->batch_size;
  lc.sampler = t->train_sampler;
  lc.num_workers = workers;
  s = ddp_loader_create(&t->train_loader, t->train_ds, &lc);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the training loader");
  s = ddp_sampler_create_distributed_eval(&t->test_sampler, ddp_dataset_size(t->test_ds),
                                          t->replicas, t->replica);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the test sampler");
  ddp_loader_config tc = ddp_loader_defaults();
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
  if (o->device.type != DDP_DEVICE_CPU && !t->strategy->places_model) {
    s = ddp_model_to(t->model, o->device);
    if (s != DDP_OK) return ddp_error_wrap(s, "moving the model");
  }
  DDP_TRY(ddp__train_scaler_init(t));
  DDP_TRY(ddp__train_tf32_apply(t));
  /* The strategy's state first: the model the optimizer steps (a
   * pipeline's stage), the data's shards, SyncBatchNorm. */
  DDP_TRY(t->strategy->create(t));
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
  if (t->strategy->bind) {
    s = t->strategy->bind(t);
    if (s != DDP_OK) return ddp_error_wrap(s, "setting up the %s strategy", t->strategy->name);
  }
  /* DataParallel's replicas compute on cores of their own, as ranks do. */
  const int computing = t->size * (o->replicas > 1 ? o->replicas : 1);
  DDP_TRY(create_loaders(t, o->workers >= 0 ? o->workers : automatic_workers(computing)));
  s = ddp_tape_create(&t->tape, 16 << 20);
  if (s != DDP_OK) return ddp_error_wrap(s, "creating the tape");
  if (o->cuda_graph) DDP_TRY(ddp__train_graph_create(t));
  if (o->log_path && t->rank == 0) {
    t->log = fopen(o->log_path, "w");
    if (!t->log)
      return ddp_error(DDP_ERR_IO, "cannot write the log %s: %s", o->log_path, strerror(errno));
    setvbuf(t->log, NULL, _IOLBF, 0); /* one line at a time, so a reader can follow it */
  }
  return ddp__train_open_sample_log(t);
}

ddp_status ddp_trainer_create(ddp_trainer **out, ddp_model *model, ddp_dataset *train,
                              ddp_dataset *test, ddp_process_group *pg,
                              const ddp_train_options *options) {
  if (!out || !model || !train || !test || !options)
    return ddp_error(DDP_ERR_INVALID, "ddp_trainer_create: out, model, train, test and options "
                                      "must not be NULL");
  *out = NULL;
  const ddp__train_strategy_ops *ops;
  DDP_TRY(ddp__train_strategy_choose(options, pg, &ops));
  DDP_TRY(check_options(options, pg, ops));
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
  t->strategy = ops;
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
  if (t->sample_log) fclose(t->sample_log);
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
