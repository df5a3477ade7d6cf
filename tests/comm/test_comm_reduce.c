/* comm reduction kernels: float16 / bfloat16 conversions over all 65536 bit
 * patterns against a reference built from the formats' definitions (and
 * F16C's hardware conversion where the build has it), rounding at every
 * midpoint between neighbouring values, and every dtype x op kernel against
 * closed forms, at lengths that exercise vector tails and unaligned starts. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "comm/backend.h"

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* IEEE binary16 by definition: (-1)^s * 2^(e-15) * 1.m, subnormal 2^-14 * 0.m. */
static double ref_half(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp(m, -24);
  else v = ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

static void test_half_to_float_all(void **state) {
  for (uint32_t h = 0; h < 65536; h++) {
    float got = ddp_half_to_float((uint16_t)h);
    double want = ref_half((uint16_t)h);
    if (isnan(want)) {
      if (!isnan(got) || (fbits(got) >> 31) != (h >> 15)) fail_msg("half 0x%04x -> %a, want NaN", h, got);
      /* quieted, the payload kept in the top mantissa bits (as F16C does) */
      assert_int_equal((fbits(got) >> 13) & 0x3ff, (h & 0x3ff) | 0x200);
    } else if ((double)got != want || (fbits(got) >> 31) != (h >> 15)) {
      fail_msg("half 0x%04x -> %a, want %a", h, got, want);
    }
  }
}

static void test_half_round_trip_all(void **state) {
  for (uint32_t h = 0; h < 65536; h++) {
    uint16_t back = ddp_float_to_half(ddp_half_to_float((uint16_t)h));
    bool nan = ((h >> 10) & 31) == 31 && (h & 1023);
    uint16_t want = nan ? (uint16_t)(h | 0x200) : (uint16_t)h; /* NaNs come back quiet */
    if (back != want) fail_msg("half 0x%04x -> float -> 0x%04x, want 0x%04x", h, back, want);
  }
}

/* Between every pair of neighbouring finite halves (and past the largest),
 * the midpoint rounds to the even one and anything off it to the nearer. */
static void test_half_rounding_midpoints(void **state) {
  for (uint32_t sign = 0; sign <= 0x8000; sign += 0x8000) {
    for (uint32_t h = 0; h < 0x7c00; h++) {
      double lo = fabs(ref_half((uint16_t)h));
      double hi = h == 0x7bff ? 65536.0 : fabs(ref_half((uint16_t)(h + 1)));
      float mid = (float)((lo + hi) / 2); /* exact: one bit more than a half */
      assert_true((double)mid == (lo + hi) / 2);
      uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
      float below = nextafterf(mid, 0), above = nextafterf(mid, INFINITY);
      if (sign) {
        mid = -mid;
        below = -below;
        above = -above;
      }
      uint16_t s = (uint16_t)sign;
      if (ddp_float_to_half(mid) != (even | s))
        fail_msg("float %a (midpoint above half 0x%04x) -> 0x%04x, want 0x%04x", mid, h,
                 ddp_float_to_half(mid), even | s);
      if (ddp_float_to_half(below) != (h | s))
        fail_msg("float %a -> 0x%04x, want 0x%04x", below, ddp_float_to_half(below), h | s);
      if (ddp_float_to_half(above) != ((h + 1) | s))
        fail_msg("float %a -> 0x%04x, want 0x%04x", above, ddp_float_to_half(above),
                 (h + 1) | s);
    }
  }
  assert_int_equal(ddp_float_to_half(INFINITY), 0x7c00);
  assert_int_equal(ddp_float_to_half(-INFINITY), 0xfc00);
  assert_int_equal(ddp_float_to_half(1e10f), 0x7c00);
  assert_int_equal(ddp_float_to_half(1e-10f), 0x0000);
  assert_int_equal(ddp_float_to_half(-1e-10f), 0x8000);
  assert_int_equal(ddp_float_to_half(from_bits(1)), 0); /* float subnormal */
  assert_true((ddp_float_to_half(NAN) & 0x7fff) > 0x7c00);
}

/* Against the CPU's own conversion (F16C), on every float whose low 13 bits
 * take a few telling values and on random bit patterns, NaNs included. */
static void test_half_vs_f16c(void **state) {
#ifdef __F16C__
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (uint32_t hi = 0; hi < (1u << 19); hi++) {
    static const uint32_t lows[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff};
    for (size_t k = 0; k < sizeof lows / sizeof *lows + 2; k++) {
      uint32_t u;
      if (k < sizeof lows / sizeof *lows) {
        u = (hi << 13) | lows[k];
      } else {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        u = (uint32_t)x;
      }
      float f = from_bits(u);
      uint16_t want = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
      uint16_t got = ddp_float_to_half(f);
      if (got != want) fail_msg("float 0x%08x -> 0x%04x, F16C says 0x%04x", u, got, want);
    }
  }
  for (uint32_t h = 0; h < 65536; h++) {
    float want = _cvtsh_ss((unsigned short)h), got = ddp_half_to_float((uint16_t)h);
    if (fbits(got) != fbits(want)) fail_msg("half 0x%04x -> %a, F16C says %a", h, got, want);
  }
#else
  print_message("no F16C in this build: the hardware comparison is skipped\n");
#endif
}

static void test_bf16_all(void **state) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = ddp_bf16_to_float((uint16_t)h);
    assert_int_equal(fbits(f), h << 16); /* bfloat16 is the top half of a float */
    uint16_t back = ddp_float_to_bf16(f);
    bool nan = ((h >> 7) & 0xff) == 0xff && (h & 0x7f);
    uint16_t want = nan ? (uint16_t)(h | 0x40) : (uint16_t)h;
    if (back != want) fail_msg("bf16 0x%04x -> float -> 0x%04x, want 0x%04x", h, back, want);
    if (nan) continue;
    /* Rounding: the midpoint to the next bf16 value goes to the even one;
     * one float ulp either side goes to the nearer. 0x7f7f rounds up to Inf. */
    bool finite = ((h >> 7) & 0xff) != 0xff;
    if (!finite || (h & 0x7fff) == 0x7f7f) continue;
    uint32_t mid = (h << 16) | 0x8000u;
    uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
    if (ddp_float_to_bf16(from_bits(mid)) != even)
      fail_msg("float 0x%08x -> 0x%04x, want 0x%04x", mid, ddp_float_to_bf16(from_bits(mid)), even);
    assert_int_equal(ddp_float_to_bf16(from_bits(mid - 1)), h);
    assert_int_equal(ddp_float_to_bf16(from_bits(mid + 1)), (uint16_t)(h + 1));
  }
  assert_int_equal(ddp_float_to_bf16(from_bits(0x7f7fffffu)), 0x7f80); /* FLT_MAX -> Inf */
  assert_int_equal(ddp_float_to_bf16(-INFINITY), 0xff80);
  assert_true((ddp_float_to_bf16(NAN) & 0x7fff) > 0x7f80);
}

/* ---- Kernels ---------------------------------------------------------------- */

static const ddp_dtype dtypes[] = {DDP_FLOAT32, DDP_FLOAT64, DDP_INT32,
                                   DDP_INT64,   DDP_FLOAT16, DDP_BFLOAT16};

static double get(ddp_dtype dt, const void *p, size_t i) {
  switch (dt) {
  case DDP_FLOAT32: return ((const float *)p)[i];
  case DDP_FLOAT64: return ((const double *)p)[i];
  case DDP_INT32: return ((const int32_t *)p)[i];
  case DDP_INT64: return (double)((const int64_t *)p)[i];
  case DDP_FLOAT16: return ref_half(((const uint16_t *)p)[i]);
  case DDP_BFLOAT16: return from_bits((uint32_t)((const uint16_t *)p)[i] << 16);
  default: fail();
  }
  return 0;
}

/* v must be exactly representable in dt. */
static void put(ddp_dtype dt, void *p, size_t i, double v) {
  switch (dt) {
  case DDP_FLOAT32: ((float *)p)[i] = (float)v; break;
  case DDP_FLOAT64: ((double *)p)[i] = v; break;
  case DDP_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
  case DDP_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
  case DDP_FLOAT16: ((uint16_t *)p)[i] = ddp_float_to_half((float)v); break;
  case DDP_BFLOAT16: ((uint16_t *)p)[i] = ddp_float_to_bf16((float)v); break;
  default: fail();
  }
  assert_true(get(dt, p, i) == v);
}

static double closed_form(ddp_reduce_op op, double a, double b) {
  switch (op) {
  case DDP_REDUCE_SUM:
  case DDP_REDUCE_AVG: return a + b;
  case DDP_REDUCE_MIN: return a < b ? a : b;
  case DDP_REDUCE_MAX: return a > b ? a : b;
  case DDP_REDUCE_PRODUCT: return a * b;
  default: fail();
  }
  return 0;
}

/* Small integers (|x| <= 12): every sum and product is exact in every dtype. */
static double value_a(size_t i) { return (double)((int)(i * 7 % 17) - 8); }
static double value_b(size_t i) { return (double)((int)(i * 5 % 13) - 6); }

static void test_kernels_closed_form(void **state) {
  static const size_t lengths[] = {0, 1, 3, 15, 16, 17, 63, 1000, 4099};
  const size_t off = 1; /* unaligned starts: the kernels must not assume alignment */
  for (size_t d = 0; d < 6; d++) {
    ddp_dtype dt = dtypes[d];
    size_t es = ddp_dtype_size(dt);
    for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
      for (size_t l = 0; l < sizeof lengths / sizeof *lengths; l++) {
        size_t n = lengths[l];
        char *a = malloc((n + off + 1) * es), *b = malloc((n + off + 1) * es);
        char *dst = malloc((n + off + 1) * es);
        void *pa = a + off * es, *pb = b + off * es, *pd = dst + off * es;
        for (size_t i = 0; i < n; i++) {
          put(dt, pa, i, value_a(i));
          put(dt, pb, i, value_b(i));
        }
        /* sentinel after the end must survive */
        put(dt, pd, n, 99);
        ddp__reduce_pair(pd, pa, pb, n, dt, (ddp_reduce_op)op);
        for (size_t i = 0; i < n; i++) {
          double want = closed_form((ddp_reduce_op)op, value_a(i), value_b(i));
          if (get(dt, pd, i) != want)
            fail_msg("%s %s n=%zu [%zu]: %g, want %g", ddp_dtype_name(dt),
                     ddp_reduce_op_name((ddp_reduce_op)op), n, i, get(dt, pd, i), want);
        }
        assert_true(get(dt, pd, n) == 99);
        /* in place: dst aliasing a (reduce_into) and b (pair) */
        memcpy(dst, a, (n + off) * es);
        ddp__reduce_into(pd, pb, n, dt, (ddp_reduce_op)op);
        for (size_t i = 0; i < n; i++)
          assert_true(get(dt, pd, i) == closed_form((ddp_reduce_op)op, value_a(i), value_b(i)));
        ddp__reduce_pair(pb, pa, pb, n, dt, (ddp_reduce_op)op);
        for (size_t i = 0; i < n; i++)
          assert_true(get(dt, pb, i) == closed_form((ddp_reduce_op)op, value_a(i), value_b(i)));
        free(a);
        free(b);
        free(dst);
      }
    }
  }
}

static void test_kernels_nan_inf_and_wrap(void **state) {
  float a[4] = {NAN, 1.0f, INFINITY, -0.0f}, b[4] = {1.0f, NAN, -INFINITY, 0.0f}, d[4];
  ddp__reduce_pair(d, a, b, 4, DDP_FLOAT32, DDP_REDUCE_MIN);
  assert_true(isnan(d[0]) && isnan(d[1]));
  assert_true(d[2] == -INFINITY);
  ddp__reduce_pair(d, a, b, 4, DDP_FLOAT32, DDP_REDUCE_MAX);
  assert_true(isnan(d[0]) && isnan(d[1]));
  assert_true(d[2] == INFINITY);
  ddp__reduce_pair(d, a, b, 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  assert_true(isnan(d[0]) && isnan(d[1]) && isnan(d[2]));
  double da[2] = {NAN, 2}, db[2] = {3, NAN}, dd[2];
  ddp__reduce_pair(dd, da, db, 2, DDP_FLOAT64, DDP_REDUCE_MAX);
  assert_true(isnan(dd[0]) && isnan(dd[1]));
  uint16_t ha[2] = {0x7e00, 0x3c00}, hb[2] = {0x3c00, 0x7e00}, hd[2];
  ddp__reduce_pair(hd, ha, hb, 2, DDP_FLOAT16, DDP_REDUCE_MIN);
  assert_true((hd[0] & 0x7fff) > 0x7c00 && (hd[1] & 0x7fff) > 0x7c00);
  /* float16 sums round once, to nearest even: 2048 + 1 = 2048 (tie to even),
   * 2050 + 1 = 2052; 65504 + 32 overflows to Inf. */
  uint16_t x[3] = {ddp_float_to_half(2048), ddp_float_to_half(2050), 0x7bff};
  uint16_t y[3] = {ddp_float_to_half(1), ddp_float_to_half(1), ddp_float_to_half(32)};
  ddp__reduce_into(x, y, 3, DDP_FLOAT16, DDP_REDUCE_SUM);
  assert_true(ddp_half_to_float(x[0]) == 2048.0f);
  assert_true(ddp_half_to_float(x[1]) == 2052.0f);
  assert_int_equal(x[2], 0x7c00);
  /* integer sums and products wrap around as two's complement */
  int32_t ia[2] = {INT32_MAX, 65536}, ib[2] = {1, 65536};
  ddp__reduce_into(ia, ib, 1, DDP_INT32, DDP_REDUCE_SUM);
  assert_int_equal(ia[0], INT32_MIN);
  ddp__reduce_into(ia + 1, ib + 1, 1, DDP_INT32, DDP_REDUCE_PRODUCT);
  assert_int_equal(ia[1], 0);
  int64_t la[1] = {INT64_MIN}, lb[1] = {-1};
  ddp__reduce_into(la, lb, 1, DDP_INT64, DDP_REDUCE_SUM);
  assert_true(la[0] == INT64_MAX);
  int64_t ma[1] = {INT64_MIN}, mb[1] = {INT64_MAX};
  ddp__reduce_into(ma, mb, 1, DDP_INT64, DDP_REDUCE_MIN);
  assert_true(ma[0] == INT64_MIN);
}

/* Random bit patterns (NaN, Inf, subnormals included) through the kernels
 * (vector bodies and tails) against one element at a time through the
 * exhaustively tested conversions; a NaN result only has to be NaN. */
static void test_kernels_16bit_random_patterns(void **state) {
  enum { N = 1037 };
  uint16_t a[N + 1], b[N + 1], d[N + 1];
  uint64_t x = 0x2545f4914f6cdd1dull;
  for (int t = 0; t < 2; t++) {
    ddp_dtype dt = t ? DDP_BFLOAT16 : DDP_FLOAT16;
    float (*to_f)(uint16_t) = t ? ddp_bf16_to_float : ddp_half_to_float;
    uint16_t (*from_f)(float) = t ? ddp_float_to_bf16 : ddp_float_to_half;
    for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
      for (int i = 0; i <= N; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        a[i] = (uint16_t)x;
        b[i] = (uint16_t)(x >> 16);
        if (i % 5 == 0) b[i] = (uint16_t)(a[i] ^ 0x0100); /* near values: sums cancel, products round */
      }
      ddp__reduce_pair(d + 1, a + 1, b + 1, N, dt, (ddp_reduce_op)op);
      for (int i = 1; i <= N; i++) {
        float p = to_f(a[i]), q = to_f(b[i]), r;
        switch (op) {
        case DDP_REDUCE_SUM:
        case DDP_REDUCE_AVG: r = p + q; break;
        case DDP_REDUCE_PRODUCT: r = p * q; break;
        case DDP_REDUCE_MIN: r = (p < q || p != p) ? p : q; break;
        default: r = (p > q || p != p) ? p : q; break;
        }
        uint16_t want = from_f(r);
        bool want_nan = isnan(to_f(want)), got_nan = isnan(to_f(d[i]));
        if (want_nan != got_nan || (!want_nan && d[i] != want))
          fail_msg("%s %s: 0x%04x op 0x%04x = 0x%04x, want 0x%04x", ddp_dtype_name(dt),
                   ddp_reduce_op_name((ddp_reduce_op)op), a[i], b[i], d[i], want);
      }
    }
  }
}

static void test_scale(void **state) {
  /* A sum of 7 equal values averages back to exactly that value. */
  float f[5] = {7 * 0.1f, 7 * 3.0f, -7.0f, 0, 7 * 1e-3f};
  float want_f[5] = {7 * 0.1f / 7, 3.0f, -1.0f, 0, 7 * 1e-3f / 7};
  ddp__reduce_scale(f, 5, DDP_FLOAT32, 7);
  assert_memory_equal(f, want_f, sizeof f);
  double g[2] = {21, 1};
  ddp__reduce_scale(g, 2, DDP_FLOAT64, 3);
  assert_true(g[0] == 7 && g[1] == 1.0 / 3);
  uint16_t h[2] = {ddp_float_to_half(6), ddp_float_to_half(1)};
  ddp__reduce_scale(h, 2, DDP_FLOAT16, 3);
  assert_true(ddp_half_to_float(h[0]) == 2.0f);
  assert_int_equal(h[1], ddp_float_to_half(1.0f / 3)); /* rounded once more */
  uint16_t bf[1] = {ddp_float_to_bf16(1)};
  ddp__reduce_scale(bf, 1, DDP_BFLOAT16, 3);
  assert_int_equal(bf[0], ddp_float_to_bf16(1.0f / 3));
  ddp__reduce_scale(NULL, 0, DDP_FLOAT32, 2); /* empty is fine */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_half_to_float_all),
      cmocka_unit_test(test_half_round_trip_all),
      cmocka_unit_test(test_half_rounding_midpoints),
      cmocka_unit_test(test_half_vs_f16c),
      cmocka_unit_test(test_bf16_all),
      cmocka_unit_test(test_kernels_closed_form),
      cmocka_unit_test(test_kernels_nan_inf_and_wrap),
      cmocka_unit_test(test_kernels_16bit_random_patterns),
      cmocka_unit_test(test_scale),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
