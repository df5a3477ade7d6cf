/* Biased exclusion of a group's inline calls (docs/comm.md, MPI, "The last
 * 5 % at 8 B").
 *
 * A blocking call that runs on its caller's thread must never overlap an
 * operation the progress thread runs or another thread's call on the same
 * group (collectives are issued in the same order on every rank). The
 * general protocol is pg->active: a compare-and-swap from 0 takes the
 * inline bit, an atomic subtract gives it back, two locked instructions a
 * call (~10 ns of a ~260 ns 8-byte MPI allreduce). Most groups only ever
 * see blocking calls from one thread, so a group starts *biased* towards
 * the first thread that runs a blocking call inline (its owner):
 *
 *   owner (enter):  busy = 1 (plain store); compiler barrier;
 *                   if (!biased) { busy = 0; take the locked path }
 *                   ... the op ...; busy = 0 (release store).
 *   anyone else, before touching pg->active (a queued or async op, another
 *   thread's blocking call, a drainer) revokes the bias once:
 *                   biased = false; membarrier(PRIVATE_EXPEDITED);
 *                   wait until busy == 0 (acquire); revoked = true.
 *
 * Why this excludes: the owner's store of busy and load of biased are the
 * "store buffering" pattern against the revoker's store of biased and load
 * of busy. The membarrier runs a full memory barrier on every thread of
 * the process that is running (one not running has passed the kernel's
 * barrier of its context switch), which with the owner's compiler barrier
 * acts as a fence between its store and its load; with the revoker's own
 * barrier, at least one side sees the other's store. Either the owner sees
 * biased false and backs off (before touching anything) to the locked
 * path, or the revoker sees busy set and waits for the owner's release
 * store, after which everything the op did happens before the revoker goes
 * on. A revoke while the owner is inside a call therefore waits for that
 * call to end (its own deadline bounds it), and from then on every thread,
 * the owner included, uses pg->active: the owner sees biased false on its
 * next call (relaxed load; it needs no order with the revoker, whose
 * accesses to pg->active are all made after `revoked`). The owner never
 * waits for anybody while biased: nobody else runs anything on the group
 * until the bias is revoked. Revokers are serialized by mu; a second one
 * arriving while the first waits waits too (it sees `revoked` false).
 *
 * The owner is named by pthread_self(): a thread that starts after the
 * owner ended may get its id and carry on as the owner, which is sound,
 * since the two never run at once (glibc hands a thread's descriptor on
 * only after the thread exited, under its own lock).
 *
 * The bias is revoked once, never re-armed: a membarrier costs
 * microseconds, so a group that has seen a queued op or a second thread
 * keeps today's locked protocol for good. Where membarrier is unavailable
 * (kernel < 4.14, ENOSYS/EPERM, a seccomp filter), under ThreadSanitizer
 * (which does not model membarrier's ordering) or with DDP_INLINE_BIAS=0,
 * a group starts revoked: the locked protocol only. */
#ifndef DDP_COMM_BIAS_H
#define DDP_COMM_BIAS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"

#if defined(__SANITIZE_THREAD__)
#define DDP__BIAS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DDP__BIAS_TSAN 1
#endif
#endif
#ifndef DDP__BIAS_TSAN
#define DDP__BIAS_TSAN 0
#endif

typedef struct ddp__bias {
  atomic_bool biased;     /* the owner may skip pg->active (cleared first by a revoker) */
  atomic_int busy;        /* the owner is inside a biased call */
  atomic_uintptr_t owner; /* pthread_self() of the owner; 0 before the first call */
  atomic_bool revoked;    /* the revocation is over: pg->active for everybody */
  pthread_mutex_t mu;     /* serializes revokers */
} ddp__bias;

/* Starts `b` biased (no owner yet) when the process can use membarrier and
 * neither TSan nor DDP_INLINE_BIAS=0 says otherwise; revoked otherwise. */
void ddp__bias_init(ddp__bias *b);
void ddp__bias_destroy(ddp__bias *b);
/* Whether this process registered for membarrier (private expedited): the
 * condition of a biased start, besides TSan and DDP_INLINE_BIAS. */
bool ddp__bias_available(void);

/* Ends the bias (membarrier once) and waits, up to timeout_ns, for an
 * owner inside a biased call. DDP_OK once no
 * biased call can run any more; DDP_ERR_TIMEOUT (message set, the bias
 * still not over) when the owner stayed inside past the deadline. The
 * caller must not touch pg->active before it returned DDP_OK. */
ddp_status ddp__bias_revoke_slow(ddp__bias *b, int64_t timeout_ns);

static inline ddp_status ddp__bias_revoke(ddp__bias *b, int64_t timeout_ns) {
  if (atomic_load_explicit(&b->revoked, memory_order_acquire)) return DDP_OK;
  return ddp__bias_revoke_slow(b, timeout_ns);
}

/* ddp__bias_enter without naming the owner: for a bias that only one
 * thread ever enters, by construction (the flight recorder's claim,
 * flight.h), and the owner's entry once ddp__bias_enter has named it. */
static inline bool ddp__bias_enter_sole(ddp__bias *b) {
  atomic_store_explicit(&b->busy, 1, memory_order_relaxed);
  /* Compiler barrier only: the revoker's membarrier supplies the CPU's. */
  atomic_signal_fence(memory_order_seq_cst);
  if (!atomic_load_explicit(&b->biased, memory_order_relaxed)) {
    atomic_store_explicit(&b->busy, 0, memory_order_release);
    return false;
  }
  return true;
}

/* The owner's entry: true when the caller may run its blocking call with
 * no other exclusion (then ddp__bias_exit after it); false: call
 * ddp__bias_revoke (at once when the bias is already over; the owner's own
 * wait, if it is the one that finds the bias being revoked, is for nothing
 * it holds) and then use the locked protocol. The first thread to call it
 * on a biased group becomes the owner. */
static inline bool ddp__bias_enter(ddp__bias *b) {
  if (!atomic_load_explicit(&b->biased, memory_order_relaxed)) return false;
  uintptr_t me = (uintptr_t)pthread_self();
  uintptr_t owner = atomic_load_explicit(&b->owner, memory_order_relaxed);
  if (owner != me) {
    uintptr_t none = 0;
    if (owner != 0 || !atomic_compare_exchange_strong(&b->owner, &none, me)) return false;
  }
  return ddp__bias_enter_sole(b);
}

static inline void ddp__bias_exit(ddp__bias *b) {
  atomic_store_explicit(&b->busy, 0, memory_order_release);
}

#endif
