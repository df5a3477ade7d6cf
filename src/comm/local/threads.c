/* The local backend's "threads" memory provider: every rank is a thread of
 * one process, so peers' buffers are plain pointers. Rank 0 allocates the
 * region and publishes its address (with its pid and a nonce, so a rank of
 * another process cannot mistake it for its own memory) through the group's
 * store; the last rank to let go of the region frees it. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/local/local.h"
#include "ddp/store.h"

#define REGION_KEY "local/threads"

typedef struct threads_mem {
  ddp__local_mem base;
} threads_mem;

static ddp_status threads_read(ddp__local_mem *m, int peer, uint64_t addr, void *dst,
                               size_t bytes) {
  if (bytes) memcpy(dst, (const void *)(uintptr_t)addr, bytes);
  return DDP_OK;
}

static ddp_status threads_write(ddp__local_mem *m, int peer, uint64_t addr, const void *src,
                                size_t bytes) {
  if (bytes) memcpy((void *)(uintptr_t)addr, src, bytes);
  return DDP_OK;
}

static ddp_status threads_view(ddp__local_mem *m, int peer, uint64_t addr, size_t bytes,
                               void *scratch, const void **out) {
  *out = (const void *)(uintptr_t)addr;
  return DDP_OK;
}

static const char *threads_transport(const ddp__local_mem *m, int peer) { return "threads"; }

static void threads_destroy(ddp__local_mem *m) {
  if (!m) return;
  ddp__local_region *reg = m->region;
  if (reg && atomic_fetch_sub(&reg->refs, 1) == 1) ddp_free(reg);
  ddp_free(m);
}

static const ddp__local_mem_ops threads_ops = {
    .name = "threads",
    .read = threads_read,
    .write = threads_write,
    .view = threads_view,
    .find_dead = NULL,
    .transport = threads_transport,
    .destroy = threads_destroy,
};

ddp_status ddp__local_threads_create(const ddp__backend_config *cfg, ddp__local_mem **out) {
  *out = NULL;
  int64_t timeout_ms = cfg->timeout_ns > 0 ? cfg->timeout_ns / 1000000 : -1;
  ddp__local_region *reg = NULL;
  if (cfg->rank == 0) {
    size_t bytes = ddp__local_region_bytes(cfg->size);
    reg = ddp_calloc(1, bytes);
    if (!reg)
      return ddp_error(DDP_ERR_NOMEM, "local backend: cannot allocate %zu bytes for %d ranks",
                       bytes, cfg->size);
    uint64_t nonce = (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)reg;
    ddp__local_region_init(reg, cfg->size, nonce);
    atomic_store(&reg->refs, (uint32_t)cfg->size);
    char value[96];
    int n = snprintf(value, sizeof value, "%d %" PRIxPTR " %" PRIx64, (int)getpid(),
                     (uintptr_t)reg, nonce);
    ddp_status st = ddp_store_set(cfg->store, REGION_KEY, value, (size_t)n);
    if (st != DDP_OK) {
      ddp_free(reg);
      return ddp_error_wrap(st, "local backend: publishing the threads region");
    }
  } else {
    void *value = NULL;
    size_t value_bytes = 0;
    ddp_status st = ddp_store_get(cfg->store, REGION_KEY, timeout_ms, &value, &value_bytes);
    if (st != DDP_OK)
      return ddp_error_wrap(st, "local backend: rank %d waiting for rank 0's threads region",
                            cfg->rank);
    int pid = 0;
    uintptr_t ptr = 0;
    uint64_t nonce = 0;
    int fields = sscanf(value, "%d %" SCNxPTR " %" SCNx64, &pid, &ptr, &nonce);
    ddp_free(value);
    if (fields != 3)
      return ddp_error(DDP_ERR_FORMAT, "local backend: malformed value of key \"%s\"",
                       REGION_KEY);
    if (pid != (int)getpid())
      return ddp_error(DDP_ERR_STATE,
                       "local backend: ranks 0 and %d were said to be threads of one process, "
                       "but rank 0 runs in process %d and rank %d in %d",
                       cfg->rank, pid, cfg->rank, (int)getpid());
    reg = (ddp__local_region *)ptr;
    if (reg->magic != DDP__LOCAL_MAGIC || reg->nonce != nonce ||
        reg->size != (uint32_t)cfg->size)
      return ddp_error(DDP_ERR_STATE, "local backend: rank 0's threads region is not valid");
  }
  ddp__local_ctl *me = ddp__local_ctl_of(reg, cfg->rank);
  atomic_store_explicit(&me->pid, (int32_t)getpid(), memory_order_relaxed);
  ddp__local_publish_cpus(me);
  atomic_fetch_add(&reg->attached, 1);

  /* Every rank attached (so rank 0 never frees a region someone may still
   * pick up). On a timeout the region stays allocated: a straggler may yet
   * find it through the store. */
  int64_t deadline = ddp_time_ns() + (cfg->timeout_ns > 0 ? cfg->timeout_ns : INT64_MAX / 2);
  while (atomic_load(&reg->attached) < (uint32_t)cfg->size) {
    if (ddp_time_ns() >= deadline)
      return ddp_error(DDP_ERR_TIMEOUT,
                       "local backend: only %u of %d ranks attached to the threads region",
                       atomic_load(&reg->attached), cfg->size);
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
  }

  threads_mem *m = ddp_calloc(1, sizeof *m);
  if (!m) {
    if (atomic_fetch_sub(&reg->refs, 1) == 1) ddp_free(reg);
    return ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
  }
  m->base.ops = &threads_ops;
  m->base.region = reg;
  m->base.shared_futex = false;
  m->base.staged = false;
  m->base.can_read_peers = true;
  *out = &m->base;
  return DDP_OK;
}
