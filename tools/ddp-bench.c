/* ddp-bench: times one collective over a sweep of sizes through the public
 * API, in the style of nccl-tests (its size and bus-bandwidth conventions),
 * with ranks it starts itself (--nproc, --threads) or as one rank of a
 * launched world (env://). For shared memory it also reports the memory
 * efficiency against the memcpy rate measured on the same machine. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/pattern.h" /* element access by dtype, the closed-form value pattern */
#include "cli/cli.h"
#include "ddp/ddp.h"
#include "io/io_internal.h"
#include "launch/launch_internal.h" /* placement: where the ranks run, as ddprun places workers */

static const char usage[] =
    "usage: ddp-bench OP [options]\n"
    "\n"
    "Times OP over a sweep of sizes and prints a table in the style of nccl-tests.\n"
    "OP: allreduce, broadcast, reduce, allgather, gather, scatter, reduce_scatter,\n"
    "    alltoall, barrier, sendrecv.\n"
    "\n"
    "Ranks:\n"
    "  --nproc N         start N ranks on this host as processes (this process\n"
    "                    hosts the store on 127.0.0.1, forks the ranks, reaps\n"
    "                    them and fails if any fails)\n"
    "  --threads N       N ranks as threads of this process (one in-process store)\n"
    "  (neither)         run as one rank of a launched world: ddp_init_process_group\n"
    "                    (\"env://\"), i.e. MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as\n"
    "                    torchrun sets them, or Slurm's / Open MPI's variables\n"
    "  --transport T     auto (default: shared memory on one host) or tcp\n"
    "  --backend B       ddp (default), mpi or nccl: the group's engine. mpi runs\n"
    "                    as one rank of a job mpirun or srun --mpi=pmix started\n"
    "                    (ranks from MPI): mpirun -np 2 ddp-bench --backend mpi\n"
    "  --timeout S       every operation's timeout, seconds (default 300)\n"
    "  --bind auto|core|socket|hwthread|none  where --nproc/--threads ranks run, as\n"
    "                    ddprun places workers: auto (default) gives each rank a\n"
    "                    core of its own when this process may use a CPU per rank,\n"
    "                    else leaves them to the scheduler with a note; core: the\n"
    "                    same, an error when CPUs are too few; none: never bind.\n"
    "                    Launched ranks are placed by their launcher; an explicit\n"
    "                    value binds this rank to LOCAL_RANK's share of its CPUs\n"
    "  --report-bindings print each rank's CPUs on stderr as it starts\n"
    "  --device D        cpu (default) or cuda: the buffers on the rank's GPU\n"
    "                    (cuda:(LOCAL_RANK %% GPUs)), launched ranks only (ddprun);\n"
    "                    the group on backend nccl when NCCL loads (its version\n"
    "                    printed), else ddp's own staged through pinned memory;\n"
    "                    --backend or DDP_BACKEND decides when set. The check copies through\n"
    "                    the host; memeff is not measured\n"
    "\n"
    "Sizes and operation (nccl-tests' flags):\n"
    "  -b, --minbytes B  smallest size (default 8); suffixes K, M, G (x1024)\n"
    "  -e, --maxbytes B  largest size (default 64M)\n"
    "  -f, --stepfactor F  multiply the size by F each row (default 2)\n"
    "  -i, --stepbytes B   add B to the size each row instead\n"
    "  -o, --op R        reduction: sum (default), prod, min, max, avg (avg: floating\n"
    "                    types only)\n"
    "  -d, --datatype T  float (default), half, bfloat16, double, int32, int64\n"
    "                    (also float32, float16, float64)\n"
    "  -r, --root R      root rank of broadcast, reduce, gather, scatter (default 0)\n"
    "  -n, --iters N     timed iterations per size (default 20)\n"
    "  -w, --warmup_iters N  untimed iterations first (default 5)\n"
    "  -c, --check 0|1   fill buffers with rank- and index-dependent values and check\n"
    "                    one more run against closed forms, counting wrong elements\n"
    "                    per row (default 1)\n"
    "  --json            one JSON object per row on stdout instead of the table\n"
    "  -h, --help        this text\n"
    "  --version         print \"ddp-bench (ddp) VERSION\"\n"
    "\n"
    "Columns (nccl-tests' conventions, PERFORMANCE.md):\n"
    "  size     bytes of one rank's buffer; for allgather, gather (recv) and\n"
    "           reduce_scatter, scatter, alltoall (send) the whole buffer of P blocks\n"
    "  count    elements passed to the call (per block where there are P blocks)\n"
    "  time     microseconds per operation: the average over the timed iterations\n"
    "           of the slowest rank\n"
    "  algbw    size / time, GB/s (1e9 bytes/s)\n"
    "  busbw    algbw x the op's factor: allreduce 2(P-1)/P; allgather,\n"
    "           reduce_scatter, gather, scatter, alltoall (P-1)/P; broadcast,\n"
    "           reduce, sendrecv 1 (sendrecv: each rank sends size bytes to the\n"
    "           next rank and receives as much from the previous one)\n"
    "  #wrong   elements that differ from the closed form, over all ranks (-c 1)\n"
    "  memeff   memory efficiency, shared memory only (\"-\" over tcp):\n"
    "           P x size / (time x R), R the aggregate memcpy rate of the P ranks\n"
    "           each copying `size` bytes at once, measured right after the row.\n"
    "           The copy is of the row's own size, so small rows compare against\n"
    "           cache-resident copies and large ones (>= 64M) against DRAM.\n"
    "           100%: the op costs what one read of each input byte and one write\n"
    "           of each output byte costs.\n"
    "\n"
    "--json rows: {\"op\", \"size\", \"count\", \"dtype\", \"time_us\", \"algbw\", \"busbw\",\n"
    "  \"redop\", \"root\", \"ranks\", \"transport\", \"memeff\" (percent or null),\n"
    "  \"wrong\" (null with -c 0)}.\n"
    "\n"
    "Exit status: 0 when every rank ran and nothing was wrong, 1 on a failure or a\n"
    "wrong result, 2 on bad usage.\n";

static void print_usage(FILE *f) { fputs(usage, f); }

typedef enum bench_op {
  OP_ALLREDUCE,
  OP_BROADCAST,
  OP_REDUCE,
  OP_ALLGATHER,
  OP_GATHER,
  OP_SCATTER,
  OP_REDUCE_SCATTER,
  OP_ALLTOALL,
  OP_BARRIER,
  OP_SENDRECV,
  OP_COUNT
} bench_op;

static const char *const op_names[OP_COUNT] = {
    "allreduce", "broadcast", "reduce",   "allgather", "gather",
    "scatter",   "reduce_scatter", "alltoall", "barrier",   "sendrecv"};

typedef struct bench_opts {
  bench_op op;
  ddp_reduce_op redop;
  ddp_dtype dtype;
  size_t min_bytes, max_bytes, step_bytes; /* step_bytes 0: multiply by step_factor */
  double step_factor;
  int root, iters, warmup, check, json;
  int nproc, threads;
  int bind;            /* ddp_launch_bind: where the ranks run (0: auto) */
  int report_bindings; /* each rank's CPUs on stderr */
  const char *transport; /* NULL: auto */
  const char *backend;   /* options.backend; NULL: auto (DDP_BACKEND, else ddp) */
  double timeout_s;
  int cuda;              /* --device cuda: buffers on the rank's GPU (launched ranks) */
} bench_opts;

static bench_opts g_opts;
/* Where the ranks run: decided once, before any rank starts (placement.c). */
static ddp__placement g_placement;

enum { BENCH_OK = 0, BENCH_WRONG = 1, BENCH_FAILED = 2, BENCH_USAGE = 3 };

/* ---- Values and closed forms ---------------------------------------------
 * Rank r contributes (r + 1) * (i % 7 + 1) to element i of a reduction
 * (PRODUCT: 2 where i % 3 == r % 3, else 1); blocks that are moved rather
 * than reduced carry code(from, to, i) < 97. Every value is a small integer
 * or half-integer, exact in every dtype at small world sizes; float16 and
 * bfloat16 round once per reduction step at large ones, hence a tolerance. */

static double code(int from, int to, size_t i) {
  return (double)(((size_t)from * 131 + (size_t)to * 17 + i) % 97);
}

/* Whether element i of buf holds `want` once rounded to the dtype (within
 * the rounding of `steps` reduction steps for float16 / bfloat16). */
static int elem_ok(const void *buf, ddp_dtype dt, size_t i, double want, int steps) {
  double got = ddp__elem_get(buf, dt, i);
  if (dt == DDP_INT32) want = (double)(int32_t)(int64_t)want; /* wraps as the op does */
  if (dt == DDP_FLOAT16 || dt == DDP_BFLOAT16 || dt == DDP_FLOAT32) {
    uint64_t tmp = 0;
    ddp__elem_set(&tmp, dt, 0, want); /* what `want` becomes in this dtype */
    want = ddp__elem_get(&tmp, dt, 0);
  }
  if (got == want) return 1;
  double eps = dt == DDP_FLOAT16 ? 0x1p-10 : dt == DDP_BFLOAT16 ? 0x1p-7 : 0;
  return isfinite(want) && fabs(got - want) <= fabs(want) * eps * steps;
}

/* ---- One rank ------------------------------------------------------------ */

typedef struct rank_bufs {
  void *send, *recv, *copy; /* each max_bytes (+ slack), 64-byte aligned */
} rank_bufs;

/* --device cuda: the operations' buffers on the GPU; fill and check work on
 * the host buffers and copy through (outside the timed iterations). */
typedef struct device_bufs {
  ddp_device device;
  ddp_tensor *send, *recv;
  rank_bufs on; /* send, recv: the device memory; copy unused */
} device_bufs;

/* Host -> device (to_device) or back, both buffers, waiting for the copies. */
static ddp_status device_sync_bufs(const device_bufs *d, const rank_bufs *host, size_t bytes,
                                   bool to_device) {
  ddp_device cpu = DDP_CPU;
  if (to_device) {
    DDP_TRY(ddp_device_copy_async(d->device, d->on.send, cpu, host->send, bytes));
    DDP_TRY(ddp_device_copy_async(d->device, d->on.recv, cpu, host->recv, bytes));
  } else {
    DDP_TRY(ddp_device_copy_async(cpu, host->send, d->device, d->on.send, bytes));
    DDP_TRY(ddp_device_copy_async(cpu, host->recv, d->device, d->on.recv, bytes));
  }
  return ddp_device_synchronize(d->device);
}

/* Element counts and the reported size for a row of `bytes` bytes. */
static void row_shape(const bench_opts *o, int P, size_t bytes, size_t *count, size_t *size) {
  size_t es = ddp_dtype_size(o->dtype);
  switch (o->op) {
    case OP_ALLGATHER:
    case OP_GATHER:
    case OP_SCATTER:
    case OP_REDUCE_SCATTER:
    case OP_ALLTOALL:
      *count = bytes / es / (size_t)P;
      *size = *count * es * (size_t)P;
      break;
    case OP_BARRIER: *count = 0, *size = 0; break;
    default: *count = bytes / es, *size = *count * es; break;
  }
}

static double busbw_factor(bench_op op, int P) {
  switch (op) {
    case OP_ALLREDUCE: return 2.0 * (P - 1) / P;
    case OP_ALLGATHER:
    case OP_GATHER:
    case OP_SCATTER:
    case OP_REDUCE_SCATTER:
    case OP_ALLTOALL: return (double)(P - 1) / P;
    case OP_BARRIER: return 0;
    default: return 1;
  }
}

/* Fills this rank's inputs (and poisons its outputs) for one run. */
static void fill(const bench_opts *o, const rank_bufs *b, int r, int P, size_t count) {
  ddp_dtype dt = o->dtype;
  int next = (r + 1) % P;
  switch (o->op) {
    case OP_ALLREDUCE:
    case OP_REDUCE:
      for (size_t i = 0; i < count; i++) ddp__elem_set(b->send, dt, i, ddp__pattern_contrib(r, i, o->redop));
      break;
    case OP_BROADCAST:
      for (size_t i = 0; i < count; i++)
        ddp__elem_set(b->send, dt, i, r == o->root ? code(o->root, 0, i) : -1.0);
      break;
    case OP_ALLGATHER:
    case OP_GATHER:
      for (size_t i = 0; i < count; i++) ddp__elem_set(b->send, dt, i, code(r, 0, i));
      for (size_t i = 0; i < count * (size_t)P; i++) ddp__elem_set(b->recv, dt, i, -1.0);
      break;
    case OP_REDUCE_SCATTER:
      for (size_t i = 0; i < count * (size_t)P; i++)
        ddp__elem_set(b->send, dt, i, ddp__pattern_contrib(r, i, o->redop));
      for (size_t i = 0; i < count; i++) ddp__elem_set(b->recv, dt, i, -1.0);
      break;
    case OP_SCATTER:
    case OP_ALLTOALL:
      for (int q = 0; q < P; q++)
        for (size_t i = 0; i < count; i++) ddp__elem_set(b->send, dt, (size_t)q * count + i, code(r, q, i));
      for (size_t i = 0; i < count * (size_t)P; i++) ddp__elem_set(b->recv, dt, i, -1.0);
      break;
    case OP_SENDRECV:
      for (size_t i = 0; i < count; i++) ddp__elem_set(b->send, dt, i, code(r, next, i));
      for (size_t i = 0; i < count; i++) ddp__elem_set(b->recv, dt, i, -1.0);
      break;
    default: break;
  }
}

/* Elements of this rank's outputs that differ from the closed form. */
static int64_t count_wrong(const bench_opts *o, const rank_bufs *b, int r, int P, size_t count) {
  ddp_dtype dt = o->dtype;
  int64_t wrong = 0;
  int prev = (r + P - 1) % P;
  int steps = P; /* enough for any algorithm's rounding, plus AVG's division */
  switch (o->op) {
    case OP_ALLREDUCE:
      for (size_t i = 0; i < count; i++)
        wrong += !elem_ok(b->send, dt, i, ddp__pattern_reduced(o->redop, P, i), steps);
      break;
    case OP_REDUCE:
      for (size_t i = 0; i < count; i++)
        wrong += !elem_ok(b->send, dt, i,
                          r == o->root ? ddp__pattern_reduced(o->redop, P, i) : ddp__pattern_contrib(r, i, o->redop), steps);
      break;
    case OP_BROADCAST:
      for (size_t i = 0; i < count; i++) wrong += !elem_ok(b->send, dt, i, code(o->root, 0, i), 0);
      break;
    case OP_ALLGATHER:
    case OP_GATHER:
      if (o->op == OP_GATHER && r != o->root) break;
      for (int q = 0; q < P; q++)
        for (size_t i = 0; i < count; i++)
          wrong += !elem_ok(b->recv, dt, (size_t)q * count + i, code(q, 0, i), 0);
      break;
    case OP_REDUCE_SCATTER:
      for (size_t i = 0; i < count; i++)
        wrong += !elem_ok(b->recv, dt, i, ddp__pattern_reduced(o->redop, P, (size_t)r * count + i), steps);
      break;
    case OP_SCATTER:
      for (size_t i = 0; i < count; i++) wrong += !elem_ok(b->recv, dt, i, code(o->root, r, i), 0);
      break;
    case OP_ALLTOALL:
      for (int q = 0; q < P; q++)
        for (size_t i = 0; i < count; i++)
          wrong += !elem_ok(b->recv, dt, (size_t)q * count + i, code(q, r, i), 0);
      break;
    case OP_SENDRECV:
      for (size_t i = 0; i < count; i++) wrong += !elem_ok(b->recv, dt, i, code(prev, r, i), 0);
      break;
    default: break;
  }
  return wrong;
}

/* One operation of the row. Point-to-point goes round the ring: even ranks
 * send first, odd ranks receive first, so no pair waits on each other. */
static ddp_status run_op(const bench_opts *o, ddp_process_group *pg, const rank_bufs *b,
                         size_t count) {
  ddp_dtype dt = o->dtype;
  switch (o->op) {
    case OP_ALLREDUCE: return ddp_allreduce(pg, b->send, count, dt, o->redop);
    case OP_BROADCAST: return ddp_broadcast(pg, b->send, count, dt, o->root);
    case OP_REDUCE: return ddp_reduce(pg, b->send, count, dt, o->redop, o->root);
    case OP_ALLGATHER: return ddp_allgather(pg, b->send, b->recv, count, dt);
    case OP_GATHER: return ddp_gather(pg, b->send, b->recv, count, dt, o->root);
    case OP_SCATTER: return ddp_scatter(pg, b->send, b->recv, count, dt, o->root);
    case OP_REDUCE_SCATTER: return ddp_reduce_scatter(pg, b->send, b->recv, count, dt, o->redop);
    case OP_ALLTOALL: return ddp_all_to_all(pg, b->send, b->recv, count, dt);
    case OP_BARRIER: return ddp_barrier(pg);
    case OP_SENDRECV: {
      /* Asked here, not per call: the timed loop of a collective holds
       * nothing but the call, as the references' loops do. */
      int r = ddp_process_group_rank(pg), P = ddp_process_group_size(pg);
      int next = (r + 1) % P, prev = (r + P - 1) % P;
      if (r % 2 == 0) {
        DDP_TRY(ddp_send(pg, b->send, count, dt, next, 0));
        return ddp_recv(pg, b->recv, count, dt, prev, 0);
      }
      DDP_TRY(ddp_recv(pg, b->recv, count, dt, prev, 0));
      return ddp_send(pg, b->send, count, dt, next, 0);
    }
    default: return DDP_ERR_INVALID;
  }
}

/* Seconds per memcpy of `bytes` while every rank copies at once: the
 * slowest rank's average over enough copies to last a few milliseconds. */
static ddp_status memcpy_time(ddp_process_group *pg, const rank_bufs *b, size_t bytes,
                              double *seconds) {
  size_t target = (size_t)256 << 20, reps = bytes ? target / bytes : 1;
  if (reps < 4) reps = 4;
  if (reps > 1000000) reps = 1000000;
  DDP_TRY(ddp_barrier(pg));
  double t0 = ddp_time_s();
  for (size_t k = 0; k < reps; k++) {
    memcpy(b->copy, b->send, bytes);
    __asm__ volatile("" : : "r"(b->copy) : "memory"); /* keep every copy */
  }
  double t = (ddp_time_s() - t0) / (double)reps;
  DDP_TRY(ddp_allreduce(pg, &t, 1, DDP_FLOAT64, DDP_REDUCE_MAX));
  *seconds = t;
  return DDP_OK;
}

/* The transport to every peer: "shm"/"threads" count as shared memory. */
static const char *group_transport(ddp_process_group *pg, int *shared) {
  int r = ddp_process_group_rank(pg), P = ddp_process_group_size(pg);
  const char *t = ddp_process_group_transport(pg, r);
  *shared = P > 1;
  for (int q = 0; q < P; q++) {
    if (q == r) continue;
    t = ddp_process_group_transport(pg, q);
    if (strcmp(t, "shm") != 0 && strcmp(t, "threads") != 0) *shared = 0;
  }
  return t;
}

static void print_header(const bench_opts *o, int P, const char *transport, int shared) {
  if (o->json) return;
  printf("# ddp-bench %s: %d ranks (%s%s, transport %s), %s, %s, root %d, %d iterations "
         "after %d warm-up, check %s\n",
         op_names[o->op], P, o->threads ? "threads" : o->nproc ? "processes" : "launched",
         g_placement.bound ? ", CPUs of their own" : "", transport, ddp_dtype_name(o->dtype), ddp_reduce_op_name(o->redop), o->root, o->iters,
         o->warmup, o->check ? "on" : "off");
  if (shared)
    printf("# memeff = P x size / (time x aggregate memcpy rate of P ranks copying size bytes at "
           "once)\n");
  printf("#%11s %12s %9s %7s %5s %11s %9s %9s %7s %7s\n", "size", "count", "type", "redop", "root",
         "time", "algbw", "busbw", "#wrong", "memeff");
  printf("#%11s %12s %9s %7s %5s %11s %9s %9s %7s %7s\n", "(B)", "(elements)", "", "", "", "(us)",
         "(GB/s)", "(GB/s)", "", "(%)");
}

static void print_row(const bench_opts *o, int P, const char *transport, size_t size,
                      size_t count, double us, double algbw, double busbw, int64_t wrong,
                      double memeff) {
  const char *dt = ddp_dtype_name(o->dtype), *redop = ddp_reduce_op_name(o->redop);
  if (o->json) {
    char wrong_s[32] = "null", memeff_s[32] = "null";
    if (o->check) snprintf(wrong_s, sizeof wrong_s, "%lld", (long long)wrong);
    if (memeff >= 0) snprintf(memeff_s, sizeof memeff_s, "%.2f", memeff);
    fputs("{\"op\":", stdout);
    ddp__json_fput_string(stdout, op_names[o->op]);
    printf(",\"size\":%zu,\"count\":%zu,\"dtype\":", size, count);
    ddp__json_fput_string(stdout, dt);
    printf(",\"time_us\":%.3f,\"algbw\":%.4f,\"busbw\":%.4f,\"redop\":", us, algbw, busbw);
    ddp__json_fput_string(stdout, redop);
    printf(",\"root\":%d,\"ranks\":%d,\"transport\":", o->root, P);
    ddp__json_fput_string(stdout, transport);
    printf(",\"memeff\":%s,\"wrong\":%s}\n", memeff_s, wrong_s);
  } else {
    char wrong_s[32] = "N/A", memeff_s[32] = "-";
    if (o->check) snprintf(wrong_s, sizeof wrong_s, "%lld", (long long)wrong);
    if (memeff >= 0) snprintf(memeff_s, sizeof memeff_s, "%.1f", memeff);
    printf(" %11zu %12zu %9s %7s %5d %11.2f %9.3f %9.3f %7s %7s\n", size, count, dt, redop,
           o->root, us, algbw, busbw, wrong_s, memeff_s);
  }
  fflush(stdout);
}

static size_t next_size(const bench_opts *o, size_t bytes) {
  size_t next = o->step_bytes ? bytes + o->step_bytes : (size_t)((double)bytes * o->step_factor);
  return next > bytes ? next : bytes + 1;
}

/* Runs the whole sweep on one rank of `pg`; rank 0 prints. Returns
 * BENCH_OK, BENCH_WRONG when a row had wrong elements (every rank sees the
 * total), BENCH_FAILED on an error (message on stderr) or BENCH_USAGE when
 * -r or the op does not fit the launched world. */
static int bench_rank(const bench_opts *o, ddp_process_group *pg) {
  int r = ddp_process_group_rank(pg), P = ddp_process_group_size(pg);
  int shared = 0, failed = 0;
  const char *transport = group_transport(pg, &shared);
  if (o->root >= P || (o->op == OP_SENDRECV && P < 2)) {
    if (r == 0)
      fprintf(stderr, "ddp-bench: %s in a world of %d ranks\n",
              o->root >= P ? "-r is not a rank" : "sendrecv needs at least 2 ranks", P);
    return BENCH_USAGE;
  }
  size_t slack = 64;
  rank_bufs b = {ddp_alloc(o->max_bytes + slack), ddp_alloc(o->max_bytes + slack),
                 ddp_alloc(o->max_bytes + slack)};
  device_bufs dev = {.device = DDP_CPU};
  const rank_bufs *ops_bufs = &b; /* what the operations read and write */
  /* The slowest rank's time and the wrong counts are host values: over the
   * group's host group where it is nccl (collective: every rank here). */
  ddp_process_group *hpg = pg;
  if (!ddp_process_group_takes_host(pg) && ddp_process_group_host_group(pg, &hpg) != DDP_OK) {
    fprintf(stderr, "ddp-bench: rank %d: %s\n", r, ddp_last_error());
    ddp_free(b.send);
    ddp_free(b.recv);
    ddp_free(b.copy);
    return BENCH_FAILED;
  }
  size_t bytes = o->min_bytes, count = 0, size = 0;
  const char *stage = "allocating buffers";
  ddp_status st = DDP_OK;
  if (!b.send || !b.recv || !b.copy) {
    fprintf(stderr, "ddp-bench: rank %d: out of memory for 3 x %zu bytes\n", r, o->max_bytes);
    failed = BENCH_FAILED;
    goto done;
  }
  memset(b.copy, 0, o->max_bytes);
  if (o->cuda) {
    int64_t local_rank = 0, local_world = 1;
    ddp_env_int("LOCAL_RANK", 0, &local_rank);
    ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_world);
    int64_t floats = (int64_t)((o->max_bytes + slack) / sizeof(float) + 1);
    stage = "allocating device buffers";
    st = ddp_default_cuda_device((int)local_rank, (int)local_world, &dev.device);
    if (st == DDP_OK) st = ddp_tensor_create_on(&dev.send, DDP_FLOAT32, 1, &floats, dev.device);
    if (st == DDP_OK) st = ddp_tensor_create_on(&dev.recv, DDP_FLOAT32, 1, &floats, dev.device);
    if (st != DDP_OK) {
      fprintf(stderr, "ddp-bench: rank %d: %s: %s\n", r, stage, ddp_last_error());
      failed = BENCH_FAILED;
      goto done;
    }
    dev.on = (rank_bufs){dev.send->data, dev.recv->data, NULL};
    ops_bufs = &dev.on;
    shared = 0; /* memeff compares with host memcpy: not for device buffers */
  }
  if (r == 0) print_header(o, P, transport, shared);
  double busbw_sum = 0;
  int rows = 0;
  for (;;) {
    row_shape(o, P, bytes, &count, &size);
    fill(o, &b, r, P, count);
    stage = "copying to the device";
    if (o->cuda) st = device_sync_bufs(&dev, &b, o->max_bytes, true);
    stage = "warm-up";
    for (int k = 0; k < o->warmup && st == DDP_OK; k++) st = run_op(o, pg, ops_bufs, count);
    stage = "timed iterations";
    if (st == DDP_OK) st = ddp_barrier(pg);
    double t0 = ddp_time_s();
    for (int k = 0; k < o->iters && st == DDP_OK; k++) st = run_op(o, pg, ops_bufs, count);
    /* Blocking calls: on a GPU each has completed (host wait) on return. */
    double t = (ddp_time_s() - t0) / o->iters;
    /* The collective's time is its slowest rank's. */
    if (st == DDP_OK) st = ddp_allreduce(hpg, &t, 1, DDP_FLOAT64, DDP_REDUCE_MAX);
    int64_t wrong = 0;
    if (o->check && st == DDP_OK) {
      stage = "checked run";
      fill(o, &b, r, P, count);
      if (o->cuda) st = device_sync_bufs(&dev, &b, o->max_bytes, true);
      if (st == DDP_OK) st = run_op(o, pg, ops_bufs, count);
      if (st == DDP_OK && o->cuda) st = device_sync_bufs(&dev, &b, o->max_bytes, false);
      wrong = st == DDP_OK ? count_wrong(o, &b, r, P, count) : 0;
      if (st == DDP_OK) st = ddp_allreduce(hpg, &wrong, 1, DDP_INT64, DDP_REDUCE_SUM);
    }
    double copy_s = 0, memeff = -1;
    if (shared && st == DDP_OK) {
      stage = "memcpy rate";
      st = memcpy_time(pg, &b, size, &copy_s);
      /* P*size / (t * P*size/copy_s) */
      if (st == DDP_OK && t > 0) memeff = 100.0 * copy_s / t;
    }
    if (st != DDP_OK) {
      fprintf(stderr, "ddp-bench: rank %d: %s %zu bytes (%s): %s\n", r, op_names[o->op], size,
              stage, ddp_last_error());
      failed = BENCH_FAILED;
      goto done;
    }
    double algbw = t > 0 ? (double)size / t * 1e-9 : 0, busbw = algbw * busbw_factor(o->op, P);
    if (r == 0) print_row(o, P, transport, size, count, t * 1e6, algbw, busbw, wrong, memeff);
    if (wrong) failed = BENCH_WRONG;
    busbw_sum += busbw;
    rows++;
    if (o->op == OP_BARRIER || bytes >= o->max_bytes) break;
    bytes = next_size(o, bytes);
    if (bytes > o->max_bytes) bytes = o->max_bytes;
  }
  if (r == 0 && !o->json)
    printf("# Avg bus bandwidth    : %.4f GB/s over %d rows%s\n", busbw_sum / rows, rows,
           failed ? "; WRONG RESULTS" : "");
done:
  ddp_tensor_destroy(dev.send);
  ddp_tensor_destroy(dev.recv);
  ddp_free(b.send);
  ddp_free(b.recv);
  ddp_free(b.copy);
  return failed;
}

static ddp_process_group_options group_options(const bench_opts *o) {
  ddp_process_group_options po = {.timeout_s = o->timeout_s, .transport = o->transport, .backend = o->backend};
  return po;
}

/* Binds the calling thread (a rank's thread, or a rank's process before it
 * starts threads) to rank r's CPUs of the plan. A failure is reported and
 * the rank runs unbound. */
static void bind_rank(int r) {
  int err = ddp__placement_apply(&g_placement, r);
  if (err) fprintf(stderr, "ddp-bench: rank %d: cannot bind to its CPUs: %s\n", r, strerror(err));
}

static void report_binding(int r, long pid) {
  if (!g_opts.report_bindings) return;
  char where[512];
  ddp__placement_describe(&g_placement, r, where, sizeof where);
  fprintf(stderr, "ddp-bench: rank %d (%s %ld) %s\n", r, pid ? "pid" : "thread", pid ? pid : (long)r, where);
}

/* --nproc and --threads: one plan for the n ranks (1 thread each), or exit 2
 * when --bind asks for what these CPUs cannot give. */
static void place_ranks(int n) {
  extern char **environ;
  if (ddp__placement_decide((ddp_launch_bind)g_opts.bind, n, 1, environ, &g_placement) != DDP_OK) {
    fprintf(stderr, "ddp-bench: %s\n", ddp_last_error());
    exit(2);
  }
  ddp__placement_note(&g_placement, "ddp-bench", stderr);
}

/* ---- --threads N: ranks as threads of this process ----------------------- */

typedef struct thread_rank {
  ddp_store *store;
  int rank, size, result;
} thread_rank;

static void *thread_main(void *arg) {
  thread_rank *t = arg;
  ddp_process_group *pg = NULL;
  bind_rank(t->rank);
  ddp_process_group_options po = group_options(&g_opts);
  if (ddp_process_group_create(t->store, t->rank, t->size, &po, &pg) != DDP_OK) {
    fprintf(stderr, "ddp-bench: rank %d: %s\n", t->rank, ddp_last_error());
    t->result = 1;
    return NULL;
  }
  t->result = bench_rank(&g_opts, pg);
  /* A rank that failed aborts, so the others fail instead of waiting. */
  if (t->result == BENCH_FAILED) ddp_process_group_abort(pg);
  ddp_process_group_destroy(pg);
  return NULL;
}

static int run_threads(int n) {
  ddp_store *store = NULL;
  if (ddp_store_mem_create(NULL, &store) != DDP_OK) {
    fprintf(stderr, "ddp-bench: %s\n", ddp_last_error());
    return 1;
  }
  thread_rank *ranks = calloc((size_t)n, sizeof *ranks);
  pthread_t *threads = calloc((size_t)n, sizeof *threads);
  int failed = !ranks || !threads, started = 0;
  for (int r = 0; r < n && !failed; r++, started++) {
    ranks[r] = (thread_rank){.store = store, .rank = r, .size = n};
    report_binding(r, 0);
    if (pthread_create(&threads[r], NULL, thread_main, &ranks[r]) != 0) failed = 1;
  }
  for (int r = 0; r < started; r++) {
    pthread_join(threads[r], NULL);
    failed |= ranks[r].result != BENCH_OK;
  }
  free(ranks);
  free(threads);
  ddp_store_destroy(store);
  return failed;
}

/* ---- --nproc N: ranks as processes of this host -------------------------- */

static int proc_rank(int rank, int n, uint16_t port) {
  ddp_store *store = NULL;
  ddp_process_group *pg = NULL;
  ddp_store_options so = {.timeout_ms = (int64_t)(g_opts.timeout_s * 1000)};
  ddp_process_group_options po = group_options(&g_opts);
  ddp_log_set_rank(rank);
  bind_rank(rank);
  if (ddp_store_tcp_connect("127.0.0.1", port, &so, &store) != DDP_OK ||
      ddp_process_group_create(store, rank, n, &po, &pg) != DDP_OK) {
    fprintf(stderr, "ddp-bench: rank %d: %s\n", rank, ddp_last_error());
    ddp_store_destroy(store);
    return 1;
  }
  int result = bench_rank(&g_opts, pg);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  return result != BENCH_OK;
}

static void *server_main(void *arg) {
  ddp_store_server_run(arg);
  return NULL;
}

static const char *describe_exit(int status, char *buf, size_t bytes) {
  if (WIFSIGNALED(status)) snprintf(buf, bytes, "killed by signal %d", WTERMSIG(status));
  else snprintf(buf, bytes, "exited with status %d", WEXITSTATUS(status));
  return buf;
}

/* The store is bound before forking and served on a thread only after, so
 * the ranks fork from a process with one thread. The parent reaps them: when
 * one fails the others get 15 s (peer failures surface within 5 s) before
 * they are killed; every rank is killed past the whole run's limit. */
static int run_procs(int n) {
  ddp_store_server *server = NULL;
  if (ddp_store_server_create("127.0.0.1", 0, NULL, &server) != DDP_OK) {
    fprintf(stderr, "ddp-bench: store: %s\n", ddp_last_error());
    return 1;
  }
  uint16_t port = ddp_store_server_port(server);
  pid_t *pids = calloc((size_t)n, sizeof *pids);
  if (!pids) {
    ddp_store_server_stop(server);
    return 1;
  }
  fflush(stdout);
  fflush(stderr);
  int failed = 0, alive = 0;
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = proc_rank(r, n, port);
      fflush(stdout);
      _exit(rc);
    }
    if (pids[r] < 0) {
      fprintf(stderr, "ddp-bench: fork: %s\n", strerror(errno));
      failed = 1;
      break;
    }
    report_binding(r, (long)pids[r]);
    alive++;
  }
  pthread_t thread;
  int serving = pthread_create(&thread, NULL, server_main, server) == 0;
  if (!serving) {
    fprintf(stderr, "ddp-bench: cannot start the store thread\n");
    failed = 1;
  }
  if (failed)
    for (int r = 0; r < n; r++)
      if (pids[r] > 0) kill(pids[r], SIGKILL);
  /* A generous bound on the whole run: every op's timeout may be used by a
   * stuck row, but a healthy sweep ends long before. */
  double deadline = ddp_time_s() + g_opts.timeout_s * 4 + 60, grace_end = 0;
  while (alive > 0) {
    int status;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < n; r++) {
        if (pids[r] != pid) continue;
        pids[r] = 0;
        alive--;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          char why[64];
          fprintf(stderr, "ddp-bench: rank %d (pid %d) %s\n", r, (int)pid,
                  describe_exit(status, why, sizeof why));
          if (!failed) grace_end = ddp_time_s() + 15;
          failed = 1;
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    double now = ddp_time_s();
    if (now > deadline || (grace_end > 0 && now > grace_end)) {
      for (int r = 0; r < n; r++) {
        if (pids[r] <= 0) continue;
        fprintf(stderr, "ddp-bench: rank %d (pid %d) still running %s; killing it\n", r,
                (int)pids[r], now > deadline ? "past the run's time limit" : "after a rank failed");
        kill(pids[r], SIGKILL);
      }
      failed = 1;
      deadline = grace_end = now + 3600; /* reaped on the next rounds */
    }
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
  }
  if (serving) {
    ddp_store_server_shutdown(server);
    pthread_join(thread, NULL);
  }
  ddp_store_server_stop(server);
  free(pids);
  return failed;
}

/* ---- Launched: one rank of an env:// world ------------------------------- */

static int run_launched(void) {
  ddp_process_group *pg = NULL;
  ddp_process_group_options po = group_options(&g_opts);
  if (g_opts.bind != DDP_LAUNCH_BIND_AUTO) {
    /* Its launcher placed it (ddprun binds by default): an explicit --bind
     * takes LOCAL_RANK's share of the CPUs this rank may use, and says so
     * when they are too few to share (a rank its launcher bound already). */
    extern char **environ;
    int64_t local_rank = 0, local_size = 1;
    if (ddp_env_int("LOCAL_RANK", -1, &local_rank) != DDP_OK || local_rank < 0) ddp_env_int("RANK", 0, &local_rank);
    if (ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_size) != DDP_OK || local_size <= local_rank)
      local_size = local_rank + 1;
    if (ddp__placement_decide((ddp_launch_bind)g_opts.bind, (int32_t)local_size, 1, environ, &g_placement) != DDP_OK)
      fprintf(stderr, "ddp-bench: rank %d: %s; it stays where its launcher put it\n", (int)local_rank,
              ddp_last_error());
    bind_rank((int)local_rank);
    report_binding((int)local_rank, (long)getpid());
  }
  if (g_opts.cuda && !po.backend && !(getenv("DDP_BACKEND") && *getenv("DDP_BACKEND"))) {
    /* As torch's nccl-tests runs: NCCL when it loads, its version said. */
    char version[128];
    int64_t rank = 0;
    ddp_env_int("RANK", 0, &rank);
    if (ddp_nccl_version(version, sizeof version) == DDP_OK) {
      po.backend = "nccl";
      if (rank == 0) fprintf(g_opts.json ? stderr : stdout, "# NCCL %s\n", version);
    } else if (rank == 0) {
      fprintf(stderr, "ddp-bench: --device cuda: NCCL is not available (%s); ddp's own backend "
                      "stages the GPU buffers through pinned host memory\n", ddp_last_error());
    }
  }
  if (ddp_init_process_group("env://", NULL, &po, &pg) != DDP_OK) {
    fprintf(stderr, "ddp-bench: %s\n", ddp_last_error());
    return 1;
  }
  int result = bench_rank(&g_opts, pg);
  /* Rank 0 may host the store: the others finish first. */
  if (result != BENCH_FAILED) ddp_barrier(pg);
  ddp_process_group_destroy(pg);
  return result == BENCH_OK ? 0 : result == BENCH_USAGE ? 2 : 1;
}

/* ---- Arguments ----------------------------------------------------------- */

static size_t parse_bytes(const char *flag, const char *s) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  double unit = 1;
  if (*end == 'K' || *end == 'k') unit = 1024.0, end++;
  else if (*end == 'M' || *end == 'm') unit = 1024.0 * 1024, end++;
  else if (*end == 'G' || *end == 'g') unit = 1024.0 * 1024 * 1024, end++;
  if (errno || end == s || *end || !(v >= 0) || v * unit > 64.0 * (1ull << 30))
    cli_die_usage("bad size \"%s\" (bytes, with an optional K, M or G; at most 64G)", s);
  (void)flag;
  return (size_t)(v * unit);
}

static int lookup(const char *s, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (names[i] && strcmp(s, names[i]) == 0) return i;
  return -1;
}

static void parse_args(int argc, char **argv, bench_opts *o) {
  *o = (bench_opts){.op = OP_COUNT, .redop = DDP_REDUCE_SUM, .dtype = DDP_FLOAT32,
                    .min_bytes = 8, .max_bytes = (size_t)64 << 20, .step_factor = 2,
                    .iters = 20, .warmup = 5, .check = 1, .timeout_s = 300};
  static const char *const redops[] = {"sum", "avg", "min", "max", "prod"};
  static const ddp_reduce_op redop_values[] = {DDP_REDUCE_SUM, DDP_REDUCE_AVG, DDP_REDUCE_MIN,
                                               DDP_REDUCE_MAX, DDP_REDUCE_PRODUCT};
  static const char *const dtypes[] = {"float", "half",    "bfloat16", "double",  "int32",
                                       "int64", "float32", "float16",  "float64"};
  static const ddp_dtype dtype_values[] = {DDP_FLOAT32, DDP_FLOAT16, DDP_BFLOAT16, DDP_FLOAT64,
                                           DDP_INT32,   DDP_INT64,   DDP_FLOAT32,  DDP_FLOAT16,
                                           DDP_FLOAT64};
  int have_factor = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    cli_help_or_version(a, print_usage);
    if (!strcmp(a, "--json")) {
      o->json = 1;
      continue;
    }
    if (!strcmp(a, "--report-bindings")) {
      o->report_bindings = 1;
      continue;
    }
    if (a[0] != '-') {
      if (o->op != OP_COUNT) cli_die_usage("more than one OP (\"%s\")", a);
      int op = lookup(a, op_names, OP_COUNT);
      if (op < 0) cli_die_usage("unknown OP \"%s\"", a);
      o->op = (bench_op)op;
      continue;
    }
    const char *v = i + 1 < argc ? argv[++i] : NULL;
    if (!v) cli_die_usage("%s needs a value", a);
    if (!strcmp(a, "-b") || !strcmp(a, "--minbytes")) o->min_bytes = parse_bytes(a, v);
    else if (!strcmp(a, "-e") || !strcmp(a, "--maxbytes")) o->max_bytes = parse_bytes(a, v);
    else if (!strcmp(a, "-i") || !strcmp(a, "--stepbytes")) o->step_bytes = parse_bytes(a, v);
    else if (!strcmp(a, "-f") || !strcmp(a, "--stepfactor")) {
      char *end;
      errno = 0;
      o->step_factor = strtod(v, &end);
      if (errno || end == v || *end || !(o->step_factor > 1) || o->step_factor > 1e6)
        cli_die_usage("bad -f \"%s\" (a factor above 1)", v);
      have_factor = 1;
    } else if (!strcmp(a, "-o") || !strcmp(a, "--op")) {
      int k = lookup(v, redops, 5);
      if (k < 0) cli_die_usage("unknown reduction \"%s\" (sum, prod, min, max, avg)", v);
      o->redop = redop_values[k];
    } else if (!strcmp(a, "-d") || !strcmp(a, "--datatype")) {
      int k = lookup(v, dtypes, 9);
      if (k < 0)
        cli_die_usage("unknown datatype \"%s\" (float, half, bfloat16, double, int32, int64)", v);
      o->dtype = dtype_values[k];
    } else if (!strcmp(a, "-r") || !strcmp(a, "--root")) o->root = (int)cli_parse_int(a, v, 0, 1 << 20);
    else if (!strcmp(a, "-n") || !strcmp(a, "--iters")) o->iters = (int)cli_parse_int(a, v, 1, 1 << 30);
    else if (!strcmp(a, "-w") || !strcmp(a, "--warmup_iters"))
      o->warmup = (int)cli_parse_int(a, v, 0, 1 << 30);
    else if (!strcmp(a, "-c") || !strcmp(a, "--check")) o->check = (int)cli_parse_int(a, v, 0, 1);
    else if (!strcmp(a, "--nproc")) o->nproc = (int)cli_parse_int(a, v, 1, 1024);
    else if (!strcmp(a, "--threads")) o->threads = (int)cli_parse_int(a, v, 1, 1024);
    else if (!strcmp(a, "--transport")) {
      if (!strcmp(v, "tcp")) o->transport = "tcp";
      else if (strcmp(v, "auto") != 0) cli_die_usage("unknown transport \"%s\" (auto or tcp)", v);
    } else if (!strcmp(a, "--backend")) {
      o->backend = cli_parse_backend(a, v);
    } else if (!strcmp(a, "--bind") || !strcmp(a, "--bind-to")) {
      ddp_launch_bind mode;
      if (ddp__bind_parse(a, v, &mode) != DDP_OK) cli_die_usage("%s", ddp_last_error());
      o->bind = (int)mode;
    } else if (!strcmp(a, "--device")) {
      if (!strcmp(v, "cuda")) o->cuda = 1;
      else if (strcmp(v, "cpu") != 0) cli_die_usage("unknown device \"%s\" (cpu or cuda)", v);
    } else if (!strcmp(a, "--timeout")) {
      char *end;
      errno = 0;
      o->timeout_s = strtod(v, &end);
      if (errno || end == v || *end || !(o->timeout_s > 0) || o->timeout_s > 1e6)
        cli_die_usage("bad --timeout \"%s\" (seconds above 0)", v);
    } else {
      cli_die_usage("unknown option %s", a);
    }
  }
  if (o->op == OP_COUNT) cli_die_usage("%s", "no OP given");
  if (o->nproc && o->threads) cli_die_usage("%s", "--nproc and --threads exclude each other");
  if (o->backend && !strcmp(o->backend, "mpi") && (o->nproc || o->threads))
    cli_die_usage("%s", "--backend mpi takes its ranks from MPI: start them with mpirun -np N (or srun "
                  "--mpi=pmix), not --nproc / --threads");
  if (o->cuda && (o->nproc || o->threads))
    cli_die_usage("%s", "--device cuda runs as launched ranks (ddprun --nproc-per-node N ddp-bench ...): "
                        "a CUDA context does not survive --nproc's fork, and --threads ranks would share one GPU");
  if (o->step_bytes && have_factor) cli_die_usage("%s", "-i and -f exclude each other");
  if (o->min_bytes > o->max_bytes) cli_die_usage("%s", "-b is larger than -e");
  if (o->redop == DDP_REDUCE_AVG && (o->dtype == DDP_INT32 || o->dtype == DDP_INT64))
    cli_die_usage("-o avg is for floating types, not %s", ddp_dtype_name(o->dtype));
  int n = o->nproc ? o->nproc : o->threads;
  if (n && o->root >= n) cli_die_usage("%s", "-r is not a rank of the world");
  if (n == 1 && o->op == OP_SENDRECV) cli_die_usage("%s", "sendrecv needs at least 2 ranks");
}

int main(int argc, char **argv) {
  cli_init("ddp-bench");
  parse_args(argc, argv, &g_opts);
  if (g_opts.threads || g_opts.nproc) place_ranks(g_opts.threads ? g_opts.threads : g_opts.nproc);
  if (g_opts.threads) return run_threads(g_opts.threads);
  if (g_opts.nproc) return run_procs(g_opts.nproc);
  return run_launched();
}
