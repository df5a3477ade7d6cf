/* Every op of the tensor layer on a GPU against the same op on the CPU,
 * through the tape (issue 26): the same random inputs on both devices, the
 * forward's output, then backward from the same random projection of it,
 * and every input's gradient (and batch norm's running statistics),
 * compared with the bound max|cuda - cpu| <= 1e-5 max|cpu| + 1e-7 per
 * tensor (tests/cuda/cuda_test.h). The shapes are the seeds' models':
 * ConvNet (conv 5x5 pad 2, batch norm, 2x2 pooling, fc 1568 -> 10), PSNet
 * (conv 3x3, dropout, fc 9216 -> 128, log_softmax + NLL), ToyModel (fc
 * 10 -> 10 -> 5, MSE), with small batches. One line per op reports the
 * largest relative difference. Without a GPU: skipped (exit 77). */
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
#include "tensor/tape.h"

#define MAX_IN 5
#define GPU DDP_CUDA(0)

/* One input on both devices. */
typedef struct pair {
  ddp_tensor *cpu, *gpu;
} pair;

static ddp_rng rng;

static pair make_pair(ddp_dtype dtype, int ndim, const int64_t *shape, bool requires_grad) {
  pair p;
  assert_int_equal(ddp_tensor_create(&p.cpu, dtype, ndim, shape), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&p.gpu, dtype, ndim, shape, GPU), DDP_OK);
  if (requires_grad) {
    p.cpu->flags |= DDP_TENSOR_REQUIRES_GRAD;
    p.gpu->flags |= DDP_TENSOR_REQUIRES_GRAD;
  }
  return p;
}

/* Uniform in [lo, hi), the same values on both devices. */
static pair random_pair(int ndim, const int64_t *shape, float lo, float hi, bool requires_grad) {
  pair p = make_pair(DDP_FLOAT32, ndim, shape, requires_grad);
  float *v = ddp_tensor_f32(p.cpu);
  for (int64_t i = 0; i < p.cpu->numel; i++) v[i] = ddp_rng_uniform_range(&rng, lo, hi);
  assert_int_equal(ddp_tensor_copy(p.gpu, p.cpu), DDP_OK);
  return p;
}

static pair labels_pair(int64_t n, int64_t classes) {
  pair p = make_pair(DDP_INT64, 1, &n, false);
  int64_t *v = ddp_tensor_i64(p.cpu);
  for (int64_t i = 0; i < n; i++) v[i] = (int64_t)(ddp_rng_uniform(&rng) * classes) % classes;
  assert_int_equal(ddp_tensor_copy(p.gpu, p.cpu), DDP_OK);
  return p;
}

static void free_pair(pair *p) {
  ddp_tensor_destroy(p->cpu);
  ddp_tensor_destroy(p->gpu);
}

/* The n floats at `data` on `device`, on the host (malloc'd). */
static float *to_host(const float *data, int64_t n, ddp_device device) {
  float *h = malloc((size_t)(n ? n : 1) * sizeof(float));
  assert_non_null(h);
  ddp_tensor dst, src;
  assert_int_equal(ddp_tensor_wrap(&dst, DDP_FLOAT32, 1, &n, h), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&src, DDP_FLOAT32, 1, &n, (void *)data), DDP_OK);
  src.device = device;
  assert_int_equal(ddp_tensor_copy(&dst, &src), DDP_OK);
  return h;
}

/* Compares `n` floats on the GPU with the CPU's; returns the largest
 * difference relative to the CPU values' largest magnitude. */
static double compare(const char *op, const char *what, const float *gpu, const float *cpu,
                      int64_t n) {
  float *g = to_host(gpu, n, GPU);
  char label[128];
  snprintf(label, sizeof label, "%s: %s", op, what);
  int ok = cuda_test_close(label, g, cpu, n);
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < n; i++) {
    worst = fmax(worst, fabs((double)g[i] - cpu[i]));
    scale = fmax(scale, fabs(cpu[i]));
  }
  free(g);
  assert_true(ok);
  return scale > 0 ? worst / scale : worst;
}

/* An op under test: runs on `in` (all on one device) with its own
 * arguments, recording on tape. */
typedef ddp_status (*op_fn)(ddp_tape *tape, ddp_tensor **in, void *arg, ddp_tensor **out);

/* Runs f on both devices, compares the outputs, backpropagates the same
 * random projection on both and compares every input's gradient; inputs
 * that are float buffers without grad (running stats) are compared too,
 * since ops update them in place. */
static void check_op(const char *name, op_fn f, void *arg, pair *in, int n_in) {
  ddp_tape *tc, *tg;
  assert_int_equal(ddp_tape_create(&tc, 1 << 20), DDP_OK);
  assert_int_equal(ddp_tape_create(&tg, 1 << 20), DDP_OK);
  ddp_tensor *ic[MAX_IN], *ig[MAX_IN];
  for (int i = 0; i < n_in; i++) ic[i] = in[i].cpu, ig[i] = in[i].gpu;
  ddp_tensor *oc, *og;
  assert_int_equal(f(tc, ic, arg, &oc), DDP_OK);
  ddp_status s = f(tg, ig, arg, &og);
  if (s != DDP_OK) fail_msg("%s on cuda: %s", name, ddp_last_error());
  assert_true(ddp_device_equal(og->device, GPU) || ddp_device_equal(og->device, DDP_CPU));
  double worst = 0;
  if (ddp_device_equal(og->device, GPU))
    worst = compare(name, "output", og->data, oc->data, oc->numel);
  else
    assert_true(cuda_test_close(name, og->data, oc->data, oc->numel));
  if (oc->flags & DDP_TENSOR_REQUIRES_GRAD) {
    float *seed = malloc((size_t)oc->numel * sizeof(float));
    for (int64_t i = 0; i < oc->numel; i++) seed[i] = ddp_rng_uniform_range(&rng, -1, 1);
    assert_int_equal(ddp__backward_from(tc, oc, seed), DDP_OK);
    s = ddp__backward_from(tg, og, seed);
    if (s != DDP_OK) fail_msg("%s backward on cuda: %s", name, ddp_last_error());
    free(seed);
    for (int i = 0; i < n_in; i++) {
      if (!in[i].cpu || !in[i].cpu->grad) continue;
      assert_non_null(in[i].gpu->grad);
      char what[32];
      snprintf(what, sizeof what, "grad of input %d", i);
      worst = fmax(worst, compare(name, what, in[i].gpu->grad, in[i].cpu->grad, in[i].cpu->numel));
    }
  }
  for (int i = 0; i < n_in; i++) { /* buffers the op updates in place */
    if (!in[i].cpu || in[i].cpu->dtype != DDP_FLOAT32 ||
        (in[i].cpu->flags & DDP_TENSOR_REQUIRES_GRAD))
      continue;
    char what[32];
    snprintf(what, sizeof what, "input %d after the op", i);
    worst = fmax(worst, compare(name, what, in[i].gpu->data, in[i].cpu->data, in[i].cpu->numel));
  }
  assert_int_equal(ddp_device_synchronize(GPU), DDP_OK);
  printf("%-34s max |cuda - cpu| / max |cpu| = %.3g\n", name, worst);
  for (int i = 0; i < n_in; i++) {
    if (!in[i].cpu) continue;
    ddp_tensor_free_grad(in[i].cpu);
    ddp_tensor_free_grad(in[i].gpu);
  }
  ddp_tape_destroy(tc);
  ddp_tape_destroy(tg);
}

/* ---- the ops ---- */

static ddp_status op_linear(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_linear(t, in[0], in[1], in[2], out);
}
static ddp_status op_matmul(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_matmul(t, in[0], in[1], out);
}
typedef struct conv_arg {
  int stride, pad;
} conv_arg;
static ddp_status op_conv(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  const conv_arg *c = a;
  return ddp_conv2d(t, in[0], in[1], in[2], c->stride, c->pad, out);
}
typedef struct pool_arg {
  int kernel, stride;
} pool_arg;
static ddp_status op_max_pool(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  const pool_arg *p = a;
  return ddp_max_pool2d(t, in[0], p->kernel, p->stride, out);
}
static ddp_status op_relu_max_pool(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  const pool_arg *p = a;
  return ddp_relu_max_pool2d(t, in[0], p->kernel, p->stride, out);
}
static ddp_status op_relu(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_relu(t, in[0], out);
}
static ddp_status op_sigmoid(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_sigmoid(t, in[0], out);
}
static ddp_status op_tanh(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_tanh(t, in[0], out);
}
/* Dropout draws its mask on the host from this generator, reseeded before
 * each device's run, so both draw the same mask. */
static ddp_rng dropout_rng;
static ddp_status op_dropout(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  ddp_rng_seed(&dropout_rng, 1234);
  return ddp_dropout(t, in[0], *(float *)a, true, &dropout_rng, out);
}
static ddp_status op_dropout2d(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  ddp_rng_seed(&dropout_rng, 1234);
  return ddp_dropout2d(t, in[0], *(float *)a, true, &dropout_rng, out);
}
static ddp_status op_batch_norm(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_batch_norm(t, in[0], in[1], in[2], in[3], in[4], NULL, *(bool *)a, 0.1f, 1e-5f, out);
}
static ddp_status op_bn_relu_pool(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_batch_norm_relu_max_pool2d(t, in[0], in[1], in[2], in[3], in[4], NULL, *(bool *)a,
                                        0.1f, 1e-5f, NULL, 2, 2, out);
}
static ddp_status op_log_softmax(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_log_softmax(t, in[0], out);
}
static ddp_status op_nll(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  ddp_tensor *logp;
  DDP_TRY(ddp_log_softmax(t, in[0], &logp));
  return ddp_nll_loss(t, logp, in[1], out);
}
static ddp_status op_cross_entropy(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_cross_entropy(t, in[0], in[1], out);
}
static ddp_status op_mse(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_mse_loss(t, in[0], in[1], out);
}
static ddp_status op_add(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  return ddp_add(t, in[0], in[1], out);
}
/* flatten then linear: the view's gradient handed to its input */
static ddp_status op_flatten_linear(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  ddp_tensor *f;
  DDP_TRY(ddp_flatten(t, in[0], 1, &f));
  return ddp_linear(t, f, in[1], in[2], out);
}
/* Across devices: x goes to the GPU for relu and comes back (on the CPU
 * side of the comparison both moves are no-ops). */
static ddp_status op_to_and_back(ddp_tape *t, ddp_tensor **in, void *a, ddp_tensor **out) {
  ddp_tensor *x = in[0], *on, *r;
  DDP_TRY(ddp_to(t, x, *(ddp_device *)a, &on));
  DDP_TRY(ddp_tanh(t, on, &r));
  return ddp_to(t, r, x->device, out);
}

/* ---- tests ---- */

static void test_linear(void **state) {
  const int64_t cases[][3] = {{100, 1568, 10}, {64, 9216, 128}, {100, 128, 10}, {20, 10, 10},
                              {20, 10, 5}, {7, 32, 32}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    int64_t xs[2] = {cases[c][0], cases[c][1]}, ws[2] = {cases[c][2], cases[c][1]},
            bs[1] = {cases[c][2]};
    pair in[3] = {random_pair(2, xs, -1, 1, true), random_pair(2, ws, -0.1f, 0.1f, true),
                  random_pair(1, bs, -0.1f, 0.1f, true)};
    char name[64];
    snprintf(name, sizeof name, "linear %lldx%lld->%lld", (long long)xs[0], (long long)xs[1],
             (long long)ws[0]);
    check_op(name, op_linear, NULL, in, 3);
    for (int i = 0; i < 3; i++) free_pair(&in[i]);
  }
  int64_t as[2] = {64, 33}, bs2[2] = {33, 17};
  pair mm[2] = {random_pair(2, as, -1, 1, true), random_pair(2, bs2, -1, 1, true)};
  check_op("matmul 64x33 @ 33x17", op_matmul, NULL, mm, 2);
  free_pair(&mm[0]);
  free_pair(&mm[1]);
}

static void test_conv2d(void **state) {
  /* n, c, h, w, o, k, stride, pad */
  const int64_t cases[][8] = {{8, 1, 28, 28, 16, 5, 1, 2}, {8, 16, 14, 14, 32, 5, 1, 2},
                              {4, 1, 28, 28, 32, 3, 1, 0}, {4, 32, 26, 26, 64, 3, 1, 0},
                              {3, 3, 11, 9, 5, 3, 2, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    const int64_t *g = cases[c];
    int64_t xs[4] = {g[0], g[1], g[2], g[3]}, ws[4] = {g[4], g[1], g[5], g[5]}, bs[1] = {g[4]};
    float bound = 1.0f / sqrtf((float)(g[1] * g[5] * g[5]));
    pair in[3] = {random_pair(4, xs, -1, 1, true), random_pair(4, ws, -bound, bound, true),
                  random_pair(1, bs, -bound, bound, true)};
    conv_arg a = {(int)g[6], (int)g[7]};
    char name[64];
    snprintf(name, sizeof name, "conv2d %lld->%lld k%lld s%lld p%lld", (long long)g[1],
             (long long)g[4], (long long)g[5], (long long)g[6], (long long)g[7]);
    check_op(name, op_conv, &a, in, 3);
    for (int i = 0; i < 3; i++) free_pair(&in[i]);
  }
}

static void test_pooling(void **state) {
  int64_t xs[4] = {8, 16, 28, 28};
  pair x = random_pair(4, xs, -1, 1, true);
  /* ties: every fourth value repeated within a window */
  float *v = ddp_tensor_f32(x.cpu);
  for (int64_t i = 0; i + 1 < x.cpu->numel; i += 4) v[i + 1] = v[i];
  assert_int_equal(ddp_tensor_copy(x.gpu, x.cpu), DDP_OK);
  pool_arg p2 = {2, 2}, p3 = {3, 2};
  check_op("max_pool2d 2x2", op_max_pool, &p2, &x, 1);
  check_op("relu_max_pool2d 2x2", op_relu_max_pool, &p2, &x, 1);
  check_op("max_pool2d 3x3 stride 2 (overlap)", op_max_pool, &p3, &x, 1);
  free_pair(&x);
}

static void test_activations(void **state) {
  int64_t n[1] = {100000};
  pair x = random_pair(1, n, -4, 4, true);
  check_op("relu", op_relu, NULL, &x, 1);
  check_op("sigmoid", op_sigmoid, NULL, &x, 1);
  check_op("tanh", op_tanh, NULL, &x, 1);
  free_pair(&x);
}

static void test_dropout(void **state) {
  int64_t a[2] = {100, 128}, b[4] = {8, 64, 12, 12};
  pair x = random_pair(2, a, -1, 1, true), y = random_pair(4, b, -1, 1, true);
  float p25 = 0.25f, p5 = 0.5f;
  check_op("dropout p=0.5", op_dropout, &p5, &x, 1);
  check_op("dropout2d p=0.25", op_dropout2d, &p25, &y, 1);
  free_pair(&x);
  free_pair(&y);
}

static void bn_case(const char *name, op_fn f, int64_t n, int64_t c, int64_t hw_side, bool training) {
  int64_t xs[4] = {n, c, hw_side, hw_side}, cs[1] = {c};
  pair in[5] = {random_pair(4, xs, -2, 3, true), random_pair(1, cs, 0.5f, 1.5f, true),
                random_pair(1, cs, -0.5f, 0.5f, true), random_pair(1, cs, -0.2f, 0.2f, false),
                random_pair(1, cs, 0.5f, 2.0f, false)};
  check_op(name, f, &training, in, 5);
  for (int i = 0; i < 5; i++) free_pair(&in[i]);
}

static void test_batch_norm(void **state) {
  bn_case("batch_norm train (8,16,28,28)", op_batch_norm, 8, 16, 28, true);
  bn_case("batch_norm train (8,32,14,14)", op_batch_norm, 8, 32, 14, true);
  bn_case("batch_norm eval (8,16,28,28)", op_batch_norm, 8, 16, 28, false);
  bn_case("bn_relu_max_pool2d train (8,16,28,28)", op_bn_relu_pool, 8, 16, 28, true);
  bn_case("bn_relu_max_pool2d train (8,32,14,14)", op_bn_relu_pool, 8, 32, 14, true);
  bn_case("bn_relu_max_pool2d eval (8,16,28,28)", op_bn_relu_pool, 8, 16, 28, false);
}

static void test_losses(void **state) {
  const int64_t rows[] = {100, 1024};
  for (int r = 0; r < 2; r++) {
    int64_t s[2] = {rows[r], 10};
    pair in[2] = {random_pair(2, s, -3, 3, true), labels_pair(rows[r], 10)};
    char name[64];
    snprintf(name, sizeof name, "log_softmax (%lld,10)", (long long)rows[r]);
    check_op(name, op_log_softmax, NULL, in, 1);
    snprintf(name, sizeof name, "log_softmax+nll_loss (%lld,10)", (long long)rows[r]);
    check_op(name, op_nll, NULL, in, 2);
    snprintf(name, sizeof name, "cross_entropy (%lld,10)", (long long)rows[r]);
    check_op(name, op_cross_entropy, NULL, in, 2);
    free_pair(&in[0]);
    free_pair(&in[1]);
  }
  int64_t m[2] = {20, 5};
  pair mse[2] = {random_pair(2, m, -1, 1, true), random_pair(2, m, -1, 1, true)};
  check_op("mse_loss (20,5)", op_mse, NULL, mse, 2);
  check_op("add (20,5)", op_add, NULL, mse, 2);
  free_pair(&mse[0]);
  free_pair(&mse[1]);
}

static void test_views(void **state) {
  int64_t xs[4] = {10, 32, 7, 7}, ws[2] = {10, 1568}, bs[1] = {10};
  pair in[3] = {random_pair(4, xs, -1, 1, true), random_pair(2, ws, -0.03f, 0.03f, true),
                random_pair(1, bs, -0.03f, 0.03f, true)};
  check_op("flatten+linear (ConvNet's fc)", op_flatten_linear, NULL, in, 3);
  for (int i = 0; i < 3; i++) free_pair(&in[i]);
}

/* ddp_to inside one graph: a CPU input visits the GPU and comes back; its
 * gradient equals the all-CPU one. */
static void test_to_across_devices(void **state) {
  int64_t n[2] = {20, 10};
  pair x = random_pair(2, n, -2, 2, true);
  ddp_tape *tc, *tg;
  assert_int_equal(ddp_tape_create(&tc, 1 << 16), DDP_OK);
  assert_int_equal(ddp_tape_create(&tg, 1 << 16), DDP_OK);
  ddp_device cpu = DDP_CPU, gpu = GPU;
  ddp_tensor *oc, *og;
  assert_int_equal(op_to_and_back(tc, &x.cpu, &cpu, &oc), DDP_OK);
  ddp_tensor *xg;
  assert_int_equal(ddp_tensor_create(&xg, DDP_FLOAT32, 2, n), DDP_OK); /* a CPU copy */
  memcpy(xg->data, x.cpu->data, (size_t)x.cpu->numel * sizeof(float));
  xg->flags |= DDP_TENSOR_REQUIRES_GRAD;
  assert_int_equal(op_to_and_back(tg, &xg, &gpu, &og), DDP_OK);
  assert_true(ddp_device_equal(og->device, DDP_CPU));
  assert_true(cuda_test_close("to: output", og->data, oc->data, oc->numel));
  float seed[200];
  for (int i = 0; i < 200; i++) seed[i] = ddp_rng_uniform_range(&rng, -1, 1);
  assert_int_equal(ddp__backward_from(tc, oc, seed), DDP_OK);
  assert_int_equal(ddp__backward_from(tg, og, seed), DDP_OK);
  assert_true(cuda_test_close("to: grad", xg->grad, x.cpu->grad, x.cpu->numel));
  printf("%-34s equal within the bound\n", "to(cuda:0) -> tanh -> to(cpu)");
  ddp_tensor_destroy(xg);
  free_pair(&x);
  ddp_tape_destroy(tc);
  ddp_tape_destroy(tg);
}

int main(void) {
  cuda_test_require_device();
  ddp_rng_seed(&rng, 26);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear),     cmocka_unit_test(test_conv2d),
      cmocka_unit_test(test_pooling),    cmocka_unit_test(test_activations),
      cmocka_unit_test(test_dropout),    cmocka_unit_test(test_batch_norm),
      cmocka_unit_test(test_losses),     cmocka_unit_test(test_views),
      cmocka_unit_test(test_to_across_devices),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
