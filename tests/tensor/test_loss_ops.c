/* log_softmax and the losses (mse_loss, nll_loss, cross_entropy): backward
 * against central finite differences, forward against closed forms in double
 * and a small fixture computed with PyTorch 1.13, stability, errors. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "support/gradcheck.h"
#include "tensor/tape.h"

static ddp_tape *new_tape(void) {
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  return tape;
}

static ddp_tensor *labels(int64_t n, const int64_t *values) {
  ddp_tensor *t;
  int64_t shape[1] = {n};
  assert_int_equal(ddp_tensor_create(&t, DDP_INT64, 1, shape), DDP_OK);
  memcpy(t->data, values, (size_t)n * sizeof(int64_t));
  return t;
}

static ddp_status fn_log_softmax(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  (void)u;
  return ddp_log_softmax(t, in[0], out);
}
static ddp_status fn_mse(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  (void)u;
  return ddp_mse_loss(t, in[0], in[1], out);
}
static ddp_status fn_nll(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  return ddp_nll_loss(t, in[0], u, out);
}
static ddp_status fn_cross_entropy(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  return ddp_cross_entropy(t, in[0], u, out);
}
/* nll(log_softmax(x)): must agree with the fused cross_entropy. */
static ddp_status fn_nll_of_log_softmax(ddp_tape *t, ddp_tensor **in, void *u, ddp_tensor **out) {
  ddp_tensor *lp;
  DDP_TRY(ddp_log_softmax(t, in[0], &lp));
  return ddp_nll_loss(t, lp, u, out);
}

static void test_losses_gradcheck(void **state) {
  (void)state;
  int64_t s[2] = {5, 7}, s3[3] = {2, 3, 19};
  const int64_t tv[5] = {0, 6, 3, 3, 1};
  ddp_tensor *target = labels(5, tv);
  ddp_tensor *x = gradcheck_random(2, s, -3, 3, 1, true);
  ddp_tensor *x3 = gradcheck_random(3, s3, -3, 3, 2, true); /* rows of 19: lanes and tail */
  ddp_tensor *xy[2] = {gradcheck_random(2, s, -1, 1, 3, true),
                       gradcheck_random(2, s, -1, 1, 4, true)};
  assert_int_equal(gradcheck("log_softmax", fn_log_softmax, &x, 1, NULL, 1e-2, 1e-4, 2e-3), 0);
  assert_int_equal(gradcheck("log_softmax 3d", fn_log_softmax, &x3, 1, NULL, 1e-2, 1e-4, 2e-3), 0);
  assert_int_equal(gradcheck("mse_loss", fn_mse, xy, 2, NULL, 1e-2, 1e-4, 1e-3), 0);
  assert_int_equal(gradcheck("nll_loss", fn_nll, &x, 1, target, 1e-2, 1e-4, 1e-3), 0);
  assert_int_equal(gradcheck("cross_entropy", fn_cross_entropy, &x, 1, target, 1e-2, 1e-4, 2e-3),
                   0);
  assert_int_equal(
      gradcheck("nll(log_softmax)", fn_nll_of_log_softmax, &x, 1, target, 1e-2, 1e-4, 2e-3), 0);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(x3);
  ddp_tensor_destroy(xy[0]);
  ddp_tensor_destroy(xy[1]);
  ddp_tensor_destroy(target);
}

/* Values and gradients computed with PyTorch 1.13:
 *   x = [[1,2,3,-1],[0.5,-1,2,0.25],[10,-3,0,4]], t = [2,0,3]
 *   F.cross_entropy(x, t) = 2.76383972; F.nll_loss(x, t) = -2.5;
 *   F.mse_loss(x, 0.5) = 10.880208; F.log_softmax(x, 1) and x.grad below. */
static void test_losses_against_torch(void **state) {
  (void)state;
  float xv[12] = {1, 2, 3, -1, 0.5f, -1, 2, 0.25f, 10, -3, 0, 4};
  const float torch_log_softmax[12] = {
      -2.4197165966033936f,    -1.4197165966033936f, -0.41971665620803833f, -4.419716835021973f,
      -1.869279146194458f,     -3.369279146194458f,  -0.36927908658981323f, -2.119279146194458f,
      -0.0025232164189219475f, -13.002523422241211f, -10.002523422241211f,  -6.002523422241211f};
  const float torch_grad[12] = {
      0.02964894101023674f,  0.08059418201446533f,  -0.11425566673278809f,   0.004012546967715025f,
      -0.28192174434661865f, 0.011471479199826717f, 0.23041081428527832f,    0.04003939777612686f,
      0.3324933350086212f,   7.51544291688333e-07f, 1.5095170056156348e-05f, -0.3325091600418091f};
  const int64_t tv[3] = {2, 0, 3};
  int64_t s[2] = {3, 4};
  ddp_tensor x, half;
  float hv[12];
  for (int i = 0; i < 12; i++) hv[i] = 0.5f;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, s, xv), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&half, DDP_FLOAT32, 2, s, hv), DDP_OK);
  x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  ddp_tensor *target = labels(3, tv);
  ddp_tape *tape = new_tape();
  ddp_tensor *ce, *nll, *mse, *lsm;
  assert_int_equal(ddp_cross_entropy(tape, &x, target, &ce), DDP_OK);
  assert_int_equal(ce->ndim, 0);
  assert_int_equal(ce->numel, 1);
  assert_float_equal(ddp_tensor_f32(ce)[0], 2.76383972f, 2e-6);
  assert_int_equal(ddp_backward(tape, ce), DDP_OK);
  assert_int_equal(allclose("cross_entropy grad vs torch", x.grad, torch_grad, 12, 0, 2e-7), 0);
  ddp_tape_reset(tape);
  ddp_tape_set_grad_enabled(tape, false);
  assert_int_equal(ddp_nll_loss(tape, &x, target, &nll), DDP_OK);
  assert_true(ddp_tensor_f32(nll)[0] == -2.5f);
  assert_int_equal(ddp_mse_loss(tape, &x, &half, &mse), DDP_OK);
  assert_float_equal(ddp_tensor_f32(mse)[0], 10.880208f, 2e-6);
  assert_int_equal(ddp_log_softmax(tape, &x, &lsm), DDP_OK);
  assert_int_equal(allclose("log_softmax vs torch", lsm->data, torch_log_softmax, 12, 0, 1e-6), 0);
  ddp_tensor_free_grad(&x);
  ddp_tensor_destroy(target);
  ddp_tape_destroy(tape);
}

/* Larger random cases against double-precision closed forms. */
static void test_losses_forward_closed_forms(void **state) {
  (void)state;
  enum { N = 33, C = 45 };
  int64_t s[2] = {N, C};
  ddp_tensor *x = gradcheck_random(2, s, -20, 20, 5, false);
  ddp_tensor *z = gradcheck_random(2, s, -20, 20, 6, false);
  int64_t tv[N];
  for (int i = 0; i < N; i++) tv[i] = (i * 7) % C;
  ddp_tensor *target = labels(N, tv);
  ddp_tape *tape = new_tape();
  ddp_tensor *lsm, *ce, *nll, *mse;
  assert_int_equal(ddp_log_softmax(tape, x, &lsm), DDP_OK);
  assert_int_equal(ddp_cross_entropy(tape, x, target, &ce), DDP_OK);
  assert_int_equal(ddp_nll_loss(tape, x, target, &nll), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape, x, z, &mse), DDP_OK);
  const float *xd = x->data, *zd = z->data;
  double ce_sum = 0, nll_sum = 0, mse_sum = 0;
  for (int i = 0; i < N; i++) {
    double m = -INFINITY, s_exp = 0;
    for (int j = 0; j < C; j++) m = fmax(m, xd[i * C + j]);
    for (int j = 0; j < C; j++) s_exp += exp(xd[i * C + j] - m);
    double lse = m + log(s_exp);
    for (int j = 0; j < C; j++)
      assert_true(fabs(ddp_tensor_f32(lsm)[i * C + j] - (xd[i * C + j] - lse)) < 4e-6);
    ce_sum += lse - xd[i * C + tv[i]];
    nll_sum -= xd[i * C + tv[i]];
  }
  for (int i = 0; i < N * C; i++) mse_sum += pow((double)xd[i] - zd[i], 2);
  assert_true(fabs(ddp_tensor_f32(ce)[0] - ce_sum / N) < 1e-6 * fabs(ce_sum / N) + 1e-6);
  assert_true(fabs(ddp_tensor_f32(nll)[0] - nll_sum / N) < 1e-6 * fabs(nll_sum / N) + 1e-6);
  assert_true(fabs(ddp_tensor_f32(mse)[0] - mse_sum / (N * C)) < 1e-6 * mse_sum / (N * C));
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(z);
  ddp_tensor_destroy(target);
}

/* Huge logits must not overflow: the row maximum is subtracted first. */
static void test_log_softmax_stability(void **state) {
  (void)state;
  float xv[6] = {1000, 1001, 999, -1000, -1001, -999};
  int64_t s[2] = {2, 3};
  ddp_tensor x;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, s, xv), DDP_OK);
  ddp_tape *tape = new_tape();
  ddp_tensor *y, *ce;
  assert_int_equal(ddp_log_softmax(tape, &x, &y), DDP_OK);
  /* log_softmax([1, 2, 0]) = [-1.40760596, -0.40760596, -2.40760596] */
  const float expect[6] = {-1.40760596f, -0.40760596f, -2.40760596f,
                           -1.40760596f, -2.40760596f, -0.40760596f};
  for (int i = 0; i < 6; i++) assert_float_equal(ddp_tensor_f32(y)[i], expect[i], 1e-6);
  const int64_t tv[2] = {1, 2};
  ddp_tensor *target = labels(2, tv);
  assert_int_equal(ddp_cross_entropy(tape, &x, target, &ce), DDP_OK);
  assert_float_equal(ddp_tensor_f32(ce)[0], 0.40760596f, 1e-6);
  ddp_tensor_destroy(target);
  ddp_tape_destroy(tape);
}

static void test_loss_errors(void **state) {
  (void)state;
  int64_t s[2] = {3, 5}, st[2] = {5, 3}, s3[3] = {3, 5, 1};
  ddp_tensor *x = gradcheck_random(2, s, -1, 1, 7, false);
  ddp_tensor *xt = gradcheck_random(2, st, -1, 1, 8, false);
  ddp_tensor *x3 = gradcheck_random(3, s3, -1, 1, 9, false);
  int64_t fs[1] = {3};
  ddp_tensor *ftarget = gradcheck_random(1, fs, 0, 3, 10, false);
  const int64_t bad[3] = {0, 4, 7}, neg[3] = {0, -100, 1}, ok[3] = {0, 1, 2}, four[4] = {0};
  ddp_tensor *tbad = labels(3, bad), *tneg = labels(3, neg), *tok = labels(3, ok);
  ddp_tensor *t4 = labels(4, four);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_nll_loss(tape, x, ftarget, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(),
                      "nll_loss: target is float32, expected int64 class indices");
  assert_int_equal(ddp_cross_entropy(tape, x, ftarget, &y), DDP_ERR_INVALID);
  assert_int_equal(ddp_nll_loss(tape, x, tbad, &y), DDP_ERR_RANGE);
  assert_string_equal(ddp_last_error(), "nll_loss: target[2] = 7 is out of range for 5 classes");
  assert_int_equal(ddp_cross_entropy(tape, x, tneg, &y), DDP_ERR_RANGE);
  assert_string_equal(ddp_last_error(),
                      "cross_entropy: target[1] = -100 is out of range for 5 classes");
  assert_int_equal(ddp_cross_entropy(tape, x, t4, &y), DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(),
                      "cross_entropy: target (4) does not match logits (3,5) (expected (3))");
  assert_int_equal(ddp_cross_entropy(tape, x3, tok, &y), DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(), "cross_entropy: logits (3,5,1) must be (N, C)");
  assert_int_equal(ddp_nll_loss(tape, NULL, tok, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "nll_loss: log_probs is NULL");
  assert_int_equal(ddp_cross_entropy(tape, x, NULL, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "cross_entropy: target is NULL");
  assert_int_equal(ddp_mse_loss(tape, x, xt, &y), DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(), "mse_loss: input (3,5) and target (5,3) differ in shape");
  assert_int_equal(ddp_mse_loss(tape, x, tok, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "mse_loss: argument 1 is int64, expected float32");
  assert_int_equal(ddp_log_softmax(tape, NULL, &y), DDP_ERR_INVALID);
  assert_string_equal(ddp_last_error(), "log_softmax: input is NULL");
  assert_int_equal(ddp_cross_entropy(tape, x, tok, &y), DDP_OK);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(xt);
  ddp_tensor_destroy(x3);
  ddp_tensor_destroy(ftarget);
  ddp_tensor_destroy(tbad);
  ddp_tensor_destroy(tneg);
  ddp_tensor_destroy(tok);
  ddp_tensor_destroy(t4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_losses_gradcheck),
      cmocka_unit_test(test_losses_against_torch),
      cmocka_unit_test(test_losses_forward_closed_forms),
      cmocka_unit_test(test_log_softmax_stability),
      cmocka_unit_test(test_loss_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
