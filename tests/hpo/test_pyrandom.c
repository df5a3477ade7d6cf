/* ddp_pyrandom draws exactly what CPython 3.11's random.Random draws from
 * the same seed: every call of tests/fixtures/pyrandom.txt (made by
 * scripts/make_pyrandom_fixture.py with CPython), in order, compared bit for
 * bit: random, getrandbits up to 64 bits, randbelow up to 2^33, randint,
 * uniform, gauss (with its kept second value), sample by both of CPython's
 * methods (pool and set), shuffle; seeds 0, small, negative, above 2^32. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpo/hpo_internal.h"

static FILE *open_fixture(const char *name) {
  char path[4096];
  const char *src = getenv("DDP_SOURCE_DIR");
  snprintf(path, sizeof path, "%s/tests/fixtures/%s", src ? src : ".", name);
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("cannot open %s", path);
  return f;
}

static void test_matches_cpython(void **state) {
  (void)state;
  FILE *f = open_fixture("pyrandom.txt");
  char line[4096];
  ddp_pyrandom r;
  int lineno = 0, checked = 0, seeds = 0;
  int64_t idx[256], pool[256];
  bool taken[256];
  while (fgets(line, sizeof line, f)) {
    lineno++;
    if (line[0] == '#') continue;
    char op[32];
    int at = 0;
    if (sscanf(line, "%31s %n", op, &at) != 1) continue;
    const char *rest = line + at;
    bool ok = true;
    if (!strcmp(op, "seed")) {
      long long s;
      sscanf(rest, "%lld", &s);
      ddp_pyrandom_seed(&r, s);
      seeds++;
      continue;
    } else if (!strcmp(op, "random")) {
      double want;
      sscanf(rest, "%lf", &want);
      ok = ddp_pyrandom_random(&r) == want;
    } else if (!strcmp(op, "getrandbits")) {
      int k;
      uint64_t want;
      sscanf(rest, "%d %" SCNu64, &k, &want);
      ok = ddp_pyrandom_getrandbits(&r, k) == want;
    } else if (!strcmp(op, "below")) {
      uint64_t n, want;
      sscanf(rest, "%" SCNu64 " %" SCNu64, &n, &want);
      ok = ddp_pyrandom_below(&r, n) == want;
    } else if (!strcmp(op, "randint")) {
      long long a, b, want;
      sscanf(rest, "%lld %lld %lld", &a, &b, &want);
      ok = ddp_pyrandom_randint(&r, a, b) == want;
    } else if (!strcmp(op, "uniform")) {
      double a, b, want;
      sscanf(rest, "%lf %lf %lf", &a, &b, &want);
      ok = ddp_pyrandom_uniform(&r, a, b) == want;
    } else if (!strcmp(op, "gauss")) {
      double mu, sigma, want;
      sscanf(rest, "%lf %lf %lf", &mu, &sigma, &want);
      ok = ddp_pyrandom_gauss(&r, mu, sigma) == want;
    } else if (!strcmp(op, "sample") || !strcmp(op, "shuffle")) {
      const bool sample = op[1] == 'a';
      char *p = (char *)rest, *end;
      long n = strtol(p, &end, 10), k = n;
      p = end;
      if (sample) {
        k = strtol(p, &end, 10);
        p = end;
      }
      assert_true(n <= 256 && k <= n);
      if (sample) {
        ddp__pyrandom_sample(&r, n, k, idx, pool, taken);
      } else {
        for (long i = 0; i < n; i++) idx[i] = i;
        ddp__pyrandom_shuffle(&r, idx, n);
      }
      for (long i = 0; i < k; i++) ok &= idx[i] == strtol(p, &p, 10);
    } else {
      fail_msg("pyrandom.txt:%d: unknown call '%s'", lineno, op);
    }
    if (!ok) fail_msg("pyrandom.txt:%d: %s %s differs from CPython", lineno, op, rest);
    checked++;
  }
  fclose(f);
  assert_int_equal(seeds, 7);
  assert_true(checked > 250);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_matches_cpython)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
