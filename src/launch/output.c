/* Workers' output: lines read from their pipes go to the console (unless
 * redirected or filtered out) and to their log files, and the last lines are
 * kept for the failure summary; plus the parsers of --redirects, --tee and
 * --local-ranks-filter, which decide where each stream goes. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

ddp_status ddp__tail_init(ddp__tail *tail, int32_t cap) {
  memset(tail, 0, sizeof *tail);
  if (cap <= 0) return DDP_OK;
  tail->lines = ddp_calloc((size_t)cap, sizeof *tail->lines);
  if (!tail->lines) return ddp_error(DDP_ERR_NOMEM, "launch: out of memory for output tails");
  tail->cap = cap;
  return DDP_OK;
}

void ddp__tail_free(ddp__tail *tail) {
  if (!tail) return;
  for (int32_t i = 0; i < tail->cap; i++) ddp_free(tail->lines[i]);
  ddp_free(tail->lines);
  memset(tail, 0, sizeof *tail);
}

static void tail_push(ddp__tail *tail, const char *line, size_t len) {
  tail->total++;
  if (tail->cap == 0) return;
  char *copy = ddp_alloc(len + 1);
  if (!copy) return; /* the tail is a courtesy: losing a line is not an error */
  memcpy(copy, line, len);
  copy[len] = '\0';
  ddp_free(tail->lines[tail->next]);
  tail->lines[tail->next] = copy;
  tail->next = (tail->next + 1) % tail->cap;
}

/* Writes all of buf, retrying short writes; a console that went away (EPIPE)
 * must not stop the supervisor, so errors are dropped. */
static void write_all(int fd, const char *buf, size_t len) {
  while (len > 0) {
    ssize_t w = write(fd, buf, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    buf += w;
    len -= (size_t)w;
  }
}

static void emit_line(ddp__stream *s, ddp__tail *tail, const char *line, size_t len, int newline) {
  if (s->console_fd >= 0) {
    write_all(s->console_fd, line, len);
    if (newline) write_all(s->console_fd, "\n", 1);
  }
  if (s->log_fd >= 0) {
    write_all(s->log_fd, line, len);
    if (newline) write_all(s->log_fd, "\n", 1);
  }
  tail_push(tail, line, len);
}

static void feed(ddp__stream *s, ddp__tail *tail, const char *data, size_t len) {
  while (len > 0) {
    const char *nl = memchr(data, '\n', len);
    size_t take = nl ? (size_t)(nl - data) : len;
    size_t room = sizeof s->partial - s->partial_len;
    if (!nl && take < room) { /* keep the incomplete line for the next read */
      memcpy(s->partial + s->partial_len, data, take);
      s->partial_len += take;
      return;
    }
    if (s->partial_len > 0) {
      /* Join the kept start with this piece; a line longer than the buffer
       * is emitted in buffer-sized pieces. */
      size_t part = take < room ? take : room;
      memcpy(s->partial + s->partial_len, data, part);
      int complete = nl && part == take;
      emit_line(s, tail, s->partial, s->partial_len + part, complete);
      s->partial_len = 0;
      data += part;
      len -= part;
      if (complete) {
        data++;
        len--;
      }
      continue;
    }
    emit_line(s, tail, data, take, nl != NULL);
    data += take;
    len -= take;
    if (nl) {
      data++;
      len--;
    }
  }
}

void ddp__stream_pump(ddp__stream *s, ddp__tail *tail) {
  char buf[16384];
  while (s->fd >= 0) {
    ssize_t got = read(s->fd, buf, sizeof buf);
    if (got > 0) {
      feed(s, tail, buf, (size_t)got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close(s->fd); /* end of file, or an error that will not go away */
    s->fd = -1;
  }
}

void ddp__stream_finish(ddp__stream *s, ddp__tail *tail) {
  ddp__stream_pump(s, tail);
  if (s->partial_len > 0) {
    emit_line(s, tail, s->partial, s->partial_len, 1);
    s->partial_len = 0;
  }
  if (s->fd >= 0) close(s->fd);
  if (s->log_fd >= 0) close(s->log_fd);
  s->fd = s->log_fd = -1;
}

/* ---- Option values ---------------------------------------------------------- */

static ddp_status parse_level(const char *option, const char *spec, const char *text, int *out) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || (*end && *end != ',') || v < 0 || v > 3)
    return ddp_error(DDP_ERR_INVALID,
                     "%s %s: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or "
                     "LOCAL_RANK:N pairs such as 0:1,1:2",
                     option, spec);
  *out = (int)v;
  return DDP_OK;
}

ddp_status ddp__std_spec_for(const char *option, const char *spec, int32_t local_rank, int *out) {
  *out = 0;
  if (!spec || !*spec) return DDP_OK;
  if (!strchr(spec, ':')) return parse_level(option, spec, spec, out);
  const char *p = spec;
  while (*p) {
    char *end;
    errno = 0;
    long r = strtol(p, &end, 10);
    if (errno || end == p || *end != ':' || r < 0)
      return ddp_error(DDP_ERR_INVALID, "%s %s: expected LOCAL_RANK:N pairs such as 0:1,1:2 (at offset %d)",
                       option, spec, (int)(p - spec));
    int level;
    DDP_TRY(parse_level(option, spec, end + 1, &level));
    if (r == local_rank) *out = level;
    p = strchr(end + 1, ',');
    if (!p) break;
    p++;
  }
  return DDP_OK;
}

ddp_status ddp__filter_allows(const char *spec, int32_t local_rank, int *out) {
  *out = 1;
  if (!spec || !*spec) return DDP_OK;
  *out = 0;
  const char *p = spec;
  for (;;) {
    char *end;
    errno = 0;
    long r = strtol(p, &end, 10);
    if (errno || end == p || r < 0 || (*end && *end != ','))
      return ddp_error(DDP_ERR_INVALID,
                       "--local-ranks-filter %s: expected local ranks separated by commas, such as 0,2 (at offset %d)",
                       spec, (int)(p - spec));
    if (r == local_rank) *out = 1;
    if (!*end) return DDP_OK;
    p = end + 1;
  }
}
