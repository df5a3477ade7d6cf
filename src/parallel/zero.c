/* ZeRO stages 1 and 2 over the data-parallel wrapper (include/ddp/zero.h,
 * docs/sharding.md): the ranks' ranges of the flat buffers, the stage-2
 * communication hook that reduces each bucket to the owners of its floats,
 * the parameters' gather after the update, the optimizer state's move at
 * the wrapper's relayout, and the state's gather and load for checkpoints.
 * Same layer as the wrapper: it reads the wrapper's internals (whether its
 * relayout is still to come) rather than widen the wrapper's API. */
#include <math.h>
#include <string.h>

#include "ddp/zero.h"
#include "parallel/dp_internal.h"

struct ddp_zero {
  ddp_dp *dp;
  ddp_model *model;
  ddp_process_group *pg;
  ddp_optimizer *opt; /* narrowed to [lo[rank], lo[rank + 1]) */
  int stage, rank, world;
  int64_t n;          /* floats in each flat buffer */
  int64_t *lo;        /* (world + 1) range starts; lo[world] = n */
  int n_params;
  int64_t *offsets;   /* (n_params) parameter offsets as the state was laid out */
  bool params_stale;  /* a backward ran since the last gather: an update may follow */
  bool relayout_seen; /* the wrapper's relayout has been followed */
  /* Stage 2: per bucket, the reduces launched before the one whose work
   * went back to the wrapper (done when it is: one queue, in order). */
  ddp_work **pending;   /* (n_params * world) */
  int *n_pending;       /* (n_params) */
  bool *bucket_full;    /* (n_params) this backward's bucket was allreduced whole */
};

ddp_zero_options ddp_zero_defaults(int stage) {
  ddp_zero_options o;
  memset(&o, 0, sizeof o);
  o.stage = stage;
  o.dp = ddp_dp_defaults();
  return o;
}

ddp_dp *ddp_zero_dp(ddp_zero *z) { return z->dp; }
int ddp_zero_stage(const ddp_zero *z) { return z->stage; }

void ddp_zero_range(const ddp_zero *z, int rank, int64_t *offset, int64_t *numel) {
  *offset = z->lo[rank];
  *numel = z->lo[rank + 1] - z->lo[rank];
}

void ddp_zero_set_no_sync(ddp_zero *z, bool no_sync) { ddp_dp_set_no_sync(z->dp, no_sync); }

static void free_pending(ddp_zero *z, int b) {
  ddp_work **w = z->pending + (size_t)b * (size_t)z->world;
  for (int k = 0; k < z->n_pending[b]; k++) {
    (void)ddp_work_wait(w[k], -1);
    ddp_work_free(w[k]);
    w[k] = NULL;
  }
  z->n_pending[b] = 0;
}

void ddp_zero_destroy(ddp_zero *z) {
  if (!z) return;
  if (z->pending)
    for (int b = 0; b < z->n_params; b++) free_pending(z, b);
  ddp_dp_destroy(z->dp);
  ddp_free(z->lo);
  ddp_free(z->offsets);
  ddp_free(z->pending);
  ddp_free(z->n_pending);
  ddp_free(z->bucket_full);
  ddp_free(z);
}

/* ---- Stage 2: reduce each bucket to its floats' owners --------------------
 * A bucket [a, b) of the gradient buffer meets the ranges of one or more
 * ranks; each meeting is one in-place reduce (sum) to that range's owner,
 * so every float is summed once, on the rank that steps it: the traffic of
 * a reduce-scatter, with ranges that need not split the bucket evenly.
 * Until the wrapper has made its relayout (after the first synced
 * backward) the bucket is allreduced whole instead: the relayout moves
 * gradients between ranges, and after it each rank's new range must hold
 * averaged values. */

static ddp_status stage2_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                                ddp_work **work) {
  ddp_zero *z = state;
  const int b = bucket->index;
  *work = NULL;
  free_pending(z, b); /* left by a failed backward */
  z->bucket_full[b] = !z->dp->relayout_done;
  if (z->bucket_full[b]) {
    if (bucket->last) return ddp_allreduce(pg, bucket->grads, bucket->numel, DDP_FLOAT32, DDP_REDUCE_SUM);
    return ddp_allreduce_async(pg, bucket->grads, bucket->numel, DDP_FLOAT32, DDP_REDUCE_SUM, work);
  }
  float *flat = ddp_model_grads_flat(z->model);
  const int64_t a = bucket->offset, e = bucket->offset + (int64_t)bucket->numel;
  ddp_work **pend = z->pending + (size_t)b * (size_t)z->world;
  ddp_work *prev = NULL;
  for (int r = 0; r < z->world; r++) {
    int64_t from = a > z->lo[r] ? a : z->lo[r], to = e < z->lo[r + 1] ? e : z->lo[r + 1];
    if (from >= to) continue;
    if (bucket->last) {
      DDP_TRY(ddp_reduce(pg, flat + from, (size_t)(to - from), DDP_FLOAT32, DDP_REDUCE_SUM, r));
      continue;
    }
    if (prev) pend[z->n_pending[b]++] = prev;
    prev = NULL;
    DDP_TRY(ddp_reduce_async(pg, flat + from, (size_t)(to - from), DDP_FLOAT32, DDP_REDUCE_SUM, r,
                             &prev));
  }
  *work = prev;
  return DDP_OK;
}

/* The same division as the wrapper's float32 hook (g / d, rounded once),
 * on the floats this rank owns, or on the whole bucket when it was
 * allreduced whole. */
static ddp_status stage2_finish(void *state, ddp_dp_bucket *bucket) {
  ddp_zero *z = state;
  const int b = bucket->index;
  free_pending(z, b);
  int64_t from = bucket->offset, to = bucket->offset + (int64_t)bucket->numel;
  if (!z->bucket_full[b]) {
    if (from < z->lo[z->rank]) from = z->lo[z->rank];
    if (to > z->lo[z->rank + 1]) to = z->lo[z->rank + 1];
  }
  const float d = (float)bucket->divisor;
  if (d == 1.0f || from >= to) return DDP_OK;
  float *restrict g = ddp_model_grads_flat(z->model) + from;
  const size_t n = (size_t)(to - from);
  for (size_t i = 0; i < n; i++) g[i] /= d;
  return DDP_OK;
}

/* ---- Construction ------------------------------------------------------------ */

static void snapshot_offsets(ddp_zero *z) {
  for (int i = 0; i < z->n_params; i++) z->offsets[i] = ddp_model_param_offset(z->model, i);
}

ddp_status ddp_zero_create(ddp_zero **out, ddp_model *model, ddp_process_group *pg,
                           ddp_optimizer *opt, const ddp_zero_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "zero: create: out is NULL");
  *out = NULL;
  if (!model || !pg || !opt)
    return ddp_error(DDP_ERR_INVALID, "zero: create: model, group and optimizer are required");
  ddp_zero_options o = options ? *options : ddp_zero_defaults(1);
  if (o.stage != 1 && o.stage != 2)
    return ddp_error(DDP_ERR_INVALID, "zero: stage %d: stages 1 and 2 are implemented", o.stage);
  const int64_t n = ddp_model_num_param_elements(model);
  const int world = ddp_process_group_size(pg), rank = ddp_process_group_rank(pg);
  if (ddp_optimizer_options(opt)->device.type != DDP_DEVICE_CPU ||
      ddp_optimizer_numel(opt) != (size_t)n)
    return ddp_error(DDP_ERR_INVALID,
                     "zero (rank %d): the optimizer covers %zu floats, the model's flat buffers "
                     "%lld: create it over ddp_model_params_flat / ddp_model_grads_flat, on "
                     "the CPU", rank, ddp_optimizer_numel(opt), (long long)n);
  if (n < world)
    return ddp_error(DDP_ERR_INVALID, "zero: the model has %lld floats, fewer than the %d ranks",
                     (long long)n, world);

  ddp_zero *z = ddp_calloc(1, sizeof *z);
  if (!z) return ddp_error(DDP_ERR_NOMEM, "zero: create: out of memory");
  z->model = model;
  z->pg = pg;
  z->opt = opt;
  z->stage = o.stage;
  z->rank = rank;
  z->world = world;
  z->n = n;
  z->n_params = ddp_model_num_params(model);
  size_t slots = (size_t)(z->n_params ? z->n_params : 1);
  z->lo = ddp_calloc((size_t)world + 1, sizeof(int64_t));
  z->offsets = ddp_calloc(slots, sizeof(int64_t));
  z->pending = ddp_calloc(slots * (size_t)world, sizeof(ddp_work *));
  z->n_pending = ddp_calloc(slots, sizeof(int));
  z->bucket_full = ddp_calloc(slots, sizeof(bool));
  ddp_status s;
  if (!z->lo || !z->offsets || !z->pending || !z->n_pending || !z->bucket_full) {
    s = ddp_error(DDP_ERR_NOMEM, "zero: create: out of memory for %d ranks", world);
    goto err;
  }
  /* Balanced: sizes differ by at most one float. */
  for (int r = 0; r <= world; r++) z->lo[r] = n * r / world;
  snapshot_offsets(z);
  s = ddp_dp_create(&z->dp, model, pg, &o.dp);
  if (s != DDP_OK) goto err;
  if (z->stage == 2) {
    ddp_dp_comm_hook h = {stage2_launch, stage2_finish, z};
    s = ddp_dp_set_comm_hook_fn(z->dp, &h);
    if (s != DDP_OK) goto err;
    /* A bucket meets at most world ranges: room for every reduce in flight. */
    s = ddp_process_group_reserve_works(pg, ddp_dp_num_buckets(z->dp) + world + 2);
    if (s != DDP_OK) goto err;
  }
  s = ddp_optimizer_narrow(opt, (size_t)z->lo[rank], (size_t)(z->lo[rank + 1] - z->lo[rank]));
  if (s != DDP_OK) goto err;
  if (z->dp->relayout_done) z->relayout_seen = true; /* none will come */
  *out = z;
  return DDP_OK;
err:
  ddp_zero_destroy(z);
  return ddp_error_wrap(s, "zero: create (rank %d)", rank);
}

/* ---- Following the wrapper's relayout ---------------------------------------
 * The relayout (once, after the first synced backward) moves parameters
 * within the flat buffers; the ranges stay where they are, so the floats of
 * a range now belong to other parameters. State without values needs
 * nothing. State with values (a resumed run) is put together whole in a
 * temporary on every rank (each range broadcast from its owner), moved as
 * the parameters moved, and each rank takes its new range: once per run,
 * allocating n floats twice. */
static ddp_status move_state(ddp_zero *z) {
  const size_t n = (size_t)z->n;
  float *whole = ddp_alloc(2 * n * sizeof(float));
  if (!whole) return ddp_error(DDP_ERR_NOMEM, "zero: relayout: cannot allocate %zu floats", 2 * n);
  float *moved = whole + n;
  const int64_t own = z->lo[z->rank], own_n = z->lo[z->rank + 1] - own;
  ddp_status s = DDP_OK;
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt) && s == DDP_OK; k++) {
    ddp_optim_state st;
    s = ddp_optimizer_state_get(z->opt, k, &st);
    if (s != DDP_OK || st.is_scalar) continue;
    memcpy(whole + own, st.data, (size_t)own_n * sizeof(float));
    for (int r = 0; r < z->world && s == DDP_OK; r++)
      s = ddp_broadcast(z->pg, whole + z->lo[r], (size_t)(z->lo[r + 1] - z->lo[r]), DDP_FLOAT32, r);
    if (s != DDP_OK) break;
    for (int i = 0; i < z->n_params; i++)
      memcpy(moved + ddp_model_param_offset(z->model, i), whole + z->offsets[i],
             (size_t)ddp_model_param(z->model, i)->numel * sizeof(float));
    s = ddp_optimizer_state_load(z->opt, st.name, moved + own, (size_t)own_n);
  }
  ddp_free(whole);
  if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): moving the optimizer state at the relayout", z->rank);
  return DDP_OK;
}

static ddp_status follow_relayout(ddp_zero *z) {
  if (z->relayout_seen || !z->dp->relayout_done) return DDP_OK;
  z->relayout_seen = true;
  if (!z->dp->relaid_out) return DDP_OK; /* the layout was kept */
  if (ddp_optimizer_has_state(z->opt)) DDP_TRY(move_state(z));
  snapshot_offsets(z);
  if (z->stage == 2)
    DDP_TRY(ddp_process_group_reserve_works(z->pg, ddp_dp_num_buckets(z->dp) + z->world + 2));
  return DDP_OK;
}

/* ---- One iteration --------------------------------------------------------- */

ddp_status ddp_zero_sync_params(ddp_zero *z) {
  if (!z->params_stale) return DDP_OK;
  float *p = ddp_model_params_flat(z->model);
  for (int r = 0; r < z->world; r++) {
    ddp_status s = ddp_broadcast(z->pg, p + z->lo[r], (size_t)(z->lo[r + 1] - z->lo[r]),
                                 DDP_FLOAT32, r);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "zero (rank %d): gathering the parameters of rank %d's range", z->rank, r);
  }
  z->params_stale = false;
  return DDP_OK;
}

ddp_status ddp_zero_forward(ddp_zero *z, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  DDP_TRY(ddp_zero_sync_params(z));
  return ddp_dp_forward(z->dp, tape, x, out);
}

ddp_status ddp_zero_backward(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  bool syncing = !z->dp->no_sync;
  DDP_TRY(ddp_dp_backward(z->dp, tape, loss));
  if (!syncing) return DDP_OK;
  z->params_stale = true;
  return follow_relayout(z);
}

ddp_status ddp_zero_clip_grad_norm(ddp_zero *z, double max_norm, double *total_norm) {
  if (!(max_norm >= 0) || isinf(max_norm))
    return ddp_error(DDP_ERR_INVALID, "zero: clip_grad_norm: max_norm %g must be finite and >= 0",
                     max_norm);
  float *g = ddp_model_grads_flat(z->model) + z->lo[z->rank];
  const int64_t n = z->lo[z->rank + 1] - z->lo[z->rank];
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += (double)g[i] * (double)g[i];
  DDP_TRY(ddp_allreduce(z->pg, &sum, 1, DDP_FLOAT64, DDP_REDUCE_SUM));
  double norm = sqrt(sum);
  if (total_norm) *total_norm = norm;
  if (!isfinite(norm))
    return ddp_error(DDP_ERR_RANGE, "zero: clip_grad_norm: the total gradient norm is %g; "
                     "gradients left as they are", norm);
  const float c = ddp_clip_coefficient(norm, max_norm);
  if (c < 1.0f) {
    for (int64_t i = 0; i < n; i++) g[i] *= c;
  }
  return DDP_OK;
}

ddp_status ddp_zero_step(ddp_zero *z) {
  DDP_TRY(ddp_optimizer_step(z->opt));
  z->params_stale = true;
  return ddp_zero_sync_params(z);
}

/* ---- State for checkpoints ---------------------------------------------------- */

#define ZERO_STATE_TAG 0x2e50

ddp_status ddp_zero_gather_state(ddp_zero *z, ddp_optimizer *full, int root) {
  if (root < 0 || root >= z->world)
    return ddp_error(DDP_ERR_INVALID, "zero: gather_state: root %d outside the %d ranks", root, z->world);
  if (z->rank == root && (!full || ddp_optimizer_numel(full) != (size_t)z->n ||
                          ddp_optimizer_state_count(full) != ddp_optimizer_state_count(z->opt)))
    return ddp_error(DDP_ERR_INVALID, "zero: gather_state: root's optimizer must be of the same "
                     "options over the model's %lld floats", (long long)z->n);
  /* Whether there is state is the same on every rank (steps and loads are). */
  if (!ddp_optimizer_has_state(z->opt)) {
    if (z->rank == root) DDP_TRY(ddp_optimizer_set_lr(full, ddp_optimizer_get_lr(z->opt)));
    return DDP_OK;
  }
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt); k++) {
    ddp_optim_state mine, whole = {0};
    DDP_TRY(ddp_optimizer_state_get(z->opt, k, &mine));
    if (z->rank == root) DDP_TRY(ddp_optimizer_state_get(full, k, &whole));
    if (mine.is_scalar) {
      if (z->rank == root) DDP_TRY(ddp_optimizer_state_load(full, mine.name, mine.data, 1));
      continue;
    }
    if (z->rank != root) {
      ddp_status s = ddp_send(z->pg, mine.data, mine.numel, DDP_FLOAT32, root, ZERO_STATE_TAG);
      if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): sending state '%s' to rank %d", z->rank, mine.name, root);
      continue;
    }
    for (int r = 0; r < z->world; r++) {
      float *at = whole.data + z->lo[r];
      size_t len = (size_t)(z->lo[r + 1] - z->lo[r]);
      if (r == root) {
        memcpy(at, mine.data, len * sizeof(float));
        continue;
      }
      ddp_status s = ddp_recv(z->pg, at, len, DDP_FLOAT32, r, ZERO_STATE_TAG);
      if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): receiving state '%s' from rank %d", z->rank, mine.name, r);
    }
    /* Marks the state present (the data is already in place). */
    DDP_TRY(ddp_optimizer_state_load(full, whole.name, whole.data, whole.numel));
  }
  if (z->rank == root) DDP_TRY(ddp_optimizer_set_lr(full, ddp_optimizer_get_lr(z->opt)));
  return DDP_OK;
}

ddp_status ddp_zero_load_state(ddp_zero *z, ddp_optimizer *full) {
  if (!full || ddp_optimizer_numel(full) != (size_t)z->n ||
      ddp_optimizer_state_count(full) != ddp_optimizer_state_count(z->opt))
    return ddp_error(DDP_ERR_INVALID, "zero: load_state: the optimizer must be of the same "
                     "options over the model's %lld floats", (long long)z->n);
  DDP_TRY(ddp_optimizer_set_lr(z->opt, ddp_optimizer_get_lr(full)));
  if (!ddp_optimizer_has_state(full)) return DDP_OK;
  const int64_t own = z->lo[z->rank], own_n = z->lo[z->rank + 1] - own;
  for (size_t k = 0; k < ddp_optimizer_state_count(full); k++) {
    ddp_optim_state st;
    DDP_TRY(ddp_optimizer_state_get(full, k, &st));
    DDP_TRY(ddp_optimizer_state_load(z->opt, st.name, st.is_scalar ? st.data : st.data + own,
                                     st.is_scalar ? 1 : (size_t)own_n));
  }
  return DDP_OK;
}

/* ---- Memory ------------------------------------------------------------------ */

void ddp_zero_get_memory(const ddp_zero *z, ddp_zero_memory *out) {
  memset(out, 0, sizeof *out);
  const int64_t f = (int64_t)sizeof(float), own_n = z->lo[z->rank + 1] - z->lo[z->rank];
  out->param_bytes = z->n * f;
  out->grad_bytes = z->n * f;
  out->grad_owned_bytes = (z->stage == 2 ? own_n : z->n) * f;
  int64_t buffers = 0;
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt); k++) {
    ddp_optim_state st;
    if (ddp_optimizer_state_get(z->opt, k, &st) == DDP_OK && !st.is_scalar) {
      out->optim_state_bytes += (int64_t)st.numel * f;
      buffers++;
    }
  }
  out->optim_state_unsharded_bytes = buffers * z->n * f;
}
