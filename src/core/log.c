/* Levelled, rank-prefixed logging to stderr. One write per line, so lines from
 * several ranks sharing a terminal do not interleave mid-line. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "ddp/core.h"

static atomic_int log_level = -1; /* -1: not yet read from DDP_LOG_LEVEL */
static atomic_int log_rank = -2;  /* -2: not yet read from RANK */

static int parse_level(const char *s) {
  static const char *names[] = {"debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 5; i++)
    if (strcasecmp(s, names[i]) == 0) return i;
  if (strcasecmp(s, "warning") == 0) return DDP_LOG_WARN;
  return -1;
}

ddp_log_level ddp_log_get_level(void) {
  int level = atomic_load(&log_level);
  if (level < 0) {
    const char *env = getenv("DDP_LOG_LEVEL");
    /* DDP_DEBUG=info or detail (torch's TORCH_DISTRIBUTED_DEBUG) shows the
     * info lines too, unless DDP_LOG_LEVEL says otherwise. */
    const char *debug = getenv("DDP_DEBUG");
    level = debug && (strcasecmp(debug, "info") == 0 || strcasecmp(debug, "detail") == 0)
                ? DDP_LOG_INFO
                : DDP_LOG_WARN;
    if (env && *env) {
      int parsed = parse_level(env);
      if (parsed >= 0)
        level = parsed;
      else
        fprintf(stderr, "ddp: ignoring DDP_LOG_LEVEL=%s (expected debug, info, warn, error or off)\n",
                env);
    }
    atomic_store(&log_level, level);
  }
  return (ddp_log_level)level;
}

void ddp_log_set_level(ddp_log_level level) { atomic_store(&log_level, (int)level); }

void ddp_log_set_rank(int rank) { atomic_store(&log_rank, rank); }

static int current_rank(void) {
  int rank = atomic_load(&log_rank);
  if (rank == -2) {
    const char *env = getenv("RANK");
    rank = env && *env ? atoi(env) : -1;
    atomic_store(&log_rank, rank);
  }
  return rank;
}

void ddp_log(ddp_log_level level, const char *fmt, ...) {
  if (level < ddp_log_get_level() || level >= DDP_LOG_OFF) return;
  static const char letters[] = "DIWE";
  char line[2048];
  int rank = current_rank();
  int n = rank >= 0 ? snprintf(line, sizeof line, "[ddp rank %d] %c ", rank, letters[level])
                    : snprintf(line, sizeof line, "[ddp] %c ", letters[level]);
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
  if (len > sizeof line - 2) len = sizeof line - 2;
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}
