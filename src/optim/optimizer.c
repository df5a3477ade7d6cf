/* The optimizer object: option validation (PyTorch's constructor checks),
 * state allocation and naming for checkpoints, the lr, and dispatch of a step
 * to the per-algorithm loop, or on a GPU to its kernel (cuda/, compiled in a
 * CUDA build only, so every call into it is behind DDP_HAVE_CUDA). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "optim/optim_internal.h"
#ifdef DDP_HAVE_CUDA
#include "optim/cuda/optim_cuda.h"
#endif

static const char *const kind_names[DDP_OPTIM_KIND_COUNT] = {"sgd", "adam", "adadelta"};

const char *ddp_optim_kind_name(ddp_optim_kind kind) {
  if ((unsigned)kind >= DDP_OPTIM_KIND_COUNT) return "unknown";
  return kind_names[kind];
}

ddp_optim_options ddp_optim_defaults(ddp_optim_kind kind) {
  ddp_optim_options o;
  memset(&o, 0, sizeof o);
  switch (kind) {
    case DDP_OPTIM_ADAM:
      o.kind = DDP_OPTIM_ADAM;
      o.lr = 1e-3;
      o.adam.beta1 = 0.9;
      o.adam.beta2 = 0.999;
      o.adam.eps = 1e-8;
      break;
    case DDP_OPTIM_ADADELTA:
      o.kind = DDP_OPTIM_ADADELTA;
      o.lr = 1.0;
      o.adadelta.rho = 0.9;
      o.adadelta.eps = 1e-6;
      break;
    default:
      o.kind = DDP_OPTIM_SGD;
      o.lr = 1e-3;
      break;
  }
  return o;
}

/* `!(x >= 0)` so that NaN is rejected too. */
static ddp_status check_nonneg(const char *opt, const char *name, double x) {
  if (!(x >= 0.0)) return ddp_error(DDP_ERR_INVALID, "%s: %s = %g must be >= 0", opt, name, x);
  return DDP_OK;
}

static ddp_status check_unit(const char *opt, const char *name, double x, bool closed) {
  if (!(x >= 0.0) || !(closed ? x <= 1.0 : x < 1.0))
    return ddp_error(DDP_ERR_INVALID, "%s: %s = %g must be in [0, 1%s", opt, name, x,
                     closed ? "]" : ")");
  return DDP_OK;
}

/* PyTorch 1.13's constructor checks, with messages naming the option. */
static ddp_status validate(const ddp_optim_options *o) {
  const char *name = ddp_optim_kind_name(o->kind);
  DDP_TRY(check_nonneg(name, "lr", o->lr));
  DDP_TRY(check_nonneg(name, "weight_decay", o->weight_decay));
  switch (o->kind) {
    case DDP_OPTIM_SGD:
      DDP_TRY(check_nonneg(name, "momentum", o->sgd.momentum));
      if (!isfinite(o->sgd.dampening))
        return ddp_error(DDP_ERR_INVALID, "sgd: dampening = %g must be finite", o->sgd.dampening);
      if (o->sgd.nesterov && (o->sgd.momentum <= 0.0 || o->sgd.dampening != 0.0))
        return ddp_error(DDP_ERR_INVALID,
                         "sgd: nesterov momentum requires momentum > 0 and dampening = 0 "
                         "(momentum = %g, dampening = %g)",
                         o->sgd.momentum, o->sgd.dampening);
      return DDP_OK;
    case DDP_OPTIM_ADAM:
      DDP_TRY(check_nonneg(name, "eps", o->adam.eps));
      DDP_TRY(check_unit(name, "betas[0]", o->adam.beta1, false));
      DDP_TRY(check_unit(name, "betas[1]", o->adam.beta2, false));
      return DDP_OK;
    case DDP_OPTIM_ADADELTA:
      DDP_TRY(check_unit(name, "rho", o->adadelta.rho, true));
      DDP_TRY(check_nonneg(name, "eps", o->adadelta.eps));
      return DDP_OK;
    default:
      return ddp_error(DDP_ERR_INVALID, "optim: unknown optimizer kind %d", (int)o->kind);
  }
}

/* Whether options->device can hold an optimizer in this build and process. */
static ddp_status check_device(const ddp_optim_options *o) {
  const char *name = ddp_optim_kind_name(o->kind);
  ddp_device d = o->device;
  if (d.type == DDP_DEVICE_CPU) {
    if (d.index != 0)
      return ddp_error(DDP_ERR_INVALID, "%s: device cpu with index %d (the CPU is index 0)",
                       name, (int)d.index);
    return DDP_OK;
  }
  if (d.type != DDP_DEVICE_CUDA)
    return ddp_error(DDP_ERR_INVALID, "%s: unknown device type %d", name, (int)d.type);
#ifdef DDP_HAVE_CUDA
  return ddp_device_check(d);
#else
  return ddp_error(DDP_ERR_UNSUPPORTED, "%s: device cuda:%d: this build has no CUDA backend",
                   name, (int)d.index);
#endif
}

/* The state layout of an optimizer with these options: names in PyTorch's
 * order, scalars flagged. Returns the number of entries. */
static size_t state_layout(const ddp_optim_options *o, const char *names[DDP__OPTIM_MAX_STATE],
                           bool scalar[DDP__OPTIM_MAX_STATE]) {
  size_t k = 0;
  memset(scalar, 0, DDP__OPTIM_MAX_STATE * sizeof *scalar);
  switch (o->kind) {
    case DDP_OPTIM_SGD:
      if (o->sgd.momentum != 0.0) names[k++] = "momentum_buffer";
      break;
    case DDP_OPTIM_ADAM:
      scalar[k] = true;
      names[k++] = "step";
      names[k++] = "exp_avg";
      names[k++] = "exp_avg_sq";
      if (o->adam.amsgrad) names[k++] = "max_exp_avg_sq";
      break;
    case DDP_OPTIM_ADADELTA:
      names[k++] = "square_avg";
      names[k++] = "acc_delta";
      break;
    default:
      break;
  }
  return k;
}

/* A GPU optimizer's state: `buffers` buffers of n floats in the device's
 * memory, zeroed there, and their host copy for state access and relayout
 * (the only host memory it keeps). Checks first that params and grads are
 * that device's memory. Partial work is the caller's to destroy. */
static ddp_status device_state_create(ddp_optimizer *opt, size_t buffers) {
#ifdef DDP_HAVE_CUDA
  const char *name = ddp_optim_kind_name(opt->options.kind);
  DDP_TRY(ddp__optim_cuda_check_buffers(opt));
  if (!buffers) return DDP_OK;
  if (opt->n > SIZE_MAX / sizeof(float) / buffers)
    return ddp_error(DDP_ERR_NOMEM, "%s: %zu state buffers of %zu floats overflow size_t", name,
                     buffers, opt->n);
  size_t floats = buffers * opt->n;
  opt->state_host = ddp_calloc(floats, sizeof(float));
  if (!opt->state_host)
    return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for the host copy of %zu state buffers "
                     "of %zu floats", name, buffers, opt->n);
  return ddp__optim_cuda_state_alloc(opt, floats, &opt->state_mem);
#else
  DDP_ASSERT(!"check_device refuses a GPU in a build without CUDA");
  return DDP_ERR_UNSUPPORTED;
#endif
}

ddp_status ddp_optimizer_create(ddp_optimizer **out, const ddp_optim_options *options,
                                float *params, const float *grads, size_t n) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "optim: out is NULL");
  *out = NULL;
  if (!options) return ddp_error(DDP_ERR_INVALID, "optim: options is NULL");
  DDP_TRY(validate(options));
  DDP_TRY(check_device(options));
  const char *name = ddp_optim_kind_name(options->kind);
  if (!params) return ddp_error(DDP_ERR_INVALID, "%s: params is NULL", name);
  if (!grads) return ddp_error(DDP_ERR_INVALID, "%s: grads is NULL", name);
  if (n == 0) return ddp_error(DDP_ERR_INVALID, "%s: empty parameter buffer (n = 0)", name);

  const char *names[DDP__OPTIM_MAX_STATE];
  bool scalar[DDP__OPTIM_MAX_STATE];
  size_t count = state_layout(options, names, scalar);
  size_t buffers = 0;
  for (size_t i = 0; i < count; i++) buffers += !scalar[i];

  ddp_optimizer *opt = ddp_calloc(1, sizeof *opt);
  if (!opt) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for the optimizer", name);
  opt->options = *options;
  opt->params = params;
  opt->grads = grads;
  opt->n = n;
  opt->on_device = options->device.type != DDP_DEVICE_CPU;
  if (opt->on_device) {
    ddp_status st = device_state_create(opt, buffers);
    if (st != DDP_OK) {
      ddp_optimizer_destroy(opt);
      return st;
    }
  } else if (buffers) {
    opt->state_mem = ddp_calloc(buffers, n * sizeof(float));
    if (!opt->state_mem) {
      ddp_free(opt);
      return ddp_error(DDP_ERR_NOMEM, "%s: out of memory for %zu state buffers of %zu floats",
                       name, buffers, n);
    }
  }
  float *next = opt->state_mem;
  for (size_t i = 0; i < count; i++) {
    ddp_optim_state *s = &opt->state[i];
    s->name = names[i];
    s->is_scalar = scalar[i];
    if (scalar[i]) {
      s->data = &opt->step_scalar;
      s->numel = 1;
    } else {
      s->data = next;
      s->numel = n;
      next += n;
    }
  }
  opt->state_count = count;
  *out = opt;
  return DDP_OK;
}

void ddp_optimizer_destroy(ddp_optimizer *opt) {
  if (!opt) return;
  if (opt->on_device) {
#ifdef DDP_HAVE_CUDA
    ddp__optim_cuda_state_free(opt, opt->state_mem);
#endif
    ddp_free(opt->state_host);
  } else {
    ddp_free(opt->state_mem);
  }
  ddp_free(opt);
}

ddp_status ddp_optimizer_step(ddp_optimizer *opt) {
  if (!opt) return ddp_error(DDP_ERR_INVALID, "optim: step on a NULL optimizer");
  if (opt->on_device) {
#ifdef DDP_HAVE_CUDA
    DDP_TRY(ddp__optim_cuda_step(opt));
#endif
  } else {
    switch (opt->options.kind) {
      case DDP_OPTIM_SGD: ddp__sgd_step(opt); break;
      case DDP_OPTIM_ADAM: ddp__adam_step(opt); break;
      case DDP_OPTIM_ADADELTA: ddp__adadelta_step(opt); break;
      default: DDP_ASSERT(!"optimizer kind validated at create");
    }
  }
  opt->has_state = true;
  opt->steps++;
  return DDP_OK;
}

ddp_status ddp_optimizer_set_lr(ddp_optimizer *opt, double lr) {
  if (!opt) return ddp_error(DDP_ERR_INVALID, "optim: set_lr on a NULL optimizer");
  DDP_TRY(check_nonneg(ddp_optim_kind_name(opt->options.kind), "lr", lr));
  opt->options.lr = lr;
  return DDP_OK;
}

double ddp_optimizer_get_lr(const ddp_optimizer *opt) { return opt->options.lr; }

const ddp_optim_options *ddp_optimizer_options(const ddp_optimizer *opt) {
  return &opt->options;
}

int64_t ddp_optimizer_step_count(const ddp_optimizer *opt) { return opt->steps; }

size_t ddp_optimizer_numel(const ddp_optimizer *opt) { return opt->n; }

size_t ddp_optimizer_state_count(const ddp_optimizer *opt) { return opt->state_count; }

bool ddp_optimizer_has_state(const ddp_optimizer *opt) { return opt->has_state; }

ddp_optim_state *ddp__optim_state(ddp_optimizer *opt, const char *name) {
  for (size_t i = 0; i < opt->state_count; i++)
    if (strcmp(opt->state[i].name, name) == 0) return &opt->state[i];
  return NULL;
}

/* The host copy of a GPU optimizer's buffer entry s (same offset). */
static float *state_host_copy(const ddp_optimizer *opt, const ddp_optim_state *s) {
  return opt->state_host + (s->data - opt->state_mem);
}

/* Entry s as the API hands it out: on a GPU a buffer's data is its host
 * copy, refreshed from the device now (after the queued steps). */
static ddp_status state_out(ddp_optimizer *opt, const ddp_optim_state *s, ddp_optim_state *out) {
  *out = *s;
  if (!opt->on_device || s->is_scalar) return DDP_OK;
  out->data = state_host_copy(opt, s);
#ifdef DDP_HAVE_CUDA
  return ddp__optim_cuda_download(opt, out->data, s->data, s->numel);
#else
  DDP_ASSERT(!"no GPU optimizer in a build without CUDA");
  return DDP_ERR_UNSUPPORTED;
#endif
}

ddp_status ddp_optimizer_state_get(ddp_optimizer *opt, size_t index, ddp_optim_state *out) {
  if (index >= opt->state_count)
    return ddp_error(DDP_ERR_RANGE, "%s: state index %zu out of range (%zu entries)",
                     ddp_optim_kind_name(opt->options.kind), index, opt->state_count);
  return state_out(opt, &opt->state[index], out);
}

/* "exp_avg, exp_avg_sq" into buf, for messages. */
static const char *state_names(const ddp_optimizer *opt, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < opt->state_count && used < size; i++) {
    int w = snprintf(buf + used, size - used, "%s%s", i ? ", " : "", opt->state[i].name);
    if (w < 0) break;
    used += (size_t)w;
  }
  return opt->state_count ? buf : "none";
}

/* The entry named `name` into *out, or DDP_ERR_NOTFOUND listing the names. */
static ddp_status find_state(ddp_optimizer *opt, const char *name, ddp_optim_state **out) {
  *out = name ? ddp__optim_state(opt, name) : NULL;
  if (*out) return DDP_OK;
  char buf[128];
  return ddp_error(DDP_ERR_NOTFOUND, "%s: no state named '%s' (this optimizer has: %s)",
                   ddp_optim_kind_name(opt->options.kind), name ? name : "(null)",
                   state_names(opt, buf, sizeof buf));
}

ddp_status ddp_optimizer_state_find(ddp_optimizer *opt, const char *name, ddp_optim_state *out) {
  ddp_optim_state *s;
  DDP_TRY(find_state(opt, name, &s));
  return state_out(opt, s, out);
}

ddp_status ddp_optimizer_state_load(ddp_optimizer *opt, const char *name, const float *data,
                                    size_t numel) {
  ddp_optim_state *s;
  DDP_TRY(find_state(opt, name, &s));
  const char *kind = ddp_optim_kind_name(opt->options.kind);
  if (!data) return ddp_error(DDP_ERR_INVALID, "%s: state '%s': data is NULL", kind, name);
  if (numel != s->numel)
    return ddp_error(DDP_ERR_SHAPE, "%s: state '%s' has %zu floats, got %zu", kind, name,
                     s->numel, numel);
  if (s->is_scalar && !(isfinite(data[0]) && data[0] >= 0.0f && data[0] == floorf(data[0])))
    return ddp_error(DDP_ERR_INVALID, "%s: state '%s' = %g is not a step count", kind, name,
                     (double)data[0]);
  if (opt->on_device && !s->is_scalar) {
#ifdef DDP_HAVE_CUDA
    DDP_TRY(ddp__optim_cuda_upload(opt, s->data, data, numel));
#endif
  } else {
    memmove(s->data, data, numel * sizeof(float));
  }
  if (s->is_scalar) opt->steps = (int64_t)data[0];
  opt->has_state = true;
  return DDP_OK;
}

/* ddp_optimizer_relayout's moves on a GPU, through the host copy: each
 * buffer comes down whole, then every segment that moves goes back up to
 * its new offset (the destinations tile [0, n), so none overwrites another's
 * source). Segments already checked. */
static ddp_status device_relayout(ddp_optimizer *opt, size_t n_segments,
                                  const int64_t *old_offsets, const int64_t *new_offsets,
                                  const int64_t *lengths) {
#ifdef DDP_HAVE_CUDA
  for (size_t k = 0; k < opt->state_count; k++) {
    ddp_optim_state *st = &opt->state[k];
    if (st->is_scalar) continue;
    float *host = state_host_copy(opt, st);
    DDP_TRY(ddp__optim_cuda_download(opt, host, st->data, st->numel));
    for (size_t i = 0; i < n_segments; i++) {
      if (lengths[i] == 0 || old_offsets[i] == new_offsets[i]) continue;
      DDP_TRY(ddp__optim_cuda_upload(opt, st->data + new_offsets[i], host + old_offsets[i],
                                     (size_t)lengths[i]));
    }
  }
  return DDP_OK;
#else
  DDP_ASSERT(!"no GPU optimizer in a build without CUDA");
  return DDP_ERR_UNSUPPORTED;
#endif
}

ddp_status ddp_optimizer_relayout(ddp_optimizer *opt, size_t n_segments,
                                  const int64_t *old_offsets, const int64_t *new_offsets,
                                  const int64_t *lengths) {
  if (!opt) return ddp_error(DDP_ERR_INVALID, "optimizer relayout: optimizer is NULL");
  int64_t n = (int64_t)opt->n, total = 0;
  for (size_t i = 0; i < n_segments; i++) {
    if (lengths[i] < 0 || old_offsets[i] < 0 || new_offsets[i] < 0 ||
        old_offsets[i] + lengths[i] > n || new_offsets[i] + lengths[i] > n)
      return ddp_error(DDP_ERR_RANGE,
                       "optimizer relayout: segment %zu (%lld floats from %lld to %lld) is "
                       "outside the optimizer's %lld floats", i, (long long)lengths[i],
                       (long long)old_offsets[i], (long long)new_offsets[i], (long long)n);
    total += lengths[i];
  }
  if (total != n)
    return ddp_error(DDP_ERR_RANGE,
                     "optimizer relayout: the segments cover %lld floats, the optimizer has %lld",
                     (long long)total, (long long)n);
  bool any = false;
  for (size_t k = 0; k < opt->state_count; k++) any |= !opt->state[k].is_scalar;
  if (!any || n == 0) return DDP_OK;
  if (opt->on_device) return device_relayout(opt, n_segments, old_offsets, new_offsets, lengths);
  float *tmp = ddp_alloc((size_t)n * sizeof(float));
  if (!tmp) return ddp_error(DDP_ERR_NOMEM, "optimizer relayout: cannot allocate %lld floats",
                             (long long)n);
  for (size_t k = 0; k < opt->state_count; k++) {
    ddp_optim_state *st = &opt->state[k];
    if (st->is_scalar) continue;
    memcpy(tmp, st->data, (size_t)n * sizeof(float));
    for (size_t i = 0; i < n_segments; i++)
      memcpy(st->data + new_offsets[i], tmp + old_offsets[i], (size_t)lengths[i] * sizeof(float));
  }
  ddp_free(tmp);
  return DDP_OK;
}

ddp_status ddp_optimizer_narrow(ddp_optimizer *opt, size_t offset, size_t n) {
  if (!opt) return ddp_error(DDP_ERR_INVALID, "optim: narrow: optimizer is NULL");
  const char *kind = ddp_optim_kind_name(opt->options.kind);
  if (opt->on_device)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: narrow: the optimizer is on a device (CPU only)",
                     kind);
  if (n == 0 || offset > opt->n || n > opt->n - offset)
    return ddp_error(DDP_ERR_RANGE, "%s: narrow: [%zu, %zu) is not a non-empty range of its "
                     "%zu floats", kind, offset, offset + n, opt->n);
  size_t buffers = 0;
  for (size_t k = 0; k < opt->state_count; k++) buffers += !opt->state[k].is_scalar;
  float *mem = NULL;
  if (buffers) {
    mem = ddp_alloc(buffers * n * sizeof(float));
    if (!mem)
      return ddp_error(DDP_ERR_NOMEM, "%s: narrow: out of memory for %zu state buffers of %zu "
                       "floats", kind, buffers, n);
  }
  float *next = mem;
  for (size_t k = 0; k < opt->state_count; k++) {
    ddp_optim_state *st = &opt->state[k];
    if (st->is_scalar) continue;
    memcpy(next, st->data + offset, n * sizeof(float));
    st->data = next;
    st->numel = n;
    next += n;
  }
  ddp_free(opt->state_mem);
  opt->state_mem = mem;
  opt->params += offset;
  opt->grads += offset;
  opt->n = n;
  return DDP_OK;
}
