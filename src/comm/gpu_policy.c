/* The NCCL backend's decisions that need no GPU (gpu_policy.h). */
#include <stdio.h>
#include <string.h>

#include "comm/gpu_policy.h"

ddp_status ddp__gpu_placement_check(const ddp__gpu_place *ranks, int n,
                                    const char *const *host_names) {
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++) {
      const ddp__gpu_place *a = &ranks[i], *b = &ranks[j];
      if (a->host != b->host || strcmp(a->uuid, b->uuid) != 0) continue;
      if (strcmp(a->nccl_hostid, b->nccl_hostid) != 0) continue; /* NCCL: two "hosts" */
      const char *host = host_names && host_names[i] ? host_names[i] : "?";
      return ddp_error(DDP_ERR_INVALID,
                       "nccl: ranks %d and %d (host %s) both use one GPU (cuda:%d of rank %d, "
                       "cuda:%d of rank %d, %s): NCCL needs a GPU per rank; start at most as "
                       "many ranks per host as it has GPUs (each on cuda:LOCAL_RANK), or use "
                       "backend \"ddp\", which stages GPU buffers through host memory",
                       i, j, host, a->device, i, b->device, j, a->uuid[0] ? a->uuid : "same UUID");
    }
  return DDP_OK;
}

ddp__watch_action ddp__watch_decide(const ddp__watch_input *in, ddp_status *status, char *msg,
                                    size_t bytes) {
  char what[96];
  if (in->op)
    snprintf(what, sizeof what, "%s #%llu", in->op, (unsigned long long)in->seq);
  else
    snprintf(what, sizeof what, "no operation pending");
  /* 0 is ncclSuccess, 7 ncclInProgress: neither is a failure. */
  if (in->async_error != 0 && in->async_error != 7) {
    *status = DDP_ERR_IO;
    snprintf(msg, bytes, "nccl: %s (rank %d of %d): NCCL reported error %d (%s); communicator aborted",
             what, in->rank, in->size, in->async_error,
             in->async_error_str ? in->async_error_str : "no description");
    return DDP__WATCH_ABORT;
  }
  if (in->dead_peer >= 0) {
    *status = DDP_ERR_PEER;
    snprintf(msg, bytes, "nccl: %s (rank %d of %d): rank %d died (%s); communicator aborted", what,
             in->rank, in->size, in->dead_peer, in->dead_why ? in->dead_why : "reported dead");
    return DDP__WATCH_ABORT;
  }
  if (in->op && in->now_ns >= in->deadline_ns) {
    *status = DDP_ERR_TIMEOUT;
    char where[200] = "";
    if (in->device_state == DDP__DEVICE_QUEUED)
      snprintf(where, sizeof where, "; it never started on cuda:%d (work queued before it on the "
               "communication stream did not finish)", in->device);
    else if (in->device_state == DDP__DEVICE_RUNNING)
      snprintf(where, sizeof where, "; it started on cuda:%d %.3g s after it was enqueued and "
               "waited %.3g s there for its peers", in->device,
               (double)(in->device_started_ns - in->started_ns) / 1e9,
               (double)(in->now_ns - in->device_started_ns) / 1e9);
    snprintf(msg, bytes, "nccl: %s (rank %d of %d) did not complete within %.3g s%s; communicator "
             "aborted", what, in->rank, in->size,
             (double)(in->deadline_ns - in->started_ns) / 1e9, where);
    return DDP__WATCH_ABORT;
  }
  return DDP__WATCH_CONTINUE;
}
