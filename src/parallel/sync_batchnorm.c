/* SyncBatchNorm over a process group: the tensor op takes a "sum these
 * doubles across the replicas" callback (ddp_batch_norm_sync) so that tensor
 * and nn stay below comm; this file is the callback for a ddp group. */
#include "ddp/parallel.h"

static ddp_status group_allreduce_sum(void *user, double *buf, size_t count) {
  return ddp_allreduce((ddp_process_group *)user, buf, count, DDP_FLOAT64, DDP_REDUCE_SUM);
}

ddp_batch_norm_sync ddp_batch_norm_sync_for_group(ddp_process_group *group) {
  return (ddp_batch_norm_sync){.allreduce_sum = group_allreduce_sum, .user = group};
}

ddp_status ddp_model_convert_sync_batchnorm(ddp_model *model, ddp_process_group *group) {
  if (!model) return ddp_error(DDP_ERR_INVALID, "convert_sync_batchnorm: model is NULL");
  if (!group) {
    ddp_model_set_batch_norm_sync(model, NULL);
    return DDP_OK;
  }
  ddp_batch_norm_sync sync = ddp_batch_norm_sync_for_group(group);
  ddp_model_set_batch_norm_sync(model, &sync);
  return DDP_OK;
}
