/* optim: ddp_grad_scaler against PyTorch 2.x's torch.amp.GradScaler("cpu")
 * (tests/fixtures/grad_scaler.txt, scripts/make_grad_scaler_fixture.py):
 * every step's unscaled gradients bit for bit, found_inf, whether the step
 * was skipped, and the scale and growth tracker after update(), over four
 * sequences (a small growth interval, PyTorch's defaults for 2100 steps,
 * factors that are not powers of two, the scale at float32's top); the
 * disabled scaler; the checks of impossible states. Mutations that fail
 * it: the backoff multiplied in float32 (scale * (float)backoff_factor)
 * breaks odd_factors at step 3; comparing the tracker before counting the
 * step breaks every growth. (The reciprocal in float64 rounded to float32
 * equals 1.0f / scale for every float: 53 >= 2 x 24 + 2 bits, so double
 * rounding of a quotient is exact; no fixture can tell them apart.) */
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/optim.h"
#include "support/fixture.h"

enum { MAX_N = 16 };

static float from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

static uint32_t to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

static FILE *open_fixture(void) {
  char path[1024];
  FILE *f = fopen(fixture_path("grad_scaler.txt", path, sizeof path), "r");
  if (!f) fail_msg("cannot open %s (made by scripts/make_grad_scaler_fixture.py)", path);
  return f;
}

/* Reads `n` hex float32 words after the word `label`. */
static void read_words(FILE *f, const char *label, int n, uint32_t *out, int line) {
  char word[32];
  if (fscanf(f, "%31s", word) != 1 || strcmp(word, label) != 0)
    fail_msg("fixture line %d: expected '%s'", line, label);
  for (int i = 0; i < n; i++)
    if (fscanf(f, "%" SCNx32, &out[i]) != 1) fail_msg("fixture line %d: bad float bits", line);
}

static int scenarios_seen, steps_seen, skips_seen;

static void test_matches_torch(void **state) {
  (void)state;
  FILE *f = open_fixture();
  char word[64], name[64];
  int line = 0;
  ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
  int n = 0;
  while (fscanf(f, "%63s", word) == 1) {
    line++;
    if (word[0] == '#') {
      int c;
      while ((c = fgetc(f)) != '\n' && c != EOF) {}
      continue;
    }
    if (strcmp(word, "scenario") == 0) {
      double init, gf, bf;
      long long gi, steps;
      if (fscanf(f, "%63s %lf %lf %lf %lld %d %lld", name, &init, &gf, &bf, &gi, &n, &steps) != 7 ||
          n < 1 || n > MAX_N)
        fail_msg("fixture line %d: bad scenario", line);
      gs = ddp_grad_scaler_defaults(true);
      gs.scale = (float)init;
      gs.growth_factor = gf;
      gs.backoff_factor = bf;
      gs.growth_interval = gi;
      assert_int_equal(ddp_grad_scaler_check(&gs), DDP_OK);
      scenarios_seen++;
    } else if (strcmp(word, "step") == 0) {
      int k, found, skipped, tracker;
      uint32_t in[MAX_N], out[MAX_N], scale_bits;
      if (fscanf(f, "%d", &k) != 1) fail_msg("fixture line %d: bad step", line);
      read_words(f, "in", n, in, line);
      read_words(f, "out", n, out, line);
      if (fscanf(f, " found %d skipped %d scale %" SCNx32 " tracker %d", &found, &skipped,
                 &scale_bits, &tracker) != 4)
        fail_msg("fixture line %d: bad step tail", line);
      float g[MAX_N];
      for (int i = 0; i < n; i++) g[i] = from_bits(in[i]);
      const bool found_inf = ddp_grad_scaler_unscale(&gs, g, (size_t)n);
      for (int i = 0; i < n; i++)
        if (to_bits(g[i]) != out[i])
          fail_msg("%s step %d: unscaled gradient %d is %08" PRIx32 " (%.9g), torch %08" PRIx32
                   " (%.9g)", name, k, i, to_bits(g[i]), (double)g[i], out[i],
                   (double)from_bits(out[i]));
      if ((int)found_inf != found) fail_msg("%s step %d: found_inf %d, torch %d", name, k, found_inf, found);
      /* The trainer steps exactly when nothing was found. */
      if ((int)found_inf != skipped)
        fail_msg("%s step %d: skipped %d, torch %d", name, k, found_inf, skipped);
      ddp_grad_scaler_update(&gs, found_inf);
      if (to_bits(gs.scale) != scale_bits || gs.growth_tracker != tracker)
        fail_msg("%s step %d: scale %.9g tracker %d, torch %.9g tracker %d", name, k,
                 (double)gs.scale, (int)gs.growth_tracker, (double)from_bits(scale_bits), tracker);
      steps_seen++;
      skips_seen += skipped;
    } else if (strcmp(word, "end") == 0) {
      uint32_t scale_bits;
      int tracker;
      double gf, bf;
      long long gi;
      if (fscanf(f, "%63s scale %" SCNx32 " tracker %d growth_factor %lf backoff_factor %lf "
                    "growth_interval %lld", word, &scale_bits, &tracker, &gf, &bf, &gi) != 6)
        fail_msg("fixture line %d: bad end", line);
      /* The state_dict's five keys. */
      assert_int_equal(to_bits(gs.scale), scale_bits);
      assert_int_equal(gs.growth_tracker, tracker);
      assert_true(gs.growth_factor == gf && gs.backoff_factor == bf);
      assert_int_equal(gs.growth_interval, gi);
    } else {
      fail_msg("fixture line %d: unknown record '%s'", line, word);
    }
  }
  fclose(f);
  /* The whole file was replayed: 4 sequences of 40 + 2100 + 30 + 6 steps. */
  assert_int_equal(scenarios_seen, 4);
  assert_int_equal(steps_seen, 2176);
  assert_true(skips_seen >= 10);
}

/* Disabled (PyTorch's enabled=False): seed 1, nothing found or changed. */
static void test_disabled(void **state) {
  (void)state;
  ddp_grad_scaler gs = ddp_grad_scaler_defaults(false);
  assert_true(ddp_grad_scaler_loss_seed(&gs) == 1.0f);
  float g[3] = {1.5f, INFINITY, NAN};
  assert_false(ddp_grad_scaler_unscale(&gs, g, 3));
  assert_true(g[0] == 1.5f && isinf(g[1]) && isnan(g[2]));
  ddp_grad_scaler_update(&gs, true);
  assert_true(gs.scale == 65536.0f && gs.growth_tracker == 0);
  ddp_grad_scaler on = ddp_grad_scaler_defaults(true);
  assert_true(ddp_grad_scaler_loss_seed(&on) == 65536.0f);
  assert_true(ddp_grad_scaler_inv_scale(&on) == 1.0f / 65536.0f);
}

static void test_check_refuses_impossible_states(void **state) {
  (void)state;
  ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
  assert_int_equal(ddp_grad_scaler_check(&gs), DDP_OK);
  ddp_grad_scaler b = gs;
  b.scale = 0;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  b = gs;
  b.scale = INFINITY;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  b = gs;
  b.growth_factor = 1.0;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  b = gs;
  b.backoff_factor = 1.0;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  b = gs;
  b.growth_interval = 0;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  b = gs;
  b.growth_tracker = 2000;
  assert_int_equal(ddp_grad_scaler_check(&b), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "_growth_tracker"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_torch),
      cmocka_unit_test(test_disabled),
      cmocka_unit_test(test_check_refuses_impossible_states),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
