/* Buckets: which parameters' gradients are reduced together, and the one-time
 * relayout that makes the flat buffers follow the order gradients actually
 * become ready in. A bucket is a view of the flat gradient buffer: its
 * parameters must be neighbours there, which the bucket order guarantees
 * (consecutive parameters of dp->order sit back to back, offsets decreasing). */
#include <stdio.h>
#include <string.h>

#include "parallel/dp_internal.h"

#define MIB (1024.0 * 1024.0)

ddp_status ddp__dp_reserve_works(ddp_dp *dp) {
  return ddp_process_group_reserve_works(dp->pg, dp->n_buckets + 2);
}

void ddp__dp_assign_buckets(ddp_dp *dp) {
  ddp_model *m = dp->model;
  int n = dp->n_params;
  /* PyTorch's compute_bucket_assignment_by_size: add parameters until the
   * bucket reaches the limit (so a bucket may pass it by one parameter);
   * the first bucket's limit is first_bucket_mb, every later one's
   * bucket_cap_mb. */
  double limit = dp->options.first_bucket_mb * MIB;
  int nb = 0, first = 0;
  double bytes = 0;
  for (int k = 0; k < n; k++) {
    int i = dp->order[k];
    if (k > 0) {
      int prev = dp->order[k - 1];
      DDP_ASSERT(ddp_model_param_offset(m, i) + ddp_model_param(m, i)->numel ==
                 ddp_model_param_offset(m, prev));
    }
    bytes += (double)ddp_model_param(m, i)->numel * sizeof(float);
    dp->bucket_of[i] = nb;
    if (bytes >= limit || k == n - 1) {
      ddp_dp_bucket *b = &dp->buckets[nb];
      int last = dp->order[k]; /* lowest offset of the bucket */
      int top = dp->order[first];
      b->index = nb;
      b->offset = ddp_model_param_offset(m, last);
      b->numel = (size_t)(ddp_model_param_offset(m, top) + ddp_model_param(m, top)->numel -
                          b->offset);
      b->grads = ddp_model_grads_flat(m) + b->offset;
      b->n_params = k - first + 1;
      b->params = &dp->order[first];
      b->divisor = dp->world;
      b->scratch = dp->scratch + b->offset;
      nb++;
      first = k + 1;
      bytes = 0;
      limit = dp->options.bucket_cap_mb * MIB;
    }
  }
  dp->n_buckets = nb;
}

ddp_status ddp__dp_maybe_relayout(ddp_dp *dp) {
  dp->relayout_done = true;
  int n = dp->n_params;
  if (n < 2) return DDP_OK;
  /* Rank 0's observed order (a complete one; otherwise "keep the layout"),
   * so every rank agrees even if their orders differed. Entry n is the flag. */
  int32_t *msg = ddp_alloc(((size_t)n + 1) * sizeof(int32_t));
  if (!msg) return ddp_error(DDP_ERR_NOMEM, "ddp: relayout: out of memory");
  bool differs = false;
  for (int k = 0; k < n && dp->n_ready_order == n; k++) {
    msg[k] = dp->ready_order[k];
    differs |= msg[k] != dp->order[k];
  }
  msg[n] = dp->n_ready_order == n && differs;
  ddp_status s = dp->world > 1 ? ddp_broadcast(dp->host_pg, msg, (size_t)n + 1, DDP_INT32, 0) : DDP_OK;
  if (s != DDP_OK || !msg[n]) {
    ddp_free(msg);
    return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "ddp: relayout: broadcasting rank 0's order");
  }
  /* The new layout places the ready order back to front, so that the first
   * ready parameter is last in the buffer as before (and the bucket order
   * keeps decreasing offsets). */
  ddp_model *m = dp->model;
  /* An attached optimizer must cover the whole flat buffers to follow the
   * move. Checked before anything moves: failing after the model's relayout
   * would leave the buckets describing the old layout. Every rank attaches
   * the same kind of optimizer, so every rank fails here together. */
  int64_t elems = ddp_model_num_param_elements(m);
  if (dp->opt && ddp_optimizer_numel(dp->opt) != (size_t)elems) {
    ddp_free(msg);
    return ddp_error(DDP_ERR_INVALID,
                     "ddp (rank %d): relayout: the attached optimizer covers %zu floats, the "
                     "model's %d parameters %lld; attach an optimizer over the model's whole "
                     "flat buffers (ddp_dp_set_optimizer), or create the wrapper with relayout "
                     "= false", dp->rank, ddp_optimizer_numel(dp->opt), n, (long long)elems);
  }
  int64_t *seg = ddp_alloc((size_t)n * 3 * sizeof(int64_t));
  int *layout = ddp_alloc((size_t)n * sizeof(int));
  if (!seg || !layout) {
    ddp_free(seg);
    ddp_free(layout);
    ddp_free(msg);
    return ddp_error(DDP_ERR_NOMEM, "ddp: relayout: out of memory");
  }
  int64_t *old_off = seg, *new_off = seg + n, *len = seg + 2 * n;
  for (int i = 0; i < n; i++) {
    old_off[i] = ddp_model_param_offset(m, i);
    len[i] = ddp_model_param(m, i)->numel;
  }
  for (int k = 0; k < n; k++) layout[k] = msg[n - 1 - k];
  s = ddp_model_relayout(m, layout);
  if (s == DDP_OK) {
    for (int i = 0; i < n; i++) new_off[i] = ddp_model_param_offset(m, i);
    if (dp->opt) s = ddp_optimizer_relayout(dp->opt, (size_t)n, old_off, new_off, len);
  }
  if (s == DDP_OK) {
    for (int k = 0; k < n; k++) dp->order[k] = msg[k];
    ddp__dp_assign_buckets(dp);
    ddp__dp_log_layout(dp, "re-laid out in the gradients' ready order");
    dp->relaid_out = true;
    s = ddp__dp_reserve_works(dp);
  }
  ddp_free(layout);
  ddp_free(seg);
  ddp_free(msg);
  if (s != DDP_OK) return ddp_error_wrap(s, "ddp: relayout");
  return DDP_OK;
}

void ddp__dp_log_layout(const ddp_dp *dp, const char *when) {
  if (dp->rank != 0 || ddp_log_get_level() > DDP_LOG_INFO) return;
  const ddp_dp_options *o = &dp->options;
  DDP_INFO("ddp: wrapper %s: %d ranks, %d parameters (%lld floats) in %d buckets "
           "(bucket_cap_mb %g, first_bucket_mb %g), find_unused_parameters %s, static_graph %s, "
           "relayout %s",
           when, dp->world, dp->n_params, (long long)ddp_model_num_param_elements(dp->model),
           dp->n_buckets, o->bucket_cap_mb, o->first_bucket_mb,
           o->find_unused_parameters ? "on" : "off", o->static_graph ? "on" : "off",
           o->relayout ? "on" : "off");
  for (int b = 0; b < dp->n_buckets; b++) {
    const ddp_dp_bucket *bk = &dp->buckets[b];
    char names[512];
    size_t len = 0;
    names[0] = '\0';
    for (int j = 0; j < bk->n_params && len + 1 < sizeof names; j++)
      len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", j ? ", " : "",
                              ddp_model_param_name(dp->model, bk->params[j]));
    DDP_INFO("ddp:   bucket %d: %zu floats (%.1f KiB), %d parameters: %s%s", b, bk->numel,
             (double)bk->numel * 4 / 1024, bk->n_params, names,
             len + 1 >= sizeof names ? " ..." : "");
  }
}
