/* ddp comm: process groups and collectives on CPU (torch.distributed with the
 * gloo backend, and what ddp does better): allreduce, broadcast, reduce,
 * allgather, gather, scatter, reduce_scatter, all_to_all, barriers,
 * point-to-point, and variable-size byte collectives, each in a blocking and
 * an async form. docs/comm.md has the algorithms, transports and failure
 * semantics.
 *
 * The model of use (PyTorch's init_process_group + all_reduce):
 *
 *   ddp_process_group *pg;
 *   DDP_TRY(ddp_init_process_group("env://", NULL, NULL, &pg));   // rendezvous + connect
 *   DDP_TRY(ddp_allreduce(pg, grads, n, DDP_FLOAT32, DDP_REDUCE_AVG));
 *   ddp_process_group_destroy(pg);
 *
 * Buffers may be host or GPU memory: each call asks where its pointers
 * are (ddp_pointer_device). A group with backend "nccl" runs on CUDA
 * buffers through NCCL (loaded at run time); ddp's own backend takes CUDA
 * buffers too where the process has a GPU, staged through pinned host
 * memory (docs/comm.md, "Buffers on devices").
 *
 * Transports are chosen per pair of ranks from what the rendezvous learned:
 * ranks that are threads of one process share memory directly ("threads"),
 * ranks of one host (same hostname and network namespace, or the same
 * DDP_HOST_ID) use shared memory ("shm"), others TCP ("tcp").
 *
 * Every group has one progress thread that runs queued operations in
 * submission order; a blocking call issued while the queue is empty runs on
 * the caller's thread (same order, no hand-off cost).
 *
 * Failure: every operation has a timeout (DDP_TIMEOUT seconds, default 1800,
 * or ddp_process_group_options.timeout_s). A peer's death (its connection
 * closed, its shared-memory heartbeat lost) fails every pending and later
 * operation on the group within 5 s with DDP_ERR_PEER and a message naming
 * the rank, its host and the operation ("allreduce #118: rank 3 (node2) died
 * (connection closed)"). Errors are sticky: once a group has failed, every
 * call returns the same status and message. */
#ifndef DDP_COMM_H
#define DDP_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/rendezvous.h"
#include "ddp/store.h"
#include "ddp/tensor.h" /* ddp_dtype */

#ifdef __cplusplus
extern "C" {
#endif

/* Reductions. AVG is SUM divided by the group size, for floating types only.
 * float16 and bfloat16 accumulate in float32 within one reduction step and
 * are rounded to their type when stored (docs/comm.md says where). */
typedef enum ddp_reduce_op {
  DDP_REDUCE_SUM = 0,
  DDP_REDUCE_AVG = 1,
  DDP_REDUCE_MIN = 2,
  DDP_REDUCE_MAX = 3,
  DDP_REDUCE_PRODUCT = 4,
  DDP_REDUCE_OP_COUNT
} ddp_reduce_op;

const char *ddp_reduce_op_name(ddp_reduce_op op); /* "sum", "avg", ... */

typedef struct ddp_process_group ddp_process_group;

/* Options for creating a group. Start from ddp_process_group_defaults();
 * every default is zero, so a zero-initialised struct ({0}) means the same,
 * and so does NULL wherever options are taken. */
typedef struct ddp_process_group_options {
  /* Default timeout of every operation, seconds; <= 0: $DDP_TIMEOUT, 1800
   * when unset (PyTorch's default). */
  double timeout_s;
  /* "auto" (NULL) picks per pair as described above; "tcp" forces TCP for
   * every pair (tests, debugging). A transport is what ddp's own backend
   * uses between two ranks; it means nothing to the mpi and nccl backends. */
  const char *transport;
  /* Which engine runs the group's operations (docs/comm.md, "Backends"):
   * "ddp" (ddp's own shared memory and TCP, the transports above), "mpi"
   * (the cluster's MPI; the job started by mpirun or srun), "nccl" (CUDA
   * buffers). NULL or "auto": $DDP_BACKEND when set, else "ddp". "gloo" is
   * taken as "ddp" (what PyTorch programs name for CPUs). A backend this
   * build lacks fails the creation, saying how to get it. */
  const char *backend;
  uint64_t reserved[7];
} ddp_process_group_options;
DDP_STRUCT_SIZE(ddp_process_group_options, 80);

/* The defaults: timeout_s 0 ($DDP_TIMEOUT, else 1800 s), transport NULL
 * (auto), backend NULL (auto). */
ddp_process_group_options ddp_process_group_defaults(void);

/* Rendezvous through `init_url` (env://, tcp://host:port, file:///path; see
 * rendezvous.h; `rdzv` carries init_process_group's rank= and world_size=,
 * NULL for none), then connects every pair. On success *out is the world
 * group; destroy it with ddp_process_group_destroy. "mpi://", or backend
 * "mpi" without RANK in the environment (mpirun, srun --mpi=pmix), takes
 * rank and world from MPI (ddp_process_group_from_mpi_comm). */
ddp_status ddp_init_process_group(const char *init_url, const ddp_rendezvous_options *rdzv,
                                  const ddp_process_group_options *options,
                                  ddp_process_group **out);

/* Builds a group of `world_size` ranks meeting in `store` (borrowed for the
 * call; the group takes a reference with ddp_store_retain). Every rank calls
 * it with the same store contents and its own rank. Ranks that are threads of
 * one process may pass one shared store (e.g. ddp_store_mem_create): this is
 * the single-process multi-replica mode. */
ddp_status ddp_process_group_create(ddp_store *store, int rank, int world_size,
                                    const ddp_process_group_options *options,
                                    ddp_process_group **out);

/* A group on the mpi backend over an MPI communicator: the program's own
 * (what mpi4py and Horovod users have; mpi_comm points to an MPI_Comm, so
 * this header needs no mpi.h), or MPI_COMM_WORLD when mpi_comm is NULL.
 * Collective over the communicator; rank and size are MPI's. MPI is started
 * (MPI_THREAD_MULTIPLE) if the program has not; a program that started it
 * must have asked for MPI_THREAD_MULTIPLE. The group's store comes from
 * MPI's rank 0 (a store server it runs while the group lives), so every
 * store-based feature works. options.backend must be NULL, "auto" or "mpi".
 * Who calls MPI_Finalize: whoever called MPI_Init (ddp at exit when it did;
 * the program otherwise, after destroying its groups). A build without MPI
 * answers DDP_ERR_UNSUPPORTED. ddp_init_process_group("mpi://", ...) is this
 * with NULL. */
ddp_status ddp_process_group_from_mpi_comm(const void *mpi_comm, const ddp_process_group_options *options,
                                           ddp_process_group **out);

/* A subgroup of `parent` with the listed parent ranks (torch.distributed.
 * new_group). Collective over the parent: every parent rank calls it with
 * the same list, and ranks outside the list get *out == NULL. */
ddp_status ddp_process_group_new(ddp_process_group *parent, int n, const int *ranks,
                                 ddp_process_group **out);
/* MPI_Comm_split: ranks with equal `color` form a group, ordered by `key`
 * (ties by parent rank); color < 0 gives *out == NULL. Collective over the
 * parent. A world of 8 splits into four groups of 2 that run side by side. */
ddp_status ddp_process_group_split(ddp_process_group *parent, int color, int key,
                                   ddp_process_group **out);

int ddp_process_group_rank(const ddp_process_group *pg);
int ddp_process_group_size(const ddp_process_group *pg);
/* The transport used towards `peer`: "self", "threads", "shm" or "tcp". */
const char *ddp_process_group_transport(const ddp_process_group *pg, int peer);
/* The group's backend by the names of options.backend: "ddp", "mpi" or
 * "nccl" (torch.distributed.get_backend). */
const char *ddp_process_group_backend(const ddp_process_group *pg);
/* Whether the group's backend takes host (CPU) buffers: true for ddp's own
 * and MPI, false for nccl, which takes CUDA buffers only (docs/comm.md,
 * "Buffers on devices"). False when pg is NULL. */
bool ddp_process_group_takes_host(const ddp_process_group *pg);
/* The group for host buffers beside pg, for a layer that mixes GPU data
 * with small host-side collectives (counters, flags, shape checks): pg
 * itself when it takes host buffers; else a group of the same ranks on
 * ddp's own backend (shared memory or TCP), made at the first call, as a
 * PyTorch program makes a gloo group beside its NCCL one. Making it is
 * collective over pg (every rank's first call at the same point of its
 * program, from the thread that runs pg's collectives); later calls only
 * return it. Borrowed: pg owns it and destroys it with itself. */
ddp_status ddp_process_group_host_group(ddp_process_group *pg, ddp_process_group **out);
/* The NCCL this process would use for backend "nccl" (loaded at the first
 * call; docs/comm.md, "The NCCL backend"): "2.28.9 (libnccl.so.2)" into
 * buf. DDP_ERR_UNSUPPORTED, saying why, when this build has no NCCL
 * backend or no library loads (naming every path tried). */
ddp_status ddp_nccl_version(char *buf, size_t bytes);

/* The group's own namespace in the store it was built on (a prefix store:
 * "pg/1/" for a world, "pg/1/sub/2/c0/" for a subgroup), for a layer above
 * that needs keys every rank of this group, and no other group, sees (the
 * pipeline's failure notice). Borrowed: valid until the group is destroyed;
 * never destroy it. NULL when pg is NULL. */
ddp_store *ddp_process_group_store(ddp_process_group *pg);
/* How many subgroups (ddp_process_group_new, _split) have been created from
 * pg so far. Creating one is collective, so every rank reads the same number
 * at the same point of its program: a name for something made there (with a
 * subgroup after it) that no other point of the program shares. 0 when pg is
 * NULL. Safe from any thread. */
uint64_t ddp_process_group_subgroup_count(ddp_process_group *pg);
/* Grows the group's pool of work handles to at least n, so that n
 * operations can be in flight without allocating: a user that knows its
 * depth (the DDP wrapper: one per bucket, and the loss's) reserves it up
 * front rather than reaching it mid-training the first time the timing
 * allows. Not collective. DDP_ERR_NOMEM when the pool cannot grow (the
 * handles added so far stay); DDP_ERR_INVALID when pg is NULL. */
ddp_status ddp_process_group_reserve_works(ddp_process_group *pg, int n);

/* What the group's transports carried on this rank since it was created:
 * evidence of which pairs went over shared memory and which over TCP. */
typedef struct ddp_comm_counters {
  /* Bytes this rank wrote to / read from TCP sockets (frames: 16-byte
   * headers and payloads). */
  uint64_t tcp_bytes_sent;
  uint64_t tcp_bytes_received;
  /* Payload bytes of this rank's operations that ran over shared memory
   * between processes ("shm") or between threads of this process
   * ("threads"): per op, what this rank contributed plus what it received
   * (an allreduce of n bytes counts 2n, a send or recv of n bytes n). */
  uint64_t shm_bytes;
  uint64_t threads_bytes;
  uint64_t reserved[12];
} ddp_comm_counters;
DDP_STRUCT_SIZE(ddp_comm_counters, 128);

/* Fills *out (zeroed first). Safe from any thread, also while operations
 * run (the figures then lag by at most the running op). With
 * DDP_LOG_LEVEL=info (or debug), destroying a group logs them. */
ddp_status ddp_process_group_counters(const ddp_process_group *pg, ddp_comm_counters *out);

/* Waits for queued operations, then closes the group's connections and
 * frees it. Not collective: peers see the connection close. NULL ok. */
void ddp_process_group_destroy(ddp_process_group *pg);
/* Fails every pending and later operation with DDP_ERR_ABORTED, wakes every
 * waiter and releases the transports; the group must still be destroyed.
 * Safe to call from any thread (e.g. a watchdog). */
void ddp_process_group_abort(ddp_process_group *pg);

/* For a launcher, after a worker died: removes the shared-memory segments
 * that process `pid` created and no one unlinked
 * (/dev/shm/ddp-local-<pid>-<nonce>). Only for a pid that has exited and
 * that the caller has reaped (ddprun does, for its workers): the last rank
 * to map a segment unlinks it, so one still named after a dead creator was
 * left by a group whose setup a kill cut short. Returns how many it removed
 * (0 when none, or when /dev/shm cannot be read). */
int ddp_comm_shm_remove_orphans(int pid);

/* ---- Work handles ---------------------------------------------------------
 * An async operation returns a work handle. The buffers passed to it must
 * stay valid and untouched until the work completes. Free every handle with
 * ddp_work_free (after completion; freeing an unfinished handle waits). */
typedef struct ddp_work ddp_work;

/* Waits for completion, at most timeout_s seconds (< 0: the group's
 * timeout). Returns the operation's status (DDP_ERR_TIMEOUT if it did not
 * finish in time; the operation itself then fails the group). */
ddp_status ddp_work_wait(ddp_work *work, double timeout_s);
/* True when the work has finished; its status in *status when not NULL. */
bool ddp_work_test(ddp_work *work, ddp_status *status);
/* For work on CUDA buffers (the nccl backend): makes the compute stream of
 * the buffers' GPU (where the tensor layer queues its kernels) wait for the
 * work, and returns without blocking the host (PyTorch's work.wait() for
 * NCCL): kernels queued after it see the result. On a backend without
 * streams, or while the work is still queued behind others, it waits on the
 * host as ddp_work_wait(work, timeout_s) does. Returns the work's failure
 * when it has already failed; a later failure surfaces at the next wait or
 * the group's next operation. */
ddp_status ddp_work_wait_stream(ddp_work *work, double timeout_s);
void ddp_work_free(ddp_work *work);

/* ---- Collectives ----------------------------------------------------------
 * `count` counts elements of `dtype`. Each has a blocking form and an
 * `_async` form that returns a work handle in *work. Arguments are checked on
 * the calling rank (DDP_ERR_INVALID naming the call); a mismatch between
 * ranks (different counts) is caught in DDP_DEBUG=detail mode, which checks
 * every operation's fingerprint across the group. */

/* In place: buf (count) becomes the reduction of every rank's buf. */
ddp_status ddp_allreduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                         ddp_reduce_op op);
ddp_status ddp_allreduce_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               ddp_reduce_op op, ddp_work **work);
/* buf (count) on every rank becomes root's. */
ddp_status ddp_broadcast(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                         int root);
ddp_status ddp_broadcast_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                               int root, ddp_work **work);
/* root's buf (count) becomes the reduction; other ranks' buf is unchanged. */
ddp_status ddp_reduce(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                      ddp_reduce_op op, int root);
ddp_status ddp_reduce_async(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype,
                            ddp_reduce_op op, int root, ddp_work **work);
/* recv (size * count) gets every rank's send (count), in rank order. */
ddp_status ddp_allgather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                         ddp_dtype dtype);
ddp_status ddp_allgather_async(ddp_process_group *pg, const void *send, void *recv,
                               size_t count, ddp_dtype dtype, ddp_work **work);
/* root's recv (size * count) gets every rank's send (count); recv may be
 * NULL on other ranks. */
ddp_status ddp_gather(ddp_process_group *pg, const void *send, void *recv, size_t count,
                      ddp_dtype dtype, int root);
ddp_status ddp_gather_async(ddp_process_group *pg, const void *send, void *recv, size_t count,
                            ddp_dtype dtype, int root, ddp_work **work);
/* Each rank's recv (count) gets block `rank` of root's send (size * count);
 * send may be NULL on other ranks. */
ddp_status ddp_scatter(ddp_process_group *pg, const void *send, void *recv, size_t count,
                       ddp_dtype dtype, int root);
ddp_status ddp_scatter_async(ddp_process_group *pg, const void *send, void *recv, size_t count,
                             ddp_dtype dtype, int root, ddp_work **work);
/* recv (count) on rank r gets block r of the reduction of every rank's send
 * (size * count). */
ddp_status ddp_reduce_scatter(ddp_process_group *pg, const void *send, void *recv, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op);
ddp_status ddp_reduce_scatter_async(ddp_process_group *pg, const void *send, void *recv,
                                    size_t count, ddp_dtype dtype, ddp_reduce_op op,
                                    ddp_work **work);
/* Block j of rank i's send (size * count) lands in block i of rank j's recv. */
ddp_status ddp_all_to_all(ddp_process_group *pg, const void *send, void *recv, size_t count,
                          ddp_dtype dtype);
ddp_status ddp_all_to_all_async(ddp_process_group *pg, const void *send, void *recv,
                                size_t count, ddp_dtype dtype, ddp_work **work);
ddp_status ddp_barrier(ddp_process_group *pg);
ddp_status ddp_barrier_async(ddp_process_group *pg, ddp_work **work);
/* A barrier through the store that names the ranks that did not arrive
 * within timeout_s ("monitored barrier: ranks 2, 5 did not arrive within
 * 30 s"); with wait_all false, rank 0 reports the first missing rank only. */
ddp_status ddp_monitored_barrier(ddp_process_group *pg, double timeout_s, bool wait_all);

/* ---- Point to point ------------------------------------------------------
 * Messages between a pair are matched in order per tag. Every point-to-point
 * operation (these four and the batches below) runs on the group's
 * point-to-point lane, outside the queue of collectives: the sends and
 * receives in flight progress together in the background, whatever their
 * size, so isend + irecv to the same peer on both sides do not deadlock
 * (docs/comm.md, "Point to point"). Blocking send/recv wait for their own
 * completion only. A peer may be this rank only in a batch. */
ddp_status ddp_send(ddp_process_group *pg, const void *buf, size_t count, ddp_dtype dtype,
                    int dst, int tag);
ddp_status ddp_recv(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype, int src,
                    int tag);
ddp_status ddp_isend(ddp_process_group *pg, const void *buf, size_t count, ddp_dtype dtype,
                     int dst, int tag, ddp_work **work);
ddp_status ddp_irecv(ddp_process_group *pg, void *buf, size_t count, ddp_dtype dtype, int src,
                     int tag, ddp_work **work);

typedef enum { DDP_P2P_SEND, DDP_P2P_RECV } ddp_p2p_kind;
typedef struct ddp_p2p_op {
  ddp_p2p_kind kind;
  void *buf;        /* read for sends, written for receives */
  size_t count;     /* elements of dtype */
  ddp_dtype dtype;
  int peer;         /* the other rank, in this group's numbering */
  int tag;
} ddp_p2p_op;
/* PyTorch's batch_isend_irecv: starts every operation in ops[0..n) at once and returns one
 * work handle that completes when all have (ops is copied; the buffers must stay valid until
 * then). Sends and receives to the same peer, in both directions, in any order within the
 * batch, never deadlock at any size, provided the peers post matching batches (or matching
 * plain send/recv); messages between a pair are matched in order per tag, as for send/recv.
 * The batch progresses in the background (the caller computes meanwhile) and does not wait
 * behind the group's collectives queued after it. A failed peer (dead process, timeout) fails
 * the work with a message naming the operation, the peer rank and the tag.
 *
 * Details: n == 0 gives a handle that is already complete. A peer equal to this rank is
 * allowed in a batch (a send to self is matched with a receive from self of the same tag and
 * size, in order). The handle is freed with ddp_work_free; handles and their copies of ops are
 * recycled, so posting the same shapes every micro-batch allocates nothing after the first.
 * Every backend a group can have supports it (self, local threads and shm, tcp, hier; mpi;
 * nccl, as one group of NCCL calls, with every buffer on the group's GPU and tags not
 * matched, as PyTorch's NCCL backend). A
 * failure (also a timeout: the group's, from the call) fails the group, as collectives do. */
ddp_status ddp_batch_isend_irecv(ddp_process_group *pg, const ddp_p2p_op *ops, size_t n, ddp_work **work);

/* ---- Variable-size byte collectives (what object collectives build on) ---
 * Results are allocated with ddp_alloc and freed by the caller. */

/* Every rank contributes `bytes` bytes (may differ per rank); *out receives
 * one ddp_alloc'd block with all contributions in rank order and lens[r]
 * (size entries, caller-allocated) their lengths. */
ddp_status ddp_allgather_bytes(ddp_process_group *pg, const void *data, size_t bytes,
                               void **out, size_t *lens);
/* On root, (*data, *bytes) is the input; on the others both are outputs
 * (*data ddp_alloc'd). */
ddp_status ddp_broadcast_bytes(ddp_process_group *pg, void **data, size_t *bytes, int root);

#ifdef __cplusplus
}
#endif
#endif /* DDP_COMM_H */
