/* Splitting a model into stages: its top-level modules in forward order, the
 * boundaries from names ("layer2", "a,b,c") or from measured cost (each
 * module's forward + backward time on a micro-batch, the contiguous split
 * that minimises the most expensive stage), and a copy of some of the
 * modules, with their parameters, buffers and names, as a model of its own.
 * Reads nn's module tree (nn/module.h): the layers' public API has no
 * walker, and a stage must rebuild exactly the modules it holds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/module.h"
#include "pipeline/split.h"
#include "tensor/tape.h"

int ddp__pp_top_modules(ddp_model *model, ddp_module **out, int max) {
  int n = 0;
  if (model->forward_order) {
    for (int i = 0; i < model->n_forward && n < max; i++) out[n++] = model->forward_order[i];
    return model->n_forward;
  }
  int total = 0;
  for (ddp_module *c = model->root->first_child; c; c = c->next_sibling, total++)
    if (n < max) out[n++] = c;
  return total;
}

const char *ddp__pp_module_name(const ddp_module *m) { return m->name; }

ddp_status ddp__pp_split_names(ddp_module *const *mods, int n_mods, const char *spec,
                               int n_stages, int *bounds) {
  /* bounds[g] is stage g's first module; bounds[n_stages] = n_mods. */
  bounds[0] = 0;
  bounds[n_stages] = n_mods;
  int g = 1;
  const char *at = spec;
  char list[512] = "";
  for (int i = 0; i < n_mods; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
             mods[i]->name);
  while (*at) {
    const char *end = strchr(at, ',');
    size_t len = end ? (size_t)(end - at) : strlen(at);
    if (g >= n_stages)
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline: split '%s' names more than the %d boundaries of %d stages",
                       spec, n_stages - 1, n_stages);
    int found = -1;
    for (int i = 0; i < n_mods; i++)
      if (strlen(mods[i]->name) == len && strncmp(mods[i]->name, at, len) == 0) found = i;
    if (found < 0)
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline: split '%s': '%.*s' is not a top-level module of the model "
                       "(they are, in forward order: %s)", spec, (int)len, at, list);
    if (found <= bounds[g - 1])
      return ddp_error(DDP_ERR_INVALID,
                       "pipeline: split '%s': stage %d would begin at '%s' (module %d), not after "
                       "stage %d's first module %s (module %d): names must follow the forward "
                       "order (%s) and each stage needs a module", spec, g, mods[found]->name,
                       found, g - 1, mods[bounds[g - 1]]->name, bounds[g - 1], list);
    bounds[g++] = found;
    at = end ? end + 1 : at + len;
  }
  if (g != n_stages)
    return ddp_error(DDP_ERR_INVALID,
                     "pipeline: split '%s' gives %d stages, the pipeline has %d (ranks x virtual "
                     "stages): name %d boundaries", spec, g, n_stages, n_stages - 1);
  return DDP_OK;
}

/* ---- Copying modules -------------------------------------------------------- */

static ddp_status clone_module(ddp_model *dst, ddp_module *parent, const ddp_module *m) {
  ddp_module *made = NULL;
  switch (m->kind) {
  case DDP_MODULE_SEQUENTIAL:
    DDP_TRY(ddp_module_add_sequential(dst, parent, m->name, &made));
    for (const ddp_module *c = m->first_child; c; c = c->next_sibling)
      DDP_TRY(clone_module(dst, made, c));
    return DDP_OK;
  case DDP_MODULE_LINEAR:
    return ddp_module_add_linear(dst, parent, m->name, m->in_features, m->out_features,
                                 m->has_bias, NULL);
  case DDP_MODULE_CONV2D:
    return ddp_module_add_conv2d(dst, parent, m->name, m->in_features, m->out_features,
                                 m->kernel, m->stride, m->padding, m->has_bias, NULL);
  case DDP_MODULE_BATCHNORM2D:
    DDP_TRY(ddp_module_add_batchnorm2d(dst, parent, m->name, m->in_features, &made));
    made->momentum = m->momentum;
    made->eps = m->eps;
    return DDP_OK;
  case DDP_MODULE_RELU: return ddp_module_add_relu(dst, parent, m->name, NULL);
  case DDP_MODULE_SIGMOID: return ddp_module_add_sigmoid(dst, parent, m->name, NULL);
  case DDP_MODULE_TANH: return ddp_module_add_tanh(dst, parent, m->name, NULL);
  case DDP_MODULE_MAXPOOL2D:
    return ddp_module_add_maxpool2d(dst, parent, m->name, m->kernel, m->stride, NULL);
  case DDP_MODULE_DROPOUT: return ddp_module_add_dropout(dst, parent, m->name, m->p, NULL);
  case DDP_MODULE_DROPOUT2D: return ddp_module_add_dropout2d(dst, parent, m->name, m->p, NULL);
  case DDP_MODULE_FLATTEN:
    return ddp_module_add_flatten(dst, parent, m->name, m->start_dim, NULL);
  case DDP_MODULE_LOGSOFTMAX: return ddp_module_add_log_softmax(dst, parent, m->name, NULL);
  default:
    return ddp_error(DDP_ERR_UNSUPPORTED, "pipeline: cannot copy module %s of kind %d", m->path,
                     (int)m->kind);
  }
}

ddp_status ddp__pp_clone(ddp_model *src, const bool *keep, ddp_model **out) {
  *out = NULL;
  ddp_model *dst;
  DDP_TRY(ddp_model_create(&dst));
  ddp_status s = DDP_OK;
  /* Registration order (the state dict's and parameters' order) is the
   * source's; `keep` is indexed by it. */
  int i = 0;
  for (ddp_module *c = src->root->first_child; c && s == DDP_OK; c = c->next_sibling, i++)
    if (keep[i]) s = clone_module(dst, NULL, c);
  if (s == DDP_OK) s = ddp_model_finalize(dst, 0);
  /* Values by name, so the copy starts where the source is, whatever the
   * source's initialisation or training did. */
  for (int k = 0; s == DDP_OK && k < ddp_model_state_count(dst); k++) {
    ddp_state_entry e, f;
    s = ddp_model_state_entry(dst, k, &e);
    if (s == DDP_OK) s = ddp_model_state_find(src, e.name, &f);
    if (s == DDP_OK) memcpy(e.data, f.data, (size_t)e.numel * ddp_dtype_size(e.dtype));
  }
  if (s != DDP_OK) {
    ddp_model_destroy(dst);
    return ddp_error_wrap(s, "pipeline: copying the stage's modules");
  }
  snprintf(dst->name, sizeof dst->name, "%s", src->name);
  dst->loss = src->loss;
  dst->training = src->training;
  dst->dropout_rng = src->dropout_rng;
  dst->num_outputs = src->num_outputs;
  dst->sample_ndim = src->sample_ndim;
  memcpy(dst->sample_shape, src->sample_shape, sizeof dst->sample_shape);
  *out = dst;
  return DDP_OK;
}

int ddp__pp_registration_index(ddp_model *model, const ddp_module *m) {
  int i = 0;
  for (ddp_module *c = model->root->first_child; c; c = c->next_sibling, i++)
    if (c == m) return i;
  return -1;
}

ddp_module *ddp__pp_find_top(ddp_model *model, const char *name) {
  for (ddp_module *c = model->root->first_child; c; c = c->next_sibling)
    if (strcmp(c->name, name) == 0) return c;
  return NULL;
}

ddp_status ddp__pp_run_modules(ddp_model *model, ddp_module *const *mods, int n, ddp_tape *tape,
                               ddp_tensor *x, ddp_tensor **out) {
  ddp_tensor *h = x;
  for (int i = 0; i < n; i++) {
    ddp_status s = ddp__module_forward(model, mods[i], tape, h, &h);
    if (s != DDP_OK) return ddp_error_wrap(s, "%s forward", model->name);
  }
  *out = h;
  return DDP_OK;
}

/* ---- Measured cost ---------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

ddp_status ddp__pp_profile(ddp_model *model, ddp_module *const *mods, int n_mods, int ndim,
                           const int64_t *sample, int64_t rows, double *cost) {
  /* On a copy: the profile's forwards would move BN's running statistics
   * and its backwards the gradients of the caller's model. */
  int total = 0;
  for (ddp_module *c = model->root->first_child; c; c = c->next_sibling) total++;
  bool *keep = ddp_alloc((size_t)(total ? total : 1) * sizeof(bool));
  if (!keep) return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  for (int i = 0; i < total; i++) keep[i] = true;
  ddp_model *copy = NULL;
  ddp_tape *tape = NULL;
  ddp_tensor *x = NULL;
  ddp_status s = ddp__pp_clone(model, keep, &copy);
  ddp_free(keep);
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 20);
  int64_t shape[DDP_MAX_DIMS + 1];
  shape[0] = rows;
  memcpy(shape + 1, sample, sizeof(int64_t) * (size_t)ndim);
  if (s == DDP_OK) s = ddp_tensor_create(&x, DDP_FLOAT32, ndim + 1, shape);
  ddp_rng rng;
  ddp_rng_seed(&rng, 1234);
  if (s == DDP_OK)
    for (int64_t i = 0; i < x->numel; i++) ddp_tensor_f32(x)[i] = ddp_rng_normal(&rng);
  /* Module k of the copy runs on module k-1's output, as a leaf that needs
   * a gradient (what a stage's input is). */
  ddp_tensor *in = x;
  for (int k = 0; s == DDP_OK && k < n_mods; k++) {
    ddp_module *m = ddp__pp_find_top(copy, mods[k]->name);
    double t[3];
    ddp_tensor *next = NULL;
    for (int rep = 0; rep < 3 && s == DDP_OK; rep++) {
      ddp_tape_reset(tape);
      ddp_tensor *out;
      int64_t t0 = ddp_time_ns();
      s = ddp__module_forward(copy, m, tape, in, &out);
      if (s != DDP_OK) break;
      if (out->flags & DDP_TENSOR_REQUIRES_GRAD) {
        float *seed = ddp_tape_scratch(tape, (size_t)out->numel * sizeof(float));
        if (!seed) {
          s = ddp_error(DDP_ERR_NOMEM, "pipeline: profile: out of memory");
          break;
        }
        for (int64_t i = 0; i < out->numel; i++) seed[i] = 1.0f;
        s = ddp__backward_from(tape, out, seed);
      }
      t[rep] = (double)(ddp_time_ns() - t0) * 1e-9;
      if (rep == 2 && s == DDP_OK) {
        /* The next module's input: this output, copied off the tape. */
        s = ddp_tensor_create(&next, DDP_FLOAT32, out->ndim, out->shape);
        if (s == DDP_OK) memcpy(next->data, out->data, (size_t)out->numel * sizeof(float));
      }
    }
    if (s != DDP_OK) {
      s = ddp_error_wrap(s, "pipeline: measuring %s", mods[k]->name);
      ddp_tensor_destroy(next);
      break;
    }
    qsort(t, 3, sizeof t[0], cmp_double);
    /* The fastest of three: another task taking the core only ever adds
     * time, and the split must not follow such noise. */
    cost[k] = t[0];
    /* The tape lists `in` among its leaves until it is reset. */
    ddp_tape_reset(tape);
    if (in != x) ddp_tensor_destroy(in);
    ddp_tensor_free_grad(next);
    next->flags |= DDP_TENSOR_REQUIRES_GRAD;
    in = next;
  }
  ddp_tape_destroy(tape); /* first: resetting it touches its leaves */
  if (in != x) ddp_tensor_destroy(in);
  ddp_tensor_free_grad(x);
  ddp_tensor_destroy(x);
  ddp_model_destroy(copy);
  return s;
}

ddp_status ddp__pp_balance(const double *cost, int n_mods, int n_stages, int *bounds) {
  /* best[g][k]: the least possible most expensive stage when the first k
   * modules form g stages; a small dynamic programme (modules and stages
   * are few). */
  size_t cells = (size_t)(n_stages + 1) * (size_t)(n_mods + 1);
  double *best = ddp_alloc(cells * sizeof(double));
  int *cut = ddp_alloc(cells * sizeof(int));
  double *prefix = ddp_alloc((size_t)(n_mods + 1) * sizeof(double));
  if (!best || !cut || !prefix) {
    ddp_free(best);
    ddp_free(cut);
    ddp_free(prefix);
    return ddp_error(DDP_ERR_NOMEM, "pipeline: out of memory");
  }
#define AT(a, g, k) (a)[(size_t)(g) * (size_t)(n_mods + 1) + (size_t)(k)]
  prefix[0] = 0;
  for (int k = 0; k < n_mods; k++) prefix[k + 1] = prefix[k] + cost[k];
  for (size_t i = 0; i < cells; i++) best[i] = 1e300, cut[i] = 0;
  AT(best, 0, 0) = 0;
  for (int g = 1; g <= n_stages; g++)
    for (int k = g; k <= n_mods; k++)
      for (int j = g - 1; j < k; j++) {
        double stage = prefix[k] - prefix[j];
        double worst = AT(best, g - 1, j) > stage ? AT(best, g - 1, j) : stage;
        if (worst < AT(best, g, k)) {
          AT(best, g, k) = worst;
          AT(cut, g, k) = j;
        }
      }
  bounds[n_stages] = n_mods;
  for (int g = n_stages, k = n_mods; g > 0; g--) {
    k = AT(cut, g, k);
    bounds[g - 1] = k;
  }
#undef AT
  ddp_free(best);
  ddp_free(cut);
  ddp_free(prefix);
  return DDP_OK;
}
