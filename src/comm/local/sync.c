/* The local backend's waits: spin briefly, yield a few times, then sleep in
 * a futex on the word's `wake` counter, so ranks that outnumber the cores do
 * not starve each other. Every sleep is bounded (a few ms), and each wake-up checks the
 * deadline, abort, and the other ranks' states and processes, so a dead or
 * failed peer fails the wait within milliseconds whatever the timeout. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm/local/local.h"

/* Longest single sleep: bounds how late abort, deadline and death are seen
 * when no post wakes the waiter. */
#define SLEEP_SLICE_NS (5 * 1000 * 1000LL)
/* How often a sleeping waiter asks the provider whether peers still exist. */
#define LIVENESS_PERIOD_NS (20 * 1000 * 1000LL)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static void futex_wait(ddp__local_backend *b, _Atomic uint32_t *word, uint32_t expected,
                       int64_t timeout_ns) {
  struct timespec ts = {timeout_ns / 1000000000LL, timeout_ns % 1000000000LL};
  int op = b->mem->shared_futex ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE;
  syscall(SYS_futex, (uint32_t *)word, op, expected, &ts, NULL, 0);
}

static void futex_wake(ddp__local_backend *b, _Atomic uint32_t *word) {
  int op = b->mem->shared_futex ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE;
  syscall(SYS_futex, (uint32_t *)word, op, INT_MAX, NULL, NULL, 0);
}

void ddp__local_post(ddp__local_backend *b, ddp__local_word *w, uint64_t value) {
  atomic_store_explicit(&w->value, value, memory_order_release);
  atomic_fetch_add(&w->wake, 1);
  if (atomic_load(&w->sleepers) != 0) futex_wake(b, &w->wake);
}

static const char *host_of(const ddp__local_backend *b, int rank) {
  const char *h = b->host_names ? b->host_names[rank] : NULL;
  return h ? h : "local";
}

static const char *op_name(const ddp__op_ctx *ctx) { return ctx && ctx->op ? ctx->op : "op"; }
static unsigned long long op_seq(const ddp__op_ctx *ctx) { return ctx ? ctx->seq : 0; }

static bool is_aborted(ddp__local_backend *b, const ddp__op_ctx *ctx) {
  return atomic_load(&b->aborted) || (ctx && ctx->aborted && atomic_load(ctx->aborted));
}

ddp_status ddp__local_fail(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp_status st) {
  ddp__local_ctl *me = ddp__local_ctl_of(b->reg, b->rank);
  uint32_t active = DDP__LOCAL_ACTIVE;
  uint32_t state = st == DDP_ERR_ABORTED ? DDP__LOCAL_ABORTED : DDP__LOCAL_FAILED;
  atomic_store(&me->failed_seq, op_seq(ctx));
  atomic_store(&me->blame, (int32_t)b->blame);
  b->blame = -1;
  if (b->failed == DDP_OK) {
    b->failed = st;
    snprintf(b->failed_msg, sizeof b->failed_msg, "%s", ddp_last_error());
  }
  if (atomic_compare_exchange_strong(&me->state, &active, state)) {
    /* Peers sleeping on this rank's flag learn at once. */
    atomic_fetch_add(&me->flag.wake, 1);
    futex_wake(b, &me->flag.wake);
  }
  ddp__local_linger(b);
  return st;
}

ddp_status ddp__local_check_failed(ddp__local_backend *b, const ddp__op_ctx *ctx) {
  if (b->failed == DDP_OK && is_aborted(b, ctx)) {
    b->blame = -1;
    ddp__local_fail(b, ctx,
                    ddp_error(DDP_ERR_ABORTED, "%s #%llu: aborted", op_name(ctx), op_seq(ctx)));
  }
  if (b->failed == DDP_OK) return DDP_OK;
  return ddp_error(b->failed, "%s", b->failed_msg);
}

/* DDP_OK while every other rank is usable for this wait; otherwise the
 * error naming the first rank that is not. `peer` is the rank waited for:
 * only its leaving matters (others may leave once done with us). */
static ddp_status check_peers(ddp__local_backend *b, const ddp__op_ctx *ctx, int peer,
                              bool check_processes) {
  /* Processes first: when a rank dies, name it rather than a peer that
   * failed because of it. */
  if (check_processes && b->mem->ops->find_dead) {
    char why[128] = "";
    int dead = b->mem->ops->find_dead(b->mem, why, sizeof why);
    if (dead >= 0) {
      b->blame = ddp__local_group_rank(b, dead);
      return ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) died (%s)", op_name(ctx),
                       op_seq(ctx), b->blame, host_of(b, dead), why);
    }
  }
  for (int q = 0; q < b->size; q++) {
    if (q == b->rank) continue;
    ddp__local_ctl *c = ddp__local_ctl_of(b->reg, q);
    uint32_t state = atomic_load(&c->state);
    if (state == DDP__LOCAL_ACTIVE || (state == DDP__LOCAL_LEFT && q != peer)) continue;
    const char *why = state == DDP__LOCAL_ABORTED ? "aborted"
                      : state == DDP__LOCAL_LEFT  ? "left the group (destroyed its backend)"
                                                  : "failed";
    int32_t blame = atomic_load(&c->blame);
    if (state == DDP__LOCAL_FAILED && ddp__local_blame_valid(b, blame)) {
      b->blame = blame;
      return ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) died or failed (reported by rank %d)",
                       op_name(ctx), op_seq(ctx), blame, ddp__local_group_host(b, blame),
                       ddp__local_group_rank(b, q));
    }
    b->blame = ddp__local_group_rank(b, q);
    if (state == DDP__LOCAL_FAILED)
      return ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) failed (its op #%llu failed)",
                       op_name(ctx), op_seq(ctx), b->blame, host_of(b, q),
                       (unsigned long long)atomic_load(&c->failed_seq));
    return ddp_error(DDP_ERR_PEER, "%s #%llu: rank %d (%s) %s", op_name(ctx), op_seq(ctx),
                     b->blame, host_of(b, q), why);
  }
  return DDP_OK;
}

/* Adaptive spinning. Ranks that the scheduler stacks on one core (unpinned
 * ranks on a machine where something else keeps the other cores busy) look
 * like ranks with a core each to the affinity check in local/local.c, but every
 * wait then spins in vain, since the peer cannot run until this rank stops:
 * such waits end in the yield phase, right after handing the core over.
 * After STACKED_STREAK waits in a row ended there, waits spin only
 * DDP__LOCAL_SPIN_SHORT times; every PROBE_PERIOD waits one long spin
 * probes whether that is still so (a wait that succeeds while spinning
 * restores long spins; one that ends in the yield phase again keeps them
 * short). Waits that end in the futex (a peer busy computing) say nothing
 * about cores and change nothing. Neither do waits that skipped their
 * blocked spin because the CPU was contended (they reach the yields by
 * design, whatever the placement), nor any wait of ranks bound to a CPU each
 * (the scheduler cannot stack those). Without these two exceptions one
 * preemption during a blocked spin could shorten a bound rank's spins for the
 * rest of a run: the contended skips that followed ended in the yields,
 * eight of them made spins short, short spins turned the blocked spin off
 * and with it the countdown of the skips, so every probe fell back again,
 * and a 2-rank allreduce ran flat at about 2 GB/s from 64 KiB up in one run
 * of ten (issue 20). */
#define STACKED_STREAK 8u
#define PROBE_PERIOD 256u

static void spin_adapt_before(ddp__local_backend *b) {
  if (b->spin_iters < b->spin_long && ++b->short_waits >= PROBE_PERIOD) {
    b->spin_iters = b->spin_long;
    b->short_waits = 0;
    b->yield_streak = STACKED_STREAK - 1;
  }
}

void ddp__local_wait_ended_in_yield(ddp__local_backend *b, bool skipped_spin) {
  if (skipped_spin || b->pinned_apart) return;
  if (b->spin_iters > DDP__LOCAL_SPIN_SHORT && ++b->yield_streak >= STACKED_STREAK) {
    b->spin_iters = DDP__LOCAL_SPIN_SHORT;
    b->short_waits = 0;
  }
}

/* Spins up to DDP__LOCAL_SPIN_BLOCKED_NS more (only called while ranks have
 * a CPU each and the caller is blocked in the op); true once w reached
 * target. Reads the clock every 64 pauses, and stops early on abort. */
static bool spin_blocked(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp__local_word *w,
                         uint64_t target) {
  const int64_t until = ddp_time_ns() + DDP__LOCAL_SPIN_BLOCKED_NS;
  for (;;) {
    for (int i = 0; i < 64; i++) {
      cpu_relax();
      if (atomic_load_explicit(&w->value, memory_order_acquire) >= target) return true;
    }
    if (ddp_time_ns() >= until || is_aborted(b, ctx)) return false;
  }
}

/* Blocked spins on a CPU that other tasks want. A bound rank cannot move
 * off a core that another process keeps busy, and a blocked spin there
 * spends up to 2 ms of the rank's share of that core on nothing: the
 * scheduler preempts the spinner to run the other task, and the rank is
 * behind when its peer's data arrives. So a blocked spin during which this
 * thread was preempted (its involuntary context switches,
 * getrusage(RUSAGE_THREAD), went up) sends the next CONTENDED_SKIP blocked
 * waits straight to the yield and futex phases; the wait after them spins
 * again, probing whether the CPU is still contended. A rank that has its CPU
 * to itself is not preempted while it spins, and spins as before. On the
 * 2-vCPU VM under other sessions' load (load average 7-9), 2 bound ranks, 5
 * rounds in one go: allreduce 2 MiB 6.4 -> 4.4 ms, 16 MiB 27 -> 15 ms,
 * 64 MiB 68 -> 58 ms, 8 B unchanged (BENCHMARKS.md, "Where the ranks run"). */
#define CONTENDED_SKIP 128u

static long thread_preemptions(void) {
  struct rusage ru;
  return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : -1;
}

ddp_status ddp__local_wait(ddp__local_backend *b, const ddp__op_ctx *ctx, ddp__local_word *w,
                           uint64_t target, int peer) {
  if (atomic_load_explicit(&w->value, memory_order_acquire) >= target) return DDP_OK;
  spin_adapt_before(b);
  for (int i = 0; i < b->spin_iters; i++) {
    cpu_relax();
    if (atomic_load_explicit(&w->value, memory_order_acquire) >= target) {
      b->yield_streak = 0;
      return DDP_OK;
    }
  }
  bool skipped_spin = false;
  if (ctx && ctx->caller_blocked && b->spin_iters == DDP__LOCAL_SPIN_LONG) {
    if (b->contended_skips > 0) {
      b->contended_skips--;
      b->waits_contended++;
      skipped_spin = true;
    } else {
      long before = thread_preemptions();
      b->waits_spun_blocked++;
      bool met = spin_blocked(b, ctx, w, target);
      long after = thread_preemptions();
      if (before >= 0 && after > before) b->contended_skips = CONTENDED_SKIP;
      if (met) {
        b->yield_streak = 0;
        return DDP_OK;
      }
    }
  }
  /* Then yield a few times: on a busy machine the peer may be waiting for
   * this core, and a yield hands it over without a futex round trip. */
  for (int i = 0; i < b->yield_iters; i++) {
    sched_yield();
    if (atomic_load_explicit(&w->value, memory_order_acquire) >= target) {
      ddp__local_wait_ended_in_yield(b, skipped_spin);
      return DDP_OK;
    }
  }
  int64_t deadline = ctx ? ctx->deadline_ns : 0;
  int64_t next_liveness = 0;
  b->waits_slept++;
  for (;;) {
    if (is_aborted(b, ctx)) {
      b->blame = -1;
      return ddp__local_fail(b, ctx,
                             ddp_error(DDP_ERR_ABORTED, "%s #%llu: aborted", op_name(ctx),
                                       op_seq(ctx)));
    }
    int64_t now = ddp_time_ns();
    if (deadline > 0 && now >= deadline) {
      b->blame = -1;
      return ddp__local_fail(
          b, ctx,
          ddp_error(DDP_ERR_TIMEOUT, "%s #%llu: timed out waiting for rank %d (%s)",
                    op_name(ctx), op_seq(ctx), ddp__local_group_rank(b, peer), host_of(b, peer)));
    }
    bool check_processes = now >= next_liveness;
    if (check_processes) next_liveness = now + LIVENESS_PERIOD_NS;
    ddp_status st = check_peers(b, ctx, peer, check_processes);
    /* A rank that posted and then failed or died still counts as posted. */
    if (atomic_load(&w->value) >= target) return DDP_OK;
    if (st != DDP_OK) return ddp__local_fail(b, ctx, st);

    atomic_fetch_add(&w->sleepers, 1);
    uint32_t seen = atomic_load(&w->wake);
    if (atomic_load(&w->value) >= target) {
      atomic_fetch_sub(&w->sleepers, 1);
      return DDP_OK;
    }
    int64_t slice = SLEEP_SLICE_NS;
    if (deadline > 0 && deadline - now < slice) slice = deadline - now;
    if (slice < 1000) slice = 1000;
    futex_wait(b, &w->wake, seen, slice);
    atomic_fetch_sub(&w->sleepers, 1);
    if (atomic_load_explicit(&w->value, memory_order_acquire) >= target) return DDP_OK;
  }
}

ddp_status ddp__local_wait_flag(ddp__local_backend *b, const ddp__op_ctx *ctx, int q,
                                uint64_t target) {
  if (b->seen[q] >= target) return DDP_OK;
  ddp__local_word *w = &ddp__local_ctl_of(b->reg, q)->flag;
  DDP_TRY(ddp__local_wait(b, ctx, w, target, q));
  b->seen[q] = atomic_load_explicit(&w->value, memory_order_acquire);
  return DDP_OK;
}

ddp_status ddp__local_wait_all(ddp__local_backend *b, const ddp__op_ctx *ctx, uint64_t target) {
  for (int i = 1; i < b->size; i++) {
    int q = (b->rank + i) % b->size;
    DDP_TRY(ddp__local_wait_flag(b, ctx, q, target));
  }
  return DDP_OK;
}

void ddp__local_wake_all(ddp__local_backend *b) {
  ddp__local_region *reg = b->reg;
  for (int q = 0; q < b->size; q++) {
    ddp__local_ctl *c = ddp__local_ctl_of(reg, q);
    atomic_fetch_add(&c->flag.wake, 1);
    futex_wake(b, &c->flag.wake);
    atomic_fetch_add(&c->p2p_bell.wake, 1);
    futex_wake(b, &c->p2p_bell.wake);
    for (int p = 0; p < b->size; p++) {
      ddp__local_p2p_chan *ch = ddp__local_chan_of(reg, q, p);
      for (unsigned s = 0; s < DDP__LOCAL_P2P_SLOTS; s++) {
        if (atomic_load(&ch->slot[s].posted.sleepers)) futex_wake(b, &ch->slot[s].posted.wake);
        if (atomic_load(&ch->slot[s].consumed.sleepers))
          futex_wake(b, &ch->slot[s].consumed.wake);
      }
    }
  }
}

void ddp__local_bell_ring(ddp__local_backend *b, int q) {
  ddp__local_word *w = &ddp__local_ctl_of(b->reg, q)->p2p_bell;
  atomic_fetch_add(&w->wake, 1);
  if (atomic_load(&w->sleepers) != 0) futex_wake(b, &w->wake);
}

void ddp__local_bell_wait(ddp__local_backend *b, uint32_t seen, int64_t ns) {
  ddp__local_word *w = &ddp__local_ctl_of(b->reg, b->rank)->p2p_bell;
  if (ns <= 0) return;
  atomic_fetch_add(&w->sleepers, 1);
  if (atomic_load(&w->wake) == seen) futex_wait(b, &w->wake, seen, ns);
  atomic_fetch_sub(&w->sleepers, 1);
}
