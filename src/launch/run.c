/* ddp_launch_run: ddprun's job on one node. Resolves the configuration
 * (standalone, ports), opens the node agent (store, node rendezvous), prepares
 * each worker's command line, environment and log files, and hands the
 * attempts to the supervisor. */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "launch/launch_internal.h"

extern char **environ;

typedef struct exec_ctx {
  const ddp_launch_config *cfg;
  char log_root[DDP_LAUNCH_PATH_BYTES]; /* "" : no log files */
} exec_ctx;

/* mkdir -p for the log directories. */
static ddp_status make_dirs(const char *path) {
  char buf[DDP_LAUNCH_PATH_BYTES];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == '\0') {
      char c = *p;
      *p = '\0';
      if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return ddp_error(DDP_ERR_IO, "ddprun: cannot create the log directory %s: %s", buf, strerror(errno));
      *p = c;
      if (c == '\0') break;
    }
  }
  return DDP_OK;
}

static int ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* The worker's argv: [python -u [-m]] program [--local-rank=N] args... */
static char **make_argv(const ddp_launch_config *cfg, int32_t local_rank) {
  int python = cfg->module || (!cfg->no_python && ends_with(cfg->program, ".py"));
  /* python, -u, -m, program, --local-rank=N, the args, NULL, the flag's buffer */
  size_t n = (size_t)cfg->num_args + 7;
  char **argv = ddp_calloc(n, sizeof *argv);
  char *flag = ddp_alloc(32);
  if (!argv || !flag) {
    ddp_free(argv);
    ddp_free(flag);
    return NULL;
  }
  size_t k = 0;
  if (python) {
    argv[k++] = (char *)ddp_env_str("PYTHON", "python3");
    argv[k++] = "-u"; /* unbuffered, as torchrun: output reaches the console and the tails at once */
    if (cfg->module) argv[k++] = "-m";
  }
  argv[k++] = (char *)cfg->program;
  snprintf(flag, 32, "--local-rank=%d", (int)local_rank);
  if (cfg->pass_local_rank) argv[k++] = flag;
  for (int32_t i = 0; i < cfg->num_args; i++) argv[k++] = cfg->args[i];
  argv[k] = NULL;
  /* The flag's buffer rides after the NULL so free_specs can find it. */
  argv[k + 1] = flag;
  return argv;
}

static void free_exec_specs(void *ctx, const ddp__world *world, ddp__worker_spec *specs) {
  (void)ctx;
  for (int32_t i = 0; i < world->nproc; i++) {
    ddp_free(specs[i].envp);
    if (specs[i].argv) {
      size_t k = 0;
      while (specs[i].argv[k]) k++;
      ddp_free(specs[i].argv[k + 1]);
      ddp_free(specs[i].argv);
    }
    specs[i].envp = specs[i].argv = NULL;
  }
}

static ddp_status make_exec_specs(void *ctx_, const ddp__world *world, int32_t attempt,
                                  ddp__worker_spec *specs) {
  exec_ctx *ctx = ctx_;
  const ddp_launch_config *cfg = ctx->cfg;
  for (int32_t i = 0; i < world->nproc; i++) {
    ddp__worker_spec *s = &specs[i];
    DDP_TRY(ddp__worker_env(environ, world, i, attempt, &s->envp));
    ddp__error_file_path(world, attempt, i, s->error_path, sizeof s->error_path);
    if (s->error_path[0]) {
      /* Its folder must exist for the worker to write there, and a record
       * from an earlier run in the same folder is not this worker's. */
      char dir[DDP_LAUNCH_PATH_BYTES];
      snprintf(dir, sizeof dir, "%s", s->error_path);
      *strrchr(dir, '/') = '\0';
      DDP_TRY(make_dirs(dir));
      if (unlink(s->error_path) != 0 && errno != ENOENT)
        return ddp_error(DDP_ERR_IO, "ddprun: cannot remove the old error record %s: %s", s->error_path,
                         strerror(errno));
    }
    s->argv = make_argv(cfg, i);
    if (!s->argv) return ddp_error(DDP_ERR_NOMEM, "ddprun: out of memory for a command line");
    int redirect, tee, shown;
    DDP_TRY(ddp__std_spec_for("--redirects", cfg->redirects, i, &redirect));
    DDP_TRY(ddp__std_spec_for("--tee", cfg->tee, i, &tee));
    DDP_TRY(ddp__filter_allows(cfg->local_ranks_filter, i, &shown));
    for (int k = 0; k < 2; k++) {
      int bit = k ? 2 : 1;
      s->show[k] = shown && !(redirect & bit);
      if (ctx->log_root[0] && ((redirect | tee) & bit || cfg->log_dir[0])) {
        char dir[DDP_LAUNCH_PATH_BYTES];
        snprintf(dir, sizeof dir, "%.*s/attempt_%d/%d", (int)(sizeof dir - 64), ctx->log_root, (int)attempt, (int)i);
        DDP_TRY(make_dirs(dir));
        snprintf(s->log_path[k], sizeof s->log_path[k], "%.*s/%s", (int)(sizeof dir - 16), dir,
                 k ? "stderr.log" : "stdout.log");
      }
    }
  }
  return DDP_OK;
}

/* Removes the empty folders left under dir (the workers' error-file
 * folders of a run whose workers recorded nothing), deepest first; a folder
 * that holds anything stays, and so does everything above it. */
static int remove_if_empty(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)ftw;
  if (flag == FTW_DP) rmdir(path); /* fails, harmlessly, when not empty */
  return 0;
}

static void prune_empty(const char *dir) {
  if (dir[0]) nftw(dir, remove_if_empty, 16, FTW_DEPTH | FTW_PHYS);
}

/* --standalone: a random run id (torchrun uses a uuid). */
static void random_run_id(char *buf, size_t bytes) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  snprintf(buf, bytes, "standalone-%016llx", (unsigned long long)x);
}

/* The log directory of this run: --log-dir/<run id>, or a temporary one when
 * only --redirects/--tee ask for files (as torchrun). */
static ddp_status log_root(const ddp_launch_config *cfg, char *out, size_t bytes) {
  out[0] = '\0';
  if (cfg->log_dir[0]) {
    snprintf(out, bytes, "%.*s/%s", (int)(bytes - sizeof cfg->rdzv_id - 2), cfg->log_dir, cfg->rdzv_id);
    return make_dirs(out);
  }
  if (!cfg->redirects[0] && !cfg->tee[0]) return DDP_OK;
  char tmpl[] = "/tmp/ddprun-XXXXXX";
  if (!mkdtemp(tmpl)) return ddp_error(DDP_ERR_IO, "ddprun: cannot create a log directory in /tmp: %s", strerror(errno));
  snprintf(out, bytes, "%s", tmpl);
  fprintf(stderr, "ddprun: --redirects/--tee without --log-dir: logs in %s\n", out);
  return DDP_OK;
}

ddp_status ddp_launch_run(const ddp_launch_config *cfg_in, int *exit_code) {
  *exit_code = 1;
  ddp_launch_config cfg = *cfg_in;
  if (!cfg.program) return ddp_error(DDP_ERR_INVALID, "ddprun: no program to run");
  if (cfg.nproc_per_node < 1 || cfg.nnodes < 1 || cfg.max_restarts < 0 || !(cfg.monitor_interval_s > 0))
    return ddp_error(DDP_ERR_INVALID, "ddprun: invalid configuration (nproc_per_node %d, nnodes %d, "
                     "max_restarts %d, monitor_interval %g)", (int)cfg.nproc_per_node, (int)cfg.nnodes,
                     (int)cfg.max_restarts, cfg.monitor_interval_s);
  if (cfg.standalone) {
    cfg.nnodes = 1;
    cfg.node_rank = 0;
    random_run_id(cfg.rdzv_id, sizeof cfg.rdzv_id);
  }
  exec_ctx ctx = {.cfg = &cfg};
  DDP_TRY(log_root(&cfg, ctx.log_root, sizeof ctx.log_root));
  if (cfg.trace_dir) DDP_TRY(make_dirs(cfg.trace_dir));
  ddp__job job = {
      .tool = "ddprun",
      .may_fail = cfg.may_fail,
      .max_restarts = cfg.max_restarts,
      .tail_lines = cfg.tail_lines,
      .grace_s = cfg.grace_s,
      .monitor_interval_s = cfg.monitor_interval_s,
      .make_specs = make_exec_specs,
      .free_specs = free_exec_specs,
      .ctx = &ctx,
      .error_dir = ctx.log_root,
  };
  ddp__event ev;
  char error_dir[DDP_LAUNCH_PATH_BYTES] = "";
  job.error_dir_out = error_dir;
  job.error_dir_out_bytes = sizeof error_dir;
  ddp_status st = ddp__job_launch(&cfg, &job, cfg.job_timeout_s, exit_code, &ev);
  /* Under the run's DDP_DEBUG_DIR (no --log-dir), folders nobody wrote to
   * are removed, and the run's folder with them when it is empty. */
  if (!ctx.log_root[0] && error_dir[0]) {
    prune_empty(error_dir);
    char *slash = strrchr(error_dir, '/');
    if (slash && !getenv("DDP_DEBUG_DIR")) { /* the user's own folder stays */
      *slash = '\0';
      rmdir(error_dir);
    }
  }
  if (st == DDP_OK && ev == DDP__EVENT_TIMEOUT)
    fprintf(stderr, "ddprun: the job timeout (--job-timeout %g s) passed; the workers were stopped\n",
            cfg.job_timeout_s);
  /* The ranks' timelines, whatever the job's end: a failed run's are the
   * ones worth seeing. A merge that fails is told, not the job's failure. */
  if (cfg.trace_dir) {
    int ranks = 0;
    if (ddp__trace_merge(cfg.trace_dir, &ranks) == DDP_OK)
      fprintf(stderr, "ddprun: the timeline of %d rank%s is in %s/trace.json\n", ranks,
              ranks == 1 ? "" : "s", cfg.trace_dir);
    else
      fprintf(stderr, "ddprun: --trace: %s\n", ddp_last_error());
  }
  return st;
}
