/* The caching allocator's bookkeeping: blocks obtained from a backend (a
 * GPU's cudaMalloc/cudaFree in src/tensor/cuda/runtime.c, malloc in the
 * tests) are kept when freed and handed out again for a request of the same
 * size class, so a training step that repeats the same requests calls the
 * backend only in its first step. Device-neutral, compiled in every build
 * and tested on the CPU (tests/tensor/test_block_cache.c).
 *
 * Size classes: a request is rounded up to a multiple of 512 bytes when it
 * is at most 1 MiB (cudaMalloc aligns to 256 or 512 bytes anyway, and small
 * tensors of nearby sizes, biases and norms, then share a class), and to a
 * multiple of 2 MiB above (the driver maps device memory in 2 MiB pages, so
 * a 1.1 MiB cudaMalloc occupies 2 MiB already: the rounding costs no memory
 * and lets more large requests share a class; PyTorch rounds the same way).
 * A request takes the smallest cached block of at least its class and at
 * most DDP__BLOCK_WASTE_DIV-th more (best fit with bounded waste); blocks
 * are never split or merged.
 *
 * Reuse and streams: a block is handed out again as soon as it is freed,
 * even while work queued earlier still uses it. That is safe when all work
 * on the blocks of one cache runs on one stream in order (the CUDA runtime
 * keeps one compute stream per device): whoever receives the block again
 * queues its work behind the earlier users. Work on another stream or the
 * host must be ordered by its issuer before the block is freed.
 *
 * Thread-safe: one mutex per cache, held across the backend's calls (the
 * backend must not call back into the cache). */
#ifndef DDP__TENSOR_BLOCK_CACHE_H
#define DDP__TENSOR_BLOCK_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where raw blocks come from. `alloc` returns `bytes` of memory (aligned as
 * the blocks' users need) or NULL after recording why with ddp_error;
 * `free` gives a block back. `ctx` is passed to both. `name` ("cuda:0")
 * starts the cache's error messages; kept by pointer. */
typedef struct ddp__block_backend {
  const char *name;
  void *(*alloc)(void *ctx, size_t bytes);
  void (*free)(void *ctx, void *ptr);
  void *ctx;
} ddp__block_backend;

/* A cached block may serve a request whose class is up to 1/DIV smaller. */
#define DDP__BLOCK_WASTE_DIV 8
#define DDP__BLOCK_SMALL_LIMIT ((size_t)1 << 20) /* 512-byte classes up to here */
#define DDP__BLOCK_SMALL_ROUND ((size_t)512)
#define DDP__BLOCK_LARGE_ROUND ((size_t)2 << 20)

typedef struct ddp__block_cache ddp__block_cache;

/* Counters and sizes of one cache. Byte counts are of blocks (rounded). */
typedef struct ddp__block_stats {
  uint64_t driver_allocs;  /* successful backend allocs */
  uint64_t driver_frees;   /* backend frees (emptying the cache, destroy) */
  uint64_t driver_failures; /* backend allocs that returned NULL */
  uint64_t flushes;        /* times the cache was emptied (on failure or asked) */
  uint64_t requests;       /* successful ddp__block_cache_alloc calls */
  uint64_t hits;           /* of which served from the cache */
  uint64_t bytes_reserved; /* held from the backend: in use + cached */
  uint64_t bytes_in_use;   /* handed out and not freed */
  uint64_t blocks_in_use;
  uint64_t blocks_cached;
} ddp__block_stats;

/* The size class of a request: rounded as above (0 counts as 1). 0 when
 * the rounding would overflow. */
size_t ddp__block_round(size_t bytes);

/* A cache over `backend` (copied). *out is NULL on failure (DDP_ERR_NOMEM).
 * Free with ddp__block_cache_destroy. */
ddp_status ddp__block_cache_create(const ddp__block_backend *backend, ddp__block_cache **out);
/* Gives every block back to the backend, cached or in use (the caller
 * promises none is used any more), and frees the cache. NULL ok. */
void ddp__block_cache_destroy(ddp__block_cache *cache);

/* A block of at least `bytes` (a distinct non-NULL pointer even for 0),
 * from the cache when it holds one of a fitting size, else from the
 * backend. When the backend fails, the cache is emptied (its blocks given
 * back) and, if that gave anything back, the backend is asked once more.
 * NULL with DDP_ERR_NOMEM (naming the backend, the request, the bytes in
 * use and reserved, then the backend's reason) when that fails too. */
void *ddp__block_cache_alloc(ddp__block_cache *cache, size_t bytes);
/* Returns a block to the cache (NULL ok). A pointer the cache did not hand
 * out (DDP_ERR_NOTFOUND) or a block already free (DDP_ERR_STATE) is an
 * error naming it; the cache is unchanged then. */
ddp_status ddp__block_cache_free(ddp__block_cache *cache, void *ptr);
/* Whether `ptr` is the start of a block of this cache (in use or cached). */
bool ddp__block_cache_contains(ddp__block_cache *cache, const void *ptr);
/* The size of the block at `ptr` (its class), or 0 when it is not one. */
size_t ddp__block_cache_size(ddp__block_cache *cache, const void *ptr);
/* Gives every cached (free) block back to the backend. Blocks in use stay. */
void ddp__block_cache_empty(ddp__block_cache *cache);
void ddp__block_cache_stats(ddp__block_cache *cache, ddp__block_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* DDP__TENSOR_BLOCK_CACHE_H */
