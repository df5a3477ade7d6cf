/* The ZeRO strategy of the training loop (options.zero_stage 1 or 2;
 * include/ddp/zero.h, docs/sharding.md): data parallelism whose optimizer
 * state is sharded over the group. The ddp_zero (which holds the DDP
 * wrapper) is its state, behind t->state; the trainer's optimizer, made
 * over the whole model, is narrowed to this rank's range in bind. The
 * loop steps that optimizer itself, so the parameters are gathered before
 * whatever reads them next: the next forward, an evaluation, a save, the
 * end. Checkpoints are the ordinary ones: the state gathered to rank 0 on
 * save, and on resume every rank reads the whole file and keeps its range,
 * so a run resumes at any world size and stage (and without ZeRO). */
#include "train/train_internal.h"

static ddp_zero *zero(const ddp_trainer *t) { return t->state; }

static ddp_status zero_check(const ddp_train_options *o, const ddp_process_group *pg) {
  if (!pg) return ddp_error(DDP_ERR_INVALID, "ZeRO (zero_stage %d) needs a process group: run under a launcher (ddprun, torchrun's variables, srun, mpirun)", (int)o->zero_stage);
  if (o->zero_stage < 1 || o->zero_stage > 3)
    return ddp_error(DDP_ERR_INVALID, "zero_stage is %d (1, 2 or 3)", (int)o->zero_stage);
  if (o->zero_stage == 3 && o->cuda_graph)
    return ddp_error(DDP_ERR_UNSUPPORTED, "zero_stage 3 gathers parameters during the step: "
                     "no CUDA graph");
  if (o->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED, "ZeRO runs on the CPU (data parallelism over GPUs "
                     "needs the NCCL backend, which ddp does not have yet)");
  return DDP_OK;
}

static ddp_status zero_create_state(ddp_trainer *t) {
  t->state = NULL;
  if (t->o.sync_bn) {
    ddp_status s = ddp_model_convert_sync_batchnorm(t->model, t->pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "converting to SyncBatchNorm");
  }
  return DDP_OK;
}

/* Collective: the wrapper's shape check and broadcast, then the optimizer
 * narrowed to this rank's range. The bucket cap as the data-parallel
 * strategy sets it. */
static ddp_status zero_bind(ddp_trainer *t) {
  ddp_zero_options o = ddp_zero_defaults(t->o.zero_stage);
  o.no_prefetch = t->o.zero_no_prefetch;
  if (t->o.bucket_cap_mb > 0) {
    o.dp.bucket_cap_mb = t->o.bucket_cap_mb;
    if (o.dp.first_bucket_mb > o.dp.bucket_cap_mb) o.dp.first_bucket_mb = o.dp.bucket_cap_mb;
  }
  ddp_zero *z;
  DDP_TRY(ddp_zero_create(&z, t->model, t->pg, t->opt, &o));
  t->state = z;
  return DDP_OK;
}

static void zero_destroy(ddp_trainer *t) {
  ddp_zero_destroy(zero(t));
  t->state = NULL;
}

static ddp_status zero_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  return ddp_zero_forward(zero(t), tape, x, out);
}

static ddp_status zero_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  ddp_dp_set_loss_scale(ddp_zero_dp(zero(t)), ddp__train_loss_seed(t));
  return ddp_zero_backward(zero(t), tape, loss);
}

/* The norm from the shards: each rank's range, one allreduce of a double. */
static ddp_status zero_clip(ddp_trainer *t, double max_norm, double *norm) {
  return ddp_zero_clip_grad_norm(zero(t), max_norm, norm);
}

/* Stages 2 and 3 reduce to this rank's range; stage 1 allreduces the
 * whole buffer. Stage 3 holds its range of the parameters and the largest
 * module gathered. */
static void zero_memory(const ddp_trainer *t, int64_t *param_bytes, int64_t *grad_bytes,
                        int64_t *grad_ring_bytes, int64_t *grad_reduced_bytes) {
  ddp_zero_memory m;
  ddp_zero_get_memory(zero(t), &m);
  *param_bytes = m.param_bytes;
  *grad_bytes = m.grad_bytes;
  *grad_ring_bytes = m.grad_ring_bytes;
  *grad_reduced_bytes = m.grad_owned_bytes;
}

/* Under stage 2's gradient ring, this rank's range only. */
static void zero_zero_grad(ddp_trainer *t) { (void)ddp_zero_zero_grad(zero(t)); }

static void zero_no_sync(ddp_trainer *t, bool on) { ddp_zero_set_no_sync(zero(t), on); }

/* The shard this rank's optimizer steps: what the gradient scaler checks. */
static void zero_grad_range(const ddp_trainer *t, int64_t *offset, int64_t *numel) {
  ddp_zero_range(zero(t), t->rank, offset, numel);
}

static ddp_status zero_local_sums(ddp_trainer *t, double sums[3]) {
  DDP_TRY(ddp_zero_sync_params(zero(t)));
  return ddp__train_local_sums(t, sums);
}

static ddp_status zero_finish(ddp_trainer *t) { return ddp_zero_sync_params(zero(t)); }

/* An optimizer of the trainer's options over the model's whole buffers:
 * where the whole state is put together (save) or read (resume). Made for
 * the occasion and freed after: a checkpoint is no steady state. */
static ddp_status whole_optimizer(ddp_trainer *t, ddp_optimizer **out) {
  ddp_optim_options oo = *ddp_optimizer_options(t->opt);
  return ddp_optimizer_create(out, &oo, ddp_model_params_flat(t->model),
                              ddp_model_grads_flat(t->model),
                              (size_t)ddp_model_num_param_elements(t->model));
}

/* Collective: every rank sends its range of the state to rank 0, which
 * writes the ordinary checkpoint. */
static ddp_status zero_save(ddp_trainer *t, const ddp_train_state *ts) {
  DDP_TRY(ddp_zero_sync_params(zero(t)));
  if (t->o.sharded_checkpoint) {
    /* Each rank its own range: no state travels. */
    int64_t starts[1025], len;
    if (t->size > 1024) return ddp_error(DDP_ERR_UNSUPPORTED, "sharded checkpoints of over 1024 ranks");
    for (int r = 0; r < t->size; r++) ddp_zero_range(zero(t), r, &starts[r], &len);
    starts[t->size] = ddp_model_num_param_elements(t->model);
    return ddp__train_save_sharded(t, ts, t->opt, starts);
  }
  ddp_optimizer *full = NULL;
  ddp_status s = t->rank == 0 ? whole_optimizer(t, &full) : DDP_OK;
  /* Every rank takes part in the gather, even after rank 0 failed to make
   * its optimizer: a rank that left would hang the others' sends. */
  ddp_status g = ddp_zero_gather_state(zero(t), s == DDP_OK ? full : NULL, 0);
  if (s == DDP_OK) s = g;
  if (s == DDP_OK && t->rank == 0)
    s = ddp_checkpoint_save(t->o.save_path, t->model, full, t->sched, ts, t->o.checkpoint_meta,
                            t->o.checkpoint_meta_count);
  ddp_optimizer_destroy(full);
  if (s != DDP_OK) return ddp_error_wrap(s, "saving the checkpoint (ZeRO, rank %d)", t->rank);
  return DDP_OK;
}

/* Every rank reads the whole checkpoint and keeps its range. */
static ddp_status zero_resume(ddp_trainer *t, ddp_train_state *start) {
  ddp_optimizer *full;
  DDP_TRY(whole_optimizer(t, &full));
  ddp_status s = ddp_sharded_is_checkpoint(t->o.resume_path)
                     ? ddp_sharded_load(t->o.resume_path, t->model, full, t->sched, start,
                                        t->o.checkpoint_meta, t->o.checkpoint_meta_count)
                     : ddp_checkpoint_load(t->o.resume_path, t->model, full, t->sched, start,
                                           t->o.checkpoint_meta, t->o.checkpoint_meta_count);
  if (s == DDP_OK) s = ddp_zero_load_state(zero(t), full);
  ddp_optimizer_destroy(full);
  return s;
}

const ddp__train_strategy_ops ddp__train_zero = {
    .name = "zero",
    .kind = DDP_TRAIN_ZERO,
    .check = zero_check,
    .create = zero_create_state,
    .bind = zero_bind,
    .destroy = zero_destroy,
    .step = ddp__train_step_eager,
    .forward = zero_forward,
    .backward = zero_backward,
    .clip_grad_norm = zero_clip,
    .no_sync = zero_no_sync,
    .memory = zero_memory,
    .zero_grad = zero_zero_grad,
    .local_sums = zero_local_sums,
    .grad_range = zero_grad_range,
    .save = zero_save,
    .resume = zero_resume,
    .finish = zero_finish,
};
