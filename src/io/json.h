/* A small JSON parser (RFC 8259) for file-format headers: safetensors'
 * header is the product's file-format boundary, so ddp parses it itself,
 * strictly, with byte offsets in every error. Values live in one arena that
 * ddp__json_free releases at once. */
#ifndef DDP_IO_JSON_H
#define DDP_IO_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

typedef enum ddp__json_kind {
  DDP__JSON_NULL = 0,
  DDP__JSON_BOOL,
  DDP__JSON_NUMBER,
  DDP__JSON_STRING,
  DDP__JSON_ARRAY,
  DDP__JSON_OBJECT,
} ddp__json_kind;

typedef struct ddp__json ddp__json;
struct ddp__json {
  ddp__json_kind kind;
  size_t offset;       /* where the value starts, in bytes from the text's start */
  bool boolean;
  /* Numbers: is_integer when written without fraction or exponent and within
   * int64 (then integer holds it); number always holds the double value. */
  bool is_integer;
  int64_t integer;
  double number;
  /* Strings: decoded UTF-8, NUL-terminated (len excludes the NUL; a string
   * with an escaped \u0000 keeps len and stops C string functions early). */
  char *string;
  size_t len;
  /* Arrays and objects: children in document order, linked by next. For an
   * object member, key (decoded) and key_offset name it. */
  ddp__json *first;
  size_t count;
  ddp__json *next;
  const char *key;
  size_t key_offset;
};

typedef struct ddp__json_doc {
  ddp_arena arena;
  ddp__json *root;
} ddp__json_doc;

/* Parses text[0..len) (one value, whitespace around it allowed) into *doc.
 * Nesting deeper than 64 is refused (a header has depth 3). Strings must be
 * valid UTF-8 without raw control characters; object keys unique. On error
 * returns DDP_ERR_FORMAT with "<what> at offset N" (N + base_offset, so a
 * caller can report file offsets) and leaves *doc empty. NOMEM when the
 * arena cannot grow. */
ddp_status ddp__json_parse(const char *text, size_t len, size_t base_offset, ddp__json_doc *doc);
void ddp__json_free(ddp__json_doc *doc);
/* The member named key of an object, or NULL. */
const ddp__json *ddp__json_get(const ddp__json *object, const char *key);
/* "null", "boolean", "number", "string", "array", "object". */
const char *ddp__json_kind_name(ddp__json_kind kind);

/* Writes s as a JSON string (quoted, escaped) into buf at *pos, growing
 * nothing: returns false when it does not fit in cap bytes. For writers. */
bool ddp__json_put_string(char *buf, size_t cap, size_t *pos, const char *s);

#endif /* DDP_IO_JSON_H */
