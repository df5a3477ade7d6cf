/* Adam (and AMSGrad) with L2 weight decay added to the gradient: PyTorch
 * 1.13's _single_tensor_adam in float32. The bias corrections are computed in
 * double from the float32 step, as Python does; then, per element,
 *   denom = sqrt(v) / sqrt(bc2) + eps      (eps after the correction)
 *   param += (-lr / bc1) * m / denom
 * in that order of float operations (ATen's addcmul/add are fused
 * multiply-adds, addcdiv is value * t1 / t2 then an add). */
#include <math.h>

#include "optim/optim_internal.h"

void ddp__adam_step(ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  float *param = opt->params;     /* (n,) */
  const float *grad = opt->grads; /* (n,) */
  const size_t n = opt->n;
  float *exp_avg = opt->state[1].data;    /* (n,) */
  float *exp_avg_sq = opt->state[2].data; /* (n,) */
  float *max_exp_avg_sq = o->adam.amsgrad ? opt->state[3].data : NULL; /* (n,) */

  opt->step_scalar += 1.0f; /* PyTorch keeps step as a float32 tensor */
  const double step = (double)opt->step_scalar;
  const double bias_correction1 = 1.0 - pow(o->adam.beta1, step);
  const double bias_correction2 = 1.0 - pow(o->adam.beta2, step);
  const double step_size = o->lr / bias_correction1;
  const float bc2_sqrt = (float)sqrt(bias_correction2);
  const float neg_step_size = (float)-step_size;

  const bool use_wd = o->weight_decay != 0.0;
  const float weight_decay = (float)o->weight_decay;
  const float beta1 = (float)o->adam.beta1;
  const float beta2 = (float)o->adam.beta2;
  const float one_minus_beta1 = (float)(1.0 - o->adam.beta1);
  const float one_minus_beta2 = (float)(1.0 - o->adam.beta2);
  const float eps = (float)o->adam.eps;
  const float sign = o->maximize ? -1.0f : 1.0f;

  for (size_t i = 0; i < n; i++) {
    float g = sign * grad[i];
    if (use_wd) g = fmaf(param[i], weight_decay, g);
    exp_avg[i] = fmaf(g, one_minus_beta1, exp_avg[i] * beta1);
    exp_avg_sq[i] = fmaf(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
    float v = exp_avg_sq[i];
    if (max_exp_avg_sq) {
      /* torch.maximum: NaN in either operand propagates. */
      float mx = max_exp_avg_sq[i];
      if (!(mx >= v) && !isnan(mx)) mx = v;
      max_exp_avg_sq[i] = mx;
      v = mx;
    }
    float denom = sqrtf(v) / bc2_sqrt + eps;
    param[i] = param[i] + neg_step_size * exp_avg[i] / denom;
  }
}
