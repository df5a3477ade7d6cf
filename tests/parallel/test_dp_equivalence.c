/* Data parallelism computes what one process computes: W ranks (threads) with
 * batch B end, after 10 SGD steps with momentum, with the parameters of one
 * process with batch W*B walking the same rows (rank r takes rows r, r+W,
 * ... of the single run's batch), compared per tensor against what training
 * changed in it, ||a - b|| <= 1e-2 ||b - b0|| (dpt_params_close_to_update
 * says why); and every rank ends bit-identical to
 * rank 0. The ranks start from different seeds (and perturbed BN buffers),
 * so the construction-time broadcast is what makes them agree. Shown for
 * toy, for the ConvNet with BatchNorm in eval mode (running statistics), for
 * the ConvNet in training mode with SyncBatchNorm (statistics over all ranks'
 * rows, so the same as the single run's batch statistics), for
 * gradient accumulation through no_sync (2 micro-steps under no_sync + 1
 * synced = one step on the concatenated batch), and with small buckets. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "parallel/dp_test_util.h"

typedef struct eq_case {
  dpt_cfg cfg;
  ddp_model *reference;
  ddp_model *initial; /* the reference before training */
  float *final[DPT_MAX_RANKS]; /* each rank's parameters after training */
  int64_t n;
} eq_case;

static void eq_body(dpt_rank *self) {
  eq_case *c = self->world->user;
  ddp_model *model;
  DPT_OK(self, ddp_model_build(c->cfg.model, NULL, 100 + (uint64_t)self->rank, &model));
  /* Each rank starts elsewhere: the broadcast from rank 0 must fix it. */
  float *buf = ddp_model_buffers_flat(model);
  for (int64_t i = 0; i < ddp_model_num_buffer_elements(model); i++) buf[i] += (float)self->rank;
  if (c->cfg.sync_bn) DPT_OK(self, ddp_model_convert_sync_batchnorm(model, self->pg));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = c->cfg.bucket_cap_mb;
  if (c->cfg.bucket_cap_mb < 1) o.first_bucket_mb = c->cfg.bucket_cap_mb;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, model, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(model);
  DPT_OK(self, s);
  if (c->cfg.hook != DDP_DP_HOOK_ALLREDUCE) ddp_dp_set_comm_hook(dp, c->cfg.hook);
  s = dpt_train(&c->cfg, model, dp, self->rank);
  if (s == DDP_OK) {
    /* Compare by registration order, whatever the flat layout became. */
    int64_t at = 0;
    for (int i = 0; i < ddp_model_num_params(model); i++) {
      ddp_tensor *t = ddp_model_param(model, i);
      memcpy(c->final[self->rank] + at, t->data, (size_t)t->numel * sizeof(float));
      at += t->numel;
    }
    char msg[512];
    if (!dpt_params_close_to_update(model, c->reference, c->initial, 1e-2, msg, sizeof msg)) {
      dpt_fail(self->world, self->rank, __FILE__, __LINE__, "vs the single run: %s", msg);
    }
  }
  ddp_dp_destroy(dp);
  ddp_model_destroy(model);
  DPT_OK(self, s);
}

static void run_case(dpt_cfg cfg) {
  eq_case c = {.cfg = cfg};
  assert_int_equal(ddp_model_build(cfg.model, NULL, 100, &c.reference), DDP_OK);
  assert_int_equal(ddp_model_build(cfg.model, NULL, 100, &c.initial), DDP_OK);
  ddp_status s = dpt_train(&cfg, c.reference, NULL, 0);
  if (s != DDP_OK) fail_msg("single run: %s", ddp_last_error());
  c.n = ddp_model_num_param_elements(c.reference);
  for (int r = 0; r < cfg.world; r++) c.final[r] = calloc((size_t)c.n, sizeof(float));
  int rc = dpt_run(cfg.world, 60, eq_body, &c);
  if (rc == 0)
    for (int r = 1; r < cfg.world; r++)
      if (memcmp(c.final[r], c.final[0], (size_t)c.n * sizeof(float)) != 0) {
        fprintf(stderr, "rank %d's parameters differ from rank 0's\n", r);
        rc = 1;
      }
  for (int r = 0; r < cfg.world; r++) free(c.final[r]);
  ddp_model_destroy(c.reference);
  ddp_model_destroy(c.initial);
  assert_int_equal(rc, 0);
}

static void test_toy_world2(void **state) {
  (void)state;
  run_case(dpt_defaults("toy", 2));
}

static void test_toy_world3(void **state) {
  (void)state;
  run_case(dpt_defaults("toy", 3));
}

static void test_convnet_eval_world2(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 2);
  c.eval = true;
  run_case(c);
}

static void test_convnet_eval_world3_small_buckets(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 3);
  c.eval = true;
  c.batch = 2;
  c.bucket_cap_mb = 0.02; /* ~20 KB: fc.weight alone, then the conv layers */
  run_case(c);
}

/* In training mode plain BatchNorm normalises each rank's rows alone (as in
 * PyTorch, legitimately different); SyncBatchNorm normalises over all W*B
 * rows, which are exactly the single run's batch. */
static void test_convnet_sync_bn_world2(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 2);
  c.sync_bn = true;
  run_case(c);
}

static void test_convnet_sync_bn_world3_small_buckets(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 3);
  c.sync_bn = true;
  c.batch = 3;
  c.bucket_cap_mb = 0.02; /* bucket allreduces interleave with SyncBN's in backward */
  run_case(c);
}

static void test_toy_no_sync_accumulation(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("toy", 2);
  c.accum = 3;
  run_case(c);
  c.world = 3;
  run_case(c);
}

static void test_convnet_eval_no_sync_accumulation(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 2);
  c.eval = true;
  c.accum = 3;
  c.batch = 2;
  run_case(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_toy_world2),
      cmocka_unit_test(test_toy_world3),
      cmocka_unit_test(test_convnet_eval_world2),
      cmocka_unit_test(test_convnet_eval_world3_small_buckets),
      cmocka_unit_test(test_convnet_sync_bn_world2),
      cmocka_unit_test(test_convnet_sync_bn_world3_small_buckets),
      cmocka_unit_test(test_toy_no_sync_accumulation),
      cmocka_unit_test(test_convnet_eval_no_sync_accumulation),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
