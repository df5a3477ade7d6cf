/* Replicas of a model for data parallelism inside one process (PyTorch's
 * DataParallel replicate()): the same tree, reading the original's
 * parameters in place, with gradients and buffers of its own. On the CPU a
 * replica needs no copy of the parameters, only somewhere of its own to
 * write: gradients, running statistics, its tape's activations. */
#include <string.h>

#include "nn/module.h"

/* Adds a module configured as `m` under `parent` of `dst`, then its children. */
static ddp_status clone_module(ddp_model *dst, ddp_module *parent, const ddp_module *m) {
  ddp_module *c = NULL;
  const char *name = m->name;
  switch (m->kind) {
  case DDP_MODULE_SEQUENTIAL:
    DDP_TRY(ddp_module_add_sequential(dst, parent, name, &c));
    break;
  case DDP_MODULE_LINEAR:
    DDP_TRY(ddp_module_add_linear(dst, parent, name, m->in_features, m->out_features, m->has_bias,
                                  &c));
    break;
  case DDP_MODULE_CONV2D:
    DDP_TRY(ddp_module_add_conv2d(dst, parent, name, m->in_features, m->out_features, m->kernel,
                                  m->stride, m->padding, m->has_bias, &c));
    break;
  case DDP_MODULE_BATCHNORM2D:
    DDP_TRY(ddp_module_add_batchnorm2d(dst, parent, name, m->in_features, &c));
    c->momentum = m->momentum;
    c->eps = m->eps;
    break;
  case DDP_MODULE_RELU: DDP_TRY(ddp_module_add_relu(dst, parent, name, &c)); break;
  case DDP_MODULE_SIGMOID: DDP_TRY(ddp_module_add_sigmoid(dst, parent, name, &c)); break;
  case DDP_MODULE_TANH: DDP_TRY(ddp_module_add_tanh(dst, parent, name, &c)); break;
  case DDP_MODULE_MAXPOOL2D:
    DDP_TRY(ddp_module_add_maxpool2d(dst, parent, name, m->kernel, m->stride, &c));
    break;
  case DDP_MODULE_DROPOUT: DDP_TRY(ddp_module_add_dropout(dst, parent, name, m->p, &c)); break;
  case DDP_MODULE_DROPOUT2D:
    DDP_TRY(ddp_module_add_dropout2d(dst, parent, name, m->p, &c));
    break;
  case DDP_MODULE_FLATTEN:
    DDP_TRY(ddp_module_add_flatten(dst, parent, name, m->start_dim, &c));
    break;
  case DDP_MODULE_LOGSOFTMAX: DDP_TRY(ddp_module_add_log_softmax(dst, parent, name, &c)); break;
  default:
    return ddp_error(DDP_ERR_UNSUPPORTED, "nn: replicate: module '%s' of kind %d", m->path,
                     (int)m->kind);
  }
  for (const ddp_module *k = m->first_child; k; k = k->next_sibling)
    DDP_TRY(clone_module(dst, c, k));
  return DDP_OK;
}

/* The replica's root child at the position `m` has among model's. */
static ddp_module *same_child(const ddp_model *model, ddp_model *replica, const ddp_module *m) {
  ddp_module *r = replica->root->first_child;
  for (const ddp_module *c = model->root->first_child; c && r; c = c->next_sibling) {
    if (c == m) return r;
    r = r->next_sibling;
  }
  return NULL;
}

/* The forward order, the buffers' values and everything else a forward
 * reads that finalize does not set. */
static ddp_status copy_settings(const ddp_model *model, ddp_model *replica) {
  if (model->forward_order) {
    ddp_module *order[64];
    if (model->n_forward > (int)(sizeof order / sizeof order[0]))
      return ddp_error(DDP_ERR_UNSUPPORTED, "nn: replicate: a forward order of %d modules (at "
                                            "most 64)", model->n_forward);
    for (int i = 0; i < model->n_forward; i++) {
      order[i] = same_child(model, replica, model->forward_order[i]);
      DDP_ASSERT(order[i]);
    }
    DDP_TRY(ddp_model_set_forward_order(replica, model->n_forward, order));
  }
  memcpy(replica->name, model->name, sizeof replica->name);
  replica->loss = model->loss;
  replica->sample_ndim = model->sample_ndim;
  memcpy(replica->sample_shape, model->sample_shape, sizeof replica->sample_shape);
  replica->num_outputs = model->num_outputs;
  replica->training = model->training;
  replica->dropout_rng = model->dropout_rng;
  memcpy(replica->buffers_flat, model->buffers_flat,
         (size_t)model->n_buffer_elems * sizeof(float));
  memcpy(replica->counters, model->counters, (size_t)model->n_counters * sizeof(int64_t));
  return DDP_OK;
}

ddp_status ddp_model_replicate(ddp_model *model, ddp_model **out) {
  *out = NULL;
  if (!model || !model->finalized)
    return ddp_error(DDP_ERR_STATE, "nn: replicate: the model must be finalized first");
  if (model->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "nn: replicate: the model must be on the CPU (replicas on GPUs get a "
                     "broadcast copy, which is not built yet)");
  if (model->params_borrowed)
    return ddp_error(DDP_ERR_INVALID, "nn: replicate: the model is itself a replica");
  ddp_model *r;
  DDP_TRY(ddp_model_create(&r));
  ddp_status s = DDP_OK;
  for (const ddp_module *c = model->root->first_child; c && s == DDP_OK; c = c->next_sibling)
    s = clone_module(r, NULL, c);
  if (s == DDP_OK) s = ddp_model_finalize(r, 0);
  if (s == DDP_OK) s = copy_settings(model, r);
  if (s != DDP_OK) {
    ddp_model_destroy(r);
    return ddp_error_wrap(s, "nn: replicate");
  }
  DDP_ASSERT(r->n_params == model->n_params && r->n_param_elems == model->n_param_elems &&
             r->n_buffer_elems == model->n_buffer_elems && r->n_counters == model->n_counters);
  /* The parameters are model's, at model's offsets (a relayout may have
   * moved them from registration order); the gradients follow the same
   * layout in the replica's own buffer, so that reducing gradients is one
   * loop over two flat buffers. */
  ddp_free(r->params_flat);
  r->params_flat = model->params_flat;
  r->params_borrowed = true;
  r->replica_of = model;
  model->has_replicas++;
  for (int i = 0; i < r->n_params; i++) {
    r->param_offsets[i] = model->param_offsets[i];
    r->params[i].data = model->params_flat + model->param_offsets[i];
    r->params[i].grad = r->grads_flat + model->param_offsets[i];
  }
  *out = r;
  return DDP_OK;
}
