/* log_softmax and the losses (mean reduction, scalar output of shape ()):
 * mse_loss, nll_loss, and cross_entropy (log_softmax + nll fused, saving only
 * each row's max and log-sum-exp for backward). */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/tape.h"

/* ---- log_softmax over the last dimension ---- */

static ddp_status log_softmax_backward(ddp_tape *tape, ddp__node *node) {
  ddp_status s = DDP_OK;
  float *dx = ddp__tape_grad(tape, node->in[0], &s);
  const ddp_tensor *y = node->out;
  int64_t C = y->shape[y->ndim - 1];
  if (dx && C > 0)
    ddp__kernels_for(y->device)->pointwise->log_softmax_backward(dx, y->grad, y->data, y->numel / C,
                                                                 C);
  return s;
}

ddp_status ddp_log_softmax(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "log_softmax: tape or out is NULL");
  if (!x) return ddp_error(DDP_ERR_INVALID, "log_softmax: input is NULL");
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("log_softmax", 1, &x, &k));
  if (x->ndim < 1)
    return ddp_error(DDP_ERR_SHAPE, "log_softmax: input is a scalar; expected (N, C)");
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "log_softmax", DDP_FLOAT32, x->ndim, x->shape, x->device, &y));
  int64_t C = x->shape[x->ndim - 1];
  if (C > 0) k->pointwise->log_softmax(y->data, x->data, x->numel / C, C);
  /* Under PyTorch 2.x's CPU autocast log_softmax is in neither list: it
   * runs in its input's dtype (computed in float32, the output rounded).
   * CUDA's autocast lists it as fp32 (autocast_mode.cpp, "fp32" on the
   * CUDA key): inside a region on a GPU its input is widened (exact) and
   * its output stays float32. */
  const bool cuda_fp32 = x->device.type != DDP_DEVICE_CPU && ddp__autocast_op_dtype(x) != DDP_FLOAT32;
  ddp__autocast_mark(y, cuda_fp32 ? DDP_FLOAT32 : ddp__low_dtype(x), true);
  if (ddp__tape_wants_grad(tape, 1, &x))
    DDP_TRY(ddp__tape_record(tape, "log_softmax", log_softmax_backward, y, 1, &x, NULL));
  *out = y;
  return DDP_OK;
}

/* ---- mse_loss ---- */

static ddp_status mse_loss_backward(ddp_tape *tape, ddp__node *node) {
  ddp_tensor *input = node->in[0], *target = node->in[1];
  ddp_status s = DDP_OK;
  float *dinput = ddp__tape_grad(tape, input, &s);
  float *dtarget = ddp__tape_grad(tape, target, &s);
  if (s != DDP_OK) return s;
  ddp__kernels_for(node->out->device)
      ->pointwise->mse_loss_backward(dinput, dtarget, node->out->grad, input->data, target->data,
                                     input->numel);
  return DDP_OK;
}

ddp_status ddp_mse_loss(ddp_tape *tape, ddp_tensor *input, ddp_tensor *target, ddp_tensor **out) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "mse_loss: tape or out is NULL");
  if (!input || !target)
    return ddp_error(DDP_ERR_INVALID, "mse_loss: %s is NULL", input ? "target" : "input");
  ddp_tensor *in[2] = {input, target};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("mse_loss", 2, in, &k));
  char si[DDP_SHAPE_STR_BYTES], st[DDP_SHAPE_STR_BYTES];
  if (!ddp_tensor_same_shape(input, target))
    return ddp_error(DDP_ERR_SHAPE, "mse_loss: input %s and target %s differ in shape",
                     ddp_tensor_shape_str(input, si, sizeof si),
                     ddp_tensor_shape_str(target, st, sizeof st));
  if (input->numel == 0)
    return ddp_error(DDP_ERR_SHAPE, "mse_loss: input %s is empty; the mean is undefined",
                     ddp_tensor_shape_str(input, si, sizeof si));
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "mse_loss", DDP_FLOAT32, 0, input->shape, input->device, &y));
  k->pointwise->mse_loss(y->data, input->data, target->data, input->numel);
  if (ddp__tape_wants_grad(tape, 2, in))
    DDP_TRY(ddp__tape_record(tape, "mse_loss", mse_loss_backward, y, 2, in, NULL));
  *out = y;
  return DDP_OK;
}

/* ---- nll_loss and cross_entropy: (N, C) scores, (N) int64 targets ---- */

static ddp_status check_classification(const char *op, const char *scores_name, ddp_tape *tape,
                                       ddp_tensor *scores, ddp_tensor *target, ddp_tensor **out,
                                       const ddp__kernels **k) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "%s: tape or out is NULL", op);
  if (!scores || !target)
    return ddp_error(DDP_ERR_INVALID, "%s: %s is NULL", op, scores ? "target" : scores_name);
  DDP_TRY(ddp__kernels_check(op, 1, &scores, k));
  char ss[DDP_SHAPE_STR_BYTES], st[DDP_SHAPE_STR_BYTES];
  if (scores->ndim != 2)
    return ddp_error(DDP_ERR_SHAPE, "%s: %s %s must be (N, C)", op, scores_name,
                     ddp_tensor_shape_str(scores, ss, sizeof ss));
  if (target->dtype != DDP_INT64)
    return ddp_error(DDP_ERR_INVALID, "%s: target is %s, expected int64 class indices", op,
                     ddp_dtype_name(target->dtype));
  if (target->device.type != scores->device.type || target->device.index != scores->device.index)
    return ddp_error(DDP_ERR_INVALID, "%s: target and %s are on different devices", op,
                     scores_name);
  if (target->ndim != 1 || target->shape[0] != scores->shape[0])
    return ddp_error(DDP_ERR_SHAPE, "%s: target %s does not match %s %s (expected (%lld))", op,
                     ddp_tensor_shape_str(target, st, sizeof st), scores_name,
                     ddp_tensor_shape_str(scores, ss, sizeof ss), (long long)scores->shape[0]);
  if (scores->shape[0] == 0)
    return ddp_error(DDP_ERR_SHAPE, "%s: empty batch %s; the mean is undefined", op,
                     ddp_tensor_shape_str(scores, ss, sizeof ss));
  if (!target->data) return ddp_error(DDP_ERR_INVALID, "%s: target has no data", op);
  return DDP_OK;
}

static ddp_status nll_loss_backward(ddp_tape *tape, ddp__node *node) {
  ddp_tensor *logp = node->in[0], *target = node->in[1];
  ddp_status s = DDP_OK;
  float *dlogp = ddp__tape_grad(tape, logp, &s);
  if (dlogp)
    ddp__kernels_for(node->out->device)
        ->pointwise->nll_loss_backward(dlogp, node->out->grad, target->data, logp->shape[0],
                                       logp->shape[1]);
  return s;
}

static ddp_status cross_entropy_backward(ddp_tape *tape, ddp__node *node) {
  ddp_tensor *logits = node->in[0], *target = node->in[1];
  ddp_status s = DDP_OK;
  float *dlogits = ddp__tape_grad(tape, logits, &s);
  if (dlogits)
    ddp__kernels_for(node->out->device)
        ->pointwise->cross_entropy_backward(dlogits, node->out->grad, logits->data, node->ctx,
                                            target->data, logits->shape[0], logits->shape[1]);
  return s;
}

/* nll_loss (fused false) and cross_entropy (fused true): one validation, one
 * output, and for the fused loss the per-row statistics backward needs. */
static ddp_status classification_loss(ddp_tape *tape, bool fused, ddp_tensor *scores,
                                      ddp_tensor *target, ddp_tensor **out) {
  const char *op = fused ? "cross_entropy" : "nll_loss";
  const ddp__kernels *k;
  DDP_TRY(check_classification(op, fused ? "logits" : "log_probs", tape, scores, target, out, &k));
  int64_t N = scores->shape[0], C = scores->shape[1];
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, op, DDP_FLOAT32, 0, scores->shape, scores->device, &y));
  float *stats = NULL;
  int64_t bad, bad_value = 0;
  if (fused) {
    /* (N, 2): each row's max and log sum exp(x - max), all backward needs. */
    stats = ddp__tape_scratch_on(tape, scores->device, (size_t)N * 2 * sizeof(float));
    if (!stats)
      return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate %lld floats of scratch", op,
                       (long long)N * 2);
    bad = k->pointwise->cross_entropy(y->data, stats, scores->data, target->data, N, C, &bad_value);
  } else {
    bad = k->pointwise->nll_loss(y->data, scores->data, target->data, N, C, &bad_value);
  }
  if (bad >= 0)
    return ddp_error(DDP_ERR_RANGE, "%s: target[%lld] = %lld is out of range for %lld classes", op,
                     (long long)bad, (long long)bad_value, (long long)C);
  ddp_tensor *in[2] = {scores, target};
  if (ddp__tape_wants_grad(tape, 1, in))
    DDP_TRY(ddp__tape_record(tape, op, fused ? cross_entropy_backward : nll_loss_backward, y, 2, in,
                             stats));
  *out = y;
  return DDP_OK;
}

ddp_status ddp_nll_loss(ddp_tape *tape, ddp_tensor *log_probs, ddp_tensor *target,
                        ddp_tensor **out) {
  return classification_loss(tape, false, log_probs, target, out);
}

ddp_status ddp_cross_entropy(ddp_tape *tape, ddp_tensor *logits, ddp_tensor *target,
                             ddp_tensor **out) {
  return classification_loss(tape, true, logits, target, out);
}
