/* Which server or client of this process a request is for (ps_internal.h),
 * the timeout rule, and the check of every payload's header. */
#include <stddef.h>

#include "ps/ps_internal.h"
#include "rpc/rpc_internal.h"

/* The servers and clients of this process by worker name (rpc's named
 * tables: as many as the process holds). */
static ddp__name_table workers = DDP__NAME_TABLE_INIT("parameter server: worker");

ddp_status ddp__ps_registry_add(const char *name, void *obj) {
  return ddp__name_table_set(&workers, name, obj, NULL, false);
}

void ddp__ps_registry_remove(const void *obj) { ddp__name_table_remove_value(&workers, obj); }

void *ddp__ps_registry_find(const ddp_rpc_call *call) {
  void *obj = NULL;
  return ddp__name_table_get(&workers, ddp_rpc_self(ddp_rpc_call_agent(call))->name, &obj, NULL) ? obj : NULL;
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
