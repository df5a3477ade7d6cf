/* The eager step of the strategies that give forward and backward (single,
 * data parallel): zero_grad, forward, the loss, backward and the optimizer
 * on one batch, or on its micro-batches for gradient accumulation
 * (options.microbatches, docs/train.md "Micro-batches"); a full batch goes
 * through the CUDA graph instead when there is one (graph_step.c). The
 * pipeline's micro-batches are its executor's, never these. */
#include "tensor/tape.h" /* ddp__basic_kernels_for */
#include "train/train_internal.h"

/* Rows [first, first + rows) of a batch tensor (N, ...) as a view: no copy,
 * on the tensor's device. */
static void microbatch_view(const ddp_tensor *x, int64_t first, int64_t rows, ddp_tensor *view) {
  *view = *x;
  const int64_t row = x->shape[0] > 0 ? x->numel / x->shape[0] : 0;
  view->shape[0] = rows;
  view->numel = rows * row;
  view->data = (char *)x->data + (size_t)(first * row) * ddp_dtype_size(x->dtype);
  view->grad = NULL;
}

/* How many micro-batches a batch of `rows` goes in: options.microbatches,
 * or one a row when it has fewer rows (torch.tensor_split would make empty
 * ones, which a mean loss cannot take). */
static int64_t microbatch_count(int64_t rows, int32_t microbatches) {
  int64_t m = microbatches > 1 ? microbatches : 1;
  return rows < m ? (rows > 0 ? rows : 1) : m;
}

/* One micro-batch's forward and loss: *loss_value read back.
 *
 * THE FORWARD/LOSS SECTION of the single, data-parallel and ZeRO
 * strategies (issue 42): the autocast region of options.precision (bf16,
 * fp16) is entered around the forward and the loss here and left before
 * the loss is read back and before backward, as PyTorch's recipe has it
 * (with torch.autocast(...): out = model(x); loss = loss_fn(out, y)). The
 * pipeline's forward runs inside its executor (src/pipeline/exec.c). */
static ddp_status microbatch_forward(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                                     ddp_tensor **loss, float *loss_value) {
  ddp_tensor *out;
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = t->strategy->forward(t, tape, x, &out);
  if (s == DDP_OK) {
    s = ddp_model_loss(t->model, tape, out, y, loss);
    if (s != DDP_OK) ddp_error_wrap(s, "loss");
  } else {
    ddp_error_wrap(s, "forward");
  }
  ddp__train_autocast_exit(t);
  if (s != DDP_OK) return s;
  s = ddp__train_scalar(*loss, loss_value);
  if (s != DDP_OK) return ddp_error_wrap(s, "reading the loss");
  return DDP_OK;
}

/* Gradient accumulation (options.microbatches): the batch in m micro-batches
 * of torch.tensor_split's sizes, forward and backward each (the
 * data-parallel wrapper under no_sync but for the last), the gradients
 * scaled by 1/m for a mean loss. *loss_value: the micro-batches' mean loss
 * (what PyTorch's accumulation loop reports: the sum of loss_i / m). */
static ddp_status accumulate(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                             int64_t m, float *loss_value, int64_t *t_forward_sum) {
  const int64_t n = x->shape[0], base = n / m, extra = n % m;
  double loss_sum = 0;
  int64_t first = 0;
  for (int64_t i = 0; i < m; i++) {
    const int64_t rows = base + (i < extra);
    ddp_tensor xi, yi, *loss;
    microbatch_view(x, first, rows, &xi);
    microbatch_view(y, first, rows, &yi);
    first += rows;
    if (t->strategy->no_sync) t->strategy->no_sync(t, i + 1 < m);
    int64_t t0 = ddp_time_ns();
    ddp_tape_reset(tape);
    float li;
    ddp_status s = microbatch_forward(t, tape, &xi, &yi, &loss, &li);
    if (s != DDP_OK) return ddp_error_wrap(s, "micro-batch %lld of %lld", (long long)i + 1, (long long)m);
    loss_sum += li;
    *t_forward_sum += ddp_time_ns() - t0;
    s = t->strategy->backward(t, tape, loss);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "backward of micro-batch %lld of %lld", (long long)i + 1, (long long)m);
  }
  if (!t->o.microbatch_sum) {
    /* After the reduction (linear: the same as scaling each loss by 1/m,
     * but one pass over the gradients instead of m). Where the optimizer
     * steps a range (ZeRO), that range: under ZeRO-2's gradient ring the
     * rest of the buffer is not kept. */
    int64_t off = 0, numel = ddp_model_num_param_elements(t->model);
    if (t->strategy->grad_range) t->strategy->grad_range(t, &off, &numel);
    ddp__basic_kernels_for(t->o.device)->scale(ddp_model_grads_flat(t->model) + off,
                                               1.0f / (float)m, numel);
  }
  *loss_value = (float)(loss_sum / (double)m);
  return DDP_OK;
}

ddp_status ddp__train_clip(ddp_trainer *t) {
  const double max_norm = t->o.clip_grad_norm;
  if (!(max_norm > 0)) return DDP_OK;
  double norm = 0;
  ddp_status s = t->strategy->clip_grad_norm
                     ? t->strategy->clip_grad_norm(t, max_norm, &norm)
                     : ddp_model_clip_grad_norm(t->model, max_norm, &norm);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "clipping the gradient norm to %g (--clip-grad-norm; a non-finite "
                          "norm stops the run as PyTorch's error_if_nonfinite=True: lower the "
                          "learning rate)", max_norm);
  return DDP_OK;
}

ddp_status ddp__train_eager_step(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                                 float *loss_value, ddp_train_phases *p) {
  int64_t t0 = ddp_time_ns();
  ddp_tensor *loss;
  if (t->strategy->zero_grad) t->strategy->zero_grad(t);
  else ddp_model_zero_grad(t->model);
  const int64_t m = microbatch_count(x->shape[0], t->o.microbatches);
  int64_t t_forward;
  if (t->o.microbatches > 1) {
    int64_t forward_sum = 0;
    DDP_TRY(accumulate(t, tape, x, y, m, loss_value, &forward_sum));
    /* The phases as sums over the micro-batches, laid end to end for the
     * timeline. */
    t_forward = t0 + forward_sum;
  } else {
    ddp_tape_reset(tape);
    DDP_TRY(microbatch_forward(t, tape, x, y, &loss, loss_value));
    t_forward = ddp_time_ns();
    ddp_status s = t->strategy->backward(t, tape, loss);
    if (s != DDP_OK) return ddp_error_wrap(s, "backward");
  }
  int64_t t_opt = ddp_time_ns();
  /* The gradients are final here (reduced, accumulated, scaled by 1/M):
   * the scaler's unscale, its agreement, clipping and the step. */
  DDP_TRY(ddp__train_optimizer_step(t));
  int64_t t_end = ddp_time_ns();
  p->forward_ms = 1e-9 * (double)(t_forward - t0);
  p->backward_compute_ms = 1e-9 * (double)(t_opt - t_forward);
  p->backward_comm_ms = 0;
  p->optimizer_ms = 1e-9 * (double)(t_end - t_opt);
  t->step_marks[0] = t0;
  t->step_marks[1] = t_forward;
  t->step_marks[2] = t_opt;
  t->step_marks[3] = t_end;
  return DDP_OK;
}

ddp_status ddp__train_step_eager(ddp_trainer *t, ddp_batch *b, ddp__train_step_out *out) {
  if (ddp__train_graph_takes(t, b)) {
    out->marked = false; /* a replay's phases are not separate readings */
    return ddp__train_graph_step(t, b, &out->loss, &out->phases);
  }
  const int64_t t0 = ddp_time_ns();
  ddp_tensor x, y;
  ddp_status s = ddp__train_batch_on_device(t, b, &x, &y);
  if (s != DDP_OK) return ddp_error_wrap(s, "copying a batch to the device");
  out->phases.load_ms += 1e-9 * (double)(ddp_time_ns() - t0);
  return ddp__train_eager_step(t, t->tape, &x, &y, &out->loss, &out->phases);
}
