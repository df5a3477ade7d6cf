/* The trainer's timeline: a preallocated event buffer filled during the run
 * and a small buffered writer that turns it into Chrome trace event JSON
 * (the format Perfetto and chrome://tracing load) through io's atomic file
 * (temporary name, fsync, rename). One event per line, "ts" always written
 * the same way, so that ddprun's merge (src/launch/trace_merge.c) can shift
 * each rank's times without a JSON parser. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "io/io_internal.h"
#include "train/trace.h"

struct ddp__trace {
  ddp__trace_event *events; /* (capacity) */
  size_t n, capacity;
  int64_t dropped;
  int rank, world_size;
  int64_t origin_mono_ns, origin_unix_ns;
  char *path;
};

static const char *const kind_names[DDP__TRACE_KIND_COUNT] = {
    [DDP__TRACE_STEP] = "step",           [DDP__TRACE_LOAD] = "load",
    [DDP__TRACE_FORWARD] = "forward",     [DDP__TRACE_BACKWARD] = "backward",
    [DDP__TRACE_AUTOGRAD] = "autograd",   [DDP__TRACE_WAIT] = "wait",
    [DDP__TRACE_BLOCKING] = "allreduce (last bucket, blocking)",
    [DDP__TRACE_OPTIMIZER] = "optimizer", [DDP__TRACE_LOSS] = "loss allreduce",
    [DDP__TRACE_EVALUATE] = "evaluate",   [DDP__TRACE_ALLREDUCE] = "allreduce",
};

/* The thread tracks: the training thread's and the communication track. */
enum { TID_TRAIN = 1, TID_COMM = 2 };

static int64_t realtime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

ddp_status ddp__trace_create(ddp__trace **out, const char *path, int rank, int world_size,
                             size_t capacity) {
  *out = NULL;
  ddp__trace *tr = ddp_calloc(1, sizeof *tr);
  size_t len = strlen(path) + 1;
  if (tr) tr->path = ddp_alloc(len);
  if (tr && capacity) tr->events = ddp_alloc(capacity * sizeof *tr->events);
  if (!tr || !tr->path || (capacity && !tr->events)) {
    ddp__trace_destroy(tr);
    return ddp_error(DDP_ERR_NOMEM, "trace %s: out of memory for %zu events", path, capacity);
  }
  memcpy(tr->path, path, len);
  tr->capacity = capacity;
  tr->rank = rank;
  tr->world_size = world_size;
  /* The pair of clocks: the realtime reading between two monotonic ones,
   * the monotonic origin their midpoint (the pair is good to the gap, a
   * microsecond or less). */
  int64_t m0 = ddp_time_ns();
  tr->origin_unix_ns = realtime_ns();
  int64_t m1 = ddp_time_ns();
  tr->origin_mono_ns = m0 + (m1 - m0) / 2;
  *out = tr;
  return DDP_OK;
}

void ddp__trace_destroy(ddp__trace *tr) {
  if (!tr) return;
  ddp_free(tr->events);
  ddp_free(tr->path);
  ddp_free(tr);
}

void ddp__trace_add_bucket(ddp__trace *tr, ddp__trace_kind kind, int64_t step, int bucket,
                           int64_t numel, int params_not_ready, int64_t start_ns,
                           int64_t end_ns) {
  if (tr->n == tr->capacity) {
    tr->dropped++;
    return;
  }
  tr->events[tr->n++] = (ddp__trace_event){.start_ns = start_ns, .end_ns = end_ns, .step = step,
                                           .numel = numel, .kind = (int32_t)kind,
                                           .bucket = bucket,
                                           .params_not_ready = params_not_ready};
}

void ddp__trace_add(ddp__trace *tr, ddp__trace_kind kind, int64_t step, int64_t start_ns,
                    int64_t end_ns) {
  ddp__trace_add_bucket(tr, kind, step, -1, 0, 0, start_ns, end_ns);
}

/* ---- Writing ------------------------------------------------------------- */

/* A buffered writer over the atomic file: the first error sticks and
 * later writes do nothing. */
typedef struct writer {
  ddp__atomic_file file;
  char buf[1 << 16];
  size_t used;
  ddp_status status;
} writer;

static void flush(writer *w) {
  if (w->status == DDP_OK && w->used) w->status = ddp__atomic_write(&w->file, w->buf, w->used);
  w->used = 0;
}

static void put(writer *w, const char *fmt, ...) {
  if (sizeof w->buf - w->used < 512) flush(w);
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(w->buf + w->used, sizeof w->buf - w->used, fmt, ap);
  va_end(ap);
  /* Every line is well under 512 bytes (no path or name of the user's is
   * printed), so it always fits after the flush above. */
  if (n > 0 && (size_t)n < sizeof w->buf - w->used) w->used += (size_t)n;
}

/* Microseconds since the origin, to the nanosecond. */
static double us(const ddp__trace *tr, int64_t ns) { return 1e-3 * (double)(ns - tr->origin_mono_ns); }

static void put_event(writer *w, const ddp__trace *tr, const ddp__trace_event *e) {
  const char *name = kind_names[e->kind];
  if (e->kind == DDP__TRACE_ALLREDUCE) {
    /* An async slice (begin, end) with an id per step and bucket: the
     * buckets' reductions overlap, which complete events on one track
     * cannot show. */
    long long id = (long long)e->step * 65536 + e->bucket;
    put(w,
        "{\"ph\":\"b\",\"name\":\"%s\",\"cat\":\"comm\",\"id\":%lld,\"pid\":%d,\"tid\":%d,"
        "\"ts\":%.3f,\"args\":{\"step\":%lld,\"bucket\":%d,\"numel\":%lld,\"bytes\":%lld,"
        "\"params_not_ready\":%d}},\n",
        name, id, tr->rank, TID_COMM, us(tr, e->start_ns), (long long)e->step, e->bucket,
        (long long)e->numel, 4LL * e->numel, e->params_not_ready);
    put(w,
        "{\"ph\":\"e\",\"name\":\"%s\",\"cat\":\"comm\",\"id\":%lld,\"pid\":%d,\"tid\":%d,"
        "\"ts\":%.3f},\n",
        name, id, tr->rank, TID_COMM, us(tr, e->end_ns));
    return;
  }
  const char *cat = e->kind == DDP__TRACE_EVALUATE ? "eval" : "step";
  put(w, "{\"ph\":\"X\",\"name\":\"%s\",\"cat\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
         "\"dur\":%.3f,\"args\":{\"step\":%lld",
      name, cat, tr->rank, TID_TRAIN, us(tr, e->start_ns), 1e-3 * (double)(e->end_ns - e->start_ns),
      (long long)e->step);
  if (e->bucket >= 0) put(w, ",\"bucket\":%d,\"numel\":%lld", e->bucket, (long long)e->numel);
  put(w, "}},\n");
}

ddp_status ddp__trace_write(ddp__trace *tr) {
  writer *w = ddp_calloc(1, sizeof *w); /* 64 KiB: off the stack; once, at the end */
  if (!w) return ddp_error(DDP_ERR_NOMEM, "trace %s: out of memory for the writer", tr->path);
  ddp_status s = ddp__atomic_open(&w->file, tr->path);
  if (s != DDP_OK) {
    ddp_free(w);
    return ddp_error_wrap(s, "writing the trace");
  }
  /* Metadata first, then the events, each line ending in a comma, then one
   * last metadata event without it: every event is one line. */
  put(w, "{\"traceEvents\":[\n");
  put(w, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"ts\":0.000,"
         "\"args\":{\"name\":\"rank %d\"}},\n", tr->rank, tr->rank);
  put(w, "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":0,\"ts\":0.000,"
         "\"args\":{\"sort_index\":%d}},\n", tr->rank, tr->rank);
  put(w, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"ts\":0.000,"
         "\"args\":{\"name\":\"training\"}},\n", tr->rank, TID_TRAIN);
  for (size_t i = 0; i < tr->n; i++) put_event(w, tr, &tr->events[i]);
  put(w, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"ts\":0.000,"
         "\"args\":{\"name\":\"communication\"}}\n", tr->rank, TID_COMM);
  put(w, "],\n\"displayTimeUnit\":\"ms\",\n");
  put(w, "\"otherData\":{\"ddp_trace_version\":1,\"rank\":%d,\"world_size\":%d,"
         "\"origin_unix_ns\":%lld,\"origin_monotonic_ns\":%lld,\"events\":%zu,"
         "\"dropped_events\":%lld}}\n",
      tr->rank, tr->world_size, (long long)tr->origin_unix_ns, (long long)tr->origin_mono_ns,
      tr->n, (long long)tr->dropped);
  flush(w);
  s = w->status;
  if (s == DDP_OK) s = ddp__atomic_finish(&w->file);
  if (s == DDP_OK) s = ddp__atomic_commit(&w->file);
  ddp__atomic_abort(&w->file);
  ddp_free(w);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "writing the trace");
}
