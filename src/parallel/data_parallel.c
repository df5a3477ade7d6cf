/* DataParallel (parallel.h, docs/parallel.md "DataParallel"): one process,
 * N replicas as threads. The forward scatters the batch, runs the
 * replicas' forwards on their tapes and gathers the outputs into one
 * tensor on the caller's tape, recorded as an op whose backward runs the
 * replicas' backwards and sums their gradients into the model's buffer.
 * Replica 0 is the model itself, on the caller's thread. */
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "ddp/parallel.h"
#include "nn/module.h"
#include "parallel/replica_pool.h"
#include "tensor/tape.h"

#define DP_DEFAULT_TIMEOUT_MS 300000
#define DP_TAPE_BYTES (1u << 20)

/* What SyncBatchNorm's allreduce_sum gets as `user`: which replica calls. */
typedef struct replica_sync {
  ddp__replica_pool *pool;
  int index;
} replica_sync;

struct ddp_data_parallel {
  ddp_model *model;
  int n;
  ddp_model **rep;       /* n; rep[0] is model */
  ddp_tape **tapes;      /* n: each replica records on its own */
  ddp_tensor *x_slices;  /* n views of the current input's rows */
  ddp_tensor **outs;     /* n: each replica's output (its tape's) */
  int64_t *first, *rows; /* n: the rows of the batch each replica takes */
  ddp__replica_pool *pool;
  replica_sync *sync;    /* n */
  bool sync_bn;
  bool saved_synced;     /* model's batch norm sync before the wrapper */
  ddp_batch_norm_sync saved_sync;
  /* The current job's inputs. */
  bool grad_enabled;
  ddp_precision precision; /* the caller's autocast region, entered in every replica */
  const float *dout;     /* backward: d loss / d gathered output */
  int64_t out_row;       /* elements per row of the outputs */
  uint64_t forwards;     /* forwards run; a gather op remembers its own */
};

/* What the gather op keeps on the caller's tape. */
typedef struct gather_ctx {
  ddp_data_parallel *dp;
  uint64_t forward; /* dp->forwards when it was recorded */
} gather_ctx;

ddp_data_parallel_options ddp_data_parallel_defaults(void) {
  return (ddp_data_parallel_options){.device = DDP_CPU, .pin_threads = true};
}

ddp_model *ddp_data_parallel_module(ddp_data_parallel *dp) { return dp->model; }
int ddp_data_parallel_num_replicas(const ddp_data_parallel *dp) { return dp->n; }
int ddp_data_parallel_replica_cpu(const ddp_data_parallel *dp, int replica) {
  return ddp__replica_pool_cpu(dp->pool, replica);
}

static ddp_status replicas_allreduce_sum(void *user, double *buf, size_t count) {
  replica_sync *s = user;
  return ddp__replica_pool_allreduce_sum(s->pool, s->index, buf, count);
}

/* ---- Construction ---- */

/* The cores each replica's thread goes on (cpus[0] unused: the caller's),
 * from device_ids or the affinity mask; *n the number of replicas. */
static ddp_status place_replicas(const ddp_data_parallel_options *o, int *n, int **cpus_out) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) != 0) CPU_SET(0, &mask);
  int allowed[CPU_SETSIZE], n_allowed = 0;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &mask)) allowed[n_allowed++] = c;
  if (o->replicas < 0)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: options.replicas = %d: must be >= 1 (or 0: "
                                      "one per core)", (int)o->replicas);
  if (o->device_ids && o->n_device_ids <= 0)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: options.n_device_ids = %d with device_ids "
                                      "set", (int)o->n_device_ids);
  if (o->device_ids && o->replicas > 0 && o->replicas != o->n_device_ids)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: options.replicas = %d but %d device_ids",
                     (int)o->replicas, (int)o->n_device_ids);
  *n = o->replicas > 0 ? o->replicas : o->device_ids ? o->n_device_ids : n_allowed;
  int *cpus = ddp_calloc((size_t)*n, sizeof *cpus);
  if (!cpus) return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
  for (int r = 0; r < *n; r++) {
    cpus[r] = -1;
    if (o->device_ids) {
      int id = o->device_ids[r];
      if (id < 0 || id >= CPU_SETSIZE || !CPU_ISSET(id, &mask)) {
        ddp_free(cpus);
        return ddp_error(DDP_ERR_INVALID, "DataParallel: device_ids[%d] = %d: no such core among "
                                          "the %d this process may run on (the first is %d, the "
                                          "last %d)", r, id, n_allowed, allowed[0],
                         allowed[n_allowed - 1]);
      }
      for (int q = 0; q < r; q++)
        if (o->device_ids[q] == id) {
          ddp_free(cpus);
          return ddp_error(DDP_ERR_INVALID, "DataParallel: device_ids[%d] and [%d] are both "
                                            "core %d: each replica needs a core of its own", q,
                           r, id);
        }
      if (o->pin_threads) cpus[r] = id;
    } else if (o->pin_threads && *n <= n_allowed) {
      cpus[r] = allowed[r]; /* not enough cores: let the kernel spread them */
    }
  }
  *cpus_out = cpus;
  return DDP_OK;
}

static ddp_status check_model(ddp_model *model, const ddp_data_parallel_options *o) {
  if (!model || !model->finalized)
    return ddp_error(DDP_ERR_STATE, "DataParallel: the model must be finalized");
  if (o->device.type != DDP_DEVICE_CPU || model->device.type != DDP_DEVICE_CPU) {
    char name[DDP_DEVICE_STR_BYTES];
    ddp_device_str(o->device.type != DDP_DEVICE_CPU ? o->device : model->device, name,
                   sizeof name);
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "DataParallel: device %s: replicas run on the CPU only for now (GPU "
                     "replicas need the NCCL backend's broadcast and reduce); keep the model "
                     "and options.device on the CPU",
                     name);
  }
  if (o->dim != 0)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "DataParallel: options.dim = %d: only dim 0 (the batch) is scattered and "
                     "gathered", (int)o->dim);
  if (model->wrapped_by)
    return ddp_error(DDP_ERR_STATE, "DataParallel: the model is already wrapped by %s; wrap a "
                                    "model once (DataParallel or DistributedDataParallel)",
                     model->wrapped_by);
  if (model->params_borrowed)
    return ddp_error(DDP_ERR_STATE, "DataParallel: the model is a replica of another model");
  if (model->bn_synced)
    return ddp_error(DDP_ERR_INVALID,
                     "DataParallel: the model's batch norm is synchronized over a process group "
                     "(ddp_model_convert_sync_batchnorm); DataParallel synchronizes across its "
                     "replicas with options.sync_batch_norm");
  return DDP_OK;
}

static ddp_status alloc_arrays(ddp_data_parallel *dp) {
  size_t n = (size_t)dp->n;
  dp->rep = ddp_calloc(n, sizeof *dp->rep);
  dp->tapes = ddp_calloc(n, sizeof *dp->tapes);
  dp->x_slices = ddp_calloc(n, sizeof *dp->x_slices);
  dp->outs = ddp_calloc(n, sizeof *dp->outs);
  dp->first = ddp_calloc(n, sizeof *dp->first);
  dp->rows = ddp_calloc(n, sizeof *dp->rows);
  dp->sync = ddp_calloc(n, sizeof *dp->sync);
  if (!dp->rep || !dp->tapes || !dp->x_slices || !dp->outs || !dp->first || !dp->rows ||
      !dp->sync)
    return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
  return DDP_OK;
}

ddp_status ddp_data_parallel_create(ddp_data_parallel **out, ddp_model *model,
                                    const ddp_data_parallel_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "DataParallel: create: out is NULL");
  *out = NULL;
  ddp_data_parallel_options o = options ? *options : ddp_data_parallel_defaults();
  if (o.timeout_ms <= 0) o.timeout_ms = DP_DEFAULT_TIMEOUT_MS;
  DDP_TRY(check_model(model, &o));
  int n, *cpus;
  DDP_TRY(place_replicas(&o, &n, &cpus));
  ddp_data_parallel *dp = ddp_calloc(1, sizeof *dp);
  if (!dp) {
    ddp_free(cpus);
    return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
  }
  dp->model = model;
  dp->n = n;
  dp->sync_bn = o.sync_batch_norm;
  ddp_status s = alloc_arrays(dp);
  dp->saved_synced = model->bn_synced;
  dp->saved_sync = model->bn_sync;
  model->wrapped_by = "DataParallel"; /* from here destroy undoes everything */
  if (s == DDP_OK) dp->rep[0] = model;
  for (int r = 1; r < n && s == DDP_OK; r++) {
    s = ddp_model_replicate(model, &dp->rep[r]);
    /* Replicas draw dropout masks of their own. */
    if (s == DDP_OK) ddp_model_seed_dropout(dp->rep[r], ddp_rng_next(&model->dropout_rng) + (uint64_t)r);
  }
  for (int r = 0; r < n && s == DDP_OK; r++) s = ddp_tape_create(&dp->tapes[r], DP_TAPE_BYTES);
  /* SyncBatchNorm sums 2C + 1 doubles at most, C <= the buffers' 2 C. */
  if (s == DDP_OK)
    s = ddp__replica_pool_create(&dp->pool, n, cpus, o.timeout_ms,
                                 (size_t)model->n_buffer_elems + 8);
  ddp_free(cpus);
  for (int r = 0; r < n && s == DDP_OK && dp->sync_bn; r++) {
    dp->sync[r] = (replica_sync){.pool = dp->pool, .index = r};
    ddp_batch_norm_sync sync = {.allreduce_sum = replicas_allreduce_sum, .user = &dp->sync[r]};
    ddp_model_set_batch_norm_sync(dp->rep[r], &sync);
  }
  if (s != DDP_OK) {
    ddp_data_parallel_destroy(dp);
    return ddp_error_wrap(s, "DataParallel: create");
  }
  *out = dp;
  return DDP_OK;
}

void ddp_data_parallel_destroy(ddp_data_parallel *dp) {
  if (!dp) return;
  ddp__replica_pool_destroy(dp->pool);
  for (int r = 0; dp->tapes && r < dp->n; r++) ddp_tape_destroy(dp->tapes[r]);
  for (int r = 1; dp->rep && r < dp->n; r++) ddp_model_destroy(dp->rep[r]);
  ddp_model_set_batch_norm_sync(dp->model, dp->saved_synced ? &dp->saved_sync : NULL);
  dp->model->wrapped_by = NULL;
  ddp_free(dp->rep);
  ddp_free(dp->tapes);
  ddp_free(dp->x_slices);
  ddp_free(dp->outs);
  ddp_free(dp->first);
  ddp_free(dp->rows);
  ddp_free(dp->sync);
  ddp_free(dp);
}

/* ---- The step ---- */

static ddp_status forward_part(void *ctx, int r) {
  ddp_data_parallel *dp = ctx;
  ddp_tape_reset(dp->tapes[r]);
  ddp_tape_set_grad_enabled(dp->tapes[r], dp->grad_enabled);
  /* Autocast regions are per thread: the caller's reaches every replica's
   * thread, as PyTorch's parallel_apply carries torch.autocast's state. */
  const bool region = dp->precision != DDP_PRECISION_FP32;
  if (region) DDP_TRY(ddp_autocast_enter(dp->precision));
  ddp_status s = ddp_model_forward(dp->rep[r], dp->tapes[r], &dp->x_slices[r], &dp->outs[r]);
  if (region) (void)ddp_autocast_exit();
  return s;
}

/* Replica r's backward on its rows of the output's gradient, then (after
 * every replica's) its share of the reduction: elements [lo, hi) of the
 * model's gradient buffer get every other replica's, in replica order. */
static ddp_status backward_part(void *ctx, int r) {
  ddp_data_parallel *dp = ctx;
  ddp_model *model = dp->model;
  const int64_t n_elems = model->n_param_elems;
  if (r > 0) memset(dp->rep[r]->grads_flat, 0, (size_t)n_elems * sizeof(float));
  if (dp->outs[r]->flags & DDP_TENSOR_REQUIRES_GRAD)
    DDP_TRY(ddp__backward_from(dp->tapes[r], dp->outs[r], dp->dout + dp->first[r] * dp->out_row));
  DDP_TRY(ddp__replica_pool_barrier(dp->pool, r));
  /* Ranges in whole cache lines (16 floats), so no two threads write one. */
  const int64_t lines = (n_elems + 15) / 16;
  int64_t lo = lines * r / dp->n * 16, hi = lines * (r + 1) / dp->n * 16;
  if (hi > n_elems) hi = n_elems;
  float *g = model->grads_flat;
  for (int q = 1; q < dp->n; q++) {
    const float *gq = dp->rep[q]->grads_flat;
    for (int64_t i = lo; i < hi; i++) g[i] += gq[i];
  }
  return DDP_OK;
}

static ddp_status gather_backward(ddp_tape *tape, ddp__node *node) {
  (void)tape;
  const gather_ctx *c = node->ctx;
  ddp_data_parallel *dp = c->dp;
  if (c->forward != dp->forwards)
    return ddp_error(DDP_ERR_STATE, "DataParallel: backward of forward %llu after forward %llu: "
                                    "the replicas keep only the last forward",
                     (unsigned long long)c->forward, (unsigned long long)dp->forwards);
  dp->dout = node->out->grad;
  return ddp__replica_pool_run(dp->pool, backward_part, dp, "backward");
}

/* Splits x's rows over the replicas: B / N each, the first B % N one more. */
static ddp_status scatter(ddp_data_parallel *dp, ddp_tensor *x) {
  char buf[DDP_SHAPE_STR_BYTES];
  if (x->ndim < 1 || x->device.type != DDP_DEVICE_CPU)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: forward: the input %s must be a CPU tensor "
                                      "with a batch dimension", DDP__SHAPE(x, buf));
  const int64_t b = x->shape[0];
  if (b < dp->n)
    return ddp_error(DDP_ERR_INVALID,
                     "DataParallel: forward: a batch of %lld rows (input %s) cannot be scattered "
                     "over %d replicas: each needs at least one row; make the batch at least %d "
                     "or use fewer replicas",
                     (long long)b, DDP__SHAPE(x, buf), dp->n, dp->n);
  const int64_t row = x->numel / b, base = b / dp->n, extra = b % dp->n;
  int64_t first = 0;
  for (int r = 0; r < dp->n; r++) {
    ddp_tensor *v = &dp->x_slices[r];
    *v = *x;
    dp->first[r] = first;
    dp->rows[r] = base + (r < extra);
    v->shape[0] = dp->rows[r];
    v->numel = dp->rows[r] * row;
    v->data = (char *)x->data + (size_t)(first * row) * ddp_dtype_size(x->dtype);
    v->grad = NULL;
    v->flags = 0; /* a leaf of each replica's tape that needs no gradient */
    v->node = -1;
    v->pending = 0;
    first += dp->rows[r];
  }
  return DDP_OK;
}

/* Buffers as PyTorch's replicate() leaves them: every replica starts each
 * forward from the model's running statistics, and only replica 0's (the
 * model's own) updates are kept. */
static void broadcast_buffers(ddp_data_parallel *dp) {
  ddp_model *m = dp->model;
  for (int r = 1; r < dp->n; r++) {
    ddp_model *q = dp->rep[r];
    memcpy(q->buffers_flat, m->buffers_flat, (size_t)m->n_buffer_elems * sizeof(float));
    memcpy(q->counters, m->counters, (size_t)m->n_counters * sizeof(int64_t));
    q->training = m->training;
  }
}

static ddp_status gather(ddp_data_parallel *dp, ddp_tape *tape, ddp_tensor **out) {
  const ddp_tensor *o0 = dp->outs[0];
  char a[DDP_SHAPE_STR_BYTES], b[DDP_SHAPE_STR_BYTES];
  int64_t shape[DDP_MAX_DIMS], total = 0;
  memcpy(shape, o0->shape, sizeof shape);
  for (int r = 0; r < dp->n; r++) {
    const ddp_tensor *o = dp->outs[r];
    bool same = o->ndim == o0->ndim && o->dtype == o0->dtype && o->ndim >= 1 &&
                o->shape[0] == dp->rows[r];
    for (int d = 1; same && d < o->ndim; d++) same = o->shape[d] == o0->shape[d];
    if (!same)
      return ddp_error(DDP_ERR_SHAPE, "DataParallel: gather: replica %d's output %s does not "
                                      "match replica 0's %s along dims other than 0",
                       r, DDP__SHAPE(o, a), DDP__SHAPE(o0, b));
    total += o->shape[0];
  }
  shape[0] = total;
  ddp_tensor *g;
  DDP_TRY(ddp__tape_output(tape, "data_parallel_gather", o0->dtype, o0->ndim, shape, DDP_CPU, &g));
  /* The replicas' outputs hold low-precision values under autocast: so
   * does their concatenation. */
  ddp__tape_mark_like(g, o0);
  dp->out_row = total ? g->numel / total : 0;
  const size_t elem = ddp_dtype_size(o0->dtype);
  for (int r = 0; r < dp->n; r++)
    memcpy((char *)g->data + (size_t)(dp->first[r] * dp->out_row) * elem, dp->outs[r]->data,
           (size_t)dp->outs[r]->numel * elem);
  if (dp->grad_enabled && (o0->flags & DDP_TENSOR_REQUIRES_GRAD)) {
    gather_ctx *c = ddp_tape_scratch(tape, sizeof *c);
    if (!c) return ddp_error(DDP_ERR_NOMEM, "DataParallel: gather: no tape memory");
    *c = (gather_ctx){.dp = dp, .forward = dp->forwards};
    DDP_TRY(ddp__tape_record(tape, "data_parallel_gather", gather_backward, g, 0, NULL, c));
  }
  *out = g;
  return DDP_OK;
}

ddp_status ddp_data_parallel_forward(ddp_data_parallel *dp, ddp_tape *tape, ddp_tensor *x,
                                     ddp_tensor **out) {
  if (!dp || !tape || !x || !out)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: forward: dp, tape, x and out are required");
  *out = NULL;
  DDP_TRY(scatter(dp, x));
  broadcast_buffers(dp);
  dp->grad_enabled = ddp_tape_grad_enabled(tape);
  dp->precision = ddp_autocast_precision();
  dp->forwards++;
  DDP_TRY(ddp__replica_pool_run(dp->pool, forward_part, dp, "forward"));
  return gather(dp, tape, out);
}

/* ---- State dict ---- */

ddp_status ddp_data_parallel_save(ddp_data_parallel *dp, const char *path, const ddp_kv *metadata,
                                  size_t metadata_count) {
  if (!dp || !path) return ddp_error(DDP_ERR_INVALID, "DataParallel: save: dp and path required");
  if (metadata_count > 62)
    return ddp_error(DDP_ERR_INVALID, "DataParallel: save: %zu metadata pairs (at most 62)",
                     metadata_count);
  const ddp_model *m = dp->model;
  const int n = ddp_model_state_count(m);
  size_t name_bytes = 0;
  ddp_state_entry e;
  for (int i = 0; i < n; i++) {
    DDP_TRY(ddp_model_state_entry(m, i, &e));
    name_bytes += strlen(e.name) + sizeof "module.";
  }
  ddp_safetensors_entry *entries = ddp_calloc(n ? (size_t)n : 1, sizeof *entries);
  char *names = ddp_alloc(name_bytes + 1);
  if (!entries || !names) {
    ddp_free(entries);
    ddp_free(names);
    return ddp_error(DDP_ERR_NOMEM, "DataParallel: save: out of memory");
  }
  char *p = names;
  for (int i = 0; i < n; i++) {
    ddp_status st = ddp_model_state_entry(m, i, &e);
    DDP_ASSERT(st == DDP_OK); /* every index below the count was just read */
    size_t len = (size_t)snprintf(p, name_bytes + 1 - (size_t)(p - names), "module.%s", e.name);
    entries[i] = (ddp_safetensors_entry){.name = p, .dtype = e.dtype, .ndim = e.ndim,
                                         .data = e.data};
    memcpy(entries[i].shape, e.shape, sizeof e.shape);
    p += len + 1;
  }
  ddp_kv meta[64] = {{"format", "pt"}, {"ddp.model", ddp_model_name(m)}};
  for (size_t i = 0; i < metadata_count; i++) meta[2 + i] = metadata[i];
  ddp_status s = ddp_safetensors_write(path, entries, (size_t)n, meta, 2 + metadata_count);
  ddp_free(entries);
  ddp_free(names);
  return s;
}
