/* The protocol-buffer encoder (protobuf.h): keys are (field << 3) | wire
 * type, varints 7 bits a byte, least significant first. */
#include "io/protobuf.h"

#include <string.h>

#include "ddp/core.h"

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };

void ddp__pb_free(ddp__pb *b) {
  ddp_free(b->data);
  *b = (ddp__pb){0};
}

void ddp__pb_clear(ddp__pb *b) {
  b->len = 0;
  b->failed = false;
}

/* Room for n more bytes; false (and `failed`) when memory runs out. */
static bool reserve(ddp__pb *b, size_t n) {
  if (b->failed) return false;
  if (b->len + n <= b->cap) return true;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + n) cap *= 2;
  uint8_t *data = ddp_alloc(cap);
  if (!data) {
    b->failed = true;
    return false;
  }
  if (b->len) memcpy(data, b->data, b->len);
  ddp_free(b->data);
  b->data = data;
  b->cap = cap;
  return true;
}

static size_t encode_varint(uint8_t out[10], uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  out[n++] = (uint8_t)v;
  return n;
}

static void put_varint(ddp__pb *b, uint64_t v) {
  uint8_t tmp[10];
  size_t n = encode_varint(tmp, v);
  if (!reserve(b, n)) return;
  memcpy(b->data + b->len, tmp, n);
  b->len += n;
}

static void put_key(ddp__pb *b, uint32_t field, int wire) {
  put_varint(b, ((uint64_t)field << 3) | (uint64_t)wire);
}

static void put_le(ddp__pb *b, uint64_t v, size_t bytes) {
  if (!reserve(b, bytes)) return;
  for (size_t i = 0; i < bytes; i++) b->data[b->len++] = (uint8_t)(v >> (8 * i));
}

void ddp__pb_uint64(ddp__pb *b, uint32_t field, uint64_t v) {
  put_key(b, field, WIRE_VARINT);
  put_varint(b, v);
}

void ddp__pb_int64(ddp__pb *b, uint32_t field, int64_t v) {
  ddp__pb_uint64(b, field, (uint64_t)v);
}

void ddp__pb_double(ddp__pb *b, uint32_t field, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  put_key(b, field, WIRE_FIXED64);
  put_le(b, bits, 8);
}

void ddp__pb_float(ddp__pb *b, uint32_t field, float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  put_key(b, field, WIRE_FIXED32);
  put_le(b, bits, 4);
}

void ddp__pb_bytes(ddp__pb *b, uint32_t field, const void *data, size_t n) {
  put_key(b, field, WIRE_LEN);
  put_varint(b, n);
  ddp__pb_raw(b, data, n);
}

void ddp__pb_string(ddp__pb *b, uint32_t field, const char *s) {
  ddp__pb_bytes(b, field, s, strlen(s));
}

void ddp__pb_raw(ddp__pb *b, const void *data, size_t n) {
  if (!n || !reserve(b, n)) return;
  memcpy(b->data + b->len, data, n);
  b->len += n;
}

size_t ddp__pb_begin(ddp__pb *b, uint32_t field) {
  put_key(b, field, WIRE_LEN);
  return b->len;
}

/* The body was written where its length belongs: move it up by the
 * length's size and put the length in front. */
void ddp__pb_end(ddp__pb *b, size_t mark) {
  if (b->failed) return;
  size_t body = b->len - mark;
  uint8_t tmp[10];
  size_t n = encode_varint(tmp, body);
  if (!reserve(b, n)) return;
  memmove(b->data + mark + n, b->data + mark, body);
  memcpy(b->data + mark, tmp, n);
  b->len += n;
}
