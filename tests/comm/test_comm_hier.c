/* Groups spanning several "hosts" with co-located ranks (the hierarchical
 * backend): rank processes with DDP_HOST_ID set per process, so one machine
 * holds 2 hosts x 2 ranks, or 3 hosts of 1 + 2 + 2 ranks (interleaved:
 * ranks 1 and 3 share a host, 2 and 4 another). Each layout:
 *   - transports per pair: "shm" between ranks of one host, "tcp" between hosts;
 *   - every op (the matrix body of test_comm_matrix) x float32, int32,
 *     bfloat16 x counts 0, 1, odd, 1 MiB against closed forms;
 *   - the counters: a 1 MiB allreduce moves no TCP byte on a rank that is not
 *     its host's leader (only shared memory), while leaders move about the
 *     ring's share over TCP; a send to a co-located rank moves no TCP byte, one
 *     to another host no shared-memory byte;
 *   - SIGKILL of a leader or a non-leader during a loop of allreduces: every
 *     other rank, on every host, fails within 5 s naming it. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>

#include "comm/comm_matrix_body.h"
#include "comm/local_proc_util.h"

typedef struct layout {
  const char *name;
  int size;
  int host[8]; /* host of each rank */
} layout;

static const layout two_by_two = {"2x2", 4, {0, 0, 1, 1}};
static const layout unequal = {"1+2+2", 5, {0, 1, 2, 1, 2}};

/* In a child: its host, then a group through the public API. */
static ddp_process_group *hier_group(const layout *l, int rank, const char *prefix,
                                     ddp_store **store_out) {
  char host[32];
  snprintf(host, sizeof host, "testhost%d", l->host[rank]);
  setenv("DDP_HOST_ID", host, 1);
  ddp_store_options o = {.timeout_ms = 30000};
  ddp_store *base = NULL, *store = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", lp_the_server.port, &o, &base) != DDP_OK ||
      ddp_store_prefix(base, prefix, &store) != DDP_OK) {
    fprintf(stderr, "rank %d: store: %s\n", rank, ddp_last_error());
    _exit(10);
  }
  ddp_store_destroy(base);
  ddp_process_group_options opt = {.timeout_s = 60};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(store, rank, l->size, &opt, &pg) != DDP_OK) {
    fprintf(stderr, "rank %d: create: %s\n", rank, ddp_last_error());
    _exit(11);
  }
  *store_out = store;
  return pg;
}

static bool is_leader(const layout *l, int rank) {
  for (int q = 0; q < rank; q++)
    if (l->host[q] == l->host[rank]) return false;
  return true;
}

static int host_count(const layout *l) {
  int n = 0;
  for (int r = 0; r < l->size; r++) n += is_leader(l, r);
  return n;
}

#define FAIL_IF(cond, ...)                              \
  do {                                                  \
    if (cond) {                                         \
      fprintf(stderr, "rank %d: ", rank);               \
      fprintf(stderr, __VA_ARGS__);                     \
      fprintf(stderr, "\n");                            \
      return 1;                                         \
    }                                                   \
  } while (0)

static ddp_comm_counters counters(ddp_process_group *pg) {
  ddp_comm_counters c;
  ddp_process_group_counters(pg, &c);
  return c;
}

/* Which transport carried which bytes. */
static int check_counters(const layout *l, int rank, ddp_process_group *pg) {
  const size_t n = (1u << 20) / sizeof(float);
  float *buf = calloc(n, sizeof *buf);
  for (size_t i = 0; i < n; i++) buf[i] = (float)(rank + 1);
  ddp_comm_counters c0 = counters(pg);
  FAIL_IF(ddp_allreduce(pg, buf, n, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK, "allreduce: %s",
          ddp_last_error());
  ddp_comm_counters c1 = counters(pg);
  float want = (float)(l->size * (l->size + 1) / 2);
  FAIL_IF(buf[0] != want || buf[n - 1] != want, "allreduce = %g, want %g", buf[0], want);
  uint64_t tcp = c1.tcp_bytes_sent - c0.tcp_bytes_sent;
  uint64_t tcp_in = c1.tcp_bytes_received - c0.tcp_bytes_received;
  uint64_t shm = c1.shm_bytes - c0.shm_bytes;
  uint64_t bytes = n * sizeof(float);
  int hosts = host_count(l);
  bool alone = true;
  for (int q = 0; q < l->size; q++) alone = alone && (q == rank || l->host[q] != l->host[rank]);
  printf("%s rank %d (%s): 1 MiB allreduce: tcp %llu sent, %llu received; shm %llu\n", l->name,
         rank, is_leader(l, rank) ? "leader" : "not leader", (unsigned long long)tcp,
         (unsigned long long)tcp_in, (unsigned long long)shm);
  fflush(stdout);
  if (is_leader(l, rank)) {
    /* A ring among the leaders sends 2 (H-1)/H of the data, plus frame headers. */
    uint64_t ring = 2 * bytes * (uint64_t)(hosts - 1) / (uint64_t)hosts;
    FAIL_IF(tcp < ring || tcp > ring + 64 * 1024, "leader sent %llu TCP bytes, want about %llu",
            (unsigned long long)tcp, (unsigned long long)ring);
  } else {
    FAIL_IF(tcp != 0 || tcp_in != 0, "not a leader, yet %llu TCP bytes sent, %llu received",
            (unsigned long long)tcp, (unsigned long long)tcp_in);
  }
  FAIL_IF(alone ? shm != 0 : shm < 2 * bytes, "%llu shm bytes (alone on its host: %d)",
          (unsigned long long)shm, alone);

  /* Point to point: rank 1 sends 100 KiB to its host mate, then to the
   * first rank of another host. */
  const size_t m = 100 * 1024, mf = m / sizeof(float);
  int mate = -1, far = -1;
  for (int q = 0; q < l->size; q++) {
    if (q != 1 && l->host[q] == l->host[1]) mate = q;
    if (far < 0 && l->host[q] != l->host[1]) far = q;
  }
  c0 = counters(pg);
  if (rank == 1) {
    FAIL_IF(ddp_send(pg, buf, mf, DDP_FLOAT32, mate, 7) != DDP_OK, "send: %s", ddp_last_error());
    c1 = counters(pg);
    FAIL_IF(c1.tcp_bytes_sent != c0.tcp_bytes_sent || c1.shm_bytes - c0.shm_bytes != m,
            "send to the host mate: tcp %llu, shm %llu more bytes",
            (unsigned long long)(c1.tcp_bytes_sent - c0.tcp_bytes_sent),
            (unsigned long long)(c1.shm_bytes - c0.shm_bytes));
    FAIL_IF(ddp_send(pg, buf, mf, DDP_FLOAT32, far, 7) != DDP_OK, "send: %s", ddp_last_error());
    ddp_comm_counters c2 = counters(pg);
    FAIL_IF(c2.shm_bytes != c1.shm_bytes || c2.tcp_bytes_sent - c1.tcp_bytes_sent < m,
            "send to another host: tcp %llu, shm %llu more bytes",
            (unsigned long long)(c2.tcp_bytes_sent - c1.tcp_bytes_sent),
            (unsigned long long)(c2.shm_bytes - c1.shm_bytes));
  } else if (rank == mate || rank == far) {
    float *got = calloc(mf, sizeof *got);
    FAIL_IF(ddp_recv(pg, got, mf, DDP_FLOAT32, 1, 7) != DDP_OK, "recv: %s", ddp_last_error());
    FAIL_IF(memcmp(got, buf, m) != 0, "recv from rank 1: wrong bytes");
    free(got);
  }
  free(buf);
  return 0;
}

static int matrix_rank(int rank, int size, void *arg) {
  (void)size;
  const layout *l = arg;
  char prefix[48];
  snprintf(prefix, sizeof prefix, "hier-matrix-%s/", l->name);
  ddp_store *store = NULL;
  ddp_process_group *pg = hier_group(l, rank, prefix, &store);
  for (int q = 0; q < l->size; q++) {
    const char *want = q == rank ? "self" : l->host[q] == l->host[rank] ? "shm" : "tcp";
    const char *got = ddp_process_group_transport(pg, q);
    FAIL_IF(strcmp(got, want) != 0, "transport to rank %d is %s, want %s", q, got, want);
  }
  int bad = check_counters(l, rank, pg);
  ct_world *w = calloc(1, sizeof *w);
  w->size = l->size;
  pthread_mutex_init(&w->mu, NULL);
  ct_rank self = {.world = w, .rank = rank, .pg = pg};
  char *a = malloc(MIB + 4096), *b = malloc(MIB + 4096);
  const ddp_dtype dtypes[] = {DDP_FLOAT32, DDP_INT32, DDP_BFLOAT16};
  for (size_t d = 0; d < 3 && !bad && !atomic_load(&w->failures); d++)
    ct_matrix_dtype(&self, dtypes[d], a, b);
  if (atomic_load(&w->failures)) {
    fprintf(stderr, "%s: %s\n", l->name, w->first_failure);
    bad = 1;
  }
  free(a);
  free(b);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  free(w);
  return bad;
}

static void run_matrix(const layout *l) {
  pid_t pids[8];
  lp_spawn(l->size, 120, matrix_rank, (void *)l, pids);
  if (lp_reap(l->size, pids) != 0) fail_msg("layout %s failed (see stderr)", l->name);
  for (int r = 0; r < l->size; r++) assert_int_equal(lp_count_segments(pids[r]), 0);
}

static void test_matrix_2x2(void **state) {
  (void)state;
  run_matrix(&two_by_two);
}

static void test_matrix_unequal(void **state) {
  (void)state;
  run_matrix(&unequal);
}

/* Kill test: ranks loop allreduces; the parent kills `victim`; every other
 * rank must fail with DDP_ERR_PEER naming it. Exit codes: 0 right error,
 * 2 wrong error, 3 no error, 4 not sticky. */
typedef struct kill_case {
  const layout *l;
  int victim;
  size_t count;
} kill_case;

static int kill_rank(int rank, int size, void *arg) {
  (void)size;
  const kill_case *k = arg;
  char prefix[64];
  snprintf(prefix, sizeof prefix, "hier-kill-%s-%d-%zu/", k->l->name, k->victim, k->count);
  ddp_store *store = NULL;
  ddp_process_group *pg = hier_group(k->l, rank, prefix, &store);
  float *buf = calloc(k->count, sizeof *buf);
  char victim[32];
  snprintf(victim, sizeof victim, "rank %d (testhost%d", k->victim, k->l->host[k->victim]);
  int64_t stop = ddp_time_ns() + 20 * 1000000000LL;
  for (uint64_t i = 1; ddp_time_ns() < stop; i++) {
    ddp_status st = ddp_allreduce(pg, buf, k->count, DDP_FLOAT32, DDP_REDUCE_SUM);
    if (st == DDP_OK) {
      if (i == 1) lp_ready_signal();
      continue;
    }
    int code = st == DDP_ERR_PEER && strstr(ddp_last_error(), victim) ? 0 : 2;
    fprintf(stderr, "rank %d: %s: %s\n", rank, ddp_status_name(st), ddp_last_error());
    if (ddp_barrier(pg) == DDP_OK) code = 4;
    ddp_process_group_destroy(pg);
    ddp_store_destroy(store);
    free(buf);
    return code;
  }
  return 3;
}

static void run_kill(const layout *l, int victim, size_t count) {
  kill_case k = {l, victim, count};
  pid_t pids[8];
  lp_ready_open();
  lp_spawn(l->size, 60, kill_rank, &k, pids);
  if (lp_ready_wait(l->size) != 0) fprintf(stderr, "ranks did not all start\n");
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  kill(pids[victim], SIGKILL);
  int64_t killed_at = ddp_time_ns();
  double slowest;
  int bad = lp_reap_after_kill(pids, l->size, victim, killed_at, &slowest);
  printf("kill rank %d of %s (count %zu): every rank failed within %.3f s\n", victim, l->name,
         count, slowest);
  assert_int_equal(bad, 0);
  assert_true(slowest < 5.0);
  for (int r = 0; r < l->size; r++) assert_int_equal(lp_count_segments(pids[r]), 0);
}

/* A rank that is not its host's leader (its death reaches the other host
 * through its leader), and a leader, with small and pipelined sizes. */
static void test_kill_non_leader(void **state) {
  (void)state;
  run_kill(&two_by_two, 3, 2);
}

static void test_kill_leader(void **state) {
  (void)state;
  run_kill(&unequal, 2, 1 << 18);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matrix_2x2),
      cmocka_unit_test(test_matrix_unequal),
      cmocka_unit_test(test_kill_non_leader),
      cmocka_unit_test(test_kill_leader),
  };
  return cmocka_run_group_tests(tests, lp_group_setup, lp_group_teardown);
}
