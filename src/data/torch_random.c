/* PyTorch's CPU random stream: core's MT19937 seeded as at::mt19937 is
 * (init_genrand with the seed's low 32 bits) and torch.randperm's shuffle.
 * The index fixture (tests/data/test_sampler_torch.c) checks both
 * against PyTorch itself. */
#include "data/torch_random.h"

void ddp__torch_generator_seed(ddp__torch_generator *g, uint64_t seed) {
  ddp__mt19937_init_genrand(g->state, &g->index, (uint32_t)(seed & 0xffffffffu));
}

void ddp__torch_randperm(ddp__torch_generator *g, int64_t n, int64_t *out) {
  for (int64_t i = 0; i < n; i++) out[i] = i;
  for (int64_t i = 0; i < n - 1; i++) {
    /* int64 arithmetic as torch's: random() is a uint32, n - i > 0. */
    int64_t z = (int64_t)ddp__torch_generator_next(g) % (n - i);
    int64_t t = out[i];
    out[i] = out[z + i];
    out[z + i] = t;
  }
}
