/* ddp pipeline: model parallelism by pipeline stages across ranks (PyTorch's
 * torch.distributed.pipelining). A model is split at module boundaries into
 * stages; each rank of a pipeline group holds its stages' parameters only,
 * a step splits the batch into M micro-batches that flow through the stages
 * (activations forward, gradients backward, point to point) in the order a
 * schedule gives, and gradients accumulate on every stage. docs/pipeline.md
 * has the rules.
 *
 * The model of use (every rank of the pipeline group `pg`):
 *
 *   ddp_model *full;
 *   DDP_TRY(ddp_model_build("convnet", NULL, 42, &full));  // same seed on every rank
 *   ddp_pipeline_options o = ddp_pipeline_defaults();
 *   o.schedule = DDP_PIPELINE_1F1B;
 *   o.n_microbatches = 4;
 *   o.split = "layer2";                          // stage 1 starts at layer2
 *   ddp_pipeline *pp;
 *   DDP_TRY(ddp_pipeline_create(&pp, full, pg, &o)); // collective; copies its part
 *   ddp_model_destroy(full);                     // the stage keeps its own copy
 *   ddp_model *stage = ddp_pipeline_model(pp);   // this rank's modules, unsplit names
 *   ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(stage),
 *                        ddp_model_grads_flat(stage), ddp_model_num_param_elements(stage));
 *   for (each batch) {
 *     ddp_model_zero_grad(stage);
 *     double loss;
 *     DDP_TRY(ddp_pipeline_step(pp, first ? x : NULL, last ? y : NULL, &loss));
 *     DDP_TRY(ddp_optimizer_step(opt));
 *   }
 *   ddp_pipeline_destroy(pp);
 *
 * Every rank of the group makes the same sequence of ddp_pipeline_* calls
 * that are marked collective. A pipeline is used by one thread at a time.
 *
 * Pipeline x data parallel: the executor talks only to its pipeline group
 * (and subgroups of it that it creates). Averaging a stage's gradients over
 * its data-parallel group is the caller's, once per step after the last
 * backward: ddp_pipeline_set_grad_sync installs a function the step calls
 * then, and ddp_pipeline_allreduce_grads is one such. */
#ifndef DDP_PIPELINE_H
#define DDP_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/nn.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bounds of the fixed-size arrays below. */
#define DDP_PIPELINE_MAX_STAGES 64  /* ranks x virtual stages */
#define DDP_PIPELINE_MAX_VIRTUAL 16 /* virtual stages (chunks) per rank */

/* ---- Schedules -------------------------------------------------------------
 * A schedule is data: for each rank of the pipeline, the list of actions it
 * runs in order. Stages are numbered globally, 0 .. n_ranks * v - 1; stage g
 * lives on rank g % n_ranks as that rank's chunk g / n_ranks (looped
 * placement: rank r holds stages r, r + p, r + 2p, ...). */
typedef enum ddp_pipeline_schedule_kind {
  DDP_PIPELINE_GPIPE = 0,       /* all forwards, then all backwards; M live per stage */
  DDP_PIPELINE_1F1B = 1,        /* PyTorch's Schedule1F1B: stage s holds <= p - s; M >= p */
  DDP_PIPELINE_INTERLEAVED = 2, /* Megatron's interleaved 1F1B: v >= 2, M a multiple of p */
  DDP_PIPELINE_FORWARD_ONLY = 3, /* evaluation: every forward, no backward */
  DDP_PIPELINE_CUSTOM = 4,      /* from ddp_pipeline_schedule_from_lists */
  DDP_PIPELINE_SCHEDULE_KIND_COUNT
} ddp_pipeline_schedule_kind;

/* "gpipe", "1f1b", "interleaved", "forward", "custom". */
const char *ddp_pipeline_schedule_name(ddp_pipeline_schedule_kind kind);
/* Parses those names (ddp-train's --schedule); DDP_ERR_INVALID listing them. */
ddp_status ddp_pipeline_schedule_parse(const char *name, ddp_pipeline_schedule_kind *out);

typedef enum ddp_pipeline_action_kind {
  DDP_PIPELINE_FORWARD = 0,   /* forward of (stage, microbatch); the last stage adds the loss */
  DDP_PIPELINE_BACKWARD = 1,  /* backward of (stage, microbatch) */
  /* Communication actions only post the transfer (it runs in the
   * background); the compute that needs a received buffer waits for it. */
  DDP_PIPELINE_SEND_ACT = 2,  /* stage's output of microbatch -> rank `peer` (stage + 1) */
  DDP_PIPELINE_RECV_ACT = 3,  /* stage's input of microbatch <- rank `peer` (stage - 1) */
  DDP_PIPELINE_SEND_GRAD = 4, /* d(input) of stage's microbatch -> rank `peer` (stage - 1) */
  DDP_PIPELINE_RECV_GRAD = 5, /* d(output) of stage's microbatch <- rank `peer` (stage + 1) */
  DDP_PIPELINE_ACTION_KIND_COUNT
} ddp_pipeline_action_kind;

/* One action. `stage` is always the stage of the rank that runs it (a
 * RECV_ACT names the stage that will consume the activation, a SEND_GRAD the
 * stage whose input gradient goes out); `peer` is the other rank of a
 * communication, -1 for compute. */
typedef struct ddp_pipeline_action {
  ddp_pipeline_action_kind kind;
  int32_t stage;
  int32_t microbatch;
  int32_t peer;
} ddp_pipeline_action;

typedef struct ddp_pipeline_schedule ddp_pipeline_schedule; /* opaque */

/* Builds the action lists of a built-in schedule for `n_ranks` ranks, M =
 * n_microbatches and v = virtual_stages (1 except for INTERLEAVED). Refuses
 * (DDP_ERR_INVALID saying which rule) 1F1B with M < p, INTERLEAVED with v < 2
 * or M not a multiple of p, more than DDP_PIPELINE_MAX_STAGES stages. Pure:
 * no communication. Free with ddp_pipeline_schedule_destroy. */
ddp_status ddp_pipeline_schedule_create(ddp_pipeline_schedule **out,
                                        ddp_pipeline_schedule_kind kind, int n_ranks,
                                        int n_microbatches, int virtual_stages);
/* A schedule from caller-given lists (copied): lists[r] holds counts[r]
 * actions of rank r. Not checked here: call ddp_pipeline_schedule_check. */
ddp_status ddp_pipeline_schedule_from_lists(ddp_pipeline_schedule **out, int n_ranks,
                                            int n_microbatches, int virtual_stages,
                                            const ddp_pipeline_action *const *lists,
                                            const int *counts);
void ddp_pipeline_schedule_destroy(ddp_pipeline_schedule *sched); /* NULL ok */

ddp_pipeline_schedule_kind ddp_pipeline_schedule_kind_of(const ddp_pipeline_schedule *sched);
int ddp_pipeline_schedule_num_ranks(const ddp_pipeline_schedule *sched);
int ddp_pipeline_schedule_num_microbatches(const ddp_pipeline_schedule *sched);
int ddp_pipeline_schedule_virtual_stages(const ddp_pipeline_schedule *sched);
/* Rank r's list (owned by the schedule) and its length; NULL / 0 out of range. */
const ddp_pipeline_action *ddp_pipeline_schedule_actions(const ddp_pipeline_schedule *sched,
                                                         int rank, int *count);

/* What the checker proved. */
typedef struct ddp_pipeline_schedule_report {
  int n_stages;
  /* Micro-batches whose forward ran and whose backward has not, at most at
   * once (the activations the stage holds), per stage; 0 for forward-only. */
  int live_high_water[DDP_PIPELINE_MAX_STAGES];
  /* The bound the kind promises per stage: M for GPipe, min(M, p - s) for
   * 1F1B; -1 where the kind promises a bound per rank only (interleaved,
   * custom). */
  int live_promised[DDP_PIPELINE_MAX_STAGES];
  /* The same per rank (all its stages together): GPipe v * M, 1F1B
   * min(M, p - r), interleaved min(v * M, 2 (p - r - 1) + (v - 1) p + 1)
   * (Megatron's warmup plus one); -1 for custom. */
  int rank_live_high_water[DDP_PIPELINE_MAX_STAGES];
  int rank_live_promised[DDP_PIPELINE_MAX_STAGES];
  /* Simulated rounds (each rank runs at most one forward or backward per
   * round, a transfer takes effect the round after its producer ran) until
   * every rank finished: the critical path in units of one compute. */
  int makespan;
  uint64_t reserved[4];
} ddp_pipeline_schedule_report;
DDP_STRUCT_SIZE(ddp_pipeline_schedule_report, 1064);

/* Simulates every rank's list together and proves, before anything runs:
 * every (stage, micro-batch) is forwarded exactly once on the rank that owns
 * the stage (and, unless forward-only, backwarded exactly once, after its
 * forward and after the next stage's backward); each compute has its input
 * (a received activation or gradient posted before it, or stage 0's batch /
 * the last stage's loss); every send has exactly one matching receive with
 * the same (stage, micro-batch) at the right peer, in the same order per
 * (sender, receiver, kind) channel; the lists cannot deadlock (posting is
 * non-blocking, a compute waits only for its inputs); the live
 * micro-batches per stage stay within the kind's promise. On failure returns
 * DDP_ERR_INVALID with a message naming the rank, the action's index and
 * what is wrong. report may be NULL. */
ddp_status ddp_pipeline_schedule_check(const ddp_pipeline_schedule *sched,
                                       ddp_pipeline_schedule_report *report);

/* Writes rank `rank`'s list (all ranks, one line each, for -1) into buf
 * (truncated, always NUL-terminated) and returns the length needed. Tokens:
 * F<s>.<m> / B<s>.<m> (forward / backward of stage s, micro-batch m),
 * sa<s>.<m>><r> / ra<s>.<m><<r> (send activation to rank r / receive from
 * r), sg / rg likewise for gradients:
 *   "rank 0: F0.0 sa0.0>1 F0.1 sa0.1>1 rg0.0<1 B0.0 ..." */
size_t ddp_pipeline_schedule_print(const ddp_pipeline_schedule *sched, int rank, char *buf,
                                   size_t bytes);

/* ---- Stages and the executor ---------------------------------------------- */

typedef struct ddp_pipeline ddp_pipeline; /* opaque */

/* Start from ddp_pipeline_defaults(). */
typedef struct ddp_pipeline_options {
  ddp_pipeline_schedule_kind schedule; /* GPIPE, 1F1B or INTERLEAVED (1F1B) */
  int n_microbatches;                  /* M >= 1 (4) */
  int virtual_stages;                  /* v: stages per rank (1; INTERLEAVED: >= 2) */
  /* Where stages begin, by the names of the model's top-level modules (its
   * root's children, in forward order): "layer2" (stage 1 begins there),
   * "a,b,c" (stages 1, 2, 3 begin at a, b and c; p * v - 1 names), or
   * "auto"/NULL: rank 0 measures each top-level module's forward + backward
   * time on a micro-batch and picks the contiguous split that minimises the
   * most expensive stage, then broadcasts it, so every rank agrees. */
  const char *split;
  /* Gradients are the sum of every micro-batch's loss gradient times
   * grad_scale; 0 means 1 / M (a mean loss: PyTorch's scaling). */
  double grad_scale;
  /* Shape of one sample of stage 0's input ((1, 28, 28)); ndim 0 takes the
   * model's ddp_model_sample_shape. Used at setup to compute and exchange the
   * shapes between stages. */
  int sample_ndim;
  int64_t sample_shape[DDP_MAX_DIMS];
  /* Micro-batch rows the auto split profiles with (32). */
  int64_t profile_rows;
  /* Largest batch a step or evaluation takes (rows); buffers are sized for
   * ceil(max_batch / M) rows per micro-batch at setup (256). */
  int64_t max_batch;
  /* Longest wait for one transfer, seconds; <= 0: the group's timeout. */
  double timeout_s;
  /* Where this rank's stages compute (DDP_CPU, the default, or cuda:N):
   * setup runs on the host (split, copy, shapes), then the stage's model
   * moves there (ddp_model_to) and the activation and gradient buffers are
   * allocated there, so point-to-point sends and receives carry device
   * memory (NCCL's send/recv on an nccl group, pinned host staging on
   * ddp's own: docs/pipeline.md, "Stages on GPUs"). A step's and an
   * evaluation's input and target must then be on that device; an
   * evaluation's output tensor stays host memory. */
  ddp_device device;
  uint64_t reserved[7];
} ddp_pipeline_options;
DDP_STRUCT_SIZE(ddp_pipeline_options, 176);

/* 1F1B, M = 4, v = 1, split "auto", grad_scale 0 (1/M), profile_rows 32,
 * max_batch 256, sample shape from the model, the group's timeout, the
 * CPU. */
ddp_pipeline_options ddp_pipeline_defaults(void);

/* Builds this rank's part of a pipeline over `pg` (p = its size ranks;
 * collective: every rank calls it with an equal `model` (same modules and
 * parameter values: build it from the same seed) and the same options).
 * Decides the split (rank 0's, broadcast), copies this rank's stages' modules
 * with their parameters, buffers and PyTorch names into a model of its own
 * (its own flat buffers: ddp_pipeline_model), computes each stage's input
 * and output shapes from the sample shape and exchanges them once, checks
 * that they fit, creates the point-to-point channels and allocates every
 * buffer the steps need. A split name that is not a top-level module, too
 * few or too many stages, or a stage whose input shape does not fit its
 * first module fails on every rank with the same message naming the module
 * and the shapes (DDP_ERR_INVALID / DDP_ERR_SHAPE). `model` is only read
 * (it may be destroyed after); `pg` is borrowed and must outlive the
 * pipeline. *out NULL on failure. */
ddp_status ddp_pipeline_create(ddp_pipeline **out, ddp_model *model, ddp_process_group *pg,
                               const ddp_pipeline_options *options);
/* Frees the pipeline, its model, channels and buffers. Not collective.
 * NULL ok. */
void ddp_pipeline_destroy(ddp_pipeline *pp);

/* One training step (collective over the pipeline group): `input` (N, ...)
 * on the rank holding stage 0, `target` (N) int64 or (N, ...) float32 per
 * the model's loss on the rank holding the last stage; NULL elsewhere (and
 * ignored). N may differ between steps (<= max_batch); both are split along
 * dim 0 into M micro-batches as torch.tensor_split does (the first N % M
 * get one row more). The last stage computes the model's loss per
 * micro-batch; backward scales it by grad_scale, so the stage's gradients
 * (ddp_pipeline_model's flat buffer) accumulate sum_m grad(loss_m) *
 * grad_scale. Gradients are not zeroed here (zero them as with
 * optimizer.zero_grad). An input with DDP_TENSOR_REQUIRES_GRAD and a grad
 * buffer (float32, as its data) gets its gradient too, added into
 * input->grad (as PyTorch's first stage does for an input that requires
 * grad: layers before the pipeline). *loss (may be NULL): the mean of the micro-batch
 * losses on the last stage's rank, NaN elsewhere. An input stage 0 refuses
 * (not the sample shape, fewer rows than M, more than max_batch) is
 * DDP_ERR_SHAPE on every rank before anything moves, and the pipeline stays
 * usable. On any other failure (a peer died, a timeout, a forward's or the
 * loss's error, a target without the input's rows) every stage's channels
 * are aborted so the others fail too, and each returns an error naming the
 * stage and rank that failed first; the pipeline is then unusable (destroy
 * it). */
ddp_status ddp_pipeline_step(ddp_pipeline *pp, const ddp_tensor *input,
                             const ddp_tensor *target, double *loss);

/* Evaluation, forward only (collective): the model in evaluation mode for
 * the call (BatchNorm's running stats, no dropout), no gradients. On the
 * last stage's rank, `output` (may be NULL) receives the model's output for
 * the whole batch (N, ...) (caller-allocated, float32, the shape
 * ddp_pipeline_output_shape gives for N rows) and, when `target` is given,
 * *loss the mean of the micro-batch losses weighted by their rows (the
 * batch's mean loss). Arguments as for ddp_pipeline_step. */
ddp_status ddp_pipeline_eval(ddp_pipeline *pp, const ddp_tensor *input,
                             const ddp_tensor *target, ddp_tensor *output, double *loss);

/* This rank's model: the modules of its stages (all its chunks), with the
 * unsplit model's names, in the unsplit model's registration order. Its flat
 * parameter and gradient buffers are what an optimizer steps and what a
 * data-parallel group averages; its state dict is this rank's slice of the
 * unsplit model's (checkpoints). Owned by the pipeline. */
ddp_model *ddp_pipeline_model(ddp_pipeline *pp);
/* This rank's rank in the pipeline group, p, v, the total number of stages
 * and M. */
int ddp_pipeline_rank(const ddp_pipeline *pp);
int ddp_pipeline_num_ranks(const ddp_pipeline *pp);
int ddp_pipeline_virtual_stages(const ddp_pipeline *pp);
int ddp_pipeline_num_stages(const ddp_pipeline *pp);
int ddp_pipeline_num_microbatches(const ddp_pipeline *pp);
bool ddp_pipeline_is_first(const ddp_pipeline *pp); /* holds stage 0 */
bool ddp_pipeline_is_last(const ddp_pipeline *pp);  /* holds the last stage */
/* The global stage index of this rank's chunk c (c in [0, v)); -1 outside. */
int ddp_pipeline_stage_index(const ddp_pipeline *pp, int chunk);
/* Stage `stage`'s top-level module names (known for every stage on every
 * rank: the split is agreed), first and last by index into the unsplit
 * model's root children in forward order: *first..*last inclusive.
 * Returns the number of modules, 0 out of range. names[k] for k in that
 * range via ddp_pipeline_module_name. */
int ddp_pipeline_stage_modules(const ddp_pipeline *pp, int stage, int *first, int *last);
const char *ddp_pipeline_module_name(const ddp_pipeline *pp, int index);
/* The split as it would be written to options.split ("layer2"; what "auto"
 * chose): static storage of the pipeline. */
const char *ddp_pipeline_split(const ddp_pipeline *pp);
/* Stage 0's input sample shape and the last stage's output sample shape
 * (per row); return ndim. */
int ddp_pipeline_input_shape(const ddp_pipeline *pp, int64_t shape[DDP_MAX_DIMS]);
int ddp_pipeline_output_shape(const ddp_pipeline *pp, int64_t shape[DDP_MAX_DIMS]);

/* The step's gradient synchronisation over data-parallel replicas: `fn` is
 * called once per ddp_pipeline_step on this rank, after its last backward
 * (every micro-batch's gradient has accumulated) and before the step
 * returns, with this rank's model; an error fails the step. NULL removes
 * it. Every replica of a stage must install the same one. */
typedef ddp_status (*ddp_pipeline_grad_sync_fn)(void *user, ddp_model *stage_model);
void ddp_pipeline_set_grad_sync(ddp_pipeline *pp, ddp_pipeline_grad_sync_fn fn, void *user);
/* GradScaler's scale(loss) (include/ddp/optim.h, "Gradient scaling"): the
 * last stage's backward seeds each micro-batch's loss gradient with
 * grad_scale times this (1 by default), so every stage's gradients come
 * out scaled by it. Set it on every rank before each step; finite and > 0
 * (asserted). */
void ddp_pipeline_set_loss_scale(ddp_pipeline *pp, float loss_scale);
/* Averages this rank's flat gradients over `dp_group` (one allreduce AVG);
 * a ddp_pipeline_grad_sync_fn when user is the group:
 *   ddp_pipeline_set_grad_sync(pp, ddp_pipeline_allreduce_grads, dp_group). */
ddp_status ddp_pipeline_allreduce_grads(void *dp_group, ddp_model *stage_model);

/* What this rank measured. */
typedef struct ddp_pipeline_stats {
  int64_t steps;              /* training steps since create or the last reset */
  double step_s;              /* the last step's wall time */
  double wait_s;              /* ... of which waiting for transfers (receives, sends) */
  double idle_fraction;       /* wait_s / step_s of the last step */
  double idle_fraction_mean;  /* sum of wait / sum of step time over `steps` */
  /* Activations held at once: the most bytes the in-flight micro-batches'
   * tapes (their arenas) held together, measured after each forward and
   * before each backward; and the largest one micro-batch's forward alone
   * took, so high_water / one is the micro-batches held at once. */
  int64_t activation_bytes_high_water;
  int64_t microbatch_activation_bytes;
  int live_high_water;        /* in-flight micro-batches at once (all chunks) */
  uint64_t reserved[8];
} ddp_pipeline_stats;
DDP_STRUCT_SIZE(ddp_pipeline_stats, 128);

void ddp_pipeline_get_stats(const ddp_pipeline *pp, ddp_pipeline_stats *out);
void ddp_pipeline_reset_stats(ddp_pipeline *pp);

/* The executor's schedule for training steps (owned by the pipeline). */
const ddp_pipeline_schedule *ddp_pipeline_get_schedule(const ddp_pipeline *pp);

#ifdef __cplusplus
}
#endif
#endif /* DDP_PIPELINE_H */
