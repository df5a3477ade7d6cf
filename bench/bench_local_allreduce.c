/* bench_local_allreduce: float32 allreduce (SUM) through the local backend
 * between N ranks of this host -- processes (fork; the "shm" provider) or
 * threads of one process -- over a size sweep, in the style of nccl-tests:
 * size, time per op, algorithm bandwidth (size / time), bus bandwidth
 * (algbw * 2 (N-1) / N), and memory efficiency: size / (time x the memcpy
 * rate one rank reaches while all N copy that size at once, measured right
 * after each size).
 * 100% would mean the allreduce costs one memcpy of the buffer per rank.
 *
 *   bench_local_allreduce [-n ranks] [-b min_bytes] [-e max_bytes] [-f factor]
 *                         [-t] (threads instead of processes) [-i iters_scale]
 *
 * The backend is driven directly (no process group), so this measures the
 * backend alone; ddp-bench measures through the public API. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/backend.h"
#include "ddp/store.h"
#include "ddp/tensor.h"

typedef struct opts {
  int ranks;
  size_t min_bytes, max_bytes;
  int factor;
  int threads;
  double scale;
  uint16_t port;
  ddp_store *mem_store;
} opts;

static opts g;

static ddp__op_ctx ctx_for(const char *op, uint64_t seq, atomic_bool *ab) {
  ddp__op_ctx c = {.op = op, .seq = seq, .deadline_ns = ddp_time_ns() + 120 * 1000000000LL,
                   .aborted = ab};
  return c;
}

static int iters_for(size_t bytes) {
  double it = 2e8 / (double)(bytes + 4096) * g.scale;
  if (it < 5) it = 5;
  if (it > 20000) it = 20000;
  return (int)it;
}

static void check(ddp_status st, int rank, const char *what) {
  if (st == DDP_OK) return;
  fprintf(stderr, "rank %d: %s: %s\n", rank, what, ddp_last_error());
  exit(1);
}

/* One rank's whole run. Rank 0 prints. */
static void run_rank(int rank) {
  ddp_store *store = NULL;
  if (g.threads) {
    store = ddp_store_retain(g.mem_store);
  } else {
    ddp_store_options o = {.timeout_ms = 30000};
    check(ddp_store_tcp_connect("127.0.0.1", g.port, &o, &store), rank, "store");
  }
  int32_t host_of[64] = {0}, process_of[64] = {0};
  for (int q = 0; q < g.ranks; q++) process_of[q] = g.threads ? 0 : q;
  ddp__backend_config cfg = {.store = store, .rank = rank, .size = g.ranks, .host_of = host_of,
                             .process_of = process_of, .timeout_ns = 30 * 1000000000LL};
  ddp__backend *b = NULL;
  check(ddp__backend_local_create(&cfg, &b), rank, "create");
  atomic_bool ab;
  atomic_init(&ab, false);
  uint64_t seq = 0;
  size_t max_count = g.max_bytes / 4;
  float *buf = ddp_alloc(max_count * 4 + 64);
  float *copy = ddp_alloc(max_count * 4 + 64);
  for (size_t i = 0; i < max_count; i++) buf[i] = copy[i] = 1.0f;

  ddp__op_ctx c;
  int64_t t0;
  if (rank == 0) {
    printf("# local backend, %d ranks as %s; memeff = size / (time x memcpy rate of one rank\n"
           "# while all copy the same size at once, measured right after each size)\n",
           g.ranks, g.threads ? "threads" : "processes");
    printf("# %12s %12s %10s %10s %10s %10s %8s\n", "size(B)", "count", "time(us)", "algbw",
           "busbw", "memcpy", "memeff");
  }
  for (size_t bytes = g.min_bytes; bytes <= g.max_bytes; bytes *= (size_t)g.factor) {
    size_t count = bytes / 4;
    int iters = iters_for(bytes), warm = iters / 10 + 2;
    for (int k = 0; k < warm; k++) {
      c = ctx_for("allreduce", ++seq, &ab);
      check(b->ops->blocking->allreduce(b, &c, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM), rank, "allreduce");
    }
    c = ctx_for("barrier", ++seq, &ab);
    check(b->ops->blocking->barrier(b, &c), rank, "barrier");
    t0 = ddp_time_ns();
    for (int k = 0; k < iters; k++) {
      c = ctx_for("allreduce", ++seq, &ab);
      check(b->ops->blocking->allreduce(b, &c, buf, count, DDP_FLOAT32, DDP_REDUCE_SUM), rank, "allreduce");
    }
    double t = (double)(ddp_time_ns() - t0) * 1e-9 / iters;
    /* The memcpy rate of one rank while every rank copies `bytes` at once,
     * in the same go (the machine's load drifts). */
    c = ctx_for("barrier", ++seq, &ab);
    check(b->ops->blocking->barrier(b, &c), rank, "barrier");
    int64_t c0 = ddp_time_ns();
    for (int k = 0; k < iters; k++) memcpy(copy, buf, bytes);
    double copy_rate = (double)bytes * iters / ((double)(ddp_time_ns() - c0) * 1e-9);
    /* Keep values bounded (each op multiplies by the world size). */
    for (size_t i = 0; i < count; i++) buf[i] = 1.0f;
    if (rank == 0) {
      double algbw = (double)bytes / t;
      double busbw = algbw * 2.0 * (g.ranks - 1) / g.ranks;
      printf("  %12zu %12zu %10.2f %10.3f %10.3f %10.3f %7.1f%%\n", bytes, count, t * 1e6,
             algbw * 1e-9, busbw * 1e-9, copy_rate * 1e-9, 100.0 * (double)bytes / (t * copy_rate));
      fflush(stdout);
    }
    if (bytes == 0) break;
  }
  b->ops->destroy(b);
  ddp_store_destroy(store);
  ddp_free(buf);
  ddp_free(copy);
}

static void *thread_main(void *arg) {
  run_rank((int)(intptr_t)arg);
  return NULL;
}

int main(int argc, char **argv) {
  g.ranks = 2;
  g.min_bytes = 8;
  g.max_bytes = 64u << 20;
  g.factor = 4;
  g.scale = 1.0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "-n") && i + 1 < argc) g.ranks = atoi(argv[++i]);
    else if (!strcmp(argv[i], "-b") && i + 1 < argc) g.min_bytes = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "-e") && i + 1 < argc) g.max_bytes = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "-f") && i + 1 < argc) g.factor = atoi(argv[++i]);
    else if (!strcmp(argv[i], "-i") && i + 1 < argc) g.scale = atof(argv[++i]);
    else if (!strcmp(argv[i], "-t")) g.threads = 1;
    else {
      fprintf(stderr, "usage: %s [-n ranks] [-b min] [-e max] [-f factor] [-i scale] [-t]\n",
              argv[0]);
      return 2;
    }
  }
  if (g.ranks < 1 || g.ranks > 64 || g.factor < 2 || g.min_bytes < 4) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  if (g.threads) {
    check(ddp_store_mem_create(NULL, &g.mem_store), 0, "store");
    pthread_t th[64];
    for (int r = 0; r < g.ranks; r++) pthread_create(&th[r], NULL, thread_main, (void *)(intptr_t)r);
    for (int r = 0; r < g.ranks; r++) pthread_join(th[r], NULL);
    ddp_store_destroy(g.mem_store);
    return 0;
  }
  /* The store server in a process of its own; ranks forked from this
   * thread-free process. */
  int fds[2];
  if (pipe(fds) != 0) return 1;
  pid_t server = fork();
  if (server == 0) {
    ddp_store_server *srv = NULL;
    if (ddp_store_server_create("127.0.0.1", 0, NULL, &srv) != DDP_OK) _exit(1);
    uint16_t port = ddp_store_server_port(srv);
    if (write(fds[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(1);
    ddp_store_server_run(srv);
    _exit(0);
  }
  if (read(fds[0], &g.port, sizeof g.port) != (ssize_t)sizeof g.port) return 1;
  pid_t pids[64];
  for (int r = 0; r < g.ranks; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(600);
      run_rank(r);
      _exit(0);
    }
  }
  int bad = 0;
  for (int r = 0; r < g.ranks; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  kill(server, SIGKILL);
  waitpid(server, NULL, 0);
  return bad;
}
