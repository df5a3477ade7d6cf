/* The backend of a group of one rank: every collective is a copy (or
 * nothing, in place). Point-to-point has no peer to talk to (the group layer
 * refuses a rank sending to itself before it gets here). */
#include <string.h>

#include "comm/backend.h"

typedef struct self_backend {
  ddp__backend base;
} self_backend;

static void copy(void *dst, const void *src, size_t count, ddp_dtype dtype) {
  if (count && dst != src) memmove(dst, src, count * ddp_dtype_size(dtype));
}

static ddp_status self_allreduce(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op) {
  return DDP_OK;
}

static ddp_status self_broadcast(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                                 ddp_dtype dtype, int root) {
  return DDP_OK;
}

static ddp_status self_reduce(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op, int root) {
  return DDP_OK;
}

static ddp_status self_allgather(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                                 void *recv, size_t count, ddp_dtype dtype) {
  copy(recv, send, count, dtype);
  return DDP_OK;
}

static ddp_status self_gather(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                              void *recv, size_t count, ddp_dtype dtype, int root) {
  copy(recv, send, count, dtype);
  return DDP_OK;
}

static ddp_status self_scatter(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype, int root) {
  copy(recv, send, count, dtype);
  return DDP_OK;
}

static ddp_status self_reduce_scatter(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                                      void *recv, size_t count, ddp_dtype dtype,
                                      ddp_reduce_op op) {
  copy(recv, send, count, dtype);
  return DDP_OK;
}

static ddp_status self_all_to_all(ddp__backend *b, const ddp__op_ctx *ctx, const void *send,
                                  void *recv, size_t count, ddp_dtype dtype) {
  copy(recv, send, count, dtype);
  return DDP_OK;
}

static ddp_status self_barrier(ddp__backend *b, const ddp__op_ctx *ctx) { return DDP_OK; }

static ddp_status self_send(ddp__backend *b, const ddp__op_ctx *ctx, const void *buf,
                            size_t bytes, int dst) {
  return ddp_error(DDP_ERR_INVALID, "send #%llu: a group of one has no rank %d",
                   (unsigned long long)ctx->seq, dst);
}

static ddp_status self_recv(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                            int src) {
  return ddp_error(DDP_ERR_INVALID, "recv #%llu: a group of one has no rank %d",
                   (unsigned long long)ctx->seq, src);
}

static const char *self_transport(const ddp__backend *b, int peer) { return "self"; }

static void self_abort(ddp__backend *b) {}

static void self_destroy(ddp__backend *b) { ddp_free(b); }

static const ddp__blocking_ops self_blocking = {
    .allreduce = self_allreduce,
    .broadcast = self_broadcast,
    .reduce = self_reduce,
    .allgather = self_allgather,
    .gather = self_gather,
    .scatter = self_scatter,
    .reduce_scatter = self_reduce_scatter,
    .all_to_all = self_all_to_all,
    .barrier = self_barrier,
    .send = self_send,
    .recv = self_recv,
};

static const ddp__backend_ops self_ops = {
    .name = "self",
    .caps = DDP__CAPS_HOST_BLOCKING,
    .enqueue = ddp__blocking_enqueue,
    .blocking = &self_blocking,
    .transport = self_transport,
    .abort = self_abort,
    .destroy = self_destroy,
};

ddp_status ddp__backend_self_create(const ddp__backend_config *cfg, ddp__backend **out) {
  DDP_ASSERT(cfg->size == 1);
  self_backend *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "self backend: out of memory");
  s->base.ops = &self_ops;
  *out = &s->base;
  return DDP_OK;
}
