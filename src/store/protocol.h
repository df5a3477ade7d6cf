/* The store's wire protocol (docs/store.md): length-prefixed binary frames, a
 * HELLO handshake with magic, version and token, then one request / one reply
 * at a time. This module is pure -- no sockets, no globals -- so the fuzzer
 * (fuzz/store_protocol_fuzz.c) can drive the parser directly. */
#ifndef DDP_STORE_PROTOCOL_H
#define DDP_STORE_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/store.h"

#define DDP__STORE_MAGIC 0x53504444u /* "DDPS" as little-endian bytes */
#define DDP__STORE_VERSION 1u
#define DDP__STORE_FRAME_HEADER 4u /* u32 body length */

/* Request opcodes: the first byte of a request body. */
typedef enum ddp__store_op {
  DDP__OP_HELLO = 1,
  DDP__OP_SET = 2,
  DDP__OP_GET = 3,
  DDP__OP_ADD = 4,
  DDP__OP_COMPARE_SET = 5,
  DDP__OP_WAIT = 6,
  DDP__OP_CHECK = 7,
  DDP__OP_DELETE = 8,
  DDP__OP_NUM_KEYS = 9,
  DDP__OP_LIST_KEYS = 10,
  DDP__OP_APPEND = 11,
  DDP__OP_MULTI_GET = 12,
  DDP__OP_MULTI_SET = 13,
  DDP__OP_PING = 14,
  DDP__OP_WATCH = 15, /* turns the connection into a watch (docs/store.md) */
  DDP__OP_MAX_ = 16,
} ddp__store_op;

/* Reply codes: the first byte of a reply body. Anything but OK is followed by
 * a text message (u32 length + bytes). */
typedef enum ddp__store_wire_status {
  DDP__WIRE_OK = 0,
  DDP__WIRE_TIMEOUT = 1,     /* blocking get / wait ran out of time */
  DDP__WIRE_MALFORMED = 2,   /* could not parse: connection is closed after */
  DDP__WIRE_TOO_LARGE = 3,   /* over a limit: connection is closed after */
  DDP__WIRE_AUTH = 4,        /* token refused: connection is closed after */
  DDP__WIRE_VERSION = 5,     /* bad magic or version: closed after */
  DDP__WIRE_NOT_INTEGER = 6, /* add on a value that is not a decimal int64 */
  DDP__WIRE_OVERFLOW = 7,    /* add overflowed int64 */
  DDP__WIRE_STATE = 8,       /* request before HELLO, or HELLO twice */
  DDP__WIRE_FULL = 9,        /* server out of memory or over max_total_bytes */
  DDP__WIRE_WATCH_DROPPED = 10, /* a watch fell behind past its bound: closed after */
  /* Not a reply: a change pushed to a watch connection,
   * `key | u8 kind (1 set, 2 delete) | u64 seq | bytes value`. */
  DDP__WIRE_EVENT = 64,
} ddp__store_wire_status;

/* A view into a buffer: not NUL-terminated, not owned. */
typedef struct ddp__slice {
  const uint8_t *data;
  size_t len;
} ddp__slice;

/* A parsed request. Slices point into the frame passed to the parser; keys
 * and values (the multi-key ops) are arrays owned by the request (free with
 * ddp__store_request_free). */
typedef struct ddp__store_request {
  uint8_t op;
  int64_t timeout_ms; /* GET, WAIT, MULTI_GET */
  int64_t integer;    /* ADD: delta; PING: nonce */
  uint32_t magic;     /* HELLO */
  uint32_t version;   /* HELLO */
  ddp__slice key;     /* single-key ops; NUM_KEYS/LIST_KEYS: prefix; HELLO: token */
  ddp__slice value;   /* SET, APPEND: value; COMPARE_SET: expected */
  ddp__slice desired; /* COMPARE_SET */
  uint32_t num_keys;  /* WAIT, CHECK, MULTI_GET, MULTI_SET, WATCH */
  ddp__slice *keys;
  ddp__slice *values; /* MULTI_SET */
} ddp__store_request;

/* Limits with zeros replaced by the defaults (and clamped to what the frame
 * format can carry). */
void ddp__store_limits_resolve(const ddp_store_limits *in, ddp_store_limits *out);

typedef enum ddp__parse_result {
  DDP__PARSE_ERROR = -1, /* *wire_status and err say why; the stream cannot be trusted */
  DDP__PARSE_MORE = 0,   /* the frame is incomplete: read more and call again */
  DDP__PARSE_DONE = 1,   /* *req holds one request, *consumed bytes used */
} ddp__parse_result;

/* Parses one request frame from buf[0..len). Checks the frame length against
 * limits->max_message_bytes as soon as the 4-byte header is there (before the
 * body arrives), and every inner length, count, key and value against the
 * limits before using it. Keys must be 1..max_key_bytes bytes with no NUL.
 * On DONE the caller frees *req with ddp__store_request_free. On ERROR
 * nothing needs freeing. limits must be resolved. */
ddp__parse_result ddp__store_parse_request(const uint8_t *buf, size_t len,
                                           const ddp_store_limits *limits, ddp__store_request *req,
                                           size_t *consumed, uint8_t *wire_status, char *err,
                                           size_t err_bytes);
void ddp__store_request_free(ddp__store_request *req);

/* Names for messages: "get", "multi_set", ... ("unknown op" for others). */
const char *ddp__store_op_name(unsigned op);

/* ---- Encoding ------------------------------------------------------------
 * A growable byte buffer. Appends never fail loudly: on allocation failure
 * the buffer sets `failed` and ignores further appends; check it once at the
 * end. */
typedef struct ddp__buf {
  uint8_t *data;
  size_t len;
  size_t cap;
  int failed;
} ddp__buf;

void ddp__buf_free(ddp__buf *b);
void ddp__buf_reserve(ddp__buf *b, size_t extra);
void ddp__buf_put(ddp__buf *b, const void *data, size_t len);
void ddp__buf_u8(ddp__buf *b, uint8_t v);
void ddp__buf_u32(ddp__buf *b, uint32_t v);
void ddp__buf_i64(ddp__buf *b, int64_t v);
/* u32 length + bytes. */
void ddp__buf_bytes(ddp__buf *b, const void *data, size_t len);
/* Starts a frame: reserves the 4-byte length; returns its offset. */
size_t ddp__buf_frame_begin(ddp__buf *b);
/* Patches the frame's length. */
void ddp__buf_frame_end(ddp__buf *b, size_t frame_at);
/* Drops the first n bytes (a consumed prefix). */
void ddp__buf_consume(ddp__buf *b, size_t n);

/* ---- Reading -------------------------------------------------------------
 * A bounds-checked cursor: reads past the end set `bad` and yield zeros. */
typedef struct ddp__reader {
  const uint8_t *p;
  const uint8_t *end;
  int bad;
} ddp__reader;

uint8_t ddp__rd_u8(ddp__reader *r);
uint32_t ddp__rd_u32(ddp__reader *r);
int64_t ddp__rd_i64(ddp__reader *r);
/* u32 length + bytes, with length <= max. */
ddp__slice ddp__rd_bytes(ddp__reader *r, size_t max);

static inline uint32_t ddp__load_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Appends a HELLO request frame (magic, version, token; NULL = none). */
void ddp__store_encode_hello(ddp__buf *b, const char *token);

/* Encodes an error reply: code + message. */
void ddp__store_encode_error(ddp__buf *b, uint8_t wire_status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Parses a decimal int64 value (as add stores it): optional '-', digits, no
 * spaces. Returns 0 on success, -1 if not an integer, -2 if out of range. */
int ddp__store_parse_int(const uint8_t *data, size_t len, int64_t *out);

#endif /* DDP_STORE_PROTOCOL_H */
