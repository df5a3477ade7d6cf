/* Test helpers: write small IDX files (plain or gzip) into a private
 * temporary directory, byte by byte, independently of the reader. */
#ifndef DDP_TESTS_DATA_IDX_FILES_H
#define DDP_TESTS_DATA_IDX_FILES_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

/* A fresh directory under /tmp; the caller removes it with tmpdir_remove. */
static inline void tmpdir_make(char *dir, size_t bytes) {
  snprintf(dir, bytes, "/tmp/ddp-data-test-XXXXXX");
  if (!mkdtemp(dir)) abort();
}

static inline void tmpdir_remove(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
}

/* Writes `bytes` of raw content to path, gzip-compressed when gz. */
static inline void write_raw(const char *path, const void *data, size_t bytes, int gz) {
  if (gz) {
    gzFile f = gzopen(path, "wb");
    if (!f) abort();
    if (bytes && gzwrite(f, data, (unsigned)bytes) != (int)bytes) abort();
    if (gzclose(f) != Z_OK) abort();
  } else {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (bytes && fwrite(data, 1, bytes, f) != bytes) abort();
    if (fclose(f) != 0) abort();
  }
}

/* Builds an IDX image in memory: header (type, dims) then `data_bytes` of
 * data copied as given (already big-endian). Returns a malloc'd buffer and
 * its size in *total. */
static inline unsigned char *idx_build(int type, int ndim, const uint32_t *dims,
                                       const void *data, size_t data_bytes, size_t *total) {
  *total = 4 + 4 * (size_t)ndim + data_bytes;
  unsigned char *buf = malloc(*total ? *total : 1);
  if (!buf) abort();
  buf[0] = 0;
  buf[1] = 0;
  buf[2] = (unsigned char)type;
  buf[3] = (unsigned char)ndim;
  for (int d = 0; d < ndim; d++) {
    buf[4 + 4 * d] = (unsigned char)(dims[d] >> 24);
    buf[5 + 4 * d] = (unsigned char)(dims[d] >> 16);
    buf[6 + 4 * d] = (unsigned char)(dims[d] >> 8);
    buf[7 + 4 * d] = (unsigned char)dims[d];
  }
  if (data_bytes) memcpy(buf + 4 + 4 * ndim, data, data_bytes);
  return buf;
}

/* Writes an unsigned-byte IDX file of the given dims and data. */
static inline void write_idx_u8(const char *path, int ndim, const uint32_t *dims,
                                const uint8_t *data, size_t data_bytes, int gz) {
  size_t total;
  unsigned char *buf = idx_build(0x08, ndim, dims, data, data_bytes, &total);
  write_raw(path, buf, total, gz);
  free(buf);
}

#endif /* DDP_TESTS_DATA_IDX_FILES_H */
