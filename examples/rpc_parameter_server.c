/* Seed 001's parameter-server program in C (torch.distributed.rpc,
 * distributed autograd and DistributedOptimizer; the reference is
 * ../shared/refs/torch_rpc_parameter_server.py). Rank 0, "parameter_server",
 * holds the tutorial's network (ddp's psnet); ranks 1..T, "trainer_1", ...,
 * each make a reference to the server's ParameterServer with ddp_rref_remote,
 * get references to its parameters, and walk the whole training set
 * (shuffled, batch 32): forward on the server through the reference within a
 * distributed autograd context, the NLL loss here, a distributed backward
 * and a distributed SGD step (lr 0.03) on the server. The server drives the
 * trainers (one call each, as the reference's rpc_async(run_trainer)) and,
 * when they are done, evaluates its network in evaluation mode on the test
 * set and prints, as the reference does:
 *
 *   ddp rpc_ps trainers=T epochs=E steps=S samples_per_s=X test_accuracy=A
 *
 * Run with ddprun (the server and one trainer; a larger world, more trainers):
 *   build/bin/ddprun --nproc-per-node 2 build/bin/rpc_parameter_server [--epochs 1]
 * or by hand as the seed does (MASTER_ADDR/MASTER_PORT, default localhost:29500):
 *   build/bin/rpc_parameter_server --rank 0 --world-size 2 &
 *   build/bin/rpc_parameter_server --rank 1 --world-size 2
 * Options: --epochs E (1), --max-steps N per trainer (0: whole epochs),
 * --batch B (32), --lr X (0.03), --seed S (0), --init FILE (initial weights
 * from the reference's --save-init), --data DIR (Fashion-MNIST), --eval-samples N
 * (the test set's first N; 0: all), --threads N
 * (RPC pool), --timeout S (the trainers' whole run, 7200).
 *
 * Several trainers step the same parameters: a step waits until no other
 * trainer's backward still needs the values its forward used (docs/rpc.md,
 * "Parameters a backward needs"), so every backward sees the parameters its
 * own forward saw. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/rpc.h"
#include "ddp/rpc_autograd.h"

#define CHECK(expr)                                                                   \
  do {                                                                                \
    ddp_status s_ = (expr);                                                           \
    if (s_ != DDP_OK) {                                                               \
      fprintf(stderr, "rpc_parameter_server: %s: %s\n", #expr, ddp_last_error());     \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

typedef struct options {
  int rank, world_size, threads;
  int64_t epochs, max_steps, batch, eval_samples;
  double lr, timeout_s;
  uint64_t seed;
  char init[512], data[512];
} options;

static options parse(int argc, char **argv) {
  options o = {.rank = -1, .world_size = -1, .epochs = 1, .batch = 32, .lr = 0.03,
               .timeout_s = 7200, .data = "/usr/share/datasets/fashion-mnist"};
  int i = 1;
  for (; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--rank")) o.rank = atoi(v);
    else if (!strcmp(k, "--world-size")) o.world_size = atoi(v);
    else if (!strcmp(k, "--epochs")) o.epochs = atoll(v);
    else if (!strcmp(k, "--max-steps")) o.max_steps = atoll(v);
    else if (!strcmp(k, "--eval-samples")) o.eval_samples = atoll(v);
    else if (!strcmp(k, "--batch")) o.batch = atoll(v);
    else if (!strcmp(k, "--lr")) o.lr = atof(v);
    else if (!strcmp(k, "--seed")) o.seed = strtoull(v, NULL, 10);
    else if (!strcmp(k, "--threads")) o.threads = atoi(v);
    else if (!strcmp(k, "--timeout")) o.timeout_s = atof(v);
    else if (!strcmp(k, "--init")) snprintf(o.init, sizeof o.init, "%s", v);
    else if (!strcmp(k, "--data")) snprintf(o.data, sizeof o.data, "%s", v);
    else break;
  }
  if (i != argc || o.epochs < 1 || o.batch < 1 || o.max_steps < 0 || o.eval_samples < 0 ||
      !(o.lr > 0) ||
      !(o.timeout_s > 0)) {
    fprintf(stderr, "usage: rpc_parameter_server [--rank R --world-size W] [--epochs E] "
                    "[--max-steps N] [--batch B] [--lr X] [--seed S] [--init FILE] [--data DIR] "
                    "[--eval-samples N] [--threads N] [--timeout S]\n");
    exit(2);
  }
  return o;
}

static options opts;

/* ---- The server's side ------------------------------------------------------
 * ParameterServer: the network, its forward serialised (the model's dropout
 * generator and the tape's bookkeeping on its parameters are not for two
 * threads at once), and references to its parameters. */
typedef struct parameter_server {
  ddp_model *model;
  pthread_mutex_t mu;
  ddp_rref *params[16];
  int num_params;
} parameter_server;

static parameter_server *server;
static pthread_mutex_t server_mu = PTHREAD_MUTEX_INITIALIZER;

/* What a trainer sends to create it: the seed and the initial weights. */
typedef struct create_args {
  uint64_t seed;
  char init[512];
} create_args;

/* ctor "ps.create" (get_parameter_server): one server however many
 * trainers ask; it lives until the process ends. */
static ddp_status ps_create(ddp_rpc_call *call, const ddp_rpc_message *args,
                            ddp_rref_value *out, void *user) {
  (void)user;
  if (args->payload_bytes != sizeof(create_args))
    return ddp_error(DDP_ERR_INVALID, "ps.create: payload of %zu bytes, expected %zu",
                     args->payload_bytes, sizeof(create_args));
  create_args a;
  memcpy(&a, args->payload, sizeof a);
  a.init[sizeof a.init - 1] = '\0';
  ddp_status s = DDP_OK;
  pthread_mutex_lock(&server_mu);
  if (!server) {
    parameter_server *ps = ddp_calloc(1, sizeof *ps);
    if (!ps) s = ddp_error(DDP_ERR_NOMEM, "ps.create: out of memory");
    if (s == DDP_OK) s = ddp_model_build("psnet", NULL, a.seed, &ps->model);
    if (s == DDP_OK && a.init[0]) s = ddp_model_load(ps->model, a.init);
    ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
    for (int i = 0; s == DDP_OK && i < ddp_model_num_params(ps->model); i++) {
      ddp_rref_value v = {.ptr = ddp_model_param(ps->model, i), .is_tensor = true};
      s = ddp_rref_create_local(agent, &v, ddp_model_param_name(ps->model, i), &ps->params[i]);
      ps->num_params = i + 1;
    }
    if (s == DDP_OK) {
      pthread_mutex_init(&ps->mu, NULL);
      server = ps;
    } else if (ps) {
      for (int i = 0; i < ps->num_params; i++) ddp_rref_release(ps->params[i]);
      ddp_model_destroy(ps->model);
      ddp_free(ps);
    }
  }
  pthread_mutex_unlock(&server_mu);
  if (s != DDP_OK) return s;
  *out = (ddp_rref_value){.ptr = server};
  return DDP_OK;
}

/* method "ps.param_rrefs" (get_param_rrefs): a token per parameter. */
static ddp_status ps_param_rrefs(ddp_rpc_call *call, void *value, const ddp_rpc_message *args,
                                 ddp_rpc_message *reply, void *user) {
  (void)call, (void)args, (void)user;
  parameter_server *ps = value;
  static _Thread_local uint8_t tokens[16][DDP_RREF_TOKEN_BYTES];
  for (int i = 0; i < ps->num_params; i++) DDP_TRY(ddp_rref_fork(ps->params[i], tokens[i]));
  reply->payload = tokens;
  reply->payload_bytes = (size_t)ps->num_params * DDP_RREF_TOKEN_BYTES;
  return DDP_OK;
}

/* dist function "ps.forward" on the server's reference: the network on the
 * trainer's batch, recorded on this call's tape. */
static ddp_status ps_forward(ddp_dist_call *call, const ddp_rpc_message *args,
                             ddp_rpc_message *reply, void *user) {
  (void)user;
  parameter_server *ps = ddp_dist_call_value(call);
  if (!ps || args->num_tensors != 1)
    return ddp_error(DDP_ERR_INVALID, "ps.forward: one input tensor on the server's reference");
  static _Thread_local ddp_tensor *out[1];
  pthread_mutex_lock(&ps->mu);
  ddp_status s = ddp_model_forward(ps->model, ddp_dist_call_tape(call), args->tensors[0], &out[0]);
  pthread_mutex_unlock(&ps->mu);
  DDP_TRY(s);
  reply->tensors = out;
  reply->num_tensors = 1;
  return DDP_OK;
}

/* The test set through the server's network in evaluation mode. */
static double evaluate(parameter_server *ps) {
  ddp_dataset *test;
  CHECK(ddp_dataset_open_idx_dir(&test, opts.data, DDP_SPLIT_TEST));
  if (opts.eval_samples) CHECK(ddp_dataset_truncate(test, opts.eval_samples));
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = 1000;
  lc.normalize = true, lc.mean = 0.1307f, lc.std = 0.3081f;
  ddp_loader *loader;
  CHECK(ddp_loader_create(&loader, test, &lc));
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 24));
  ddp_tape_set_grad_enabled(tape, false);
  pthread_mutex_lock(&ps->mu);
  ddp_model_train(ps->model, false); /* the reference's ps.set_train(False) */
  int64_t correct = 0, total = 0;
  CHECK(ddp_loader_start_epoch(loader, 0));
  for (;;) {
    ddp_batch b;
    CHECK(ddp_loader_next(loader, &b));
    if (b.size == 0) break;
    ddp_tensor *out;
    ddp_tape_reset(tape);
    CHECK(ddp_model_forward(ps->model, tape, &b.x, &out));
    const float *o = ddp_tensor_f32(out); /* (size, 10) */
    for (int64_t i = 0; i < b.size; i++) {
      int64_t best = 0;
      for (int64_t c = 1; c < 10; c++)
        if (o[i * 10 + c] > o[i * 10 + best]) best = c;
      correct += best == ddp_tensor_i64(&b.y)[i];
    }
    total += b.size;
  }
  ddp_model_train(ps->model, true);
  pthread_mutex_unlock(&ps->mu);
  ddp_tape_destroy(tape);
  ddp_loader_destroy(loader);
  ddp_dataset_destroy(test);
  return (double)correct / (double)total;
}

/* ---- A trainer ------------------------------------------------------------------ */

typedef struct run_args {
  int64_t epochs, max_steps, batch;
  double lr;
  uint64_t seed;
  char init[512];
} run_args;

static _Thread_local int64_t steps_reply;

/* "trainer.run" (run_trainer), called by the server: trains and replies
 * with the number of steps. */
static ddp_status trainer_run(ddp_rpc_call *call, const ddp_rpc_message *args,
                              ddp_rpc_message *reply, void *user) {
  (void)user;
  if (args->payload_bytes != sizeof(run_args))
    return ddp_error(DDP_ERR_INVALID, "trainer.run: payload of %zu bytes, expected %zu",
                     args->payload_bytes, sizeof(run_args));
  run_args a;
  memcpy(&a, args->payload, sizeof a);
  ddp_rpc_agent *agent = ddp_rpc_call_agent(call);
  int rank = ddp_rpc_self(agent)->rank;

  /* ps = rpc.remote("parameter_server", get_parameter_server, ...) */
  create_args ca = {.seed = a.seed};
  memcpy(ca.init, a.init, sizeof ca.init);
  ddp_rpc_message cm = {.payload = &ca, .payload_bytes = sizeof ca};
  ddp_rref *ps;
  DDP_TRY(ddp_rref_remote(agent, "parameter_server", "ps.create", &cm, -1, &ps));
  /* params = remote_method(ParameterServer.get_param_rrefs, ps) */
  ddp_rpc_message tokens;
  ddp_status s = ddp_rref_rpc_sync(ps, "ps.param_rrefs", NULL, -1, &tokens);
  ddp_rref *params[16] = {0};
  int n = s == DDP_OK ? (int)(tokens.payload_bytes / DDP_RREF_TOKEN_BYTES) : 0;
  for (int i = 0; i < n && s == DDP_OK; i++)
    s = ddp_rref_from_token(agent, (const uint8_t *)tokens.payload + i * DDP_RREF_TOKEN_BYTES,
                            &params[i]);
  ddp_rpc_message_free(&tokens);
  /* opt = DistributedOptimizer(optim.SGD, params, lr=a.lr) */
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = a.lr;
  ddp_dist_optimizer *opt = NULL;
  if (s == DDP_OK) s = ddp_dist_optimizer_create(agent, &sgd, n, params, &opt);

  ddp_dataset *train = NULL;
  ddp_loader *loader = NULL;
  if (s == DDP_OK) s = ddp_dataset_open_idx_dir(&train, opts.data, DDP_SPLIT_TRAIN);
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = a.batch;
  lc.shuffle = true;
  lc.seed = a.seed + (uint64_t)rank; /* the reference's generator seed a.seed + rank */
  lc.normalize = true, lc.mean = 0.1307f, lc.std = 0.3081f;
  lc.num_workers = 1;
  if (s == DDP_OK) s = ddp_loader_create(&loader, train, &lc);

  int64_t steps = 0;
  for (int64_t epoch = 0; s == DDP_OK && epoch < a.epochs; epoch++) {
    s = ddp_loader_start_epoch(loader, epoch);
    for (;;) {
      ddp_batch b;
      if (s == DDP_OK) s = ddp_loader_next(loader, &b);
      if (s != DDP_OK || b.size == 0) break;
      /* with dist_autograd.context() as cid: */
      ddp_dist_context *ctx;
      s = ddp_dist_context_begin(agent, &ctx);
      if (s != DDP_OK) break;
      ddp_tensor *x[1] = {&b.x}, *loss = NULL;
      ddp_rpc_message fm = {.tensors = x, .num_tensors = 1};
      const ddp_rpc_message *out;
      s = ddp_dist_rref_call(ctx, ps, "ps.forward", &fm, -1, &out);
      if (s == DDP_OK) s = ddp_nll_loss(ddp_dist_context_tape(ctx), out->tensors[0], &b.y, &loss);
      if (s == DDP_OK) s = ddp_dist_backward(ctx, loss);
      if (s == DDP_OK) s = ddp_dist_optimizer_step(opt, ctx);
      ddp_status e = ddp_dist_context_end(ctx);
      if (s == DDP_OK) s = e;
      if (s == DDP_OK && ++steps % 500 == 0)
        fprintf(stderr, "trainer_%d: step %lld loss %.4f\n", rank, (long long)steps,
                (double)ddp_tensor_f32(loss)[0]);
      if (s != DDP_OK || (a.max_steps && steps >= a.max_steps)) break;
    }
    if (a.max_steps && steps >= a.max_steps) break;
  }
  if (s != DDP_OK) s = ddp_error_wrap(s, "trainer_%d at step %lld", rank, (long long)steps);
  ddp_loader_destroy(loader);
  ddp_dataset_destroy(train);
  ddp_dist_optimizer_destroy(opt);
  for (int i = 0; i < n; i++) ddp_rref_release(params[i]);
  ddp_rref_release(ps);
  DDP_TRY(s);
  steps_reply = steps;
  reply->payload = &steps_reply;
  reply->payload_bytes = sizeof steps_reply;
  return DDP_OK;
}

int main(int argc, char **argv) {
  opts = parse(argc, argv);
  ddp_rref_register_ctor("ps.create", ps_create, NULL);
  ddp_rref_register_method("ps.param_rrefs", ps_param_rrefs, NULL);
  ddp_dist_register("ps.forward", ps_forward, NULL);
  ddp_rpc_register("trainer.run", trainer_run, NULL);

  /* By hand (--rank), as the seed: MASTER_ADDR and MASTER_PORT, default
   * localhost:29500; under ddprun, its variables (env://). */
  char url[256];
  ddp_rpc_options ro = ddp_rpc_defaults();
  if (opts.rank >= 0) {
    snprintf(url, sizeof url, "tcp://%s:%s", ddp_env_str("MASTER_ADDR", "localhost"),
             ddp_env_str("MASTER_PORT", "29500"));
    ro.init_method = url;
    ro.rank = opts.rank;
    ro.world_size = opts.world_size > 0 ? opts.world_size : 2;
  }
  int64_t env_rank = -1;
  CHECK(ddp_env_int("RANK", -1, &env_rank));
  int rank = opts.rank >= 0 ? opts.rank : (int)env_rank;
  if (rank < 0) {
    fprintf(stderr, "rpc_parameter_server: no rank: start it with ddprun, or give --rank R "
                    "(0 is the server) and --world-size W\n");
    return 2;
  }
  char name[64];
  if (rank == 0) snprintf(name, sizeof name, "parameter_server");
  else snprintf(name, sizeof name, "trainer_%d", rank);
  ro.name = name;
  ro.num_threads = opts.threads;
  ddp_rpc_agent *agent;
  CHECK(ddp_rpc_init(&ro, &agent));
  int world = ddp_rpc_world_size(agent);
  if (world < 2) {
    fprintf(stderr, "rpc_parameter_server: a world of %d: the server needs at least one trainer "
                    "(--nproc-per-node 2)\n", world);
    ddp_rpc_shutdown(agent, false, -1);
    return 2;
  }

  int rc = 0;
  if (rank == 0) {
    run_args ra = {opts.epochs, opts.max_steps, opts.batch, opts.lr, opts.seed, ""};
    memcpy(ra.init, opts.init, sizeof ra.init);
    ddp_rpc_message m = {.payload = &ra, .payload_bytes = sizeof ra};
    int trainers = world - 1;
    ddp_rpc_future **f = ddp_calloc((size_t)trainers, sizeof *f);
    double t0 = ddp_time_s();
    for (int r = 1; r <= trainers; r++) {
      char to[64];
      snprintf(to, sizeof to, "trainer_%d", r);
      CHECK(ddp_rpc_async(agent, to, "trainer.run", &m, opts.timeout_s, &f[r - 1]));
    }
    int64_t steps = 0;
    for (int r = 0; r < trainers; r++) {
      ddp_status s = ddp_rpc_future_wait(f[r], -1);
      const ddp_rpc_message *res;
      if (s == DDP_OK) s = ddp_rpc_future_result(f[r], &res);
      if (s != DDP_OK) {
        fprintf(stderr, "rpc_parameter_server: %s\n", ddp_rpc_future_error(f[r]));
        rc = 1;
      } else if (res->payload_bytes == sizeof(int64_t)) {
        int64_t n;
        memcpy(&n, res->payload, sizeof n);
        steps += n;
      }
      ddp_rpc_future_destroy(f[r]);
    }
    ddp_free(f);
    double dt = ddp_time_s() - t0;
    if (rc == 0 && server) {
      double acc = evaluate(server);
      printf("ddp rpc_ps trainers=%d epochs=%lld steps=%lld samples_per_s=%.1f "
             "test_accuracy=%.4f\n", trainers, (long long)opts.epochs, (long long)steps,
             (double)(steps * opts.batch) / dt, acc);
      fflush(stdout);
    }
    if (server)
      for (int i = 0; i < server->num_params; i++) ddp_rref_release(server->params[i]);
  }
  ddp_status s = ddp_rpc_shutdown(agent, rc == 0, opts.timeout_s);
  if (s != DDP_OK) {
    fprintf(stderr, "rpc_parameter_server (%s): shutdown: %s\n", name, ddp_last_error());
    rc = 1;
  }
  if (server) {
    ddp_model_destroy(server->model);
    pthread_mutex_destroy(&server->mu);
    ddp_free(server);
  }
  return rc;
}
