/* The trainer's gradient scaler through the library (ddp_train_options
 * .precision, .grad_scaler; docs/mixed-precision.md): the steady step of an
 * fp16 run with the scaler and micro-batches allocates nothing, a skipped
 * step included; what the step callback sees (the scale halved at the
 * skip, doubled after growth_interval clean steps, skipped steps counted;
 * NaN and 0 without a scaler); the parameters after a skipped step are the
 * ones before it; bad options refused naming the field. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "ddp/train.h"
#include "tensor/tape.h"       /* ddp__basic_kernels_for: the CPU's unscale pass */
#include "train/train_internal.h" /* ddp__train_precision_check */

enum { SEED = 4, BATCH = 16, STEPS = 12, SKIP_AT = 8 };

typedef struct probe {
  uint64_t at4, at12;
  double scale[STEPS + 1];
  bool skipped[STEPS + 1];
  int64_t skipped_steps[STEPS + 1];
  float params_before_skip[4], params_after_skip[4];
  ddp_model *model;
} probe;

static bool on_step(const ddp_train_step_info *info, void *user) {
  probe *p = user;
  if (info->step == 4) p->at4 = ddp_alloc_count();
  if (info->step == STEPS) p->at12 = ddp_alloc_count();
  p->scale[info->step] = info->loss_scale;
  p->skipped[info->step] = info->skipped;
  p->skipped_steps[info->step] = info->skipped_steps;
  if (info->step == SKIP_AT - 1) memcpy(p->params_before_skip, ddp_model_params_flat(p->model), sizeof p->params_before_skip);
  if (info->step == SKIP_AT) memcpy(p->params_after_skip, ddp_model_params_flat(p->model), sizeof p->params_after_skip);
  return false;
}

static void run(ddp_train_options *o, probe *p) {
  ddp_model *model;
  ddp_dataset *train_ds, *test_ds;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&train_ds, 512, SEED), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&test_ds, 32, SEED + 1), DDP_OK);
  o->max_steps = STEPS;
  o->batch_size = BATCH;
  o->workers = 1;
  p->model = model;
  o->callbacks = (ddp_train_callbacks){NULL, on_step, NULL, p};
  ddp_trainer *t;
  assert_int_equal(ddp_trainer_create(&t, model, train_ds, test_ds, NULL, o), DDP_OK);
  ddp_train_result r;
  assert_int_equal(ddp_trainer_run(t, &r), DDP_OK);
  ddp_train_result_free(&r);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test_ds);
  ddp_dataset_destroy(train_ds);
  ddp_model_destroy(model);
}

static void test_fp16_scaler_steps(void **state) {
  (void)state;
  ddp_train_options o = ddp_train_defaults();
  o.microbatches = 3;
  o.grad_scaler_growth_interval = 3;
  probe p;
  /* fp16 under autocast: the steady step, a skip included, allocates nothing
   * (its scale follows the real overflows of fp16 arithmetic, so the rules
   * are checked below on the scaler without autocast, where only the
   * injected inf overflows). */
  o.precision = DDP_PRECISION_FP16;
  memset(&p, 0, sizeof p);
  setenv("DDP_TEST_INJECT_INF", "8", 1); /* read when the trainer is made */
  run(&o, &p);
  assert_true(p.at4 > 0);
  if (p.at12 != p.at4)
    print_error("%llu allocations in 8 steady fp16 steps\n", (unsigned long long)(p.at12 - p.at4));
  assert_int_equal(p.at12, p.at4);
  assert_int_equal(p.skipped[SKIP_AT], 1);
  o.precision = DDP_PRECISION_FP32;
  o.grad_scaler = DDP_TRAIN_GRAD_SCALER_ON;
  memset(&p, 0, sizeof p);
  run(&o, &p);
  unsetenv("DDP_TEST_INJECT_INF");
  /* Allocation-free, the skipped step 8 included. */
  assert_true(p.at4 > 0);
  if (p.at12 != p.at4)
    print_error("%llu allocations in 8 steady fp16 steps\n", (unsigned long long)(p.at12 - p.at4));
  assert_int_equal(p.at12, p.at4);
  /* GradScaler's rules, interval 3: x2 after 3, 6; x0.5 at 8; x2 after 11. */
  const double expect[STEPS + 1] = {0, 65536, 65536, 131072, 131072, 131072, 262144, 262144,
                                    131072, 131072, 131072, 262144, 262144};
  for (int s = 1; s <= STEPS; s++) {
    assert_true(p.scale[s] == expect[s]);
    assert_int_equal(p.skipped[s], s == SKIP_AT);
    assert_int_equal(p.skipped_steps[s], s >= SKIP_AT);
  }
  /* The skipped step left the parameters as they were. */
  assert_memory_equal(p.params_before_skip, p.params_after_skip, sizeof p.params_before_skip);
}

static void test_no_scaler(void **state) {
  (void)state;
  for (int precision = DDP_PRECISION_FP32; precision <= DDP_PRECISION_FP16; precision++) {
    ddp_train_options o = ddp_train_defaults();
    o.precision = precision;
    if (precision == DDP_PRECISION_FP16) o.grad_scaler = DDP_TRAIN_GRAD_SCALER_OFF;
    probe p;
    memset(&p, 0, sizeof p);
    run(&o, &p);
    assert_true(isnan(p.scale[1]) && isnan(p.scale[STEPS]));
    assert_int_equal(p.skipped_steps[STEPS], 0);
  }
}

static void expect_refused(ddp_train_options *o, ddp_status code, const char *words) {
  ddp_model *model;
  ddp_dataset *ds;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&ds, 64, SEED), DDP_OK);
  ddp_trainer *t = (ddp_trainer *)1;
  assert_int_equal(ddp_trainer_create(&t, model, ds, ds, NULL, o), code);
  assert_null(t);
  if (!strstr(ddp_last_error(), words)) fail_msg("'%s' lacks '%s'", ddp_last_error(), words);
  ddp_dataset_destroy(ds);
  ddp_model_destroy(model);
}

static void test_bad_options(void **state) {
  (void)state;
  ddp_train_options o = ddp_train_defaults();
  o.precision = 7;
  expect_refused(&o, DDP_ERR_INVALID, "precision is 7");
  o = ddp_train_defaults();
  o.precision = DDP_PRECISION_TF32;
  expect_refused(&o, DDP_ERR_UNSUPPORTED, "GPU-only opt-in");
  o = ddp_train_defaults();
  o.grad_scaler = 3;
  expect_refused(&o, DDP_ERR_INVALID, "grad_scaler is 3");
  o = ddp_train_defaults();
  o.grad_scaler_growth_interval = -1;
  expect_refused(&o, DDP_ERR_INVALID, "grad_scaler_growth_interval");
  setenv("DDP_TEST_INJECT_INF", "x", 1);
  o = ddp_train_defaults();
  o.precision = DDP_PRECISION_FP16;
  expect_refused(&o, DDP_ERR_INVALID, "DDP_TEST_INJECT_INF");
  unsetenv("DDP_TEST_INJECT_INF");
}

/* The GPU's precisions as the options check sees them (no GPU needed):
 * bf16, fp16 (with its scaler) and tf32 on cuda are accepted in a CUDA
 * build (the ops, the scaler's unscale and TF32 run on the device); tf32
 * stays refused on the CPU, and on cuda in a build without CUDA. */
static void test_gpu_precisions(void **state) {
  (void)state;
  const ddp_precision ps[] = {DDP_PRECISION_BF16, DDP_PRECISION_FP16, DDP_PRECISION_TF32};
  for (int i = 0; i < 3; i++) {
    ddp_train_options o = ddp_train_defaults();
    o.device = DDP_CUDA(0);
    o.precision = ps[i];
    const ddp_status s = ddp__train_precision_check(&o);
    if (ddp_cuda_built() || ps[i] != DDP_PRECISION_TF32) {
      if (s != DDP_OK) fail_msg("precision %d on cuda refused: %s", (int)ps[i], ddp_last_error());
    } else {
      assert_int_equal(s, DDP_ERR_UNSUPPORTED);
      assert_non_null(strstr(ddp_last_error(), "no CUDA backend"));
    }
    o.grad_scaler = DDP_TRAIN_GRAD_SCALER_ON; /* a scaler on the GPU: no longer refused */
    if (ps[i] != DDP_PRECISION_TF32) assert_int_equal(ddp__train_precision_check(&o), DDP_OK);
  }
  ddp_train_options o = ddp_train_defaults();
  o.device = DDP_CUDA(0);
  o.cuda_graph = true; /* bf16 replays its region; a scaler cannot be replayed */
  o.precision = DDP_PRECISION_BF16;
  assert_int_equal(ddp__train_precision_check(&o), DDP_OK);
  o.precision = DDP_PRECISION_FP16;
  assert_int_equal(ddp__train_precision_check(&o), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "CUDA graph"));
  o = ddp_train_defaults();
  o.precision = DDP_PRECISION_TF32;
  assert_int_equal(ddp__train_precision_check(&o), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "GPU-only opt-in"));
  o.param_server = (struct ddp_ps_client *)(uintptr_t)1; /* set (only that is read): still
                                                           * refused, the servers step */
  o.precision = DDP_PRECISION_FP16;
  assert_int_equal(ddp__train_precision_check(&o), DDP_ERR_UNSUPPORTED);
}

/* The device-neutral unscale (ddp_grad_scaler_unscale_on) on the CPU: the
 * host function's bits and finding. */
static void test_unscale_on_cpu(void **state) {
  (void)state;
  enum { N = 1000 };
  float a[N], b[N];
  for (int i = 0; i < N; i++) a[i] = b[i] = (float)(i - 500) * 3.25f;
  ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
  assert_false(ddp_grad_scaler_unscale(&gs, a, N));
  assert_false(ddp_grad_scaler_unscale_on(&gs, DDP_CPU, b, N));
  assert_memory_equal(a, b, sizeof a);
  b[N - 1] = NAN;
  assert_true(ddp_grad_scaler_unscale_on(&gs, DDP_CPU, b, N));
  memcpy(b, a, sizeof b);
  b[N - 1] = INFINITY;
  assert_true(ddp__basic_kernels_for(DDP_CPU)->unscale_check(b, 1.0f, N));
  assert_true(isinf(b[N - 1]) && b[0] == a[0]); /* inverse 1: untouched */
  gs.enabled = false;
  assert_false(ddp_grad_scaler_unscale_on(&gs, DDP_CPU, b, N));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_precisions),
      cmocka_unit_test(test_unscale_on_cpu),
      cmocka_unit_test(test_fp16_scaler_steps),
      cmocka_unit_test(test_no_scaler),
      cmocka_unit_test(test_bad_options),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
