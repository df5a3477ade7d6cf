/* bench_p2p: a 2-rank neighbour exchange through ddp_batch_isend_irecv, as a
 * pipeline stage pair does it, on the local backend between processes
 * ("shm", fork) or, with -t, the tcp backend on loopback:
 *   exchange   both ranks post one batch [send S bytes, recv S bytes] to
 *              each other and wait (1F1B's steady state); bandwidth is the
 *              bytes each rank moves, 2S, over the time;
 *   round trip rank 0 sends S bytes, rank 1 receives them and sends S back
 *              (ping-pong, one batch of one op each way); the time of one
 *              round trip.
 * Sizes 4 B, 64 KiB, 1 MiB, 16 MiB; each figure is the median over -r runs
 * (default 7) of the mean of a run's iterations, printed as one line per
 * size (and JSON lines with -j).
 *
 *   bench_p2p [-t] [-r runs] [-j] */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/ddp.h"

static const size_t SIZES[] = {4, 64 << 10, 1 << 20, 16 << 20};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])
#define MAX_RUNS 31

typedef struct result {
  double exchange_us[N_SIZES][MAX_RUNS];
  double rtt_us[N_SIZES][MAX_RUNS];
} result;

static int g_runs = 7, g_tcp = 0, g_json = 0;

static int iters_for(size_t bytes) {
  size_t it = (size_t)(256u << 20) / (bytes + 4096);
  if (it < 10) it = 10;
  if (it > 2000) it = 2000;
  return (int)it;
}

static void die(int rank, const char *what) {
  fprintf(stderr, "rank %d: %s: %s\n", rank, what, ddp_last_error());
  _exit(1);
}

static void exchange(ddp_process_group *pg, int rank, void *send, void *recv, size_t count) {
  ddp_p2p_op ops[2] = {{DDP_P2P_SEND, send, count, DDP_FLOAT32, 1 - rank, 0},
                       {DDP_P2P_RECV, recv, count, DDP_FLOAT32, 1 - rank, 0}};
  ddp_work *w = NULL;
  if (ddp_batch_isend_irecv(pg, ops, 2, &w) != DDP_OK) die(rank, "batch_isend_irecv");
  if (ddp_work_wait(w, -1) != DDP_OK) die(rank, "wait");
  ddp_work_free(w);
}

static void one_way(ddp_process_group *pg, int rank, bool sending, void *buf, size_t count) {
  ddp_p2p_op op = {sending ? DDP_P2P_SEND : DDP_P2P_RECV, buf, count, DDP_FLOAT32, 1 - rank, 1};
  ddp_work *w = NULL;
  if (ddp_batch_isend_irecv(pg, &op, 1, &w) != DDP_OK) die(rank, "batch_isend_irecv");
  if (ddp_work_wait(w, -1) != DDP_OK) die(rank, "wait");
  ddp_work_free(w);
}

static void run_rank(int rank, uint16_t port, result *res) {
  ddp_store *store = NULL;
  ddp_store_options so = {.timeout_ms = 60000};
  if (ddp_store_tcp_connect("127.0.0.1", port, &so, &store) != DDP_OK) die(rank, "store");
  ddp_process_group_options o = {.timeout_s = 120, .transport = g_tcp ? "tcp" : NULL};
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(store, rank, 2, &o, &pg) != DDP_OK) die(rank, "create");
  size_t max = SIZES[N_SIZES - 1];
  float *send = ddp_alloc(max), *recv = ddp_alloc(max);
  if (!send || !recv) die(rank, "alloc");
  memset(send, rank + 1, max);
  memset(recv, 0, max);
  for (size_t z = 0; z < N_SIZES; z++) {
    size_t count = SIZES[z] / sizeof(float);
    int iters = iters_for(SIZES[z]);
    for (int i = 0; i < 3; i++) exchange(pg, rank, send, recv, count); /* warm up */
    /* The exchange delivered the peer's bytes. */
    unsigned char want = (unsigned char)(2 - rank);
    if (((unsigned char *)recv)[0] != want || ((unsigned char *)recv)[SIZES[z] - 1] != want) {
      fprintf(stderr, "rank %d: wrong bytes received at %zu B\n", rank, SIZES[z]);
      _exit(2);
    }
    for (int run = 0; run < g_runs; run++) {
      if (ddp_barrier(pg) != DDP_OK) die(rank, "barrier");
      int64_t t0 = ddp_time_ns();
      for (int i = 0; i < iters; i++) exchange(pg, rank, send, recv, count);
      res->exchange_us[z][run] = (double)(ddp_time_ns() - t0) / 1e3 / iters;
      if (ddp_barrier(pg) != DDP_OK) die(rank, "barrier");
      t0 = ddp_time_ns();
      for (int i = 0; i < iters; i++) {
        one_way(pg, rank, rank == 0, rank == 0 ? send : recv, count);
        one_way(pg, rank, rank == 1, recv, count); /* rank 1 returns what it got */
      }
      res->rtt_us[z][run] = (double)(ddp_time_ns() - t0) / 1e3 / iters;
    }
  }
  ddp_free(send);
  ddp_free(recv);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
  int c;
  while ((c = getopt(argc, argv, "tr:j")) != -1) {
    if (c == 't') g_tcp = 1;
    else if (c == 'r') g_runs = atoi(optarg);
    else if (c == 'j') g_json = 1;
    else {
      fprintf(stderr, "usage: bench_p2p [-t] [-r runs] [-j]\n");
      return 2;
    }
  }
  if (g_runs < 1 || g_runs > MAX_RUNS) {
    fprintf(stderr, "bench_p2p: -r must be in [1, %d]\n", MAX_RUNS);
    return 2;
  }
  int fds[2];
  if (pipe(fds) != 0) return 1;
  pid_t server = fork();
  if (server == 0) {
    close(fds[0]);
    ddp_store_server *srv = NULL;
    if (ddp_store_server_create("127.0.0.1", 0, NULL, &srv) != DDP_OK) _exit(1);
    uint16_t port = ddp_store_server_port(srv);
    if (write(fds[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(1);
    close(fds[1]);
    ddp_store_server_run(srv);
    _exit(0);
  }
  close(fds[1]);
  uint16_t port = 0;
  if (read(fds[0], &port, sizeof port) != (ssize_t)sizeof port) return 1;
  close(fds[0]);
  /* Rank 0's results come back through a pipe. */
  int rp[2];
  if (pipe(rp) != 0) return 1;
  pid_t pids[2];
  for (int r = 0; r < 2; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(600);
      result *res = calloc(1, sizeof *res);
      run_rank(r, port, res);
      if (r == 0) {
        const char *p = (const char *)res;
        for (size_t off = 0; off < sizeof *res;) {
          ssize_t n = write(rp[1], p + off, sizeof *res - off);
          if (n <= 0) _exit(3);
          off += (size_t)n;
        }
      }
      _exit(0);
    }
  }
  close(rp[1]);
  result *res = calloc(1, sizeof *res);
  size_t got = 0;
  while (got < sizeof *res) {
    ssize_t n = read(rp[0], (char *)res + got, sizeof *res - got);
    if (n <= 0) break;
    got += (size_t)n;
  }
  int bad = 0;
  for (int r = 0; r < 2; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  kill(server, SIGKILL);
  waitpid(server, NULL, 0);
  if (bad || got != sizeof *res) {
    fprintf(stderr, "bench_p2p: a rank failed\n");
    return 1;
  }
  const char *transport = g_tcp ? "tcp" : "shm";
  if (!g_json)
    printf("# bench_p2p: 2 ranks (%s), median of %d runs\n# %10s %14s %14s %14s\n", transport, g_runs,
           "bytes", "exchange_us", "exchange_GB/s", "roundtrip_us");
  for (size_t z = 0; z < N_SIZES; z++) {
    double ex = median(res->exchange_us[z], g_runs), rtt = median(res->rtt_us[z], g_runs);
    double gbs = 2.0 * (double)SIZES[z] / (ex * 1e3);
    if (g_json)
      printf("{\"bench\":\"p2p\",\"transport\":\"%s\",\"bytes\":%zu,\"exchange_us\":%.2f,"
             "\"exchange_gbs\":%.3f,\"roundtrip_us\":%.2f,\"runs\":%d}\n",
             transport, SIZES[z], ex, gbs, rtt, g_runs);
    else
      printf("  %10zu %14.2f %14.3f %14.2f\n", SIZES[z], ex, gbs, rtt);
  }
  free(res);
  return 0;
}
