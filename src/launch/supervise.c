/* Attempts and restarts: start the node's workers, watch them, and when one
 * fails (or another node's did) stop the rest, print the summary, agree with
 * the other nodes, and start the whole group again while restarts are left.
 * Shared by ddprun (run.c) and ddp_spawn (spawn.c). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

extern char **environ;

/* A failure published with DDP__STOP_MARK stops every node without a
 * restart (a signal to one ddprun, a job timeout). */
#define STOP_MARK DDP__STOP_MARK

void ddp__job_stop(ddp__job *job, ddp__worker_group *g, int32_t attempt, ddp__event ev, char *failure,
                   size_t bytes) {
  ddp__agent *a = job->agent;
  char signame[32];
  switch (ev) {
    case DDP__EVENT_FAILED:
      /* Other nodes hear of it now, so their workers dump while ours do. */
      ddp__summary_first(g, a->host, failure, bytes);
      ddp__agent_announce_failure(a, attempt, failure);
      g->flight_verdict = ddp__flight_gather(g, a, attempt, !job->quiet);
      ddp__worker_group_stop(g, SIGTERM, job->grace_s);
      break;
    case DDP__EVENT_SIGNAL:
      ddp__worker_group_stop(g, g->stop_signal, job->grace_s);
      snprintf(failure, bytes, STOP_MARK "node %d (%s) received %s", (int)a->world.node_rank, a->host,
               ddp__signal_name(g->stop_signal, signame, sizeof signame));
      break;
    case DDP__EVENT_TIMEOUT:
      g->flight_verdict = ddp__flight_gather(g, a, attempt, !job->quiet);
      ddp__worker_group_stop(g, SIGTERM, job->grace_s);
      snprintf(failure, bytes, STOP_MARK "node %d (%s): the job timeout passed during attempt %d",
               (int)a->world.node_rank, a->host, (int)attempt);
      break;
    case DDP__EVENT_EXTERNAL:
      /* The failed node judges; ours only dump (into the store it reads). */
      ddp_free(ddp__flight_gather(g, a, attempt, 0));
      ddp__worker_group_stop(g, SIGTERM, job->grace_s);
      failure[0] = '\0'; /* the other node's failure is the verdict */
      break;
    case DDP__EVENT_ERROR:
      ddp__worker_group_stop(g, SIGTERM, job->grace_s);
      snprintf(failure, bytes, STOP_MARK "node %d (%s) lost the job's store", (int)a->world.node_rank, a->host);
      break;
    case DDP__EVENT_STORE: {
      ddp__worker_group_stop(g, SIGTERM, job->grace_s);
      char what[256];
      ddp__store_proc_describe(&a->server, what, sizeof what);
      snprintf(failure, bytes, STOP_MARK "node %d (%s): %s during attempt %d; the job cannot go on without its store",
               (int)a->world.node_rank, a->host, what, (int)attempt);
      break;
    }
    case DDP__EVENT_DONE:
      failure[0] = '\0';
      break;
  }
}

/* The summary goes to stderr without waiting on a console that stopped
 * reading (DRAIN limit as for the workers' output): composed in memory,
 * then written while stderr takes it. */
void ddp__job_print_summary(const char *tool, const ddp__worker_group *g, const char *host, int32_t attempt,
                            const char *headline) {
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (!mem) {
    ddp__summary_print(stderr, tool, g, host, attempt, headline);
    return;
  }
  ddp__summary_print(mem, tool, g, host, attempt, headline);
  fclose(mem);
  fflush(stderr);
  ddp__console_write_bounded(2, text, len, 2.0);
  free(text); /* open_memstream's buffer comes from malloc */
}

/* --report-bindings: one line per worker as it starts, as mpirun's. */
static void report_bindings(const ddp__job *job, const ddp__worker_group *g) {
  for (int32_t i = 0; i < g->n; i++) {
    const ddp__worker *w = &g->workers[i];
    char where[512];
    ddp__placement_describe(&job->placement, i, where, sizeof where);
    fprintf(stderr, "%s: rank %d (local rank %d, pid %ld) %s\n", job->tool, (int)w->rank, (int)w->local_rank,
            (long)w->pid, where);
  }
  fflush(stderr);
}

ddp_status ddp__job_start_group(ddp__job *job, int32_t attempt, ddp__worker_spec *specs, ddp__worker_group *g) {
  ddp__agent *a = job->agent;
  int32_t n = a->world.nproc;
  memset(specs, 0, (size_t)n * sizeof *specs);
  ddp_status st = job->make_specs(job->ctx, &a->world, attempt, specs);
  for (int32_t i = 0; i < n && job->placement.bound; i++) specs[i].cpus = &job->placement.cpus[i];
  memset(g, 0, sizeof *g);
  g->monitor_interval_s = job->monitor_interval_s;
  g->may_fail = job->may_fail;
  g->poll_hook = !a->store ? NULL : a->elastic_min > 0 ? ddp__elastic_poll : ddp__agent_poll;
  g->poll_ctx = a;
  g->store = a->server.pid > 0 ? &a->server : NULL;
  if (st == DDP_OK) st = ddp__worker_group_start(g, n, a->world.rank_offset, specs, job->tail_lines);
  job->free_specs(job->ctx, &a->world, specs);
  if (st) {
    ddp__worker_group_free(g);
    memset(g, 0, sizeof *g);
    return st;
  }
  if (job->report_bindings) report_bindings(job, g);
  return DDP_OK;
}

ddp_status ddp__job_run(ddp__job *job, int *exit_code, ddp__event *event) {
  ddp__agent *a = job->agent;
  int32_t n = a->world.nproc;
  *exit_code = 1;
  *event = DDP__EVENT_FAILED;
  job->failure[0] = '\0';
  ddp__worker_spec *specs = ddp_calloc((size_t)n, sizeof *specs);
  if (!specs) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for %d workers", job->tool, (int)n);
  ddp_status st = DDP_OK;
  for (int32_t attempt = 0;; attempt++) {
    a->attempt = attempt;
    ddp__worker_group g;
    st = ddp__job_start_group(job, attempt, specs, &g);
    if (st) break;
    ddp__event ev = ddp__worker_group_monitor(&g, job->deadline_s);
    char failure[sizeof job->failure];
    ddp__job_stop(job, &g, attempt, ev, failure, sizeof failure);
    if (ev == DDP__EVENT_STORE) {
      /* Nothing to agree on: the other nodes lose the store too. */
      snprintf(job->failure, sizeof job->failure, "%s", failure);
      ddp__worker_group_free(&g);
      *event = ev;
      st = ddp_error(DDP_ERR_CLOSED, "%s", failure + strlen(STOP_MARK));
      break;
    }
    int restart_left = attempt < job->max_restarts;
    int any_failed = 0;
    ddp_status agreed = ddp__agent_end_attempt(a, attempt, ev == DDP__EVENT_DONE || !failure[0] ? NULL : failure,
                                               job->deadline_s, &any_failed);
    if (ev != DDP__EVENT_DONE && ev != DDP__EVENT_EXTERNAL) any_failed = 1;
    const char *remote = a->remote_failure;
    int stop_all = strncmp(failure, STOP_MARK, strlen(STOP_MARK)) == 0 ||
                   strncmp(remote, STOP_MARK, strlen(STOP_MARK)) == 0 || agreed != DDP_OK;
    int again = any_failed && restart_left && !stop_all;
    if (ev == DDP__EVENT_FAILED && !job->quiet) {
      char headline[160];
      if (again)
        snprintf(headline, sizeof headline, "restarting the group (restart %d of %d)", (int)attempt + 1,
                 (int)job->max_restarts);
      else
        snprintf(headline, sizeof headline, "the job failed%s", job->max_restarts ? " (no restarts left)" : "");
      ddp__job_print_summary(job->tool, &g, a->host, attempt, headline);
    } else if (ev == DDP__EVENT_TIMEOUT && g.flight_verdict && !job->quiet) {
      ddp__flight_print(stderr, job->tool, g.flight_verdict);
    } else if (any_failed && remote[0] && !job->quiet) {
      fprintf(stderr, "%s: node %d stopped its workers: %s%s\n", job->tool, (int)a->world.node_rank,
              strncmp(remote, STOP_MARK, strlen(STOP_MARK)) == 0 ? "" : "another node failed: ", remote);
      if (again)
        fprintf(stderr, "%s: restarting the group (restart %d of %d)\n", job->tool, (int)attempt + 1,
                (int)job->max_restarts);
    }
    if (!job->failure[0]) snprintf(job->failure, sizeof job->failure, "%s", failure[0] ? failure : remote);
    const int32_t let_go = g.num_let_go;
    ddp__worker_group_free(&g);
    *event = ev;
    if (agreed != DDP_OK) {
      st = agreed;
      break;
    }
    if (!any_failed) {
      if (let_go && !job->quiet)
        fprintf(stderr, "%s: the job finished; %d worker%s failed and %s let go (--may-fail)\n", job->tool,
                (int)let_go, let_go == 1 ? "" : "s", let_go == 1 ? "was" : "were");
      *exit_code = 0;
      job->failure[0] = '\0';
      break;
    }
    if (ev == DDP__EVENT_SIGNAL) {
      *exit_code = 128 + g.stop_signal;
      break;
    }
    if (!again) break;
    job->failure[0] = '\0'; /* a new attempt: its failure is the one to report */
  }
  ddp_free(specs);
  return st;
}

ddp_status ddp__job_launch(const ddp_launch_config *cfg, ddp__job *job, double timeout_s,
                           int *exit_code, ddp__event *event) {
  *exit_code = 1;
  *event = DDP__EVENT_FAILED;
  double start = ddp_time_s();
  /* Before the node rendezvous: a --bind that cannot be met fails at once. */
  DDP_TRY(ddp__placement_decide((ddp_launch_bind)cfg->bind, cfg->nproc_per_node, cfg->threads_per_worker, environ,
                                &job->placement));
  ddp__placement_note(&job->placement, job->tool, stderr);
  job->report_bindings = cfg->report_bindings;
  ddp__agent agent;
  ddp_status st = ddp__agent_open(cfg, &agent);
  if (st) {
    ddp__placement_free(&job->placement);
    return st;
  }
  agent.world.omp_threads = cfg->threads_per_worker;
  agent.world.trace_dir = cfg->trace_dir;
  ddp__flight_debug_dir(agent.world.run_id, (int64_t)getpid(), agent.world.debug_dir, sizeof agent.world.debug_dir);
  if (job->error_dir && job->error_dir[0])
    snprintf(agent.world.error_dir, sizeof agent.world.error_dir, "%s", job->error_dir);
  else if (job->error_dir && agent.world.debug_dir[0])
    /* The pid keeps this agent's records apart from other runs' when
     * DDP_DEBUG_DIR is one folder for many (each prunes its own at the
     * end; a shared errors/ had one run's pruning remove the folders
     * another was creating, and two runs' workers sharing records). */
    snprintf(agent.world.error_dir, sizeof agent.world.error_dir, "%.*s/errors-%ld",
             (int)sizeof agent.world.error_dir - 32, agent.world.debug_dir, (long)getpid());
  if (job->error_dir_out) snprintf(job->error_dir_out, job->error_dir_out_bytes, "%s", agent.world.error_dir);
  st = ddp__signals_install();
  if (st == DDP_OK) {
    job->agent = &agent;
    job->deadline_s = timeout_s > 0 ? start + timeout_s : 0;
    st = agent.elastic_min > 0 ? ddp__job_run_elastic(job, exit_code, event) : ddp__job_run(job, exit_code, event);
    job->agent = NULL;
    ddp__signals_restore();
  }
  ddp__agent_close(&agent);
  ddp__placement_free(&job->placement);
  return st;
}
