/* A protocol-buffer encoder small enough to read in one sitting: varints,
 * fixed 32/64-bit numbers and length-delimited fields (strings, bytes,
 * nested messages) appended to one growing buffer, fields in the order the
 * caller writes them. It is what TensorBoard's Event and Summary messages
 * need (tfevents.c) and no more: no schema, no decoding. Fields are written
 * as given; like proto3, callers leave out fields at their default value
 * where the schema says so. Wire format: protobuf.dev "Encoding". */
#ifndef DDP_IO_PROTOBUF_H
#define DDP_IO_PROTOBUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The buffer (zero-initialised = empty). An allocation failure sets
 * `failed` and makes every later call a no-op, so a writer checks once at
 * the end. Owned by the caller; ddp__pb_free releases it. */
typedef struct ddp__pb {
  uint8_t *data;
  size_t len, cap;
  bool failed;
} ddp__pb;

void ddp__pb_free(ddp__pb *b);
/* Empties the buffer, keeping its memory (and clearing `failed`). */
void ddp__pb_clear(ddp__pb *b);

/* Field `field` with wire type varint: v as is (uint64, bool, enum), or an
 * int64 as its two's complement (10 bytes when negative, as protobuf's
 * int64 is written). */
void ddp__pb_uint64(ddp__pb *b, uint32_t field, uint64_t v);
void ddp__pb_int64(ddp__pb *b, uint32_t field, int64_t v);
/* Wire type fixed64 / fixed32, little-endian IEEE 754. */
void ddp__pb_double(ddp__pb *b, uint32_t field, double v);
void ddp__pb_float(ddp__pb *b, uint32_t field, float v);
/* Wire type length-delimited: n bytes, or a NUL-terminated string. */
void ddp__pb_bytes(ddp__pb *b, uint32_t field, const void *data, size_t n);
void ddp__pb_string(ddp__pb *b, uint32_t field, const char *s);

/* Bytes as they are, with no key: for framing around a message (a
 * TFRecord's length and checksums). */
void ddp__pb_raw(ddp__pb *b, const void *data, size_t n);

/* A nested message: begin writes the field's key and returns a mark; what
 * is written until ddp__pb_end(b, mark) becomes the message's body, and end
 * puts its length before it. Messages nest to any depth (ends in reverse
 * order of begins). */
size_t ddp__pb_begin(ddp__pb *b, uint32_t field);
void ddp__pb_end(ddp__pb *b, size_t mark);

#endif /* DDP_IO_PROTOBUF_H */
