/* The correctness matrix's per-dtype body, shared by test_comm_matrix
 * (ranks as threads) and test_comm_hier (ranks as processes on several
 * "hosts"): every operation x counts 0, 1, one not divisible by the world
 * size and 1 MiB of data, against closed forms, through the public API.
 *
 * Rank r contributes (r + 1) * (i % 7 + 1) to element i of a reduction
 * (PRODUCT: 2 where i % 3 == r % 3, else 1), and r * 8 + (i % 5) to data
 * that is moved; every expected value is a small integer or half-integer,
 * exact in every dtype including bfloat16, whatever the order of the
 * reduction. */
#ifndef DDP_TESTS_COMM_MATRIX_BODY_H
#define DDP_TESTS_COMM_MATRIX_BODY_H

#include "comm/comm_test_util.h"

#define MIB (1u << 20)

/* Closed forms: ddp__pattern_contrib / _reduced (src/comm/pattern.h) and lt_code (local_test_util.h). */
static inline double code(int r, size_t i) { return lt_code(r, 0, i); }

#define JUNK (-3.0)

typedef struct rank_bufs {
  char *a, *b; /* MIB + slack each */
} rank_bufs;

/* The counts for a dtype: total elements of the in-place ops, and of one
 * rank's block for the blocked ops. */
static inline void counts_for(ddp_dtype dt, int P, size_t *plain, size_t *block) {
  size_t es = ddp_dtype_size(dt);
  plain[0] = 0, plain[1] = 1, plain[2] = 13 * (size_t)P + 1, plain[3] = MIB / es;
  block[0] = 0, block[1] = 1, block[2] = 13 * (size_t)P + 1, block[3] = MIB / es / (size_t)P;
}

#define FOR_I(n) for (size_t i = 0; i < (n); i++)

static inline void ct_matrix_dtype(ct_rank *self, ddp_dtype dt, char *a, char *b) {
  ddp_process_group *pg = self->pg;
  int P = ddp_process_group_size(pg), r = self->rank;
  const char *dn = ddp_dtype_name(dt);
  size_t plain[4], block[4];
  counts_for(dt, P, plain, block);
  for (int c = 0; c < 4; c++) {
    size_t n = plain[c], m = block[c];
    /* allreduce, every op */
    for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
      if (op == DDP_REDUCE_AVG && !lt_is_float(dt)) continue;
      FOR_I(n) ddp__elem_set(a, dt, i, ddp__pattern_contrib(r, i, (ddp_reduce_op)op));
      CT_OK(self, ddp_allreduce(pg, a, n, dt, (ddp_reduce_op)op));
      FOR_I(n) CT_CHECK(self, ddp__elem_get(a, dt, i) == ddp__pattern_reduced((ddp_reduce_op)op, P, i),
                        "allreduce %s %s n=%zu [%zu] = %g, want %g", dn,
                        ddp_reduce_op_name((ddp_reduce_op)op), n, i, ddp__elem_get(a, dt, i),
                        ddp__pattern_reduced((ddp_reduce_op)op, P, i));
    }
    /* reduce to a middle root: SUM and MAX (AVG for floats); others unchanged */
    int root = P / 2;
    ddp_reduce_op rops[3] = {DDP_REDUCE_SUM, DDP_REDUCE_MAX, lt_is_float(dt) ? DDP_REDUCE_AVG : DDP_REDUCE_MIN};
    for (int k = 0; k < 3; k++) {
      FOR_I(n) ddp__elem_set(a, dt, i, ddp__pattern_contrib(r, i, rops[k]));
      CT_OK(self, ddp_reduce(pg, a, n, dt, rops[k], root));
      FOR_I(n) {
        double want = r == root ? ddp__pattern_reduced(rops[k], P, i) : ddp__pattern_contrib(r, i, rops[k]);
        CT_CHECK(self, ddp__elem_get(a, dt, i) == want, "reduce %s %s root %d n=%zu [%zu] = %g, want %g",
                 dn, ddp_reduce_op_name(rops[k]), root, n, i, ddp__elem_get(a, dt, i), want);
      }
    }
    /* broadcast from the last rank */
    FOR_I(n) ddp__elem_set(a, dt, i, r == P - 1 ? code(r, i) : JUNK);
    CT_OK(self, ddp_broadcast(pg, a, n, dt, P - 1));
    FOR_I(n) CT_CHECK(self, ddp__elem_get(a, dt, i) == code(P - 1, i), "broadcast %s n=%zu [%zu] = %g", dn,
                      n, i, ddp__elem_get(a, dt, i));
    /* allgather */
    FOR_I(m) ddp__elem_set(a, dt, i, code(r, i));
    FOR_I(m * (size_t)P) ddp__elem_set(b, dt, i, JUNK);
    CT_OK(self, ddp_allgather(pg, a, b, m, dt));
    for (int q = 0; q < P; q++)
      FOR_I(m) CT_CHECK(self, ddp__elem_get(b, dt, (size_t)q * m + i) == code(q, i),
                        "allgather %s m=%zu block %d [%zu] = %g", dn, m, q, i,
                        ddp__elem_get(b, dt, (size_t)q * m + i));
    /* gather to rank (P-1)/2 */
    int groot = (P - 1) / 2;
    FOR_I(m * (size_t)P) ddp__elem_set(b, dt, i, JUNK);
    CT_OK(self, ddp_gather(pg, a, r == groot ? b : NULL, m, dt, groot));
    if (r == groot)
      for (int q = 0; q < P; q++)
        FOR_I(m) CT_CHECK(self, ddp__elem_get(b, dt, (size_t)q * m + i) == code(q, i),
                          "gather %s m=%zu block %d [%zu] = %g", dn, m, q, i,
                          ddp__elem_get(b, dt, (size_t)q * m + i));
    /* scatter from rank P/2: block q of the root's send is lt_code(root, q) */
    int sroot = P / 2;
    if (r == sroot)
      for (int q = 0; q < P; q++) FOR_I(m) ddp__elem_set(b, dt, (size_t)q * m + i, lt_code(sroot, q, i));
    FOR_I(m) ddp__elem_set(a, dt, i, JUNK);
    CT_OK(self, ddp_scatter(pg, r == sroot ? b : NULL, a, m, dt, sroot));
    FOR_I(m) CT_CHECK(self, ddp__elem_get(a, dt, i) == lt_code(sroot, r, i), "scatter %s m=%zu [%zu] = %g", dn,
                      m, i, ddp__elem_get(a, dt, i));
    /* reduce_scatter: SUM and MAX over the whole send; block r lands here */
    ddp_reduce_op sops[2] = {DDP_REDUCE_SUM, DDP_REDUCE_MAX};
    for (int k = 0; k < 2; k++) {
      FOR_I(m * (size_t)P) ddp__elem_set(b, dt, i, ddp__pattern_contrib(r, i, sops[k]));
      FOR_I(m) ddp__elem_set(a, dt, i, JUNK);
      CT_OK(self, ddp_reduce_scatter(pg, b, a, m, dt, sops[k]));
      FOR_I(m) CT_CHECK(self, ddp__elem_get(a, dt, i) == ddp__pattern_reduced(sops[k], P, (size_t)r * m + i),
                        "reduce_scatter %s %s m=%zu [%zu] = %g, want %g", dn,
                        ddp_reduce_op_name(sops[k]), m, i, ddp__elem_get(a, dt, i),
                        ddp__pattern_reduced(sops[k], P, (size_t)r * m + i));
    }
    /* all_to_all: block q of rank r's send goes to block r of rank q's recv */
    for (int q = 0; q < P; q++) FOR_I(m) ddp__elem_set(b, dt, (size_t)q * m + i, lt_code(r, q, i));
    FOR_I(m * (size_t)P) ddp__elem_set(a, dt, i, JUNK);
    CT_OK(self, ddp_all_to_all(pg, b, a, m, dt));
    for (int q = 0; q < P; q++)
      FOR_I(m) CT_CHECK(self, ddp__elem_get(a, dt, (size_t)q * m + i) == lt_code(q, r, i),
                        "all_to_all %s m=%zu block %d [%zu] = %g", dn, m, q, i,
                        ddp__elem_get(a, dt, (size_t)q * m + i));
    /* point to point around the ring (P > 1): even ranks send first, odd
     * ranks receive first (operations run one at a time, and a large send
     * may wait for its receiver) */
    if (P > 1) {
      int next = (r + 1) % P, prev = (r + P - 1) % P;
      FOR_I(n) ddp__elem_set(a, dt, i, code(r, i));
      FOR_I(n) ddp__elem_set(b, dt, i, JUNK);
      if (r % 2 == 0) {
        CT_OK(self, ddp_send(pg, a, n, dt, next, c));
        CT_OK(self, ddp_recv(pg, b, n, dt, prev, c));
      } else {
        CT_OK(self, ddp_recv(pg, b, n, dt, prev, c));
        CT_OK(self, ddp_send(pg, a, n, dt, next, c));
      }
      FOR_I(n) CT_CHECK(self, ddp__elem_get(b, dt, i) == code(prev, i), "recv %s n=%zu [%zu] = %g", dn, n,
                        i, ddp__elem_get(b, dt, i));
    }
  }
  CT_OK(self, ddp_barrier(pg));
}

#endif
