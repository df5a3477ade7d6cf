/* The tools' command-line helpers (cli.h). */
#include "cli/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/core.h"

static const char *tool_name = "ddp";

void cli_init(const char *tool) { tool_name = tool; }

_Noreturn void cli_die_usage(const char *fmt, const char *arg) {
  fprintf(stderr, "%s: ", tool_name);
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n(run %s --help for the options)\n", tool_name);
  exit(2);
}

const char *cli_parse_backend(const char *flag, const char *v) {
  static const char *const names[] = {"ddp", "gloo", "mpi", "nccl", "auto"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++)
    if (!strcmp(v, names[i])) return v;
  char msg[192];
  snprintf(msg, sizeof msg, "%s expects ddp, mpi or nccl, got '%.80s'", flag, v);
  cli_die_usage("%s", msg);
}

int cli_parse_precision(const char *flag, const char *v) {
  static const char *const names[] = {"fp32", "bf16", "fp16", "tf32"}; /* ddp_precision's order */
  for (int i = 0; i < 4; i++)
    if (!strcmp(v, names[i])) return i;
  char msg[192];
  snprintf(msg, sizeof msg, "%s expects fp32, bf16, fp16 or tf32, got '%.80s'", flag, v);
  cli_die_usage("%s", msg);
}

int64_t cli_parse_int(const char *flag, const char *v, int64_t lo, int64_t hi) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || *end || end == v || x < lo || x > hi) {
    char msg[192];
    if (hi == INT64_MAX)
      snprintf(msg, sizeof msg, "%s expects an integer >= %lld, got '%%s'", flag, (long long)lo);
    else
      snprintf(msg, sizeof msg, "%s expects an integer from %lld to %lld, got '%%s'", flag, (long long)lo,
               (long long)hi);
    cli_die_usage(msg, v);
  }
  return x;
}

void cli_valued_option(const char *f, const char *const *valued, size_t n, char *name,
                       size_t bytes, const char **eq) {
  *eq = strchr(f, '=');
  size_t len = *eq ? (size_t)(*eq - f) : strlen(f);
  if (len >= bytes) cli_die_usage("unknown option '%s'", f);
  memcpy(name, f, len);
  name[len] = '\0';
  for (char *p = name; *p; p++)
    if (*p == '_') *p = '-';
  for (size_t k = 0; k < n; k++)
    if (!strcmp(name, valued[k])) return;
  cli_die_usage("unknown option '%s'", f);
}

const char *cli_option_value(int argc, char **argv, int *i, const char *eq) {
  if (eq) return eq + 1;
  if (*i + 1 >= argc) cli_die_usage("%s needs a value", argv[*i]);
  return argv[++*i];
}

void cli_help_or_version(const char *flag, void (*usage)(FILE *)) {
  if (!strcmp(flag, "-h") || !strcmp(flag, "--help")) {
    usage(stdout);
    exit(0);
  }
  if (!strcmp(flag, "--version")) {
    printf("%s (ddp) %s\n", tool_name, ddp_version());
    exit(0);
  }
}
