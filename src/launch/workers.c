/* The supervised group of workers on one node: fork them (each its own
 * process group, killed with the supervisor), watch them through one poll(2)
 * on their output pipes and the signal pipe, and stop them all (signal,
 * grace period, SIGKILL) when one fails or the job is stopped. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddp/comm.h" /* ddp_comm_shm_remove_orphans */
#include "launch/launch_internal.h"

extern char **environ;

#define REAP_LIMIT_S 5.0 /* after SIGKILL: how long the kernel may take */
/* Once the workers are gone, how long the console may take nothing before
 * what still waits for it is dropped (a reader that is slow but reading gets
 * everything). */
#define DRAIN_STALL_S 2.0

static int64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- The reaper ----------------------------------------------------------------
 * PDEATHSIG kills a worker when its supervisor dies, even by SIGKILL, but not
 * what the worker forked (a shell's children, a Python worker's helpers),
 * which the supervisor kills, through the worker's process group, only when
 * it lives to reap the worker. The reaper is a process of its own (its own
 * process group, so a signal to the supervisor's spares it; named
 * "ddprun-reaper"; SIGINT, SIGTERM and SIGHUP ignored) reading a pipe: the
 * supervisor writes +pgid when it starts a worker and -pgid when it reaps
 * one. At end of file (the supervisor closed it, or died) the reaper
 * SIGKILLs the groups still listed and exits: none after a normal end. */

#define REAPER_MAX_GROUPS 4096

static _Noreturn void reaper_main(int fd) {
  setpgid(0, 0);
  prctl(PR_SET_NAME, "ddprun-reaper");
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = SIG_IGN;
  const int ignored[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGUSR1, SIGUSR2, SIGQUIT};
  for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++) sigaction(ignored[i], &sa, NULL);
  sa.sa_handler = SIG_DFL;
  sigaction(SIGCHLD, &sa, NULL);
  /* Hold nothing of the supervisor's (its pipes, sockets and console): the
   * pipe moves to fd 3 (out of 0-2 first, should the supervisor have run
   * with one of them closed), /dev/null to 0-2, everything else closes. */
  if (fd < 3 && (fd = fcntl(fd, F_DUPFD, 3)) < 0) _exit(1);
  int null_fd = open("/dev/null", O_RDWR);
  if (null_fd >= 0)
    for (int k = 0; k < 3; k++) dup2(null_fd, k);
  if (fd != 3 && dup2(fd, 3) < 0) _exit(1);
  close_range(4, ~0U, 0);
  static int32_t groups[REAPER_MAX_GROUPS];
  int n = 0;
  for (;;) {
    int32_t rec;
    ssize_t r = read(3, &rec, sizeof rec);
    if (r < 0 && errno == EINTR) continue;
    if (r != (ssize_t)sizeof rec) break; /* end of file: the supervisor is gone */
    if (rec > 0 && n < REAPER_MAX_GROUPS) {
      groups[n++] = rec;
    } else if (rec < 0) {
      for (int i = 0; i < n; i++)
        if (groups[i] == -rec) {
          groups[i] = groups[--n];
          break;
        }
    }
  }
  for (int i = 0; i < n; i++) kill(-groups[i], SIGKILL);
  _exit(0);
}

/* Starts the group's reaper; without one (no pipe, no fork) the group runs
 * as before, with a warning. */
static void reaper_start(ddp__worker_group *g) {
  int p[2];
  g->reaper_fd = -1;
  g->reaper_pid = 0;
  if (pipe2(p, O_CLOEXEC) != 0) {
    fprintf(stderr, "ddprun: warning: no reaper for what workers fork (pipe2: %s)\n",
            strerror(errno));
    return;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[1]);
    reaper_main(p[0]);
  }
  close(p[0]);
  if (pid < 0) {
    fprintf(stderr, "ddprun: warning: no reaper for what workers fork (fork: %s)\n",
            strerror(errno));
    close(p[1]);
    return;
  }
  fcntl(p[1], F_SETFL, O_NONBLOCK); /* a reaper that stopped reading never blocks us */
  g->reaper_fd = p[1];
  g->reaper_pid = pid;
}

/* Tells the reaper about a worker's process group: +pgid started, -pgid reaped. */
static void reaper_tell(const ddp__worker_group *g, int32_t rec) {
  if (g->reaper_fd < 0) return;
  ssize_t r = write(g->reaper_fd, &rec, sizeof rec);
  (void)r; /* best effort: a full pipe or a dead reaper loses the record */
}

/* Ends the reaper after the workers are reaped: it has nothing left to kill
 * and exits at end of file, which a process still holding a copy of the
 * pipe could delay: then it is SIGKILLed after REAP_LIMIT_S. */
static void reaper_stop(ddp__worker_group *g) {
  if (g->reaper_fd >= 0) close(g->reaper_fd);
  g->reaper_fd = -1;
  if (g->reaper_pid <= 0) return;
  double until = ddp_time_s() + REAP_LIMIT_S;
  while (waitpid(g->reaper_pid, NULL, WNOHANG) == 0) {
    if (ddp_time_s() > until) {
      kill(g->reaper_pid, SIGKILL);
      waitpid(g->reaper_pid, NULL, 0);
      break;
    }
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  g->reaper_pid = 0;
}

/* ---- The child side ---------------------------------------------------------- */

/* Runs in the child between fork and exec (or fn): only async-signal-safe
 * calls until exec, except on the fn path where the child is a copy of the
 * caller anyway. Never returns. */
static _Noreturn void child_main(const ddp__worker_spec *spec, int32_t rank, pid_t parent,
                                 int out_fd, int err_fd, int reaper_fd) {
  setpgid(0, 0);
  /* Only the supervisor may hold the reaper's pipe open (exec would close
   * it, but ddp_spawn's workers run a function, and what they fork would
   * keep the reaper waiting). */
  if (reaper_fd >= 0) close(reaper_fd);
  /* Die with the supervisor, even when it is SIGKILLed. The parent may have
   * died between fork and prctl: then getppid() is no longer the parent. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(128 + SIGKILL);
  /* Where it runs (placement.c): before exec or fn, so the program's threads
   * inherit it. A failure (a cpuset changed under us) leaves it unbound. */
  if (spec->cpus && sched_setaffinity(0, sizeof *spec->cpus, spec->cpus) != 0) {
    const char *why = strerror(errno);
    const char *parts[] = {"ddprun: warning: cannot bind this worker to its CPUs (sched_setaffinity: ", why,
                           "); it runs unbound\n"};
    for (int i = 0; i < 3; i++) {
      ssize_t rc = write(err_fd, parts[i], strlen(parts[i]));
      (void)rc;
    }
  }
  if (spec->fn) {
    /* A forked worker of ddp_spawn gets the caller's own handlers back. */
    ddp__signals_restore();
  } else {
    /* An executed program starts with default dispositions (ddprun ignores
     * SIGPIPE, and ignored signals would survive exec). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    const int sigs[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGPIPE, SIGQUIT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &dfl, NULL);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  if (dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) _exit(127);
  close(out_fd);
  close(err_fd);
  if (spec->fn) {
    environ = spec->envp;
    int rc = spec->fn((int)rank, spec->arg);
    fflush(NULL);
    _exit(rc & 0xff);
  }
  execvpe(spec->argv[0], spec->argv, spec->envp);
  /* Only async-signal-safe calls here: write the reason by hand. */
  const char *why = strerror(errno);
  const char *parts[] = {"ddprun: cannot execute ", spec->argv[0], ": ", why, "\n"};
  for (int i = 0; i < 5; i++) {
    ssize_t rc = write(2, parts[i], strlen(parts[i]));
    (void)rc;
  }
  _exit(errno == ENOENT ? 127 : 126);
}

/* ---- Starting ---------------------------------------------------------------- */

static int open_log(const char *path) {
  if (!path[0]) return -1;
  return open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644);
}

ddp_status ddp__worker_group_start(ddp__worker_group *g, int32_t n, int32_t rank_offset,
                                   const ddp__worker_spec *specs, int32_t tail_lines) {
  g->n = 0;
  g->first_failure = -1;
  g->num_failures = 0;
  g->stop_signal = 0;
  g->stopping = 0;
  g->start_wall_ms = wall_ms();
  g->console[0].fd = g->console[1].fd = -1;
  g->workers = ddp_calloc((size_t)n, sizeof *g->workers);
  if (!g->workers) return ddp_error(DDP_ERR_NOMEM, "launch: out of memory for %d workers", (int)n);
  int shown[2] = {0, 0};
  for (int32_t i = 0; i < n; i++)
    for (int k = 0; k < 2; k++) shown[k] |= specs[i].show[k] != 0;
  for (int k = 0; k < 2; k++)
    if (shown[k]) ddp__console_open(&g->console[k], k + 1);
  fflush(NULL); /* forked workers must not write the supervisor's buffered output again */
  ddp__orphans_adopt(&g->orphans);
  reaper_start(g);
  pid_t self = getpid();
  for (int32_t i = 0; i < n; i++) {
    ddp__worker *w = &g->workers[i];
    w->local_rank = i;
    snprintf(w->error_path, sizeof w->error_path, "%s", specs[i].error_path);
    w->rank = rank_offset + i;
    w->out.fd = w->err.fd = w->out.log_fd = w->err.log_fd = -1;
    w->out.console = specs[i].show[0] ? &g->console[0] : NULL;
    w->err.console = specs[i].show[1] ? &g->console[1] : NULL;
    w->out.rank = w->err.rank = w->rank;
    g->n = i + 1;
    ddp_status s = ddp__tail_init(&w->tail, tail_lines);
    if (s) goto fail;
    for (int k = 0; k < 2; k++) {
      ddp__stream *st = k ? &w->err : &w->out;
      st->log_fd = open_log(specs[i].log_path[k]);
      if (specs[i].log_path[k][0] && st->log_fd < 0) {
        s = ddp_error(DDP_ERR_IO, "launch: cannot create the log file %s for local rank %d: %s",
                      specs[i].log_path[k], (int)i, strerror(errno));
        goto fail;
      }
    }
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0) {
      s = ddp_error(DDP_ERR_SYS, "launch: pipe2: %s", strerror(errno));
      goto fail;
    }
    if (pipe2(err_pipe, O_CLOEXEC) != 0) {
      s = ddp_error(DDP_ERR_SYS, "launch: pipe2: %s", strerror(errno));
      close(out_pipe[0]);
      close(out_pipe[1]);
      goto fail;
    }
    pid_t pid = fork();
    if (pid == 0) child_main(&specs[i], w->rank, self, out_pipe[1], err_pipe[1], g->reaper_fd);
    close(out_pipe[1]);
    close(err_pipe[1]);
    w->out.fd = out_pipe[0];
    w->err.fd = err_pipe[0];
    fcntl(w->out.fd, F_SETFL, O_NONBLOCK);
    fcntl(w->err.fd, F_SETFL, O_NONBLOCK);
    if (pid < 0) {
      s = ddp_error(DDP_ERR_SYS, "launch: fork for local rank %d: %s", (int)i, strerror(errno));
      goto fail;
    }
    /* Also from the parent, so a signal sent at once reaches the group. */
    setpgid(pid, pid);
    reaper_tell(g, (int32_t)pid);
    w->pid = pid;
    w->state = DDP__WORKER_RUNNING;
    continue;
  fail:
    g->stopping = 1;
    ddp__worker_group_stop(g, SIGKILL, 0);
    return s;
  }
  return DDP_OK;
}

/* ---- Watching ---------------------------------------------------------------- */

/* Records a worker's exit (at reap, on the monotonic clock) and drains its
 * output; whether it counts as a failure is decided per batch by reap(). */
static void mark_exited(ddp__worker_group *g, ddp__worker *w, int status) {
  w->state = DDP__WORKER_EXITED;
  w->status = status;
  w->exit_s = ddp_time_s();
  w->exit_wall_ms = wall_ms();
  /* Kill what the worker left behind in its process group (a shell's
   * children, a Python worker's helpers): the group id stays valid until its
   * last member is gone, so this cannot hit an unrelated process. */
  kill(-w->pid, SIGKILL);
  reaper_tell(g, -(int32_t)w->pid);
  /* A worker killed while its group was being set up may leave the local
   * backend's shared-memory segment in /dev/shm (named after its pid). */
  int segments = ddp_comm_shm_remove_orphans((int)w->pid);
  if (segments > 0)
    fprintf(stderr, "ddprun: removed %d shared-memory segment%s that worker pid %d left in "
                    "/dev/shm\n", segments, segments == 1 ? "" : "s", (int)w->pid);
  ddp__stream_finish(&w->out, &w->tail);
  ddp__stream_finish(&w->err, &w->tail);
}

/* The rank another worker's last output says died ("rank 3 (host) died",
 * "rank 3 (host) died or failed (reported by rank 0)", "rank 3 died (process
 * 4711 is gone)": the comm layer's wording for a dead peer), or -1. Lines
 * are read newest first; a "rank N" naming the worker itself is skipped
 * ("launch_worker: rank 0: barrier: rank 3 ... died"). */
int32_t ddp__worker_blamed_rank(const ddp__worker *w) {
  const ddp__tail *t = &w->tail;
  int32_t kept = t->total < t->cap ? (int32_t)t->total : t->cap;
  for (int32_t i = kept - 1; i >= 0; i--) {
    const char *line = t->lines[(t->next - kept + i + t->cap) % t->cap];
    if (!line) continue;
    for (const char *p = strstr(line, "rank "); p; p = strstr(p + 5, "rank ")) {
      char *end;
      long r = strtol(p + 5, &end, 10);
      if (end == p + 5 || r < 0 || r == w->rank) continue;
      if (strstr(end, " died")) return (int32_t)r;
    }
  }
  return -1;
}

/* Whether a is a likelier cause than b, of two failures reaped in one batch
 * (the kernel keeps no exit time, so within a batch the order is unknown):
 * a worker whose output names a dead peer is a consequence, not a cause; a
 * worker killed by a signal died abruptly, where one that noticed a failure
 * exits with a code; then the lower local rank. See docs/launch.md. */
static int likelier_cause(const ddp__worker *a, const ddp__worker *b) {
  int ca = ddp__worker_blamed_rank(a) >= 0, cb = ddp__worker_blamed_rank(b) >= 0;
  if (ca != cb) return cb;
  int sa = a->status != -1 && WIFSIGNALED(a->status), sb = b->status != -1 && WIFSIGNALED(b->status);
  if (sa != sb) return sa;
  return a->local_rank < b->local_rank;
}

/* Reaps every worker that has exited, as one batch; returns how many are
 * still running. A cause is a zombie before any peer can notice it died, so
 * it is reaped in the same batch as its consequences or an earlier one; the
 * batch's failures are ranked by likelier_cause. */
static int32_t reap(ddp__worker_group *g) {
  int32_t running = 0;
  ddp__worker *best = NULL;
  /* The store first: when it died, workers failing on their store calls in
   * this batch are its consequences (the job fails naming the store). */
  if (g->store && !g->store_died && !g->stopping && ddp__store_proc_exited(g->store)) g->store_died = 1;
  for (int32_t i = 0; i < g->n; i++) {
    ddp__worker *w = &g->workers[i];
    if (w->state != DDP__WORKER_RUNNING) continue;
    int status;
    pid_t r = waitpid(w->pid, &status, WNOHANG);
    if (r == w->pid) {
      mark_exited(g, w, status);
    } else if (r < 0 && errno == ECHILD) {
      /* Someone else reaped it (a SIGCHLD set to SIG_IGN in the caller):
       * its status is lost; count it as a failure with status -1. */
      mark_exited(g, w, -1);
    } else {
      running++;
      continue;
    }
    int ok = w->status != -1 && WIFEXITED(w->status) && WEXITSTATUS(w->status) == 0;
    if (ok || g->stopping) continue;
    if (ddp__rank_set_contains(g->may_fail, w->rank)) {
      /* --may-fail: told now, and the others go on (a parameter server's
       * trainer that died; its peers' transports survive it). */
      char how[160];
      ddp__describe_status(w->status, how, sizeof how);
      fprintf(stderr, "ddprun: rank %d (local rank %d, pid %ld) %s; the others go on (--may-fail)\n",
              (int)w->rank, (int)w->local_rank, (long)w->pid, how);
      w->let_go = 1;
      g->num_let_go++;
      continue;
    }
    w->failed = 1;
    g->num_failures++;
    if (!best || likelier_cause(w, best)) best = w;
  }
  if (best && g->first_failure < 0) g->first_failure = best->local_rank;
  return running;
}

/* Whether pid is one of the group's own children (a worker, the store, the
 * reaper), whose exit status is not the orphans' to take. */
static int is_own_child(pid_t pid, void *ctx) {
  const ddp__worker_group *g = ctx;
  for (int32_t i = 0; i < g->n; i++)
    if (g->workers[i].pid == pid) return 1;
  return (g->store && g->store->pid == pid) || g->reaper_pid == pid;
}

/* ---- The console ------------------------------------------------------------ */

/* Offers every stream's waiting output to the console, the stream whose line
 * is half written first. */
static void flush_consoles(ddp__worker_group *g) {
  for (int k = 0; k < 2; k++)
    if (g->console[k].busy) ddp__stream_flush(g->console[k].busy);
  for (int32_t i = 0; i < g->n; i++) {
    ddp__stream_flush(&g->workers[i].out);
    ddp__stream_flush(&g->workers[i].err);
  }
}

/* Whether output waits for console k (then poll asks when it can take more). */
static void consoles_waiting(const ddp__worker_group *g, int waiting[2]) {
  waiting[0] = waiting[1] = 0;
  for (int32_t i = 0; i < g->n; i++) {
    const ddp__stream *st[2] = {&g->workers[i].out, &g->workers[i].err};
    for (int k = 0; k < 2; k++) {
      const ddp__stream *s = st[k];
      if (!s->console || s->console->fd < 0) continue;
      if (s->pend_len > 0 || s->dropped > 0 || s->notice_len > 0) waiting[s->console == &g->console[1]] = 1;
    }
  }
}

/* Once the workers are gone: gives the console their last output while it
 * takes some within DRAIN_STALL_S, then drops the rest with a notice. */
static void drain_consoles(ddp__worker_group *g) {
  double last = ddp_time_s();
  for (;;) {
    size_t before = 0, after = 0;
    for (int32_t i = 0; i < g->n; i++) before += g->workers[i].out.pend_len + g->workers[i].err.pend_len;
    flush_consoles(g);
    int waiting[2];
    consoles_waiting(g, waiting);
    if (!waiting[0] && !waiting[1]) return;
    for (int32_t i = 0; i < g->n; i++) after += g->workers[i].out.pend_len + g->workers[i].err.pend_len;
    double now = ddp_time_s();
    if (after < before) last = now;
    if (now - last > DRAIN_STALL_S) break;
    struct pollfd p[2];
    nfds_t n = 0;
    for (int k = 0; k < 2; k++)
      if (waiting[k]) p[n++] = (struct pollfd){.fd = g->console[k].fd, .events = POLLOUT};
    poll(p, n, 20);
  }
  for (int32_t i = 0; i < g->n; i++) {
    ddp__stream_discard(&g->workers[i].out);
    ddp__stream_discard(&g->workers[i].err);
  }
}

static void signal_all(ddp__worker_group *g, int sig) {
  for (int32_t i = 0; i < g->n; i++)
    if (g->workers[i].state == DDP__WORKER_RUNNING) kill(-g->workers[i].pid, sig);
}

/* One round of poll: output, signals, exits. Returns the forwarded stopping
 * signal (SIGINT, SIGTERM, SIGHUP) if one arrived, else 0. */
static int wait_round(ddp__worker_group *g, double timeout_s) {
  struct pollfd *fds = NULL;
  ddp__stream **who = NULL;
  size_t cap = 3 + 2 * (size_t)g->n;
  fds = ddp_calloc(cap, sizeof *fds);
  who = ddp_calloc(cap, sizeof *who);
  size_t nfds = 0;
  if (fds && who) {
    fds[nfds].fd = ddp__signals_fd();
    fds[nfds++].events = POLLIN;
    size_t first_stream = 1;
    int waiting[2];
    consoles_waiting(g, waiting);
    for (int k = 0; k < 2; k++) {
      if (!waiting[k]) continue;
      fds[nfds].fd = g->console[k].fd;
      fds[nfds++].events = POLLOUT;
      first_stream++;
    }
    for (int32_t i = 0; i < g->n; i++) {
      ddp__worker *w = &g->workers[i];
      ddp__stream *st[2] = {&w->out, &w->err};
      for (int k = 0; k < 2; k++) {
        if (st[k]->fd < 0) continue;
        who[nfds] = st[k];
        fds[nfds].fd = st[k]->fd;
        fds[nfds++].events = POLLIN;
      }
    }
    int ms = timeout_s <= 0 ? 0 : (int)(timeout_s * 1000.0 + 0.999);
    if (poll(fds, nfds, ms) > 0) {
      /* Exits first (a SIGCHLD byte woke us, or a dead worker's pipes hung
       * up): their times are taken now, not after the others' output. */
      reap(g);
      for (size_t i = first_stream; i < nfds; i++) {
        if (who[i]->fd < 0) continue; /* drained by reap */
        if (!fds[i].revents) continue;
        for (int32_t k = 0; k < g->n; k++) {
          ddp__worker *w = &g->workers[k];
          if (who[i] == &w->out || who[i] == &w->err) ddp__stream_pump(who[i], &w->tail);
        }
      }
    }
  } else {
    /* Out of memory for the poll set: fall back to sleeping between reaps. */
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  ddp_free(fds);
  ddp_free(who);
  flush_consoles(g);
  int stop = 0, child_exited = 0, sigs[64];
  int n = ddp__signals_take(sigs, 64);
  for (int i = 0; i < n; i++) {
    switch (sigs[i]) {
      case SIGCHLD:
        child_exited = 1;
        break;
      case SIGUSR1:
      case SIGUSR2:
        signal_all(g, sigs[i]);
        break;
      default: /* SIGINT, SIGTERM, SIGHUP: forward, then the job stops */
        signal_all(g, sigs[i]);
        if (!stop) stop = sigs[i];
        break;
    }
  }
  reap(g);
  /* Every round, not only after a SIGCHLD: a full batch leaves the rest to
   * the next round (one waitid when there is nothing to reap). */
  ddp__orphans_reap_exited(&g->orphans, is_own_child, g, child_exited);
  return stop;
}

ddp__event ddp__worker_group_monitor(ddp__worker_group *g, double deadline_s) {
  double next_poll = ddp_time_s() + g->monitor_interval_s;
  for (;;) {
    double now = ddp_time_s();
    double wait = g->monitor_interval_s;
    if (deadline_s > 0 && deadline_s - now < wait) wait = deadline_s - now;
    int sig = wait_round(g, wait);
    if (sig) {
      g->stop_signal = sig;
      return DDP__EVENT_SIGNAL;
    }
    if (g->store_died) return DDP__EVENT_STORE;
    if (g->first_failure >= 0) return DDP__EVENT_FAILED;
    int32_t running = 0;
    for (int32_t i = 0; i < g->n; i++) running += g->workers[i].state == DDP__WORKER_RUNNING;
    if (running == 0) return DDP__EVENT_DONE;
    now = ddp_time_s();
    if (deadline_s > 0 && now >= deadline_s) return DDP__EVENT_TIMEOUT;
    if (g->poll_hook && now >= next_poll) {
      next_poll = now + g->monitor_interval_s;
      int r = g->poll_hook(g->poll_ctx);
      if (r > 0) return DDP__EVENT_EXTERNAL;
      if (r < 0) return DDP__EVENT_ERROR;
    }
  }
}

/* ---- Stopping ---------------------------------------------------------------- */

char ddp__proc_state(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

static int32_t count_running(const ddp__worker_group *g) {
  int32_t running = 0;
  for (int32_t i = 0; i < g->n; i++) running += g->workers[i].state == DDP__WORKER_RUNNING;
  return running;
}

/* Whether every worker still running is stopped (SIGSTOP, a debugger): a
 * stopped process acts on no signal but SIGKILL, so the grace period would
 * only delay the summary. */
static int all_running_stopped(const ddp__worker_group *g) {
  for (int32_t i = 0; i < g->n; i++) {
    if (g->workers[i].state != DDP__WORKER_RUNNING) continue;
    char st = ddp__proc_state(g->workers[i].pid);
    if (st != 'T' && st != 't') return 0;
  }
  return 1;
}

void ddp__worker_group_stop(ddp__worker_group *g, int sig, double grace_s) {
  g->stopping = 1;
  if (!g->workers) return;
  reap(g);
  if (count_running(g) > 0 && sig != SIGKILL) {
    signal_all(g, sig ? sig : SIGTERM);
    double until = ddp_time_s() + (grace_s > 0 ? grace_s : 0);
    while (count_running(g) > 0 && ddp_time_s() < until && !all_running_stopped(g)) {
      int again = wait_round(g, until - ddp_time_s() < 0.05 ? until - ddp_time_s() : 0.05);
      if (again) signal_all(g, again); /* a second Ctrl-C is forwarded too */
    }
  }
  if (count_running(g) > 0) {
    signal_all(g, SIGKILL);
    double until = ddp_time_s() + REAP_LIMIT_S;
    while (count_running(g) > 0 && ddp_time_s() < until) wait_round(g, 0.02);
    for (int32_t i = 0; i < g->n; i++) {
      ddp__worker *w = &g->workers[i];
      if (w->state != DDP__WORKER_RUNNING) continue;
      fprintf(stderr, "ddprun: warning: local rank %d (pid %ld) is still there %g s after SIGKILL "
              "(stuck in the kernel?); giving up on it\n", (int)w->local_rank, (long)w->pid, REAP_LIMIT_S);
      w->state = DDP__WORKER_EXITED;
      w->status = -1;
      ddp__stream_finish(&w->out, &w->tail);
      ddp__stream_finish(&w->err, &w->tail);
    }
  }
  drain_consoles(g); /* their last words come before the summary */
}

/* Once the workers are reaped: what they started outside their process
 * groups and left running goes too (orphans.c), with a notice naming it. */
static void kill_orphans(ddp__worker_group *g) {
  char names[256];
  int killed = ddp__orphans_kill(&g->orphans, is_own_child, g, names, sizeof names);
  if (killed > 0)
    fprintf(stderr, "ddprun: killed %d process%s that the workers left running outside their "
            "process groups (setsid or a daemon): %s\n", killed, killed == 1 ? "" : "es", names);
  ddp__orphans_release(&g->orphans);
}

void ddp__worker_group_free(ddp__worker_group *g) {
  if (!g || !g->workers) return;
  reaper_stop(g);
  kill_orphans(g);
  for (int32_t i = 0; i < g->n; i++) {
    ddp__worker *w = &g->workers[i];
    ddp__stream_finish(&w->out, &w->tail);
    ddp__stream_finish(&w->err, &w->tail);
  }
  drain_consoles(g);
  for (int32_t i = 0; i < g->n; i++) {
    ddp__worker *w = &g->workers[i];
    ddp__stream_discard(&w->out);
    ddp__stream_discard(&w->err);
    ddp__tail_free(&w->tail);
  }
  ddp__console_close(&g->console[0]);
  ddp__console_close(&g->console[1]);
  ddp_free(g->flight_verdict);
  g->flight_verdict = NULL;
  ddp_free(g->workers);
  g->workers = NULL;
  g->n = 0;
}
