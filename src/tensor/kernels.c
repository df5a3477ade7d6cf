/* Device -> kernel table. CPU always; CUDA when built with it (later). */
#include "tensor/kernels.h"

static const ddp__kernels cpu_kernels = {
    .name = "cpu",
    .basic = &ddp__cpu_basic_kernels,
    .dense = &ddp__cpu_dense_kernels,
    .pointwise = &ddp__cpu_pointwise_kernels,
};

const ddp__kernels *ddp__kernels_for(ddp_device device) {
  switch (device.type) {
  case DDP_DEVICE_CPU: return &cpu_kernels;
  default: return NULL;
  }
}

ddp_status ddp__kernels_check(const char *op, int n, ddp_tensor *const *tensors,
                              const ddp__kernels **k) {
  const ddp_tensor *first = NULL;
  for (int i = 0; i < n; i++) {
    const ddp_tensor *t = tensors[i];
    if (!t) continue;
    if (t->dtype != DDP_FLOAT32)
      return ddp_error(DDP_ERR_INVALID, "%s: argument %d is %s, expected float32", op, i,
                       ddp_dtype_name(t->dtype));
    if (!t->data && t->numel)
      return ddp_error(DDP_ERR_INVALID, "%s: argument %d has no data", op, i);
    if (!first)
      first = t;
    else if (t->device.type != first->device.type || t->device.index != first->device.index)
      return ddp_error(DDP_ERR_INVALID, "%s: arguments are on different devices", op);
  }
  if (!first) return ddp_error(DDP_ERR_INVALID, "%s: no input tensor", op);
  *k = ddp__kernels_for(first->device);
  if (!*k)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: no kernels for device type %d in this build", op,
                     (int)first->device.type);
  return DDP_OK;
}
