/* Helpers for the pipeline tests: the models (the seed ConvNet and an MLP of
 * 8 x (Linear, ReLU) and a head), deterministic batches, the single-rank
 * reference (the unsplit model with the same micro-batch accumulation:
 * torch.tensor_split rows, backward of loss / M per micro-batch, one SGD
 * step), and the per-tensor comparison max|a - b| <= 1e-5 max|b| + 1e-7. */
#ifndef DDP_TESTS_PP_TEST_UTIL_H
#define DDP_TESTS_PP_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/pipeline.h"
#include "tensor/tape.h"

#define PPT_MLP_DIM 24
#define PPT_MLP_OUT 8

/* "convnet" (seed 001's, cross-entropy) or "mlp": 0..15 = 8 x (Linear(24,
 * 24), ReLU), "head" Linear(24, 8); MSE. Same seed, same weights. */
static inline ddp_status ppt_build(const char *name, ddp_model **out) {
  if (strcmp(name, "mlp") != 0) return ddp_model_build(name, NULL, 7, out);
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  for (int i = 0; i < 8; i++) {
    DDP_TRY(ddp_module_add_linear(m, NULL, NULL, PPT_MLP_DIM, PPT_MLP_DIM, true, NULL));
    DDP_TRY(ddp_module_add_relu(m, NULL, NULL, NULL));
  }
  DDP_TRY(ddp_module_add_linear(m, NULL, "head", PPT_MLP_DIM, PPT_MLP_OUT, true, NULL));
  DDP_TRY(ddp_model_finalize(m, 7));
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  int64_t sample[1] = {PPT_MLP_DIM};
  ddp_model_set_sample_shape(m, 1, sample);
  *out = m;
  return DDP_OK;
}

/* Step `step`'s batch of n rows: x (n, sample) normal, y labels in [0, 10)
 * (convnet) or (n, 8) normal (mlp). Buffers are the caller's. */
static inline void ppt_batch(const char *name, int step, int64_t n, float *xbuf, void *ybuf,
                             ddp_tensor *x, ddp_tensor *y) {
  ddp_rng rng;
  ddp_rng_seed(&rng, 4242u + (uint64_t)step);
  bool conv = strcmp(name, "mlp") != 0;
  int64_t sample = conv ? 784 : PPT_MLP_DIM;
  for (int64_t i = 0; i < n * sample; i++) xbuf[i] = ddp_rng_normal(&rng);
  if (conv) {
    for (int64_t i = 0; i < n; i++) ((int64_t *)ybuf)[i] = (int64_t)ddp_rng_below(&rng, 10);
    int64_t xs[4] = {n, 1, 28, 28}, ys[1] = {n};
    ddp_tensor_wrap(x, DDP_FLOAT32, 4, xs, xbuf);
    ddp_tensor_wrap(y, DDP_INT64, 1, ys, ybuf);
  } else {
    for (int64_t i = 0; i < n * PPT_MLP_OUT; i++) ((float *)ybuf)[i] = ddp_rng_normal(&rng);
    int64_t xs[2] = {n, PPT_MLP_DIM}, ys[2] = {n, PPT_MLP_OUT};
    ddp_tensor_wrap(x, DDP_FLOAT32, 2, xs, xbuf);
    ddp_tensor_wrap(y, DDP_FLOAT32, 2, ys, ybuf);
  }
}

static inline ddp_status ppt_sgd(ddp_model *model, ddp_optimizer **opt) {
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  return ddp_optimizer_create(opt, &oo, ddp_model_params_flat(model), ddp_model_grads_flat(model),
                              (size_t)ddp_model_num_param_elements(model));
}

/* One step's forward and backward of an unsplit model over the n rows of
 * (x, y), split as torch.tensor_split does into m micro-batches, each
 * loss's gradient scaled by `scale` and accumulated into the model's
 * gradients; and into xgrad (n rows of x) when it is not NULL. */
static inline ddp_status ppt_microbatches(ddp_model *model, ddp_tape *tape, const ddp_tensor *x,
                                          const ddp_tensor *y, int64_t n, int m, float scale,
                                          float *xgrad) {
  int64_t xrow = x->numel / n, yrow = y->numel / n;
  for (int mb = 0, off = 0; mb < m; mb++) {
    int64_t rows = n / m + (mb < n % m);
    ddp_tensor xm = *x, ym = *y;
    xm.shape[0] = rows, xm.numel = rows * xrow, xm.data = (float *)x->data + off * xrow;
    ym.shape[0] = rows, ym.numel = rows * yrow;
    ym.data = (char *)y->data + (size_t)(off * yrow) * ddp_dtype_size(y->dtype);
    if (xgrad) xm.grad = xgrad + off * xrow, xm.flags |= DDP_TENSOR_REQUIRES_GRAD;
    off += (int)rows;
    ddp_tape_reset(tape);
    ddp_tensor *o, *loss;
    DDP_TRY(ddp_model_forward(model, tape, &xm, &o));
    DDP_TRY(ddp_model_loss(model, tape, o, &ym, &loss));
    DDP_TRY(ddp__backward_from(tape, loss, &scale));
  }
  return DDP_OK;
}

/* The reference: the unsplit model on one rank, each step's batch split as
 * torch.tensor_split does into m micro-batches, d(loss / m) accumulated. */
static inline ddp_status ppt_reference(const char *name, int steps, int64_t n, int m,
                                       ddp_model **out) {
  ddp_model *model;
  DDP_TRY(ppt_build(name, &model));
  ddp_optimizer *opt;
  DDP_TRY(ppt_sgd(model, &opt));
  ddp_tape *tape;
  DDP_TRY(ddp_tape_create(&tape, 1 << 20));
  float *xbuf = malloc(sizeof(float) * (size_t)n * 784);
  int64_t *ybuf = malloc(sizeof(float) * (size_t)n * 10 + 8 * (size_t)n);
  float scale = 1.0f / (float)m;
  for (int step = 0; step < steps; step++) {
    ddp_tensor x, y;
    ppt_batch(name, step, n, xbuf, ybuf, &x, &y);
    ddp_model_zero_grad(model);
    DDP_TRY(ppt_microbatches(model, tape, &x, &y, n, m, scale, NULL));
    DDP_TRY(ddp_optimizer_step(opt));
  }
  free(xbuf);
  free(ybuf);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  *out = model;
  return DDP_OK;
}

/* Every state entry of `part` (a stage's model) against the entry of the
 * same name in `whole`; writes the first difference to why. */
static inline bool ppt_same(ddp_model *part, ddp_model *whole, char *why, size_t bytes) {
  int n = ddp_model_state_count(part);
  if (n == 0) {
    snprintf(why, bytes, "the stage holds no state");
    return ddp_model_num_params(part) == 0;
  }
  for (int i = 0; i < n; i++) {
    ddp_state_entry a, b;
    ddp_model_state_entry(part, i, &a);
    if (ddp_model_state_find(whole, a.name, &b) != DDP_OK || a.numel != b.numel) {
      snprintf(why, bytes, "%s: not in the unsplit model or another size", a.name);
      return false;
    }
    if (a.dtype == DDP_INT64) {
      if (memcmp(a.data, b.data, (size_t)a.numel * 8) != 0) {
        snprintf(why, bytes, "%s: %lld vs %lld", a.name, (long long)*(int64_t *)a.data,
                 (long long)*(int64_t *)b.data);
        return false;
      }
      continue;
    }
    double diff = 0, ref = 0;
    for (int64_t k = 0; k < a.numel; k++) {
      double x = ((float *)a.data)[k], y = ((float *)b.data)[k];
      if (fabs(x - y) > diff || isnan(x)) diff = isnan(x) ? INFINITY : fabs(x - y);
      if (fabs(y) > ref) ref = fabs(y);
    }
    if (!(diff <= 1e-5 * ref + 1e-7)) {
      snprintf(why, bytes, "%s: max|a - b| = %.3g, max|b| = %.3g", a.name, diff, ref);
      return false;
    }
  }
  return true;
}

#endif /* DDP_TESTS_PP_TEST_UTIL_H */
