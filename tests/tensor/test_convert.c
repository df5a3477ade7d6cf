/* float32 <-> bfloat16 / float16 over buffers (ddp_convert_*): every CPU
 * kernel family's path gives the bits of the single-value functions over
 * all 65536 16-bit patterns and over edge and random floats, and the
 * single-value functions themselves round to nearest even, as an
 * independent float64 computation says. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/tensor.h"
#include "tensor/cpu/dense.h"

static const int families[] = {DDP__CPU_AVX512, DDP__CPU_AVX2, DDP__CPU_GENERIC};

static uint64_t lcg(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 32;
}

/* Edge floats and random bit patterns (every exponent, NaNs included). The
 * count is not a multiple of 16 so that the vector paths' tails run. */
enum { NF = 70001 };
static float *test_floats(void) {
  static const uint32_t edges[] = {
      0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu,
      0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0x3f808000u,
      0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x477fefffu, 0x477ff000u, 0x477fe000u, 0x47800000u,
      0x33000000u, 0x33000001u, 0x33800000u, 0x387fc000u, 0x387fe000u, 0x38800000u, 0x7f7f8000u};
  float *f = malloc(NF * sizeof *f);
  uint64_t s = 7;
  for (int i = 0; i < NF; i++) {
    uint32_t u = (uint32_t)lcg(&s);
    if (i < (int)(sizeof edges / sizeof *edges)) u = edges[i];
    /* half of them in float16's range, where its rounding matters */
    else if (i & 1) u = (u & 0x80000000u) | (0x33000000u + u % (0x47800000u - 0x33000000u));
    memcpy(&f[i], &u, 4);
  }
  return f;
}

static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static void test_paths_match_the_scalar_functions(void **state) {
  (void)state;
  float *f = test_floats();
  uint16_t *h = malloc(NF * sizeof *h), all[65536];
  float *w = malloc(NF * sizeof *w), wide[65536];
  for (int i = 0; i < 65536; i++) all[i] = (uint16_t)i;
  int ran = 0;
  for (size_t fam = 0; fam < sizeof families / sizeof *families; fam++) {
    if (!ddp__cpu_force_family(families[fam])) continue; /* this CPU lacks it */
    ran++;
    ddp_convert_f32_to_bf16(h, f, NF);
    for (int i = 0; i < NF; i++)
      if (h[i] != ddp_float_to_bf16(f[i]))
        fail_msg("family %d: bf16 of 0x%08x: 0x%04x, scalar 0x%04x", families[fam], bits(f[i]),
                 h[i], ddp_float_to_bf16(f[i]));
    ddp_convert_f32_to_f16(h, f, NF);
    for (int i = 0; i < NF; i++)
      if (h[i] != ddp_float_to_half(f[i]))
        fail_msg("family %d: f16 of 0x%08x: 0x%04x, scalar 0x%04x", families[fam], bits(f[i]),
                 h[i], ddp_float_to_half(f[i]));
    ddp_convert_bf16_to_f32(wide, all, 65536);
    for (int i = 0; i < 65536; i++)
      if (bits(wide[i]) != bits(ddp_bf16_to_float((uint16_t)i)))
        fail_msg("family %d: float of bf16 0x%04x", families[fam], i);
    ddp_convert_f16_to_f32(wide, all, 65536);
    for (int i = 0; i < 65536; i++)
      if (bits(wide[i]) != bits(ddp_half_to_float((uint16_t)i)))
        fail_msg("family %d: float of f16 0x%04x: 0x%08x, scalar 0x%08x", families[fam], i,
                 bits(wide[i]), bits(ddp_half_to_float((uint16_t)i)));
    ddp_convert_round_f32(w, f, NF, DDP_BFLOAT16);
    for (int i = 0; i < NF; i++)
      assert_int_equal(bits(w[i]), bits(ddp_bf16_to_float(ddp_float_to_bf16(f[i]))));
    memcpy(w, f, NF * sizeof *w);
    ddp_convert_round_f32(w, w, NF, DDP_FLOAT16); /* in place */
    for (int i = 0; i < NF; i++)
      assert_int_equal(bits(w[i]), bits(ddp_half_to_float(ddp_float_to_half(f[i]))));
  }
  ddp__cpu_force_family(-1);
  assert_true(ran >= 1);
  free(f);
  free(h);
  free(w);
}

/* The nearest representable value to x with ties to the even significand,
 * by float64 search over the 16-bit patterns' values (an independent
 * reference for the bit tricks): the candidates bracketing x are found by
 * bisection over the ordered positive patterns. `maxbits` is the largest
 * finite pattern; above its value plus half an ulp, infinity. */
static double nearest(double x, double (*value)(uint16_t), uint16_t maxbits, uint16_t *pattern) {
  const double a = fabs(x);
  uint16_t lo = 0, hi = maxbits;
  if (a >= value(maxbits)) {
    /* the overflow threshold: max + ulp/2 rounds to infinity (even) */
    const double half_ulp = (value(maxbits) - value((uint16_t)(maxbits - 1))) / 2;
    *pattern = a >= value(maxbits) + half_ulp ? (uint16_t)(maxbits + 1) : maxbits;
  } else {
    while (hi - lo > 1) {
      const uint16_t mid = (uint16_t)((lo + hi) / 2);
      if (value(mid) <= a) lo = mid;
      else hi = mid;
    }
    const double dl = a - value(lo), dh = value(hi) - a;
    *pattern = dl < dh ? lo : dh < dl ? hi : (lo & 1) ? hi : lo;
  }
  if (signbit(x)) *pattern |= 0x8000;
  return 0;
}
static double bf16_value(uint16_t p) { return ddp_bf16_to_float(p); }
static double f16_value(uint16_t p) { return ddp_half_to_float(p); }

static void test_rounding_is_nearest_even(void **state) {
  (void)state;
  float *f = test_floats();
  for (int i = 0; i < NF; i++) {
    if (isnan(f[i])) {
      assert_true(isnan(ddp_bf16_to_float(ddp_float_to_bf16(f[i]))));
      assert_true(isnan(ddp_half_to_float(ddp_float_to_half(f[i]))));
      continue;
    }
    uint16_t want;
    if (isinf(f[i])) {
      assert_true(ddp_bf16_to_float(ddp_float_to_bf16(f[i])) == f[i]);
      assert_true(ddp_half_to_float(ddp_float_to_half(f[i])) == f[i]);
      continue;
    }
    nearest(f[i], bf16_value, 0x7f7f, &want);
    if (ddp_float_to_bf16(f[i]) != want)
      fail_msg("bf16 of %a (0x%08x): 0x%04x, nearest-even 0x%04x", (double)f[i], bits(f[i]),
               ddp_float_to_bf16(f[i]), want);
    nearest(f[i], f16_value, 0x7bff, &want);
    if (ddp_float_to_half(f[i]) != want)
      fail_msg("f16 of %a (0x%08x): 0x%04x, nearest-even 0x%04x", (double)f[i], bits(f[i]),
               ddp_float_to_half(f[i]), want);
  }
  /* Overflow: 65520 (max + half an ulp) is infinity in float16, 65519 is not. */
  assert_int_equal(ddp_float_to_half(65520.0f), 0x7c00);
  assert_int_equal(ddp_float_to_half(65519.0f), 0x7bff);
  assert_int_equal(ddp_float_to_half(-1e6f), 0xfc00);
  free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_paths_match_the_scalar_functions),
      cmocka_unit_test(test_rounding_is_nearest_even),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
