/* rendezvous join: real ranks as forked processes meeting through env://
 * (rank 0 hosting), DDP_STORE_ADDR (a server this test runs), tcp:// and
 * file://, with torchrun-, Slurm- and MPI-style variables; and the failures
 * users hit: a missing rank, a port in use, a server that starts late, a
 * duplicate rank, disagreeing world sizes, an unreachable store. Loopback
 * only. Every child has an alarm and is killed and reaped by the parent. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/rendezvous.h"
#include "ddp/store.h"
#include "rendezvous/rdzv_test_env.h"

#define MAX_RANKS 8

/* What a child does: its environment, URL, options, and a start delay. */
typedef struct rank_spec {
  char env[1024];
  const char *url;
  int32_t opt_rank, opt_world;
  double opt_timeout;
  int delay_ms;
  const char *stderr_path; /* where the child's log lines go, or NULL */
} rank_spec;

/* What a child reports back through its pipe. */
typedef struct rank_result {
  int reported;
  int exit_status; /* the child's wait status: 0 unless it crashed or leaked */
  int status;
  int32_t rank, world_size, local_rank, local_world_size, num_hosts, host_index;
  int32_t rank_host[MAX_RANKS];
  int hosted, external;
  int64_t store_timeout_ms; /* the returned store's default timeout */
  char sources[96];
  char store_addr[DDP_RENDEZVOUS_STORE_ADDR_BYTES];
  char master[300];
  double elapsed_s;
  int store_ok; /* every rank's key was readable through the returned store */
  char error[1024];
} rank_result;

static uint16_t free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0)
    abort();
  close(fd);
  return ntohs(a.sin_port);
}

/* After a successful rendezvous: exchange keys with every peer through the
 * returned store, then leave in order (rank 0, which may host the server,
 * last). */
static int use_store(const ddp_rendezvous_info *info) {
  char key[64], val[32];
  snprintf(key, sizeof key, "test/hello/%d", (int)info->rank);
  int n = snprintf(val, sizeof val, "%d", (int)info->rank * 7);
  if (ddp_store_set(info->store, key, val, (size_t)n)) return 0;
  for (int r = 0; r < info->world_size; r++) {
    void *v = NULL;
    size_t bytes;
    snprintf(key, sizeof key, "test/hello/%d", r);
    if (ddp_store_get(info->store, key, 10000, &v, &bytes)) return 0;
    int ok = atoi(v) == r * 7;
    ddp_free(v);
    if (!ok) return 0;
  }
  if (info->rank != 0) {
    snprintf(key, sizeof key, "test/bye/%d", (int)info->rank);
    return ddp_store_set(info->store, key, "", 0) == DDP_OK;
  }
  for (int r = 1; r < info->world_size; r++) {
    snprintf(key, sizeof key, "test/bye/%d", r);
    const char *k = key;
    if (ddp_store_wait(info->store, &k, 1, 10000)) return 0;
  }
  return 1;
}

static void child(const rank_spec *spec, int fd) {
  alarm(30); /* a hung child dies on its own as well */
  if (spec->stderr_path && !freopen(spec->stderr_path, "w", stderr)) exit(4);
  rdzv_test_clear_env();
  rdzv_test_apply_env(spec->env);
  if (spec->delay_ms) usleep((useconds_t)spec->delay_ms * 1000);
  ddp_rendezvous_options opts = ddp_rendezvous_defaults();
  opts.rank = spec->opt_rank;
  opts.world_size = spec->opt_world;
  opts.timeout_s = spec->opt_timeout;
  rank_result res;
  memset(&res, 0, sizeof res);
  ddp_rendezvous_info info;
  double t0 = ddp_time_s();
  res.status = ddp_rendezvous(spec->url, &opts, &info);
  res.elapsed_s = ddp_time_s() - t0;
  res.reported = 1;
  if (res.status) {
    snprintf(res.error, sizeof res.error, "%s", ddp_last_error());
  } else {
    res.rank = info.rank;
    res.world_size = info.world_size;
    res.local_rank = info.local_rank;
    res.local_world_size = info.local_world_size;
    res.num_hosts = info.num_hosts;
    res.host_index = info.host_index;
    for (int r = 0; r < info.world_size && r < MAX_RANKS; r++) res.rank_host[r] = info.rank_host[r];
    res.hosted = info.server != NULL;
    res.external = info.store_is_external;
    res.store_timeout_ms = ddp_store_timeout_ms(info.store);
    snprintf(res.sources, sizeof res.sources, "%s/%s/%s/%s/%s",
             ddp_rendezvous_source_name(info.rank_source),
             ddp_rendezvous_source_name(info.world_size_source),
             ddp_rendezvous_source_name(info.local_rank_source),
             ddp_rendezvous_source_name(info.local_world_size_source),
             ddp_rendezvous_source_name(info.master_source));
    snprintf(res.store_addr, sizeof res.store_addr, "%s", info.store_addr);
    snprintf(res.master, sizeof res.master, "%s:%d", info.master_addr, (int)info.master_port);
    res.store_ok = use_store(&info);
    ddp_rendezvous_info_destroy(&info);
  }
  ssize_t w = write(fd, &res, sizeof res);
  close(fd);
  /* exit, not _exit: under the sanitizer build LeakSanitizer checks the child too. */
  exit(w == (ssize_t)sizeof res ? 0 : 3);
}

/* Forks one child per spec, collects their results, and kills whatever is
 * still running after `limit_s`. Every child is reaped. */
static void run_ranks(int n, const rank_spec *specs, rank_result *results, double limit_s) {
  pid_t pids[MAX_RANKS];
  int fds[MAX_RANKS];
  size_t got[MAX_RANKS] = {0};
  assert_true(n <= MAX_RANKS);
  memset(results, 0, sizeof *results * (size_t)n);
  fflush(NULL);
  for (int i = 0; i < n; i++) {
    int p[2];
    assert_int_equal(pipe(p), 0);
    pids[i] = fork();
    assert_true(pids[i] >= 0);
    if (pids[i] == 0) {
      close(p[0]);
      for (int j = 0; j < i; j++) close(fds[j]);
      child(&specs[i], p[1]);
    }
    close(p[1]);
    fds[i] = p[0];
  }
  double deadline = ddp_time_s() + limit_s;
  int open_count = n;
  while (open_count > 0 && ddp_time_s() < deadline) {
    struct pollfd pfd[MAX_RANKS];
    for (int i = 0; i < n; i++) {
      pfd[i].fd = fds[i];
      pfd[i].events = POLLIN;
      pfd[i].revents = 0;
    }
    int ready = poll(pfd, (nfds_t)n, 50);
    if (ready < 0 && errno != EINTR) break;
    for (int i = 0; i < n; i++) {
      if (fds[i] < 0 || !(pfd[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t r = read(fds[i], (char *)&results[i] + got[i], sizeof results[i] - got[i]);
      if (r > 0) got[i] += (size_t)r;
      if (r <= 0 || got[i] == sizeof results[i]) {
        close(fds[i]);
        fds[i] = -1;
        open_count--;
      }
    }
  }
  for (int i = 0; i < n; i++) {
    if (fds[i] >= 0) close(fds[i]);
    if (got[i] != sizeof results[i]) {
      results[i].reported = 0;
      kill(pids[i], SIGKILL);
    }
    int st = 0;
    while (waitpid(pids[i], &st, 0) < 0 && errno == EINTR) {
    }
    results[i].exit_status = st;
  }
}

static void spec(rank_spec *s, const char *url, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void spec(rank_spec *s, const char *url, const char *fmt, ...) {
  memset(s, 0, sizeof *s);
  s->url = url;
  s->opt_rank = -1;
  s->opt_world = -1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->env, sizeof s->env, fmt, ap);
  va_end(ap);
}

static void expect_ok(const rank_result *r, int n) {
  for (int i = 0; i < n; i++) {
    if (!r[i].reported) fail_msg("child %d did not report (killed after the time limit)", i);
    if (r[i].exit_status != 0) fail_msg("child %d exited with wait status %#x", i, r[i].exit_status);
    if (r[i].status) fail_msg("child %d failed: %s", i, r[i].error);
    if (!r[i].store_ok) fail_msg("child %d: the returned store did not work", i);
  }
}

static void expect_error(const rank_result *r, const char *who, const char *text) {
  if (!r->reported) fail_msg("%s did not report (killed after the time limit)", who);
  if (r->exit_status != 0) fail_msg("%s exited with wait status %#x", who, r->exit_status);
  if (r->status == DDP_OK) fail_msg("%s succeeded; expected an error containing '%s'", who, text);
  if (!strstr(r->error, text)) fail_msg("%s: error '%s' lacks '%s'", who, r->error, text);
  if (getenv("DDP_TEST_VERBOSE")) fprintf(stderr, "  %s: %s\n", who, r->error);
}

/* A launcher's store in a process of its own: the ranks are forked from this
 * process, and forking while a server thread runs here could hand a child a
 * lock that thread held. Returns the server's pid; *port is where it listens
 * and *control the pipe whose closing stops it. */
static pid_t start_store_process(const char *token, uint16_t *port, int *control) {
  int up[2], down[2];
  assert_int_equal(pipe(up), 0);
  assert_int_equal(pipe(down), 0);
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(60);
    close(up[0]);
    close(down[1]);
    ddp_store_server_options so;
    memset(&so, 0, sizeof so);
    so.token = token;
    ddp_store_server *server = NULL;
    uint16_t p = 0;
    if (ddp_store_server_start("127.0.0.1", 0, &so, &server) == DDP_OK)
      p = ddp_store_server_port(server);
    if (write(up[1], &p, sizeof p) != (ssize_t)sizeof p) p = 0;
    close(up[1]);
    char c;
    while (p && read(down[0], &c, 1) < 0 && errno == EINTR) {
    }
    ddp_store_server_stop(server);
    exit(0);
  }
  close(up[1]);
  close(down[0]);
  *port = 0;
  assert_int_equal(read(up[0], port, sizeof *port), (ssize_t)sizeof *port);
  close(up[0]);
  assert_true(*port != 0);
  *control = down[1];
  return pid;
}

static void stop_store_process(pid_t pid, int control) {
  close(control);
  int st = 0;
  double deadline = ddp_time_s() + 10;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (ddp_time_s() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      fail_msg("the store process did not stop");
    }
    usleep(10000);
  }
  assert_int_equal(st, 0);
}

/* ---- Successful rendezvous ------------------------------------------------ */

static void env_world(int world) {
  uint16_t port = free_port();
  rank_spec specs[MAX_RANKS];
  rank_result res[MAX_RANKS];
  for (int r = 0; r < world; r++)
    spec(&specs[r], "env://",
         "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d WORLD_SIZE=%d LOCAL_RANK=%d "
         "LOCAL_WORLD_SIZE=%d DDP_TIMEOUT=20",
         port, r, world, r, world);
  run_ranks(world, specs, res, 25);
  expect_ok(res, world);
  for (int r = 0; r < world; r++) {
    assert_int_equal(res[r].rank, r);
    assert_int_equal(res[r].world_size, world);
    assert_int_equal(res[r].local_rank, r);
    assert_int_equal(res[r].local_world_size, world);
    assert_string_equal(res[r].sources, "env/env/env/env/env");
    assert_int_equal(res[r].hosted, r == 0); /* rank 0 hosts, the others are clients */
    assert_int_equal(res[r].num_hosts, 1);   /* one machine, one network namespace */
    assert_int_equal(res[r].store_timeout_ms, 20000); /* DDP_TIMEOUT=20 */
    char master[64];
    snprintf(master, sizeof master, "127.0.0.1:%u", port);
    assert_string_equal(res[r].store_addr, master);
  }
}

static void test_env_world_1(void **state) {
  (void)state;
  env_world(1);
}
static void test_env_world_2(void **state) {
  (void)state;
  env_world(2);
}
static void test_env_world_4(void **state) {
  (void)state;
  env_world(4);
}

/* No MASTER_* at all and a world of one: loopback, any free port. */
static void test_env_world_1_no_master(void **state) {
  (void)state;
  rank_spec s;
  rank_result r;
  spec(&s, "env://", "RANK=0 WORLD_SIZE=1");
  run_ranks(1, &s, &r, 20);
  expect_ok(&r, 1);
  assert_int_equal(r.hosted, 1);
  assert_string_equal(r.sources, "env/env/hosts/hosts/default");
  assert_int_equal(strncmp(r.store_addr, "127.0.0.1:", 10), 0);
  assert_true(atoi(r.store_addr + 10) > 0); /* the port actually bound */
}

/* Two "hosts" (DDP_HOST_ID) of two ranks each and no LOCAL_*: local ranks are
 * counted from the registered host identities. */
static void test_local_rank_from_host_ids(void **state) {
  (void)state;
  rank_spec specs[4];
  rank_result res[4];
  const char *hosts[] = {"hostA", "hostA", "hostB", "hostB"};
  /* Interleave to show the host numbering follows each host's lowest rank. */
  const char *mixed[] = {"hostB", "hostA", "hostB", "hostA"};
  for (int round = 0; round < 2; round++) {
    const char **h = round == 0 ? hosts : mixed;
    uint16_t port = free_port();
    for (int r = 0; r < 4; r++)
      spec(&specs[r], "env://",
           "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d WORLD_SIZE=4 DDP_HOST_ID=%s "
           "DDP_TIMEOUT=20",
           port, r, h[r]);
    run_ranks(4, specs, res, 25);
    expect_ok(res, 4);
    for (int r = 0; r < 4; r++) {
      int expect_local = round == 0 ? r % 2 : r / 2;
      int expect_host = round == 0 ? r / 2 : r % 2;
      assert_int_equal(res[r].local_rank, expect_local);
      assert_int_equal(res[r].local_world_size, 2);
      assert_int_equal(res[r].num_hosts, 2);
      assert_int_equal(res[r].host_index, expect_host);
      for (int q = 0; q < 4; q++)
        assert_int_equal(res[r].rank_host[q], round == 0 ? q / 2 : q % 2);
      assert_string_equal(res[r].sources, "env/env/hosts/hosts/env");
    }
  }
}

/* DDP_STORE_ADDR: a launcher (this test) runs the store; every rank is a client. */
static void test_external_store(void **state) {
  (void)state;
  uint16_t port;
  int control;
  pid_t server = start_store_process(NULL, &port, &control);
  uint16_t unused = free_port(); /* MASTER_PORT that nobody listens on: must not matter */
  rank_spec specs[3];
  rank_result res[3];
  for (int r = 0; r < 3; r++)
    spec(&specs[r], "env://",
         "DDP_STORE_ADDR=127.0.0.1:%u MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d "
         "WORLD_SIZE=3 DDP_TIMEOUT=20",
         port, unused, r);
  run_ranks(3, specs, res, 25);
  expect_ok(res, 3);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(res[r].rank, r);
    assert_int_equal(res[r].hosted, 0);
    assert_int_equal(res[r].external, 1);
    assert_string_equal(res[r].store_addr, addr);
  }
  /* The registrations are in the launcher's store, as docs/rendezvous.md says. */
  ddp_store *store;
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", port, NULL, &store), DDP_OK);
  int64_t joined = 0;
  assert_int_equal(ddp_store_add(store, "rdzv/joined", 0, &joined), DDP_OK);
  assert_int_equal(joined, 3);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(store, "rdzv/rank/2", 1000, &v, &n), DDP_OK);
  assert_int_equal(strncmp(v, "ddp-rdzv 1 3 ", 13), 0);
  ddp_free(v);
  ddp_store_destroy(store);
  stop_store_process(server, control);
}

/* DDP_STORE_TOKEN reaches the store client: a wrong token is refused with a
 * message that says so, the right one is let in. */
static void test_store_token(void **state) {
  (void)state;
  uint16_t port;
  int control;
  pid_t server = start_store_process("s3cret", &port, &control);
  rank_spec specs[2];
  rank_result res[2];
  spec(&specs[0], "env://", "DDP_STORE_ADDR=127.0.0.1:%u RANK=0 WORLD_SIZE=1 DDP_STORE_TOKEN=wrong DDP_TIMEOUT=5", port);
  run_ranks(1, specs, res, 15);
  expect_error(&res[0], "rank 0", "rank 0 cannot use the store at 127.0.0.1:");
  expect_error(&res[0], "rank 0", "token refused");
  assert_int_equal(res[0].status, DDP_ERR_AUTH);
  for (int r = 0; r < 2; r++)
    spec(&specs[r], "env://", "DDP_STORE_ADDR=127.0.0.1:%u RANK=%d WORLD_SIZE=2 DDP_STORE_TOKEN=s3cret DDP_TIMEOUT=20",
         port, r);
  run_ranks(2, specs, res, 25);
  expect_ok(res, 2);
  stop_store_process(server, control);
}

static void test_tcp_url(void **state) {
  (void)state;
  uint16_t port = free_port();
  char urls[2][96];
  rank_spec specs[2];
  rank_result res[2];
  /* Rank 0 from the query, rank 1 from the options: both are init_process_group's ways. */
  snprintf(urls[0], sizeof urls[0], "tcp://127.0.0.1:%u?rank=0&world_size=2", port);
  snprintf(urls[1], sizeof urls[1], "tcp://127.0.0.1:%u", port);
  spec(&specs[0], urls[0], "DDP_TIMEOUT=20");
  spec(&specs[1], urls[1], "DDP_TIMEOUT=20");
  specs[1].opt_rank = 1;
  specs[1].opt_world = 2;
  run_ranks(2, specs, res, 25);
  expect_ok(res, 2);
  assert_string_equal(res[0].sources, "url/url/hosts/hosts/url");
  assert_string_equal(res[1].sources, "options/options/hosts/hosts/url");
  assert_int_equal(res[0].hosted, 1);
  assert_int_equal(res[1].local_rank, 1);
  assert_int_equal(res[1].local_world_size, 2);
}

static void test_file_url(void **state) {
  (void)state;
  char dir[] = "/tmp/ddp-rdzv-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char url[128];
  snprintf(url, sizeof url, "file://%s/store", dir);
  rank_spec specs[4];
  rank_result res[4];
  for (int r = 0; r < 4; r++) spec(&specs[r], url, "RANK=%d WORLD_SIZE=4 DDP_TIMEOUT=20", r);
  run_ranks(4, specs, res, 25);
  char path[160];
  snprintf(path, sizeof path, "%s/store", dir);
  unlink(path); /* before any assertion, so a failure leaves nothing behind */
  rmdir(dir);
  expect_ok(res, 4);
  char addr[160];
  snprintf(addr, sizeof addr, "file://%s/store", dir);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(res[r].rank, r);
    assert_int_equal(res[r].hosted, 0);
    assert_string_equal(res[r].store_addr, addr);
    assert_int_equal(res[r].local_rank, r);
  }
}

/* srun-style: SLURM_* only, rank 0's host is the first of SLURM_NODELIST. */
static void test_slurm_variables(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec specs[4];
  rank_result res[4];
  for (int r = 0; r < 4; r++)
    spec(&specs[r], "env://",
         "SLURM_PROCID=%d SLURM_NTASKS=4 SLURM_LOCALID=%d SLURM_NODEID=0 "
         "SLURM_TASKS_PER_NODE=4 SLURM_NODELIST=127.0.0.[1-2] SLURM_JOB_ID=99 MASTER_PORT=%u "
         "DDP_TIMEOUT=20",
         r, r, port);
  run_ranks(4, specs, res, 25);
  expect_ok(res, 4);
  char master[64];
  snprintf(master, sizeof master, "127.0.0.1:%u", port);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(res[r].rank, r);
    assert_int_equal(res[r].local_rank, r);
    assert_int_equal(res[r].local_world_size, 4);
    assert_string_equal(res[r].sources, "slurm/slurm/slurm/slurm/slurm");
    assert_string_equal(res[r].master, master);
  }
}

/* mpirun-style: OMPI_COMM_WORLD_*, all on this host, so no MASTER_ADDR needed. */
static void test_mpi_variables(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec specs[2];
  rank_result res[2];
  for (int r = 0; r < 2; r++)
    spec(&specs[r], "env://",
         "OMPI_COMM_WORLD_RANK=%d OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=%d "
         "OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=%u DDP_TIMEOUT=20",
         r, r, port);
  run_ranks(2, specs, res, 25);
  expect_ok(res, 2);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(res[r].rank, r);
    assert_string_equal(res[r].sources, "mpi/mpi/mpi/mpi/mpi");
  }
  /* PMI (MPICH, Intel MPI) */
  port = free_port();
  for (int r = 0; r < 2; r++)
    spec(&specs[r], "env://",
         "PMI_RANK=%d PMI_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=%u DDP_TIMEOUT=20", r, port);
  run_ranks(2, specs, res, 25);
  expect_ok(res, 2);
  assert_string_equal(res[1].sources, "mpi/mpi/hosts/hosts/env");
}

/* Rank 1 starts before rank 0's server is up (300 ms late): backoff wins. */
static void test_server_starts_late(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec specs[2];
  rank_result res[2];
  for (int r = 0; r < 2; r++)
    spec(&specs[r], "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d WORLD_SIZE=2 DDP_TIMEOUT=20",
         port, r);
  specs[0].delay_ms = 300;
  run_ranks(2, specs, res, 25);
  expect_ok(res, 2);
  assert_true(res[1].elapsed_s >= 0.25); /* it really did wait for rank 0 */
  assert_true(res[1].elapsed_s < 10);
}

/* ---- Failures ------------------------------------------------------------- */


/* Ranks 0, 1 and 3 of 4 start; rank 2 never does. Every rank fails within
 * about the timeout, and says who is missing. */
static void test_missing_rank(void **state) {
  (void)state;
  for (int external = 0; external < 2; external++) {
    pid_t server = -1;
    int control = -1;
    uint16_t port = free_port(), store_port;
    char extra[64] = "";
    if (external) {
      server = start_store_process(NULL, &store_port, &control);
      snprintf(extra, sizeof extra, "DDP_STORE_ADDR=127.0.0.1:%u", store_port);
    }
    rank_spec specs[3];
    rank_result res[3];
    const int ranks[3] = {0, 1, 3};
    for (int i = 0; i < 3; i++)
      spec(&specs[i], "env://",
           "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d WORLD_SIZE=4 DDP_TIMEOUT=1 %s", port,
           ranks[i], extra);
    double t0 = ddp_time_s();
    run_ranks(3, specs, res, 15);
    double took = ddp_time_s() - t0;
    for (int i = 0; i < 3; i++) {
      char who[32];
      snprintf(who, sizeof who, "rank %d", ranks[i]);
      expect_error(&res[i], who, "timed out after 1 s waiting for workers: 3/4 joined; missing ranks: 2");
      assert_int_equal(res[i].status, res[i].status == DDP_ERR_TIMEOUT ? DDP_ERR_TIMEOUT : DDP_ERR_ABORTED);
      assert_true(res[i].elapsed_s < 5); /* the timeout, plus rank 0's brief linger */
    }
    assert_true(took < 10);
    if (external) stop_store_process(server, control);
  }
}

/* A long wait is not silent: rank 0 logs who is missing while it waits. */
static void test_progress_while_waiting(void **state) {
  (void)state;
  char path[] = "/tmp/ddp-rdzv-log-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  rank_spec s;
  rank_result r;
  spec(&s, "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=0 WORLD_SIZE=3 DDP_TIMEOUT=2.5",
       free_port());
  s.stderr_path = path;
  run_ranks(1, &s, &r, 15);
  expect_error(&r, "rank 0", "timed out after 2.5 s waiting for workers: 1/3 joined; missing ranks: 1-2");
  char log[4096] = "";
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  size_t n = fread(log, 1, sizeof log - 1, f);
  log[n] = '\0';
  fclose(f);
  unlink(path);
  if (!strstr(log, "still waiting after 1 s (timeout 2.5 s): 1/3 joined; missing ranks: 1-2") ||
      !strstr(log, "still waiting after 2 s"))
    fail_msg("rank 0's log lacks the progress lines:\n%s", log);
}

/* MASTER_PORT already taken: rank 0 says so, in words a user can act on. */
static void test_port_in_use(void **state) {
  (void)state;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(fd, 1), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  unsigned port = ntohs(a.sin_port);
  rank_spec s;
  rank_result r;
  spec(&s, "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=0 WORLD_SIZE=2 DDP_TIMEOUT=5", port);
  run_ranks(1, &s, &r, 15);
  char text[160];
  snprintf(text, sizeof text,
           "rank 0 cannot listen on 127.0.0.1:%u: address already in use — another job or a "
           "stale process holds the port; pick another MASTER_PORT",
           port);
  expect_error(&r, "rank 0", text);
  assert_int_equal(r.status, DDP_ERR_ADDRINUSE);
  assert_true(r.elapsed_s < 2); /* at once, not after the timeout */
  close(fd);
}

/* Nobody ever listens: a non-zero rank gives up after the timeout and says where it tried. */
static void test_unreachable_store(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec s;
  rank_result r;
  spec(&s, "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=1 WORLD_SIZE=2 DDP_TIMEOUT=1", port);
  run_ranks(1, &s, &r, 15);
  char text[160];
  snprintf(text, sizeof text, "rank 1 cannot reach the store at 127.0.0.1:%u after 1 s (last error: ", port);
  expect_error(&r, "rank 1", text);
  expect_error(&r, "rank 1", "is rank 0 running, and are MASTER_ADDR and MASTER_PORT right?");
  assert_int_equal(r.status, DDP_ERR_TIMEOUT);
  assert_true(r.elapsed_s >= 0.9 && r.elapsed_s < 5);
}

/* Two processes claim rank 1 of 3: the second is told so at once, and the
 * others fail fast with the same reason instead of timing out. */
static void test_duplicate_rank(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec specs[3];
  rank_result res[3];
  const int ranks[3] = {0, 1, 1};
  for (int i = 0; i < 3; i++)
    spec(&specs[i], "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=%d WORLD_SIZE=3 DDP_TIMEOUT=20",
         port, ranks[i]);
  specs[2].delay_ms = 200; /* the duplicate comes second */
  run_ranks(3, specs, res, 25);
  for (int i = 0; i < 3; i++) {
    char who[32];
    snprintf(who, sizeof who, "process %d (rank %d)", i, ranks[i]);
    expect_error(&res[i], who, "rank 1 is claimed by two processes: pid ");
    assert_true(res[i].elapsed_s < 8); /* far below the 20 s timeout */
  }
  assert_int_equal(res[2].status, DDP_ERR_INVALID);
  assert_int_equal(res[0].status, DDP_ERR_ABORTED);
  assert_non_null(strstr(res[0].error, "aborted"));
}

/* A stale WORLD_SIZE on one rank: everyone learns of the disagreement at once. */
static void test_world_size_disagreement(void **state) {
  (void)state;
  uint16_t port = free_port();
  rank_spec specs[2];
  rank_result res[2];
  spec(&specs[0], "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=0 WORLD_SIZE=2 DDP_TIMEOUT=20", port);
  spec(&specs[1], "env://", "MASTER_ADDR=127.0.0.1 MASTER_PORT=%u RANK=1 WORLD_SIZE=3 DDP_TIMEOUT=20", port);
  specs[1].delay_ms = 200;
  run_ranks(2, specs, res, 25);
  expect_error(&res[1], "rank 1", "ranks disagree on the world size: rank 1");
  expect_error(&res[1], "rank 1", "has 3 (from env), the ranks before it have 2");
  expect_error(&res[0], "rank 0", "aborted: ranks disagree on the world size");
  assert_true(res[0].elapsed_s < 8);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env_world_1),
      cmocka_unit_test(test_env_world_2),
      cmocka_unit_test(test_env_world_4),
      cmocka_unit_test(test_env_world_1_no_master),
      cmocka_unit_test(test_local_rank_from_host_ids),
      cmocka_unit_test(test_external_store),
      cmocka_unit_test(test_store_token),
      cmocka_unit_test(test_tcp_url),
      cmocka_unit_test(test_file_url),
      cmocka_unit_test(test_slurm_variables),
      cmocka_unit_test(test_mpi_variables),
      cmocka_unit_test(test_server_starts_late),
      cmocka_unit_test(test_missing_rank),
      cmocka_unit_test(test_progress_while_waiting),
      cmocka_unit_test(test_port_in_use),
      cmocka_unit_test(test_unreachable_store),
      cmocka_unit_test(test_duplicate_rank),
      cmocka_unit_test(test_world_size_disagreement),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
