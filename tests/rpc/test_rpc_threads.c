/* The RPC engine with its workers as threads of one process (an in-process
 * store): small enough for ThreadSanitizer. Every worker echoes payloads
 * and tensors (small, and large enough for cross-memory attach) to every
 * other, makes nested calls with a pool of one thread, and many async calls
 * with then-callbacks, then all shut down gracefully. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "rpc_test_handlers.h"

#define WORKERS 3

typedef struct worker_arg {
  int rank;
  ddp_store *store;
  int failures;
  char msg[512];
} worker_arg;

#define CHECK(w, cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond) && (w)->failures++ == 0) snprintf((w)->msg, sizeof (w)->msg, __VA_ARGS__); \
  } while (0)

static atomic_int callbacks_ran;

static void on_done(ddp_rpc_future *f, void *user) {
  (void)user;
  if (ddp_rpc_future_status(f) == DDP_OK) atomic_fetch_add(&callbacks_ran, 1);
}

static void *worker_main(void *p) {
  worker_arg *w = p;
  char name[16];
  snprintf(name, sizeof name, "w%d", w->rank);
  ddp_rpc_options o = ddp_rpc_defaults();
  o.name = name;
  o.rank = w->rank;
  o.world_size = WORKERS;
  o.store = w->store;
  o.num_threads = 1;
  o.init_timeout_s = 30;
  ddp_rpc_agent *a;
  if (ddp_rpc_init(&o, &a) != DDP_OK) {
    CHECK(w, false, "init %s: %s", name, ddp_last_error());
    return NULL;
  }
  for (int to = 0; to < WORKERS; to++) {
    char dest[16];
    snprintf(dest, sizeof dest, "w%d", to);
    for (int64_t n = 16; n <= (1 << 17); n *= 64) {
      ddp_tensor *t;
      ddp_tensor_create(&t, DDP_FLOAT32, 1, &n);
      fill_bytes(t->data, (size_t)n * 4, (uint64_t)(w->rank * 10 + to));
      ddp_tensor *ts[1] = {t};
      ddp_rpc_message m = {.payload = name, .payload_bytes = strlen(name), .tensors = ts, .num_tensors = 1}, out;
      ddp_status st = ddp_rpc_sync(a, dest, "echo", &m, 20, &out);
      CHECK(w, st == DDP_OK, "echo %s -> %s: %s", name, dest, ddp_last_error());
      if (st == DDP_OK) {
        CHECK(w, out.num_tensors == 1 && memcmp(out.tensors[0]->data, t->data, (size_t)n * 4) == 0,
              "echo %s -> %s: tensor of %lld differs", name, dest, (long long)n);
        ddp_rpc_message_free(&out);
      }
      ddp_tensor_destroy(t);
    }
    int64_t depth = 3;
    ddp_rpc_message m = {.payload = &depth, .payload_bytes = 8}, out;
    ddp_status st = ddp_rpc_sync(a, dest, "ping", &m, 20, &out);
    CHECK(w, st == DDP_OK, "ping %s -> %s: %s", name, dest, ddp_last_error());
    if (st == DDP_OK) {
      int64_t hops = 0;
      memcpy(&hops, out.payload, 8);
      CHECK(w, hops == 4, "ping %s -> %s: %lld hops", name, dest, (long long)hops);
      ddp_rpc_message_free(&out);
    }
  }
  ddp_rpc_future *fs[20];
  for (int i = 0; i < 20; i++) {
    int64_t v = i;
    ddp_rpc_message m = {.payload = &v, .payload_bytes = 8};
    char dest[16];
    snprintf(dest, sizeof dest, "w%d", (w->rank + 1 + i) % WORKERS);
    if (ddp_rpc_async(a, dest, "echo", &m, 20, &fs[i]) != DDP_OK) {
      CHECK(w, false, "async: %s", ddp_last_error());
      fs[i] = NULL;
      continue;
    }
    ddp_rpc_future_then(fs[i], on_done, NULL);
  }
  for (int i = 0; i < 20; i++) {
    if (!fs[i]) continue;
    CHECK(w, ddp_rpc_future_wait(fs[i], 20) == DDP_OK, "wait: %s", ddp_last_error());
    ddp_rpc_future_destroy(fs[i]);
  }
  ddp_status st = ddp_rpc_shutdown(a, true, 30);
  CHECK(w, st == DDP_OK, "shutdown %s: %s", name, ddp_last_error());
  return NULL;
}

static void test_threads_as_workers(void **state) {
  (void)state;
  register_test_handlers();
  ddp_store *store;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  pthread_t th[WORKERS];
  worker_arg args[WORKERS];
  memset(args, 0, sizeof args);
  for (int r = 0; r < WORKERS; r++) {
    args[r].rank = r;
    args[r].store = store;
    assert_int_equal(pthread_create(&th[r], NULL, worker_main, &args[r]), 0);
  }
  for (int r = 0; r < WORKERS; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < WORKERS; r++)
    if (args[r].failures) fail_msg("worker %d: %s", r, args[r].msg);
  /* Every callback ran before its agent's graceful shutdown returned. */
  assert_int_equal(atomic_load(&callbacks_ran), WORKERS * 20);
  ddp_store_destroy(store);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_threads_as_workers)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
