/* The built-in communication hooks (PyTorch's default_hooks): the float32
 * allreduce, and float16 / bfloat16 compression.
 *
 * Where the division happens. float32: the sum first, then one division by
 * the divisor (a correctly rounded quotient of the exactly reduced sum; for a
 * power-of-two world the division is exact, so the result is the sum's
 * rounding only). Dividing first would round every addend once more.
 * float16 / bfloat16: divide before compressing, as PyTorch's
 * fp16_compress_hook does, so the sum of W gradients stays within the half
 * range (65504 for float16); g / W is computed in float32 and rounded once.
 *
 * The last bucket of a backward is reduced on the calling thread (blocking):
 * nothing is left to overlap it with, and handing it to the progress thread
 * costs a wake-up on a core this rank's compute is using (measured: world-2
 * ConvNet training 5-6% faster with it, BENCHMARKS.md "Data parallel"). */
#include "parallel/dp_internal.h"

/* Sums buf over pg: async, or at once on this thread for the last bucket. */
static ddp_status reduce(ddp_process_group *pg, ddp_dp_bucket *bucket, void *buf, ddp_dtype dtype,
                         ddp_work **work) {
  if (bucket->last) {
    *work = NULL;
    return ddp_allreduce(pg, buf, bucket->numel, dtype, DDP_REDUCE_SUM);
  }
  return ddp_allreduce_async(pg, buf, bucket->numel, dtype, DDP_REDUCE_SUM, work);
}

static ddp_status allreduce_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                                   ddp_work **work) {
  (void)state;
  return reduce(pg, bucket, bucket->grads, DDP_FLOAT32, work);
}

/* The loops take the bucket's fields into locals: through the bucket
 * pointer GCC must assume a gradient store may change numel. For float32
 * that kept the division scalar (one vdivss per gradient: 0.02 ms of a
 * world-2 ConvNet step on the critical path, 16 times the vectorised
 * loop's). */
static ddp_status allreduce_finish(void *state, ddp_dp_bucket *bucket) {
  const ddp_dp *dp = state;
  const float d = (float)bucket->divisor;
  if (d == 1.0f) return DDP_OK;
  /* On a GPU, a kernel on the compute stream: the allreduce it follows has
   * completed (the work was waited for), and the optimizer's kernels come
   * after it on the same stream. */
  if (dp->kernels) {
    dp->kernels->div(bucket->grads, d, (int64_t)bucket->numel);
    return DDP_OK;
  }
  float *restrict g = bucket->grads;
  const size_t n = bucket->numel;
  for (size_t i = 0; i < n; i++) g[i] /= d;
  return DDP_OK;
}

/* On a GPU the conversions are kernels on the compute stream; the
 * allreduce that reads the compressed copy is ordered after them (comm
 * orders a GPU operation after the compute stream, docs/comm.md). */
static ddp_status fp16_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                              ddp_work **work) {
  const ddp_dp *dp = state;
  const float d = (float)bucket->divisor;
  if (dp->kernels) {
    dp->kernels->to_half(bucket->scratch, bucket->grads, d, (int64_t)bucket->numel, false);
    return reduce(pg, bucket, bucket->scratch, DDP_FLOAT16, work);
  }
  ddp__basic_kernels_for(DDP_CPU)->to_half(bucket->scratch, bucket->grads, d,
                                           (int64_t)bucket->numel, false);
  return reduce(pg, bucket, bucket->scratch, DDP_FLOAT16, work);
}

static ddp_status fp16_finish(void *state, ddp_dp_bucket *bucket) {
  const ddp_dp *dp = state;
  if (dp->kernels) {
    dp->kernels->from_half(bucket->grads, bucket->scratch, (int64_t)bucket->numel, false);
    return DDP_OK;
  }
  ddp__basic_kernels_for(DDP_CPU)->from_half(bucket->grads, bucket->scratch,
                                             (int64_t)bucket->numel, false);
  return DDP_OK;
}

static ddp_status bf16_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                              ddp_work **work) {
  const ddp_dp *dp = state;
  const float d = (float)bucket->divisor;
  if (dp->kernels) {
    dp->kernels->to_half(bucket->scratch, bucket->grads, d, (int64_t)bucket->numel, true);
    return reduce(pg, bucket, bucket->scratch, DDP_BFLOAT16, work);
  }
  ddp__basic_kernels_for(DDP_CPU)->to_half(bucket->scratch, bucket->grads, d,
                                           (int64_t)bucket->numel, true);
  return reduce(pg, bucket, bucket->scratch, DDP_BFLOAT16, work);
}

static ddp_status bf16_finish(void *state, ddp_dp_bucket *bucket) {
  const ddp_dp *dp = state;
  if (dp->kernels) {
    dp->kernels->from_half(bucket->grads, bucket->scratch, (int64_t)bucket->numel, true);
    return DDP_OK;
  }
  ddp__basic_kernels_for(DDP_CPU)->from_half(bucket->grads, bucket->scratch,
                                             (int64_t)bucket->numel, true);
  return DDP_OK;
}

ddp_dp_comm_hook ddp__dp_builtin_hook(ddp_dp *dp, ddp_dp_hook_kind kind) {
  ddp_dp_comm_hook h = {allreduce_launch, allreduce_finish, dp};
  if (kind == DDP_DP_HOOK_FP16) {
    h.launch = fp16_launch;
    h.finish = fp16_finish;
  } else if (kind == DDP_DP_HOOK_BF16) {
    h.launch = bf16_launch;
    h.finish = bf16_finish;
  }
  return h;
}
