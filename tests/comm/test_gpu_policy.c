/* The NCCL backend's decisions that need no GPU (src/comm/gpu_policy.h),
 * on the CPU: ranks sharing a GPU refused naming both ranks, the host and
 * the GPU, unless their NCCL_HOSTID differ (the one-GPU test arrangement);
 * and the watchdog's verdicts: NCCL's asynchronous error first, then a dead
 * peer, then the oldest operation's deadline, ncclInProgress no error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "comm/gpu_policy.h"
#include "ddp/ddp.h"

static void expect_msg(const char *msg, const char *substring) {
  if (!strstr(msg, substring)) fail_msg("message \"%s\" does not contain \"%s\"", msg, substring);
}

static ddp__gpu_place place(int host, int device, const char *uuid, const char *hostid) {
  ddp__gpu_place p = {.host = host, .device = device};
  snprintf(p.uuid, sizeof p.uuid, "%s", uuid);
  snprintf(p.nccl_hostid, sizeof p.nccl_hostid, "%s", hostid);
  return p;
}

static void test_placement(void **state) {
  (void)state;
  const char *hosts[] = {"n0", "n0", "n1", "n1"};
  /* A GPU per rank; the same UUID on two hosts is two GPUs. */
  ddp__gpu_place ok[] = {place(0, 0, "GPU-a", ""), place(0, 1, "GPU-b", ""),
                         place(1, 0, "GPU-a", ""), place(1, 1, "GPU-b", "")};
  assert_int_equal(ddp__gpu_placement_check(ok, 4, hosts), DDP_OK);
  /* Ranks 2 and 3 share n1's GPU-c (ordinal 0 in both processes). */
  ddp__gpu_place shared[] = {place(0, 0, "GPU-a", ""), place(0, 1, "GPU-b", ""),
                             place(1, 0, "GPU-c", ""), place(1, 0, "GPU-c", "")};
  assert_int_equal(ddp__gpu_placement_check(shared, 4, hosts), DDP_ERR_INVALID);
  expect_msg(ddp_last_error(), "ranks 2 and 3 (host n1) both use one GPU");
  expect_msg(ddp_last_error(), "GPU-c");
  expect_msg(ddp_last_error(), "backend \"ddp\"");
  /* The same GPU under different ordinals (CUDA_VISIBLE_DEVICES) is still one. */
  ddp__gpu_place renamed[] = {place(0, 1, "GPU-z", ""), place(0, 0, "GPU-z", "")};
  assert_int_equal(ddp__gpu_placement_check(renamed, 2, hosts), DDP_ERR_INVALID);
  expect_msg(ddp_last_error(), "cuda:1 of rank 0, cuda:0 of rank 1");
  /* Distinct NCCL_HOSTID: NCCL takes them for two hosts. Equal: refused. */
  ddp__gpu_place test_arr[] = {place(0, 0, "GPU-z", "ddp-r0"), place(0, 0, "GPU-z", "ddp-r1")};
  assert_int_equal(ddp__gpu_placement_check(test_arr, 2, hosts), DDP_OK);
  ddp__gpu_place same_id[] = {place(0, 0, "GPU-z", "x"), place(0, 0, "GPU-z", "x")};
  assert_int_equal(ddp__gpu_placement_check(same_id, 2, hosts), DDP_ERR_INVALID);
  assert_int_equal(ddp__gpu_placement_check(ok, 1, hosts), DDP_OK);
}

static ddp__watch_input pending(int64_t now, int64_t started, int64_t deadline) {
  ddp__watch_input in = {.now_ns = now, .rank = 1, .size = 4, .op = "allreduce", .seq = 17,
                         .started_ns = started, .deadline_ns = deadline, .dead_peer = -1};
  return in;
}

static void test_watchdog(void **state) {
  (void)state;
  char msg[512];
  ddp_status st = DDP_OK;
  /* In time, no error, ncclInProgress: continue. */
  ddp__watch_input in = pending(5000000000LL, 1000000000LL, 11000000000LL);
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_CONTINUE);
  in.async_error = 7;
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_CONTINUE);
  /* Past the deadline: timeout naming op, number, rank and the time allowed. */
  in = pending(11000000000LL, 1000000000LL, 11000000000LL);
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  assert_int_equal(st, DDP_ERR_TIMEOUT);
  expect_msg(msg, "allreduce #17 (rank 1 of 4) did not complete within 10 s");
  /* Nothing pending never times out. */
  in.op = NULL;
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_CONTINUE);
  /* A dead peer beats the deadline. */
  in = pending(11000000000LL, 1000000000LL, 11000000000LL);
  in.dead_peer = 3;
  in.dead_why = "killed by signal 9";
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  assert_int_equal(st, DDP_ERR_PEER);
  expect_msg(msg, "allreduce #17 (rank 1 of 4): rank 3 died (killed by signal 9)");
  /* NCCL's own error beats both, and aborts with nothing pending too. */
  in.async_error = 6; /* ncclRemoteError */
  in.async_error_str = "remote process exited or there was a network error";
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  assert_int_equal(st, DDP_ERR_IO);
  expect_msg(msg, "NCCL reported error 6 (remote process exited");
  in.op = NULL;
  in.dead_peer = -1;
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  expect_msg(msg, "no operation pending (rank 1 of 4)");
}

/* The timeout says where the op stood on its GPU, from its two events:
 * never started (stuck behind earlier work on the stream) or running and
 * waiting for its peers; a host engine's (no events) says neither. The
 * decision itself does not change with it. */
static void test_watchdog_device_state(void **state) {
  (void)state;
  char msg[512];
  ddp_status st = DDP_OK;
  ddp__watch_input in = pending(31000000000LL, 1000000000LL, 31000000000LL);
  in.device = 3;
  in.device_state = DDP__DEVICE_QUEUED;
  in.device_started_ns = -1;
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  assert_int_equal(st, DDP_ERR_TIMEOUT);
  expect_msg(msg, "allreduce #17 (rank 1 of 4) did not complete within 30 s; it never started on "
                  "cuda:3 (work queued before it on the communication stream did not finish)");
  in.device_state = DDP__DEVICE_RUNNING;
  in.device_started_ns = 6000000000LL; /* 5 s after it was enqueued, 25 s ago */
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  expect_msg(msg, "it started on cuda:3 5 s after it was enqueued and waited 25 s there for its peers");
  if (strstr(msg, "never started")) fail_msg("running op called never started: %s", msg);
  /* Before its deadline a queued op is no reason to abort. */
  in.now_ns = 30000000000LL;
  in.device_state = DDP__DEVICE_QUEUED;
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_CONTINUE);
  /* A host engine: no device words. */
  in = pending(31000000000LL, 1000000000LL, 31000000000LL);
  assert_int_equal(ddp__watch_decide(&in, &st, msg, sizeof msg), DDP__WATCH_ABORT);
  if (strstr(msg, "cuda:")) fail_msg("host engine's timeout names a GPU: %s", msg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_placement),
      cmocka_unit_test(test_watchdog),
      cmocka_unit_test(test_watchdog_device_state),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
