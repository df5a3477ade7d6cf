/* The data-parallel step allocates nothing in the steady state (the pattern
 * of tests/train/test_step_alloc.c, two ranks as threads): after warm-up
 * steps (the tape's arena settles, the relayout happens once, the groups'
 * work pools fill), a window of steps with forward, backward with bucketed
 * async allreduces, no_sync micro-steps, fp16 compression and join's
 * per-iteration count (and, in a case of its own, PowerSGD compressing
 * with warm start) makes no call to the allocator in any thread,
 * counted through ddp_alloc_count(). The ranks meet at a barrier around the
 * window so that neither is still warming up inside it. The same for ZeRO
 * stages 1 and 2 at three ranks (buckets meeting several ranks' ranges:
 * several reduces in flight; the parameters' gather), micro-batches too. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "parallel/dp_test_util.h"

typedef struct alloc_case {
  ddp_dp_hook_kind hook; /* DDP_DP_HOOK_KIND_COUNT: PowerSGD at rank 2 from step 3 */
  bool join;
  pthread_barrier_t barrier;
  uint64_t before, after;
} alloc_case;

static void alloc_body(dpt_rank *self) {
  alloc_case *c = self->world->user;
  int W = self->world->size;
  ddp_model *m;
  DPT_OK(self, ddp_model_build("convnet", NULL, 3, &m));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = 0.02; /* 3 buckets */
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                           (size_t)ddp_model_num_param_elements(m));
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 16);
  if (s == DDP_OK) ddp_dp_set_optimizer(dp, opt);
  ddp_powersgd *ps = NULL;
  if (s == DDP_OK && c->hook == DDP_DP_HOOK_KIND_COUNT) {
    ddp_powersgd_options po = ddp_powersgd_defaults();
    po.rank = 2;
    po.start_iter = 3; /* compressing (and warm-starting) well before the window */
    s = ddp_powersgd_create(&ps, dp, &po);
  } else if (s == DDP_OK) {
    s = ddp_dp_set_comm_hook(dp, c->hook);
  }
  if (s == DDP_OK && c->join) s = ddp_dp_join_enable(dp, true);
  enum { B = 8 };
  float *xbuf = malloc(B * 784 * sizeof(float));
  int64_t ybuf[B];
  for (int step = 0; step < 10 && s == DDP_OK; step++) {
    if (step == 5) {
      pthread_barrier_wait(&c->barrier);
      if (self->rank == 0) c->before = ddp_alloc_count();
      pthread_barrier_wait(&c->barrier);
    }
    ddp_model_zero_grad(m);
    for (int micro = 0; micro < 2 && s == DDP_OK; micro++) {
      ddp_tensor x, y, *out, *loss;
      dpt_batch("convnet", step, micro * W * B + self->rank, W, B, xbuf, ybuf, &x, &y);
      ddp_dp_set_no_sync(dp, micro == 0);
      ddp_tape_reset(tape);
      s = ddp_dp_forward(dp, tape, &x, &out);
      if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
      if (s == DDP_OK) s = ddp_dp_backward(dp, tape, loss);
    }
    if (s == DDP_OK) s = ddp_optimizer_step(opt);
  }
  pthread_barrier_wait(&c->barrier);
  if (self->rank == 0) c->after = ddp_alloc_count();
  pthread_barrier_wait(&c->barrier);
  if (s == DDP_OK && c->join) s = ddp_dp_join(dp);
  ddp_powersgd_stats pst = {0};
  if (ps) ddp_powersgd_get_stats(ps, &pst);
  char msg[512] = "";
  if (s != DDP_OK) snprintf(msg, sizeof msg, "%s", ddp_last_error());
  free(xbuf);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_powersgd_destroy(ps);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_CHECK(self, s == DDP_OK, "%s", msg);
  DPT_CHECK(self, !ps || (pst.iter == 10 && pst.last_elements_sent < pst.last_elements_uncompressed),
            "PowerSGD did not compress: %lld iterations, %llu of %llu floats sent", (long long)pst.iter,
            (unsigned long long)pst.last_elements_sent,
            (unsigned long long)pst.last_elements_uncompressed);
}

static void run_case(ddp_dp_hook_kind hook, bool join) {
  alloc_case c = {.hook = hook, .join = join};
  pthread_barrier_init(&c.barrier, NULL, 2);
  assert_int_equal(dpt_run(2, 30, alloc_body, &c), 0);
  pthread_barrier_destroy(&c.barrier);
  uint64_t n = c.after - c.before;
  if (n)
    print_error("hook %d, join %d: %llu allocations in 5 steady-state steps\n", (int)hook, join,
                (unsigned long long)n);
  assert_int_equal(n, 0);
}

static void test_dp_step_fp32(void **state) {
  (void)state;
  run_case(DDP_DP_HOOK_ALLREDUCE, false);
}

static void test_dp_step_fp16_join(void **state) {
  (void)state;
  run_case(DDP_DP_HOOK_FP16, true);
}

static void test_dp_step_powersgd(void **state) {
  (void)state;
  run_case(DDP_DP_HOOK_KIND_COUNT, false);
}

/* ZeRO: forward (gather first), backward through the stage's reduction,
 * the narrowed optimizer's step, the parameters' gather; at stage 2 also
 * with the gradient ring (each micro-batch reduced from its slots). */
typedef struct zero_case {
  int stage;
  bool ring; /* DDP_ZERO_GRAD_RING=always, and the ring checked in use */
  pthread_barrier_t barrier;
  uint64_t before, after;
} zero_case;

static void zero_body(dpt_rank *self) {
  zero_case *c = self->world->user;
  int W = self->world->size;
  ddp_model *m;
  DPT_OK(self, ddp_model_build("convnet", NULL, 3, &m));
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_ADAM);
  ddp_optimizer *opt = NULL;
  ddp_zero *z = NULL;
  ddp_tape *tape = NULL;
  ddp_status s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                                      (size_t)ddp_model_num_param_elements(m));
  ddp_zero_options zo = ddp_zero_defaults(c->stage);
  zo.dp.bucket_cap_mb = zo.dp.first_bucket_mb = 0.02;
  if (s == DDP_OK) s = ddp_zero_create(&z, m, self->pg, opt, &zo);
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 16);
  enum { B = 4 };
  float *xbuf = malloc(B * 784 * sizeof(float));
  int64_t ybuf[B];
  for (int step = 0; step < 10 && s == DDP_OK; step++) {
    if (step == 5) {
      pthread_barrier_wait(&c->barrier);
      if (self->rank == 0) c->before = ddp_alloc_count();
      pthread_barrier_wait(&c->barrier);
    }
    if (s == DDP_OK) s = ddp_zero_zero_grad(z);
    for (int micro = 0; micro < 2 && s == DDP_OK; micro++) {
      ddp_tensor x, y, *out, *loss;
      dpt_batch("convnet", step, micro * W * B + self->rank, W, B, xbuf, ybuf, &x, &y);
      ddp_zero_set_no_sync(z, micro == 0);
      ddp_tape_reset(tape);
      s = ddp_zero_forward(z, tape, &x, &out);
      if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
      if (s == DDP_OK) s = ddp_zero_backward(z, tape, loss);
    }
    if (s == DDP_OK) s = ddp_zero_step(z);
  }
  pthread_barrier_wait(&c->barrier);
  if (self->rank == 0) c->after = ddp_alloc_count();
  pthread_barrier_wait(&c->barrier);
  char msg[512] = "";
  if (s != DDP_OK) snprintf(msg, sizeof msg, "%s", ddp_last_error());
  ddp_zero_memory mem = {0};
  if (z) ddp_zero_get_memory(z, &mem);
  free(xbuf);
  ddp_tape_destroy(tape);
  ddp_zero_destroy(z);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_CHECK(self, s == DDP_OK, "%s", msg);
  if (c->ring) DPT_CHECK(self, mem.grad_ring_bytes > 0, "stage 2: the gradient ring was not in use");
}

static void test_zero_steps(void **state) {
  (void)state;
  for (int k = 0; k < 3; k++) {
    const int stage = k == 0 ? 1 : 2;
    zero_case c = {.stage = stage, .ring = k == 2};
    /* Threads start inside dpt_run: the variable is read at create. */
    if (c.ring) setenv("DDP_ZERO_GRAD_RING", "always", 1);
    pthread_barrier_init(&c.barrier, NULL, 3);
    assert_int_equal(dpt_run(3, 30, zero_body, &c), 0);
    unsetenv("DDP_ZERO_GRAD_RING");
    pthread_barrier_destroy(&c.barrier);
    uint64_t n = c.after - c.before;
    if (n)
      print_error("ZeRO stage %d: %llu allocations in 5 steady-state steps\n", stage,
                  (unsigned long long)n);
    assert_int_equal(n, 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dp_step_fp32),
      cmocka_unit_test(test_dp_step_fp16_join),
      cmocka_unit_test(test_dp_step_powersgd),
      cmocka_unit_test(test_zero_steps),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
