/* Internal pieces of the rendezvous, exposed to each other and to the tests
 * (not to other layers): init-URL parsing, the environment contracts
 * (torchrun, Slurm, MPI), Slurm's tasks-per-node lists. Host identity and
 * host:port splitting are net's (net/net.h), the rank lists of messages
 * core's (core/core_internal.h). Not installed. */
#ifndef DDP_RDZV_INTERNAL_H
#define DDP_RDZV_INTERNAL_H

#include <stdint.h>

#include "ddp/core.h"
#include "ddp/rendezvous.h"
#include "ddp/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Init URLs ----------------------------------------------------------- */
typedef enum ddp__rdzv_scheme {
  DDP__RDZV_ENV = 0,  /* env:// */
  DDP__RDZV_TCP = 1,  /* tcp://host:port */
  DDP__RDZV_FILE = 2, /* file:///abs/path */
} ddp__rdzv_scheme;

#define DDP__RDZV_HOST_MAX 256
#define DDP__RDZV_PATH_MAX 4096

typedef struct ddp__rdzv_url {
  ddp__rdzv_scheme scheme;
  char host[DDP__RDZV_HOST_MAX]; /* tcp: without IPv6 brackets */
  int32_t port;                  /* tcp: 1..65535 */
  char path[DDP__RDZV_PATH_MAX]; /* file: absolute path */
  int32_t rank;                  /* ?rank=, or -1 */
  int32_t world_size;            /* ?world_size=, or -1 */
} ddp__rdzv_url;

/* Parses an init URL strictly. NULL or "" mean "env://". Errors name the URL
 * and what is wrong with it. */
ddp_status ddp__rdzv_url_parse(const char *url, ddp__rdzv_url *out);

/* ---- Environment contracts ----------------------------------------------
 * Fills rank, world_size, local_rank, local_world_size (-1 where nothing says),
 * master_addr/master_port, the sources of each, init_method, store_addr and
 * timeout_s of *info from the options, the URL and the environment, in that
 * order of precedence (see docs/rendezvous.md). Touches nothing else in *info
 * and talks to no one, so tests can drive it with setenv(). */
ddp_status ddp__rdzv_resolve(const ddp__rdzv_url *url, const ddp_rendezvous_options *opts,
                             ddp_rendezvous_info *info);

/* Expands Slurm's tasks-per-node list ("2(x3),1" -> 2,2,2,1) and returns the
 * count of node `node_index` in *out. */
ddp_status ddp__slurm_tasks_per_node(const char *list, int64_t node_index, int32_t *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_RDZV_INTERNAL_H */
