/* Messages: checking what is sent, and the one-block layout of what is
 * received (payload, tensor descriptors and data, each 64-byte aligned, so a
 * reader can receive tensors straight into their final memory). */
#include <string.h>

#include "rpc/rpc_internal.h"

#define ALIGN64(x) (((x) + 63u) & ~(size_t)63u)

void ddp_rpc_message_free(ddp_rpc_message *msg) {
  if (!msg) return;
  if (msg->release) msg->release(msg->release_ctx);
  memset(msg, 0, sizeof *msg);
}

size_t ddp__rpc_tensor_bytes(const ddp_tensor *t) {
  return (size_t)t->numel * ddp_dtype_size(t->dtype);
}

ddp_status ddp__rpc_message_check(const ddp_rpc_message *msg) {
  if (!msg) return DDP_OK;
  if (msg->num_tensors < 0 || msg->num_tensors > DDP_RPC_MAX_TENSORS)
    return ddp_error(DDP_ERR_RANGE, "message has %d tensors (0..%d allowed)", msg->num_tensors,
                     DDP_RPC_MAX_TENSORS);
  if (msg->num_tensors > 0 && !msg->tensors)
    return ddp_error(DDP_ERR_INVALID, "message has %d tensors but tensors is NULL",
                     msg->num_tensors);
  if (msg->payload_bytes > 0 && !msg->payload)
    return ddp_error(DDP_ERR_INVALID, "message has %zu payload bytes but payload is NULL",
                     msg->payload_bytes);
  uint64_t total = msg->payload_bytes;
  if (total > DDP_RPC_MAX_PAYLOAD_BYTES)
    return ddp_error(DDP_ERR_RANGE, "payload of %zu bytes is over the limit (%llu)",
                     msg->payload_bytes, (unsigned long long)DDP_RPC_MAX_PAYLOAD_BYTES);
  for (int32_t i = 0; i < msg->num_tensors; i++) {
    const ddp_tensor *t = msg->tensors[i];
    if (!t) return ddp_error(DDP_ERR_INVALID, "tensor %d of the message is NULL", i);
    if (t->device.type != DDP_DEVICE_CPU)
      return ddp_error(DDP_ERR_UNSUPPORTED,
                       "tensor %d of the message is on a GPU: RPC sends CPU tensors (copy it "
                       "with ddp_to first)",
                       i);
    if ((unsigned)t->dtype >= DDP_DTYPE_COUNT || t->ndim < 0 || t->ndim > DDP_MAX_DIMS)
      return ddp_error(DDP_ERR_INVALID, "tensor %d of the message has a bad dtype or ndim", i);
    if (t->numel > 0 && !t->data)
      return ddp_error(DDP_ERR_INVALID, "tensor %d of the message has no data", i);
    total += ddp__rpc_tensor_bytes(t);
  }
  if (total > DDP_RPC_MAX_MESSAGE_BYTES)
    return ddp_error(DDP_ERR_RANGE, "message of %llu bytes is over the limit (%llu)",
                     (unsigned long long)total, (unsigned long long)DDP_RPC_MAX_MESSAGE_BYTES);
  return DDP_OK;
}

void ddp__rpc_block_free(void *block) { ddp_free(block); }

ddp_status ddp__rpc_block_create(const ddp__rpc_tensor_desc *descs, uint32_t num_tensors,
                                 uint64_t payload_bytes, size_t extra_bytes, const char *who,
                                 ddp__rpc_block **out) {
  *out = NULL;
  if (num_tensors > DDP_RPC_MAX_TENSORS)
    return ddp_error(DDP_ERR_FORMAT, "%s sent %u tensors (at most %d)", who, num_tensors,
                     DDP_RPC_MAX_TENSORS);
  if (payload_bytes > DDP_RPC_MAX_PAYLOAD_BYTES)
    return ddp_error(DDP_ERR_FORMAT, "%s sent a payload of %llu bytes (at most %llu)", who,
                     (unsigned long long)payload_bytes,
                     (unsigned long long)DDP_RPC_MAX_PAYLOAD_BYTES);
  /* Layout: block | extra | tensor pointers | tensors | payload | data... */
  size_t off = ALIGN64(sizeof(ddp__rpc_block));
  size_t extra_off = off;
  off = ALIGN64(off + extra_bytes);
  size_t ptrs_off = off;
  off = ALIGN64(off + num_tensors * sizeof(ddp_tensor *));
  size_t tensors_off = off;
  off = ALIGN64(off + num_tensors * sizeof(ddp_tensor));
  size_t payload_off = off;
  uint64_t total = ALIGN64(off + payload_bytes);
  for (uint32_t i = 0; i < num_tensors; i++) {
    const ddp__rpc_tensor_desc *d = &descs[i];
    if (d->dtype < 0 || d->dtype >= DDP_DTYPE_COUNT || d->ndim < 0 || d->ndim > DDP_MAX_DIMS)
      return ddp_error(DDP_ERR_FORMAT, "%s sent tensor %u with dtype %d, ndim %d", who, i,
                       d->dtype, d->ndim);
    uint64_t numel = 1;
    for (int k = 0; k < d->ndim; k++) {
      if (d->shape[k] < 0 || (d->shape[k] > 0 && numel > DDP_RPC_MAX_MESSAGE_BYTES / (uint64_t)d->shape[k]))
        return ddp_error(DDP_ERR_FORMAT, "%s sent tensor %u with a bad shape (dim %d = %lld)",
                         who, i, k, (long long)d->shape[k]);
      numel *= (uint64_t)d->shape[k];
    }
    uint64_t bytes = numel * ddp_dtype_size((ddp_dtype)d->dtype);
    total = ALIGN64(total + bytes);
    if (bytes > DDP_RPC_MAX_MESSAGE_BYTES || total > DDP_RPC_MAX_MESSAGE_BYTES)
      return ddp_error(DDP_ERR_FORMAT, "%s sent a message of more than %llu bytes", who,
                       (unsigned long long)DDP_RPC_MAX_MESSAGE_BYTES);
  }
  char *base = ddp_alloc((size_t)total);
  if (!base)
    return ddp_error(DDP_ERR_NOMEM, "cannot allocate %llu bytes for a message from %s",
                     (unsigned long long)total, who);
  ddp__rpc_block *b = (ddp__rpc_block *)base;
  memset(b, 0, payload_off); /* header, extra, pointers, descriptors */
  b->extra = extra_bytes ? base + extra_off : NULL;
  b->payload = base + payload_off;
  b->total_bytes = (size_t)total;
  ddp_tensor **ptrs = (ddp_tensor **)(base + ptrs_off);
  ddp_tensor *tensors = (ddp_tensor *)(base + tensors_off);
  size_t data_off = ALIGN64(payload_off + payload_bytes);
  for (uint32_t i = 0; i < num_tensors; i++) {
    ddp_tensor *t = &tensors[i];
    DDP_ASSERT(ddp_tensor_wrap(t, (ddp_dtype)descs[i].dtype, descs[i].ndim, descs[i].shape,
                               base + data_off) == DDP_OK);
    ptrs[i] = t;
    data_off = ALIGN64(data_off + ddp__rpc_tensor_bytes(t));
  }
  b->msg.payload = payload_bytes ? b->payload : NULL;
  b->msg.payload_bytes = (size_t)payload_bytes;
  b->msg.tensors = num_tensors ? ptrs : NULL;
  b->msg.num_tensors = (int32_t)num_tensors;
  b->msg.release = ddp__rpc_block_free;
  b->msg.release_ctx = b;
  *out = b;
  return DDP_OK;
}

ddp_status ddp__rpc_message_copy(const ddp_rpc_message *msg, size_t extra_bytes,
                                 ddp__rpc_block **out) {
  ddp_rpc_message empty = {0};
  if (!msg) msg = &empty;
  DDP_TRY(ddp__rpc_message_check(msg));
  ddp__rpc_tensor_desc small[8];
  ddp__rpc_tensor_desc *descs = small;
  if (msg->num_tensors > 8) {
    descs = ddp_calloc((size_t)msg->num_tensors, sizeof *descs);
    if (!descs) return ddp_error(DDP_ERR_NOMEM, "cannot copy a message of %d tensors",
                                 msg->num_tensors);
  }
  for (int32_t i = 0; i < msg->num_tensors; i++) {
    const ddp_tensor *t = msg->tensors[i];
    memset(&descs[i], 0, sizeof descs[i]);
    descs[i].dtype = (int32_t)t->dtype;
    descs[i].ndim = t->ndim;
    for (int k = 0; k < t->ndim; k++) descs[i].shape[k] = t->shape[k];
  }
  ddp_status st = ddp__rpc_block_create(descs, (uint32_t)msg->num_tensors, msg->payload_bytes,
                                        extra_bytes, "this worker", out);
  if (descs != small) ddp_free(descs);
  if (st != DDP_OK) return st;
  ddp__rpc_block *b = *out;
  if (msg->payload_bytes) memcpy(b->payload, msg->payload, msg->payload_bytes);
  for (int32_t i = 0; i < msg->num_tensors; i++)
    if (b->msg.tensors[i]->numel)
      memcpy(b->msg.tensors[i]->data, msg->tensors[i]->data,
             ddp__rpc_tensor_bytes(msg->tensors[i]));
  return DDP_OK;
}
