/* The in-process store: the shared table behind a mutex, with a condition
 * variable that every write broadcasts so blocked gets and waits recheck.
 * For tests and the threads transport (ranks as threads of one process). */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "store/store_impl.h"
#include "store/table.h"

typedef struct mem_store {
  ddp_store base;
  pthread_mutex_t mu;
  pthread_cond_t changed; /* CLOCK_MONOTONIC */
  ddp__kv_table table;
} mem_store;

static mem_store *as_mem(ddp_store *s) { return (mem_store *)s; }

/* Waits for a broadcast or the deadline; returns 0 once the deadline passed. */
static int wait_until(mem_store *m, int64_t deadline_ns) {
  int64_t now = ddp_time_ns();
  if (now >= deadline_ns) return 0;
  struct timespec ts;
  ts.tv_sec = deadline_ns / 1000000000LL;
  ts.tv_nsec = deadline_ns % 1000000000LL;
  pthread_cond_timedwait(&m->changed, &m->mu, &ts);
  return 1;
}

static int has(const mem_store *m, const char *key) {
  const ddp__kv_entry *e = ddp__kv_find(&m->table, key, strlen(key));
  return e && e->has_value;
}

/* Index of the first missing key, or n. Called with the lock held. */
static size_t first_missing(const mem_store *m, const char *const *keys, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!has(m, keys[i])) return i;
  return n;
}

/* Blocks (lock held) until every key exists or the deadline. */
static ddp_status await_keys(mem_store *m, const char *const *keys, size_t n, int64_t timeout_ms) {
  int64_t deadline = ddp_time_ns() + timeout_ms * 1000000LL;
  size_t miss;
  while ((miss = first_missing(m, keys, n)) < n)
    if (!wait_until(m, deadline)) return ddp__store_keys_timeout(timeout_ms, keys, n, miss);
  return DDP_OK;
}

static void changed(mem_store *m, ddp_status st) {
  if (st == DDP_OK) pthread_cond_broadcast(&m->changed);
  pthread_mutex_unlock(&m->mu);
}

static ddp_status mem_set(ddp_store *s, const char *key, const void *value, size_t bytes) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = ddp__kv_set(&m->table, key, strlen(key), value, bytes, NULL);
  changed(m, st);
  return st;
}

static ddp_status mem_get(ddp_store *s, const char *key, int64_t timeout_ms, void **value,
                          size_t *bytes) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = await_keys(m, &key, 1, timeout_ms);
  if (st == DDP_OK) {
    const ddp__kv_entry *e = ddp__kv_find(&m->table, key, strlen(key));
    *value = ddp__store_copy_value(e->value, e->value_len);
    *bytes = e->value_len;
    if (!*value) st = ddp_error(DDP_ERR_NOMEM, "out of memory for %zu bytes", e->value_len);
  }
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = ddp__kv_add(&m->table, key, strlen(key), delta, result, NULL);
  changed(m, st);
  return st;
}

static ddp_status mem_compare_set(ddp_store *s, const char *key, const void *expected,
                                  size_t expected_bytes, const void *desired, size_t desired_bytes,
                                  void **current, size_t *current_bytes) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  const uint8_t *r;
  size_t rlen;
  ddp__kv_entry *e;
  ddp_status st = ddp__kv_compare_set(&m->table, key, strlen(key), expected, expected_bytes,
                                      desired, desired_bytes, &r, &rlen, &e);
  if (st == DDP_OK) {
    *current = ddp__store_copy_value(r, rlen);
    *current_bytes = rlen;
    if (!*current) st = ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  if (e) pthread_cond_broadcast(&m->changed);
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_wait(ddp_store *s, const char *const *keys, size_t n, int64_t timeout_ms) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = await_keys(m, keys, n, timeout_ms);
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_check(ddp_store *s, const char *const *keys, size_t n, int *all) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  *all = first_missing(m, keys, n) == n;
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static ddp_status mem_del(ddp_store *s, const char *key, int *deleted) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp__kv_delete(&m->table, key, strlen(key), deleted);
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static ddp_status mem_num_keys(ddp_store *s, const char *prefix, int64_t *count) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  *count = (int64_t)ddp__kv_count_prefix(&m->table, prefix, strlen(prefix));
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static ddp_status mem_list_keys(ddp_store *s, const char *prefix, char ***keys, size_t *count) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = ddp__kv_list_prefix(&m->table, prefix, strlen(prefix), keys, count);
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_append(ddp_store *s, const char *key, const void *value, size_t bytes) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = ddp__kv_append(&m->table, key, strlen(key), value, bytes, NULL);
  changed(m, st);
  return st;
}

static ddp_status mem_multi_get(ddp_store *s, const char *const *keys, size_t n, int64_t timeout_ms,
                                ddp_store_value *values) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = await_keys(m, keys, n, timeout_ms);
  for (size_t i = 0; i < n && st == DDP_OK; i++) {
    const ddp__kv_entry *e = ddp__kv_find(&m->table, keys[i], strlen(keys[i]));
    values[i].data = ddp__store_copy_value(e->value, e->value_len);
    values[i].bytes = e->value_len;
    if (!values[i].data) st = ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_multi_set(ddp_store *s, const char *const *keys,
                                const ddp_store_value *values, size_t n) {
  mem_store *m = as_mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status st = DDP_OK;
  for (size_t i = 0; i < n && st == DDP_OK; i++)
    st = ddp__kv_set(&m->table, keys[i], strlen(keys[i]), values[i].data, values[i].bytes, NULL);
  pthread_cond_broadcast(&m->changed); /* even a partial failure changed something */
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status mem_clone(ddp_store *s, ddp_store **out) {
  *out = ddp_store_retain(s);
  return DDP_OK;
}

static void mem_destroy(ddp_store *s) {
  mem_store *m = as_mem(s);
  ddp__kv_free(&m->table);
  pthread_cond_destroy(&m->changed);
  pthread_mutex_destroy(&m->mu);
  ddp__store_fini(s);
  ddp_free(m);
}

static const ddp__store_ops mem_ops = {
    .kind = "mem",
    .set = mem_set,
    .get = mem_get,
    .add = mem_add,
    .compare_set = mem_compare_set,
    .wait = mem_wait,
    .check = mem_check,
    .del = mem_del,
    .num_keys = mem_num_keys,
    .list_keys = mem_list_keys,
    .append = mem_append,
    .multi_get = mem_multi_get,
    .multi_set = mem_multi_set,
    .clone = mem_clone,
    .destroy = mem_destroy,
};

ddp_status ddp_store_mem_create(const ddp_store_options *options, ddp_store **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_store_mem_create: out is NULL");
  *out = NULL;
  mem_store *m = ddp_calloc(1, sizeof *m);
  if (!m) return ddp_error(DDP_ERR_NOMEM, "mem store: out of memory");
  if (ddp__store_init(&m->base, &mem_ops, options, "mem") != DDP_OK) {
    ddp_free(m);
    return DDP_ERR_NOMEM;
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->changed, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&m->mu, NULL);
  ddp__kv_init(&m->table, 0);
  *out = &m->base;
  return DDP_OK;
}
