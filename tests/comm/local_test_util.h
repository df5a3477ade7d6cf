/* Helpers for the local backend's tests: closed-form contributions and
 * expected values, element access for every dtype, a per-call context, and
 * the matrix of every op x dtype x count that one rank runs against a
 * backend (the same code for threads and for processes). Rank r contributes
 * (r + 1) * (i % 7 + 1) to element i (PRODUCT: 2 where i % 3 == r % 3, else
 * 1), so every expected value is a small integer or half-integer, exact in
 * every dtype including bfloat16. */
#ifndef DDP_TESTS_COMM_LOCAL_TEST_UTIL_H
#define DDP_TESTS_COMM_LOCAL_TEST_UTIL_H

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "comm/backend.h"
#include "comm/pattern.h"
#include "ddp/tensor.h"

static const ddp_dtype lt_dtypes[] = {DDP_FLOAT32, DDP_FLOAT64, DDP_INT32,
                                      DDP_INT64,   DDP_FLOAT16, DDP_BFLOAT16};
#define LT_NUM_DTYPES (sizeof lt_dtypes / sizeof lt_dtypes[0])

/* all_to_all: what rank r puts in the block for rank q. */
static inline double lt_code(int r, int q, size_t i) { return (double)(r * 8 + q + (int)(i % 5)); }

static inline bool lt_is_float(ddp_dtype dt) {
  return dt == DDP_FLOAT32 || dt == DDP_FLOAT64 || dt == DDP_FLOAT16 || dt == DDP_BFLOAT16;
}

static inline ddp__op_ctx lt_ctx(const char *op, uint64_t seq, atomic_bool *aborted,
                                 double timeout_s) {
  ddp__op_ctx c = {.op = op, .seq = seq, .deadline_ns = ddp_time_ns() + (int64_t)(timeout_s * 1e9),
                   .aborted = aborted, .tag = 0};
  return c;
}

/* One rank's run of the matrix. Returns the number of failed checks, the
 * first described in err. */
typedef struct lt_matrix {
  int rank, size;
  int failures;
  char err[512];
  uint64_t seq;
  atomic_bool aborted;
  const size_t *counts;
  size_t num_counts;
  ddp__backend *b;
} lt_matrix;

#define LT_CHECK(m, cond, ...)                                                  \
  do {                                                                          \
    if (!(cond)) {                                                              \
      if ((m)->failures++ == 0) snprintf((m)->err, sizeof (m)->err, __VA_ARGS__); \
    }                                                                           \
  } while (0)

#define LT_CALL(m, name, expr)                                                             \
  do {                                                                                     \
    ddp__op_ctx ctx = lt_ctx(name, ++(m)->seq, &(m)->aborted, 60.0);                       \
    ddp__op_ctx *ctxp = &ctx;                                                              \
    ddp_status st_ = (expr);                                                               \
    (void)ctxp;                                                                            \
    if (st_ != DDP_OK) {                                                                   \
      LT_CHECK(m, 0, "rank %d: %s failed: %s (%s)", (m)->rank, name, ddp_status_name(st_), \
               ddp_last_error());                                                          \
      return;                                                                              \
    }                                                                                      \
  } while (0)

/* Runs every collective and point to point for one dtype and count. */
static void lt_run_case(lt_matrix *m, ddp_dtype dt, size_t count, int round) {
  ddp__backend *b = m->b;
  const ddp__blocking_ops *o = b->ops->blocking;
  int r = m->rank, P = m->size;
  size_t es = ddp_dtype_size(dt);
  size_t n_all = count * (size_t)P;
  char *buf = ddp_alloc(n_all * es + 64);
  char *send = ddp_alloc(n_all * es + 64);
  char *recv = ddp_alloc(n_all * es + 64);
  const char *dn = ddp_dtype_name(dt);

  /* allreduce, every op */
  for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
    if (op == DDP_REDUCE_AVG && !lt_is_float(dt)) continue;
    for (size_t i = 0; i < count; i++) ddp__elem_set(buf, dt, i, ddp__pattern_contrib(r, i, op));
    LT_CALL(m, "allreduce", o->allreduce(b, ctxp, buf, count, dt, op));
    for (size_t i = 0; i < count; i++) {
      double got = ddp__elem_get(buf, dt, i), want = ddp__pattern_reduced(op, P, i);
      LT_CHECK(m, got == want, "rank %d of %d: allreduce %s %s count %zu: [%zu] = %g, expected %g",
               r, P, ddp_reduce_op_name((ddp_reduce_op)op), dn, count, i, got, want);
      if (got != want) break;
    }
  }
  /* broadcast */
  int root = round % P;
  for (size_t i = 0; i < count; i++) ddp__elem_set(buf, dt, i, r == root ? ddp__pattern_contrib(r, i, 0) : -1);
  LT_CALL(m, "broadcast", o->broadcast(b, ctxp, buf, count, dt, root));
  for (size_t i = 0; i < count; i++) {
    double got = ddp__elem_get(buf, dt, i), want = ddp__pattern_contrib(root, i, 0);
    LT_CHECK(m, got == want, "rank %d of %d: broadcast %s count %zu root %d: [%zu] = %g, expected %g",
             r, P, dn, count, root, i, got, want);
    if (got != want) break;
  }
  /* reduce (SUM; MAX on odd rounds) to root P-1-root */
  int rroot = P - 1 - root;
  ddp_reduce_op rop = round % 2 ? DDP_REDUCE_MAX : DDP_REDUCE_SUM;
  for (size_t i = 0; i < count; i++) ddp__elem_set(buf, dt, i, ddp__pattern_contrib(r, i, rop));
  LT_CALL(m, "reduce", o->reduce(b, ctxp, buf, count, dt, rop, rroot));
  for (size_t i = 0; i < count; i++) {
    double got = ddp__elem_get(buf, dt, i);
    double want = r == rroot ? ddp__pattern_reduced(rop, P, i) : ddp__pattern_contrib(r, i, rop);
    LT_CHECK(m, got == want, "rank %d of %d: reduce %s %s count %zu root %d: [%zu] = %g, expected %g",
             r, P, ddp_reduce_op_name((ddp_reduce_op)rop), dn, count, rroot, i, got, want);
    if (got != want) break;
  }
  /* allgather */
  for (size_t i = 0; i < count; i++) ddp__elem_set(send, dt, i, ddp__pattern_contrib(r, i, 0));
  memset(recv, 0xee, n_all * es);
  LT_CALL(m, "allgather", o->allgather(b, ctxp, send, recv, count, dt));
  for (size_t j = 0; j < n_all; j++) {
    double got = ddp__elem_get(recv, dt, j), want = ddp__pattern_contrib((int)(j / count), j % count, 0);
    LT_CHECK(m, got == want, "rank %d of %d: allgather %s count %zu: [%zu] = %g, expected %g", r,
             P, dn, count, j, got, want);
    if (got != want) break;
  }
  /* allgather in place: send is this rank's block of recv */
  memset(recv, 0xee, n_all * es);
  for (size_t i = 0; i < count; i++) ddp__elem_set(recv + (size_t)r * count * es, dt, i, ddp__pattern_contrib(r, i, 0));
  LT_CALL(m, "allgather", o->allgather(b, ctxp, recv + (size_t)r * count * es, recv, count, dt));
  for (size_t j = 0; j < n_all; j++) {
    double got = ddp__elem_get(recv, dt, j), want = ddp__pattern_contrib((int)(j / count), j % count, 0);
    LT_CHECK(m, got == want, "rank %d of %d: allgather in place %s count %zu: [%zu] = %g, expected %g",
             r, P, dn, count, j, got, want);
    if (got != want) break;
  }
  /* gather to root */
  memset(recv, 0xee, n_all * es);
  LT_CALL(m, "gather", o->gather(b, ctxp, send, r == root ? recv : NULL, count, dt, root));
  for (size_t j = 0; r == root && j < n_all; j++) {
    double got = ddp__elem_get(recv, dt, j), want = ddp__pattern_contrib((int)(j / count), j % count, 0);
    LT_CHECK(m, got == want, "rank %d of %d: gather %s count %zu root %d: [%zu] = %g, expected %g",
             r, P, dn, count, root, j, got, want);
    if (got != want) break;
  }
  /* scatter from rroot: block q element i = ddp__pattern_contrib(q, i) */
  for (size_t j = 0; j < n_all; j++) ddp__elem_set(send, dt, j, ddp__pattern_contrib((int)(j / count), j % count, 0));
  memset(recv, 0xee, count * es);
  LT_CALL(m, "scatter",
          o->scatter(b, ctxp, r == rroot ? send : NULL, recv, count, dt, rroot));
  for (size_t i = 0; i < count; i++) {
    double got = ddp__elem_get(recv, dt, i), want = ddp__pattern_contrib(r, i, 0);
    LT_CHECK(m, got == want, "rank %d of %d: scatter %s count %zu root %d: [%zu] = %g, expected %g",
             r, P, dn, count, rroot, i, got, want);
    if (got != want) break;
  }
  /* reduce_scatter SUM: send element j = ddp__pattern_contrib(r, j) */
  for (size_t j = 0; j < n_all; j++) ddp__elem_set(send, dt, j, ddp__pattern_contrib(r, j, 0));
  memset(recv, 0xee, count * es);
  LT_CALL(m, "reduce_scatter", o->reduce_scatter(b, ctxp, send, recv, count, dt, DDP_REDUCE_SUM));
  for (size_t i = 0; i < count; i++) {
    double got = ddp__elem_get(recv, dt, i), want = ddp__pattern_reduced(DDP_REDUCE_SUM, P, (size_t)r * count + i);
    LT_CHECK(m, got == want, "rank %d of %d: reduce_scatter %s count %zu: [%zu] = %g, expected %g",
             r, P, dn, count, i, got, want);
    if (got != want) break;
  }
  /* all_to_all */
  for (size_t j = 0; j < n_all; j++) ddp__elem_set(send, dt, j, lt_code(r, (int)(j / count), j % count));
  memset(recv, 0xee, n_all * es);
  LT_CALL(m, "all_to_all", o->all_to_all(b, ctxp, send, recv, count, dt));
  for (size_t j = 0; j < n_all; j++) {
    double got = ddp__elem_get(recv, dt, j), want = lt_code((int)(j / count), r, j % count);
    LT_CHECK(m, got == want, "rank %d of %d: all_to_all %s count %zu: [%zu] = %g, expected %g", r,
             P, dn, count, j, got, want);
    if (got != want) break;
  }
  LT_CALL(m, "barrier", o->barrier(b, ctxp));

  /* Point to point around the ring: two messages with tags 1 and 2, taken
   * in the opposite order (small ones are eager; for big ones even ranks
   * send first and odd ranks receive first, as a rendezvous needs). */
  if (P > 1) {
    int next = (r + 1) % P, prev = (r + P - 1) % P;
    size_t bytes = count * es;
    bool eager = bytes <= 4096;
    for (size_t i = 0; i < count; i++) {
      ddp__elem_set(send, dt, i, ddp__pattern_contrib(r, i, 0));
      ddp__elem_set(send + bytes, dt, i, lt_code(r, 0, i));
    }
    for (int phase = 0; phase < 2; phase++) {
      bool do_send = eager ? phase == 0 : (phase == 0) == (r % 2 == 0);
      if (do_send) {
        ddp__op_ctx c1 = lt_ctx("send", ++m->seq, &m->aborted, 60.0);
        c1.tag = 1;
        ddp_status st = o->send(b, &c1, send, bytes, next);
        ddp__op_ctx c2 = lt_ctx("send", ++m->seq, &m->aborted, 60.0);
        c2.tag = 2;
        if (st == DDP_OK) st = o->send(b, &c2, send + bytes, bytes, next);
        LT_CHECK(m, st == DDP_OK, "rank %d: send: %s", r, ddp_last_error());
        if (st != DDP_OK) break;
      } else {
        /* Big messages are received in order (the sender blocks on tag 1). */
        int first = eager ? 2 : 1;
        for (int k = 0; k < 2; k++) {
          int tag = k == 0 ? first : 3 - first;
          ddp__op_ctx c = lt_ctx("recv", ++m->seq, &m->aborted, 60.0);
          c.tag = tag;
          memset(recv, 0xee, bytes);
          ddp_status st = o->recv(b, &c, recv, bytes, prev);
          LT_CHECK(m, st == DDP_OK, "rank %d: recv: %s", r, ddp_last_error());
          if (st != DDP_OK) break;
          for (size_t i = 0; i < count; i++) {
            double got = ddp__elem_get(recv, dt, i);
            double want = tag == 1 ? ddp__pattern_contrib(prev, i, 0) : lt_code(prev, 0, i);
            LT_CHECK(m, got == want, "rank %d of %d: recv %s count %zu tag %d: [%zu] = %g, expected %g",
                     r, P, dn, count, tag, i, got, want);
            if (got != want) break;
          }
        }
      }
    }
  }
  ddp_free(buf);
  ddp_free(send);
  ddp_free(recv);
}

/* The whole matrix for one rank: every dtype x every count. */
static inline void lt_run_matrix(lt_matrix *m) {
  int round = 0;
  for (size_t d = 0; d < LT_NUM_DTYPES; d++)
    for (size_t c = 0; c < m->num_counts; c++) lt_run_case(m, lt_dtypes[d], m->counts[c], round++);
}

#endif /* DDP_TESTS_COMM_LOCAL_TEST_UTIL_H */
