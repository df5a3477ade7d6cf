/* The data-parallel strategy of the training loop (PyTorch's
 * DistributedDataParallel over the trainer's group): the DDP wrapper
 * (ddp_dp) and its PowerSGD hook, when options.powersgd_rank asks for one,
 * are its state, behind t->state. Its step is the eager one, the wrapper's
 * forward and backward averaging gradients in buckets while backward runs
 * (through options.comm_hook). */
#include <stdio.h>
#include <unistd.h>

#include "train/trace.h"
#include "train/train_internal.h"

typedef struct dp_state {
  ddp_dp *dp;
  ddp_powersgd *powersgd; /* NULL: a built-in hook */
} dp_state;

static dp_state *state(const ddp_trainer *t) { return t->state; }
static ddp_dp *wrapper(const ddp_trainer *t) { return state(t)->dp; }

ddp_status ddp__train_check_comm_hook(const ddp_train_options *o, const ddp__train_strategy_ops *ops) {
  if (!o->comm_hook && !o->powersgd_rank && !o->powersgd_start_iter) return DDP_OK;
  if (o->comm_hook < 0 || o->comm_hook >= DDP_DP_HOOK_KIND_COUNT)
    return ddp_error(DDP_ERR_INVALID, "comm_hook is %d (a ddp_dp_hook_kind: 0 allreduce, 1 fp16, "
                     "2 bf16)", (int)o->comm_hook);
  if (o->powersgd_rank < 0 || o->powersgd_start_iter < 0 || o->powersgd_start_iter == 1)
    return ddp_error(DDP_ERR_INVALID, "powersgd_rank %d and powersgd_start_iter %d: the rank is "
                     ">= 1 (0: no PowerSGD), the start 0 (PyTorch's 1000) or > 1 (error feedback "
                     "and warm start need the buckets of the first iteration's relayout)",
                     (int)o->powersgd_rank, (int)o->powersgd_start_iter);
  if (o->powersgd_rank && o->comm_hook)
    return ddp_error(DDP_ERR_INVALID, "comm_hook %d and powersgd_rank %d: one hook at a time "
                     "(PowerSGD compresses float32 gradients itself)",
                     (int)o->comm_hook, (int)o->powersgd_rank);
  if (o->powersgd_start_iter && !o->powersgd_rank)
    return ddp_error(DDP_ERR_INVALID, "powersgd_start_iter %d without powersgd_rank",
                     (int)o->powersgd_start_iter);
  const char *what = o->powersgd_rank ? "PowerSGD" : "a communication hook";
  if (ops->kind != DDP_TRAIN_DATA_PARALLEL)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "%s applies to data parallelism's gradient allreduce (the DDP wrapper); the "
                     "%s strategy reduces gradients its own way%s (drop --comm-hook)", what,
                     ops->name,
                     ops->kind == DDP_TRAIN_ZERO ? " (ZeRO reduce-scatters them over its shards)"
                     : ops->kind == DDP_TRAIN_PIPELINE ? " (not wired to the stages' wrappers yet)"
                     : ops->kind == DDP_TRAIN_SINGLE ? " (one process: nothing to average; run "
                                                       "2+ ranks under a launcher)"
                     : ops->kind == DDP_TRAIN_PARAM_SERVER ? " (pushes to the parameter servers)"
                     : "");
  if (o->powersgd_rank && o->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED, "PowerSGD runs on host gradients; the model is on %s "
                     "(use --comm-hook fp16 or bf16 on a GPU)",
                     o->device.type == DDP_DEVICE_CUDA ? "a GPU" : "a device");
  if (o->powersgd_rank && o->sharded_checkpoint)
    return ddp_error(DDP_ERR_UNSUPPORTED, "PowerSGD's state is saved beside an ordinary "
                     "checkpoint file; drop --sharded-checkpoint");
  return DDP_OK;
}

static ddp_status dp_check(const ddp_train_options *o, const ddp_process_group *pg) {
  if (!pg) return ddp_error(DDP_ERR_INVALID, "the data-parallel strategy needs a process group");
  /* On a GPU the group carries the gradients on the device: nccl, or ddp's
   * own staged through pinned memory (docs/comm.md); the wrapper's host
   * collectives go over the group's host group. */
  if (o->device.type != DDP_DEVICE_CPU) return ddp_device_check(o->device);
  return DDP_OK;
}

/* SyncBatchNorm over the group, in place (the model stays converted after
 * the trainer is gone). The wrapper comes in bind, once the optimizer it
 * hooks exists. */
static ddp_status dp_create(ddp_trainer *t) {
  t->state = ddp_calloc(1, sizeof(dp_state));
  if (!t->state) return ddp_error(DDP_ERR_NOMEM, "data parallel: out of memory");
  if (t->o.sync_bn) {
    ddp_status s = ddp_model_convert_sync_batchnorm(t->model, t->pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "converting to SyncBatchNorm");
  }
  return DDP_OK;
}

/* Collective: the wrapper checks the ranks' shapes and broadcasts rank 0's
 * parameters and buffers. */
static ddp_status dp_bind(ddp_trainer *t) {
  ddp_dp_options o = ddp_dp_defaults();
  /* A cap below the first bucket's 1 MiB caps that one too: the seeds'
   * models (ConvNet's gradients are 113 KiB) would otherwise always be one
   * bucket, whatever the cap. */
  if (t->o.bucket_cap_mb > 0) {
    o.bucket_cap_mb = t->o.bucket_cap_mb;
    if (o.first_bucket_mb > o.bucket_cap_mb) o.first_bucket_mb = o.bucket_cap_mb;
  }
  ddp_dp *dp;
  DDP_TRY(ddp_dp_create(&dp, t->model, t->pg, &o));
  state(t)->dp = dp;
  ddp_dp_set_optimizer(dp, t->opt);
  if (t->o.powersgd_rank > 0) {
    ddp_powersgd_options po = ddp_powersgd_defaults();
    po.rank = t->o.powersgd_rank;
    if (t->o.powersgd_start_iter) po.start_iter = t->o.powersgd_start_iter;
    DDP_TRY(ddp_powersgd_create(&state(t)->powersgd, dp, &po));
  } else if (t->o.comm_hook) {
    DDP_TRY(ddp_dp_set_comm_hook(dp, (ddp_dp_hook_kind)t->o.comm_hook));
  }
  return DDP_OK;
}

static void dp_destroy(ddp_trainer *t) {
  if (!t->state) return;
  ddp_powersgd_destroy(state(t)->powersgd);
  ddp_dp_destroy(state(t)->dp);
  ddp_free(t->state);
  t->state = NULL;
}

/* PowerSGD's state of this rank beside the checkpoint: PATH.powersgd-rankR.safetensors. */
static void aside_path(const ddp_trainer *t, const char *ckpt, char *buf, size_t bytes) {
  snprintf(buf, bytes, "%s.powersgd-rank%d.safetensors", ckpt, t->pg ? t->rank : 0);
}

static ddp_status dp_save_aside(ddp_trainer *t, const ddp_train_state *ts) {
  (void)ts;
  if (!state(t)->powersgd) return DDP_OK;
  char path[4096];
  aside_path(t, t->o.save_path, path, sizeof path);
  return ddp_powersgd_save(state(t)->powersgd, path);
}

/* The state must be the checkpoint's: PowerSGD counts one iteration per
 * optimizer step (one synced backward), so its iteration is the step. A
 * checkpoint saved without PowerSGD starts it afresh (warned). */
static ddp_status dp_resume_aside(ddp_trainer *t, const ddp_train_state *start) {
  ddp_powersgd *ps = state(t)->powersgd;
  if (!ps) return DDP_OK;
  char path[4096];
  aside_path(t, t->o.resume_path, path, sizeof path);
  const int world = t->replicas;
  if (start->world_size != world) {
    /* Error feedback is a rank's own: it has no meaning at another world
     * size (an elastic restart, a resume elsewhere). */
    DDP_WARN("rank %d: %s was saved by %lld ranks, this run has %d: PowerSGD starts afresh (its "
             "error feedback is per rank), with %d plain allreduce steps first",
             t->pg ? t->rank : 0, t->o.resume_path, (long long)start->world_size, world,
             t->o.powersgd_start_iter ? (int)t->o.powersgd_start_iter : 1000);
    return DDP_OK;
  }
  if (access(path, F_OK) != 0) {
    DDP_WARN("rank %d: %s has no PowerSGD state beside it (%s): PowerSGD starts afresh, with "
             "%d plain allreduce steps first", t->pg ? t->rank : 0, t->o.resume_path, path,
             t->o.powersgd_start_iter ? (int)t->o.powersgd_start_iter : 1000);
    return DDP_OK;
  }
  DDP_TRY(ddp_powersgd_load(ps, path));
  ddp_powersgd_stats st;
  ddp_powersgd_get_stats(ps, &st);
  if (st.iter != start->step)
    return ddp_error(DDP_ERR_INVALID, "%s is at step %lld but its PowerSGD state %s at %lld (a "
                     "save interrupted between the two?); resume from an earlier checkpoint",
                     t->o.resume_path, (long long)start->step, path, (long long)st.iter);
  return DDP_OK;
}

static ddp_status dp_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                             ddp_tensor **out) {
  return ddp_dp_forward(wrapper(t), tape, x, out);
}

static ddp_status dp_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  return ddp_dp_backward(wrapper(t), tape, loss);
}

static void dp_no_sync(ddp_trainer *t, bool on) { ddp_dp_set_no_sync(wrapper(t), on); }

/* From the last bucket's launch (every gradient ready) to the end of
 * finalize: what backward's compute did not hide, on the same clock as
 * ddp_time_s (ddp_time_ns, monotonic). */
static void dp_split_backward(ddp_trainer *t, double *backward_compute, double *backward_comm) {
  ddp_dp_trace tr;
  ddp_dp_get_trace(wrapper(t), &tr);
  if (tr.n_buckets <= 0) return;
  double last_launch = 1e-9 * (double)tr.buckets[tr.n_buckets - 1].launch_ns;
  double comm = 1e-9 * (double)tr.finalize_end_ns - last_launch;
  if (comm >= 0 && comm <= *backward_compute) {
    *backward_comm = comm;
    *backward_compute -= comm;
  }
}

/* The wrapper's own record of the backward on the timeline: autograd, each
 * bucket's reduction from launch to completion, and the waits for them. */
static void dp_trace(ddp_trainer *t, int64_t step) {
  ddp__trace *tr = t->trace;
  ddp_dp_trace dt;
  ddp_dp_get_trace(wrapper(t), &dt);
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

const ddp__train_strategy_ops ddp__train_data_parallel = {
    .name = "data_parallel",
    .kind = DDP_TRAIN_DATA_PARALLEL,
    .check = dp_check,
    .create = dp_create,
    .bind = dp_bind,
    .destroy = dp_destroy,
    .step = ddp__train_step_eager,
    .forward = dp_forward,
    .backward = dp_backward,
    .no_sync = dp_no_sync,
    .split_backward = dp_split_backward,
    .trace = dp_trace,
    .save_aside = dp_save_aside,
    .resume_aside = dp_resume_aside,
};
