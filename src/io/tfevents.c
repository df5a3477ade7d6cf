/* TensorBoard event files (include/ddp/tensorboard.h): SummaryWriter's file
 * naming, TFRecord framing, and the Event / Summary protocol buffers encoded
 * by protobuf.c. Field numbers from tensorflow/core/util/event.proto,
 * tensorflow/core/framework/{summary,tensor,tensor_shape,types}.proto (as
 * vendored in the tensorboard package's compat/proto). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/core_internal.h"
#include "ddp/tensorboard.h"
#include "io/crc32c.h"
#include "io/protobuf.h"

/* Event */
enum { EVENT_WALL_TIME = 1, EVENT_STEP = 2, EVENT_FILE_VERSION = 3, EVENT_SUMMARY = 5,
       EVENT_SOURCE_METADATA = 10 };
enum { SOURCE_METADATA_WRITER = 1 };
/* Summary, Summary.Value */
enum { SUMMARY_VALUE = 1 };
enum { VALUE_TAG = 1, VALUE_SIMPLE_VALUE = 2, VALUE_TENSOR = 8, VALUE_METADATA = 9 };
/* SummaryMetadata, SummaryMetadata.PluginData */
enum { METADATA_PLUGIN_DATA = 1 };
enum { PLUGIN_DATA_PLUGIN_NAME = 1 };
/* TensorProto, TensorShapeProto, TensorShapeProto.Dim, DataType */
enum { TENSOR_DTYPE = 1, TENSOR_SHAPE = 2, TENSOR_STRING_VAL = 8 };
enum { SHAPE_DIM = 2 };
enum { DIM_SIZE = 1 };
enum { DT_STRING = 7 };

/* A TFRecord's header: the length (8 bytes) and its masked CRC (4). */
#define RECORD_HEADER 12

struct ddp_summary_writer {
  int fd;
  char *path;
  ddp__pb record; /* one record being framed: header, Event, footer */
};

/* SummaryWriter's <n>: writers made by this process, from 0. */
static atomic_uint writers_made;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* w->record holds RECORD_HEADER bytes of room followed by an encoded
 * Event: fills in the header, appends the footer and writes the record in
 * one call. TFRecord: uint64 length, uint32 masked CRC-32C of those 8
 * bytes, the data, uint32 masked CRC-32C of the data; little-endian. */
static ddp_status write_record(ddp_summary_writer *w) {
  ddp__pb *b = &w->record;
  uint8_t footer[4] = {0};
  if (!b->failed) {
    uint64_t len = b->len - RECORD_HEADER;
    for (int i = 0; i < 8; i++) b->data[i] = (uint8_t)(len >> (8 * i));
    uint32_t crc = ddp__crc32c_mask(ddp__crc32c(0, b->data, 8));
    for (int i = 0; i < 4; i++) b->data[8 + i] = (uint8_t)(crc >> (8 * i));
    crc = ddp__crc32c_mask(ddp__crc32c(0, b->data + RECORD_HEADER, len));
    for (int i = 0; i < 4; i++) footer[i] = (uint8_t)(crc >> (8 * i));
  }
  ddp__pb_raw(b, footer, sizeof footer);
  if (b->failed)
    return ddp_error(DDP_ERR_NOMEM, "tensorboard: %s: out of memory encoding an event", w->path);
  /* O_APPEND: each write(2) lands after the last. */
  if (ddp__write_all(w->fd, b->data, b->len) != 0)
    return ddp_error(DDP_ERR_IO, "tensorboard: writing %s: %s", w->path, strerror(errno));
  return DDP_OK;
}

/* Starts a record: header room, then the Event's wall_time and step
 * (proto3 leaves out a zero step, as SerializeToString does). */
static void begin_event(ddp_summary_writer *w, double wall_time, int64_t step) {
  ddp__pb *b = &w->record;
  ddp__pb_clear(b);
  ddp__pb_raw(b, (const uint8_t[RECORD_HEADER]){0}, RECORD_HEADER);
  ddp__pb_double(b, EVENT_WALL_TIME, isnan(wall_time) ? now_s() : wall_time);
  if (step != 0) ddp__pb_int64(b, EVENT_STEP, step);
}

/* mkdir -p: every missing component of `dir`. */
static ddp_status make_dirs(const char *dir) {
  size_t n = strlen(dir);
  char *p = ddp_strdup(dir);
  if (!p) return ddp_error(DDP_ERR_NOMEM, "tensorboard: creating %s: out of memory", dir);
  ddp_status s = DDP_OK;
  for (size_t i = 1; i <= n && s == DDP_OK; i++) {
    if (p[i] != '/' && p[i] != '\0') continue;
    char c = p[i];
    p[i] = '\0';
    struct stat st;
    if (mkdir(p, 0777) != 0 && errno != EEXIST)
      s = ddp_error(DDP_ERR_IO, "tensorboard: cannot create the directory %s: %s", p,
                    strerror(errno));
    else if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode))
      s = ddp_error(DDP_ERR_IO, "tensorboard: %s is not a directory", p);
    p[i] = c;
  }
  ddp_free(p);
  return s;
}

ddp_status ddp_summary_writer_create(ddp_summary_writer **out, const char *dir,
                                     const char *suffix) {
  *out = NULL;
  if (!dir || !*dir) return ddp_error(DDP_ERR_INVALID, "tensorboard: no directory given");
  DDP_TRY(make_dirs(dir));
  char host[256];
  if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = '\0';
  /* Python's "%010d" % time.time(): the seconds, truncated. */
  double wall = now_s();
  unsigned n = atomic_fetch_add(&writers_made, 1);
  size_t cap = strlen(dir) + strlen(host) + (suffix ? strlen(suffix) : 0) + 96;
  ddp_summary_writer *w = ddp_calloc(1, sizeof *w);
  char *path = ddp_alloc(cap);
  if (!w || !path) {
    ddp_free(w);
    ddp_free(path);
    return ddp_error(DDP_ERR_NOMEM, "tensorboard: out of memory");
  }
  snprintf(path, cap, "%s/events.out.tfevents.%010lld.%s.%ld.%u%s", dir, (long long)wall, host,
           (long)getpid(), n, suffix ? suffix : "");
  w->path = path;
  w->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0666);
  if (w->fd < 0) {
    ddp_status s = ddp_error(DDP_ERR_IO, "tensorboard: cannot create %s: %s", path,
                             strerror(errno));
    ddp_free(path);
    ddp_free(w);
    return s;
  }
  /* The first record says which format follows. */
  ddp__pb *b = &w->record;
  begin_event(w, wall, 0);
  ddp__pb_string(b, EVENT_FILE_VERSION, "brain.Event:2");
  size_t m = ddp__pb_begin(b, EVENT_SOURCE_METADATA);
  ddp__pb_string(b, SOURCE_METADATA_WRITER, "ddp");
  ddp__pb_end(b, m);
  ddp_status s = write_record(w);
  if (s != DDP_OK) {
    unlink(path);
    ddp_summary_writer_destroy(w);
    return s;
  }
  *out = w;
  return DDP_OK;
}

const char *ddp_summary_writer_path(const ddp_summary_writer *w) {
  return w->path;
}

static ddp_status check_tag(const ddp_summary_writer *w, const char *tag) {
  if (!tag || !*tag)
    return ddp_error(DDP_ERR_INVALID, "tensorboard: %s: a summary needs a non-empty tag",
                     w->path);
  return DDP_OK;
}

ddp_status ddp_summary_writer_add_scalars(ddp_summary_writer *w, size_t n,
                                          const char *const *tags, const float *values,
                                          int64_t step, double wall_time) {
  if (n == 0) return ddp_error(DDP_ERR_INVALID, "tensorboard: %s: no scalars to add", w->path);
  for (size_t i = 0; i < n; i++) DDP_TRY(check_tag(w, tags[i]));
  ddp__pb *b = &w->record;
  begin_event(w, wall_time, step);
  size_t summary = ddp__pb_begin(b, EVENT_SUMMARY);
  for (size_t i = 0; i < n; i++) {
    size_t value = ddp__pb_begin(b, SUMMARY_VALUE);
    ddp__pb_string(b, VALUE_TAG, tags[i]);
    ddp__pb_float(b, VALUE_SIMPLE_VALUE, values[i]);
    ddp__pb_end(b, value);
  }
  ddp__pb_end(b, summary);
  return write_record(w);
}

ddp_status ddp_summary_writer_add_scalar(ddp_summary_writer *w, const char *tag, float value,
                                         int64_t step, double wall_time) {
  return ddp_summary_writer_add_scalars(w, 1, &tag, &value, step, wall_time);
}

/* torch.utils.tensorboard.summary.text: Value{tag + "/text_summary",
 * tensor {dtype DT_STRING, shape [1], string_val [text]}, metadata
 * {plugin_data {plugin_name "text", content TextPluginData(version 0),
 * which serializes to nothing}}}, fields in number order as
 * SerializeToString writes them. */
ddp_status ddp_summary_writer_add_text(ddp_summary_writer *w, const char *tag, const char *text,
                                       int64_t step, double wall_time) {
  DDP_TRY(check_tag(w, tag));
  if (!text) return ddp_error(DDP_ERR_INVALID, "tensorboard: %s: text for '%s' is NULL", w->path, tag);
  ddp__pb *b = &w->record;
  begin_event(w, wall_time, step);
  size_t summary = ddp__pb_begin(b, EVENT_SUMMARY);
  size_t value = ddp__pb_begin(b, SUMMARY_VALUE);
  size_t taglen = strlen(tag);
  size_t key = ddp__pb_begin(b, VALUE_TAG); /* the tag and its suffix, one string */
  ddp__pb_raw(b, tag, taglen);
  ddp__pb_raw(b, "/text_summary", strlen("/text_summary"));
  ddp__pb_end(b, key);
  size_t tensor = ddp__pb_begin(b, VALUE_TENSOR);
  ddp__pb_uint64(b, TENSOR_DTYPE, DT_STRING);
  size_t shape = ddp__pb_begin(b, TENSOR_SHAPE);
  size_t dim = ddp__pb_begin(b, SHAPE_DIM);
  ddp__pb_int64(b, DIM_SIZE, 1);
  ddp__pb_end(b, dim);
  ddp__pb_end(b, shape);
  ddp__pb_string(b, TENSOR_STRING_VAL, text);
  ddp__pb_end(b, tensor);
  size_t metadata = ddp__pb_begin(b, VALUE_METADATA);
  size_t plugin = ddp__pb_begin(b, METADATA_PLUGIN_DATA);
  ddp__pb_string(b, PLUGIN_DATA_PLUGIN_NAME, "text");
  ddp__pb_end(b, plugin);
  ddp__pb_end(b, metadata);
  ddp__pb_end(b, value);
  ddp__pb_end(b, summary);
  return write_record(w);
}

void ddp_summary_writer_destroy(ddp_summary_writer *w) {
  if (!w) return;
  if (w->fd >= 0) close(w->fd);
  ddp__pb_free(&w->record);
  ddp_free(w->path);
  ddp_free(w);
}
