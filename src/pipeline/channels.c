/* The point-to-point channels between stages. Each one-way, one-kind stream
 * (activations from rank a to b, gradients from b to a, and interleaving's
 * wrap-around streams) is a two-rank subgroup of the pipeline group, and its
 * transfers go through comm's ddp_batch_isend_irecv (the group's
 * point-to-point lane: in flight in the background whatever their size).
 * Within one stream both ends post in the same order (the schedule checker
 * proves it). Buffers on a GPU go by isend / irecv instead (ddp__pp_post).
 * Why subgroups rather than the pipeline group itself: a peer's
 * death fails every pending transfer of a group, whoever it was with, and
 * would be blamed on the wrong neighbour; on a two-rank channel the only
 * peer is the one to blame, and a failure leaves the caller's pipeline group
 * alone. */
#include <stdio.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"

typedef struct {
  ddp_process_group *group; /* {src, dst}; NULL where this rank is neither or unused */
  int peer;                 /* the other end's rank in `group` */
} stream;

struct ddp__pp_channels {
  ddp_process_group *pg;
  int p, rank;
  stream *streams; /* (p * p * 2), index (src * p + dst) * 2 + kind */
  char fail_key[64];
  double timeout_s;
};

static bool stream_used(const ddp_pipeline_schedule *s, int src, int dst, int kind) {
  int want = kind == DDP__PP_ACT ? DDP_PIPELINE_SEND_ACT : DDP_PIPELINE_SEND_GRAD;
  for (int i = 0; i < s->counts[src]; i++)
    if ((int)s->lists[src][i].kind == want && s->lists[src][i].peer == dst) return true;
  return false;
}

ddp_status ddp__pp_channels_create(ddp__pp_channels **out, ddp_process_group *pg,
                                   const ddp_pipeline_schedule *sched, double timeout_s) {
  *out = NULL;
  ddp__pp_channels *ch = ddp_calloc(1, sizeof *ch);
  if (!ch) return ddp_error(DDP_ERR_NOMEM, "pipeline channels: out of memory");
  ch->pg = pg;
  ch->p = ddp_process_group_size(pg);
  ch->rank = ddp_process_group_rank(pg);
  ch->timeout_s = timeout_s;
  /* Subgroup creation numbers the parent's subgroups alike on every rank:
   * a key of its own for this pipeline's failure notice. */
  snprintf(ch->fail_key, sizeof ch->fail_key, "pipeline/%llu/failed",
           (unsigned long long)ddp_process_group_subgroup_count(pg));
  ch->streams = ddp_calloc((size_t)(ch->p * ch->p * 2), sizeof(stream));
  if (!ch->streams) {
    ddp_free(ch);
    return ddp_error(DDP_ERR_NOMEM, "pipeline channels: out of memory");
  }
  /* Every rank walks the same (src, dst, kind) order: ddp_process_group_new
   * is collective over the pipeline group. */
  for (int src = 0; src < ch->p; src++)
    for (int dst = 0; dst < ch->p; dst++)
      for (int kind = 0; kind < 2; kind++) {
        if (src == dst || !stream_used(sched, src, dst, kind)) continue;
        int ranks[2] = {src, dst};
        stream *st = &ch->streams[(src * ch->p + dst) * 2 + kind];
        ddp_status s = ddp_process_group_new(pg, 2, ranks, &st->group);
        if (s != DDP_OK) {
          ddp__pp_channels_destroy(ch);
          return ddp_error_wrap(s, "pipeline: creating the %s channel from rank %d to rank %d",
                                kind == DDP__PP_ACT ? "activation" : "gradient", src, dst);
        }
        if (st->group) st->peer = 1 - ddp_process_group_rank(st->group);
      }
  *out = ch;
  return DDP_OK;
}

void ddp__pp_channels_destroy(ddp__pp_channels *ch) {
  if (!ch) return;
  if (ch->streams)
    for (int i = 0; i < ch->p * ch->p * 2; i++) ddp_process_group_destroy(ch->streams[i].group);
  ddp_free(ch->streams);
  ddp_free(ch);
}

void ddp__pp_channels_abort(ddp__pp_channels *ch) {
  if (!ch) return;
  for (int i = 0; i < ch->p * ch->p * 2; i++)
    if (ch->streams[i].group) ddp_process_group_abort(ch->streams[i].group);
}

ddp_status ddp__pp_post(ddp__pp_channels *ch, bool send, int kind, int peer, void *buf,
                        size_t bytes, ddp_work **work) {
  int src = send ? ch->rank : peer, dst = send ? peer : ch->rank;
  stream *st = &ch->streams[(src * ch->p + dst) * 2 + kind];
  if (!st->group)
    return ddp_error(DDP_ERR_INTERNAL, "pipeline: no %s channel from rank %d to rank %d",
                     kind == DDP__PP_ACT ? "activation" : "gradient", src, dst);
  /* Activations and gradients are float32. */
  const size_t count = bytes / sizeof(float);
  /* Buffers on a GPU (stages on GPUs) go as isend / irecv: NCCL's
   * send/recv on an nccl group; on ddp's own backend, staged through pinned
   * host memory in the channel group's queue, one at a time, which keeps
   * the channel's order (its lane, what batch_isend_irecv uses, takes host
   * memory only). */
  if (ddp_pointer_device(buf).type != DDP_DEVICE_CPU)
    return send ? ddp_isend(st->group, buf, count, DDP_FLOAT32, st->peer, kind, work)
                : ddp_irecv(st->group, buf, count, DDP_FLOAT32, st->peer, kind, work);
  ddp_p2p_op op = {send ? DDP_P2P_SEND : DDP_P2P_RECV, buf, count, DDP_FLOAT32, st->peer, kind};
  return ddp_batch_isend_irecv(st->group, &op, 1, work);
}

void ddp__pp_record_failure(ddp__pp_channels *ch, const char *msg, char *first, size_t bytes) {
  snprintf(first, bytes, "%s", msg);
  ddp_store *store = ch ? ddp_process_group_store(ch->pg) : NULL;
  if (!store) return;
  /* The store may be gone with the failure (its server's host died): keep
   * our own message then. A short timeout: failing must not hang. */
  int64_t old = ddp_store_timeout_ms(store);
  ddp_store_set_timeout_ms(store, 2000);
  void *cur = NULL;
  size_t cur_bytes = 0;
  if (ddp_store_compare_set(store, ch->fail_key, "", 0, msg, strlen(msg), &cur, &cur_bytes) ==
          DDP_OK &&
      cur) {
    size_t n = cur_bytes < bytes - 1 ? cur_bytes : bytes - 1;
    memcpy(first, cur, n);
    first[n] = '\0';
  }
  ddp_free(cur);
  ddp_store_set_timeout_ms(store, old);
}

