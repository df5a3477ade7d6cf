/* The fixture reader (see optim_fixture.h). "DDPFIX01", little-endian:
 *   header  8 bytes magic, u32 record count, u32 reserved (0)
 *   record  u16 name length, name, u8 dtype, u8 ndim, ndim x i64 shape,
 *           numel x dtype-size bytes of data */
#include "optim/optim_fixture.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FIXTURE_MAGIC "DDPFIX01"
#define MAX_RECORDS 100000

typedef struct reader {
  const unsigned char *buf;
  size_t size, off;
} reader;

static int fail(char *err, size_t err_size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t err_size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_size, fmt, ap);
  va_end(ap);
  return -1;
}

static size_t dtype_size(uint64_t dtype) {
  switch (dtype) {
    case FIXTURE_F32: return 4;
    case FIXTURE_F64: return 8;
    case FIXTURE_I64: return 8;
    default: return 0;
  }
}

static int take(reader *r, void *dst, size_t n) {
  if (n > r->size - r->off) return -1;
  memcpy(dst, r->buf + r->off, n);
  r->off += n;
  return 0;
}

/* Little-endian unsigned of `bytes` bytes. */
static int take_le(reader *r, size_t bytes, uint64_t *out) {
  unsigned char b[8];
  if (take(r, b, bytes) != 0) return -1;
  *out = 0;
  for (size_t i = 0; i < bytes; i++) *out |= (uint64_t)b[i] << (8 * i);
  return 0;
}

static int parse_record(reader *r, fixture_record *rec, const char *path, char *err,
                        size_t err_size) {
  size_t at = r->off;
  uint64_t name_len, dtype, ndim;
  if (take_le(r, 2, &name_len) != 0 || name_len == 0 || name_len > r->size - r->off)
    return fail(err, err_size, "%s: record at offset %zu: bad or truncated name", path, at);
  rec->name = calloc(name_len + 1, 1);
  if (!rec->name) return fail(err, err_size, "%s: out of memory", path);
  take(r, rec->name, name_len);
  if (take_le(r, 1, &dtype) != 0 || take_le(r, 1, &ndim) != 0)
    return fail(err, err_size, "%s: record '%s' (offset %zu): truncated", path, rec->name, at);
  size_t elem = dtype_size(dtype);
  if (elem == 0 || ndim > FIXTURE_MAX_DIMS)
    return fail(err, err_size, "%s: record '%s' (offset %zu): dtype %llu / ndim %llu not supported",
                path, rec->name, at, (unsigned long long)dtype, (unsigned long long)ndim);
  rec->dtype = (int)dtype;
  rec->ndim = (int)ndim;
  uint64_t numel = 1;
  for (uint64_t d = 0; d < ndim; d++) {
    uint64_t dim;
    if (take_le(r, 8, &dim) != 0)
      return fail(err, err_size, "%s: record '%s' (offset %zu): truncated shape", path, rec->name, at);
    if ((int64_t)dim < 0 || (dim && numel > (UINT64_MAX / 8) / dim))
      return fail(err, err_size, "%s: record '%s' (offset %zu): bad dimension %llu = %lld", path,
                  rec->name, at, (unsigned long long)d, (long long)dim);
    rec->shape[d] = (int64_t)dim;
    numel *= dim;
  }
  if (numel > (r->size - r->off) / elem)
    return fail(err, err_size,
                "%s: record '%s' (offset %zu): %llu elements of %zu bytes, only %zu bytes left", path,
                rec->name, at, (unsigned long long)numel, elem, r->size - r->off);
  size_t bytes = (size_t)numel * elem;
  rec->numel = (size_t)numel;
  rec->data = malloc(bytes ? bytes : 1);
  if (!rec->data) return fail(err, err_size, "%s: out of memory", path);
  /* The hosts we run on are little-endian (x86-64, aarch64): copy as is. */
  take(r, rec->data, bytes);
  return 0;
}

static int parse(fixture *fx, const char *path, const unsigned char *buf, size_t size, char *err,
                 size_t err_size) {
  reader r = {buf, size, 0};
  char magic[8];
  uint64_t count, reserved;
  if (take(&r, magic, 8) != 0 || memcmp(magic, FIXTURE_MAGIC, 8) != 0)
    return fail(err, err_size, "%s: bad magic (not a DDPFIX01 fixture)", path);
  if (take_le(&r, 4, &count) != 0 || take_le(&r, 4, &reserved) != 0)
    return fail(err, err_size, "%s: truncated header", path);
  if (count > MAX_RECORDS || reserved != 0)
    return fail(err, err_size, "%s: bad header (%llu records, reserved %llu)", path,
                (unsigned long long)count, (unsigned long long)reserved);
  fx->records = calloc(count ? count : 1, sizeof *fx->records);
  if (!fx->records) return fail(err, err_size, "%s: out of memory", path);
  for (size_t i = 0; i < count; i++) {
    fx->count = i + 1; /* so fixture_free releases a half-parsed record */
    if (parse_record(&r, &fx->records[i], path, err, err_size) != 0) return -1;
    for (size_t j = 0; j < i; j++)
      if (strcmp(fx->records[j].name, fx->records[i].name) == 0)
        return fail(err, err_size, "%s: record '%s' appears twice", path, fx->records[i].name);
  }
  if (r.off != r.size)
    return fail(err, err_size, "%s: %zu trailing bytes after the last record", path,
                r.size - r.off);
  return 0;
}

int fixture_load(fixture *fx, const char *path, char *err, size_t err_size) {
  memset(fx, 0, sizeof *fx);
  FILE *f = fopen(path, "rb");
  if (!f) return fail(err, err_size, "%s: cannot open", path);
  unsigned char *buf = NULL;
  long size = -1;
  if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
  if (size >= 0 && fseek(f, 0, SEEK_SET) == 0) buf = malloc(size ? (size_t)size : 1);
  int rc;
  if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size)
    rc = fail(err, err_size, "%s: cannot read", path);
  else
    rc = parse(fx, path, buf, (size_t)size, err, err_size);
  free(buf);
  fclose(f);
  if (rc != 0) fixture_free(fx);
  return rc;
}

const fixture_record *fixture_find(const fixture *fx, const char *name) {
  for (size_t i = 0; i < fx->count; i++)
    if (strcmp(fx->records[i].name, name) == 0) return &fx->records[i];
  return NULL;
}

void fixture_free(fixture *fx) {
  for (size_t i = 0; i < fx->count; i++) {
    free(fx->records[i].name);
    free(fx->records[i].data);
  }
  free(fx->records);
  memset(fx, 0, sizeof *fx);
}
