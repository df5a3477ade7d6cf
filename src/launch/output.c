/* Workers' output: lines read from their pipes go to the console (unless
 * redirected or filtered out) and to their log files, and the last lines are
 * kept for the failure summary; plus the parsers of --redirects, --tee and
 * --local-ranks-filter, which decide where each stream goes. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core_internal.h"
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

/* Writes all of buf, retrying short writes (log files, and consoles that are
 * regular files); errors are dropped: a full disk must not stop the
 * supervisor. */

/* ---- The console -------------------------------------------------------------- */

enum { CONSOLE_PLAIN = 0, CONSOLE_NONBLOCK = 1, CONSOLE_SOCKET = 2, CONSOLE_POLL = 3 };

void ddp__console_open(ddp__console *c, int fd) {
  memset(c, 0, sizeof *c);
  c->fd = -1;
  struct stat st;
  if (fstat(fd, &st) != 0) return; /* no such fd: nothing is shown */
  c->fd = fd;
  if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode)) {
    c->kind = CONSOLE_PLAIN;
  } else if (S_ISSOCK(st.st_mode)) {
    c->kind = CONSOLE_SOCKET;
  } else {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int nb = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY | O_APPEND);
    if (nb >= 0) {
      c->fd = nb;
      c->owned = 1;
      c->kind = CONSOLE_NONBLOCK;
    } else {
      int fl = fcntl(fd, F_GETFL);
      c->kind = fl >= 0 && (fl & O_NONBLOCK) ? CONSOLE_NONBLOCK : CONSOLE_POLL;
    }
  }
}

void ddp__console_close(ddp__console *c) {
  if (c->owned && c->fd >= 0) close(c->fd);
  c->fd = -1;
  c->owned = 0;
  c->busy = NULL;
}

/* Bytes the console took now (0: it would block), or -1: it is gone. */
static ssize_t console_write(ddp__console *c, const char *buf, size_t len) {
  if (c->fd < 0) return -1;
  for (;;) {
    ssize_t w;
    switch (c->kind) {
      case CONSOLE_PLAIN:
        (void)ddp__write_all(c->fd, buf, len); /* what cannot be written is dropped */
        return (ssize_t)len;
      case CONSOLE_SOCKET:
        w = send(c->fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        break;
      case CONSOLE_POLL: {
        struct pollfd p = {.fd = c->fd, .events = POLLOUT};
        if (poll(&p, 1, 0) <= 0 || !(p.revents & POLLOUT)) return (p.revents & (POLLERR | POLLHUP)) ? -1 : 0;
        w = write(c->fd, buf, len < PIPE_BUF ? len : PIPE_BUF);
        break;
      }
      default:
        w = write(c->fd, buf, len);
        break;
    }
    if (w >= 0) return w;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    /* EPIPE (the reader went away), EIO (the terminal hung up): the job goes
     * on without a console. */
    ddp__console_close(c);
    return -1;
  }
}

/* Drops the oldest whole lines (never the one half written) until `need`
 * more bytes fit; returns 0 when they cannot. */
static int make_room(ddp__stream *s, size_t need) {
  while (s->pend_len + need > DDP__CONSOLE_BUFFER) {
    size_t start = 0;
    if (s->pend_sent > 0) {
      const char *nl = memchr(s->pend, '\n', s->pend_len);
      start = nl ? (size_t)(nl - s->pend) + 1 : s->pend_len;
    }
    if (start >= s->pend_len) return 0;
    const char *nl = memchr(s->pend + start, '\n', s->pend_len - start);
    size_t drop = nl ? (size_t)(nl - (s->pend + start)) + 1 : s->pend_len - start;
    memmove(s->pend + start, s->pend + start + drop, s->pend_len - start - drop);
    s->pend_len -= drop;
    s->dropped += drop;
  }
  return 1;
}

static void console_queue(ddp__stream *s, const char *line, size_t len, int newline) {
  if (!s->console || s->console->fd < 0) return;
  if (!s->pend && !(s->pend = ddp_alloc(DDP__CONSOLE_BUFFER))) {
    s->dropped += len + (size_t)newline; /* out of memory: the line is lost, and said so */
    return;
  }
  if (len + 1 > DDP__CONSOLE_BUFFER / 2 || !make_room(s, len + 1)) {
    s->dropped += len + (size_t)newline;
  } else {
    memcpy(s->pend + s->pend_len, line, len);
    s->pend_len += len;
    if (newline) s->pend[s->pend_len++] = '\n';
  }
  ddp__stream_flush(s);
}

/* Writes pend[pend_sent, limit); returns 1 when all of it went. */
static int write_pending(ddp__stream *s, size_t limit) {
  while (s->pend_sent < limit) {
    ssize_t w = console_write(s->console, s->pend + s->pend_sent, limit - s->pend_sent);
    if (w <= 0) return 0;
    s->pend_sent += (size_t)w;
  }
  return 1;
}

/* Removes the whole lines already written from the front of pend. */
static void compact(ddp__stream *s) {
  size_t cut = 0;
  for (size_t i = s->pend_sent; i > 0; i--)
    if (s->pend[i - 1] == '\n') {
      cut = i;
      break;
    }
  if (s->pend_sent == s->pend_len) cut = s->pend_len;
  memmove(s->pend, s->pend + cut, s->pend_len - cut);
  s->pend_len -= cut;
  s->pend_sent -= cut;
}

int ddp__stream_flush(ddp__stream *s) {
  ddp__console *c = s->console;
  int waiting = s->pend_len > 0 || s->dropped > 0 || s->notice_len > 0;
  if (!c || !waiting) return 0;
  if (c->fd < 0) { /* the console went away: nothing will be shown */
    s->pend_len = s->pend_sent = 0;
    s->dropped = 0;
    s->notice_len = s->notice_sent = 0;
    return 0;
  }
  if (c->busy && c->busy != s) return 1;
  int done = 0;
  /* 1. The rest of a line half written. */
  if (s->pend_sent > 0) {
    const char *nl = memchr(s->pend, '\n', s->pend_len);
    size_t end = nl ? (size_t)(nl - s->pend) + 1 : s->pend_len;
    if (!write_pending(s, end)) goto out;
    compact(s);
  }
  /* 2. The notice of what was dropped, where it was dropped. */
  if (s->notice_len == 0 && s->dropped > 0) {
    int n = snprintf(s->notice, sizeof s->notice,
                     "[ddprun: %llu bytes of rank %d's output dropped: the console is not reading]\n",
                     (unsigned long long)s->dropped, (int)s->rank);
    s->notice_len = n > 0 && (size_t)n < sizeof s->notice ? (size_t)n : 0;
    s->notice_sent = 0;
    s->dropped = 0;
  }
  while (s->notice_sent < s->notice_len) {
    ssize_t w = console_write(c, s->notice + s->notice_sent, s->notice_len - s->notice_sent);
    if (w <= 0) goto out;
    s->notice_sent += (size_t)w;
  }
  s->notice_len = s->notice_sent = 0;
  /* 3. Everything else. */
  write_pending(s, s->pend_len);
  compact(s);
  done = s->pend_len == 0 && s->dropped == 0;
out:
  if (c->fd >= 0) c->busy = s->pend_sent > 0 || s->notice_sent > 0 ? s : NULL;
  return !done;
}

void ddp__stream_discard(ddp__stream *s) {
  int half = s->pend_sent > 0 || s->notice_sent > 0; /* the console shows part of a line */
  if (s->pend_len > s->pend_sent) s->dropped += s->pend_len - s->pend_sent;
  s->pend_len = s->pend_sent = 0;
  s->notice_len = s->notice_sent = 0;
  ddp__console *c = s->console;
  if (c && c->busy == s) c->busy = NULL;
  if (c && c->fd >= 0 && s->dropped > 0 && !c->busy) {
    char note[192];
    int n = snprintf(note, sizeof note,
                     "%s[ddprun: %llu bytes of rank %d's output dropped: the console is not reading]\n",
                     half ? "\n" : "", (unsigned long long)s->dropped, (int)s->rank);
    if (n > 0 && (size_t)n < sizeof note) console_write(c, note, (size_t)n); /* one try */
  }
  s->dropped = 0;
  ddp_free(s->pend);
  s->pend = NULL;
}

void ddp__console_write_bounded(int fd, const char *buf, size_t len, double stall_s) {
  ddp__console c;
  ddp__console_open(&c, fd);
  double last = ddp_time_s();
  while (len > 0 && c.fd >= 0) {
    ssize_t w = console_write(&c, buf, len);
    if (w < 0) break;
    if (w > 0) {
      buf += w;
      len -= (size_t)w;
      last = ddp_time_s();
      continue;
    }
    if (ddp_time_s() - last > stall_s) break;
    struct pollfd p = {.fd = c.fd, .events = POLLOUT};
    poll(&p, 1, 20);
  }
  ddp__console_close(&c);
}

static void emit_line(ddp__stream *s, ddp__tail *tail, const char *line, size_t len, int newline) {
  console_queue(s, line, len, newline);
  if (s->log_fd >= 0) {
    (void)ddp__write_all(s->log_fd, line, len); /* a log that cannot be written: the job goes on */
    if (newline) (void)ddp__write_all(s->log_fd, "\n", 1);
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
  DDP_TRY(ddp__rank_set_check("--local-ranks-filter", spec)); /* "0,2", "0-3", "all" */
  *out = ddp__rank_set_contains(spec, local_rank);
  return DDP_OK;
}
