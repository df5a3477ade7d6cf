/* Dense-op kernels at the seed ConvNet's batch-100 shapes, on one thread:
 * conv1 1->16 k5 p2 on 28x28, relu + max_pool 2 (fused), conv2 16->32 k5 p2 on 14x14,
 * relu + max_pool 2, linear 1568->10; forward and backward (conv1 without dx, as
 * its input is data). Prints the median time of several runs and GFLOP/s,
 * beside OpenBLAS sgemm at the conv2 gemm shape and a square shape measured
 * in the same run, so the ratio survives a noisy machine. Each dense op's
 * GFLOP/s (direct-convolution FLOPs: 2 per multiply-add of the direct sum,
 * whatever the kernel does) is also given as a fraction of the core's FMA
 * peak at the family's vector width (bench/fma_peak.h), measured in the
 * same run.
 *
 *   bench_ops [runs] [generic|avx2|avx512] [cpu]   (runs default 11; a
 *       family forces that kernel family, as DDP_CPU_KERNELS would; by
 *       default, or "auto", the one DDP_CPU_KERNELS and the CPU choose. "cpu" times
 *       the thread's CPU time instead of the wall clock: on a loaded
 *       machine the time spent waiting for a CPU drops out, though not
 *       what the other tasks do to the caches) */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp/ddp.h"
#include "fma_peak.h"
#include "tensor/cpu/dense.h"
#include "tensor/kernels.h"

void openblas_set_num_threads(int num_threads);

#define BATCH 100

static int runs = 11;
static bool cpu_clock; /* time the thread's CPU time, not the wall clock */

static double now_s(void) {
  if (!cpu_clock) return ddp_time_s();
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static double best_s; /* fastest run of the last median_s: the least disturbed on a shared machine */
static ddp_arena arena;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median seconds of `runs` timings of fn(arg), after one warm-up call. The
 * arena is reset before each call, as the tape is each step. */
static double median_s(void (*fn)(void *), void *arg) {
  double t[64];
  int n = runs < 64 ? runs : 64;
  ddp_arena_reset(&arena);
  fn(arg);
  for (int i = 0; i < n; i++) {
    ddp_arena_reset(&arena);
    double t0 = now_s();
    fn(arg);
    t[i] = now_s() - t0;
  }
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  best_s = t[0];
  return t[n / 2];
}

static float *randn(int64_t n, uint64_t seed, float scale) {
  float *p = ddp_alloc((size_t)n * sizeof(float));
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = 0; i < n; i++) p[i] = scale * ddp_rng_normal(&rng);
  return p;
}

/* ---- conv ---- */

typedef struct conv_case {
  ddp__conv2d_geom g;
  float *x, *w, *b, *y, *dy, *dx, *dw, *db;
  bool want_dx;
} conv_case;

static const ddp__dense_kernels *K;

static void conv_setup(conv_case *c, int64_t ch, int64_t hw, int64_t o, bool want_dx,
                       uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->g = (ddp__conv2d_geom){.n = BATCH, .c = ch, .h = hw, .w = hw, .o = o, .kh = 5, .kw = 5,
                            .stride = 1, .pad = 2, .oh = hw, .ow = hw};
  int64_t nx = BATCH * ch * hw * hw, nw = o * ch * 25, ny = BATCH * o * hw * hw;
  c->x = randn(nx, seed, 1);
  c->w = randn(nw, seed + 1, 0.1f);
  c->b = randn(o, seed + 2, 0.1f);
  c->y = randn(ny, seed + 3, 1);
  c->dy = randn(ny, seed + 4, 1);
  c->dx = want_dx ? randn(nx, seed + 5, 0) : NULL;
  c->dw = randn(nw, seed + 6, 0);
  c->db = randn(o, seed + 7, 0);
  c->want_dx = want_dx;
}

static void conv_free(conv_case *c) {
  float *all[] = {c->x, c->w, c->b, c->y, c->dy, c->dx, c->dw, c->db};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) ddp_free(all[i]);
}

static void conv_fwd(void *arg) {
  conv_case *c = arg;
  if (K->conv2d_forward(c->y, c->x, c->w, c->b, &c->g, &arena) != DDP_OK) abort();
}

static void conv_bwd(void *arg) {
  conv_case *c = arg;
  if (K->conv2d_backward(c->dx, c->dw, c->db, c->dy, c->x, c->w, &c->g, false, &arena) != DDP_OK)
    abort();
}

/* The parts of backward alone, to see where its time goes (not in the total). */
static void conv_bwd_dw(void *arg) {
  conv_case *c = arg;
  if (K->conv2d_backward(NULL, c->dw, c->db, c->dy, c->x, c->w, &c->g, false, &arena) != DDP_OK)
    abort();
}

static void conv_bwd_dx(void *arg) {
  conv_case *c = arg;
  if (K->conv2d_backward(c->dx, NULL, NULL, c->dy, c->x, c->w, &c->g, false, &arena) != DDP_OK)
    abort();
}

static double conv_flops(const conv_case *c) {
  const ddp__conv2d_geom *g = &c->g;
  return 2.0 * g->n * g->o * g->c * g->kh * g->kw * g->oh * g->ow;
}

/* ---- pool ---- */

typedef struct pool_case {
  int64_t planes, hw;
  float *x, *y, *dy, *dx;
  int32_t *arg;
} pool_case;

static void pool_fwd(void *p) {
  pool_case *c = p;
  /* relu fused, as nn runs the ConvNet's ReLU + MaxPool2d */
  K->max_pool2d_forward(c->y, c->arg, NULL, c->x, c->planes, c->hw, c->hw, 2, 2, c->hw / 2,
                        c->hw / 2, true, NULL);
}

static void pool_bwd(void *p) {
  pool_case *c = p;
  K->max_pool2d_backward(c->dx, c->dy, c->arg, c->planes, c->hw, c->hw, 2, 2, c->hw / 2,
                         c->hw / 2, false);
}

/* ---- linear ---- */

typedef struct lin_case {
  float *x, *w, *b, *y, *dy, *dx, *dw, *db;
} lin_case;

static void lin_fwd(void *p) {
  lin_case *c = p;
  K->linear_forward(c->y, c->x, c->w, c->b, BATCH, 1568, 10);
}

static void lin_bwd(void *p) {
  lin_case *c = p;
  K->linear_backward(c->dx, false, c->dw, c->db, c->dy, c->x, c->w, BATCH, 1568, 10);
}

/* ---- reference sgemm ---- */

typedef struct gemm_case {
  int m, n, k, reps;
  float *a, *b, *c;
} gemm_case;

static void gemm_run(void *p) {
  gemm_case *g = p;
  for (int r = 0; r < g->reps; r++)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g->m, g->n, g->k, 1.0f, g->a, g->k,
                g->b, g->n, 0.0f, g->c, g->n);
}

/* ddp's own kernel of the running vector family on the same operands: the
 * ceiling the convolutions work against (no im2col, operands hot in cache). */
static void own_gemm_run(void *p) {
  gemm_case *g = p;
  for (int r = 0; r < g->reps; r++) {
    if (ddp__cpu_has_avx512())
      ddp__cpu_gemm_avx512(g->m, g->n, g->k, g->a, g->k, g->b, g->n, g->c, g->n, NULL, false);
    else
      ddp__cpu_gemm_avx2(g->m, g->n, g->k, g->a, g->k, g->b, g->n, g->c, g->n, NULL, false);
  }
}

static double gemm_gflops(int m, int n, int k, int reps, bool own) {
  gemm_case g = {m, n, k, reps, randn((int64_t)m * k, 1, 1), randn((int64_t)k * n, 2, 1),
                 randn((int64_t)m * n, 3, 1)};
  double s = median_s(own ? own_gemm_run : gemm_run, &g);
  ddp_free(g.a);
  ddp_free(g.b);
  ddp_free(g.c);
  return 2.0 * m * n * k * reps / s / 1e9;
}

static double total_s;
static double peak_gflops; /* the family's FMA peak, bench/fma_peak.h */

static void report(const char *name, double s, double flops) {
  total_s += s;
  if (flops > 0)
    printf("%-26s %8.3f ms  %7.1f GFLOP/s %3.0f%% of peak   (best %.3f ms, %.1f GFLOP/s)\n",
           name, s * 1e3, flops / s / 1e9, 100.0 * flops / s / 1e9 / peak_gflops,
           best_s * 1e3, flops / best_s / 1e9);
  else
    printf("%-26s %8.3f ms                   (best %.3f ms)\n", name, s * 1e3, best_s * 1e3);
}

int main(int argc, char **argv) {
  if (argc > 1) runs = atoi(argv[1]);
  if (runs < 1) runs = 1;
  cpu_clock = argc > 3 && strcmp(argv[3], "cpu") == 0;
  if (argc > 2 && strcmp(argv[2], "auto") != 0) {
    static const char *const names[] = {"generic", "avx2", "avx512"};
    int f = -1;
    for (int i = 0; i < 3; i++)
      if (strcmp(argv[2], names[i]) == 0) f = i;
    if (f < 0 || !ddp__cpu_force_family(f)) {
      fprintf(stderr, "bench_ops: cannot run the family \"%s\" here (generic, avx2, avx512)\n",
              argv[2]);
      return 2;
    }
  }
  openblas_set_num_threads(1);
  K = ddp__kernels_for(DDP_CPU)->dense;
  ddp_arena_init(&arena, 4 << 20);
  const char *family = ddp_cpu_kernels();
  peak_gflops = fma_peak_gflops(family_lanes(family));
  printf("dense ops, batch %d, 1 thread, median of %d runs (%s time), %s family (OpenBLAS core "
         "%s)\n",
         BATCH, runs, cpu_clock ? "CPU" : "wall", family, openblas_get_corename());
  printf("FMA peak at %d lanes: %.1f GFLOP/s (best of 15 runs of independent FMA chains)\n",
         family_lanes(family), peak_gflops);

  conv_case c1, c2;
  conv_setup(&c1, 1, 28, 16, false, 10);
  conv_setup(&c2, 16, 14, 32, true, 20);
  report("conv1 forward", median_s(conv_fwd, &c1), conv_flops(&c1));
  report("conv1 backward (dw, db)", median_s(conv_bwd, &c1), conv_flops(&c1));
  report("conv2 forward", median_s(conv_fwd, &c2), conv_flops(&c2));
  report("conv2 backward (dx,dw,db)", median_s(conv_bwd, &c2), 2 * conv_flops(&c2));
  double part = median_s(conv_bwd_dw, &c2);
  printf("  of which dw, db           %8.3f ms  %7.1f GFLOP/s %3.0f%% of peak\n", part * 1e3,
         conv_flops(&c2) / part / 1e9, 100.0 * conv_flops(&c2) / part / 1e9 / peak_gflops);
  part = median_s(conv_bwd_dx, &c2);
  printf("  of which dx               %8.3f ms  %7.1f GFLOP/s %3.0f%% of peak\n", part * 1e3,
         conv_flops(&c2) / part / 1e9, 100.0 * conv_flops(&c2) / part / 1e9 / peak_gflops);

  pool_case p1 = {.planes = BATCH * 16, .hw = 28}, p2 = {.planes = BATCH * 32, .hw = 14};
  pool_case *pools[2] = {&p1, &p2};
  for (int i = 0; i < 2; i++) {
    pool_case *p = pools[i];
    int64_t nx = p->planes * p->hw * p->hw, ny = nx / 4;
    p->x = randn(nx, 30 + i, 1);
    p->y = randn(ny, 40 + i, 1);
    p->dy = randn(ny, 50 + i, 1);
    p->dx = randn(nx, 60 + i, 0);
    p->arg = ddp_alloc((size_t)ny * sizeof(int32_t));
    char name[64];
    snprintf(name, sizeof name, "relu+max_pool%d forward", i + 1);
    report(name, median_s(pool_fwd, p), 0);
    snprintf(name, sizeof name, "relu+max_pool%d backward", i + 1);
    report(name, median_s(pool_bwd, p), 0);
  }

  lin_case l = {randn(BATCH * 1568, 70, 1), randn(10 * 1568, 71, 0.02f), randn(10, 72, 0.02f),
                randn(BATCH * 10, 73, 1),   randn(BATCH * 10, 74, 1),      randn(BATCH * 1568, 75, 0),
                randn(10 * 1568, 76, 0),    randn(10, 77, 0)};
  report("linear forward", median_s(lin_fwd, &l), 2.0 * BATCH * 1568 * 10);
  report("linear backward (dx,dw,db)", median_s(lin_bwd, &l), 4.0 * BATCH * 1568 * 10);

  double flops = 2 * conv_flops(&c1) + 3 * conv_flops(&c2) + 6.0 * BATCH * 1568 * 10;
  printf("%-26s %8.3f ms  %7.1f GFLOP/s %3.0f%% of peak  (%.0f samples/s for the dense part "
         "alone)\n",
         "dense total", total_s * 1e3, flops / total_s / 1e9,
         100.0 * flops / total_s / 1e9 / peak_gflops, BATCH / total_s);

  printf("reference OpenBLAS sgemm 32x196x400 x%d (conv2 forward's gemm): %.1f GFLOP/s\n",
         BATCH, gemm_gflops(32, 196, 400, BATCH, false));
  printf("reference OpenBLAS sgemm 512x512x512:                       %.1f GFLOP/s\n",
         gemm_gflops(512, 512, 512, 4, false));
  if (ddp__cpu_has_avx512() || ddp__cpu_has_avx2())
    printf("ddp %s gemm 32x196x400 x%d, operands in cache:   %.1f GFLOP/s\n", family, BATCH,
           gemm_gflops(32, 196, 400, BATCH, true));

  conv_free(&c1);
  conv_free(&c2);
  for (int i = 0; i < 2; i++) {
    ddp_free(pools[i]->x);
    ddp_free(pools[i]->y);
    ddp_free(pools[i]->dy);
    ddp_free(pools[i]->dx);
    ddp_free(pools[i]->arg);
  }
  float *lf[] = {l.x, l.w, l.b, l.y, l.dy, l.dx, l.dw, l.db};
  for (int i = 0; i < 8; i++) ddp_free(lf[i]);
  ddp_arena_free(&arena);
  return 0;
}
