/* ddprun --trace DIR: after the job, the ranks' timelines (DIR/rank<N>.json,
 * written by the trainer, src/train/trace.c) merged into DIR/trace.json, a
 * process per rank. Each rank's times count from its own start; the merge
 * shifts them onto the earliest rank's start through the CLOCK_REALTIME
 * reading each rank paired with its monotonic origin. The rank files are
 * ours (one event per line, "ts":<number> in each), so lines are shifted
 * as text and everything else is copied as it is. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io_internal.h"
#include "launch/launch_internal.h"

#define MAX_RANK_FILE ((long)1 << 31) /* 2 GiB: far beyond a trace's 96 MiB of events */

typedef struct text {
  char *p;
  size_t n, cap;
} text;

static ddp_status append(text *t, const char *s, size_t n) {
  if (t->n + n + 1 > t->cap) {
    size_t cap = t->cap ? t->cap : 1 << 16;
    while (cap < t->n + n + 1) cap *= 2;
    char *p = ddp_realloc(t->p, t->n, cap);
    if (!p) return ddp_error(DDP_ERR_NOMEM, "ddprun --trace: out of memory merging the traces");
    t->p = p;
    t->cap = cap;
  }
  memcpy(t->p + t->n, s, n);
  t->n += n;
  t->p[t->n] = '\0';
  return DDP_OK;
}

static ddp_status read_file(const char *path, text *out) {
  FILE *f = fopen(path, "rb");
  if (!f) return ddp_error(DDP_ERR_IO, "ddprun --trace: cannot open %s: %s", path, strerror(errno));
  ddp_status s = DDP_OK;
  long size = -1;
  if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
  if (size < 0 || size > MAX_RANK_FILE || fseek(f, 0, SEEK_SET) != 0) {
    s = ddp_error(DDP_ERR_IO, "ddprun --trace: %s: cannot take its size, or over 2 GiB", path);
  } else {
    out->p = ddp_alloc((size_t)size + 1);
    if (!out->p) s = ddp_error(DDP_ERR_NOMEM, "ddprun --trace: out of memory for %s", path);
    else if (fread(out->p, 1, (size_t)size, f) != (size_t)size)
      s = ddp_error(DDP_ERR_IO, "ddprun --trace: reading %s: short read", path);
    else {
      out->p[size] = '\0';
      out->n = (size_t)size;
    }
  }
  fclose(f);
  return s;
}

/* The number after `key` in the file's otherData; false when missing. */
static bool other_int(const char *file, const char *key, int64_t *v) {
  const char *other = strstr(file, "\"otherData\":");
  const char *at = other ? strstr(other, key) : NULL;
  if (!at) return false;
  char *end;
  long long x = strtoll(at + strlen(key), &end, 10);
  if (end == at + strlen(key)) return false;
  *v = x;
  return true;
}

/* Appends the events of one rank's file to `out`, their times shifted by
 * shift_us; *first says whether a separator is due. */
static ddp_status merge_events(const char *path, const text *file, double shift_us, text *out,
                               bool *first) {
  static const char head[] = "{\"traceEvents\":[\n";
  if (strncmp(file->p, head, sizeof head - 1) != 0)
    return ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s is not a ddp trace (no traceEvents)", path);
  const char *line = file->p + sizeof head - 1;
  int line_no = 2;
  while (*line && *line != ']') {
    const char *nl = strchr(line, '\n');
    if (!nl) return ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s ends inside line %d", path, line_no);
    size_t len = (size_t)(nl - line);
    if (len && line[len - 1] == ',') len--;
    const char *ts = strstr(line, "\"ts\":");
    if (line[0] != '{' || !ts || ts > line + len)
      return ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s line %d is not an event with \"ts\"",
                       path, line_no);
    char *end;
    double v = strtod(ts + 5, &end);
    if (end == ts + 5 || end > line + len)
      return ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s line %d: \"ts\" is not a number",
                       path, line_no);
    char num[64];
    int k = snprintf(num, sizeof num, "%.3f", v + shift_us);
    if (!*first) DDP_TRY(append(out, ",\n", 2));
    *first = false;
    DDP_TRY(append(out, line, (size_t)(ts + 5 - line)));
    DDP_TRY(append(out, num, (size_t)k));
    DDP_TRY(append(out, end, (size_t)(line + len - end)));
    line = nl + 1;
    line_no++;
  }
  if (*line != ']')
    return ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s: the event list does not end", path);
  return DDP_OK;
}

/* rank<N>.json, N a decimal number. */
static bool rank_file(const char *name, int *rank) {
  int n = -1, r;
  if (sscanf(name, "rank%d.json%n", &r, &n) != 1 || n < 0 || name[n] != '\0' || r < 0)
    return false;
  *rank = r;
  return true;
}

#define MAX_RANKS 65536

ddp_status ddp__trace_merge(const char *dir, int *ranks) {
  *ranks = 0;
  DIR *d = opendir(dir);
  if (!d) return ddp_error(DDP_ERR_IO, "ddprun --trace: cannot open %s: %s", dir, strerror(errno));
  /* The rank files in rank order. */
  int *found = NULL, n = 0, cap = 0;
  ddp_status s = DDP_OK;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    int r;
    if (!rank_file(e->d_name, &r)) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      int *p = cap <= MAX_RANKS
                   ? ddp_realloc(found, (size_t)n * sizeof *found, (size_t)cap * sizeof *found)
                   : NULL;
      if (!p) {
        s = ddp_error(DDP_ERR_NOMEM, "ddprun --trace: too many rank files in %s", dir);
        break;
      }
      found = p;
    }
    found[n++] = r;
  }
  closedir(d);
  for (int i = 1; i < n; i++) /* insertion sort: a few ranks per node */
    for (int j = i; j > 0 && found[j - 1] > found[j]; j--) {
      int x = found[j];
      found[j] = found[j - 1];
      found[j - 1] = x;
    }
  text *files = s == DDP_OK && n ? ddp_calloc((size_t)n, sizeof *files) : NULL;
  int64_t *origin = s == DDP_OK && n ? ddp_calloc((size_t)n, sizeof *origin) : NULL;
  if (s == DDP_OK && n && (!files || !origin))
    s = ddp_error(DDP_ERR_NOMEM, "ddprun --trace: out of memory");
  if (s == DDP_OK && n == 0) s = ddp_error(DDP_ERR_IO, "ddprun --trace: no rank<N>.json in %s", dir);
  char path[DDP_LAUNCH_PATH_BYTES + 32];
  int64_t common = INT64_MAX;
  for (int i = 0; s == DDP_OK && i < n; i++) {
    snprintf(path, sizeof path, "%s/rank%d.json", dir, found[i]);
    s = read_file(path, &files[i]);
    int64_t version = 0;
    if (s == DDP_OK && (!other_int(files[i].p, "\"ddp_trace_version\":", &version) || version != 1 ||
                        !other_int(files[i].p, "\"origin_unix_ns\":", &origin[i])))
      s = ddp_error(DDP_ERR_INVALID, "ddprun --trace: %s has no ddp_trace_version 1 with "
                    "origin_unix_ns in its otherData", path);
    if (s == DDP_OK && origin[i] < common) common = origin[i];
  }
  text out = {0};
  bool first = true;
  if (s == DDP_OK) s = append(&out, "{\"traceEvents\":[\n", 17);
  for (int i = 0; s == DDP_OK && i < n; i++) {
    snprintf(path, sizeof path, "%s/rank%d.json", dir, found[i]);
    s = merge_events(path, &files[i], 1e-3 * (double)(origin[i] - common), &out, &first);
  }
  if (s == DDP_OK) {
    char tail[256];
    int k = snprintf(tail, sizeof tail,
                     "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"ddp_trace_version\":1,"
                     "\"ranks\":%d,\"origin_unix_ns\":%" PRId64 ",\"aligned_on\":\"CLOCK_REALTIME\"}}\n",
                     n, common);
    s = append(&out, tail, (size_t)k);
  }
  if (s == DDP_OK) {
    snprintf(path, sizeof path, "%s/trace.json", dir);
    ddp__atomic_file f = {0};
    s = ddp__atomic_open(&f, path);
    if (s == DDP_OK) s = ddp__atomic_write(&f, out.p, out.n);
    if (s == DDP_OK) s = ddp__atomic_finish(&f);
    if (s == DDP_OK) s = ddp__atomic_commit(&f);
    ddp__atomic_abort(&f);
  }
  for (int i = 0; files && i < n; i++) ddp_free(files[i].p);
  ddp_free(files);
  ddp_free(origin);
  ddp_free(found);
  ddp_free(out.p);
  if (s == DDP_OK) *ranks = n;
  return s;
}
