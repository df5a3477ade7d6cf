/* A pipeline over ranks (threads of this process) against the unsplit model
 * on one rank with the same micro-batch accumulation: after 10 SGD steps
 * every stage's parameters and buffers match the unsplit model's of the
 * same names (max|a - b| <= 1e-5 max|b| + 1e-7), for each schedule, 2 stages
 * (the ConvNet split at layer2, an MLP) and 4 (the MLP), uneven micro-batches
 * included. The same runs check memory: the activations each stage holds at
 * once, measured from its tapes' arenas, are the schedule's (M micro-batches
 * under GPipe, p - s under 1F1B, the simulated high-water mark interleaved),
 * and the idle time is measured. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include "parallel/dp_test_util.h"
#include "pp_test_util.h"

#define STEPS 10

typedef struct {
  const char *model;
  ddp_pipeline_schedule_kind kind;
  int p, v, m;
  const char *split;
  int64_t batch;
  ddp_model *reference;
  bool even; /* micro-batches of equal rows: memory is checked exactly */
} pp_cfg;

static void body(dpt_rank *self) {
  pp_cfg *c = self->world->user;
  ddp_model *full;
  DPT_OK(self, ppt_build(c->model, &full));
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.schedule = c->kind;
  o.n_microbatches = c->m;
  o.virtual_stages = c->v;
  o.split = c->split;
  o.max_batch = c->batch;
  ddp_pipeline *pp;
  DPT_OK(self, ddp_pipeline_create(&pp, full, self->pg, &o));
  ddp_model_destroy(full);
  ddp_model *stage = ddp_pipeline_model(pp);
  ddp_optimizer *opt;
  DPT_OK(self, ppt_sgd(stage, &opt));
  float *xbuf = malloc(sizeof(float) * (size_t)c->batch * 784);
  int64_t *ybuf = malloc((size_t)c->batch * 48);
  for (int step = 0; step < STEPS; step++) {
    ddp_tensor x, y;
    ppt_batch(c->model, step, c->batch, xbuf, ybuf, &x, &y);
    ddp_model_zero_grad(stage);
    double loss;
    DPT_OK(self, ddp_pipeline_step(pp, ddp_pipeline_is_first(pp) ? &x : NULL,
                                   ddp_pipeline_is_last(pp) ? &y : NULL, &loss));
    DPT_CHECK(self, ddp_pipeline_is_last(pp) ? isfinite(loss) : isnan(loss),
              "loss %g on rank %d", loss, self->rank);
    DPT_OK(self, ddp_optimizer_step(opt));
  }
  char why[256];
  DPT_CHECK(self, ppt_same(stage, c->reference, why, sizeof why), "%s %s p=%d v=%d M=%d: %s",
            c->model, ddp_pipeline_schedule_name(c->kind), c->p, c->v, c->m, why);

  /* Memory: micro-batches held at once, from the arenas. */
  ddp_pipeline_stats st;
  ddp_pipeline_get_stats(pp, &st);
  ddp_pipeline_schedule_report rep;
  DPT_OK(self, ddp_pipeline_schedule_check(ddp_pipeline_get_schedule(pp), &rep));
  int r = self->rank, expect = c->kind == DDP_PIPELINE_GPIPE  ? c->v * c->m
                               : c->kind == DDP_PIPELINE_1F1B ? c->p - r
                                                              : rep.rank_live_high_water[r];
  DPT_CHECK(self, st.live_high_water == expect, "rank %d held %d micro-batches, expected %d", r,
            st.live_high_water, expect);
  if (c->even && c->v == 1) {
    DPT_CHECK(self, st.microbatch_activation_bytes > 0, "no activation bytes measured");
    DPT_CHECK(self, st.activation_bytes_high_water == expect * st.microbatch_activation_bytes,
              "rank %d: %lld bytes held at most, %d x %lld expected", r,
              (long long)st.activation_bytes_high_water, expect,
              (long long)st.microbatch_activation_bytes);
  }
  DPT_CHECK(self, st.steps == STEPS && st.step_s > 0 && st.idle_fraction >= 0 &&
                      st.idle_fraction < 1,
            "stats: %lld steps, step %g s, idle %g", (long long)st.steps, st.step_s,
            st.idle_fraction);
  free(xbuf);
  free(ybuf);
  ddp_optimizer_destroy(opt);
  ddp_pipeline_destroy(pp);
}

static void run(const char *model, ddp_pipeline_schedule_kind kind, int p, int v, int m,
                const char *split, int64_t batch) {
  pp_cfg c = {model, kind, p, v, m, split, batch, NULL, batch % m == 0};
  assert_int_equal(ppt_reference(model, STEPS, batch, m, &c.reference), DDP_OK);
  int failed = dpt_run(p, 60, body, &c);
  ddp_model_destroy(c.reference);
  assert_int_equal(failed, 0);
}

/* The ConvNet, 2 stages at layer2; 10 rows in 4 micro-batches: 3, 3, 2, 2. */
static void test_convnet_gpipe(void **s) { (void)s; run("convnet", DDP_PIPELINE_GPIPE, 2, 1, 4, "layer2", 10); }
static void test_convnet_1f1b(void **s) { (void)s; run("convnet", DDP_PIPELINE_1F1B, 2, 1, 4, "layer2", 10); }
static void test_convnet_1f1b_even(void **s) { (void)s; run("convnet", DDP_PIPELINE_1F1B, 2, 1, 4, "layer2", 8); }
/* Interleaved: 2 ranks x 2 stages, each top-level module a stage. */
static void test_convnet_interleaved(void **s) {
  (void)s;
  run("convnet", DDP_PIPELINE_INTERLEAVED, 2, 2, 4, "layer2,flatten,fc", 10);
}
/* The MLP: 2 stages (auto split), 4 stages (named), interleaved 2 x 2 and
 * 4 x 2; 13 rows in 4 micro-batches (4, 3, 3, 3), 16 in 8 (2 each). */
static void test_mlp2_gpipe(void **s) { (void)s; run("mlp", DDP_PIPELINE_GPIPE, 2, 1, 4, "auto", 13); }
static void test_mlp2_1f1b(void **s) { (void)s; run("mlp", DDP_PIPELINE_1F1B, 2, 1, 4, NULL, 13); }
static void test_mlp2_interleaved(void **s) { (void)s; run("mlp", DDP_PIPELINE_INTERLEAVED, 2, 2, 4, "4,8,12", 13); }
/* More micro-batches than the warmup covers: 8 and 16 on 2 ranks x 2. */
static void test_mlp2_interleaved_m8(void **s) { (void)s; run("mlp", DDP_PIPELINE_INTERLEAVED, 2, 2, 8, "4,8,12", 19); }
static void test_mlp2_interleaved_m16(void **s) { (void)s; run("mlp", DDP_PIPELINE_INTERLEAVED, 2, 2, 16, "4,8,12", 32); }
static void test_mlp4_gpipe(void **s) { (void)s; run("mlp", DDP_PIPELINE_GPIPE, 4, 1, 8, "4,8,12", 16); }
static void test_mlp4_1f1b(void **s) { (void)s; run("mlp", DDP_PIPELINE_1F1B, 4, 1, 8, "4,8,12", 16); }
static void test_mlp4_1f1b_uneven(void **s) { (void)s; run("mlp", DDP_PIPELINE_1F1B, 4, 1, 6, "2,8,14", 15); }
static void test_mlp4_interleaved(void **s) {
  (void)s;
  run("mlp", DDP_PIPELINE_INTERLEAVED, 4, 2, 8, "2,4,6,8,10,12,14", 19);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_convnet_gpipe),      cmocka_unit_test(test_convnet_1f1b),
      cmocka_unit_test(test_convnet_1f1b_even),  cmocka_unit_test(test_convnet_interleaved),
      cmocka_unit_test(test_mlp2_gpipe),         cmocka_unit_test(test_mlp2_1f1b),
      cmocka_unit_test(test_mlp2_interleaved),   cmocka_unit_test(test_mlp2_interleaved_m8),
      cmocka_unit_test(test_mlp2_interleaved_m16), cmocka_unit_test(test_mlp4_gpipe),
      cmocka_unit_test(test_mlp4_1f1b),          cmocka_unit_test(test_mlp4_1f1b_uneven),
      cmocka_unit_test(test_mlp4_interleaved),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
