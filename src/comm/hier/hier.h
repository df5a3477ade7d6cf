/* What the hierarchical compositions share: hier/hier.c's (shared memory
 * inside a host, ddp's TCP between hosts) and mpi/leaders.c's (shared
 * memory inside a host, MPI between the hosts' leaders). */
#ifndef DDP__COMM_HIER_H
#define DDP__COMM_HIER_H

#include "comm/backend.h"

/* The local backend (shared memory) over one host's ranks of the group
 * cfg describes: `mates` (ls group ranks, in rank order; this rank is
 * mates[li]) in the store namespace `ns` of cfg->store (its prefix store
 * returned in *store, which the caller destroys after the backend). The
 * backend takes the group ranks, so its messages and blame name them. */
ddp_status ddp__hier_local_create(const ddp__backend_config *cfg, const char *ns, const int *mates, int ls,
                                  int li, ddp_store **store, ddp__backend **out);

#endif /* DDP__COMM_HIER_H */
