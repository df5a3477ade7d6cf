/* Pipeline parallelism's bubble and speed: 8 x (Linear(D, D), ReLU) with MSE
 * against a random target (refs/torch_pipeline.py's model), trained with SGD
 * (lr 1e-3) on batches of B rows in M micro-batches, as
 *   --schedule none         the unsplit model on one rank, the M micro-batches
 *                           accumulated (the baseline of the ideal speedup)
 *   --schedule gpipe|1f1b   2 stages of 4 layers on 2 forked ranks
 *   --schedule interleaved  2 ranks x v stages (v = --virtual-stages)
 * Each rank is pinned to a core of its own (rank r to the r-th CPU this
 * process may use) and runs one BLAS thread. Prints one line:
 *   ddp pipeline schedule=1f1b world=2 microbatches=8 v=1 batch=256 dim=1024 steps=20
 *     samples_per_s=X idle=0.110,0.112 ideal_idle=0.111
 * idle: each rank's measured idle fraction (time waiting for transfers over
 * step time, steps after warm-up); ideal_idle: (p - 1) / (v M + p - 1);
 * cpu: each rank's CPU time (all its threads) over the wall time;
 * preempted: the time its main thread was ready to run while its core ran
 * something else (schedstat), over the wall time: other load's share.
 *
 * --input-grad: the input requires grad, so the first layer computes its
 * input's gradient too (as a pipeline fed by layers before it): then the
 * two stages cost the same (without it the first stage skips one of the 12
 * matrix products a micro-batch costs the last), the premise of the
 * bubble's closed form.
 *
 *   bench_pipeline [--schedule 1f1b] [--microbatches 8] [--virtual-stages 1]
 *                  [--batch 256] [--dim 1024] [--steps 20] [--warmup 3]
 *                  [--input-grad] */
#include <cblas.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "ddp/pipeline.h"
#include "tensor/tape.h"

typedef struct {
  const char *schedule;
  int m, v, dim, steps, warmup, layers;
  int64_t batch;
  bool input_grad;
} cfg;

static void die(const char *what) {
  fprintf(stderr, "bench_pipeline: %s: %s\n", what, ddp_last_error());
  exit(1);
}

static void pin(int index) {
  cpu_set_t allowed, one;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
    if (CPU_ISSET(cpu, &allowed) && seen++ == index) {
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      sched_setaffinity(0, sizeof one, &one);
      return;
    }
}

/* CPU seconds of this process (all its threads). */
static double cpu_s(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return (double)u.ru_utime.tv_sec + (double)u.ru_stime.tv_sec +
         1e-6 * (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

static ddp_model *build(const cfg *c) {
  ddp_model *m;
  if (ddp_model_create(&m) != DDP_OK) die("model");
  for (int i = 0; i < c->layers; i++) {
    if (ddp_module_add_linear(m, NULL, NULL, c->dim, c->dim, true, NULL) != DDP_OK) die("linear");
    if (ddp_module_add_relu(m, NULL, NULL, NULL) != DDP_OK) die("relu");
  }
  if (ddp_model_finalize(m, 0) != DDP_OK) die("finalize");
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  int64_t sample[1] = {c->dim};
  ddp_model_set_sample_shape(m, 1, sample);
  return m;
}

static ddp_optimizer *sgd(ddp_model *m) {
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 1e-3;
  ddp_optimizer *opt;
  if (ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                           (size_t)ddp_model_num_param_elements(m)) != DDP_OK)
    die("optimizer");
  return opt;
}

static void fill(ddp_tensor *t, float *buf, int64_t rows, int64_t cols, uint64_t seed) {
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = 0; i < rows * cols; i++) buf[i] = ddp_rng_normal(&rng);
  int64_t shape[2] = {rows, cols};
  ddp_tensor_wrap(t, DDP_FLOAT32, 2, shape, buf);
}

/* The unsplit model on this process: samples per second; its CPU and
 * preempted time over the wall time into cpu_pre[0], cpu_pre[1]. */
static double run_single(const cfg *c, double *cpu_pre) {
  pin(0);
  ddp_preempt_clock clock;
  ddp_preempt_clock_open(&clock);
  double cpu0 = 0;
  int64_t pre0 = 0;
  ddp_model *model = build(c);
  ddp_optimizer *opt = sgd(model);
  ddp_tape *tape;
  if (ddp_tape_create(&tape, 1 << 20) != DDP_OK) die("tape");
  float *xb = malloc(sizeof(float) * (size_t)(c->batch * c->dim));
  float *yb = malloc(sizeof(float) * (size_t)(c->batch * c->dim));
  ddp_tensor x, y;
  fill(&x, xb, c->batch, c->dim, 1);
  fill(&y, yb, c->batch, c->dim, 2);
  float *xg = calloc((size_t)(c->batch * c->dim), sizeof(float));
  float scale = 1.0f / (float)c->m;
  double t0 = 0;
  for (int step = 0; step < c->warmup + c->steps; step++) {
    if (step == c->warmup) {
      t0 = ddp_time_s();
      cpu0 = cpu_s();
      pre0 = ddp_preempt_clock_ns(&clock);
    }
    ddp_model_zero_grad(model);
    for (int mb = 0, off = 0; mb < c->m; mb++) {
      int64_t rows = c->batch / c->m + (mb < c->batch % c->m);
      int64_t shape[2] = {rows, c->dim};
      ddp_tensor xm, ym, *out, *loss;
      ddp_tensor_wrap(&xm, DDP_FLOAT32, 2, shape, xb + off * c->dim);
      ddp_tensor_wrap(&ym, DDP_FLOAT32, 2, shape, yb + off * c->dim);
      if (c->input_grad) xm.grad = xg + off * c->dim, xm.flags |= DDP_TENSOR_REQUIRES_GRAD;
      off += (int)rows;
      ddp_tape_reset(tape);
      if (ddp_model_forward(model, tape, &xm, &out) != DDP_OK ||
          ddp_model_loss(model, tape, out, &ym, &loss) != DDP_OK ||
          ddp__backward_from(tape, loss, &scale) != DDP_OK)
        die("step");
    }
    if (ddp_optimizer_step(opt) != DDP_OK) die("sgd");
  }
  double dt = ddp_time_s() - t0;
  cpu_pre[0] = (cpu_s() - cpu0) / dt;
  cpu_pre[1] = (double)(ddp_preempt_clock_ns(&clock) - pre0) * 1e-9 / dt;
  ddp_preempt_clock_close(&clock);
  free(xb);
  free(yb);
  free(xg);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  return (double)c->steps * (double)c->batch / dt;
}

/* Rank `rank` of the pipeline: writes its idle fraction and (rank 0) the
 * samples per second into out[2 * rank], out[2 * rank + 1]. */
static void run_rank(const cfg *c, const char *path, int rank, int world, double *out) {
  pin(rank);
  ddp_store_options so = {.timeout_ms = 120000};
  ddp_store *store;
  if (ddp_store_file_open(path, &so, &store) != DDP_OK) die("file store");
  ddp_process_group_options po = {.timeout_s = 120};
  ddp_process_group *pg;
  if (ddp_process_group_create(store, rank, world, &po, &pg) != DDP_OK) die("group");
  ddp_model *full = build(c);
  ddp_pipeline_options o = ddp_pipeline_defaults();
  if (ddp_pipeline_schedule_parse(c->schedule, &o.schedule) != DDP_OK) die("schedule");
  o.n_microbatches = c->m;
  o.virtual_stages = c->v;
  o.max_batch = c->batch;
  /* Equal stages: layers / (world v) (Linear, ReLU) pairs each. */
  char split[256] = "";
  int stages = world * c->v, per = 2 * c->layers / stages;
  for (int g = 1; g < stages; g++)
    snprintf(split + strlen(split), sizeof split - strlen(split), "%s%d", g > 1 ? "," : "", g * per);
  o.split = split;
  ddp_pipeline *pp;
  if (ddp_pipeline_create(&pp, full, pg, &o) != DDP_OK) die("pipeline");
  ddp_model_destroy(full);
  ddp_model *stage = ddp_pipeline_model(pp);
  ddp_optimizer *opt = sgd(stage);
  float *xb = malloc(sizeof(float) * (size_t)(c->batch * c->dim));
  float *yb = malloc(sizeof(float) * (size_t)(c->batch * c->dim));
  ddp_tensor x, y;
  fill(&x, xb, c->batch, c->dim, 1);
  fill(&y, yb, c->batch, c->dim, 2);
  float *xg = calloc((size_t)(c->batch * c->dim), sizeof(float));
  if (c->input_grad) x.grad = xg, x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  ddp_preempt_clock clock;
  ddp_preempt_clock_open(&clock);
  double t0 = 0, cpu0 = 0;
  int64_t pre0 = 0;
  for (int step = 0; step < c->warmup + c->steps; step++) {
    if (step == c->warmup) {
      if (ddp_barrier(pg) != DDP_OK) die("barrier");
      ddp_pipeline_reset_stats(pp);
      t0 = ddp_time_s();
      cpu0 = cpu_s();
      pre0 = ddp_preempt_clock_ns(&clock);
    }
    ddp_model_zero_grad(stage);
    if (ddp_pipeline_step(pp, ddp_pipeline_is_first(pp) ? &x : NULL,
                          ddp_pipeline_is_last(pp) ? &y : NULL, NULL) != DDP_OK)
      die("step");
    if (ddp_optimizer_step(opt) != DDP_OK) die("sgd");
  }
  if (ddp_barrier(pg) != DDP_OK) die("barrier");
  double dt = ddp_time_s() - t0;
  ddp_pipeline_stats st;
  ddp_pipeline_get_stats(pp, &st);
  out[2 * rank] = st.idle_fraction_mean;
  out[2 * rank + 1] = (double)c->steps * (double)c->batch / dt;
  out[4 + rank] = (cpu_s() - cpu0) / dt;
  out[6 + rank] = (double)(ddp_preempt_clock_ns(&clock) - pre0) * 1e-9 / dt;
  ddp_preempt_clock_close(&clock);
  free(xb);
  free(yb);
  free(xg);
  ddp_optimizer_destroy(opt);
  ddp_pipeline_destroy(pp);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
}

int main(int argc, char **argv) {
  cfg c = {"1f1b", 8, 1, 1024, 20, 3, 8, 256, false};
  for (int i = 1; i < argc; i++) {
    const char *k = argv[i];
    if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
      printf("usage: bench_pipeline [--schedule none|gpipe|1f1b|interleaved] [--microbatches M]\n"
             "                      [--virtual-stages v] [--batch B] [--dim D] [--steps S]\n"
             "                      [--warmup W] [--input-grad]\n"
             "8 x (Linear(D, D), ReLU) with MSE, as 2 pipeline stages on 2 forked ranks (none: the\n"
             "unsplit model on one rank); prints samples/s and each rank's idle fraction.\n");
      return 0;
    }
    if (!strcmp(k, "--input-grad")) {
      c.input_grad = true;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "bench_pipeline: %s needs a value (--help)\n", k);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(k, "--schedule")) c.schedule = v;
    else if (!strcmp(k, "--microbatches")) c.m = atoi(v);
    else if (!strcmp(k, "--virtual-stages")) c.v = atoi(v);
    else if (!strcmp(k, "--batch")) c.batch = atoll(v);
    else if (!strcmp(k, "--dim")) c.dim = atoi(v);
    else if (!strcmp(k, "--steps")) c.steps = atoi(v);
    else if (!strcmp(k, "--warmup")) c.warmup = atoi(v);
    else {
      fprintf(stderr, "bench_pipeline: unknown option %s (--help)\n", k);
      return 2;
    }
  }
  openblas_set_num_threads(1);
  if (!strcmp(c.schedule, "none")) {
    double cp[2];
    double sps = run_single(&c, cp);
    printf("ddp pipeline schedule=none world=1 microbatches=%d v=1 batch=%lld dim=%d steps=%d "
           "input_grad=%d samples_per_s=%.1f cpu=%.2f preempted=%.2f\n", c.m, (long long)c.batch,
           c.dim, c.steps, c.input_grad, sps, cp[0], cp[1]);
    return 0;
  }
  const int world = 2;
  char path[] = "/tmp/bench_pipeline_store_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) die("mkstemp");
  close(fd);
  unlink(path);
  double *shared = mmap(NULL, sizeof(double) * 4 * world, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) die("mmap");
  pid_t pids[2];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(600);
      run_rank(&c, path, r, world, shared);
      _exit(0);
    }
  }
  int bad = 0;
  for (int r = 0; r < world; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  unlink(path);
  if (bad) {
    fprintf(stderr, "bench_pipeline: a rank failed\n");
    return 1;
  }
  double ideal = (double)(world - 1) / (double)(c.v * c.m + world - 1);
  printf("ddp pipeline schedule=%s world=%d microbatches=%d v=%d batch=%lld dim=%d steps=%d "
         "input_grad=%d samples_per_s=%.1f idle=%.3f,%.3f ideal_idle=%.3f cpu=%.2f,%.2f "
         "preempted=%.2f,%.2f\n",
         c.schedule, world, c.m, c.v, (long long)c.batch, c.dim, c.steps, c.input_grad, shared[1],
         shared[0], shared[2], ideal, shared[4], shared[5], shared[6], shared[7]);
  return 0;
}
