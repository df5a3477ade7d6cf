/* xoshiro256** (Blackman and Vigna), seeded through splitmix64. */
#include <math.h>

#include "ddp/core.h"

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void ddp_rng_seed(ddp_rng *rng, uint64_t seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t ddp_rng_next(ddp_rng *rng) {
  uint64_t *s = rng->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

float ddp_rng_uniform(ddp_rng *rng) {
  return (float)(ddp_rng_next(rng) >> 40) * (1.0f / 16777216.0f);
}

float ddp_rng_uniform_range(ddp_rng *rng, float lo, float hi) {
  return lo + (hi - lo) * ddp_rng_uniform(rng);
}

float ddp_rng_normal(ddp_rng *rng) {
  /* 53-bit uniforms; u1 in (0, 1] so log is finite. */
  double u1 = ((double)(ddp_rng_next(rng) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  double u2 = (double)(ddp_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

uint64_t ddp_rng_below(ddp_rng *rng, uint64_t n) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = ddp_rng_next(rng);
  while (x >= limit);
  return x % n;
}
