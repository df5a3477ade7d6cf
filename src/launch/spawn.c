/* ddp_spawn: torch.multiprocessing.spawn in C. The calling process forks the
 * store's process (store_proc.c) and supervises forked workers that run
 * fn(rank, arg) with torchrun's environment, exactly as ddprun's workers on
 * one node. The caller must be single-threaded, as with mp.spawn's fork
 * start method: a worker is a fork without exec, and a lock another thread
 * held at the fork (malloc's, stdio's) stays held in the worker forever. */
#include <stdio.h>
#include <string.h>

#include "launch/launch_internal.h"

extern char **environ;

typedef struct spawn_ctx {
  ddp_spawn_fn fn;
  void *arg;
} spawn_ctx;

ddp_spawn_options ddp_spawn_defaults(void) {
  ddp_spawn_options opts;
  memset(&opts, 0, sizeof opts);
  opts.grace_s = DDP__LAUNCH_DEFAULT_GRACE_S;
  opts.tail_lines = DDP__LAUNCH_DEFAULT_TAIL;
  return opts;
}

static ddp_status make_fn_specs(void *ctx_, const ddp__world *world, int32_t attempt,
                                ddp__worker_spec *specs) {
  spawn_ctx *ctx = ctx_;
  for (int32_t i = 0; i < world->nproc; i++) {
    DDP_TRY(ddp__worker_env(environ, world, i, attempt, &specs[i].envp));
    specs[i].fn = ctx->fn;
    specs[i].arg = ctx->arg;
    specs[i].show[0] = specs[i].show[1] = 1;
  }
  return DDP_OK;
}

static void free_fn_specs(void *ctx, const ddp__world *world, ddp__worker_spec *specs) {
  (void)ctx;
  for (int32_t i = 0; i < world->nproc; i++) {
    ddp_free(specs[i].envp);
    specs[i].envp = NULL;
  }
}

ddp_status ddp_spawn(int32_t nprocs, ddp_spawn_fn fn, void *arg, const ddp_spawn_options *opts_in) {
  ddp_spawn_options opts = opts_in ? *opts_in : ddp_spawn_defaults();
  if (nprocs < 1 || !fn)
    return ddp_error(DDP_ERR_INVALID, "ddp_spawn: nprocs=%d must be >= 1 and fn non-NULL", (int)nprocs);
  if (opts.max_restarts < 0) return ddp_error(DDP_ERR_INVALID, "ddp_spawn: max_restarts=%d is negative", (int)opts.max_restarts);
  if (opts.bind < DDP_LAUNCH_BIND_AUTO || opts.bind > DDP_LAUNCH_BIND_HWTHREAD || opts.threads_per_worker < 0)
    return ddp_error(DDP_ERR_INVALID, "ddp_spawn: bind=%d or threads_per_worker=%d is not valid", (int)opts.bind,
                     (int)opts.threads_per_worker);
  /* Only a debug note: a library's idle pool that stops itself around fork
   * (OpenBLAS's threads, through pthread_atfork) is a thread here too. */
  int32_t threads = ddp__thread_count();
  if (threads > 1)
    DDP_DEBUG("ddp_spawn: the calling process has %d threads; its workers are forked without exec, and one "
              "forked while another thread holds a lock (malloc's, stdio's) deadlocks. Call ddp_spawn before "
              "starting threads (or run the program under ddprun)",
              (int)threads);
  ddp_launch_config cfg = ddp_launch_defaults();
  cfg.nproc_per_node = nprocs;
  cfg.max_restarts = opts.max_restarts;
  cfg.bind = opts.bind;
  cfg.report_bindings = opts.report_bindings;
  cfg.threads_per_worker = opts.threads_per_worker;
  snprintf(cfg.rdzv_id, sizeof cfg.rdzv_id, "spawn");
  spawn_ctx ctx = {.fn = fn, .arg = arg};
  ddp__job job = {
      .tool = "ddp_spawn",
      .max_restarts = opts.max_restarts,
      .tail_lines = opts.tail_lines > 0 ? opts.tail_lines : DDP__LAUNCH_DEFAULT_TAIL,
      .quiet = opts.quiet,
      .grace_s = opts.grace_s >= 0 ? opts.grace_s : DDP__LAUNCH_DEFAULT_GRACE_S,
      .monitor_interval_s = cfg.monitor_interval_s,
      .make_specs = make_fn_specs,
      .free_specs = free_fn_specs,
      .ctx = &ctx,
  };
  int code;
  ddp__event ev;
  ddp_status st = ddp__job_launch(&cfg, &job, opts.timeout_s, &code, &ev);
  if (st) return ddp_error_wrap(st, "ddp_spawn");
  if (code == 0) return DDP_OK;
  if (ev == DDP__EVENT_TIMEOUT)
    return ddp_error(DDP_ERR_TIMEOUT, "ddp_spawn: the %d workers did not finish within %g s", (int)nprocs, opts.timeout_s);
  if (ev == DDP__EVENT_SIGNAL) return ddp_error(DDP_ERR_ABORTED, "ddp_spawn: %s", job.failure);
  return ddp_error(DDP_ERR_PEER, "ddp_spawn: %s", job.failure);
}
