/* The single strategy of the training loop: this process's model and plain
 * backward; a group, when there is one, only reduces the loss and the
 * metrics. Its step is the eager one, or a CUDA graph's replay
 * (graph_step.c). With options.replicas > 1 its forward is DataParallel's
 * (the wrapper is its state): still one process and one model, the batch
 * spread over threads, and the backward the tape's own. */
#include "tensor/tape.h" /* ddp__backward_from: the scaled loss's seed */
#include "train/train_internal.h"

static ddp_data_parallel *replicas(const ddp_trainer *t) { return t->state; }

/* SyncBatchNorm needs the data-parallel strategy's group; with one process
 * (no group) it is BatchNorm itself, or across DataParallel's replicas. */
static ddp_status single_check(const ddp_train_options *o, const ddp_process_group *pg) {
  if (o->sync_bn && pg)
    return ddp_error(DDP_ERR_INVALID, "sync_bn needs the data-parallel strategy");
  if (o->replicas < 0)
    return ddp_error(DDP_ERR_INVALID, "replicas = %d: must be >= 1", (int)o->replicas);
  if (o->replicas > 1 && pg)
    return ddp_error(DDP_ERR_INVALID,
                     "replicas = %d with a process group: DataParallel is one process; with "
                     "several processes, use data parallelism across them (one replica each)",
                     (int)o->replicas);
  if (o->replicas > 1 && o->cuda_graph)
    return ddp_error(DDP_ERR_UNSUPPORTED, "replicas = %d: not with a CUDA graph", (int)o->replicas);
  return DDP_OK;
}

static ddp_status single_create(ddp_trainer *t) {
  t->state = NULL;
  if (t->o.replicas <= 1) return DDP_OK;
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = t->o.replicas;
  o.sync_batch_norm = t->o.sync_bn;
  o.device = t->o.device;
  ddp_data_parallel *dp;
  ddp_status s = ddp_data_parallel_create(&dp, t->model, &o);
  if (s != DDP_OK) return s;
  t->state = dp;
  return DDP_OK;
}

static void single_destroy(ddp_trainer *t) {
  ddp_data_parallel_destroy(replicas(t));
  t->state = NULL;
}

static ddp_status single_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                                 ddp_tensor **out) {
  if (replicas(t)) return ddp_data_parallel_forward(replicas(t), tape, x, out);
  return ddp_model_forward(t->model, tape, x, out);
}

/* With a gradient scaler, backward from the loss seeded with the scale
 * (GradScaler's scale(loss)). */
static ddp_status single_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  const float seed = ddp__train_loss_seed(t);
  if (seed == 1.0f || loss->numel != 1 || loss->dtype != DDP_FLOAT32) return ddp_backward(tape, loss);
  return ddp__backward_from(tape, loss, &seed);
}

const ddp__train_strategy_ops ddp__train_single = {
    .name = "single",
    .kind = DDP_TRAIN_SINGLE,
    .check = single_check,
    .create = single_create,
    .destroy = single_destroy,
    .step = ddp__train_step_eager,
    .forward = single_forward,
    .backward = single_backward,
};
