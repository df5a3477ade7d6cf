/* A server's shard (ps_internal.h): its parameter tensors, an optimizer for
 * each, and how a push becomes an update in each mode. sync stores each
 * trainer's gradient and applies the mean once all are in, summed in
 * trainer order so the result is the same whatever order pushes arrive in;
 * async and ssp apply each push on arrival. No RPC here. */
#include <stdlib.h>
#include <string.h>

#include "ps/ps_internal.h"

void ddp__ps_shard_free(ddp__ps_shard *sh) {
  if (!sh) return;
  for (int32_t k = 0; sh->tensors && k < sh->n; k++) ddp_optimizer_destroy(sh->tensors[k].opt);
  ddp_free(sh->tensors);
  ddp_free(sh->local_of);
  ddp_free(sh->slots);
  ddp_free(sh->pushed);
  *sh = (ddp__ps_shard){0};
}

ddp_status ddp__ps_shard_init(ddp__ps_shard *sh, ddp_model *model, int32_t server,
                              int32_t num_servers, int32_t num_trainers, ddp_ps_mode mode,
                              const ddp_optim_options *optim) {
  *sh = (ddp__ps_shard){.model = model, .mode = mode, .num_trainers = num_trainers};
  const int32_t np = ddp_model_num_params(model);
  int64_t *numel = ddp_alloc((size_t)(np > 0 ? np : 1) * sizeof *numel);
  int32_t *owner = ddp_alloc((size_t)(np > 0 ? np : 1) * sizeof *owner);
  sh->local_of = ddp_alloc((size_t)(np > 0 ? np : 1) * sizeof *sh->local_of);
  sh->tensors = ddp_calloc((size_t)(np > 0 ? np : 1), sizeof *sh->tensors);
  ddp_status s = DDP_OK;
  if (!numel || !owner || !sh->local_of || !sh->tensors) {
    s = ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory for %d tensors", np);
    goto out;
  }
  for (int32_t i = 0; i < np; i++) numel[i] = ddp_model_param(model, i)->numel;
  s = ddp_ps_shard(numel, np, num_servers, owner);
  if (s != DDP_OK) goto out;
  float *params = ddp_model_params_flat(model), *grads = ddp_model_grads_flat(model);
  for (int32_t i = 0; i < np; i++) {
    sh->local_of[i] = -1;
    if (owner[i] != server) continue;
    ddp__ps_tensor *x = &sh->tensors[sh->n];
    x->param = i;
    x->offset = ddp_model_param_offset(model, i);
    x->numel = numel[i];
    s = ddp_optimizer_create(&x->opt, optim, params + x->offset, grads + x->offset,
                             (size_t)x->numel);
    if (s != DDP_OK) {
      s = ddp_error_wrap(s, "the optimizer of %s", ddp_model_param_name(model, i));
      goto out;
    }
    sh->local_of[i] = sh->n++;
    sh->owned_numel += x->numel;
  }
  if (mode == DDP_PS_SYNC) {
    sh->slots = ddp_calloc((size_t)num_trainers * (size_t)(sh->owned_numel ? sh->owned_numel : 1),
                       sizeof *sh->slots);
    sh->pushed = ddp_calloc((size_t)num_trainers * (size_t)(sh->n ? sh->n : 1), 1);
    if (!sh->slots || !sh->pushed) {
      s = ddp_error(DDP_ERR_NOMEM, "parameter server: out of memory for %d trainers' gradients "
                                   "(%lld floats each)",
                    num_trainers, (long long)sh->owned_numel);
      goto out;
    }
  }
out:
  ddp_free(numel);
  ddp_free(owner);
  if (s != DDP_OK) ddp__ps_shard_free(sh);
  return s;
}

/* Where trainer t's copy of owned tensor k sits in the sync slots: the
 * tensors' slots are laid out in shard order after each other. */
static float *slot(ddp__ps_shard *sh, int32_t t, int32_t k) {
  int64_t at = 0;
  for (int32_t j = 0; j < k; j++) at += sh->tensors[j].numel;
  return sh->slots + (int64_t)t * sh->owned_numel + at;
}

static ddp_status step_tensor(ddp__ps_shard *sh, ddp__ps_tensor *x, double lr) {
  ddp_status s = ddp_optimizer_set_lr(x->opt, lr);
  if (s == DDP_OK) s = ddp_optimizer_step(x->opt);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "updating %s", ddp_model_param_name(sh->model, x->param));
  sh->updates++;
  x->version++;
  return DDP_OK;
}

/* sync: the mean of the pushes of tensor k, in trainer order, into the
 * model's gradient buffer, then the update. */
static ddp_status apply_mean(ddp__ps_shard *sh, int32_t k, double lr) {
  ddp__ps_tensor *x = &sh->tensors[k];
  float *acc = ddp_model_grads_flat(sh->model) + x->offset;
  memset(acc, 0, (size_t)x->numel * sizeof *acc);
  int32_t count = 0;
  for (int32_t t = 0; t < sh->num_trainers; t++) {
    uint8_t *p = &sh->pushed[(int64_t)t * sh->n + k];
    if (!*p) continue;
    const float *g = slot(sh, t, k);
    for (int64_t e = 0; e < x->numel; e++) acc[e] += g[e];
    *p = 0;
    count++;
  }
  /* DistributedDataParallel divides the sum by the world size; here the
   * trainers that pushed are every live trainer, the same number. */
  const float inv = 1.0f / (float)(count ? count : 1);
  for (int64_t e = 0; e < x->numel; e++) acc[e] *= inv;
  x->contributions = 0;
  return step_tensor(sh, x, lr);
}

ddp_status ddp__ps_shard_push(ddp__ps_shard *sh, int32_t t, int32_t param, int64_t step,
                              const float *g, double lr, int32_t live, bool *updated) {
  *updated = false;
  const int32_t np = ddp_model_num_params(sh->model);
  if (param < 0 || param >= np || sh->local_of[param] < 0)
    return ddp_error(DDP_ERR_INVALID, "trainer %d pushed parameter %d, which this server does not "
                                      "hold (a trainer and the servers disagree on the model)",
                     t, param);
  if (t < 0 || t >= sh->num_trainers)
    return ddp_error(DDP_ERR_INVALID, "push from trainer %d of %d", t, sh->num_trainers);
  const int32_t k = sh->local_of[param];
  ddp__ps_tensor *x = &sh->tensors[k];
  if (sh->mode != DDP_PS_SYNC) {
    memcpy(ddp_model_grads_flat(sh->model) + x->offset, g, (size_t)x->numel * sizeof *g);
    DDP_TRY(step_tensor(sh, x, lr));
    *updated = true;
    return DDP_OK;
  }
  /* sync: version is the last step applied; this push belongs to the next. */
  if (step != x->version + 1)
    return ddp_error(DDP_ERR_STATE,
                     "trainer %d pushed %s for step %lld while step %lld is in progress (sync)",
                     t, ddp_model_param_name(sh->model, param), (long long)step,
                     (long long)x->version + 1);
  uint8_t *p = &sh->pushed[(int64_t)t * sh->n + k];
  if (*p)
    return ddp_error(DDP_ERR_STATE, "trainer %d pushed %s twice for step %lld", t,
                     ddp_model_param_name(sh->model, param), (long long)step);
  memcpy(slot(sh, t, k), g, (size_t)x->numel * sizeof *g);
  *p = 1;
  x->contributions++;
  x->pending_lr = lr;
  if (x->contributions >= live) {
    DDP_TRY(apply_mean(sh, k, lr));
    *updated = true;
  }
  return DDP_OK;
}

ddp_status ddp__ps_shard_flush(ddp__ps_shard *sh, int32_t live) {
  if (sh->mode != DDP_PS_SYNC) return DDP_OK;
  for (int32_t k = 0; k < sh->n; k++) {
    ddp__ps_tensor *x = &sh->tensors[k];
    if (x->contributions > 0 && x->contributions >= live)
      DDP_TRY(apply_mean(sh, k, x->pending_lr));
  }
  return DDP_OK;
}
