/* rendezvous environment contracts: which rank, world size, local rank and
 * master each combination of options, URL, torchrun, Slurm and MPI variables
 * gives, and the error text for each bad combination. Variables are set and
 * cleared in-process; nothing here talks to a store. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "rendezvous/rdzv_internal.h"
#include "rendezvous/rdzv_test_env.h"

typedef struct env_case {
  const char *env; /* "NAME=value NAME=value" */
  const char *url;
  int32_t opt_rank, opt_world; /* -1: not given */
  double opt_timeout;
  const char *error; /* NULL: success expected; else a substring of the message */
  int32_t rank, world, local_rank, local_world;
  const char *sources; /* rank/world/local_rank/local_world/master */
  const char *master;  /* "addr:port" as resolved, "" when none */
  const char *store;   /* info.store_addr */
  double timeout;
} env_case;

#define TR "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "
#define OK(env, url, orank, oworld, r, w, lr, lw, src, master, store) \
  {env, url, orank, oworld, 0, NULL, r, w, lr, lw, src, master, store, 1800}
#define FAIL(env, url, orank, oworld, msg) \
  {env, url, orank, oworld, 0, msg, 0, 0, 0, 0, NULL, NULL, NULL, 0}

static const env_case cases[] = {
    /* torchrun */
    OK(TR "RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2", "env://", -1, -1, 1, 4, 1, 2,
       "env/env/env/env/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    /* torchrun's variables win over Slurm's and MPI's (torchrun inside srun). */
    OK(TR "RANK=1 WORLD_SIZE=4 SLURM_PROCID=3 SLURM_NTASKS=8 SLURM_LOCALID=0 PMI_RANK=2 PMI_SIZE=4",
       "env://", -1, -1, 1, 4, -1, -1, "env/env/none/none/env", "127.0.0.1:29500",
       "127.0.0.1:29500"),
    /* Explicit options win over everything; local values are then counted
     * from host identities, not taken from another launcher. */
    OK(TR "RANK=1 WORLD_SIZE=4 LOCAL_RANK=1", "env://", 2, 4, 2, 4, -1, -1,
       "options/options/none/none/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    OK(TR "RANK=1 WORLD_SIZE=4", "env://?rank=0&world_size=2", -1, -1, 0, 2, -1, -1,
       "url/url/none/none/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    OK(TR "RANK=1 WORLD_SIZE=4", "env://?rank=3&world_size=8", 2, -1, 2, 8, -1, -1,
       "options/url/none/none/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    OK(TR "WORLD_SIZE=2", "env://", 0, -1, 0, 2, -1, -1, "options/env/none/none/env",
       "127.0.0.1:29500", "127.0.0.1:29500"),
    /* A world of one needs no master: any free port on loopback. */
    OK("RANK=0 WORLD_SIZE=1", "env://", -1, -1, 0, 1, -1, -1, "env/env/none/none/default",
       "127.0.0.1:0", "127.0.0.1:0"),
    /* Slurm: master is the step's first node, port from the job id. */
    OK("SLURM_PROCID=5 SLURM_NTASKS=8 SLURM_LOCALID=1 SLURM_STEP_NODELIST=node[03-06] "
       "SLURM_NODELIST=other[1-9] SLURM_TASKS_PER_NODE=2(x4) SLURM_NODEID=2 SLURM_JOB_ID=123456",
       "env://", -1, -1, 5, 8, 1, 2, "slurm/slurm/slurm/slurm/slurm", "node03:18456",
       "node03:18456"),
    OK("SLURM_PROCID=3 SLURM_NTASKS=4 SLURM_LOCALID=0 SLURM_NODELIST=a1,b[2-3] "
       "SLURM_TASKS_PER_NODE=3,1 SLURM_NODEID=1",
       "env://", -1, -1, 3, 4, 0, 1, "slurm/slurm/slurm/slurm/slurm", "a1:29500", "a1:29500"),
    OK("SLURM_PROCID=2 SLURM_NPROCS=4 SLURM_LOCALID=2 SLURM_NTASKS_PER_NODE=4 "
       "SLURM_JOB_NODELIST=gpu[7]",
       "env://", -1, -1, 2, 4, 2, 4, "slurm/slurm/slurm/slurm/slurm", "gpu7:29500", "gpu7:29500"),
    /* Uneven nodes and no SLURM_NODEID: the local world size is left to the join. */
    OK("SLURM_PROCID=1 SLURM_NTASKS=5 SLURM_LOCALID=1 SLURM_NODELIST=n[1-2] "
       "SLURM_TASKS_PER_NODE=2(x2),1",
       "env://", -1, -1, 1, 5, 1, -1, "slurm/slurm/slurm/none/slurm", "n1:29500", "n1:29500"),
    OK(TR "SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_NODELIST=n[1-2]", "env://", -1, -1, 1, 2, -1, -1,
       "slurm/slurm/none/none/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    /* srun --mpi=pmi2 sets both Slurm's and PMI's variables: Slurm wins. */
    OK("SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_NODELIST=n1 PMI_RANK=0 PMI_SIZE=2", "env://", -1, -1,
       1, 2, -1, -1, "slurm/slurm/none/none/slurm", "n1:29500", "n1:29500"),
    /* Open MPI, every rank on this host: master is loopback. */
    OK("OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_RANK=2 "
       "OMPI_COMM_WORLD_LOCAL_SIZE=4",
       "env://", -1, -1, 2, 4, 2, 4, "mpi/mpi/mpi/mpi/mpi", "127.0.0.1:29500", "127.0.0.1:29500"),
    OK("OMPI_COMM_WORLD_RANK=3 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_RANK=1 "
       "OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_ADDR=10.0.0.1",
       "env://", -1, -1, 3, 4, 1, 2, "mpi/mpi/mpi/mpi/env", "10.0.0.1:29500", "10.0.0.1:29500"),
    /* MPICH / Intel MPI (hydra) */
    OK(TR "PMI_RANK=1 PMI_SIZE=2 MPI_LOCALRANKID=1 MPI_LOCALNRANKS=2", "env://", -1, -1, 1, 2, 1,
       2, "mpi/mpi/mpi/mpi/env", "127.0.0.1:29500", "127.0.0.1:29500"),
    OK(TR "PMIX_RANK=1", "env://", -1, 2, 1, 2, -1, -1, "mpi/options/none/none/env",
       "127.0.0.1:29500", "127.0.0.1:29500"),
    /* A launcher's store: every rank is a client, MASTER_* are not needed. */
    OK("RANK=1 WORLD_SIZE=2 DDP_STORE_ADDR=127.0.0.1:4000", "env://", -1, -1, 1, 2, -1, -1,
       "env/env/none/none/none", ":0", "127.0.0.1:4000"),
    OK("RANK=1 WORLD_SIZE=2 DDP_STORE_ADDR=[::1]:4000 " TR, "env://", -1, -1, 1, 2, -1, -1,
       "env/env/none/none/env", "127.0.0.1:29500", "[::1]:4000"),
    /* tcp:// and file:// take the address from the URL; rank and world size
     * from the query, the options, or (as a fallback) the environment. */
    OK("DDP_STORE_ADDR=127.0.0.1:4000", "tcp://127.0.0.1:5000?rank=1&world_size=2", -1, -1, 1,
       2, -1, -1, "url/url/none/none/url", "127.0.0.1:5000", "127.0.0.1:5000"),
    OK("RANK=1 WORLD_SIZE=3 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1", "tcp://[::1]:5000", -1, -1, 1, 3,
       0, 1, "env/env/env/env/url", "::1:5000", "[::1]:5000"),
    OK("", "file:///tmp/rdzv-x?rank=0&world_size=1", -1, -1, 0, 1, -1, -1,
       "url/url/none/none/none", ":0", "file:///tmp/rdzv-x"),
    OK("", "file:///tmp/rdzv-x", 1, 3, 1, 3, -1, -1, "options/options/none/none/none", ":0",
       "file:///tmp/rdzv-x"),

    /* Errors name the variable and its value. */
    FAIL("", "env://", -1, -1, "env://: this process's rank is not set: set RANK and WORLD_SIZE"),
    FAIL("", "tcp://127.0.0.1:1", -1, -1, "tcp://: this process's rank is not set"),
    FAIL(TR "RANK=1", "env://", -1, -1,
         "RANK=1 is set but the world size is not: set WORLD_SIZE"),
    FAIL(TR "PMIX_RANK=1", "env://", -1, -1,
         "PMIX_RANK=1 is set but the world size is not: set OMPI_COMM_WORLD_SIZE"),
    FAIL("", "env://?rank=1", -1, -1, "the init url's rank=1 is set but the world size is not"),
    FAIL(TR "RANK=4 WORLD_SIZE=4", "env://", -1, -1,
         "RANK=4 is out of range for WORLD_SIZE=4 (ranks are 0..3)"),
    FAIL(TR "WORLD_SIZE=4", "env://", 4, -1,
         "options.rank=4 is out of range for WORLD_SIZE=4 (ranks are 0..3)"),
    FAIL("SLURM_PROCID=8 SLURM_NTASKS=8", "env://", -1, -1,
         "SLURM_PROCID=8 is out of range for SLURM_NTASKS=8"),
    FAIL(TR "RANK=x WORLD_SIZE=4", "env://", -1, -1,
         "environment variable RANK=\"x\" is not an integer"),
    FAIL(TR "RANK=-1 WORLD_SIZE=4", "env://", -1, -1,
         "environment variable RANK=\"-1\" is out of range"),
    FAIL(TR "RANK=0 WORLD_SIZE=0", "env://", -1, -1,
         "environment variable WORLD_SIZE=\"0\" is out of range"),
    FAIL(TR "RANK=0 WORLD_SIZE=4 LOCAL_RANK=2 LOCAL_WORLD_SIZE=2", "env://", -1, -1,
         "LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"),
    FAIL(TR "RANK=0 WORLD_SIZE=4 LOCAL_WORLD_SIZE=8", "env://", -1, -1,
         "LOCAL_WORLD_SIZE=8 exceeds the world size 4"),
    FAIL("RANK=0 WORLD_SIZE=2 MASTER_PORT=29500", "env://", -1, -1,
         "env://: MASTER_ADDR is not set"),
    FAIL("RANK=0 WORLD_SIZE=2 MASTER_ADDR=h", "env://", -1, -1, "env://: MASTER_PORT is not set"),
    FAIL("RANK=0 WORLD_SIZE=2 MASTER_ADDR=h MASTER_PORT=70000", "env://", -1, -1,
         "environment variable MASTER_PORT=\"70000\" is out of range (expected 1..65535)"),
    FAIL("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_SIZE=2", "env://",
         -1, -1, "env:// under MPI: MASTER_ADDR is not set and the 4 ranks are not all on this host"),
    FAIL("PMI_RANK=0 PMI_SIZE=4", "env://", -1, -1, "under MPI: MASTER_ADDR is not set"),
    FAIL("SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_NODELIST=node[1-", "env://", -1, -1,
         "SLURM_NODELIST: hostlist 'node[1-': expected a number in brackets at offset 7"),
    FAIL("SLURM_PROCID=0 SLURM_NTASKS=2", "env://", -1, -1,
         "MASTER_ADDR is not set and neither is SLURM_NODELIST"),
    FAIL("SLURM_PROCID=0 SLURM_NTASKS=4 SLURM_NODELIST=n1 SLURM_TASKS_PER_NODE=2(x2) SLURM_NODEID=5",
         "env://", -1, -1, "SLURM_TASKS_PER_NODE (SLURM_NODEID=5): tasks-per-node list '2(x2)' covers 2 nodes"),
    FAIL("RANK=1 WORLD_SIZE=2 DDP_STORE_ADDR=localhost", "env://", -1, -1,
         "environment variable DDP_STORE_ADDR=\"localhost\": missing ':port'"),
    FAIL(TR "RANK=1 WORLD_SIZE=2 DDP_TIMEOUT=soon", "env://", -1, -1,
         "environment variable DDP_TIMEOUT=\"soon\" is not a number"),
    FAIL(TR "RANK=1 WORLD_SIZE=2 DDP_TIMEOUT=-5", "env://", -1, -1,
         "DDP_TIMEOUT=\"-5\" must be a positive number of seconds"),
    FAIL(TR "RANK=1 WORLD_SIZE=2", "env://", -1, 0, "options.world_size=0 must be >= 1"),
    FAIL(TR "RANK=1 WORLD_SIZE=2", "env://", -2, -1, "options.rank=-2 is negative"),
};

static void clear_env(void) { rdzv_test_clear_env(); }

static void apply_env(const char *env) { assert_int_equal(rdzv_test_apply_env(env), 0); }

static ddp_status resolve(const char *url, int32_t rank, int32_t world, double timeout,
                          ddp_rendezvous_info *info) {
  ddp__rdzv_url u;
  DDP_TRY(ddp__rdzv_url_parse(url, &u));
  ddp_rendezvous_options o = ddp_rendezvous_defaults();
  o.rank = rank;
  o.world_size = world;
  o.timeout_s = timeout;
  memset(info, 0, sizeof *info);
  return ddp__rdzv_resolve(&u, &o, info);
}

static void test_env_table(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const env_case *c = &cases[i];
    clear_env();
    apply_env(c->env);
    ddp_rendezvous_info info;
    ddp_clear_error();
    ddp_status s = resolve(c->url, c->opt_rank, c->opt_world, c->opt_timeout, &info);
    if (c->error) {
      if (s == DDP_OK || !strstr(ddp_last_error(), c->error))
        fail_msg("case %zu [%s] %s: status %d, error '%s', expected '%s'", i, c->env, c->url, s,
                 ddp_last_error(), c->error);
      continue;
    }
    if (s != DDP_OK) fail_msg("case %zu [%s] %s: %s", i, c->env, c->url, ddp_last_error());
    char sources[128], master[300];
    snprintf(sources, sizeof sources, "%s/%s/%s/%s/%s", ddp_rendezvous_source_name(info.rank_source),
             ddp_rendezvous_source_name(info.world_size_source),
             ddp_rendezvous_source_name(info.local_rank_source),
             ddp_rendezvous_source_name(info.local_world_size_source),
             ddp_rendezvous_source_name(info.master_source));
    snprintf(master, sizeof master, "%s:%d", info.master_addr, (int)info.master_port);
    if (info.rank != c->rank || info.world_size != c->world || info.local_rank != c->local_rank ||
        info.local_world_size != c->local_world || strcmp(sources, c->sources) != 0 ||
        strcmp(master, c->master) != 0 || strcmp(info.store_addr, c->store) != 0 ||
        info.timeout_s != c->timeout)
      fail_msg("case %zu [%s] %s: got rank %d world %d local %d/%d sources %s master %s store %s "
               "timeout %g; expected %d %d %d/%d %s %s %s %g",
               i, c->env, c->url, info.rank, info.world_size, info.local_rank,
               info.local_world_size, sources, master, info.store_addr, info.timeout_s, c->rank,
               c->world, c->local_rank, c->local_world, c->sources, c->master, c->store,
               c->timeout);
  }
  clear_env();
}

static void test_timeout_precedence(void **state) {
  (void)state;
  ddp_rendezvous_info info;
  clear_env();
  apply_env(TR "RANK=0 WORLD_SIZE=2");
  assert_int_equal(resolve("env://", -1, -1, 0, &info), DDP_OK);
  assert_true(info.timeout_s == 1800.0); /* PyTorch's default */
  setenv("DDP_TIMEOUT", "30", 1);
  assert_int_equal(resolve("env://", -1, -1, 0, &info), DDP_OK);
  assert_true(info.timeout_s == 30.0);
  setenv("DDP_TIMEOUT", "2.5", 1);
  assert_int_equal(resolve("env://", -1, -1, 0, &info), DDP_OK);
  assert_true(info.timeout_s == 2.5);
  assert_int_equal(resolve("env://", -1, -1, 5.0, &info), DDP_OK); /* options win */
  assert_true(info.timeout_s == 5.0);
  assert_string_equal(info.init_method, "env");
  assert_int_equal(info.store_is_external, 0);
  clear_env();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env_table),
      cmocka_unit_test(test_timeout_precedence),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
