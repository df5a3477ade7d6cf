/* core: status table, last error, arenas, RNG, allocation hooks, env parsing,
 * the preemption clock. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#include <cmocka.h>

#include "ddp/core.h"

static void test_status_table(void **state) {
  (void)state;
  assert_string_equal(ddp_strerror(DDP_OK), "success");
  assert_string_equal(ddp_strerror(DDP_ERR_TIMEOUT), "timed out");
  assert_string_equal(ddp_status_name(DDP_ERR_SHAPE), "DDP_ERR_SHAPE");
  assert_string_equal(ddp_strerror((ddp_status)-999), "unknown status");
}

static void test_last_error_and_wrap(void **state) {
  (void)state;
  ddp_clear_error();
  assert_string_equal(ddp_last_error(), "");
  ddp_status s = ddp_error(DDP_ERR_SHAPE, "linear: x is (%d,%d)", 8, 3);
  assert_int_equal(s, DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(), "linear: x is (8,3)");
  s = ddp_error_wrap(s, "layer %s", "fc");
  assert_int_equal(s, DDP_ERR_SHAPE);
  assert_string_equal(ddp_last_error(), "layer fc: linear: x is (8,3)");
}

static void test_arena_reuses_memory(void **state) {
  (void)state;
  ddp_arena a;
  ddp_arena_init(&a, 4096);
  /* First cycle needs several chunks. */
  for (int i = 0; i < 100; i++) {
    char *p = ddp_arena_alloc(&a, 1000);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    memset(p, i, 1000);
  }
  ddp_arena_reset(&a);
  uint64_t before = ddp_alloc_count();
  for (int cycle = 0; cycle < 5; cycle++) {
    for (int i = 0; i < 100; i++) assert_non_null(ddp_arena_alloc(&a, 1000));
    ddp_arena_reset(&a);
  }
  assert_int_equal(ddp_alloc_count(), before); /* steady state: no allocation */
  ddp_arena_free(&a);
}

/* A backed arena (the device arenas of src/tensor/cuda/) takes every chunk
 * from its backing and gives each back exactly once: on reset when a
 * cycle needed several (merged into one of the high-water size) and on
 * free; calloc clears through the backing; the steady state calls it no
 * more. A backing that fails makes the allocation fail with its name. */
static int backing_allocs, backing_frees, backing_zeroes, backing_fail;
static void *backing_alloc(size_t bytes) {
  if (backing_fail) return NULL;
  backing_allocs++;
  return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}
static void backing_free(void *p) { backing_frees++, free(p); }
static void backing_zero(void *p, size_t bytes) { backing_zeroes++, memset(p, 0, bytes); }
static const ddp_arena_backing test_backing = {"test-device", backing_alloc, backing_free,
                                               backing_zero};

static void test_arena_backed(void **state) {
  (void)state;
  ddp_arena a;
  ddp_arena_init_backed(&a, 4096, &test_backing);
  for (int i = 0; i < 20; i++) {
    char *p = ddp_arena_alloc(&a, 1000);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
  }
  int first = backing_allocs;
  assert_true(first > 1); /* several chunks */
  ddp_arena_reset(&a);
  assert_int_equal(backing_frees, first);
  assert_int_equal(backing_allocs, first + 1); /* the merged one */
  for (int cycle = 0; cycle < 3; cycle++) {
    for (int i = 0; i < 20; i++) assert_non_null(ddp_arena_alloc(&a, 1000));
    ddp_arena_reset(&a);
  }
  assert_int_equal(backing_allocs, first + 1);
  unsigned char *z = ddp_arena_calloc(&a, 100);
  assert_non_null(z);
  assert_int_equal(backing_zeroes, 1);
  assert_int_equal(z[0] | z[99], 0);
  backing_fail = 1;
  assert_null(ddp_arena_alloc(&a, 1 << 20));
  assert_non_null(strstr(ddp_last_error(), "test-device"));
  backing_fail = 0;
  ddp_arena_free(&a);
  assert_int_equal(backing_frees, backing_allocs);
}

/* ddp_arena_release: later allocations of the cycle come from the released
 * block first (first fit, 64-byte aligned, from its front), larger ones
 * from the bump pointer; the cycle's high-water mark counts the block
 * once, so the steady state is smaller and allocates nothing; with every
 * hole taken a release is ignored; reset forgets the holes. */
static void test_arena_release(void **state) {
  (void)state;
  ddp_arena a;
  ddp_arena_init(&a, 1 << 20);
  size_t water[2];
  for (int cycle = 0; cycle < 2; cycle++) {
    char *big = ddp_arena_alloc(&a, 100000);
    char *keep = ddp_arena_alloc(&a, 1000);
    assert_non_null(big);
    assert_non_null(keep);
    memset(big, 1, 100000);
    ddp_arena_release(&a, big, 100000);
#if defined(__SANITIZE_ADDRESS__)
    assert_true(__asan_address_is_poisoned(big)); /* a released block reads as an error */
#endif
    char *p = ddp_arena_alloc(&a, 30000), *q = ddp_arena_alloc(&a, 100);
    assert_ptr_equal(p, big);                      /* the hole's front */
    assert_ptr_equal(q, big + 30016);              /* 30000 rounded up to 64 */
#if defined(__SANITIZE_ADDRESS__)
    assert_false(__asan_address_is_poisoned(q + 99)); /* handed out again: usable */
    assert_true(__asan_address_is_poisoned(q + 128)); /* the rest of the hole */
#endif
    char *r = ddp_arena_alloc(&a, 80000);          /* larger than what is left */
    assert_true(r > keep);
    memset(p, 2, 30000);
    memset(q, 3, 100);
    water[cycle] = a.high_water;
    ddp_arena_reset(&a);
  }
  assert_int_equal(water[0], water[1]);
  /* 100000 + 1000 + 80000 (rounded), not 100000 + 1000 + 30000 + 100 + 80000 */
  assert_int_equal(water[0], 100032 + 1024 + 80000);
  uint64_t before = ddp_alloc_count();
  char *blocks[DDP_ARENA_HOLES + 1];
  for (int i = 0; i <= DDP_ARENA_HOLES; i++) blocks[i] = ddp_arena_alloc(&a, 4096);
  for (int i = 0; i <= DDP_ARENA_HOLES; i++) ddp_arena_release(&a, blocks[i], 4096);
  assert_int_equal(a.n_holes, DDP_ARENA_HOLES); /* the last release ignored */
  for (int i = 0; i < DDP_ARENA_HOLES; i++) assert_ptr_equal(ddp_arena_alloc(&a, 4096), blocks[i]);
  assert_true((char *)ddp_arena_alloc(&a, 4096) > blocks[DDP_ARENA_HOLES]);
  ddp_arena_reset(&a);
  assert_int_equal(a.n_holes, 0);
  assert_int_equal(ddp_alloc_count(), before);
  ddp_arena_free(&a);
}

static void test_rng_reproducible_and_uniform(void **state) {
  (void)state;
  ddp_rng a, b;
  ddp_rng_seed(&a, 42);
  ddp_rng_seed(&b, 42);
  for (int i = 0; i < 100; i++) assert_true(ddp_rng_next(&a) == ddp_rng_next(&b));
  /* Mean of U[0,1) over 1e5 draws is 0.5 within 5 sigma (sigma = 0.29/316). */
  double sum = 0, sq = 0;
  for (int i = 0; i < 100000; i++) {
    float u = ddp_rng_uniform(&a);
    assert_true(u >= 0.0f && u < 1.0f);
    sum += u;
  }
  assert_true(sum / 100000 > 0.5 - 0.0046 && sum / 100000 < 0.5 + 0.0046);
  sum = 0;
  for (int i = 0; i < 100000; i++) {
    double z = ddp_rng_normal(&a);
    sum += z;
    sq += z * z;
  }
  assert_true(sum / 100000 < 0.016 && sum / 100000 > -0.016);
  assert_true(sq / 100000 > 0.98 && sq / 100000 < 1.02);
  for (int i = 0; i < 1000; i++) assert_true(ddp_rng_below(&a, 7) < 7);
}

static int counted;
static void *counting_alloc(size_t bytes, void *user) {
  (void)user;
  counted++;
  void *p = NULL;
  return posix_memalign(&p, 64, bytes ? bytes : 64) == 0 ? p : NULL;
}
static void counting_free(void *p, void *user) {
  (void)user;
  free(p);
}
static void *failing_alloc(size_t bytes, void *user) {
  (void)bytes;
  (void)user;
  return NULL;
}

static void test_alloc_hooks(void **state) {
  (void)state;
  ddp_alloc_hooks h = {counting_alloc, counting_free, NULL};
  ddp_set_alloc_hooks(&h);
  counted = 0;
  void *p = ddp_alloc(100);
  assert_non_null(p);
  assert_int_equal((uintptr_t)p % 64, 0);
  ddp_free(p);
  ddp_free(NULL);
  assert_int_equal(counted, 1);
  ddp_alloc_hooks fail = {failing_alloc, counting_free, NULL};
  ddp_set_alloc_hooks(&fail);
  ddp_arena a;
  ddp_arena_init(&a, 64);
  assert_null(ddp_arena_alloc(&a, 10)); /* failure is a value, not an abort */
  assert_non_null(strstr(ddp_last_error(), "arena"));
  ddp_set_alloc_hooks(NULL);
  ddp_arena_free(&a);
}

/* ddp_realloc goes through the hooks (one counted alloc, the old block
 * freed by the hook), keeps the first old_bytes, and on failure returns
 * NULL with the old block intact. */
static void test_ddp_realloc(void **state) {
  (void)state;
  ddp_alloc_hooks h = {counting_alloc, counting_free, NULL};
  ddp_set_alloc_hooks(&h);
  counted = 0;
  uint64_t before = ddp_alloc_count();
  unsigned char *p = ddp_realloc(NULL, 0, 10);
  assert_non_null(p);
  for (int i = 0; i < 10; i++) p[i] = (unsigned char)(i + 1);
  unsigned char *q = ddp_realloc(p, 10, 1000);
  assert_non_null(q);
  assert_int_equal((uintptr_t)q % 64, 0);
  for (int i = 0; i < 10; i++) assert_int_equal(q[i], i + 1);
  assert_int_equal(counted, 2);
  assert_int_equal(ddp_alloc_count() - before, 2);
  ddp_alloc_hooks fail = {failing_alloc, counting_free, NULL};
  ddp_set_alloc_hooks(&fail);
  assert_null(ddp_realloc(q, 1000, 2000));
  ddp_set_alloc_hooks(&h);
  for (int i = 0; i < 10; i++) assert_int_equal(q[i], i + 1); /* still ours */
  unsigned char *r = ddp_realloc(q, 4, 2); /* shrinking keeps the first 2 */
  assert_non_null(r);
  assert_int_equal(r[0], 1);
  assert_int_equal(r[1], 2);
  ddp_free(r);
  ddp_set_alloc_hooks(NULL);
}

static void test_env_parsing(void **state) {
  (void)state;
  int64_t v;
  unsetenv("DDP_TEST_X");
  assert_int_equal(ddp_env_int("DDP_TEST_X", 7, &v), DDP_OK);
  assert_int_equal(v, 7);
  setenv("DDP_TEST_X", "123", 1);
  assert_int_equal(ddp_env_int("DDP_TEST_X", 7, &v), DDP_OK);
  assert_int_equal(v, 123);
  setenv("DDP_TEST_X", "12x", 1);
  assert_int_equal(ddp_env_int("DDP_TEST_X", 7, &v), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "DDP_TEST_X=\"12x\""));
  double d;
  setenv("DDP_TEST_X", "2.5", 1);
  assert_int_equal(ddp_env_double("DDP_TEST_X", 0, &d), DDP_OK);
  assert_true(d == 2.5);
  assert_string_equal(ddp_env_str("DDP_TEST_UNSET_Y", "fb"), "fb");
}

/* ---- The preemption clock ---- */

static int64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static atomic_int spinner_stop;

static void *spin_until_stopped(void *arg) {
  (void)arg;
  while (!atomic_load_explicit(&spinner_stop, memory_order_relaxed)) {
  }
  return NULL;
}

/* A thread that never sleeps is, at every moment, either running or
 * waiting for a CPU: wall time minus its CPU time (CLOCK_THREAD_CPUTIME_ID,
 * an independent account) is what the clock must read. Sharing one CPU
 * with two more spinning threads, it waits about two thirds of the time. */
static void test_preempt_clock(void **state) {
  (void)state;
  ddp_preempt_clock c;
  ddp_preempt_clock_open(&c);
  if (c.fd < 0) {
    fprintf(stderr, "test_preempt_clock: skipped: this kernel keeps no "
                    "/proc/thread-self/schedstat\n");
    skip();
  }
  cpu_set_t saved, one;
  assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof saved, &saved), 0);
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  assert_int_equal(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
  atomic_store(&spinner_stop, 0);
  pthread_t others[2];
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  assert_int_equal(pthread_attr_setaffinity_np(&attr, sizeof one, &one), 0);
  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_create(&others[i], &attr, spin_until_stopped, NULL), 0);
  pthread_attr_destroy(&attr);

  int64_t wait0 = ddp_preempt_clock_ns(&c), cpu0 = thread_cpu_ns(), wall0 = ddp_time_ns();
  while (ddp_time_ns() - wall0 < 400 * 1000 * 1000) {
  }
  int64_t wait1 = ddp_preempt_clock_ns(&c), cpu1 = thread_cpu_ns(), wall1 = ddp_time_ns();
  atomic_store(&spinner_stop, 1);
  for (int i = 0; i < 2; i++) pthread_join(others[i], NULL);
  pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
  ddp_preempt_clock_close(&c);
  assert_int_equal(ddp_preempt_clock_ns(&c), -1);

  double wall = (double)(wall1 - wall0), waited = (double)(wait1 - wait0);
  double off_cpu = wall - (double)(cpu1 - cpu0);
  fprintf(stderr, "test_preempt_clock: %.0f ms: waited %.1f ms by the clock, %.1f ms off the CPU\n",
          wall / 1e6, waited / 1e6, off_cpu / 1e6);
  /* Two thirds (the CPU's time, in turn, is not), with room for slices. */
  assert_true(waited >= 0.5 * wall);
  assert_true(fabs(waited - off_cpu) <= 0.05 * wall + 5e6);
}

static void test_log_level(void **state) {
  (void)state;
  ddp_log_set_level(DDP_LOG_ERROR);
  assert_int_equal(ddp_log_get_level(), DDP_LOG_ERROR);
  ddp_log_set_rank(3);
  DDP_WARN("this line is filtered out");
  ddp_log_set_level(DDP_LOG_WARN);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_table),       cmocka_unit_test(test_last_error_and_wrap),
      cmocka_unit_test(test_arena_reuses_memory), cmocka_unit_test(test_arena_release),
      cmocka_unit_test(test_arena_backed),
      cmocka_unit_test(test_rng_reproducible_and_uniform),
      cmocka_unit_test(test_alloc_hooks),         cmocka_unit_test(test_env_parsing),
      cmocka_unit_test(test_ddp_realloc),
      cmocka_unit_test(test_log_level),           cmocka_unit_test(test_preempt_clock),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
