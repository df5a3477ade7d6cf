/* The TCP store server's connections: one thread, one epoll loop (in the
 * manner of Redis's ae.c), every socket non-blocking. Each client has an
 * input and an output buffer; requests are parsed from the input buffer with
 * protocol.c, served by server_requests.c into the output buffer, which is
 * written at once and, if the socket is full, when epoll says it is
 * writable. A client that sends anything malformed or over a limit gets an
 * error reply and is dropped; no client can stall the loop: nothing blocks,
 * and each one's buffers are bounded. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "store/server_impl.h"
#include "store/server_fork.h"
#include "store/store_impl.h"

#define READ_CHUNK (64 * 1024)
#define MAX_EVENTS 256

void ddp__store_server_set_deadline(ddp_store_server *s, int64_t deadline_ns) {
  if (deadline_ns >= 0 && (s->next_deadline_ns < 0 || deadline_ns < s->next_deadline_ns))
    s->next_deadline_ns = deadline_ns;
}

/* ---- Clients ------------------------------------------------------------- */

static void update_events(ddp_store_server *s, client *c) {
  if (c->dead) return;
  uint32_t want = EPOLLRDHUP;
  size_t pending = c->out.len - c->out_sent;
  if (!c->waiter && !c->closing && pending < OUT_HIGH_WATER) want |= EPOLLIN;
  if (pending) want |= EPOLLOUT;
  if (want == c->events) return;
  struct epoll_event ev = {.events = want, .data.ptr = c};
  epoll_ctl(s->epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
  c->events = want;
}

/* Closes the client at once; its memory goes at the end of the loop pass
 * (events for it may still be in this pass's array). */
static void client_drop(ddp_store_server *s, client *c, int for_error) {
  if (c->dead) return;
  if (c->waiter) {
    ddp__store_server_cancel_waiter(s, c->waiter);
    c->waiter = NULL;
  }
  if (c->watch) ddp__store_server_cancel_watch(s, c->watch); /* clears c->watch */
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

int ddp__store_server_flush(ddp_store_server *s, client *c) {
  if (c->out.failed) {
    /* A reply could not be built (out of memory): the stream is broken. */
    ddp_log(DDP_LOG_WARN, "store server %s: out of memory replying to %s; dropping it", s->address,
            c->addr);
    client_drop(s, c, 1);
    return -1;
  }
  while (c->out_sent < c->out.len) {
    ssize_t n = send(c->fd, c->out.data + c->out_sent, c->out.len - c->out_sent,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c->out_sent += (size_t)n;
      c->sent_total += (uint64_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    DDP_DEBUG("store server: client %s: send failed (%s); dropping it", c->addr,
              n < 0 ? strerror(errno) : "closed");
    client_drop(s, c, 1);
    return -1;
  }
  if (c->watch) ddp__store_server_watch_sent(c);
  if (c->closing && c->out_sent == c->out.len) {
    /* A dropped watch has read its error: now it goes. */
    shutdown(c->fd, SHUT_WR);
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
  if (c->backpressured && c->out.len - c->out_sent < OUT_HIGH_WATER) {
    c->backpressured = 0;
    ddp__store_server_resume(s, c);
  }
  update_events(s, c);
  return 0;
}

/* The reply is best effort: the client may already be gone. */
void ddp__store_server_reject(ddp_store_server *s, client *c, uint8_t status, const char *fmt,
                              ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  DDP_INFO("store server: client %s: %s; dropping it", c->addr, msg);
  ddp__store_encode_error(&c->out, status, "%s", msg);
  if (ddp__store_server_flush(s, c) != 0) return;
  shutdown(c->fd, SHUT_WR);
  client_drop(s, c, 1);
}

void ddp__store_server_resume(ddp_store_server *s, client *c) {
  if (c->resume || c->dead) return;
  c->resume = 1;
  c->resume_next = s->resume_list;
  s->resume_list = c;
}

/* Times out expired waiters and silent handshakes; recomputes the next
 * deadline. */
static void expire(ddp_store_server *s, int64_t now) {
  if (s->next_deadline_ns < 0 || now < s->next_deadline_ns) return;
  s->next_deadline_ns = -1;
  ddp__store_server_expire_waiters(s, now);
  client *c = s->clients;
  while (c) {
    client *next = c->next;
    if (c->closing) {
      /* A dropped watch that never read its error: give up on it. */
      if (c->closing_deadline_ns <= now) client_drop(s, c, 1);
      else ddp__store_server_set_deadline(s, c->closing_deadline_ns);
    } else if (!c->authed) {
      if (c->hello_deadline_ns <= now)
        ddp__store_server_reject(s, c, DDP__WIRE_STATE, "no handshake within %" PRId64 " ms",
                                 s->handshake_timeout_ms);
      else ddp__store_server_set_deadline(s, c->hello_deadline_ns);
    }
    c = next;
  }
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
    ddp__parse_result r = ddp__store_parse_request(c->in.data + off, c->in.len - off, limits, &req,
                                                   &used, &status, err, sizeof err);
    if (r == DDP__PARSE_MORE) break;
    if (r == DDP__PARSE_ERROR) {
      ddp__store_server_reject(s, c, status, "%s", err);
      return;
    }
    ddp__store_server_handle(s, c, &req);
    ddp__store_request_free(&req);
    off += used;
  }
  if (c->dead) return;
  if (c->out.len - c->out_sent >= OUT_HIGH_WATER) c->backpressured = 1;
  ddp__buf_consume(&c->in, off);
  if (c->in.len == 0 && c->in.cap > (1u << 20)) ddp__buf_free(&c->in); /* after a big value */
  if (c->out.len > c->out_sent || c->out.failed) ddp__store_server_flush(s, c);
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
    ddp__store_server_reject(s, c, DDP__WIRE_FULL, "server out of memory for a %zu-byte read",
                             want);
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
    ddp__store_server_set_deadline(s, c->hello_deadline_ns);
    if (__atomic_load_n(&s->stats.clients, __ATOMIC_RELAXED) > s->limits.max_clients)
      ddp__store_server_reject(s, c, DDP__WIRE_FULL,
                               "the server already has %u clients (its limit)",
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
        if (ddp__store_server_flush(s, c) != 0) continue;
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

ddp_store_server_options ddp_store_server_defaults(void) {
  ddp_store_server_options o = {0};
  return o;
}

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
  s->handshake_timeout_ms = options && options->handshake_timeout_ms > 0
                                ? ddp__store_clamp_ms(options->handshake_timeout_ms)
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
  if (ddp_store_server_run(s) != DDP_OK) ddp_log(DDP_LOG_ERROR, "%s", ddp_last_error());
  return NULL;
}

ddp_status ddp_store_server_start(const char *bind_addr, uint16_t port,
                                  const ddp_store_server_options *options, ddp_store_server **out) {
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

/* The fds of a forked server are shared objects (one epoll instance, one
 * eventfd, one listening socket, one socket per client): closing this
 * process's copies leaves them to the other process, where epoll_ctl(DEL),
 * a write to the eventfd or a shutdown would reach into the other copy. So
 * nothing but close(2) and free here. */
void ddp__store_server_forget(ddp_store_server *s) {
  if (!s) return;
  if (s->running || s->has_thread) {
    ddp_log(DDP_LOG_ERROR, "store server %s: ddp__store_server_forget on a running server; ignored",
            s->address);
    return;
  }
  while (s->clients) {
    client *c = s->clients;
    s->clients = c->next;
    if (c->waiter) ddp__store_server_cancel_waiter(s, c->waiter);
    if (c->watch) ddp__store_server_cancel_watch(s, c->watch);
    close(c->fd);
    ddp__buf_free(&c->in);
    ddp__buf_free(&c->out);
    ddp_free(c);
  }
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
  out->watches = __atomic_load_n(&s->stats.watches, __ATOMIC_RELAXED);
  out->watches_dropped = __atomic_load_n(&s->stats.watches_dropped, __ATOMIC_RELAXED);
}
