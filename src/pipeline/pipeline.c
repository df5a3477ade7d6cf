/* Setting a pipeline up: the schedules (checked before anything runs), the
 * split agreed by every rank, this rank's copy of its stages' modules, the
 * shapes between stages computed and exchanged once, the channels, and every
 * buffer the steps need. The steps themselves are in exec.c. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/module.h"
#include "pipeline/stage.h"
#include "tensor/tape.h"

ddp_pipeline_options ddp_pipeline_defaults(void) {
  ddp_pipeline_options o;
  memset(&o, 0, sizeof o);
  o.schedule = DDP_PIPELINE_1F1B;
  o.n_microbatches = 4;
  o.virtual_stages = 1;
  o.split = NULL;
  o.profile_rows = 32;
  o.max_batch = 256;
  return o;
}

/* What the owner of a stage tells every rank at setup. */
/* Broadcast as int32s: sizeof is a multiple of 4. */
typedef struct {
  int32_t status;
  int32_t ndim;
  int64_t shape[DDP_MAX_DIMS];
  char msg[1000];
} shape_msg;

/* Broadcasts a status and message from `root` so every rank fails alike. */
static ddp_status agree(ddp_process_group *pg, int root, ddp_status mine, const char *what) {
  shape_msg m;
  memset(&m, 0, sizeof m);
  m.status = mine;
  if (mine != DDP_OK) snprintf(m.msg, sizeof m.msg, "%s", ddp_last_error());
  ddp_status s = ddp_broadcast(pg, &m, sizeof m / 4, DDP_INT32, root);
  if (s != DDP_OK) return ddp_error_wrap(s, "pipeline: agreeing on %s", what);
  if (m.status != DDP_OK) return ddp_error((ddp_status)m.status, "%s", m.msg);
  return DDP_OK;
}

static ddp_status decide_split(ddp_pipeline *pp, ddp_model *full, ddp_module **mods) {
  const char *spec = pp->options.split;
  bool automatic = !spec || !*spec || strcmp(spec, "auto") == 0;
  ddp_status s = DDP_OK;
  if (!automatic) {
    s = ddp__pp_split_names(mods, pp->n_mods, spec, pp->n_stages, pp->bounds);
  } else if (pp->rank == 0) {
    /* Rank 0 measures and decides; the others take its answer, so timing
     * noise cannot make ranks disagree. */
    double *cost = ddp_alloc(sizeof(double) * (size_t)pp->n_mods);
    s = cost ? ddp__pp_profile(full, mods, pp->n_mods, pp->stage_ndim[0], pp->stage_shape[0],
                               pp->options.profile_rows, cost)
             : ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
    if (s == DDP_OK) s = ddp__pp_balance(cost, pp->n_mods, pp->n_stages, pp->bounds);
    if (s == DDP_OK) {
      char line[512] = "";
      for (int k = 0; k < pp->n_mods; k++)
        snprintf(line + strlen(line), sizeof line - strlen(line), " %s=%.3fms", mods[k]->name,
                 cost[k] * 1e3);
      DDP_INFO("pipeline: measured cost per module:%s", line);
    }
    ddp_free(cost);
  }
  DDP_TRY(agree(pp->host_pg, 0, s, "the split"));
  if (automatic) {
    int32_t b[DDP_PIPELINE_MAX_STAGES + 1];
    for (int g = 0; g <= pp->n_stages; g++) b[g] = pp->bounds[g];
    DDP_TRY(ddp_broadcast(pp->host_pg, b, (size_t)(pp->n_stages + 1), DDP_INT32, 0));
    for (int g = 0; g <= pp->n_stages; g++) pp->bounds[g] = b[g];
  }
  pp->split[0] = '\0';
  for (int g = 1; g < pp->n_stages; g++)
    snprintf(pp->split + strlen(pp->split), sizeof pp->split - strlen(pp->split), "%s%s",
             g > 1 ? "," : "", mods[pp->bounds[g]]->name);
  return DDP_OK;
}

/* Stage g's output shape for one row of input of shape stage_shape[g], on
 * the owner; every rank learns it (and any failure) from a broadcast. */
static ddp_status exchange_shapes(ddp_pipeline *pp) {
  ddp_tape *tape = NULL;
  DDP_TRY(ddp_tape_create(&tape, 1 << 16));
  ddp_tape_set_grad_enabled(tape, false);
  bool training = ddp_model_is_training(pp->model);
  ddp_model_train(pp->model, false); /* BN on running stats, no dropout draws */
  ddp_status s = DDP_OK;
  for (int g = 0; g < pp->n_stages && s == DDP_OK; g++) {
    int owner = ddp__pp_rank_of(pp->p, g);
    shape_msg m;
    memset(&m, 0, sizeof m);
    if (owner == pp->rank) {
      pp_chunk *c = &pp->chunks[g / pp->p];
      int64_t shape[DDP_MAX_DIMS];
      int nd = pp->stage_ndim[g];
      shape[0] = 1;
      memcpy(shape + 1, pp->stage_shape[g], sizeof(int64_t) * (size_t)nd);
      ddp_tensor *x = NULL, *out = NULL;
      ddp_status st = nd + 1 > DDP_MAX_DIMS
                          ? ddp_error(DDP_ERR_SHAPE, "pipeline: input of %d dims", nd)
                          : ddp_tensor_create(&x, DDP_FLOAT32, nd + 1, shape);
      ddp_tape_reset(tape);
      if (st == DDP_OK) st = ddp__pp_run_modules(pp->model, c->mods, c->n_mods, tape, x, &out);
      if (st == DDP_OK && (out->ndim < 1 || out->shape[0] != 1 || out->dtype != DDP_FLOAT32)) {
        char buf[DDP_SHAPE_STR_BYTES];
        st = ddp_error(DDP_ERR_SHAPE, "its output %s does not keep the batch as dim 0",
                       ddp_tensor_shape_str(out, buf, sizeof buf));
      }
      if (st != DDP_OK) {
        char in[128] = "(N";
        for (int d = 0; d < nd; d++)
          snprintf(in + strlen(in), sizeof in - strlen(in), ",%lld",
                   (long long)pp->stage_shape[g][d]);
        snprintf(in + strlen(in), sizeof in - strlen(in), ")");
        snprintf(m.msg, sizeof m.msg,
                 "pipeline: stage %d (rank %d; modules %s..%s) does not take %s of shape %s: %s",
                 g, owner, pp->names[pp->bounds[g]], pp->names[pp->bounds[g + 1] - 1],
                 g ? "the previous stage's output" : "the input", in, ddp_last_error());
        m.status = st;
      } else {
        m.ndim = out->ndim - 1;
        memcpy(m.shape, out->shape + 1, sizeof(int64_t) * (size_t)m.ndim);
      }
      ddp_tensor_destroy(x);
    }
    s = ddp_broadcast(pp->host_pg, &m, sizeof m / 4, DDP_INT32, owner);
    if (s != DDP_OK) {
      s = ddp_error_wrap(s, "pipeline: exchanging stage %d's output shape", g);
      break;
    }
    if (m.status != DDP_OK) {
      s = ddp_error((ddp_status)m.status, "%s", m.msg);
      break;
    }
    pp->stage_ndim[g + 1] = m.ndim;
    memcpy(pp->stage_shape[g + 1], m.shape, sizeof m.shape);
  }
  ddp_model_train(pp->model, training);
  ddp_tape_destroy(tape);
  return s;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

/* The most pool entries of each kind a chunk holds at once under `s`,
 * walking this rank's list with the executor's rules (exec.c). */
static void count_pools(ddp_pipeline *pp, const ddp_pipeline_schedule *s, int *acts, int *grads,
                        int *tapes) {
  int n;
  const ddp_pipeline_action *list = ddp_pipeline_schedule_actions(s, pp->rank, &n);
  int a[DDP_PIPELINE_MAX_VIRTUAL] = {0}, g[DDP_PIPELINE_MAX_VIRTUAL] = {0},
      t[DDP_PIPELINE_MAX_VIRTUAL] = {0};
  bool forward_only = s->kind == DDP_PIPELINE_FORWARD_ONLY;
  for (int i = 0; i < n; i++) {
    int c = list[i].stage / pp->p;
    bool first = list[i].stage == 0;
    switch (list[i].kind) {
    case DDP_PIPELINE_RECV_ACT: a[c]++; break;
    case DDP_PIPELINE_RECV_GRAD: g[c]++; break;
    case DDP_PIPELINE_FORWARD:
      t[c]++;
      if (forward_only && !first) a[c]--;
      if (forward_only && list[i].stage == pp->n_stages - 1) t[c]--;
      break;
    case DDP_PIPELINE_SEND_ACT:
      if (forward_only) t[c]--;
      break;
    case DDP_PIPELINE_BACKWARD:
      t[c]--;
      if (list[i].stage < pp->n_stages - 1) g[c]--;
      break;
    case DDP_PIPELINE_SEND_GRAD: a[c]--; break;
    default: break;
    }
    if (a[c] > acts[c]) acts[c] = a[c];
    if (g[c] > grads[c]) grads[c] = g[c];
    if (t[c] > tapes[c]) tapes[c] = t[c];
  }
}

/* A buffer of `floats` float32s on the pipeline's device: *mem owns it. */
static ddp_status buffer_on_device(ddp_pipeline *pp, int64_t floats, ddp_tensor **mem,
                                   float **data) {
  ddp_status s = ddp_tensor_create_on(mem, DDP_FLOAT32, 1, &floats, pp->device);
  if (s != DDP_OK) {
    char dev[DDP_DEVICE_STR_BYTES];
    return ddp_error_wrap(s, "pipeline: cannot allocate %lld bytes of activations or gradients "
                          "on %s", (long long)floats * 4, ddp_device_str(pp->device, dev, sizeof dev));
  }
  *data = ddp_tensor_f32(*mem);
  return DDP_OK;
}

static ddp_status alloc_chunks(ddp_pipeline *pp) {
  int acts[DDP_PIPELINE_MAX_VIRTUAL] = {0}, grads[DDP_PIPELINE_MAX_VIRTUAL] = {0},
      tapes[DDP_PIPELINE_MAX_VIRTUAL] = {0};
  count_pools(pp, pp->train, acts, grads, tapes);
  count_pools(pp, pp->eval, acts, grads, tapes);
  for (int ci = 0; ci < pp->v; ci++) {
    pp_chunk *c = &pp->chunks[ci];
    int g = c->stage;
    c->in_ndim = pp->stage_ndim[g];
    memcpy(c->in_shape, pp->stage_shape[g], sizeof c->in_shape);
    c->out_ndim = pp->stage_ndim[g + 1];
    memcpy(c->out_shape, pp->stage_shape[g + 1], sizeof c->out_shape);
    c->in_row = numel_of(c->in_ndim, c->in_shape);
    c->out_row = numel_of(c->out_ndim, c->out_shape);
    c->n_acts = acts[ci];
    c->n_grads = grads[ci];
    c->n_tapes = tapes[ci] > 0 ? tapes[ci] : 1;
    size_t m = (size_t)pp->m;
    c->acts = ddp_calloc((size_t)(c->n_acts ? c->n_acts : 1), sizeof(pp_slot));
    c->grads = ddp_calloc((size_t)(c->n_grads ? c->n_grads : 1), sizeof(pp_slot));
    c->tapes = ddp_calloc((size_t)c->n_tapes, sizeof(pp_tape));
    c->act_of = ddp_calloc(m, sizeof(int));
    c->grad_of = ddp_calloc(m, sizeof(int));
    c->tape_of = ddp_calloc(m, sizeof(int));
    c->inputs = ddp_calloc(m, sizeof(ddp_tensor));
    c->targets = ddp_calloc(m, sizeof(ddp_tensor));
    c->outputs = ddp_calloc(m, sizeof(ddp_tensor *));
    c->losses = ddp_calloc(m, sizeof(ddp_tensor *));
    if (!c->acts || !c->grads || !c->tapes || !c->act_of || !c->grad_of || !c->tape_of ||
        !c->inputs || !c->targets || !c->outputs || !c->losses)
      return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
    /* On the stages' device: what a receive writes and a send reads is
     * where the stage's kernels read and write it. */
    const int64_t in_floats = pp->max_rows * c->in_row, out_floats = pp->max_rows * c->out_row;
    for (int i = 0; i < c->n_acts; i++) {
      DDP_TRY(buffer_on_device(pp, in_floats, &c->acts[i].data_mem, &c->acts[i].data));
      DDP_TRY(buffer_on_device(pp, in_floats, &c->acts[i].grad_mem, &c->acts[i].grad));
    }
    for (int i = 0; i < c->n_grads; i++)
      DDP_TRY(buffer_on_device(pp, out_floats, &c->grads[i].data_mem, &c->grads[i].data));
    for (int i = 0; i < c->n_tapes; i++) DDP_TRY(ddp_tape_create(&c->tapes[i].tape, 1 << 20));
  }
  pp->rows = ddp_calloc((size_t)pp->m, sizeof(int64_t));
  pp->offsets = ddp_calloc((size_t)pp->m, sizeof(int64_t));
  if (!pp->rows || !pp->offsets) return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  return DDP_OK;
}

static ddp_status check_options(const ddp_pipeline_options *o, int p) {
  if (o->n_microbatches < 1)
    return ddp_error(DDP_ERR_INVALID, "pipeline: n_microbatches must be >= 1 (got %d)",
                     o->n_microbatches);
  if (o->schedule > DDP_PIPELINE_INTERLEAVED)
    return ddp_error(DDP_ERR_INVALID, "pipeline: schedule must be gpipe, 1f1b or interleaved");
  if (o->virtual_stages < 1 || o->virtual_stages > DDP_PIPELINE_MAX_VIRTUAL)
    return ddp_error(DDP_ERR_INVALID, "pipeline: virtual_stages must be in [1, %d] (got %d)",
                     DDP_PIPELINE_MAX_VIRTUAL, o->virtual_stages);
  if (o->max_batch < o->n_microbatches)
    return ddp_error(DDP_ERR_INVALID, "pipeline: max_batch (%lld) is below the %d micro-batches",
                     (long long)o->max_batch, o->n_microbatches);
  if (o->grad_scale < 0 || !isfinite(o->grad_scale))
    return ddp_error(DDP_ERR_INVALID, "pipeline: grad_scale must be finite and >= 0");
  (void)p;
  if (o->device.type != DDP_DEVICE_CPU) {
    ddp_status s = ddp_device_check(o->device);
    if (s != DDP_OK) return ddp_error_wrap(s, "pipeline: options.device");
  }
  return DDP_OK;
}

/* The stages onto their device, once the host-side setup is done: the
 * stage's model, the batch-size header's device copy and the pinned
 * losses. */
static ddp_status place_on_device(ddp_pipeline *pp) {
  if (pp->device.type == DDP_DEVICE_CPU) return DDP_OK;
  char dev[DDP_DEVICE_STR_BYTES];
  ddp_device_str(pp->device, dev, sizeof dev);
  ddp_status s = ddp_model_to(pp->model, pp->device);
  if (s != DDP_OK) return ddp_error_wrap(s, "pipeline: moving rank %d's stages to %s", pp->rank, dev);
  int64_t two = 2;
  DDP_TRY(ddp_tensor_create_on(&pp->header_dev, DDP_INT64, 1, &two, pp->device));
  s = ddp_pinned_alloc(pp->device, sizeof(float) * (size_t)pp->m, (void **)&pp->loss_host);
  if (s != DDP_OK) return ddp_error_wrap(s, "pipeline: pinned memory for the losses on %s", dev);
  return DDP_OK;
}

static ddp_status create(ddp_pipeline *pp, ddp_model *full) {
  const ddp_pipeline_options *o = &pp->options;
  DDP_TRY(ddp_pipeline_schedule_create(&pp->train, o->schedule, pp->p, pp->m, pp->v));
  DDP_TRY(ddp_pipeline_schedule_create(&pp->eval, DDP_PIPELINE_FORWARD_ONLY, pp->p, pp->m, pp->v));
  DDP_TRY(ddp_pipeline_schedule_check(pp->train, NULL));
  DDP_TRY(ddp_pipeline_schedule_check(pp->eval, NULL));

  if (o->sample_ndim > 0) {
    pp->stage_ndim[0] = o->sample_ndim;
    memcpy(pp->stage_shape[0], o->sample_shape, sizeof o->sample_shape);
  } else {
    pp->stage_ndim[0] = ddp_model_sample_shape(full, pp->stage_shape[0]);
  }
  if (pp->stage_ndim[0] <= 0 || pp->stage_ndim[0] >= DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline: the input's sample shape is unknown: set options.sample_shape "
                     "or ddp_model_set_sample_shape");

  /* The top-level modules, in forward order. */
  int n = ddp__pp_top_modules(full, NULL, 0);
  ddp_module **mods = ddp_alloc(sizeof(ddp_module *) * (size_t)(n ? n : 1));
  pp->names = ddp_calloc((size_t)(n ? n : 1), sizeof(char *));
  if (!mods || !pp->names) {
    ddp_free(mods);
    return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  }
  ddp__pp_top_modules(full, mods, n);
  pp->n_mods = n;
  ddp_status s = DDP_OK;
  for (int k = 0; k < n && s == DDP_OK; k++)
    if (!(pp->names[k] = ddp_strdup(mods[k]->name)))
      s = ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  if (s == DDP_OK && n < pp->n_stages)
    s = ddp_error(DDP_ERR_INVALID,
                  "pipeline: the model has %d top-level modules, fewer than the %d stages "
                  "(%d ranks x %d virtual stages)", n, pp->n_stages, pp->p, pp->v);
  if (s == DDP_OK) s = decide_split(pp, full, mods);

  /* This rank's modules, copied with their values and names. */
  bool *keep = NULL;
  int total = 0;
  for (ddp_module *c = full->root->first_child; c; c = c->next_sibling) total++;
  if (s == DDP_OK && !(keep = ddp_calloc((size_t)(total ? total : 1), sizeof(bool))))
    s = ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  for (int ci = 0; s == DDP_OK && ci < pp->v; ci++) {
    int g = ci * pp->p + pp->rank;
    for (int k = pp->bounds[g]; k < pp->bounds[g + 1]; k++)
      keep[ddp__pp_registration_index(full, mods[k])] = true;
  }
  if (s == DDP_OK) s = ddp__pp_clone(full, keep, &pp->model);
  ddp_free(keep);
  ddp_free(mods);
  for (int ci = 0; s == DDP_OK && ci < pp->v; ci++) {
    pp_chunk *c = &pp->chunks[ci];
    c->stage = ci * pp->p + pp->rank;
    c->n_mods = pp->bounds[c->stage + 1] - pp->bounds[c->stage];
    c->mods = ddp_alloc(sizeof(ddp_module *) * (size_t)c->n_mods);
    if (!c->mods) s = ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
    for (int k = 0; s == DDP_OK && k < c->n_mods; k++)
      c->mods[k] = ddp__pp_find_top(pp->model, pp->names[pp->bounds[c->stage] + k]);
  }
  /* A copy that failed on one rank must fail everywhere before the shapes
   * are exchanged. */
  ddp_status all = DDP_OK;
  for (int r = 0; r < pp->p; r++) {
    ddp_status got = agree(pp->host_pg, r, s, "this rank's stages");
    if (got != DDP_OK && all == DDP_OK) all = got;
  }
  if (all != DDP_OK) return all;
  DDP_TRY(exchange_shapes(pp));
  /* A failure to place the stages on their device is every rank's. */
  s = place_on_device(pp);
  all = DDP_OK;
  for (int r = 0; r < pp->p; r++) {
    ddp_status got = agree(pp->host_pg, r, s, "placing the stages on their devices");
    if (got != DDP_OK && all == DDP_OK) all = got;
  }
  if (all != DDP_OK) return all;
  DDP_TRY(alloc_chunks(pp));
  return ddp__pp_channels_create(&pp->channels, pp->pg, pp->train, pp->options.timeout_s);
}

ddp_status ddp_pipeline_create(ddp_pipeline **out, ddp_model *model, ddp_process_group *pg,
                               const ddp_pipeline_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "pipeline: out is NULL");
  *out = NULL;
  if (!model || !pg) return ddp_error(DDP_ERR_INVALID, "pipeline: model and group must be given");
  ddp_pipeline_options o = options ? *options : ddp_pipeline_defaults();
  int p = ddp_process_group_size(pg);
  DDP_TRY(check_options(&o, p));
  ddp_pipeline *pp = ddp_calloc(1, sizeof *pp);
  if (!pp) return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  pp->pg = pg;
  pp->rank = ddp_process_group_rank(pg);
  pp->p = p;
  pp->v = o.virtual_stages;
  pp->m = o.n_microbatches;
  pp->n_stages = p * pp->v;
  pp->options = o;
  pp->options.split = o.split; /* the caller's string until setup ends; pp->split keeps it */
  pp->device = o.device;
  pp->host_pg = pg;
  pp->max_rows = (o.max_batch + o.n_microbatches - 1) / o.n_microbatches;
  pp->grad_scale = o.grad_scale > 0 ? (float)o.grad_scale : 1.0f / (float)o.n_microbatches;
  pp->scale = pp->grad_scale;
  ddp_status s = ddp_process_group_takes_host(pg) ? DDP_OK
                                                 : ddp_process_group_host_group(pg, &pp->host_pg);
  if (s != DDP_OK) s = ddp_error_wrap(s, "pipeline: the host group beside the %s group",
                                      ddp_process_group_backend(pg));
  if (s == DDP_OK) s = create(pp, model);
  pp->options.split = NULL;
  if (s != DDP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
    ddp_pipeline_destroy(pp);
    return ddp_error(s, "%s", msg);
  }
  *out = pp;
  return DDP_OK;
}

void ddp_pipeline_destroy(ddp_pipeline *pp) {
  if (!pp) return;
  ddp__pp_chunks_free(pp);
  ddp__pp_channels_destroy(pp->channels);
  ddp_pipeline_schedule_destroy(pp->train);
  ddp_pipeline_schedule_destroy(pp->eval);
  if (pp->names)
    for (int k = 0; k < pp->n_mods; k++) ddp_free(pp->names[k]);
  ddp_free(pp->names);
  ddp_free(pp->rows);
  ddp_free(pp->offsets);
  ddp_tensor_destroy(pp->header_dev);
  ddp_pinned_free(pp->loss_host);
  ddp_model_destroy(pp->model);
  ddp_free(pp);
}

/* ---- Accessors ------------------------------------------------------------------ */

ddp_model *ddp_pipeline_model(ddp_pipeline *pp) { return pp->model; }
int ddp_pipeline_rank(const ddp_pipeline *pp) { return pp->rank; }
int ddp_pipeline_num_ranks(const ddp_pipeline *pp) { return pp->p; }
int ddp_pipeline_virtual_stages(const ddp_pipeline *pp) { return pp->v; }
int ddp_pipeline_num_stages(const ddp_pipeline *pp) { return pp->n_stages; }
int ddp_pipeline_num_microbatches(const ddp_pipeline *pp) { return pp->m; }
bool ddp_pipeline_is_first(const ddp_pipeline *pp) { return pp->rank == 0; }
bool ddp_pipeline_is_last(const ddp_pipeline *pp) {
  return ddp__pp_rank_of(pp->p, pp->n_stages - 1) == pp->rank;
}
int ddp_pipeline_stage_index(const ddp_pipeline *pp, int chunk) {
  return chunk >= 0 && chunk < pp->v ? chunk * pp->p + pp->rank : -1;
}
int ddp_pipeline_stage_modules(const ddp_pipeline *pp, int stage, int *first, int *last) {
  if (stage < 0 || stage >= pp->n_stages) return 0;
  if (first) *first = pp->bounds[stage];
  if (last) *last = pp->bounds[stage + 1] - 1;
  return pp->bounds[stage + 1] - pp->bounds[stage];
}
const char *ddp_pipeline_module_name(const ddp_pipeline *pp, int index) {
  return index >= 0 && index < pp->n_mods ? pp->names[index] : NULL;
}
const char *ddp_pipeline_split(const ddp_pipeline *pp) { return pp->split; }
int ddp_pipeline_input_shape(const ddp_pipeline *pp, int64_t shape[DDP_MAX_DIMS]) {
  memcpy(shape, pp->stage_shape[0], sizeof pp->stage_shape[0]);
  return pp->stage_ndim[0];
}
int ddp_pipeline_output_shape(const ddp_pipeline *pp, int64_t shape[DDP_MAX_DIMS]) {
  memcpy(shape, pp->stage_shape[pp->n_stages], sizeof pp->stage_shape[0]);
  return pp->stage_ndim[pp->n_stages];
}
const ddp_pipeline_schedule *ddp_pipeline_get_schedule(const ddp_pipeline *pp) {
  return pp->train;
}
void ddp_pipeline_set_loss_scale(ddp_pipeline *pp, float loss_scale) {
  DDP_ASSERT(isfinite(loss_scale) && loss_scale > 0);
  /* In float32, as the seed is: exact for the power-of-two scales a
   * GradScaler with its default factors keeps. */
  pp->scale = pp->grad_scale * loss_scale;
}

void ddp_pipeline_set_grad_sync(ddp_pipeline *pp, ddp_pipeline_grad_sync_fn fn, void *user) {
  pp->sync_fn = fn;
  pp->sync_user = user;
}
ddp_status ddp_pipeline_allreduce_grads(void *dp_group, ddp_model *stage_model) {
  int64_t n = ddp_model_num_param_elements(stage_model);
  if (!dp_group || n == 0) return DDP_OK;
  ddp_status s = ddp_allreduce((ddp_process_group *)dp_group, ddp_model_grads_flat(stage_model),
                               (size_t)n, DDP_FLOAT32, DDP_REDUCE_AVG);
  return s == DDP_OK ? s : ddp_error_wrap(s, "pipeline: averaging the stage's gradients");
}
void ddp_pipeline_get_stats(const ddp_pipeline *pp, ddp_pipeline_stats *out) { *out = pp->stats; }
void ddp_pipeline_reset_stats(ddp_pipeline *pp) {
  memset(&pp->stats, 0, sizeof pp->stats);
  pp->sum_wait_s = pp->sum_step_s = 0;
}
