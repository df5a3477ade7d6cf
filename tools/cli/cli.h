/* The tools' command-line helpers, one of each: the usage error (exit 2)
 * and the integer option parser. Linked into every tool (CMakeLists.txt);
 * main calls cli_init first. */
#ifndef DDP_TOOLS_CLI_H
#define DDP_TOOLS_CLI_H

#include <stddef.h>
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
/* v as a --backend value (ddp, gloo, mpi, nccl or auto: the names the
 * process group takes, docs/comm.md), else a usage error naming flag. */
const char *cli_parse_backend(const char *flag, const char *v);
/* v as a --precision value, its ddp_precision (fp32 0, bf16 1, fp16 2,
 * tf32 3: docs/mixed-precision.md), else a usage error naming flag. */
int cli_parse_precision(const char *flag, const char *v);
/* A valued option's name: f ("--opt", "--opt=V", "--o_pt") up to its '='
 * (*eq: the '=', or NULL), with '_' read as '-' (PyTorch's and Propulate's
 * spellings), into name[bytes]; a usage error unless it is one of
 * valued[0..n). */
void cli_valued_option(const char *f, const char *const *valued, size_t n, char *name,
                       size_t bytes, const char **eq);
/* The value of the option argv[*i]: the text after its '=' (eq points at
 * the '=', NULL when the option has none), else the next argument, which
 * it takes (*i advances); a usage error naming the option when there is
 * none. */
const char *cli_option_value(int argc, char **argv, int *i, const char *eq);
/* The flags every tool answers the same way: -h/--help (usage(stdout),
 * exit 0) and --version ("<tool> (ddp) <version>", exit 0); returns for any
 * other flag. */
void cli_help_or_version(const char *flag, void (*usage)(FILE *));

#endif /* DDP_TOOLS_CLI_H */
