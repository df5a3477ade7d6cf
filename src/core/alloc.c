/* Every heap allocation of ddp passes through here, so tests can count them
 * and inject failures. The default is 64-byte aligned malloc. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/core.h"

static void *default_alloc(size_t bytes, void *user) {
  (void)user;
  void *p = NULL;
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded == 0) rounded = 64;
  if (posix_memalign(&p, 64, rounded) != 0) return NULL;
  return p;
}

static void default_free(void *ptr, void *user) {
  (void)user;
  free(ptr);
}

static ddp_alloc_hooks hooks = {default_alloc, default_free, NULL};
static atomic_uint_fast64_t alloc_count;

void ddp_set_alloc_hooks(const ddp_alloc_hooks *h) {
  if (h)
    hooks = *h;
  else
    hooks = (ddp_alloc_hooks){default_alloc, default_free, NULL};
}

uint64_t ddp_alloc_count(void) { return atomic_load(&alloc_count); }

void *ddp_alloc(size_t bytes) {
  atomic_fetch_add(&alloc_count, 1);
  return hooks.alloc(bytes, hooks.user);
}

void *ddp_calloc(size_t count, size_t size) {
  if (size && count > SIZE_MAX / size) return NULL;
  void *p = ddp_alloc(count * size);
  if (p) memset(p, 0, count * size);
  return p;
}

void ddp_free(void *ptr) {
  if (ptr) hooks.free(ptr, hooks.user);
}

char *ddp_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = ddp_alloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

void *ddp_realloc(void *ptr, size_t old_bytes, size_t new_bytes) {
  void *p = ddp_alloc(new_bytes);
  if (!p) return NULL;
  if (ptr) {
    memcpy(p, ptr, old_bytes < new_bytes ? old_bytes : new_bytes);
    ddp_free(ptr);
  }
  return p;
}
