/* Processes that leave a worker's process group (setsid, a daemon's double
 * fork) escape the kill of that group when the worker exits. While a group
 * runs, its supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER): such a
 * process, once orphaned, becomes the supervisor's child instead of init's,
 * and when the group ends the supervisor SIGKILLs and reaps every child it
 * did not have before the group started. Being its parent, the supervisor
 * cannot hit a reused pid: the pid stays taken until it reaps it. One that
 * exits on its own while the group runs is reaped in the round its SIGCHLD
 * wakes, so a long job whose workers keep starting short-lived daemons does
 * not pile up zombies. */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch/launch_internal.h"

#define ORPHANS_LIMIT_S 5.0 /* SIGKILL to gone, for each generation together */
#define ORPHANS_REAP_BATCH 64 /* exited orphans reaped per SIGCHLD at most */

/* Calls fn(pid, state, comm, ctx) for every process whose parent is this
 * process (from /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold
 * spaces and parentheses, so the fields after it start at the last ')').
 * Returns how many it found; -1 without /proc. */
static int for_each_child(void (*fn)(pid_t pid, char state, const char *comm, void *ctx), void *ctx) {
  DIR *d = opendir("/proc");
  if (!d) return -1;
  pid_t self = getpid();
  int found = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!isdigit((unsigned char)e->d_name[0])) continue;
    char path[sizeof e->d_name + 16], buf[512];
    snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "re");
    if (!f) continue; /* gone meanwhile */
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    char *open = strchr(buf, '(');
    char *close = strrchr(buf, ')');
    if (!open || !close || close < open) continue;
    char state = 0;
    long ppid = 0;
    if (sscanf(close + 1, " %c %ld", &state, &ppid) != 2 || ppid != (long)self) continue;
    *close = '\0';
    found++;
    fn((pid_t)atol(e->d_name), state, open + 1, ctx);
  }
  closedir(d);
  return found;
}

static void add_preexisting(pid_t pid, char state, const char *comm, void *ctx) {
  (void)state;
  (void)comm;
  ddp__orphans *o = ctx;
  if (o->n_preexisting < DDP__ORPHANS_MAX_KEEP) o->preexisting[o->n_preexisting] = pid;
  o->n_preexisting++; /* past the cap: adopt gives up rather than kill one later */
}

void ddp__orphans_adopt(ddp__orphans *o) {
  memset(o, 0, sizeof *o);
  int was = 0;
  if (prctl(PR_GET_CHILD_SUBREAPER, &was) != 0) return;
  o->was_subreaper = was;
  if (!was && prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) return;
  if (for_each_child(add_preexisting, o) < 0 || o->n_preexisting > DDP__ORPHANS_MAX_KEEP) {
    if (!was) prctl(PR_SET_CHILD_SUBREAPER, 0);
    return;
  }
  o->adopting = 1;
}

typedef struct kill_ctx {
  ddp__orphans *o;
  ddp__orphans_is_own *is_own;
  void *own_ctx;
  int seen;       /* children of this pass not kept (alive, or reaped now) */
  char *names;    /* "pid 4711 (sleep), ..." of the first few killed */
  size_t bytes;
} kill_ctx;

static int listed(const pid_t *pids, int n, pid_t pid) {
  for (int i = 0; i < n; i++)
    if (pids[i] == pid) return 1;
  return 0;
}

static void kill_child(pid_t pid, char state, const char *comm, void *ctx_) {
  kill_ctx *c = ctx_;
  ddp__orphans *o = c->o;
  if (listed(o->preexisting, o->n_preexisting, pid) || c->is_own(pid, c->own_ctx)) return;
  /* A zombie exited on its own: reaped, not counted. */
  if (state != 'Z' && !listed(o->killed, o->n_killed < DDP__ORPHANS_MAX_KEEP ? o->n_killed
                                                                            : DDP__ORPHANS_MAX_KEEP, pid)) {
    kill(pid, SIGKILL);
    if (o->n_killed < DDP__ORPHANS_MAX_KEEP) o->killed[o->n_killed] = pid;
    if (o->n_killed < 4 && c->bytes > 0) {
      size_t used = strlen(c->names);
      snprintf(c->names + used, c->bytes - used, "%spid %ld (%s)", used ? ", " : "", (long)pid, comm);
    } else if (o->n_killed == 4 && c->bytes > 0) {
      size_t used = strlen(c->names);
      snprintf(c->names + used, c->bytes - used, ", ...");
    }
    o->n_killed++;
  }
  waitpid(pid, NULL, WNOHANG);
  c->seen++;
}

int ddp__orphans_kill(ddp__orphans *o, ddp__orphans_is_own *is_own, void *ctx, char *names,
                      size_t bytes) {
  if (bytes > 0) names[0] = '\0';
  if (!o->adopting) return 0;
  kill_ctx c = {o, is_own, ctx, 0, names, bytes};
  double until = ddp_time_s() + ORPHANS_LIMIT_S;
  /* Each pass kills this generation; what they forked becomes our child as
   * they die (perhaps after the pass read its entry), so passes go on until
   * one finds no child left to kill or reap. */
  for (;;) {
    c.seen = 0;
    if (for_each_child(kill_child, &c) < 0 || c.seen == 0) break;
    if (ddp_time_s() > until) {
      fprintf(stderr, "ddprun: warning: %d process%s that workers left behind still there %g s "
              "after SIGKILL; giving up on them\n", c.seen, c.seen == 1 ? " is" : "es are",
              ORPHANS_LIMIT_S);
      break;
    }
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return o->n_killed;
}

typedef struct reap_ctx {
  ddp__orphans *o;
  ddp__orphans_is_own *is_own;
  void *own_ctx;
  int reaped;
} reap_ctx;

static void reap_zombie(pid_t pid, char state, const char *comm, void *ctx_) {
  (void)comm;
  reap_ctx *c = ctx_;
  if (state != 'Z' || listed(c->o->preexisting, c->o->n_preexisting, pid) || c->is_own(pid, c->own_ctx))
    return;
  if (waitpid(pid, NULL, WNOHANG) == pid) c->reaped++;
}

int ddp__orphans_reap_exited(ddp__orphans *o, ddp__orphans_is_own *is_own, void *ctx, int child_exited) {
  if (!o->adopting) return 0;
  int reaped = 0;
  /* waitid's WNOWAIT names an exited child without reaping it, so a worker,
   * the store or a child the caller had before the group (whose status
   * belongs to someone else) is left for its owner. It names the same child
   * until that one is reaped, and an owner may keep its zombie for the whole
   * run (a caller of ddp_spawn busy in it, the reaper once killed, which the
   * group reaps at its end): the orphans behind such a child, or past a
   * full batch, are found in /proc instead. */
  for (int i = 0; i < ORPHANS_REAP_BATCH; i++) {
    siginfo_t info;
    memset(&info, 0, sizeof info);
    if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) return reaped;
    pid_t pid = info.si_pid;
    if (listed(o->preexisting, o->n_preexisting, pid) || is_own(pid, ctx)) break;
    if (waitpid(pid, NULL, WNOHANG) != pid) return reaped;
    reaped++;
  }
  /* No SIGCHLD in this round: every orphan that exited before the last one
   * was reaped in its round, so there is nothing behind to look for. */
  if (!child_exited) return reaped;
  reap_ctx c = {o, is_own, ctx, 0};
  for_each_child(reap_zombie, &c);
  return reaped + c.reaped;
}

void ddp__orphans_release(ddp__orphans *o) {
  if (o->adopting && !o->was_subreaper) prctl(PR_SET_CHILD_SUBREAPER, 0);
  o->adopting = 0;
}
