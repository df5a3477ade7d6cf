/* The trainer on a GPU: batches come from the loader in host memory and are
 * copied into device buffers kept for the run (grown, never shrunk)
 * through two pinned staging buffers in turn, asynchronously (the issue's
 * "the loader fills pinned batches and copies them asynchronously": the
 * host goes on queueing the step while the batch crosses), and the few
 * values the loop reads (the loss, evaluation's outputs) come back. Each
 * copy back waits for the device, as PyTorch's loss.item() does. */
#include "train/train_internal.h"

/* Makes *buf a device tensor of at least `numel` elements of dtype. */
static ddp_status ensure(ddp_tensor **buf, ddp_dtype dtype, int64_t numel, ddp_device device) {
  if (*buf && (*buf)->numel >= numel) return DDP_OK;
  ddp_tensor_destroy(*buf);
  *buf = NULL;
  return ddp_tensor_create_on(buf, dtype, 1, &numel, device);
}

/* A view of `buf`'s memory shaped as `like`. */
static ddp_status view_as(ddp_tensor *view, const ddp_tensor *buf, const ddp_tensor *like) {
  DDP_TRY(ddp_tensor_wrap(view, like->dtype, like->ndim, like->shape, buf->data));
  view->device = buf->device;
  return DDP_OK;
}

ddp_status ddp__train_batch_to(ddp_trainer *t, ddp_batch *b, ddp_tensor *x, ddp_tensor *y) {
  if (!t->stage) DDP_TRY(ddp_device_stage_create(t->o.device, &t->stage));
  void *dst[2] = {x->data, y->data};
  const void *src[2] = {b->x.data, b->y.data};
  size_t bytes[2] = {(size_t)b->x.numel * ddp_dtype_size(b->x.dtype),
                     (size_t)b->y.numel * ddp_dtype_size(b->y.dtype)};
  return ddp_device_stage_upload(t->stage, 2, dst, src, bytes);
}

ddp_status ddp__train_batch_on_device(ddp_trainer *t, ddp_batch *b, ddp_tensor *x, ddp_tensor *y) {
  if (t->o.device.type == DDP_DEVICE_CPU) {
    *x = b->x;
    *y = b->y;
    return DDP_OK;
  }
  DDP_TRY(ensure(&t->device_x, b->x.dtype, b->x.numel, t->o.device));
  DDP_TRY(ensure(&t->device_y, b->y.dtype, b->y.numel, t->o.device));
  DDP_TRY(view_as(x, t->device_x, &b->x));
  DDP_TRY(view_as(y, t->device_y, &b->y));
  return ddp__train_batch_to(t, b, x, y);
}

ddp_status ddp__train_scalar(const ddp_tensor *t, float *value) {
  if (t->device.type == DDP_DEVICE_CPU) {
    *value = ddp_tensor_f32(t)[0];
    return DDP_OK;
  }
  int64_t one = 1;
  ddp_tensor host;
  DDP_TRY(ddp_tensor_wrap(&host, DDP_FLOAT32, 1, &one, value));
  ddp_tensor dev;
  DDP_TRY(ddp_tensor_wrap(&dev, DDP_FLOAT32, 1, &one, t->data));
  dev.device = t->device;
  return ddp_tensor_copy(&host, &dev);
}

ddp_status ddp__train_host_view(const ddp_tensor *t, float *host, const float **data) {
  if (t->device.type == DDP_DEVICE_CPU) {
    *data = ddp_tensor_f32(t);
    return DDP_OK;
  }
  ddp_tensor h, d;
  DDP_TRY(ddp_tensor_wrap(&h, DDP_FLOAT32, 1, &t->numel, host));
  DDP_TRY(ddp_tensor_wrap(&d, DDP_FLOAT32, 1, &t->numel, t->data));
  d.device = t->device;
  DDP_TRY(ddp_tensor_copy(&h, &d));
  *data = host;
  return DDP_OK;
}

void ddp__train_device_free(ddp_trainer *t) {
  ddp_device_stage_destroy(t->stage); /* waits for its copies into the buffers */
  t->stage = NULL;
  ddp_tensor_destroy(t->device_x);
  ddp_tensor_destroy(t->device_y);
  t->device_x = t->device_y = NULL;
}
