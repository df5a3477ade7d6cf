/* The local backend's point to point: a channel per ordered pair of ranks in
 * the region, holding DDP__LOCAL_P2P_SLOTS message descriptors used in turn
 * (message id % slots). A message of up to DDP__LOCAL_P2P_INLINE bytes is
 * copied into its descriptor and the send returns at once (so exchanges
 * where both sides send first work, as over gloo); a bigger one is read by
 * the receiver straight from the sender's buffer and the send returns once
 * it has been. The receiver takes the oldest message with its tag, so
 * messages are matched in order per (peer, tag). */
#include <string.h>

#include "comm/local.h"

static ddp__local_backend *as_local(ddp__backend *b) { return (ddp__local_backend *)b; }

ddp_status ddp__local_send(ddp__backend *base, const ddp__op_ctx *ctx, const void *buf,
                           size_t bytes, int dst) {
  ddp__local_backend *b = as_local(base);
  DDP_TRY(ddp__local_check_failed(b));
  ddp__local_p2p_chan *ch = ddp__local_chan_of(b->reg, b->rank, dst);
  uint64_t id = b->p2p_next_send[dst]++;
  ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
  /* The descriptor's previous message (id - slots) must have been received. */
  if (id >= DDP__LOCAL_P2P_SLOTS)
    DDP_TRY(ddp__local_wait(b, ctx, &s->consumed, id + 1 - DDP__LOCAL_P2P_SLOTS, dst));
  s->tag = ctx ? ctx->tag : 0;
  s->bytes = bytes;
  s->is_inline = bytes <= DDP__LOCAL_P2P_INLINE;
  if (s->is_inline) {
    if (bytes) memcpy(s->data, buf, bytes);
    s->addr = 0;
  } else {
    s->addr = (uint64_t)(uintptr_t)buf;
  }
  ddp__local_post(b, &s->posted, id + 1);
  if (s->is_inline) return DDP_OK;
  return ddp__local_wait(b, ctx, &s->consumed, id + 1, dst);
}

ddp_status ddp__local_recv(ddp__backend *base, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                           int src) {
  ddp__local_backend *b = as_local(base);
  DDP_TRY(ddp__local_check_failed(b));
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
                    src, tag, DDP__LOCAL_P2P_SLOTS));
    ddp__local_p2p_slot *s = &ch->slot[id % DDP__LOCAL_P2P_SLOTS];
    if (atomic_load_explicit(&s->consumed.value, memory_order_acquire) >= id + 1) continue;
    DDP_TRY(ddp__local_wait(b, ctx, &s->posted, id + 1, src));
    if (s->tag != tag) continue;
    ddp_status st = DDP_OK;
    if (s->bytes != bytes) {
      st = ddp_error(DDP_ERR_INVALID,
                     "%s #%llu: recv of %zu bytes from rank %d with tag %d matched a send of "
                     "%llu bytes",
                     ctx && ctx->op ? ctx->op : "recv", (unsigned long long)(ctx ? ctx->seq : 0),
                     bytes, src, tag, (unsigned long long)s->bytes);
    } else if (s->is_inline) {
      if (bytes) memcpy(buf, s->data, bytes);
    } else {
      st = b->mem->ops->read(b->mem, src, s->addr, buf, bytes);
      if (st != DDP_OK) {
        b->blame = src;
        st = ddp_error_wrap(st, "%s #%llu: rank %d", ctx && ctx->op ? ctx->op : "recv",
                            (unsigned long long)(ctx ? ctx->seq : 0), src);
      }
    }
    ddp__local_post(b, &s->consumed, id + 1);
    /* Advance past every message already taken. */
    uint64_t next = b->p2p_next_recv[src];
    while (atomic_load_explicit(&ch->slot[next % DDP__LOCAL_P2P_SLOTS].consumed.value,
                                memory_order_acquire) >= next + 1)
      next++;
    b->p2p_next_recv[src] = next;
    return st == DDP_OK ? DDP_OK : ddp__local_fail(b, ctx, st);
  }
}
