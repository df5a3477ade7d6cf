/* ddp-train under an elastic launcher (ddprun --nnodes MIN:MAX): every round
 * starts the same command at a new world size, so the run resumes from its
 * latest checkpoint when there is one (--resume auto), and the per-rank batch
 * is recomputed to keep the global batch of the checkpoint's run
 * (--elastic-batch global, the default) or kept (--elastic-batch per-rank). */
#ifndef DDP_TOOLS_TRAIN_ELASTIC_H
#define DDP_TOOLS_TRAIN_ELASTIC_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"

/* --resume auto: the --save path when its files exist, else NULL (a fresh
 * start: round 0 of an elastic job). Any other value is returned as given. */
const char *train_elastic_resume_path(const char *resume, const char *save_path);

/* With --elastic-batch global, resuming: *batch_size becomes the
 * checkpoint's global batch (its "ddp-train.global_batch": the per-rank
 * batch x the replicas of the run that started it) / `replicas`, whatever
 * --batch-size said; DDP_ERR_INVALID naming the numbers when it does not
 * divide. *changed: 1 when it changed the batch. A missing file is left to
 * the trainer's load to report. */
ddp_status train_elastic_batch(const char *resume_path, int64_t replicas, int64_t *batch_size, int *changed);

#endif /* DDP_TOOLS_TRAIN_ELASTIC_H */
