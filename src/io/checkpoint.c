/* Checkpoints: the model's state dict in PATH and the training state in
 * PATH's ".train.safetensors" sibling (docs/io.md lists every tensor).
 * Saving writes both temporary files completely before renaming either;
 * loading reads and checks both completely before changing anything. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/io_internal.h"
#include "io/model_state.h"

#define MAX_META 64

ddp_status ddp_checkpoint_train_path(const char *path, char *buf, size_t bytes) {
  static const char suffix[] = ".safetensors";
  size_t n = strlen(path), s = sizeof suffix - 1;
  size_t stem = n >= s && !strcmp(path + n - s, suffix) ? n - s : n;
  int w = snprintf(buf, bytes, "%.*s.train.safetensors", (int)stem, path);
  if (w < 0 || (size_t)w >= bytes)
    return ddp_error(DDP_ERR_RANGE, "checkpoint: path %s too long", path);
  return DDP_OK;
}

/* ---- The training state's tensors ---------------------------------------------- */

/* Names live in one buffer per save: "optimizer.state.<i>.<key>". */
typedef struct ddp__ckpt_entries {
  ddp_safetensors_entry *e;
  size_t count, cap;
  char *names;
  size_t names_used, names_cap;
  /* Scalars are written from here (the entries point at them). */
  int64_t i64[16];
  double f64[8];
  int n_i64, n_f64;
} ddp__ckpt_entries;
typedef ddp__ckpt_entries train_entries;

static const char *keep_name(train_entries *t, const char *fmt, int index, const char *key) {
  char tmp[256];
  int n = snprintf(tmp, sizeof tmp, fmt, index, key);
  DDP_ASSERT(n > 0 && (size_t)n < sizeof tmp && t->names_used + (size_t)n + 1 <= t->names_cap);
  char *p = t->names + t->names_used;
  memcpy(p, tmp, (size_t)n + 1);
  t->names_used += (size_t)n + 1;
  return p;
}

static ddp_safetensors_entry *add(train_entries *t, const char *name, ddp_dtype dtype, int ndim,
                                  const int64_t *shape, const void *data) {
  DDP_ASSERT(t->count < t->cap);
  ddp_safetensors_entry *e = &t->e[t->count++];
  memset(e, 0, sizeof *e);
  e->name = name;
  e->dtype = dtype;
  e->ndim = ndim;
  for (int d = 0; d < ndim; d++) e->shape[d] = shape[d];
  e->data = data;
  return e;
}

static void add_i64(train_entries *t, const char *name, int64_t v) {
  DDP_ASSERT(t->n_i64 < 16);
  t->i64[t->n_i64] = v;
  add(t, name, DDP_INT64, 0, NULL, &t->i64[t->n_i64++]);
}

static void add_f64(train_entries *t, const char *name, double v) {
  DDP_ASSERT(t->n_f64 < 8);
  t->f64[t->n_f64] = v;
  add(t, name, DDP_FLOAT64, 0, NULL, &t->f64[t->n_f64++]);
}

static ddp_status build_train_entries(train_entries *t, ddp_model *model, ddp_optimizer *opt,
                                      const ddp_scheduler *sched, const ddp_train_state *ts) {
  int n_params = ddp_model_num_params(model);
  size_t n_state = opt ? ddp_optimizer_state_count(opt) : 0;
  memset(t, 0, sizeof *t);
  t->cap = (size_t)n_params * n_state + 32;
  t->names_cap = t->cap * 96;
  t->e = ddp_calloc(t->cap, sizeof *t->e);
  t->names = ddp_alloc(t->names_cap);
  if (!t->e || !t->names) {
    ddp_free(t->e);
    ddp_free(t->names);
    return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate the training state's entries");
  }
  add_i64(t, "train.step", ts->step);
  add_i64(t, "train.epoch", ts->epoch);
  add_i64(t, "train.epoch_batches", ts->epoch_batches);
  add_i64(t, "train.sampler_seed", (int64_t)ts->sampler_seed);
  add_i64(t, "train.world_size", ts->world_size);
  add_f64(t, "train.best_test_loss", ts->best_test_loss);
  add_i64(t, "train.evals_without_better", ts->evals_without_better);
  add_i64(t, "train.epoch_samples", ts->epoch_samples);
  /* The dropout generator (xoshiro256** state words, as int64 bits). */
  const ddp_rng *rng = ddp_model_dropout_rng(model);
  static const int64_t four[1] = {4};
  add(t, "rng.dropout", DDP_INT64, 1, four, rng->s);
  if (opt) {
    add_f64(t, "optimizer.param_groups.0.lr", ddp_optimizer_get_lr(opt));
    /* PyTorch's state is empty before the first step: write nothing then. */
    for (size_t k = 0; k < n_state && ddp_optimizer_has_state(opt); k++) {
      ddp_optim_state os;
      DDP_TRY(ddp_optimizer_state_get(opt, k, &os));
      for (int i = 0; i < n_params; i++) {
        ddp_tensor *p = ddp_model_param(model, i);
        const char *name = keep_name(t, "optimizer.state.%d.%s", i, os.name);
        if (os.is_scalar)
          add(t, name, DDP_FLOAT32, 0, NULL, os.data);
        else
          add(t, name, DDP_FLOAT32, p->ndim, p->shape, os.data + ddp_model_param_offset(model, i));
      }
    }
  }
  const ddp_grad_scaler *gs = ts->grad_scaler;
  if (gs && gs->enabled) { /* PyTorch's state_dict of a disabled scaler is empty */
    add(t, "grad_scaler.scale", DDP_FLOAT32, 0, NULL, &gs->scale);
    add_f64(t, "grad_scaler.growth_factor", gs->growth_factor);
    add_f64(t, "grad_scaler.backoff_factor", gs->backoff_factor);
    add_i64(t, "grad_scaler.growth_interval", gs->growth_interval);
    add_i64(t, "grad_scaler._growth_tracker", gs->growth_tracker);
  }
  if (sched) {
    ddp_scheduler_state ss;
    ddp_scheduler_state_get(sched, &ss);
    add_i64(t, "scheduler.last_epoch", ss.last_epoch);
    add_i64(t, "scheduler._step_count", ss.step_count);
    add_f64(t, "scheduler.base_lrs.0", ss.base_lr);
    add_f64(t, "scheduler._last_lr.0", ss.last_lr);
  }
  return DDP_OK;
}

static void free_train_entries(train_entries *t) {
  ddp_free(t->e);
  ddp_free(t->names);
}

/* metadata + caller's pairs into out (MAX_META + 4 slots). */
static ddp_status merge_meta(ddp_kv *out, size_t *n, const ddp_kv *fixed, size_t n_fixed,
                             const ddp_kv *meta, size_t n_meta) {
  if (n_meta > MAX_META)
    return ddp_error(DDP_ERR_INVALID, "checkpoint: %zu metadata pairs (at most %d)", n_meta,
                     MAX_META);
  for (size_t i = 0; i < n_fixed; i++) out[i] = fixed[i];
  for (size_t i = 0; i < n_meta; i++) out[n_fixed + i] = meta[i];
  *n = n_fixed + n_meta;
  return DDP_OK;
}

ddp_status ddp_checkpoint_save(const char *path, const ddp_model *model_c, ddp_optimizer *opt,
                               const ddp_scheduler *sched, const ddp_train_state *ts,
                               const ddp_kv *metadata, size_t metadata_count) {
  /* The dropout generator is read, not changed; nn only hands it out mutable. */
  ddp_model *model = (ddp_model *)model_c;
  char train_path[4096];
  DDP_TRY(ddp_checkpoint_train_path(path, train_path, sizeof train_path));
  char id[96];
  snprintf(id, sizeof id, "%ld-%lld-%lld", (long)getpid(), (long long)ddp_time_ns(),
           (long long)ts->step);
  ddp_kv meta[MAX_META + 4];
  size_t n_meta;

  ddp_safetensors_entry *model_entries;
  int n_model;
  DDP_TRY(ddp__model_state_entries(model, &model_entries, &n_model));
  train_entries te;
  ddp_status s = build_train_entries(&te, model, opt, sched, ts);
  if (s != DDP_OK) {
    ddp_free(model_entries);
    return s;
  }
  ddp__atomic_file model_file, train_file;
  memset(&model_file, 0, sizeof model_file);
  memset(&train_file, 0, sizeof train_file);
  model_file.fd = train_file.fd = -1;

  const ddp_kv model_fixed[] = {
      {"format", "pt"}, {"ddp.model", ddp_model_name(model)}, {"ddp.checkpoint_id", id}};
  s = merge_meta(meta, &n_meta, model_fixed, 3, metadata, metadata_count);
  if (s == DDP_OK)
    s = ddp__safetensors_write_temp(&model_file, path, model_entries, (size_t)n_model, meta,
                                    n_meta);
  /* The model's temporary file, named in the training state so that a load
   * can roll forward a save interrupted between its two renames. */
  const char *pending = "";
  if (s == DDP_OK) {
    const char *slash = strrchr(model_file.tmp, '/');
    pending = slash ? slash + 1 : model_file.tmp;
  }
  const ddp_kv train_fixed[] = {{"ddp.kind", "training-state"},
                                {"ddp.model", ddp_model_name(model)},
                                {"ddp.optimizer", opt ? ddp_optim_kind_name(ddp_optimizer_options(opt)->kind) : "none"},
                                {"ddp.checkpoint_id", id},
                                {"ddp.model_pending", pending}};
  if (s == DDP_OK) s = merge_meta(meta, &n_meta, train_fixed, 5, metadata, metadata_count);
  if (s == DDP_OK)
    s = ddp__safetensors_write_temp(&train_file, train_path, te.e, te.count, meta, n_meta);
  /* Both complete and synced: now replace the old pair, training state
   * first, then one directory fsync. A crash between the two renames leaves
   * the new training state beside the old model and the new model still in
   * its temporary file, which the training state names: a load rolls
   * forward from it (docs/io.md, "Atomicity"). */
  bool train_renamed = false;
  if (s == DDP_OK) s = ddp__atomic_rename(&train_file);
  if (s == DDP_OK) train_renamed = true;
  if (s == DDP_OK) s = ddp__atomic_rename(&model_file);
  if (s == DDP_OK) s = ddp__atomic_sync_dir(path);
  if (s != DDP_OK && train_renamed && model_file.tmp) {
    /* The model's rename failed after the training state's succeeded: the
     * old pair is gone, and the new model's temporary file (which the new
     * training state names) is what a load rolls forward from. Keep it. */
    (void)ddp__atomic_sync_dir(path);
    ddp_free(model_file.tmp);
    model_file.tmp = NULL;
    s = ddp_error_wrap(s, "the model stays in its temporary file, from which loading %s rolls "
                          "forward", path);
  }
  ddp__atomic_abort(&train_file);
  ddp__atomic_abort(&model_file);
  free_train_entries(&te);
  ddp_free(model_entries);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "saving checkpoint %s", path);
}

/* ---- Loading ---------------------------------------------------------------------- */

static ddp_status get_scalar(const ddp_safetensors *st, const char *name, ddp_dtype dtype,
                             void *out) {
  ddp_safetensors_tensor t;
  ddp_status s = ddp_safetensors_find(st, name, &t);
  if (s != DDP_OK)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: the training state lacks %s",
                     ddp_safetensors_path(st), name);
  if (t.dtype != dtype || t.ndim != 0)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: %s at offset %llu is %s with %d "
                     "dimensions; expected a %s scalar", ddp_safetensors_path(st), name,
                     (unsigned long long)t.file_offset, ddp_safetensors_dtype_name(t.dtype),
                     t.ndim, ddp_safetensors_dtype_name(dtype));
  memcpy(out, t.data, ddp_dtype_size(dtype));
  return DDP_OK;
}

/* What a load will apply, gathered while checking. */
typedef struct pending {
  ddp_train_state ts;
  ddp_rng rng;
  double lr;
  ddp_scheduler_state sched;
  float **optim;       /* per state entry: n floats to load, or NULL (none saved) */
  size_t n_optim;
  ddp_grad_scaler scaler; /* the saved gradient scaler, when has_scaler */
  bool has_scaler;
} pending;

static void free_pending(pending *p) {
  for (size_t k = 0; k < p->n_optim; k++) ddp_free(p->optim[k]);
  ddp_free(p->optim);
}

static ddp_status check_optimizer(const ddp_safetensors *st, ddp_model *model, ddp_optimizer *opt,
                                  pending *p) {
  const char *path = ddp_safetensors_path(st);
  DDP_TRY(get_scalar(st, "optimizer.param_groups.0.lr", DDP_FLOAT64, &p->lr));
  if (!(p->lr >= 0) || !isfinite(p->lr))
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: optimizer.param_groups.0.lr is %g", path,
                     p->lr);
  int n_params = ddp_model_num_params(model);
  p->n_optim = ddp_optimizer_state_count(opt);
  p->optim = ddp_calloc(p->n_optim ? p->n_optim : 1, sizeof *p->optim);
  if (!p->optim) return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate");
  size_t n = ddp_optimizer_numel(opt);
  size_t expected = 0;
  (void)n;
  for (size_t k = 0; k < p->n_optim; k++) {
    ddp_optim_state os;
    DDP_TRY(ddp_optimizer_state_get(opt, k, &os));
    char name[256];
    snprintf(name, sizeof name, "optimizer.state.0.%s", os.name);
    ddp_safetensors_tensor t;
    if (ddp_safetensors_find(st, name, &t) != DDP_OK) continue; /* saved before any step */
    p->optim[k] = ddp_alloc(os.numel * sizeof(float));
    if (!p->optim[k]) return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate");
    for (int i = 0; i < n_params; i++) {
      ddp_tensor *param = ddp_model_param(model, i);
      snprintf(name, sizeof name, "optimizer.state.%d.%s", i, os.name);
      if (ddp_safetensors_find(st, name, &t) != DDP_OK)
        return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: the optimizer state lacks %s (parameter "
                         "%s); the file has this state for parameter 0", path, name,
                         ddp_model_param_name(model, i));
      int want_ndim = os.is_scalar ? 0 : param->ndim;
      bool ok = t.dtype == DDP_FLOAT32 && t.ndim == want_ndim;
      for (int d = 0; ok && d < want_ndim; d++) ok = t.shape[d] == param->shape[d];
      if (!ok)
        return ddp_error(DDP_ERR_SHAPE, "checkpoint: %s: %s at offset %llu is %s with %d "
                         "dimensions, not float32 shaped like parameter %s (%d dimensions)",
                         path, name, (unsigned long long)t.file_offset,
                         ddp_safetensors_dtype_name(t.dtype), t.ndim,
                         ddp_model_param_name(model, i), want_ndim);
      if (os.is_scalar) {
        float v;
        memcpy(&v, t.data, sizeof v);
        if (i == 0) p->optim[k][0] = v;
        else if (memcmp(&v, &p->optim[k][0], sizeof v) != 0)
          return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: %s (%g) differs from parameter 0's "
                           "(%g); ddp keeps one %s for all parameters", path, name, (double)v,
                           (double)p->optim[k][0], os.name);
      } else {
        DDP_ASSERT((size_t)(ddp_model_param_offset(model, i) + param->numel) <= n);
        memcpy(p->optim[k] + ddp_model_param_offset(model, i), t.data, t.bytes);
      }
      expected++;
    }
  }
  /* Anything else under optimizer.state. is state this optimizer does not
   * keep (saved by another optimizer, or for more parameters). */
  size_t count = ddp_safetensors_count(st), found = 0;
  for (size_t i = 0; i < count; i++) {
    ddp_safetensors_tensor t;
    ddp_safetensors_get(st, i, &t);
    if (strncmp(t.name, "optimizer.state.", 16) != 0) continue;
    found++;
    char *end;
    long index = strtol(t.name + 16, &end, 10);
    bool known = end != t.name + 16 && *end == '.' && index >= 0 && index < n_params;
    if (known) {
      known = false;
      for (size_t k = 0; k < p->n_optim && !known; k++) {
        ddp_optim_state os;
        ddp_optimizer_state_get(opt, k, &os);
        known = p->optim[k] && !strcmp(end + 1, os.name);
      }
    }
    if (!known)
      return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: unexpected optimizer state %s at offset "
                       "%llu (the %s optimizer of this %d-parameter model has no such state)",
                       path, t.name, (unsigned long long)t.file_offset,
                       ddp_optim_kind_name(ddp_optimizer_options(opt)->kind), n_params);
  }
  DDP_ASSERT(found == expected);
  return DDP_OK;
}

/* The gradient scaler's state, when the file has one (all five keys). */
static ddp_status check_grad_scaler(const ddp_safetensors *st, pending *p) {
  ddp_safetensors_tensor es;
  p->has_scaler = false;
  if (ddp_safetensors_find(st, "grad_scaler.scale", &es) != DDP_OK) return DDP_OK;
  ddp_grad_scaler gs = ddp_grad_scaler_defaults(true);
  int64_t interval, tracker;
  DDP_TRY(get_scalar(st, "grad_scaler.scale", DDP_FLOAT32, &gs.scale));
  DDP_TRY(get_scalar(st, "grad_scaler.growth_factor", DDP_FLOAT64, &gs.growth_factor));
  DDP_TRY(get_scalar(st, "grad_scaler.backoff_factor", DDP_FLOAT64, &gs.backoff_factor));
  DDP_TRY(get_scalar(st, "grad_scaler.growth_interval", DDP_INT64, &interval));
  DDP_TRY(get_scalar(st, "grad_scaler._growth_tracker", DDP_INT64, &tracker));
  gs.growth_interval = interval;
  gs.growth_tracker = tracker >= INT32_MIN && tracker <= INT32_MAX ? (int32_t)tracker : -1;
  if (ddp_grad_scaler_check(&gs) != DDP_OK)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: the gradient scaler's state is impossible "
                     "(%s)", ddp_safetensors_path(st), ddp_last_error());
  p->scaler = gs;
  p->has_scaler = true;
  return DDP_OK;
}

/* A loaded scaler's state into the caller's enabled scaler (see
 * ddp_train_state.grad_scaler). */
void ddp__ckpt_apply_scaler(ddp_grad_scaler *gs, const ddp_grad_scaler *saved, bool has) {
  if (!gs || !gs->enabled || !has) return;
  *gs = *saved;
  gs->enabled = true;
}

static ddp_status check_train_state(const ddp_safetensors *st, ddp_model *model,
                                    ddp_optimizer *opt, ddp_scheduler *sched, pending *p) {
  const char *path = ddp_safetensors_path(st);
  memset(&p->ts, 0, sizeof p->ts);
  int64_t seed;
  DDP_TRY(get_scalar(st, "train.step", DDP_INT64, &p->ts.step));
  DDP_TRY(get_scalar(st, "train.epoch", DDP_INT64, &p->ts.epoch));
  DDP_TRY(get_scalar(st, "train.epoch_batches", DDP_INT64, &p->ts.epoch_batches));
  DDP_TRY(get_scalar(st, "train.sampler_seed", DDP_INT64, &seed));
  DDP_TRY(get_scalar(st, "train.world_size", DDP_INT64, &p->ts.world_size));
  p->ts.sampler_seed = (uint64_t)seed;
  /* Early stopping's position, absent from checkpoints of older versions. */
  ddp_safetensors_tensor es;
  p->ts.best_test_loss = INFINITY;
  p->ts.evals_without_better = 0;
  if (ddp_safetensors_find(st, "train.best_test_loss", &es) == DDP_OK)
    DDP_TRY(get_scalar(st, "train.best_test_loss", DDP_FLOAT64, &p->ts.best_test_loss));
  if (ddp_safetensors_find(st, "train.evals_without_better", &es) == DDP_OK)
    DDP_TRY(get_scalar(st, "train.evals_without_better", DDP_INT64, &p->ts.evals_without_better));
  /* The epoch's position in samples, absent before elastic training. */
  p->ts.epoch_samples = -1;
  if (ddp_safetensors_find(st, "train.epoch_samples", &es) == DDP_OK)
    DDP_TRY(get_scalar(st, "train.epoch_samples", DDP_INT64, &p->ts.epoch_samples));
  if (p->ts.epoch_samples < -1)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: train.epoch_samples is %lld", path,
                     (long long)p->ts.epoch_samples);
  if (isnan(p->ts.best_test_loss) || p->ts.evals_without_better < 0)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: impossible early-stopping position: best "
                     "test loss %g, %lld evaluations since", path, p->ts.best_test_loss,
                     (long long)p->ts.evals_without_better);
  if (p->ts.step < 0 || p->ts.epoch < 0 || p->ts.epoch_batches < 0 || p->ts.world_size < 1)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: impossible position: step %lld, epoch %lld, "
                     "batch %lld, world size %lld", path, (long long)p->ts.step,
                     (long long)p->ts.epoch, (long long)p->ts.epoch_batches,
                     (long long)p->ts.world_size);
  ddp_safetensors_tensor t;
  if (ddp_safetensors_find(st, "rng.dropout", &t) != DDP_OK)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: the training state lacks rng.dropout", path);
  if (t.dtype != DDP_INT64 || t.ndim != 1 || t.shape[0] != 4)
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: rng.dropout at offset %llu is not int64 [4]",
                     path, (unsigned long long)t.file_offset);
  memcpy(p->rng.s, t.data, sizeof p->rng.s);
  (void)model;
  if (opt) DDP_TRY(check_optimizer(st, model, opt, p));
  DDP_TRY(check_grad_scaler(st, p));
  if (sched) {
    DDP_TRY(get_scalar(st, "scheduler.last_epoch", DDP_INT64, &p->sched.last_epoch));
    DDP_TRY(get_scalar(st, "scheduler._step_count", DDP_INT64, &p->sched.step_count));
    DDP_TRY(get_scalar(st, "scheduler.base_lrs.0", DDP_FLOAT64, &p->sched.base_lr));
    DDP_TRY(get_scalar(st, "scheduler._last_lr.0", DDP_FLOAT64, &p->sched.last_lr));
    if (!(p->sched.base_lr >= 0) || p->sched.last_epoch < -1)
      return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: scheduler state base_lr %g, last_epoch "
                       "%lld is impossible", path, p->sched.base_lr,
                       (long long)p->sched.last_epoch);
  }
  return DDP_OK;
}

/* Reads the model file of the pair; when it is missing or from another save
 * and the training state names a pending model file (the save was cut
 * between its renames) with the training state's id, reads that one. */
static ddp_status read_model_file(const char *path, const ddp_safetensors *train_st,
                                  ddp_safetensors **out) {
  ddp_status s = ddp_safetensors_read(path, out);
  if (s != DDP_OK && s != DDP_ERR_NOTFOUND) return s;
  const char *tid = ddp_safetensors_metadata(train_st, "ddp.checkpoint_id");
  const char *mid = s == DDP_OK ? ddp_safetensors_metadata(*out, "ddp.checkpoint_id") : NULL;
  const char *pending = ddp_safetensors_metadata(train_st, "ddp.model_pending");
  if ((mid && tid && !strcmp(mid, tid)) || !tid || !pending || !pending[0] || strchr(pending, '/'))
    return s;
  char alt[4096];
  const char *slash = strrchr(path, '/');
  snprintf(alt, sizeof alt, "%.*s%s", slash ? (int)(slash - path + 1) : 0, path, pending);
  ddp_safetensors *st;
  if (ddp_safetensors_read(alt, &st) != DDP_OK) {
    if (s != DDP_OK) ddp_safetensors_read(path, out); /* restore the NOTFOUND message */
    return s;
  }
  const char *pid = ddp_safetensors_metadata(st, "ddp.checkpoint_id");
  if (!pid || strcmp(pid, tid)) {
    ddp_safetensors_free(st);
    if (s != DDP_OK) return ddp_safetensors_read(path, out);
    return DDP_OK;
  }
  DDP_WARN("checkpoint: %s: the save that wrote %s was interrupted before renaming the model "
           "file; loading the model from %s (the next save replaces %s)", path,
           ddp_safetensors_path(train_st), alt, path);
  ddp_safetensors_free(s == DDP_OK ? *out : NULL);
  *out = st;
  return DDP_OK;
}

static ddp_status check_metadata(const ddp_safetensors *model_st, const ddp_safetensors *train_st,
                                 const ddp_model *model, const ddp_kv *expect,
                                 size_t expect_count) {
  const char *mid = ddp_safetensors_metadata(model_st, "ddp.checkpoint_id");
  const char *kind = ddp_safetensors_metadata(train_st, "ddp.kind");
  const char *tid = ddp_safetensors_metadata(train_st, "ddp.checkpoint_id");
  if (!tid || !kind || strcmp(kind, "training-state"))
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s is not a ddp training state (no ddp.kind "
                     "\"training-state\" in its metadata)", ddp_safetensors_path(train_st));
  if (!mid || strcmp(mid, tid))
    return ddp_error(DDP_ERR_FORMAT, "checkpoint: %s (checkpoint id %s) and %s (id %s) come from "
                     "different saves (a save interrupted between its two renames, or files "
                     "copied from different runs); use a matching pair",
                     ddp_safetensors_path(model_st), mid ? mid : "none",
                     ddp_safetensors_path(train_st), tid);
  const char *saved_model = ddp_safetensors_metadata(train_st, "ddp.model");
  if (!saved_model || strcmp(saved_model, ddp_model_name(model)))
    return ddp_error(DDP_ERR_INVALID, "checkpoint: %s was saved from model %s; this run builds %s",
                     ddp_safetensors_path(train_st), saved_model ? saved_model : "(unknown)",
                     ddp_model_name(model));
  for (size_t i = 0; i < expect_count; i++) {
    const char *v = ddp_safetensors_metadata(train_st, expect[i].key);
    if (!v || strcmp(v, expect[i].value))
      return ddp_error(DDP_ERR_INVALID, "checkpoint: %s was saved with %s = %s; this run has "
                       "%s = %s (resume with the options it was saved with)",
                       ddp_safetensors_path(train_st), expect[i].key, v ? v : "(not recorded)",
                       expect[i].key, expect[i].value);
  }
  return DDP_OK;
}

ddp_status ddp_checkpoint_load(const char *path, ddp_model *model, ddp_optimizer *opt,
                               ddp_scheduler *sched, ddp_train_state *ts, const ddp_kv *expect,
                               size_t expect_count) {
  char train_path[4096];
  DDP_TRY(ddp_checkpoint_train_path(path, train_path, sizeof train_path));
  ddp_safetensors *model_st = NULL, *train_st = NULL;
  pending p;
  memset(&p, 0, sizeof p);
  ddp_status s = ddp_safetensors_read(train_path, &train_st);
  if (s == DDP_ERR_NOTFOUND) {
    if (access(path, F_OK) != 0) /* neither file: name the one the user gave */
      s = ddp_safetensors_read(path, &model_st);
    else
      s = ddp_error(DDP_ERR_NOTFOUND, "checkpoint: %s has no training state beside it (%s does "
                    "not exist): a model-only state dict (ddp_model_save, PyTorch) can be loaded "
                    "but not resumed", path, train_path);
  }
  if (s == DDP_OK) s = read_model_file(path, train_st, &model_st);
  if (s == DDP_OK) s = check_metadata(model_st, train_st, model, expect, expect_count);
  if (s == DDP_OK) s = ddp__model_state_check(model, model_st);
  if (s == DDP_OK) s = check_train_state(train_st, model, opt, sched, &p);
  /* Everything is checked and staged: from here nothing fails but a GPU's
   * copy (the model's state to its device), before anything else changes. */
  if (s == DDP_OK) s = ddp__model_state_apply(model, model_st);
  if (s == DDP_OK) {
    *ddp_model_dropout_rng(model) = p.rng;
    if (opt) {
      ddp_status ls = ddp_optimizer_set_lr(opt, p.lr);
      DDP_ASSERT(ls == DDP_OK);
      for (size_t k = 0; k < p.n_optim; k++) {
        if (!p.optim[k]) continue;
        ddp_optim_state os;
        ddp_optimizer_state_get(opt, k, &os);
        ddp_status ls = ddp_optimizer_state_load(opt, os.name, p.optim[k], os.numel);
        DDP_ASSERT(ls == DDP_OK);
      }
    }
    if (sched) {
      ddp_status ls = ddp_scheduler_state_load(sched, &p.sched);
      DDP_ASSERT(ls == DDP_OK);
    }
    ddp_grad_scaler *gs = ts->grad_scaler;
    ddp__ckpt_apply_scaler(gs, &p.scaler, p.has_scaler);
    *ts = p.ts;
    ts->grad_scaler = gs;
  }
  free_pending(&p);
  ddp_safetensors_free(train_st);
  ddp_safetensors_free(model_st);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "loading checkpoint %s", path);
}

/* ---- For sharded checkpoints (sharded.c) ------------------------------------------ */

ddp_status ddp__ckpt_train_entries(ddp__ckpt_entries **out, ddp_model *model, ddp_optimizer *opt,
                                   const ddp_scheduler *sched, const ddp_train_state *ts) {
  *out = ddp_calloc(1, sizeof **out);
  if (!*out) return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate the training state");
  ddp_status s = build_train_entries(*out, model, opt, sched, ts);
  if (s != DDP_OK) {
    free_train_entries(*out);
    ddp_free(*out);
    *out = NULL;
  }
  return s;
}

const ddp_safetensors_entry *ddp__ckpt_entries_get(const ddp__ckpt_entries *t, size_t *count) {
  *count = t->count;
  return t->e;
}

void ddp__ckpt_entries_free(ddp__ckpt_entries *t) {
  if (!t) return;
  free_train_entries(t);
  ddp_free(t);
}

ddp_status ddp__ckpt_read_train(const ddp_safetensors *st, ddp_model *model, ddp_scheduler *sched,
                                ddp_train_state *ts, ddp_rng *rng, ddp_scheduler_state *ss,
                                ddp_grad_scaler *scaler, bool *has_scaler) {
  pending p;
  memset(&p, 0, sizeof p);
  ddp_status s = check_train_state(st, model, NULL, sched, &p);
  if (s == DDP_OK) {
    *ts = p.ts;
    *rng = p.rng;
    *ss = p.sched;
    *scaler = p.scaler;
    *has_scaler = p.has_scaler;
  }
  free_pending(&p);
  return s;
}

ddp_status ddp__ckpt_get_scalar(const ddp_safetensors *st, const char *name, ddp_dtype dtype,
                                void *out) {
  return get_scalar(st, name, dtype, out);
}
