/* bench_store: the TCP store under load, on loopback.
 *
 *   rendezvous   N clients (threads, 1024 by default) each connect, add 1 to
 *                a counter, set their own address key, and wait for all N
 *                address keys -- the shape of a rendezvous where every rank
 *                needs every other's address. Time from release to the last
 *                client done, including connecting.
 *   throughput   64 clients each doing synchronous set + get of a small key
 *                (16-byte values) for 2 s; total operations per second. Runs
 *                alternate with a bare TCP echo of the same shape (the
 *                ceiling on this machine at that moment), reported beside it.
 *
 * The server runs in this process on its own thread (as rank 0 hosts it), or
 * in a separate ddp-store process with --external HOST:PORT. Each figure is
 * the median of --runs runs (default 5).
 *
 * Usage: bench_store [--mode rendezvous|throughput|all] [--clients N]
 *                    [--tp-clients N] [--seconds S] [--runs R]
 *                    [--external HOST:PORT] */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp/store.h"

static const char *host = "127.0.0.1";
static uint16_t port;

typedef struct barrier {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int ready, go;
} barrier;

static barrier start = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

static void wait_go(void) {
  pthread_mutex_lock(&start.mu);
  start.ready++;
  pthread_cond_broadcast(&start.cv);
  while (!start.go) pthread_cond_wait(&start.cv, &start.mu);
  pthread_mutex_unlock(&start.mu);
}

static void release_when_ready(int n) {
  pthread_mutex_lock(&start.mu);
  while (start.ready < n) pthread_cond_wait(&start.cv, &start.mu);
  start.go = 1;
  pthread_cond_broadcast(&start.cv);
  pthread_mutex_unlock(&start.mu);
}

static void reset_barrier(void) {
  start.ready = 0;
  start.go = 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* ---- Rendezvous ----------------------------------------------------------- */

typedef struct rdzv {
  int rank;
  int world;
  int run;
  const char *const *keys; /* all address keys of this run */
  double done_s;
  ddp_status st;
  char err[256];
  pthread_t thread;
} rdzv;

static void *rdzv_main(void *arg) {
  rdzv *r = arg;
  wait_go();
  ddp_store_options o = {.timeout_ms = 60000, .token = ""};
  ddp_store *s = NULL;
  r->st = ddp_store_tcp_connect(host, port, &o, &s);
  char key[64], value[64];
  snprintf(key, sizeof key, "run%d/addr/%d", r->run, r->rank);
  snprintf(value, sizeof value, "10.1.%d.%d:29%03d", r->rank / 256, r->rank % 256, r->rank % 1000);
  char counter[32];
  snprintf(counter, sizeof counter, "run%d/count", r->run);
  if (r->st == DDP_OK) r->st = ddp_store_add(s, counter, 1, NULL);
  if (r->st == DDP_OK) r->st = ddp_store_set(s, key, value, strlen(value));
  if (r->st == DDP_OK) r->st = ddp_store_wait(s, r->keys, (size_t)r->world, 60000);
  r->done_s = ddp_time_s();
  if (r->st != DDP_OK) snprintf(r->err, sizeof r->err, "%s", ddp_last_error());
  ddp_store_destroy(s);
  return NULL;
}

static double rendezvous_once(int n, int run) {
  rdzv *r = calloc((size_t)n, sizeof *r);
  char **keys = calloc((size_t)n, sizeof *keys);
  for (int i = 0; i < n; i++) {
    keys[i] = malloc(64);
    snprintf(keys[i], 64, "run%d/addr/%d", run, i);
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 128 * 1024);
  reset_barrier();
  for (int i = 0; i < n; i++) {
    r[i] = (rdzv){.rank = i, .world = n, .run = run, .keys = (const char *const *)keys};
    if (pthread_create(&r[i].thread, &attr, rdzv_main, &r[i]) != 0) {
      fprintf(stderr, "bench_store: cannot create thread %d\n", i);
      exit(1);
    }
  }
  release_when_ready(n);
  double t0 = ddp_time_s(), last = t0;
  for (int i = 0; i < n; i++) {
    pthread_join(r[i].thread, NULL);
    if (r[i].st != DDP_OK) {
      fprintf(stderr, "bench_store: client %d: %s\n", i, r[i].err);
      exit(1);
    }
    if (r[i].done_s > last) last = r[i].done_s;
  }
  pthread_attr_destroy(&attr);
  for (int i = 0; i < n; i++) free(keys[i]);
  free(keys);
  free(r);
  return last - t0;
}

/* ---- Throughput ------------------------------------------------------------ */

typedef struct tp {
  int id;
  double seconds;
  uint64_t ops;
  double max_op_s; /* slowest set+get pair */
  ddp_status st;
  char err[256];
  pthread_t thread;
} tp;

static void *tp_main(void *arg) {
  tp *t = arg;
  ddp_store_options o = {.timeout_ms = 60000, .token = ""};
  ddp_store *s = NULL;
  t->st = ddp_store_tcp_connect(host, port, &o, &s);
  char key[32];
  snprintf(key, sizeof key, "tp/%d", t->id);
  char value[17];
  wait_go();
  double end = ddp_time_s() + t->seconds;
  uint64_t ops = 0;
  double last = ddp_time_s();
  while (t->st == DDP_OK && (ops & 63 || last < end)) {
    snprintf(value, sizeof value, "%016" PRIx64, ops);
    t->st = ddp_store_set(s, key, value, 16);
    void *got = NULL;
    size_t bytes;
    /* The handle's default timeout, as PyTorch's get(key) uses its store's. */
    if (t->st == DDP_OK) t->st = ddp_store_get(s, key, -1, &got, &bytes);
    if (t->st == DDP_OK && (bytes != 16 || memcmp(got, value, 16))) t->st = DDP_ERR_INTERNAL;
    ddp_free(got);
    ops += 2;
    double now = ddp_time_s();
    if (now - last > t->max_op_s) t->max_op_s = now - last;
    last = now;
  }
  t->ops = ops;
  if (t->st != DDP_OK) snprintf(t->err, sizeof t->err, "%s", ddp_last_error());
  ddp_store_destroy(s);
  return NULL;
}

static double slowest_pair_s; /* over all throughput runs */

static double throughput_once(int n, double seconds) {
  tp *t = calloc((size_t)n, sizeof *t);
  reset_barrier();
  for (int i = 0; i < n; i++) {
    t[i] = (tp){.id = i, .seconds = seconds};
    pthread_create(&t[i].thread, NULL, tp_main, &t[i]);
  }
  release_when_ready(n);
  double t0 = ddp_time_s();
  uint64_t ops = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(t[i].thread, NULL);
    if (t[i].st != DDP_OK) {
      fprintf(stderr, "bench_store: client %d: %s\n", i, t[i].err);
      exit(1);
    }
    ops += t[i].ops;
    if (t[i].max_op_s > slowest_pair_s) slowest_pair_s = t[i].max_op_s;
  }
  double took = ddp_time_s() - t0;
  free(t);
  return (double)ops / took;
}

/* ---- Ceiling: a bare TCP echo ------------------------------------------------
 * The same clients doing send + recv of a 32-byte message against an epoll
 * loop that only echoes: what loopback TCP and the scheduler allow on this
 * machine at the moment, the reference the store's throughput is a fraction
 * of (each store operation is one such round trip plus the store's work). */

typedef struct echo_ctx {
  int listen_fd;
  int stop_fd; /* eventfd */
  uint16_t port;
} echo_ctx;

static void *echo_server(void *arg) {
  echo_ctx *e = arg;
  int ep = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = e->listen_fd};
  epoll_ctl(ep, EPOLL_CTL_ADD, e->listen_fd, &ev);
  struct epoll_event sev = {.events = EPOLLIN, .data.fd = e->stop_fd};
  epoll_ctl(ep, EPOLL_CTL_ADD, e->stop_fd, &sev);
  struct epoll_event evs[256];
  char buf[4096];
  for (;;) {
    int n = epoll_wait(ep, evs, 256, -1);
    for (int i = 0; i < n; i++) {
      int fd = evs[i].data.fd;
      if (fd == e->stop_fd) {
        close(ep);
        return NULL;
      }
      if (fd == e->listen_fd) {
        int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) continue;
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
        epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
        continue;
      }
      ssize_t r = recv(fd, buf, sizeof buf, 0);
      if (r <= 0 || send(fd, buf, (size_t)r, MSG_NOSIGNAL) < 0) close(fd);
    }
  }
}

typedef struct echo_client {
  uint16_t port;
  double seconds;
  uint64_t ops;
  pthread_t thread;
} echo_client;

static void *echo_client_main(void *arg) {
  echo_client *c = arg;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(c->port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int one = 1;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    perror("bench_store: echo connect");
    exit(1);
  }
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  char msg[32] = {0};
  wait_go();
  double end = ddp_time_s() + c->seconds;
  uint64_t ops = 0;
  while (ops & 63 || ddp_time_s() < end) {
    if (send(fd, msg, sizeof msg, MSG_NOSIGNAL) != (ssize_t)sizeof msg) break;
    size_t got = 0;
    while (got < sizeof msg) {
      ssize_t r = recv(fd, msg + got, sizeof msg - got, 0);
      if (r <= 0) break;
      got += (size_t)r;
    }
    ops++;
  }
  c->ops = ops;
  close(fd);
  return NULL;
}

static double echo_once(int n, double seconds) {
  echo_ctx e;
  e.listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (bind(e.listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(e.listen_fd, 4096) != 0 ||
      getsockname(e.listen_fd, (struct sockaddr *)&sa, &len) != 0) {
    perror("bench_store: echo listen");
    exit(1);
  }
  e.port = ntohs(sa.sin_port);
  e.stop_fd = eventfd(0, EFD_CLOEXEC);
  pthread_t server;
  pthread_create(&server, NULL, echo_server, &e);
  echo_client *c = calloc((size_t)n, sizeof *c);
  reset_barrier();
  for (int i = 0; i < n; i++) {
    c[i] = (echo_client){.port = e.port, .seconds = seconds};
    pthread_create(&c[i].thread, NULL, echo_client_main, &c[i]);
  }
  release_when_ready(n);
  double t0 = ddp_time_s();
  uint64_t ops = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(c[i].thread, NULL);
    ops += c[i].ops;
  }
  double took = ddp_time_s() - t0;
  uint64_t one = 1;
  if (write(e.stop_fd, &one, sizeof one) != sizeof one) perror("bench_store: eventfd");
  pthread_join(server, NULL);
  close(e.stop_fd);
  close(e.listen_fd);
  free(c);
  return (double)ops / took;
}

static void raise_fd_limit(int need) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  if ((int)rl.rlim_cur < need)
    fprintf(stderr, "bench_store: warning: RLIMIT_NOFILE is %lu, %d descriptors wanted\n",
            (unsigned long)rl.rlim_cur, need);
}

int main(int argc, char **argv) {
  const char *mode = "all", *external = NULL;
  int clients = 1024, tp_clients = 64, runs = 5;
  double seconds = 2.0;
  for (int i = 1; i < argc; i++) {
    const char *next = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(argv[i], "--mode") && next) mode = argv[++i];
    else if (!strcmp(argv[i], "--clients") && next) clients = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--tp-clients") && next) tp_clients = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--runs") && next) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--seconds") && next) seconds = atof(argv[++i]);
    else if (!strcmp(argv[i], "--external") && next) external = argv[++i];
    else {
      fprintf(stderr,
              "usage: bench_store [--mode rendezvous|throughput|all] [--clients N] "
              "[--tp-clients N] [--seconds S] [--runs R] [--external HOST:PORT]\n");
      return 2;
    }
  }
  if (clients < 1 || tp_clients < 1 || runs < 1 || runs > 99) return 2;
  raise_fd_limit(2 * clients + 64);

  ddp_store_server *server = NULL;
  static char host_buf[256];
  if (external) {
    const char *colon = strrchr(external, ':');
    if (!colon || colon == external) return 2;
    snprintf(host_buf, sizeof host_buf, "%.*s", (int)(colon - external), external);
    host = host_buf;
    port = (uint16_t)atoi(colon + 1);
  } else {
    ddp_store_server_options so = {.token = ""};
    if (ddp_store_server_start("127.0.0.1", 0, &so, &server) != DDP_OK) {
      fprintf(stderr, "bench_store: %s\n", ddp_last_error());
      return 1;
    }
    port = ddp_store_server_port(server);
  }
  const char *where = external ? "external server" : "in-process server thread";

  if (!strcmp(mode, "all") || !strcmp(mode, "rendezvous")) {
    double t[99];
    for (int r = 0; r < runs; r++) t[r] = rendezvous_once(clients, r);
    qsort(t, (size_t)runs, sizeof t[0], cmp_double);
    printf(
        "rendezvous: %d clients (connect + add + set + wait for all %d keys), %s: "
        "median %.3f s (min %.3f, max %.3f, %d runs)\n",
        clients, clients, where, t[runs / 2], t[0], t[runs - 1], runs);
  }
  if (!strcmp(mode, "all") || !strcmp(mode, "throughput")) {
    /* Interleave store and echo runs so both see the same machine load. */
    double t[99], e[99];
    for (int r = 0; r < runs; r++) {
      t[r] = throughput_once(tp_clients, seconds);
      e[r] = echo_once(tp_clients, seconds);
    }
    qsort(t, (size_t)runs, sizeof t[0], cmp_double);
    qsort(e, (size_t)runs, sizeof e[0], cmp_double);
    printf(
        "throughput: %d clients, synchronous set+get of 16-byte values for %.1f s, %s: "
        "median %.0f ops/s (min %.0f, max %.0f, %d runs; slowest set+get %.1f ms)\n",
        tp_clients, seconds, where, t[runs / 2], t[0], t[runs - 1], runs, slowest_pair_s * 1e3);
    printf(
        "ceiling: %d clients, bare TCP echo round trips (32 bytes) on loopback: "
        "median %.0f round trips/s (min %.0f, max %.0f); store/ceiling = %.2f\n",
        tp_clients, e[runs / 2], e[0], e[runs - 1], t[runs / 2] / e[runs / 2]);
  }
  fflush(stdout);
  ddp_store_server_stop(server);
  return 0;
}
