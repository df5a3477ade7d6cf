/* Gradient accumulation (ddp_train_options.microbatches) against a float64
 * computation of the same steps written out here: seed 001's toy model
 * (Linear(10, 10), ReLU, Linear(10, 5), mean squared error) on its
 * regression data, 3 steps of SGD with momentum, each batch of 16 split as
 * torch.tensor_split splits it (M = 3: 6, 5, 5; M = 5: 4, 3, 3, 3, 3; M = 4:
 * 4 x 4), the micro-batches' gradients summed and scaled by 1/M (or not,
 * with microbatch_sum). Every parameter within 1e-5 * max|ref| + 1e-7.
 * Uneven micro-batches weigh their rows unequally, so their update is not
 * the full batch's: the test also checks that the reference of the full
 * batch is farther than the bound (the check can tell the two apart).
 * And the steady step with micro-batches allocates nothing. */
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

enum { IN = 10, HID = 10, OUT = 5, SAMPLES = 48, BATCH = 16, STEPS = 3 };
#define LR 0.05
#define MOMENTUM 0.9
#define SEED 4

/* The toy model's parameters in float64, in its registration order. */
typedef struct toy {
  double w1[HID][IN], b1[HID], w2[OUT][HID], b2[OUT];
} toy;

static void toy_from_model(ddp_model *m, toy *p) {
  const char *names[4] = {"net1.weight", "net1.bias", "net2.weight", "net2.bias"};
  double *dst[4] = {&p->w1[0][0], p->b1, &p->w2[0][0], p->b2};
  const int64_t numel[4] = {HID * IN, HID, OUT * HID, OUT};
  for (int k = 0; k < 4; k++) {
    ddp_tensor *t = ddp_model_find_param(m, names[k]);
    assert_non_null(t);
    assert_int_equal(t->numel, numel[k]);
    for (int64_t i = 0; i < numel[k]; i++) dst[k][i] = ddp_tensor_f32(t)[i];
  }
}

/* Adds d(mean squared error of rows [first, first + rows))/d(params) into g. */
static void toy_grad(const toy *p, const double (*x)[IN], const double (*y)[OUT], int first,
                     int rows, toy *g) {
  for (int r = first; r < first + rows; r++) {
    double h[HID], a[HID], o[OUT], dout[OUT], da[HID] = {0};
    for (int j = 0; j < HID; j++) {
      h[j] = p->b1[j];
      for (int i = 0; i < IN; i++) h[j] += p->w1[j][i] * x[r][i];
      a[j] = h[j] > 0 ? h[j] : 0;
    }
    for (int k = 0; k < OUT; k++) {
      o[k] = p->b2[k];
      for (int j = 0; j < HID; j++) o[k] += p->w2[k][j] * a[j];
      dout[k] = 2 * (o[k] - y[r][k]) / (rows * OUT);
      g->b2[k] += dout[k];
      for (int j = 0; j < HID; j++) {
        g->w2[k][j] += dout[k] * a[j];
        da[j] += p->w2[k][j] * dout[k];
      }
    }
    for (int j = 0; j < HID; j++) {
      double dh = h[j] > 0 ? da[j] : 0;
      g->b1[j] += dh;
      for (int i = 0; i < IN; i++) g->w1[j][i] += dh * x[r][i];
    }
  }
}

/* The reference run: STEPS steps of SGD with momentum from p over the
 * epoch's order, each batch in m micro-batches (m = 1: the full batch). */
static void reference(toy *p, const ddp_dataset *ds, uint64_t seed, int m, bool sum) {
  int64_t order[SAMPLES];
  ddp_sampler *sampler;
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(1, 0);
  so.seed = seed;
  assert_int_equal(ddp_sampler_create_distributed(&sampler, SAMPLES, &so), DDP_OK);
  ddp_sampler_set_epoch(sampler, 0);
  assert_int_equal(ddp_sampler_fill(sampler, order), DDP_OK);
  ddp_sampler_destroy(sampler);
  toy buf = {0};
  const int n = (int)(sizeof(toy) / sizeof(double));
  for (int step = 0; step < STEPS; step++) {
    double x[BATCH][IN], y[BATCH][OUT];
    for (int r = 0; r < BATCH; r++) {
      float xf[IN], yf[OUT];
      assert_int_equal(ddp_dataset_get(ds, order[step * BATCH + r], xf, yf), DDP_OK);
      for (int i = 0; i < IN; i++) x[r][i] = xf[i];
      for (int k = 0; k < OUT; k++) y[r][k] = yf[k];
    }
    toy g = {0};
    for (int i = 0, first = 0; i < m; i++) {
      int rows = BATCH / m + (i < BATCH % m);
      toy_grad(p, (const double(*)[IN])x, (const double(*)[OUT])y, first, rows, &g);
      first += rows;
    }
    double *pv = (double *)p, *gv = (double *)&g, *bv = (double *)&buf;
    for (int k = 0; k < n; k++) {
      double grad = sum ? gv[k] : gv[k] / m;
      bv[k] = step == 0 ? grad : MOMENTUM * bv[k] + grad;
      pv[k] -= LR * bv[k];
    }
  }
}

/* Trains STEPS steps with `microbatches`; returns the final parameters. */
static void train(int microbatches, bool sum, toy *start, toy *end) {
  ddp_model *model;
  ddp_dataset *train_ds, *test_ds;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&train_ds, SAMPLES, SEED), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&test_ds, 32, SEED + 1), DDP_OK);
  toy_from_model(model, start);
  ddp_train_options o = ddp_train_defaults();
  o.max_steps = STEPS;
  o.batch_size = BATCH;
  o.optim.lr = LR;
  o.optim.sgd.momentum = MOMENTUM;
  o.seed = SEED;
  o.workers = 0;
  o.microbatches = microbatches;
  o.microbatch_sum = sum;
  ddp_trainer *t;
  assert_int_equal(ddp_trainer_create(&t, model, train_ds, test_ds, NULL, &o), DDP_OK);
  ddp_train_result r;
  ddp_status s = ddp_trainer_run(t, &r);
  if (s != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(r.steps, STEPS);
  ddp_train_result_free(&r);
  toy_from_model(model, end);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test_ds);
  ddp_dataset_destroy(train_ds);
  ddp_model_destroy(model);
}

/* max|a - b| over each tensor against 1e-5 * max|b| + 1e-7; returns the
 * worst ratio of error to bound. */
static double worst_ratio(const toy *a, const toy *b) {
  const double *av = (const double *)a, *bv = (const double *)b;
  const int64_t sizes[4] = {HID * IN, HID, OUT * HID, OUT};
  double worst = 0;
  for (int k = 0, at = 0; k < 4; at += (int)sizes[k], k++) {
    double err = 0, scale = 0;
    for (int64_t i = at; i < at + sizes[k]; i++) {
      err = fmax(err, fabs(av[i] - bv[i]));
      scale = fmax(scale, fabs(bv[i]));
    }
    worst = fmax(worst, err / (1e-5 * scale + 1e-7));
  }
  return worst;
}

static void check(int microbatches, bool sum) {
  toy start, end, ref, full;
  train(microbatches, sum, &start, &end);
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_create_regression(&ds, SAMPLES, SEED), DDP_OK);
  ref = start;
  reference(&ref, ds, SEED, microbatches, sum);
  full = start;
  reference(&full, ds, SEED, 1, false);
  ddp_dataset_destroy(ds);
  double r = worst_ratio(&end, &ref);
  print_message("M = %d%s: worst error %.3g of the bound; the full batch's reference at %.3g\n",
                microbatches, sum ? " (summed)" : "", r, worst_ratio(&full, &ref));
  assert_true(r <= 1);
  /* Uneven or summed micro-batches are not the full batch's step, and the
   * bound tells them apart; even ones with a mean are the same step. */
  if (BATCH % microbatches || sum) assert_true(worst_ratio(&full, &ref) > 10);
  else assert_true(worst_ratio(&end, &full) <= 1);
}

static void test_even(void **state) {
  (void)state;
  check(4, false);
}

static void test_uneven(void **state) {
  (void)state;
  check(3, false);
  check(5, false);
}

static void test_summed(void **state) {
  (void)state;
  check(3, true);
}

/* More micro-batches than rows: one row each (no empty micro-batch). */
static void test_more_microbatches_than_rows(void **state) {
  (void)state;
  toy start, end, ref;
  train(BATCH + 7, false, &start, &end);
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_create_regression(&ds, SAMPLES, SEED), DDP_OK);
  ref = start;
  reference(&ref, ds, SEED, BATCH, false);
  ddp_dataset_destroy(ds);
  assert_true(worst_ratio(&end, &ref) <= 1);
}

/* The steady-state step with micro-batches allocates nothing: between the
 * 4th and the 12th step's callbacks, no call reaches the allocator (every
 * ddp allocation, of every thread, is counted by ddp_alloc_count). */
typedef struct alloc_probe {
  uint64_t at4, at12;
} alloc_probe;

static bool count_allocations(const ddp_train_step_info *info, void *user) {
  alloc_probe *p = user;
  if (info->step == 4) p->at4 = ddp_alloc_count();
  if (info->step == 12) p->at12 = ddp_alloc_count();
  return false;
}

static void test_steady_steps_allocate_nothing(void **state) {
  (void)state;
  ddp_model *model;
  ddp_dataset *train_ds, *test_ds;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&train_ds, 512, SEED), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&test_ds, 32, SEED + 1), DDP_OK);
  ddp_train_options o = ddp_train_defaults();
  o.max_steps = 12;
  o.batch_size = BATCH;
  o.workers = 1;
  o.microbatches = 3;
  alloc_probe probe = {0};
  o.callbacks = (ddp_train_callbacks){NULL, count_allocations, NULL, &probe};
  ddp_trainer *t;
  assert_int_equal(ddp_trainer_create(&t, model, train_ds, test_ds, NULL, &o), DDP_OK);
  ddp_train_result r;
  assert_int_equal(ddp_trainer_run(t, &r), DDP_OK);
  ddp_train_result_free(&r);
  assert_true(probe.at4 > 0);
  if (probe.at12 != probe.at4)
    print_error("%llu allocations in 8 steady steps with 3 micro-batches\n",
                (unsigned long long)(probe.at12 - probe.at4));
  assert_int_equal(probe.at12, probe.at4);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test_ds);
  ddp_dataset_destroy(train_ds);
  ddp_model_destroy(model);
}

static void test_bad_microbatches(void **state) {
  (void)state;
  ddp_model *model;
  ddp_dataset *ds;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&ds, SAMPLES, SEED), DDP_OK);
  ddp_train_options o = ddp_train_defaults();
  o.microbatches = -2;
  ddp_trainer *t;
  assert_int_equal(ddp_trainer_create(&t, model, ds, ds, NULL, &o), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "microbatches"));
  ddp_dataset_destroy(ds);
  ddp_model_destroy(model);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_even),
      cmocka_unit_test(test_uneven),
      cmocka_unit_test(test_summed),
      cmocka_unit_test(test_more_microbatches_than_rows),
      cmocka_unit_test(test_steady_steps_allocate_nothing),
      cmocka_unit_test(test_bad_microbatches),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
