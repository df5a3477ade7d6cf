/* The tcp backend's engine: frames on the pairs (tcp.h has the format),
 * running several transfers at once on non-blocking sockets with one poll
 * over every peer (so a peer that dies is noticed whatever the op waits
 * for), failure detection and blame, BYE, point-to-point and the unexpected
 * queue. */
#include "comm/tcp/tcp.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* Sends BYE (with the cause, after a failure) unless sent already or a frame
 * is half out (it would cut into it). 16 bytes go whole or not at all. */
static void send_bye(ddp__tcp_backend *b, ddp__tcp_pair *p) {
  if (p->fd < 0 || p->bye_sent || p->send_open) return;
  uint32_t cause = b->failed && b->failed_peer >= 0 ? (uint32_t)b->failed_peer + 1 : 0;
  if (cause && b->failed_left) cause |= 1u << 31;
  ddp__tcp_header bye = {DDP__TCP_MAGIC | DDP__TCP_BYE, cause, p->session};
  if (send(p->fd, &bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof bye)
    p->bye_sent = true;
}

void ddp__tcp_close_pairs(ddp__tcp_backend *b) {
  for (int r = 0; r < b->size; r++) {
    ddp__tcp_pair *p = &b->pairs[r];
    if (p->fd < 0) continue;
    /* Best effort: a full socket (a peer that stopped reading) loses it. */
    send_bye(b, p);
    shutdown(p->fd, SHUT_WR);
    /* Unread bytes at close turn the FIN into a reset; read them first. */
    unsigned char sink[4096];
    while (recv(p->fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    close(p->fd);
    p->fd = -1;
  }
}

/* ---- Failures -------------------------------------------------------------- */

static const char *peer_desc(const ddp__tcp_backend *b, int peer, char *buf, size_t cap) {
  const ddp__tcp_pair *p = &b->pairs[peer];
  if (p->host && *p->host && !strstr(p->addr, p->host))
    snprintf(buf, cap, "rank %d (%s, %s)", peer, p->host, p->addr);
  else
    snprintf(buf, cap, "rank %d (%s)", peer, p->addr);
  return buf;
}

/* Records the backend's sticky failure and returns it. */
static ddp_status fail(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp_status st,
                       const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static ddp_status fail(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp_status st,
                       const char *fmt, ...) {
  char detail[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  snprintf(b->failed_msg, sizeof b->failed_msg, "%s #%" PRIu64 ": %s", ctx->op ? ctx->op : "op",
           ctx->seq, detail);
  b->failed = st;
  b->failed_peer = -1;
  b->failed_left = false;
  return ddp_error(st, "%s", b->failed_msg);
}

static ddp_status peer_died(ddp__tcp_backend *b, const ddp__op_ctx *ctx, int peer,
                            const char *why) {
  char d[160];
  fail(b, ctx, DDP_ERR_PEER, "%s died (%s)", peer_desc(b, peer, d, sizeof d), why);
  b->failed_peer = peer;
  return b->failed;
}

/* p left with a BYE that blames another rank: that rank is the failure. */
static ddp_status peer_reported(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p) {
  char d[160], d2[160];
  fail(b, ctx, DDP_ERR_PEER, "%s %s (reported by %s)",
       peer_desc(b, p->left_cause, d, sizeof d),
       p->cause_left ? "left the group (destroyed it) before this operation finished" : "died",
       peer_desc(b, p->rank, d2, sizeof d2));
  b->failed_peer = p->left_cause;
  b->failed_left = p->cause_left; /* a rank that left may be hiding one that died */
  return b->failed;
}

static void parse_bye_cause(ddp__tcp_pair *p, uint32_t tag) {
  p->left_cause = (int)(tag & 0x7fffffffu) - 1;
  p->cause_left = (tag >> 31) != 0;
}

static bool blames_other(const ddp__tcp_backend *b, const ddp__tcp_pair *p) {
  return p->left_cause >= 0 && p->left_cause < b->size && p->left_cause != b->rank;
}

/* The pair saw its peer's end close while frames are still unread: a clean
 * exit (the stream ends with BYE) or a crash. Peeks at every unread byte. */
static bool stream_ends_with_bye(ddp__tcp_pair *p) {
  int unread = 0;
  if (ioctl(p->fd, FIONREAD, &unread) != 0 || unread < (int)sizeof(ddp__tcp_header)) return false;
  unsigned char *tmp = ddp_alloc((size_t)unread);
  if (!tmp) return false;
  p->left_cause = -1;
  ssize_t n = recv(p->fd, tmp, (size_t)unread, MSG_PEEK | MSG_DONTWAIT);
  bool bye = false;
  if (n >= (ssize_t)sizeof(ddp__tcp_header)) {
    ddp__tcp_header h;
    memcpy(&h, tmp + n - sizeof h, sizeof h);
    bye = h.magic_kind == (DDP__TCP_MAGIC | DDP__TCP_BYE) && h.bytes == p->session;
    if (bye) parse_bye_cause(p, h.tag);
  }
  ddp_free(tmp);
  return bye;
}

/* ---- Reading frames -------------------------------------------------------- */


/* recv() into buf; >0 bytes, IO_BLOCKED, or IO_ERROR with the failure
 * recorded (EOF and resets name the peer). */
static ssize_t pair_recv(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p, void *buf,
                         size_t cap, bool mid_frame) {
  for (;;) {
    ssize_t n = recv(p->fd, buf, cap, MSG_DONTWAIT);
    if (n > 0) {
      atomic_store_explicit(&b->bytes_received,
                            atomic_load_explicit(&b->bytes_received, memory_order_relaxed) + (uint64_t)n,
                            memory_order_relaxed);
      return n;
    }
    if (n == 0) {
      peer_died(b, ctx, p->rank,
                mid_frame ? "connection closed in the middle of a message" : "connection closed");
      return IO_ERROR;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return IO_BLOCKED;
    char why[96];
    snprintf(why, sizeof why, "connection %s",
             errno == ECONNRESET  ? "reset"
             : errno == ETIMEDOUT ? "timed out: its host stopped answering"
                                  : strerror(errno));
    peer_died(b, ctx, p->rank, why);
    return IO_ERROR;
  }
}

/* Reads until a header is complete (p->have_hdr). BYE ends the stream: the
 * peer left cleanly (p->peer_left) and nothing more will come. */
int ddp__tcp_read_header(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p) {
  if (p->have_hdr) return IO_READY;
  if (p->peer_left) return IO_BLOCKED;
  while (p->hdr_got < sizeof p->hdr_buf) {
    ssize_t n = pair_recv(b, ctx, p, p->hdr_buf + p->hdr_got, sizeof p->hdr_buf - p->hdr_got,
                          p->hdr_got > 0);
    if (n <= 0) return (int)n;
    p->hdr_got += (size_t)n;
  }
  p->hdr_got = 0;
  memcpy(&p->hdr, p->hdr_buf, sizeof p->hdr);
  uint32_t kind = p->hdr.magic_kind & 0xffu;
  if ((p->hdr.magic_kind & ~0xffu) != DDP__TCP_MAGIC || kind < DDP__TCP_COLL ||
      kind > DDP__TCP_BYE) {
    char d[160];
    fail(b, ctx, DDP_ERR_FORMAT, "%s sent a malformed frame (header %08x)",
         peer_desc(b, p->rank, d, sizeof d), p->hdr.magic_kind);
    return IO_ERROR;
  }
  if (kind == DDP__TCP_BYE) {
    p->peer_left = true;
    parse_bye_cause(p, p->hdr.tag);
    return IO_BLOCKED;
  }
  p->have_hdr = true;
  return IO_READY;
}

/* Moves P2P frames into the unexpected queue until a COLL header is pending,
 * the socket is empty, or (stop_tag >= 0) a P2P header with that tag is
 * pending and no queued message has it (the caller reads it in place). */
static int service(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p,
                   int64_t stop_tag) {
  for (;;) {
    if (p->draining) {
      ddp__tcp_msg *m = p->draining;
      while (p->drain_got < m->bytes) {
        ssize_t n = pair_recv(b, ctx, p, m->data + p->drain_got, m->bytes - p->drain_got, true);
        if (n <= 0) return (int)n;
        p->drain_got += (size_t)n;
      }
      if (p->unexp_tail)
        p->unexp_tail->next = m;
      else
        p->unexp_head = m;
      p->unexp_tail = m;
      p->draining = NULL;
    }
    int r = ddp__tcp_read_header(b, ctx, p);
    if (r != IO_READY) return r;
    if ((p->hdr.magic_kind & 0xffu) != DDP__TCP_P2P) return IO_READY; /* COLL waits */
    if (stop_tag >= 0 && p->hdr.tag == (uint32_t)stop_tag) {
      bool queued = false;
      for (ddp__tcp_msg *m = p->unexp_head; m && !queued; m = m->next)
        queued = m->tag == (uint32_t)stop_tag;
      if (!queued) return IO_READY;
    }
    if (p->hdr.bytes > (uint64_t)1 << 40) {
      char d[160];
      fail(b, ctx, DDP_ERR_FORMAT, "%s announced a message of %" PRIu64 " bytes",
           peer_desc(b, p->rank, d, sizeof d), p->hdr.bytes);
      return IO_ERROR;
    }
    ddp__tcp_msg *m = ddp_calloc(1, sizeof *m);
    if (m && p->hdr.bytes) m->data = ddp_alloc(p->hdr.bytes);
    if (!m || (p->hdr.bytes && !m->data)) {
      ddp_free(m);
      fail(b, ctx, DDP_ERR_NOMEM, "no memory for a %" PRIu64 "-byte message from rank %d",
           p->hdr.bytes, p->rank);
      return IO_ERROR;
    }
    m->tag = p->hdr.tag;
    m->bytes = p->hdr.bytes;
    p->have_hdr = false;
    p->draining = m;
    p->drain_got = 0;
  }
}

/* ---- Transfers ------------------------------------------------------------- */

void ddp__tcp_post_send(ddp__tcp_xfer *x, int peer, const void *src, size_t bytes) {
  memset(x, 0, sizeof *x);
  x->peer = peer;
  x->is_send = true;
  x->kind = DDP__TCP_COLL;
  x->src = src;
  x->bytes = bytes;
  x->after = -1;
}

void ddp__tcp_post_recv(ddp__tcp_xfer *x, int peer, void *dst, size_t bytes) {
  memset(x, 0, sizeof *x);
  x->peer = peer;
  x->kind = DDP__TCP_COLL;
  x->dst = dst;
  x->bytes = bytes;
  x->after = -1;
}

void ddp__tcp_post_recv_reduce(ddp__tcp_xfer *x, int peer, void *dst, size_t bytes,
                               ddp_dtype dtype, ddp_reduce_op op) {
  ddp__tcp_post_recv(x, peer, dst, bytes);
  x->reduce = true;
  x->dtype = dtype;
  x->op = op;
}

static ddp_status left_during_op(ddp__tcp_backend *b, const ddp__op_ctx *ctx, int peer) {
  ddp__tcp_pair *p = &b->pairs[peer];
  if (blames_other(b, p)) return peer_reported(b, ctx, p);
  char d[160];
  fail(b, ctx, DDP_ERR_PEER, "%s left the group (destroyed it) before this operation finished",
       peer_desc(b, peer, d, sizeof d));
  b->failed_left = true;
  b->failed_peer = peer;
  return b->failed;
}

int ddp__tcp_progress_send(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x) {
  ddp__tcp_pair *p = &b->pairs[x->peer];
  if (!x->started) {
    ddp__tcp_header h = {DDP__TCP_MAGIC | x->kind, x->tag, x->bytes};
    memcpy(x->hdr, &h, sizeof h);
    x->started = true;
    p->send_open = true;
  }
  while (x->hdr_sent < sizeof x->hdr || x->done < x->bytes) {
    struct iovec iov[2];
    int n_iov = 0;
    if (x->hdr_sent < sizeof x->hdr)
      iov[n_iov++] = (struct iovec){x->hdr + x->hdr_sent, sizeof x->hdr - x->hdr_sent};
    if (x->done < x->bytes)
      iov[n_iov++] = (struct iovec){(char *)x->src + x->done, x->bytes - x->done};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n_iov};
    ssize_t n = sendmsg(p->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return IO_BLOCKED;
      int err = errno;
      /* Read what the peer left: a BYE means it exited cleanly. */
      service(b, ctx, p, -1);
      if (p->peer_left) return left_during_op(b, ctx, x->peer), IO_ERROR;
      char why[96];
      snprintf(why, sizeof why, "connection %s",
               err == EPIPE ? "closed" : err == ECONNRESET ? "reset" : strerror(err));
      peer_died(b, ctx, x->peer, why);
      return IO_ERROR;
    }
    size_t sent = (size_t)n;
    atomic_store_explicit(&b->bytes_sent,
                          atomic_load_explicit(&b->bytes_sent, memory_order_relaxed) + (uint64_t)n,
                          memory_order_relaxed);
    size_t h = sizeof x->hdr - x->hdr_sent;
    if (sent < h) {
      x->hdr_sent += sent;
      continue;
    }
    x->hdr_sent = sizeof x->hdr;
    x->done += sent - h;
  }
  x->finished = true;
  p->send_open = false;
  return IO_READY;
}

/* Reduces the whole elements among the `held` bytes at the start of the
 * piece buffer into dst; keeps a partial element in x->tail. */
static void reduce_arrived(ddp__tcp_backend *b, ddp__tcp_xfer *x, size_t held) {
  size_t esize = ddp_dtype_size(x->dtype);
  size_t whole = held / esize * esize;
  if (whole)
    ddp__reduce_into((char *)x->dst + x->reduced, b->piece, whole / esize, x->dtype, x->op);
  memcpy(x->tail, b->piece + whole, held - whole);
  x->reduced += whole;
}

/* Takes the oldest queued P2P message with x's tag, if any. */
static int take_queued(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x) {
  ddp__tcp_pair *p = &b->pairs[x->peer];
  ddp__tcp_msg *prev = NULL;
  for (ddp__tcp_msg *m = p->unexp_head; m; prev = m, m = m->next) {
    if (m->tag != x->tag) continue;
    if (m->bytes != x->bytes) {
      char d[160];
      fail(b, ctx, DDP_ERR_INVALID, "%s sent %zu bytes with tag %u, recv expects %zu",
           peer_desc(b, x->peer, d, sizeof d), m->bytes, x->tag, x->bytes);
      return IO_ERROR;
    }
    if (m->bytes) memcpy(x->dst, m->data, m->bytes);
    if (prev)
      prev->next = m->next;
    else
      p->unexp_head = m->next;
    if (p->unexp_tail == m) p->unexp_tail = prev;
    ddp_free(m->data);
    ddp_free(m);
    x->finished = true;
    return IO_READY;
  }
  return IO_BLOCKED;
}

int ddp__tcp_progress_recv(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x) {
  ddp__tcp_pair *p = &b->pairs[x->peer];
  if (!x->started) {
    bool p2p = x->kind == DDP__TCP_P2P;
    /* An earlier message with this tag may be queued already. */
    if (p2p && take_queued(b, ctx, x) != IO_BLOCKED) return x->finished ? IO_READY : IO_ERROR;
    int r = service(b, ctx, p, p2p ? (int64_t)x->tag : -1);
    if (r == IO_ERROR) return r;
    /* service may have queued it (with other messages, up to a BYE). */
    if (p2p && take_queued(b, ctx, x) != IO_BLOCKED) return x->finished ? IO_READY : IO_ERROR;
    if (r == IO_BLOCKED) {
      if (p->peer_left) return left_during_op(b, ctx, x->peer), IO_ERROR;
      return IO_BLOCKED;
    }
    uint32_t kind = p->hdr.magic_kind & 0xffu;
    if (kind != x->kind) return IO_BLOCKED; /* a collective's frame while we wait for p2p */
    if (p->hdr.bytes != x->bytes) {
      char d[160];
      fail(b, ctx, DDP_ERR_INVALID,
           "%s sent %" PRIu64 " bytes where this rank expects %zu (do the ranks call the same "
           "operations with the same counts?)",
           peer_desc(b, x->peer, d, sizeof d), p->hdr.bytes, x->bytes);
      return IO_ERROR;
    }
    p->have_hdr = false;
    x->started = true;
  }
  while (x->done < x->bytes) {
    ssize_t n;
    if (x->reduce) {
      /* Through the piece buffer (shared by every transfer: nothing stays
       * in it between calls but a partial element, kept in x->tail). */
      size_t held = x->done - x->reduced;
      memcpy(b->piece, x->tail, held);
      size_t room = b->piece_bytes - held;
      if (room > x->bytes - x->done) room = x->bytes - x->done;
      n = pair_recv(b, ctx, p, b->piece + held, room, true);
      if (n <= 0) {
        memcpy(x->tail, b->piece, held);
        return (int)n;
      }
      x->done += (size_t)n;
      reduce_arrived(b, x, held + (size_t)n);
    } else {
      n = pair_recv(b, ctx, p, (char *)x->dst + x->done, x->bytes - x->done, true);
      if (n <= 0) return (int)n;
      x->done += (size_t)n;
    }
  }
  x->finished = true;
  return IO_READY;
}

/* ---- The engine ------------------------------------------------------------ */

static bool is_aborted(ddp__tcp_backend *b, const ddp__op_ctx *ctx) {
  return atomic_load(&b->aborted) || (ctx->aborted && atomic_load(ctx->aborted));
}

/* A closed peer we are not reading from: fails unless it left cleanly. */
static ddp_status check_idle_pair(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p,
                                  short revents) {
  int r = service(b, ctx, p, -1);
  if (r == IO_ERROR) return b->failed;
  if (p->peer_left) return blames_other(b, p) ? peer_reported(b, ctx, p) : DDP_OK;
  if (!(revents & (POLLRDHUP | POLLHUP | POLLERR))) return DDP_OK;
  if (p->have_hdr || p->draining) {
    /* Frames for later are still unread; the stream's end tells. */
    if (!stream_ends_with_bye(p)) return peer_died(b, ctx, p->rank, "connection closed");
    if (blames_other(b, p)) return peer_reported(b, ctx, p);
  }
  return DDP_OK;
}

/* A peer that left cleanly (it failed and destroyed its group) is usually a
 * consequence: when another peer's connection dropped without BYE, that one
 * is the cause, and the failure names it instead. */
static ddp_status blame_the_dead(ddp__tcp_backend *b, const ddp__op_ctx *ctx) {
  if (!b->failed_left) return b->failed;
  char saved[sizeof b->failed_msg];
  memcpy(saved, b->failed_msg, sizeof saved);
  int saved_peer = b->failed_peer;
  for (int r = 0; r < b->size; r++) {
    ddp__tcp_pair *p = &b->pairs[r];
    if (r == b->rank || r == saved_peer) continue;
    struct pollfd pf = {.fd = p->fd, .events = POLLRDHUP | POLLIN};
    if (p->fd < 0 || poll(&pf, 1, 0) != 1) continue;
    b->failed = DDP_OK;
    if (check_idle_pair(b, ctx, p, pf.revents) != DDP_OK && !b->failed_left) return b->failed;
  }
  memcpy(b->failed_msg, saved, sizeof saved);
  b->failed = DDP_ERR_PEER;
  b->failed_peer = saved_peer;
  b->failed_left = true;
  return ddp_error(b->failed, "%s", b->failed_msg);
}

static ddp_status run(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x, int n);

ddp_status ddp__tcp_run(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x, int n) {
  if (b->failed) return ddp_error(b->failed, "%s", b->failed_msg);
  for (int i = 0; i < n; i++) {
    /* Collectives over a view post member indices; the engine works on
     * group ranks. */
    if (b->view && !x[i].mapped) x[i].peer = b->view[x[i].peer];
    x[i].mapped = true;
    if (b->pairs[x[i].peer].fd < 0)
      return ddp_error(DDP_ERR_STATE, "%s #%llu: tcp backend: no connection to rank %d (it is on this host)",
                       ctx->op ? ctx->op : "op", (unsigned long long)ctx->seq, x[i].peer);
  }
  ddp_status st = run(b, ctx, x, n);
  if (st != DDP_OK) {
    /* Tell every peer now, naming the cause: ranks waiting on this one, or
     * on one that waits on it, fail at once instead of at their deadline. */
    for (int r = 0; r < b->size; r++)
      if (r != b->rank) send_bye(b, &b->pairs[r]);
  }
  return st;
}

/* One pass over the transfers: each that is first in its (peer, direction)
 * and whose data is there moves as far as its socket lets it. Fills
 * act_send / act_recv (per peer: the index of that first transfer, -1 for
 * none), *pending (transfers not finished) and *moved (one finished, so the
 * next on its (peer, direction) may start: another pass is due). */
static ddp_status engine_pass(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x, int n,
                              int *act_send, int *act_recv, int *pending, bool *moved) {
  *pending = 0;
  *moved = false;
  for (int i = 0; i < n; i++) {
    if (x[i].finished) continue;
    int *act = x[i].is_send ? &act_send[x[i].peer] : &act_recv[x[i].peer];
    ++*pending;
    if (*act >= 0) continue;
    *act = i;
    if (x[i].after >= 0 && !x[x[i].after].finished) continue; /* its data is not there yet */
    int r = x[i].is_send ? ddp__tcp_progress_send(b, ctx, &x[i]) : ddp__tcp_progress_recv(b, ctx, &x[i]);
    if (r == IO_ERROR) return blame_the_dead(b, ctx);
    if (x[i].finished) {
      *moved = true;
      --*pending;
    }
  }
  return DDP_OK;
}

static ddp_status run(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x, int n) {
  int size = b->size;
  int *act_send = NULL, *act_recv = NULL;
  /* Peers whose closed stream ended with BYE but still hold unread frames:
   * not watched for hang-ups again during this run (they would fire forever). */
  for (;;) {
    /* Progress every transfer that is first in its (peer, direction), again
     * while one finishes. */
    int pending;
    bool moved = true;
    while (moved) {
      ddp__tcp_active_reset(b, &act_send, &act_recv);
      DDP_TRY(engine_pass(b, ctx, x, n, act_send, act_recv, &pending, &moved));
    }
    if (pending == 0) return DDP_OK;
    if (is_aborted(b, ctx))
      return fail(b, ctx, DDP_ERR_ABORTED, "aborted");
    int64_t now = ddp_time_ns();
    if (now >= ctx->deadline_ns) {
      int waiting = -1;
      for (int i = 0; i < n && waiting < 0; i++)
        if (!x[i].finished) waiting = x[i].peer;
      char d[160];
      return fail(b, ctx, DDP_ERR_TIMEOUT, "timed out waiting for %s",
                  peer_desc(b, waiting, d, sizeof d));
    }
    /* Poll every peer: those we move data with for data, the others for
     * hang-ups (and P2P messages, drained eagerly), plus the abort eventfd. */
    int nfds = 0;
    for (int r = 0; r < size; r++) {
      if (r == b->rank || b->pairs[r].fd < 0) continue; /* pairs on this host: not connected */
      ddp__tcp_pair *p = &b->pairs[r];
      short ev = 0;
      /* (A pending header of another kind waits for a later op: no POLLIN.) */
      if (act_recv[r] >= 0) ev |= POLLRDHUP | (p->have_hdr ? 0 : POLLIN);
      int s = act_send[r];
      if (s >= 0 && (x[s].after < 0 || x[x[s].after].finished)) ev |= POLLOUT;
      if (!p->peer_left && !p->bye_seen) ev |= POLLRDHUP | (p->have_hdr ? 0 : POLLIN);
      if (!ev) continue;
      b->pfds[nfds] = (struct pollfd){.fd = p->fd, .events = ev};
      b->pfd_owner[nfds++] = r;
    }
    b->pfds[nfds] = (struct pollfd){.fd = b->wake_fd, .events = POLLIN};
    b->pfd_owner[nfds++] = -1;
    int64_t left_ns = ctx->deadline_ns - now;
    /* At most 1 s: ctx->aborted is re-checked now and then. */
    int wait_ms = left_ns >= 1000000000 ? 1000 : (int)((left_ns + 999999) / 1000000);
    int rc = poll(b->pfds, (nfds_t)nfds, wait_ms);
    if (rc < 0 && errno != EINTR)
      return fail(b, ctx, DDP_ERR_SYS, "poll: %s", strerror(errno));
    for (int i = 0; rc > 0 && i < nfds; i++) {
      int r = b->pfd_owner[i];
      short re = b->pfds[i].revents;
      if (r < 0 || !re || act_recv[r] >= 0) continue; /* active receives see it themselves */
      ddp__tcp_pair *p = &b->pairs[r];
      if (check_idle_pair(b, ctx, p, re) != DDP_OK) return b->failed;
      if ((re & (POLLRDHUP | POLLHUP | POLLERR)) && !p->peer_left) p->bye_seen = true;
    }
  }
}

/* ---- Point to point -------------------------------------------------------- */

ddp_status ddp__tcp_send_p2p(ddp__tcp_backend *b, const ddp__op_ctx *ctx, const void *buf,
                             size_t bytes, int dst) {
  ddp__tcp_xfer *x = &b->xfers[0];
  ddp__tcp_post_send(x, dst, buf, bytes);
  x->kind = DDP__TCP_P2P;
  x->tag = (uint32_t)ctx->tag;
  return ddp__tcp_run(b, ctx, x, 1);
}

ddp_status ddp__tcp_recv_p2p(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf,
                             size_t bytes, int src) {
  ddp__tcp_xfer *x = &b->xfers[0];
  ddp__tcp_post_recv(x, src, buf, bytes);
  x->kind = DDP__TCP_P2P;
  x->tag = (uint32_t)ctx->tag;
  return ddp__tcp_run(b, ctx, x, 1);
}

ddp__tcp_xfer *ddp__tcp_xfers(ddp__tcp_backend *b, int n) {
  if (n <= b->xfer_cap) return b->xfers;
  ddp__tcp_xfer *x = ddp_calloc((size_t)n, sizeof *x);
  if (!x) {
    ddp_error(DDP_ERR_NOMEM, "tcp backend: no memory for %d transfers", n);
    return NULL;
  }
  ddp_free(b->xfers);
  b->xfers = x;
  b->xfer_cap = n;
  return x;
}

void *ddp__tcp_scratch(ddp__tcp_backend *b, size_t bytes) {
  if (bytes <= b->scratch_bytes) return b->scratch;
  ddp_free(b->scratch);
  b->scratch_bytes = 0;
  b->scratch = ddp_alloc(bytes);
  if (!b->scratch) {
    ddp_error(DDP_ERR_NOMEM, "tcp backend: no memory for a %zu-byte scratch buffer", bytes);
    return NULL;
  }
  b->scratch_bytes = bytes;
  return b->scratch;
}

/* ---- The hierarchical backend's hooks -------------------------------------- */

void ddp__tcp_view_set(ddp__tcp_backend *b, int n, const int *view) {
  b->view = view;
  b->vsize = n;
  b->vrank = -1;
  for (int i = 0; i < n; i++)
    if (view[i] == b->rank) b->vrank = i;
  DDP_ASSERT(b->vrank >= 0);
}

void ddp__tcp_view_clear(ddp__tcp_backend *b) {
  b->view = NULL;
  b->vsize = b->size;
  b->vrank = b->rank;
}

void ddp__tcp_fail_external(ddp__tcp_backend *b, ddp_status st, int blame) {
  if (b->failed) return;
  snprintf(b->failed_msg, sizeof b->failed_msg, "%s", ddp_last_error());
  b->failed = st;
  b->failed_peer = blame >= 0 && blame < b->size ? blame : -1;
  b->failed_left = false;
  for (int r = 0; r < b->size; r++)
    if (r != b->rank) send_bye(b, &b->pairs[r]);
}
