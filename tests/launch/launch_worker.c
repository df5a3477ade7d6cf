/* A worker for the launcher's tests: joins the job with
 * ddp_init_process_group("env://"), checks its environment against what the
 * test expects, passes a barrier and an allreduce, and prints one line
 * "launch_worker rank R/W local L/LW node G/GW restart C pid P ok".
 * Options (all optional):
 *   --nproc N --nnodes N     expected LOCAL_WORLD_SIZE and GROUP_WORLD_SIZE
 *   --die-rank R --die-how kill|exit|segv  rank R dies that way after the
 *                            barrier (only on restart count --die-attempt, default 0; -1: every attempt)
 *   --hang                   the other ranks then sleep (to be stopped)
 *   --sleep S                sleep S seconds before exiting
 *   --pidfile DIR            write DIR/pid.<rank>
 *   --no-init                skip the process group (environment checks only)
 *   --print-time             print "past_barrier <unix time, s>" after the barrier
 *                            (scripts/bench-launch.sh)
 *   --spew-rank R --spew MB  rank R first prints MB megabytes to stdout, lines
 *                            "spew <i> <padding>" numbered from 0
 *   --spew-exit C            then rank R exits with code C at once
 *   --freeze-launcher MS     the dying rank first stops its launcher (SIGSTOP to
 *                            its parent) and has a helper resume it MS ms later, so
 *                            the deaths its own causes reach the launcher in one batch
 *   --check-final            a failing final barrier prints the error and exits 7
 *                            (the ranks that outlive a dead peer fail visibly) */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"

static int fails = 0;

static long env_long(const char *name) {
  const char *v = getenv(name);
  if (!v) {
    fprintf(stderr, "launch_worker: %s is not set\n", name);
    fails++;
    return -1;
  }
  return strtol(v, NULL, 10);
}

static void expect_str(const char *name, const char *want) {
  const char *v = getenv(name);
  if (!v || strcmp(v, want) != 0) {
    fprintf(stderr, "launch_worker: %s=%s, expected %s\n", name, v ? v : "(unset)", want);
    fails++;
  }
}

static void expect_eq(const char *what, long got, long want) {
  if (got != want) {
    fprintf(stderr, "launch_worker: %s=%ld, expected %ld\n", what, got, want);
    fails++;
  }
}

int main(int argc, char **argv) {
  long nproc = -1, nnodes = -1, die_rank = -1, die_attempt = 0;
  const char *die_how = "kill", *pidfile = NULL;
  double sleep_s = 0;
  int hang = 0, init = 1, print_time = 0, check_final = 0;
  long spew_rank = -1, spew_exit = -1;
  double spew_mb = 0;
  long freeze_ms = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = atol(argv[++i]);
    else if (!strcmp(argv[i], "--nnodes") && i + 1 < argc) nnodes = atol(argv[++i]);
    else if (!strcmp(argv[i], "--die-rank") && i + 1 < argc) die_rank = atol(argv[++i]);
    else if (!strcmp(argv[i], "--die-how") && i + 1 < argc) die_how = argv[++i];
    else if (!strcmp(argv[i], "--die-attempt") && i + 1 < argc) die_attempt = atol(argv[++i]);
    else if (!strcmp(argv[i], "--sleep") && i + 1 < argc) sleep_s = atof(argv[++i]);
    else if (!strcmp(argv[i], "--pidfile") && i + 1 < argc) pidfile = argv[++i];
    else if (!strcmp(argv[i], "--hang")) hang = 1;
    else if (!strcmp(argv[i], "--no-init")) init = 0;
    else if (!strcmp(argv[i], "--print-time")) print_time = 1;
    else if (!strcmp(argv[i], "--check-final")) check_final = 1;
    else if (!strcmp(argv[i], "--freeze-launcher") && i + 1 < argc) freeze_ms = atol(argv[++i]);
    else if (!strcmp(argv[i], "--spew-rank") && i + 1 < argc) spew_rank = atol(argv[++i]);
    else if (!strcmp(argv[i], "--spew") && i + 1 < argc) spew_mb = atof(argv[++i]);
    else if (!strcmp(argv[i], "--spew-exit") && i + 1 < argc) spew_exit = atol(argv[++i]);
    else if (!strncmp(argv[i], "--local-rank=", 13)) expect_eq("--local-rank", atol(argv[i] + 13), env_long("LOCAL_RANK"));
    else {
      fprintf(stderr, "launch_worker: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  long rank = env_long("RANK"), world = env_long("WORLD_SIZE");
  long local = env_long("LOCAL_RANK"), local_world = env_long("LOCAL_WORLD_SIZE");
  long group = env_long("GROUP_RANK"), groups = env_long("GROUP_WORLD_SIZE");
  long restart = env_long("TORCHELASTIC_RESTART_COUNT");
  env_long("MASTER_PORT");
  env_long("TORCHELASTIC_MAX_RESTARTS");
  if (!getenv("MASTER_ADDR") || !getenv("DDP_STORE_ADDR") || !getenv("TORCHELASTIC_RUN_ID")) {
    fprintf(stderr, "launch_worker: MASTER_ADDR, DDP_STORE_ADDR or TORCHELASTIC_RUN_ID is not set\n");
    fails++;
  }
  expect_eq("ROLE_RANK", env_long("ROLE_RANK"), rank);
  expect_eq("ROLE_WORLD_SIZE", env_long("ROLE_WORLD_SIZE"), world);
  expect_str("ROLE_NAME", "default");
  expect_str("TORCHELASTIC_USE_AGENT_STORE", "False");
  if (nproc > 0) expect_eq("LOCAL_WORLD_SIZE", local_world, nproc);
  if (nnodes > 0) expect_eq("GROUP_WORLD_SIZE", groups, nnodes);
  if (nproc > 0 && nnodes > 0) {
    expect_eq("WORLD_SIZE", world, nproc * nnodes);
    expect_eq("RANK", rank, group * nproc + local);
  }
  if (local_world > 1 && !getenv("OMP_NUM_THREADS")) {
    fprintf(stderr, "launch_worker: OMP_NUM_THREADS is not set\n");
    fails++;
  }
  if (pidfile) {
    char path[4096];
    snprintf(path, sizeof path, "%s/pid.%ld", pidfile, rank);
    FILE *f = fopen(path, "w");
    if (f) {
      fprintf(f, "%ld\n", (long)getpid());
      fclose(f);
    }
  }
  if (fails) return 3;
  if (rank == spew_rank && spew_mb > 0) {
    /* 100-byte lines: "spew <i> " padded with x to 99 characters. */
    long lines = (long)(spew_mb * 1e6 / 100.0);
    char line[128];
    for (long i = 0; i < lines; i++) {
      int n = snprintf(line, sizeof line, "spew %ld ", i);
      memset(line + n, 'x', (size_t)(99 - n));
      line[99] = '\n';
      fwrite(line, 1, 100, stdout);
    }
    fflush(stdout);
    if (spew_exit >= 0) {
      fprintf(stderr, "launch_worker: rank %ld spewed %ld lines, exits %ld\n", rank, lines, spew_exit);
      return (int)spew_exit;
    }
  }
  if (init) {
    ddp_process_group *pg = NULL;
    if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) {
      fprintf(stderr, "launch_worker: init: %s\n", ddp_last_error());
      return 4;
    }
    expect_eq("ddp rank", ddp_process_group_rank(pg), rank);
    expect_eq("ddp world", ddp_process_group_size(pg), world);
    if (ddp_barrier(pg) != DDP_OK) {
      fprintf(stderr, "launch_worker: barrier: %s\n", ddp_last_error());
      return 5;
    }
    if (print_time) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      printf("past_barrier %.6f\n", (double)ts.tv_sec + ts.tv_nsec * 1e-9);
    }
    /* Every rank contributes rank+1: the sum is world*(world+1)/2. */
    double x = (double)rank + 1;
    if (ddp_allreduce(pg, &x, 1, DDP_FLOAT64, DDP_REDUCE_SUM) != DDP_OK) {
      fprintf(stderr, "launch_worker: allreduce: %s\n", ddp_last_error());
      return 6;
    }
    expect_eq("allreduce sum", (long)x, world * (world + 1) / 2);
    printf("launch_worker rank %ld/%ld local %ld/%ld node %ld/%ld restart %ld pid %ld ok\n", rank, world, local,
           local_world, group, groups, restart, (long)getpid());
    fflush(stdout);
    if (rank == die_rank && (die_attempt < 0 || restart == die_attempt)) {
      fprintf(stderr, "launch_worker: rank %ld dies now (%s)\n", rank, die_how);
      if (freeze_ms > 0) {
        pid_t launcher = getppid();
        pid_t helper = fork();
        if (helper == 0) {
          usleep((useconds_t)(freeze_ms * 1000));
          kill(launcher, SIGCONT);
          _exit(0);
        }
        if (helper > 0) kill(launcher, SIGSTOP);
      }
      if (!strcmp(die_how, "exit")) return 3;
      raise(!strcmp(die_how, "segv") ? SIGSEGV : SIGKILL);
    }
    if (hang && die_rank >= 0 && (die_attempt < 0 || restart == die_attempt)) {
      for (;;) pause();
    }
    if (sleep_s > 0) usleep((useconds_t)(sleep_s * 1e6));
    /* Rank 0 of a job with no launcher hosts the store: a final barrier. */
    if (ddp_barrier(pg) != DDP_OK && check_final) {
      fprintf(stderr, "launch_worker: rank %ld: final barrier: %s\n", rank, ddp_last_error());
      fflush(stderr);
      ddp_process_group_destroy(pg); /* no leak report under ASan to change the exit code */
      return 7;
    }
    ddp_process_group_destroy(pg);
  } else {
    printf("launch_worker rank %ld/%ld local %ld/%ld node %ld/%ld restart %ld pid %ld ok\n", rank, world, local,
           local_world, group, groups, restart, (long)getpid());
    if (sleep_s > 0) usleep((useconds_t)(sleep_s * 1e6));
  }
  return fails ? 3 : 0;
}
