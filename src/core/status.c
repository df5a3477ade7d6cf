/* Status codes, their names and messages, and the thread-local last error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/core.h"

#define DDP__ERROR_BYTES 1024

static _Thread_local char last_error[DDP__ERROR_BYTES];

const char *ddp_strerror(ddp_status status) {
  switch (status) {
#define DDP__STATUS_MSG(name, code, msg) \
  case DDP_##name:                       \
    return msg;
    DDP_STATUS_TABLE(DDP__STATUS_MSG)
#undef DDP__STATUS_MSG
  }
  return "unknown status";
}

const char *ddp_status_name(ddp_status status) {
  switch (status) {
#define DDP__STATUS_NAME(name, code, msg) \
  case DDP_##name:                        \
    return "DDP_" #name;
    DDP_STATUS_TABLE(DDP__STATUS_NAME)
#undef DDP__STATUS_NAME
  }
  return "DDP_UNKNOWN";
}

ddp_status ddp_error(ddp_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

ddp_status ddp_error_wrap(ddp_status status, const char *fmt, ...) {
  char prefix[DDP__ERROR_BYTES];
  char old[DDP__ERROR_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, last_error, sizeof old);
  const char *parts[3] = {prefix, ": ", old[0] ? old : ddp_strerror(status)};
  size_t n = 0;
  for (int i = 0; i < 3; i++) {
    size_t len = strlen(parts[i]);
    if (len > sizeof last_error - 1 - n) len = sizeof last_error - 1 - n;
    memcpy(last_error + n, parts[i], len);
    n += len;
  }
  last_error[n] = '\0';
  return status;
}

const char *ddp_last_error(void) { return last_error; }

void ddp_clear_error(void) { last_error[0] = '\0'; }

void ddp__assert_fail(const char *cond, const char *file, int line, const char *func) {
  fprintf(stderr, "ddp: internal error: assertion `%s` failed in %s at %s:%d\n", cond, func,
          file, line);
  fflush(stderr);
  abort();
}
