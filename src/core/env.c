/* Time and environment parameters. */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "ddp/core.h"

int64_t ddp_time_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

double ddp_time_s(void) { return (double)ddp_time_ns() * 1e-9; }

const char *ddp_env_str(const char *name, const char *fallback) {
  const char *v = getenv(name);
  return v && *v ? v : fallback;
}

ddp_status ddp_env_int(const char *name, int64_t fallback, int64_t *out) {
  const char *v = getenv(name);
  if (!v || !*v) {
    *out = fallback;
    return DDP_OK;
  }
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || *end != '\0')
    return ddp_error(DDP_ERR_INVALID, "environment variable %s=\"%s\" is not an integer", name, v);
  *out = x;
  return DDP_OK;
}

ddp_status ddp_env_double(const char *name, double fallback, double *out) {
  const char *v = getenv(name);
  if (!v || !*v) {
    *out = fallback;
    return DDP_OK;
  }
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || *end != '\0')
    return ddp_error(DDP_ERR_INVALID, "environment variable %s=\"%s\" is not a number", name, v);
  *out = x;
  return DDP_OK;
}
