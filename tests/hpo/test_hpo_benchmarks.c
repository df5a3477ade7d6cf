/* The benchmark functions equal Propulate 1.2.2's at fixed points
 * (tests/fixtures/hpo_benchmarks.txt, made by
 * scripts/make_hpo_benchmarks_fixture.py with Propulate and numpy): each
 * within 1e-12 relative (numpy sums pairwise and may take its SIMD sin and
 * cos; ddp sums in order and takes libm's), with Propulate's dimensions and
 * limits; the known minima are minima; quartic's noise is N(0, 1) per term;
 * an unknown name lists the known ones. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

static void test_match_propulate(void **state) {
  (void)state;
  char path[4096], line[8192];
  const char *src = getenv("DDP_SOURCE_DIR");
  snprintf(path, sizeof path, "%s/tests/fixtures/hpo_benchmarks.txt", src ? src : ".");
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("cannot open %s", path);
  int checked = 0;
  while (fgets(line, sizeof line, f)) {
    if (line[0] == '#') continue;
    char name[32];
    int at = 0;
    double lo, hi, want, x[64];
    assert_int_equal(sscanf(line, "%31s %lf %lf %lf %n", name, &lo, &hi, &want, &at), 4);
    ddp_hpo_benchmark_fn fn;
    int dims;
    char spec[4096];
    if (ddp_hpo_benchmark(name, &fn, &dims, spec, sizeof spec) != DDP_OK)
      fail_msg("%s", ddp_last_error());
    char *p = line + at;
    for (int i = 0; i < dims; i++) x[i] = strtod(p, &p);
    double got = fn(x, dims);
    if (!(fabs(got - want) <= 1e-12 * fabs(want) + 1e-12))
      fail_msg("%s: %.17g, Propulate %.17g", name, got, want);
    /* The space: dims float traits over Propulate's limits. */
    ddp_hpo_space *s;
    assert_int_equal(ddp_hpo_space_parse(spec, &s), DDP_OK);
    assert_int_equal(ddp_hpo_space_size(s), dims);
    for (int i = 0; i < dims; i++) {
      const ddp_hpo_trait *t = ddp_hpo_space_trait(s, i);
      assert_true(t->kind == DDP_HPO_FLOAT && t->lo == lo && t->hi == hi);
    }
    if (dims > 26) assert_string_equal(ddp_hpo_space_trait(s, 26)->name, "A1");
    ddp_hpo_space_destroy(s);
    checked++;
  }
  fclose(f);
  assert_int_equal(checked, 36);
}

static void test_minima_and_noise(void **state) {
  (void)state;
  ddp_hpo_benchmark_fn fn;
  double zero[30] = {0}, ones[2] = {1, 1};
  assert_int_equal(ddp_hpo_benchmark("sphere", &fn, NULL, NULL, 0), DDP_OK);
  assert_true(fn(zero, 2) == 0);
  assert_int_equal(ddp_hpo_benchmark("rosenbrock", &fn, NULL, NULL, 0), DDP_OK);
  assert_true(fn(ones, 2) == 0);
  assert_int_equal(ddp_hpo_benchmark("rastrigin", &fn, NULL, NULL, 0), DDP_OK);
  assert_true(fabs(fn(zero, 20)) < 1e-12);
  assert_int_equal(ddp_hpo_benchmark("griewank", &fn, NULL, NULL, 0), DDP_OK);
  assert_true(fabs(fn(zero, 10)) < 1e-15);
  /* quartic at 0 is |sum of 30 N(0, 1)|: mean |N(0, 30)| = sqrt(60/pi). */
  ddp_pyrandom r;
  ddp_pyrandom_seed(&r, 5);
  double mean = 0;
  const int n = 4000;
  for (int i = 0; i < n; i++) mean += ddp_hpo_quartic(zero, 30, &r) / n;
  const double expect = sqrt(60 / M_PI), se = sqrt(30 * (1 - 2 / M_PI) / n);
  if (fabs(mean - expect) > 5 * se) fail_msg("quartic noise: mean %g, expected %g +- %g", mean, expect, se);
  assert_true(ddp_hpo_quartic(zero, 30, NULL) == 0);
  assert_int_equal(ddp_hpo_benchmark("ackley", &fn, NULL, NULL, 0), DDP_ERR_NOTFOUND);
  assert_non_null(strstr(ddp_last_error(), "no benchmark function 'ackley' (sphere, rosenbrock"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_match_propulate),
      cmocka_unit_test(test_minima_and_noise),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
