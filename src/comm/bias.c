/* Biased exclusion of a group's inline calls: the rare side (bias.h). */
#include "comm/bias.h"

#include <errno.h>
#include <linux/membarrier.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static pthread_once_t registered_once = PTHREAD_ONCE_INIT;
static bool registered;

static int membarrier(int cmd) {
#ifdef __NR_membarrier
  return (int)syscall(__NR_membarrier, cmd, 0, 0);
#else
  (void)cmd;
  errno = ENOSYS;
  return -1;
#endif
}

/* Registration is per process and permanent; a kernel or filter that
 * refuses either call leaves the process on the locked protocol. */
static void register_membarrier(void) {
  int cmds = membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) ||
      !(cmds & MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED))
    return;
  registered = membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

bool ddp__bias_available(void) {
  pthread_once(&registered_once, register_membarrier);
  return registered;
}

void ddp__bias_init(ddp__bias *b) {
  const char *env = getenv("DDP_INLINE_BIAS");
  bool want = !DDP__BIAS_TSAN && !(env && !strcmp(env, "0")) && ddp__bias_available();
  atomic_init(&b->biased, want);
  atomic_init(&b->busy, 0);
  atomic_init(&b->owner, 0);
  atomic_init(&b->revoked, !want);
  pthread_mutex_init(&b->mu, NULL);
}

void ddp__bias_destroy(ddp__bias *b) { pthread_mutex_destroy(&b->mu); }

ddp_status ddp__bias_revoke_slow(ddp__bias *b, int64_t timeout_ns) {
  /* The owner's call ends by its own deadline (the group's timeout);
   * 5 s of slack for it to notice, saturating. */
  int64_t now = ddp_time_ns(), slack = 5000000000LL;
  int64_t deadline_ns = timeout_ns > INT64_MAX - slack - now ? INT64_MAX : now + timeout_ns + slack;
  pthread_mutex_lock(&b->mu);
  if (atomic_load_explicit(&b->biased, memory_order_relaxed)) {
    atomic_store(&b->biased, false);
    /* Registered at init (biased starts true only then), so this cannot
     * fail with EPERM; if the kernel still refuses, the owner's next
     * load of `biased` could miss the store, and exclusion would rest on
     * luck: stop rather than issue collectives out of order. */
    int rc = membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
    /* A child of fork() has a new address space, not registered: register
     * it (it has one thread, ours, so nobody else can be biased there). */
    if (rc != 0 && errno == EPERM && membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0)
      rc = membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED);
    if (rc != 0) {
      fprintf(stderr, "ddp: membarrier(PRIVATE_EXPEDITED) failed after registration: %s; "
                      "set DDP_INLINE_BIAS=0 to run without it\n", strerror(errno));
      abort();
    }
  }
  /* The owner inside a biased call: its op ends by its own deadline. */
  long pause_ns = 1000;
  while (atomic_load_explicit(&b->busy, memory_order_acquire) != 0) {
    if (ddp_time_ns() >= deadline_ns) {
      pthread_mutex_unlock(&b->mu);
      return ddp_error(DDP_ERR_TIMEOUT, "process group: a blocking call on another thread did not "
                                        "finish in time (waiting to queue behind it)");
    }
    struct timespec ts = {0, pause_ns};
    nanosleep(&ts, NULL);
    if (pause_ns < 1000000) pause_ns *= 2;
  }
  atomic_store_explicit(&b->revoked, true, memory_order_release);
  pthread_mutex_unlock(&b->mu);
  return DDP_OK;
}
