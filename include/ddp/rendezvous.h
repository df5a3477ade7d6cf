/* ddp rendezvous: how a worker learns its rank, the world size, its local rank
 * and its peers' hosts before any collective runs (PyTorch's init_method):
 * env:// (torchrun's variables, else Slurm's, else Open MPI's / PMI's),
 * tcp://host:port and file:///path, all meeting in a ddp store. The process
 * group (a later layer) is built on the result. docs/rendezvous.md has the
 * variables, their precedence, the join protocol's keys and what each error
 * means. */
#ifndef DDP_RENDEZVOUS_H
#define DDP_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a value of ddp_rendezvous_info came from, for debugging a launch. */
typedef enum ddp_rendezvous_source {
  DDP_RENDEZVOUS_SOURCE_NONE = 0,    /* "none": not known */
  DDP_RENDEZVOUS_SOURCE_OPTIONS = 1, /* "options": ddp_rendezvous_options */
  DDP_RENDEZVOUS_SOURCE_URL = 2,     /* "url": the init URL (host:port, ?rank=) */
  DDP_RENDEZVOUS_SOURCE_ENV = 3,     /* "env": torchrun's variables (RANK, MASTER_ADDR, ...) */
  DDP_RENDEZVOUS_SOURCE_SLURM = 4,   /* "slurm": SLURM_PROCID, SLURM_NODELIST, ... */
  DDP_RENDEZVOUS_SOURCE_MPI = 5,     /* "mpi": OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK */
  DDP_RENDEZVOUS_SOURCE_HOSTS = 6,   /* "hosts": counted from the ranks' host identities */
  DDP_RENDEZVOUS_SOURCE_DEFAULT = 7, /* "default": a built-in default */
} ddp_rendezvous_source;

/* "env", "slurm", ... (see above); never NULL. */
const char *ddp_rendezvous_source_name(ddp_rendezvous_source source);

/* Arguments that override the URL and the environment, as
 * init_process_group's rank= and world_size=. Start from
 * ddp_rendezvous_defaults(), then set what you need; NULL wherever options
 * are taken means the defaults. (A zero-initialised struct asks for rank 0
 * of a world of 0, which is refused.) */
typedef struct ddp_rendezvous_options {
  int32_t rank;       /* -1: from the URL's ?rank= or the environment */
  int32_t world_size; /* -1: from the URL's ?world_size= or the environment */
  /* How long the whole rendezvous may take (connecting, waiting for every
   * rank) and the store's default timeout afterwards; <= 0: $DDP_TIMEOUT
   * seconds, 1800 when unset (PyTorch's default). */
  double timeout_s;
  uint64_t reserved[8];
} ddp_rendezvous_options;
DDP_STRUCT_SIZE(ddp_rendezvous_options, 80);

/* The defaults: rank and world_size -1 (from the URL or the environment),
 * timeout_s 0 ($DDP_TIMEOUT, else 1800 s). */
ddp_rendezvous_options ddp_rendezvous_defaults(void);

#define DDP_RENDEZVOUS_HOST_ID_BYTES 256
#define DDP_RENDEZVOUS_ADDR_BYTES 256
#define DDP_RENDEZVOUS_STORE_ADDR_BYTES 4200

/* The result of a rendezvous. Caller-allocated, filled by ddp_rendezvous.
 *
 * Ownership: the info owns `store`, `server` and `rank_host`; release them all
 * with ddp_rendezvous_info_destroy. On the rank that hosts the store (rank 0
 * without DDP_STORE_ADDR, for env:// and tcp://) `server` is the running store
 * server: destroying the info waits until the other ranks have disconnected
 * (at most 2 s), then stops it, which disconnects anyone left; so rank 0
 * should still destroy its info last (after a final barrier, as in PyTorch
 * where rank 0's exit takes the TCPStore with it). To keep the store
 * beyond the info, ddp_store_retain(info->store) first; to keep the server,
 * move it out (copy the pointer, set info->server = NULL) and stop it later
 * with ddp_store_server_stop. */
typedef struct ddp_rendezvous_info {
  ddp_store *store;          /* connected store, default timeout = timeout_s */
  ddp_store_server *server;  /* the hosted server, or NULL */
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;        /* rank among the processes of this host */
  int32_t local_world_size;  /* processes on this host */
  /* Host identities, exchanged in the join: hosts are numbered 0..num_hosts-1
   * in order of their lowest rank; rank_host[r] (world_size entries) is rank
   * r's host, host_index this rank's. Ranks on one host may share memory. */
  int32_t num_hosts;
  int32_t host_index;
  int32_t *rank_host;
  char host_id[DDP_RENDEZVOUS_HOST_ID_BYTES];    /* "hostname/netns-inode" or $DDP_HOST_ID */
  char init_method[8];                           /* "env", "tcp" or "file" */
  char master_addr[DDP_RENDEZVOUS_ADDR_BYTES];   /* where rank 0 hosts; "" for file:// */
  int32_t master_port;                           /* 0 for file:// */
  /* Where the store is: "host:port" (the master, or DDP_STORE_ADDR's launcher
   * store) or "file:///path". */
  char store_addr[DDP_RENDEZVOUS_STORE_ADDR_BYTES];
  int32_t store_is_external;                     /* 1: DDP_STORE_ADDR (a launcher hosts it) */
  double timeout_s;
  ddp_rendezvous_source rank_source;
  ddp_rendezvous_source world_size_source;
  ddp_rendezvous_source local_rank_source;
  ddp_rendezvous_source local_world_size_source;
  ddp_rendezvous_source master_source;           /* of master_addr and master_port */
  uint64_t reserved[8];
} ddp_rendezvous_info;
DDP_STRUCT_SIZE(ddp_rendezvous_info, 4872);

/* Meets every other rank of the job through `url` (NULL means "env://") and
 * fills *out. opts may be NULL (all from the URL and the environment).
 *
 * Rank 0 hosts the store server on master_addr:master_port unless
 * DDP_STORE_ADDR names a store that a launcher already runs; the others
 * connect, retrying with backoff until the timeout. Every rank then registers
 * and waits for all world_size ranks, so a successful return means all of
 * them are here. Errors say which address, which key, how long it waited and
 * who is missing ("timed out after 30 s waiting for workers: 3/4 joined;
 * missing ranks: 2"). On success, log lines carry this rank (ddp_log_set_rank).
 * On failure *out holds nothing to destroy (it is zeroed), and a server this
 * call started is stopped (after up to 2 s, so the others can read why). */
ddp_status ddp_rendezvous(const char *url, const ddp_rendezvous_options *opts,
                          ddp_rendezvous_info *out);

/* Whether the environment asks this process to join a multi-process job:
 * the name of the variable that does, or NULL. A ddp launcher's store
 * (DDP_STORE_ADDR), or a world size above one from torchrun's (WORLD_SIZE),
 * an srun step's (SLURM_STEP_NUM_TASKS) or an MPI launcher's variables
 * (OMPI_COMM_WORLD_SIZE, PMI_SIZE). An sbatch script's own environment
 * (SLURM_NTASKS without a step) is not asking: a tool started there runs
 * as one process unless started with srun or ddprun. Malformed values
 * count as asking (the rendezvous then names them). */
const char *ddp_rendezvous_requested(void);

/* Destroys the store, stops the server if this rank hosts it (after waiting
 * up to 2 s for the other ranks to disconnect), frees rank_host and zeroes
 * *info. Accepts NULL and a zeroed info. */
void ddp_rendezvous_info_destroy(ddp_rendezvous_info *info);

/* ---- Slurm hostlists ------------------------------------------------------
 * Expands a Slurm hostlist ("node[01-04,07]", "a1,b[2-3]",
 * "rack[1-2]-node[1-2]") into host names, in Slurm's order (several bracket
 * groups in one name expand left to right, the last varying fastest). A
 * range keeps the zero padding of its lower bound ("[08-10]" -> 08, 09, 10).
 * On success *hosts is one ddp_alloc'd block holding *count pointers and the
 * strings they point to: free it with one ddp_free. On failure (a malformed
 * list, named with the offset of the problem, or more than 1<<20 hosts)
 * *hosts is NULL and *count 0. */
ddp_status ddp_hostlist_expand(const char *list, char ***hosts, size_t *count);

#ifdef __cplusplus
}
#endif
#endif /* DDP_RENDEZVOUS_H */
