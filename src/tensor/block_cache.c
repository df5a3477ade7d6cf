/* The caching allocator's bookkeeping (block_cache.h): every block the
 * backend gave is a record in a hash table keyed by its address (O(1)
 * lookup on free); free blocks are also on a stack per size, the sizes
 * kept in a sorted array of bins so a request finds its best fit by
 * binary search. Bookkeeping memory is allocated only when a block is new:
 * a steady cycle of requests allocates nothing, host or device. */
#include <inttypes.h>
#include <pthread.h>
#include <string.h>

#include "tensor/block_cache.h"

typedef struct block {
  void *ptr;
  size_t size;        /* the class: what the backend was asked for */
  bool in_use;
  struct block *next; /* next free block of the same size (free ones only) */
} block;

/* Free blocks of one size, most recently freed first (likely warm in the
 * device's L2 cache). Bins with no block left are removed. */
typedef struct bin {
  size_t size;
  block *head;
} bin;

struct ddp__block_cache {
  pthread_mutex_t lock;
  ddp__block_backend backend;
  block **table;      /* open addressing, linear probing; NULL = empty slot */
  size_t table_cap;   /* a power of two, at least twice the blocks */
  size_t n_blocks;
  bin *bins;          /* sorted by size, each with at least one free block */
  size_t n_bins, bins_cap;
  ddp__block_stats stats;
};

size_t ddp__block_round(size_t bytes) {
  if (bytes == 0) bytes = 1;
  size_t unit = bytes <= DDP__BLOCK_SMALL_LIMIT ? DDP__BLOCK_SMALL_ROUND : DDP__BLOCK_LARGE_ROUND;
  if (bytes > SIZE_MAX - (unit - 1)) return 0;
  return (bytes + unit - 1) / unit * unit;
}

/* ---- The address table ---------------------------------------------------- */

static size_t slot_of(const ddp__block_cache *c, const void *ptr) {
  /* Fibonacci hashing; the low bits are zero for any backend's alignment. */
  uint64_t h = ((uint64_t)(uintptr_t)ptr >> 4) * UINT64_C(0x9E3779B97F4A7C15);
  return (size_t)(h >> 32) & (c->table_cap - 1);
}

static block *table_find(const ddp__block_cache *c, const void *ptr) {
  if (!c->table_cap) return NULL;
  for (size_t i = slot_of(c, ptr);; i = (i + 1) & (c->table_cap - 1)) {
    block *b = c->table[i];
    if (!b) return NULL;
    if (b->ptr == ptr) return b;
  }
}

static void table_put(ddp__block_cache *c, block *b) {
  size_t i = slot_of(c, b->ptr);
  while (c->table[i]) i = (i + 1) & (c->table_cap - 1);
  c->table[i] = b;
}

/* Room for one more block (load at most 1/2). */
static ddp_status table_reserve(ddp__block_cache *c) {
  if ((c->n_blocks + 1) * 2 <= c->table_cap) return DDP_OK;
  size_t cap = c->table_cap ? c->table_cap * 2 : 64;
  block **fresh = ddp_calloc(cap, sizeof *fresh);
  if (!fresh)
    return ddp_error(DDP_ERR_NOMEM, "%s: block cache: cannot grow its table to %zu slots",
                     c->backend.name, cap);
  block **old = c->table;
  size_t old_cap = c->table_cap;
  c->table = fresh;
  c->table_cap = cap;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i]) table_put(c, old[i]);
  ddp_free(old);
  return DDP_OK;
}

/* Removes b's slot, shifting later entries of its probe run back so no
 * lookup stops early (no tombstones). */
static void table_remove(ddp__block_cache *c, const block *b) {
  size_t mask = c->table_cap - 1, i = slot_of(c, b->ptr);
  while (c->table[i] != b) i = (i + 1) & mask;
  c->table[i] = NULL;
  for (size_t j = (i + 1) & mask; c->table[j]; j = (j + 1) & mask) {
    size_t home = slot_of(c, c->table[j]->ptr);
    /* Entry j may move into the hole at i unless its home lies in (i, j]. */
    bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    c->table[i] = c->table[j];
    c->table[j] = NULL;
    i = j;
  }
}

/* ---- Free bins ------------------------------------------------------------ */

/* The first bin whose size is >= size (n_bins when none). */
static size_t bin_lower_bound(const ddp__block_cache *c, size_t size) {
  size_t lo = 0, hi = c->n_bins;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (c->bins[mid].size < size) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Pushes a free block onto its size's bin, making the bin if needed.
 * Fails only when the bin array cannot grow (the block then stays out of
 * the cache; the caller gives it back to the backend). */
static ddp_status bin_push(ddp__block_cache *c, block *b) {
  size_t i = bin_lower_bound(c, b->size);
  if (i == c->n_bins || c->bins[i].size != b->size) {
    if (c->n_bins == c->bins_cap) {
      size_t cap = c->bins_cap ? c->bins_cap * 2 : 32;
      bin *fresh = ddp_alloc(cap * sizeof *fresh);
      if (!fresh)
        return ddp_error(DDP_ERR_NOMEM, "%s: block cache: cannot grow its bins to %zu",
                         c->backend.name, cap);
      if (c->n_bins) memcpy(fresh, c->bins, c->n_bins * sizeof *fresh);
      ddp_free(c->bins);
      c->bins = fresh;
      c->bins_cap = cap;
    }
    memmove(&c->bins[i + 1], &c->bins[i], (c->n_bins - i) * sizeof c->bins[0]);
    c->bins[i] = (bin){b->size, NULL};
    c->n_bins++;
  }
  b->next = c->bins[i].head;
  c->bins[i].head = b;
  return DDP_OK;
}

static block *bin_pop(ddp__block_cache *c, size_t i) {
  block *b = c->bins[i].head;
  c->bins[i].head = b->next;
  b->next = NULL;
  if (!c->bins[i].head) {
    memmove(&c->bins[i], &c->bins[i + 1], (c->n_bins - i - 1) * sizeof c->bins[0]);
    c->n_bins--;
  }
  return b;
}

/* ---- Blocks --------------------------------------------------------------- */

/* Gives a block back to the backend and forgets it. */
static void block_release(ddp__block_cache *c, block *b) {
  table_remove(c, b);
  c->n_blocks--;
  c->backend.free(c->backend.ctx, b->ptr);
  c->stats.driver_frees++;
  c->stats.bytes_reserved -= b->size;
  ddp_free(b);
}

/* Empties every bin; returns the bytes given back. */
static size_t flush_locked(ddp__block_cache *c) {
  size_t released = 0;
  for (size_t i = 0; i < c->n_bins; i++) {
    for (block *b = c->bins[i].head, *next; b; b = next) {
      next = b->next;
      released += b->size;
      block_release(c, b);
      c->stats.blocks_cached--;
    }
  }
  c->n_bins = 0;
  c->stats.flushes++;
  return released;
}

/* A new block of `size` from the backend, recorded in the table. */
static block *block_new(ddp__block_cache *c, size_t size) {
  block *b = ddp_alloc(sizeof *b);
  if (!b || table_reserve(c) != DDP_OK) {
    ddp_free(b);
    ddp_error(DDP_ERR_NOMEM, "%s: block cache: no host memory for its bookkeeping",
              c->backend.name);
    return NULL;
  }
  void *p = c->backend.alloc(c->backend.ctx, size);
  if (!p) {
    c->stats.driver_failures++;
    ddp_free(b);
    return NULL;
  }
  c->stats.driver_allocs++;
  c->stats.bytes_reserved += size;
  *b = (block){p, size, false, NULL};
  table_put(c, b);
  c->n_blocks++;
  return b;
}

ddp_status ddp__block_cache_create(const ddp__block_backend *backend, ddp__block_cache **out) {
  *out = NULL;
  ddp__block_cache *c = ddp_calloc(1, sizeof *c);
  if (!c)
    return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate a block cache", backend->name);
  if (pthread_mutex_init(&c->lock, NULL) != 0) {
    ddp_free(c);
    return ddp_error(DDP_ERR_SYS, "%s: block cache: pthread_mutex_init failed", backend->name);
  }
  c->backend = *backend;
  *out = c;
  return DDP_OK;
}

void ddp__block_cache_destroy(ddp__block_cache *c) {
  if (!c) return;
  for (size_t i = 0; i < c->table_cap; i++) {
    block *b = c->table[i];
    if (!b) continue;
    c->backend.free(c->backend.ctx, b->ptr);
    ddp_free(b);
  }
  ddp_free(c->table);
  ddp_free(c->bins);
  pthread_mutex_destroy(&c->lock);
  ddp_free(c);
}

void *ddp__block_cache_alloc(ddp__block_cache *c, size_t bytes) {
  size_t size = ddp__block_round(bytes);
  if (!size) {
    ddp_error(DDP_ERR_RANGE, "%s: cannot allocate %zu bytes (too large)", c->backend.name,
              bytes);
    return NULL;
  }
  pthread_mutex_lock(&c->lock);
  block *b = NULL;
  size_t i = bin_lower_bound(c, size);
  if (i < c->n_bins && c->bins[i].size - size <= size / DDP__BLOCK_WASTE_DIV) {
    b = bin_pop(c, i);
    c->stats.blocks_cached--;
    c->stats.hits++;
  } else {
    b = block_new(c, size);
    /* The device may be full of cached blocks of other sizes: give them
     * back and ask once more (pointless when there were none). */
    if (!b && c->stats.blocks_cached && flush_locked(c)) b = block_new(c, size);
    if (!b) {
      ddp_error_wrap(DDP_ERR_NOMEM,
                     "%s: cannot allocate %zu bytes (%" PRIu64 " in use, %" PRIu64
                     " reserved, none cached)",
                     c->backend.name, bytes, c->stats.bytes_in_use, c->stats.bytes_reserved);
      pthread_mutex_unlock(&c->lock);
      return NULL;
    }
  }
  b->in_use = true;
  c->stats.requests++;
  c->stats.blocks_in_use++;
  c->stats.bytes_in_use += b->size;
  void *p = b->ptr;
  pthread_mutex_unlock(&c->lock);
  return p;
}

ddp_status ddp__block_cache_free(ddp__block_cache *c, void *ptr) {
  if (!ptr) return DDP_OK;
  pthread_mutex_lock(&c->lock);
  block *b = table_find(c, ptr);
  ddp_status st = DDP_OK;
  if (!b) {
    st = ddp_error(DDP_ERR_NOTFOUND, "%s: free of %p, which this cache did not hand out",
                   c->backend.name, ptr);
  } else if (!b->in_use) {
    st = ddp_error(DDP_ERR_STATE, "%s: double free of %p (a block of %zu bytes)",
                   c->backend.name, ptr, b->size);
  } else {
    b->in_use = false;
    c->stats.blocks_in_use--;
    c->stats.bytes_in_use -= b->size;
    if (bin_push(c, b) == DDP_OK) {
      c->stats.blocks_cached++;
    } else {
      /* No host memory to remember it by: give it back instead. */
      block_release(c, b);
    }
  }
  pthread_mutex_unlock(&c->lock);
  return st;
}

bool ddp__block_cache_contains(ddp__block_cache *c, const void *ptr) {
  return ddp__block_cache_size(c, ptr) != 0;
}

size_t ddp__block_cache_size(ddp__block_cache *c, const void *ptr) {
  pthread_mutex_lock(&c->lock);
  const block *b = table_find(c, ptr);
  size_t size = b ? b->size : 0;
  pthread_mutex_unlock(&c->lock);
  return size;
}

void ddp__block_cache_empty(ddp__block_cache *c) {
  pthread_mutex_lock(&c->lock);
  flush_locked(c);
  pthread_mutex_unlock(&c->lock);
}

void ddp__block_cache_stats(ddp__block_cache *c, ddp__block_stats *out) {
  pthread_mutex_lock(&c->lock);
  *out = c->stats;
  pthread_mutex_unlock(&c->lock);
}
