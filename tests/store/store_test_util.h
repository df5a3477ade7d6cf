/* Helpers shared by the store tests: timing, a thread that writes after a
 * delay, and starting a server on a free loopback port. */
#ifndef DDP_TESTS_STORE_UTIL_H
#define DDP_TESTS_STORE_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ddp/store.h"

static inline int64_t test_now_ms(void) { return ddp_time_ns() / 1000000; }

static inline void test_sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Sets keys[i] := values[i] on `store` after delay_ms, on its own thread. */
typedef struct delayed_set {
  ddp_store *store; /* the thread's own handle (destroyed by join) */
  int64_t delay_ms;
  const char *keys[4];
  const char *values[4];
  int num_keys;
  ddp_status status;
  pthread_t thread;
} delayed_set;

static void *delayed_set_main(void *arg) {
  delayed_set *d = arg;
  test_sleep_ms(d->delay_ms);
  d->status = DDP_OK;
  for (int i = 0; i < d->num_keys && d->status == DDP_OK; i++)
    d->status = ddp_store_set(d->store, d->keys[i], d->values[i], strlen(d->values[i]));
  return NULL;
}

/* Starts the thread on a clone of store (so a TCP store's blocking call on
 * the caller's handle does not hold this one up). */
static inline ddp_status delayed_set_start(delayed_set *d, ddp_store *store) {
  ddp_status st = ddp_store_clone(store, &d->store);
  if (st != DDP_OK) return st;
  pthread_create(&d->thread, NULL, delayed_set_main, d);
  return DDP_OK;
}

static inline ddp_status delayed_set_join(delayed_set *d) {
  pthread_join(d->thread, NULL);
  ddp_store_destroy(d->store);
  d->store = NULL;
  return d->status;
}

#endif /* DDP_TESTS_STORE_UTIL_H */
