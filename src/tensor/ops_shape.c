/* Elementwise add and the shape ops (reshape, flatten). These are also the
 * worked example of how an op validates, computes through the kernel table,
 * and records its backward on the tape. */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/tape.h"

/* ---- add ---- */

static ddp_status add_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const float *dy = node->out->grad;
  ddp_status s = DDP_OK;
  for (int i = 0; i < 2; i++) {
    float *dx = ddp__tape_grad(tape, node->in[i], &s);
    if (dx) k->basic->axpy(dx, 1.0f, dy, node->out->numel);
    if (s != DDP_OK) return s;
  }
  return DDP_OK;
}

ddp_status ddp_add(ddp_tape *tape, ddp_tensor *a, ddp_tensor *b, ddp_tensor **out) {
  ddp_tensor *in[2] = {a, b};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("add", 2, in, &k));
  if (!a || !b || !ddp_tensor_same_shape(a, b)) {
    char sa[DDP_SHAPE_STR_BYTES], sb[DDP_SHAPE_STR_BYTES];
    return ddp_error(DDP_ERR_SHAPE, "add: shapes differ: %s and %s",
                     a ? ddp_tensor_shape_str(a, sa, sizeof sa) : "NULL",
                     b ? ddp_tensor_shape_str(b, sb, sizeof sb) : "NULL");
  }
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "add", DDP_FLOAT32, a->ndim, a->shape, a->device, &y));
  k->basic->add(y->data, a->data, b->data, a->numel);
  /* Type promotion: low only when both are (the same) low; then rounded. */
  ddp__autocast_mark(y, ddp__autocast_promote(2, in), true);
  if (ddp__tape_wants_grad(tape, 2, in))
    DDP_TRY(ddp__tape_record(tape, "add", add_backward, y, 2, in, NULL));
  *out = y;
  return DDP_OK;
}

/* ---- reshape / flatten: views whose backward passes the gradient through ---- */

/* The view's gradient has the input's elements in the input's order, so
 * when this view is the input's only consumer left to run backward and no
 * gradient of the input exists yet, the input's gradient IS the view's: it
 * is handed over, not copied (a reshape before a linear layer would
 * otherwise cost a zeroed buffer and an add of its size every step). */
static ddp_status view_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  ddp_tensor *x = node->in[0];
  if (x->node >= 0 && !x->grad && x->pending == 1 && (x->flags & DDP_TENSOR_REQUIRES_GRAD) &&
      x->dtype == DDP_FLOAT32) {
    x->grad = node->out->grad;
    return DDP_OK;
  }
  ddp_status s = DDP_OK;
  float *dx = ddp__tape_grad(tape, node->in[0], &s);
  if (dx) k->basic->axpy(dx, 1.0f, node->out->grad, node->out->numel);
  return s;
}

ddp_status ddp__tape_make_view(ddp_tape *tape, const char *op, ddp_tensor *x, int ndim,
                              const int64_t *shape, ddp_tensor **out) {
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check(op, 1, &x, &k));
  ddp_tensor *y;
  DDP_TRY(ddp__tape_view(tape, op, x, ndim, shape, &y));
  if (ddp__tape_wants_grad(tape, 1, &x))
    DDP_TRY(ddp__tape_record(tape, op, view_backward, y, 1, &x, NULL));
  *out = y;
  return DDP_OK;
}

ddp_status ddp_reshape(ddp_tape *tape, ddp_tensor *x, int ndim, const int64_t *shape,
                       ddp_tensor **out) {
  char sx[DDP_SHAPE_STR_BYTES];
  if (!x) return ddp_error(DDP_ERR_INVALID, "reshape: input is NULL");
  if (ndim < 0 || ndim > DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_INVALID, "reshape: %d dimensions (at most %d)", ndim, DDP_MAX_DIMS);
  int64_t resolved[DDP_MAX_DIMS], known = 1;
  int infer = -1;
  for (int i = 0; i < ndim; i++) {
    resolved[i] = shape[i];
    if (shape[i] == -1) {
      if (infer >= 0) return ddp_error(DDP_ERR_INVALID, "reshape: more than one -1 in the shape");
      infer = i;
    } else if (shape[i] < 0) {
      return ddp_error(DDP_ERR_INVALID, "reshape: dimension %d is %lld", i, (long long)shape[i]);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || x->numel % known != 0)
      return ddp_error(DDP_ERR_SHAPE, "reshape: cannot infer dimension %d for %s (%lld elements)",
                       infer, ddp_tensor_shape_str(x, sx, sizeof sx), (long long)x->numel);
    resolved[infer] = x->numel / known;
    known *= resolved[infer];
  }
  if (known != x->numel)
    return ddp_error(DDP_ERR_SHAPE, "reshape: %s has %lld elements, the new shape %lld",
                     ddp_tensor_shape_str(x, sx, sizeof sx), (long long)x->numel,
                     (long long)known);
  return ddp__tape_make_view(tape, "reshape", x, ndim, resolved, out);
}

ddp_status ddp_flatten(ddp_tape *tape, ddp_tensor *x, int start_dim, ddp_tensor **out) {
  if (!x) return ddp_error(DDP_ERR_INVALID, "flatten: input is NULL");
  if (start_dim < 0) start_dim += x->ndim;
  if (start_dim < 0 || start_dim >= (x->ndim ? x->ndim : 1))
    return ddp_error(DDP_ERR_INVALID, "flatten: start_dim %d out of range for %d dimensions",
                     start_dim, x->ndim);
  int64_t shape[DDP_MAX_DIMS];
  int64_t rest = 1;
  for (int i = 0; i < start_dim; i++) shape[i] = x->shape[i];
  for (int i = start_dim; i < x->ndim; i++) rest *= x->shape[i];
  shape[start_dim] = rest;
  return ddp__tape_make_view(tape, "flatten", x, start_dim + 1, shape, out);
}
