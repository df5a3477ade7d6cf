/* ddp train: the training loop as a library (what ddp-train, the
 * hyperparameter search, the pipeline and the parameter server run). A
 * trainer borrows a model, its training and test data and, optionally, a
 * process group (the world, a subgroup, or NULL for one process); it owns
 * the optimizer, the lr schedule, the samplers and loaders, the
 * data-parallel wrapper, checkpoints and the JSON-lines log. docs/train.md
 * has the rules.
 *
 * The model of use:
 *
 *   ddp_train_options o = ddp_train_defaults();
 *   o.epochs = 3;
 *   o.optim.sgd.momentum = 0.9;
 *   o.callbacks.on_step = my_step;           // progress, tracing, pruning ...
 *   ddp_trainer *t;
 *   DDP_TRY(ddp_trainer_create(&t, model, train_ds, test_ds, pg, &o));  // pg may be NULL
 *   ddp_train_result r;
 *   ddp_status s = ddp_trainer_run(t, &r);   // collective over pg
 *   printf("%.2f%%\n", 100 * r.test_accuracy);
 *   ddp_train_result_free(&r);
 *   ddp_trainer_destroy(t);
 *
 * With a group, every rank of it creates its trainer with the same options
 * and runs it: each trains on its shard of every epoch (PyTorch's
 * DistributedSampler), gradients are averaged over the group while backward
 * runs, the test set is split without padding and its metrics reduced, so
 * every rank ends with the same result. Ranks outside the group take no
 * part: trainers on disjoint subgroups train side by side. */
#ifndef DDP_TRAIN_H
#define DDP_TRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/data.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_trainer ddp_trainer;

/* How the model is spread over the group (docs/train.md, "Strategies").
 * AUTO: the pipeline with options.pipeline, the parameter server with
 * options.param_server, else data parallel with a group and single
 * without. An explicit value that contradicts those options is
 * DDP_ERR_INVALID. */
typedef enum ddp_train_strategy {
  DDP_TRAIN_AUTO = 0,
  DDP_TRAIN_SINGLE = 1,        /* this process alone; a group is only for the reductions */
  DDP_TRAIN_DATA_PARALLEL = 2, /* DistributedDataParallel over the group */
  DDP_TRAIN_PIPELINE = 3,      /* stages over the group (needs options.pipeline) */
  DDP_TRAIN_PARAM_SERVER = 4,  /* trainers of a parameter server (needs options.param_server) */
  DDP_TRAIN_ZERO = 5,          /* ZeRO stage options.zero_stage over the group (ddp/zero.h) */
} ddp_train_strategy;

/* Where one step's time went, in milliseconds (PyTorch's DDP logging splits
 * a step the same way). backward_comm: from the last bucket's launch to the
 * end of the gradients' reduction, the communication backward did not hide,
 * the wait for the slowest rank included. preempted is no part but a cause:
 * the time this rank was ready to run while another task held its CPU (NaN
 * where the kernel has no schedstat). */
typedef struct ddp_train_phases {
  double load_ms, forward_ms, backward_compute_ms, backward_comm_ms, optimizer_ms, step_ms,
      preempted_ms;
} ddp_train_phases;

/* What a step callback sees, after the step's update; the same on every
 * rank of the group but for phases and preempted (this rank's). */
typedef struct ddp_train_step_info {
  int64_t step;          /* optimizer steps since the start of training (1 after the first) */
  int64_t epoch;         /* 0-based epoch the step belongs to */
  int64_t total_steps;   /* steps this run will make at most (epochs and max_steps) */
  double loss;           /* the global batch's mean loss */
  double lr;             /* the learning rate the step used */
  double samples_per_s;  /* every rank's samples over the training time so far */
  double train_seconds;  /* training time so far (steps only, no evaluation) */
  ddp_train_phases phases;
  /* Gradient scaling (options.grad_scaler): the scale after this step's
   * update, whether this step was skipped for an inf/NaN gradient (on
   * every rank alike), and the steps skipped since the start of training
   * (a resumed run counts from its resume). loss_scale NaN and the rest 0
   * without a scaler. */
  double loss_scale;
  bool skipped;
  int64_t skipped_steps;
} ddp_train_step_info;

typedef enum ddp_train_eval_kind {
  DDP_TRAIN_EVAL_PERIODIC = 0, /* every eval_every steps */
  DDP_TRAIN_EVAL_EPOCH = 1,    /* at the end of an epoch (eval_every 0), or where max_steps stopped it */
  DDP_TRAIN_EVAL_FINAL = 2,    /* the end of training, when no other evaluation was just made */
} ddp_train_eval_kind;

/* An evaluation on the whole test set (every sample counted once over the
 * group); the same on every rank. */
typedef struct ddp_train_eval_info {
  int64_t step, epoch;
  double test_loss;     /* mean over the test samples */
  double test_accuracy; /* fraction correct; NaN for a regression model */
  ddp_train_eval_kind kind;
} ddp_train_eval_info;

/* Where training starts: 0, or where a resumed checkpoint stopped. */
typedef struct ddp_train_start_info {
  int64_t step, epoch, epoch_batches; /* the position resumed from (all 0 when fresh) */
  int64_t steps_per_epoch;            /* batches per epoch on each rank */
  int64_t total_steps;                /* as in ddp_train_step_info */
  bool resumed;
} ddp_train_start_info;

/* Callbacks, all optional, called on every rank of the group in the same
 * order. on_step and on_eval return true to stop training: the run stops
 * after that step (or evaluation) on every rank of the group, whichever
 * rank asked (the requests are reduced over the group), and the result
 * says so. A callback must not call collectives on the trainer's group. */
typedef struct ddp_train_callbacks {
  void (*on_start)(const ddp_train_start_info *info, void *user);
  bool (*on_step)(const ddp_train_step_info *info, void *user);
  bool (*on_eval)(const ddp_train_eval_info *info, void *user);
  void *user;
} ddp_train_callbacks;

/* Pipeline parallelism in the trainer (ddp_train_options.pipeline;
 * docs/train.md, "Pipeline"). The group of G ranks is a mesh of P stages x
 * D = G / P replicas: ranks [k*P, (k+1)*P) form replica k (a pipeline group
 * each), and the ranks holding the same stage form its data-parallel group
 * (both made once, by ddp_process_group_split). The sampler shards every
 * epoch over the D replicas by replica index; every rank of a replica reads
 * the same batches, stage 0 feeds them in and the last stage takes the
 * targets. Each stage's gradients are averaged over its data-parallel group
 * once per step, after the last micro-batch's backward, and its BatchNorm
 * buffers follow the group's first replica (DDP's broadcast_buffers).
 * sync_bn reduces batch statistics over the stage's data-parallel group.
 * M is ddp_train_options.microbatches (>= 1). Start from
 * ddp_train_pipeline_defaults(), then set the stages. */
typedef struct ddp_train_pipeline {
  int32_t stages;                      /* P: ranks per pipeline, >= 2, dividing the group */
  ddp_pipeline_schedule_kind schedule; /* GPIPE, 1F1B or INTERLEAVED */
  int32_t virtual_stages;              /* v: stages per rank (1; interleaved >= 2) */
  /* Where stages begin: top-level module names ("layer2", "a,b,c") or
   * "auto"/NULL (measured cost; rank 0 decides). Borrowed. */
  const char *split;
  uint64_t reserved[4]; /* zero */
} ddp_train_pipeline;
DDP_STRUCT_SIZE(ddp_train_pipeline, 56);

/* 2 stages, 1F1B, virtual_stages 1, split NULL ("auto"). */
ddp_train_pipeline ddp_train_pipeline_defaults(void);

/* ddp_train_options.grad_scaler: whether the run scales the loss
 * (ddp-train --grad-scaler auto|on|off). */
typedef enum ddp_train_grad_scaler {
  DDP_TRAIN_GRAD_SCALER_AUTO = 0, /* on for fp16, off for fp32, bf16 and tf32 */
  DDP_TRAIN_GRAD_SCALER_ON = 1,
  DDP_TRAIN_GRAD_SCALER_OFF = 2,
} ddp_train_grad_scaler;

/* Everything ddp-train's flags express. Start from ddp_train_defaults(). */
typedef struct ddp_train_options {
  int64_t epochs;          /* passes over the training set; 0 = only evaluate (1) */
  int64_t max_steps;       /* stop after this many steps in total, 0 = no limit (0) */
  int64_t batch_size;      /* samples per step on each rank (100) */
  int64_t eval_batch_size; /* 0 = max(batch_size, 1000) */
  ddp_optim_options optim; /* SGD, lr 0.01 */
  int64_t step_lr_size;    /* > 0: StepLR, lr times step_lr_gamma every this many epochs (0) */
  double step_lr_gamma;    /* (0.1) */
  uint64_t seed;           /* the sampler's shuffle: torch.randperm(N) seeded seed + epoch (1) */
  int workers;             /* loader threads; -1 = 1, or 0 when the ranks on this host (from
                            * LOCAL_WORLD_SIZE, else the group's size) fill its CPUs (-1) */
  ddp_train_strategy strategy;
  bool sync_bn;            /* data parallel: convert the model's BatchNorm to SyncBatchNorm */
  int64_t eval_every;      /* evaluate every N steps; 0 = at each epoch's end and the end (0) */
  int64_t patience;        /* stop after this many evaluations without a better test
                            * loss; 0 = never (0) */
  const char *log_path;    /* JSON lines, per step and per evaluation (rank 0); NULL: none */
  const char *save_path;   /* checkpoint at the end (rank 0 writes; docs/io.md); NULL: none */
  int64_t save_every;      /* also every N steps (needs save_path); 0: at the end only */
  const char *resume_path; /* continue the run saved there; NULL: start fresh */
  /* Options a resumed run must share with the saved one, stored in both
   * checkpoint files and compared on resume (borrowed; may be NULL). */
  const ddp_kv *checkpoint_meta;
  size_t checkpoint_meta_count;
  ddp_train_callbacks callbacks;
  /* Where the step runs: DDP_CPU (default) or DDP_CUDA(i). The trainer
   * moves the model there (ddp_model_to) and copies each batch over; the
   * optimizer's state lives there too. One process per device: data
   * parallelism over GPUs (NCCL) is not there yet and is refused. */
  ddp_device device;
  /* On a GPU: after a few eager steps, capture the step of a full batch
   * (zero_grad, forward, loss, backward) once as a CUDA graph and replay
   * it for every full batch, the optimizer launched after it; the last,
   * smaller batch of an epoch and evaluation run eagerly (docs/cuda.md,
   * "CUDA graphs"). Refused (DDP_ERR_UNSUPPORTED, saying why) on the CPU,
   * with SyncBatchNorm and with dropout. (false) */
  bool cuda_graph;
  /* Data parallel: the wrapper's bucket cap in MiB (ddp_dp_options
   * .bucket_cap_mb; the first bucket's 1 MiB too when it is smaller);
   * 0 = the wrapper's defaults (25, first 1). (0) */
  double bucket_cap_mb;
  /* A timeline of the run: Chrome trace event JSON (Perfetto,
   * chrome://tracing) written to this path when ddp_trainer_run returns
   * (temporary name, then rename); every rank writes its own, so give each
   * rank its own path. Events are kept in a buffer sized when the run
   * starts (docs/debugging.md, "Timeline"). NULL: no tracing, which costs
   * one branch per step. Borrowed. (NULL) */
  const char *trace_path;
  /* Gradient accumulation: each step splits its batch along dim 0 into
   * this many micro-batches (torch.tensor_split's sizes: the first N % M
   * get a row more; a batch of fewer than M rows goes in N micro-batches
   * of one), runs forward and backward on each, and scales the
   * accumulated gradients by 1/M (a mean loss; microbatch_sum: not
   * scaled) before the optimizer. Under data parallelism the gradients are
   * reduced once, after the last micro-batch's backward (no_sync before).
   * BatchNorm normalises each micro-batch with its own statistics and
   * updates its running statistics once per micro-batch, as PyTorch does.
   * With `pipeline` this is the pipeline's M. 0 or 1: the whole batch at
   * once. CPU only. (0) */
  int32_t microbatches;
  bool microbatch_sum; /* gradients summed over micro-batches, not averaged (false) */
  /* Pipeline parallelism (docs/train.md, "Pipeline"): the model split into
   * stages over the group's ranks. NULL: no pipeline. Borrowed. */
  const struct ddp_train_pipeline *pipeline;
  /* Parameter-server training (include/ddp/ps.h, docs/ps.md): this
   * process is one of the trainers; each step's gradients go to the
   * servers through this client and fresh parameters come back in the
   * optimizer's place. pg must be NULL (trainers share no group: RPC
   * outlives a trainer's death); the sampler shards over the trainers.
   * NULL: none. Borrowed. */
  struct ddp_ps_client *param_server;
  /* DataParallel (include/ddp/parallel.h): the single strategy runs each
   * step's batch over this many replicas, threads of this process, the
   * gradients summed into the one model (sync_bn: SyncBatchNorm across
   * them). 0 or 1: the model alone. CPU; not with a group. (0) */
  int32_t replicas;
  /* ZeRO (include/ddp/zero.h, docs/sharding.md): 1 or 2 shards the
   * optimizer state (and, at 2, the gradients' reduction) over the group,
   * 3 the parameters too (gathered per top-level module);
   * AUTO then picks DDP_TRAIN_ZERO. Its checkpoints are the ordinary ones
   * (the state gathered to rank 0), which load at any world size and
   * stage. 0: none. (0) */
  int16_t zero_stage;
  /* save_path is a directory of shards (include/ddp/io.h, "Sharded
   * checkpoints"): every rank writes its range of the parameters and of
   * the optimizer state, rank 0 the metadata. resume_path may name such a
   * directory whatever this option is. (false) */
  bool sharded_checkpoint;
  /* zero_stage 3: no prefetch of the next top-level module's gather
   * (ddp_zero_options.no_prefetch; docs/sharding.md, "Prefetch"), to
   * measure what it gains. (false) */
  bool zero_no_prefetch;
  /* The struct grew by 72 bytes here at once for issues 41 and 42. */
  /* Mixed precision (docs/mixed-precision.md): a ddp_precision from
   * ddp/tensor.h. FP32 (0): every op in float32. BF16, FP16: autocast's
   * region (ddp/tensor.h, "Autocast") around each step's forward and loss
   * and around evaluation's; CPU only so far. TF32: refused on the CPU
   * (a GPU-only opt-in) and not switched on GPUs yet. (0) */
  int32_t precision;
  /* Data parallel: the DDP communication hook, a ddp_dp_hook_kind from
   * ddp/parallel.h (0: allreduce, PyTorch's default). powersgd_rank > 0:
   * PowerSGD at that rank instead (with comm_hook 0; ddp_powersgd in
   * ddp/parallel.h, PyTorch's other defaults), its plain-allreduce steps
   * powersgd_start_iter (0: PyTorch's 1000; else > 1). PowerSGD's state
   * (error feedback, Q's) is saved beside each checkpoint, one file per
   * rank (docs/parallel.md, "PowerSGD"), and resumed at the same world
   * size. Only the data-parallel strategy on the CPU takes PowerSGD; the
   * fp16/bf16 hooks run on a GPU too. (0, 0, 0) */
  int32_t comm_hook;
  int32_t powersgd_rank;
  int32_t powersgd_start_iter;
  /* Gradient-norm clipping (issue 41): > 0 scales the gradients so that
   * their global L2 norm, over the whole model, is at most this before
   * the optimizer steps (torch.nn.utils.clip_grad_norm_). 0: none. (0) */
  double clip_grad_norm;
  /* Gradient scaling (issue 42; include/ddp/optim.h "Gradient scaling",
   * docs/mixed-precision.md): a ddp_train_grad_scaler. AUTO: on for
   * fp16, off otherwise. With it on, backward's loss gradient is seeded
   * with the scale, the gradients are unscaled once per optimizer step
   * (after the last micro-batch and the reduction, before clipping), the
   * inf/NaN finding is agreed over the group (one 4-byte allreduce MAX)
   * and a step with one is skipped on every rank. (AUTO) */
  int32_t grad_scaler;
  /* The scaler's growth_interval; 0: PyTorch's 2000. (0) */
  int32_t grad_scaler_growth_interval;
  uint64_t reserved[5]; /* zero: room for later options */
} ddp_train_options;
DDP_STRUCT_SIZE(ddp_train_options, 400);

/* epochs 1, batch 100, SGD lr 0.01 (no momentum), seed 1, automatic
 * workers, evaluation at each epoch's end, no log, no checkpoints. */
ddp_train_options ddp_train_defaults(void);

/* Why the run ended. */
typedef enum ddp_train_stop {
  DDP_TRAIN_STOP_EPOCHS = 0,    /* every epoch ran */
  DDP_TRAIN_STOP_MAX_STEPS = 1, /* max_steps reached */
  DDP_TRAIN_STOP_PATIENCE = 2,  /* early stopping: patience ran out */
  DDP_TRAIN_STOP_CALLBACK = 3,  /* a callback asked (on some rank of the group) */
} ddp_train_stop;
const char *ddp_train_stop_name(ddp_train_stop stop); /* "epochs", "max_steps", ... */

/* One pipeline rank's figures (ddp_pipeline_stats, over the run). */
typedef struct ddp_train_stage_stats {
  int32_t rank;               /* in the pipeline group (= its first stage's index) */
  int32_t live_high_water;    /* micro-batches in flight at once */
  double idle_fraction;       /* waiting for transfers / step time, summed over steps */
  int64_t activation_bytes_high_water; /* activations held at once, from its arenas */
  int64_t microbatch_activation_bytes; /* one micro-batch's forward alone */
} ddp_train_stage_stats;

/* One rank's training-state bytes (ddp_train_result.memory_per_rank;
 * docs/train.md, "Memory"). */
typedef struct ddp_train_memory {
  /* The flat buffers: the parameters the rank holds, its gradients (the
   * whole buffer under data parallelism and ZeRO-1: backward accumulates
   * into it; under ZeRO-2's gradient ring the rank's range plus the ring,
   * docs/sharding.md), its optimizer's state buffers (1/W under ZeRO). */
  int64_t param_bytes, grad_bytes, optim_state_bytes;
  /* The part of the gradient buffer that holds reduced gradients after a
   * step: all of it under data parallelism and ZeRO-1, the rank's range
   * under ZeRO-2 (the rest holds the rank's own, unreduced, until
   * zero_grad). */
  int64_t grad_reduced_bytes;
  /* The most tensor memory the rank held at once: the three buffers above
   * plus the high-water mark of the trainer's tape arenas (activations,
   * their gradients and the kernels' scratch of a step's forward and
   * backward). Not counted: the loader's batches, the data set, a
   * checkpoint's one-off buffers, libraries. */
  int64_t peak_tensor_bytes;
  /* The process's peak resident set (getrusage ru_maxrss): everything,
   * for ranks that are threads of one process the process's. */
  int64_t max_rss_bytes;
  /* Of grad_bytes, ZeRO-2's gradient ring (two bucket-sized slots
   * backward writes into); 0 without one. */
  int64_t grad_ring_bytes;
} ddp_train_memory;

/* What ddp-train's --json summary reports. Filled by ddp_trainer_run; free
 * with ddp_train_result_free. NaN where a figure does not exist (no step
 * ran, a regression model's accuracy, steady figures within the first 10
 * steps). */
typedef struct ddp_train_result {
  double samples_per_s;        /* every rank's samples over the training time */
  double steady_samples_per_s; /* the same without this process's first 10 steps */
  double train_loss;           /* mean over the last epoch's steps (all steps if < 1 epoch) */
  double test_loss, test_accuracy;
  int64_t steps;               /* optimizer steps since the start of training */
  int64_t steps_run;           /* of those, run by this call (not before a resume) */
  double epochs;               /* steps / steps per epoch */
  int world_size;              /* the group's size (1 without one) */
  ddp_train_phases steady_phases;     /* this rank's mean over the steady steps */
  double *steady_preempted_ms_per_rank; /* world_size entries, each rank's mean preempted_ms */
  ddp_train_stop stopped;
  /* Under a pipeline: one entry per pipeline rank (P), as that rank of
   * replica 0 measured it over the whole run; NULL and 0 otherwise. */
  const struct ddp_train_stage_stats *stages; /* owned by the result */
  int64_t n_stages;
  /* Each rank's training-state memory at the end (world_size entries, owned
   * by the result): the bytes of the flat buffers its optimizer steps
   * (parameters and gradients) and of its optimizer's state buffers (1/W
   * of the unsharded under ZeRO). */
  const struct ddp_train_memory *memory_per_rank;
  uint64_t reserved[1];
} ddp_train_result;
DDP_STRUCT_SIZE(ddp_train_result, 176);

void ddp_train_result_free(ddp_train_result *r);

/* Creates a trainer over `model`, `train` and `test` (borrowed: they must
 * outlive it) and `pg` (borrowed, may be NULL). Checks that the data fit
 * the model, converts BatchNorm to SyncBatchNorm when asked, creates the
 * optimizer, the schedule, the samplers and loaders and, for data
 * parallelism, the wrapper (collective: broadcasts rank 0's parameters).
 * Opens the log on rank 0. Bad options are DDP_ERR_INVALID naming the
 * option; nothing is left allocated on error. */
ddp_status ddp_trainer_create(ddp_trainer **out, ddp_model *model, ddp_dataset *train,
                              ddp_dataset *test, ddp_process_group *pg,
                              const ddp_train_options *options);

/* Trains (from the resumed checkpoint when options->resume_path), evaluates
 * and fills *result (also on some errors: what was reached). Collective
 * over the group. Errors say what and where: "step 37 (epoch 1): the loss
 * became nan; try a smaller lr", a checkpoint's file and offset, a peer
 * that failed. Run once per trainer. */
ddp_status ddp_trainer_run(ddp_trainer *t, ddp_train_result *result);

/* The optimizer the trainer made (for its state; owned by the trainer). */
ddp_optimizer *ddp_trainer_optimizer(ddp_trainer *t);

/* Frees what the trainer made and closes the log; NULL is fine. Not
 * collective. */
void ddp_trainer_destroy(ddp_trainer *t);

/* ---- The trainer's curves in TensorBoard ------------------------------------
 * Event files are io's (include/ddp/tensorboard.h); this attaches them to a
 * trainer (src/train/tensorboard.c). Rank 0 writes; call it on every rank
 * of the group, after the options are final:
 *
 *   ddp_train_tensorboard *tb;
 *   DDP_TRY(ddp_train_tensorboard_attach(&tb, &o, "runs/exp1", pg));  // pg may be NULL
 *   DDP_TRY(ddp_trainer_create(&t, model, train, test, pg, &o));
 *   ... ddp_trainer_run(t, &r) ...
 *   DDP_TRY(ddp_train_tensorboard_close(tb));   // the first write error, if any
 *
 * then `tensorboard --logdir runs`. */

/* What ddp_train_tensorboard_attach made: the writer (rank 0) and the
 * callbacks it chains to. Opaque. */
typedef struct ddp_train_tensorboard ddp_train_tensorboard;

/* Makes a trainer with these options write its curves to an event file in
 * `dir`: replaces options->callbacks with callbacks that write and then
 * call the ones that were there (their return values decide stops, as
 * before). Per step, at the step's number: train/loss, train/lr,
 * train/samples_per_s and phases/<phase>_ms for each part of the step
 * (load, forward, backward_compute, backward_comm, optimizer, step,
 * preempted), and train/loss_scale with a gradient scaler; per evaluation: test/loss and test/accuracy; at the start:
 * the options (those of the trainer, the group's size and
 * options->checkpoint_meta's pairs) as a Markdown table, text tag
 * "options". The names after the slash are the JSON log's keys
 * (docs/train.md, "TensorBoard"). Values are stored as float32, as
 * TensorBoard's scalars are; a value that is not finite (preempted_ms
 * where the kernel has no schedstat, a regression model's accuracy) is
 * left out, as the log writes it null.
 *
 * Call it on every rank of pg (NULL: one process) with the same options,
 * once they are final and before ddp_trainer_create: every rank gets the
 * callbacks, since the trainer reduces callbacks' stop requests over the
 * group and every rank must take part; only pg's rank 0 opens a file
 * (`dir` is created if missing). With no callbacks before, this adds the
 * trainer's one 8-byte allreduce per step on a group of more than one
 * rank (docs/train.md, "Callbacks").
 *
 * The attachment must outlive the trainer's run; ddp_train_tensorboard_close
 * frees it. A write error during the run does not stop training: it is
 * logged once (a warning), nothing more is written, and close returns it.
 * On error nothing is allocated and the options are unchanged. */
ddp_status ddp_train_tensorboard_attach(ddp_train_tensorboard **out,
                                        ddp_train_options *options, const char *dir,
                                        const ddp_process_group *pg);

/* The event file's path on rank 0, NULL on other ranks (and for NULL). */
const char *ddp_train_tensorboard_path(const ddp_train_tensorboard *tb);

/* Closes the file and frees the attachment; returns the first write error
 * of the run (the message names the file), else DDP_OK. NULL is fine. The
 * options it was attached to must not be used for another trainer after:
 * their callbacks point at it. */
ddp_status ddp_train_tensorboard_close(ddp_train_tensorboard *tb);

#ifdef __cplusplus
}
#endif

#endif /* DDP_TRAIN_H */
