/* One rank of the MPI backend's tests, run under mpirun by test_mpi.sh
 * (docs/comm.md, "MPI backend"). Usage: test_mpi_ranks MODE
 *   matrix    every operation x dtype x reduce op x counts 0, 1, odd and
 *             1 MiB against the closed forms (tests/comm/comm_matrix_body.h,
 *             the matrix ddp's own backends run), then async allreduces in
 *             flight together
 *   p2p       ordering per (peer, tag) through blocking and async sends,
 *             a batch, and a truncated receive failing by name
 *   subgroups split by parity and new_group of the lower half, collectives
 *             in each against closed forms; monitored barrier
 *   usercomm  the program starts MPI itself and makes a group from its own
 *             MPI_Comm (split and reordered): ranks are that communicator's
 *   outside   not under mpirun: backend "mpi" fails at once saying why
 *   stall     rank 1 sleeps past the group's 3 s timeout before an
 *             allreduce: rank 0's ends the job naming the op (the watchdog of
 *             a blocking call, or the nonblocking wait's DDP_ERR_TIMEOUT)
 *   arrival   the ranks but 0 sleep 1 s before a 1 MiB blocking allreduce:
 *             rank 0, there first, waits at the arrival barrier sleeping
 *             (its thread's CPU time under half the wait's wall time; a
 *             spinning wait takes all of it on an idle core), and the
 *             sum is the closed form
 *   mismatch  under DDP_DEBUG=detail, rank 1 reduces 5 elements where the
 *             others reduce 4: every rank fails naming the mismatch (the
 *             fingerprints go through the group's store from MPI's rank 0)
 *   direct    the direct path of a small blocking allreduce (collectives.c):
 *             offered, on ddp's recursive doubling over point-to-point
 *             where mpi.c's small_rule says (2^k ranks on one host, up to
 *             DDP_MPI_SMALL_BYTES) and MPI_Allreduce elsewhere, sums, maxima and averages against closed forms, a
 *             blocking call behind an async one in flight (the general
 *             path), bad arguments failing by name as on the general
 *             path, count 0, and what it keeps: one collective number a
 *             call, with the flight recorder's records of every call,
 *             completed, in order, with their arguments
 *   exclusion two threads on one group (docs/comm.md, MPI, "The last 5 %
 *             at 8 B"): each round the second thread submits an async
 *             1024-element allreduce, then lets the main thread (the
 *             group's bias owner until then) issue a blocking 8-byte one
 *             at once, while the async one is queued or running; the
 *             blocking call must wait its turn (the direct path's
 *             exclusion), or the ranks' MPI calls go out in different
 *             orders; every result against its closed form
 *   lane      the flight recorder's record numbers with the point-to-point
 *             lane beside the direct path (flight.h): the main thread (the
 *             group's bias owner, taking its records' numbers without a
 *             locked instruction) runs blocking 8-byte allreduces while a
 *             second thread, started once the first has made some, passes
 *             messages round the ring of ranks; every result against its
 *             closed form, then every record of both in the ring, each
 *             number once, completed, and the allreduces' collective
 *             numbers consecutive
 *   smallmismatch  2 ranks: rank 1 reduces 3 floats, rank 0 2, on the
 *             small path (point-to-point): both fail naming the counts,
 *             neither reduces stale bytes
 *   kill      rank 1 SIGKILLs itself while the others run collectives; the
 *             script checks the job ends naming it
 *   hier      ranks on faked hosts (DDP_HOST_ID, set per rank by test_mpi.sh
 *             from DDP_TEST_LAYOUT: block, interleaved or uneven): each
 *             pair's transport ("shm" inside a host, "mpi" between hosts:
 *             shared memory inside hosts, MPI between their leaders; all
 *             "mpi" under DDP_MPI_HIER=0), then, unless DDP_TEST_QUICK=1,
 *             which path an allreduce below and one at the threshold
 *             (DDP_MPI_HIER_BYTES, else the default) took: ddp's shared
 *             memory moved bytes (the counters' shm_bytes) only for a
 *             composed one, so one below the threshold ran flat on MPI
 *             alone; then, unless DDP_TEST_QUICK=1,
 *             a reversed subgroup (composed too), a monitored barrier,
 *             the matrix, async allreduces and p2p ordering
 * Exit status 0 when this rank passed. */
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/comm_matrix_body.h"
#include "comm/flight/flight.h"
#include "comm/mpi/mpi_internal.h"

static int bad(const char *what) {
  fprintf(stderr, "test_mpi_ranks: %s: %s\n", what, ddp_last_error());
  return 1;
}

/* One process's rank of the world the matrix body expects. */
static ct_world *world_of(ddp_process_group *pg) {
  ct_world *w = calloc(1, sizeof *w);
  w->size = ddp_process_group_size(pg);
  pthread_mutex_init(&w->mu, NULL);
  return w;
}

/* This rank's result; frees w. */
static int verdict(ct_world *w, int rank) {
  int rc = 0;
  if (atomic_load(&w->failures)) {
    fprintf(stderr, "FAILED (rank %d): %s\n", rank, w->first_failure);
    rc = 1;
  }
  pthread_mutex_destroy(&w->mu);
  free(w);
  return rc;
}

static void body_async(ct_rank *self) {
  ddp_process_group *pg = self->pg;
  int P = ddp_process_group_size(pg), r = self->rank;
  enum { K = 8, N = 100003 };
  float *bufs[K];
  ddp_work *works[K];
  for (int k = 0; k < K; k++) {
    bufs[k] = malloc(N * sizeof(float));
    for (size_t i = 0; i < N; i++) bufs[k][i] = (float)((r + 1) * (k + 1));
    CT_OK(self, ddp_allreduce_async(pg, bufs[k], N, DDP_FLOAT32, k % 2 ? DDP_REDUCE_AVG : DDP_REDUCE_SUM,
                                    &works[k]));
  }
  for (int k = 0; k < K; k++) {
    CT_OK(self, ddp_work_wait(works[k], -1));
    ddp_work_free(works[k]);
    double sum = (double)P * (P + 1) / 2 * (k + 1), want = k % 2 ? sum / P : sum;
    for (size_t i = 0; i < N; i += 997)
      CT_CHECK(self, bufs[k][i] == (float)want, "async allreduce %d [%zu] = %g, want %g", k, i, bufs[k][i], want);
    free(bufs[k]);
  }
}

static int mode_matrix(ddp_process_group *pg) {
  ct_world *w = world_of(pg);
  ct_rank self = {.world = w, .rank = ddp_process_group_rank(pg), .pg = pg};
  char *a = malloc(MIB + 4096), *b = malloc(MIB + 4096);
  for (size_t d = 0; d < LT_NUM_DTYPES && !atomic_load(&w->failures); d++)
    ct_matrix_dtype(&self, lt_dtypes[d], a, b);
  if (!atomic_load(&w->failures)) body_async(&self);
  free(a);
  free(b);
  return verdict(w, self.rank);
}

static void body_p2p(ct_rank *self) {
  ddp_process_group *pg = self->pg;
  int P = ddp_process_group_size(pg), r = self->rank;
  int next = (r + 1) % P, prev = (r + P - 1) % P;
  enum { M = 64 };
  /* Sizes from 0 to 256 KiB interleaved over two tags: each arrives in the
   * order it was sent on its tag. */
  static int64_t out[M][8192], in[M][8192];
  ddp_work *sends[M], *recvs[M];
  for (int k = 0; k < M; k++) {
    size_t n = (size_t)(k * 131) % 8192;
    for (size_t i = 0; i < n; i++) out[k][i] = (int64_t)r * 1000000 + k * 1000 + (int64_t)(i % 1000);
    CT_OK(self, ddp_isend(pg, out[k], n, DDP_INT64, next, k % 2, &sends[k]));
  }
  for (int k = 0; k < M; k++) {
    size_t n = (size_t)(k * 131) % 8192;
    CT_OK(self, ddp_irecv(pg, in[k], n, DDP_INT64, prev, k % 2, &recvs[k]));
  }
  for (int k = 0; k < M; k++) {
    CT_OK(self, ddp_work_wait(recvs[k], -1));
    CT_OK(self, ddp_work_wait(sends[k], -1));
    ddp_work_free(recvs[k]);
    ddp_work_free(sends[k]);
    size_t n = (size_t)(k * 131) % 8192;
    for (size_t i = 0; i < n; i++)
      CT_CHECK(self, in[k][i] == (int64_t)prev * 1000000 + k * 1000 + (int64_t)(i % 1000),
               "message %d from rank %d [%zu] = %lld", k, prev, i, (long long)in[k][i]);
  }
  /* A batch both ways around the ring, and blocking send/recv in turn. */
  int32_t x = r * 7 + 1, y = -1, z = r, u = -1;
  ddp_p2p_op ops[2] = {{DDP_P2P_SEND, &x, 1, DDP_INT32, next, 5}, {DDP_P2P_RECV, &y, 1, DDP_INT32, prev, 5}};
  ddp_work *batch = NULL;
  CT_OK(self, ddp_batch_isend_irecv(pg, ops, 2, &batch));
  CT_OK(self, ddp_work_wait(batch, -1));
  ddp_work_free(batch);
  CT_CHECK(self, y == prev * 7 + 1, "batch recv from %d = %d", prev, y);
  if (r % 2 == 0) {
    CT_OK(self, ddp_send(pg, &z, 1, DDP_INT32, next, 9));
    CT_OK(self, ddp_recv(pg, &u, 1, DDP_INT32, prev, 9));
  } else {
    CT_OK(self, ddp_recv(pg, &u, 1, DDP_INT32, prev, 9));
    CT_OK(self, ddp_send(pg, &z, 1, DDP_INT32, next, 9));
  }
  CT_CHECK(self, u == prev, "recv from %d = %d", prev, u);
  CT_OK(self, ddp_barrier(pg));
}

static int mode_p2p(ddp_process_group *pg) {
  ct_world *w = world_of(pg);
  ct_rank self = {.world = w, .rank = ddp_process_group_rank(pg), .pg = pg};
  body_p2p(&self);
  return verdict(w, self.rank);
}

/* Sum of (parent rank + 1) over members, in every element. */
static int check_sum(ddp_process_group *g, int parent_rank, int want, const char *what) {
  int64_t v[3] = {parent_rank + 1, parent_rank + 1, parent_rank + 1};
  if (ddp_allreduce(g, v, 3, DDP_INT64, DDP_REDUCE_SUM) != DDP_OK) return bad(what);
  for (int i = 0; i < 3; i++)
    if (v[i] != want) {
      fprintf(stderr, "test_mpi_ranks: %s: allreduce [%d] = %lld, want %d\n", what, i, (long long)v[i], want);
      return 1;
    }
  return 0;
}

static int mode_subgroups(ddp_process_group *pg) {
  int P = ddp_process_group_size(pg), r = ddp_process_group_rank(pg);
  ddp_process_group *half = NULL, *low = NULL;
  if (ddp_process_group_split(pg, r % 2, -r, &half) != DDP_OK) return bad("split");
  int want = 0, n = 0;
  for (int q = r % 2; q < P; q += 2) want += q + 1, n++;
  if (ddp_process_group_size(half) != n || strcmp(ddp_process_group_backend(half), "mpi") != 0) {
    fprintf(stderr, "test_mpi_ranks: split: size %d backend %s, want %d mpi\n", ddp_process_group_size(half),
            ddp_process_group_backend(half), n);
    return 1;
  }
  /* key -r: the highest parent rank comes first */
  int expect_rank = 0;
  for (int q = r % 2; q < P; q += 2)
    if (q > r) expect_rank++;
  if (ddp_process_group_rank(half) != expect_rank) {
    fprintf(stderr, "test_mpi_ranks: split: rank %d, want %d\n", ddp_process_group_rank(half), expect_rank);
    return 1;
  }
  if (check_sum(half, r, want, "split allreduce")) return 1;
  int lows[8], nl = P / 2 > 0 ? P / 2 : 1;
  for (int i = 0; i < nl; i++) lows[i] = i;
  if (ddp_process_group_new(pg, nl, lows, &low) != DDP_OK) return bad("new_group");
  if ((r < nl) != (low != NULL)) {
    fprintf(stderr, "test_mpi_ranks: new_group: rank %d got %s\n", r, low ? "a group" : "none");
    return 1;
  }
  if (low && check_sum(low, r, nl * (nl + 1) / 2, "new_group allreduce")) return 1;
  /* The parent still works beside them, and the store-based barrier too. */
  if (check_sum(pg, r, P * (P + 1) / 2, "parent allreduce")) return 1;
  if (ddp_monitored_barrier(pg, 30, true) != DDP_OK) return bad("monitored_barrier");
  ddp_process_group_destroy(low);
  ddp_process_group_destroy(half);
  return 0;
}

static int mode_kill(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg);
  float v[1024] = {0};
  for (int k = 0; k < 200000; k++) {
    if (k == 50 && r == 1) raise(SIGKILL);
    if (ddp_allreduce(pg, v, 1024, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("allreduce after the kill");
  }
  fprintf(stderr, "test_mpi_ranks: rank %d finished every allreduce although rank 1 was killed\n", r);
  return 1;
}

static int mode_mismatch(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg);
  float v[5] = {1, 2, 3, 4, 5};
  if (ddp_allreduce(pg, v, 4, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("first allreduce");
  ddp_status st = ddp_allreduce(pg, v, r == 1 ? 5 : 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  if (st == DDP_OK || !strstr(ddp_last_error(), "mismatch")) {
    fprintf(stderr, "test_mpi_ranks: rank %d: mismatched allreduce: %s (%s), want a mismatch named\n", r,
            ddp_status_name(st), ddp_last_error());
    return 1;
  }
  printf("rank %d: %s\n", r, ddp_last_error());
  return 0;
}

static int mode_direct(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg), n = ddp_process_group_size(pg);
  if (!pg->direct_allreduce || pg->direct_count[DDP_FLOAT32] < 64) {
    fprintf(stderr, "test_mpi_ranks: the mpi backend offers no direct path for a small float32 allreduce\n");
    return 1;
  }
  if (!pg->flight) {
    fprintf(stderr, "test_mpi_ranks: no flight recorder (DDP_FLIGHT_RECORDER_SIZE=0?)\n");
    return 1;
  }
  /* Which algorithm the small calls below take (mpi.c, small_rule): ddp's
   * recursive doubling over point-to-point for 2^k ranks on one host up to
   * DDP_MPI_SMALL_BYTES (default 256), MPI_Allreduce otherwise. */
  int64_t small_env = 256;
  ddp_env_int("DDP_MPI_SMALL_BYTES", 256, &small_env);
  size_t small_want = (n & (n - 1)) == 0 ? (size_t)small_env : 0;
  size_t small = ddp__mpi_small_bytes(pg->host_backend);
  if (small != small_want) {
    fprintf(stderr, "test_mpi_ranks: rank %d of %d: small allreduces up to %zu bytes over point-to-point, want %zu\n",
            r, n, small, small_want);
    return 1;
  }
  if (r == 0)
    printf("direct path: %d ranks, small allreduces %s\n", n,
           small ? "as ddp's recursive doubling over point-to-point" : "as MPI_Allreduce");
  uint64_t seq0 = pg->next_seq;
  int calls = 0;
  /* Closed forms: rank r holds r + 1 + i. */
  float f[5];
  int64_t l[3];
  double d[4];
  for (int i = 0; i < 5; i++) f[i] = (float)(r + 1 + i);
  for (int i = 0; i < 3; i++) l[i] = (int64_t)(r + 1) * (i + 1);
  for (int i = 0; i < 4; i++) d[i] = (double)(r + 1 + i);
  if (ddp_allreduce(pg, f, 5, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("float32 sum");
  calls++;
  if (ddp_allreduce(pg, l, 3, DDP_INT64, DDP_REDUCE_MAX) != DDP_OK) return bad("int64 max");
  calls++;
  if (ddp_allreduce(pg, d, 4, DDP_FLOAT64, DDP_REDUCE_AVG) != DDP_OK) return bad("float64 avg");
  calls++;
  for (int i = 0; i < 5; i++)
    if (f[i] != (float)(n * (n + 1) / 2 + n * i)) return bad("float32 sum: wrong value");
  for (int i = 0; i < 3; i++)
    if (l[i] != (int64_t)n * (i + 1)) return bad("int64 max: wrong value");
  for (int i = 0; i < 4; i++)
    if (d[i] != (double)(n + 1) / 2 + i) return bad("float64 avg: wrong value");
  /* A blocking call while an async one is in flight: it queues behind it
   * (the general path); both right. */
  float a[3] = {1, 2, 3}, b[2] = {(float)r, 1};
  ddp_work *w = NULL;
  if (ddp_allreduce_async(pg, a, 3, DDP_FLOAT32, DDP_REDUCE_SUM, &w) != DDP_OK) return bad("async allreduce");
  if (ddp_allreduce(pg, b, 2, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("blocking behind async");
  if (ddp_work_wait(w, -1) != DDP_OK) return bad("async wait");
  ddp_work_free(w);
  calls += 2;
  if (a[0] != (float)n || a[2] != 3.0f * n || b[0] != (float)(n * (n - 1) / 2) || b[1] != (float)n)
    return bad("async and blocking: wrong values");
  /* Bad arguments fail at once, by name, numbering nothing. */
  struct { ddp_dtype dt; ddp_reduce_op op; void *buf; const char *want; } bads[] = {
      {(ddp_dtype)99, DDP_REDUCE_SUM, f, "dtype 99"},
      {DDP_FLOAT32, (ddp_reduce_op)99, f, "reduce op 99"},
      {DDP_INT32, DDP_REDUCE_AVG, f, "avg is for floating types"},
      {DDP_FLOAT32, DDP_REDUCE_SUM, NULL, "buf is NULL"},
  };
  for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
    ddp_status st = ddp_allreduce(pg, bads[i].buf, 2, bads[i].dt, bads[i].op);
    if (st != DDP_ERR_INVALID || !strstr(ddp_last_error(), "allreduce") || !strstr(ddp_last_error(), bads[i].want)) {
      fprintf(stderr, "test_mpi_ranks: rank %d: bad allreduce %zu: %s (%s), want INVALID naming \"%s\"\n", r, i,
              ddp_status_name(st), ddp_last_error(), bads[i].want);
      return 1;
    }
  }
  if (ddp_allreduce(pg, NULL, 0, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("count 0");
  calls++;
  if (pg->next_seq != seq0 + (uint64_t)calls) {
    fprintf(stderr, "test_mpi_ranks: rank %d: %d collectives numbered %llu\n", r, calls,
            (unsigned long long)(pg->next_seq - seq0));
    return 1;
  }
  /* The flight recorder: the last `calls` records, in order. */
  static ddp__flight_record rec[1 << 16];
  if (pg->flight->capacity > (1u << 16)) return bad("flight recorder larger than the test's buffer");
  size_t got = ddp__flight_snapshot(pg->flight, rec);
  if (got < (size_t)calls) return bad("flight recorder: too few records");
  const ddp__flight_record *last = rec + got - calls;
  struct { uint64_t count; int dtype, op; } want[] = {{5, DDP_FLOAT32, DDP_REDUCE_SUM}, {3, DDP_INT64, DDP_REDUCE_MAX},
                                                      {4, DDP_FLOAT64, DDP_REDUCE_AVG}, {3, DDP_FLOAT32, DDP_REDUCE_SUM},
                                                      {2, DDP_FLOAT32, DDP_REDUCE_SUM}, {0, DDP_FLOAT32, DDP_REDUCE_SUM}};
  for (int i = 0; i < calls; i++) {
    const ddp__flight_record *x = last + i;
    if (x->seq != seq0 + 1 + (uint64_t)i || x->kind != DDP__OP_ALLREDUCE || x->state != DDP__FLIGHT_COMPLETED ||
        x->count != want[i].count || x->dtype != want[i].dtype || x->reduce_op != want[i].op ||
        x->started_ns < x->scheduled_ns || x->ended_ns < x->started_ns) {
      fprintf(stderr, "test_mpi_ranks: rank %d: flight record %d: seq %llu (want %llu) kind %d state %d count %llu "
              "dtype %d op %d times %lld %lld %lld\n", r, i, (unsigned long long)x->seq,
              (unsigned long long)(seq0 + 1 + i), x->kind, x->state, (unsigned long long)x->count, x->dtype,
              x->reduce_op, (long long)x->scheduled_ns, (long long)x->started_ns, (long long)x->ended_ns);
      return 1;
    }
  }
  printf("rank %d: direct path: %d allreduces numbered %llu..%llu, recorded completed\n", r, calls,
         (unsigned long long)seq0 + 1, (unsigned long long)(seq0 + calls));
  /* Every rank holds the same bits, where rounding could tell orders
   * apart: float32 sums and bfloat16 averages of values no sum holds
   * exactly, compared across the ranks through the MIN and MAX of their
   * bit patterns (int32). */
  {
    enum { NB = 24 };
    float fx[NB];
    uint16_t bx[NB];
    uint32_t seed = 2654435761u * (uint32_t)(r + 1);
    for (int i = 0; i < NB; i++) {
      seed = seed * 1664525u + 1013904223u;
      fx[i] = (float)((double)(seed >> 8) / 16777216.0 * 3.0 - 1.0) * (float)(1 + i % 5) / 7.0f;
      uint32_t bits;
      memcpy(&bits, &fx[i], 4);
      bx[i] = (uint16_t)(bits >> 16);
    }
    if (ddp_allreduce(pg, fx, NB, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("float32 sum of fractions");
    if (ddp_allreduce(pg, bx, NB, DDP_BFLOAT16, DDP_REDUCE_AVG) != DDP_OK) return bad("bfloat16 avg of fractions");
    int32_t lo[2 * NB], hi[2 * NB];
    for (int i = 0; i < NB; i++) {
      memcpy(&lo[i], &fx[i], 4);
      lo[NB + i] = bx[i];
    }
    memcpy(hi, lo, sizeof hi);
    if (ddp_allreduce(pg, lo, 2 * NB, DDP_INT32, DDP_REDUCE_MIN) != DDP_OK) return bad("min of the bits");
    if (ddp_allreduce(pg, hi, 2 * NB, DDP_INT32, DDP_REDUCE_MAX) != DDP_OK) return bad("max of the bits");
    for (int i = 0; i < 2 * NB; i++)
      if (lo[i] != hi[i]) {
        fprintf(stderr, "test_mpi_ranks: rank %d of %d: %s element %d differs between ranks (bits %08x and %08x)\n",
                r, n, i < NB ? "float32 sum" : "bfloat16 avg", i % NB, (unsigned)lo[i], (unsigned)hi[i]);
        return 1;
      }
  }
  return 0;
}

/* Whether the group's backend offers the direct path for an 8-byte
 * float32 allreduce (says so when not). */
static bool offers_direct_8b(const ddp_process_group *pg) {
  if (pg->direct_allreduce && pg->direct_count[DDP_FLOAT32] >= 2) return true;
  fprintf(stderr, "test_mpi_ranks: the mpi backend offers no direct path for an 8-byte allreduce\n");
  return false;
}

/* mode exclusion: the second thread's side. Rounds are handed over through
 * `posted` (the async op of round i submitted) and `done` (the blocking
 * call of round i returned), so every rank issues Y0 X0 Y1 X1 ...; the
 * overlap is inside each round, between X(i) and Y(i) in flight. */
enum { EXCL_ROUNDS = 400, EXCL_COUNT = 1024 };
typedef struct {
  ddp_process_group *pg;
  atomic_int posted, done;
  atomic_int failed;
  char msg[256];
} excl_state;

static bool excl_wait_for(atomic_int *v, int want, const atomic_int *failed) {
  int64_t until = ddp_time_ns() + 60 * 1000000000LL;
  for (long spins = 0; atomic_load(v) < want; spins++) {
    if (atomic_load(failed)) return false;
    if ((spins & 1023) == 1023 && ddp_time_ns() > until) return false;
    sched_yield();
  }
  return true;
}

static void *excl_async_side(void *arg) {
  excl_state *s = arg;
  int r = ddp_process_group_rank(s->pg), n = ddp_process_group_size(s->pg);
  static float y[EXCL_COUNT];
  for (int i = 0; i < EXCL_ROUNDS; i++) {
    if (!excl_wait_for(&s->done, i, &s->failed)) {
      if (!atomic_exchange(&s->failed, 1)) snprintf(s->msg, sizeof s->msg, "round %d: the blocking side stalled", i);
      return NULL;
    }
    for (int j = 0; j < EXCL_COUNT; j++) y[j] = (float)((r + 1) * (j % 7 + 1) + i % 5);
    ddp_work *w = NULL;
    ddp_status st = ddp_allreduce_async(s->pg, y, EXCL_COUNT, DDP_FLOAT32, DDP_REDUCE_SUM, &w);
    atomic_store(&s->posted, i + 1);
    if (st == DDP_OK) st = ddp_work_wait(w, -1);
    if (w) ddp_work_free(w);
    for (int j = 0; st == DDP_OK && j < EXCL_COUNT; j++)
      if (y[j] != (float)((j % 7 + 1) * n * (n + 1) / 2 + n * (i % 5))) {
        if (!atomic_exchange(&s->failed, 1))
          snprintf(s->msg, sizeof s->msg, "round %d: async allreduce element %d is %g, want %g", i, j, y[j],
                   (double)((j % 7 + 1) * n * (n + 1) / 2 + n * (i % 5)));
        return NULL;
      }
    if (st != DDP_OK) {
      if (!atomic_exchange(&s->failed, 1))
        snprintf(s->msg, sizeof s->msg, "round %d: async allreduce: %s", i, ddp_last_error());
      return NULL;
    }
  }
  return NULL;
}

static int mode_exclusion(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg), n = ddp_process_group_size(pg);
  if (!offers_direct_8b(pg)) return 1;
  /* The main thread first alone: it owns the bias where there is one. */
  float x[2] = {(float)(r + 1), -(float)(r + 1)};
  if (ddp_allreduce(pg, x, 2, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("exclusion: first allreduce");
  if (x[0] != (float)(n * (n + 1) / 2) || x[1] != -x[0]) return bad("exclusion: first allreduce: wrong value");
  bool biased_at_start = atomic_load(&pg->bias.biased);
  static excl_state s;
  s.pg = pg;
  pthread_t t;
  if (pthread_create(&t, NULL, excl_async_side, &s) != 0) return bad("exclusion: pthread_create");
  int rc = 0;
  for (int i = 0; i < EXCL_ROUNDS && !rc; i++) {
    if (!excl_wait_for(&s.posted, i + 1, &s.failed)) break;
    x[0] = (float)((r + 1) * (i % 11 + 1));
    x[1] = -(float)(r + 1);
    ddp_status st = ddp_allreduce(pg, x, 2, DDP_FLOAT32, DDP_REDUCE_SUM);
    if (st != DDP_OK) {
      fprintf(stderr, "test_mpi_ranks: rank %d: round %d: blocking allreduce: %s\n", r, i, ddp_last_error());
      rc = 1;
    } else if (x[0] != (float)((i % 11 + 1) * n * (n + 1) / 2) || x[1] != -(float)(n * (n + 1) / 2)) {
      fprintf(stderr, "test_mpi_ranks: rank %d: round %d: blocking allreduce gave %g %g, want %g %g\n", r, i, x[0],
              x[1], (double)((i % 11 + 1) * n * (n + 1) / 2), -(double)(n * (n + 1) / 2));
      rc = 1;
    }
    if (rc) atomic_store(&s.failed, 1);
    atomic_store(&s.done, i + 1);
  }
  pthread_join(t, NULL);
  if (atomic_load(&s.failed) && !rc) {
    fprintf(stderr, "test_mpi_ranks: rank %d: %s\n", r, s.msg);
    rc = 1;
  }
  /* The order of issue, from the flight recorder's collective numbers:
   * on every rank Y(i) then X(i) (each X right after its round's Y). A
   * blocking call that ran beside the queue could have taken a number
   * first (and gone to MPI first) while the MPI calls still matched. */
  if (!rc && (!pg->flight || pg->flight->capacity < 2 * EXCL_ROUNDS)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: the flight recorder holds fewer than %d records\n", r, 2 * EXCL_ROUNDS);
    rc = 1;
  }
  if (!rc) {
    static ddp__flight_record rec[1 << 16];
    static uint64_t count_at[2 * EXCL_ROUNDS];
    size_t got = pg->flight->capacity <= (1u << 16) ? ddp__flight_snapshot(pg->flight, rec) : 0;
    uint64_t first = UINT64_MAX;
    for (size_t k = 0; k < got; k++)
      if (rec[k].kind == DDP__OP_ALLREDUCE && rec[k].count == EXCL_COUNT && rec[k].seq && rec[k].seq < first)
        first = rec[k].seq;
    int seen = 0;
    for (size_t k = 0; k < got && first != UINT64_MAX; k++)
      if (rec[k].kind == DDP__OP_ALLREDUCE && rec[k].seq >= first && rec[k].seq - first < 2 * EXCL_ROUNDS) {
        count_at[rec[k].seq - first] = rec[k].count;
        seen++;
      }
    if (seen != 2 * EXCL_ROUNDS) {
      fprintf(stderr, "test_mpi_ranks: rank %d: %d of %d rounds' records in the flight recorder\n", r, seen,
              2 * EXCL_ROUNDS);
      rc = 1;
    }
    for (int k = 0; k < 2 * EXCL_ROUNDS && !rc; k++)
      if (count_at[k] != (k % 2 ? 2u : (uint64_t)EXCL_COUNT)) {
        fprintf(stderr, "test_mpi_ranks: rank %d: collective #%llu of the rounds has %llu elements, want %d: "
                "a blocking call was issued out of turn\n", r, (unsigned long long)(first + k),
                (unsigned long long)count_at[k], k % 2 ? 2 : EXCL_COUNT);
        rc = 1;
      }
  }
  if (!rc && !atomic_load(&pg->bias.revoked)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: async work ran but the group's bias was not revoked\n", r);
    rc = 1;
  }
  if (!rc)
    printf("rank %d: exclusion: %d rounds of a blocking 8-byte allreduce beside an async one in flight, all right "
           "(group biased at start: %s)\n", r, EXCL_ROUNDS, biased_at_start ? "yes" : "no");
  return rc;
}

/* mode lane: the second thread's side, LANE_MSGS messages of 3 int32
 * round the ring (send to the next rank, receive from the previous one:
 * an async send, then a blocking receive, so no rank waits on its own
 * send). */
enum { LANE_CALLS = 1200, LANE_MAX_CALLS = 40000, LANE_MSGS = 300, LANE_START = 100 };
typedef struct {
  ddp_process_group *pg;
  atomic_int calls; /* blocking allreduces the main thread made */
  atomic_int lane_done;
  atomic_int failed;
  char msg[256];
} lane_state;

static void *lane_side(void *arg) {
  lane_state *s = arg;
  int r = ddp_process_group_rank(s->pg), n = ddp_process_group_size(s->pg);
  int64_t until = ddp_time_ns() + 60 * 1000000000LL;
  while (atomic_load(&s->calls) < LANE_START && !atomic_load(&s->failed) && ddp_time_ns() < until) sched_yield();
  for (int i = 0; i < LANE_MSGS && !atomic_load(&s->failed); i++) {
    int32_t out[3] = {r, i, r * 1000 + i}, in[3] = {-1, -1, -1};
    int prev = (r + n - 1) % n;
    ddp_work *w = NULL;
    ddp_status st = ddp_isend(s->pg, out, 3, DDP_INT32, (r + 1) % n, 5, &w);
    if (st == DDP_OK) st = ddp_recv(s->pg, in, 3, DDP_INT32, prev, 5);
    if (st == DDP_OK && w) st = ddp_work_wait(w, -1);
    if (w) ddp_work_free(w);
    if (st != DDP_OK || in[0] != prev || in[1] != i || in[2] != prev * 1000 + i) {
      if (!atomic_exchange(&s->failed, 1))
        snprintf(s->msg, sizeof s->msg, "message %d from rank %d: %s (got %d %d %d)", i, prev,
                 st != DDP_OK ? ddp_last_error() : "wrong contents", in[0], in[1], in[2]);
      atomic_store(&s->lane_done, 1);
      return NULL;
    }
  }
  atomic_store(&s->lane_done, 1);
  return NULL;
}

static int mode_lane(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg), n = ddp_process_group_size(pg);
  if (!offers_direct_8b(pg)) return 1;
  if (!pg->flight || pg->flight->capacity < LANE_MAX_CALLS + 2 * LANE_MSGS) {
    fprintf(stderr, "test_mpi_ranks: rank %d: the flight recorder holds fewer than %d records "
            "(DDP_FLIGHT_RECORDER_SIZE)\n", r, LANE_MAX_CALLS + 2 * LANE_MSGS);
    return 1;
  }
  /* The group biased to this thread, where the process can (bias.h): the
   * owner's plain claims are what is raced here. */
  const char *inline_bias = getenv("DDP_INLINE_BIAS");
  bool want_biased = ddp__bias_available() && !DDP__BIAS_TSAN && !(inline_bias && !strcmp(inline_bias, "0"));
  if (atomic_load(&pg->bias.biased) != want_biased || atomic_load(&pg->flight->claim.biased) != want_biased) {
    fprintf(stderr, "test_mpi_ranks: rank %d: lane: group biased %d, claims biased %d, want %d\n", r,
            (int)atomic_load(&pg->bias.biased), (int)atomic_load(&pg->flight->claim.biased), (int)want_biased);
    return 1;
  }
  uint64_t ids_before = atomic_load(&pg->flight->next_id), seq0 = pg->next_seq;
  static lane_state s;
  s.pg = pg;
  pthread_t t;
  if (pthread_create(&t, NULL, lane_side, &s) != 0) return bad("lane: pthread_create");
  int rc = 0, calls = 0, revoked_at = -1;
  /* At least LANE_CALLS, and on until the lane is done: every rank stops
   * at the first round boundary where all are done (a MAX of the flags,
   * every LANE_CALLS calls), so the ranks' calls match. */
  for (int i = 0; !rc && i < LANE_MAX_CALLS; i++) {
    if (i >= LANE_CALLS && i % LANE_CALLS == 0) {
      int32_t done = atomic_load(&s.lane_done);
      int32_t all = done;
      if (ddp_allreduce(pg, &all, 1, DDP_INT32, DDP_REDUCE_MIN) != DDP_OK) {
        rc = bad("lane: allreduce of the flags");
        break;
      }
      calls++;
      if (all) break;
    }
    float x[2] = {(float)((r + 1) * (i % 13 + 1)), -(float)(r + 1)};
    if (ddp_allreduce(pg, x, 2, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) {
      rc = bad("lane: blocking allreduce");
    } else if (x[0] != (float)((i % 13 + 1) * n * (n + 1) / 2) || x[1] != -(float)(n * (n + 1) / 2)) {
      fprintf(stderr, "test_mpi_ranks: rank %d: call %d: allreduce gave %g %g\n", r, i, x[0], x[1]);
      rc = 1;
    }
    calls++;
    if (revoked_at < 0 && atomic_load(&pg->flight->claim.revoked)) revoked_at = calls;
    atomic_store(&s.calls, i + 1);
  }
  if (rc) atomic_store(&s.failed, 1);
  pthread_join(t, NULL);
  if (!rc && atomic_load(&s.failed)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: lane: %s\n", r, s.msg);
    rc = 1;
  }
  if (rc) return rc;
  bool biased = atomic_load(&pg->bias.biased), claim_revoked = atomic_load(&pg->flight->claim.revoked);
  /* Every record made since, each number once: the ring holds them all
   * (capacity checked above), so a number claimed twice leaves it short. */
  uint64_t made = atomic_load(&pg->flight->next_id) - ids_before;
  uint64_t want = (uint64_t)calls + 2 * (uint64_t)LANE_MSGS;
  static ddp__flight_record rec[1 << 16];
  size_t got = pg->flight->capacity <= (1u << 16) ? ddp__flight_snapshot(pg->flight, rec) : 0;
  int allreduces = 0, sends = 0, recvs = 0;
  uint64_t next_seq = seq0 + 1;
  for (size_t k = 0; k < got; k++) {
    const ddp__flight_record *x = &rec[k];
    if (x->id < ids_before) continue;
    if (x->state != DDP__FLIGHT_COMPLETED) {
      fprintf(stderr, "test_mpi_ranks: rank %d: record %llu is %s\n", r, (unsigned long long)x->id,
              ddp__flight_state_name(x->state));
      return 1;
    }
    if (x->kind == DDP__OP_ALLREDUCE && (x->count == 2 || x->count == 1)) {
      if (x->seq != next_seq++) {
        fprintf(stderr, "test_mpi_ranks: rank %d: allreduce record %llu has collective #%llu, want #%llu\n", r,
                (unsigned long long)x->id, (unsigned long long)x->seq, (unsigned long long)(next_seq - 1));
        return 1;
      }
      allreduces++;
    } else if (x->kind == DDP__OP_SEND && x->count == 3) {
      sends++;
    } else if (x->kind == DDP__OP_RECV && x->count == 3) {
      recvs++;
    }
  }
  if (made != want || allreduces != calls || sends != LANE_MSGS || recvs != LANE_MSGS) {
    fprintf(stderr, "test_mpi_ranks: rank %d: lane: %llu record numbers taken, %d allreduces, %d sends and %d "
            "receives recorded; want %llu, %d, %d, %d\n", r, (unsigned long long)made, allreduces, sends, recvs,
            (unsigned long long)want, calls, LANE_MSGS, LANE_MSGS);
    return 1;
  }
  if (want_biased && (revoked_at < 0 || revoked_at >= calls)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: lane: the claims were revoked after call %d of %d: the lane's "
            "records did not come while the owner was making its own\n", r, revoked_at, calls);
    return 1;
  }
  if (!claim_revoked) {
    fprintf(stderr, "test_mpi_ranks: rank %d: lane: point-to-point records were made but the owner's claims "
            "were not revoked\n", r);
    return 1;
  }
  printf("rank %d: lane: %d blocking allreduces beside %d messages, %llu records each numbered once "
         "(group still biased: %s; claims revoked after call %d)\n", r, calls, LANE_MSGS, (unsigned long long)made,
         biased ? "yes" : "no", revoked_at);
  return 0;
}

/* mode smallmismatch (2 ranks): rank 1 reduces 3 floats where rank 0
 * reduces 2, below DDP_MPI_SMALL_BYTES: both fail naming the counts
 * (each receives into room for DDP__MPI_SMALL_MAX and compares), rather
 * than one reducing stale bytes. */
static int mode_smallmismatch(ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg);
  if (!ddp__mpi_small_bytes(pg->host_backend)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: small allreduces are not on point-to-point here\n", r);
    return 1;
  }
  float x[3] = {1, 2, 3};
  ddp_status st = ddp_allreduce(pg, x, r == 1 ? 3 : 2, DDP_FLOAT32, DDP_REDUCE_SUM);
  if (st == DDP_OK) {
    fprintf(stderr, "test_mpi_ranks: rank %d: a mismatched small allreduce succeeded (%g %g %g)\n", r, x[0], x[1],
            x[2]);
    return 1;
  }
  printf("rank %d: mismatched small allreduce failed: %s\n", r, ddp_last_error());
  if (!strstr(ddp_last_error(), "every rank must pass the same count")) {
    fprintf(stderr, "test_mpi_ranks: rank %d: the error does not name the mismatch\n", r);
    return 1;
  }
  return 0;
}

static double clock_s(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int mode_arrival(ddp_process_group *pg) {
  enum { N = 1 << 18 }; /* 1 MiB of float32 per rank: past the DDP_MPI_ARRIVAL_BYTES test_mpi.sh sets */
  int r = ddp_process_group_rank(pg), n = ddp_process_group_size(pg);
  static float v[N];
  for (int i = 0; i < N; i++) v[i] = (float)(r + 1) + (float)(i % 7);
  if (ddp_barrier(pg) != DDP_OK) return bad("barrier");
  if (r != 0) sleep(1);
  double wall0 = clock_s(CLOCK_MONOTONIC), cpu0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
  if (ddp_allreduce(pg, v, N, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("1 MiB allreduce");
  double wall = clock_s(CLOCK_MONOTONIC) - wall0, cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - cpu0;
  for (int i = 0; i < N; i++) {
    float want = (float)(n * (n + 1) / 2) + (float)(n * (i % 7)); /* small integers: exact */
    if (v[i] != want) {
      fprintf(stderr, "test_mpi_ranks: rank %d: element %d is %g, want %g\n", r, i, v[i], want);
      return 1;
    }
  }
  if (r == 0) {
    printf("rank 0 waited %.3f s for its peers at a 1 MiB allreduce using %.3f s of CPU\n", wall, cpu);
    if (wall < 0.5) {
      fprintf(stderr, "test_mpi_ranks: rank 0 waited only %.3f s; the others sleep 1 s first\n", wall);
      return 1;
    }
    if (cpu > 0.5 * wall) {
      fprintf(stderr, "test_mpi_ranks: rank 0 spent %.3f s of CPU in a %.3f s wait for late peers: the arrival "
              "barrier should sleep (docs/comm.md, \"Blocking and nonblocking, and polling\")\n", cpu, wall);
      return 1;
    }
  }
  return 0;
}

static int mode_stall(ddp_process_group *pg) {
  float v[2] = {1, 2};
  if (ddp_allreduce(pg, v, 2, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) return bad("first allreduce");
  if (ddp_process_group_rank(pg) == 1) sleep(30);
  ddp_status st = ddp_allreduce(pg, v, 2, DDP_FLOAT32, DDP_REDUCE_SUM);
  fprintf(stderr, "test_mpi_ranks: rank %d: second allreduce: %s: %s\n", ddp_process_group_rank(pg),
          ddp_status_name(st), ddp_last_error());
  /* A non-zero exit makes mpirun end the job (the sleeper too). */
  return 3;
}

/* The host test_mpi.sh gives rank r of 4 under DDP_TEST_LAYOUT. */
static int layout_host(const char *layout, int r) {
  if (!strcmp(layout, "interleaved")) return r % 2;
  if (!strcmp(layout, "uneven")) return r < 3 ? 0 : 1;
  return r / 2; /* block */
}

/* One float32 SUM allreduce of `count` elements, each rank giving r + 1
 * (the sum 1 + ... + P, exact in float32), and the shared-memory bytes it
 * moved on this rank: ddp's local backend counts them, MPI's own shared
 * memory is not counted, so they are more than 0 only where the call
 * composed (docs/comm.md, "Hierarchy"). */
static int path_of_allreduce(ddp_process_group *pg, size_t count, bool want_composed) {
  int P = ddp_process_group_size(pg), r = ddp_process_group_rank(pg);
  float *v = malloc(count * sizeof *v);
  for (size_t i = 0; i < count; i++) v[i] = (float)(r + 1);
  ddp_comm_counters c0, c1;
  ddp_process_group_counters(pg, &c0);
  ddp_status st = ddp_allreduce(pg, v, count, DDP_FLOAT32, DDP_REDUCE_SUM);
  ddp_process_group_counters(pg, &c1);
  int rc = st == DDP_OK ? 0 : bad("allreduce (path)");
  for (size_t i = 0; i < count && !rc; i++)
    if (v[i] != (float)(P * (P + 1) / 2)) {
      fprintf(stderr, "test_mpi_ranks: rank %d: allreduce of %zu B [%zu] = %g, want %d\n", r, count * 4, i,
              (double)v[i], P * (P + 1) / 2);
      rc = 1;
    }
  uint64_t shm = c1.shm_bytes - c0.shm_bytes;
  if (!rc && (shm > 0) != want_composed) {
    fprintf(stderr, "test_mpi_ranks: rank %d: allreduce of %zu B moved %llu B through ddp's shared memory: it "
            "ran %s, want %s\n", r, count * 4, (unsigned long long)shm, shm ? "composed" : "flat on MPI",
            want_composed ? "composed" : "flat on MPI");
    rc = 1;
  }
  free(v);
  return rc;
}

/* Async allreduces below and at the threshold in flight together (flat ones
 * up to four at once, a composed one after the flat ones before it), then
 * a blocking one: each the closed form. */
static int mixed_async(ddp_process_group *pg, size_t small, size_t at) {
  int P = ddp_process_group_size(pg), r = ddp_process_group_rank(pg);
  enum { K = 7 };
  /* flat, flat, flat, composed, flat, composed, composed (where at is) */
  const bool big[K] = {false, false, false, true, false, true, true};
  float *bufs[K];
  ddp_work *works[K];
  int rc = 0;
  for (int k = 0; k < K; k++) {
    size_t n = big[k] ? at : small;
    bufs[k] = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) bufs[k][i] = (float)((r + 1) * (k + 1));
    if (ddp_allreduce_async(pg, bufs[k], n, DDP_FLOAT32, DDP_REDUCE_SUM, &works[k]) != DDP_OK) {
      rc = bad("async allreduce (mixed)");
      for (int j = 0; j < k; j++) ddp_work_wait(works[j], -1), ddp_work_free(works[j]);
      for (int j = 0; j <= k; j++) free(bufs[j]);
      return rc;
    }
  }
  for (int k = 0; k < K; k++) {
    if (ddp_work_wait(works[k], -1) != DDP_OK && !rc) rc = bad("async allreduce wait (mixed)");
    ddp_work_free(works[k]);
    size_t n = big[k] ? at : small;
    float want = (float)(P * (P + 1) / 2 * (k + 1));
    for (size_t i = 0; i < n && !rc; i++)
      if (bufs[k][i] != want) {
        fprintf(stderr, "test_mpi_ranks: rank %d: mixed async allreduce %d (%zu B) [%zu] = %g, want %g\n", r, k,
                n * 4, i, (double)bufs[k][i], (double)want);
        rc = 1;
      }
    free(bufs[k]);
  }
  return rc ? rc : check_sum(pg, r, P * (P + 1) / 2, "blocking allreduce after the mixed async ones");
}

static int mode_hier(ddp_process_group *pg) {
  int P = ddp_process_group_size(pg), r = ddp_process_group_rank(pg);
  const char *layout = getenv("DDP_TEST_LAYOUT") ? getenv("DDP_TEST_LAYOUT") : "block";
  const char *hier = getenv("DDP_MPI_HIER");
  bool composed = !(hier && !strcmp(hier, "0"));
  if (P != 4) {
    fprintf(stderr, "test_mpi_ranks: hier wants 4 ranks, not %d\n", P);
    return 1;
  }
  for (int q = 0; q < P; q++) {
    const char *want = !composed ? "mpi" : q == r ? "self"
                       : layout_host(layout, q) == layout_host(layout, r) ? "shm" : "mpi";
    const char *got = ddp_process_group_transport(pg, q);
    if (strcmp(got, want) != 0) {
      fprintf(stderr, "test_mpi_ranks: rank %d (layout %s, DDP_MPI_HIER %s): transport to rank %d is %s, want %s\n",
              r, layout, hier ? hier : "unset", q, got, want);
      return 1;
    }
  }
  /* Which path ran: below the threshold flat on MPI, from it composed
   * (where this rank's host has host mates: the uneven layout's rank 3 is
   * alone on its host and its part is MPI's between the leaders). */
  const char *hb = getenv("DDP_MPI_HIER_BYTES");
  size_t threshold = hb ? (size_t)strtoull(hb, NULL, 10) : DDP__MPI_HIER_DEFAULT_BYTES;
  int mates = 0;
  for (int q = 0; q < P; q++) mates += q != r && layout_host(layout, q) == layout_host(layout, r);
  size_t small = 16384, at = threshold ? (threshold + 3) / 4 : 1; /* elements: 64 KiB, the threshold */
  if (path_of_allreduce(pg, small, composed && mates > 0 && small * 4 >= threshold) ||
      path_of_allreduce(pg, at, composed && mates > 0) || mixed_async(pg, small, at))
    return 1;
  /* The direct path of a small blocking allreduce (collectives.c), as on
   * flat MPI, and only below the threshold (none where every size
   * composes). */
  size_t direct = pg->direct_allreduce ? pg->direct_count[DDP_FLOAT32] * 4 : 0;
  if (composed && (threshold ? direct == 0 || direct >= threshold : direct != 0)) {
    fprintf(stderr, "test_mpi_ranks: rank %d: the direct path takes float32 allreduces up to %zu B; want 1 B up "
            "to below the threshold %zu B (none at threshold 0)\n", r, direct, threshold);
    return 1;
  }
  const char *quick = getenv("DDP_TEST_QUICK");
  if (quick && !strcmp(quick, "1")) return check_sum(pg, r, P * (P + 1) / 2, "allreduce (hier, quick)");
  /* A subgroup of every rank in reverse order spans the same hosts: it
   * composes too, with its own leaders (subgroup rank s is parent rank
   * P - 1 - s). */
  ddp_process_group *rev = NULL;
  if (ddp_process_group_split(pg, 0, -r, &rev) != DDP_OK) return bad("split (reversed)");
  int rc = 0;
  for (int s = 0; s < P && !rc; s++) {
    int q = P - 1 - s;
    const char *want = q == r ? "self" : layout_host(layout, q) == layout_host(layout, r) ? "shm" : "mpi";
    const char *got = ddp_process_group_transport(rev, s);
    if (composed && strcmp(got, want) != 0) {
      fprintf(stderr, "test_mpi_ranks: rank %d: reversed subgroup's transport to its rank %d is %s, want %s\n", r,
              s, got, want);
      rc = 1;
    }
  }
  if (!rc) rc = check_sum(rev, r, P * (P + 1) / 2, "allreduce on the reversed subgroup");
  if (!rc && ddp_monitored_barrier(pg, 30, true) != DDP_OK) rc = bad("monitored_barrier");
  ddp_process_group_destroy(rev);
  if (!rc) rc = mode_matrix(pg);
  if (!rc) rc = mode_p2p(pg);
  return rc;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  ddp_process_group_options o = ddp_process_group_defaults();
  o.backend = "mpi";
  o.timeout_s = strcmp(mode, "stall") ? 120 : 3;
  ddp_process_group *pg = NULL;
  if (!strcmp(mode, "outside")) {
    /* Both doors: the MPI constructor, and init_process_group with backend mpi. */
    ddp_status st = ddp_process_group_from_mpi_comm(NULL, &o, &pg);
    const char *e = ddp_last_error();
    if (st == DDP_OK || !strstr(e, "mpirun") || !strstr(e, "no launcher")) {
      fprintf(stderr, "test_mpi_ranks: outside mpirun: %s (%s), want a failure naming mpirun\n", ddp_status_name(st), e);
      return 1;
    }
    printf("from_mpi_comm: %s\n", e);
    st = ddp_init_process_group("env://", NULL, &o, &pg);
    e = ddp_last_error();
    if (st == DDP_OK || !strstr(e, "mpirun")) {
      fprintf(stderr, "test_mpi_ranks: init_process_group: %s (%s), want a failure naming mpirun\n", ddp_status_name(st), e);
      return 1;
    }
    printf("init_process_group: %s\n", e);
    return 0;
  }
  if (!strcmp(mode, "usercomm")) {
    int provided = 0, wr = 0, wn = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    MPI_Comm_size(MPI_COMM_WORLD, &wn);
    MPI_Comm mine;
    MPI_Comm_split(MPI_COMM_WORLD, 0, wn - wr, &mine); /* reversed order */
    int cr = -1;
    MPI_Comm_rank(mine, &cr);
    int rc = 0;
    if (ddp_process_group_from_mpi_comm(&mine, &o, &pg) != DDP_OK) {
      rc = bad("from_mpi_comm");
    } else if (ddp_process_group_rank(pg) != cr || ddp_process_group_size(pg) != wn) {
      fprintf(stderr, "test_mpi_ranks: group rank %d of %d, communicator's %d of %d\n", ddp_process_group_rank(pg),
              ddp_process_group_size(pg), cr, wn);
      rc = 1;
    } else {
      rc = check_sum(pg, cr, wn * (wn + 1) / 2, "allreduce on the user's communicator");
      /* The program's own MPI traffic on its communicator beside ddp's. */
      int one = 1, all = 0;
      MPI_Allreduce(&one, &all, 1, MPI_INT, MPI_SUM, mine);
      if (!rc && all != wn) rc = 1;
      if (!rc) rc = mode_matrix(pg);
    }
    ddp_process_group_destroy(pg);
    MPI_Comm_free(&mine);
    MPI_Finalize(); /* the program started MPI, so it finalizes it */
    return rc;
  }
  if (ddp_init_process_group("mpi://", NULL, &o, &pg) != DDP_OK) return bad("init_process_group(mpi://)");
  int rc = 2;
  if (!strcmp(mode, "matrix")) rc = mode_matrix(pg);
  else if (!strcmp(mode, "p2p")) rc = mode_p2p(pg);
  else if (!strcmp(mode, "subgroups")) rc = mode_subgroups(pg);
  else if (!strcmp(mode, "kill")) rc = mode_kill(pg);
  else if (!strcmp(mode, "stall")) rc = mode_stall(pg);
  else if (!strcmp(mode, "arrival")) rc = mode_arrival(pg);
  else if (!strcmp(mode, "mismatch")) rc = mode_mismatch(pg);
  else if (!strcmp(mode, "direct")) rc = mode_direct(pg);
  else if (!strcmp(mode, "exclusion")) rc = mode_exclusion(pg);
  else if (!strcmp(mode, "lane")) rc = mode_lane(pg);
  else if (!strcmp(mode, "smallmismatch")) rc = mode_smallmismatch(pg);
  else if (!strcmp(mode, "hier")) rc = mode_hier(pg);
  else fprintf(stderr, "test_mpi_ranks: unknown mode \"%s\"\n", mode);
  ddp_process_group_destroy(pg);
  return rc;
}
