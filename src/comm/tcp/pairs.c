/* The tcp backend's pairs: choosing and publishing this rank's address,
 * socket options, and connecting the full mesh with a handshake. Moving
 * frames over the pairs is tcp/engine.c's. */
#include "comm/tcp/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp/store.h"
#include "net/net.h"

/* ---- Choosing the address to listen on ------------------------------------ */

/* The address this rank listens on and publishes: net's choice
 * (DDP_COMM_ADDR, DDP_SOCKET_IFNAME, 127.0.0.1 when every rank is on this
 * host, the route to the store's host, ...). */
static ddp_status choose_address(const ddp__backend_config *cfg, char *host, size_t cap) {
  static const char *const vars[] = {"DDP_COMM_ADDR", NULL};
  bool one_host = cfg->host_of != NULL;
  for (int r = 0; one_host && r < cfg->size; r++)
    if (cfg->host_of[r] != cfg->host_of[cfg->rank]) one_host = false;
  return ddp__net_choose_address("tcp backend", vars, one_host, ddp_store_address(cfg->store), host, cap);
}

/* Socket buffers: left to the kernel's autotuning, which grows a busy
 * connection's buffers up to net.ipv4.tcp_[rw]mem's maximum (32 MiB for
 * receiving here): a fixed SO_RCVBUF turns autotuning off and is clamped to
 * net.core.rmem_max (4 MiB here); measured on loopback at 64 MiB, 2 ranks,
 * autotuning gave 0.89-1.02 GB/s against 0.74-0.83 with 4 MiB fixed (1 Gbit/s
 * netns: 95% either way). DDP_SOCKET_BUFFER=bytes fixes both buffers.
 *
 * Keepalive probes after DDP_SOCKET_KEEPALIVE seconds of silence (default
 * 3; 0 turns them off), then every second, 3 times: a peer host that
 * vanished without closing (power loss, a partition) fails the connection
 * in about 6 s. A live peer's kernel answers probes whatever its process is
 * doing, so a rank busy computing is never mistaken for a dead one. */
static void set_socket_options(int fd) {
  int64_t bytes = 0;
  if (ddp_env_int("DDP_SOCKET_BUFFER", 0, &bytes) != DDP_OK) bytes = 0;
  if (bytes > 0) {
    int v = bytes > (1 << 30) ? 1 << 30 : (int)bytes;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
  }
  int64_t idle = 3;
  if (ddp_env_int("DDP_SOCKET_KEEPALIVE", idle, &idle) != DDP_OK) idle = 3;
  if (idle > 0) {
    int on = 1, idle_s = idle > 3600 ? 3600 : (int)idle, interval_s = 1, probes = 3;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  }
}

/* ---- Handshake ------------------------------------------------------------- */

#define HELLO_MAGIC 0x444450484c4f3031ull /* "DDPHLO01" */

/* Sent by the lower rank right after connecting; the higher rank answers
 * with its own hello (from/to swapped) when it accepts. The nonce is the
 * acceptor's, as published: it tells a stale address (an earlier group's
 * listener) from this group's. */
typedef struct hello {
  uint64_t magic;
  int32_t size, from, to, pad;
  uint64_t nonce;
  char addr[DDP_NET_ADDR_BYTES]; /* the sender's published address */
} hello;

static void key_for(int rank, char *key, size_t cap) { snprintf(key, cap, "tcp/addr/%d", rank); }

/* Parses "host port nonce". */
static int parse_published(const char *v, char *host, size_t cap, uint16_t *port,
                           uint64_t *nonce) {
  const char *sp = strchr(v, ' ');
  if (!sp || (size_t)(sp - v) >= cap) return -1;
  memcpy(host, v, (size_t)(sp - v));
  host[sp - v] = '\0';
  unsigned p;
  unsigned long long n;
  if (sscanf(sp + 1, "%u %llx", &p, &n) != 2 || p == 0 || p > 65535) return -1;
  *port = (uint16_t)p;
  *nonce = n;
  return 0;
}

static int64_t ms_until(int64_t deadline_ns) {
  int64_t left = (deadline_ns - ddp_time_ns()) / 1000000;
  return left < 0 ? 0 : left;
}

/* Connects to `peer` (a higher rank) and sends the hello; retries with
 * backoff (10 ms doubling to 1 s) until the deadline, re-reading the peer's
 * address each time (it may be republished by a restarted group). */
static ddp_status connect_peer(ddp__tcp_backend *b, ddp_store *store, int peer,
                               int64_t deadline_ns) {
  char key[64];
  key_for(peer, key, sizeof key);
  int64_t backoff_ms = 10;
  for (;;) {
    void *v = NULL;
    size_t vlen = 0;
    ddp_status st = ddp_store_get(store, key, ms_until(deadline_ns), &v, &vlen);
    if (st != DDP_OK)
      return ddp_error_wrap(st, "tcp backend: rank %d: reading rank %d's address", b->rank, peer);
    char host[DDP_NET_ADDR_BYTES];
    uint16_t port;
    uint64_t nonce;
    int bad = parse_published(v, host, sizeof host, &port, &nonce);
    ddp_free(v);
    if (bad)
      return ddp_error(DDP_ERR_FORMAT, "tcp backend: rank %d's published address is malformed",
                       peer);
    ddp__tcp_pair *p = &b->pairs[peer];
    ddp__net_format_host_port(host, port, p->addr, sizeof p->addr);
    int fd = -1;
    st = ddp__net_connect(host, port, deadline_ns, &fd);
    if (st == DDP_OK) {
      hello h = {.magic = HELLO_MAGIC, .size = b->size, .from = b->rank, .to = peer,
                 .nonce = nonce};
      snprintf(h.addr, sizeof h.addr, "%s", b->local_addr);
      st = ddp__net_write_full(fd, &h, sizeof h, deadline_ns);
      if (st == DDP_OK) {
        p->fd = fd;
        p->session = nonce;
        return DDP_OK;
      }
      close(fd);
    }
    if (st == DDP_ERR_TIMEOUT || ddp_time_ns() >= deadline_ns)
      return ddp_error(DDP_ERR_TIMEOUT, "tcp backend: rank %d: cannot connect to rank %d (%s): %s",
                       b->rank, peer, p->addr, ddp_last_error());
    DDP_DEBUG("tcp backend: connect to rank %d (%s) failed (%s); retrying", peer, p->addr,
              ddp_last_error());
    int64_t left = ms_until(deadline_ns);
    int64_t sleep_ms = backoff_ms < left ? backoff_ms : left;
    usleep((useconds_t)(sleep_ms * 1000));
    backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
  }
}

/* Accepts until every lower rank has connected with a valid hello; strays
 * (bad magic, wrong nonce, a rank already connected) are dropped. */
static ddp_status accept_peers(ddp__tcp_backend *b, int listen_fd, uint64_t nonce,
                               int64_t deadline_ns, const bool *wanted) {
  int missing = 0;
  for (int q = 0; q < b->rank; q++) missing += wanted[q];
  while (missing > 0) {
    ddp_status st = ddp__net_wait(listen_fd, POLLIN, deadline_ns);
    if (st != DDP_OK) {
      int first = 0;
      while (first < b->rank && (!wanted[first] || b->pairs[first].fd >= 0)) first++;
      return ddp_error(st, "tcp backend: rank %d: %d lower rank(s) did not connect (rank %d "
                           "first) within the timeout",
                       b->rank, missing, first);
    }
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      return ddp_error(DDP_ERR_SYS, "tcp backend: accept: %s", strerror(errno));
    }
    if (ddp__net_set_nonblocking(fd, 0) != DDP_OK) {
      close(fd);
      continue;
    }
    hello h;
    int64_t hello_deadline = ddp_time_ns() + 5000000000LL;
    if (hello_deadline > deadline_ns) hello_deadline = deadline_ns;
    char peer_addr[DDP_NET_ADDR_BYTES];
    ddp__net_peer_addr(fd, peer_addr, sizeof peer_addr);
    if (ddp__net_read_full(fd, &h, sizeof h, hello_deadline) != DDP_OK ||
        h.magic != HELLO_MAGIC || h.nonce != nonce || h.to != b->rank || h.size != b->size ||
        h.from < 0 || h.from >= b->rank || !wanted[h.from] || b->pairs[h.from].fd >= 0) {
      DDP_WARN("tcp backend: rank %d: dropped a connection from %s that is not a peer of this "
               "group (bad or stale handshake)",
               b->rank, peer_addr);
      close(fd);
      continue;
    }
    ddp__tcp_pair *p = &b->pairs[h.from];
    h.addr[sizeof h.addr - 1] = '\0';
    snprintf(p->addr, sizeof p->addr, "%s", h.addr);
    p->session = nonce;
    hello reply = {.magic = HELLO_MAGIC, .size = b->size, .from = b->rank, .to = h.from,
                   .nonce = nonce};
    snprintf(reply.addr, sizeof reply.addr, "%s", b->local_addr);
    if (ddp__net_write_full(fd, &reply, sizeof reply, hello_deadline) != DDP_OK) {
      close(fd);
      continue;
    }
    ddp__net_set_nodelay(fd);
    p->fd = fd;
    missing--;
  }
  return DDP_OK;
}

ddp_status ddp__tcp_connect_mesh(ddp__tcp_backend *b, const ddp__backend_config *cfg) {
  int64_t timeout_ns = cfg->timeout_ns > 0 ? cfg->timeout_ns
                                            : ddp_store_default_timeout_ms() * 1000000LL;
  int64_t deadline_ns = ddp_time_ns() + timeout_ns;
  char host[DDP_NET_ADDR_BYTES];
  DDP_TRY(choose_address(cfg, host, sizeof host));
  /* The pairs to connect: all, or (hier/hier.c) only those on different hosts. */
  bool *wanted = ddp_calloc((size_t)b->size, sizeof *wanted);
  if (!wanted) return ddp_error(DDP_ERR_NOMEM, "tcp backend: out of memory");
  for (int q = 0; q < b->size; q++)
    wanted[q] = q != b->rank && !(cfg->skip_colocated && cfg->host_of &&
                                  cfg->host_of[q] == cfg->host_of[b->rank]);
  int listen_fd = -1;
  ddp_status st = ddp__net_listen(host, 0, b->size + 16, &listen_fd);
  if (st != DDP_OK) {
    ddp_free(wanted);
    return ddp_error_wrap(st, "tcp backend: rank %d (DDP_COMM_ADDR / DDP_SOCKET_IFNAME choose "
                              "the address)",
                          b->rank);
  }
  uint16_t port = ddp__net_local_port(listen_fd);
  ddp__net_format_host_port(host, port, b->local_addr, sizeof b->local_addr);
  snprintf(b->pairs[b->rank].addr, sizeof b->pairs[b->rank].addr, "%s", b->local_addr);
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
    nonce = (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 32);
  char key[64], value[DDP_NET_ADDR_BYTES + 48];
  key_for(b->rank, key, sizeof key);
  snprintf(value, sizeof value, "%s %u %016" PRIx64, host, port, nonce);
  st = ddp_store_set(cfg->store, key, value, strlen(value));
  if (st != DDP_OK) {
    st = ddp_error_wrap(st, "tcp backend: rank %d: publishing its address", b->rank);
    goto out;
  }
  /* Lower connects to higher. Hellos go out before accepting (the kernel
   * queues them in the backlog), so nobody waits on a rank that is itself
   * still connecting; the answers are read last. */
  for (int peer = b->rank + 1; peer < b->size; peer++) {
    if (!wanted[peer]) continue;
    st = connect_peer(b, cfg->store, peer, deadline_ns);
    if (st != DDP_OK) goto out;
  }
  st = accept_peers(b, listen_fd, nonce, deadline_ns, wanted);
  if (st != DDP_OK) goto out;
  for (int peer = b->rank + 1; peer < b->size; peer++) {
    if (!wanted[peer]) continue;
    ddp__tcp_pair *p = &b->pairs[peer];
    hello h;
    st = ddp__net_read_full(p->fd, &h, sizeof h, deadline_ns);
    if (st != DDP_OK) {
      st = ddp_error_wrap(st, "tcp backend: rank %d: handshake with rank %d (%s)", b->rank, peer,
                          p->addr);
      goto out;
    }
    if (h.magic != HELLO_MAGIC || h.from != peer || h.to != b->rank || h.nonce != p->session) {
      st = ddp_error(DDP_ERR_FORMAT, "tcp backend: rank %d: bad handshake answer from %s",
                     b->rank, p->addr);
      goto out;
    }
  }
  for (int peer = 0; peer < b->size; peer++) {
    if (!wanted[peer]) continue;
    st = ddp__net_set_nonblocking(b->pairs[peer].fd, 1);
    if (st != DDP_OK) goto out;
    set_socket_options(b->pairs[peer].fd);
  }
out:
  close(listen_fd);
  ddp_free(wanted);
  return st;
}
