/* SGD with momentum, dampening, Nesterov and L2 weight decay: PyTorch 1.13's
 * _single_tensor_sgd in float32. Scalars are rounded to float as ATen does
 * when it applies a Python number to a float tensor, and each `add(x,
 * alpha=a)` is a fused multiply-add, as ATen's vectorised CPU kernel is.
 * The step's scalars (ddp__sgd_scalars_of) are shared with the CUDA kernel
 * (cuda/optim_kernels.cu), which repeats this loop on a GPU. */
#include <math.h>

#include "optim/optim_internal.h"

ddp__sgd_scalars ddp__sgd_scalars_of(const ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  ddp__sgd_scalars s;
  s.sign = o->maximize ? -1.0f : 1.0f;
  s.use_wd = o->weight_decay != 0.0;
  s.weight_decay = (float)o->weight_decay;
  s.neg_lr = (float)-o->lr;
  s.use_momentum = o->sgd.momentum != 0.0;
  s.momentum = (float)o->sgd.momentum;
  s.one_minus_dampening = (float)(1.0 - o->sgd.dampening);
  s.first = !opt->has_state; /* PyTorch: buf = clone(d_p), undampened */
  s.nesterov = o->sgd.nesterov;
  return s;
}

void ddp__sgd_step(ddp_optimizer *opt) {
  const ddp__sgd_scalars s = ddp__sgd_scalars_of(opt);
  float *param = opt->params;     /* (n,) */
  const float *grad = opt->grads; /* (n,) */
  const size_t n = opt->n;

  if (!s.use_momentum) {
    for (size_t i = 0; i < n; i++) {
      float d_p = s.sign * grad[i];
      if (s.use_wd) d_p = fmaf(param[i], s.weight_decay, d_p);
      param[i] = fmaf(d_p, s.neg_lr, param[i]);
    }
    return;
  }

  float *buf = opt->state[0].data; /* (n,) momentum_buffer */
  for (size_t i = 0; i < n; i++) {
    float d_p = s.sign * grad[i];
    if (s.use_wd) d_p = fmaf(param[i], s.weight_decay, d_p);
    if (s.first)
      buf[i] = d_p;
    else
      buf[i] = fmaf(d_p, s.one_minus_dampening, buf[i] * s.momentum);
    d_p = s.nesterov ? fmaf(buf[i], s.momentum, d_p) : buf[i];
    param[i] = fmaf(d_p, s.neg_lr, param[i]);
  }
}
