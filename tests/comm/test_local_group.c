/* The local backend through the public API: groups of threads over one
 * in-process store and of processes over a store server pick it
 * ("threads" / "shm" transports); blocking and async collectives with
 * closed-form results; a world of 8 threads split into four 2-rank groups
 * that run side by side; a process killed with SIGKILL fails the others'
 * ddp_allreduce with DDP_ERR_PEER naming it, and the error stays. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>

#include "comm/local_proc_util.h"
#include "ddp/comm.h"

typedef struct rank_arg {
  ddp_store *store;
  int rank, size;
  int failures;
  char err[256];
} rank_arg;

#define FAILF(a, ...)                                                         \
  do {                                                                        \
    if ((a)->failures++ == 0) snprintf((a)->err, sizeof (a)->err, __VA_ARGS__); \
  } while (0)

/* allreduce (blocking and async), broadcast, allgather and split into
 * groups of 2 on one rank of a world; shared by threads and processes. */
static void group_body(rank_arg *a, const char *want_transport) {
  ddp_process_group_options o = {.timeout_s = 60};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(a->store, a->rank, a->size, &o, &pg) != DDP_OK) {
    FAILF(a, "rank %d: create: %s", a->rank, ddp_last_error());
    return;
  }
  int r = a->rank, P = a->size;
  const char *t = ddp_process_group_transport(pg, (r + 1) % P);
  if (strcmp(t, want_transport) != 0) FAILF(a, "rank %d: transport %s", r, t);

  enum { N = 100003 };
  float *v = ddp_alloc(N * sizeof(float));
  for (int i = 0; i < N; i++) v[i] = (float)((r + 1) * (i % 7 + 1));
  if (ddp_allreduce(pg, v, N, DDP_FLOAT32, DDP_REDUCE_AVG) != DDP_OK)
    FAILF(a, "rank %d: allreduce: %s", r, ddp_last_error());
  for (int i = 0; i < N; i++)
    if (v[i] != (float)((P + 1) / 2.0 * (i % 7 + 1))) {
      FAILF(a, "rank %d: allreduce avg [%d] = %g", r, i, v[i]);
      break;
    }

  int64_t x[3] = {r, 10 * r, -r};
  ddp_work *w = NULL;
  if (ddp_allreduce_async(pg, x, 3, DDP_INT64, DDP_REDUCE_MAX, &w) != DDP_OK ||
      ddp_work_wait(w, -1) != DDP_OK)
    FAILF(a, "rank %d: allreduce_async: %s", r, ddp_last_error());
  ddp_work_free(w);
  if (x[0] != P - 1 || x[1] != 10 * (P - 1) || x[2] != 0) FAILF(a, "rank %d: max wrong", r);

  double d[5] = {0};
  if (r == 1)
    for (int i = 0; i < 5; i++) d[i] = i + 0.5;
  if (ddp_broadcast(pg, d, 5, DDP_FLOAT64, 1) != DDP_OK)
    FAILF(a, "rank %d: broadcast: %s", r, ddp_last_error());
  for (int i = 0; i < 5; i++)
    if (d[i] != i + 0.5) FAILF(a, "rank %d: broadcast [%d] = %g", r, i, d[i]);

  int32_t mine = 100 + r, all[8] = {0};
  if (ddp_allgather(pg, &mine, all, 1, DDP_INT32) != DDP_OK)
    FAILF(a, "rank %d: allgather: %s", r, ddp_last_error());
  for (int q = 0; q < P; q++)
    if (all[q] != 100 + q) FAILF(a, "rank %d: allgather [%d] = %d", r, q, all[q]);

  /* Pairs (0,1), (2,3), ...: each runs its own allreduces side by side. */
  ddp_process_group *pair = NULL;
  if (ddp_process_group_split(pg, r / 2, r, &pair) != DDP_OK || !pair) {
    FAILF(a, "rank %d: split: %s", r, ddp_last_error());
  } else {
    for (int k = 0; k < 200; k++) {
      int32_t y = r * 1000 + k;
      if (ddp_allreduce(pair, &y, 1, DDP_INT32, DDP_REDUCE_SUM) != DDP_OK) {
        FAILF(a, "rank %d: pair allreduce: %s", r, ddp_last_error());
        break;
      }
      int lo = r / 2 * 2;
      int32_t want = ddp_process_group_size(pair) == 2 ? (lo * 1000 + k) + ((lo + 1) * 1000 + k)
                                                       : y;
      if (y != want) {
        FAILF(a, "rank %d: pair allreduce %d = %d, expected %d", r, k, y, want);
        break;
      }
    }
    ddp_process_group_destroy(pair);
  }
  if (ddp_barrier(pg) != DDP_OK) FAILF(a, "rank %d: barrier: %s", r, ddp_last_error());
  ddp_free(v);
  ddp_process_group_destroy(pg);
}

static void *thread_main(void *p) {
  group_body(p, "threads");
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  int sizes[] = {2, 3, 8};
  for (int s = 0; s < 3; s++) {
    int P = sizes[s];
    ddp_store *store = NULL;
    assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
    rank_arg a[8];
    pthread_t th[8];
    for (int r = 0; r < P; r++) {
      a[r] = (rank_arg){.store = store, .rank = r, .size = P};
      pthread_create(&th[r], NULL, thread_main, &a[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    ddp_store_destroy(store);
    for (int r = 0; r < P; r++)
      if (a[r].failures) fail_msg("world %d: %s", P, a[r].err);
  }
}


static ddp_store *child_store(const char *prefix) {
  ddp_store_options o = {.timeout_ms = 30000};
  ddp_store *base = NULL, *store = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", lp_the_server.port, &o, &base) != DDP_OK ||
      ddp_store_prefix(base, prefix, &store) != DDP_OK)
    _exit(10);
  ddp_store_destroy(base);
  return store;
}

static int proc_rank(int rank, int size, void *arg) {
  char prefix[32];
  snprintf(prefix, sizeof prefix, "group%d/", size);
  rank_arg a = {.store = child_store(prefix), .rank = rank, .size = size};
  group_body(&a, "shm");
  ddp_store_destroy(a.store);
  if (a.failures) fprintf(stderr, "%s\n", a.err);
  return a.failures ? 1 : 0;
}

static void test_processes(void **state) {
  (void)state;
  assert_int_equal(lp_server_start(&lp_the_server), 0);
  int sizes[] = {2, 4};
  for (int s = 0; s < 2; s++) {
    pid_t pids[8];
    lp_spawn(sizes[s], 60, proc_rank, NULL, pids);
    int bad = lp_reap(sizes[s], pids);
    if (bad) {
      lp_server_stop(&lp_the_server);
      fail_msg("world %d failed (see stderr)", sizes[s]);
    }
    assert_int_equal(lp_count_segments(pids[0]), 0);
  }
  lp_server_stop(&lp_the_server);
}

/* Three processes loop ddp_allreduce; rank 2 is killed. */
static int kill_rank(int rank, int size, void *arg) {
  ddp_store *store = child_store("kill/");
  ddp_process_group_options o = {.timeout_s = 60};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(store, rank, size, &o, &pg) != DDP_OK) return 10;
  float v[1024] = {0};
  for (int k = 0;; k++) {
    ddp_status st = ddp_allreduce(pg, v, 1024, DDP_FLOAT32, DDP_REDUCE_SUM);
    if (st == DDP_OK) {
      if (k == 0) lp_ready_signal();
      continue;
    }
    int code = st == DDP_ERR_PEER && strstr(ddp_last_error(), "rank 2") ? 0 : 2;
    if (code) fprintf(stderr, "rank %d: %s: %s\n", rank, ddp_status_name(st), ddp_last_error());
    /* Sticky: the same error again. */
    if (ddp_barrier(pg) != st) code = 3;
    ddp_process_group_destroy(pg);
    ddp_store_destroy(store);
    return code;
  }
}

static void test_kill(void **state) {
  (void)state;
  assert_int_equal(lp_server_start(&lp_the_server), 0);
  pid_t pids[3];
  lp_ready_open();
  lp_spawn(3, 30, kill_rank, NULL, pids);
  if (lp_ready_wait(3) != 0) fprintf(stderr, "ranks did not all start\n");
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  kill(pids[2], SIGKILL);
  int64_t killed = ddp_time_ns();
  int bad = lp_reap(2, pids);
  double took = (double)(ddp_time_ns() - killed) * 1e-9;
  waitpid(pids[2], NULL, 0);
  lp_server_stop(&lp_the_server);
  printf("ddp_allreduce: both survivors failed %.3f s after the kill\n", took);
  assert_int_equal(bad, 0);
  assert_true(took < 5.0);
  assert_int_equal(lp_count_segments(pids[0]), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_threads),
      cmocka_unit_test(test_processes),
      cmocka_unit_test(test_kill),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
