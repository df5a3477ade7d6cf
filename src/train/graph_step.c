/* The trainer's CUDA-graph step (ddp_train_options.cuda_graph; docs/cuda.md,
 * "CUDA graphs"): a small model's step on a GPU is bound by kernel
 * launches, so the step of a full batch (zero_grad, forward, loss,
 * backward, the loss's copy into pinned memory) is captured once and
 * replayed, one launch, for every later full batch. The optimizer stays
 * eager, launched after each replay: its step count and learning rate are
 * kernel arguments that change from step to step. Everything the graph
 * touches is the graph's alone and fixed for the run: its own tape (whose
 * arena holds the step's tensors at the captured addresses), its own
 * input buffers (each batch is copied into them), a pinned float for the
 * loss. Smaller batches and evaluation run eagerly on the trainer's tape
 * and buffers, which the graph never sees. */
#include <stdlib.h>
#include <string.h>

#include "train/train_internal.h"

/* Eager steps on the graph's tape before the capture: the first grows
 * its arena, the next merges its chunks into one; after that a step
 * allocates nothing, which a capture requires (no cudaMalloc inside). */
#define GRAPH_WARMUP_STEPS 3

typedef struct ddp__train_graph {
  ddp_tape *tape;
  ddp_tensor *x, *y;       /* one full batch on the device, allocated once */
  float *loss_host;        /* pinned: the graph copies the loss here */
  ddp_tensor *loss;        /* the captured loss (on tape) */
  ddp_cuda_graph *graph;   /* NULL until captured */
  int warm;                /* eager steps run on tape so far */
  int n_counters;
  int64_t *counter_delta;  /* what one step adds to each BatchNorm counter */
} ddp__train_graph;

/* ---- Preconditions -------------------------------------------------------- */

/* The first dropout module with p > 0 in `model`'s description, as
 * "(name): Dropout(p=0.5)" into which; false when there is none. The
 * description is the public view of the module tree. */
static bool find_dropout(const ddp_model *model, char *which, size_t bytes) {
  size_t need = ddp_model_describe(model, NULL, 0) + 1;
  char *text = ddp_alloc(need);
  if (!text) return false;
  ddp_model_describe(model, text, need);
  bool found = false;
  for (char *line = text; line && *line && !found;) {
    char *end = strchr(line, '\n');
    if (end) *end = '\0';
    char *kind = strstr(line, "): Dropout");
    double p = 0;
    if (kind) {
      const char *paren = strchr(kind + 3, '(');
      if (paren && sscanf(paren, "(p=%lf", &p) == 1 && p > 0) {
        while (*line == ' ') line++;
        snprintf(which, bytes, "%s", line);
        found = true;
      }
    }
    line = end ? end + 1 : NULL;
  }
  ddp_free(text);
  return found;
}

ddp_status ddp__train_graph_check(const ddp_train_options *o, const ddp_model *model,
                                  const ddp_process_group *pg) {
  char name[DDP_DEVICE_STR_BYTES];
  ddp_device_str(o->device, name, sizeof name);
  if (o->device.type != DDP_DEVICE_CUDA)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "cuda_graph: CUDA graphs replay GPU work and the device is %s; train on "
                     "a GPU (device cuda) or leave cuda_graph off",
                     name);
  if (o->sync_bn || ddp_model_batch_norm_synced(model))
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "cuda_graph on %s: SyncBatchNorm sums its statistics across ranks on the "
                     "host in every step, which a replayed graph cannot do; leave sync_bn off",
                     name);
  if (o->strategy == DDP_TRAIN_DATA_PARALLEL || (o->strategy == DDP_TRAIN_AUTO && pg))
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "cuda_graph on %s: data parallelism reduces gradients from hooks on the "
                     "host during backward, which a replayed graph would skip; train one "
                     "process (strategy single)",
                     name);
  char which[128];
  if (find_dropout(model, which, sizeof which))
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "cuda_graph on %s: the model has dropout (%s), whose masks are drawn on "
                     "the host each step; a replayed graph would reuse one mask forever",
                     name, which);
  return DDP_OK;
}

/* ---- Life ------------------------------------------------------------------- */

ddp_status ddp__train_graph_create(ddp_trainer *t) {
  ddp__train_graph *g = ddp_calloc(1, sizeof *g);
  if (!g) return ddp_error(DDP_ERR_NOMEM, "cuda_graph: out of memory");
  t->graph = g;
  g->n_counters = ddp_model_num_counters(t->model);
  g->counter_delta = ddp_calloc((size_t)g->n_counters + 1, sizeof *g->counter_delta);
  if (!g->counter_delta) return ddp_error(DDP_ERR_NOMEM, "cuda_graph: out of memory");
  DDP_TRY(ddp_tape_create(&g->tape, 16 << 20));
  void *pinned;
  DDP_TRY(ddp_pinned_alloc(t->o.device, sizeof(float), &pinned));
  g->loss_host = pinned;
  return DDP_OK;
}

void ddp__train_graph_destroy(ddp_trainer *t) {
  ddp__train_graph *g = t->graph;
  if (!g) return;
  /* The graph first: its replays write the tape's and buffers' memory. */
  ddp_cuda_graph_destroy(g->graph);
  ddp_tape_destroy(g->tape);
  ddp_tensor_destroy(g->x);
  ddp_tensor_destroy(g->y);
  ddp_pinned_free(g->loss_host);
  ddp_free(g->counter_delta);
  ddp_free(g);
  t->graph = NULL;
}

ddp_tape *ddp__train_graph_tape(const ddp_trainer *t) { return t->graph ? t->graph->tape : NULL; }

bool ddp__train_graph_takes(const ddp_trainer *t, const ddp_batch *b) {
  return t->graph && b->size == t->o.batch_size;
}

/* ---- The step --------------------------------------------------------------- */

/* The captured work: the eager step without the loss's read-back (copied
 * into pinned memory instead) and without the optimizer. */
static ddp_status record_step(ddp_trainer *t, ddp__train_graph *g, ddp_tensor *x, ddp_tensor *y) {
  ddp_tensor *out;
  ddp_model_zero_grad(t->model);
  /* forward and loss in autocast's region (bf16/fp16), as the eager step:
   * the captured conversions of the parameters rerun at every replay */
  DDP_TRY(ddp__train_autocast_enter(t));
  ddp_status s = t->strategy->forward(t, g->tape, x, &out);
  if (s == DDP_OK) s = ddp_model_loss(t->model, g->tape, out, y, &g->loss);
  ddp__train_autocast_exit(t);
  if (s != DDP_OK) return ddp_error_wrap(s, "forward and loss");
  s = t->strategy->backward(t, g->tape, g->loss);
  if (s != DDP_OK) return ddp_error_wrap(s, "backward");
  s = ddp_device_copy_async(DDP_CPU, g->loss_host, g->loss->device, g->loss->data, sizeof(float));
  return s == DDP_OK ? s : ddp_error_wrap(s, "copying the loss out");
}

/* Captures the step on (x, y). BatchNorm's num_batches_tracked counters
 * live on the host and move once, during the capture, which runs nothing:
 * they are put back, and each replay adds what the capture added. */
static ddp_status capture(ddp_trainer *t, ddp__train_graph *g, ddp_tensor *x, ddp_tensor *y) {
  int64_t *counters = ddp_model_counters(t->model);
  int64_t *before = g->counter_delta; /* reused: the delta once known */
  if (g->n_counters) memcpy(before, counters, (size_t)g->n_counters * sizeof *counters);
  /* Outside the capture: a reset may merge the arena's chunks (a free and
   * a cudaMalloc), which the warm-up made unnecessary anyway. */
  ddp_tape_reset(g->tape);
  DDP_TRY(ddp_cuda_graph_begin(t->o.device));
  ddp_status s = record_step(t, g, x, y);
  char why[512] = "";
  if (s != DDP_OK) snprintf(why, sizeof why, "%s", ddp_last_error());
  ddp_status ended = ddp_cuda_graph_end(t->o.device, &g->graph);
  for (int i = 0; i < g->n_counters; i++) {
    int64_t after = counters[i];
    counters[i] = before[i];
    g->counter_delta[i] = after - before[i];
  }
  if (s != DDP_OK) {
    /* Its own error, which a refusal also made the capture's. */
    ddp_cuda_graph_destroy(g->graph);
    g->graph = NULL;
    return ddp_error(s, "capturing the step as a CUDA graph: %s", why);
  }
  if (ended != DDP_OK) return ddp_error_wrap(ended, "capturing the step as a CUDA graph");
  return DDP_OK;
}

/* x, y: views of the graph's buffers shaped as b's tensors (made on the
 * first full batch; every later one has the same shapes). */
static ddp_status graph_inputs(ddp_trainer *t, ddp__train_graph *g, ddp_batch *b, ddp_tensor *x,
                               ddp_tensor *y) {
  if (!g->x) DDP_TRY(ddp_tensor_create_on(&g->x, b->x.dtype, b->x.ndim, b->x.shape, t->o.device));
  if (!g->y) DDP_TRY(ddp_tensor_create_on(&g->y, b->y.dtype, b->y.ndim, b->y.shape, t->o.device));
  if (g->x->numel != b->x.numel || g->y->numel != b->y.numel || g->x->dtype != b->x.dtype ||
      g->y->dtype != b->y.dtype)
    return ddp_error(DDP_ERR_SHAPE, "cuda_graph: a full batch of another size than the first");
  DDP_TRY(ddp_tensor_wrap(x, b->x.dtype, b->x.ndim, b->x.shape, g->x->data));
  DDP_TRY(ddp_tensor_wrap(y, b->y.dtype, b->y.ndim, b->y.shape, g->y->data));
  x->device = y->device = t->o.device;
  return DDP_OK;
}

ddp_status ddp__train_graph_step(ddp_trainer *t, ddp_batch *b, float *loss, ddp_train_phases *p) {
  ddp__train_graph *g = t->graph;
  double t0 = ddp_time_s();
  ddp_tensor x, y;
  ddp_status s = graph_inputs(t, g, b, &x, &y);
  if (s == DDP_OK) s = ddp__train_batch_to(t, b, &x, &y);
  if (s != DDP_OK) return ddp_error_wrap(s, "copying a batch to the device");
  p->load_ms += ddp_time_s() - t0;
  if (g->warm < GRAPH_WARMUP_STEPS) {
    g->warm++;
    return ddp__train_eager_step(t, g->tape, &x, &y, loss, p);
  }
  double t1 = ddp_time_s();
  if (!g->graph) DDP_TRY(capture(t, g, &x, &y));
  s = ddp_cuda_graph_replay(g->graph);
  if (s != DDP_OK) return ddp_error_wrap(s, "replaying the step");
  int64_t *counters = ddp_model_counters(t->model);
  for (int i = 0; i < g->n_counters; i++) counters[i] += g->counter_delta[i];
  double t2 = ddp_time_s();
  s = ddp__train_clip(t); /* outside the graph: the norm's read-back is a sync */
  if (s == DDP_OK) s = ddp_optimizer_step(t->opt);
  if (s != DDP_OK) return ddp_error_wrap(s, "optimizer step");
  double t3 = ddp_time_s();
  /* loss.item(): waits for the replay and the optimizer, and reports a bad
   * target the replayed loss found. */
  s = ddp_device_synchronize(t->o.device);
  if (s != DDP_OK) return ddp_error_wrap(s, "reading the loss");
  *loss = *g->loss_host;
  p->forward_ms = (t2 - t1) + (ddp_time_s() - t3); /* the device's whole step */
  p->backward_compute_ms = 0;
  p->backward_comm_ms = 0;
  p->optimizer_ms = t3 - t2; /* queueing it */
  return DDP_OK;
}
