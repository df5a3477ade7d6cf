/* The servers' checkpoints (docs/ps.md, "Checkpoints"): server 0 gathers
 * every shard (parameters and optimizer state) into a whole model and a
 * whole-model optimizer and writes the same pair of files as any other
 * ddp-train run (PyTorch's names; io.h); every server resumes by loading the
 * pair into its model and a whole-model optimizer and keeping its shard. */
#include <stdlib.h>
#include <string.h>

#include "ps/server_internal.h"

/* A whole-model optimizer over the model's flat buffers, as the trainers'
 * would be (the elementwise updates make the shards' together equal it). */
static ddp_status whole_optimizer(ddp_ps_server *s, ddp_optimizer **out) {
  ddp_status st = ddp_optimizer_create(out, &s->o.optim, ddp_model_params_flat(s->model),
                                       ddp_model_grads_flat(s->model),
                                       (size_t)ddp_model_num_param_elements(s->model));
  return st == DDP_OK ? DDP_OK : ddp_error_wrap(st, "%s: the checkpoint's optimizer", s->name);
}

ddp_status ddp__ps_server_resume(ddp_ps_server *s, int64_t *start) {
  ddp_optimizer *whole;
  DDP_TRY(whole_optimizer(s, &whole));
  ddp_train_state ts = {0};
  ddp_status st = ddp_checkpoint_load(s->o.resume_path, s->model, whole, NULL, &ts,
                                      s->o.checkpoint_meta, s->o.checkpoint_meta_count);
  if (st != DDP_OK) {
    ddp_optimizer_destroy(whole);
    return ddp_error_wrap(st, "%s: resuming", s->name);
  }
  if (ddp_optimizer_has_state(whole)) {
    const size_t entries = ddp_optimizer_state_count(whole);
    for (int32_t k = 0; k < s->shard.n && st == DDP_OK; k++) {
      const ddp__ps_tensor *x = &s->shard.tensors[k];
      for (size_t e = 0; e < entries && st == DDP_OK; e++) {
        ddp_optim_state w;
        st = ddp_optimizer_state_get(whole, e, &w);
        if (st == DDP_OK)
          st = ddp_optimizer_state_load(x->opt, w.name, w.is_scalar ? w.data : w.data + x->offset,
                                        w.is_scalar ? 1 : (size_t)x->numel);
      }
    }
  }
  ddp_optimizer_destroy(whole);
  if (st != DDP_OK) return ddp_error_wrap(st, "%s: resuming the optimizer's state", s->name);
  *start = ts.step;
  return DDP_OK;
}

ddp_status ddp__ps_server_save_init(ddp_ps_server *s) {
  DDP_TRY(whole_optimizer(s, &s->save_opt));
  if (s->o.step_lr_size > 0) {
    ddp_step_lr_options so = ddp_step_lr_defaults(s->o.step_lr_size);
    so.gamma = s->o.step_lr_gamma;
    ddp_status st = ddp_scheduler_create_step_lr(&s->save_sched, s->save_opt, &so);
    if (st != DDP_OK) return ddp_error_wrap(st, "%s: the checkpoint's StepLR", s->name);
  }
  s->save_stage = ddp_alloc((size_t)ddp_model_num_param_elements(s->model) * sizeof(float) + 64);
  if (!s->save_stage) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", s->name);
  return DDP_OK;
}

void ddp__ps_server_save_free(ddp_ps_server *s) {
  ddp_scheduler_destroy(s->save_sched);
  ddp_optimizer_destroy(s->save_opt);
  ddp_free(s->save_stage);
  s->save_sched = NULL;
  s->save_opt = NULL;
  s->save_stage = NULL;
}

/* ---- Export: one block, freed by the message's release ---- */

typedef struct export_entry {
  int32_t param;
  int32_t has_state;
} export_entry;

void ddp__ps_server_export(ddp_ps_server *s, ddp_rpc_message *m) {
  *m = (ddp_rpc_message){0};
  const int32_t n = s->shard.n;
  const size_t entries = n ? ddp_optimizer_state_count(s->shard.tensors[0].opt) : 0;
  const size_t per = 1 + entries, nt = (size_t)n * per;
  const size_t payload = sizeof(ddp__ps_header) + (size_t)n * sizeof(export_entry);
  char *block = ddp_alloc(payload + nt * (sizeof(ddp_tensor) + sizeof(ddp_tensor *)) + 64);
  if (!block) return; /* an empty reply: server 0 fails the save naming this server */
  ddp__ps_header *h = (ddp__ps_header *)block;
  *h = (ddp__ps_header){.magic = DDP__PS_MAGIC, .kind = DDP__PS_STATE, .count = n};
  export_entry *ee = (export_entry *)(h + 1);
  ddp_tensor *tensors = (ddp_tensor *)(block + ((payload + 63) / 64) * 64);
  ddp_tensor **ptrs = (ddp_tensor **)(tensors + nt);
  float *params = ddp_model_params_flat(s->model);
  size_t j = 0;
  for (int32_t k = 0; k < n; k++) {
    const ddp__ps_tensor *x = &s->shard.tensors[k];
    ee[k] = (export_entry){.param = x->param, .has_state = ddp_optimizer_has_state(x->opt)};
    int64_t shape[1] = {x->numel};
    (void)ddp_tensor_wrap(&tensors[j++], DDP_FLOAT32, 1, shape, params + x->offset);
    for (size_t e = 0; e < entries; e++) {
      ddp_optim_state st;
      (void)ddp_optimizer_state_get(x->opt, e, &st);
      int64_t sh[1] = {(int64_t)st.numel};
      (void)ddp_tensor_wrap(&tensors[j++], DDP_FLOAT32, 1, sh, st.data);
    }
  }
  for (size_t i = 0; i < nt; i++) ptrs[i] = &tensors[i];
  *m = (ddp_rpc_message){.payload = block, .payload_bytes = payload, .tensors = ptrs,
                         .num_tensors = (int32_t)nt, .release = ddp_free, .release_ctx = block};
}

/* Copies one server's exported shard into the model and save_opt's state
 * (at the tensors' offsets); *any_state once a tensor holds state. */
static ddp_status absorb(ddp_ps_server *s, const ddp_rpc_message *m, const char *from,
                         bool *any_state) {
  const ddp__ps_header *h;
  DDP_TRY(ddp__ps_header_check(m, DDP__PS_STATE, sizeof(export_entry), from, &h));
  const size_t entries = ddp_optimizer_state_count(s->save_opt);
  if ((size_t)m->num_tensors != (size_t)h->count * (1 + entries))
    return ddp_error(DDP_ERR_FORMAT, "%s: %d tensors for %d parameters", from, m->num_tensors,
                     h->count);
  const export_entry *ee = (const export_entry *)(h + 1);
  float *params = ddp_model_params_flat(s->model);
  size_t j = 0;
  for (int32_t k = 0; k < h->count; k++) {
    int32_t p = ee[k].param;
    if (p < 0 || p >= ddp_model_num_params(s->model))
      return ddp_error(DDP_ERR_FORMAT, "%s: parameter %d", from, p);
    const int64_t off = ddp_model_param_offset(s->model, p);
    const int64_t numel = ddp_model_param(s->model, p)->numel;
    const ddp_tensor *pt = m->tensors[j++];
    if (pt->numel != numel) return ddp_error(DDP_ERR_SHAPE, "%s: parameter %d's size", from, p);
    if (ddp_tensor_f32(pt) != params + off) /* a server's own export points into the model */
      memcpy(params + off, ddp_tensor_f32(pt), (size_t)numel * sizeof(float));
    *any_state |= ee[k].has_state != 0;
    for (size_t e = 0; e < entries; e++) {
      ddp_optim_state st;
      DDP_TRY(ddp_optimizer_state_get(s->save_opt, e, &st));
      const ddp_tensor *v = m->tensors[j++];
      const size_t want = st.is_scalar ? 1 : (size_t)numel;
      if ((size_t)v->numel != want)
        return ddp_error(DDP_ERR_SHAPE, "%s: optimizer state %s of parameter %d", from, st.name, p);
      memcpy(st.is_scalar ? st.data : st.data + off, ddp_tensor_f32(v), want * sizeof(float));
    }
  }
  return DDP_OK;
}

ddp_status ddp__ps_server_save(ddp_ps_server *s) {
  const double timeout = ddp__ps_timeout(&s->o.ps);
  bool any_state = false;
  for (int32_t j = 0; j < s->o.ps.num_servers; j++) {
    ddp_rpc_message m = {0};
    char who[DDP_RPC_MAX_NAME_BYTES + 32];
    ddp_ps_worker_name(&s->o.ps, j, who);
    ddp_status st;
    if (j == s->o.index) {
      pthread_mutex_lock(&s->mu);
      ddp__ps_server_export(s, &m);
      st = m.payload ? absorb(s, &m, who, &any_state)
                     : ddp_error(DDP_ERR_NOMEM, "%s: out of memory exporting the shard", who);
      pthread_mutex_unlock(&s->mu);
    } else {
      st = ddp_rpc_sync(s->agent, who, DDP__PS_FN_STATE, NULL, timeout, &m);
      if (st == DDP_OK) st = absorb(s, &m, who, &any_state);
    }
    ddp_rpc_message_free(&m);
    if (st != DDP_OK) return ddp_error_wrap(st, "saving the checkpoint: gathering %s's shard", who);
  }
  const ddp_ps_save_info *info = &s->meet.save;
  if (any_state) {
    const size_t entries = ddp_optimizer_state_count(s->save_opt);
    for (size_t e = 0; e < entries; e++) {
      ddp_optim_state st;
      DDP_TRY(ddp_optimizer_state_get(s->save_opt, e, &st));
      memcpy(s->save_stage, st.data, st.numel * sizeof(float));
      DDP_TRY(ddp_optimizer_state_load(s->save_opt, st.name, s->save_stage, st.numel));
    }
  }
  DDP_TRY(ddp_optimizer_set_lr(s->save_opt, info->lr));
  if (s->save_sched && info->has_sched) DDP_TRY(ddp_scheduler_state_load(s->save_sched, &info->sched));
  ddp_status st = ddp_checkpoint_save(s->o.save_path, s->model, s->save_opt, s->save_sched,
                                      &info->ts, s->o.checkpoint_meta, s->o.checkpoint_meta_count);
  return st == DDP_OK ? DDP_OK : ddp_error_wrap(st, "%s: saving the checkpoint", s->name);
}
