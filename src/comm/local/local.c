/* The local backend: collectives between ranks of one host, and the
 * backend's lifecycle. Between threads, ranks read and reduce straight from
 * each other's buffers (plain pointers); between processes, large
 * collectives go through staging in the shared segment (local/staged.c).
 *
 * Every collective is op number n (counted alike on every rank). A rank's
 * progress is its flag, (n << 32) | step:
 *   START  its buffer addresses (or its slot) for op n are published;
 *   2 + c  (large allreduce) segment c of its slice is reduced;
 *   DONE   it has finished reading everyone else's buffers.
 * Small messages go through per-rank slots in the region (double-buffered by
 * n's parity: before writing slot n%2 a rank waits until every peer started
 * op n-1, hence finished reading slot n%2 in op n-2). Large ones between
 * threads are read in place and end with every rank waiting for every DONE,
 * since peers may still be reading its buffers. */
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/local/local.h"
#include "ddp/tensor.h"

static ddp__local_backend *as_local(ddp__backend *b) { return (ddp__local_backend *)b; }

/* ---- The region ---------------------------------------------------------- */

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t ddp__local_chunk_bytes(int size) {
  size_t chunk = DDP__LOCAL_STAGED_BYTES / (size_t)size;
  chunk -= chunk % (64u << 10);
  if (chunk < DDP__LOCAL_CHUNK_MIN) chunk = DDP__LOCAL_CHUNK_MIN;
  if (chunk > DDP__LOCAL_CHUNK_MAX) chunk = DDP__LOCAL_CHUNK_MAX;
  return chunk;
}

size_t ddp__local_region_bytes(int size) {
  size_t n = (size_t)size;
  size_t ctl = align_up(sizeof(ddp__local_region), 128);
  size_t slots = ctl + n * sizeof(ddp__local_ctl);
  size_t chans = slots + n * 2 * DDP__LOCAL_SLOT_BYTES;
  size_t stage = align_up(chans + n * n * sizeof(ddp__local_p2p_chan), 4096);
  size_t chunk = ddp__local_chunk_bytes(size);
  size_t result = stage + n * 2 * chunk;
  return result + 2 * chunk;
}

void ddp__local_region_init(ddp__local_region *reg, int size, uint64_t nonce) {
  size_t n = (size_t)size;
  reg->magic = DDP__LOCAL_MAGIC;
  reg->version = DDP__LOCAL_VERSION;
  reg->size = (uint32_t)size;
  reg->nonce = nonce;
  reg->total_bytes = ddp__local_region_bytes(size);
  reg->ctl_off = align_up(sizeof(ddp__local_region), 128);
  reg->slot_off = reg->ctl_off + n * sizeof(ddp__local_ctl);
  reg->chan_off = reg->slot_off + n * 2 * DDP__LOCAL_SLOT_BYTES;
  reg->stage_off = align_up(reg->chan_off + n * n * sizeof(ddp__local_p2p_chan), 4096);
  reg->chunk_bytes = ddp__local_chunk_bytes(size);
  reg->result_off = reg->stage_off + n * 2 * reg->chunk_bytes;
}

/* ---- Op framing ---------------------------------------------------------- */

/* Starts op n: waits until every peer has started op n-1 (so nobody still
 * reads this rank's slot of parity n%2). */
static ddp_status op_begin(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t *n) {
  /* After a failure the region no longer describes this rank's op: touch
   * nothing, repeat the error. */
  DDP_TRY(ddp__local_check_failed(b, ctx));
  *n = ++b->op_number;
  if (*n > 1) return ddp__local_wait_all(b, ctx, ddp__local_flag(*n - 1, DDP__LOCAL_STEP_START));
  return DDP_OK;
}

/* Publishes this rank's buffers for op n and posts DDP__LOCAL_STEP_START. */
static void op_publish(ddp__local_backend *b, uint64_t n, const void *a0, const void *a1) {
  ddp__local_ctl *c = ddp__local_my_ctl(b);
  c->addr[0] = (uint64_t)(uintptr_t)a0;
  c->addr[1] = (uint64_t)(uintptr_t)a1;
  ddp__local_post(b, &c->flag, ddp__local_flag(n, DDP__LOCAL_STEP_START));
}

/* Small messages: this rank's `bytes` of src (none when src is NULL) go into
 * its slot of op n, then op n's buffers are published and START posted. */
static void slot_put(ddp__local_backend *b, uint64_t n, const void *src, size_t bytes,
                     const void *a0, const void *a1) {
  if (src && bytes) memcpy(ddp__local_slot_of(b->reg, b->rank, n), src, bytes);
  op_publish(b, n, a0, a1);
}

/* Waits until every rank, or rank q, has posted op n's START. */
static ddp_status wait_start_all(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n) {
  return ddp__local_wait_all(b, ctx, ddp__local_flag(n, DDP__LOCAL_STEP_START));
}

static ddp_status wait_start_of(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n, int q) {
  return ddp__local_wait_flag(b, ctx, q, ddp__local_flag(n, DDP__LOCAL_STEP_START));
}

/* op_publish for ops whose peers read this rank's buffers in place
 * (threads): if this op fails, ddp__local_fail lingers until they stop. */
static void op_expose(ddp__local_backend *b, uint64_t n, const void *a0, const void *a1) {
  if (!b->mem->staged) b->exposed_op = n;
  op_publish(b, n, a0, a1);
}

void ddp__local_linger(ddp__local_backend *b) {
  uint64_t n = b->op_number;
  if (b->mem->staged || n == 0 || b->exposed_op != n) return;
  b->exposed_op = 0;
  int64_t deadline = ddp_time_ns() + 2000000000LL;
  for (;;) {
    bool reading = false;
    for (int q = 0; q < b->size && !reading; q++) {
      if (q == b->rank) continue;
      ddp__local_ctl *c = ddp__local_ctl_of(b->reg, q);
      uint64_t f = atomic_load(&c->flag.value);
      /* A peer that has not started op n checks this rank's state first
       * (peers_active) and will not read. */
      reading = atomic_load(&c->state) == DDP__LOCAL_ACTIVE &&
                f >= ddp__local_flag(n, DDP__LOCAL_STEP_START) && f < ddp__local_flag(n, DDP__LOCAL_STEP_DONE);
    }
    if (!reading || ddp_time_ns() >= deadline) return;
    struct timespec ts = {0, 100 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* Before reading peer q's buffer in place: q is still running (one that
 * failed or aborted may have returned and let go of its buffers). */
static ddp_status peer_active(ddp__local_backend *b, const ddp__op_ctx *ctx, int q) {
  if (atomic_load(&ddp__local_ctl_of(b->reg, q)->state) != DDP__LOCAL_ACTIVE)
    return ddp__local_wait_flag(b, ctx, q, UINT64_MAX); /* reports q's state */
  return DDP_OK;
}

/* peer_active for every peer: before ops that read every peer's buffer. An
 * op that reads only the root's (broadcast, scatter) asks for the root
 * alone: another receiver may have finished and left the group already. */
static ddp_status peers_active(ddp__local_backend *b, const ddp__op_ctx *ctx) {
  for (int q = 0; q < b->size; q++)
    if (q != b->rank) DDP_TRY(peer_active(b, ctx, q));
  return DDP_OK;
}

static uint64_t peer_addr(ddp__local_backend *b, int q, int i) {
  return ddp__local_ctl_of(b->reg, q)->addr[i];
}

/* Posts DDP__LOCAL_STEP_DONE and waits for everyone's. */
static ddp_status op_finish(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n) {
  ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  return ddp__local_wait_all(b, ctx, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
}

static ddp_status fail(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp_status st) {
  return ddp__local_fail(b, ctx, st);
}

/* A provider error reaching rank q, as the op's error (a dead peer named
 * the way the waits name it). */
static ddp_status mem_error(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp_status st, int q) {
  const char *op = ctx && ctx->op ? ctx->op : "op";
  unsigned long long seq = ctx ? ctx->seq : 0;
  b->blame = ddp__local_group_rank(b, q);
  ddp__local_ctl *c = ddp__local_ctl_of(b->reg, q);
  int32_t blame = atomic_load(&c->blame);
  if (atomic_load(&c->state) != DDP__LOCAL_ACTIVE) {
    /* The peer failed during this op and let go of its buffers (or exited):
     * name the rank it blamed. */
    if (ddp__local_blame_valid(b, blame)) {
      b->blame = blame;
      st = ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) died or failed (reported by rank %d)",
                     op, seq, blame, ddp__local_group_host(b, blame), ddp__local_group_rank(b, q));
    } else {
      st = ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) failed", op, seq,
                     ddp__local_group_rank(b, q), b->host_names[q]);
    }
  } else if (st == DDP_ERR_PEER) {
    char why[160];
    snprintf(why, sizeof why, "%s", ddp_last_error());
    st = ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) died (%s)", op, seq,
                   ddp__local_group_rank(b, q), b->host_names[q], why);
  } else {
    st = ddp_error_wrap(st, "%s #%llu: rank %d (%s)", op, seq, ddp__local_group_rank(b, q),
                        b->host_names[q]);
  }
  return fail(b, ctx, st);
}

#define MEM_TRY(q, expr)                                       \
  do {                                                         \
    ddp_status mem__s = (expr);                                \
    if (mem__s != DDP_OK) return mem_error(b, ctx, mem__s, q); \
  } while (0)

static ddp_status mem_read(ddp__local_backend *b, int q, uint64_t addr, void *dst, size_t bytes) {
  if (!bytes) return DDP_OK;
  if (q == b->rank) {
    memmove(dst, (const void *)(uintptr_t)addr, bytes);
    return DDP_OK;
  }
  return b->mem->ops->read(b->mem, q, addr, dst, bytes);
}

/* ---- Collectives ----------------------------------------------------------- */

/* Small collectives go through the slots: every rank copies in, every rank
 * reads what it needs. Decided from arguments equal on every rank. */
static bool use_slots(const ddp__local_backend *b, size_t slot_bytes, size_t read_bytes) {
  /* Between processes the staged path wins from 16 KiB (2 ranks: 2.3 vs
   * 3.1 us at 16 KiB, 7.6 vs 13 us at 64 KiB); between threads the slots
   * serve up to their size. */
  size_t limit = b->mem->staged ? DDP__LOCAL_STAGED_SLOT_LIMIT : DDP__LOCAL_SLOT_BYTES;
  return slot_bytes <= limit && read_bytes <= 256u * 1024u;
}

/* dst (count) := the reduction, in rank order, of every rank's slot of op n
 * at byte offset `off`. Rank order makes every rank's result bitwise equal. */
static void reduce_slots(ddp__local_backend *b, uint64_t n, size_t off, void *dst, size_t count,
                         ddp_dtype dtype, ddp_reduce_op op) {
  const void *src[DDP__LOCAL_MAX_RANKS];
  for (int q = 0; q < b->size; q++) src[q] = ddp__local_slot_of(b->reg, q, n) + off;
  ddp__local_reduce_ranks(dst, src, b->size, count, dtype, op);
}

void ddp__local_reduce_ranks(void *dst, const void *const *src, int size, size_t count,
                             ddp_dtype dtype, ddp_reduce_op op) {
  if (size == 1) {
    memmove(dst, src[0], count * ddp_dtype_size(dtype));
  } else {
    ddp__reduce_pair(dst, src[0], src[1], count, dtype, op);
    for (int q = 2; q < size; q++) ddp__reduce_into(dst, src[q], count, dtype, op);
  }
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(dst, count, dtype, size);
}

/* dst (count elements) := own op every peer's (count) at byte offset `off`
 * of their published buffer addr[which]; own data already in dst when
 * `dst_is_own`, else read from own addr. Segment-sized (views fit scratch). */
static ddp_status reduce_segment(ddp__local_backend *b, const ddp__op_ctx *ctx, int which,
                                 size_t off, void *dst, bool dst_is_own, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op) {
  size_t bytes = count * ddp_dtype_size(dtype);
  if (!dst_is_own) memmove(dst, (const char *)(uintptr_t)peer_addr(b, b->rank, which) + off, bytes);
  for (int i = 1; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    const void *v = NULL;
    MEM_TRY(q, b->mem->ops->view(b->mem, q, peer_addr(b, q, which) + off, bytes, b->scratch[0], &v));
    ddp__reduce_into(dst, v, count, dtype, op);
  }
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(dst, count, dtype, b->size);
  return DDP_OK;
}

static ddp_status local_allreduce(ddp__backend *base, const ddp__op_ctx *ctx, void *buf,
                                  size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  ddp__local_backend *b = as_local(base);
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, 2 * bytes);
  if (use_slots(b, bytes, bytes * (size_t)(b->size - 1))) {
    slot_put(b, n, buf, bytes, buf, NULL);
    DDP_TRY(wait_start_all(b, ctx, n));
    if (bytes) reduce_slots(b, n, 0, buf, count, dtype, op);
    return DDP_OK;
  }
  op_expose(b, n, buf, NULL);
  if (b->mem->staged) return ddp__local_staged_allreduce(b, ctx, n, buf, count, dtype, op);
  /* Reduce-scatter: this rank reduces its slice from every peer's buffer
   * into its own, a segment at a time, posting each; then allgather: it
   * copies every peer's reduced slice out of that peer's buffer as its
   * segments are posted. Each input byte is read once, each output byte
   * written once (plus the slice's own accumulation). */
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  size_t seg = DDP__LOCAL_SEGMENT_BYTES / esize;
  size_t lo = ddp__local_slice_lo(count, b->size, b->rank, esize);
  size_t hi = ddp__local_slice_lo(count, b->size, b->rank + 1, esize);
  uint32_t c = 0;
  for (size_t at = lo; at < hi; at += seg, c++) {
    size_t len = hi - at < seg ? hi - at : seg;
    DDP_TRY(reduce_segment(b, ctx, 0, at * esize, (char *)buf + at * esize, true, len, dtype, op));
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 2 + c));
  }
  for (int i = 1; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    size_t qlo = ddp__local_slice_lo(count, b->size, q, esize);
    size_t qhi = ddp__local_slice_lo(count, b->size, q + 1, esize);
    uint32_t qc = 0;
    for (size_t at = qlo; at < qhi; at += seg, qc++) {
      size_t len = qhi - at < seg ? qhi - at : seg;
      DDP_TRY(ddp__local_wait_flag(b, ctx, q, ddp__local_flag(n, 2 + qc)));
      MEM_TRY(q, mem_read(b, q, peer_addr(b, q, 0) + at * esize, (char *)buf + at * esize,
                       len * esize));
    }
  }
  return op_finish(b, ctx, n);
}

static ddp_status local_broadcast(ddp__backend *base, const ddp__op_ctx *ctx, void *buf,
                                  size_t count, ddp_dtype dtype, int root) {
  ddp__local_backend *b = as_local(base);
  size_t bytes = count * ddp_dtype_size(dtype);
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, bytes);
  if (use_slots(b, bytes, bytes)) {
    slot_put(b, n, b->rank == root ? buf : NULL, bytes, buf, NULL);
    if (b->rank == root) return DDP_OK;
    DDP_TRY(wait_start_of(b, ctx, n, root));
    if (bytes) memcpy(buf, ddp__local_slot_of(b->reg, root, n), bytes);
    return DDP_OK;
  }
  op_expose(b, n, buf, NULL);
  if (b->mem->staged) {
    return ddp__local_staged_broadcast(b, ctx, n, buf, bytes, root);
  }
  if (b->rank == root) {
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
    return ddp__local_wait_all(b, ctx, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  }
  DDP_TRY(wait_start_of(b, ctx, n, root));
  DDP_TRY(peer_active(b, ctx, root));
  MEM_TRY(root, mem_read(b, root, peer_addr(b, root, 0), buf, bytes));
  ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  return DDP_OK;
}

static ddp_status local_reduce(ddp__backend *base, const ddp__op_ctx *ctx, void *buf,
                               size_t count, ddp_dtype dtype, ddp_reduce_op op, int root) {
  ddp__local_backend *b = as_local(base);
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, b->rank == root ? 2 * bytes : bytes);
  if (use_slots(b, bytes, bytes * (size_t)(b->size - 1))) {
    slot_put(b, n, buf, bytes, buf, NULL);
    if (b->rank != root) return DDP_OK;
    DDP_TRY(wait_start_all(b, ctx, n));
    if (bytes) reduce_slots(b, n, 0, buf, count, dtype, op);
    return DDP_OK;
  }
  op_expose(b, n, buf, NULL);
  if (b->mem->staged) {
    return ddp__local_staged_reduce(b, ctx, n, buf, count, dtype, op, root);
  }
  /* Every rank reduces its slice (own first, in scratch) and writes it into
   * root's buffer: only rank q ever touches slice q, in any buffer. */
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  size_t seg = DDP__LOCAL_SEGMENT_BYTES / esize;
  size_t lo = ddp__local_slice_lo(count, b->size, b->rank, esize);
  size_t hi = ddp__local_slice_lo(count, b->size, b->rank + 1, esize);
  for (size_t at = lo; at < hi; at += seg) {
    size_t len = hi - at < seg ? hi - at : seg;
    if (b->rank == root) {
      DDP_TRY(reduce_segment(b, ctx, 0, at * esize, (char *)buf + at * esize, true, len, dtype,
                             op));
    } else {
      void *acc = b->scratch[1];
      DDP_TRY(reduce_segment(b, ctx, 0, at * esize, acc, false, len, dtype, op));
      MEM_TRY(root, b->mem->ops->write(b->mem, root, peer_addr(b, root, 0) + at * esize, acc,
                                 len * esize));
    }
  }
  return op_finish(b, ctx, n);
}

static ddp_status local_allgather(ddp__backend *base, const ddp__op_ctx *ctx, const void *send,
                                  void *recv, size_t count, ddp_dtype dtype) {
  ddp__local_backend *b = as_local(base);
  size_t bytes = count * ddp_dtype_size(dtype);
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, bytes * (1 + (size_t)b->size));
  if (use_slots(b, bytes, bytes * (size_t)b->size)) {
    slot_put(b, n, send, bytes, send, recv);
    DDP_TRY(wait_start_all(b, ctx, n));
    for (int q = 0; q < b->size && bytes; q++)
      memcpy((char *)recv + (size_t)q * bytes, ddp__local_slot_of(b->reg, q, n), bytes);
    return DDP_OK;
  }
  op_expose(b, n, send, recv);
  if (b->mem->staged) {
    return ddp__local_staged_allgather(b, ctx, n, send, recv, bytes);
  }
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  /* (In place, send is that block already: peers are reading it.) */
  if ((char *)recv + (size_t)b->rank * bytes != (const char *)send)
    memmove((char *)recv + (size_t)b->rank * bytes, send, bytes);
  for (int i = 1; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    MEM_TRY(q, mem_read(b, q, peer_addr(b, q, 0), (char *)recv + (size_t)q * bytes, bytes));
  }
  return op_finish(b, ctx, n);
}

static ddp_status local_gather(ddp__backend *base, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype, int root) {
  ddp__local_backend *b = as_local(base);
  size_t bytes = count * ddp_dtype_size(dtype);
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, b->rank == root ? bytes * (1 + (size_t)b->size) : bytes);
  if (use_slots(b, bytes, bytes * (size_t)b->size)) {
    slot_put(b, n, send, bytes, send, recv);
    if (b->rank != root) return DDP_OK;
    DDP_TRY(wait_start_all(b, ctx, n));
    for (int q = 0; q < b->size && bytes; q++)
      memcpy((char *)recv + (size_t)q * bytes, ddp__local_slot_of(b->reg, q, n), bytes);
    return DDP_OK;
  }
  op_expose(b, n, send, recv);
  if (b->mem->staged) {
    return ddp__local_staged_gather(b, ctx, n, send, recv, bytes, root);
  }
  if (b->rank != root) {
    /* Root reads this rank's send: keep it until root is done. */
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
    return ddp__local_wait_flag(b, ctx, root, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  }
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  memmove((char *)recv + (size_t)root * bytes, send, bytes);
  for (int i = 1; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    MEM_TRY(q, mem_read(b, q, peer_addr(b, q, 0), (char *)recv + (size_t)q * bytes, bytes));
  }
  ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  return DDP_OK;
}

static ddp_status local_scatter(ddp__backend *base, const ddp__op_ctx *ctx, const void *send,
                                void *recv, size_t count, ddp_dtype dtype, int root) {
  ddp__local_backend *b = as_local(base);
  size_t bytes = count * ddp_dtype_size(dtype);
  size_t all = bytes * (size_t)b->size;
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, b->rank == root ? all + bytes : bytes);
  if (use_slots(b, all, bytes)) {
    slot_put(b, n, b->rank == root ? send : NULL, all, send, recv);
    if (b->rank != root) DDP_TRY(wait_start_of(b, ctx, n, root));
    if (bytes)
      memmove(recv, ddp__local_slot_of(b->reg, root, n) + (size_t)b->rank * bytes, bytes);
    return DDP_OK;
  }
  op_expose(b, n, send, recv);
  if (b->mem->staged) {
    return ddp__local_staged_scatter(b, ctx, n, send, recv, bytes, root);
  }
  if (b->rank == root) {
    memmove(recv, (const char *)send + (size_t)root * bytes, bytes);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
    return ddp__local_wait_all(b, ctx, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  }
  DDP_TRY(wait_start_of(b, ctx, n, root));
  DDP_TRY(peer_active(b, ctx, root));
  MEM_TRY(root, mem_read(b, root, peer_addr(b, root, 0) + (size_t)b->rank * bytes, recv, bytes));
  ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, DDP__LOCAL_STEP_DONE));
  return DDP_OK;
}

static ddp_status local_reduce_scatter(ddp__backend *base, const ddp__op_ctx *ctx,
                                       const void *send, void *recv, size_t count,
                                       ddp_dtype dtype, ddp_reduce_op op) {
  ddp__local_backend *b = as_local(base);
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  size_t all = bytes * (size_t)b->size;
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, all + bytes);
  if (use_slots(b, all, all)) {
    slot_put(b, n, send, all, send, recv);
    DDP_TRY(wait_start_all(b, ctx, n));
    if (bytes) reduce_slots(b, n, (size_t)b->rank * bytes, recv, count, dtype, op);
    return DDP_OK;
  }
  op_expose(b, n, send, recv);
  if (b->mem->staged) {
    return ddp__local_staged_reduce_scatter(b, ctx, n, send, recv, count, dtype, op);
  }
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  size_t seg = DDP__LOCAL_SEGMENT_BYTES / esize;
  for (size_t at = 0; at < count; at += seg) {
    size_t len = count - at < seg ? count - at : seg;
    DDP_TRY(reduce_segment(b, ctx, 0, (size_t)b->rank * bytes + at * esize,
                           (char *)recv + at * esize, false, len, dtype, op));
  }
  return op_finish(b, ctx, n);
}

static ddp_status local_all_to_all(ddp__backend *base, const ddp__op_ctx *ctx, const void *send,
                                   void *recv, size_t count, ddp_dtype dtype) {
  ddp__local_backend *b = as_local(base);
  size_t bytes = count * ddp_dtype_size(dtype);
  size_t all = bytes * (size_t)b->size;
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  ddp__local_count(b, 2 * all);
  if (use_slots(b, all, all)) {
    slot_put(b, n, send, all, send, recv);
    DDP_TRY(wait_start_all(b, ctx, n));
    for (int q = 0; q < b->size && bytes; q++)
      memcpy((char *)recv + (size_t)q * bytes,
             ddp__local_slot_of(b->reg, q, n) + (size_t)b->rank * bytes, bytes);
    return DDP_OK;
  }
  op_expose(b, n, send, recv);
  if (b->mem->staged) {
    return ddp__local_staged_all_to_all(b, ctx, n, send, recv, bytes);
  }
  DDP_TRY(wait_start_all(b, ctx, n));
  DDP_TRY(peers_active(b, ctx));
  for (int i = 0; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    MEM_TRY(q, mem_read(b, q, peer_addr(b, q, 0) + (size_t)b->rank * bytes,
                     (char *)recv + (size_t)q * bytes, bytes));
  }
  return op_finish(b, ctx, n);
}

static ddp_status local_barrier(ddp__backend *base, const ddp__op_ctx *ctx) {
  ddp__local_backend *b = as_local(base);
  uint64_t n;
  DDP_TRY(op_begin(b, ctx, &n));
  op_publish(b, n, NULL, NULL);
  return wait_start_all(b, ctx, n);
}

/* ---- Lifecycle ------------------------------------------------------------- */

const char *ddp__local_group_host(const ddp__local_backend *b, int group_rank) {
  if (b->group_host_names && group_rank >= 0 && group_rank < b->group_size)
    return b->group_host_names[group_rank] ? b->group_host_names[group_rank] : "?";
  for (int q = 0; q < b->size; q++)
    if (b->group_rank[q] == group_rank) return b->host_names[q];
  return "?";
}

int ddp__local_blamed(const ddp__backend *base) {
  ddp__local_backend *b = (ddp__local_backend *)base;
  return atomic_load(&ddp__local_my_ctl(b)->blame);
}

void ddp__local_fail_external(ddp__backend *base, ddp_status st, int blame) {
  ddp__local_backend *b = as_local(base);
  if (b->failed != DDP_OK) return;
  b->blame = blame;
  ddp__local_fail(b, NULL, st);
}

static const char *local_transport(const ddp__backend *base, int peer) {
  const ddp__local_backend *b = (const ddp__local_backend *)base;
  if (peer == b->rank) return "self";
  return b->mem->ops->transport(b->mem, peer);
}

static void local_abort(ddp__backend *base) {
  ddp__local_backend *b = as_local(base);
  atomic_store(&b->aborted, true);
  /* Peers fail fast (naming this rank) even if no op is running here. */
  uint32_t active = DDP__LOCAL_ACTIVE;
  atomic_compare_exchange_strong(&ddp__local_my_ctl(b)->state, &active, DDP__LOCAL_ABORTED);
  ddp__local_wake_all(b);
}

static void free_backend(ddp__local_backend *b) {
  if (b->host_names)
    for (int q = 0; q < b->size; q++) ddp_free(b->host_names[q]);
  ddp_free(b->host_names);
  ddp_free(b->seen);
  ddp_free(b->p2p_next_send);
  ddp_free(b->p2p_next_recv);
  ddp_free(b->p2p_send_held);
  ddp_free(b->p2p_recv_held);
  ddp_free(b->scratch[0]);
  ddp_free(b->scratch[1]);
  ddp_free(b->group_rank);
  ddp_free(b);
}

static void local_destroy(ddp__backend *base) {
  if (!base) return;
  ddp__local_backend *b = as_local(base);
  if (b->mem) {
    ddp__local_ctl *c = ddp__local_my_ctl(b);
    uint32_t active = DDP__LOCAL_ACTIVE;
    atomic_compare_exchange_strong(&c->state, &active, DDP__LOCAL_LEFT);
    ddp__local_wake_all(b);
    b->mem->ops->destroy(b->mem);
  }
  free_backend(b);
}

static void local_counters(const ddp__backend *base, ddp_comm_counters *acc) {
  const ddp__local_backend *b = (const ddp__local_backend *)base;
  uint64_t moved = atomic_load_explicit(&b->moved, memory_order_relaxed) +
                   atomic_load_explicit(&b->p2p_moved, memory_order_relaxed);
  if (strcmp(b->mem->ops->name, "threads") == 0)
    acc->threads_bytes += moved;
  else
    acc->shm_bytes += moved;
}

static const ddp__blocking_ops local_blocking = {
    .allreduce = local_allreduce,
    .broadcast = local_broadcast,
    .reduce = local_reduce,
    .allgather = local_allgather,
    .gather = local_gather,
    .scatter = local_scatter,
    .reduce_scatter = local_reduce_scatter,
    .all_to_all = local_all_to_all,
    .barrier = local_barrier,
    .send = ddp__local_send,
    .recv = ddp__local_recv,
};

static const ddp__backend_ops local_ops = {
    .name = "local",
    .caps = DDP__CAPS_HOST_BLOCKING,
    .enqueue = ddp__blocking_enqueue,
    .blocking = &local_blocking,
    .p2p_progress = ddp__local_p2p_progress,
    .p2p_wake = ddp__local_p2p_wake,
    .transport = local_transport,
    .counters = local_counters,
    .abort = local_abort,
    .destroy = local_destroy,
};

static int online_cpus(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

void ddp__local_publish_cpus(ddp__local_ctl *ctl) {
  memset(ctl->cpus, 0, sizeof ctl->cpus);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return;
  uint64_t words[DDP__LOCAL_CPU_WORDS] = {0};
  for (int c = 0; c < CPU_SETSIZE; c++) {
    if (!CPU_ISSET(c, &set)) continue;
    if (c >= DDP__LOCAL_CPU_WORDS * 64) return; /* unknown: all zero */
    words[c / 64] |= 1ull << (c % 64);
  }
  memcpy(ctl->cpus, words, sizeof words);
}

int ddp__local_shared_cpus(ddp__local_region *reg, int size) {
  int online = online_cpus();
  uint64_t all[DDP__LOCAL_CPU_WORDS] = {0};
  for (int q = 0; q < size; q++) {
    const uint64_t *m = ddp__local_ctl_of(reg, q)->cpus;
    uint64_t any = 0;
    for (int w = 0; w < DDP__LOCAL_CPU_WORDS; w++) any |= m[w], all[w] |= m[w];
    if (!any) return online;
  }
  int n = 0;
  for (int w = 0; w < DDP__LOCAL_CPU_WORDS; w++) n += __builtin_popcountll(all[w]);
  return n < online ? n : online;
}

bool ddp__local_pinned_apart(ddp__local_region *reg, int size) {
  uint64_t all[DDP__LOCAL_CPU_WORDS] = {0};
  for (int q = 0; q < size; q++) {
    const uint64_t *m = ddp__local_ctl_of(reg, q)->cpus;
    int bits = 0;
    for (int w = 0; w < DDP__LOCAL_CPU_WORDS; w++) {
      bits += __builtin_popcountll(m[w]);
      if (all[w] & m[w]) return false;
      all[w] |= m[w];
    }
    if (bits != 1) return false;
  }
  return true;
}

ddp_status ddp__backend_local_create(const ddp__backend_config *cfg, ddp__backend **out) {
  *out = NULL;
  if (!cfg || cfg->size < 1 || cfg->size > DDP__LOCAL_MAX_RANKS || cfg->rank < 0 ||
      cfg->rank >= cfg->size || !cfg->store)
    return ddp_error(DDP_ERR_INVALID, "local backend: bad configuration (rank %d of %d)",
                     cfg ? cfg->rank : -1, cfg ? cfg->size : 0);
  bool one_process = true;
  for (int q = 0; q < cfg->size; q++) {
    if (cfg->host_of && cfg->host_of[q] != cfg->host_of[cfg->rank])
      return ddp_error(DDP_ERR_INVALID, "local backend: rank %d is on another host", q);
    if (cfg->process_of && cfg->process_of[q] != cfg->process_of[0]) one_process = false;
  }
  ddp__local_backend *b = ddp_calloc(1, sizeof *b);
  if (!b) return ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
  b->base.ops = &local_ops;
  b->rank = cfg->rank;
  b->size = cfg->size;
  atomic_init(&b->aborted, false);
  b->blame = -1;
  ddp_status stores_st = ddp__local_stores_from_env(&b->stores);
  if (stores_st != DDP_OK) {
    ddp_free(b);
    return stores_st;
  }
  size_t n = (size_t)cfg->size;
  b->seen = ddp_calloc(n, sizeof *b->seen);
  b->p2p_next_send = ddp_calloc(n, sizeof *b->p2p_next_send);
  b->p2p_next_recv = ddp_calloc(n, sizeof *b->p2p_next_recv);
  b->host_names = ddp_calloc(n, sizeof *b->host_names);
  b->p2p_send_held = ddp_calloc(n, 1);
  b->p2p_recv_held = ddp_calloc(n, 1);
  b->group_rank = ddp_calloc(n, sizeof *b->group_rank);
  b->scratch[0] = ddp_alloc(DDP__LOCAL_SEGMENT_BYTES);
  b->scratch[1] = ddp_alloc(DDP__LOCAL_SEGMENT_BYTES);
  if (!b->seen || !b->p2p_next_send || !b->p2p_next_recv || !b->p2p_send_held ||
      !b->p2p_recv_held || !b->host_names || !b->group_rank || !b->scratch[0] ||
      !b->scratch[1]) {
    free_backend(b);
    return ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
  }
  b->group_size = cfg->group_ranks ? cfg->group_size : cfg->size;
  b->group_host_names = cfg->group_ranks ? cfg->group_host_names : NULL;
  for (size_t q = 0; q < n; q++) {
    b->group_rank[q] = cfg->group_ranks ? cfg->group_ranks[q] : (int)q;
    const char *h = cfg->host_names && cfg->host_names[q] ? cfg->host_names[q] : "local";
    b->host_names[q] = ddp_strdup(h);
    if (!b->host_names[q]) {
      free_backend(b);
      return ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
    }
  }
  ddp_status st = one_process ? ddp__local_threads_create(cfg, &b->mem)
                              : ddp__local_shm_create(cfg, &b->mem);
  if (st != DDP_OK) {
    free_backend(b);
    return st;
  }
  b->reg = b->mem->region;
  if (b->mem->staged) ddp__local_stage_prefault(b);
  /* Spin about 20 us before sleeping when every rank can have a core; barely
   * at all when they outnumber the CPUs they may run on together (the union
   * of their affinity masks: `taskset -c 0` on 2 ranks, or more ranks than
   * the host has), since the peer then needs this CPU to make progress.
   * Waits shorten long spins themselves when they find ranks stacked on one
   * core by the scheduler (local/sync.c). */
  b->host_cpus = ddp__local_shared_cpus(b->reg, cfg->size);
  b->spin_long = cfg->size <= b->host_cpus ? DDP__LOCAL_SPIN_LONG : DDP__LOCAL_SPIN_SHORT;
  b->spin_iters = b->spin_long;
  b->pinned_apart = ddp__local_pinned_apart(b->reg, cfg->size);
  if (b->spin_long < DDP__LOCAL_SPIN_LONG && cfg->rank == 0)
    DDP_INFO("local backend: %d ranks may use %d CPUs together; waits spin briefly, then sleep",
             cfg->size, b->host_cpus);
  b->yield_iters = 16;
  *out = &b->base;
  return DDP_OK;
}
