/* Running one operation on a group's backend through the asynchronous
 * interface of backend.h: the capability check, numbering, the context
 * (deadline, abort flag), the flight recorder's start and end, the debug
 * fingerprint check, enqueue, and completion (the backend's wait, or
 * polling its test); and the adapter that lets a backend whose operations
 * run to completion on the caller (ddp's own) fill that interface. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/comm_internal.h"
#include "comm/flight/flight.h"

/* Polling a backend without wait: spin this many tests, then sleep between
 * tests from MIN to MAX (doubling), so a rank with one core leaves it to the
 * caller's work after about 20 us of spinning. */
#define POLL_SPINS 200
#define POLL_SLEEP_MIN_NS 20000LL
#define POLL_SLEEP_MAX_NS 200000LL
/* After a timeout or abort, how long an enqueued op may take to complete
 * once its backend was aborted (the backend's rule: promptly). */
#define ABORT_GRACE_NS (5LL * 1000000000LL)

/* ---- Completions ---------------------------------------------------------- */

void ddp__completion_reset(ddp__completion *c) {
  atomic_store_explicit(&c->done, false, memory_order_relaxed);
  c->status = DDP_OK;
  c->msg[0] = '\0';
}

void ddp__completion_finish(ddp__completion *c, ddp_status status) {
  c->status = status;
  if (status != DDP_OK)
    snprintf(c->msg, sizeof c->msg, "%s", ddp_last_error());
  atomic_store_explicit(&c->done, true, memory_order_release);
}

static bool completion_done(const ddp__completion *c) {
  return atomic_load_explicit(&c->done, memory_order_acquire);
}

/* ---- The blocking adapter ---------------------------------------------------- */

/* Runs a on a blocking backend's table, on this thread. Inlined into both
 * callers below: the group layer's own path adds no call to ddp's backends. */
static inline __attribute__((always_inline)) ddp_status run_blocking(ddp__backend *b,
                                                                    const ddp__op_ctx *ctx,
                                                                    const ddp__op_args *a) {
  const ddp__blocking_ops *ops = b->ops->blocking;
  ddp_reduce_op rop = a->reduce_op;
  size_t elem = ddp_dtype_size(a->dtype);
  switch (a->kind) {
  case DDP__OP_ALLREDUCE: return ops->allreduce(b, ctx, a->buf, a->count, a->dtype, rop);
  case DDP__OP_BROADCAST: return ops->broadcast(b, ctx, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_REDUCE: return ops->reduce(b, ctx, a->buf, a->count, a->dtype, rop, a->root);
  case DDP__OP_ALLGATHER: return ops->allgather(b, ctx, a->send, a->buf, a->count, a->dtype);
  case DDP__OP_GATHER: return ops->gather(b, ctx, a->send, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_SCATTER: return ops->scatter(b, ctx, a->send, a->buf, a->count, a->dtype, a->root);
  case DDP__OP_REDUCE_SCATTER:
    return ops->reduce_scatter(b, ctx, a->send, a->buf, a->count, a->dtype, rop);
  case DDP__OP_ALL_TO_ALL: return ops->all_to_all(b, ctx, a->send, a->buf, a->count, a->dtype);
  case DDP__OP_BARRIER: return ops->barrier(b, ctx);
  case DDP__OP_SEND: return ops->send(b, ctx, a->send, a->count * elem, a->root);
  case DDP__OP_RECV: return ops->recv(b, ctx, a->buf, a->count * elem, a->root);
  default: DDP_ASSERT(!"unknown op kind"); return DDP_ERR_INTERNAL;
  }
}

ddp_status ddp__blocking_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *a,
                                 ddp__completion *c) {
  ddp__completion_finish(c, run_blocking(b, ctx, a));
  return DDP_OK;
}

/* ---- Capabilities --------------------------------------------------------------- */

ddp_device (*ddp__pointer_device_hook)(const void *ptr);

/* comm's API takes raw pointers: each call asks where its buffers are
 * (docs/comm.md, "Buffers on devices"), so the public calls need no device
 * argument and a CPU program runs unchanged. */
ddp_status ddp__buffers_device(const char *call, const void *send, const void *buf,
                               ddp_device *out) {
  ddp_device (*where)(const void *) = ddp__pointer_device_hook ? ddp__pointer_device_hook
                                                               : ddp_pointer_device;
  ddp_device send_device = send ? where(send) : DDP_CPU;
  ddp_device buf_device = buf ? where(buf) : DDP_CPU;
  return ddp__op_device_pick(call, send, send_device, buf, buf_device, out);
}

ddp_status ddp__caps_check(const ddp_process_group *pg, const char *call, ddp__op_kind kind,
                           ddp_dtype dtype, ddp_reduce_op rop, ddp_device device) {
  const ddp__backend_ops *ops = pg->backend->ops;
  const ddp__backend_caps *caps = &ops->caps;
  if (ddp__caps_allow(caps, kind, dtype, rop, device)) return DDP_OK;
  if (!(caps->ops & (1u << kind)))
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: the %s backend of this group (rank %d of %d) has no %s",
                     call, ops->name, pg->rank, pg->size, ddp__op_kind_name(kind));
  if (kind != DDP__OP_BARRIER && !(caps->dtypes & (1u << dtype)))
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: the %s backend of this group (rank %d of %d) does not carry %s",
                     call, ops->name, pg->rank, pg->size, ddp_dtype_name(dtype));
  if (ddp__op_reduces(kind) && !(caps->reduce_ops & (1u << rop)))
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: the %s backend of this group (rank %d of %d) cannot reduce with %s",
                     call, ops->name, pg->rank, pg->size, ddp_reduce_op_name(rop));
  if (kind != DDP__OP_BARRIER &&
      ((unsigned)device.type >= DDP_DEVICE_TYPE_COUNT || !(caps->devices & (1u << device.type)))) {
    char dev[DDP_DEVICE_STR_BYTES];
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "%s: the %s backend of this group (rank %d of %d) cannot reach buffers on %s; "
                     "copy them to a device it serves, or use a group whose backend does",
                     call, ops->name, pg->rank, pg->size, ddp_device_str(device, dev, sizeof dev));
  }
  return DDP_OK;
}

/* ---- Running one operation ----------------------------------------------------- */

static void sleep_ns(int64_t ns) {
  struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000LL), .tv_nsec = (long)(ns % 1000000000LL)};
  nanosleep(&ts, NULL);
}

/* A backend without wait: polls test until c is done, the deadline passes
 * or the group is aborted. */
static ddp_status poll_until_done(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  for (int i = 0; i < POLL_SPINS; i++)
    if (b->ops->test(b, c)) return DDP_OK;
  int64_t pause = POLL_SLEEP_MIN_NS;
  for (;;) {
    if (b->ops->test(b, c)) return DDP_OK;
    if (ctx->aborted && atomic_load(ctx->aborted))
      return ddp_error(DDP_ERR_ABORTED, "%s #%llu: the group was aborted", ctx->op,
                       (unsigned long long)ctx->seq);
    if (ddp_time_ns() >= ctx->deadline_ns)
      return ddp_error(DDP_ERR_TIMEOUT, "%s #%llu did not complete in time on the %s backend", ctx->op,
                       (unsigned long long)ctx->seq, b->ops->name);
    sleep_ns(pause);
    pause = pause * 2 > POLL_SLEEP_MAX_NS ? POLL_SLEEP_MAX_NS : pause * 2;
  }
}

/* Aborts b and waits for c to come back, so that its memory is no longer
 * the backend's when this returns (a backend must complete what it holds
 * promptly once aborted; one that does not is named after 5 s). */
static void abort_and_reclaim(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  b->ops->abort(b);
  int64_t deadline = ddp_time_ns() + ABORT_GRACE_NS;
  while (!completion_done(c) && !(b->ops->test && b->ops->test(b, c))) {
    if (ddp_time_ns() >= deadline) {
      DDP_WARN("%s #%llu: the %s backend did not complete the operation within 5 s of its abort",
               ctx->op, (unsigned long long)ctx->seq, b->ops->name);
      return;
    }
    sleep_ns(POLL_SLEEP_MAX_NS);
  }
}

ddp_status ddp__backend_complete(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  if (!completion_done(c)) {
    DDP_ASSERT(b->ops->test || b->ops->wait); /* else enqueue must have completed it */
    ddp_status st = b->ops->wait ? b->ops->wait(b, ctx, c) : poll_until_done(b, ctx, c);
    if (st != DDP_OK) return st;
  }
  if (c->status != DDP_OK) return ddp_error(c->status, "%s", c->msg);
  return DDP_OK;
}

ddp_status ddp__backend_run(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *args,
                            ddp__completion *c) {
  ddp__completion_reset(c);
  DDP_TRY(b->ops->enqueue(b, ctx, args, c));
  ddp_status st = ddp__backend_complete(b, ctx, c);
  if (st != DDP_OK && !completion_done(c))
    abort_and_reclaim(b, ctx, c); /* given up on (deadline, abort) */
  return st;
}

/* The op ends: recorded, and a failure made the group's sticky error. */
static inline __attribute__((always_inline)) ddp_status op_end(ddp_process_group *pg,
                                                               ddp__op_args *args, ddp_status st) {
  if (pg->flight) ddp__flight_end(pg->flight, args, st, ddp__now_coarse_ns());
  if (st != DDP_OK) {
    ddp__group_fail(pg, st, ddp_last_error());
    return ddp__group_check(pg);
  }
  return DDP_OK;
}

/* The backend an op runs on: host buffers skip staged.c's wrapper
 * (pg->host_backend, the same as pg->backend where nothing is staged). */
static inline ddp__backend *op_backend(const ddp_process_group *pg, const ddp__op_args *args) {
  return args->device.type == DDP_DEVICE_CPU ? pg->host_backend : pg->backend;
}

/* The bodies of ddp__op_start and ddp__op_finish, inlined into
 * ddp__op_execute too: a blocking call on ddp's own backends then runs
 * through no call of the group layer's but the backend's own. */
static inline __attribute__((always_inline)) ddp_status op_start(ddp_process_group *pg,
                                                                 ddp__op_args *args,
                                                                 bool caller_blocked,
                                                                 ddp__op_ctx *ctx,
                                                                 ddp__completion *c) {
  args->seq = ddp__op_is_collective(args->kind) ? ++pg->next_seq : ++pg->next_p2p_seq;
  ddp_status st = ddp__group_check(pg);
  if (st != DDP_OK) {
    if (pg->flight) ddp__flight_end(pg->flight, args, st, ddp__now_coarse_ns());
    return st;
  }
  int64_t now = ddp__now_coarse_ns(); /* one reading: the deadline's and the recorder's */
  *ctx = (ddp__op_ctx){
      .op = ddp__op_kind_name(args->kind),
      .seq = args->seq,
      .deadline_ns = ddp__deadline_from(now, pg->timeout_ns),
      .aborted = &pg->aborted,
      .tag = args->tag,
      .caller_blocked = caller_blocked,
  };
  if (pg->flight) {
    if (op_backend(pg, args)->ops->caps.device_start) ddp__flight_enqueue(pg->flight, args, now);
    else ddp__flight_start(pg->flight, args, now);
    ctx->flight = pg->flight;
    ctx->flight_record = args->flight;
  }
  if (pg->debug_detail && pg->size > 1 && ddp__op_is_collective(args->kind))
    st = ddp__debug_check(pg, args, ctx);
  if (st == DDP_OK) {
    ddp__completion_reset(c);
    ddp__backend *b = op_backend(pg, args);
    /* ddp's own backends: the adapter's body inlined here, so the group
     * layer adds no call to theirs (an 8-byte allreduce costs ~0.12 us in
     * all at 2 ranks, ~0.03 us of it the group layer's). */
    if (b->ops->enqueue == ddp__blocking_enqueue)
      ddp__completion_finish(c, run_blocking(b, ctx, args));
    else
      st = b->ops->enqueue(b, ctx, args, c);
  }
  return st == DDP_OK ? DDP_OK : op_end(pg, args, st);
}

static inline __attribute__((always_inline)) ddp_status op_finish(ddp_process_group *pg,
                                                                  ddp__op_args *args,
                                                                  const ddp__op_ctx *ctx,
                                                                  ddp__completion *c) {
  if (completion_done(c) && c->status == DDP_OK) return op_end(pg, args, DDP_OK); /* the common case */
  ddp__backend *b = op_backend(pg, args);
  ddp_status st = ddp__backend_complete(b, ctx, c);
  if (st != DDP_OK && !completion_done(c)) {
    /* The deadline passed or the group was aborted with the op still in
     * the backend: the group fails first (every later call sees why), then
     * the backend is aborted and the op given back. */
    ddp__group_fail(pg, st, ddp_last_error());
    atomic_store(&pg->aborted, true);
    abort_and_reclaim(b, ctx, c);
  }
  return op_end(pg, args, st);
}

ddp_status ddp__op_start(ddp_process_group *pg, ddp__op_args *args, bool caller_blocked,
                         ddp__op_ctx *ctx, ddp__completion *c) {
  return op_start(pg, args, caller_blocked, ctx, c);
}

ddp_status ddp__op_finish(ddp_process_group *pg, ddp__op_args *args, const ddp__op_ctx *ctx,
                          ddp__completion *c) {
  return op_finish(pg, args, ctx, c);
}

ddp_status ddp__op_execute(ddp_process_group *pg, ddp__op_args *args, bool caller_blocked,
                           ddp__op_ctx *ctx, ddp__completion *c) {
  DDP_TRY(op_start(pg, args, caller_blocked, ctx, c));
  return op_finish(pg, args, ctx, c);
}
