/* Point-to-point: send, recv, their async forms and batch_isend_irecv.
 * Argument checks here; everything runs on the group's point-to-point lane
 * (p2p_lane.c), outside the queue of collectives, with a sequence counter
 * of its own, so collective numbers agree across ranks whatever the
 * point-to-point traffic. A backend without a lane (none today but a
 * future one) takes send/recv through the queue, one at a time. What the
 * backend's caps do not list is refused before anything is posted. */
#include <stdio.h>

#include "comm/comm_internal.h"

static ddp_status check_peer(ddp_process_group *pg, const char *name, ddp__op_kind kind, int peer,
                             bool self_ok) {
  const char *peer_name = kind == DDP__OP_SEND ? "dst" : "src";
  if (peer < 0 || peer >= pg->size)
    return ddp_error(DDP_ERR_INVALID, "%s: %s %d is not a rank of the group (size %d)", name,
                     peer_name, peer, pg->size);
  if (peer == pg->rank && !self_ok)
    return ddp_error(DDP_ERR_INVALID, "%s: %s %d is this rank (a rank cannot %s itself)", name,
                     peer_name, peer, kind == DDP__OP_SEND ? "send to" : "receive from");
  return DDP_OK;
}

static ddp_status do_p2p(ddp_process_group *pg, ddp__op_kind kind, const char *name, void *buf,
                         size_t count, ddp_dtype dtype, int peer, int tag, ddp_work **work) {
  ddp__call c = {name, false}; /* isend / irecv check their work pointer themselves */
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, 1, work));
  DDP_TRY(check_peer(pg, name, kind, peer, false));
  DDP_TRY(ddp__check_buf(&c, "buf", buf, count));
  ddp_device device;
  DDP_TRY(ddp__buffers_device(name, NULL, buf, &device));
  DDP_TRY(ddp__caps_check(pg, name, kind, dtype, DDP_REDUCE_SUM, device));
  /* The lane reads and writes host memory: buffers on a GPU (ddp's own
   * backend, staged) go through the queue, one at a time. */
  if (pg->backend->ops->p2p_progress && device.type == DDP_DEVICE_CPU) {
    ddp_p2p_op op = {kind == DDP__OP_SEND ? DDP_P2P_SEND : DDP_P2P_RECV, buf, count, dtype, peer, tag};
    return ddp__p2p_submit(pg, name, &op, 1, work);
  }
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

ddp_status ddp_batch_isend_irecv(ddp_process_group *pg, const ddp_p2p_op *ops, size_t n,
                                 ddp_work **work) {
  static const char name[] = "batch_isend_irecv";
  if (!work) return ddp_error(DDP_ERR_INVALID, "%s: work is NULL", name);
  *work = NULL;
  if (!pg) return ddp_error(DDP_ERR_INVALID, "%s: process group is NULL", name);
  DDP_TRY(ddp__group_check(pg));
  if (!ops && n > 0) return ddp_error(DDP_ERR_INVALID, "%s: ops is NULL with n %zu", name, n);
  /* An engine that groups a batch itself (NCCL) takes it as one operation
   * of the queue, in program order with the collectives; ddp's own
   * backends run it on the point-to-point lane. */
  bool engine = (pg->backend->ops->caps.ops >> DDP__OP_P2P_BATCH & 1u) != 0;
  if (!engine && !pg->backend->ops->p2p_progress && pg->size > 1)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: the %s backend has no point-to-point lane", name,
                     pg->backend->ops->name);
  ddp_device first = DDP_CPU;
  for (size_t i = 0; i < n; i++) {
    const ddp_p2p_op *o = &ops[i];
    char what[48];
    snprintf(what, sizeof what, "%s: ops[%zu]", name, i);
    ddp__call c = {what, false};
    if (o->kind != DDP_P2P_SEND && o->kind != DDP_P2P_RECV)
      return ddp_error(DDP_ERR_INVALID, "%s.kind is %d, not DDP_P2P_SEND or DDP_P2P_RECV", what,
                       (int)o->kind);
    DDP_TRY(ddp__check_common(pg, &c, o->dtype, o->count, 1, NULL));
    DDP_TRY(check_peer(pg, what, o->kind == DDP_P2P_SEND ? DDP__OP_SEND : DDP__OP_RECV, o->peer, true));
    DDP_TRY(ddp__check_buf(&c, "buf", o->buf, o->count));
    ddp_device device;
    DDP_TRY(ddp__buffers_device(what, NULL, o->buf, &device));
    DDP_TRY(ddp__caps_check(pg, what, o->kind == DDP_P2P_SEND ? DDP__OP_SEND : DDP__OP_RECV, o->dtype,
                            DDP_REDUCE_SUM, device));
    if (i == 0) first = device;
    DDP_TRY(ddp__p2p_batch_device_check(name, i, first, device, engine, pg->backend->ops->name));
  }
  if (!engine) return ddp__p2p_submit(pg, name, ops, n, work);
  if (n == 0) { /* nothing to group: a handle already complete, as on the lane */
    ddp_work *w = ddp__work_take(pg);
    if (!w) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for a work handle", name);
    ddp__work_complete(pg, w, DDP_OK);
    *work = w;
    return DDP_OK;
  }
  ddp__op_args a = {.kind = DDP__OP_P2P_BATCH, .count = n, .dtype = ops[0].dtype, .root = -1,
                    .device = first, .batch = ops};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp__p2p_batch_device_check(const char *call, size_t i, ddp_device first,
                                       ddp_device device, bool engine, const char *backend) {
  char a[DDP_DEVICE_STR_BYTES], b[DDP_DEVICE_STR_BYTES];
  if (!engine && device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: ops[%zu]: buffers on %s: the %s backend's batched "
                     "point-to-point takes host memory; send them one by one (isend/irecv) or "
                     "copy them to the host", call, i, ddp_device_str(device, a, sizeof a), backend);
  if (engine && !ddp_device_equal(device, first))
    return ddp_error(DDP_ERR_INVALID, "%s: ops[%zu]'s buffer is on %s but ops[0]'s on %s: one "
                     "batch on the %s backend runs on one device (its group's)", call, i,
                     ddp_device_str(device, a, sizeof a), ddp_device_str(first, b, sizeof b), backend);
  return DDP_OK;
}
