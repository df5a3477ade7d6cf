/* The store server's requests: what each one does to the table and replies,
 * and the waiters behind blocking get / wait / multi_get. A waiter is linked
 * from each missing key's table entry and counts the keys still missing; a
 * write to a key decrements its waiters' counts and answers those that reach
 * zero. Waiters time out here, at the deadline the client sent (the client's
 * own deadline is a safety net). The connections are server.c's. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "store/server_impl.h"
#include "store/store_impl.h"

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
  uint8_t code = st == DDP_ERR_FORMAT  ? DDP__WIRE_NOT_INTEGER
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
                            "the %u values total %" PRIu64
                            " bytes, over the message limit of %" PRIu64,
                            n, total, s->limits.max_message_bytes);
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
      int n =
          snprintf(buf + at, cap - at, "%s\"%.*s\"", shown ? ", " : "",
                   (int)(w->keys[i].len > 64 ? 64 : w->keys[i].len), (const char *)w->keys[i].data);
      if (n > 0) at += (size_t)n < cap - at ? (size_t)n : cap - at - 1;
      shown++;
    }
  }
  if (missing > shown && at + 24 < cap)
    snprintf(buf + at, cap - at, " and %zu more", missing - shown);
}

/* Ends a waiter (reply already queued) and lets its client go on. */
static void waiter_finish(ddp_store_server *s, waiter *w) {
  client *c = w->c;
  waiter_unlink_all(s, w);
  waiter_free(s, w);
  c->waiter = NULL;
  if (c->in.len) ddp__store_server_resume(s, c);
  ddp__store_server_flush(s, c);
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
  ddp__store_server_set_deadline(s, w->deadline_ns);
  if (waiter_link_missing(s, w) < 0) {
    ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "server out of memory");
    waiter_finish(s, w);
  }
}

void ddp__store_server_cancel_waiter(ddp_store_server *s, waiter *w) {
  waiter_unlink_all(s, w);
  waiter_free(s, w);
}

void ddp__store_server_expire_waiters(ddp_store_server *s, int64_t now) {
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
        ddp__store_encode_error(&w->c->out, DDP__WIRE_TIMEOUT, "timed out after %s (missing %s)", t,
                                missing);
      waiter_finish(s, w);
    } else if (w->deadline_ns > now) {
      ddp__store_server_set_deadline(s, w->deadline_ns);
    }
    w = next;
  }
}

/* ---- Watches -------------------------------------------------------------
 * A watch connection's keys are linked from their entries (a placeholder
 * entry stays while watched). Every change appends a notification to each
 * watcher's output, which goes out at the end of the request; what the socket
 * does not take waits in the client's output, counted in its ring. A watcher
 * that lets max_watch_pending notifications (or max_watch_pending_bytes)
 * wait is dropped at the next change: its links go, an error frame follows
 * what it was sent, and the connection closes once that is read (or after
 * the handshake timeout). Nothing here blocks and no watcher has a thread. */

static void watch_unlink_all(ddp_store_server *s, watch *w, const ddp__kv_entry *keep) {
  for (uint32_t i = 0; i < w->num_keys; i++) {
    wlink *l = &w->links[i];
    ddp__kv_entry *e = l->entry;
    if (!e) continue;
    if (l->prev) l->prev->next = l->next;
    else e->watchers = l->next;
    if (l->next) l->next->prev = l->prev;
    l->prev = l->next = NULL;
    l->entry = NULL;
    if (e != keep) ddp__kv_release(&s->table, e); /* `keep` is being iterated */
  }
}

static void watch_free(ddp_store_server *s, watch *w, const ddp__kv_entry *keep) {
  watch_unlink_all(s, w, keep);
  w->c->watch = NULL;
  STAT_ADD(s, watches, (uint64_t)-1);
  ddp_free(w); /* links and ring share the allocation */
}

void ddp__store_server_cancel_watch(ddp_store_server *s, watch *w) { watch_free(s, w, NULL); }

void ddp__store_server_watch_sent(client *c) {
  watch *w = c->watch;
  while (w->count && w->ends[w->head] <= c->sent_total) {
    w->head = w->head + 1 == c->watch_cap ? 0 : w->head + 1;
    w->count--;
  }
}

static void queue_flush(ddp_store_server *s, client *c) {
  if (c->flush_queued) return;
  c->flush_queued = 1;
  c->flush_next = s->flush_list;
  s->flush_list = c;
}

/* Sends what the watchers were given (at the end of each request). */
static void flush_watchers(ddp_store_server *s) {
  while (s->flush_list) {
    client *c = s->flush_list;
    s->flush_list = c->flush_next;
    c->flush_queued = 0;
    if (!c->dead) ddp__store_server_flush(s, c);
  }
}

/* The watch fell behind: an error after what it was sent, and it goes. */
static void watch_overflow(ddp_store_server *s, watch *w, const ddp__kv_entry *changed) {
  client *c = w->c;
  uint64_t pending = c->out.len - c->out_sent;
  ddp__store_encode_error(
      &c->out, DDP__WIRE_WATCH_DROPPED,
      "watch dropped by the store: it did not read its changes, and a change of \"%.*s\" came "
      "while %u notifications (%" PRIu64 " bytes) waited for it (the bound is %u notifications or "
      "%" PRIu64 " bytes, ddp_store_limits.max_watch_pending[_bytes]); read faster or open a new "
      "watch",
      (int)(changed->key_len > 64 ? 64 : changed->key_len), changed->key, w->count, pending,
      s->limits.max_watch_pending, s->limits.max_watch_pending_bytes);
  DDP_INFO("store server %s: client %s: watch of \"%.*s\" dropped past its bound (%u pending)",
           s->address, c->addr, (int)(changed->key_len > 64 ? 64 : changed->key_len), changed->key,
           w->count);
  watch_free(s, w, changed);
  STAT_ADD(s, watches_dropped, 1);
  c->closing = 1;
  c->closing_deadline_ns = ddp_time_ns() + s->handshake_timeout_ms * 1000000LL;
  ddp__store_server_set_deadline(s, c->closing_deadline_ns);
  queue_flush(s, c);
}

/* Tells every watcher of e about its change (kind 1 set, 2 delete). */
static void notify(ddp_store_server *s, ddp__kv_entry *e, uint8_t kind) {
  if (!e) return;
  wlink *l = e->watchers;
  while (l) {
    wlink *next = l->next; /* an overflow unlinks l (and only l from e) */
    watch *w = l->watch;
    client *c = w->c;
    uint64_t pending = c->out.len - c->out_sent;
    if (w->count >= s->limits.max_watch_pending || pending > s->limits.max_watch_pending_bytes) {
      watch_overflow(s, w, e);
      l = next;
      continue;
    }
    size_t at = ddp__buf_frame_begin(&c->out);
    ddp__buf_reserve(&c->out, 32 + e->key_len + (kind == 1 ? e->value_len : 0));
    ddp__buf_u8(&c->out, DDP__WIRE_EVENT);
    ddp__buf_bytes(&c->out, e->key, e->key_len);
    ddp__buf_u8(&c->out, kind);
    ddp__buf_i64(&c->out, (int64_t)++w->seq);
    ddp__buf_bytes(&c->out, kind == 1 ? e->value : NULL, kind == 1 ? e->value_len : 0);
    ddp__buf_frame_end(&c->out, at);
    uint32_t tail = w->head + w->count;
    if (tail >= c->watch_cap) tail -= c->watch_cap;
    w->ends[tail] = c->sent_total + (c->out.len - c->out_sent);
    w->count++;
    queue_flush(s, c); /* out.failed is seen (and the client dropped) there */
    l = next;
  }
}

/* WATCH: links the connection's keys and replies with their state now. */
static void do_watch(ddp_store_server *s, client *c, const ddp__store_request *req) {
  uint32_t n = req->num_keys;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < i; j++)
      if (req->keys[i].len == req->keys[j].len &&
          !memcmp(req->keys[i].data, req->keys[j].data, req->keys[i].len)) {
        ddp__store_server_reject(s, c, DDP__WIRE_MALFORMED, "watch names key %u twice", i);
        return;
      }
  uint64_t total = 9;
  for (uint32_t i = 0; i < n; i++) {
    const ddp__kv_entry *e = ddp__kv_find(&s->table, (const char *)req->keys[i].data, req->keys[i].len);
    total += 5 + (e && e->has_value ? e->value_len : 0);
  }
  if (total > s->limits.max_message_bytes) {
    ddp__store_encode_error(&c->out, DDP__WIRE_TOO_LARGE,
                            "the %u watched values total %" PRIu64
                            " bytes, over the message limit of %" PRIu64,
                            n, total, s->limits.max_message_bytes);
    return;
  }
  uint32_t cap = s->limits.max_watch_pending;
  watch *w = ddp_calloc(1, sizeof *w + n * sizeof(wlink) + (size_t)cap * sizeof(uint64_t));
  if (!w) {
    ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "server out of memory");
    return;
  }
  w->c = c;
  w->num_keys = n;
  w->links = (wlink *)(w + 1);
  w->ends = (uint64_t *)(w->links + n);
  c->watch = w;
  c->watch_cap = cap;
  STAT_ADD(s, watches, 1);
  for (uint32_t i = 0; i < n; i++) {
    ddp__kv_entry *e = ddp__kv_intern(&s->table, (const char *)req->keys[i].data, req->keys[i].len);
    if (!e) {
      watch_free(s, w, NULL);
      ddp__store_encode_error(&c->out, DDP__WIRE_FULL, "server out of memory");
      return;
    }
    wlink *l = &w->links[i];
    l->watch = w;
    l->entry = e;
    l->next = e->watchers;
    if (l->next) l->next->prev = l;
    e->watchers = l;
  }
  size_t at = ddp__buf_frame_begin(&c->out);
  ddp__buf_reserve(&c->out, total);
  ddp__buf_u8(&c->out, DDP__WIRE_OK);
  ddp__buf_u32(&c->out, n);
  for (uint32_t i = 0; i < n; i++) {
    const ddp__kv_entry *e = w->links[i].entry;
    ddp__buf_u8(&c->out, (uint8_t)e->has_value);
    ddp__buf_bytes(&c->out, e->has_value ? e->value : NULL, e->has_value ? e->value_len : 0);
  }
  ddp__buf_frame_end(&c->out, at);
}

/* ---- Requests ------------------------------------------------------------ */

static int token_matches(const ddp_store_server *s, ddp__slice t) {
  size_t want = strlen(s->token);
  unsigned diff = (unsigned)(want ^ t.len);
  for (size_t i = 0; i < t.len; i++)
    diff |= (unsigned)(t.data[i] ^ (uint8_t)s->token[i % (want ? want : 1)]);
  return diff == 0;
}

static void do_hello(ddp_store_server *s, client *c, const ddp__store_request *req) {
  if (req->magic != DDP__STORE_MAGIC) {
    ddp__store_server_reject(s, c, DDP__WIRE_VERSION, "not a ddp store client (bad magic 0x%08x)",
                             req->magic);
    return;
  }
  if (req->version != DDP__STORE_VERSION) {
    ddp__store_server_reject(s, c, DDP__WIRE_VERSION,
                             "protocol version %u is not supported (this server speaks %u)",
                             req->version, DDP__STORE_VERSION);
    return;
  }
  if (s->has_token && !token_matches(s, req->key)) {
    ddp__store_server_reject(s, c, DDP__WIRE_AUTH,
                             req->key.len
                                 ? "token refused (DDP_STORE_TOKEN differs from the server's)"
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
  for (ddp__kv_entry *e = ddp__kv_next(&s->table, &b, NULL); e;
       e = ddp__kv_next(&s->table, &b, e)) {
    if (!ddp__kv_entry_matches(e, (const char *)prefix.data, prefix.len)) continue;
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

void ddp__store_server_handle(ddp_store_server *s, client *c, const ddp__store_request *req) {
  STAT_ADD(s, requests, 1);
  if (req->op == DDP__OP_HELLO) {
    if (c->authed)
      ddp__store_server_reject(s, c, DDP__WIRE_STATE, "second hello on one connection");
    else do_hello(s, c, req);
    return;
  }
  if (!c->authed) {
    ddp__store_server_reject(s, c, DDP__WIRE_STATE, "%s before the hello handshake",
                             ddp__store_op_name(req->op));
    return;
  }
  if (c->watch || c->closing) {
    ddp__store_server_reject(s, c, DDP__WIRE_STATE, "%s on a watch connection (it only reads)",
                             ddp__store_op_name(req->op));
    return;
  }
  const char *key = (const char *)req->key.data;
  size_t klen = req->key.len;
  ddp__kv_entry *changed = NULL;
  int silent = 0; /* a change not to report to watchers */
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
      /* add(key, 0) on a key that exists is a read: no change to report. */
      int read_only = req->integer == 0 && key_present(s, req->key);
      st = ddp__kv_add(&s->table, key, klen, req->integer, &result, &changed);
      if (st == DDP_OK) reply_i64(c, result);
      else reply_status(c, st);
      if (read_only) silent = 1;
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
    case DDP__OP_MULTI_GET: start_blocking(s, c, req); break;
    case DDP__OP_CHECK: {
      uint8_t all = 1;
      for (uint32_t i = 0; i < req->num_keys && all; i++)
        all = (uint8_t)key_present(s, req->keys[i]);
      reply_u8(c, all);
      break;
    }
    case DDP__OP_DELETE: {
      int deleted;
      ddp__kv_entry *e = ddp__kv_find(&s->table, key, klen);
      int watched = e && e->watchers; /* then the entry outlives its value */
      ddp__kv_delete(&s->table, key, klen, &deleted);
      s->deletes += (uint64_t)deleted;
      reply_u8(c, (uint8_t)deleted);
      if (deleted && watched) notify(s, e, DDP_STORE_EVENT_DELETE);
      break;
    }
    case DDP__OP_WATCH: do_watch(s, c, req); break;
    case DDP__OP_NUM_KEYS: reply_i64(c, (int64_t)ddp__kv_count_prefix(&s->table, key, klen)); break;
    case DDP__OP_LIST_KEYS: do_list_keys(s, c, req->key); break;
    case DDP__OP_MULTI_SET: {
      /* All or nothing: check room first, so no reader sees half of them. */
      uint64_t need = request_bytes(req);
      if (s->table.max_bytes && s->table.bytes + need > s->table.max_bytes) {
        ddp__store_encode_error(&c->out, DDP__WIRE_FULL,
                                "the store is full (%" PRIu64 " of %" PRIu64 " bytes held)",
                                s->table.bytes, s->table.max_bytes);
        break;
      }
      st = DDP_OK;
      for (uint32_t i = 0; i < req->num_keys && st == DDP_OK; i++) {
        ddp__kv_entry *e = NULL;
        st = ddp__kv_set(&s->table, (const char *)req->keys[i].data, req->keys[i].len,
                         req->values[i].data, req->values[i].len, &e);
        notify(s, e, DDP_STORE_EVENT_SET);
        wake(s, e);
      }
      if (st == DDP_OK) reply_ok(c);
      else reply_status(c, st);
      break;
    }
    case DDP__OP_PING: reply_i64(c, req->integer); break;
    default: DDP_ASSERT(0 && "parser let an unknown opcode through");
  }
  if (!silent) notify(s, changed, DDP_STORE_EVENT_SET);
  wake(s, changed);
  flush_watchers(s);
  STAT_SET(s, keys, s->table.num_values);
}
