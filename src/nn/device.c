/* A model on a device (model.to(device)): the three flat buffers move as
 * wholes, and every parameter and buffer tensor is re-pointed into the new
 * ones, so offsets, names and the state dict stay what they were. */
#include "nn/module.h"

ddp_device ddp_model_device(const ddp_model *model) { return model->device; }

/* A new buffer of n floats on `device` holding `from`'s n floats (on
 * `from_device`): a device tensor that owns it, or NULL on the CPU side
 * (*host, from ddp_alloc). */
static ddp_status move_flat(const float *from, ddp_device from_device, int64_t n,
                            ddp_device device, ddp_tensor **owner, float **data) {
  int64_t len = n ? n : 1;
  ddp_tensor src;
  DDP_TRY(ddp_tensor_wrap(&src, DDP_FLOAT32, 1, &len, (void *)from));
  src.device = from_device;
  *owner = NULL;
  if (device.type == DDP_DEVICE_CPU) {
    ddp_tensor dst;
    float *host = ddp_calloc((size_t)len, sizeof(float));
    if (!host) return ddp_error(DDP_ERR_NOMEM, "cannot allocate %lld floats", (long long)len);
    DDP_TRY(ddp_tensor_wrap(&dst, DDP_FLOAT32, 1, &len, host));
    ddp_status s = ddp_tensor_copy(&dst, &src);
    if (s != DDP_OK) {
      ddp_free(host);
      return s;
    }
    *data = host;
    return DDP_OK;
  }
  DDP_TRY(ddp_tensor_create_on(owner, DDP_FLOAT32, 1, &len, device));
  ddp_status s = ddp_tensor_copy(*owner, &src);
  if (s != DDP_OK) {
    ddp_tensor_destroy(*owner);
    *owner = NULL;
    return s;
  }
  *data = (*owner)->data;
  return DDP_OK;
}

ddp_status ddp_model_to(ddp_model *model, ddp_device device) {
  char name[DDP_DEVICE_STR_BYTES];
  if (!model || !model->finalized)
    return ddp_error(DDP_ERR_STATE, "nn: to: the model must be finalized first");
  if (ddp_device_equal(model->device, device)) return DDP_OK;
  if (model->params_borrowed || model->has_replicas)
    return ddp_error(DDP_ERR_STATE, "nn: to(%s): the model's parameters are %s",
                     ddp_device_str(device, name, sizeof name),
                     model->params_borrowed ? "another model's (a replica)"
                                            : "read in place by replicas (DataParallel)");
  ddp_status s = ddp_device_check(device);
  if (s != DDP_OK) return ddp_error_wrap(s, "nn: to(%s)", ddp_device_str(device, name, sizeof name));
  float *const old[3] = {model->params_flat, model->grads_flat, model->buffers_flat};
  const int64_t n[3] = {model->n_param_elems, model->n_param_elems, model->n_buffer_elems};
  ddp_tensor *owner[3] = {NULL, NULL, NULL};
  float *fresh[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3 && s == DDP_OK; i++)
    s = move_flat(old[i], model->device, n[i], device, &owner[i], &fresh[i]);
  if (s == DDP_OK) s = ddp_device_synchronize(device);
  if (s != DDP_OK) { /* nothing changed: drop what was made */
    for (int i = 0; i < 3; i++) {
      if (owner[i])
        ddp_tensor_destroy(owner[i]);
      else if (device.type == DDP_DEVICE_CPU)
        ddp_free(fresh[i]);
    }
    return ddp_error_wrap(s, "nn: to(%s)", ddp_device_str(device, name, sizeof name));
  }
  for (int i = 0; i < model->n_params; i++) {
    ddp_tensor *t = &model->params[i];
    t->data = fresh[0] + model->param_offsets[i];
    t->grad = fresh[1] + model->param_offsets[i];
    t->device = device;
  }
  for (int i = 0; i < model->n_buffers; i++) {
    ddp_tensor *t = &model->buffers[i];
    t->data = fresh[2] + ((float *)t->data - model->buffers_flat);
    t->device = device;
  }
  for (int i = 0; i < 3; i++) {
    if (model->device.type == DDP_DEVICE_CPU) ddp_free(old[i]);
    ddp_tensor_destroy(model->device_flat[i]);
    model->device_flat[i] = owner[i];
  }
  model->params_flat = fresh[0];
  model->grads_flat = fresh[1];
  model->buffers_flat = fresh[2];
  model->device = device;
  return DDP_OK;
}
