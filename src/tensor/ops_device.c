/* ddp_to: moving a tensor between devices inside the graph. The forward
 * copies x to the device; the backward copies the gradient back to x's
 * device and adds it there. Both copies go through ddp_tensor_copy, so
 * the tensor layer has one place that knows how devices exchange memory. */
#include "tensor/kernels.h"
#include "tensor/tape.h"

/* A view descriptor of n floats at `data` on `device`, for ddp_tensor_copy. */
static ddp_tensor flat_view(float *data, int64_t n, ddp_device device) {
  ddp_tensor t;
  ddp_tensor_wrap(&t, DDP_FLOAT32, 1, &n, data);
  t.device = device;
  return t;
}

static ddp_status to_backward(ddp_tape *tape, ddp__node *node) {
  ddp_tensor *x = node->in[0], *y = node->out;
  ddp_status s = DDP_OK;
  bool accumulate;
  float *dx = ddp__tape_grad_out(tape, x, &accumulate, &s);
  if (!dx) return s;
  if (!accumulate) { /* a fresh buffer: the copy is the gradient */
    ddp_tensor to = flat_view(dx, x->numel, x->device), from = flat_view(y->grad, y->numel, y->device);
    return ddp_tensor_copy(&to, &from);
  }
  float *tmp = ddp__tape_scratch_on(tape, x->device, (size_t)x->numel * sizeof(float));
  if (!tmp) return ddp_error_wrap(DDP_ERR_NOMEM, "to: no room for the gradient on x's device");
  ddp_tensor to = flat_view(tmp, x->numel, x->device), from = flat_view(y->grad, y->numel, y->device);
  DDP_TRY(ddp_tensor_copy(&to, &from));
  ddp__kernels_for(x->device)->basic->axpy(dx, 1.0f, tmp, x->numel);
  return DDP_OK;
}

ddp_status ddp_to(ddp_tape *tape, ddp_tensor *x, ddp_device device, ddp_tensor **out) {
  if (!tape || !x || !out) return ddp_error(DDP_ERR_INVALID, "to: tape, x or out is NULL");
  if (ddp_device_equal(x->device, device)) {
    *out = x;
    return DDP_OK;
  }
  char name[DDP_DEVICE_STR_BYTES];
  ddp_status s = ddp_device_check(device);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "to(%s)", ddp_device_str(device, name, sizeof name));
  if (!x->data && x->numel) return ddp_error(DDP_ERR_INVALID, "to: x has no data");
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "to", x->dtype, x->ndim, x->shape, device, &y));
  s = ddp_tensor_copy(y, x);
  if (s != DDP_OK) return ddp_error_wrap(s, "to(%s)", ddp_device_str(device, name, sizeof name));
  if (x->dtype == DDP_FLOAT32 && ddp__tape_wants_grad(tape, 1, &x))
    DDP_TRY(ddp__tape_record(tape, "to", to_backward, y, 1, &x, NULL));
  *out = y;
  return DDP_OK;
}
