/* The parameter-server strategy of the training loop
 * (ddp_train_options.param_server; docs/ps.md): the trainer has no group;
 * its sampler shards the data over the trainers; each step's gradients go
 * to the servers as backward makes them final (the tape's grad hook, as
 * the data-parallel wrapper's buckets) and the step ends with the pull of
 * fresh parameters, in the optimizer's place. Evaluation and checkpoints
 * are meetings of the live trainers at server 0. Its state is the client
 * of options.param_server (borrowed: the caller's); t->state stays NULL. */
#include "train/train_internal.h"

static ddp_ps_client *client(const ddp_trainer *t) { return t->o.param_server; }

/* A parameter's gradient is final: off it goes, while backward computes
 * the layers before it. */
static void grad_ready(ddp_tensor *param, void *user) {
  ddp_trainer *t = user;
  const int i = param->param_index;
  if (i < 0 || i >= ddp_model_num_params(t->model) || ddp_model_param(t->model, i) != param) return;
  ddp_ps_client_push(client(t), i, ddp_ps_client_step(client(t)), ddp_optimizer_get_lr(t->opt));
}

/* The data sharded over the trainers, by this trainer's index. */
static ddp_status ps_create(ddp_trainer *t) {
  const ddp_ps_client *c = client(t);
  t->state = NULL;
  t->replicas = ddp_ps_client_options(c)->num_trainers;
  t->replica = ddp_ps_client_trainer_index(c);
  return DDP_OK;
}

/* The first pull: the servers' parameters and buffers (fresh, or a resumed
 * run's) and the step they stand at. */
static ddp_status ps_bind(ddp_trainer *t) {
  int64_t base;
  return ddp_ps_client_bind(client(t), t->model, &base);
}

static void ps_destroy(ddp_trainer *t) { t->state = NULL; }

/* zero_grad, forward, loss, backward pushing each gradient, then the pull
 * in the optimizer's place (phases in seconds, as the eager step's). */
static ddp_status ps_step(ddp_trainer *t, ddp_batch *b, ddp__train_step_out *out) {
  ddp_tensor x, y, *model_out, *l;
  DDP_TRY(ddp__train_batch_on_device(t, b, &x, &y));
  const int64_t t0 = ddp_time_ns();
  ddp_tape *tape = t->tape;
  ddp_tape_reset(tape);
  ddp_model_zero_grad(t->model);
  ddp_tape_set_grad_hook(tape, grad_ready, t);
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = ddp_model_forward(t->model, tape, &x, &model_out);
  if (s == DDP_OK) {
    s = ddp_model_loss(t->model, tape, model_out, &y, &l);
    if (s != DDP_OK) ddp_error_wrap(s, "loss");
  } else {
    ddp_error_wrap(s, "forward");
  }
  ddp__train_autocast_exit(t);
  if (s != DDP_OK) return s;
  DDP_TRY(ddp__train_scalar(l, &out->loss));
  const int64_t t_forward = ddp_time_ns();
  s = ddp_backward(tape, l);
  ddp_tape_set_grad_hook(tape, NULL, NULL);
  if (s != DDP_OK) return ddp_error_wrap(s, "backward");
  const int64_t t_backward = ddp_time_ns();
  s = ddp_ps_client_end_step(client(t), ddp_optimizer_get_lr(t->opt));
  if (s != DDP_OK) return s; /* names the trainer, the step and the server */
  const int64_t t_end = ddp_time_ns();
  ddp_train_phases *p = &out->phases;
  p->forward_ms = 1e-9 * (double)(t_forward - t0);
  p->backward_compute_ms = 1e-9 * (double)(t_backward - t_forward);
  p->backward_comm_ms = 0;
  p->optimizer_ms = 1e-9 * (double)(t_end - t_backward);
  t->step_marks[0] = t0;
  t->step_marks[1] = t_forward;
  t->step_marks[2] = t_backward;
  t->step_marks[3] = t_end;
  return DDP_OK;
}

/* One model for every trainer's part of the test set: the live trainers
 * meet, pull the same parameters and buffers, evaluate their parts, and
 * the servers sum (the sums come back whole, so the group's reduction,
 * which this strategy has none of, is nothing). */
static ddp_status ps_local_sums(ddp_trainer *t, double sums[3]) {
  ddp_status s = ddp_ps_client_eval_begin(client(t));
  if (s != DDP_OK) return ddp_error_wrap(s, "fetching the model to evaluate");
  DDP_TRY(ddp__train_local_sums(t, sums));
  s = ddp_ps_client_sum(client(t), sums, 3);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "summing the test metrics over the trainers");
}

/* The servers write the checkpoint once every live trainer asks, with this
 * trainer's training state (the same on every trainer at that point). */
static ddp_status ps_save(ddp_trainer *t, const ddp_train_state *ts) {
  ddp_ps_save_info info = {.ts = *ts, .lr = ddp_optimizer_get_lr(t->opt)};
  /* A pointer into this trainer: meaningless to the servers (and the
   * scaler is refused with a parameter server). */
  info.ts.grad_scaler = NULL;
  if (t->sched) {
    ddp_scheduler_state_get(t->sched, &info.sched);
    info.has_sched = 1;
  }
  return ddp_ps_client_save(client(t), &info);
}

static ddp_status ps_check(const ddp_train_options *o, const ddp_process_group *pg) {
  if (pg)
    return ddp_error(DDP_ERR_INVALID, "param_server: a parameter-server trainer takes no process "
                                      "group (pass NULL: trainers meet through the servers)");
  if (o->pipeline || o->microbatches > 1 || o->cuda_graph || o->sync_bn ||
      o->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "param_server: not with a pipeline, micro-batches, CUDA graphs, "
                     "SyncBatchNorm or a GPU (the parameter server trains on the CPU, each "
                     "trainer's batch whole)");
  return DDP_OK;
}

const ddp__train_strategy_ops ddp__train_param_server = {
    .name = "param_server",
    .kind = DDP_TRAIN_PARAM_SERVER,
    .check = ps_check,
    .create = ps_create,
    .bind = ps_bind,
    .destroy = ps_destroy,
    .step = ps_step,
    .local_sums = ps_local_sums,
    .save = ps_save,
};
