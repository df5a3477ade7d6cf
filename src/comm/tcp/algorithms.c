/* The tcp backend's collectives, written as schedules of framed transfers
 * that the engine (tcp/engine.c) runs overlapped:
 *   allreduce       recursive doubling (up to 8 KiB), halving-doubling (up
 *                   to 512 KiB; for both, non-power-of-two sizes fold the
 *                   extra ranks in first and out last), else a pipelined
 *                   ring (reduce-scatter then allgather, in segments:
 *                   segment j moves on as soon as it has arrived)
 *   broadcast       binomial tree (small), else a pipelined chain
 *   reduce          binomial tree (small), else a pipelined chain
 *   allgather       pipelined ring;  reduce_scatter  pipelined ring
 *   gather/scatter  straight to / from the root, all peers at once
 *   all_to_all      every pair at once;  barrier  dissemination
 * Received data is reduced as it arrives (in pieces), so reducing overlaps
 * the network. */
#include <string.h>

#include "comm/tcp/tcp.h"

/* Messages up to this size use the latency-bound algorithms (binomial
 * trees; allreduce: recursive doubling up to DOUBLING_BYTES, then halving-
 * doubling up to SMALL_BYTES, then the ring). */
#define SMALL_BYTES (64u * 1024u)
#define DOUBLING_BYTES (8u * 1024u)
#define HALVING_BYTES (512u * 1024u)
/* The unit a pipelined ring or chain moves. */
#define SEGMENT_BYTES (1024u * 1024u)

static ddp__tcp_backend *as_tcp(ddp__backend *be) { return (ddp__tcp_backend *)be; }

/* Start of part i of n of `count` elements (the first count % n parts get
 * one more). */
static size_t part_off(size_t count, int n, int i) {
  size_t base = count / (size_t)n, extra = count % (size_t)n;
  return base * (size_t)i + ((size_t)i < extra ? (size_t)i : extra);
}

static int mod(int a, int p) { return ((a % p) + p) % p; }

/* Segments per chunk so that none exceeds SEGMENT_BYTES (the same on every
 * rank: it depends on count, dtype and size only). */
static int segments_for(size_t max_chunk_elems, size_t esize) {
  size_t seg_elems = SEGMENT_BYTES / esize;
  size_t nseg = (max_chunk_elems + seg_elems - 1) / seg_elems;
  return nseg < 1 ? 1 : (int)nseg;
}

static ddp_status sticky(ddp__tcp_backend *b) {
  return b->failed ? ddp_error(b->failed, "%s", b->failed_msg) : DDP_OK;
}

/* ---- Ring reduce-scatter / allgather --------------------------------------
 * The buffer `work` holds p chunks (chunk c: elements part_off(count, p, c)
 * ..). Reduce-scatter step k sends chunk (first - k) to the right and
 * reduces chunk (first - k - 1) from the left into work, so after p - 1
 * steps this rank holds the reduction of chunk (first - p + 1). Allgather
 * step k sends chunk (gfirst - k) and receives chunk (gfirst - k - 1). Every
 * chunk is cut into nseg segments; segment j of step k+1 is sent as soon as
 * segment j of step k has arrived. */
typedef struct ring_plan {
  char *work;
  const char *first_send; /* RS step 0's data (NULL: from work) */
  size_t count, esize;
  int p, rank, nseg;
  int rs_first;  /* chunk sent at RS step 0, or -1 for no RS */
  int ag_first;  /* chunk sent at AG step 0, or -1 for no AG */
  ddp_dtype dtype;
  ddp_reduce_op op;
} ring_plan;

static void seg_range(const ring_plan *r, int chunk, int j, size_t *off, size_t *len) {
  size_t c0 = part_off(r->count, r->p, chunk), c1 = part_off(r->count, r->p, chunk + 1);
  size_t s0 = part_off(c1 - c0, r->nseg, j), s1 = part_off(c1 - c0, r->nseg, j + 1);
  *off = (c0 + s0) * r->esize;
  *len = (s1 - s0) * r->esize;
}

static ddp_status ring_run(ddp__tcp_backend *b, const ddp__op_ctx *ctx, const ring_plan *r) {
  int p = r->p, nseg = r->nseg, steps = p - 1;
  int phases = (r->rs_first >= 0) + (r->ag_first >= 0);
  int per_phase = steps * nseg;
  int n = 2 * phases * per_phase;
  ddp__tcp_xfer *x = ddp__tcp_xfers(b, n);
  if (!x) return DDP_ERR_NOMEM;
  int right = mod(r->rank + 1, p), left = mod(r->rank - 1, p);
  int send_base = phases * per_phase;
  int phase = 0;
  if (r->rs_first >= 0) {
    for (int k = 0; k < steps; k++) {
      for (int j = 0; j < nseg; j++) {
        size_t off, len;
        int ri = k * nseg + j, si = send_base + ri;
        seg_range(r, mod(r->rs_first - k - 1, p), j, &off, &len);
        ddp__tcp_post_recv_reduce(&x[ri], left, r->work + off, len, r->dtype, r->op);
        seg_range(r, mod(r->rs_first - k, p), j, &off, &len);
        const char *src = (k == 0 && r->first_send ? r->first_send : r->work) + off;
        ddp__tcp_post_send(&x[si], right, src, len);
        x[si].after = k == 0 ? -1 : ri - nseg;
      }
    }
    phase = 1;
  }
  if (r->ag_first >= 0) {
    for (int k = 0; k < steps; k++) {
      for (int j = 0; j < nseg; j++) {
        size_t off, len;
        int ri = phase * per_phase + k * nseg + j, si = send_base + ri;
        seg_range(r, mod(r->ag_first - k - 1, p), j, &off, &len);
        ddp__tcp_post_recv(&x[ri], left, r->work + off, len);
        seg_range(r, mod(r->ag_first - k, p), j, &off, &len);
        ddp__tcp_post_send(&x[si], right, r->work + off, len);
        /* Step 0 sends what reduce-scatter finished (or local data). */
        x[si].after = k > 0 ? ri - nseg : phase ? (steps - 1) * nseg + j : -1;
      }
    }
  }
  return ddp__tcp_run(b, ctx, x, n);
}

/* ---- Allreduce ------------------------------------------------------------- */

/* With p not a power of two, the first 2 * rem ranks pair up: even ones
 * hand their data to the odd neighbour and sit out (vrank -1), then get the
 * result back (fold_out). The others get vranks 0..pof2-1. */
static ddp_status fold_in(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                          ddp_dtype dtype, ddp_reduce_op op, int *pof2_out, int *rem_out,
                          int *vrank_out) {
  int p = b->vsize, rank = b->vrank;
  ddp__tcp_xfer *x = b->xfers;
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  int rem = p - pof2;
  *pof2_out = pof2;
  *rem_out = rem;
  *vrank_out = rank < 2 * rem ? (rank % 2 ? rank / 2 : -1) : rank - rem;
  if (rank >= 2 * rem) return DDP_OK;
  if (rank % 2 == 0)
    ddp__tcp_post_send(&x[0], rank + 1, buf, bytes);
  else
    ddp__tcp_post_recv_reduce(&x[0], rank - 1, buf, bytes, dtype, op);
  return ddp__tcp_run(b, ctx, x, 1);
}

static ddp_status fold_out(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                           int rem) {
  int rank = b->vrank;
  if (rank >= 2 * rem) return DDP_OK;
  ddp__tcp_xfer *x = b->xfers;
  if (rank % 2 == 0)
    ddp__tcp_post_recv(&x[0], rank + 1, buf, bytes);
  else
    ddp__tcp_post_send(&x[0], rank - 1, buf, bytes);
  return ddp__tcp_run(b, ctx, x, 1);
}

static int real_rank(int vrank, int rem) { return vrank < rem ? vrank * 2 + 1 : vrank + rem; }

/* Recursive doubling: log2(pof2) rounds exchanging the whole buffer. */
static ddp_status allreduce_doubling(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf,
                                     size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  size_t bytes = count * ddp_dtype_size(dtype);
  void *tmp = ddp__tcp_scratch(b, bytes);
  if (!tmp) return DDP_ERR_NOMEM;
  int pof2, rem, vrank;
  DDP_TRY(fold_in(b, ctx, buf, bytes, dtype, op, &pof2, &rem, &vrank));
  ddp__tcp_xfer *x = b->xfers;
  for (int mask = 1; vrank >= 0 && mask < pof2; mask <<= 1) {
    int peer = real_rank(vrank ^ mask, rem);
    ddp__tcp_post_send(&x[0], peer, buf, bytes);
    ddp__tcp_post_recv(&x[1], peer, tmp, bytes);
    DDP_TRY(ddp__tcp_run(b, ctx, x, 2));
    ddp__reduce_into(buf, tmp, count, dtype, op);
  }
  return fold_out(b, ctx, buf, bytes, rem);
}

/* Halving-doubling (Rabenseifner): reduce-scatter by recursive halving (each
 * round keeps half of the current range and reduces the peer's copy of it
 * in as it arrives), then allgather by recursive doubling back up the same
 * ranges. Each element is reduced by one rank only, so all get the same
 * bits. */
static ddp_status allreduce_halving(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf,
                                    size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  char *base = buf;
  int pof2, rem, vrank;
  DDP_TRY(fold_in(b, ctx, buf, bytes, dtype, op, &pof2, &rem, &vrank));
  ddp__tcp_xfer *x = b->xfers;
  if (vrank >= 0) {
    size_t lo_at[32], hi_at[32]; /* the range held before round `level` */
    size_t lo = 0, hi = count;
    int level = 0;
    for (int mask = pof2 >> 1; mask >= 1; mask >>= 1, level++) {
      int peer = real_rank(vrank ^ mask, rem);
      size_t mid = lo + (hi - lo) / 2;
      lo_at[level] = lo;
      hi_at[level] = hi;
      bool keep_low = (vrank & mask) == 0;
      size_t klo = keep_low ? lo : mid, khi = keep_low ? mid : hi;
      size_t slo = keep_low ? mid : lo, shi = keep_low ? hi : mid;
      ddp__tcp_post_send(&x[0], peer, base + slo * esize, (shi - slo) * esize);
      ddp__tcp_post_recv_reduce(&x[1], peer, base + klo * esize, (khi - klo) * esize, dtype, op);
      DDP_TRY(ddp__tcp_run(b, ctx, x, 2));
      lo = klo;
      hi = khi;
    }
    for (int mask = 1; mask < pof2; mask <<= 1) {
      level--;
      int peer = real_rank(vrank ^ mask, rem);
      /* The peer holds the other half of the range held before `level`. */
      size_t plo = lo == lo_at[level] ? hi : lo_at[level];
      size_t phi = lo == lo_at[level] ? hi_at[level] : lo;
      ddp__tcp_post_send(&x[0], peer, base + lo * esize, (hi - lo) * esize);
      ddp__tcp_post_recv(&x[1], peer, base + plo * esize, (phi - plo) * esize);
      DDP_TRY(ddp__tcp_run(b, ctx, x, 2));
      lo = lo_at[level];
      hi = hi_at[level];
    }
  }
  return fold_out(b, ctx, buf, bytes, rem);
}

ddp_status ddp__tcp_allreduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  if (p == 1 || count == 0) return DDP_OK; /* AVG over one rank: unchanged */
  size_t esize = ddp_dtype_size(dtype);
  size_t bytes = count * esize;
  if (bytes <= DOUBLING_BYTES || count < (size_t)p) {
    DDP_TRY(allreduce_doubling(b, ctx, buf, count, dtype, op));
  } else if (bytes <= HALVING_BYTES) {
    DDP_TRY(allreduce_halving(b, ctx, buf, count, dtype, op));
  } else {
    ring_plan r = {.work = buf, .count = count, .esize = esize, .p = p, .rank = b->vrank,
                   .nseg = segments_for(part_off(count, p, 1), esize), .rs_first = b->vrank,
                   .ag_first = mod(b->vrank + 1, p), .dtype = dtype, .op = op};
    DDP_TRY(ring_run(b, ctx, &r));
  }
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, p);
  return DDP_OK;
}

/* ---- Broadcast and reduce -------------------------------------------------- */

ddp_status ddp__tcp_broadcast(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, int root) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  if (p == 1 || count == 0) return DDP_OK;
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  int vrank = mod(b->vrank - root, p);
  if (bytes <= SMALL_BYTES) {
    /* Binomial tree: receive from the parent, then send to every child at once. */
    ddp__tcp_xfer *x = b->xfers;
    int mask = 1;
    while (mask < p) {
      if (vrank & mask) {
        ddp__tcp_post_recv(&x[0], mod(vrank - mask + root, p), buf, bytes);
        DDP_TRY(ddp__tcp_run(b, ctx, x, 1));
        break;
      }
      mask <<= 1;
    }
    int n = 0;
    for (mask >>= 1; mask > 0; mask >>= 1)
      if (vrank + mask < p) ddp__tcp_post_send(&x[n++], mod(vrank + mask + root, p), buf, bytes);
    return ddp__tcp_run(b, ctx, x, n);
  }
  /* Pipelined chain root -> root+1 -> ...: segment j is forwarded as soon as
   * it has arrived. */
  int nseg = segments_for(count, esize);
  ddp__tcp_xfer *x = ddp__tcp_xfers(b, 2 * nseg);
  if (!x) return DDP_ERR_NOMEM;
  int n = 0;
  int prev = mod(b->vrank - 1, p), next = mod(b->vrank + 1, p);
  if (vrank > 0)
    for (int j = 0; j < nseg; j++) {
      size_t s0 = part_off(count, nseg, j), s1 = part_off(count, nseg, j + 1);
      ddp__tcp_post_recv(&x[n++], prev, (char *)buf + s0 * esize, (s1 - s0) * esize);
    }
  if (vrank < p - 1) {
    for (int j = 0; j < nseg; j++) {
      size_t s0 = part_off(count, nseg, j), s1 = part_off(count, nseg, j + 1);
      ddp__tcp_post_send(&x[n], next, (char *)buf + s0 * esize, (s1 - s0) * esize);
      x[n++].after = vrank > 0 ? j : -1;
    }
  }
  return ddp__tcp_run(b, ctx, x, n);
}

ddp_status ddp__tcp_reduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                           ddp_dtype dtype, ddp_reduce_op op, int root) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  if (p == 1 || count == 0) return DDP_OK;
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  int vrank = mod(b->vrank - root, p);
  /* Non-roots reduce into a copy: their buffer stays as it was. */
  char *acc = buf;
  if (vrank != 0) {
    acc = ddp__tcp_scratch(b, bytes);
    if (!acc) return DDP_ERR_NOMEM;
    memcpy(acc, buf, bytes);
  }
  if (bytes <= SMALL_BYTES) {
    /* Binomial tree towards the root. */
    ddp__tcp_xfer *x = b->xfers;
    for (int mask = 1; mask < p; mask <<= 1) {
      if (vrank & mask) {
        ddp__tcp_post_send(&x[0], mod(vrank - mask + root, p), acc, bytes);
        DDP_TRY(ddp__tcp_run(b, ctx, x, 1));
        break;
      }
      if (vrank + mask < p) {
        ddp__tcp_post_recv_reduce(&x[0], mod(vrank + mask + root, p), acc, bytes, dtype, op);
        DDP_TRY(ddp__tcp_run(b, ctx, x, 1));
      }
    }
  } else {
    /* Pipelined chain from root-1 (= root+p-1) down to the root. */
    int nseg = segments_for(count, esize);
    ddp__tcp_xfer *x = ddp__tcp_xfers(b, 2 * nseg);
    if (!x) return DDP_ERR_NOMEM;
    int n = 0;
    int from = mod(b->vrank + 1, p), to = mod(b->vrank - 1, p);
    if (vrank < p - 1)
      for (int j = 0; j < nseg; j++) {
        size_t s0 = part_off(count, nseg, j), s1 = part_off(count, nseg, j + 1);
        ddp__tcp_post_recv_reduce(&x[n++], from, acc + s0 * esize, (s1 - s0) * esize, dtype, op);
      }
    if (vrank > 0) {
      bool received = vrank < p - 1;
      for (int j = 0; j < nseg; j++) {
        size_t s0 = part_off(count, nseg, j), s1 = part_off(count, nseg, j + 1);
        ddp__tcp_post_send(&x[n], to, acc + s0 * esize, (s1 - s0) * esize);
        x[n++].after = received ? j : -1;
      }
    }
    DDP_TRY(ddp__tcp_run(b, ctx, x, n));
  }
  if (vrank == 0 && op == DDP_REDUCE_AVG) ddp__reduce_scale(buf, count, dtype, p);
  return DDP_OK;
}

/* ---- Gathers and scatters -------------------------------------------------- */

ddp_status ddp__tcp_allgather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                              void *recv, size_t count, ddp_dtype dtype) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  char *own = (char *)recv + (size_t)b->vrank * bytes;
  if (bytes && own != send) memmove(own, send, bytes);
  if (p == 1 || count == 0) return DDP_OK;
  /* The ring over blocks of `count`: chunk c of the p-chunk split of
   * p * count elements is exactly block c. */
  ring_plan r = {.work = recv, .count = count * (size_t)p, .esize = esize, .p = p,
                 .rank = b->vrank, .nseg = segments_for(count, esize), .rs_first = -1,
                 .ag_first = b->vrank, .dtype = dtype};
  return ring_run(b, ctx, &r);
}

ddp_status ddp__tcp_reduce_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                                   void *recv, size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  size_t esize = ddp_dtype_size(dtype), bytes = count * esize;
  if (p == 1 || count == 0) {
    if (bytes && recv != send) memmove(recv, send, bytes);
    return DDP_OK;
  }
  /* Reduce in a copy of send; step 0 sends straight from send. Starting the
   * ring at chunk rank - 1 leaves this rank with block `rank` reduced. */
  char *work = ddp__tcp_scratch(b, bytes * (size_t)p);
  if (!work) return DDP_ERR_NOMEM;
  memcpy(work, send, bytes * (size_t)p);
  ring_plan r = {.work = work, .first_send = send, .count = count * (size_t)p, .esize = esize,
                 .p = p, .rank = b->vrank, .nseg = segments_for(count, esize),
                 .rs_first = mod(b->vrank - 1, p), .ag_first = -1, .dtype = dtype, .op = op};
  DDP_TRY(ring_run(b, ctx, &r));
  memcpy(recv, work + (size_t)b->vrank * bytes, bytes);
  if (op == DDP_REDUCE_AVG) ddp__reduce_scale(recv, count, dtype, p);
  return DDP_OK;
}

ddp_status ddp__tcp_gather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                           void *recv, size_t count, ddp_dtype dtype, int root) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  size_t bytes = count * ddp_dtype_size(dtype);
  ddp__tcp_xfer *x = b->xfers;
  int n = 0;
  if (b->vrank == root) {
    char *own = (char *)recv + (size_t)root * bytes;
    if (bytes && own != send) memmove(own, send, bytes);
    for (int r = 0; r < p; r++)
      if (r != root) ddp__tcp_post_recv(&x[n++], r, (char *)recv + (size_t)r * bytes, bytes);
  } else {
    ddp__tcp_post_send(&x[n++], root, send, bytes);
  }
  if (p == 1 || count == 0) return DDP_OK;
  return ddp__tcp_run(b, ctx, x, n);
}

ddp_status ddp__tcp_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                            void *recv, size_t count, ddp_dtype dtype, int root) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  size_t bytes = count * ddp_dtype_size(dtype);
  ddp__tcp_xfer *x = b->xfers;
  int n = 0;
  if (b->vrank == root) {
    const char *own = (const char *)send + (size_t)root * bytes;
    if (bytes && own != recv) memmove(recv, own, bytes);
    for (int r = 0; r < p; r++)
      if (r != root)
        ddp__tcp_post_send(&x[n++], r, (const char *)send + (size_t)r * bytes, bytes);
  } else {
    ddp__tcp_post_recv(&x[n++], root, recv, bytes);
  }
  if (p == 1 || count == 0) return DDP_OK;
  return ddp__tcp_run(b, ctx, x, n);
}

ddp_status ddp__tcp_all_to_all(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  size_t bytes = count * ddp_dtype_size(dtype);
  const char *s = send;
  char *d = recv;
  if (bytes) memmove(d + (size_t)b->vrank * bytes, s + (size_t)b->vrank * bytes, bytes);
  if (p == 1 || count == 0) return DDP_OK;
  /* Every pair at once: sockets progress independently, so the order of
   * peers does not matter (ring-shifted all the same, to spread load). */
  ddp__tcp_xfer *x = b->xfers;
  int n = 0;
  for (int k = 1; k < p; k++) {
    int to = mod(b->vrank + k, p), from = mod(b->vrank - k, p);
    ddp__tcp_post_send(&x[n++], to, s + (size_t)to * bytes, bytes);
    ddp__tcp_post_recv(&x[n++], from, d + (size_t)from * bytes, bytes);
  }
  return ddp__tcp_run(b, ctx, x, n);
}

ddp_status ddp__tcp_barrier(ddp__backend *be, const ddp__op_ctx *ctx) {
  ddp__tcp_backend *b = as_tcp(be);
  DDP_TRY(sticky(b));
  int p = b->vsize;
  ddp__tcp_xfer *x = b->xfers;
  /* Dissemination: after round k every rank has heard (transitively) from
   * 2^(k+1) ranks. */
  for (int dist = 1; dist < p; dist <<= 1) {
    ddp__tcp_post_send(&x[0], mod(b->vrank + dist, p), NULL, 0);
    ddp__tcp_post_recv(&x[1], mod(b->vrank - dist, p), NULL, 0);
    DDP_TRY(ddp__tcp_run(b, ctx, x, 2));
  }
  return DDP_OK;
}
