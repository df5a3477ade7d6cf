/* The correctness matrix through the public API: every operation x dtype x
 * world of 1..8 ranks (threads of this process) x counts 0, 1, one not
 * divisible by the world size, and 1 MiB of data, against closed forms.
 * The backend comes from $DDP_TEST_TRANSPORT (unset: local; "tcp": TCP over
 * loopback), so each backend runs the same matrix; SKIP when the backend is
 * not built.
 *
 * Rank r contributes (r + 1) * (i % 7 + 1) to element i of a reduction
 * (PRODUCT: 2 where i % 3 == r % 3, else 1), and r * 8 + (i % 5) to data
 * that is moved; every expected value is a small integer or half-integer,
 * exact in every dtype including bfloat16, whatever the order of the
 * reduction. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/comm_matrix_body.h"

static void body_matrix(ct_rank *self) {
  char *a = malloc(MIB + 4096), *b = malloc(MIB + 4096);
  for (size_t d = 0; d < LT_NUM_DTYPES; d++) {
    ct_matrix_dtype(self, lt_dtypes[d], a, b);
    if (atomic_load(&self->world->failures)) break;
  }
  free(a);
  free(b);
}

static void run_world(int P) {
  int r = ct_run(P, 60, body_matrix, NULL);
  if (r == 2) {
    print_message("SKIP: the backend for a world of %d is not built\n", P);
    skip();
  }
  assert_int_equal(r, 0);
}

#define WORLD_TEST(P) \
  static void test_world_##P(void **state) { run_world(P); }
WORLD_TEST(1)
WORLD_TEST(2)
WORLD_TEST(3)
WORLD_TEST(4)
WORLD_TEST(5)
WORLD_TEST(6)
WORLD_TEST(7)
WORLD_TEST(8)

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_world_1), cmocka_unit_test(test_world_2), cmocka_unit_test(test_world_3),
      cmocka_unit_test(test_world_4), cmocka_unit_test(test_world_5), cmocka_unit_test(test_world_6),
      cmocka_unit_test(test_world_7), cmocka_unit_test(test_world_8),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
