/* ddp-hpo's cmd: objective (docs/hpo.md, "Any program"): one run of a
 * program per evaluation, the hyperparameters as "--name value" arguments
 * and DDP_HPO_<NAME> variables; with workers of several ranks every rank
 * runs it at once as one torchrun-style job (RANK, WORLD_SIZE, LOCAL_*,
 * MASTER_ADDR/PORT, and ddp's store with a fresh prefix), so a ddp program
 * or a PyTorch script trains data-parallel inside it. The loss is the last
 * line the worker's first rank's program printed: a number, or a JSON
 * object's loss field. A program that fails, hangs past the timeout (then
 * every rank's is killed, its whole process group) or prints no loss gives
 * INFINITY, and the reason goes to stderr. */
#include "ddp_hpo/cmd_objective.h"
#include "launch/launch_internal.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

ddp_status hpo_cmd_parse(const char *spec, hpo_cmd *out) {
  memset(out, 0, sizeof *out);
  size_t len = strlen(spec);
  out->text = malloc(len + 1);
  out->argv = calloc(len / 2 + 2, sizeof *out->argv);
  if (!out->text || !out->argv) {
    hpo_cmd_free(out);
    return ddp_error(DDP_ERR_NOMEM, "cmd objective: out of memory");
  }
  memcpy(out->text, spec, len + 1);
  /* Words split at blanks: no quoting (a script takes anything fancier). */
  for (char *p = out->text; *p;) {
    while (*p && isspace((unsigned char)*p)) *p++ = '\0';
    if (!*p) break;
    out->argv[out->argc++] = p;
    while (*p && !isspace((unsigned char)*p)) p++;
  }
  if (out->argc == 0) {
    hpo_cmd_free(out);
    return ddp_error(DDP_ERR_INVALID, "--objective cmd: names no program (cmd:PROGRAM [ARGS])");
  }
  return DDP_OK;
}

void hpo_cmd_free(hpo_cmd *c) {
  free(c->text);
  free(c->argv);
  memset(c, 0, sizeof *c);
}

/* A free TCP port on the loopback for the evaluation's MASTER_PORT. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t n = sizeof a;
  int port = 0;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &n) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

/* The child's environment: ours under the launcher's contract (without an
 * outer job's rank variables, store, restart count or trace file), plus the
 * evaluation's. Lines are formatted into `scratch`; the table is ddp_alloc'd
 * (ddp_free), NULL when it does not fit. */
static char **child_env(const ddp_hpo_space *space, const double *v, const hpo_cmd_eval *e,
                        char *scratch, size_t bytes) {
  char **lines = calloc((size_t)ddp_hpo_space_size(space) + 16, sizeof *lines);
  if (!lines) return NULL;
  size_t k = 0, at = 0;
#define PUT(...)                                                        \
  do {                                                                  \
    int w_ = snprintf(scratch + at, bytes - at, __VA_ARGS__);          \
    if (w_ < 0 || (size_t)w_ >= bytes - at) { free(lines); return NULL; } \
    lines[k++] = scratch + at;                                          \
    at += (size_t)w_ + 1;                                               \
  } while (0)
  for (int i = 0; i < ddp_hpo_space_size(space); i++) {
    const ddp_hpo_trait *t = ddp_hpo_space_trait(space, i);
    char name[128];
    size_t j = 0;
    for (; t->name[j] && j + 1 < sizeof name; j++) name[j] = (char)toupper((unsigned char)t->name[j]);
    name[j] = '\0';
    if (t->kind == DDP_HPO_CATEGORICAL) PUT("DDP_HPO_%s=%s", name, t->choices[(int)v[i]]);
    else if (t->kind == DDP_HPO_INT) PUT("DDP_HPO_%s=%lld", name, (long long)v[i]);
    else PUT("DDP_HPO_%s=%.17g", name, v[i]);
  }
  PUT("RANK=%d", e->rank);
  PUT("WORLD_SIZE=%d", e->size);
  PUT("LOCAL_RANK=%d", e->rank);
  PUT("LOCAL_WORLD_SIZE=%d", e->size);
  PUT("GROUP_RANK=0");
  if (e->size > 1) {
    PUT("MASTER_ADDR=127.0.0.1");
    PUT("MASTER_PORT=%d", e->master_port);
    if (e->store_addr && *e->store_addr) {
      PUT("DDP_STORE_ADDR=%s", e->store_addr);
      PUT("DDP_STORE_PREFIX=hpo-eval/%d/%lld/", e->worker, (long long)e->generation);
    }
  }
#undef PUT
  char **env = NULL;
  if (ddp__launch_env(environ, lines, k, &env) != DDP_OK) env = NULL;
  free(lines);
  return env;
}

/* The loss in a line: a number, or {"...": ..., "KEY": number, ...}. */
static bool parse_loss(const char *line, const char *key, double *loss) {
  while (isspace((unsigned char)*line)) line++;
  char *end;
  if (*line != '{') {
    double x = strtod(line, &end);
    while (isspace((unsigned char)*end)) end++;
    if (end != line && !*end) {
      *loss = x;
      return true;
    }
    return false;
  }
  char pattern[160];
  snprintf(pattern, sizeof pattern, "\"%s\"", key);
  const char *p = strstr(line, pattern);
  if (!p) return false;
  p += strlen(pattern);
  while (isspace((unsigned char)*p)) p++;
  if (*p++ != ':') return false;
  while (isspace((unsigned char)*p)) p++;
  if (!strncmp(p, "null", 4)) {
    *loss = INFINITY;
    return true;
  }
  double x = strtod(p, &end);
  if (end == p) return false;
  *loss = x;
  return true;
}

double hpo_cmd_run(const hpo_cmd *c, const ddp_hpo_space *space, const double *v,
                   const hpo_cmd_eval *e) {
  /* argv: the program's own words, then --name value per trait. */
  int traits = ddp_hpo_space_size(space);
  char **argv = calloc((size_t)(c->argc + 2 * traits + 1), sizeof *argv);
  char *values = malloc((size_t)traits * 64 + 1), *scratch = malloc(1 << 16);
  char **env = NULL;
  double loss = INFINITY;
  char reason[512] = "";
  if (!argv || !values || !scratch) {
    snprintf(reason, sizeof reason, "out of memory");
    goto done;
  }
  int n = 0;
  for (int i = 0; i < c->argc; i++) argv[n++] = c->argv[i];
  char names[64][132];
  for (int i = 0; i < traits && i < 64; i++) {
    const ddp_hpo_trait *t = ddp_hpo_space_trait(space, i);
    snprintf(names[i], sizeof names[i], "--%s", t->name);
    char *val = values + 64 * i;
    if (t->kind == DDP_HPO_CATEGORICAL) snprintf(val, 64, "%s", t->choices[(int)v[i]]);
    else if (t->kind == DDP_HPO_INT) snprintf(val, 64, "%lld", (long long)v[i]);
    else snprintf(val, 64, "%.17g", v[i]);
    argv[n++] = names[i];
    argv[n++] = val;
  }
  env = child_env(space, v, e, scratch, 1 << 16);
  if (!env) {
    snprintf(reason, sizeof reason, "its environment does not fit");
    goto done;
  }
  int out[2];
  if (pipe(out) != 0) {
    snprintf(reason, sizeof reason, "pipe: %s", strerror(errno));
    goto done;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(out[0]), close(out[1]);
    snprintf(reason, sizeof reason, "fork: %s", strerror(errno));
    goto done;
  }
  if (pid == 0) {
    setsid(); /* its own process group: a timeout kills all it started */
    /* The worker's first rank reads the loss; the others' output is seen on stderr. */
    dup2(e->rank == 0 ? out[1] : STDERR_FILENO, STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execve(argv[0], argv, env);
    execvpe(argv[0], argv, env);
    fprintf(stderr, "ddp-hpo: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  close(out[1]);
  /* Read until EOF or the deadline, keeping the last non-empty line. */
  char line[4096] = "", cur[4096];
  size_t cur_len = 0;
  const double deadline = ddp_time_s() + e->timeout_s;
  bool timed_out = false;
  for (;;) {
    double left = deadline - ddp_time_s();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd pfd = {.fd = out[0], .events = POLLIN};
    int ready = poll(&pfd, 1, (int)(left * 1000) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buf[4096];
    ssize_t got = read(out[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break; /* EOF */
    for (ssize_t i = 0; i < got; i++) {
      if (buf[i] == '\n') {
        cur[cur_len] = '\0';
        if (cur_len) memcpy(line, cur, cur_len + 1);
        cur_len = 0;
      } else if (cur_len + 1 < sizeof cur) {
        cur[cur_len++] = buf[i];
      }
    }
  }
  close(out[0]);
  if (cur_len) {
    cur[cur_len] = '\0';
    memcpy(line, cur, cur_len + 1);
  }
  int status = 0;
  if (!timed_out) {
    /* The output ended; the program has the rest of the deadline to exit. */
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (ddp_time_s() > deadline) {
        timed_out = true;
        break;
      }
      usleep(1000);
    }
  }
  if (timed_out) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    snprintf(reason, sizeof reason, "timed out after %g s (killed)", e->timeout_s);
  } else if (WIFSIGNALED(status)) {
    snprintf(reason, sizeof reason, "killed by signal %d", WTERMSIG(status));
  } else if (WEXITSTATUS(status) != 0) {
    snprintf(reason, sizeof reason, "exited %d", WEXITSTATUS(status));
  } else if (e->rank == 0 && !parse_loss(line, c->loss_key, &loss)) {
    snprintf(reason, sizeof reason, "printed '%.200s' last, no loss (a number, or JSON with \"%s\")",
             line, c->loss_key);
    loss = INFINITY;
  }
done:
  if (reason[0] && e->rank == 0)
    fprintf(stderr, "ddp-hpo: worker %d generation %lld: %s %s: loss inf\n", e->worker,
            (long long)e->generation, c->argv[0], reason);
  if (reason[0]) loss = INFINITY;
  ddp_free(env);
  free(argv);
  free(values);
  free(scratch);
  return loss;
}

int hpo_cmd_free_port(void) { return free_port(); }
