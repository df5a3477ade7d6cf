/* ddp rpc_autograd: remote references, distributed autograd and the
 * distributed optimizer, on top of the RPC engine (include/ddp/rpc.h):
 * PyTorch's rpc.RRef, torch.distributed.autograd (FAST mode) and
 * torch.distributed.optim.DistributedOptimizer. docs/rpc.md ("Remote
 * references", "Distributed autograd", "Distributed optimizer") has the
 * protocol and the reasons.
 *
 * The model of use (seed 001's parameter server; examples/rpc_parameter_server.c):
 *
 *   // every worker, before ddp_rpc_init:
 *   ddp_rref_register_ctor("ps.create", ps_create, NULL);      // makes the value
 *   ddp_dist_register("ps.forward", ps_forward, NULL);         // runs on the value
 *   // a trainer:
 *   ddp_rref *ps;
 *   ddp_rref_remote(rpc, "parameter_server", "ps.create", NULL, -1, &ps);  // at once
 *   ddp_rref **params; ...   // references to the server's parameters (tokens)
 *   ddp_dist_optimizer *opt;
 *   ddp_dist_optimizer_create(rpc, &sgd_options, n, params, &opt);
 *   for (batch...) {
 *     ddp_dist_context *ctx;
 *     ddp_dist_context_begin(rpc, &ctx);
 *     const ddp_rpc_message *out;
 *     ddp_dist_rref_call(ctx, ps, "ps.forward", &args, -1, &out);  // out requires grad
 *     ddp_nll_loss(ddp_dist_context_tape(ctx), out->tensors[0], target, &loss);
 *     ddp_dist_backward(ctx, loss);            // across workers
 *     ddp_dist_optimizer_step(opt, ctx);       // each parameter on its owner
 *     ddp_dist_context_end(ctx);               // frees it on every worker
 *   }
 *
 * Every function may be called from any thread; handlers run on the RPC
 * pool. Waits are bounded by the timeouts given (<= 0: the agent's default). */
#ifndef DDP_RPC_AUTOGRAD_H
#define DDP_RPC_AUTOGRAD_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/optim.h"
#include "ddp/rpc.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ==== Remote references ====================================================
 * A value lives on its owner; references to it are held by any worker.
 * The owner frees the value (its destroy callback) exactly when the last
 * reference anywhere is released: every reference held outside the owner is
 * a "fork" the owner knows by id, and a reference passed on from one user to
 * another keeps its parent's fork alive until the owner has registered the
 * child's (PyTorch's guarantees G1 and G2). */

typedef struct ddp_rref ddp_rref; /* one reference held by this worker */

/* What a reference refers to, on its owner. `ptr` is the object (a
 * ddp_tensor * when is_tensor: ddp_rref_to_here copies it to the caller);
 * destroy(ptr, user) runs once on the owner when the last reference is
 * gone (may be NULL: the value is someone else's). */
typedef struct ddp_rref_value {
  void *ptr;
  bool is_tensor;
  void (*destroy)(void *ptr, void *user);
  void *user;
} ddp_rref_value;

/* Makes a value on the owner for ddp_rref_remote, from the call's args.
 * Fill *out and return DDP_OK, or return an error (ddp_error(...)): every
 * later use of the reference then fails with that message. */
typedef ddp_status (*ddp_rref_ctor)(ddp_rpc_call *call, const ddp_rpc_message *args,
                                    ddp_rref_value *out, void *user);
/* A method run on the owner on the referenced value (ddp_rref_rpc_sync). The
 * reply must not point into the value (it may be sent after the value is
 * freed); it may point into args. */
typedef ddp_status (*ddp_rref_method)(ddp_rpc_call *call, void *value,
                                      const ddp_rpc_message *args, ddp_rpc_message *reply,
                                      void *user);

/* Register on every worker before ddp_rpc_init (names as rpc.h's). */
ddp_status ddp_rref_register_ctor(const char *name, ddp_rref_ctor fn, void *user);
ddp_status ddp_rref_register_method(const char *name, ddp_rref_method fn, void *user);

/* rpc.remote: asks worker `to` to run ctor `ctor` on args and returns a
 * reference to the result at once (*out, release with ddp_rref_release);
 * the value is made meanwhile. A ctor's failure, or a timeout past
 * timeout_s, shows in every later use. Fails here only when the request
 * cannot be sent (no such worker: DDP_ERR_NOTFOUND). */
ddp_status ddp_rref_remote(ddp_rpc_agent *agent, const char *to, const char *ctor,
                           const ddp_rpc_message *args, double timeout_s, ddp_rref **out);
/* rpc.RRef(value): a reference owned by this worker to a value it holds
 * (taken: value->destroy runs when the last reference is gone). `name` (may
 * be NULL) labels it in messages and leak reports. */
ddp_status ddp_rref_create_local(ddp_rpc_agent *agent, const ddp_rref_value *value,
                                 const char *name, ddp_rref **out);
/* Copies a tensor value to the caller (*out, ddp_rpc_message_free; one
 * tensor), waiting up to timeout_s for the value to be made. The owner's
 * error if its ctor failed; DDP_ERR_INVALID for a value that is not a
 * tensor (call a method on it instead). */
ddp_status ddp_rref_to_here(ddp_rref *rref, double timeout_s, ddp_rpc_message *out);
/* The value itself (owner only: DDP_ERR_STATE elsewhere, naming the owner).
 * Waits up to the agent's default timeout for a value still being made. */
ddp_status ddp_rref_local_value(ddp_rref *rref, void **out);
/* rref.rpc_sync().method(args): runs a registered method on the value on
 * its owner and returns its reply (*out, ddp_rpc_message_free). */
ddp_status ddp_rref_rpc_sync(ddp_rref *rref, const char *method, const ddp_rpc_message *args,
                             double timeout_s, ddp_rpc_message *out);
int32_t ddp_rref_owner(const ddp_rref *rref); /* the owner's rank */
const char *ddp_rref_owner_name(const ddp_rref *rref);
bool ddp_rref_is_owner(const ddp_rref *rref);
/* "rref 1:4 (ps.create) on 'parameter_server'": for messages. */
const char *ddp_rref_name(const ddp_rref *rref);

/* Passing a reference on (PyTorch pickles it into an RPC): ddp_rref_fork
 * writes a token of DDP_RREF_TOKEN_BYTES for one receiver, which turns it
 * into its own reference with ddp_rref_from_token (exactly once; a token
 * never received leaks the parent's reference, reported at shutdown).
 * `rref` stays the caller's. */
#define DDP_RREF_TOKEN_BYTES 128
ddp_status ddp_rref_fork(ddp_rref *rref, void *token);
ddp_status ddp_rref_from_token(ddp_rpc_agent *agent, const void *token, ddp_rref **out);

/* Drops this reference (NULL ok). The owner learns of it once the
 * reference is confirmed and its own children are (asynchronously). */
void ddp_rref_release(ddp_rref *rref);
/* Waits until every reference message this worker sent (deletes, fork
 * requests, acceptances) has been acknowledged; DDP_ERR_TIMEOUT past
 * timeout_s. Graceful shutdown does it; tests use it to observe frees. */
ddp_status ddp_rref_flush(ddp_rpc_agent *agent, double timeout_s);
/* Values owned by this worker and alive now (tests). */
int64_t ddp_rref_owned_count(ddp_rpc_agent *agent);

/* ==== Distributed autograd ==================================================
 * A context (one per training step) records, on every worker it touches,
 * the calls made within it whose tensors need gradients: each call's
 * request tensors that require grad are "sends" on the caller and leaves
 * requiring grad ("receives") on the callee, and likewise for the reply.
 * ddp_dist_backward runs the tape of the worker it is called on, sends the
 * gradients of its receives back to their senders, which run their tapes
 * from the sends, and so on (PyTorch's FAST mode), and returns when every
 * worker reached is done. Gradients of leaves (parameters) accumulate in
 * the context, never in the tensors' own grad. */

typedef struct ddp_dist_context ddp_dist_context;
typedef struct ddp_dist_call ddp_dist_call; /* a call being served within a context */

/* dist_autograd.context(): a new context with a job-wide unique id. *out is
 * the caller's: end it with ddp_dist_context_end. */
ddp_status ddp_dist_context_begin(ddp_rpc_agent *agent, ddp_dist_context **out);
/* Frees the context here and on every worker it reached (they are told and
 * answer; bounded by the agent's default timeout). NULL ok. Returns the
 * first failure to reach one (the context is freed here anyway). */
ddp_status ddp_dist_context_end(ddp_dist_context *ctx);
int64_t ddp_dist_context_id(const ddp_dist_context *ctx);
/* The tape this worker records the context's local ops on (the loss).
 * Owned by the context. */
ddp_tape *ddp_dist_context_tape(ddp_dist_context *ctx);

/* A function called within a context. Its args' tensors that the caller
 * marked as needing grad arrive as leaves requiring grad; it records its
 * ops on ddp_dist_call_tape(call); reply tensors that require grad (made on
 * that tape, or such leaves) are sent back as needing grad. Reply tensors
 * may point into the tape or the args (both live as long as the context). */
typedef ddp_status (*ddp_dist_handler)(ddp_dist_call *call, const ddp_rpc_message *args,
                                       ddp_rpc_message *reply, void *user);
/* Register on every worker before ddp_rpc_init. */
ddp_status ddp_dist_register(const char *name, ddp_dist_handler fn, void *user);

/* Calls `fn` on worker `to` within ctx. *result is borrowed from the
 * context (valid until ddp_dist_context_end): its tensors that the callee
 * made from tensors needing grad require grad here. Errors as
 * ddp_rpc_sync's. Inside a dist handler, pass that call's context
 * (ddp_dist_call_context): the nested call is recorded on its tape. */
ddp_status ddp_dist_rpc_sync(ddp_dist_context *ctx, const char *to, const char *fn,
                             const ddp_rpc_message *args, double timeout_s,
                             const ddp_rpc_message **result);
/* ddp_dist_rpc_sync on the owner of rref, whose handler gets the value
 * (ddp_dist_call_value): "calls on the referenced object" within a context. */
ddp_status ddp_dist_rref_call(ddp_dist_context *ctx, ddp_rref *rref, const char *fn,
                              const ddp_rpc_message *args, double timeout_s,
                              const ddp_rpc_message **result);

/* Inside a dist handler: */
ddp_tape *ddp_dist_call_tape(ddp_dist_call *call);
ddp_dist_context *ddp_dist_call_context(ddp_dist_call *call);
ddp_rpc_call *ddp_dist_call_rpc(ddp_dist_call *call);
/* The referenced value for a ddp_dist_rref_call, else NULL. */
void *ddp_dist_call_value(ddp_dist_call *call);

/* dist_autograd.backward(context, [loss]): loss (one float32) on
 * ddp_dist_context_tape(ctx). One backward per context (FAST mode runs
 * each worker's recorded ops once). */
ddp_status ddp_dist_backward(ddp_dist_context *ctx, ddp_tensor *loss);
/* dist_autograd.get_gradients(context) on this worker: the gradient the
 * context accumulated for leaf t (numel floats, owned by the context), or
 * NULL when it has none. */
const float *ddp_dist_get_gradient(ddp_dist_context *ctx, const ddp_tensor *t);
/* This worker's view of context `id` (a handler's, or after a backward
 * reached it): borrowed until the context ends; DDP_ERR_NOTFOUND if none. */
ddp_status ddp_dist_context_retrieve(ddp_rpc_agent *agent, int64_t id, ddp_dist_context **out);

/* ==== Distributed optimizer ================================================
 * Steps each parameter on its owner with a local optimizer (options: SGD,
 * Adam, Adadelta as optim.h's) from the gradients a context accumulated
 * there. Steps on the same parameters are serialised on their owner, and a
 * step waits until no other context still needs those parameters' current
 * values for a backward (docs/rpc.md, "Parameters a backward needs"). */
typedef struct ddp_dist_optimizer ddp_dist_optimizer;

/* params: references to tensors (float32, on their owners), borrowed for
 * the call (the optimizer keeps references of its own on the owners).
 * Collective with nothing: one request per owner. */
ddp_status ddp_dist_optimizer_create(ddp_rpc_agent *agent, const ddp_optim_options *options,
                                     int num_params, ddp_rref *const *params,
                                     ddp_dist_optimizer **out);
/* opt.step(context_id): every owner steps at once; returns when all did.
 * Parameters without a gradient in the context are left as they are. */
ddp_status ddp_dist_optimizer_step(ddp_dist_optimizer *opt, ddp_dist_context *ctx);
/* Frees the owners' optimizers (NULL ok). */
void ddp_dist_optimizer_destroy(ddp_dist_optimizer *opt);

#ifdef __cplusplus
}
#endif
#endif /* DDP_RPC_AUTOGRAD_H */
