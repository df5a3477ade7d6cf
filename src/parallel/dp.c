/* The data-parallel wrapper: construction (verify, broadcast, buckets) and
 * one iteration (pre-forward, backward with hook-driven bucket launches,
 * finalize). Buckets launch strictly in index order on every rank, so the
 * ranks' collectives match whatever order gradients become ready in. */
#include <math.h>
#include <string.h>

#include "nn/module.h" /* wrapped_by */
#include "parallel/dp_internal.h"
#include "tensor/tape.h"

ddp_dp_options ddp_dp_defaults(void) {
  ddp_dp_options o;
  memset(&o, 0, sizeof o);
  o.bucket_cap_mb = 25.0;
  o.first_bucket_mb = 1.0;
  o.broadcast_buffers = true;
  o.find_unused_parameters = false;
  o.relayout = true;
  return o;
}

void ddp_dp_destroy(ddp_dp *dp) {
  if (!dp) return;
  if (dp->marked_model) dp->model->wrapped_by = NULL;
  if (dp->tape) ddp_tape_set_grad_hook(dp->tape, NULL, NULL);
  if (dp->works)
    for (int b = 0; b < dp->n_params; b++) ddp_work_free(dp->works[b]);
  ddp_free(dp->order);
  ddp_free(dp->bucket_of);
  ddp_free(dp->buckets);
  ddp_free(dp->trace);
  if (dp->scratch_dev)
    ddp_tensor_destroy(dp->scratch_dev);
  else
    ddp_free(dp->scratch);
  ddp_free(dp->param_ready);
  ddp_free(dp->bucket_pending);
  ddp_free(dp->works);
  ddp_free(dp->ready_order);
  ddp_free(dp->got_grad);
  ddp_free(dp->first_got_grad);
  ddp_free(dp->join_gather);
  ddp_free(dp);
}

static ddp_status check_options(const ddp_dp_options *o) {
  if (!(o->bucket_cap_mb > 0) || !(o->first_bucket_mb > 0))
    return ddp_error(DDP_ERR_INVALID,
                     "ddp: bucket_cap_mb (%g) and first_bucket_mb (%g) must be > 0",
                     o->bucket_cap_mb, o->first_bucket_mb);
  return DDP_OK;
}

ddp_status ddp_dp_create(ddp_dp **out, ddp_model *model, ddp_process_group *pg,
                         const ddp_dp_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp: create: out is NULL");
  *out = NULL;
  if (!model || !pg) return ddp_error(DDP_ERR_INVALID, "ddp: create: model and group are required");
  if (!ddp_model_params_flat(model) || ddp_model_num_params(model) < 0)
    return ddp_error(DDP_ERR_STATE, "ddp: create: the model is not finalized");
  ddp_dp_options o = options ? *options : ddp_dp_defaults();
  DDP_TRY(check_options(&o));
  /* DataParallel's replicas read this model's parameters in place; a
   * relayout would move them under them (and each would reduce alone). */
  if (model->wrapped_by && strcmp(model->wrapped_by, "DataParallel") == 0)
    return ddp_error(DDP_ERR_STATE, "ddp: create: the model is already wrapped by DataParallel; "
                                    "wrap the model itself, once");

  ddp_dp *dp = ddp_calloc(1, sizeof *dp);
  if (!dp) return ddp_error(DDP_ERR_NOMEM, "ddp: create: out of memory");
  dp->model = model;
  dp->pg = pg;
  dp->loss_scale = 1.0f;
  dp->options = o;
  dp->rank = ddp_process_group_rank(pg);
  dp->world = ddp_process_group_size(pg);
  int n = dp->n_params = ddp_model_num_params(model);
  size_t slots = (size_t)(n ? n : 1);
  size_t elems = (size_t)ddp_model_num_param_elements(model);
  dp->order = ddp_calloc(slots, sizeof(int));
  dp->bucket_of = ddp_calloc(slots, sizeof(int));
  ddp_status s = DDP_OK;
  dp->buckets = ddp_calloc(slots, sizeof(ddp_dp_bucket));
  dp->trace = ddp_calloc(slots, sizeof(ddp_dp_bucket_trace));
  dp->device = ddp_model_device(model);
  if (dp->device.type == DDP_DEVICE_CPU) {
    dp->scratch = ddp_calloc(elems ? elems : 1, sizeof(uint16_t));
  } else {
    /* The compressed copies beside the gradients on the GPU (2 bytes per
     * gradient, as float32 pairs); the hooks convert with the device's
     * kernels, so no gradient crosses to the host. */
    dp->kernels = ddp__basic_kernels_for(dp->device);
    int64_t pairs = (int64_t)(elems / 2 + 1);
    if (!dp->kernels) {
      char dev[DDP_DEVICE_STR_BYTES];
      s = ddp_error(DDP_ERR_UNSUPPORTED, "ddp: create: this build has no kernels for %s",
                    ddp_device_str(dp->device, dev, sizeof dev));
      goto err;
    }
    s = ddp_tensor_create_on(&dp->scratch_dev, DDP_FLOAT32, 1, &pairs, dp->device);
    if (s != DDP_OK) {
      ddp_error_wrap(s, "ddp: create: device memory for compressed gradients");
      goto err;
    }
    dp->scratch = dp->scratch_dev->data;
  }
  dp->param_ready = ddp_calloc(slots, sizeof(bool));
  dp->bucket_pending = ddp_calloc(slots, sizeof(int));
  dp->works = ddp_calloc(slots, sizeof(ddp_work *));
  dp->ready_order = ddp_calloc(slots, sizeof(int));
  dp->got_grad = ddp_calloc(slots, sizeof(bool));
  dp->first_got_grad = ddp_calloc(slots, sizeof(bool));
  dp->join_gather = ddp_calloc((size_t)dp->world * 2, sizeof(int32_t));
  if (!dp->order || !dp->bucket_of || !dp->buckets || !dp->trace || !dp->scratch ||
      !dp->param_ready || !dp->bucket_pending || !dp->works || !dp->ready_order ||
      !dp->got_grad || !dp->first_got_grad || !dp->join_gather) {
    s = ddp_error(DDP_ERR_NOMEM, "ddp: create: out of memory for %d parameters", n);
    goto err;
  }
  s = ddp_process_group_host_group(pg, &dp->host_pg);
  if (s != DDP_OK) {
    ddp_error_wrap(s, "ddp: create (rank %d)", dp->rank);
    goto err;
  }
  dp->forward_param_sync = true;
  dp->divisor = dp->world;
  dp->hook_kind = DDP_DP_HOOK_ALLREDUCE;
  dp->hook = ddp__dp_builtin_hook(dp, DDP_DP_HOOK_ALLREDUCE);

  s = ddp__dp_verify_params(dp);
  if (s != DDP_OK) goto err;
  s = ddp__dp_broadcast_state(dp, 0, true);
  if (s != DDP_OK) {
    ddp_error_wrap(s, "ddp: create: broadcasting the model from rank 0");
    goto err;
  }
  /* Reverse registration order: the last layers' gradients come first. */
  for (int k = 0; k < n; k++) dp->order[k] = n - 1 - k;
  ddp__dp_assign_buckets(dp);
  s = ddp__dp_reserve_works(dp);
  if (s != DDP_OK) goto err;
  ddp__dp_log_layout(dp, "created");
  /* With parameters that may or may not get a gradient the ready order can
   * change from one iteration to the next, unless the graph is static. */
  if (!o.relayout || (o.find_unused_parameters && !o.static_graph)) dp->relayout_done = true;
  if (!model->wrapped_by) {
    model->wrapped_by = "DistributedDataParallel";
    dp->marked_model = true;
  }
  /* nn's relayout moves host memory only (ddp_model_relayout): on a GPU the
   * buckets keep registration order, which only costs overlap. */
  if (dp->device.type != DDP_DEVICE_CPU) dp->relayout_done = true;
  *out = dp;
  return DDP_OK;
err:
  ddp_dp_destroy(dp);
  return s;
}

void ddp_dp_set_optimizer(ddp_dp *dp, ddp_optimizer *opt) { dp->opt = opt; }

ddp_status ddp_dp_set_comm_hook(ddp_dp *dp, ddp_dp_hook_kind kind) {
  if ((unsigned)kind >= DDP_DP_HOOK_KIND_COUNT)
    return ddp_error(DDP_ERR_INVALID, "ddp: unknown communication hook kind %d", (int)kind);
  if (dp->armed) return ddp_error(DDP_ERR_STATE, "ddp: set_comm_hook during a backward");
  dp->hook_kind = kind;
  dp->hook = ddp__dp_builtin_hook(dp, kind);
  return DDP_OK;
}

ddp_status ddp_dp_set_comm_hook_fn(ddp_dp *dp, const ddp_dp_comm_hook *hook) {
  if (dp->armed) return ddp_error(DDP_ERR_STATE, "ddp: set_comm_hook during a backward");
  if (!hook) return ddp_dp_set_comm_hook(dp, DDP_DP_HOOK_ALLREDUCE);
  if (!hook->launch)
    return ddp_error(DDP_ERR_INVALID, "ddp: a communication hook needs a launch function");
  dp->hook_kind = DDP_DP_HOOK_KIND_COUNT; /* a user's */
  dp->hook = *hook;
  return DDP_OK;
}

void ddp_dp_set_no_sync(ddp_dp *dp, bool no_sync) { dp->no_sync = no_sync; }

void ddp_dp_set_loss_scale(ddp_dp *dp, float scale) {
  DDP_ASSERT(isfinite(scale) && scale > 0);
  dp->loss_scale = scale;
}

ddp_status ddp__dp_broadcast_state(ddp_dp *dp, int root, bool params) {
  if (dp->world == 1) return DDP_OK;
  ddp_model *m = dp->model;
  if (params && ddp_model_num_param_elements(m) > 0)
    DDP_TRY(ddp_broadcast(dp->pg, ddp_model_params_flat(m),
                          (size_t)ddp_model_num_param_elements(m), DDP_FLOAT32, root));
  if (ddp_model_num_buffer_elements(m) > 0)
    DDP_TRY(ddp_broadcast(dp->pg, ddp_model_buffers_flat(m),
                          (size_t)ddp_model_num_buffer_elements(m), DDP_FLOAT32, root));
  /* The counters (num_batches_tracked) stay in host memory on every device. */
  if (ddp_model_num_counters(m) > 0)
    DDP_TRY(ddp_broadcast(dp->host_pg, ddp_model_counters(m), (size_t)ddp_model_num_counters(m),
                          DDP_INT64, root));
  return DDP_OK;
}

/* ---- Forward -------------------------------------------------------------- */

/* Join's per-iteration count: every rank contributes [training, syncing];
 * ranks that joined contribute zeros from ddp_dp_join's loop. */
ddp_status ddp__dp_join_count(ddp_dp *dp, bool training, bool syncing, int *n_training,
                              int *n_syncing, int *highest_training);

/* grad_enabled: whether a backward may follow this forward (PyTorch's
 * torch.is_grad_enabled()). Only then does this rank count as syncing in
 * join's census, so a joined rank shadows no gradient allreduce for an
 * evaluation forward; and, as PyTorch's require_forward_param_sync, only
 * then does the next forward broadcast buffers. */
static ddp_status pre_forward(ddp_dp *dp, bool grad_enabled) {
  bool syncing = grad_enabled && !dp->no_sync;
  if (dp->armed)
    return ddp_error(DDP_ERR_STATE, "ddp: forward while a backward is unfinished "
                                    "(call ddp_dp_finalize_backward first)");
  dp->divisor = dp->world;
  dp->buffer_root = 0;
  if (dp->join_enabled) {
    int n_training, n_syncing, highest;
    DDP_TRY(ddp__dp_join_count(dp, true, syncing, &n_training, &n_syncing, &highest));
    if (!dp->join_divide_initial) dp->divisor = n_training;
    dp->buffer_root = highest; /* PyTorch's _find_common_rank over the ranks still training */
  }
  if (dp->options.broadcast_buffers && dp->forward_param_sync) {
    ddp_status s = ddp__dp_broadcast_state(dp, dp->buffer_root, false);
    if (s != DDP_OK) return ddp_error_wrap(s, "ddp: broadcasting buffers in forward");
  }
  dp->forward_param_sync = syncing;
  return DDP_OK;
}

ddp_status ddp_dp_pre_forward(ddp_dp *dp) { return pre_forward(dp, true); }

ddp_status ddp_dp_forward(ddp_dp *dp, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  DDP_TRY(pre_forward(dp, ddp_tape_grad_enabled(tape)));
  return ddp_model_forward(dp->model, tape, x, out);
}

/* ---- Backward ------------------------------------------------------------- */

static void launch_bucket(ddp_dp *dp, int b) {
  ddp_dp_bucket *bucket = &dp->buckets[b];
  ddp_dp_bucket_trace *tr = &dp->trace[b];
  tr->launch_ns = ddp_time_ns();
  tr->params_not_ready = dp->n_params - dp->n_ready;
  tr->hook_calls_before = dp->hook_calls;
  tr->first_param = bucket->params[0];
  tr->numel = bucket->numel;
  bucket->divisor = dp->divisor;
  bucket->last = b == dp->n_buckets - 1; /* launched in index order: all are ready */
  dp->works[b] = NULL;
  if (dp->launch_error != DDP_OK) return;
  /* A group of one has nothing to reduce; the default hook's average is the
   * gradient itself. Other hooks still run (compression changes the values). */
  if (dp->world == 1 && dp->hook_kind == DDP_DP_HOOK_ALLREDUCE) return;
  ddp_status s = dp->hook.launch(dp->hook.state, dp->pg, bucket, &dp->works[b]);
  if (!dp->works[b]) tr->done_ns = ddp_time_ns(); /* reduced on this thread */
  if (s != DDP_OK) {
    dp->launch_error = ddp_error_wrap(s, "ddp: launching bucket %d", b);
    dp->works[b] = NULL;
  }
}

void ddp__dp_mark_ready(ddp_dp *dp, int i) {
  if (dp->param_ready[i]) return;
  dp->param_ready[i] = true;
  dp->n_ready++;
  dp->ready_order[dp->n_ready_order++] = i;
  int b = dp->bucket_of[i];
  if (--dp->bucket_pending[b] == 0) dp->trace[b].ready_ns = ddp_time_ns();
  /* In index order on every rank: a bucket that completes early waits for
   * the ones before it, so every rank issues the same allreduce sequence. */
  while (dp->next_launch < dp->n_buckets && dp->bucket_pending[dp->next_launch] == 0)
    launch_bucket(dp, dp->next_launch++);
}

void ddp__dp_grad_ready(ddp_tensor *param, void *user) {
  ddp_dp *dp = user;
  int i = param->param_index;
  /* Parameters of another model on the same tape are not ours. */
  if (i < 0 || i >= dp->n_params || ddp_model_param(dp->model, i) != param) return;
  dp->hook_calls++;
  dp->got_grad[i] = true;
  ddp__dp_mark_ready(dp, i);
}

void ddp__dp_arm(ddp_dp *dp, bool syncing) {
  dp->armed = true;
  dp->syncing = syncing;
  dp->n_ready = 0;
  dp->n_ready_order = 0;
  dp->next_launch = 0;
  dp->hook_calls = 0;
  dp->traced_buckets = dp->n_buckets;
  dp->launch_error = DDP_OK;
  for (int i = 0; i < dp->n_params; i++) dp->param_ready[i] = dp->got_grad[i] = false;
  for (int b = 0; b < dp->n_buckets; b++) {
    dp->bucket_pending[b] = dp->buckets[b].n_params;
    dp->works[b] = NULL;
    memset(&dp->trace[b], 0, sizeof dp->trace[b]);
  }
}

ddp_status ddp_dp_prepare_backward(ddp_dp *dp, ddp_tape *tape) {
  if (dp->armed)
    return ddp_error(DDP_ERR_STATE, "ddp: prepare_backward twice without finalize_backward");
  ddp__dp_arm(dp, !dp->no_sync);
  dp->tape = tape;
  if (!dp->syncing) return DDP_OK;
  ddp_tape_set_grad_hook(tape, ddp__dp_grad_ready, dp);
  /* find_unused_parameters: a parameter no recorded op uses gets no hook;
   * mark it ready now (PyTorch marks it at the end of forward) so its bucket
   * need not wait for the end of backward. Its gradient is reduced as it is. */
  if (dp->options.find_unused_parameters || dp->options.static_graph)
    for (int k = 0; k < dp->n_params; k++) {
      int i = dp->order[k];
      if (ddp__tape_leaf_pending(tape, ddp_model_param(dp->model, i)) == 0)
        ddp__dp_mark_ready(dp, i);
    }
  return DDP_OK;
}

ddp_status ddp__dp_abandon_backward(ddp_dp *dp, ddp_tape *tape, ddp_status failure) {
  ddp_tape_set_grad_hook(tape, NULL, NULL);
  dp->tape = NULL;
  (void)ddp__dp_complete(dp);
  dp->armed = false;
  return failure;
}

ddp_status ddp__dp_complete(ddp_dp *dp) {
  ddp_status first = dp->launch_error;
  for (int b = 0; b < dp->next_launch; b++) {
    if (dp->works[b]) {
      dp->trace[b].wait_start_ns = ddp_time_ns();
      ddp_status s = ddp_work_wait(dp->works[b], -1);
      dp->trace[b].done_ns = ddp_time_ns();
      ddp_work_free(dp->works[b]);
      dp->works[b] = NULL;
      if (s != DDP_OK && first == DDP_OK)
        first = ddp_error_wrap(s, "ddp: bucket %d of %d (%zu gradients)", b, dp->n_buckets,
                               dp->buckets[b].numel);
    }
    if (first == DDP_OK && dp->hook.finish &&
        !(dp->world == 1 && dp->hook_kind == DDP_DP_HOOK_ALLREDUCE)) {
      ddp_status s = dp->hook.finish(dp->hook.state, &dp->buckets[b]);
      if (s != DDP_OK) first = ddp_error_wrap(s, "ddp: finishing bucket %d", b);
    }
  }
  return first;
}

/* static_graph: the first synced backward records which parameters got a
 * gradient; every later one must give the same set. Checked once the buckets
 * are reduced, so nothing is in flight; every rank with the same graph
 * change fails alike. */
static ddp_status check_static_graph(ddp_dp *dp) {
  if (!dp->graph_recorded) {
    memcpy(dp->first_got_grad, dp->got_grad, (size_t)dp->n_params * sizeof(bool));
    dp->graph_recorded = true;
    return DDP_OK;
  }
  for (int i = 0; i < dp->n_params; i++) {
    if (dp->got_grad[i] == dp->first_got_grad[i]) continue;
    return ddp_error(DDP_ERR_STATE,
                     "ddp (rank %d): static_graph: parameter '%s' (index %d) %s in synced "
                     "backward %lld but %s in the first; the graph changed, which "
                     "static_graph rules out: create the wrapper without static_graph (and with "
                     "find_unused_parameters = true if the parameters in use vary)",
                     dp->rank, ddp_model_param_name(dp->model, i), i,
                     dp->got_grad[i] ? "got a gradient" : "got no gradient",
                     (long long)dp->iterations + 1,
                     dp->first_got_grad[i] ? "got one" : "none");
  }
  return DDP_OK;
}

ddp_status ddp_dp_finalize_backward(ddp_dp *dp) {
  if (!dp->armed)
    return ddp_error(DDP_ERR_STATE, "ddp: finalize_backward without prepare_backward");
  if (dp->tape) ddp_tape_set_grad_hook(dp->tape, NULL, NULL);
  dp->tape = NULL;
  if (!dp->syncing) {
    dp->armed = false;
    return DDP_OK;
  }
  /* Parameters whose hook never fired: used by no op that reaches the loss. */
  int unused = -1, n_unused = 0;
  for (int k = 0; k < dp->n_params; k++) {
    int i = dp->order[k];
    if (dp->param_ready[i]) continue;
    if (dp->options.find_unused_parameters || dp->options.static_graph) {
      ddp__dp_mark_ready(dp, i);
    } else {
      if (unused < 0 || i < unused) unused = i;
      n_unused++;
    }
  }
  ddp_status s = ddp__dp_complete(dp);
  dp->armed = false;
  if (unused >= 0) {
    /* Buckets from the unused parameter's on never launched, on any rank
     * with the same model: nothing is left in flight. */
    return ddp_error(DDP_ERR_STATE,
                     "ddp (rank %d): parameter '%s' (index %d)%s received no gradient in this "
                     "backward pass; every parameter must take part in computing the loss, or "
                     "create the wrapper with find_unused_parameters = true",
                     dp->rank, ddp_model_param_name(dp->model, unused), unused,
                     n_unused > 1 ? " and others" : "");
  }
  DDP_TRY(s);
  if (dp->options.static_graph) DDP_TRY(check_static_graph(dp));
  dp->iterations++;
  if (!dp->relayout_done) DDP_TRY(ddp__dp_maybe_relayout(dp));
  dp->finalize_end_ns = ddp_time_ns();
  return DDP_OK;
}

ddp_status ddp_dp_backward(ddp_dp *dp, ddp_tape *tape, ddp_tensor *loss) {
  DDP_TRY(ddp_dp_prepare_backward(dp, tape));
  dp->backward_start_ns = ddp_time_ns();
  /* Seed 1 through ddp_backward (its check of the loss's shape), else the
   * loss scale as the seed of the same walk. */
  ddp_status s = dp->loss_scale == 1.0f || loss->numel != 1 || loss->dtype != DDP_FLOAT32
                     ? ddp_backward(tape, loss)
                     : ddp__backward_from(tape, loss, &dp->loss_scale);
  dp->backward_end_ns = ddp_time_ns();
  if (s != DDP_OK) return ddp__dp_abandon_backward(dp, tape, s);
  return ddp_dp_finalize_backward(dp);
}

ddp_status ddp_dp_reduce_grads(ddp_dp *dp) {
  if (dp->armed)
    return ddp_error(DDP_ERR_STATE, "ddp: reduce_grads between prepare_backward and finalize_backward");
  ddp__dp_arm(dp, true);
  /* In the bucket order a backward would make ready, every rank alike. */
  for (int k = 0; k < dp->n_params; k++) {
    int i = dp->order[k];
    dp->got_grad[i] = true;
    ddp__dp_mark_ready(dp, i);
  }
  ddp_status s = ddp__dp_complete(dp);
  dp->armed = false;
  DDP_TRY(s);
  dp->iterations++;
  dp->finalize_end_ns = ddp_time_ns();
  return DDP_OK;
}

/* ---- Introspection --------------------------------------------------------- */

int ddp_dp_num_buckets(const ddp_dp *dp) { return dp->n_buckets; }

const ddp_dp_bucket *ddp_dp_bucket_get(const ddp_dp *dp, int index) {
  return index >= 0 && index < dp->n_buckets ? &dp->buckets[index] : NULL;
}

void ddp_dp_get_trace(const ddp_dp *dp, ddp_dp_trace *out) {
  memset(out, 0, sizeof *out);
  out->backward_start_ns = dp->backward_start_ns;
  out->backward_end_ns = dp->backward_end_ns;
  out->finalize_end_ns = dp->finalize_end_ns;
  out->n_buckets = dp->traced_buckets;
  out->buckets = dp->trace;
  out->relaid_out = dp->relaid_out;
  out->iterations = dp->iterations;
}
