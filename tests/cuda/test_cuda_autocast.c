/* Autocast on a GPU (issue 42; docs/tensor.md, "Mixed precision", and
 * docs/cuda.md, "Mixed precision"), against the CPU's autocast, which
 * tests/tensor/test_autocast.c holds to PyTorch's CPU fixtures:
 *   - the rounding kernel (round_low) gives the CPU's bits for every value
 *     class (normal, subnormal, ties, overflow, inf, NaN), bf16 and fp16;
 *   - the GradScaler's device pass (unscale_check) gives the CPU's bits
 *     and the same finding (none, an inf, a NaN; inverse scale 1 leaves
 *     the values untouched);
 *   - linear, matmul and conv2d in a bf16 / fp16 region: the output holds
 *     values of the low dtype, is marked so, and is within one ulp of the
 *     low dtype plus 2 gamma_K S (the float32 accumulation bound, as
 *     test_autocast.c) of the CPU's; the gradients (backward outside the
 *     region) hold low values and are within the same kind of bound;
 *     relu and batch norm keep their input's dtype, log_softmax and the
 *     losses are float32 (CUDA's fp32 list);
 *   - the cast cache keeps one 16-bit copy of a weight per region;
 *   - the same inputs give the same bits twice (deterministic GEMMs);
 *   - TF32 (ddp_cuda_allow_tf32) changes a float32 GEMM only within TF32's
 *     bound, and only while allowed.
 * Without a GPU: skipped (exit 77). */
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
#include "ddp/optim.h"
#include "tensor/autocast.h"
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/runtime.h"
#include "tensor/tape.h"
#include "support/low_precision.h"

#define GPU DDP_CUDA(0)

static ddp_rng rng;

/* ---- memory ---- */

static float *to_host(const float *data, int64_t n) {
  float *h = malloc((size_t)(n ? n : 1) * sizeof(float));
  assert_non_null(h);
  if (ddp__cuda_copy(h, data, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost) != DDP_OK)
    fail_msg("download: %s", ddp_last_error());
  return h;
}

static float *upload(const float *src, int64_t n) {
  float *d = ddp__cuda_malloc((size_t)(n ? n : 1) * sizeof(float));
  if (!d) fail_msg("ddp__cuda_malloc: %s", ddp_last_error());
  if (ddp__cuda_copy(d, src, (size_t)n * sizeof(float), cudaMemcpyHostToDevice) != DDP_OK)
    fail_msg("upload: %s", ddp_last_error());
  return d;
}

/* ---- the kernels ---- */

/* Values of every class, then random ones over a wide range. */
static float *value_classes(int64_t n) {
  float *v = malloc((size_t)n * sizeof *v);
  const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, 65504.0f,
                           65520.0f, 1e-8f, 6e-8f, 1e-40f, 3.0e38f, 1.00390625f, 1.01171875f,
                           1.0009765625f, 1.0029296875f, 0x1.fffffep127f};
  const int64_t ns = (int64_t)(sizeof special / sizeof *special);
  for (int64_t i = 0; i < n; i++) {
    if (i < ns) {
      v[i] = special[i];
    } else {
      uint32_t bits = (uint32_t)(ddp_rng_next(&rng) >> 32);
      memcpy(&v[i], &bits, sizeof bits); /* every bit pattern, NaN payloads included */
    }
  }
  return v;
}

static void test_round_low_bits(void **state) {
  (void)state;
  const int64_t n = 1 << 16;
  float *v = value_classes(n);
  for (int bf16 = 0; bf16 <= 1; bf16++) {
    float *want = malloc((size_t)n * sizeof *want);
    ddp__cpu_basic_kernels.round_low(want, v, n, bf16);
    float *d = upload(v, n);
    ddp__cuda_basic_kernels.round_low(d, d, n, bf16); /* in place */
    float *got = to_host(d, n);
    assert_int_equal(memcmp(got, want, (size_t)n * sizeof *got), 0);
    printf("  round_low %s: %lld values, the CPU's bits\n", bf16 ? "bf16" : "fp16", (long long)n);
    ddp__cuda_free(d);
    free(got);
    free(want);
  }
  free(v);
}

static void test_unscale_check(void **state) {
  (void)state;
  const int64_t n = 100003;
  float *v = malloc((size_t)n * sizeof *v);
  struct {
    const char *name;
    int64_t bad_at;
    float bad, inv;
  } cases[] = {{"finite", -1, 0, 0x1p-16f},
               {"inf", 77, INFINITY, 0x1p-16f},
               {"-inf at the end", n - 1, -INFINITY, 0.5f},
               {"NaN", 50000, NAN, 0x1p-16f},
               {"inverse 1", 3, NAN, 1.0f}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    for (int64_t i = 0; i < n; i++) v[i] = ddp_rng_uniform_range(&rng, -70000.0f, 70000.0f);
    if (cases[c].bad_at >= 0) v[cases[c].bad_at] = cases[c].bad;
    float *want = malloc((size_t)n * sizeof *want);
    memcpy(want, v, (size_t)n * sizeof *v);
    const bool found_cpu = ddp__cpu_basic_kernels.unscale_check(want, cases[c].inv, n);
    float *d = upload(v, n);
    const bool found_gpu = ddp__cuda_basic_kernels.unscale_check(d, cases[c].inv, n);
    float *got = to_host(d, n);
    assert_int_equal(found_gpu, found_cpu);
    assert_int_equal(found_cpu, cases[c].bad_at >= 0);
    assert_int_equal(memcmp(got, want, (size_t)n * sizeof *got), 0);
    if (cases[c].inv == 1.0f) assert_int_equal(memcmp(got, v, (size_t)n * sizeof *got), 0);
    /* the public door: the same through ddp_grad_scaler_unscale_on */
    ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
    gs.scale = 1.0f / cases[c].inv;
    assert_int_equal(ddp__cuda_copy(d, v, (size_t)n * sizeof *v, cudaMemcpyHostToDevice), DDP_OK);
    assert_int_equal(ddp_grad_scaler_unscale_on(&gs, GPU, d, (size_t)n), found_cpu);
    printf("  unscale_check %-16s found %d, the CPU's bits\n", cases[c].name, found_gpu);
    ddp__cuda_free(d);
    free(got);
    free(want);
  }
  free(v);
  assert_int_equal(ddp_device_synchronize(GPU), DDP_OK);
}

/* ---- the ops against the CPU's autocast ---- */

typedef struct pair {
  ddp_tensor *cpu, *gpu;
} pair;

static pair random_pair(int ndim, const int64_t *shape, float lo, float hi, bool param) {
  pair p;
  assert_int_equal(ddp_tensor_create(&p.cpu, DDP_FLOAT32, ndim, shape), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&p.gpu, DDP_FLOAT32, ndim, shape, GPU), DDP_OK);
  float *v = ddp_tensor_f32(p.cpu);
  for (int64_t i = 0; i < p.cpu->numel; i++) v[i] = ddp_rng_uniform_range(&rng, lo, hi);
  assert_int_equal(ddp_tensor_copy(p.gpu, p.cpu), DDP_OK);
  if (param) {
    p.cpu->flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
    p.gpu->flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
    assert_int_equal(ddp_tensor_ensure_grad(p.cpu), DDP_OK);
    assert_int_equal(ddp_tensor_ensure_grad(p.gpu), DDP_OK);
  }
  return p;
}

static void free_pair(pair *p) {
  ddp_tensor_destroy(p->cpu);
  ddp_tensor_destroy(p->gpu);
}

/* |gpu - cpu| <= ulp_low(max) + slack[i] elementwise (slack NULL: 0). */
static void check_within(const char *what, const float *gpu, const float *cpu, int64_t n,
                         ddp_dtype dtype, const double *slack, double abs_slack) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)gpu[i] - cpu[i]);
    const double bound = ulp_of(fmax(fabs(gpu[i]), fabs(cpu[i])), dtype) +
                         (slack ? slack[i] : 0) + abs_slack;
    if (!(d <= bound))
      fail_msg("%s[%lld]: gpu %.9g, cpu %.9g, |diff| %.3g > bound %.3g", what, (long long)i,
               gpu[i], cpu[i], d, bound);
    if (d / bound > worst) worst = d / bound;
  }
  printf("  %-36s %8lld values, worst |diff|/bound %.3f\n", what, (long long)n, worst);
}

/* 2 gamma_K S per output of y (rows, out) = x (rows, in) @ w^T (+ b), from
 * the rounded operands (w (out, in)); for matmul pass w = b^T. */
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

/* conv2d stride 1, padding pad: 2 gamma_K S per output, and the double
 * rounding's extra ulp (below). */
static double *conv_slack(const float *x, const float *w, const float *b, int64_t n, int64_t ci,
                          int64_t h, int64_t co, int64_t k, int64_t pad, ddp_dtype low) {
  const int64_t oh = h + 2 * pad - k + 1, terms = ci * k * k + 1;
  double *s = malloc((size_t)(n * co * oh * oh) * sizeof *s);
  for (int64_t in = 0; in < n; in++)
    for (int64_t o = 0; o < co; o++)
      for (int64_t p = 0; p < oh; p++)
        for (int64_t q = 0; q < oh; q++) {
          double a = fabs(round_to(b[o], low));
          for (int64_t c = 0; c < ci; c++)
            for (int64_t u = 0; u < k; u++)
              for (int64_t v = 0; v < k; v++) {
                const int64_t yy = p + u - pad, xx = q + v - pad;
                if (yy < 0 || yy >= h || xx < 0 || xx >= h) continue;
                a += fabs((double)round_to(x[((in * ci + c) * h + yy) * h + xx], low)) *
                     fabs((double)round_to(w[((o * ci + c) * k + u) * k + v], low));
              }
          /* + one low ulp of the sum's magnitude: the GPU rounds the
           * convolution before adding the bias (PyTorch's order, then a
           * second rounding), the CPU rounds once */
          s[((in * co + o) * oh + p) * oh + q] = 2 * gamma_k(terms) * a + ulp_of(a, low);
        }
  return s;
}

/* Normwise: ||gpu - cpu|| <= tol ||cpu||, tol = 4 ulp_low(1) (the outputs
 * upstream may differ by an ulp of low), and, when `exact`, gpu's values
 * exact in low (a low op's gradient). */
static void check_grad_as(const char *what, const float *gpu_dev, const float *cpu, int64_t n,
                          ddp_dtype low, bool exact) {
  float *g = to_host(gpu_dev, n);
  double d = 0, nb = 0;
  for (int64_t i = 0; i < n; i++) {
    d += ((double)g[i] - cpu[i]) * ((double)g[i] - cpu[i]);
    nb += (double)cpu[i] * cpu[i];
  }
  const double err = sqrt(d) / (nb > 0 ? sqrt(nb) : 1), tol = 4 * ulp_of(1.0, low);
  printf("  %-36s ||gpu - cpu|| / ||cpu|| = %.3g (bound %.3g)\n", what, err, tol);
  if (exact) assert_true(exact_in(g, n, low));
  if (!(err <= tol)) fail_msg("%s: relative error %.3g > %.3g", what, err, tol);
  free(g);
}

static void check_grad(const char *what, const float *gpu_dev, const float *cpu, int64_t n,
                       ddp_dtype low) {
  check_grad_as(what, gpu_dev, cpu, n, low, true);
}

static ddp_tape *new_tape(void) {
  ddp_tape *t;
  assert_int_equal(ddp_tape_create(&t, 1 << 22), DDP_OK);
  return t;
}

/* The forward on one device in a region of `prec` (batch norm apart: it
 * takes the CPU's convolution output on both devices, so that it is
 * compared on the same input), the losses, backward outside the region. */
typedef struct chain_out {
  ddp_tensor *lin, *mm, *conv, *bn, *ls, *ce;
} chain_out;

static void run_ops(ddp_tape *tape, ddp_precision prec, ddp_tensor *x, ddp_tensor *w,
                    ddp_tensor *b, ddp_tensor *mb, ddp_tensor *img, ddp_tensor *cw,
                    ddp_tensor *cb, ddp_tensor *bw, ddp_tensor *bb, ddp_tensor *target,
                    chain_out *o) {
  ddp_tensor *r, *loss;
  assert_int_equal(ddp_autocast_enter(prec), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, w, b, &o->lin), DDP_OK);
  assert_int_equal(ddp_matmul(tape, x, mb, &o->mm), DDP_OK);
  assert_int_equal(ddp_conv2d(tape, img, cw, cb, 1, 2, &o->conv), DDP_OK);
  (void)bw, (void)bb;
  assert_int_equal(ddp_relu(tape, o->lin, &r), DDP_OK);
  assert_int_equal(ddp_log_softmax(tape, r, &o->ls), DDP_OK);
  assert_int_equal(ddp_cross_entropy(tape, o->lin, target, &o->ce), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  (void)loss;
}

static void ops_vs_cpu(ddp_dtype low) {
  const ddp_precision prec = low == DDP_BFLOAT16 ? DDP_PRECISION_BF16 : DDP_PRECISION_FP16;
  const char *name = low == DDP_BFLOAT16 ? "bf16" : "fp16";
  /* the ConvNet's fc (1568 -> 10) at batch 8; conv 5x5 pad 2, 1 -> 32 on 28x28 */
  const int64_t rows = 8, in = 1568, out = 10;
  pair x = random_pair(2, (int64_t[]){rows, in}, -1, 1, false);
  pair w = random_pair(2, (int64_t[]){out, in}, -0.05f, 0.05f, true);
  pair b = random_pair(1, (int64_t[]){out}, -0.1f, 0.1f, true);
  pair mb = random_pair(2, (int64_t[]){in, out}, -0.05f, 0.05f, true);
  pair img = random_pair(4, (int64_t[]){2, 1, 28, 28}, -1, 2, false);
  pair cw = random_pair(4, (int64_t[]){32, 1, 5, 5}, -0.3f, 0.3f, true);
  pair cb = random_pair(1, (int64_t[]){32}, -0.1f, 0.1f, true);
  pair bw = random_pair(1, (int64_t[]){32}, 0.5f, 1.5f, true);
  pair bb = random_pair(1, (int64_t[]){32}, -0.1f, 0.1f, true);
  ddp_tensor *tc, *tg;
  assert_int_equal(ddp_tensor_create(&tc, DDP_INT64, 1, (int64_t[]){rows}), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&tg, DDP_INT64, 1, (int64_t[]){rows}, GPU), DDP_OK);
  for (int64_t i = 0; i < rows; i++) ddp_tensor_i64(tc)[i] = (i * 7) % out;
  assert_int_equal(ddp_tensor_copy(tg, tc), DDP_OK);

  ddp_tape *tape_c = new_tape(), *tape_g = new_tape();
  chain_out oc, og;
  run_ops(tape_c, prec, x.cpu, w.cpu, b.cpu, mb.cpu, img.cpu, cw.cpu, cb.cpu, bw.cpu, bb.cpu, tc,
          &oc);
  run_ops(tape_g, prec, x.gpu, w.gpu, b.gpu, mb.gpu, img.gpu, cw.gpu, cb.gpu, bw.gpu, bb.gpu, tg,
          &og);
  /* batch norm on the CPU's convolution output (low values), on both */
  pair bnin;
  assert_int_equal(ddp_tensor_create(&bnin.cpu, DDP_FLOAT32, 4, oc.conv->shape), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&bnin.gpu, DDP_FLOAT32, 4, oc.conv->shape, GPU), DDP_OK);
  memcpy(bnin.cpu->data, oc.conv->data, (size_t)oc.conv->numel * sizeof(float));
  assert_int_equal(ddp_tensor_copy(bnin.gpu, bnin.cpu), DDP_OK);
  ddp__autocast_mark(bnin.cpu, low, false);
  ddp__autocast_mark(bnin.gpu, low, false);
  assert_int_equal(ddp_autocast_enter(prec), DDP_OK);
  assert_int_equal(ddp_batch_norm(tape_c, bnin.cpu, bw.cpu, bb.cpu, NULL, NULL, NULL, true, 0.1f,
                                  1e-5f, &oc.bn), DDP_OK);
  assert_int_equal(ddp_batch_norm(tape_g, bnin.gpu, bw.gpu, bb.gpu, NULL, NULL, NULL, true, 0.1f,
                                  1e-5f, &og.bn), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  char what[96];
  /* linear, matmul, conv2d: low outputs within ulp + 2 gamma_K S */
  {
    assert_int_equal(ddp_tensor_values_dtype(og.lin), low);
    float *g = to_host(og.lin->data, og.lin->numel);
    assert_true(exact_in(g, og.lin->numel, low));
    double *sl = linear_slack(ddp_tensor_f32(x.cpu), ddp_tensor_f32(w.cpu), ddp_tensor_f32(b.cpu),
                              rows, in, out, low);
    snprintf(what, sizeof what, "%s linear 1568->10", name);
    check_within(what, g, ddp_tensor_f32(oc.lin), og.lin->numel, low, sl, 0);
    free(sl);
    free(g);
  }
  {
    assert_int_equal(ddp_tensor_values_dtype(og.mm), low);
    float *g = to_host(og.mm->data, og.mm->numel);
    assert_true(exact_in(g, og.mm->numel, low));
    float *mbt = malloc((size_t)(in * out) * sizeof *mbt);
    for (int64_t i = 0; i < in; i++)
      for (int64_t j = 0; j < out; j++) mbt[j * in + i] = ddp_tensor_f32(mb.cpu)[i * out + j];
    double *sl = linear_slack(ddp_tensor_f32(x.cpu), mbt, NULL, rows, in, out, low);
    snprintf(what, sizeof what, "%s matmul", name);
    check_within(what, g, ddp_tensor_f32(oc.mm), og.mm->numel, low, sl, 0);
    free(sl);
    free(mbt);
    free(g);
  }
  {
    assert_int_equal(ddp_tensor_values_dtype(og.conv), low);
    float *g = to_host(og.conv->data, og.conv->numel);
    assert_true(exact_in(g, og.conv->numel, low));
    double *sl = conv_slack(ddp_tensor_f32(img.cpu), ddp_tensor_f32(cw.cpu), ddp_tensor_f32(cb.cpu),
                            2, 1, 28, 32, 5, 2, low);
    snprintf(what, sizeof what, "%s conv2d 5x5 pad 2", name);
    check_within(what, g, ddp_tensor_f32(oc.conv), og.conv->numel, low, sl, 0);
    free(sl);
    free(g);
  }
  /* batch norm: the input's dtype (low), from the same input: float32
   * statistics on both (a few float32 ulps apart), then one rounding: one
   * low ulp, and 1e-5 for the statistics' float32 differences */
  {
    assert_int_equal(ddp_tensor_values_dtype(og.bn), low);
    float *g = to_host(og.bn->data, og.bn->numel);
    assert_true(exact_in(g, og.bn->numel, low));
    snprintf(what, sizeof what, "%s batch_norm (input's dtype)", name);
    check_within(what, g, ddp_tensor_f32(oc.bn), og.bn->numel, low, NULL, 1e-5);
    free(g);
  }
  /* log_softmax: float32 on the GPU (CUDA's fp32 list), the CPU's input
   * dtype (neither of the CPU's lists) */
  assert_int_equal(ddp_tensor_values_dtype(og.ls), DDP_FLOAT32);
  assert_int_equal(ddp_tensor_values_dtype(oc.ls), low);
  assert_int_equal(ddp_tensor_values_dtype(og.ce), DDP_FLOAT32);
  {
    float *g = to_host(og.ce->data, 1);
    snprintf(what, sizeof what, "%s cross_entropy (float32)", name);
    /* from linear outputs one low ulp apart: a low ulp of the logits' scale */
    check_within(what, g, ddp_tensor_f32(oc.ce), 1, low, NULL, 4 * ulp_of(4.0, low));
    free(g);
  }
  /* backward outside the region from cross_entropy + mse(matmul, 0.1) +
   * mse(batch_norm, 0.1) + mse(conv2d, 0.1) (float32 losses, CUDA's fp32
   * list and the CPU's) */
  ddp_tensor *lc, *lg, *s1c, *s1g, *s2c, *s2g, *s3c, *s3g;
  pair zm = random_pair(2, (int64_t[]){rows, out}, 0.1f, 0.1f, false);
  pair zb = random_pair(4, (int64_t[]){2, 32, 28, 28}, 0.1f, 0.1f, false);
  assert_int_equal(ddp_mse_loss(tape_c, oc.mm, zm.cpu, &s1c), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape_g, og.mm, zm.gpu, &s1g), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape_c, oc.bn, zb.cpu, &s2c), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape_g, og.bn, zb.gpu, &s2g), DDP_OK);
  assert_int_equal(ddp_add(tape_c, s1c, oc.ce, &lc), DDP_OK);
  assert_int_equal(ddp_add(tape_g, s1g, og.ce, &lg), DDP_OK);
  assert_int_equal(ddp_add(tape_c, lc, s2c, &lc), DDP_OK);
  assert_int_equal(ddp_add(tape_g, lg, s2g, &lg), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape_c, oc.conv, zb.cpu, &s3c), DDP_OK);
  assert_int_equal(ddp_mse_loss(tape_g, og.conv, zb.gpu, &s3g), DDP_OK);
  assert_int_equal(ddp_add(tape_c, lc, s3c, &lc), DDP_OK);
  assert_int_equal(ddp_add(tape_g, lg, s3g, &lg), DDP_OK);
  assert_int_equal(ddp_backward(tape_c, lc), DDP_OK);
  assert_int_equal(ddp_backward(tape_g, lg), DDP_OK);
  assert_int_equal(ddp_device_synchronize(GPU), DDP_OK);
  pair *params[] = {&w, &b, &mb, &cw, &cb};
  const char *pn[] = {"linear.w", "linear.b", "matmul.b", "conv.w", "conv.b"};
  for (int i = 0; i < 5; i++) {
    snprintf(what, sizeof what, "%s d%s", name, pn[i]);
    check_grad(what, params[i]->gpu->grad, params[i]->cpu->grad, params[i]->cpu->numel, low);
  }
  ddp_tape_destroy(tape_c);
  ddp_tape_destroy(tape_g);
  /* batch norm's weight and bias: float32 gradients (batch norm is not a
   * low op), from outputs an ulp of low apart */
  check_grad_as("dbatch_norm.w", bw.gpu->grad, bw.cpu->grad, bw.cpu->numel, low, false);
  check_grad_as("dbatch_norm.b", bb.gpu->grad, bb.cpu->grad, bb.cpu->numel, low, false);
  pair *all[] = {&x, &w, &b, &mb, &img, &cw, &cb, &bw, &bb, &zm, &zb, &bnin};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) free_pair(all[i]);
  ddp_tensor_destroy(tc);
  ddp_tensor_destroy(tg);
}

static void test_ops_bf16(void **state) {
  (void)state;
  ops_vs_cpu(DDP_BFLOAT16);
}

static void test_ops_fp16(void **state) {
  (void)state;
  ops_vs_cpu(DDP_FLOAT16);
}

/* ---- the cast cache, determinism, TF32 ---- */

static void test_cast_cache_gpu(void **state) {
  (void)state;
  pair x = random_pair(2, (int64_t[]){4, 64}, -1, 1, false);
  pair w = random_pair(2, (int64_t[]){32, 64}, -1, 1, true);
  ddp_tape *tape = new_tape();
  ddp_tensor *y1, *y2;
  const ddp__autocast_cache_stats s0 = ddp__autocast_cache_counters();
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_linear(tape, x.gpu, w.gpu, NULL, &y1), DDP_OK);
  assert_int_equal(ddp_linear(tape, x.gpu, w.gpu, NULL, &y2), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  const ddp__autocast_cache_stats s1 = ddp__autocast_cache_counters();
  assert_int_equal(s1.fills - s0.fills, 1); /* the weight's 16-bit copy, once */
  assert_int_equal(s1.hits - s0.hits, 1);
  float *a = to_host(y1->data, y1->numel), *b = to_host(y2->data, y2->numel);
  assert_int_equal(memcmp(a, b, (size_t)y1->numel * sizeof *a), 0);
  /* a new region fills again (the weight may have been stepped) but
   * reuses the entry's device memory */
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_linear(tape, x.gpu, w.gpu, NULL, &y1), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  const ddp__autocast_cache_stats s2 = ddp__autocast_cache_counters();
  assert_int_equal(s2.fills - s1.fills, 1);
  assert_int_equal(s2.allocations - s1.allocations, 0);
  free(a);
  free(b);
  ddp_tape_destroy(tape);
  free_pair(&x);
  free_pair(&w);
}

/* The bf16 linear's forward and backward twice: the same bits. */
static void test_deterministic(void **state) {
  (void)state;
  pair x = random_pair(2, (int64_t[]){256, 1024}, -1, 1, true);
  pair w = random_pair(2, (int64_t[]){512, 1024}, -0.05f, 0.05f, true);
  pair zero = random_pair(2, (int64_t[]){256, 512}, 0, 0, false);
  float *first[3] = {NULL, NULL, NULL};
  for (int run = 0; run < 2; run++) {
    ddp_tape *tape = new_tape();
    ddp_tensor *y, *l;
    ddp_tensor_free_grad(x.gpu); /* backward assigns fresh gradients */
    ddp_tensor_free_grad(w.gpu);
    assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
    assert_int_equal(ddp_linear(tape, x.gpu, w.gpu, NULL, &y), DDP_OK);
    assert_int_equal(ddp_autocast_exit(), DDP_OK);
    assert_int_equal(ddp_mse_loss(tape, y, zero.gpu, &l), DDP_OK);
    assert_int_equal(ddp_backward(tape, l), DDP_OK);
    float *now[3] = {to_host(y->data, y->numel), to_host(x.gpu->grad, x.gpu->numel),
                     to_host(w.gpu->grad, w.gpu->numel)};
    const int64_t n[3] = {y->numel, x.gpu->numel, w.gpu->numel};
    for (int i = 0; i < 3; i++) {
      if (run == 0) first[i] = now[i];
      else {
        assert_int_equal(memcmp(first[i], now[i], (size_t)n[i] * sizeof(float)), 0);
        free(now[i]);
      }
    }
    ddp_tape_destroy(tape);
  }
  for (int i = 0; i < 3; i++) free(first[i]);
  printf("  bf16 linear 256x1024 @ 1024x512, forward and backward: the same bits twice\n");
  free_pair(&zero);
  free_pair(&x);
  free_pair(&w);
}

/* TF32: off by default (float32 bits as before), within TF32's bound when
 * on (operands rounded to 10 mantissa bits: |diff| <= 2 * 2^-11 * S + 2
 * gamma_K S), and different somewhere (the tensor cores ran). */
static void test_tf32_opt_in(void **state) {
  (void)state;
  assert_false(ddp_cuda_tf32_allowed());
  const int64_t m = 128, k = 1024, n = 96;
  pair a = random_pair(2, (int64_t[]){m, k}, -1, 1, false);
  pair b = random_pair(2, (int64_t[]){k, n}, -1, 1, false);
  ddp_tape *tape = new_tape();
  ddp_tensor *y0, *y1, *y2;
  assert_int_equal(ddp_matmul(tape, a.gpu, b.gpu, &y0), DDP_OK);
  assert_int_equal(ddp_cuda_allow_tf32(true), DDP_OK);
  assert_true(ddp_cuda_tf32_allowed());
  assert_int_equal(ddp_matmul(tape, a.gpu, b.gpu, &y1), DDP_OK);
  assert_int_equal(ddp_cuda_allow_tf32(false), DDP_OK);
  assert_int_equal(ddp_matmul(tape, a.gpu, b.gpu, &y2), DDP_OK);
  float *h0 = to_host(y0->data, m * n), *h1 = to_host(y1->data, m * n), *h2 = to_host(y2->data, m * n);
  assert_int_equal(memcmp(h0, h2, (size_t)(m * n) * sizeof *h0), 0);
  const float *av = ddp_tensor_f32(a.cpu), *bv = ddp_tensor_f32(b.cpu);
  int64_t differ = 0;
  double worst = 0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++) s += fabs((double)av[i * k + p] * bv[p * n + j]);
      const double bound = (2 * 0x1p-11 + 2 * gamma_k(k)) * s;
      const double d = fabs((double)h1[i * n + j] - h0[i * n + j]);
      if (!(d <= bound)) fail_msg("tf32 [%lld, %lld]: |diff| %.3g > %.3g", (long long)i, (long long)j, d, bound);
      if (d / bound > worst) worst = d / bound;
      differ += h1[i * n + j] != h0[i * n + j];
    }
  printf("  tf32 matmul 128x1024x96: %lld of %lld outputs differ from float32, worst |diff|/bound "
         "%.3f; off again: float32's bits\n", (long long)differ, (long long)(m * n), worst);
  assert_true(differ > 0);
  free(h0);
  free(h1);
  free(h2);
  ddp_tape_destroy(tape);
  free_pair(&a);
  free_pair(&b);
}

static int setup(void **state) {
  (void)state;
  cuda_test_require_device();
  ddp_rng_seed(&rng, 42);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_low_bits),  cmocka_unit_test(test_unscale_check),
      cmocka_unit_test(test_ops_bf16),        cmocka_unit_test(test_ops_fp16),
      cmocka_unit_test(test_cast_cache_gpu),  cmocka_unit_test(test_deterministic),
      cmocka_unit_test(test_tf32_opt_in),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
