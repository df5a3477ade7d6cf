/* Device -> kernel table. CPU always; CUDA in a CUDA build (DDP_HAVE_CUDA),
 * where choosing a GPU's table also makes that GPU current for the calling
 * thread, so the kernels run on its stream (src/tensor/cuda/runtime.h). */
#include "tensor/kernels.h"
#include "tensor/tape.h"
#ifdef DDP_HAVE_CUDA
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/runtime.h"

static const ddp__kernels cuda_kernels = {
    .name = "cuda",
    .basic = &ddp__cuda_basic_kernels,
    .dense = &ddp__cuda_dense_kernels,
    .pointwise = &ddp__cuda_pointwise_kernels,
};
#endif

static const ddp__kernels cpu_kernels = {
    .name = "cpu",
    .basic = &ddp__cpu_basic_kernels,
    .dense = &ddp__cpu_dense_kernels,
    .pointwise = &ddp__cpu_pointwise_kernels,
};

const ddp__kernels *ddp__kernels_for(ddp_device device) {
  switch (device.type) {
  case DDP_DEVICE_CPU: return &cpu_kernels;
#ifdef DDP_HAVE_CUDA
  case DDP_DEVICE_CUDA:
    return device.index >= 0 && device.index < ddp__cuda_device_count() &&
                   ddp__cuda_set_device(device.index) == DDP_OK
               ? &cuda_kernels
               : NULL;
#endif
  default: return NULL;
  }
}

const ddp__basic_kernels *ddp__basic_kernels_for(ddp_device device) {
  const ddp__kernels *k = ddp__kernels_for(device);
  return k ? k->basic : NULL;
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
  if (!*k) {
    ddp_status s = ddp_device_check(first->device); /* says why: no backend, no such GPU */
    char name[DDP_DEVICE_STR_BYTES];
    return ddp_error_wrap(s != DDP_OK ? s : DDP_ERR_UNSUPPORTED, "%s: no kernels for %s", op,
                          ddp_device_str(first->device, name, sizeof name));
  }
  return DDP_OK;
}
