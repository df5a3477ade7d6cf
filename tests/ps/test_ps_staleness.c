/* Issue 36: what a parameter server's pull returns and how stale the
 * gradients it applies are, with the trainers' steps scripted one by one
 * (1 server and 2 trainers as threads of one process, the toy model, SGD
 * without momentum, so the server's parameters after any set of pushes
 * are init - lr * (the sum of the gradients pushed), computed here in
 * double from the gradients the script made up):
 *  - ssp:1, trainer 0 two steps ahead: its pull for step 2 is deferred
 *    until trainer 1 finishes step 1, and then carries the parameters of
 *    that moment (trainer 1's update included), not those of when it
 *    arrived; every gradient's staleness is at most K + 1 = 2 steps, and
 *    the counts are those worked out by hand;
 *  - trainers of equal speed (alternating steps): ssp:2 counts exactly
 *    async's staleness (tolerance 0: the schedule is the same), with every
 *    trainer's parameters after every step the reference's;
 *  - DDP_PS_SNAPSHOT (async, trainer 0 stops while trainer 1 still has
 *    steps to make): the file holds the server's parameters of the moment
 *    trainer 0 stopped, and is not rewritten by trainer 1's steps after it
 *    or its own stop; with DDP_PS_SNAPSHOT_STEP=2, those of when the
 *    slowest trainer finished step 2. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "ps/ps_internal.h"
#include "ps/server_internal.h"

enum { TRAINERS = 2, SEED = 5 };
#define LR 0.1

/* A trainer thread runs the steps the main thread hands it, one at a time. */
typedef struct trainer {
  int rank;
  ddp_ps_options ps;
  ddp_store *store;
  ddp_model *model;
  ddp_ps_client *client;
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int asked, done; /* steps handed over, steps finished */
  bool bound, quit; /* bound: its first pull (the initial parameters) is in */
  const float *grad; /* the gradient of the step handed over (all parameters) */
  ddp_status status;
  char error[1024];
} trainer;

typedef struct world {
  ddp_ps_options ps;
  ddp_store *store;
  ddp_model *server_model;
  ddp_ps_server *server;
  pthread_t server_th;
  ddp_status server_status;
  char server_error[1024];
  ddp__ps_staleness staleness;
  trainer tr[TRAINERS];
  int64_t n; /* parameter elements */
  double *ref; /* (n): the reference parameters, init - lr * sum of pushed gradients */
} world;

static ddp_status start_agent(const ddp_ps_options *ps, ddp_store *store, int rank,
                              ddp_rpc_agent **agent) {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(ps, rank, name);
  ddp_rpc_options ro = ddp_rpc_defaults();
  ro.name = name;
  ro.rank = rank;
  ro.world_size = ps->num_servers + ps->num_trainers;
  ro.store = store;
  ro.num_threads = 2;
  ro.init_timeout_s = 60;
  return ddp_rpc_init(&ro, agent);
}

static void *server_main(void *p) {
  world *w = p;
  ddp_rpc_agent *agent = NULL;
  ddp_status s = start_agent(&w->ps, w->store, 0, &agent);
  if (s == DDP_OK) s = ddp_ps_server_serve(w->server, agent, NULL);
  if (s != DDP_OK) snprintf(w->server_error, sizeof w->server_error, "%s", ddp_last_error());
  w->server_status = s;
  ddp__ps_server_staleness(w->server, &w->staleness);
  ddp_rpc_shutdown(agent, true, 30);
  return NULL;
}

/* One step as the strategy makes it, with the gradient given: every
 * parameter pushed, then the pull (which returns once the server answers). */
static ddp_status run_step(trainer *t, const float *grad) {
  const int64_t step = ddp_ps_client_step(t->client);
  memcpy(ddp_model_grads_flat(t->model), grad,
         (size_t)ddp_model_num_param_elements(t->model) * sizeof(float));
  for (int32_t i = 0; i < ddp_model_num_params(t->model); i++)
    ddp_ps_client_push(t->client, i, step, LR);
  return ddp_ps_client_end_step(t->client, LR);
}

static void *trainer_main(void *p) {
  trainer *t = p;
  ddp_rpc_agent *agent = NULL;
  int64_t base = -1;
  ddp_status s = start_agent(&t->ps, t->store, t->rank, &agent);
  if (s == DDP_OK) s = ddp_ps_client_attach(t->client, agent);
  if (s == DDP_OK) s = ddp_ps_client_bind(t->client, t->model, &base);
  pthread_mutex_lock(&t->mu);
  t->bound = true;
  pthread_cond_broadcast(&t->cv);
  for (;;) {
    while (s == DDP_OK && !t->quit && t->asked == t->done) pthread_cond_wait(&t->cv, &t->mu);
    if (s != DDP_OK || t->quit) break;
    const float *grad = t->grad;
    pthread_mutex_unlock(&t->mu);
    s = run_step(t, grad);
    pthread_mutex_lock(&t->mu);
    t->done++;
    pthread_cond_broadcast(&t->cv);
  }
  if (s != DDP_OK) snprintf(t->error, sizeof t->error, "trainer rank %d: %s", t->rank, ddp_last_error());
  t->status = s;
  t->done = INT32_MAX; /* nothing more will finish */
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  if (agent) (void)ddp_ps_client_finish(t->client);
  ddp_rpc_shutdown(agent, true, 30);
  return NULL;
}

static void start_world(world *w, ddp_ps_mode mode, int32_t staleness) {
  memset(w, 0, sizeof *w);
  w->ps = (ddp_ps_options){.num_servers = 1, .num_trainers = TRAINERS, .mode = mode,
                           .staleness = staleness, .timeout_s = 60};
  assert_int_equal(ddp_store_mem_create(NULL, &w->store), DDP_OK);
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &w->server_model), DDP_OK);
  ddp_train_options to = ddp_train_defaults();
  to.optim.lr = LR;
  to.optim.sgd.momentum = 0;
  ddp_ps_server_options so = {.ps = w->ps, .index = 0, .optim = to.optim};
  assert_int_equal(ddp_ps_server_create(&w->server, w->server_model, &so), DDP_OK);
  w->n = ddp_model_num_param_elements(w->server_model);
  w->ref = calloc((size_t)w->n, sizeof *w->ref);
  assert_non_null(w->ref);
  for (int64_t e = 0; e < w->n; e++) w->ref[e] = ddp_model_params_flat(w->server_model)[e];
  for (int k = 0; k < TRAINERS; k++) {
    trainer *t = &w->tr[k];
    *t = (trainer){.rank = 1 + k, .ps = w->ps, .store = w->store};
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    assert_int_equal(ddp_model_build("toy", NULL, SEED, &t->model), DDP_OK);
    assert_int_equal(ddp_ps_client_create(&t->client, &w->ps, k), DDP_OK);
  }
  assert_int_equal(pthread_create(&w->server_th, NULL, server_main, w), 0);
  for (int k = 0; k < TRAINERS; k++)
    assert_int_equal(pthread_create(&w->tr[k].th, NULL, trainer_main, &w->tr[k]), 0);
  /* Every trainer holds the initial parameters before the script starts
   * (a bind after another's step would pull its update). */
  for (int k = 0; k < TRAINERS; k++) {
    trainer *t = &w->tr[k];
    pthread_mutex_lock(&t->mu);
    while (!t->bound) pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
  }
}

/* Hands trainer k a step with gradient `grad` and adds it to the reference. */
static void ask_step(world *w, int k, const float *grad) {
  trainer *t = &w->tr[k];
  pthread_mutex_lock(&t->mu);
  t->grad = grad;
  t->asked++;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* Waits (at most 30 s) for trainer k's steps handed over to finish. */
static void wait_steps(world *w, int k) {
  trainer *t = &w->tr[k];
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 30;
  pthread_mutex_lock(&t->mu);
  int rc = 0;
  while (t->done < t->asked && rc == 0) rc = pthread_cond_timedwait(&t->cv, &t->mu, &until);
  const bool ok = t->done != INT32_MAX && t->done >= t->asked;
  pthread_mutex_unlock(&t->mu);
  if (!ok) fail_msg("trainer %d: its step did not finish (%s)", k, t->error[0] ? t->error : "timeout");
}

/* Whether trainer k's pull waits at the server (polled for at most 30 s). */
static void wait_deferred(world *w, int k) {
  for (int i = 0; i < 30000; i++) {
    pthread_mutex_lock(&w->server->mu);
    const bool deferred = w->server->trainers[k].pull_reply != NULL;
    pthread_mutex_unlock(&w->server->mu);
    if (deferred) return;
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  fail_msg("trainer %d's pull never waited at the server", k);
}

static bool step_finished(world *w, int k) {
  pthread_mutex_lock(&w->tr[k].mu);
  const bool done = w->tr[k].done >= w->tr[k].asked;
  pthread_mutex_unlock(&w->tr[k].mu);
  return done;
}

/* Largest |trainer k's parameters - ref|, relative to the largest |ref|. */
static double error_against(world *w, int k, const double *ref) {
  const float *p = ddp_model_params_flat(w->tr[k].model);
  double err = 0, big = 0;
  for (int64_t e = 0; e < w->n; e++) {
    err = fmax(err, fabs(p[e] - ref[e]));
    big = fmax(big, fabs(ref[e]));
  }
  return err / big;
}

static void add_to_ref(world *w, const float *grad) {
  for (int64_t e = 0; e < w->n; e++) w->ref[e] -= LR * grad[e];
}

static void stop_world(world *w) {
  /* All at once: a graceful RPC shutdown is collective. */
  for (int k = 0; k < TRAINERS; k++) {
    trainer *t = &w->tr[k];
    pthread_mutex_lock(&t->mu);
    t->quit = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
  }
  for (int k = 0; k < TRAINERS; k++) pthread_join(w->tr[k].th, NULL);
  pthread_join(w->server_th, NULL);
  for (int k = 0; k < TRAINERS; k++)
    if (w->tr[k].status != DDP_OK) fail_msg("%s", w->tr[k].error);
  if (w->server_status != DDP_OK) fail_msg("server: %s", w->server_error);
  for (int k = 0; k < TRAINERS; k++) {
    ddp_ps_client_destroy(w->tr[k].client);
    ddp_model_destroy(w->tr[k].model);
    pthread_mutex_destroy(&w->tr[k].mu);
    pthread_cond_destroy(&w->tr[k].cv);
  }
  ddp_ps_server_destroy(w->server);
  ddp_model_destroy(w->server_model);
  ddp_store_destroy(w->store);
  free(w->ref);
}

/* Gradient number `which`: values in [-1, 1) from a fixed LCG. */
static float *make_grad(int64_t n, uint64_t which) {
  float *g = malloc((size_t)n * sizeof *g);
  assert_non_null(g);
  uint64_t x = 0x9e3779b97f4a7c15ull * (which + 1);
  for (int64_t e = 0; e < n; e++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    g[e] = (float)((double)(x >> 11) * 0x1p-52 - 1.0);
  }
  return g;
}

static void test_deferred_pull_is_current(void **state) {
  (void)state;
  world w;
  start_world(&w, DDP_PS_SSP, 1);
  const int32_t tensors = ddp_model_num_params(w.server_model);
  float *g01 = make_grad(w.n, 1), *g02 = make_grad(w.n, 2), *g11 = make_grad(w.n, 3);
  /* Trainer 0, step 1: answered at once (ssp:1 lets it be 1 step ahead). */
  ask_step(&w, 0, g01);
  wait_steps(&w, 0);
  add_to_ref(&w, g01);
  assert_true(error_against(&w, 0, w.ref) < 1e-6);
  /* Step 2: its pull needs the slowest to have finished step 1: it waits. */
  ask_step(&w, 0, g02);
  wait_deferred(&w, 0);
  add_to_ref(&w, g02);
  assert_false(step_finished(&w, 0));
  double *arrived = malloc((size_t)w.n * sizeof *arrived); /* the parameters as it arrived */
  assert_non_null(arrived);
  memcpy(arrived, w.ref, (size_t)w.n * sizeof *arrived);
  /* Trainer 1's step 1 releases it; the reply carries trainer 1's update. */
  ask_step(&w, 1, g11);
  wait_steps(&w, 1);
  wait_steps(&w, 0);
  add_to_ref(&w, g11);
  const double err = error_against(&w, 0, w.ref), err_arrived = error_against(&w, 0, arrived);
  if (!(err < 1e-6))
    fail_msg("trainer 0's deferred pull: max|p - current| = %g of the largest (%s)", err,
             err_arrived < 1e-6 ? "it carried the parameters of when it arrived"
                                : "neither those of when it arrived");
  assert_true(err_arrived > 1e-3); /* the two differ by lr * g11: the check can tell them apart */
  assert_true(error_against(&w, 1, w.ref) < 1e-6);
  stop_world(&w);
  /* Per tensor: t0 step 1 (pulled at clock min 0, nothing missed): 1 step,
   * 0 updates; t0 step 2 (pulled after its step 1, min 0): 2 steps, 0
   * updates; t1 step 1 (pulled at bind, min 0; t0's 2 updates since): 1
   * step, 2 updates. */
  const ddp__ps_staleness *st = &w.staleness;
  assert_int_equal(st->pushes, 3 * tensors);
  assert_int_equal(st->steps[1], 2 * tensors);
  assert_int_equal(st->steps[2], tensors);
  assert_int_equal(st->max_steps, 2); /* K + 1 */
  assert_int_equal(st->updates[0], 2 * tensors);
  assert_int_equal(st->updates[2], tensors);
  free(arrived);
  free(g01);
  free(g02);
  free(g11);
}

/* Trainers of equal speed: each round trainer 0 makes a step, then
 * trainer 1. Every trainer's parameters after its step are the
 * reference's (every pull current), and the staleness counted. */
static void run_alternating(ddp_ps_mode mode, int32_t staleness, int rounds,
                            ddp__ps_staleness *out) {
  world w;
  start_world(&w, mode, staleness);
  float **g = calloc((size_t)(2 * rounds), sizeof *g);
  assert_non_null(g);
  for (int r = 0; r < rounds; r++)
    for (int k = 0; k < TRAINERS; k++) {
      float *grad = g[2 * r + k] = make_grad(w.n, (uint64_t)(100 + 2 * r + k));
      ask_step(&w, k, grad);
      wait_steps(&w, k);
      add_to_ref(&w, grad);
      const double err = error_against(&w, k, w.ref);
      if (!(err < 1e-5)) fail_msg("%s, round %d, trainer %d: max|p - ref| = %g of the largest",
                                  ddp_ps_mode_name(mode), r, k, err);
    }
  stop_world(&w);
  *out = w.staleness;
  for (int i = 0; i < 2 * rounds; i++) free(g[i]);
  free(g);
}

static void test_equal_speed_matches_async(void **state) {
  (void)state;
  enum { ROUNDS = 12 };
  ddp__ps_staleness a, s;
  run_alternating(DDP_PS_ASYNC, 0, ROUNDS, &a);
  run_alternating(DDP_PS_SSP, 2, ROUNDS, &s);
  ddp_model *m;
  assert_int_equal(ddp_model_build("toy", NULL, SEED, &m), DDP_OK);
  const int64_t tensors = ddp_model_num_params(m);
  ddp_model_destroy(m);
  /* By hand: trainer 0's step r (r >= 2) was pulled after its step r - 1,
   * before trainer 1's: min r - 2, 2 steps, trainer 1's step r - 1 missed;
   * trainer 1's step r was pulled after both made step r - 1: 1 step, trainer
   * 0's step r missed. Step 1: 1 step each; trainer 1 missed trainer 0's. */
  assert_int_equal(s.pushes, 2 * ROUNDS * tensors);
  assert_int_equal(s.steps[1], (ROUNDS + 1) * tensors);
  assert_int_equal(s.steps[2], (ROUNDS - 1) * tensors);
  assert_int_equal(s.updates[0], tensors);
  assert_int_equal(s.updates[1], (2 * ROUNDS - 1) * tensors);
  assert_true(s.max_steps <= 2 + 1);
  /* Tolerance 0: the same schedule counts the same in both modes. */
  assert_memory_equal(a.steps, s.steps, sizeof a.steps);
  assert_memory_equal(a.updates, s.updates, sizeof a.updates);
}

/* Polls (at most 30 s) until a trainer stopped stepping at the server. */
static void wait_training_over(world *w) {
  for (int i = 0; i < 30000; i++) {
    pthread_mutex_lock(&w->server->mu);
    const bool over = w->server->all_training_over;
    pthread_mutex_unlock(&w->server->mu);
    if (over) return;
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  fail_msg("no trainer's stop reached the server");
}

static void test_snapshot_at_first_stop(void **state) {
  (void)state;
  char path[] = "/tmp/ddp_ps_snapshot_XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  remove(path); /* the server writes it; an old file would hide a missing write */
  assert_int_equal(setenv("DDP_PS_SNAPSHOT", path, 1), 0);
  world w;
  start_world(&w, DDP_PS_ASYNC, 0);
  unsetenv("DDP_PS_SNAPSHOT"); /* read when the server is created */
  float *g[5];
  for (int i = 0; i < 5; i++) g[i] = make_grad(w.n, (uint64_t)(200 + i));
  /* Trainer 0 makes 2 steps, trainer 1 one, then trainer 0 stops. */
  ask_step(&w, 0, g[0]);
  wait_steps(&w, 0);
  ask_step(&w, 0, g[1]);
  wait_steps(&w, 0);
  ask_step(&w, 1, g[2]);
  wait_steps(&w, 1);
  for (int i = 0; i < 3; i++) add_to_ref(&w, g[i]);
  double *at_stop = malloc((size_t)w.n * sizeof *at_stop);
  assert_non_null(at_stop);
  memcpy(at_stop, w.ref, (size_t)w.n * sizeof *at_stop);
  pthread_mutex_lock(&w.tr[0].mu);
  w.tr[0].quit = true; /* its thread says done to the server */
  pthread_cond_broadcast(&w.tr[0].cv);
  pthread_mutex_unlock(&w.tr[0].mu);
  wait_training_over(&w);
  /* The tail: trainer 1 alone, 2 more steps, then it stops too. */
  for (int i = 3; i < 5; i++) {
    ask_step(&w, 1, g[i]);
    wait_steps(&w, 1);
    add_to_ref(&w, g[i]);
  }
  assert_true(error_against(&w, 1, w.ref) < 1e-5);
  double *final = malloc((size_t)w.n * sizeof *final);
  assert_non_null(final);
  memcpy(final, w.ref, (size_t)w.n * sizeof *final);
  const int64_t n = w.n;
  stop_world(&w); /* frees w.ref */
  assert_int_equal(w.staleness.stop_min, 1);
  assert_int_equal(w.staleness.stop_max, 2);
  ddp_model *snap;
  assert_int_equal(ddp_model_build("toy", NULL, SEED + 1, &snap), DDP_OK);
  if (ddp_model_load(snap, path) != DDP_OK) fail_msg("the snapshot: %s", ddp_last_error());
  const float *p = ddp_model_params_flat(snap);
  double err = 0, err_final = 0, big = 0;
  for (int64_t e = 0; e < n; e++) {
    err = fmax(err, fabs(p[e] - at_stop[e]));
    err_final = fmax(err_final, fabs(p[e] - final[e]));
    big = fmax(big, fabs(at_stop[e]));
  }
  if (!(err < 1e-6 * big))
    fail_msg("the snapshot: max|p - server's at the first stop| = %g (against the final "
             "parameters: %g)", err, err_final);
  assert_true(err_final > 1e-3 * big); /* the tail moved them: the check can tell */
  ddp_model_destroy(snap);
  remove(path);
  free(at_stop);
  free(final);
  for (int i = 0; i < 5; i++) free(g[i]);
}

/* DDP_PS_SNAPSHOT_STEP=2: the file holds the parameters of when the
 * slowest trainer finished step 2, not of the first stop after it. */
static void test_snapshot_at_step(void **state) {
  (void)state;
  char path[] = "/tmp/ddp_ps_snapshot_XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  remove(path);
  assert_int_equal(setenv("DDP_PS_SNAPSHOT", path, 1), 0);
  assert_int_equal(setenv("DDP_PS_SNAPSHOT_STEP", "2", 1), 0);
  world w;
  start_world(&w, DDP_PS_ASYNC, 0);
  unsetenv("DDP_PS_SNAPSHOT");
  unsetenv("DDP_PS_SNAPSHOT_STEP");
  float *g[5];
  for (int i = 0; i < 5; i++) g[i] = make_grad(w.n, (uint64_t)(300 + i));
  /* t0 steps 1, 2, 3 around t1's steps 1 and 2: the slowest finishes step
   * 2 with t1's second step, before t0's third. */
  const int who[5] = {0, 0, 1, 1, 0};
  double *at_step = malloc((size_t)w.n * sizeof *at_step);
  assert_non_null(at_step);
  for (int i = 0; i < 5; i++) {
    ask_step(&w, who[i], g[i]);
    wait_steps(&w, who[i]);
    add_to_ref(&w, g[i]);
    if (i == 3) memcpy(at_step, w.ref, (size_t)w.n * sizeof *at_step);
  }
  double *final = malloc((size_t)w.n * sizeof *final);
  assert_non_null(final);
  memcpy(final, w.ref, (size_t)w.n * sizeof *final);
  const int64_t n = w.n;
  stop_world(&w); /* frees w.ref */
  ddp_model *snap;
  assert_int_equal(ddp_model_build("toy", NULL, SEED + 1, &snap), DDP_OK);
  if (ddp_model_load(snap, path) != DDP_OK) fail_msg("the snapshot: %s", ddp_last_error());
  const float *p = ddp_model_params_flat(snap);
  double err = 0, err_final = 0, big = 0;
  for (int64_t e = 0; e < n; e++) {
    err = fmax(err, fabs(p[e] - at_step[e]));
    err_final = fmax(err_final, fabs(p[e] - final[e]));
    big = fmax(big, fabs(at_step[e]));
  }
  if (!(err < 1e-6 * big))
    fail_msg("the snapshot at step 2: max|p - server's then| = %g (against the final "
             "parameters: %g)", err, err_final);
  assert_true(err_final > 1e-3 * big);
  ddp_model_destroy(snap);
  remove(path);
  free(at_step);
  free(final);
  for (int i = 0; i < 5; i++) free(g[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_deferred_pull_is_current),
      cmocka_unit_test(test_equal_speed_matches_async),
      cmocka_unit_test(test_snapshot_at_first_stop),
      cmocka_unit_test(test_snapshot_at_step),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
