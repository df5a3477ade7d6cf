/* Running local-backend ranks as real processes: a store server in a
 * process of its own (so no rank is forked from a process with a server
 * thread), and ranks forked from the test, each with an alarm, connecting
 * to it and creating the backend with one process per rank. Every child is
 * reaped; none outlives its test. */
#ifndef DDP_TESTS_COMM_LOCAL_PROC_UTIL_H
#define DDP_TESTS_COMM_LOCAL_PROC_UTIL_H

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/backend.h"
#include "ddp/store.h"

typedef struct lp_server {
  pid_t pid;
  uint16_t port;
} lp_server;

static inline int lp_server_start(lp_server *s) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  s->pid = fork();
  if (s->pid < 0) return -1;
  if (s->pid == 0) {
    close(fds[0]);
    alarm(600);
    ddp_store_server *srv = NULL;
    if (ddp_store_server_create("127.0.0.1", 0, NULL, &srv) != DDP_OK) _exit(1);
    uint16_t port = ddp_store_server_port(srv);
    if (write(fds[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(1);
    close(fds[1]);
    ddp_store_server_run(srv);
    _exit(0);
  }
  close(fds[1]);
  ssize_t n = read(fds[0], &s->port, sizeof s->port);
  close(fds[0]);
  return n == (ssize_t)sizeof s->port ? 0 : -1;
}

static inline void lp_server_stop(lp_server *s) {
  if (s->pid > 0) {
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
  }
}

/* The test program's server, started and stopped around its tests by the
 * cmocka group fixtures below. */
static lp_server lp_the_server;

static inline int lp_group_setup(void **state) {
  (void)state;
  return lp_server_start(&lp_the_server);
}

static inline int lp_group_teardown(void **state) {
  (void)state;
  lp_server_stop(&lp_the_server);
  return 0;
}

/* In a child: connects to the server and creates rank `rank` of `size`
 * under the store prefix `prefix`, ranks being `per_process` threads of
 * each process (rank / per_process is the process). Exits on failure. */
static inline ddp__backend *lp_backend(const lp_server *s, const char *prefix, int rank, int size,
                                       int per_process, ddp_store **store_out) {
  ddp_store_options o = {.timeout_ms = 30000};
  ddp_store *base = NULL, *store = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", s->port, &o, &base) != DDP_OK ||
      ddp_store_prefix(base, prefix, &store) != DDP_OK) {
    fprintf(stderr, "rank %d: store: %s\n", rank, ddp_last_error());
    _exit(10);
  }
  ddp_store_destroy(base);
  int32_t host_of[64] = {0}, process_of[64];
  for (int q = 0; q < size; q++) process_of[q] = q / per_process;
  ddp__backend_config cfg = {.store = store, .rank = rank, .size = size, .host_of = host_of,
                             .process_of = process_of, .host_names = NULL,
                             .timeout_ns = 30 * 1000000000LL};
  ddp__backend *b = NULL;
  if (ddp__backend_local_create(&cfg, &b) != DDP_OK) {
    fprintf(stderr, "rank %d of %d: create: %s\n", rank, size, ddp_last_error());
    _exit(11);
  }
  *store_out = store;
  return b;
}

/* One process per rank. */
static inline ddp__backend *lp_child_backend(const lp_server *s, const char *prefix, int rank,
                                             int size, ddp_store **store_out) {
  return lp_backend(s, prefix, rank, size, 1, store_out);
}

/* Forks `size` ranks running body(rank, size, arg) -> exit code, each under
 * an alarm of alarm_s. pids[] (size entries) receives the children. */
/* When the latest lp_spawn began (CLOCK_REALTIME, as file times are). */
static struct timespec lp_spawned_at;

static inline void lp_spawn(int size, int alarm_s, int (*body)(int, int, void *), void *arg,
                            pid_t *pids) {
  clock_gettime(CLOCK_REALTIME, &lp_spawned_at);
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < size; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm((unsigned)alarm_s);
      _exit(body(r, size, arg));
    }
  }
}

/* Reaps every child; returns how many did not exit with status 0 (printing
 * each). */
static inline int lp_reap(int size, const pid_t *pids) {
  int bad = 0;
  for (int r = 0; r < size; r++) {
    int status = 0;
    if (pids[r] <= 0 || waitpid(pids[r], &status, 0) != pids[r]) {
      bad++;
      continue;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    bad++;
    if (WIFSIGNALED(status))
      fprintf(stderr, "rank %d: killed by signal %d\n", r, WTERMSIG(status));
    else
      fprintf(stderr, "rank %d: exit status %d\n", r, WEXITSTATUS(status));
  }
  return bad;
}

/* A pipe on which each rank reports that it is up (one byte), so a test
 * kills ranks only once every rank is past creation, however loaded the
 * machine. */
static int lp_ready_pipe[2] = {-1, -1};

static inline void lp_ready_open(void) {
  if (pipe(lp_ready_pipe) != 0) lp_ready_pipe[0] = lp_ready_pipe[1] = -1;
}

static inline void lp_ready_signal(void) {
  char c = 1;
  if (lp_ready_pipe[1] >= 0 && write(lp_ready_pipe[1], &c, 1) != 1) _exit(12);
}

/* Waits (at most 60 s) for n ranks' bytes; closes the pipe. 0 on success. */
static inline int lp_ready_wait(int n) {
  int got = 0;
  int64_t deadline = ddp_time_ns() + 60 * 1000000000LL;
  close(lp_ready_pipe[1]);
  while (got < n && ddp_time_ns() < deadline) {
    char c;
    ssize_t r = read(lp_ready_pipe[0], &c, 1);
    if (r == 1) got++;
    else if (r == 0) break;
  }
  close(lp_ready_pipe[0]);
  lp_ready_pipe[0] = lp_ready_pipe[1] = -1;
  return got == n ? 0 : -1;
}

/* Segments in /dev/shm created by the local backend in process pid. */
static inline int lp_count_segments(pid_t pid) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "ddp-local-%d-", (int)pid);
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
    /* Pids recycle (pid_max is 32768 here): a segment left by a SIGKILLed
     * process of an earlier test that had this pid is older than the spawn
     * and not this rank's. */
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, 0) == 0 &&
        (st.st_mtim.tv_sec < lp_spawned_at.tv_sec ||
         (st.st_mtim.tv_sec == lp_spawned_at.tv_sec && st.st_mtim.tv_nsec < lp_spawned_at.tv_nsec)))
      continue;
    n++;
  }
  closedir(d);
  return n;
}

/* After rank `victim` of n forked ranks was SIGKILLed at killed_at
 * (ddp_time_ns()): reaps the victim and every other rank, each of which must
 * exit 0 (its test body saw the failure it expected). A rank still running
 * 10 s after the kill is SIGKILLed and counted. Returns the number of bad
 * ranks; *slowest gets the latest exit, in seconds after the kill. */
static inline int lp_reap_after_kill(const pid_t *pids, int n, int victim, int64_t killed_at,
                                     double *slowest) {
  int status = 0, bad = 0;
  waitpid(pids[victim], &status, 0);
  *slowest = 0;
  for (int r = 0; r < n; r++) {
    if (r == victim) continue;
    while (waitpid(pids[r], &status, WNOHANG) == 0) {
      if (ddp_time_ns() - killed_at > 10 * 1000000000LL) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &status, 0);
        fprintf(stderr, "rank %d still running 10 s after the kill\n", r);
        bad++;
        break;
      }
      struct timespec s = {0, 1000000L};
      nanosleep(&s, NULL);
    }
    double t = (double)(ddp_time_ns() - killed_at) * 1e-9;
    if (t > *slowest) *slowest = t;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "rank %d: status %d\n", r, status);
      bad++;
    }
  }
  return bad;
}

#endif /* DDP_TESTS_COMM_LOCAL_PROC_UTIL_H */
