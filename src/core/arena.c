/* Bump arenas for per-step temporaries. After the first cycle the arena holds
 * one chunk as large as the cycle's high-water mark, so identical cycles (the
 * steady-state training step) never allocate. */
#include <string.h>

#include "ddp/core.h"

struct ddp_arena_chunk {
  ddp_arena_chunk *next; /* older chunk */
  size_t capacity;       /* usable bytes after the header */
  size_t used;
};

#define CHUNK_HEADER 64 /* keeps the payload 64-byte aligned */

static ddp_arena_chunk *chunk_new(size_t capacity) {
  ddp_arena_chunk *c = ddp_alloc(CHUNK_HEADER + capacity);
  if (!c) return NULL;
  c->next = NULL;
  c->capacity = capacity;
  c->used = 0;
  return c;
}

void ddp_arena_init(ddp_arena *arena, size_t initial_bytes) {
  memset(arena, 0, sizeof *arena);
  arena->min_chunk = initial_bytes < 4096 ? 4096 : initial_bytes;
}

void *ddp_arena_alloc(ddp_arena *arena, size_t bytes) {
  size_t need = (bytes + 63) & ~(size_t)63;
  if (need == 0) need = 64;
  ddp_arena_chunk *c = arena->head;
  if (!c || c->capacity - c->used < need) {
    size_t cap = arena->min_chunk;
    if (c && c->capacity * 2 > cap) cap = c->capacity * 2;
    if (cap < need) cap = need;
    ddp_arena_chunk *fresh = chunk_new(cap);
    if (!fresh) {
      ddp_error(DDP_ERR_NOMEM, "arena: cannot allocate a chunk of %zu bytes", cap);
      return NULL;
    }
    fresh->next = c;
    arena->head = c = fresh;
  }
  void *p = (char *)c + CHUNK_HEADER + c->used;
  c->used += need;
  arena->used_total += need;
  if (arena->used_total > arena->high_water) arena->high_water = arena->used_total;
  return p;
}

void *ddp_arena_calloc(ddp_arena *arena, size_t bytes) {
  void *p = ddp_arena_alloc(arena, bytes);
  if (p) memset(p, 0, bytes);
  return p;
}

void ddp_arena_reset(ddp_arena *arena) {
  ddp_arena_chunk *c = arena->head;
  if (c && c->next) {
    /* Several chunks: replace them by one that holds the whole cycle. */
    while (c) {
      ddp_arena_chunk *next = c->next;
      ddp_free(c);
      c = next;
    }
    arena->head = chunk_new(arena->high_water);
    /* On failure the next alloc simply starts a new chain. */
  } else if (c) {
    c->used = 0;
  }
  arena->used_total = 0;
}

void ddp_arena_free(ddp_arena *arena) {
  ddp_arena_chunk *c = arena->head;
  while (c) {
    ddp_arena_chunk *next = c->next;
    ddp_free(c);
    c = next;
  }
  memset(arena, 0, sizeof *arena);
}
