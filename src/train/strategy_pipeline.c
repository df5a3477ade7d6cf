/* The pipeline strategy of the training loop (issue 23; docs/train.md,
 * "Pipeline"): the trainer's group as a mesh of P stages x D replicas, a
 * pipeline (include/ddp/pipeline.h) per replica, each stage's gradients
 * averaged over its data-parallel group once per step, the step and the
 * evaluation through the pipeline, and checkpoints of the whole model with
 * the unsplit model's names gathered from the stages. Its state (the
 * pipeline, the mesh's groups, the stage's wrapper) is behind t->state.
 *
 * On a GPU (options.device cuda:N) the pipeline puts only this rank's
 * stage there (places_model): t->model, the unsplit model, stays on the
 * host, where the stages are gathered for checkpoints and at the end, so a
 * checkpoint is the CPU pipeline's file. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/module.h" /* ddp__model_state_entry_any: a stage on a GPU */
#include "train/train_internal.h"

/* This rank's part of the mesh: its stage index in its pipeline, the
 * pipeline, its group and the stage's data-parallel group (both from
 * splits, owned), the stage's data-parallel wrapper over that group
 * (replicas > 1), the last stage's evaluation outputs, the unsplit model's
 * optimizer for checkpoints (made at the first save or resume), a full
 * model's floats. */
typedef struct pipeline_state {
  int stage_rank;
  ddp_pipeline *pp;
  ddp_process_group *pipe_pg, *stage_dp_pg;
  ddp_dp *stage_dp;
  ddp_tensor *eval_out;
  ddp_optimizer *full_opt;
  float *gather;
} pipeline_state;

static pipeline_state *state(const ddp_trainer *t) { return t->state; }

/* ---- The mesh ------------------------------------------------------------ */

static ddp_status pipeline_check(const ddp_train_options *o, const ddp_process_group *pg) {
  const ddp_train_pipeline *p = o->pipeline;
  if (!pg)
    return ddp_error(DDP_ERR_INVALID, "pipeline: %d stages need a process group of a multiple "
                                      "of %d ranks (run under ddprun)",
                     (int)p->stages, (int)p->stages);
  const int size = ddp_process_group_size(pg);
  if (p->stages < 2 || size % p->stages != 0)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline: stages is %d; it must be >= 2 and divide the group's %d ranks "
                     "(P stages x D replicas)",
                     (int)p->stages, size);
  if (o->cuda_graph)
    return ddp_error(DDP_ERR_UNSUPPORTED, "pipeline: a CUDA graph replays one whole step on one "
                     "device; drop --cuda-graph with --pp");
  return DDP_OK;
}

/* The step's gradient synchronisation over the stage's replicas (the
 * pipeline calls it once, after the last micro-batch's backward): the
 * data-parallel wrapper reduces the accumulated gradients bucket by bucket
 * (its comm hook and bucket sizes apply), and the BatchNorm buffers come
 * from the group's first replica, as its broadcast_buffers does before
 * each forward. */
static ddp_status sync_stage(void *user, ddp_model *stage) {
  ddp_trainer *t = user;
  pipeline_state *ps = state(t);
  ddp_status s = ddp_dp_reduce_grads(ps->stage_dp);
  if (s != DDP_OK) return ddp_error_wrap(s, "averaging stage %d's gradients over its %d replicas",
                                         ps->stage_rank, t->replicas);
  const int64_t nbuf = ddp_model_num_buffer_elements(stage);
  if (nbuf > 0) {
    s = ddp_broadcast(ps->stage_dp_pg, ddp_model_buffers_flat(stage), (size_t)nbuf, DDP_FLOAT32, 0);
    if (s != DDP_OK) return ddp_error_wrap(s, "broadcasting stage %d's buffers", ps->stage_rank);
  }
  const int nc = ddp_model_num_counters(stage);
  if (nc > 0) {
    /* The counters stay in host memory on every device: over the host
     * group where the stage's group is nccl. */
    ddp_process_group *hg = ps->stage_dp_pg;
    if (!ddp_process_group_takes_host(hg)) DDP_TRY(ddp_process_group_host_group(hg, &hg));
    s = ddp_broadcast(hg, ddp_model_counters(stage), (size_t)nc, DDP_INT64, 0);
    if (s != DDP_OK) return ddp_error_wrap(s, "broadcasting stage %d's counters", ps->stage_rank);
  }
  return DDP_OK;
}

/* The stage's data-parallel wrapper over its replicas. Creating it checks
 * that every replica has the stage's shapes and broadcasts parameters,
 * buffers and counters from the group's first replica: equal already when
 * every rank built the model from the same seed, and made so when not. */
static ddp_status wrap_stage(ddp_trainer *t) {
  ddp_dp_options o = ddp_dp_defaults();
  if (t->o.bucket_cap_mb > 0) {
    o.bucket_cap_mb = t->o.bucket_cap_mb;
    if (o.first_bucket_mb > o.bucket_cap_mb) o.first_bucket_mb = o.bucket_cap_mb;
  }
  o.broadcast_buffers = false; /* sync_stage broadcasts them once per step */
  pipeline_state *ps = state(t);
  return ddp_dp_create(&ps->stage_dp, t->step_model, ps->stage_dp_pg, &o);
}

/* The largest batch a step or evaluation hands the pipeline. */
static int64_t largest_batch(const ddp_train_options *o) {
  const int64_t eval = ddp__train_eval_batch_size(o);
  return eval > o->batch_size ? eval : o->batch_size;
}

/* Before the optimizer: splits the group into the mesh's pipeline and
 * data-parallel groups, builds this rank's stage from t->model and points
 * t->step_model at it. Collective over the group. */
static ddp_status pipeline_create(ddp_trainer *t) {
  const ddp_train_options *o = &t->o;
  const ddp_train_pipeline *p = o->pipeline;
  const int P = p->stages;
  pipeline_state *ps = ddp_calloc(1, sizeof *ps);
  if (!ps) return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  t->state = ps;
  t->replicas = t->size / P;
  t->replica = t->rank / P;
  ps->stage_rank = t->rank % P;
  /* Each made once: the pipeline group of this rank's replica, and the
   * data-parallel group of its stage (every rank takes part in both
   * splits: they are collective over the trainer's group). */
  ddp_status s = ddp_process_group_split(t->pg, t->replica, ps->stage_rank, &ps->pipe_pg);
  if (s != DDP_OK) return ddp_error_wrap(s, "making replica %d's pipeline group", t->replica);
  s = ddp_process_group_split(t->pg, ps->stage_rank, t->replica, &ps->stage_dp_pg);
  if (s != DDP_OK) return ddp_error_wrap(s, "making stage %d's data-parallel group", ps->stage_rank);
  ddp_pipeline_options po = ddp_pipeline_defaults();
  po.schedule = p->schedule;
  po.n_microbatches = o->microbatches > 1 ? o->microbatches : 1;
  po.virtual_stages = p->virtual_stages > 0 ? p->virtual_stages : 1;
  po.split = p->split;
  po.grad_scale = o->microbatch_sum ? 1.0 : 0.0;
  po.max_batch = largest_batch(o);
  po.device = o->device; /* the stage moves there; t->model stays on the host */
  s = ddp_pipeline_create(&ps->pp, t->model, ps->pipe_pg, &po);
  if (s != DDP_OK) return ddp_error_wrap(s, "rank %d (stage %d of replica %d): setting up the pipeline",
                                         t->rank, ps->stage_rank, t->replica);
  t->step_model = ddp_pipeline_model(ps->pp);
  if (o->sync_bn && t->replicas > 1) {
    s = ddp_model_convert_sync_batchnorm(t->step_model, ps->stage_dp_pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "converting stage %d to SyncBatchNorm", ps->stage_rank);
  }
  /* Every batch of an epoch must fill the M micro-batches: the sampler
   * pads each replica's share to ceil(N / D), so only its last batch can
   * be short. */
  const int64_t per_replica = (ddp_dataset_size(t->train_ds) + t->replicas - 1) / t->replicas;
  const int64_t last = per_replica % o->batch_size;
  if (last && last < po.n_microbatches)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline: each replica's epoch of %lld samples ends with a batch of %lld, "
                     "fewer than the %d micro-batches; pick a batch size that leaves none or "
                     "at least %d",
                     (long long)per_replica, (long long)last, po.n_microbatches,
                     po.n_microbatches);
  /* The outputs of an evaluation batch, on the last stage (sized once). */
  if (ddp_pipeline_is_last(ps->pp)) {
    int64_t shape[DDP_MAX_DIMS + 1];
    int nd = ddp_pipeline_output_shape(ps->pp, shape + 1);
    shape[0] = largest_batch(o);
    s = ddp_tensor_create(&ps->eval_out, DDP_FLOAT32, nd + 1, shape);
    if (s != DDP_OK) return ddp_error_wrap(s, "the evaluation's outputs");
  }
  ps->gather = ddp_calloc((size_t)ddp_model_num_param_elements(t->model) + 1, sizeof(float));
  if (!ps->gather) return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory for the gather buffer");
  return DDP_OK;
}

/* After the optimizer: the stage's wrapper over its replicas, hooked into
 * the pipeline's grad sync. */
static ddp_status pipeline_bind(ddp_trainer *t) {
  pipeline_state *ps = state(t);
  if (t->replicas > 1) {
    ddp_status s = wrap_stage(t);
    if (s != DDP_OK) return ddp_error_wrap(s, "wrapping stage %d for data parallelism over its replicas",
                                           ps->stage_rank);
    ddp_pipeline_set_grad_sync(ps->pp, sync_stage, t);
  }
  ddp_pipeline_reset_stats(ps->pp);
  return DDP_OK;
}

static void pipeline_destroy(ddp_trainer *t) {
  pipeline_state *ps = state(t);
  t->state = NULL;
  t->step_model = t->model;
  if (!ps) return;
  /* The wrapper before the pipeline: it wraps the pipeline's stage model
   * (and unmarks it when destroyed). */
  ddp_dp_destroy(ps->stage_dp);
  ddp_pipeline_destroy(ps->pp);
  ddp_tensor_destroy(ps->eval_out);
  ddp_optimizer_destroy(ps->full_opt);
  ddp_free(ps->gather);
  ddp_process_group_destroy(ps->stage_dp_pg);
  ddp_process_group_destroy(ps->pipe_pg);
  ddp_free(ps);
}

/* ---- The step and the evaluation ---------------------------------------- */

static ddp_status pipeline_step(ddp_trainer *t, ddp_batch *b, ddp__train_step_out *out) {
  pipeline_state *ps = state(t);
  const int64_t t0 = ddp_time_ns();
  ddp_model_zero_grad(t->step_model);
  const bool first = ddp_pipeline_is_first(ps->pp), last = ddp_pipeline_is_last(ps->pp);
  double loss = NAN;
  /* GradScaler's scale(loss): the last stage's seeds. */
  ddp_pipeline_set_loss_scale(ps->pp, ddp__train_loss_seed(t));
  /* Autocast's region around the whole schedule: the executor
   * interleaves forwards and backwards on this thread, and a backward
   * keeps the precision its forward was recorded with (ddp/tensor.h). */
  /* On a GPU the batch goes to the device first (the first stage reads x,
   * the last y). */
  ddp_tensor x, y;
  DDP_TRY(ddp__train_batch_on_device(t, b, &x, &y));
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = ddp_pipeline_step(ps->pp, first ? &x : NULL, last ? &y : NULL, &loss);
  ddp__train_autocast_exit(t);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "replica %d's pipeline step", t->replica);
  const int64_t t1 = ddp_time_ns();
  /* The stage's gradients are final (every micro-batch, reduced over the
   * stage's replicas): unscale, the agreement over the whole mesh, the
   * step or its skip. */
  DDP_TRY(ddp__train_optimizer_step(t));
  const int64_t t2 = ddp_time_ns();
  /* Only the last stage has the loss: the others add nothing to the
   * group's sums. */
  out->loss = (float)loss;
  out->counts = last;
  /* The pipeline interleaves forwards and backwards: its whole step is the
   * forward phase here, and the waits for transfers are communication. */
  ddp_pipeline_stats st;
  ddp_pipeline_get_stats(ps->pp, &st);
  double wait = st.wait_s < 1e-9 * (double)(t1 - t0) ? st.wait_s : 1e-9 * (double)(t1 - t0);
  ddp_train_phases *p = &out->phases;
  p->forward_ms = 1e-9 * (double)(t1 - t0) - wait;
  p->backward_compute_ms = 0;
  p->backward_comm_ms = wait;
  p->optimizer_ms = 1e-9 * (double)(t2 - t1);
  t->step_marks[0] = t0;
  t->step_marks[1] = t1;
  t->step_marks[2] = t1;
  t->step_marks[3] = t2;
  return DDP_OK;
}

/* One test batch through the pipeline's forward-only schedule; counted on
 * the replica's last stage only (the other stages add nothing, so the
 * trainer's reduction over the whole group counts every test sample once). */
static ddp_status pipeline_eval_batch(ddp_trainer *t, ddp_batch *b, void *ctx, bool classify,
                                      double *loss_rows, int64_t *correct, bool *counted) {
  pipeline_state *ps = ctx;
  const bool first = ddp_pipeline_is_first(ps->pp), last = ddp_pipeline_is_last(ps->pp);
  ddp_tensor out;
  if (last) {
    out = *ps->eval_out;
    out.shape[0] = b->size;
    out.numel = ps->eval_out->numel / ps->eval_out->shape[0] * b->size;
  }
  double loss = NAN;
  ddp_tensor x, y;
  DDP_TRY(ddp__train_batch_on_device(t, b, &x, &y));
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = ddp_pipeline_eval(ps->pp, first ? &x : NULL, last ? &y : NULL,
                                   last ? &out : NULL, &loss);
  ddp__train_autocast_exit(t);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "rank %d (stage %d, replica %d): pipeline evaluation", t->rank,
                          ps->stage_rank, t->replica);
  *counted = last;
  if (!last) return DDP_OK;
  *loss_rows = loss * (double)b->size;
  if (classify)
    *correct = ddp__train_count_correct(ddp_tensor_f32(&out), ddp_tensor_i64(&b->y), b->size,
                                        out.shape[1]);
  return DDP_OK;
}

/* This replica's test sums (loss * rows, correct, rows). */
static ddp_status pipeline_local_sums(ddp_trainer *t, double sums[3]) {
  return ddp__train_eval_sums(t, pipeline_eval_batch, state(t), sums);
}

/* ---- The figures ---------------------------------------------------------- */

/* Every pipeline rank's figures as replica 0 measured them, on every rank
 * (a sum over the group, where the other replicas add zeros). Collective. */
static ddp_status pipeline_figures(ddp_trainer *t, ddp_train_result *res) {
  pipeline_state *ps = state(t);
  const int P = t->o.pipeline->stages;
  enum { FIELDS = 4 };
  double *v = ddp_calloc((size_t)P * FIELDS, sizeof(double));
  ddp_train_stage_stats *out = ddp_calloc((size_t)P, sizeof *out);
  if (!v || !out) {
    ddp_free(v);
    ddp_free(out);
    return ddp_error(DDP_ERR_NOMEM, "out of memory for %d stages' figures", P);
  }
  if (t->replica == 0) {
    ddp_pipeline_stats st;
    ddp_pipeline_get_stats(ps->pp, &st);
    double *row = v + (size_t)ps->stage_rank * FIELDS;
    row[0] = st.idle_fraction_mean;
    row[1] = (double)st.activation_bytes_high_water;
    row[2] = (double)st.microbatch_activation_bytes;
    row[3] = st.live_high_water;
  }
  ddp_status s = ddp__train_sum(t, v, P * FIELDS);
  if (s != DDP_OK) {
    ddp_free(v);
    ddp_free(out);
    return ddp_error_wrap(s, "gathering the stages' figures");
  }
  for (int r = 0; r < P; r++) {
    const double *row = v + (size_t)r * FIELDS;
    out[r] = (ddp_train_stage_stats){.rank = r, .idle_fraction = row[0],
                                     .activation_bytes_high_water = (int64_t)row[1],
                                     .microbatch_activation_bytes = (int64_t)row[2],
                                     .live_high_water = (int32_t)row[3]};
  }
  ddp_free(v);
  res->stages = out;
  res->n_stages = P;
  return DDP_OK;
}

/* ---- The whole model: gathered for checkpoints and at the end ------------ */

/* The full model's parameter (by name) that stage parameter i is. */
static int full_index(ddp_trainer *t, int i) {
  ddp_tensor *p = ddp_model_find_param(t->model, ddp_model_param_name(t->step_model, i));
  DDP_ASSERT(p);
  return p->param_index;
}

/* The pipeline group for host buffers: itself, or its host group where it
 * is nccl (the unsplit model is host memory). */
static ddp_status pipe_host_group(ddp_trainer *t, ddp_process_group **out) {
  *out = state(t)->pipe_pg;
  return ddp_process_group_takes_host(*out) ? DDP_OK : ddp_process_group_host_group(*out, out);
}

/* Sums `n` values of the full model's layout (this rank's part filled, the
 * rest zero) over the pipeline group: x + 0 is exact, so every rank ends
 * with every stage's values. */
static ddp_status sum_parts(ddp_trainer *t, void *buf, size_t n, ddp_dtype dtype) {
  if (!n) return DDP_OK;
  ddp_process_group *hg;
  DDP_TRY(pipe_host_group(t, &hg));
  return ddp_allreduce(hg, buf, n, dtype, DDP_REDUCE_SUM);
}

/* Stage state entry k wherever it lives (a GPU's parameters and buffers,
 * the host's counters): *dev says where. */
static ddp_status stage_entry(ddp_trainer *t, int k, ddp_state_entry *e, ddp_device *dev) {
  bool on_device;
  DDP_TRY(ddp__model_state_entry_any(t->step_model, k, e, &on_device));
  *dev = on_device ? t->o.device : DDP_CPU;
  return DDP_OK;
}

/* Copies every stage's parameters, buffers and counters into the full
 * model (t->model) on every rank of the pipeline. Collective over it. */
static ddp_status gather_model(ddp_trainer *t) {
  ddp_model *full = t->model, *stage = t->step_model;
  const int64_t n = ddp_model_num_param_elements(full);
  float *params = ddp_model_params_flat(full);
  memset(params, 0, (size_t)n * sizeof(float));
  for (int i = 0; i < ddp_model_num_params(stage); i++) {
    const ddp_tensor *sp = ddp_model_param(stage, i);
    DDP_TRY(ddp_device_copy(DDP_CPU, params + ddp_model_param_offset(full, full_index(t, i)),
                       sp->device, sp->data, (size_t)sp->numel * sizeof(float)));
  }
  DDP_TRY(sum_parts(t, params, (size_t)n, DDP_FLOAT32));
  /* Buffers and counters by name: running statistics are float32 arrays
   * at their entry's place, num_batches_tracked an int64 scalar. */
  float *buffers = ddp_model_buffers_flat(full);
  int64_t *counters = ddp_model_counters(full);
  const int64_t nbuf = ddp_model_num_buffer_elements(full);
  const int nc = ddp_model_num_counters(full);
  if (nbuf) memset(buffers, 0, (size_t)nbuf * sizeof(float));
  if (nc) memset(counters, 0, (size_t)nc * sizeof(int64_t));
  for (int k = 0; k < ddp_model_state_count(stage); k++) {
    ddp_state_entry se, fe;
    ddp_device where;
    DDP_TRY(stage_entry(t, k, &se, &where));
    if (se.is_param) continue;
    DDP_TRY(ddp_model_state_find(full, se.name, &fe));
    DDP_TRY(ddp_device_copy(DDP_CPU, fe.data, where, se.data,
                       (size_t)se.numel * ddp_dtype_size(se.dtype)));
  }
  DDP_TRY(sum_parts(t, buffers, (size_t)nbuf, DDP_FLOAT32));
  DDP_TRY(sum_parts(t, counters, (size_t)nc, DDP_INT64));
  return DDP_OK;
}

/* The unsplit model's optimizer, made at the first save or resume: the
 * checkpoint's optimizer state is laid out by the full model's parameter
 * indices, whatever the split. */
static ddp_status full_optimizer(ddp_trainer *t) {
  pipeline_state *ps = state(t);
  if (ps->full_opt) return DDP_OK;
  ddp_optim_options oo = *ddp_optimizer_options(t->opt);
  oo.device = DDP_CPU; /* the unsplit model is host memory whatever the stages' device */
  ddp_status s = ddp_optimizer_create(&ps->full_opt, &oo, ddp_model_params_flat(t->model),
                                      ddp_model_grads_flat(t->model),
                                      (size_t)ddp_model_num_param_elements(t->model));
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "the unsplit model's optimizer state");
}

/* Every stage's optimizer state into the full optimizer (on every rank of
 * the pipeline). Collective over it. */
static ddp_status gather_optimizer(ddp_trainer *t) {
  pipeline_state *ps = state(t);
  DDP_TRY(full_optimizer(t));
  DDP_TRY(ddp_optimizer_set_lr(ps->full_opt, ddp_optimizer_get_lr(t->opt)));
  double has = ddp_optimizer_has_state(t->opt) ? 1 : 0;
  ddp_process_group *hg;
  DDP_TRY(pipe_host_group(t, &hg));
  DDP_TRY(ddp_allreduce(hg, &has, 1, DDP_FLOAT64, DDP_REDUCE_MIN));
  if (!has) return DDP_OK; /* before the first step: PyTorch's state is empty */
  const int64_t n = ddp_model_num_param_elements(t->model);
  for (size_t k = 0; k < ddp_optimizer_state_count(t->opt); k++) {
    ddp_optim_state st;
    DDP_TRY(ddp_optimizer_state_get(t->opt, k, &st));
    if (st.is_scalar) { /* Adam's step: the same on every stage */
      DDP_TRY(ddp_optimizer_state_load(ps->full_opt, st.name, st.data, 1));
      continue;
    }
    memset(ps->gather, 0, (size_t)n * sizeof(float));
    for (int i = 0; i < ddp_model_num_params(t->step_model); i++)
      memcpy(ps->gather + ddp_model_param_offset(t->model, full_index(t, i)),
             st.data + ddp_model_param_offset(t->step_model, i),
             (size_t)ddp_model_param(t->step_model, i)->numel * sizeof(float));
    DDP_TRY(sum_parts(t, ps->gather, (size_t)n, DDP_FLOAT32));
    DDP_TRY(ddp_optimizer_state_load(ps->full_opt, st.name, ps->gather, (size_t)n));
  }
  return DDP_OK;
}

/* After the last step: the caller's model gets the trained stages back. */
static ddp_status pipeline_finish(ddp_trainer *t) {
  ddp_status s = gather_model(t);
  if (s != DDP_OK) return ddp_error_wrap(s, "gathering the stages' parameters into the whole model");
  return DDP_OK;
}

/* Gathers model and optimizer state and has rank 0 write the whole
 * model's checkpoint. Collective. */
static ddp_status pipeline_save(ddp_trainer *t, const ddp_train_state *ts) {
  pipeline_state *ps = state(t);
  ddp_status s = gather_model(t);
  if (s == DDP_OK) s = gather_optimizer(t);
  if (s != DDP_OK) return ddp_error_wrap(s, "gathering the stages' parts for the checkpoint");
  if (t->rank == 0) {
    s = ddp_checkpoint_save(t->o.save_path, t->model, ps->full_opt, t->sched, ts,
                            t->o.checkpoint_meta, t->o.checkpoint_meta_count);
    if (s != DDP_OK) return ddp_error_wrap(s, "saving the checkpoint");
  }
  return DDP_OK;
}

/* The stage's part of a checkpoint loaded into the full model and
 * optimizer: parameters, buffers and counters by name, each optimizer
 * buffer's segments by parameter. Not collective. */
static ddp_status pipeline_resume(ddp_trainer *t, ddp_train_state *start) {
  pipeline_state *ps = state(t);
  DDP_TRY(full_optimizer(t));
  ddp_status s = ddp_checkpoint_load(t->o.resume_path, t->model, ps->full_opt, t->sched, start,
                                     t->o.checkpoint_meta, t->o.checkpoint_meta_count);
  if (s != DDP_OK) return ddp_error_wrap(s, "resuming");
  ddp_model *stage = t->step_model;
  for (int k = 0; k < ddp_model_state_count(stage); k++) {
    ddp_state_entry se, fe;
    ddp_device where;
    DDP_TRY(stage_entry(t, k, &se, &where));
    DDP_TRY(ddp_model_state_find(t->model, se.name, &fe));
    DDP_TRY(ddp_device_copy(where, se.data, DDP_CPU, fe.data,
                       (size_t)se.numel * ddp_dtype_size(se.dtype)));
  }
  DDP_TRY(ddp_optimizer_set_lr(t->opt, ddp_optimizer_get_lr(ps->full_opt)));
  if (!ddp_optimizer_has_state(ps->full_opt)) return DDP_OK;
  float *part = ps->gather; /* the stage's layout fits: it has fewer floats */
  for (size_t k = 0; k < ddp_optimizer_state_count(ps->full_opt); k++) {
    ddp_optim_state st;
    DDP_TRY(ddp_optimizer_state_get(ps->full_opt, k, &st));
    if (st.is_scalar) {
      DDP_TRY(ddp_optimizer_state_load(t->opt, st.name, st.data, 1));
      continue;
    }
    for (int i = 0; i < ddp_model_num_params(stage); i++)
      memcpy(part + ddp_model_param_offset(stage, i),
             st.data + ddp_model_param_offset(t->model, full_index(t, i)),
             (size_t)ddp_model_param(stage, i)->numel * sizeof(float));
    DDP_TRY(ddp_optimizer_state_load(t->opt, st.name, part,
                                     (size_t)ddp_model_num_param_elements(stage)));
  }
  return DDP_OK;
}

/* "the mesh: rank 0 is stage 0 of replica 0, ..." (a peer named by its
 * rank in an error is also named by its stage). */
static const char *pipeline_where(const ddp_trainer *t, char *buf, size_t bytes) {
  const int P = t->o.pipeline->stages;
  size_t at = (size_t)snprintf(buf, bytes, "the mesh:");
  if (t->size > 16) {
    snprintf(buf + (at < bytes ? at : bytes), at < bytes ? bytes - at : 0,
             " rank r is stage r %% %d of replica r / %d", P, P);
    return buf;
  }
  for (int r = 0; r < t->size && at < bytes; r++)
    at += (size_t)snprintf(buf + at, bytes - at, "%s rank %d is stage %d of replica %d",
                           r ? "," : "", r, r % P, r / P);
  return buf;
}

const ddp__train_strategy_ops ddp__train_pipeline = {
    .name = "pipeline",
    .kind = DDP_TRAIN_PIPELINE,
    .shards = "replicas",
    .shards_long = "data-parallel replicas",
    .places_model = true,
    .check = pipeline_check,
    .create = pipeline_create,
    .bind = pipeline_bind,
    .destroy = pipeline_destroy,
    .step = pipeline_step,
    .local_sums = pipeline_local_sums,
    .save = pipeline_save,
    .resume = pipeline_resume,
    .finish = pipeline_finish,
    .figures = pipeline_figures,
    .where = pipeline_where,
};
