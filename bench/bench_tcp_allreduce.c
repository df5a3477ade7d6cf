/* Allreduce over TCP through the public API (float32 sum), in the style of
 * nccl-tests: size, count, time, algbw and busbw (= algbw * 2(P-1)/P).
 *
 *   bench_tcp_allreduce --nproc 2 [-b 8] [-e 64M] [-f 4] [-n 20] [-w 5] [-c 1] [--json]
 *       P ranks on this host over loopback (a store process and P rank
 *       processes, forked here; the group is created with transport "tcp");
 *   bench_tcp_allreduce --rank R --world P --store HOST:PORT [--serve] [...]
 *       one rank of a world spread over hosts (or network namespaces); the
 *       rank given --serve hosts the store on HOST:PORT. The group picks the
 *       transport itself (tcp between hosts: different hostnames, network
 *       namespaces or DDP_HOST_ID), and the tcp backend listens on the
 *       address that routes to the store (or DDP_COMM_ADDR /
 *       DDP_SOCKET_IFNAME).
 * Rank 0 prints the table; --json prints one object per size instead.
 * --counters: at the end every rank prints one JSON object with its
 * transport towards each rank and what each transport carried
 * (ddp_process_group_counters). Used by tests/comm/test_tcp_netns.sh and
 * test_hier_netns.sh. Until ddp-bench drives process groups,
 * this is the tcp transport's benchmark (BENCHMARKS.md). */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/comm.h"
#include "ddp/store.h"

typedef struct opts {
  int nproc, rank, world, serve, check, json, counters, iters, warmup;
  size_t min_bytes, max_bytes;
  double factor;
  char store_host[256];
  uint16_t store_port;
} opts;

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

static void usage(void) {
  fprintf(stderr,
          "usage: bench_tcp_allreduce (--nproc P | --rank R --world P --store HOST:PORT "
          "[--serve])\n"
          "       [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-c 0|1] [--json]\n"
          "       [--counters]\n");
}

static int run_rank(const opts *o, int rank, int world) {
  ddp_store *store = NULL;
  ddp_store_server *server = NULL;
  ddp_process_group *pg = NULL;
  float *buf = NULL;
  ddp_status st;
  if (o->serve) {
    st = ddp_store_server_start(o->store_host, o->store_port, NULL, &server);
    if (st != DDP_OK) goto fail;
  }
  ddp_store_options so = {.timeout_ms = 60000};
  st = ddp_store_tcp_connect(o->store_host, o->store_port, &so, &store);
  if (st != DDP_OK) goto fail;
  /* Local runs force tcp (one host would pick shared memory); spread runs
   * let the group choose, so the transport printed is what users get. */
  ddp_process_group_options po = {.timeout_s = 120, .transport = o->nproc ? "tcp" : NULL};
  st = ddp_process_group_create(store, rank, world, &po, &pg);
  if (st != DDP_OK) goto fail;
  buf = ddp_alloc(o->max_bytes + 64);
  if (!buf) goto fail;
  const char *transport = ddp_process_group_transport(pg, (rank + 1) % world);
  if (rank == 0 && !o->json)
    printf("# tcp allreduce, %d ranks, float32 sum, transport %s\n"
           "#%11s %12s %10s %10s %10s %6s\n",
           world, transport, "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
           "check");
  for (size_t bytes = o->min_bytes;;) {
    size_t count = bytes / 4;
    for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1);
    /* As nccl-tests: warm-up, a barrier, then the timed iterations back to
     * back on the same buffer (values grow; the speed does not change), and
     * with -c 1 one more allreduce of fresh data, checked. */
    int bad = 0;
    double t = 0;
    for (int it = 0; it < o->warmup + o->iters; it++) {
      if (it == o->warmup) {
        st = ddp_barrier(pg);
        if (st != DDP_OK) goto fail;
        t = ddp_time_s();
      }
      st = ddp_allreduce(pg, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM);
      if (st != DDP_OK) goto fail;
    }
    double us = (ddp_time_s() - t) / o->iters * 1e6;
    if (o->check) {
      for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1);
      st = ddp_allreduce(pg, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM);
      if (st != DDP_OK) goto fail;
      for (size_t i = 0; i < count && !bad; i++) bad = buf[i] != (float)(world * (world + 1) / 2);
    }
    /* The slowest rank's time is the collective's. */
    double worst = us;
    st = ddp_allreduce(pg, &worst, 1, DDP_FLOAT64, DDP_REDUCE_MAX);
    if (st != DDP_OK) goto fail;
    double algbw = (double)count * 4 / (worst * 1e-6) / 1e9;
    double busbw = algbw * 2.0 * (world - 1) / world;
    if (rank == 0) {
      if (o->json)
        printf("{\"op\":\"allreduce\",\"size\":%zu,\"count\":%zu,\"dtype\":\"float32\","
               "\"time_us\":%.2f,\"algbw\":%.4f,\"busbw\":%.4f,\"transport\":\"%s\","
               "\"ranks\":%d,\"check\":%s}\n",
               count * 4, count, worst, algbw, busbw, transport, world,
               o->check ? (bad ? "false" : "true") : "null");
      else
        printf(" %11zu %12zu %10.1f %10.3f %10.3f %6s\n", count * 4, count, worst, algbw, busbw,
               o->check ? (bad ? "FAIL" : "ok") : "-");
      fflush(stdout);
    }
    if (bad) {
      fprintf(stderr, "rank %d: wrong result at %zu bytes\n", rank, bytes);
      return 1;
    }
    if (bytes >= o->max_bytes) break;
    size_t next = (size_t)((double)bytes * o->factor);
    bytes = next <= bytes ? bytes + 4 : next > o->max_bytes ? o->max_bytes : next;
  }
  if (o->counters) {
    ddp_comm_counters c;
    ddp_process_group_counters(pg, &c);
    printf("{\"rank\":%d,\"transports\":\"", rank);
    for (int q = 0; q < world; q++)
      printf("%s%s", q ? "," : "", ddp_process_group_transport(pg, q));
    printf("\",\"tcp_bytes_sent\":%llu,\"tcp_bytes_received\":%llu,\"shm_bytes\":%llu,"
           "\"threads_bytes\":%llu}\n",
           (unsigned long long)c.tcp_bytes_sent, (unsigned long long)c.tcp_bytes_received,
           (unsigned long long)c.shm_bytes, (unsigned long long)c.threads_bytes);
    fflush(stdout);
  }
  ddp_free(buf);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  ddp_store_server_stop(server);
  return 0;
fail:
  fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error());
  return 1;
}

int main(int argc, char **argv) {
  opts o = {.iters = 20, .warmup = 5, .check = 1, .min_bytes = 8, .max_bytes = 64 << 20,
            .factor = 4, .rank = -1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--json")) { o.json = 1; continue; }
    if (!strcmp(a, "--serve")) { o.serve = 1; continue; }
    if (!strcmp(a, "--counters")) { o.counters = 1; continue; }
    if (!v) { usage(); return 2; }
    i++;
    if (!strcmp(a, "--nproc")) o.nproc = atoi(v);
    else if (!strcmp(a, "--rank")) o.rank = atoi(v);
    else if (!strcmp(a, "--world")) o.world = atoi(v);
    else if (!strcmp(a, "--store")) {
      const char *colon = strrchr(v, ':');
      if (!colon || colon == v || (size_t)(colon - v) >= sizeof o.store_host) { usage(); return 2; }
      memcpy(o.store_host, v, (size_t)(colon - v));
      o.store_port = (uint16_t)atoi(colon + 1);
    }
    else if (!strcmp(a, "-b")) o.min_bytes = parse_size(v);
    else if (!strcmp(a, "-e")) o.max_bytes = parse_size(v);
    else if (!strcmp(a, "-f")) o.factor = atof(v);
    else if (!strcmp(a, "-n")) o.iters = atoi(v);
    else if (!strcmp(a, "-w")) o.warmup = atoi(v);
    else if (!strcmp(a, "-c")) o.check = atoi(v);
    else { usage(); return 2; }
  }
  if (o.min_bytes < 4) o.min_bytes = 4;
  if (o.max_bytes < o.min_bytes || o.iters < 1 || o.factor <= 1) { usage(); return 2; }
  if (!o.nproc) {
    if (o.rank < 0 || o.world < 1 || o.rank >= o.world || !o.store_port) { usage(); return 2; }
    return run_rank(&o, o.rank, o.world);
  }
  /* Local: a store in its own process (ranks never fork from a process with
   * a server thread), then the ranks. */
  if (o.nproc < 1 || o.nproc > 256) { usage(); return 2; }
  int fds[2];
  if (pipe(fds) != 0) return 1;
  pid_t store_pid = fork();
  if (store_pid == 0) {
    ddp_store_server *srv = NULL;
    if (ddp_store_server_create("127.0.0.1", 0, NULL, &srv) != DDP_OK) _exit(1);
    uint16_t port = ddp_store_server_port(srv);
    if (write(fds[1], &port, sizeof port) != sizeof port) _exit(1);
    ddp_store_server_run(srv);
    _exit(0);
  }
  if (read(fds[0], &o.store_port, sizeof o.store_port) != sizeof o.store_port) return 1;
  snprintf(o.store_host, sizeof o.store_host, "127.0.0.1");
  pid_t pids[256];
  fflush(stdout);
  for (int r = 0; r < o.nproc; r++) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(run_rank(&o, r, o.nproc));
  }
  int rc = 0;
  for (int r = 0; r < o.nproc; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) rc = 1;
  }
  kill(store_pid, SIGKILL);
  waitpid(store_pid, NULL, 0);
  return rc;
}
