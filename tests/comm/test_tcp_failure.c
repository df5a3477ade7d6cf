/* The tcp backend when things go wrong, with real rank processes: one rank
 * is SIGKILLed during a loop of allreduces and every other rank fails with
 * DDP_ERR_PEER naming it within 5 s (whatever it was waiting for); abort()
 * from another thread wakes a blocked op; the deadline names the rank
 * waited for; errors are sticky; mismatched counts are named with both
 * sizes; a rank that destroys its backend early is named as having left. */
#include <pthread.h>

#include "comm/tcp_test_util.h"

/* ---- SIGKILL during allreduces --------------------------------------------- */

typedef struct kill_args {
  int victim;
} kill_args;

/* Loops allreduces of alternating sizes (recursive doubling and ring) until
 * one fails; res->value counts the successful ones. */
static void loop_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  atomic_bool aborted;
  atomic_init(&aborted, false);
  size_t big = 256 * 1024;
  float *buf = ddp_alloc(big * sizeof(float));
  for (size_t i = 0; i < big; i++) buf[i] = 1.0f;
  for (uint64_t seq = 1; seq < 1000000; seq++) {
    size_t count = seq % 3 == 0 ? big : 16;
    ddp__op_ctx c = tt_ctx("allreduce", seq, &aborted, 60);
    ddp_status st = b->ops->blocking->allreduce(b, &c, buf, count, DDP_FLOAT32, DDP_REDUCE_MAX);
    if (st != DDP_OK) {
      res->t_ns = ddp_time_ns();
      res->status = st;
      snprintf(res->msg, sizeof res->msg, "%s", ddp_last_error());
      /* Sticky: the next op fails the same way, at once. */
      c = tt_ctx("barrier", seq + 1, &aborted, 60);
      ddp_status again = b->ops->blocking->barrier(b, &c);
      if (again != st) {
        res->failures++;
        snprintf(res->msg, sizeof res->msg, "rank %d: error not sticky: %s then %s", rank,
                 ddp_status_name(st), ddp_status_name(again));
      }
      break;
    }
    res->value = (int64_t)seq;
  }
  ddp_free(buf);
}

static void run_kill(int size, int victim) {
  tt_world w;
  assert_int_equal(tt_spawn(&w, size, loop_rank, NULL, 60), 0);
  /* Kill once everyone is well into the loop. */
  int64_t start = ddp_time_ns();
  for (;;) {
    bool ready = true;
    for (int r = 0; r < size; r++) ready = ready && w.results[r].value >= 30;
    if (ready) break;
    if (ddp_time_ns() - start > 40 * 1000000000LL) fail_msg("ranks did not start looping");
    tt_sleep_ms(2);
  }
  tt_sleep_ms(20);
  int64_t killed_at = ddp_time_ns();
  kill(w.pids[victim], SIGKILL);
  char err[1024];
  int bad = tt_wait(&w, 30, err, sizeof err);
  /* The victim died by the signal; nobody else failed the harness. */
  assert_int_equal(bad, 1);
  char want[32];
  snprintf(want, sizeof want, "rank %d (", victim);
  for (int r = 0; r < size; r++) {
    if (r == victim) continue;
    tt_result *res = &w.results[r];
    if (res->failures) fail_msg("rank %d: %s", r, res->msg);
    if (res->status != DDP_ERR_PEER)
      fail_msg("rank %d: status %s, expected DDP_ERR_PEER (%s)", r,
               ddp_status_name(res->status), res->msg);
    if (!strstr(res->msg, want) || !strstr(res->msg, "127.0.0.1:"))
      fail_msg("rank %d: the error does not name rank %d and its address: %s", r, victim,
               res->msg);
    double secs = (double)(res->t_ns - killed_at) / 1e9;
    if (secs > 5.0) fail_msg("rank %d noticed after %.2f s: %s", r, secs, res->msg);
    print_message("rank %d after %.3f s: %s\n", r, secs, res->msg);
  }
  tt_release(&w);
}

static void test_kill_one_of_4(void **state) { run_kill(4, 2); }
static void test_kill_one_of_7(void **state) { run_kill(7, 5); }
static void test_kill_rank0_of_3(void **state) { run_kill(3, 0); }

/* ---- Abort and deadlines --------------------------------------------------- */

typedef struct aborter {
  ddp__backend *b;
  atomic_bool *flag; /* set this instead of calling abort(), when not NULL */
  int delay_ms;
} aborter;

static void *abort_main(void *arg) {
  aborter *a = arg;
  tt_sleep_ms(a->delay_ms);
  if (a->flag)
    atomic_store(a->flag, true);
  else
    a->b->ops->abort(a->b);
  return NULL;
}

/* mode 0: abort() after 200 ms; 1: ctx->aborted after 200 ms; 2: a 300 ms
 * deadline. Rank 1 never joins (it waits for rank 0 to be done). */
static void stuck_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  int mode = *(int *)arg;
  atomic_bool aborted;
  atomic_init(&aborted, false);
  if (rank == 1) {
    /* Idle until rank 0 has reported (it leaves with BYE afterwards). */
    for (int i = 0; i < 1000 && !res[-1].done; i++) tt_sleep_ms(10);
    return;
  }
  float buf[1024] = {0};
  aborter a = {.b = b, .flag = mode == 1 ? &aborted : NULL, .delay_ms = 200};
  pthread_t t;
  if (mode < 2) pthread_create(&t, NULL, abort_main, &a);
  int64_t t0 = ddp_time_ns();
  ddp__op_ctx c = tt_ctx("allreduce", 7, &aborted, mode == 2 ? 0.3 : 60);
  ddp_status st = b->ops->blocking->allreduce(b, &c, buf, 1024, DDP_FLOAT32, DDP_REDUCE_SUM);
  res->t_ns = ddp_time_ns() - t0;
  res->status = st;
  snprintf(res->msg, sizeof res->msg, "%s", ddp_last_error());
  if (mode < 2) pthread_join(t, NULL);
  res->done = 1;
}

static void run_stuck(int mode, ddp_status want, const char *want_text, double max_s) {
  tt_world w;
  tt_run(&w, 2, stuck_rank, &mode, 30);
  tt_result *res = &w.results[0];
  if (res->status != want)
    fail_msg("status %s, expected %s: %s", ddp_status_name(res->status), ddp_status_name(want),
             res->msg);
  if (!strstr(res->msg, want_text)) fail_msg("message lacks \"%s\": %s", want_text, res->msg);
  if (!strstr(res->msg, "allreduce #7")) fail_msg("message lacks the op: %s", res->msg);
  double secs = (double)res->t_ns / 1e9;
  if (secs > max_s) fail_msg("took %.2f s: %s", secs, res->msg);
  print_message("after %.3f s: %s\n", secs, res->msg);
  tt_release(&w);
}

static void test_abort_wakes_op(void **state) {
  run_stuck(0, DDP_ERR_ABORTED, "aborted", 1.0);
}
static void test_abort_flag_wakes_op(void **state) {
  run_stuck(1, DDP_ERR_ABORTED, "aborted", 2.0);
}
static void test_deadline_names_peer(void **state) {
  run_stuck(2, DDP_ERR_TIMEOUT, "rank 1 (", 2.0);
}

/* ---- Mismatched calls and a rank that leaves --------------------------------- */

/* Rank 0 allreduces 100 floats, rank 1 200: both fail saying who sent how
 * many bytes. */
static void mismatch_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  atomic_bool aborted;
  atomic_init(&aborted, false);
  float buf[200] = {0};
  ddp__op_ctx c = tt_ctx("allreduce", 3, &aborted, 20);
  res->status = b->ops->blocking->allreduce(b, &c, buf, rank == 0 ? 100 : 200, DDP_FLOAT32, DDP_REDUCE_SUM);
  snprintf(res->msg, sizeof res->msg, "%s", ddp_last_error());
}

static void test_mismatched_counts(void **state) {
  tt_world w;
  tt_run(&w, 2, mismatch_rank, NULL, 30);
  const char *want[2] = {"rank 1 (localhost, 127.0.0.1:", "rank 0 (localhost, 127.0.0.1:"};
  const char *sizes[2] = {"sent 800 bytes where this rank expects 400",
                          "sent 400 bytes where this rank expects 800"};
  for (int r = 0; r < 2; r++) {
    tt_result *res = &w.results[r];
    if (res->status != DDP_ERR_INVALID || !strstr(res->msg, want[r]) ||
        !strstr(res->msg, sizes[r]) || !strstr(res->msg, "allreduce #3"))
      fail_msg("rank %d: %s: %s", r, ddp_status_name(res->status), res->msg);
    print_message("rank %d: %s\n", r, res->msg);
  }
  tt_release(&w);
}

/* Rank 2 destroys its backend at once; the others' allreduce fails naming
 * it as having left (directly, or reported by the rank that saw it). */
static void leaver_rank(int rank, int size, ddp__backend *b, tt_result *res, void *arg) {
  if (rank == 2) return;
  atomic_bool aborted;
  atomic_init(&aborted, false);
  float buf[4] = {1, 2, 3, 4};
  ddp__op_ctx c = tt_ctx("allreduce", 1, &aborted, 20);
  int64_t t0 = ddp_time_ns();
  res->status = b->ops->blocking->allreduce(b, &c, buf, 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  res->t_ns = ddp_time_ns() - t0;
  snprintf(res->msg, sizeof res->msg, "%s", ddp_last_error());
}

static void test_peer_left(void **state) {
  tt_world w;
  tt_run(&w, 3, leaver_rank, NULL, 30);
  for (int r = 0; r < 2; r++) {
    tt_result *res = &w.results[r];
    if (res->status != DDP_ERR_PEER || !strstr(res->msg, "rank 2 (") ||
        !strstr(res->msg, "left the group"))
      fail_msg("rank %d: %s: %s", r, ddp_status_name(res->status), res->msg);
    if (res->t_ns > 5000000000LL) fail_msg("rank %d took %.1f s", r, (double)res->t_ns / 1e9);
    print_message("rank %d: %s\n", r, res->msg);
  }
  tt_release(&w);
}


int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kill_one_of_4),       cmocka_unit_test(test_kill_one_of_7),
      cmocka_unit_test(test_kill_rank0_of_3),     cmocka_unit_test(test_abort_wakes_op),
      cmocka_unit_test(test_abort_flag_wakes_op), cmocka_unit_test(test_deadline_names_peer),
      cmocka_unit_test(test_mismatched_counts),   cmocka_unit_test(test_peer_left),
  };
  return cmocka_run_group_tests(tests, tt_setup, tt_teardown);
}
