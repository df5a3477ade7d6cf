/* ddp core: status codes, the thread-local last error, rank-prefixed logging,
 * allocation hooks, arenas for per-step temporaries, a seeded RNG, time and
 * environment parameters. Every other layer builds on this one. */
#ifndef DDP_CORE_H
#define DDP_CORE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version -------------------------------------------------------------
 * The version of these headers (CMake's project version is read from these
 * three lines) and, from ddp_version(), the version of the library a program
 * runs with: the two differ when a program built against one release loads
 * another's libddp.so. The soname (libddp.so.0) changes with the ABI. */
#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0

/* The running library's version, "MAJOR.MINOR.PATCH" ("0.1.0"); static
 * storage, never NULL. */
const char *ddp_version(void);

/* ---- Public structs that can grow ------------------------------------------
 * A public struct the caller allocates ends in reserved space (zero) that a
 * later field is taken from, so a program built against one release keeps
 * working with the next. DDP_STRUCT_SIZE states each such struct's size
 * where it is declared (x86-64 and aarch64 Linux, LP64): a new field that
 * does not come out of the reserved space stops the build. The options
 * structs among them come with ddp_<thing>_defaults(), which returns them
 * filled with the documented defaults (docs/architecture.md, "Options"). */
#ifdef __cplusplus
#define DDP_STRUCT_SIZE(type, bytes) \
  static_assert(sizeof(type) == (bytes), #type ": a new field must come out of its reserved space")
#else
#define DDP_STRUCT_SIZE(type, bytes) \
  _Static_assert(sizeof(type) == (bytes), #type ": a new field must come out of its reserved space")
#endif

/* ---- Status codes -------------------------------------------------------
 * Library functions return ddp_status: 0 on success, a negative code on
 * failure. The detail ("conv2d: input (8,3,28,28) has 3 channels, weight
 * expects 1") is in the calling thread's last-error message. */
#define DDP_STATUS_TABLE(X)                                             \
  X(OK, 0, "success")                                                   \
  X(ERR_INVALID, -1, "invalid argument")                                \
  X(ERR_SHAPE, -2, "shape mismatch")                                    \
  X(ERR_NOMEM, -3, "out of memory")                                     \
  X(ERR_IO, -4, "input/output error")                                   \
  X(ERR_FORMAT, -5, "malformed data")                                   \
  X(ERR_TIMEOUT, -6, "timed out")                                       \
  X(ERR_CLOSED, -7, "connection closed")                                \
  X(ERR_PEER, -8, "peer failed")                                        \
  X(ERR_NOTFOUND, -9, "not found")                                      \
  X(ERR_UNSUPPORTED, -10, "not supported")                              \
  X(ERR_STATE, -11, "invalid state")                                    \
  X(ERR_ADDRINUSE, -12, "address already in use")                       \
  X(ERR_AUTH, -13, "authentication failed")                             \
  X(ERR_ABORTED, -14, "aborted")                                        \
  X(ERR_SYS, -15, "system call failed")                                 \
  X(ERR_RANGE, -16, "value out of range")                               \
  X(ERR_INTERNAL, -17, "internal error")

typedef enum ddp_status {
#define DDP__STATUS_ENUM(name, code, msg) DDP_##name = code,
  DDP_STATUS_TABLE(DDP__STATUS_ENUM)
#undef DDP__STATUS_ENUM
} ddp_status;

/* The fixed message of a status ("timed out"); never NULL. */
const char *ddp_strerror(ddp_status status);
/* The symbolic name of a status ("DDP_ERR_TIMEOUT"); never NULL. */
const char *ddp_status_name(ddp_status status);

/* Records a detailed message for the calling thread and returns status, so
 * callers write `return ddp_error(DDP_ERR_SHAPE, "linear: ...", ...)`. */
ddp_status ddp_error(ddp_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prepends "context: " to the calling thread's last message and returns status;
 * used to leave a trail as an error propagates upward. */
ddp_status ddp_error_wrap(ddp_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The calling thread's last detailed message ("" if none). Valid until the next
 * ddp call on this thread. */
const char *ddp_last_error(void);
void ddp_clear_error(void);

/* Propagates a failing status to the caller (NCCL's one-line check). */
#define DDP_TRY(expr)                          \
  do {                                         \
    ddp_status ddp__s = (expr);                \
    if (ddp__s != DDP_OK) return ddp__s;       \
  } while (0)

/* A broken invariant inside ddp (never a user mistake): abort with file:line.
 * For ddp's own code and its tests (which link libddp.a): libddp.so does not
 * export ddp__assert_fail, so a program linking it cannot use this macro. */
#define DDP_ASSERT(cond)                                                   \
  do {                                                                     \
    if (!(cond)) ddp__assert_fail(#cond, __FILE__, __LINE__, __func__);    \
  } while (0)
_Noreturn void ddp__assert_fail(const char *cond, const char *file, int line,
                                const char *func);

/* ---- Logging -------------------------------------------------------------
 * Lines go to stderr as "[ddp rank 3] W message". The threshold comes from
 * DDP_LOG_LEVEL (debug, info, warn, error, off; default warn, or info when
 * DDP_DEBUG is info or detail), read once. */
typedef enum ddp_log_level {
  DDP_LOG_DEBUG = 0,
  DDP_LOG_INFO = 1,
  DDP_LOG_WARN = 2,
  DDP_LOG_ERROR = 3,
  DDP_LOG_OFF = 4,
} ddp_log_level;

void ddp_log(ddp_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void ddp_log_set_level(ddp_log_level level);
ddp_log_level ddp_log_get_level(void);
/* The rank shown in the prefix; -1 (the default, unless RANK is set) hides it. */
void ddp_log_set_rank(int rank);

#define DDP_DEBUG(...) ddp_log(DDP_LOG_DEBUG, __VA_ARGS__)
#define DDP_INFO(...) ddp_log(DDP_LOG_INFO, __VA_ARGS__)
#define DDP_WARN(...) ddp_log(DDP_LOG_WARN, __VA_ARGS__)

/* ---- Allocation ----------------------------------------------------------
 * All of ddp's heap memory goes through these hooks, so tests can count
 * allocations (the steady-state training step must make none) and inject
 * failures. ddp_alloc returns NULL on failure (it never aborts); memory is
 * aligned to 64 bytes. ddp_free accepts NULL. */
typedef struct ddp_alloc_hooks {
  void *(*alloc)(size_t bytes, void *user);   /* 64-byte aligned or NULL */
  void (*free)(void *ptr, void *user);
  void *user;
} ddp_alloc_hooks;

void *ddp_alloc(size_t bytes);
void *ddp_calloc(size_t count, size_t size); /* zeroed; NULL on overflow */
void ddp_free(void *ptr);
char *ddp_strdup(const char *s);
/* Grows or shrinks a block from ddp_alloc: a new block of new_bytes holding
 * the first min(old_bytes, new_bytes) bytes of ptr, which is then freed.
 * The hooks' free is not told sizes, so the caller says how many bytes to
 * keep (the old block's size, or just the bytes in use). NULL on failure,
 * ptr left as it was (as realloc); ptr NULL allocates. Counted as one
 * ddp_alloc. */
void *ddp_realloc(void *ptr, size_t old_bytes, size_t new_bytes);
/* Installs hooks (NULL restores the default aligned malloc). Not thread-safe
 * against concurrent allocation: install before starting work. */
void ddp_set_alloc_hooks(const ddp_alloc_hooks *hooks);
/* Number of ddp_alloc calls so far in this process (all threads). */
uint64_t ddp_alloc_count(void);

/* ---- Arenas --------------------------------------------------------------
 * A bump allocator for one step's temporaries (activations, their gradients,
 * the tape). ddp_arena_reset() keeps the memory: after a first step has
 * grown the arena to its high-water mark, later steps allocate nothing. */
typedef struct ddp_arena_chunk ddp_arena_chunk;
/* Released blocks the arena hands out again before bumping (a few: the
 * tape releases at most one or two per step). */
#define DDP_ARENA_HOLES 4
/* Where an arena's memory comes from when it is not the host heap (a
 * GPU's memory: src/tensor/cuda/). The chunks' bookkeeping stays on the
 * host; `alloc` returns `bytes` (NULL with ddp_error set on failure), 64-byte
 * aligned at least; `zero` clears memory (ddp_arena_calloc). */
typedef struct ddp_arena_backing {
  const char *name; /* in error messages: "cuda" */
  void *(*alloc)(size_t bytes);
  void (*free)(void *ptr);
  void (*zero)(void *ptr, size_t bytes);
} ddp_arena_backing;
typedef struct ddp_arena {
  ddp_arena_chunk *head;     /* chunk being filled (newest) */
  const ddp_arena_backing *backing; /* NULL: the host heap (ddp_alloc) */
  size_t used_total;         /* bytes handed out since the last reset */
  size_t high_water;         /* largest used_total seen */
  size_t min_chunk;          /* size of a new chunk, at least */
  struct {
    char *at;
    size_t bytes;
  } holes[DDP_ARENA_HOLES];  /* released this cycle, not yet handed out again */
  int n_holes;
} ddp_arena;

void ddp_arena_init(ddp_arena *arena, size_t initial_bytes);
/* An arena whose memory comes from `backing` (kept by pointer; it must
 * outlive the arena). Its memory may not be host-addressable: only the
 * backing's own code touches it, and ASan does not poison it. */
void ddp_arena_init_backed(ddp_arena *arena, size_t initial_bytes,
                           const ddp_arena_backing *backing);
/* Returns `bytes` of memory aligned to 64, or NULL (with last error) when the
 * allocator fails. Memory is not zeroed. */
void *ddp_arena_alloc(ddp_arena *arena, size_t bytes);
void *ddp_arena_calloc(ddp_arena *arena, size_t bytes);
/* Gives back `bytes` at `p` (an allocation of this cycle, or its tail)
 * that nothing will read again before the reset: later allocations of the
 * cycle take their memory from there first (first fit, holes in the order
 * released), so a cycle whose large temporaries die early needs less
 * memory than the sum of them, which keeps a step's working set in cache.
 * With every hole in use the block is simply not reused. Allocations stay
 * 64-byte aligned. In ASan builds the block is poisoned until handed out
 * again. */
void ddp_arena_release(ddp_arena *arena, void *p, size_t bytes);
/* Forgets every allocation. If the last cycle needed more than one chunk, they
 * are merged into one chunk of the high-water size (one allocation), so the
 * next identical cycle fits without allocating. */
void ddp_arena_reset(ddp_arena *arena);
void ddp_arena_free(ddp_arena *arena);

/* ---- Random numbers ------------------------------------------------------
 * xoshiro256** seeded through splitmix64: fast, reproducible across machines,
 * its state a plain value that checkpoints can save. */
typedef struct ddp_rng {
  uint64_t s[4];
} ddp_rng;

void ddp_rng_seed(ddp_rng *rng, uint64_t seed);
uint64_t ddp_rng_next(ddp_rng *rng);
/* Uniform in [0, 1) with 24 random bits. */
float ddp_rng_uniform(ddp_rng *rng);
/* Uniform in [lo, hi). */
float ddp_rng_uniform_range(ddp_rng *rng, float lo, float hi);
/* Standard normal (Box-Muller). */
float ddp_rng_normal(ddp_rng *rng);
/* Uniform integer in [0, n); n > 0. Unbiased (rejection). */
uint64_t ddp_rng_below(ddp_rng *rng, uint64_t n);

/* ---- Time ---------------------------------------------------------------- */
/* Monotonic clock in nanoseconds. */
int64_t ddp_time_ns(void);
/* Monotonic clock in seconds. */
double ddp_time_s(void);

/* ---- Preemption ---------------------------------------------------------- */
/* How long a thread has been kept from running while it was ready to run:
 * runnable, its CPU held by another task (a kernel thread, a daemon, another
 * rank, a loader thread), from Linux's schedstat. A synchronous collective
 * waits for the slowest rank, so a rank preempted for d ms delays every rank
 * by about d ms, whereas a process alone on a machine with an idle core
 * rarely waits at all; ddp-train reports it per step (preempted_ms). Time the
 * thread sleeps (in a futex, in I/O) is not counted. */
typedef struct ddp_preempt_clock {
  int fd; /* /proc/thread-self/schedstat, -1 without one */
} ddp_preempt_clock;
/* Opens the clock of the calling thread (readable from any thread after).
 * Without schedstat (a kernel built without CONFIG_SCHED_INFO, no /proc)
 * the clock reads -1; nothing else can fail. */
void ddp_preempt_clock_open(ddp_preempt_clock *clock);
/* Nanoseconds the thread has waited for a CPU since it started; -1 without
 * schedstat. One pread (under a microsecond): cheap enough for every step. */
int64_t ddp_preempt_clock_ns(const ddp_preempt_clock *clock);
void ddp_preempt_clock_close(ddp_preempt_clock *clock);

/* ---- Environment parameters ---------------------------------------------- */
/* The variable's value, or `fallback` when unset or empty. */
const char *ddp_env_str(const char *name, const char *fallback);
/* Parses the variable as a decimal integer into *out; `fallback` when unset.
 * A malformed value is an error naming the variable and the value. */
ddp_status ddp_env_int(const char *name, int64_t fallback, int64_t *out);
/* Like ddp_env_int, for a floating-point number of seconds or similar. */
ddp_status ddp_env_double(const char *name, double fallback, double *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_CORE_H */
