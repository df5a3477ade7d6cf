/* The TCP store client: one blocking connection to a ddp store server, one
 * request and one reply at a time under a mutex. Connecting retries with
 * exponential backoff and jitter until the connect timeout, so workers may
 * start before rank 0's server. Blocking calls send their timeout to the
 * server, which answers "timed out" itself; the client waits a little longer
 * (CLIENT_GRACE_MS) as a safety net against a server that stopped answering,
 * and a dead server shows up at once as a closed connection. After any
 * transport failure the connection is dropped and the next call reconnects. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "net/net.h"
#include "store/protocol.h"
#include "store/store_impl.h"
#include "store/table.h"

#define CLIENT_GRACE_MS 250
#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000

typedef struct tcp_store {
  ddp_store base;
  pthread_mutex_t mu;
  char *host;
  uint16_t port;
  char *token; /* NULL: none */
  int64_t connect_timeout_ms;
  int fd; /* -1: not connected */
  /* The server's limits, from its hello reply. */
  uint32_t max_key_bytes;
  uint32_t max_keys_per_call;
  uint64_t max_value_bytes;
  uint64_t max_message_bytes;
  ddp__buf out;        /* the request being sent */
  ddp__buf in;         /* the reply frame */
  const uint8_t *body; /* into `in`: the reply body */
  size_t body_len;
  int64_t recv_timeout_ms; /* SO_RCVTIMEO now set; -1 none */
} tcp_store;

static tcp_store *as_tcp(ddp_store *s) { return (tcp_store *)s; }

static void disconnect(tcp_store *t) {
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
}

/* Sets the socket's receive timeout (SO_RCVTIMEO). */
static void set_recv_timeout(tcp_store *t, int64_t ms) {
  struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000; /* 0 would mean forever */
  t->recv_timeout_ms = setsockopt(t->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 ? ms : -1;
}

/* Reads one reply frame into t->in (t->body, t->body_len). When the call's
 * budget is the handle's default timeout -- every non-blocking call -- the
 * first read is one blocking recv, the socket's receive timeout (set at
 * connect) bounding it; otherwise, and for anything after it (a large reply),
 * poll waits until deadline_ns. */
static ddp_status read_reply(tcp_store *t, int64_t deadline_ns, int64_t budget_ms) {
  t->in.len = 0;
  ddp__buf_reserve(&t->in, 4096);
  if (t->in.failed) {
    t->in.failed = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  if (budget_ms == t->recv_timeout_ms) {
    ssize_t n = recv(t->fd, t->in.data, t->in.cap, 0);
    if (n > 0) t->in.len = (size_t)n;
    else if (n == 0) return ddp_error(DDP_ERR_CLOSED, "connection closed by the peer");
    else if (errno == ECONNRESET || errno == EPIPE || errno == ENOTCONN)
      return ddp_error(DDP_ERR_CLOSED, "connection reset by the peer");
    else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
      return ddp_error(DDP_ERR_IO, "recv: %s", strerror(errno));
    /* EINTR / EAGAIN: the poll loop below decides against the deadline. */
  }
  size_t want = DDP__STORE_FRAME_HEADER;
  for (;;) {
    if (t->in.len >= DDP__STORE_FRAME_HEADER) {
      uint32_t body = ddp__load_u32(t->in.data);
      if (body == 0 || body > t->max_message_bytes + 1024)
        return ddp_error(DDP_ERR_FORMAT, "malformed reply from the store (frame of %u bytes)",
                         body);
      want = DDP__STORE_FRAME_HEADER + (size_t)body;
    }
    if (t->in.len >= want) break;
    ddp__buf_reserve(&t->in, want - t->in.len);
    if (t->in.failed) {
      t->in.failed = 0;
      return ddp_error(DDP_ERR_NOMEM, "out of memory for a reply of %zu bytes", want);
    }
    size_t got;
    DDP_TRY(ddp__net_read_some(t->fd, t->in.data + t->in.len, t->in.cap - t->in.len, &got,
                               deadline_ns));
    t->in.len += got;
  }
  /* One request is outstanding, so one frame arrives; more is a broken server. */
  if (t->in.len != want)
    return ddp_error(DDP_ERR_FORMAT, "malformed reply from the store (%zu unexpected bytes)",
                     t->in.len - want);
  t->body = t->in.data + DDP__STORE_FRAME_HEADER;
  t->body_len = want - DDP__STORE_FRAME_HEADER;
  return DDP_OK;
}

/* The status a non-OK reply code stands for. */
static ddp_status status_of(uint8_t code) {
  switch (code) {
    case DDP__WIRE_TIMEOUT: return DDP_ERR_TIMEOUT;
    case DDP__WIRE_AUTH: return DDP_ERR_AUTH;
    case DDP__WIRE_TOO_LARGE: return DDP_ERR_RANGE;
    case DDP__WIRE_NOT_INTEGER: return DDP_ERR_FORMAT;
    case DDP__WIRE_OVERFLOW: return DDP_ERR_RANGE;
    case DDP__WIRE_FULL: return DDP_ERR_NOMEM;
    case DDP__WIRE_VERSION: return DDP_ERR_UNSUPPORTED;
    case DDP__WIRE_WATCH_DROPPED: return DDP_ERR_RANGE;
    default: return DDP_ERR_PEER;
  }
}

/* The error of a non-OK reply body, with the server's message. */
static ddp_status reply_error(const uint8_t *body, size_t len) {
  ddp__reader r = {body + 1, body + len, 0};
  ddp__slice msg = ddp__rd_bytes(&r, 4096);
  char text[600];
  snprintf(text, sizeof text, "%.*s", r.bad ? 0 : (int)msg.len, r.bad ? "" : (const char *)msg.data);
  return ddp_error(status_of(body[0]), "%s", text[0] ? text : "the store refused the request");
}

/* Sends t->out and reads the reply; maps a non-OK reply to a status with the
 * server's message. Transport failures drop the connection. */
static ddp_status exchange(tcp_store *t, int64_t deadline_ns, int64_t budget_ms,
                           int64_t blocking_timeout_ms) {
  ddp_status st = ddp__net_write_full(t->fd, t->out.data, t->out.len, deadline_ns);
  if (st == DDP_OK) st = read_reply(t, deadline_ns, budget_ms);
  if (st != DDP_OK) {
    disconnect(t);
    if (st == DDP_ERR_TIMEOUT) {
      char ms[32];
      ddp__store_format_ms(
          blocking_timeout_ms >= 0 ? blocking_timeout_ms : ddp_store_timeout_ms(&t->base), ms,
          sizeof ms);
      return ddp_error(st, "timed out after %s (no reply from the store)", ms);
    }
    if (st == DDP_ERR_CLOSED) {
      char why[256];
      snprintf(why, sizeof why, "%s", ddp_last_error());
      return ddp_error(st, "connection closed by the store (%s; is the server still running?)",
                       why);
    }
    return st;
  }
  uint8_t code = t->body[0];
  if (code == DDP__WIRE_OK) return DDP_OK;
  ddp__reader r = {t->body + 1, t->body + t->body_len, 0};
  ddp__slice msg = ddp__rd_bytes(&r, 4096);
  char text[600];
  snprintf(text, sizeof text, "%.*s", r.bad ? 0 : (int)msg.len,
           r.bad ? "" : (const char *)msg.data);
  st = status_of(code);
  /* The server closes the connection after a protocol-level refusal. */
  if (code == DDP__WIRE_MALFORMED || code == DDP__WIRE_TOO_LARGE || code == DDP__WIRE_AUTH ||
      code == DDP__WIRE_VERSION || code == DDP__WIRE_STATE)
    disconnect(t);
  return ddp_error(st, "%s", text[0] ? text : "the store refused the request");
}

static ddp_status handshake(tcp_store *t, int64_t deadline_ns) {
  t->out.len = 0;
  ddp__store_encode_hello(&t->out, t->token);
  if (t->out.failed) {
    t->out.failed = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  t->max_message_bytes = DDP_STORE_MAX_MESSAGE_BYTES; /* until the server says */
  DDP_TRY(exchange(t, deadline_ns, (deadline_ns - ddp_time_ns()) / 1000000 + 1, -1));
  ddp__reader r = {t->body + 1, t->body + t->body_len, 0};
  uint32_t version = ddp__rd_u32(&r);
  uint32_t max_key = ddp__rd_u32(&r);
  uint32_t max_keys = ddp__rd_u32(&r);
  int64_t max_value = ddp__rd_i64(&r);
  int64_t max_message = ddp__rd_i64(&r);
  if (r.bad || version != DDP__STORE_VERSION || max_key == 0 || max_value < 0 || max_message <= 0) {
    disconnect(t);
    return ddp_error(DDP_ERR_FORMAT, "malformed hello reply from the store (not a ddp store?)");
  }
  t->max_key_bytes = max_key;
  t->max_keys_per_call = max_keys;
  t->max_value_bytes = (uint64_t)max_value;
  t->max_message_bytes = (uint64_t)max_message;
  return DDP_OK;
}

/* A thread's own jitter source (threads reconnecting together must not
 * retry in lockstep). */
static uint64_t jitter_next(void) {
  static __thread ddp_rng rng;
  static __thread int seeded;
  if (!seeded) {
    ddp_rng_seed(&rng, (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)&rng);
    seeded = 1;
  }
  return ddp_rng_next(&rng);
}

/* Connects and shakes hands, retrying until deadline_ns. */
static ddp_status connect_retry(tcp_store *t, int64_t deadline_ns) {
  int64_t start = ddp_time_ns();
  int64_t backoff = BACKOFF_FIRST_MS;
  char last[512] = "";
  int attempts = 0;
  for (;;) {
    attempts++;
    int fd;
    ddp_status st = ddp__net_connect(t->host, t->port, deadline_ns, &fd);
    if (st == DDP_OK) {
      t->fd = fd;
      t->recv_timeout_ms = -1;
      st = handshake(t, deadline_ns);
      if (st == DDP_OK) return DDP_OK;
      disconnect(t);
      /* A refusal is final; a connection closed during the handshake (server
       * starting or full) is worth another try. */
      if (st != DDP_ERR_CLOSED && st != DDP_ERR_TIMEOUT) return st;
    }
    snprintf(last, sizeof last, "%s", ddp_last_error());
    int64_t left_ms = (deadline_ns - ddp_time_ns()) / 1000000LL;
    if (left_ms <= 0) break;
    /* +-25% jitter around the current backoff. */
    int64_t sleep = backoff * 3 / 4 + (int64_t)(jitter_next() % (uint64_t)(backoff / 2 + 1));
    if (sleep > left_ms) sleep = left_ms;
    if (attempts == 1 || attempts % 20 == 0)
      DDP_DEBUG("store %s: not reachable yet (%s); retrying", t->base.address, last);
    ddp__store_sleep_ms(sleep);
    backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
  }
  char ms[32];
  ddp__store_format_ms((ddp_time_ns() - start) / 1000000LL, ms, sizeof ms);
  return ddp_error(DDP_ERR_TIMEOUT, "cannot connect within %s after %d attempts (last error: %s)",
                   ms, attempts, last[0] ? last : "timed out");
}

/* Runs the request in t->out: (re)connects if needed, then exchanges.
 * blocking_timeout_ms >= 0 for get / wait / multi_get (the server enforces
 * it; we allow CLIENT_GRACE_MS more), -1 for the others (the store's default
 * timeout bounds them). */
static ddp_status run(tcp_store *t, int64_t blocking_timeout_ms) {
  if (t->out.failed) {
    t->out.failed = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory encoding the request");
  }
  if (t->out.len - DDP__STORE_FRAME_HEADER > t->max_message_bytes)
    return ddp_error(DDP_ERR_RANGE,
                     "request of %zu bytes exceeds the store's message limit of %" PRIu64,
                     t->out.len, t->max_message_bytes);
  int64_t start = ddp_time_ns();
  /* Every call's reply may take its timeout plus the grace; a call with the
   * handle's default timeout (all non-blocking ones, and blocking ones given
   * a negative timeout) then matches the socket's receive timeout and reads
   * its reply with one blocking recv. */
  int64_t default_ms = ddp_store_timeout_ms(&t->base) + CLIENT_GRACE_MS;
  int64_t budget_ms = blocking_timeout_ms >= 0 ? blocking_timeout_ms + CLIENT_GRACE_MS : default_ms;
  int64_t deadline = start + budget_ms * 1000000LL;
  if (t->fd < 0) {
    /* Reconnect within both the call's and the connect timeout. */
    int64_t cd = start + t->connect_timeout_ms * 1000000LL;
    ddp__buf saved = t->out; /* the handshake reuses t->out */
    t->out = (ddp__buf){0};
    ddp_status st = connect_retry(t, cd < deadline ? cd : deadline);
    ddp__buf_free(&t->out);
    t->out = saved;
    if (st != DDP_OK) return st;
  }
  if (t->recv_timeout_ms != default_ms) set_recv_timeout(t, default_ms);
  return exchange(t, deadline, budget_ms, blocking_timeout_ms);
}

static void begin(tcp_store *t, uint8_t op) {
  t->out.len = 0;
  t->out.failed = 0;
  ddp__buf_frame_begin(&t->out);
  ddp__buf_u8(&t->out, op);
}

static void finish(tcp_store *t) { ddp__buf_frame_end(&t->out, 0); }

/* Checks a key and a value against the server's limits. */
static ddp_status limits_ok(const tcp_store *t, const char *key, size_t value_bytes) {
  size_t klen = key ? strlen(key) : 0;
  if (klen > t->max_key_bytes)
    return ddp_error(DDP_ERR_RANGE, "key of %zu bytes exceeds the store's limit of %u", klen,
                     t->max_key_bytes);
  if (value_bytes > t->max_value_bytes)
    return ddp_error(DDP_ERR_RANGE, "value of %zu bytes exceeds the store's limit of %" PRIu64,
                     value_bytes, t->max_value_bytes);
  return DDP_OK;
}

static ddp_status keys_ok(const tcp_store *t, const char *const *keys, size_t n) {
  if (n > t->max_keys_per_call)
    return ddp_error(DDP_ERR_RANGE, "%zu keys exceed the store's limit of %u per call", n,
                     t->max_keys_per_call);
  for (size_t i = 0; i < n; i++) DDP_TRY(limits_ok(t, keys[i], 0));
  return DDP_OK;
}

static void put_key(tcp_store *t, const char *key) { ddp__buf_bytes(&t->out, key, strlen(key)); }

static void put_keys(tcp_store *t, const char *const *keys, size_t n) {
  ddp__buf_u32(&t->out, (uint32_t)n);
  for (size_t i = 0; i < n; i++) put_key(t, keys[i]);
}

/* The reply after its status byte. */
static ddp__reader reply(const tcp_store *t) {
  return (ddp__reader){t->body + 1, t->body + t->body_len, 0};
}

static ddp_status bad_reply(tcp_store *t, const char *op) {
  disconnect(t);
  return ddp_error(DDP_ERR_FORMAT, "malformed %s reply from the store", op);
}

/* Copies a length-prefixed value out of the reply. */
static ddp_status take_value(tcp_store *t, ddp__reader *r, const char *op, void **value,
                             size_t *bytes) {
  ddp__slice v = ddp__rd_bytes(r, t->body_len);
  if (r->bad) return bad_reply(t, op);
  *value = ddp__store_copy_value(v.data, v.len);
  if (!*value) return ddp_error(DDP_ERR_NOMEM, "out of memory for a value of %zu bytes", v.len);
  *bytes = v.len;
  return DDP_OK;
}

#define LOCKED(t, expr)             \
  do {                              \
    pthread_mutex_lock(&(t)->mu);   \
    ddp_status locked_st_ = (expr); \
    pthread_mutex_unlock(&(t)->mu); \
    return locked_st_;              \
  } while (0)

static ddp_status do_set(tcp_store *t, uint8_t op, const char *key, const void *v, size_t n) {
  DDP_TRY(limits_ok(t, key, n));
  begin(t, op);
  ddp__buf_reserve(&t->out, strlen(key) + n + 16);
  put_key(t, key);
  ddp__buf_bytes(&t->out, v, n);
  finish(t);
  return run(t, -1);
}

static ddp_status tcp_set(ddp_store *s, const char *key, const void *v, size_t n) {
  LOCKED(as_tcp(s), do_set(as_tcp(s), DDP__OP_SET, key, v, n));
}

static ddp_status tcp_append(ddp_store *s, const char *key, const void *v, size_t n) {
  LOCKED(as_tcp(s), do_set(as_tcp(s), DDP__OP_APPEND, key, v, n));
}

static ddp_status do_get(tcp_store *t, const char *key, int64_t timeout_ms, void **v, size_t *n) {
  DDP_TRY(limits_ok(t, key, 0));
  begin(t, DDP__OP_GET);
  ddp__buf_i64(&t->out, timeout_ms);
  put_key(t, key);
  finish(t);
  DDP_TRY(run(t, timeout_ms));
  ddp__reader r = reply(t);
  return take_value(t, &r, "get", v, n);
}

static ddp_status tcp_get(ddp_store *s, const char *key, int64_t timeout_ms, void **v, size_t *n) {
  LOCKED(as_tcp(s), do_get(as_tcp(s), key, timeout_ms, v, n));
}

static ddp_status do_add(tcp_store *t, const char *key, int64_t delta, int64_t *result) {
  DDP_TRY(limits_ok(t, key, 0));
  begin(t, DDP__OP_ADD);
  put_key(t, key);
  ddp__buf_i64(&t->out, delta);
  finish(t);
  DDP_TRY(run(t, -1));
  ddp__reader r = reply(t);
  *result = ddp__rd_i64(&r);
  return r.bad ? bad_reply(t, "add") : DDP_OK;
}

static ddp_status tcp_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
  LOCKED(as_tcp(s), do_add(as_tcp(s), key, delta, result));
}

static ddp_status do_compare_set(tcp_store *t, const char *key, const void *e, size_t en,
                                 const void *d, size_t dn, void **c, size_t *cn) {
  DDP_TRY(limits_ok(t, key, en));
  DDP_TRY(limits_ok(t, key, dn));
  begin(t, DDP__OP_COMPARE_SET);
  put_key(t, key);
  ddp__buf_bytes(&t->out, e, en);
  ddp__buf_bytes(&t->out, d, dn);
  finish(t);
  DDP_TRY(run(t, -1));
  ddp__reader r = reply(t);
  return take_value(t, &r, "compare_set", c, cn);
}

static ddp_status tcp_compare_set(ddp_store *s, const char *key, const void *e, size_t en,
                                  const void *d, size_t dn, void **c, size_t *cn) {
  LOCKED(as_tcp(s), do_compare_set(as_tcp(s), key, e, en, d, dn, c, cn));
}

static ddp_status do_keys_op(tcp_store *t, uint8_t op, const char *const *keys, size_t n,
                             int64_t timeout_ms) {
  DDP_TRY(keys_ok(t, keys, n));
  begin(t, op);
  if (op != DDP__OP_CHECK) ddp__buf_i64(&t->out, timeout_ms);
  put_keys(t, keys, n);
  finish(t);
  return run(t, op == DDP__OP_CHECK ? -1 : timeout_ms);
}

static ddp_status do_wait(tcp_store *t, const char *const *keys, size_t n, int64_t timeout_ms) {
  return do_keys_op(t, DDP__OP_WAIT, keys, n, timeout_ms);
}

static ddp_status tcp_wait(ddp_store *s, const char *const *keys, size_t n, int64_t timeout_ms) {
  LOCKED(as_tcp(s), do_wait(as_tcp(s), keys, n, timeout_ms));
}

static ddp_status do_check(tcp_store *t, const char *const *keys, size_t n, int *all) {
  DDP_TRY(do_keys_op(t, DDP__OP_CHECK, keys, n, -1));
  ddp__reader r = reply(t);
  *all = ddp__rd_u8(&r) != 0;
  return r.bad ? bad_reply(t, "check") : DDP_OK;
}

static ddp_status tcp_check(ddp_store *s, const char *const *keys, size_t n, int *all) {
  LOCKED(as_tcp(s), do_check(as_tcp(s), keys, n, all));
}

/* A request of one key (or prefix) answered at once (no waiting). */
static ddp_status do_key_op(tcp_store *t, uint8_t op, const char *key) {
  DDP_TRY(limits_ok(t, key, 0));
  begin(t, op);
  put_key(t, key);
  finish(t);
  return run(t, -1);
}

static ddp_status do_del(tcp_store *t, const char *key, int *deleted) {
  DDP_TRY(do_key_op(t, DDP__OP_DELETE, key));
  ddp__reader r = reply(t);
  *deleted = ddp__rd_u8(&r) != 0;
  return r.bad ? bad_reply(t, "delete") : DDP_OK;
}

static ddp_status tcp_del(ddp_store *s, const char *key, int *deleted) {
  LOCKED(as_tcp(s), do_del(as_tcp(s), key, deleted));
}

static ddp_status do_num_keys(tcp_store *t, const char *prefix, int64_t *count) {
  DDP_TRY(do_key_op(t, DDP__OP_NUM_KEYS, prefix));
  ddp__reader r = reply(t);
  *count = ddp__rd_i64(&r);
  return r.bad ? bad_reply(t, "num_keys") : DDP_OK;
}

static ddp_status tcp_num_keys(ddp_store *s, const char *prefix, int64_t *count) {
  LOCKED(as_tcp(s), do_num_keys(as_tcp(s), prefix, count));
}

static ddp_status do_list_keys(tcp_store *t, const char *prefix, char ***keys, size_t *count) {
  DDP_TRY(do_key_op(t, DDP__OP_LIST_KEYS, prefix));
  ddp__reader r = reply(t);
  uint32_t n = ddp__rd_u32(&r);
  if (r.bad || (uint64_t)n * 4 > (uint64_t)(r.end - r.p)) return bad_reply(t, "list_keys");
  char **out = ddp_calloc(n ? n : 1, sizeof *out);
  if (!out) return ddp_error(DDP_ERR_NOMEM, "out of memory for %u keys", n);
  for (uint32_t i = 0; i < n; i++) {
    ddp__slice k = ddp__rd_bytes(&r, t->max_key_bytes);
    if (r.bad) {
      ddp__store_free_key_array(out, i);
      return bad_reply(t, "list_keys");
    }
    out[i] = ddp__store_copy_value(k.data, k.len);
    if (!out[i]) {
      ddp__store_free_key_array(out, i);
      return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
  }
  *keys = out;
  *count = n;
  return DDP_OK;
}

static ddp_status tcp_list_keys(ddp_store *s, const char *prefix, char ***keys, size_t *count) {
  LOCKED(as_tcp(s), do_list_keys(as_tcp(s), prefix, keys, count));
}

static ddp_status do_multi_get(tcp_store *t, const char *const *keys, size_t n, int64_t timeout_ms,
                               ddp_store_value *values) {
  DDP_TRY(do_keys_op(t, DDP__OP_MULTI_GET, keys, n, timeout_ms));
  ddp__reader r = reply(t);
  uint32_t got = ddp__rd_u32(&r);
  if (r.bad || got != n) return bad_reply(t, "multi_get");
  for (size_t i = 0; i < n; i++) {
    ddp_status st = take_value(t, &r, "multi_get", &values[i].data, &values[i].bytes);
    if (st != DDP_OK) return st; /* the caller frees what was filled */
  }
  return DDP_OK;
}

static ddp_status tcp_multi_get(ddp_store *s, const char *const *keys, size_t n, int64_t timeout_ms,
                                ddp_store_value *values) {
  LOCKED(as_tcp(s), do_multi_get(as_tcp(s), keys, n, timeout_ms, values));
}

static ddp_status do_multi_set(tcp_store *t, const char *const *keys, const ddp_store_value *values,
                               size_t n) {
  DDP_TRY(keys_ok(t, keys, n));
  for (size_t i = 0; i < n; i++) DDP_TRY(limits_ok(t, keys[i], values[i].bytes));
  begin(t, DDP__OP_MULTI_SET);
  ddp__buf_u32(&t->out, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    put_key(t, keys[i]);
    ddp__buf_bytes(&t->out, values[i].data, values[i].bytes);
  }
  finish(t);
  return run(t, -1);
}

static ddp_status tcp_multi_set(ddp_store *s, const char *const *keys,
                                const ddp_store_value *values, size_t n) {
  LOCKED(as_tcp(s), do_multi_set(as_tcp(s), keys, values, n));
}

static ddp_status tcp_clone(ddp_store *s, ddp_store **out) {
  tcp_store *t = as_tcp(s);
  ddp_store_options o = {
      .timeout_ms = ddp_store_timeout_ms(s),
      .connect_timeout_ms = t->connect_timeout_ms,
      .token = t->token ? t->token : "",
  };
  return ddp_store_tcp_connect(t->host, t->port, &o, out);
}

static void tcp_destroy(ddp_store *s) {
  tcp_store *t = as_tcp(s);
  disconnect(t);
  ddp__buf_free(&t->out);
  ddp__buf_free(&t->in);
  ddp_free(t->host);
  ddp_free(t->token);
  pthread_mutex_destroy(&t->mu);
  ddp__store_fini(s);
  ddp_free(t);
}

/* ---- Watches -------------------------------------------------------------
 * A watch is a connection of its own (a clone of the handle's): it sends one
 * WATCH request, reads the snapshot, and from then on only reads the changes
 * the server pushes. Frames may arrive back to back, so it keeps what it
 * read past the current frame. */
typedef struct tcp_watch {
  ddp_store_watcher base;
  ddp_store *conn; /* a tcp_store of its own */
  ddp__buf in;     /* frames read; the first `used` bytes were handed out */
  size_t used;
  ddp__buf event;  /* the current event: key NUL value NUL */
} tcp_watch;

/* The next frame's body, reading until deadline_ns. */
static ddp_status watch_frame(tcp_watch *w, int64_t deadline_ns, const uint8_t **body,
                              size_t *len) {
  tcp_store *t = as_tcp(w->conn);
  if (w->used) {
    ddp__buf_consume(&w->in, w->used);
    w->used = 0;
  }
  for (;;) {
    size_t need = DDP__STORE_FRAME_HEADER;
    if (w->in.len >= DDP__STORE_FRAME_HEADER) {
      uint32_t n = ddp__load_u32(w->in.data);
      if (n == 0 || n > t->max_message_bytes + 1024)
        return ddp_error(DDP_ERR_FORMAT, "malformed frame from the store (%u bytes)", n);
      if (w->in.len >= DDP__STORE_FRAME_HEADER + (size_t)n) {
        *body = w->in.data + DDP__STORE_FRAME_HEADER;
        *len = n;
        w->used = DDP__STORE_FRAME_HEADER + (size_t)n;
        return DDP_OK;
      }
      need = DDP__STORE_FRAME_HEADER + (size_t)n;
    }
    size_t want = need - w->in.len;
    ddp__buf_reserve(&w->in, want > 65536 ? want : 65536);
    if (w->in.failed) {
      w->in.failed = 0;
      return ddp_error(DDP_ERR_NOMEM, "out of memory for a frame of %zu bytes", need);
    }
    size_t got;
    ddp_status st = ddp__net_read_some(t->fd, w->in.data + w->in.len, w->in.cap - w->in.len, &got,
                                       deadline_ns);
    if (st == DDP_ERR_CLOSED)
      return ddp_error(st, "connection closed by the store (%s; is the server still running?)",
                       ddp_last_error());
    DDP_TRY(st);
    w->in.len += got;
  }
}

static ddp_status tcp_watch_next(ddp_store_watcher *base, int64_t timeout_ms, ddp_store_event *ev) {
  tcp_watch *w = (tcp_watch *)base;
  const uint8_t *body;
  size_t len;
  DDP_TRY(watch_frame(w, ddp_time_ns() + timeout_ms * 1000000LL, &body, &len));
  if (body[0] != DDP__WIRE_EVENT) {
    if (body[0] == DDP__WIRE_OK) return ddp_error(DDP_ERR_FORMAT, "malformed event from the store");
    return reply_error(body, len);
  }
  ddp__reader r = {body + 1, body + len, 0};
  ddp__slice key = ddp__rd_bytes(&r, len);
  uint8_t kind = ddp__rd_u8(&r);
  int64_t seq = ddp__rd_i64(&r);
  ddp__slice value = ddp__rd_bytes(&r, len);
  if (r.bad || r.p != r.end || key.len == 0 ||
      (kind != DDP_STORE_EVENT_SET && kind != DDP_STORE_EVENT_DELETE))
    return ddp_error(DDP_ERR_FORMAT, "malformed event from the store");
  w->event.len = 0;
  ddp__buf_reserve(&w->event, key.len + value.len + 2);
  ddp__buf_put(&w->event, key.data, key.len);
  ddp__buf_u8(&w->event, 0);
  ddp__buf_put(&w->event, value.data, value.len);
  ddp__buf_u8(&w->event, 0);
  if (w->event.failed) {
    w->event.failed = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory for a change of %zu bytes", value.len);
  }
  ev->key = (const char *)w->event.data;
  ev->kind = kind;
  ev->seq = (uint64_t)seq;
  ev->value = w->event.data + key.len + 1;
  ev->value_bytes = value.len;
  return DDP_OK;
}

static void tcp_watch_interrupt(ddp_store_watcher *base) {
  tcp_watch *w = (tcp_watch *)base;
  int fd = as_tcp(w->conn)->fd;
  if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

static void tcp_watch_destroy(ddp_store_watcher *base) {
  tcp_watch *w = (tcp_watch *)base;
  ddp_store_destroy(w->conn);
  ddp__buf_free(&w->in);
  ddp__buf_free(&w->event);
  ddp_free(w);
}

static const ddp__watch_ops tcp_watch_ops = {
    .next = tcp_watch_next,
    .interrupt = tcp_watch_interrupt,
    .destroy = tcp_watch_destroy,
};

/* Sends WATCH on the new connection and reads the snapshot. */
static ddp_status watch_start(tcp_watch *w, const char *const *keys, size_t n,
                              ddp_store_value *initial) {
  tcp_store *t = as_tcp(w->conn);
  DDP_TRY(keys_ok(t, keys, n));
  begin(t, DDP__OP_WATCH);
  put_keys(t, keys, n);
  finish(t);
  if (t->out.failed) return ddp_error(DDP_ERR_NOMEM, "out of memory encoding the request");
  int64_t deadline = ddp_time_ns() + ddp_store_timeout_ms(w->conn) * 1000000LL;
  DDP_TRY(ddp__net_write_full(t->fd, t->out.data, t->out.len, deadline));
  const uint8_t *body;
  size_t len;
  DDP_TRY(watch_frame(w, deadline, &body, &len));
  if (body[0] != DDP__WIRE_OK) return reply_error(body, len);
  ddp__reader r = {body + 1, body + len, 0};
  if (ddp__rd_u32(&r) != n) return ddp_error(DDP_ERR_FORMAT, "malformed watch reply from the store");
  for (size_t i = 0; i < n; i++) {
    uint8_t exists = ddp__rd_u8(&r);
    ddp__slice v = ddp__rd_bytes(&r, len);
    if (r.bad) return ddp_error(DDP_ERR_FORMAT, "malformed watch reply from the store");
    if (!exists) continue;
    initial[i].data = ddp__store_copy_value(v.data, v.len);
    if (!initial[i].data) return ddp_error(DDP_ERR_NOMEM, "out of memory for a value of %zu bytes", v.len);
    initial[i].bytes = v.len;
  }
  return DDP_OK;
}

static ddp_status tcp_watch_open(ddp_store *s, const char *const *keys, size_t n,
                                 ddp_store_value *initial, ddp_store_watcher **out) {
  tcp_watch *w = ddp_calloc(1, sizeof *w);
  if (!w) return ddp_error(DDP_ERR_NOMEM, "out of memory");
  w->base.ops = &tcp_watch_ops;
  ddp_status st = tcp_clone(s, &w->conn);
  if (st == DDP_OK) st = watch_start(w, keys, n, initial);
  if (st != DDP_OK) {
    ddp_store_values_free(initial, n);
    tcp_watch_destroy(&w->base);
    return st;
  }
  *out = &w->base;
  return DDP_OK;
}

static const ddp__store_ops tcp_ops = {
    .kind = "tcp",
    .set = tcp_set,
    .get = tcp_get,
    .add = tcp_add,
    .compare_set = tcp_compare_set,
    .wait = tcp_wait,
    .check = tcp_check,
    .del = tcp_del,
    .num_keys = tcp_num_keys,
    .list_keys = tcp_list_keys,
    .append = tcp_append,
    .multi_get = tcp_multi_get,
    .multi_set = tcp_multi_set,
    .clone = tcp_clone,
    .watch_open = tcp_watch_open,
    .destroy = tcp_destroy,
};

ddp_status ddp_store_tcp_connect(const char *host, uint16_t port, const ddp_store_options *options,
                                 ddp_store **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_store_tcp_connect: out is NULL");
  *out = NULL;
  if (!host || !*host) return ddp_error(DDP_ERR_INVALID, "ddp_store_tcp_connect: host is empty");
  if (port == 0) return ddp_error(DDP_ERR_INVALID, "ddp_store_tcp_connect: port is 0");
  const char *token = ddp__store_token(options ? options->token : NULL);
  if (token && strlen(token) > DDP_STORE_MAX_TOKEN_BYTES)
    return ddp_error(DDP_ERR_RANGE, "store token of %zu bytes exceeds %u", strlen(token),
                     DDP_STORE_MAX_TOKEN_BYTES);
  tcp_store *t = ddp_calloc(1, sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "out of memory");
  char address[DDP_NET_ADDR_BYTES];
  ddp__net_format_host_port(host, port, address, sizeof address);
  t->fd = -1;
  t->port = port;
  t->host = ddp_strdup(host);
  t->token = token ? ddp_strdup(token) : NULL;
  pthread_mutex_init(&t->mu, NULL);
  if (!t->host || (token && !t->token) ||
      ddp__store_init(&t->base, &tcp_ops, options, address) != DDP_OK) {
    ddp_free(t->host);
    ddp_free(t->token);
    pthread_mutex_destroy(&t->mu);
    ddp_free(t);
    return ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  t->connect_timeout_ms = options && options->connect_timeout_ms > 0
                              ? ddp__store_clamp_ms(options->connect_timeout_ms)
                              : t->base.timeout_ms;
  ddp_status st = connect_retry(t, ddp_time_ns() + t->connect_timeout_ms * 1000000LL);
  if (st != DDP_OK) {
    st = ddp_error_wrap(st, "store %s", address);
    tcp_destroy(&t->base);
    return st;
  }
  *out = &t->base;
  return DDP_OK;
}
