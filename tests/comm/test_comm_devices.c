/* The device-aware comm API (docs/comm.md, "Buffers on devices"), on the
 * CPU: which device an operation's buffers are on (ddp__op_device_pick), a
 * group refusing buffers on a device its backend cannot reach, naming the
 * call, the backend and the device (GPU buffers played by the pointer
 * hook), buffers on two devices refused, and host memory answered as the
 * CPU by ddp_pointer_device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/comm_internal.h"
#include "comm/staged.h"
#include "ddp/ddp.h"

static void expect_error(ddp_status st, ddp_status want, const char *substring) {
  if (st != want)
    fail_msg("status %s, want %s (%s)", ddp_status_name(st), ddp_status_name(want), ddp_last_error());
  if (!strstr(ddp_last_error(), substring))
    fail_msg("message \"%s\" does not contain \"%s\"", ddp_last_error(), substring);
}

static void test_pick(void **state) {
  (void)state;
  int a = 0, b = 0;
  ddp_device d = DDP_CUDA(5);
  assert_int_equal(ddp__op_device_pick("barrier", NULL, DDP_CUDA(1), NULL, DDP_CUDA(1), &d), DDP_OK);
  assert_true(ddp_device_equal(d, DDP_CPU)); /* no buffer: the CPU */
  assert_int_equal(ddp__op_device_pick("allreduce", NULL, DDP_CPU, &a, DDP_CUDA(2), &d), DDP_OK);
  assert_true(ddp_device_equal(d, DDP_CUDA(2)));
  assert_int_equal(ddp__op_device_pick("send", &a, DDP_CUDA(3), NULL, DDP_CPU, &d), DDP_OK);
  assert_true(ddp_device_equal(d, DDP_CUDA(3)));
  assert_int_equal(ddp__op_device_pick("allgather", &a, DDP_CUDA(1), &b, DDP_CUDA(1), &d), DDP_OK);
  assert_true(ddp_device_equal(d, DDP_CUDA(1)));
  expect_error(ddp__op_device_pick("allgather", &a, DDP_CUDA(0), &b, DDP_CPU, &d), DDP_ERR_INVALID,
               "allgather: the send buffer is on cuda:0 and the receive buffer on cpu");
  expect_error(ddp__op_device_pick("all_to_all", &a, DDP_CUDA(0), &b, DDP_CUDA(1), &d),
               DDP_ERR_INVALID, "on cuda:0 and the receive buffer on cuda:1");
}

static void test_host_memory_is_cpu(void **state) {
  (void)state;
  static int global;
  int local;
  int *heap = ddp_alloc(64);
  assert_non_null(heap);
  assert_true(ddp_device_equal(ddp_pointer_device(NULL), DDP_CPU));
  assert_true(ddp_device_equal(ddp_pointer_device(&global), DDP_CPU));
  assert_true(ddp_device_equal(ddp_pointer_device(&local), DDP_CPU));
  assert_true(ddp_device_equal(ddp_pointer_device(heap), DDP_CPU));
  ddp_free(heap);
}

/* Buffers at addresses in gpu_lo..gpu_hi are "on cuda:0". */
static const char *gpu_lo, *gpu_hi;
static ddp_device fake_where(const void *p) {
  const char *c = p;
  return c >= gpu_lo && c < gpu_hi ? DDP_CUDA(0) : DDP_CPU;
}

static void test_group_refuses_gpu_buffers(void **state) {
  (void)state;
  ddp__staged_mode = -1; /* ddp's own backend as it is, even on a GPU machine */
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.timeout_s = 10};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(store, 0, 1, &o, &pg) != DDP_OK) fail_msg("%s", ddp_last_error());
  float gpu[8] = {0}, cpu[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  gpu_lo = (const char *)gpu;
  gpu_hi = (const char *)(gpu + 8);
  ddp__pointer_device_hook = fake_where;
  /* The CPU call is unchanged. */
  assert_int_equal(ddp_allreduce(pg, cpu, 8, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_OK);
  assert_true(cpu[7] == 8.0f);
  expect_error(ddp_allreduce(pg, gpu, 8, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_ERR_UNSUPPORTED,
               "allreduce: the self backend of this group (rank 0 of 1) cannot reach buffers on cuda:0");
  expect_error(ddp_allgather(pg, gpu, cpu, 8, DDP_FLOAT32), DDP_ERR_INVALID,
               "allgather: the send buffer is on cuda:0 and the receive buffer on cpu");
  ddp_work *w = NULL;
  expect_error(ddp_broadcast_async(pg, gpu, 8, DDP_FLOAT32, 0, &w), DDP_ERR_UNSUPPORTED, "cuda:0");
  assert_null(w);
  /* A refusal is the caller's mistake, not the group's failure. */
  assert_int_equal(ddp_allreduce(pg, cpu, 8, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_OK);
  assert_true(cpu[7] == 8.0f);
  ddp__pointer_device_hook = NULL;
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  ddp__staged_mode = 0;
}

/* batch_isend_irecv's device rule: ddp's own backends run a batch on
 * their lane, in host memory; an engine that groups batches (NCCL) takes
 * one batch on one device. The batch as one op of the queue belongs to the
 * engines only: no CPU backend's caps name it. */
static void test_batch_devices(void **state) {
  (void)state;
  assert_int_equal(ddp__p2p_batch_device_check("batch_isend_irecv", 0, DDP_CPU, DDP_CPU, false, "local"),
                   DDP_OK);
  expect_error(ddp__p2p_batch_device_check("batch_isend_irecv", 2, DDP_CPU, DDP_CUDA(1), false, "tcp"),
               DDP_ERR_UNSUPPORTED, "batch_isend_irecv: ops[2]: buffers on cuda:1: the tcp backend's "
               "batched point-to-point takes host memory");
  assert_int_equal(ddp__p2p_batch_device_check("batch_isend_irecv", 3, DDP_CUDA(1), DDP_CUDA(1), true,
                                               "nccl"), DDP_OK);
  expect_error(ddp__p2p_batch_device_check("batch_isend_irecv", 1, DDP_CUDA(1), DDP_CUDA(0), true, "nccl"),
               DDP_ERR_INVALID, "ops[1]'s buffer is on cuda:0 but ops[0]'s on cuda:1: one batch on the "
               "nccl backend runs on one device");
  expect_error(ddp__p2p_batch_device_check("batch_isend_irecv", 1, DDP_CUDA(0), DDP_CPU, true, "nccl"),
               DDP_ERR_INVALID, "ops[1]'s buffer is on cpu but ops[0]'s on cuda:0");
  assert_string_equal(ddp__op_kind_name(DDP__OP_P2P_BATCH), "batch_isend_irecv");
  assert_false(ddp__op_is_collective(DDP__OP_P2P_BATCH));
  ddp__backend_caps host = DDP__CAPS_HOST_BLOCKING;
  assert_false(host.ops >> DDP__OP_P2P_BATCH & 1u);
  assert_true(host.ops >> DDP__OP_RECV & 1u);
  ddp__op_args a = {.kind = DDP__OP_P2P_BATCH, .count = 6};
  char text[96];
  ddp__op_describe(&a, 2, text, sizeof text);
  assert_string_equal(text, "batch_isend_irecv(6 operations)");

  /* Through a group on ddp's own backend: a GPU buffer in a batch is
   * refused before anything is posted, and the group goes on. */
  ddp__staged_mode = -1;
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.timeout_s = 10};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(store, 0, 1, &o, &pg) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_false(pg->backend->ops->caps.ops >> DDP__OP_P2P_BATCH & 1u);
  float gpu[4] = {0}, cpu[4] = {1, 2, 3, 4}, got[4] = {0};
  gpu_lo = (const char *)gpu;
  gpu_hi = (const char *)(gpu + 4);
  ddp__pointer_device_hook = fake_where;
  ddp_p2p_op ops[2] = {{DDP_P2P_SEND, cpu, 4, DDP_FLOAT32, 0, 0}, {DDP_P2P_RECV, gpu, 4, DDP_FLOAT32, 0, 0}};
  ddp_work *w = NULL;
  expect_error(ddp_batch_isend_irecv(pg, ops, 2, &w), DDP_ERR_UNSUPPORTED, "ops[1]");
  assert_null(w);
  ops[1].buf = got; /* all on the host: the lane runs it (a send to self) */
  assert_int_equal(ddp_batch_isend_irecv(pg, ops, 2, &w), DDP_OK);
  assert_int_equal(ddp_work_wait(w, 10), DDP_OK);
  ddp_work_free(w);
  assert_memory_equal(got, cpu, sizeof cpu);
  ddp__pointer_device_hook = NULL;
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  ddp__staged_mode = 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pick),
      cmocka_unit_test(test_host_memory_is_cpu),
      cmocka_unit_test(test_group_refuses_gpu_buffers),
      cmocka_unit_test(test_batch_devices),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
