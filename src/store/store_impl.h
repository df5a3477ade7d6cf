/* The inside of a ddp_store handle: a table of operations that each store kind
 * (tcp, file, mem, prefix) fills in. The public functions in store.c check
 * arguments, resolve timeouts and name the store and the call in errors, so
 * implementations see valid arguments and report only what went wrong
 * ("timed out after 200 ms", "connection closed by the store"). */
#ifndef DDP_STORE_IMPL_H
#define DDP_STORE_IMPL_H

#include <pthread.h>

#include "ddp/store.h"

typedef struct ddp__store_ops {
  const char *kind; /* "tcp", "file", "mem", "prefix" */
  ddp_status (*set)(ddp_store *s, const char *key, const void *value, size_t value_bytes);
  /* timeout_ms >= 0 here (already resolved). */
  ddp_status (*get)(ddp_store *s, const char *key, int64_t timeout_ms, void **value,
                    size_t *value_bytes);
  ddp_status (*add)(ddp_store *s, const char *key, int64_t delta, int64_t *result);
  ddp_status (*compare_set)(ddp_store *s, const char *key, const void *expected,
                            size_t expected_bytes, const void *desired, size_t desired_bytes,
                            void **current, size_t *current_bytes);
  ddp_status (*wait)(ddp_store *s, const char *const *keys, size_t num_keys, int64_t timeout_ms);
  ddp_status (*check)(ddp_store *s, const char *const *keys, size_t num_keys, int *all_exist);
  ddp_status (*del)(ddp_store *s, const char *key, int *deleted);
  /* Keys starting with prefix ("" for all). */
  ddp_status (*num_keys)(ddp_store *s, const char *prefix, int64_t *count);
  /* Full keys starting with prefix, as ddp_alloc'd strings in a ddp_alloc'd
   * array (ddp_store_keys_free). */
  ddp_status (*list_keys)(ddp_store *s, const char *prefix, char ***keys, size_t *count);
  ddp_status (*append)(ddp_store *s, const char *key, const void *value, size_t value_bytes);
  ddp_status (*multi_get)(ddp_store *s, const char *const *keys, size_t num_keys,
                          int64_t timeout_ms, ddp_store_value *values);
  ddp_status (*multi_set)(ddp_store *s, const char *const *keys, const ddp_store_value *values,
                          size_t num_keys);
  ddp_status (*clone)(ddp_store *s, ddp_store **out);
  /* NULL: the store has no watches (DDP_ERR_UNSUPPORTED). keys are full
   * keys; initial is non-NULL and zeroed (see ddp_store_watch_open). */
  ddp_status (*watch_open)(ddp_store *s, const char *const *keys, size_t num_keys,
                           ddp_store_value *initial, ddp_store_watcher **out);
  /* Frees the implementation (the last reference is gone). */
  void (*destroy)(ddp_store *s);
} ddp__store_ops;

/* Embedded first in every implementation's struct. */
struct ddp_store {
  const ddp__store_ops *ops;
  int refs;           /* atomic */
  int64_t timeout_ms; /* atomic; resolved default for negative timeouts */
  char *address;      /* for messages; owned */
};

/* The inside of a watch: the implementation's next / close, and what
 * store.c adds around them (the key prefix to strip, the callback thread, the
 * final error that every later call returns). */
typedef struct ddp__watch_ops {
  /* timeout_ms >= 0. Fills event->key with the full key. */
  ddp_status (*next)(ddp_store_watcher *w, int64_t timeout_ms, ddp_store_event *event);
  /* Makes a next() blocked on another thread return soon (shutdown). */
  void (*interrupt)(ddp_store_watcher *w);
  void (*destroy)(ddp_store_watcher *w);
} ddp__watch_ops;

struct ddp_store_watcher {
  const ddp__watch_ops *ops;
  char *address;      /* "store ADDR: watch([keys])" for messages; owned */
  int64_t timeout_ms; /* the store's default, for negative timeouts */
  size_t strip;       /* bytes of prefix to drop from event keys */
  ddp_status failed;  /* the final error, once there is one */
  char failed_msg[1800];
  /* The callback form. */
  ddp_store_watch_fn fn;
  void *ctx;
  int closing; /* atomic */
  int has_thread;
  pthread_t thread;
};

/* The public calls fill the rest (address, timeout, strip) after the
 * implementation's watch_open returns its zeroed struct with ops set. */

/* Timeouts are clamped to this (about 35 years) so that deadlines in
 * nanoseconds cannot overflow. */
#define DDP__STORE_MAX_TIMEOUT_MS (1LL << 40)
static inline int64_t ddp__store_clamp_ms(int64_t ms) {
  return ms > DDP__STORE_MAX_TIMEOUT_MS ? DDP__STORE_MAX_TIMEOUT_MS : ms;
}

/* Fills the common part: one reference, the options' timeout, a copy of the
 * address. DDP_ERR_NOMEM if the copy fails. */
ddp_status ddp__store_init(ddp_store *s, const ddp__store_ops *ops,
                           const ddp_store_options *options, const char *address);
/* Frees the common part (the address); implementations call it last. */
void ddp__store_fini(ddp_store *s);

/* The token the options ask for: options->token, else $DDP_STORE_TOKEN, else
 * NULL (none); "" means none. */
const char *ddp__store_token(const char *option_token);

/* Formats a duration for messages: "200 ms", "30 s", "1.5 s". */
void ddp__store_format_ms(int64_t ms, char *buf, size_t buf_bytes);

/* The key-list helper that wait/check messages use: ["a", "b", ...] with at
 * most a few keys shown, non-printable bytes escaped. */
void ddp__store_format_keys(const char *const *keys, size_t num_keys, char *buf, size_t buf_bytes);

/* The DDP_ERR_TIMEOUT of a local blocking call (mem, file): "timed out
 * after 200 ms", plus "(missing "k" and maybe others)" when it waited for
 * several keys; keys[miss] is one still missing. */
ddp_status ddp__store_keys_timeout(int64_t timeout_ms, const char *const *keys, size_t n,
                                   size_t miss);

/* Sleeps ms milliseconds (EINTR resumes the sleep). */
void ddp__store_sleep_ms(int64_t ms);

/* Frees a keys array of which the first `count` entries are filled. */
void ddp__store_free_key_array(char **keys, size_t count);

#endif /* DDP_STORE_IMPL_H */
