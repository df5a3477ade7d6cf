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

#include "comm/local.h"

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
