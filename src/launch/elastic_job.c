/* An elastic job on this node (--nnodes MIN:MAX): round after round, join
 * the next round (elastic.c), run this node's workers with that round's
 * world, and decide what their end means: the job is done (every node of the
 * round succeeded), a scale event (a node arrived: a new round, not counted
 * against --max-restarts), or a failure (a worker's, another node's, a node
 * gone silent: a new round while restarts are left, as torchrun counts
 * them). A signal to this node's ddprun makes it leave: its workers stop and
 * the others re-form without it, as when torchrun's agent is stopped. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "launch/launch_internal.h"

static void say_round(const ddp__job *job, const ddp__agent *a) {
  if (job->quiet) return;
  const ddp__world *w = &a->world;
  fprintf(stderr,
          "%s: round %d: node %d of %d (host %s), ranks %d-%d of world %d, restart count %d; store %s\n",
          job->tool, (int)a->attempt, (int)w->node_rank, (int)w->nnodes, a->host, (int)w->rank_offset,
          (int)(w->rank_offset + w->nproc - 1), (int)w->world_size, (int)w->restarts, w->store_addr);
  fflush(stderr);
}

/* Another node's failure of the round, read after the poll stopped us. */
static int read_remote_failure(ddp__agent *a, int32_t round) {
  char key[64];
  snprintf(key, sizeof key, "attempt/%d/failed", (int)round);
  void *v = NULL;
  size_t bytes = 0;
  if (ddp_store_get(a->store, key, 0, &v, &bytes) != DDP_OK) {
    ddp_clear_error();
    return 0;
  }
  snprintf(a->remote_failure, sizeof a->remote_failure, "%s", (char *)v);
  ddp_free(v);
  return 1;
}

/* After round `round` failed: re-form while restarts are left, else end the
 * job for every node (those waiting in the next round too). 1: go on. */
static int after_failure(ddp__job *job, ddp__worker_group *g, ddp__event ev, int32_t round, const char *failure) {
  ddp__agent *a = job->agent;
  const char *what = failure[0] ? failure : a->remote_failure;
  snprintf(job->failure, sizeof job->failure, "%s", what);
  int stop = strncmp(what, DDP__STOP_MARK, strlen(DDP__STOP_MARK)) == 0;
  int32_t restarts = a->world.restarts + 1;
  int again = !stop && restarts <= job->max_restarts;
  char headline[200];
  if (again)
    snprintf(headline, sizeof headline, "re-forming the group in a new round (restart %d of %d)", (int)restarts,
             (int)job->max_restarts);
  else
    snprintf(headline, sizeof headline, "the job failed%s", stop ? "" : job->max_restarts ? " (no restarts left)"
                                                                                      : " (--max-restarts 0)");
  if (ev == DDP__EVENT_FAILED && !job->quiet) {
    ddp__job_print_summary(job->tool, g, a->host, round, headline);
  } else if (!job->quiet) {
    fprintf(stderr, "%s: node %d stopped its workers: %s%s\n", job->tool, (int)a->world.node_rank,
            stop || !a->remote_failure[0] ? "" : "another node failed: ", what);
    fprintf(stderr, "%s: %s\n", job->tool, headline);
  }
  ddp__elastic_leave(a, round, 0);
  if (again) return 1;
  char reason[sizeof job->failure + 96];
  snprintf(reason, sizeof reason, "round %d failed and no restarts are left (--max-restarts %d): %s", (int)round,
           (int)job->max_restarts, what);
  ddp__elastic_abort(a, round + 1, reason);
  return 0;
}

ddp_status ddp__job_run_elastic(ddp__job *job, int *exit_code, ddp__event *event) {
  ddp__agent *a = job->agent;
  int32_t n = a->world.nproc;
  *exit_code = 1;
  *event = DDP__EVENT_FAILED;
  job->failure[0] = '\0';
  ddp__worker_spec *specs = ddp_calloc((size_t)n, sizeof *specs);
  if (!specs) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for %d workers", job->tool, (int)n);
  ddp_status st = DDP_OK;
  for (int32_t round = 0;; round++) {
    st = ddp__elastic_join(a, round, job->deadline_s);
    if (st && a->stop_signal) {
      /* Stopped while waiting for a round: no workers to stop, and the exit
       * status says which signal, as when workers run. */
      fprintf(stderr, "%s: %s\n", job->tool, ddp_last_error());
      ddp_clear_error();
      *exit_code = 128 + a->stop_signal;
      *event = DDP__EVENT_SIGNAL;
      st = DDP_OK;
      break;
    }
    if (st) break;
    round = a->attempt;
    say_round(job, a);
    ddp__worker_group g;
    st = ddp__job_start_group(job, round, specs, &g);
    if (st) {
      ddp__elastic_leave(a, round, 0);
      break;
    }
    ddp__event ev = ddp__worker_group_monitor(&g, job->deadline_s);
    *event = ev;
    char failure[sizeof job->failure] = "";
    int outcome = 1; /* 0 done, 1 failed, 2 scale event */
    /* A worker that failed while another node stopped its workers for a
     * scale event lost its peers to it: part of the scale event. */
    if (ev == DDP__EVENT_FAILED && ddp__elastic_rescaling(a, round) && !read_remote_failure(a, round)) {
      if (!job->quiet) {
        char first[sizeof job->failure];
        ddp__summary_first(&g, a->host, first, sizeof first);
        fprintf(stderr, "%s: %s, while another node stopped for a scale event: taken for part of it\n",
                job->tool, first);
      }
      a->scale_event = 1;
      ev = DDP__EVENT_EXTERNAL;
    }
    if (ev == DDP__EVENT_EXTERNAL && a->scale_event && !read_remote_failure(a, round)) {
      /* No verdict to gather for: the workers are fine, the world changes. */
      ddp__worker_group_stop(&g, SIGTERM, job->grace_s);
      outcome = 2;
    } else {
      ddp__job_stop(job, &g, round, ev, failure, sizeof failure);
    }
    if (ev == DDP__EVENT_SIGNAL) {
      snprintf(failure, sizeof failure, "node %d (%s) left the job: its ddprun received signal %d",
               (int)a->world.node_rank, a->host, g.stop_signal);
      ddp__agent_announce_failure(a, round, failure);
      ddp__elastic_leave(a, round, 0);
      snprintf(job->failure, sizeof job->failure, "%s", failure);
      *exit_code = 128 + g.stop_signal;
      ddp__worker_group_free(&g);
      break;
    }
    if (ev == DDP__EVENT_TIMEOUT || ev == DDP__EVENT_STORE || ev == DDP__EVENT_ERROR) {
      /* No round can follow: the job's time is up, or its store is gone. */
      if (ev == DDP__EVENT_TIMEOUT) {
        ddp__agent_announce_failure(a, round, failure);
        ddp__elastic_abort(a, round + 1, failure);
        if (g.flight_verdict && !job->quiet) ddp__flight_print(stderr, job->tool, g.flight_verdict);
      } else if (!job->quiet) {
        fprintf(stderr, "%s: %s\n", job->tool, failure + strlen(DDP__STOP_MARK));
      }
      snprintf(job->failure, sizeof job->failure, "%s", failure);
      ddp__worker_group_free(&g);
      if (ev != DDP__EVENT_TIMEOUT) st = ddp_error(DDP_ERR_CLOSED, "%s", failure + strlen(DDP__STOP_MARK));
      break;
    }
    if (ev == DDP__EVENT_DONE) {
      st = ddp__elastic_finish(a, round, job->deadline_s, &outcome);
      if (st) {
        ddp__worker_group_free(&g);
        if (a->stop_signal) {
          fprintf(stderr, "%s: %s\n", job->tool, ddp_last_error());
          ddp_clear_error();
          *exit_code = 128 + a->stop_signal;
          st = DDP_OK;
        }
        break;
      }
      if (outcome == 1 && !job->quiet)
        fprintf(stderr, "%s: node %d's workers finished, but round %d failed on another node\n", job->tool,
                (int)a->world.node_rank, (int)round);
    } else if (ev == DDP__EVENT_EXTERNAL && outcome != 2) {
      read_remote_failure(a, round);
    }
    if (outcome == 0) {
      /* A node waiting for the next round (one that arrived too late, or
       * while the round was full) learns that there is none. */
      char done[96];
      snprintf(done, sizeof done, "the job finished in round %d", (int)round);
      ddp__elastic_abort(a, round + 1, done);
      if (g.num_let_go && !job->quiet)
        fprintf(stderr, "%s: the job finished; %d worker%s failed and %s let go (--may-fail)\n", job->tool,
                (int)g.num_let_go, g.num_let_go == 1 ? "" : "s", g.num_let_go == 1 ? "was" : "were");
      ddp__worker_group_free(&g);
      *exit_code = 0;
      job->failure[0] = '\0';
      break;
    }
    if (outcome == 2) {
      if (!job->quiet)
        fprintf(stderr, "%s: a node arrived for round %d: node %d stopped its workers of round %d for a new round "
                "(a scale event, not counted against --max-restarts)\n", job->tool, (int)round + 1,
                (int)a->world.node_rank, (int)round);
      if (ev == DDP__EVENT_EXTERNAL) ddp__elastic_leave(a, round, 1);
      ddp__worker_group_free(&g);
      continue;
    }
    int again = after_failure(job, &g, ev, round, failure);
    ddp__worker_group_free(&g);
    if (!again) break;
  }
  ddp_free(specs);
  return st;
}
