/* Reader for "DDPFIX01" reference fixtures (see fixture.h, docs/nn.md). */
#include "support/fixture.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC "DDPFIX01"
#define MAGIC_BYTES 8
#define MAX_NAME_BYTES 1024
#define MAX_RECORDS 100000

void fixture_free(fixture *f) {
  if (!f) return;
  for (int i = 0; i < f->count; i++) {
    ddp_free(f->tensors[i].name);
    ddp_free(f->tensors[i].data);
  }
  ddp_free(f->tensors);
  ddp_free(f);
}

/* A bounds-checked little-endian cursor over the file image. */
typedef struct cursor {
  const unsigned char *p;
  size_t size, off;
  const char *what;
} cursor;

static ddp_status need(cursor *c, size_t n, const char *field) {
  if (c->size - c->off < n)
    return ddp_error(DDP_ERR_FORMAT, "%s: truncated at offset %zu: %s needs %zu bytes, %zu left",
                     c->what, c->off, field, n, c->size - c->off);
  return DDP_OK;
}

static uint64_t get_le(cursor *c, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++) v |= (uint64_t)c->p[c->off + (size_t)i] << (8 * i);
  c->off += (size_t)bytes;
  return v;
}

static ddp_status parse_record(cursor *c, fixture_tensor *t) {
  size_t start = c->off;
  DDP_TRY(need(c, 2, "name length"));
  size_t name_len = (size_t)get_le(c, 2);
  if (name_len == 0 || name_len > MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_FORMAT, "%s: record at offset %zu: name length %zu (1..%d)", c->what,
                     start, name_len, MAX_NAME_BYTES);
  DDP_TRY(need(c, name_len + 2, "name, dtype and ndim"));
  t->name = ddp_alloc(name_len + 1);
  if (!t->name) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", c->what);
  memcpy(t->name, c->p + c->off, name_len);
  t->name[name_len] = '\0';
  c->off += name_len;
  int dtype = (int)get_le(c, 1);
  int ndim = (int)get_le(c, 1);
  if (dtype != DDP_FLOAT32 && dtype != DDP_FLOAT64 && dtype != DDP_INT64 && dtype != DDP_BFLOAT16)
    return ddp_error(DDP_ERR_FORMAT, "%s: record '%s' (offset %zu): dtype %d is not float32 (0), "
                     "float64 (1), int64 (3) or bfloat16 (5)", c->what, t->name, start, dtype);
  if (ndim > DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_FORMAT, "%s: record '%s' (offset %zu): %d dimensions (at most %d)",
                     c->what, t->name, start, ndim, DDP_MAX_DIMS);
  DDP_TRY(need(c, (size_t)ndim * 8, "shape"));
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) {
    int64_t d = (int64_t)get_le(c, 8);
    if (d < 0 || (d > 0 && numel > (INT64_MAX / 8) / d))
      return ddp_error(DDP_ERR_FORMAT, "%s: record '%s' (offset %zu): bad dimension %d = %lld",
                       c->what, t->name, start, i, (long long)d);
    t->shape[i] = d;
    numel *= d;
  }
  t->ndim = ndim;
  t->numel = numel;
  t->stored_dtype = (ddp_dtype)dtype;
  size_t elem = ddp_dtype_size((ddp_dtype)dtype);
  if ((uint64_t)numel > (uint64_t)(c->size - c->off) / elem)
    return ddp_error(DDP_ERR_FORMAT,
                     "%s: record '%s' (offset %zu): %lld elements of %zu bytes, only %zu bytes left",
                     c->what, t->name, start, (long long)numel, elem, c->size - c->off);
  t->dtype = dtype == DDP_BFLOAT16 ? DDP_FLOAT32 : (ddp_dtype)dtype;
  size_t out_bytes = (size_t)numel * ddp_dtype_size(t->dtype);
  t->data = ddp_alloc(out_bytes ? out_bytes : 1);
  if (!t->data) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", c->what);
  if (dtype == DDP_BFLOAT16) {
    /* bfloat16 is the top half of a float32: widening is exact. */
    uint32_t *dst = t->data;
    for (int64_t i = 0; i < numel; i++) dst[i] = (uint32_t)get_le(c, 2) << 16;
  } else if (dtype == DDP_FLOAT32) {
    uint32_t *dst = t->data;
    for (int64_t i = 0; i < numel; i++) dst[i] = (uint32_t)get_le(c, 4);
  } else { /* int64, float64: 8-byte words */
    uint64_t *dst = t->data;
    for (int64_t i = 0; i < numel; i++) dst[i] = get_le(c, 8);
  }
  return DDP_OK;
}

ddp_status fixture_parse(const void *bytes, size_t size, const char *what, fixture **out) {
  *out = NULL;
  cursor c = {bytes, size, 0, what};
  DDP_TRY(need(&c, MAGIC_BYTES + 8, "header"));
  if (memcmp(c.p, MAGIC, MAGIC_BYTES) != 0)
    return ddp_error(DDP_ERR_FORMAT, "%s: bad magic (not a DDPFIX01 fixture)", what);
  c.off = MAGIC_BYTES;
  uint64_t count = get_le(&c, 4);
  uint64_t reserved = get_le(&c, 4);
  if (count > MAX_RECORDS || reserved != 0)
    return ddp_error(DDP_ERR_FORMAT, "%s: bad header (%llu records, reserved %llu)", what,
                     (unsigned long long)count, (unsigned long long)reserved);
  fixture *f = ddp_calloc(1, sizeof *f);
  if (!f) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", what);
  f->tensors = ddp_calloc(count ? count : 1, sizeof *f->tensors);
  if (!f->tensors) {
    fixture_free(f);
    return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", what);
  }
  for (uint64_t i = 0; i < count; i++) {
    f->count = (int)i + 1; /* so fixture_free releases a half-parsed record */
    ddp_status s = parse_record(&c, &f->tensors[i]);
    if (s != DDP_OK) {
      fixture_free(f);
      return s;
    }
    for (uint64_t j = 0; j < i; j++)
      if (strcmp(f->tensors[j].name, f->tensors[i].name) == 0) {
        s = ddp_error(DDP_ERR_FORMAT, "%s: record '%s' appears twice", what, f->tensors[i].name);
        fixture_free(f);
        return s;
      }
  }
  if (c.off != size) {
    ddp_status s = ddp_error(DDP_ERR_FORMAT, "%s: %zu trailing bytes after %llu records at offset %zu",
                             what, size - c.off, (unsigned long long)count, c.off);
    fixture_free(f);
    return s;
  }
  *out = f;
  return DDP_OK;
}

ddp_status fixture_load(const char *path, fixture **out) {
  *out = NULL;
  FILE *fp = fopen(path, "rb");
  if (!fp) return ddp_error(DDP_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  unsigned char *buf = NULL;
  size_t size = 0, cap = 0;
  for (;;) {
    if (size == cap) {
      size_t fresh = cap ? cap * 2 : 1 << 16;
      unsigned char *p = ddp_alloc(fresh);
      if (!p) {
        ddp_free(buf);
        fclose(fp);
        return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", path);
      }
      if (buf) memcpy(p, buf, size);
      ddp_free(buf);
      buf = p;
      cap = fresh;
    }
    size_t n = fread(buf + size, 1, cap - size, fp);
    size += n;
    if (n == 0) break;
  }
  bool failed = ferror(fp);
  fclose(fp);
  if (failed) {
    ddp_free(buf);
    return ddp_error(DDP_ERR_IO, "%s: read error", path);
  }
  ddp_status s = fixture_parse(buf, size, path, out);
  ddp_free(buf);
  return s;
}

const fixture_tensor *fixture_find(const fixture *f, const char *name) {
  for (int i = 0; i < f->count; i++)
    if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
  return NULL;
}

const char *fixture_path(const char *file, char *buf, size_t bytes) {
  const char *root = getenv("DDP_SOURCE_DIR");
  snprintf(buf, bytes, "%s%stests/fixtures/%s", root ? root : "", root ? "/" : "", file);
  return buf;
}
