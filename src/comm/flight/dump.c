/* The flight recorder's dumps: the process's registry of rings, the
 * triggers (a group's timeout or dead peer, on the failing thread; SIGUSR1,
 * through a pipe to the dump thread, since a signal handler may do nothing
 * but write(2)), and the dump itself: every ring copied, written as JSON to
 * DDP_DEBUG_DIR (a temporary name, then rename) and, under a launcher, to
 * its store, so that ddprun sees ranks of every node. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "comm/flight/flight.h"
#include "io/io_internal.h"
#include "net/net.h"

/* ---- Process state --------------------------------------------------------
 * Lock order: dump_mu, then reg_mu. A ring is unregistered under reg_mu, so
 * a dump never reads a freed ring. The SIGUSR1 trigger (pipe, thread,
 * handler) exists while the process has a ring: the last ring's close takes
 * it down, so a process without groups has no thread of ours (ddp_spawn and
 * fork need a single-threaded caller) and SIGUSR1 back at its default. */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static ddp__flight *reg_head;
static pthread_mutex_t dump_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t dumps_made; /* under dump_mu */
/* Dumps finished, for the dump thread to see that one finished while it
 * waited for dump_mu (written under dump_mu). */
static atomic_uint_fast64_t dumps_done;

typedef struct trigger {
  bool ready;             /* set up (or tried) for the current rings */
  bool handler_installed;
  bool thread_started;
  struct sigaction previous; /* SIGUSR1's action before ours */
  int fds[2];             /* the pipe: read end for the thread, write end for the handler */
  pthread_t thread;
} trigger;

static trigger trig = {.fds = {-1, -1}}; /* under reg_mu */
/* The pipe's write end as the handler sees it: an atomic int, which a signal
 * handler may read. -1: nothing to write to. */
static atomic_int handler_fd = -1;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_sigusr1(int sig) {
  (void)sig;
  int saved_errno = errno;
  int fd = atomic_load_explicit(&handler_fd, memory_order_relaxed);
  if (fd >= 0) {
    char byte = 'S';
    ssize_t rc = write(fd, &byte, 1); /* a full pipe drops it: a dump is pending anyway */
    (void)rc;
  }
  errno = saved_errno;
}

static ddp_status dump_locked(const char *reason, const char *detail);

/* The dump thread: sleeps in read(2) until the handler writes, then dumps;
 * returns on a 'Q' (the last ring closed) or end of file. It blocks every
 * signal, so the handler runs on another thread and never interrupts a
 * dump. */
static void *dump_main(void *arg) {
  int fd = (int)(intptr_t)arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  for (;;) {
    char buf[64];
    ssize_t got = read(fd, buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0 || memchr(buf, 'Q', (size_t)got)) return NULL;
    /* A dump that ends while this one waits for its turn (a failure's,
     * which a launcher's SIGUSR1 often meets) answers the signal too: no
     * second dump for the launcher's stop to cut short. */
    uint64_t before = atomic_load(&dumps_done);
    pthread_mutex_lock(&dump_mu);
    ddp_status st = atomic_load(&dumps_done) == before ? dump_locked("signal", "SIGUSR1") : DDP_OK;
    pthread_mutex_unlock(&dump_mu);
    if (st != DDP_OK) DDP_WARN("flight recorder: %s", ddp_last_error());
  }
}

/* A forked child has copies of the parent's rings but not its threads: it
 * forgets them, gives SIGUSR1 back, and sets up afresh when it creates a
 * group of its own. */
static void atfork_child(void) {
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  reg_mu = fresh;
  dump_mu = fresh;
  reg_head = NULL;
  atomic_store(&handler_fd, -1);
  if (trig.handler_installed) sigaction(SIGUSR1, &trig.previous, NULL);
  for (int k = 0; k < 2; k++)
    if (trig.fds[k] >= 0) close(trig.fds[k]);
  trig = (trigger){.fds = {-1, -1}};
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

/* Under reg_mu, with the first ring: the pipe, the dump thread and the
 * handler. A program that handles or ignores SIGUSR1 itself keeps it (it
 * still gets dumps on failures). Failures cost only the SIGUSR1 path. */
static void trigger_up(void) {
  if (trig.ready) return;
  trig.ready = true;
  pthread_once(&atfork_once, register_atfork);
  struct sigaction current;
  if (sigaction(SIGUSR1, NULL, &current) != 0 || current.sa_handler != SIG_DFL ||
      (current.sa_flags & SA_SIGINFO)) {
    DDP_DEBUG("flight recorder: SIGUSR1 has a handler already; dumps only on failures");
    return;
  }
  if (pipe2(trig.fds, O_CLOEXEC) != 0) {
    DDP_WARN("flight recorder: no dumps on SIGUSR1 (pipe2: %s)", strerror(errno));
    trig.fds[0] = trig.fds[1] = -1;
    return;
  }
  fcntl(trig.fds[1], F_SETFL, O_NONBLOCK); /* the handler never blocks */
  int rc = pthread_create(&trig.thread, NULL, dump_main, (void *)(intptr_t)trig.fds[0]);
  if (rc != 0) {
    DDP_WARN("flight recorder: no dumps on SIGUSR1 (cannot start its thread: %s)", strerror(rc));
    close(trig.fds[0]);
    close(trig.fds[1]);
    trig.fds[0] = trig.fds[1] = -1;
    return;
  }
  trig.thread_started = true;
  pthread_setname_np(trig.thread, "ddp-flight");
  atomic_store(&handler_fd, trig.fds[1]);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigusr1;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGUSR1, &sa, &trig.previous) == 0) trig.handler_installed = true;
}

void ddp__flight_register(ddp__flight *f) {
  pthread_mutex_lock(&reg_mu);
  trigger_up();
  f->reg_next = reg_head;
  reg_head = f;
  pthread_mutex_unlock(&reg_mu);
}

void ddp__flight_unregister(ddp__flight *f) {
  pthread_mutex_lock(&reg_mu);
  for (ddp__flight **p = &reg_head; *p; p = &(*p)->reg_next)
    if (*p == f) {
      *p = f->reg_next;
      break;
    }
  /* The last ring: the trigger goes. SIGUSR1 gets its action back first;
   * the thread is told to quit through the pipe (so a handler that already
   * read the write end still writes into an open pipe) and joined outside
   * reg_mu, since a dump it may be running takes reg_mu; the pipe closes
   * after. A new ring meanwhile sets up a trigger of its own. */
  trigger down = {.fds = {-1, -1}};
  if (!reg_head && trig.ready) {
    down = trig;
    if (trig.handler_installed) sigaction(SIGUSR1, &trig.previous, NULL);
    atomic_store(&handler_fd, -1);
    trig = (trigger){.fds = {-1, -1}};
  }
  pthread_mutex_unlock(&reg_mu);
  if (down.thread_started) {
    char quit = 'Q';
    if (write(down.fds[1], &quit, 1) != 1) { /* a full pipe: end of file ends it too */
      close(down.fds[1]);
      down.fds[1] = -1;
    }
    pthread_join(down.thread, NULL);
  }
  for (int k = 0; k < 2; k++)
    if (down.fds[k] >= 0) close(down.fds[k]);
}

/* ---- Collecting ------------------------------------------------------------ */

static int32_t env_int32(const char *name) {
  int64_t v = -1;
  if (ddp_env_int(name, -1, &v) != DDP_OK || v < 0 || v > INT32_MAX) {
    ddp_clear_error();
    return -1;
  }
  return (int32_t)v;
}

/* Copies s without line breaks (the launcher's environment is trusted, but a
 * dump stays one record per line in messages). */
static void copy_flat(char *dst, size_t bytes, const char *s) {
  snprintf(dst, bytes, "%s", s ? s : "");
  for (char *p = dst; *p; p++)
    if (*p == '\n' || *p == '\r') *p = ' ';
}

ddp_status ddp__flight_collect(const char *reason, const char *detail, ddp__flight_dump *d) {
  memset(d, 0, sizeof *d);
  d->rank = env_int32("RANK");
  d->world_size = env_int32("WORLD_SIZE");
  d->attempt = env_int32("TORCHELASTIC_RESTART_COUNT");
  d->pid = (int64_t)getpid();
  if (gethostname(d->host, sizeof d->host) != 0) snprintf(d->host, sizeof d->host, "unknown");
  d->host[sizeof d->host - 1] = '\0';
  copy_flat(d->run_id, sizeof d->run_id, ddp_env_str("TORCHELASTIC_RUN_ID", ""));
  copy_flat(d->reason, sizeof d->reason, reason);
  copy_flat(d->detail, sizeof d->detail, detail);
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  d->dump_ns = ddp__now_coarse_ns(); /* the records' clock */
  d->dump_unix_ns = (int64_t)wall.tv_sec * 1000000000LL + wall.tv_nsec;
  ddp_status st = DDP_OK;
  pthread_mutex_lock(&reg_mu);
  size_t n = 0;
  for (ddp__flight *f = reg_head; f; f = f->reg_next) n++;
  d->groups = n ? ddp_calloc(n, sizeof *d->groups) : NULL;
  if (n && !d->groups) st = ddp_error(DDP_ERR_NOMEM, "flight recorder: out of memory for %zu groups", n);
  /* Oldest group first: the registry is newest first. */
  size_t g = n;
  for (ddp__flight *f = reg_head; f && st == DDP_OK; f = f->reg_next) {
    ddp__flight_group *out = &d->groups[--g];
    snprintf(out->name, sizeof out->name, "%s", f->name);
    snprintf(out->backend, sizeof out->backend, "%s", f->backend);
    out->rank = f->rank;
    out->size = f->size;
    out->dump_ns = d->dump_ns;
    out->recorded = atomic_load(&f->next_id);
    out->records = ddp_calloc((size_t)f->capacity, sizeof *out->records);
    if (!out->records) {
      st = ddp_error(DDP_ERR_NOMEM, "flight recorder: out of memory for %llu records of group %s",
                     (unsigned long long)f->capacity, f->name);
      break;
    }
    out->n = ddp__flight_snapshot(f, out->records);
    if (d->capacity < f->capacity) d->capacity = f->capacity;
  }
  d->n_groups = n;
  pthread_mutex_unlock(&reg_mu);
  if (st != DDP_OK) ddp__flight_dump_free(d);
  return st;
}

/* ---- JSON -------------------------------------------------------------------- */

/* A JSON string: quotes, backslashes and control characters escaped; bytes
 * >= 0x80 copied (our strings are ASCII or the environment's UTF-8). */
static void put_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p < 0x20)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

static void put_time(FILE *f, const char *key, int64_t ns) {
  if (ns < 0)
    fprintf(f, ", \"%s\": null", key);
  else
    fprintf(f, ", \"%s\": %" PRId64, key, ns);
}

static void put_record(FILE *f, const ddp__flight_record *r) {
  const char *op = ddp__op_kind_name((ddp__op_kind)r->kind);
  fprintf(f, "{\"id\": %" PRIu64 ", \"seq\": %" PRIu64 ", \"op\": ", r->id, r->seq);
  put_string(f, op);
  fprintf(f, ", \"count\": %" PRIu64 ", \"dtype\": ", r->count);
  if (r->dtype < 0)
    fputs("null", f);
  else
    put_string(f, ddp_dtype_name((ddp_dtype)r->dtype));
  fprintf(f, ", \"bytes\": %" PRIu64 ", \"reduce_op\": ", ddp__flight_bytes(r));
  if (r->reduce_op < 0)
    fputs("null", f);
  else
    put_string(f, ddp_reduce_op_name((ddp_reduce_op)r->reduce_op));
  fprintf(f, ", \"root\": %d, \"peer\": %d, \"tag\": %d, \"state\": \"%s\", \"status\": ", (int)r->root,
          (int)r->peer, (int)r->tag, ddp__flight_state_name(r->state));
  if (r->status == 0)
    fputs("null", f);
  else
    put_string(f, ddp_status_name((ddp_status)r->status));
  put_time(f, "scheduled_ns", r->scheduled_ns);
  put_time(f, "started_ns", r->started_ns);
  put_time(f, "ended_ns", r->ended_ns);
  fputc('}', f);
}

ddp_status ddp__flight_to_json(const ddp__flight_dump *d, char **text, size_t *len) {
  *text = NULL;
  *len = 0;
  char *buf = NULL;
  size_t size = 0;
  FILE *f = open_memstream(&buf, &size);
  if (!f) return ddp_error(DDP_ERR_NOMEM, "flight recorder: open_memstream: %s", strerror(errno));
  fprintf(f, "{\"format\": \"%s\", \"version\": %d,\n", DDP__FLIGHT_FORMAT, DDP__FLIGHT_VERSION);
  fprintf(f, " \"rank\": %d, \"world_size\": %d, \"pid\": %" PRId64 ", \"host\": ", (int)d->rank,
          (int)d->world_size, d->pid);
  put_string(f, d->host);
  fputs(", \"run_id\": ", f);
  put_string(f, d->run_id);
  fprintf(f, ", \"attempt\": %d,\n \"reason\": ", (int)d->attempt);
  put_string(f, d->reason);
  fputs(", \"detail\": ", f);
  put_string(f, d->detail);
  fprintf(f, ",\n \"dump\": %" PRIu64 ", \"capacity\": %" PRIu64 ", \"clock\": \"CLOCK_MONOTONIC_COARSE\","
             " \"dump_ns\": %" PRId64 ", \"dump_unix_ns\": %" PRId64 ",\n \"groups\": [",
          d->dump_number, d->capacity, d->dump_ns, d->dump_unix_ns);
  for (size_t g = 0; g < d->n_groups; g++) {
    const ddp__flight_group *gr = &d->groups[g];
    fprintf(f, "%s\n  {\"name\": ", g ? "," : "");
    put_string(f, gr->name);
    fprintf(f, ", \"rank\": %d, \"size\": %d, \"backend\": ", (int)gr->rank, (int)gr->size);
    put_string(f, gr->backend);
    fprintf(f, ", \"recorded\": %" PRIu64 ", \"entries\": [", gr->recorded);
    for (size_t i = 0; i < gr->n; i++) {
      fputs(i ? ",\n   " : "\n   ", f);
      put_record(f, &gr->records[i]);
    }
    fputs(gr->n ? "\n  ]}" : "]}", f);
  }
  fputs(d->n_groups ? "\n ]\n}\n" : "]\n}\n", f);
  if (fclose(f) != 0 || !buf) {
    free(buf);
    return ddp_error(DDP_ERR_NOMEM, "flight recorder: out of memory writing JSON");
  }
  /* Handed over as ddp_alloc memory, as the rest of ddp's buffers. */
  char *out = ddp_alloc(size + 1);
  if (!out) {
    free(buf);
    return ddp_error(DDP_ERR_NOMEM, "flight recorder: out of memory for %zu bytes of JSON", size);
  }
  memcpy(out, buf, size + 1);
  free(buf); /* open_memstream's buffer comes from malloc */
  *text = out;
  *len = size;
  return DDP_OK;
}

/* ---- Writing ------------------------------------------------------------------ */

void ddp__flight_dump_path(const char *dir, int32_t rank, int64_t pid, char *out, size_t bytes) {
  if (rank >= 0)
    snprintf(out, bytes, "%s/ddp-flight-rank%d.json", dir, (int)rank);
  else
    snprintf(out, bytes, "%s/ddp-flight-pid%" PRId64 ".json", dir, pid);
}

void ddp__flight_debug_dir(const char *run_id, int64_t pid, char *out, size_t bytes) {
  const char *dir = ddp_env_str("DDP_DEBUG_DIR", "");
  if (*dir) {
    snprintf(out, bytes, "%s", dir);
    return;
  }
  const char *tmp = ddp_env_str("TMPDIR", "");
  if (!*tmp) tmp = "/tmp";
  if (run_id && *run_id) {
    /* A run id is the user's (--rdzv-id): anything but a plain name part
     * becomes '_', so it stays one directory below tmp. The pid keeps two
     * runs with the same id ("none", torchrun's default) apart. */
    int n = snprintf(out, bytes, "%s/ddp-debug-", tmp);
    size_t k = n > 0 && (size_t)n < bytes ? (size_t)n : 0;
    for (const char *c = run_id; *c && k + 1 < bytes; c++)
      out[k++] = (isalnum((unsigned char)*c) || *c == '-' || *c == '.') ? *c : '_';
    snprintf(out + k, bytes - k, "-%" PRId64, pid);
  } else {
    snprintf(out, bytes, "%s/ddp-debug-pid%" PRId64, tmp, pid);
  }
}

/* The file, in ddp__flight_debug_dir (created if missing), replaced
 * atomically (io's writer: a reader never sees half a dump). */
static ddp_status write_file(const ddp__flight_dump *d, const char *text, size_t len, char *path,
                             size_t bytes) {
  char dir[4000];
  ddp__flight_debug_dir(NULL, d->pid, dir, sizeof dir);
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return ddp_error(DDP_ERR_IO, "flight recorder: cannot create the debug directory %s: %s", dir, strerror(errno));
  ddp__flight_dump_path(dir, d->rank, d->pid, path, bytes);
  return ddp__atomic_write_file(path, text, len);
}

/* The launcher's store (DDP_STORE_ADDR, DDP_STORE_PREFIX: ddprun's): key
 * flight/<rank> holds the JSON, then flight/<rank>/dumps is counted up, which
 * the launcher watches to know a fresh dump arrived. A short connect
 * timeout: the store may be what failed. Returns whether it was written. */
static bool write_store(const ddp__flight_dump *d, const char *text, size_t len) {
  const char *addr = ddp_env_str("DDP_STORE_ADDR", NULL);
  if (!addr || !*addr || d->rank < 0) return false;
  char host[DDP_RENDEZVOUS_ADDR_BYTES];
  int32_t port;
  ddp_store_options so = {0};
  so.timeout_ms = 5000;
  so.connect_timeout_ms = 1000;
  ddp_store *base = NULL, *store = NULL;
  ddp_status st = ddp__net_split_hostport("DDP_STORE_ADDR", addr, host, sizeof host, &port);
  if (st == DDP_OK) st = ddp_store_tcp_connect(host, (uint16_t)port, &so, &base);
  if (st == DDP_OK) st = ddp_store_prefix(base, ddp_env_str("DDP_STORE_PREFIX", ""), &store);
  char key[64];
  snprintf(key, sizeof key, "flight/%d", (int)d->rank);
  if (st == DDP_OK) st = ddp_store_set(store, key, text, len);
  int64_t count = 0;
  snprintf(key, sizeof key, "flight/%d/dumps", (int)d->rank);
  if (st == DDP_OK) st = ddp_store_add(store, key, 1, &count);
  if (st != DDP_OK) DDP_WARN("flight recorder: the dump did not reach the store at %s: %s", addr, ddp_last_error());
  ddp_store_destroy(store);
  ddp_store_destroy(base);
  return st == DDP_OK;
}

/* One dump, under dump_mu. */
static ddp_status dump_locked(const char *reason, const char *detail) {
  ddp__flight_dump d;
  ddp_status st = ddp__flight_collect(reason, detail, &d);
  char *text = NULL;
  size_t len = 0;
  if (st == DDP_OK) {
    d.dump_number = ++dumps_made;
    st = ddp__flight_to_json(&d, &text, &len);
  }
  char path[4096] = "";
  if (st == DDP_OK) {
    size_t records = 0;
    for (size_t g = 0; g < d.n_groups; g++) records += d.groups[g].n;
    st = write_file(&d, text, len, path, sizeof path);
    ddp_status file_st = st;
    bool stored = write_store(&d, text, len);
    if (file_st == DDP_OK)
      DDP_WARN("flight recorder: %zu operation%s of %zu group%s dumped to %s%s (%s)", records,
               records == 1 ? "" : "s", d.n_groups, d.n_groups == 1 ? "" : "s", path,
               stored ? " and the launcher's store" : "", reason);
    else if (stored)
      st = DDP_OK; /* the launcher has it; the file's error was logged below */
    if (file_st != DDP_OK) DDP_WARN("%s", ddp_last_error());
  }
  ddp_free(text);
  ddp__flight_dump_free(&d);
  atomic_fetch_add(&dumps_done, 1);
  return st;
}

ddp_status ddp__flight_dump_now(const char *reason, const char *detail) {
  pthread_mutex_lock(&dump_mu);
  ddp_status st = dump_locked(reason, detail);
  pthread_mutex_unlock(&dump_mu);
  return st;
}

void ddp__flight_on_failure(ddp__flight *f, ddp_status status, const char *msg) {
  (void)f;
  if (status != DDP_ERR_TIMEOUT && status != DDP_ERR_PEER) return;
  /* The caller's last error is the failure; the dump must not replace it. */
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", ddp_last_error());
  if (ddp__flight_dump_now(status == DDP_ERR_TIMEOUT ? "timeout" : "peer", msg) != DDP_OK)
    DDP_WARN("flight recorder: %s", ddp_last_error());
  ddp_error(status, "%s", saved);
}
