/* Bump arenas for per-step temporaries. After the first cycle the arena holds
 * one chunk as large as the cycle's high-water mark, so identical cycles (the
 * steady-state training step) never allocate. Blocks released during a
 * cycle are handed out again first (a few holes, first fit), so the
 * high-water mark, and with it a step's working set, counts only what is
 * alive at once where the tape says a tensor died early. */
#include <string.h>

#include "ddp/core.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#define ASAN_UNPOISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#endif

struct ddp_arena_chunk {
  ddp_arena_chunk *next; /* older chunk */
  size_t capacity;       /* usable bytes at base */
  size_t used;
  char *base;            /* after the header (host heap), or the backing's memory */
};

#define CHUNK_HEADER 64 /* keeps the payload 64-byte aligned */

/* A host chunk is one allocation, header and payload; a backed one keeps
 * its header on the host and its payload where the backing says. */
static ddp_arena_chunk *chunk_new(const ddp_arena *arena, size_t capacity) {
  const ddp_arena_backing *b = arena->backing;
  ddp_arena_chunk *c = ddp_alloc(b ? sizeof *c : CHUNK_HEADER + capacity);
  if (!c) return NULL;
  c->next = NULL;
  c->capacity = capacity;
  c->used = 0;
  c->base = b ? b->alloc(capacity) : (char *)c + CHUNK_HEADER;
  if (!c->base) {
    ddp_free(c);
    return NULL;
  }
  return c;
}

static void chunk_free(const ddp_arena *arena, ddp_arena_chunk *c) {
  if (arena->backing) arena->backing->free(c->base);
  ddp_free(c);
}

void ddp_arena_init(ddp_arena *arena, size_t initial_bytes) {
  memset(arena, 0, sizeof *arena);
  arena->min_chunk = initial_bytes < 4096 ? 4096 : initial_bytes;
}

void ddp_arena_init_backed(ddp_arena *arena, size_t initial_bytes,
                           const ddp_arena_backing *backing) {
  ddp_arena_init(arena, initial_bytes);
  arena->backing = backing;
}

/* Rounded up to the alignment, at least one unit. */
static size_t aligned_size(size_t bytes) {
  size_t need = (bytes + 63) & ~(size_t)63;
  return need ? need : 64;
}

/* The front of the first released block that holds `need` bytes, or NULL. */
static void *from_hole(ddp_arena *arena, size_t need) {
  for (int i = 0; i < arena->n_holes; i++) {
    if (arena->holes[i].bytes < need) continue;
    char *p = arena->holes[i].at;
    arena->holes[i].at += need;
    arena->holes[i].bytes -= need;
    if (arena->holes[i].bytes == 0) { /* used up: the later holes move down, in order */
      arena->n_holes--;
      memmove(&arena->holes[i], &arena->holes[i + 1],
              (size_t)(arena->n_holes - i) * sizeof arena->holes[0]);
    }
    if (!arena->backing) ASAN_UNPOISON_MEMORY_REGION(p, need);
    return p;
  }
  return NULL;
}

void *ddp_arena_alloc(ddp_arena *arena, size_t bytes) {
  size_t need = aligned_size(bytes);
  void *reused = arena->n_holes ? from_hole(arena, need) : NULL;
  if (reused) return reused;
  ddp_arena_chunk *c = arena->head;
  if (!c || c->capacity - c->used < need) {
    size_t cap = arena->min_chunk;
    if (c && c->capacity * 2 > cap) cap = c->capacity * 2;
    if (cap < need) cap = need;
    ddp_arena_chunk *fresh = chunk_new(arena, cap);
    if (!fresh) {
      ddp_error(DDP_ERR_NOMEM, "arena%s%s: cannot allocate a chunk of %zu bytes",
                arena->backing ? " on " : "", arena->backing ? arena->backing->name : "", cap);
      return NULL;
    }
    fresh->next = c;
    arena->head = c = fresh;
  }
  void *p = c->base + c->used;
  c->used += need;
  arena->used_total += need;
  if (arena->used_total > arena->high_water) arena->high_water = arena->used_total;
  return p;
}

void *ddp_arena_calloc(ddp_arena *arena, size_t bytes) {
  void *p = ddp_arena_alloc(arena, bytes);
  if (p && arena->backing)
    arena->backing->zero(p, bytes);
  else if (p)
    memset(p, 0, bytes);
  return p;
}

void ddp_arena_release(ddp_arena *arena, void *p, size_t bytes) {
  /* Whole 64-byte units only, so that what is carved from the hole stays
   * aligned (a partial last unit is simply not reused). */
  size_t usable = bytes & ~(size_t)63;
  if (!p || usable == 0 || arena->n_holes == DDP_ARENA_HOLES) return;
  if (!arena->backing) ASAN_POISON_MEMORY_REGION(p, usable);
  arena->holes[arena->n_holes].at = p;
  arena->holes[arena->n_holes].bytes = usable;
  arena->n_holes++;
}

void ddp_arena_reset(ddp_arena *arena) {
  /* Holes are unpoisoned with the rest: the next cycle's allocations may
   * fall anywhere in the chunk. */
  for (int i = 0; i < arena->n_holes && !arena->backing; i++)
    ASAN_UNPOISON_MEMORY_REGION(arena->holes[i].at, arena->holes[i].bytes);
  arena->n_holes = 0;
  ddp_arena_chunk *c = arena->head;
  if (c && c->next) {
    /* Several chunks: replace them by one that holds the whole cycle. */
    while (c) {
      ddp_arena_chunk *next = c->next;
      chunk_free(arena, c);
      c = next;
    }
    arena->head = chunk_new(arena, arena->high_water);
    /* On failure the next alloc simply starts a new chain. */
  } else if (c) {
    c->used = 0;
  }
  arena->used_total = 0;
}

void ddp_arena_free(ddp_arena *arena) {
  for (int i = 0; i < arena->n_holes && !arena->backing; i++)
    ASAN_UNPOISON_MEMORY_REGION(arena->holes[i].at, arena->holes[i].bytes);
  ddp_arena_chunk *c = arena->head;
  while (c) {
    ddp_arena_chunk *next = c->next;
    chunk_free(arena, c);
    c = next;
  }
  memset(arena, 0, sizeof *arena);
}
