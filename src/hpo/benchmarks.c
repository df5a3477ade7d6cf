/* The benchmark functions of Propulate's paper and its code
 * (propulate/utils/benchmark_functions.py, 1.2.2): the same formulas, the
 * same dimensions and default limits, evaluated in the same order of
 * operations where numpy's order is sequential. For measuring the search,
 * not training: an evaluation costs nanoseconds, so what is timed is the
 * search's own machinery. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "hpo/hpo_internal.h"

/* x^2 as numpy's x ** 2 (multiplication, exact rounding as pow(x, 2)). */
static double sq(double x) { return x * x; }

static double sphere(const double *x, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += sq(x[i]);
  return s;
}

static double rosenbrock(const double *x, int n) {
  (void)n;
  return 100 * sq(sq(x[0]) - x[1]) + sq(1 - x[0]);
}

/* numpy's x.astype(int): truncation toward zero, summed as floats. */
static double step(const double *x, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += (double)(long long)x[i];
  return s;
}

static double rastrigin(const double *x, int n) {
  const double a = 10.0;
  double s = 0;
  for (int i = 0; i < n; i++) s += sq(x[i]) - a * cos(2 * M_PI * x[i]);
  return a * n + s;
}

static double griewank(const double *x, int n) {
  double s = 0, p = 1;
  for (int i = 0; i < n; i++) {
    s += sq(x[i]);
    p *= cos(x[i] / sqrt((double)(i + 1)));
  }
  return 1 + 1.0 / 4000 * s - p;
}

static double schwefel(const double *x, int n) {
  const double v = 418.982887;
  double s = 0;
  for (int i = 0; i < n; i++) s += x[i] * sin(sqrt(fabs(x[i])));
  return v * n - s;
}

/* bisphere's two spheres: the nearer one's value. */
static double bi_sphere_part(const double *x, int n) {
  const double d = 1, mu1 = 2.5;
  const double s = 1 - sqrt(1 / (2 * sqrt(n + 20.0) - 8.2));
  const double mu2 = -sqrt((sq(mu1) - d) / s);
  double s1 = 0, s2 = 0;
  for (int i = 0; i < n; i++) {
    s1 += sq(x[i] - mu1);
    s2 += sq(x[i] - mu2);
  }
  return fmin(s1, d * n + s * s2);
}

static double bisphere(const double *x, int n) { return bi_sphere_part(x, n); }

static double birastrigin(const double *x, int n) {
  double r = 0;
  for (int i = 0; i < n; i++) r += 1 - cos(2 * M_PI * (x[i] - 2.5));
  return bi_sphere_part(x, n) + 10 * r;
}

/* quartic: sum(i * x_i^4 + noise_i), noise N(0, 1) from the generator in
 * `noise` (Propulate draws numpy's global normal; the noise is the point,
 * not its source), or none when noise is NULL. */
static double quartic_with(const double *x, int n, ddp_pyrandom *noise) {
  double s = 0;
  for (int i = 0; i < n; i++) {
    double g = noise ? ddp_pyrandom_gauss(noise, 0.0, 1.0) : 0.0;
    s += (i + 1) * sq(sq(x[i])) + g;
  }
  return fabs(s);
}

typedef struct benchmark {
  const char *name;
  int dims;
  double lo, hi;
  double (*fn)(const double *x, int n);
} benchmark;

static double quartic_noiseless(const double *x, int n) { return quartic_with(x, n, NULL); }

static const benchmark benchmarks[] = {
    {"sphere", 2, -5.12, 5.12, sphere},
    {"rosenbrock", 2, -2.048, 2.048, rosenbrock},
    {"step", 5, -5.12, 5.12, step},
    {"quartic", 30, -1.28, 1.28, quartic_noiseless},
    {"rastrigin", 20, -5.12, 5.12, rastrigin},
    {"griewank", 10, -600.0, 600.0, griewank},
    {"schwefel", 10, -500.0, 500.0, schwefel},
    {"bisphere", 30, -5.12, 5.12, bisphere},
    {"birastrigin", 30, -5.12, 5.12, birastrigin},
};

/* Propulate's trait names: a..z, then A1, B1, ... */
static void trait_name(int i, char *buf, size_t bytes) {
  if (i < 26) snprintf(buf, bytes, "%c", 'a' + i);
  else snprintf(buf, bytes, "%c1", 'A' + (i - 26));
}

ddp_status ddp_hpo_benchmark(const char *name, ddp_hpo_benchmark_fn *fn, int *dims,
                             char *space, size_t space_bytes) {
  for (size_t k = 0; k < sizeof benchmarks / sizeof *benchmarks; k++) {
    const benchmark *b = &benchmarks[k];
    if (strcmp(b->name, name) != 0) continue;
    if (fn) *fn = b->fn;
    if (dims) *dims = b->dims;
    if (space) {
      size_t at = 0;
      space[0] = '\0';
      for (int i = 0; i < b->dims; i++) {
        char t[8];
        trait_name(i, t, sizeof t);
        int w = snprintf(space + at, space_bytes - at, "%s%s=float:%.17g:%.17g", i ? "," : "", t,
                         b->lo, b->hi);
        if (w < 0 || (size_t)w >= space_bytes - at)
          return ddp_error(DDP_ERR_RANGE, "hpo benchmark %s: its space needs more than %zu bytes",
                           name, space_bytes);
        at += (size_t)w;
      }
    }
    return DDP_OK;
  }
  return ddp_error(DDP_ERR_NOTFOUND,
                   "no benchmark function '%s' (sphere, rosenbrock, step, quartic, rastrigin, "
                   "griewank, schwefel, bisphere, birastrigin)", name);
}

double ddp_hpo_quartic(const double *x, int n, ddp_pyrandom *noise) {
  return quartic_with(x, n, noise);
}
