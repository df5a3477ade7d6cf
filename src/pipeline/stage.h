/* The pipeline object shared by pipeline.c (setup: split, copy, shapes,
 * buffers) and exec.c (running a schedule). Internal. */
#ifndef DDP__PIPELINE_STAGE_H
#define DDP__PIPELINE_STAGE_H

#include "pipeline/pipeline_internal.h"
#include "pipeline/split.h"

/* A receive buffer (activations in, with room for their gradient going back;
 * or a gradient in) and the transfer that last used it: a buffer is taken
 * again only after that transfer completed. */
typedef struct pp_slot {
  float *data;
  float *grad;     /* activation slots in training: d(input), sent back */
  ddp_tensor *data_mem, *grad_mem; /* what owns data and grad (on pp->device) */
  ddp_work *work;  /* pending transfer on data or grad; NULL when none */
  bool busy;
} pp_slot;

/* A tape per micro-batch in flight, and the send of its output. */
typedef struct pp_tape {
  ddp_tape *tape;
  ddp_work *send;
  bool busy;
} pp_tape;

/* One of this rank's stages. */
typedef struct pp_chunk {
  int stage;               /* global stage index */
  ddp_module **mods;       /* its top-level modules in this rank's model, forward order */
  int n_mods;
  int in_ndim, out_ndim;   /* per-row shapes (without the batch dim) */
  int64_t in_shape[DDP_MAX_DIMS], out_shape[DDP_MAX_DIMS];
  int64_t in_row, out_row; /* elements per row */
  pp_slot *acts, *grads;   /* pools */
  int n_acts, n_grads;
  pp_tape *tapes;
  int n_tapes;
  /* Per micro-batch (M entries): which pool entries it holds, its input
   * leaf, its output and loss (tape-owned). */
  int *act_of, *grad_of, *tape_of;
  ddp_tensor *inputs, *targets; /* views the tapes keep pointers to until backward */
  ddp_tensor **outputs, **losses;
} pp_chunk;

struct ddp_pipeline {
  ddp_process_group *pg;
  /* pg, or its host group where pg takes device buffers only (nccl): the
   * setup's small host collectives (the split, the shapes, the
   * agreements) go there. Borrowed from pg. */
  ddp_process_group *host_pg;
  ddp_device device; /* options.device: where the stages compute */
  int rank, p, v, m, n_stages;
  ddp_pipeline_options options;
  ddp_model *model; /* this rank's modules */
  /* The split, agreed on every rank: bounds[g] is stage g's first top-level
   * module, names[k] the k-th module's name in forward order. */
  int n_mods;
  char **names;
  int bounds[DDP_PIPELINE_MAX_STAGES + 1];
  char split[512];
  /* Every stage's per-row input shape (stage_in[n_stages] is the output). */
  int stage_ndim[DDP_PIPELINE_MAX_STAGES + 1];
  int64_t stage_shape[DDP_PIPELINE_MAX_STAGES + 1][DDP_MAX_DIMS];
  pp_chunk chunks[DDP_PIPELINE_MAX_VIRTUAL];
  ddp_pipeline_schedule *train, *eval;
  ddp__pp_channels *channels;
  int64_t max_rows; /* per micro-batch */
  float scale;      /* the loss gradient's seed: grad_scale x loss_scale */
  float grad_scale; /* options.grad_scale, or 1 / M */
  ddp_pipeline_grad_sync_fn sync_fn;
  void *sync_user;
  bool failed;
  char failure[1024];
  /* The batch-size header (exec.c, agree_batch) and its send; on a GPU it
   * travels in header_dev (device memory: an nccl channel takes nothing
   * else), copied from and to `header`. */
  int64_t header[2];
  ddp_tensor *header_dev;
  ddp_work *header_work;
  /* On a GPU: the last stage's micro-batch losses, copied back without
   * waiting (pinned, M floats) and read once after the schedule. */
  float *loss_host;
  /* This step's micro-batches. */
  int64_t *rows, *offsets; /* (M) */
  /* Stats. */
  ddp_pipeline_stats stats;
  double sum_wait_s, sum_step_s;
  int64_t wait_ns; /* this step's */
};

/* exec.c: frees what the chunks hold (waiting for their transfers). */
void ddp__pp_chunks_free(ddp_pipeline *pp);

#endif /* DDP__PIPELINE_STAGE_H */
