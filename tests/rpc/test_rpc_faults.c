/* RPC faults: a call to a function that is not registered, with a payload
 * the handler refuses, or past its timeout fails that call alone (the next
 * works) with a message naming the worker and the function; a worker killed
 * with SIGKILL fails every call to it, in flight and new, within 5 s naming
 * it as dead (also when it was killed inside its own graceful shutdown), and
 * a graceful shutdown of the others still ends, naming it; a graceful
 * shutdown waits for this worker's outstanding calls; an abrupt one is
 * reported to its callers as such. */
#include <stdatomic.h>

#include "rpc_test_handlers.h"
#include "rpc_test_util.h"

static bool has(const char *msg, const char *what) { return strstr(msg, what) != NULL; }

/* A working call, to show the failure before it left nothing broken. */
static void works(ddp_rpc_agent *a, const char *to, rt_result *res) {
  int64_t ms = 0;
  ddp_rpc_message m = {.payload = &ms, .payload_bytes = 8}, out;
  ddp_status st = ddp_rpc_sync(a, to, "slow", &m, 10, &out);
  RT_CHECK(res, st == DDP_OK && out.payload_bytes == 8, "the call after a failure: %s",
           ddp_last_error());
  ddp_rpc_message_free(&out);
}

static void call_faults_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank != 0) return; /* w1 serves */
  ddp_rpc_message m = {.payload = "xyz", .payload_bytes = 3}, out;

  ddp_status st = ddp_rpc_sync(a, "w1", "no_such_fn", &m, 10, &out);
  const char *e = ddp_last_error();
  RT_CHECK(res, st == DDP_ERR_NOTFOUND, "unregistered: %s", ddp_status_name(st));
  RT_CHECK(res, has(e, "'w1'") && has(e, "'no_such_fn'") && has(e, "not registered"), "message: %s", e);
  RT_CHECK(res, out.num_tensors == 0 && out.payload == NULL, "result zeroed on failure");
  works(a, "w1", res);

  st = ddp_rpc_sync(a, "w1", "scale", &m, 10, &out);
  e = ddp_last_error();
  RT_CHECK(res, st == DDP_ERR_INVALID, "refused payload: %s", ddp_status_name(st));
  RT_CHECK(res, has(e, "'w1'") && has(e, "'scale'") && has(e, "payload of 3 bytes, expected 8"),
           "message: %s", e);
  works(a, "w1", res);

  /* Past its timeout: 0.2 s against a handler that takes 1.5 s. */
  int64_t ms = 1500;
  ddp_rpc_message slow = {.payload = &ms, .payload_bytes = 8};
  int64_t t0 = ddp_time_ns();
  st = ddp_rpc_sync(a, "w1", "slow", &slow, 0.2, &out);
  double took = (double)(ddp_time_ns() - t0) / 1e9;
  e = ddp_last_error();
  RT_CHECK(res, st == DDP_ERR_TIMEOUT, "timeout: %s", ddp_status_name(st));
  RT_CHECK(res, has(e, "'w1'") && has(e, "'slow'") && has(e, "timed out after 0.2 s"), "message: %s", e);
  RT_CHECK(res, took >= 0.2 && took < 1.4, "timed out after %.3f s", took);
  works(a, "w1", res); /* while the slow handler still runs there */

  /* A future's own wait may time out first; the call then stays pending. */
  ddp_rpc_future *f;
  ms = 300;
  RT_CHECK(res, ddp_rpc_async(a, "w1", "slow", &slow, 10, &f) == DDP_OK, "%s", ddp_last_error());
  st = ddp_rpc_future_wait(f, 0.01);
  RT_CHECK(res, st == DDP_ERR_TIMEOUT && !ddp_rpc_future_done(f), "short wait: %s", ddp_status_name(st));
  RT_CHECK(res, ddp_rpc_future_wait(f, 10) == DDP_OK, "then completes: %s", ddp_last_error());
  ddp_rpc_future_destroy(f);

  /* The default timeout (the agent's, set to 0.5 s in this world). */
  ms = 2000;
  t0 = ddp_time_ns();
  st = ddp_rpc_sync(a, "w1", "slow", &slow, DDP_RPC_DEFAULT_TIMEOUT, NULL);
  took = (double)(ddp_time_ns() - t0) / 1e9;
  RT_CHECK(res, st == DDP_ERR_TIMEOUT && took >= 0.5 && took < 1.9, "default timeout: %s after %.3f s",
           ddp_status_name(st), took);
  works(a, "w1", res);
}

static void test_call_faults(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true, .timeout_s = 0.5};
  rt_run(2, &cfg, call_faults_fn, NULL, 60);
}

/* ---- SIGKILL ----------------------------------------------------------------------- */

static int64_t *kill_time_ns; /* shared: when w2 killed itself */

static ddp_status h_die(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                        void *user) {
  (void)call, (void)args, (void)reply, (void)user;
  rt_sleep_ms(300); /* let the others' slow calls arrive */
  *kill_time_ns = ddp_time_ns();
  kill(getpid(), SIGKILL);
  return DDP_OK;
}

static void kill_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank == 2) {
    /* Serve until killed (by its own "die" handler). */
    rt_sleep_ms(30000);
    RT_CHECK(res, false, "w2 was not killed");
    return;
  }
  int64_t ms = 20000;
  ddp_rpc_message slow = {.payload = &ms, .payload_bytes = 8};
  ddp_rpc_future *inflight[3], *die = NULL;
  for (int i = 0; i < 3; i++)
    RT_CHECK(res, ddp_rpc_async(a, "w2", "slow", &slow, 30, &inflight[i]) == DDP_OK, "%s", ddp_last_error());
  if (rank == 0) RT_CHECK(res, ddp_rpc_async(a, "w2", "die", NULL, 30, &die) == DDP_OK, "%s", ddp_last_error());
  for (int i = 0; i < 3; i++) {
    ddp_status st = ddp_rpc_future_wait(inflight[i], 20);
    int64_t now = ddp_time_ns();
    const char *e = ddp_rpc_future_error(inflight[i]);
    RT_CHECK(res, st == DDP_ERR_CLOSED, "in-flight call %d: %s (%s)", i, ddp_status_name(st), e);
    RT_CHECK(res, has(e, "'w2'") && has(e, "'slow'"), "message: %s", e);
    /* A death is a death, not a shutdown. */
    RT_CHECK(res, has(e, "worker 'w2' (rank 2) died or cannot be reached") && !has(e, "shut down"),
             "message: %s", e);
    RT_CHECK(res, *kill_time_ns > 0 && now - *kill_time_ns < 5000000000LL,
             "failed %.3f s after the kill", (double)(now - *kill_time_ns) / 1e9);
    ddp_rpc_future_destroy(inflight[i]);
  }
  if (die) {
    RT_CHECK(res, ddp_rpc_future_wait(die, 10) == DDP_ERR_CLOSED, "the die call");
    ddp_rpc_future_destroy(die);
  }
  /* New calls fail at once, naming it. */
  int64_t t0 = ddp_time_ns();
  ddp_status st = ddp_rpc_sync(a, "w2", "echo", NULL, 10, NULL);
  RT_CHECK(res, st == DDP_ERR_CLOSED && has(ddp_last_error(), "'echo'") &&
                    has(ddp_last_error(), "worker 'w2' (rank 2) died or cannot be reached") &&
                    !has(ddp_last_error(), "shut down"),
           "new call: %s: %s", ddp_status_name(st), ddp_last_error());
  RT_CHECK(res, ddp_time_ns() - t0 < 1000000000LL, "a new call took %.3f s",
           (double)(ddp_time_ns() - t0) / 1e9);
  /* The survivors still talk. */
  works(a, rank ? "w0" : "w1", res);
  /* A graceful shutdown ends, naming the dead worker. */
  t0 = ddp_time_ns();
  st = ddp_rpc_shutdown(a, true, 20);
  const char *e = ddp_last_error();
  RT_CHECK(res, st == DDP_ERR_PEER, "shutdown: %s: %s", ddp_status_name(st), e);
  const char *dead = strstr(e, "without");
  RT_CHECK(res, dead && has(dead, "'w2'") && has(dead, "died") && !has(dead, "'w0'") &&
                    !has(dead, "'w1'"),
           "shutdown message: %s", e);
  RT_CHECK(res, ddp_time_ns() - t0 < 10000000000LL, "shutdown took %.3f s", (double)(ddp_time_ns() - t0) / 1e9);
}

static void test_sigkill(void **state) {
  (void)state;
  kill_time_ns = mmap(NULL, sizeof *kill_time_ns, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  *kill_time_ns = 0;
  rt_config cfg = {.threads = 8, .no_shutdown = true};
  rt_world w;
  assert_int_equal(rt_spawn(&w, 3, &cfg, kill_fn, NULL, 65), 0);
  char err[1200];
  int bad = rt_wait(&w, 60, 2, err, sizeof err);
  if (bad) fail_msg("%d workers failed; %s", bad, err);
  assert_true(*kill_time_ns > 0);
  munmap(w.results, sizeof(rt_result) * 3);
  munmap(kill_time_ns, sizeof *kill_time_ns);
}

/* ---- SIGKILL during a graceful shutdown -------------------------------------------- */

/* w1 starts a graceful shutdown (it sends DONE at once, then keeps serving
 * while it waits for w0's DONE) and is killed while serving w0's call: w0
 * must hear of a death, not of a shutdown (before BYE, a close after DONE
 * read as "has shut down" and the dead worker's state was never cleaned). */
static atomic_int *shutdown_begun; /* shared: w1 is inside ddp_rpc_shutdown */

static ddp_status h_die_in_shutdown(ddp_rpc_call *call, const ddp_rpc_message *args,
                                    ddp_rpc_message *reply, void *user) {
  (void)call, (void)args, (void)reply, (void)user;
  for (int i = 0; i < 10000 && !atomic_load(shutdown_begun); i++) rt_sleep_ms(1);
  rt_sleep_ms(300); /* its DONE is out by now */
  *kill_time_ns = ddp_time_ns();
  kill(getpid(), SIGKILL);
  return DDP_OK;
}

static void die_in_shutdown_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank == 1) {
    rt_sleep_ms(100); /* w0's call arrives first */
    atomic_store(shutdown_begun, 1);
    ddp_rpc_shutdown(a, true, 30);
    RT_CHECK(res, false, "w1 was not killed");
    return;
  }
  ddp_rpc_future *f;
  RT_CHECK(res, ddp_rpc_async(a, "w1", "die_in_shutdown", NULL, 30, &f) == DDP_OK, "%s",
           ddp_last_error());
  ddp_status st = ddp_rpc_future_wait(f, 20);
  int64_t now = ddp_time_ns();
  const char *e = ddp_rpc_future_error(f);
  RT_CHECK(res, st == DDP_ERR_CLOSED, "the call: %s (%s)", ddp_status_name(st), e);
  RT_CHECK(res, has(e, "'die_in_shutdown'") &&
                    has(e, "worker 'w1' (rank 1) died or cannot be reached") && !has(e, "shut down"),
           "message: %s", e);
  RT_CHECK(res, *kill_time_ns > 0 && now - *kill_time_ns < 5000000000LL,
           "failed %.3f s after the kill", (double)(now - *kill_time_ns) / 1e9);
  ddp_rpc_future_destroy(f);
  st = ddp_rpc_shutdown(a, true, 20);
  e = ddp_last_error();
  RT_CHECK(res, st == DDP_ERR_PEER && has(e, "without the workers that died: worker 'w1' (rank 1) died"),
           "shutdown: %s: %s", ddp_status_name(st), e);
}

static void test_sigkill_in_shutdown(void **state) {
  (void)state;
  kill_time_ns = mmap(NULL, sizeof *kill_time_ns, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  shutdown_begun = mmap(NULL, sizeof *shutdown_begun, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  *kill_time_ns = 0;
  atomic_init(shutdown_begun, 0);
  rt_config cfg = {.threads = 4, .no_shutdown = true};
  rt_world w;
  assert_int_equal(rt_spawn(&w, 2, &cfg, die_in_shutdown_fn, NULL, 65), 0);
  char err[1200];
  int bad = rt_wait(&w, 60, 1, err, sizeof err);
  if (bad) fail_msg("%d workers failed; %s", bad, err);
  assert_true(*kill_time_ns > 0);
  munmap(w.results, sizeof(rt_result) * 2);
  munmap(kill_time_ns, sizeof *kill_time_ns);
  munmap(shutdown_begun, sizeof *shutdown_begun);
}

/* ---- Graceful shutdown with work outstanding ---------------------------------------- */

static atomic_int *served; /* shared: slow calls completed on w1 */

static ddp_status h_counted_slow(ddp_rpc_call *call, const ddp_rpc_message *args,
                                 ddp_rpc_message *reply, void *user) {
  ddp_status st = h_slow(call, args, reply, user);
  atomic_fetch_add(served, 1);
  return st;
}

static void outstanding_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank == 1) {
    /* Shuts down at once: must keep serving w0 until w0 is done too. */
    ddp_status st = ddp_rpc_shutdown(a, true, 30);
    RT_CHECK(res, st == DDP_OK, "w1 shutdown: %s", ddp_last_error());
    RT_CHECK(res, atomic_load(served) == 4, "w1 left after serving %d of 4", atomic_load(served));
    return;
  }
  int64_t ms = 400;
  ddp_rpc_message slow = {.payload = &ms, .payload_bytes = 8};
  ddp_rpc_future *fs[4];
  for (int i = 0; i < 4; i++)
    RT_CHECK(res, ddp_rpc_async(a, "w1", "counted_slow", &slow, 30, &fs[i]) == DDP_OK, "%s", ddp_last_error());
  int64_t t0 = ddp_time_ns();
  ddp_status st = ddp_rpc_shutdown(a, true, 30);
  RT_CHECK(res, st == DDP_OK, "w0 shutdown: %s", ddp_last_error());
  RT_CHECK(res, ddp_time_ns() - t0 >= 400 * 1000000LL, "shutdown returned before the calls ended");
  for (int i = 0; i < 4; i++) {
    RT_CHECK(res, ddp_rpc_future_done(fs[i]) && ddp_rpc_future_status(fs[i]) == DDP_OK,
             "call %d after shutdown: %s", i, ddp_rpc_future_error(fs[i]));
    ddp_rpc_future_destroy(fs[i]);
  }
}

static void test_graceful_outstanding(void **state) {
  (void)state;
  served = mmap(NULL, sizeof *served, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  atomic_init(served, 0);
  rt_config cfg = {.threads = 4, .no_shutdown = true};
  rt_run(2, &cfg, outstanding_fn, NULL, 60);
  munmap(served, sizeof *served);
}

/* Not graceful: pending calls fail at once with "shut down". */
static void abrupt_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank == 1) {
    rt_sleep_ms(1500);
    ddp_rpc_shutdown(a, false, 0);
    return;
  }
  int64_t ms = 1000;
  ddp_rpc_message slow = {.payload = &ms, .payload_bytes = 8};
  ddp_rpc_future *f;
  RT_CHECK(res, ddp_rpc_async(a, "w1", "slow", &slow, 30, &f) == DDP_OK, "%s", ddp_last_error());
  int64_t t0 = ddp_time_ns();
  ddp_rpc_shutdown(a, false, 0);
  RT_CHECK(res, ddp_time_ns() - t0 < 900 * 1000000LL, "abrupt shutdown waited %.3f s",
           (double)(ddp_time_ns() - t0) / 1e9);
  RT_CHECK(res, ddp_rpc_future_status(f) == DDP_ERR_STATE && has(ddp_rpc_future_error(f), "shut down"),
           "pending call: %s", ddp_rpc_future_error(f));
  ddp_rpc_future_destroy(f);
}

static void test_abrupt_shutdown(void **state) {
  (void)state;
  rt_config cfg = {.no_shutdown = true};
  rt_run(2, &cfg, abrupt_fn, NULL, 60);
}

/* The other side of it: a worker that shuts down abruptly is reported as
 * such to the calls it leaves pending, neither as dead nor as gracefully
 * gone. */
static void peer_abrupt_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  if (rank == 1) {
    rt_sleep_ms(300); /* w0's call is being served */
    ddp_rpc_shutdown(a, false, 0);
    return;
  }
  int64_t ms = 3000;
  ddp_rpc_message slow = {.payload = &ms, .payload_bytes = 8};
  ddp_rpc_future *f;
  RT_CHECK(res, ddp_rpc_async(a, "w1", "slow", &slow, 30, &f) == DDP_OK, "%s", ddp_last_error());
  ddp_status st = ddp_rpc_future_wait(f, 20);
  const char *e = ddp_rpc_future_error(f);
  RT_CHECK(res, st == DDP_ERR_CLOSED && has(e, "'slow'") &&
                    has(e, "worker 'w1' (rank 1) stopped without a graceful shutdown") &&
                    !has(e, "died"),
           "pending call: %s: %s", ddp_status_name(st), e);
  ddp_rpc_future_destroy(f);
  ddp_rpc_shutdown(a, false, 0);
}

static void test_peer_abrupt_shutdown(void **state) {
  (void)state;
  rt_config cfg = {.threads = 2, .no_shutdown = true};
  rt_run(2, &cfg, peer_abrupt_fn, NULL, 60);
}

static int setup(void **state) {
  (void)state;
  register_test_handlers();
  ddp_rpc_register("die", h_die, NULL);
  ddp_rpc_register("counted_slow", h_counted_slow, NULL);
  ddp_rpc_register("die_in_shutdown", h_die_in_shutdown, NULL);
  return rt_start_store();
}

static int teardown(void **state) {
  (void)state;
  rt_stop_store();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_call_faults),
      cmocka_unit_test(test_sigkill),
      cmocka_unit_test(test_sigkill_in_shutdown),
      cmocka_unit_test(test_graceful_outstanding),
      cmocka_unit_test(test_abrupt_shutdown),
      cmocka_unit_test(test_peer_abrupt_shutdown),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
