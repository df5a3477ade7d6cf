/* The agent's life: init (the rendezvous or a given store, names and
 * addresses exchanged through it, a connection to every other worker, the
 * pool, a barrier) and shutdown (graceful: this worker's calls complete,
 * then every live worker tells every other it is done). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "net/net.h"
#include "rpc/engine.h"
#include "rpc/registry.h"

#define UNIX_NAME_BYTES 96

/* What each worker publishes about itself. */
typedef struct published {
  char name[DDP_RPC_MAX_NAME_BYTES];
  char host_id[DDP_RENDEZVOUS_HOST_ID_BYTES];
  char tcp_host[DDP_NET_ADDR_BYTES];
  uint16_t tcp_port;
  char unix_name[UNIX_NAME_BYTES]; /* abstract socket name, without the leading NUL */
  int64_t pid;
  uint64_t magic_addr; /* where pull_magic is in its memory */
  char machine_id[80]; /* kernel boot id / pid namespace: who may read whose memory */
} published;

/* Read by the other workers of this host through cross-memory attach to
 * learn whether they may read this process's memory. */
static const uint64_t pull_magic = 0x6464702d72706321ull;

/* The modules' init and destroy hooks run one at a time in a process
 * (rpc_internal.h), whichever agents start or end at once. */
static pthread_mutex_t modules_mu = PTHREAD_MUTEX_INITIALIZER;

void **ddp__rpc_module_slot(ddp_rpc_agent *agent, int slot) {
  DDP_ASSERT(slot >= 0 && slot < DDP__RPC_MAX_MODULES);
  return &agent->module_state[slot];
}

int ddp__rpc_module_index(const ddp__rpc_module *module) {
  for (int m = 0; m < ddp__rpc_num_modules; m++)
    if (ddp__rpc_modules[m] == module) return m;
  DDP_ASSERT(!"a module that is not in ddp__rpc_modules");
  return -1;
}

ddp_rpc_options ddp_rpc_defaults(void) {
  ddp_rpc_options opts;
  memset(&opts, 0, sizeof opts);
  opts.rank = -1;
  opts.world_size = -1;
  return opts;
}

static void init_cond(pthread_cond_t *cv) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &ca);
  pthread_condattr_destroy(&ca);
}

/* ---- Addresses ----------------------------------------------------------------- */

/* The TCP address this worker publishes: DDP_RPC_ADDR, else net's choice
 * as for the tcp backend (DDP_COMM_ADDR, DDP_SOCKET_IFNAME, the route to
 * the store's host, ...). */
static ddp_status choose_address(const char *store_addr, char *host, size_t cap) {
  static const char *const vars[] = {"DDP_RPC_ADDR", "DDP_COMM_ADDR", NULL};
  return ddp__net_choose_address("rpc", vars, false, store_addr, host, cap);
}

static socklen_t unix_addr(const char *name, struct sockaddr_un *sa) {
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  size_t n = strlen(name);
  memcpy(sa->sun_path + 1, name, n); /* abstract: sun_path[0] = '\0' */
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static ddp_status unix_listen(const char *name, int *fd_out) {
  *fd_out = -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ddp_error(DDP_ERR_SYS, "rpc: unix socket: %s", strerror(errno));
  struct sockaddr_un sa;
  socklen_t len = unix_addr(name, &sa);
  if (bind(fd, (struct sockaddr *)&sa, len) != 0 || listen(fd, 1024) != 0) {
    int err = errno;
    close(fd);
    return ddp_error(DDP_ERR_SYS, "rpc: cannot listen on unix socket @%s: %s", name, strerror(err));
  }
  *fd_out = fd;
  return DDP_OK;
}

static ddp_status unix_connect(const char *name, int *fd_out) {
  *fd_out = -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ddp_error(DDP_ERR_SYS, "rpc: unix socket: %s", strerror(errno));
  struct sockaddr_un sa;
  socklen_t len = unix_addr(name, &sa);
  int rc;
  do rc = connect(fd, (struct sockaddr *)&sa, len);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    close(fd);
    return ddp_error(DDP_ERR_CLOSED, "rpc: connect to unix socket @%s: %s", name, strerror(err));
  }
  *fd_out = fd;
  return DDP_OK;
}

/* ---- Publishing and reading the workers ------------------------------------------ */

static ddp_status publish(ddp_rpc_agent *a, const published *me) {
  char key[32], value[sizeof(published) + 64];
  snprintf(key, sizeof key, "w/%d", a->rank);
  int n = snprintf(value, sizeof value, "%s\n%s\n%s\n%u\n%s\n%lld\n%llu\n%s\n", me->name,
                   me->host_id, me->tcp_host, me->tcp_port, me->unix_name, (long long)me->pid,
                   (unsigned long long)me->magic_addr, me->machine_id);
  return ddp_store_set(a->store, key, value, (size_t)n);
}

static ddp_status parse_published(const char *text, int32_t rank, published *p) {
  memset(p, 0, sizeof *p);
  char *fields[8];
  char buf[sizeof(published) + 64];
  snprintf(buf, sizeof buf, "%s", text);
  char *s = buf;
  for (int i = 0; i < 8; i++) {
    char *nl = strchr(s, '\n');
    if (!nl) return ddp_error(DDP_ERR_FORMAT, "rpc: rank %d's record in the store is malformed", rank);
    *nl = '\0';
    fields[i] = s;
    s = nl + 1;
  }
  if (strlen(fields[0]) >= sizeof p->name || strlen(fields[1]) >= sizeof p->host_id ||
      strlen(fields[2]) >= sizeof p->tcp_host || strlen(fields[4]) >= sizeof p->unix_name)
    return ddp_error(DDP_ERR_FORMAT, "rpc: rank %d's record in the store is malformed", rank);
  snprintf(p->name, sizeof p->name, "%.*s", (int)sizeof p->name - 1, fields[0]);
  snprintf(p->host_id, sizeof p->host_id, "%.*s", (int)sizeof p->host_id - 1, fields[1]);
  snprintf(p->tcp_host, sizeof p->tcp_host, "%.*s", (int)sizeof p->tcp_host - 1, fields[2]);
  p->tcp_port = (uint16_t)atoi(fields[3]);
  snprintf(p->unix_name, sizeof p->unix_name, "%.*s", (int)sizeof p->unix_name - 1, fields[4]);
  p->pid = strtoll(fields[5], NULL, 10);
  p->magic_addr = strtoull(fields[6], NULL, 10);
  if (strlen(fields[7]) >= sizeof p->machine_id)
    return ddp_error(DDP_ERR_FORMAT, "rpc: rank %d's record in the store is malformed", rank);
  snprintf(p->machine_id, sizeof p->machine_id, "%.*s", (int)sizeof p->machine_id - 1, fields[7]);
  return DDP_OK;
}

static ddp_status gather(ddp_rpc_agent *a, published *all, int64_t timeout_ms) {
  int32_t n = a->world;
  char **keys = ddp_calloc((size_t)n, sizeof *keys);
  ddp_store_value *values = ddp_calloc((size_t)n, sizeof *values);
  char *key_text = ddp_calloc((size_t)n, 16);
  ddp_status st = DDP_OK;
  if (!keys || !values || !key_text) st = ddp_error(DDP_ERR_NOMEM, "rpc init: out of memory");
  for (int32_t r = 0; st == DDP_OK && r < n; r++) {
    keys[r] = key_text + 16 * r;
    snprintf(keys[r], 16, "w/%d", r);
  }
  if (st == DDP_OK) {
    st = ddp_store_multi_get(a->store, (const char *const *)keys, (size_t)n, timeout_ms, values);
    if (st != DDP_OK)
      st = ddp_error_wrap(st, "rpc init: waiting for every worker's address (world size %d)", n);
  }
  for (int32_t r = 0; st == DDP_OK && r < n; r++) st = parse_published(values[r].data, r, &all[r]);
  if (values) ddp_store_values_free(values, (size_t)n);
  ddp_free(values);
  ddp_free(keys);
  ddp_free(key_text);
  return st;
}

/* Socket buffers of a Unix connection: 4 MiB (net.core.wmem_max's usual
 * cap) lets a 1 MiB message go in one send instead of a dozen rounds of
 * the sender waiting for the reader to drain 208 KiB. */
static void unix_buffers(int fd) {
  int bytes = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

/* ---- Connecting ---------------------------------------------------------------- */

static ddp_status send_hello(ddp_rpc_agent *a, int fd, int64_t deadline_ns) {
  const char *name = a->workers[a->rank].name;
  ddp__rpc_frame h = {.magic = DDP__RPC_MAGIC,
                      .kind = DDP__RPC_HELLO,
                      .call_id = (uint64_t)a->rank,
                      .payload_bytes = strlen(name)};
  DDP_TRY(ddp__net_write_full(fd, &h, sizeof h, deadline_ns));
  return ddp__net_write_full(fd, name, strlen(name), deadline_ns);
}

static ddp_status connect_to(ddp_rpc_agent *a, const published *peer, int32_t r,
                             ddp__rpc_link link, int64_t deadline_ns) {
  ddp__rpc_conn *c = &a->conns[r];
  int fd = -1;
  ddp_status st;
  if (link == DDP__RPC_LINK_UNIX) {
    st = unix_connect(peer->unix_name, &fd);
  } else {
    /* The peer listened before it published: refusals are not expected,
     * but a slow network may need a retry. */
    for (;;) {
      st = ddp__net_connect(peer->tcp_host, peer->tcp_port, deadline_ns, &fd);
      if (st != DDP_ERR_CLOSED || ddp_time_ns() >= deadline_ns) break;
      struct timespec ts = {0, 20 * 1000000};
      nanosleep(&ts, NULL);
    }
  }
  if (st == DDP_OK) st = send_hello(a, fd, deadline_ns);
  if (st != DDP_OK) {
    if (fd >= 0) close(fd);
    char who[128];
    return ddp_error_wrap(st, "rpc init: connecting to %s at %s:%u",
                          ddp__rpc_worker_str(a, r, who, sizeof who),
                          link == DDP__RPC_LINK_UNIX ? "unix" : peer->tcp_host,
                          link == DDP__RPC_LINK_UNIX ? 0u : peer->tcp_port);
  }
  if (link == DDP__RPC_LINK_UNIX) unix_buffers(fd);
  c->fd = fd;
  c->link = link;
  return DDP_OK;
}

/* Accepts the connections of every higher rank, on either listener. */
static ddp_status accept_all(ddp_rpc_agent *a, int tcp_fd, int unix_fd, int64_t deadline_ns) {
  int wanted = a->world - 1 - a->rank;
  while (wanted > 0) {
    struct pollfd p[2] = {{.fd = tcp_fd, .events = POLLIN}, {.fd = unix_fd, .events = POLLIN}};
    int64_t left_ms = (deadline_ns - ddp_time_ns()) / 1000000;
    if (left_ms <= 0) {
      char missing[512] = "";
      size_t used = 0;
      for (int32_t r = a->rank + 1; r < a->world && used + 16 < sizeof missing; r++)
        if (a->conns[r].fd < 0) used += (size_t)snprintf(missing + used, sizeof missing - used, "%s'%s' (rank %d)", used ? ", " : "", a->workers[r].name, r);
      return ddp_error(DDP_ERR_TIMEOUT, "rpc init: timed out waiting for %d workers to connect: %s",
                       wanted, missing);
    }
    int rc = poll(p, 2, left_ms > 1000 ? 1000 : (int)left_ms);
    if (rc < 0 && errno != EINTR) return ddp_error(DDP_ERR_SYS, "rpc init: poll: %s", strerror(errno));
    for (int i = 0; i < 2 && rc > 0; i++) {
      if (!(p[i].revents & POLLIN)) continue;
      int fd = accept4(p[i].fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd < 0) continue;
      ddp__rpc_frame h;
      char name[DDP_RPC_MAX_NAME_BYTES];
      int64_t hello_deadline = ddp_time_ns() + 10LL * 1000000000;
      if (hello_deadline > deadline_ns) hello_deadline = deadline_ns;
      ddp_status st = ddp__net_read_full(fd, &h, sizeof h, hello_deadline);
      if (st == DDP_OK && (h.magic != DDP__RPC_MAGIC || h.kind != DDP__RPC_HELLO ||
                           h.payload_bytes >= sizeof name))
        st = ddp_error(DDP_ERR_FORMAT, "not a ddp rpc hello");
      if (st == DDP_OK) st = ddp__net_read_full(fd, name, h.payload_bytes, hello_deadline);
      int32_t r = (int32_t)h.call_id;
      if (st == DDP_OK) {
        name[h.payload_bytes] = '\0';
        if (h.call_id >= (uint64_t)a->world || r <= a->rank || a->conns[r].fd >= 0 ||
            strcmp(name, a->workers[r].name) != 0)
          st = ddp_error(DDP_ERR_FORMAT, "unexpected hello from '%s' (rank %llu)", name,
                         (unsigned long long)h.call_id);
      }
      if (st != DDP_OK) {
        char peer[DDP_NET_ADDR_BYTES];
        ddp_log(DDP_LOG_WARN, "rpc init: dropping a connection from %s: %s",
                i == 0 ? ddp__net_peer_addr(fd, peer, sizeof peer) : "a unix socket",
                ddp_last_error());
        close(fd);
        continue;
      }
      a->conns[r].fd = fd;
      a->conns[r].link = i == 0 ? DDP__RPC_LINK_TCP : DDP__RPC_LINK_UNIX;
      if (i == 0) ddp__net_set_nodelay(fd);
      else unix_buffers(fd);
      wanted--;
    }
  }
  return DDP_OK;
}

/* ---- Init ---------------------------------------------------------------------- */


static void agent_free(ddp_rpc_agent *a);

/* Processes that may read each other's memory share a kernel (its boot id)
 * and a pid namespace (pids mean the same): "boot-id/pidns-inode", or "" if
 * either is unknown. Network namespaces do not matter: two workers of one
 * machine in different network namespaces talk TCP (different host
 * identities) but still pass large tensors by cross-memory attach, as
 * TensorPipe's CMA channel does. */
static void machine_id(char *out, size_t cap) {
  out[0] = '\0';
  char boot[64] = "";
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  bool ok = fgets(boot, sizeof boot, f) != NULL;
  fclose(f);
  struct stat st;
  if (!ok || stat("/proc/self/ns/pid", &st) != 0) return;
  boot[strcspn(boot, "\n")] = '\0';
  snprintf(out, cap, "%s/%llu", boot, (unsigned long long)st.st_ino);
}

/* Which workers of this machine this one can read through cross-memory attach
 * (a test read of each one's magic), published as "p/<rank>": one '0'/'1'
 * per rank. DDP_RPC_NO_CMA=1 says none (to measure the socket path). */
static ddp_status publish_pulls(ddp_rpc_agent *a, const published *all) {
  char *can = ddp_calloc((size_t)a->world + 1, 1);
  if (!can) return ddp_error(DDP_ERR_NOMEM, "rpc init: out of memory");
  bool off = strcmp(ddp_env_str("DDP_RPC_NO_CMA", "0"), "0") != 0;
  for (int32_t r = 0; r < a->world; r++) {
    can[r] = '0';
    a->conns[r].peer_pid = (int32_t)all[r].pid;
    bool same_machine = all[r].machine_id[0] && strcmp(all[r].machine_id, all[a->rank].machine_id) == 0;
    if (off || r == a->rank || !same_machine) continue;
    uint64_t magic = 0;
    struct iovec l = {&magic, sizeof magic};
    struct iovec rem = {(void *)(uintptr_t)all[r].magic_addr, sizeof magic};
    if (process_vm_readv((pid_t)all[r].pid, &l, 1, &rem, 1, 0) == (ssize_t)sizeof magic &&
        magic == pull_magic)
      can[r] = '1';
  }
  char key[32];
  snprintf(key, sizeof key, "p/%d", a->rank);
  ddp_status st = ddp_store_set(a->store, key, can, (size_t)a->world);
  ddp_free(can);
  return st;
}

/* After the barrier (every "p/" is there): may each peer read our memory? */
static ddp_status read_pulls(ddp_rpc_agent *a) {
  for (int32_t r = 0; r < a->world; r++) {
    if (r == a->rank) continue;
    char key[32];
    snprintf(key, sizeof key, "p/%d", r);
    void *v = NULL;
    size_t n = 0;
    DDP_TRY(ddp_store_get(a->store, key, 0, &v, &n));
    bool pulls = n == (size_t)a->world && ((char *)v)[a->rank] == '1';
    atomic_store(&a->conns[r].peer_pulls, pulls);
    ddp_free(v);
  }
  return DDP_OK;
}

static ddp_status barrier(ddp_rpc_agent *a, const char *what, int64_t deadline_ns) {
  char count_key[64], done_key[64];
  snprintf(count_key, sizeof count_key, "%s/count", what);
  snprintf(done_key, sizeof done_key, "%s/done", what);
  int64_t count;
  DDP_TRY(ddp_store_add(a->store, count_key, 1, &count));
  if (count == a->world) DDP_TRY(ddp_store_set(a->store, done_key, "1", 1));
  const char *keys[1] = {done_key};
  int64_t left_ms = (deadline_ns - ddp_time_ns()) / 1000000;
  ddp_status st = ddp_store_wait(a->store, keys, 1, left_ms > 0 ? left_ms : 0);
  if (st != DDP_OK)
    return ddp_error_wrap(st, "rpc init: waiting for every worker to finish connecting");
  return DDP_OK;
}

/* ---- Init, step by step ------------------------------------------------------ */

/* The agent with its locks and condition variables, nothing else yet. */
static ddp_rpc_agent *agent_alloc(void) {
  ddp_rpc_agent *a = ddp_calloc(1, sizeof *a);
  if (!a) return NULL;
  pthread_mutex_init(&a->mu, NULL);
  init_cond(&a->work_cv);
  init_cond(&a->outstanding_cv);
  init_cond(&a->timer_cv);
  atomic_init(&a->outside_users, 0);
  return a;
}

/* The default call timeout and the pool's size, from the options or the
 * environment. */
static ddp_status resolve_settings(ddp_rpc_agent *a, const ddp_rpc_options *opts) {
  double timeout_s = opts->timeout_s;
  if (timeout_s <= 0) {
    DDP_TRY(ddp_env_double("DDP_RPC_TIMEOUT", DDP_RPC_DEFAULT_TIMEOUT_S, &timeout_s));
    if (timeout_s <= 0) timeout_s = DDP_RPC_DEFAULT_TIMEOUT_S;
  }
  a->default_timeout_ns = (int64_t)(timeout_s * 1e9);
  int64_t threads = opts->num_threads;
  if (threads <= 0) {
    DDP_TRY(ddp_env_int("DDP_RPC_THREADS", 4, &threads));
    if (threads <= 0 || threads > 1024)
      return ddp_error(DDP_ERR_INVALID, "rpc init: DDP_RPC_THREADS=%lld (1..1024)", (long long)threads);
  }
  a->num_threads = (int)threads;
  return DDP_OK;
}

/* Meets the others: a rendezvous (env://, tcp://, file://) or the caller's
 * store. Sets the rank and world size, *base (borrowed: the caller's store
 * or the rendezvous's) and *init_timeout_s. */
static ddp_status meet(ddp_rpc_agent *a, const ddp_rpc_options *opts, ddp_store **base,
                       double *init_timeout_s) {
  *init_timeout_s = opts->init_timeout_s;
  if (opts->store) {
    if (opts->rank < 0 || opts->world_size <= 0 || opts->rank >= opts->world_size)
      return ddp_error(DDP_ERR_INVALID,
                       "rpc init: with a store, give rank and world_size (got rank %d, world size %d)",
                       opts->rank, opts->world_size);
    a->rank = opts->rank;
    a->world = opts->world_size;
    *base = opts->store;
    if (*init_timeout_s <= 0) *init_timeout_s = (double)ddp_store_timeout_ms(*base) / 1e3;
    return DDP_OK;
  }
  ddp_rendezvous_options ro = ddp_rendezvous_defaults();
  ro.rank = opts->rank;
  ro.world_size = opts->world_size;
  ro.timeout_s = *init_timeout_s;
  ddp_status st = ddp_rendezvous(opts->init_method, &ro, &a->rdzv);
  if (st != DDP_OK) return ddp_error_wrap(st, "rpc init of worker '%s'", opts->name);
  a->have_rdzv = true;
  a->rank = a->rdzv.rank;
  a->world = a->rdzv.world_size;
  *base = a->rdzv.store;
  *init_timeout_s = a->rdzv.timeout_s;
  return DDP_OK;
}

/* One worker info and one connection per rank, and *all: one published
 * record per rank (the caller frees it). */
static ddp_status alloc_peers(ddp_rpc_agent *a, published **all) {
  a->workers = ddp_calloc((size_t)a->world, sizeof *a->workers);
  a->conns = ddp_calloc((size_t)a->world, sizeof *a->conns);
  *all = ddp_calloc((size_t)a->world, sizeof **all);
  if (!a->workers || !a->conns || !*all)
    return ddp_error(DDP_ERR_NOMEM, "rpc init: out of memory for %d workers", a->world);
  for (int32_t r = 0; r < a->world; r++) {
    a->conns[r].agent = a;
    a->conns[r].rank = r;
    a->conns[r].fd = -1;
    pthread_mutex_init(&a->conns[r].write_mu, NULL);
    init_cond(&a->conns[r].pulled_cv);
    atomic_init(&a->conns[r].peer_pulls, false);
    atomic_init(&a->conns[r].ack_due, 0);
    atomic_init(&a->conns[r].ack_sent, 0);
  }
  return DDP_OK;
}

/* Listens (TCP on every interface, and an abstract Unix socket) and
 * publishes this worker's record. *tcp_fd and *unix_fd are the caller's to
 * close, also on error. */
static ddp_status listen_and_publish(ddp_rpc_agent *a, const ddp_rpc_options *opts, ddp_store *base,
                                     int *tcp_fd, int *unix_fd) {
  published me;
  memset(&me, 0, sizeof me);
  snprintf(me.name, sizeof me.name, "%s", opts->name);
  me.pid = (int64_t)getpid();
  me.magic_addr = (uint64_t)(uintptr_t)&pull_magic;
  machine_id(me.machine_id, sizeof me.machine_id);
  DDP_TRY(ddp__net_host_id(me.host_id, sizeof me.host_id));
  /* The store's address as the others reach it: rank 0 of a rendezvous
   * talks to the store it hosts through loopback, which says nothing about
   * the interface facing the others. */
  DDP_TRY(choose_address(a->have_rdzv ? a->rdzv.store_addr : ddp_store_address(base), me.tcp_host,
                         sizeof me.tcp_host));
  DDP_TRY(ddp__net_listen(strchr(me.tcp_host, ':') ? "::" : "0.0.0.0", 0, a->world + 16, tcp_fd));
  me.tcp_port = ddp__net_local_port(*tcp_fd);
  static _Atomic unsigned counter;
  unsigned k = atomic_fetch_add(&counter, 1);
  snprintf(me.unix_name, sizeof me.unix_name, "ddp-rpc-%d-%u-%llx", (int)getpid(), k,
           (unsigned long long)ddp_time_ns());
  DDP_TRY(unix_listen(me.unix_name, unix_fd));
  return publish(a, &me);
}

/* Names unique: every worker sees the same records, so each fails alike. */
static ddp_status check_unique_names(const ddp_rpc_agent *a, const published *all) {
  for (int32_t i = 0; i < a->world; i++)
    for (int32_t j = i + 1; j < a->world; j++)
      if (strcmp(all[i].name, all[j].name) == 0)
        return ddp_error(DDP_ERR_INVALID,
                         "rpc init: worker name '%s' is used by rank %d and rank %d (names must be "
                         "unique)",
                         all[i].name, i, j);
  return DDP_OK;
}

/* Fills a->workers from the records. Hosts are numbered in the order of
 * their lowest rank: a rank whose host first appears at rank p takes rank
 * p's number, and a host seen first gets the next one. */
static void describe_workers(ddp_rpc_agent *a, const published *all) {
  int32_t hosts = 0;
  for (int32_t r = 0; r < a->world; r++) {
    ddp_rpc_worker_info *w = &a->workers[r];
    snprintf(w->name, sizeof w->name, "%s", all[r].name);
    w->rank = r;
    int32_t first = r;
    for (int32_t p = 0; p < r; p++)
      if (strcmp(all[p].host_id, all[r].host_id) == 0) {
        first = p;
        break;
      }
    w->host_index = first < r ? a->workers[first].host_index : hosts++;
    ddp__net_format_host_port(all[r].tcp_host, all[r].tcp_port, w->addr, sizeof w->addr);
  }
}

/* Connects to every lower rank (a Unix socket within a host unless TCP is
 * forced) and accepts every higher one. */
static ddp_status connect_peers(ddp_rpc_agent *a, const ddp_rpc_options *opts, const published *all,
                                int tcp_fd, int unix_fd, int64_t deadline) {
  a->conns[a->rank].link = DDP__RPC_LINK_SELF;
  for (int32_t r = 0; r < a->rank; r++) {
    bool same_host = strcmp(all[r].host_id, all[a->rank].host_id) == 0;
    ddp__rpc_link link = same_host && opts->transport == DDP_RPC_TRANSPORT_AUTO
                             ? DDP__RPC_LINK_UNIX : DDP__RPC_LINK_TCP;
    DDP_TRY(connect_to(a, &all[r], r, link, deadline));
  }
  return accept_all(a, tcp_fd, unix_fd, deadline);
}

/* Prepares every connection, starts the pool, lets every registered module
 * set itself up, then agrees with the others on who may pull from whose
 * memory. */
static ddp_status start_serving(ddp_rpc_agent *a, const published *all, int64_t deadline) {
  for (int32_t r = 0; r < a->world; r++) {
    if (r == a->rank) continue;
    DDP_TRY(ddp__rpc_conn_prepare(&a->conns[r]));
  }
  DDP_TRY(ddp__rpc_pool_start(a));
  ddp_status st = DDP_OK;
  pthread_mutex_lock(&modules_mu);
  for (int m = 0; m < ddp__rpc_num_modules && st == DDP_OK; m++)
    if (ddp__rpc_modules[m]->init) {
      st = ddp__rpc_modules[m]->init(a, m);
      if (st != DDP_OK) st = ddp_error_wrap(st, "rpc init: module %s", ddp__rpc_modules[m]->name);
    }
  pthread_mutex_unlock(&modules_mu);
  DDP_TRY(st);
  DDP_TRY(publish_pulls(a, all));
  DDP_TRY(barrier(a, "init", deadline));
  return read_pulls(a);
}

ddp_status ddp_rpc_init(const ddp_rpc_options *opts, ddp_rpc_agent **out) {
  *out = NULL;
  if (!opts) return ddp_error(DDP_ERR_INVALID, "rpc init: NULL options");
  DDP_TRY(ddp__rpc_check_name("rpc init: worker", opts->name));
  ddp_rpc_agent *a = agent_alloc();
  if (!a) return ddp_error(DDP_ERR_NOMEM, "rpc init: out of memory");
  int tcp_fd = -1, unix_fd = -1;
  published *all = NULL;
  ddp_store *base = NULL;
  double init_timeout_s = 0;
  int64_t deadline = 0;
  ddp_status st = resolve_settings(a, opts);
  if (st == DDP_OK) st = meet(a, opts, &base, &init_timeout_s);
  if (st == DDP_OK) {
    deadline = ddp_time_ns() + (int64_t)(init_timeout_s * 1e9);
    st = ddp_store_prefix(base, "rpc/", &a->store);
  }
  if (st == DDP_OK) st = alloc_peers(a, &all);
  if (st == DDP_OK) st = listen_and_publish(a, opts, base, &tcp_fd, &unix_fd);
  if (st == DDP_OK) {
    int64_t left_ms = (deadline - ddp_time_ns()) / 1000000;
    st = gather(a, all, left_ms > 0 ? left_ms : 0);
  }
  if (st == DDP_OK) st = check_unique_names(a, all);
  if (st == DDP_OK) {
    describe_workers(a, all);
    st = connect_peers(a, opts, all, tcp_fd, unix_fd, deadline);
  }
  if (tcp_fd >= 0) close(tcp_fd);
  if (unix_fd >= 0) close(unix_fd);
  if (st == DDP_OK) st = start_serving(a, all, deadline);
  ddp_free(all);
  if (st != DDP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
    agent_free(a);
    return ddp_error(st, "%s", msg);
  }
  *out = a;
  return DDP_OK;
}

/* ---- Shutdown ------------------------------------------------------------------- */

static void agent_free(ddp_rpc_agent *a) {
  pthread_mutex_lock(&a->mu);
  a->state = DDP__RPC_STOPPING;
  pthread_mutex_unlock(&a->mu);
  /* Wake the readers (a shut-down socket reads as closed); the threads are
   * joined below. */
  for (int32_t r = 0; a->conns && r < a->world; r++)
    if (a->conns[r].fd >= 0) shutdown(a->conns[r].fd, SHUT_RDWR);
  /* Calls still pending fail (a non-graceful shutdown, or calls made after
   * the graceful wait). */
  for (;;) {
    pthread_mutex_lock(&a->mu);
    ddp_rpc_future *f = NULL;
    for (int b = 0; b < DDP__RPC_PENDING_BUCKETS && !f; b++) f = a->pending[b];
    if (f) ddp__rpc_pending_remove_locked(a, f);
    pthread_mutex_unlock(&a->mu);
    if (!f) break;
    char msg[256];
    snprintf(msg, sizeof msg, "rpc to worker '%s' (rank %d), function '%s': the agent was shut down",
             a->workers[f->to].name, f->to, f->fn);
    ddp__rpc_future_finish(f, DDP_ERR_STATE, NULL, msg);
    ddp_rpc_future_destroy(f);
  }
  ddp__rpc_pool_stop(a);
  /* A deferred reply still being sent from a thread of the user's: its send
   * gives up at the default timeout, so this wait ends; past twice that the
   * agent is left allocated (a leak) rather than freed under that thread. */
  int64_t limit_ms = 2 * a->default_timeout_ns / 1000000 + 1000;
  for (int64_t waited_ms = 0; atomic_load(&a->outside_users) > 0; waited_ms++) {
    if (waited_ms == limit_ms) {
      ddp_log(DDP_LOG_ERROR, "rpc: worker '%s': a thread is still inside ddp_rpc_reply_send after "
              "%lld ms; the agent is not freed",
              a->workers ? a->workers[a->rank].name : "?", (long long)waited_ms);
      return;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  pthread_mutex_lock(&modules_mu);
  for (int m = 0; m < ddp__rpc_num_modules; m++)
    if (ddp__rpc_modules[m]->destroy) ddp__rpc_modules[m]->destroy(a, m);
  pthread_mutex_unlock(&modules_mu);
  for (int32_t r = 0; a->conns && r < a->world; r++) {
    if (a->conns[r].fd >= 0) close(a->conns[r].fd);
    ddp__rpc_release_held(&a->conns[r]);
    ddp_free(a->conns[r].rbuf);
    pthread_mutex_destroy(&a->conns[r].write_mu);
    pthread_cond_destroy(&a->conns[r].pulled_cv);
  }
  ddp_free(a->threads);
  ddp_free(a->conns);
  ddp_free(a->workers);
  ddp_store_destroy(a->store);
  if (a->have_rdzv) ddp_rendezvous_info_destroy(&a->rdzv);
  pthread_mutex_destroy(&a->mu);
  pthread_cond_destroy(&a->work_cv);
  pthread_cond_destroy(&a->outstanding_cv);
  pthread_cond_destroy(&a->timer_cv);
  ddp_free(a);
}

static void timed_wait(ddp_rpc_agent *a, int64_t deadline_ns) {
  int64_t wake = deadline_ns;
  int64_t cap = ddp_time_ns() + 100 * 1000000LL;
  if (wake > cap) wake = cap;
  struct timespec ts = {.tv_sec = (time_t)(wake / 1000000000), .tv_nsec = (long)(wake % 1000000000)};
  pthread_cond_timedwait(&a->outstanding_cv, &a->mu, &ts);
}

ddp_status ddp_rpc_shutdown(ddp_rpc_agent *a, bool graceful, double timeout_s) {
  if (!a) return DDP_OK;
  for (int m = 0; m < ddp__rpc_num_modules; m++)
    if (ddp__rpc_modules[m]->before_shutdown) ddp__rpc_modules[m]->before_shutdown(a, m, graceful);
  ddp_status st = DDP_OK;
  char msg[1024] = "";
  if (graceful) {
    int64_t deadline = ddp_time_ns() + (timeout_s > 0 ? (int64_t)(timeout_s * 1e9) : a->default_timeout_ns);
    pthread_mutex_lock(&a->mu);
    a->state = DDP__RPC_DRAINING;
    while (a->outstanding > 0 && ddp_time_ns() < deadline) timed_wait(a, deadline);
    int64_t outstanding = a->outstanding;
    pthread_mutex_unlock(&a->mu);
    /* Tell every live worker that this one is done. */
    for (int32_t r = 0; r < a->world; r++) {
      if (r == a->rank) continue;
      pthread_mutex_lock(&a->mu);
      bool open = a->conns[r].state == DDP__RPC_CONN_OPEN;
      pthread_mutex_unlock(&a->mu);
      if (open) ddp__rpc_send_frame(&a->conns[r], DDP__RPC_DONE, 0, DDP_OK, NULL, 0, NULL, deadline);
    }
    /* Wait for every live worker's DONE; a dead one is skipped. */
    pthread_mutex_lock(&a->mu);
    for (;;) {
      bool all = true;
      for (int32_t r = 0; r < a->world && all; r++)
        if (r != a->rank && !a->conns[r].done_received && a->conns[r].state == DDP__RPC_CONN_OPEN)
          all = false;
      if (all || ddp_time_ns() >= deadline) break;
      timed_wait(a, deadline);
    }
    size_t used = 0;
    for (int32_t r = 0; r < a->world; r++) {
      ddp__rpc_conn *c = &a->conns[r];
      /* One that sent DONE and then died (while still serving) is named too. */
      if (r == a->rank || (c->done_received && c->state != DDP__RPC_CONN_FAILED)) continue;
      if (c->state == DDP__RPC_CONN_OPEN) st = DDP_ERR_TIMEOUT;
      else if (st == DDP_OK) st = DDP_ERR_PEER;
      if (used + 8 >= sizeof msg) continue;
      if (c->state == DDP__RPC_CONN_OPEN)
        used += (size_t)snprintf(msg + used, sizeof msg - used, "%sworker '%s' (rank %d) not heard from",
                                 used ? "; " : "", a->workers[r].name, r);
      else
        used += (size_t)snprintf(msg + used, sizeof msg - used, "%s%s", used ? "; " : "", c->error);
    }
    pthread_mutex_unlock(&a->mu);
    if (outstanding > 0 && st == DDP_OK) {
      st = DDP_ERR_TIMEOUT;
      snprintf(msg, sizeof msg, "%lld calls of this worker were still pending", (long long)outstanding);
    }
  }
  /* Last on the wire: the others tell this shutdown from a death. */
  for (int32_t r = 0; r < a->world; r++) {
    if (r == a->rank) continue;
    pthread_mutex_lock(&a->mu);
    bool open = a->conns[r].state == DDP__RPC_CONN_OPEN;
    pthread_mutex_unlock(&a->mu);
    if (open) ddp__rpc_send_bye(&a->conns[r], graceful);
  }
  const char *self_name = a->workers[a->rank].name;
  char name[DDP_RPC_MAX_NAME_BYTES];
  snprintf(name, sizeof name, "%s", self_name);
  agent_free(a);
  if (st == DDP_ERR_PEER)
    return ddp_error(st, "rpc shutdown of worker '%s': completed without the workers that died: %s",
                     name, msg);
  if (st != DDP_OK)
    return ddp_error(st, "rpc shutdown of worker '%s': timed out after %.3g s; %s", name,
                     timeout_s, msg);
  return DDP_OK;
}

/* ---- Queries --------------------------------------------------------------------- */

const ddp_rpc_worker_info *ddp_rpc_self(const ddp_rpc_agent *agent) {
  return &agent->workers[agent->rank];
}

int32_t ddp_rpc_world_size(const ddp_rpc_agent *agent) { return agent->world; }

ddp_status ddp_rpc_get_worker_info(const ddp_rpc_agent *agent, const char *name, int32_t rank,
                                   ddp_rpc_worker_info *out) {
  memset(out, 0, sizeof *out);
  for (int32_t r = 0; r < agent->world; r++)
    if (name ? strcmp(agent->workers[r].name, name) == 0 : r == rank) {
      *out = agent->workers[r];
      return DDP_OK;
    }
  char names[512];
  size_t used = 0;
  names[0] = '\0';
  for (int32_t r = 0; r < agent->world && used + 80 < sizeof names; r++)
    used += (size_t)snprintf(names + used, sizeof names - used, "%s'%s'", r ? ", " : "",
                             agent->workers[r].name);
  if (name)
    return ddp_error(DDP_ERR_NOTFOUND, "rpc: no worker named '%s' (workers: %s)", name, names);
  return ddp_error(DDP_ERR_NOTFOUND, "rpc: no worker of rank %d (world size %d: %s)", rank,
                   agent->world, names);
}

const char *ddp_rpc_transport_name(const ddp_rpc_agent *agent, int32_t rank) {
  if (!agent || rank < 0 || rank >= agent->world) return "?";
  switch (agent->conns[rank].link) {
    case DDP__RPC_LINK_SELF: return "self";
    case DDP__RPC_LINK_UNIX: return "unix";
    case DDP__RPC_LINK_TCP: return "tcp";
  }
  return "?";
}
