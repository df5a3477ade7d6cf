/* The memory pool of distributed-autograd contexts' blocks
 * (rpc_autograd/memory_pool.h). */
#include "rpc_autograd/memory_pool.h"

#include <string.h>

void ddp__dist_pool_init(ddp__dist_pool *p) {
  memset(p, 0, sizeof *p);
  pthread_mutex_init(&p->mu, NULL);
  p->enabled = strcmp(ddp_env_str("DDP_DIST_POOL", "1"), "0") != 0;
}

void ddp__dist_pool_destroy(ddp__dist_pool *p) {
  for (int i = 0; i < p->n; i++) ddp_free(p->block[i]);
  p->n = 0;
  pthread_mutex_destroy(&p->mu);
}

void *ddp__dist_pool_get(ddp__dist_pool *p, size_t bytes) {
  if (!bytes) bytes = 1;
  void *b = NULL;
  pthread_mutex_lock(&p->mu);
  /* Newest first: the block most recently put back is the warmest. */
  for (int i = p->n - 1; i >= 0 && !b; i--)
    if (p->bytes[i] == bytes) {
      b = p->block[i];
      memmove(&p->block[i], &p->block[i + 1], (size_t)(p->n - 1 - i) * sizeof p->block[0]);
      memmove(&p->bytes[i], &p->bytes[i + 1], (size_t)(p->n - 1 - i) * sizeof p->bytes[0]);
      p->n--;
      p->pooled_bytes -= bytes;
    }
  if (!b) p->misses++;
  p->live_bytes += bytes;
  if (p->live_bytes > p->peak_bytes) p->peak_bytes = p->live_bytes;
  pthread_mutex_unlock(&p->mu);
  if (!b) {
    b = ddp_calloc(1, bytes);
    if (!b) { /* nothing handed out */
      pthread_mutex_lock(&p->mu);
      p->live_bytes -= bytes;
      pthread_mutex_unlock(&p->mu);
    }
    return b;
  }
  memset(b, 0, bytes);
  return b;
}

void ddp__dist_pool_put(ddp__dist_pool *p, void *block, size_t bytes) {
  if (!block) return;
  if (!bytes) bytes = 1;
  void *evict[DDP__DIST_POOL_MAX_BLOCKS];
  int n_evict = 0;
  pthread_mutex_lock(&p->mu);
  p->live_bytes -= bytes;
  if (p->enabled && bytes <= p->peak_bytes) {
    /* Room by the bound: the oldest go first. */
    int k = 0;
    while (k < p->n && (p->n - k >= DDP__DIST_POOL_MAX_BLOCKS ||
                        p->pooled_bytes + bytes > p->peak_bytes)) {
      evict[n_evict++] = p->block[k];
      p->pooled_bytes -= p->bytes[k];
      k++;
    }
    if (k) {
      memmove(&p->block[0], &p->block[k], (size_t)(p->n - k) * sizeof p->block[0]);
      memmove(&p->bytes[0], &p->bytes[k], (size_t)(p->n - k) * sizeof p->bytes[0]);
      p->n -= k;
    }
    p->block[p->n] = block;
    p->bytes[p->n++] = bytes;
    p->pooled_bytes += bytes;
    block = NULL;
  }
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < n_evict; i++) ddp_free(evict[i]);
  ddp_free(block);
}

uint64_t ddp__dist_pool_misses(ddp__dist_pool *p) {
  pthread_mutex_lock(&p->mu);
  uint64_t m = p->misses;
  pthread_mutex_unlock(&p->mu);
  return m;
}
