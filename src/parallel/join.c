/* Join: training with uneven inputs (torch.distributed.algorithms.Join with
 * DDP's join hook). While join is enabled, every pre-forward allgathers
 * [training, syncing] from every rank. A rank out of data calls ddp_dp_join,
 * which contributes [0, 0] to the same allgather each round and, while other
 * ranks still train, shadows their iteration's collectives: the buffer
 * broadcast (when they sync buffers) and one allreduce per bucket of zeros
 * (when they sync gradients). When a round counts no rank training, every
 * rank is in ddp_dp_join; the last to join (those that shadowed nothing)
 * are authoritative and the highest of them broadcasts parameters and
 * buffers, as DDP's join hook does in its post-hook. */
#include <string.h>

#include "parallel/dp_internal.h"

ddp_status ddp__dp_join_count(ddp_dp *dp, bool training, bool syncing, int *n_training,
                              int *n_syncing, int *highest_training) {
  int32_t mine[2] = {training, training && syncing};
  ddp_status s = DDP_OK;
  if (dp->world > 1)
    s = ddp_allgather(dp->host_pg, mine, dp->join_gather, 2, DDP_INT32);
  else
    memcpy(dp->join_gather, mine, sizeof mine);
  if (s != DDP_OK) return ddp_error_wrap(s, "ddp: join: counting the ranks still training");
  *n_training = *n_syncing = 0;
  *highest_training = 0;
  for (int r = 0; r < dp->world; r++) {
    *n_training += dp->join_gather[2 * r];
    *n_syncing += dp->join_gather[2 * r + 1];
    if (dp->join_gather[2 * r]) *highest_training = r;
  }
  return DDP_OK;
}

/* SyncBatchNorm's forward and backward are collectives of their own that a
 * joined rank cannot shadow (it would have to run the layers' reductions
 * with zero counts); PyTorch's DDP join documents the same limitation. */
static ddp_status refuse_sync_batchnorm(ddp_dp *dp, const char *call) {
  if (!ddp_model_batch_norm_synced(dp->model)) return DDP_OK;
  return ddp_error(DDP_ERR_UNSUPPORTED,
                   "ddp: %s: join does not support SyncBatchNorm (a joined rank cannot shadow "
                   "its collectives); give every rank the same number of batches, or convert "
                   "back with ddp_model_convert_sync_batchnorm(model, NULL)", call);
}

ddp_status ddp_dp_join_enable(ddp_dp *dp, bool divide_by_initial_world_size) {
  if (dp->armed) return ddp_error(DDP_ERR_STATE, "ddp: join_enable during a backward");
  DDP_TRY(refuse_sync_batchnorm(dp, "join_enable"));
  dp->join_enabled = true;
  dp->join_divide_initial = divide_by_initial_world_size;
  return DDP_OK;
}

/* One shadowed backward: zeros through every bucket, in bucket order, with
 * the same hook the training ranks use. */
static ddp_status shadow_backward(ddp_dp *dp) {
  ddp_model *m = dp->model;
  if (dp->kernels) /* the gradients are on a GPU */
    dp->kernels->fill(ddp_model_grads_flat(m), 0.0f, ddp_model_num_param_elements(m));
  else
    memset(ddp_model_grads_flat(m), 0, (size_t)ddp_model_num_param_elements(m) * sizeof(float));
  ddp__dp_arm(dp, true);
  for (int k = 0; k < dp->n_params; k++) ddp__dp_mark_ready(dp, dp->order[k]);
  ddp_status s = ddp__dp_complete(dp);
  dp->armed = false;
  DDP_TRY(s);
  dp->iterations++;
  /* The training ranks decide the relayout after their first synced
   * iteration; a rank that joined before it takes part in that broadcast. */
  if (!dp->relayout_done) DDP_TRY(ddp__dp_maybe_relayout(dp));
  return DDP_OK;
}

ddp_status ddp_dp_join(ddp_dp *dp) {
  if (!dp->join_enabled)
    return ddp_error(DDP_ERR_STATE, "ddp: join without join_enable (every rank must call "
                                    "ddp_dp_join_enable before its loop)");
  if (dp->armed) return ddp_error(DDP_ERR_STATE, "ddp: join during a backward");
  DDP_TRY(refuse_sync_batchnorm(dp, "join"));
  bool last_joiner = true;
  for (;;) {
    int n_training, n_syncing, highest;
    DDP_TRY(ddp__dp_join_count(dp, false, false, &n_training, &n_syncing, &highest));
    if (n_training == 0) break;
    last_joiner = false;
    if (dp->options.broadcast_buffers && dp->forward_param_sync) {
      ddp_status s = ddp__dp_broadcast_state(dp, highest, false);
      if (s != DDP_OK) return ddp_error_wrap(s, "ddp: join: shadowing the buffer broadcast");
    }
    dp->forward_param_sync = n_syncing > 0;
    if (n_syncing > 0) {
      dp->divisor = dp->join_divide_initial ? dp->world : n_training;
      ddp_status s = shadow_backward(dp);
      if (s != DDP_OK) return ddp_error_wrap(s, "ddp: join: shadowing the gradient allreduce");
    }
  }
  /* Everyone has joined: the final model comes from the last joiner. */
  int32_t candidate = last_joiner ? dp->rank : -1;
  ddp_status s = dp->world > 1 ? ddp_allreduce(dp->host_pg, &candidate, 1, DDP_INT32, DDP_REDUCE_MAX)
                               : DDP_OK;
  if (s == DDP_OK) s = ddp__dp_broadcast_state(dp, candidate < 0 ? 0 : candidate, true);
  dp->join_enabled = false;
  dp->forward_param_sync = true;
  if (s != DDP_OK) return ddp_error_wrap(s, "ddp: join: synchronising the final model");
  return DDP_OK;
}
