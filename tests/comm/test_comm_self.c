/* comm on a group of one (the self backend) and everything the group layer
 * decides on its own: every operation's result and its async form, argument
 * errors naming the call, async operations completing in submission order,
 * sticky errors after an abort, group creation timing out with the missing
 * ranks named, byte collectives. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "ddp/comm.h"

static ddp_process_group *make_self(ddp_store **store_out) {
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.timeout_s = 10};
  ddp_process_group *pg = NULL;
  ddp_status st = ddp_process_group_create(store, 0, 1, &o, &pg);
  if (st != DDP_OK) fail_msg("create: %s", ddp_last_error());
  if (store_out)
    *store_out = store;
  else
    ddp_store_destroy(store); /* the group holds its own reference */
  return pg;
}

static void expect_error(ddp_status st, ddp_status want, const char *substring) {
  if (st != want)
    fail_msg("status %s, want %s (%s)", ddp_status_name(st), ddp_status_name(want), ddp_last_error());
  if (!strstr(ddp_last_error(), substring))
    fail_msg("message \"%s\" does not contain \"%s\"", ddp_last_error(), substring);
}

/* options.backend and $DDP_BACKEND (docs/comm.md, "Backends"): the names a
 * group answers to, where an unknown name is reported from, and the
 * transport that belongs to ddp's own backend only. */
static void test_backend_names(void **state) {
  (void)state;
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  const char *ours[] = {NULL, "auto", "ddp", "gloo"};
  for (size_t i = 0; i < sizeof ours / sizeof *ours; i++) {
    ddp_process_group_options o = {.timeout_s = 10, .backend = ours[i]};
    ddp_process_group *pg = NULL;
    if (ddp_process_group_create(store, 0, 1, &o, &pg) != DDP_OK) fail_msg("%s", ddp_last_error());
    assert_string_equal(ddp_process_group_backend(pg), "ddp");
    ddp_process_group_destroy(pg);
  }
  ddp_process_group_options o = {.timeout_s = 10, .backend = "infiniband"};
  ddp_process_group *pg = NULL;
  expect_error(ddp_process_group_create(store, 0, 1, &o, &pg), DDP_ERR_INVALID,
               "options.backend \"infiniband\" is not a backend");
  assert_null(pg);
  setenv("DDP_BACKEND", "smoke-signals", 1);
  o.backend = NULL;
  expect_error(ddp_process_group_create(store, 0, 1, &o, &pg), DDP_ERR_INVALID,
               "DDP_BACKEND \"smoke-signals\" is not a backend");
  setenv("DDP_BACKEND", "gloo", 1);
  if (ddp_process_group_create(store, 0, 1, &o, &pg) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_string_equal(ddp_process_group_backend(pg), "ddp");
  ddp_process_group_destroy(pg);
  unsetenv("DDP_BACKEND");
  o = (ddp_process_group_options){.timeout_s = 10, .backend = "nccl", .transport = "tcp"};
  expect_error(ddp_process_group_create(store, 0, 1, &o, &pg), DDP_ERR_INVALID,
               "\"tcp\" is a transport of ddp's own backend");
  ddp_store_destroy(store);
}

static void test_self_group_ops(void **state) {
  ddp_process_group *pg = make_self(NULL);
  assert_int_equal(ddp_process_group_rank(pg), 0);
  assert_int_equal(ddp_process_group_size(pg), 1);
  assert_string_equal(ddp_process_group_transport(pg, 0), "self");
  float buf[5] = {1, 2, 3, 4, 5}, out[5] = {0};
  for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
    assert_int_equal(ddp_allreduce(pg, buf, 5, DDP_FLOAT32, (ddp_reduce_op)op), DDP_OK);
    assert_int_equal(ddp_reduce(pg, buf, 5, DDP_FLOAT32, (ddp_reduce_op)op, 0), DDP_OK);
  }
  float want[5] = {1, 2, 3, 4, 5};
  assert_memory_equal(buf, want, sizeof buf);
  assert_int_equal(ddp_broadcast(pg, buf, 5, DDP_FLOAT32, 0), DDP_OK);
  assert_int_equal(ddp_allgather(pg, buf, out, 5, DDP_FLOAT32), DDP_OK);
  assert_memory_equal(out, want, sizeof out);
  memset(out, 0, sizeof out);
  assert_int_equal(ddp_gather(pg, buf, out, 3, DDP_FLOAT32, 0), DDP_OK);
  assert_memory_equal(out, want, 3 * sizeof(float));
  memset(out, 0, sizeof out);
  assert_int_equal(ddp_scatter(pg, buf, out, 4, DDP_FLOAT32, 0), DDP_OK);
  assert_memory_equal(out, want, 4 * sizeof(float));
  memset(out, 0, sizeof out);
  assert_int_equal(ddp_reduce_scatter(pg, buf, out, 5, DDP_FLOAT32, DDP_REDUCE_AVG), DDP_OK);
  assert_memory_equal(out, want, sizeof out);
  memset(out, 0, sizeof out);
  assert_int_equal(ddp_all_to_all(pg, buf, out, 5, DDP_FLOAT32), DDP_OK);
  assert_memory_equal(out, want, sizeof out);
  assert_int_equal(ddp_barrier(pg), DDP_OK);
  assert_int_equal(ddp_monitored_barrier(pg, 1, true), DDP_OK);
  /* count 0 is fine, with NULL buffers */
  assert_int_equal(ddp_allreduce(pg, NULL, 0, DDP_INT64, DDP_REDUCE_SUM), DDP_OK);
  assert_int_equal(ddp_allgather(pg, NULL, NULL, 0, DDP_FLOAT16), DDP_OK);
  /* async forms */
  ddp_work *w[4];
  int64_t l[3] = {5, 6, 7}, lo[3] = {0};
  assert_int_equal(ddp_allreduce_async(pg, l, 3, DDP_INT64, DDP_REDUCE_PRODUCT, &w[0]), DDP_OK);
  assert_int_equal(ddp_allgather_async(pg, l, lo, 3, DDP_INT64, &w[1]), DDP_OK);
  assert_int_equal(ddp_barrier_async(pg, &w[2]), DDP_OK);
  assert_int_equal(ddp_broadcast_async(pg, l, 3, DDP_INT64, 0, &w[3]), DDP_OK);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(ddp_work_wait(w[i], 5), DDP_OK);
    ddp_status st = DDP_ERR_INTERNAL;
    assert_true(ddp_work_test(w[i], &st));
    assert_int_equal(st, DDP_OK);
    ddp_work_free(w[i]);
  }
  assert_memory_equal(lo, l, sizeof l);
  ddp_work_free(NULL);
  ddp_process_group_destroy(pg);
  ddp_process_group_destroy(NULL);
}

/* Each async allgather copies block k to block k+1; only submission order
 * carries the first value to the end. A blocking call queued behind them
 * (the queue is not empty) sees their results. */
static void test_async_submission_order(void **state) {
  ddp_process_group *pg = make_self(NULL);
  enum { N = 200 };
  static int32_t chain[N + 1][16];
  memset(chain, 0, sizeof chain);
  for (int j = 0; j < 16; j++) chain[0][j] = 1000 + j;
  ddp_work *works[N];
  for (int k = 0; k < N; k++)
    assert_int_equal(ddp_allgather_async(pg, chain[k], chain[k + 1], 16, DDP_INT32, &works[k]), DDP_OK);
  int32_t last[16];
  assert_int_equal(ddp_allgather(pg, chain[N], last, 16, DDP_INT32), DDP_OK);
  for (int j = 0; j < 16; j++) assert_int_equal(last[j], 1000 + j);
  for (int k = 0; k < N; k++) {
    ddp_status st;
    assert_true(ddp_work_test(works[k], &st)); /* finished before the blocking call returned */
    assert_int_equal(st, DDP_OK);
    ddp_work_free(works[k]);
  }
  /* The pool: a second round allocates no new work objects. */
  uint64_t before = ddp_alloc_count();
  for (int k = 0; k < N; k++)
    assert_int_equal(ddp_allgather_async(pg, chain[k], chain[k + 1], 16, DDP_INT32, &works[k]), DDP_OK);
  for (int k = 0; k < N; k++) {
    assert_int_equal(ddp_work_wait(works[k], -1), DDP_OK);
    ddp_work_free(works[k]);
  }
  assert_int_equal(ddp_alloc_count() - before, 0);
  /* Handles not freed by the user are released by destroy (ASan checks). */
  assert_int_equal(ddp_barrier_async(pg, &works[0]), DDP_OK);
  ddp_process_group_destroy(pg);
}

static void test_argument_errors(void **state) {
  ddp_process_group *pg = make_self(NULL);
  float f[4] = {0};
  int32_t i4[4] = {0};
  ddp_work *w = (ddp_work *)&f; /* must be reset to NULL on failure */
  expect_error(ddp_allreduce(pg, NULL, 4, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_ERR_INVALID,
               "allreduce: buf is NULL with count 4");
  expect_error(ddp_allreduce_async(pg, NULL, 4, DDP_FLOAT32, DDP_REDUCE_SUM, &w), DDP_ERR_INVALID,
               "allreduce_async: buf is NULL");
  assert_null(w);
  expect_error(ddp_allreduce_async(pg, f, 4, DDP_FLOAT32, DDP_REDUCE_SUM, NULL), DDP_ERR_INVALID,
               "allreduce_async: work is NULL");
  expect_error(ddp_allreduce(pg, i4, 4, DDP_INT32, DDP_REDUCE_AVG), DDP_ERR_INVALID,
               "allreduce: avg is for floating types, not int32");
  expect_error(ddp_reduce_scatter(pg, i4, i4, 1, DDP_INT64, DDP_REDUCE_AVG), DDP_ERR_INVALID,
               "reduce_scatter: avg is for floating types, not int64");
  expect_error(ddp_allreduce(pg, f, 4, DDP_UINT8, DDP_REDUCE_SUM), DDP_ERR_INVALID,
               "allreduce: dtype 6 is not one of");
  expect_error(ddp_allreduce(pg, f, 4, (ddp_dtype)99, DDP_REDUCE_SUM), DDP_ERR_INVALID,
               "dtype 99");
  expect_error(ddp_allreduce(pg, f, 4, DDP_FLOAT32, (ddp_reduce_op)7), DDP_ERR_INVALID,
               "allreduce: reduce op 7");
  expect_error(ddp_broadcast(pg, f, 4, DDP_FLOAT32, 1), DDP_ERR_INVALID,
               "broadcast: root 1 is not a rank of the group (size 1)");
  expect_error(ddp_reduce(pg, f, 4, DDP_FLOAT32, DDP_REDUCE_SUM, -1), DDP_ERR_INVALID,
               "reduce: root -1");
  expect_error(ddp_gather(pg, f, NULL, 4, DDP_FLOAT32, 0), DDP_ERR_INVALID,
               "gather: recv (on the root) is NULL");
  expect_error(ddp_scatter(pg, NULL, f, 4, DDP_FLOAT32, 0), DDP_ERR_INVALID,
               "scatter: send (on the root) is NULL");
  expect_error(ddp_allgather(pg, f, NULL, 1, DDP_FLOAT32), DDP_ERR_INVALID,
               "allgather: recv is NULL");
  expect_error(ddp_all_to_all_async(pg, NULL, f, 1, DDP_FLOAT32, &w), DDP_ERR_INVALID,
               "all_to_all_async: send is NULL");
  expect_error(ddp_allgather(pg, f, f, SIZE_MAX / 2, DDP_FLOAT32), DDP_ERR_INVALID, "too large");
  expect_error(ddp_send(pg, f, 4, DDP_FLOAT32, 0, 0), DDP_ERR_INVALID,
               "send: dst 0 is this rank");
  expect_error(ddp_recv(pg, f, 4, DDP_FLOAT32, 3, 0), DDP_ERR_INVALID,
               "recv: src 3 is not a rank of the group");
  expect_error(ddp_isend(pg, f, 4, DDP_FLOAT32, 0, 0, NULL), DDP_ERR_INVALID, "isend: work is NULL");
  expect_error(ddp_barrier(NULL), DDP_ERR_INVALID, "barrier: process group is NULL");
  expect_error(ddp_broadcast_bytes(pg, NULL, NULL, 0), DDP_ERR_INVALID, "broadcast_bytes");
  expect_error(ddp_work_wait(NULL, 1), DDP_ERR_INVALID, "work_wait: work is NULL");
  int bad_ranks[2] = {0, 0};
  ddp_process_group *sub = NULL;
  expect_error(ddp_process_group_new(pg, 2, bad_ranks, &sub), DDP_ERR_INVALID,
               "process_group_new: 2 ranks");
  bad_ranks[0] = 4;
  expect_error(ddp_process_group_new(pg, 1, bad_ranks, &sub), DDP_ERR_INVALID,
               "ranks[0] = 4 is not a rank of the parent");
  /* argument errors are not sticky: the group still works */
  assert_int_equal(ddp_allreduce(pg, f, 4, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_OK);
  ddp_process_group_destroy(pg);

  ddp_store *store;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.transport = "carrier-pigeon"};
  expect_error(ddp_process_group_create(store, 0, 1, &o, &pg), DDP_ERR_INVALID,
               "options.transport \"carrier-pigeon\"");
  assert_null(pg);
  expect_error(ddp_process_group_create(store, 2, 2, NULL, &pg), DDP_ERR_INVALID,
               "rank 2 is not in [0, 2)");
  ddp_store_destroy(store);
}

static void test_sticky_after_abort(void **state) {
  ddp_process_group *pg = make_self(NULL);
  float f[2] = {1, 2};
  ddp_process_group_abort(pg);
  expect_error(ddp_allreduce(pg, f, 2, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_ERR_ABORTED,
               "process group (rank 0 of 1) was aborted");
  char first[256];
  snprintf(first, sizeof first, "%s", ddp_last_error());
  ddp_work *w = NULL;
  expect_error(ddp_broadcast_async(pg, f, 2, DDP_FLOAT32, 0, &w), DDP_ERR_ABORTED, first);
  assert_null(w);
  expect_error(ddp_barrier(pg), DDP_ERR_ABORTED, first);
  expect_error(ddp_monitored_barrier(pg, 1, true), DDP_ERR_ABORTED, first);
  ddp_process_group *sub = NULL;
  int r0 = 0;
  expect_error(ddp_process_group_new(pg, 1, &r0, &sub), DDP_ERR_ABORTED, first);
  ddp_process_group_abort(pg); /* idempotent */
  ddp_process_group_destroy(pg);
}

/* Rank 0 of 3 alone: creation gives up after the timeout and names ranks
 * 1 and 2. */
static void test_create_timeout_names_missing(void **state) {
  ddp_store *store;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.timeout_s = 0.3};
  ddp_process_group *pg = (ddp_process_group *)store;
  double t0 = ddp_time_s();
  expect_error(ddp_process_group_create(store, 0, 3, &o, &pg), DDP_ERR_TIMEOUT,
               "waiting for ranks 1-2 to arrive");
  double took = ddp_time_s() - t0;
  assert_true(took >= 0.25 && took < 5);
  assert_null(pg);
  ddp_store_destroy(store);
}

static void test_subgroups_of_one(void **state) {
  ddp_process_group *pg = make_self(NULL);
  int r0 = 0;
  ddp_process_group *a = NULL, *b = NULL, *c = (ddp_process_group *)pg;
  assert_int_equal(ddp_process_group_new(pg, 1, &r0, &a), DDP_OK);
  assert_non_null(a);
  assert_int_equal(ddp_process_group_split(pg, 5, 0, &b), DDP_OK);
  assert_non_null(b);
  assert_int_equal(ddp_process_group_size(b), 1);
  assert_int_equal(ddp_process_group_split(pg, -1, 0, &c), DDP_OK); /* no color: no group */
  assert_null(c);
  double v = 3;
  assert_int_equal(ddp_allreduce(b, &v, 1, DDP_FLOAT64, DDP_REDUCE_AVG), DDP_OK);
  assert_true(v == 3);
  ddp_process_group_destroy(a);
  ddp_process_group_destroy(b);
  ddp_process_group_destroy(pg);
}

static void test_bytes_self(void **state) {
  ddp_process_group *pg = make_self(NULL);
  void *out = NULL;
  size_t lens[1] = {99};
  assert_int_equal(ddp_allgather_bytes(pg, "hello", 5, &out, lens), DDP_OK);
  assert_int_equal(lens[0], 5);
  assert_memory_equal(out, "hello", 5);
  ddp_free(out);
  assert_int_equal(ddp_allgather_bytes(pg, NULL, 0, &out, lens), DDP_OK);
  assert_int_equal(lens[0], 0);
  assert_non_null(out);
  ddp_free(out);
  void *data = "broadcast me";
  size_t bytes = 12;
  assert_int_equal(ddp_broadcast_bytes(pg, &data, &bytes, 0), DDP_OK);
  assert_int_equal(bytes, 12);
  assert_string_equal(data, "broadcast me"); /* the root keeps its own input */
  ddp_process_group_destroy(pg);
}

/* Several threads on one group (a group of one, so any interleaving is a
 * valid order): blocking calls take the inline path or queue behind async
 * ones, and every result must still be right. Run under TSan this checks
 * the lock-free inline path against the progress thread. */
static ddp_process_group *shared_pg;

static void *hammer(void *arg) {
  int id = (int)(intptr_t)arg;
  int64_t src[8], dst[8];
  for (int it = 0; it < 3000; it++) {
    for (int i = 0; i < 8; i++) src[i] = id * 100000 + it * 10 + i;
    ddp_work *w = NULL;
    if (it % 3 == 0) {
      if (ddp_allgather_async(shared_pg, src, dst, 8, DDP_INT64, &w) != DDP_OK) return (void *)1;
      if (ddp_work_wait(w, 10) != DDP_OK) return (void *)1;
      ddp_work_free(w);
    } else if (ddp_all_to_all(shared_pg, src, dst, 8, DDP_INT64) != DDP_OK) {
      return (void *)1;
    }
    if (memcmp(src, dst, sizeof src) != 0) return (void *)2;
  }
  return NULL;
}

static void test_threads_share_a_group(void **state) {
  shared_pg = make_self(NULL);
  pthread_t t[4];
  for (intptr_t i = 0; i < 4; i++) pthread_create(&t[i], NULL, hammer, (void *)i);
  for (int i = 0; i < 4; i++) {
    void *rc = NULL;
    pthread_join(t[i], &rc);
    assert_null(rc);
  }
  ddp_process_group_destroy(shared_pg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_self_group_ops),
      cmocka_unit_test(test_backend_names),
      cmocka_unit_test(test_async_submission_order),
      cmocka_unit_test(test_argument_errors),
      cmocka_unit_test(test_sticky_after_abort),
      cmocka_unit_test(test_create_timeout_names_missing),
      cmocka_unit_test(test_subgroups_of_one),
      cmocka_unit_test(test_bytes_self),
      cmocka_unit_test(test_threads_share_a_group),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
