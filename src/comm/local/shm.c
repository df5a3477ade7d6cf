/* The local backend's "shm" memory provider: ranks are processes of one
 * host. Rank 0 creates a POSIX shared-memory segment holding the region and
 * publishes its name through the group's store; the last rank to map it
 * unlinks it, so nothing is left in /dev/shm even if a rank is killed later;
 * a kill before then leaves it, and ddprun removes what its dead workers
 * left (ddp_comm_shm_remove_orphans).
 * Collectives go through staging areas in the segment (local/local.c); large
 * point-to-point messages are read straight from the sender's buffer with
 * cross-memory attach (process_vm_readv: one copy, by the kernel) where it
 * is permitted. A pidfd per peer process tells a waiter within
 * milliseconds that a peer died. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "comm/local/local.h"
#include "ddp/store.h"

#define SEGMENT_KEY "local/shm"

typedef struct shm_mem {
  ddp__local_mem base;
  size_t bytes;
  int rank, size;
  int32_t *pid;     /* [size] */
  int *pidfd;       /* [size] -1: same process, or no pidfd (kill(pid, 0) then) */
  int lock_fd;      /* rank 0: the segment, write-locked until every rank mapped it; -1 */
  char name[64];
} shm_mem;

static shm_mem *as_shm(ddp__local_mem *m) { return (shm_mem *)m; }

/* ---- One mapping per segment and process ----------------------------------
 * Ranks that are threads of one process (a world of processes x threads)
 * share one mapping of their group's segment instead of mapping it once
 * each. Besides saving address space, it keeps their synchronisation
 * visible to ThreadSanitizer: with two mappings, a rank's release store
 * through one and its peer's acquire load through the other are different
 * addresses, so the peer's later read of the rank's user buffer (a large
 * point-to-point message) looked like a race. The kernel orders the two
 * mappings' accesses alike; only the tool could not see it. */
typedef struct mapping {
  struct mapping *next;
  char name[64];
  void *addr;
  size_t bytes;
  int refs;
} mapping;

static pthread_mutex_t mappings_mu = PTHREAD_MUTEX_INITIALIZER;
static mapping *mappings;

/* Under mappings_mu: this process's mapping of `name`, with one more ref. */
static void *mapping_find(const char *name, size_t bytes) {
  for (mapping *m = mappings; m; m = m->next)
    if (strcmp(m->name, name) == 0 && m->bytes == bytes) {
      m->refs++;
      return m->addr;
    }
  return NULL;
}

/* Under mappings_mu: records a fresh mapping (one ref). On failure to record
 * it the mapping still works, unshared. */
static void mapping_add(const char *name, void *addr, size_t bytes) {
  mapping *m = ddp_calloc(1, sizeof *m);
  if (!m) return;
  snprintf(m->name, sizeof m->name, "%s", name);
  m->addr = addr;
  m->bytes = bytes;
  m->refs = 1;
  m->next = mappings;
  mappings = m;
}

static void mapping_release(void *addr, size_t bytes) {
  pthread_mutex_lock(&mappings_mu);
  bool last = true;
  for (mapping **pm = &mappings; *pm; pm = &(*pm)->next) {
    mapping *m = *pm;
    if (m->addr != addr) continue;
    last = --m->refs == 0;
    if (last) {
      *pm = m->next;
      ddp_free(m);
    }
    break;
  }
  if (last) munmap(addr, bytes);
  pthread_mutex_unlock(&mappings_mu);
}

/* One cross-memory copy, looping over partial transfers. */
static ddp_status cma_copy(shm_mem *s, int peer, uint64_t addr, void *local, size_t bytes,
                           bool write) {
  pid_t pid = s->pid[peer];
  if (pid == getpid()) {
    if (!bytes) return DDP_OK;
    if (write)
      memcpy((void *)(uintptr_t)addr, local, bytes);
    else
      memcpy(local, (const void *)(uintptr_t)addr, bytes);
    return DDP_OK;
  }
  size_t done = 0;
  while (done < bytes) {
    struct iovec l = {(char *)local + done, bytes - done};
    struct iovec r = {(void *)(uintptr_t)(addr + done), bytes - done};
    ssize_t n = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                      : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = n < 0 ? errno : EFAULT;
      if (e == ESRCH) return ddp_error(DDP_ERR_PEER, "process %d is gone", (int)pid);
      return ddp_error(DDP_ERR_SYS, "%s %zu bytes at 0x%" PRIx64 " of rank %d (process %d): %s",
                       write ? "process_vm_writev of" : "process_vm_readv of", bytes - done,
                       addr + done, peer, (int)pid, strerror(e));
    }
    done += (size_t)n;
  }
  return DDP_OK;
}

static ddp_status shm_read(ddp__local_mem *m, int peer, uint64_t addr, void *dst, size_t bytes) {
  return cma_copy(as_shm(m), peer, addr, dst, bytes, false);
}

static ddp_status shm_write(ddp__local_mem *m, int peer, uint64_t addr, const void *src,
                            size_t bytes) {
  return cma_copy(as_shm(m), peer, addr, (void *)src, bytes, true);
}

static ddp_status shm_view(ddp__local_mem *m, int peer, uint64_t addr, size_t bytes,
                           void *scratch, const void **out) {
  shm_mem *s = as_shm(m);
  if (s->pid[peer] == getpid()) {
    *out = (const void *)(uintptr_t)addr;
    return DDP_OK;
  }
  *out = scratch;
  return cma_copy(s, peer, addr, scratch, bytes, false);
}

static int shm_find_dead(ddp__local_mem *m, char *why, size_t why_bytes) {
  shm_mem *s = as_shm(m);
  for (int q = 0; q < s->size; q++) {
    if (q == s->rank || s->pid[q] == getpid()) continue;
    if (atomic_load(&ddp__local_ctl_of(s->base.region, q)->state) != DDP__LOCAL_ACTIVE) continue;
    bool dead;
    if (s->pidfd[q] >= 0) {
      struct pollfd p = {s->pidfd[q], POLLIN, 0};
      dead = poll(&p, 1, 0) > 0;
    } else {
      dead = kill(s->pid[q], 0) != 0 && errno == ESRCH;
    }
    if (dead) {
      snprintf(why, why_bytes, "process %d is gone", (int)s->pid[q]);
      return q;
    }
  }
  return -1;
}

static const char *shm_transport(const ddp__local_mem *m, int peer) {
  const shm_mem *s = (const shm_mem *)m;
  return s->pid[peer] == getpid() ? "threads" : "shm";
}

static void shm_destroy(ddp__local_mem *m) {
  if (!m) return;
  shm_mem *s = as_shm(m);
  if (s->base.region) mapping_release(s->base.region, s->bytes);
  if (s->lock_fd >= 0) close(s->lock_fd);
  if (s->pidfd)
    for (int q = 0; q < s->size; q++)
      if (s->pidfd[q] >= 0) close(s->pidfd[q]);
  ddp_free(s->pidfd);
  ddp_free(s->pid);
  ddp_free(s);
}

static const ddp__local_mem_ops shm_ops = {
    .name = "shm",
    .read = shm_read,
    .write = shm_write,
    .view = shm_view,
    .find_dead = shm_find_dead,
    .transport = shm_transport,
    .destroy = shm_destroy,
};

/* Waits (polling with short sleeps) until every rank's `field` is set. */
/* Whether process pid has exited (a zombie counts as exited). */
static bool process_gone(pid_t pid) {
#ifdef SYS_pidfd_open
  int fd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) {
    struct pollfd p = {fd, POLLIN, 0};
    bool gone = poll(&p, 1, 0) > 0;
    close(fd);
    return gone;
  }
  if (errno == ESRCH) return true;
#endif
  return kill(pid, 0) != 0 && errno == ESRCH;
}

/* Waits (polling with short sleeps) until ready(q) for every rank; fails
 * early when a rank that has attached dies meanwhile. */
static ddp_status wait_all_ranks(ddp__local_region *reg, int size, int64_t deadline,
                                 bool (*ready)(ddp__local_region *, int), const char *what) {
  int64_t next_check = ddp_time_ns() + 20 * 1000000LL;
  for (;;) {
    int missing = -1;
    for (int q = 0; q < size && missing < 0; q++)
      if (!ready(reg, q)) missing = q;
    if (missing < 0) return DDP_OK;
    int64_t now = ddp_time_ns();
    if (now >= deadline)
      return ddp_error(DDP_ERR_TIMEOUT, "local backend: rank %d did not %s in time", missing,
                       what);
    if (now >= next_check) {
      next_check = now + 20 * 1000000LL;
      for (int q = 0; q < size; q++) {
        pid_t pid = atomic_load_explicit(&ddp__local_ctl_of(reg, q)->pid, memory_order_relaxed);
        if (pid > 0 && pid != getpid() && process_gone(pid))
          return ddp_error(DDP_ERR_PEER,
                           "local backend: rank %d died (process %d is gone) while the group "
                           "was being created",
                           q, (int)pid);
      }
    }
    struct timespec ts = {0, 100 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* Every rank increments `attached` after writing its pid, addr[0] and cpus, and
 * an acquire load that reads the last increment synchronises with every
 * rank's (increments extend each other's release sequences), so after it
 * these fields of every rank may be read plainly. (Polling a peer's addr[0]
 * or pid before that point would race with the peer writing them; the
 * liveness check in wait_all_ranks reads pid atomically for that reason, a
 * race ThreadSanitizer found with 2 processes x 2 threads.) */
static bool has_attached(ddp__local_region *reg, int q) {
  (void)q;
  return atomic_load_explicit(&reg->attached, memory_order_acquire) >= reg->size;
}

static bool has_probed(ddp__local_region *reg, int q) {
  return atomic_load(&ddp__local_ctl_of(reg, q)->cma_ok) != 0;
}

/* A segment's name: "/" SEGMENT_PREFIX, the pid of the process that
 * created it (rank 0's), "-", and a nonce of 16 hex digits. */
#define SEGMENT_PREFIX "ddp-local-"
#define SEGMENT_NAME_FORMAT "/" SEGMENT_PREFIX "%d-%016" PRIx64
#define SEGMENT_NONCE_DIGITS 16

/* Name after /dev/shm/: SEGMENT_PREFIX, decimal pid, "-", 16 hex digits. */
static bool is_segment_name(const char *name) {
  if (strncmp(name, SEGMENT_PREFIX, strlen(SEGMENT_PREFIX)) != 0) return false;
  const char *p = name + strlen(SEGMENT_PREFIX);
  size_t digits = strspn(p, "0123456789");
  if (digits == 0 || p[digits] != '-') return false;
  const char *nonce = p + digits + 1;
  return strlen(nonce) == SEGMENT_NONCE_DIGITS &&
         strspn(nonce, "0123456789abcdef") == SEGMENT_NONCE_DIGITS;
}

int ddp_comm_shm_remove_orphans(int pid) {
  char prefix[48];
  int len = snprintf(prefix, sizeof prefix, SEGMENT_PREFIX "%d-", pid);
  DIR *d = opendir("/dev/shm"); /* where glibc's shm_open keeps them */
  if (!d) return 0;
  int removed = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    /* this pid's prefix (another pid's name differs before the dash), then
     * a whole segment name (an unrelated file does not match) */
    if (strncmp(e->d_name, prefix, (size_t)len) != 0 || !is_segment_name(e->d_name)) continue;
    char name[sizeof e->d_name + 1];
    snprintf(name, sizeof name, "/%s", e->d_name);
    if (shm_unlink(name) == 0) removed++;
  }
  closedir(d);
  return removed;
}

/* ---- Abandoned segments ------------------------------------------------------
 * A segment's name is unlinked once every rank has mapped it, so one stays in
 * /dev/shm only when its group died during setup (every rank killed, or all
 * giving up at once before the unlink). Rank 0 holds an open-file-description
 * write lock on the segment from creation until every rank has mapped it; the
 * kernel drops the lock when the process dies, whatever kills it and in
 * whatever pid namespace. So a segment of ours (this version's magic) that
 * can be write-locked has no creator left: no rank will map it any more. Rank
 * 0 removes such segments before creating its own, under any launcher. */

static bool lock_whole(int fd) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

int ddp__local_shm_remove_abandoned(void) {
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int removed = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!is_segment_name(e->d_name)) continue;
    char name[sizeof e->d_name + 1];
    snprintf(name, sizeof name, "/%s", e->d_name);
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) continue; /* gone meanwhile, or another user's */
    /* Initialised (magic and version written after the creator took its
     * lock) and lockable: abandoned. An older ddp's segment (another
     * version) never took the lock, so it is left alone. */
    struct {
      uint64_t magic;
      uint32_t version;
    } head = {0, 0};
    if (lock_whole(fd) && pread(fd, &head, sizeof head, 0) == (ssize_t)sizeof head &&
        head.magic == DDP__LOCAL_MAGIC && head.version == DDP__LOCAL_VERSION &&
        shm_unlink(name) == 0)
      removed++;
    close(fd); /* drops the lock */
  }
  closedir(d);
  return removed;
}

/* Maps the segment: rank 0 creates it and publishes its name. */
static ddp_status map_segment(const ddp__backend_config *cfg, shm_mem *s, int64_t timeout_ms) {
  int fd = -1;
  if (cfg->rank == 0) {
    int abandoned = ddp__local_shm_remove_abandoned();
    if (abandoned > 0)
      DDP_INFO("local backend: removed %d shared-memory segment%s in /dev/shm that a group "
               "killed during its setup left behind", abandoned, abandoned == 1 ? "" : "s");
    uint64_t nonce = (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 20) ^ (uintptr_t)s;
    snprintf(s->name, sizeof s->name, SEGMENT_NAME_FORMAT, (int)getpid(), nonce);
    fd = shm_open(s->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      return ddp_error(DDP_ERR_SYS, "local backend: shm_open(\"%s\"): %s", s->name,
                       strerror(errno));
    /* The lock first, the magic after: a sweeper that opened the new, empty
     * file in between holds the lock for a moment and finds no magic. */
    bool locked = false;
    for (int tries = 0; tries < 1000 && !(locked = lock_whole(fd)) && errno == EAGAIN; tries++) {
      struct timespec ts = {0, 1000 * 1000};
      nanosleep(&ts, NULL);
    }
    if (!locked) {
      int e = errno;
      close(fd);
      shm_unlink(s->name);
      return ddp_error(DDP_ERR_SYS, "local backend: locking \"%s\": %s", s->name, strerror(e));
    }
    if (ftruncate(fd, (off_t)s->bytes) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(s->name);
      return ddp_error(DDP_ERR_SYS, "local backend: sizing \"%s\" to %zu bytes: %s", s->name,
                       s->bytes, strerror(e));
    }
    void *p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      close(fd);
      shm_unlink(s->name);
      return ddp_error(DDP_ERR_SYS, "local backend: mapping \"%s\": %s", s->name, strerror(e));
    }
    s->lock_fd = fd; /* held until every rank has mapped it */
    s->base.region = p;
    ddp__local_region_init(p, cfg->size, nonce);
    pthread_mutex_lock(&mappings_mu);
    mapping_add(s->name, p, s->bytes);
    pthread_mutex_unlock(&mappings_mu);
    ddp_status st = ddp_store_set(cfg->store, SEGMENT_KEY, s->name, strlen(s->name));
    if (st != DDP_OK) {
      shm_unlink(s->name);
      return ddp_error_wrap(st, "local backend: publishing the shared-memory segment");
    }
    return DDP_OK;
  }
  void *value = NULL;
  size_t value_bytes = 0;
  ddp_status st = ddp_store_get(cfg->store, SEGMENT_KEY, timeout_ms, &value, &value_bytes);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "local backend: rank %d waiting for rank 0's segment", cfg->rank);
  if (value_bytes == 0 || value_bytes >= sizeof s->name) {
    ddp_free(value);
    return ddp_error(DDP_ERR_FORMAT, "local backend: malformed segment name");
  }
  memcpy(s->name, value, value_bytes + 1);
  ddp_free(value);
  /* A rank of this process mapped it already: share that mapping. */
  pthread_mutex_lock(&mappings_mu);
  void *p = mapping_find(s->name, s->bytes);
  if (!p) {
    fd = shm_open(s->name, O_RDWR, 0600);
    if (fd < 0) {
      pthread_mutex_unlock(&mappings_mu);
      return ddp_error(DDP_ERR_SYS, "local backend: shm_open(\"%s\"): %s", s->name,
                       strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != s->bytes) {
      close(fd);
      pthread_mutex_unlock(&mappings_mu);
      return ddp_error(DDP_ERR_FORMAT, "local backend: segment \"%s\" has %lld bytes, expected %zu",
                       s->name, (long long)sb.st_size, s->bytes);
    }
    p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      pthread_mutex_unlock(&mappings_mu);
      return ddp_error(DDP_ERR_SYS, "local backend: mapping \"%s\": %s", s->name,
                       strerror(errno));
    }
    mapping_add(s->name, p, s->bytes);
  }
  pthread_mutex_unlock(&mappings_mu);
  s->base.region = p;
  ddp__local_region *reg = p;
  if (reg->magic != DDP__LOCAL_MAGIC || reg->version != DDP__LOCAL_VERSION ||
      reg->size != (uint32_t)cfg->size)
    return ddp_error(DDP_ERR_FORMAT, "local backend: segment \"%s\" is not a %d-rank region",
                     s->name, cfg->size);
  return DDP_OK;
}

ddp_status ddp__local_shm_create(const ddp__backend_config *cfg, ddp__local_mem **out) {
  *out = NULL;
  int64_t timeout_ms = cfg->timeout_ns > 0 ? cfg->timeout_ns / 1000000 : -1;
  int64_t deadline = ddp_time_ns() + (cfg->timeout_ns > 0 ? cfg->timeout_ns : INT64_MAX / 2);
  shm_mem *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
  s->base.ops = &shm_ops;
  s->lock_fd = -1;
  s->base.shared_futex = true;
  s->base.staged = true;
  s->rank = cfg->rank;
  s->size = cfg->size;
  s->bytes = ddp__local_region_bytes(cfg->size);
  s->pid = ddp_calloc((size_t)cfg->size, sizeof *s->pid);
  s->pidfd = ddp_calloc((size_t)cfg->size, sizeof *s->pidfd);
  ddp_status st = DDP_OK;
  if (!s->pid || !s->pidfd) {
    st = ddp_error(DDP_ERR_NOMEM, "local backend: out of memory");
    goto err;
  }
  for (int q = 0; q < cfg->size; q++) s->pidfd[q] = -1;

  st = map_segment(cfg, s, timeout_ms);
  if (st != DDP_OK) goto err;
  ddp__local_region *reg = s->base.region;
  ddp__local_ctl *me = ddp__local_ctl_of(reg, cfg->rank);
  atomic_store_explicit(&me->pid, (int32_t)getpid(), memory_order_relaxed);
  /* addr[0] until the first op: where this process mapped the region, so
   * peers can check that cross-memory attach reaches it. */
  me->addr[0] = (uint64_t)(uintptr_t)reg;
  ddp__local_publish_cpus(me);
  if (atomic_fetch_add(&reg->attached, 1) + 1 == (uint32_t)cfg->size) shm_unlink(s->name);
  st = wait_all_ranks(reg, cfg->size, deadline, has_attached, "map the shared-memory segment");
  if (st != DDP_OK) {
    shm_unlink(s->name); /* whoever gives up removes it; ENOENT is fine */
    goto err;
  }
  if (s->lock_fd >= 0) { /* the name is gone: nothing left to protect */
    close(s->lock_fd);
    s->lock_fd = -1;
  }

  /* Peers' processes: a pidfd each (death shows as readable), and a probe
   * read of their mapping's magic through cross-memory attach. */
  bool cma_ok = true;
  int cma_errno = 0, cma_peer = -1;
  for (int q = 0; q < cfg->size; q++) {
    ddp__local_ctl *c = ddp__local_ctl_of(reg, q);
    s->pid[q] = atomic_load_explicit(&c->pid, memory_order_relaxed);
    if (q == cfg->rank || s->pid[q] == getpid()) continue;
#ifdef SYS_pidfd_open
    s->pidfd[q] = (int)syscall(SYS_pidfd_open, (pid_t)s->pid[q], 0);
#endif
    uint64_t magic = 0;
    struct iovec l = {&magic, sizeof magic};
    struct iovec r = {(void *)(uintptr_t)c->addr[0], sizeof magic};
    if (process_vm_readv(s->pid[q], &l, 1, &r, 1, 0) != (ssize_t)sizeof magic ||
        magic != DDP__LOCAL_MAGIC) {
      if (cma_ok) cma_errno = errno, cma_peer = q;
      cma_ok = false;
    }
  }
  /* DDP_LOCAL_NO_CMA=1 behaves as if it were refused (tests, debugging). */
  const char *no_cma = ddp_env_str("DDP_LOCAL_NO_CMA", "0");
  if (strcmp(no_cma, "0") != 0 && cma_ok) cma_ok = false, cma_errno = EPERM, cma_peer = -1;
  atomic_store(&me->cma_ok, cma_ok ? 1u : 2u);
  st = wait_all_ranks(reg, cfg->size, deadline, has_probed, "finish attaching");
  if (st != DDP_OK) goto err;
  /* Cross-memory attach only for point to point's large messages: without
   * it they go through the channel in pieces (collectives never need it). */
  s->base.can_read_peers = true;
  for (int q = 0; q < cfg->size; q++)
    if (atomic_load(&ddp__local_ctl_of(reg, q)->cma_ok) != 1) s->base.can_read_peers = false;
  if (!s->base.can_read_peers)
    DDP_INFO("local backend: cross-memory attach between ranks is not permitted here (%s); "
             "large point-to-point messages go through shared memory in pieces",
             cma_ok ? "on another rank" : strerror(cma_errno));
  (void)cma_peer;
  *out = &s->base;
  return DDP_OK;
err:
  shm_destroy(&s->base);
  return st;
}
