/* The biased exclusion of a group's inline calls (src/comm/bias.h), on its
 * own: the owner's calls and a revoker's never overlap, including when the
 * revoke lands while the owner is inside; a non-owner waits for the owner's
 * call; a revoke times out by name; DDP_INLINE_BIAS=0 (and TSan, and a
 * process without membarrier) starts revoked. The overlap is seen two
 * ways: an occupancy count that must stay at one, and a plain counter each
 * side increments inside its section, which loses updates when they run
 * together. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>

#include "comm/bias.h"

enum { ROUNDS = 1500, OWNER_CALLS = 200, OTHER_CALLS = 50, WORK = 100 };

typedef struct {
  ddp__bias bias;
  atomic_uint_fast64_t active; /* pg->active's role: 0 idle, 1 held */
  atomic_int occupancy;
  atomic_int overlaps;
  volatile long plain;         /* incremented WORK times per section */
  atomic_int revoke_delay;     /* spins before the revoker revokes */
  atomic_int biased_calls;     /* owner calls run biased */
  atomic_int revoke_errors;    /* (cmocka's asserts belong to the main thread) */
  atomic_int go;               /* both threads start together */
} shared;

static void section(shared *s) {
  if (atomic_fetch_add(&s->occupancy, 1) != 0) atomic_fetch_add(&s->overlaps, 1);
  for (int i = 0; i < WORK; i++) s->plain = s->plain + 1;
  atomic_fetch_sub(&s->occupancy, 1);
}

static void locked_section(shared *s) {
  for (;;) {
    uint_fast64_t idle = 0;
    if (atomic_compare_exchange_strong(&s->active, &idle, 1)) break;
  }
  section(s);
  atomic_store(&s->active, 0);
}

static void *owner_main(void *arg) {
  shared *s = arg;
  while (!atomic_load(&s->go)) {
  }
  for (int i = 0; i < OWNER_CALLS; i++) {
    if (ddp__bias_enter(&s->bias)) {
      section(s);
      ddp__bias_exit(&s->bias);
      atomic_fetch_add(&s->biased_calls, 1);
    } else {
      if (ddp__bias_revoke(&s->bias, 60000000000LL) != DDP_OK) atomic_fetch_add(&s->revoke_errors, 1);
      locked_section(s);
    }
  }
  return NULL;
}

static void *revoker_main(void *arg) {
  shared *s = arg;
  while (!atomic_load(&s->go)) {
  }
  for (volatile int i = 0, n = atomic_load(&s->revoke_delay); i < n; i++) {
  }
  if (ddp__bias_revoke(&s->bias, 60000000000LL) != DDP_OK) atomic_fetch_add(&s->revoke_errors, 1);
  for (int i = 0; i < OTHER_CALLS; i++) locked_section(s);
  return NULL;
}

static bool bias_usable(void) {
  if (DDP__BIAS_TSAN || !ddp__bias_available()) {
    print_message("bias unavailable here (%s): the locked protocol only\n",
                  DDP__BIAS_TSAN ? "ThreadSanitizer" : "no membarrier");
    return false;
  }
  return true;
}

/* The owner loops while a second thread revokes at a different moment each
 * round (before the owner's first call, while it is inside one, between
 * calls, after its last), then both keep going on the locked protocol. */
static void test_revoke_races_the_owner(void **state) {
  (void)state;
  if (!bias_usable()) skip();
  static shared s;
  long biased = 0;
  int mid = 0; /* rounds whose revoke came between the owner's first and last call */
  for (int round = 0; round < ROUNDS; round++) {
    ddp__bias_init(&s.bias);
    assert_true(atomic_load(&s.bias.biased));
    atomic_store(&s.active, 0);
    atomic_store(&s.occupancy, 0);
    atomic_store(&s.biased_calls, 0);
    s.plain = 0;
    atomic_store(&s.revoke_delay, (round * 7919) % 20000);
    atomic_store(&s.go, 0);
    pthread_t o, r;
    assert_int_equal(pthread_create(&o, NULL, owner_main, &s), 0);
    assert_int_equal(pthread_create(&r, NULL, revoker_main, &s), 0);
    atomic_store(&s.go, 1);
    pthread_join(o, NULL);
    pthread_join(r, NULL);
    assert_int_equal(atomic_load(&s.overlaps), 0);
    assert_int_equal(atomic_load(&s.revoke_errors), 0);
    assert_int_equal(s.plain, (long)(OWNER_CALLS + OTHER_CALLS) * WORK);
    assert_true(atomic_load(&s.bias.revoked));
    assert_false(atomic_load(&s.bias.biased));
    int got = atomic_load(&s.biased_calls);
    biased += got;
    mid += got > 0 && got < OWNER_CALLS;
    ddp__bias_destroy(&s.bias);
  }
  print_message("%d rounds (%d revoked mid-run), %ld owner calls run biased of %ld, no overlap\n", ROUNDS, mid,
                biased, (long)ROUNDS * OWNER_CALLS);
  assert_true(biased > 0); /* the owner did run biased: the race was there */
}

typedef struct {
  ddp__bias *bias;
  atomic_int done;
  ddp_status st;
  char msg[256];
  int64_t timeout_ns;
  bool entered;
} other_thread;

static void *other_main(void *arg) {
  other_thread *t = arg;
  t->entered = ddp__bias_enter(t->bias);
  t->st = ddp__bias_revoke(t->bias, t->timeout_ns);
  snprintf(t->msg, sizeof t->msg, "%s", t->st == DDP_OK ? "" : ddp_last_error());
  atomic_store(&t->done, 1);
  return NULL;
}

/* A second thread is no owner: its entry fails, and its revoke waits for
 * the owner's call to end; the owner's next entry fails. */
static void test_second_thread_waits_for_the_owner(void **state) {
  (void)state;
  if (!bias_usable()) skip();
  ddp__bias b;
  ddp__bias_init(&b);
  assert_true(ddp__bias_enter(&b)); /* this thread: the owner */
  other_thread t = {.bias = &b, .timeout_ns = 60000000000LL};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, other_main, &t), 0);
  struct timespec ts = {0, 100000000};
  nanosleep(&ts, NULL);
  assert_int_equal(atomic_load(&t.done), 0); /* still waiting for the owner */
  ddp__bias_exit(&b);
  pthread_join(th, NULL);
  assert_false(t.entered);
  assert_int_equal(t.st, DDP_OK);
  assert_true(atomic_load(&b.revoked));
  assert_false(ddp__bias_enter(&b));
  ddp__bias_destroy(&b);
}

/* An owner that stays inside past the revoker's time: DDP_ERR_TIMEOUT by
 * name, the bias not over; once the owner leaves, a revoke succeeds. */
static void test_revoke_times_out(void **state) {
  (void)state;
  if (!bias_usable()) skip();
  ddp__bias b;
  ddp__bias_init(&b);
  assert_true(ddp__bias_enter(&b));
  other_thread t = {.bias = &b, .timeout_ns = 1000000LL}; /* + the 5 s slack */
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, other_main, &t), 0);
  pthread_join(th, NULL);
  assert_int_equal(t.st, DDP_ERR_TIMEOUT);
  assert_non_null(strstr(t.msg, "did not finish in time"));
  assert_false(atomic_load(&b.revoked));
  ddp__bias_exit(&b);
  assert_int_equal(ddp__bias_revoke(&b, 1000000LL), DDP_OK);
  assert_true(atomic_load(&b.revoked));
  ddp__bias_destroy(&b);
}

/* DDP_INLINE_BIAS=0: revoked from the start, whoever calls. */
static void test_env_turns_it_off(void **state) {
  (void)state;
  setenv("DDP_INLINE_BIAS", "0", 1);
  ddp__bias b;
  ddp__bias_init(&b);
  unsetenv("DDP_INLINE_BIAS");
  assert_false(atomic_load(&b.biased));
  assert_true(atomic_load(&b.revoked));
  assert_false(ddp__bias_enter(&b));
  assert_int_equal(ddp__bias_revoke(&b, 0), DDP_OK);
  ddp__bias_destroy(&b);
  /* And without it, biased exactly where membarrier is usable. */
  ddp__bias_init(&b);
  assert_int_equal(atomic_load(&b.biased), !DDP__BIAS_TSAN && ddp__bias_available());
  ddp__bias_destroy(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env_turns_it_off),
      cmocka_unit_test(test_second_thread_waits_for_the_owner),
      cmocka_unit_test(test_revoke_times_out),
      cmocka_unit_test(test_revoke_races_the_owner),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
