/* The parameter server's pure parts, without RPC (src/ps/ps_internal.h):
 *  - the sharding: whole tensors, every server holding some, deterministic,
 *    hand-worked cases, and balance against the best assignment found by
 *    brute force (longest-processing-time first is within 4/3 of it,
 *    Graham's bound, and within the largest tensor of the mean);
 *  - the clock table's rule per mode, and under random schedules the ssp
 *    invariant: no trainer starts a step more than K steps ahead of the
 *    slowest live trainer;
 *  - a shard's updates: sync applies the mean of every trainer's gradient
 *    once all are in (against a float64 computation, and bit-identical
 *    whatever order the pushes arrive in), async each push at once, and
 *    the per-tensor optimizers together equal one optimizer over the model
 *    (SGD with momentum and weight decay, 3 steps); bad pushes refused. */
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
#include "ps/ps_internal.h"

/* ---- Sharding ---- */

static int64_t max_load(const int64_t *numel, const int32_t *owner, int n, int S) {
  int64_t load[8] = {0}, m = 0;
  for (int i = 0; i < n; i++) load[owner[i]] += numel[i];
  for (int s = 0; s < S; s++) m = load[s] > m ? load[s] : m;
  return m;
}

/* The smallest largest load over every assignment of n tensors to S servers. */
static int64_t best_max_load(const int64_t *numel, int n, int S) {
  int64_t best = INT64_MAX;
  int32_t owner[16];
  long total = 1;
  for (int i = 0; i < n; i++) total *= S;
  for (long code = 0; code < total; code++) {
    long c = code;
    for (int i = 0; i < n; i++, c /= S) owner[i] = (int32_t)(c % S);
    int64_t m = max_load(numel, owner, n, S);
    if (m < best) best = m;
  }
  return best;
}

static void test_shard_cases(void **state) {
  (void)state;
  int32_t owner[8];
  const int64_t a[5] = {10, 7, 5, 3, 1};
  assert_int_equal(ddp_ps_shard(a, 5, 2, owner), DDP_OK);
  const int32_t want_a[5] = {0, 1, 1, 0, 1}; /* 10+3 = 13, 7+5+1 = 13 */
  for (int i = 0; i < 5; i++) assert_int_equal(owner[i], want_a[i]);
  const int64_t b[4] = {4, 4, 4, 4}; /* ties: lower index first, lower server first */
  assert_int_equal(ddp_ps_shard(b, 4, 2, owner), DDP_OK);
  const int32_t want_b[4] = {0, 1, 0, 1};
  for (int i = 0; i < 4; i++) assert_int_equal(owner[i], want_b[i]);
  assert_int_equal(ddp_ps_shard(a, 5, 1, owner), DDP_OK);
  for (int i = 0; i < 5; i++) assert_int_equal(owner[i], 0);
  /* Fewer tensors than servers, no servers: refused, naming the fix. */
  assert_int_equal(ddp_ps_shard(a, 2, 3, owner), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "at most 2 servers"));
  assert_int_equal(ddp_ps_shard(a, 5, 0, owner), DDP_ERR_INVALID);
}

static void test_shard_balance(void **state) {
  (void)state;
  uint64_t rng = 12345;
  for (int trial = 0; trial < 300; trial++) {
    int n = 2 + (int)(trial % 7);  /* 2..8 tensors */
    int S = 1 + (int)(trial % 3);  /* 1..3 servers */
    if (n < S) continue;
    int64_t numel[8];
    int64_t total = 0, largest = 0;
    for (int i = 0; i < n; i++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      numel[i] = 1 + (int64_t)((rng >> 33) % (trial % 2 ? 100 : 100000));
      total += numel[i];
      largest = numel[i] > largest ? numel[i] : largest;
    }
    int32_t owner[8], again[8];
    assert_int_equal(ddp_ps_shard(numel, n, S, owner), DDP_OK);
    assert_int_equal(ddp_ps_shard(numel, n, S, again), DDP_OK);
    assert_memory_equal(owner, again, sizeof(int32_t) * (size_t)n); /* deterministic */
    int held[3] = {0};
    for (int i = 0; i < n; i++) {
      assert_in_range(owner[i], 0, S - 1);
      held[owner[i]]++;
    }
    for (int s = 0; s < S; s++) assert_true(held[s] > 0); /* every server holds a tensor */
    int64_t got = max_load(numel, owner, n, S), best = best_max_load(numel, n, S);
    assert_true(3 * got <= 4 * best);                     /* Graham: LPT <= 4/3 OPT */
    assert_true((double)got <= (double)total / S + (double)largest);
  }
}

/* The ConvNet's tensors over 1..4 servers: whole tensors, the same on a
 * second model built with another seed (sizes alone decide). */
static void test_shard_convnet(void **state) {
  (void)state;
  ddp_model *m1, *m2;
  assert_int_equal(ddp_model_build("convnet", NULL, 1, &m1), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 7, &m2), DDP_OK);
  for (int S = 1; S <= 4; S++) {
    ddp__ps_shard shards[4];
    int64_t covered = 0;
    for (int s = 0; s < S; s++) {
      ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
      assert_int_equal(ddp__ps_shard_init(&shards[s], m1, s, S, 2, DDP_PS_SYNC, &o), DDP_OK);
      assert_true(shards[s].n > 0);
      covered += shards[s].owned_numel;
    }
    assert_int_equal(covered, ddp_model_num_param_elements(m1));
    for (int i = 0; i < ddp_model_num_params(m1); i++) {
      int holders = 0;
      for (int s = 0; s < S; s++) holders += shards[s].local_of[i] >= 0;
      assert_int_equal(holders, 1);
    }
    for (int s = 0; s < S; s++) ddp__ps_shard_free(&shards[s]);
  }
  ddp_model_destroy(m1);
  ddp_model_destroy(m2);
}

/* ---- The clock table ---- */

static void test_clock_rules(void **state) {
  (void)state;
  ddp__ps_clock c;
  assert_int_equal(ddp__ps_clock_init(&c, 3, DDP_PS_SYNC, 0, 0), DDP_OK);
  c.clock[0] = 1;
  assert_false(ddp__ps_clock_may_pull(&c, 0, 1)); /* the others have not finished step 1 */
  assert_false(ddp__ps_clock_may_pull(&c, 1, 1)); /* nor has trainer 1 itself */
  c.clock[1] = c.clock[2] = 1;
  assert_true(ddp__ps_clock_may_pull(&c, 0, 1));
  c.state[2] = DDP__PS_FINISHED; /* a finished trainer holds nobody back */
  c.clock[0] = c.clock[1] = 2;
  assert_true(ddp__ps_clock_may_pull(&c, 0, 2));
  assert_int_equal(ddp__ps_clock_live(&c), 2);
  ddp__ps_clock_free(&c);

  assert_int_equal(ddp__ps_clock_init(&c, 3, DDP_PS_SSP, 2, 10), DDP_OK);
  assert_int_equal(ddp__ps_clock_min(&c), 10); /* a resumed run starts at its step */
  c.clock[0] = 15;
  c.clock[1] = c.clock[2] = 13;
  assert_true(ddp__ps_clock_may_pull(&c, 0, 15));  /* 13 >= 15 - 2 */
  c.clock[0] = 16;
  assert_false(ddp__ps_clock_may_pull(&c, 0, 16)); /* 13 < 14 */
  c.state[1] = c.state[2] = DDP__PS_DROPPED;       /* dropped: the bound is over the live */
  assert_true(ddp__ps_clock_may_pull(&c, 0, 16));
  assert_int_equal(ddp__ps_clock_min(&c), 16);
  ddp__ps_clock_free(&c);

  assert_int_equal(ddp__ps_clock_init(&c, 2, DDP_PS_ASYNC, 0, 0), DDP_OK);
  c.clock[0] = 100;
  assert_true(ddp__ps_clock_may_pull(&c, 0, 100));
  assert_false(ddp__ps_clock_may_pull(&c, 0, 101)); /* its own step first, in every mode */
  ddp__ps_clock_free(&c);
}

/* Random schedules: at each event a random trainer tries to take a step
 * (it may if its pending pull may be answered); one may be dropped midway.
 * Whenever a trainer starts a step, (its finished steps) - (the slowest
 * live trainer's) <= K; and with K large nobody ever waits. */
static void test_clock_ssp_invariant(void **state) {
  (void)state;
  uint64_t rng = 99;
  for (int K = 0; K <= 3; K++) {
    ddp__ps_clock c;
    assert_int_equal(ddp__ps_clock_init(&c, 4, DDP_PS_SSP, K, 0), DDP_OK);
    int64_t worst_gap = 0, blocked = 0;
    for (int ev = 0; ev < 20000; ev++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      int t = (int)((rng >> 33) % 4);
      if (ev == 10000) c.state[3] = DDP__PS_DROPPED;
      if (c.state[t] != DDP__PS_LIVE) continue;
      /* Trainer t has finished clock[t] steps and pulled for it: may it start the next? */
      if (!ddp__ps_clock_may_pull(&c, t, c.clock[t])) {
        blocked++;
        continue;
      }
      int64_t gap = c.clock[t] - ddp__ps_clock_min(&c);
      worst_gap = gap > worst_gap ? gap : worst_gap;
      c.clock[t]++; /* it runs the step and finishes it */
    }
    assert_true(worst_gap <= K);
    assert_true(worst_gap == K); /* the bound is reached: the schedules do run ahead */
    assert_true(blocked > 0);
    ddp__ps_clock_free(&c);
  }
}

/* ---- A shard's updates on the toy model ---- */

enum { TRAINERS = 3 };

static ddp_model *toy(void) {
  ddp_model *m;
  assert_int_equal(ddp_model_build("toy", NULL, 5, &m), DDP_OK);
  return m;
}

/* Gradient of trainer t at step s for parameter element e (distinct values). */
static float grad_value(int t, int s, int64_t e) {
  return (float)sin(0.37 * (double)e + 1.3 * t + 0.71 * s) * (1.0f + 0.5f * (float)t);
}

static void fill_grad(float *g, int64_t n, int t, int s) {
  for (int64_t e = 0; e < n; e++) g[e] = grad_value(t, s, e);
}

/* Pushes every trainer's gradient of every parameter for step s, in the
 * order `order` gives trainers (per parameter). */
static void push_step(ddp__ps_shard *sh, int s, const int *order, double lr) {
  ddp_model *m = sh->model;
  float g[200];
  for (int i = 0; i < ddp_model_num_params(m); i++) {
    int64_t n = ddp_model_param(m, i)->numel;
    for (int k = 0; k < TRAINERS; k++) {
      int t = order[(k + i) % TRAINERS];
      fill_grad(g, n, t, s);
      bool updated;
      assert_int_equal(ddp__ps_shard_push(sh, t, i, s, g, lr, TRAINERS, &updated), DDP_OK);
      assert_int_equal(updated, sh->mode != DDP_PS_SYNC || k == TRAINERS - 1);
    }
  }
}

static void test_shard_sync_mean(void **state) {
  (void)state;
  const double lr = 0.1;
  ddp_model *a = toy(), *b = toy();
  int64_t n = ddp_model_num_param_elements(a);
  double *ref = malloc((size_t)n * sizeof *ref);
  for (int64_t e = 0; e < n; e++) ref[e] = ddp_model_params_flat(a)[e];
  ddp__ps_shard sa, sb;
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = lr;
  assert_int_equal(ddp__ps_shard_init(&sa, a, 0, 1, TRAINERS, DDP_PS_SYNC, &o), DDP_OK);
  assert_int_equal(ddp__ps_shard_init(&sb, b, 0, 1, TRAINERS, DDP_PS_SYNC, &o), DDP_OK);
  const int order_a[TRAINERS] = {0, 1, 2}, order_b[TRAINERS] = {2, 0, 1};
  for (int s = 1; s <= 3; s++) {
    push_step(&sa, s, order_a, lr);
    push_step(&sb, s, order_b, lr);
    /* float64: p -= lr * mean over trainers */
    for (int i = 0; i < ddp_model_num_params(a); i++) {
      int64_t off = ddp_model_param_offset(a, i), numel = ddp_model_param(a, i)->numel;
      for (int64_t e = 0; e < numel; e++) {
        double mean = 0;
        for (int t = 0; t < TRAINERS; t++) mean += grad_value(t, s, e);
        ref[off + e] -= lr * mean / TRAINERS;
      }
    }
  }
  double worst = 0;
  for (int64_t e = 0; e < n; e++) {
    double d = fabs(ddp_model_params_flat(a)[e] - ref[e]);
    worst = d > worst ? d : worst;
  }
  assert_true(worst <= 1e-6);
  /* Arrival order changes nothing: the sum is in trainer order. */
  assert_memory_equal(ddp_model_params_flat(a), ddp_model_params_flat(b), (size_t)n * sizeof(float));
  assert_int_equal(sa.updates, 3 * ddp_model_num_params(a));
  /* A push for a step that is not in progress, or twice, is refused. */
  float g[200] = {0};
  bool updated;
  assert_int_equal(ddp__ps_shard_push(&sa, 0, 0, 7, g, lr, TRAINERS, &updated), DDP_ERR_STATE);
  assert_int_equal(ddp__ps_shard_push(&sa, 0, 0, 4, g, lr, TRAINERS, &updated), DDP_OK);
  assert_int_equal(ddp__ps_shard_push(&sa, 0, 0, 4, g, lr, TRAINERS, &updated), DDP_ERR_STATE);
  assert_int_equal(ddp__ps_shard_push(&sa, 0, 99, 4, g, lr, TRAINERS, &updated), DDP_ERR_INVALID);
  /* A trainer that leaves mid-step: the others' pushes are applied. */
  assert_int_equal(ddp__ps_shard_push(&sa, 1, 0, 4, g, lr, TRAINERS, &updated), DDP_OK);
  assert_false(updated);
  int64_t before = sa.updates;
  assert_int_equal(ddp__ps_shard_flush(&sa, 2), DDP_OK);
  assert_int_equal(sa.updates, before + 1);
  ddp__ps_shard_free(&sa);
  ddp__ps_shard_free(&sb);
  free(ref);
  ddp_model_destroy(a);
  ddp_model_destroy(b);
}

static void test_shard_async_each(void **state) {
  (void)state;
  const double lr = 0.05;
  ddp_model *a = toy();
  int64_t n = ddp_model_num_param_elements(a);
  double *ref = malloc((size_t)n * sizeof *ref);
  for (int64_t e = 0; e < n; e++) ref[e] = ddp_model_params_flat(a)[e];
  ddp__ps_shard sa;
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = lr;
  assert_int_equal(ddp__ps_shard_init(&sa, a, 0, 1, TRAINERS, DDP_PS_ASYNC, &o), DDP_OK);
  const int order[TRAINERS] = {1, 2, 0};
  /* Steps need not agree in async: trainers 0..2 push their own steps. */
  push_step(&sa, 1, order, lr);
  for (int i = 0; i < ddp_model_num_params(a); i++) {
    int64_t off = ddp_model_param_offset(a, i), numel = ddp_model_param(a, i)->numel;
    for (int64_t e = 0; e < numel; e++)
      for (int t = 0; t < TRAINERS; t++) ref[off + e] -= lr * grad_value(t, 1, e);
  }
  for (int64_t e = 0; e < n; e++) assert_true(fabs(ddp_model_params_flat(a)[e] - ref[e]) <= 1e-6);
  assert_int_equal(sa.updates, TRAINERS * ddp_model_num_params(a));
  ddp__ps_shard_free(&sa);
  free(ref);
  ddp_model_destroy(a);
}

/* Two servers' per-tensor optimizers (SGD, momentum 0.9, weight decay,
 * nesterov) equal one optimizer over the whole model fed the same mean
 * gradients: the updates are elementwise. */
static void test_shards_equal_whole_optimizer(void **state) {
  (void)state;
  ddp_model *a = toy(), *w = toy();
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = 0.05;
  o.weight_decay = 1e-3;
  o.sgd.momentum = 0.9;
  o.sgd.nesterov = true;
  ddp__ps_shard s0, s1;
  assert_int_equal(ddp__ps_shard_init(&s0, a, 0, 2, TRAINERS, DDP_PS_SYNC, &o), DDP_OK);
  assert_int_equal(ddp__ps_shard_init(&s1, a, 1, 2, TRAINERS, DDP_PS_SYNC, &o), DDP_OK);
  assert_int_equal(s0.n + s1.n, ddp_model_num_params(a));
  ddp_optimizer *whole;
  int64_t n = ddp_model_num_param_elements(w);
  assert_int_equal(ddp_optimizer_create(&whole, &o, ddp_model_params_flat(w),
                                        ddp_model_grads_flat(w), (size_t)n), DDP_OK);
  const int order[TRAINERS] = {0, 1, 2};
  for (int s = 1; s <= 3; s++) {
    ddp_model *m = a;
    float g[200];
    for (int i = 0; i < ddp_model_num_params(m); i++) {
      int64_t numel = ddp_model_param(m, i)->numel;
      ddp__ps_shard *sh = s0.local_of[i] >= 0 ? &s0 : &s1;
      for (int k = 0; k < TRAINERS; k++) {
        fill_grad(g, numel, order[k], s);
        bool updated;
        assert_int_equal(ddp__ps_shard_push(sh, order[k], i, s, g, o.lr, TRAINERS, &updated),
                         DDP_OK);
      }
      /* The whole optimizer's gradient: the same float mean. */
      float *wg = ddp_model_grads_flat(w) + ddp_model_param_offset(w, i);
      for (int64_t e = 0; e < numel; e++) {
        float sum = 0;
        for (int t = 0; t < TRAINERS; t++) sum += grad_value(t, s, e);
        wg[e] = sum * (1.0f / TRAINERS);
      }
    }
    assert_int_equal(ddp_optimizer_step(whole), DDP_OK);
  }
  assert_memory_equal(ddp_model_params_flat(a), ddp_model_params_flat(w), (size_t)n * sizeof(float));
  ddp_optimizer_destroy(whole);
  ddp__ps_shard_free(&s0);
  ddp__ps_shard_free(&s1);
  ddp_model_destroy(a);
  ddp_model_destroy(w);
}

static void test_mode_parse(void **state) {
  (void)state;
  ddp_ps_mode m;
  int32_t k;
  assert_int_equal(ddp_ps_mode_parse("sync", &m, &k), DDP_OK);
  assert_int_equal(m, DDP_PS_SYNC);
  assert_int_equal(ddp_ps_mode_parse("async", &m, &k), DDP_OK);
  assert_int_equal(m, DDP_PS_ASYNC);
  assert_int_equal(ddp_ps_mode_parse("ssp:2", &m, &k), DDP_OK);
  assert_int_equal(m, DDP_PS_SSP);
  assert_int_equal(k, 2);
  assert_int_equal(ddp_ps_mode_parse("ssp:0", &m, &k), DDP_OK);
  const char *bad[] = {"ssp", "ssp:", "ssp:-1", "ssp:2x", "Sync", ""};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    assert_int_equal(ddp_ps_mode_parse(bad[i], &m, &k), DDP_ERR_INVALID);
  ddp_ps_options o = {.num_servers = 2, .num_trainers = 3, .mode = DDP_PS_SSP, .staleness = 1};
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(&o, 1, name);
  assert_string_equal(name, "ps1");
  ddp_ps_worker_name(&o, 2, name);
  assert_string_equal(name, "trainer0");
  o.num_trainers = 0;
  assert_int_equal(ddp_ps_options_check(&o), DDP_ERR_INVALID);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shard_cases),
      cmocka_unit_test(test_shard_balance),
      cmocka_unit_test(test_shard_convnet),
      cmocka_unit_test(test_clock_rules),
      cmocka_unit_test(test_clock_ssp_invariant),
      cmocka_unit_test(test_shard_sync_mean),
      cmocka_unit_test(test_shard_async_each),
      cmocka_unit_test(test_shards_equal_whole_optimizer),
      cmocka_unit_test(test_mode_parse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
