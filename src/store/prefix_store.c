/* The prefix store: a namespace ("group3/") over another store, so groups of
 * ranks (and the hyperparameter search's many trainings) share one server
 * without their keys meeting. Calls go straight to the base's ops with the
 * prefixed keys; errors are named by the outer (prefix) handle. */
#include <stdio.h>
#include <string.h>

#include "store/store_impl.h"

typedef struct prefix_store {
  ddp_store base_handle;
  ddp_store *base; /* one reference held */
  char *prefix;
  size_t prefix_len;
} prefix_store;

static prefix_store *as_prefix(ddp_store *s) { return (prefix_store *)s; }

/* prefix + key in a new string; NULL when out of memory. */
static char *join(const prefix_store *p, const char *key) {
  size_t klen = strlen(key);
  char *k = ddp_alloc(p->prefix_len + klen + 1);
  if (!k) return NULL;
  memcpy(k, p->prefix, p->prefix_len);
  memcpy(k + p->prefix_len, key, klen + 1);
  return k;
}

static char **join_all(const prefix_store *p, const char *const *keys, size_t n) {
  char **out = ddp_calloc(n, sizeof *out);
  if (!out) return NULL;
  for (size_t i = 0; i < n; i++) {
    out[i] = join(p, keys[i]);
    if (!out[i]) {
      ddp__store_free_key_array(out, i);
      return NULL;
    }
  }
  return out;
}

#define NOMEM() ddp_error(DDP_ERR_NOMEM, "out of memory")

static ddp_status pre_set(ddp_store *s, const char *key, const void *v, size_t n) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->set(p->base, k, v, n);
  ddp_free(k);
  return st;
}

static ddp_status pre_get(ddp_store *s, const char *key, int64_t t, void **v, size_t *n) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->get(p->base, k, t, v, n);
  ddp_free(k);
  return st;
}

static ddp_status pre_add(ddp_store *s, const char *key, int64_t delta, int64_t *r) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->add(p->base, k, delta, r);
  ddp_free(k);
  return st;
}

static ddp_status pre_compare_set(ddp_store *s, const char *key, const void *e, size_t en,
                                  const void *d, size_t dn, void **c, size_t *cn) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->compare_set(p->base, k, e, en, d, dn, c, cn);
  ddp_free(k);
  return st;
}

static ddp_status pre_wait(ddp_store *s, const char *const *keys, size_t n, int64_t t) {
  prefix_store *p = as_prefix(s);
  char **k = join_all(p, keys, n);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->wait(p->base, (const char *const *)k, n, t);
  ddp__store_free_key_array(k, n);
  return st;
}

static ddp_status pre_check(ddp_store *s, const char *const *keys, size_t n, int *all) {
  prefix_store *p = as_prefix(s);
  char **k = join_all(p, keys, n);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->check(p->base, (const char *const *)k, n, all);
  ddp__store_free_key_array(k, n);
  return st;
}

static ddp_status pre_del(ddp_store *s, const char *key, int *deleted) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->del(p->base, k, deleted);
  ddp_free(k);
  return st;
}

static ddp_status pre_num_keys(ddp_store *s, const char *prefix, int64_t *count) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, prefix);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->num_keys(p->base, k, count);
  ddp_free(k);
  return st;
}

static ddp_status pre_list_keys(ddp_store *s, const char *prefix, char ***keys, size_t *count) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, prefix);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->list_keys(p->base, k, keys, count);
  ddp_free(k);
  if (st != DDP_OK) return st;
  /* Strip our prefix (every key returned starts with it). */
  for (size_t i = 0; i < *count; i++) {
    char *key = (*keys)[i];
    memmove(key, key + p->prefix_len, strlen(key + p->prefix_len) + 1);
  }
  return DDP_OK;
}

static ddp_status pre_append(ddp_store *s, const char *key, const void *v, size_t n) {
  prefix_store *p = as_prefix(s);
  char *k = join(p, key);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->append(p->base, k, v, n);
  ddp_free(k);
  return st;
}

static ddp_status pre_multi_get(ddp_store *s, const char *const *keys, size_t n, int64_t t,
                                ddp_store_value *values) {
  prefix_store *p = as_prefix(s);
  char **k = join_all(p, keys, n);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->multi_get(p->base, (const char *const *)k, n, t, values);
  ddp__store_free_key_array(k, n);
  return st;
}

static ddp_status pre_multi_set(ddp_store *s, const char *const *keys,
                                const ddp_store_value *values, size_t n) {
  prefix_store *p = as_prefix(s);
  char **k = join_all(p, keys, n);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->multi_set(p->base, (const char *const *)k, values, n);
  ddp__store_free_key_array(k, n);
  return st;
}

static ddp_status pre_watch_open(ddp_store *s, const char *const *keys, size_t n,
                                 ddp_store_value *initial, ddp_store_watcher **out) {
  prefix_store *p = as_prefix(s);
  if (!p->base->ops->watch_open)
    return ddp_error(DDP_ERR_UNSUPPORTED, "the %s store under this prefix has no watches",
                     p->base->ops->kind);
  char **k = join_all(p, keys, n);
  if (!k) return NOMEM();
  ddp_status st = p->base->ops->watch_open(p->base, (const char *const *)k, n, initial, out);
  ddp__store_free_key_array(k, n);
  if (st == DDP_OK) (*out)->strip += p->prefix_len; /* prefixes nest */
  return st;
}

static ddp_status make(ddp_store *base, const char *prefix, int64_t timeout_ms, ddp_store **out);

static ddp_status pre_clone(ddp_store *s, ddp_store **out) {
  prefix_store *p = as_prefix(s);
  ddp_store *base = NULL;
  DDP_TRY(p->base->ops->clone(p->base, &base));
  ddp_status st = make(base, p->prefix, ddp_store_timeout_ms(s), out);
  ddp_store_destroy(base); /* make took its own reference */
  return st;
}

static void pre_destroy(ddp_store *s) {
  prefix_store *p = as_prefix(s);
  ddp_store_destroy(p->base);
  ddp_free(p->prefix);
  ddp__store_fini(s);
  ddp_free(p);
}

static const ddp__store_ops prefix_ops = {
    .kind = "prefix",
    .set = pre_set,
    .get = pre_get,
    .add = pre_add,
    .compare_set = pre_compare_set,
    .wait = pre_wait,
    .check = pre_check,
    .del = pre_del,
    .num_keys = pre_num_keys,
    .list_keys = pre_list_keys,
    .append = pre_append,
    .multi_get = pre_multi_get,
    .multi_set = pre_multi_set,
    .clone = pre_clone,
    .watch_open = pre_watch_open,
    .destroy = pre_destroy,
};

static ddp_status make(ddp_store *base, const char *prefix, int64_t timeout_ms, ddp_store **out) {
  prefix_store *p = ddp_calloc(1, sizeof *p);
  if (!p) return NOMEM();
  size_t alen = strlen(base->address) + strlen(prefix) + 16;
  char *address = ddp_alloc(alen);
  p->prefix = ddp_strdup(prefix);
  ddp_store_options o = {.timeout_ms = timeout_ms};
  if (!address || !p->prefix) goto nomem;
  snprintf(address, alen, "%s prefix \"%s\"", base->address, prefix);
  if (ddp__store_init(&p->base_handle, &prefix_ops, &o, address) != DDP_OK) goto nomem;
  ddp_free(address);
  p->prefix_len = strlen(prefix);
  p->base = ddp_store_retain(base);
  *out = &p->base_handle;
  return DDP_OK;
nomem:
  ddp_free(address);
  ddp_free(p->prefix);
  ddp_free(p);
  return NOMEM();
}

ddp_status ddp_store_prefix(ddp_store *base, const char *prefix, ddp_store **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_store_prefix: out is NULL");
  *out = NULL;
  if (!base) return ddp_error(DDP_ERR_INVALID, "ddp_store_prefix: base store is NULL");
  if (!prefix || !*prefix)
    return ddp_error(DDP_ERR_INVALID, "store %s: prefix: the prefix is empty", base->address);
  if (strlen(prefix) >= DDP_STORE_MAX_KEY_BYTES)
    return ddp_error(DDP_ERR_RANGE, "store %s: prefix of %zu bytes leaves no room for keys",
                     base->address, strlen(prefix));
  return make(base, prefix, ddp_store_timeout_ms(base), out);
}
