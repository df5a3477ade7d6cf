/* The failure summary: which worker failed first, how (exit code or signal),
 * when, where, and the last lines of its output; then the other failures and
 * the workers the launcher stopped. The format is in docs/launch.md. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "launch/launch_internal.h"

const char *ddp__signal_name(int sig, char *buf, size_t bytes) {
  const char *abbrev = sigabbrev_np(sig);
  if (abbrev)
    snprintf(buf, bytes, "SIG%s", abbrev);
  else
    snprintf(buf, bytes, "SIG%d", sig);
  return buf;
}

void ddp__describe_status(int status, char *buf, size_t bytes) {
  char name[32];
  if (status == -1)
    snprintf(buf, bytes, "exited (status unknown: reaped elsewhere, or stuck after SIGKILL)");
  else if (WIFEXITED(status))
    snprintf(buf, bytes, "exited with code %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, bytes, "killed by signal %d (%s)%s", WTERMSIG(status),
             ddp__signal_name(WTERMSIG(status), name, sizeof name),
             WCOREDUMP(status) ? ", core dumped" : "");
  else
    snprintf(buf, bytes, "ended with status 0x%x", (unsigned)status);
}

static void format_time(int64_t ms, char *buf, size_t bytes) {
  time_t secs = (time_t)(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  char day[32];
  strftime(day, sizeof day, "%Y-%m-%d %H:%M:%S", &tm);
  snprintf(buf, bytes, "%s.%03d UTC", day, (int)(ms % 1000));
}

void ddp__summary_first(const ddp__worker_group *g, const char *host, char *buf, size_t bytes) {
  if (g->first_failure < 0) {
    snprintf(buf, bytes, "no worker failed");
    return;
  }
  const ddp__worker *w = &g->workers[g->first_failure];
  char how[160];
  ddp__describe_status(w->status, how, sizeof how);
  snprintf(buf, bytes, "rank %d (local rank %d, pid %ld) on host %s: %s", (int)w->rank,
           (int)w->local_rank, (long)w->pid, host, how);
}

static void print_tail(FILE *f, const char *tool, const ddp__tail *t) {
  int32_t kept = t->total < t->cap ? (int32_t)t->total : t->cap;
  if (kept == 0) {
    fprintf(f, "%s:   (no output)\n", tool);
    return;
  }
  fprintf(f, "%s:   last %d line%s of its output (of %lld):\n", tool, (int)kept, kept == 1 ? "" : "s",
          (long long)t->total);
  for (int32_t i = 0; i < kept; i++) {
    int32_t slot = (t->next - kept + i + t->cap) % t->cap;
    if (t->lines[slot]) fprintf(f, "%s:   | %s\n", tool, t->lines[slot]);
  }
}

/* The worker's error record (TORCHELASTIC_ERROR_FILE), when it left one:
 * what the program said it failed of, which an exit code does not tell. */
static void print_error_record(FILE *f, const char *tool, const ddp__worker *w) {
  char record[2048];
  ddp__error_record_read(w->error_path, record, sizeof record);
  if (!record[0]) return;
  fprintf(f, "%s:   error record (%s):\n", tool, w->error_path);
  /* One summary line per line of the message (a traceback has several). */
  for (char *line = record, *next; line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = '\0';
    fprintf(f, "%s:   > %s\n", tool, line);
  }
}

void ddp__summary_print(FILE *f, const char *tool, const ddp__worker_group *g, const char *host,
                        int32_t attempt, const char *headline) {
  char when[64], how[160];
  fprintf(f, "%s: ======== failure summary (attempt %d) ========\n", tool, (int)attempt);
  if (g->first_failure >= 0) {
    const ddp__worker *w = &g->workers[g->first_failure];
    format_time(w->exit_wall_ms, when, sizeof when);
    ddp__describe_status(w->status, how, sizeof how);
    fprintf(f, "%s: first failure: rank %d (local rank %d) on host %s, pid %ld: %s\n", tool,
            (int)w->rank, (int)w->local_rank, host, (long)w->pid, how);
    fprintf(f, "%s:   at %s (%.3f s after the workers started)\n", tool, when,
            (double)(w->exit_wall_ms - g->start_wall_ms) / 1000.0);
    print_tail(f, tool, &w->tail);
    print_error_record(f, tool, w);
  }
  for (int32_t i = 0; i < g->n; i++) {
    const ddp__worker *w = &g->workers[i];
    if (!w->failed || i == g->first_failure) continue;
    format_time(w->exit_wall_ms, when, sizeof when);
    ddp__describe_status(w->status, how, sizeof how);
    fprintf(f, "%s: also failed: rank %d (local rank %d), pid %ld: %s at %s\n", tool, (int)w->rank,
            (int)w->local_rank, (long)w->pid, how, when);
    print_tail(f, tool, &w->tail);
    print_error_record(f, tool, w);
  }
  int stopped = 0;
  for (int32_t i = 0; i < g->n; i++) {
    const ddp__worker *w = &g->workers[i];
    if (w->failed || w->pid == 0) continue;
    if (!stopped++) fprintf(f, "%s: the other workers (stopped by %s unless they had exited):\n", tool, tool);
    ddp__describe_status(w->status, how, sizeof how);
    fprintf(f, "%s:   rank %d (local rank %d), pid %ld: %s\n", tool, (int)w->rank, (int)w->local_rank,
            (long)w->pid, how);
  }
  if (g->flight_verdict) ddp__flight_print(f, tool, g->flight_verdict);
  fprintf(f, "%s: %s\n", tool, headline);
  fprintf(f, "%s: ===============================================\n", tool);
  fflush(f);
}
