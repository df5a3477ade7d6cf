/* Finite-difference gradient checks (see gradcheck.h). */
#include "support/gradcheck.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tensor/tape.h"

ddp_tensor *gradcheck_random(int ndim, const int64_t *shape, float lo, float hi, uint64_t seed,
                             bool requires_grad) {
  ddp_tensor *t;
  if (ddp_tensor_create(&t, DDP_FLOAT32, ndim, shape) != DDP_OK) return NULL;
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  float *d = t->data;
  for (int64_t i = 0; i < t->numel; i++) d[i] = ddp_rng_uniform_range(&rng, lo, hi);
  if (requires_grad) t->flags |= DDP_TENSOR_REQUIRES_GRAD;
  return t;
}

int allclose(const char *what, const float *a, const float *b, int64_t n, double rtol,
             double atol) {
  double maxb = 0, worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) maxb = fmax(maxb, fabs((double)b[i]));
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (!(d <= worst)) { /* also catches NaN */
      worst = isnan(d) ? INFINITY : d;
      at = i;
    }
  }
  double tol = atol + rtol * maxb;
  if (worst <= tol) return 0;
  fprintf(stderr, "%s: mismatch at element %lld: got %.9g, expected %.9g (|diff| %.3g > tol %.3g)\n",
          what, (long long)at, at >= 0 ? a[at] : 0.0, at >= 0 ? b[at] : 0.0, worst, tol);
  return 1;
}

/* L = sum(r * out) for a fresh forward; returns NAN on failure. */
static double projected(gradcheck_fn fn, ddp_tensor **inputs, void *user, const float *r,
                        int64_t n_out, ddp_tape *tape) {
  ddp_tape_reset(tape);
  ddp_tape_set_grad_enabled(tape, false);
  ddp_tensor *out;
  ddp_status s = fn(tape, inputs, user, &out);
  ddp_tape_set_grad_enabled(tape, true);
  if (s != DDP_OK || out->numel != n_out) return NAN;
  double l = 0;
  const float *y = out->data;
  for (int64_t i = 0; i < n_out; i++) l += (double)r[i] * y[i];
  return l;
}

int gradcheck(const char *what, gradcheck_fn fn, ddp_tensor **inputs, int n_inputs, void *user,
              double eps, double atol, double rtol) {
  ddp_tape *tape;
  if (ddp_tape_create(&tape, 1 << 20) != DDP_OK) return 1;
  int failures = 0;
  ddp_tensor *out;
  ddp_status s = fn(tape, inputs, user, &out);
  if (s != DDP_OK) {
    fprintf(stderr, "%s: forward failed: %s\n", what, ddp_last_error());
    ddp_tape_destroy(tape);
    return 1;
  }
  int64_t n_out = out->numel;
  float *r = ddp_alloc((size_t)n_out * sizeof(float) + 4);
  ddp_rng rng;
  ddp_rng_seed(&rng, 1234);
  for (int64_t i = 0; i < n_out; i++) r[i] = ddp_rng_uniform_range(&rng, -1, 1);
  for (int i = 0; i < n_inputs; i++)
    if (inputs[i] && inputs[i]->grad) memset(inputs[i]->grad, 0, (size_t)inputs[i]->numel * 4);
  s = ddp__backward_from(tape, out, r);
  if (s != DDP_OK) {
    fprintf(stderr, "%s: backward failed: %s\n", what, ddp_last_error());
    failures++;
  }
  for (int i = 0; i < n_inputs && !failures; i++) {
    ddp_tensor *x = inputs[i];
    if (!x || !(x->flags & DDP_TENSOR_REQUIRES_GRAD)) continue;
    if (!x->grad) {
      fprintf(stderr, "%s: input %d got no gradient\n", what, i);
      failures++;
      continue;
    }
    float *numeric = ddp_alloc((size_t)x->numel * sizeof(float) + 4);
    float *xd = x->data;
    for (int64_t j = 0; j < x->numel; j++) {
      float saved = xd[j];
      xd[j] = saved + (float)eps;
      double lp = projected(fn, inputs, user, r, n_out, tape);
      xd[j] = saved - (float)eps;
      double lm = projected(fn, inputs, user, r, n_out, tape);
      xd[j] = saved;
      numeric[j] = (float)((lp - lm) / (2 * eps));
    }
    char label[256];
    snprintf(label, sizeof label, "%s: d/d input %d", what, i);
    failures += allclose(label, x->grad, numeric, x->numel, rtol, atol);
    ddp_free(numeric);
  }
  ddp_free(r);
  ddp_tape_destroy(tape);
  return failures;
}
