/* The key-value table behind the server, the in-process store and the file
 * store's cache: a chained hash map from key to value bytes, and the store's
 * operations on it (set, add, compare_set, append, delete) with PyTorch's
 * semantics, written once. Not thread-safe: callers lock. */
#ifndef DDP_STORE_TABLE_H
#define DDP_STORE_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>
#include <stdint.h>

#include "ddp/core.h"

/* One key. An entry without a value is a placeholder that the server keeps
 * while clients wait for the key (`waiters`); the table never looks at it. */
typedef struct ddp__kv_entry {
  struct ddp__kv_entry *next; /* hash chain */
  uint64_t hash;
  uint8_t *value; /* value_len bytes + a NUL; NULL when absent */
  size_t value_len;
  size_t value_cap;
  int has_value;
  void *waiters;  /* the server's list of blocked clients */
  void *watchers; /* the server's list of watch links */
  size_t key_len;
  char key[]; /* key_len bytes + NUL */
} ddp__kv_entry;

/* True when e holds a value and its key starts with prefix (prefix_len bytes). */
static inline bool ddp__kv_entry_matches(const ddp__kv_entry *e, const char *prefix,
                                         size_t prefix_len) {
  return e->has_value && e->key_len >= prefix_len && !memcmp(e->key, prefix, prefix_len);
}

typedef struct ddp__kv_table {
  ddp__kv_entry **buckets;
  size_t num_buckets; /* a power of two */
  size_t num_entries; /* including placeholders */
  size_t num_values;  /* keys that exist */
  uint64_t bytes;     /* keys + values held */
  uint64_t max_bytes; /* 0: unlimited; else writes beyond fail */
  uint64_t seed;
} ddp__kv_table;

void ddp__kv_init(ddp__kv_table *t, uint64_t max_bytes);
/* Frees every entry (the caller has released their waiters). */
void ddp__kv_free(ddp__kv_table *t);

ddp__kv_entry *ddp__kv_find(const ddp__kv_table *t, const char *key, size_t key_len);
/* Finds or creates (as a placeholder) the entry; NULL when out of memory. */
ddp__kv_entry *ddp__kv_intern(ddp__kv_table *t, const char *key, size_t key_len);
/* Removes the entry if it has neither a value nor waiters nor watchers. */
void ddp__kv_release(ddp__kv_table *t, ddp__kv_entry *e);

/* The operations. Errors carry a message without the store's name (callers
 * wrap it): DDP_ERR_NOMEM when out of memory or over max_bytes. On success
 * *changed (when non-NULL) is the entry that got a new value, for waking
 * waiters, or NULL when nothing was written. */
ddp_status ddp__kv_set(ddp__kv_table *t, const char *key, size_t key_len, const void *value,
                       size_t value_len, ddp__kv_entry **changed);
ddp_status ddp__kv_append(ddp__kv_table *t, const char *key, size_t key_len, const void *value,
                          size_t value_len, ddp__kv_entry **changed);
/* DDP_ERR_FORMAT when the value is not a decimal int64, DDP_ERR_RANGE on
 * overflow. */
ddp_status ddp__kv_add(ddp__kv_table *t, const char *key, size_t key_len, int64_t delta,
                       int64_t *result, ddp__kv_entry **changed);
/* PyTorch's compareSet (see ddp_store_compare_set). *result points at the
 * bytes to return: the entry's value, or `expected` when the key is absent
 * and expected is non-empty; valid until the table changes. */
ddp_status ddp__kv_compare_set(ddp__kv_table *t, const char *key, size_t key_len,
                               const void *expected, size_t expected_len, const void *desired,
                               size_t desired_len, const uint8_t **result, size_t *result_len,
                               ddp__kv_entry **changed);
/* *deleted = 1 when the key existed. The entry stays as a placeholder if it
 * has waiters. */
void ddp__kv_delete(ddp__kv_table *t, const char *key, size_t key_len, int *deleted);

/* Keys that exist and start with prefix (prefix_len 0: all). */
size_t ddp__kv_count_prefix(const ddp__kv_table *t, const char *prefix, size_t prefix_len);
/* The keys that exist and start with prefix, as ddp_alloc'd strings in a
 * ddp_alloc'd array (free with ddp__store_free_key_array). */
ddp_status ddp__kv_list_prefix(const ddp__kv_table *t, const char *prefix, size_t prefix_len,
                               char ***keys, size_t *count);
/* Iteration over all entries (placeholders included): start with *bucket = 0
 * and prev = NULL; returns NULL at the end. The table must not change. */
ddp__kv_entry *ddp__kv_next(const ddp__kv_table *t, size_t *bucket, ddp__kv_entry *prev);

/* Copies bytes into a new ddp_alloc'd buffer with a trailing NUL (the public
 * API's value convention). NULL when out of memory. */
void *ddp__store_copy_value(const void *data, size_t len);

#endif /* DDP_STORE_TABLE_H */
