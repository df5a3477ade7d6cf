/* Gradient scaling for mixed precision (include/ddp/optim.h, "Gradient
 * scaling"; docs/mixed-precision.md): PyTorch 2.x's torch.amp.GradScaler
 * and its CPU kernels _amp_foreach_non_finite_check_and_unscale_ and
 * _amp_update_scale_, float for float. The agreement of found_inf over a
 * group is the train layer's (it needs comm). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ddp/optim.h"
#include "tensor/tape.h" /* ddp__basic_kernels_for: the unscale on a GPU */

ddp_grad_scaler ddp_grad_scaler_defaults(bool enabled) {
  ddp_grad_scaler gs;
  memset(&gs, 0, sizeof gs);
  gs.scale = 65536.0f;
  gs.growth_tracker = 0;
  gs.growth_factor = 2.0;
  gs.backoff_factor = 0.5;
  gs.growth_interval = 2000;
  gs.enabled = enabled;
  return gs;
}

ddp_status ddp_grad_scaler_check(const ddp_grad_scaler *gs) {
  if (!gs) return ddp_error(DDP_ERR_INVALID, "grad_scaler: NULL");
  if (!isfinite(gs->scale) || !(gs->scale > 0))
    return ddp_error(DDP_ERR_INVALID, "grad_scaler: scale is %g (finite and > 0)", (double)gs->scale);
  if (!(gs->growth_factor > 1.0) || !isfinite(gs->growth_factor))
    return ddp_error(DDP_ERR_INVALID, "grad_scaler: growth_factor is %g (finite and > 1)",
                     gs->growth_factor);
  if (!(gs->backoff_factor > 0.0 && gs->backoff_factor < 1.0))
    return ddp_error(DDP_ERR_INVALID, "grad_scaler: backoff_factor is %g (in (0, 1))",
                     gs->backoff_factor);
  if (gs->growth_interval < 1 || gs->growth_interval > INT32_MAX)
    return ddp_error(DDP_ERR_INVALID, "grad_scaler: growth_interval is %lld (1 to %d)",
                     (long long)gs->growth_interval, INT32_MAX);
  if (gs->growth_tracker < 0 || gs->growth_tracker >= gs->growth_interval)
    return ddp_error(DDP_ERR_INVALID, "grad_scaler: _growth_tracker is %d (0 to growth_interval %lld - 1)",
                     (int)gs->growth_tracker, (long long)gs->growth_interval);
  return DDP_OK;
}

float ddp_grad_scaler_loss_seed(const ddp_grad_scaler *gs) {
  return gs->enabled ? gs->scale : 1.0f;
}

/* PyTorch: self._scale.double().reciprocal().float() ("FP32 division can be
 * imprecise for certain compile options"). */
float ddp_grad_scaler_inv_scale(const ddp_grad_scaler *gs) {
  return (float)(1.0 / (double)gs->scale);
}

/* Inf or NaN: every exponent bit set. On the bits, so -ffast-math style
 * flags cannot fold the test away, and the loop vectorises. */
static inline uint32_t non_finite(float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7f800000u) == 0x7f800000u;
}

bool ddp_grad_scaler_unscale(const ddp_grad_scaler *gs, float *grads, size_t n) {
  if (!gs->enabled) return false;
  const float inv = ddp_grad_scaler_inv_scale(gs);
  uint32_t found = 0;
  if (inv == 1.0f) { /* PyTorch leaves the value as it is then */
    for (size_t i = 0; i < n; i++) found |= non_finite(grads[i]);
  } else {
    for (size_t i = 0; i < n; i++) {
      found |= non_finite(grads[i]);
      grads[i] *= inv;
    }
  }
  return found != 0;
}

void ddp_grad_scaler_update(ddp_grad_scaler *gs, bool found_inf) {
  if (!gs->enabled) return;
  if (found_inf) {
    gs->scale = (float)((double)gs->scale * gs->backoff_factor);
    gs->growth_tracker = 0;
    return;
  }
  /* A successful step: counted before the comparison. */
  const int64_t successful = (int64_t)gs->growth_tracker + 1;
  if (successful == gs->growth_interval) {
    const float grown = (float)((double)gs->scale * gs->growth_factor);
    if (isfinite(grown)) gs->scale = grown; /* never grow past float32 to inf */
    gs->growth_tracker = 0;
  } else {
    gs->growth_tracker = (int32_t)successful;
  }
}

bool ddp_grad_scaler_unscale_on(const ddp_grad_scaler *gs, ddp_device device, float *grads,
                                size_t n) {
  if (!gs->enabled) return false;
  if (device.type == DDP_DEVICE_CPU) return ddp_grad_scaler_unscale(gs, grads, n);
  const ddp__basic_kernels *k = ddp__basic_kernels_for(device);
  if (!k) return true; /* no backend for it: the step must not use these gradients */
  return k->unscale_check(grads, ddp_grad_scaler_inv_scale(gs), (int64_t)n);
}
