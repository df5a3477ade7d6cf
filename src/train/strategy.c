/* The strategies of the training loop: one process alone, and data
 * parallelism over the trainer's group (PyTorch's DistributedDataParallel).
 * The pipeline's table is in strategy_pipeline.c, the parameter server's
 * in strategy_ps.c. */
#include "train/train_internal.h"

/* ---- single: this process's model, plain backward ---- */

static ddp_status single_create(ddp_trainer *t) {
  (void)t;
  return DDP_OK;
}

static ddp_status single_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                                 ddp_tensor **out) {
  return ddp_model_forward(t->model, tape, x, out);
}

static ddp_status single_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  (void)t;
  return ddp_backward(tape, loss);
}

static void single_destroy(ddp_trainer *t) { (void)t; }

const ddp__train_strategy ddp__train_single = {
    .name = "single",
    .create = single_create,
    .forward = single_forward,
    .backward = single_backward,
    .split_backward = NULL,
    .destroy = single_destroy,
    .step = NULL,
    .local_sums = NULL,
};

/* ---- data parallel: the DDP wrapper over the group ---- */

/* Collective: the wrapper checks the ranks' shapes and broadcasts rank 0's
 * parameters and buffers. */
static ddp_status dp_create(ddp_trainer *t) {
  ddp_dp_options o = ddp_dp_defaults();
  /* A cap below the first bucket's 1 MiB caps that one too: the seeds'
   * models (ConvNet's gradients are 113 KiB) would otherwise always be one
   * bucket, whatever the cap. */
  if (t->o.bucket_cap_mb > 0) {
    o.bucket_cap_mb = t->o.bucket_cap_mb;
    if (o.first_bucket_mb > o.bucket_cap_mb) o.first_bucket_mb = o.bucket_cap_mb;
  }
  DDP_TRY(ddp_dp_create(&t->dp, t->model, t->pg, &o));
  ddp_dp_set_optimizer(t->dp, t->opt);
  return DDP_OK;
}

static ddp_status dp_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                             ddp_tensor **out) {
  return ddp_dp_forward(t->dp, tape, x, out);
}

static ddp_status dp_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  return ddp_dp_backward(t->dp, tape, loss);
}

/* From the last bucket's launch (every gradient ready) to the end of
 * finalize: what backward's compute did not hide, on the same clock as
 * ddp_time_s (ddp_time_ns, monotonic). */
static void dp_split_backward(ddp_trainer *t, double *backward_compute, double *backward_comm) {
  ddp_dp_trace tr;
  ddp_dp_get_trace(t->dp, &tr);
  if (tr.n_buckets <= 0) return;
  double last_launch = 1e-9 * (double)tr.buckets[tr.n_buckets - 1].launch_ns;
  double comm = 1e-9 * (double)tr.finalize_end_ns - last_launch;
  if (comm >= 0 && comm <= *backward_compute) {
    *backward_comm = comm;
    *backward_compute -= comm;
  }
}

static void dp_destroy(ddp_trainer *t) {
  ddp_dp_destroy(t->dp);
  t->dp = NULL;
}

const ddp__train_strategy ddp__train_data_parallel = {
    .name = "data_parallel",
    .create = dp_create,
    .forward = dp_forward,
    .backward = dp_backward,
    .split_backward = dp_split_backward,
    .destroy = dp_destroy,
    .step = NULL,
    .local_sums = NULL,
};
