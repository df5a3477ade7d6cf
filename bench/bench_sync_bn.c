/* What SyncBatchNorm costs: seed 001's ConvNet trained data-parallel through
 * the DDP wrapper by W ranks (threads of this process, one group), each step
 * forward + loss + backward (bucketed gradient averaging) + SGD, with
 * BatchNorm2d and with SyncBatchNorm (two more allreduces per BN layer and
 * step: 2C+1 doubles forward, 2C backward). Each round runs both modes, in
 * alternating order, so that load drifting on a shared machine hits both
 * alike; the figure is the median step time of each mode and their ratio.
 *
 *   bench_sync_bn [--world 2] [--batch 100] [--steps 30] [--rounds 5] [--json]
 *
 * Data is synthetic (normal pixels, random labels): the loader is not what
 * is measured. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

#define MAX_WORLD 8
#define MAX_ROUNDS 64

typedef struct bench {
  int world, rounds;
  int64_t batch, steps;
  ddp_store *store;
  pthread_barrier_t barrier;
  /* Rank 0's step times, seconds per step: [round][mode], mode 1 = SyncBN. */
  double seconds[MAX_ROUNDS][2];
  int failed;
} bench;

typedef struct rank_arg {
  bench *b;
  int rank;
} rank_arg;

#define RANK_TRY(expr, what)                                                              \
  do {                                                                                    \
    ddp_status s_ = (expr);                                                               \
    if (s_ != DDP_OK) {                                                                   \
      fprintf(stderr, "bench_sync_bn: rank %d: %s: %s\n", a->rank, what, ddp_last_error()); \
      a->b->failed = 1;                                                                   \
      goto out;                                                                           \
    }                                                                                     \
  } while (0)

static void *rank_main(void *arg) {
  rank_arg *a = arg;
  bench *b = a->b;
  ddp_process_group *pg = NULL;
  ddp_model *model = NULL;
  ddp_dp *dp = NULL;
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  float *xbuf = malloc((size_t)(b->batch * 784) * sizeof(float));
  int64_t *ybuf = malloc((size_t)b->batch * sizeof(int64_t));
  ddp_rng rng;
  ddp_rng_seed(&rng, 1000 + (uint64_t)a->rank);
  for (int64_t i = 0; i < b->batch * 784; i++) xbuf[i] = ddp_rng_normal(&rng);
  for (int64_t i = 0; i < b->batch; i++) ybuf[i] = (int64_t)ddp_rng_below(&rng, 10);
  int64_t xs[4] = {b->batch, 1, 28, 28};
  ddp_tensor x, y;
  ddp_tensor_wrap(&x, DDP_FLOAT32, 4, xs, xbuf);
  ddp_tensor_wrap(&y, DDP_INT64, 1, &b->batch, ybuf);

  ddp_process_group_options po = {.timeout_s = 120};
  RANK_TRY(ddp_process_group_create(b->store, a->rank, b->world, &po, &pg), "group");
  RANK_TRY(ddp_model_build("convnet", NULL, 1, &model), "model");
  ddp_dp_options o = ddp_dp_defaults();
  RANK_TRY(ddp_dp_create(&dp, model, pg, &o), "dp");
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  RANK_TRY(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model),
                                ddp_model_grads_flat(model),
                                (size_t)ddp_model_num_param_elements(model)),
           "optimizer");
  ddp_dp_set_optimizer(dp, opt);
  RANK_TRY(ddp_tape_create(&tape, 1 << 24), "tape");

  /* Round -1 warms up both modes; odd rounds run SyncBN first, because the
   * second run of a round measures faster (caches, frequency) on its own. */
  for (int round = -1; round < b->rounds; round++)
    for (int k = 0; k < 2; k++) {
      int mode = (round & 1) ? 1 - k : k;
      RANK_TRY(ddp_model_convert_sync_batchnorm(model, mode ? pg : NULL), "convert");
      pthread_barrier_wait(&b->barrier);
      int64_t t0 = ddp_time_ns();
      for (int64_t s = 0; s < b->steps; s++) {
        ddp_tensor *out, *loss;
        ddp_model_zero_grad(model);
        ddp_tape_reset(tape);
        RANK_TRY(ddp_dp_forward(dp, tape, &x, &out), "forward");
        RANK_TRY(ddp_model_loss(model, tape, out, &y, &loss), "loss");
        RANK_TRY(ddp_dp_backward(dp, tape, loss), "backward");
        RANK_TRY(ddp_optimizer_step(opt), "step");
      }
      /* Every rank has finished its steps: time the slowest. */
      pthread_barrier_wait(&b->barrier);
      if (a->rank == 0 && round >= 0)
        b->seconds[round][mode] = (double)(ddp_time_ns() - t0) * 1e-9 / (double)b->steps;
    }
out:
  if (dp) ddp_dp_set_optimizer(dp, NULL);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_dp_destroy(dp);
  ddp_model_destroy(model);
  ddp_process_group_destroy(pg);
  free(xbuf);
  free(ybuf);
  /* A failed rank leaves the others to their collectives' timeouts. */
  return NULL;
}

static int cmp_double(const void *p, const void *q) {
  double x = *(const double *)p, y = *(const double *)q;
  return (x > y) - (x < y);
}

static double median_of(bench *b, int mode) {
  double v[MAX_ROUNDS];
  for (int r = 0; r < b->rounds; r++) v[r] = b->seconds[r][mode];
  qsort(v, (size_t)b->rounds, sizeof v[0], cmp_double);
  return v[b->rounds / 2];
}

int main(int argc, char **argv) {
  bench b = {.world = 2, .rounds = 5, .batch = 100, .steps = 30};
  bool json = false;
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    bool has = i + 1 < argc;
    if (!strcmp(f, "--world") && has) b.world = atoi(argv[++i]);
    else if (!strcmp(f, "--batch") && has) b.batch = atoll(argv[++i]);
    else if (!strcmp(f, "--steps") && has) b.steps = atoll(argv[++i]);
    else if (!strcmp(f, "--rounds") && has) b.rounds = atoi(argv[++i]);
    else if (!strcmp(f, "--json")) json = true;
    else {
      fprintf(stderr, "usage: bench_sync_bn [--world 2] [--batch 100] [--steps 30] "
                      "[--rounds 5] [--json]\n");
      return !strcmp(f, "--help") ? 0 : 2;
    }
  }
  if (b.world < 1 || b.world > MAX_WORLD || b.batch < 1 || b.steps < 1 || b.rounds < 1 ||
      b.rounds > MAX_ROUNDS) {
    fprintf(stderr, "bench_sync_bn: world in 1..%d, rounds in 1..%d, batch and steps positive\n",
            MAX_WORLD, MAX_ROUNDS);
    return 2;
  }
  ddp_store_options so = {.timeout_ms = 120000};
  if (ddp_store_mem_create(&so, &b.store) != DDP_OK) {
    fprintf(stderr, "bench_sync_bn: store: %s\n", ddp_last_error());
    return 1;
  }
  pthread_barrier_init(&b.barrier, NULL, (unsigned)b.world);
  pthread_t threads[MAX_WORLD];
  rank_arg args[MAX_WORLD];
  for (int r = 0; r < b.world; r++) {
    args[r] = (rank_arg){&b, r};
    pthread_create(&threads[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < b.world; r++) pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&b.barrier);
  ddp_store_destroy(b.store);
  if (b.failed) return 1;
  double plain = median_of(&b, 0), synced = median_of(&b, 1);
  double samples = (double)(b.batch * b.world);
  if (json)
    printf("{\"world\": %d, \"batch\": %lld, \"bn_step_ms\": %.3f, \"sync_bn_step_ms\": %.3f, "
           "\"bn_samples_per_s\": %.1f, \"sync_bn_samples_per_s\": %.1f, \"ratio\": %.4f}\n",
           b.world, (long long)b.batch, plain * 1e3, synced * 1e3, samples / plain,
           samples / synced, synced / plain);
  else
    printf("ConvNet, DDP over %d thread ranks, batch %lld per rank, median of %d rounds:\n"
           "  BatchNorm2d    %8.3f ms/step  %9.1f samples/s\n"
           "  SyncBatchNorm  %8.3f ms/step  %9.1f samples/s\n"
           "  SyncBatchNorm / BatchNorm2d step time: %.3f\n",
           b.world, (long long)b.batch, b.rounds, plain * 1e3, samples / plain, synced * 1e3,
           samples / synced, synced / plain);
  return 0;
}
