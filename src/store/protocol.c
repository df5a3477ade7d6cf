/* The store's wire protocol: the request parser the server and the fuzzer
 * use, and the small encoder both sides use. Layouts are in docs/store.md. */
#include "store/protocol.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void ddp__store_limits_resolve(const ddp_store_limits *in, ddp_store_limits *out) {
  ddp_store_limits l;
  memset(&l, 0, sizeof l);
  if (in) l = *in;
  if (!l.max_key_bytes) l.max_key_bytes = DDP_STORE_MAX_KEY_BYTES;
  if (!l.max_keys_per_call) l.max_keys_per_call = DDP_STORE_MAX_KEYS_PER_CALL;
  if (!l.max_value_bytes) l.max_value_bytes = DDP_STORE_MAX_VALUE_BYTES;
  if (!l.max_message_bytes) l.max_message_bytes = DDP_STORE_MAX_MESSAGE_BYTES;
  if (!l.max_clients) l.max_clients = 65536;
  if (!l.max_total_bytes) l.max_total_bytes = 4ull << 30;
  if (!l.max_watch_pending) l.max_watch_pending = DDP_STORE_WATCH_PENDING;
  if (l.max_watch_pending > DDP_STORE_WATCH_PENDING_MAX) l.max_watch_pending = DDP_STORE_WATCH_PENDING_MAX;
  if (!l.max_watch_pending_bytes) l.max_watch_pending_bytes = DDP_STORE_WATCH_PENDING_BYTES;
  /* Lengths travel as u32: keep every limit representable, with room for the
   * frame around a value. */
  const uint64_t frame_cap = 0xFFFFFFFFull - 64;
  if (l.max_message_bytes > frame_cap) l.max_message_bytes = frame_cap;
  if (l.max_value_bytes > l.max_message_bytes) l.max_value_bytes = l.max_message_bytes;
  if (l.max_key_bytes > l.max_message_bytes) l.max_key_bytes = (uint32_t)l.max_message_bytes;
  *out = l;
}

const char *ddp__store_op_name(unsigned op) {
  static const char *names[DDP__OP_MAX_] = {
      [DDP__OP_HELLO] = "hello",
      [DDP__OP_SET] = "set",
      [DDP__OP_GET] = "get",
      [DDP__OP_ADD] = "add",
      [DDP__OP_COMPARE_SET] = "compare_set",
      [DDP__OP_WAIT] = "wait",
      [DDP__OP_CHECK] = "check",
      [DDP__OP_DELETE] = "delete",
      [DDP__OP_NUM_KEYS] = "num_keys",
      [DDP__OP_LIST_KEYS] = "list_keys",
      [DDP__OP_APPEND] = "append",
      [DDP__OP_MULTI_GET] = "multi_get",
      [DDP__OP_MULTI_SET] = "multi_set",
      [DDP__OP_PING] = "ping",
      [DDP__OP_WATCH] = "watch",
  };
  if (op < DDP__OP_MAX_ && names[op]) return names[op];
  return "unknown op";
}

/* ---- Buffer -------------------------------------------------------------- */

void ddp__buf_free(ddp__buf *b) {
  ddp_free(b->data);
  memset(b, 0, sizeof *b);
}

void ddp__buf_reserve(ddp__buf *b, size_t extra) {
  if (b->failed) return;
  if (extra > SIZE_MAX / 2 - b->len) {
    b->failed = 1;
    return;
  }
  size_t need = b->len + extra;
  if (need <= b->cap) return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need) cap *= 2;
  uint8_t *data = ddp_alloc(cap);
  if (!data) {
    b->failed = 1;
    return;
  }
  if (b->len) memcpy(data, b->data, b->len);
  ddp_free(b->data);
  b->data = data;
  b->cap = cap;
}

void ddp__buf_put(ddp__buf *b, const void *data, size_t len) {
  ddp__buf_reserve(b, len);
  if (b->failed) return;
  if (len) memcpy(b->data + b->len, data, len);
  b->len += len;
}

void ddp__buf_u8(ddp__buf *b, uint8_t v) { ddp__buf_put(b, &v, 1); }

void ddp__buf_u32(ddp__buf *b, uint32_t v) {
  uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
  ddp__buf_put(b, x, 4);
}

void ddp__buf_i64(ddp__buf *b, int64_t v) {
  uint64_t u = (uint64_t)v;
  uint8_t x[8];
  for (int i = 0; i < 8; i++) x[i] = (uint8_t)(u >> (8 * i));
  ddp__buf_put(b, x, 8);
}

void ddp__buf_bytes(ddp__buf *b, const void *data, size_t len) {
  if (len > 0xFFFFFFFFu) {
    b->failed = 1;
    return;
  }
  ddp__buf_u32(b, (uint32_t)len);
  ddp__buf_put(b, data, len);
}

size_t ddp__buf_frame_begin(ddp__buf *b) {
  size_t at = b->len;
  ddp__buf_u32(b, 0);
  return at;
}

void ddp__buf_frame_end(ddp__buf *b, size_t frame_at) {
  if (b->failed) return;
  size_t body = b->len - frame_at - DDP__STORE_FRAME_HEADER;
  if (body > 0xFFFFFFFFu) {
    b->failed = 1;
    return;
  }
  uint8_t *p = b->data + frame_at;
  p[0] = (uint8_t)body;
  p[1] = (uint8_t)(body >> 8);
  p[2] = (uint8_t)(body >> 16);
  p[3] = (uint8_t)(body >> 24);
}

void ddp__buf_consume(ddp__buf *b, size_t n) {
  if (n >= b->len) {
    b->len = 0;
    return;
  }
  memmove(b->data, b->data + n, b->len - n);
  b->len -= n;
}

/* ---- Reader -------------------------------------------------------------- */

static int rd_need(ddp__reader *r, size_t n) {
  if (r->bad || (size_t)(r->end - r->p) < n) {
    r->bad = 1;
    return 0;
  }
  return 1;
}

uint8_t ddp__rd_u8(ddp__reader *r) {
  if (!rd_need(r, 1)) return 0;
  return *r->p++;
}

uint32_t ddp__rd_u32(ddp__reader *r) {
  if (!rd_need(r, 4)) return 0;
  uint32_t v = ddp__load_u32(r->p);
  r->p += 4;
  return v;
}

int64_t ddp__rd_i64(ddp__reader *r) {
  if (!rd_need(r, 8)) return 0;
  uint64_t u = 0;
  for (int i = 0; i < 8; i++) u |= (uint64_t)r->p[i] << (8 * i);
  r->p += 8;
  return (int64_t)u;
}

ddp__slice ddp__rd_bytes(ddp__reader *r, size_t max) {
  ddp__slice s = {NULL, 0};
  uint32_t len = ddp__rd_u32(r);
  if (r->bad) return s;
  if (len > max || !rd_need(r, len)) {
    r->bad = 1;
    return s;
  }
  s.data = r->p;
  s.len = len;
  r->p += len;
  return s;
}

/* ---- Request parser ------------------------------------------------------ */

/* Parser state for one frame: reports the first problem found. */
typedef struct parse_ctx {
  ddp__reader r;
  const ddp_store_limits *limits;
  uint8_t status;
  char *err;
  size_t err_bytes;
  int failed;
} parse_ctx;

__attribute__((format(printf, 3, 4))) static void fail(parse_ctx *c, uint8_t status,
                                                       const char *fmt, ...) {
  if (c->failed) return;
  c->failed = 1;
  c->status = status;
  if (c->err && c->err_bytes) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_bytes, fmt, ap);
    va_end(ap);
  }
}

static int64_t p_i64(parse_ctx *c, const char *what) {
  int64_t v = ddp__rd_i64(&c->r);
  if (c->r.bad) fail(c, DDP__WIRE_MALFORMED, "truncated %s", what);
  return v;
}

/* A length-prefixed field checked against max before it is trusted. */
static ddp__slice p_bytes(parse_ctx *c, uint64_t max, uint8_t over_status, const char *what) {
  ddp__slice s = {NULL, 0};
  if (c->failed) return s;
  if ((size_t)(c->r.end - c->r.p) < 4) {
    fail(c, DDP__WIRE_MALFORMED, "truncated %s length", what);
    return s;
  }
  uint32_t len = ddp__load_u32(c->r.p);
  if (len > max) {
    fail(c, over_status, "%s of %u bytes exceeds the limit of %llu", what, len,
         (unsigned long long)max);
    return s;
  }
  s = ddp__rd_bytes(&c->r, max);
  if (c->r.bad) fail(c, DDP__WIRE_MALFORMED, "%s of %u bytes overruns the message", what, len);
  return s;
}

static ddp__slice p_key(parse_ctx *c) {
  ddp__slice k = p_bytes(c, c->limits->max_key_bytes, DDP__WIRE_TOO_LARGE, "key");
  if (c->failed) return k;
  if (k.len == 0) fail(c, DDP__WIRE_MALFORMED, "empty key");
  else if (memchr(k.data, 0, k.len)) fail(c, DDP__WIRE_MALFORMED, "key contains a NUL byte");
  return k;
}

static ddp__slice p_value(parse_ctx *c, const char *what) {
  return p_bytes(c, c->limits->max_value_bytes, DDP__WIRE_TOO_LARGE, what);
}

/* A key count, checked against the limit and against the bytes left (every
 * key takes at least 5), so a forged count cannot make us allocate much. */
static uint32_t p_count(parse_ctx *c, size_t min_item_bytes) {
  if (c->failed) return 0;
  uint32_t n = ddp__rd_u32(&c->r);
  if (c->r.bad) {
    fail(c, DDP__WIRE_MALFORMED, "truncated key count");
    return 0;
  }
  if (n > c->limits->max_keys_per_call) {
    fail(c, DDP__WIRE_TOO_LARGE, "%u keys in one call exceeds the limit of %u", n,
         c->limits->max_keys_per_call);
    return 0;
  }
  if ((uint64_t)n * min_item_bytes > (uint64_t)(c->r.end - c->r.p)) {
    fail(c, DDP__WIRE_MALFORMED, "%u keys cannot fit in the %zu bytes left", n,
         (size_t)(c->r.end - c->r.p));
    return 0;
  }
  return n;
}

static void p_key_list(parse_ctx *c, ddp__store_request *req, int with_values) {
  uint32_t n = p_count(c, with_values ? 4 + 1 + 4 : 4 + 1);
  if (c->failed || n == 0) return;
  req->keys = ddp_calloc(n, sizeof *req->keys);
  if (with_values) req->values = ddp_calloc(n, sizeof *req->values);
  if (!req->keys || (with_values && !req->values)) {
    fail(c, DDP__WIRE_FULL, "out of memory for %u keys", n);
    return;
  }
  req->num_keys = n;
  for (uint32_t i = 0; i < n && !c->failed; i++) {
    req->keys[i] = p_key(c);
    if (with_values) req->values[i] = p_value(c, "value");
  }
}

void ddp__store_request_free(ddp__store_request *req) {
  ddp_free(req->keys);
  ddp_free(req->values);
  req->keys = NULL;
  req->values = NULL;
  req->num_keys = 0;
}

ddp__parse_result ddp__store_parse_request(const uint8_t *buf, size_t len,
                                           const ddp_store_limits *limits, ddp__store_request *req,
                                           size_t *consumed, uint8_t *wire_status, char *err,
                                           size_t err_bytes) {
  memset(req, 0, sizeof *req);
  *consumed = 0;
  parse_ctx c = {.limits = limits, .err = err, .err_bytes = err_bytes};
  if (err && err_bytes) err[0] = '\0';
  if (len < DDP__STORE_FRAME_HEADER) return DDP__PARSE_MORE;
  uint32_t body = ddp__load_u32(buf);
  if (body == 0) {
    fail(&c, DDP__WIRE_MALFORMED, "empty message");
  } else if (body > limits->max_message_bytes) {
    fail(&c, DDP__WIRE_TOO_LARGE, "message of %u bytes exceeds the limit of %llu", body,
         (unsigned long long)limits->max_message_bytes);
  }
  if (c.failed) {
    *wire_status = c.status;
    return DDP__PARSE_ERROR;
  }
  if (len - DDP__STORE_FRAME_HEADER < body) return DDP__PARSE_MORE;

  c.r.p = buf + DDP__STORE_FRAME_HEADER;
  c.r.end = c.r.p + body;
  req->op = ddp__rd_u8(&c.r);
  switch (req->op) {
    case DDP__OP_HELLO:
      req->magic = ddp__rd_u32(&c.r);
      req->version = ddp__rd_u32(&c.r);
      if (c.r.bad) fail(&c, DDP__WIRE_MALFORMED, "truncated hello");
      req->key = p_bytes(&c, DDP_STORE_MAX_TOKEN_BYTES, DDP__WIRE_TOO_LARGE, "token");
      break;
    case DDP__OP_SET:
    case DDP__OP_APPEND:
      req->key = p_key(&c);
      req->value = p_value(&c, "value");
      break;
    case DDP__OP_GET:
      req->timeout_ms = p_i64(&c, "timeout");
      req->key = p_key(&c);
      break;
    case DDP__OP_ADD:
      req->key = p_key(&c);
      req->integer = p_i64(&c, "delta");
      break;
    case DDP__OP_COMPARE_SET:
      req->key = p_key(&c);
      req->value = p_value(&c, "expected value");
      req->desired = p_value(&c, "desired value");
      break;
    case DDP__OP_WAIT:
    case DDP__OP_MULTI_GET:
      req->timeout_ms = p_i64(&c, "timeout");
      p_key_list(&c, req, 0);
      break;
    case DDP__OP_CHECK:
    case DDP__OP_WATCH: p_key_list(&c, req, 0); break;
    case DDP__OP_DELETE: req->key = p_key(&c); break;
    case DDP__OP_NUM_KEYS:
    case DDP__OP_LIST_KEYS:
      req->key = p_bytes(&c, limits->max_key_bytes, DDP__WIRE_TOO_LARGE, "prefix");
      break;
    case DDP__OP_MULTI_SET: p_key_list(&c, req, 1); break;
    case DDP__OP_PING: req->integer = p_i64(&c, "nonce"); break;
    default: fail(&c, DDP__WIRE_MALFORMED, "unknown opcode %u", req->op); break;
  }
  if (!c.failed && c.r.p != c.r.end)
    fail(&c, DDP__WIRE_MALFORMED, "%s message has %zu trailing bytes", ddp__store_op_name(req->op),
         (size_t)(c.r.end - c.r.p));
  if (c.failed) {
    ddp__store_request_free(req);
    *wire_status = c.status;
    return DDP__PARSE_ERROR;
  }
  *consumed = DDP__STORE_FRAME_HEADER + (size_t)body;
  return DDP__PARSE_DONE;
}

/* ---- Encoders ------------------------------------------------------------ */

void ddp__store_encode_hello(ddp__buf *b, const char *token) {
  size_t at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_HELLO);
  ddp__buf_u32(b, DDP__STORE_MAGIC);
  ddp__buf_u32(b, DDP__STORE_VERSION);
  ddp__buf_bytes(b, token ? token : "", token ? strlen(token) : 0);
  ddp__buf_frame_end(b, at);
}

void ddp__store_encode_error(ddp__buf *b, uint8_t wire_status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof msg) n = sizeof msg - 1;
  size_t at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, wire_status);
  ddp__buf_bytes(b, msg, (size_t)n);
  ddp__buf_frame_end(b, at);
}

int ddp__store_parse_int(const uint8_t *data, size_t len, int64_t *out) {
  size_t i = 0;
  int neg = 0;
  if (len > 0 && data[0] == '-') {
    neg = 1;
    i = 1;
  }
  if (i == len) return -1;
  uint64_t mag = 0;
  const uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
  for (; i < len; i++) {
    if (data[i] < '0' || data[i] > '9') return -1;
    unsigned d = data[i] - '0';
    if (mag > (limit - d) / 10) return -2;
    mag = mag * 10 + d;
  }
  *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
  return 0;
}
