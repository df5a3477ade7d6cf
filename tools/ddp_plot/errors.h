/* ddp-plot's readers report an error as one line in a caller's buffer
 * ("PATH:LINE: what"); the tool prints it and exits. */
#ifndef DDP_TOOLS_PLOT_ERRORS_H
#define DDP_TOOLS_PLOT_ERRORS_H

#include <stdbool.h>
#include <stddef.h>

/* Formats into err[0..n) and returns false, so a reader writes
 * `return plot_fail(err, n, "%s:%ld: ...", path, line)`. */
bool plot_fail(char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
