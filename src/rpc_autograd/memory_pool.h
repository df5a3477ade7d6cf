/* A worker's memory pool of what distributed-autograd contexts allocate
 * (records, receives' and parameters' gradient buffers, reply buffers),
 * recycled when a context ends so that a steady-state step allocates none of them
 * (docs/rpc.md "What a step allocates"). Blocks are matched by exact size:
 * a training step repeats the same shapes. Thread-safe: contexts of several
 * trainers begin and end at once on the RPC pool's threads. */
#ifndef DDP_RPC_AUTOGRAD_MEMORY_POOL_H
#define DDP_RPC_AUTOGRAD_MEMORY_POOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/rpc.h"

#define DDP__DIST_POOL_MAX_BLOCKS 512

typedef struct ddp__dist_pool {
  pthread_mutex_t mu;
  bool enabled; /* false: every get allocates, every put frees (DDP_DIST_POOL=0) */
  int n;
  void *block[DDP__DIST_POOL_MAX_BLOCKS];
  size_t bytes[DDP__DIST_POOL_MAX_BLOCKS];
  size_t pooled_bytes; /* held in block[] */
  size_t live_bytes;   /* handed out, not yet put back */
  size_t peak_bytes;   /* most ever handed out at once: the bound on pooled_bytes */
  uint64_t misses;     /* gets that had to allocate */
} ddp__dist_pool;

/* Starts an empty pool; DDP_DIST_POOL=0 in the environment disables it. */
void ddp__dist_pool_init(ddp__dist_pool *p);
/* Frees every pooled block (those still handed out are the caller's). */
void ddp__dist_pool_destroy(ddp__dist_pool *p);
/* A zeroed block of `bytes` (64-byte aligned): a pooled one of exactly that
 * size if there is one, else a new one (counted as a miss). NULL when out of
 * memory. */
void *ddp__dist_pool_get(ddp__dist_pool *p, size_t bytes);
/* Hands back a block of `bytes` got from this pool (NULL is ignored). Kept
 * while the pool holds no more than the peak bytes ever handed out at once
 * and fewer than DDP__DIST_POOL_MAX_BLOCKS blocks; the oldest are freed to
 * make room, so a change of shapes does not keep the old sizes forever. */
void ddp__dist_pool_put(ddp__dist_pool *p, void *block, size_t bytes);
/* Gets that allocated so far (for tests: zero more once steps are warm). */
uint64_t ddp__dist_pool_misses(ddp__dist_pool *p);

/* The misses of `agent`'s distributed-autograd pool (dist_autograd.c). */
uint64_t ddp__dist_pool_misses_of(ddp_rpc_agent *agent);

#endif /* DDP_RPC_AUTOGRAD_MEMORY_POOL_H */
