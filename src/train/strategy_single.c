/* The single strategy of the training loop: this process's model and plain
 * backward; a group, when there is one, only reduces the loss and the
 * metrics. It keeps no state. Its step is the eager one, or a CUDA graph's
 * replay (graph_step.c). */
#include "train/train_internal.h"

/* SyncBatchNorm needs the data-parallel strategy's group; with one process
 * (no group) it is BatchNorm itself. */
static ddp_status single_check(const ddp_train_options *o, const ddp_process_group *pg) {
  if (o->sync_bn && pg)
    return ddp_error(DDP_ERR_INVALID, "sync_bn needs the data-parallel strategy");
  return DDP_OK;
}

static ddp_status single_create(ddp_trainer *t) {
  t->state = NULL;
  return DDP_OK;
}

static void single_destroy(ddp_trainer *t) { t->state = NULL; }

static ddp_status single_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x,
                                 ddp_tensor **out) {
  return ddp_model_forward(t->model, tape, x, out);
}

static ddp_status single_backward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss) {
  (void)t;
  return ddp_backward(tape, loss);
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
