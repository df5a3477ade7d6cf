/* MT19937 (Matsumoto and Nishimura, 1998), the one core behind PyTorch's
 * CPU generator (data/torch_random.c) and CPython's random.Random
 * (hpo/pyrandom.c): the state, the twist, the tempering and both published
 * seedings; the callers differ only in which seeding they use and how they
 * turn the words into numbers. Their fixtures check it bit for bit. */
#include "core/core_internal.h"

#define MT_N DDP__MT19937_N
#define MT_M 397
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

void ddp__mt19937_init_genrand(uint32_t state[DDP__MT19937_N], int *index, uint32_t seed) {
  state[0] = seed;
  for (uint32_t j = 1; j < MT_N; j++) state[j] = 1812433253u * (state[j - 1] ^ (state[j - 1] >> 30)) + j;
  *index = MT_N; /* the first read twists */
}

void ddp__mt19937_init_by_array(uint32_t state[DDP__MT19937_N], int *index, const uint32_t *key, size_t len) {
  ddp__mt19937_init_genrand(state, index, 19650218u);
  size_t i = 1, j = 0;
  for (size_t k = MT_N > len ? MT_N : len; k; k--) {
    state[i] = (state[i] ^ ((state[i - 1] ^ (state[i - 1] >> 30)) * 1664525u)) + key[j] + (uint32_t)j;
    i++;
    j++;
    if (i >= MT_N) {
      state[0] = state[MT_N - 1];
      i = 1;
    }
    if (j >= len) j = 0;
  }
  for (size_t k = MT_N - 1; k; k--) {
    state[i] = (state[i] ^ ((state[i - 1] ^ (state[i - 1] >> 30)) * 1566083941u)) - (uint32_t)i;
    i++;
    if (i >= MT_N) {
      state[0] = state[MT_N - 1];
      i = 1;
    }
  }
  state[0] = 0x80000000u; /* MSB is 1, assuring a non-zero initial array */
}

static uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & MT_UPPER) | (v & MT_LOWER)) >> 1) ^ ((v & 1u) ? MT_MATRIX_A : 0u);
}

/* Regenerates all 624 words in place. */
static void next_state(uint32_t *s) {
  int k = 0;
  for (; k < MT_N - MT_M; k++) s[k] = s[k + MT_M] ^ twist(s[k], s[k + 1]);
  for (; k < MT_N - 1; k++) s[k] = s[k + MT_M - MT_N] ^ twist(s[k], s[k + 1]);
  s[MT_N - 1] = s[MT_M - 1] ^ twist(s[MT_N - 1], s[0]);
}

uint32_t ddp__mt19937_next(uint32_t state[DDP__MT19937_N], int *index) {
  if (*index >= MT_N) {
    next_state(state);
    *index = 0;
  }
  uint32_t y = state[(*index)++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

void ddp__mt19937_discard(uint32_t state[DDP__MT19937_N], int *index, uint64_t count) {
  /* Whole blocks of 624 skip the tempering: only the twists matter. */
  while (count > 0) {
    if (*index >= MT_N) {
      next_state(state);
      *index = 0;
    }
    uint64_t here = (uint64_t)(MT_N - *index); /* readable before the next twist */
    if (count <= here) {
      *index += (int)count;
      return;
    }
    count -= here;
    *index = MT_N;
  }
}
