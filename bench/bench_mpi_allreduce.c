/* bench_mpi_allreduce: ddp_allreduce on the mpi backend against Open MPI's
 * own MPI_Allreduce in one process (issue 38, docs/comm.md MPI "Speed"), so
 * that the ratio does not depend on the state the machine is in when a
 * program starts (this VM runs a world-2 8-byte allreduce either at about
 * 0.25 us or at about 0.5 us a call, from one launch to the next).
 *
 *   mpirun -np 2 bench_mpi_allreduce [-b BYTES (8)] [-n CALLS (2000)]
 *                                    [-r ROUNDS (200)] [-w WARMUP (2000)]
 *                                    [-s SIDE,SIDE,... (world,comm,ddp)]
 *                                    [-a OFFSET (0)] [-p BLOCKS [-k STEP]]
 *
 * A round runs a block of CALLS blocking in-place float32 SUM allreduces of
 * BYTES per rank for each side, the order rotated by one each round; each
 * block starts after an MPI_Barrier and is timed on its own (CLOCK_MONOTONIC
 * around the block, the slower rank's time). Printed per side: the median
 * per-call time over the rounds and its quartiles, and against the first
 * side (world by default) the ratio of medians and the median of the
 * rounds' paired ratios (first side's time over this side's: above 1 this
 * side is faster; the bar of issue 38 is 0.95 for ddp). Sides:
 *   world      MPI_Allreduce(MPI_IN_PLACE, buf, ..., MPI_COMM_WORLD): the
 *              like-with-like reference's call (scripts/mpi-refs.sh);
 *   comm       the same on the communicator ddp's group runs its
 *              collectives on (a duplicate of MPI_COMM_WORLD with
 *              MPI_ERRORS_RETURN): whether ddp's communicator costs;
 *   ddp        ddp_allreduce(pg, buf, ..., DDP_FLOAT32, DDP_REDUCE_SUM) on
 *              a group from ddp_process_group_from_mpi_comm(NULL), what
 *              `mpirun -np 2 ddp-bench allreduce --backend mpi` makes;
 * and, to find what ddp's call costs, MPI's call on ddp's communicator with
 * one piece of what ddp's direct path does around it, done here, in this
 * program (the library has no switch for them):
 *   comm+cas   the group's idle check: a locked compare-and-swap before,
 *              a locked fetch-and-subtract after (pg->active);
 *   comm+fence the same place for a full fence (mfence) before and after;
 *   comm+pre   the fence before only;  comm+post  the fence after only;
 *   comm+xadd  the flight recorder's locked add (a record's number);
 *   comm+clock two CLOCK_MONOTONIC_COARSE readings (vDSO), the deadline's
 *              and the flight recorder's;
 *   comm+watch the watchdog's three stores before (op, number, deadline:
 *              release) and one after, on a line another thread reads;
 *   comm+all   cas, xadd, clock and watch together: the direct path's
 *              costs other than its instructions.
 * -p BLOCKS: before ddp's group is made, BLOCKS blocks of world alone
 * (printed as world-pre), to see whether making the group changes MPI's
 * own call (it did: ddp's bootstrap broadcast, see do_step); -k STEP does
 * STEP (see do_step) after half of them and prints the second half apart
 * (world-step). With -p, this program starts MPI itself (MPI_Init_thread,
 * MPI_THREAD_MULTIPLE) and finalizes it; otherwise ddp starts it, as in
 * ddp-bench. -a OFFSET moves the buffer OFFSET bytes off its 64-byte
 * alignment. DDP_FLIGHT_RECORDER_SIZE=0 and the like apply to the ddp side
 * as to any program. Exits 1 on a wrong result (checked for every side
 * after the rounds), 2 on a usage error. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm_internal.h"
#include "comm/mpi/mpi_internal.h"
#include "comm/op.h"
#include "ddp/comm.h"

enum { SIDE_WORLD, SIDE_COMM, SIDE_DDP, SIDE_CAS, SIDE_FENCE, SIDE_PRE, SIDE_POST, SIDE_XADD, SIDE_CLOCK,
       SIDE_WATCH, SIDE_ALL, SIDE_KINDS };
static const char *const side_names[SIDE_KINDS] = {"world", "comm", "ddp", "comm+cas", "comm+fence", "comm+pre",
                                                   "comm+post", "comm+xadd", "comm+clock", "comm+watch",
                                                   "comm+all"};

/* What comm+cas and comm+watch write: the group's idle word, and the
 * watchdog's view of the call (a thread of its own reads it, as the mpi
 * backend's watchdog does). */
typedef struct emulated {
  _Alignas(64) atomic_uint_fast64_t active;
  _Alignas(64) _Atomic uint64_t next_id;
  _Alignas(64) _Atomic int64_t deadline;
  const char *_Atomic op;
  _Atomic uint64_t seq;
  atomic_bool stop;
} emulated;

static emulated g_emu;
static volatile int64_t g_sink;

static void *watch_main(void *arg) {
  (void)arg;
  while (!atomic_load(&g_emu.stop)) {
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
    g_sink = atomic_load_explicit(&g_emu.deadline, memory_order_acquire);
  }
  return NULL;
}

static int emulated_call(int side, MPI_Comm comm, float *buf, int n, uint64_t seq) {
  bool cas = side == SIDE_CAS || side == SIDE_ALL, clock = side == SIDE_CLOCK || side == SIDE_ALL;
  bool watch = side == SIDE_WATCH || side == SIDE_ALL, xadd = side == SIDE_XADD || side == SIDE_ALL;
  bool pre = side == SIDE_FENCE || side == SIDE_PRE, post = side == SIDE_FENCE || side == SIDE_POST;
  uint_fast64_t idle = 0;
  if (cas && !atomic_compare_exchange_strong(&g_emu.active, &idle, 1)) return MPI_ERR_OTHER;
  if (pre) atomic_thread_fence(memory_order_seq_cst);
  if (xadd) g_sink = (int64_t)atomic_fetch_add_explicit(&g_emu.next_id, 1, memory_order_relaxed);
  int64_t now = clock ? ddp__now_coarse_ns() : 0;
  if (watch) {
    atomic_store_explicit(&g_emu.op, "allreduce", memory_order_relaxed);
    atomic_store_explicit(&g_emu.seq, seq, memory_order_relaxed);
    atomic_store_explicit(&g_emu.deadline, now + 1800000000000LL, memory_order_release);
  }
  int rc = MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm);
  if (watch) atomic_store_explicit(&g_emu.deadline, 0, memory_order_release);
  if (clock) g_sink = ddp__now_coarse_ns() - now;
  if (post) atomic_thread_fence(memory_order_seq_cst);
  if (cas) atomic_fetch_sub(&g_emu.active, 1);
  return rc;
}

/* One block of `calls` calls of `side`; false on an error (printed). */
static bool run_block(int side, ddp_process_group *pg, MPI_Comm comm, float *buf, int n, int calls, uint64_t *seq) {
  for (int k = 0; k < calls; k++) {
    int rc = MPI_SUCCESS;
    switch (side) {
    case SIDE_WORLD: rc = MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case SIDE_COMM: rc = MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm); break;
    case SIDE_DDP:
      if (ddp_allreduce(pg, buf, (size_t)n, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) {
        fprintf(stderr, "bench_mpi_allreduce: ddp_allreduce: %s\n", ddp_last_error());
        return false;
      }
      break;
    default: rc = emulated_call(side, comm, buf, n, ++*seq); break;
    }
    if (rc != MPI_SUCCESS) {
      fprintf(stderr, "bench_mpi_allreduce: %s: MPI error %d\n", side_names[side], rc);
      return false;
    }
  }
  return true;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The q-quantile of v[0..n) (sorted in place), interpolated. */
static double quantile(double *v, int n, double q) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  double pos = q * (n - 1);
  int i = (int)pos;
  return i + 1 < n ? v[i] + (pos - i) * (v[i + 1] - v[i]) : v[i];
}

/* -k STEP, between the two halves of -p's blocks: what might change MPI's
 * own call, done once on every rank (for the search that found the
 * bootstrap's broadcast; docs/comm.md, MPI, "Speed"):
 *   sendB       one message of B bytes from rank 0 to rank 1 only;
 *   sendrecvB   one message of B bytes each way;
 *   bcast       MPI_Bcast of 512 bytes from rank 0 (what ddp's bootstrap
 *               did before it became an allreduce);
 *   group       a ddp group made and destroyed (ddp_process_group_from_mpi_comm);
 *   dup         two MPI_Comm_dup, the second with MPI_ERRORS_RETURN;
 *   nbc         an MPI_Ibarrier, waited for;
 *   thread      one more thread, waking every 50 ms. */
static void do_step(const char *step) {
  int me = 0, size = 0, b = 0;
  char tmp[4096] = {0}, rcv[4096];
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (!strncmp(step, "send", 4) && size != 2) {
    if (me == 0) fprintf(stderr, "bench_mpi_allreduce: step %s is for a world of 2, not %d\n", step, size);
  } else if (sscanf(step, "sendrecv%d", &b) == 1 && b >= 0 && b <= 4096) {
    MPI_Sendrecv(tmp, b, MPI_BYTE, 1 - me, 7, rcv, b, MPI_BYTE, 1 - me, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else if (sscanf(step, "send%d", &b) == 1 && b >= 0 && b <= 4096) {
    if (me == 0) MPI_Send(tmp, b, MPI_BYTE, 1, 9, MPI_COMM_WORLD);
    else if (me == 1) MPI_Recv(tmp, b, MPI_BYTE, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else if (!strcmp(step, "bcast")) {
    MPI_Bcast(tmp, 512, MPI_CHAR, 0, MPI_COMM_WORLD);
  } else if (!strcmp(step, "group")) {
    ddp_process_group_options o = ddp_process_group_defaults();
    ddp_process_group *g = NULL;
    if (ddp_process_group_from_mpi_comm(NULL, &o, &g) == DDP_OK) ddp_process_group_destroy(g);
  } else if (!strcmp(step, "dup")) {
    MPI_Comm c1, c2;
    MPI_Comm_dup(MPI_COMM_WORLD, &c1);
    MPI_Comm_dup(c1, &c2);
    MPI_Comm_set_errhandler(c2, MPI_ERRORS_RETURN);
    MPI_Comm_free(&c2);
    MPI_Comm_free(&c1);
  } else if (!strcmp(step, "nbc")) {
    MPI_Request q;
    MPI_Ibarrier(MPI_COMM_WORLD, &q);
    MPI_Wait(&q, MPI_STATUS_IGNORE);
  } else if (!strcmp(step, "thread")) {
    pthread_t th;
    if (pthread_create(&th, NULL, watch_main, NULL) == 0) pthread_detach(th);
  } else {
    fprintf(stderr, "bench_mpi_allreduce: unknown step \"%s\"\n", step);
  }
}

static void usage(void) {
  fprintf(stderr, "usage: mpirun -np 2 bench_mpi_allreduce [-b BYTES] [-n CALLS] [-r ROUNDS] [-w WARMUP] "
                  "[-s SIDES] [-a OFFSET] [-p BLOCKS [-k STEP]]\n");
  exit(2);
}

static int parse_sides(const char *list, int *sides) {
  int n = 0;
  char copy[256];
  snprintf(copy, sizeof copy, "%s", list);
  for (char *save = NULL, *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    int k = 0;
    while (k < SIDE_KINDS && strcmp(t, side_names[k]) != 0) k++;
    if (k == SIDE_KINDS || n == SIDE_KINDS) {
      fprintf(stderr, "bench_mpi_allreduce: unknown side \"%s\"\n", t);
      usage();
    }
    sides[n++] = k;
  }
  return n;
}

int main(int argc, char **argv) {
  long bytes = 8, calls = 2000, rounds = 200, warmup = 2000, offset = 0, pre_blocks = 0;
  const char *step = NULL;
  int sides[SIDE_KINDS], nsides = parse_sides("world,comm,ddp", sides);
  for (int i = 1; i < argc; i++) {
    if (i + 1 >= argc) usage();
    const char *f = argv[i], *v = argv[++i];
    char *end = NULL;
    long x = strtol(v, &end, 10);
    bool num = *v && !*end;
    if (!strcmp(f, "-s")) nsides = parse_sides(v, sides);
    else if (!strcmp(f, "-k")) step = v;
    else if (!num || x < 0) usage();
    else if (!strcmp(f, "-b")) bytes = x;
    else if (!strcmp(f, "-n")) calls = x;
    else if (!strcmp(f, "-r")) rounds = x;
    else if (!strcmp(f, "-w")) warmup = x;
    else if (!strcmp(f, "-a")) offset = x;
    else if (!strcmp(f, "-p")) pre_blocks = x;
    else usage();
  }
  if (bytes < 4 || bytes % 4 || bytes > (1L << 30) || calls < 1 || rounds < 1 || offset >= 64 || offset % 4)
    usage();
  int n = (int)(bytes / 4);
  char *raw = ddp_alloc((size_t)bytes + 64);
  double *times = calloc((size_t)rounds * SIDE_KINDS, sizeof *times);
  double *slowest = calloc((size_t)rounds * SIDE_KINDS, sizeof *slowest);
  if (!raw || !times || !slowest) return 1;
  float *buf = (float *)(void *)(raw + offset);
  memset(buf, 0, (size_t)bytes); /* 0 + 0: the values stay finite */
  /* -p: world blocks before ddp's group exists (MPI started here, at the
   * level ddp asks), to see whether the group's presence slows MPI's own
   * call. */
  double pre_med = 0, pre2_med = 0;
  if (pre_blocks > 0) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    double *t = calloc((size_t)pre_blocks, sizeof *t), *tm = calloc((size_t)pre_blocks, sizeof *tm);
    uint64_t seq0 = 0;
    run_block(SIDE_WORLD, NULL, MPI_COMM_WORLD, buf, n, (int)warmup, &seq0);
    for (long r = 0; r < pre_blocks; r++) {
      if (step && r == pre_blocks / 2) do_step(step);
      MPI_Barrier(MPI_COMM_WORLD);
      struct timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      run_block(SIDE_WORLD, NULL, MPI_COMM_WORLD, buf, n, (int)calls, &seq0);
      clock_gettime(CLOCK_MONOTONIC, &t1);
      t[r] = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / (double)calls;
    }
    MPI_Allreduce(t, tm, (int)pre_blocks, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (step) pre_med = quantile(tm, (int)(pre_blocks / 2), 0.5);
    pre2_med = step ? quantile(tm + pre_blocks / 2, (int)(pre_blocks - pre_blocks / 2), 0.5)
                    : quantile(tm, (int)pre_blocks, 0.5);
    free(t);
    free(tm);
  }
  ddp_process_group_options po = ddp_process_group_defaults();
  ddp_process_group *pg = NULL;
  if (ddp_process_group_from_mpi_comm(NULL, &po, &pg) != DDP_OK) {
    fprintf(stderr, "bench_mpi_allreduce: %s\n", ddp_last_error());
    return 1;
  }
  int rank = ddp_process_group_rank(pg), world = ddp_process_group_size(pg);
  MPI_Comm comm = ddp__mpi_backend_comm(pg->host_backend);
  if (comm == MPI_COMM_NULL) {
    fprintf(stderr, "bench_mpi_allreduce: the group's backend is not mpi\n");
    return 1;
  }
  pthread_t watcher;
  atomic_init(&g_emu.stop, false);
  pthread_create(&watcher, NULL, watch_main, NULL);
  uint64_t seq = 0;
  bool ok = true;
  for (int s = 0; s < nsides && ok; s++) ok = run_block(sides[s], pg, comm, buf, n, (int)warmup, &seq);
  for (int r = 0; r < rounds && ok; r++)
    for (int j = 0; j < nsides && ok; j++) {
      int s = sides[(j + r) % nsides];
      MPI_Barrier(MPI_COMM_WORLD);
      struct timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      ok = run_block(s, pg, comm, buf, n, (int)calls, &seq);
      clock_gettime(CLOCK_MONOTONIC, &t1);
      times[r * SIDE_KINDS + s] = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / (double)calls;
    }
  int all_ok = 0, mine = ok;
  MPI_Allreduce(&mine, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok) return 1;
  /* Every side once more on 1.0s: world ranks' sum. */
  int wrong = 0;
  for (int s = 0; s < nsides; s++) {
    for (int i = 0; i < n; i++) buf[i] = 1.0f;
    if (!run_block(sides[s], pg, comm, buf, n, 1, &seq)) return 1;
    for (int i = 0; i < n; i++)
      if (buf[i] != (float)world) {
        fprintf(stderr, "bench_mpi_allreduce: rank %d: %s gave %g at %d, not %d\n", rank, side_names[sides[s]],
                buf[i], i, world);
        wrong = 1;
        break;
      }
  }
  MPI_Reduce(times, slowest, (int)rounds * SIDE_KINDS, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("# bench_mpi_allreduce: world %d, %ld B float32 SUM in place, %ld rounds x %ld calls a side, "
           "buffer offset %ld; per call, the slower rank's, ns\n",
           world, bytes, rounds, calls, offset);
    printf("# %-11s %9s %9s %9s %12s %12s\n", "side", "median", "q1", "q3", "ratio_med", "paired_med");
    double *col = calloc((size_t)rounds, sizeof *col), *pair = calloc((size_t)rounds, sizeof *pair);
    int base = sides[0];
    for (int j = 0; j < nsides; j++) {
      int s = sides[j];
      for (int r = 0; r < rounds; r++) {
        col[r] = slowest[r * SIDE_KINDS + s];
        pair[r] = slowest[r * SIDE_KINDS + base] / slowest[r * SIDE_KINDS + s];
      }
      double q1 = quantile(col, (int)rounds, 0.25), med = quantile(col, (int)rounds, 0.5),
             q3 = quantile(col, (int)rounds, 0.75);
      double base_med = 0;
      for (int r = 0; r < rounds; r++) col[r] = slowest[r * SIDE_KINDS + base];
      base_med = quantile(col, (int)rounds, 0.5);
      printf("  %-11s %9.1f %9.1f %9.1f %12.3f %12.3f\n", side_names[s], med, q1, q3, base_med / med,
             quantile(pair, (int)rounds, 0.5));
    }
    if (pre_blocks > 0)
      printf("  %-11s %9.1f (world before ddp's group was made: the median of %ld blocks)\n", "world-pre",
             step ? pre_med : pre2_med, step ? pre_blocks / 2 : pre_blocks);
    if (pre_blocks > 0 && step)
      printf("  %-11s %9.1f (the same, %ld blocks after step %s)\n", "world-step", pre2_med,
             pre_blocks - pre_blocks / 2, step);
    printf("# ratio_med: %s's median over this side's; paired_med: the median of the rounds' %s/side "
           "ratios (above 1: this side is faster)\n", side_names[base], side_names[base]);
    free(col);
    free(pair);
  }
  atomic_store(&g_emu.stop, true);
  pthread_join(watcher, NULL);
  free(times);
  free(slowest);
  ddp_free(raw);
  ddp_process_group_destroy(pg);
  if (pre_blocks > 0) MPI_Finalize(); /* this program started MPI, not ddp */
  return wrong;
}
