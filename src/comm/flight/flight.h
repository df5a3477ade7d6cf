/* The flight recorder (PyTorch's NCCL flight recorder, for ddp's groups):
 * every process group keeps its last N operations in a ring, each with its
 * sequence number, operation, sizes, dtype, peer, state and times; on a
 * timeout, a peer's death or SIGUSR1 the process dumps every group's ring
 * (a JSON file per rank in DDP_DEBUG_DIR or a run directory under $TMPDIR,
 * and the store under a launcher),
 * and a launcher or `ddp-debug flight` reads the dumps of all ranks and says
 * who stopped where (docs/comm.md, "Flight recorder"; docs/debugging.md).
 *
 * Three parts:
 *   ring.c            the ring: recording on the hot path, consistent copies
 *   dump.c            the process: registry of rings, triggers (failure,
 *                     SIGUSR1 through a pipe and a dump thread), the JSON
 *                     writer, the file and the store
 *   verdict.c         the verdict over the dumps of every rank
 * The JSON reader is src/launch/flight_read.c (it uses io's parser). Not
 * installed. */
#ifndef DDP__COMM_FLIGHT_H
#define DDP__COMM_FLIGHT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/bias.h"
#include "comm/op.h"

typedef struct ddp__flight ddp__flight;

#define DDP__FLIGHT_DEFAULT_SIZE 2000
#define DDP__FLIGHT_MAX_SIZE (1 << 20)
#define DDP__FLIGHT_NAME_BYTES 128
#define DDP__FLIGHT_FORMAT "ddp-flight-recorder"
#define DDP__FLIGHT_VERSION 1

typedef enum ddp__flight_state {
  DDP__FLIGHT_SCHEDULED = 1, /* queued behind other operations */
  DDP__FLIGHT_STARTED = 2,   /* running on the backend */
  DDP__FLIGHT_COMPLETED = 3,
  DDP__FLIGHT_FAILED = 4,
  /* Handed to an engine that runs it later on a device stream (NCCL): the
   * program entered it and its kernels are queued, but its start event has
   * not passed yet (PyTorch's "scheduled" on NCCL); the backend marks it
   * started when it has (ddp__flight_mark_started). */
  DDP__FLIGHT_ENQUEUED = 5,
} ddp__flight_state;

/* "scheduled", "started", "completed", "failed", "enqueued"; "unknown"
 * otherwise. */
const char *ddp__flight_state_name(int32_t state);
/* The inverse (0 for an unknown name). */
int32_t ddp__flight_state_of(const char *name);

/* ---- The model of a dump: what a ring holds, as the writer copies it and
 * the reader parses it back ------------------------------------------------ */

/* One operation. Times are CLOCK_MONOTONIC nanoseconds read from the coarse
 * clock (a tick: 1-4 ms), -1 when the state was never reached. */
typedef struct ddp__flight_record {
  uint64_t id;        /* the ring's record number, from 0 */
  uint64_t seq;       /* collective number (collectives) or point-to-point
                         number (send/recv); 0 while scheduled */
  int32_t kind;       /* ddp__op_kind */
  int32_t dtype;      /* ddp_dtype; -1 for barrier */
  int32_t reduce_op;  /* ddp_reduce_op; -1 where the op has none */
  int32_t root;       /* broadcast/reduce/gather/scatter; else -1 */
  int32_t peer;       /* send/recv; else -1 */
  int32_t tag;        /* send/recv; else 0 */
  uint64_t count;     /* elements of dtype, as passed to the call */
  int32_t state;      /* ddp__flight_state */
  int32_t status;     /* ddp_status of a failed op, else 0 */
  int64_t scheduled_ns, started_ns, ended_ns;
} ddp__flight_record;

/* One group's ring as seen by one rank. */
typedef struct ddp__flight_group {
  char name[DDP__FLIGHT_NAME_BYTES]; /* "pg/1/", "pg/1/sub/2/c0/": equal on every rank */
  int32_t rank;
  int32_t size;
  char backend[16];
  uint64_t recorded;  /* records ever made; more than n once the ring wrapped */
  int64_t dump_ns;    /* the dump's time (the process's), for "waited T s" */
  size_t n;
  ddp__flight_record *records; /* (n) oldest first */
} ddp__flight_group;

/* One process's dump. A process with several ranks (ranks as threads) has a
 * group entry per rank. */
typedef struct ddp__flight_dump {
  int32_t rank;        /* RANK of the process, -1 when unset */
  int32_t world_size;  /* WORLD_SIZE, -1 when unset */
  int64_t pid;
  int32_t attempt;     /* TORCHELASTIC_RESTART_COUNT, -1 when unset */
  uint64_t dump_number; /* 1 for the process's first dump, ... */
  uint64_t capacity;   /* N */
  int64_t dump_ns;     /* monotonic, the clock of the records */
  int64_t dump_unix_ns; /* the wall clock at the same moment */
  char host[256];
  char run_id[128];    /* TORCHELASTIC_RUN_ID, "" when unset */
  char reason[16];     /* "timeout", "peer", "signal" */
  char detail[512];    /* the failure's message, or what asked */
  size_t n_groups;
  ddp__flight_group *groups;
} ddp__flight_dump;

/* Frees what a dump holds (not the struct itself); zeroes it. NULL ok. */
void ddp__flight_dump_free(ddp__flight_dump *dump);

/* ---- The ring ---------------------------------------------------------------
 * A slot is a seqlock. A record is written up to three times (made, started,
 * ended), and each write w (0, 1, 2) of record `id` has a version of its
 * own, V = 2 (4 id + w): the slot's `version` is V + 1 while that write is
 * under way and V + 2 once the record is consistent. A reader on another
 * thread (the dump) copies a slot, checks that the version did not move,
 * and otherwise retries or skips it; versions only grow, so a write that
 * came and went during the copy is always seen (with one version per
 * record, a started record's copy could take its state from before the end
 * and its end time from after, and pass). Every field is an atomic written with relaxed stores: on x86 a
 * record is a few plain stores and one locked add (the record number);
 * nothing waits. Records are made by whoever submits (scheduled, under the
 * group's mutex) and by the executing thread (started, ended; one at a time
 * per group), so only the record number needs the atomic add; the
 * group's biased owner takes even that without a locked instruction
 * (ddp__flight_new_owned, below). */
typedef struct ddp__flight_slot {
  _Atomic uint64_t version;
  _Atomic uint64_t seq;
  _Atomic uint64_t what;     /* kind | dtype << 8 | reduce_op << 16 | state << 24 | (uint32)status << 32 */
  _Atomic uint64_t peer_tag; /* (uint32)root-or-peer | (uint32)tag << 32 */
  _Atomic uint64_t count;
  _Atomic int64_t scheduled_ns;
  _Atomic int64_t started_ns;
  _Atomic int64_t ended_ns;
} ddp__flight_slot;

struct ddp__flight {
  ddp__flight_slot *slots; /* (mask + 1), a power of two >= capacity */
  uint64_t mask;
  uint64_t capacity;       /* N: a dump holds the last N records */
  _Atomic uint64_t next_id; /* records made so far */
  /* Claims of next_id by plain load and store: the group's biased owner's
   * (ddp__flight_new_owned), until a writer the group's exclusion does not
   * order against it revokes them (ddp__flight_share). */
  ddp__bias claim;
  char name[DDP__FLIGHT_NAME_BYTES];
  int32_t rank;
  int32_t size;
  char backend[16];
  ddp__flight *reg_next;   /* the process's registry (flight/dump.c) */
};

/* N from DDP_FLIGHT_RECORDER_SIZE (default 2000, 0 = off; malformed or
 * negative: a warning and the default; above 2^20: 2^20). */
uint64_t ddp__flight_capacity_from_env(void);

/* A ring of `capacity` records for the group `name` (rank of size),
 * registered with the process (so dumps include it; the first ring also
 * installs the SIGUSR1 handler and the dump thread). *out is NULL when
 * capacity is 0. NOMEM when the ring cannot be allocated. Free with
 * ddp__flight_close. */
ddp_status ddp__flight_open(uint64_t capacity, const char *name, int32_t rank, int32_t size,
                            const char *backend, ddp__flight **out);
/* Unregisters (waiting for a dump that reads it) and frees. NULL ok. */
void ddp__flight_close(ddp__flight *flight);

/* Copies the last min(capacity, recorded) records, oldest first, into out
 * (capacity entries) and returns how many; a slot being written at that
 * moment (or overwritten meanwhile) is left out. Any thread. */
size_t ddp__flight_snapshot(const ddp__flight *flight, ddp__flight_record *out);

static inline uint64_t ddp__flight_pack_what(const ddp__op_args *a, int32_t state, ddp_status status) {
  return (uint64_t)(uint8_t)a->kind | (uint64_t)(uint8_t)a->dtype << 8 |
         (uint64_t)(uint8_t)a->reduce_op << 16 | (uint64_t)(uint8_t)state << 24 |
         (uint64_t)(uint32_t)status << 32;
}

/* The version of write w of record id (before its +1 / +2). */
static inline uint64_t ddp__flight_version(uint64_t id, uint64_t w) { return 2 * (4 * id + w); }
/* The record a consistent (even, nonzero) version belongs to, and its write. */
static inline uint64_t ddp__flight_version_id(uint64_t v) { return (v - 2) / 8; }
static inline uint64_t ddp__flight_version_write(uint64_t v) { return (v - 2) / 2 % 4; }

static inline void ddp__flight_begin_write(ddp__flight_slot *s, uint64_t version) {
  atomic_store_explicit(&s->version, version + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
}

static inline void ddp__flight_end_write(ddp__flight_slot *s, uint64_t version) {
  atomic_store_explicit(&s->version, version + 2, memory_order_release);
}

/* Writes record `id` (claimed: see below) of `a` in `state` at `now_ns`;
 * a->flight gets id + 1. */
static inline void ddp__flight_write_new(ddp__flight *f, uint64_t id, ddp__op_args *a, int32_t state,
                                         int64_t now_ns) {
  ddp__flight_slot *s = &f->slots[id & f->mask];
  uint64_t v = ddp__flight_version(id, 0);
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->seq, a->seq, memory_order_relaxed);
  atomic_store_explicit(&s->what, ddp__flight_pack_what(a, state, DDP_OK), memory_order_relaxed);
  atomic_store_explicit(&s->peer_tag, (uint64_t)(uint32_t)a->root | (uint64_t)(uint32_t)a->tag << 32,
                        memory_order_relaxed);
  atomic_store_explicit(&s->count, (uint64_t)a->count, memory_order_relaxed);
  atomic_store_explicit(&s->scheduled_ns, now_ns, memory_order_relaxed);
  atomic_store_explicit(&s->started_ns, state == DDP__FLIGHT_STARTED ? now_ns : -1, memory_order_relaxed);
  atomic_store_explicit(&s->ended_ns, -1, memory_order_relaxed);
  ddp__flight_end_write(s, v);
  a->flight = id + 1;
}

/* Who may make a record, and how its number is claimed. Writers of a
 * group's ring: its collectives' (ddp__submit's scheduled record under the
 * group's mutex, the executing thread's start of an inline op, the direct
 * path), all ordered by the group's own exclusion (bias.h, pg->active),
 * and the point-to-point lane's submitters (under the lane's mutex, on any
 * thread, at any time, a collective running or not).
 *
 * ddp__flight_new: an atomic add claims the number (a locked instruction
 * on x86). Any writer; the point-to-point lane calls ddp__flight_share
 * once before its first.
 *
 * ddp__flight_new_owned: for the group's biased owner inside a biased call
 * (the direct path of collectives.c; docs/comm.md, MPI, "The flight
 * recorder's number"). The locked add drains the store buffer, about 5 ns
 * of a 240 ns 8-byte MPI allreduce, so the owner claims with a plain load
 * and store inside the ring's own bias, f->claim (the protocol of bias.h,
 * over a window of a few instructions instead of a whole call):
 *   - the group's other collective writers never run beside it: they come
 *     after the group's bias was revoked, which waited for the owner's
 *     call, or they are the owner itself;
 *   - the point-to-point lane's writers revoke f->claim first
 *     (ddp__flight_share: membarrier, then a wait for the owner's claim in
 *     progress, a few instructions that never wait for anything), so
 *     either the owner sees the claim bias gone and adds atomically, or
 *     its plain store happens before their atomic adds.
 * f->claim starts biased where the group's bias would (bias.h: membarrier
 * available, not under TSan, DDP_INLINE_BIAS not 0); only the group's
 * owner ever enters it (ddp__bias_enter_sole). */
static inline void ddp__flight_new(ddp__flight *f, ddp__op_args *a, int32_t state, int64_t now_ns) {
  ddp__flight_write_new(f, atomic_fetch_add_explicit(&f->next_id, 1, memory_order_relaxed), a, state, now_ns);
}

static inline void ddp__flight_new_owned(ddp__flight *f, ddp__op_args *a, int32_t state, int64_t now_ns) {
  uint64_t id;
  if (ddp__bias_enter_sole(&f->claim)) {
    id = atomic_load_explicit(&f->next_id, memory_order_relaxed);
    atomic_store_explicit(&f->next_id, id + 1, memory_order_relaxed);
    ddp__bias_exit(&f->claim);
  } else {
    id = atomic_fetch_add_explicit(&f->next_id, 1, memory_order_relaxed);
  }
  ddp__flight_write_new(f, id, a, state, now_ns);
}

/* Ends the owner's plain claims (see above), once per ring: a writer that
 * the group's exclusion does not order against the owner calls it before
 * its first ddp__flight_new. Waits only for a claim in progress; TIMEOUT
 * (message set) when that took past timeout_ns + 5 s, a thread stopped
 * mid-claim: then it must not record. */
static inline ddp_status ddp__flight_share(ddp__flight *f, int64_t timeout_ns) {
  return ddp__bias_revoke(&f->claim, timeout_ns);
}

/* The slot still holding a->flight's record, or NULL (none, or a newer record
 * took the slot: with N below the operations in flight); *next_version: the
 * version its next write takes. A record's writes come one after another
 * (submission, then the executing thread), so its slot is consistent here. */
static inline ddp__flight_slot *ddp__flight_slot_of(ddp__flight *f, const ddp__op_args *a,
                                                    uint64_t *next_version) {
  if (a->flight == 0) return NULL;
  uint64_t id = a->flight - 1;
  ddp__flight_slot *s = &f->slots[id & f->mask];
  uint64_t v = atomic_load_explicit(&s->version, memory_order_relaxed);
  if (v < 2 || v % 2 != 0 || ddp__flight_version_id(v) != id) return NULL;
  uint64_t w = ddp__flight_version_write(v) + 1;
  if (w > 3) return NULL; /* more writes than a record has: leave it */
  *next_version = ddp__flight_version(id, w);
  return s;
}

/* The op starts running (numbered: a->seq is set): its scheduled record
 * becomes started, or a new record is made (a blocking call run inline). */
static inline void ddp__flight_start(ddp__flight *f, ddp__op_args *a, int64_t now_ns) {
  uint64_t v;
  ddp__flight_slot *s = ddp__flight_slot_of(f, a, &v);
  if (!s) {
    ddp__flight_new(f, a, DDP__FLIGHT_STARTED, now_ns);
    return;
  }
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->seq, a->seq, memory_order_relaxed);
  atomic_store_explicit(&s->what, ddp__flight_pack_what(a, DDP__FLIGHT_STARTED, DDP_OK), memory_order_relaxed);
  atomic_store_explicit(&s->started_ns, now_ns, memory_order_relaxed);
  ddp__flight_end_write(s, v);
}

/* The op was handed to an engine that starts it on a device later
 * (numbered: a->seq is set): like ddp__flight_start, in state ENQUEUED
 * with no start time yet. */
static inline void ddp__flight_enqueue(ddp__flight *f, ddp__op_args *a, int64_t now_ns) {
  uint64_t v;
  ddp__flight_slot *s = ddp__flight_slot_of(f, a, &v);
  if (!s) {
    ddp__flight_new(f, a, DDP__FLIGHT_ENQUEUED, now_ns);
    return;
  }
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->seq, a->seq, memory_order_relaxed);
  atomic_store_explicit(&s->what, ddp__flight_pack_what(a, DDP__FLIGHT_ENQUEUED, DDP_OK), memory_order_relaxed);
  ddp__flight_end_write(s, v);
}

/* The backend's mark: record `record` (an op's a->flight, id + 1; 0: none)
 * started on its device at now_ns. Only a record still ENQUEUED changes (a
 * newer record in its slot, or one already ended, is left). The backend
 * calls it before it completes the op, so its write comes between the
 * group layer's enqueue and end writes, never beside them. */
static inline void ddp__flight_mark_started(ddp__flight *f, uint64_t record, int64_t now_ns) {
  ddp__op_args a = {.flight = record};
  uint64_t v;
  ddp__flight_slot *s = f ? ddp__flight_slot_of(f, &a, &v) : NULL;
  if (!s) return;
  uint64_t what = atomic_load_explicit(&s->what, memory_order_relaxed);
  if ((what >> 24 & 0xff) != DDP__FLIGHT_ENQUEUED) return;
  what = (what & ~((uint64_t)0xff << 24)) | (uint64_t)DDP__FLIGHT_STARTED << 24;
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->what, what, memory_order_relaxed);
  atomic_store_explicit(&s->started_ns, now_ns, memory_order_relaxed);
  ddp__flight_end_write(s, v);
}

/* The op finished with `status` at now_ns. */
static inline void ddp__flight_end(ddp__flight *f, const ddp__op_args *a, ddp_status status, int64_t now_ns) {
  uint64_t v;
  ddp__flight_slot *s = ddp__flight_slot_of(f, a, &v);
  if (!s) return;
  int32_t state = status == DDP_OK ? DDP__FLIGHT_COMPLETED : DDP__FLIGHT_FAILED;
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->what, ddp__flight_pack_what(a, state, status), memory_order_relaxed);
  atomic_store_explicit(&s->ended_ns, now_ns, memory_order_relaxed);
  ddp__flight_end_write(s, v);
}

/* ddp__flight_end for a record made by ddp__flight_new(_owned) and not
 * written since (the direct path's: started, then ended), found without
 * reading back which write is next: it is write 1, unless a newer record
 * took the slot meanwhile (then nothing is written, as there). */
static inline void ddp__flight_end_started(ddp__flight *f, const ddp__op_args *a, ddp_status status,
                                           int64_t now_ns) {
  uint64_t id = a->flight - 1;
  ddp__flight_slot *s = &f->slots[id & f->mask];
  uint64_t v = ddp__flight_version(id, 1);
  if (atomic_load_explicit(&s->version, memory_order_relaxed) != v) return; /* v: write 0's + 2 */
  int32_t state = status == DDP_OK ? DDP__FLIGHT_COMPLETED : DDP__FLIGHT_FAILED;
  ddp__flight_begin_write(s, v);
  atomic_store_explicit(&s->what, ddp__flight_pack_what(a, state, status), memory_order_relaxed);
  atomic_store_explicit(&s->ended_ns, now_ns, memory_order_relaxed);
  ddp__flight_end_write(s, v);
}

/* ---- Dumps (flight/dump.c) ------------------------------------------------- */

/* The process's registry of rings, which every dump reads: open registers
 * (the first ring also installs the SIGUSR1 handler and starts the dump
 * thread), close unregisters, waiting for a dump that is reading it. */
void ddp__flight_register(ddp__flight *flight);
void ddp__flight_unregister(ddp__flight *flight);

/* Where dump files go: DDP_DEBUG_DIR when set (by the user, or by ddprun
 * for its workers); else a run directory under the system's temporary
 * directory ($TMPDIR, else /tmp): "ddp-debug-<run id>-<pid>" for a
 * launcher (run_id set; pid its own: ddprun passes the result to its
 * workers as DDP_DEBUG_DIR and names it in its summary),
 * "ddp-debug-pid<pid>" for a process alone (run_id NULL). Never the working
 * directory unless asked. */
void ddp__flight_debug_dir(const char *run_id, int64_t pid, char *out, size_t bytes);

/* Dumps every ring of the process now, on the calling thread (serialised
 * with other dumps): the JSON file in ddp__flight_debug_dir (created if
 * missing; written atomically, io's writer), then, under a
 * launcher that gives DDP_STORE_ADDR, the store (key flight/<RANK> under
 * DDP_STORE_PREFIX, and flight/<RANK>/dumps counted up after it). `reason`
 * is "timeout", "peer" or "signal"; `detail` says more (NULL
 * ok). Logs one warning line naming the file. Returns DDP_OK when the file
 * was written; errors name the path. */
ddp_status ddp__flight_dump_now(const char *reason, const char *detail);
/* The group layer's hook: the group's first failure was `status` (called
 * once per group, outside its locks). A timeout or a peer's death dumps
 * (synchronously, so a process that exits on the error has dumped first). */
void ddp__flight_on_failure(ddp__flight *flight, ddp_status status, const char *msg);

/* The file a dump of this process goes to: "<dir>/ddp-flight-rank<R>.json"
 * (RANK set) or "<dir>/ddp-flight-pid<P>.json". */
void ddp__flight_dump_path(const char *dir, int32_t rank, int64_t pid, char *out, size_t bytes);
/* The dump as JSON (the format of docs/comm.md): a ddp_alloc'd,
 * NUL-terminated text in *text (length in *len). */
ddp_status ddp__flight_to_json(const ddp__flight_dump *dump, char **text, size_t *len);
/* Fills *dump with this process's rings and identity (what a dump writes).
 * Free with ddp__flight_dump_free. */
ddp_status ddp__flight_collect(const char *reason, const char *detail, ddp__flight_dump *dump);

/* ---- The verdict (flight/verdict.c) -------------------------------------- */

/* Reads the dumps of a job (any order, one per process; several group
 * entries of one group and rank: the newest dump wins) and says, per group
 * with something to say, who stopped where: a rank that never entered the
 * collective the others wait in ("rank 2 never entered allreduce #1812
 * (116 KiB); ranks 0-1 waited 30 s in it"), ranks that called different
 * collectives as the same number, ranks waiting in a collective or a
 * send/recv, and ranks with no dump ("no dump from rank 2: <why>").
 * world_size: the job's (ranks 0..world_size-1 expected to dump), or -1 to
 * go by the groups' sizes alone. why_absent: per world rank, why it has no
 * dump, or NULL (entries may be NULL). *text: ddp_alloc'd lines, each ending
 * in '\n' ("" when there is nothing to say). */
ddp_status ddp__flight_verdict(const ddp__flight_dump *dumps, size_t n, int32_t world_size,
                               const char *const *why_absent, char **text);

/* "allreduce #5 (8 B)" and friends, shared with ddp-debug's listing. */
void ddp__flight_describe(const ddp__flight_record *r, char *out, size_t bytes);
/* Bytes of one rank's buffer as passed (count x dtype size; 0 for barrier). */
uint64_t ddp__flight_bytes(const ddp__flight_record *r);
/* "8 B", "116 KiB", "4.0 MiB". */
void ddp__flight_format_bytes(uint64_t bytes, char *out, size_t size);

#endif /* DDP__COMM_FLIGHT_H */
