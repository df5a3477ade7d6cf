/* ddp rpc: remote procedure calls between named workers (PyTorch's
 * torch.distributed.rpc). Workers meet through the same rendezvous as process
 * groups; each may call a function registered by name on any other, with
 * arguments and results made of bytes plus tensors; calls are served by a
 * pool of threads on the callee, so a handler may itself call RPC. Calls go
 * through Unix sockets between workers of one host and TCP between hosts;
 * tensors are written from and read into their final memory (no packing
 * copy). docs/rpc.md has the rules, the wire format and the reasons.
 *
 * The model of use (every worker):
 *
 *   static ddp_status echo(ddp_rpc_call *call, const ddp_rpc_message *args,
 *                          ddp_rpc_message *reply, void *user) {
 *     *reply = *args;  // the reply may point into args (sent before they are freed)
 *     reply->release = NULL;
 *     return DDP_OK;
 *   }
 *   ddp_rpc_register("echo", echo, NULL);           // before init, on every worker
 *   ddp_rpc_options o = ddp_rpc_defaults();
 *   o.name = "trainer1";                            // rank, world size: env://
 *   ddp_rpc_agent *rpc;
 *   DDP_TRY(ddp_rpc_init(&o, &rpc));                // collective: all workers meet
 *   ddp_tensor *t[1] = {x};
 *   ddp_rpc_message args = {.tensors = t, .num_tensors = 1}, out;
 *   DDP_TRY(ddp_rpc_sync(rpc, "ps", "echo", &args, DDP_RPC_DEFAULT_TIMEOUT, &out));
 *   ... out.tensors[0] ...
 *   ddp_rpc_message_free(&out);
 *   ddp_rpc_shutdown(rpc, true, -1);                // collective when graceful
 *
 * Threads: every function here may be called from any thread, handlers and
 * then-callbacks included. */
#ifndef DDP_RPC_H
#define DDP_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/store.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Worker and function names: 1..DDP_RPC_MAX_NAME_BYTES-1 bytes of
 * [A-Za-z0-9_.:-]. Function names starting with "__" are reserved for ddp's
 * own messages (remote references, distributed autograd). */
#define DDP_RPC_MAX_NAME_BYTES 64
/* PyTorch's default RPC timeout (rpc.constants.DEFAULT_RPC_TIMEOUT_SEC). */
#define DDP_RPC_DEFAULT_TIMEOUT_S 60.0
/* Pass as a timeout_s to mean "the agent's default" (options.timeout_s). */
#define DDP_RPC_DEFAULT_TIMEOUT (-1.0)
/* Limits checked on both ends before a length is trusted. */
#define DDP_RPC_MAX_TENSORS 65536
#define DDP_RPC_MAX_PAYLOAD_BYTES ((uint64_t)1 << 34)     /* 16 GiB */
#define DDP_RPC_MAX_MESSAGE_BYTES ((uint64_t)1 << 36)     /* 64 GiB, tensors included */

typedef struct ddp_rpc_agent ddp_rpc_agent;   /* this process's worker */
typedef struct ddp_rpc_future ddp_rpc_future; /* a call's (or a user's) pending result */
typedef struct ddp_rpc_call ddp_rpc_call;     /* a request being served (handler context) */
typedef struct ddp_rpc_reply ddp_rpc_reply;   /* a deferred reply, sent later */

/* ---- Messages -------------------------------------------------------------
 * Arguments and results: a byte payload and a list of CPU tensors (any
 * dtype, contiguous). A message is a descriptor: it points at memory that
 * someone owns, and `release` (may be NULL) is how the engine tells that
 * someone it no longer needs the memory.
 *
 * Sending (ddp_rpc_sync / ddp_rpc_async args, a handler's reply): the
 * contents are only read, during the call: ddp_rpc_async returns once the
 * request is written, so the caller may reuse its buffers at once. The
 * engine never calls `release` of args passed to sync/async (they are the
 * caller's); it calls a reply's `release(release_ctx)` once the reply is
 * sent (or could not be), exactly once.
 *
 * Receiving (a handler's args, a result from sync / future_take): the engine
 * allocates one block holding the payload, the tensor descriptors and their
 * data (each 64-byte aligned); `tensors[i]->data` is writable. Such a message
 * is freed with ddp_rpc_message_free, which calls its release. Received
 * tensors are views: their flags do not include DDP_TENSOR_OWNS_DATA, so
 * never ddp_tensor_destroy them; copy what must outlive the message. */
typedef struct ddp_rpc_message {
  const void *payload;          /* payload_bytes bytes; NULL when 0 */
  size_t payload_bytes;
  ddp_tensor *const *tensors;   /* num_tensors pointers; NULL when 0 */
  int32_t num_tensors;
  int32_t reserved32;
  void (*release)(void *release_ctx); /* who frees the contents; NULL: nothing to free */
  void *release_ctx;
  uint64_t reserved[4];
} ddp_rpc_message;
DDP_STRUCT_SIZE(ddp_rpc_message, 80);

/* Frees a message that the caller owns (from ddp_rpc_sync, ddp_rpc_future_take,
 * ddp_rpc_call_take_args): calls msg->release(msg->release_ctx) if set, then
 * zeroes *msg. Accepts NULL and a zeroed message. */
void ddp_rpc_message_free(ddp_rpc_message *msg);

/* ---- Functions ------------------------------------------------------------
 * A handler serves one request on a pool thread of the callee. `args` is
 * valid until the handler returns (or longer, see ddp_rpc_call_take_args);
 * `reply` arrives zeroed: fill it to return a result (it may point into
 * args, whose memory outlives the send). Return DDP_OK, or an error status
 * with ddp_error(...) describing it: the caller's call then fails with that
 * status and the message, prefixed with this worker's and the function's
 * names ("rpc to worker 'ps' (rank 0): function 'step': payload of 3 bytes,
 * expected 8"). A reply filled before an error is released, not sent.
 * A handler may block, call RPC (ddp_rpc_call_agent), or defer its reply
 * (ddp_rpc_call_defer). */
typedef ddp_status (*ddp_rpc_handler)(ddp_rpc_call *call, const ddp_rpc_message *args,
                                      ddp_rpc_message *reply, void *user);

/* Registers `fn` under `name` for every agent of this process (PyTorch
 * resolves a function by its pickled name; here, by this name). Register on
 * every worker before ddp_rpc_init: a request that arrives for a name not
 * (yet) registered fails with DDP_ERR_NOTFOUND, naming the function and the
 * worker. Registering a name again replaces it. Names starting with "__"
 * are refused (DDP_ERR_INVALID). `user` is passed to every call. */
ddp_status ddp_rpc_register(const char *name, ddp_rpc_handler fn, void *user);
/* Removes a registration (DDP_ERR_NOTFOUND if absent). Requests already
 * running finish; later ones fail as unregistered. */
ddp_status ddp_rpc_unregister(const char *name);

/* ---- Agent ---------------------------------------------------------------- */

typedef enum ddp_rpc_transport {
  DDP_RPC_TRANSPORT_AUTO = 0, /* Unix sockets within a host, TCP between hosts */
  DDP_RPC_TRANSPORT_TCP = 1,  /* TCP everywhere (to measure it, or across containers) */
} ddp_rpc_transport;

/* Start from ddp_rpc_defaults(), then set what you need (name at least). */
typedef struct ddp_rpc_options {
  const char *name;        /* this worker's name (required), unique in the job */
  const char *init_method; /* NULL: "env://" (torchrun's / Slurm's / MPI's variables,
                            * DDP_STORE_ADDR); "tcp://host:port", "file:///path" */
  int32_t rank;            /* -1: from init_method / the environment */
  int32_t world_size;      /* -1: from init_method / the environment */
  /* Threads serving requests and then-callbacks; <= 0: $DDP_RPC_THREADS, else
   * 4. One is enough for nested calls (see ddp_rpc_future_wait). */
  int32_t num_threads;
  ddp_rpc_transport transport;
  /* Default per-call timeout; <= 0: $DDP_RPC_TIMEOUT seconds, else 60. */
  double timeout_s;
  /* How long init may take (rendezvous, every worker connected); <= 0: the
   * rendezvous default ($DDP_TIMEOUT, else 1800 s). */
  double init_timeout_s;
  /* Meet in this store instead of a rendezvous (rank and world_size then
   * required); the agent keeps a reference until shutdown. NULL: rendezvous
   * through init_method. */
  ddp_store *store;
  uint64_t reserved[8];
} ddp_rpc_options;
DDP_STRUCT_SIZE(ddp_rpc_options, 120);

/* The defaults: name NULL (to be set), init_method NULL (env://), rank and
 * world_size -1 (from init_method), num_threads 0 ($DDP_RPC_THREADS, else 4),
 * DDP_RPC_TRANSPORT_AUTO, timeout_s 0 ($DDP_RPC_TIMEOUT, else 60 s),
 * init_timeout_s 0 (the rendezvous default), store NULL. */
ddp_rpc_options ddp_rpc_defaults(void);

/* Where a worker is; same on every worker for a given rank. */
typedef struct ddp_rpc_worker_info {
  char name[DDP_RPC_MAX_NAME_BYTES];
  int32_t rank;
  int32_t host_index; /* equal for workers of one host (0..hosts-1, by lowest rank) */
  char addr[96];      /* where it listens for TCP ("10.0.0.2:41234") */
  uint64_t reserved[4];
} ddp_rpc_worker_info;
DDP_STRUCT_SIZE(ddp_rpc_worker_info, 200);

/* Starts this process's worker: meets every other worker (the rendezvous, or
 * opts->store), checks that names are unique (a duplicate fails on every
 * worker, naming both ranks: "worker name 'w' is used by rank 0 and rank 2"),
 * connects to every other worker (eagerly, so a worker that is missing or
 * unreachable fails init, named, within init_timeout_s), starts the pool,
 * and returns when every worker has done the same (a barrier). *out is owned
 * by the caller: end it with ddp_rpc_shutdown. Several agents may live in one
 * process (threads as workers, in tests), each with its own name. On failure
 * *out is NULL and nothing is left running. */
ddp_status ddp_rpc_init(const ddp_rpc_options *opts, ddp_rpc_agent **out);

/* Ends the agent and frees it (always, whatever is returned).
 * graceful (PyTorch's default): waits until this worker's outstanding calls
 * have completed, then meets every other live worker (each tells every
 * other that it is done; requests keep being served meanwhile), so no
 * worker leaves while another still has work for it; then closes. A worker
 * that dies meanwhile is skipped: shutdown still ends and returns
 * DDP_ERR_PEER naming it. timeout_s bounds the whole (<= 0: the agent's
 * default call timeout); past it, DDP_ERR_TIMEOUT naming the workers not
 * heard from. Not graceful: fails every pending call and future at once
 * ("agent shut down") and closes. Collective when graceful. Accepts NULL. */
ddp_status ddp_rpc_shutdown(ddp_rpc_agent *agent, bool graceful, double timeout_s);

/* This worker; valid for the agent's life. */
const ddp_rpc_worker_info *ddp_rpc_self(const ddp_rpc_agent *agent);
int32_t ddp_rpc_world_size(const ddp_rpc_agent *agent);
/* A worker by name (name non-NULL) or else by rank, copied to *out.
 * DDP_ERR_NOTFOUND naming what was asked and the workers there are. */
ddp_status ddp_rpc_get_worker_info(const ddp_rpc_agent *agent, const char *name, int32_t rank,
                                   ddp_rpc_worker_info *out);
/* How this agent reaches `rank`: "self", "unix" or "tcp"; "?" for a bad rank. */
const char *ddp_rpc_transport_name(const ddp_rpc_agent *agent, int32_t rank);

/* ---- Calls ----------------------------------------------------------------
 * `to` is a worker's name; `fn` a function name registered there; `args` may
 * be NULL (empty). timeout_s: DDP_RPC_DEFAULT_TIMEOUT (or any value <= 0)
 * for the agent's default. A call fails, alone (the next works), with:
 *   DDP_ERR_NOTFOUND  no such worker, or `fn` not registered there;
 *   DDP_ERR_TIMEOUT   no reply within timeout_s (a late reply is dropped;
 *                     the remote handler is not interrupted);
 *   DDP_ERR_CLOSED    the worker died or left (within milliseconds of its
 *                     connection closing: a killed process's socket closes);
 *   the handler's own status when it returned an error;
 *   DDP_ERR_STATE     the agent is shutting down.
 * Every message names the worker, its rank and the function. */

/* Calls and waits. On success *result (may be NULL to discard) is the reply,
 * owned by the caller (ddp_rpc_message_free); on failure it is zeroed. */
ddp_status ddp_rpc_sync(ddp_rpc_agent *agent, const char *to, const char *fn,
                        const ddp_rpc_message *args, double timeout_s, ddp_rpc_message *result);

/* Sends the request and returns a future (*out, owned by the caller:
 * ddp_rpc_future_destroy). The args' memory is free to reuse on return. A
 * failure to send (unknown worker, dead connection) is returned here and
 * *out is NULL; later failures complete the future with an error. */
ddp_status ddp_rpc_async(ddp_rpc_agent *agent, const char *to, const char *fn,
                         const ddp_rpc_message *args, double timeout_s, ddp_rpc_future **out);

/* ---- Futures --------------------------------------------------------------
 * A future completes once, with a message or an error. It is reference
 * counted: the caller's reference (from ddp_rpc_async or _create) ends with
 * ddp_rpc_future_destroy; the engine holds its own while the call is
 * pending, so destroying a pending future is allowed (its result is then
 * dropped). */

/* Waits until f completes or timeout_s passes (< 0: until the call's own
 * deadline; a future from ddp_rpc_future_create: the agent's default
 * timeout). Returns the call's status once complete (its error message in
 * the last error), DDP_ERR_TIMEOUT if this wait ran out first (f stays
 * pending: ddp_rpc_future_done tells the two timeouts apart).
 * On a pool thread (in a handler or a then-callback) the wait serves other
 * queued requests meanwhile, so nested calls (A -> B -> A -> ...) complete
 * even with a pool of one thread. */
ddp_status ddp_rpc_future_wait(ddp_rpc_future *f, double timeout_s);
/* Whether f has completed (no wait). */
bool ddp_rpc_future_done(const ddp_rpc_future *f);
/* The status of a completed future; DDP_ERR_STATE while pending. */
ddp_status ddp_rpc_future_status(const ddp_rpc_future *f);
/* The error message of a completed, failed future ("" otherwise). Valid for
 * the future's life. Names the worker and the function. */
const char *ddp_rpc_future_error(const ddp_rpc_future *f);
/* A completed future's result, borrowed (valid until the future is
 * destroyed or its result taken). The call's status if it failed;
 * DDP_ERR_STATE while pending or after take. */
ddp_status ddp_rpc_future_result(ddp_rpc_future *f, const ddp_rpc_message **out);
/* Moves a completed future's result to *out (caller frees with
 * ddp_rpc_message_free). Same errors as _result; *out zeroed then. */
ddp_status ddp_rpc_future_take(ddp_rpc_future *f, ddp_rpc_message *out);

/* Calls cb(f, user) once f completes, on a pool thread of f's agent (so the
 * callback may block or call RPC); at once on the calling thread if f has
 * completed already. Several callbacks run in the order they were added.
 * The callback must not destroy f (the engine holds a reference meanwhile).
 * DDP_ERR_NOMEM leaves nothing registered. */
typedef void (*ddp_rpc_future_callback)(ddp_rpc_future *f, void *user);
ddp_status ddp_rpc_future_then(ddp_rpc_future *f, ddp_rpc_future_callback cb, void *user);

/* Drops the caller's reference. Accepts NULL. */
void ddp_rpc_future_destroy(ddp_rpc_future *f);

/* A future the caller completes (torch.futures.Future): with a result
 * (taken: *result's release will be called by the future) or an error. The
 * second completion of a future fails with DDP_ERR_STATE (and a given
 * result is released). */
ddp_status ddp_rpc_future_create(ddp_rpc_agent *agent, ddp_rpc_future **out);
ddp_status ddp_rpc_future_complete(ddp_rpc_future *f, ddp_rpc_message *result);
ddp_status ddp_rpc_future_fail(ddp_rpc_future *f, ddp_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- Inside a handler ------------------------------------------------------ */

/* The agent serving the call (to make nested calls). */
ddp_rpc_agent *ddp_rpc_call_agent(const ddp_rpc_call *call);
/* Who called, and which function (valid during the handler). */
const ddp_rpc_worker_info *ddp_rpc_call_caller(const ddp_rpc_call *call);
const char *ddp_rpc_call_function(const ddp_rpc_call *call);
/* Seconds left before the caller gives up (it may be negative). */
double ddp_rpc_call_time_left_s(const ddp_rpc_call *call);

/* Takes the request's args out of the engine's hands into *out (caller
 * frees with ddp_rpc_message_free), e.g. to keep a tensor without copying.
 * Once per call; the handler's `args` pointer stays valid until it returns. */
ddp_status ddp_rpc_call_take_args(ddp_rpc_call *call, ddp_rpc_message *out);

/* Defers the reply: the handler then returns DDP_OK without filling its
 * reply (ignored if it does), and later, from any thread, exactly one of
 * ddp_rpc_reply_send / ddp_rpc_reply_fail sends it (consuming *out). For
 * handlers that wait for something else (serialised optimizer steps):
 * the pool thread is free meanwhile. The caller's timeout still applies;
 * a reply for a caller that is gone is dropped. The args are freed when the
 * handler returns unless taken. */
ddp_status ddp_rpc_call_defer(ddp_rpc_call *call, ddp_rpc_reply **out);
/* Sends the deferred reply (reply may be NULL: empty) and frees `r`; the
 * reply's release is called once sent. Returns the send's status (the
 * caller gone is DDP_ERR_CLOSED; `r` is freed anyway). */
ddp_status ddp_rpc_reply_send(ddp_rpc_reply *r, ddp_rpc_message *reply);
/* Sends an error as the handler's return would, and frees `r`. */
ddp_status ddp_rpc_reply_fail(ddp_rpc_reply *r, ddp_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif
#endif /* DDP_RPC_H */
