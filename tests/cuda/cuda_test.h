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
 * b's scale. A NaN must be matched by a NaN at the same place (then the
 * pair counts as equal); a NaN on one side only fails. Prints the worst
 * element when the tensors differ. */
static inline int cuda_test_close(const char *what, const float *a, const float *b, long n) {
  double scale = 0, worst = 0;
  long at = -1, nan_at = -1;
  for (long i = 0; i < n; i++) {
    if (isnan(a[i]) || isnan(b[i])) {
      if (isnan(a[i]) != isnan(b[i]) && nan_at < 0) nan_at = i;
      continue;
    }
    if (fabs(b[i]) > scale) scale = fabs(b[i]);
    double d = fabs((double)a[i] - b[i]);
    if (d > worst) worst = d, at = i;
  }
  double bound = 1e-5 * scale + 1e-7;
  if (nan_at >= 0) {
    printf("%s: NaN on one side only at %ld (cuda %.9g, cpu %.9g)\n", what, nan_at,
           (double)a[nan_at], (double)b[nan_at]);
    return 0;
  }
  if (worst > bound) {
    printf("%s: max|cuda - cpu| = %.3g at %ld (cuda %.9g, cpu %.9g) > bound %.3g\n", what, worst,
           at, (double)a[at], (double)b[at], bound);
    return 0;
  }
  return 1;
}

#endif
