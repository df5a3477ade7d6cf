/* Autocast's internals for the ops (docs/tensor.md, "Mixed precision"):
 * which precision an op computes in, the marks on float32 tensors that
 * hold bfloat16 / float16 values, and the rounded operands (parameters
 * through the thread's cast cache, other tensors in tape scratch). */
#ifndef DDP__TENSOR_AUTOCAST_H
#define DDP__TENSOR_AUTOCAST_H

#include "ddp/tensor.h"

/* A float32 tensor whose values are exactly bfloat16 (float16) values: the
 * output dtype PyTorch's autocast would give it (ddp_tensor_values_dtype). */
#define DDP__TENSOR_BF16_VALUES 0x200u
#define DDP__TENSOR_F16_VALUES 0x400u
#define DDP__TENSOR_LOW_VALUES (DDP__TENSOR_BF16_VALUES | DDP__TENSOR_F16_VALUES)

/* DDP_BFLOAT16 / DDP_FLOAT16 when t (may be NULL) carries that mark, else
 * DDP_FLOAT32. */
static inline ddp_dtype ddp__low_dtype(const ddp_tensor *t) {
  if (!t) return DDP_FLOAT32;
  if (t->flags & DDP__TENSOR_BF16_VALUES) return DDP_BFLOAT16;
  if (t->flags & DDP__TENSOR_F16_VALUES) return DDP_FLOAT16;
  return DDP_FLOAT32;
}

/* The dtype a lower_precision_fp op (linear, matmul, conv2d) on `x`
 * computes in: this thread's region's BF16 / FP16 (a CPU or a GPU tensor:
 * both devices' autocast lists hold these ops), else DDP_FLOAT32 (no
 * region, a region with autocast off or TF32). */
ddp_dtype ddp__autocast_op_dtype(const ddp_tensor *x);

/* The dtype of an op that runs in its inputs' precision (PyTorch's type
 * promotion): the low dtype when every one of the n float inputs (NULL
 * entries skipped) carries the same mark, else DDP_FLOAT32. */
ddp_dtype ddp__autocast_promote(int n, ddp_tensor *const *inputs);

/* Marks y as holding `low` values (nothing for DDP_FLOAT32); with `round`,
 * first rounds y's data to them in place (CPU tensors). */
void ddp__autocast_mark(ddp_tensor *y, ddp_dtype low, bool round);

/* t's values rounded to `low`, as float32 for the kernels: t's own data when
 * it already holds such values (or low is DDP_FLOAT32); the cast cache's
 * copy for a leaf that requires grad when `cache` (forward inside a
 * region); else a rounded copy in the tape's scratch. NULL t gives NULL.
 * NULL with *status set on failure (out of memory). */
const float *ddp__autocast_operand(ddp_tape *tape, ddp_tensor *t, ddp_dtype low, bool cache,
                                   ddp_status *status);

/* t's values (or, with `data` not NULL, those n = t->numel floats on t's
 * device, a rounded gradient) as 16-bit bfloat16 / float16 (low) on t's
 * device, rounded to nearest even: the operands of a GPU's low-precision
 * GEMM (ddp__dense_kernels' gemm_low). A parameter's (data NULL, `cache`,
 * a leaf that requires grad inside a region) comes from the cast cache,
 * made once per region as PyTorch's autocast caches its casts; others are
 * converted into tape scratch on t's device. NULL t gives NULL. */
const uint16_t *ddp__autocast_half(ddp_tape *tape, ddp_tensor *t, const float *data,
                                   ddp_dtype low, bool cache, ddp_status *status);

/* op(t) packed for the device's bfloat16 GEMM (ddp__dense_kernels'
 * gemm_bf16; t (k, n), or (n, k) when trans): through the cast cache for a
 * parameter when `cache` (forward inside a region), else in tape scratch. */
const uint16_t *ddp__autocast_packed(ddp_tape *tape, ddp_tensor *t, bool trans, int64_t k,
                                     int64_t n, bool cache, ddp_status *status);

/* For the backward of a low-precision op (ctx holds its dtype `low`):
 *   dy rounded to `low` (the gradient of a low-precision tensor is one);
 *   ddp__autocast_grad_scratch: a float32 buffer of numel in tape scratch
 *     (zeroed with `zero`, for kernels that accumulate into it; not for
 *     those that write every element), for a gradient, or NULL (with
 *     *status DDP_OK) when t (NULL ok) needs none;
 *   ddp__autocast_grad_deliver: rounds that gradient to `low` (the dtype
 *     PyTorch computes it in) and adds it to t's float32 gradient (assigns
 *     when first: ddp__tape_grad_out), as the backward of PyTorch's cast
 *     to the low dtype hands a parameter float32 values.
 * Each returns NULL / a status with the error set on failure. */
const float *ddp__autocast_round_grad(ddp_tape *tape, const ddp_tensor *out, ddp_dtype low,
                                      ddp_status *status);
float *ddp__autocast_grad_scratch(ddp_tape *tape, const ddp_tensor *t, bool zero,
                                  ddp_status *status);
ddp_status ddp__autocast_grad_deliver(ddp_tape *tape, ddp_tensor *t, float *grad,
                                      ddp_dtype low);

/* What the CPU's low-precision ops run on now, in words (benchmarks). */
const char *ddp__autocast_kernels(void);

/* Tests: the thread's cast-cache counters since its creation: hits (a
 * cached copy reused), fills (a copy made), allocations (entry buffers
 * allocated or grown). */
typedef struct ddp__autocast_cache_stats {
  int64_t hits, fills, allocations;
} ddp__autocast_cache_stats;
ddp__autocast_cache_stats ddp__autocast_cache_counters(void);

#endif /* DDP__TENSOR_AUTOCAST_H */
