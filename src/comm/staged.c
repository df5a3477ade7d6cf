/* CUDA buffers over ddp's own backends, staged through pinned host memory
 * (staged.h). The host copies are two buffers per group, grown to the
 * largest op seen and kept (no allocation in the steady state). An op on
 * host memory goes straight to the wrapped backend. */
#include <string.h>

#include "comm/staged.h"

typedef struct staged_backend {
  ddp__backend base;
  ddp__backend_ops ops; /* the wrapped backend's, with CUDA in caps */
  ddp__backend *inner;
  int rank, size;
  void *host_send, *host_buf; /* pinned, for one device */
  size_t cap_send, cap_buf;
  ddp_device host_for;        /* the device the pinned memory was made for */
} staged_backend;

static staged_backend *sb(ddp__backend *b) { return (staged_backend *)b; }
static const staged_backend *sbc(const ddp__backend *b) { return (const staged_backend *)b; }

/* ---- The plan ------------------------------------------------------------------ */

void ddp__staged_plan_of(const ddp__op_args *a, int rank, int size, ddp__staged_plan *p) {
  memset(p, 0, sizeof *p);
  size_t one = a->count * ddp_dtype_size(a->dtype), all = one * (size_t)size;
  bool root = rank == a->root;
  switch (a->kind) {
  case DDP__OP_ALLREDUCE:
    *p = (ddp__staged_plan){.buf_bytes = one, .buf_in = true, .buf_out = true};
    break;
  case DDP__OP_BROADCAST: /* the root's is input, every other rank's output */
    *p = (ddp__staged_plan){.buf_bytes = one, .buf_in = root, .buf_out = !root};
    break;
  case DDP__OP_REDUCE: /* other ranks' buffers stay as they were */
    *p = (ddp__staged_plan){.buf_bytes = one, .buf_in = true, .buf_out = root};
    break;
  case DDP__OP_ALLGATHER:
    *p = (ddp__staged_plan){.send_bytes = one, .buf_bytes = all, .buf_out = true};
    break;
  case DDP__OP_GATHER:
    *p = (ddp__staged_plan){.send_bytes = one, .buf_bytes = root ? all : 0, .buf_out = root};
    break;
  case DDP__OP_SCATTER:
    *p = (ddp__staged_plan){.send_bytes = root ? all : 0, .buf_bytes = one, .buf_out = true};
    break;
  case DDP__OP_REDUCE_SCATTER:
    *p = (ddp__staged_plan){.send_bytes = all, .buf_bytes = one, .buf_out = true};
    break;
  case DDP__OP_ALL_TO_ALL:
    *p = (ddp__staged_plan){.send_bytes = all, .buf_bytes = all, .buf_out = true};
    break;
  case DDP__OP_SEND:
    p->send_bytes = one;
    break;
  case DDP__OP_RECV:
    *p = (ddp__staged_plan){.buf_bytes = one, .buf_out = true};
    break;
  default: /* barrier: no buffer */
    break;
  }
  if (!a->send) p->send_bytes = 0;
  if (!a->buf) p->buf_bytes = 0, p->buf_in = p->buf_out = false;
}

/* ---- Copies: the tensor layer's, unless a test brings its own -------------------- */

static ddp_status tl_to_host(void *host, ddp_device device, const void *src, size_t bytes) {
  DDP_TRY(ddp_device_copy_async(DDP_CPU, host, device, src, bytes));
  return ddp_device_synchronize(device);
}
static ddp_status tl_to_device(ddp_device device, void *dst, const void *host, size_t bytes) {
  DDP_TRY(ddp_device_copy_async(device, dst, DDP_CPU, host, bytes));
  return ddp_device_synchronize(device);
}
static const ddp__staged_copier tensor_copier = {ddp_pinned_alloc, ddp_pinned_free, tl_to_host,
                                                 tl_to_device};
const ddp__staged_copier *ddp__staged_copier_hook;
int ddp__staged_mode;

bool ddp__staged_wanted(void) {
  return ddp__staged_mode > 0 || (ddp__staged_mode == 0 && ddp_cuda_device_count() > 0);
}

static const ddp__staged_copier *copier(void) {
  return ddp__staged_copier_hook ? ddp__staged_copier_hook : &tensor_copier;
}

/* Pinned buffers for `device` of at least the plan's sizes. */
static ddp_status reserve(staged_backend *s, ddp_device device, const ddp__staged_plan *p) {
  const ddp__staged_copier *cp = copier();
  bool other = !ddp_device_equal(device, s->host_for);
  if (other || p->send_bytes > s->cap_send) {
    cp->host_free(s->host_send);
    s->host_send = NULL, s->cap_send = 0;
    if (p->send_bytes) {
      DDP_TRY(cp->host_alloc(device, p->send_bytes, &s->host_send));
      s->cap_send = p->send_bytes;
    }
  }
  if (other || p->buf_bytes > s->cap_buf) {
    cp->host_free(s->host_buf);
    s->host_buf = NULL, s->cap_buf = 0;
    if (p->buf_bytes) {
      DDP_TRY(cp->host_alloc(device, p->buf_bytes, &s->host_buf));
      s->cap_buf = p->buf_bytes;
    }
  }
  s->host_for = device;
  return DDP_OK;
}

static ddp_status staged_run(staged_backend *s, const ddp__op_ctx *ctx, const ddp__op_args *a,
                             ddp__completion *c) {
  ddp__staged_plan p;
  ddp__staged_plan_of(a, s->rank, s->size, &p);
  char dev[DDP_DEVICE_STR_BYTES];
  ddp_device_str(a->device, dev, sizeof dev);
  ddp_status st = reserve(s, a->device, &p);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "%s #%llu (rank %d of %d): pinned host memory to stage %s's buffers",
                          ctx->op, (unsigned long long)ctx->seq, s->rank, s->size, dev);
  const ddp__staged_copier *cp = copier();
  if (p.send_bytes) st = cp->to_host(s->host_send, a->device, a->send, p.send_bytes);
  if (st == DDP_OK && p.buf_in && p.buf_bytes) st = cp->to_host(s->host_buf, a->device, a->buf, p.buf_bytes);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "%s #%llu (rank %d of %d): copying from %s to the host", ctx->op,
                          (unsigned long long)ctx->seq, s->rank, s->size, dev);
  ddp__op_args h = *a;
  h.device = DDP_CPU;
  h.send = a->send ? (p.send_bytes ? s->host_send : NULL) : NULL;
  h.buf = a->buf ? (p.buf_bytes ? s->host_buf : NULL) : NULL;
  /* The wrapped backend completes inside enqueue, into a completion of our
   * own: c is finished once the result is back on the device. */
  ddp__completion host_done;
  atomic_init(&host_done.done, false);
  host_done.status = DDP_OK;
  host_done.msg[0] = 0;
  DDP_TRY(s->inner->ops->enqueue(s->inner, ctx, &h, &host_done));
  DDP_ASSERT(atomic_load(&host_done.done)); /* a blocking backend */
  st = host_done.status;
  if (st != DDP_OK) {
    ddp_error(st, "%s", host_done.msg);
  } else if (p.buf_out && p.buf_bytes) {
    st = cp->to_device(a->device, a->buf, s->host_buf, p.buf_bytes);
    if (st != DDP_OK)
      st = ddp_error_wrap(st, "%s #%llu (rank %d of %d): copying the result back to %s", ctx->op,
                          (unsigned long long)ctx->seq, s->rank, s->size, dev);
  }
  ddp__completion_finish(c, st);
  return DDP_OK;
}

/* ---- The wrapper's table: everything else is the wrapped backend's ----------------- */

static ddp_status staged_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *a,
                                 ddp__completion *c) {
  staged_backend *s = sb(b);
  if (a->device.type == DDP_DEVICE_CPU) { /* not from the group layer (host_backend) */
    atomic_fetch_add_explicit(&ddp__staged_host_passes, 1, memory_order_relaxed);
    return s->inner->ops->enqueue(s->inner, ctx, a, c);
  }
  return staged_run(s, ctx, a, c);
}
static ddp_status staged_p2p_progress(ddp__backend *b, const ddp__op_ctx *ctx,
                                      ddp__p2p_req *const *reqs, int n, int64_t wait_ns, int *culprit) {
  ddp__backend *in = sb(b)->inner;
  return in->ops->p2p_progress(in, ctx, reqs, n, wait_ns, culprit);
}
static void staged_p2p_wake(ddp__backend *b) {
  ddp__backend *in = sb(b)->inner;
  in->ops->p2p_wake(in);
}
static const char *staged_transport(const ddp__backend *b, int peer) {
  const ddp__backend *in = sbc(b)->inner;
  return in->ops->transport ? in->ops->transport(in, peer) : in->ops->name;
}
static void staged_counters(const ddp__backend *b, ddp_comm_counters *acc) {
  const ddp__backend *in = sbc(b)->inner;
  if (in->ops->counters) in->ops->counters(in, acc);
}
static void staged_abort(ddp__backend *b) {
  ddp__backend *in = sb(b)->inner;
  in->ops->abort(in);
}
static void staged_destroy(ddp__backend *b) {
  staged_backend *s = sb(b);
  if (!s) return;
  s->inner->ops->destroy(s->inner);
  const ddp__staged_copier *cp = copier();
  cp->host_free(s->host_send);
  cp->host_free(s->host_buf);
  ddp_free(s);
}

_Atomic long ddp__staged_host_passes;

ddp__backend *ddp__staged_inner(ddp__backend *b) {
  return b->ops->enqueue == staged_enqueue ? sb(b)->inner : b;
}

ddp_status ddp__backend_staged_wrap(ddp__backend **b, int rank, int size) {
  ddp__backend *inner = *b;
  if (inner->ops->test) return DDP_OK; /* not blocking: left as it is */
  staged_backend *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "staged: backend");
  s->inner = inner;
  s->rank = rank;
  s->size = size;
  s->host_for = DDP_CPU;
  s->ops = *inner->ops;
  /* The name stays the wrapped backend's: messages, the flight recorder
   * and ddp_process_group_transport say what moves the bytes. */
  s->ops.caps.devices |= 1u << DDP_DEVICE_CUDA;
  s->ops.enqueue = staged_enqueue;
  s->ops.blocking = NULL; /* the group layer goes through enqueue */
  s->ops.p2p_progress = inner->ops->p2p_progress ? staged_p2p_progress : NULL;
  s->ops.p2p_wake = inner->ops->p2p_wake ? staged_p2p_wake : NULL;
  s->ops.transport = staged_transport;
  s->ops.counters = staged_counters;
  s->ops.abort = staged_abort;
  s->ops.destroy = staged_destroy;
  s->base.ops = &s->ops;
  *b = &s->base;
  return DDP_OK;
}
