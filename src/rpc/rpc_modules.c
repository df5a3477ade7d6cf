/* The layers built on the RPC engine that keep per-agent state or serve
 * built-in "__ddp." functions (remote references, distributed autograd, the
 * distributed optimizer: src/rpc_autograd/): one row each, in the order
 * their init runs. The rows are defined there and named here by extern
 * declarations only: the engine includes none of rpc_autograd's headers. */
#include "rpc/rpc_internal.h"

/* A placeholder keeps the array non-empty in C11; it has no hooks. */
static const ddp__rpc_module engine_module = {.name = "engine"};

/* Remote references, distributed autograd and the distributed optimizer
 * (src/rpc_autograd/rref.c, dist_autograd.c, dist_optim.c). The optimizer comes
 * first: at shutdown it lets go of its parameters' references before the
 * references' module names those still held. */
extern const ddp__rpc_module ddp__dist_optim_module;
extern const ddp__rpc_module ddp__dist_autograd_module;
extern const ddp__rpc_module ddp__rref_module;

const ddp__rpc_module *const ddp__rpc_modules[] = {
    &engine_module,
    &ddp__dist_optim_module,
    &ddp__dist_autograd_module,
    &ddp__rref_module,
};
const int ddp__rpc_num_modules = (int)(sizeof ddp__rpc_modules / sizeof ddp__rpc_modules[0]);
_Static_assert(sizeof ddp__rpc_modules / sizeof ddp__rpc_modules[0] <= DDP__RPC_MAX_MODULES,
               "more modules than DDP__RPC_MAX_MODULES");
