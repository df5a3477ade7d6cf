/* CUDA buffers over ddp's own backends, staged through host memory
 * (src/comm/staged.c), on the CPU: the plan of which buffers travel and
 * how many bytes, for every operation at the root and elsewhere; then the
 * whole correctness matrix (every op x dtype x counts, worlds of 1 to 3
 * threads) with each rank's buffers played as cuda:0 (a pointer hook) and
 * the copies done by memcpy, counted, so the results prove the staging and
 * the counts its bookkeeping; host buffers on the same group untouched by
 * it; a failed copy back named with the operation and the device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/comm_internal.h"
#include "comm/comm_matrix_body.h"
#include "comm/staged.h"

/* ---- The plan ---------------------------------------------------------------------- */

static void expect_plan(ddp__op_kind kind, int rank, int root, bool send, bool buf, size_t send_bytes,
                        size_t buf_bytes, bool in, bool out) {
  char s = 0, b = 0;
  ddp__op_args a = {.kind = kind, .count = 10, .dtype = DDP_FLOAT64, .root = root,
                    .send = send ? &s : NULL, .buf = buf ? &b : NULL};
  ddp__staged_plan p;
  ddp__staged_plan_of(&a, rank, 4, &p);
  if (p.send_bytes != send_bytes || p.buf_bytes != buf_bytes || p.buf_in != in || p.buf_out != out)
    fail_msg("%s rank %d root %d: send %zu buf %zu in %d out %d; want %zu %zu %d %d",
             ddp__op_kind_name(kind), rank, root, p.send_bytes, p.buf_bytes, p.buf_in, p.buf_out,
             send_bytes, buf_bytes, in, out);
}

static void test_plan(void **state) {
  (void)state;
  /* 10 float64 = 80 bytes a block, 4 ranks. */
  expect_plan(DDP__OP_ALLREDUCE, 1, 0, false, true, 0, 80, true, true);
  expect_plan(DDP__OP_BROADCAST, 2, 2, false, true, 0, 80, true, false);  /* the root sends */
  expect_plan(DDP__OP_BROADCAST, 1, 2, false, true, 0, 80, false, true);  /* others receive */
  expect_plan(DDP__OP_REDUCE, 3, 3, false, true, 0, 80, true, true);
  expect_plan(DDP__OP_REDUCE, 0, 3, false, true, 0, 80, true, false);     /* unchanged elsewhere */
  expect_plan(DDP__OP_ALLGATHER, 0, 0, true, true, 80, 320, false, true);
  expect_plan(DDP__OP_GATHER, 1, 1, true, true, 80, 320, false, true);
  expect_plan(DDP__OP_GATHER, 0, 1, true, false, 80, 0, false, false);    /* recv NULL off the root */
  expect_plan(DDP__OP_SCATTER, 2, 2, true, true, 320, 80, false, true);
  expect_plan(DDP__OP_SCATTER, 0, 2, false, true, 0, 80, false, true);    /* send NULL off the root */
  expect_plan(DDP__OP_REDUCE_SCATTER, 1, 0, true, true, 320, 80, false, true);
  expect_plan(DDP__OP_ALL_TO_ALL, 1, 0, true, true, 320, 320, false, true);
  expect_plan(DDP__OP_SEND, 0, 1, true, false, 80, 0, false, false);
  expect_plan(DDP__OP_RECV, 1, 0, false, true, 0, 80, false, true);
  expect_plan(DDP__OP_BARRIER, 0, 0, false, false, 0, 0, false, false);
}

/* ---- The CPU playing a GPU ---------------------------------------------------------- */

static struct {
  const char *lo, *hi;
} fake[CT_MAX_RANKS * 2];
static atomic_int nfake;
static _Atomic size_t to_host_bytes, to_device_bytes, host_allocs;
static atomic_bool fail_to_device;

static ddp_device where(const void *p) {
  const char *c = p;
  int n = atomic_load(&nfake);
  for (int i = 0; i < n; i++)
    if (c >= fake[i].lo && c < fake[i].hi) return DDP_CUDA(0);
  return DDP_CPU;
}
static void add_fake(const char *p, size_t bytes) {
  int i = atomic_fetch_add(&nfake, 1);
  fake[i].lo = p;
  fake[i].hi = p + bytes;
}

static ddp_status fake_alloc(ddp_device d, size_t bytes, void **out) {
  assert_true(ddp_device_equal(d, DDP_CUDA(0)));
  atomic_fetch_add(&host_allocs, 1);
  *out = ddp_alloc(bytes);
  return *out ? DDP_OK : DDP_ERR_NOMEM;
}
static ddp_status fake_to_host(void *host, ddp_device d, const void *src, size_t bytes) {
  assert_true(ddp_device_equal(d, DDP_CUDA(0)) && ddp_device_equal(where(src), DDP_CUDA(0)));
  assert_true(ddp_device_equal(where(host), DDP_CPU)); /* staged into host memory */
  memcpy(host, src, bytes);
  atomic_fetch_add(&to_host_bytes, bytes);
  return DDP_OK;
}
static ddp_status fake_to_device(ddp_device d, void *dst, const void *host, size_t bytes) {
  if (atomic_load(&fail_to_device)) return ddp_error(DDP_ERR_IO, "cuda:0: made-up copy failure");
  assert_true(ddp_device_equal(d, DDP_CUDA(0)) && ddp_device_equal(where(dst), DDP_CUDA(0)));
  memcpy(dst, host, bytes);
  atomic_fetch_add(&to_device_bytes, bytes);
  return DDP_OK;
}
static const ddp__staged_copier memcpy_copier = {fake_alloc, ddp_free, fake_to_host, fake_to_device};

static void setup_fake(void) {
  atomic_store(&nfake, 0);
  ddp__pointer_device_hook = where;
  ddp__staged_copier_hook = &memcpy_copier;
  ddp__staged_mode = 1;
}
static void teardown_fake(void) {
  ddp__pointer_device_hook = NULL;
  ddp__staged_copier_hook = NULL;
  ddp__staged_mode = 0;
}

/* Each rank's a and b are "on cuda:0" (registered before any rank runs an
 * op: the world's threads meet at ct_sync). */
static void body_matrix(ct_rank *self) {
  char *a = ddp_alloc(MIB + 4096), *b = ddp_alloc(MIB + 4096);
  add_fake(a, MIB + 4096);
  add_fake(b, MIB + 4096);
  ct_sync(self);
  for (size_t d = 0; d < LT_NUM_DTYPES; d++) {
    ct_matrix_dtype(self, lt_dtypes[d], a, b);
    if (atomic_load(&self->world->failures)) break;
  }
  ct_sync(self);
  ddp_free(a);
  ddp_free(b);
}

static void test_matrix_staged(void **state) {
  (void)state;
  for (int P = 1; P <= 3; P++) {
    setup_fake();
    atomic_store(&to_host_bytes, 0);
    atomic_store(&to_device_bytes, 0);
    int r = ct_run(P, 60, body_matrix, NULL);
    teardown_fake();
    assert_int_equal(r, 0);
    /* Everything went through the staging (the matrix moves MiBs). */
    assert_true(atomic_load(&to_host_bytes) > MIB && atomic_load(&to_device_bytes) > MIB);
  }
}

/* One allgather: each rank copies its block in and the whole result out,
 * nothing else; an op on host buffers of the same group copies nothing. */
static void body_count(ct_rank *self) {
  ddp_process_group *pg = self->pg;
  int P = self->world->size;
  float *dev_send = ddp_alloc(64 * sizeof(float)), *dev_recv = ddp_alloc(64 * P * sizeof(float));
  add_fake((const char *)dev_send, 64 * sizeof(float));
  add_fake((const char *)dev_recv, 64 * P * sizeof(float));
  for (int i = 0; i < 64; i++) dev_send[i] = (float)(self->rank * 100 + i);
  ct_sync(self);
  if (self->rank == 0) atomic_store(&to_host_bytes, 0), atomic_store(&to_device_bytes, 0);
  ct_sync(self);
  CT_OK(self, ddp_allgather(pg, dev_send, dev_recv, 64, DDP_FLOAT32));
  for (int r = 0; r < P; r++)
    for (int i = 0; i < 64; i++)
      CT_CHECK(self, dev_recv[r * 64 + i] == (float)(r * 100 + i), "[%d][%d] = %g", r, i,
               dev_recv[r * 64 + i]);
  ct_sync(self);
  CT_CHECK(self, atomic_load(&to_host_bytes) == (size_t)P * 64 * 4, "to host %zu bytes, want %zu",
           atomic_load(&to_host_bytes), (size_t)P * 64 * 4);
  CT_CHECK(self, atomic_load(&to_device_bytes) == (size_t)P * P * 64 * 4, "to device %zu, want %zu",
           atomic_load(&to_device_bytes), (size_t)P * P * 64 * 4);
  ct_sync(self);
  float host[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  CT_OK(self, ddp_allreduce(pg, host, 8, DDP_FLOAT32, DDP_REDUCE_SUM));
  CT_CHECK(self, host[7] == (float)P, "host allreduce %g", host[7]);
  ct_sync(self);
  CT_CHECK(self, atomic_load(&to_host_bytes) == (size_t)P * 64 * 4, "a host op was staged");
  /* ... nor did it pass through the wrapper: host buffers take the group
   * layer's inline path on the unwrapped backend, as on a machine without
   * a GPU (async and point-to-point too). */
  ddp_work *w = NULL;
  CT_OK(self, ddp_allreduce_async(pg, host, 8, DDP_FLOAT32, DDP_REDUCE_SUM, &w));
  CT_OK(self, ddp_work_wait(w, 30));
  ddp_work_free(w);
  if (P > 1) {
    int peer = self->rank ^ 1;
    if (peer < P) {
      if (self->rank & 1) CT_OK(self, ddp_send(pg, host, 8, DDP_FLOAT32, peer, 3));
      else CT_OK(self, ddp_recv(pg, host, 8, DDP_FLOAT32, peer, 3));
    }
  }
  ct_sync(self);
  CT_CHECK(self, atomic_load(&ddp__staged_host_passes) == 0, "%ld host ops went through the wrapper",
           (long)atomic_load(&ddp__staged_host_passes));
  CT_CHECK(self, ddp__staged_inner(self->pg->backend) == self->pg->host_backend &&
                     self->pg->host_backend != self->pg->backend,
           "the group keeps its unwrapped backend for host buffers");
  /* Buffers on two devices in one op. */
  ddp_status st = ddp_allgather(pg, host, dev_recv, 1, DDP_FLOAT32);
  CT_CHECK(self, st == DDP_ERR_INVALID && strstr(ddp_last_error(), "on cpu and the receive buffer on cuda:0"),
           "mixed: %s %s", ddp_status_name(st), ddp_last_error());
  /* A failed copy back fails the op, naming it and the device. */
  ct_sync(self);
  if (self->rank == 0) atomic_store(&fail_to_device, true);
  ct_sync(self);
  st = ddp_allreduce(pg, dev_send, 64, DDP_FLOAT32, DDP_REDUCE_SUM);
  CT_CHECK(self, st == DDP_ERR_IO && strstr(ddp_last_error(), "copying the result back to cuda:0") &&
                     strstr(ddp_last_error(), "made-up copy failure"),
           "failed copy: %s %s", ddp_status_name(st), ddp_last_error());
  ct_sync(self);
  ddp_free(dev_send);
  ddp_free(dev_recv);
}

static void test_bookkeeping(void **state) {
  (void)state;
  for (int P = 1; P <= 3; P += 2) {
    setup_fake();
    atomic_store(&fail_to_device, false);
    atomic_store(&host_allocs, 0);
    int r = ct_run(P, 30, body_count, NULL);
    teardown_fake();
    atomic_store(&fail_to_device, false);
    assert_int_equal(r, 0);
    /* Two pinned buffers per rank, grown once each for these sizes (the
     * allreduce fits in what the allgather took). */
    assert_int_equal((int)atomic_load(&host_allocs), 2 * P);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan),
      cmocka_unit_test(test_bookkeeping),
      cmocka_unit_test(test_matrix_staged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
