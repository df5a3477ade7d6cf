/* SyncBatchNorm over a process group: the tensor op takes a "sum these
 * doubles across the replicas" callback (ddp_batch_norm_sync) so that tensor
 * and nn stay below comm; this file is the callback for a ddp group. */
#include "ddp/parallel.h"

/* buf is host memory: a group that refuses it (nccl) sums over its host
 * group (made at the first call, which every rank reaches at the same
 * layer; ddp_model_convert_sync_batchnorm makes it up front). */
static ddp_status group_allreduce_sum(void *user, double *buf, size_t count) {
  ddp_process_group *pg = user;
  if (!ddp_process_group_takes_host(pg)) DDP_TRY(ddp_process_group_host_group(pg, &pg));
  return ddp_allreduce(pg, buf, count, DDP_FLOAT64, DDP_REDUCE_SUM);
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
  /* The statistics are summed in host doubles (the CUDA kernels copy them
   * back: 2C + 1 values a layer), so an nccl group sums them over its host
   * group, made here, where every rank converts at the same point. */
  ddp_process_group *host = NULL;
  ddp_status s = ddp_process_group_host_group(group, &host);
  if (s != DDP_OK) return ddp_error_wrap(s, "convert_sync_batchnorm");
  ddp_batch_norm_sync sync = ddp_batch_norm_sync_for_group(host);
  ddp_model_set_batch_norm_sync(model, &sync);
  return DDP_OK;
}
