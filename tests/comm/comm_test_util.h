/* Helpers for the process-group tests: a world of ranks as threads of this
 * process meeting in one in-process store (each thread creates its own
 * group through the public API), a thread-safe CHECK that records the first
 * failure (cmocka's asserts must stay on the main thread). Element access
 * and closed forms are src/comm/pattern.h's, shared with the backend tests
 * and ddp-bench. */
#ifndef DDP_TESTS_COMM_TEST_UTIL_H
#define DDP_TESTS_COMM_TEST_UTIL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/backend.h"
#include "comm/local_test_util.h"
#include "ddp/ddp.h"

#define CT_MAX_RANKS 16

typedef struct ct_world ct_world;

/* What one rank's thread gets. pg is its group (already created). */
typedef struct ct_rank {
  ct_world *world;
  int rank;
  ddp_process_group *pg;
} ct_rank;

struct ct_world {
  int size;
  ddp_store *store;
  ddp_process_group_options options;
  void (*body)(ct_rank *self);
  void *user;
  atomic_int unsupported; /* group creation said DDP_ERR_UNSUPPORTED: no backend */
  atomic_int failures;
  pthread_mutex_t mu;
  char first_failure[1024];
  pthread_barrier_t barrier;
  ct_rank ranks[CT_MAX_RANKS];
};

static inline void ct_fail(ct_world *w, int rank, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static inline void ct_fail(ct_world *w, int rank, const char *file, int line, const char *fmt, ...) {
  pthread_mutex_lock(&w->mu);
  if (atomic_fetch_add(&w->failures, 1) == 0) {
    int n = snprintf(w->first_failure, sizeof w->first_failure, "%s:%d: rank %d: ", file, line, rank);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->first_failure + n, sizeof w->first_failure - (size_t)n, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&w->mu);
}

/* In a rank's thread: records the failure and returns from the body. */
#define CT_CHECK(self, cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      ct_fail((self)->world, (self)->rank, __FILE__, __LINE__, __VA_ARGS__);       \
      return;                                                                      \
    }                                                                              \
  } while (0)
#define CT_OK(self, expr)                                                          \
  do {                                                                             \
    ddp_status ct__s = (expr);                                                     \
    CT_CHECK(self, ct__s == DDP_OK, "%s -> %s: %s", #expr, ddp_status_name(ct__s),  \
             ddp_last_error());                                                    \
  } while (0)

static inline void *ct_thread(void *arg) {
  ct_rank *self = arg;
  ct_world *w = self->world;
  char name[16];
  snprintf(name, sizeof name, "rank%d", self->rank);
  pthread_setname_np(pthread_self(), name);
  ddp_status st = ddp_process_group_create(w->store, self->rank, w->size, &w->options, &self->pg);
  if (st == DDP_ERR_UNSUPPORTED) {
    atomic_store(&w->unsupported, 1);
    return NULL;
  }
  if (st != DDP_OK) {
    ct_fail(w, self->rank, __FILE__, __LINE__, "create: %s", ddp_last_error());
    return NULL;
  }
  w->body(self);
  ddp_process_group_destroy(self->pg);
  self->pg = NULL;
  return NULL;
}

/* The transport the tests ask for: $DDP_TEST_TRANSPORT ("tcp" forces the tcp
 * backend; unset or "auto": local for threads of one process). */
static inline const char *ct_transport(void) {
  const char *t = getenv("DDP_TEST_TRANSPORT");
  return t && *t ? t : NULL;
}

/* Runs body on `size` rank threads meeting in `store` (NULL: a new
 * in-process store). Returns 0 when every rank passed, 1 on a failure
 * (printed), 2 when no backend could be created (SKIP). */
static inline int ct_run_on(ddp_store *store, int size, double timeout_s, void (*body)(ct_rank *),
                            void *user) {
  ct_world *w = calloc(1, sizeof *w);
  w->size = size;
  w->options.timeout_s = timeout_s;
  w->options.transport = ct_transport();
  w->body = body;
  w->user = user;
  pthread_mutex_init(&w->mu, NULL);
  pthread_barrier_init(&w->barrier, NULL, (unsigned)size);
  ddp_store_options so = {.timeout_ms = (int64_t)(timeout_s * 1000) + 5000};
  if (store)
    w->store = ddp_store_retain(store);
  else if (ddp_store_mem_create(&so, &w->store) != DDP_OK)
    abort();
  pthread_t threads[CT_MAX_RANKS];
  for (int r = 0; r < size; r++) {
    w->ranks[r] = (ct_rank){.world = w, .rank = r};
    pthread_create(&threads[r], NULL, ct_thread, &w->ranks[r]);
  }
  for (int r = 0; r < size; r++) pthread_join(threads[r], NULL);
  int result = atomic_load(&w->unsupported) && !atomic_load(&w->failures) ? 2
               : atomic_load(&w->failures)                                ? 1
                                                                          : 0;
  if (result == 1) fprintf(stderr, "FAILED (world of %d): %s\n", size, w->first_failure);
  ddp_store_destroy(w->store);
  pthread_barrier_destroy(&w->barrier);
  pthread_mutex_destroy(&w->mu);
  free(w);
  return result;
}

static inline int ct_run(int size, double timeout_s, void (*body)(ct_rank *), void *user) {
  return ct_run_on(NULL, size, timeout_s, body, user);
}

/* Every rank of the world waits here (not through the group). */
static inline void ct_sync(ct_rank *self) { pthread_barrier_wait(&self->world->barrier); }

#endif
