/* ddp-debug: looks at what a job left behind. `ddp-debug flight` reads the
 * flight recorder's dumps of every rank (files, or directories holding
 * them), says who stopped where (the verdict ddprun prints when a job
 * fails) and, with -v, lists each rank's last operations. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ddp/ddp.h"
#include "launch/launch_internal.h"

static const char usage[] =
    "usage: ddp-debug flight [options] PATH...\n"
    "\n"
    "Reads flight recorder dumps (the ddp-flight-rank<R>.json files each rank\n"
    "writes to DDP_DEBUG_DIR, or $TMPDIR/ddp-debug-*, on a timeout, a peer's\n"
    "death or SIGUSR1; PATH is a\n"
    "file or a directory holding them) and says per process group who stopped\n"
    "where: a rank that never entered the collective the others wait in, ranks\n"
    "that called different collectives as the same number, ranks waiting in a\n"
    "send or recv, ranks without a dump. docs/debugging.md has the details.\n"
    "\n"
    "Options:\n"
    "  -v, --verbose     also list each rank's operations, newest last\n"
    "  -n, --last N      with -v, at most N operations per rank and group\n"
    "                    (default 20; 0: all)\n"
    "  --world-size W    expect ranks 0..W-1 (default: the dumps' WORLD_SIZE)\n"
    "  -h, --help        this text\n"
    "  --version         print \"ddp-debug (ddp) VERSION\"\n"
    "\n"
    "Exit status: 0 when the dumps were read, 1 when one could not be, 2 on\n"
    "bad usage.\n";

typedef struct dumps {
  ddp__flight_dump *items;
  size_t n, cap;
  int failed;
} dumps;

static int add_file(dumps *d, const char *path) {
  if (d->n == d->cap) {
    size_t cap = d->cap ? 2 * d->cap : 16;
    ddp__flight_dump *items = realloc(d->items, cap * sizeof *items);
    if (!items) {
      fprintf(stderr, "ddp-debug: out of memory\n");
      exit(1);
    }
    d->items = items;
    d->cap = cap;
  }
  if (ddp__flight_read_file(path, &d->items[d->n]) != DDP_OK) {
    fprintf(stderr, "ddp-debug: %s\n", ddp_last_error());
    d->failed = 1;
    return 0;
  }
  d->n++;
  return 1;
}

static int is_dump_name(const char *name) {
  size_t n = strlen(name);
  return strncmp(name, "ddp-flight-", 11) == 0 && n > 16 && strcmp(name + n - 5, ".json") == 0;
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static void add_path(dumps *d, const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) {
    fprintf(stderr, "ddp-debug: %s: %s\n", path, strerror(errno));
    d->failed = 1;
    return;
  }
  if (!S_ISDIR(sb.st_mode)) {
    add_file(d, path);
    return;
  }
  DIR *dir = opendir(path);
  if (!dir) {
    fprintf(stderr, "ddp-debug: %s: %s\n", path, strerror(errno));
    d->failed = 1;
    return;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  for (struct dirent *e; (e = readdir(dir));) {
    if (!is_dump_name(e->d_name)) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(names, cap * sizeof *names);
      if (!grown) exit(1);
      names = grown;
    }
    names[n++] = strdup(e->d_name);
  }
  closedir(dir);
  qsort(names, n, sizeof *names, name_cmp);
  if (n == 0) fprintf(stderr, "ddp-debug: no ddp-flight-*.json in %s\n", path);
  for (size_t i = 0; i < n; i++) {
    char full[4096];
    snprintf(full, sizeof full, "%s/%s", path, names[i]);
    add_file(d, full);
    free(names[i]);
  }
  free(names);
}

/* A time relative to the dump ("-2.004s"), or "-" when never reached. */
static void print_time(int64_t ns, int64_t base) {
  if (ns < 0)
    printf(" %11s", "-");
  else
    printf(" %+10.3fs", (double)(ns - base) / 1e9);
}

static void list_group(const ddp__flight_dump *d, const ddp__flight_group *g, long last) {
  printf("  group %s: rank %d of %d, %s backend, %llu operation%s recorded (%zu kept)\n", g->name, (int)g->rank,
         (int)g->size, g->backend[0] ? g->backend : "?", (unsigned long long)g->recorded, g->recorded == 1 ? "" : "s",
         g->n);
  if (g->n == 0) return;
  printf("    %8s  %-44s %-10s %12s %12s %12s  (s before the dump)\n", "record", "operation", "state", "scheduled",
         "started", "ended");
  size_t from = last > 0 && g->n > (size_t)last ? g->n - (size_t)last : 0;
  for (size_t i = from; i < g->n; i++) {
    const ddp__flight_record *r = &g->records[i];
    char what[200];
    ddp__flight_describe(r, what, sizeof what);
    char *unnumbered = r->seq == 0 ? strstr(what, " #0") : NULL; /* queued: numbered when it starts */
    if (unnumbered) memmove(unnumbered, unnumbered + 3, strlen(unnumbered + 3) + 1);
    printf("    %8llu  %-44s %-10s", (unsigned long long)r->id, what, ddp__flight_state_name(r->state));
    print_time(r->scheduled_ns, d->dump_ns);
    print_time(r->started_ns, d->dump_ns);
    print_time(r->ended_ns, d->dump_ns);
    if (r->status) printf("  %s", ddp_status_name((ddp_status)r->status));
    printf("\n");
  }
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--version")) {
      printf("ddp-debug (ddp) %s\n", ddp_version());
      return 0;
    }
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      fputs(usage, stdout);
      return 0;
    }
  }
  if (argc < 2 || strcmp(argv[1], "flight") != 0) {
    fprintf(stderr, "ddp-debug: %s\n(see ddp-debug --help)\n",
            argc < 2 ? "no command (flight)" : "unknown command; the one command is flight");
    return 2;
  }
  int verbose = 0;
  long last = 20, world = -1;
  dumps d = {0};
  int paths = 0;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
      verbose = 1;
    } else if ((!strcmp(a, "-n") || !strcmp(a, "--last") || !strcmp(a, "--world-size")) && i + 1 < argc) {
      char *end;
      long v = strtol(argv[++i], &end, 10);
      if (*end || v < 0) {
        fprintf(stderr, "ddp-debug: %s takes a count, not \"%s\"\n", a, argv[i]);
        return 2;
      }
      if (!strcmp(a, "--world-size")) world = v;
      else last = v;
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "ddp-debug: unknown option %s\n(see ddp-debug --help)\n", a);
      return 2;
    } else {
      add_path(&d, a);
      paths++;
    }
  }
  if (!paths) {
    fprintf(stderr, "ddp-debug: flight needs a dump file or a directory\n(see ddp-debug --help)\n");
    return 2;
  }
  for (size_t k = 0; k < d.n; k++) {
    const ddp__flight_dump *x = &d.items[k];
    char label[32];
    if (x->rank >= 0) snprintf(label, sizeof label, "rank %d", (int)x->rank);
    else snprintf(label, sizeof label, "pid %lld", (long long)x->pid);
    printf("%s: pid %lld on %s, dump %llu on %s%s%s\n", label, (long long)x->pid, x->host,
           (unsigned long long)x->dump_number, x->reason, x->detail[0] ? ": " : "", x->detail);
    if (verbose)
      for (size_t g = 0; g < x->n_groups; g++) list_group(x, &x->groups[g], last);
  }
  char *verdict = NULL;
  if (d.n && ddp__flight_verdict(d.items, d.n, (int32_t)world, NULL, &verdict) == DDP_OK) {
    printf("verdict:\n");
    for (char *line = verdict; *line;) {
      char *end = strchr(line, '\n');
      printf("  %.*s\n", (int)(end ? end - line : (long)strlen(line)), line);
      if (!end) break;
      line = end + 1;
    }
  } else if (d.n) {
    fprintf(stderr, "ddp-debug: %s\n", ddp_last_error());
    d.failed = 1;
  }
  ddp_free(verdict);
  for (size_t k = 0; k < d.n; k++) ddp__flight_dump_free(&d.items[k]);
  free(d.items);
  return d.failed ? 1 : 0;
}
