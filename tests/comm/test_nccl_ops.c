/* Every operation of comm over the nccl backend on CUDA buffers of every
 * dtype, at world 1 and world 2, against closed-form results (pattern.h:
 * small integers, exact in every dtype, so floats too must match exactly),
 * every reduce op; an async allreduce ordered before the tensor layer's
 * stream by ddp_work_wait_stream; batch_isend_irecv grouped by
 * ncclGroupStart/End (a 16 MiB ring); ranks on one GPU refused without
 * NCCL_HOSTID. World 2 is two processes on one GPU, each with its own
 * NCCL_HOSTID, NCCL_SOCKET_IFNAME=lo and NCCL_IB_DISABLE=1 (issue 39's
 * arrangement: NCCL takes them for two hosts). The same checks again over
 * ddp's own backend, which stages GPU buffers through pinned host memory
 * (docs/comm.md, "CUDA buffers on the CPU backends"). Exits 77 without a
 * GPU.
 * Usage: test_nccl_ops                         (the parent: runs the children)
 *        test_nccl_ops rank world storefile backend [hostid]  (one rank) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "comm/pattern.h"
#include "ddp/ddp.h"

#define N 1000
static int rank_, world_, failures;

#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "rank %d of %d: FAIL: ", rank_, world_);       \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, "\n");                                         \
      failures++;                                                    \
    }                                                                \
  } while (0)
#define TRY(call)                                                                     \
  do {                                                                                \
    ddp_status st_ = (call);                                                          \
    if (st_ != DDP_OK) {                                                              \
      fprintf(stderr, "rank %d: %s: %s\n", rank_, #call, ddp_last_error());           \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

static void set(void *b, ddp_dtype dt, size_t i, double v) {
  if (dt == DDP_UINT8) ((uint8_t *)b)[i] = (uint8_t)v;
  else ddp__elem_set(b, dt, i, v);
}
static double get(const void *b, ddp_dtype dt, size_t i) {
  return dt == DDP_UINT8 ? ((const uint8_t *)b)[i] : ddp__elem_get(b, dt, i);
}
static bool is_float(ddp_dtype dt) {
  return dt == DDP_FLOAT32 || dt == DDP_FLOAT64 || dt == DDP_FLOAT16 || dt == DDP_BFLOAT16;
}

static void *host, *dev, *dev2;
static void up(void *d, size_t bytes) {
  if (cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) exit(1);
}
static void down(const void *d, size_t bytes) {
  if (cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) exit(1);
}

/* Element i of rank r's data in block b (distinct per rank, block, element). */
static double val(int r, int b, size_t i) { return (double)((r * 7 + b * 3 + (int)(i % 11)) % 50); }

static void one_dtype(ddp_process_group *pg, ddp_dtype dt) {
  size_t es = ddp_dtype_size(dt);
  const char *dn = ddp_dtype_name(dt);
  int P = world_, me = rank_;
  for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
    if (op == DDP_REDUCE_AVG && !is_float(dt)) continue;
    if (dt == DDP_UINT8 && op == DDP_REDUCE_SUM && P > 6) continue;
    for (size_t i = 0; i < N; i++) set(host, dt, i, ddp__pattern_contrib(me, i, op));
    up(dev, N * es);
    TRY(ddp_allreduce(pg, dev, N, dt, op));
    down(dev, N * es);
    int bad = 0;
    for (size_t i = 0; i < N; i++) bad += get(host, dt, i) != ddp__pattern_reduced(op, P, i);
    CHECK(!bad, "allreduce %s %s: %d of %d wrong", dn, ddp_reduce_op_name(op), bad, N);
    /* reduce_scatter: block r of the reduction lands on rank r. */
    for (int b = 0; b < P; b++)
      for (size_t i = 0; i < N; i++) set(host, dt, (size_t)b * N + i, ddp__pattern_contrib(me, i, op));
    up(dev2, (size_t)P * N * es);
    TRY(ddp_reduce_scatter(pg, dev2, dev, N, dt, op));
    down(dev, N * es);
    bad = 0;
    for (size_t i = 0; i < N; i++) bad += get(host, dt, i) != ddp__pattern_reduced(op, P, i);
    CHECK(!bad, "reduce_scatter %s %s: %d wrong", dn, ddp_reduce_op_name(op), bad);
  }
  /* reduce (sum) to the last rank; other ranks' buffers unchanged. */
  for (size_t i = 0; i < N; i++) set(host, dt, i, ddp__pattern_contrib(me, i, DDP_REDUCE_SUM));
  up(dev, N * es);
  TRY(ddp_reduce(pg, dev, N, dt, DDP_REDUCE_SUM, P - 1));
  down(dev, N * es);
  int bad = 0;
  for (size_t i = 0; i < N; i++)
    bad += get(host, dt, i) != (me == P - 1 ? ddp__pattern_reduced(DDP_REDUCE_SUM, P, i)
                                            : ddp__pattern_contrib(me, i, DDP_REDUCE_SUM));
  CHECK(!bad, "reduce %s: %d wrong", dn, bad);
  /* broadcast from each root. */
  for (int root = 0; root < P; root++) {
    for (size_t i = 0; i < N; i++) set(host, dt, i, val(me, 0, i));
    up(dev, N * es);
    TRY(ddp_broadcast(pg, dev, N, dt, root));
    down(dev, N * es);
    bad = 0;
    for (size_t i = 0; i < N; i++) bad += get(host, dt, i) != val(root, 0, i);
    CHECK(!bad, "broadcast %s root %d: %d wrong", dn, root, bad);
  }
  /* allgather, gather (root last), all_to_all, scatter (root 0). */
  for (size_t i = 0; i < N; i++) set(host, dt, i, val(me, 0, i));
  up(dev, N * es);
  TRY(ddp_allgather(pg, dev, dev2, N, dt));
  down(dev2, (size_t)P * N * es);
  bad = 0;
  for (int r = 0; r < P; r++)
    for (size_t i = 0; i < N; i++) bad += get(host, dt, (size_t)r * N + i) != val(r, 0, i);
  CHECK(!bad, "allgather %s: %d wrong", dn, bad);
  for (size_t i = 0; i < N; i++) set(host, dt, i, val(me, 1, i));
  up(dev, N * es);
  TRY(ddp_gather(pg, dev, me == P - 1 ? dev2 : NULL, N, dt, P - 1));
  if (me == P - 1) {
    down(dev2, (size_t)P * N * es);
    bad = 0;
    for (int r = 0; r < P; r++)
      for (size_t i = 0; i < N; i++) bad += get(host, dt, (size_t)r * N + i) != val(r, 1, i);
    CHECK(!bad, "gather %s: %d wrong", dn, bad);
  }
  for (int b = 0; b < P; b++)
    for (size_t i = 0; i < N; i++) set(host, dt, (size_t)b * N + i, val(me, b + 2, i));
  up(dev2, (size_t)P * N * es);
  TRY(ddp_all_to_all(pg, dev2, dev, N, dt)); /* dev holds P * N: allocated so */
  down(dev, (size_t)P * N * es);
  bad = 0;
  for (int r = 0; r < P; r++) /* block r of mine came from rank r's block `me` */
    for (size_t i = 0; i < N; i++) bad += get(host, dt, (size_t)r * N + i) != val(r, me + 2, i);
  CHECK(!bad, "all_to_all %s: %d wrong", dn, bad);
  for (int b = 0; b < P; b++)
    for (size_t i = 0; i < N; i++) set(host, dt, (size_t)b * N + i, val(me, b + 5, i));
  up(dev2, (size_t)P * N * es);
  TRY(ddp_scatter(pg, me == 0 ? dev2 : NULL, dev, N, dt, 0));
  down(dev, N * es);
  bad = 0;
  for (size_t i = 0; i < N; i++) bad += get(host, dt, i) != val(0, me + 5, i);
  CHECK(!bad, "scatter %s: %d wrong", dn, bad);
  /* send / recv: rank 0 to the last. */
  if (P > 1 && (me == 0 || me == P - 1)) {
    for (size_t i = 0; i < N; i++) set(host, dt, i, val(me, 9, i));
    up(dev, N * es);
    if (me == 0) TRY(ddp_send(pg, dev, N, dt, P - 1, 0));
    else TRY(ddp_recv(pg, dev, N, dt, 0, 0));
    down(dev, N * es);
    bad = 0;
    for (size_t i = 0; i < N; i++) bad += get(host, dt, i) != val(0, 9, i);
    CHECK(!bad, "send/recv %s: %d wrong", dn, bad);
  }
}

/* batch_isend_irecv on CUDA buffers: a ring (every rank sends to the next
 * and receives from the previous, all posting the send first) of 16 MiB,
 * far beyond what NCCL buffers eagerly, so it completes only with the
 * batch grouped (ncclGroupStart/End); at world 1 a send to self. Then an
 * async allreduce queued behind a second batch: program order holds.
 * Over ddp's own backend the batch is refused, saying what to do. */
static void batch_ring(ddp_process_group *pg, bool nccl) {
  const size_t count = (size_t)4 << 20;
  int P = world_, me = rank_, next = (me + 1) % P, prev = (me + P - 1) % P;
  float *hs = NULL, *ds = NULL, *dr = NULL;
  if (cudaMalloc((void **)&ds, count * 4) != cudaSuccess || cudaMalloc((void **)&dr, count * 4) != cudaSuccess) {
    CHECK(0, "batch: cudaMalloc of 2 x 16 MiB");
    return;
  }
  hs = ddp_alloc(count * 4);
  for (size_t i = 0; i < count; i++) hs[i] = (float)(me * 1000 + (int)(i % 997));
  cudaMemcpy(ds, hs, count * 4, cudaMemcpyHostToDevice);
  cudaMemset(dr, 0, count * 4);
  ddp_p2p_op ops[2] = {{DDP_P2P_SEND, ds, count, DDP_FLOAT32, next, 0},
                       {DDP_P2P_RECV, dr, count, DDP_FLOAT32, prev, 0}};
  ddp_work *w = NULL;
  ddp_status st = ddp_batch_isend_irecv(pg, ops, 2, &w);
  if (!nccl) {
    CHECK(st == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(), "takes host memory"),
          "batch on backend ddp: %s %s", ddp_status_name(st), ddp_last_error());
  } else {
    CHECK(st == DDP_OK, "batch_isend_irecv: %s", ddp_last_error());
    if (st == DDP_OK) {
      CHECK(ddp_work_wait(w, 60) == DDP_OK, "batch wait: %s", ddp_last_error());
      ddp_work_free(w);
      cudaMemcpy(hs, dr, count * 4, cudaMemcpyDeviceToHost);
      size_t bad = 0;
      for (size_t i = 0; i < count; i++) bad += hs[i] != (float)(prev * 1000 + (int)(i % 997));
      CHECK(!bad, "batch ring: %zu of %zu wrong (first %g)", bad, count, hs[0]);
      /* A batch, then an allreduce on the received buffer, both async: the
       * allreduce sees what the batch delivered. */
      ddp_work *wb = NULL, *wa = NULL;
      TRY(ddp_batch_isend_irecv(pg, ops, 2, &wb));
      TRY(ddp_allreduce_async(pg, dr, count, DDP_FLOAT32, DDP_REDUCE_SUM, &wa));
      CHECK(ddp_work_wait(wa, 60) == DDP_OK, "allreduce after batch: %s", ddp_last_error());
      CHECK(ddp_work_wait(wb, 60) == DDP_OK, "second batch: %s", ddp_last_error());
      ddp_work_free(wa);
      ddp_work_free(wb);
      cudaMemcpy(hs, dr, count * 4, cudaMemcpyDeviceToHost);
      bad = 0;
      for (size_t i = 0; i < count; i++) {
        double want = 0;
        for (int r = 0; r < P; r++) want += r * 1000 + (int)(i % 997);
        bad += hs[i] != (float)want;
      }
      CHECK(!bad, "batch then allreduce: %zu wrong (first %g)", bad, hs[0]);
    }
  }
  cudaFree(ds);
  cudaFree(dr);
  ddp_free(hs);
}

static int run_rank(int rank, int world, const char *storefile, const char *backend,
                    const char *hostid) {
  rank_ = rank, world_ = world;
  if (hostid && hostid[0]) setenv("NCCL_HOSTID", hostid, 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  setenv("NCCL_IB_DISABLE", "1", 0);
  ddp_store *store = NULL;
  TRY(ddp_store_file_open(storefile, NULL, &store));
  ddp_process_group_options o = {.timeout_s = 60, .backend = backend};
  bool nccl = !strcmp(backend, "nccl");
  ddp_process_group *pg = NULL;
  TRY(ddp_process_group_create(store, rank, world, &o, &pg));
  CHECK(!strcmp(ddp_process_group_backend(pg), backend), "backend %s", ddp_process_group_backend(pg));
  size_t big = (size_t)world * N * 8;
  host = ddp_alloc(big);
  if (!host || cudaMalloc(&dev, big) != cudaSuccess || cudaMalloc(&dev2, big) != cudaSuccess) return 1;
  /* A CPU buffer is refused by the nccl group, naming it; ddp's own
   * backend takes both. */
  ddp_status st = ddp_allreduce(pg, host, 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  if (nccl)
    CHECK(st == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(), "cannot reach buffers on cpu"),
          "CPU buffer: %s %s", ddp_status_name(st), ddp_last_error());
  else
    CHECK(st == DDP_OK, "CPU buffer on backend ddp: %s", ddp_last_error());
  for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) one_dtype(pg, (ddp_dtype)dt);
  TRY(ddp_barrier(pg));
  batch_ring(pg, nccl);
  TRY(ddp_allreduce(pg, dev, 0, DDP_FLOAT32, DDP_REDUCE_SUM)); /* count 0 */
  /* A subgroup per rank (split by rank): its own communicator; then the
   * world's again, so the two coexist. */
  ddp_process_group *sub = NULL;
  TRY(ddp_process_group_split(pg, rank, 0, &sub));
  for (size_t i = 0; i < N; i++) ((float *)host)[i] = (float)(rank + 3);
  up(dev, N * 4);
  TRY(ddp_allreduce(sub, dev, N, DDP_FLOAT32, DDP_REDUCE_SUM));
  TRY(ddp_allreduce(pg, dev, N, DDP_FLOAT32, DDP_REDUCE_SUM));
  down(dev, N * 4);
  float want_sub = 0;
  for (int r = 0; r < world; r++) want_sub += (float)(r + 3);
  CHECK(((float *)host)[N - 1] == want_sub, "subgroup then world: %g, want %g", ((float *)host)[N - 1],
        want_sub);
  ddp_process_group_destroy(sub);
  /* Async: the tensor layer's stream waits for the work; a copy queued on
   * that stream after it reads the result, with no host wait in between. */
  for (size_t i = 0; i < N; i++) ((float *)host)[i] = (float)(rank + 1);
  up(dev, N * 4);
  ddp_work *w = NULL;
  TRY(ddp_allreduce_async(pg, dev, N, DDP_FLOAT32, DDP_REDUCE_SUM, &w));
  TRY(ddp_work_wait_stream(w, 60));
  float *pinned = NULL;
  TRY(ddp_pinned_alloc(DDP_CUDA(0), N * 4, (void **)&pinned));
  TRY(ddp_device_copy_async(DDP_CPU, pinned, DDP_CUDA(0), dev, N * 4));
  TRY(ddp_device_synchronize(DDP_CUDA(0)));
  float want = (float)world * (world + 1) / 2;
  int bad = 0;
  for (size_t i = 0; i < N; i++) bad += pinned[i] != want;
  CHECK(!bad, "allreduce_async + work_wait_stream: %d wrong (first %g, want %g)", bad, pinned[0], want);
  TRY(ddp_work_wait(w, 60));
  ddp_work_free(w);
  ddp_pinned_free(pinned);
  char version[600];
  if (ddp_nccl_version(version, sizeof version) == DDP_OK && rank == 0)
    printf("NCCL %s\n", version);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  cudaFree(dev);
  cudaFree(dev2);
  ddp_free(host);
  printf("rank %d of %d (%s): %s\n", rank, world, backend, failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}

/* Runs `world` ranks as processes of this program; 0 when all pass. */
static int run_world(const char *self, int world, const char *backend, bool hostids,
                     const char *expect_error) {
  char dir[] = "/tmp/test_nccl_ops.XXXXXX";
  if (!mkdtemp(dir)) return 1;
  char storefile[64];
  snprintf(storefile, sizeof storefile, "%s/store", dir);
  pid_t pids[8];
  char log[8][96];
  for (int r = 0; r < world; r++) {
    snprintf(log[r], sizeof log[r], "%s/rank%d.log", dir, r);
    pids[r] = fork();
    if (pids[r] == 0) {
      char rs[8], ws[8], hid[32];
      snprintf(rs, sizeof rs, "%d", r);
      snprintf(ws, sizeof ws, "%d", world);
      snprintf(hid, sizeof hid, hostids ? "ddp-test-rank%d" : "", r);
      if (!freopen(log[r], "w", stderr)) _exit(1);
      execl(self, self, rs, ws, storefile, backend, hid, (char *)NULL);
      _exit(127);
    }
  }
  int failed = 0;
  for (int r = 0; r < world; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    char text[4096] = "";
    FILE *f = fopen(log[r], "r");
    if (f) {
      size_t n = fread(text, 1, sizeof text - 1, f);
      text[n] = 0;
      fclose(f);
    }
    if (expect_error) {
      /* Every rank must fail, saying why. */
      if (ok || !strstr(text, expect_error)) {
        fprintf(stderr, "world %d without NCCL_HOSTID: rank %d should fail with \"%s\":\n%s\n", world,
                r, expect_error, text);
        failed = 1;
      }
    } else if (!ok) {
      fprintf(stderr, "world %d rank %d failed (status %d):\n%s\n", world, r, status, text);
      failed = 1;
    }
    unlink(log[r]);
  }
  unlink(storefile);
  rmdir(dir);
  return failed;
}

int main(int argc, char **argv) {
  if (argc >= 5) return run_rank(atoi(argv[1]), atoi(argv[2]), argv[3], argv[4], argc > 5 ? argv[5] : "");
  /* The parent never touches CUDA before it forks (a CUDA context does not
   * survive fork); a child asks whether there is a GPU. */
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  pid_t probe = fork();
  if (probe == 0) _exit(ddp_cuda_device_count() > 0 ? 0 : 77);
  int status = 0;
  waitpid(probe, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 77) {
    printf("SKIP: no CUDA device (%s)\n", ddp_cuda_unavailable_reason());
    return 77;
  }
  char version[600];
  if (ddp_nccl_version(version, sizeof version) != DDP_OK) {
    printf("FAIL: a GPU but no NCCL: %s\n", ddp_last_error());
    return 1;
  }
  printf("NCCL %s\n", version);
  int failed = 0;
  failed |= run_world(self, 1, "nccl", false, NULL);
  printf("nccl world 1: %s\n", failed ? "FAIL" : "ok");
  int f2 = run_world(self, 2, "nccl", true, NULL);
  printf("nccl world 2 (one GPU, NCCL_HOSTID per rank): %s\n", f2 ? "FAIL" : "ok");
  int f3 = run_world(self, 2, "nccl", false, "both use one GPU");
  printf("nccl world 2 without NCCL_HOSTID refused naming both ranks: %s\n", f3 ? "FAIL" : "ok");
  int f4 = run_world(self, 2, "ddp", false, NULL);
  printf("ddp (staged) world 2 on one GPU: %s\n", f4 ? "FAIL" : "ok");
  f3 |= f4;
  return failed | f2 | f3;
}
