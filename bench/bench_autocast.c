/* Autocast on the CPU: the seeds' ConvNet layers (the RPC tutorial's Net:
 * conv1 1->32 3x3 on 28x28, conv2 32->64 3x3 on 26x26, fc1 9216->128, fc2
 * 128->10), forward + backward through the tape, in float32 and inside a
 * bf16 and an fp16 autocast region (docs/tensor.md, "Mixed precision"), on
 * one thread. Prints the median time of each per layer and precision, the
 * ratio to float32, the CPU kernel family running and the instructions the
 * low-precision path uses, so a quiet run gives BENCHMARKS.md's
 * "bf16 against fp32 on this CPU" line.
 *
 *   bench_autocast [batch] [runs] [layer|all] [fp32|bf16|fp16]
 *       (batch default 64, runs default 11; a layer name times that layer
 *       only; a precision runs that precision only, so that `perf stat -e
 *       cycles` counts one precision per process (alternate them on a
 *       loaded machine); DDP_CPU_KERNELS picks the family as everywhere;
 *       BENCH_CLOCK=cpu times by the thread's CPU time instead of wall) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp/ddp.h"
#include "tensor/autocast.h"
#include "tensor/tape.h"

void openblas_set_num_threads(int num_threads);

typedef struct layer {
  const char *name;
  bool conv;
  int64_t c, h, o; /* conv: in channels, input side, out channels (3x3); linear: in, -, out */
} layer;

static ddp_tensor *filled(int ndim, const int64_t *shape, float scale, uint64_t seed,
                          bool param) {
  ddp_tensor *t;
  if (ddp_tensor_create(&t, DDP_FLOAT32, ndim, shape) != DDP_OK) exit(1);
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = 0; i < t->numel; i++)
    ddp_tensor_f32(t)[i] = scale * (2.0f * (float)ddp_rng_uniform(&rng) - 1.0f);
  if (param) {
    t->flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
    if (ddp_tensor_ensure_grad(t) != DDP_OK) exit(1);
  }
  return t;
}

/* The clock the runs are timed by: wall time, or with BENCH_CLOCK=cpu this
 * thread's CPU time, which a loaded machine's preemption does not inflate
 * (cache and memory contention it still does). */
static bool cpu_clock;

static double now_s(void) {
  if (!cpu_clock) return ddp_time_s();
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median seconds of one forward + backward of the layer in `precision`. */
static double time_layer(const layer *l, int64_t batch, ddp_precision precision, int runs) {
  ddp_tensor *x, *w, *b;
  if (l->conv) {
    x = filled(4, (int64_t[]){batch, l->c, l->h, l->h}, 1.0f, 1, false);
    w = filled(4, (int64_t[]){l->o, l->c, 3, 3}, 0.1f, 2, true);
  } else {
    x = filled(2, (int64_t[]){batch, l->c}, 1.0f, 1, false);
    w = filled(2, (int64_t[]){l->o, l->c}, 0.01f, 2, true);
  }
  b = filled(1, (int64_t[]){l->o}, 0.1f, 3, true);
  x->flags |= DDP_TENSOR_REQUIRES_GRAD; /* every layer but the first computes dx */
  if (!strcmp(l->name, "conv1")) {
    x->flags &= ~DDP_TENSOR_REQUIRES_GRAD;
  } else if (precision != DDP_PRECISION_FP32) {
    /* In the ConvNet every layer but the first reads the activation of the
     * one before (through relu, pooling, dropout), which autocast made in
     * the low dtype: mark x so, as those ops would, so that the layer does
     * not pay for a cast of its input that the network never makes. */
    ddp__autocast_mark(x, precision == DDP_PRECISION_BF16 ? DDP_BFLOAT16 : DDP_FLOAT16, true);
  }
  ddp_tape *tape;
  if (ddp_tape_create(&tape, 1 << 24) != DDP_OK) exit(1);
  float *seed = NULL;
  double t[64];
  const int n = runs < 64 ? runs : 64;
  for (int r = -1; r < n; r++) { /* r = -1: warm-up (the arena grows, the cache fills) */
    ddp_tape_reset(tape);
    const double t0 = now_s();
    ddp_tensor *y;
    ddp_status s = ddp_autocast_enter(precision);
    if (s == DDP_OK) s = l->conv ? ddp_conv2d(tape, x, w, b, 1, 0, &y) : ddp_linear(tape, x, w, b, &y);
    if (s == DDP_OK) s = ddp_autocast_exit();
    if (s == DDP_OK && !seed) {
      seed = malloc((size_t)y->numel * sizeof *seed);
      for (int64_t i = 0; i < y->numel; i++) seed[i] = 1e-3f * (float)(i % 7);
    }
    if (s == DDP_OK) s = ddp__backward_from(tape, y, seed);
    if (s != DDP_OK) {
      fprintf(stderr, "bench_autocast: %s: %s\n", l->name, ddp_last_error());
      exit(1);
    }
    if (r >= 0) t[r] = now_s() - t0;
  }
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  free(seed);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
  return t[n / 2];
}

int main(int argc, char **argv) {
  const int64_t batch = argc > 1 ? atoll(argv[1]) : 64;
  const int runs = argc > 2 ? atoi(argv[2]) : 11;
  const char *only = argc > 3 && strcmp(argv[3], "all") != 0 ? argv[3] : NULL;
  const char *prec = argc > 4 ? argv[4] : NULL;
  const bool want[3] = {!prec || !strcmp(prec, "fp32"), !prec || !strcmp(prec, "bf16"),
                        !prec || !strcmp(prec, "fp16")};
  if (batch <= 0 || runs <= 0 || (prec && !want[0] && !want[1] && !want[2])) {
    fprintf(stderr, "usage: bench_autocast [batch] [runs] [layer|all] [fp32|bf16|fp16]\n");
    return 2;
  }
  openblas_set_num_threads(1);
  const char *clock_env = getenv("BENCH_CLOCK");
  cpu_clock = clock_env && !strcmp(clock_env, "cpu");
  static const layer layers[] = {{"conv1", true, 1, 28, 32},
                                 {"conv2", true, 32, 26, 64},
                                 {"fc1", false, 9216, 0, 128},
                                 {"fc2", false, 128, 0, 10}};
  printf("bench_autocast: batch %lld, %d runs, median ms (%s) of forward + backward, one "
         "thread\n",
         (long long)batch, runs, cpu_clock ? "thread CPU time" : "wall time");
  printf("CPU kernel family: %s; CPU has avx512_bf16: %s, f16c: %s\n", ddp_cpu_kernels(),
         __builtin_cpu_supports("avx512bf16") ? "yes" : "no",
         __builtin_cpu_supports("f16c") ? "yes" : "no");
  printf("low-precision path: %s\n", ddp__autocast_kernels());
  printf("%-6s %10s %10s %10s %9s %9s\n", "layer", "fp32", "bf16", "fp16", "bf16/fp32",
         "fp16/fp32");
  double total[3] = {0, 0, 0};
  for (size_t i = 0; i < sizeof layers / sizeof *layers; i++) {
    if (only && strcmp(only, layers[i].name) != 0) continue;
    /* a precision not run shows as 0 (and its ratios as 0 or inf) */
    const double f32 = want[0] ? time_layer(&layers[i], batch, DDP_PRECISION_FP32, runs) : 0;
    const double bf = want[1] ? time_layer(&layers[i], batch, DDP_PRECISION_BF16, runs) : 0;
    const double hf = want[2] ? time_layer(&layers[i], batch, DDP_PRECISION_FP16, runs) : 0;
    total[0] += f32;
    total[1] += bf;
    total[2] += hf;
    printf("%-6s %10.3f %10.3f %10.3f %9.2f %9.2f\n", layers[i].name, 1e3 * f32, 1e3 * bf,
           1e3 * hf, bf / f32, hf / f32);
  }
  printf("%-6s %10.3f %10.3f %10.3f %9.2f %9.2f\n", "all", 1e3 * total[0], 1e3 * total[1],
         1e3 * total[2], total[1] / total[0], total[2] / total[0]);
  ddp_autocast_cache_free();
  return 0;
}
