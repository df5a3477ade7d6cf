/* The parameter server with its workers as threads of one process (an
 * in-memory store), through the trainer library: small enough for
 * ThreadSanitizer, which watches the server's lock, its deferred replies
 * and watches, and the clients, all on the RPC engine's threads.
 *  - sync, 3 trainers x batch 16 on seed 001's toy regression model (SGD
 *    with momentum, 2 epochs, 2 servers): every trainer ends with the
 *    parameters one process computes with batch 48 over the same samples
 *    (each step's three shards are the big batch's rows; equal sizes, so
 *    the mean of the means is the big batch's mean), issue 7's bound;
 *  - async and ssp:1 with 1 server: every trainer finishes all its steps
 *    and the server applied every push. */
#include <math.h>
#include <pthread.h>
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

enum { TRAINERS = 3, BATCH = 16, SAMPLES = 240, EPOCHS = 2, SEED = 5 };

typedef struct worker {
  int rank;
  ddp_ps_options ps;
  ddp_store *store;
  ddp_model *model;
  ddp_ps_server_stats stats;
  int64_t steps;
  int64_t pushes_in_backward, pushes_after;
  int32_t first_push;
  char error[1024];
} worker;

static ddp_train_options train_options(void) {
  ddp_train_options o = ddp_train_defaults();
  o.epochs = EPOCHS;
  o.batch_size = BATCH;
  o.optim.lr = 0.05;
  o.optim.sgd.momentum = 0.9;
  o.workers = 0;
  o.seed = 3;
  return o;
}

static ddp_status start_agent(worker *w, ddp_rpc_agent **agent) {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(&w->ps, w->rank, name);
  ddp_rpc_options ro = ddp_rpc_defaults();
  ro.name = name;
  ro.rank = w->rank;
  ro.world_size = w->ps.num_servers + w->ps.num_trainers;
  ro.store = w->store;
  ro.num_threads = 2;
  ro.init_timeout_s = 60;
  return ddp_rpc_init(&ro, agent);
}

static void *server_main(void *p) {
  worker *w = p;
  ddp_train_options to = train_options();
  ddp_ps_server_options so = {.ps = w->ps, .index = w->rank, .optim = to.optim};
  ddp_ps_server *srv = NULL;
  ddp_rpc_agent *agent = NULL;
  ddp_status s = ddp_ps_server_create(&srv, w->model, &so);
  if (s == DDP_OK) s = start_agent(w, &agent);
  if (s == DDP_OK) s = ddp_ps_server_serve(srv, agent, &w->stats);
  if (s != DDP_OK) snprintf(w->error, sizeof w->error, "server %d: %s", w->rank, ddp_last_error());
  ddp_rpc_shutdown(agent, true, 30);
  ddp_ps_server_destroy(srv);
  return NULL;
}

static void *trainer_main(void *p) {
  worker *w = p;
  ddp_dataset *train = NULL, *test = NULL;
  ddp_ps_client *c = NULL;
  ddp_rpc_agent *agent = NULL;
  ddp_trainer *t = NULL;
  ddp_train_result r = {0};
  ddp_status s = ddp_dataset_create_regression(&train, SAMPLES, SEED);
  if (s == DDP_OK) s = ddp_dataset_create_regression(&test, 64, SEED + 1);
  if (s == DDP_OK) s = ddp_ps_client_create(&c, &w->ps, w->rank - w->ps.num_servers);
  if (s == DDP_OK) s = start_agent(w, &agent);
  if (s == DDP_OK) s = ddp_ps_client_attach(c, agent);
  ddp_train_options o = train_options();
  o.param_server = c;
  if (s == DDP_OK) s = ddp_trainer_create(&t, w->model, train, test, NULL, &o);
  if (s == DDP_OK) s = ddp_trainer_run(t, &r);
  if (s != DDP_OK) snprintf(w->error, sizeof w->error, "trainer rank %d: %s", w->rank, ddp_last_error());
  w->steps = r.steps;
  if (c) ddp__ps_client_push_counts(c, &w->pushes_in_backward, &w->pushes_after, &w->first_push);
  ddp_train_result_free(&r);
  ddp_trainer_destroy(t);
  if (c && agent) (void)ddp_ps_client_finish(c);
  ddp_rpc_shutdown(agent, true, 30);
  ddp_ps_client_destroy(c);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  return NULL;
}

/* Runs S servers and TRAINERS trainers as threads; models[r] is rank r's. */
static void run_world(ddp_ps_options ps, worker *w, ddp_model **models) {
  ddp_store *store;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  const int world = ps.num_servers + ps.num_trainers;
  pthread_t th[8];
  for (int r = 0; r < world; r++) {
    w[r] = (worker){.rank = r, .ps = ps, .store = store, .model = models[r]};
    assert_int_equal(pthread_create(&th[r], NULL, r < ps.num_servers ? server_main : trainer_main,
                                    &w[r]), 0);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++)
    if (w[r].error[0]) fail_msg("%s", w[r].error);
  ddp_store_destroy(store);
}

static ddp_model **build_models(int n) {
  ddp_model **m = calloc((size_t)n, sizeof *m);
  for (int r = 0; r < n; r++) assert_int_equal(ddp_model_build("toy", NULL, SEED, &m[r]), DDP_OK);
  return m;
}

static void free_models(ddp_model **m, int n) {
  for (int r = 0; r < n; r++) ddp_model_destroy(m[r]);
  free(m);
}

static void test_sync_equals_big_batch(void **state) {
  (void)state;
  ddp_ps_options ps = {.num_servers = 2, .num_trainers = TRAINERS, .mode = DDP_PS_SYNC,
                       .timeout_s = 60};
  const int world = ps.num_servers + TRAINERS;
  ddp_model **models = build_models(world);
  worker w[8];
  run_world(ps, w, models);
  /* The reference: one process, batch 48, the same data and order. */
  ddp_model *ref;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &ref), DDP_OK);
  ddp_dataset *train, *test;
  assert_int_equal(ddp_dataset_create_regression(&train, SAMPLES, SEED), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&test, 64, SEED + 1), DDP_OK);
  ddp_train_options o = train_options();
  o.batch_size = BATCH * TRAINERS;
  ddp_trainer *t;
  ddp_train_result r;
  assert_int_equal(ddp_trainer_create(&t, ref, train, test, NULL, &o), DDP_OK);
  assert_int_equal(ddp_trainer_run(t, &r), DDP_OK);
  const int64_t steps = SAMPLES / (BATCH * TRAINERS) * EPOCHS;
  assert_int_equal(r.steps, steps);
  const int64_t n = ddp_model_num_param_elements(ref);
  for (int k = ps.num_servers; k < world; k++) {
    assert_int_equal(w[k].steps, steps);
    for (int i = 0; i < ddp_model_num_params(ref); i++) {
      const ddp_tensor *a = ddp_model_param(models[k], i), *b = ddp_model_param(ref, i);
      double err = 0, big = 0;
      for (int64_t e = 0; e < b->numel; e++) {
        err = fmax(err, fabs(ddp_tensor_f32(a)[e] - ddp_tensor_f32(b)[e]));
        big = fmax(big, fabs(ddp_tensor_f32(b)[e]));
      }
      if (err > 1e-4 * big + 1e-6)
        fail_msg("trainer rank %d, %s: max|a-b| = %g > %g", k, ddp_model_param_name(ref, i), err,
                 1e-4 * big + 1e-6);
    }
    /* Every gradient left from backward's hook as it became final, the
     * last layer's first (net2 is parameters 2 and 3): the pushes overlap
     * the rest of backward. */
    assert_int_equal(w[k].pushes_in_backward, steps * ddp_model_num_params(ref));
    assert_int_equal(w[k].pushes_after, 0);
    assert_true(w[k].first_push >= 2);
    /* Every trainer holds the same model. */
    assert_memory_equal(ddp_model_params_flat(models[k]), ddp_model_params_flat(models[ps.num_servers]),
                        (size_t)n * sizeof(float));
  }
  /* Each server: one update per owned tensor per step. */
  assert_int_equal(w[0].stats.updates + w[1].stats.updates, steps * ddp_model_num_params(ref));
  ddp_train_result_free(&r);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(ref);
  free_models(models, world);
}

static void run_mode(ddp_ps_mode mode, int32_t staleness) {
  ddp_ps_options ps = {.num_servers = 1, .num_trainers = TRAINERS, .mode = mode,
                       .staleness = staleness, .timeout_s = 60};
  const int world = 1 + TRAINERS;
  ddp_model **models = build_models(world);
  worker w[8];
  run_world(ps, w, models);
  const int64_t steps = SAMPLES / TRAINERS / BATCH * EPOCHS;
  for (int k = 1; k < world; k++) assert_int_equal(w[k].steps, steps);
  /* Every push applied: trainers x steps x tensors. */
  assert_int_equal(w[0].stats.updates, TRAINERS * steps * ddp_model_num_params(models[0]));
  assert_int_equal(w[0].stats.trainers_done, TRAINERS);
  free_models(models, world);
}

static void test_async(void **state) {
  (void)state;
  run_mode(DDP_PS_ASYNC, 0);
}

static void test_ssp(void **state) {
  (void)state;
  run_mode(DDP_PS_SSP, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sync_equals_big_batch),
      cmocka_unit_test(test_async),
      cmocka_unit_test(test_ssp),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
