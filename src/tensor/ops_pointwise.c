/* Elementwise ops: relu, sigmoid, tanh, dropout and dropout2d. Each validates,
 * computes through the pointwise kernel table and records its backward. The
 * activations' backward reads the op's output (y), which the tape keeps. */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/tape.h"

/* Validates a one-input float32 op and allocates its output (x's shape). */
static ddp_status unary_begin(ddp_tape *tape, const char *op, ddp_tensor *x, ddp_tensor **out,
                              const ddp__kernels **k, ddp_tensor **y) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "%s: tape or out is NULL", op);
  if (!x) return ddp_error(DDP_ERR_INVALID, "%s: input is NULL", op);
  DDP_TRY(ddp__kernels_check(op, 1, &x, k));
  return ddp__tape_output(tape, op, DDP_FLOAT32, x->ndim, x->shape, x->device, y);
}

/* ---- activations ---- */

typedef void (*activation_backward_fn)(float *dx, const float *dy, const float *y, int64_t n,
                                       bool accumulate);

static ddp_status activation_backward(ddp_tape *tape, ddp__node *node,
                                      activation_backward_fn kernel) {
  ddp_status s = DDP_OK;
  bool accumulate;
  float *dx = ddp__tape_grad_out(tape, node->in[0], &accumulate, &s);
  if (dx) kernel(dx, node->out->grad, node->out->data, node->out->numel, accumulate);
  return s;
}

static ddp_status relu_backward(ddp_tape *tape, ddp__node *node) {
  return activation_backward(tape, node,
                             ddp__kernels_for(node->out->device)->pointwise->relu_backward);
}

static ddp_status sigmoid_backward(ddp_tape *tape, ddp__node *node) {
  return activation_backward(tape, node,
                             ddp__kernels_for(node->out->device)->pointwise->sigmoid_backward);
}

static ddp_status tanh_backward(ddp_tape *tape, ddp__node *node) {
  return activation_backward(tape, node,
                             ddp__kernels_for(node->out->device)->pointwise->tanh_backward);
}

typedef enum activation { ACT_RELU, ACT_SIGMOID, ACT_TANH } activation;

static ddp_status activation_forward(ddp_tape *tape, activation act, ddp_tensor *x,
                                     ddp_tensor **out) {
  static const char *const names[] = {"relu", "sigmoid", "tanh"};
  static const ddp__backward_fn backwards[] = {relu_backward, sigmoid_backward, tanh_backward};
  const char *op = names[act];
  const ddp__kernels *k;
  ddp_tensor *y;
  DDP_TRY(unary_begin(tape, op, x, out, &k, &y));
  const ddp__pointwise_kernels *pw = k->pointwise;
  switch (act) {
  case ACT_RELU: pw->relu(y->data, x->data, x->numel); break;
  case ACT_SIGMOID: pw->sigmoid(y->data, x->data, x->numel); break;
  case ACT_TANH: pw->tanh(y->data, x->data, x->numel); break;
  }
  /* In x's precision under autocast (PyTorch runs them in their input's
   * dtype): relu of a low-precision value is one; the others round. */
  ddp__autocast_mark(y, ddp__low_dtype(x), act != ACT_RELU);
  if (ddp__tape_wants_grad(tape, 1, &x))
    DDP_TRY(ddp__tape_record(tape, op, backwards[act], y, 1, &x, NULL));
  *out = y;
  return DDP_OK;
}

ddp_status ddp_relu(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  return activation_forward(tape, ACT_RELU, x, out);
}

ddp_status ddp_sigmoid(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  return activation_forward(tape, ACT_SIGMOID, x, out);
}

ddp_status ddp_tanh(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  return activation_forward(tape, ACT_TANH, x, out);
}

/* ---- dropout ----
 * The mask (one byte per group, in tape scratch) is what backward needs:
 * dx = dy * mask * scale. A group is one element for dropout and one
 * feature map x[n, c, ...] for dropout2d. */

typedef struct dropout_ctx {
  uint8_t *mask; /* (groups) 1 keep, 0 drop */
  int64_t groups;
  int64_t group_size;
  float scale; /* 1/(1-p); 0 when p == 1 */
} dropout_ctx;

static ddp_status dropout_backward(ddp_tape *tape, ddp__node *node) {
  const dropout_ctx *ctx = node->ctx;
  ddp_status s = DDP_OK;
  float *dx = ddp__tape_grad(tape, node->in[0], &s);
  if (dx)
    ddp__kernels_for(node->out->device)
        ->pointwise->dropout_backward(dx, node->out->grad, ctx->mask, ctx->groups, ctx->group_size,
                                      ctx->scale);
  return s;
}

/* Shared by dropout (group_size 1) and dropout2d. `groups` is 0 for an
 * empty input. */
static ddp_status dropout_common(ddp_tape *tape, const char *op, ddp_tensor *x, float p,
                                 bool training, ddp_rng *rng, int64_t groups, int64_t group_size,
                                 ddp_tensor **out) {
  const ddp__kernels *k;
  ddp_tensor *y;
  /* Identity: a view of x (no copy), whose gradient passes straight through. */
  if (!training || p == 0.0f || x->numel == 0)
    return ddp__tape_make_view(tape, op, x, x->ndim, x->shape, out);
  if (!rng && p < 1.0f)
    return ddp_error(DDP_ERR_INVALID, "%s: training with p = %g needs an rng, got NULL", op,
                     (double)p);
  DDP_TRY(unary_begin(tape, op, x, out, &k, &y));
  dropout_ctx *ctx = ddp_tape_scratch(tape, sizeof *ctx);
  uint8_t *mask = ddp__tape_scratch_on(tape, x->device, (size_t)groups);
  if (!ctx || !mask)
    return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate a mask of %lld bytes", op,
                     (long long)groups);
  ctx->mask = mask;
  ctx->groups = groups;
  ctx->group_size = group_size;
  ctx->scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  k->pointwise->dropout_mask(mask, groups, p, rng);
  k->pointwise->dropout_apply(y->data, x->data, mask, groups, group_size, ctx->scale);
  ddp__autocast_mark(y, ddp__low_dtype(x), true); /* x's precision: x * scale rounded */
  if (ddp__tape_wants_grad(tape, 1, &x))
    DDP_TRY(ddp__tape_record(tape, op, dropout_backward, y, 1, &x, ctx));
  *out = y;
  return DDP_OK;
}

static ddp_status dropout_check(ddp_tape *tape, const char *op, ddp_tensor *x, float p,
                                ddp_tensor **out) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "%s: tape or out is NULL", op);
  if (!x) return ddp_error(DDP_ERR_INVALID, "%s: input is NULL", op);
  if (!(p >= 0.0f && p <= 1.0f))
    return ddp_error(DDP_ERR_RANGE, "%s: dropout probability must be in [0, 1], got %g", op,
                     (double)p);
  return DDP_OK;
}

ddp_status ddp_dropout(ddp_tape *tape, ddp_tensor *x, float p, bool training, ddp_rng *rng,
                       ddp_tensor **out) {
  DDP_TRY(dropout_check(tape, "dropout", x, p, out));
  return dropout_common(tape, "dropout", x, p, training, rng, x->numel, 1, out);
}

/* PyTorch 1.13's F.dropout2d is ATen's feature_dropout for every rank: the
 * noise has shape (shape[0], shape[1], 1, ...), so (N, C, H, W) drops whole
 * (n, c) maps, (N, C, L) whole rows of length L, and (N, F) single elements
 * (the same as dropout). Fewer than 2 dimensions is an error when a mask is
 * actually needed (training, 0 < p < 1), as in PyTorch. */
ddp_status ddp_dropout2d(ddp_tape *tape, ddp_tensor *x, float p, bool training, ddp_rng *rng,
                         ddp_tensor **out) {
  DDP_TRY(dropout_check(tape, "dropout2d", x, p, out));
  int64_t groups = 0, group_size = 0;
  if (training && p > 0.0f && p < 1.0f && x->ndim < 2) {
    char sx[DDP_SHAPE_STR_BYTES];
    return ddp_error(DDP_ERR_SHAPE,
                     "dropout2d: input %s has %d dimension(s); channel dropout needs at least 2 "
                     "(N, C, ...)",
                     ddp_tensor_shape_str(x, sx, sizeof sx), x->ndim);
  }
  if (x->ndim >= 2 && x->numel > 0) {
    groups = x->shape[0] * x->shape[1];
    group_size = x->numel / groups;
  } else if (x->numel > 0) {
    groups = 1; /* p == 1 on a 0-D/1-D input: everything is one group, zeroed */
    group_size = x->numel;
  }
  return dropout_common(tape, "dropout2d", x, p, training, rng, groups, group_size, out);
}
