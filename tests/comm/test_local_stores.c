/* How the local backend writes into the shared segment (local_stores.c):
 * the streaming copy against memcpy at every alignment of source and
 * destination and lengths around its 16-byte and 64-byte steps; the policy
 * under each DDP_LOCAL_STORES value (what streams, what does not, and that
 * every copy is exact); the slowness threshold; a bad value's error. The
 * collectives under DDP_LOCAL_STORES=streaming are test_local_procs_streaming
 * and test_local_large_streaming (CMakeLists.txt). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/local/local.h"

static void fill(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (uint8_t)(seed >> 24);
  }
}

/* Every destination and source offset in 0..63 and lengths that end on
 * either side of the 16- and 64-byte steps; the bytes around the
 * destination stay untouched. */
static void test_streaming_copy_exact(void **state) {
  (void)state;
  enum { PAD = 64, MAXLEN = 1100 };
  static _Alignas(64) uint8_t src[MAXLEN + 2 * PAD], dst[MAXLEN + 2 * PAD], ref[MAXLEN + 2 * PAD];
  const size_t lens[] = {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 1024, 1100 - 64};
  for (size_t di = 0; di < 64; di++)
    for (size_t si = 0; si < 64; si += 7)
      for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        size_t len = lens[li];
        fill(src, sizeof src, (uint32_t)(di * 131 + si * 7 + len));
        fill(dst, sizeof dst, 99);
        memcpy(ref, dst, sizeof ref);
        memcpy(ref + PAD + di, src + si, len);
        ddp__local_copy_streaming(dst + PAD + di, src + si, len);
        if (memcmp(dst, ref, sizeof ref) != 0)
          fail_msg("streaming copy: dst offset %zu, src offset %zu, %zu bytes differ", di, si, len);
      }
}

/* A fake backend is enough: the policy reads only `stores`,
 * `stream_until_ns` and `copies_streamed`. */
static bool copy_with(ddp__local_backend *b, size_t len, uint32_t seed) {
  uint8_t *src = malloc(len + 64), *dst = malloc(len + 64);
  assert_non_null(src);
  assert_non_null(dst);
  fill(src, len + 64, seed);
  memset(dst, 0, len + 64);
  bool streamed = ddp__local_shared_copy(b, dst + 3, src + 5, len);
  assert_memory_equal(dst + 3, src + 5, len);
  assert_int_equal(dst[2], 0);
  assert_int_equal(dst[3 + len], 0);
  free(src);
  free(dst);
  return streamed;
}

static void test_policy(void **state) {
  (void)state;
  ddp__local_backend b;
  memset(&b, 0, sizeof b);
  const size_t big = 1u << 20, small = 2 * DDP__LOCAL_STORE_PROBE - 1;

  b.stores = DDP__LOCAL_STORES_CACHED;
  assert_false(copy_with(&b, big, 1));
  assert_int_equal(b.copies_streamed, 0);

  b.stores = DDP__LOCAL_STORES_STREAMING;
  assert_true(copy_with(&b, big, 2));
  assert_false(copy_with(&b, small, 3)); /* too small to stream */
  assert_true(copy_with(&b, small + 1, 4));
  assert_int_equal(b.copies_streamed, 2);

  /* auto: small copies never probe nor stream; after a slow probe, copies
   * stream unprobed until stream_until_ns; whatever a probe finds, the copy
   * is exact. */
  b.stores = DDP__LOCAL_STORES_AUTO;
  b.copies_streamed = 0;
  assert_false(copy_with(&b, small, 5));
  assert_int_equal(b.copies_streamed, 0);
  b.stream_until_ns = ddp_time_ns() + 60 * (int64_t)1000000000;
  assert_true(copy_with(&b, big, 6));
  assert_false(copy_with(&b, small, 7));
  assert_int_equal(b.copies_streamed, 1);
  b.stream_until_ns = 0;
  for (uint32_t i = 0; i < 8; i++) copy_with(&b, big + i, 8 + i);
}

/* 4 GB/s: bytes per ns below 4 is slow. */
static void test_slow_threshold(void **state) {
  (void)state;
  assert_true(ddp__local_store_is_slow(4096, 8192));  /* 2 GB/s */
  assert_false(ddp__local_store_is_slow(1024, 8192)); /* 8 GB/s */
  assert_false(ddp__local_store_is_slow(2048, 8192)); /* exactly 4 GB/s */
  assert_true(ddp__local_store_is_slow(2049, 8192));
}

static void test_env(void **state) {
  (void)state;
  ddp__local_stores s;
  const char *names[] = {"auto", "cached", "streaming"};
  const ddp__local_stores want[] = {DDP__LOCAL_STORES_AUTO, DDP__LOCAL_STORES_CACHED,
                                    DDP__LOCAL_STORES_STREAMING};
  for (int i = 0; i < 3; i++) {
    setenv("DDP_LOCAL_STORES", names[i], 1);
    assert_int_equal(ddp__local_stores_from_env(&s), DDP_OK);
    assert_int_equal(s, want[i]);
  }
  unsetenv("DDP_LOCAL_STORES");
  assert_int_equal(ddp__local_stores_from_env(&s), DDP_OK);
  assert_int_equal(s, DDP__LOCAL_STORES_AUTO);
  setenv("DDP_LOCAL_STORES", "fast", 1);
  assert_int_equal(ddp__local_stores_from_env(&s), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "DDP_LOCAL_STORES=fast"));
  unsetenv("DDP_LOCAL_STORES");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_streaming_copy_exact),
      cmocka_unit_test(test_policy),
      cmocka_unit_test(test_slow_threshold),
      cmocka_unit_test(test_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
