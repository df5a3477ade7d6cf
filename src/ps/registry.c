/* Which server or client of this process a request is for (ps_internal.h),
 * the timeout rule, and the check of every payload's header. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ps/ps_internal.h"

#define MAX_WORKERS 64

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  char name[DDP_RPC_MAX_NAME_BYTES];
  void *obj;
} registry[MAX_WORKERS];

ddp_status ddp__ps_registry_add(const char *name, void *obj) {
  pthread_mutex_lock(&registry_mu);
  int free_slot = -1;
  for (int i = 0; i < MAX_WORKERS; i++) {
    if (registry[i].obj && !strcmp(registry[i].name, name)) {
      pthread_mutex_unlock(&registry_mu);
      return ddp_error(DDP_ERR_STATE, "parameter server: worker '%s' exists already in this "
                                      "process", name);
    }
    if (!registry[i].obj && free_slot < 0) free_slot = i;
  }
  if (free_slot < 0) {
    pthread_mutex_unlock(&registry_mu);
    return ddp_error(DDP_ERR_RANGE, "parameter server: more than %d workers in one process",
                     MAX_WORKERS);
  }
  snprintf(registry[free_slot].name, sizeof registry[free_slot].name, "%s", name);
  registry[free_slot].obj = obj;
  pthread_mutex_unlock(&registry_mu);
  return DDP_OK;
}

void ddp__ps_registry_remove(const void *obj) {
  pthread_mutex_lock(&registry_mu);
  for (int i = 0; i < MAX_WORKERS; i++)
    if (registry[i].obj == obj) registry[i].obj = NULL;
  pthread_mutex_unlock(&registry_mu);
}

void *ddp__ps_registry_find(const ddp_rpc_call *call) {
  const char *name = ddp_rpc_self(ddp_rpc_call_agent(call))->name;
  void *obj = NULL;
  pthread_mutex_lock(&registry_mu);
  for (int i = 0; i < MAX_WORKERS && !obj; i++)
    if (registry[i].obj && !strcmp(registry[i].name, name)) obj = registry[i].obj;
  pthread_mutex_unlock(&registry_mu);
  return obj;
}

double ddp__ps_timeout(const ddp_ps_options *o) {
  if (o->timeout_s > 0) return o->timeout_s;
  double t = 1800;
  if (ddp_env_double("DDP_TIMEOUT", 1800, &t) != DDP_OK || !(t > 0)) t = 1800;
  return t;
}

ddp_status ddp__ps_header_check(const ddp_rpc_message *m, uint32_t kind, size_t elem_bytes,
                                const char *who, const ddp__ps_header **out) {
  if (!m || m->payload_bytes < sizeof(ddp__ps_header))
    return ddp_error(DDP_ERR_FORMAT, "%s: a payload of %zu bytes, shorter than the %zu-byte "
                                     "header",
                     who, m ? m->payload_bytes : (size_t)0, sizeof(ddp__ps_header));
  const ddp__ps_header *h = m->payload;
  if (h->magic != DDP__PS_MAGIC || h->kind != kind)
    return ddp_error(DDP_ERR_FORMAT, "%s: magic 0x%08x kind %u, expected 0x%08x kind %u", who,
                     h->magic, h->kind, DDP__PS_MAGIC, kind);
  if (h->count < 0 || h->count > DDP_RPC_MAX_TENSORS)
    return ddp_error(DDP_ERR_FORMAT, "%s: count %d out of range", who, h->count);
  const size_t want = sizeof(ddp__ps_header) + (size_t)h->count * elem_bytes;
  if (m->payload_bytes != want)
    return ddp_error(DDP_ERR_FORMAT, "%s: a payload of %zu bytes, expected %zu for count %d", who,
                     m->payload_bytes, want, h->count);
  *out = h;
  return DDP_OK;
}
