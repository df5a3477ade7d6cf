/* local backend, 64 MiB: float32 allreduce (SUM), broadcast and allgather
 * (64 MiB gathered in all) between 2, 3 and 8 processes, every element
 * checked against its closed form. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/local_proc_util.h"
#include "comm/local_test_util.h"

#define BYTES (64u << 20)

static int large_rank(int rank, int size, void *arg) {
  char prefix[32];
  snprintf(prefix, sizeof prefix, "large%d/", size);
  ddp_store *store = NULL;
  ddp__backend *b = lp_child_backend(&lp_the_server, prefix, rank, size, &store);
  atomic_bool ab;
  atomic_init(&ab, false);
  size_t count = BYTES / sizeof(float);
  float *buf = ddp_alloc(BYTES);
  float *recv = ddp_alloc(BYTES);
  if (!buf || !recv) return 5;
  int bad = 0;

  for (size_t i = 0; i < count; i++) buf[i] = (float)ddp__pattern_contrib(rank, i, DDP_REDUCE_SUM);
  ddp__op_ctx ctx = lt_ctx("allreduce", 1, &ab, 60.0);
  ddp_status st = b->ops->blocking->allreduce(b, &ctx, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM);
  for (size_t i = 0; st == DDP_OK && i < count; i++)
    if (buf[i] != (float)ddp__pattern_reduced(DDP_REDUCE_SUM, size, i)) {
      fprintf(stderr, "rank %d of %d: allreduce [%zu] = %g\n", rank, size, i, buf[i]);
      bad = 1;
      break;
    }

  int root = size - 1;
  for (size_t i = 0; st == DDP_OK && i < count; i++)
    buf[i] = rank == root ? (float)(i % 1000003) : -1.0f;
  ctx = lt_ctx("broadcast", 2, &ab, 60.0);
  if (st == DDP_OK) st = b->ops->blocking->broadcast(b, &ctx, buf, count, DDP_FLOAT32, root);
  for (size_t i = 0; st == DDP_OK && i < count; i++)
    if (buf[i] != (float)(i % 1000003)) {
      fprintf(stderr, "rank %d of %d: broadcast [%zu] = %g\n", rank, size, i, buf[i]);
      bad = 1;
      break;
    }

  size_t per = count / (size_t)size;
  for (size_t i = 0; st == DDP_OK && i < per; i++) buf[i] = (float)ddp__pattern_contrib(rank, i, 0);
  ctx = lt_ctx("allgather", 3, &ab, 60.0);
  if (st == DDP_OK) st = b->ops->blocking->allgather(b, &ctx, buf, recv, per, DDP_FLOAT32);
  for (size_t j = 0; st == DDP_OK && j < per * (size_t)size; j++)
    if (recv[j] != (float)ddp__pattern_contrib((int)(j / per), j % per, 0)) {
      fprintf(stderr, "rank %d of %d: allgather [%zu] = %g\n", rank, size, j, recv[j]);
      bad = 1;
      break;
    }
  if (st != DDP_OK) {
    fprintf(stderr, "rank %d of %d: %s\n", rank, size, ddp_last_error());
    bad = 1;
  }
  b->ops->destroy(b);
  ddp_store_destroy(store);
  ddp_free(buf);
  ddp_free(recv);
  return bad;
}

static void run(int size) {
  pid_t pids[8];
  lp_spawn(size, 120, large_rank, NULL, pids);
  if (lp_reap(size, pids) != 0) fail_msg("%d ranks failed (see stderr)", size);
  assert_int_equal(lp_count_segments(pids[0]), 0);
}

static void test_2(void **state) { (void)state; run(2); }
static void test_3(void **state) { (void)state; run(3); }
static void test_8(void **state) { (void)state; run(8); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_2),
      cmocka_unit_test(test_3),
      cmocka_unit_test(test_8),
  };
  return cmocka_run_group_tests(tests, lp_group_setup, lp_group_teardown);
}
