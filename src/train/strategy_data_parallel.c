/* The data-parallel strategy of the training loop (PyTorch's
 * DistributedDataParallel over the trainer's group): the DDP wrapper
 * (ddp_dp) is its state, behind t->state. Its step is the eager one, the
 * wrapper's forward and backward averaging gradients in buckets while
 * backward runs. */
#include "train/trace.h"
#include "train/train_internal.h"

static ddp_dp *wrapper(const ddp_trainer *t) { return t->state; }

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
  t->state = NULL;
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
  t->state = dp;
  ddp_dp_set_optimizer(dp, t->opt);
  return DDP_OK;
}

static void dp_destroy(ddp_trainer *t) {
  ddp_dp_destroy(wrapper(t));
  t->state = NULL;
}

static ddp_status dp_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                             ddp_tensor **out) {
  return ddp_dp_forward(wrapper(t), tape, x, out);
}

static ddp_status dp_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  ddp_dp_set_loss_scale(wrapper(t), ddp__train_loss_seed(t));
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
};
