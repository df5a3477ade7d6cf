/* The public store API: argument checks, timeout defaults, and errors that
 * name the store and the call, in front of each implementation's ops. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "store/store_impl.h"

#define DEFAULT_TIMEOUT_S 1800 /* PyTorch's default_pg_timeout */

ddp_store_options ddp_store_defaults(void) {
  ddp_store_options o = {0};
  return o;
}

int64_t ddp_store_default_timeout_ms(void) {
  double seconds;
  if (ddp_env_double("DDP_TIMEOUT", DEFAULT_TIMEOUT_S, &seconds) != DDP_OK || !(seconds > 0) ||
      seconds > 1e9) {
    ddp_log(DDP_LOG_WARN, "DDP_TIMEOUT=\"%s\" is not a positive number of seconds; using %d s",
            ddp_env_str("DDP_TIMEOUT", ""), DEFAULT_TIMEOUT_S);
    seconds = DEFAULT_TIMEOUT_S;
  }
  return (int64_t)(seconds * 1000.0 + 0.5);
}

ddp_status ddp__store_init(ddp_store *s, const ddp__store_ops *ops,
                           const ddp_store_options *options, const char *address) {
  s->ops = ops;
  s->refs = 1;
  s->timeout_ms = options && options->timeout_ms > 0 ? ddp__store_clamp_ms(options->timeout_ms)
                                                     : ddp_store_default_timeout_ms();
  s->address = ddp_strdup(address);
  if (!s->address) return ddp_error(DDP_ERR_NOMEM, "out of memory");
  return DDP_OK;
}

void ddp__store_fini(ddp_store *s) {
  ddp_free(s->address);
  s->address = NULL;
}

const char *ddp__store_token(const char *option_token) {
  const char *t = option_token ? option_token : ddp_env_str("DDP_STORE_TOKEN", NULL);
  return t && *t ? t : NULL;
}

void ddp__store_format_ms(int64_t ms, char *buf, size_t buf_bytes) {
  if (ms < 1000) snprintf(buf, buf_bytes, "%" PRId64 " ms", ms);
  else if (ms % 1000 == 0) snprintf(buf, buf_bytes, "%" PRId64 " s", ms / 1000);
  else snprintf(buf, buf_bytes, "%.3g s", (double)ms / 1000.0);
}

/* Appends "key" in quotes, escaping what would garble a log line. */
static size_t quote(char *buf, size_t at, size_t cap, const char *key) {
  const size_t show = 64;
  if (at + 1 < cap) buf[at++] = '"';
  size_t i = 0;
  for (; key[i] && i < show && at + 5 < cap; i++) {
    unsigned char ch = (unsigned char)key[i];
    if (ch == '"' || ch == '\\') {
      buf[at++] = '\\';
      buf[at++] = (char)ch;
    } else if (ch < 0x20 || ch > 0x7e) {
      at += (size_t)snprintf(buf + at, cap - at, "\\x%02x", ch);
    } else {
      buf[at++] = (char)ch;
    }
  }
  if (key[i] && at + 4 < cap) {
    memcpy(buf + at, "...", 3);
    at += 3;
  }
  if (at + 1 < cap) buf[at++] = '"';
  buf[at < cap ? at : cap - 1] = '\0';
  return at < cap ? at : cap - 1;
}

void ddp__store_format_keys(const char *const *keys, size_t num_keys, char *buf, size_t buf_bytes) {
  const size_t show = 4;
  size_t at = 0;
  if (buf_bytes < 8) {
    if (buf_bytes) buf[0] = '\0';
    return;
  }
  buf[at++] = '[';
  for (size_t i = 0; i < num_keys && i < show; i++) {
    if (i) at += (size_t)snprintf(buf + at, buf_bytes - at, ", ");
    if (at >= buf_bytes - 1) break;
    at = quote(buf, at, buf_bytes, keys[i]);
  }
  if (num_keys > show && at < buf_bytes - 1)
    at += (size_t)snprintf(buf + at, buf_bytes - at, ", ... (%zu keys)", num_keys);
  if (at < buf_bytes - 1) buf[at++] = ']';
  buf[at < buf_bytes ? at : buf_bytes - 1] = '\0';
}

ddp_status ddp__store_keys_timeout(int64_t timeout_ms, const char *const *keys, size_t n,
                                   size_t miss) {
  char t[32], list[256];
  ddp__store_format_ms(timeout_ms, t, sizeof t);
  if (n == 1) return ddp_error(DDP_ERR_TIMEOUT, "timed out after %s", t);
  ddp__store_format_keys(keys + miss, 1, list, sizeof list);
  return ddp_error(DDP_ERR_TIMEOUT, "timed out after %s (missing %s and maybe others)", t, list);
}

void ddp__store_sleep_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void ddp__store_free_key_array(char **keys, size_t count) {
  if (!keys) return;
  for (size_t i = 0; i < count; i++) ddp_free(keys[i]);
  ddp_free(keys);
}

/* Wraps the implementation's message: "store ADDR: get("k"): <what>", or for
 * a timeout "store ADDR: get("k") timed out after 30 s". */
static ddp_status fail(const ddp_store *s, ddp_status st, const char *call) {
  char what[1024];
  snprintf(what, sizeof what, "%s", ddp_last_error()[0] ? ddp_last_error() : ddp_strerror(st));
  if (!strncmp(what, "timed out", 9))
    return ddp_error(st, "store %s: %s %s", s->address, call, what);
  return ddp_error(st, "store %s: %s: %s", s->address, call, what);
}

static void call1(char *buf, size_t cap, const char *op, const char *key) {
  size_t at = (size_t)snprintf(buf, cap, "%s(", op);
  if (at >= cap) at = cap - 1;
  at = quote(buf, at, cap, key);
  snprintf(buf + at, cap - at, ")");
}

static void calln(char *buf, size_t cap, const char *op, const char *const *keys, size_t n) {
  char list[512];
  ddp__store_format_keys(keys, n, list, sizeof list);
  snprintf(buf, cap, "%s(%s)", op, list);
}

static ddp_status check_key(const ddp_store *s, const char *op, const char *key) {
  if (!key || !*key)
    return ddp_error(DDP_ERR_INVALID, "store %s: %s: the key is %s", s ? s->address : "(null)", op,
                     key ? "empty" : "NULL");
  size_t len = strlen(key);
  if (len > DDP_STORE_MAX_KEY_BYTES) {
    char call[160];
    call1(call, sizeof call, op, key);
    return ddp_error(DDP_ERR_RANGE, "store %s: %s: key of %zu bytes exceeds the limit of %u",
                     s->address, call, len, DDP_STORE_MAX_KEY_BYTES);
  }
  return DDP_OK;
}

static ddp_status check_value(const ddp_store *s, const char *op, const char *key,
                              const void *value, size_t bytes) {
  char call[160];
  if (!value && bytes) {
    call1(call, sizeof call, op, key);
    return ddp_error(DDP_ERR_INVALID, "store %s: %s: value is NULL but %zu bytes long", s->address,
                     call, bytes);
  }
  if (bytes > DDP_STORE_MAX_VALUE_BYTES) {
    call1(call, sizeof call, op, key);
    return ddp_error(DDP_ERR_RANGE, "store %s: %s: value of %zu bytes exceeds the limit of %u",
                     s->address, call, bytes, DDP_STORE_MAX_VALUE_BYTES);
  }
  return DDP_OK;
}

static ddp_status check_keys(const ddp_store *s, const char *op, const char *const *keys,
                             size_t n) {
  if (n && !keys) return ddp_error(DDP_ERR_INVALID, "store %s: %s: keys is NULL", s->address, op);
  if (n > DDP_STORE_MAX_KEYS_PER_CALL)
    return ddp_error(DDP_ERR_RANGE, "store %s: %s: %zu keys exceed the limit of %u per call",
                     s->address, op, n, DDP_STORE_MAX_KEYS_PER_CALL);
  for (size_t i = 0; i < n; i++) DDP_TRY(check_key(s, op, keys[i]));
  return DDP_OK;
}

static int64_t resolve_timeout(const ddp_store *s, int64_t timeout_ms) {
  return timeout_ms < 0 ? __atomic_load_n(&s->timeout_ms, __ATOMIC_RELAXED)
                        : ddp__store_clamp_ms(timeout_ms);
}

#define CHECK_STORE(s, op)                                                       \
  do {                                                                           \
    if (!(s)) return ddp_error(DDP_ERR_INVALID, "store: %s: store is NULL", op); \
  } while (0)

/* set and append: the same checks and error trail around a different op. */
static ddp_status put_value(ddp_store *s, const char *op,
                            ddp_status (*put)(ddp_store *, const char *, const void *, size_t),
                            const char *key, const void *value, size_t value_bytes) {
  CHECK_STORE(s, op);
  DDP_TRY(check_key(s, op, key));
  DDP_TRY(check_value(s, op, key, value, value_bytes));
  ddp_status st = put(s, key, value, value_bytes);
  if (st == DDP_OK) return st;
  char call[160];
  call1(call, sizeof call, op, key);
  return fail(s, st, call);
}

ddp_status ddp_store_set(ddp_store *s, const char *key, const void *value, size_t value_bytes) {
  return put_value(s, "set", s ? s->ops->set : NULL, key, value, value_bytes);
}

ddp_status ddp_store_get(ddp_store *s, const char *key, int64_t timeout_ms, void **value,
                         size_t *value_bytes) {
  if (value) *value = NULL;
  if (value_bytes) *value_bytes = 0;
  CHECK_STORE(s, "get");
  DDP_TRY(check_key(s, "get", key));
  if (!value || !value_bytes)
    return ddp_error(DDP_ERR_INVALID, "store %s: get: value and value_bytes must not be NULL",
                     s->address);
  ddp_status st = s->ops->get(s, key, resolve_timeout(s, timeout_ms), value, value_bytes);
  if (st == DDP_OK) return st;
  *value = NULL;
  *value_bytes = 0;
  char call[160];
  call1(call, sizeof call, "get", key);
  return fail(s, st, call);
}

ddp_status ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
  CHECK_STORE(s, "add");
  DDP_TRY(check_key(s, "add", key));
  int64_t r = 0;
  ddp_status st = s->ops->add(s, key, delta, &r);
  if (st == DDP_OK) {
    if (result) *result = r;
    return st;
  }
  char call[160];
  call1(call, sizeof call, "add", key);
  return fail(s, st, call);
}

ddp_status ddp_store_compare_set(ddp_store *s, const char *key, const void *expected,
                                 size_t expected_bytes, const void *desired, size_t desired_bytes,
                                 void **current, size_t *current_bytes) {
  if (current) *current = NULL;
  if (current_bytes) *current_bytes = 0;
  CHECK_STORE(s, "compare_set");
  DDP_TRY(check_key(s, "compare_set", key));
  DDP_TRY(check_value(s, "compare_set", key, expected, expected_bytes));
  DDP_TRY(check_value(s, "compare_set", key, desired, desired_bytes));
  void *cur = NULL;
  size_t cur_bytes = 0;
  ddp_status st = s->ops->compare_set(s, key, expected, expected_bytes, desired, desired_bytes,
                                      &cur, &cur_bytes);
  if (st != DDP_OK) {
    char call[160];
    call1(call, sizeof call, "compare_set", key);
    return fail(s, st, call);
  }
  if (current) *current = cur;
  else ddp_free(cur);
  if (current_bytes) *current_bytes = cur_bytes;
  return DDP_OK;
}

ddp_status ddp_store_wait(ddp_store *s, const char *const *keys, size_t num_keys,
                          int64_t timeout_ms) {
  CHECK_STORE(s, "wait");
  DDP_TRY(check_keys(s, "wait", keys, num_keys));
  if (num_keys == 0) return DDP_OK;
  ddp_status st = s->ops->wait(s, keys, num_keys, resolve_timeout(s, timeout_ms));
  if (st == DDP_OK) return st;
  char call[600];
  calln(call, sizeof call, "wait", keys, num_keys);
  return fail(s, st, call);
}

ddp_status ddp_store_check(ddp_store *s, const char *const *keys, size_t num_keys, int *all_exist) {
  CHECK_STORE(s, "check");
  DDP_TRY(check_keys(s, "check", keys, num_keys));
  if (!all_exist)
    return ddp_error(DDP_ERR_INVALID, "store %s: check: all_exist is NULL", s->address);
  *all_exist = 0;
  if (num_keys == 0) {
    *all_exist = 1;
    return DDP_OK;
  }
  ddp_status st = s->ops->check(s, keys, num_keys, all_exist);
  if (st == DDP_OK) return st;
  char call[600];
  calln(call, sizeof call, "check", keys, num_keys);
  return fail(s, st, call);
}

ddp_status ddp_store_delete(ddp_store *s, const char *key, int *deleted) {
  CHECK_STORE(s, "delete");
  DDP_TRY(check_key(s, "delete", key));
  int d = 0;
  ddp_status st = s->ops->del(s, key, &d);
  if (st != DDP_OK) {
    char call[160];
    call1(call, sizeof call, "delete", key);
    return fail(s, st, call);
  }
  if (deleted) *deleted = d;
  return DDP_OK;
}

ddp_status ddp_store_num_keys(ddp_store *s, int64_t *count) {
  CHECK_STORE(s, "num_keys");
  if (!count) return ddp_error(DDP_ERR_INVALID, "store %s: num_keys: count is NULL", s->address);
  *count = 0;
  ddp_status st = s->ops->num_keys(s, "", count);
  return st == DDP_OK ? st : fail(s, st, "num_keys()");
}

ddp_status ddp_store_list_keys(ddp_store *s, char ***keys, size_t *count) {
  CHECK_STORE(s, "list_keys");
  if (!keys || !count)
    return ddp_error(DDP_ERR_INVALID, "store %s: list_keys: keys and count must not be NULL",
                     s->address);
  *keys = NULL;
  *count = 0;
  ddp_status st = s->ops->list_keys(s, "", keys, count);
  return st == DDP_OK ? st : fail(s, st, "list_keys()");
}

void ddp_store_keys_free(char **keys, size_t count) { ddp__store_free_key_array(keys, count); }

ddp_status ddp_store_append(ddp_store *s, const char *key, const void *value, size_t value_bytes) {
  return put_value(s, "append", s ? s->ops->append : NULL, key, value, value_bytes);
}

ddp_status ddp_store_multi_get(ddp_store *s, const char *const *keys, size_t num_keys,
                               int64_t timeout_ms, ddp_store_value *values) {
  CHECK_STORE(s, "multi_get");
  DDP_TRY(check_keys(s, "multi_get", keys, num_keys));
  if (num_keys && !values)
    return ddp_error(DDP_ERR_INVALID, "store %s: multi_get: values is NULL", s->address);
  for (size_t i = 0; i < num_keys; i++) values[i] = (ddp_store_value){NULL, 0};
  if (num_keys == 0) return DDP_OK;
  ddp_status st = s->ops->multi_get(s, keys, num_keys, resolve_timeout(s, timeout_ms), values);
  if (st == DDP_OK) return st;
  ddp_store_values_free(values, num_keys);
  char call[600];
  calln(call, sizeof call, "multi_get", keys, num_keys);
  return fail(s, st, call);
}

void ddp_store_values_free(ddp_store_value *values, size_t count) {
  if (!values) return;
  for (size_t i = 0; i < count; i++) {
    ddp_free(values[i].data);
    values[i].data = NULL;
    values[i].bytes = 0;
  }
}

ddp_status ddp_store_multi_set(ddp_store *s, const char *const *keys, const ddp_store_value *values,
                               size_t num_keys) {
  CHECK_STORE(s, "multi_set");
  DDP_TRY(check_keys(s, "multi_set", keys, num_keys));
  if (num_keys && !values)
    return ddp_error(DDP_ERR_INVALID, "store %s: multi_set: values is NULL", s->address);
  for (size_t i = 0; i < num_keys; i++)
    DDP_TRY(check_value(s, "multi_set", keys[i], values[i].data, values[i].bytes));
  if (num_keys == 0) return DDP_OK;
  ddp_status st = s->ops->multi_set(s, keys, values, num_keys);
  if (st == DDP_OK) return st;
  char call[600];
  calln(call, sizeof call, "multi_set", keys, num_keys);
  return fail(s, st, call);
}

ddp_status ddp_store_clone(ddp_store *s, ddp_store **out) {
  if (out) *out = NULL;
  CHECK_STORE(s, "clone");
  if (!out) return ddp_error(DDP_ERR_INVALID, "store %s: clone: out is NULL", s->address);
  ddp_status st = s->ops->clone(s, out);
  return st == DDP_OK ? st : fail(s, st, "clone()");
}

ddp_store *ddp_store_retain(ddp_store *s) {
  if (s) __atomic_add_fetch(&s->refs, 1, __ATOMIC_RELAXED);
  return s;
}

void ddp_store_destroy(ddp_store *s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  s->ops->destroy(s);
}

const char *ddp_store_address(const ddp_store *s) { return s ? s->address : "(null)"; }

int64_t ddp_store_timeout_ms(const ddp_store *s) {
  return __atomic_load_n(&s->timeout_ms, __ATOMIC_RELAXED);
}

void ddp_store_set_timeout_ms(ddp_store *s, int64_t timeout_ms) {
  __atomic_store_n(
      &s->timeout_ms,
      timeout_ms > 0 ? ddp__store_clamp_ms(timeout_ms) : ddp_store_default_timeout_ms(),
      __ATOMIC_RELAXED);
}

/* ---- Watches ------------------------------------------------------------- */

ddp_status ddp_store_watch_open(ddp_store *s, const char *const *keys, size_t num_keys,
                                ddp_store_value *initial, ddp_store_watcher **out) {
  if (out) *out = NULL;
  CHECK_STORE(s, "watch");
  if (!out) return ddp_error(DDP_ERR_INVALID, "store %s: watch: out is NULL", s->address);
  DDP_TRY(check_keys(s, "watch", keys, num_keys));
  char call[600];
  calln(call, sizeof call, "watch", keys, num_keys);
  if (num_keys == 0)
    return ddp_error(DDP_ERR_INVALID, "store %s: %s: no keys to watch", s->address, call);
  for (size_t i = 0; i < num_keys; i++)
    for (size_t j = 0; j < i; j++)
      if (!strcmp(keys[i], keys[j]))
        return ddp_error(DDP_ERR_INVALID, "store %s: %s: key \"%s\" is given twice", s->address,
                         call, keys[i]);
  if (!s->ops->watch_open)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "store %s: %s: the %s store has no watches (use a TCP store: ddp-store serve)",
                     s->address, call, s->ops->kind);
  ddp_store_value *snap = initial ? initial : ddp_calloc(num_keys, sizeof *snap);
  if (!snap) return ddp_error(DDP_ERR_NOMEM, "store %s: %s: out of memory", s->address, call);
  for (size_t i = 0; i < num_keys; i++) snap[i] = (ddp_store_value){NULL, 0};
  ddp_store_watcher *w = NULL;
  ddp_status st = s->ops->watch_open(s, keys, num_keys, snap, &w);
  if (!initial) {
    ddp_store_values_free(snap, num_keys);
    ddp_free(snap);
  }
  if (st != DDP_OK) {
    if (initial) ddp_store_values_free(initial, num_keys);
    return fail(s, st, call);
  }
  char label[700];
  snprintf(label, sizeof label, "store %s: %s", s->address, call);
  w->address = ddp_strdup(label);
  w->timeout_ms = ddp_store_timeout_ms(s);
  if (!w->address) {
    w->ops->destroy(w);
    if (initial) ddp_store_values_free(initial, num_keys);
    return ddp_error(DDP_ERR_NOMEM, "store %s: %s: out of memory", s->address, call);
  }
  *out = w;
  return DDP_OK;
}

/* The watch's final error, again, for every call after it failed. */
static ddp_status watch_failed(ddp_store_watcher *w) {
  return ddp_error(w->failed, "%s", w->failed_msg);
}

ddp_status ddp_store_watch_next(ddp_store_watcher *w, int64_t timeout_ms, ddp_store_event *event) {
  if (!w || !event) return ddp_error(DDP_ERR_INVALID, "ddp_store_watch_next: watch or event is NULL");
  memset(event, 0, sizeof *event);
  if (w->failed) return watch_failed(w);
  int64_t t = timeout_ms < 0 ? w->timeout_ms : ddp__store_clamp_ms(timeout_ms);
  ddp_status st = w->ops->next(w, t, event);
  if (st == DDP_OK) {
    event->key += w->strip;
    return st;
  }
  char what[1024];
  snprintf(what, sizeof what, "%s", ddp_last_error()[0] ? ddp_last_error() : ddp_strerror(st));
  memset(event, 0, sizeof *event);
  if (st == DDP_ERR_TIMEOUT) {
    char ms[32];
    ddp__store_format_ms(t, ms, sizeof ms);
    return ddp_error(st, "%s: no change within %s", w->address, ms);
  }
  w->failed = st;
  snprintf(w->failed_msg, sizeof w->failed_msg, "%.700s: %.1000s", w->address, what);
  return watch_failed(w);
}

/* The callback form's thread: next() in slices of a second (close
 * interrupts it sooner), each change to the callback, the final error once. */
static void *watch_thread(void *arg) {
  ddp_store_watcher *w = arg;
  for (;;) {
    ddp_store_event ev;
    ddp_status st = ddp_store_watch_next(w, 1000, &ev);
    if (__atomic_load_n(&w->closing, __ATOMIC_ACQUIRE)) break;
    if (st == DDP_ERR_TIMEOUT) {
      ddp_clear_error();
      continue;
    }
    w->fn(w->ctx, st == DDP_OK ? &ev : NULL, st);
    if (st != DDP_OK) break;
  }
  return NULL;
}

ddp_status ddp_store_watch(ddp_store *s, const char *key, ddp_store_watch_fn fn, void *ctx,
                           ddp_store_value *initial, ddp_store_watcher **out) {
  if (out) *out = NULL;
  CHECK_STORE(s, "watch");
  if (!fn) return ddp_error(DDP_ERR_INVALID, "store %s: watch: the callback is NULL", s->address);
  ddp_store_watcher *w;
  DDP_TRY(ddp_store_watch_open(s, &key, 1, initial, &w));
  w->fn = fn;
  w->ctx = ctx;
  int rc = pthread_create(&w->thread, NULL, watch_thread, w);
  if (rc != 0) {
    ddp_store_watch_close(w);
    if (initial) ddp_store_values_free(initial, 1);
    return ddp_error(DDP_ERR_SYS, "store %s: watch: cannot start its thread: %s", s->address,
                     strerror(rc));
  }
  pthread_setname_np(w->thread, "ddp-watch");
  w->has_thread = 1;
  *out = w;
  return DDP_OK;
}

void ddp_store_watch_close(ddp_store_watcher *w) {
  if (!w) return;
  if (w->has_thread) {
    __atomic_store_n(&w->closing, 1, __ATOMIC_RELEASE);
    w->ops->interrupt(w);
    pthread_join(w->thread, NULL);
  }
  ddp_free(w->address);
  w->ops->destroy(w);
}
