/* Adadelta with L2 weight decay: PyTorch 1.13's _single_tensor_adadelta in
 * float32, per element
 *   square_avg = rho * square_avg + (1 - rho) * g * g
 *   delta      = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
 *   acc_delta  = rho * acc_delta + (1 - rho) * delta * delta
 *   param     -= lr * delta
 * with ATen's rounding: addcmul and add(alpha) are fused multiply-adds. */
#include <math.h>

#include "optim/optim_internal.h"

void ddp__adadelta_step(ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  float *param = opt->params;            /* (n,) */
  const float *grad = opt->grads;        /* (n,) */
  float *square_avg = opt->state[0].data; /* (n,) */
  float *acc_delta = opt->state[1].data;  /* (n,) */
  const size_t n = opt->n;
  const bool use_wd = o->weight_decay != 0.0;
  const float weight_decay = (float)o->weight_decay;
  const float rho = (float)o->adadelta.rho;
  const float one_minus_rho = (float)(1.0 - o->adadelta.rho);
  const float eps = (float)o->adadelta.eps;
  const float neg_lr = (float)-o->lr;
  const float sign = o->maximize ? -1.0f : 1.0f;

  for (size_t i = 0; i < n; i++) {
    float g = sign * grad[i];
    if (use_wd) g = fmaf(param[i], weight_decay, g);
    square_avg[i] = fmaf(one_minus_rho * g, g, square_avg[i] * rho);
    float std = sqrtf(square_avg[i] + eps);
    float delta = sqrtf(acc_delta[i] + eps) / std * g;
    acc_delta[i] = fmaf(one_minus_rho * delta, delta, acc_delta[i] * rho);
    param[i] = fmaf(delta, neg_lr, param[i]);
  }
}
