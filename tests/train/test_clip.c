/* Gradient-norm clipping in the trainer (options.clip_grad_norm,
 * ddp-train --clip-grad-norm) under every strategy where the gradients are
 * final on the rank: single, data parallel, ZeRO-1 and ZeRO-2 (ranks as
 * threads). The toy model, plain SGD (no momentum, no weight decay), a
 * max_norm far below the gradients' norm, so every step clips. After each
 * step (the step callback, before the next zero_grad) each rank reads its
 * part [n*r/W, n*(r+1)/W) of the gradient buffer, which holds the clipped,
 * averaged gradients the optimizer used:
 *  - the global norm, from the parts' float64 sums of squares, is max_norm
 *    within float32's rounding and the 1e-6 of clip_grad_norm_'s
 *    denominator (it must not come out as the unclipped norm, nor as a
 *    rank-local one under ZeRO-2);
 *  - the parameters moved by exactly -lr * gradient (SGD's update), from
 *    the third step on (the wrapper re-lays out its buffers in the first):
 *    the clip happened before the optimizer, on what it stepped;
 *  - ZeRO-1 and ZeRO-2 end bit for bit where data parallelism ends at 2
 *    ranks (the norm's double sum is split at another place, then rounded
 *    to float32 as PyTorch's is: the same coefficient), with and without
 *    micro-batches; ZeRO-3 likewise.
 * Also: a negative, NaN or infinite clip_grad_norm refused by name, and the
 * pipeline and parameter-server strategies refusing clipping with a reason. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cblas.h>

#include "parallel/dp_test_util.h"

#define MAX_NORM 0.01
#define LR 0.05
#define STEPS 12

typedef struct clip_case {
  int world;          /* 1: the single strategy (no group) */
  int zero;           /* 0, 1, 2 */
  int microbatches;   /* 0: whole batch */
  int64_t n;          /* the model's floats */
  float *params[DPT_MAX_RANKS];
  double sumsq[DPT_MAX_RANKS][STEPS];
  int64_t steps[DPT_MAX_RANKS];
} clip_case;

/* What one rank's step callback sees. */
typedef struct rank_view {
  clip_case *c;
  int rank;
  ddp_model *model;
  float *prev; /* the parameters after the previous step */
  int64_t lo, hi;
  char failure[256];
} rank_view;

static bool on_step(const ddp_train_step_info *info, void *user) {
  rank_view *v = user;
  const float *g = ddp_model_grads_flat(v->model), *p = ddp_model_params_flat(v->model);
  double sum = 0;
  for (int64_t i = v->lo; i < v->hi; i++) sum += (double)g[i] * (double)g[i];
  if (info->step >= 1 && info->step <= STEPS) v->c->sumsq[v->rank][info->step - 1] = sum;
  v->c->steps[v->rank] = info->step;
  if (info->step >= 3 && !v->failure[0]) {
    for (int64_t i = v->lo; i < v->hi; i++) {
      const double moved = (double)p[i] - (double)v->prev[i], want = -LR * (double)g[i];
      /* p - fl(lr * g), rounded: two float32 roundings and lr as a float. */
      if (!(fabs(moved - want) <= 0x1p-22 * (fabs(want) + fabs((double)p[i])))) {
        snprintf(v->failure, sizeof v->failure,
                 "step %lld: parameter %lld moved by %.9g, -lr * gradient is %.9g",
                 (long long)info->step, (long long)i, moved, want);
        break;
      }
    }
  }
  memcpy(v->prev + v->lo, p + v->lo, (size_t)(v->hi - v->lo) * sizeof(float));
  return false;
}

static ddp_status train(clip_case *c, ddp_process_group *pg, int rank, rank_view *v) {
  ddp_model *model = NULL;
  ddp_dataset *train_set = NULL, *test_set = NULL;
  ddp_trainer *t = NULL;
  ddp_train_result res = {0};
  ddp_status s = ddp_model_build("toy", NULL, 3, &model);
  if (s == DDP_OK) s = ddp_dataset_create_regression(&train_set, 512, 3);
  if (s == DDP_OK) s = ddp_dataset_create_regression(&test_set, 64, 1000003);
  if (s == DDP_OK) {
    v->model = model;
    v->prev = malloc((size_t)c->n * sizeof(float));
    memcpy(v->prev, ddp_model_params_flat(model), (size_t)c->n * sizeof(float));
    ddp_train_options o = ddp_train_defaults();
    o.max_steps = STEPS;
    o.batch_size = 16;
    o.optim.lr = LR;
    o.seed = 3;
    o.workers = 0;
    o.zero_stage = (int16_t)c->zero;
    o.microbatches = c->microbatches;
    o.clip_grad_norm = MAX_NORM;
    o.callbacks = (ddp_train_callbacks){NULL, on_step, NULL, v};
    s = ddp_trainer_create(&t, model, train_set, test_set, pg, &o);
  }
  if (s == DDP_OK) s = ddp_trainer_run(t, &res);
  /* In registration order: the flat buffer's order is the wrapper's
   * (re-laid out, but not under ZeRO-3). */
  for (int i = 0, at = 0; s == DDP_OK && i < ddp_model_num_params(model); i++) {
    const int64_t len = ddp_model_param(model, i)->numel;
    memcpy(c->params[rank] + at, ddp_model_params_flat(model) + ddp_model_param_offset(model, i),
           (size_t)len * sizeof(float));
    at += (int)len;
  }
  ddp_train_result_free(&res);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test_set);
  ddp_dataset_destroy(train_set);
  ddp_model_destroy(model);
  free(v->prev);
  return s;
}

static void rank_body(dpt_rank *self) {
  clip_case *c = self->world->user;
  rank_view v = {.c = c, .rank = self->rank};
  v.lo = c->n * self->rank / c->world;
  v.hi = c->n * (self->rank + 1) / c->world;
  DPT_OK(self, train(c, self->pg, self->rank, &v));
  DPT_CHECK(self, !v.failure[0], "%s", v.failure);
}

static void run_case(clip_case *c) {
  ddp_model *m;
  assert_int_equal(ddp_model_build("toy", NULL, 3, &m), DDP_OK);
  c->n = ddp_model_num_param_elements(m);
  ddp_model_destroy(m);
  for (int r = 0; r < c->world; r++) c->params[r] = calloc((size_t)c->n, sizeof(float));
  if (c->world == 1) {
    rank_view v = {.c = c, .rank = 0, .lo = 0, .hi = c->n};
    if (train(c, NULL, 0, &v) != DDP_OK) fail_msg("%s", ddp_last_error());
    if (v.failure[0]) fail_msg("single: %s", v.failure);
  } else {
    assert_int_equal(dpt_run(c->world, 60, rank_body, c), 0);
  }
  for (int r = 0; r < c->world; r++) assert_int_equal(c->steps[r], STEPS);
  for (int s = 0; s < STEPS; s++) {
    double sum = 0;
    for (int r = 0; r < c->world; r++) sum += c->sumsq[r][s];
    const double norm = sqrt(sum);
    /* clipped = raw * fl(max / (raw + 1e-6)): max within 1e-6 / raw (raw
     * is above 0.01 here) and a few float32 roundings. */
    if (!(fabs(norm - MAX_NORM) <= 2e-4 * MAX_NORM))
      fail_msg("world %d zero %d microbatches %d, step %d: the clipped gradients' norm is %.9g, "
               "max_norm %g", c->world, c->zero, c->microbatches, s + 1, norm, MAX_NORM);
  }
  /* Data parallelism's replicas are equal. */
  if (c->zero == 0)
    for (int r = 1; r < c->world; r++)
      assert_memory_equal(c->params[r], c->params[0], (size_t)c->n * sizeof(float));
}

static void free_case(clip_case *c) {
  for (int r = 0; r < c->world; r++) free(c->params[r]);
}

static void test_single_clips(void **state) {
  (void)state;
  clip_case c = {.world = 1};
  run_case(&c);
  free_case(&c);
}

static void test_zero_equals_data_parallel(void **state) {
  (void)state;
  for (int m = 0; m <= 2; m += 2) {
    clip_case dp = {.world = 2, .microbatches = m};
    run_case(&dp);
    for (int zero = 1; zero <= 3; zero++) {
      clip_case z = {.world = 2, .zero = zero, .microbatches = m};
      run_case(&z);
      for (int r = 0; r < 2; r++) {
        if (memcmp(z.params[r], dp.params[0], (size_t)dp.n * sizeof(float)) != 0)
          fail_msg("--zero %d, microbatches %d: rank %d's parameters differ from data "
                   "parallelism's with the same clipping", zero, m, r);
      }
      free_case(&z);
    }
    free_case(&dp);
  }
}

static void test_bad_clip_options(void **state) {
  (void)state;
  ddp_model *model;
  ddp_dataset *train_set, *test_set;
  assert_int_equal(ddp_model_build("toy", NULL, 1, &model), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&train_set, 64, 1), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&test_set, 16, 2), DDP_OK);
  ddp_trainer *t = NULL;
  const double bad[] = {-1.0, NAN, INFINITY};
  for (int i = 0; i < 3; i++) {
    ddp_train_options o = ddp_train_defaults();
    o.clip_grad_norm = bad[i];
    assert_int_equal(ddp_trainer_create(&t, model, train_set, test_set, NULL, &o), DDP_ERR_INVALID);
    assert_null(t);
    assert_non_null(strstr(ddp_last_error(), "clip_grad_norm is"));
  }
  /* No pointer of the pipeline's or the server's is followed first. */
  ddp_train_pipeline pipeline = {.stages = 2};
  ddp_train_options o = ddp_train_defaults();
  o.clip_grad_norm = 1.0;
  o.pipeline = &pipeline;
  assert_int_equal(ddp_trainer_create(&t, model, train_set, test_set, NULL, &o), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "under the pipeline strategy"));
  o = ddp_train_defaults();
  o.clip_grad_norm = 1.0;
  o.param_server = (ddp_ps_client *)&pipeline;
  assert_int_equal(ddp_trainer_create(&t, model, train_set, test_set, NULL, &o), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "under the param_server strategy"));
  ddp_dataset_destroy(test_set);
  ddp_dataset_destroy(train_set);
  ddp_model_destroy(model);
}

int main(void) {
  openblas_set_num_threads(1); /* the ranks' threads share this process's BLAS */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_clip_options),
      cmocka_unit_test(test_single_clips),
      cmocka_unit_test(test_zero_equals_data_parallel),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
