/* ddp store: the rendezvous key-value store (PyTorch's c10d::Store). One
 * abstract handle with TCP (client of a ddp store server), file (shared
 * filesystem), in-process and prefix (namespace) implementations, and the
 * TCP server itself. The wire protocol is in docs/store.md. */
#ifndef DDP_STORE_H
#define DDP_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Conventions ----------------------------------------------------------
 * Keys are NUL-terminated strings of 1..DDP_STORE_MAX_KEY_BYTES bytes (the
 * server may lower the limit). Values are byte strings of any content and
 * 0..DDP_STORE_MAX_VALUE_BYTES bytes. A value returned to the caller is
 * allocated with ddp_alloc, followed by one NUL byte that its length does not
 * count (so text values print directly); the caller frees it with ddp_free.
 *
 * Timeouts are in milliseconds: a negative timeout means the store's default
 * (ddp_store_options.timeout_ms, itself defaulting to DDP_TIMEOUT seconds,
 * 1800 as in PyTorch); 0 means "do not wait" (a blocking call whose keys are
 * missing fails at once with DDP_ERR_TIMEOUT). Timeouts beyond 2^40 ms (~35
 * years) are clamped to it. On a TCP store the server enforces the timeout of
 * get / wait / multi_get; the client gives up 250 ms later if the server has
 * gone silent, and at once if the connection closes (server gone).
 *
 * Errors: every call returns a ddp_status; the last-error message names the
 * store and the call, e.g.
 *   store 10.0.0.1:29500: get("rank/3") timed out after 30 s
 *   store 10.0.0.1:29500: wait(["a", "b"]): connection closed by the store
 *   file store /shared/rdzv: add("count"): value "x" is not an integer
 * Codes: DDP_ERR_TIMEOUT (blocking call ran out of time), DDP_ERR_CLOSED (the
 * server went away), DDP_ERR_AUTH (token refused), DDP_ERR_RANGE (a key,
 * value or message over the limits), DDP_ERR_FORMAT (add on a non-integer
 * value, malformed file or reply), DDP_ERR_INVALID (bad argument),
 * DDP_ERR_ADDRINUSE (server cannot bind), DDP_ERR_IO / DDP_ERR_SYS.
 *
 * Threads: every store handle may be used from several threads at once. A TCP
 * store has one connection, so its calls are serialised: a blocking get on
 * one thread delays the others' calls on the same handle. Threads that block
 * concurrently should each use their own handle (ddp_store_clone). */

#define DDP_STORE_MAX_KEY_BYTES 4096u                     /* default key limit */
#define DDP_STORE_MAX_VALUE_BYTES (64u * 1024u * 1024u)   /* default value limit */
#define DDP_STORE_MAX_MESSAGE_BYTES (80u * 1024u * 1024u) /* default frame limit */
#define DDP_STORE_MAX_KEYS_PER_CALL 65536u                /* wait/check/multi_* */
#define DDP_STORE_MAX_TOKEN_BYTES 1024u
#define DDP_STORE_DEFAULT_PORT 29500
#define DDP_STORE_WATCH_PENDING 1024u                    /* default watch bound */
#define DDP_STORE_WATCH_PENDING_MAX 65536u
#define DDP_STORE_WATCH_PENDING_BYTES (64u * 1024u * 1024u)

/* An opaque store handle: a table of operations behind a pointer (as gloo's
 * rendezvous::Store or ggml's backends). Created by the constructors below,
 * released with ddp_store_destroy. Reference counted: ddp_store_prefix and
 * ddp_store_retain take a reference to their base. */
typedef struct ddp_store ddp_store;

/* A value in multi_get / multi_set. */
typedef struct ddp_store_value {
  void *data;     /* multi_get: ddp_alloc'd, NUL-terminated, caller frees */
  size_t bytes;
} ddp_store_value;

/* Options for client stores. Start from ddp_store_defaults(); every
 * default is zero, so a zero-initialised struct ({0}) means the same, and so
 * does NULL wherever a pointer to options is taken. */
typedef struct ddp_store_options {
  /* Default for blocking calls given a negative timeout; <= 0 -> DDP_TIMEOUT
   * seconds (1800 when unset). */
  int64_t timeout_ms;
  /* How long ddp_store_tcp_connect keeps retrying (exponential backoff with
   * jitter, so the server may start later than its clients); <= 0 ->
   * timeout_ms. */
  int64_t connect_timeout_ms;
  /* Shared secret sent in the handshake. NULL -> $DDP_STORE_TOKEN if set,
   * else none. "" -> explicitly none. */
  const char *token;
  uint64_t reserved[6];
} ddp_store_options;
DDP_STRUCT_SIZE(ddp_store_options, 72);

/* The defaults: timeout_ms and connect_timeout_ms 0 (DDP_TIMEOUT seconds,
 * and the same for connecting), token NULL ($DDP_STORE_TOKEN, else none). */
ddp_store_options ddp_store_defaults(void);

/* The default timeout in ms: $DDP_TIMEOUT seconds, 1800 s when unset. A
 * malformed DDP_TIMEOUT logs a warning and yields the default. */
int64_t ddp_store_default_timeout_ms(void);

/* ---- Constructors -------------------------------------------------------- */

/* Connects to a ddp store server at host:port (a name, IPv4 or IPv6 literal).
 * Retries refused / unreachable connections with exponential backoff (10 ms
 * doubling to 1 s, +-25% jitter) until options.connect_timeout_ms, then fails
 * with DDP_ERR_TIMEOUT naming host:port and the last error. A token mismatch
 * fails at once with DDP_ERR_AUTH. On success *out is a new handle owned by
 * the caller; on failure *out is NULL. */
ddp_status ddp_store_tcp_connect(const char *host, uint16_t port,
                                 const ddp_store_options *options, ddp_store **out);

/* Opens (creating if absent) a store kept in one file on a shared filesystem
 * (PyTorch's FileStore, `file://` init). Every operation takes an fcntl lock
 * (open-file-description locks, so handles in one process exclude each other
 * too); blocking calls poll the file. The file starts with a magic and
 * version; a file of another format is refused with DDP_ERR_FORMAT. The file
 * is not deleted on destroy. */
ddp_status ddp_store_file_open(const char *path, const ddp_store_options *options,
                               ddp_store **out);

/* An in-process store (mutex + condition variable): for tests and the threads
 * transport. Share it between threads by passing the handle (or clones). */
ddp_status ddp_store_mem_create(const ddp_store_options *options, ddp_store **out);

/* A view of `base` where every key is prefixed with `prefix` (e.g. "group3/"),
 * so groups of ranks get their own namespace. Takes a reference to base: the
 * caller may destroy its own base handle afterwards. num_keys and list_keys
 * count only the keys under the prefix (and list them without it). */
ddp_status ddp_store_prefix(ddp_store *base, const char *prefix, ddp_store **out);

/* A second handle on the same store: for TCP a new connection (so two threads
 * can block independently), for file a new open file, for mem and prefix a
 * handle onto the same data. Destroy it separately. */
ddp_status ddp_store_clone(ddp_store *store, ddp_store **out);

/* Adds a reference; every retain needs a ddp_store_destroy. Returns store. */
ddp_store *ddp_store_retain(ddp_store *store);

/* Drops a reference; the last one closes the connection / file and frees the
 * handle. Accepts NULL. */
void ddp_store_destroy(ddp_store *store);

/* Where the store lives, for messages: "10.0.0.1:29500", "file:///path",
 * "mem", or the base's address followed by " prefix \"group3/\"". Valid for
 * the handle's life. */
const char *ddp_store_address(const ddp_store *store);

/* The handle's default timeout (ms), and setting it (<= 0 restores
 * ddp_store_default_timeout_ms()). */
int64_t ddp_store_timeout_ms(const ddp_store *store);
void ddp_store_set_timeout_ms(ddp_store *store, int64_t timeout_ms);

/* ---- Operations ---------------------------------------------------------- */

/* Sets key to value (value_bytes may be 0; value may be NULL then), replacing
 * any old value, and wakes every get / wait blocked on it. */
ddp_status ddp_store_set(ddp_store *store, const char *key, const void *value,
                         size_t value_bytes);

/* Waits until key exists (at most timeout_ms), then returns a copy of its
 * value in *value / *value_bytes (see conventions for ownership). On failure
 * *value is NULL and *value_bytes 0. */
ddp_status ddp_store_get(ddp_store *store, const char *key, int64_t timeout_ms,
                         void **value, size_t *value_bytes);

/* Atomically adds delta to the integer stored at key (a missing key counts as
 * 0) and returns the new value in *result (may be NULL). The value is kept as
 * decimal ASCII ("3"), as in PyTorch, so get returns it as text. A value that
 * is not a decimal int64 fails with DDP_ERR_FORMAT; overflow with
 * DDP_ERR_RANGE. Wakes waiters on key. */
ddp_status ddp_store_add(ddp_store *store, const char *key, int64_t delta, int64_t *result);

/* PyTorch's compareSet, atomically:
 *   key absent,  expected empty      -> key := desired; returns desired
 *   key absent,  expected non-empty  -> nothing set;    returns expected
 *   key present, value == expected   -> key := desired; returns desired
 *   key present, value != expected   -> nothing set;    returns the value
 * The returned bytes go to *current / *current_bytes (caller frees; both may
 * be NULL to ignore them). Wakes waiters when it sets. */
ddp_status ddp_store_compare_set(ddp_store *store, const char *key, const void *expected,
                                 size_t expected_bytes, const void *desired,
                                 size_t desired_bytes, void **current, size_t *current_bytes);

/* Waits until every key exists (at most timeout_ms). num_keys may be 0 (returns
 * at once). The timeout message lists the keys still missing. */
ddp_status ddp_store_wait(ddp_store *store, const char *const *keys, size_t num_keys,
                          int64_t timeout_ms);

/* Without waiting: *all_exist = 1 when every key exists, else 0. */
ddp_status ddp_store_check(ddp_store *store, const char *const *keys, size_t num_keys,
                           int *all_exist);

/* Deletes key; *deleted (may be NULL) = 1 if it existed, else 0. Waiters on
 * the key keep waiting for a later set. */
ddp_status ddp_store_delete(ddp_store *store, const char *key, int *deleted);

/* The number of keys (under the prefix, for a prefix store). Note that add
 * and compare_set create keys like set does. */
ddp_status ddp_store_num_keys(ddp_store *store, int64_t *count);

/* All keys (under the prefix, stripped of it, for a prefix store), in no
 * particular order: *keys is an array of *count strings; free it with
 * ddp_store_keys_free. */
ddp_status ddp_store_list_keys(ddp_store *store, char ***keys, size_t *count);
void ddp_store_keys_free(char **keys, size_t count);

/* Appends value to key's value (creating key if absent). Wakes waiters. */
ddp_status ddp_store_append(ddp_store *store, const char *key, const void *value,
                            size_t value_bytes);

/* Waits until every key exists (at most timeout_ms), then fills values[i] for
 * keys[i] as one consistent snapshot. On failure no values are returned
 * (values[i].data = NULL). Free with ddp_store_values_free. */
ddp_status ddp_store_multi_get(ddp_store *store, const char *const *keys, size_t num_keys,
                               int64_t timeout_ms, ddp_store_value *values);
/* Frees values[i].data for every i and zeroes them. */
void ddp_store_values_free(ddp_store_value *values, size_t count);

/* Sets keys[i] := values[i] for every i atomically (no reader sees half of
 * them), waking waiters. values[i].data is not taken over. */
ddp_status ddp_store_multi_set(ddp_store *store, const char *const *keys,
                               const ddp_store_value *values, size_t num_keys);

/* ---- Watches --------------------------------------------------------------
 * A watch reports every change of its keys, in the order the store applied
 * them, with the new value (PyTorch's TCPStore watchKey, and etcd's watch).
 * A change is every write that reaches a key -- set (even to the same
 * bytes), append, add (except add(key, 0) on an existing key: that is how
 * callers read a counter, and it writes nothing new), compare_set when it
 * sets, each key of multi_set -- and delete of an existing key, reported as
 * kind DDP_STORE_EVENT_DELETE with an empty value.
 *
 * On a TCP store a watch is its own connection: the server pushes the
 * changes to it; nothing polls. The server keeps at most
 * ddp_store_limits.max_watch_pending notifications (and
 * max_watch_pending_bytes) waiting for a watch that does not read; the next
 * change past that drops that watch alone: it gets the changes queued before
 * it, in order, then DDP_ERR_RANGE naming its keys and the bound. A watch
 * whose connection drops gets DDP_ERR_CLOSED. Either error is final for the
 * watch (every later call returns it); open a new one, whose snapshot tells
 * the state again. Other watches and clients are unaffected.
 *
 * The in-process and file stores return DDP_ERR_UNSUPPORTED; a prefix store
 * watches its base's keys under the prefix and reports them without it. */
typedef struct ddp_store_watcher ddp_store_watcher;

typedef enum ddp_store_event_kind {
  DDP_STORE_EVENT_SET = 1,    /* the key has a (new) value */
  DDP_STORE_EVENT_DELETE = 2, /* the key was deleted (value empty) */
} ddp_store_event_kind;

/* One change. key and value point into the watch: valid until the next call
 * on it (or until the callback returns). value is NUL-terminated beyond
 * value_bytes. */
typedef struct ddp_store_event {
  const char *key;    /* one of the watched keys (without a prefix store's prefix) */
  int32_t kind;       /* ddp_store_event_kind */
  int32_t reserved;
  uint64_t seq;       /* 1, 2, 3, ...: changes delivered to this watch, all keys */
  const void *value;
  size_t value_bytes;
} ddp_store_event;

/* Opens a watch on keys[0..num_keys) (1 .. the store's keys per call; no
 * key twice). Atomically with the registration, the current state of each
 * key goes to initial[i] (may be NULL to skip it): data NULL when absent,
 * else a ddp_alloc'd copy (free with ddp_store_values_free). Every change
 * after that snapshot is reported by ddp_store_watch_next. *out is owned by
 * the caller (ddp_store_watch_close). DDP_ERR_UNSUPPORTED for mem and file
 * stores. */
ddp_status ddp_store_watch_open(ddp_store *store, const char *const *keys, size_t num_keys,
                                ddp_store_value *initial, ddp_store_watcher **out);

/* The blocking form: waits at most timeout_ms (0: only what has arrived;
 * negative: the store's default timeout) for the next change and fills
 * *event. DDP_ERR_TIMEOUT when none came (the watch stays good);
 * DDP_ERR_RANGE when the server dropped the watch past its bound,
 * DDP_ERR_CLOSED when its connection dropped (both final). Not for a watch
 * that has a callback. One thread at a time per watch. */
ddp_status ddp_store_watch_next(ddp_store_watcher *watch, int64_t timeout_ms, ddp_store_event *event);

/* Called on the watch's own thread for each change, in order (event non-NULL,
 * status DDP_OK), and once with event NULL and the final error when the watch
 * fails (status and ddp_last_error() say why). Not called after
 * ddp_store_watch_close returns; must not call ddp_store_watch_close itself. */
typedef void (*ddp_store_watch_fn)(void *ctx, const ddp_store_event *event, ddp_status status);

/* The callback form (the ddp_store_watch(store, key, callback)):
 * opens a watch on one key and runs fn for each change on a thread of its
 * own (one client thread per callback watch; the server has none).
 * *initial (may be NULL) gets the key's state at registration as in
 * ddp_store_watch_open. */
ddp_status ddp_store_watch(ddp_store *store, const char *key, ddp_store_watch_fn fn, void *ctx,
                           ddp_store_value *initial, ddp_store_watcher **out);

/* Ends the watch (its connection closes; the server forgets it), joins the
 * callback thread if any, frees it. Accepts NULL. */
void ddp_store_watch_close(ddp_store_watcher *watch);

/* ---- Server -------------------------------------------------------------
 * A single-threaded epoll server holding the key-value table in memory. It
 * serves thousands of clients, checks every length against its limits before
 * trusting it, answers a malformed or oversized message with an error and
 * drops that client only, and times blocking gets / waits out itself (the
 * client's deadline is a safety net). Rank 0 of a job without a launcher
 * hosts it in the training process (ddp_store_server_start); the
 * `ddp-store serve` tool runs it in the foreground (create + run). */
typedef struct ddp_store_server ddp_store_server;

/* Limits enforced by the server, part of ddp_store_server_options; a zero
 * field means the default. The server announces them in its handshake reply
 * so clients fail early and clearly. */
typedef struct ddp_store_limits {
  uint32_t max_key_bytes;        /* default DDP_STORE_MAX_KEY_BYTES */
  uint32_t max_keys_per_call;    /* default DDP_STORE_MAX_KEYS_PER_CALL */
  uint64_t max_value_bytes;      /* default DDP_STORE_MAX_VALUE_BYTES */
  uint64_t max_message_bytes;    /* default DDP_STORE_MAX_MESSAGE_BYTES */
  uint32_t max_clients;          /* default 65536; more are refused */
  /* A watch connection is dropped (DDP_ERR_RANGE to it alone) when a change
   * arrives while this many notifications already wait for it on the server
   * (beyond what its socket took): default DDP_STORE_WATCH_PENDING, at most
   * DDP_STORE_WATCH_PENDING_MAX. */
  uint32_t max_watch_pending;
  uint64_t max_total_bytes;      /* keys + values held; default 4 GiB */
  /* ... or while more than this many bytes of them wait; default
   * DDP_STORE_WATCH_PENDING_BYTES. */
  uint64_t max_watch_pending_bytes;
  uint64_t reserved[3];
} ddp_store_limits;
DDP_STRUCT_SIZE(ddp_store_limits, 72);

/* Start from ddp_store_server_defaults(); every default is zero, so a
 * zero-initialised struct ({0}) means the same, and so does NULL. */
typedef struct ddp_store_server_options {
  /* Required from every client. NULL -> $DDP_STORE_TOKEN if set, else none
   * (any client is accepted). "" -> explicitly none. */
  const char *token;
  ddp_store_limits limits;
  /* A client that has not completed its handshake by then is dropped;
   * <= 0 -> 10 s. */
  int64_t handshake_timeout_ms;
  uint64_t reserved[6];
} ddp_store_server_options;
DDP_STRUCT_SIZE(ddp_store_server_options, 136);

/* The defaults: token NULL ($DDP_STORE_TOKEN, else none), every limit 0 (its
 * default above), handshake_timeout_ms 0 (10 s). */
ddp_store_server_options ddp_store_server_defaults(void);

/* Counters, readable from any thread while the server runs. */
typedef struct ddp_store_server_stats {
  uint64_t clients;            /* connected now */
  uint64_t clients_accepted;   /* since start */
  uint64_t clients_dropped;    /* closed for errors, bad input or auth */
  uint64_t requests;           /* requests served */
  uint64_t keys;               /* keys held now */
  uint64_t waiters;            /* blocked gets / waits now */
  uint64_t watches;            /* watch connections now */
  uint64_t watches_dropped;    /* watch connections dropped past their bound */
  uint64_t reserved[2];
} ddp_store_server_stats;
DDP_STRUCT_SIZE(ddp_store_server_stats, 80);

/* Binds and listens on bind_addr:port (bind_addr NULL or "" -> "0.0.0.0";
 * "::" for IPv6; port 0 picks a free port) without serving yet. A port in
 * use fails with DDP_ERR_ADDRINUSE: "cannot listen on 0.0.0.0:29500: address
 * already in use (another job or a stale process holds it; choose another
 * MASTER_PORT or stop it)". options may be NULL. *out is owned by the caller
 * (ddp_store_server_stop). */
ddp_status ddp_store_server_create(const char *bind_addr, uint16_t port,
                                   const ddp_store_server_options *options,
                                   ddp_store_server **out);

/* Serves in the calling thread until ddp_store_server_shutdown. Returns
 * DDP_OK after a shutdown, or an error if the event loop itself fails. */
ddp_status ddp_store_server_run(ddp_store_server *server);

/* Asks run to return (it closes every client first). Thread-safe and
 * async-signal-safe: a SIGINT/SIGTERM handler may call it. */
void ddp_store_server_shutdown(ddp_store_server *server);

/* create + run on a background thread (named "ddp-store"). */
ddp_status ddp_store_server_start(const char *bind_addr, uint16_t port,
                                  const ddp_store_server_options *options,
                                  ddp_store_server **out);

/* Shuts down, joins the background thread if any, closes the socket and frees
 * the server. Not to be called while another thread is inside run (except
 * the server's own background thread). Accepts NULL. */
void ddp_store_server_stop(ddp_store_server *server);

/* The port actually bound (the chosen one when created with port 0). */
uint16_t ddp_store_server_port(const ddp_store_server *server);
/* "HOST:PORT" as bound ("0.0.0.0:29500", "[::1]:41234"). */
const char *ddp_store_server_address(const ddp_store_server *server);
void ddp_store_server_get_stats(const ddp_store_server *server, ddp_store_server_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_STORE_H */
