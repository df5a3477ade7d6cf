/* The local backend's internals: the shared region every rank of one host
 * maps (per-rank control blocks, small-message slots, point-to-point
 * channels), the memory-provider interface (how a rank reaches a peer's user
 * buffers: plain pointers for threads, cross-memory attach for processes)
 * and the waits (spin, then futex). Algorithms are in local/local.c, point to point
 * in local/p2p_channels.c, waits in local/sync.c, providers in local/threads.c and
 * local/shm.c. docs/comm.md, "Local backend", describes the whole. */
#ifndef DDP__COMM_LOCAL_H
#define DDP__COMM_LOCAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "comm/backend.h"

#define DDP__LOCAL_MAGIC 0x4c434f4c50444444ull /* "DDDPLOCL" */
#define DDP__LOCAL_VERSION 5u /* 5: a point-to-point doorbell per rank */
#define DDP__LOCAL_MAX_RANKS 256

/* Bytes per rank and parity of the small-message slots (collectives whose
 * data fits go through them: one copy in, every rank reads all). */
#define DDP__LOCAL_SLOT_BYTES (64u * 1024u)
/* Between processes only data up to this size takes the slots. */
#define DDP__LOCAL_STAGED_SLOT_LIMIT (8u * 1024u)
/* Point-to-point: descriptors per ordered pair, and the payload carried
 * inline (eagerly: the send returns at once); bigger messages are read
 * straight from the sender's buffer (the send returns once received). */
#define DDP__LOCAL_P2P_SLOTS 8u
#define DDP__LOCAL_P2P_INLINE 4096u
/* Large collectives between processes go through staging in the region, a
 * chunk at a time (double-buffered): per rank a staging area of 2 chunks,
 * and a shared result area of 2 chunks. Every rank's chunk together stays
 * in cache (about DDP__LOCAL_STAGED_BYTES), and chunks are as big as that
 * allows, since each costs two synchronisations (which a loaded machine
 * turns into sleeps): 2 MiB for 2 ranks, 512 KiB for 8 (measured best
 * among 256 KiB .. 4 MiB chunks with 2 ranks). */
#define DDP__LOCAL_STAGED_BYTES (4u << 20)
#define DDP__LOCAL_CHUNK_MIN (256u << 10)
#define DDP__LOCAL_CHUNK_MAX (2u << 20)
/* Two processes' allreduce of one chunk moves around this much of each
 * rank's staging area, op by op (more than a core's L2, here 1 MiB). Among
 * 1, 2 and 4 MiB, 2 MiB was best: 2 processes, 400 warm-up ops, 64 KiB 5.1
 * -> 14.6 GB/s, 256 KiB 5.4 -> 17.6, 1 MiB 16.7 -> 18.3 (shared L3). */
#define DDP__LOCAL_PAIR_WINDOW (2u << 20)
/* Writes into the shared segment (local/stores.c): a copy of at least twice
 * DDP__LOCAL_STORE_PROBE bytes times its first DDP__LOCAL_STORE_PROBE with
 * ordinary stores and streams the rest when they ran below
 * DDP__LOCAL_STORE_SLOW_GBPS (a peer's cache held the lines across a slow
 * fabric: about 2 GB/s, against 10 GB/s or more from a shared cache). */
#define DDP__LOCAL_STORE_PROBE 8192u
#define DDP__LOCAL_STORE_SLOW_GBPS 4.0
/* After a slow probe, copies stream without probing for this long. */
#define DDP__LOCAL_STORE_STICKY_NS 1000000

/* Large collectives move data in segments of this many bytes (the scratch
 * a cross-memory read lands in stays in L2). */
#define DDP__LOCAL_SEGMENT_BYTES (256u * 1024u)

/* A monotonically increasing 64-bit value that others wait on. `wake` changes
 * on every post and is the futex word; `sleepers` counts waiters in the
 * futex so that a post makes a system call only when someone sleeps. */
typedef struct ddp__local_word {
  _Atomic uint64_t value;
  _Atomic uint32_t wake;
  _Atomic uint32_t sleepers;
} ddp__local_word;

/* Spins before yielding: long while ranks seem to have a CPU each, short
 * when they share CPUs (local/local.c, local/sync.c). */
#define DDP__LOCAL_SPIN_LONG 2000
#define DDP__LOCAL_SPIN_SHORT 20
/* How long a wait keeps spinning, past the spins above, while the op's
 * caller is blocked in it (ddp__op_ctx.caller_blocked) and ranks have a CPU
 * each: a peer a few hundred microseconds behind (one rank's step hit by an
 * interrupt) is then met awake instead of through a futex wake-up, which
 * on a VM costs tens of microseconds more. 2 ms covers nearly all such
 * lags of a training step; longer waits (rank 0 evaluating) sleep. */
#define DDP__LOCAL_SPIN_BLOCKED_NS 2000000

/* Words of a rank's CPU mask in its control block (512 CPUs). */
#define DDP__LOCAL_CPU_WORDS 8

/* Rank states in the control block. */
enum {
  DDP__LOCAL_ACTIVE = 0,
  DDP__LOCAL_FAILED = 1,  /* an op failed on that rank (timeout, peer) */
  DDP__LOCAL_ABORTED = 2, /* ddp_process_group_abort */
  DDP__LOCAL_LEFT = 3,    /* destroyed its backend */
};

/* One per rank, on its own cache lines. `flag` orders a rank's progress:
 * (op number << 32) | step, see local/local.c. */
typedef struct ddp__local_ctl {
  ddp__local_word flag;
  uint64_t addr[2];            /* this op's buffers (send/recv or buf), in its own address space */
  _Atomic uint32_t state;      /* DDP__LOCAL_* */
  _Atomic int32_t pid;         /* the rank's process (atomic: peers poll it while it is set) */
  _Atomic uint64_t failed_seq; /* the op (ctx->seq) that failed, for messages */
  _Atomic uint32_t cma_ok;     /* 1: process_vm_readv from every peer works, 2: not */
  _Atomic int32_t blame;       /* when failed because of a peer: that rank, else -1 */
  /* The CPUs this rank may run on (sched_getaffinity of its thread, bit c
   * of word c / 64), written before it counts itself attached; all zero
   * when unknown (a CPU numbered DDP__LOCAL_CPU_WORDS * 64 or above). */
  uint64_t cpus[DDP__LOCAL_CPU_WORDS];
  uint8_t pad[128 - sizeof(ddp__local_word) - 16 - 8 - 8 - 4 - 4 - 8 * DDP__LOCAL_CPU_WORDS];
  /* The point-to-point lane's doorbell (its own cache line: peers ring it
   * while collectives poll `flag`): rung (wake += 1) whenever a peer posts
   * a message to this rank or consumes one of this rank's; the lane sleeps
   * on it. */
  ddp__local_word p2p_bell;
  uint8_t pad2[64 - sizeof(ddp__local_word)];
} ddp__local_ctl;
_Static_assert(sizeof(ddp__local_ctl) == 192, "control block is three cache lines");

/* One message descriptor of a point-to-point channel. */
typedef struct ddp__local_p2p_slot {
  ddp__local_word posted;   /* message id + 1 once the descriptor is valid */
  ddp__local_word consumed; /* message id + 1 once the receiver is done */
  int32_t tag;
  uint32_t is_inline;
  uint64_t bytes;
  uint64_t addr; /* sender's buffer when not inline */
  uint8_t pad[8];
  uint8_t data[DDP__LOCAL_P2P_INLINE];
} ddp__local_p2p_slot;
_Static_assert(sizeof(ddp__local_p2p_slot) == 64 + DDP__LOCAL_P2P_INLINE, "descriptor header is one cache line");

typedef struct ddp__local_p2p_chan {
  ddp__local_p2p_slot slot[DDP__LOCAL_P2P_SLOTS];
} ddp__local_p2p_chan;

/* The region's header; ctl[size], slots[size][2][SLOT_BYTES],
 * chan[size * size] (chan[src * size + dst]), stage[size][2][CHUNK_BYTES]
 * and result[2][CHUNK_BYTES] follow at the offsets below. */
typedef struct ddp__local_region {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t nonce;
  uint64_t total_bytes;
  _Atomic uint32_t attached; /* ranks that mapped it */
  _Atomic uint32_t refs;     /* threads provider: ranks still holding it */
  uint64_t ctl_off, slot_off, chan_off, stage_off, result_off;
  uint64_t chunk_bytes; /* staging chunk, ddp__local_chunk_bytes(size) */
} ddp__local_region;

size_t ddp__local_region_bytes(int size);
size_t ddp__local_chunk_bytes(int size);
/* Fills the header of a zeroed region of ddp__local_region_bytes(size). */
void ddp__local_region_init(ddp__local_region *reg, int size, uint64_t nonce);
static inline ddp__local_ctl *ddp__local_ctl_of(ddp__local_region *reg, int rank) {
  return (ddp__local_ctl *)((char *)reg + reg->ctl_off) + rank;
}
static inline uint8_t *ddp__local_slot_of(ddp__local_region *reg, int rank, uint64_t parity) {
  return (uint8_t *)reg + reg->slot_off +
         ((size_t)rank * 2 + (size_t)(parity & 1)) * DDP__LOCAL_SLOT_BYTES;
}
static inline uint8_t *ddp__local_stage_of(ddp__local_region *reg, int rank, uint64_t parity) {
  return (uint8_t *)reg + reg->stage_off +
         ((size_t)rank * 2 + (size_t)(parity & 1)) * reg->chunk_bytes;
}
static inline uint8_t *ddp__local_result_of(ddp__local_region *reg, uint64_t parity) {
  return (uint8_t *)reg + reg->result_off + (size_t)(parity & 1) * reg->chunk_bytes;
}
static inline ddp__local_p2p_chan *ddp__local_chan_of(ddp__local_region *reg, int src,
                                                      int dst) {
  return (ddp__local_p2p_chan *)((char *)reg + reg->chan_off) + (size_t)src * reg->size + dst;
}

/* ---- Memory providers -----------------------------------------------------
 * How a rank reaches its peers: the region (found through the group's store)
 * and peers' user buffers. Addresses are the peer's own (uint64_t). */
typedef struct ddp__local_mem ddp__local_mem;
typedef struct ddp__local_mem_ops {
  const char *name; /* "threads" or "shm" */
  /* dst (local) := bytes at addr in peer's memory. */
  ddp_status (*read)(ddp__local_mem *m, int peer, uint64_t addr, void *dst, size_t bytes);
  /* bytes at addr in peer's memory := src (local). */
  ddp_status (*write)(ddp__local_mem *m, int peer, uint64_t addr, const void *src, size_t bytes);
  /* *out := a local pointer to bytes at addr in peer's memory: the address
   * itself when directly visible, else a copy in `scratch` (>= bytes). */
  ddp_status (*view)(ddp__local_mem *m, int peer, uint64_t addr, size_t bytes, void *scratch,
                     const void **out);
  /* An active rank (state DDP__LOCAL_ACTIVE: ranks that left or failed are
   * not asked about) whose process is gone (-1: none), with the reason in
   * why ("process 1234 is gone"). Cheap enough to call every few ms.
   * Errors of read/write/view for a dead peer are DDP_ERR_PEER with the
   * same reason as their message. */
  int (*find_dead)(ddp__local_mem *m, char *why, size_t why_bytes);
  /* The transport name towards peer ("threads" or "shm"). */
  const char *(*transport)(const ddp__local_mem *m, int peer);
  /* Unmaps / releases the region (not collective). */
  void (*destroy)(ddp__local_mem *m);
} ddp__local_mem_ops;

struct ddp__local_mem {
  const ddp__local_mem_ops *ops;
  ddp__local_region *region;
  bool shared_futex; /* the region is shared between processes */
  /* Peers' buffers are not directly addressable (processes): large
   * collectives go through the region's staging instead of reading them. */
  bool staged;
  /* read/write/view work (cross-memory attach, or one process); when false
   * large point-to-point messages go through the channel in pieces. */
  bool can_read_peers;
};

/* Records the calling thread's CPU affinity in ctl->cpus (providers call it
 * before counting the rank attached). local/local.c. */
void ddp__local_publish_cpus(ddp__local_ctl *ctl);
/* How many distinct CPUs the ranks of the region may run on together (the
 * union of their masks, capped by the online CPUs); the online count when
 * any mask is unknown. Call once every rank has attached. local/local.c. */
int ddp__local_shared_cpus(ddp__local_region *reg, int size);

/* Both attach every rank of cfg (collective: returns once all have attached,
 * or fails after cfg->timeout_ns). */
ddp_status ddp__local_threads_create(const ddp__backend_config *cfg, ddp__local_mem **out);
ddp_status ddp__local_shm_create(const ddp__backend_config *cfg, ddp__local_mem **out);
/* ddp_comm_shm_remove_orphans (comm.h), for launchers, is in local_shm.c. */
/* Removes every segment of this version in /dev/shm whose creator is gone
 * (its rank 0 holds a write lock on it until every rank has mapped it; the
 * kernel drops the lock with the process), whoever started the processes.
 * Rank 0 calls it before creating a segment. Returns how many were removed. */
int ddp__local_shm_remove_abandoned(void);

/* How large writes into the shared segment are stored (DDP_LOCAL_STORES):
 * auto (timed per copy, above), cached (ordinary stores) or streaming
 * (non-temporal stores, past the caches). */
typedef enum ddp__local_stores {
  DDP__LOCAL_STORES_AUTO,
  DDP__LOCAL_STORES_CACHED,
  DDP__LOCAL_STORES_STREAMING,
} ddp__local_stores;

/* ---- The backend object -------------------------------------------------- */
typedef struct ddp__local_backend {
  ddp__backend base;
  ddp__local_mem *mem;
  ddp__local_region *reg;
  int rank, size;
  uint64_t op_number;      /* collectives run so far (same on every rank) */
  uint64_t *seen;          /* [size] last observed value of each rank's flag */
  uint64_t *p2p_next_send; /* [size] next message id towards each rank */
  uint64_t *p2p_next_recv; /* [size] oldest message id not yet received from each rank */
  char **host_names;       /* [size] for messages */
  void *scratch[2];        /* SEGMENT_BYTES each, when the provider needs them */
  atomic_bool aborted;
  int spin_iters;          /* spins before yielding now (local/sync.c adapts it) */
  int spin_long;           /* spins when ranks seem to have a CPU each, else SHORT */
  uint32_t yield_streak;   /* waits in a row that ended in the yield phase */
  uint32_t short_waits;    /* waits since spins were shortened (probe period) */
  int host_cpus;           /* CPUs the ranks may use together (ddp__local_shared_cpus) */
  bool pinned_apart;       /* each rank bound to one CPU of its own: never stacked */
  int yield_iters;         /* sched_yield calls after spinning, before sleeping */
  uint64_t waits_slept;    /* waits that reached the futex phase (for tests) */
  uint32_t contended_skips; /* blocked waits left that skip their spin (local/sync.c) */
  uint64_t waits_contended; /* blocked waits that skipped it because the CPU was contended (for tests) */
  uint64_t waits_spun_blocked; /* waits that spun for a blocked caller (for tests) */
  int blame;               /* the peer behind the last error (a group rank), -1 if none */
  ddp__local_stores stores; /* DDP_LOCAL_STORES */
  uint64_t copies_streamed; /* shared-segment copies that streamed (for tests) */
  int64_t stream_until_ns;  /* copies stream unprobed until then (auto) */
  /* Group ranks of this backend's ranks (identity unless it serves one host
   * of a larger group, hier/hier.c), the group's size and host names (borrowed,
   * NULL: host_names), for messages and blame. */
  int *group_rank;
  int group_size;
  const char *const *group_host_names;
  _Atomic uint64_t moved;  /* payload bytes of this rank's ops (counters) */
  _Atomic uint64_t p2p_moved; /* ... of its point-to-point lane (written by the lane only) */
  /* The lane's per-peer scratch (local/p2p_channels.c): ranks whose next send or
   * receive must wait for an earlier one in this round. */
  uint8_t *p2p_send_held, *p2p_recv_held;
  int64_t p2p_next_liveness; /* when the lane next asks whether peers live */
  uint64_t exposed_op;     /* the last op whose buffers peers read in place (threads) */
  ddp_status failed;       /* sticky: the first op error, DDP_OK while none */
  char failed_msg[320];
} ddp__local_backend;

/* ---- Group ranks, blame and counters ----------------------------------- */

static inline int ddp__local_group_rank(const ddp__local_backend *b, int q) {
  return q >= 0 && q < b->size ? b->group_rank[q] : q;
}
/* A blame (a group rank) that names some other rank. */
static inline bool ddp__local_blame_valid(const ddp__local_backend *b, int32_t blame) {
  return blame >= 0 && blame < b->group_size && blame != b->group_rank[b->rank];
}
/* The host of a group rank, for messages. local/local.c. */
const char *ddp__local_group_host(const ddp__local_backend *b, int group_rank);
/* Adds an op's payload to the counters (one writer: the op's thread). */
static inline void ddp__local_count(ddp__local_backend *b, size_t bytes) {
  atomic_store_explicit(&b->moved,
                        atomic_load_explicit(&b->moved, memory_order_relaxed) + bytes,
                        memory_order_relaxed);
}
/* hier/hier.c's hooks: the group rank this rank's failure blames (-1: none), and
 * failing the backend because of an error found elsewhere (the TCP part of
 * the group): peers waiting here fail at once, naming group rank `blame`.
 * The message is the calling thread's last error. */
int ddp__local_blamed(const ddp__backend *b);
void ddp__local_fail_external(ddp__backend *b, ddp_status st, int blame);

/* ---- Waits (local/sync.c) ------------------------------------------------ */

/* Sets w->value (release) and wakes sleepers. */
/* dst (count) := the reduction of src[0..size) in rank order (so every rank's
 * result is bitwise equal), finished for AVG. dst may alias one source. */
void ddp__local_reduce_ranks(void *dst, const void *const *src, int size, size_t count,
                             ddp_dtype dtype, ddp_reduce_op op);
void ddp__local_post(ddp__local_backend *b, ddp__local_word *w, uint64_t value);
/* Waits until w->value >= target: spins, then sleeps in the futex; gives up
 * on the deadline, abort, or when any peer has failed, left or died.
 * `peer` is the rank that will post w (for messages). */
/* True when every rank's published affinity is a single CPU and no two ranks
 * share one (ddprun's default placement): the scheduler cannot stack them. */
bool ddp__local_pinned_apart(ddp__local_region *reg, int size);

/* The spin policy's bookkeeping after a wait that ended in the yield phase
 * (local/sync.c). `skipped_spin`: the wait skipped its blocked spin because
 * the CPU was contended, so ending in the yields says nothing about ranks
 * stacked on one core. Exposed for tests of the policy. */
void ddp__local_wait_ended_in_yield(ddp__local_backend *b, bool skipped_spin);

ddp_status ddp__local_wait(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp__local_word *w,
                           uint64_t target, int peer);
/* Waits until rank q's flag >= target (uses and updates b->seen). */
ddp_status ddp__local_wait_flag(ddp__local_backend *b, const ddp__op_ctx *ctx, int q,
                                uint64_t target);
/* Every other rank's flag >= target. */
ddp_status ddp__local_wait_all(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t target);
/* After this rank failed during an op whose buffers peers read in place:
 * waits (at most 2 s) until every peer has finished the op or stopped, so
 * the caller may free its buffers once the op returns. local/local.c. */
void ddp__local_linger(ddp__local_backend *b);
/* DDP_OK, or the sticky error of an earlier op (message restored), or
 * DDP_ERR_ABORTED once aborted: an op that cannot run touches nothing. */
ddp_status ddp__local_check_failed(ddp__local_backend *b, const ddp__op_ctx *ctx);
/* Wakes every sleeper on the region (abort). */
void ddp__local_wake_all(ddp__local_backend *b);
/* Marks this rank failed (so waiting peers fail fast), remembers the error
 * (every later op returns it) and returns st. */
ddp_status ddp__local_fail(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp_status st);

/* ---- Op framing (shared by local/local.c and local/staged.c) ------------------- */

/* A rank's flag: (op number << 32) | step. */
#define DDP__LOCAL_STEP_START 1u
#define DDP__LOCAL_STEP_DONE 0xfffffff0u
static inline uint64_t ddp__local_flag(uint64_t n, uint32_t step) { return (n << 32) | step; }
static inline ddp__local_ctl *ddp__local_my_ctl(ddp__local_backend *b) {
  return ddp__local_ctl_of(b->reg, b->rank);
}
/* Elements per slice of `count` split over `size` ranks: slice q is
 * [lo(q), lo(q + 1)), boundaries on 64-byte multiples. */
static inline size_t ddp__local_slice_lo(size_t count, int size, int q, size_t esize) {
  if (q >= size) return count;
  size_t align = esize < 64 ? 64 / esize : 1;
  size_t lo = (size_t)((unsigned __int128)count * (unsigned)q / (unsigned)size);
  lo -= lo % align;
  return lo;
}

/* ---- Writing into the shared segment (local/stores.c) --------------------
 * For data a peer reads next: ordinary stores, or streaming ones when a
 * peer's cache holding the lines makes ordinary stores slow (the policy
 * above, b->stores). */
/* The policy from DDP_LOCAL_STORES (unset: auto); DDP_ERR_INVALID naming a
 * bad value. */
ddp_status ddp__local_stores_from_env(ddp__local_stores *out);
/* True when `bytes` written in `ns` ran below DDP__LOCAL_STORE_SLOW_GBPS. */
bool ddp__local_store_is_slow(int64_t ns, size_t bytes);
/* dst := src (len bytes, any alignment) with streaming stores, fenced: the
 * data is visible to every CPU before the function returns. */
void ddp__local_copy_streaming(void *dst, const void *src, size_t len);
/* dst := src by b->stores's policy (copies under 2 * DDP__LOCAL_STORE_PROBE
 * bytes never stream); true when it streamed (the caller's next writes into
 * the segment for the same chunk may then stream too). */
bool ddp__local_shared_copy(ddp__local_backend *b, void *dst, const void *src, size_t len);
/* ddp__local_reduce_ranks into the segment, with streaming stores (through a
 * block that stays in L1) when `streaming`. */
void ddp__local_reduce_to_shared(void *dst, const void *const *src, int size, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op, bool streaming);

/* ---- Staged collectives between processes (local/staged.c) ---------------
 * Called for op n after its START is posted (op_publish); data moves only
 * through the region's staging chunks, never through peers' buffers. */
/* At creation: every rank's staging area is mapped in and allocated
 * (MADV_POPULATE_WRITE), so no op pays the page faults of touching it first
 * (the two-process allreduce moves around 2 MiB of it). About 4 MiB of
 * shared memory per rank, which the first large op would allocate anyway. */
void ddp__local_stage_prefault(ddp__local_backend *b);
ddp_status ddp__local_staged_allreduce(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       void *buf, size_t count, ddp_dtype dtype,
                                       ddp_reduce_op op);
ddp_status ddp__local_staged_broadcast(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       void *buf, size_t bytes, int root);
ddp_status ddp__local_staged_reduce(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                    void *buf, size_t count, ddp_dtype dtype, ddp_reduce_op op,
                                    int root);
ddp_status ddp__local_staged_allgather(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                       const void *send, void *recv, size_t bytes);
ddp_status ddp__local_staged_gather(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                    const void *send, void *recv, size_t bytes, int root);
ddp_status ddp__local_staged_scatter(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t n,
                                     const void *send, void *recv, size_t bytes, int root);
ddp_status ddp__local_staged_reduce_scatter(ddp__local_backend *b, const ddp__op_ctx *ctx,
                                            uint64_t n, const void *send, void *recv,
                                            size_t count, ddp_dtype dtype, ddp_reduce_op op);
ddp_status ddp__local_staged_all_to_all(ddp__local_backend *b, const ddp__op_ctx *ctx,
                                        uint64_t n, const void *send, void *recv, size_t bytes);

/* ---- Point to point (local/p2p_channels.c) ----------------------------------------
 * send/recv run one message at a time on the op's thread (the hierarchical
 * backend's pairs on one host); p2p_progress and p2p_wake are the group's
 * point-to-point lane (backend.h). Both use the same channels and message
 * ids, so a group uses one or the other. */
ddp_status ddp__local_p2p_progress(ddp__backend *b, const ddp__op_ctx *ctx,
                                   ddp__p2p_req *const *reqs, int n, int64_t wait_ns,
                                   int *culprit);
void ddp__local_p2p_wake(ddp__backend *b);
/* Rings rank q's doorbell (local/sync.c). */
void ddp__local_bell_ring(ddp__local_backend *b, int q);
/* Sleeps on this rank's doorbell until it is rung after `seen` (its wake
 * counter read before the caller last looked) or ns pass. */
void ddp__local_bell_wait(ddp__local_backend *b, uint32_t seen, int64_t ns);
ddp_status ddp__local_send(ddp__backend *b, const ddp__op_ctx *ctx, const void *buf,
                           size_t bytes, int dst);
ddp_status ddp__local_recv(ddp__backend *b, const ddp__op_ctx *ctx, void *buf, size_t bytes,
                           int src);

#endif /* DDP__COMM_LOCAL_H */
