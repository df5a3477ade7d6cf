/* The rpc_autograd layer's insides, shared by its files (src/rpc_autograd/:
 * rref.c, dist_autograd.c, dist_optim.c): remote references' ids and pins,
 * the modules' rows for the engine, distributed autograd's gate. It sees
 * the engine through rpc/rpc_internal.h only. Not installed. */
#ifndef DDP_RPC_AUTOGRAD_INTERNAL_H
#define DDP_RPC_AUTOGRAD_INTERNAL_H

#include "ddp/rpc_autograd.h"
#include "rpc/rpc_internal.h"

/* A reference's global id: the worker that created it and a number unique
 * there (PyTorch's GloballyUniqueId). */
typedef struct ddp__rref_id {
  int32_t worker;
  int32_t reserved;
  int64_t local;
} ddp__rref_id;

ddp__rref_id ddp__rref_get_id(const ddp_rref *rref);
ddp_rpc_agent *ddp__rref_agent(const ddp_rref *rref);

/* On the owner: the value of reference `id`, waiting until it is made or
 * deadline_ns passes, and pinned (not freed) until ddp__rref_unpin. Errors
 * name the reference and say why (its ctor failed, unknown id, timeout). */
ddp_status ddp__rref_pin(ddp_rpc_agent *agent, ddp__rref_id id, int64_t deadline_ns,
                         ddp_rref_value *out);
void ddp__rref_unpin(ddp_rpc_agent *agent, ddp__rref_id id);

/* Module rows for the engine's list (src/rpc/rpc_modules.c). */
extern const ddp__rpc_module ddp__rref_module;
extern const ddp__rpc_module ddp__dist_autograd_module;
extern const ddp__rpc_module ddp__dist_optim_module;

/* Distributed autograd's gate, for the optimizer (dist_autograd.c): waits
 * until no context other than `ctx_id` has a backward pending on this
 * worker (new dist calls wait meanwhile), then holds the gate until
 * ddp__dist_gate_write_end. DDP_ERR_TIMEOUT past deadline_ns, naming the
 * contexts still pending. */
ddp_status ddp__dist_gate_write_begin(ddp_rpc_agent *agent, int64_t ctx_id, int64_t deadline_ns);
void ddp__dist_gate_write_end(ddp_rpc_agent *agent);

#endif /* DDP_RPC_AUTOGRAD_INTERNAL_H */
