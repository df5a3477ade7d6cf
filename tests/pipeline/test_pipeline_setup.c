/* Setting a pipeline up and the rest of its contract, ranks as threads:
 * splits and shapes that do not fit fail on every rank before the first
 * step, naming the module and the shapes; the automatic split is measured
 * on rank 0 and agreed everywhere; evaluation (forward only) gives the
 * unsplit model's outputs and loss; a refused input leaves the pipeline
 * usable; the steady-state step allocates nothing; and pipeline x data
 * parallel (2 stages x 2 replicas, the gradients averaged over each stage's
 * data-parallel group by the grad-sync hook) equals one rank with the
 * doubled batch and the same accumulation; a stages' device the process
 * does not have is refused on every rank. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include "parallel/dp_test_util.h"
#include "pp_test_util.h"

typedef struct {
  const char *model, *split, *expect1, *expect2;
  int p;
  int sample_ndim;
  int64_t sample[3];
} bad_cfg;

/* Every rank's create fails with a message holding both expected pieces. */
static void bad_body(dpt_rank *self) {
  bad_cfg *c = self->world->user;
  ddp_model *full;
  DPT_OK(self, ppt_build(c->model, &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.schedule = DDP_PIPELINE_GPIPE;
  o.split = c->split;
  o.sample_ndim = c->sample_ndim;
  for (int d = 0; d < c->sample_ndim; d++) o.sample_shape[d] = c->sample[d];
  ddp_pipeline *pp = NULL;
  ddp_status s = ddp_pipeline_create(&pp, full, self->pg, &o);
  ddp_model_destroy(full);
  DPT_CHECK(self, s != DDP_OK && pp == NULL, "create succeeded");
  DPT_CHECK(self, strstr(ddp_last_error(), c->expect1) && strstr(ddp_last_error(), c->expect2),
            "message '%s' lacks '%s' or '%s'", ddp_last_error(), c->expect1, c->expect2);
}

static void expect_bad(bad_cfg c) { assert_int_equal(dpt_run(c.p, 30, bad_body, &c), 0); }

static void test_bad_splits(void **state) {
  (void)state;
  expect_bad((bad_cfg){"convnet", "layer9", "'layer9' is not a top-level module",
                       "layer1, layer2, flatten, fc", 2, 0, {0}});
  expect_bad((bad_cfg){"convnet", "fc,layer2", "names must follow the forward order", "fc", 3, 0,
                       {0}});
  expect_bad((bad_cfg){"convnet", "layer2", "gives 2 stages, the pipeline has 3", "", 3, 0, {0}});
  expect_bad((bad_cfg){"toy", NULL, "3 top-level modules, fewer than the 4 stages", "", 4, 0, {0}});
  /* 32 x 32 images: the ConvNet's fc (1568 inputs) gets 32 x 8 x 8 = 2048. */
  expect_bad((bad_cfg){"convnet", "fc", "stage 1 (rank 1; modules fc..fc) does not take",
                       "(N,2048)", 2, 3, {1, 32, 32}});
  /* 3 channels: the first convolution refuses, on stage 0. */
  expect_bad((bad_cfg){"convnet", "layer2", "stage 0 (rank 0; modules layer1..layer1)",
                       "(N,3,28,28)", 2, 3, {3, 28, 28}});
}

/* A model whose first module costs far more than the rest: the measured
 * split puts it alone (with at most the ReLU after it) on stage 0. */
static ddp_status lopsided(ddp_model **out) {
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  DDP_TRY(ddp_module_add_linear(m, NULL, NULL, 512, 512, true, NULL));
  DDP_TRY(ddp_module_add_relu(m, NULL, NULL, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, NULL, 512, 8, true, NULL));
  for (int i = 0; i < 6; i++) {
    DDP_TRY(ddp_module_add_relu(m, NULL, NULL, NULL));
    DDP_TRY(ddp_module_add_linear(m, NULL, NULL, 8, 8, true, NULL));
  }
  DDP_TRY(ddp_model_finalize(m, 3));
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  int64_t sample[1] = {512};
  ddp_model_set_sample_shape(m, 1, sample);
  *out = m;
  return DDP_OK;
}

static char auto_splits[2][64];

static void auto_body(dpt_rank *self) {
  ddp_model *full;
  DPT_OK(self, lopsided(&full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.split = "auto";
  o.profile_rows = 64;
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_model_destroy(full);
  snprintf(auto_splits[self->rank], sizeof auto_splits[0], "%s", ddp_pipeline_split(pp));
  int first, last;
  DPT_CHECK(self, ddp_pipeline_stage_modules(pp, 0, &first, &last) >= 1 && first == 0, "stage 0");
  DPT_CHECK(self, last <= 1, "stage 0 ends at module %d (%s): the costly Linear(512, 512) is not "
            "alone", last, ddp_pipeline_split(pp));
  /* This rank's model holds exactly its stage's parameters. */
  int expect = self->rank == 0 ? 2 : 14;
  DPT_CHECK(self, ddp_model_num_params(ddp_pipeline_model(pp)) == expect, "%d parameters",
            ddp_model_num_params(ddp_pipeline_model(pp)));
  ddp_pipeline_destroy(pp);
}

static void test_auto_split(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, auto_body, NULL), 0);
  assert_string_equal(auto_splits[0], auto_splits[1]);
}

/* Evaluation equals the unsplit model in eval mode; a refused input is
 * returned by every rank and the next step runs. */
static ddp_model *eval_reference;

static void eval_body(dpt_rank *self) {
  ddp_model *full;
  DPT_OK(self, ppt_build("convnet", &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.n_microbatches = 3;
  o.split = "layer2";
  o.max_batch = 16;
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_model_destroy(full);
  float xb[11 * 784];
  int64_t yb[11];
  ddp_tensor x, y;
  ppt_batch("convnet", 99, 11, xb, yb, &x, &y);
  float got[11 * 10];
  int64_t os[2] = {11, 10};
  ddp_tensor out;
  ddp_tensor_wrap(&out, DDP_FLOAT32, 2, os, got);
  double loss;
  bool first = ddp_pipeline_is_first(pp), last = ddp_pipeline_is_last(pp);
  DPT_OK(self, ddp_pipeline_eval(pp, first ? &x : NULL, last ? &y : NULL, last ? &out : NULL,
                                 &loss));
  if (last) {
    ddp_tape *tape;
    DPT_OK(self, ddp_tape_create(&tape, 1 << 20));
    ddp_tape_set_grad_enabled(tape, false);
    ddp_model_train(eval_reference, false);
    ddp_tensor *want, *want_loss;
    DPT_OK(self, ddp_model_forward(eval_reference, tape, &x, &want));
    DPT_OK(self, ddp_model_loss(eval_reference, tape, want, &y, &want_loss));
    for (int i = 0; i < 110; i++)
      DPT_CHECK(self, fabsf(got[i] - ddp_tensor_f32(want)[i]) <= 1e-5f, "output %d: %g vs %g", i,
                got[i], ddp_tensor_f32(want)[i]);
    DPT_CHECK(self, fabs(loss - ddp_tensor_f32(want_loss)[0]) <= 1e-5, "loss %g vs %g", loss,
              ddp_tensor_f32(want_loss)[0]);
    ddp_tape_destroy(tape);
  } else {
    DPT_CHECK(self, isnan(loss), "loss %g on a stage without the loss", loss);
  }
  /* A batch of the wrong sample shape: refused everywhere, nothing breaks. */
  int64_t bad_shape[2] = {11, 784};
  ddp_tensor bad;
  ddp_tensor_wrap(&bad, DDP_FLOAT32, 2, bad_shape, xb);
  ddp_status s = ddp_pipeline_step(pp, first ? &bad : NULL, last ? &y : NULL, NULL);
  DPT_CHECK(self, s == DDP_ERR_SHAPE, "bad input: %s", ddp_status_name(s));
  DPT_CHECK(self, strstr(ddp_last_error(), first ? "sample shape" : "refused its input"), "%s",
            ddp_last_error());
  /* Then steps run; from the third on, nothing is allocated. */
  for (int step = 0; step < 6; step++) {
    DPT_OK(self, ddp_pipeline_step(pp, first ? &x : NULL, last ? &y : NULL, &loss));
    DPT_CHECK(self, !last || isfinite(loss), "loss %g", loss);
  }
  ddp_pipeline_destroy(pp);
}

static void test_eval_and_refusal(void **state) {
  (void)state;
  assert_int_equal(ppt_build("convnet", &eval_reference), DDP_OK);
  assert_int_equal(dpt_run(2, 30, eval_body, NULL), 0);
  ddp_model_destroy(eval_reference);
}

/* The steady-state step allocates nothing: the process-wide allocation
 * count does not move over 4 steps of 2 stages (after warm-up steps), the
 * ranks meeting at barriers around them. */
static atomic_uint_fast64_t alloc_before, alloc_after;

static void alloc_body(dpt_rank *self) {
  ddp_model *full;
  DPT_OK(self, ppt_build("mlp", &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.n_microbatches = 4;
  o.split = "8";
  o.max_batch = 16;
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_model_destroy(full);
  float xb[16 * 784];
  float yb[16 * PPT_MLP_OUT];
  ddp_tensor x, y;
  ppt_batch("mlp", 1, 16, xb, yb, &x, &y);
  bool first = ddp_pipeline_is_first(pp), last = ddp_pipeline_is_last(pp);
  for (int step = 0; step < 8; step++) {
    if (step == 4) {
      DPT_OK(self, ddp_barrier(self->pg));
      if (self->rank == 0) alloc_before = ddp_alloc_count();
      DPT_OK(self, ddp_barrier(self->pg));
    }
    DPT_OK(self, ddp_pipeline_step(pp, first ? &x : NULL, last ? &y : NULL, NULL));
  }
  DPT_OK(self, ddp_barrier(self->pg));
  if (self->rank == 0) alloc_after = ddp_alloc_count();
  DPT_OK(self, ddp_barrier(self->pg));
  ddp_pipeline_destroy(pp);
}

static void test_steady_state_allocates_nothing(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, alloc_body, NULL), 0);
  assert_int_equal(alloc_after - alloc_before, 0);
}

/* Pipeline x data parallel: a world of 4 = 2 stages x 2 replicas; ranks
 * [2k, 2k + 2) are replica k's pipeline, ranks {s, s + 2} stage s's
 * data-parallel group. Replica k trains on its own batch; the grad-sync
 * hook averages each stage's gradients over its group after the last
 * backward. The reference: the unsplit model on one rank accumulating both
 * replicas' micro-batches with d(loss / (2 M)). */
#define DP_STEPS 6
#define DP_ROWS 9
#define DP_M 3
static ddp_model *dp_reference;

static void dp_body(dpt_rank *self) {
  int replica = self->rank / 2, stage_rank = self->rank % 2;
  ddp_process_group *pipe_group, *dp_group;
  DPT_OK(self, ddp_process_group_split(self->pg, replica, stage_rank, &pipe_group));
  DPT_OK(self, ddp_process_group_split(self->pg, stage_rank, replica, &dp_group));
  ddp_model *full;
  DPT_OK(self, ppt_build("mlp", &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.n_microbatches = DP_M;
  o.split = "8";
  o.max_batch = DP_ROWS;
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, pipe_group, &o));
  ddp_model_destroy(full);
  ddp_pipeline_set_grad_sync(pp, ddp_pipeline_allreduce_grads, dp_group);
  ddp_model *stage = ddp_pipeline_model(pp);
  ddp_optimizer *opt;
  DPT_OK(self, ppt_sgd(stage, &opt));
  float xb[DP_ROWS * 784];
  float yb[DP_ROWS * PPT_MLP_OUT];
  for (int step = 0; step < DP_STEPS; step++) {
    ddp_tensor x, y;
    ppt_batch("mlp", step * 16 + replica, DP_ROWS, xb, yb, &x, &y);
    ddp_model_zero_grad(stage);
    DPT_OK(self, ddp_pipeline_step(pp, ddp_pipeline_is_first(pp) ? &x : NULL,
                                   ddp_pipeline_is_last(pp) ? &y : NULL, NULL));
    DPT_OK(self, ddp_optimizer_step(opt));
  }
  char why[256];
  DPT_CHECK(self, ppt_same(stage, dp_reference, why, sizeof why), "replica %d, stage %d: %s",
            replica, stage_rank, why);
  ddp_optimizer_destroy(opt);
  ddp_pipeline_destroy(pp);
  ddp_process_group_destroy(dp_group);
  ddp_process_group_destroy(pipe_group);
}

static void test_pipeline_by_data_parallel(void **state) {
  (void)state;
  ddp_model *model = NULL;
  assert_int_equal(ppt_build("mlp", &model), DDP_OK);
  ddp_optimizer *opt;
  assert_int_equal(ppt_sgd(model, &opt), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  float xb[DP_ROWS * 784];
  float yb[DP_ROWS * PPT_MLP_OUT];
  float scale = 1.0f / (2 * DP_M);
  for (int step = 0; step < DP_STEPS; step++) {
    ddp_model_zero_grad(model);
    for (int replica = 0; replica < 2; replica++) {
      ddp_tensor x, y;
      ppt_batch("mlp", step * 16 + replica, DP_ROWS, xb, yb, &x, &y);
      assert_int_equal(ppt_microbatches(model, tape, &x, &y, DP_ROWS, DP_M, scale, NULL), DDP_OK);
    }
    assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
  }
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  dp_reference = model;
  assert_int_equal(dpt_run(4, 60, dp_body, NULL), 0);
  ddp_model_destroy(dp_reference);
}

/* The stages' device (options.device): the CPU by default; a device this
 * process does not have is refused on every rank before any collective,
 * naming the option and the device (cuda:99: no machine here has it, with
 * or without a GPU or a CUDA build). The runs on a GPU are test_cuda_pipeline's
 * and scripts/gpu-pp-steps.sh's. */
static void device_body(dpt_rank *self) {
  ddp_model *full;
  DPT_OK(self, ppt_build("mlp", &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  DPT_CHECK(self, ddp_device_equal(o.device, DDP_CPU), "the default device is not the CPU");
  o.split = "8";
  o.device = DDP_CUDA(99);
  ddp_pipeline *pp = NULL;
  ddp_status s = ddp_pipeline_create(&pp, full, self->pg, &o);
  DPT_CHECK(self, s != DDP_OK && pp == NULL, "a pipeline on cuda:99 was made");
  DPT_CHECK(self, strstr(ddp_last_error(), "options.device"), "message '%s' lacks options.device",
            ddp_last_error());
  /* The same group still makes a CPU pipeline: nothing was left half-agreed. */
  o.device = DDP_CPU;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_pipeline_destroy(pp);
  ddp_model_destroy(full);
}

static void test_device_option(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, device_body, NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_device_option),
      cmocka_unit_test(test_bad_splits),
      cmocka_unit_test(test_auto_split),
      cmocka_unit_test(test_eval_and_refusal),
      cmocka_unit_test(test_steady_state_allocates_nothing),
      cmocka_unit_test(test_pipeline_by_data_parallel),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
