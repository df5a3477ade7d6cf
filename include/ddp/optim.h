/* ddp optim: optimizers (SGD, Adam, Adadelta) and learning-rate schedules
 * (StepLR) that reproduce PyTorch 1.13's single-tensor implementations in
 * float32, operation for operation (docs/optim.md has the formulas).
 *
 * Parameters and gradients live in flat float32 buffers of the same layout,
 * so an optimizer is one loop over n floats:
 *
 *   ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADAM);
 *   o.lr = 1e-3;
 *   o.weight_decay = 1e-4;
 *   ddp_optimizer *opt;
 *   DDP_TRY(ddp_optimizer_create(&opt, &o, params, grads, n));
 *   ddp_step_lr_options so = ddp_step_lr_defaults(30);   // every 30 epochs
 *   ddp_scheduler *sched;
 *   DDP_TRY(ddp_scheduler_create_step_lr(&sched, opt, &so));
 *   for (epoch...) { for (batch...) { ...backward...; ddp_optimizer_step(opt); }
 *                    ddp_scheduler_step(sched); }
 *
 * The optimizer's state (momentum buffers, Adam's moments, ...) is a set of
 * flat float32 arrays parallel to the parameters, named as in PyTorch's
 * optimizer.state[p], so a checkpoint can write and read them directly.
 *
 * On a GPU (options.device = DDP_CUDA(i)), params and grads are device
 * memory of that GPU, the state is too, and a step is one fused kernel
 * queued on the device's compute stream, computing what the CPU computes
 * (docs/optim.md, "On a CUDA device").
 *
 * Functions that take an optimizer or a scheduler need a valid one, except
 * where NULL is said to be accepted or reported. One object is used by one
 * thread at a time. */
#ifndef DDP_OPTIM_H
#define DDP_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Options -------------------------------------------------------------- */

typedef enum ddp_optim_kind {
  DDP_OPTIM_SGD = 0,
  DDP_OPTIM_ADAM = 1,
  DDP_OPTIM_ADADELTA = 2,
  DDP_OPTIM_KIND_COUNT
} ddp_optim_kind;

/* An optimizer's hyperparameters, PyTorch's constructor arguments. Start from
 * ddp_optim_defaults(kind) and change fields; only the member of the union
 * that matches `kind` is read. Caller-owned; the optimizer keeps a copy. */
typedef struct ddp_optim_options {
  ddp_optim_kind kind;
  double lr;           /* learning rate, >= 0 */
  double weight_decay; /* L2 penalty added to the gradient (not AdamW), >= 0 */
  bool maximize;       /* ascend instead of descend (negates the gradient) */
  union {
    struct {
      double momentum;  /* >= 0; 0 disables the momentum buffer */
      double dampening; /* not applied on the first step, as in PyTorch */
      bool nesterov;    /* requires momentum > 0 and dampening == 0 */
    } sgd;
    struct {
      double beta1, beta2; /* each in [0, 1) */
      double eps;          /* >= 0, added after the bias-corrected sqrt */
      bool amsgrad;
    } adam;
    struct {
      double rho; /* in [0, 1] */
      double eps; /* >= 0 */
    } adadelta;
  };
  /* Where params, grads and the state live: DDP_CPU (the default, all
   * zero) or DDP_CUDA(i) in a CUDA build. */
  ddp_device device;
  uint64_t reserved[3]; /* zero */
} ddp_optim_options;
DDP_STRUCT_SIZE(ddp_optim_options, 96);

/* PyTorch's defaults for `kind`: SGD lr 1e-3 (PyTorch 1.13 has no default
 * and requires one; 2.x uses 1e-3), momentum 0, dampening 0; Adam lr 1e-3,
 * betas (0.9, 0.999), eps 1e-8; Adadelta lr 1.0, rho 0.9, eps 1e-6; weight
 * decay 0, maximize false and device DDP_CPU for all. An unknown kind gives
 * SGD's. */
ddp_optim_options ddp_optim_defaults(ddp_optim_kind kind);
/* "sgd", "adam", "adadelta"; "unknown" otherwise. Never NULL. */
const char *ddp_optim_kind_name(ddp_optim_kind kind);

/* ---- Optimizer ------------------------------------------------------------ */

typedef struct ddp_optimizer ddp_optimizer;

/* Creates an optimizer that updates params[0..n) from grads[0..n). The
 * buffers stay the caller's and must outlive the optimizer; every state
 * buffer is allocated here, so ddp_optimizer_step never allocates.
 * Bad options return DDP_ERR_INVALID with a message naming the optimizer and
 * the option ("sgd: nesterov momentum requires momentum > 0 and dampening =
 * 0"); out of memory returns DDP_ERR_NOMEM. *out is NULL on failure.
 * With a CUDA device, params and grads must be that device's memory
 * (checked: DDP_ERR_INVALID) and the state is zeroed on its stream; a build
 * without CUDA returns DDP_ERR_UNSUPPORTED ("this build has no CUDA
 * backend"), a device that does not exist the error of ddp_device_check. */
ddp_status ddp_optimizer_create(ddp_optimizer **out, const ddp_optim_options *options,
                                float *params, const float *grads, size_t n);
/* Frees the optimizer and its state; accepts NULL. */
void ddp_optimizer_destroy(ddp_optimizer *opt);

/* One update of params from the current grads, as PyTorch's optimizer.step().
 * Makes no allocation. Fails only for a NULL optimizer. On a CUDA device
 * the update is queued on the device's compute stream, after the work that
 * wrote the grads, and returns at once; a failed kernel is reported by the
 * next synchronizing call (ddp_device_synchronize). */
ddp_status ddp_optimizer_step(ddp_optimizer *opt);

/* The learning rate used by the next step (PyTorch's param_groups[0]["lr"]).
 * Schedulers set it; a negative or NaN lr is DDP_ERR_INVALID. */
ddp_status ddp_optimizer_set_lr(ddp_optimizer *opt, double lr);
double ddp_optimizer_get_lr(const ddp_optimizer *opt);
/* The options it was created with (lr as set since). Valid until destroy. */
const ddp_optim_options *ddp_optimizer_options(const ddp_optimizer *opt);
/* Steps taken (for Adam, the "step" state, which a load replaces). */
int64_t ddp_optimizer_step_count(const ddp_optimizer *opt);
/* Number of floats in the parameter buffer. */
size_t ddp_optimizer_numel(const ddp_optimizer *opt);

/* ---- State, for checkpoints -------------------------------------------------
 * Entries by kind, in this order (PyTorch's keys of optimizer.state[p]):
 *   SGD       momentum_buffer                      (only when momentum != 0)
 *   Adam      step, exp_avg, exp_avg_sq, max_exp_avg_sq (the last with amsgrad)
 *   Adadelta  square_avg, acc_delta
 * A buffer has n floats laid out like the parameters; a scalar ("step", a
 * float32 in PyTorch too) has one float and shape () — PyTorch keeps one
 * per parameter tensor, all equal. PyTorch's state is empty until the first
 * step; here the arrays always exist (zero) and ddp_optimizer_has_state says
 * whether they hold state yet, so a checkpoint writer can skip them as
 * PyTorch's state_dict would. A step or a load makes it true.
 * On a CUDA device, a buffer's `data` from state_get/state_find is a host
 * copy the call makes (waiting for the queued steps): it stays valid until
 * destroy, but the next state_get/state_find of that entry overwrites it,
 * and writing into it does not reach the optimizer (use state_load). Those
 * calls can then also fail with the copy's error (naming the device); *out
 * is filled all the same, its data holding the previous copy. */
typedef struct ddp_optim_state {
  const char *name; /* static string, PyTorch's key: "exp_avg" */
  float *data;      /* numel floats, owned by the optimizer, valid until destroy */
  size_t numel;     /* n for a buffer, 1 for a scalar */
  bool is_scalar;   /* shape () rather than the parameters' layout */
} ddp_optim_state;

/* Number of state entries this optimizer has (fixed at create). */
size_t ddp_optimizer_state_count(const ddp_optimizer *opt);
/* Entry `index` (< state_count) into *out; DDP_ERR_RANGE otherwise. */
ddp_status ddp_optimizer_state_get(ddp_optimizer *opt, size_t index, ddp_optim_state *out);
/* Entry by name into *out; DDP_ERR_NOTFOUND (message lists the names) if the
 * optimizer has no such entry (e.g. "max_exp_avg_sq" without amsgrad). */
ddp_status ddp_optimizer_state_find(ddp_optimizer *opt, const char *name, ddp_optim_state *out);
/* Copies numel floats into the entry `name` and marks the state present.
 * numel must be the entry's (n, or 1 for a scalar): DDP_ERR_SHAPE otherwise.
 * A checkpoint loads every entry; one left out keeps its current values.
 * Loading Adam's "step" also sets ddp_optimizer_step_count. */
ddp_status ddp_optimizer_state_load(ddp_optimizer *opt, const char *name, const float *data,
                                    size_t numel);
/* Whether the state holds values from a step or a load (PyTorch's state is
 * non-empty). Before that, the first SGD step copies the gradient into the
 * momentum buffer instead of decaying it. */
bool ddp_optimizer_has_state(const ddp_optimizer *opt);

/* Moves the per-parameter state when the flat layout of params and grads
 * changes (ddp_model_relayout): in every state buffer, segment i of
 * lengths[i] floats moves from old_offsets[i] to new_offsets[i]. The segments
 * must tile [0, n) before and after (checked: bounds and total length,
 * DDP_ERR_RANGE otherwise). Scalars ("step") stay. The params and grads
 * themselves are the caller's to move. Allocates a temporary of n floats;
 * not for the steady state. On a CUDA device the buffers move through the
 * host copy of the state (no allocation; one copy per segment). */
ddp_status ddp_optimizer_relayout(ddp_optimizer *opt, size_t n_segments,
                                  const int64_t *old_offsets, const int64_t *new_offsets,
                                  const int64_t *lengths);

/* Narrows the optimizer to floats [offset, offset + n) of the buffers it
 * covers (ZeRO's shard of the optimizer state, include/ddp/zero.h): from
 * then on it updates params + offset from grads + offset, n floats, and
 * every buffer entry of its state holds that range only (kept as it was;
 * the rest is freed: the state's memory becomes n floats per entry).
 * Scalars ("step"), the lr and has_state are kept. Allocates the narrowed
 * state once; not for the steady state. CPU only (DDP_ERR_UNSUPPORTED on a
 * device); n == 0 or a range past the buffers is DDP_ERR_RANGE, out of
 * memory DDP_ERR_NOMEM; on error the optimizer is unchanged. */
ddp_status ddp_optimizer_narrow(ddp_optimizer *opt, size_t offset, size_t n);

/* ---- Learning-rate schedules -------------------------------------------- */

typedef struct ddp_scheduler ddp_scheduler;

/* StepLR: decays the lr by gamma every step_size epochs. */
typedef struct ddp_step_lr_options {
  int64_t step_size;  /* epochs between decays, > 0 */
  double gamma;       /* multiplicative factor */
  int64_t last_epoch; /* -1 to start fresh; >= 0 to resume (needs base_lr) */
  double base_lr;     /* PyTorch's initial_lr; read only when last_epoch >= 0 */
  uint64_t reserved[2];
} ddp_step_lr_options;
DDP_STRUCT_SIZE(ddp_step_lr_options, 48);

/* step_size as given, gamma 0.1, last_epoch -1, base_lr NaN. */
ddp_step_lr_options ddp_step_lr_defaults(int64_t step_size);

/* Creates a StepLR driving `opt` (which must outlive it) and takes PyTorch's
 * initial step: last_epoch becomes last_epoch + 1. Fresh (last_epoch -1), the
 * base lr is the optimizer's lr; resuming, it is options->base_lr, and the
 * initial step applies the decay due at the new epoch, as PyTorch does.
 * Bad options are DDP_ERR_INVALID naming "steplr" and the option. */
ddp_status ddp_scheduler_create_step_lr(ddp_scheduler **out, ddp_optimizer *opt,
                                        const ddp_step_lr_options *options);
/* Accepts NULL. Leaves the optimizer's lr as it is. */
void ddp_scheduler_destroy(ddp_scheduler *sched);

/* Advances one epoch, in PyTorch's chainable form: lr *= gamma when the new
 * epoch is a non-zero multiple of step_size, else unchanged, so an lr set by
 * hand in between is kept. Call after the epoch's optimizer steps. */
ddp_status ddp_scheduler_step(ddp_scheduler *sched);
/* Jumps to `epoch` in closed form, lr = base_lr * gamma^floor(epoch /
 * step_size) (PyTorch's deprecated step(epoch)). */
ddp_status ddp_scheduler_step_to(ddp_scheduler *sched, int64_t epoch);
/* The lr the last step set (PyTorch's get_last_lr()[0]). */
double ddp_scheduler_get_last_lr(const ddp_scheduler *sched);

/* The scheduler's state_dict: what a resumed job needs besides the
 * optimizer's lr (which PyTorch keeps in the optimizer's param_groups). */
typedef struct ddp_scheduler_state {
  int64_t last_epoch;
  int64_t step_count; /* PyTorch's _step_count: steps including the initial one */
  double base_lr;     /* base_lrs[0] */
  double last_lr;     /* _last_lr[0] */
} ddp_scheduler_state;

void ddp_scheduler_state_get(const ddp_scheduler *sched, ddp_scheduler_state *out);
/* Replaces the state (PyTorch's load_state_dict); the optimizer's lr is not
 * touched. A negative base_lr or last_epoch < -1 is DDP_ERR_INVALID. */
ddp_status ddp_scheduler_state_load(ddp_scheduler *sched, const ddp_scheduler_state *state);


/* ---- Gradient scaling (PyTorch's torch.amp.GradScaler) ---------------------
 * Mixed precision in fp16 loses small gradients to underflow; a GradScaler
 * multiplies the loss (in ddp: the seed of backward's loss gradient) by a
 * large power of two, so the gradients come out scaled, then divides them
 * back before the optimizer, skipping the step when any is inf or NaN and
 * adapting the scale (docs/mixed-precision.md):
 *
 *   ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
 *   for (...) {
 *     seed = ddp_grad_scaler_loss_seed(&gs);         // backward from loss * seed
 *     ... backward ...
 *     bool found_inf = ddp_grad_scaler_unscale(&gs, grads, n);   // grads *= 1/scale
 *     // (reduce found_inf over the data-parallel group: ddp/train.h does)
 *     if (!found_inf) ddp_optimizer_step(opt);
 *     ddp_grad_scaler_update(&gs, found_inf);
 *   }
 *
 * The arithmetic is PyTorch 2.x's, float for float: the scale is a float32,
 * the reciprocal is computed in float64 and rounded to float32, each
 * gradient is multiplied by it in float32 (left alone when it is 1), and
 * the update multiplies the float32 scale by the float64 factor and rounds
 * (_amp_update_scale_). A transparent value the caller keeps: no
 * allocation, nothing to free; one thread at a time. */
typedef struct ddp_grad_scaler {
  float scale;             /* PyTorch's _scale (float32; init_scale 2^16) */
  int32_t growth_tracker;  /* _growth_tracker: consecutive unskipped steps (int32, as PyTorch) */
  double growth_factor;    /* > 1 (2.0) */
  double backoff_factor;   /* in (0, 1) (0.5) */
  int64_t growth_interval; /* > 0 (2000) */
  /* false: the loss seed is 1, unscale finds nothing and changes nothing,
   * update does nothing (PyTorch's enabled=False) */
  bool enabled;
  uint64_t reserved[2]; /* zero */
} ddp_grad_scaler;
DDP_STRUCT_SIZE(ddp_grad_scaler, 56);

/* PyTorch's defaults: scale 65536 (2^16), growth_factor 2, backoff_factor
 * 0.5, growth_interval 2000, tracker 0. */
ddp_grad_scaler ddp_grad_scaler_defaults(bool enabled);
/* DDP_ERR_INVALID naming the field when a value is impossible: scale not
 * finite or <= 0, growth_factor <= 1, backoff_factor outside (0, 1) (the
 * bounds PyTorch's constructor asserts), growth_interval < 1 or past
 * INT32_MAX, tracker outside [0, growth_interval). For a state built by
 * hand or read from a checkpoint. */
ddp_status ddp_grad_scaler_check(const ddp_grad_scaler *gs);
/* The seed of backward's loss gradient: the scale when enabled, else 1. */
float ddp_grad_scaler_loss_seed(const ddp_grad_scaler *gs);
/* 1 / scale as PyTorch computes it: in float64, rounded to float32. */
float ddp_grad_scaler_inv_scale(const ddp_grad_scaler *gs);
/* Unscales grads[0..n) in place (each times the inverse scale, in float32)
 * and returns whether any of them was inf or NaN before it was unscaled
 * (PyTorch's _amp_foreach_non_finite_check_and_unscale_). Disabled: false,
 * grads untouched. Host memory only. Allocates nothing. */
bool ddp_grad_scaler_unscale(const ddp_grad_scaler *gs, float *grads, size_t n);
/* The same for grads in `device`'s memory: on a GPU one kernel over the
 * flat buffer unscales and checks, and its one flag is read back (this
 * waits for the device: the step's decision needs the answer). A device
 * that failed counts as a finding (true: the step is skipped, and the
 * failure is reported by the next synchronize). The CPU: as above. */
bool ddp_grad_scaler_unscale_on(const ddp_grad_scaler *gs, ddp_device device, float *grads,
                                size_t n);
/* After the step (taken or skipped), with the found_inf every rank agreed
 * on: inf/NaN found multiplies the scale by backoff_factor and resets the
 * tracker; else the tracker counts the step and, on reaching
 * growth_interval, the scale grows by growth_factor (kept when that would
 * overflow float32) and the tracker restarts at 0. Disabled: nothing. */
void ddp_grad_scaler_update(ddp_grad_scaler *gs, bool found_inf);

#ifdef __cplusplus
}
#endif
#endif /* DDP_OPTIM_H */
