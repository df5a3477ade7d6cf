/* TensorBoard event files' pieces, in C (tests/train/test_tensorboard.c
 * reads whole files back with the tensorboard package):
 *  - CRC-32C against the check value and RFC 3720's test vectors, and
 *    TFRecord's mask against its definition;
 *  - the protobuf encoder against the encodings in protobuf.dev's
 *    "Encoding" page (150 -> 08 96 01, "testing", nested 1a 03 08 96 01,
 *    negative int64 in 10 bytes, fixed32/64 little-endian), including a
 *    length that needs two bytes of varint;
 *  - the writer: SummaryWriter's file name, a record per call with valid
 *    framing, the file-version event first, an error naming the path when
 *    the directory cannot be made, empty tags refused, and a write that
 *    fails (RLIMIT_FSIZE) reported with the file's name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ddp/tensorboard.h"
#include "io/crc32c.h"
#include "io/protobuf.h"

/* ---- CRC-32C ------------------------------------------------------------------ */

static void test_crc32c_vectors(void **state) {
  (void)state;
  assert_int_equal(ddp__crc32c(0, "123456789", 9), 0xE3069283u);
  assert_int_equal(ddp__crc32c(0, "", 0), 0);
  uint8_t buf[32];
  memset(buf, 0, sizeof buf);
  assert_int_equal(ddp__crc32c(0, buf, 32), 0x8A9136AAu); /* RFC 3720, B.4 */
  memset(buf, 0xFF, sizeof buf);
  assert_int_equal(ddp__crc32c(0, buf, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; i++) buf[i] = (uint8_t)i;
  assert_int_equal(ddp__crc32c(0, buf, 32), 0x46DD794Eu);
  for (int i = 0; i < 32; i++) buf[i] = (uint8_t)(31 - i);
  assert_int_equal(ddp__crc32c(0, buf, 32), 0x113FDB5Cu);
  /* Continuing a CRC over a split buffer gives the whole one's. */
  assert_int_equal(ddp__crc32c(ddp__crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
  /* Mask: rotate right 15, add 0xa282ead8 (mod 2^32). */
  uint32_t c = 0xE3069283u;
  assert_int_equal(ddp__crc32c_mask(c), (uint32_t)(((c >> 15) | (c << 17)) + 0xa282ead8u));
  assert_int_equal(ddp__crc32c_mask(0), 0xa282ead8u);
}

/* ---- protobuf ------------------------------------------------------------------ */

static void expect_bytes(const ddp__pb *b, const uint8_t *want, size_t n) {
  assert_false(b->failed);
  assert_int_equal(b->len, n);
  assert_memory_equal(b->data, want, n);
}

static void test_protobuf_encodings(void **state) {
  (void)state;
  ddp__pb b = {0};
  ddp__pb_uint64(&b, 1, 150);
  expect_bytes(&b, (const uint8_t[]){0x08, 0x96, 0x01}, 3);
  ddp__pb_clear(&b);
  ddp__pb_string(&b, 2, "testing");
  expect_bytes(&b, (const uint8_t[]){0x12, 0x07, 't', 'e', 's', 't', 'i', 'n', 'g'}, 9);
  ddp__pb_clear(&b);
  size_t m = ddp__pb_begin(&b, 3);
  ddp__pb_uint64(&b, 1, 150);
  ddp__pb_end(&b, m);
  expect_bytes(&b, (const uint8_t[]){0x1a, 0x03, 0x08, 0x96, 0x01}, 5);
  ddp__pb_clear(&b);
  ddp__pb_int64(&b, 2, -1);
  expect_bytes(&b, (const uint8_t[]){0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                     0x01}, 11);
  ddp__pb_clear(&b);
  ddp__pb_float(&b, 2, 1.0f);
  ddp__pb_double(&b, 1, -2.0);
  expect_bytes(&b, (const uint8_t[]){0x15, 0x00, 0x00, 0x80, 0x3f,
                                     0x09, 0, 0, 0, 0, 0, 0, 0x00, 0xc0}, 14);
  /* A field number above 15 takes a two-byte key: (16 << 3) | 0. */
  ddp__pb_clear(&b);
  ddp__pb_uint64(&b, 16, 0);
  expect_bytes(&b, (const uint8_t[]){0x80, 0x01, 0x00}, 3);
  /* Nested messages whose bodies need two-byte lengths: 300 bytes inside
   * 1 + 2 + 300 inside. */
  ddp__pb_clear(&b);
  size_t outer = ddp__pb_begin(&b, 1);
  size_t inner = ddp__pb_begin(&b, 2);
  char big[300];
  memset(big, 'x', sizeof big);
  ddp__pb_raw(&b, big, sizeof big);
  ddp__pb_end(&b, inner);
  ddp__pb_end(&b, outer);
  assert_int_equal(b.len, 1 + 2 + 1 + 2 + 300);
  const uint8_t head[] = {0x0a, 0xaf, 0x02 /* 303 */, 0x12, 0xac, 0x02 /* 300 */};
  assert_memory_equal(b.data, head, sizeof head);
  assert_int_equal(b.data[b.len - 1], 'x');
  ddp__pb_free(&b);
}

/* ---- the writer --------------------------------------------------------------- */

static char tmp_root[64];

static int setup(void **state) {
  (void)state;
  snprintf(tmp_root, sizeof tmp_root, "/tmp/ddp_tfevents_XXXXXX");
  return mkdtemp(tmp_root) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
  return system(cmd) == 0 ? 0 : -1;
}

static uint8_t *read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *data = malloc((size_t)len + 1);
  assert_int_equal(fread(data, 1, (size_t)len, f), (size_t)len);
  fclose(f);
  *n = (size_t)len;
  return data;
}

static uint64_t le(const uint8_t *p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* Walks the TFRecords of data[0..n), checking both CRCs of each; returns
 * the count and points first/first_len at the first record's bytes. */
static int check_records(const uint8_t *data, size_t n, const uint8_t **first, size_t *first_len) {
  size_t pos = 0;
  int count = 0;
  while (pos < n) {
    assert_true(pos + 12 <= n);
    uint64_t len = le(data + pos, 8);
    assert_int_equal(le(data + pos + 8, 4), ddp__crc32c_mask(ddp__crc32c(0, data + pos, 8)));
    assert_true(pos + 12 + len + 4 <= n);
    assert_int_equal(le(data + pos + 12 + len, 4),
                     ddp__crc32c_mask(ddp__crc32c(0, data + pos + 12, len)));
    if (count == 0) {
      *first = data + pos + 12;
      *first_len = len;
    }
    pos += 12 + len + 4;
    count++;
  }
  return count;
}

static void test_writer_file(void **state) {
  (void)state;
  char dir[128];
  snprintf(dir, sizeof dir, "%s/a/b", tmp_root); /* parents made too */
  ddp_summary_writer *w, *w2;
  /* The writer's clock (CLOCK_REALTIME), not time(): glibc's time() reads
   * the kernel's coarse seconds, which lag CLOCK_REALTIME by up to a tick,
   * so a name made just after a second began could be one past `after`. */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  time_t before = ts.tv_sec;
  assert_int_equal(ddp_summary_writer_create(&w, dir, NULL), DDP_OK);
  assert_int_equal(ddp_summary_writer_create(&w2, dir, ".x"), DDP_OK);
  clock_gettime(CLOCK_REALTIME, &ts);
  time_t after = ts.tv_sec;
  /* events.out.tfevents.<10 digits>.<host>.<pid>.<n>[suffix], n one more
   * for the second writer. */
  char host[256];
  gethostname(host, sizeof host);
  const char *name = strrchr(ddp_summary_writer_path(w), '/') + 1;
  const char *name2 = strrchr(ddp_summary_writer_path(w2), '/') + 1;
  long long t;
  unsigned n, n2;
  char rest[512];
  assert_int_equal(sscanf(name, "events.out.tfevents.%10lld.%511s", &t, rest), 2);
  assert_true(t >= (long long)before && t <= (long long)after);
  assert_int_equal(strlen(name), strlen("events.out.tfevents.") + 10 + 1 + strlen(rest));
  char want[600];
  snprintf(want, sizeof want, "%s.%ld.", host, (long)getpid());
  assert_memory_equal(rest, want, strlen(want));
  assert_int_equal(sscanf(rest + strlen(want), "%u", &n), 1);
  assert_int_equal(sscanf(strstr(name2, want) + strlen(want), "%u", &n2), 1);
  assert_int_equal(n2, n + 1);
  assert_string_equal(name2 + strlen(name2) - 2, ".x");

  assert_int_equal(ddp_summary_writer_add_scalar(w, "train/loss", 0.5f, 3, 1700000000.25), DDP_OK);
  const char *tags[2] = {"a", "b"};
  const float values[2] = {1, 2};
  assert_int_equal(ddp_summary_writer_add_scalars(w, 2, tags, values, -7, NAN), DDP_OK);
  assert_int_equal(ddp_summary_writer_add_text(w, "options", "| a | b |", 0, NAN), DDP_OK);
  /* Refused: an empty or NULL tag, no scalars, NULL text; nothing written. */
  assert_int_equal(ddp_summary_writer_add_scalar(w, "", 1, 0, NAN), DDP_ERR_INVALID);
  const char *bad[2] = {"ok", NULL};
  assert_int_equal(ddp_summary_writer_add_scalars(w, 2, bad, values, 0, NAN), DDP_ERR_INVALID);
  assert_int_equal(ddp_summary_writer_add_scalars(w, 0, tags, values, 0, NAN), DDP_ERR_INVALID);
  assert_int_equal(ddp_summary_writer_add_text(w, "t", NULL, 0, NAN), DDP_ERR_INVALID);

  /* Every record reached the file before the call returned (no close yet). */
  size_t len;
  uint8_t *data = read_file(ddp_summary_writer_path(w), &len);
  const uint8_t *first = NULL;
  size_t first_len = 0;
  assert_int_equal(check_records(data, len, &first, &first_len), 4);
  /* The first: wall_time (field 1, fixed64), file_version "brain.Event:2"
   * (field 3), source_metadata {writer "ddp"} (field 10). */
  assert_int_equal(first[0], 0x09);
  const uint8_t version[] = {0x1a, 13, 'b', 'r', 'a', 'i', 'n', '.', 'E', 'v', 'e', 'n', 't', ':', '2',
                             0x52, 5, 0x0a, 3, 'd', 'd', 'p'};
  assert_int_equal(first_len, 9 + sizeof version);
  assert_memory_equal(first + 9, version, sizeof version);
  /* The second: wall_time 1700000000.25, step 3, summary {value {tag, simple_value 0.5}}. */
  const uint8_t *second = first + first_len + 4 + 12;
  double wall = 1700000000.25;
  uint8_t want_event[] = {0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 3, 0x2a, 19, 0x0a, 17, 0x0a, 10,
                          't', 'r', 'a', 'i', 'n', '/', 'l', 'o', 's', 's',
                          0x15, 0x00, 0x00, 0x00, 0x3f};
  uint64_t bits;
  memcpy(&bits, &wall, 8);
  for (int i = 0; i < 8; i++) want_event[1 + i] = (uint8_t)(bits >> (8 * i));
  assert_int_equal(le(second - 12, 8), sizeof want_event);
  assert_memory_equal(second, want_event, sizeof want_event);
  free(data);
  ddp_summary_writer_destroy(w);
  ddp_summary_writer_destroy(w2);
  ddp_summary_writer_destroy(NULL);
}

static void test_writer_errors(void **state) {
  (void)state;
  char file[128], dir[160];
  snprintf(file, sizeof file, "%s/plain", tmp_root);
  FILE *f = fopen(file, "w");
  assert_non_null(f);
  fclose(f);
  snprintf(dir, sizeof dir, "%s/sub", file);
  ddp_summary_writer *w = (ddp_summary_writer *)1;
  assert_int_equal(ddp_summary_writer_create(&w, dir, NULL), DDP_ERR_IO);
  assert_null(w);
  assert_non_null(strstr(ddp_last_error(), file));
  assert_int_equal(ddp_summary_writer_create(&w, "", NULL), DDP_ERR_INVALID);
}

/* A full disk, played by RLIMIT_FSIZE: the failing write is an error that
 * names the file, and the records before it stay whole. */
static void test_writer_write_failure(void **state) {
  (void)state;
  char dir[128];
  snprintf(dir, sizeof dir, "%s/full", tmp_root);
  ddp_summary_writer *w;
  assert_int_equal(ddp_summary_writer_create(&w, dir, NULL), DDP_OK);
  struct rlimit old, small;
  assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  struct stat st;
  assert_int_equal(stat(ddp_summary_writer_path(w), &st), 0);
  small = old;
  small.rlim_cur = (rlim_t)st.st_size + 200;
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
  ddp_status s = DDP_OK;
  int written = 0;
  for (; written < 100 && s == DDP_OK; written++)
    s = ddp_summary_writer_add_scalar(w, "train/loss", (float)written, written, NAN);
  assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, old_handler);
  assert_int_equal(s, DDP_ERR_IO);
  assert_true(written > 1 && written < 100);
  assert_non_null(strstr(ddp_last_error(), ddp_summary_writer_path(w)));
  ddp_summary_writer_destroy(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_crc32c_vectors),
      cmocka_unit_test(test_protobuf_encodings),
      cmocka_unit_test(test_writer_file),
      cmocka_unit_test(test_writer_errors),
      cmocka_unit_test(test_writer_write_failure),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
