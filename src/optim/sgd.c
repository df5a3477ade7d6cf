/* SGD with momentum, dampening, Nesterov and L2 weight decay: PyTorch 1.13's
 * _single_tensor_sgd in float32. Scalars are rounded to float as ATen does
 * when it applies a Python number to a float tensor, and each `add(x,
 * alpha=a)` is a fused multiply-add, as ATen's vectorised CPU kernel is. */
#include <math.h>

#include "optim/optim_internal.h"

void ddp__sgd_step(ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  float *param = opt->params;     /* (n,) */
  const float *grad = opt->grads; /* (n,) */
  const size_t n = opt->n;
  const bool use_wd = o->weight_decay != 0.0;
  const float weight_decay = (float)o->weight_decay;
  const float neg_lr = (float)-o->lr;
  const float sign = o->maximize ? -1.0f : 1.0f;

  if (o->sgd.momentum == 0.0) {
    for (size_t i = 0; i < n; i++) {
      float d_p = sign * grad[i];
      if (use_wd) d_p = fmaf(param[i], weight_decay, d_p);
      param[i] = fmaf(d_p, neg_lr, param[i]);
    }
    return;
  }

  float *buf = opt->state[0].data; /* (n,) momentum_buffer */
  const float momentum = (float)o->sgd.momentum;
  const float one_minus_dampening = (float)(1.0 - o->sgd.dampening);
  const bool first = !opt->has_state; /* PyTorch: buf = clone(d_p), undampened */
  const bool nesterov = o->sgd.nesterov;
  for (size_t i = 0; i < n; i++) {
    float d_p = sign * grad[i];
    if (use_wd) d_p = fmaf(param[i], weight_decay, d_p);
    if (first)
      buf[i] = d_p;
    else
      buf[i] = fmaf(d_p, one_minus_dampening, buf[i] * momentum);
    d_p = nesterov ? fmaf(buf[i], momentum, d_p) : buf[i];
    param[i] = fmaf(d_p, neg_lr, param[i]);
  }
}
