/* Autocast on a GPU against PyTorch 2.x's torch.autocast("cuda", bf16 /
 * fp16) (issue 42's Must show): the fixtures are made on the GPU machine by
 * the machine's own PyTorch (scripts/make_autocast_fixtures.py --device
 * cuda --out DIR, which scripts/gpu-amp-steps.sh runs) and named to this
 * test by DDP_AUTOCAST_CUDA_FIXTURES=DIR (autocast_cuda_bf16.bin,
 * autocast_cuda_fp16.bin). The ops and shapes are the CPU fixtures' (the
 * seeds' MNIST ConvNet, batch 2; tests/tensor/test_autocast.c): each op's
 * output dtype must be PyTorch's, and its values within
 *   ulp_low(max(|ours|, |torch|)) + 2 gamma_K S
 * (one ulp of the output dtype plus the float32 accumulation bound; the
 * fixtures are made with cuBLAS's reduced-precision reductions off, so
 * both sides accumulate in float32), float32 ops within a few float32
 * ulps; then the chain's loss and parameter gradients (backward outside
 * the region) normwise within 4 ulp_low(1), as on the CPU.
 * Exit 77 (skipped) without a GPU, or without the fixtures (saying so). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "cuda/cuda_test.h"
#include "support/fixture.h"
#include "tensor/autocast.h"
#include "tensor/tape.h"
#include "support/low_precision.h"

#define GPU DDP_CUDA(0)

static const char *fixture_dir;

typedef struct ctx {
  fixture *fx;
  ddp_dtype low;
  const char *name;
  ddp_tape *tape;
  ddp_tensor *owned[64]; /* GPU tensors made here, destroyed at the end */
  int n_owned;
} ctx;

static const fixture_tensor *need(const ctx *c, const char *name) {
  const fixture_tensor *t = fixture_find(c->fx, name);
  if (!t) fail_msg("autocast_cuda_%s.bin: no record %s", c->name, name);
  return t;
}

static ddp_tensor *gpu_from(ctx *c, ddp_dtype dtype, int ndim, const int64_t *shape,
                            const void *data, bool param) {
  ddp_tensor host, *t;
  assert_int_equal(ddp_tensor_wrap(&host, dtype, ndim, shape, (void *)data), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&t, dtype, ndim, shape, GPU), DDP_OK);
  assert_int_equal(ddp_tensor_copy(t, &host), DDP_OK);
  if (param) {
    t->flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
    assert_int_equal(ddp_tensor_ensure_grad(t), DDP_OK);
  }
  assert_true(c->n_owned < 64);
  c->owned[c->n_owned++] = t;
  return t;
}

/* A fixture record on the GPU, marked `mark` (an earlier op's output). */
static ddp_tensor *load(ctx *c, const char *name, bool param, ddp_dtype mark) {
  const fixture_tensor *f = need(c, name);
  assert_int_equal(f->dtype, DDP_FLOAT32);
  ddp_tensor *t = gpu_from(c, DDP_FLOAT32, f->ndim, f->shape, f->data, param);
  ddp__autocast_mark(t, mark, false);
  return t;
}

static float *to_host(const ddp_tensor *t) {
  float *h = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *h);
  ddp_tensor dst;
  assert_int_equal(ddp_tensor_wrap(&dst, DDP_FLOAT32, t->ndim, t->shape, h), DDP_OK);
  assert_int_equal(ddp_tensor_copy(&dst, t), DDP_OK);
  return h;
}

static float *grad_to_host(const ddp_tensor *t) {
  ddp_tensor g = *t;
  g.data = t->grad;
  g.grad = NULL;
  return to_host(&g);
}

static void check_op(const ctx *c, const char *op, const ddp_tensor *y, const double *slack,
                     double abs_slack) {
  char key[64];
  snprintf(key, sizeof key, "%s.dtype", op);
  const ddp_dtype want = (ddp_dtype)((const int64_t *)need(c, key)->data)[0];
  if (ddp_tensor_values_dtype(y) != want)
    fail_msg("cuda %s %s: output dtype %s, torch's %s", c->name, op,
             ddp_dtype_name(ddp_tensor_values_dtype(y)), ddp_dtype_name(want));
  snprintf(key, sizeof key, "%s.y", op);
  const fixture_tensor *ref = need(c, key);
  assert_int_equal(ref->numel, y->numel);
  float *ours = to_host(y);
  const float *theirs = ref->data;
  double worst = 0;
  for (int64_t i = 0; i < y->numel; i++) {
    const double d = fabs((double)ours[i] - theirs[i]);
    const double bound = ulp_of(fmax(fabs(ours[i]), fabs(theirs[i])), want) +
                         (slack ? slack[i] : 0) + abs_slack;
    if (!(d <= bound))
      fail_msg("cuda %s %s[%lld]: ours %.9g, torch %.9g, |diff| %.3g > bound %.3g", c->name, op,
               (long long)i, ours[i], theirs[i], d, bound);
    if (d / bound > worst) worst = d / bound;
  }
  if (want != DDP_FLOAT32) assert_true(exact_in(ours, y->numel, want));
  printf("  cuda %s %-14s %-9s %8lld values, worst |diff|/bound %.3f\n", c->name, op,
         ddp_dtype_name(want), (long long)y->numel, worst);
  free(ours);
}

static double *conv_slack(const float *x, const float *w, const float *b, int64_t n, int64_t ci,
                          int64_t h, int64_t co, int64_t k, ddp_dtype low) {
  const int64_t oh = h - k + 1, terms = ci * k * k + 1;
  double *s = malloc((size_t)(n * co * oh * oh) * sizeof *s);
  for (int64_t in = 0; in < n; in++)
    for (int64_t o = 0; o < co; o++)
      for (int64_t p = 0; p < oh; p++)
        for (int64_t q = 0; q < oh; q++) {
          double a = fabs(round_to(b[o], low));
          for (int64_t cc = 0; cc < ci; cc++)
            for (int64_t u = 0; u < k; u++)
              for (int64_t v = 0; v < k; v++)
                a += fabs((double)round_to(x[((in * ci + cc) * h + p + u) * h + q + v], low)) *
                     fabs((double)round_to(w[((o * ci + cc) * k + u) * k + v], low));
          /* + one low ulp of the sum's magnitude: ddp rounds the
           * convolution before adding the bias (at::_convolution's order:
           * cuDNN, then add_ of the bias); a build of PyTorch that fuses
           * the bias into cuDNN's call rounds once */
          s[((in * co + o) * oh + p) * oh + q] = 2 * gamma_k(terms) * a + ulp_of(a, low);
        }
  return s;
}

static double *linear_slack(const float *x, const float *w, const float *b, int64_t rows,
                            int64_t in, int64_t out, ddp_dtype low) {
  double *s = malloc((size_t)(rows * out) * sizeof *s);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < out; o++) {
      double a = b ? fabs(round_to(b[o], low)) : 0;
      for (int64_t k = 0; k < in; k++)
        a += fabs((double)round_to(x[r * in + k], low)) * fabs((double)round_to(w[o * in + k], low));
      s[r * out + o] = 2 * gamma_k(in + 1) * a;
    }
  return s;
}

static float *formula_weight(int64_t rows, int64_t cols) {
  float *w = malloc((size_t)(rows * cols) * sizeof *w);
  for (int64_t i = 0; i < rows * cols; i++) {
    const uint64_t h = ((1664525ull * (uint64_t)i + 1013904223ull) % (1ull << 32)) >> 8;
    w[i] = (float)((double)((int64_t)(h % 2001) - 1000) * 0x1p-17);
  }
  return w;
}

static bool open_ctx(ctx *c, ddp_dtype low, const char *name) {
  char path[1024];
  memset(c, 0, sizeof *c);
  c->low = low;
  c->name = name;
  snprintf(path, sizeof path, "%s/autocast_cuda_%s.bin", fixture_dir, name);
  if (fixture_load(path, &c->fx) != DDP_OK) fail_msg("%s: %s", path, ddp_last_error());
  assert_int_equal(ddp_tape_create(&c->tape, 1 << 24), DDP_OK);
  return true;
}

static void close_ctx(ctx *c) {
  ddp_tape_destroy(c->tape);
  for (int i = 0; i < c->n_owned; i++) ddp_tensor_destroy(c->owned[i]);
  fixture_free(c->fx);
}

static void parity(ddp_dtype low, const char *name) {
  ctx c;
  open_ctx(&c, low, name);
  const ddp_precision prec = low == DDP_BFLOAT16 ? DDP_PRECISION_BF16 : DDP_PRECISION_FP16;
  const fixture_tensor *tf = need(&c, "target");
  ddp_tensor *x = load(&c, "x", false, DDP_FLOAT32);
  ddp_tensor *target = gpu_from(&c, DDP_INT64, tf->ndim, tf->shape, tf->data, false);
  ddp_tensor *y, *h;
  double *sl;
  assert_int_equal(ddp_autocast_enter(prec), DDP_OK);
  ddp_tape_set_grad_enabled(c.tape, false);

  ddp_tensor *w1 = load(&c, "conv1.w", true, DDP_FLOAT32), *b1 = load(&c, "conv1.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_conv2d(c.tape, x, w1, b1, 1, 0, &y), DDP_OK);
  sl = conv_slack(need(&c, "x")->data, need(&c, "conv1.w")->data, need(&c, "conv1.b")->data, 2, 1,
                  28, 32, 3, low);
  check_op(&c, "conv1", y, sl, 0);
  free(sl);

  /* batch norm, training statistics: cuDNN's half-input batch norm on
   * torch's side, float32 statistics on ours; 8 float32 ulps + 1e-5 */
  ddp_tensor *c1 = load(&c, "conv1.y", false, low);
  ddp_tensor *bw = load(&c, "batch_norm.w", true, DDP_FLOAT32), *bb = load(&c, "batch_norm.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_batch_norm(c.tape, c1, bw, bb, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_OK);
  check_op(&c, "batch_norm", y, NULL, 1e-5);

  ddp_tensor *r1;
  assert_int_equal(ddp_relu(c.tape, c1, &r1), DDP_OK);
  ddp_tensor *w2 = load(&c, "conv2.w", true, DDP_FLOAT32), *b2 = load(&c, "conv2.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_conv2d(c.tape, r1, w2, b2, 1, 0, &y), DDP_OK);
  float *r1h = to_host(r1);
  sl = conv_slack(r1h, need(&c, "conv2.w")->data, need(&c, "conv2.b")->data, 2, 32, 26, 64, 3, low);
  check_op(&c, "conv2", y, sl, 0);
  free(sl);
  free(r1h);

  ddp_tensor *c2 = load(&c, "conv2.y", false, low), *p, *f;
  assert_int_equal(ddp_max_pool2d(c.tape, c2, 2, 2, &p), DDP_OK);
  assert_int_equal(ddp_flatten(c.tape, p, 1, &f), DDP_OK);
  float *fw = formula_weight(128, 9216);
  ddp_tensor *w3 = gpu_from(&c, DDP_FLOAT32, 2, (int64_t[]){128, 9216}, fw, true);
  ddp_tensor *b3 = load(&c, "fc1.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_linear(c.tape, f, w3, b3, &h), DDP_OK);
  float *fh = to_host(f);
  sl = linear_slack(fh, fw, need(&c, "fc1.b")->data, 2, 9216, 128, low);
  check_op(&c, "fc1", h, sl, 0);
  free(sl);
  free(fh);

  ddp_tensor *h1 = load(&c, "fc1.y", false, low), *hr;
  assert_int_equal(ddp_relu(c.tape, h1, &hr), DDP_OK);
  ddp_tensor *w4 = load(&c, "fc2.w", true, DDP_FLOAT32), *b4 = load(&c, "fc2.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_linear(c.tape, hr, w4, b4, &y), DDP_OK);
  float *hrh = to_host(hr);
  sl = linear_slack(hrh, need(&c, "fc2.w")->data, need(&c, "fc2.b")->data, 2, 128, 10, low);
  check_op(&c, "fc2", y, sl, 0);
  free(sl);
  ddp_tensor *mb = load(&c, "matmul.b", true, DDP_FLOAT32);
  assert_int_equal(ddp_matmul(c.tape, hr, mb, &y), DDP_OK);
  float *mbt = malloc(1280 * sizeof *mbt);
  const float *mbv = need(&c, "matmul.b")->data;
  for (int i = 0; i < 128; i++)
    for (int j = 0; j < 10; j++) mbt[j * 128 + i] = mbv[i * 10 + j];
  sl = linear_slack(hrh, mbt, NULL, 2, 128, 10, low);
  check_op(&c, "matmul", y, sl, 0);
  free(sl);
  free(mbt);
  free(hrh);

  /* CUDA's fp32 list: log_softmax and the losses in float32 */
  ddp_tensor *z = load(&c, "fc2.y", false, low), *ls, *loss;
  assert_int_equal(ddp_log_softmax(c.tape, z, &ls), DDP_OK);
  check_op(&c, "log_softmax", ls, NULL, 4 * 16 * U32);
  ddp_tensor *lsy = load(&c, "log_softmax.y", false, DDP_FLOAT32);
  assert_int_equal(ddp_nll_loss(c.tape, lsy, target, &loss), DDP_OK);
  check_op(&c, "nll_loss", loss, NULL, 4 * 16 * U32);
  assert_int_equal(ddp_cross_entropy(c.tape, z, target, &loss), DDP_OK);
  check_op(&c, "cross_entropy", loss, NULL, 4 * 16 * U32);
  ddp_tensor *mt = load(&c, "mse_target", false, DDP_FLOAT32);
  assert_int_equal(ddp_mse_loss(c.tape, z, mt, &loss), DDP_OK);
  check_op(&c, "mse_loss", loss, NULL, 4 * 16 * U32);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  free(fw);
  close_ctx(&c);
}

static double rel_err(const float *a, const float *b, int64_t n, double *norm) {
  double d = 0, nb = 0;
  for (int64_t i = 0; i < n; i++) {
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    nb += (double)b[i] * b[i];
  }
  *norm = sqrt(nb);
  return sqrt(d) / (sqrt(nb) > 0 ? sqrt(nb) : 1);
}

static void chain(ddp_dtype low, const char *name) {
  ctx c;
  open_ctx(&c, low, name);
  const ddp_precision prec = low == DDP_BFLOAT16 ? DDP_PRECISION_BF16 : DDP_PRECISION_FP16;
  float *fw = formula_weight(128, 9216);
  ddp_tensor *params[8] = {load(&c, "conv1.w", true, DDP_FLOAT32), load(&c, "conv1.b", true, DDP_FLOAT32),
                           load(&c, "conv2.w", true, DDP_FLOAT32), load(&c, "conv2.b", true, DDP_FLOAT32),
                           gpu_from(&c, DDP_FLOAT32, 2, (int64_t[]){128, 9216}, fw, true),
                           load(&c, "fc1.b", true, DDP_FLOAT32),
                           load(&c, "fc2.w", true, DDP_FLOAT32), load(&c, "fc2.b", true, DDP_FLOAT32)};
  const fixture_tensor *tf = need(&c, "target");
  ddp_tensor *x = load(&c, "x", false, DDP_FLOAT32);
  ddp_tensor *target = gpu_from(&c, DDP_INT64, tf->ndim, tf->shape, tf->data, false), *t, *loss;
  assert_int_equal(ddp_autocast_enter(prec), DDP_OK);
  assert_int_equal(ddp_conv2d(c.tape, x, params[0], params[1], 1, 0, &t), DDP_OK);
  assert_int_equal(ddp_relu(c.tape, t, &t), DDP_OK);
  assert_int_equal(ddp_conv2d(c.tape, t, params[2], params[3], 1, 0, &t), DDP_OK);
  assert_int_equal(ddp_max_pool2d(c.tape, t, 2, 2, &t), DDP_OK);
  assert_int_equal(ddp_flatten(c.tape, t, 1, &t), DDP_OK);
  assert_int_equal(ddp_linear(c.tape, t, params[4], params[5], &t), DDP_OK);
  assert_int_equal(ddp_relu(c.tape, t, &t), DDP_OK);
  assert_int_equal(ddp_linear(c.tape, t, params[6], params[7], &t), DDP_OK);
  assert_int_equal(ddp_log_softmax(c.tape, t, &t), DDP_OK);
  assert_int_equal(ddp_nll_loss(c.tape, t, target, &loss), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_tensor_values_dtype(loss), DDP_FLOAT32);
  assert_int_equal(ddp_backward(c.tape, loss), DDP_OK);
  float *lh = to_host(loss);
  const float ref_loss = *(const float *)need(&c, "chain.loss")->data;
  printf("  cuda %s chain loss ours %.9g torch %.9g\n", name, lh[0], ref_loss);
  assert_true(fabs(lh[0] - ref_loss) <= 2 * ulp_of(ref_loss, low));
  free(lh);
  static const char *const keys[8] = {"conv1.w", "conv1.b", "conv2.w", "conv2.b",
                                      "fc1.w",   "fc1.b",   "fc2.w",   "fc2.b"};
  const double tol = 4 * ulp_of(1.0, low);
  for (int i = 0; i < 8; i++) {
    ddp_tensor *prm = params[i];
    float *g = grad_to_host(prm);
    char key[64];
    double norm, err;
    assert_true(exact_in(g, prm->numel, low));
    if (i == 4) {
      const int64_t *rows = need(&c, "chain.fc1.w.grad_rows")->data;
      float *ours = malloc(4 * 9216 * sizeof *ours);
      for (int r = 0; r < 4; r++) memcpy(ours + r * 9216, g + rows[r] * 9216, 9216 * sizeof *ours);
      err = rel_err(ours, need(&c, "chain.fc1.w.grad_rows4")->data, 4 * 9216, &norm);
      free(ours);
      assert_true(norm > 0);
      double sumsq = 0;
      for (int64_t j = 0; j < prm->numel; j++) sumsq += (double)g[j] * g[j];
      const double ref = *(const double *)need(&c, "chain.fc1.w.grad_sumsq")->data;
      printf("  cuda %s chain fc1.w sum of squares ours %.6g torch %.6g\n", name, sumsq, ref);
      assert_true(fabs(sqrt(sumsq) - sqrt(ref)) <= tol * sqrt(ref));
    } else {
      snprintf(key, sizeof key, "chain.%s.grad", keys[i]);
      err = rel_err(g, need(&c, key)->data, prm->numel, &norm);
    }
    printf("  cuda %s chain d%-8s ||ours - torch|| / ||torch|| = %.3g (bound %.3g)\n", name,
           keys[i], err, tol);
    if (!(err <= tol)) fail_msg("cuda %s chain d%s: relative error %.3g > %.3g", name, keys[i], err, tol);
    free(g);
  }
  free(fw);
  close_ctx(&c);
}

static void test_parity_bf16(void **state) {
  (void)state;
  parity(DDP_BFLOAT16, "bf16");
}
static void test_parity_fp16(void **state) {
  (void)state;
  parity(DDP_FLOAT16, "fp16");
}
static void test_chain_bf16(void **state) {
  (void)state;
  chain(DDP_BFLOAT16, "bf16");
}
static void test_chain_fp16(void **state) {
  (void)state;
  chain(DDP_FLOAT16, "fp16");
}

int main(void) {
  cuda_test_require_device();
  fixture_dir = getenv("DDP_AUTOCAST_CUDA_FIXTURES");
  if (!fixture_dir || !*fixture_dir) {
    printf("SKIP: DDP_AUTOCAST_CUDA_FIXTURES is not set (the GPU machine's PyTorch makes them: "
           "scripts/make_autocast_fixtures.py --device cuda --out DIR; scripts/gpu-amp-steps.sh "
           "does both)\n");
    return CUDA_TEST_SKIP;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity_bf16), cmocka_unit_test(test_parity_fp16),
      cmocka_unit_test(test_chain_bf16),  cmocka_unit_test(test_chain_fp16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
