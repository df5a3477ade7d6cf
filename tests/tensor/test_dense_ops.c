/* Dense ops (matmul, linear, conv2d, max_pool2d and the fused pools): forward against naive loops
 * in double, backward against central finite differences and against naive
 * backward loops at the ConvNet's shapes, error codes and messages, and no
 * allocation in a steady-state step. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "support/gradcheck.h"
#include "tensor/cpu/dense.h"
#include "tensor/tape.h"

/* The kernel families a test compares in one process: the one chosen for
 * this process (AVX-512 where the CPU has it), the AVX2 one and the generic
 * one; a family this CPU cannot run is left out. */
static const int families[] = {-1, DDP__CPU_AVX2, DDP__CPU_GENERIC};
#define N_FAMILIES (sizeof families / sizeof families[0])
/* The family the running group of tests forces (-1: the chosen one), which
 * a test that compares families puts back when it is done. */
static int group_family = -1;

/* ---- naive references (double accumulation, direct loops) ---- */

static void ref_matmul(float *y, const float *a, const float *b, int64_t m, int64_t k,
                       int64_t n) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t l = 0; l < k; l++) s += (double)a[i * k + l] * b[l * n + j];
      y[i * n + j] = (float)s;
    }
}

typedef struct conv_cfg {
  int64_t n, c, h, w, o, kh, kw;
  int stride, pad;
  bool bias;
} conv_cfg;

static int64_t conv_out(int64_t size, int64_t k, int stride, int pad) {
  return (size + 2 * pad - k) / stride + 1;
}

static void ref_conv(float *y, const float *x, const float *w, const float *b,
                     const conv_cfg *q) {
  int64_t oh = conv_out(q->h, q->kh, q->stride, q->pad), ow = conv_out(q->w, q->kw, q->stride, q->pad);
  for (int64_t n = 0; n < q->n; n++)
    for (int64_t o = 0; o < q->o; o++)
      for (int64_t i = 0; i < oh; i++)
        for (int64_t j = 0; j < ow; j++) {
          double s = b ? b[o] : 0.0;
          for (int64_t c = 0; c < q->c; c++)
            for (int64_t a = 0; a < q->kh; a++)
              for (int64_t e = 0; e < q->kw; e++) {
                int64_t ih = i * q->stride - q->pad + a, iw = j * q->stride - q->pad + e;
                if (ih < 0 || ih >= q->h || iw < 0 || iw >= q->w) continue;
                s += (double)x[((n * q->c + c) * q->h + ih) * q->w + iw] *
                     w[((o * q->c + c) * q->kh + a) * q->kw + e];
              }
          y[((n * q->o + o) * oh + i) * ow + j] = (float)s;
        }
}

/* dx, dw, db from dy by direct loops (each may be NULL). */
static void ref_conv_backward(double *dx, double *dw, double *db, const float *dy, const float *x,
                              const float *w, const conv_cfg *q) {
  int64_t oh = conv_out(q->h, q->kh, q->stride, q->pad), ow = conv_out(q->w, q->kw, q->stride, q->pad);
  for (int64_t n = 0; n < q->n; n++)
    for (int64_t o = 0; o < q->o; o++)
      for (int64_t i = 0; i < oh; i++)
        for (int64_t j = 0; j < ow; j++) {
          double g = dy[((n * q->o + o) * oh + i) * ow + j];
          if (db) db[o] += g;
          for (int64_t c = 0; c < q->c; c++)
            for (int64_t a = 0; a < q->kh; a++)
              for (int64_t e = 0; e < q->kw; e++) {
                int64_t ih = i * q->stride - q->pad + a, iw = j * q->stride - q->pad + e;
                if (ih < 0 || ih >= q->h || iw < 0 || iw >= q->w) continue;
                int64_t xi = ((n * q->c + c) * q->h + ih) * q->w + iw;
                int64_t wi = ((o * q->c + c) * q->kh + a) * q->kw + e;
                if (dx) dx[xi] += g * w[wi];
                if (dw) dw[wi] += g * x[xi];
              }
        }
}

static void ref_pool(float *y, int64_t *arg, const float *x, int64_t planes, int64_t h,
                     int64_t w, int k, int s) {
  int64_t oh = (h - k) / s + 1, ow = (w - k) / s + 1;
  for (int64_t p = 0; p < planes; p++)
    for (int64_t i = 0; i < oh; i++)
      for (int64_t j = 0; j < ow; j++) {
        int64_t best = -1;
        for (int64_t a = 0; a < k; a++)
          for (int64_t b = 0; b < k; b++) {
            int64_t at = p * h * w + (i * s + a) * w + j * s + b;
            if (best < 0 || x[at] > x[best]) best = at;
          }
        y[(p * oh + i) * ow + j] = x[best];
        if (arg) arg[(p * oh + i) * ow + j] = best;
      }
}

static float *to_float(const double *d, int64_t n) {
  float *f = ddp_alloc((size_t)n * sizeof(float) + 4);
  for (int64_t i = 0; i < n; i++) f[i] = (float)d[i];
  return f;
}

static ddp_tape *new_tape(void) {
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  return tape;
}

/* ---- matmul ---- */

static ddp_status matmul_fn(ddp_tape *tape, ddp_tensor **in, void *user, ddp_tensor **out) {
  (void)user;
  return ddp_matmul(tape, in[0], in[1], out);
}

static void test_matmul(void **state) {
  (void)state;
  const int64_t dims[][3] = {{5, 7, 3}, {1, 4, 6}, {33, 17, 9}};
  for (int t = 0; t < 3; t++) {
    int64_t m = dims[t][0], k = dims[t][1], n = dims[t][2];
    int64_t sa[2] = {m, k}, sb[2] = {k, n};
    ddp_tensor *in[2] = {gradcheck_random(2, sa, -1, 1, 10 + t, true),
                         gradcheck_random(2, sb, -1, 1, 20 + t, true)};
    ddp_tape *tape = new_tape();
    ddp_tensor *y;
    assert_int_equal(ddp_matmul(tape, in[0], in[1], &y), DDP_OK);
    assert_int_equal(y->ndim, 2);
    assert_int_equal(y->shape[0], m);
    assert_int_equal(y->shape[1], n);
    float *ref = ddp_alloc((size_t)(m * n) * sizeof(float));
    ref_matmul(ref, in[0]->data, in[1]->data, m, k, n);
    assert_int_equal(allclose("matmul forward", y->data, ref, m * n, 1e-5, 1e-5), 0);
    ddp_free(ref);
    ddp_tape_destroy(tape);
    if (m * k < 200)
      assert_int_equal(gradcheck("matmul", matmul_fn, in, 2, NULL, 1e-2, 1e-3, 1e-3), 0);
    ddp_tensor_destroy(in[0]);
    ddp_tensor_destroy(in[1]);
  }
}

/* ---- linear ---- */

static ddp_status linear_fn(ddp_tape *tape, ddp_tensor **in, void *user, ddp_tensor **out) {
  (void)user;
  return ddp_linear(tape, in[0], in[1], in[2], out);
}

static void test_linear(void **state) {
  (void)state;
  /* x (2, 3, 5): linear accepts any leading dimensions, as PyTorch does. */
  const int64_t sx3[3] = {2, 3, 5}, sw[2] = {4, 5}, sb[1] = {4};
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    ddp_tensor *in[3] = {gradcheck_random(3, sx3, -1, 1, 31, true),
                         gradcheck_random(2, sw, -1, 1, 32, true),
                         with_bias ? gradcheck_random(1, sb, -1, 1, 33, true) : NULL};
    ddp_tape *tape = new_tape();
    ddp_tensor *y;
    assert_int_equal(ddp_linear(tape, in[0], in[1], in[2], &y), DDP_OK);
    assert_int_equal(y->ndim, 3);
    assert_int_equal(y->shape[2], 4);
    /* reference: y = x @ W^T + b with explicit loops */
    float ref[24];
    const float *x = in[0]->data, *w = in[1]->data;
    for (int r = 0; r < 6; r++)
      for (int o = 0; o < 4; o++) {
        double s = with_bias ? ((float *)in[2]->data)[o] : 0.0;
        for (int i = 0; i < 5; i++) s += (double)x[r * 5 + i] * w[o * 5 + i];
        ref[r * 4 + o] = (float)s;
      }
    assert_int_equal(allclose("linear forward", y->data, ref, 24, 1e-5, 1e-5), 0);
    ddp_tape_destroy(tape);
    assert_int_equal(gradcheck("linear", linear_fn, in, 3, NULL, 1e-2, 1e-3, 1e-3), 0);
    for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
  }
}

/* ---- conv2d ---- */

static ddp_status conv_fn(ddp_tape *tape, ddp_tensor **in, void *user, ddp_tensor **out) {
  const conv_cfg *q = user;
  return ddp_conv2d(tape, in[0], in[1], in[2], q->stride, q->pad, out);
}

static const conv_cfg conv_shapes[] = {
    /* n, c, h, w, o, kh, kw, stride, pad, bias */
    {2, 3, 7, 6, 4, 3, 3, 1, 1, true},   /* same-size, non-square input */
    {2, 3, 7, 6, 4, 3, 2, 2, 0, false},  /* stride 2, non-square kernel, no bias */
    {1, 1, 9, 8, 3, 5, 5, 1, 2, true},   /* conv1-like: C = 1, k5 p2, batch 1 */
    {3, 2, 8, 9, 2, 5, 5, 2, 2, true},   /* stride 2, padding 2 */
    {2, 4, 5, 5, 3, 1, 1, 1, 0, true},   /* 1x1: the im2col-free path */
    {1, 2, 10, 7, 3, 3, 3, 3, 1, false}, /* stride 3 */
    {2, 2, 3, 3, 2, 5, 5, 1, 1, true},   /* kernel exactly fills the padded input */
    {1, 3, 4, 4, 2, 1, 1, 2, 1, true},   /* 1x1 but strided and padded: im2col */
    {2, 3, 7, 6, 4, 3, 2, 1, 1, true},   /* non-square kernel, stride 1: flipped dx */
    {1, 2, 4, 5, 3, 2, 2, 1, 2, true},   /* padding > kernel - 1: dx by col2im */
    {1, 2, 5, 37, 3, 3, 3, 1, 1, true},  /* rows wider than two 16-lane vectors */
    {2, 2, 6, 20, 9, 3, 3, 1, 1, true},  /* rows of two vectors */
    {1, 3, 4, 19, 2, 3, 3, 1, 0, false}, /* rows of 17: one lane in the second vector */
    {2, 2, 5, 4, 33, 3, 3, 1, 1, true},  /* O >= 32: dW^T through a transposed dy */
    {1, 2, 6, 5, 32, 3, 3, 2, 1, false}, /* the same, strided (explicit columns) */
    {2, 10, 6, 20, 10, 3, 3, 1, 1, true}, /* convnet-N's 10 channels: shifted copies */
    /* Winograd F(2x2, 3x3) (cpu/winograd.c: 3x3, stride 1, >= 16 channels
     * each side, even outputs up to 30 wide), forward and dX: */
    {1, 16, 6, 6, 16, 3, 3, 1, 1, true},   /* same padding: a padded copy */
    {1, 16, 6, 18, 16, 3, 3, 1, 0, true},  /* valid: read in place; rows of 16 outputs */
    {1, 16, 4, 30, 17, 3, 3, 1, 1, false}, /* rows of 30 (the widest); 17 output channels */
};

static void make_conv_inputs(const conv_cfg *q, ddp_tensor **in, uint64_t seed, bool x_grad) {
  int64_t sx[4] = {q->n, q->c, q->h, q->w}, sw[4] = {q->o, q->c, q->kh, q->kw}, sb[1] = {q->o};
  in[0] = gradcheck_random(4, sx, -1, 1, seed, x_grad);
  in[1] = gradcheck_random(4, sw, -1, 1, seed + 1, true);
  in[2] = q->bias ? gradcheck_random(1, sb, -1, 1, seed + 2, true) : NULL;
}

static void test_conv2d_forward(void **state) {
  (void)state;
  for (size_t t = 0; t < sizeof conv_shapes / sizeof *conv_shapes; t++) {
    const conv_cfg *q = &conv_shapes[t];
    ddp_tensor *in[3];
    make_conv_inputs(q, in, 100 + 10 * t, false);
    ddp_tape *tape = new_tape();
    ddp_tensor *y;
    assert_int_equal(ddp_conv2d(tape, in[0], in[1], in[2], q->stride, q->pad, &y), DDP_OK);
    int64_t oh = conv_out(q->h, q->kh, q->stride, q->pad), ow = conv_out(q->w, q->kw, q->stride, q->pad);
    assert_int_equal(y->ndim, 4);
    assert_int_equal(y->shape[0], q->n);
    assert_int_equal(y->shape[1], q->o);
    assert_int_equal(y->shape[2], oh);
    assert_int_equal(y->shape[3], ow);
    float *ref = ddp_alloc((size_t)y->numel * sizeof(float));
    ref_conv(ref, in[0]->data, in[1]->data, in[2] ? in[2]->data : NULL, q);
    char label[64];
    snprintf(label, sizeof label, "conv2d forward shape %zu", t);
    assert_int_equal(allclose(label, y->data, ref, y->numel, 1e-5, 1e-5), 0);
    ddp_free(ref);
    ddp_tape_destroy(tape);
    for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
  }
}

static void test_conv2d_gradcheck(void **state) {
  (void)state;
  for (size_t t = 0; t < sizeof conv_shapes / sizeof *conv_shapes; t++) {
    const conv_cfg *q = &conv_shapes[t];
    ddp_tensor *in[3];
    make_conv_inputs(q, in, 200 + 10 * t, true);
    char label[64];
    snprintf(label, sizeof label, "conv2d shape %zu", t);
    assert_int_equal(gradcheck(label, conv_fn, in, 3, (void *)q, 1e-2, 2e-3, 1e-3), 0);
    for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
  }
}

/* Backward at the ConvNet's shapes (batch 2) against direct loops; also
 * checks that an input that does not require grad gets no gradient while
 * the weight's is unchanged, and that gradients accumulate into existing
 * values. */
static void check_conv_backward(const conv_cfg *q, bool x_grad) {
  ddp_tensor *in[3];
  make_conv_inputs(q, in, 300, x_grad);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_conv2d(tape, in[0], in[1], in[2], q->stride, q->pad, &y), DDP_OK);
  float *ref = ddp_alloc((size_t)y->numel * sizeof(float));
  ref_conv(ref, in[0]->data, in[1]->data, in[2] ? in[2]->data : NULL, q);
  assert_int_equal(allclose("conv2d forward", y->data, ref, y->numel, 1e-5, 1e-5), 0);
  ddp_free(ref);
  float *dy = ddp_alloc((size_t)y->numel * sizeof(float));
  ddp_rng rng;
  ddp_rng_seed(&rng, 77);
  for (int64_t i = 0; i < y->numel; i++) dy[i] = ddp_rng_uniform_range(&rng, -1, 1);
  /* Pre-existing gradient values must be added to, not overwritten. */
  for (int i = 0; i < 3; i++) {
    if (!in[i] || !(in[i]->flags & DDP_TENSOR_REQUIRES_GRAD)) continue;
    assert_int_equal(ddp_tensor_ensure_grad(in[i]), DDP_OK);
    for (int64_t j = 0; j < in[i]->numel; j++) in[i]->grad[j] = 0.5f;
  }
  assert_int_equal(ddp__backward_from(tape, y, dy), DDP_OK);
  double *dx = ddp_calloc((size_t)in[0]->numel, sizeof(double));
  double *dw = ddp_calloc((size_t)in[1]->numel, sizeof(double));
  double *db = ddp_calloc((size_t)q->o, sizeof(double));
  ref_conv_backward(dx, dw, db, dy, in[0]->data, in[1]->data, q);
  for (int64_t j = 0; j < in[1]->numel; j++) dw[j] += 0.5;
  for (int64_t j = 0; j < q->o; j++) db[j] += 0.5;
  for (int64_t j = 0; j < in[0]->numel; j++) dx[j] += 0.5;
  float *f = to_float(dw, in[1]->numel);
  assert_int_equal(allclose("conv2d dweight", in[1]->grad, f, in[1]->numel, 1e-4, 1e-4), 0);
  ddp_free(f);
  f = to_float(db, q->o);
  assert_int_equal(allclose("conv2d dbias", in[2]->grad, f, q->o, 1e-4, 1e-4), 0);
  ddp_free(f);
  if (x_grad) {
    f = to_float(dx, in[0]->numel);
    assert_int_equal(allclose("conv2d dinput", in[0]->grad, f, in[0]->numel, 1e-4, 1e-4), 0);
    ddp_free(f);
  } else {
    assert_null(in[0]->grad);
  }
  ddp_free(dx);
  ddp_free(dw);
  ddp_free(db);
  ddp_free(dy);
  ddp_tape_destroy(tape);
  for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
}

static void test_conv2d_backward_convnet_shapes(void **state) {
  (void)state;
  const conv_cfg conv1 = {2, 1, 28, 28, 16, 5, 5, 1, 2, true};
  const conv_cfg conv2 = {2, 16, 14, 14, 32, 5, 5, 1, 2, true};
  check_conv_backward(&conv1, false); /* first layer: input is data */
  check_conv_backward(&conv1, true);
  check_conv_backward(&conv2, true);
  /* psnet's conv2 (seed 001), whose forward and dX run by Winograd */
  const conv_cfg psnet_conv2 = {2, 32, 26, 26, 64, 3, 3, 1, 0, true};
  check_conv_backward(&psnet_conv2, true);
}

/* ---- max_pool2d ---- */

typedef struct pool_cfg {
  int kernel, stride;
} pool_cfg;

static ddp_status pool_fn(ddp_tape *tape, ddp_tensor **in, void *user, ddp_tensor **out) {
  const pool_cfg *q = user;
  return ddp_max_pool2d(tape, in[0], q->kernel, q->stride, out);
}

/* Distinct values at least 0.01 apart in a shuffled order, so finite
 * differences with eps 1e-3 never cross a tie. */
static ddp_tensor *distinct_tensor(int ndim, const int64_t *shape, uint64_t seed) {
  ddp_tensor *t = gradcheck_random(ndim, shape, 0, 1, seed, true);
  float *d = t->data;
  for (int64_t i = 0; i < t->numel; i++) d[i] = 0.01f * (float)i - 1.0f;
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = t->numel - 1; i > 0; i--) {
    int64_t j = (int64_t)ddp_rng_below(&rng, (uint64_t)i + 1);
    float tmp = d[i];
    d[i] = d[j];
    d[j] = tmp;
  }
  return t;
}

static const struct {
  int64_t shape[4];
  int ndim;
  pool_cfg q;
} pool_cases[] = {
    {{2, 3, 6, 6}, 4, {2, 2}},  {{2, 3, 7, 5}, 4, {2, 2}}, /* floor mode drops the edge */
    {{1, 2, 7, 7}, 4, {3, 2}},  {{1, 2, 5, 6}, 4, {3, 1}}, /* overlapping windows */
    {{3, 6, 5}, 3, {2, 0}},                                 /* 3-D, stride 0 = kernel */
    {{1, 1, 4, 4}, 4, {4, 4}},  {{1, 2, 6, 41}, 4, {2, 2}}, /* rows of 20 outputs */
    {{2, 3, 14, 14}, 4, {2, 2}}, /* the ConvNet's layer2: rows of 7, whole vectors but the last */
};
#define N_POOL_CASES (sizeof pool_cases / sizeof *pool_cases)

/* The fold kernels (cpu/conv_fold.c) on their own, with arbitrary gradient
 * planes (through batch norm the bias's gradient is 0 but for rounding):
 * dw[o][c][a][b] = sum dy[n][o][y][x] * xpad[n][c][y+a][x+b] and
 * db[o] = sum dy[n][o], against the sums in double, on both paths, for row
 * widths of one vector, two, and more, kernel heights in the sliding
 * window and past it; adds into dw and db as given. */
static void test_conv_fold_kernels(void **state) {
  (void)state;
  const struct {
    int64_t c, h, k, pad;
  } cases[] = {{1, 8, 5, 2}, {2, 20, 3, 1}, {1, 36, 5, 2}, {2, 12, 9, 4}, {3, 28, 5, 0}};
  for (size_t fam = 0; fam < N_FAMILIES; fam++) {
    if (!ddp__cpu_force_family(families[fam])) continue; /* the CPU lacks it */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      ddp__conv2d_geom g = {.n = 3, .c = cases[i].c, .h = cases[i].h, .w = cases[i].h, .o = 2,
                            .kh = cases[i].k, .kw = cases[i].k, .stride = 1, .pad = cases[i].pad};
      g.oh = g.ow = g.h + 2 * g.pad - g.kh + 1;
      const int64_t k = g.c * g.kh * g.kw, ohw = g.oh * g.ow;
      int64_t sx[4] = {g.n, g.c, g.h, g.w}, sy[4] = {g.n, g.o, g.oh, g.ow};
      ddp_tensor *x = gradcheck_random(4, sx, -1, 1, 81 + i, false);
      ddp_tensor *dy = gradcheck_random(4, sy, -1, 1, 91 + i, false);
      const float *xd = x->data, *dyd = dy->data;
      float *dw = ddp_alloc((size_t)(g.o * k) * sizeof(float)), db[2] = {0.5f, -0.25f};
      for (int64_t t = 0; t < g.o * k; t++) dw[t] = 0.125f * (float)(t % 3);
      ddp_arena arena;
      ddp_arena_init(&arena, 1 << 16);
      ddp__conv2d_fold f;
      assert_int_equal(ddp__cpu_conv2d_fold_init(&f, xd, &g, &arena), DDP_OK);
      for (int64_t o = 0; o < g.o; o++) {
        for (int64_t n = 0; n < g.n; n++) ddp__cpu_conv2d_fold_plane(&f, dyd + (n * g.o + o) * ohw, n);
        ddp__cpu_conv2d_fold_channel(&f, dw + o * k, &db[o]);
      }
      for (int64_t o = 0; o < g.o; o++) {
        double sb = o == 0 ? 0.5 : -0.25, mag = 0;
        for (int64_t n = 0; n < g.n; n++)
          for (int64_t p = 0; p < ohw; p++) sb += dyd[(n * g.o + o) * ohw + p], mag += fabs(dyd[(n * g.o + o) * ohw + p]);
        if (fabs(db[o] - sb) > 1e-6 * mag + 1e-6)
          fail_msg("case %zu (%s): db[%lld] %g, expected %g", i, ddp_cpu_kernels(),
                   (long long)o, db[o], sb);
        for (int64_t c = 0; c < g.c; c++)
          for (int64_t a = 0; a < g.kh; a++)
            for (int64_t b = 0; b < g.kw; b++) {
              const int64_t t = (c * g.kh + a) * g.kw + b;
              double s = 0.125 * (double)((o * k + t) % 3);
              for (int64_t n = 0; n < g.n; n++)
                for (int64_t y = 0; y < g.oh; y++)
                  for (int64_t xx = 0; xx < g.ow; xx++) {
                    const int64_t iy = y + a - g.pad, ix = xx + b - g.pad;
                    if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                    s += (double)dyd[((n * g.o + o) * g.oh + y) * g.ow + xx] *
                         xd[((n * g.c + c) * g.h + iy) * g.w + ix];
                  }
              if (fabs(dw[o * k + t] - s) > 1e-5 * mag + 1e-6)
                fail_msg("case %zu (%s): dw[%lld][%lld] %g, expected %g", i,
                         ddp_cpu_kernels(), (long long)o, (long long)t,
                         dw[o * k + t], s);
            }
      }
      ddp_arena_free(&arena);
      ddp_free(dw);
      ddp_tensor_destroy(x);
      ddp_tensor_destroy(dy);
    }
  }
  ddp__cpu_force_family(group_family);
}

/* The patches' sums and Gram matrix (ddp__cpu_conv2d_fold_gram), against
 * the sums over every output position in double: psum[t] = sum of tap
 * t's input element, gram[t][u] = sum of taps t's and u's product (zero
 * padding included). Cases: the ConvNet's conv1 (1 channel, 5x5, pad 2,
 * 28x28, samples past one block), 2 and 3 channels (pairs of planes,
 * negative row offsets), no padding, a 3x3 and a 9x9 kernel (column
 * offsets in more than one pass), a plane of one row. Both paths. */
static void test_conv_fold_gram(void **state) {
  (void)state;
  const struct {
    int64_t n, c, h, w, k, pad;
  } cases[] = {{37, 1, 28, 28, 5, 2}, {3, 2, 20, 20, 3, 1}, {2, 3, 12, 9, 5, 0},
               {2, 2, 12, 12, 9, 4}, {4, 1, 1, 30, 1, 0}, {5, 1, 6, 7, 3, 2}};
  for (size_t fam = 0; fam < N_FAMILIES; fam++) {
    if (!ddp__cpu_force_family(families[fam])) continue; /* the CPU lacks it */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      ddp__conv2d_geom g = {.n = cases[i].n, .c = cases[i].c, .h = cases[i].h, .w = cases[i].w,
                            .o = 2, .kh = cases[i].k, .kw = cases[i].k, .stride = 1,
                            .pad = cases[i].pad};
      g.oh = g.h + 2 * g.pad - g.kh + 1;
      g.ow = g.w + 2 * g.pad - g.kw + 1;
      const int64_t k = g.c * g.kh * g.kw;
      int64_t sx[4] = {g.n, g.c, g.h, g.w};
      ddp_tensor *x = gradcheck_random(4, sx, -1, 1, 301 + i, false);
      const float *xd = x->data;
      double *gram = ddp_alloc((size_t)(k * k) * sizeof(double));
      double *psum = ddp_alloc((size_t)k * sizeof(double));
      double *patch = ddp_alloc((size_t)k * sizeof(double));
      double *want = ddp_alloc((size_t)(k * k) * sizeof(double));
      double *want_p = ddp_alloc((size_t)k * sizeof(double));
      for (int64_t t = 0; t < k * k; t++) want[t] = 0;
      for (int64_t t = 0; t < k; t++) want_p[t] = 0;
      double mag = 0;
      for (int64_t n = 0; n < g.n; n++)
        for (int64_t y = 0; y < g.oh; y++)
          for (int64_t xx = 0; xx < g.ow; xx++) {
            for (int64_t c = 0; c < g.c; c++)
              for (int64_t a = 0; a < g.kh; a++)
                for (int64_t b = 0; b < g.kw; b++) {
                  const int64_t iy = y + a - g.pad, ix = xx + b - g.pad;
                  patch[(c * g.kh + a) * g.kw + b] =
                      iy < 0 || iy >= g.h || ix < 0 || ix >= g.w
                          ? 0.0
                          : xd[((n * g.c + c) * g.h + iy) * g.w + ix];
                }
            for (int64_t t = 0; t < k; t++) {
              want_p[t] += patch[t];
              for (int64_t u = 0; u < k; u++) want[t * k + u] += patch[t] * patch[u];
            }
            mag += 1;
          }
      ddp_arena arena;
      ddp_arena_init(&arena, 1 << 16);
      ddp__conv2d_fold f;
      assert_int_equal(ddp__cpu_conv2d_fold_init(&f, xd, &g, &arena), DDP_OK);
      assert_int_equal(ddp__cpu_conv2d_fold_gram(&f, gram, psum, &arena), DDP_OK);
      /* products of values in [-1, 1]: each term at most 1, float sums
       * over blocks of samples */
      for (int64_t t = 0; t < k; t++) {
        if (fabs(psum[t] - want_p[t]) > 1e-5 * mag)
          fail_msg("case %zu (%s): psum[%lld] %g, expected %g", i, ddp_cpu_kernels(),
                   (long long)t, psum[t], want_p[t]);
        for (int64_t u = 0; u < k; u++)
          if (fabs(gram[t * k + u] - want[t * k + u]) > 1e-5 * mag)
            fail_msg("case %zu (%s): gram[%lld][%lld] %g, expected %g", i,
                     ddp_cpu_kernels(), (long long)t, (long long)u,
                     gram[t * k + u], want[t * k + u]);
      }
      ddp_arena_free(&arena);
      ddp_free(gram);
      ddp_free(psum);
      ddp_free(patch);
      ddp_free(want);
      ddp_free(want_p);
      ddp_tensor_destroy(x);
    }
  }
  ddp__cpu_force_family(group_family);
}

static void test_max_pool2d(void **state) {
  (void)state;
  const __typeof__(pool_cases[0]) *cases = pool_cases;
  for (size_t t = 0; t < N_POOL_CASES; t++) {
    ddp_tensor *x = distinct_tensor(cases[t].ndim, cases[t].shape, 400 + t);
    int k = cases[t].q.kernel, s = cases[t].q.stride ? cases[t].q.stride : k;
    ddp_tape *tape = new_tape();
    ddp_tensor *y;
    assert_int_equal(ddp_max_pool2d(tape, x, k, cases[t].q.stride, &y), DDP_OK);
    int64_t h = x->shape[x->ndim - 2], w = x->shape[x->ndim - 1];
    assert_int_equal(y->shape[y->ndim - 2], (h - k) / s + 1);
    assert_int_equal(y->shape[y->ndim - 1], (w - k) / s + 1);
    float *ref = ddp_alloc((size_t)y->numel * sizeof(float));
    ref_pool(ref, NULL, x->data, x->numel / (h * w), h, w, k, s);
    assert_int_equal(allclose("max_pool2d forward", y->data, ref, y->numel, 0, 0), 0);
    ddp_free(ref);
    ddp_tape_destroy(tape);
    char label[64];
    snprintf(label, sizeof label, "max_pool2d case %zu", t);
    assert_int_equal(gradcheck(label, pool_fn, &x, 1, (void *)&cases[t].q, 1e-3, 1e-3, 1e-3), 0);
    ddp_tensor_destroy(x);
  }
}

/* relu_max_pool2d against max_pool2d(relu(x)) run as two ops: equal values
 * and bitwise-equal gradients (the same windows pass the same seed values
 * in the same order), on data with negative and all-negative windows, ties
 * at zero, -0.0 and NaN; and against finite differences. */
static ddp_status relu_pool_fn(ddp_tape *tape, ddp_tensor **in, void *user, ddp_tensor **out) {
  const pool_cfg *q = user;
  return ddp_relu_max_pool2d(tape, in[0], q->kernel, q->stride, out);
}

static void test_relu_max_pool2d(void **state) {
  (void)state;
  for (size_t t = 0; t < N_POOL_CASES; t++) {
    const pool_cfg *q = &pool_cases[t].q;
    ddp_tensor *x = distinct_tensor(pool_cases[t].ndim, pool_cases[t].shape, 500 + t);
    float *d = x->data;
    /* distinct_tensor spans [-1, 0.01 numel - 1): push a third of the values
     * below zero so whole windows are negative, and plant the edge cases. */
    for (int64_t i = 0; i < x->numel; i++) d[i] -= 0.004f * (float)x->numel;
    d[0] = 0.0f, d[1] = -0.0f, d[x->numel / 2] = NAN, d[x->numel - 1] = 0.0f;
    ddp_tensor *y[2], *r;
    ddp_tape *tapes[2] = {new_tape(), new_tape()};
    assert_int_equal(ddp_relu_max_pool2d(tapes[0], x, q->kernel, q->stride, &y[0]), DDP_OK);
    assert_int_equal(ddp_relu(tapes[1], x, &r), DDP_OK);
    assert_int_equal(ddp_max_pool2d(tapes[1], r, q->kernel, q->stride, &y[1]), DDP_OK);
    assert_int_equal(y[0]->numel, y[1]->numel);
    const float *a = y[0]->data, *b = y[1]->data;
    for (int64_t i = 0; i < y[0]->numel; i++)
      assert_true(a[i] == b[i] || (isnan(a[i]) && isnan(b[i])));
    float *seed = ddp_alloc((size_t)y[0]->numel * sizeof(float));
    for (int64_t i = 0; i < y[0]->numel; i++) seed[i] = 0.5f + 0.25f * (float)(i % 7);
    float *grads[2];
    for (int k = 0; k < 2; k++) {
      assert_int_equal(ddp__backward_from(tapes[k], y[k], seed), DDP_OK);
      grads[k] = ddp_alloc((size_t)x->numel * sizeof(float));
      memcpy(grads[k], x->grad, (size_t)x->numel * sizeof(float));
      ddp_tensor_free_grad(x);
    }
    for (int64_t i = 0; i < x->numel; i++) assert_true(grads[0][i] == grads[1][i]);
    for (int k = 0; k < 2; k++) ddp_free(grads[k]), ddp_tape_destroy(tapes[k]);
    ddp_free(seed);
    ddp_tensor_destroy(x);
    /* Away from the kink at 0 and from NaN, finite differences agree. */
    x = distinct_tensor(pool_cases[t].ndim, pool_cases[t].shape, 600 + t);
    char label[64];
    snprintf(label, sizeof label, "relu_max_pool2d case %zu", t);
    assert_int_equal(gradcheck(label, relu_pool_fn, &x, 1, (void *)q, 1e-3, 1e-3, 1e-3), 0);
    ddp_tensor_destroy(x);
  }
}

/* batch_norm_relu_max_pool2d against batch_norm, relu and max_pool2d run as
 * three ops: equal outputs, bitwise-equal gradients of x, weight and bias,
 * equal running statistics and batch counts; in training and evaluation,
 * plain and synchronized (a group of one), with and without the affine
 * parameters, on odd planes (7x7: 2x2 windows leave an edge, 3x3 ones
 * overlap), wide ones and 1x1 ones. */
static ddp_status sum_in_place(void *user, double *buf, size_t count) {
  (void)user, (void)buf, (void)count; /* a group of one */
  return DDP_OK;
}

static void test_batch_norm_relu_max_pool2d(void **state) {
  (void)state;
  const ddp_batch_norm_sync one = {sum_in_place, NULL};
  int64_t sc[1] = {4};
  for (int variant = 0; variant < 32; variant++) {
    bool training = variant & 1, synced = variant & 2, affine = !(variant & 4);
    /* 3x3 windows on 7x7: the portable loop; 2x2: the AVX-512 one, on 7x7
     * (masked rows) and on rows of 40 (20 outputs: both vector halves);
     * 1x1 windows on 1x1 planes, which batch norm takes as (N, C) rows. */
    int shape_kind = variant >> 3;
    int kernel = shape_kind == 1 ? 3 : shape_kind == 3 ? 1 : 2;
    int64_t sx[4] = {3, 4, 7, 7};
    if (shape_kind == 2) sx[0] = 2, sx[2] = 6, sx[3] = 40;
    if (shape_kind == 3) sx[0] = 5, sx[2] = 1, sx[3] = 1;
    ddp_tensor *x = gradcheck_random(4, sx, -2, 2, 700 + variant, true);
    ddp_tensor *w = affine ? gradcheck_random(1, sc, -1.5f, 1.5f, 710, true) : NULL;
    ddp_tensor *b = affine ? gradcheck_random(1, sc, -0.5f, 0.5f, 711, true) : NULL;
    ddp_tensor *rm[2], *rv[2], *y[2];
    int64_t tracked[2] = {5, 5};
    ddp_tape *tapes[2] = {new_tape(), new_tape()};
    for (int k = 0; k < 2; k++) {
      rm[k] = gradcheck_random(1, sc, -0.2f, 0.2f, 720, false);
      rv[k] = gradcheck_random(1, sc, 0.5f, 1.5f, 721, false);
    }
    const ddp_batch_norm_sync *sync = synced ? &one : NULL;
    assert_int_equal(ddp_batch_norm_relu_max_pool2d(tapes[0], x, w, b, rm[0], rv[0], &tracked[0],
                                                    training, 0.1f, 1e-5f, sync, kernel, 2,
                                                    &y[0]),
                     DDP_OK);
    ddp_tensor *n, *r;
    assert_int_equal(ddp_sync_batch_norm(tapes[1], x, w, b, rm[1], rv[1], &tracked[1], training,
                                         0.1f, 1e-5f, sync, &n),
                     DDP_OK);
    assert_int_equal(ddp_relu(tapes[1], n, &r), DDP_OK);
    assert_int_equal(ddp_max_pool2d(tapes[1], r, kernel, 2, &y[1]), DDP_OK);
    assert_int_equal(y[0]->numel, y[1]->numel);
    const float *ya = y[0]->data, *yb = y[1]->data;
    for (int64_t i = 0; i < y[0]->numel; i++) assert_true(ya[i] == yb[i]);
    assert_memory_equal(rm[0]->data, rm[1]->data, 4 * sizeof(float));
    assert_memory_equal(rv[0]->data, rv[1]->data, 4 * sizeof(float));
    assert_int_equal(tracked[0], tracked[1]);
    float *seed = ddp_alloc((size_t)y[0]->numel * sizeof(float));
    for (int64_t i = 0; i < y[0]->numel; i++) seed[i] = 0.25f + 0.125f * (float)(i % 9);
    ddp_tensor *params[3] = {x, w, b};
    float *grads[2][3] = {{NULL}};
    for (int k = 0; k < 2; k++) {
      assert_int_equal(ddp__backward_from(tapes[k], y[k], seed), DDP_OK);
      for (int p = 0; p < 3; p++) {
        if (!params[p]) continue;
        size_t bytes = (size_t)params[p]->numel * sizeof(float);
        grads[k][p] = ddp_alloc(bytes);
        memcpy(grads[k][p], params[p]->grad, bytes);
        ddp_tensor_free_grad(params[p]);
      }
    }
    for (int p = 0; p < 3; p++) {
      if (!params[p]) continue;
      assert_memory_equal(grads[0][p], grads[1][p], (size_t)params[p]->numel * sizeof(float));
      ddp_free(grads[0][p]);
      ddp_free(grads[1][p]);
    }
    ddp_free(seed);
    for (int k = 0; k < 2; k++) {
      ddp_tape_destroy(tapes[k]);
      ddp_tensor_destroy(rm[k]);
      ddp_tensor_destroy(rv[k]);
    }
    for (int p = 0; p < 3; p++) ddp_tensor_destroy(params[p]);
  }
}

/* max_pool2d's backward kernel into a fresh buffer, against a scatter
 * written here: dx zeroed, then each window's gradient added at its
 * argmax, none for windows of argmax -1 (closed by relu). Bitwise, so -0.0
 * gradients must come out +0.0. Cases: rows of one step with an odd last
 * column and row (2x2's whole-vector stores, whose spill must be
 * overwritten and never leave the buffer: ASan checks the exact-size
 * buffers), rows of two steps (20 windows), overlapping 3x3 windows, one
 * plane and many, the widest one-byte argmax (11x11) and four-byte ones
 * (12x12). The forward's argmax is checked against the reference's maxima
 * first, and its argval against x there. Runs on both kernel paths. */
static void test_max_pool2d_backward_fresh(void **state) {
  (void)state;
  static const struct {
    int64_t planes, h, w;
    int k, s;
  } cases[] = {{1, 28, 28, 2, 2}, {5, 7, 7, 2, 2},  {3, 14, 14, 2, 2}, {2, 9, 40, 2, 2},
               {4, 7, 9, 3, 2},   {1, 2, 2, 2, 2},  {6, 5, 33, 2, 2},  {2, 8, 8, 3, 3},
               {2, 26, 27, 12, 7}, {3, 11, 12, 11, 1}};
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const int64_t planes = cases[t].planes, h = cases[t].h, w = cases[t].w;
    const int k = cases[t].k, st = cases[t].s;
    const int64_t oh = (h - k) / st + 1, ow = (w - k) / st + 1, outs = planes * oh * ow;
    const int64_t sx[1] = {planes * h * w}, sy[1] = {outs};
    ddp_tensor *x = gradcheck_random(1, sx, -1, 1, 900 + t, false);
    ddp_tensor *dy = gradcheck_random(1, sy, -1, 1, 950 + t, false);
    float *y = ddp_alloc((size_t)outs * sizeof(float));
    int64_t *arg64 = ddp_alloc((size_t)outs * sizeof(int64_t));
    /* the kernels' argmax: each max's place in its window, one byte wide
     * up to 11x11 windows and four beyond (ddp__pool_arg_bytes), in
     * exact-size buffers */
    const int64_t bytes = ddp__pool_arg_bytes(k);
    assert_int_equal(bytes, k <= 11 ? 1 : 4);
    void *arg = malloc((size_t)(outs * bytes)), *fwd_arg = malloc((size_t)(outs * bytes));
    assert_non_null(arg);
    assert_non_null(fwd_arg);
    int64_t *at = ddp_alloc((size_t)outs * sizeof(int64_t)); /* plane index, -1 closed */
    ref_pool(y, arg64, x->data, planes, h, w, k, st);
    /* the forward's argmax: the reference's maxima, in window places */
    float *argval = malloc((size_t)outs * sizeof(float)); /* exact size */
    assert_non_null(argval);
    ddp__cpu_max_pool2d_forward(y, fwd_arg, argval, x->data, planes, h, w, k, st, oh, ow, false,
                                NULL);
    for (int64_t o = 0; o < outs; o++) {
      const int64_t pos = arg64[o] % (h * w), i = (o % (oh * ow)) / ow, j = o % ow;
      const int32_t place = (int32_t)((pos / w - i * st) * k + pos % w - j * st);
      const int32_t fwd = bytes == 1 ? ((int8_t *)fwd_arg)[o] : ((int32_t *)fwd_arg)[o];
      if (fwd != place)
        fail_msg("case %zu: window %lld's argmax %d, expected %d", t, (long long)o, fwd, place);
      const float xv = ((const float *)x->data)[(o / (oh * ow)) * h * w + pos];
      if (argval[o] != xv)
        fail_msg("case %zu: window %lld's value at the argmax %g, expected %g", t, (long long)o,
                 argval[o], xv);
      at[o] = o % 5 == 0 ? -1 : pos; /* some windows closed */
      const int32_t code = at[o] < 0 ? -1 : place;
      if (bytes == 1)
        ((int8_t *)arg)[o] = (int8_t)code;
      else
        ((int32_t *)arg)[o] = code;
      if (o % 11 == 3) ((float *)dy->data)[o] = -0.0f;
    }
    float *want = ddp_alloc((size_t)sx[0] * sizeof(float));
    float *got = malloc((size_t)sx[0] * sizeof(float)); /* exact size, unlike ddp_alloc */
    assert_non_null(got);
    memset(want, 0, (size_t)sx[0] * sizeof(float));
    for (int64_t o = 0; o < outs; o++)
      if (at[o] >= 0) want[(o / (oh * ow)) * h * w + at[o]] += ((const float *)dy->data)[o];
    for (int64_t i = 0; i < sx[0]; i++) got[i] = NAN; /* a fresh buffer's garbage */
    ddp__cpu_max_pool2d_backward(got, dy->data, arg, planes, h, w, k, st, oh, ow, false);
    if (memcmp(got, want, (size_t)sx[0] * sizeof(float)) != 0)
      fail_msg("case %zu: the fresh backward differs from the scatter", t);
    ddp_free(want);
    free(got);
    ddp_free(y);
    ddp_free(arg64);
    ddp_free(at);
    free(arg);
    free(fwd_arg);
    free(argval);
    ddp_tensor_destroy(x);
    ddp_tensor_destroy(dy);
  }
}

/* Ties: the gradient goes to the first maximum in row-major window order
 * (PyTorch's CPU kernel), once per window. */
static void test_max_pool2d_ties(void **state) {
  (void)state;
  int64_t shape[4] = {1, 1, 4, 4};
  float data[16] = {1, 1, 0, 2,  /* window (0,0): all 1 -> index 0 */
                    1, 1, 2, 0,  /* window (0,1): 2 at (0,3) and (1,2) -> (0,3) */
                    3, 0, 5, 5,  /* window (1,0): 3 at (2,0) and (3,1) -> (2,0) */
                    0, 3, 5, 5}; /* window (1,1): all 5 -> (2,2) */
  ddp_tensor x;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 4, shape, data), DDP_OK);
  x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_max_pool2d(tape, &x, 2, 2, &y), DDP_OK);
  const float want_y[4] = {1, 2, 3, 5};
  assert_memory_equal(y->data, want_y, sizeof want_y);
  const float seed[4] = {1, 2, 3, 4};
  assert_int_equal(ddp__backward_from(tape, y, seed), DDP_OK);
  const float want_dx[16] = {1, 0, 0, 2, 0, 0, 0, 0, 3, 0, 4, 0, 0, 0, 0, 0};
  assert_memory_equal(x.grad, want_dx, sizeof want_dx);
  /* Overlapping windows (kernel 2, stride 1) sharing one max both route to it. */
  ddp_tape_reset(tape);
  memset(x.grad, 0, 16 * sizeof(float));
  float seed9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  assert_int_equal(ddp_max_pool2d(tape, &x, 2, 1, &y), DDP_OK);
  assert_int_equal(y->numel, 9);
  assert_int_equal(ddp__backward_from(tape, y, seed9), DDP_OK);
  /* windows whose max is 5 at (2,2): (1,1),(1,2),(2,1),(2,2) -> 4 */
  assert_true(x.grad[10] == 4.0f);
  ddp_tensor_free_grad(&x);
  /* A NaN wins its window and takes the gradient, as in PyTorch. */
  ddp_tape_reset(tape);
  float nan_data[16] = {1, NAN, 0, 2, 5, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 4, shape, nan_data), DDP_OK);
  x.flags |= DDP_TENSOR_REQUIRES_GRAD;
  assert_int_equal(ddp_max_pool2d(tape, &x, 2, 2, &y), DDP_OK);
  assert_true(isnan(((float *)y->data)[0]));
  assert_true(((float *)y->data)[1] == 2.0f);
  assert_int_equal(ddp__backward_from(tape, y, seed), DDP_OK);
  assert_true(x.grad[1] == 1.0f && x.grad[4] == 0.0f && x.grad[3] == 2.0f);
  ddp_tensor_free_grad(&x);
  ddp_tape_destroy(tape);
}

/* ---- errors ---- */

static void expect_error(ddp_status got, ddp_status want, const char *text) {
  assert_int_equal(got, want);
  if (!strstr(ddp_last_error(), text)) {
    fprintf(stderr, "last error \"%s\" lacks \"%s\"\n", ddp_last_error(), text);
    fail();
  }
}

static void test_errors(void **state) {
  (void)state;
  ddp_tape *tape = new_tape();
  ddp_tensor *y = NULL;
  int64_t sx[4] = {8, 3, 28, 28}, sw[4] = {16, 1, 5, 5}, sw3[4] = {16, 3, 5, 5};
  ddp_tensor *x = gradcheck_random(4, sx, -1, 1, 1, false);
  ddp_tensor *w1 = gradcheck_random(4, sw, -1, 1, 2, false);
  ddp_tensor *w3 = gradcheck_random(4, sw3, -1, 1, 3, false);
  int64_t s2[2] = {3, 4}, s2b[2] = {5, 6}, s1[1] = {7}, s16[1] = {16};
  ddp_tensor *m34 = gradcheck_random(2, s2, -1, 1, 4, false);
  ddp_tensor *m56 = gradcheck_random(2, s2b, -1, 1, 5, false);
  ddp_tensor *v7 = gradcheck_random(1, s1, -1, 1, 6, false);
  ddp_tensor *b16 = gradcheck_random(1, s16, -1, 1, 7, false);
  ddp_tensor *ints;
  assert_int_equal(ddp_tensor_create(&ints, DDP_INT64, 4, sx), DDP_OK);

  /* conv2d */
  expect_error(ddp_conv2d(tape, x, w1, NULL, 1, 2, &y), DDP_ERR_SHAPE,
               "conv2d: input (8,3,28,28) has 3 channels but weight (16,1,5,5) expects 1");
  expect_error(ddp_conv2d(tape, NULL, w1, NULL, 1, 0, &y), DDP_ERR_INVALID, "conv2d: input is NULL");
  expect_error(ddp_conv2d(tape, x, NULL, NULL, 1, 0, &y), DDP_ERR_INVALID, "conv2d: weight is NULL");
  expect_error(ddp_conv2d(tape, m34, w3, NULL, 1, 0, &y), DDP_ERR_SHAPE,
               "conv2d: input (3,4) must be 4-D");
  expect_error(ddp_conv2d(tape, x, m34, NULL, 1, 0, &y), DDP_ERR_SHAPE,
               "conv2d: weight (3,4) must be 4-D");
  expect_error(ddp_conv2d(tape, x, w3, v7, 1, 0, &y), DDP_ERR_SHAPE,
               "conv2d: bias (7) does not match weight (16,3,5,5)");
  expect_error(ddp_conv2d(tape, x, w3, NULL, 0, 0, &y), DDP_ERR_INVALID,
               "conv2d: stride must be positive, got 0");
  expect_error(ddp_conv2d(tape, x, w3, NULL, -2, 0, &y), DDP_ERR_INVALID,
               "conv2d: stride must be positive, got -2");
  expect_error(ddp_conv2d(tape, x, w3, NULL, 1, -1, &y), DDP_ERR_INVALID,
               "conv2d: padding must be non-negative, got -1");
  expect_error(ddp_conv2d(tape, ints, w3, NULL, 1, 0, &y), DDP_ERR_INVALID,
               "conv2d: argument 0 is int64, expected float32");
  int64_t tiny[4] = {1, 3, 2, 3};
  ddp_tensor *xt = gradcheck_random(4, tiny, -1, 1, 8, false);
  expect_error(ddp_conv2d(tape, xt, w3, NULL, 1, 1, &y), DDP_ERR_SHAPE,
               "conv2d: kernel 5x5 is larger than the padded input 4x5 (input (1,3,2,3), padding 1)");
  assert_int_equal(ddp_conv2d(tape, xt, w3, b16, 1, 2, &y), DDP_OK); /* 6x7 padded: fits */

  /* linear */
  expect_error(ddp_linear(tape, m34, m56, NULL, &y), DDP_ERR_SHAPE,
               "linear: input (3,4) has 4 features but weight (5,6) expects 6");
  expect_error(ddp_linear(tape, NULL, m56, NULL, &y), DDP_ERR_INVALID, "linear: input is NULL");
  expect_error(ddp_linear(tape, m34, v7, NULL, &y), DDP_ERR_SHAPE,
               "linear: weight (7) must be 2-D");
  int64_t s54[2] = {5, 4};
  ddp_tensor *w54 = gradcheck_random(2, s54, -1, 1, 9, false);
  expect_error(ddp_linear(tape, m34, w54, v7, &y), DDP_ERR_SHAPE,
               "linear: bias (7) does not match weight (5,4): expected (5)");
  assert_int_equal(ddp_linear(tape, m34, w54, NULL, &y), DDP_OK);

  /* matmul */
  expect_error(ddp_matmul(tape, m34, m56, &y), DDP_ERR_SHAPE,
               "matmul: a (3,4) and b (5,6) cannot be multiplied (4 columns vs 5 rows)");
  expect_error(ddp_matmul(tape, m34, v7, &y), DDP_ERR_SHAPE,
               "matmul: expects 2-D tensors, got a (3,4) and b (7)");
  expect_error(ddp_matmul(tape, m34, NULL, &y), DDP_ERR_INVALID, "matmul: b is NULL");
  int64_t si[2] = {4, 2};
  ddp_tensor *ints2;
  assert_int_equal(ddp_tensor_create(&ints2, DDP_INT32, 2, si), DDP_OK);
  expect_error(ddp_matmul(tape, m34, ints2, &y), DDP_ERR_INVALID,
               "matmul: argument 1 is int32, expected float32");

  /* max_pool2d */
  expect_error(ddp_max_pool2d(tape, m34, 2, 2, &y), DDP_ERR_SHAPE,
               "max_pool2d: input (3,4) must be 4-D (N, C, H, W) or 3-D");
  expect_error(ddp_max_pool2d(tape, xt, 3, 2, &y), DDP_ERR_SHAPE,
               "max_pool2d: kernel 3x3 is larger than the input plane 2x3 (input (1,3,2,3))");
  expect_error(ddp_max_pool2d(tape, x, 0, 2, &y), DDP_ERR_INVALID,
               "max_pool2d: kernel size must be positive, got 0");
  expect_error(ddp_max_pool2d(tape, x, 2, -1, &y), DDP_ERR_INVALID,
               "max_pool2d: stride must be positive");
  expect_error(ddp_max_pool2d(tape, NULL, 2, 2, &y), DDP_ERR_INVALID, "max_pool2d: input is NULL");
  expect_error(ddp_max_pool2d(tape, ints, 2, 2, &y), DDP_ERR_INVALID,
               "max_pool2d: argument 0 is int64, expected float32");

  ddp_tensor *all[] = {x, w1, w3, m34, m56, v7, b16, ints, xt, w54, ints2};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) ddp_tensor_destroy(all[i]);
  ddp_tape_destroy(tape);
}

/* No grad wanted: nothing is recorded and no argmax is kept. */
static void test_no_grad_records_nothing(void **state) {
  (void)state;
  const conv_cfg q = {2, 3, 6, 6, 4, 3, 3, 1, 1, true};
  ddp_tensor *in[3];
  make_conv_inputs(&q, in, 500, false);
  in[1]->flags &= ~DDP_TENSOR_REQUIRES_GRAD;
  in[2]->flags &= ~DDP_TENSOR_REQUIRES_GRAD;
  ddp_tape *tape = new_tape();
  ddp_tensor *y, *p;
  assert_int_equal(ddp_conv2d(tape, in[0], in[1], in[2], 1, 1, &y), DDP_OK);
  assert_int_equal(ddp_max_pool2d(tape, y, 2, 2, &p), DDP_OK);
  assert_int_equal(ddp_tape_num_nodes(tape), 0);
  in[1]->flags |= DDP_TENSOR_REQUIRES_GRAD;
  ddp_tape_set_grad_enabled(tape, false);
  assert_int_equal(ddp_conv2d(tape, in[0], in[1], in[2], 1, 1, &y), DDP_OK);
  assert_int_equal(ddp_tape_num_nodes(tape), 0);
  ddp_tape_destroy(tape);
  for (int i = 0; i < 3; i++) ddp_tensor_destroy(in[i]);
}

/* Empty batches and an empty inner dimension work, as in PyTorch. */
static void test_empty(void **state) {
  (void)state;
  ddp_tape *tape = new_tape();
  int64_t sx[4] = {0, 2, 5, 5}, sw[4] = {3, 2, 3, 3}, sb[1] = {3};
  ddp_tensor *x = gradcheck_random(4, sx, -1, 1, 1, true);
  ddp_tensor *w = gradcheck_random(4, sw, -1, 1, 2, true);
  ddp_tensor *b = gradcheck_random(1, sb, -1, 1, 3, true);
  ddp_tensor *y, *p;
  assert_int_equal(ddp_conv2d(tape, x, w, b, 1, 1, &y), DDP_OK);
  assert_int_equal(y->numel, 0);
  assert_int_equal(y->shape[1], 3);
  assert_int_equal(ddp_max_pool2d(tape, y, 2, 2, &p), DDP_OK);
  assert_int_equal(p->numel, 0);
  assert_int_equal(ddp__backward_from(tape, p, NULL), DDP_OK);
  for (int i = 0; i < 9; i++) assert_true(w->grad[i] == 0.0f);
  int64_t sa[2] = {2, 0}, sbm[2] = {0, 3};
  ddp_tensor *a = gradcheck_random(2, sa, -1, 1, 4, false);
  ddp_tensor *bm = gradcheck_random(2, sbm, -1, 1, 5, false);
  ddp_tape_reset(tape);
  assert_int_equal(ddp_matmul(tape, a, bm, &y), DDP_OK);
  assert_int_equal(y->numel, 6);
  for (int i = 0; i < 6; i++) assert_true(((float *)y->data)[i] == 0.0f);
  ddp_tensor *all[] = {x, w, b, a, bm};
  for (int i = 0; i < 5; i++) ddp_tensor_destroy(all[i]);
  ddp_tape_destroy(tape);
}

/* A ConvNet-shaped step (conv, pool, conv, pool, linear, backward) allocates
 * nothing once the tape's arena has grown to its high-water mark. */
static void test_steady_state_no_alloc(void **state) {
  (void)state;
  int64_t sx[4] = {4, 1, 28, 28}, sw1[4] = {16, 1, 5, 5}, sb1[1] = {16}, sw2[4] = {32, 16, 5, 5},
          sb2[1] = {32}, sfw[2] = {10, 1568}, sfb[1] = {10};
  ddp_tensor *x = gradcheck_random(4, sx, 0, 1, 1, false);
  ddp_tensor *p[6] = {gradcheck_random(4, sw1, -.2f, .2f, 2, true),
                      gradcheck_random(1, sb1, -.2f, .2f, 3, true),
                      gradcheck_random(4, sw2, -.05f, .05f, 4, true),
                      gradcheck_random(1, sb2, -.05f, .05f, 5, true),
                      gradcheck_random(2, sfw, -.02f, .02f, 6, true),
                      gradcheck_random(1, sfb, -.02f, .02f, 7, true)};
  ddp_tape *tape = new_tape();
  float seed[40];
  for (int i = 0; i < 40; i++) seed[i] = (float)(i % 7) - 3.0f;
  uint64_t before = 0;
  for (int step = 0; step < 4; step++) {
    if (step == 3) before = ddp_alloc_count();
    ddp_tape_reset(tape);
    ddp_tensor *a, *b, *c, *d, *f, *y;
    assert_int_equal(ddp_conv2d(tape, x, p[0], p[1], 1, 2, &a), DDP_OK);
    assert_int_equal(ddp_max_pool2d(tape, a, 2, 2, &b), DDP_OK);
    assert_int_equal(ddp_conv2d(tape, b, p[2], p[3], 1, 2, &c), DDP_OK);
    assert_int_equal(ddp_max_pool2d(tape, c, 2, 2, &d), DDP_OK);
    assert_int_equal(ddp_flatten(tape, d, 1, &f), DDP_OK);
    assert_int_equal(ddp_linear(tape, f, p[4], p[5], &y), DDP_OK);
    assert_int_equal(ddp__backward_from(tape, y, seed), DDP_OK);
  }
  assert_int_equal(ddp_alloc_count() - before, 0);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  for (int i = 0; i < 6; i++) ddp_tensor_destroy(p[i]);
}

/* Every test runs on each family: the CPU's fastest (AVX-512 where the CPU
 * has it, else AVX2, or what DDP_CPU_KERNELS chose), the AVX2 one where the
 * CPU has AVX2 and FMA, and the portable OpenBLAS one. */
static int use_fast(void **state) {
  (void)state;
  ddp__cpu_force_family(group_family = -1);
  if (!ddp__cpu_has_avx512())
    fprintf(stderr, "fast path: the %s family (no AVX-512 on this CPU, or DDP_CPU_KERNELS)\n",
            ddp_cpu_kernels());
  return 0;
}

static int use_avx2(void **state) {
  (void)state;
  assert_true(ddp__cpu_force_family(group_family = DDP__CPU_AVX2));
  return 0;
}

static int use_generic(void **state) {
  (void)state;
  ddp__cpu_force_family(group_family = DDP__CPU_GENERIC);
  return 0;
}

static int use_chosen(void **state) {
  (void)state;
  ddp__cpu_force_family(group_family = -1);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matmul),
      cmocka_unit_test(test_linear),
      cmocka_unit_test(test_conv2d_forward),
      cmocka_unit_test(test_conv2d_gradcheck),
      cmocka_unit_test(test_conv2d_backward_convnet_shapes),
      cmocka_unit_test(test_conv_fold_kernels),
      cmocka_unit_test(test_conv_fold_gram),
      cmocka_unit_test(test_max_pool2d),
      cmocka_unit_test(test_max_pool2d_ties),
      cmocka_unit_test(test_max_pool2d_backward_fresh),
      cmocka_unit_test(test_relu_max_pool2d),
      cmocka_unit_test(test_batch_norm_relu_max_pool2d),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_no_grad_records_nothing),
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_steady_state_no_alloc),
  };
  int failed = cmocka_run_group_tests_name("fast path", tests, use_fast, use_chosen);
  if (ddp__cpu_can_run(DDP__CPU_AVX2))
    failed += cmocka_run_group_tests_name("AVX2 path", tests, use_avx2, use_chosen);
  else
    fprintf(stderr, "SKIP AVX2 path: this CPU has no AVX2 and FMA\n");
  failed += cmocka_run_group_tests_name("generic path", tests, use_generic, use_chosen);
  return failed;
}
