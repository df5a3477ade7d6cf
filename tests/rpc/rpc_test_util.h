/* Helpers for the RPC tests: a store server in a process of its own (so no
 * worker is forked from a process with a server thread), worlds of real
 * worker processes that each start an agent through that store and run a
 * function, results back through shared memory. Every child has an alarm
 * and is reaped; a world that outlives its time is killed. */
#ifndef DDP_TESTS_RPC_TEST_UTIL_H
#define DDP_TESTS_RPC_TEST_UTIL_H

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/rpc.h"
#include "ddp/store.h"

#define RT_MAX 16

typedef struct rt_result {
  int failures;
  int64_t value[4];  /* free for the test */
  char msg[1024];    /* the first failed check */
} rt_result;

typedef struct rt_world {
  int size;
  pid_t pids[RT_MAX];
  rt_result *results; /* shared, size entries */
} rt_world;

/* What a worker runs: agent started (NULL when opts say not to start). */
typedef void (*rt_fn)(int rank, int size, ddp_rpc_agent *agent, rt_result *res, void *arg);

static pid_t rt_store_pid = -1;
static uint16_t rt_store_port;
static int rt_world_counter;

static inline void rt_sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Records a failed check (the first message is kept) and goes on. */
#define RT_CHECK(res, cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      if ((res)->failures++ == 0) {                                                  \
        int rt_n = snprintf((res)->msg, sizeof (res)->msg, "%s:%d: %s: ", __FILE__,  \
                            __LINE__, #cond);                                        \
        if (rt_n > 0 && (size_t)rt_n < sizeof (res)->msg)                            \
          snprintf((res)->msg + rt_n, sizeof (res)->msg - (size_t)rt_n, __VA_ARGS__);\
      }                                                                              \
    }                                                                                \
  } while (0)

static inline int rt_start_store(void) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fflush(NULL);
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
  ssize_t n = read(fds[0], &rt_store_port, sizeof rt_store_port);
  close(fds[0]);
  if (n != (ssize_t)sizeof rt_store_port) return -1;
  rt_store_pid = pid;
  return 0;
}

static inline void rt_stop_store(void) {
  if (rt_store_pid > 0) {
    kill(rt_store_pid, SIGKILL);
    waitpid(rt_store_pid, NULL, 0);
    rt_store_pid = -1;
  }
}

/* How each worker starts. */
typedef struct rt_config {
  int threads;          /* pool size; 0: default */
  double timeout_s;     /* default call timeout; 0: default */
  bool graceful;        /* shutdown(graceful) after fn; else not graceful */
  bool no_shutdown;     /* fn shuts down itself (or is killed) */
  ddp_rpc_transport transport;
} rt_config;

/* The store of a new world: a fresh prefix, so worlds do not meet. */
static inline ddp_status rt_connect_store(const char *prefix, ddp_store **out) {
  ddp_store *base = NULL;
  ddp_store_options so = {.timeout_ms = 30000};
  ddp_status st = ddp_store_tcp_connect("127.0.0.1", rt_store_port, &so, &base);
  if (st != DDP_OK) return st;
  st = ddp_store_prefix(base, prefix, out);
  ddp_store_destroy(base);
  return st;
}

/* Forks `size` workers named w0, w1, ... running fn with an alarm. */
static inline int rt_spawn(rt_world *w, int size, const rt_config *cfg, rt_fn fn, void *arg,
                           int alarm_s) {
  memset(w, 0, sizeof *w);
  w->size = size;
  w->results = mmap(NULL, sizeof(rt_result) * (size_t)size, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (w->results == MAP_FAILED) return -1;
  memset(w->results, 0, sizeof(rt_result) * (size_t)size);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "world%d-%d/", (int)getpid(), ++rt_world_counter);
  fflush(NULL);
  for (int r = 0; r < size; r++) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
      alarm((unsigned)alarm_s);
      ddp_log_set_rank(r);
      rt_result *res = &w->results[r];
      ddp_store *store = NULL;
      ddp_status st = rt_connect_store(prefix, &store);
      ddp_rpc_agent *agent = NULL;
      if (st == DDP_OK) {
        char name[16];
        snprintf(name, sizeof name, "w%d", r);
        ddp_rpc_options o = ddp_rpc_defaults();
        o.name = name;
        o.rank = r;
        o.world_size = size;
        o.store = store;
        o.num_threads = cfg->threads;
        o.timeout_s = cfg->timeout_s;
        o.init_timeout_s = 30;
        o.transport = cfg->transport;
        st = ddp_rpc_init(&o, &agent);
      }
      if (st != DDP_OK) {
        res->failures++;
        snprintf(res->msg, sizeof res->msg, "worker %d: init: %s", r, ddp_last_error());
        _exit(1);
      }
      fn(r, size, agent, res, arg);
      if (!cfg->no_shutdown) {
        st = ddp_rpc_shutdown(agent, cfg->graceful, 30);
        RT_CHECK(res, st == DDP_OK, "shutdown: %s", ddp_last_error());
      }
      ddp_store_destroy(store);
      _exit(res->failures ? 1 : 0);
    }
    w->pids[r] = pid;
  }
  return 0;
}

/* Reaps every worker (killing all once timeout_s has passed). Returns how
 * many did not exit with 0 (`expect_killed` ranks may die of SIGKILL);
 * describes the first in err. */
static inline int rt_wait(rt_world *w, int timeout_s, int expect_killed, char *err,
                          size_t err_bytes) {
  int bad = 0, left = w->size;
  int status[RT_MAX] = {0};
  bool reaped[RT_MAX] = {0};
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
    rt_sleep_ms(5);
  }
  for (int r = 0; r < w->size; r++) {
    if (r == expect_killed && WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGKILL) continue;
    bool ok = WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0 && w->results[r].failures == 0;
    if (ok) continue;
    if (bad++ == 0) {
      if (WIFSIGNALED(status[r]))
        snprintf(err, err_bytes, "worker %d killed by signal %d (alarm: 14) %s", r,
                 WTERMSIG(status[r]), w->results[r].msg);
      else
        snprintf(err, err_bytes, "worker %d exited with %d: %s", r, WEXITSTATUS(status[r]),
                 w->results[r].msg);
    }
  }
  return bad;
}

/* Spawns, reaps, fails the test naming the first bad worker. */
static inline void rt_run(int size, const rt_config *cfg, rt_fn fn, void *arg, int timeout_s) {
  rt_world w;
  assert_int_equal(rt_spawn(&w, size, cfg, fn, arg, timeout_s + 5), 0);
  char err[1200];
  int bad = rt_wait(&w, timeout_s, -1, err, sizeof err);
  if (bad) fail_msg("%d of %d workers failed; %s", bad, size, err);
  munmap(w.results, sizeof(rt_result) * (size_t)size);
}

#endif /* DDP_TESTS_RPC_TEST_UTIL_H */
