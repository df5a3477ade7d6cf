/* Learning-rate schedules: PyTorch 1.13's _LRScheduler protocol (an initial
 * step at construction, a chainable step per epoch, a closed form for
 * step(epoch)) and StepLR, the one schedule so far. */
#include <math.h>

#include "optim/optim_internal.h"

typedef enum sched_kind { SCHED_STEP_LR = 0 } sched_kind;

struct ddp_scheduler {
  sched_kind kind;
  ddp_optimizer *opt; /* not owned */
  int64_t step_size;
  double gamma;
  ddp_scheduler_state state;
};

ddp_step_lr_options ddp_step_lr_defaults(int64_t step_size) {
  ddp_step_lr_options o = {0};
  o.step_size = step_size;
  o.gamma = 0.1;
  o.last_epoch = -1;
  o.base_lr = NAN;
  return o;
}

/* Python's floor division, for epochs before 0 too. */
static int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
  return q;
}

/* StepLR.get_lr, the chainable form: the optimizer's current lr, times gamma
 * when the epoch just entered is a non-zero multiple of step_size. */
static double step_lr_chainable(const ddp_scheduler *s) {
  double lr = ddp_optimizer_get_lr(s->opt);
  int64_t epoch = s->state.last_epoch;
  if (epoch == 0 || epoch % s->step_size != 0) return lr;
  return lr * s->gamma;
}

static ddp_status apply_lr(ddp_scheduler *s, double lr) {
  ddp_status st = ddp_optimizer_set_lr(s->opt, lr);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "steplr: epoch %lld", (long long)s->state.last_epoch);
  s->state.last_lr = lr;
  return DDP_OK;
}

ddp_status ddp_scheduler_create_step_lr(ddp_scheduler **out, ddp_optimizer *opt,
                                        const ddp_step_lr_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "steplr: out is NULL");
  *out = NULL;
  if (!opt) return ddp_error(DDP_ERR_INVALID, "steplr: optimizer is NULL");
  if (!options) return ddp_error(DDP_ERR_INVALID, "steplr: options is NULL");
  if (options->step_size <= 0)
    return ddp_error(DDP_ERR_INVALID, "steplr: step_size = %lld must be > 0",
                     (long long)options->step_size);
  if (!isfinite(options->gamma) || options->gamma < 0.0)
    return ddp_error(DDP_ERR_INVALID, "steplr: gamma = %g must be finite and >= 0",
                     options->gamma);
  if (options->last_epoch < -1)
    return ddp_error(DDP_ERR_INVALID, "steplr: last_epoch = %lld must be >= -1",
                     (long long)options->last_epoch);
  double base_lr = ddp_optimizer_get_lr(opt);
  if (options->last_epoch != -1) {
    /* PyTorch reads initial_lr from the param group when resuming. */
    if (!(options->base_lr >= 0.0))
      return ddp_error(DDP_ERR_INVALID,
                       "steplr: resuming at last_epoch = %lld needs base_lr (PyTorch's "
                       "initial_lr) >= 0, got %g",
                       (long long)options->last_epoch, options->base_lr);
    base_lr = options->base_lr;
  }

  ddp_scheduler *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "steplr: out of memory");
  s->kind = SCHED_STEP_LR;
  s->opt = opt;
  s->step_size = options->step_size;
  s->gamma = options->gamma;
  s->state.last_epoch = options->last_epoch;
  s->state.base_lr = base_lr;
  s->state.last_lr = ddp_optimizer_get_lr(opt);
  ddp_status st = ddp_scheduler_step(s); /* PyTorch's _initial_step */
  if (st != DDP_OK) {
    ddp_free(s);
    return st;
  }
  *out = s;
  return DDP_OK;
}

void ddp_scheduler_destroy(ddp_scheduler *sched) { ddp_free(sched); }

ddp_status ddp_scheduler_step(ddp_scheduler *sched) {
  if (!sched) return ddp_error(DDP_ERR_INVALID, "steplr: step on a NULL scheduler");
  sched->state.step_count++;
  sched->state.last_epoch++;
  return apply_lr(sched, step_lr_chainable(sched));
}

ddp_status ddp_scheduler_step_to(ddp_scheduler *sched, int64_t epoch) {
  if (!sched) return ddp_error(DDP_ERR_INVALID, "steplr: step on a NULL scheduler");
  sched->state.step_count++;
  sched->state.last_epoch = epoch;
  double k = (double)floor_div(epoch, sched->step_size);
  return apply_lr(sched, sched->state.base_lr * pow(sched->gamma, k));
}

double ddp_scheduler_get_last_lr(const ddp_scheduler *sched) { return sched->state.last_lr; }

void ddp_scheduler_state_get(const ddp_scheduler *sched, ddp_scheduler_state *out) {
  *out = sched->state;
}

ddp_status ddp_scheduler_state_load(ddp_scheduler *sched, const ddp_scheduler_state *state) {
  if (!sched || !state) return ddp_error(DDP_ERR_INVALID, "steplr: NULL scheduler or state");
  if (!(state->base_lr >= 0.0))
    return ddp_error(DDP_ERR_INVALID, "steplr: state base_lr = %g must be >= 0", state->base_lr);
  if (state->last_epoch < -1)
    return ddp_error(DDP_ERR_INVALID, "steplr: state last_epoch = %lld must be >= -1",
                     (long long)state->last_epoch);
  sched->state = *state;
  return DDP_OK;
}
