/* The names of operations and reduce ops, and the one-line description of
 * an operation that messages and the flight recorder's verdict print (op.h). */
#include <stdio.h>

#include "comm/op.h"

const char *ddp__op_kind_name(ddp__op_kind kind) {
  static const char *names[DDP__OP_KIND_COUNT] = {
      "allreduce", "broadcast",      "reduce",     "allgather", "gather", "scatter",
      "reduce_scatter", "all_to_all", "barrier", "send",      "recv", "batch_isend_irecv"};
  return (unsigned)kind < DDP__OP_KIND_COUNT ? names[kind] : "unknown-op";
}

const char *ddp_reduce_op_name(ddp_reduce_op op) {
  static const char *names[] = {"sum", "avg", "min", "max", "product"};
  return (unsigned)op < DDP_REDUCE_OP_COUNT ? names[op] : "invalid-reduce-op";
}

void ddp__op_describe(const ddp__op_args *a, int group_size, char *out, size_t bytes) {
  const char *name = ddp__op_kind_name(a->kind);
  const char *dt = ddp_dtype_name(a->dtype);
  switch (a->kind) {
  case DDP__OP_ALLREDUCE:
  case DDP__OP_REDUCE_SCATTER:
    snprintf(out, bytes, "%s(count=%zu, %s, %s)", name, a->count, dt,
             ddp_reduce_op_name(a->reduce_op));
    break;
  case DDP__OP_REDUCE:
    snprintf(out, bytes, "%s(count=%zu, %s, %s, root=%d)", name, a->count, dt,
             ddp_reduce_op_name(a->reduce_op), a->root);
    break;
  case DDP__OP_BROADCAST:
  case DDP__OP_GATHER:
  case DDP__OP_SCATTER:
    snprintf(out, bytes, "%s(count=%zu, %s, root=%d)", name, a->count, dt, a->root);
    break;
  case DDP__OP_BARRIER: snprintf(out, bytes, "%s()", name); break;
  case DDP__OP_P2P_BATCH: snprintf(out, bytes, "%s(%zu operations)", name, a->count); break;
  default: snprintf(out, bytes, "%s(count=%zu, %s)", name, a->count, dt); break;
  }
}

ddp_status ddp__op_device_pick(const char *call, const void *send, ddp_device send_device,
                               const void *buf, ddp_device buf_device, ddp_device *out) {
  *out = DDP_CPU;
  if (send && buf && !ddp_device_equal(send_device, buf_device)) {
    char a[DDP_DEVICE_STR_BYTES], b[DDP_DEVICE_STR_BYTES];
    return ddp_error(DDP_ERR_INVALID,
                     "%s: the send buffer is on %s and the receive buffer on %s: both buffers of "
                     "an operation must be on one device (copy one of them first)",
                     call, ddp_device_str(send_device, a, sizeof a),
                     ddp_device_str(buf_device, b, sizeof b));
  }
  if (send) *out = send_device;
  if (buf) *out = buf_device;
  return DDP_OK;
}
