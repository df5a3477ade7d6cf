/* The tools' command-line helpers, one of each: the usage error (exit 2)
 * and the integer option parser. Linked into every tool (CMakeLists.txt);
 * main calls cli_init first. */
#ifndef DDP_TOOLS_CLI_H
#define DDP_TOOLS_CLI_H

#include <stdint.h>
#include <stdio.h>

/* The tool's name as messages start ("ddp-train"); kept, not copied. */
void cli_init(const char *tool);
/* "<tool>: " then fmt with arg (one %s), then "(run <tool> --help for the
 * options)" on stderr; exits 2. */
_Noreturn void cli_die_usage(const char *fmt, const char *arg);
/* v as a whole decimal integer in [lo, hi], else a usage error naming
 * flag: "<flag> expects an integer >= lo, got 'v'" (hi INT64_MAX) or
 * "<flag> expects an integer from lo to hi, got 'v'". */
int64_t cli_parse_int(const char *flag, const char *v, int64_t lo, int64_t hi);
/* The flags every tool answers the same way: -h/--help (usage(stdout),
 * exit 0) and --version ("<tool> (ddp) <version>", exit 0); returns for any
 * other flag. */
void cli_help_or_version(const char *flag, void (*usage)(FILE *));

#endif /* DDP_TOOLS_CLI_H */
