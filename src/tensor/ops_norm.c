/* Batch normalisation (PyTorch's F.batch_norm / BatchNorm1d / BatchNorm2d,
 * and SyncBatchNorm's statistics across ranks): validation, the
 * running-statistics update, and the recorded backward. The
 * per-channel mean and 1/std used by the forward live in tape scratch, so
 * backward reuses them and a step allocates nothing once the arena is warm. */
#include "tensor/autocast.h"
#include "tensor/kernels.h"
#include "tensor/ops_fused.h"
#include "tensor/tape.h"

typedef struct batch_norm_ctx {
  float *mean;   /* (C) the statistics the forward normalised with */
  float *invstd; /* (C) 1/sqrt(var + eps) */
  int64_t N, C, HW;
  bool batch_stats; /* mean/invstd came from this batch (so depend on x) */
  /* Synchronized: the statistics are those of every rank's batch together
   * (count elements per channel in all), and backward sums its two
   * per-channel sums across the ranks through `sync` (a copy, so the
   * caller's struct need not outlive the forward). */
  bool synced;
  ddp_batch_norm_sync sync;
  int64_t count;
} batch_norm_ctx;

/* The synchronized backward (PyTorch's SyncBatchNorm.backward): this rank's
 * sums of dy and dy * (x - mean) give its share of dweight and dbias (data
 * parallelism averages those like any gradient); summed across ranks they
 * give dx as if the batches were one. Only when dx is wanted do the ranks
 * reduce: every rank records the same graph, so all of them do or none. */
static ddp_status sync_batch_norm_backward(ddp_tape *tape, const ddp__kernels *k,
                                           const batch_norm_ctx *ctx, const ddp__bn_grad *dy,
                                           const ddp_tensor *x, const ddp_tensor *weight,
                                           float *dx, bool dx_accumulate, float *dweight,
                                           float *dbias) {
  int64_t C = ctx->C;
  double *sums = ddp_arena_alloc(ddp__tape_arena(tape), (size_t)C * 2 * sizeof(double));
  if (!sums)
    return ddp_error(DDP_ERR_NOMEM, "sync_batch_norm backward: no scratch for %lld channels",
                     (long long)C);
  k->pointwise->batch_norm_backward_reduce(sums, dweight, dbias, dy, x->data, ctx->mean,
                                           ctx->invstd, ctx->N, C, ctx->HW);
  if (!dx) return DDP_OK;
  ddp_status s = ctx->sync.allreduce_sum(ctx->sync.user, sums, (size_t)C * 2);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "sync_batch_norm backward: summing %lld channels' gradient sums "
                             "across ranks", (long long)C);
  return k->pointwise->batch_norm_backward_dx(dx, dy, x->data, ctx->mean, ctx->invstd,
                                              weight ? weight->data : NULL, sums, ctx->count,
                                              ctx->N, C, ctx->HW, dx_accumulate,
                                              ddp__tape_arena_on(tape, x->device));
}

/* Batch norm's backward for `node` (inputs x, weight, bias) from the
 * gradient dy of batch norm's output: node's output's own, or, fused, the
 * pooling's that follows it. The kernels read each element of x before
 * they write its gradient, so dx may take over x's data when the tape
 * allows (ddp__tape_grad_reusing_data). */
static ddp_status batch_norm_backward_from(ddp_tape *tape, ddp__node *node,
                                           const batch_norm_ctx *ctx, const ddp__bn_grad *dy) {
  ddp_tensor *x = node->in[0], *weight = node->in[1], *bias = node->in[2];
  ddp_status s = DDP_OK;
  bool dx_accumulate;
  float *dx = ddp__tape_grad_reusing_data(tape, x, &dx_accumulate, &s);
  float *dweight = ddp__tape_grad(tape, weight, &s);
  float *dbias = ddp__tape_grad(tape, bias, &s);
  if (s != DDP_OK) return s;
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  if (ctx->synced)
    return sync_batch_norm_backward(tape, k, ctx, dy, x, weight, dx, dx_accumulate, dweight,
                                    dbias);
  return k->pointwise->batch_norm_backward(dx, dweight, dbias, dy, x->data, ctx->mean,
                                           ctx->invstd, weight ? weight->data : NULL, ctx->N,
                                           ctx->C, ctx->HW, ctx->batch_stats, dx_accumulate,
                                           ddp__tape_arena_on(tape, x->device));
}

static ddp_status batch_norm_backward(ddp_tape *tape, ddp__node *node) {
  const ddp__bn_grad dy = {.dense = node->out->grad};
  return batch_norm_backward_from(tape, node, node->ctx, &dy);
}

/* The synchronized forward's statistics: this rank's per-channel sum and sum
 * of squares and its element count, packed into one buffer (2C + 1 doubles)
 * and summed across ranks in one reduction; then mean, invstd and the
 * running update from the totals. */
static ddp_status sync_batch_norm_stats(ddp_tape *tape, const ddp__kernels *k, batch_norm_ctx *ctx,
                                        const ddp_tensor *x, float *running_mean,
                                        float *running_var, float momentum, float eps) {
  int64_t C = ctx->C;
  double *sums = ddp_tape_scratch(tape, (size_t)(2 * C + 1) * sizeof(double));
  if (!sums)
    return ddp_error(DDP_ERR_NOMEM, "sync_batch_norm: no scratch for %lld channels",
                     (long long)C);
  k->pointwise->batch_norm_sums(sums, x->data, ctx->N, C, ctx->HW);
  sums[2 * C] = (double)(ctx->N * ctx->HW);
  ddp_status s = ctx->sync.allreduce_sum(ctx->sync.user, sums, (size_t)(2 * C + 1));
  if (s != DDP_OK)
    return ddp_error_wrap(s, "sync_batch_norm: summing %lld channels' statistics across ranks",
                          (long long)C);
  /* Counts are integers far below 2^53, so the double sum is exact. Every
   * rank sees the same total, so every rank fails here together. */
  ctx->count = (int64_t)sums[2 * C];
  if (ctx->count <= 1) {
    char sx[DDP_SHAPE_STR_BYTES];
    return ddp_error(DDP_ERR_SHAPE,
                     "sync_batch_norm: expected more than 1 value per channel across all ranks "
                     "when training, got %lld in all (this rank's input %s)",
                     (long long)ctx->count, ddp_tensor_shape_str(x, sx, sizeof sx));
  }
  k->pointwise->batch_norm_stats_from_sums(ctx->mean, ctx->invstd, running_mean, running_var,
                                           sums, ctx->count, C, momentum, eps);
  return DDP_OK;
}

/* A per-channel vector (weight, bias, running stats) must be (C) or NULL. */
static ddp_status check_channel_vector(const char *name, const ddp_tensor *v, const ddp_tensor *x) {
  if (!v) return DDP_OK;
  if (v->ndim == 1 && v->shape[0] == x->shape[1]) return DDP_OK;
  char sv[DDP_SHAPE_STR_BYTES], sx[DDP_SHAPE_STR_BYTES];
  return ddp_error(DDP_ERR_SHAPE, "batch_norm: %s has shape %s, input %s has %lld channels", name,
                   ddp_tensor_shape_str(v, sv, sizeof sv), ddp_tensor_shape_str(x, sx, sizeof sx),
                   (long long)x->shape[1]);
}

ddp_status ddp_batch_norm(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                          ddp_tensor *running_mean, ddp_tensor *running_var,
                          int64_t *num_batches_tracked, bool training, float momentum, float eps,
                          ddp_tensor **out) {
  return ddp_sync_batch_norm(tape, x, weight, bias, running_mean, running_var,
                             num_batches_tracked, training, momentum, eps, NULL, out);
}

/* The forward up to writing y: validation, y (allocated, or with
 * !materialize a view of x's data standing for the output that a fused
 * consumer computes itself), the statistics (summed across ranks when
 * synced), the running update and the context backward needs. */
static ddp_status batch_norm_prepare(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                                     ddp_tensor *bias, ddp_tensor *running_mean,
                                     ddp_tensor *running_var, int64_t *num_batches_tracked,
                                     bool training, float momentum, float eps,
                                     const ddp_batch_norm_sync *sync, bool materialize,
                                     const ddp__kernels **kernels, ddp_tensor **out,
                                     batch_norm_ctx **context) {
  if (!tape || !out) return ddp_error(DDP_ERR_INVALID, "batch_norm: tape or out is NULL");
  if (!x) return ddp_error(DDP_ERR_INVALID, "batch_norm: input is NULL");
  if (sync && !sync->allreduce_sum)
    return ddp_error(DDP_ERR_INVALID, "sync_batch_norm: the sync has no allreduce_sum function");
  ddp_tensor *all[5] = {x, weight, bias, running_mean, running_var};
  const ddp__kernels *k;
  DDP_TRY(ddp__kernels_check("batch_norm", 5, all, &k));
  char sx[DDP_SHAPE_STR_BYTES];
  if (x->ndim < 2)
    return ddp_error(DDP_ERR_SHAPE, "batch_norm: input %s must be (N, C) or (N, C, H, W)",
                     ddp_tensor_shape_str(x, sx, sizeof sx));
  DDP_TRY(check_channel_vector("weight", weight, x));
  DDP_TRY(check_channel_vector("bias", bias, x));
  DDP_TRY(check_channel_vector("running_mean", running_mean, x));
  DDP_TRY(check_channel_vector("running_var", running_var, x));
  if (!running_mean != !running_var)
    return ddp_error(DDP_ERR_INVALID,
                     "batch_norm: running_mean and running_var must both be given or both NULL "
                     "(got %s and %s)",
                     running_mean ? "a tensor" : "NULL", running_var ? "a tensor" : "NULL");
  if (!(eps >= 0.0f))
    return ddp_error(DDP_ERR_RANGE, "batch_norm: eps must be >= 0, got %g", (double)eps);

  int64_t N = x->shape[0], C = x->shape[1];
  int64_t HW = 1;
  for (int i = 2; i < x->ndim; i++) HW *= x->shape[i];
  /* Without running statistics, eval normalises with the batch's own, like a
   * module built with track_running_stats=False. */
  bool batch_stats = training || !running_mean;
  /* As PyTorch's SyncBatchNorm: synchronized in training only; evaluation
   * is plain batch norm. A rank's batch may hold one value per channel, or
   * none, when the ranks together hold more (checked after the reduction). */
  bool synced = sync && training;
  if (batch_stats && !synced && N * HW <= 1)
    return ddp_error(DDP_ERR_SHAPE,
                     "batch_norm: expected more than 1 value per channel when using batch "
                     "statistics, got input %s",
                     ddp_tensor_shape_str(x, sx, sizeof sx));

  ddp_tensor *y;
  if (materialize)
    DDP_TRY(ddp__tape_output(tape, "batch_norm", DDP_FLOAT32, x->ndim, x->shape, x->device, &y));
  else
    DDP_TRY(ddp__tape_view(tape, "batch_norm", x, x->ndim, x->shape, &y));
  batch_norm_ctx *ctx = ddp_tape_scratch(tape, sizeof *ctx);
  float *stats = ddp__tape_scratch_on(tape, x->device, (size_t)C * 2 * sizeof(float));
  if (!ctx || !stats)
    return ddp_error(DDP_ERR_NOMEM, "batch_norm: cannot allocate statistics for %lld channels",
                     (long long)C);
  *ctx = (batch_norm_ctx){.mean = stats,
                         .invstd = stats + C,
                         .N = N,
                         .C = C,
                         .HW = HW,
                         .batch_stats = batch_stats,
                         .synced = synced,
                         .sync = synced ? *sync : (ddp_batch_norm_sync){0},
                         .count = N * HW};
  bool update = training && running_mean;
  if (synced) {
    DDP_TRY(sync_batch_norm_stats(tape, k, ctx, x, update ? running_mean->data : NULL,
                                  update ? running_var->data : NULL, momentum, eps));
  } else if (batch_stats) {
    DDP_TRY(k->pointwise->batch_norm_stats(ctx->mean, ctx->invstd,
                                           update ? running_mean->data : NULL,
                                           update ? running_var->data : NULL, x->data, N, C, HW,
                                           momentum, eps, ddp__tape_arena_on(tape, x->device)));
  } else {
    k->pointwise->batch_norm_running(ctx->mean, ctx->invstd, running_mean->data, running_var->data,
                                     C, eps);
  }
  if (training && num_batches_tracked) (*num_batches_tracked)++;
  *kernels = k;
  *out = y;
  *context = ctx;
  return DDP_OK;
}

/* Records the backward (batch_norm_backward reads y's gradient, never y). */
static ddp_status batch_norm_record(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                                    ddp_tensor *bias, ddp_tensor *y, batch_norm_ctx *ctx) {
  ddp_tensor *in[3] = {x, weight, bias};
  if (!ddp__tape_wants_grad(tape, 3, in)) return DDP_OK;
  return ddp__tape_record(tape, ctx->synced ? "sync_batch_norm" : "batch_norm",
                          batch_norm_backward, y, 3, in, ctx);
}

ddp_status ddp_sync_batch_norm(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                               ddp_tensor *bias, ddp_tensor *running_mean,
                               ddp_tensor *running_var, int64_t *num_batches_tracked,
                               bool training, float momentum, float eps,
                               const ddp_batch_norm_sync *sync, ddp_tensor **out) {
  const ddp__kernels *k;
  ddp_tensor *y;
  batch_norm_ctx *ctx;
  DDP_TRY(batch_norm_prepare(tape, x, weight, bias, running_mean, running_var,
                             num_batches_tracked, training, momentum, eps, sync, true, &k, &y,
                             &ctx));
  k->pointwise->batch_norm_forward(y->data, x->data, ctx->mean, ctx->invstd,
                                   weight ? weight->data : NULL, bias ? bias->data : NULL, ctx->N,
                                   ctx->C, ctx->HW);
  /* Under autocast batch norm runs in its input's dtype (PyTorch 2.x's CPU
   * autocast lists it in neither list): statistics and normalisation in
   * float32 with float32 weight, bias and running statistics, the output
   * rounded to the input's low dtype (docs/tensor.md, "Mixed precision"). */
  ddp__autocast_mark(y, ddp__low_dtype(x), true);
  DDP_TRY(batch_norm_record(tape, x, weight, bias, y, ctx));
  *out = y;
  return DDP_OK;
}

/* batch_norm_relu_max_pool2d records one node, from x, weight and bias to
 * the pooled output: its backward is batch norm's, given the pooling's
 * gradient (ddp__bn_grad), so the gradient of the normalised values is
 * never stored. */
typedef struct bn_pool_ctx {
  const batch_norm_ctx *bn;
  const void *argmax; /* (N, C, oh, ow): where each window's max is (ddp__pool_arg_bytes) */
  int64_t h, w;       /* batch norm's planes */
  int64_t kernel, stride;
  /* x is a convolution's output that only this block reads, whose
   * backward is folded in: its geometry (ddp__conv2d_foldable), or NULL.
   * The forward then released x's data: backward needs only argval. */
  const ddp__conv2d_geom *fold;
  const float *argval; /* (N, C, oh, ow): x at each window's max, when folding */
} bn_pool_ctx;

/* Batch norm's backward with the convolution that made x folded in: dx
 * goes straight into the convolution's dw and db without being formed,
 * from the pooled gradient, x's values at the windows' maxima and the
 * convolution's input and weights (x itself is gone), and x gets no
 * gradient, so the convolution's node is skipped. */
static ddp_status backward_folding_conv(ddp_tape *tape, ddp__node *node,
                                        const batch_norm_ctx *ctx, const bn_pool_ctx *pc,
                                        const ddp__bn_grad *dy) {
  ddp_tensor *x = node->in[0], *weight = node->in[1], *bias = node->in[2];
  const ddp__node *conv = ddp__tape_node(tape, x);
  ddp_tensor *conv_w = conv->in[1], *conv_b = conv->in[2];
  ddp__conv2d_fold_in in;
  DDP_TRY(ddp__conv2d_fold_operands(tape, x, &in));
  ddp_status s = DDP_OK;
  float *dweight = ddp__tape_grad(tape, weight, &s);
  float *dbias = ddp__tape_grad(tape, bias, &s);
  float *conv_dw, *conv_db;
  if (in.low == DDP_FLOAT32) {
    conv_dw = ddp__tape_grad(tape, conv_w, &s);
    conv_db = ddp__tape_grad(tape, conv_b, &s);
  } else {
    /* Under autocast the convolution's weight and bias gradients are
     * summed in float32 (zeroed scratch: the kernel adds to them) and
     * rounded to the low dtype once, as conv2d_low_backward delivers them.
     * Batch norm's dx, which that backward would round element by element
     * before reading it, is never formed, so never rounded (docs/tensor.md,
     * "Mixed precision"). */
    conv_dw = s == DDP_OK ? ddp__autocast_grad_scratch(tape, conv_w, true, &s) : NULL;
    conv_db = s == DDP_OK ? ddp__autocast_grad_scratch(tape, conv_b, true, &s) : NULL;
  }
  if (s != DDP_OK) return s;
  const ddp__kernels *k = ddp__kernels_for(node->out->device);
  DDP_TRY(k->pointwise->batch_norm_backward_conv(
      dweight, dbias, dy, pc->argval, ctx->mean, ctx->invstd, weight ? weight->data : NULL,
      ctx->N, ctx->C, ctx->HW, ctx->batch_stats, pc->fold, in.x, in.w, in.b, conv_dw, conv_db,
      ddp__tape_arena_on(tape, x->device)));
  if (in.low == DDP_FLOAT32) return DDP_OK;
  DDP_TRY(ddp__autocast_grad_deliver(tape, conv_w, conv_dw, in.low));
  return ddp__autocast_grad_deliver(tape, conv_b, conv_db, in.low);
}

static ddp_status batch_norm_relu_max_pool2d_backward(ddp_tape *tape, ddp__node *node) {
  const bn_pool_ctx *ctx = node->ctx;
  const ddp_tensor *y = node->out;
  const batch_norm_ctx *bn = ctx->bn;
  /* One plane of the normalised values' gradient at a time; all of them
   * for 1x1 planes, which batch norm's kernels take as rows. */
  const int64_t floats = bn->HW == 1 ? bn->N * bn->C : bn->HW;
  float *scratch = ddp__tape_scratch_on(tape, node->in[0]->device, (size_t)floats * sizeof(float));
  if (!scratch)
    return ddp_error(DDP_ERR_NOMEM, "batch_norm_relu_max_pool2d backward: no scratch for a "
                     "%lldx%lld plane", (long long)ctx->h, (long long)ctx->w);
  const ddp__bn_grad dy = {.pooled = y->grad,
                           .argmax = ctx->argmax,
                           .h = ctx->h,
                           .w = ctx->w,
                           .kernel = ctx->kernel,
                           .stride = ctx->stride,
                           .oh = y->shape[2],
                           .ow = y->shape[3],
                           .scratch = scratch};
  if (!ctx->fold) return batch_norm_backward_from(tape, node, bn, &dy);
  /* Folding needs this block to be the only contributor to x's gradient:
   * the last of x's consumers to run, none before it having written one.
   * The owner that marked x reusable promised no other op reads it. */
  const ddp_tensor *x = node->in[0];
  if (x->grad || x->pending != 1)
    return ddp_error(DDP_ERR_STATE,
                     "batch_norm_relu_max_pool2d backward: its input was marked reusable (read "
                     "by this op alone), but another op used it too; its data is gone");
  return backward_folding_conv(tape, node, bn, ctx, &dy);
}

ddp_status ddp_batch_norm_relu_max_pool2d(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                                          ddp_tensor *bias, ddp_tensor *running_mean,
                                          ddp_tensor *running_var, int64_t *num_batches_tracked,
                                          bool training, float momentum, float eps,
                                          const ddp_batch_norm_sync *sync, int kernel, int stride,
                                          ddp_tensor **out) {
  char sx[DDP_SHAPE_STR_BYTES];
  if (x && x->ndim != 4)
    return ddp_error(DDP_ERR_SHAPE,
                     "batch_norm_relu_max_pool2d: input %s must be 4-D (N, C, H, W)",
                     DDP__SHAPE(x, sx));
  const ddp__kernels *k;
  ddp_tensor *normalised, *y;
  batch_norm_ctx *ctx;
  DDP_TRY(batch_norm_prepare(tape, x, weight, bias, running_mean, running_var,
                             num_batches_tracked, training, momentum, eps, sync, false, &k,
                             &normalised, &ctx));
  /* batch_norm_forward's per-channel factor, computed the same way. */
  int64_t C = ctx->C;
  float *affine = ddp__tape_scratch_on(tape, x->device, (size_t)C * 2 * sizeof(float));
  if (!affine)
    return ddp_error(DDP_ERR_NOMEM, "batch_norm_relu_max_pool2d: no scratch for %lld channels",
                     (long long)C);
  const float *w = weight ? weight->data : NULL, *b = bias ? bias->data : NULL;
  if (x->device.type == DDP_DEVICE_CPU) {
    for (int64_t c = 0; c < C; c++) {
      affine[c] = ctx->invstd[c] * (w ? w[c] : 1.0f);
      affine[C + c] = b ? b[c] : 0.0f;
    }
  } else { /* the same products, by the device's kernels */
    if (w)
      k->basic->mul(affine, ctx->invstd, w, C);
    else
      k->basic->copy(affine, ctx->invstd, C);
    if (b)
      k->basic->copy(affine + C, b, C);
    else
      k->basic->fill(affine + C, 0.0f, C);
  }
  const ddp__pool_affine map = {ctx->mean, affine, affine + C, C};
  ddp_tensor *in[3] = {x, weight, bias};
  const bool wants = ddp__tape_wants_grad(tape, 3, in);
  /* A convolution's output that only this block reads (its owner marked
   * it, and no op has used it yet): the convolution's backward is folded
   * into this one's, which needs x only at the windows' maxima, so x's 5 MB
   * in the ConvNet can go as soon as it is pooled. */
  /* (CPU only: a backend without the folded kernel keeps x.) */
  const ddp__conv2d_geom *fold = wants && !ctx->synced &&
                                         k->pointwise->batch_norm_backward_conv &&
                                         (x->flags & DDP__TENSOR_REUSABLE) && x->pending == 0
                                     ? ddp__conv2d_foldable(tape, x)
                                     : NULL;
  void *argmax = NULL;
  float *argval = NULL;
  DDP_TRY(ddp__relu_max_pool2d_affine(tape, normalised, x->data, &map, kernel, stride, &y,
                                      wants ? &argmax : NULL, fold ? &argval : NULL));
  /* Rounding is monotone: the pooled maximum of the rounded normalised
   * values is the rounded pooled maximum (batch norm's rule above). */
  ddp__autocast_mark(y, ddp__low_dtype(x), true);
  if (wants) {
    bn_pool_ctx *pc = ddp_tape_scratch(tape, sizeof *pc);
    if (!pc)
      return ddp_error(DDP_ERR_NOMEM,
                       "batch_norm_relu_max_pool2d: cannot allocate its backward's context");
    *pc = (bn_pool_ctx){.bn = ctx,
                        .argmax = argmax,
                        .h = x->shape[2],
                        .w = x->shape[3],
                        .kernel = kernel,
                        .stride = ddp__pool_stride(kernel, stride),
                        .fold = fold,
                        .argval = argval};
    DDP_TRY(ddp__tape_record(tape,
                             ctx->synced ? "sync_batch_norm_relu_max_pool2d"
                                         : "batch_norm_relu_max_pool2d",
                             batch_norm_relu_max_pool2d_backward, y, 3, in, pc));
  }
  if (fold) {
    /* Later allocations of the step (the next layers' outputs, backward's
     * scratch) reuse x's memory, so a step's working set holds x only
     * while it is pooled. Its pointer goes too: a use would fault rather
     * than read another tensor's values. */
    ddp_arena_release(ddp__tape_arena_on(tape, x->device), x->data,
                      (size_t)x->numel * sizeof(float));
    x->data = NULL;
  }
  *out = y;
  return DDP_OK;
}
