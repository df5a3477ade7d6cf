/* Re-laying out a model's flat buffers: the parameters (and their gradients)
 * placed in another order, so that data parallelism can make every bucket a
 * contiguous range of the gradient buffer when gradients become ready in an
 * order other than reverse registration. The flat allocations stay where
 * they are (optimizers hold pointers to them); only their contents move. */
#include <string.h>

#include "nn/module.h"

ddp_status ddp_model_relayout(ddp_model *model, const int *order) {
  if (!model || !model->finalized)
    return ddp_error(DDP_ERR_STATE, "nn: relayout: the model is not finalized");
  if (model->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED, "nn: relayout: the model must be on the CPU");
  if (model->params_borrowed || model->has_replicas)
    return ddp_error(DDP_ERR_STATE, "nn: relayout: the model's parameters are %s",
                     model->params_borrowed ? "another model's (a replica)"
                                            : "read in place by replicas (DataParallel)");
  int n = model->n_params;
  if (n == 0) return DDP_OK;
  if (!order) return ddp_error(DDP_ERR_INVALID, "nn: relayout: order is NULL");
  /* One allocation: a seen-flag per parameter, then a copy of the buffers. */
  size_t elems = (size_t)model->n_param_elems;
  size_t flags = ((size_t)n + sizeof(float) - 1) / sizeof(float) * sizeof(float);
  unsigned char *seen = ddp_calloc(flags + 2 * elems * sizeof(float), 1);
  if (!seen) return ddp_error(DDP_ERR_NOMEM, "nn: relayout: cannot allocate %zu floats", 2 * elems);
  for (int k = 0; k < n; k++) {
    if (order[k] < 0 || order[k] >= n || seen[order[k]]) {
      ddp_free(seen);
      return ddp_error(DDP_ERR_INVALID,
                       "nn: relayout: order is not a permutation of the %d parameters "
                       "(entry %d is %d)", n, k, order[k]);
    }
    seen[order[k]] = 1;
  }
  /* The copy starts at the first float boundary past the flags. */
  float *old_params = (float *)(void *)(seen + flags);
  float *old_grads = old_params + elems;
  memcpy(old_params, model->params_flat, elems * sizeof(float));
  memcpy(old_grads, model->grads_flat, elems * sizeof(float));
  int64_t off = 0;
  for (int k = 0; k < n; k++) {
    int i = order[k];
    ddp_tensor *t = &model->params[i];
    int64_t from = model->param_offsets[i];
    memcpy(model->params_flat + off, old_params + from, (size_t)t->numel * sizeof(float));
    memcpy(model->grads_flat + off, old_grads + from, (size_t)t->numel * sizeof(float));
    t->data = model->params_flat + off;
    t->grad = model->grads_flat + off;
    model->param_offsets[i] = off;
    off += t->numel;
  }
  DDP_ASSERT(off == model->n_param_elems);
  ddp_free(seen);
  return DDP_OK;
}
