/* Sets of ranks written as ddprun takes them on its command line ("all",
 * or "0,3-5"), read straight from the text: a job names a few ranges, and
 * the supervisor asks only when a worker exits (--may-fail, global ranks)
 * or a worker starts (--local-ranks-filter, local ranks). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "launch/launch_internal.h"

/* Reads one "N" or "N-M" range at *p; advances past it. */
static int read_range(const char **p, long *lo, long *hi) {
  char *end;
  errno = 0;
  *lo = strtol(*p, &end, 10);
  if (end == *p || errno || *lo < 0 || *p[0] == '-' || *p[0] == '+' || *p[0] == ' ') return 0;
  *hi = *lo;
  if (*end == '-') {
    const char *q = end + 1;
    if (*q < '0' || *q > '9') return 0;
    *hi = strtol(q, &end, 10);
    if (errno || *hi < *lo) return 0;
  }
  *p = end;
  return 1;
}

ddp_status ddp__rank_set_check(const char *option, const char *spec) {
  if (strcmp(spec, "all") == 0) return DDP_OK;
  const char *p = spec;
  for (;;) {
    long lo, hi;
    if (!read_range(&p, &lo, &hi) || hi > INT32_MAX)
      return ddp_error(DDP_ERR_INVALID, "%s '%s': expected \"all\" or ranks such as 1,3-5 "
                       "(at '%.20s')", option, spec, p);
    if (*p == '\0') return DDP_OK;
    if (*p != ',') return ddp_error(DDP_ERR_INVALID, "%s '%s': expected ',' after a rank (at '%.20s')",
                                    option, spec, p);
    p++;
  }
}

int ddp__rank_set_contains(const char *spec, int32_t rank) {
  if (!spec) return 0;
  if (strcmp(spec, "all") == 0) return 1;
  const char *p = spec;
  long lo, hi;
  while (read_range(&p, &lo, &hi)) {
    if (rank >= lo && rank <= hi) return 1;
    if (*p != ',') break;
    p++;
  }
  return 0;
}
