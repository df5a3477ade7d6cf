/* Connections: writing a frame in one gathered send straight from the
 * message's memory, and the reader thread of each connection, which receives
 * frames into one block per message (tensors straight into their final
 * memory), queues requests for the pool, completes replies, and notices a
 * worker's death (its socket closes) at once. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "net/net.h"
#include "rpc/engine.h"

#define RBUF_BYTES (64u * 1024u)
#define MAX_IOV 64
/* Tensor bytes from which a frame to a peer that can pull goes by
 * cross-memory attach: one copy instead of two through the socket, for an
 * acknowledgement's round trip (docs/rpc.md has the measurements). */
#define PULL_MIN_BYTES (64u * 1024u)

const char *ddp__rpc_worker_str(const ddp_rpc_agent *a, int32_t rank, char *buf, size_t bytes) {
  if (rank >= 0 && rank < a->world)
    snprintf(buf, bytes, "worker '%s' (rank %d)", a->workers[rank].name, rank);
  else snprintf(buf, bytes, "rank %d", rank);
  return buf;
}

/* ---- Writing ----------------------------------------------------------------- */

/* Sends every byte of iov[0..n) (advancing it), waiting while the socket is
 * full, until deadline_ns. */
static ddp_status sendv_full(int fd, struct iovec *iov, int n, int64_t deadline_ns) {
  int i = 0;
  while (i < n) {
    if (iov[i].iov_len == 0) {
      i++;
      continue;
    }
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov + i;
    mh.msg_iovlen = (size_t)(n - i < MAX_IOV ? n - i : MAX_IOV);
    ssize_t sent = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        ddp_status st = ddp__net_wait(fd, POLLOUT, deadline_ns);
        if (st == DDP_ERR_TIMEOUT) return ddp_error(st, "sending timed out (the worker does not read)");
        if (st != DDP_OK) return st;
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
        return ddp_error(DDP_ERR_CLOSED, "the connection is closed (%s)", strerror(errno));
      return ddp_error(DDP_ERR_IO, "sendmsg: %s", strerror(errno));
    }
    size_t left = (size_t)sent;
    while (left > 0 && i < n) {
      size_t take = left < iov[i].iov_len ? left : iov[i].iov_len;
      iov[i].iov_base = (char *)iov[i].iov_base + take;
      iov[i].iov_len -= take;
      left -= take;
      if (iov[i].iov_len == 0) i++;
    }
  }
  return DDP_OK;
}

/* ---- Acknowledgements --------------------------------------------------------------- */

/* Under write_mu: sends the PULLED count due, if any. blocking: wait while
 * the socket is full (a writer, who may wait); else give up at once when
 * nothing could be written (a reader, who must go on draining the socket;
 * the count stays due). */
static ddp_status send_acks_locked(ddp__rpc_conn *c, bool blocking, int64_t deadline_ns) {
  for (;;) {
    uint64_t due = atomic_load(&c->ack_due);
    if (due <= atomic_load(&c->ack_sent)) return DDP_OK;
    ddp__rpc_frame ack = {.magic = DDP__RPC_MAGIC, .kind = DDP__RPC_PULLED, .call_id = due};
    if (!blocking) {
      ssize_t n = send(c->fd, &ack, sizeof ack, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return DDP_OK;
      if (n < 0) return ddp_error(DDP_ERR_CLOSED, "the connection is closed (%s)", strerror(errno));
      if ((size_t)n < sizeof ack) {
        /* Part of it is on the wire: the rest must follow before anything else. */
        struct iovec rest = {(char *)&ack + n, sizeof ack - (size_t)n};
        DDP_TRY(sendv_full(c->fd, &rest, 1, deadline_ns));
      }
    } else {
      struct iovec iov = {&ack, sizeof ack};
      DDP_TRY(sendv_full(c->fd, &iov, 1, deadline_ns));
    }
    atomic_store(&c->ack_sent, due);
  }
}

/* Sends the PULLED count due if the write lock is free (never waits for it). */
static ddp_status try_send_acks(ddp__rpc_conn *c, int64_t deadline_ns) {
  /* The fence pairs with the one after a writer's unlock: either that writer
   * sees the count posted, or this trylock sees the lock free. */
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load(&c->ack_due) <= atomic_load(&c->ack_sent)) return DDP_OK;
  if (pthread_mutex_trylock(&c->write_mu) != 0) return DDP_OK;
  ddp_status st = send_acks_locked(c, false, deadline_ns);
  pthread_mutex_unlock(&c->write_mu);
  return st;
}

static bool acks_due(ddp__rpc_conn *c) {
  return atomic_load(&c->ack_due) > atomic_load(&c->ack_sent);
}

ddp_status ddp__rpc_wait_pulled(ddp__rpc_conn *c, uint64_t seq, int64_t deadline_ns) {
  if (seq == 0) return DDP_OK;
  ddp_rpc_agent *a = c->agent;
  pthread_mutex_lock(&a->mu);
  while (c->cma_pulled < seq && c->state == DDP__RPC_CONN_OPEN && ddp_time_ns() < deadline_ns) {
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000),
                          .tv_nsec = (long)(deadline_ns % 1000000000)};
    pthread_cond_timedwait(&c->pulled_cv, &a->mu, &ts);
  }
  bool pulled = c->cma_pulled >= seq;
  bool open = c->state == DDP__RPC_CONN_OPEN;
  pthread_mutex_unlock(&a->mu);
  if (pulled) return DDP_OK;
  if (!open)
    return ddp_error(DDP_ERR_CLOSED, "the connection closed before the worker read the tensors");
  /* It may still read them later, from memory reused by then: end it. */
  ddp__rpc_conn_lost(c, "the worker did not read the tensors sent to it in time");
  return ddp_error(DDP_ERR_TIMEOUT, "the worker did not read the tensors in time");
}

ddp_status ddp__rpc_send_frame(ddp__rpc_conn *c, uint8_t kind, uint64_t call_id,
                               ddp_status status, const char *fn, int64_t timeout_ms,
                               const ddp_rpc_message *msg, int64_t deadline_ns) {
  return ddp__rpc_send_frame_ex(c, kind, call_id, status, fn, timeout_ms, msg, deadline_ns, NULL);
}

ddp_status ddp__rpc_send_frame_ex(ddp__rpc_conn *c, uint8_t kind, uint64_t call_id,
                                  ddp_status status, const char *fn, int64_t timeout_ms,
                                  const ddp_rpc_message *msg, int64_t deadline_ns,
                                  uint64_t *pull_seq) {
  if (pull_seq) *pull_seq = 0;
  ddp_rpc_message empty = {0};
  if (!msg) msg = &empty;
  size_t fn_bytes = fn ? strlen(fn) : 0;
  DDP_ASSERT(fn_bytes < DDP_RPC_MAX_NAME_BYTES);
  ddp__rpc_frame h = {
      .magic = DDP__RPC_MAGIC,
      .kind = kind,
      .fn_bytes = (uint8_t)fn_bytes,
      .status = (int32_t)status,
      .num_tensors = (uint32_t)msg->num_tensors,
      .call_id = call_id,
      .payload_bytes = msg->payload_bytes,
      .timeout_ms = timeout_ms,
  };
  int nt = msg->num_tensors;
  ddp__rpc_tensor_desc small_descs[8];
  struct iovec small_iov[8 + 4];
  ddp__rpc_tensor_desc *descs = small_descs;
  struct iovec *iov = small_iov;
  if (nt > 8) {
    descs = ddp_calloc((size_t)nt, sizeof *descs);
    iov = ddp_calloc((size_t)nt + 4, sizeof *iov);
    if (!descs || !iov) {
      ddp_free(descs);
      ddp_free(iov);
      return ddp_error(DDP_ERR_NOMEM, "rpc: cannot send a message of %d tensors", nt);
    }
  }
  int n = 0;
  iov[n++] = (struct iovec){&h, sizeof h};
  if (fn_bytes) iov[n++] = (struct iovec){(void *)fn, fn_bytes};
  if (nt) {
    for (int i = 0; i < nt; i++) {
      const ddp_tensor *t = msg->tensors[i];
      memset(&descs[i], 0, sizeof descs[i]);
      descs[i].dtype = (int32_t)t->dtype;
      descs[i].ndim = t->ndim;
      for (int k = 0; k < t->ndim; k++) descs[i].shape[k] = t->shape[k];
    }
    iov[n++] = (struct iovec){descs, (size_t)nt * sizeof *descs};
  }
  if (msg->payload_bytes) iov[n++] = (struct iovec){(void *)msg->payload, msg->payload_bytes};
  size_t tensor_bytes = 0;
  for (int i = 0; i < nt; i++) tensor_bytes += ddp__rpc_tensor_bytes(msg->tensors[i]);
  bool pull = atomic_load_explicit(&c->peer_pulls, memory_order_relaxed) && tensor_bytes >= PULL_MIN_BYTES;
  uint64_t small_addrs[8], *addrs = small_addrs;
  if (pull) {
    if (nt > 8 && !(addrs = ddp_calloc((size_t)nt, sizeof *addrs))) pull = false;
  }
  if (pull) {
    h.flags = DDP__RPC_FLAG_PULL;
    for (int i = 0; i < nt; i++) addrs[i] = (uint64_t)(uintptr_t)msg->tensors[i]->data;
    iov[n++] = (struct iovec){addrs, (size_t)nt * sizeof *addrs};
  } else {
    for (int i = 0; i < nt; i++) {
      size_t bytes = ddp__rpc_tensor_bytes(msg->tensors[i]);
      if (bytes) iov[n++] = (struct iovec){msg->tensors[i]->data, bytes};
    }
  }
  pthread_mutex_lock(&c->write_mu);
  uint64_t seq = pull ? ++c->cma_sent : 0;
  ddp_status st = sendv_full(c->fd, iov, n, deadline_ns);
  if (st == DDP_OK) st = send_acks_locked(c, true, deadline_ns);
  pthread_mutex_unlock(&c->write_mu);
  /* A count the reader posted while this thread held the lock. */
  if (st == DDP_OK) st = try_send_acks(c, deadline_ns);
  if (addrs != small_addrs) ddp_free(addrs);
  if (st == DDP_OK && pull) {
    /* The memory must stay as it is until the peer has read it: wait here,
     * or leave the wait to the caller (a sync call: its reply comes after). */
    if (pull_seq) *pull_seq = seq;
    else st = ddp__rpc_wait_pulled(c, seq, deadline_ns);
  }
  if (descs != small_descs) ddp_free(descs);
  if (iov != small_iov) ddp_free(iov);
  if (st != DDP_OK) {
    char who[128];
    ddp__rpc_worker_str(c->agent, c->rank, who, sizeof who);
    ddp_status ret = ddp_error_wrap(st, "rpc: sending to %s", who);
    char why[256];
    snprintf(why, sizeof why, "%s", ddp_last_error());
    /* Half a frame may be on the wire: the stream is unusable. */
    ddp__rpc_conn_lost(c, why);
    return ddp_error(ret, "%s", why);
  }
  return DDP_OK;
}

void ddp__rpc_send_bye(ddp__rpc_conn *c, bool graceful) {
  if (c->fd < 0) return;
  /* A writer stuck on a full socket holds the lock until its own deadline:
   * waiting that long would stall the shutdown, so try for a while only. */
  int64_t deadline = ddp_time_ns() + 100 * 1000000LL;
  while (pthread_mutex_trylock(&c->write_mu) != 0) {
    if (ddp_time_ns() >= deadline) return;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ddp__rpc_frame h = {.magic = DDP__RPC_MAGIC, .kind = DDP__RPC_BYE, .status = graceful ? 1 : 0};
  struct iovec iov = {&h, sizeof h};
  /* Half a BYE is harmless: the sockets close right after it either way. */
  (void)sendv_full(c->fd, &iov, 1, ddp_time_ns() + 100 * 1000000LL);
  pthread_mutex_unlock(&c->write_mu);
}

/* ---- Memory the peer is still to read ------------------------------------------ */

typedef struct ddp__rpc_held {
  struct ddp__rpc_held *next;
  uint64_t seq;
  ddp_rpc_message msg;
  ddp__rpc_block *block;
} ddp__rpc_held;

static void held_free(ddp__rpc_held *h) {
  while (h) {
    ddp__rpc_held *next = h->next;
    ddp_rpc_message_free(&h->msg);
    ddp__rpc_block_free(h->block);
    ddp_free(h);
    h = next;
  }
}

void ddp__rpc_hold_until_pulled(ddp__rpc_conn *c, uint64_t seq, ddp_rpc_message *msg,
                                ddp__rpc_block *block) {
  ddp_rpc_agent *a = c->agent;
  ddp__rpc_held *h = ddp_calloc(1, sizeof *h);
  if (!h) {
    /* Without a record, wait here instead. */
    ddp__rpc_wait_pulled(c, seq, ddp_time_ns() + a->default_timeout_ns);
    ddp_rpc_message_free(msg);
    ddp__rpc_block_free(block);
    return;
  }
  h->seq = seq;
  h->msg = *msg;
  memset(msg, 0, sizeof *msg);
  h->block = block;
  pthread_mutex_lock(&a->mu);
  bool pulled = c->cma_pulled >= seq;
  if (!pulled) {
    if (c->held_tail) c->held_tail->next = h;
    else c->held_head = h;
    c->held_tail = h;
  }
  pthread_mutex_unlock(&a->mu);
  if (pulled) held_free(h);
}

/* Under a->mu: detaches what the peer has read. */
static ddp__rpc_held *held_pulled_locked(ddp__rpc_conn *c) {
  ddp__rpc_held *done = NULL, **tail = &done;
  while (c->held_head && c->held_head->seq <= c->cma_pulled) {
    ddp__rpc_held *h = c->held_head;
    c->held_head = h->next;
    h->next = NULL;
    *tail = h;
    tail = &h->next;
  }
  if (!c->held_head) c->held_tail = NULL;
  return done;
}

void ddp__rpc_release_held(ddp__rpc_conn *c) {
  held_free(c->held_head);
  c->held_head = c->held_tail = NULL;
}

/* ---- Losing a connection -------------------------------------------------------- */

void ddp__rpc_conn_lost(ddp__rpc_conn *c, const char *why) {
  ddp_rpc_agent *a = c->agent;
  pthread_mutex_lock(&a->mu);
  if (c->state != DDP__RPC_CONN_OPEN) {
    pthread_mutex_unlock(&a->mu);
    return;
  }
  /* Only a worker that said so has shut down gracefully: one that sent
   * DONE and was killed while still serving (a graceful shutdown waits for
   * the others' DONE) died, and is reported and cleaned up as such. */
  bool graceful = c->bye == DDP__RPC_BYE_GRACEFUL;
  bool stopping = a->state == DDP__RPC_STOPPING;
  bool left = graceful || stopping;
  c->state = left ? DDP__RPC_CONN_LEFT : DDP__RPC_CONN_FAILED;
  char who[128];
  ddp__rpc_worker_str(a, c->rank, who, sizeof who);
  if (graceful)
    snprintf(c->error, sizeof c->error, "%s has shut down", who);
  else if (stopping)
    snprintf(c->error, sizeof c->error, "the connection to %s was closed by this worker's "
             "shutdown", who);
  else if (c->bye == DDP__RPC_BYE_ABRUPT)
    snprintf(c->error, sizeof c->error, "%s stopped without a graceful shutdown "
             "(ddp_rpc_shutdown with graceful = false)", who);
  else
    snprintf(c->error, sizeof c->error, "%s died or cannot be reached: %s", who, why);
  /* Its pending calls, out of the table. */
  ddp_rpc_future *lost = NULL;
  for (int b = 0; b < DDP__RPC_PENDING_BUCKETS; b++)
    for (ddp_rpc_future *f = a->pending[b], *next; f; f = next) {
      next = f->hnext;
      if (f->to != c->rank) continue;
      ddp__rpc_pending_remove_locked(a, f);
      f->hnext = lost;
      lost = f;
    }
  char error[sizeof c->error];
  memcpy(error, c->error, sizeof error);
  pthread_cond_broadcast(&a->outstanding_cv);
  pthread_cond_broadcast(&c->pulled_cv);
  pthread_mutex_unlock(&a->mu);
  /* Nothing more goes either way (after a failed write the stream is
   * broken): the reader ends, the worker sees the connection close. The fd
   * itself stays open until the agent is freed. */
  if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
  if (!left) ddp_log(DDP_LOG_WARN, "rpc: %s", error);
  for (ddp_rpc_future *f = lost, *next; f; f = next) {
    next = f->hnext;
    char msg[640];
    snprintf(msg, sizeof msg, "rpc to %s, function '%s': %s", who, f->fn, error);
    ddp__rpc_future_finish(f, DDP_ERR_CLOSED, NULL, msg);
    ddp_rpc_future_destroy(f);
  }
  if (!left)
    for (int m = 0; m < ddp__rpc_num_modules; m++)
      if (ddp__rpc_modules[m]->worker_failed) ddp__rpc_modules[m]->worker_failed(a, m, c->rank);
}

/* ---- Reading ------------------------------------------------------------------- */

/* Exactly n bytes into dst: first from the buffer, then large remainders
 * straight from the socket, small ones through the buffer. */
static ddp_status read_exact(ddp__rpc_conn *c, void *dst, size_t n, int64_t deadline_ns) {
  char *d = dst;
  size_t avail = c->rlen - c->rpos;
  size_t take = avail < n ? avail : n;
  memcpy(d, c->rbuf + c->rpos, take);
  c->rpos += take;
  d += take;
  n -= take;
  if (n >= RBUF_BYTES / 2) return ddp__net_read_full(c->fd, d, n, deadline_ns);
  while (n > 0) {
    size_t got;
    DDP_TRY(ddp__net_read_some(c->fd, c->rbuf, RBUF_BYTES, &got, deadline_ns));
    c->rpos = 0;
    c->rlen = got;
    take = got < n ? got : n;
    memcpy(d, c->rbuf, take);
    c->rpos = take;
    d += take;
    n -= take;
  }
  return DDP_OK;
}

/* The tensors of a frame sent for pulling: their addresses from the stream,
 * their data straight from the sender's memory; then the acknowledgement. */
static ddp_status pull_tensors(ddp__rpc_conn *c, ddp__rpc_block *b, const char *who,
                               int64_t deadline) {
  int32_t nt = b->msg.num_tensors;
  uint64_t small[8], *addrs = small;
  if (nt > 8 && !(addrs = ddp_calloc((size_t)nt, sizeof *addrs)))
    return ddp_error(DDP_ERR_NOMEM, "rpc: out of memory reading from %s", who);
  ddp_status st = read_exact(c, addrs, (size_t)nt * sizeof *addrs, deadline);
  for (int32_t i = 0; st == DDP_OK && i < nt; i++) {
    char *dst = b->msg.tensors[i]->data;
    size_t bytes = ddp__rpc_tensor_bytes(b->msg.tensors[i]), done = 0;
    while (done < bytes) {
      struct iovec l = {dst + done, bytes - done};
      struct iovec r = {(void *)(uintptr_t)(addrs[i] + done), bytes - done};
      ssize_t got = process_vm_readv(c->peer_pid, &l, 1, &r, 1, 0);
      if (got <= 0) {
        if (got < 0 && errno == EINTR) continue;
        st = ddp_error(DDP_ERR_IO,
                       "cannot read tensor %d (%zu bytes) from %s's memory (process_vm_readv: "
                       "%s)",
                       i, bytes, who, got < 0 ? strerror(errno) : "nothing read");
        break;
      }
      done += (size_t)got;
    }
  }
  if (addrs != small) ddp_free(addrs);
  if (st != DDP_OK) return st;
  /* Acknowledge in order: the sender may reuse the memory now. */
  atomic_store(&c->ack_due, ++c->cma_received);
  return try_send_acks(c, deadline);
}

/* Reads the body of a REQUEST / REPLY / ERROR frame into a new block. */
static ddp_status read_body(ddp__rpc_conn *c, const ddp__rpc_frame *h, char *fn,
                            size_t extra_bytes, const char *who, ddp__rpc_block **out) {
  ddp_rpc_agent *a = c->agent;
  *out = NULL;
  int64_t deadline = ddp_time_ns() + a->default_timeout_ns;
  if (h->fn_bytes >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_FORMAT, "%s sent a function name of %u bytes", who, h->fn_bytes);
  DDP_TRY(read_exact(c, fn, h->fn_bytes, deadline));
  fn[h->fn_bytes] = '\0';
  if (h->num_tensors > DDP_RPC_MAX_TENSORS)
    return ddp_error(DDP_ERR_FORMAT, "%s sent %u tensors (at most %d)", who, h->num_tensors,
                     DDP_RPC_MAX_TENSORS);
  ddp__rpc_tensor_desc small[8];
  ddp__rpc_tensor_desc *descs = small;
  if (h->num_tensors > 8) {
    descs = ddp_calloc(h->num_tensors, sizeof *descs);
    if (!descs) return ddp_error(DDP_ERR_NOMEM, "rpc: out of memory reading from %s", who);
  }
  ddp_status st = read_exact(c, descs, h->num_tensors * sizeof *descs, deadline);
  if (st == DDP_OK)
    st = ddp__rpc_block_create(descs, h->num_tensors, h->payload_bytes, extra_bytes, who, out);
  if (descs != small) ddp_free(descs);
  if (st != DDP_OK) return st;
  ddp__rpc_block *b = *out;
  st = read_exact(c, b->payload, h->payload_bytes, deadline);
  if (st == DDP_OK && (h->flags & DDP__RPC_FLAG_PULL)) st = pull_tensors(c, b, who, deadline);
  else
    for (int32_t i = 0; st == DDP_OK && i < b->msg.num_tensors; i++)
      st = read_exact(c, b->msg.tensors[i]->data, ddp__rpc_tensor_bytes(b->msg.tensors[i]), deadline);
  if (st != DDP_OK) {
    ddp__rpc_block_free(b);
    *out = NULL;
  }
  return st;
}

bool ddp__rpc_read_loop(ddp__rpc_conn *c) {
  ddp_rpc_agent *a = c->agent;
  char who[128];
  ddp__rpc_worker_str(a, c->rank, who, sizeof who);
  char why[512] = "";
  for (;;) {
    ddp__rpc_frame h;
    /* An acknowledgement still due (the lock was busy, or the socket full):
     * retry it every millisecond while no frame arrives. */
    ddp_status st = DDP_OK;
    while (st == DDP_OK && c->rpos == c->rlen && acks_due(c)) {
      st = try_send_acks(c, ddp_time_ns() + a->default_timeout_ns);
      if (st == DDP_OK && acks_due(c) &&
          ddp__net_wait(c->fd, POLLIN, ddp_time_ns() + 1000000) == DDP_OK)
        break;
    }
    if (st != DDP_OK) {
      snprintf(why, sizeof why, "%s", ddp_last_error());
      break;
    }
    /* Between frames the reader waits without a deadline: an idle
     * connection is normal; shutdown wakes it by shutting the socket down. */
    st = read_exact(c, &h, sizeof h, -1);
    if (st != DDP_OK) {
      snprintf(why, sizeof why, "%s", ddp_last_error());
      break;
    }
    if (h.magic != DDP__RPC_MAGIC) {
      snprintf(why, sizeof why, "%s sent a frame with magic 0x%08x (expected 0x%08x)", who,
               h.magic, DDP__RPC_MAGIC);
      break;
    }
    if (h.kind == DDP__RPC_PULLED) {
      pthread_mutex_lock(&a->mu);
      if (h.call_id > c->cma_pulled) c->cma_pulled = h.call_id;
      pthread_cond_broadcast(&c->pulled_cv);
      ddp__rpc_held *done = held_pulled_locked(c);
      pthread_mutex_unlock(&a->mu);
      held_free(done);
      continue;
    }
    if (h.kind == DDP__RPC_BYE) {
      pthread_mutex_lock(&a->mu);
      c->bye = h.status ? DDP__RPC_BYE_GRACEFUL : DDP__RPC_BYE_ABRUPT;
      pthread_mutex_unlock(&a->mu);
      continue;
    }
    if (h.kind == DDP__RPC_DONE) {
      pthread_mutex_lock(&a->mu);
      c->done_received = true;
      pthread_cond_broadcast(&a->outstanding_cv);
      pthread_mutex_unlock(&a->mu);
      continue;
    }
    if (h.kind != DDP__RPC_REQUEST && h.kind != DDP__RPC_REPLY && h.kind != DDP__RPC_ERROR) {
      snprintf(why, sizeof why, "%s sent a frame of unknown kind %u", who, h.kind);
      break;
    }
    char fn[DDP_RPC_MAX_NAME_BYTES];
    ddp__rpc_block *b;
    size_t extra = h.kind == DDP__RPC_REQUEST ? sizeof(ddp_rpc_call) : 0;
    st = read_body(c, &h, fn, extra, who, &b);
    if (st != DDP_OK) {
      snprintf(why, sizeof why, "%s", ddp_last_error());
      break;
    }
    if (h.kind == DDP__RPC_REQUEST) {
      ddp_rpc_call *call = b->extra;
      call->task.kind = DDP__RPC_TASK_REQUEST;
      call->agent = a;
      call->block = b;
      call->from = c->rank;
      call->call_id = h.call_id;
      int64_t timeout_ms = h.timeout_ms > 0 ? h.timeout_ms : 0;
      if (timeout_ms > INT64_MAX / 2000000) timeout_ms = INT64_MAX / 2000000;
      call->deadline_ns = ddp_time_ns() + timeout_ms * 1000000;
      memcpy(call->fn, fn, sizeof fn);
      pthread_mutex_lock(&a->mu);
      bool handed = ddp__rpc_handoff_locked(a, c);
      if (!handed) ddp__rpc_enqueue_locked(a, &call->task);
      pthread_mutex_unlock(&a->mu);
      if (handed) {
        /* Another thread reads c now: serve here, without a wake-up. */
        ddp__rpc_serve(a, call);
        return true;
      }
    } else {
      ddp__rpc_deliver(a, c->rank, h.call_id, h.kind == DDP__RPC_REPLY ? DDP_OK : (ddp_status)h.status, b);
    }
  }
  pthread_mutex_lock(&a->mu);
  bool stopping = a->state == DDP__RPC_STOPPING;
  pthread_mutex_unlock(&a->mu);
  if (!stopping) ddp__rpc_conn_lost(c, why);
  return false;
}

ddp_status ddp__rpc_conn_prepare(ddp__rpc_conn *c) {
  c->rbuf = ddp_alloc(RBUF_BYTES);
  if (!c->rbuf) return ddp_error(DDP_ERR_NOMEM, "rpc: cannot allocate a read buffer");
  c->rpos = c->rlen = 0;
  return DDP_OK;
}
