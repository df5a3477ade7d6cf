/* The job's store server in a process of its own. The supervisor (ddprun,
 * or ddp_spawn's caller) binds the server itself, so the port is known and a
 * bind error is its own, then forks a child that serves until the
 * supervisor SIGTERMs it at the end of the job. The supervisor stays
 * single-threaded at every fork: a store *thread* could hold a lock (the
 * allocator's, stdio's, a sanitizer's) at the moment a worker is forked,
 * and a worker forked without exec (ddp_spawn) then deadlocks on its first
 * malloc -- as GCC 12's ASan did. And the workers forked afterwards hold none
 * of the server's fds: the supervisor drops its copy right after the fork
 * (ddp__store_server_forget). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch/launch_internal.h"
#include "store/server_fork.h"

#define STOP_GRACE_S 2.0 /* SIGTERM -> SIGKILL */
#define REAP_LIMIT_S 5.0 /* after SIGKILL: how long the kernel may take */

/* The child: serves until SIGTERM (or the parent's death). Never returns. */
static _Noreturn void serve_child(ddp_store_server *server, pid_t parent) {
  /* Its own process group: a Ctrl-C at the terminal goes to the supervisor,
   * which stops the workers first and this process last. */
  setpgid(0, 0);
  prctl(PR_SET_NAME, "ddp-store");
  /* Die with the supervisor, even when it is SIGKILLed; it may have died
   * between fork and prctl (then getppid() is no longer the parent). */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(128 + SIGKILL);
  /* The caller's handlers (ddp_spawn runs inside any program) do not apply:
   * SIGTERM ends the server, terminal signals are the supervisor's. */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = SIG_DFL;
  const int dfl[] = {SIGTERM, SIGCHLD, SIGUSR1, SIGUSR2, SIGQUIT};
  for (size_t i = 0; i < sizeof dfl / sizeof dfl[0]; i++) sigaction(dfl[i], &sa, NULL);
  sa.sa_handler = SIG_IGN;
  const int ign[] = {SIGINT, SIGHUP, SIGPIPE};
  for (size_t i = 0; i < sizeof ign / sizeof ign[0]; i++) sigaction(ign[i], &sa, NULL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  ddp_status st = ddp_store_server_run(server);
  if (st != DDP_OK) ddp_log(DDP_LOG_ERROR, "store server %s: %s", ddp_store_server_address(server), ddp_last_error());
  /* _exit: the caller's atexit handlers and stdio buffers are not ours. */
  _exit(st == DDP_OK ? 0 : 1);
}

ddp_status ddp__store_proc_start(const char *bind_addr, uint16_t port, ddp__store_proc *p) {
  memset(p, 0, sizeof *p);
  ddp_store_server *server;
  DDP_TRY(ddp_store_server_create(bind_addr, port, NULL, &server));
  p->port = ddp_store_server_port(server);
  snprintf(p->address, sizeof p->address, "%s", ddp_store_server_address(server));
  fflush(NULL); /* the child must not write the supervisor's buffered output again */
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) serve_child(server, parent);
  int err = errno;
  /* Parent (or no child): drop this process's copy without signalling. */
  ddp__store_server_forget(server);
  if (pid < 0) return ddp_error(DDP_ERR_SYS, "cannot fork the store server process for %s: %s", p->address, strerror(err));
  setpgid(pid, pid); /* also from here, so a signal sent at once reaches it */
  p->pid = pid;
  return DDP_OK;
}

int ddp__store_proc_exited(ddp__store_proc *p) {
  if (p->pid <= 0) return 0;
  if (p->exited) return 1;
  int status;
  pid_t r = waitpid(p->pid, &status, WNOHANG);
  if (r == p->pid) {
    p->exited = 1;
    p->status = status;
  } else if (r < 0 && errno == ECHILD) {
    /* Reaped by someone else (SIGCHLD set to SIG_IGN by ddp_spawn's caller):
     * its status is lost. */
    p->exited = 1;
    p->status = -1;
  }
  return p->exited;
}

void ddp__store_proc_describe(const ddp__store_proc *p, char *buf, size_t bytes) {
  char how[96];
  if (!p->exited)
    snprintf(how, sizeof how, "is running");
  else if (p->status == -1)
    snprintf(how, sizeof how, "is gone (exit status unknown)");
  else
    ddp__describe_status(p->status, how, sizeof how);
  snprintf(buf, bytes, "the store server process (pid %ld, %s) %s", (long)p->pid, p->address, how);
}

/* Polls for its exit until `limit_s` passes; 1 once gone. */
static int wait_gone(ddp__store_proc *p, double limit_s) {
  double until = ddp_time_s() + limit_s;
  for (;;) {
    if (ddp__store_proc_exited(p)) return 1;
    if (ddp_time_s() >= until) return 0;
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

void ddp__store_proc_stop(ddp__store_proc *p) {
  if (p->pid <= 0 || ddp__store_proc_exited(p)) return;
  kill(p->pid, SIGTERM);
  if (wait_gone(p, STOP_GRACE_S)) return;
  kill(p->pid, SIGKILL);
  if (wait_gone(p, REAP_LIMIT_S)) return;
  fprintf(stderr, "ddprun: warning: the store server process (pid %ld) is still there %g s after SIGKILL "
          "(stuck in the kernel?); giving up on it\n", (long)p->pid, REAP_LIMIT_S);
}

int32_t ddp__thread_count(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  int32_t n = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  fclose(f);
  return n;
}
