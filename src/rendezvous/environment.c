/* Environment contracts: which rank, world size, local rank and master this
 * process has, from explicit options, the init URL, torchrun's variables,
 * Slurm's and Open MPI's / PMI's, in that order, each value validated with an
 * error that names the variable and its value. */
#include <stdbool.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net.h"
#include "rendezvous/rdzv_internal.h"

#define DEFAULT_TIMEOUT_S 1800.0
#define DEFAULT_MPI_PORT 29500
/* Under Slurm without MASTER_PORT, the port is derived from the job id, so two
 * jobs sharing a node rarely collide (PyTorch Lightning does the same). */
#define SLURM_PORT_BASE 15000
#define SLURM_PORT_SPAN 20000

/* One launcher's variables. Several names may carry one value (PMI_RANK and
 * PMIX_RANK); the first that is set wins. */
typedef struct contract {
  ddp_rendezvous_source source;
  const char *rank[3];
  const char *world[3];
  const char *local_rank[3];
  const char *local_world[3];
} contract;

static const contract contracts[] = {
    {DDP_RENDEZVOUS_SOURCE_ENV, {"RANK"}, {"WORLD_SIZE"}, {"LOCAL_RANK"}, {"LOCAL_WORLD_SIZE"}},
    {DDP_RENDEZVOUS_SOURCE_SLURM, {"SLURM_PROCID"}, {"SLURM_NTASKS", "SLURM_NPROCS"},
     {"SLURM_LOCALID"}, {NULL}},
    {DDP_RENDEZVOUS_SOURCE_MPI,
     {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"},
     {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"},
     {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"},
     {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"}},
};
#define NUM_CONTRACTS (sizeof contracts / sizeof contracts[0])

/* The first of names[] that is set and non-empty, or NULL. */
static const char *first_set(const char *const names[3]) {
  for (int i = 0; i < 3 && names[i]; i++)
    if (ddp_env_str(names[i], NULL)) return names[i];
  return NULL;
}

/* Reads variable `name` as an integer in [lo, hi]. */
static ddp_status env_int32(const char *name, int64_t lo, int64_t hi, int32_t *out) {
  int64_t v;
  DDP_TRY(ddp_env_int(name, -1, &v));
  if (v < lo || v > hi)
    return ddp_error(DDP_ERR_INVALID, "environment variable %s=\"%s\" is out of range (expected %lld..%lld)",
                     name, getenv(name), (long long)lo, (long long)hi);
  *out = (int32_t)v;
  return DDP_OK;
}

/* "RANK=5" or "options.rank=5": how to name a value in an error. */
static void describe(char *buf, size_t bytes, ddp_rendezvous_source src, const char *var,
                     const char *field, int32_t value) {
  if (src == DDP_RENDEZVOUS_SOURCE_OPTIONS)
    snprintf(buf, bytes, "options.%s=%d", field, (int)value);
  else if (src == DDP_RENDEZVOUS_SOURCE_URL)
    snprintf(buf, bytes, "the init url's %s=%d", field, (int)value);
  else if (src == DDP_RENDEZVOUS_SOURCE_HOSTS)
    snprintf(buf, bytes, "%s=%d (counted from host identities)", field, (int)value);
  else
    snprintf(buf, bytes, "%s=%d", var ? var : field, (int)value);
}

/* Under Slurm: the tasks on this node, from SLURM_NTASKS_PER_NODE or the
 * compressed per-node list indexed by SLURM_NODEID; -1 when neither says. */
static ddp_status slurm_local_world(int32_t *out, const char **var) {
  *out = -1;
  if (ddp_env_str("SLURM_NTASKS_PER_NODE", NULL)) {
    *var = "SLURM_NTASKS_PER_NODE";
    return env_int32(*var, 1, INT32_MAX, out);
  }
  const char *names[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
  for (int i = 0; i < 2; i++) {
    const char *list = ddp_env_str(names[i], NULL);
    if (!list) continue;
    *var = names[i];
    int32_t node = 0;
    if (ddp_env_str("SLURM_NODEID", NULL)) {
      DDP_TRY(env_int32("SLURM_NODEID", 0, INT32_MAX, &node));
    } else if (strchr(list, ',')) {
      return DDP_OK; /* uneven nodes and no node index: count from host identities */
    }
    ddp_status s = ddp__slurm_tasks_per_node(list, node, out);
    if (s) return ddp_error_wrap(s, "%s (SLURM_NODEID=%d)", names[i], (int)node);
    return DDP_OK;
  }
  return DDP_OK;
}

/* Rank 0's host under Slurm: the first name of the step's (else the job's)
 * node list. */
static ddp_status slurm_master(char *addr, size_t bytes) {
  const char *names[] = {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"};
  for (int i = 0; i < 3; i++) {
    const char *list = ddp_env_str(names[i], NULL);
    if (!list) continue;
    char **hosts;
    size_t n;
    ddp_status s = ddp_hostlist_expand(list, &hosts, &n);
    if (s) return ddp_error_wrap(s, "%s", names[i]);
    if (strlen(hosts[0]) >= bytes) {
      ddp_free(hosts);
      return ddp_error(DDP_ERR_INVALID, "%s: host name '%s' is too long", names[i], list);
    }
    snprintf(addr, bytes, "%s", hosts[0]);
    ddp_free(hosts);
    return DDP_OK;
  }
  return ddp_error(DDP_ERR_INVALID,
                   "env:// under Slurm: MASTER_ADDR is not set and neither is SLURM_NODELIST; "
                   "export MASTER_ADDR=<rank 0's host>");
}

static ddp_status resolve_timeout(const ddp_rendezvous_options *opts, double *out) {
  if (opts && opts->timeout_s > 0) {
    *out = opts->timeout_s;
    return DDP_OK;
  }
  double t;
  DDP_TRY(ddp_env_double("DDP_TIMEOUT", DEFAULT_TIMEOUT_S, &t));
  if (!(t > 0) || t > 1e9)
    return ddp_error(DDP_ERR_INVALID, "environment variable DDP_TIMEOUT=\"%s\" must be a positive number of seconds",
                     getenv("DDP_TIMEOUT"));
  *out = t;
  return DDP_OK;
}

/* MASTER_ADDR / MASTER_PORT for env://, with the launcher-specific fallbacks. */
static ddp_status resolve_master(const contract *c, ddp_rendezvous_info *info) {
  const char *addr = ddp_env_str("MASTER_ADDR", NULL);
  ddp_rendezvous_source src = DDP_RENDEZVOUS_SOURCE_ENV;
  if (addr) {
    if (strlen(addr) >= sizeof info->master_addr)
      return ddp_error(DDP_ERR_INVALID, "environment variable MASTER_ADDR is longer than %zu characters",
                       sizeof info->master_addr - 1);
    snprintf(info->master_addr, sizeof info->master_addr, "%s", addr);
  } else if (c && c->source == DDP_RENDEZVOUS_SOURCE_SLURM) {
    DDP_TRY(slurm_master(info->master_addr, sizeof info->master_addr));
    src = DDP_RENDEZVOUS_SOURCE_SLURM;
  } else if (c && c->source == DDP_RENDEZVOUS_SOURCE_MPI && info->local_world_size > 0 &&
             info->local_world_size == info->world_size) {
    snprintf(info->master_addr, sizeof info->master_addr, "127.0.0.1");
    src = DDP_RENDEZVOUS_SOURCE_MPI;
  } else if (c && c->source == DDP_RENDEZVOUS_SOURCE_MPI) {
    return ddp_error(DDP_ERR_INVALID,
                     "env:// under MPI: MASTER_ADDR is not set and the %d ranks are not all on "
                     "this host (local world size %s); export MASTER_ADDR=<rank 0's host> "
                     "(mpirun -x MASTER_ADDR)",
                     (int)info->world_size,
                     info->local_world_size > 0 ? "smaller" : "unknown");
  } else if (info->world_size == 1) {
    snprintf(info->master_addr, sizeof info->master_addr, "127.0.0.1");
    src = DDP_RENDEZVOUS_SOURCE_DEFAULT;
  } else {
    return ddp_error(DDP_ERR_INVALID,
                     "env://: MASTER_ADDR is not set (rank 0's host name or address, which "
                     "torchrun and ddprun set; or set DDP_STORE_ADDR to use a launcher's store)");
  }
  info->master_source = src;

  if (ddp_env_str("MASTER_PORT", NULL)) {
    DDP_TRY(env_int32("MASTER_PORT", 1, 65535, &info->master_port));
  } else if (c && c->source == DDP_RENDEZVOUS_SOURCE_SLURM && ddp_env_str("SLURM_JOB_ID", NULL)) {
    int32_t job;
    DDP_TRY(env_int32("SLURM_JOB_ID", 0, INT32_MAX, &job));
    info->master_port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN;
  } else if (c && c->source != DDP_RENDEZVOUS_SOURCE_ENV) {
    info->master_port = DEFAULT_MPI_PORT;
  } else if (info->world_size == 1) {
    info->master_port = 0; /* any free port: nobody else needs to find it */
  } else {
    return ddp_error(DDP_ERR_INVALID,
                     "env://: MASTER_PORT is not set (the port rank 0 listens on, e.g. 29500)");
  }
  return DDP_OK;
}

ddp_status ddp__rdzv_resolve(const ddp__rdzv_url *url, const ddp_rendezvous_options *opts,
                             ddp_rendezvous_info *info) {
  static const char *methods[] = {"env", "tcp", "file"};
  snprintf(info->init_method, sizeof info->init_method, "%s", methods[url->scheme]);
  info->rank = info->world_size = info->local_rank = info->local_world_size = -1;
  info->rank_source = info->world_size_source = DDP_RENDEZVOUS_SOURCE_NONE;
  info->local_rank_source = info->local_world_size_source = DDP_RENDEZVOUS_SOURCE_NONE;
  info->master_source = DDP_RENDEZVOUS_SOURCE_NONE;
  info->master_addr[0] = '\0';
  info->master_port = 0;
  info->store_addr[0] = '\0';
  info->store_is_external = 0;
  DDP_TRY(resolve_timeout(opts, &info->timeout_s));

  if (opts && (opts->rank < -1))
    return ddp_error(DDP_ERR_INVALID, "options.rank=%d is negative (use -1 for \"from the environment\")",
                     (int)opts->rank);
  if (opts && (opts->world_size == 0 || opts->world_size < -1))
    return ddp_error(DDP_ERR_INVALID, "options.world_size=%d must be >= 1 (or -1 for \"from the environment\")",
                     (int)opts->world_size);

  const char *rank_var = NULL, *world_var = NULL;
  if (opts && opts->rank >= 0) {
    info->rank = opts->rank;
    info->rank_source = DDP_RENDEZVOUS_SOURCE_OPTIONS;
  } else if (url->rank >= 0) {
    info->rank = url->rank;
    info->rank_source = DDP_RENDEZVOUS_SOURCE_URL;
  }
  if (opts && opts->world_size > 0) {
    info->world_size = opts->world_size;
    info->world_size_source = DDP_RENDEZVOUS_SOURCE_OPTIONS;
  } else if (url->world_size > 0) {
    info->world_size = url->world_size;
    info->world_size_source = DDP_RENDEZVOUS_SOURCE_URL;
  }

  /* The launcher: the first contract whose rank variable is set (or, when the
   * rank is explicit, whose world-size variable is). Values never mix
   * launchers: RANK with SLURM_NTASKS would be a bug waiting to happen. */
  const contract *c = NULL;
  for (size_t i = 0; i < NUM_CONTRACTS && !c; i++)
    if (first_set(contracts[i].rank)) c = &contracts[i];
  if (!c && info->rank >= 0)
    for (size_t i = 0; i < NUM_CONTRACTS && !c; i++)
      if (first_set(contracts[i].world)) c = &contracts[i];

  if (info->rank < 0) {
    if (!c || !(rank_var = first_set(c->rank)))
      return ddp_error(DDP_ERR_INVALID,
                       "%s://: this process's rank is not set: set RANK and WORLD_SIZE (torchrun "
                       "and ddprun do), start it with srun (SLURM_PROCID) or mpirun "
                       "(OMPI_COMM_WORLD_RANK, PMI_RANK), or pass the rank (options.rank, "
                       "or ?rank=&world_size= in the url)",
                       info->init_method);
    DDP_TRY(env_int32(rank_var, 0, INT32_MAX - 1, &info->rank));
    info->rank_source = c->source;
  }
  if (info->world_size < 0) {
    if (!c || !(world_var = first_set(c->world))) {
      char who[64];
      describe(who, sizeof who, info->rank_source, rank_var, "rank", info->rank);
      return ddp_error(DDP_ERR_INVALID, "%s is set but the world size is not: set %s (or options.world_size)",
                       who, c ? c->world[0] : "WORLD_SIZE");
    }
    DDP_TRY(env_int32(world_var, 1, INT32_MAX, &info->world_size));
    info->world_size_source = c->source;
  }
  if (info->rank >= info->world_size) {
    char r[96], w[96];
    describe(r, sizeof r, info->rank_source, rank_var, "rank", info->rank);
    describe(w, sizeof w, info->world_size_source, world_var, "world_size", info->world_size);
    return ddp_error(DDP_ERR_INVALID, "%s is out of range for %s (ranks are 0..%d)", r, w,
                     (int)info->world_size - 1);
  }

  /* Local values only from the launcher that gave the rank; otherwise they
   * are counted from host identities after the join. */
  if (c && info->rank_source == c->source) {
    const char *lr_var = first_set(c->local_rank);
    const char *lw_var = first_set(c->local_world);
    if (lr_var) {
      DDP_TRY(env_int32(lr_var, 0, INT32_MAX - 1, &info->local_rank));
      info->local_rank_source = c->source;
    }
    if (lw_var) {
      DDP_TRY(env_int32(lw_var, 1, INT32_MAX, &info->local_world_size));
      info->local_world_size_source = c->source;
    } else if (c->source == DDP_RENDEZVOUS_SOURCE_SLURM) {
      DDP_TRY(slurm_local_world(&info->local_world_size, &lw_var));
      if (info->local_world_size > 0) info->local_world_size_source = c->source;
    }
    if (info->local_world_size > info->world_size)
      return ddp_error(DDP_ERR_INVALID, "%s=%d exceeds the world size %d", lw_var,
                       (int)info->local_world_size, (int)info->world_size);
    if (info->local_rank >= info->world_size ||
        (info->local_world_size > 0 && info->local_rank >= info->local_world_size))
      return ddp_error(DDP_ERR_INVALID, "%s=%d is out of range for %s=%d", lr_var,
                       (int)info->local_rank,
                       info->local_world_size > 0 ? lw_var : "the world size",
                       info->local_world_size > 0 ? (int)info->local_world_size
                                                  : (int)info->world_size);
  }

  switch (url->scheme) {
    case DDP__RDZV_TCP:
      snprintf(info->master_addr, sizeof info->master_addr, "%s", url->host);
      info->master_port = url->port;
      info->master_source = DDP_RENDEZVOUS_SOURCE_URL;
      ddp__net_format_host_port(url->host, (uint16_t)url->port, info->store_addr,
                                  sizeof info->store_addr);
      break;
    case DDP__RDZV_FILE:
      snprintf(info->store_addr, sizeof info->store_addr, "file://%s", url->path);
      break;
    case DDP__RDZV_ENV: {
      const char *ext = ddp_env_str("DDP_STORE_ADDR", NULL);
      if (ext) {
        char host[DDP_RENDEZVOUS_ADDR_BYTES];
        int32_t port;
        char what[DDP_RENDEZVOUS_ADDR_BYTES + 64];
        snprintf(what, sizeof what, "environment variable DDP_STORE_ADDR=\"%.*s\"",
                 DDP_RENDEZVOUS_ADDR_BYTES, ext);
        DDP_TRY(ddp__net_split_hostport(what, ext, host, sizeof host, &port));
        ddp__net_format_host_port(host, (uint16_t)port, info->store_addr,
                                  sizeof info->store_addr);
        info->store_is_external = 1;
        /* MASTER_* stay informational here: a PyTorch-style rank 0 may use them. */
        if (ddp_env_str("MASTER_ADDR", NULL) && ddp_env_str("MASTER_PORT", NULL) &&
            resolve_master(c, info) != DDP_OK) {
          info->master_addr[0] = '\0';
          info->master_port = 0;
          info->master_source = DDP_RENDEZVOUS_SOURCE_NONE;
          ddp_clear_error();
        }
      } else {
        DDP_TRY(resolve_master(c, info));
        ddp__net_format_host_port(info->master_addr, (uint16_t)info->master_port,
                                  info->store_addr, sizeof info->store_addr);
      }
      break;
    }
  }
  return DDP_OK;
}

/* A variable holding an integer above one. Malformed values are left to the
 * rendezvous, which names them; here they only mean "asked". */
static bool above_one(const char *name) {
  const char *v = getenv(name);
  if (!v || !*v) return false;
  char *end;
  long n = strtol(v, &end, 10);
  return *end != '\0' || n > 1;
}

const char *ddp_rendezvous_requested(void) {
  const char *v = getenv("DDP_STORE_ADDR");
  if (v && *v) return "DDP_STORE_ADDR";
  static const char *const sizes[] = {"WORLD_SIZE", "SLURM_STEP_NUM_TASKS",
                                      "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
    if (above_one(sizes[i])) return sizes[i];
  return NULL;
}
