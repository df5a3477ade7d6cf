/* Schedules as data, without communication: the action lists of GPipe, 1F1B
 * and interleaved 1F1B for small p, M, v against lists derived by hand, the
 * activation high-water marks (M for GPipe, p - s for 1F1B) and the critical
 * path the checker simulates (2 (M + p - 1) computes for GPipe and 1F1B),
 * the refusals of impossible shapes, and the checker rejecting broken lists
 * (a missing receive, a swapped order, a deadlock, a duplicate forward, a
 * backward before its forward, a wrong peer, an unmatched send). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "ddp/pipeline.h"

static ddp_pipeline_schedule *make(ddp_pipeline_schedule_kind kind, int p, int m, int v) {
  ddp_pipeline_schedule *s = NULL;
  ddp_status st = ddp_pipeline_schedule_create(&s, kind, p, m, v);
  if (st != DDP_OK) fprintf(stderr, "%s\n", ddp_last_error());
  assert_int_equal(st, DDP_OK);
  return s;
}

static void expect_print(const ddp_pipeline_schedule *s, const char *want) {
  char buf[4096];
  ddp_pipeline_schedule_print(s, -1, buf, sizeof buf);
  if (strcmp(buf, want) != 0) fprintf(stderr, "got:\n%swant:\n%s", buf, want);
  assert_string_equal(buf, want);
}

/* GPipe, 2 ranks, 3 micro-batches: all forwards, then all backwards; each
 * receive is posted one compute before the compute that needs it. */
static void test_gpipe_lists(void **state) {
  (void)state;
  ddp_pipeline_schedule *s = make(DDP_PIPELINE_GPIPE, 2, 3, 1);
  expect_print(s,
               "rank 0: F0.0 sa0.0>1 F0.1 sa0.1>1 rg0.0<1 F0.2 sa0.2>1 rg0.1<1 B0.0 rg0.2<1 "
               "B0.1 B0.2\n"
               "rank 1: ra1.0<0 ra1.1<0 F1.0 ra1.2<0 F1.1 F1.2 B1.0 sg1.0>0 B1.1 sg1.1>0 B1.2 "
               "sg1.2>0\n");
  ddp_pipeline_schedule_report rep;
  assert_int_equal(ddp_pipeline_schedule_check(s, &rep), DDP_OK);
  assert_int_equal(rep.live_high_water[0], 3);
  assert_int_equal(rep.live_high_water[1], 3);
  assert_int_equal(rep.makespan, 2 * (3 + 2 - 1));
  ddp_pipeline_schedule_destroy(s);
}

/* 1F1B (PyTorch's Schedule1F1B), 3 ranks, 4 micro-batches: stage s runs
 * p - s forwards, then backward and forward in turn. */
static void test_1f1b_lists(void **state) {
  (void)state;
  ddp_pipeline_schedule *s = make(DDP_PIPELINE_1F1B, 3, 4, 1);
  expect_print(s,
               "rank 0: F0.0 sa0.0>1 F0.1 sa0.1>1 rg0.0<1 F0.2 sa0.2>1 B0.0 rg0.1<1 F0.3 "
               "sa0.3>1 rg0.2<1 B0.1 rg0.3<1 B0.2 B0.3\n"
               "rank 1: ra1.0<0 ra1.1<0 F1.0 sa1.0>2 rg1.0<2 F1.1 sa1.1>2 ra1.2<0 B1.0 "
               "sg1.0>0 rg1.1<2 F1.2 sa1.2>2 ra1.3<0 B1.1 sg1.1>0 rg1.2<2 F1.3 sa1.3>2 rg1.3<2 "
               "B1.2 sg1.2>0 B1.3 sg1.3>0\n"
               "rank 2: ra2.0<1 F2.0 ra2.1<1 B2.0 sg2.0>1 F2.1 ra2.2<1 B2.1 sg2.1>1 F2.2 "
               "ra2.3<1 B2.2 sg2.2>1 F2.3 B2.3 sg2.3>1\n");
  ddp_pipeline_schedule_destroy(s);
}

/* The high-water marks and the critical path over a range of shapes. */
static void test_high_water(void **state) {
  (void)state;
  for (int p = 1; p <= 6; p++)
    for (int m = 1; m <= 12; m++) {
      ddp_pipeline_schedule_report rep;
      ddp_pipeline_schedule *g = make(DDP_PIPELINE_GPIPE, p, m, 1);
      assert_int_equal(ddp_pipeline_schedule_check(g, &rep), DDP_OK);
      for (int s = 0; s < p; s++) assert_int_equal(rep.live_high_water[s], m);
      assert_int_equal(rep.makespan, 2 * (m + p - 1));
      ddp_pipeline_schedule_destroy(g);
      if (m < p) continue;
      ddp_pipeline_schedule *f = make(DDP_PIPELINE_1F1B, p, m, 1);
      assert_int_equal(ddp_pipeline_schedule_check(f, &rep), DDP_OK);
      for (int s = 0; s < p; s++) assert_int_equal(rep.live_high_water[s], p - s);
      assert_int_equal(rep.makespan, 2 * (m + p - 1));
      ddp_pipeline_schedule_destroy(f);
      ddp_pipeline_schedule *e = make(DDP_PIPELINE_FORWARD_ONLY, p, m, 1);
      assert_int_equal(ddp_pipeline_schedule_check(e, &rep), DDP_OK);
      assert_int_equal(rep.makespan, m + p - 1);
      ddp_pipeline_schedule_destroy(e);
    }
}

/* Interleaved, 2 ranks x 2 chunks, 2 micro-batches, derived by hand from
 * Megatron's rule: rank r runs 2 (p - r - 1) + (v - 1) p warmup forwards
 * (rank 0: 4 = all of them, rank 1: 2), forward unit k is chunk (k / p) % v
 * of micro-batch k % p, backward units walk the chunks in reverse. */
static void test_interleaved_lists(void **state) {
  (void)state;
  ddp_pipeline_schedule *s = make(DDP_PIPELINE_INTERLEAVED, 2, 2, 2);
  expect_print(s,
               "rank 0: F0.0 sa0.0>1 ra2.0<1 F0.1 sa0.1>1 ra2.1<1 F2.0 sa2.0>1 rg2.0<1 F2.1 "
               "sa2.1>1 rg2.1<1 B2.0 sg2.0>1 rg0.0<1 B2.1 sg2.1>1 rg0.1<1 B0.0 B0.1\n"
               "rank 1: ra1.0<0 ra1.1<0 F1.0 sa1.0>0 ra3.0<0 F1.1 sa1.1>0 F3.0 ra3.1<0 B3.0 "
               "sg3.0>0 F3.1 rg1.0<0 B3.1 sg3.1>0 rg1.1<0 B1.0 sg1.0>0 B1.1 sg1.1>0\n");
  ddp_pipeline_schedule_report rep;
  assert_int_equal(ddp_pipeline_schedule_check(s, &rep), DDP_OK);
  assert_int_equal(rep.rank_live_high_water[0], 4);
  assert_int_equal(rep.rank_live_high_water[1], 3);
  ddp_pipeline_schedule_destroy(s);
  /* Larger shapes pass the checker within Megatron's bound, and the bubble
   * shrinks with v: the critical path in units of a chunk's compute is
   * 2 (v M + p - 1) at most. */
  for (int p = 2; p <= 4; p++)
    for (int v = 2; v <= 4; v++)
      for (int m = p; m <= 3 * p; m += p) {
        ddp_pipeline_schedule *t = make(DDP_PIPELINE_INTERLEAVED, p, m, v);
        assert_int_equal(ddp_pipeline_schedule_check(t, &rep), DDP_OK);
        assert_true(rep.makespan <= 2 * (v * m + p - 1));
        for (int r = 0; r < p; r++) assert_true(rep.rank_live_high_water[r] <= rep.rank_live_promised[r]);
        ddp_pipeline_schedule_destroy(t);
      }
}

static void test_refusals(void **state) {
  (void)state;
  ddp_pipeline_schedule *s = NULL;
  assert_int_equal(ddp_pipeline_schedule_create(&s, DDP_PIPELINE_1F1B, 4, 3, 1), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "M = 3 < p = 4"));
  assert_int_equal(ddp_pipeline_schedule_create(&s, DDP_PIPELINE_INTERLEAVED, 2, 3, 2),
                   DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "multiple of p"));
  assert_int_equal(ddp_pipeline_schedule_create(&s, DDP_PIPELINE_INTERLEAVED, 2, 4, 1),
                   DDP_ERR_INVALID);
  assert_int_equal(ddp_pipeline_schedule_create(&s, DDP_PIPELINE_GPIPE, 1, 4, 2), DDP_ERR_INVALID);
  assert_int_equal(ddp_pipeline_schedule_create(&s, DDP_PIPELINE_GPIPE, 0, 4, 1), DDP_ERR_INVALID);
  assert_null(s);
  ddp_pipeline_schedule_kind k;
  assert_int_equal(ddp_pipeline_schedule_parse("1f1b", &k), DDP_OK);
  assert_int_equal(k, DDP_PIPELINE_1F1B);
  assert_int_equal(ddp_pipeline_schedule_parse("zigzag", &k), DDP_ERR_INVALID);
}

/* A correct 2-rank, 2-micro-batch GPipe list to break. */
#define A(kind, st, mb, peer) {DDP_PIPELINE_##kind, st, mb, peer}
#define AC(kind, st, mb, peer) ((ddp_pipeline_action)A(kind, st, mb, peer))
static const ddp_pipeline_action good0[] = {
    A(FORWARD, 0, 0, -1),   A(SEND_ACT, 0, 0, 1), A(FORWARD, 0, 1, -1), A(SEND_ACT, 0, 1, 1),
    A(RECV_GRAD, 0, 0, 1),  A(RECV_GRAD, 0, 1, 1), A(BACKWARD, 0, 0, -1), A(BACKWARD, 0, 1, -1)};
static const ddp_pipeline_action good1[] = {
    A(RECV_ACT, 1, 0, 0),  A(RECV_ACT, 1, 1, 0),   A(FORWARD, 1, 0, -1), A(FORWARD, 1, 1, -1),
    A(BACKWARD, 1, 0, -1), A(SEND_GRAD, 1, 0, 0), A(BACKWARD, 1, 1, -1), A(SEND_GRAD, 1, 1, 0)};

/* Checks lists made from good0/good1 with one change; returns the status
 * and leaves the message in ddp_last_error. */
static ddp_status check_mutant(int rank, int index, ddp_pipeline_action with, bool remove,
                               int swap_with) {
  ddp_pipeline_action l0[8], l1[8];
  memcpy(l0, good0, sizeof l0);
  memcpy(l1, good1, sizeof l1);
  ddp_pipeline_action *l = rank ? l1 : l0;
  int counts[2] = {8, 8};
  if (swap_with >= 0) {
    ddp_pipeline_action t = l[index];
    l[index] = l[swap_with];
    l[swap_with] = t;
  } else if (remove) {
    memmove(&l[index], &l[index + 1], sizeof *l * (size_t)(7 - index));
    counts[rank]--;
  } else {
    l[index] = with;
  }
  const ddp_pipeline_action *lists[2] = {l0, l1};
  ddp_pipeline_schedule *s;
  assert_int_equal(ddp_pipeline_schedule_from_lists(&s, 2, 2, 1, lists, counts), DDP_OK);
  ddp_status st = ddp_pipeline_schedule_check(s, NULL);
  ddp_pipeline_schedule_destroy(s);
  return st;
}

static void expect_refused(ddp_status st, const char *words) {
  if (st == DDP_OK || !strstr(ddp_last_error(), words))
    fprintf(stderr, "status %d, message: %s (wanted '%s')\n", st, ddp_last_error(), words);
  assert_int_equal(st, DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), words));
}

static void test_checker_rejects(void **state) {
  (void)state;
  ddp_pipeline_action none = {0, 0, 0, 0};
  assert_int_equal(check_mutant(0, 0, none, false, 0), DDP_OK); /* the unbroken lists pass */
  /* Rank 1 never posts the receive of micro-batch 1's activation. */
  expect_refused(check_mutant(1, 1, none, true, -1), "no receive of its input");
  /* Rank 1 receives micro-batch 1 before 0 while rank 0 sends 0 first. */
  expect_refused(check_mutant(1, 0, AC(RECV_ACT, 1, 1, 0), false, -1), "twice");
  /* Swapped receives: the channel's order differs between the two ends. */
  {
    ddp_pipeline_action a[8], b[8];
    memcpy(a, good0, sizeof a);
    memcpy(b, good1, sizeof b);
    b[0].microbatch = 1;
    b[1].microbatch = 0;
    const ddp_pipeline_action *lists[2] = {a, b};
    int counts[2] = {8, 8};
    ddp_pipeline_schedule *s;
    assert_int_equal(ddp_pipeline_schedule_from_lists(&s, 2, 2, 1, lists, counts), DDP_OK);
    expect_refused(ddp_pipeline_schedule_check(s, NULL), "different orders");
    ddp_pipeline_schedule_destroy(s);
  }
  /* Deadlock: rank 0 waits for a gradient before it sends its activations
   * (the backward moved before the forwards' sends). */
  {
    ddp_pipeline_action a[] = {A(FORWARD, 0, 0, -1), A(RECV_GRAD, 0, 0, 1), A(RECV_GRAD, 0, 1, 1),
                               A(BACKWARD, 0, 0, -1), A(SEND_ACT, 0, 0, 1), A(FORWARD, 0, 1, -1),
                               A(SEND_ACT, 0, 1, 1),  A(BACKWARD, 0, 1, -1)};
    const ddp_pipeline_action *lists[2] = {a, good1};
    int counts[2] = {8, 8};
    ddp_pipeline_schedule *s;
    assert_int_equal(ddp_pipeline_schedule_from_lists(&s, 2, 2, 1, lists, counts), DDP_OK);
    expect_refused(ddp_pipeline_schedule_check(s, NULL), "deadlock");
    assert_non_null(strstr(ddp_last_error(), "rank 0 at action 3 (B0.0) waits for the gradient"));
    ddp_pipeline_schedule_destroy(s);
  }
  /* A duplicate forward in place of the second. */
  expect_refused(check_mutant(0, 2, AC(FORWARD, 0, 0, -1), false, -1), "runs twice");
  /* A backward before its forward: rank 1's first backward swapped ahead. */
  expect_refused(check_mutant(1, 2, none, false, 4), "backward before the forward");
  /* The wrong peer. */
  expect_refused(check_mutant(0, 1, AC(SEND_ACT, 0, 0, 0), false, -1), "not another rank");
  /* A send whose receive is missing, and a missing backward. */
  expect_refused(check_mutant(0, 7, none, true, -1), "never runs the backward");
  /* Sending an activation before computing it. */
  expect_refused(check_mutant(0, 0, none, false, 1), "before it ran");
  /* A stage on the wrong rank. */
  expect_refused(check_mutant(0, 0, AC(FORWARD, 1, 0, -1), false, -1), "lives on rank 1");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpipe_lists),      cmocka_unit_test(test_1f1b_lists),
      cmocka_unit_test(test_high_water),       cmocka_unit_test(test_interleaved_lists),
      cmocka_unit_test(test_refusals),         cmocka_unit_test(test_checker_rejects),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
