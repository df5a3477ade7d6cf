/* CPython's random.Random, bit for bit (CPython 3.11, Modules/_randommodule.c
 * and Lib/random.py): the Mersenne Twister MT19937 seeded from an integer as
 * CPython seeds it, and random(), getrandbits(), randbelow(), randint(),
 * uniform(), choice(), sample(), shuffle() and gauss() computed as CPython
 * computes them, so a search seeded like Propulate's reproduces its draws
 * (docs/hpo.md, "A Python-compatible generator"). */
#include <math.h>
#include <string.h>

#include "core/core_internal.h"
#include "hpo/hpo_internal.h"

void ddp_pyrandom_seed(ddp_pyrandom *r, int64_t seed) {
  uint64_t a = seed < 0 ? (uint64_t)0 - (uint64_t)seed : (uint64_t)seed;
  uint32_t key[2] = {(uint32_t)a, (uint32_t)(a >> 32)};
  /* CPython seeds every integer through init_by_array, with the integer's
   * absolute value cut into 32-bit words, least significant first ([0] for 0). */
  ddp__mt19937_init_by_array(r->mt, &r->index, key, key[1] ? 2 : 1);
  r->has_gauss_next = false;
}

uint32_t ddp_pyrandom_uint32(ddp_pyrandom *r) { return ddp__mt19937_next(r->mt, &r->index); }

/* random(): 53 random bits, as genrand_res53. */
double ddp_pyrandom_random(ddp_pyrandom *r) {
  uint32_t a = ddp_pyrandom_uint32(r) >> 5, b = ddp_pyrandom_uint32(r) >> 6;
  return ((double)a * 67108864.0 + (double)b) * (1.0 / 9007199254740992.0);
}

/* getrandbits(k), 0 <= k <= 64: one word's top k bits for k <= 32, else
 * words least significant first (the last one's top bits). */
uint64_t ddp_pyrandom_getrandbits(ddp_pyrandom *r, int k) {
  if (k <= 0) return 0;
  if (k <= 32) return ddp_pyrandom_uint32(r) >> (32 - k);
  uint64_t lo = ddp_pyrandom_uint32(r);
  uint64_t hi = ddp_pyrandom_uint32(r) >> (64 - k);
  return lo | (hi << 32);
}

/* _randbelow_with_getrandbits (3.11): k = n.bit_length(), draw k bits until
 * the value is below n. n >= 1. */
uint64_t ddp_pyrandom_below(ddp_pyrandom *r, uint64_t n) {
  int k = 64 - __builtin_clzll(n);
  uint64_t v = ddp_pyrandom_getrandbits(r, k);
  while (v >= n) v = ddp_pyrandom_getrandbits(r, k);
  return v;
}

/* randint(a, b) = randrange(a, b + 1) = a + randbelow(b - a + 1); a <= b. */
int64_t ddp_pyrandom_randint(ddp_pyrandom *r, int64_t a, int64_t b) {
  return a + (int64_t)ddp_pyrandom_below(r, (uint64_t)(b - a) + 1);
}

/* uniform(a, b) = a + (b - a) * random(). */
double ddp_pyrandom_uniform(ddp_pyrandom *r, double a, double b) {
  return a + (b - a) * ddp_pyrandom_random(r);
}

/* gauss(mu, sigma): Box-Muller on two random()s, the second value kept for
 * the next call, as CPython's gauss (not normalvariate). */
double ddp_pyrandom_gauss(ddp_pyrandom *r, double mu, double sigma) {
  double z;
  if (r->has_gauss_next) {
    z = r->gauss_next;
    r->has_gauss_next = false;
  } else {
    const double two_pi = 6.283185307179586; /* math.tau */
    double x2pi = ddp_pyrandom_random(r) * two_pi;
    double g2rad = sqrt(-2.0 * log(1.0 - ddp_pyrandom_random(r)));
    z = cos(x2pi) * g2rad;
    r->gauss_next = sin(x2pi) * g2rad;
    r->has_gauss_next = true;
  }
  return mu + z * sigma;
}

/* sample(range(n), k) into out[0..k): CPython 3.11's two methods, chosen
 * by its own rule (a pool for small n, a set of taken indices otherwise).
 * `taken` is scratch for n flags (the set method), or NULL when
 * ddp__pyrandom_sample_uses_pool(n, k). Returns indices into the
 * population. */
bool ddp__pyrandom_sample_uses_pool(int64_t n, int64_t k) {
  int64_t setsize = 21; /* size of a small set minus size of an empty list */
  if (k > 5) setsize += (int64_t)pow(4.0, ceil(log((double)(k * 3)) / log(4.0)));
  return n <= setsize;
}

void ddp__pyrandom_sample(ddp_pyrandom *r, int64_t n, int64_t k, int64_t *out, int64_t *pool,
                          bool *taken) {
  if (ddp__pyrandom_sample_uses_pool(n, k)) {
    for (int64_t i = 0; i < n; i++) pool[i] = i;
    for (int64_t i = 0; i < k; i++) {
      int64_t j = (int64_t)ddp_pyrandom_below(r, (uint64_t)(n - i));
      out[i] = pool[j];
      pool[j] = pool[n - i - 1]; /* move the non-selected item into the vacancy */
    }
    return;
  }
  memset(taken, 0, (size_t)n * sizeof *taken);
  for (int64_t i = 0; i < k; i++) {
    int64_t j = (int64_t)ddp_pyrandom_below(r, (uint64_t)n);
    while (taken[j]) j = (int64_t)ddp_pyrandom_below(r, (uint64_t)n);
    taken[j] = true;
    out[i] = j;
  }
}

/* shuffle(x) of n items: Fisher-Yates from the end, as CPython. */
void ddp__pyrandom_shuffle(ddp_pyrandom *r, int64_t *x, int64_t n) {
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)ddp_pyrandom_below(r, (uint64_t)i + 1);
    int64_t t = x[i];
    x[i] = x[j];
    x[j] = t;
  }
}
