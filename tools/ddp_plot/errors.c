/* ddp-plot's readers' error lines (errors.h). */
#include "ddp_plot/errors.h"

#include <stdarg.h>
#include <stdio.h>

bool plot_fail(char *err, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
  return false;
}
