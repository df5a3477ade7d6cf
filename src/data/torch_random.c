/* PyTorch's CPU random stream: MT19937 (Matsumoto and Nishimura's
 * generator, in the form at::mt19937 uses: tempering on read, a twist every
 * 624 outputs) and torch.randperm's shuffle. Written from the published
 * algorithm; the index fixture (tests/data/test_sampler_torch.c) checks both
 * against PyTorch itself. */
#include "data/torch_random.h"

#define MT_M 397
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

void ddp__mt19937_seed(ddp__mt19937 *mt, uint64_t seed) {
  mt->state[0] = (uint32_t)(seed & 0xffffffffu);
  for (uint32_t j = 1; j < DDP__MT_N; j++)
    mt->state[j] = 1812433253u * (mt->state[j - 1] ^ (mt->state[j - 1] >> 30)) + j;
  /* The first read twists: left counts down to zero before it. */
  mt->left = 1;
  mt->next = 0;
}

static uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & MT_UPPER) | (v & MT_LOWER)) >> 1) ^ ((v & 1u) ? MT_MATRIX_A : 0u);
}

/* Regenerates all 624 words in place. */
static void next_state(ddp__mt19937 *mt) {
  uint32_t *s = mt->state;
  int k = 0;
  for (; k < DDP__MT_N - MT_M; k++) s[k] = s[k + MT_M] ^ twist(s[k], s[k + 1]);
  for (; k < DDP__MT_N - 1; k++) s[k] = s[k + MT_M - DDP__MT_N] ^ twist(s[k], s[k + 1]);
  s[DDP__MT_N - 1] = s[MT_M - 1] ^ twist(s[DDP__MT_N - 1], s[0]);
  mt->left = DDP__MT_N;
  mt->next = 0;
}

uint32_t ddp__mt19937_next(ddp__mt19937 *mt) {
  if (--mt->left == 0) next_state(mt);
  uint32_t y = mt->state[mt->next++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

void ddp__mt19937_discard(ddp__mt19937 *mt, uint64_t count) {
  /* Whole blocks of 624 skip the tempering: only the twists matter. */
  while (count > 0) {
    uint64_t here = (uint64_t)(mt->left - 1); /* readable before the next twist */
    if (count <= here) {
      mt->left -= (int32_t)count;
      mt->next += (int32_t)count;
      return;
    }
    count -= here + 1;
    mt->left = 1;
    mt->next = DDP__MT_N;
    (void)ddp__mt19937_next(mt); /* twists and consumes the first word */
  }
}

void ddp__torch_randperm(ddp__mt19937 *mt, int64_t n, int64_t *out) {
  for (int64_t i = 0; i < n; i++) out[i] = i;
  for (int64_t i = 0; i < n - 1; i++) {
    /* int64 arithmetic as torch's: random() is a uint32, n - i > 0. */
    int64_t z = (int64_t)ddp__mt19937_next(mt) % (n - i);
    int64_t t = out[i];
    out[i] = out[z + i];
    out[z + i] = t;
  }
}
