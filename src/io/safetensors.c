/* safetensors files: the writer (header built here, data streamed through
 * an atomic file) and the validating reader. The format, from its public
 * spec: u64 little-endian header length N; N bytes of UTF-8 JSON, an object
 * of tensor entries {"dtype", "shape", "data_offsets": [begin, end]} plus an
 * optional "__metadata__" object of strings; then the data section, whose
 * offsets the entries give, tiled exactly by the tensors. The reference
 * writer pads the header with spaces so the data starts 8-byte aligned;
 * ddp does the same. */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; ddp's io layer assumes a little-endian host"
#endif

#define MAX_HEADER ((uint64_t)100 << 20) /* the reference implementation's limit */

/* safetensors dtype names and ddp's types. Valid names ddp has no type for
 * are listed so that their error says "unsupported", not "unknown". */
static const struct {
  const char *name;
  int dtype; /* ddp_dtype, or -1 */
} dtype_names[] = {
    {"F32", DDP_FLOAT32}, {"F64", DDP_FLOAT64},  {"I32", DDP_INT32}, {"I64", DDP_INT64},
    {"F16", DDP_FLOAT16}, {"BF16", DDP_BFLOAT16}, {"U8", DDP_UINT8},  {"BOOL", -1},
    {"I8", -1},           {"I16", -1},            {"U16", -1},        {"U32", -1},
    {"U64", -1},          {"F8_E4M3", -1},        {"F8_E5M2", -1},
};

const char *ddp_safetensors_dtype_name(ddp_dtype dtype) {
  for (size_t i = 0; i < sizeof dtype_names / sizeof *dtype_names; i++)
    if (dtype_names[i].dtype == (int)dtype) return dtype_names[i].name;
  return NULL;
}

/* ---- Writing ------------------------------------------------------------------ */

static int64_t entry_numel(const ddp_safetensors_entry *e) {
  int64_t n = 1;
  for (int d = 0; d < e->ndim; d++) n *= e->shape[d];
  return n;
}

static ddp_status check_entries(const char *path, const ddp_safetensors_entry *entries,
                                size_t count) {
  for (size_t i = 0; i < count; i++) {
    const ddp_safetensors_entry *e = &entries[i];
    if (!e->name || !e->name[0] || !strcmp(e->name, "__metadata__"))
      return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor %zu has the name \"%s\"", path,
                       i, e->name ? e->name : "(null)");
    if (!ddp_safetensors_dtype_name(e->dtype))
      return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor %s has dtype %d, not one ddp "
                       "can write", path, e->name, (int)e->dtype);
    if (e->ndim < 0 || e->ndim > DDP_MAX_DIMS)
      return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor %s has %d dimensions", path,
                       e->name, e->ndim);
    for (int d = 0; d < e->ndim; d++)
      if (e->shape[d] < 0)
        return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor %s has dimension %d = %lld",
                         path, e->name, d, (long long)e->shape[d]);
    if (entry_numel(e) > 0 && !e->data)
      return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor %s has no data", path, e->name);
    for (size_t j = 0; j < i; j++)
      if (!strcmp(entries[j].name, e->name))
        return ddp_error(DDP_ERR_INVALID, "safetensors: %s: tensor name %s appears twice", path,
                         e->name);
  }
  return DDP_OK;
}

/* The header JSON, padded with spaces so 8 + length is a multiple of 8.
 * Allocated; *len set. */
static ddp_status build_header(const char *path, const ddp_safetensors_entry *entries,
                               size_t count, const ddp_kv *metadata, size_t metadata_count,
                               char **out, size_t *len) {
  /* Every string can grow 6x when escaped; numbers take at most 20 digits. */
  size_t cap = 64;
  for (size_t i = 0; i < count; i++) cap += 6 * strlen(entries[i].name) + 64 + 22 * (DDP_MAX_DIMS + 2);
  for (size_t i = 0; i < metadata_count; i++)
    cap += 6 * (strlen(metadata[i].key) + strlen(metadata[i].value)) + 16;
  char *h = ddp_alloc(cap);
  if (!h) return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate the header", path);
  size_t n = 0;
  bool ok = true;
#define APPEND(...) (n += (size_t)snprintf(h + n, cap - n, __VA_ARGS__))
  APPEND("{");
  if (metadata_count) {
    APPEND("\"__metadata__\":{");
    for (size_t i = 0; i < metadata_count && ok; i++) {
      if (i) APPEND(",");
      ok = ddp__json_put_string(h, cap, &n, metadata[i].key);
      APPEND(":");
      ok = ok && ddp__json_put_string(h, cap, &n, metadata[i].value);
    }
    APPEND("}");
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < count && ok; i++) {
    const ddp_safetensors_entry *e = &entries[i];
    if (i || metadata_count) APPEND(",");
    ok = ddp__json_put_string(h, cap, &n, e->name);
    APPEND(":{\"dtype\":\"%s\",\"shape\":[", ddp_safetensors_dtype_name(e->dtype));
    for (int d = 0; d < e->ndim; d++) APPEND("%s%lld", d ? "," : "", (long long)e->shape[d]);
    uint64_t bytes = (uint64_t)entry_numel(e) * ddp_dtype_size(e->dtype);
    APPEND("],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
           (unsigned long long)(offset + bytes));
    offset += bytes;
  }
  APPEND("}");
#undef APPEND
  DDP_ASSERT(ok && n + 8 < cap);
  while ((8 + n) % 8 != 0) h[n++] = ' ';
  *out = h;
  *len = n;
  return DDP_OK;
}

ddp_status ddp__safetensors_write_temp(ddp__atomic_file *f, const char *path,
                                       const ddp_safetensors_entry *entries, size_t count,
                                       const ddp_kv *metadata, size_t metadata_count) {
  memset(f, 0, sizeof *f);
  f->fd = -1;
  DDP_TRY(check_entries(path, entries, count));
  char *header = NULL;
  size_t header_len = 0;
  DDP_TRY(build_header(path, entries, count, metadata, metadata_count, &header, &header_len));
  ddp_status s = ddp__atomic_open(f, path);
  if (s != DDP_OK) {
    ddp_free(header);
    return ddp_error_wrap(s, "safetensors");
  }
  uint8_t le[8];
  for (int i = 0; i < 8; i++) le[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
  s = ddp__atomic_write(f, le, sizeof le);
  if (s == DDP_OK) s = ddp__atomic_write(f, header, header_len);
  ddp_free(header);
  for (size_t i = 0; i < count && s == DDP_OK; i++) {
    size_t bytes = (size_t)entry_numel(&entries[i]) * ddp_dtype_size(entries[i].dtype);
    if (bytes) s = ddp__atomic_write(f, entries[i].data, bytes);
  }
  if (s == DDP_OK) s = ddp__atomic_finish(f);
  if (s != DDP_OK) {
    ddp__atomic_abort(f);
    return ddp_error_wrap(s, "safetensors");
  }
  return DDP_OK;
}

ddp_status ddp_safetensors_write(const char *path, const ddp_safetensors_entry *entries,
                                 size_t count, const ddp_kv *metadata, size_t metadata_count) {
  ddp__atomic_file f;
  DDP_TRY(ddp__safetensors_write_temp(&f, path, entries, count, metadata, metadata_count));
  ddp_status s = ddp__atomic_commit(&f);
  ddp__atomic_abort(&f);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "safetensors");
}

/* ---- Reading ------------------------------------------------------------------ */

typedef struct st_tensor {
  ddp_safetensors_tensor t;
  uint64_t begin, end;     /* in the data section */
  size_t entry_offset;     /* where its entry starts in the file */
} st_tensor;

struct ddp_safetensors {
  char *path;
  uint8_t *image;          /* the whole file */
  uint64_t size;
  uint64_t data_start;     /* 8 + header length */
  ddp__json_doc doc;       /* names and metadata strings live here */
  st_tensor *tensors;
  size_t count;
  const ddp__json *metadata; /* the "__metadata__" object or NULL */
};

void ddp_safetensors_free(ddp_safetensors *st) {
  if (!st) return;
  ddp__json_free(&st->doc);
  ddp_free(st->tensors);
  ddp_free(st->image);
  ddp_free(st->path);
  ddp_free(st);
}

static ddp_status bad(const ddp_safetensors *st, uint64_t offset, const char *tensor,
                      const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* "safetensors: PATH: <what> at offset N (tensor NAME)". */
static ddp_status bad(const ddp_safetensors *st, uint64_t offset, const char *tensor,
                      const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (tensor)
    return ddp_error(DDP_ERR_FORMAT, "safetensors: %s: %s at offset %llu (tensor %s)", st->path,
                     msg, (unsigned long long)offset, tensor);
  return ddp_error(DDP_ERR_FORMAT, "safetensors: %s: %s at offset %llu", st->path, msg,
                   (unsigned long long)offset);
}

static ddp_status read_image(ddp_safetensors *st) {
  int fd = open(st->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return ddp_error(e == ENOENT ? DDP_ERR_NOTFOUND : DDP_ERR_IO, "safetensors: %s: cannot open: %s",
                     st->path, strerror(e));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    int e = errno;
    close(fd);
    return ddp_error(DDP_ERR_IO, "safetensors: %s: %s", st->path,
                     S_ISDIR(sb.st_mode) ? "is a directory" : strerror(e));
  }
  st->size = (uint64_t)sb.st_size;
  st->image = ddp_alloc(st->size ? st->size : 1);
  if (!st->image) {
    close(fd);
    return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate %llu bytes", st->path,
                     (unsigned long long)st->size);
  }
  uint64_t got = 0;
  while (got < st->size) {
    ssize_t r = read(fd, st->image + got, st->size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = errno;
      close(fd);
      return ddp_error(DDP_ERR_IO, "safetensors: %s: read failed at offset %llu: %s", st->path,
                       (unsigned long long)got, r == 0 ? "file shrank while reading" : strerror(e));
    }
    got += (uint64_t)r;
  }
  close(fd);
  return DDP_OK;
}

/* A JSON array of non-negative integers into vals (at most max of them). */
static ddp_status read_ints(const ddp_safetensors *st, const ddp__json *a, const char *name,
                            const char *field, int max, int64_t *vals, int *n) {
  uint64_t at = 8 + a->offset;
  if (a->kind != DDP__JSON_ARRAY)
    return bad(st, at, name, "\"%s\" is %s, not an array", field, ddp__json_kind_name(a->kind));
  if (a->count > (size_t)max)
    return bad(st, at, name, "\"%s\" has %zu elements (at most %d)", field, a->count, max);
  int i = 0;
  for (const ddp__json *v = a->first; v; v = v->next, i++) {
    if (v->kind != DDP__JSON_NUMBER || !v->is_integer || v->integer < 0)
      return bad(st, 8 + v->offset, name, "\"%s\"[%d] is not a non-negative integer", field, i);
    vals[i] = v->integer;
  }
  *n = i;
  return DDP_OK;
}

static ddp_status parse_entry(ddp_safetensors *st, const ddp__json *e, st_tensor *out) {
  const char *name = e->key;
  uint64_t at = 8 + e->key_offset;
  if (e->kind != DDP__JSON_OBJECT)
    return bad(st, at, name, "entry is %s, not an object", ddp__json_kind_name(e->kind));
  for (const ddp__json *m = e->first; m; m = m->next)
    if (strcmp(m->key, "dtype") && strcmp(m->key, "shape") && strcmp(m->key, "data_offsets"))
      return bad(st, 8 + m->key_offset, name, "unknown field \"%s\" (an entry has dtype, shape "
                 "and data_offsets)", m->key);
  const ddp__json *dtype = ddp__json_get(e, "dtype"), *shape = ddp__json_get(e, "shape"),
                  *offsets = ddp__json_get(e, "data_offsets");
  if (!dtype || !shape || !offsets)
    return bad(st, at, name, "entry lacks \"%s\"", !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
  if (dtype->kind != DDP__JSON_STRING)
    return bad(st, 8 + dtype->offset, name, "\"dtype\" is %s, not a string",
               ddp__json_kind_name(dtype->kind));
  int code = -2;
  for (size_t i = 0; i < sizeof dtype_names / sizeof *dtype_names; i++)
    if (!strcmp(dtype_names[i].name, dtype->string)) code = dtype_names[i].dtype;
  if (code == -2)
    return bad(st, 8 + dtype->offset, name, "unknown dtype \"%s\" (safetensors has F64, F32, F16, "
               "BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL, F8_E4M3, F8_E5M2)", dtype->string);
  if (code == -1) {
    ddp_error(DDP_ERR_UNSUPPORTED, "safetensors: %s: dtype %s is valid but ddp has no such type "
              "(it reads F32, F64, F16, BF16, I64, I32, U8) at offset %llu (tensor %s)", st->path,
              dtype->string, (unsigned long long)(8 + dtype->offset), name);
    return DDP_ERR_UNSUPPORTED;
  }
  ddp_safetensors_tensor *t = &out->t;
  t->name = name;
  t->dtype = (ddp_dtype)code;
  int nd, no;
  int64_t off[2];
  DDP_TRY(read_ints(st, shape, name, "shape", DDP_MAX_DIMS, t->shape, &nd));
  DDP_TRY(read_ints(st, offsets, name, "data_offsets", 2, off, &no));
  if (no != 2)
    return bad(st, 8 + offsets->offset, name, "\"data_offsets\" has %d elements, not 2", no);
  t->ndim = nd;
  /* numel * size, refusing overflow: every factor is checked against what
   * the file could hold. */
  uint64_t bytes = ddp_dtype_size(t->dtype);
  int64_t numel = 1;
  for (int d = 0; d < nd; d++) {
    uint64_t dim = (uint64_t)t->shape[d];
    if (dim && bytes > st->size / dim)
      return bad(st, 8 + shape->offset, name, "shape's size exceeds the file (%llu bytes)",
                 (unsigned long long)st->size);
    bytes *= dim;
    numel *= t->shape[d];
  }
  if (numel == 0) bytes = 0;
  t->numel = numel;
  t->bytes = (size_t)bytes;
  if (off[0] > off[1])
    return bad(st, 8 + offsets->offset, name, "data_offsets [%lld, %lld] end before they begin",
               (long long)off[0], (long long)off[1]);
  if ((uint64_t)(off[1] - off[0]) != bytes) {
    char sh[160];
    size_t n = 0;
    n += (size_t)snprintf(sh + n, sizeof sh - n, "[");
    for (int d = 0; d < nd && n < sizeof sh; d++)
      n += (size_t)snprintf(sh + n, sizeof sh - n, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    if (n < sizeof sh) snprintf(sh + n, sizeof sh - n, "]");
    return bad(st, 8 + offsets->offset, name, "shape %s of %s needs %llu bytes but data_offsets "
               "[%lld, %lld] hold %lld", sh, dtype->string, (unsigned long long)bytes,
               (long long)off[0], (long long)off[1], (long long)(off[1] - off[0]));
  }
  out->begin = (uint64_t)off[0];
  out->end = (uint64_t)off[1];
  out->entry_offset = (size_t)at;
  return DDP_OK;
}

static int by_begin(const void *a, const void *b) {
  const st_tensor *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* The tensors must tile [0, data size): sorted by begin, each starts where
 * the previous ended and the last ends at the end of the file. */
static ddp_status check_tiling(ddp_safetensors *st) {
  uint64_t data_size = st->size - st->data_start;
  st_tensor *sorted = ddp_alloc((st->count ? st->count : 1) * sizeof *sorted);
  if (!sorted) return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate", st->path);
  memcpy(sorted, st->tensors, st->count * sizeof *sorted);
  qsort(sorted, st->count, sizeof *sorted, by_begin);
  ddp_status s = DDP_OK;
  uint64_t pos = 0;
  const char *prev = NULL;
  for (size_t i = 0; i < st->count && s == DDP_OK; i++) {
    const st_tensor *t = &sorted[i];
    if (t->end > data_size)
      s = bad(st, t->entry_offset, t->t.name, "data_offsets [%llu, %llu] reach past the data "
              "section's %llu bytes (the file ends at offset %llu: truncated?)",
              (unsigned long long)t->begin, (unsigned long long)t->end,
              (unsigned long long)data_size, (unsigned long long)st->size);
    else if (t->begin < pos)
      s = bad(st, t->entry_offset, t->t.name, "data_offsets [%llu, %llu] overlap tensor %s's "
              "bytes (which end at %llu)", (unsigned long long)t->begin,
              (unsigned long long)t->end, prev, (unsigned long long)pos);
    else if (t->begin > pos)
      s = bad(st, t->entry_offset, t->t.name, "data bytes [%llu, %llu) before it belong to no "
              "tensor", (unsigned long long)pos, (unsigned long long)t->begin);
    if (t->end > pos) {
      pos = t->end;
      prev = t->t.name;
    }
  }
  if (s == DDP_OK && pos != data_size)
    s = bad(st, st->data_start + pos, NULL, "%llu trailing bytes after the last tensor's data "
            "(the data section has %llu bytes, the tensors cover %llu)",
            (unsigned long long)(data_size - pos), (unsigned long long)data_size,
            (unsigned long long)pos);
  ddp_free(sorted);
  return s;
}

static ddp_status parse(ddp_safetensors *st) {
  if (st->size < 8)
    return bad(st, 0, NULL, "the file has %llu bytes, fewer than the 8-byte header length "
               "(empty or truncated)", (unsigned long long)st->size);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; i++) header_len |= (uint64_t)st->image[i] << (8 * i);
  if (header_len > MAX_HEADER)
    return bad(st, 0, NULL, "header length %llu exceeds the %llu-byte limit (not a safetensors "
               "file?)", (unsigned long long)header_len, (unsigned long long)MAX_HEADER);
  if (header_len > st->size - 8)
    return bad(st, 0, NULL, "header length %llu reaches past the end of the file (%llu bytes: "
               "truncated?)", (unsigned long long)header_len, (unsigned long long)st->size);
  st->data_start = 8 + header_len;
  const char *text = (const char *)st->image + 8;
  if (header_len == 0 || text[0] != '{')
    return bad(st, 8, NULL, "the header does not start with '{'");
  ddp_status s = ddp__json_parse(text, (size_t)header_len, 8, &st->doc);
  if (s != DDP_OK) return ddp_error_wrap(s, "safetensors: %s: header JSON", st->path);
  const ddp__json *root = st->doc.root;
  st->tensors = ddp_calloc(root->count ? root->count : 1, sizeof *st->tensors);
  if (!st->tensors) return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate", st->path);
  for (const ddp__json *e = root->first; e; e = e->next) {
    if (!strcmp(e->key, "__metadata__")) {
      if (e->kind != DDP__JSON_OBJECT)
        return bad(st, 8 + e->offset, NULL, "\"__metadata__\" is %s, not an object",
                   ddp__json_kind_name(e->kind));
      for (const ddp__json *m = e->first; m; m = m->next)
        if (m->kind != DDP__JSON_STRING)
          return bad(st, 8 + m->offset, NULL, "metadata \"%s\" is %s; metadata values are "
                     "strings", m->key, ddp__json_kind_name(m->kind));
      st->metadata = e;
      continue;
    }
    DDP_TRY(parse_entry(st, e, &st->tensors[st->count]));
    st->count++;
  }
  DDP_TRY(check_tiling(st));
  for (size_t i = 0; i < st->count; i++) {
    st_tensor *t = &st->tensors[i];
    t->t.file_offset = st->data_start + t->begin;
    t->t.data = st->image + t->t.file_offset;
  }
  return DDP_OK;
}

ddp_status ddp_safetensors_read(const char *path, ddp_safetensors **out) {
  *out = NULL;
  ddp_safetensors *st = ddp_calloc(1, sizeof *st);
  if (!st || !(st->path = ddp_strdup(path))) {
    ddp_free(st);
    return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate", path);
  }
  ddp_status s = read_image(st);
  if (s == DDP_OK) s = parse(st);
  if (s != DDP_OK) {
    ddp_safetensors_free(st);
    return s;
  }
  *out = st;
  return DDP_OK;
}

ddp_status ddp__safetensors_from_bytes(const char *name, const void *bytes, size_t size,
                                       ddp_safetensors **out) {
  *out = NULL;
  ddp_safetensors *st = ddp_calloc(1, sizeof *st);
  if (!st || !(st->path = ddp_strdup(name)) || !(st->image = ddp_alloc(size ? size : 1))) {
    ddp_safetensors_free(st);
    return ddp_error(DDP_ERR_NOMEM, "safetensors: %s: cannot allocate", name);
  }
  if (size) memcpy(st->image, bytes, size);
  st->size = size;
  ddp_status s = parse(st);
  if (s != DDP_OK) {
    ddp_safetensors_free(st);
    return s;
  }
  *out = st;
  return DDP_OK;
}

size_t ddp_safetensors_count(const ddp_safetensors *st) { return st->count; }

const char *ddp_safetensors_path(const ddp_safetensors *st) { return st->path; }

ddp_status ddp_safetensors_get(const ddp_safetensors *st, size_t index,
                               ddp_safetensors_tensor *out) {
  if (index >= st->count)
    return ddp_error(DDP_ERR_RANGE, "safetensors: %s: tensor index %zu of %zu", st->path, index,
                     st->count);
  *out = st->tensors[index].t;
  return DDP_OK;
}

ddp_status ddp_safetensors_find(const ddp_safetensors *st, const char *name,
                                ddp_safetensors_tensor *out) {
  for (size_t i = 0; i < st->count; i++)
    if (!strcmp(st->tensors[i].t.name, name)) {
      *out = st->tensors[i].t;
      return DDP_OK;
    }
  return ddp_error(DDP_ERR_NOTFOUND, "safetensors: %s: no tensor %s", st->path, name);
}

const char *ddp_safetensors_metadata(const ddp_safetensors *st, const char *key) {
  const ddp__json *v = ddp__json_get(st->metadata, key);
  return v ? v->string : NULL;
}
