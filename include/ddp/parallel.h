/* ddp parallel: data parallelism (PyTorch's DistributedDataParallel). A
 * wrapper over a model and a process group that keeps the replicas equal:
 * parameters and buffers are broadcast from rank 0 at construction, and
 * gradients are averaged across ranks in buckets whose allreduces start while
 * backward is still running. docs/parallel.md has the rules.
 *
 * The model of use (one replica per rank):
 *
 *   ddp_dp_options o = ddp_dp_defaults();
 *   ddp_dp *dp;
 *   DDP_TRY(ddp_dp_create(&dp, model, pg, &o));   // collective: checks shapes, broadcasts
 *   ddp_dp_set_optimizer(dp, opt);                // its state follows a relayout
 *   for (each batch) {
 *     ddp_model_zero_grad(model);
 *     ddp_tape_reset(tape);
 *     DDP_TRY(ddp_dp_forward(dp, tape, x, &out));  // buffers from rank 0, join bookkeeping
 *     DDP_TRY(ddp_model_loss(model, tape, out, y, &loss));
 *     DDP_TRY(ddp_dp_backward(dp, tape, loss));    // backward + bucketed async allreduce
 *     DDP_TRY(ddp_optimizer_step(opt));             // grads are the average over ranks
 *   }
 *   ddp_dp_destroy(dp);
 *
 * Every rank must make the same sequence of ddp_dp_* calls (they issue
 * collectives on the group). A dp is used by one thread at a time. */
#ifndef DDP_PARALLEL_H
#define DDP_PARALLEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_dp ddp_dp;

/* A bucket: a contiguous range of the model's flat gradient buffer holding
 * whole parameters (a view, no copy). What a communication hook sees. */
typedef struct ddp_dp_bucket {
  int index;           /* 0 is the first launched (the last layers' gradients) */
  float *grads;        /* numel floats inside ddp_model_grads_flat(model) */
  size_t numel;
  int64_t offset;      /* of grads in the flat buffer, floats */
  int n_params;        /* parameters in the bucket, in bucket order ... */
  const int *params;   /* ... their ddp_model_param indices (owned by the dp) */
  double divisor;      /* this iteration's averaging divisor (world size, see join) */
  void *scratch;       /* 2 * numel bytes owned by the dp, for a compressed copy */
  bool last;           /* launched last in this backward: every gradient is final, so
                        * nothing is left to overlap its reduction with; the
                        * built-in hooks then reduce it on the calling thread
                        * (blocking, *work NULL) instead of handing it to the
                        * group's progress thread, which would compete with this
                        * rank's compute for its core */
} ddp_dp_bucket;

/* A communication hook (PyTorch's register_comm_hook): `launch` starts the
 * reduction of bucket->grads over pg and returns its work handle in *work
 * (NULL when it completed inside launch); after that work has completed,
 * `finish` (may be NULL) must leave bucket->grads holding the average over
 * ranks, i.e. the sum divided by bucket->divisor. launch runs inside
 * backward on the caller's thread; both run once per bucket per synced
 * backward, in bucket order. Return a status; an error fails the backward. */
typedef struct ddp_dp_comm_hook {
  ddp_status (*launch)(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                       ddp_work **work);
  ddp_status (*finish)(void *state, ddp_dp_bucket *bucket);
  void *state; /* passed through; the caller's */
} ddp_dp_comm_hook;

/* Built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks). */
typedef enum ddp_dp_hook_kind {
  DDP_DP_HOOK_ALLREDUCE = 0, /* float32 sum, then divide (the default) */
  DDP_DP_HOOK_FP16 = 1,      /* divide, compress to float16, sum, decompress */
  DDP_DP_HOOK_BF16 = 2,      /* the same with bfloat16 */
  DDP_DP_HOOK_KIND_COUNT
} ddp_dp_hook_kind;

/* Options, PyTorch's DistributedDataParallel arguments. Start from
 * ddp_dp_defaults(); NULL wherever options are taken means the defaults. */
typedef struct ddp_dp_options {
  double bucket_cap_mb;        /* bucket size cap in MiB (25); the first bucket is 1 MiB */
  double first_bucket_mb;      /* 1 (PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES) */
  bool broadcast_buffers;      /* buffers (BN running stats) from rank 0 at each forward (true) */
  bool find_unused_parameters; /* parameters without a gradient are reduced as they are (false) */
  bool relayout;               /* re-lay out buffers in observed ready order once (true) */
  /* PyTorch's static_graph (false): every iteration's backward uses the same
   * parameters as the first's. The parameters without a gradient in the first
   * synced backward are then reduced as they are, as with
   * find_unused_parameters, and the relayout runs even with
   * find_unused_parameters; a later synced backward whose set of parameters
   * with a gradient differs fails (DDP_ERR_STATE naming the first parameter
   * that changed). */
  bool static_graph;
  uint64_t reserved[8];        /* zero */
} ddp_dp_options;
DDP_STRUCT_SIZE(ddp_dp_options, 88);

/* The defaults in parentheses above: PyTorch's. */
ddp_dp_options ddp_dp_defaults(void);

/* Wraps `model` (finalized) for data parallelism over `pg`. Collective: every
 * rank calls it. Checks that every rank has the same parameters (number and
 * shapes; DDP_ERR_SHAPE naming the first parameter that differs and the rank,
 * the same message on every rank), then broadcasts parameters, buffers and
 * BN counters from rank 0. Allocates every buffer the steady state needs.
 * model and pg are borrowed and must outlive the dp. *out NULL on failure. */
ddp_status ddp_dp_create(ddp_dp **out, ddp_model *model, ddp_process_group *pg,
                         const ddp_dp_options *options);
/* Frees the dp (waits for nothing: call after the last backward). NULL ok. */
void ddp_dp_destroy(ddp_dp *dp);

/* The optimizer whose state must follow a relayout of the flat buffers (its
 * params and grads must be the model's flat buffers). NULL detaches. Only
 * optimizers attached here stay consistent after the first iteration. */
void ddp_dp_set_optimizer(ddp_dp *dp, ddp_optimizer *opt);

/* Installs a built-in hook, or a user hook (copied; NULL restores the
 * default). Every rank must install the same one, before a backward. */
ddp_status ddp_dp_set_comm_hook(ddp_dp *dp, ddp_dp_hook_kind kind);
ddp_status ddp_dp_set_comm_hook_fn(ddp_dp *dp, const ddp_dp_comm_hook *hook);

/* no_sync (gradient accumulation): while true, backward only accumulates
 * gradients locally; the first backward after setting it false reduces the
 * accumulated sums. */
void ddp_dp_set_no_sync(ddp_dp *dp, bool no_sync);

/* The seed of ddp_dp_backward's loss gradient (1 by default): GradScaler's
 * scale(loss) (include/ddp/optim.h, "Gradient scaling"), applied as the
 * seed instead of a multiplication on the tape, which is the same gradient
 * (d(loss * s)/d(loss) = s). Every gradient then comes out scaled by it,
 * and so do the averaged ones. Finite and > 0 (asserted). */
void ddp_dp_set_loss_scale(ddp_dp *dp, float scale);

/* ---- One iteration ---------------------------------------------------- */

/* What runs before the forward (PyTorch's _pre_forward): the join
 * bookkeeping when join is enabled, then the buffer broadcast when
 * broadcast_buffers. ddp_dp_forward calls it; call it yourself if you run the
 * model's forward another way (it assumes a backward follows; evaluate
 * with ddp_model_forward, or ddp_dp_forward on a tape with gradients off). */
ddp_status ddp_dp_pre_forward(ddp_dp *dp);
/* ddp_dp_pre_forward, then ddp_model_forward. On a tape with gradients off
 * (ddp_tape_set_grad_enabled false, PyTorch's torch.no_grad()) the forward is
 * an evaluation: no backward is expected, ranks that joined shadow no
 * gradient allreduce for it, and the next forward does not broadcast
 * buffers (PyTorch's require_forward_param_sync). */
ddp_status ddp_dp_forward(ddp_dp *dp, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);

/* Backward with gradient reduction: ddp_dp_prepare_backward, ddp_backward,
 * ddp_dp_finalize_backward. On return (DDP_OK) every gradient is the average
 * over ranks (or, under no_sync, the local accumulation). */
ddp_status ddp_dp_backward(ddp_dp *dp, ddp_tape *tape, ddp_tensor *loss);
/* The two halves, for a loop that calls ddp_backward itself: prepare
 * installs the dp's grad hook on `tape` (replacing any other); finalize waits
 * for every bucket (the group's timeout), averages, checks for parameters
 * that got no gradient (DDP_ERR_STATE naming the first one unless
 * find_unused_parameters), removes the hook and, after the first synced
 * iteration, re-lays out the buffers if the ready order asks for it. */
ddp_status ddp_dp_prepare_backward(ddp_dp *dp, ddp_tape *tape);
ddp_status ddp_dp_finalize_backward(ddp_dp *dp);

/* Reduces the gradients already in the model's flat gradient buffer as a
 * synced backward would (every bucket through the comm hook, in index
 * order, averaged over the group; then waits for them), for a loop whose
 * backward runs on tapes the wrapper cannot hook: a pipeline stage, whose
 * micro-batches' backwards accumulate into the buffer on the executor's
 * tapes (Megatron and PyTorch's pipelining reduce a stage's gradients over
 * its data-parallel group once, after the last micro-batch's backward).
 * Every parameter counts as used; no relayout follows. Collective over the
 * wrapper's group; DDP_ERR_STATE between prepare_backward and
 * finalize_backward. */
ddp_status ddp_dp_reduce_grads(ddp_dp *dp);

/* ---- Join: uneven inputs (torch.distributed.algorithms.Join) -----------
 * Every rank calls ddp_dp_join_enable before its loop. From then on each
 * pre_forward also counts the ranks still training (one small allgather).
 * A rank that runs out of data calls ddp_dp_join: it shadows the others'
 * collectives (buffer broadcasts, zero-filled bucket allreduces) until every
 * rank has joined, then every rank takes the final parameters and buffers
 * from the last rank to join. Gradients are divided by the initial world
 * size when divide_by_initial_world_size (PyTorch's default), else by the
 * number of ranks still training in that iteration. A model converted to
 * SyncBatchNorm cannot join (DDP_ERR_UNSUPPORTED from both calls, as
 * PyTorch documents: a joined rank cannot shadow SyncBN's collectives). */
ddp_status ddp_dp_join_enable(ddp_dp *dp, bool divide_by_initial_world_size);
ddp_status ddp_dp_join(ddp_dp *dp);

/* ---- Introspection ------------------------------------------------------ */

int ddp_dp_num_buckets(const ddp_dp *dp);
/* Bucket `index` (its params, offset, numel); NULL out of range. Valid until
 * the next relayout. */
const ddp_dp_bucket *ddp_dp_bucket_get(const ddp_dp *dp, int index);

/* What the last synced backward did, per bucket (for tests and traces). */
typedef struct ddp_dp_bucket_trace {
  int64_t ready_ns;       /* ddp_time_ns() when its last gradient became final */
  int64_t launch_ns;      /* when its reduction was launched */
  int params_not_ready;   /* model parameters still without a final grad at launch */
  int hook_calls_before;  /* grad hooks fired before the launch, this backward */
  int first_param;        /* the bucket as it was then (a relayout rebuilds buckets): */
  size_t numel;           /* its first parameter and size */
  /* When its reduction was seen complete: the launch's return for a
   * reduction that ran on the calling thread (the last bucket's), else the
   * return of its wait in finalize (an upper bound: it may have finished
   * earlier on the progress thread); 0 when nothing was reduced (a group
   * of one with the default hook). wait_start_ns: when finalize began
   * waiting for it (0 when it did not wait). */
  int64_t wait_start_ns, done_ns;
} ddp_dp_bucket_trace;

typedef struct ddp_dp_trace {
  int64_t backward_start_ns, backward_end_ns; /* around ddp_backward in ddp_dp_backward */
  int64_t finalize_end_ns;
  int n_buckets;                      /* as they were during that backward */
  const ddp_dp_bucket_trace *buckets; /* n_buckets entries, owned by the dp */
  bool relaid_out;                    /* a relayout has happened */
  int64_t iterations;                 /* synced backwards so far */
} ddp_dp_trace;

void ddp_dp_get_trace(const ddp_dp *dp, ddp_dp_trace *out);

/* ---- PowerSGD (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) --
 * A communication hook that replaces each matrix-shaped gradient M (a
 * parameter of shape [n, ...] viewed as n x m, m the product of the rest) by
 * a rank-r approximation P Q^T: P = M Q, allreduce P, orthogonalize P,
 * Q = M^T P, allreduce Q, M ~ P (Q / W)^T. Vectors, and matrices for which
 * (n + m) r * min_compression_rate >= n m, are allreduced as they are (one
 * allreduce per bucket together with the bucket's P's). With error feedback
 * each rank adds what compression lost last time to its gradient before, and
 * keeps (gradient + error) - result after, as PyTorch does (also for the
 * uncompressed tensors: their error is the local minus the average). With
 * warm start Q is kept across iterations (orthogonalized before reuse);
 * without, it is drawn afresh every iteration. The first start_iter synced
 * backwards are plain float32 allreduces (PyTorch's start_powerSGD_iter).
 * docs/parallel.md ("PowerSGD") has the rules and the wire bytes.
 *
 *   ddp_powersgd *ps;
 *   ddp_powersgd_options po = ddp_powersgd_defaults();
 *   po.rank = 4;
 *   DDP_TRY(ddp_powersgd_create(&ps, dp, &po));   // installs itself as dp's hook
 *   ... train ...
 *   ddp_powersgd_destroy(ps);                    // after the last backward, before dp
 *
 * Every buffer is sized at create from the parameters' shapes: no step
 * allocates. Host buffers only (DDP_ERR_UNSUPPORTED for a model on a GPU). */
typedef struct ddp_powersgd ddp_powersgd;

/* Fills q (rows x cols, row-major, as torch.randn(1, rows, cols)) with the
 * initial random values of one Q, before orthogonalization; called in
 * PyTorch's order (bucket by bucket, each bucket's tensors grouped by shape).
 * For tests that inject PyTorch's values. */
typedef ddp_status (*ddp_powersgd_init_q_fn)(void *user, float *q, int64_t rows, int64_t cols);

typedef struct ddp_powersgd_options {
  int32_t rank;                     /* matrix_approximation_rank (1) */
  int32_t reserved0;                /* zero */
  int64_t start_iter;               /* start_powerSGD_iter: plain allreduces first (1000);
                                     * > 1 with error feedback or warm start, as PyTorch */
  double min_compression_rate;      /* compress only when n m > rate * (n + m) r (2) */
  bool use_error_feedback;          /* (true) */
  bool warm_start;                  /* (true) */
  double orthogonalization_epsilon; /* added to each column's norm (0) */
  uint64_t random_seed;             /* numpy RandomState seed of the Q seeds (0) */
  ddp_powersgd_init_q_fn init_q;    /* NULL: PyTorch's generator (torch.randn, CPU) */
  void *init_q_user;
  uint64_t reserved[6];             /* zero */
} ddp_powersgd_options;
DDP_STRUCT_SIZE(ddp_powersgd_options, 112);

/* PyTorch's PowerSGDState defaults, as above. */
ddp_powersgd_options ddp_powersgd_defaults(void);

/* Makes the state for `dp` (borrowed; must outlive it) and installs its hook
 * (ddp_dp_set_comm_hook_fn). Not collective; every rank must make the same
 * one. *out NULL on failure. */
ddp_status ddp_powersgd_create(ddp_powersgd **out, ddp_dp *dp, const ddp_powersgd_options *options);
/* Frees it (and leaves dp's hook dangling: destroy the dp, or install another
 * hook, before the next backward). NULL ok. */
void ddp_powersgd_destroy(ddp_powersgd *ps);

typedef struct ddp_powersgd_stats {
  int64_t iter;               /* synced backwards seen (PyTorch's state.iter) */
  /* The last completed synced backward: floats this rank allreduced through
   * the hook (uncompressed tensors, P's and Q's), and what a plain allreduce
   * of the same buckets would have been (the gradients' count). */
  uint64_t last_elements_sent;
  uint64_t last_elements_uncompressed;
  /* Over the model's parameters at this rank: floats per step once
   * compressing (sum of (n + m) r over compressed, n m over the others),
   * and how many parameters are compressed. */
  uint64_t elements_per_step;
  int32_t compressed_params;
  int32_t reserved32;
  uint64_t reserved[4];
} ddp_powersgd_stats;
DDP_STRUCT_SIZE(ddp_powersgd_stats, 72);
void ddp_powersgd_get_stats(const ddp_powersgd *ps, ddp_powersgd_stats *out);

/* Parameter i's current Q (cols x r, row-major, after the last allreduce and
 * division), *rows and *cols set; NULL when i is not compressed or no Q has
 * been made yet. For tests. */
const float *ddp_powersgd_q(const ddp_powersgd *ps, int param, int64_t *rows, int64_t *cols);

/* The state (iteration, error feedback, Q's, the seed generator) of this
 * rank to / from a safetensors file, atomically written. The error feedback
 * differs per rank: each rank saves its own file and loads it at the same
 * rank and world size, with the same model and options (a mismatch is
 * DDP_ERR_INVALID naming the file and what differs). Not collective. A
 * load that fails may have replaced part of the state (the error feedback
 * is read in place, allocation-free): destroy the hook, or load again,
 * before training on with it. */
ddp_status ddp_powersgd_save(const ddp_powersgd *ps, const char *path);
ddp_status ddp_powersgd_load(ddp_powersgd *ps, const char *path);

/* ---- SyncBatchNorm ---------------------------------------------------------
 * The batch-norm sync over a process group: allreduce_sum is a blocking
 * ddp_allreduce(group, buf, count, DDP_FLOAT64, DDP_REDUCE_SUM), with the
 * group's timeout and sticky errors. The group is borrowed: it must outlive
 * every forward and backward that uses the returned value. */
ddp_batch_norm_sync ddp_batch_norm_sync_for_group(ddp_process_group *group);

/* torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group): every
 * BatchNorm2d of `model` becomes a SyncBatchNorm over `group` (borrowed, as
 * above); NULL turns them back into BatchNorm2d. Parameter and buffer names
 * and the state dict are unchanged (docs/nn.md). Call it on every rank of
 * the group, before or after ddp_dp_create: the forward and backward of a
 * synced model are collectives over it. The statistics are host doubles
 * (2C + 1 a layer), so over an nccl group they travel on its host group
 * (ddp_process_group_host_group, made here). */
ddp_status ddp_model_convert_sync_batchnorm(ddp_model *model, ddp_process_group *group);

/* ---- DataParallel: one process, many replicas ------------------------------
 * PyTorch's torch.nn.DataParallel, without Python's lock: the one-line change
 * to a single-process loop (docs/parallel.md, "DataParallel").
 *
 *   ddp_data_parallel *dp;
 *   DDP_TRY(ddp_data_parallel_create(&dp, model, NULL));  // one replica per core
 *   for (each batch) {                       // the loop is the single-process one:
 *     ddp_model_zero_grad(model);
 *     ddp_tape_reset(tape);
 *     DDP_TRY(ddp_data_parallel_forward(dp, tape, x, &out)); // was ddp_model_forward
 *     DDP_TRY(ddp_model_loss(model, tape, out, y, &loss));
 *     DDP_TRY(ddp_backward(tape, loss));     // replicas' backward, gradients summed
 *     DDP_TRY(ddp_optimizer_step(opt));      // once, on the model
 *   }
 *   ddp_data_parallel_destroy(dp);
 *
 * The forward scatters x along dim 0 over the replicas (threads of this
 * process, each on a core of its own where the affinity mask allows), runs
 * each replica's forward on its slice, and gathers the outputs along dim 0
 * into one tensor on the caller's tape; its backward runs each replica's
 * backward on its slice of the output's gradient and adds every replica's
 * gradients into the model's own gradient buffer, in replica order (the
 * same bits on every run). Replica 0 is the model itself on the calling
 * thread; the others read its parameters in place (ddp_model_replicate).
 * Batch norm: the running statistics are replica 0's (PyTorch's rule), or,
 * with sync_batch_norm, every replica normalises with the whole batch's
 * statistics (SyncBatchNorm across the replicas). CPU only: GPU replicas
 * (DDP_CUDA) are refused until the NCCL backend lands. A dp is used by one
 * thread at a time. */
typedef struct ddp_data_parallel ddp_data_parallel;

typedef struct ddp_data_parallel_options {
  /* Replicas (threads): >= 1; 0 = one per CPU this process may run on, or
   * n_device_ids when device_ids is set. (0) */
  int32_t replicas;
  /* PyTorch's device_ids: the CPU cores (numbers in the affinity mask,
   * sched_getaffinity) that replica i's thread runs on, i in
   * [0, n_device_ids); replica 0 is the caller's thread and is not moved.
   * NULL: replica i >= 1 on the i-th core of the mask (when it has as many).
   * Borrowed for the call. (NULL) */
  const int32_t *device_ids;
  int32_t n_device_ids;
  /* Scatter and gather dimension: 0 only (the batch). (0) */
  int32_t dim;
  ddp_device device;      /* where replicas run: DDP_CPU only, for now (DDP_CPU) */
  bool sync_batch_norm;   /* SyncBatchNorm across the replicas (false: replica 0's stats) */
  bool pin_threads;       /* pin replica threads to their cores (true) */
  int64_t timeout_ms;     /* every wait for a replica; <= 0: 300000 (0) */
  uint64_t reserved[6];   /* zero */
} ddp_data_parallel_options;
DDP_STRUCT_SIZE(ddp_data_parallel_options, 96);

ddp_data_parallel_options ddp_data_parallel_defaults(void);

/* Wraps `model` (finalized, on the CPU, not wrapped by another wrapper):
 * makes replicas 1..N-1 and their threads, which persist until destroy.
 * Errors (DDP_ERR_INVALID / DDP_ERR_UNSUPPORTED / DDP_ERR_STATE, with the
 * option and value): replicas < 0, a device id that is not a core of this
 * process, dim != 0, a GPU device, a model already wrapped (DDP or
 * DataParallel), a model whose batch norm syncs over a process group.
 * model is borrowed and must outlive the dp; while wrapped it cannot be
 * moved or re-laid out. *out NULL on failure. */
ddp_status ddp_data_parallel_create(ddp_data_parallel **out, ddp_model *model,
                                    const ddp_data_parallel_options *options);
/* Stops the threads, frees the replicas, restores the model's batch norm
 * as it was. NULL ok. */
void ddp_data_parallel_destroy(ddp_data_parallel *dp);

/* The forward of DataParallel(model)(x): x (B, ...) with B >= the replicas
 * (DDP_ERR_INVALID naming both otherwise), scattered in slices of B / N
 * rows (the first B % N replicas one more); *out (B, ...) tape-owned. With
 * gradients enabled on `tape`, backward through *out runs the replicas'
 * backwards and adds their gradients into the model's gradient buffer (x
 * gets none); dp must live until then, and only the last forward's
 * output can be backpropagated (DDP_ERR_STATE otherwise: the replicas'
 * tapes hold one forward). A replica's failure returns its error prefixed
 * with "DataParallel: replica i (core c)". */
ddp_status ddp_data_parallel_forward(ddp_data_parallel *dp, ddp_tape *tape, ddp_tensor *x,
                                     ddp_tensor **out);

/* DataParallel.module: the wrapped model (borrowed). */
ddp_model *ddp_data_parallel_module(ddp_data_parallel *dp);
int ddp_data_parallel_num_replicas(const ddp_data_parallel *dp);
/* The core replica i's thread is pinned to, or -1 (not pinned, or i = 0). */
int ddp_data_parallel_replica_cpu(const ddp_data_parallel *dp, int replica);

/* DataParallel(model).state_dict() saved: the model's state dict with every
 * name prefixed "module." (PyTorch's names for a wrapped model), written
 * as ddp_model_save does. ddp_model_load reads it back into an unwrapped
 * model and a file without the prefix into a wrapped one (it strips the
 * prefix), so checkpoints move both ways. */
ddp_status ddp_data_parallel_save(ddp_data_parallel *dp, const char *path, const ddp_kv *metadata,
                                  size_t metadata_count);

#ifdef __cplusplus
}
#endif
#endif /* DDP_PARALLEL_H */
