/* Autocast (docs/tensor.md, "Mixed precision"): the region API and its
 * nesting, the cast cache, each op's output dtype and values against
 * PyTorch 2.x's torch.autocast("cpu", bfloat16 / float16) on the seeds'
 * ConvNet shapes (tests/fixtures/autocast_*.bin, made by
 * scripts/make_autocast_fixtures.py), the backward against a float64
 * reference of the same rule and against PyTorch's gradients, and the
 * float32 path untouched.
 *
 * The parity bound for an op whose output is rounded to the low dtype
 * (bfloat16: 8 significant bits, float16: 11):
 *   |ours - torch| <= ulp_low(max(|ours|, |torch|)) + 2 * gamma_K * S
 * The products of two rounded operands are exact in float32 (8 + 8 or
 * 11 + 11 significant bits <= 24), so the two float32 results before the
 * final rounding differ only by summation order: each is within
 * gamma_K * S of the exact sum (Higham, Accuracy and Stability, 3.1:
 * gamma_K = K u / (1 - K u), u = 2^-24, K the terms summed including the
 * bias, S = sum |x_i w_i| + |b|, computed here in float64), so they are
 * within 2 gamma_K S of each other; rounding each to the low dtype moves it
 * at most half an ulp, and half + half is the one ulp. Ops that compute in
 * float32 from exact low-precision inputs (log_softmax, batch norm) get a
 * float32 slack in place of the gamma term (their exp, log and sqrt are
 * not PyTorch's: a few float32 ulps), named where used. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <cmocka.h>

#include "support/fixture.h"
#include "support/gradcheck.h"
#include "tensor/autocast.h"
#include "tensor/cpu/dense.h"
#include "tensor/tape.h"
#include "support/low_precision.h"


/* |ours - ref| <= ulp_low(max |.|) + slack[i] (slack NULL: 0) + abs_slack. */
static void check_within(const char *what, const float *ours, const float *ref, int64_t n,
                         ddp_dtype dtype, const double *slack, double abs_slack) {
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)ours[i] - ref[i]);
    const double bound = ulp_of(fmax(fabs(ours[i]), fabs(ref[i])), dtype) +
                         (slack ? slack[i] : 0) + abs_slack;
    if (!(d <= bound)) fail_msg("%s[%lld]: ours %.9g, torch %.9g, |diff| %.3g > bound %.3g", what,
                                (long long)i, ours[i], ref[i], d, bound);
    if (d / bound > worst) {
      worst = d / bound;
      at = i;
    }
  }
  printf("  %-28s %8lld values, worst |diff|/bound %.3f (at %lld)\n", what, (long long)n, worst,
         (long long)at);
}

/* ---- the region API ---- */

static void test_regions_nest(void **state) {
  (void)state;
  assert_int_equal(ddp_autocast_depth(), 0);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_FP32);
  assert_int_equal(ddp_autocast_exit(), DDP_ERR_STATE);
  assert_int_equal(ddp_autocast_enter((ddp_precision)7), DDP_ERR_INVALID);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_BF16);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_FP32), DDP_OK);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_FP32);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_FP16), DDP_OK);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_FP16);
  assert_int_equal(ddp_autocast_depth(), 3);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_FP32);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_autocast_precision(), DDP_PRECISION_BF16);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_autocast_depth(), 0);
  for (int i = 0; i < DDP_AUTOCAST_MAX_DEPTH; i++)
    assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_ERR_STATE);
  for (int i = 0; i < DDP_AUTOCAST_MAX_DEPTH; i++) assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_autocast_depth(), 0);
}

/* Regions are per thread: another thread sees none. */
static void *other_thread(void *arg) {
  int *seen = arg;
  seen[0] = ddp_autocast_depth();
  seen[1] = (int)ddp_autocast_precision();
  return NULL;
}

static void test_regions_are_per_thread(void **state) {
  (void)state;
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  int seen[2] = {-1, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, other_thread, seen), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(seen[0], 0);
  assert_int_equal(seen[1], DDP_PRECISION_FP32);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
}

/* ---- nesting, the cache and the float32 path on linear ---- */

static ddp_tape *new_tape(void) {
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 20), DDP_OK);
  return tape;
}

static void test_nested_off_region_is_float32(void **state) {
  (void)state;
  int64_t sx[2] = {5, 37}, sw[2] = {11, 37}, sb[1] = {11};
  ddp_tensor *x = gradcheck_random(2, sx, -2, 2, 1, false);
  ddp_tensor *w = gradcheck_random(2, sw, -1, 1, 2, true);
  ddp_tensor *b = gradcheck_random(1, sb, -1, 1, 3, true);
  w->flags |= DDP_TENSOR_PARAM;
  ddp_tape *tape = new_tape();
  ddp_tensor *plain, *off, *low, *after;
  assert_int_equal(ddp_linear(tape, x, w, b, &plain), DDP_OK);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_FP32), DDP_OK); /* autocast off inside */
  assert_int_equal(ddp_linear(tape, x, w, b, &off), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, w, b, &low), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, w, b, &after), DDP_OK);
  /* off and after: float32, bit for bit the plain op */
  assert_int_equal(ddp_tensor_values_dtype(off), DDP_FLOAT32);
  assert_int_equal(ddp_tensor_values_dtype(after), DDP_FLOAT32);
  assert_memory_equal(off->data, plain->data, (size_t)plain->numel * sizeof(float));
  assert_memory_equal(after->data, plain->data, (size_t)plain->numel * sizeof(float));
  /* low: bfloat16 values, within bfloat16's error of the float32 ones and
   * not all equal to them */
  assert_int_equal(ddp_tensor_values_dtype(low), DDP_BFLOAT16);
  assert_true(exact_in(low->data, low->numel, DDP_BFLOAT16));
  int differ = 0;
  for (int64_t i = 0; i < low->numel; i++) {
    const float l = ddp_tensor_f32(low)[i], p = ddp_tensor_f32(plain)[i];
    differ += l != p;
    assert_true(fabs(l - p) <= 37 * 3 * 0x1p-8 * 2 + 0x1p-8 * fabs(p));
  }
  assert_true(differ > 0);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
}

/* Backward from y with d(loss)/dy = 1 everywhere (tape scratch). */
static ddp_status backward_ones(ddp_tape *tape, ddp_tensor *y) {
  float *seed = ddp_tape_scratch(tape, (size_t)y->numel * sizeof *seed);
  if (!seed) return DDP_ERR_NOMEM;
  for (int64_t i = 0; i < y->numel; i++) seed[i] = 1.0f;
  return ddp__backward_from(tape, y, seed);
}

static void test_cast_cache(void **state) {
  (void)state;
  int64_t sx[2] = {4, 64}, sw[2] = {64, 64}, sb[1] = {64};
  ddp_tensor *x = gradcheck_random(2, sx, -2, 2, 4, false);
  ddp_tensor *w = gradcheck_random(2, sw, -1, 1, 5, true);
  ddp_tensor *b = gradcheck_random(1, sb, -1, 1, 6, true);
  ddp_tape *tape = new_tape();
  ddp_autocast_cache_free();
  ddp__autocast_cache_stats s0 = ddp__autocast_cache_counters();
  ddp_tensor *h1, *h2, *h3;
  uint64_t allocs_before = 0;
  for (int step = 0; step < 3; step++) {
    if (step == 1) allocs_before = ddp_alloc_count();
    ddp_tape_reset(tape);
    assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
    assert_int_equal(ddp_linear(tape, x, w, b, &h1), DDP_OK);  /* fills w's and b's copies */
    assert_int_equal(ddp_linear(tape, h1, w, b, &h2), DDP_OK); /* reuses both */
    assert_int_equal(ddp_autocast_exit(), DDP_OK);
    assert_int_equal(backward_ones(tape, h2), DDP_OK);
  }
  /* steps after the first allocate nothing: the tape's arena and the
   * cache's buffers are reused (the steady-state training step's rule) */
  assert_int_equal(ddp_alloc_count() - allocs_before, 0);
  ddp__autocast_cache_stats s = ddp__autocast_cache_counters();
  /* each step: 2 fills (w, b: the exit forgot them), 2 hits; buffers made
   * once, in the first step: later steps allocate nothing */
  assert_int_equal(s.fills - s0.fills, 6);
  assert_int_equal(s.hits - s0.hits, 6);
  assert_int_equal(s.allocations - s0.allocations, 2);
  /* A parameter changed in place inside a region is not seen (as in
   * PyTorch) until ddp_autocast_cache_clear. */
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, w, b, &h1), DDP_OK);
  for (int64_t i = 0; i < w->numel; i++) ddp_tensor_f32(w)[i] *= 2.0f;
  assert_int_equal(ddp_linear(tape, x, w, b, &h2), DDP_OK); /* stale: the old copy */
  assert_memory_equal(h1->data, h2->data, (size_t)h1->numel * sizeof(float));
  ddp_autocast_cache_clear();
  assert_int_equal(ddp_linear(tape, x, w, b, &h3), DDP_OK); /* fresh */
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  int changed = 0;
  for (int64_t i = 0; i < h1->numel; i++)
    changed += ddp_tensor_f32(h3)[i] != ddp_tensor_f32(h1)[i];
  assert_true(changed > 0);
  /* The cached copy is what the op computes with: equal to a rounded copy
   * of a tensor that is not a leaf requiring grad (no cache). */
  ddp_tensor *wc;
  assert_int_equal(ddp_tensor_create(&wc, DDP_FLOAT32, 2, sw), DDP_OK);
  memcpy(wc->data, w->data, (size_t)w->numel * sizeof(float));
  ddp_tensor *h4;
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, wc, b, &h4), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_memory_equal(h3->data, h4->data, (size_t)h3->numel * sizeof(float));
  ddp_autocast_cache_free();
  ddp_tensor_destroy(wc);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
}

/* ---- backward: a float64 reference of the rule ---- */

/* linear's gradients under autocast against the rule computed in float64:
 * dy, x, w rounded; dx = r(dy @ w), dw = r(dy^T @ x), db = r(sum dy), each
 * rounded once to the low dtype; a parameter's gradient arrives in float32.
 * (Finite differences do not fit a function rounded to 8 bits: it is
 * piecewise constant. The float32 rule itself is checked by finite
 * differences in test_dense_ops.) */
static void check_linear_backward(ddp_dtype low) {
  enum { R = 6, IN = 45, OUT = 13 };
  int64_t sx[2] = {R, IN}, sw[2] = {OUT, IN}, sb[1] = {OUT};
  ddp_tensor *x = gradcheck_random(2, sx, -2, 2, 7, true);
  ddp_tensor *w = gradcheck_random(2, sw, -1, 1, 8, true);
  ddp_tensor *b = gradcheck_random(1, sb, -1, 1, 9, true);
  ddp_tensor *r = gradcheck_random(2, (int64_t[]){R, OUT}, -1, 1, 10, false);
  ddp_tape *tape = new_tape();
  ddp_tensor *y;
  assert_int_equal(ddp_autocast_enter(low == DDP_BFLOAT16 ? DDP_PRECISION_BF16
                                                          : DDP_PRECISION_FP16), DDP_OK);
  assert_int_equal(ddp_linear(tape, x, w, b, &y), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  /* backward outside the region, seeded with dy = r */
  assert_int_equal(ddp__backward_from(tape, y, r->data), DDP_OK);
  const float *xd = x->data, *wd = w->data, *dy = r->data;
  float ref_dx[R * IN], ref_dw[OUT * IN], ref_db[OUT];
  double sl_dx[R * IN], sl_dw[OUT * IN], sl_db[OUT];
  for (int i = 0; i < R; i++)
    for (int k = 0; k < IN; k++) {
      double s = 0, a = 0;
      for (int o = 0; o < OUT; o++) {
        const double t = (double)round_to(dy[i * OUT + o], low) * round_to(wd[o * IN + k], low);
        s += t;
        a += fabs(t);
      }
      ref_dx[i * IN + k] = round_to((float)s, low);
      sl_dx[i * IN + k] = gamma_k(OUT) * a + fabs(s) * U32; /* + (float) of s */
    }
  for (int o = 0; o < OUT; o++) {
    double sb_ = 0, ab = 0;
    for (int i = 0; i < R; i++) {
      sb_ += round_to(dy[i * OUT + o], low);
      ab += fabs(round_to(dy[i * OUT + o], low));
    }
    ref_db[o] = round_to((float)sb_, low);
    sl_db[o] = gamma_k(R) * ab + fabs(sb_) * U32;
    for (int k = 0; k < IN; k++) {
      double s = 0, a = 0;
      for (int i = 0; i < R; i++) {
        const double t = (double)round_to(dy[i * OUT + o], low) * round_to(xd[i * IN + k], low);
        s += t;
        a += fabs(t);
      }
      ref_dw[o * IN + k] = round_to((float)s, low);
      sl_dw[o * IN + k] = gamma_k(R) * a + fabs(s) * U32;
    }
  }
  const char *name = low == DDP_BFLOAT16 ? "bf16" : "fp16";
  char what[64];
  snprintf(what, sizeof what, "linear %s dx", name);
  assert_true(exact_in(x->grad, x->numel, low));
  check_within(what, x->grad, ref_dx, x->numel, low, sl_dx, 0);
  snprintf(what, sizeof what, "linear %s dw", name);
  assert_true(exact_in(w->grad, w->numel, low));
  check_within(what, w->grad, ref_dw, w->numel, low, sl_dw, 0);
  snprintf(what, sizeof what, "linear %s db", name);
  check_within(what, b->grad, ref_db, b->numel, low, sl_db, 0);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(w);
  ddp_tensor_destroy(b);
  ddp_tensor_destroy(r);
}

/* Each test that computes runs on every kernel family the CPU has: the
 * AVX-512 one (with AVX512_BF16, bfloat16 ops run on its dot products:
 * cpu/gemm_bf16.c), the AVX2 one and the generic one (rounded float32
 * operands and the float32 kernels). */
static const int families[] = {DDP__CPU_AVX512, DDP__CPU_AVX2, DDP__CPU_GENERIC};

static void for_each_family(void (*fn)(ddp_dtype, const char *), ddp_dtype low,
                            const char *name) {
  int ran = 0;
  for (size_t f = 0; f < sizeof families / sizeof *families; f++) {
    if (!ddp__cpu_force_family(families[f])) continue;
    printf(" family %s%s\n", ddp_cpu_kernels(),
           ddp__cpu_has_bf16_dot() ? " (bfloat16 dot products)" : "");
    fn(low, name);
    ran++;
  }
  ddp__cpu_force_family(-1);
  assert_true(ran >= 1);
}

static void linear_backward_named(ddp_dtype low, const char *name) {
  (void)name;
  check_linear_backward(low);
}

static void test_linear_backward_rule(void **state) {
  (void)state;
  for_each_family(linear_backward_named, DDP_BFLOAT16, "bf16");
  for_each_family(linear_backward_named, DDP_FLOAT16, "fp16");
}

/* The bfloat16 GEMM (cpu/gemm_bf16.c) on its own, every transpose and
 * edge (tiles of 6 rows x 64 columns, k blocks of 256 pairs, odd k):
 * against float64 sums of the bfloat16-rounded operands, within
 * gamma_K S (only the float32 summation differs: the products are exact). */
static void test_bf16_gemm_kernel(void **state) {
  (void)state;
  if (!ddp__cpu_has_bf16_dot()) skip(); /* no AVX512_BF16 here: the other families' paths ran */
  static const int64_t sizes[][3] = {{1, 1, 1}, {7, 70, 33}, {6, 64, 512}, {13, 130, 515},
                                     {64, 10, 128}, {2, 128, 9216}};
  ddp_arena arena;
  ddp_arena_init(&arena, 1 << 20);
  for (size_t t = 0; t < sizeof sizes / sizeof *sizes; t++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        const int64_t m = sizes[t][0], n = sizes[t][1], k = sizes[t][2];
        ddp_tensor *a = gradcheck_random(1, (int64_t[]){m * k}, -2, 2, 11 + t, false);
        ddp_tensor *b = gradcheck_random(1, (int64_t[]){k * n}, -2, 2, 21 + t, false);
        float *c = malloc((size_t)(m * n) * sizeof *c), *ref = malloc((size_t)(m * n) * sizeof *ref);
        double *sl = malloc((size_t)(m * n) * sizeof *sl);
        const float *ad = a->data, *bd = b->data;
        const int64_t lda = ta ? m : k, ldb = tb ? k : n;
        ddp_arena_reset(&arena);
        assert_true(ddp__cpu_gemm_bf16(ta, tb, m, n, k, ad, lda, bd, ldb, NULL, c, n, &arena));
        for (int64_t i = 0; i < m; i++)
          for (int64_t j = 0; j < n; j++) {
            double sum = 0, abs_sum = 0;
            for (int64_t p = 0; p < k; p++) {
              const double x = round_to(ta ? ad[p * lda + i] : ad[i * lda + p], DDP_BFLOAT16);
              const double y = round_to(tb ? bd[j * ldb + p] : bd[p * ldb + j], DDP_BFLOAT16);
              sum += x * y;
              abs_sum += fabs(x * y);
            }
            ref[i * n + j] = (float)sum;
            sl[i * n + j] = gamma_k(k) * abs_sum + fabs(sum) * U32;
          }
        char what[64];
        snprintf(what, sizeof what, "gemm_bf16 %lldx%lldx%lld %c%c", (long long)m, (long long)n,
                 (long long)k, ta ? 'T' : 'N', tb ? 'T' : 'N');
        /* float32 output: the "ulp" term is float32's */
        check_within(what, c, ref, m * n, DDP_FLOAT32, sl, 0);
        free(c);
        free(ref);
        free(sl);
        ddp_tensor_destroy(a);
        ddp_tensor_destroy(b);
      }
  ddp_arena_free(&arena);
}

/* ---- parity with PyTorch's fixtures ---- */

typedef struct ctx {
  fixture *fx;
  ddp_dtype low;
  const char *name; /* "bf16" */
  ddp_tape *tape;
} ctx;

static const fixture_tensor *need(const ctx *c, const char *name) {
  const fixture_tensor *t = fixture_find(c->fx, name);
  if (!t) fail_msg("autocast_%s.bin: no record %s", c->name, name);
  return t;
}

/* A float32 tensor over a fixture record's data (not owned). */
static ddp_tensor *wrap(const ctx *c, const char *name, bool param) {
  const fixture_tensor *f = need(c, name);
  ddp_tensor *t = ddp_tape_scratch(c->tape, sizeof *t);
  assert_int_equal(f->dtype, DDP_FLOAT32);
  assert_int_equal(ddp_tensor_wrap(t, DDP_FLOAT32, f->ndim, f->shape, f->data), DDP_OK);
  if (param) t->flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
  return t;
}

/* An int64 label tensor over the fixture's target. */
static ddp_tensor *wrap_labels(const ctx *c) {
  const fixture_tensor *f = need(c, "target");
  ddp_tensor *t = ddp_tape_scratch(c->tape, sizeof *t);
  assert_int_equal(ddp_tensor_wrap(t, DDP_INT64, f->ndim, f->shape, f->data), DDP_OK);
  return t;
}

/* fc1's weight by the script's formula_weight (128, 9216). */
static float *formula_weight(int64_t rows, int64_t cols) {
  float *w = malloc((size_t)(rows * cols) * sizeof *w);
  for (int64_t i = 0; i < rows * cols; i++) {
    const uint64_t h = ((1664525ull * (uint64_t)i + 1013904223ull) % (1ull << 32)) >> 8;
    w[i] = (float)((double)((int64_t)(h % 2001) - 1000) * 0x1p-17);
  }
  return w;
}

/* Checks an op's output dtype and values against <op>.dtype and <op>.y. */
static void check_op(const ctx *c, const char *op, const ddp_tensor *y, const double *slack,
                     double abs_slack) {
  char key[64], what[64];
  snprintf(key, sizeof key, "%s.dtype", op);
  const fixture_tensor *dt = need(c, key);
  const ddp_dtype want = (ddp_dtype)((const int64_t *)dt->data)[0];
  if (ddp_tensor_values_dtype(y) != want)
    fail_msg("%s %s: output dtype %s, torch's %s", c->name, op,
             ddp_dtype_name(ddp_tensor_values_dtype(y)), ddp_dtype_name(want));
  snprintf(key, sizeof key, "%s.y", op);
  const fixture_tensor *ref = need(c, key);
  assert_int_equal(ref->numel, y->numel);
  snprintf(what, sizeof what, "%s %s", c->name, op);
  check_within(what, y->data, ref->data, y->numel, want, slack, abs_slack);
  if (want != DDP_FLOAT32) assert_true(exact_in(y->data, y->numel, want));
}

/* Per output element: 2 gamma_K S, S = sum |x w| + |b| over its terms
 * (rounded operands), for conv2d (stride 1, no padding) and linear. */
static double *conv_slack(const float *x, const float *w, const float *b, int64_t n, int64_t ci,
                          int64_t h, int64_t wd, int64_t co, int64_t k, ddp_dtype low) {
  const int64_t oh = h - k + 1, ow = wd - k + 1, terms = ci * k * k + 1;
  double *s = malloc((size_t)(n * co * oh * ow) * sizeof *s);
  float *xr = malloc((size_t)(n * ci * h * wd) * sizeof *xr);
  for (int64_t i = 0; i < n * ci * h * wd; i++) xr[i] = fabsf(round_to(x[i], low));
  for (int64_t in = 0; in < n; in++)
    for (int64_t o = 0; o < co; o++)
      for (int64_t p = 0; p < oh; p++)
        for (int64_t q = 0; q < ow; q++) {
          double a = fabs(round_to(b[o], low));
          for (int64_t c = 0; c < ci; c++)
            for (int64_t u = 0; u < k; u++)
              for (int64_t v = 0; v < k; v++)
                a += xr[((in * ci + c) * h + p + u) * wd + q + v] *
                     fabs((double)round_to(w[((o * ci + c) * k + u) * k + v], low));
          s[((in * co + o) * oh + p) * ow + q] = 2 * gamma_k(terms) * a;
        }
  free(xr);
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

static void parity(ddp_dtype low, const char *name) {
  char path[512], file[64];
  snprintf(file, sizeof file, "autocast_%s.bin", name);
  ctx c = {.low = low, .name = name, .tape = new_tape()};
  assert_int_equal(fixture_load(fixture_path(file, path, sizeof path), &c.fx), DDP_OK);
  const ddp_precision prec = low == DDP_BFLOAT16 ? DDP_PRECISION_BF16 : DDP_PRECISION_FP16;
  ddp_tensor *x = wrap(&c, "x", false), *target = wrap_labels(&c);
  ddp_tensor *y, *h;
  double *sl;
  assert_int_equal(ddp_autocast_enter(prec), DDP_OK);
  ddp_tape_set_grad_enabled(c.tape, false);

  /* conv1: x (2,1,28,28), w (32,1,3,3) -> (2,32,26,26) */
  ddp_tensor *w1 = wrap(&c, "conv1.w", true), *b1 = wrap(&c, "conv1.b", true);
  assert_int_equal(ddp_conv2d(c.tape, x, w1, b1, 1, 0, &y), DDP_OK);
  sl = conv_slack(x->data, w1->data, b1->data, 2, 1, 28, 28, 32, 3, low);
  check_op(&c, "conv1", y, sl, 0);
  free(sl);

  /* batch_norm on conv1's output (training statistics, no running ones):
   * float32 from exact low inputs; slack 8 float32 ulps of |y| + 1e-6 for
   * the variance's rounding (values are O(1)). */
  ddp_tensor *c1 = wrap(&c, "conv1.y", false);
  c1->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
  ddp_tensor *bw = wrap(&c, "batch_norm.w", true), *bb = wrap(&c, "batch_norm.b", true);
  assert_int_equal(ddp_batch_norm(c.tape, c1, bw, bb, NULL, NULL, NULL, true, 0.1f, 1e-5f, &y),
                   DDP_OK);
  check_op(&c, "batch_norm", y, NULL, 1e-5);

  /* conv2: relu(conv1.y) (2,32,26,26), w (64,32,3,3) -> (2,64,24,24) */
  ddp_tensor *r1;
  assert_int_equal(ddp_relu(c.tape, c1, &r1), DDP_OK);
  assert_int_equal(ddp_tensor_values_dtype(r1), low); /* relu keeps its input's dtype */
  ddp_tensor *w2 = wrap(&c, "conv2.w", true), *b2 = wrap(&c, "conv2.b", true);
  assert_int_equal(ddp_conv2d(c.tape, r1, w2, b2, 1, 0, &y), DDP_OK);
  sl = conv_slack(r1->data, w2->data, b2->data, 2, 32, 26, 26, 64, 3, low);
  check_op(&c, "conv2", y, sl, 0);
  free(sl);

  /* fc1: flatten(max_pool(conv2.y)) (2,9216), w (128,9216) by formula */
  ddp_tensor *c2 = wrap(&c, "conv2.y", false), *p, *f;
  c2->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
  assert_int_equal(ddp_max_pool2d(c.tape, c2, 2, 2, &p), DDP_OK);
  assert_int_equal(ddp_flatten(c.tape, p, 1, &f), DDP_OK);
  assert_int_equal(ddp_tensor_values_dtype(f), low);
  float *fw = formula_weight(128, 9216);
  ddp_tensor w3;
  assert_int_equal(ddp_tensor_wrap(&w3, DDP_FLOAT32, 2, (int64_t[]){128, 9216}, fw), DDP_OK);
  w3.flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
  ddp_tensor *b3 = wrap(&c, "fc1.b", true);
  assert_int_equal(ddp_linear(c.tape, f, &w3, b3, &h), DDP_OK);
  sl = linear_slack(f->data, fw, b3->data, 2, 9216, 128, low);
  check_op(&c, "fc1", h, sl, 0);
  free(sl);

  /* fc2 and matmul: relu(fc1.y) (2,128) */
  ddp_tensor *h1 = wrap(&c, "fc1.y", false), *hr;
  h1->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
  assert_int_equal(ddp_relu(c.tape, h1, &hr), DDP_OK);
  ddp_tensor *w4 = wrap(&c, "fc2.w", true), *b4 = wrap(&c, "fc2.b", true);
  assert_int_equal(ddp_linear(c.tape, hr, w4, b4, &y), DDP_OK);
  sl = linear_slack(hr->data, w4->data, b4->data, 2, 128, 10, low);
  check_op(&c, "fc2", y, sl, 0);
  free(sl);
  ddp_tensor *mb = wrap(&c, "matmul.b", true);
  assert_int_equal(ddp_matmul(c.tape, hr, mb, &y), DDP_OK);
  float *mbt = malloc(1280 * sizeof *mbt); /* b^T (10,128) for linear_slack */
  for (int i = 0; i < 128; i++)
    for (int j = 0; j < 10; j++) mbt[j * 128 + i] = ddp_tensor_f32(mb)[i * 10 + j];
  sl = linear_slack(hr->data, mbt, NULL, 2, 128, 10, low);
  check_op(&c, "matmul", y, sl, 0);
  free(sl);
  free(mbt);

  /* log_softmax of fc2.y: in its input's dtype; float32 slack 4 ulps of
   * the largest |x| (exp, log and the max-shift are not PyTorch's). */
  ddp_tensor *z = wrap(&c, "fc2.y", false), *ls;
  z->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
  assert_int_equal(ddp_log_softmax(c.tape, z, &ls), DDP_OK);
  check_op(&c, "log_softmax", ls, NULL, 4 * 16 * U32);

  /* the fp32 list: losses in float32 from the low values (exact upcast);
   * slack 4 float32 ulps of the magnitudes (mean of 2 terms, exp/log). */
  ddp_tensor *lsy = wrap(&c, "log_softmax.y", false), *loss;
  lsy->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
  assert_int_equal(ddp_nll_loss(c.tape, lsy, target, &loss), DDP_OK);
  check_op(&c, "nll_loss", loss, NULL, 4 * 16 * U32);
  assert_int_equal(ddp_cross_entropy(c.tape, z, target, &loss), DDP_OK);
  check_op(&c, "cross_entropy", loss, NULL, 4 * 16 * U32);
  ddp_tensor *mt = wrap(&c, "mse_target", false);
  assert_int_equal(ddp_mse_loss(c.tape, z, mt, &loss), DDP_OK);
  check_op(&c, "mse_loss", loss, NULL, 4 * 16 * U32);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  free(fw);
  ddp_tape_destroy(c.tape);
  fixture_free(c.fx);
}

static void test_parity_bf16(void **state) {
  (void)state;
  for_each_family(parity, DDP_BFLOAT16, "bf16");
}

static void test_parity_fp16(void **state) {
  (void)state;
  for_each_family(parity, DDP_FLOAT16, "fp16");
}

/* The ConvNet chain (conv1, relu, conv2, max_pool, flatten, fc1, relu,
 * fc2, log_softmax, nll_loss; dropout left out) forward in the region and
 * backward outside it, against PyTorch's loss and parameter gradients.
 * Each op's output may differ from PyTorch's by one ulp of the low dtype
 * (the per-op parity above), and those differences travel through the
 * backward, so the gradients are compared normwise: ||ours - torch|| <=
 * 4 ulp_low(1) ||torch|| per parameter (four roundings' worth), and every
 * gradient must hold values of the low dtype (the backward rounds them as
 * PyTorch's does) in float32. */
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
  char path[512], file[64];
  snprintf(file, sizeof file, "autocast_%s.bin", name);
  ctx c = {.low = low, .name = name, .tape = new_tape()};
  assert_int_equal(fixture_load(fixture_path(file, path, sizeof path), &c.fx), DDP_OK);
  const ddp_precision prec = low == DDP_BFLOAT16 ? DDP_PRECISION_BF16 : DDP_PRECISION_FP16;
  ddp_tensor *params[8] = {wrap(&c, "conv1.w", true), wrap(&c, "conv1.b", true),
                           wrap(&c, "conv2.w", true), wrap(&c, "conv2.b", true),
                           NULL,                      wrap(&c, "fc1.b", true),
                           wrap(&c, "fc2.w", true),   wrap(&c, "fc2.b", true)};
  float *fw = formula_weight(128, 9216);
  ddp_tensor w3;
  assert_int_equal(ddp_tensor_wrap(&w3, DDP_FLOAT32, 2, (int64_t[]){128, 9216}, fw), DDP_OK);
  w3.flags |= DDP_TENSOR_REQUIRES_GRAD | DDP_TENSOR_PARAM;
  params[4] = &w3;
  for (int i = 0; i < 8; i++) assert_int_equal(ddp_tensor_ensure_grad(params[i]), DDP_OK);
  ddp_tensor *x = wrap(&c, "x", false), *target = wrap_labels(&c), *t, *loss;
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
  const float ref_loss = *(const float *)need(&c, "chain.loss")->data;
  printf("  %s chain loss ours %.9g torch %.9g\n", name, ddp_tensor_f32(loss)[0], ref_loss);
  assert_true(fabs(ddp_tensor_f32(loss)[0] - ref_loss) <= 2 * ulp_of(ref_loss, low));
  static const char *const keys[8] = {"conv1.w", "conv1.b", "conv2.w", "conv2.b",
                                      "fc1.w",   "fc1.b",   "fc2.w",   "fc2.b"};
  const double tol = 4 * ulp_of(1.0, low);
  for (int i = 0; i < 8; i++) {
    ddp_tensor *prm = params[i];
    char key[64];
    double norm, err;
    assert_true(exact_in(prm->grad, prm->numel, low));
    if (i == 4) { /* fc1.w: 4 of its rows (not zero) and the whole one's sum of squares */
      const int64_t *rows = need(&c, "chain.fc1.w.grad_rows")->data;
      float *ours = malloc(4 * 9216 * sizeof *ours);
      for (int r = 0; r < 4; r++)
        memcpy(ours + r * 9216, prm->grad + rows[r] * 9216, 9216 * sizeof *ours);
      err = rel_err(ours, need(&c, "chain.fc1.w.grad_rows4")->data, 4 * 9216, &norm);
      free(ours);
      assert_true(norm > 0);
      double sumsq = 0;
      for (int64_t j = 0; j < prm->numel; j++) sumsq += (double)prm->grad[j] * prm->grad[j];
      const double ref = *(const double *)need(&c, "chain.fc1.w.grad_sumsq")->data;
      printf("  %s chain fc1.w sum of squares ours %.6g torch %.6g\n", name, sumsq, ref);
      assert_true(fabs(sqrt(sumsq) - sqrt(ref)) <= tol * sqrt(ref));
    } else {
      snprintf(key, sizeof key, "chain.%s.grad", keys[i]);
      err = rel_err(prm->grad, need(&c, key)->data, prm->numel, &norm);
    }
    printf("  %s chain d%-8s ||ours - torch|| / ||torch|| = %.3g (bound %.3g)\n", name, keys[i],
           err, tol);
    if (!(err <= tol)) fail_msg("%s chain d%s: relative error %.3g > %.3g", name, keys[i], err, tol);
    ddp_tensor_free_grad(prm);
  }
  free(fw);
  ddp_tape_destroy(c.tape);
  fixture_free(c.fx);
}

static void test_chain_bf16(void **state) {
  (void)state;
  for_each_family(chain, DDP_BFLOAT16, "bf16");
}

static void test_chain_fp16(void **state) {
  (void)state;
  chain(DDP_FLOAT16, "fp16");
}

/* The convolution kernels' fused rounding (ddp__conv2d_geom.round, which
 * conv2d sets under autocast): on every family and on geometries that take
 * each of their paths (Winograd, conv_rows, shifted copies, pointwise,
 * a column matrix with stride 2 and col2im, bfloat16 dot products over
 * channel pairs), y and dx come out holding
 * `low` values, within the parity bound of a float64 sum of the rounded
 * operands (dy rounded by the kernels as they read it); dw and db, which
 * the op rounds when it delivers them, within the float32 bound. */
typedef struct conv_case {
  int64_t n, c, h, o, k, stride, pad;
} conv_case;

static void check_conv_rounding(ddp_dtype low, const char *name) {
  static const conv_case cases[] = {
      {2, 16, 10, 32, 3, 1, 0}, /* Winograd: forward, dW and dX */
      {2, 1, 12, 32, 3, 1, 0},  /* conv_rows forward, dW by conv_taps */
      {2, 3, 10, 8, 3, 1, 1},   /* same convolution, few channels: shifted */
      {2, 8, 6, 16, 1, 1, 0},   /* pointwise */
      {2, 4, 9, 32, 3, 2, 1},   /* stride 2: column matrix, dX by col2im */
      /* bfloat16 with AVX512_BF16: forward and dX by vdpbf16ps over
       * channel pairs (cpu/conv_bf16.c); the float32 kernels elsewhere */
      {2, 16, 14, 32, 5, 1, 2}, /* the ConvNet's conv2 */
      {2, 5, 11, 12, 3, 1, 0},  /* an odd channel, 12 channels out: a tile of 8 and 4 single */
      {2, 16, 8, 20, 5, 1, 1},  /* 6 rows: two tiles of 3; dX padded by 3 */
      {2, 4, 20, 16, 3, 1, 0},  /* 18-wide rows (dX: 20): flat tiles */
      /* one input channel: taps paired along kernel rows */
      {2, 1, 28, 16, 5, 1, 2},  /* the ConvNet's conv1: flat tiles of 28-wide rows */
      {2, 1, 19, 9, 5, 1, 1},   /* 17-wide rows, 289 outputs, 9 channels */
      {2, 1, 9, 12, 4, 1, 0},   /* an even kernel width without padding */
      {2, 1, 12, 16, 5, 1, 1},  /* 10-wide rows, an odd kernel: its last taps on single columns */
      {2, 1, 10, 16, 5, 1, 0},  /* an odd kernel width without padding */
      /* dW in pairs with 40 channels out (a partial vector); 9-wide rows
       * (odd: dW on the float32 kernel) with 33 channels out */
      {2, 3, 10, 40, 5, 1, 1},
      {2, 2, 10, 33, 4, 1, 1},
  };
  ddp_arena arena;
  ddp_arena_init(&arena, 1 << 20);
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const conv_case *cc = &cases[ci];
    ddp__conv2d_geom g = {.n = cc->n, .c = cc->c, .h = cc->h, .w = cc->h, .o = cc->o,
                          .kh = cc->k, .kw = cc->k, .stride = cc->stride, .pad = cc->pad,
                          .round = (int)low};
    g.oh = (g.h + 2 * g.pad - g.kh) / g.stride + 1;
    g.ow = g.oh;
    const int64_t xs = g.n * g.c * g.h * g.w, ws = g.o * g.c * g.kh * g.kw;
    const int64_t ys = g.n * g.o * g.oh * g.ow, kk = g.c * g.kh * g.kw;
    ddp_tensor *xt = gradcheck_random(1, (int64_t[]){xs}, -2, 2, 31 + ci, false);
    ddp_tensor *wt = gradcheck_random(1, (int64_t[]){ws}, -1, 1, 41 + ci, false);
    ddp_tensor *bt = gradcheck_random(1, (int64_t[]){g.o}, -1, 1, 51 + ci, false);
    ddp_tensor *dyt = gradcheck_random(1, (int64_t[]){ys}, -1, 1, 61 + ci, false);
    float *x = xt->data, *w = wt->data, *b = bt->data, *dy = dyt->data;
    for (int64_t i = 0; i < xs; i++) x[i] = round_to(x[i], low); /* the op's operands */
    for (int64_t i = 0; i < ws; i++) w[i] = round_to(w[i], low);
    for (int64_t i = 0; i < g.o; i++) b[i] = round_to(b[i], low);
    float *y = malloc((size_t)ys * sizeof *y), *dx = malloc((size_t)xs * sizeof *dx);
    float *dw = calloc((size_t)ws, sizeof *dw), *db = calloc((size_t)g.o, sizeof *db);
    const int64_t most = xs > ys ? (xs > ws ? xs : ws) : (ys > ws ? ys : ws);
    float *ref = malloc((size_t)most * sizeof *ref);
    double *sl = calloc((size_t)most, sizeof *sl);
    double *dxs = calloc((size_t)xs, sizeof *dxs), *dxa = calloc((size_t)xs, sizeof *dxa);
    double *dws = calloc((size_t)ws, sizeof *dws), *dwa = calloc((size_t)ws, sizeof *dwa);
    double dbs[64] = {0}, dba[64] = {0};
    ddp_arena_reset(&arena);
    assert_int_equal(ddp__cpu_conv2d_forward(y, x, w, b, &g, &arena), DDP_OK);
    ddp_arena_reset(&arena);
    assert_int_equal(ddp__cpu_conv2d_backward(dx, dw, db, dy, x, w, &g, false, &arena), DDP_OK);
    /* float64 references: y from the rounded operands; the gradients from
     * dy rounded to `low`, each product added to dx, dw, db */
    for (int64_t n = 0; n < g.n; n++)
      for (int64_t o = 0; o < g.o; o++)
        for (int64_t oy = 0; oy < g.oh; oy++)
          for (int64_t ox = 0; ox < g.ow; ox++) {
            const int64_t yi = ((n * g.o + o) * g.oh + oy) * g.ow + ox;
            const double d = round_to(dy[yi], low);
            double sum = b[o], abs_sum = fabs(b[o]);
            dbs[o] += d;
            dba[o] += fabs(d);
            for (int64_t c = 0; c < g.c; c++)
              for (int64_t a = 0; a < g.kh; a++)
                for (int64_t e = 0; e < g.kw; e++) {
                  const int64_t iy = oy * g.stride - g.pad + a, ix = ox * g.stride - g.pad + e;
                  if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                  const int64_t xi = ((n * g.c + c) * g.h + iy) * g.w + ix;
                  const int64_t wi = ((o * g.c + c) * g.kh + a) * g.kw + e;
                  sum += (double)x[xi] * w[wi];
                  abs_sum += fabs((double)x[xi] * w[wi]);
                  dxs[xi] += d * w[wi];
                  dxa[xi] += fabs(d * w[wi]);
                  dws[wi] += d * x[xi];
                  dwa[wi] += fabs(d * x[xi]);
                }
            ref[yi] = (float)sum;
            sl[yi] = 2 * gamma_k(kk + 1) * abs_sum;
          }
    char what[80];
    for (int64_t i = 0; i < ys; i++)
      if (round_to(y[i], low) != y[i])
        fail_msg("conv %zu y[%lld] = %.9g is not %s", ci, (long long)i, y[i], name);
    snprintf(what, sizeof what, "conv %zu %s y", ci, name);
    check_within(what, y, ref, ys, low, sl, 0);
    const int64_t dx_terms = g.o * g.kh * g.kw, dw_terms = g.n * g.oh * g.ow;
    for (int64_t i = 0; i < xs; i++) {
      if (round_to(dx[i], low) != dx[i])
        fail_msg("conv %zu dx[%lld] = %.9g is not %s", ci, (long long)i, dx[i], name);
      ref[i] = (float)dxs[i];
      sl[i] = 2 * gamma_k(dx_terms) * dxa[i];
    }
    snprintf(what, sizeof what, "conv %zu %s dx", ci, name);
    check_within(what, dx, ref, xs, low, sl, 0);
    for (int64_t i = 0; i < ws; i++) {
      ref[i] = (float)dws[i];
      sl[i] = 2 * gamma_k(dw_terms) * dwa[i];
    }
    snprintf(what, sizeof what, "conv %zu %s dw", ci, name);
    check_within(what, dw, ref, ws, DDP_FLOAT32, sl, 0);
    for (int64_t i = 0; i < g.o; i++) {
      ref[i] = (float)dbs[i];
      sl[i] = 2 * gamma_k(dw_terms) * dba[i];
    }
    snprintf(what, sizeof what, "conv %zu %s db", ci, name);
    check_within(what, db, ref, g.o, DDP_FLOAT32, sl, 0);
    free(y), free(dx), free(dw), free(db), free(ref), free(sl);
    free(dxs), free(dxa), free(dws), free(dwa);
    ddp_tensor_destroy(xt), ddp_tensor_destroy(wt), ddp_tensor_destroy(bt),
        ddp_tensor_destroy(dyt);
  }
  ddp_arena_free(&arena);
}

static void test_conv_kernels_round_bf16(void **state) {
  (void)state;
  for_each_family(check_conv_rounding, DDP_BFLOAT16, "bf16");
}

static void test_conv_kernels_round_fp16(void **state) {
  (void)state;
  for_each_family(check_conv_rounding, DDP_FLOAT16, "fp16");
}

/* A non-finite input reaches only the outputs whose windows hold it, as
 * in PyTorch: an infinite input gives +-inf there and leaves every other
 * output finite. The one-channel bfloat16 kernels pair kernel columns (a,
 * 2j) and (a, 2j + 1); with an odd kernel width the last pair's second tap
 * has a zero weight, and it must not read a real input (0 x inf = NaN one
 * column left of the inf's windows). Rows up to 16 wide and flat tiles,
 * the ConvNet's conv1 (5x5, padding 2) among them; then channel pairs. */
static void check_conv_inf_stays_local(ddp_dtype low, const char *name) {
  static const conv_case cases[] = {
      {1, 1, 12, 16, 5, 1, 2}, /* rows tiles (16 channels out: not the shifted copies) */
      {1, 1, 28, 16, 5, 1, 2}, /* the ConvNet's conv1: flat tiles */
      {1, 1, 11, 16, 3, 1, 1}, /* 3x3 */
      {1, 3, 10, 16, 5, 1, 1}, /* channel pairs, an odd channel */
  };
  ddp_arena arena;
  ddp_arena_init(&arena, 1 << 16);
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const conv_case *cc = &cases[ci];
    ddp__conv2d_geom g = {.n = cc->n, .c = cc->c, .h = cc->h, .w = cc->h, .o = cc->o,
                          .kh = cc->k, .kw = cc->k, .stride = 1, .pad = cc->pad,
                          .round = (int)low};
    g.oh = g.ow = g.h + 2 * g.pad - g.kh + 1;
    const int64_t xs = g.n * g.c * g.h * g.w, ws = g.o * g.c * g.kh * g.kw;
    const int64_t ys = g.n * g.o * g.oh * g.ow;
    ddp_tensor *xt = gradcheck_random(1, (int64_t[]){xs}, -2, 2, 71 + ci, false);
    ddp_tensor *wt = gradcheck_random(1, (int64_t[]){ws}, 0.25, 1, 81 + ci, false);
    float *x = xt->data, *w = wt->data, *y = malloc((size_t)ys * sizeof *y);
    for (int64_t i = 0; i < xs; i++) x[i] = round_to(x[i], low);
    for (int64_t i = 0; i < ws; i++) w[i] = round_to(w[i], low); /* positive: +inf */
    const int64_t iy = g.h / 2, ix = g.w / 2, ic = g.c - 1;
    x[(ic * g.h + iy) * g.w + ix] = INFINITY;
    ddp_arena_reset(&arena);
    assert_int_equal(ddp__cpu_conv2d_forward(y, x, w, NULL, &g, &arena), DDP_OK);
    for (int64_t o = 0; o < g.o; o++)
      for (int64_t oy = 0; oy < g.oh; oy++)
        for (int64_t ox = 0; ox < g.ow; ox++) {
          const float v = y[(o * g.oh + oy) * g.ow + ox];
          const int64_t a = iy + g.pad - oy, b = ix + g.pad - ox; /* the inf's tap */
          const bool inside = a >= 0 && a < g.kh && b >= 0 && b < g.kw;
          if (inside ? !(isinf(v) && v > 0) : !isfinite(v))
            fail_msg("%s conv %zu: y[%lld][%lld][%lld] = %g, expected %s (the inf at (%lld, "
                     "%lld) %s its window)",
                     name, ci, (long long)o, (long long)oy, (long long)ox, v,
                     inside ? "+inf" : "a finite value", (long long)iy, (long long)ix,
                     inside ? "in" : "not in");
        }
    free(y);
    ddp_tensor_destroy(xt), ddp_tensor_destroy(wt);
  }
  ddp_arena_free(&arena);
}

static void test_conv_inf_stays_local(void **state) {
  (void)state;
  for_each_family(check_conv_inf_stays_local, DDP_BFLOAT16, "bf16");
}

/* The bfloat16 kernels round y in their stores: the same bits as
 * ddp_convert_round_f32 on ties to even and odd, values rounding up to
 * infinity, infinities and NaNs (quiet and signalling). With x and w zero,
 * y is the bias: each output channel's bias one such value, on every
 * geometry of the kernels (channel pairs, column pairs, rows tiles and flat
 * tiles). */
static void test_conv_bf16_store_rounding(void **state) {
  (void)state;
  if (!ddp__cpu_force_family(DDP__CPU_AVX512) || !ddp__cpu_has_bf16_dot()) {
    ddp__cpu_force_family(-1);
    printf("  no AVX512_BF16 on this CPU: nothing to check here (the float32 kernels run)\n");
    return;
  }
  static const uint32_t bits[] = {
      0x3f808000u, /* 1 + 2^-8: a tie, down to even 1 */
      0x3f818000u, /* a tie, up to even */
      0x3f808001u, /* just above a tie */
      0xbf817fffu, /* just below one, negative */
      0x7f7fffffu, /* the largest float: to +inf */
      0xff7f8000u, /* a tie at the top: to -inf */
      0x7f800000u, 0xff800000u, /* infinities */
      0x7fc12345u, /* a quiet NaN with a payload */
      0x7f812345u, /* a signalling NaN */
      0xffa00001u, /* a negative signalling NaN */
      0x00000000u, 0x3f800000u, 0x42f6e979u, 0xc2f6e979u, /* (-0 + the +0 products is +0) */
  };
  enum { O = sizeof bits / sizeof *bits };
  static const conv_case cases[] = {
      /* (none a same convolution: below 16 channels out those take the
       * float32 shifted copies) */
      {1, 2, 10, O, 4, 1, 1}, /* channel pairs, rows tiles */
      {1, 2, 20, O, 4, 1, 1}, /* channel pairs, flat tiles */
      {1, 1, 10, O, 5, 1, 1}, /* column pairs and single columns, rows tiles */
      {1, 1, 24, O, 5, 1, 1}, /* column pairs and single columns, flat tiles */
      {1, 1, 24, O, 4, 1, 1}, /* column pairs, flat tiles */
  };
  float bias[O], want[O];
  memcpy(bias, bits, sizeof bias);
  ddp_convert_round_f32(want, bias, O, DDP_BFLOAT16);
  ddp_arena arena;
  ddp_arena_init(&arena, 1 << 16);
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const conv_case *cc = &cases[ci];
    ddp__conv2d_geom g = {.n = cc->n, .c = cc->c, .h = cc->h, .w = cc->h, .o = cc->o,
                          .kh = cc->k, .kw = cc->k, .stride = 1, .pad = cc->pad,
                          .round = DDP_BFLOAT16};
    g.oh = g.ow = g.h + 2 * g.pad - g.kh + 1;
    const int64_t ohw = g.oh * g.ow;
    float *x = calloc((size_t)(g.c * g.h * g.w), sizeof *x);
    float *w = calloc((size_t)(g.o * g.c * g.kh * g.kw), sizeof *w);
    float *y = malloc((size_t)(g.o * ohw) * sizeof *y);
    ddp_arena_reset(&arena);
    assert_int_equal(ddp__cpu_conv2d_forward(y, x, w, bias, &g, &arena), DDP_OK);
    for (int64_t o = 0; o < g.o; o++)
      for (int64_t p = 0; p < ohw; p++) {
        uint32_t got, exp;
        memcpy(&got, &y[o * ohw + p], sizeof got);
        memcpy(&exp, &want[o], sizeof exp);
        if (got != exp)
          fail_msg("conv %zu: bias 0x%08x stored as 0x%08x at %lld, ddp_convert_round_f32 "
                   "gives 0x%08x", ci, bits[o], got, (long long)p, exp);
      }
    free(x), free(w), free(y);
  }
  ddp_arena_free(&arena);
  ddp__cpu_force_family(-1);
}

/* The bfloat16 kernels' whole-vector reads stay inside their buffers:
 * an arena whose every chunk ends at an inaccessible page (a read past a
 * chunk's end faults, in release as under ASan), with its first chunk
 * filled beforehand by every multiple of 64 bytes in turn, so that each of
 * the convolution's scratch buffers in turn is the one ending at the guard
 * page. The geometries: one input channel with rows up to 16 wide (the
 * rows tiles read 16 words from each row start) on column-pair images
 * whose size is a multiple of 16 words, odd and even kernels; two
 * channels (pair images); the backward's dX and dW on the same. */
typedef struct guard_map {
  void *payload, *base;
  size_t len;
} guard_map;
static guard_map guard_maps[64];

static void *guard_alloc(size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t body = (bytes + page - 1) / page * page, len = body + page;
  char *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return NULL;
  if (mprotect(base + body, page, PROT_NONE) != 0) {
    munmap(base, len);
    return NULL;
  }
  for (size_t i = 0; i < sizeof guard_maps / sizeof *guard_maps; i++)
    if (!guard_maps[i].payload) {
      guard_maps[i] = (guard_map){base + body - bytes, base, len};
      return guard_maps[i].payload;
    }
  munmap(base, len);
  return NULL;
}

static void guard_free(void *p) {
  for (size_t i = 0; i < sizeof guard_maps / sizeof *guard_maps; i++)
    if (guard_maps[i].payload == p) {
      munmap(guard_maps[i].base, guard_maps[i].len);
      guard_maps[i] = (guard_map){0};
      return;
    }
}

static void guard_zero(void *p, size_t bytes) { memset(p, 0, bytes); }

static void test_conv_bf16_reads_stay_inside(void **state) {
  (void)state;
  if (!ddp__cpu_force_family(DDP__CPU_AVX512) || !ddp__cpu_has_bf16_dot()) {
    ddp__cpu_force_family(-1);
    printf("  no AVX512_BF16 on this CPU: nothing to check here (the float32 kernels run)\n");
    return;
  }
  static const ddp_arena_backing guard = {"guard pages", guard_alloc, guard_free, guard_zero};
  static const conv_case cases[] = {
      {1, 1, 16, 16, 4, 1, 0}, /* 16x16 image (256 words), 13-wide rows */
      {1, 1, 6, 16, 3, 1, 1},  /* 8x8 padded image (64 words), 6-wide rows; singles */
      {1, 1, 14, 16, 5, 1, 1}, /* 16x16 padded, 12-wide rows; singles */
      {1, 1, 16, 16, 3, 1, 0}, /* an odd kernel without padding; singles */
      {1, 2, 8, 16, 3, 1, 1},  /* channel pairs */
      {1, 3, 10, 32, 4, 1, 1}, /* channel pairs, dW (32 channels out, 9 rows: float32) */
      {1, 2, 12, 32, 4, 1, 1}, /* dW in pairs (11 rows: float32); dX from 32 channels */
      {1, 2, 11, 32, 4, 1, 1}, /* dW in pairs (10-wide rows) */
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const conv_case *cc = &cases[ci];
    ddp__conv2d_geom g = {.n = cc->n, .c = cc->c, .h = cc->h, .w = cc->h, .o = cc->o,
                          .kh = cc->k, .kw = cc->k, .stride = 1, .pad = cc->pad,
                          .round = DDP_BFLOAT16};
    g.oh = g.ow = g.h + 2 * g.pad - g.kh + 1;
    const int64_t xs = g.n * g.c * g.h * g.w, ws = g.o * g.c * g.kh * g.kw;
    const int64_t ys = g.n * g.o * g.oh * g.ow;
    float *x = calloc((size_t)xs, sizeof *x), *w = calloc((size_t)ws, sizeof *w);
    float *y = calloc((size_t)ys, sizeof *y), *dy = calloc((size_t)ys, sizeof *dy);
    float *dx = calloc((size_t)xs, sizeof *dx), *dw = calloc((size_t)ws, sizeof *dw);
    for (int64_t i = 0; i < xs; i++) x[i] = round_to((float)((i % 7) - 3), DDP_BFLOAT16);
    for (int64_t i = 0; i < ws; i++) w[i] = round_to((float)((i % 5) - 2) / 4, DDP_BFLOAT16);
    for (int64_t i = 0; i < ys; i++) dy[i] = (float)((i % 3) - 1);
    for (size_t fill = 0; fill < 4096; fill += 64) {
      ddp_arena arena;
      ddp_arena_init_backed(&arena, 4096, &guard);
      if (fill) assert_non_null(ddp_arena_alloc(&arena, fill));
      assert_int_equal(ddp__cpu_conv2d_forward(y, x, w, NULL, &g, &arena), DDP_OK);
      ddp_arena_free(&arena);
      ddp_arena_init_backed(&arena, 4096, &guard);
      if (fill) assert_non_null(ddp_arena_alloc(&arena, fill));
      memset(dw, 0, (size_t)ws * sizeof *dw);
      assert_int_equal(ddp__cpu_conv2d_backward(dx, dw, NULL, dy, x, w, &g, false, &arena),
                       DDP_OK);
      ddp_arena_free(&arena);
    }
    free(x), free(w), free(y), free(dy), free(dx), free(dw);
  }
  ddp__cpu_force_family(-1);
}

/* conv2d keeps the input as its forward rounded it for the backward. A
 * leaf input that requires grad must not be kept as the thread's cast
 * cache's copy: ddp_autocast_cache_free between the forward and the
 * backward releases that copy, and the next region's fill reuses the
 * memory. The weight's gradient must come out the same, bit for bit, as
 * with an input the cache never holds. */
static void test_conv_saved_input_outlives_cache(void **state) {
  (void)state;
  int64_t sx[4] = {2, 3, 9, 9}, sw[4] = {4, 3, 3, 3};
  ddp_tensor *x = gradcheck_random(4, sx, -2, 2, 21, true);
  ddp_tensor *x2 = gradcheck_random(4, sx, -2, 2, 22, true);
  ddp_tensor *w = gradcheck_random(4, sw, -1, 1, 23, true);
  ddp_tensor *xc, *y, *y2;
  assert_int_equal(ddp_tensor_create(&xc, DDP_FLOAT32, 4, sx), DDP_OK);
  memcpy(xc->data, x->data, (size_t)x->numel * sizeof(float));
  const size_t wbytes = (size_t)w->numel * sizeof(float);
  float *dw_ref = malloc(wbytes);
  assert_non_null(dw_ref);
  /* the reference: the same values in a tensor that is not a leaf
   * requiring grad (rounded into the tape's scratch) */
  ddp_tape *tape = new_tape(), *other = new_tape();
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_conv2d(tape, xc, w, NULL, 1, 1, &y), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(backward_ones(tape, y), DDP_OK);
  memcpy(dw_ref, w->grad, wbytes);
  ddp_tensor_free_grad(w);
  ddp_tape_reset(tape);
  /* the leaf: its cached copy freed, then its memory filled by another
   * leaf's copy, before the backward */
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_conv2d(tape, x, w, NULL, 1, 1, &y), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  ddp_autocast_cache_free();
  assert_int_equal(ddp_autocast_enter(DDP_PRECISION_BF16), DDP_OK);
  assert_int_equal(ddp_conv2d(other, x2, w, NULL, 1, 1, &y2), DDP_OK);
  assert_int_equal(ddp_autocast_exit(), DDP_OK);
  assert_int_equal(backward_ones(tape, y), DDP_OK);
  assert_memory_equal(w->grad, dw_ref, wbytes);
  ddp_autocast_cache_free();
  free(dw_ref);
  ddp_tape_destroy(other);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(xc);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(x2);
  ddp_tensor_destroy(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_regions_nest),
      cmocka_unit_test(test_regions_are_per_thread),
      cmocka_unit_test(test_nested_off_region_is_float32),
      cmocka_unit_test(test_cast_cache),
      cmocka_unit_test(test_linear_backward_rule),
      cmocka_unit_test(test_bf16_gemm_kernel),
      cmocka_unit_test(test_conv_kernels_round_bf16),
      cmocka_unit_test(test_conv_kernels_round_fp16),
      cmocka_unit_test(test_conv_bf16_store_rounding),
      cmocka_unit_test(test_conv_bf16_reads_stay_inside),
      cmocka_unit_test(test_conv_inf_stays_local),
      cmocka_unit_test(test_conv_saved_input_outlives_cache),
      cmocka_unit_test(test_parity_bf16),
      cmocka_unit_test(test_parity_fp16),
      cmocka_unit_test(test_chain_bf16),
      cmocka_unit_test(test_chain_fp16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
