/* data: the IDX reader and the datasets. Round trips on files the test
 * writes byte by byte, every malformed-input error (status, file name,
 * offset), the real Fashion-MNIST files against values read with Python's
 * gzip module, and the synthetic datasets. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "ddp/data.h"
#include "data/idx_files.h"

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

static char dir[256]; /* a fresh temporary directory per test */

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

static void path_of(char *out, size_t bytes, const char *name) {
  snprintf(out, bytes, "%s/%s", dir, name);
}

/* Asserts the last error contains every given fragment (NULL-terminated). */
static void assert_error_mentions(const char *first, ...) {
  const char *msg = ddp_last_error();
  va_list ap;
  va_start(ap, first);
  for (const char *frag = first; frag; frag = va_arg(ap, const char *)) {
    if (!strstr(msg, frag)) {
      fprintf(stderr, "error message \"%s\"\n  lacks \"%s\"\n", msg, frag);
      fail();
    }
  }
  va_end(ap);
}

/* ---- Round trips ---------------------------------------------------------- */

static void roundtrip_u8(int gz) {
  char path[512];
  path_of(path, sizeof path, gz ? "images.gz" : "images");
  const uint32_t dims[3] = {5, 4, 3};
  uint8_t data[60];
  for (int i = 0; i < 60; i++) data[i] = (uint8_t)(i * 37 + 11);
  write_idx_u8(path, 3, dims, data, sizeof data, gz);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_OK);
  assert_int_equal(idx.type, DDP_IDX_UBYTE);
  assert_int_equal(idx.ndim, 3);
  assert_int_equal(idx.dims[0], 5);
  assert_int_equal(idx.dims[1], 4);
  assert_int_equal(idx.dims[2], 3);
  assert_int_equal(idx.numel, 60);
  assert_int_equal(idx.header_bytes, 16);
  assert_memory_equal(idx.data, data, 60);
  ddp_idx_free(&idx);
  assert_null(idx.data);
}

static void test_roundtrip_plain(void **state) {
  (void)state;
  roundtrip_u8(0);
}

static void test_roundtrip_gzip(void **state) {
  (void)state;
  roundtrip_u8(1);
}

/* Multi-byte types are big-endian on disk and host order in memory. A gzip
 * file with a misleading name is still recognised by its magic bytes. */
static void test_roundtrip_wide_types(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "ints.idx"); /* gzip inside, no .gz in the name */
  const uint32_t dims[1] = {3};
  const unsigned char be_ints[12] = {0x00, 0x00, 0x00, 0x01, 0xff, 0xff, 0xff, 0xfe,
                                     0x12, 0x34, 0x56, 0x78};
  size_t total;
  unsigned char *buf = idx_build(0x0C, 1, dims, be_ints, sizeof be_ints, &total);
  write_raw(path, buf, total, 1);
  free(buf);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_OK);
  assert_int_equal(idx.type, DDP_IDX_INT);
  const int32_t *v = idx.data;
  assert_int_equal(v[0], 1);
  assert_int_equal(v[1], -2);
  assert_int_equal(v[2], 0x12345678);
  ddp_idx_free(&idx);

  path_of(path, sizeof path, "floats");
  const unsigned char be_floats[8] = {0x3f, 0x80, 0x00, 0x00, 0xc0, 0x49, 0x0f, 0xdb};
  const uint32_t fdims[2] = {1, 2};
  buf = idx_build(0x0D, 2, fdims, be_floats, sizeof be_floats, &total);
  write_raw(path, buf, total, 0);
  free(buf);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_OK);
  const float *f = idx.data;
  assert_true(f[0] == 1.0f);
  assert_true(f[1] == -3.14159274f);
  ddp_idx_free(&idx);
}

/* ---- Malformed files ------------------------------------------------------ */

static void test_wrong_magic(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "magic");
  const unsigned char bytes[12] = {0x01, 0x02, 0x08, 0x01, 0, 0, 0, 4, 1, 2, 3, 4};
  write_raw(path, bytes, sizeof bytes, 0);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "bad magic 0x01020801", "offset 0", NULL);
  assert_null(idx.data);
}

static void test_wrong_type_code(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "type");
  const unsigned char bytes[9] = {0, 0, 0x07, 0x01, 0, 0, 0, 1, 9};
  write_raw(path, bytes, sizeof bytes, 1);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "unknown type code 0x07", "offset 2", NULL);
}

static void test_too_many_dims(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "ndim");
  const unsigned char bytes[4] = {0, 0, 0x08, 0x09};
  write_raw(path, bytes, sizeof bytes, 0);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "9 dimensions at offset 3", NULL);
}

static void test_truncated_header(void **state) {
  (void)state;
  char path[512];
  ddp_idx idx;
  /* Three dimensions announced, only one and a half present. */
  path_of(path, sizeof path, "header");
  const unsigned char bytes[10] = {0, 0, 0x08, 0x03, 0, 0, 0, 5, 0, 0};
  write_raw(path, bytes, sizeof bytes, 0);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "truncated header", "need 16 header bytes",
                        "data ends at offset 10", NULL);
  /* Shorter than the fixed 4 bytes, inside gzip. */
  path_of(path, sizeof path, "header.gz");
  write_raw(path, bytes, 3, 1);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "truncated header", "offset 3", NULL);
  /* Empty. */
  path_of(path, sizeof path, "empty");
  write_raw(path, bytes, 0, 0);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "empty file", NULL);
}

static void truncated_data(int gz) {
  char path[512];
  path_of(path, sizeof path, gz ? "train-labels-idx1-ubyte.gz" : "train-labels-idx1-ubyte");
  const uint32_t dims[1] = {10};
  const uint8_t labels[7] = {1, 2, 3, 4, 5, 6, 7};
  write_idx_u8(path, 1, dims, labels, sizeof labels, gz);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path,
                        "truncated: header says 10 labels (10 bytes) but the data ends at "
                        "offset 8 + 7",
                        NULL);
  assert_null(idx.data);
}

static void test_truncated_data_plain(void **state) {
  (void)state;
  truncated_data(0);
}

static void test_truncated_data_gzip(void **state) {
  (void)state;
  truncated_data(1);
}

static void test_truncated_images(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "images-short");
  const uint32_t dims[3] = {3, 2, 2};
  const uint8_t px[11] = {0};
  write_idx_u8(path, 3, dims, px, sizeof px, 0);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "header says 3 images of 2x2 (12 bytes)", "offset 16 + 11", NULL);
}

static void trailing_garbage(int gz) {
  char path[512];
  path_of(path, sizeof path, gz ? "trail.gz" : "trail");
  const uint32_t dims[1] = {4};
  const uint8_t labels[7] = {1, 2, 3, 4, 0xde, 0xad, 0xbe};
  write_idx_u8(path, 1, dims, labels, sizeof labels, gz);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "trailing data", "offset 8 + 4", "3 more bytes", NULL);
}

static void test_trailing_garbage_plain(void **state) {
  (void)state;
  trailing_garbage(0);
}

static void test_trailing_garbage_gzip(void **state) {
  (void)state;
  trailing_garbage(1);
}

/* Dimensions whose product overflows 64 bits must be rejected at the header,
 * and a huge but representable claim must not be believed (no allocation of
 * what the header says: the data simply ends early). */
static void test_overflowing_dims(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "overflow");
  const uint32_t dims[3] = {0xffffffffu, 0xffffffffu, 0xffffffffu};
  const uint8_t px[4] = {0};
  write_idx_u8(path, 3, dims, px, sizeof px, 0);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "dimension 1 (4294967295, at offset 8)", "overflow", NULL);

  path_of(path, sizeof path, "huge.gz");
  const uint32_t huge[2] = {0x7fffffffu, 0x100000u};
  write_idx_u8(path, 2, huge, px, sizeof px, 1);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
  assert_error_mentions(path, "truncated", "2251799812636672 bytes", "offset 12 + 4", NULL);
}

static void gzip_of_labels(const char *path, unsigned char **out, size_t *bytes) {
  const uint32_t dims[1] = {4000};
  uint8_t labels[4000];
  for (int i = 0; i < 4000; i++) labels[i] = (uint8_t)((i * 7919) % 10);
  write_idx_u8(path, 1, dims, labels, sizeof labels, 1);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  *bytes = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  *out = malloc(*bytes);
  assert_int_equal(fread(*out, 1, *bytes, f), *bytes);
  fclose(f);
}

static void test_corrupted_gzip(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "corrupt.gz");
  unsigned char *gz;
  size_t bytes;
  gzip_of_labels(path, &gz, &bytes);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_OK); /* intact first */
  ddp_idx_free(&idx);

  /* A damaged checksum in the gzip trailer (CRC32 is the last 8..4 bytes). */
  gz[bytes - 6] ^= 0x5a;
  write_raw(path, gz, bytes, 0);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_IO);
  assert_error_mentions(path, "corrupted gzip stream", "incorrect data check", NULL);
  gz[bytes - 6] ^= 0x5a;

  /* Garbage in the middle of the deflate data. */
  for (size_t i = bytes / 2; i < bytes / 2 + 8; i++) gz[i] = 0xff;
  write_raw(path, gz, bytes, 0);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_IO);
  assert_error_mentions(path, "corrupted gzip stream", "near compressed offset", NULL);
  assert_null(idx.data);

  /* A .gz file cut in half. */
  path_of(path, sizeof path, "cut.gz");
  free(gz);
  gzip_of_labels(path, &gz, &bytes); /* fresh copy */
  write_raw(path, gz, bytes / 2, 0);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_IO);
  assert_error_mentions(path, "corrupted gzip stream", "cut short", NULL);
  free(gz);
}

static void test_missing_file(void **state) {
  (void)state;
  char path[512];
  path_of(path, sizeof path, "no-such-file-idx1-ubyte.gz");
  ddp_idx idx;
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_NOTFOUND);
  assert_error_mentions(path, "cannot open", "No such file", NULL);
  assert_int_equal(ddp_idx_read(dir, &idx), DDP_ERR_IO); /* a directory is no file */
  assert_error_mentions(dir, "Is a directory", NULL);
}

/* ---- Datasets from IDX files --------------------------------------------- */

/* Writes an MNIST-style pair into dir with the given label bytes. */
static void write_pair(const char *images_name, const char *labels_name, uint32_t n,
                       const uint8_t *labels, int gz) {
  char path[512];
  const uint32_t idims[3] = {n, 2, 3};
  uint8_t *px = malloc(n * 6);
  for (uint32_t i = 0; i < n * 6; i++) px[i] = (uint8_t)(i * 13);
  path_of(path, sizeof path, images_name);
  write_idx_u8(path, 3, idims, px, n * 6, gz);
  path_of(path, sizeof path, labels_name);
  const uint32_t ldims[1] = {n};
  write_idx_u8(path, 1, ldims, labels, n, gz);
  free(px);
}

static void test_dataset_dir_mnist_names(void **state) {
  (void)state;
  const uint8_t labels[4] = {3, 1, 4, 1};
  /* MNIST's plain names for train, the dotted variant for test. */
  write_pair("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 4, labels, 0);
  write_pair("t10k-images.idx3-ubyte", "t10k-labels.idx1-ubyte", 4, labels, 1);
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TRAIN), DDP_OK);
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  assert_int_equal(info->num_samples, 4);
  assert_int_equal(info->input_ndim, 3);
  assert_int_equal(info->input_shape[0], 1);
  assert_int_equal(info->input_shape[1], 2);
  assert_int_equal(info->input_shape[2], 3);
  assert_int_equal(info->input_storage, DDP_UINT8);
  assert_int_equal(info->target_dtype, DDP_INT64);
  assert_int_equal(info->num_classes, 10);
  float x[6];
  int64_t y;
  assert_int_equal(ddp_dataset_get(ds, 2, x, &y), DDP_OK);
  assert_int_equal(y, 4);
  for (int k = 0; k < 6; k++) assert_true(x[k] == (float)(uint8_t)((12 + k) * 13) / 255.0f);
  assert_int_equal(ddp_dataset_get(ds, 4, x, &y), DDP_ERR_RANGE);
  ddp_dataset_destroy(ds);
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TEST), DDP_OK);
  assert_int_equal(ddp_dataset_size(ds), 4);
  ddp_dataset_destroy(ds);
}

/* ddp_idx_read_first: the leading items only, plain and gzip; what follows
 * them is not read (a file cut short after them reads), 0 or too many
 * means all, a negative count is refused. */
static void read_first(int gz) {
  char path[512];
  path_of(path, sizeof path, gz ? "first.gz" : "first");
  const uint32_t dims[3] = {5, 4, 3};
  uint8_t data[60];
  for (int i = 0; i < 60; i++) data[i] = (uint8_t)(i * 37 + 11);
  write_idx_u8(path, 3, dims, data, sizeof data, gz);
  ddp_idx idx;
  assert_int_equal(ddp_idx_read_first(path, 2, &idx), DDP_OK);
  assert_int_equal(idx.dims[0], 2);
  assert_int_equal(idx.dims[1], 4);
  assert_int_equal(idx.numel, 24);
  assert_memory_equal(idx.data, data, 24);
  ddp_idx_free(&idx);
  for (int64_t all = 0; all <= 9; all += 9) {
    assert_int_equal(ddp_idx_read_first(path, all, &idx), DDP_OK);
    assert_int_equal(idx.dims[0], 5);
    assert_memory_equal(idx.data, data, 60);
    ddp_idx_free(&idx);
  }
  assert_int_equal(ddp_idx_read_first(path, -1, &idx), DDP_ERR_INVALID);
  /* Cut short in the fourth item: the first three read, all does not. */
  write_idx_u8(path, 3, dims, data, 40, gz);
  assert_int_equal(ddp_idx_read_first(path, 3, &idx), DDP_OK);
  assert_memory_equal(idx.data, data, 36);
  ddp_idx_free(&idx);
  assert_int_equal(ddp_idx_read(path, &idx), DDP_ERR_FORMAT);
}

static void test_read_first_plain(void **state) {
  (void)state;
  read_first(0);
}

static void test_read_first_gzip(void **state) {
  (void)state;
  read_first(1);
}

/* ddp_dataset_open_idx_dir_first is open + truncate: the same first samples;
 * labels past them are not read, so not checked either. */
static void test_dataset_dir_first(void **state) {
  (void)state;
  const uint8_t labels[6] = {3, 1, 4, 1, 5, 10};
  write_pair("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 6, labels, 1);
  ddp_dataset *first, *all;
  assert_int_equal(ddp_dataset_open_idx_dir_first(&first, dir, DDP_SPLIT_TRAIN, 5), DDP_OK);
  assert_int_equal(ddp_dataset_size(first), 5);
  assert_int_equal(ddp_dataset_open_idx_dir(&all, dir, DDP_SPLIT_TRAIN), DDP_ERR_RANGE);
  const uint8_t fine[6] = {3, 1, 4, 1, 5, 9};
  write_pair("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 6, fine, 1);
  ddp_dataset_destroy(first);
  assert_int_equal(ddp_dataset_open_idx_dir_first(&first, dir, DDP_SPLIT_TRAIN, 4), DDP_OK);
  assert_int_equal(ddp_dataset_open_idx_dir(&all, dir, DDP_SPLIT_TRAIN), DDP_OK);
  assert_int_equal(ddp_dataset_truncate(all, 4), DDP_OK);
  const ddp_dataset_info *a = ddp_dataset_get_info(first), *b = ddp_dataset_get_info(all);
  assert_int_equal(a->num_samples, 4);
  assert_int_equal(b->num_samples, 4);
  assert_memory_equal(a->inputs, b->inputs, 4 * 6);
  assert_memory_equal(a->targets, b->targets, 4 * sizeof(int64_t));
  ddp_dataset_destroy(first);
  ddp_dataset_destroy(all);
  assert_int_equal(ddp_dataset_open_idx_dir_first(&first, dir, DDP_SPLIT_TRAIN, -2),
                   DDP_ERR_INVALID);
  assert_null(first);
}

static void test_labels_out_of_range(void **state) {
  (void)state;
  const uint8_t labels[6] = {0, 9, 2, 10, 1, 200};
  write_pair("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 6, labels, 1);
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TRAIN), DDP_ERR_RANGE);
  assert_null(ds);
  char path[512];
  path_of(path, sizeof path, "train-labels-idx1-ubyte.gz");
  assert_error_mentions(path, "label 10 at index 3 (offset 11)", "[0, 10)", NULL);
}

static void test_dataset_mismatched_files(void **state) {
  (void)state;
  char images[512], labels[512];
  const uint8_t lab[5] = {0, 1, 2, 3, 4};
  write_pair("img", "lab", 5, lab, 0);
  path_of(images, sizeof images, "img");
  path_of(labels, sizeof labels, "lab4");
  const uint32_t ldims[1] = {4};
  write_idx_u8(labels, 1, ldims, lab, 4, 0);
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_open_idx(&ds, images, labels, 10), DDP_ERR_FORMAT);
  assert_error_mentions(images, "has 5 images", labels, "has 4 labels", NULL);
  /* Labels passed as images: wrong number of dimensions. */
  assert_int_equal(ddp_dataset_open_idx(&ds, labels, labels, 10), DDP_ERR_FORMAT);
  assert_error_mentions(labels, "images must be unsigned bytes", "1 dimension", NULL);
}

static void test_missing_directory(void **state) {
  (void)state;
  char missing[512];
  path_of(missing, sizeof missing, "no/such/dir");
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, missing, DDP_SPLIT_TRAIN), DDP_ERR_NOTFOUND);
  assert_null(ds);
  assert_error_mentions(missing, "No such file or directory", "train-images-idx3-ubyte", NULL);
  /* An existing directory without the files names what it looked for. */
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TEST), DDP_ERR_NOTFOUND);
  assert_error_mentions(dir, "no test images", "t10k-images-idx3-ubyte.gz",
                        "t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte", NULL);
  /* Images present, labels missing. */
  char path[512];
  path_of(path, sizeof path, "t10k-images-idx3-ubyte");
  const uint32_t idims[3] = {1, 1, 1};
  const uint8_t px[1] = {7};
  write_idx_u8(path, 3, idims, px, 1, 0);
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TEST), DDP_ERR_NOTFOUND);
  assert_error_mentions(dir, "no test labels", "t10k-labels-idx1-ubyte.gz", NULL);
  /* A file that is not a directory. */
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, path, DDP_SPLIT_TEST), DDP_ERR_INVALID);
  assert_error_mentions(path, "not a directory", NULL);
}

/* ---- The real Fashion-MNIST ----------------------------------------------
 * Reference values from Python's gzip module:
 *   /usr/bin/python3 -c "import gzip; l = gzip.open('.../train-labels-idx1-ubyte.gz')
 *     .read()[8:]; print(list(l[:10]), sum(l))"   -> [9,0,0,3,0,2,7,2,5,5] 270000
 *   images[16:][:784]: sum 76247, pixel (14,14) = 217; t10k labels start 9,2,1,1,6
 *   and sum to 45000. */
static void test_fashion_mnist(void **state) {
  (void)state;
  struct stat st;
  if (stat(FASHION_DIR, &st) != 0) {
    fprintf(stderr, "SKIP: %s is absent (Debian package dataset-fashion-mnist)\n", FASHION_DIR);
    skip();
  }
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_open_idx_dir(&ds, FASHION_DIR, DDP_SPLIT_TRAIN), DDP_OK);
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  assert_string_equal(info->name, "fashion-mnist train");
  assert_int_equal(info->num_samples, 60000);
  assert_int_equal(info->input_shape[1], 28);
  assert_int_equal(info->input_shape[2], 28);
  assert_int_equal(info->input_numel, 784);
  const int64_t *labels = info->targets;
  const int64_t first[10] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  int64_t sum = 0;
  for (int i = 0; i < 60000; i++) {
    assert_true(labels[i] >= 0 && labels[i] < 10);
    sum += labels[i];
  }
  assert_int_equal(sum, 270000);
  for (int i = 0; i < 10; i++) assert_int_equal(labels[i], first[i]);
  const uint8_t *px = info->inputs;
  int64_t psum = 0;
  for (int k = 0; k < 784; k++) psum += px[k];
  assert_int_equal(psum, 76247);
  assert_int_equal(px[14 * 28 + 14], 217);
  float x[784];
  int64_t y;
  assert_int_equal(ddp_dataset_get(ds, 0, x, &y), DDP_OK);
  assert_int_equal(y, 9);
  assert_true(x[14 * 28 + 14] == 217.0f / 255.0f);
  ddp_dataset_destroy(ds);

  assert_int_equal(ddp_dataset_open_idx_dir(&ds, FASHION_DIR, DDP_SPLIT_TEST), DDP_OK);
  info = ddp_dataset_get_info(ds);
  assert_int_equal(info->num_samples, 10000);
  labels = info->targets;
  const int64_t tfirst[5] = {9, 2, 1, 1, 6};
  for (int i = 0; i < 5; i++) assert_int_equal(labels[i], tfirst[i]);
  sum = 0;
  for (int i = 0; i < 10000; i++) sum += labels[i];
  assert_int_equal(sum, 45000);
  ddp_dataset_destroy(ds);
}

/* ---- Synthetic datasets --------------------------------------------------- */

static void test_toydata(void **state) {
  (void)state;
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_create_toydata(&ds, 1 << 20), DDP_OK);
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  assert_int_equal(info->num_samples, 1 << 20);
  assert_int_equal(info->input_numel, 32);
  assert_int_equal(info->num_classes, 10);
  float x[32];
  int64_t y;
  const int64_t probe[4] = {0, 7, 123457, (1 << 20) - 1};
  for (int p = 0; p < 4; p++) {
    assert_int_equal(ddp_dataset_get(ds, probe[p], x, &y), DDP_OK);
    for (int k = 0; k < 32; k++) assert_true(x[k] == (float)probe[p]);
    assert_int_equal(y, probe[p] % 10);
  }
  ddp_dataset_destroy(ds);
}

static void test_regression(void **state) {
  (void)state;
  ddp_dataset *a, *b, *c;
  assert_int_equal(ddp_dataset_create_regression(&a, 2000, 42), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&b, 2000, 42), DDP_OK);
  assert_int_equal(ddp_dataset_create_regression(&c, 2000, 43), DDP_OK);
  const ddp_dataset_info *info = ddp_dataset_get_info(a);
  assert_int_equal(info->input_numel, 10);
  assert_int_equal(info->target_numel, 5);
  assert_int_equal(info->target_dtype, DDP_FLOAT32);
  assert_int_equal(info->num_classes, 0);
  assert_memory_equal(info->inputs, ddp_dataset_get_info(b)->inputs, 2000 * 10 * sizeof(float));
  assert_memory_equal(info->targets, ddp_dataset_get_info(b)->targets, 2000 * 5 * sizeof(float));
  assert_memory_not_equal(info->inputs, ddp_dataset_get_info(c)->inputs, 10 * sizeof(float));
  /* Standard normal: mean 0 and variance 1 within 5 sigma over 20000 / 10000 draws. */
  const float *x = info->inputs, *t = info->targets;
  double s = 0, q = 0;
  for (int i = 0; i < 20000; i++) s += x[i], q += (double)x[i] * x[i];
  assert_true(fabs(s / 20000) < 5 / sqrt(20000.0));
  assert_true(fabs(q / 20000 - 1) < 5 * sqrt(2.0 / 20000));
  s = 0;
  for (int i = 0; i < 10000; i++) s += t[i];
  assert_true(fabs(s / 10000) < 5 / sqrt(10000.0));
  float xs[10], ts[5];
  assert_int_equal(ddp_dataset_get(a, 1999, xs, ts), DDP_OK);
  assert_memory_equal(xs, x + 1999 * 10, sizeof xs);
  assert_memory_equal(ts, t + 1999 * 5, sizeof ts);
  ddp_dataset_destroy(a);
  ddp_dataset_destroy(b);
  ddp_dataset_destroy(c);
}

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_roundtrip_plain),
      T(test_roundtrip_gzip),
      T(test_roundtrip_wide_types),
      T(test_wrong_magic),
      T(test_wrong_type_code),
      T(test_too_many_dims),
      T(test_truncated_header),
      T(test_truncated_data_plain),
      T(test_truncated_data_gzip),
      T(test_truncated_images),
      T(test_trailing_garbage_plain),
      T(test_trailing_garbage_gzip),
      T(test_overflowing_dims),
      T(test_corrupted_gzip),
      T(test_missing_file),
      T(test_dataset_dir_mnist_names),
      T(test_read_first_plain),
      T(test_read_first_gzip),
      T(test_dataset_dir_first),
      T(test_labels_out_of_range),
      T(test_dataset_mismatched_files),
      T(test_missing_directory),
      T(test_fashion_mnist),
      T(test_toydata),
      T(test_regression),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
