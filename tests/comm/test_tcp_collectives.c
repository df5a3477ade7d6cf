/* The tcp backend through its constructor, with real rank processes meeting
 * in a store server on loopback: every op x dtype x count at world sizes 1
 * to 8, against closed forms (tests/comm/local_test_util.h, shared with the
 * local backend's tests). Counts: 0, 1, 1003 and 5003 (divisible by no
 * world size here; allreduce takes recursive doubling and halving-doubling)
 * and about 1 MiB (the ring). Then 64 MiB float32 allreduce, broadcast and
 * allgather at 2, 3 and 8 ranks, and point-to-point messages interleaved
 * with collectives. */
#include "comm/local_test_util.h"
#include "comm/tcp_test_util.h"

/* ---- The matrix ------------------------------------------------------------ */

/* 1003: recursive doubling; 5003: halving-doubling; the last: the ring. */
static const size_t matrix_counts[] = {0, 1, 1003, 5003, (1u << 20) / 8 + 3};

static void matrix_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  lt_matrix m = {.rank = rank, .size = size, .counts = matrix_counts,
                 .num_counts = sizeof matrix_counts / sizeof matrix_counts[0], .b = b};
  atomic_init(&m.aborted, false);
  lt_run_matrix(&m);
  res->failures = m.failures;
  snprintf(res->msg, sizeof res->msg, "%s", m.err);
}

static void run_matrix(int size) {
  tt_world w;
  tt_run(&w, size, matrix_rank, NULL, 100);
  tt_release(&w);
}

static void test_matrix_1(void **state) { run_matrix(1); }
static void test_matrix_2(void **state) { run_matrix(2); }
static void test_matrix_3(void **state) { run_matrix(3); }
static void test_matrix_4(void **state) { run_matrix(4); }
static void test_matrix_5(void **state) { run_matrix(5); }
static void test_matrix_6(void **state) { run_matrix(6); }
static void test_matrix_7(void **state) { run_matrix(7); }
static void test_matrix_8(void **state) { run_matrix(8); }

/* ---- 64 MiB ---------------------------------------------------------------- */

#define BIG_FLOATS ((size_t)64 << 20 >> 2)

static void big_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  atomic_bool aborted;
  atomic_init(&aborted, false);
  float *buf = ddp_alloc(BIG_FLOATS * sizeof(float));
  float *send = ddp_alloc(BIG_FLOATS / (size_t)size * sizeof(float) + 64);
  const ddp__blocking_ops *o = b->ops->blocking;
  uint64_t seq = 0;
  /* allreduce SUM: element i of rank r is (r + 1) * (i % 13) */
  for (size_t i = 0; i < BIG_FLOATS; i++) buf[i] = (float)((rank + 1) * (int)(i % 13));
  ddp__op_ctx c = tt_ctx("allreduce", ++seq, &aborted, 60);
  ddp_status st = o->allreduce(b, &c, buf, BIG_FLOATS, DDP_FLOAT32, DDP_REDUCE_SUM);
  float k = (float)(size * (size + 1) / 2);
  for (size_t i = 0; st == DDP_OK && i < BIG_FLOATS; i++)
    if (buf[i] != k * (float)(i % 13)) {
      res->failures++;
      snprintf(res->msg, sizeof res->msg, "rank %d: 64 MiB allreduce: [%zu] = %g, expected %g",
               rank, i, buf[i], k * (float)(i % 13));
      break;
    }
  /* broadcast from the last rank */
  int root = size - 1;
  for (size_t i = 0; st == DDP_OK && i < BIG_FLOATS; i++)
    buf[i] = rank == root ? (float)(i % 1021) : -1.0f;
  c = tt_ctx("broadcast", ++seq, &aborted, 60);
  if (st == DDP_OK) st = o->broadcast(b, &c, buf, BIG_FLOATS, DDP_FLOAT32, root);
  for (size_t i = 0; st == DDP_OK && !res->failures && i < BIG_FLOATS; i++)
    if (buf[i] != (float)(i % 1021)) {
      res->failures++;
      snprintf(res->msg, sizeof res->msg, "rank %d: 64 MiB broadcast: [%zu] = %g", rank, i,
               buf[i]);
      break;
    }
  /* allgather: 64 MiB in all, rank r contributes r * 10000 + i % 9973 */
  size_t per = BIG_FLOATS / (size_t)size;
  for (size_t i = 0; i < per; i++) send[i] = (float)(rank * 10000 + (int)(i % 9973));
  c = tt_ctx("allgather", ++seq, &aborted, 60);
  if (st == DDP_OK) st = o->allgather(b, &c, send, buf, per, DDP_FLOAT32);
  for (size_t j = 0; st == DDP_OK && !res->failures && j < per * (size_t)size; j++) {
    float want = (float)((int)(j / per) * 10000 + (int)(j % per % 9973));
    if (buf[j] != want) {
      res->failures++;
      snprintf(res->msg, sizeof res->msg, "rank %d: 64 MiB allgather: [%zu] = %g, expected %g",
               rank, j, buf[j], want);
      break;
    }
  }
  if (st != DDP_OK) {
    res->failures++;
    snprintf(res->msg, sizeof res->msg, "rank %d: %s", rank, ddp_last_error());
  }
  ddp_free(buf);
  ddp_free(send);
}

static void run_big(int size) {
  tt_world w;
  tt_run(&w, size, big_rank, NULL, 100);
  tt_release(&w);
}

static void test_64mib_2(void **state) { run_big(2); }
static void test_64mib_3(void **state) { run_big(3); }
static void test_64mib_8(void **state) { run_big(8); }

/* ---- Point to point between collectives ------------------------------------
 * Rank 0 sends a 300 KiB message and then joins an allreduce; rank 1 runs the
 * allreduce first and receives after: the message waits in rank 1's queue
 * (a blocked sender would deadlock here). Then tags are taken out of order. */
static void p2p_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  atomic_bool aborted;
  atomic_init(&aborted, false);
  const ddp__blocking_ops *o = b->ops->blocking;
  size_t n = 300 * 1024;
  unsigned char *msg = ddp_alloc(n);
  int64_t v = rank + 1;
  ddp__op_ctx c;
  ddp_status st = DDP_OK;
  if (rank == 0) {
    for (size_t i = 0; i < n; i++) msg[i] = (unsigned char)(i * 7);
    c = tt_ctx("send", 1, &aborted, 20);
    c.tag = 5;
    st = o->send(b, &c, msg, n, 1);
    for (int t = 1; st == DDP_OK && t <= 3; t++) {
      int64_t x = 100 + t;
      c = tt_ctx("send", 1, &aborted, 20);
      c.tag = t;
      st = o->send(b, &c, &x, sizeof x, 1);
    }
  }
  c = tt_ctx("allreduce", 1, &aborted, 20);
  if (st == DDP_OK) st = o->allreduce(b, &c, &v, 1, DDP_INT64, DDP_REDUCE_SUM);
  if (st == DDP_OK && v != 3) {
    res->failures++;
    snprintf(res->msg, sizeof res->msg, "rank %d: allreduce gave %lld", rank, (long long)v);
  }
  if (rank == 1 && st == DDP_OK) {
    for (int t = 3; st == DDP_OK && t >= 1; t--) {
      int64_t x = 0;
      c = tt_ctx("recv", 2, &aborted, 20);
      c.tag = t;
      st = o->recv(b, &c, &x, sizeof x, 0);
      if (st == DDP_OK && x != 100 + t) {
        res->failures++;
        snprintf(res->msg, sizeof res->msg, "recv tag %d gave %lld", t, (long long)x);
      }
    }
    memset(msg, 0, n);
    c = tt_ctx("recv", 3, &aborted, 20);
    c.tag = 5;
    if (st == DDP_OK) st = o->recv(b, &c, msg, n, 0);
    for (size_t i = 0; st == DDP_OK && i < n; i++)
      if (msg[i] != (unsigned char)(i * 7)) {
        res->failures++;
        snprintf(res->msg, sizeof res->msg, "recv: byte %zu is %u", i, msg[i]);
        break;
      }
  }
  if (st != DDP_OK) {
    res->failures++;
    snprintf(res->msg, sizeof res->msg, "rank %d: %s", rank, ddp_last_error());
  }
  ddp_free(msg);
}

static void test_p2p_between_collectives(void **state) {
  tt_world w;
  tt_run(&w, 2, p2p_rank, NULL, 30);
  tt_release(&w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matrix_1),    cmocka_unit_test(test_matrix_2),
      cmocka_unit_test(test_matrix_3),    cmocka_unit_test(test_matrix_4),
      cmocka_unit_test(test_matrix_5),    cmocka_unit_test(test_matrix_6),
      cmocka_unit_test(test_matrix_7),    cmocka_unit_test(test_matrix_8),
      cmocka_unit_test(test_64mib_2),     cmocka_unit_test(test_64mib_3),
      cmocka_unit_test(test_64mib_8),     cmocka_unit_test(test_p2p_between_collectives),
  };
  return cmocka_run_group_tests(tests, tt_setup, tt_teardown);
}
