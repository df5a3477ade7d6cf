/* io: the safetensors format. The JSON parser's errors and offsets; a file
 * written by hand from the spec reads back as the spec says; ddp's writer
 * produces that layout (length, header, 8-byte alignment, data in order);
 * every kind of broken file gives an error naming the file, the offset and
 * the tensor; a failed write leaves the old file untouched. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "io/io_internal.h"
#include "io/io_test_util.h"

/* ---- JSON ------------------------------------------------------------------- */

static void json_ok(const char *text, ddp__json_doc *doc) {
  ddp_status s = ddp__json_parse(text, strlen(text), 0, doc);
  if (s != DDP_OK) fail_msg("%s: %s", text, ddp_last_error());
}

static void json_bad(const char *text, const char *want) {
  ddp__json_doc doc;
  ddp_status s = ddp__json_parse(text, strlen(text), 100, &doc);
  if (s != DDP_ERR_FORMAT) fail_msg("parsed %s (status %d)", text, s);
  if (!strstr(ddp_last_error(), want)) fail_msg("%s: got \"%s\", want \"%s\"", text, ddp_last_error(), want);
  assert_null(doc.root);
}

static void test_json(void **state) {
  (void)state;
  ddp__json_doc doc;
  const char *text =
      " {\"a\": [1, -2, 3.5e1, true, false, null], \"b\\u00e9\\ud83d\\ude00\": \"x\\ny\\\"\"} ";
  json_ok(text, &doc);
  const ddp__json *a = ddp__json_get(doc.root, "a");
  assert_non_null(a);
  assert_int_equal(a->count, 6);
  assert_true(a->first->is_integer && a->first->integer == 1);
  assert_true(a->first->next->integer == -2);
  assert_false(a->first->next->next->is_integer);
  assert_true(a->first->next->next->number == 35.0);
  const ddp__json *b = ddp__json_get(doc.root, "b\xc3\xa9\xf0\x9f\x98\x80");
  assert_non_null(b);
  assert_string_equal(b->string, "x\ny\"");
  assert_int_equal(b->offset, (size_t)(strstr(text, "\"x\\n") - text));
  ddp__json_free(&doc);

  /* Offsets count from base (100 here). */
  json_bad("{\"a\": 1,}", "expected a member name (a string) but found '}' at offset 108");
  json_bad("{\"a\": 1 \"b\": 2}", "expected ',' or '}' in an object but found '\"' at offset 108");
  json_bad("{\"a\": \"abc", "unterminated string at offset 106");
  json_bad("{\"a\": 1, \"a\": 2}", "duplicate member \"a\" at offset 109");
  json_bad("{\"a\": \"\\x\"}", "bad escape '\\x' at offset 107");
  json_bad("{\"a\": 012}", "leading zero at offset 106");
  json_bad("{\"a\": \"\x01\"}", "raw control character 0x01 in a string at offset 107");
  json_bad("{\"a\": \"\xff\"}", "invalid UTF-8 in a string at offset 107");
  json_bad("{\"a\": \"\xc0\xaf\"}", "invalid UTF-8"); /* overlong '/' */
  json_bad("{\"a\": \"\\ud800\"}", "high surrogate without its low half");
  json_bad("{\"a\": tru}", "unexpected token at offset 106");
  json_bad("{} x", "trailing characters after the JSON value at offset 103");
  json_bad("", "expected a value but the header ends at offset 100");
  json_bad("{\"a\": 1.}", "no digits after '.'");
  char deep[200];
  memset(deep, '[', 100);
  deep[100] = '\0';
  json_bad(deep, "nesting deeper than 64");
}

/* ---- A file made by hand from the spec ------------------------------------------ */

/* header + data into a file; header length written as given. */
static void make_file(const char *path, uint64_t header_len, const char *header, const void *data,
                      size_t data_len) {
  size_t hl = strlen(header);
  unsigned char *buf = malloc(8 + hl + data_len + 1);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(header_len >> (8 * i));
  memcpy(buf + 8, header, hl);
  if (data_len) memcpy(buf + 8 + hl, data, data_len);
  spit(path, buf, 8 + hl + data_len);
  free(buf);
}

static void test_read_handmade(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/hand.safetensors", dir);
  /* Two tensors, the second listed first in the header, and metadata. */
  const char *header =
      "{\"b\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
      "\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  unsigned char data[16];
  float av[2] = {1.5f, -2.0f};
  int64_t bv = -7;
  memcpy(data, av, 8);
  memcpy(data + 8, &bv, 8);
  make_file(path, strlen(header), header, data, sizeof data);
  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_OK);
  assert_int_equal(ddp_safetensors_count(st), 2);
  assert_string_equal(ddp_safetensors_metadata(st, "format"), "pt");
  assert_null(ddp_safetensors_metadata(st, "other"));
  ddp_safetensors_tensor t;
  assert_int_equal(ddp_safetensors_find(st, "a", &t), DDP_OK);
  assert_int_equal(t.dtype, DDP_FLOAT32);
  assert_int_equal(t.ndim, 1);
  assert_int_equal(t.shape[0], 2);
  assert_int_equal(t.file_offset, 8 + strlen(header));
  assert_memory_equal(t.data, av, 8);
  assert_int_equal(ddp_safetensors_find(st, "b", &t), DDP_OK);
  assert_int_equal(t.dtype, DDP_INT64);
  assert_int_equal(t.ndim, 0);
  assert_int_equal(t.numel, 1);
  assert_memory_equal(t.data, &bv, 8);
  assert_int_equal(ddp_safetensors_find(st, "c", &t), DDP_ERR_NOTFOUND);
  ddp_safetensors_free(st);
}

/* Each broken header gives DDP_ERR_FORMAT (or the named status) whose message
 * contains `want`. */
static void expect_bad(const char *header, const void *data, size_t data_len, ddp_status status,
                       const char *want) {
  char path[512];
  snprintf(path, sizeof path, "%s/bad.safetensors", dir);
  make_file(path, strlen(header), header, data, data_len);
  ddp_safetensors *st = (ddp_safetensors *)1;
  ddp_status s = ddp_safetensors_read(path, &st);
  if (s != status) fail_msg("%s: status %d, want %d (%s)", header, s, status, ddp_last_error());
  assert_null(st);
  if (!strstr(ddp_last_error(), want)) fail_msg("%s:\n got  %s\n want %s", header, ddp_last_error(), want);
  assert_non_null(strstr(ddp_last_error(), path)); /* the file is named */
}

static void test_read_errors(void **state) {
  (void)state;
  unsigned char data[64] = {0};
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 4,
             DDP_ERR_FORMAT,
             "data_offsets [0, 8] reach past the data section's 4 bytes (the file ends at offset "
             "66: truncated?) at offset 9 (tensor a)"); /* 8 + 54 header bytes + 4 */
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", data, 12,
             DDP_ERR_FORMAT, "data_offsets [4, 12] overlap tensor a's bytes (which end at 8)");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", data, 8,
             DDP_ERR_FORMAT, "data bytes [0, 4) before it belong to no tensor at offset 9 (tensor a)");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 8,
             DDP_ERR_FORMAT, "4 trailing bytes after the last tensor's data");
  expect_bad("{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4,
             DDP_ERR_FORMAT, "unknown dtype \"F33\"");
  expect_bad("{\"a\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[0,1]}}", data, 1,
             DDP_ERR_UNSUPPORTED, "dtype BOOL is valid but ddp has no such type");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", data, 8,
             DDP_ERR_FORMAT, "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] hold 8");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,8]}}", data, 8,
             DDP_ERR_FORMAT, "\"shape\"[0] is not a non-negative integer");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", data, 8,
             DDP_ERR_FORMAT, "end before they begin");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", data, 8, DDP_ERR_FORMAT,
             "entry lacks \"data_offsets\"");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", data, 8,
             DDP_ERR_FORMAT, "unknown field \"x\"");
  expect_bad("{\"__metadata__\":{\"k\":1}}", data, 0, DDP_ERR_FORMAT,
             "metadata \"k\" is number; metadata values are strings");
  expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}",
             data, 8, DDP_ERR_FORMAT, "shape's size exceeds the file");
  expect_bad("[1]", data, 0, DDP_ERR_FORMAT, "the header does not start with '{'");
  expect_bad("{\"a\":1,}", data, 0, DDP_ERR_FORMAT, "header JSON: expected a member name");

  /* Header length against the file. */
  char path[512];
  snprintf(path, sizeof path, "%s/len.safetensors", dir);
  make_file(path, 1000, "{}", NULL, 0);
  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "header length 1000 reaches past the end of the file (10 bytes"));
  make_file(path, (uint64_t)1 << 40, "{}", NULL, 0);
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "exceeds the 104857600-byte limit"));
  spit(path, "abc", 3);
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "the file has 3 bytes, fewer than the 8-byte header"));
  snprintf(path, sizeof path, "%s/none.safetensors", dir);
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_ERR_NOTFOUND);
  assert_int_equal(ddp_safetensors_read(dir, &st), DDP_ERR_IO);
}

/* ---- ddp's writer ----------------------------------------------------------------- */

static void test_write_layout(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/w.safetensors", dir);
  float w[6] = {1, 2, 3, 4, 5, 6};
  int64_t n = 42;
  double d[1] = {0.25};
  uint8_t u[3] = {1, 2, 255};
  ddp_safetensors_entry e[5] = {
      {.name = "layer.weight", .dtype = DDP_FLOAT32, .ndim = 2, .shape = {2, 3}, .data = w},
      {.name = "layer.num_batches_tracked", .dtype = DDP_INT64, .ndim = 0, .data = &n},
      {.name = "q\"uote\\d", .dtype = DDP_FLOAT64, .ndim = 1, .shape = {1}, .data = d},
      {.name = "bytes", .dtype = DDP_UINT8, .ndim = 1, .shape = {3}, .data = u},
      {.name = "empty", .dtype = DDP_FLOAT32, .ndim = 2, .shape = {0, 5}, .data = NULL},
  };
  ddp_kv meta[2] = {{"format", "pt"}, {"note", "line\nbreak \"q\""}};
  assert_int_equal(ddp_safetensors_write(path, e, 5, meta, 2), DDP_OK);
  assert_int_equal(dir_entries(dir), 1); /* no temporary file left */

  size_t size;
  unsigned char *raw = slurp(path, &size);
  uint64_t hl = 0;
  for (int i = 0; i < 8; i++) hl |= (uint64_t)raw[i] << (8 * i);
  assert_int_equal((8 + hl) % 8, 0); /* data 8-byte aligned, as the reference writes */
  assert_int_equal(raw[8], '{');
  assert_int_equal(size, 8 + hl + 24 + 8 + 8 + 3);
  /* Data in entry order, right after the header. */
  assert_memory_equal(raw + 8 + hl, w, 24);
  assert_memory_equal(raw + 8 + hl + 24, &n, 8);
  assert_memory_equal(raw + 8 + hl + 32, d, 8);
  assert_memory_equal(raw + 8 + hl + 40, u, 3);
  /* The header names the scalar's shape as [] (PyTorch's num_batches_tracked). */
  assert_non_null(memmem(raw + 8, hl, "\"layer.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[],"
                         "\"data_offsets\":[24,32]}", 75));
  free(raw);

  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_OK);
  assert_int_equal(ddp_safetensors_count(st), 5);
  assert_string_equal(ddp_safetensors_metadata(st, "note"), "line\nbreak \"q\"");
  ddp_safetensors_tensor t;
  assert_int_equal(ddp_safetensors_find(st, "q\"uote\\d", &t), DDP_OK);
  assert_int_equal(t.dtype, DDP_FLOAT64);
  assert_int_equal(ddp_safetensors_find(st, "empty", &t), DDP_OK);
  assert_int_equal(t.numel, 0);
  assert_int_equal(t.shape[1], 5);
  ddp_safetensors_free(st);

  /* Bad entries are refused before anything is written. */
  ddp_safetensors_entry dup[2] = {e[0], e[0]};
  assert_int_equal(ddp_safetensors_write(path, dup, 2, NULL, 0), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "appears twice"));
}

/* A write that fails midway (a full disk, injected) leaves the old file as it
 * was and no temporary file; so does a directory that does not exist. */
static void test_write_failure_keeps_old(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/keep.safetensors", dir);
  float a[256], b[256];
  for (int i = 0; i < 256; i++) a[i] = (float)i, b[i] = (float)-i;
  ddp_safetensors_entry e = {.name = "x", .dtype = DDP_FLOAT32, .ndim = 1, .shape = {256}, .data = a};
  assert_int_equal(ddp_safetensors_write(path, &e, 1, NULL, 0), DDP_OK);
  size_t old_size;
  unsigned char *old = slurp(path, &old_size);
  e.data = b;
  const int64_t cut[] = {0, 5, 8, 60, 500};
  for (size_t k = 0; k < sizeof cut / sizeof *cut; k++) {
    ddp__io_fail_after_bytes = cut[k];
    ddp_status s = ddp_safetensors_write(path, &e, 1, NULL, 0);
    ddp__io_fail_after_bytes = -1;
    assert_int_equal(s, DDP_ERR_IO);
    assert_non_null(strstr(ddp_last_error(), "No space left on device"));
    assert_non_null(strstr(ddp_last_error(), path));
    size_t now_size;
    unsigned char *now = slurp(path, &now_size);
    assert_int_equal(now_size, old_size);
    assert_memory_equal(now, old, old_size);
    free(now);
    assert_int_equal(dir_entries(dir), 1);
  }
  free(old);
  char nodir[512];
  snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", dir);
  assert_int_equal(ddp_safetensors_write(nodir, &e, 1, NULL, 0), DDP_ERR_NOTFOUND);
  assert_non_null(strstr(ddp_last_error(), "cannot create the temporary file"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_json),
      cmocka_unit_test_setup_teardown(test_read_handmade, setup, teardown),
      cmocka_unit_test_setup_teardown(test_read_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_write_layout, setup, teardown),
      cmocka_unit_test_setup_teardown(test_write_failure_keeps_old, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
