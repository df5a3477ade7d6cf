/* local backend, "shm" provider: ranks as real processes (fork), meeting
 * through a store server. Every op x dtype x world 1..8 x counts 0, 1, not
 * divisible by the world and up to 1 MiB against closed-form values; a rank
 * killed with SIGKILL in a loop of allreduces fails every other rank within
 * 5 s with DDP_ERR_PEER naming it; nothing is left in /dev/shm. The matrix
 * again as where cross-memory attach is refused, and with 2 processes of 2
 * threads each; 300 allreduces in a row between 2 processes. */
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
#include "comm/local_test_util.h"

static int matrix_rank(int rank, int size, void *arg) {
  char prefix[32];
  /* arg non-NULL: as where cross-memory attach is refused. */
  if (arg) setenv("DDP_LOCAL_NO_CMA", "1", 1);
  snprintf(prefix, sizeof prefix, "matrix%d%s/", size, arg ? "nocma" : "");
  ddp_store *store = NULL;
  ddp__backend *b = lp_child_backend(&lp_the_server, prefix, rank, size, &store);
  if (size > 1 && strcmp(b->ops->transport(b, (rank + 1) % size), "shm") != 0) {
    fprintf(stderr, "rank %d: transport %s\n", rank, b->ops->transport(b, (rank + 1) % size));
    return 3;
  }
  lt_matrix m = {.rank = rank, .size = size, .b = b};
  atomic_init(&m.aborted, false);
  size_t counts[3] = {0, 1, 7 * (size_t)size + 3};
  m.counts = counts;
  m.num_counts = 3;
  lt_run_matrix(&m);
  for (size_t d = 0; d < LT_NUM_DTYPES && !m.failures; d++) {
    size_t count = (1u << 20) / ddp_dtype_size(lt_dtypes[d]) / (size_t)size + 3;
    lt_run_case(&m, lt_dtypes[d], count, (int)d);
  }
  b->ops->destroy(b);
  ddp_store_destroy(store);
  if (m.failures) {
    fprintf(stderr, "world %d: %d failures; first: %s\n", size, m.failures, m.err);
    return 1;
  }
  return 0;
}

static void test_matrix(void **state) {
  (void)state;
  pid_t pids[8];
  for (int size = 1; size <= 8; size++) {
    lp_spawn(size, 60, matrix_rank, NULL, pids);
    if (lp_reap(size, pids) != 0) fail_msg("world %d failed (see stderr)", size);
    assert_int_equal(lp_count_segments(pids[0]), 0);
  }
}

/* Two processes, 300 allreduces in a row of sizes through every path of
 * the two-process staged allreduce: one chunk (whose place in the staging
 * area moves op by op and wraps around many times), several chunks, and
 * slots in between; each op's every element checked against its closed
 * form (all values exact in float32). */
static int pair_rounds_rank(int rank, int size, void *arg) {
  (void)arg;
  ddp_store *store = NULL;
  ddp__backend *b = lp_child_backend(&lp_the_server, "pairrounds/", rank, size, &store);
  const size_t counts[] = {3 * 1024 + 1, 16 * 1024, 75 * 1024 + 3, 256 * 1024,
                           640 * 1024 + 5, 1000, 2 * 1024 * 1024 + 16};
  size_t max = 2 * 1024 * 1024 + 16;
  float *buf = ddp_alloc(max * sizeof *buf);
  if (!buf) return 5;
  atomic_bool ab;
  atomic_init(&ab, false);
  int bad = 0;
  for (int round = 0; round < 300 && !bad; round++) {
    size_t count = counts[(size_t)round % (sizeof counts / sizeof counts[0])];
    for (size_t i = 0; i < count; i++) buf[i] = (float)(rank * 1000 + round + (int)(i % 97));
    ddp__op_ctx ctx = lt_ctx("allreduce", (uint64_t)round + 1, &ab, 30.0);
    ddp_status st = b->ops->blocking->allreduce(b, &ctx, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM);
    if (st != DDP_OK) {
      fprintf(stderr, "rank %d round %d: %s\n", rank, round, ddp_last_error());
      bad = 1;
    }
    for (size_t i = 0; !bad && i < count; i++) {
      float want = (float)(1000 + 2 * round + 2 * (int)(i % 97));
      if (buf[i] != want) {
        fprintf(stderr, "rank %d round %d (count %zu): [%zu] = %g, want %g\n", rank, round, count,
                i, buf[i], want);
        bad = 1;
      }
    }
  }
  ddp_free(buf);
  b->ops->destroy(b);
  ddp_store_destroy(store);
  return bad;
}

static void test_matrix_pair_rounds(void **state) {
  (void)state;
  pid_t pids[2];
  lp_spawn(2, 120, pair_rounds_rank, NULL, pids);
  if (lp_reap(2, pids) != 0) fail_msg("pair rounds failed (see stderr)");
  assert_int_equal(lp_count_segments(pids[0]), 0);
}

/* Without cross-memory attach (Yama ptrace_scope, seccomp): collectives
 * never needed it; large point-to-point messages go in pieces. */
static void test_matrix_without_cma(void **state) {
  (void)state;
  pid_t pids[8];
  int sizes[] = {2, 3, 5};
  for (int s = 0; s < 3; s++) {
    lp_spawn(sizes[s], 60, matrix_rank, "no-cma", pids);
    if (lp_reap(sizes[s], pids) != 0) fail_msg("world %d failed (see stderr)", sizes[s]);
    assert_int_equal(lp_count_segments(pids[0]), 0);
  }
}

/* Mixed: 2 processes x 2 threads = 4 ranks (transport "threads" inside a
 * process, "shm" between them). */
typedef struct mixed_thread {
  pthread_t thread;
  int rank;
  lt_matrix m;
} mixed_thread;

static void *mixed_main(void *arg) {
  mixed_thread *t = arg;
  ddp_store *store = NULL;
  ddp__backend *b = lp_backend(&lp_the_server, "mixed/", t->rank, 4, 2, &store);
  const char *want[4] = {"threads", "threads", "shm", "shm"};
  int peer = t->rank ^ 1, far = (t->rank + 2) % 4;
  if (strcmp(b->ops->transport(b, peer), want[0]) != 0 ||
      strcmp(b->ops->transport(b, far), want[2]) != 0) {
    t->m.failures++;
    snprintf(t->m.err, sizeof t->m.err, "rank %d: transports %s, %s", t->rank,
             b->ops->transport(b, peer), b->ops->transport(b, far));
  }
  t->m.rank = t->rank;
  t->m.size = 4;
  t->m.b = b;
  atomic_init(&t->m.aborted, false);
  size_t counts[3] = {0, 1, 31};
  t->m.counts = counts;
  t->m.num_counts = 3;
  lt_run_matrix(&t->m);
  for (size_t d = 0; d < LT_NUM_DTYPES && !t->m.failures; d++)
    lt_run_case(&t->m, lt_dtypes[d], (1u << 18) / ddp_dtype_size(lt_dtypes[d]) + 3, (int)d);
  b->ops->destroy(b);
  ddp_store_destroy(store);
  return NULL;
}

static int mixed_process(int proc, int nproc, void *arg) {
  mixed_thread t[2];
  memset(t, 0, sizeof t);
  for (int i = 0; i < 2; i++) {
    t[i].rank = proc * 2 + i;
    pthread_create(&t[i].thread, NULL, mixed_main, &t[i]);
  }
  int bad = 0;
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i].thread, NULL);
    if (t[i].m.failures) {
      fprintf(stderr, "%s\n", t[i].m.err);
      bad = 1;
    }
  }
  return bad;
}

static void test_mixed_threads_and_processes(void **state) {
  (void)state;
  pid_t pids[2];
  lp_spawn(2, 60, mixed_process, NULL, pids);
  if (lp_reap(2, pids) != 0) fail_msg("mixed world failed (see stderr)");
  assert_int_equal(lp_count_segments(pids[0]), 0);
}

/* Kill test: ranks loop allreduces of `count` floats; the parent kills the
 * last rank; the others must fail with DDP_ERR_PEER naming it. Exit codes:
 * 0 right error, 2 wrong error, 3 no error. */
static size_t kill_count;
static int kill_rank(int rank, int size, void *arg) {
  char prefix[32];
  snprintf(prefix, sizeof prefix, "kill%zu/", kill_count);
  ddp_store *store = NULL;
  ddp__backend *b = lp_child_backend(&lp_the_server, prefix, rank, size, &store);
  float *buf = ddp_calloc(kill_count, sizeof *buf);
  atomic_bool ab;
  atomic_init(&ab, false);
  char victim[32];
  snprintf(victim, sizeof victim, "rank %d (local) died", size - 1);
  int64_t stop = ddp_time_ns() + 20 * 1000000000LL;
  for (uint64_t k = 1; ddp_time_ns() < stop; k++) {
    ddp__op_ctx ctx = lt_ctx("allreduce", k, &ab, 60.0);
    ddp_status st = b->ops->blocking->allreduce(b, &ctx, buf, kill_count, DDP_FLOAT32, DDP_REDUCE_SUM);
    if (st == DDP_OK) {
      if (k == 1) lp_ready_signal();
      continue;
    }
    int code = st == DDP_ERR_PEER && strstr(ddp_last_error(), victim) ? 0 : 2;
    if (code) fprintf(stderr, "rank %d: %s: %s\n", rank, ddp_status_name(st), ddp_last_error());
    /* Sticky: the next op fails too. */
    ctx = lt_ctx("barrier", k + 1, &ab, 60.0);
    if (b->ops->blocking->barrier(b, &ctx) == DDP_OK) code = 4;
    b->ops->destroy(b);
    ddp_store_destroy(store);
    ddp_free(buf);
    return code;
  }
  return 3;
}

static void run_kill(size_t count, int size) {
  kill_count = count;
  pid_t pids[8];
  lp_ready_open();
  lp_spawn(size, 60, kill_rank, NULL, pids);
  /* Every rank has completed an allreduce; then let them loop a while. */
  if (lp_ready_wait(size) != 0) fprintf(stderr, "ranks did not all start\n");
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  kill(pids[size - 1], SIGKILL);
  int64_t killed_at = ddp_time_ns();
  double slowest;
  int bad = lp_reap_after_kill(pids, size, size - 1, killed_at, &slowest);
  printf("kill (count %zu, %d ranks): every rank failed within %.3f s\n", count, size, slowest);
  assert_int_equal(bad, 0);
  assert_true(slowest < 5.0);
  assert_int_equal(lp_count_segments(pids[0]), 0);
}

static void test_kill_small(void **state) {
  (void)state;
  run_kill(2, 4);
}

static void test_kill_large(void **state) {
  (void)state;
  run_kill(1 << 18, 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matrix),
      cmocka_unit_test(test_matrix_without_cma),
      cmocka_unit_test(test_matrix_pair_rounds),
      cmocka_unit_test(test_mixed_threads_and_processes),
      cmocka_unit_test(test_kill_small),
      cmocka_unit_test(test_kill_large),
  };
  /* DDP_TEST_FILTER / DDP_TEST_SKIP: run only the tests matching, or skip
   * those matching, a cmocka pattern (* and ?); the ThreadSanitizer subset
   * runs part of this program that way (tests/comm/CMakeLists.txt). */
  if (getenv("DDP_TEST_FILTER")) cmocka_set_test_filter(getenv("DDP_TEST_FILTER"));
  if (getenv("DDP_TEST_SKIP")) cmocka_set_skip_filter(getenv("DDP_TEST_SKIP"));
  return cmocka_run_group_tests(tests, lp_group_setup, lp_group_teardown);
}
