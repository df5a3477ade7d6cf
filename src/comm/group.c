/* Process groups: creation through a store (each rank publishes who it is,
 * the group derives which ranks share a host or a process and picks a
 * backend), subgroups (new and split), getters, sticky errors, destroy and
 * abort.
 *
 * Store keys, under the group's namespace "pg/<n>/" of the user's store (n
 * counts the groups each rank created on that store, so every rank's n-th
 * group meets in the same namespace), or "<parent>sub/<k>/[c<color>/]" for
 * the parent's k-th subgroup:
 *   id/<rank>      "ddp-pg 1 <pid> <nonce> <host id>"
 *   split/<k>/<r>  "<color> <key>" (in the parent's namespace)
 * and whatever the backend exchanges. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/staged.h"
#include "comm/flight/flight.h"
#include "core/core_internal.h"
#include "net/net.h"

#define ID_MAGIC "ddp-pg 1"
#define MAX_LISTED_RANKS 16

/* ---- Sticky errors ---------------------------------------------------------- */

void ddp__group_fail(ddp_process_group *pg, ddp_status status, const char *msg) {
  bool first = false;
  pthread_mutex_lock(&pg->err_mu);
  if (!atomic_load(&pg->failed)) {
    pg->err_status = status;
    snprintf(pg->err_msg, sizeof pg->err_msg, "%s", msg && *msg ? msg : ddp_strerror(status));
    atomic_store_explicit(&pg->failed, true, memory_order_release);
    first = true;
  }
  pthread_mutex_unlock(&pg->err_mu);
  /* A timeout or a dead peer dumps the flight recorder (err_msg no longer
   * changes once failed is set). */
  if (first && pg->flight) ddp__flight_on_failure(pg->flight, status, pg->err_msg);
}

ddp_status ddp__group_check(ddp_process_group *pg) {
  if (!atomic_load_explicit(&pg->failed, memory_order_acquire)) return DDP_OK;
  return ddp_error(pg->err_status, "%s", pg->err_msg);
}

/* The direct path of a small blocking allreduce (collectives.c): what its
 * checks compare against, from the backend's caps and its limit, so that
 * a call asks a few loads instead of the general path's checks. */
static void direct_allreduce_setup(ddp_process_group *pg) {
  const ddp__backend_ops *hops = pg->host_backend->ops;
  const ddp__backend_caps *caps = &pg->backend->ops->caps;
  pg->direct_allreduce = NULL;
  memset(pg->direct_count, 0, sizeof pg->direct_count);
  memset(pg->direct_rops, 0, sizeof pg->direct_rops);
  /* An engine that starts ops on a device later records them enqueued
   * first (execute.c), which the direct path does not. */
  if (!hops->allreduce_direct || !hops->allreduce_direct_bytes || pg->debug_detail || caps->device_start) return;
  size_t bytes = hops->allreduce_direct_bytes(pg->host_backend);
  for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
    uint32_t rops = 0;
    for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
      bool invalid = op == DDP_REDUCE_AVG && (d == DDP_INT32 || d == DDP_INT64); /* the checks' message */
      if (!invalid && ddp__caps_allow(caps, DDP__OP_ALLREDUCE, (ddp_dtype)d, (ddp_reduce_op)op, DDP_CPU))
        rops |= 1u << op;
    }
    pg->direct_rops[d] = rops;
    pg->direct_count[d] = rops ? bytes / ddp_dtype_size((ddp_dtype)d) : 0;
  }
  /* Where the process sees a GPU, each buffer's device is asked (a CUDA
   * pointer takes the general path, which refuses or stages it). */
  pg->direct_ask_device = ddp_cuda_device_count() > 0;
  pg->direct_allreduce = hops->allreduce_direct;
}

/* ---- Identity ----------------------------------------------------------------- */

static uint64_t process_nonce;
static pthread_once_t nonce_once = PTHREAD_ONCE_INIT;

/* Random per process, so threads of one process recognise each other and a
 * reused pid (or one in another pid namespace) does not. */
static void make_nonce(void) {
  uint64_t n = 0;
  if (getrandom(&n, sizeof n, 0) != (ssize_t)sizeof n)
    n = (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 32);
  process_nonce = n ? n : 1;
}

/* Per-rank identity and the tables derived from it. */
typedef struct identity {
  int32_t *host_of;
  int32_t *process_of;
  char **host_names; /* (size) pointers followed by the strings, one block */
} identity;

static void identity_free(identity *id) {
  ddp_free(id->host_of);
  ddp_free(id->process_of);
  ddp_free(id->host_names);
  memset(id, 0, sizeof *id);
}

/* Numbers equal values 0, 1, ... in order of their lowest rank. */
static void number_classes(int size, int32_t *out, const void *ctx,
                           bool (*same)(const void *ctx, int a, int b)) {
  int32_t next = 0;
  for (int r = 0; r < size; r++) {
    out[r] = -1;
    for (int q = 0; q < r; q++)
      if (same(ctx, q, r)) {
        out[r] = out[q];
        break;
      }
    if (out[r] < 0) out[r] = next++;
  }
}

typedef struct parsed_id {
  long pid;
  unsigned long long nonce;
  const char *host;
} parsed_id;

static bool same_host(const void *ctx, int a, int b) {
  const parsed_id *p = ctx;
  return strcmp(p[a].host, p[b].host) == 0;
}

static bool same_process(const void *ctx, int a, int b) {
  const parsed_id *p = ctx;
  return same_host(ctx, a, b) && p[a].pid == p[b].pid && p[a].nonce == p[b].nonce;
}

/* Copies names (size strings) into one block of pointers + strings. */
static char **names_block(int size, const char *const *names) {
  size_t bytes = (size_t)size * sizeof(char *);
  for (int r = 0; r < size; r++) bytes += strlen(names[r]) + 1;
  char **block = ddp_alloc(bytes);
  if (!block) return NULL;
  char *p = (char *)(block + size);
  for (int r = 0; r < size; r++) {
    size_t n = strlen(names[r]) + 1;
    memcpy(p, names[r], n);
    block[r] = p;
    p += n;
  }
  return block;
}

/* Lists the ranks whose key (fmt % rank) is missing, as "2, 5-7". */
static void missing_ranks(ddp_store *store, const char *fmt, int size, char *out, size_t bytes) {
  int32_t *missing = ddp_calloc((size_t)size, sizeof *missing);
  int32_t n = 0;
  bool known = missing != NULL;
  for (int r = 0; known && r < size; r++) {
    char key[64];
    snprintf(key, sizeof key, fmt, r);
    const char *keys[1] = {key};
    int exists = 0;
    if (ddp_store_check(store, keys, 1, &exists) != DDP_OK) known = false;
    if (!exists) missing[n++] = r;
  }
  if (known)
    ddp__format_ranks(missing, n, MAX_LISTED_RANKS, out, bytes);
  else
    snprintf(out, bytes, "(unknown: the store could not be read)");
  ddp_free(missing);
}

/* Waits until every rank of `size` has set fmt % rank, then reads them all
 * (values[size], caller frees with ddp_store_values_free). `what` and
 * `who` name the wait in errors. */
static ddp_status gather_keys(ddp_store *store, const char *fmt, int size, int64_t timeout_ns,
                              const char *who, ddp_store_value *values) {
  char(*names)[64] = ddp_calloc((size_t)size, sizeof *names);
  const char **keys = ddp_calloc((size_t)size, sizeof *keys);
  if (!names || !keys) {
    ddp_free(names);
    ddp_free(keys);
    return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
  }
  for (int r = 0; r < size; r++) {
    snprintf(names[r], sizeof names[r], fmt, r);
    keys[r] = names[r];
  }
  int64_t timeout_ms = timeout_ns / 1000000;
  if (timeout_ms < 1) timeout_ms = 1;
  ddp_status st = ddp_store_wait(store, keys, (size_t)size, timeout_ms);
  if (st == DDP_ERR_TIMEOUT) {
    char list[512];
    missing_ranks(store, fmt, size, list, sizeof list);
    if (list[0])
      st = ddp_error(DDP_ERR_TIMEOUT, "%s: timed out after %.3g s waiting for ranks %s to arrive (store %s)",
                     who, (double)timeout_ns / 1e9, list, ddp_store_address(store));
    else
      st = ddp_error(DDP_ERR_TIMEOUT, "%s: timed out after %.3g s waiting for the other ranks, who all arrived just after (store %s is slow or its handle is busy)",
                     who, (double)timeout_ns / 1e9, ddp_store_address(store));
  } else if (st != DDP_OK) {
    st = ddp_error_wrap(st, "%s", who);
  }
  if (st == DDP_OK) {
    st = ddp_store_multi_get(store, keys, (size_t)size, timeout_ms, values);
    if (st != DDP_OK) st = ddp_error_wrap(st, "%s", who);
  }
  ddp_free(names);
  ddp_free(keys);
  return st;
}

/* Publishes this rank's identity and reads everyone's into *id. */
static ddp_status exchange_identity(ddp_store *store, int rank, int size, int64_t timeout_ns,
                                    identity *id) {
  char who[96];
  snprintf(who, sizeof who, "process group (rank %d of %d)", rank, size);
  char host[DDP_RENDEZVOUS_HOST_ID_BYTES];
  DDP_TRY(ddp__net_host_id(host, sizeof host));
  pthread_once(&nonce_once, make_nonce);
  char value[DDP_RENDEZVOUS_HOST_ID_BYTES + 96], key[64];
  int n = snprintf(value, sizeof value, ID_MAGIC " %ld %016llx %s", (long)getpid(),
                   (unsigned long long)process_nonce, host);
  snprintf(key, sizeof key, "id/%d", rank);
  ddp_status st = ddp_store_set(store, key, value, (size_t)n);
  if (st != DDP_OK) return ddp_error_wrap(st, "%s: publishing its identity", who);

  ddp_store_value *values = ddp_calloc((size_t)size, sizeof *values);
  parsed_id *ids = ddp_calloc((size_t)size, sizeof *ids);
  const char **names = ddp_calloc((size_t)size, sizeof *names);
  id->host_of = ddp_calloc((size_t)size, sizeof *id->host_of);
  id->process_of = ddp_calloc((size_t)size, sizeof *id->process_of);
  if (!values || !ids || !names || !id->host_of || !id->process_of) {
    st = ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
    goto done;
  }
  st = gather_keys(store, "id/%d", size, timeout_ns, who, values);
  if (st != DDP_OK) goto done;
  for (int r = 0; r < size; r++) {
    const char *v = values[r].data;
    int off = 0;
    if (sscanf(v, ID_MAGIC " %ld %llx %n", &ids[r].pid, &ids[r].nonce, &off) != 2 || off == 0 ||
        v[off] == '\0') {
      st = ddp_error(DDP_ERR_FORMAT, "%s: rank %d's identity \"%.80s\" is malformed (key id/%d of store %s)",
                     who, r, v, r, ddp_store_address(store));
      goto done;
    }
    ids[r].host = v + off;
    names[r] = ids[r].host;
  }
  number_classes(size, id->host_of, ids, same_host);
  number_classes(size, id->process_of, ids, same_process);
  id->host_names = names_block(size, names);
  if (!id->host_names) st = ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
done:
  if (values) ddp_store_values_free(values, (size_t)size);
  ddp_free(values);
  ddp_free(ids);
  ddp_free(names);
  if (st != DDP_OK) identity_free(id);
  return st;
}

/* ---- Creation ----------------------------------------------------------------- */

typedef struct group_settings {
  int64_t timeout_ns;
  bool force_tcp;
  ddp__backend_kind backend;
} group_settings;

const char *ddp__backend_kind_name(ddp__backend_kind kind) {
  switch (kind) {
  case DDP__BACKEND_MPI: return "mpi";
  case DDP__BACKEND_NCCL: return "nccl";
  default: return "ddp";
  }
}

/* options.backend, else $DDP_BACKEND, else ddp. The name is checked here,
 * whether this build has the backend is checked when the group is built
 * (choose_backend), so both messages say where the name came from. */
static ddp_status resolve_backend(const ddp_process_group_options *options, ddp__backend_kind *out) {
  *out = DDP__BACKEND_DDP;
  const char *name = options ? options->backend : NULL;
  const char *from = "options.backend";
  if (!name || !strcmp(name, "auto")) {
    name = ddp_env_str("DDP_BACKEND", "auto");
    from = "DDP_BACKEND";
  }
  if (!strcmp(name, "auto") || !strcmp(name, "ddp") || !strcmp(name, "gloo"))
    *out = DDP__BACKEND_DDP;
  else if (!strcmp(name, "mpi"))
    *out = DDP__BACKEND_MPI;
  else if (!strcmp(name, "nccl"))
    *out = DDP__BACKEND_NCCL;
  else
    return ddp_error(DDP_ERR_INVALID, "process group: %s \"%s\" is not a backend: say \"ddp\" (ddp's own "
                     "shared memory and TCP; \"gloo\" means the same), \"mpi\" or \"nccl\"", from, name);
  return DDP_OK;
}

static ddp_status resolve_settings(const ddp_process_group_options *options, group_settings *out) {
  double timeout_s = options ? options->timeout_s : 0;
  if (timeout_s <= 0) {
    DDP_TRY(ddp_env_double("DDP_TIMEOUT", 1800, &timeout_s));
    if (timeout_s <= 0) timeout_s = 1800;
  }
  out->timeout_ns = timeout_s > 9e9 ? INT64_MAX / 4 : (int64_t)(timeout_s * 1e9);
  const char *transport = options ? options->transport : NULL;
  if (transport && strcmp(transport, "auto") != 0 && strcmp(transport, "tcp") != 0)
    return ddp_error(DDP_ERR_INVALID, "process group: options.transport \"%s\" is neither \"auto\" nor \"tcp\"",
                     transport);
  out->force_tcp = transport && strcmp(transport, "tcp") == 0;
  DDP_TRY(resolve_backend(options, &out->backend));
  if (out->force_tcp && out->backend != DDP__BACKEND_DDP)
    return ddp_error(DDP_ERR_INVALID, "process group: options.transport \"tcp\" is a transport of ddp's own "
                     "backend, but the backend asked for is \"%s\": drop one of the two",
                     ddp__backend_kind_name(out->backend));
  return DDP_OK;
}

ddp__backend_create_fn ddp__backend_override;

/* A backend asked for by name that this build lacks: what it is and how
 * to get it, or what to use instead. */
ddp_status ddp__backend_absent(ddp__backend_kind kind) {
  if (kind == DDP__BACKEND_MPI)
    return ddp_error(DDP_ERR_UNSUPPORTED, "backend \"mpi\" (options.backend or DDP_BACKEND): this libddp was "
                     "built without MPI; install an MPI (Debian: libopenmpi-dev, scripts/install-deps.sh mpi) "
                     "and rebuild, or use backend \"ddp\"");
  return ddp_error(DDP_ERR_UNSUPPORTED, "backend \"nccl\" (options.backend or DDP_BACKEND): this libddp was "
                   "built without NCCL (it needs a CUDA build with NCCL found beside the toolkit); rebuild so, "
                   "or use backend \"ddp\" (CPU buffers)");
}

/* ddp's own backend for the group's pairs (see choose_backend). */
static ddp__backend_create_fn own_backend_by_pairs(const group_settings *set,
                                                   const ddp__backend_config *cfg) {
  if (cfg->size == 1) return ddp__backend_self_create;
  if (ddp__backend_override) return ddp__backend_override;
  if (set->force_tcp) return ddp__backend_tcp_create;
  bool one_host = true, colocated = false;
  for (int r = 0; r < cfg->size; r++) {
    one_host = one_host && cfg->host_of[r] == cfg->host_of[0];
    for (int q = 0; q < r && !colocated; q++) colocated = cfg->host_of[q] == cfg->host_of[r];
  }
  if (one_host) return ddp__backend_local_create;
  return colocated ? ddp__backend_hier_create : ddp__backend_tcp_create;
}

/* The backend for a group. ddp's own, per pair as DESIGN.md says:
 * co-located ranks share memory, others use TCP. One rank: self; one host:
 * local; one rank per host (or options.transport "tcp"): tcp; both kinds of
 * pairs: hier (a local backend per host composed with tcp between hosts).
 * A backend asked for by name (mpi, nccl) adds its constructor here, under
 * its DDP_HAVE_ macro; a build without it answers backend_absent. */
static ddp_status choose_backend(const group_settings *set, const ddp__backend_config *cfg,
                                 ddp__backend_create_fn *out) {
  *out = NULL;
#ifdef DDP_HAVE_NCCL
  if (set->backend == DDP__BACKEND_NCCL) {
    *out = ddp__backend_nccl_create;
    return DDP_OK;
  }
#endif
#ifdef DDP_HAVE_MPI
  if (set->backend == DDP__BACKEND_MPI) {
    *out = ddp__backend_mpi_choose(cfg); /* flat, or shm inside hosts + MPI between them */
    return DDP_OK;
  }
#endif
  if (set->backend != DDP__BACKEND_DDP) return ddp__backend_absent(set->backend);
  *out = own_backend_by_pairs(set, cfg);
  return DDP_OK;
}

/* Builds a group on its namespace `ns` (a reference the group takes over,
 * released on failure too), called `name` (the namespace's prefix from the
 * user's store). `known` gives the identity tables when the caller already
 * has them (subgroups: the parent's, renumbered); NULL exchanges them
 * through ns. */
static ddp_status group_build(ddp_store *ns, const char *name, int rank, int size,
                              const group_settings *set, identity *known, ddp_process_group **out) {
  *out = NULL;
  ddp_process_group *pg = ddp_calloc(1, sizeof *pg);
  if (!pg) {
    ddp_store_destroy(ns);
    if (known) identity_free(known);
    return ddp_error(DDP_ERR_NOMEM, "process group: out of memory");
  }
  pg->rank = rank;
  pg->size = size;
  pg->store = ns;
  snprintf(pg->name, sizeof pg->name, "%s", name);
  pg->timeout_ns = set->timeout_ns;
  pg->force_tcp = set->force_tcp;
  pg->backend_kind = set->backend;
  pthread_mutex_init(&pg->err_mu, NULL);
  atomic_init(&pg->aborted, false);
  atomic_init(&pg->failed, false);
  const char *debug = ddp_env_str("DDP_DEBUG", "");
  pg->debug_detail = strcasecmp(debug, "detail") == 0;
  ddp_status st = ddp__queue_init(pg);
  bool queue_ready = st == DDP_OK;
  if (st == DDP_OK && (st = ddp__p2p_lane_init(pg)) != DDP_OK) {
    ddp__queue_destroy(pg);
    queue_ready = false;
  }
  identity id = {0};
  if (st == DDP_OK) {
    if (known) {
      id = *known;
      memset(known, 0, sizeof *known);
    } else {
      st = exchange_identity(ns, rank, size, set->timeout_ns, &id);
    }
  }
  if (st == DDP_OK) {
    pg->host_of = id.host_of;
    pg->process_of = id.process_of;
    pg->host_names = id.host_names;
    ddp__backend_config cfg = {
        .store = ns,
        .rank = rank,
        .size = size,
        .host_of = pg->host_of,
        .process_of = pg->process_of,
        .host_names = (const char *const *)pg->host_names,
        .timeout_ns = set->timeout_ns,
        .force_tcp = set->force_tcp,
    };
    ddp__backend_create_fn create = NULL;
    st = choose_backend(set, &cfg, &create);
    if (st == DDP_OK) st = create(&cfg, &pg->backend);
    if (st == DDP_OK) pg->host_backend = pg->backend;
    /* ddp's own backend takes CUDA buffers too, staged through pinned host
     * memory, where this process has a GPU (staged.h). */
    if (st == DDP_OK && set->backend == DDP__BACKEND_DDP && ddp__staged_wanted()) {
      st = ddp__backend_staged_wrap(&pg->backend, rank, size);
      if (st != DDP_OK) pg->backend->ops->destroy(pg->backend);
      else pg->host_backend = ddp__staged_inner(pg->backend);
    }
    if (st != DDP_OK) {
      pg->backend = pg->host_backend = NULL;
      st = ddp_error_wrap(st, "process group (rank %d of %d)", rank, size);
    } else {
      st = ddp__flight_open(ddp__flight_capacity_from_env(), pg->name, rank, size, pg->backend->ops->name,
                            &pg->flight);
      if (st != DDP_OK) {
        pg->backend->ops->destroy(pg->backend);
        pg->backend = pg->host_backend = NULL;
      } else {
        direct_allreduce_setup(pg);
      }
    }
  } else if (known) {
    identity_free(known);
  }
  if (st != DDP_OK) {
    if (queue_ready) {
      ddp__p2p_lane_destroy(pg);
      ddp__queue_destroy(pg);
    }
    ddp_free(pg->host_of);
    ddp_free(pg->process_of);
    ddp_free(pg->host_names);
    pthread_mutex_destroy(&pg->err_mu);
    ddp_store_destroy(ns);
    ddp_free(pg);
    return st;
  }
  *out = pg;
  return DDP_OK;
}

ddp_process_group_options ddp_process_group_defaults(void) {
  ddp_process_group_options o = {0};
  return o;
}

ddp_status ddp_process_group_create(ddp_store *store, int rank, int world_size,
                                    const ddp_process_group_options *options,
                                    ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_create: out is NULL");
  *out = NULL;
  if (!store) return ddp_error(DDP_ERR_INVALID, "process_group_create: store is NULL");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    return ddp_error(DDP_ERR_INVALID, "process_group_create: rank %d is not in [0, %d)", rank,
                     world_size);
  group_settings set;
  DDP_TRY(resolve_settings(options, &set));
  /* The n-th group this rank creates on this store meets the other ranks'
   * n-th group: a per-rank counter, so threads sharing a store agree too. */
  char key[64], prefix[64];
  snprintf(key, sizeof key, "pg/count/%d", rank);
  int64_t n = 0;
  ddp_status st = ddp_store_add(store, key, 1, &n);
  if (st != DDP_OK) return ddp_error_wrap(st, "process group (rank %d of %d)", rank, world_size);
  snprintf(prefix, sizeof prefix, "pg/%" PRId64 "/", n);
  /* A handle of the group's own (for TCP its own connection): threads that
   * share one store handle would otherwise queue their blocking waits behind
   * each other's on its single connection. */
  ddp_store *view = NULL, *ns = NULL;
  DDP_TRY(ddp_store_prefix(store, prefix, &view));
  st = ddp_store_clone(view, &ns);
  ddp_store_destroy(view);
  if (st != DDP_OK) return ddp_error_wrap(st, "process group (rank %d of %d)", rank, world_size);
  return group_build(ns, prefix, rank, world_size, &set, NULL, out);
}

ddp_status ddp_init_process_group(const char *init_url, const ddp_rendezvous_options *rdzv,
                                  const ddp_process_group_options *options,
                                  ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "init_process_group: out is NULL");
  *out = NULL;
  /* "mpi://", or backend mpi in a job no ddp launcher started (no RANK):
   * ranks come from MPI and the store from MPI's rank 0 (docs/comm.md,
   * "MPI backend"). */
  group_settings set;
  DDP_TRY(resolve_settings(options, &set));
  if ((init_url && !strncmp(init_url, "mpi://", 6)) ||
      (set.backend == DDP__BACKEND_MPI && !getenv("RANK")))
    return ddp_process_group_from_mpi_comm(NULL, options, out);
  ddp_rendezvous_info *info = ddp_calloc(1, sizeof *info);
  if (!info) return ddp_error(DDP_ERR_NOMEM, "init_process_group: out of memory");
  ddp_status st = ddp_rendezvous(init_url, rdzv, info);
  if (st != DDP_OK) {
    ddp_free(info);
    return st;
  }
  st = ddp_process_group_create(info->store, info->rank, info->world_size, options, out);
  if (st != DDP_OK) {
    ddp_rendezvous_info_destroy(info);
    ddp_free(info);
    return st;
  }
  (*out)->rdzv = info;
  return DDP_OK;
}

/* ---- Subgroups ------------------------------------------------------------------- */

static group_settings settings_of(const ddp_process_group *pg) {
  group_settings s = {.timeout_ns = pg->timeout_ns, .force_tcp = pg->force_tcp, .backend = pg->backend_kind};
  return s;
}

/* The identity tables of the parent ranks `members` (n), renumbered. */
static ddp_status subset_identity(const ddp_process_group *parent, int n, const int *members,
                                  identity *out) {
  memset(out, 0, sizeof *out);
  const char **names = ddp_calloc((size_t)n, sizeof *names);
  int32_t *hosts = ddp_calloc((size_t)n, sizeof *hosts);
  int32_t *procs = ddp_calloc((size_t)n, sizeof *procs);
  out->host_of = ddp_calloc((size_t)n, sizeof *out->host_of);
  out->process_of = ddp_calloc((size_t)n, sizeof *out->process_of);
  ddp_status st = DDP_OK;
  if (!names || !hosts || !procs || !out->host_of || !out->process_of) {
    st = ddp_error(DDP_ERR_NOMEM, "process group: out of memory");
  } else {
    for (int i = 0; i < n; i++) {
      names[i] = parent->host_names[members[i]];
      hosts[i] = parent->host_of[members[i]];
      procs[i] = parent->process_of[members[i]];
    }
    /* Renumber densely in order of the lowest member. */
    for (int i = 0; i < n; i++) {
      out->host_of[i] = out->process_of[i] = -1;
      int32_t hmax = -1, pmax = -1;
      for (int j = 0; j < i; j++) {
        if (hosts[j] == hosts[i] && out->host_of[i] < 0) out->host_of[i] = out->host_of[j];
        if (procs[j] == procs[i] && out->process_of[i] < 0) out->process_of[i] = out->process_of[j];
        if (out->host_of[j] > hmax) hmax = out->host_of[j];
        if (out->process_of[j] > pmax) pmax = out->process_of[j];
      }
      if (out->host_of[i] < 0) out->host_of[i] = hmax + 1;
      if (out->process_of[i] < 0) out->process_of[i] = pmax + 1;
    }
    out->host_names = names_block(n, names);
    if (!out->host_names) st = ddp_error(DDP_ERR_NOMEM, "process group: out of memory");
  }
  ddp_free(names);
  ddp_free(hosts);
  ddp_free(procs);
  if (st != DDP_OK) identity_free(out);
  return st;
}

/* The parent's next subgroup number (every parent rank counts the same). */
static uint64_t next_subgroup(ddp_process_group *parent) {
  pthread_mutex_lock(&parent->mu);
  uint64_t k = ++parent->subgroups;
  pthread_mutex_unlock(&parent->mu);
  return k;
}

/* Builds the subgroup of parent ranks `members` (n) in the namespace
 * "sub/<k><suffix>" of the parent's, with this rank at index `index`. */
static ddp_status subgroup_build_on(ddp_process_group *parent, uint64_t k, const char *suffix, int n,
                                    const int *members, int index, ddp__backend_kind backend,
                                    ddp_process_group **out);
static ddp_status subgroup_build(ddp_process_group *parent, uint64_t k, const char *suffix, int n,
                                 const int *members, int index, ddp_process_group **out) {
  return subgroup_build_on(parent, k, suffix, n, members, index, parent->backend_kind, out);
}

/* As subgroup_build, on `backend` rather than the parent's. */
static ddp_status subgroup_build_on(ddp_process_group *parent, uint64_t k, const char *suffix, int n,
                                    const int *members, int index, ddp__backend_kind backend,
                                    ddp_process_group **out) {
  char prefix[96];
  snprintf(prefix, sizeof prefix, "sub/%" PRIu64 "/%s", k, suffix);
  identity id;
  DDP_TRY(subset_identity(parent, n, members, &id));
  ddp_store *ns = NULL;
  ddp_status st = ddp_store_prefix(parent->store, prefix, &ns);
  if (st != DDP_OK) {
    identity_free(&id);
    return st;
  }
  group_settings set = settings_of(parent);
  set.backend = backend;
  char name[sizeof parent->name + sizeof prefix];
  snprintf(name, sizeof name, "%s%s", parent->name, prefix);
  return group_build(ns, name, index, n, &set, &id, out);
}

ddp_status ddp_process_group_new(ddp_process_group *parent, int n, const int *ranks,
                                 ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_new: out is NULL");
  *out = NULL;
  if (!parent) return ddp_error(DDP_ERR_INVALID, "process_group_new: parent is NULL");
  DDP_TRY(ddp__group_check(parent));
  if (!parent->backend->ops->caps.subgroups)
    return ddp_error(DDP_ERR_UNSUPPORTED, "process_group_new: the %s backend of the parent group (rank %d of %d) "
                     "cannot make subgroups", parent->backend->ops->name, parent->rank, parent->size);
  if (n < 1 || n > parent->size || !ranks)
    return ddp_error(DDP_ERR_INVALID, "process_group_new: %d ranks%s for a parent of %d", n,
                     ranks ? "" : " (ranks is NULL)", parent->size);
  int index = -1;
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= parent->size)
      return ddp_error(DDP_ERR_INVALID, "process_group_new: ranks[%d] = %d is not a rank of the parent (size %d)",
                       i, ranks[i], parent->size);
    for (int j = 0; j < i; j++)
      if (ranks[j] == ranks[i])
        return ddp_error(DDP_ERR_INVALID, "process_group_new: rank %d is listed twice (ranks[%d] and ranks[%d])",
                         ranks[i], j, i);
    if (ranks[i] == parent->rank) index = i;
  }
  uint64_t k = next_subgroup(parent);
  if (index < 0) return DDP_OK;
  return subgroup_build(parent, k, "", n, ranks, index, out);
}

/* Host buffers beside a group whose backend refuses them (nccl), as a
 * PyTorch program makes a gloo group beside its NCCL one: the same ranks on
 * ddp's own backend, made once (a subgroup "sub/<k>/host", so collective
 * the first time) and kept with the group. */
ddp_status ddp_process_group_host_group(ddp_process_group *pg, ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_host_group: out is NULL");
  *out = NULL;
  if (!pg) return ddp_error(DDP_ERR_INVALID, "process_group_host_group: pg is NULL");
  if (pg->backend->ops->caps.devices & DDP__CAPS_CPU) {
    *out = pg;
    return DDP_OK;
  }
  if (!pg->host_group) {
    DDP_TRY(ddp__group_check(pg));
    int *members = ddp_calloc((size_t)pg->size, sizeof *members);
    if (!members) return ddp_error(DDP_ERR_NOMEM, "process_group_host_group: out of memory");
    for (int r = 0; r < pg->size; r++) members[r] = r;
    uint64_t k = next_subgroup(pg);
    ddp_status st = subgroup_build_on(pg, k, "host", pg->size, members, pg->rank,
                                      DDP__BACKEND_DDP, &pg->host_group);
    ddp_free(members);
    if (st != DDP_OK)
      return ddp_error_wrap(st, "process_group_host_group (rank %d of %d, backend %s): a group on "
                            "ddp's own backend for host buffers", pg->rank, pg->size,
                            ddp__backend_kind_name(pg->backend_kind));
  }
  *out = pg->host_group;
  return DDP_OK;
}

bool ddp_process_group_takes_host(const ddp_process_group *pg) {
  return pg && pg->backend && (pg->backend->ops->caps.devices & DDP__CAPS_CPU);
}

typedef struct split_entry {
  int color, key, rank;
} split_entry;

static int split_cmp(const void *a, const void *b) {
  const split_entry *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->rank < y->rank ? -1 : x->rank > y->rank;
}

ddp_status ddp_process_group_split(ddp_process_group *parent, int color, int key,
                                   ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_split: out is NULL");
  *out = NULL;
  if (!parent) return ddp_error(DDP_ERR_INVALID, "process_group_split: parent is NULL");
  DDP_TRY(ddp__group_check(parent));
  if (!parent->backend->ops->caps.subgroups)
    return ddp_error(DDP_ERR_UNSUPPORTED, "process_group_split: the %s backend of the parent group (rank %d of %d) "
                     "cannot make subgroups", parent->backend->ops->name, parent->rank, parent->size);
  int size = parent->size;
  uint64_t k = next_subgroup(parent);
  char fmt[64], keyname[80], value[64], who[96];
  snprintf(fmt, sizeof fmt, "split/%" PRIu64 "/%%d", k);
  snprintf(keyname, sizeof keyname, fmt, parent->rank);
  snprintf(who, sizeof who, "process_group_split (rank %d of %d)", parent->rank, size);
  int vn = snprintf(value, sizeof value, "%d %d", color < 0 ? -1 : color, key);
  ddp_status st = ddp_store_set(parent->store, keyname, value, (size_t)vn);
  if (st != DDP_OK) return ddp_error_wrap(st, "%s", who);

  ddp_store_value *values = ddp_calloc((size_t)size, sizeof *values);
  split_entry *entries = ddp_calloc((size_t)size, sizeof *entries);
  int *members = ddp_calloc((size_t)size, sizeof *members);
  if (!values || !entries || !members) {
    st = ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
    goto done;
  }
  st = gather_keys(parent->store, fmt, size, parent->timeout_ns, who, values);
  if (st != DDP_OK) goto done;
  int n = 0;
  for (int r = 0; r < size; r++) {
    int c, kk;
    if (sscanf(values[r].data, "%d %d", &c, &kk) != 2) {
      st = ddp_error(DDP_ERR_FORMAT, "%s: rank %d's color and key \"%.40s\" are malformed", who, r,
                     (const char *)values[r].data);
      goto done;
    }
    if (color >= 0 && c == color) entries[n++] = (split_entry){c, kk, r};
  }
  if (color < 0) goto done;
  qsort(entries, (size_t)n, sizeof *entries, split_cmp);
  int index = -1;
  for (int i = 0; i < n; i++) {
    members[i] = entries[i].rank;
    if (entries[i].rank == parent->rank) index = i;
  }
  DDP_ASSERT(index >= 0);
  char suffix[32];
  snprintf(suffix, sizeof suffix, "c%d/", color);
  st = subgroup_build(parent, k, suffix, n, members, index, out);
done:
  if (values) ddp_store_values_free(values, (size_t)size);
  ddp_free(values);
  ddp_free(entries);
  ddp_free(members);
  return st;
}

/* ---- Getters, destroy, abort ------------------------------------------------------ */

int ddp_process_group_rank(const ddp_process_group *pg) { return pg ? pg->rank : -1; }
int ddp_process_group_size(const ddp_process_group *pg) { return pg ? pg->size : 0; }
ddp_store *ddp_process_group_store(ddp_process_group *pg) { return pg ? pg->store : NULL; }

uint64_t ddp_process_group_subgroup_count(ddp_process_group *pg) {
  if (!pg) return 0;
  pthread_mutex_lock(&pg->mu); /* next_subgroup counts under it */
  uint64_t k = pg->subgroups;
  pthread_mutex_unlock(&pg->mu);
  return k;
}

const char *ddp_process_group_backend(const ddp_process_group *pg) {
  return pg ? ddp__backend_kind_name(pg->backend_kind) : NULL;
}

#ifndef DDP_HAVE_NCCL
/* A build with NCCL answers from src/comm/nccl/loader.c. */
ddp_status ddp_nccl_version(char *buf, size_t bytes) {
  if (buf && bytes) buf[0] = 0;
  return ddp__backend_absent(DDP__BACKEND_NCCL);
}
#endif

const char *ddp_process_group_transport(const ddp_process_group *pg, int peer) {
  if (!pg || peer < 0 || peer >= pg->size) return "none";
  if (!pg->backend->ops->transport) return pg->backend->ops->name;
  return pg->backend->ops->transport(pg->backend, peer);
}

void ddp_process_group_abort(ddp_process_group *pg) {
  if (!pg) return;
  char msg[128];
  snprintf(msg, sizeof msg, "process group (rank %d of %d) was aborted", pg->rank, pg->size);
  ddp__group_fail(pg, DDP_ERR_ABORTED, msg);
  atomic_store(&pg->aborted, true);
  if (pg->backend && pg->backend->ops->abort) pg->backend->ops->abort(pg->backend);
  ddp__queue_fail_all(pg);
  ddp__p2p_lane_wake(pg);
}

ddp_status ddp_process_group_counters(const ddp_process_group *pg, ddp_comm_counters *out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_counters: out is NULL");
  memset(out, 0, sizeof *out);
  if (!pg) return ddp_error(DDP_ERR_INVALID, "process_group_counters: pg is NULL");
  if (pg->backend && pg->backend->ops->counters) pg->backend->ops->counters(pg->backend, out);
  return DDP_OK;
}

void ddp_process_group_destroy(ddp_process_group *pg) {
  if (!pg) return;
  ddp_process_group_destroy(pg->host_group);
  ddp__p2p_lane_destroy(pg);
  ddp__queue_destroy(pg);
  if (pg->backend && pg->backend->ops->counters && ddp_log_get_level() <= DDP_LOG_INFO) {
    ddp_comm_counters c;
    ddp_process_group_counters(pg, &c);
    DDP_INFO("process group (rank %d of %d, backend %s): tcp %llu bytes sent, %llu received; "
              "shm %llu bytes; threads %llu bytes",
              pg->rank, pg->size, pg->backend->ops->name, (unsigned long long)c.tcp_bytes_sent,
              (unsigned long long)c.tcp_bytes_received, (unsigned long long)c.shm_bytes,
              (unsigned long long)c.threads_bytes);
  }
  if (pg->backend) pg->backend->ops->destroy(pg->backend);
  ddp__flight_close(pg->flight);
  ddp_store_destroy(pg->store);
  ddp_free(pg->host_of);
  ddp_free(pg->process_of);
  ddp_free(pg->host_names);
  pthread_mutex_destroy(&pg->err_mu);
  ddp_rendezvous_info *rdzv = pg->rdzv;
  void *owned = pg->owned;
  void (*owned_release)(void *) = pg->owned_release;
  ddp_free(pg);
  if (owned_release) owned_release(owned);
  if (rdzv) {
    ddp_rendezvous_info_destroy(rdzv);
    ddp_free(rdzv);
  }
}

