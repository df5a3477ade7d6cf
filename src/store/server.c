/* The TCP store server: one thread, one epoll loop (in the manner of Redis's
 * ae.c), every socket non-blocking. Each client has an input and an output
 * buffer; requests are parsed from the input buffer with protocol.c and
 * answered into the output buffer, which is written at once and, if the
 * socket is full, when epoll says it is writable. A blocking get / wait /
 * multi_get whose keys are missing becomes a waiter, linked from each missing
 * key's table entry; a write to the key re-evaluates it. Waiters time out
 * here, at the deadline the client sent (the client's own deadline is a
 * safety net). A client that sends anything malformed or over a limit gets
 * an error reply and is dropped; no client can stall the loop: nothing
 * blocks, and each one's buffers are bounded. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>

#include "net/net.h"
#include "store/protocol.h"
#include "store/store_impl.h"
#include "store/table.h"

#define READ_CHUNK (64 * 1024)
/* Stop reading a client's requests while this much output waits for it. */
#define OUT_HIGH_WATER (4u * 1024u * 1024u)
#define MAX_EVENTS 256

typedef struct client client;
typedef struct waiter waiter;

/* One waiter's link into a key's list. */
typedef struct wnode {
  struct wnode *prev, *next;
  waiter *w;
  ddp__kv_entry *entry; /* NULL when not linked */
} wnode;

/* A blocked get / wait / multi_get. Its keys are copied (the request's bytes
 * are gone once parsed). */
struct waiter {
  client *c;
  uint8_t op;
  int queued;           /* in the server's wake queue */
  uint32_t missing;     /* linked nodes: keys absent when last checked */
  uint64_t deletes_seen; /* the server's delete count when it was linked */
  int64_t deadline_ns;  /* -1: none */
  int64_t timeout_ms;
  uint32_t num_keys;
  ddp__slice *keys;     /* into key_bytes */
  wnode *nodes;         /* one per key */
  waiter *prev, *next;  /* the server's list of all waiters */
};

struct client {
  int fd;
  int authed;
  int dead;                 /* closed; freed at the end of the loop pass */
  int resume;               /* in the resume list */
  int backpressured;        /* stopped parsing while its output drains */
  uint32_t events;          /* epoll interest now */
  int64_t hello_deadline_ns;
  ddp__buf in, out;
  size_t out_sent;          /* bytes of `out` already written */
  waiter *waiter;
  client *prev, *next;      /* all clients */
  client *resume_next;
  char addr[DDP_NET_ADDR_BYTES];
};

struct ddp_store_server {
  int listen_fd;
  int epoll_fd;
  int wake_fd;              /* eventfd: shutdown */
  int spare_fd;             /* closed to accept-and-drop when out of fds */
  uint16_t port;
  char address[DDP_NET_ADDR_BYTES];
  char token[DDP_STORE_MAX_TOKEN_BYTES + 1];
  int has_token;
  ddp_store_limits limits;
  ddp_store_limits hello_limits; /* before the handshake: frames of a hello only */
  int64_t handshake_timeout_ms;
  ddp__kv_table table;
  client *clients;
  waiter *waiters;
  int64_t next_deadline_ns; /* earliest waiter / handshake deadline, -1 none */
  uint64_t deletes;         /* keys deleted so far (see waiter_recheck) */
  waiter **wake_queue;
  size_t wake_len, wake_cap;
  client *resume_list;
  client *dead_list;
  int stop;                 /* atomic */
  int running;
  pthread_t thread;
  int has_thread;
  ddp_store_server_stats stats; /* fields updated atomically */
};

#define STAT_ADD(s, field, v) __atomic_add_fetch(&(s)->stats.field, (v), __ATOMIC_RELAXED)
#define STAT_SET(s, field, v) __atomic_store_n(&(s)->stats.field, (v), __ATOMIC_RELAXED)

static void set_deadline(ddp_store_server *s, int64_t deadline_ns) {
  if (deadline_ns >= 0 && (s->next_deadline_ns < 0 || deadline_ns < s->next_deadline_ns))
    s->next_deadline_ns = deadline_ns;
}

/* ---- Clients ------------------------------------------------------------- */

static void update_events(ddp_store_server *s, client *c) {
  if (c->dead) return;
  uint32_t want = EPOLLRDHUP;
  size_t pending = c->out.len - c->out_sent;
  if (!c->waiter && pending < OUT_HIGH_WATER) want |= EPOLLIN;
  if (pending) want |= EPOLLOUT;
  if (want == c->events) return;
  struct epoll_event ev = {.events = want, .data.ptr = c};
  epoll_ctl(s->epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
  c->events = want;
}

static void waiter_unlink_all(ddp_store_server *s, waiter *w);
static void waiter_free(ddp_store_server *s, waiter *w);

/* Closes the client at once; its memory goes at the end of the loop pass
 * (events for it may still be in this pass's array). */
static void client_drop(ddp_store_server *s, client *c, int for_error) {
  if (c->dead) return;
  if (c->waiter) {
    waiter_unlink_all(s, c->waiter);
    waiter_free(s, c->waiter);
    c->waiter = NULL;
  }
  epoll_ctl(s->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = -1;
  c->dead = 1;
  if (c->prev) c->prev->next = c->next;
  else s->clients = c->next;
  if (c->next) c->next->prev = c->prev;
  c->next = s->dead_list;
  s->dead_list = c;
  STAT_ADD(s, clients, (uint64_t)-1);
  if (for_error) STAT_ADD(s, clients_dropped, 1);
}

static void free_dead(ddp_store_server *s) {
  while (s->dead_list) {
    client *c = s->dead_list;
    s->dead_list = c->next;
    ddp__buf_free(&c->in);
    ddp__buf_free(&c->out);
    ddp_free(c);
  }
}

/* Writes what the socket takes now. Returns -1 if the client was dropped. */
static int client_flush(ddp_store_server *s, client *c) {
  if (c->out.failed) {
    /* A reply could not be built (out of memory): the stream is broken. */
    ddp_log(DDP_LOG_WARN, "store server %s: out of memory replying to %s; dropping it",
            s->address, c->addr);
    client_drop(s, c, 1);
    return -1;
  }
  while (c->out_sent < c->out.len) {
    ssize_t n = send(c->fd, c->out.data + c->out_sent, c->out.len - c->out_sent,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c->out_sent += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    DDP_DEBUG("store server: client %s: send failed (%s); dropping it", c->addr,
              n < 0 ? strerror(errno) : "closed");
    client_drop(s, c, 1);
    return -1;
  }
  if (c->out_sent == c->out.len) {
    c->out.len = c->out_sent = 0;
    if (c->out.cap > (1u << 20)) ddp__buf_free(&c->out); /* after a big value */
  } else if (c->out_sent >= (1u << 20)) {
    /* Compact now and then, not on every partial write of a big reply. */
    ddp__buf_consume(&c->out, c->out_sent);
    c->out_sent = 0;
  }
  /* Output dropped below the high-water mark with requests still buffered. */
  if (c->backpressured && c->out.len - c->out_sent < OUT_HIGH_WATER && !c->resume) {
    c->backpressured = 0;
    c->resume = 1;
    c->resume_next = s->resume_list;
    s->resume_list = c;
  }
  update_events(s, c);
  return 0;
}

/* Sends an error reply and drops the client (its stream can no longer be
 * trusted). The reply is best effort: the client may already be gone. */
__attribute__((format(printf, 4, 5))) static void client_reject(ddp_store_server *s, client *c,
                                                                uint8_t status, const char *fmt,
                                                                ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  DDP_INFO("store server: client %s: %s; dropping it", c->addr, msg);
  ddp__store_encode_error(&c->out, status, "%s", msg);
  if (client_flush(s, c) != 0) return;
  shutdown(c->fd, SHUT_WR);
  client_drop(s, c, 1);
}

/* ---- Replies ------------------------------------------------------------- */

static void reply_ok(client *c) {
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_frame_end(&c->out, at);
}

static void reply_i64(client *c, int64_t v) {
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_i64(&c->out, v);
  ddp__buf_frame_end(&c->out, at);
}

static void reply_u8(client *c, uint8_t v) {
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_u8(&c->out, v);
  ddp__buf_frame_end(&c->out, at);
}

static void reply_bytes(client *c, const void *data, size_t len) {
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_reserve(&c->out, 5 + len);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_bytes(&c->out, data, len);
  ddp__buf_frame_end(&c->out, at);
}

/* Maps a table error (message in ddp_last_error) onto a reply. */
static void reply_status(client *c, ddp_status st) {
  uint8_t code = st == DDP_ERR_FORMAT ? DDP__WIRE_NOT_INTEGER
                 : st == DDP_ERR_RANGE ? DDP__WIRE_OVERFLOW
                                       : DDP__WIRE_FULL;
  ddp__store_encode_error(&c->out, code, "%s", ddp_last_error());
}

/* ---- Waiters ------------------------------------------------------------- */

static int key_present(ddp_store_server *s, ddp__slice k) {
  const ddp__kv_entry *e = ddp__kv_find(&s->table, (const char *)k.data, k.len);
  return e && e->has_value;
}

/* Replies to a get / multi_get / wait whose keys all exist. */
static void reply_ready(ddp_store_server *s, client *c, uint8_t op, const ddp__slice *keys,
                        uint32_t n) {
  if (op == DDP__OP_WAIT) {
    reply_ok(c);
    return;
  }
  if (op == DDP__OP_GET) {
    const ddp__kv_entry *e = ddp__kv_find(&s->table, (const char *)keys[0].data, keys[0].len);
    reply_bytes(c, e->value, e->value_len);
    return;
  }
  uint64_t total = 9;
  for (uint32_t i = 0; i < n; i++)
    total += 4 + ddp__kv_find(&s->table, (const char *)keys[i].data, keys[i].len)->value_len;
  if (total > s->limits.max_message_bytes) {
    ddp__store_encode_error(&c->out, DDP__WIRE_TOO_LARGE,
                            "the %u values total %" PRIu64 " bytes, over the message limit of %"
                            PRIu64, n, total, s->limits.max_message_bytes);
    return;
  }
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_reserve(&c->out, total);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_u32(&c->out, n);
  for (uint32_t i = 0; i < n; i++) {
    const ddp__kv_entry *e = ddp__kv_find(&s->table, (const char *)keys[i].data, keys[i].len);
    ddp__buf_bytes(&c->out, e->value, e->value_len);
  }
  ddp__buf_frame_end(&c->out, at);
}

static void waiter_unlink_all(ddp_store_server *s, waiter *w) {
  for (uint32_t i = 0; i < w->num_keys; i++) {
    wnode *n = &w->nodes[i];
    ddp__kv_entry *e = n->entry;
    if (!e) continue;
    if (n->prev) n->prev->next = n->next;
    else e->waiters = n->next;
    if (n->next) n->next->prev = n->prev;
    n->prev = n->next = NULL;
    n->entry = NULL;
    ddp__kv_release(&s->table, e); /* a placeholder nobody waits on goes */
  }
}

static void waiter_free(ddp_store_server *s, waiter *w) {
  if (w->prev) w->prev->next = w->next;
  else s->waiters = w->next;
  if (w->next) w->next->prev = w->prev;
  STAT_ADD(s, waiters, (uint64_t)-1);
  ddp_free(w); /* keys, nodes and key bytes share the allocation */
}

/* Links the waiter onto every missing key. Returns the number missing, or
 * -1 when out of memory. */
static int waiter_link_missing(ddp_store_server *s, waiter *w) {
  int missing = 0;
  w->missing = 0;
  w->deletes_seen = s->deletes;
  for (uint32_t i = 0; i < w->num_keys; i++) {
    /* One lookup: finds a present key, or makes the placeholder to wait on. */
    ddp__kv_entry *e = ddp__kv_intern(&s->table, (const char *)w->keys[i].data, w->keys[i].len);
    if (!e) return -1;
    if (e->has_value) continue;
    missing++;
    wnode *n = &w->nodes[i];
    n->w = w;
    n->entry = e;
    n->prev = NULL;
    n->next = e->waiters;
    if (n->next) n->next->prev = n;
    e->waiters = n;
    w->missing++;
  }
  return missing;
}

/* The keys still missing, for a timeout message. */
static void missing_keys_text(ddp_store_server *s, waiter *w, char *buf, size_t cap) {
  size_t at = 0, shown = 0, missing = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < w->num_keys; i++) {
    if (key_present(s, w->keys[i])) continue;
    missing++;
    if (shown < 4 && at + 8 < cap) {
      int n = snprintf(buf + at, cap - at, "%s\"%.*s\"", shown ? ", " : "",
                       (int)(w->keys[i].len > 64 ? 64 : w->keys[i].len),
                       (const char *)w->keys[i].data);
      if (n > 0) at += (size_t)n < cap - at ? (size_t)n : cap - at - 1;
      shown++;
    }
  }
  if (missing > shown && at + 24 < cap) snprintf(buf + at, cap - at, " and %zu more", missing - shown);
}

/* Ends a waiter (reply already queued) and lets its client go on. */
static void waiter_finish(ddp_store_server *s, waiter *w) {
  client *c = w->c;
  waiter_unlink_all(s, w);
  waiter_free(s, w);
  c->waiter = NULL;
  if (c->in.len && !c->resume) {
    c->resume = 1;
    c->resume_next = s->resume_list;
    s->resume_list = c;
  }
  client_flush(s, c);
}

/* Re-evaluates a waiter whose last missing key was just written: usually
 * it is done; if a key it had seen was deleted since, it waits for that. */
static void waiter_recheck(ddp_store_server *s, waiter *w) {
  /* Keys present when it was linked are present still unless something was
   * deleted since (only delete removes a value): then no need to look. */
  uint32_t i = 0;
  if (w->deletes_seen == s->deletes) i = w->num_keys;
  while (i < w->num_keys && key_present(s, w->keys[i])) i++;
  if (i == w->num_keys) {
    reply_ready(s, w->c, w->op, w->keys, w->num_keys);
    waiter_finish(s, w);
    return;
  }
  waiter_unlink_all(s, w);
  int missing = waiter_link_missing(s, w);
  if (missing == 0) {
    reply_ready(s, w->c, w->op, w->keys, w->num_keys);
    waiter_finish(s, w);
  } else if (missing < 0) {
    ddp__store_encode_error(&w->c->out, DDP__WIRE_FULL, "server out of memory");
    waiter_finish(s, w);
  }
}

/* Wakes the waiters of an entry that just got a value. */
static void wake(ddp_store_server *s, ddp__kv_entry *e) {
  if (!e || !e->waiters) return;
  wnode *n = e->waiters;
  e->waiters = NULL;
  s->wake_len = 0;
  while (n) {
    wnode *next = n->next;
    n->entry = NULL;
    n->prev = n->next = NULL;
    waiter *w = n->w;
    /* Counting, not rechecking every key, keeps a wait on N keys O(1) per
     * write (a rendezvous where each of N ranks waits for all N is N^2). */
    if (w->missing) w->missing--;
    if (w->missing == 0 && !w->queued && s->wake_len == s->wake_cap) {
      size_t cap = s->wake_cap ? s->wake_cap * 2 : 64;
      waiter **q = ddp_alloc(cap * sizeof *q);
      if (q) {
        if (s->wake_len) memcpy(q, s->wake_queue, s->wake_len * sizeof *q);
        ddp_free(s->wake_queue);
        s->wake_queue = q;
        s->wake_cap = cap;
      }
    }
    /* Out of memory for the queue: the waiter is unlinked from this key
     * anyway, and expire() rechecks it at its deadline. */
    if (w->missing == 0 && !w->queued && s->wake_len < s->wake_cap) {
      w->queued = 1;
      s->wake_queue[s->wake_len++] = w;
    }
    n = next;
  }
  for (size_t i = 0; i < s->wake_len; i++) {
    waiter *w = s->wake_queue[i];
    w->queued = 0;
    waiter_recheck(s, w);
  }
  s->wake_len = 0;
}

/* Starts a blocking request: replies now if it can, else parks a waiter. */
static void start_blocking(ddp_store_server *s, client *c, const ddp__store_request *req) {
  const ddp__slice *keys = req->op == DDP__OP_GET ? &req->key : req->keys;
  uint32_t n = req->op == DDP__OP_GET ? 1 : req->num_keys;
  uint32_t first_missing = 0;
  while (first_missing < n && key_present(s, keys[first_missing])) first_missing++;
  if (first_missing == n) {
    reply_ready(s, c, req->op, keys, n);
    return;
  }
  if (req->timeout_ms == 0) {
    ddp__store_encode_error(&c->out, DDP__WIRE_TIMEOUT, "timed out after 0 ms");
    return;
  }
  size_t key_bytes = 0;
  for (uint32_t i = 0; i < n; i++) key_bytes += keys[i].len;
  waiter *w = ddp_alloc(sizeof *w + n * (sizeof(ddp__slice) + sizeof(wnode)) + key_bytes);
  if (!w) {
    ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "server out of memory");
    return;
  }
  memset(w, 0, sizeof *w);
  w->keys = (ddp__slice *)(w + 1);
  w->nodes = (wnode *)(w->keys + n);
  uint8_t *bytes = (uint8_t *)(w->nodes + n);
  memset(w->nodes, 0, n * sizeof(wnode));
  for (uint32_t i = 0; i < n; i++) {
    memcpy(bytes, keys[i].data, keys[i].len);
    w->keys[i].data = bytes;
    w->keys[i].len = keys[i].len;
    bytes += keys[i].len;
  }
  w->c = c;
  w->op = req->op;
  w->num_keys = n;
  w->timeout_ms = ddp__store_clamp_ms(req->timeout_ms); /* a client's 2^63 must not overflow */
  w->deadline_ns = w->timeout_ms < 0 ? -1 : ddp_time_ns() + w->timeout_ms * 1000000LL;
  w->next = s->waiters;
  if (w->next) w->next->prev = w;
  s->waiters = w;
  c->waiter = w;
  STAT_ADD(s, waiters, 1);
  set_deadline(s, w->deadline_ns);
  if (waiter_link_missing(s, w) < 0) {
    ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "server out of memory");
    waiter_finish(s, w);
  }
}

/* Times out expired waiters and silent handshakes; recomputes the next
 * deadline. */
static void expire(ddp_store_server *s, int64_t now) {
  if (s->next_deadline_ns < 0 || now < s->next_deadline_ns) return;
  s->next_deadline_ns = -1;
  waiter *w = s->waiters;
  while (w) {
    waiter *next = w->next;
    int expired = w->deadline_ns >= 0 && w->deadline_ns <= now;
    if (expired) {
      /* Recheck first: a wake lost to an allocation failure lands here. */
      waiter_unlink_all(s, w);
      expired = waiter_link_missing(s, w) != 0;
      if (!expired) {
        reply_ready(s, w->c, w->op, w->keys, w->num_keys);
        waiter_finish(s, w);
        w = next;
        continue;
      }
    }
    if (expired) {
      char missing[300], t[32];
      missing_keys_text(s, w, missing, sizeof missing);
      ddp__store_format_ms(w->timeout_ms, t, sizeof t);
      if (w->op == DDP__OP_GET) /* the caller's message names its one key */
        ddp__store_encode_error(&w->c->out, DDP__WIRE_TIMEOUT, "timed out after %s", t);
      else
        ddp__store_encode_error(&w->c->out, DDP__WIRE_TIMEOUT, "timed out after %s (missing %s)",
                                t, missing);
      waiter_finish(s, w);
    } else if (w->deadline_ns > now) {
      set_deadline(s, w->deadline_ns);
    }
    w = next;
  }
  client *c = s->clients;
  while (c) {
    client *next = c->next;
    if (!c->authed) {
      if (c->hello_deadline_ns <= now)
        client_reject(s, c, DDP__WIRE_STATE, "no handshake within %" PRId64 " ms",
                      s->handshake_timeout_ms);
      else
        set_deadline(s, c->hello_deadline_ns);
    }
    c = next;
  }
}

/* ---- Requests ------------------------------------------------------------ */

static int token_matches(const ddp_store_server *s, ddp__slice t) {
  size_t want = strlen(s->token);
  unsigned diff = (unsigned)(want ^ t.len);
  for (size_t i = 0; i < t.len; i++) diff |= (unsigned)(t.data[i] ^ (uint8_t)s->token[i % (want ? want : 1)]);
  return diff == 0;
}

static void do_hello(ddp_store_server *s, client *c, const ddp__store_request *req) {
  if (req->magic != DDP__STORE_MAGIC) {
    client_reject(s, c, DDP__WIRE_VERSION, "not a ddp store client (bad magic 0x%08x)", req->magic);
    return;
  }
  if (req->version != DDP__STORE_VERSION) {
    client_reject(s, c, DDP__WIRE_VERSION,
                  "protocol version %u is not supported (this server speaks %u)", req->version,
                  DDP__STORE_VERSION);
    return;
  }
  if (s->has_token && !token_matches(s, req->key)) {
    client_reject(s, c, DDP__WIRE_AUTH,
                  req->key.len ? "token refused (DDP_STORE_TOKEN differs from the server's)"
                               : "this store requires a token (set DDP_STORE_TOKEN)");
    return;
  }
  if (!s->has_token && req->key.len)
    DDP_DEBUG("store server: client %s sent a token, but none is required", c->addr);
  c->authed = 1;
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_u32(&c->out, DDP__STORE_VERSION);
  ddp__buf_u32(&c->out, s->limits.max_key_bytes);
  ddp__buf_u32(&c->out, s->limits.max_keys_per_call);
  ddp__buf_i64(&c->out, (int64_t)s->limits.max_value_bytes);
  ddp__buf_i64(&c->out, (int64_t)s->limits.max_message_bytes);
  ddp__buf_frame_end(&c->out, at);
}

static void do_list_keys(ddp_store_server *s, client *c, ddp__slice prefix) {
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  size_t count_at = c->out.len;
  ddp__buf_u32(&c->out, 0);
  uint32_t n = 0;
  size_t b = 0;
  for (ddp__kv_entry *e = ddp__kv_next(&s->table, &b, NULL); e; e = ddp__kv_next(&s->table, &b, e)) {
    if (!e->has_value || e->key_len < prefix.len || memcmp(e->key, prefix.data, prefix.len)) continue;
    ddp__buf_bytes(&c->out, e->key, e->key_len);
    n++;
  }
  if (c->out.failed || c->out.len - at - 4 > s->limits.max_message_bytes) {
    int failed = c->out.failed;
    c->out.failed = 0;
    c->out.len = at;
    ddp__store_encode_error(&c->out, failed ? DDP__WIRE_FULL : DDP__WIRE_TOO_LARGE,
                            "the %u keys do not fit in one message", n);
    return;
  }
  uint8_t *p = c->out.data + count_at;
  p[0] = (uint8_t)n;
  p[1] = (uint8_t)(n >> 8);
  p[2] = (uint8_t)(n >> 16);
  p[3] = (uint8_t)(n >> 24);
  ddp__buf_frame_end(&c->out, at);
}

static uint64_t request_bytes(const ddp__store_request *req) {
  uint64_t n = req->key.len + req->value.len + req->desired.len;
  for (uint32_t i = 0; i < req->num_keys; i++) {
    n += req->keys[i].len;
    if (req->values) n += req->values[i].len;
  }
  return n;
}

static void handle(ddp_store_server *s, client *c, const ddp__store_request *req) {
  STAT_ADD(s, requests, 1);
  if (req->op == DDP__OP_HELLO) {
    if (c->authed) client_reject(s, c, DDP__WIRE_STATE, "second hello on one connection");
    else do_hello(s, c, req);
    return;
  }
  if (!c->authed) {
    client_reject(s, c, DDP__WIRE_STATE, "%s before the hello handshake",
                  ddp__store_op_name(req->op));
    return;
  }
  const char *key = (const char *)req->key.data;
  size_t klen = req->key.len;
  ddp__kv_entry *changed = NULL;
  ddp_status st;
  switch (req->op) {
    case DDP__OP_SET:
      st = ddp__kv_set(&s->table, key, klen, req->value.data, req->value.len, &changed);
      if (st == DDP_OK) reply_ok(c);
      else reply_status(c, st);
      break;
    case DDP__OP_APPEND:
      st = ddp__kv_append(&s->table, key, klen, req->value.data, req->value.len, &changed);
      if (st == DDP_OK) reply_ok(c);
      else reply_status(c, st);
      break;
    case DDP__OP_ADD: {
      int64_t result = 0;
      st = ddp__kv_add(&s->table, key, klen, req->integer, &result, &changed);
      if (st == DDP_OK) reply_i64(c, result);
      else reply_status(c, st);
      break;
    }
    case DDP__OP_COMPARE_SET: {
      const uint8_t *r;
      size_t rlen;
      st = ddp__kv_compare_set(&s->table, key, klen, req->value.data, req->value.len,
                               req->desired.data, req->desired.len, &r, &rlen, &changed);
      if (st == DDP_OK) reply_bytes(c, r, rlen);
      else reply_status(c, st);
      break;
    }
    case DDP__OP_GET:
    case DDP__OP_WAIT:
    case DDP__OP_MULTI_GET:
      start_blocking(s, c, req);
      break;
    case DDP__OP_CHECK: {
      uint8_t all = 1;
      for (uint32_t i = 0; i < req->num_keys && all; i++) all = (uint8_t)key_present(s, req->keys[i]);
      reply_u8(c, all);
      break;
    }
    case DDP__OP_DELETE: {
      int deleted;
      ddp__kv_delete(&s->table, key, klen, &deleted);
      s->deletes += (uint64_t)deleted;
      reply_u8(c, (uint8_t)deleted);
      break;
    }
    case DDP__OP_NUM_KEYS:
      reply_i64(c, (int64_t)ddp__kv_count_prefix(&s->table, key, klen));
      break;
    case DDP__OP_LIST_KEYS:
      do_list_keys(s, c, req->key);
      break;
    case DDP__OP_MULTI_SET: {
      /* All or nothing: check room first, so no reader sees half of them. */
      uint64_t need = request_bytes(req);
      if (s->table.max_bytes && s->table.bytes + need > s->table.max_bytes) {
        ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "the store is full (%" PRIu64
                                " of %" PRIu64 " bytes held)", s->table.bytes, s->table.max_bytes);
        break;
      }
      st = DDP_OK;
      for (uint32_t i = 0; i < req->num_keys && st == DDP_OK; i++) {
        ddp__kv_entry *e = NULL;
        st = ddp__kv_set(&s->table, (const char *)req->keys[i].data, req->keys[i].len,
                         req->values[i].data, req->values[i].len, &e);
        wake(s, e);
      }
      if (st == DDP_OK) reply_ok(c);
      else reply_status(c, st);
      break;
    }
    case DDP__OP_PING:
      reply_i64(c, req->integer);
      break;
    default:
      DDP_ASSERT(0 && "parser let an unknown opcode through");
  }
  wake(s, changed);
  STAT_SET(s, keys, s->table.num_values);
}

/* Parses and serves the complete requests in the client's input buffer, as
 * long as it is not blocked and its output is not backed up. */
static void client_process(ddp_store_server *s, client *c) {
  size_t off = 0;
  while (!c->dead && !c->waiter && c->out.len - c->out_sent < OUT_HIGH_WATER && off < c->in.len) {
    ddp__store_request req;
    size_t used = 0;
    uint8_t status = 0;
    char err[256];
    /* Until a client has shaken hands it may send a hello and nothing
     * bigger, so strangers cannot make the server buffer large frames. */
    const ddp_store_limits *limits = c->authed ? &s->limits : &s->hello_limits;
    ddp__parse_result r = ddp__store_parse_request(c->in.data + off, c->in.len - off, limits,
                                                   &req, &used, &status, err, sizeof err);
    if (r == DDP__PARSE_MORE) break;
    if (r == DDP__PARSE_ERROR) {
      client_reject(s, c, status, "%s", err);
      return;
    }
    handle(s, c, &req);
    ddp__store_request_free(&req);
    off += used;
  }
  if (c->dead) return;
  if (c->out.len - c->out_sent >= OUT_HIGH_WATER) c->backpressured = 1;
  ddp__buf_consume(&c->in, off);
  if (c->in.len == 0 && c->in.cap > (1u << 20)) ddp__buf_free(&c->in); /* after a big value */
  if (c->out.len > c->out_sent || c->out.failed) client_flush(s, c);
  else update_events(s, c);
}

static void client_read(ddp_store_server *s, client *c) {
  /* Read a chunk, or up to 1 MiB of a big frame in progress: memory grows
   * with the bytes that actually arrive, not with what a header claims. */
  size_t want = READ_CHUNK;
  if (c->in.len >= DDP__STORE_FRAME_HEADER) {
    uint64_t frame = DDP__STORE_FRAME_HEADER + (uint64_t)ddp__load_u32(c->in.data);
    if (frame > c->in.len && frame - c->in.len > want)
      want = frame - c->in.len < (1u << 20) ? (size_t)(frame - c->in.len) : (1u << 20);
  }
  ddp__buf_reserve(&c->in, want);
  if (c->in.failed) {
    c->in.failed = 0;
    client_reject(s, c, DDP__WIRE_FULL, "server out of memory for a %zu-byte read", want);
    return;
  }
  ssize_t n;
  do n = recv(c->fd, c->in.data + c->in.len, c->in.cap - c->in.len, MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    DDP_DEBUG("store server: client %s %s", c->addr, n == 0 ? "disconnected" : strerror(errno));
    client_drop(s, c, n != 0);
    return;
  }
  if (n < 0) return;
  c->in.len += (size_t)n;
  client_process(s, c);
}

static void accept_clients(ddp_store_server *s) {
  for (int i = 0; i < 1024; i++) {
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && s->spare_fd >= 0) {
        /* Out of descriptors: accept and close one so the backlog does not
         * spin the loop, then keep the spare for next time. */
        close(s->spare_fd);
        int drop = accept(s->listen_fd, NULL, NULL);
        if (drop >= 0) close(drop);
        s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        DDP_WARN("store server %s: out of file descriptors; refused a client (raise ulimit -n)",
                 s->address);
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        DDP_WARN("store server %s: accept: %s", s->address, strerror(errno));
      return;
    }
    client *c = ddp_calloc(1, sizeof *c);
    if (!c) {
      close(fd);
      continue;
    }
    c->fd = fd;
    ddp__net_set_nodelay(fd);
    ddp__net_peer_addr(fd, c->addr, sizeof c->addr);
    c->hello_deadline_ns = ddp_time_ns() + s->handshake_timeout_ms * 1000000LL;
    c->events = EPOLLIN | EPOLLRDHUP;
    struct epoll_event ev = {.events = c->events, .data.ptr = c};
    if (epoll_ctl(s->epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      close(fd);
      ddp_free(c);
      continue;
    }
    c->next = s->clients;
    if (c->next) c->next->prev = c;
    s->clients = c;
    STAT_ADD(s, clients, 1);
    STAT_ADD(s, clients_accepted, 1);
    set_deadline(s, c->hello_deadline_ns);
    if (__atomic_load_n(&s->stats.clients, __ATOMIC_RELAXED) > s->limits.max_clients)
      client_reject(s, c, DDP__WIRE_FULL, "the server already has %u clients (its limit)",
                    s->limits.max_clients);
  }
}

/* ---- The loop ------------------------------------------------------------ */

ddp_status ddp_store_server_run(ddp_store_server *s) {
  if (!s) return ddp_error(DDP_ERR_INVALID, "ddp_store_server_run: server is NULL");
  struct epoll_event events[MAX_EVENTS];
  ddp_status st = DDP_OK;
  s->running = 1;
  while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
    int timeout = -1;
    if (s->next_deadline_ns >= 0) {
      int64_t left = s->next_deadline_ns - ddp_time_ns();
      timeout = left <= 0 ? 0 : (int)((left + 999999) / 1000000);
    }
    int n = epoll_wait(s->epoll_fd, events, MAX_EVENTS, timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      st = ddp_error(DDP_ERR_SYS, "store server %s: epoll_wait: %s", s->address, strerror(errno));
      break;
    }
    for (int i = 0; i < n; i++) {
      void *p = events[i].data.ptr;
      uint32_t ev = events[i].events;
      if (p == &s->listen_fd) {
        accept_clients(s);
        continue;
      }
      if (p == &s->wake_fd) continue; /* the loop condition sees stop */
      client *c = p;
      if (c->dead) continue;
      if (ev & EPOLLOUT) {
        if (client_flush(s, c) != 0) continue;
      }
      if (ev & EPOLLIN) {
        client_read(s, c);
      } else if (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        /* Gone while blocked (we are not reading it): drop it and its waiter. */
        DDP_DEBUG("store server: client %s hung up", c->addr);
        client_drop(s, c, 0);
      }
    }
    expire(s, ddp_time_ns());
    while (s->resume_list) {
      client *c = s->resume_list;
      s->resume_list = c->resume_next;
      c->resume = 0;
      if (!c->dead) client_process(s, c);
    }
    free_dead(s);
  }
  s->running = 0;
  return st;
}

/* ---- Lifecycle ----------------------------------------------------------- */

ddp_status ddp_store_server_create(const char *bind_addr, uint16_t port,
                                   const ddp_store_server_options *options,
                                   ddp_store_server **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_store_server_create: out is NULL");
  *out = NULL;
  ddp_store_server *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "store server: out of memory");
  s->listen_fd = s->epoll_fd = s->wake_fd = s->spare_fd = -1;
  s->next_deadline_ns = -1;
  ddp__store_limits_resolve(options ? &options->limits : NULL, &s->limits);
  s->hello_limits = s->limits;
  s->hello_limits.max_message_bytes = 1 + 4 + 4 + 4 + DDP_STORE_MAX_TOKEN_BYTES;
  s->handshake_timeout_ms =
      options && options->handshake_timeout_ms > 0 ? ddp__store_clamp_ms(options->handshake_timeout_ms)
                                                   : 10000;
  const char *token = options ? options->token : NULL;
  if (!token) token = ddp_env_str("DDP_STORE_TOKEN", NULL);
  ddp_status st;
  if (token && *token) {
    if (strlen(token) > DDP_STORE_MAX_TOKEN_BYTES) {
      st = ddp_error(DDP_ERR_RANGE, "store server: token of %zu bytes exceeds %u", strlen(token),
                     DDP_STORE_MAX_TOKEN_BYTES);
      goto err;
    }
    snprintf(s->token, sizeof s->token, "%s", token);
    s->has_token = 1;
  }
  st = ddp__net_listen(bind_addr, port, SOMAXCONN > 4096 ? SOMAXCONN : 4096, &s->listen_fd);
  if (st != DDP_OK) goto err;
  s->port = ddp__net_local_port(s->listen_fd);
  ddp__net_local_addr(s->listen_fd, s->address, sizeof s->address);
  s->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (s->epoll_fd < 0 || s->wake_fd < 0) {
    st = ddp_error(DDP_ERR_SYS, "store server: epoll/eventfd: %s", strerror(errno));
    goto err;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &s->listen_fd};
  struct epoll_event wev = {.events = EPOLLIN, .data.ptr = &s->wake_fd};
  if (epoll_ctl(s->epoll_fd, EPOLL_CTL_ADD, s->listen_fd, &ev) != 0 ||
      epoll_ctl(s->epoll_fd, EPOLL_CTL_ADD, s->wake_fd, &wev) != 0) {
    st = ddp_error(DDP_ERR_SYS, "store server: epoll_ctl: %s", strerror(errno));
    goto err;
  }
  ddp__kv_init(&s->table, s->limits.max_total_bytes);
  *out = s;
  return DDP_OK;
err:
  if (s->listen_fd >= 0) close(s->listen_fd);
  if (s->epoll_fd >= 0) close(s->epoll_fd);
  if (s->wake_fd >= 0) close(s->wake_fd);
  if (s->spare_fd >= 0) close(s->spare_fd);
  ddp_free(s);
  return st;
}

void ddp_store_server_shutdown(ddp_store_server *s) {
  if (!s) return;
  __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
  uint64_t one = 1;
  ssize_t rc = write(s->wake_fd, &one, sizeof one); /* async-signal-safe */
  (void)rc;
}

static void *server_thread(void *arg) {
  ddp_store_server *s = arg;
  /* Signals belong to the application's threads, not to the store's. */
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  if (ddp_store_server_run(s) != DDP_OK)
    ddp_log(DDP_LOG_ERROR, "%s", ddp_last_error());
  return NULL;
}

ddp_status ddp_store_server_start(const char *bind_addr, uint16_t port,
                                  const ddp_store_server_options *options,
                                  ddp_store_server **out) {
  ddp_store_server *s;
  DDP_TRY(ddp_store_server_create(bind_addr, port, options, &s));
  int rc = pthread_create(&s->thread, NULL, server_thread, s);
  if (rc != 0) {
    ddp_store_server_stop(s);
    return ddp_error(DDP_ERR_SYS, "store server: cannot start its thread: %s", strerror(rc));
  }
  pthread_setname_np(s->thread, "ddp-store");
  s->has_thread = 1;
  *out = s;
  return DDP_OK;
}

void ddp_store_server_stop(ddp_store_server *s) {
  if (!s) return;
  ddp_store_server_shutdown(s);
  if (s->has_thread) pthread_join(s->thread, NULL);
  while (s->clients) client_drop(s, s->clients, 0);
  free_dead(s);
  ddp__kv_free(&s->table);
  ddp_free(s->wake_queue);
  close(s->listen_fd);
  close(s->epoll_fd);
  close(s->wake_fd);
  if (s->spare_fd >= 0) close(s->spare_fd);
  ddp_free(s);
}

uint16_t ddp_store_server_port(const ddp_store_server *s) { return s ? s->port : 0; }

const char *ddp_store_server_address(const ddp_store_server *s) {
  return s ? s->address : "(null)";
}

void ddp_store_server_get_stats(const ddp_store_server *s, ddp_store_server_stats *out) {
  memset(out, 0, sizeof *out);
  if (!s) return;
  out->clients = __atomic_load_n(&s->stats.clients, __ATOMIC_RELAXED);
  out->clients_accepted = __atomic_load_n(&s->stats.clients_accepted, __ATOMIC_RELAXED);
  out->clients_dropped = __atomic_load_n(&s->stats.clients_dropped, __ATOMIC_RELAXED);
  out->requests = __atomic_load_n(&s->stats.requests, __ATOMIC_RELAXED);
  out->keys = __atomic_load_n(&s->stats.keys, __ATOMIC_RELAXED);
  out->waiters = __atomic_load_n(&s->stats.waiters, __ATOMIC_RELAXED);
}
