/* The tcp backend's table: construction (connect the mesh), the op entry
 * points, point-to-point, transport names, abort and destroy. Pairs and the
 * transfer engine are in tcp/pairs.c and tcp/engine.c, the collectives in
 * tcp/algorithms.c. */
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "comm/tcp/tcp.h"
#include "ddp/store.h"

static ddp__tcp_backend *as_tcp(ddp__backend *be) { return (ddp__tcp_backend *)be; }

static ddp_status tcp_send(ddp__backend *be, const ddp__op_ctx *ctx, const void *buf,
                           size_t bytes, int dst) {
  ddp__tcp_backend *b = as_tcp(be);
  if (dst < 0 || dst >= b->size || dst == b->rank || b->pairs[dst].fd < 0)
    return ddp_error(DDP_ERR_INVALID, "%s: tcp backend: cannot send to rank %d", ctx->op, dst);
  return ddp__tcp_send_p2p(b, ctx, buf, bytes, dst);
}

static ddp_status tcp_recv(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                           int src) {
  ddp__tcp_backend *b = as_tcp(be);
  if (src < 0 || src >= b->size || src == b->rank || b->pairs[src].fd < 0)
    return ddp_error(DDP_ERR_INVALID, "%s: tcp backend: cannot receive from rank %d", ctx->op,
                     src);
  return ddp__tcp_recv_p2p(b, ctx, buf, bytes, src);
}

static const char *tcp_transport(const ddp__backend *be, int peer) {
  const ddp__tcp_backend *b = (const ddp__tcp_backend *)be;
  return peer == b->rank ? "self" : "tcp";
}

/* Thread-safe: an atomic flag and a write to the eventfd every wait polls. */
static void tcp_abort(ddp__backend *be) {
  ddp__tcp_backend *b = as_tcp(be);
  atomic_store(&b->aborted, true);
  uint64_t one = 1;
  if (b->wake_fd >= 0) (void)!write(b->wake_fd, &one, sizeof one);
  if (b->lane) tcp_abort(&b->lane->base);
}

static void tcp_destroy(ddp__backend *be) {
  ddp__tcp_backend *b = as_tcp(be);
  if (!b) return;
  if (b->lane) tcp_destroy(&b->lane->base);
  if (b->pairs) {
    ddp__tcp_close_pairs(b);
    for (int r = 0; r < b->size; r++) {
      ddp__tcp_pair *p = &b->pairs[r];
      ddp__tcp_msg *m = p->unexp_head;
      while (m) {
        ddp__tcp_msg *next = m->next;
        ddp_free(m->data);
        ddp_free(m);
        m = next;
      }
      if (p->draining) {
        ddp_free(p->draining->data);
        ddp_free(p->draining);
      }
    }
  }
  if (b->wake_fd >= 0) close(b->wake_fd);
  ddp_free(b->pairs);
  ddp_free(b->pfds);
  ddp_free(b->pfd_owner);
  ddp_free(b->piece);
  ddp_free(b->scratch);
  ddp_free(b->xfers);
  ddp_free(b);
}

static void tcp_counters(const ddp__backend *be, ddp_comm_counters *acc) {
  const ddp__tcp_backend *b = (const ddp__tcp_backend *)be;
  acc->tcp_bytes_sent += atomic_load_explicit(&b->bytes_sent, memory_order_relaxed);
  acc->tcp_bytes_received += atomic_load_explicit(&b->bytes_received, memory_order_relaxed);
  if (b->lane) tcp_counters(&b->lane->base, acc);
}

static const ddp__blocking_ops tcp_blocking = {
    .allreduce = ddp__tcp_allreduce,
    .broadcast = ddp__tcp_broadcast,
    .reduce = ddp__tcp_reduce,
    .allgather = ddp__tcp_allgather,
    .gather = ddp__tcp_gather,
    .scatter = ddp__tcp_scatter,
    .reduce_scatter = ddp__tcp_reduce_scatter,
    .all_to_all = ddp__tcp_all_to_all,
    .barrier = ddp__tcp_barrier,
    .send = tcp_send,
    .recv = tcp_recv,
};

static const ddp__backend_ops tcp_ops = {
    .name = "tcp",
    .caps = DDP__CAPS_HOST_BLOCKING,
    .enqueue = ddp__blocking_enqueue,
    .blocking = &tcp_blocking,
    .p2p_progress = ddp__tcp_p2p_progress,
    .p2p_wake = ddp__tcp_p2p_wake,
    .transport = tcp_transport,
    .counters = tcp_counters,
    .abort = tcp_abort,
    .destroy = tcp_destroy,
};

/* The mesh; with `lane`, a second one for the point-to-point lane, in the
 * namespace "lane/" of the group's store. */
static ddp_status tcp_create(const ddp__backend_config *cfg, bool lane, ddp__backend **out);

ddp_status ddp__backend_tcp_create(const ddp__backend_config *cfg, ddp__backend **out) {
  return tcp_create(cfg, true, out);
}

static ddp_status tcp_create(const ddp__backend_config *cfg, bool lane, ddp__backend **out) {
  *out = NULL;
  if (!cfg || !cfg->store || cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size)
    return ddp_error(DDP_ERR_INVALID, "tcp backend: bad configuration (rank %d of %d)",
                     cfg ? cfg->rank : -1, cfg ? cfg->size : 0);
  ddp__tcp_backend *b = ddp_calloc(1, sizeof *b);
  if (!b) return ddp_error(DDP_ERR_NOMEM, "tcp backend: no memory");
  b->base.ops = &tcp_ops;
  b->rank = b->vrank = cfg->rank;
  b->size = b->vsize = cfg->size;
  b->wake_fd = -1;
  b->failed_peer = -1;
  atomic_init(&b->aborted, false);
  int size = cfg->size;
  b->pairs = ddp_calloc((size_t)size, sizeof *b->pairs);
  b->pfds = ddp_calloc((size_t)size + 1, sizeof *b->pfds);
  b->pfd_owner = ddp_calloc((size_t)size * 3 + 1, sizeof *b->pfd_owner);
  b->piece_bytes = DDP__TCP_PIECE_BYTES;
  b->piece = ddp_alloc(b->piece_bytes);
  ddp_status st = DDP_OK;
  if (!b->pairs || !b->pfds || !b->pfd_owner || !b->piece || !ddp__tcp_xfers(b, 4 * size)) {
    st = ddp_error(DDP_ERR_NOMEM, "tcp backend: no memory for %d pairs", size);
    goto err;
  }
  for (int r = 0; r < size; r++) {
    b->pairs[r].fd = -1;
    b->pairs[r].rank = r;
    b->pairs[r].host = cfg->host_names ? cfg->host_names[r] : NULL;
    b->pairs[r].left_cause = -1;
  }
  b->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (b->wake_fd < 0) {
    st = ddp_error(DDP_ERR_SYS, "tcp backend: eventfd failed");
    goto err;
  }
  if (size > 1) {
    st = ddp__tcp_connect_mesh(b, cfg);
    if (st != DDP_OK) goto err;
  }
  if (lane && size > 1) {
    ddp__backend_config lcfg = *cfg;
    ddp_store *ns = NULL;
    st = ddp_store_prefix(cfg->store, "lane/", &ns);
    if (st != DDP_OK) goto err;
    lcfg.store = ns;
    ddp__backend *inner = NULL;
    st = tcp_create(&lcfg, false, &inner);
    ddp_store_destroy(ns);
    if (st != DDP_OK) {
      st = ddp_error_wrap(st, "tcp backend: the point-to-point mesh");
      goto err;
    }
    b->lane = as_tcp(inner);
  }
  *out = &b->base;
  return DDP_OK;
err:
  tcp_destroy(&b->base);
  return st;
}
