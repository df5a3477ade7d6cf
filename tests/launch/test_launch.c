/* The launch layer in-process: ddprun's option parser (both spellings, both
 * forms, the refusals), the Slurm derivation from tables of variables, the
 * worker environment, and ddp_spawn (8 workers through env:// and a barrier;
 * a failing worker named in the error with its exit code or signal; a
 * restart; the timeout). */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "launch/launch_internal.h"

static ddp_status parse(ddp_launch_config *cfg, int argc, char **argv) {
  *cfg = ddp_launch_defaults();
  return ddp_launch_parse_args(argc, argv, cfg);
}

static void test_options_spellings(void **state) {
  (void)state;
  ddp_launch_config a, b;
  char *dash[] = {"ddprun", "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0",
                  "--master-port", "1234", "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-id", "job",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:99", "--log-dir", "/tmp/x", "--tee", "3",
                  "--redirects", "0:1,1:2", "--local-ranks-filter", "0,2", "--no-python", "--pass-local-rank",
                  "--grace-period", "2.5", "prog", "--lr", "0.1"};
  char *under[] = {"ddprun", "--nproc_per_node=4", "--nnodes=2", "--node_rank=1", "--master_addr=h0",
                   "--master_port=1234", "--max_restarts=3", "--monitor_interval=0.5", "--rdzv_id=job",
                   "--rdzv_backend=c10d", "--rdzv_endpoint=h0:99", "--log_dir=/tmp/x", "--tee=3",
                   "--redirects=0:1,1:2", "--local_ranks_filter=0,2", "--no_python", "--pass_local_rank",
                   "--grace_period=2.5", "prog", "--lr", "0.1"};
  assert_int_equal(parse(&a, sizeof dash / sizeof *dash, dash), DDP_OK);
  assert_int_equal(parse(&b, sizeof under / sizeof *under, under), DDP_OK);
  ddp_launch_config *cs[] = {&a, &b};
  for (int i = 0; i < 2; i++) {
    ddp_launch_config *c = cs[i];
    assert_int_equal(c->nproc_per_node, 4);
    assert_int_equal(c->nnodes, 2);
    assert_int_equal(c->node_rank, 1);
    assert_string_equal(c->master_addr, "h0");
    assert_int_equal(c->master_port, 1234);
    assert_int_equal(c->max_restarts, 3);
    assert_true(c->monitor_interval_s == 0.5);
    assert_string_equal(c->rdzv_id, "job");
    assert_int_equal(c->rdzv_backend, DDP_LAUNCH_RDZV_C10D);
    assert_string_equal(c->rdzv_endpoint, "h0:99");
    assert_string_equal(c->log_dir, "/tmp/x");
    assert_string_equal(c->tee, "3");
    assert_string_equal(c->redirects, "0:1,1:2");
    assert_string_equal(c->local_ranks_filter, "0,2");
    assert_true(c->no_python && c->pass_local_rank && c->nodes_given);
    assert_true(c->grace_s == 2.5);
    assert_string_equal(c->program, "prog");
    assert_int_equal(c->num_args, 2);
    assert_string_equal(c->args[0], "--lr"); /* the program's options are not ddprun's */
  }
  int level;
  assert_int_equal(ddp__std_spec_for("--redirects", "0:1,1:2", 1, &level), DDP_OK);
  assert_int_equal(level, 2);
  assert_int_equal(ddp__std_spec_for("--redirects", "0:1,1:2", 5, &level), DDP_OK);
  assert_int_equal(level, 0);
  int allowed;
  assert_int_equal(ddp__filter_allows("0,2", 2, &allowed), DDP_OK);
  assert_true(allowed);
  assert_int_equal(ddp__filter_allows("0,2", 1, &allowed), DDP_OK);
  assert_false(allowed);
  assert_int_equal(ddp__filter_allows("1-3", 3, &allowed), DDP_OK); /* ranges, as --may-fail */
  assert_true(allowed);
  assert_int_equal(ddp__filter_allows("1-3", 0, &allowed), DDP_OK);
  assert_false(allowed);
  assert_int_equal(ddp__filter_allows("0,x", 0, &allowed), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "--local-ranks-filter '0,x'"));
}

static void test_options_refused(void **state) {
  (void)state;
  ddp_launch_config c;
  /* MIN:MAX: elastic with c10d only; MIN above MAX never. */
  char *elastic[] = {"ddprun", "--nnodes", "1:2", "prog"};
  assert_int_equal(parse(&c, 4, elastic), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "--nnodes 1:2: elastic membership needs --rdzv-backend c10d"));
  char *elastic_c10d[] = {"ddprun", "--nnodes", "1:3", "--rdzv-backend", "c10d",
                          "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=4", "prog"};
  assert_int_equal(parse(&c, 8, elastic_c10d), DDP_OK);
  assert_int_equal(c.min_nnodes, 1);
  assert_int_equal(c.nnodes, 3);
  assert_true(c.last_call_timeout_s == 2.0);
  assert_true(c.keep_alive_s == 2.0);
  char *inverted[] = {"ddprun", "--nnodes", "3:2", "--rdzv-backend", "c10d", "prog"};
  assert_int_equal(parse(&c, 6, inverted), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "--nnodes 3:2: MIN 3 is above MAX 2"));
  char *fixed[] = {"ddprun", "--nnodes", "2:2", "prog"};
  assert_int_equal(parse(&c, 4, fixed), DDP_OK);
  assert_int_equal(c.nnodes, 2);
  assert_int_equal(c.min_nnodes, 0);
  char *bad_rank[] = {"ddprun", "--nnodes", "2", "--node-rank", "2", "prog"};
  assert_int_equal(parse(&c, 6, bad_rank), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "--node-rank 2 is out of range"));
  char *backend[] = {"ddprun", "--rdzv-backend", "etcd", "prog"};
  assert_int_equal(parse(&c, 4, backend), DDP_ERR_UNSUPPORTED);
  char *missing[] = {"ddprun", "--nproc-per-node"};
  assert_int_equal(parse(&c, 2, missing), DDP_ERR_INVALID);
  char *noprog[] = {"ddprun", "--standalone"};
  assert_int_equal(parse(&c, 2, noprog), DDP_ERR_INVALID);
  char *tee[] = {"ddprun", "--tee", "4", "prog"};
  assert_int_equal(parse(&c, 4, tee), DDP_ERR_INVALID);
  char *help[] = {"ddprun", "--help"};
  assert_int_equal(parse(&c, 2, help), DDP_OK);
  assert_true(c.help);
  char *cpu[] = {"ddprun", "--nproc-per-node", "cpu", "prog"};
  assert_int_equal(parse(&c, 4, cpu), DDP_OK);
  assert_int_equal(c.nproc_per_node, (int32_t)sysconf(_SC_NPROCESSORS_ONLN));
}

/* ---- Slurm ------------------------------------------------------------------ */

static void test_slurm_derivation(void **state) {
  (void)state;
  ddp_launch_config c;
  int applied;
  char *prog[] = {"ddprun", "--nproc-per-node", "4", "prog"};
  /* Node 2 of node[07-09,12]: 4 nodes, master the first host. */
  char *job[] = {"SLURM_JOB_ID=4242", "SLURM_NNODES=4", "SLURM_NODEID=2", "SLURM_JOB_NODELIST=node[07-09,12]",
                 "PATH=/bin", NULL};
  assert_int_equal(parse(&c, 4, prog), DDP_OK);
  assert_int_equal(ddp_launch_apply_slurm(&c, job, &applied), DDP_OK);
  assert_true(applied);
  assert_int_equal(c.nnodes, 4);
  assert_int_equal(c.node_rank, 2);
  assert_string_equal(c.master_addr, "node07");
  assert_int_equal(c.master_port, 15000 + 4242 % 20000);
  assert_string_equal(c.rdzv_id, "slurm-4242");
  /* SLURM_NODELIST when SLURM_JOB_NODELIST is absent; an explicit master wins. */
  char *old[] = {"SLURM_JOB_ID=7", "SLURM_NNODES=2", "SLURM_NODEID=0", "SLURM_NODELIST=a1,b2", NULL};
  char *with_master[] = {"ddprun", "--master-addr", "head", "--master-port", "555", "prog"};
  assert_int_equal(parse(&c, 6, with_master), DDP_OK);
  assert_int_equal(ddp_launch_apply_slurm(&c, old, &applied), DDP_OK);
  assert_true(applied);
  assert_string_equal(c.master_addr, "head");
  assert_int_equal(c.master_port, 555);
  assert_int_equal(c.node_rank, 0);
  /* Not applied: explicit --nnodes; a missing variable; outside Slurm. */
  char *explicit_nodes[] = {"ddprun", "--nnodes", "1", "prog"};
  assert_int_equal(parse(&c, 4, explicit_nodes), DDP_OK);
  assert_int_equal(ddp_launch_apply_slurm(&c, job, &applied), DDP_OK);
  assert_false(applied);
  assert_int_equal(c.nnodes, 1);
  char *partial[] = {"SLURM_JOB_ID=1", "SLURM_NNODES=2", "SLURM_JOB_NODELIST=a[1-2]", NULL};
  assert_int_equal(parse(&c, 4, prog), DDP_OK);
  assert_int_equal(ddp_launch_apply_slurm(&c, partial, &applied), DDP_OK);
  assert_false(applied);
  char *none[] = {"HOME=/root", NULL};
  assert_int_equal(ddp_launch_apply_slurm(&c, none, &applied), DDP_OK);
  assert_false(applied);
  /* Malformed: named. */
  char *bad_id[] = {"SLURM_JOB_ID=1", "SLURM_NNODES=2", "SLURM_NODEID=5", "SLURM_JOB_NODELIST=a[1-2]", NULL};
  assert_int_equal(ddp_launch_apply_slurm(&c, bad_id, &applied), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "SLURM_NODEID=\"5\""));
  char *mismatch[] = {"SLURM_JOB_ID=1", "SLURM_NNODES=3", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=a[1-2]", NULL};
  assert_int_equal(ddp_launch_apply_slurm(&c, mismatch, &applied), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "names 2 hosts but SLURM_NNODES=3"));
  char *badlist[] = {"SLURM_JOB_ID=1", "SLURM_NNODES=2", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=a[1-", NULL};
  assert_int_not_equal(ddp_launch_apply_slurm(&c, badlist, &applied), DDP_OK);
  assert_non_null(strstr(ddp_last_error(), "SLURM_JOB_NODELIST"));
}

/* ---- Worker environment ----------------------------------------------------- */

static void test_worker_env(void **state) {
  (void)state;
  ddp__world w = {.world_size = 8, .rank_offset = 4, .nproc = 4, .nnodes = 2, .node_rank = 1,
                  .master_addr = "h0", .master_port = 29501, .store_addr = "h0:29500",
                  .run_id = "job", .max_restarts = 3};
  char *base[] = {"PATH=/bin", "RANK=77", "MASTER_PORT=1", "HOME=/h", NULL};
  char **env;
  assert_int_equal(ddp__worker_env(base, &w, 2, 1, &env), DDP_OK);
  const char *want[][2] = {{"MASTER_ADDR", "h0"}, {"MASTER_PORT", "29501"}, {"RANK", "6"}, {"WORLD_SIZE", "8"},
                           {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
                           {"GROUP_WORLD_SIZE", "2"}, {"ROLE_RANK", "6"}, {"ROLE_WORLD_SIZE", "8"},
                           {"ROLE_NAME", "default"}, {"TORCHELASTIC_RESTART_COUNT", "1"},
                           {"TORCHELASTIC_MAX_RESTARTS", "3"}, {"TORCHELASTIC_RUN_ID", "job"},
                           {"TORCHELASTIC_USE_AGENT_STORE", "False"}, {"OMP_NUM_THREADS", "1"},
                           {"DDP_STORE_ADDR", "h0:29500"}, {"DDP_STORE_PREFIX", "ddprun/job/attempt/1/"},
                           {"PATH", "/bin"}, {"HOME", "/h"}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const char *v = ddp__envp_get(env, want[i][0]);
    if (!v || strcmp(v, want[i][1]) != 0) fail_msg("%s=%s, expected %s", want[i][0], v ? v : "(unset)", want[i][1]);
  }
  size_t n = 0, ranks = 0;
  for (; env[n]; n++) ranks += strncmp(env[n], "RANK=", 5) == 0;
  assert_int_equal(ranks, 1); /* the inherited RANK=77 is gone, not shadowed */
  assert_int_equal(n, sizeof want / sizeof want[0]);
  ddp_free(env);
}

/* ---- ddp_spawn ---------------------------------------------------------------- */

typedef struct spawn_arg {
  int die_rank;
  int die_signal; /* 0: return 3 */
} spawn_arg;

static int spawn_worker(int rank, void *arg_) {
  spawn_arg *arg = arg_;
  long restart = strtol(getenv("TORCHELASTIC_RESTART_COUNT"), NULL, 10);
  if (strtol(getenv("RANK"), NULL, 10) != rank) return 10;
  ddp_process_group *pg;
  if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) {
    fprintf(stderr, "spawn worker %d: %s\n", rank, ddp_last_error());
    return 11;
  }
  int rc = ddp_barrier(pg) == DDP_OK ? 0 : 12;
  int64_t x = rank + 1;
  if (!rc && ddp_allreduce(pg, &x, 1, DDP_INT64, DDP_REDUCE_SUM) != DDP_OK) rc = 13;
  int world = ddp_process_group_size(pg);
  if (!rc && x != (int64_t)world * (world + 1) / 2) rc = 14;
  if (arg && rank == arg->die_rank && restart == 0) {
    printf("worker %d fails now\n", rank);
    fflush(stdout);
    if (arg->die_signal) {
      signal(arg->die_signal, SIG_DFL); /* cmocka catches SIGSEGV in the test process */
      raise(arg->die_signal);
    }
    return 3;
  }
  if (arg && arg->die_rank >= 0 && restart == 0) pause(); /* until stopped */
  if (!rc && ddp_barrier(pg) != DDP_OK) rc = 15;
  ddp_process_group_destroy(pg);
  return rc;
}

static void test_spawn_ok(void **state) {
  (void)state;
  ddp_spawn_options o = ddp_spawn_defaults();
  o.timeout_s = 30;
  assert_int_equal(ddp_spawn(8, spawn_worker, NULL, &o), DDP_OK);
  /* The caller's environment is untouched. */
  assert_null(getenv("DDP_STORE_ADDR"));
}

static void test_spawn_failure(void **state) {
  (void)state;
  ddp_spawn_options o = ddp_spawn_defaults();
  o.timeout_s = 30;
  o.grace_s = 2;
  o.quiet = 1;
  spawn_arg exit3 = {.die_rank = 2, .die_signal = 0};
  double t0 = ddp_time_s();
  assert_int_equal(ddp_spawn(4, spawn_worker, &exit3, &o), DDP_ERR_PEER);
  assert_true(ddp_time_s() - t0 < 10);
  assert_non_null(strstr(ddp_last_error(), "rank 2 (local rank 2, pid"));
  assert_non_null(strstr(ddp_last_error(), "exited with code 3"));
  spawn_arg segv = {.die_rank = 1, .die_signal = SIGSEGV};
  o.quiet = 0; /* the summary goes to stderr: visible in the test log */
  assert_int_equal(ddp_spawn(3, spawn_worker, &segv, &o), DDP_ERR_PEER);
  assert_non_null(strstr(ddp_last_error(), "rank 1 (local rank 1, pid"));
  assert_non_null(strstr(ddp_last_error(), "killed by signal 11 (SIGSEGV)"));
  /* With a restart, attempt 1 runs clean. */
  o.max_restarts = 1;
  o.quiet = 1;
  assert_int_equal(ddp_spawn(3, spawn_worker, &exit3, &o), DDP_OK);
}

static int sleeper(int rank, void *arg) {
  (void)rank;
  (void)arg;
  sleep(30);
  return 0;
}

/* ---- The store's process and the workers' fds ---------------------------------- */

/* The inode of the TCP socket listening on `port` (/proc/net/tcp, tcp6), 0. */
static unsigned long listening_inode(int port) {
  const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
  for (int f = 0; f < 2; f++) {
    FILE *in = fopen(files[f], "r");
    if (!in) continue;
    char line[512];
    unsigned long found = 0;
    while (!found && fgets(line, sizeof line, in)) {
      char local[80], remote[80];
      unsigned st, lport;
      unsigned long inode;
      if (sscanf(line, " %*d: %79s %79s %x %*s %*s %*s %*s %*s %lu", local, remote, &st, &inode) != 4) continue;
      const char *colon = strrchr(local, ':');
      if (colon && sscanf(colon + 1, "%x", &lport) == 1 && (int)lport == port && st == 0x0A) found = inode;
    }
    fclose(in);
    if (found) return found;
  }
  return 0;
}

/* Whether process `pid` holds socket inode `inode` among its fds. */
static int holds_socket(pid_t pid, unsigned long inode) {
  char dir[64], want[64];
  snprintf(dir, sizeof dir, "/proc/%ld/fd", (long)pid);
  snprintf(want, sizeof want, "socket:[%lu]", inode);
  DIR *d = opendir(dir);
  if (!d) return -1;
  int held = 0;
  struct dirent *e;
  while (!held && (e = readdir(d))) {
    char path[320], target[128];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    held = strcmp(target, want) == 0;
  }
  closedir(d);
  return held;
}

/* Sockets of this process whose local port is `port` (the listening socket
 * or a connection accepted by a server there). */
static int sockets_on_port(int port) {
  int count = 0;
  for (int fd = 0; fd < 1024; fd++) {
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &len) != 0) continue;
    int p = a.ss_family == AF_INET    ? ntohs(((struct sockaddr_in *)&a)->sin_port)
            : a.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&a)->sin6_port)
                                      : -1;
    count += p == port;
  }
  return count;
}

/* The child of `parent` named "ddp-store" (/proc/PID/stat), or 0. */
static pid_t store_child_of(pid_t parent) {
  DIR *d = opendir("/proc");
  pid_t found = 0;
  struct dirent *e;
  while (d && !found && (e = readdir(d))) {
    char path[300], line[512], comm[64];
    long pid, ppid;
    snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (fgets(line, sizeof line, f) && sscanf(line, "%ld (%63[^)]) %*c %ld", &pid, comm, &ppid) == 3 &&
        ppid == parent && strcmp(comm, "ddp-store") == 0)
      found = (pid_t)pid;
    fclose(f);
  }
  if (d) closedir(d);
  return found;
}

/* A worker that checks, after its rendezvous (so the store has accepted
 * connections), that the store's listening socket belongs to the ddp-store
 * process beside it and that it holds no socket of the server: neither the
 * listening socket nor an accepted connection. */
static int fd_worker(int rank, void *arg) {
  (void)arg;
  ddp_process_group *pg;
  if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) return 11;
  int rc = ddp_barrier(pg) == DDP_OK ? 0 : 12;
  const char *addr = getenv("DDP_STORE_ADDR");
  const char *colon = addr ? strrchr(addr, ':') : NULL;
  int port = colon ? atoi(colon + 1) : 0;
  unsigned long inode = listening_inode(port);
  pid_t store = store_child_of(getppid());
  if (!rc && (port <= 0 || inode == 0)) rc = 20;                  /* no listening socket found */
  if (!rc && store <= 0) rc = 21;                                 /* no ddp-store beside us */
  if (!rc && holds_socket(store, inode) != 1) rc = 22;            /* it does not serve the port */
  if (!rc && holds_socket(getpid(), inode) != 0) rc = 23;         /* we inherited it */
  if (!rc && holds_socket(getppid(), inode) != 0) rc = 24;        /* the supervisor kept it */
  if (!rc && sockets_on_port(port) != 0) rc = 25;                 /* a server-side socket */
  if (rc) fprintf(stderr, "fd worker %d: check %d failed (store %s, pid %ld, inode %lu)\n", rank, rc,
                  addr ? addr : "?", (long)store, inode);
  if (!rc && ddp_barrier(pg) != DDP_OK) rc = 15;
  ddp_process_group_destroy(pg);
  return rc;
}

static void test_spawn_store_process(void **state) {
  (void)state;
  ddp_spawn_options o = ddp_spawn_defaults();
  o.timeout_s = 30;
  assert_int_equal(ddp_spawn(3, fd_worker, NULL, &o), DDP_OK);
  /* The store's process was reaped: no child is left, not even a zombie. */
  errno = 0;
  assert_int_equal(waitpid(-1, NULL, WNOHANG), -1);
  assert_int_equal(errno, ECHILD);
}

static void test_spawn_timeout(void **state) {
  (void)state;
  ddp_spawn_options o = ddp_spawn_defaults();
  o.timeout_s = 0.5;
  o.grace_s = 0.5;
  double t0 = ddp_time_s();
  assert_int_equal(ddp_spawn(2, sleeper, NULL, &o), DDP_ERR_TIMEOUT);
  assert_true(ddp_time_s() - t0 < 5);
  assert_int_equal(ddp_spawn(0, sleeper, NULL, &o), DDP_ERR_INVALID);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_options_spellings), cmocka_unit_test(test_options_refused),
      cmocka_unit_test(test_slurm_derivation),  cmocka_unit_test(test_worker_env),
      cmocka_unit_test(test_spawn_ok),          cmocka_unit_test(test_spawn_failure),
      cmocka_unit_test(test_spawn_timeout),     cmocka_unit_test(test_spawn_store_process),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
