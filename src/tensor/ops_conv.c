/* conv2d: validation, the forward through the dense kernel table, and a
 * backward that computes only the gradients that are wanted (a first layer's
 * input is data: its dx, a third of the layer's backward, is skipped). */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/ops_fused.h"
#include "tensor/tape.h"


static ddp_status conv2d_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const ddp__conv2d_geom *g = node->ctx;
  ddp_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
  ddp_status s = DDP_OK;
  bool dx_accumulate;
  /* The kernels read each sample's input before writing its dx, so dx may
   * take over x's data (ddp__tape_grad_reusing_data). */
  float *dx = ddp__tape_grad_reusing_data(tape, x, &dx_accumulate, &s);
  float *dw = s == DDP_OK ? ddp__tape_grad(tape, w, &s) : NULL;
  float *db = s == DDP_OK ? ddp__tape_grad(tape, b, &s) : NULL;
  if (s != DDP_OK) return s;
  return k->dense->conv2d_backward(dx, dw, db, node->out->grad, x->data, w->data, g,
                                   dx_accumulate, ddp__tape_arena_on(tape, x->device));
}

/* conv2d recorded under autocast: the geometry, the dtype, and the input
 * as forward rounded it (tape scratch, or x's own data when x held `low`
 * values already; NULL when forward ran through cuDNN), so that backward
 * does not round it again. */
typedef struct conv_low_ctx {
  ddp__conv2d_geom g;
  ddp_dtype low;
  const float *xr;
} conv_low_ctx;

/* From the rounded gradient, rounded input and weight, float32
 * accumulation; each gradient rounded to the low dtype before it reaches
 * its tensor's float32 grad (docs/tensor.md, "Mixed precision"). On a GPU
 * (ctx->g.round unset) through cuDNN in 16 bits where it takes the
 * geometry, else the float32 kernels on rounded operands. On the CPU dy and
 * dx, the large ones, are rounded by the kernels a sample at a time
 * (ctx->g.round), and dx is written straight into x's gradient when this
 * op is its first writer (taking over x's data as the float32 path does):
 * no whole-tensor passes to round dy and dx, no zeroed scratch, no copy. */
static ddp_status conv2d_low_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  const conv_low_ctx *ctx = node->ctx;
  ddp_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
  ddp_status s = DDP_OK;
  ddp_arena *arena = ddp__tape_arena_on(tape, x->device);
  if (ctx->g.round == DDP_FLOAT32) {
    /* a GPU: the kernels round nothing themselves */
    const float *dy = ddp__autocast_round_grad(tape, node->out, ctx->low, &s);
    if (s == DDP_OK && k->dense->conv2d_backward_low) {
      /* 16-bit operands through cuDNN; the bias gradient is the
       * fixed-order sums of the rounded dy (conv2d_backward with db only) */
      const uint16_t *dy16 = ddp__autocast_half(tape, node->out, dy, ctx->low, false, &s);
      const uint16_t *x16 =
          s == DDP_OK ? ddp__autocast_half(tape, x, NULL, ctx->low, false, &s) : NULL;
      const uint16_t *w16 =
          s == DDP_OK ? ddp__autocast_half(tape, w, NULL, ctx->low, false, &s) : NULL;
      float *dx = s == DDP_OK ? ddp__autocast_grad_scratch(tape, x, false, &s) : NULL;
      float *dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, w, false, &s) : NULL;
      if (s != DDP_OK) return s;
      bool done = false;
      DDP_TRY(k->dense->conv2d_backward_low(ctx->low == DDP_BFLOAT16, dx, dw, dy16, x16, w16,
                                            &ctx->g, arena, &done));
      if (done) {
        float *db = ddp__autocast_grad_scratch(tape, b, true, &s);
        if (s != DDP_OK) return s;
        if (db)
          DDP_TRY(k->dense->conv2d_backward(NULL, NULL, db, dy, x->data, w->data, &ctx->g, false,
                                            arena));
        DDP_TRY(ddp__autocast_grad_deliver(tape, x, dx, ctx->low));
        DDP_TRY(ddp__autocast_grad_deliver(tape, w, dw, ctx->low));
        return ddp__autocast_grad_deliver(tape, b, db, ctx->low);
      }
    }
    /* no 16-bit path for this geometry: the float32 kernels on rounded
     * operands, dy and dx rounded in whole-tensor passes */
    /* ctx->xr is NULL when forward ran through cuDNN */
    const float *xr = ctx->xr;
    if (!xr && s == DDP_OK) xr = ddp__autocast_operand(tape, x, ctx->low, false, &s);
    const float *wr = s == DDP_OK ? ddp__autocast_operand(tape, w, ctx->low, false, &s) : NULL;
    float *dx = s == DDP_OK ? ddp__autocast_grad_scratch(tape, x, true, &s) : NULL;
    float *dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, w, true, &s) : NULL;
    float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, true, &s) : NULL;
    if (s != DDP_OK) return s;
    DDP_TRY(k->dense->conv2d_backward(dx, dw, db, dy, xr, wr, &ctx->g, false, arena));
    DDP_TRY(ddp__autocast_grad_deliver(tape, x, dx, ctx->low));
    DDP_TRY(ddp__autocast_grad_deliver(tape, w, dw, ctx->low));
    return ddp__autocast_grad_deliver(tape, b, db, ctx->low);
  }
  const float *wr = ddp__autocast_operand(tape, w, ctx->low, false, &s);
  float *dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, w, true, &s) : NULL;
  float *db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, b, true, &s) : NULL;
  bool dx_accumulate = false;
  float *dx = NULL, *dx_dst = NULL;
  if (s == DDP_OK && x && (x->flags & DDP_TENSOR_REQUIRES_GRAD)) {
    dx_dst = ddp__tape_grad_reusing_data(tape, x, &dx_accumulate, &s);
    /* an existing gradient: this op's own, rounded, is added to it */
    dx = dx_accumulate && dx_dst ? ddp__autocast_grad_scratch(tape, x, false, &s) : dx_dst;
  }
  if (s != DDP_OK) return s;
  /* ctx->g.round: the kernels round dy as they read it and dx as they
   * write it, a sample at a time (kernels_dense.h) */
  DDP_TRY(k->dense->conv2d_backward(dx, dw, db, node->out->grad, ctx->xr, wr, &ctx->g, false,
                                    arena));
  if (dx && dx_accumulate) ddp__basic_kernels_for(x->device)->axpy(dx_dst, 1.0f, dx, x->numel);
  DDP_TRY(ddp__autocast_grad_deliver(tape, w, dw, ctx->low));
  return ddp__autocast_grad_deliver(tape, b, db, ctx->low);
}

const ddp__conv2d_geom *ddp__conv2d_foldable(ddp_tape *tape, const ddp_tensor *t) {
  if (!t || t->node < 0) return NULL;
  const ddp__node *node = ddp__tape_node(tape, t);
  const ddp__conv2d_geom *g;
  if (node->backward == conv2d_backward) {
    g = node->ctx;
  } else if (node->backward == conv2d_low_backward) {
    /* under autocast on the CPU (the kernels rounded y, and backward reads
     * the input as forward rounded it): the fold reads the same operands
     * (ddp__conv2d_fold_operands) */
    const conv_low_ctx *ctx = node->ctx;
    if (ctx->g.round == DDP_FLOAT32 || !ctx->xr) return NULL;
    g = &ctx->g;
  } else {
    return NULL;
  }
  const ddp_tensor *x = node->in[0], *w = node->in[1];
  if ((x->flags & DDP_TENSOR_REQUIRES_GRAD) || !(w->flags & DDP_TENSOR_REQUIRES_GRAD))
    return NULL;
  return g->stride == 1 && g->oh * g->ow > 1 ? g : NULL;
}

ddp_status ddp__conv2d_fold_operands(ddp_tape *tape, const ddp_tensor *t,
                                     ddp__conv2d_fold_in *in) {
  const ddp__node *node = ddp__tape_node(tape, t);
  ddp_tensor *x = node->in[0], *w = node->in[1], *b = node->in[2];
  if (node->backward == conv2d_backward) {
    *in = (ddp__conv2d_fold_in){.x = x->data, .w = w->data, .b = b ? b->data : NULL,
                                .low = DDP_FLOAT32};
    return DDP_OK;
  }
  /* conv2d_low_backward's operands: the input as forward rounded it, the
   * weight and bias rounded again (tape scratch: the cast cache's copies
   * may be gone by now), as conv2d_low_backward reads them */
  const conv_low_ctx *ctx = node->ctx;
  ddp_status s = DDP_OK;
  const float *wr = ddp__autocast_operand(tape, w, ctx->low, false, &s);
  const float *br = s == DDP_OK ? ddp__autocast_operand(tape, b, ctx->low, false, &s) : NULL;
  if (s != DDP_OK) return s;
  *in = (ddp__conv2d_fold_in){.x = ctx->xr, .w = wr, .b = br, .low = ctx->low};
  return DDP_OK;
}

ddp_status ddp_conv2d(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                      int stride, int padding, ddp_tensor **out) {
  char sx[DDP_SHAPE_STR_BYTES], sw[DDP_SHAPE_STR_BYTES], sb[DDP_SHAPE_STR_BYTES];
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "conv2d: tape or out is NULL");
  if (!x || !weight)
    return ddp_error(DDP_ERR_INVALID, "conv2d: %s is NULL (input %s, weight %s)",
                     x ? "weight" : "input", DDP__SHAPE(x, sx), DDP__SHAPE(weight, sw));
  ddp_tensor *in[3] = {x, weight, bias};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("conv2d", 3, in, &k));
  if (x->ndim != 4)
    return ddp_error(DDP_ERR_SHAPE, "conv2d: input %s must be 4-D (N, C, H, W)", DDP__SHAPE(x, sx));
  if (weight->ndim != 4)
    return ddp_error(DDP_ERR_SHAPE, "conv2d: weight %s must be 4-D (O, C, KH, KW)",
                     DDP__SHAPE(weight, sw));
  if (x->shape[1] != weight->shape[1])
    return ddp_error(DDP_ERR_SHAPE, "conv2d: input %s has %lld channels but weight %s expects %lld",
                     DDP__SHAPE(x, sx), (long long)x->shape[1], DDP__SHAPE(weight, sw),
                     (long long)weight->shape[1]);
  if (bias && (bias->ndim != 1 || bias->shape[0] != weight->shape[0]))
    return ddp_error(DDP_ERR_SHAPE, "conv2d: bias %s does not match weight %s: expected (%lld)",
                     DDP__SHAPE(bias, sb), DDP__SHAPE(weight, sw), (long long)weight->shape[0]);
  if (stride <= 0)
    return ddp_error(DDP_ERR_INVALID, "conv2d: stride must be positive, got %d", stride);
  if (padding < 0)
    return ddp_error(DDP_ERR_INVALID, "conv2d: padding must be non-negative, got %d", padding);
  ddp__conv2d_geom g = {
      .n = x->shape[0], .c = x->shape[1], .h = x->shape[2], .w = x->shape[3],
      .o = weight->shape[0], .kh = weight->shape[2], .kw = weight->shape[3],
      .stride = stride, .pad = padding,
  };
  if (g.kh <= 0 || g.kw <= 0 || g.c <= 0)
    return ddp_error(DDP_ERR_SHAPE, "conv2d: weight %s is empty", DDP__SHAPE(weight, sw));
  const int64_t ph = g.h + 2 * g.pad, pw = g.w + 2 * g.pad;
  if (g.kh > ph || g.kw > pw)
    return ddp_error(DDP_ERR_SHAPE,
                     "conv2d: kernel %lldx%lld is larger than the padded input %lldx%lld "
                     "(input %s, padding %d)",
                     (long long)g.kh, (long long)g.kw, (long long)ph, (long long)pw,
                     DDP__SHAPE(x, sx), padding);
  g.oh = (ph - g.kh) / g.stride + 1;
  g.ow = (pw - g.kw) / g.stride + 1;
  int64_t shape[4] = {g.n, g.o, g.oh, g.ow};
  ddp_tensor *y;
  DDP_TRY(ddp__tape_output(tape, "conv2d", DDP_FLOAT32, 4, shape, x->device, &y));
  /* Under autocast: input, weight and bias rounded (the weight and bias
   * through the cast cache), float32 accumulation, the output rounded. */
  const ddp_dtype low = ddp__autocast_op_dtype(x);
  ddp_status s = DDP_OK;
  ddp_arena *arena = ddp__tape_arena_on(tape, x->device);
  bool done = false;
  const float *xd = NULL;
  if (low != DDP_FLOAT32 && k->dense->conv2d_forward_low) {
    /* a GPU: x and the weight as 16-bit values (the weight through the
     * cast cache), cuDNN in 16 bits, the rounded bias added after */
    const uint16_t *x16 = ddp__autocast_half(tape, x, NULL, low, true, &s);
    const uint16_t *w16 = s == DDP_OK ? ddp__autocast_half(tape, weight, NULL, low, true, &s) : NULL;
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, bias, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    DDP_TRY(k->dense->conv2d_forward_low(low == DDP_BFLOAT16, y->data, x16, w16, bd, &g, arena,
                                         &done));
  }
  if (!done) {
    /* x never through the cast cache: backward reads xd (ctx->xr), and a
     * cache copy may be freed (ddp_autocast_cache_free, thread exit) or
     * refilled by a later region before the backward runs */
    xd = ddp__autocast_operand(tape, x, low, false, &s);
    const float *wd = s == DDP_OK ? ddp__autocast_operand(tape, weight, low, true, &s) : NULL;
    const float *bd = s == DDP_OK ? ddp__autocast_operand(tape, bias, low, true, &s) : NULL;
    if (s != DDP_OK) return s;
    /* on the CPU the kernels round y to `low` a sample at a time, while it
     * is in cache (kernels_dense.h: only CPU kernels honour g.round); on a
     * GPU the output is rounded in one pass below */
    if (x->device.type == DDP_DEVICE_CPU) g.round = (int)low;
    DDP_TRY(k->dense->conv2d_forward(y->data, xd, wd, bd, &g, arena));
  }
  ddp__autocast_mark(y, low, g.round == DDP_FLOAT32);
  if (low != DDP_FLOAT32 && ddp__tape_wants_grad(tape, 3, in)) {
    conv_low_ctx *saved = ddp_tape_scratch(tape, sizeof *saved);
    if (!saved) return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate the saved geometry");
    *saved = (conv_low_ctx){.g = g, .low = low, .xr = xd};
    DDP_TRY(ddp__tape_record(tape, "conv2d", conv2d_low_backward, y, 3, in, saved));
  } else if (ddp__tape_wants_grad(tape, 3, in)) {
    ddp__conv2d_geom *saved = ddp_tape_scratch(tape, sizeof *saved);
    if (!saved) return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate the saved geometry");
    *saved = g;
    DDP_TRY(ddp__tape_record(tape, "conv2d", conv2d_backward, y, 3, in, saved));
  }
  *out = y;
  return DDP_OK;
}
