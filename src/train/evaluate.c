/* Evaluation on the test set: every rank its part (the evaluation sampler
 * deals the set out without padding), then one reduction of the sums, so
 * the figures count every test sample once and agree on every rank. */
#include <math.h>

#include "train/train_internal.h"

ddp_status ddp__train_sum(ddp_trainer *t, double *values, int n) {
  if (!t->pg || t->size == 1) return DDP_OK;
  /* Host doubles: over the host group where the trainer's group is nccl. */
  ddp_process_group *pg = t->pg;
  if (!ddp_process_group_takes_host(pg)) DDP_TRY(ddp_process_group_host_group(pg, &pg));
  return ddp_allreduce(pg, values, (size_t)n, DDP_FLOAT64, DDP_REDUCE_SUM);
}

int64_t ddp__train_count_correct(const float *logits, const int64_t *labels, int64_t n, int64_t classes) {
  int64_t correct = 0;
  for (int64_t i = 0; i < n; i++) {
    const float *row = logits + i * classes; /* (classes) */
    int64_t best = 0;
    for (int64_t c = 1; c < classes; c++)
      if (row[c] > row[best]) best = c;
    correct += best == labels[i];
  }
  return correct;
}

ddp_status ddp__train_eval_sums(ddp_trainer *t, ddp__train_eval_batch_fn batch, void *ctx,
                                double sums[3]) {
  const bool classify = ddp_model_loss_kind(t->model) != DDP_LOSS_MSE;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  DDP_TRY(ddp_loader_start_epoch(t->test_loader, 0));
  for (;;) {
    ddp_batch b;
    DDP_TRY(ddp_loader_next(t->test_loader, &b));
    if (b.size == 0) break;
    double loss_rows = 0;
    int64_t right = 0;
    bool counted = true;
    DDP_TRY(batch(t, &b, ctx, classify, &loss_rows, &right, &counted));
    if (!counted) continue;
    loss_sum += loss_rows;
    correct += right;
    seen += b.size;
  }
  sums[0] = loss_sum;
  sums[1] = (double)correct; /* counts: exact in float64 */
  sums[2] = (double)seen;
  return DDP_OK;
}

/* One test batch through the model's forward and loss, on this rank. */
static ddp_status forward_batch(ddp_trainer *t, ddp_batch *b, void *ctx, bool classify,
                                double *loss_rows, int64_t *correct, bool *counted) {
  (void)ctx;
  *counted = true;
  ddp_tape *tape = t->tape;
  ddp_tensor *out, *loss, x, yd;
  DDP_TRY(ddp__train_batch_on_device(t, b, &x, &yd));
  ddp_tape_reset(tape);
  /* Evaluated in the precision trained in (autocast's region, as a
   * PyTorch test loop under torch.autocast). */
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = ddp_model_forward(t->model, tape, &x, &out);
  if (s == DDP_OK) s = ddp_model_loss(t->model, tape, out, &yd, &loss);
  ddp__train_autocast_exit(t);
  DDP_TRY(s);
  float loss0;
  DDP_TRY(ddp__train_scalar(loss, &loss0));
  *loss_rows = (double)loss0 * (double)b->size;
  if (classify) {
    /* On a GPU the outputs come to the host: into the test set's share
     * of tape memory, a few KB per batch. */
    float *host = out->device.type == DDP_DEVICE_CPU
                      ? NULL
                      : ddp_tape_scratch(tape, (size_t)out->numel * sizeof(float));
    if (out->device.type != DDP_DEVICE_CPU && !host)
      return ddp_error(DDP_ERR_NOMEM, "no room for a batch's outputs on the host");
    const float *o;
    DDP_TRY(ddp__train_host_view(out, host, &o));
    *correct = ddp__train_count_correct(o, ddp_tensor_i64(&b->y), b->size, out->shape[1]);
  }
  return DDP_OK;
}

ddp_status ddp__train_local_sums(ddp_trainer *t, double sums[3]) {
  return ddp__train_eval_sums(t, forward_batch, NULL, sums);
}

ddp_status ddp__train_evaluate(ddp_trainer *t, double *loss, double *accuracy) {
  ddp_model_train(t->model, false);
  ddp_tape_set_grad_enabled(t->tape, false);
  double sums[3];
  ddp_status s = t->strategy->local_sums ? t->strategy->local_sums(t, sums)
                                         : ddp__train_local_sums(t, sums);
  ddp_tape_reset(t->tape);
  ddp_tape_set_grad_enabled(t->tape, true);
  ddp_model_train(t->model, true);
  if (s != DDP_OK) return ddp_error_wrap(s, "evaluating on the test set");
  s = ddp__train_sum(t, sums, 3);
  if (s != DDP_OK) return ddp_error_wrap(s, "reducing the test metrics over the ranks");
  const bool classify = ddp_model_loss_kind(t->model) != DDP_LOSS_MSE;
  *loss = sums[2] > 0 ? sums[0] / sums[2] : NAN;
  *accuracy = classify && sums[2] > 0 ? sums[1] / sums[2] : NAN;
  return DDP_OK;
}
