/* A worker's error record: torchrun gives each worker TORCHELASTIC_ERROR_FILE,
 * where a program decorated with torch.distributed.elastic's @record (or any
 * program that writes the same JSON) leaves the error that ended it; the
 * launcher reports that message in its failure summary instead of a bare exit
 * code. The formats torchrun reads:
 *   {"message": {"message": "RuntimeError: ...", "extraInfo": {"timestamp": "1700000000", ...}}}
 *   {"message": "..."}                              (a plain message) */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "io/io_internal.h"
#include "launch/launch_internal.h"

/* A record bigger than this is cut: the summary shows its start. */
#define MAX_RECORD_BYTES (256 * 1024)

static void describe(const ddp__json *root, char *buf, size_t bytes) {
  const ddp__json *m = root && root->kind == DDP__JSON_OBJECT ? ddp__json_get(root, "message") : NULL;
  const char *text = NULL, *stamp = NULL;
  if (m && m->kind == DDP__JSON_STRING) {
    text = m->string;
  } else if (m && m->kind == DDP__JSON_OBJECT) {
    const ddp__json *inner = ddp__json_get(m, "message");
    const ddp__json *extra = ddp__json_get(m, "extraInfo");
    const ddp__json *ts = extra && extra->kind == DDP__JSON_OBJECT ? ddp__json_get(extra, "timestamp") : NULL;
    if (inner && inner->kind == DDP__JSON_STRING) text = inner->string;
    if (ts && ts->kind == DDP__JSON_STRING) stamp = ts->string;
  }
  if (!text) {
    snprintf(buf, bytes, "not an error record: no \"message\" string (torchrun's format: "
             "{\"message\": {\"message\": \"...\", \"extraInfo\": {...}}})");
    return;
  }
  char when[64] = "";
  if (stamp) {
    char *end;
    long long secs = strtoll(stamp, &end, 10);
    struct tm tm;
    time_t t = (time_t)secs;
    if (*end == '\0' && end != stamp && gmtime_r(&t, &tm))
      strftime(when, sizeof when, " (recorded at %Y-%m-%d %H:%M:%S UTC)", &tm);
  }
  snprintf(buf, bytes, "%s%s", text, when);
}

void ddp__error_record_read(const char *path, char *buf, size_t bytes) {
  buf[0] = '\0';
  if (!path || !path[0]) return;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) snprintf(buf, bytes, "cannot read %s: %s", path, strerror(errno));
    return;
  }
  char *text = ddp_alloc(MAX_RECORD_BYTES + 1);
  if (!text) {
    close(fd);
    snprintf(buf, bytes, "out of memory reading %s", path);
    return;
  }
  size_t len = 0;
  while (len < MAX_RECORD_BYTES) {
    ssize_t got = read(fd, text + len, MAX_RECORD_BYTES - len);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    len += (size_t)got;
  }
  close(fd);
  text[len] = '\0';
  ddp__json_doc doc;
  if (ddp__json_parse(text, len, 0, &doc) != DDP_OK) {
    snprintf(buf, bytes, "not an error record: %s", ddp_last_error());
    ddp_clear_error();
  } else {
    describe(doc.root, buf, bytes);
    ddp__json_free(&doc);
  }
  ddp_free(text);
}
