/* Helpers for the tcp backend's tests: a store server in a process of its
 * own (so no rank is forked from a process with a server thread), and
 * worlds of real rank processes that each build a tcp backend through the
 * store and run a function; results come back through shared memory. Every
 * child has an alarm and is reaped; a world that outlives its time is
 * killed. */
#ifndef DDP_TESTS_COMM_TCP_TEST_UTIL_H
#define DDP_TESTS_COMM_TCP_TEST_UTIL_H

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "comm/backend.h"
#include "ddp/store.h"

#define TT_MAX_RANKS 16

/* What a rank reports (in shared memory). */
typedef struct tt_result {
  int done;         /* the function returned */
  int failures;     /* failed checks (0: passed) */
  ddp_status status;
  int64_t t_ns;     /* free for the test: e.g. when an error was seen */
  int64_t value;    /* free for the test */
  char msg[768];
} tt_result;

/* Runs on each rank with its backend; returns normally (the harness exits). */
typedef void (*tt_rank_fn)(int rank, int size, ddp__backend *b, tt_result *res, void *arg);

typedef struct tt_world {
  int size;
  pid_t pids[TT_MAX_RANKS];
  tt_result *results; /* size entries, shared */
} tt_world;

static pid_t tt_store_pid = -1;
static uint16_t tt_store_port;
static int tt_world_counter;

static inline void tt_sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts `ddp store` serving on 127.0.0.1:<free port> in a child process. */
static inline int tt_start_store(void) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    close(fds[0]);
    alarm(600);
    ddp_store_server *srv = NULL;
    if (ddp_store_server_create("127.0.0.1", 0, NULL, &srv) != DDP_OK) _exit(3);
    uint16_t port = ddp_store_server_port(srv);
    if (write(fds[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(4);
    close(fds[1]);
    ddp_store_server_run(srv);
    _exit(0);
  }
  close(fds[1]);
  ssize_t n = read(fds[0], &tt_store_port, sizeof tt_store_port);
  close(fds[0]);
  if (n != (ssize_t)sizeof tt_store_port) return -1;
  tt_store_pid = pid;
  return 0;
}

static inline void tt_stop_store(void) {
  if (tt_store_pid > 0) {
    kill(tt_store_pid, SIGKILL);
    waitpid(tt_store_pid, NULL, 0);
    tt_store_pid = -1;
  }
}

/* Builds this rank's backend: every rank on one host (127.0.0.1). */
static inline ddp_status tt_make_backend(int rank, int size, const char *prefix,
                                         ddp_store **store_out, ddp__backend **out) {
  ddp_store *base = NULL, *store = NULL;
  ddp_store_options so = {.timeout_ms = 30000};
  ddp_status st = ddp_store_tcp_connect("127.0.0.1", tt_store_port, &so, &base);
  if (st != DDP_OK) return st;
  st = ddp_store_prefix(base, prefix, &store);
  ddp_store_destroy(base);
  if (st != DDP_OK) return st;
  static int32_t host_of[TT_MAX_RANKS], process_of[TT_MAX_RANKS];
  static const char *names[TT_MAX_RANKS];
  for (int r = 0; r < size; r++) {
    host_of[r] = 0;
    process_of[r] = r;
    names[r] = "localhost";
  }
  ddp__backend_config cfg = {.store = store, .rank = rank, .size = size, .host_of = host_of,
                             .process_of = process_of, .host_names = names,
                             .timeout_ns = 30 * 1000000000LL, .force_tcp = true};
  st = ddp__backend_tcp_create(&cfg, out);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  *store_out = store;
  return DDP_OK;
}

/* Forks `size` ranks running fn; each has an alarm of alarm_s. */
static inline int tt_spawn(tt_world *w, int size, tt_rank_fn fn, void *arg, int alarm_s) {
  memset(w, 0, sizeof *w);
  w->size = size;
  w->results = mmap(NULL, sizeof(tt_result) * (size_t)size, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (w->results == MAP_FAILED) return -1;
  memset(w->results, 0, sizeof(tt_result) * (size_t)size);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "world%d/", ++tt_world_counter);
  fflush(NULL);
  for (int r = 0; r < size; r++) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
      alarm((unsigned)alarm_s);
      ddp_log_set_rank(r);
      tt_result *res = &w->results[r];
      ddp_store *store = NULL;
      ddp__backend *b = NULL;
      ddp_status st = tt_make_backend(r, size, prefix, &store, &b);
      if (st != DDP_OK) {
        res->failures = 1;
        res->status = st;
        snprintf(res->msg, sizeof res->msg, "rank %d: creating the tcp backend: %s", r,
                 ddp_last_error());
        _exit(1);
      }
      fn(r, size, b, res, arg);
      res->done = 1;
      b->ops->destroy(b);
      ddp_store_destroy(store);
      _exit(res->failures ? 1 : 0);
    }
    w->pids[r] = pid;
  }
  return 0;
}

/* Reaps every rank (killing all once timeout_s has passed). Returns the
 * number of ranks that did not exit with 0; describes the first in err. */
static inline int tt_wait(tt_world *w, int timeout_s, char *err, size_t err_bytes) {
  int bad = 0, left = w->size;
  int status[TT_MAX_RANKS];
  bool reaped[TT_MAX_RANKS] = {0};
  int64_t deadline = ddp_time_ns() + (int64_t)timeout_s * 1000000000LL;
  err[0] = '\0';
  while (left > 0) {
    for (int r = 0; r < w->size; r++) {
      if (reaped[r]) continue;
      if (waitpid(w->pids[r], &status[r], WNOHANG) == w->pids[r]) {
        reaped[r] = true;
        left--;
      }
    }
    if (left == 0) break;
    if (ddp_time_ns() > deadline) {
      for (int r = 0; r < w->size; r++)
        if (!reaped[r]) kill(w->pids[r], SIGKILL);
      deadline = INT64_MAX;
      continue;
    }
    tt_sleep_ms(5);
  }
  for (int r = 0; r < w->size; r++) {
    bool ok = WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0;
    if (ok) continue;
    if (bad++ == 0) {
      if (WIFSIGNALED(status[r]))
        snprintf(err, err_bytes, "rank %d killed by signal %d (alarm: 14) %s", r,
                 WTERMSIG(status[r]), w->results[r].msg);
      else
        snprintf(err, err_bytes, "rank %d exited with %d: %s", r, WEXITSTATUS(status[r]),
                 w->results[r].msg);
    }
  }
  return bad;
}

/* Spawns a world of `size` ranks running fn (each with an alarm of
 * timeout_s), reaps it, and fails the test naming the first rank that did
 * not exit cleanly. The results stay in w until tt_release. */
static inline void tt_run(tt_world *w, int size, tt_rank_fn fn, void *arg, int timeout_s) {
  assert_int_equal(tt_spawn(w, size, fn, arg, timeout_s), 0);
  char err[1024];
  if (tt_wait(w, timeout_s + 10, err, sizeof err)) fail_msg("world of %d: %s", size, err);
}

/* cmocka group setup / teardown: the store process. */
static inline int tt_setup(void **state) { return tt_start_store(); }
static inline int tt_teardown(void **state) {
  tt_stop_store();
  return 0;
}

static inline void tt_release(tt_world *w) {
  if (w->results) munmap(w->results, sizeof(tt_result) * (size_t)w->size);
  w->results = NULL;
}

static inline ddp__op_ctx tt_ctx(const char *op, uint64_t seq, atomic_bool *aborted,
                                 double timeout_s) {
  ddp__op_ctx c = {.op = op, .seq = seq,
                   .deadline_ns = ddp_time_ns() + (int64_t)(timeout_s * 1e9),
                   .aborted = aborted, .tag = 0};
  return c;
}

#endif /* DDP_TESTS_COMM_TCP_TEST_UTIL_H */
