/* Starting MPI, and groups whose ranks come from MPI: the launch check,
 * MPI_Init_thread, who finalizes, and the bootstrap store (MPI's rank 0
 * serves a ddp store for the group's life, its address and a random token
 * broadcast by MPI), so the store-based features (subgroups, monitored
 * barrier, the flight recorder's gathering, DDP_DEBUG=detail) work under
 * mpirun as under ddprun. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/mpi/mpi_internal.h"
#include "core/core_internal.h"
#include "net/net.h"

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *level_name(int level) {
  switch (level) {
  case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
  case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
  case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
  default: return "MPI_THREAD_MULTIPLE";
  }
}

/* Whether an MPI launcher started this process: Open MPI's mpirun
 * (OMPI_COMM_WORLD_SIZE), a PMIx launcher such as srun --mpi=pmix
 * (PMIX_RANK), MPICH's hydra or srun --mpi=pmi2 (PMI_RANK / PMI_SIZE).
 * MPI_Init without one would make a world of one (or fail slowly), so
 * ddp refuses at once instead. DDP_MPI_SINGLETON=1 allows it (a world of 1). */
static bool launched_by_mpi(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                                     "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
    if (getenv(vars[i])) return true;
  return ddp_env_str("DDP_MPI_SINGLETON", "0")[0] == '1';
}

/* ddp started MPI, so ddp finalizes it, at exit (after the program's own
 * atexit handlers registered later, and its groups' destroy). */
static void finalize_at_exit(void) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (atomic_load(&ddp__mpi_failed)) {
    fprintf(stderr, "[ddp] an MPI group of this process failed: ending the job with MPI_Abort (MPI_Finalize "
            "would wait for the operations MPI still holds)\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
}

ddp_status ddp__mpi_ensure_init(const char *who) {
  pthread_mutex_lock(&init_mu);
  int initialized = 0, finalized = 0, provided = MPI_THREAD_SINGLE;
  ddp_status st = DDP_OK;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    st = ddp_error(DDP_ERR_INVALID, "%s: MPI was finalized already; make groups before MPI_Finalize", who);
  } else if (!initialized) {
    if (!launched_by_mpi()) {
      st = ddp_error(DDP_ERR_INVALID, "%s: backend \"mpi\" needs a job started by an MPI launcher, and no "
                     "launcher started this process (none of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK is set): "
                     "start it with `mpirun -np N ...` or `srun --mpi=pmix -n N ...`, or use backend \"ddp\" "
                     "(ddprun)", who);
    } else if (MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
      st = ddp_error(DDP_ERR_INVALID, "%s: MPI_Init_thread failed", who);
    } else {
      atexit(finalize_at_exit);
      if (provided < MPI_THREAD_MULTIPLE)
        st = ddp_error(DDP_ERR_UNSUPPORTED, "%s: this MPI gives %s, not MPI_THREAD_MULTIPLE (ddp calls MPI from "
                       "the caller and its progress thread at once): use an MPI built with thread support "
                       "(Open MPI: --enable-mpi-thread-multiple, the default since 3.0)",
                       who, level_name(provided));
    }
  } else {
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      st = ddp_error(DDP_ERR_UNSUPPORTED, "%s: the program started MPI with %s; the mpi backend needs "
                     "MPI_THREAD_MULTIPLE (ddp calls MPI from the caller and its progress thread at once): "
                     "call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, &provided)", who, level_name(provided));
  }
  pthread_mutex_unlock(&init_mu);
  return st;
}

/* ---- The bootstrap store --------------------------------------------------------- */

typedef struct boot {
  ddp_store_server *server; /* rank 0's; NULL elsewhere */
  MPI_Comm comm;            /* for the end's barrier */
} boot;

/* The end of a group made here: every rank's group is gone (a barrier,
 * given up after 10 s: a rank that died or left must not hang the rest)
 * before rank 0 stops serving the store. */
static void boot_release(void *arg) {
  boot *bt = arg;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && bt->comm != MPI_COMM_NULL && !atomic_load(&ddp__mpi_failed)) {
    MPI_Request req;
    bool done = false;
    if (MPI_Ibarrier(bt->comm, &req) == MPI_SUCCESS) {
      int64_t deadline = ddp_time_ns() + 10000000000LL;
      while (!done && ddp_time_ns() < deadline) {
        int flag = 0;
        MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        done = flag != 0;
        if (!done) {
          struct timespec ts = {0, 50000};
          nanosleep(&ts, NULL);
        }
      }
    }
    if (done) MPI_Comm_free(&bt->comm);
  }
  ddp_store_server_stop(bt->server);
  ddp_free(bt);
}

#define BOOT_MSG 512

/* Rank 0 starts a store server and broadcasts "host port token" (or "!"
 * and its error); every rank connects. All ranks agree whether it worked,
 * so a failure anywhere fails everyone at once. */
static ddp_status boot_store(MPI_Comm comm, int rank, const char *who, boot *bt, ddp_store **store) {
  char msg[BOOT_MSG] = {0}, self_host[256] = {0}, self_id[256] = {0};
  gethostname(self_host, sizeof self_host - 1);
  /* Which ranks share rank 0's loopback: the host identity (name and
   * network namespace), not the name alone, which two containers or
   * network namespaces of one machine share (docs/cluster.md). Never a
   * return before the broadcast below: the other ranks wait in it. */
  if (ddp__net_host_id(self_id, sizeof self_id) != DDP_OK) snprintf(self_id, sizeof self_id, "%s", self_host);
  ddp_status st = DDP_OK;
  if (rank == 0) {
    unsigned char raw[16] = {0};
    char token[40];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
      for (size_t i = 0; i < sizeof raw; i++) raw[i] = (unsigned char)(ddp_time_ns() >> (i % 8 * 8));
    for (size_t i = 0; i < sizeof raw; i++) snprintf(token + 2 * i, 3, "%02x", raw[i]);
    ddp_store_server_options so = {.token = token};
    st = ddp_store_server_start(NULL, 0, &so, &bt->server);
    const char *host = ddp_env_str("DDP_MPI_STORE_HOST", self_host);
    if (st == DDP_OK)
      snprintf(msg, sizeof msg, "%s %u %s %s", host, (unsigned)ddp_store_server_port(bt->server), token, self_id);
    else
      snprintf(msg, sizeof msg, "! %s", ddp_last_error());
  }
  /* Every rank's msg is zeros but rank 0's, so a bitwise OR gives rank 0's
   * message to all. An allreduce rather than MPI_Bcast: in a world of 2,
   * a broadcast is one message one way, which leaves Open MPI's
   * shared-memory fast boxes (its per-peer rings of 32-byte slots) an odd
   * number of slots apart in the two directions, and from then on every
   * small MPI call of the job, ddp's or the program's own, ran ~45 ns slower
   * on this VM when its cores were far apart (bench_mpi_allreduce -p;
   * docs/comm.md, MPI, "Speed"); the allreduce moves both rings alike. */
  if (MPI_Allreduce(MPI_IN_PLACE, msg, BOOT_MSG, MPI_BYTE, MPI_BOR, comm) != MPI_SUCCESS)
    return ddp_error(DDP_ERR_PEER, "%s: broadcasting the store's address from MPI rank 0 failed", who);
  msg[BOOT_MSG - 1] = '\0';
  if (msg[0] == '!') {
    if (rank == 0) return st;
    return ddp_error(DDP_ERR_PEER, "%s: MPI rank 0 could not start the group's store: %s", who, msg + 2);
  }
  char host[256], token[40], id[256];
  unsigned port = 0;
  if (sscanf(msg, "%255s %u %39s %255s", host, &port, token, id) != 4)
    return ddp_error(DDP_ERR_FORMAT, "%s: the store address from MPI rank 0 \"%.80s\" is malformed", who, msg);
  /* A rank on rank 0's host connects over loopback (a host name need not
   * resolve to an address this host listens on); a rank elsewhere dials
   * the name (or DDP_MPI_STORE_HOST), even where its own name is the same. */
  const char *connect_to = strcmp(id, self_id) == 0 ? "127.0.0.1" : host;
  ddp_store_options co = {.connect_timeout_ms = 60000, .token = token};
  st = ddp_store_tcp_connect(connect_to, (uint16_t)port, &co, store);
  if (st != DDP_OK) st = ddp_error_wrap(st, "%s: connecting to the group's store on MPI rank 0 (%s:%u)", who, host, port);
  int ok = st == DDP_OK, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, comm);
  if (st == DDP_OK && !all) {
    ddp_store_destroy(*store);
    *store = NULL;
    st = ddp_error(DDP_ERR_PEER, "%s: another rank could not connect to the group's store on MPI rank 0 (%s:%u)",
                   who, host, port);
  }
  return st;
}

ddp_status ddp_process_group_from_mpi_comm(const void *mpi_comm, const ddp_process_group_options *options,
                                           ddp_process_group **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "process_group_from_mpi_comm: out is NULL");
  *out = NULL;
  const char *asked = options ? options->backend : NULL;
  if (asked && strcmp(asked, "auto") != 0 && strcmp(asked, "mpi") != 0)
    return ddp_error(DDP_ERR_INVALID, "process_group_from_mpi_comm: options.backend \"%s\": a group over an MPI "
                     "communicator runs on backend \"mpi\"", asked);
  DDP_TRY(ddp__mpi_ensure_init("process_group_from_mpi_comm"));
  MPI_Comm user = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
  int rank = 0, size = 0;
  if (user == MPI_COMM_NULL || MPI_Comm_rank(user, &rank) != MPI_SUCCESS || MPI_Comm_size(user, &size) != MPI_SUCCESS)
    return ddp_error(DDP_ERR_INVALID, "process_group_from_mpi_comm: the MPI communicator is not valid");
  char who[96];
  snprintf(who, sizeof who, "process_group_from_mpi_comm (rank %d of %d)", rank, size);
  boot *bt = ddp_calloc(1, sizeof *bt);
  if (!bt) return ddp_error(DDP_ERR_NOMEM, "%s: out of memory", who);
  bt->comm = MPI_COMM_NULL;
  if (MPI_Comm_dup(user, &bt->comm) != MPI_SUCCESS) {
    ddp_free(bt);
    return ddp_error(DDP_ERR_PEER, "%s: duplicating the communicator failed", who);
  }
  ddp_store *store = NULL;
  ddp_status st = boot_store(bt->comm, rank, who, bt, &store);
  if (st == DDP_OK) {
    ddp_process_group_options o = options ? *options : ddp_process_group_defaults();
    o.backend = "mpi";
    ddp__mpi_base_comm = user;
    st = ddp_process_group_create(store, rank, size, &o, out);
    ddp__mpi_base_comm = MPI_COMM_NULL;
    ddp_store_destroy(store); /* the group holds a handle of its own */
  }
  if (st != DDP_OK) {
    boot_release(bt);
    return st;
  }
  (*out)->owned = bt;
  (*out)->owned_release = boot_release;
  return DDP_OK;
}
