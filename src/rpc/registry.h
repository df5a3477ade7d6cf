/* The function table (registry.c). */
#ifndef DDP_RPC_REGISTRY_H
#define DDP_RPC_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>

#include "ddp/rpc.h"

/* DDP_OK when name is a valid worker or function name; else says why. */
ddp_status ddp__rpc_check_name(const char *what, const char *name);
/* The handler registered under name (copied out under the table's lock). */
bool ddp__rpc_lookup(const char *name, ddp_rpc_handler *fn, void **user);
/* "echo, add, step" (user functions only; "none"), for error messages. */
void ddp__rpc_registered_names(char *buf, size_t bytes);

#endif /* DDP_RPC_REGISTRY_H */
