/* The local backend's collectives between processes: data moves only
 * through staging chunks in the shared segment (per rank two chunks, plus
 * two shared result chunks; ddp__local_chunk_bytes), never through peers'
 * buffers, which a process can reach only by cross-memory attach at about
 * half memcpy speed. A chunk's copies stay in cache, so memory sees about
 * one read and one write of each rank's buffer. Called by local/local.c for op n
 * once its START is posted. */
#include <string.h>
#include <sys/mman.h>

#include "comm/local/local.h"
#include "ddp/tensor.h"

void ddp__local_stage_prefault(ddp__local_backend *b) {
  ddp__local_region *reg = b->reg;
  size_t area = 2 * reg->chunk_bytes;
  /* The kernel fills in the pages (every rank's staging is contiguous and
   * page-aligned) without touching their bytes, so ranks that are threads
   * of one process, doing this at once, do not race. Before Linux 5.14
   * (EINVAL) this rank writes its own area and leaves the peers' to their
   * first ops. */
  if (madvise(ddp__local_stage_of(reg, 0, 0), area * (size_t)b->size, MADV_POPULATE_WRITE) != 0)
    memset(ddp__local_stage_of(reg, b->rank, 0), 0, area);
}

/* Where op n's single chunk of `bytes` goes in a rank's staging area (both
 * of its chunks, contiguous): at the next `bytes`-sized (4 KiB-aligned)
 * place after op n-1's, wrapping around within DDP__LOCAL_PAIR_WINDOW (at
 * least two places). Writing lines the peer read in the last op, still in
 * its L2, costs a cross-core invalidation each (a copy at about 10 GB/s);
 * lines it read some ops ago have left its L2 for the shared L3 and cost
 * far less. Every rank computes the same offset from n, and the previous op
 * ended with the peer done reading, so any place is free. */
static size_t pair_stage_offset(const ddp__local_region *reg, uint64_t n, size_t bytes) {
  size_t span = (bytes + 4095) / 4096 * 4096;
  size_t places = DDP__LOCAL_PAIR_WINDOW / span;
  if (places < 2) places = 2;
  if (places > 2 * reg->chunk_bytes / span) places = 2 * reg->chunk_bytes / span;
  return (size_t)(n % places) * span;
}

/* Large allreduce of two processes: chunk k of the buffer: each rank copies
 * it into its staging[k % 2] and posts 2 + 2k; once both have, each reduces
 * the two stagings' chunk k into its own buffer (own data read in place) in
 * rank order, so both get the same bits, and posts 3 + 2k. Against the
 * reduce-scatter below, each rank reads L instead of 1.5 L and writes L
 * instead of 1.5 L of shared memory, and waits once per chunk instead of
 * twice (2 MiB: 18 against 12 GB/s when the cores share a cache). A rank
 * restages staging[k % 2] for chunk k + 2 after the peer's 3 + 2k (it has
 * read chunk k), and the op ends after the peer's last 3 + 2k, so that the
 * next op may stage anywhere. */
static ddp_status staged_allreduce_pair(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                        void *buf, size_t count, ddp_dtype dtype,
                                        ddp_reduce_op op) {
  size_t esize = ddp_dtype_size(dtype);
  size_t chunk = b->reg->chunk_bytes / esize;
  ddp__local_region *reg = b->reg;
  /* An op of one chunk moves around DDP__LOCAL_PAIR_WINDOW of the staging
   * area; longer ones alternate its two chunks. */
  size_t one = count <= chunk ? pair_stage_offset(reg, n, count * esize) : 0;
  uint32_t k = 0;
  for (size_t at = 0; at < count; at += chunk, k++) {
    size_t len = count - at < chunk ? count - at : chunk;
    char *mine = (char *)buf + at * esize;
    if (k >= 2) DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 3 + 2 * (k - 2))));
    ddp__local_shared_copy(b, ddp__local_stage_of(reg, b->rank, k) + one, mine, len * esize);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 2 + 2 * k));
    DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 2 + 2 * k)));
    const void *src[2];
    src[b->rank] = mine;
    src[1 - b->rank] = ddp__local_stage_of(reg, 1 - b->rank, k) + one;
    ddp__local_reduce_ranks(mine, src, 2, len, dtype, op);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 3 + 2 * k));
  }
  if (k > 0) DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 3 + 2 * (k - 1))));
  return DDP_OK;
}

/* Large allreduce through the region's staging, for processes (where
 * reading a peer's buffer in place costs a cross-memory copy at about half
 * memcpy speed). Chunk k of the buffer: every rank copies it into its
 * staging[k % 2] and posts 2 + 2k; rank r reduces sub-slice r of the chunk
 * from every rank's staging into result[k % 2] and posts 3 + 2k; every
 * rank copies the whole result chunk into its buffer. A chunk's copies stay
 * in cache, so memory sees about one read and one write of the buffer.
 * Double buffering is safe without further waits: a rank stages chunk k
 * after waiting for everyone's 3 + 2(k-1), so nobody still reads its
 * staging[k % 2] from chunk k-2; and it writes result[k % 2] after
 * everyone's 2 + 2k, posted after they copied chunk k-2 out of it. Peers
 * never read this rank's buffer, so no final barrier is needed. */
ddp_status ddp__local_staged_allreduce(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       void *buf, size_t count, ddp_dtype dtype,
                                       ddp_reduce_op op) {
  if (b->size == 2) return staged_allreduce_pair(b, ctx, n, buf, count, dtype, op);
  size_t esize = ddp_dtype_size(dtype);
  size_t chunk = b->reg->chunk_bytes / esize;
  ddp__local_region *reg = b->reg;
  uint32_t k = 0;
  for (size_t at = 0; at < count; at += chunk, k++) {
    size_t len = count - at < chunk ? count - at : chunk;
    char *mine = (char *)buf + at * esize;
    /* Stage all but this rank's own sub-slice (only it reads that, from
     * its buffer). */
    size_t lo = ddp__local_slice_lo(len, b->size, b->rank, esize);
    size_t hi = ddp__local_slice_lo(len, b->size, b->rank + 1, esize);
    uint8_t *stage = ddp__local_stage_of(reg, b->rank, k);
    bool streamed = ddp__local_shared_copy(b, stage, mine, lo * esize);
    streamed |= ddp__local_shared_copy(b, stage + hi * esize, mine + hi * esize, (len - hi) * esize);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 2 + 2 * k));
    DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 2 + 2 * k)));
    if (hi > lo) {
      size_t off = lo * esize;
      const void *src[DDP__LOCAL_MAX_RANKS];
      for (int q = 0; q < b->size; q++)
        src[q] = q == b->rank ? (const uint8_t *)mine + off : ddp__local_stage_of(reg, q, k) + off;
      ddp__local_reduce_to_shared(ddp__local_result_of(reg, k) + off, src, b->size, hi - lo, dtype,
                                  op, streamed);
    }
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 3 + 2 * k));
    DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 3 + 2 * k)));
    memcpy(mine, ddp__local_result_of(reg, k), len * esize);
  }
  return DDP_OK;
}

/* ---- Streaming through staging (processes) --------------------------------
 * Every rank streams `bytes` bytes of its own (only rank `only` when >= 0)
 * through its staging chunks; after each chunk is staged everywhere, each
 * rank consumes the parts it needs from the ranks' staging. Same waits as
 * ddp__local_staged_allreduce; peers never read a rank's own buffers. */
typedef struct stream_args {
  ddp__local_backend *b;
  void *dst;       /* the op's output */
  size_t block;    /* bytes per rank block (count * esize) */
  ddp_dtype dtype;
  ddp_reduce_op op;
  int root;
} stream_args;

/* Consumes [off, off + len) of rank q's stream, staged at p. */
typedef void (*stream_consume_fn)(stream_args *a, int q, size_t off, const uint8_t *p, size_t len);

static ddp_status stream_all(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                             const void *src, size_t bytes, int only, stream_consume_fn consume,
                             stream_args *a) {
  ddp__local_region *reg = b->reg;
  uint32_t k = 0;
  size_t chunk = reg->chunk_bytes;
  for (size_t at = 0; at < bytes; at += chunk, k++) {
    size_t len = bytes - at < chunk ? bytes - at : chunk;
    if (only < 0 || only == b->rank)
      ddp__local_shared_copy(b, ddp__local_stage_of(reg, b->rank, k), (const char *)src + at, len);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 2 + 2 * k));
    if (only >= 0)
      DDP_TRY(ddp__local_wait_flag(b, ctx, only, ddp__local_flag(n, 2 + 2 * k)));
    else
      DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 2 + 2 * k)));
    for (int q = 0; q < b->size; q++)
      if (only < 0 || q == only) consume(a, q, at, ddp__local_stage_of(reg, q, k), len);
    ddp__local_post(b, &ddp__local_my_ctl(b)->flag, ddp__local_flag(n, 3 + 2 * k));
    DDP_TRY(ddp__local_wait_all(b, ctx, ddp__local_flag(n, 3 + 2 * k)));
  }
  return DDP_OK;
}

/* The part of [off, off + len) inside block `blk` of a stream of blocks:
 * false when empty, else *from (stream offset) and *n (bytes). */
static bool block_part(size_t off, size_t len, size_t block, int blk, size_t *from, size_t *n) {
  size_t lo = block * (size_t)blk, hi = lo + block;
  size_t a = off > lo ? off : lo, e = off + len < hi ? off + len : hi;
  if (a >= e) return false;
  *from = a;
  *n = e - a;
  return true;
}

static void consume_copy_root(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  if (a->b->rank != a->root) memcpy((char *)a->dst + off, p, len);
}

static void consume_gather_all(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  memcpy((char *)a->dst + (size_t)q * a->block + off, p, len);
}

static void consume_gather_root(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  if (a->b->rank == a->root) consume_gather_all(a, q, off, p, len);
}

static void consume_my_block(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  size_t from, n;
  int r = a->b->rank;
  if (!block_part(off, len, a->block, r, &from, &n)) return;
  memcpy((char *)a->dst + (from - a->block * (size_t)r), p + (from - off), n);
}

static void consume_all_to_all(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  size_t from, n;
  int r = a->b->rank;
  if (!block_part(off, len, a->block, r, &from, &n)) return;
  memcpy((char *)a->dst + (size_t)q * a->block + (from - a->block * (size_t)r), p + (from - off),
         n);
}

/* dst (n bytes) := q == 0 ? p : dst op p, then AVG's division after the last
 * rank: the reduction in rank order. */
static void reduce_step(stream_args *a, int q, void *dst, const uint8_t *p, size_t n) {
  size_t esize = ddp_dtype_size(a->dtype), count = n / esize;
  if (q == 0)
    memcpy(dst, p, n);
  else
    ddp__reduce_into(dst, p, count, a->dtype, a->op);
  if (q == a->b->size - 1 && a->op == DDP_REDUCE_AVG)
    ddp__reduce_scale(dst, count, a->dtype, a->b->size);
}

static void consume_reduce_root(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  if (a->b->rank == a->root) reduce_step(a, q, (char *)a->dst + off, p, len);
}

static void consume_reduce_block(stream_args *a, int q, size_t off, const uint8_t *p, size_t len) {
  size_t from, n;
  int r = a->b->rank;
  if (!block_part(off, len, a->block, r, &from, &n)) return;
  reduce_step(a, q, (char *)a->dst + (from - a->block * (size_t)r), p + (from - off), n);
}

/* ---- The collectives ------------------------------------------------------ */

ddp_status ddp__local_staged_broadcast(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       void *buf, size_t bytes, int root) {
  stream_args a = {.b = b, .dst = buf, .root = root};
  return stream_all(b, ctx, n, buf, bytes, root, consume_copy_root, &a);
}

ddp_status ddp__local_staged_reduce(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                    void *buf, size_t count, ddp_dtype dtype, ddp_reduce_op op,
                                    int root) {
  stream_args a = {.b = b, .dst = buf, .dtype = dtype, .op = op, .root = root};
  return stream_all(b, ctx, n, buf, count * ddp_dtype_size(dtype), -1, consume_reduce_root, &a);
}

ddp_status ddp__local_staged_allgather(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       const void *send, void *recv, size_t bytes) {
  stream_args a = {.b = b, .dst = recv, .block = bytes};
  return stream_all(b, ctx, n, send, bytes, -1, consume_gather_all, &a);
}

ddp_status ddp__local_staged_gather(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                    const void *send, void *recv, size_t bytes, int root) {
  stream_args a = {.b = b, .dst = recv, .block = bytes, .root = root};
  return stream_all(b, ctx, n, send, bytes, -1, consume_gather_root, &a);
}

ddp_status ddp__local_staged_scatter(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                     const void *send, void *recv, size_t bytes, int root) {
  stream_args a = {.b = b, .dst = recv, .block = bytes, .root = root};
  return stream_all(b, ctx, n, send, bytes * (size_t)b->size, root, consume_my_block, &a);
}

ddp_status ddp__local_staged_reduce_scatter(ddp__local_backend *b, const ddp__op_ctx *ctx,
                                            uint64_t n, const void *send, void *recv,
                                            size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  size_t bytes = count * ddp_dtype_size(dtype);
  stream_args a = {.b = b, .dst = recv, .block = bytes, .dtype = dtype, .op = op};
  return stream_all(b, ctx, n, send, bytes * (size_t)b->size, -1, consume_reduce_block, &a);
}

ddp_status ddp__local_staged_all_to_all(ddp__local_backend *b, const ddp__op_ctx *ctx,
                                        uint64_t n, const void *send, void *recv, size_t bytes) {
  stream_args a = {.b = b, .dst = recv, .block = bytes};
  return stream_all(b, ctx, n, send, bytes * (size_t)b->size, -1, consume_all_to_all, &a);
}
