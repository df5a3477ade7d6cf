/* The reducer's overhead: one training step of seed 001's ConvNet (forward,
 * backward, SGD with momentum, synthetic batches) per rank, timed as
 *   plain       no wrapper (the reference)
 *   dp1         the DDP wrapper over a group of one
 *   dp2-threads two ranks as threads of this process (local backend)
 *   dp2-procs   two forked ranks over shared memory (file store rendezvous)
 * Each mode runs `repeats` times; the figure is the median step time (ms)
 * and its ratio to plain's. At world 2 every rank does plain's work, so a
 * ratio of 1.0 is perfect scaling; above it is the reducer's cost plus the
 * ranks' contention for the machine (two cores here, shared).
 *
 *   bench_dp [--batch 100] [--steps 60] [--warmup 5] [--repeats 5]
 *            [--bucket-cap-mb 25] [--modes plain,dp1,dp2-threads,dp2-procs]
 *
 * One BLAS thread per rank, as in PyTorch's reference with one thread. */
#include <cblas.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/ddp.h"

typedef struct bench_cfg {
  int64_t batch, steps, warmup, repeats;
  double bucket_cap_mb;
} bench_cfg;

static void die(const char *what) {
  fprintf(stderr, "bench_dp: %s: %s\n", what, ddp_last_error());
  exit(1);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Trains `repeats` timed runs of `steps` steps on this rank; writes each
 * run's mean step time (s) into times. pg NULL: no wrapper. */
static void run_rank(const bench_cfg *c, ddp_process_group *pg, int rank, double *times) {
  ddp_model *m;
  if (ddp_model_build("convnet", NULL, 1, &m) != DDP_OK) die("model");
  ddp_dp *dp = NULL;
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = c->bucket_cap_mb;
  if (pg && ddp_dp_create(&dp, m, pg, &o) != DDP_OK) die("ddp_dp_create");
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  if (ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                           (size_t)ddp_model_num_param_elements(m)) != DDP_OK)
    die("optimizer");
  if (dp) ddp_dp_set_optimizer(dp, opt);
  ddp_tape *tape;
  if (ddp_tape_create(&tape, 1 << 20) != DDP_OK) die("tape");
  int64_t B = c->batch;
  float *xbuf = malloc((size_t)(B * 784) * sizeof(float));
  int64_t *ybuf = malloc((size_t)B * sizeof(int64_t));
  ddp_rng rng;
  ddp_rng_seed(&rng, 11 + (uint64_t)rank);
  for (int64_t i = 0; i < B * 784; i++) xbuf[i] = ddp_rng_normal(&rng);
  for (int64_t i = 0; i < B; i++) ybuf[i] = (int64_t)ddp_rng_below(&rng, 10);
  int64_t xs[4] = {B, 1, 28, 28};
  ddp_tensor x, y;
  ddp_tensor_wrap(&x, DDP_FLOAT32, 4, xs, xbuf);
  ddp_tensor_wrap(&y, DDP_INT64, 1, &B, ybuf);
  for (int64_t r = -1; r < c->repeats; r++) {
    int64_t n = r < 0 ? c->warmup : c->steps;
    if (pg) ddp_barrier(pg);
    double t0 = ddp_time_s();
    for (int64_t s = 0; s < n; s++) {
      ddp_tensor *out, *loss;
      ddp_model_zero_grad(m);
      ddp_tape_reset(tape);
      ddp_status st = dp ? ddp_dp_forward(dp, tape, &x, &out) : ddp_model_forward(m, tape, &x, &out);
      if (st == DDP_OK) st = ddp_model_loss(m, tape, out, &y, &loss);
      if (st == DDP_OK) st = dp ? ddp_dp_backward(dp, tape, loss) : ddp_backward(tape, loss);
      if (st == DDP_OK) st = ddp_optimizer_step(opt);
      if (st != DDP_OK) die("step");
    }
    if (r >= 0) times[r] = (ddp_time_s() - t0) / (double)n;
  }
  free(xbuf);
  free(ybuf);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
}

/* ---- Worlds ------------------------------------------------------------------ */

typedef struct thread_arg {
  const bench_cfg *c;
  ddp_store *store;
  int rank, world;
  double *times;
} thread_arg;

static void *rank_thread(void *p) {
  thread_arg *a = p;
  ddp_process_group *pg;
  if (ddp_process_group_create(a->store, a->rank, a->world, NULL, &pg) != DDP_OK) die("group");
  run_rank(a->c, pg, a->rank, a->times);
  ddp_process_group_destroy(pg);
  return NULL;
}

/* Rank 0's times (every rank waits for the slowest in each step anyway). */
static void run_threads(const bench_cfg *c, int world, double *times) {
  ddp_store *store;
  if (ddp_store_mem_create(NULL, &store) != DDP_OK) die("store");
  pthread_t th[8];
  thread_arg args[8];
  double *scratch = calloc((size_t)(world * c->repeats), sizeof(double));
  for (int r = 0; r < world; r++) {
    args[r] = (thread_arg){c, store, r, world, r ? scratch + r * c->repeats : times};
    pthread_create(&th[r], NULL, rank_thread, &args[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  free(scratch);
  ddp_store_destroy(store);
}

static void run_procs(const bench_cfg *c, int world, double *times) {
  char path[] = "/tmp/ddp-bench-dp-XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) die("mkstemp");
  close(fd);
  unlink(path);
  double *shared = mmap(NULL, (size_t)c->repeats * sizeof(double), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) die("mmap");
  pid_t pids[8];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      ddp_store *store;
      ddp_store_options so = {.timeout_ms = 60000};
      if (ddp_store_file_open(path, &so, &store) != DDP_OK) die("file store");
      ddp_process_group *pg;
      if (ddp_process_group_create(store, r, world, NULL, &pg) != DDP_OK) die("group");
      ddp_store_destroy(store);
      double *mine = calloc((size_t)c->repeats, sizeof(double));
      run_rank(c, pg, r, mine);
      if (r == 0) memcpy(shared, mine, (size_t)c->repeats * sizeof(double));
      free(mine);
      ddp_process_group_destroy(pg);
      _exit(0);
    }
  }
  int failed = 0;
  for (int r = 0; r < world; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  unlink(path);
  if (failed) {
    fprintf(stderr, "bench_dp: a rank process failed\n");
    exit(1);
  }
  memcpy(times, shared, (size_t)c->repeats * sizeof(double));
  munmap(shared, (size_t)c->repeats * sizeof(double));
}

int main(int argc, char **argv) {
  bench_cfg c = {.batch = 100, .steps = 60, .warmup = 5, .repeats = 5, .bucket_cap_mb = 25};
  const char *modes = "plain,dp1,dp2-threads,dp2-procs";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--batch") && v) c.batch = atoll(argv[++i]);
    else if (!strcmp(a, "--steps") && v) c.steps = atoll(argv[++i]);
    else if (!strcmp(a, "--warmup") && v) c.warmup = atoll(argv[++i]);
    else if (!strcmp(a, "--repeats") && v) c.repeats = atoll(argv[++i]);
    else if (!strcmp(a, "--bucket-cap-mb") && v) c.bucket_cap_mb = atof(argv[++i]);
    else if (!strcmp(a, "--modes") && v) modes = argv[++i];
    else {
      fprintf(stderr, "usage: bench_dp [--batch 100] [--steps 60] [--warmup 5] [--repeats 5]\n"
                      "                [--bucket-cap-mb 25] [--modes plain,dp1,dp2-threads,dp2-procs]\n");
      return !strcmp(a, "--help") ? 0 : 2;
    }
  }
  if (c.batch <= 0 || c.steps <= 0 || c.repeats <= 0 || c.repeats > 64 || c.bucket_cap_mb <= 0) {
    fprintf(stderr, "bench_dp: batch, steps, bucket-cap-mb and repeats (<= 64) must be positive\n");
    return 2;
  }
  openblas_set_num_threads(1);
  static const char *names[4] = {"plain", "dp1", "dp2-threads", "dp2-procs"};
  double plain_ms = 0;
  for (int k = 0; k < 4; k++) {
    if (!strstr(modes, names[k])) continue;
    double times[64];
    if (k == 0) run_rank(&c, NULL, 0, times);
    else if (k == 1) run_threads(&c, 1, times);
    else if (k == 2) run_threads(&c, 2, times);
    else run_procs(&c, 2, times);
    qsort(times, (size_t)c.repeats, sizeof(double), cmp_double);
    double ms = times[c.repeats / 2] * 1e3;
    if (k == 0) plain_ms = ms;
    int world = k >= 2 ? 2 : 1;
    printf("%-12s batch %lld/rank  step %.3f ms (median of %lld)  %.0f samples/s in all",
           names[k], (long long)c.batch, ms, (long long)c.repeats,
           (double)world * (double)c.batch / (ms / 1e3));
    if (plain_ms > 0 && k > 0) printf("  ratio to plain %.3f", ms / plain_ms);
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
