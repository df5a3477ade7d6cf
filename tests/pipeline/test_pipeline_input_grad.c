/* A pipeline fed an input that requires grad gives the input's gradient:
 * after one step, stage 0's input->grad equals the unsplit model's on one
 * rank with the same micro-batch accumulation (d(loss_m / M)/d(x) over
 * torch.tensor_split's rows), max|a - b| <= 1e-5 max|b|, for GPipe
 * and 1F1B with uneven micro-batches; values already in input->grad are
 * added to, not overwritten. Without the flag the input gets no gradient
 * (the other tests). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include "parallel/dp_test_util.h"
#include "pp_test_util.h"

#define BATCH 13
#define MICRO 4
/* Already in input->grad before the step: 2^-20, the gradients' scale
 * (this MLP's input gradients are ~1e-6), exact in float. */
#define PRESET (1.0f / 1048576.0f)

typedef struct {
  ddp_pipeline_schedule_kind kind;
  const float *reference; /* (BATCH, PPT_MLP_DIM): d(sum_m loss_m / M)/dx */
} ig_cfg;

/* The unsplit model's input gradient for step 0's batch. */
static void reference_grad(float *dx) {
  ddp_model *model = NULL;
  assert_int_equal(ppt_build("mlp", &model), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  float xbuf[BATCH * PPT_MLP_DIM], ybuf[BATCH * PPT_MLP_OUT];
  ddp_tensor x, y;
  ppt_batch("mlp", 0, BATCH, xbuf, ybuf, &x, &y);
  memset(dx, 0, sizeof(float) * BATCH * PPT_MLP_DIM);
  assert_int_equal(ppt_microbatches(model, tape, &x, &y, BATCH, MICRO, 1.0f / MICRO, dx), DDP_OK);
  ddp_tape_destroy(tape);
  ddp_model_destroy(model);
}

static void body(dpt_rank *self) {
  ig_cfg *c = self->world->user;
  ddp_model *full;
  DPT_OK(self, ppt_build("mlp", &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.schedule = c->kind;
  o.n_microbatches = MICRO;
  o.max_batch = BATCH;
  o.split = "8"; /* 4 (Linear, ReLU) pairs each side */
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_model_destroy(full);
  float xbuf[BATCH * PPT_MLP_DIM], ybuf[BATCH * PPT_MLP_OUT], dx[BATCH * PPT_MLP_DIM];
  ddp_tensor x, y;
  ppt_batch("mlp", 0, BATCH, xbuf, ybuf, &x, &y);
  for (int i = 0; i < BATCH * PPT_MLP_DIM; i++) dx[i] = PRESET;
  x.grad = dx;
  x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  DPT_OK(self, ddp_pipeline_step(pp, ddp_pipeline_is_first(pp) ? &x : NULL,
                                 ddp_pipeline_is_last(pp) ? &y : NULL, NULL));
  if (ddp_pipeline_is_first(pp)) {
    float worst = 0, top = 0;
    for (int i = 0; i < BATCH * PPT_MLP_DIM; i++) {
      float want = c->reference[i] + PRESET, d = fabsf(dx[i] - want);
      worst = d > worst ? d : worst;
      top = fabsf(want) > top ? fabsf(want) : top;
    }
    DPT_CHECK(self, worst <= 1e-5f * top, "%s: input gradient max|a - b| = %g (max|b| %g)",
              ddp_pipeline_schedule_name(c->kind), (double)worst, (double)top);
  }
  ddp_pipeline_destroy(pp);
}

static void run(ddp_pipeline_schedule_kind kind) {
  float ref[BATCH * PPT_MLP_DIM];
  reference_grad(ref);
  float top = 0; /* a gradient to tell apart from the preset alone */
  for (int i = 0; i < BATCH * PPT_MLP_DIM; i++) top = fabsf(ref[i]) > top ? fabsf(ref[i]) : top;
  assert_true(top > 1e-7f);
  ig_cfg c = {kind, ref};
  assert_int_equal(dpt_run(2, 60, body, &c), 0);
}

static void test_gpipe(void **s) {
  (void)s;
  run(DDP_PIPELINE_GPIPE);
}

static void test_1f1b(void **s) {
  (void)s;
  run(DDP_PIPELINE_1F1B);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_gpipe), cmocka_unit_test(test_1f1b)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
