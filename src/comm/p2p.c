/* Point-to-point: send, recv and their async forms. They go through the
 * group's queue like collectives (one op at a time on the backend, in
 * submission order) with a sequence counter of their own, so that collective
 * numbers agree across ranks whatever the point-to-point traffic. */
#include "comm/comm_internal.h"

static ddp_status do_p2p(ddp_process_group *pg, ddp__op_kind kind, const char *name, void *buf,
                         size_t count, ddp_dtype dtype, int peer, int tag, ddp_work **work) {
  ddp__call c = {name, false}; /* isend / irecv check their work pointer themselves */
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, 1, work));
  const char *peer_name = kind == DDP__OP_SEND ? "dst" : "src";
  if (peer < 0 || peer >= pg->size)
    return ddp_error(DDP_ERR_INVALID, "%s: %s %d is not a rank of the group (size %d)", name,
                     peer_name, peer, pg->size);
  if (peer == pg->rank)
    return ddp_error(DDP_ERR_INVALID, "%s: %s %d is this rank (a rank cannot %s itself)", name,
                     peer_name, peer, kind == DDP__OP_SEND ? "send to" : "receive from");
  DDP_TRY(ddp__check_buf(&c, "buf", buf, count));
  ddp__op_args a = {.kind = kind, .count = count, .dtype = dtype, .root = peer, .tag = tag};
  if (kind == DDP__OP_SEND)
    a.send = buf;
  else
    a.buf = buf;
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_send(ddp_process_group *pg, const void *buf, size_t count, ddp_dtype dtype,
                    int dst, int tag) {
  return do_p2p(pg, DDP__OP_SEND, "send", (void *)buf, count, dtype, dst, tag, NULL);
}

ddp_status ddp_recv(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype, int src,
                    int tag) {
  return do_p2p(pg, DDP__OP_RECV, "recv", buf, count, dtype, src, tag, NULL);
}

ddp_status ddp_isend(ddp_process_group *pg, const void *buf, size_t count, ddp_dtype dtype,
                     int dst, int tag, ddp_work **work) {
  if (!work) return ddp_error(DDP_ERR_INVALID, "isend: work is NULL");
  return do_p2p(pg, DDP__OP_SEND, "isend", (void *)buf, count, dtype, dst, tag, work);
}

ddp_status ddp_irecv(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype, int src,
                     int tag, ddp_work **work) {
  if (!work) return ddp_error(DDP_ERR_INVALID, "irecv: work is NULL");
  return do_p2p(pg, DDP__OP_RECV, "irecv", buf, count, dtype, src, tag, work);
}
