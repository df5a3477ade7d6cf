/* Flight recorder dumps, from JSON back to records (declared in
 * launch_internal.h). Names (operations, dtypes, reduce ops, states,
 * statuses) map back through the same tables that wrote them, so an unknown
 * name is an error, not a guess. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "io/io_internal.h"
#include "launch/launch_internal.h"

#define MAX_FILE_BYTES (1LL << 30)

typedef struct reader {
  const char *what;
  ddp_status st;
} reader;

static ddp_status bad(reader *rd, const ddp__json *at, const char *fmt, const char *field) {
  if (rd->st == DDP_OK)
    rd->st = ddp_error(DDP_ERR_FORMAT, "%s: %s%s (offset %zu)", rd->what, field, fmt, at ? at->offset : 0);
  return rd->st;
}

static const ddp__json *member(reader *rd, const ddp__json *obj, const char *key, ddp__json_kind kind,
                               bool nullable) {
  const ddp__json *v = ddp__json_get(obj, key);
  if (!v) {
    bad(rd, obj, " is missing", key);
    return NULL;
  }
  if (nullable && v->kind == DDP__JSON_NULL) return v;
  if (v->kind != kind) {
    bad(rd, v, kind == DDP__JSON_NUMBER ? " is not an integer" : " has the wrong type", key);
    return NULL;
  }
  if (kind == DDP__JSON_NUMBER && !v->is_integer) {
    bad(rd, v, " is not an integer", key);
    return NULL;
  }
  return v;
}

/* An integer member within [lo, hi]; null gives null_value when allowed. */
static int64_t integer(reader *rd, const ddp__json *obj, const char *key, int64_t lo, int64_t hi, bool nullable,
                       int64_t null_value) {
  const ddp__json *v = member(rd, obj, key, DDP__JSON_NUMBER, nullable);
  if (!v) return lo;
  if (v->kind == DDP__JSON_NULL) return null_value;
  if (v->integer < lo || v->integer > hi) {
    bad(rd, v, " is out of range", key);
    return lo;
  }
  return v->integer;
}

static void string(reader *rd, const ddp__json *obj, const char *key, char *out, size_t bytes) {
  out[0] = '\0';
  const ddp__json *v = member(rd, obj, key, DDP__JSON_STRING, false);
  if (v) snprintf(out, bytes, "%s", v->string);
}

/* A name member looked up by `name_of(i)` for i in [lo, hi); null gives
 * null_value when allowed. */
static int32_t named(reader *rd, const ddp__json *obj, const char *key, int32_t lo, int32_t hi,
                     const char *(*name_of)(int32_t), bool nullable, int32_t null_value) {
  const ddp__json *v = member(rd, obj, key, DDP__JSON_STRING, nullable);
  if (!v) return null_value;
  if (v->kind == DDP__JSON_NULL) return null_value;
  for (int32_t i = lo; i < hi; i++)
    if (strcmp(v->string, name_of(i)) == 0) return i;
  bad(rd, v, " names nothing known", key);
  return null_value;
}

static const char *op_name(int32_t i) { return ddp__op_kind_name((ddp__op_kind)i); }
static const char *dtype_name(int32_t i) { return ddp_dtype_name((ddp_dtype)i); }
static const char *reduce_name(int32_t i) { return ddp_reduce_op_name((ddp_reduce_op)i); }
static const char *state_name(int32_t i) { return ddp__flight_state_name(i); }
static const char *status_name(int32_t i) { return ddp_status_name((ddp_status)-i); }

static void read_record(reader *rd, const ddp__json *e, ddp__flight_record *r) {
  memset(r, 0, sizeof *r);
  if (e->kind != DDP__JSON_OBJECT) {
    bad(rd, e, " is not an object", "an entry");
    return;
  }
  r->id = (uint64_t)integer(rd, e, "id", 0, INT64_MAX, false, 0);
  r->seq = (uint64_t)integer(rd, e, "seq", 0, INT64_MAX, false, 0);
  r->kind = named(rd, e, "op", 0, DDP__OP_KIND_COUNT, op_name, false, 0);
  r->count = (uint64_t)integer(rd, e, "count", 0, INT64_MAX, false, 0);
  r->dtype = named(rd, e, "dtype", DDP_FLOAT32, DDP_BFLOAT16 + 1, dtype_name, true, -1);
  r->reduce_op = named(rd, e, "reduce_op", 0, DDP_REDUCE_OP_COUNT, reduce_name, true, -1);
  r->root = (int32_t)integer(rd, e, "root", -1, INT32_MAX, false, -1);
  r->peer = (int32_t)integer(rd, e, "peer", -1, INT32_MAX, false, -1);
  r->tag = (int32_t)integer(rd, e, "tag", INT32_MIN, INT32_MAX, false, 0);
  r->state = named(rd, e, "state", DDP__FLIGHT_SCHEDULED, DDP__FLIGHT_ENQUEUED + 1, state_name, false, 0);
  /* Statuses are 0, -1, ..., -17: named by their negation. */
  r->status = -named(rd, e, "status", 0, 64, status_name, true, 0);
  r->scheduled_ns = integer(rd, e, "scheduled_ns", 0, INT64_MAX, true, -1);
  r->started_ns = integer(rd, e, "started_ns", 0, INT64_MAX, true, -1);
  r->ended_ns = integer(rd, e, "ended_ns", 0, INT64_MAX, true, -1);
}

static void read_group(reader *rd, const ddp__json *g, int64_t dump_ns, ddp__flight_group *out) {
  if (g->kind != DDP__JSON_OBJECT) {
    bad(rd, g, " is not an object", "a group");
    return;
  }
  string(rd, g, "name", out->name, sizeof out->name);
  string(rd, g, "backend", out->backend, sizeof out->backend);
  out->size = (int32_t)integer(rd, g, "size", 1, INT32_MAX, false, 1);
  out->rank = (int32_t)integer(rd, g, "rank", 0, out->size - 1, false, 0);
  out->recorded = (uint64_t)integer(rd, g, "recorded", 0, INT64_MAX, false, 0);
  out->dump_ns = dump_ns;
  const ddp__json *entries = member(rd, g, "entries", DDP__JSON_ARRAY, false);
  if (!entries || rd->st != DDP_OK) return;
  if (entries->count > DDP__FLIGHT_MAX_SIZE) {
    bad(rd, entries, " holds more records than a ring can", "entries");
    return;
  }
  out->records = entries->count ? ddp_calloc(entries->count, sizeof *out->records) : NULL;
  if (entries->count && !out->records) {
    rd->st = ddp_error(DDP_ERR_NOMEM, "%s: out of memory for %zu records", rd->what, entries->count);
    return;
  }
  for (const ddp__json *e = entries->first; e && rd->st == DDP_OK; e = e->next)
    read_record(rd, e, &out->records[out->n++]);
}

ddp_status ddp__flight_parse(const char *text, size_t len, const char *what, ddp__flight_dump *d) {
  memset(d, 0, sizeof *d);
  ddp__json_doc doc;
  ddp_status st = ddp__json_parse(text, len, 0, &doc);
  if (st != DDP_OK) return ddp_error_wrap(st, "%s", what);
  reader rd = {what, DDP_OK};
  const ddp__json *root = doc.root;
  char format[64] = "";
  if (root->kind != DDP__JSON_OBJECT) bad(&rd, root, " is not a JSON object", "the dump");
  if (rd.st == DDP_OK) string(&rd, root, "format", format, sizeof format);
  if (rd.st == DDP_OK && strcmp(format, DDP__FLIGHT_FORMAT) != 0)
    bad(&rd, ddp__json_get(root, "format"), " is not \"" DDP__FLIGHT_FORMAT "\"", "format");
  if (rd.st == DDP_OK && integer(&rd, root, "version", 0, INT32_MAX, false, 0) != DDP__FLIGHT_VERSION)
    bad(&rd, ddp__json_get(root, "version"), " is not 1 (a newer ddp wrote this dump?)", "version");
  if (rd.st == DDP_OK) {
    d->rank = (int32_t)integer(&rd, root, "rank", -1, INT32_MAX, false, -1);
    d->world_size = (int32_t)integer(&rd, root, "world_size", -1, INT32_MAX, false, -1);
    d->pid = integer(&rd, root, "pid", 0, INT64_MAX, false, 0);
    d->attempt = (int32_t)integer(&rd, root, "attempt", -1, INT32_MAX, false, -1);
    d->dump_number = (uint64_t)integer(&rd, root, "dump", 0, INT64_MAX, false, 0);
    d->capacity = (uint64_t)integer(&rd, root, "capacity", 0, DDP__FLIGHT_MAX_SIZE, false, 0);
    d->dump_ns = integer(&rd, root, "dump_ns", 0, INT64_MAX, false, 0);
    d->dump_unix_ns = integer(&rd, root, "dump_unix_ns", 0, INT64_MAX, false, 0);
    string(&rd, root, "host", d->host, sizeof d->host);
    string(&rd, root, "run_id", d->run_id, sizeof d->run_id);
    string(&rd, root, "reason", d->reason, sizeof d->reason);
    string(&rd, root, "detail", d->detail, sizeof d->detail);
  }
  const ddp__json *groups = rd.st == DDP_OK ? member(&rd, root, "groups", DDP__JSON_ARRAY, false) : NULL;
  if (groups && groups->count) {
    d->groups = ddp_calloc(groups->count, sizeof *d->groups);
    if (!d->groups) rd.st = ddp_error(DDP_ERR_NOMEM, "%s: out of memory", what);
    for (const ddp__json *g = groups->first; g && rd.st == DDP_OK; g = g->next)
      read_group(&rd, g, d->dump_ns, &d->groups[d->n_groups++]);
  }
  ddp__json_free(&doc);
  if (rd.st != DDP_OK) ddp__flight_dump_free(d);
  return rd.st;
}

ddp_status ddp__flight_read_file(const char *path, ddp__flight_dump *dump) {
  memset(dump, 0, sizeof *dump);
  FILE *f = fopen(path, "rb");
  if (!f) return ddp_error(errno == ENOENT ? DDP_ERR_NOTFOUND : DDP_ERR_IO, "cannot open %s: %s", path,
                           strerror(errno));
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0 || sb.st_size < 0 || sb.st_size > MAX_FILE_BYTES) {
    fclose(f);
    return ddp_error(DDP_ERR_FORMAT, "%s: not a flight recorder dump (size %lld)", path, (long long)sb.st_size);
  }
  size_t len = (size_t)sb.st_size;
  char *text = ddp_alloc(len + 1);
  if (!text) {
    fclose(f);
    return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for %zu bytes", path, len);
  }
  size_t got = fread(text, 1, len, f);
  fclose(f);
  if (got != len) {
    ddp_free(text);
    return ddp_error(DDP_ERR_IO, "%s: short read (%zu of %zu bytes)", path, got, len);
  }
  text[len] = '\0';
  ddp_status st = ddp__flight_parse(text, len, path, dump);
  ddp_free(text);
  return st;
}
