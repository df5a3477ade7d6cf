/* The construction-time check that every rank wraps the same model: each rank
 * allgathers one record per parameter (name and shape), and every rank
 * compares them all with rank 0's, so each reports the same first difference
 * (lowest parameter index, then lowest rank) and none waits for another. */
#include <stdio.h>
#include <string.h>

#include "parallel/dp_internal.h"

typedef struct param_record {
  int64_t ndim;
  int64_t shape[DDP_MAX_DIMS];
  char name[72]; /* truncated; for messages only */
} param_record;

static void shape_text(const param_record *r, char *buf, size_t bytes) {
  ddp_tensor t = {.ndim = (int32_t)r->ndim};
  for (int d = 0; d < r->ndim && d < DDP_MAX_DIMS; d++) t.shape[d] = r->shape[d];
  ddp_tensor_shape_str(&t, buf, bytes);
}

static bool same_shape(const param_record *a, const param_record *b) {
  if (a->ndim != b->ndim) return false;
  for (int d = 0; d < a->ndim && d < DDP_MAX_DIMS; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

ddp_status ddp__dp_verify_params(ddp_dp *dp) {
  if (dp->world == 1) return DDP_OK;
  int n = dp->n_params;
  param_record *mine = ddp_calloc((size_t)(n ? n : 1), sizeof *mine);
  size_t *lens = ddp_calloc((size_t)dp->world, sizeof *lens);
  if (!mine || !lens) {
    ddp_free(mine);
    ddp_free(lens);
    return ddp_error(DDP_ERR_NOMEM, "ddp: create: out of memory");
  }
  for (int i = 0; i < n; i++) {
    const ddp_tensor *t = ddp_model_param(dp->model, i);
    mine[i].ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) mine[i].shape[d] = t->shape[d];
    snprintf(mine[i].name, sizeof mine[i].name, "%s", ddp_model_param_name(dp->model, i));
  }
  void *all = NULL;
  /* Host records: over the host group where pg is nccl. */
  ddp_status s = ddp_allgather_bytes(dp->host_pg, mine, (size_t)n * sizeof *mine, &all, lens);
  ddp_free(mine);
  if (s != DDP_OK) {
    ddp_free(lens);
    return ddp_error_wrap(s, "ddp: create: exchanging parameter shapes");
  }
  /* Rank r's records start after the lengths of ranks before it. */
  const param_record *rank0 = all;
  int n0 = (int)(lens[0] / sizeof(param_record));
  size_t at = lens[0];
  int bad_index = -1, bad_rank = -1;
  for (int r = 1; r < dp->world; r++) {
    const param_record *other = (const param_record *)(void *)((char *)all + at);
    int nr = (int)(lens[r] / sizeof(param_record));
    at += lens[r];
    int lim = nr < n0 ? nr : n0, i = 0;
    while (i < lim && same_shape(&rank0[i], &other[i])) i++;
    if (i == lim && nr == n0) continue;
    if (bad_index < 0 || i < bad_index) {
      bad_index = i;
      bad_rank = r;
    }
  }
  s = DDP_OK;
  if (bad_index >= 0) {
    at = 0;
    for (int r = 0; r < bad_rank; r++) at += lens[r];
    const param_record *other = (const param_record *)(void *)((char *)all + at);
    int nr = (int)(lens[bad_rank] / sizeof(param_record));
    char a[DDP_SHAPE_STR_BYTES], b[DDP_SHAPE_STR_BYTES];
    if (bad_index < n0 && bad_index < nr) {
      shape_text(&rank0[bad_index], a, sizeof a);
      shape_text(&other[bad_index], b, sizeof b);
      s = ddp_error(DDP_ERR_SHAPE,
                    "ddp: every rank must wrap the same model: parameter %d '%s' has shape %s "
                    "on rank 0 but '%s' %s on rank %d",
                    bad_index, rank0[bad_index].name, a, other[bad_index].name, b, bad_rank);
    } else {
      const param_record *extra = bad_index < n0 ? &rank0[bad_index] : &other[bad_index];
      shape_text(extra, a, sizeof a);
      s = ddp_error(DDP_ERR_SHAPE,
                    "ddp: every rank must wrap the same model: rank %d has %d parameters but "
                    "rank 0 has %d (parameter %d '%s' %s exists only on rank %d)",
                    bad_rank, nr, n0, bad_index, extra->name, a, bad_index < n0 ? 0 : bad_rank);
    }
  }
  ddp_free(all);
  ddp_free(lens);
  return s;
}
