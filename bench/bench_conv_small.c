/* The convolutions of the seeds' small networks at their batches, one
 * thread: seed 002's convnet-N (issue 22: 3x3, padding 1, on 28x28, 1 -> 10
 * and 10 -> 10 channels, batch 8) and seed 001's psnet (issue 24: 3x3, no
 * padding, 1 -> 32 on 28x28 and 32 -> 64 on 26x26, batch 32); forward, dX,
 * and dW + db, each timed alone. DDP_CONV_WINOGRAD=0 times psnet's conv2
 * by the direct kernels instead of Winograd's. Prints the median and the
 * fastest of the runs (the least disturbed on a shared machine) in
 * microseconds, and GFLOP/s at the fastest.
 *
 *   bench_conv_small [runs]   (default 300) */
#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"
#include "tensor/cpu/dense.h"

static ddp_arena arena;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static float *uniform(int64_t n, ddp_rng *rng) {
  float *p = ddp_alloc((size_t)n * sizeof(float));
  if (!p) abort();
  for (int64_t i = 0; i < n; i++) p[i] = (float)ddp_rng_uniform(rng) - 0.5f;
  return p;
}

typedef enum { FORWARD, DX, DW } pass;

static const struct {
  const char *net;
  ddp__conv2d_geom g;
} shapes[] = {
    {"convnet-N (issue 22)", {.n = 8, .c = 1, .h = 28, .w = 28, .o = 10, .kh = 3, .kw = 3,
                              .stride = 1, .pad = 1, .oh = 28, .ow = 28}},
    {"convnet-N (issue 22)", {.n = 8, .c = 10, .h = 28, .w = 28, .o = 10, .kh = 3, .kw = 3,
                              .stride = 1, .pad = 1, .oh = 28, .ow = 28}},
    {"psnet (issue 24)", {.n = 32, .c = 1, .h = 28, .w = 28, .o = 32, .kh = 3, .kw = 3,
                          .stride = 1, .pad = 0, .oh = 26, .ow = 26}},
    {"psnet (issue 24)", {.n = 32, .c = 32, .h = 26, .w = 26, .o = 64, .kh = 3, .kw = 3,
                          .stride = 1, .pad = 0, .oh = 24, .ow = 24}},
};

static void report(const char *what, double *t, int runs, double flops) {
  qsort(t, (size_t)runs, sizeof *t, cmp_double);
  printf("  %-8s median %7.1f us, fastest %7.1f us (%5.1f GFLOP/s)\n", what, 1e6 * t[runs / 2],
         1e6 * t[0], flops / t[0] * 1e-9);
}

int main(int argc, char **argv) {
  const int runs = argc > 1 ? atoi(argv[1]) : 300;
  if (runs < 1) {
    fprintf(stderr, "usage: bench_conv_small [runs >= 1]\n");
    return 2;
  }
  double *t[3];
  for (int p = 0; p < 3; p++)
    if (!(t[p] = malloc((size_t)runs * sizeof(double)))) return 1;
  ddp_arena_init(&arena, 1 << 20);
  ddp_rng rng;
  ddp_rng_seed(&rng, 2);
  printf("kernels: %s\n", ddp_cpu_kernels());
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
    const ddp__conv2d_geom g = shapes[i].g;
    const int64_t xs = g.n * g.c * g.h * g.w, ys = g.n * g.o * g.oh * g.ow;
    const int64_t ws = g.o * g.c * g.kh * g.kw;
    float *x = uniform(xs, &rng), *w = uniform(ws, &rng), *b = uniform(g.o, &rng);
    float *y = uniform(ys, &rng), *dy = uniform(ys, &rng), *dx = uniform(xs, &rng);
    float *dw = uniform(ws, &rng), *db = uniform(g.o, &rng);
    const bool first = g.c == 1; /* the first layer's dX is not needed */
    for (int r = -1; r < runs; r++) /* one warm-up */
      for (int p = 0; p < 3; p++) {
        if (p == DX && first) continue;
        ddp_arena_reset(&arena);
        double t0 = ddp_time_s();
        ddp_status s = p == FORWARD ? ddp__cpu_conv2d_forward(y, x, w, b, &g, &arena)
                       : p == DX    ? ddp__cpu_conv2d_backward(dx, NULL, NULL, dy, x, w, &g, false,
                                                               &arena)
                                    : ddp__cpu_conv2d_backward(NULL, dw, db, dy, x, w, &g, false,
                                                               &arena);
        if (s != DDP_OK) {
          fprintf(stderr, "bench_conv_small: %s\n", ddp_last_error());
          return 1;
        }
        if (r >= 0) t[p][r] = ddp_time_s() - t0;
      }
    /* the multiply-adds of the direct forward; dX and dW do as many useful
     * ones (Winograd's fewer count as these) */
    const double flops = 2.0 * (double)(g.n * g.o * g.oh * g.ow * g.c * g.kh * g.kw);
    printf("%s: conv %lld -> %lld, %lldx%lld pad %lld, %lldx%lld, batch %lld:\n", shapes[i].net,
           (long long)g.c, (long long)g.o, (long long)g.kh, (long long)g.kw, (long long)g.pad,
           (long long)g.h, (long long)g.w, (long long)g.n);
    report("forward", t[FORWARD], runs, flops);
    if (!first) report("dX", t[DX], runs, flops);
    report("dW + db", t[DW], runs, flops);
    ddp_free(x), ddp_free(w), ddp_free(b), ddp_free(y), ddp_free(dy), ddp_free(dx);
    ddp_free(dw), ddp_free(db);
  }
  ddp_arena_free(&arena);
  for (int p = 0; p < 3; p++) free(t[p]);
  return 0;
}
