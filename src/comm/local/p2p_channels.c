/* The local backend's point to point: a channel per ordered pair of ranks in
 * the region, holding DDP__LOCAL_P2P_SLOTS message descriptors used in turn
 * (message id % slots). A message of up to DDP__LOCAL_P2P_INLINE bytes is
 * copied into its descriptor and the send returns at once (so exchanges
 * where both sides send first work, as over gloo); a bigger one is read by
 * the receiver straight from the sender's buffer and the send returns once
 * it has been (or, where cross-memory attach is not permitted, sent eagerly
 * in descriptor-sized pieces). The receiver takes the oldest message with its tag, so
 * messages are matched in order per (peer, tag). */
#include <string.h>

#include "comm/local/local.h"

static ddp__local_backend *as_local(ddp__backend *b) { return (ddp__local_backend *)b; }

/* Descriptor kinds (is_inline). */
enum {
  BY_ADDRESS = 0, /* the receiver reads the sender's buffer */
  INLINE = 1,     /* the whole message is in the descriptor */
  PIECES = 2,     /* first piece of a message sent in pieces; bytes: the total */
  PIECE = 3,      /* a later piece: never matched by itself */
};

/* Posts one descriptor (waiting for its slot to be free). */
static ddp_status post_one(ddp__local_backend *b, const ddp__op_ctx *ctx, int dst, uint32_t kind,
                           uint64_t total, const void *data, size_t data_bytes, uint64_t *id_out) {
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, b->rank, dst);
  uint64_t id = b->p2p_next_send[dst]++;
  ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
  /* The descriptor's previous message (id - slots) must have been received. */
  if (id >= DDP__LOCAL_P2P_SLOTS)
    DDP_TRY(ddp__local_wait(b, ctx, &s->consumed, id + 1 - DDP__LOCAL_P2P_SLOTS, dst));
  s->tag = ctx ? ctx->tag : 0;
  s->bytes = total;
  s->is_inline = kind;
  s->addr = kind == BY_ADDRESS ? (uint64_t)(uintptr_t)data : 0;
  if (kind != BY_ADDRESS && data_bytes) memcpy(s->data, data, data_bytes);
  ddp__local_post(b, &s->posted, id + 1);
  *id_out = id;
  return DDP_OK;
}

ddp_status ddp__local_send(ddp__backend *base, const ddp__op_ctx *ctx, const void *buf,
                           size_t bytes, int dst) {
  ddp__local_backend *b = as_local(base);
  DDP_TRY(ddp__local_check_failed(b, ctx));
  ddp__local_count(b, bytes);
  uint64_t id;
  if (bytes <= DDP__LOCAL_P2P_INLINE) return post_one(b, ctx, dst, INLINE, bytes, buf, bytes, &id);
  if (!b->mem->can_read_peers) {
    /* Eagerly, in descriptor-sized pieces with consecutive ids. */
    for (size_t at = 0; at < bytes; at += DDP__LOCAL_P2P_INLINE) {
      size_t len = bytes - at < DDP__LOCAL_P2P_INLINE ? bytes - at : DDP__LOCAL_P2P_INLINE;
      DDP_TRY(post_one(b, ctx, dst, at == 0 ? PIECES : PIECE, bytes, (const char *)buf + at, len,
                       &id));
    }
    return DDP_OK;
  }
  DDP_TRY(post_one(b, ctx, dst, BY_ADDRESS, bytes, buf, 0, &id));
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, b->rank, dst);
  return ddp__local_wait(b, ctx, &ch->slot[id % DDP__LOCAL_P2P_SLOTS].consumed, id + 1, dst);
}

/* Receives the pieces after the first (ids first + 1 ...) into buf (NULL:
 * drops them). */
static ddp_status recv_pieces(ddp__local_backend *b, const ddp__op_ctx *ctx, int src,
                              uint64_t first, char *buf, size_t bytes) {
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, src, b->rank);
  uint64_t id = first + 1;
  for (size_t at = DDP__LOCAL_P2P_INLINE; at < bytes; at += DDP__LOCAL_P2P_INLINE, id++) {
    ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
    DDP_TRY(ddp__local_wait(b, ctx, &s->posted, id + 1, src));
    size_t len = bytes - at < DDP__LOCAL_P2P_INLINE ? bytes - at : DDP__LOCAL_P2P_INLINE;
    if (buf) memcpy(buf + at, s->data, len);
    ddp__local_post(b, &s->consumed, id + 1);
  }
  return DDP_OK;
}

ddp_status ddp__local_recv(ddp__backend *base, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                           int src) {
  ddp__local_backend *b = as_local(base);
  DDP_TRY(ddp__local_check_failed(b, ctx));
  ddp__local_count(b, bytes);
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, src, b->rank);
  int tag = ctx ? ctx->tag : 0;
  uint64_t first = b->p2p_next_recv[src];
  for (uint64_t id = first;; id++) {
    if (id >= first + DDP__LOCAL_P2P_SLOTS)
      return ddp__local_fail(
          b, ctx,
          ddp_error(DDP_ERR_STATE,
                    "%s #%llu: recv from rank %d with tag %d: the %u messages before it, with "
                    "other tags, have not been received (receive them first)",
                    ctx && ctx->op ? ctx->op : "recv", (unsigned long long)(ctx ? ctx->seq : 0),
                    ddp__local_group_rank(b, src), tag, DDP__LOCAL_P2P_SLOTS));
    ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
    if (atomic_load_explicit(&s->consumed.value, memory_order_acquire) >= id + 1) continue;
    DDP_TRY(ddp__local_wait(b, ctx, &s->posted, id + 1, src));
    if (s->tag != tag || s->is_inline == PIECE) continue;
    uint32_t kind = s->is_inline;
    uint64_t sent = s->bytes;
    ddp_status st = DDP_OK;
    if (sent != bytes) {
      st = ddp_error(DDP_ERR_INVALID,
                     "%s #%llu: recv of %zu bytes from rank %d with tag %d matched a send of "
                     "%llu bytes",
                     ctx && ctx->op ? ctx->op : "recv", (unsigned long long)(ctx ? ctx->seq : 0),
                     bytes, ddp__local_group_rank(b, src), tag, (unsigned long long)sent);
      if (kind == PIECES) {
        /* Take the pieces anyway, so later messages can be received. */
        ddp__local_post(b, &s->consumed, id + 1);
        ddp_status drained = recv_pieces(b, ctx, src, id, NULL, sent);
        if (drained != DDP_OK) st = drained;
      }
    } else if (kind == INLINE) {
      if (bytes) memcpy(buf, s->data, bytes);
    } else if (kind == PIECES) {
      memcpy(buf, s->data, DDP__LOCAL_P2P_INLINE);
      ddp__local_post(b, &s->consumed, id + 1);
      st = recv_pieces(b, ctx, src, id, buf, bytes);
    } else {
      st = b->mem->ops->read(b->mem, src, s->addr, buf, bytes);
      if (st != DDP_OK) {
        b->blame = ddp__local_group_rank(b, src);
        st = ddp_error_wrap(st, "%s #%llu: rank %d", ctx && ctx->op ? ctx->op : "recv",
                            (unsigned long long)(ctx ? ctx->seq : 0), b->blame);
      }
    }
    if (kind != PIECES) ddp__local_post(b, &s->consumed, id + 1);
    /* Advance past every message already taken. */
    uint64_t next = b->p2p_next_recv[src];
    while (atomic_load_explicit(&ch->slot[next % DDP__LOCAL_P2P_SLOTS].consumed.value,
                                memory_order_acquire) >= next + 1)
      next++;
    b->p2p_next_recv[src] = next;
    return st == DDP_OK ? DDP_OK : ddp__local_fail(b, ctx, st);
  }
}

/* ---- The point-to-point lane ------------------------------------------------
 * The same channels and descriptors, driven without blocking: every call
 * moves each pending request as far as it can go now. A send takes its
 * message ids in posting order per destination (a later send to the same
 * rank waits, within the round, until every earlier one has posted all its
 * descriptors); a message sent by address completes when the receiver has
 * consumed it, and meanwhile later sends post theirs (up to the channel's
 * DDP__LOCAL_P2P_SLOTS in flight). A receive takes the oldest posted,
 * unconsumed message of its tag from its source, so receives from one rank
 * match in order per tag, and a receive with a tag whose message is not in
 * the channel yet holds up no other. The lane touches only the channels,
 * the message counters and its doorbell (never the collectives' state), so
 * it runs while a collective does. */

/* Per request, in ddp__p2p_req.state. */
typedef struct lane_state {
  uint64_t id;      /* send by address: its descriptor; pieces: the next id to post or take */
  size_t at;        /* pieces: bytes posted / received so far */
  uint32_t phase;   /* LANE_* */
} lane_state;
_Static_assert(sizeof(lane_state) <= sizeof(((ddp__p2p_req *)0)->state), "lane state fits");

enum {
  LANE_NEW = 0,
  LANE_POSTED = 1,  /* send by address: waits for consumed */
  LANE_PIECES = 2,  /* send or receive in pieces, part way */
};

/* How often the lane asks whether peer processes still exist while it
 * waits (a dead peer's request fails within that plus a wait slice). */
#define LANE_LIVENESS_NS (20 * 1000000LL)

static lane_state *state_of(ddp__p2p_req *r) { return (lane_state *)(void *)r->state; }

/* Whether the descriptor of message id towards dst is free for reuse. */
static bool slot_free(ddp__local_p2p_chan *ch, uint64_t id) {
  if (id < DDP__LOCAL_P2P_SLOTS) return true;
  return atomic_load_explicit(&ch->slot[id % DDP__LOCAL_P2P_SLOTS].consumed.value,
                              memory_order_acquire) >= id + 1 - DDP__LOCAL_P2P_SLOTS;
}

/* Fills and posts descriptor `id` towards dst (its slot is free). */
static void lane_post(ddp__local_backend *b, int dst, uint64_t id, uint32_t kind, int tag,
                      uint64_t total, const void *data, size_t data_bytes) {
  ddp__local_p2p_slot *s = &ddp__local_chan_of(b->reg, b->rank, dst)->slot[id % DDP__LOCAL_P2P_SLOTS];
  s->tag = tag;
  s->bytes = total;
  s->is_inline = kind;
  s->addr = kind == BY_ADDRESS ? (uint64_t)(uintptr_t)data : 0;
  if (kind != BY_ADDRESS && data_bytes) memcpy(s->data, data, data_bytes);
  atomic_store_explicit(&s->posted.value, id + 1, memory_order_release);
}

static void lane_count(ddp__local_backend *b, size_t bytes) {
  atomic_store_explicit(&b->p2p_moved,
                        atomic_load_explicit(&b->p2p_moved, memory_order_relaxed) + bytes,
                        memory_order_relaxed);
}

/* Moves send r as far as it goes; true when it progressed. */
static bool lane_send(ddp__local_backend *b, ddp__p2p_req *r, bool *rung) {
  int dst = r->peer;
  lane_state *ls = state_of(r);
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, b->rank, dst);
  if (ls->phase == LANE_POSTED) {
    if (atomic_load_explicit(&ch->slot[ls->id % DDP__LOCAL_P2P_SLOTS].consumed.value,
                             memory_order_acquire) < ls->id + 1)
      return false;
    r->finished = true;
    return true;
  }
  if (b->p2p_send_held[dst]) return false;
  bool moved = false;
  if (ls->phase == LANE_NEW && (r->bytes <= DDP__LOCAL_P2P_INLINE || b->mem->can_read_peers)) {
    uint64_t id = b->p2p_next_send[dst];
    if (!slot_free(ch, id)) {
      b->p2p_send_held[dst] = 1;
      return false;
    }
    b->p2p_next_send[dst]++;
    bool in = r->bytes <= DDP__LOCAL_P2P_INLINE;
    lane_post(b, dst, id, in ? INLINE : BY_ADDRESS, r->tag, r->bytes, r->buf, in ? r->bytes : 0);
    lane_count(b, r->bytes);
    *rung = true;
    if (in) {
      r->finished = true;
    } else {
      ls->phase = LANE_POSTED;
      ls->id = id;
    }
    return true;
  }
  /* Eagerly in descriptor-sized pieces (no cross-memory attach). */
  if (ls->phase == LANE_NEW) {
    ls->phase = LANE_PIECES;
    lane_count(b, r->bytes);
  }
  while (ls->at < r->bytes) {
    uint64_t id = b->p2p_next_send[dst];
    if (!slot_free(ch, id)) break;
    b->p2p_next_send[dst]++;
    size_t len = r->bytes - ls->at < DDP__LOCAL_P2P_INLINE ? r->bytes - ls->at : DDP__LOCAL_P2P_INLINE;
    lane_post(b, dst, id, ls->at == 0 ? PIECES : PIECE, r->tag, r->bytes, (const char *)r->buf + ls->at, len);
    ls->at += len;
    moved = *rung = true;
  }
  if (ls->at < r->bytes)
    b->p2p_send_held[dst] = 1; /* later sends to dst take ids after these pieces */
  else
    r->finished = true;
  return moved;
}

static ddp_status size_mismatch(ddp__local_backend *b, const ddp__p2p_req *r, uint64_t sent) {
  return ddp_error(DDP_ERR_INVALID,
                   "rank %d sent %llu bytes with tag %d where this rank receives %zu (do the ranks "
                   "post matching sends and receives?)",
                   ddp__local_group_rank(b, r->peer), (unsigned long long)sent, r->tag, r->bytes);
}

/* Moves the oldest message id not yet received from src past every message
 * already taken (by any receive, in whole or in pieces), so the window of
 * DDP__LOCAL_P2P_SLOTS ids a receive scans starts at the first one left. */
static void advance_recv(ddp__local_backend *b, int src) {
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, src, b->rank);
  uint64_t next = b->p2p_next_recv[src];
  for (;;) {
    ddp__local_p2p_slot *s = &ch->slot[next % DDP__LOCAL_P2P_SLOTS];
    if (atomic_load_explicit(&s->posted.value, memory_order_acquire) < next + 1 ||
        atomic_load_explicit(&s->consumed.value, memory_order_acquire) < next + 1)
      break;
    next++;
  }
  b->p2p_next_recv[src] = next;
}

/* Takes posted pieces of receive r (the message's pieces have consecutive
 * ids from ls->id). */
static bool lane_take_pieces(ddp__local_backend *b, ddp__p2p_req *r, bool *rung) {
  lane_state *ls = state_of(r);
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, r->peer, b->rank);
  bool moved = false;
  while (ls->at < r->bytes) {
    ddp__local_p2p_slot *s = &ch->slot[ls->id % DDP__LOCAL_P2P_SLOTS];
    if (atomic_load_explicit(&s->posted.value, memory_order_acquire) < ls->id + 1) break;
    size_t len = r->bytes - ls->at < DDP__LOCAL_P2P_INLINE ? r->bytes - ls->at : DDP__LOCAL_P2P_INLINE;
    memcpy((char *)r->buf + ls->at, s->data, len);
    ls->at += len;
    atomic_store_explicit(&s->consumed.value, ls->id + 1, memory_order_release);
    ls->id++;
    moved = *rung = true;
  }
  if (ls->at >= r->bytes) r->finished = true;
  if (moved) advance_recv(b, r->peer);
  return moved;
}

/* Moves receive r as far as it goes; true when it progressed. */
static ddp_status lane_recv(ddp__local_backend *b, ddp__p2p_req *const *reqs, int index,
                           bool *moved, bool *rung) {
  ddp__p2p_req *r = reqs[index];
  int src = r->peer;
  lane_state *ls = state_of(r);
  if (ls->phase == LANE_PIECES) {
    *moved = lane_take_pieces(b, r, rung) || *moved;
    if (!r->finished) b->p2p_recv_held[src] = 1;
    return DDP_OK;
  }
  if (b->p2p_recv_held[src]) return DDP_OK;
  /* Messages of one (source, tag) go to receives in posting order: while an
   * earlier receive of the pair and tag is still unmatched in this round
   * (its message was not there when it looked, though it may be by now), a
   * later one must not take that message. */
  for (int j = 0; j < index; j++) {
    ddp__p2p_req *e = reqs[j];
    if (!e->is_send && !e->finished && e->peer == src && e->tag == r->tag &&
        state_of(e)->phase == LANE_NEW)
      return DDP_OK;
  }
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, src, b->rank);
  uint64_t first = b->p2p_next_recv[src];
  for (uint64_t id = first; id < first + DDP__LOCAL_P2P_SLOTS; id++) {
    ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
    /* Ids are posted in order: nothing past an unposted one. */
    if (atomic_load_explicit(&s->posted.value, memory_order_acquire) < id + 1) return DDP_OK;
    if (atomic_load_explicit(&s->consumed.value, memory_order_relaxed) >= id + 1) continue;
    if (s->tag != r->tag || s->is_inline == PIECE) continue;
    uint32_t kind = s->is_inline;
    if (s->bytes != r->bytes) return size_mismatch(b, r, s->bytes);
    ddp_status st = DDP_OK;
    if (kind == INLINE) {
      if (r->bytes) memcpy(r->buf, s->data, r->bytes);
    } else if (kind == BY_ADDRESS) {
      st = b->mem->ops->read(b->mem, src, s->addr, r->buf, r->bytes);
      if (st != DDP_OK) return ddp_error_wrap(st, "reading rank %d's message", ddp__local_group_rank(b, src));
    }
    lane_count(b, r->bytes);
    *moved = *rung = true;
    if (kind == PIECES) {
      ls->phase = LANE_PIECES;
      ls->id = id;
      lane_take_pieces(b, r, rung);
      if (!r->finished) b->p2p_recv_held[src] = 1;
    } else {
      atomic_store_explicit(&s->consumed.value, id + 1, memory_order_release);
      r->finished = true;
    }
    advance_recv(b, src);
    return DDP_OK;
  }
  return DDP_OK;
}

static const char *lane_host(const ddp__local_backend *b, int q) {
  return ddp__local_group_host(b, ddp__local_group_rank(b, q));
}

/* A pending request's peer that can no longer answer, or a dead process
 * anywhere in the group (the group is broken then: every pending request
 * fails, naming the dead rank). */
static ddp_status lane_check_peers(ddp__local_backend *b, ddp__p2p_req *const *reqs, int n,
                                   int *culprit) {
  if (b->mem->ops->find_dead) {
    char why[128] = "";
    int dead = b->mem->ops->find_dead(b->mem, why, sizeof why);
    if (dead >= 0) {
      *culprit = -1;
      for (int i = 0; i < n && *culprit < 0; i++)
        if (reqs[i]->peer == dead) *culprit = i;
      if (*culprit < 0) *culprit = 0;
      return ddp_error(DDP_ERR_PEER, "rank %d (%s) died (%s)", ddp__local_group_rank(b, dead),
                       lane_host(b, dead), why);
    }
  }
  return DDP_OK;
}

/* Requests' peers are group ranks; the channels are indexed by this
 * backend's ranks (the same unless the backend serves one host of a larger
 * group: hier/hier.c translates before calling). */
ddp_status ddp__local_p2p_progress(ddp__backend *base, const ddp__op_ctx *ctx,
                                   ddp__p2p_req *const *reqs, int n, int64_t wait_ns, int *culprit) {
  ddp__local_backend *b = as_local(base);
  *culprit = -1;
  ddp__local_word *bell = &ddp__local_my_ctl(b)->p2p_bell;
  for (int round = 0;; round++) {
    uint32_t seen = atomic_load(&bell->wake);
    memset(b->p2p_send_held, 0, (size_t)b->size);
    memset(b->p2p_recv_held, 0, (size_t)b->size);
    bool moved = false;
    int left = 0;
    for (int i = 0; i < n; i++) {
      ddp__p2p_req *r = reqs[i];
      if (r->finished) continue;
      bool rung = false;
      if (r->is_send) {
        moved = lane_send(b, r, &rung) || moved;
      } else {
        ddp_status st = lane_recv(b, reqs, i, &moved, &rung);
        if (st != DDP_OK) {
          *culprit = i;
          return st;
        }
      }
      if (rung) ddp__local_bell_ring(b, r->peer);
      if (!r->finished) left++;
    }
    if (left == 0 || moved) return DDP_OK;
    /* Nothing moved: peers' state, then sleep on the doorbell. */
    int64_t now = ddp_time_ns();
    if (now >= b->p2p_next_liveness) {
      b->p2p_next_liveness = now + LANE_LIVENESS_NS;
      DDP_TRY(lane_check_peers(b, reqs, n, culprit));
      for (int i = 0; i < n; i++) {
        ddp__p2p_req *r = reqs[i];
        if (r->finished) continue;
        ddp__local_ctl *c = ddp__local_ctl_of(b->reg, r->peer);
        uint32_t state = atomic_load(&c->state);
        if (state == DDP__LOCAL_ACTIVE) continue;
        *culprit = i;
        int32_t blame = atomic_load(&c->blame);
        if (state == DDP__LOCAL_FAILED && ddp__local_blame_valid(b, blame))
          return ddp_error(DDP_ERR_PEER, "rank %d (%s) died or failed (reported by rank %d)", blame,
                           ddp__local_group_host(b, blame), ddp__local_group_rank(b, r->peer));
        return ddp_error(DDP_ERR_PEER, "rank %d (%s) %s", ddp__local_group_rank(b, r->peer),
                         lane_host(b, r->peer),
                         state == DDP__LOCAL_ABORTED ? "aborted its group"
                         : state == DDP__LOCAL_LEFT  ? "left the group (destroyed it) first"
                                                     : "failed");
      }
    }
    if (round > 0 || wait_ns <= 0) return DDP_OK;
    if (atomic_load(&b->aborted) || (ctx->aborted && atomic_load(ctx->aborted))) return DDP_OK;
    int64_t slice = wait_ns < LANE_LIVENESS_NS ? wait_ns : LANE_LIVENESS_NS;
    ddp__local_bell_wait(b, seen, slice);
  }
}

void ddp__local_p2p_wake(ddp__backend *base) {
  ddp__local_backend *b = as_local(base);
  ddp__local_bell_ring(b, b->rank);
}
