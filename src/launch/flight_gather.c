/* The launcher's side of the flight recorder: before it stops a group that
 * failed or hung, ask each worker that records (one that catches SIGUSR1:
 * a ddp program with DDP_FLIGHT_RECORDER_SIZE > 0) to dump, wait briefly
 * for the dumps, read every rank's from the job's store (a local worker's
 * file when the store lacks it) and say who stopped where, naming the ranks
 * that could not dump and why (docs/launch.md, "The flight recorder's
 * verdict"). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/core_internal.h"
#include "launch/launch_internal.h"
#include "net/net.h"

/* How long to wait for the dumps: a dump takes milliseconds, so this is for
 * other nodes' ranks (their ddprun learns of the failure at its next poll)
 * and a loaded machine. */
#define FLIGHT_WAIT_S 3.0
#define POLL_S 0.02

/* Whether the worker catches SIGUSR1 (SigCgt in /proc/<pid>/status): only
 * those get it, since SIGUSR1's default action ends a process. */
static int catches_usr1(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%ld/status", (long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int caught = 0;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "SigCgt:", 7) != 0) continue;
    unsigned long long mask = strtoull(line + 7, NULL, 16);
    caught = (mask >> (SIGUSR1 - 1)) & 1;
    break;
  }
  fclose(f);
  return caught;
}

/* The job's store, scoped to the attempt's keys (the workers' DDP_STORE_PREFIX). */
static ddp_store *open_store(const ddp__agent *a, int32_t attempt) {
  char host[DDP_RENDEZVOUS_ADDR_BYTES], prefix[DDP_LAUNCH_ID_BYTES + 64];
  int32_t port;
  ddp_store_options so = {0};
  so.timeout_ms = 2000;
  so.connect_timeout_ms = 1000;
  ddp_store *base = NULL, *store = NULL;
  if (ddp__net_split_hostport("the store's address", a->world.store_addr, host, sizeof host, &port) == DDP_OK &&
      ddp_store_tcp_connect(host, (uint16_t)port, &so, &base) == DDP_OK) {
    ddp__attempt_prefix(a->world.run_id, attempt, prefix, sizeof prefix);
    if (ddp_store_prefix(base, prefix, &store) != DDP_OK) store = NULL;
  }
  ddp_store_destroy(base);
  ddp_clear_error();
  return store;
}

/* How many dumps rank has put in the store so far (0 without a store). */
static int64_t store_dumps(ddp_store *store, int32_t rank) {
  if (!store) return 0;
  char key[64];
  snprintf(key, sizeof key, "flight/%d/dumps", (int)rank);
  int64_t count = 0;
  if (ddp_store_add(store, key, 0, &count) != DDP_OK) {
    ddp_clear_error();
    return 0;
  }
  return count;
}


/* A local worker's dump file, if it is this worker's (its pid) and at
 * least as new as `since` (CLOCK_REALTIME seconds; 0: any). */
static int read_file_dump(const ddp__world *world, const ddp__worker *w, double since, ddp__flight_dump *out) {
  char path[DDP_LAUNCH_PATH_BYTES + 64];
  /* The DDP_DEBUG_DIR the workers were given (the user's, or this run's). */
  ddp__flight_dump_path(world->debug_dir, w->rank, -1, path, sizeof path);
  struct stat sb;
  if (stat(path, &sb) != 0 || (double)sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9 < since) return 0;
  if (ddp__flight_read_file(path, out) != DDP_OK) {
    ddp_clear_error();
    return 0;
  }
  if (out->pid != (int64_t)w->pid) {
    ddp__flight_dump_free(out);
    return 0;
  }
  return 1;
}

static int read_store_dump(ddp_store *store, int32_t rank, ddp__flight_dump *out) {
  if (!store) return 0;
  char key[64], what[96];
  snprintf(key, sizeof key, "flight/%d", (int)rank);
  const char *keys[1] = {key};
  int exists = 0;
  if (ddp_store_check(store, keys, 1, &exists) != DDP_OK || !exists) {
    ddp_clear_error();
    return 0;
  }
  void *value = NULL;
  size_t bytes = 0;
  if (ddp_store_get(store, key, 2000, &value, &bytes) != DDP_OK) {
    ddp_clear_error();
    return 0;
  }
  snprintf(what, sizeof what, "rank %d's dump in the store", (int)rank);
  ddp_status st = ddp__flight_parse(value, bytes, what, out);
  ddp_free(value);
  if (st != DDP_OK) {
    fprintf(stderr, "ddprun: %s\n", ddp_last_error());
    ddp_clear_error();
    return 0;
  }
  return 1;
}

typedef struct local_rank {
  int asked;      /* sent SIGUSR1 */
  int recording;  /* catches SIGUSR1 */
  int64_t before; /* its dump count in the store when asked */
  int settled;    /* dumped since, or cannot any more */
} local_rank;

/* Why local or remote rank r left no dump, as ddprun sees it. */
static void why_absent(const ddp__worker *wk, const local_rank *loc, char *out, size_t bytes) {
  char how[120];
  char st = wk ? ddp__proc_state(wk->pid) : 0;
  if (!wk) {
    snprintf(out, bytes, "it runs on another node; none reached the store within %g s", FLIGHT_WAIT_S);
  } else if (wk->state == DDP__WORKER_EXITED) {
    ddp__describe_status(wk->status, how, sizeof how);
    snprintf(out, bytes, "it %s%s before it could dump", wk->status != -1 && WIFSIGNALED(wk->status) ? "was " : "",
             how);
  } else if (st == 'T' || st == 't') {
    snprintf(out, bytes, "it is stopped (SIGSTOP, or a debugger), so it could not dump");
  } else if (st == 'Z' || st == 0) {
    snprintf(out, bytes, "it exited before it could dump");
  } else if (!loc->recording) {
    snprintf(out, bytes, "it does not record (not a ddp program, DDP_FLIGHT_RECORDER_SIZE=0, or it handles SIGUSR1 itself)");
  } else {
    snprintf(out, bytes, "none within %g s of SIGUSR1", FLIGHT_WAIT_S);
  }
}

/* Reads every rank's dump (the store; a local worker's file) and returns the
 * heading and the verdict, or NULL when no rank dumped. */
static char *judge_dumps(const ddp__worker_group *g, const ddp__world *w, ddp_store *store, const local_rank *loc) {
  int32_t world = w->world_size;
  ddp__flight_dump *dumps = ddp_calloc((size_t)world, sizeof *dumps);
  const char **why = ddp_calloc((size_t)world, sizeof *why);
  char(*why_buf)[200] = ddp_calloc((size_t)world, sizeof *why_buf);
  int32_t *have = ddp_calloc((size_t)world, sizeof *have);
  size_t n = 0;
  for (int32_t r = 0; dumps && why && why_buf && have && r < world; r++) {
    int32_t i = r - w->rank_offset;
    const ddp__worker *wk = i >= 0 && i < g->n ? &g->workers[i] : NULL;
    if (read_store_dump(store, r, &dumps[n]) || (wk && read_file_dump(w, wk, 0, &dumps[n]))) {
      have[n++] = r;
      continue;
    }
    why_absent(wk, wk ? &loc[i] : NULL, why_buf[r], sizeof why_buf[r]);
    why[r] = why_buf[r];
  }
  char *text = NULL, *verdict = NULL;
  /* Nothing to say for a job whose workers do not record. */
  if (n > 0 && ddp__flight_verdict(dumps, n, world, why, &verdict) == DDP_OK) {
    char ranks[256], path[DDP_LAUNCH_PATH_BYTES + 64];
    ddp__format_ranks(have, (int32_t)n, 16, ranks, sizeof ranks);
    ddp__flight_dump_path(w->debug_dir, 0, -1, path, sizeof path);
    char *star = strstr(path, "rank0.json");
    if (star) snprintf(star, sizeof path - (size_t)(star - path), "rank*.json");
    size_t len = strlen(verdict) + strlen(path) + strlen(ranks) + 100;
    text = ddp_alloc(len);
    if (text)
      snprintf(text, len, "flight recorder (dumps of rank%s %s of %d, in %s):\n%s", n == 1 ? "" : "s", ranks,
               (int)world, path, verdict);
  }
  ddp_clear_error();
  ddp_free(verdict);
  for (size_t k = 0; dumps && k < n; k++) ddp__flight_dump_free(&dumps[k]);
  ddp_free(dumps);
  ddp_free(why);
  ddp_free(why_buf);
  ddp_free(have);
  return text;
}

char *ddp__flight_gather(ddp__worker_group *g, const ddp__agent *a, int32_t attempt, int judge) {
  if (!g->workers || g->n == 0) return NULL;
  ddp__world w = a->world;
  ddp_store *store = open_store(a, attempt);
  local_rank *loc = ddp_calloc((size_t)g->n, sizeof *loc);
  if (!loc) {
    ddp_store_destroy(store);
    return NULL;
  }
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  double asked_at = (double)now.tv_sec + now.tv_nsec * 1e-9;
  int recording = 0;
  for (int32_t i = 0; i < g->n; i++) {
    ddp__worker *wk = &g->workers[i];
    if (wk->state != DDP__WORKER_RUNNING) {
      loc[i].settled = 1;
      continue;
    }
    char st = ddp__proc_state(wk->pid);
    loc[i].recording = st != 'Z' && st != 0 && catches_usr1(wk->pid);
    if (!loc[i].recording || st == 'T' || st == 't') {
      loc[i].settled = 1;
      continue;
    }
    loc[i].before = store_dumps(store, wk->rank);
    kill(wk->pid, SIGUSR1); /* the worker only, not its process group: its children may not catch it */
    loc[i].asked = 1;
    recording = 1;
  }
  /* Wait for the asked workers (a fresh dump, or they exit or stop) and, on
   * the node that judges, for every other node's ranks in the store: when
   * this job records at all (some worker catches SIGUSR1 or has dumped). */
  int32_t world = w.world_size;
  int job_records = recording;
  for (int32_t i = 0; i < g->n && !job_records; i++) job_records = store_dumps(store, g->workers[i].rank) > 0;
  double deadline = ddp_time_s() + FLIGHT_WAIT_S;
  for (;;) {
    int pending = 0;
    for (int32_t i = 0; i < g->n; i++) {
      if (loc[i].settled) continue;
      char st = ddp__proc_state(g->workers[i].pid);
      if (st == 0 || st == 'Z' || st == 'T' || st == 't' || store_dumps(store, g->workers[i].rank) > loc[i].before) {
        loc[i].settled = 1;
      } else if (!store) {
        ddp__flight_dump d;
        if (read_file_dump(&w, &g->workers[i], asked_at, &d)) {
          loc[i].settled = 1;
          ddp__flight_dump_free(&d);
        }
      }
      pending += !loc[i].settled;
    }
    if (judge && store && job_records)
      for (int32_t r = 0; r < world; r++) {
        if (r >= w.rank_offset && r < w.rank_offset + g->n) continue;
        if (store_dumps(store, r) == 0) pending++;
      }
    if (pending == 0 || ddp_time_s() >= deadline) break;
    struct timespec ts = {0, (long)(POLL_S * 1e9)};
    nanosleep(&ts, NULL);
  }
  char *text = judge ? judge_dumps(g, &w, store, loc) : NULL;
  ddp_free(loc);
  ddp_store_destroy(store);
  return text;
}

void ddp__flight_print(FILE *f, const char *tool, const char *text) {
  for (const char *line = text; line && *line;) {
    const char *end = strchr(line, '\n');
    int len = end ? (int)(end - line) : (int)strlen(line);
    fprintf(f, "%s: %s%.*s\n", tool, line == text ? "" : "  ", len, line);
    line = end ? end + 1 : line + len;
  }
}
