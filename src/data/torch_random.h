/* PyTorch's CPU random stream, for samplers that must give PyTorch's index
 * orders: the MT19937 engine of torch.Generator() (at::mt19937, seeded as
 * manual_seed does) and torch.randperm's shuffle on top of it (torch 1.13).
 * docs/data.md ("PyTorch's random orders") says how this was checked. */
#ifndef DDP_DATA_TORCH_RANDOM_H
#define DDP_DATA_TORCH_RANDOM_H

#include <stdint.h>

#define DDP__MT_N 624

/* A plain value (2.5 KB): samplers embed it, nothing to free. */
typedef struct ddp__mt19937 {
  uint32_t state[DDP__MT_N];
  int32_t left;  /* outputs left before the next twist, + 1 */
  int32_t next;  /* index of the next state word to temper */
} ddp__mt19937;

/* torch.Generator().manual_seed(seed): MT19937's init_genrand with the low
 * 32 bits of seed (PyTorch keeps the 64-bit value but the engine uses only
 * those bits). */
void ddp__mt19937_seed(ddp__mt19937 *mt, uint64_t seed);
/* The next 32-bit output (CPUGeneratorImpl::random()). */
uint32_t ddp__mt19937_next(ddp__mt19937 *mt);
/* Advances by `count` outputs, as if ddp__mt19937_next were called that often. */
void ddp__mt19937_discard(ddp__mt19937 *mt, uint64_t count);

/* torch.randperm(n, generator=g) drawing from *mt: out[i] = i, then for
 * i in [0, n-1): swap out[i] with out[i + random() % (n - i)]. Uses exactly
 * max(n - 1, 0) outputs. torch 1.13 uses this one loop for every n (a
 * 64-bit variant for n >= 2^32 / 20 came later). out holds n values. */
void ddp__torch_randperm(ddp__mt19937 *mt, int64_t n, int64_t *out);

#endif /* DDP_DATA_TORCH_RANDOM_H */
