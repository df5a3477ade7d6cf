/* Pointwise and per-channel ops: relu, sigmoid, tanh, dropout, dropout2d,
 * batch_norm. Backward against central finite differences; forward against
 * closed forms computed here in double; batch-norm running statistics against
 * values computed by hand; dropout statistics and the structure of what
 * dropout2d zeroes (checked against PyTorch 1.13, see docs/tensor.md); errors
 * by code and message. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "support/gradcheck.h"
#include "tensor/tape.h"

static ddp_tape *new_tape(void) {
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  return tape;
}

/* Values in [lo, hi) with random signs: |x| >= lo keeps relu away from its kink. */
static ddp_tensor *signed_away_from_zero(int ndim, const int64_t *shape, float lo, float hi,
                                         uint64_t seed) {
  ddp_tensor *t = gradcheck_random(ndim, shape, lo, hi, seed, true);
  ddp_rng rng;
  ddp_rng_seed(&rng, seed + 100);
  float *d = t->data;
  for (int64_t i = 0; i < t->numel; i++)
    if (ddp_rng_uniform(&rng) < 0.5f) d[i] = -d[i];
  return t;
}

/* ---- activations ---- */

static ddp_status fn_relu(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  (void)u;
  return ddp_relu(t, in[0], out);
}
static ddp_status fn_sigmoid(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  (void)u;
  return ddp_sigmoid(t, in[0], out);
}
static ddp_status fn_tanh(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  (void)u;
  return ddp_tanh(t, in[0], out);
}

static void test_activations_gradcheck(void **state) {
  (void)state;
  int64_t shape[3] = {3, 4, 5};
  ddp_tensor *x = signed_away_from_zero(3, shape, 0.05f, 3.0f, 11);
  assert_int_equal(gradcheck("relu", fn_relu, &x, 1, NULL, 1e-2, 1e-4, 1e-3), 0);
  assert_int_equal(gradcheck("sigmoid", fn_sigmoid, &x, 1, NULL, 1e-2, 1e-4, 1e-3), 0);
  /* tanh switches formula at |x| = 0.625: the range covers both. */
  assert_int_equal(gradcheck("tanh", fn_tanh, &x, 1, NULL, 1e-2, 1e-4, 1e-3), 0);
  ddp_tensor_destroy(x);
}

static void test_activations_forward(void **state) {
  (void)state;
  enum { n = 4003 }; /* not a multiple of the vector width: the tail runs too */
  int64_t shape[1] = {n};
  ddp_tensor *x = gradcheck_random(1, shape, -30, 30, 12, false);
  float *xd = x->data;
  /* Hand-picked points: tiny, near the tanh switch, exp's clamps, extremes. */
  const float special[] = {0.0f,  -0.0f, 1e-7f,  -1e-5f, 0.624f, 0.626f, -0.625f, 8.9f,  -44.0f,
                           44.0f, 87.0f, -87.0f, 88.5f,  -88.5f, 100.0f, -100.0f, 1e30f, -1e30f};
  for (size_t i = 0; i < sizeof special / sizeof *special; i++) xd[i] = special[i];
  for (int i = 100; i < 600; i++) xd[i] = (float)(i - 350) * 0.004f; /* dense near 0 */
  ddp_tape *tape = new_tape();
  ddp_tensor *r, *s, *t;
  assert_int_equal(ddp_relu(tape, x, &r), DDP_OK);
  assert_int_equal(ddp_sigmoid(tape, x, &s), DDP_OK);
  assert_int_equal(ddp_tanh(tape, x, &t), DDP_OK);
  assert_int_equal(ddp_tape_num_nodes(tape), 0); /* x does not require grad */
  float *rd = r->data, *sd = s->data, *td = t->data;
  double worst_s = 0, worst_t = 0;
  for (int i = 0; i < n; i++) {
    double v = xd[i];
    assert_true(rd[i] == (v > 0 ? xd[i] : 0.0f));
    double es = 1.0 / (1.0 + exp(-v)), et = tanh(v);
    /* Relative error where the value is representable, absolute near 0. */
    worst_s = fmax(worst_s, fabs(sd[i] - es) / fmax(fabs(es), 1e-30));
    worst_t = fmax(worst_t, fabs(td[i] - et) / fmax(fabs(et), 1e-30));
    if (es < 1e-30) assert_true(sd[i] < 1e-30f);
  }
  if (worst_s > 4e-7 || worst_t > 4e-7)
    fprintf(stderr, "sigmoid rel err %.3g, tanh rel err %.3g\n", worst_s, worst_t);
  assert_true(worst_s <= 4e-7);
  assert_true(worst_t <= 4e-7);
  /* NaN propagates through all three, as in PyTorch. */
  int64_t one[1] = {1};
  float nan_value = NAN;
  ddp_tensor xn;
  assert_int_equal(ddp_tensor_wrap(&xn, DDP_FLOAT32, 1, one, &nan_value), DDP_OK);
  assert_int_equal(ddp_relu(tape, &xn, &r), DDP_OK);
  assert_true(isnan(ddp_tensor_f32(r)[0]));
  assert_int_equal(ddp_sigmoid(tape, &xn, &s), DDP_OK);
  assert_true(isnan(ddp_tensor_f32(s)[0]));
  assert_int_equal(ddp_tanh(tape, &xn, &t), DDP_OK);
  assert_true(isnan(ddp_tensor_f32(t)[0]));
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

/* relu's gradient is exactly dy where x > 0 and exactly 0 where x <= 0. */
static void test_relu_grad_at_zero(void **state) {
  (void)state;
  int64_t shape[1] = {4};
  float xv[4] = {-1.0f, 0.0f, 1e-20f, 2.0f};
  ddp_tensor x;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 1, shape, xv), DDP_OK);
  x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_relu(tape, &x, &y), DDP_OK);
  float seed[4] = {5, 6, 7, 8};
  assert_int_equal(ddp__backward_from(tape, y, seed), DDP_OK);
  assert_true(x.grad[0] == 0.0f && x.grad[1] == 0.0f && x.grad[2] == 7.0f && x.grad[3] == 8.0f);
  ddp_tensor_free_grad(&x);
  ddp_tape_destroy(tape);
}

/* ---- dropout ---- */

typedef struct dropout_args {
  float p;
  bool training;
  uint64_t seed;
  bool channel; /* dropout2d */
} dropout_args;

static ddp_status fn_dropout(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  dropout_args *a = u;
  ddp_rng rng;
  ddp_rng_seed(&rng, a->seed); /* the same mask on every call */
  return a->channel ? ddp_dropout2d(t, in[0], a->p, a->training, &rng, out)
                    : ddp_dropout(t, in[0], a->p, a->training, &rng, out);
}

static void test_dropout_gradcheck(void **state) {
  (void)state;
  int64_t shape[4] = {2, 3, 2, 3};
  ddp_tensor *x = gradcheck_random(4, shape, -1, 1, 21, true);
  dropout_args cases[] = {
      {0.4f, true, 5, false}, {0.4f, true, 6, true},  {0.4f, false, 7, false},
      {0.0f, true, 8, true},  {1.0f, true, 9, false}, {1.0f, true, 9, true},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[64];
    snprintf(what, sizeof what, "dropout case %zu", i);
    assert_int_equal(gradcheck(what, fn_dropout, &x, 1, &cases[i], 1e-2, 1e-4, 1e-3), 0);
  }
  ddp_tensor_destroy(x);
}

static void test_dropout_statistics(void **state) {
  (void)state;
  enum { n = 200000 };
  int64_t shape[2] = {400, 500};
  ddp_tensor *x = gradcheck_random(2, shape, 0.5f, 2.0f, 22, true);
  const float *xd = x->data;
  ddp_tape *tape = new_tape();
  const float ps[] = {0.1f, 0.3f, 0.5f, 0.9f};
  for (size_t k = 0; k < sizeof ps / sizeof *ps; k++) {
    float p = ps[k];
    ddp_tape_reset(tape);
    ddp_rng rng;
    ddp_rng_seed(&rng, 100 + k);
    ddp_tensor *y;
    assert_int_equal(ddp_dropout(tape, x, p, true, &rng, &y), DDP_OK);
    const float *yd = y->data;
    float scale = 1.0f / (1.0f - p);
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; i++) {
      if (yd[i] == 0.0f) {
        dropped++;
      } else {
        assert_true(yd[i] == xd[i] * scale);
      }
    }
    /* Binomial: sd = sqrt(p(1-p)/n) <= 0.0012; allow 6 sd. */
    double frac = (double)dropped / n;
    assert_true(fabs(frac - p) < 0.007);
    /* Backward: dx = dy * mask / (1 - p), the same mask. */
    float *seed = ddp_alloc(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) seed[i] = 1.0f;
    if (x->grad) memset(x->grad, 0, n * sizeof(float));
    assert_int_equal(ddp__backward_from(tape, y, seed), DDP_OK);
    for (int64_t i = 0; i < n; i++) assert_true(x->grad[i] == (yd[i] == 0.0f ? 0.0f : scale));
    ddp_free(seed);
  }
  /* The mask is a function of the rng state only: same seed, same mask. */
  ddp_rng r1, r2;
  ddp_rng_seed(&r1, 9);
  ddp_rng_seed(&r2, 9);
  ddp_tensor *a, *b;
  ddp_tape_reset(tape);
  assert_int_equal(ddp_dropout(tape, x, 0.5f, true, &r1, &a), DDP_OK);
  assert_int_equal(ddp_dropout(tape, x, 0.5f, true, &r2, &b), DDP_OK);
  assert_memory_equal(a->data, b->data, n * sizeof(float));
  /* One uniform per element, drop when u < p. */
  ddp_rng_seed(&r2, 9);
  for (int64_t i = 0; i < 1000; i++)
    assert_true((ddp_tensor_f32(a)[i] == 0.0f) == (ddp_rng_uniform(&r2) < 0.5f));
  ddp_tensor_free_grad(x);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

static void test_dropout_edge_cases(void **state) {
  (void)state;
  int64_t shape[2] = {3, 4};
  ddp_tensor *x = gradcheck_random(2, shape, -1, 1, 23, false);
  ddp_tape *tape = new_tape();
  ddp_rng rng;
  ddp_rng_seed(&rng, 1);
  ddp_rng before = rng;
  ddp_tensor *y;
  /* eval and p == 0: identity, no draws, no rng needed. */
  assert_int_equal(ddp_dropout(tape, x, 0.5f, false, NULL, &y), DDP_OK);
  assert_memory_equal(y->data, x->data, 12 * sizeof(float));
  assert_int_equal(ddp_dropout(tape, x, 0.0f, true, &rng, &y), DDP_OK);
  assert_memory_equal(y->data, x->data, 12 * sizeof(float));
  assert_int_equal(ddp_dropout2d(tape, x, 0.3f, false, &rng, &y), DDP_OK);
  assert_memory_equal(y->data, x->data, 12 * sizeof(float));
  /* p == 1: all zero, and (as in PyTorch) no random numbers drawn. */
  assert_int_equal(ddp_dropout(tape, x, 1.0f, true, &rng, &y), DDP_OK);
  for (int i = 0; i < 12; i++) assert_true(ddp_tensor_f32(y)[i] == 0.0f);
  assert_int_equal(ddp_dropout2d(tape, x, 1.0f, true, NULL, &y), DDP_OK);
  for (int i = 0; i < 12; i++) assert_true(ddp_tensor_f32(y)[i] == 0.0f);
  assert_memory_equal(&rng, &before, sizeof rng);
  /* NaN stays NaN even where dropped (a multiply by 0, as PyTorch does). */
  float nan_value = NAN;
  int64_t one[1] = {1};
  ddp_tensor xn;
  assert_int_equal(ddp_tensor_wrap(&xn, DDP_FLOAT32, 1, one, &nan_value), DDP_OK);
  assert_int_equal(ddp_dropout(tape, &xn, 1.0f, true, &rng, &y), DDP_OK);
  assert_true(isnan(ddp_tensor_f32(y)[0]));
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

/* dropout2d, checked against torch 1.13.0 (F.dropout2d is ATen's
 * feature_dropout, noise shape (shape[0], shape[1], 1, ...)):
 *   4-D (N, C, H, W): whole (n, c) maps are zeroed or scaled together;
 *   3-D (N, C, L):    whole rows x[n, c, :];
 *   2-D (N, F):       every element on its own, exactly like dropout;
 *   1-D: an error in training (torch: "Feature dropout requires at least 2
 *   dimensions in the input"). */
static void test_dropout2d_structure(void **state) {
  (void)state;
  ddp_tape *tape = new_tape();
  ddp_rng rng;
  const float p = 0.5f;
  /* 4-D: 64 x 32 maps of 3 x 5. */
  int64_t s4[4] = {64, 32, 3, 5};
  ddp_tensor *x4 = gradcheck_random(4, s4, 0.5f, 1.5f, 31, false);
  ddp_tensor *y;
  ddp_rng_seed(&rng, 3);
  assert_int_equal(ddp_dropout2d(tape, x4, p, true, &rng, &y), DDP_OK);
  int maps_dropped = 0;
  for (int m = 0; m < 64 * 32; m++) {
    const float *ym = ddp_tensor_f32(y) + m * 15, *xm = ddp_tensor_f32(x4) + m * 15;
    bool dropped = ym[0] == 0.0f;
    maps_dropped += dropped;
    for (int i = 0; i < 15; i++) assert_true(ym[i] == (dropped ? 0.0f : xm[i] * 2.0f));
  }
  assert_true(abs(maps_dropped - 1024) < 6 * 23); /* sd = sqrt(2048 / 4) */
  /* 3-D: rows of length L. */
  int64_t s3[3] = {16, 8, 7};
  ddp_tensor *x3 = gradcheck_random(3, s3, 0.5f, 1.5f, 32, false);
  ddp_rng_seed(&rng, 4);
  assert_int_equal(ddp_dropout2d(tape, x3, p, true, &rng, &y), DDP_OK);
  int rows_dropped = 0;
  for (int r = 0; r < 16 * 8; r++) {
    const float *yr = ddp_tensor_f32(y) + r * 7;
    bool dropped = yr[0] == 0.0f;
    rows_dropped += dropped;
    for (int i = 0; i < 7; i++) assert_true((yr[i] == 0.0f) == dropped);
  }
  assert_true(rows_dropped > 20 && rows_dropped < 108);
  /* 2-D (the psnet case, Dropout2d on (N, 128)): element-wise. Rows and
   * columns both mix kept and dropped elements, and the mask is the one
   * dropout draws from the same rng state. */
  int64_t s2[2] = {32, 128};
  ddp_tensor *x2 = gradcheck_random(2, s2, 0.5f, 1.5f, 33, false);
  ddp_tensor *y2, *yd;
  ddp_rng_seed(&rng, 5);
  assert_int_equal(ddp_dropout2d(tape, x2, p, true, &rng, &y2), DDP_OK);
  ddp_rng_seed(&rng, 5);
  assert_int_equal(ddp_dropout(tape, x2, p, true, &rng, &yd), DDP_OK);
  assert_memory_equal(y2->data, yd->data, 32 * 128 * sizeof(float));
  int mixed_rows = 0, mixed_cols = 0, dropped = 0;
  const float *v = y2->data;
  for (int r = 0; r < 32; r++) {
    int z = 0;
    for (int c = 0; c < 128; c++) z += v[r * 128 + c] == 0.0f;
    mixed_rows += z > 0 && z < 128;
    dropped += z;
  }
  for (int c = 0; c < 128; c++) {
    int z = 0;
    for (int r = 0; r < 32; r++) z += v[r * 128 + c] == 0.0f;
    mixed_cols += z > 0 && z < 32;
  }
  assert_int_equal(mixed_rows, 32);
  assert_true(mixed_cols > 120);
  assert_true(abs(dropped - 2048) < 6 * 32); /* sd = sqrt(4096 / 4) */
  /* 1-D: an error when a mask is needed, identity otherwise. */
  int64_t s1[1] = {10};
  ddp_tensor *x1 = gradcheck_random(1, s1, 0.5f, 1.5f, 34, false);
  assert_int_equal(ddp_dropout2d(tape, x1, p, true, &rng, &y), DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(),
                      "dropout2d: input (10) has 1 dimension(s); channel dropout needs at least "
                      "2 (N, C, ...)");
  assert_int_equal(ddp_dropout2d(tape, x1, p, false, &rng, &y), DDP_OK);
  assert_memory_equal(y->data, x1->data, 10 * sizeof(float));
  ddp_tensor_destroy(x1);
  ddp_tensor_destroy(x2);
  ddp_tensor_destroy(x3);
  ddp_tensor_destroy(x4);
  ddp_tape_destroy(tape);
}

/* ---- batch norm ---- */

typedef struct bn_args {
  bool training;
  ddp_tensor *running_mean, *running_var;
  float momentum, eps;
} bn_args;

/* inputs: x, weight, bias (weight/bias may be NULL) */
static ddp_status fn_batch_norm(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  bn_args *a = u;
  ddp_tensor *y;
  DDP_TRY(ddp_batch_norm(t, in[0], in[1], in[2], a->running_mean, a->running_var, NULL, a->training,
                         a->momentum, a->eps, &y));
  /* A nonlinearity after it, so the training-mode terms of dx (which vanish
   * for a plain sum) are exercised by the random projection too. */
  return ddp_tanh(t, y, out);
}

static void bn_gradcheck_case(int ndim, const int64_t *shape, bool affine, bool training,
                              bool running, uint64_t seed) {
  int64_t C = shape[1];
  int64_t cshape[1] = {C};
  ddp_tensor *in[3] = {gradcheck_random(ndim, shape, -2, 3, seed, true), NULL, NULL};
  if (affine) {
    in[1] = gradcheck_random(1, cshape, 0.5f, 1.5f, seed + 1, true);
    in[2] = gradcheck_random(1, cshape, -0.5f, 0.5f, seed + 2, true);
  }
  bn_args a = {training, NULL, NULL, 0.1f, 1e-5f};
  if (running) {
    a.running_mean = gradcheck_random(1, cshape, -0.5f, 0.5f, seed + 3, false);
    a.running_var = gradcheck_random(1, cshape, 0.5f, 2.0f, seed + 4, false);
  }
  char what[96];
  snprintf(what, sizeof what, "batch_norm %dd affine=%d training=%d running=%d", ndim, affine,
           training, running);
  assert_int_equal(gradcheck(what, fn_batch_norm, in, 3, &a, 1e-2, 1e-3, 5e-3), 0);
  for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
  ddp_tensor_destroy(a.running_mean);
  ddp_tensor_destroy(a.running_var);
}

static void test_batch_norm_gradcheck(void **state) {
  (void)state;
  int64_t s4[4] = {3, 2, 3, 4}, s2[2] = {6, 5}, s4b[4] = {2, 3, 5, 7};
  bn_gradcheck_case(4, s4, true, true, true, 41);
  bn_gradcheck_case(4, s4b, true, true, true, 42); /* HW = 35: the lane loop and its tail */
  bn_gradcheck_case(2, s2, true, true, true, 43);
  bn_gradcheck_case(4, s4, false, true, false, 44);
  bn_gradcheck_case(2, s2, false, true, true, 45);
  bn_gradcheck_case(4, s4, true, false, true, 46); /* eval: running stats */
  bn_gradcheck_case(2, s2, true, false, true, 47);
  bn_gradcheck_case(2, s2, true, false, false, 48); /* eval without running stats: batch stats */
}

/* y and running statistics against a double-precision computation here. */
static void test_batch_norm_forward_and_running_stats(void **state) {
  (void)state;
  enum { N = 4, C = 3, HW = 20 };
  int64_t shape[4] = {N, C, 4, 5}, cs[1] = {C};
  ddp_tensor *w = gradcheck_random(1, cs, 0.5f, 1.5f, 51, false);
  ddp_tensor *b = gradcheck_random(1, cs, -1, 1, 52, false);
  ddp_tensor *rm, *rv;
  assert_int_equal(ddp_tensor_create(&rm, DDP_FLOAT32, 1, cs), DDP_OK);
  assert_int_equal(ddp_tensor_create(&rv, DDP_FLOAT32, 1, cs), DDP_OK);
  for (int c = 0; c < C; c++) ddp_tensor_f32(rv)[c] = 1.0f; /* PyTorch's initial values */
  double ref_mean[C] = {0, 0, 0}, ref_var[C] = {1, 1, 1};
  int64_t tracked = 0;
  const float momentum = 0.1f, eps = 1e-5f;
  ddp_tape *tape = new_tape();
  for (int step = 0; step < 3; step++) {
    /* A large offset (1000) checks the variance is computed without cancellation. */
    ddp_tensor *x = gradcheck_random(4, shape, 1000.0f - step, 1004.0f + step, 53 + step, false);
    ddp_tape_reset(tape);
    ddp_tensor *y;
    assert_int_equal(ddp_batch_norm(tape, x, w, b, rm, rv, &tracked, true, momentum, eps, &y),
                     DDP_OK);
    const float *xd = x->data;
    for (int c = 0; c < C; c++) {
      double s = 0, ss = 0;
      for (int n = 0; n < N; n++)
        for (int i = 0; i < HW; i++) s += xd[(n * C + c) * HW + i];
      double mean = s / (N * HW);
      for (int n = 0; n < N; n++)
        for (int i = 0; i < HW; i++) {
          double d = xd[(n * C + c) * HW + i] - mean;
          ss += d * d;
        }
      double var = ss / (N * HW);
      for (int n = 0; n < N; n++)
        for (int i = 0; i < HW; i++) {
          int64_t at = (n * C + c) * HW + i;
          double expect =
              (xd[at] - mean) / sqrt(var + eps) * ddp_tensor_f32(w)[c] + ddp_tensor_f32(b)[c];
          /* The mean is a float near 1000 (ulp 6e-5); std is about 1.2. */
          assert_true(fabs(ddp_tensor_f32(y)[at] - expect) < 1e-4);
        }
      ref_mean[c] = 0.9 * ref_mean[c] + 0.1 * mean;
      ref_var[c] = 0.9 * ref_var[c] + 0.1 * var * (N * HW) / (N * HW - 1);
    }
    ddp_tensor_destroy(x);
  }
  assert_int_equal(tracked, 3);
  for (int c = 0; c < C; c++) {
    assert_true(fabs(ddp_tensor_f32(rm)[c] - ref_mean[c]) < 1e-5 * fabs(ref_mean[c]));
    assert_true(fabs(ddp_tensor_f32(rv)[c] - ref_var[c]) < 1e-4 * ref_var[c]);
  }
  /* Eval: normalise with the running statistics; nothing is updated. */
  float rm_before[C], rv_before[C];
  memcpy(rm_before, rm->data, sizeof rm_before);
  memcpy(rv_before, rv->data, sizeof rv_before);
  ddp_tensor *x = gradcheck_random(4, shape, -1, 1, 60, false);
  ddp_tensor *y;
  assert_int_equal(ddp_batch_norm(tape, x, w, b, rm, rv, &tracked, false, momentum, eps, &y),
                   DDP_OK);
  assert_int_equal(tracked, 3);
  assert_memory_equal(rm->data, rm_before, sizeof rm_before);
  assert_memory_equal(rv->data, rv_before, sizeof rv_before);
  for (int64_t i = 0; i < x->numel; i++) {
    int c = (int)((i / HW) % C);
    double expect = (ddp_tensor_f32(x)[i] - rm_before[c]) / sqrt(rv_before[c] + (double)eps) *
                        ddp_tensor_f32(w)[c] +
                    ddp_tensor_f32(b)[c];
    assert_true(fabs(ddp_tensor_f32(y)[i] - expect) < 2e-6 * fabs(expect) + 1e-5);
  }
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
  ddp_tensor_destroy(rm);
  ddp_tensor_destroy(rv);
  ddp_tape_destroy(tape);
}

/* The batch mean is correctly rounded to float, also over the ConvNet's
 * 100 x 28 x 28 values per channel, and so the sign of a normalised value
 * equal to the input's most common one (an image's plain background, the
 * convolution's bias there) is the sign that exact arithmetic gives: ReLU
 * then opens or closes all those positions as a float64 computation does.
 * Issue 19: float lanes put the mean units in the last place off at this
 * size, and the ConvNet trained on one rank took another step than on two
 * (fails with norm.c's mean summed by sum_f32). */
static void test_batch_norm_mean_correctly_rounded(void **state) {
  (void)state;
  enum { N = 100, C = 8, H = 28, W = 28, HW = H * W };
  int64_t shape[4] = {N, C, H, W}, cs[1] = {C};
  ddp_tensor *x = gradcheck_random(4, shape, 0.0f, 1.0f, 71, false);
  float *xd = x->data;
  ddp_rng rng;
  ddp_rng_seed(&rng, 72);
  /* Channel c's background value, on about 70% of the positions. */
  float background[C];
  for (int c = 0; c < C; c++) background[c] = 0.3f + 0.05f * (float)c;
  for (int64_t i = 0; i < x->numel; i++)
    if (ddp_rng_uniform(&rng) < 0.7f) xd[i] = background[(i / HW) % C];
  ddp_tensor *rm = gradcheck_random(1, cs, 0, 0, 73, false);
  ddp_tensor *rv = gradcheck_random(1, cs, 1, 1, 74, false);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  /* momentum 1: running_mean is the batch mean */
  assert_int_equal(ddp_batch_norm(tape, x, NULL, NULL, rm, rv, NULL, true, 1.0f, 1e-5f, &y),
                   DDP_OK);
  for (int c = 0; c < C; c++) {
    long double s = 0; /* 64-bit mantissa: exact to far below float's last place */
    int64_t at_background = -1;
    for (int n = 0; n < N; n++)
      for (int i = 0; i < HW; i++) {
        int64_t at = ((int64_t)n * C + c) * HW + i;
        s += xd[at];
        if (xd[at] == background[c]) at_background = at;
      }
    const long double mean = s / (N * HW);
    const float want = (float)mean;
    if (ddp_tensor_f32(rm)[c] != want)
      fail_msg("channel %d: batch mean %.9g, correctly rounded %.9g", c,
               (double)ddp_tensor_f32(rm)[c], (double)want);
    assert_true(at_background >= 0);
    const float yb = ddp_tensor_f32(y)[at_background];
    const long double exact = background[c] - mean;
    if ((exact > 0 && yb < 0) || (exact < 0 && yb > 0))
      fail_msg("channel %d: background normalises to %g, exact sign %+d", c, (double)yb,
               exact > 0 ? 1 : -1);
  }
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(rm);
  ddp_tensor_destroy(rv);
  ddp_tape_destroy(tape);
}

/* (N, C) input without affine: every column has mean 0, biased variance
 * var / (var + eps). */
static void test_batch_norm_1d_columns(void **state) {
  (void)state;
  int64_t shape[2] = {37, 21};
  ddp_tensor *x = gradcheck_random(2, shape, -5, 7, 61, false);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_batch_norm(tape, x, NULL, NULL, NULL, NULL, NULL, true, 0.1f, 0.0f, &y),
                   DDP_OK);
  for (int c = 0; c < 21; c++) {
    double s = 0, ss = 0;
    for (int n = 0; n < 37; n++) s += ddp_tensor_f32(y)[n * 21 + c];
    for (int n = 0; n < 37; n++) ss += pow(ddp_tensor_f32(y)[n * 21 + c] - s / 37, 2);
    assert_true(fabs(s / 37) < 1e-6);
    assert_true(fabs(ss / 37 - 1.0) < 1e-5);
  }
  /* Columns near 1000 with spread ~3: with momentum 1 the running stats are
   * the batch mean and the unbiased variance, checked against double. */
  ddp_tensor *xo = gradcheck_random(2, shape, 995, 1007, 62, false);
  int64_t cs[1] = {21};
  ddp_tensor *rm = gradcheck_random(1, cs, 0, 0, 63, false);
  ddp_tensor *rv = gradcheck_random(1, cs, 1, 1, 64, false);
  assert_int_equal(ddp_batch_norm(tape, xo, NULL, NULL, rm, rv, NULL, true, 1.0f, 1e-5f, &y),
                   DDP_OK);
  for (int c = 0; c < 21; c++) {
    double s = 0, ss = 0;
    for (int n = 0; n < 37; n++) s += ddp_tensor_f32(xo)[n * 21 + c];
    for (int n = 0; n < 37; n++) ss += pow(ddp_tensor_f32(xo)[n * 21 + c] - s / 37, 2);
    assert_true(fabs(ddp_tensor_f32(rm)[c] - s / 37) < 1e-7 * (s / 37));
    assert_true(fabs(ddp_tensor_f32(rv)[c] - ss / 36) < 1e-6 * (ss / 36));
  }
  ddp_tensor_destroy(xo);
  ddp_tensor_destroy(rm);
  ddp_tensor_destroy(rv);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

static void test_batch_norm_errors(void **state) {
  (void)state;
  int64_t s4[4] = {2, 3, 2, 2}, c4[1] = {4}, c3[1] = {3}, one[2] = {1, 3};
  ddp_tensor *x = gradcheck_random(4, s4, -1, 1, 71, false);
  ddp_tensor *w4 = gradcheck_random(1, c4, -1, 1, 72, false);
  ddp_tensor *v3 = gradcheck_random(1, c3, 0.5f, 1, 73, false);
  ddp_tensor *x1 = gradcheck_random(2, one, -1, 1, 74, false);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_batch_norm(tape, x, w4, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(),
                      "batch_norm: weight has shape (4), input (2,3,2,2) has 3 channels");
  assert_int_equal(ddp_batch_norm(tape, x, NULL, NULL, w4, v3, NULL, false, 0.1f, 1e-5f, &y),
                   DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(),
                      "batch_norm: running_mean has shape (4), input (2,3,2,2) has 3 channels");
  assert_int_equal(ddp_batch_norm(tape, x, NULL, NULL, v3, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "running_mean and running_var"));
  assert_int_equal(ddp_batch_norm(tape, x1, NULL, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "more than 1 value per channel"));
  assert_non_null(strstr(ddp_last_error(), "(1,3)"));
  /* One sample is fine in eval with running statistics. */
  assert_int_equal(ddp_batch_norm(tape, x1, NULL, NULL, v3, v3, NULL, false, 0.1f, 1e-5f, &y),
                   DDP_OK);
  assert_int_equal(ddp_batch_norm(tape, NULL, NULL, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "batch_norm: input is NULL");
  assert_int_equal(ddp_batch_norm(tape, w4, NULL, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "batch_norm: input (4) must be"));
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(x1);
  ddp_tensor_destroy(w4);
  ddp_tensor_destroy(v3);
}

static void test_pointwise_errors(void **state) {
  (void)state;
  int64_t s[2] = {2, 3};
  ddp_tensor *x = gradcheck_random(2, s, -1, 1, 81, false);
  ddp_tensor xi;
  int64_t ints[6] = {0};
  assert_int_equal(ddp_tensor_wrap(&xi, DDP_INT64, 2, s, ints), DDP_OK);
  ddp_tape *tape = new_tape();
  ddp_rng rng;
  ddp_rng_seed(&rng, 1);
  ddp_tensor *y;
  assert_int_equal(ddp_relu(tape, NULL, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "relu: input is NULL");
  assert_int_equal(ddp_sigmoid(tape, &xi, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "sigmoid: argument 0 is int64, expected float32");
  assert_int_equal(ddp_tanh(NULL, x, &y), DDP_ERR_INVALID);
  assert_int_equal(ddp_dropout(tape, x, 1.5f, true, &rng, &y), DDP_ERR_RANGE);
  assert_string_equal(ddp_last_error(), "dropout: dropout probability must be in [0, 1], got 1.5");
  assert_int_equal(ddp_dropout2d(tape, x, -0.1f, false, &rng, &y), DDP_ERR_RANGE);
  assert_int_equal(ddp_dropout(tape, x, NAN, true, &rng, &y), DDP_ERR_RANGE);
  assert_int_equal(ddp_dropout(tape, x, 0.5f, true, NULL, &y), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "needs an rng"));
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

/* A training step through these ops allocates nothing once the tape's arena
 * and the leaves' gradients exist. */
static void test_steady_state_does_not_allocate(void **state) {
  (void)state;
  int64_t s[4] = {8, 4, 6, 6}, cs[1] = {4}, ts[1] = {8}, fs[2] = {8, 144};
  ddp_tensor *x = gradcheck_random(4, s, -1, 1, 91, false);
  ddp_tensor *w = gradcheck_random(1, cs, 0.5f, 1.5f, 92, true);
  ddp_tensor *b = gradcheck_random(1, cs, -1, 1, 93, true);
  ddp_tensor *rm = gradcheck_random(1, cs, 0, 0, 94, false);
  ddp_tensor *rv = gradcheck_random(1, cs, 1, 1, 95, false);
  ddp_tensor *target;
  assert_int_equal(ddp_tensor_create(&target, DDP_INT64, 1, ts), DDP_OK);
  for (int i = 0; i < 8; i++) ddp_tensor_i64(target)[i] = i % 3;
  ddp_tape *tape = new_tape();
  ddp_rng rng;
  ddp_rng_seed(&rng, 2);
  uint64_t allocs = 0;
  for (int step = 0; step < 4; step++) {
    if (step == 2) allocs = ddp_alloc_count();
    ddp_tape_reset(tape);
    ddp_tensor *h, *r, *d, *f, *s2, *l1, *l2, *loss;
    assert_int_equal(ddp_batch_norm(tape, x, w, b, rm, rv, NULL, true, 0.1f, 1e-5f, &h), DDP_OK);
    assert_int_equal(ddp_relu(tape, h, &r), DDP_OK);
    assert_int_equal(ddp_dropout2d(tape, r, 0.25f, true, &rng, &d), DDP_OK);
    assert_int_equal(ddp_reshape(tape, d, 2, fs, &f), DDP_OK);
    assert_int_equal(ddp_dropout(tape, f, 0.5f, true, &rng, &s2), DDP_OK);
    assert_int_equal(ddp_tanh(tape, s2, &l1), DDP_OK);
    assert_int_equal(ddp_sigmoid(tape, l1, &l2), DDP_OK);
    /* BatchNorm1d on (N, F): the per-channel scratch path. */
    ddp_tensor *n1, *lsm, *nll, *mse, *sum1, *total;
    assert_int_equal(ddp_batch_norm(tape, l2, NULL, NULL, NULL, NULL, NULL, true, 0.1f, 1e-5f, &n1),
                     DDP_OK);
    assert_int_equal(ddp_cross_entropy(tape, n1, target, &loss), DDP_OK);
    assert_int_equal(ddp_log_softmax(tape, l2, &lsm), DDP_OK);
    assert_int_equal(ddp_nll_loss(tape, lsm, target, &nll), DDP_OK);
    assert_int_equal(ddp_mse_loss(tape, l1, s2, &mse), DDP_OK);
    assert_int_equal(ddp_add(tape, loss, nll, &sum1), DDP_OK);
    assert_int_equal(ddp_add(tape, sum1, mse, &total), DDP_OK);
    assert_int_equal(ddp_backward(tape, total), DDP_OK);
  }
  assert_int_equal(ddp_alloc_count(), allocs);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
  ddp_tensor_destroy(rm);
  ddp_tensor_destroy(rv);
  ddp_tensor_destroy(target);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_activations_gradcheck),
      cmocka_unit_test(test_activations_forward),
      cmocka_unit_test(test_relu_grad_at_zero),
      cmocka_unit_test(test_dropout_gradcheck),
      cmocka_unit_test(test_dropout_statistics),
      cmocka_unit_test(test_dropout_edge_cases),
      cmocka_unit_test(test_dropout2d_structure),
      cmocka_unit_test(test_batch_norm_gradcheck),
      cmocka_unit_test(test_batch_norm_forward_and_running_stats),
      cmocka_unit_test(test_batch_norm_mean_correctly_rounded),
      cmocka_unit_test(test_batch_norm_1d_columns),
      cmocka_unit_test(test_batch_norm_errors),
      cmocka_unit_test(test_pointwise_errors),
      cmocka_unit_test(test_steady_state_does_not_allocate),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
