/* Models as trees of modules: building the tree, laying out parameters and
 * buffers in flat allocations with PyTorch's names and initialisation, and the
 * state dict over them. The forward pass is in forward.c, the seeds' models in
 * models.c. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/module.h"
#include "tensor/tape.h" /* ddp__basic_kernels_for */

#define NAME_MAX_BYTES 64

const char *ddp__module_kind_name(ddp_module_kind kind) {
  static const char *names[DDP_MODULE_KIND_COUNT] = {
      "Sequential", "Linear",  "Conv2d",    "BatchNorm2d", "ReLU",    "Sigmoid",
      "Tanh",       "MaxPool2d", "Dropout", "Dropout2d",   "Flatten", "LogSoftmax"};
  return (unsigned)kind < DDP_MODULE_KIND_COUNT ? names[kind] : "invalid-module";
}

/* ---- The tree ---- */

static void module_free(ddp_module *m) {
  if (!m) return;
  ddp_module *c = m->first_child;
  while (c) {
    ddp_module *next = c->next_sibling;
    module_free(c);
    c = next;
  }
  ddp_free(m->name);
  ddp_free(m->path);
  ddp_free(m);
}

/* "prefix.leaf", or "leaf" when prefix is empty; heap, NULL on failure. */
static char *join_name(const char *prefix, const char *leaf) {
  size_t a = strlen(prefix), b = strlen(leaf);
  char *s = ddp_alloc(a + b + 2);
  if (!s) return NULL;
  if (a) {
    memcpy(s, prefix, a);
    s[a] = '.';
    memcpy(s + a + 1, leaf, b + 1);
  } else {
    memcpy(s, leaf, b + 1);
  }
  return s;
}

ddp_status ddp_model_create(ddp_model **out) {
  *out = NULL;
  ddp_model *model = ddp_calloc(1, sizeof *model);
  if (!model) return ddp_error(DDP_ERR_NOMEM, "model: out of memory");
  model->root = ddp_calloc(1, sizeof *model->root);
  if (!model->root) goto err;
  model->root->kind = DDP_MODULE_SEQUENTIAL;
  model->root->name = ddp_strdup("");
  model->root->path = ddp_strdup("");
  if (!model->root->name || !model->root->path) goto err;
  model->training = true;
  snprintf(model->name, sizeof model->name, "custom");
  *out = model;
  return DDP_OK;
err:
  ddp_model_destroy(model);
  return ddp_error(DDP_ERR_NOMEM, "model: out of memory");
}

/* Frees what ddp_model_finalize laid out and returns the model to its
 * unfinalized state (used by destroy and by a failed finalize). */
static void free_layout(ddp_model *model) {
  for (int i = 0; i < model->n_state; i++) ddp_free(model->state[i].name);
  ddp_free(model->state);
  ddp_free(model->params);
  ddp_free(model->param_names);
  ddp_free(model->param_offsets);
  if (model->device.type == DDP_DEVICE_CPU) {
    if (!model->params_borrowed) ddp_free(model->params_flat);
    ddp_free(model->grads_flat);
    ddp_free(model->buffers_flat);
  }
  for (int i = 0; i < 3; i++) ddp_tensor_destroy(model->device_flat[i]), model->device_flat[i] = NULL;
  model->device = DDP_CPU;
  ddp_free(model->buffers);
  ddp_free(model->counters);
  model->state = NULL;
  model->params = model->buffers = NULL;
  model->param_names = NULL;
  model->param_offsets = model->counters = NULL;
  model->params_flat = model->grads_flat = model->buffers_flat = NULL;
  model->n_state = model->n_params = model->n_buffers = model->n_counters = 0;
  model->n_param_elems = model->n_buffer_elems = 0;
}

void ddp_model_destroy(ddp_model *model) {
  if (!model) return;
  if (model->replica_of) model->replica_of->has_replicas--;
  free_layout(model);
  module_free(model->root);
  ddp_free(model->forward_order);
  ddp_free(model);
}

ddp_module *ddp_model_root(ddp_model *model) { return model->root; }

/* Validates and appends a child of `kind`; the caller fills its configuration. */
static ddp_status add_module(ddp_model *model, ddp_module *parent, const char *name,
                             ddp_module_kind kind, ddp_module **out) {
  const char *what = ddp__module_kind_name(kind);
  if (out) *out = NULL;
  if (!model) return ddp_error(DDP_ERR_INVALID, "nn: add %s: model is NULL", what);
  if (model->finalized)
    return ddp_error(DDP_ERR_STATE, "nn: add %s: the model is finalized; modules can only be "
                                    "added before ddp_model_finalize", what);
  if (!parent) parent = model->root;
  if (parent->kind != DDP_MODULE_SEQUENTIAL)
    return ddp_error(DDP_ERR_INVALID, "nn: add %s: parent '%s' is a %s, not a Sequential", what,
                     parent->path, ddp__module_kind_name(parent->kind));
  char index_name[24];
  if (!name) {
    snprintf(index_name, sizeof index_name, "%d", parent->n_children);
    name = index_name;
  }
  size_t len = strlen(name);
  if (len == 0 || len >= NAME_MAX_BYTES || strchr(name, '.'))
    return ddp_error(DDP_ERR_INVALID,
                     "nn: add %s: bad module name '%s' (1 to %d characters, no '.')", what, name,
                     NAME_MAX_BYTES - 1);
  for (ddp_module *c = parent->first_child; c; c = c->next_sibling)
    if (strcmp(c->name, name) == 0)
      return ddp_error(DDP_ERR_INVALID, "nn: add %s: '%s' already has a child named '%s'", what,
                       parent->path[0] ? parent->path : "(root)", name);

  ddp_module *m = ddp_calloc(1, sizeof *m);
  if (!m) return ddp_error(DDP_ERR_NOMEM, "nn: add %s: out of memory", what);
  m->kind = kind;
  m->name = ddp_strdup(name);
  m->path = join_name(parent->path, name);
  if (!m->name || !m->path) {
    module_free(m);
    return ddp_error(DDP_ERR_NOMEM, "nn: add %s: out of memory", what);
  }
  m->parent = parent;
  if (parent->last_child)
    parent->last_child->next_sibling = m;
  else
    parent->first_child = m;
  parent->last_child = m;
  parent->n_children++;
  if (out) *out = m;
  return DDP_OK;
}

/* Adds a parameterless module whose configuration is set by the caller. */
static ddp_status add_simple(ddp_model *model, ddp_module *parent, const char *name,
                             ddp_module_kind kind, ddp_module **out, ddp_module **made) {
  ddp_module *m;
  DDP_TRY(add_module(model, parent, name, kind, &m));
  if (out) *out = m;
  if (made) *made = m;
  return DDP_OK;
}

ddp_status ddp_module_add_sequential(ddp_model *model, ddp_module *parent, const char *name,
                                     ddp_module **out) {
  return add_simple(model, parent, name, DDP_MODULE_SEQUENTIAL, out, NULL);
}

ddp_status ddp_module_add_linear(ddp_model *model, ddp_module *parent, const char *name,
                                 int64_t in_features, int64_t out_features, bool bias,
                                 ddp_module **out) {
  if (in_features <= 0 || out_features <= 0)
    return ddp_error(DDP_ERR_INVALID, "nn: Linear(%lld, %lld): sizes must be positive",
                     (long long)in_features, (long long)out_features);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, DDP_MODULE_LINEAR, out, &m));
  m->in_features = in_features;
  m->out_features = out_features;
  m->has_bias = bias;
  return DDP_OK;
}

ddp_status ddp_module_add_conv2d(ddp_model *model, ddp_module *parent, const char *name,
                                 int64_t in_channels, int64_t out_channels, int kernel,
                                 int stride, int padding, bool bias, ddp_module **out) {
  if (in_channels <= 0 || out_channels <= 0 || kernel <= 0 || stride <= 0 || padding < 0)
    return ddp_error(DDP_ERR_INVALID,
                     "nn: Conv2d(%lld, %lld, kernel_size=%d, stride=%d, padding=%d): channels, "
                     "kernel and stride must be positive, padding non-negative",
                     (long long)in_channels, (long long)out_channels, kernel, stride, padding);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, DDP_MODULE_CONV2D, out, &m));
  m->in_features = in_channels;
  m->out_features = out_channels;
  m->kernel = kernel;
  m->stride = stride;
  m->padding = padding;
  m->has_bias = bias;
  return DDP_OK;
}

ddp_status ddp_module_add_batchnorm2d(ddp_model *model, ddp_module *parent, const char *name,
                                      int64_t num_features, ddp_module **out) {
  if (num_features <= 0)
    return ddp_error(DDP_ERR_INVALID, "nn: BatchNorm2d(%lld): num_features must be positive",
                     (long long)num_features);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, DDP_MODULE_BATCHNORM2D, out, &m));
  m->in_features = num_features;
  m->has_bias = true;
  m->momentum = 0.1f;
  m->eps = 1e-5f;
  return DDP_OK;
}

ddp_status ddp_module_add_relu(ddp_model *model, ddp_module *parent, const char *name,
                               ddp_module **out) {
  return add_simple(model, parent, name, DDP_MODULE_RELU, out, NULL);
}

ddp_status ddp_module_add_sigmoid(ddp_model *model, ddp_module *parent, const char *name,
                                  ddp_module **out) {
  return add_simple(model, parent, name, DDP_MODULE_SIGMOID, out, NULL);
}

ddp_status ddp_module_add_tanh(ddp_model *model, ddp_module *parent, const char *name,
                               ddp_module **out) {
  return add_simple(model, parent, name, DDP_MODULE_TANH, out, NULL);
}

ddp_status ddp_module_add_maxpool2d(ddp_model *model, ddp_module *parent, const char *name,
                                    int kernel, int stride, ddp_module **out) {
  if (kernel <= 0 || stride < 0)
    return ddp_error(DDP_ERR_INVALID, "nn: MaxPool2d(kernel_size=%d, stride=%d): kernel must be "
                                      "positive, stride non-negative (0: = kernel)", kernel, stride);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, DDP_MODULE_MAXPOOL2D, out, &m));
  m->kernel = kernel;
  m->stride = stride ? stride : kernel;
  return DDP_OK;
}

static ddp_status add_dropout(ddp_model *model, ddp_module *parent, const char *name,
                              ddp_module_kind kind, float p, ddp_module **out) {
  if (!(p >= 0.0f && p < 1.0f))
    return ddp_error(DDP_ERR_INVALID, "nn: %s(p=%g): p must be in [0, 1)",
                     ddp__module_kind_name(kind), (double)p);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, kind, out, &m));
  m->p = p;
  return DDP_OK;
}

ddp_status ddp_module_add_dropout(ddp_model *model, ddp_module *parent, const char *name,
                                  float p, ddp_module **out) {
  return add_dropout(model, parent, name, DDP_MODULE_DROPOUT, p, out);
}

ddp_status ddp_module_add_dropout2d(ddp_model *model, ddp_module *parent, const char *name,
                                    float p, ddp_module **out) {
  return add_dropout(model, parent, name, DDP_MODULE_DROPOUT2D, p, out);
}

ddp_status ddp_module_add_flatten(ddp_model *model, ddp_module *parent, const char *name,
                                  int start_dim, ddp_module **out) {
  if (start_dim < 0 || start_dim >= DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_INVALID, "nn: Flatten(start_dim=%d): must be in [0, %d)", start_dim,
                     DDP_MAX_DIMS);
  ddp_module *m;
  DDP_TRY(add_simple(model, parent, name, DDP_MODULE_FLATTEN, out, &m));
  m->start_dim = start_dim;
  return DDP_OK;
}

ddp_status ddp_module_add_log_softmax(ddp_model *model, ddp_module *parent, const char *name,
                                      ddp_module **out) {
  return add_simple(model, parent, name, DDP_MODULE_LOGSOFTMAX, out, NULL);
}

ddp_status ddp_model_set_forward_order(ddp_model *model, int n, ddp_module *const *modules) {
  if (n < 0 || (n > 0 && !modules))
    return ddp_error(DDP_ERR_INVALID, "nn: forward order: %d modules", n);
  for (int i = 0; i < n; i++)
    if (!modules[i] || modules[i]->parent != model->root)
      return ddp_error(DDP_ERR_INVALID,
                       "nn: forward order: entry %d (%s) is not a child of the model's root", i,
                       modules[i] ? modules[i]->path : "NULL");
  ddp_module **order = NULL;
  if (n > 0) {
    order = ddp_alloc((size_t)n * sizeof *order);
    if (!order) return ddp_error(DDP_ERR_NOMEM, "nn: forward order: out of memory");
    memcpy(order, modules, (size_t)n * sizeof *order);
  }
  ddp_free(model->forward_order);
  model->forward_order = order;
  model->n_forward = n;
  return DDP_OK;
}

/* ---- Layout: flat buffers and the state dict ---- */

/* Sizes gathered by the first walk over the tree. */
typedef struct layout {
  int n_params, n_buffers, n_counters, n_state;
  int64_t n_param_elems, n_buffer_elems;
} layout;

static int64_t fan_in(const ddp_module *m) {
  return m->kind == DDP_MODULE_CONV2D ? m->in_features * m->kernel * m->kernel : m->in_features;
}

static void count_module(const ddp_module *m, layout *l) {
  switch (m->kind) {
  case DDP_MODULE_LINEAR:
  case DDP_MODULE_CONV2D: {
    int64_t k = m->kind == DDP_MODULE_CONV2D ? (int64_t)m->kernel * m->kernel : 1;
    l->n_params += 1 + m->has_bias;
    l->n_param_elems += m->out_features * m->in_features * k + (m->has_bias ? m->out_features : 0);
    l->n_state += 1 + m->has_bias;
    break;
  }
  case DDP_MODULE_BATCHNORM2D:
    l->n_params += 2;
    l->n_param_elems += 2 * m->in_features;
    l->n_buffers += 2;
    l->n_buffer_elems += 2 * m->in_features;
    l->n_counters += 1;
    l->n_state += 5;
    break;
  default:
    break;
  }
  for (const ddp_module *c = m->first_child; c; c = c->next_sibling) count_module(c, l);
}

/* Cursor of the second walk: where the next tensor of each kind goes. */
typedef struct placer {
  ddp_model *model;
  ddp_rng init_rng;
  int param, buffer, counter, state;
  int64_t param_off, buffer_off;
} placer;

static ddp_status add_state(placer *pl, const ddp_module *m, const char *leaf,
                            ddp__state_kind kind, int index) {
  ddp__state_rec *rec = &pl->model->state[pl->state];
  rec->name = join_name(m->path, leaf);
  if (!rec->name) return ddp_error(DDP_ERR_NOMEM, "nn: finalize: out of memory");
  rec->kind = kind;
  rec->index = index;
  pl->state++;
  return DDP_OK;
}

/* Places the next parameter, viewing the flat buffers, and fills it with
 * uniform(-bound, bound) draws when bound > 0, else with `fill`. */
static ddp_status place_param(placer *pl, ddp_module *m, const char *leaf, int ndim,
                              const int64_t *shape, double bound, float fill,
                              ddp_tensor **slot) {
  ddp_model *model = pl->model;
  int i = pl->param++;
  ddp_tensor *t = &model->params[i];
  DDP_TRY(ddp_tensor_wrap(t, DDP_FLOAT32, ndim, shape, model->params_flat + pl->param_off));
  t->grad = model->grads_flat + pl->param_off;
  t->flags = DDP_TENSOR_PARAM | DDP_TENSOR_REQUIRES_GRAD;
  t->param_index = i;
  model->param_offsets[i] = pl->param_off;
  pl->param_off += t->numel;
  DDP_TRY(add_state(pl, m, leaf, DDP__STATE_PARAM, i));
  model->param_names[i] = model->state[pl->state - 1].name;
  float *d = t->data;
  if (bound > 0) {
    for (int64_t j = 0; j < t->numel; j++)
      d[j] = ddp_rng_uniform_range(&pl->init_rng, (float)-bound, (float)bound);
  } else {
    for (int64_t j = 0; j < t->numel; j++) d[j] = fill;
  }
  *slot = t;
  return DDP_OK;
}

static ddp_status place_buffer(placer *pl, ddp_module *m, const char *leaf, int64_t n,
                               float fill, ddp_tensor **slot) {
  ddp_model *model = pl->model;
  int i = pl->buffer++;
  ddp_tensor *t = &model->buffers[i];
  DDP_TRY(ddp_tensor_wrap(t, DDP_FLOAT32, 1, &n, model->buffers_flat + pl->buffer_off));
  pl->buffer_off += n;
  for (int64_t j = 0; j < n; j++) ((float *)t->data)[j] = fill;
  DDP_TRY(add_state(pl, m, leaf, DDP__STATE_BUFFER, i));
  *slot = t;
  return DDP_OK;
}

/* Depth first, as PyTorch's state_dict: own parameters, own buffers, children. */
static ddp_status place_module(placer *pl, ddp_module *m) {
  switch (m->kind) {
  case DDP_MODULE_LINEAR:
  case DDP_MODULE_CONV2D: {
    /* kaiming_uniform_(a=sqrt(5)) gives gain sqrt(1/3) and bound
     * sqrt(3) * gain / sqrt(fan_in) = 1 / sqrt(fan_in); the bias uses the same. */
    double bound = 1.0 / sqrt((double)fan_in(m));
    int64_t shape[4] = {m->out_features, m->in_features, m->kernel, m->kernel};
    int ndim = m->kind == DDP_MODULE_CONV2D ? 4 : 2;
    DDP_TRY(place_param(pl, m, "weight", ndim, shape, bound, 0, &m->weight));
    if (m->has_bias) DDP_TRY(place_param(pl, m, "bias", 1, shape, bound, 0, &m->bias));
    break;
  }
  case DDP_MODULE_BATCHNORM2D: {
    int64_t c = m->in_features;
    DDP_TRY(place_param(pl, m, "weight", 1, &c, 0, 1.0f, &m->weight));
    DDP_TRY(place_param(pl, m, "bias", 1, &c, 0, 0.0f, &m->bias));
    DDP_TRY(place_buffer(pl, m, "running_mean", c, 0.0f, &m->running_mean));
    DDP_TRY(place_buffer(pl, m, "running_var", c, 1.0f, &m->running_var));
    int i = pl->counter++;
    pl->model->counters[i] = 0;
    m->num_batches_tracked = &pl->model->counters[i];
    DDP_TRY(add_state(pl, m, "num_batches_tracked", DDP__STATE_COUNTER, i));
    break;
  }
  default:
    break;
  }
  for (ddp_module *c = m->first_child; c; c = c->next_sibling) DDP_TRY(place_module(pl, c));
  return DDP_OK;
}

/* Allocates n elements of size, or sets *ok false. Zero elements allocate
 * one so that a model without buffers still has valid (empty) pointers. */
static void *alloc_zeroed(size_t n, size_t size, bool *ok) {
  void *p = ddp_calloc(n ? n : 1, size);
  if (!p) *ok = false;
  return p;
}

ddp_status ddp_model_finalize(ddp_model *model, uint64_t seed) {
  if (!model) return ddp_error(DDP_ERR_INVALID, "nn: finalize: model is NULL");
  if (model->finalized) return ddp_error(DDP_ERR_STATE, "nn: finalize: already finalized");
  layout l = {0};
  count_module(model->root, &l);
  bool ok = true;
  model->params = alloc_zeroed((size_t)l.n_params, sizeof(ddp_tensor), &ok);
  model->param_names = alloc_zeroed((size_t)l.n_params, sizeof(char *), &ok);
  model->param_offsets = alloc_zeroed((size_t)l.n_params, sizeof(int64_t), &ok);
  model->params_flat = alloc_zeroed((size_t)l.n_param_elems, sizeof(float), &ok);
  model->grads_flat = alloc_zeroed((size_t)l.n_param_elems, sizeof(float), &ok);
  model->buffers = alloc_zeroed((size_t)l.n_buffers, sizeof(ddp_tensor), &ok);
  model->buffers_flat = alloc_zeroed((size_t)l.n_buffer_elems, sizeof(float), &ok);
  model->counters = alloc_zeroed((size_t)l.n_counters, sizeof(int64_t), &ok);
  model->state = alloc_zeroed((size_t)l.n_state, sizeof(ddp__state_rec), &ok);
  ddp_status s = DDP_OK;
  if (!ok) {
    s = ddp_error(DDP_ERR_NOMEM, "nn: finalize: cannot allocate %lld parameters",
                  (long long)l.n_param_elems);
    goto err;
  }
  model->n_params = l.n_params;
  model->n_param_elems = l.n_param_elems;
  model->n_buffers = l.n_buffers;
  model->n_buffer_elems = l.n_buffer_elems;
  model->n_counters = l.n_counters;
  model->n_state = l.n_state;

  placer pl = {.model = model};
  ddp_rng_seed(&pl.init_rng, seed);
  s = place_module(&pl, model->root);
  if (s != DDP_OK) goto err;
  DDP_ASSERT(pl.param == l.n_params && pl.state == l.n_state &&
             pl.param_off == l.n_param_elems && pl.buffer_off == l.n_buffer_elems);
  /* Dropout draws from its own stream, so that adding dropout to a model does
   * not change its initial weights. */
  ddp_rng_seed(&model->dropout_rng, seed ^ 0x9e3779b97f4a7c15ull);
  model->finalized = true;
  model->training = true;
  return DDP_OK;

err:
  free_layout(model);
  return s;
}

/* ---- Accessors ---- */

const char *ddp_model_name(const ddp_model *model) { return model->name; }

int ddp_model_sample_shape(const ddp_model *model, int64_t shape[DDP_MAX_DIMS]) {
  for (int i = 0; i < model->sample_ndim; i++) shape[i] = model->sample_shape[i];
  return model->sample_ndim;
}

void ddp_model_set_sample_shape(ddp_model *model, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > DDP_MAX_DIMS) ndim = 0;
  model->sample_ndim = ndim;
  for (int i = 0; i < ndim; i++) model->sample_shape[i] = shape[i];
}

int64_t ddp_model_num_outputs(const ddp_model *model) { return model->num_outputs; }

int ddp_model_num_params(const ddp_model *model) { return model->n_params; }

ddp_tensor *ddp_model_param(ddp_model *model, int index) {
  return index >= 0 && index < model->n_params ? &model->params[index] : NULL;
}

const char *ddp_model_param_name(const ddp_model *model, int index) {
  return index >= 0 && index < model->n_params ? model->param_names[index] : NULL;
}

int64_t ddp_model_param_offset(const ddp_model *model, int index) {
  return index >= 0 && index < model->n_params ? model->param_offsets[index] : -1;
}

ddp_tensor *ddp_model_find_param(ddp_model *model, const char *name) {
  for (int i = 0; i < model->n_params; i++)
    if (strcmp(model->param_names[i], name) == 0) return &model->params[i];
  return NULL;
}

float *ddp_model_params_flat(ddp_model *model) { return model->params_flat; }
float *ddp_model_grads_flat(ddp_model *model) { return model->grads_flat; }
int64_t ddp_model_num_param_elements(const ddp_model *model) { return model->n_param_elems; }
float *ddp_model_buffers_flat(ddp_model *model) { return model->buffers_flat; }
int64_t ddp_model_num_buffer_elements(const ddp_model *model) { return model->n_buffer_elems; }
int64_t *ddp_model_counters(ddp_model *model) { return model->counters; }
int ddp_model_num_counters(const ddp_model *model) { return model->n_counters; }

/* ---- State dict ---- */

int ddp_model_state_count(const ddp_model *model) { return model->n_state; }

ddp_status ddp_model_state_entry(const ddp_model *model, int index, ddp_state_entry *entry) {
  if (model->device.type != DDP_DEVICE_CPU) {
    char dev[DDP_DEVICE_STR_BYTES];
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "nn: the state dict hands out host memory, and the model is on %s: move it "
                     "to the CPU first (ddp_model_to), or save and load it with ddp_model_save / "
                     "ddp_model_load and the checkpoint calls, which copy through the host",
                     ddp_device_str(model->device, dev, sizeof dev));
  }
  bool on_device;
  return ddp__model_state_entry_any(model, index, entry, &on_device);
}

ddp_status ddp__model_state_entry_any(const ddp_model *model, int index, ddp_state_entry *entry,
                                      bool *on_device) {
  if (index < 0 || index >= model->n_state)
    return ddp_error(DDP_ERR_RANGE, "nn: state entry %d out of range (the model has %d)", index,
                     model->n_state);
  *on_device = false;
  const ddp__state_rec *rec = &model->state[index];
  memset(entry, 0, sizeof *entry);
  entry->name = rec->name;
  entry->param_index = -1;
  const ddp_tensor *t = NULL;
  switch (rec->kind) {
  case DDP__STATE_PARAM:
    t = &model->params[rec->index];
    entry->is_param = true;
    entry->param_index = rec->index;
    break;
  case DDP__STATE_BUFFER:
    t = &model->buffers[rec->index];
    break;
  case DDP__STATE_COUNTER:
    entry->dtype = DDP_INT64;
    entry->ndim = 0;
    entry->numel = 1;
    entry->data = &model->counters[rec->index];
    return DDP_OK;
  }
  entry->dtype = t->dtype;
  entry->ndim = t->ndim;
  for (int i = 0; i < t->ndim; i++) entry->shape[i] = t->shape[i];
  entry->numel = t->numel;
  entry->data = t->data;
  *on_device = model->device.type != DDP_DEVICE_CPU;
  return DDP_OK;
}

ddp_status ddp_model_state_find(const ddp_model *model, const char *name, ddp_state_entry *entry) {
  for (int i = 0; i < model->n_state; i++)
    if (strcmp(model->state[i].name, name) == 0) return ddp_model_state_entry(model, i, entry);
  return ddp_error(DDP_ERR_NOTFOUND, "nn: the model (%s) has no state entry named '%s'",
                   model->name, name);
}

static const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t bytes) {
  ddp_tensor t = {.ndim = ndim};
  for (int i = 0; i < ndim && i < DDP_MAX_DIMS; i++) t.shape[i] = shape[i];
  return ddp_tensor_shape_str(&t, buf, bytes);
}

ddp_status ddp_model_load_tensor(ddp_model *model, const char *name, ddp_dtype dtype, int ndim,
                                 const int64_t *shape, const void *data) {
  ddp_state_entry e;
  DDP_TRY(ddp_model_state_find(model, name, &e));
  char want[DDP_SHAPE_STR_BYTES], got[DDP_SHAPE_STR_BYTES];
  if (dtype != e.dtype)
    return ddp_error(DDP_ERR_INVALID, "nn: load '%s': dtype %s, the model's is %s", name,
                     ddp_dtype_name(dtype), ddp_dtype_name(e.dtype));
  bool same = ndim == e.ndim;
  for (int i = 0; same && i < ndim; i++) same = shape[i] == e.shape[i];
  if (!same)
    return ddp_error(DDP_ERR_SHAPE, "nn: load '%s': shape %s, the model's is %s", name,
                     ndim >= 0 && ndim <= DDP_MAX_DIMS ? shape_str(ndim, shape, got, sizeof got)
                                                       : "(bad ndim)",
                     shape_str(e.ndim, e.shape, want, sizeof want));
  memcpy(e.data, data, (size_t)e.numel * ddp_dtype_size(e.dtype));
  return DDP_OK;
}

/* ---- Training helpers ---- */

void ddp_model_train(ddp_model *model, bool training) { model->training = training; }
bool ddp_model_is_training(const ddp_model *model) { return model->training; }
void ddp_model_seed_dropout(ddp_model *model, uint64_t seed) {
  ddp_rng_seed(&model->dropout_rng, seed);
}
ddp_rng *ddp_model_dropout_rng(ddp_model *model) { return &model->dropout_rng; }

void ddp_model_set_batch_norm_sync(ddp_model *model, const ddp_batch_norm_sync *sync) {
  model->bn_synced = sync != NULL;
  model->bn_sync = sync ? *sync : (ddp_batch_norm_sync){0};
}
bool ddp_model_batch_norm_synced(const ddp_model *model) { return model->bn_synced; }

void ddp_model_set_forward_hook(ddp_model *model, ddp_module_forward_hook fn, void *user) {
  model->forward_hook = fn;
  model->forward_hook_user = fn ? user : NULL;
}

void ddp_model_zero_grad(ddp_model *model) {
  if (model->grads_flat && model->device.type != DDP_DEVICE_CPU)
    ddp__basic_kernels_for(model->device)->fill(model->grads_flat, 0.0f, model->n_param_elems);
  else if (model->grads_flat)
    memset(model->grads_flat, 0, (size_t)model->n_param_elems * sizeof(float));
}

float ddp_clip_coefficient(double total_norm, double max_norm) {
  /* volatile: each operation rounded to float32 as PyTorch's tensors are,
   * whatever the compiler's excess precision or contraction. */
  volatile float denom = (float)total_norm + 1e-6f;
  volatile float coef = (1.0f / denom) * (float)max_norm;
  return coef > 1.0f ? 1.0f : coef; /* torch.clamp(max=1.0), which keeps a NaN */
}

ddp_status ddp_model_clip_grad_norm(ddp_model *model, double max_norm, double *total_norm) {
  if (!(max_norm >= 0) || isinf(max_norm))
    return ddp_error(DDP_ERR_INVALID, "nn: clip_grad_norm: max_norm %g must be finite and >= 0",
                     max_norm);
  const float *g = model->grads_flat;
  const ddp__basic_kernels *k = ddp__basic_kernels_for(model->device);
  double sum = 0;
  if (model->device.type != DDP_DEVICE_CPU)
    sum = k->sum_squares(g, model->n_param_elems);
  else
    for (int64_t i = 0; i < model->n_param_elems; i++) sum += (double)g[i] * (double)g[i];
  double norm = sqrt(sum);
  if (total_norm) *total_norm = norm;
  if (!isfinite(norm))
    return ddp_error(DDP_ERR_RANGE,
                     "nn: clip_grad_norm: the total gradient norm is %g; gradients left as they are",
                     norm);
  const float c = ddp_clip_coefficient(norm, max_norm);
  if (c < 1.0f) {
    if (model->device.type != DDP_DEVICE_CPU)
      k->scale(model->grads_flat, c, model->n_param_elems);
    else
      for (int64_t i = 0; i < model->n_param_elems; i++) model->grads_flat[i] *= c;
  }
  return DDP_OK;
}

/* ---- Description ---- */

typedef struct text {
  char *buf;
  size_t bytes, len;
} text;

static void emit(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(text *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = t->len < t->bytes ? t->bytes - t->len : 0;
  int n = vsnprintf(room ? t->buf + t->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0) t->len += (size_t)n;
}

static void describe(text *t, const ddp_module *m, int depth, bool model_synced) {
  emit(t, "%*s", 2 * depth, "");
  if (depth > 0) emit(t, "(%s): ", m->name);
  const char *kind = ddp__module_kind_name(m->kind);
  switch (m->kind) {
  case DDP_MODULE_LINEAR:
    emit(t, "Linear(in_features=%lld, out_features=%lld, bias=%s)\n", (long long)m->in_features,
         (long long)m->out_features, m->has_bias ? "True" : "False");
    break;
  case DDP_MODULE_CONV2D:
    emit(t, "Conv2d(%lld, %lld, kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d)%s)\n",
         (long long)m->in_features, (long long)m->out_features, m->kernel, m->kernel, m->stride,
         m->stride, m->padding, m->padding, m->has_bias ? "" : ", bias=False");
    break;
  case DDP_MODULE_BATCHNORM2D:
    emit(t, "%s(%lld, eps=%g, momentum=%g, affine=True, track_running_stats=True)\n",
         model_synced ? "SyncBatchNorm" : "BatchNorm2d", (long long)m->in_features,
         (double)m->eps, (double)m->momentum);
    break;
  case DDP_MODULE_MAXPOOL2D:
    emit(t, "MaxPool2d(kernel_size=%d, stride=%d)\n", m->kernel, m->stride);
    break;
  case DDP_MODULE_DROPOUT:
  case DDP_MODULE_DROPOUT2D:
    emit(t, "%s(p=%g)\n", kind, (double)m->p);
    break;
  case DDP_MODULE_FLATTEN:
    emit(t, "Flatten(start_dim=%d, end_dim=-1)\n", m->start_dim);
    break;
  case DDP_MODULE_LOGSOFTMAX:
    emit(t, "LogSoftmax(dim=1)\n");
    break;
  case DDP_MODULE_SEQUENTIAL:
    emit(t, "%s(\n", depth == 0 ? "Model" : kind);
    for (const ddp_module *c = m->first_child; c; c = c->next_sibling)
      describe(t, c, depth + 1, model_synced);
    emit(t, "%*s)\n", 2 * depth, "");
    break;
  default:
    emit(t, "%s()\n", kind);
    break;
  }
}

size_t ddp_model_describe(const ddp_model *model, char *buf, size_t bytes) {
  text t = {buf, bytes, 0};
  if (buf && bytes) buf[0] = '\0';
  describe(&t, model->root, 0, model->bn_synced);
  return t.len;
}
