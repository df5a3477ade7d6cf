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
#include <unistd.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "launch/launch_internal.h"

static ddp_status parse(ddp_launch_config *cfg, int argc, char **argv) {
  ddp_launch_config_init(cfg);
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
}

static void test_options_refused(void **state) {
  (void)state;
  ddp_launch_config c;
  char *elastic[] = {"ddprun", "--nnodes", "1:2", "prog"};
  assert_int_equal(parse(&c, 4, elastic), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "--nnodes 1:2: elastic membership"));
  char *fixed[] = {"ddprun", "--nnodes", "2:2", "prog"};
  assert_int_equal(parse(&c, 4, fixed), DDP_OK);
  assert_int_equal(c.nnodes, 2);
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
  ddp_spawn_options o;
  ddp_spawn_options_init(&o);
  o.timeout_s = 30;
  assert_int_equal(ddp_spawn(8, spawn_worker, NULL, &o), DDP_OK);
  /* The caller's environment is untouched. */
  assert_null(getenv("DDP_STORE_ADDR"));
}

static void test_spawn_failure(void **state) {
  (void)state;
  ddp_spawn_options o;
  ddp_spawn_options_init(&o);
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

static void test_spawn_timeout(void **state) {
  (void)state;
  ddp_spawn_options o;
  ddp_spawn_options_init(&o);
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
      cmocka_unit_test(test_spawn_timeout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
