/* The distributed optimizer between worker processes.
 *
 * test_optimizers: SGD (with momentum), Adam and Adadelta stepping a
 * server's parameters through references, from gradients of distributed
 * backward passes, equal the same optimizer stepping a local copy of the
 * model on the same batches (the parameters fetched with to_here after
 * each step, within 1e-6 relative).
 *
 * test_concurrent_trainers: 3 trainers step the same server parameters at
 * once (forward, a pause, backward, step), the server keeping a copy of the
 * parameters each forward saw; after each backward the server recomputes
 * that context's gradient in one process from the copy and the batch: they
 * must agree, so no backward ever computed with parameters another
 * trainer's step changed after its forward. Without the gate that makes
 * steps wait for other contexts' pending backward passes this fails (the
 * pause makes steps land between forwards and backwards).
 *
 * test_steady_state_pool: after 3 warm-up steps (forward, distributed
 * backward, distributed optimizer step, context end), 20 more steps of the
 * same shapes take every context record and gradient buffer from the
 * workers' pools: the pools' allocations (each a ddp_alloc, counted by the
 * pool) do not grow on the trainer nor on the server, and the trainer's
 * ddp_alloc_count per step (the engine's messages and futures, which the
 * pool does not cover) is the same every step. DDP_DIST_POOL=0 (the pool
 * off) makes it fail. */
#include <pthread.h>

#include "ddp/rpc_autograd.h"
#include "rpc_autograd/memory_pool.h"
#include "rpc_test_util.h"

#define N 6
#define D_IN 8
#define D_H 5
#define D_OUT 3
#define NP 4

static ddp_rpc_agent *self_agent;
static ddp_tensor *server_params[NP]; /* w0's */
static ddp_rref *server_rrefs[NP];

static void make_params(ddp_tensor **p) {
  ddp_rng rng;
  ddp_rng_seed(&rng, 77);
  static const int64_t shapes[NP][2] = {{D_H, D_IN}, {D_H, 0}, {D_OUT, D_H}, {D_OUT, 0}};
  for (int i = 0; i < NP; i++) {
    int nd = shapes[i][1] ? 2 : 1;
    if (ddp_tensor_create(&p[i], DDP_FLOAT32, nd, shapes[i]) != DDP_OK) abort();
    for (int64_t k = 0; k < p[i]->numel; k++)
      ddp_tensor_f32(p[i])[k] = ddp_rng_uniform_range(&rng, -0.7f, 0.7f);
    p[i]->flags |= DDP_TENSOR_REQUIRES_GRAD;
  }
}

static void make_batch(uint64_t seed, float *x, int64_t *y) {
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int i = 0; i < N * D_IN; i++) x[i] = ddp_rng_uniform_range(&rng, -2, 2);
  for (int i = 0; i < N; i++) y[i] = (int64_t)ddp_rng_below(&rng, D_OUT);
}

static ddp_status model(ddp_tape *t, ddp_tensor *x, ddp_tensor *const *p, ddp_tensor **out) {
  ddp_tensor *h, *a;
  DDP_TRY(ddp_linear(t, x, p[0], p[1], &h));
  DDP_TRY(ddp_tanh(t, h, &a));
  return ddp_linear(t, a, p[2], p[3], out);
}

static ddp_status loss_of(ddp_tape *t, ddp_tensor *out, ddp_tensor *y, ddp_tensor **loss) {
  ddp_tensor *lp;
  DDP_TRY(ddp_log_softmax(t, out, &lp));
  return ddp_nll_loss(t, lp, y, loss);
}

static bool close_rel(const float *a, const float *b, int64_t n, double *err) {
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - (double)b[i];
    d = d < 0 ? -d : d;
    if (!(d == d)) return false;
    if (d > worst) worst = d;
    double m = b[i] < 0 ? -b[i] : b[i];
    if (m > scale) scale = m;
  }
  *err = scale > 0 ? worst / scale : worst;
  return worst <= 1e-6 * (scale > 0 ? scale : 1);
}

/* ---- The server (w0) ---------------------------------------------------------- */

/* What each forward saw, by context, for the concurrent test's check. */
#define MAX_SNAPSHOTS 4096
typedef struct snapshot {
  int64_t ctx_id;
  float x[N * D_IN];
  float p[NP][D_H * D_IN];
} snapshot;
static snapshot *snapshots;
static int n_snapshots;
static pthread_mutex_t model_mu = PTHREAD_MUTEX_INITIALIZER;

/* dist "fwd": the model on the batch; keeps a copy of the parameters. */
static ddp_status f_fwd(ddp_dist_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                        void *user) {
  (void)user;
  static _Thread_local ddp_tensor *out[1];
  pthread_mutex_lock(&model_mu);
  ddp_status s = model(ddp_dist_call_tape(call), args->tensors[0], server_params, &out[0]);
  if (s == DDP_OK && n_snapshots < MAX_SNAPSHOTS) {
    snapshot *sn = &snapshots[n_snapshots++];
    sn->ctx_id = ddp_dist_context_id(ddp_dist_call_context(call));
    memcpy(sn->x, ddp_tensor_f32(args->tensors[0]), sizeof sn->x);
    for (int i = 0; i < NP; i++)
      memcpy(sn->p[i], server_params[i]->data, (size_t)server_params[i]->numel * sizeof(float));
  }
  pthread_mutex_unlock(&model_mu);
  DDP_TRY(s);
  reply->tensors = out;
  reply->num_tensors = 1;
  return DDP_OK;
}

/* "params": a token per parameter. */
static pthread_mutex_t setup_mu = PTHREAD_MUTEX_INITIALIZER;

/* The server's references to its parameters, made once (a trainer may ask
 * before the server's own code runs). */
static void serve_setup(ddp_rpc_agent *a) {
  pthread_mutex_lock(&setup_mu);
  for (int i = 0; i < NP; i++) {
    ddp_rref_value v = {.ptr = server_params[i], .is_tensor = true};
    if (!server_rrefs[i] && ddp_rref_create_local(a, &v, "param", &server_rrefs[i]) != DDP_OK)
      abort();
  }
  pthread_mutex_unlock(&setup_mu);
}

static ddp_status f_params(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                           void *user) {
  (void)args, (void)user;
  static _Thread_local uint8_t tokens[NP][DDP_RREF_TOKEN_BYTES];
  serve_setup(ddp_rpc_call_agent(call));
  for (int i = 0; i < NP; i++) DDP_TRY(ddp_rref_fork(server_rrefs[i], tokens[i]));
  reply->payload = tokens;
  reply->payload_bytes = sizeof tokens;
  return DDP_OK;
}

/* "check": payload {ctx id, labels}: the context's gradients against one
 * process's from the parameters its forward saw. */
static ddp_status f_check(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)reply, (void)user;
  int64_t id;
  int64_t y[N];
  memcpy(&id, args->payload, sizeof id);
  memcpy(y, (const char *)args->payload + sizeof id, sizeof y);
  snapshot sn;
  bool found = false;
  pthread_mutex_lock(&model_mu);
  for (int i = n_snapshots - 1; i >= 0 && !found; i--)
    if (snapshots[i].ctx_id == id) sn = snapshots[i], found = true;
  pthread_mutex_unlock(&model_mu);
  if (!found) return ddp_error(DDP_ERR_NOTFOUND, "check: no forward of context %lld", (long long)id);
  ddp_dist_context *ctx;
  DDP_TRY(ddp_dist_context_retrieve(ddp_rpc_call_agent(call), id, &ctx));
  ddp_tensor p[NP], *pp[NP], tx, ty;
  float grads[NP][D_H * D_IN] = {{0}};
  for (int i = 0; i < NP; i++) {
    ddp_tensor_wrap(&p[i], DDP_FLOAT32, server_params[i]->ndim, server_params[i]->shape, sn.p[i]);
    p[i].flags |= DDP_TENSOR_REQUIRES_GRAD;
    p[i].grad = grads[i];
    pp[i] = &p[i];
  }
  ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){N, D_IN}, sn.x);
  ddp_tensor_wrap(&ty, DDP_INT64, 1, (int64_t[]){N}, y);
  ddp_tape *t;
  DDP_TRY(ddp_tape_create(&t, 1 << 16));
  ddp_tensor *out, *loss;
  ddp_status s = model(t, &tx, pp, &out);
  if (s == DDP_OK) s = loss_of(t, out, &ty, &loss);
  if (s == DDP_OK) s = ddp_backward(t, loss);
  ddp_tape_destroy(t);
  DDP_TRY(s);
  for (int i = 0; i < NP; i++) {
    const float *g = ddp_dist_get_gradient(ctx, server_params[i]);
    double err = 0;
    if (!g || !close_rel(g, grads[i], server_params[i]->numel, &err))
      return ddp_error(DDP_ERR_INTERNAL, "context %lld: parameter %d's gradient differs by %.3g "
                       "relative from the one its forward's parameters give: the backward saw "
                       "parameters changed after its forward", (long long)id, i, err);
  }
  return DDP_OK;
}

static void serve_teardown(void) {
  for (int i = 0; i < NP; i++) {
    ddp_rref_release(server_rrefs[i]);
    server_rrefs[i] = NULL;
  }
}

/* "wait_done" on a trainer: returns once the trainer's own work is over,
 * so the server keeps its references exactly as long as needed. */
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static bool done;
static void mark_done(void) {
  pthread_mutex_lock(&done_mu);
  done = true;
  pthread_cond_broadcast(&done_cv);
  pthread_mutex_unlock(&done_mu);
}
static ddp_status f_wait_done(ddp_rpc_call *call, const ddp_rpc_message *args,
                              ddp_rpc_message *reply, void *user) {
  (void)args, (void)reply, (void)user;
  pthread_mutex_lock(&done_mu);
  while (!done && ddp_rpc_call_time_left_s(call) > 0) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 20000000;
    ts.tv_sec += ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    pthread_cond_timedwait(&done_cv, &done_mu, &ts);
  }
  bool ok = done;
  pthread_mutex_unlock(&done_mu);
  return ok ? DDP_OK : ddp_error(DDP_ERR_TIMEOUT, "wait_done: the trainer did not finish");
}

/* ---- Trainers ---------------------------------------------------------------------- */

static ddp_status get_params(ddp_rref **refs) {
  ddp_rpc_message out;
  DDP_TRY(ddp_rpc_sync(self_agent, "w0", "params", NULL, 30, &out));
  ddp_status s = DDP_OK;
  for (int i = 0; i < NP && s == DDP_OK; i++)
    s = ddp_rref_from_token(self_agent, (const uint8_t *)out.payload + i * DDP_RREF_TOKEN_BYTES,
                            &refs[i]);
  ddp_rpc_message_free(&out);
  return s;
}

/* One distributed step on batch `seed`; pause_us between forward and backward. */
static ddp_status dist_step(ddp_dist_optimizer *opt, uint64_t seed, int pause_us, bool check) {
  float x[N * D_IN];
  int64_t y[N];
  make_batch(seed, x, y);
  ddp_tensor tx, ty;
  ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){N, D_IN}, x);
  ddp_tensor_wrap(&ty, DDP_INT64, 1, (int64_t[]){N}, y);
  ddp_dist_context *ctx;
  DDP_TRY(ddp_dist_context_begin(self_agent, &ctx));
  ddp_tensor *t[1] = {&tx}, *loss = NULL;
  ddp_rpc_message m = {.tensors = t, .num_tensors = 1};
  const ddp_rpc_message *out;
  ddp_status s = ddp_dist_rpc_sync(ctx, "w0", "fwd", &m, 30, &out);
  if (s == DDP_OK) s = loss_of(ddp_dist_context_tape(ctx), out->tensors[0], &ty, &loss);
  if (pause_us) rt_sleep_ms(pause_us / 1000);
  if (s == DDP_OK) s = ddp_dist_backward(ctx, loss);
  if (s == DDP_OK && check) {
    char buf[sizeof(int64_t) + sizeof y];
    int64_t id = ddp_dist_context_id(ctx);
    memcpy(buf, &id, sizeof id);
    memcpy(buf + sizeof id, y, sizeof y);
    ddp_rpc_message cm = {.payload = buf, .payload_bytes = sizeof buf};
    s = ddp_rpc_sync(self_agent, "w0", "check", &cm, 30, NULL);
  }
  if (s == DDP_OK) s = ddp_dist_optimizer_step(opt, ctx);
  ddp_status e = ddp_dist_context_end(ctx);
  return s != DDP_OK ? s : e;
}

typedef struct optim_case {
  ddp_optim_kind kind;
} optim_case;

/* w1: the distributed optimizer against a local one on a copy. */
static void optimizers_driver(rt_result *res) {
  static const ddp_optim_kind kinds[3] = {DDP_OPTIM_SGD, DDP_OPTIM_ADAM, DDP_OPTIM_ADADELTA};
  for (int k = 0; k < 3; k++) {
    ddp_optim_options o = ddp_optim_defaults(kinds[k]);
    if (kinds[k] == DDP_OPTIM_SGD) o.lr = 0.1, o.sgd.momentum = 0.9;
    if (kinds[k] == DDP_OPTIM_ADAM) o.lr = 0.01;
    ddp_rref *refs[NP] = {0};
    ddp_status s = get_params(refs);
    RT_CHECK(res, s == DDP_OK, "params: %s", ddp_last_error());
    /* The local copy starts from the server's current values. */
    ddp_tensor *local[NP];
    make_params(local);
    for (int i = 0; i < NP && s == DDP_OK; i++) {
      ddp_rpc_message v;
      s = ddp_rref_to_here(refs[i], 30, &v);
      if (s == DDP_OK) {
        memcpy(local[i]->data, v.tensors[0]->data, (size_t)local[i]->numel * 4);
        ddp_rpc_message_free(&v);
      }
      ddp_tensor_ensure_grad(local[i]);
    }
    ddp_optimizer *lopt[NP];
    for (int i = 0; i < NP; i++)
      ddp_optimizer_create(&lopt[i], &o, ddp_tensor_f32(local[i]), local[i]->grad,
                           (size_t)local[i]->numel);
    ddp_dist_optimizer *opt = NULL;
    if (s == DDP_OK) s = ddp_dist_optimizer_create(self_agent, &o, NP, refs, &opt);
    RT_CHECK(res, s == DDP_OK, "%s: create: %s", ddp_optim_kind_name(kinds[k]), ddp_last_error());
    for (int step = 0; step < 4 && s == DDP_OK; step++) {
      uint64_t seed = 1000 + (uint64_t)(k * 10 + step);
      s = dist_step(opt, seed, 0, false);
      RT_CHECK(res, s == DDP_OK, "%s step %d: %s", ddp_optim_kind_name(kinds[k]), step,
               ddp_last_error());
      /* The same step here. */
      float x[N * D_IN];
      int64_t y[N];
      make_batch(seed, x, y);
      ddp_tensor tx, ty, *out, *loss;
      ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){N, D_IN}, x);
      ddp_tensor_wrap(&ty, DDP_INT64, 1, (int64_t[]){N}, y);
      for (int i = 0; i < NP; i++) memset(local[i]->grad, 0, (size_t)local[i]->numel * 4);
      ddp_tape *t;
      ddp_tape_create(&t, 1 << 16);
      if (model(t, &tx, local, &out) || loss_of(t, out, &ty, &loss) || ddp_backward(t, loss))
        abort();
      ddp_tape_destroy(t);
      for (int i = 0; i < NP; i++) ddp_optimizer_step(lopt[i]);
      for (int i = 0; i < NP && s == DDP_OK; i++) {
        ddp_rpc_message v;
        s = ddp_rref_to_here(refs[i], 30, &v);
        RT_CHECK(res, s == DDP_OK, "to_here: %s", ddp_last_error());
        if (s != DDP_OK) break;
        double err = 0;
        RT_CHECK(res, close_rel(ddp_tensor_f32(v.tensors[0]), ddp_tensor_f32(local[i]),
                                local[i]->numel, &err),
                 "%s step %d: parameter %d differs from the local optimizer's by %.3g relative",
                 ddp_optim_kind_name(kinds[k]), step, i, err);
        ddp_rpc_message_free(&v);
      }
    }
    ddp_dist_optimizer_destroy(opt);
    for (int i = 0; i < NP; i++) {
      ddp_optimizer_destroy(lopt[i]);
      ddp_rref_release(refs[i]);
      ddp_tensor_destroy(local[i]);
    }
  }
}

/* Two workers: w0 serves until w1's driver (arg, a `driver`) is done; its
 * shutdown comes first, then ours meets it. */
typedef struct {
  void (*run)(rt_result *res);
} driver;

static void serve_and_drive(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size;
  self_agent = a;
  if (rank == 0) {
    serve_setup(a);
    ddp_rpc_message out;
    ddp_status s = ddp_rpc_sync(a, "w1", "wait_done", NULL, 120, &out);
    RT_CHECK(res, s == DDP_OK, "wait_done: %s", ddp_last_error());
    if (s == DDP_OK) ddp_rpc_message_free(&out);
    serve_teardown();
  } else {
    ((const driver *)arg)->run(res);
    mark_done();
  }
}

/* "pool_misses": the server's dist-autograd pool allocations so far. */
static ddp_status f_pool_misses(ddp_rpc_call *call, const ddp_rpc_message *args,
                                ddp_rpc_message *reply, void *user) {
  (void)args, (void)user;
  static _Thread_local uint64_t misses;
  misses = ddp__dist_pool_misses_of(ddp_rpc_call_agent(call));
  reply->payload = &misses;
  reply->payload_bytes = sizeof misses;
  return DDP_OK;
}

static void register_all(void) {
  if (!server_params[0]) make_params(server_params);
  if (!snapshots) snapshots = calloc(MAX_SNAPSHOTS, sizeof *snapshots);
  ddp_dist_register("fwd", f_fwd, NULL);
  ddp_rpc_register("params", f_params, NULL);
  ddp_rpc_register("check", f_check, NULL);
  ddp_rpc_register("wait_done", f_wait_done, NULL);
  ddp_rpc_register("pool_misses", f_pool_misses, NULL);
}

static void test_optimizers(void **state) {
  (void)state;
  register_all();
  rt_config cfg = {.threads = 2, .graceful = true};
  rt_run(2, &cfg, serve_and_drive, &(driver){optimizers_driver}, 120);
}

/* ---- Concurrent trainers ----------------------------------------------------------- */

#define TRAINERS 3
#define STEPS 25

static void concurrent_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  self_agent = a;
  if (rank == 0) {
    serve_setup(a);
    for (int t = 1; t <= TRAINERS; t++) {
      char name[8];
      snprintf(name, sizeof name, "w%d", t);
      ddp_rpc_message out;
      ddp_status s = ddp_rpc_sync(a, name, "wait_done", NULL, 120, &out);
      RT_CHECK(res, s == DDP_OK, "wait_done %s: %s", name, ddp_last_error());
      if (s == DDP_OK) ddp_rpc_message_free(&out);
    }
    res->value[0] = n_snapshots;
    serve_teardown();
    return;
  }
  ddp_rref *refs[NP] = {0};
  ddp_status s = get_params(refs);
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = 0.5; /* large steps: a stale backward would differ clearly */
  ddp_dist_optimizer *opt = NULL;
  if (s == DDP_OK) s = ddp_dist_optimizer_create(a, &o, NP, refs, &opt);
  RT_CHECK(res, s == DDP_OK, "setup: %s", ddp_last_error());
  for (int step = 0; step < STEPS && s == DDP_OK; step++) {
    s = dist_step(opt, (uint64_t)(rank * 1000 + step), 3000, true);
    RT_CHECK(res, s == DDP_OK, "trainer %d step %d: %s", rank, step, ddp_last_error());
  }
  ddp_dist_optimizer_destroy(opt);
  for (int i = 0; i < NP; i++) ddp_rref_release(refs[i]);
  mark_done();
}

static void test_concurrent_trainers(void **state) {
  (void)state;
  register_all();
  rt_config cfg = {.threads = 4, .graceful = true};
  rt_world w;
  assert_int_equal(rt_spawn(&w, TRAINERS + 1, &cfg, concurrent_fn, NULL, 125), 0);
  char err[1200];
  int bad = rt_wait(&w, 120, -1, err, sizeof err);
  if (bad) fail_msg("%d workers failed; %s", bad, err);
  assert_int_equal(w.results[0].value[0], TRAINERS * STEPS);
  munmap(w.results, sizeof(rt_result) * (size_t)w.size);
}

/* ---- The steady state allocates no context records nor buffers ---------------- */

#define WARM_STEPS 3
#define STEADY_STEPS 20

static ddp_status server_misses(uint64_t *m) {
  ddp_rpc_message out;
  DDP_TRY(ddp_rpc_sync(self_agent, "w0", "pool_misses", NULL, 30, &out));
  memcpy(m, out.payload, sizeof *m);
  ddp_rpc_message_free(&out);
  return DDP_OK;
}

static void pool_trainer(rt_result *res) {
  ddp_rref *refs[NP] = {0};
  ddp_status s = get_params(refs);
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.lr = 0.01;
  ddp_dist_optimizer *opt = NULL;
  if (s == DDP_OK) s = ddp_dist_optimizer_create(self_agent, &o, NP, refs, &opt);
  RT_CHECK(res, s == DDP_OK, "setup: %s", ddp_last_error());
  uint64_t mine0 = 0, server0 = 0, server1 = 0;
  uint64_t per_step[STEADY_STEPS] = {0};
  for (int step = 0; step < WARM_STEPS + STEADY_STEPS && s == DDP_OK; step++) {
    if (step == WARM_STEPS) {
      s = server_misses(&server0);
      mine0 = ddp__dist_pool_misses_of(self_agent);
    }
    uint64_t before = ddp_alloc_count();
    if (s == DDP_OK) s = dist_step(opt, (uint64_t)(500 + step), 0, false);
    if (step >= WARM_STEPS) per_step[step - WARM_STEPS] = ddp_alloc_count() - before;
    RT_CHECK(res, s == DDP_OK, "step %d: %s", step, ddp_last_error());
  }
  uint64_t mine = ddp__dist_pool_misses_of(self_agent) - mine0;
  if (s == DDP_OK) s = server_misses(&server1);
  RT_CHECK(res, s == DDP_OK, "pool_misses: %s", ddp_last_error());
  RT_CHECK(res, mine == 0, "the trainer's dist-autograd pool allocated %llu blocks in %d "
           "steady-state steps (expected none after %d warm-up steps)", (unsigned long long)mine,
           STEADY_STEPS, WARM_STEPS);
  RT_CHECK(res, server1 - server0 == 0, "the server's dist-autograd pool allocated %llu blocks "
           "in %d steady-state steps (expected none after %d warm-up steps)",
           (unsigned long long)(server1 - server0), STEADY_STEPS, WARM_STEPS);
  /* What is left per step is the engine's own (a message block per
   * received message, a future per call): the same count every step. */
  for (int i = 1; i < STEADY_STEPS && s == DDP_OK; i++)
    RT_CHECK(res, per_step[i] == per_step[0], "steady-state step %d made %llu allocations, "
             "step 0 %llu", i, (unsigned long long)per_step[i], (unsigned long long)per_step[0]);
  res->value[0] = (int64_t)per_step[0];
  print_message("trainer: %llu allocations a steady-state step (the engine's), pools %llu and "
                "%llu blocks in the steady state\n", (unsigned long long)per_step[0],
                (unsigned long long)mine, (unsigned long long)(server1 - server0));
  ddp_dist_optimizer_destroy(opt);
  for (int i = 0; i < NP; i++) ddp_rref_release(refs[i]);
}

static void test_steady_state_pool(void **state) {
  (void)state;
  register_all();
  rt_config cfg = {.threads = 2, .graceful = true};
  rt_run(2, &cfg, serve_and_drive, &(driver){pool_trainer}, 120);
}

static int setup(void **state) {
  (void)state;
  return rt_start_store();
}

static int teardown(void **state) {
  (void)state;
  for (int i = 0; i < NP; i++) ddp_tensor_destroy(server_params[i]);
  free(snapshots);
  rt_stop_store();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optimizers),
      cmocka_unit_test(test_concurrent_trainers),
      cmocka_unit_test(test_steady_state_pool),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
