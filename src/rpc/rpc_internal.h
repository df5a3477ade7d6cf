/* The RPC engine's insides, shared by the files of src/rpc/, and the one
 * header of rpc that the layer built on it (src/rpc_autograd/: remote
 * references, distributed autograd, the distributed optimizer) includes: the
 * built-in registration, modules, calls by rank, messages. Not installed. */
#ifndef DDP_RPC_INTERNAL_H
#define DDP_RPC_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "ddp/rendezvous.h"
#include "ddp/rpc.h"

/* ---- Named tables (registry.c) ---------------------------------------------
 * ddp's one registry of names: a process-wide table from a name (the rule of
 * worker and function names: 1..63 bytes of letters, digits, _ . : -) to a
 * value and a user pointer, growing as needed, thread-safe. rpc's functions,
 * rpc_autograd's RRef ctors and methods and dist functions, and ps's servers
 * and clients (by worker name) each keep one. A static table starts as
 * DDP__NAME_TABLE_INIT("function"), the word naming its entries in errors;
 * it lives as long as the process. */
typedef struct ddp__name_entry ddp__name_entry;
typedef struct ddp__name_table {
  pthread_mutex_t mu;
  const char *what;
  ddp__name_entry *entries;
  size_t n, cap;
} ddp__name_table;
#define DDP__NAME_TABLE_INIT(what) {PTHREAD_MUTEX_INITIALIZER, (what), NULL, 0, 0}

/* Sets name -> (value, user). A name already there: replaced when
 * `replace`, else DDP_ERR_STATE ("... '<name>' exists already"). Errors:
 * DDP_ERR_INVALID for a bad name (saying why) or a NULL value, NOMEM. */
ddp_status ddp__name_table_set(ddp__name_table *t, const char *name, void *value, void *user, bool replace);
/* Copies out the entry of name (under the lock); false when there is none. */
bool ddp__name_table_get(ddp__name_table *t, const char *name, void **value, void **user);
/* Removes name; DDP_ERR_NOTFOUND when absent. */
ddp_status ddp__name_table_remove(ddp__name_table *t, const char *name);
/* Removes every entry whose value is `value` (an object going away). */
void ddp__name_table_remove_value(ddp__name_table *t, const void *value);
/* "echo, add, step": the names not starting with "__" ("none"), for errors. */
void ddp__name_table_names(ddp__name_table *t, char *buf, size_t bytes);

/* ---- Built-in functions and modules ---------------------------------------
 * ddp's own messages (RRef fork/confirm/delete, distributed autograd's
 * backward and cleanup, optimizer steps) are ordinary requests to functions
 * whose names start with "__ddp." (users cannot register "__" names). A file
 * of src/rpc_autograd/ registers them once per process with
 * ddp__rpc_register_builtin (typically from its module's init, which runs
 * before the agent's final init barrier, so no request can arrive for a name
 * not yet registered). */
ddp_status ddp__rpc_register_builtin(const char *name, ddp_rpc_handler fn, void *user);

/* A module: per-agent state and hooks of a layer built on the engine. The
 * list is ddp__rpc_modules in rpc_modules.c (add a row there). Each hook may
 * be NULL. `slot` is the module's index there: its state lives in
 * *ddp__rpc_module_slot(agent, slot). The init and destroy hooks of all
 * agents of a process run one at a time (a process-wide lock), so they may
 * set up process-wide things (registering built-ins) without a race. */
typedef struct ddp__rpc_module {
  const char *name; /* "rref", "dist_autograd" */
  /* After every worker is connected, before init's final barrier; a failure
   * fails init (on this worker; the others time out in the barrier). */
  ddp_status (*init)(ddp_rpc_agent *agent, int slot);
  /* At the start of ddp_rpc_shutdown, before the engine waits for this
   * worker's outstanding calls (the module may still make calls: RRef
   * deletes). graceful as given to shutdown. */
  void (*before_shutdown)(ddp_rpc_agent *agent, int slot, bool graceful);
  /* A worker's connection failed (it died); on the thread that saw it,
   * after its pending calls were failed. Must not block. */
  void (*worker_failed)(ddp_rpc_agent *agent, int slot, int32_t rank);
  /* Last: the pool and the connections are gone; free the state. */
  void (*destroy)(ddp_rpc_agent *agent, int slot);
} ddp__rpc_module;

#define DDP__RPC_MAX_MODULES 8
extern const ddp__rpc_module *const ddp__rpc_modules[];
extern const int ddp__rpc_num_modules;
void **ddp__rpc_module_slot(ddp_rpc_agent *agent, int slot);
/* A module's slot (its index in ddp__rpc_modules), for code that is not
 * handed one (handlers): a constant, so no agent's init needs to store it
 * in a global (which agents started on several threads would race on). */
int ddp__rpc_module_index(const ddp__rpc_module *module);

/* A call to a worker by rank (no name lookup); otherwise ddp_rpc_async. */
ddp_status ddp__rpc_async_rank(ddp_rpc_agent *agent, int32_t to, const char *fn,
                               const ddp_rpc_message *args, double timeout_s,
                               ddp_rpc_future **out);

/* The agent whose pool runs the calling thread, or NULL. */
ddp_rpc_agent *ddp__rpc_current_pool_agent(void);

/* ---- Wire format (docs/rpc.md) ---------------------------------------------
 * One stream connection per pair of workers carries both directions. Each
 * frame: this header, then fn_bytes of function name (requests), then
 * num_tensors descriptors, then payload_bytes of payload, then each tensor's
 * data (numel x dtype size bytes), or, with DDP__RPC_FLAG_PULL, each tensor's
 * address for the receiver to read across processes. Host byte order: a peer of the other order
 * fails the handshake on the magic. */
#define DDP__RPC_MAGIC 0x31435044u /* "DPC1" */

enum {
  DDP__RPC_HELLO = 1,    /* connector -> acceptor; call_id = connector's rank; payload = its name */
  DDP__RPC_REQUEST = 2,  /* call_id; fn; timeout_ms = caller's timeout */
  DDP__RPC_REPLY = 3,    /* call_id; the result */
  DDP__RPC_ERROR = 4,    /* call_id; status; payload = the handler's message */
  DDP__RPC_DONE = 5,     /* graceful shutdown: "my outstanding calls are done" */
  DDP__RPC_PULLED = 6,   /* call_id = count of pulled frames so far (cross-memory attach) */
  DDP__RPC_BYE = 7,      /* status 1: a graceful shutdown ends, 0: an abrupt one; sent just
                          * before the sockets close, so a close without it is a death */
};
/* frame.flags: the tensors' data is not in the stream; num_tensors
 * addresses (uint64) in the sender's memory follow the payload instead. */
#define DDP__RPC_FLAG_PULL 1u

typedef struct ddp__rpc_frame {
  uint32_t magic;
  uint8_t kind;
  uint8_t fn_bytes;
  uint16_t flags;
  int32_t status;
  uint32_t num_tensors;
  uint64_t call_id;
  uint64_t payload_bytes;
  int64_t timeout_ms;
} ddp__rpc_frame; /* 40 bytes */

typedef struct ddp__rpc_tensor_desc {
  int32_t dtype;
  int32_t ndim;
  int64_t shape[DDP_MAX_DIMS];
} ddp__rpc_tensor_desc; /* 56 bytes */

/* ---- Messages (message.c) ----------------------------------------------------
 * A received message lives in one block: the block header, the tensor
 * pointer array, the tensor descriptors, the payload and the tensors' data,
 * each 64-byte aligned. `extra_bytes` more bytes follow the header for the
 * caller's use (an inbound request keeps its task there). */
typedef struct ddp__rpc_block {
  ddp_rpc_message msg;   /* release = ddp__rpc_block_free, release_ctx = this */
  void *extra;           /* extra_bytes, zeroed */
  void *payload;
  size_t total_bytes;
} ddp__rpc_block;

/* Validates descs (dtype, ndim, shapes, sizes within DDP_RPC_MAX_MESSAGE_BYTES,
 * naming what is wrong and `who` sent it) and allocates the block. */
ddp_status ddp__rpc_block_create(const ddp__rpc_tensor_desc *descs, uint32_t num_tensors,
                                 uint64_t payload_bytes, size_t extra_bytes, const char *who,
                                 ddp__rpc_block **out);
void ddp__rpc_block_free(void *block);
/* A deep copy of msg into one block (self calls, where the sender's memory
 * may change after ddp_rpc_async returns). */
ddp_status ddp__rpc_message_copy(const ddp_rpc_message *msg, size_t extra_bytes,
                                 ddp__rpc_block **out);
/* Checks a message to send: CPU tensors, contiguous sizes, limits. */
ddp_status ddp__rpc_message_check(const ddp_rpc_message *msg);
/* Bytes of tensor data of a tensor. */
size_t ddp__rpc_tensor_bytes(const ddp_tensor *t);

#endif /* DDP_RPC_INTERNAL_H */
