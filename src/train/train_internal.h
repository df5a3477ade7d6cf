/* The trainer's parts (src/train/): the strategy table and the trainer they
 * share, the loop's state, the step, checkpoints, the result, evaluation,
 * the JSON-lines log. Internal: never installed. */
#ifndef DDP_SRC_TRAIN_INTERNAL_H
#define DDP_SRC_TRAIN_INTERNAL_H

#include <stdio.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/data.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"
#include "ddp/pipeline.h"
#include "ddp/ps.h"
#include "ddp/tensor.h"
#include "ddp/train.h"
#include "ddp/zero.h"

/* What a strategy's step reports to the loop. */
typedef struct ddp__train_step_out {
  float loss;  /* the batch's mean loss, where this rank computes it */
  /* false: this rank has no loss (a pipeline's stage before the last) and
   * adds nothing to the group's sums */
  bool counts;
  /* t->step_marks hold this step's forward, backward and optimizer (the
   * timeline draws them); false for a replayed CUDA graph */
  bool marked;
  /* Seconds. load_ms holds the loader's part when the step starts; a step
   * that copies the batch to a device adds the copy. */
  ddp_train_phases phases;
} ddp__train_step_out;

/* One way of spreading the model over the ranks (docs/train.md,
 * "Strategies"): a table and a file (strategy_<name>.c), chosen in one place
 * (ddp__train_strategy_choose, strategy.c). The loop around it is the same
 * for all: loading, the loss's reduction, the schedule, evaluation, early
 * stopping, checkpoints, callbacks, the figures. A strategy keeps what it
 * makes behind t->state (its create makes it, its destroy frees it); NULL
 * members are the loop's default. */
typedef struct ddp__train_strategy_ops {
  const char *name; /* "single", "data_parallel", ...: messages, the summary */
  ddp_train_strategy kind;
  /* What the sampler shards the data over, plural, for messages: "ranks"
   * when NULL; shards_long where the message names them first. */
  const char *shards, *shards_long;
  /* Whether the strategy puts the model it steps on options.device itself
   * (the pipeline moves its stage there, not the whole model): the trainer
   * then leaves t->model on the host. */
  bool places_model;
  /* Whether the options fit this strategy and the group (pure). NULL: any. */
  ddp_status (*check)(const ddp_train_options *o, const ddp_process_group *pg);
  /* Before the optimizer (the model on its device, unless places_model):
   * makes t->state, and
   * may point t->step_model at the model the optimizer steps and set how
   * the data is sharded (t->replicas, t->replica). Collective where the
   * strategy says. On error the trainer calls destroy. */
  ddp_status (*create)(ddp_trainer *t);
  /* After the optimizer and the schedule exist (the DDP wrapper hooks the
   * optimizer; the parameter server's first pull). NULL: nothing. */
  ddp_status (*bind)(ddp_trainer *t);
  /* Frees t->state (which may be partly made, or NULL) and sets it NULL. */
  void (*destroy)(ddp_trainer *t);
  /* One optimizer step on batch b (on the host): zero_grad, forward,
   * backward, the update. ddp__train_step_eager for a strategy that gives
   * forward and backward. */
  ddp_status (*step)(ddp_trainer *t, ddp_batch *b, ddp__train_step_out *out);
  /* The parts ddp__train_step_eager calls (and the CUDA graph captures). */
  ddp_status (*forward)(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
  ddp_status (*backward)(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss);
  /* options.clip_grad_norm between backward and the optimizer: the norm of
   * the whole model's reduced gradients into *norm and the gradients the
   * optimizer steps scaled (torch.nn.utils.clip_grad_norm_). Collective
   * where the gradients are sharded. NULL: ddp_model_clip_grad_norm on the
   * trainer's model (its gradients final on this rank). */
  ddp_status (*clip_grad_norm)(ddp_trainer *t, double max_norm, double *norm);
  /* Micro-batches: true for every micro-batch's backward but the last, which
   * alone reduces gradients (PyTorch's no_sync()). NULL: nothing to skip. */
  void (*no_sync)(ddp_trainer *t, bool on);
  /* Moves the communication backward did not hide from *backward_compute
   * to *backward_comm (seconds); NULL: nothing to split. */
  void (*split_backward)(ddp_trainer *t, double *backward_compute, double *backward_comm);
  /* Adds the strategy's own events of step `step` to t->trace (the DDP
   * wrapper's buckets). NULL: none. */
  void (*trace)(ddp_trainer *t, int64_t step);
  /* The evaluation's sums (loss * rows, correct, rows) of this rank's
   * part; NULL: ddp__train_local_sums (the model's forward on each test
   * batch). */
  ddp_status (*local_sums)(ddp_trainer *t, double sums[3]);
  /* Writes the checkpoint of state *ts; NULL: rank 0 writes the trainer's
   * model and optimizer. Every rank then meets at a barrier. */
  ddp_status (*save)(ddp_trainer *t, const ddp_train_state *ts);
  /* Loads options.resume_path and fills *start; NULL: every rank loads the
   * files into the trainer's model, optimizer and schedule. */
  ddp_status (*resume)(ddp_trainer *t, ddp_train_state *start);
  /* State of the strategy's own that lives beside the checkpoint, one file
   * per rank (PowerSGD's error feedback and Q's): save_aside runs on every
   * rank before the checkpoint is written (so the checkpoint, written
   * last, is what makes a save complete), resume_aside on every rank after
   * it is loaded, with the loaded position. NULL: none. */
  ddp_status (*save_aside)(ddp_trainer *t, const ddp_train_state *ts);
  ddp_status (*resume_aside)(ddp_trainer *t, const ddp_train_state *start);
  /* After the last step, before the final save and evaluation (the
   * pipeline gathers the whole model). Collective. NULL: nothing. */
  ddp_status (*finish)(ddp_trainer *t);
  /* The bytes of parameters this rank holds at most, and of the part of
   * its gradient buffer holding reduced gradients (ddp_train_memory);
   * NULL: both the whole flat buffer. */
  void (*memory)(const ddp_trainer *t, int64_t *param_bytes, int64_t *grad_reduced_bytes);
  /* Fills the result's strategy figures (the pipeline's per stage).
   * Collective. NULL: none. */
  ddp_status (*figures)(ddp_trainer *t, ddp_train_result *res);
  /* The gradients this rank's optimizer steps, as a range of the step
   * model's flat gradient buffer (ZeRO: this rank's shard): what the
   * GradScaler unscales and checks. NULL: the whole buffer. */
  void (*grad_range)(const ddp_trainer *t, int64_t *offset, int64_t *numel);
  /* Where this rank stands, for an error of the loop ("the mesh: rank 0
   * is stage 0 of replica 0, ..."), into buf; returns buf. NULL: nothing
   * to add. */
  const char *(*where)(const ddp_trainer *t, char *buf, size_t bytes);
} ddp__train_strategy_ops;

extern const ddp__train_strategy_ops ddp__train_single;
extern const ddp__train_strategy_ops ddp__train_data_parallel;
/* The comm_hook / powersgd_* options against the strategy (pure; in
 * strategy_data_parallel.c, the one strategy that takes them). */
ddp_status ddp__train_check_comm_hook(const ddp_train_options *o, const ddp__train_strategy_ops *ops);
extern const ddp__train_strategy_ops ddp__train_pipeline;
extern const ddp__train_strategy_ops ddp__train_param_server;
extern const ddp__train_strategy_ops ddp__train_zero;

/* The strategy of options o with group pg (strategy.c): the one o->strategy
 * names, or for DDP_TRAIN_AUTO the pipeline with options.pipeline, the
 * parameter server with options.param_server, data parallel with a group,
 * else single. DDP_ERR_INVALID for an unknown value, and for a value that
 * contradicts options.pipeline or options.param_server (naming both). */
ddp_status ddp__train_strategy_choose(const ddp_train_options *o, const ddp_process_group *pg,
                                      const ddp__train_strategy_ops **out);

/* The trainer's state shared with its parts. */
struct ddp_trainer {
  ddp_train_options o;
  ddp_model *model;
  ddp_dataset *train_ds, *test_ds;
  ddp_process_group *pg; /* NULL: one process */
  int rank, size;
  const ddp__train_strategy_ops *strategy;
  void *state; /* the strategy's own (strategy_<name>.c), or NULL */
  /* The model the optimizer steps: t->model, or under a pipeline this
   * rank's stage (owned by the strategy). */
  ddp_model *step_model;
  /* How the sampler shards the data: over `replicas` by `replica` (the
   * group's size and rank, the pipeline mesh's replicas, the parameter
   * server's trainers). */
  int replicas, replica;
  ddp_optimizer *opt;
  ddp_scheduler *sched;
  ddp_sampler *train_sampler, *test_sampler;
  ddp_loader *train_loader, *test_loader;
  ddp_tape *tape;
  FILE *log; /* rank 0's, when options.log_path */
  /* Every rank's, when $DDP_TRAIN_SAMPLE_LOG names a folder: the samples
   * each step took (ddp__train_log_samples). */
  FILE *sample_log;
  bool ran;
  /* On a GPU (o.device): the batch's home there, grown to the largest
   * batch seen, and the pinned staging its copies go through
   * (device_batch.c). */
  ddp_tensor *device_x, *device_y;
  ddp_device_stage *stage;
  /* o.cuda_graph: the captured step and what it keeps (graph_step.c), a
   * variant of ddp__train_step_eager. */
  struct ddp__train_graph *graph;
  /* o.trace_path: the run's timeline (trace.c), made when the run starts
   * and written when it returns; NULL when not tracing. */
  struct ddp__trace *trace;
  /* The last step's clock readings (ddp_time_ns): forward start, forward
   * end (loss read), backward end, optimizer end. */
  int64_t step_marks[4];
  /* Gradient scaling (grad_scaling.c; options.grad_scaler): the scaler,
   * this run's skipped steps, whether the last step was skipped, and the
   * step the loop runs now (1-based, for the test hook that injects an
   * inf: DDP_TEST_INJECT_INF, docs/mixed-precision.md). */
  ddp_grad_scaler scaler;
  int64_t skipped_steps;
  bool last_skipped;
  int64_t step_now;
  int64_t inject_inf_step; /* 0: none */
  int inject_inf_rank;     /* -1: every rank */
};

/* Steps left out of the steady figures, as PyTorch's reference script
 * leaves out its 10 warm-up steps (first touch of the activations, the
 * wrapper's one-time bucket relayout). */
#define DDP__TRAIN_WARMUP_STEPS 10

/* Early stopping: patience evaluations in a row without a better test loss. */
typedef struct ddp__train_patience {
  int64_t limit; /* 0 = never stop */
  int64_t without_better;
  double best_loss;
} ddp__train_patience;

/* Everything the loop (loop.c) keeps between steps. Phases are in seconds
 * while they accumulate and become milliseconds only in what callers see. */
typedef struct ddp__train_run {
  ddp_train_state start;
  int64_t per_epoch, total_steps;
  int64_t step, samples, epochs_done;
  /* The position a checkpoint records: the epoch in progress and the
   * batches of it consumed; (next epoch, 0) once an epoch's end is
   * processed. */
  int64_t pos_epoch, pos_batches;
  /* The same position in samples of the epoch's order (every world the
   * epoch ran at: docs/train.md, "Elastic training"). */
  int64_t pos_samples;
  double train_seconds;
  /* The same rate without this process's first DDP__TRAIN_WARMUP_STEPS steps. */
  double steady_seconds;
  int64_t steady_samples, steps_here;
  ddp_train_phases steady; /* seconds, summed */
  ddp_preempt_clock preempt_clock;
  double epoch_loss_sum, all_loss_sum;
  int64_t epoch_steps;  /* batches of this epoch consumed (also before a resume) */
  int64_t epoch_pos;    /* positions of this epoch's order consumed (also before a resume) */
  int64_t epoch_losses; /* of those, steps run by this process */
  ddp__train_patience pat;
  double last_loss, last_accuracy;
  bool evaluated_now, stop;
  ddp_train_stop stopped;
} ddp__train_run;

/* ---- Checkpoints (checkpoint.c) ---- */

/* Writes the checkpoint of position (step, epoch, epoch_batches) and
 * early stopping's *pat through the strategy; every rank waits at a
 * barrier until it is on disk. Collective. */
ddp_status ddp__train_save(ddp_trainer *t, int64_t step, int64_t epoch, int64_t epoch_batches,
                           int64_t epoch_samples, const ddp__train_patience *pat);
/* A sharded checkpoint of state *ts in options.save_path (a directory):
 * rank r writes floats [starts[r], starts[r + 1]) of the parameters and of
 * `opt`'s state (opt over that range, or over the whole buffers), then,
 * once every rank has, rank 0 the metadata. Collective; every rank returns
 * the same status. */
ddp_status ddp__train_save_sharded(ddp_trainer *t, const ddp_train_state *ts, ddp_optimizer *opt,
                                   const int64_t *starts);
/* Where training starts: the beginning, or options.resume_path loaded
 * through the strategy (refused when saved mid-epoch by another number of
 * shards by a version that did not record the epoch's position in samples). */
ddp_status ddp__train_resume(ddp_trainer *t, ddp_train_state *start);
/* Whether the resumed epoch starts from start->epoch_samples through the
 * sampler (another world, or an epoch that changed worlds before) instead
 * of replaying start->epoch_batches batches. */
bool ddp__train_resume_by_samples(const ddp_trainer *t, const ddp_train_state *start);

/* ---- Gradient scaling and the optimizer step (grad_scaling.c) ---- */

/* Checks options.precision and options.grad_scaler against the strategy
 * and the device (pure). */
ddp_status ddp__train_precision_check(const ddp_train_options *o);
/* The autocast region of options.precision (bf16, fp16; include/ddp/
 * tensor.h "Autocast") around a step's forward and loss, and around
 * evaluation's, on the calling thread; nothing at fp32. Enter fails only
 * on a programming error (regions nested too deep). */
ddp_status ddp__train_autocast_enter(const ddp_trainer *t);
void ddp__train_autocast_exit(const ddp_trainer *t);
/* --precision tf32: allows TF32 in the GPUs' float32 matmuls and
 * convolutions (ddp_cuda_allow_tf32, process-wide); nothing otherwise. */
ddp_status ddp__train_tf32_apply(const ddp_trainer *t);
/* Makes t->scaler from the options and reads the test hook. */
ddp_status ddp__train_scaler_init(ddp_trainer *t);
/* The seed of this step's backward: the scale with a scaler, else 1. */
float ddp__train_loss_seed(const ddp_trainer *t);
/* The optimizer step of every strategy, once the step's gradients are
 * final (reduced, accumulated, scaled by 1/M): with a scaler, unscales this
 * rank's gradients and agrees on inf/NaN over the group (one allreduce
 * MAX); then, unless an inf/NaN was found anywhere, gradient clipping
 * (ddp__train_clip) on the unscaled gradients and the optimizer's step;
 * then the scaler's update. Collective with a scaler and a group. No allocation. */
ddp_status ddp__train_optimizer_step(ddp_trainer *t);

/* ---- The result (result.c) ---- */

/* count / seconds, 0 without time. */
double ddp__train_per_second(int64_t count, double seconds);
/* The figures of the result, after the loop. Collective: gathers every
 * rank's preempted time, and the strategy's figures. */
ddp_status ddp__train_fill_result(ddp_trainer *t, const ddp__train_run *r, ddp_train_result *res);

/* ---- The step (step.c) ---- */

/* The step of a strategy that gives forward and backward (single, data
 * parallel): the batch through the CUDA graph when it takes it (o.cuda_graph,
 * a full batch), else copied to the device and ddp__train_eager_step on the
 * trainer's tape, in micro-batches with o.microbatches > 1. */
ddp_status ddp__train_step_eager(ddp_trainer *t, ddp_batch *b, ddp__train_step_out *out);

/* One eager step on `tape` from the batch (x, y) already on the device:
 * zero_grad, forward, loss (read back: *loss), backward, optimizer. Fills
 * the forward, backward and optimizer phases of *p, in seconds. */
/* options.clip_grad_norm (> 0) applied through the strategy; nothing when
 * 0. A non-finite norm fails the step (gradients unchanged). */
ddp_status ddp__train_clip(ddp_trainer *t);

ddp_status ddp__train_eager_step(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                                 float *loss, ddp_train_phases *p);

/* ---- CUDA graphs (graph_step.c; ddp_train_options.cuda_graph) ---- */

/* Whether the step can be captured and replayed correctly with these
 * options, model and group: DDP_OK, or DDP_ERR_UNSUPPORTED saying why (the
 * CPU, SyncBatchNorm (its collectives wait on the host), dropout with
 * p > 0 (masks drawn on the host each step), data parallelism (hooks on
 * the host during backward)). Pure: no device is touched, so the CPU
 * tests it. */
ddp_status ddp__train_graph_check(const ddp_train_options *o, const ddp_model *model,
                                  const ddp_process_group *pg);
/* Makes t->graph for a run with o.cuda_graph (nothing on the device yet). */
ddp_status ddp__train_graph_create(ddp_trainer *t);
void ddp__train_graph_destroy(ddp_trainer *t);
/* The tape the graph's steps record on (memory figures); NULL without one. */
ddp_tape *ddp__train_graph_tape(const ddp_trainer *t);
/* Whether the batch goes through the graph: a full batch (o.batch_size)
 * with o.cuda_graph. */
bool ddp__train_graph_takes(const ddp_trainer *t, const ddp_batch *b);
/* The step of a full batch: its first few eagerly on the graph's own tape
 * and input buffers (warm-up), then one capture, then a replay each, the
 * optimizer queued after it and the loss read from pinned memory once the
 * device is done. *loss and the phases as ddp__train_eager_step (a
 * replayed step's forward phase holds the whole device step). */
ddp_status ddp__train_graph_step(ddp_trainer *t, ddp_batch *b, float *loss, ddp_train_phases *p);

/* The batch b on the trainer's device: *x and *y are b's tensors on the
 * CPU, else views of the trainer's device buffers holding a copy. */
ddp_status ddp__train_batch_on_device(ddp_trainer *t, ddp_batch *b, ddp_tensor *x, ddp_tensor *y);
/* Queues the copy of b's data into x's and y's device memory (their shapes
 * b's) through the trainer's staging; returns at once. */
ddp_status ddp__train_batch_to(ddp_trainer *t, ddp_batch *b, ddp_tensor *x, ddp_tensor *y);
/* The value of a one-element float32 tensor on any device (a GPU's:
 * copied, which waits for the step to get there). */
ddp_status ddp__train_scalar(const ddp_tensor *t, float *value);
/* A copy of a float32 tensor's data on the host: t's own data on the CPU,
 * else `host` (t->numel floats) filled from the device. */
ddp_status ddp__train_host_view(const ddp_tensor *t, float *host, const float **data);
/* How many of n rows of logits (n, classes) have their first maximum at
 * the row's label (labels: n). The accuracy count of every evaluation. */
int64_t ddp__train_count_correct(const float *logits, const int64_t *labels, int64_t n, int64_t classes);
void ddp__train_device_free(ddp_trainer *t);

/* The test loader's batch: eval_batch_size, or max(batch_size, 1000). */
int64_t ddp__train_eval_batch_size(const ddp_train_options *o);

/* Sums values[0..n) over the group in place (float64); nothing without one.
 * Collective. */
ddp_status ddp__train_sum(ddp_trainer *t, double *values, int n);

/* What one test batch adds to this rank's sums: *loss_rows (its mean loss
 * times its rows) and *correct (with classify), or *counted false when
 * this rank counts nothing for it (a pipeline's earlier stages). */
typedef ddp_status (*ddp__train_eval_batch_fn)(ddp_trainer *t, ddp_batch *b, void *ctx,
                                               bool classify, double *loss_rows,
                                               int64_t *correct, bool *counted);
/* The sums (loss * rows, correct, rows) of one pass over this rank's part
 * of the test set, batch by batch through `batch` (the one loop over the
 * test loader that every strategy's evaluation uses). */
ddp_status ddp__train_eval_sums(ddp_trainer *t, ddp__train_eval_batch_fn batch, void *ctx,
                                double sums[3]);
/* ddp__train_eval_sums with the model's forward and loss on each batch. */
ddp_status ddp__train_local_sums(ddp_trainer *t, double sums[3]);

/* Evaluates on the test set (every rank its part, no padding) and reduces
 * the sums once, so every rank gets the same figures. Collective. */
ddp_status ddp__train_evaluate(ddp_trainer *t, double *loss, double *accuracy);

/* JSON lines (train_log.c): a step's record and an evaluation's. */
void ddp__train_log_step(FILE *log, const ddp_train_step_info *s);
void ddp__train_log_eval(FILE *log, int64_t step, int64_t epoch, double loss, double accuracy);
/* Opens this rank's sample log, DIR/samples.<pid>.jsonl, when
 * $DDP_TRAIN_SAMPLE_LOG=DIR (a debugging aid; off, nothing is written). */
ddp_status ddp__train_open_sample_log(ddp_trainer *t);
/* One line for the step just taken: which dataset indices this rank's
 * batch held, and where they sit in the epoch's global order (sample i at
 * position first + i * replicas). */
void ddp__train_log_samples(ddp_trainer *t, int64_t step, int64_t epoch, int64_t start_step,
                            int64_t first_position, const ddp_batch *b);
/* `"key": value` with JSON's null for NaN and infinities, ", " after it when comma. */
void ddp__train_json_number(FILE *f, const char *key, double v, bool comma);

#endif
