/* The supervisor's signals: a self-pipe written by async-signal-safe
 * handlers and read by the supervision loop, so child exits (SIGCHLD) and the
 * signals to forward (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) wake one
 * poll(2) together with the workers' output. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

static const int handled[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};
#define NUM_HANDLED (int)(sizeof handled / sizeof handled[0])

static int pipe_fds[2] = {-1, -1};
static struct sigaction saved[NUM_HANDLED];
static int installed;

static void on_signal(int sig) {
  int saved_errno = errno;
  unsigned char byte = (unsigned char)sig;
  /* A full pipe drops the byte: the loop reaps every child on any SIGCHLD
   * byte, and a burst of one forwarded signal loses nothing that matters. */
  ssize_t rc = write(pipe_fds[1], &byte, 1);
  (void)rc;
  errno = saved_errno;
}

ddp_status ddp__signals_install(void) {
  if (installed) return ddp_error(DDP_ERR_STATE, "launch: signal handlers are already installed (one supervisor per process)");
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0)
    return ddp_error(DDP_ERR_SYS, "launch: pipe2: %s", strerror(errno));
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (int i = 0; i < NUM_HANDLED; i++) sigaction(handled[i], &sa, &saved[i]);
  /* Unblock them in case the caller blocked them (a shell's background job). */
  sigset_t set;
  sigemptyset(&set);
  for (int i = 0; i < NUM_HANDLED; i++) sigaddset(&set, handled[i]);
  pthread_sigmask(SIG_UNBLOCK, &set, NULL);
  installed = 1;
  return DDP_OK;
}

void ddp__signals_restore(void) {
  if (!installed) return;
  for (int i = 0; i < NUM_HANDLED; i++) sigaction(handled[i], &saved[i], NULL);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  pipe_fds[0] = pipe_fds[1] = -1;
  installed = 0;
}

int ddp__signals_fd(void) { return pipe_fds[0]; }

int ddp__signals_take(int *signals, int max) {
  int n = 0;
  unsigned char buf[64];
  while (n < max) {
    ssize_t got = read(pipe_fds[0], buf, (size_t)(max - n) < sizeof buf ? (size_t)(max - n) : sizeof buf);
    if (got <= 0) break;
    for (ssize_t i = 0; i < got; i++) signals[n++] = buf[i];
  }
  return n;
}
