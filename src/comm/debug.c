/* DDP_DEBUG=detail: before each collective, the ranks allgather its
 * fingerprint (op, dtype, count, root, reduce op, sequence number) through
 * the backend and compare them, so that a rank that called something else
 * (or skipped a call) is named instead of the group hanging or computing
 * garbage. */
#include <stdio.h>
#include <string.h>

#include "comm/comm_internal.h"

#define FP_MAGIC 0x64647066 /* "ddpf" */

enum { FP_MAGIC_I, FP_KIND, FP_DTYPE, FP_COUNT, FP_ROOT, FP_OP, FP_SEQ, FP_WORDS };

static void fingerprint(const ddp__op_args *a, int64_t *fp) {
  bool has_root = a->kind == DDP__OP_BROADCAST || a->kind == DDP__OP_REDUCE ||
                  a->kind == DDP__OP_GATHER || a->kind == DDP__OP_SCATTER;
  bool has_op = a->kind == DDP__OP_ALLREDUCE || a->kind == DDP__OP_REDUCE ||
                a->kind == DDP__OP_REDUCE_SCATTER;
  bool has_data = a->kind != DDP__OP_BARRIER;
  fp[FP_MAGIC_I] = FP_MAGIC;
  fp[FP_KIND] = a->kind;
  fp[FP_DTYPE] = has_data ? (int64_t)a->dtype : -1;
  fp[FP_COUNT] = has_data ? (int64_t)a->count : -1;
  fp[FP_ROOT] = has_root ? a->root : -1;
  fp[FP_OP] = has_op ? (int64_t)a->reduce_op : -1;
  fp[FP_SEQ] = (int64_t)a->seq;
}

static void args_of(const int64_t *fp, ddp__op_args *a) {
  memset(a, 0, sizeof *a);
  a->kind = (ddp__op_kind)fp[FP_KIND];
  a->dtype = (ddp_dtype)fp[FP_DTYPE];
  a->count = (size_t)fp[FP_COUNT];
  a->root = (int)fp[FP_ROOT];
  a->reduce_op = (ddp_reduce_op)fp[FP_OP];
  a->seq = (uint64_t)fp[FP_SEQ];
}


static bool same_fp(const int64_t *a, const int64_t *b) {
  return memcmp(a, b, FP_WORDS * sizeof *a) == 0;
}

ddp_status ddp__debug_check(ddp_process_group *pg, const ddp__op_args *args,
                            const ddp__op_ctx *ctx) {
  int size = pg->size;
  int64_t mine[FP_WORDS];
  fingerprint(args, mine);
  int64_t *all = ddp_alloc((size_t)size * sizeof mine);
  if (!all) return ddp_error(DDP_ERR_NOMEM, "%s #%llu: debug check: out of memory", ctx->op,
                             (unsigned long long)ctx->seq);
  ddp__op_ctx fctx = *ctx;
  fctx.op = "debug fingerprint check";
  ddp__op_args gather = {.kind = DDP__OP_ALLGATHER, .send = mine, .buf = all, .count = FP_WORDS,
                         .dtype = DDP_INT64, .device = DDP_CPU};
  ddp__completion done;
  ddp_status st = ddp__caps_check(pg, "DDP_DEBUG=detail's fingerprint check", DDP__OP_ALLGATHER,
                                  DDP_INT64, DDP_REDUCE_SUM, DDP_CPU);
  if (st == DDP_OK) st = ddp__backend_run(pg->backend, &fctx, &gather, &done);
  if (st != DDP_OK) {
    ddp_free(all);
    return ddp_error_wrap(st, "%s #%llu (debug fingerprint check)", ctx->op,
                          (unsigned long long)ctx->seq);
  }
  /* The reference is the fingerprint most ranks share (ties: the lowest
   * rank's), so the message names the rank that diverged. */
  int ref = 0, ref_votes = 0;
  for (int r = 0; r < size && ref_votes <= size / 2; r++) {
    int votes = 0;
    for (int q = 0; q < size; q++) votes += same_fp(all + r * FP_WORDS, all + q * FP_WORDS);
    if (votes > ref_votes) {
      ref = r;
      ref_votes = votes;
    }
  }
  int odd = -1;
  for (int r = 0; r < size && odd < 0; r++)
    if (!same_fp(all + r * FP_WORDS, all + ref * FP_WORDS)) odd = r;
  if (odd >= 0) {
    const int64_t *o = all + odd * FP_WORDS, *f = all + ref * FP_WORDS;
    char what_odd[160], what_ref[160], seq_note[64] = "";
    if (o[FP_MAGIC_I] != FP_MAGIC || (uint64_t)o[FP_KIND] >= DDP__OP_KIND_COUNT) {
      snprintf(what_odd, sizeof what_odd, "something that is not a collective");
    } else {
      ddp__op_args oa;
      args_of(o, &oa);
      ddp__op_describe(&oa, size, what_odd, sizeof what_odd);
      if (o[FP_SEQ] != f[FP_SEQ])
        snprintf(seq_note, sizeof seq_note, " as its collective #%lld", (long long)o[FP_SEQ]);
    }
    ddp__op_args fa;
    args_of(f, &fa);
    ddp__op_describe(&fa, size, what_ref, sizeof what_ref);
    st = ddp_error(DDP_ERR_INVALID, "collective #%lld mismatch: rank %d called %s%s but rank %d called %s",
                   (long long)f[FP_SEQ], odd, what_odd, seq_note, ref, what_ref);
  }
  ddp_free(all);
  return st;
}
