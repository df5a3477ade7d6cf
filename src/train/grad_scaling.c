/* Mixed precision in the trainer (issue 42; docs/mixed-precision.md): the
 * precision option checked, the GradScaler (include/ddp/optim.h) made
 * from the options, and the optimizer step every strategy takes once its
 * gradients are final: unscale, the inf/NaN finding agreed over the group,
 * clipping, the step or its skip, the scaler's update. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tape.h" /* ddp__basic_kernels_for: the gradients' device */
#include "train/train_internal.h"

static const char *precision_name(int32_t p) {
  switch (p) {
  case DDP_PRECISION_FP32: return "fp32";
  case DDP_PRECISION_BF16: return "bf16";
  case DDP_PRECISION_FP16: return "fp16";
  case DDP_PRECISION_TF32: return "tf32";
  }
  return "unknown";
}

static bool scaler_wanted(const ddp_train_options *o) {
  if (o->grad_scaler == DDP_TRAIN_GRAD_SCALER_ON) return true;
  if (o->grad_scaler == DDP_TRAIN_GRAD_SCALER_OFF) return false;
  return o->precision == DDP_PRECISION_FP16;
}

ddp_status ddp__train_precision_check(const ddp_train_options *o) {
  if (o->precision < 0 || o->precision >= DDP_PRECISION_COUNT)
    return ddp_error(DDP_ERR_INVALID, "precision is %d (fp32 0, bf16 1, fp16 2, tf32 3)",
                     (int)o->precision);
  if (o->precision == DDP_PRECISION_TF32 && o->device.type == DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "precision tf32: TensorFloat-32 is a GPU-only opt-in (tensor-core "
                     "matmuls on NVIDIA Ampere and later); on the CPU use fp32, or bf16");
  if (o->precision == DDP_PRECISION_TF32 && !ddp_cuda_built())
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "precision tf32 on %s: this build has no CUDA backend",
                     o->device.type == DDP_DEVICE_CUDA ? "a GPU" : "this device");
  if (o->grad_scaler < DDP_TRAIN_GRAD_SCALER_AUTO || o->grad_scaler > DDP_TRAIN_GRAD_SCALER_OFF)
    return ddp_error(DDP_ERR_INVALID, "grad_scaler is %d (auto 0, on 1, off 2)", (int)o->grad_scaler);
  if (o->grad_scaler_growth_interval < 0)
    return ddp_error(DDP_ERR_INVALID, "grad_scaler_growth_interval is %d (> 0, or 0 for 2000)",
                     (int)o->grad_scaler_growth_interval);
  if (!scaler_wanted(o)) return DDP_OK;
  /* Where the scaler cannot act (yet): say so rather than train unscaled. */
  const char *why = NULL;
  if (o->cuda_graph)
    why = "a CUDA graph's replayed step bakes the loss's scale in at capture and steps "
          "without the scaler's check";
  else if (o->param_server)
    why = "the parameter server's servers step the optimizer, not the trainers";
  if (why)
    return ddp_error(DDP_ERR_UNSUPPORTED, "precision %s with the gradient scaler: %s (use "
                     "--grad-scaler off, or bf16, which needs no scaler)",
                     precision_name(o->precision), why);
  return DDP_OK;
}

static bool autocast_on(const ddp_trainer *t) {
  return t->o.precision == DDP_PRECISION_BF16 || t->o.precision == DDP_PRECISION_FP16;
}

ddp_status ddp__train_tf32_apply(const ddp_trainer *t) {
  if (t->o.precision != DDP_PRECISION_TF32) return DDP_OK;
  ddp_status s = ddp_cuda_allow_tf32(true);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "precision tf32");
}

ddp_status ddp__train_autocast_enter(const ddp_trainer *t) {
  if (!autocast_on(t)) return DDP_OK;
  ddp_status s = ddp_autocast_enter((ddp_precision)t->o.precision);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "entering the %s autocast region",
                                               precision_name(t->o.precision));
}

void ddp__train_autocast_exit(const ddp_trainer *t) {
  if (autocast_on(t)) (void)ddp_autocast_exit(); /* entered above: cannot fail */
}

/* DDP_TEST_INJECT_INF=STEP[:RANK]: at optimizer step STEP (1-based, counted
 * from the start of training) rank RANK (every rank without one) puts an
 * inf into its first gradient after backward, as an fp16 overflow would:
 * the tests' way to make a step overflow on one rank (docs/mixed-precision.md). */
static ddp_status read_inject_hook(ddp_trainer *t) {
  t->inject_inf_step = 0;
  t->inject_inf_rank = -1;
  const char *v = getenv("DDP_TEST_INJECT_INF");
  if (!v || !v[0]) return DDP_OK;
  long long step = 0;
  int rank = -1, n = 0;
  if (sscanf(v, "%lld%n", &step, &n) != 1 || step < 1 ||
      (v[n] && (v[n] != ':' || sscanf(v + n + 1, "%d", &rank) != 1 || rank < 0)))
    return ddp_error(DDP_ERR_INVALID, "DDP_TEST_INJECT_INF=%s: expected STEP or STEP:RANK "
                     "(STEP >= 1)", v);
  t->inject_inf_step = step;
  t->inject_inf_rank = rank;
  return DDP_OK;
}

ddp_status ddp__train_scaler_init(ddp_trainer *t) {
  const ddp_train_options *o = &t->o;
  t->scaler = ddp_grad_scaler_defaults(scaler_wanted(o));
  if (o->grad_scaler_growth_interval > 0) t->scaler.growth_interval = o->grad_scaler_growth_interval;
  t->skipped_steps = 0;
  t->last_skipped = false;
  return read_inject_hook(t);
}

float ddp__train_loss_seed(const ddp_trainer *t) { return ddp_grad_scaler_loss_seed(&t->scaler); }

/* Whether any rank of the group found an inf/NaN: one float32 MAX over the
 * trainer's whole group (a pipeline's too: every stage of every replica
 * skips together, or the stages' parameters would drift apart). */
static ddp_status agree(ddp_trainer *t, bool *found) {
  if (!t->pg || t->size < 2) return DDP_OK;
  float v = *found ? 1.0f : 0.0f;
  ddp_process_group *pg = t->pg;
  ddp_status s = ddp_process_group_takes_host(pg) ? DDP_OK : ddp_process_group_host_group(pg, &pg);
  if (s == DDP_OK) s = ddp_allreduce(pg, &v, 1, DDP_FLOAT32, DDP_REDUCE_MAX);
  if (s != DDP_OK) return ddp_error_wrap(s, "agreeing on the gradient scaler's inf/NaN check");
  *found = v > 0;
  return DDP_OK;
}

ddp_status ddp__train_optimizer_step(ddp_trainer *t) {
  bool found = false;
  if (t->scaler.enabled) {
    int64_t offset = 0, n = ddp_model_num_param_elements(t->step_model);
    if (t->strategy->grad_range) t->strategy->grad_range(t, &offset, &n);
    float *g = ddp_model_grads_flat(t->step_model) + offset;
    if (t->inject_inf_step == t->step_now && n > 0 &&
        (t->inject_inf_rank < 0 || t->inject_inf_rank == t->rank)) {
      const ddp__basic_kernels *k = ddp__basic_kernels_for(t->o.device);
      if (k) k->fill(g, INFINITY, 1); /* g may be a GPU's memory */
    }
    /* one pass on the gradients' device (a kernel on a GPU) */
    found = ddp_grad_scaler_unscale_on(&t->scaler, t->o.device, g, (size_t)n);
    DDP_TRY(agree(t, &found));
  }
  /* Gradient clipping (options.clip_grad_norm, step.c): after the
   * unscale, before the step, as PyTorch's recipe has it
   * (scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)). A
   * step the scaler skips is not clipped: its norm is inf/NaN, and the
   * finding is agreed, so every rank of a sharded norm's allreduce skips
   * it alike. */
  if (!found) DDP_TRY(ddp__train_clip(t));
  if (!found) {
    ddp_status s = ddp_optimizer_step(t->opt);
    if (s != DDP_OK) return ddp_error_wrap(s, "optimizer step");
  }
  t->last_skipped = found;
  t->skipped_steps += found;
  ddp_grad_scaler_update(&t->scaler, found);
  return DDP_OK;
}
