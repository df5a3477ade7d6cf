/* PyTorch's CPU random stream, for samplers that must give PyTorch's index
 * orders: the MT19937 engine of torch.Generator() (at::mt19937, seeded as
 * manual_seed does) and torch.randperm's shuffle on top of it (torch 1.13).
 * docs/data.md ("PyTorch's random orders") says how this was checked. */
#ifndef DDP_DATA_TORCH_RANDOM_H
#define DDP_DATA_TORCH_RANDOM_H

#include <stdint.h>

#include "core/core_internal.h"

/* A plain value (2.5 KB): samplers embed it, nothing to free. The engine is
 * core's MT19937; PyTorch's part is the seeding. */
typedef struct ddp__torch_generator {
  uint32_t state[DDP__MT19937_N];
  int index;
} ddp__torch_generator;

/* torch.Generator().manual_seed(seed): MT19937's init_genrand with the low
 * 32 bits of seed (PyTorch keeps the 64-bit value but the engine uses only
 * those bits). */
void ddp__torch_generator_seed(ddp__torch_generator *g, uint64_t seed);
/* The next 32-bit output (CPUGeneratorImpl::random()). */
static inline uint32_t ddp__torch_generator_next(ddp__torch_generator *g) {
  return ddp__mt19937_next(g->state, &g->index);
}
/* Advances by `count` outputs, as if ddp__torch_generator_next were called that often. */
static inline void ddp__torch_generator_discard(ddp__torch_generator *g, uint64_t count) {
  ddp__mt19937_discard(g->state, &g->index, count);
}

/* torch.randperm(n, generator=g) drawing from *mt: out[i] = i, then for
 * i in [0, n-1): swap out[i] with out[i + random() % (n - i)]. Uses exactly
 * max(n - 1, 0) outputs. torch 1.13 uses this one loop for every n (a
 * 64-bit variant for n >= 2^32 / 20 came later). out holds n values. */
void ddp__torch_randperm(ddp__torch_generator *g, int64_t n, int64_t *out);

#endif /* DDP_DATA_TORCH_RANDOM_H */
