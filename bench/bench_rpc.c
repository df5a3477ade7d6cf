/* The round trip of ddp_rpc_sync echoing one float32 tensor between two
 * workers, as ../shared/refs/torch_rpc_latency.py measures PyTorch's: 100
 * warm-up calls, then the median of --iters calls, per size. Prints one line
 * per size: "ddp rpc_sync round trip bytes=B us=T".
 *
 *   bench_rpc [--sizes 4,1048576] [--iters 2000] [--threads 4] [--transport auto|tcp]
 *       forks both workers on this host (they meet at tcp://127.0.0.1:--port)
 *   bench_rpc --rank R --init tcp://HOST:PORT [...]
 *       one worker of two (rank 0 measures and hosts the store), e.g. one per
 *       network namespace (scripts/bench-rpc.sh). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/rpc.h"

static ddp_status echo(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                       void *user) {
  (void)call, (void)user;
  *reply = *args; /* points into args: sent before they are freed */
  reply->release = NULL;
  return DDP_OK;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

typedef struct bench_opts {
  int64_t sizes[16];
  int num_sizes;
  int iters;
  int threads;
  int port;
  ddp_rpc_transport transport;
  const char *init;
} bench_opts;

static int worker(int rank, const bench_opts *b) {
  char url[256];
  if (b->init) snprintf(url, sizeof url, "%s", b->init);
  else snprintf(url, sizeof url, "tcp://127.0.0.1:%d", b->port);
  char name[16];
  snprintf(name, sizeof name, "w%d", rank);
  ddp_rpc_register("echo", echo, NULL);
  ddp_rpc_options o = ddp_rpc_defaults();
  o.name = name;
  o.rank = rank;
  o.world_size = 2;
  o.init_method = url;
  o.num_threads = b->threads;
  o.transport = b->transport;
  o.init_timeout_s = 60;
  ddp_rpc_agent *a;
  if (ddp_rpc_init(&o, &a) != DDP_OK) {
    fprintf(stderr, "bench_rpc: worker %d: %s\n", rank, ddp_last_error());
    return 1;
  }
  int rc = 0;
  if (rank == 0) {
    int64_t *times = calloc((size_t)b->iters, sizeof *times);
    for (int s = 0; s < b->num_sizes && rc == 0; s++) {
      int64_t numel = b->sizes[s] / 4 > 0 ? b->sizes[s] / 4 : 1;
      ddp_tensor *t;
      ddp_tensor_create(&t, DDP_FLOAT32, 1, &numel);
      for (int64_t i = 0; i < numel; i++) ddp_tensor_f32(t)[i] = (float)(i % 1000003);
      ddp_tensor *ts[1] = {t};
      ddp_rpc_message m = {.tensors = ts, .num_tensors = 1}, out;
      for (int i = 0; i < 100 + b->iters && rc == 0; i++) {
        int64_t t0 = ddp_time_ns();
        ddp_status st = ddp_rpc_sync(a, "w1", "echo", &m, DDP_RPC_DEFAULT_TIMEOUT, &out);
        int64_t dt = ddp_time_ns() - t0;
        /* The echo checked outside the timing: a wrong reply fails the run. */
        if (st != DDP_OK || out.num_tensors != 1 || out.tensors[0]->numel != numel ||
            memcmp(out.tensors[0]->data, t->data, (size_t)numel * 4) != 0) {
          fprintf(stderr, "bench_rpc: call %d of %lld bytes: %s\n", i, (long long)b->sizes[s],
                  st != DDP_OK ? ddp_last_error() : "the echo differs from what was sent");
          rc = 1;
        }
        ddp_rpc_message_free(&out);
        if (i >= 100) times[i - 100] = dt;
      }
      qsort(times, (size_t)b->iters, sizeof *times, cmp_i64);
      printf("ddp rpc_sync round trip bytes=%lld us=%.1f transport=%s\n", (long long)b->sizes[s],
             (double)times[b->iters / 2] / 1e3, ddp_rpc_transport_name(a, 1));
      fflush(stdout);
      ddp_tensor_destroy(t);
    }
    free(times);
  }
  if (ddp_rpc_shutdown(a, true, 60) != DDP_OK) {
    fprintf(stderr, "bench_rpc: worker %d: %s\n", rank, ddp_last_error());
    rc = 1;
  }
  return rc;
}

int main(int argc, char **argv) {
  bench_opts b = {.sizes = {4, 1048576}, .num_sizes = 2, .iters = 2000, .threads = 4, .port = 29778};
  int rank = -1;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(argv[i], "--sizes") && v) {
      b.num_sizes = 0;
      for (char *p = argv[++i]; *p && b.num_sizes < 16;) {
        b.sizes[b.num_sizes++] = strtoll(p, &p, 10);
        if (*p == ',') p++;
      }
    } else if (!strcmp(argv[i], "--iters") && v) b.iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && v) b.threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--port") && v) b.port = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--rank") && v) rank = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--init") && v) b.init = argv[++i];
    else if (!strcmp(argv[i], "--transport") && v) {
      b.transport = !strcmp(argv[++i], "tcp") ? DDP_RPC_TRANSPORT_TCP : DDP_RPC_TRANSPORT_AUTO;
    } else {
      fprintf(stderr,
              "usage: bench_rpc [--sizes B,B] [--iters N] [--threads N] [--transport auto|tcp] "
              "[--port P | --rank R --init tcp://HOST:PORT]\n");
      return 2;
    }
  }
  if (b.iters < 1) b.iters = 1;
  if (rank >= 0) return worker(rank, &b);
  fflush(NULL);
  pid_t pids[2];
  for (int r = 0; r < 2; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(600);
      _exit(worker(r, &b));
    }
  }
  int rc = 0;
  for (int r = 0; r < 2; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}
