/* Helpers for the io tests (include after cmocka.h): a scratch directory, whole-file reads and
 * writes, and a model's state as one byte string to compare. Tests only. */
#ifndef DDP_TEST_IO_UTIL_H
#define DDP_TEST_IO_UTIL_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "data/idx_files.h"

/* A fresh scratch directory per test (tests/data's tmpdir helpers). */
static char dir[256];

static int setup(void **state) {
  (void)state;
  tmpdir_make(dir, sizeof dir);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  tmpdir_remove(dir);
  return 0;
}

/* Number of entries in dir other than . and .. */
static inline int dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* The whole file, malloc'ed (NULL if it cannot be read); *size set. */
static inline unsigned char *slurp(const char *path, size_t *size) {
  *size = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc((size_t)n + 1);
  if (fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
  fclose(f);
  *size = (size_t)n;
  return buf;
}

static inline void spit(const char *path, const void *data, size_t size) {
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  if (size && fwrite(data, 1, size, f) != size) abort();
  if (fclose(f) != 0) abort();
}

/* Every state entry's bytes, concatenated (malloc'ed); *size set. */
static inline unsigned char *model_bytes(const ddp_model *m, size_t *size) {
  size_t total = 0;
  for (int i = 0; i < ddp_model_state_count(m); i++) {
    ddp_state_entry e;
    ddp_model_state_entry(m, i, &e);
    total += (size_t)e.numel * ddp_dtype_size(e.dtype);
  }
  unsigned char *buf = malloc(total + 1), *p = buf;
  for (int i = 0; i < ddp_model_state_count(m); i++) {
    ddp_state_entry e;
    ddp_model_state_entry(m, i, &e);
    size_t b = (size_t)e.numel * ddp_dtype_size(e.dtype);
    memcpy(p, e.data, b);
    p += b;
  }
  *size = total;
  return buf;
}

#endif
