/* Shared by the `cuda` tests: they need a GPU, and where there is none
 * (every CI machine) they print why and exit 77, which CTest reports as
 * skipped (ddp_add_test's SKIP_RETURN_CODE for the `cuda` label). The
 * comparison bound of issue 26: a CUDA result a equals the CPU result b
 * when max|a - b| <= 1e-5 * max|b| + 1e-7 over the tensor. */
#ifndef DDP_TESTS_CUDA_TEST_H
#define DDP_TESTS_CUDA_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ddp/tensor.h"

#define CUDA_TEST_SKIP 77

/* Exits 77 ("no CUDA device: <reason>") unless a CUDA device is present. */
static inline void cuda_test_require_device(void) {
  if (ddp_cuda_device_count() > 0) return;
  const char *why = ddp_cuda_unavailable_reason();
  printf("no CUDA device: %s\n", why ? why : "unknown");
  fflush(stdout);
  exit(CUDA_TEST_SKIP);
}

/* max|a - b| over n floats, and whether it is within the bound against
 * b's scale. Prints the worst element when it is not. */
static inline int cuda_test_close(const char *what, const float *a, const float *b, long n) {
  double scale = 0, worst = 0;
  long at = -1;
  for (long i = 0; i < n; i++) {
    if (fabs(b[i]) > scale) scale = fabs(b[i]);
    double d = fabs((double)a[i] - b[i]);
    if (d > worst || (isnan(d) && at < 0) || isnan(a[i]) != isnan(b[i])) worst = d, at = i;
  }
  double bound = 1e-5 * scale + 1e-7;
  int ok = !(worst > bound) && (at < 0 || !isnan(worst) || isnan(b[at]));
  if (!ok)
    printf("%s: max|cuda - cpu| = %.3g at %ld (cuda %.9g, cpu %.9g) > bound %.3g\n", what,
           worst, at, at >= 0 ? a[at] : 0.0, at >= 0 ? b[at] : 0.0, bound);
  return ok;
}

#endif
