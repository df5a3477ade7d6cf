/* The collectives of comm.h: argument checks (DDP_ERR_INVALID naming the
 * call), then submission through the group's queue (work.c), which runs
 * them on the backend (execute.c). AVG goes to the backend as AVG: each
 * backend divides (ddp__reduce_scale) while the data is still in its cache. */
#include <stdio.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "comm/flight/flight.h"


/* ---- Argument checks ------------------------------------------------------------ */

const char *ddp__call_name(const ddp__call *c, char *buf) {
  snprintf(buf, DDP__CALL_NAME_BYTES, "%s%s", c->name, c->async ? "_async" : "");
  return buf;
}

/* pg, sticky error, work pointer, dtype, and that blocks * count elements
 * fit in size_t bytes. */
ddp_status ddp__check_common(ddp_process_group *pg, const ddp__call *c, ddp_dtype dtype, size_t count,
                               size_t blocks, ddp_work **work) {
  char n[DDP__CALL_NAME_BYTES];
  if (work) *work = NULL;
  if (!pg) return ddp_error(DDP_ERR_INVALID, "%s: process group is NULL", ddp__call_name(c, n));
  DDP_TRY(ddp__group_check(pg));
  if (c->async && !work) return ddp_error(DDP_ERR_INVALID, "%s: work is NULL", ddp__call_name(c, n));
  if ((unsigned)dtype > DDP_BFLOAT16)
    return ddp_error(DDP_ERR_INVALID, "%s: dtype %d is not one of float32, float64, int32, int64, float16, bfloat16",
                     ddp__call_name(c, n), (int)dtype);
  size_t elem = ddp_dtype_size(dtype);
  if (count > SIZE_MAX / elem / blocks)
    return ddp_error(DDP_ERR_INVALID, "%s: count %zu of %s is too large", ddp__call_name(c, n), count,
                     ddp_dtype_name(dtype));
  return DDP_OK;
}

static ddp_status check_reduce_op(const ddp__call *c, ddp_dtype dtype, ddp_reduce_op op) {
  char n[DDP__CALL_NAME_BYTES];
  if ((unsigned)op >= DDP_REDUCE_OP_COUNT)
    return ddp_error(DDP_ERR_INVALID, "%s: reduce op %d is not one of sum, avg, min, max, product",
                     ddp__call_name(c, n), (int)op);
  if (op == DDP_REDUCE_AVG && (dtype == DDP_INT32 || dtype == DDP_INT64))
    return ddp_error(DDP_ERR_INVALID, "%s: avg is for floating types, not %s (use sum and divide)",
                     ddp__call_name(c, n), ddp_dtype_name(dtype));
  return DDP_OK;
}

static ddp_status check_root(const ddp_process_group *pg, const ddp__call *c, int root) {
  char n[DDP__CALL_NAME_BYTES];
  if (root < 0 || root >= pg->size)
    return ddp_error(DDP_ERR_INVALID, "%s: root %d is not a rank of the group (size %d)",
                     ddp__call_name(c, n), root, pg->size);
  return DDP_OK;
}

ddp_status ddp__check_buf(const ddp__call *c, const char *what, const void *p, size_t count) {
  char n[DDP__CALL_NAME_BYTES];
  if (!p && count > 0)
    return ddp_error(DDP_ERR_INVALID, "%s: %s is NULL with count %zu", ddp__call_name(c, n), what, count);
  return DDP_OK;
}

/* ---- Public operations ------------------------------------------------------------ */

static ddp_status do_allreduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               ddp_reduce_op op, ddp_work **work, bool async) {
  ddp__call c = {"allreduce", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, 1, work));
  DDP_TRY(check_reduce_op(&c, dtype, op));
  DDP_TRY(ddp__check_buf(&c, "buf", buf, count));
  ddp__op_args a = {.kind = DDP__OP_ALLREDUCE, .buf = buf, .count = count, .dtype = dtype,
                    .reduce_op = op};
  return ddp__submit(pg, &a, work);
}

/* The direct path of a blocking allreduce, for a backend that offers one
 * (mpi: MPI_Allreduce on the caller; docs/comm.md, MPI, "Speed"): taken when
 * the group is idle (biased to this thread, or its inline bit, as
 * ddp__submit's inline path: bias.h), the
 * call is valid (anything the checks below do not pass takes the general
 * path, which says what is wrong), the group has not failed, and the buffer
 * is host memory. It keeps what the general path's inline run gives a
 * blocking call (the same number in the group's sequence, the flight
 * recorder's record, started then completed or failed, the deadline the
 * backend's watchdog enforces, a failure made the group's sticky error),
 * without the op record, completion and calls between (the general path
 * costs ddp ~630 instructions a call on top of MPI's, this ~260). Returns
 * false when not taken (nothing done). */
static inline __attribute__((always_inline)) bool allreduce_direct(ddp_process_group *pg, void *buf,
                                                                   size_t count, ddp_dtype dtype,
                                                                   ddp_reduce_op op, ddp_status *out) {
  if (!pg || !pg->direct_allreduce || (unsigned)dtype >= DDP_DTYPE_COUNT ||
      (unsigned)op >= DDP_REDUCE_OP_COUNT || !(pg->direct_rops[dtype] >> op & 1u) || !buf ||
      count - 1 >= pg->direct_count[dtype] /* count 0 wraps: general path */ ||
      atomic_load_explicit(&pg->failed, memory_order_acquire))
    return false;
  if (ddp__pointer_device_hook || pg->direct_ask_device) {
    ddp_device d;
    if (ddp__buffers_device("allreduce", NULL, buf, &d) != DDP_OK || d.type != DDP_DEVICE_CPU) return false;
  }
  /* Exclusion (bias.h): the group biased to this thread costs no locked
   * instruction; otherwise the inline bit, as ddp__submit's inline path,
   * once the bias is over (a timeout there: the general path says so). */
  bool biased = ddp__bias_enter(&pg->bias);
  if (!biased) {
    if (ddp__bias_revoke(&pg->bias, pg->timeout_ns) != DDP_OK) return false;
    uint_fast64_t idle = 0;
    if (!atomic_compare_exchange_strong(&pg->active, &idle, DDP__INLINE_BIT)) return false;
  }
  ddp__op_args a = {.kind = DDP__OP_ALLREDUCE, .buf = buf, .count = count, .dtype = dtype,
                    .reduce_op = op, .device = DDP_CPU, .blocking_call = true, .seq = ++pg->next_seq};
  int64_t now = ddp__now_coarse_ns(); /* one reading: the deadline's and the recorder's */
  ddp__op_ctx ctx = {.op = "allreduce", .seq = a.seq, .deadline_ns = ddp__deadline_from(now, pg->timeout_ns),
                     .aborted = &pg->aborted, .caller_blocked = true};
  if (pg->flight) {
    if (biased)
      ddp__flight_new_owned(pg->flight, &a, DDP__FLIGHT_STARTED, now);
    else
      ddp__flight_new(pg->flight, &a, DDP__FLIGHT_STARTED, now);
    ctx.flight = pg->flight;
    ctx.flight_record = a.flight;
  }
  ddp_status st = pg->direct_allreduce(pg->host_backend, &ctx, buf, count, dtype, op);
  if (pg->flight) ddp__flight_end_started(pg->flight, &a, st, ddp__now_coarse_ns());
  if (st != DDP_OK) {
    ddp__group_fail(pg, st, ddp_last_error());
    st = ddp__group_check(pg);
  }
  if (biased)
    ddp__bias_exit(&pg->bias);
  else
    ddp__inline_release(pg);
  *out = st;
  return true;
}

ddp_status ddp_allreduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                         ddp_reduce_op op) {
  ddp_status st;
  if (allreduce_direct(pg, buf, count, dtype, op, &st)) return st;
  return do_allreduce(pg, buf, count, dtype, op, NULL, false);
}

ddp_status ddp_allreduce_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               ddp_reduce_op op, ddp_work **work) {
  return do_allreduce(pg, buf, count, dtype, op, work, true);
}

static ddp_status do_broadcast(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               int root, ddp_work **work, bool async) {
  ddp__call c = {"broadcast", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, 1, work));
  DDP_TRY(check_root(pg, &c, root));
  DDP_TRY(ddp__check_buf(&c, "buf", buf, count));
  ddp__op_args a = {.kind = DDP__OP_BROADCAST, .buf = buf, .count = count, .dtype = dtype,
                    .root = root};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_broadcast(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                         int root) {
  return do_broadcast(pg, buf, count, dtype, root, NULL, false);
}

ddp_status ddp_broadcast_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               int root, ddp_work **work) {
  return do_broadcast(pg, buf, count, dtype, root, work, true);
}

static ddp_status do_reduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                            ddp_reduce_op op, int root, ddp_work **work, bool async) {
  ddp__call c = {"reduce", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, 1, work));
  DDP_TRY(check_reduce_op(&c, dtype, op));
  DDP_TRY(check_root(pg, &c, root));
  DDP_TRY(ddp__check_buf(&c, "buf", buf, count));
  ddp__op_args a = {.kind = DDP__OP_REDUCE, .buf = buf, .count = count, .dtype = dtype,
                    .reduce_op = op, .root = root};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_reduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op, int root) {
  return do_reduce(pg, buf, count, dtype, op, root, NULL, false);
}

ddp_status ddp_reduce_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                            ddp_reduce_op op, int root, ddp_work **work) {
  return do_reduce(pg, buf, count, dtype, op, root, work, true);
}

static ddp_status do_allgather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                               ddp_dtype dtype, ddp_work **work, bool async) {
  ddp__call c = {"allgather", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, pg ? (size_t)pg->size : 1, work));
  DDP_TRY(ddp__check_buf(&c, "send", send, count));
  DDP_TRY(ddp__check_buf(&c, "recv", recv, count));
  ddp__op_args a = {.kind = DDP__OP_ALLGATHER, .send = send, .buf = recv, .count = count,
                    .dtype = dtype};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_allgather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                         ddp_dtype dtype) {
  return do_allgather(pg, send, recv, count, dtype, NULL, false);
}

ddp_status ddp_allgather_async(ddp_process_group *pg, const void *send, void *recv,
                               size_t count, ddp_dtype dtype, ddp_work **work) {
  return do_allgather(pg, send, recv, count, dtype, work, true);
}

static ddp_status do_gather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                            ddp_dtype dtype, int root, ddp_work **work, bool async) {
  ddp__call c = {"gather", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, pg ? (size_t)pg->size : 1, work));
  DDP_TRY(check_root(pg, &c, root));
  DDP_TRY(ddp__check_buf(&c, "send", send, count));
  if (pg->rank == root) DDP_TRY(ddp__check_buf(&c, "recv (on the root)", recv, count));
  ddp__op_args a = {.kind = DDP__OP_GATHER, .send = send, .buf = recv, .count = count,
                    .dtype = dtype, .root = root};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_gather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                      ddp_dtype dtype, int root) {
  return do_gather(pg, send, recv, count, dtype, root, NULL, false);
}

ddp_status ddp_gather_async(ddp_process_group *pg, const void *send, void *recv, size_t count,
                            ddp_dtype dtype, int root, ddp_work **work) {
  return do_gather(pg, send, recv, count, dtype, root, work, true);
}

static ddp_status do_scatter(ddp_process_group *pg, const void *send, void *recv, size_t count,
                             ddp_dtype dtype, int root, ddp_work **work, bool async) {
  ddp__call c = {"scatter", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, pg ? (size_t)pg->size : 1, work));
  DDP_TRY(check_root(pg, &c, root));
  if (pg->rank == root) DDP_TRY(ddp__check_buf(&c, "send (on the root)", send, count));
  DDP_TRY(ddp__check_buf(&c, "recv", recv, count));
  ddp__op_args a = {.kind = DDP__OP_SCATTER, .send = send, .buf = recv, .count = count,
                    .dtype = dtype, .root = root};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_scatter(ddp_process_group *pg, const void *send, void *recv, size_t count,
                       ddp_dtype dtype, int root) {
  return do_scatter(pg, send, recv, count, dtype, root, NULL, false);
}

ddp_status ddp_scatter_async(ddp_process_group *pg, const void *send, void *recv, size_t count,
                             ddp_dtype dtype, int root, ddp_work **work) {
  return do_scatter(pg, send, recv, count, dtype, root, work, true);
}

static ddp_status do_reduce_scatter(ddp_process_group *pg, const void *send, void *recv,
                                    size_t count, ddp_dtype dtype, ddp_reduce_op op,
                                    ddp_work **work, bool async) {
  ddp__call c = {"reduce_scatter", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, pg ? (size_t)pg->size : 1, work));
  DDP_TRY(check_reduce_op(&c, dtype, op));
  DDP_TRY(ddp__check_buf(&c, "send", send, count));
  DDP_TRY(ddp__check_buf(&c, "recv", recv, count));
  ddp__op_args a = {.kind = DDP__OP_REDUCE_SCATTER, .send = send, .buf = recv, .count = count,
                    .dtype = dtype, .reduce_op = op};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_reduce_scatter(ddp_process_group *pg, const void *send, void *recv, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op) {
  return do_reduce_scatter(pg, send, recv, count, dtype, op, NULL, false);
}

ddp_status ddp_reduce_scatter_async(ddp_process_group *pg, const void *send, void *recv,
                                    size_t count, ddp_dtype dtype, ddp_reduce_op op,
                                    ddp_work **work) {
  return do_reduce_scatter(pg, send, recv, count, dtype, op, work, true);
}

static ddp_status do_all_to_all(ddp_process_group *pg, const void *send, void *recv, size_t count,
                                ddp_dtype dtype, ddp_work **work, bool async) {
  ddp__call c = {"all_to_all", async};
  DDP_TRY(ddp__check_common(pg, &c, dtype, count, pg ? (size_t)pg->size : 1, work));
  DDP_TRY(ddp__check_buf(&c, "send", send, count));
  DDP_TRY(ddp__check_buf(&c, "recv", recv, count));
  ddp__op_args a = {.kind = DDP__OP_ALL_TO_ALL, .send = send, .buf = recv, .count = count,
                    .dtype = dtype};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_all_to_all(ddp_process_group *pg, const void *send, void *recv, size_t count,
                          ddp_dtype dtype) {
  return do_all_to_all(pg, send, recv, count, dtype, NULL, false);
}

ddp_status ddp_all_to_all_async(ddp_process_group *pg, const void *send, void *recv,
                                size_t count, ddp_dtype dtype, ddp_work **work) {
  return do_all_to_all(pg, send, recv, count, dtype, work, true);
}

static ddp_status do_barrier(ddp_process_group *pg, ddp_work **work, bool async) {
  ddp__call c = {"barrier", async};
  DDP_TRY(ddp__check_common(pg, &c, DDP_INT32, 0, 1, work));
  ddp__op_args a = {.kind = DDP__OP_BARRIER, .dtype = DDP_INT32};
  return ddp__submit(pg, &a, work);
}

ddp_status ddp_barrier(ddp_process_group *pg) { return do_barrier(pg, NULL, false); }

ddp_status ddp_barrier_async(ddp_process_group *pg, ddp_work **work) {
  return do_barrier(pg, work, true);
}
