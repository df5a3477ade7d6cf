/* Internals of the optim layer: the optimizer object shared by the generic
 * code (optimizer.c), the per-algorithm update loops (sgd.c, adam.c,
 * adadelta.c) and their CUDA kernels (cuda/optim_kernels.cu). Not
 * installed. */
#ifndef DDP_OPTIM_INTERNAL_H
#define DDP_OPTIM_INTERNAL_H

#include "ddp/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP__OPTIM_MAX_STATE 4

struct ddp_optimizer {
  ddp_optim_options options; /* options.lr is the current lr */
  float *params;             /* (n,) caller's, on options.device */
  const float *grads;        /* (n,) caller's, same layout and device */
  size_t n;
  float *state_mem;          /* one allocation: every buffer entry, n floats each;
                                device memory when on_device */
  float *state_host;         /* on_device: host copy of state_mem for state access
                                and relayout (same layout); NULL on the CPU */
  bool on_device;            /* options.device is a GPU */
  float step_scalar;         /* Adam's "step" (float32, as PyTorch keeps it); host */
  ddp_optim_state state[DDP__OPTIM_MAX_STATE]; /* data into state_mem, or &step_scalar */
  size_t state_count;
  bool has_state;            /* a step or a load has filled the state */
  int64_t steps;
};

/* The scalars of one step, rounded to float as ATen applies them, computed
 * on the host by ddp__<algo>_scalars and used by the CPU loop and, passed by
 * value, by the CUDA kernel: both paths then round them identically. */
typedef struct ddp__sgd_scalars {
  float sign;                /* -1 with maximize, else 1 */
  float weight_decay;        /* (float)weight_decay, used when use_wd */
  float neg_lr;              /* (float)-lr */
  float momentum;            /* (float)momentum */
  float one_minus_dampening; /* (float)(1 - dampening), the subtraction in double */
  bool use_wd;               /* weight_decay != 0 */
  bool use_momentum;         /* momentum != 0: state[0] is momentum_buffer */
  bool first;                /* no state yet: the buffer takes the gradient */
  bool nesterov;
} ddp__sgd_scalars;

typedef struct ddp__adam_scalars {
  float sign, weight_decay;
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2; /* subtractions in double */
  float eps;
  float bc2_sqrt;      /* (float)sqrt(1 - beta2^step), in double */
  float neg_step_size; /* (float)-(lr / (1 - beta1^step)), in double */
  bool use_wd;
} ddp__adam_scalars;

typedef struct ddp__adadelta_scalars {
  float sign, weight_decay;
  float rho, one_minus_rho, eps, neg_lr;
  bool use_wd;
} ddp__adadelta_scalars;

/* The scalars of the next step. Adam's advances step_scalar (PyTorch's
 * state["step"] += 1) and derives the bias corrections from it. */
ddp__sgd_scalars ddp__sgd_scalars_of(const ddp_optimizer *opt);
ddp__adam_scalars ddp__adam_next_scalars(ddp_optimizer *opt);
ddp__adadelta_scalars ddp__adadelta_scalars_of(const ddp_optimizer *opt);

/* The CPU update loops. Each reads opt->options and opt->state, runs one
 * PyTorch step over opt->n floats, and allocates nothing. */
void ddp__sgd_step(ddp_optimizer *opt);
void ddp__adam_step(ddp_optimizer *opt);
void ddp__adadelta_step(ddp_optimizer *opt);

/* The state entry named `name`, or NULL. */
ddp_optim_state *ddp__optim_state(ddp_optimizer *opt, const char *name);

#ifdef __cplusplus
}
#endif

#endif /* DDP_OPTIM_INTERNAL_H */
