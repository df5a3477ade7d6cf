/* optim: SGD, Adam and Adadelta with StepLR against PyTorch 1.13 fixtures
 * (tests/fixtures/optim_*.bin, scripts/make_optim_fixtures.py), per step and
 * in the final state; checkpoint state save -> load -> continue; option
 * errors; no allocation in the step; the device option where no GPU runs
 * (the CPU by default, bad devices refused). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/optim.h"
#include "ddp/tensor.h"
#include "support/fixture.h"

/* ---- Fixture access --------------------------------------------------------- */

static fixture *load_fixture(const char *config) {
  char file[128], path[1024];
  snprintf(file, sizeof file, "optim_%s.bin", config);
  fixture *fx;
  if (fixture_load(fixture_path(file, path, sizeof path), &fx) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  return fx;
}

static const fixture_tensor *need(const fixture *fx, const char *name, ddp_dtype dtype) {
  const fixture_tensor *t = fixture_find(fx, name);
  if (!t) fail_msg("fixture has no record '%s'", name);
  if (t->dtype != dtype) fail_msg("fixture record '%s' has dtype %d, want %d", name, t->dtype, dtype);
  return t;
}

static int64_t scalar_i64(const fixture *fx, const char *name) {
  const fixture_tensor *t = need(fx, name, DDP_INT64);
  assert_int_equal(t->numel, 1);
  return ((const int64_t *)t->data)[0];
}

static double scalar_f64(const fixture *fx, const char *name) {
  const fixture_tensor *t = need(fx, name, DDP_FLOAT64);
  assert_int_equal(t->numel, 1);
  return ((const double *)t->data)[0];
}

static double hp(const fixture *fx, const char *name) {
  char key[64];
  snprintf(key, sizeof key, "hp.%s", name);
  return scalar_f64(fx, key);
}

/* The optimizer options the fixture was made with. */
static ddp_optim_options fixture_options(const fixture *fx) {
  int64_t kind = scalar_i64(fx, "kind");
  assert_true(kind >= 0 && kind < DDP_OPTIM_KIND_COUNT);
  ddp_optim_options o = ddp_optim_defaults((ddp_optim_kind)kind);
  switch (o.kind) {
    case DDP_OPTIM_SGD:
      o.sgd.momentum = hp(fx, "momentum");
      o.sgd.dampening = hp(fx, "dampening");
      o.sgd.nesterov = hp(fx, "nesterov") != 0.0;
      break;
    case DDP_OPTIM_ADAM:
      o.adam.beta1 = hp(fx, "beta1");
      o.adam.beta2 = hp(fx, "beta2");
      o.adam.eps = hp(fx, "eps");
      o.adam.amsgrad = hp(fx, "amsgrad") != 0.0;
      break;
    default:
      o.adadelta.rho = hp(fx, "rho");
      o.adadelta.eps = hp(fx, "eps");
      break;
  }
  o.lr = hp(fx, "lr");
  o.weight_decay = hp(fx, "weight_decay");
  o.maximize = hp(fx, "maximize") != 0.0;
  return o;
}

static ddp_step_lr_options fixture_sched_options(const fixture *fx) {
  ddp_step_lr_options so = ddp_step_lr_defaults(scalar_i64(fx, "sched.step_size"));
  so.gamma = scalar_f64(fx, "sched.gamma");
  return so;
}

/* ---- Comparison --------------------------------------------------------------- */

/* Distance in units in the last place between two floats of the same sign
 * (ordered-integer mapping, so it counts across exponents). */
static int64_t ulps(float a, float b) {
  int32_t ia, ib;
  memcpy(&ia, &a, 4);
  memcpy(&ib, &b, 4);
  if (ia < 0) ia = INT32_MIN - ia;
  if (ib < 0) ib = INT32_MIN - ib;
  int64_t d = (int64_t)ia - (int64_t)ib;
  return d < 0 ? -d : d;
}

typedef struct deviation {
  double max_abs;   /* max |ours - torch| over the checked arrays */
  double max_rel;   /* max_abs / max|torch| of the worst array */
  int64_t max_ulps; /* largest per-element ulp distance */
} deviation;

static deviation worst; /* over the whole run, printed at the end */

/* The acceptance rule: max|ours - torch| <= 1e-6 * max|torch| + 1e-7. */
static void expect_close(const char *what, const float *ours, const float *torch, size_t n,
                         deviation *dev) {
  double max_ref = 0, max_abs = 0;
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    if (isnan(torch[i]) || isnan(ours[i])) fail_msg("%s[%zu]: NaN (ours %g, torch %g)", what, i,
                                                    (double)ours[i], (double)torch[i]);
    double d = fabs((double)ours[i] - (double)torch[i]);
    if (fabs((double)torch[i]) > max_ref) max_ref = fabs((double)torch[i]);
    if (d > max_abs) {
      max_abs = d;
      at = i;
    }
    int64_t u = ulps(ours[i], torch[i]);
    if (u > dev->max_ulps) dev->max_ulps = u;
  }
  if (max_abs > dev->max_abs) dev->max_abs = max_abs;
  if (max_ref > 0 && max_abs / max_ref > dev->max_rel) dev->max_rel = max_abs / max_ref;
  if (max_abs > 1e-6 * max_ref + 1e-7)
    fail_msg("%s: max |ours - torch| = %.3g at [%zu] (ours %.9g, torch %.9g), allowed %.3g", what,
             max_abs, at, (double)ours[at], (double)torch[at], 1e-6 * max_ref + 1e-7);
}

static void merge(deviation *into, const deviation *d) {
  if (d->max_abs > into->max_abs) into->max_abs = d->max_abs;
  if (d->max_rel > into->max_rel) into->max_rel = d->max_rel;
  if (d->max_ulps > into->max_ulps) into->max_ulps = d->max_ulps;
}

/* ---- Against PyTorch ------------------------------------------------------------ */

/* Runs the fixture's configuration step by step: the lr in force before each
 * step must equal torch's exactly (it is a double computed the same way), the
 * params after it must be within tolerance, and the steps allocate nothing. */
static void test_matches_torch(void **state) {
  const char *config = *state;
  fixture *fx = load_fixture(config);
  const fixture_tensor *init = need(fx, "params.init", DDP_FLOAT32);
  const fixture_tensor *grads = need(fx, "grads", DDP_FLOAT32);
  const fixture_tensor *after = need(fx, "params", DDP_FLOAT32);
  const fixture_tensor *lrs = need(fx, "lr", DDP_FLOAT64);
  const double *lr = lrs->data;
  const size_t n = (size_t)init->numel;
  const size_t steps = (size_t)grads->shape[0];
  assert_int_equal(grads->ndim, 2);
  assert_int_equal(grads->shape[1], n);
  assert_int_equal(after->numel, (int64_t)(steps * n));
  assert_int_equal(lrs->numel, steps);

  float *params = malloc(n * sizeof *params), *grad = malloc(n * sizeof *grad);
  memcpy(params, init->data, n * sizeof *params);
  ddp_optim_options o = fixture_options(fx);
  ddp_step_lr_options so = fixture_sched_options(fx);
  ddp_optimizer *opt;
  ddp_scheduler *sched;
  assert_int_equal(ddp_optimizer_create(&opt, &o, params, grad, n), DDP_OK);
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_OK);
  assert_false(ddp_optimizer_has_state(opt));

  deviation dev = {0};
  uint64_t allocs = ddp_alloc_count();
  for (size_t s = 0; s < steps; s++) {
    memcpy(grad, (const float *)grads->data + s * n, n * sizeof *grad);
    if (ddp_optimizer_get_lr(opt) != lr[s])
      fail_msg("%s step %zu: lr %.17g, torch %.17g", config, s, ddp_optimizer_get_lr(opt),
               lr[s]);
    assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
    assert_int_equal(ddp_scheduler_step(sched), DDP_OK);
    char what[96];
    snprintf(what, sizeof what, "%s params after step %zu", config, s + 1);
    expect_close(what, params, (const float *)after->data + s * n, n, &dev);
  }
  assert_int_equal(ddp_alloc_count(), allocs); /* the steps allocate nothing */

  assert_true(ddp_optimizer_get_lr(opt) == scalar_f64(fx, "lr.final"));
  assert_true(ddp_scheduler_get_last_lr(sched) == scalar_f64(fx, "lr.final"));
  ddp_scheduler_state ss;
  ddp_scheduler_state_get(sched, &ss);
  assert_int_equal(ss.last_epoch, scalar_i64(fx, "sched.last_epoch"));
  assert_int_equal(ss.step_count, (int64_t)steps + 1);
  assert_true(ss.base_lr == hp(fx, "lr"));

  /* The final state, entry by entry, under PyTorch's names; every entry the
   * fixture has must exist here and the other way round. */
  assert_true(ddp_optimizer_has_state(opt));
  size_t fixture_states = 0;
  for (int i = 0; i < fx->count; i++) fixture_states += strncmp(fx->tensors[i].name, "state.", 6) == 0;
  assert_int_equal(ddp_optimizer_state_count(opt), fixture_states);
  for (size_t i = 0; i < ddp_optimizer_state_count(opt); i++) {
    ddp_optim_state st;
    assert_int_equal(ddp_optimizer_state_get(opt, i, &st), DDP_OK);
    char key[64], what[96];
    snprintf(key, sizeof key, "state.%s", st.name);
    const fixture_tensor *ref = need(fx, key, DDP_FLOAT32);
    assert_int_equal(st.numel, ref->numel);
    assert_int_equal(st.is_scalar, ref->ndim == 0);
    snprintf(what, sizeof what, "%s final %s", config, st.name);
    if (st.is_scalar)
      assert_true(st.data[0] == ((const float *)ref->data)[0]);
    else
      expect_close(what, st.data, ref->data, st.numel, &dev);
  }
  print_message("%-28s max |ours - torch| %.3g (%.3g of max|torch|), %lld ulp\n", config,
                dev.max_abs, dev.max_rel, (long long)dev.max_ulps);
  merge(&worst, &dev);

  ddp_scheduler_destroy(sched);
  ddp_optimizer_destroy(opt);
  free(params);
  free(grad);
  fixture_free(fx);
}

/* ---- Checkpoint: save -> load -> continue ---------------------------------------- */

typedef struct saved_state {
  size_t count;
  char name[4][32];
  float *data[4];
  size_t numel[4];
  double lr;
  ddp_scheduler_state sched;
} saved_state;

static void save(ddp_optimizer *opt, ddp_scheduler *sched, saved_state *out) {
  memset(out, 0, sizeof *out);
  out->count = ddp_optimizer_state_count(opt);
  assert_true(out->count <= 4);
  for (size_t i = 0; i < out->count; i++) {
    ddp_optim_state st;
    assert_int_equal(ddp_optimizer_state_get(opt, i, &st), DDP_OK);
    snprintf(out->name[i], sizeof out->name[i], "%s", st.name);
    out->numel[i] = st.numel;
    out->data[i] = malloc(st.numel * sizeof(float));
    memcpy(out->data[i], st.data, st.numel * sizeof(float));
  }
  out->lr = ddp_optimizer_get_lr(opt);
  ddp_scheduler_state_get(sched, &out->sched);
}

/* Every configuration: k steps, a checkpoint, a fresh optimizer and scheduler
 * that load it and run the remaining steps end bit-identical (params and
 * state) to an uninterrupted run, for every split point k. */
static void test_resume_matches_uninterrupted(void **state) {
  const char *config = *state;
  fixture *fx = load_fixture(config);
  const fixture_tensor *init = need(fx, "params.init", DDP_FLOAT32);
  const fixture_tensor *grads = need(fx, "grads", DDP_FLOAT32);
  const size_t n = (size_t)init->numel, steps = (size_t)grads->shape[0];
  ddp_optim_options o = fixture_options(fx);
  ddp_step_lr_options so = fixture_sched_options(fx);
  float *grad = malloc(n * sizeof *grad);
  float *straight = malloc(n * sizeof *straight), *resumed = malloc(n * sizeof *resumed);

  /* Uninterrupted. */
  memcpy(straight, init->data, n * sizeof(float));
  ddp_optimizer *a;
  ddp_scheduler *sa;
  assert_int_equal(ddp_optimizer_create(&a, &o, straight, grad, n), DDP_OK);
  assert_int_equal(ddp_scheduler_create_step_lr(&sa, a, &so), DDP_OK);
  for (size_t s = 0; s < steps; s++) {
    memcpy(grad, (const float *)grads->data + s * n, n * sizeof *grad);
    ddp_optimizer_step(a);
    ddp_scheduler_step(sa);
  }

  for (size_t k = 1; k < steps; k++) {
    memcpy(resumed, init->data, n * sizeof(float));
    ddp_optimizer *b;
    ddp_scheduler *sb;
    assert_int_equal(ddp_optimizer_create(&b, &o, resumed, grad, n), DDP_OK);
    assert_int_equal(ddp_scheduler_create_step_lr(&sb, b, &so), DDP_OK);
    for (size_t s = 0; s < k; s++) {
      memcpy(grad, (const float *)grads->data + s * n, n * sizeof *grad);
      ddp_optimizer_step(b);
      ddp_scheduler_step(sb);
    }
    saved_state saved;
    save(b, sb, &saved);
    ddp_scheduler_destroy(sb);
    ddp_optimizer_destroy(b);

    /* A new process would start from the same parameters (restored from the
     * checkpoint too): keep `resumed` and rebuild everything else. */
    ddp_optim_options fresh = o;
    assert_int_equal(ddp_optimizer_create(&b, &fresh, resumed, grad, n), DDP_OK);
    assert_int_equal(ddp_scheduler_create_step_lr(&sb, b, &so), DDP_OK);
    for (size_t i = 0; i < saved.count; i++) {
      assert_int_equal(ddp_optimizer_state_load(b, saved.name[i], saved.data[i], saved.numel[i]),
                       DDP_OK);
      free(saved.data[i]);
    }
    assert_int_equal(ddp_optimizer_set_lr(b, saved.lr), DDP_OK);
    assert_int_equal(ddp_scheduler_state_load(sb, &saved.sched), DDP_OK);
    assert_int_equal(ddp_optimizer_has_state(b), saved.count > 0);
    for (size_t s = k; s < steps; s++) {
      memcpy(grad, (const float *)grads->data + s * n, n * sizeof *grad);
      ddp_optimizer_step(b);
      ddp_scheduler_step(sb);
    }
    if (memcmp(straight, resumed, n * sizeof(float)) != 0)
      fail_msg("%s: resumed after step %zu differs from the uninterrupted run", config, k);
    assert_true(ddp_optimizer_get_lr(a) == ddp_optimizer_get_lr(b));
    ddp_scheduler_state x, y;
    ddp_scheduler_state_get(sa, &x);
    ddp_scheduler_state_get(sb, &y);
    assert_memory_equal(&x, &y, sizeof x);
    for (size_t i = 0; i < ddp_optimizer_state_count(a); i++) {
      ddp_optim_state sx, sy;
      ddp_optimizer_state_get(a, i, &sx);
      ddp_optimizer_state_get(b, i, &sy);
      assert_string_equal(sx.name, sy.name);
      assert_memory_equal(sx.data, sy.data, sx.numel * sizeof(float));
    }
    assert_int_equal(ddp_optimizer_step_count(b),
                     o.kind == DDP_OPTIM_ADAM ? (int64_t)steps : (int64_t)(steps - k));
    ddp_scheduler_destroy(sb);
    ddp_optimizer_destroy(b);
  }
  ddp_scheduler_destroy(sa);
  ddp_optimizer_destroy(a);
  free(grad);
  free(straight);
  free(resumed);
  fixture_free(fx);
}

/* ---- State API --------------------------------------------------------------- */

static void expect_names(ddp_optimizer *opt, const char *const *names, size_t count) {
  assert_int_equal(ddp_optimizer_state_count(opt), count);
  for (size_t i = 0; i < count; i++) {
    ddp_optim_state st;
    assert_int_equal(ddp_optimizer_state_get(opt, i, &st), DDP_OK);
    assert_string_equal(st.name, names[i]);
    assert_non_null(st.data);
    assert_int_equal(st.is_scalar, strcmp(names[i], "step") == 0);
    assert_int_equal(st.numel, st.is_scalar ? 1 : 10);
  }
  ddp_optim_state st;
  assert_int_equal(ddp_optimizer_state_get(opt, count, &st), DDP_ERR_RANGE);
}

static void test_state_names_and_errors(void **state) {
  (void)state;
  float p[10] = {0}, g[10] = {0};
  ddp_optimizer *opt;

  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 10), DDP_OK);
  expect_names(opt, NULL, 0); /* no momentum, no state (as PyTorch: None) */
  ddp_optimizer_destroy(opt);

  o.sgd.momentum = 0.9;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 10), DDP_OK);
  static const char *const sgd_names[] = {"momentum_buffer"};
  expect_names(opt, sgd_names, 1);
  ddp_optim_state st;
  assert_int_equal(ddp_optimizer_state_find(opt, "exp_avg", &st), DDP_ERR_NOTFOUND);
  assert_string_equal(ddp_last_error(),
                      "sgd: no state named 'exp_avg' (this optimizer has: momentum_buffer)");
  float wrong[9] = {0};
  assert_int_equal(ddp_optimizer_state_load(opt, "momentum_buffer", wrong, 9), DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(), "sgd: state 'momentum_buffer' has 10 floats, got 9");
  assert_false(ddp_optimizer_has_state(opt));
  ddp_optimizer_destroy(opt);

  o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 10), DDP_OK);
  static const char *const adam_names[] = {"step", "exp_avg", "exp_avg_sq"};
  expect_names(opt, adam_names, 3);
  float bad_step = 2.5f;
  assert_int_equal(ddp_optimizer_state_load(opt, "step", &bad_step, 1), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "adam: state 'step' = 2.5 is not a step count");
  float step = 7.0f;
  assert_int_equal(ddp_optimizer_state_load(opt, "step", &step, 1), DDP_OK);
  assert_int_equal(ddp_optimizer_step_count(opt), 7);
  assert_true(ddp_optimizer_has_state(opt));
  ddp_optimizer_destroy(opt);

  o.adam.amsgrad = true;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 10), DDP_OK);
  static const char *const ams_names[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  expect_names(opt, ams_names, 4);
  ddp_optimizer_destroy(opt);

  o = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 10), DDP_OK);
  static const char *const adadelta_names[] = {"square_avg", "acc_delta"};
  expect_names(opt, adadelta_names, 2);
  ddp_optimizer_destroy(opt);
}

/* A loaded momentum buffer is decayed by the next step, not replaced by the
 * gradient as on a first step: buf = 0.9 * 2 + 1 * 1 = 2.8, p = -0.1 * 2.8. */
static void test_sgd_loaded_buffer_is_not_first_step(void **state) {
  (void)state;
  float p[3] = {0}, g[3] = {1, 1, 1}, buf[3] = {2, 2, 2};
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = 0.1;
  o.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 3), DDP_OK);
  assert_int_equal(ddp_optimizer_state_load(opt, "momentum_buffer", buf, 3), DDP_OK);
  assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
  ddp_optim_state st;
  assert_int_equal(ddp_optimizer_state_find(opt, "momentum_buffer", &st), DDP_OK);
  for (int i = 0; i < 3; i++) {
    assert_true(st.data[i] == fmaf(1.0f, 1.0f, 2.0f * 0.9f));
    assert_true(p[i] == fmaf(st.data[i], -0.1f, 0.0f));
  }
  ddp_optimizer_destroy(opt);
}

/* ---- Option errors ------------------------------------------------------------ */

static void expect_invalid(const ddp_optim_options *o, float *p, const float *g, size_t n,
                           const char *message) {
  ddp_optimizer *opt = (ddp_optimizer *)&opt; /* must be reset to NULL */
  ddp_clear_error();
  assert_int_equal(ddp_optimizer_create(&opt, o, p, g, n), DDP_ERR_INVALID);
  assert_null(opt);
  assert_string_equal(ddp_last_error(), message);
}

static void test_bad_options(void **state) {
  (void)state;
  float p[4] = {0}, g[4] = {0};
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = -0.1;
  expect_invalid(&o, p, g, 4, "sgd: lr = -0.1 must be >= 0");
  o.lr = NAN;
  expect_invalid(&o, p, g, 4, "sgd: lr = nan must be >= 0");
  o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.sgd.momentum = -0.5;
  expect_invalid(&o, p, g, 4, "sgd: momentum = -0.5 must be >= 0");
  o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.weight_decay = -1;
  expect_invalid(&o, p, g, 4, "sgd: weight_decay = -1 must be >= 0");
  o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.sgd.nesterov = true;
  expect_invalid(&o, p, g, 4,
                 "sgd: nesterov momentum requires momentum > 0 and dampening = 0 "
                 "(momentum = 0, dampening = 0)");
  o.sgd.momentum = 0.9;
  o.sgd.dampening = 0.1;
  expect_invalid(&o, p, g, 4,
                 "sgd: nesterov momentum requires momentum > 0 and dampening = 0 "
                 "(momentum = 0.9, dampening = 0.1)");
  o = ddp_optim_defaults(DDP_OPTIM_SGD);
  expect_invalid(&o, NULL, g, 4, "sgd: params is NULL");
  expect_invalid(&o, p, NULL, 4, "sgd: grads is NULL");
  expect_invalid(&o, p, g, 0, "sgd: empty parameter buffer (n = 0)");
  expect_invalid(NULL, p, g, 4, "optim: options is NULL");
  o.kind = (ddp_optim_kind)7;
  expect_invalid(&o, p, g, 4, "optim: unknown optimizer kind 7");

  o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.adam.beta1 = 1.0;
  expect_invalid(&o, p, g, 4, "adam: betas[0] = 1 must be in [0, 1)");
  o.adam.beta1 = 0.9;
  o.adam.beta2 = -0.1;
  expect_invalid(&o, p, g, 4, "adam: betas[1] = -0.1 must be in [0, 1)");
  o.adam.beta2 = 0.999;
  o.adam.eps = -1e-8;
  expect_invalid(&o, p, g, 4, "adam: eps = -1e-08 must be >= 0");
  o.adam.eps = 1e-8;
  o.lr = -1;
  expect_invalid(&o, p, g, 4, "adam: lr = -1 must be >= 0");

  o = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  o.adadelta.rho = 1.5;
  expect_invalid(&o, p, g, 4, "adadelta: rho = 1.5 must be in [0, 1]");
  o.adadelta.rho = 1.0; /* allowed, as in PyTorch */
  ddp_optimizer *opt;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 4), DDP_OK);
  assert_int_equal(ddp_optimizer_set_lr(opt, -0.5), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "adadelta: lr = -0.5 must be >= 0");
  assert_true(ddp_optimizer_get_lr(opt) == 1.0);

  /* Scheduler options. */
  ddp_scheduler *sched = (ddp_scheduler *)&sched;
  ddp_step_lr_options so = ddp_step_lr_defaults(0);
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_ERR_INVALID);
  assert_null(sched);
  assert_string_equal(ddp_last_error(), "steplr: step_size = 0 must be > 0");
  so = ddp_step_lr_defaults(-3);
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "steplr: step_size = -3 must be > 0");
  so = ddp_step_lr_defaults(2);
  so.gamma = -0.1;
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "steplr: gamma = -0.1 must be finite and >= 0");
  so = ddp_step_lr_defaults(2);
  so.last_epoch = 4;
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(),
                      "steplr: resuming at last_epoch = 4 needs base_lr (PyTorch's initial_lr) "
                      ">= 0, got nan");
  so = ddp_step_lr_defaults(2);
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, NULL, &so), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "steplr: optimizer is NULL");
  ddp_optimizer_destroy(opt);
  ddp_optimizer_destroy(NULL);
  ddp_scheduler_destroy(NULL);
  assert_int_equal(ddp_optimizer_step(NULL), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "optim: step on a NULL optimizer");
  assert_int_equal(ddp_scheduler_step(NULL), DDP_ERR_INVALID);
}

/* ---- Schedules against PyTorch's values -------------------------------------------- */

/* Values printed by torch 1.13 (see docs/optim.md):
 *   opt lr 0.05, initial_lr 0.1, StepLR(step_size=2, gamma=0.5, last_epoch=3)
 *     -> lr 0.025, last_epoch 4, _step_count 1
 *   lr 0.1, StepLR(2, 0.3): step(5) -> 0.009; step(); step() -> 0.0026999999999999997
 *   lr 0.1, StepLR(2, 0.3), six step()s -> 0.0026999999999999997, _step_count 7 */
static void test_step_lr_against_torch(void **state) {
  (void)state;
  float p[2] = {0}, g[2] = {0};
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = 0.05;
  ddp_optimizer *opt;
  ddp_scheduler *sched;
  ddp_scheduler_state ss;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 2), DDP_OK);
  ddp_step_lr_options so = ddp_step_lr_defaults(2);
  so.gamma = 0.5;
  so.last_epoch = 3;
  so.base_lr = 0.1;
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_OK);
  assert_true(ddp_optimizer_get_lr(opt) == 0.025);
  ddp_scheduler_state_get(sched, &ss);
  assert_int_equal(ss.last_epoch, 4);
  assert_int_equal(ss.step_count, 1);
  assert_true(ss.base_lr == 0.1);
  ddp_scheduler_destroy(sched);

  assert_int_equal(ddp_optimizer_set_lr(opt, 0.1), DDP_OK);
  so = ddp_step_lr_defaults(2);
  so.gamma = 0.3;
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_OK);
  assert_int_equal(ddp_scheduler_step_to(sched, 5), DDP_OK);
  assert_true(ddp_optimizer_get_lr(opt) == 0.009);
  ddp_scheduler_step(sched);
  ddp_scheduler_step(sched);
  assert_true(ddp_optimizer_get_lr(opt) == 0.0026999999999999997);
  ddp_scheduler_state_get(sched, &ss);
  assert_int_equal(ss.last_epoch, 7);
  ddp_scheduler_destroy(sched);

  assert_int_equal(ddp_optimizer_set_lr(opt, 0.1), DDP_OK);
  assert_int_equal(ddp_scheduler_create_step_lr(&sched, opt, &so), DDP_OK);
  for (int i = 0; i < 6; i++) ddp_scheduler_step(sched);
  assert_true(ddp_optimizer_get_lr(opt) == 0.0026999999999999997);
  assert_true(ddp_scheduler_get_last_lr(sched) == 0.0026999999999999997);
  ddp_scheduler_state_get(sched, &ss);
  assert_int_equal(ss.step_count, 7);
  /* Chainable: an lr set by hand between epochs is kept and decayed. */
  assert_int_equal(ddp_optimizer_set_lr(opt, 1.0), DDP_OK);
  ddp_scheduler_step(sched); /* epoch 7: no decay */
  assert_true(ddp_optimizer_get_lr(opt) == 1.0);
  ddp_scheduler_step(sched); /* epoch 8: decay */
  assert_true(ddp_optimizer_get_lr(opt) == 0.3);
  ddp_scheduler_destroy(sched);
  ddp_optimizer_destroy(opt);
}

/* ---- Device ------------------------------------------------------------------- */

/* options.device where no GPU runs: the CPU by default and for every kind,
 * a bad device refused with a message before anything is allocated, and
 * cuda:N refused by a build without CUDA (or, in a CUDA build, a device the
 * process does not have). The GPU path itself is tests/cuda/test_cuda_optim.c. */
static void test_device_option(void **state) {
  (void)state;
  /* The field took one word of the reserved space: the struct keeps its size. */
  assert_int_equal(sizeof(ddp_device), sizeof(uint64_t));
  float p[4] = {0}, g[4] = {0};
  for (int kind = 0; kind < DDP_OPTIM_KIND_COUNT; kind++) {
    ddp_optim_options o = ddp_optim_defaults((ddp_optim_kind)kind);
    assert_true(ddp_device_equal(o.device, DDP_CPU));
    ddp_optimizer *opt;
    assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 4), DDP_OK);
    assert_true(ddp_device_equal(ddp_optimizer_options(opt)->device, DDP_CPU));
    ddp_optimizer_destroy(opt);
  }

  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.device = (ddp_device){DDP_DEVICE_CPU, 1};
  expect_invalid(&o, p, g, 4, "sgd: device cpu with index 1 (the CPU is index 0)");
  o.device = (ddp_device){(ddp_device_type)5, 0};
  expect_invalid(&o, p, g, 4, "sgd: unknown device type 5");

  ddp_optimizer *opt = (ddp_optimizer *)&opt;
  o = ddp_optim_defaults(DDP_OPTIM_ADAM);
#ifndef DDP_HAVE_CUDA
  o.device = DDP_CUDA(0);
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, 4), DDP_ERR_UNSUPPORTED);
  assert_null(opt);
  assert_string_equal(ddp_last_error(), "adam: device cuda:0: this build has no CUDA backend");
#else
  /* The first ordinal this process lacks: ddp_device_check's error. */
  o.device = DDP_CUDA(ddp_cuda_device_count());
  assert_int_not_equal(ddp_optimizer_create(&opt, &o, p, g, 4), DDP_OK);
  assert_null(opt);
  print_message("cuda:%d refused: %s\n", o.device.index, ddp_last_error());
#endif
}

/* ---- No allocation at scale --------------------------------------------------------- */

/* ddp_optimizer_narrow (ZeRO's shard): a narrowed optimizer keeps its
 * range's state and steps that range exactly as the whole optimizer steps
 * it (every kind is elementwise); bad ranges are refused, unchanged. */
static void test_narrow_steps_its_range(void **state) {
  (void)state;
  enum { N = 23, LO = 7, LEN = 9 };
  for (int kind = 0; kind < DDP_OPTIM_KIND_COUNT; kind++) {
    ddp_optim_options o = ddp_optim_defaults((ddp_optim_kind)kind);
    o.weight_decay = 0.01;
    if (kind == DDP_OPTIM_SGD) o.sgd.momentum = 0.9;
    float pw[N], pn[N], g[N], st[N];
    for (int i = 0; i < N; i++) {
      pw[i] = pn[i] = 0.1f * (float)(i - 11);
      g[i] = 0.05f * (float)((i * 7) % 5) - 0.1f;
      st[i] = 0.001f * (float)(i + 1);
    }
    ddp_optimizer *whole, *part;
    assert_int_equal(ddp_optimizer_create(&whole, &o, pw, g, N), DDP_OK);
    assert_int_equal(ddp_optimizer_create(&part, &o, pn, g, N), DDP_OK);
    for (size_t k = 0; k < ddp_optimizer_state_count(whole); k++) {
      ddp_optim_state e;
      assert_int_equal(ddp_optimizer_state_get(whole, k, &e), DDP_OK);
      float step = 2;
      assert_int_equal(ddp_optimizer_state_load(whole, e.name, e.is_scalar ? &step : st, e.numel), DDP_OK);
      assert_int_equal(ddp_optimizer_state_load(part, e.name, e.is_scalar ? &step : st, e.numel), DDP_OK);
    }
    assert_int_equal(ddp_optimizer_narrow(part, N - 3, 4), DDP_ERR_RANGE);
    assert_int_equal(ddp_optimizer_narrow(part, 0, 0), DDP_ERR_RANGE);
    assert_int_equal(ddp_optimizer_numel(part), N);
    assert_int_equal(ddp_optimizer_narrow(part, LO, LEN), DDP_OK);
    assert_int_equal(ddp_optimizer_numel(part), LEN);
    for (int t = 0; t < 3; t++) {
      assert_int_equal(ddp_optimizer_step(whole), DDP_OK);
      assert_int_equal(ddp_optimizer_step(part), DDP_OK);
    }
    /* The range moved as the whole one did; outside it nothing moved. */
    assert_memory_equal(pn + LO, pw + LO, LEN * sizeof(float));
    for (int i = 0; i < N; i++)
      if (i < LO || i >= LO + LEN) assert_true(pn[i] == 0.1f * (float)(i - 11));
    for (size_t k = 0; k < ddp_optimizer_state_count(whole); k++) {
      ddp_optim_state w, p;
      assert_int_equal(ddp_optimizer_state_get(whole, k, &w), DDP_OK);
      assert_int_equal(ddp_optimizer_state_get(part, k, &p), DDP_OK);
      if (w.is_scalar) {
        assert_true(p.data[0] == w.data[0]);
      } else {
        assert_int_equal(p.numel, LEN);
        assert_memory_equal(p.data, w.data + LO, LEN * sizeof(float));
      }
    }
    ddp_optimizer_destroy(whole);
    ddp_optimizer_destroy(part);
  }
}

static void test_step_allocates_nothing(void **state) {
  (void)state;
  const size_t n = 1 << 16;
  float *p = calloc(n, sizeof *p), *g = malloc(n * sizeof *g);
  for (size_t i = 0; i < n; i++) g[i] = (float)((int)(i % 7) - 3) * 1e-3f;
  for (int kind = 0; kind < DDP_OPTIM_KIND_COUNT; kind++) {
    ddp_optim_options o = ddp_optim_defaults((ddp_optim_kind)kind);
    o.weight_decay = 1e-4;
    if (kind == DDP_OPTIM_SGD) o.sgd.momentum = 0.9;
    if (kind == DDP_OPTIM_ADAM) o.adam.amsgrad = true;
    ddp_optimizer *opt;
    assert_int_equal(ddp_optimizer_create(&opt, &o, p, g, n), DDP_OK);
    uint64_t before = ddp_alloc_count();
    for (int s = 0; s < 3; s++) assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
    assert_int_equal(ddp_alloc_count(), before);
    ddp_optimizer_destroy(opt);
  }
  free(p);
  free(g);
}

static int report_worst(void **state) {
  (void)state;
  print_message("largest deviation from torch over all configurations: %.3g abs, %.3g rel, "
                "%lld ulp\n",
                worst.max_abs, worst.max_rel, (long long)worst.max_ulps);
  return 0;
}

#define CONFIG_TESTS(name)                                                               \
  {"test_matches_torch(" name ")", test_matches_torch, NULL, NULL, (void *)name},          \
      {"test_resume_matches_uninterrupted(" name ")", test_resume_matches_uninterrupted, NULL, \
       NULL, (void *)name}

int main(void) {
  const struct CMUnitTest tests[] = {
      CONFIG_TESTS("sgd_plain"),
      CONFIG_TESTS("sgd_momentum_wd_dampening"),
      CONFIG_TESTS("sgd_nesterov_wd"),
      CONFIG_TESTS("adam"),
      CONFIG_TESTS("adam_wd"),
      CONFIG_TESTS("adam_wd_amsgrad"),
      CONFIG_TESTS("adam_maximize"),
      CONFIG_TESTS("adadelta"),
      CONFIG_TESTS("adadelta_wd"),
      cmocka_unit_test(test_state_names_and_errors),
      cmocka_unit_test(test_sgd_loaded_buffer_is_not_first_step),
      cmocka_unit_test(test_bad_options),
      cmocka_unit_test(test_step_lr_against_torch),
      cmocka_unit_test(test_narrow_steps_its_range),
      cmocka_unit_test(test_step_allocates_nothing),
      cmocka_unit_test(test_device_option),
  };
  return cmocka_run_group_tests(tests, NULL, report_worst);
}
