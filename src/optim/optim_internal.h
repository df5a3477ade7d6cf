/* Internals of the optim layer: the optimizer object shared by the generic
 * code (optimizer.c) and the per-algorithm update loops (sgd.c, adam.c,
 * adadelta.c). Not installed. */
#ifndef DDP_OPTIM_INTERNAL_H
#define DDP_OPTIM_INTERNAL_H

#include "ddp/optim.h"

#define DDP__OPTIM_MAX_STATE 4

struct ddp_optimizer {
  ddp_optim_options options; /* options.lr is the current lr */
  float *params;             /* (n,) caller's */
  const float *grads;        /* (n,) caller's, same layout */
  size_t n;
  float *state_mem;          /* one allocation: every buffer entry, n floats each */
  float step_scalar;         /* Adam's "step" (float32, as PyTorch keeps it) */
  ddp_optim_state state[DDP__OPTIM_MAX_STATE];
  size_t state_count;
  bool has_state;            /* a step or a load has filled the state */
  int64_t steps;
};

/* The update loops. Each reads opt->options and opt->state, runs one
 * PyTorch step over opt->n floats, and allocates nothing. */
void ddp__sgd_step(ddp_optimizer *opt);
void ddp__adam_step(ddp_optimizer *opt);
void ddp__adadelta_step(ddp_optimizer *opt);

/* The state entry named `name`, or NULL. */
ddp_optim_state *ddp__optim_state(ddp_optimizer *opt, const char *name);

#endif /* DDP_OPTIM_INTERNAL_H */
