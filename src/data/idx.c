/* The IDX reader: one whole MNIST-format file, plain or gzip, into memory.
 * Nothing read from the file is trusted before it is checked: the header's
 * dimensions must multiply without overflow to exactly the bytes that follow,
 * and memory grows with the data actually read, never with what a header
 * claims. Errors read "idx: <path>: <what> ... offset <n>". */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "ddp/data.h"

/* A gzip file grows its buffer from here (doubling, capped at the size the
 * header implies), so a lying header cannot make us allocate gigabytes. */
#define IDX_GZ_INITIAL_BYTES ((size_t)64 << 20)
#define IDX_GZ_BUFFER_BYTES (256u << 10)

/* The source of bytes: a plain file descriptor or a zlib stream. `offset`
 * counts (decompressed) bytes consumed so far. */
typedef struct idx_stream {
  const char *path;
  int fd;
  gzFile gz;
  int64_t file_bytes; /* plain files: size from fstat; gzip: compressed size */
  size_t offset;
} idx_stream;

const char *ddp_idx_type_name(int type_code) {
  switch (type_code) {
    case DDP_IDX_UBYTE: return "unsigned byte";
    case DDP_IDX_SBYTE: return "signed byte";
    case DDP_IDX_SHORT: return "short";
    case DDP_IDX_INT: return "int";
    case DDP_IDX_FLOAT: return "float";
    case DDP_IDX_DOUBLE: return "double";
    default: return "unknown";
  }
}

size_t ddp_idx_type_size(int type_code) {
  switch (type_code) {
    case DDP_IDX_UBYTE:
    case DDP_IDX_SBYTE: return 1;
    case DDP_IDX_SHORT: return 2;
    case DDP_IDX_INT:
    case DDP_IDX_FLOAT: return 4;
    case DDP_IDX_DOUBLE: return 8;
    default: return 0;
  }
}

void ddp_idx_free(ddp_idx *idx) {
  if (!idx) return;
  ddp_free(idx->data);
  memset(idx, 0, sizeof *idx);
}

/* zlib's message without its "<fd:3>: " prefix. */
static const char *gz_message(gzFile gz, int *zerr) {
  const char *msg = gzerror(gz, zerr);
  const char *colon = strncmp(msg, "<fd:", 4) == 0 ? strstr(msg, ">: ") : NULL;
  return colon ? colon + 3 : msg;
}

/* Reads up to `bytes` into buf; *got < bytes only at the end of the data.
 * A gzip stream that is corrupted or cut short is DDP_ERR_IO. */
static ddp_status stream_read(idx_stream *s, void *buf, size_t bytes, size_t *got) {
  char *p = buf;
  *got = 0;
  while (*got < bytes) {
    size_t want = bytes - *got;
    if (want > (1u << 30)) want = 1u << 30;
    if (s->gz) {
      int n = gzread(s->gz, p + *got, (unsigned)want);
      if (n < 0 || (n == 0 && !gzeof(s->gz))) {
        int zerr = Z_OK;
        const char *msg = gz_message(s->gz, &zerr);
        if (zerr == Z_ERRNO)
          return ddp_error(DDP_ERR_IO, "idx: %s: read failed at offset %zu: %s", s->path,
                           s->offset + *got, strerror(errno));
        /* zlib inflates ahead of what it hands out, so both offsets are
         * where reading stood, not the damaged byte itself. */
        return ddp_error(DDP_ERR_IO,
                         "idx: %s: corrupted gzip stream: %s (near compressed offset %lld; "
                         "%zu decompressed bytes read before it)",
                         s->path, msg, (long long)gzoffset(s->gz), s->offset + *got);
      }
      if (n == 0) {
        /* zlib reports a stream cut short as a soft error at the end. */
        int zerr = Z_OK;
        const char *msg = gz_message(s->gz, &zerr);
        if (zerr != Z_OK)
          return ddp_error(DDP_ERR_IO,
                           "idx: %s: corrupted gzip stream: %s after %zu decompressed bytes "
                           "(the .gz file is cut short or damaged)",
                           s->path, msg, s->offset + *got);
        break;
      }
      *got += (size_t)n;
    } else {
      ssize_t n = read(s->fd, p + *got, want);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ddp_error(DDP_ERR_IO, "idx: %s: read failed at offset %zu: %s", s->path,
                         s->offset + *got, strerror(errno));
      }
      if (n == 0) break;
      *got += (size_t)n;
    }
  }
  s->offset += *got;
  return DDP_OK;
}

/* Opens `path`, choosing zlib when the first two bytes are the gzip magic. */
static ddp_status stream_open(idx_stream *s, const char *path) {
  memset(s, 0, sizeof *s);
  s->path = path;
  s->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (s->fd < 0) {
    int e = errno;
    return ddp_error(e == ENOENT || e == ENOTDIR ? DDP_ERR_NOTFOUND : DDP_ERR_IO,
                     "idx: %s: cannot open: %s", path, strerror(e));
  }
  struct stat st;
  if (fstat(s->fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    int e = S_ISDIR(st.st_mode) ? EISDIR : errno;
    close(s->fd);
    s->fd = -1;
    return ddp_error(DDP_ERR_IO, "idx: %s: cannot read: %s", path, strerror(e));
  }
  s->file_bytes = (int64_t)st.st_size;
  unsigned char magic[2];
  size_t got;
  ddp_status status = stream_read(s, magic, 2, &got);
  if (status != DDP_OK) {
    close(s->fd);
    s->fd = -1;
    return status;
  }
  s->offset = 0;
  if (lseek(s->fd, 0, SEEK_SET) != 0) {
    int e = errno;
    close(s->fd);
    s->fd = -1;
    return ddp_error(DDP_ERR_IO, "idx: %s: cannot seek: %s", path, strerror(e));
  }
  if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
    /* zlib takes the descriptor and closes it in gzclose. */
    s->gz = gzdopen(s->fd, "rb");
    if (!s->gz) {
      close(s->fd);
      s->fd = -1;
      return ddp_error(DDP_ERR_NOMEM, "idx: %s: cannot start the gzip decoder", path);
    }
    s->fd = -1;
    gzbuffer(s->gz, IDX_GZ_BUFFER_BYTES);
  }
  return DDP_OK;
}

static void stream_close(idx_stream *s) {
  if (s->gz) gzclose(s->gz);
  if (s->fd >= 0) close(s->fd);
  s->gz = NULL;
  s->fd = -1;
}

/* "60000 labels", "60000 images of 28x28", "5 items of 2x3x4". */
static void describe_items(const ddp_idx *h, char *buf, size_t bytes) {
  int n = 0;
  const char *noun = "items";
  if (h->type == DDP_IDX_UBYTE && h->ndim == 1) noun = "labels";
  if (h->type == DDP_IDX_UBYTE && h->ndim == 3) noun = "images";
  n = snprintf(buf, bytes, "%lld %s", (long long)h->dims[0], noun);
  for (int d = 1; d < h->ndim && n > 0 && (size_t)n < bytes; d++)
    n += snprintf(buf + n, bytes - (size_t)n, "%s%lld", d == 1 ? " of " : "x",
                  (long long)h->dims[d]);
}

/* Byte-swaps big-endian elements into host order in place. */
static void to_host_order(void *data, int64_t numel, size_t elem_size) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  unsigned char *p = data;
  for (int64_t i = 0; i < numel; i++, p += elem_size)
    for (size_t a = 0, b = elem_size - 1; a < b; a++, b--) {
      unsigned char t = p[a];
      p[a] = p[b];
      p[b] = t;
    }
#else
  (void)data;
  (void)numel;
  (void)elem_size;
#endif
}

/* Parses and checks the header; on success h describes the data that must
 * follow (h->data still NULL). */
static ddp_status read_header(idx_stream *s, ddp_idx *h) {
  unsigned char head[4 + 4 * DDP_IDX_MAX_DIMS];
  size_t got;
  DDP_TRY(stream_read(s, head, 4, &got));
  if (got == 0) return ddp_error(DDP_ERR_FORMAT, "idx: %s: empty file (no IDX header)", s->path);
  if (got < 4)
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: truncated header: the data ends at offset %zu, an IDX header "
                     "needs at least 4 bytes",
                     s->path, got);
  if (head[0] != 0 || head[1] != 0)
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: bad magic 0x%02x%02x%02x%02x at offset 0: an IDX file starts "
                     "with two zero bytes, a type code and the number of dimensions",
                     s->path, head[0], head[1], head[2], head[3]);
  int type = head[2], ndim = head[3];
  h->elem_size = ddp_idx_type_size(type);
  if (h->elem_size == 0)
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: unknown type code 0x%02x at offset 2 (expected 0x08 unsigned "
                     "byte, 0x09, 0x0b, 0x0c, 0x0d or 0x0e)",
                     s->path, type);
  if (ndim < 1 || ndim > DDP_IDX_MAX_DIMS)
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: %d dimensions at offset 3 (ddp reads 1 to %d)", s->path, ndim,
                     DDP_IDX_MAX_DIMS);
  h->type = (ddp_idx_type)type;
  h->ndim = ndim;
  h->header_bytes = 4 + 4 * (size_t)ndim;
  DDP_TRY(stream_read(s, head + 4, 4 * (size_t)ndim, &got));
  if (got < 4 * (size_t)ndim)
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: truncated header: %d dimensions need %zu header bytes but the "
                     "data ends at offset %zu",
                     s->path, ndim, h->header_bytes, 4 + got);
  /* Element count and byte size must fit comfortably in int64 / size_t:
   * a header of 0xffffffff dimensions is an overflow attempt, not data. */
  uint64_t numel = 1, bytes;
  for (int d = 0; d < ndim; d++) {
    const unsigned char *b = head + 4 + 4 * d;
    uint32_t dim = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    h->dims[d] = dim;
    if (__builtin_mul_overflow(numel, (uint64_t)dim, &numel) || numel > (UINT64_C(1) << 56))
      return ddp_error(DDP_ERR_FORMAT,
                       "idx: %s: dimension %d (%u, at offset %d) makes the element count "
                       "overflow: the header cannot describe real data",
                       s->path, d, dim, 4 + 4 * d);
  }
  if (__builtin_mul_overflow(numel, (uint64_t)h->elem_size, &bytes) ||
      bytes > (UINT64_C(1) << 56))
    return ddp_error(DDP_ERR_FORMAT, "idx: %s: data size overflows (%llu elements of %zu bytes)",
                     s->path, (unsigned long long)numel, h->elem_size);
  h->numel = (int64_t)numel;
  return DDP_OK;
}

/* Reads exactly `expected` data bytes into a buffer that grows as the data
 * arrives; reports truncation with the offset where the data ended. With
 * `prefix`, the data may go on past `expected` (the file's first items
 * only): nothing after them is read. */
static ddp_status read_data(idx_stream *s, ddp_idx *h, size_t expected, bool prefix) {
  char what[96];
  describe_items(h, what, sizeof what);
  if (!s->gz) {
    /* A plain file's size is known: check it before allocating anything. */
    uint64_t have = s->file_bytes > (int64_t)h->header_bytes
                        ? (uint64_t)s->file_bytes - h->header_bytes
                        : 0;
    if (have < expected)
      return ddp_error(DDP_ERR_FORMAT,
                       "idx: %s: truncated: header says %s (%zu bytes) but the data ends at "
                       "offset %zu + %llu",
                       s->path, what, expected, h->header_bytes, (unsigned long long)have);
    if (have > expected && !prefix)
      return ddp_error(DDP_ERR_FORMAT,
                       "idx: %s: trailing data: header says %s, so the data ends at offset "
                       "%zu + %zu, but the file has %llu more bytes",
                       s->path, what, h->header_bytes, expected,
                       (unsigned long long)(have - expected));
  }
  size_t capacity = expected;
  if (s->gz && capacity > IDX_GZ_INITIAL_BYTES) capacity = IDX_GZ_INITIAL_BYTES;
  char *buf = ddp_alloc(capacity ? capacity : 1);
  if (!buf)
    return ddp_error(DDP_ERR_NOMEM, "idx: %s: cannot allocate %zu bytes", s->path, capacity);
  size_t filled = 0;
  for (;;) {
    size_t got;
    ddp_status status = stream_read(s, buf + filled, capacity - filled, &got);
    if (status != DDP_OK) {
      ddp_free(buf);
      return status;
    }
    filled += got;
    if (filled < capacity || capacity == expected) break;
    size_t grown = capacity * 2 < expected ? capacity * 2 : expected;
    char *bigger = ddp_alloc(grown);
    if (!bigger) {
      ddp_free(buf);
      return ddp_error(DDP_ERR_NOMEM, "idx: %s: cannot allocate %zu bytes", s->path, grown);
    }
    memcpy(bigger, buf, filled);
    ddp_free(buf);
    buf = bigger;
    capacity = grown;
  }
  if (filled < expected) {
    ddp_free(buf);
    return ddp_error(DDP_ERR_FORMAT,
                     "idx: %s: truncated: header says %s (%zu bytes) but the data ends at "
                     "offset %zu + %zu",
                     s->path, what, expected, h->header_bytes, filled);
  }
  if (s->gz && !prefix) {
    /* Anything after the data means the header and the data disagree. */
    char tail[4096];
    size_t extra = 0, got;
    do {
      ddp_status status = stream_read(s, tail, sizeof tail, &got);
      if (status != DDP_OK) {
        ddp_free(buf);
        return status;
      }
      extra += got;
    } while (got == sizeof tail);
    if (extra) {
      ddp_free(buf);
      return ddp_error(DDP_ERR_FORMAT,
                       "idx: %s: trailing data: header says %s, so the data ends at offset "
                       "%zu + %zu, but the file has %zu more bytes",
                       s->path, what, h->header_bytes, expected, extra);
    }
  }
  h->data = buf;
  return DDP_OK;
}

ddp_status ddp_idx_read(const char *path, ddp_idx *out) { return ddp_idx_read_first(path, 0, out); }

ddp_status ddp_idx_read_first(const char *path, int64_t max_items, ddp_idx *out) {
  memset(out, 0, sizeof *out);
  if (!path || !*path) return ddp_error(DDP_ERR_INVALID, "idx: no path given");
  if (max_items < 0)
    return ddp_error(DDP_ERR_INVALID, "idx: %s: max_items is %lld (0 for all, or more)", path,
                     (long long)max_items);
  idx_stream s;
  DDP_TRY(stream_open(&s, path));
  ddp_idx h;
  memset(&h, 0, sizeof h);
  ddp_status status = read_header(&s, &h);
  /* The first max_items along dimension 0: the leading slice of the data. */
  const bool prefix = status == DDP_OK && max_items > 0 && max_items < h.dims[0];
  if (prefix) {
    h.numel = h.numel / h.dims[0] * max_items;
    h.dims[0] = max_items;
  }
  if (status == DDP_OK) status = read_data(&s, &h, (size_t)h.numel * h.elem_size, prefix);
  stream_close(&s);
  if (status != DDP_OK) return status;
  if (h.elem_size > 1) to_host_order(h.data, h.numel, h.elem_size);
  *out = h;
  return DDP_OK;
}
