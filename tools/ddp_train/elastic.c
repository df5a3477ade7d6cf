/* ddp-train across worlds (tools/ddp_train/elastic.h): the resume that an
 * elastic round needs, read from the checkpoint before the trainer exists. */
#include "ddp_train/elastic.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp/io.h"

const char *train_elastic_resume_path(const char *resume, const char *save_path) {
  if (!resume || strcmp(resume, "auto") != 0) return resume;
  char train[4096];
  if (!save_path || ddp_checkpoint_train_path(save_path, train, sizeof train) != DDP_OK) return NULL;
  return access(save_path, R_OK) == 0 && access(train, R_OK) == 0 ? save_path : NULL;
}

ddp_status train_elastic_batch(const char *resume_path, int64_t replicas, int64_t *batch_size, int *changed) {
  *changed = 0;
  if (!resume_path) return DDP_OK;
  char train[4096];
  if (ddp_sharded_is_checkpoint(resume_path)) {
    /* A sharded checkpoint's metadata file holds the training state and
     * the run's metadata, as a checkpoint's .train file does. */
    if (snprintf(train, sizeof train, "%s/metadata.safetensors", resume_path) >= (int)sizeof train)
      return ddp_error(DDP_ERR_INVALID, "--resume %s: path too long", resume_path);
  } else {
    DDP_TRY(ddp_checkpoint_train_path(resume_path, train, sizeof train));
  }
  if (access(train, R_OK) != 0) return DDP_OK; /* the trainer's load says what is missing */
  ddp_safetensors *st;
  DDP_TRY(ddp_safetensors_read(train, &st));
  ddp_status s = DDP_OK;
  ddp_safetensors_tensor t;
  int64_t saved_world = 0;
  const char *global = ddp_safetensors_metadata(st, "ddp-train.global_batch");
  if (ddp_safetensors_find(st, "train.world_size", &t) != DDP_OK || t.dtype != DDP_INT64 || t.ndim != 0) {
    s = ddp_error(DDP_ERR_FORMAT, "%s: no train.world_size scalar", train);
  } else if (global) { /* else: saved with --elastic-batch per-rank; the meta comparison says so */
    memcpy(&saved_world, t.data, sizeof saved_world);
    char *end;
    long long g = strtoll(global, &end, 10);
    if (*end || g < 1) {
      s = ddp_error(DDP_ERR_FORMAT, "%s: ddp-train.global_batch is \"%s\"", train, global);
    } else if (g != *batch_size * replicas) {
      /* The run's global batch wins over --batch-size, at another world
       * (the elastic case) as at the same one (a later round at the world
       * of an earlier one gives back the per-rank batch of that round). */
      if (g % replicas != 0)
        s = ddp_error(DDP_ERR_INVALID,
                      "%s was saved at %lld data-parallel ranks with a global batch of %lld, which does not "
                      "divide over this run's %lld ranks (--elastic-batch per-rank keeps the per-rank batch "
                      "instead)", resume_path, (long long)saved_world, g, (long long)replicas);
      else if (g / replicas != *batch_size) {
        *batch_size = g / replicas;
        *changed = 1;
      }
    }
  }
  ddp_safetensors_free(st);
  return s;
}
