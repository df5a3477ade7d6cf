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

/* The host tables of the group cfg describes. Hosts are numbered 0.. in
 * order of their lowest rank (group.c numbers them so), so host g's first
 * rank in by_host is its leader. Sets *nhosts, *host_first (nhosts + 1:
 * where host g's ranks start in by_host), *by_host (size: ranks grouped by
 * host, each host's in rank order) and *local_index (size: each rank's
 * index within its host); the caller ddp_frees the three arrays, also
 * after a failure (each is then an array or NULL). */
ddp_status ddp__hier_host_tables(const ddp__backend_config *cfg, int *nhosts, int **host_first, int **by_host,
                                 int **local_index);

/* A composition's scratch buffer: kept, grown on demand. */
typedef struct ddp__hier_scratch {
  unsigned char *buf;
  size_t bytes;
} ddp__hier_scratch;

/* At least `bytes` of s (its contents not kept when it grows), or NULL with
 * DDP_ERR_NOMEM's error naming `who`. */
void *ddp__hier_scratch_get(ddp__hier_scratch *s, size_t bytes, const char *who);
void ddp__hier_scratch_free(ddp__hier_scratch *s);

/* A composition's point-to-point lane (backend.h's p2p_progress, lane
 * thread only): requests to host mates go to the local backend's lane (the
 * peer rewritten to its local index for the call, then back), the others to
 * the between-hosts backend's (`remote`: tcp or mpi, group ranks). When both
 * sides have requests pending each waits briefly in turn (1 ms), so neither
 * side's messages wait long behind the other's sleep. A failure is the
 * lane's (*culprit: its index in reqs, or -1). The split lists grow on
 * demand and are kept here. */
typedef struct ddp__hier_lane {
  ddp__p2p_req **local, **remote;
  int *local_at, *remote_at; /* each one's index in the caller's list */
  int cap;
} ddp__hier_lane;

/* The composition's layout the lane reads: host_of (group rank -> host),
 * my_host, local_index (group rank -> index within its host) and mates
 * (this host's group ranks, by local index). */
typedef struct ddp__hier_layout {
  const int32_t *host_of;
  int my_host;
  const int *local_index;
  const int *mates;
} ddp__hier_layout;

ddp_status ddp__hier_lane_progress(ddp__hier_lane *lane, const ddp__hier_layout *at, ddp__backend *local,
                                   ddp__backend *remote, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs,
                                   int n, int64_t wait_ns, int *culprit);
void ddp__hier_lane_free(ddp__hier_lane *lane);

#endif /* DDP__COMM_HIER_H */
