/* Dense ops: matmul, linear and max_pool2d (conv2d is in ops_conv.c). Each
 * validates its arguments with a message naming the op and the shapes,
 * computes through the device's dense kernel table, and records a backward
 * that accumulates into the gradients of the inputs that require grad (or
 * assigns, when it is first to write a fresh one: ddp__tape_grad_out). */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/ops_fused.h"
#include "tensor/tape.h"


/* ---- matmul: a (M, K) @ b (K, N) -> (M, N) ---- */

static ddp_status matmul_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  ddp_tensor *a = node->in[0], *b = node->in[1];
  const int64_t m = a->shape[0], inner = a->shape[1], n = b->shape[1];
  const float *dy = node->out->grad; /* (M, N) */
  ddp_status s = DDP_OK;
  float *da = ddp__tape_grad(tape, a, &s);
  if (s != DDP_OK) return s;
  if (da) /* da (M, K) += dy (M, N) @ b^T (N, K) */
    k->dense->gemm(false, true, m, inner, n, 1.0f, dy, n, b->data, n, 1.0f, da, inner);
  float *db = ddp__tape_grad(tape, b, &s);
  if (s != DDP_OK) return s;
  if (db) /* db (K, N) += a^T (K, M) @ dy (M, N) */
    k->dense->gemm(true, false, inner, n, m, 1.0f, a->data, inner, dy, n, 1.0f, db, n);
  return DDP_OK;
}

/* matmul recorded under autocast (ctx: its ddp_dtype): the products of
 * rounded operands and the rounded gradient, each result rounded. */
static ddp_status matmul_low_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const ddp_dtype low = *(const ddp_dtype *)node->ctx;
  ddp_tensor *a = node->in[0], *b = node->in[1];
  const int64_t m = a->shape[0], inner = a->shape[1], n = b->shape[1];
  ddp_status s = DDP_OK;
  const float *dy = ddp__autocast_round_grad(tape, node->out, low, &s);
  if (s == DDP_OK && k->dense->gemm_low) { /* a GPU: 16-bit operands, tensor cores */
    const bool bf16 = low == DDP_BFLOAT16;
    const uint16_t *dy16 = ddp__autocast_half(tape, node->out, dy, low, false, &s);
    const uint16_t *a16 = s == DDP_OK ? ddp__autocast_half(tape, a, NULL, low, false, &s) : NULL;
    const uint16_t *b16 = s == DDP_OK ? ddp__autocast_half(tape, b, NULL, low, false, &s) : NULL;
    float *da = s == DDP_OK ? ddp__autocast_grad_scratch(tape, a, false, &s) : NULL;
    float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, false, &s) : NULL;
    if (s != DDP_OK) return s;
    if (da) DDP_TRY(k->dense->gemm_low(bf16, false, true, m, inner, n, dy16, n, b16, n, 0.0f, da, inner));
    if (db) DDP_TRY(k->dense->gemm_low(bf16, true, false, inner, n, m, a16, inner, dy16, n, 0.0f, db, n));
    DDP_TRY(ddp__autocast_grad_deliver(tape, a, da, low));
    return ddp__autocast_grad_deliver(tape, b, db, low);
  }
  const float *ar = s == DDP_OK ? ddp__autocast_operand(tape, a, low, false, &s) : NULL;
  const float *br = s == DDP_OK ? ddp__autocast_operand(tape, b, low, false, &s) : NULL;
  /* zeroed: a gemm with beta 0 may still read c (0 * NaN garbage) */
  float *da = s == DDP_OK ? ddp__autocast_grad_scratch(tape, a, true, &s) : NULL;
  float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, true, &s) : NULL;
  if (s != DDP_OK) return s;
  if (da) k->dense->gemm(false, true, m, inner, n, 1.0f, dy, n, br, n, 0.0f, da, inner);
  if (db) k->dense->gemm(true, false, inner, n, m, 1.0f, ar, inner, dy, n, 0.0f, db, n);
  DDP_TRY(ddp__autocast_grad_deliver(tape, a, da, low));
  return ddp__autocast_grad_deliver(tape, b, db, low);
}

/* Whether a bfloat16 op runs on the device's bfloat16 dot products
 * (docs/tensor.md, "CPU kernels under autocast"), else on rounded float32
 * operands and the float32 kernels. */
static bool bf16_dot(const ddp__kernels *k, ddp_dtype low) {
  return low == DDP_BFLOAT16 && k->dense->gemm_bf16 && k->dense->has_bf16_dot();
}

/* Saves an autocast op's dtype for its backward (tape scratch). */
static ddp_dtype *save_low(ddp_tape *tape, const char *op, ddp_dtype low, ddp_status *s) {
  ddp_dtype *saved = ddp_tape_scratch(tape, sizeof *saved);
  if (!saved) *s = ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate its backward's context", op);
  else *saved = low;
  return saved;
}

ddp_status ddp_matmul(ddp_tape *tape, ddp_tensor *a, ddp_tensor *b, ddp_tensor **out) {
  char sa[DDP_SHAPE_STR_BYTES], sb[DDP_SHAPE_STR_BYTES];
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "matmul: tape or out is NULL");
  if (!a || !b)
    return ddp_error(DDP_ERR_INVALID, "matmul: %s is NULL (a %s, b %s)", a ? "b" : "a",
                     DDP__SHAPE(a, sa), DDP__SHAPE(b, sb));
  ddp_tensor *in[2] = {a, b};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("matmul", 2, in, &k));
  if (a->ndim != 2 || b->ndim != 2)
    return ddp_error(DDP_ERR_SHAPE, "matmul: expects 2-D tensors, got a %s and b %s",
                     DDP__SHAPE(a, sa), DDP__SHAPE(b, sb));
  if (a->shape[1] != b->shape[0])
    return ddp_error(DDP_ERR_SHAPE,
                     "matmul: a %s and b %s cannot be multiplied (%lld columns vs %lld rows)",
                     DDP__SHAPE(a, sa), DDP__SHAPE(b, sb), (long long)a->shape[1], (long long)b->shape[0]);
  const int64_t m = a->shape[0], inner = a->shape[1], n = b->shape[1];
  int64_t shape[2] = {m, n};
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "matmul", DDP_FLOAT32, 2, shape, a->device, &y));
  /* Under autocast (docs/tensor.md, "Mixed precision"): rounded operands,
   * float32 accumulation, a rounded output. */
  const ddp_dtype low = ddp__autocast_op_dtype(a);
  ddp_status s = DDP_OK;
  if (low != DDP_FLOAT32 && k->dense->gemm_low) { /* a GPU: 16-bit operands, tensor cores */
    const uint16_t *a16 = ddp__autocast_half(tape, a, NULL, low, true, &s);
    const uint16_t *b16 = s == DDP_OK ? ddp__autocast_half(tape, b, NULL, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    s = k->dense->gemm_low(low == DDP_BFLOAT16, false, false, m, n, inner, a16, inner, b16, n,
                           0.0f, y->data, n);
    if (s != DDP_OK) return ddp_error_wrap(s, "matmul of a %s and b %s", DDP__SHAPE(a, sa),
                                           DDP__SHAPE(b, sb));
  } else {
    const float *ad = ddp__autocast_operand(tape, a, low, true, &s);
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, b, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    k->dense->gemm(false, false, m, n, inner, 1.0f, ad, inner, bd, n, 0.0f, y->data, n);
  }
  ddp__autocast_mark(y, low, true);
  if (ddp__tape_wants_grad(tape, 2, in)) {
    if (low == DDP_FLOAT32)
      DDP_TRY(ddp__tape_record(tape, "matmul", matmul_backward, y, 2, in, NULL));
    else {
      ddp_dtype *saved = save_low(tape, "matmul", low, &s);
      if (!saved) return s;
      DDP_TRY(ddp__tape_record(tape, "matmul", matmul_low_backward, y, 2, in, saved));
    }
  }
  *out = y;
  return DDP_OK;
}

/* ---- linear: x (*, in), weight (out, in), bias (out) -> (*, out) ---- */

static ddp_status linear_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  ddp_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
  const int64_t in = w->shape[1], outf = w->shape[0];
  int64_t rows = 1; /* every dimension of x but the last */
  for (int i = 0; i < x->ndim - 1; i++) rows *= x->shape[i];
  ddp_status s = DDP_OK;
  bool dx_accumulate;
  /* The kernel reads all of x (for dw) before it writes dx, so dx may take
   * over x's data (ddp__tape_grad_reusing_data). */
  float *dx = ddp__tape_grad_reusing_data(tape, x, &dx_accumulate, &s);
  float *dw = s == DDP_OK ? ddp__tape_grad(tape, w, &s) : NULL;
  float *db = s == DDP_OK ? ddp__tape_grad(tape, b, &s) : NULL;
  if (s != DDP_OK) return s;
  k->dense->linear_backward(dx, dx_accumulate, dw, db, node->out->grad, x->data, w->data, rows,
                            in, outf);
  return DDP_OK;
}

/* linear recorded under autocast (ctx: its ddp_dtype): from the rounded
 * gradient, rounded input and weight, float32 accumulation; each gradient
 * rounded to the low dtype before it reaches its tensor's float32 grad. */
static ddp_status linear_low_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const ddp_dtype low = *(const ddp_dtype *)node->ctx;
  ddp_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
  const int64_t in = w->shape[1], outf = w->shape[0];
  int64_t rows = 1; /* every dimension of x but the last */
  for (int i = 0; i < x->ndim - 1; i++) rows *= x->shape[i];
  ddp_status s = DDP_OK;
  const float *dy = ddp__autocast_round_grad(tape, node->out, low, &s);
  if (s == DDP_OK && k->dense->linear_backward_low) { /* a GPU: 16-bit operands */
    const uint16_t *dy16 = ddp__autocast_half(tape, node->out, dy, low, false, &s);
    const uint16_t *x16 = s == DDP_OK ? ddp__autocast_half(tape, x, NULL, low, false, &s) : NULL;
    const uint16_t *w16 = s == DDP_OK ? ddp__autocast_half(tape, w, NULL, low, false, &s) : NULL;
    float *dx = s == DDP_OK ? ddp__autocast_grad_scratch(tape, x, false, &s) : NULL;
    float *dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, w, false, &s) : NULL;
    float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, true, &s) : NULL;
    if (s != DDP_OK) return s;
    DDP_TRY(k->dense->linear_backward_low(low == DDP_BFLOAT16, dx, dw, db, dy, dy16, x16, w16,
                                          rows, in, outf));
    DDP_TRY(ddp__autocast_grad_deliver(tape, x, dx, low));
    DDP_TRY(ddp__autocast_grad_deliver(tape, w, dw, low));
    return ddp__autocast_grad_deliver(tape, b, db, low);
  }
  /* the bf16 GEMM writes dx and dw; the float32 kernel accumulates */
  const bool dot = bf16_dot(k, low);
  float *dx = s == DDP_OK ? ddp__autocast_grad_scratch(tape, x, !dot, &s) : NULL;
  float *dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, w, !dot, &s) : NULL;
  float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, true, &s) : NULL;
  if (s != DDP_OK) return s;
  if (dot) {
    /* bfloat16 dot products (the GEMM rounds x and w itself) */
    ddp_arena *arena = ddp__tape_arena_on(tape, x->device);
    bool ok = true;
    if (dx) /* dx (rows, in) = dy (rows, out) @ w (out, in) */
      ok = k->dense->gemm_bf16(false, false, rows, in, outf, dy, outf, w->data, in, NULL, dx, in,
                               arena);
    if (ok && dw) /* dw (out, in) = dy^T (out, rows) @ x (rows, in) */
      ok = k->dense->gemm_bf16(true, false, outf, in, rows, dy, outf, x->data, in, NULL, dw, in,
                               arena);
    if (!ok) return ddp_error(DDP_ERR_NOMEM, "linear backward: no scratch for the bf16 GEMM");
    if (db)
      for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < outf; o++) db[o] += dy[r * outf + o];
  } else {
    const float *xr = ddp__autocast_operand(tape, x, low, false, &s);
    const float *wr = s == DDP_OK ? ddp__autocast_operand(tape, w, low, false, &s) : NULL;
    if (s != DDP_OK) return s;
    k->dense->linear_backward(dx, false, dw, db, dy, xr, wr, rows, in, outf);
  }
  DDP_TRY(ddp__autocast_grad_deliver(tape, x, dx, low));
  DDP_TRY(ddp__autocast_grad_deliver(tape, w, dw, low));
  return ddp__autocast_grad_deliver(tape, b, db, low);
}

ddp_status ddp_linear(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                      ddp_tensor **out) {
  char sx[DDP_SHAPE_STR_BYTES], sw[DDP_SHAPE_STR_BYTES], sb[DDP_SHAPE_STR_BYTES];
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "linear: tape or out is NULL");
  if (!x || !weight)
    return ddp_error(DDP_ERR_INVALID, "linear: %s is NULL (input %s, weight %s)",
                     x ? "weight" : "input", DDP__SHAPE(x, sx), DDP__SHAPE(weight, sw));
  ddp_tensor *in[3] = {x, weight, bias};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("linear", 3, in, &k));
  if (weight->ndim != 2)
    return ddp_error(DDP_ERR_SHAPE, "linear: weight %s must be 2-D (out_features, in_features)",
                     DDP__SHAPE(weight, sw));
  const int64_t outf = weight->shape[0], inf = weight->shape[1];
  if (x->ndim < 1)
    return ddp_error(DDP_ERR_SHAPE, "linear: input %s must have at least 1 dimension",
                     DDP__SHAPE(x, sx));
  if (x->shape[x->ndim - 1] != inf)
    return ddp_error(DDP_ERR_SHAPE,
                     "linear: input %s has %lld features but weight %s expects %lld",
                     DDP__SHAPE(x, sx), (long long)x->shape[x->ndim - 1], DDP__SHAPE(weight, sw),
                     (long long)inf);
  if (bias && (bias->ndim != 1 || bias->shape[0] != outf))
    return ddp_error(DDP_ERR_SHAPE, "linear: bias %s does not match weight %s: expected (%lld)",
                     DDP__SHAPE(bias, sb), DDP__SHAPE(weight, sw), (long long)outf);
  int64_t shape[DDP_MAX_DIMS], rows = 1;
  for (int i = 0; i < x->ndim - 1; i++) {
    shape[i] = x->shape[i];
    rows *= x->shape[i];
  }
  shape[x->ndim - 1] = outf;
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "linear", DDP_FLOAT32, x->ndim, shape, x->device, &y));
  /* Under autocast: input, weight and bias rounded (the weight and bias
   * through the cast cache), float32 accumulation, the output rounded. */
  const ddp_dtype low = ddp__autocast_op_dtype(x);
  ddp_status s = DDP_OK;
  if (low != DDP_FLOAT32 && k->dense->linear_forward_low) {
    /* a GPU: x and the weight as 16-bit values (the weight's through the
     * cast cache, once per region), the rounded bias, tensor cores */
    const uint16_t *x16 = ddp__autocast_half(tape, x, NULL, low, true, &s);
    const uint16_t *w16 = s == DDP_OK ? ddp__autocast_half(tape, weight, NULL, low, true, &s) : NULL;
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, bias, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    s = k->dense->linear_forward_low(low == DDP_BFLOAT16, y->data, x16, w16, bd, rows, inf, outf);
    if (s != DDP_OK) return ddp_error_wrap(s, "linear of input %s", DDP__SHAPE(x, sx));
  } else if (bf16_dot(k, low)) {
    /* bfloat16 dot products: the weight packed once per region (the cast
     * cache), x rounded by the GEMM, the bias added in float32 */
    const uint16_t *wp = ddp__autocast_packed(tape, weight, true, inf, outf, true, &s);
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, bias, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    if (!k->dense->gemm_bf16(false, true, rows, outf, inf, x->data, inf, NULL, inf, wp, y->data,
                             outf, ddp__tape_arena_on(tape, x->device)))
      return ddp_error(DDP_ERR_NOMEM, "linear: no scratch for the bf16 GEMM of input %s",
                       DDP__SHAPE(x, sx));
    float *yd = y->data;
    if (bd)
      for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < outf; o++) yd[r * outf + o] += bd[o];
  } else {
    const float *xd = ddp__autocast_operand(tape, x, low, true, &s);
    const float *wd = s == DDP_OK ? ddp__autocast_operand(tape, weight, low, true, &s) : NULL;
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, bias, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    k->dense->linear_forward(y->data, xd, wd, bd, rows, inf, outf);
  }
  ddp__autocast_mark(y, low, true);
  if (ddp__tape_wants_grad(tape, 3, in)) {
    if (low == DDP_FLOAT32)
      DDP_TRY(ddp__tape_record(tape, "linear", linear_backward, y, 3, in, NULL));
    else {
      ddp_dtype *saved = save_low(tape, "linear", low, &s);
      if (!saved) return s;
      DDP_TRY(ddp__tape_record(tape, "linear", linear_low_backward, y, 3, in, saved));
    }
  }
  *out = y;
  return DDP_OK;
}

/* ---- max_pool2d: x (N, C, H, W) or (C, H, W) -> (..., H', W') ----
 * and relu_max_pool2d, max_pool2d(relu(x)) in one pass: pooling x and then
 * applying relu to each window's max gives the same values (relu is
 * monotone and keeps NaN; a window whose max is -0.0 gives -0.0 where
 * pooling relu(x) may give +0.0) and the same gradient, without writing,
 * keeping and reading back relu(x), four times the pooled output's size. */

typedef struct pool_ctx {
  /* (planes, H', W'): where in each window its max is; -1 where relu
   * closed the window (ddp__pool_arg_bytes each) */
  void *argmax;
  int64_t planes, h, w, kernel, stride;
} pool_ctx;

static ddp_status max_pool2d_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const pool_ctx *ctx = node->ctx;
  ddp_tensor *y = node->out;
  ddp_status s = DDP_OK;
  bool accumulate;
  float *dx = ddp__tape_grad_out(tape, node->in[0], &accumulate, &s);
  if (s != DDP_OK) return s;
  if (dx)
    k->dense->max_pool2d_backward(dx, y->grad, ctx->argmax, ctx->planes, ctx->h, ctx->w,
                                  ctx->kernel, ctx->stride, y->shape[y->ndim - 2],
                                  y->shape[y->ndim - 1], accumulate);
  return DDP_OK;
}

/* Validates, allocates y and computes it, pooling x whose values are read
 * from `data` (NULL: x's own; otherwise the input of a fused batch norm
 * whose output x is never written) through `affine` (or NULL); with
 * `argmax` not NULL, also each window's argmax (tape scratch) for the
 * backward, and with `argval` not NULL the data's value there (tape
 * scratch). Records nothing. */
static ddp_status pool_compute(ddp_tape *tape, const char *op, bool relu, ddp_tensor *x,
                               const float *data, const ddp__pool_affine *affine, int kernel,
                               int stride, ddp_tensor **out, void **argmax, float **argval) {
  char sx[DDP_SHAPE_STR_BYTES];
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "%s: tape or out is NULL", op);
  if (!x) return ddp_error(DDP_ERR_INVALID, "%s: input is NULL", op);
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check(op, 1, &x, &k));
  if (x->ndim != 4 && x->ndim != 3)
    return ddp_error(DDP_ERR_SHAPE, "%s: input %s must be 4-D (N, C, H, W) or 3-D", op,
                     DDP__SHAPE(x, sx));
  if (kernel <= 0)
    return ddp_error(DDP_ERR_INVALID, "%s: kernel size must be positive, got %d", op, kernel);
  if (stride < 0)
    return ddp_error(DDP_ERR_INVALID, "%s: stride must be positive (or 0 for the "
                     "kernel size), got %d", op, stride);
  stride = ddp__pool_stride(kernel, stride);
  const int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1];
  if (kernel > h || kernel > w)
    return ddp_error(DDP_ERR_SHAPE,
                     "%s: kernel %dx%d is larger than the input plane %lldx%lld "
                     "(input %s)",
                     op, kernel, kernel, (long long)h, (long long)w, DDP__SHAPE(x, sx));
  if (h * w > INT32_MAX)
    return ddp_error(DDP_ERR_SHAPE, "%s: input plane %lldx%lld is too large", op,
                     (long long)h, (long long)w);
  const int64_t oh = (h - kernel) / stride + 1, ow = (w - kernel) / stride + 1;
  const int64_t planes = x->numel / (h * w); /* h, w >= kernel >= 1 */
  int64_t shape[4];
  for (int i = 0; i < x->ndim - 2; i++) shape[i] = x->shape[i];
  shape[x->ndim - 2] = oh;
  shape[x->ndim - 1] = ow;
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, op, DDP_FLOAT32, x->ndim, shape, x->device, &y));
  void *at = NULL;
  if (argmax) {
    at = ddp__tape_scratch_on(tape, x->device, (size_t)(y->numel * ddp__pool_arg_bytes(kernel)));
    if (!at)
      return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate the argmax of %s", op,
                       DDP__SHAPE(y, sx));
    *argmax = at;
  }
  float *val = NULL;
  if (argval) {
    val = ddp__tape_scratch_on(tape, x->device, (size_t)y->numel * sizeof(float));
    if (!val)
      return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate the values at the argmax of %s", op,
                       DDP__SHAPE(y, sx));
    *argval = val;
  }
  k->dense->max_pool2d_forward(y->data, at, val, data ? data : x->data, planes, h, w, kernel,
                               stride, oh, ow, relu, affine);
  /* A maximum of low-precision values is one (exact): the mark carries
   * over. A fused batch norm (affine) marks and rounds its own output. */
  if (!affine) ddp__autocast_mark(y, ddp__low_dtype(x), false);
  *out = y;
  return DDP_OK;
}

/* max_pool2d and relu_max_pool2d: computes, and records the backward when
 * x wants a gradient. */
static ddp_status pool_forward(ddp_tape *tape, const char *op, bool relu, ddp_tensor *x,
                               int kernel, int stride, ddp_tensor **out) {
  const bool wants = tape && x && ddp__tape_wants_grad(tape, 1, &x);
  void *argmax = NULL;
  ddp_tensor *y;
  DDP_TRY(pool_compute(tape, op, relu, x, NULL, NULL, kernel, stride, &y,
                       wants ? &argmax : NULL, NULL));
  if (wants) {
    pool_ctx *ctx = ddp_tape_scratch(tape, sizeof *ctx);
    if (!ctx) return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate its backward's context", op);
    const int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1];
    *ctx = (pool_ctx){.argmax = argmax,
                      .planes = x->numel / (h * w),
                      .h = h,
                      .w = w,
                      .kernel = kernel,
                      .stride = ddp__pool_stride(kernel, stride)};
    DDP_TRY(ddp__tape_record(tape, op, max_pool2d_backward, y, 1, &x, ctx));
  }
  *out = y;
  return DDP_OK;
}

ddp_status ddp_max_pool2d(ddp_tape *tape, ddp_tensor *x, int kernel, int stride,
                          ddp_tensor **out) {
  return pool_forward(tape, "max_pool2d", false, x, kernel, stride, out);
}

ddp_status ddp_relu_max_pool2d(ddp_tape *tape, ddp_tensor *x, int kernel, int stride,
                               ddp_tensor **out) {
  return pool_forward(tape, "relu_max_pool2d", true, x, kernel, stride, out);
}

ddp_status ddp__relu_max_pool2d_affine(ddp_tape *tape, ddp_tensor *x, const float *data,
                                       const ddp__pool_affine *affine, int kernel, int stride,
                                       ddp_tensor **out, void **argmax, float **argval) {
  return pool_compute(tape, "batch_norm_relu_max_pool2d", true, x, data, affine, kernel, stride,
                      out, argmax, argval);
}
