/* The store's key-value table and the operations' semantics (see table.h). */
#include "store/table.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "store/protocol.h"
#include "store/store_impl.h" /* ddp__store_free_key_array */

static uint64_t hash_key(uint64_t seed, const char *key, size_t len) {
  uint64_t h = 1469598103934665603ull ^ seed; /* FNV-1a, then a 64-bit finaliser */
  for (size_t i = 0; i < len; i++) {
    h ^= (uint8_t)key[i];
    h *= 1099511628211ull;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

void ddp__kv_init(ddp__kv_table *t, uint64_t max_bytes) {
  memset(t, 0, sizeof t[0]);
  t->max_bytes = max_bytes;
  /* A per-table seed keeps chains short even when clients pick the keys. */
  t->seed = (uint64_t)ddp_time_ns() * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)t;
}

static void entry_free(ddp__kv_entry *e) {
  ddp_free(e->value);
  ddp_free(e);
}

void ddp__kv_free(ddp__kv_table *t) {
  for (size_t b = 0; b < t->num_buckets; b++) {
    ddp__kv_entry *e = t->buckets[b];
    while (e) {
      ddp__kv_entry *next = e->next;
      entry_free(e);
      e = next;
    }
  }
  ddp_free(t->buckets);
  t->buckets = NULL;
  t->num_buckets = t->num_entries = t->num_values = 0;
  t->bytes = 0;
}

ddp__kv_entry *ddp__kv_find(const ddp__kv_table *t, const char *key, size_t key_len) {
  if (!t->num_buckets) return NULL;
  uint64_t h = hash_key(t->seed, key, key_len);
  for (ddp__kv_entry *e = t->buckets[h & (t->num_buckets - 1)]; e; e = e->next)
    if (e->hash == h && e->key_len == key_len && !memcmp(e->key, key, key_len)) return e;
  return NULL;
}

/* Doubles the bucket array; on allocation failure keeps the old one (longer
 * chains, still correct). */
static void grow(ddp__kv_table *t) {
  size_t n = t->num_buckets ? t->num_buckets * 2 : 64;
  ddp__kv_entry **b = ddp_calloc(n, sizeof *b);
  if (!b) return;
  for (size_t i = 0; i < t->num_buckets; i++) {
    ddp__kv_entry *e = t->buckets[i];
    while (e) {
      ddp__kv_entry *next = e->next;
      e->next = b[e->hash & (n - 1)];
      b[e->hash & (n - 1)] = e;
      e = next;
    }
  }
  ddp_free(t->buckets);
  t->buckets = b;
  t->num_buckets = n;
}

ddp__kv_entry *ddp__kv_intern(ddp__kv_table *t, const char *key, size_t key_len) {
  ddp__kv_entry *e = ddp__kv_find(t, key, key_len);
  if (e) return e;
  if (t->num_entries >= t->num_buckets) grow(t);
  if (!t->num_buckets) return NULL;
  e = ddp_alloc(sizeof *e + key_len + 1);
  if (!e) return NULL;
  memset(e, 0, sizeof *e);
  e->hash = hash_key(t->seed, key, key_len);
  e->key_len = key_len;
  memcpy(e->key, key, key_len);
  e->key[key_len] = '\0';
  size_t b = e->hash & (t->num_buckets - 1);
  e->next = t->buckets[b];
  t->buckets[b] = e;
  t->num_entries++;
  return e;
}

void ddp__kv_release(ddp__kv_table *t, ddp__kv_entry *e) {
  if (e->has_value || e->waiters || e->watchers) return;
  ddp__kv_entry **pp = &t->buckets[e->hash & (t->num_buckets - 1)];
  while (*pp && *pp != e) pp = &(*pp)->next;
  if (!*pp) return;
  *pp = e->next;
  t->num_entries--;
  entry_free(e);
}

/* Makes room for `len` value bytes (+ NUL), keeping the first `keep` bytes. */
static ddp_status reserve_value(ddp__kv_table *t, ddp__kv_entry *e, size_t len, size_t keep) {
  uint64_t old_bytes = e->has_value ? e->key_len + e->value_len : 0;
  uint64_t new_bytes = e->key_len + len;
  if (t->max_bytes && new_bytes > old_bytes && t->bytes - old_bytes + new_bytes > t->max_bytes)
    return ddp_error(DDP_ERR_NOMEM, "the store is full (%" PRIu64 " of %" PRIu64 " bytes held)",
                     t->bytes, t->max_bytes);
  if (len + 1 > e->value_cap || (e->value_cap > 4096 && len < e->value_cap / 4)) {
    /* Appends grow geometrically; a much smaller set shrinks. */
    size_t cap = len + 1;
    if (keep && cap < e->value_cap * 2) cap = e->value_cap * 2;
    uint8_t *v = ddp_alloc(cap);
    if (!v) return ddp_error(DDP_ERR_NOMEM, "out of memory for a value of %zu bytes", len);
    if (keep) memcpy(v, e->value, keep);
    ddp_free(e->value);
    e->value = v;
    e->value_cap = cap;
  }
  return DDP_OK;
}

/* Accounts for the entry's new value length. */
static void commit_value(ddp__kv_table *t, ddp__kv_entry *e, size_t len) {
  if (e->has_value) t->bytes -= e->key_len + e->value_len;
  else t->num_values++;
  e->has_value = 1;
  e->value_len = len;
  e->value[len] = '\0';
  t->bytes += e->key_len + len;
}

static ddp_status intern_or_fail(ddp__kv_table *t, const char *key, size_t key_len,
                                 ddp__kv_entry **out) {
  *out = ddp__kv_intern(t, key, key_len);
  if (!*out) return ddp_error(DDP_ERR_NOMEM, "out of memory for a new key");
  return DDP_OK;
}

static ddp_status put(ddp__kv_table *t, ddp__kv_entry *e, const void *value, size_t len) {
  ddp_status st = reserve_value(t, e, len, 0);
  if (st != DDP_OK) return st;
  if (len) memcpy(e->value, value, len);
  commit_value(t, e, len);
  return DDP_OK;
}

ddp_status ddp__kv_set(ddp__kv_table *t, const char *key, size_t key_len, const void *value,
                       size_t value_len, ddp__kv_entry **changed) {
  if (changed) *changed = NULL;
  ddp__kv_entry *e;
  DDP_TRY(intern_or_fail(t, key, key_len, &e));
  ddp_status st = put(t, e, value, value_len);
  if (st != DDP_OK) {
    ddp__kv_release(t, e);
    return st;
  }
  if (changed) *changed = e;
  return DDP_OK;
}

ddp_status ddp__kv_append(ddp__kv_table *t, const char *key, size_t key_len, const void *value,
                          size_t value_len, ddp__kv_entry **changed) {
  if (changed) *changed = NULL;
  ddp__kv_entry *e;
  DDP_TRY(intern_or_fail(t, key, key_len, &e));
  size_t old = e->has_value ? e->value_len : 0;
  if (value_len > SIZE_MAX / 2 - old) return ddp_error(DDP_ERR_RANGE, "appended value too large");
  ddp_status st = reserve_value(t, e, old + value_len, old);
  if (st != DDP_OK) {
    ddp__kv_release(t, e);
    return st;
  }
  if (value_len) memcpy(e->value + old, value, value_len);
  commit_value(t, e, old + value_len);
  if (changed) *changed = e;
  return DDP_OK;
}

ddp_status ddp__kv_add(ddp__kv_table *t, const char *key, size_t key_len, int64_t delta,
                       int64_t *result, ddp__kv_entry **changed) {
  if (changed) *changed = NULL;
  ddp__kv_entry *e = ddp__kv_find(t, key, key_len);
  int64_t cur = 0;
  if (e && e->has_value) {
    int rc = ddp__store_parse_int(e->value, e->value_len, &cur);
    if (rc != 0) {
      size_t show = e->value_len > 32 ? 32 : e->value_len;
      int printable = 1;
      for (size_t i = 0; i < show; i++)
        if (e->value[i] < 0x20 || e->value[i] > 0x7e) printable = 0;
      if (rc == -2)
        return ddp_error(DDP_ERR_RANGE, "value \"%.*s\" is out of the int64 range", (int)show,
                         (const char *)e->value);
      if (printable)
        return ddp_error(DDP_ERR_FORMAT, "value \"%.*s%s\" is not an integer", (int)show,
                         (const char *)e->value, e->value_len > show ? "..." : "");
      return ddp_error(DDP_ERR_FORMAT, "value (%zu bytes of binary data) is not an integer",
                       e->value_len);
    }
  }
  int64_t sum;
  if (__builtin_add_overflow(cur, delta, &sum))
    return ddp_error(DDP_ERR_RANGE, "%" PRId64 " + %" PRId64 " overflows int64", cur, delta);
  char text[24];
  int n = snprintf(text, sizeof text, "%" PRId64, sum);
  DDP_TRY(ddp__kv_set(t, key, key_len, text, (size_t)n, changed));
  if (result) *result = sum;
  return DDP_OK;
}

ddp_status ddp__kv_compare_set(ddp__kv_table *t, const char *key, size_t key_len,
                               const void *expected, size_t expected_len, const void *desired,
                               size_t desired_len, const uint8_t **result, size_t *result_len,
                               ddp__kv_entry **changed) {
  if (changed) *changed = NULL;
  ddp__kv_entry *e = ddp__kv_find(t, key, key_len);
  if (!e || !e->has_value) {
    if (expected_len != 0) {
      /* PyTorch answers with `expected` here (the key stays absent). */
      *result = expected;
      *result_len = expected_len;
      return DDP_OK;
    }
  } else if (e->value_len != expected_len ||
             (expected_len && memcmp(e->value, expected, expected_len))) {
    *result = e->value;
    *result_len = e->value_len;
    return DDP_OK;
  }
  DDP_TRY(ddp__kv_set(t, key, key_len, desired, desired_len, &e));
  if (changed) *changed = e;
  *result = e->value;
  *result_len = e->value_len;
  return DDP_OK;
}

void ddp__kv_delete(ddp__kv_table *t, const char *key, size_t key_len, int *deleted) {
  ddp__kv_entry *e = ddp__kv_find(t, key, key_len);
  *deleted = e && e->has_value;
  if (!*deleted) return;
  t->bytes -= e->key_len + e->value_len;
  t->num_values--;
  e->has_value = 0;
  e->value_len = 0;
  ddp_free(e->value);
  e->value = NULL;
  e->value_cap = 0;
  ddp__kv_release(t, e);
}

size_t ddp__kv_count_prefix(const ddp__kv_table *t, const char *prefix, size_t prefix_len) {
  if (prefix_len == 0) return t->num_values;
  size_t n = 0, b = 0;
  for (ddp__kv_entry *e = ddp__kv_next(t, &b, NULL); e; e = ddp__kv_next(t, &b, e))
    if (ddp__kv_entry_matches(e, prefix, prefix_len)) n++;
  return n;
}

ddp_status ddp__kv_list_prefix(const ddp__kv_table *t, const char *prefix, size_t prefix_len,
                               char ***keys, size_t *count) {
  size_t n = ddp__kv_count_prefix(t, prefix, prefix_len), i = 0, b = 0;
  char **out = ddp_calloc(n ? n : 1, sizeof *out);
  if (!out) return ddp_error(DDP_ERR_NOMEM, "out of memory for %zu keys", n);
  for (ddp__kv_entry *e = ddp__kv_next(t, &b, NULL); e; e = ddp__kv_next(t, &b, e)) {
    if (!ddp__kv_entry_matches(e, prefix, prefix_len)) continue;
    out[i] = ddp_strdup(e->key);
    if (!out[i]) {
      ddp__store_free_key_array(out, i);
      return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    i++;
  }
  *keys = out;
  *count = i;
  return DDP_OK;
}

ddp__kv_entry *ddp__kv_next(const ddp__kv_table *t, size_t *bucket, ddp__kv_entry *prev) {
  if (prev && prev->next) return prev->next;
  size_t b = prev ? *bucket + 1 : *bucket;
  for (; b < t->num_buckets; b++) {
    if (t->buckets[b]) {
      *bucket = b;
      return t->buckets[b];
    }
  }
  *bucket = b;
  return NULL;
}

void *ddp__store_copy_value(const void *data, size_t len) {
  uint8_t *v = ddp_alloc(len + 1);
  if (!v) return NULL;
  if (len) memcpy(v, data, len);
  v[len] = '\0';
  return v;
}
