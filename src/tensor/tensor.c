/* Tensor descriptors: dtypes, shapes, heap and device tensors, caller-memory
 * views, and copies between devices. Device memory goes through
 * device_internal.h; the CPU paths stay the heap's. */
#include <stdio.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/device_internal.h"

size_t ddp_dtype_size(ddp_dtype dtype) {
  switch (dtype) {
  case DDP_FLOAT32: return 4;
  case DDP_FLOAT64: return 8;
  case DDP_INT32: return 4;
  case DDP_INT64: return 8;
  case DDP_FLOAT16: return 2;
  case DDP_BFLOAT16: return 2;
  case DDP_UINT8: return 1;
  default: return 0;
  }
}

const char *ddp_dtype_name(ddp_dtype dtype) {
  static const char *names[] = {"float32", "float64", "int32", "int64",
                                "float16", "bfloat16", "uint8"};
  return (unsigned)dtype < DDP_DTYPE_COUNT ? names[dtype] : "invalid-dtype";
}

const char *ddp_tensor_shape_str(const ddp_tensor *t, char *buf, size_t bytes) {
  size_t n = 0;
  n += (size_t)snprintf(buf + n, bytes - n, "(");
  for (int i = 0; i < t->ndim && n < bytes; i++)
    n += (size_t)snprintf(buf + n, bytes - n, i ? ",%lld" : "%lld", (long long)t->shape[i]);
  if (n < bytes) snprintf(buf + n, bytes - n, ")");
  return buf;
}

bool ddp_tensor_same_shape(const ddp_tensor *a, const ddp_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* Validates a shape and computes its element count. */
static ddp_status shape_numel(ddp_dtype dtype, int ndim, const int64_t *shape, int64_t *numel) {
  if ((unsigned)dtype >= DDP_DTYPE_COUNT)
    return ddp_error(DDP_ERR_INVALID, "tensor: invalid dtype %d", (int)dtype);
  if (ndim < 0 || ndim > DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_INVALID, "tensor: %d dimensions (at most %d)", ndim, DDP_MAX_DIMS);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return ddp_error(DDP_ERR_INVALID, "tensor: dimension %d has negative size %lld", i,
                       (long long)shape[i]);
    if (shape[i] && n > INT64_MAX / 8 / shape[i])
      return ddp_error(DDP_ERR_RANGE, "tensor: shape too large");
    n *= shape[i];
  }
  *numel = n;
  return DDP_OK;
}

ddp_status ddp_tensor_wrap(ddp_tensor *t, ddp_dtype dtype, int ndim, const int64_t *shape,
                           void *data) {
  int64_t numel;
  DDP_TRY(shape_numel(dtype, ndim, shape, &numel));
  memset(t, 0, sizeof *t);
  t->dtype = dtype;
  t->device = DDP_CPU;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->numel = numel;
  t->data = data;
  t->param_index = -1;
  t->node = -1;
  return DDP_OK;
}

ddp_status ddp_tensor_create(ddp_tensor **out, ddp_dtype dtype, int ndim, const int64_t *shape) {
  *out = NULL;
  int64_t numel;
  DDP_TRY(shape_numel(dtype, ndim, shape, &numel));
  ddp_tensor *t = ddp_alloc(sizeof *t);
  void *data = ddp_calloc((size_t)numel ? (size_t)numel : 1, ddp_dtype_size(dtype));
  if (!t || !data) {
    ddp_free(t);
    ddp_free(data);
    return ddp_error(DDP_ERR_NOMEM, "tensor: cannot allocate %lld elements", (long long)numel);
  }
  ddp_tensor_wrap(t, dtype, ndim, shape, data);
  t->flags |= DDP_TENSOR_OWNS_DATA;
  *out = t;
  return DDP_OK;
}

ddp_status ddp_tensor_create_on(ddp_tensor **out, ddp_dtype dtype, int ndim,
                                const int64_t *shape, ddp_device device) {
  if (device.type == DDP_DEVICE_CPU && device.index == 0)
    return ddp_tensor_create(out, dtype, ndim, shape);
  *out = NULL;
  int64_t numel;
  DDP_TRY(shape_numel(dtype, ndim, shape, &numel));
  char name[DDP_DEVICE_STR_BYTES];
  ddp_device_str(device, name, sizeof name);
  ddp_status st = ddp_device_check(device);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "tensor: cannot create %lld elements on %s", (long long)numel,
                          name);
  ddp_tensor *t = ddp_alloc(sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "tensor: cannot allocate a tensor struct");
  void *data;
  st = ddp__device_calloc(device, (size_t)numel * ddp_dtype_size(dtype), &data);
  if (st != DDP_OK) {
    ddp_free(t);
    return ddp_error_wrap(st, "tensor: cannot allocate %lld elements on %s", (long long)numel,
                          name);
  }
  ddp_tensor_wrap(t, dtype, ndim, shape, data);
  t->device = device;
  t->flags |= DDP_TENSOR_OWNS_DATA;
  *out = t;
  return DDP_OK;
}

ddp_status ddp_tensor_ensure_grad(ddp_tensor *t) {
  if (t->grad) return DDP_OK;
  if (t->device.type != DDP_DEVICE_CPU) {
    void *grad;
    ddp_status st = ddp__device_calloc(t->device, (size_t)t->numel * sizeof(float), &grad);
    if (st != DDP_OK) {
      char name[DDP_DEVICE_STR_BYTES];
      return ddp_error_wrap(st, "tensor: cannot allocate a gradient of %lld elements on %s",
                            (long long)t->numel, ddp_device_str(t->device, name, sizeof name));
    }
    t->grad = grad;
    t->flags |= DDP_TENSOR_OWNS_GRAD;
    return DDP_OK;
  }
  t->grad = ddp_calloc((size_t)t->numel ? (size_t)t->numel : 1, sizeof(float));
  if (!t->grad)
    return ddp_error(DDP_ERR_NOMEM, "tensor: cannot allocate a gradient of %lld elements",
                     (long long)t->numel);
  t->flags |= DDP_TENSOR_OWNS_GRAD;
  return DDP_OK;
}

void ddp_tensor_free_grad(ddp_tensor *t) {
  if (t->flags & DDP_TENSOR_OWNS_GRAD) {
    if (t->device.type == DDP_DEVICE_CPU)
      ddp_free(t->grad);
    else
      ddp__device_free(t->device, t->grad);
  }
  t->grad = NULL;
  t->flags &= ~DDP_TENSOR_OWNS_GRAD;
}

void ddp_tensor_destroy(ddp_tensor *t) {
  if (!t) return;
  ddp_tensor_free_grad(t);
  if (t->flags & DDP_TENSOR_OWNS_DATA) {
    if (t->device.type == DDP_DEVICE_CPU)
      ddp_free(t->data);
    else
      ddp__device_free(t->device, t->data);
    ddp_free(t);
  }
}

/* "float32 (2,3) on cuda:0" for copy errors. */
static const char *tensor_desc(const ddp_tensor *t, char *buf, size_t bytes) {
  char shape[128], device[DDP_DEVICE_STR_BYTES];
  snprintf(buf, bytes, "%s %s on %s", ddp_dtype_name(t->dtype),
           ddp_tensor_shape_str(t, shape, sizeof shape),
           ddp_device_str(t->device, device, sizeof device));
  return buf;
}

ddp_status ddp_device_copy(ddp_device dst_device, void *dst, ddp_device src_device,
                           const void *src, size_t bytes) {
  if (bytes == 0) return DDP_OK;
  if (!dst || !src)
    return ddp_error(DDP_ERR_INVALID, "device_copy: %s is NULL (%zu bytes)",
                     src ? "the destination" : "the source", bytes);
  if (dst_device.type == DDP_DEVICE_CPU && src_device.type == DDP_DEVICE_CPU) {
    memcpy(dst, src, bytes);
    return DDP_OK;
  }
  ddp_status st = ddp_device_check(src_device);
  if (st == DDP_OK) st = ddp_device_check(dst_device);
  if (st == DDP_OK) st = ddp__device_copy(dst_device, dst, src_device, src, bytes);
  if (st != DDP_OK) {
    char a[32], b[32];
    return ddp_error_wrap(st, "device_copy: %zu bytes from %s to %s", bytes,
                          ddp_device_str(src_device, a, sizeof a),
                          ddp_device_str(dst_device, b, sizeof b));
  }
  return DDP_OK;
}

ddp_status ddp_tensor_copy(ddp_tensor *dst, const ddp_tensor *src) {
  char a[192], b[192];
  if (dst->dtype != src->dtype || dst->numel != src->numel)
    return ddp_error(DDP_ERR_SHAPE, "tensor_copy: from %s to %s: %s", tensor_desc(src, a, sizeof a),
                     tensor_desc(dst, b, sizeof b),
                     dst->dtype != src->dtype ? "different dtypes" : "different element counts");
  size_t bytes = (size_t)src->numel * ddp_dtype_size(src->dtype);
  if (bytes == 0) return DDP_OK;
  if (!dst->data || !src->data)
    return ddp_error(DDP_ERR_INVALID, "tensor_copy: from %s to %s: %s has no data",
                     tensor_desc(src, a, sizeof a), tensor_desc(dst, b, sizeof b),
                     src->data ? "the destination" : "the source");
  ddp_status st = ddp_device_check(src->device);
  if (st == DDP_OK) st = ddp_device_check(dst->device);
  if (st == DDP_OK)
    st = ddp__device_copy(dst->device, dst->data, src->device, src->data, bytes);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "tensor_copy: from %s to %s", tensor_desc(src, a, sizeof a),
                          tensor_desc(dst, b, sizeof b));
  return DDP_OK;
}
