/* The trainer's parts (src/train/): the strategy table, evaluation, the
 * JSON-lines log. Internal: never installed. */
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

/* How a step's forward and backward go for one way of spreading the model
 * (docs/train.md, "Strategies"). The loop around them is the same for all:
 * loading, the loss, the optimizer, the loss's reduction, evaluation,
 * checkpoints and callbacks. A strategy that needs a step-long object
 * (the data-parallel wrapper) keeps it in the trainer (ddp__trainer_dp). */
typedef struct ddp__train_strategy {
  const char *name;
  /* Sets up what the strategy needs (collective where it says so). */
  ddp_status (*create)(ddp_trainer *t);
  ddp_status (*forward)(ddp_trainer *t, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
  ddp_status (*backward)(ddp_trainer *t, ddp_tape *tape, ddp_tensor *loss);
  /* Moves the communication backward did not hide from *backward_compute
   * to *backward_comm (seconds); NULL: nothing to split. */
  void (*split_backward)(ddp_trainer *t, double *backward_compute, double *backward_comm);
  void (*destroy)(ddp_trainer *t);
  /* A strategy that runs the whole step itself (the pipeline: forwards
   * and backwards interleaved over micro-batches) instead of forward and
   * backward: zero_grad, the step, the optimizer; *loss the batch's mean
   * loss where this rank computes it. NULL: the eager step. */
  ddp_status (*step)(ddp_trainer *t, ddp_batch *b, double *loss, ddp_train_phases *p);
  /* The evaluation's sums (loss * rows, correct, rows) of this rank's
   * part; NULL: the model's forward on each test batch. */
  ddp_status (*local_sums)(ddp_trainer *t, double sums[3]);
  /* Writes the checkpoint of state *ts (the parameter server: the servers
   * write it; the pipeline: gathered from the stages); NULL: rank 0 writes
   * the trainer's model and optimizer. */
  ddp_status (*save)(ddp_trainer *t, const ddp_train_state *ts);
} ddp__train_strategy;

extern const ddp__train_strategy ddp__train_single;
extern const ddp__train_strategy ddp__train_data_parallel;
extern const ddp__train_strategy ddp__train_pipeline;
extern const ddp__train_strategy ddp__train_param_server;

/* ---- The parameter server (strategy_ps.c; options.param_server) ---- */

/* Whether options.param_server fits the group (none) and the other options. */
ddp_status ddp__train_ps_check(const ddp_train_options *o, const ddp_process_group *pg);
/* Picks the strategy and shards the data over the trainers. */
void ddp__train_ps_place(ddp_trainer *t);

/* ---- The pipeline (strategy_pipeline.c; options.pipeline) ---- */

/* Whether options.pipeline fits the group and the other options. */
ddp_status ddp__train_pipeline_check(const ddp_train_options *o, const ddp_process_group *pg);
/* Before the optimizer: splits the group into the mesh's pipeline and
 * data-parallel groups, builds this rank's stage from t->model and points
 * t->step_model at it. Collective over the group. */
ddp_status ddp__train_pipeline_prepare(ddp_trainer *t);
/* Copies every stage's parameters and buffers into t->model on every rank
 * (the whole trained model, with its own names). Collective. */
ddp_status ddp__train_pipeline_gather(ddp_trainer *t);
/* Gathers model and optimizer state and has rank 0 write the whole
 * model's checkpoint. Collective. */
ddp_status ddp__train_pipeline_save(ddp_trainer *t, const ddp_train_state *ts);
/* Loads options.resume_path into the full model and takes this stage's part. */
ddp_status ddp__train_pipeline_resume(ddp_trainer *t, ddp_train_state *start);
/* The result's per-stage figures. Collective. */
ddp_status ddp__train_pipeline_stats(ddp_trainer *t, ddp_train_result *res);
/* "the mesh: rank 0 is stage 0 of replica 0, ..." into buf (for errors:
 * a peer named by its rank is also named by its stage); returns buf. */
const char *ddp__train_pipeline_mesh(const ddp_trainer *t, char *buf, size_t bytes);

/* The trainer's state shared with its parts. */
struct ddp_trainer {
  ddp_train_options o;
  ddp_model *model;
  ddp_dataset *train_ds, *test_ds;
  ddp_process_group *pg; /* NULL: one process */
  int rank, size;
  const ddp__train_strategy *strategy;
  ddp_dp *dp; /* the data-parallel strategy's wrapper */
  /* The model the optimizer steps: t->model, or under a pipeline this
   * rank's stage (owned by the pipeline). */
  ddp_model *step_model;
  /* How the sampler shards the data: over `replicas` by `replica` (the
   * group's size and rank, or the pipeline mesh's replicas). */
  int replicas, replica;
  /* The pipeline strategy (strategy_pipeline.c): this rank's stage index in its
   * pipeline, the pipeline, its group and the stage's data-parallel group
   * (both from splits, owned), the last stage's evaluation outputs, the
   * unsplit model's optimizer for checkpoints, a full model's floats. */
  int stage_rank;
  ddp_pipeline *pp;
  ddp_process_group *pipe_pg, *stage_dp_pg;
  ddp_dp *stage_dp; /* the stage's data-parallel wrapper over stage_dp_pg (replicas > 1) */
  ddp_tensor *eval_out;
  ddp_optimizer *full_opt;
  float *gather;
  ddp_optimizer *opt;
  ddp_scheduler *sched;
  ddp_sampler *train_sampler, *test_sampler;
  ddp_loader *train_loader, *test_loader;
  ddp_tape *tape;
  FILE *log; /* rank 0's, when options.log_path */
  bool ran;
  /* On a GPU (o.device): the batch's home there, grown to the largest
   * batch seen, and the pinned staging its copies go through
   * (device_batch.c). */
  ddp_tensor *device_x, *device_y;
  ddp_device_stage *stage;
  /* o.cuda_graph: the captured step and what it keeps (graph_step.c). */
  struct ddp__train_graph *graph;
  /* o.trace_path: the run's timeline (trace.c), made when the run starts
   * and written when it returns; NULL when not tracing. */
  struct ddp__trace *trace;
  /* The last eager step's clock readings (ddp_time_ns): forward start,
   * forward end (loss read), backward end, optimizer end. */
  int64_t step_marks[4];
};

/* One eager step on `tape` from the batch (x, y) already on the device:
 * zero_grad, forward, loss (read back: *loss), backward, optimizer. Fills
 * the forward, backward and optimizer phases of *p, in seconds. */
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

/* The sums (loss * rows, correct, rows) of one pass over this rank's part
 * of the test set with the model's forward. */
ddp_status ddp__train_local_sums(ddp_trainer *t, double sums[3]);

/* Evaluates on the test set (every rank its part, no padding) and reduces
 * the sums once, so every rank gets the same figures. Collective. */
ddp_status ddp__train_evaluate(ddp_trainer *t, double *loss, double *accuracy);

/* JSON lines (train_log.c): a step's record and an evaluation's. */
void ddp__train_log_step(FILE *log, const ddp_train_step_info *s);
void ddp__train_log_eval(FILE *log, int64_t step, int64_t epoch, double loss, double accuracy);
/* `"key": value` with JSON's null for NaN and infinities, ", " after it when comma. */
void ddp__train_json_number(FILE *f, const char *key, double v, bool comma);

#endif
