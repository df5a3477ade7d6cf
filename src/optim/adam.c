/* Adam (and AMSGrad) with L2 weight decay added to the gradient: PyTorch
 * 1.13's _single_tensor_adam in float32. The bias corrections are computed in
 * double from the float32 step, as Python does; then, per element,
 *   denom = sqrt(v) / sqrt(bc2) + eps      (eps after the correction)
 *   param += (-lr / bc1) * m / denom
 * in that order of float operations (ATen's addcmul/add are fused
 * multiply-adds, addcdiv is value * t1 / t2 then an add).
 * The step's scalars (ddp__adam_next_scalars) are shared with the CUDA kernel
 * (cuda/optim_kernels.cu), which repeats this loop on a GPU. */
#include <math.h>

#include "optim/optim_internal.h"

ddp__adam_scalars ddp__adam_next_scalars(ddp_optimizer *opt) {
  const ddp_optim_options *o = &opt->options;
  ddp__adam_scalars s;
  opt->step_scalar += 1.0f; /* PyTorch keeps step as a float32 tensor */
  const double step = (double)opt->step_scalar;
  const double bias_correction1 = 1.0 - pow(o->adam.beta1, step);
  const double bias_correction2 = 1.0 - pow(o->adam.beta2, step);
  const double step_size = o->lr / bias_correction1;
  s.bc2_sqrt = (float)sqrt(bias_correction2);
  s.neg_step_size = (float)-step_size;

  s.use_wd = o->weight_decay != 0.0;
  s.weight_decay = (float)o->weight_decay;
  s.beta1 = (float)o->adam.beta1;
  s.beta2 = (float)o->adam.beta2;
  s.one_minus_beta1 = (float)(1.0 - o->adam.beta1);
  s.one_minus_beta2 = (float)(1.0 - o->adam.beta2);
  s.eps = (float)o->adam.eps;
  s.sign = o->maximize ? -1.0f : 1.0f;
  return s;
}

void ddp__adam_step(ddp_optimizer *opt) {
  const ddp__adam_scalars s = ddp__adam_next_scalars(opt);
  float *param = opt->params;     /* (n,) */
  const float *grad = opt->grads; /* (n,) */
  const size_t n = opt->n;
  float *exp_avg = opt->state[1].data;    /* (n,) */
  float *exp_avg_sq = opt->state[2].data; /* (n,) */
  float *max_exp_avg_sq = opt->options.adam.amsgrad ? opt->state[3].data : NULL; /* (n,) */

  for (size_t i = 0; i < n; i++) {
    float g = s.sign * grad[i];
    if (s.use_wd) g = fmaf(param[i], s.weight_decay, g);
    exp_avg[i] = fmaf(g, s.one_minus_beta1, exp_avg[i] * s.beta1);
    exp_avg_sq[i] = fmaf(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
    float v = exp_avg_sq[i];
    if (max_exp_avg_sq) {
      /* torch.maximum: NaN in either operand propagates. */
      float mx = max_exp_avg_sq[i];
      if (!(mx >= v) && !isnan(mx)) mx = v;
      max_exp_avg_sq[i] = mx;
      v = mx;
    }
    float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
    param[i] = param[i] + s.neg_step_size * exp_avg[i] / denom;
  }
}
