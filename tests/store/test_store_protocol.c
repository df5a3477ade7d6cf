/* store protocol: the request parser against valid messages of every
 * opcode (round trip), every truncation of them, a corpus of nasty inputs
 * with the refusal each must get, the fuzz target over its seed corpus and
 * over 20,000 deterministic mutations (so CI exercises the parser without
 * clang), and the integer parsing add relies on. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "store/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static ddp_store_limits limits(void) {
  ddp_store_limits l;
  ddp__store_limits_resolve(NULL, &l);
  return l;
}

/* One valid request of each opcode. */
static void encode_all(ddp__buf *b) {
  size_t at;
  ddp__store_encode_hello(b, "tok");
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_SET);
  ddp__buf_bytes(b, "key", 3);
  ddp__buf_bytes(b, "value", 5);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_GET);
  ddp__buf_i64(b, 1500);
  ddp__buf_bytes(b, "key", 3);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_ADD);
  ddp__buf_bytes(b, "n", 1);
  ddp__buf_i64(b, -42);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_COMPARE_SET);
  ddp__buf_bytes(b, "c", 1);
  ddp__buf_bytes(b, "", 0);
  ddp__buf_bytes(b, "d", 1);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_WAIT);
  ddp__buf_i64(b, -1);
  ddp__buf_u32(b, 2);
  ddp__buf_bytes(b, "a", 1);
  ddp__buf_bytes(b, "bb", 2);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_CHECK);
  ddp__buf_u32(b, 1);
  ddp__buf_bytes(b, "a", 1);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_DELETE);
  ddp__buf_bytes(b, "a", 1);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_NUM_KEYS);
  ddp__buf_bytes(b, "", 0);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_LIST_KEYS);
  ddp__buf_bytes(b, "g/", 2);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_APPEND);
  ddp__buf_bytes(b, "log", 3);
  ddp__buf_bytes(b, "x", 1);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_MULTI_GET);
  ddp__buf_i64(b, 0);
  ddp__buf_u32(b, 1);
  ddp__buf_bytes(b, "m", 1);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_MULTI_SET);
  ddp__buf_u32(b, 2);
  ddp__buf_bytes(b, "m1", 2);
  ddp__buf_bytes(b, "v1", 2);
  ddp__buf_bytes(b, "m2", 2);
  ddp__buf_bytes(b, "", 0);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_PING);
  ddp__buf_i64(b, 77);
  ddp__buf_frame_end(b, at);
  at = ddp__buf_frame_begin(b);
  ddp__buf_u8(b, DDP__OP_WATCH);
  ddp__buf_u32(b, 2);
  ddp__buf_bytes(b, "w1", 2);
  ddp__buf_bytes(b, "w2", 2);
  ddp__buf_frame_end(b, at);
}

static int slice_is(ddp__slice s, const char *text) {
  return s.len == strlen(text) && !memcmp(s.data, text, s.len);
}

static void test_round_trip_every_opcode(void **state) {
  (void)state;
  ddp__buf b = {0};
  encode_all(&b);
  assert_false(b.failed);
  ddp_store_limits l = limits();
  size_t off = 0;
  int op = DDP__OP_HELLO;
  while (off < b.len) {
    ddp__store_request r;
    size_t used;
    uint8_t status;
    char err[128];
    assert_int_equal(ddp__store_parse_request(b.data + off, b.len - off, &l, &r, &used, &status,
                                              err, sizeof err),
                     DDP__PARSE_DONE);
    assert_int_equal(r.op, op);
    switch (r.op) {
      case DDP__OP_HELLO:
        assert_int_equal(r.magic, DDP__STORE_MAGIC);
        assert_int_equal(r.version, DDP__STORE_VERSION);
        assert_true(slice_is(r.key, "tok"));
        break;
      case DDP__OP_SET: assert_true(slice_is(r.key, "key") && slice_is(r.value, "value")); break;
      case DDP__OP_GET: assert_true(r.timeout_ms == 1500 && slice_is(r.key, "key")); break;
      case DDP__OP_ADD: assert_true(r.integer == -42 && slice_is(r.key, "n")); break;
      case DDP__OP_COMPARE_SET:
        assert_true(slice_is(r.value, "") && slice_is(r.desired, "d"));
        break;
      case DDP__OP_WAIT:
        assert_true(r.timeout_ms == -1 && r.num_keys == 2 && slice_is(r.keys[1], "bb"));
        break;
      case DDP__OP_MULTI_SET:
        assert_true(r.num_keys == 2 && slice_is(r.keys[0], "m1") && slice_is(r.values[0], "v1") &&
                    slice_is(r.values[1], ""));
        break;
      case DDP__OP_PING: assert_true(r.integer == 77); break;
      case DDP__OP_WATCH:
        assert_true(r.num_keys == 2 && slice_is(r.keys[0], "w1") && slice_is(r.keys[1], "w2"));
        break;
      case DDP__OP_LIST_KEYS: assert_true(slice_is(r.key, "g/")); break;
      default: break;
    }
    ddp__store_request_free(&r);
    off += used;
    op++;
  }
  assert_int_equal(op, DDP__OP_MAX_);
  ddp__buf_free(&b);
}

/* Every proper prefix of a valid frame is "need more", never a verdict. */
static void test_every_truncation_needs_more(void **state) {
  (void)state;
  ddp__buf b = {0};
  encode_all(&b);
  ddp_store_limits l = limits();
  size_t off = 0;
  while (off < b.len) {
    size_t frame = DDP__STORE_FRAME_HEADER + ddp__load_u32(b.data + off);
    for (size_t cut = 0; cut < frame; cut++) {
      ddp__store_request r;
      size_t used = 99;
      uint8_t status;
      assert_int_equal(ddp__store_parse_request(b.data + off, cut, &l, &r, &used, &status, NULL, 0),
                       DDP__PARSE_MORE);
      assert_int_equal(used, 0);
    }
    off += frame;
  }
  ddp__buf_free(&b);
}

typedef struct nasty {
  const char *what;
  uint8_t bytes[40];
  size_t len;
  uint8_t status; /* the refusal expected */
} nasty;

static void test_nasty_inputs_are_refused(void **state) {
  (void)state;
  /* Frames: u32 body length (LE), then the body. */
  const nasty cases[] = {
      {"empty frame", {0, 0, 0, 0}, 4, DDP__WIRE_MALFORMED},
      {"4 GB frame", {0xff, 0xff, 0xff, 0xff}, 4, DDP__WIRE_TOO_LARGE},
      {"HTTP request", {'G', 'E', 'T', ' ', '/', ' '}, 6, DDP__WIRE_TOO_LARGE},
      {"unknown opcode", {1, 0, 0, 0, 200}, 5, DDP__WIRE_MALFORMED},
      {"opcode 0", {1, 0, 0, 0, 0}, 5, DDP__WIRE_MALFORMED},
      {"set without key", {1, 0, 0, 0, DDP__OP_SET}, 5, DDP__WIRE_MALFORMED},
      {"key length past the frame",
       {9, 0, 0, 0, DDP__OP_SET, 100, 0, 0, 0, 'a', 0, 0, 0},
       13,
       DDP__WIRE_MALFORMED},
      {"key over the limit",
       {9, 0, 0, 0, DDP__OP_DELETE, 0, 0x10, 1, 0, 'a', 'b', 'c', 'd'},
       13,
       DDP__WIRE_TOO_LARGE},
      {"empty key", {5, 0, 0, 0, DDP__OP_DELETE, 0, 0, 0, 0}, 9, DDP__WIRE_MALFORMED},
      {"NUL in key",
       {8, 0, 0, 0, DDP__OP_DELETE, 3, 0, 0, 0, 'a', 0, 'b'},
       12,
       DDP__WIRE_MALFORMED},
      {"value length 2^32-1",
       {11, 0, 0, 0, DDP__OP_SET, 1, 0, 0, 0, 'k', 0xff, 0xff, 0xff, 0xff, 'v'},
       15,
       DDP__WIRE_TOO_LARGE},
      {"wait claiming 10^9 keys",
       {13, 0, 0, 0, DDP__OP_WAIT, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xca, 0x9a, 0x3b},
       17,
       DDP__WIRE_TOO_LARGE},
      {"check claiming 1000 keys in 4 bytes",
       {9, 0, 0, 0, DDP__OP_CHECK, 0xe8, 3, 0, 0, 1, 0, 0, 0},
       13,
       DDP__WIRE_MALFORMED},
      {"trailing bytes after a delete",
       {7, 0, 0, 0, DDP__OP_DELETE, 1, 0, 0, 0, 'k', 'x'},
       11,
       DDP__WIRE_MALFORMED},
      {"truncated timeout", {4, 0, 0, 0, DDP__OP_GET, 1, 2, 3}, 8, DDP__WIRE_MALFORMED},
      {"token over 1 KiB",
       {13, 0, 0, 0, DDP__OP_HELLO, 0x44, 0x44, 0x50, 0x53, 1, 0, 0, 0, 1, 8, 0, 0},
       17,
       DDP__WIRE_TOO_LARGE},
  };
  ddp_store_limits l = limits();
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ddp__store_request r;
    size_t used = 99;
    uint8_t status = 0;
    char err[128];
    ddp__parse_result res = ddp__store_parse_request(cases[i].bytes, cases[i].len, &l, &r, &used,
                                                     &status, err, sizeof err);
    if (res != DDP__PARSE_ERROR || status != cases[i].status)
      fail_msg("%s: result %d status %u (%s)", cases[i].what, res, status, err);
    assert_true(err[0] != '\0');
    assert_null(r.keys);
  }
}

/* Runs the fuzz target over its seed corpus. */
static void test_fuzz_corpus_replay(void **state) {
  (void)state;
  const char *src = getenv("DDP_SOURCE_DIR");
  char dir[600];
  snprintf(dir, sizeof dir, "%s/fuzz/corpus/store_protocol", src ? src : ".");
  DIR *d = opendir(dir);
  if (!d) fail_msg("no seed corpus at %s", dir);
  int files = 0;
  struct dirent *e;
  static uint8_t buf[1 << 16];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n); /* aborts on a broken promise */
    files++;
  }
  closedir(d);
  assert_true(files >= 10);
}

/* 20,000 deterministic mutations of the valid stream through the fuzz target. */
static void test_mutations(void **state) {
  (void)state;
  ddp__buf b = {0};
  ddp__buf_u8(&b, 0); /* limits selector */
  encode_all(&b);
  uint8_t *m = malloc(b.len + 64);
  ddp_rng rng;
  ddp_rng_seed(&rng, 42);
  for (int round = 0; round < 20000; round++) {
    size_t len = b.len;
    memcpy(m, b.data, len);
    m[0] = (uint8_t)ddp_rng_below(&rng, 2);
    int edits = 1 + (int)ddp_rng_below(&rng, 6);
    for (int i = 0; i < edits && len > 1; i++) {
      size_t at = 1 + ddp_rng_below(&rng, len - 1);
      switch (ddp_rng_below(&rng, 4)) {
        case 0: m[at] ^= (uint8_t)(1u << ddp_rng_below(&rng, 8)); break;
        case 1: m[at] = (uint8_t)ddp_rng_next(&rng); break;
        case 2: m[at] = (uint8_t)(ddp_rng_below(&rng, 2) ? 0xff : 0); break;
        default: len = at; break; /* truncate */
      }
    }
    LLVMFuzzerTestOneInput(m, len);
  }
  free(m);
  ddp__buf_free(&b);
}

static void test_parse_int(void **state) {
  (void)state;
  int64_t v;
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"0", 1, &v), 0);
  assert_int_equal(v, 0);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"-17", 3, &v), 0);
  assert_int_equal(v, -17);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"9223372036854775807", 19, &v), 0);
  assert_true(v == INT64_MAX);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"-9223372036854775808", 20, &v), 0);
  assert_true(v == INT64_MIN);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"9223372036854775808", 19, &v), -2);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"", 0, &v), -1);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"-", 1, &v), -1);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)" 1", 2, &v), -1);
  assert_int_equal(ddp__store_parse_int((const uint8_t *)"1e3", 3, &v), -1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_trip_every_opcode),
      cmocka_unit_test(test_every_truncation_needs_more),
      cmocka_unit_test(test_nasty_inputs_are_refused),
      cmocka_unit_test(test_fuzz_corpus_replay),
      cmocka_unit_test(test_mutations),
      cmocka_unit_test(test_parse_int),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
