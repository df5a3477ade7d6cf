/* A strict recursive-descent JSON parser (RFC 8259) with byte offsets in
 * its errors, and the string escaper writers use. Written for safetensors
 * headers: small documents, read once, from untrusted files. */
#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io_internal.h"

#define MAX_DEPTH 64

typedef struct parser {
  const char *text;
  size_t len;
  size_t pos;
  size_t base; /* added to every offset in messages */
  ddp_arena *arena;
} parser;

static ddp_status fail(parser *p, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static ddp_status fail(parser *p, size_t at, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return ddp_error(DDP_ERR_FORMAT, "%s at offset %zu", msg, p->base + at);
}

static void skip_ws(parser *p) {
  while (p->pos < p->len) {
    char c = p->text[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

/* What is at pos, for messages: "'x'" or "the end of the text". */
static const char *describe(parser *p, char *buf, size_t n) {
  if (p->pos >= p->len) return "the end of the header";
  unsigned char c = (unsigned char)p->text[p->pos];
  if (c >= 0x20 && c < 0x7f)
    snprintf(buf, n, "'%c'", c);
  else
    snprintf(buf, n, "byte 0x%02x", c);
  return buf;
}

static ddp__json *node(parser *p, ddp__json_kind kind, size_t at) {
  ddp__json *v = ddp_arena_calloc(p->arena, sizeof *v);
  if (v) {
    v->kind = kind;
    v->offset = at;
  }
  return v;
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static ddp_status read_hex4(parser *p, uint32_t *out) {
  if (p->len - p->pos < 4) return fail(p, p->pos, "truncated \\u escape");
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    int d = hex_digit(p->text[p->pos + (size_t)i]);
    if (d < 0) return fail(p, p->pos + (size_t)i, "bad hex digit in \\u escape");
    v = v * 16 + (uint32_t)d;
  }
  p->pos += 4;
  *out = v;
  return DDP_OK;
}

static size_t put_utf8(char *out, uint32_t cp) {
  if (cp < 0x80) {
    out[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (char)(0xe0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  out[0] = (char)(0xf0 | (cp >> 18));
  out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  out[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 when it is not one
 * (overlong forms, surrogates and values above U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  size_t len;
  uint32_t cp, min;
  if (c < 0x80) return 1;
  if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
  else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
  else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  if (n < len) return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return len;
}

/* A string at pos (which holds '"'); decoded into the arena. */
static ddp_status parse_string(parser *p, char **out, size_t *out_len) {
  size_t start = p->pos++;
  /* The decoded form is never longer than the raw one. */
  size_t end = p->pos;
  while (end < p->len && p->text[end] != '"') end += p->text[end] == '\\' ? 2 : 1;
  if (end >= p->len) return fail(p, start, "unterminated string");
  char *buf = ddp_arena_alloc(p->arena, end - p->pos + 1);
  if (!buf) return DDP_ERR_NOMEM;
  size_t n = 0;
  while (p->text[p->pos] != '"') {
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c < 0x20) return fail(p, p->pos, "raw control character 0x%02x in a string", c);
    if (c == '\\') {
      size_t esc = p->pos++;
      char e = p->text[p->pos++];
      switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
          uint32_t cp;
          DDP_TRY(read_hex4(p, &cp));
          if (cp >= 0xdc00 && cp <= 0xdfff) return fail(p, esc, "lone low surrogate in \\u escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            uint32_t lo;
            if (p->len - p->pos < 2 || p->text[p->pos] != '\\' || p->text[p->pos + 1] != 'u')
              return fail(p, esc, "high surrogate without its low half");
            p->pos += 2;
            DDP_TRY(read_hex4(p, &lo));
            if (lo < 0xdc00 || lo > 0xdfff) return fail(p, esc, "bad surrogate pair");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          /* \uXXXX is 6 raw bytes for at most 3 decoded, a pair 12 for 4. */
          n += put_utf8(buf + n, cp);
          break;
        }
        default:
          return fail(p, esc, "bad escape '\\%c'", e >= 0x20 && e < 0x7f ? e : '?');
      }
      continue;
    }
    size_t ulen = utf8_len((const unsigned char *)p->text + p->pos, p->len - p->pos);
    if (ulen == 0) return fail(p, p->pos, "invalid UTF-8 in a string");
    memcpy(buf + n, p->text + p->pos, ulen);
    n += ulen;
    p->pos += ulen;
  }
  p->pos++; /* the closing quote */
  buf[n] = '\0';
  *out = buf;
  *out_len = n;
  return DDP_OK;
}

static ddp_status parse_number(parser *p, ddp__json *v) {
  size_t start = p->pos;
  const char *t = p->text;
  bool integer = true;
  if (p->pos < p->len && t[p->pos] == '-') p->pos++;
  if (p->pos >= p->len || t[p->pos] < '0' || t[p->pos] > '9')
    return fail(p, start, "bad number");
  if (t[p->pos] == '0') {
    p->pos++;
    if (p->pos < p->len && t[p->pos] >= '0' && t[p->pos] <= '9')
      return fail(p, start, "number with a leading zero");
  } else {
    while (p->pos < p->len && t[p->pos] >= '0' && t[p->pos] <= '9') p->pos++;
  }
  if (p->pos < p->len && t[p->pos] == '.') {
    integer = false;
    p->pos++;
    if (p->pos >= p->len || t[p->pos] < '0' || t[p->pos] > '9')
      return fail(p, start, "number with no digits after '.'");
    while (p->pos < p->len && t[p->pos] >= '0' && t[p->pos] <= '9') p->pos++;
  }
  if (p->pos < p->len && (t[p->pos] == 'e' || t[p->pos] == 'E')) {
    integer = false;
    p->pos++;
    if (p->pos < p->len && (t[p->pos] == '+' || t[p->pos] == '-')) p->pos++;
    if (p->pos >= p->len || t[p->pos] < '0' || t[p->pos] > '9')
      return fail(p, start, "number with an empty exponent");
    while (p->pos < p->len && t[p->pos] >= '0' && t[p->pos] <= '9') p->pos++;
  }
  /* strtod/strtoll need a terminated copy; numbers in a header are short. */
  char tmp[64];
  size_t n = p->pos - start;
  if (n >= sizeof tmp) return fail(p, start, "number longer than %zu characters", sizeof tmp - 1);
  memcpy(tmp, t + start, n);
  tmp[n] = '\0';
  v->number = strtod(tmp, NULL);
  if (integer) {
    errno = 0;
    long long x = strtoll(tmp, NULL, 10);
    if (errno == 0) {
      v->is_integer = true;
      v->integer = x;
    }
  }
  return DDP_OK;
}

static ddp_status parse_value(parser *p, int depth, ddp__json **out);

static ddp_status parse_container(parser *p, int depth, bool object, ddp__json *v) {
  p->pos++; /* '[' or '{' */
  ddp__json **tail = &v->first;
  skip_ws(p);
  char close = object ? '}' : ']';
  if (p->pos < p->len && p->text[p->pos] == close) {
    p->pos++;
    return DDP_OK;
  }
  for (;;) {
    char what[16];
    const char *key = NULL;
    size_t key_len = 0, key_at = 0;
    skip_ws(p);
    if (object) {
      if (p->pos >= p->len || p->text[p->pos] != '"')
        return fail(p, p->pos, "expected a member name (a string) but found %s",
                    describe(p, what, sizeof what));
      key_at = p->pos;
      char *k;
      DDP_TRY(parse_string(p, &k, &key_len));
      key = k;
      if (strlen(key) != key_len) return fail(p, key_at, "member name contains \\u0000");
      for (const ddp__json *c = v->first; c; c = c->next)
        if (!strcmp(c->key, key)) return fail(p, key_at, "duplicate member \"%s\"", key);
      skip_ws(p);
      if (p->pos >= p->len || p->text[p->pos] != ':')
        return fail(p, p->pos, "expected ':' after member name \"%s\" but found %s", key,
                    describe(p, what, sizeof what));
      p->pos++;
    }
    ddp__json *child;
    DDP_TRY(parse_value(p, depth + 1, &child));
    child->key = key;
    child->key_offset = key_at;
    *tail = child;
    tail = &child->next;
    v->count++;
    skip_ws(p);
    if (p->pos < p->len && p->text[p->pos] == ',') {
      p->pos++;
      continue;
    }
    if (p->pos < p->len && p->text[p->pos] == close) {
      p->pos++;
      return DDP_OK;
    }
    return fail(p, p->pos, "expected ',' or '%c' in %s but found %s", close,
                object ? "an object" : "an array", describe(p, what, sizeof what));
  }
}

static ddp_status literal(parser *p, const char *word) {
  size_t n = strlen(word);
  if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0)
    return fail(p, p->pos, "unexpected token");
  p->pos += n;
  return DDP_OK;
}

static ddp_status parse_value(parser *p, int depth, ddp__json **out) {
  if (depth > MAX_DEPTH) return fail(p, p->pos, "nesting deeper than %d", MAX_DEPTH);
  skip_ws(p);
  if (p->pos >= p->len) return fail(p, p->pos, "expected a value but the header ends");
  char c = p->text[p->pos];
  size_t at = p->pos;
  ddp__json *v;
  switch (c) {
    case '{':
    case '[':
      v = node(p, c == '{' ? DDP__JSON_OBJECT : DDP__JSON_ARRAY, at);
      if (!v) return DDP_ERR_NOMEM;
      DDP_TRY(parse_container(p, depth, c == '{', v));
      break;
    case '"':
      v = node(p, DDP__JSON_STRING, at);
      if (!v) return DDP_ERR_NOMEM;
      DDP_TRY(parse_string(p, &v->string, &v->len));
      break;
    case 't':
    case 'f':
      v = node(p, DDP__JSON_BOOL, at);
      if (!v) return DDP_ERR_NOMEM;
      v->boolean = c == 't';
      DDP_TRY(literal(p, c == 't' ? "true" : "false"));
      break;
    case 'n':
      v = node(p, DDP__JSON_NULL, at);
      if (!v) return DDP_ERR_NOMEM;
      DDP_TRY(literal(p, "null"));
      break;
    default:
      if (c != '-' && (c < '0' || c > '9')) {
        char what[16];
        return fail(p, at, "expected a value but found %s", describe(p, what, sizeof what));
      }
      v = node(p, DDP__JSON_NUMBER, at);
      if (!v) return DDP_ERR_NOMEM;
      DDP_TRY(parse_number(p, v));
  }
  *out = v;
  return DDP_OK;
}

ddp_status ddp__json_parse(const char *text, size_t len, size_t base_offset, ddp__json_doc *doc) {
  ddp_arena_init(&doc->arena, len * 4 + 4096);
  doc->root = NULL;
  parser p = {.text = text, .len = len, .pos = 0, .base = base_offset, .arena = &doc->arena};
  ddp__json *root;
  ddp_status s = parse_value(&p, 0, &root);
  if (s == DDP_OK) {
    skip_ws(&p);
    if (p.pos < p.len) s = fail(&p, p.pos, "trailing characters after the JSON value");
  }
  if (s != DDP_OK) {
    if (s == DDP_ERR_NOMEM) ddp_error(s, "json: out of memory parsing %zu bytes", len);
    ddp_arena_free(&doc->arena);
    memset(doc, 0, sizeof *doc);
    return s;
  }
  doc->root = root;
  return DDP_OK;
}

void ddp__json_free(ddp__json_doc *doc) {
  if (!doc) return;
  ddp_arena_free(&doc->arena);
  memset(doc, 0, sizeof *doc);
}

const ddp__json *ddp__json_get(const ddp__json *object, const char *key) {
  if (!object || object->kind != DDP__JSON_OBJECT) return NULL;
  for (const ddp__json *c = object->first; c; c = c->next)
    if (!strcmp(c->key, key)) return c;
  return NULL;
}

const char *ddp__json_kind_name(ddp__json_kind kind) {
  static const char *const names[] = {"null", "boolean", "number", "string", "array", "object"};
  return (unsigned)kind < sizeof names / sizeof *names ? names[kind] : "unknown";
}

/* One character of a JSON string as written: itself, or its escape (at
 * most 6 bytes, "\u001f"). Returns the length. */
static size_t escape_char(unsigned char c, char out[6]) {
  static const char hex[] = "0123456789abcdef";
  if (c == '"' || c == '\\') {
    out[0] = '\\';
    out[1] = (char)c;
    return 2;
  }
  if (c < 0x20) {
    memcpy(out, "\\u00", 4);
    out[4] = hex[c >> 4];
    out[5] = hex[c & 15];
    return 6;
  }
  out[0] = (char)c;
  return 1;
}

bool ddp__json_put_string(char *buf, size_t cap, size_t *pos, const char *s) {
  size_t n = *pos;
  if (n + 1 >= cap) return false;
  buf[n++] = '"';
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    char e[6];
    size_t k = escape_char(*c, e);
    if (n + k >= cap) return false;
    memcpy(buf + n, e, k);
    n += k;
  }
  if (n + 1 >= cap) return false;
  buf[n++] = '"';
  buf[n] = '\0';
  *pos = n;
  return true;
}

void ddp__json_fput_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    char e[6];
    fwrite(e, 1, escape_char(*c, e), f);
  }
  fputc('"', f);
}
