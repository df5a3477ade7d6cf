/* DataParallel (one process, N replicas as threads) against independent
 * references: one model trained on the whole batch (SyncBatchNorm across
 * the replicas, or batch norm in eval mode), PyTorch's default batch-norm
 * rule from its definition (plain forwards of replica 0's rows), the
 * "module." prefix both ways, two runs bitwise equal, no allocation in the
 * steady state, and the errors for bad input and a failing replica. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "parallel/dp_test_util.h"

/* Trains `model` like dpt_train's single run (SGD, momentum, weight decay
 * 1e-4; step t's batch is rows 0..n-1 of dpt_batch) but through a
 * DataParallel wrapper of `replicas`. */
static ddp_status train_dp(const dpt_cfg *cfg, ddp_model *model, int replicas, bool sync_bn) {
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = replicas;
  o.sync_batch_norm = sync_bn;
  o.timeout_ms = 60000;
  ddp_data_parallel *dp;
  DDP_TRY(ddp_data_parallel_create(&dp, model, &o));
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = cfg->lr;
  oo.sgd.momentum = cfg->momentum;
  oo.weight_decay = 1e-4;
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  ddp_status s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model),
                                      ddp_model_grads_flat(model),
                                      (size_t)ddp_model_num_param_elements(model));
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 20);
  ddp_model_train(model, !cfg->eval);
  const int64_t rows = (int64_t)cfg->world * cfg->batch, sn = dpt_sample_numel(cfg->model);
  float *xbuf = malloc((size_t)(rows * sn) * sizeof(float));
  float *ybuf = malloc((size_t)rows * 8 * 5);
  for (int t = 0; t < cfg->steps && s == DDP_OK; t++) {
    ddp_tensor x, y, *out, *loss;
    dpt_batch(cfg->model, t, 0, 1, rows, xbuf, ybuf, &x, &y);
    ddp_model_zero_grad(model);
    ddp_tape_reset(tape);
    s = ddp_data_parallel_forward(dp, tape, &x, &out); /* the one changed line */
    if (s == DDP_OK) s = ddp_model_loss(model, tape, out, &y, &loss);
    if (s == DDP_OK) s = ddp_backward(tape, loss);
    if (s == DDP_OK) s = ddp_optimizer_step(opt);
  }
  free(xbuf);
  free(ybuf);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_data_parallel_destroy(dp);
  return s;
}

/* The reference (one model, the whole batch) and the wrapped run from the
 * same initial state; returns whether they agree within docs/parallel.md's
 * bound, with the reason in msg. */
static bool matches_single(dpt_cfg cfg, int replicas, bool sync_bn, char *msg, size_t bytes) {
  ddp_model *ref, *init, *m;
  assert_int_equal(ddp_model_build(cfg.model, NULL, 100, &ref), DDP_OK);
  assert_int_equal(ddp_model_build(cfg.model, NULL, 100, &init), DDP_OK);
  assert_int_equal(ddp_model_build(cfg.model, NULL, 100, &m), DDP_OK);
  cfg.world = replicas; /* dpt_train's single run takes world * batch rows */
  if (dpt_train(&cfg, ref, NULL, 0) != DDP_OK) fail_msg("single run: %s", ddp_last_error());
  if (train_dp(&cfg, m, replicas, sync_bn) != DDP_OK) fail_msg("DataParallel: %s", ddp_last_error());
  bool ok = dpt_params_close_to_update(m, ref, init, 1e-2, msg, bytes);
  /* Running statistics: with SyncBatchNorm (or in eval mode) the whole
   * batch's, so the reference's. */
  const float *a = ddp_model_buffers_flat(m), *b = ddp_model_buffers_flat(ref);
  for (int64_t i = 0; ok && i < ddp_model_num_buffer_elements(ref); i++)
    if (!(fabsf(a[i] - b[i]) <= 1e-3f * fabsf(b[i]) + 1e-4f)) {
      snprintf(msg, bytes, "buffer element %lld: %g vs the reference's %g", (long long)i, a[i], b[i]);
      ok = false;
    }
  for (int i = 0; ok && i < ddp_model_num_counters(ref); i++)
    if (ddp_model_counters(m)[i] != ddp_model_counters(ref)[i]) {
      snprintf(msg, bytes, "num_batches_tracked %d: %lld vs %lld", i,
               (long long)ddp_model_counters(m)[i], (long long)ddp_model_counters(ref)[i]);
      ok = false;
    }
  ddp_model_destroy(ref);
  ddp_model_destroy(init);
  ddp_model_destroy(m);
  return ok;
}

/* The equality: N replicas x B/N rows with SyncBatchNorm across
 * the replicas equal one model on B rows after 10 ConvNet steps. */
static void test_convnet_sync_bn_equals_one_replica(void **state) {
  (void)state;
  char msg[512];
  for (int n = 2; n <= 3; n++) {
    dpt_cfg cfg = dpt_defaults("convnet", n);
    if (!matches_single(cfg, n, true, msg, sizeof msg))
      fail_msg("%d replicas with SyncBatchNorm vs one model: %s", n, msg);
  }
}

/* The same comparison must fail without the sync (batch norm over each
 * replica's rows is other mathematics, docs/parallel.md: 0.19): the
 * comparison above can tell. */
static void test_convnet_without_sync_differs(void **state) {
  (void)state;
  char msg[512];
  dpt_cfg cfg = dpt_defaults("convnet", 2);
  assert_false(matches_single(cfg, 2, false, msg, sizeof msg));
}

/* Eval-mode batch norm and the toy model: the gathered output and the sum
 * of the replicas' gradients are the whole batch's, uneven slices too. */
static void test_eval_and_toy_equal_one_replica(void **state) {
  (void)state;
  char msg[512];
  dpt_cfg cfg = dpt_defaults("convnet", 2);
  cfg.eval = true;
  if (!matches_single(cfg, 2, false, msg, sizeof msg)) fail_msg("convnet eval: %s", msg);
  dpt_cfg toy = dpt_defaults("toy", 3);
  toy.batch = 5; /* 15 rows over 2 replicas: 8 and 7 */
  if (!matches_single(toy, 2, false, msg, sizeof msg)) fail_msg("toy: %s", msg);
}

/* PyTorch's rule, from its definition: after each forward the model's
 * running statistics are what a plain forward of replica 0's rows makes
 * of them, and every replica starts its forward from the model's. So two
 * wrapped forwards of 8 rows over 2 replicas leave the buffers of two
 * plain forwards of rows 0-3, and replica 1's output rows are a plain
 * forward of rows 4-7 by a model holding those same statistics. */
static void test_default_batch_norm_rule(void **state) {
  (void)state;
  ddp_model *m, *ref0, *ref1;
  assert_int_equal(ddp_model_build("convnet", NULL, 7, &m), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 7, &ref0), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 7, &ref1), DDP_OK);
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = 2;
  ddp_data_parallel *dp;
  assert_int_equal(ddp_data_parallel_create(&dp, m, &o), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  float xbuf[8 * 784];
  int64_t ybuf[8];
  for (int step = 0; step < 2; step++) {
    ddp_tensor x, y, x0, x1, *out, *o0, *o1;
    dpt_batch("convnet", step, 0, 1, 8, xbuf, ybuf, &x, &y);
    ddp_tape_reset(tape);
    assert_int_equal(ddp_data_parallel_forward(dp, tape, &x, &out), DDP_OK);
    /* ref1 holds the statistics the model had before this forward. */
    memcpy(ddp_model_buffers_flat(ref1), ddp_model_buffers_flat(ref0),
           (size_t)ddp_model_num_buffer_elements(ref0) * sizeof(float));
    memcpy(ddp_model_counters(ref1), ddp_model_counters(ref0),
           (size_t)ddp_model_num_counters(ref0) * sizeof(int64_t));
    assert_int_equal(ddp_tensor_wrap(&x0, DDP_FLOAT32, 4, (int64_t[]){4, 1, 28, 28}, xbuf), DDP_OK);
    assert_int_equal(ddp_tensor_wrap(&x1, DDP_FLOAT32, 4, (int64_t[]){4, 1, 28, 28}, xbuf + 4 * 784),
                     DDP_OK);
    ddp_tape *t0, *t1;
    assert_int_equal(ddp_tape_create(&t0, 1 << 20), DDP_OK);
    assert_int_equal(ddp_tape_create(&t1, 1 << 20), DDP_OK);
    assert_int_equal(ddp_model_forward(ref0, t0, &x0, &o0), DDP_OK);
    assert_int_equal(ddp_model_forward(ref1, t1, &x1, &o1), DDP_OK);
    /* The same kernels on the same rows: the same bits. */
    assert_memory_equal(ddp_model_buffers_flat(m), ddp_model_buffers_flat(ref0),
                        (size_t)ddp_model_num_buffer_elements(m) * sizeof(float));
    assert_memory_equal(ddp_model_counters(m), ddp_model_counters(ref0),
                        (size_t)ddp_model_num_counters(m) * sizeof(int64_t));
    assert_int_equal(ddp_model_counters(m)[0], step + 1); /* not 2 per forward */
    assert_memory_equal(ddp_tensor_f32(out), ddp_tensor_f32(o0), 4 * 10 * sizeof(float));
    assert_memory_equal(ddp_tensor_f32(out) + 40, ddp_tensor_f32(o1), 4 * 10 * sizeof(float));
    ddp_tape_destroy(t0);
    ddp_tape_destroy(t1);
  }
  /* In eval mode every replica normalises with the model's running
   * statistics (the broadcast before each forward), so replica 1's rows
   * are the model's own eval forward of them. */
  ddp_model_train(m, false);
  ddp_model_train(ref0, false);
  ddp_tensor x, y, x1, *out, *o1;
  dpt_batch("convnet", 5, 0, 1, 8, xbuf, ybuf, &x, &y);
  ddp_tape_reset(tape);
  assert_int_equal(ddp_data_parallel_forward(dp, tape, &x, &out), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&x1, DDP_FLOAT32, 4, (int64_t[]){4, 1, 28, 28}, xbuf + 4 * 784),
                   DDP_OK);
  ddp_tape *t1;
  assert_int_equal(ddp_tape_create(&t1, 1 << 20), DDP_OK);
  assert_int_equal(ddp_model_forward(ref0, t1, &x1, &o1), DDP_OK);
  assert_memory_equal(ddp_tensor_f32(out) + 40, ddp_tensor_f32(o1), 4 * 10 * sizeof(float));
  ddp_tape_destroy(t1);
  ddp_tape_destroy(tape);
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(m);
  ddp_model_destroy(ref0);
  ddp_model_destroy(ref1);
}

/* Two runs, the same bits: the replicas' gradients are summed in replica
 * order whatever order the threads finish in. */
static void test_two_runs_bitwise_equal(void **state) {
  (void)state;
  dpt_cfg cfg = dpt_defaults("convnet", 3);
  cfg.steps = 5; /* enough steps for momentum to carry any difference; short under TSan */
  ddp_model *a, *b;
  for (int sync = 0; sync <= 1; sync++) {
    assert_int_equal(ddp_model_build("convnet", NULL, 5, &a), DDP_OK);
    assert_int_equal(ddp_model_build("convnet", NULL, 5, &b), DDP_OK);
    if (train_dp(&cfg, a, 3, sync) != DDP_OK) fail_msg("run 1: %s", ddp_last_error());
    if (train_dp(&cfg, b, 3, sync) != DDP_OK) fail_msg("run 2: %s", ddp_last_error());
    assert_memory_equal(ddp_model_params_flat(a), ddp_model_params_flat(b),
                        (size_t)ddp_model_num_param_elements(a) * sizeof(float));
    assert_memory_equal(ddp_model_buffers_flat(a), ddp_model_buffers_flat(b),
                        (size_t)ddp_model_num_buffer_elements(a) * sizeof(float));
    ddp_model_destroy(a);
    ddp_model_destroy(b);
  }
}

/* DataParallel(model).state_dict() names are "module." + the model's;
 * ddp_model_load takes them into a bare model, and a bare model's file
 * loads into a wrapped one. */
static void test_module_prefix_round_trip(void **state) {
  (void)state;
  char path[] = "/tmp/ddp_dp_prefix_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  ddp_model *m, *bare, *other;
  assert_int_equal(ddp_model_build("convnet", NULL, 11, &m), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 12, &bare), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 13, &other), DDP_OK);
  dpt_cfg cfg = dpt_defaults("convnet", 2);
  cfg.steps = 2; /* running statistics and counters off their initial values */
  assert_int_equal(train_dp(&cfg, m, 2, false), DDP_OK);
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = 2;
  ddp_data_parallel *dp;
  assert_int_equal(ddp_data_parallel_create(&dp, m, &o), DDP_OK);
  assert_int_equal(ddp_data_parallel_save(dp, path, NULL, 0), DDP_OK);
  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_OK);
  assert_int_equal((int)ddp_safetensors_count(st), ddp_model_state_count(m));
  ddp_safetensors_tensor t;
  assert_int_equal(ddp_safetensors_find(st, "module.layer1.1.running_mean", &t), DDP_OK);
  assert_int_not_equal(ddp_safetensors_find(st, "layer1.1.running_mean", &t), DDP_OK);
  for (size_t i = 0; i < ddp_safetensors_count(st); i++) {
    assert_int_equal(ddp_safetensors_get(st, i, &t), DDP_OK);
    assert_int_equal(strncmp(t.name, "module.", 7), 0);
  }
  ddp_safetensors_free(st);
  /* Wrapped -> bare. */
  assert_int_equal(ddp_model_load(bare, path), DDP_OK);
  assert_memory_equal(ddp_model_params_flat(bare), ddp_model_params_flat(m),
                      (size_t)ddp_model_num_param_elements(m) * sizeof(float));
  assert_memory_equal(ddp_model_buffers_flat(bare), ddp_model_buffers_flat(m),
                      (size_t)ddp_model_num_buffer_elements(m) * sizeof(float));
  assert_memory_equal(ddp_model_counters(bare), ddp_model_counters(m),
                      (size_t)ddp_model_num_counters(m) * sizeof(int64_t));
  /* Bare -> wrapped: other's state, saved without the prefix. */
  assert_int_equal(ddp_model_save(other, path, NULL, 0), DDP_OK);
  assert_int_equal(ddp_model_load(ddp_data_parallel_module(dp), path), DDP_OK);
  assert_memory_equal(ddp_model_params_flat(m), ddp_model_params_flat(other),
                      (size_t)ddp_model_num_param_elements(m) * sizeof(float));
  ddp_data_parallel_destroy(dp);
  unlink(path);
  ddp_model_destroy(m);
  ddp_model_destroy(bare);
  ddp_model_destroy(other);
}

/* After the first steps, a step through the wrapper allocates nothing
 * (the replicas' tapes keep their arenas, the threads persist). */
static void test_steady_state_allocates_nothing(void **state) {
  (void)state;
  ddp_model *m;
  assert_int_equal(ddp_model_build("convnet", NULL, 3, &m), DDP_OK);
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = 2;
  o.sync_batch_norm = true;
  ddp_data_parallel *dp;
  assert_int_equal(ddp_data_parallel_create(&dp, m, &o), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  assert_int_equal(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                                        (size_t)ddp_model_num_param_elements(m)),
                   DDP_OK);
  static float xbuf[16 * 784];
  int64_t ybuf[16];
  uint64_t before = 0;
  for (int step = 0; step < 8; step++) {
    if (step == 3) before = ddp_alloc_count();
    ddp_tensor x, y, *out, *loss;
    dpt_batch("convnet", step, 0, 1, 16, xbuf, ybuf, &x, &y);
    ddp_model_zero_grad(m);
    ddp_tape_reset(tape);
    assert_int_equal(ddp_data_parallel_forward(dp, tape, &x, &out), DDP_OK);
    assert_int_equal(ddp_model_loss(m, tape, out, &y, &loss), DDP_OK);
    assert_int_equal(ddp_backward(tape, loss), DDP_OK);
    assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
  }
  assert_int_equal(ddp_alloc_count() - before, 0);
  ddp_optimizer_destroy(opt);
  ddp_tape_destroy(tape);
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(m);
}

static void expect_error(ddp_status got, ddp_status want, const char *needle) {
  if (got != want || !strstr(ddp_last_error(), needle))
    fail_msg("got %s \"%s\", wanted %s with \"%s\"", ddp_status_name(got), ddp_last_error(),
             ddp_status_name(want), needle);
}

static void test_bad_input(void **state) {
  (void)state;
  ddp_model *m;
  assert_int_equal(ddp_model_build("convnet", NULL, 3, &m), DDP_OK);
  ddp_data_parallel *dp = (ddp_data_parallel *)1;
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = -1;
  expect_error(ddp_data_parallel_create(&dp, m, &o), DDP_ERR_INVALID, "options.replicas = -1");
  assert_null(dp);
  /* A core that no machine this runs on has in its mask. */
  o = ddp_data_parallel_defaults();
  int32_t ids[2] = {0, CPU_SETSIZE - 1};
  cpu_set_t mask;
  assert_int_equal(sched_getaffinity(0, sizeof mask, &mask), 0);
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &mask)) {
      ids[0] = c;
      break;
    }
  o.device_ids = ids;
  o.n_device_ids = 2;
  char want[64];
  snprintf(want, sizeof want, "device_ids[1] = %d: no such core", CPU_SETSIZE - 1);
  expect_error(ddp_data_parallel_create(&dp, m, &o), DDP_ERR_INVALID, want);
  ids[1] = ids[0];
  expect_error(ddp_data_parallel_create(&dp, m, &o), DDP_ERR_INVALID, "each replica needs a core");
  o = ddp_data_parallel_defaults();
  o.device = DDP_CUDA(0);
  expect_error(ddp_data_parallel_create(&dp, m, &o), DDP_ERR_UNSUPPORTED, "on the CPU only");
  o = ddp_data_parallel_defaults();
  o.dim = 1;
  expect_error(ddp_data_parallel_create(&dp, m, &o), DDP_ERR_UNSUPPORTED, "options.dim = 1");

  /* A batch smaller than the replicas. */
  o = ddp_data_parallel_defaults();
  o.replicas = 3;
  assert_int_equal(ddp_data_parallel_create(&dp, m, &o), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  static float xbuf[2 * 784];
  int64_t ybuf[2];
  ddp_tensor x, y, *out;
  dpt_batch("convnet", 0, 0, 1, 2, xbuf, ybuf, &x, &y);
  expect_error(ddp_data_parallel_forward(dp, tape, &x, &out), DDP_ERR_INVALID,
               "a batch of 2 rows (input (2,1,28,28)) cannot be scattered over 3 replicas");
  /* Wrapped twice, or for DDP too. */
  ddp_data_parallel *again;
  expect_error(ddp_data_parallel_create(&again, m, NULL), DDP_ERR_STATE,
               "already wrapped by DataParallel");
  expect_error(ddp_model_relayout(m, (int[]){0}), DDP_ERR_STATE, "read in place by replicas");
  ddp_tape_destroy(tape);
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(m);
}

/* A model already wrapped for DDP (a group of one, threads backend). */
static void ddp_wrapped_body(dpt_rank *self) {
  ddp_model *m;
  DPT_OK(self, ddp_model_build("toy", NULL, 1, &m));
  ddp_dp *ddp;
  DPT_OK(self, ddp_dp_create(&ddp, m, self->pg, NULL));
  ddp_data_parallel *dp;
  ddp_status s = ddp_data_parallel_create(&dp, m, NULL);
  DPT_CHECK(self, s == DDP_ERR_STATE && strstr(ddp_last_error(), "DistributedDataParallel"),
            "DataParallel over DDP: %s", ddp_last_error());
  ddp_dp_destroy(ddp);
  /* And the other way round. */
  DPT_OK(self, ddp_data_parallel_create(&dp, m, &(ddp_data_parallel_options){.replicas = 2,
                                                                             .pin_threads = true}));
  s = ddp_dp_create(&ddp, m, self->pg, NULL);
  DPT_CHECK(self, s == DDP_ERR_STATE && strstr(ddp_last_error(), "DataParallel"),
            "DDP over DataParallel: %s", ddp_last_error());
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(m);
}

static void test_model_wrapped_for_ddp(void **state) {
  (void)state;
  assert_int_equal(dpt_run(1, 30, ddp_wrapped_body, NULL), 0);
}

/* ---- A failing replica names itself --------------------------------------
 * Allocation fails on every thread but the test's once armed: replica 1's
 * first forward grows its tape there. */
static pthread_t main_thread;
static atomic_bool fail_armed;

static void *failing_alloc(size_t bytes, void *user) {
  (void)user;
  if (atomic_load(&fail_armed) && !pthread_equal(pthread_self(), main_thread)) return NULL;
  void *p = NULL;
  return posix_memalign(&p, 64, bytes ? bytes : 1) == 0 ? p : NULL;
}
static void plain_free(void *p, void *user) {
  (void)user;
  free(p);
}

static void test_failing_replica_is_named(void **state) {
  (void)state;
  main_thread = pthread_self();
  ddp_set_alloc_hooks(&(ddp_alloc_hooks){.alloc = failing_alloc, .free = plain_free});
  ddp_model *m;
  assert_int_equal(ddp_model_build("convnet", NULL, 3, &m), DDP_OK);
  ddp_data_parallel *dp;
  ddp_data_parallel_options o = ddp_data_parallel_defaults();
  o.replicas = 2;
  o.sync_batch_norm = true; /* replica 0 waits for replica 1 in its first batch norm */
  o.timeout_ms = 20000;
  assert_int_equal(ddp_data_parallel_create(&dp, m, &o), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  static float xbuf[4 * 784];
  int64_t ybuf[4];
  ddp_tensor x, y, *out;
  dpt_batch("convnet", 0, 0, 1, 4, xbuf, ybuf, &x, &y);
  atomic_store(&fail_armed, true);
  int64_t t0 = ddp_time_ns();
  ddp_status s = ddp_data_parallel_forward(dp, tape, &x, &out);
  atomic_store(&fail_armed, false);
  expect_error(s, DDP_ERR_NOMEM, "DataParallel: replica 1");
  printf("the failing replica's error: %s\n", ddp_last_error());
  assert_non_null(strstr(ddp_last_error(), "forward"));
  /* Replica 0 was released at once, not after the timeout. */
  assert_true(ddp_time_ns() - t0 < 10 * 1000000000ll);
  ddp_tape_destroy(tape);
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(m);
  ddp_set_alloc_hooks(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_convnet_sync_bn_equals_one_replica),
      cmocka_unit_test(test_convnet_without_sync_differs),
      cmocka_unit_test(test_eval_and_toy_equal_one_replica),
      cmocka_unit_test(test_default_batch_norm_rule),
      cmocka_unit_test(test_two_runs_bitwise_equal),
      cmocka_unit_test(test_module_prefix_round_trip),
      cmocka_unit_test(test_steady_state_allocates_nothing),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_model_wrapped_for_ddp),
      cmocka_unit_test(test_failing_replica_is_named),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
