/* Finite-difference gradient checks for ops (tests only).
 *
 * gradcheck() runs `fn` on a fresh tape, projects its output onto fixed random
 * weights r (L = sum(r * out), in double), runs backward with seed r, and
 * compares every input's analytic gradient with central differences of L.
 * Inputs that do not have DDP_TENSOR_REQUIRES_GRAD are not checked.
 * Returns 0 when all agree within |a - n| <= atol + rtol * max|n| per input,
 * else prints the worst element and returns 1. */
#ifndef DDP_TEST_GRADCHECK_H
#define DDP_TEST_GRADCHECK_H

#include "ddp/ddp.h"

typedef ddp_status (*gradcheck_fn)(ddp_tape *tape, ddp_tensor **inputs, void *user,
                                   ddp_tensor **out);

int gradcheck(const char *what, gradcheck_fn fn, ddp_tensor **inputs, int n_inputs, void *user,
              double eps, double atol, double rtol);

/* A heap tensor filled with uniform values in [lo, hi) from `seed`, with
 * DDP_TENSOR_REQUIRES_GRAD set when requires_grad. Free with ddp_tensor_destroy. */
ddp_tensor *gradcheck_random(int ndim, const int64_t *shape, float lo, float hi, uint64_t seed,
                             bool requires_grad);

/* max|a - b| <= atol + rtol * max|b|, printing the worst element when not. */
int allclose(const char *what, const float *a, const float *b, int64_t n, double rtol,
             double atol);

#endif
