/* Adadelta with L2 weight decay: PyTorch 1.13's _single_tensor_adadelta in
 * float32, per element
 *   square_avg = rho * square_avg + (1 - rho) * g * g
 *   delta      = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
 *   acc_delta  = rho * acc_delta + (1 - rho) * delta * delta
 *   param     -= lr * delta
 * with ATen's rounding: addcmul and add(alpha) are fused multiply-adds.
 * The step's scalars (ddp__adadelta_scalars_of) are shared with the CUDA kernel
 * (cuda/optim_kernels.cu), which repeats this loop on a GPU. */
#include <math.h>

#include "optim/optim_internal.h"

ddp__adadelta_scalars ddp__adadelta_scalars_of(const ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  ddp__adadelta_scalars s;
  s.use_wd = o->weight_decay != 0.0;
  s.weight_decay = (float)o->weight_decay;
  s.rho = (float)o->adadelta.rho;
  s.one_minus_rho = (float)(1.0 - o->adadelta.rho);
  s.eps = (float)o->adadelta.eps;
  s.neg_lr = (float)-o->lr;
  s.sign = o->maximize ? -1.0f : 1.0f;
  return s;
}

void ddp__adadelta_step(ddp_optimizer *opt) {
  const ddp__adadelta_scalars s = ddp__adadelta_scalars_of(opt);
  float *param = opt->params;             /* (n,) */
  const float *grad = opt->grads;         /* (n,) */
  float *square_avg = opt->state[0].data; /* (n,) */
  float *acc_delta = opt->state[1].data;  /* (n,) */
  const size_t n = opt->n;

  for (size_t i = 0; i < n; i++) {
    float g = s.sign * grad[i];
    if (s.use_wd) g = fmaf(param[i], s.weight_decay, g);
    square_avg[i] = fmaf(s.one_minus_rho * g, g, square_avg[i] * s.rho);
    float std = sqrtf(square_avg[i] + s.eps);
    float delta = sqrtf(acc_delta[i] + s.eps) / std * g;
    acc_delta[i] = fmaf(s.one_minus_rho * delta, delta, acc_delta[i] * s.rho);
    param[i] = fmaf(delta, s.neg_lr, param[i]);
  }
}
