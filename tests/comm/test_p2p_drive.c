/* Who drives the point-to-point lane (src/comm/p2p_lane.c): a caller that
 * waits for its batch drives the lane itself while nobody else does; the
 * lane thread drives only batches nobody waits for. Ranks are threads of
 * this process, over the local backend ("threads") and over tcp (loopback),
 * 2 ranks:
 *   (a) two threads of each rank use one group at once: one exchanges with
 *       blocking send/recv, the other with batches it waits for, so the
 *       role of driver passes between them (and a waiter's batch is often
 *       finished by the other thread's driving); every element is checked
 *       against a closed form of (thread, iteration, index);
 *   (b) an isend nobody waits for completes in the background: rank 0
 *       posts 8 MiB and stays away from the group until rank 1 (blocking
 *       recv) has it and the handle reads complete (ddp_work_test only);
 *       over tcp the message is far above the sockets' buffers, so only
 *       the lane thread can have moved it;
 *   (c) a caller driving a receive that never comes sees the group's abort
 *       (from another thread) within 5 s, and
 *   (d) its deadline: with a 2 s group timeout, the receive fails with
 *       DDP_ERR_TIMEOUT naming the receive, the peer and the tag, within
 *       the timeout plus 5 s.
 * A peer process that dies while the caller drives: test_p2p_batch's
 * dead-peer tests (their waits drive the lane). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "ddp/ddp.h"

#define ITERS 200
#define BIG ((size_t)8 << 20)

typedef struct shared {
  ddp_store *store;
  const char *transport; /* NULL: local ("threads"), "tcp" */
  double timeout_s;
  atomic_int flag;       /* (b): rank 1 has the message; (c): abort issued */
  ddp_process_group *pg[2];
  pthread_barrier_t ready;
} shared;

typedef struct rank_arg {
  shared *sh;
  int rank;
  int (*body)(struct rank_arg *a, ddp_process_group *pg);
  char err[1024];
} rank_arg;

static int failf(rank_arg *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int failf(rank_arg *a, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int len = snprintf(a->err, sizeof a->err, "rank %d: ", a->rank);
  vsnprintf(a->err + len, sizeof a->err - (size_t)len, fmt, ap);
  va_end(ap);
  return -1;
}

#define TRY(a, call)                                                                 \
  do {                                                                               \
    ddp_status st_ = (call);                                                         \
    if (st_ != DDP_OK) return failf(a, "%s: %s", #call, ddp_last_error());          \
  } while (0)

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Element i of the message of (thread t, iteration k, direction d). */
static int32_t value(int t, int k, int d, size_t i) {
  return (int32_t)((uint32_t)t * 1000003u + (uint32_t)k * 7919u + (uint32_t)d * 104729u +
                   (uint32_t)i * 31u);
}

static int check(rank_arg *a, const int32_t *b, size_t n, int t, int k, int d) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != value(t, k, d, i))
      return failf(a, "thread %d, iteration %d, %zu elements: element %zu is %d, expected %d", t, k,
                   n, i, (int)b[i], (int)value(t, k, d, i));
  return 0;
}

/* ---- (a) two threads per rank on one group -------------------------------------- */

typedef struct worker {
  rank_arg *a;
  ddp_process_group *pg;
  int t;       /* 0: blocking send/recv, 1: batches waited for */
  char err[1024];
} worker;

static void *worker_main(void *p) {
  worker *w = p;
  rank_arg a = {.sh = w->a->sh, .rank = w->a->rank};
  int peer = 1 - a.rank;
  /* Sizes below and above the local backend's inline limit (4 KiB). */
  static const size_t counts[] = {1, 1000, 64 << 10};
  int32_t *out = malloc((64 << 10) * sizeof *out), *in = malloc((64 << 10) * sizeof *in);
  int rc = 0;
  if (!out || !in) rc = failf(&a, "out of memory");
  for (int k = 0; k < ITERS && rc == 0; k++) {
    size_t n = counts[k % 3];
    for (size_t i = 0; i < n; i++) out[i] = value(w->t, k, a.rank, i);
    int tag_out = 2 * w->t + a.rank, tag_in = 2 * w->t + peer;
    if (w->t == 0) {
      /* Rank 0 sends first, rank 1 receives first: a ping-pong. */
      for (int step = 0; step < 2 && rc == 0; step++) {
        ddp_status st = (step == 0) == (a.rank == 0)
                            ? ddp_send(w->pg, out, n, DDP_INT32, peer, tag_out)
                            : ddp_recv(w->pg, in, n, DDP_INT32, peer, tag_in);
        if (st != DDP_OK) rc = failf(&a, "blocking step %d of iteration %d: %s", step, k, ddp_last_error());
      }
    } else {
      ddp_p2p_op ops[2] = {{DDP_P2P_RECV, in, n, DDP_INT32, peer, tag_in},
                           {DDP_P2P_SEND, out, n, DDP_INT32, peer, tag_out}};
      ddp_work *h = NULL;
      if (ddp_batch_isend_irecv(w->pg, ops, 2, &h) != DDP_OK || ddp_work_wait(h, -1) != DDP_OK)
        rc = failf(&a, "batch of iteration %d: %s", k, ddp_last_error());
      ddp_work_free(h);
    }
    if (rc == 0) rc = check(&a, in, n, w->t, k, peer);
  }
  free(out);
  free(in);
  if (rc) snprintf(w->err, sizeof w->err, "%s", a.err);
  return NULL;
}

static int body_two_threads(rank_arg *a, ddp_process_group *pg) {
  worker w[2];
  pthread_t th[2];
  for (int t = 0; t < 2; t++) {
    w[t] = (worker){.a = a, .pg = pg, .t = t};
    pthread_create(&th[t], NULL, worker_main, &w[t]);
  }
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 2; t++)
    if (w[t].err[0]) return failf(a, "%s", w[t].err);
  return 0;
}

/* ---- (b) an isend nobody waits for ---------------------------------------------- */

static int body_background(rank_arg *a, ddp_process_group *pg) {
  size_t n = BIG / sizeof(int32_t);
  int32_t *buf = malloc(BIG);
  if (!buf) return failf(a, "out of memory");
  int rc = 0;
  if (a->rank == 0) {
    for (size_t i = 0; i < n; i++) buf[i] = value(9, 0, 0, i);
    ddp_work *h = NULL;
    if (ddp_isend(pg, buf, n, DDP_INT32, 1, 3, &h) != DDP_OK) {
      rc = failf(a, "isend: %s", ddp_last_error());
    } else {
      /* Nothing of this thread drives the lane from here on: the handle
       * completes only if the lane thread moves the send. */
      int64_t until = ddp_time_ns() + 20 * 1000000000LL;
      ddp_status st = DDP_OK;
      bool done = false;
      while (!(done = ddp_work_test(h, &st)) && ddp_time_ns() < until) sleep_ms(1);
      if (!done)
        rc = failf(a, "the isend nobody waits for did not complete in 20 s (rank 1 %s it)",
                   atomic_load(&a->sh->flag) ? "received" : "did not receive");
      else if (st != DDP_OK)
        rc = failf(a, "the isend failed: %s", ddp_last_error());
      /* Complete means received: rank 1's receive has returned by now, or
       * does so at once. */
      until = ddp_time_ns() + 20 * 1000000000LL;
      while (rc == 0 && !atomic_load(&a->sh->flag) && ddp_time_ns() < until) sleep_ms(1);
      if (rc == 0 && !atomic_load(&a->sh->flag)) rc = failf(a, "rank 1 did not receive in 20 s");
      ddp_work_free(h);
    }
  } else {
    if (ddp_recv(pg, buf, n, DDP_INT32, 0, 3) != DDP_OK)
      rc = failf(a, "recv: %s", ddp_last_error());
    else
      rc = check(a, buf, n, 9, 0, 0);
    atomic_store(&a->sh->flag, 1);
  }
  free(buf);
  return rc;
}

/* ---- (c) abort and (d) deadline while a caller drives ---------------------------- */

static void *aborter(void *p) {
  shared *sh = p;
  sleep_ms(100);
  atomic_store(&sh->flag, 1);
  ddp_process_group_abort(sh->pg[0]);
  return NULL;
}

/* Rank 0 receives what rank 1 never sends; rank 1 waits (off the group)
 * until rank 0 is done. abort: another thread aborts rank 0's group. */
static int body_unmatched(rank_arg *a, ddp_process_group *pg, bool abort) {
  if (a->rank == 1) {
    int64_t until = ddp_time_ns() + 30 * 1000000000LL;
    while (atomic_load(&a->sh->flag) < 2 && ddp_time_ns() < until) sleep_ms(1);
    return 0;
  }
  a->sh->pg[0] = pg;
  pthread_t t;
  if (abort) pthread_create(&t, NULL, aborter, a->sh);
  int32_t x[4];
  int64_t t0 = ddp_time_ns();
  ddp_status st = ddp_recv(pg, x, 4, DDP_INT32, 1, 11);
  double took = (double)(ddp_time_ns() - t0) / 1e9;
  const char *msg = ddp_last_error();
  int rc = 0;
  if (abort) {
    pthread_join(t, NULL);
    if (st != DDP_ERR_ABORTED) rc = failf(a, "aborted recv returned %s: %s", ddp_status_name(st), msg);
    else if (took > 5.0) rc = failf(a, "the aborted recv returned after %.3f s (at most 5)", took);
  } else {
    if (st != DDP_ERR_TIMEOUT || !strstr(msg, "recv from rank 1 (tag 11"))
      rc = failf(a, "unmatched recv returned %s: %s", ddp_status_name(st), msg);
    else if (took < a->sh->timeout_s * 0.9 || took > a->sh->timeout_s + 5.0)
      rc = failf(a, "the unmatched recv timed out after %.3f s (timeout %.3g s)", took,
                 a->sh->timeout_s);
  }
  fprintf(stderr, "%s, %s: rank 0's recv returned after %.3f s: %s: %s\n",
          a->sh->transport ? a->sh->transport : "threads", abort ? "abort" : "deadline", took,
          ddp_status_name(st), msg);
  atomic_store(&a->sh->flag, 2);
  return rc;
}

static int body_abort(rank_arg *a, ddp_process_group *pg) { return body_unmatched(a, pg, true); }
static int body_deadline(rank_arg *a, ddp_process_group *pg) { return body_unmatched(a, pg, false); }

/* ---- Ranks as threads ------------------------------------------------------------ */

static void *rank_main(void *p) {
  rank_arg *a = p;
  ddp_process_group_options o = {.timeout_s = a->sh->timeout_s, .transport = a->sh->transport};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(a->sh->store, a->rank, 2, &o, &pg) != DDP_OK) {
    failf(a, "create: %s", ddp_last_error());
    return NULL;
  }
  const char *want = a->sh->transport ? a->sh->transport : "threads";
  const char *t = ddp_process_group_transport(pg, 1 - a->rank);
  if (strcmp(t, want) != 0)
    failf(a, "transport %s, expected %s", t, want);
  else
    a->body(a, pg);
  ddp_process_group_destroy(pg);
  return NULL;
}

static void run(const char *transport, double timeout_s,
                int (*body)(rank_arg *a, ddp_process_group *pg)) {
  shared sh = {.transport = transport, .timeout_s = timeout_s};
  ddp_store_options so = {.timeout_ms = 60000};
  assert_int_equal(ddp_store_mem_create(&so, &sh.store), DDP_OK);
  rank_arg a[2];
  pthread_t t[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (rank_arg){.sh = &sh, .rank = r, .body = body};
    pthread_create(&t[r], NULL, rank_main, &a[r]);
  }
  int bad = 0;
  for (int r = 0; r < 2; r++) {
    pthread_join(t[r], NULL);
    if (a[r].err[0]) {
      fprintf(stderr, "%s: %s\n", transport ? transport : "threads", a[r].err);
      bad++;
    }
  }
  ddp_store_destroy(sh.store);
  if (bad) fail_msg("%s: %d ranks failed (see stderr)", transport ? transport : "threads", bad);
}

static void test_two_threads_local(void **s) { (void)s; run(NULL, 60, body_two_threads); }
static void test_two_threads_tcp(void **s) { (void)s; run("tcp", 60, body_two_threads); }
static void test_background_local(void **s) { (void)s; run(NULL, 60, body_background); }
static void test_background_tcp(void **s) { (void)s; run("tcp", 60, body_background); }
static void test_abort_local(void **s) { (void)s; run(NULL, 60, body_abort); }
static void test_abort_tcp(void **s) { (void)s; run("tcp", 60, body_abort); }
static void test_deadline_local(void **s) { (void)s; run(NULL, 2, body_deadline); }
static void test_deadline_tcp(void **s) { (void)s; run("tcp", 2, body_deadline); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_threads_local), cmocka_unit_test(test_two_threads_tcp),
      cmocka_unit_test(test_background_local),  cmocka_unit_test(test_background_tcp),
      cmocka_unit_test(test_abort_local),       cmocka_unit_test(test_abort_tcp),
      cmocka_unit_test(test_deadline_local),    cmocka_unit_test(test_deadline_tcp),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
