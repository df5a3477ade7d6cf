/* Tensor descriptors: dtypes, shapes, heap tensors and caller-memory views. */
#include <stdio.h>
#include <string.h>

#include "ddp/tensor.h"

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

ddp_status ddp_tensor_ensure_grad(ddp_tensor *t) {
  if (t->grad) return DDP_OK;
  t->grad = ddp_calloc((size_t)t->numel ? (size_t)t->numel : 1, sizeof(float));
  if (!t->grad)
    return ddp_error(DDP_ERR_NOMEM, "tensor: cannot allocate a gradient of %lld elements",
                     (long long)t->numel);
  t->flags |= DDP_TENSOR_OWNS_GRAD;
  return DDP_OK;
}

void ddp_tensor_free_grad(ddp_tensor *t) {
  if (t->flags & DDP_TENSOR_OWNS_GRAD) ddp_free(t->grad);
  t->grad = NULL;
  t->flags &= ~DDP_TENSOR_OWNS_GRAD;
}

void ddp_tensor_destroy(ddp_tensor *t) {
  if (!t) return;
  ddp_tensor_free_grad(t);
  if (t->flags & DDP_TENSOR_OWNS_DATA) {
    ddp_free(t->data);
    ddp_free(t);
  }
}
