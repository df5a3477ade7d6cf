/* ddp_batch_isend_irecv and the point-to-point lane, through the public API,
 * on the local backend between threads ("threads") and processes ("shm")
 * and on the tcp backend (processes on loopback), at 2 and 4 ranks: the
 * exchange patterns of every pipeline schedule never deadlock and deliver
 * the right bytes at every size around the eager limit and up to 16 MiB.
 * Every element is checked against a closed form of (src, dst, tag,
 * micro-batch, index), and the element past each receive buffer must stay
 * untouched. Patterns:
 *   (a) neighbours both ways in one batch (1F1B's steady state), ops in
 *       opposite orders on adjacent ranks;
 *   (b) a ring (interleaved 1F1B's last stage sends to the first), both
 *       directions, plus a send to and receive from the rank itself;
 *   (c) M batches per direction posted back to back before any wait
 *       (GPipe), one tag: matched in order;
 *   (d) a batch and a collective on the same group: even ranks post the
 *       batch then run a blocking allreduce, odd ranks the allreduce first
 *       (a FIFO of both would deadlock above the eager size);
 *   (e) a batch whose peer uses plain blocking send/recv or isend/irecv.
 * Then: the steady state allocates nothing (ddp_alloc_count, per process),
 * a group of one (self backend) exchanges with itself, argument errors, and
 * a peer process that exits makes the waiting rank fail within 5 s with an
 * error naming the operation, the peer and the tag.
 *
 * Message sizes are in bytes of float16 elements (the API has no 1-byte
 * type): 0, 2, 4094, 4096, 4098 (the local backend's inline limit is 4096),
 * 64 KiB, 1 MiB, 16 MiB. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "comm/local_proc_util.h"
#include "ddp/ddp.h"

static const size_t SIZES[] = {0, 2, 4094, 4096, 4098, 64 << 10, 1 << 20, 16 << 20};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])
#define MAX_BYTES ((size_t)16 << 20)
#define M_BATCHES 4
#define GUARD 0xBEEFu

typedef struct rank_ctx {
  ddp_process_group *pg;
  int rank, size;
  uint16_t *send[2 * M_BATCHES], *recv[2 * M_BATCHES]; /* MAX_BYTES + a guard element each */
  char err[1024];
} rank_ctx;

static int failf(rank_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int failf(rank_ctx *c, const char *fmt, ...) {
  int n = snprintf(c->err, sizeof c->err, "rank %d of %d: ", c->rank, c->size);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err + n, sizeof c->err - (size_t)n, fmt, ap);
  va_end(ap);
  return -1;
}

#define TRY(c, expr)                                                                       \
  do {                                                                                     \
    ddp_status t__ = (expr);                                                               \
    if (t__ != DDP_OK) return failf(c, "%s -> %s: %s", #expr, ddp_status_name(t__), ddp_last_error()); \
  } while (0)

/* The closed form: element i of the message src sends dst with `tag` in
 * micro-batch m is a + k i (mod 2^16), with a and an odd k hashed from
 * (src, dst, tag, m): every element depends on its index, and two messages
 * differ in nearly every element, so a message delivered to the wrong
 * receive, shifted, or cut short fails the check. Cheap enough per element
 * for the sanitizer builds to check 16 MiB messages in full. */
static void code_params(int src, int dst, int tag, int m, uint16_t *a, uint16_t *k) {
  uint32_t h = (uint32_t)src * 0x9E3779B1u ^ (uint32_t)dst * 0x85EBCA77u ^ (uint32_t)tag * 0xC2B2AE3Du ^
               (uint32_t)m * 0x27D4EB2Fu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 13;
  *a = (uint16_t)h;
  *k = (uint16_t)((h >> 16) | 1u);
}

static void fill_send(uint16_t *b, size_t n, int src, int dst, int tag, int m) {
  uint16_t a, k;
  code_params(src, dst, tag, m, &a, &k);
  for (size_t i = 0; i < n; i++) b[i] = (uint16_t)(a + k * (uint16_t)i);
}

static void prep_recv(uint16_t *b, size_t n) {
  memset(b, 0xAA, 2 * n); /* FILL */
  b[n] = GUARD;
}

static int check_recv(rank_ctx *c, const char *what, const uint16_t *b, size_t n, int src,
                      int tag, int m) {
  uint16_t a, k;
  code_params(src, c->rank, tag, m, &a, &k);
  for (size_t i = 0; i < n; i++) {
    uint16_t want = (uint16_t)(a + k * (uint16_t)i);
    if (b[i] != want)
      return failf(c, "%s: %zu bytes from rank %d (tag %d, micro-batch %d): element %zu is %#x, "
                   "expected %#x", what, 2 * n, src, tag, m, i, b[i], want);
  }
  if (b[n] != GUARD) return failf(c, "%s: the element past %zu bytes from rank %d was written", what, 2 * n, src);
  return 0;
}

static ddp_p2p_op op_send(const uint16_t *b, size_t n, int peer, int tag) {
  return (ddp_p2p_op){DDP_P2P_SEND, (void *)b, n, DDP_FLOAT16, peer, tag};
}
static ddp_p2p_op op_recv(uint16_t *b, size_t n, int peer, int tag) {
  return (ddp_p2p_op){DDP_P2P_RECV, b, n, DDP_FLOAT16, peer, tag};
}

static void reverse(ddp_p2p_op *ops, int n) {
  for (int i = 0; i < n / 2; i++) {
    ddp_p2p_op t = ops[i];
    ops[i] = ops[n - 1 - i];
    ops[n - 1 - i] = t;
  }
}

static int run_batch(rank_ctx *c, ddp_p2p_op *ops, int n) {
  ddp_work *w = NULL;
  TRY(c, ddp_batch_isend_irecv(c->pg, ops, (size_t)n, &w));
  ddp_status st = ddp_work_wait(w, -1);
  ddp_work_free(w);
  TRY(c, st);
  return 0;
}

/* ---- The patterns ------------------------------------------------------------ */

/* (a) Stage s sends activations to s + 1 (tag 1) and receives gradients
 * from it (tag 2) in one batch; s + 1 the converse. */
static int pat_neighbours(rank_ctx *c, size_t n, int iter) {
  int s = c->rank, P = c->size, k = 0;
  ddp_p2p_op ops[4];
  if (s + 1 < P) {
    fill_send(c->send[0], n, s, s + 1, 1, iter);
    prep_recv(c->recv[0], n);
    ops[k++] = op_send(c->send[0], n, s + 1, 1);
    ops[k++] = op_recv(c->recv[0], n, s + 1, 2);
  }
  if (s > 0) {
    fill_send(c->send[1], n, s, s - 1, 2, iter);
    prep_recv(c->recv[1], n);
    ops[k++] = op_recv(c->recv[1], n, s - 1, 1);
    ops[k++] = op_send(c->send[1], n, s - 1, 2);
  }
  if ((s + iter) % 2) reverse(ops, k);
  if (run_batch(c, ops, k)) return -1;
  if (s + 1 < P && check_recv(c, "(a) gradients", c->recv[0], n, s + 1, 2, iter)) return -1;
  if (s > 0 && check_recv(c, "(a) activations", c->recv[1], n, s - 1, 1, iter)) return -1;
  return 0;
}

/* (b) A ring, both directions (tags 3 and 4), and the rank itself (tag 9). */
static int pat_ring(rank_ctx *c, size_t n, int iter) {
  int s = c->rank, P = c->size;
  int next = (s + 1) % P, prev = (s + P - 1) % P;
  fill_send(c->send[0], n, s, next, 3, iter);
  fill_send(c->send[1], n, s, prev, 4, iter);
  fill_send(c->send[2], n, s, s, 9, iter);
  for (int i = 0; i < 3; i++) prep_recv(c->recv[i], n);
  ddp_p2p_op ops[6] = {
      op_send(c->send[0], n, next, 3), op_recv(c->recv[0], n, prev, 3),
      op_recv(c->recv[2], n, s, 9),    op_send(c->send[1], n, prev, 4),
      op_recv(c->recv[1], n, next, 4), op_send(c->send[2], n, s, 9),
  };
  if (s % 2) reverse(ops, 6);
  if (run_batch(c, ops, 6)) return -1;
  if (check_recv(c, "(b) ring forward", c->recv[0], n, prev, 3, iter)) return -1;
  if (check_recv(c, "(b) ring backward", c->recv[1], n, next, 4, iter)) return -1;
  return check_recv(c, "(b) self", c->recv[2], n, s, 9, iter);
}

/* (c) M forward batches (to s + 1, tag 5) and M backward ones (to s - 1,
 * tag 6) posted before any wait; the receives likewise. One tag per
 * direction: micro-batch m must land in receive m. */
static int pat_gpipe(rank_ctx *c, size_t n, int iter) {
  int s = c->rank, P = c->size;
  ddp_work *w[4 * M_BATCHES];
  int nw = 0;
  for (int m = 0; m < M_BATCHES; m++) {
    int mb = iter * M_BATCHES + m;
    ddp_p2p_op ops[4];
    int k = 0;
    if (s + 1 < P) {
      fill_send(c->send[m], n, s, s + 1, 5, mb);
      prep_recv(c->recv[m], n);
      ops[k++] = op_send(c->send[m], n, s + 1, 5);
      ops[k++] = op_recv(c->recv[m], n, s + 1, 6);
    }
    if (s > 0) {
      fill_send(c->send[M_BATCHES + m], n, s, s - 1, 6, mb);
      prep_recv(c->recv[M_BATCHES + m], n);
      ops[k++] = op_recv(c->recv[M_BATCHES + m], n, s - 1, 5);
      ops[k++] = op_send(c->send[M_BATCHES + m], n, s - 1, 6);
    }
    /* Half the batches one op each: several handles per micro-batch. */
    if (m % 2) {
      for (int i = 0; i < k; i++) TRY(c, ddp_batch_isend_irecv(c->pg, &ops[i], 1, &w[nw++]));
    } else {
      TRY(c, ddp_batch_isend_irecv(c->pg, ops, (size_t)k, &w[nw++]));
    }
  }
  ddp_status first = DDP_OK;
  for (int i = 0; i < nw; i++) {
    ddp_status st = ddp_work_wait(w[i], -1);
    if (st != DDP_OK && first == DDP_OK) first = st;
    ddp_work_free(w[i]);
  }
  TRY(c, first);
  for (int m = 0; m < M_BATCHES; m++) {
    int mb = iter * M_BATCHES + m;
    if (s + 1 < P && check_recv(c, "(c) gradients", c->recv[m], n, s + 1, 6, mb)) return -1;
    if (s > 0 && check_recv(c, "(c) activations", c->recv[M_BATCHES + m], n, s - 1, 5, mb)) return -1;
  }
  return 0;
}

/* (d) A batch with partners 2k <-> 2k + 1, and a blocking allreduce on the
 * same group: even ranks post the batch first, odd ranks the allreduce. */
static int pat_collective(rank_ctx *c, size_t n, int iter) {
  int s = c->rank, partner = s ^ 1;
  if (partner >= c->size) return 0;
  fill_send(c->send[0], n, s, partner, 7, iter);
  prep_recv(c->recv[0], n);
  ddp_p2p_op ops[2] = {op_send(c->send[0], n, partner, 7), op_recv(c->recv[0], n, partner, 7)};
  int32_t x[4] = {s + 1, s + 1, s + 1, iter};
  ddp_work *w = NULL;
  if (s % 2 == 0) TRY(c, ddp_batch_isend_irecv(c->pg, ops, 2, &w));
  TRY(c, ddp_allreduce(c->pg, x, 4, DDP_INT32, DDP_REDUCE_SUM));
  if (s % 2 == 1) TRY(c, ddp_batch_isend_irecv(c->pg, ops, 2, &w));
  ddp_status st = ddp_work_wait(w, -1);
  ddp_work_free(w);
  TRY(c, st);
  int P = c->size;
  if (x[0] != P * (P + 1) / 2 || x[3] != P * iter)
    return failf(c, "(d) allreduce gave %d, %d (expected %d, %d)", x[0], x[3], P * (P + 1) / 2, P * iter);
  return check_recv(c, "(d) batch beside an allreduce", c->recv[0], n, partner, 7, iter);
}

/* (e) Even ranks post one batch; their odd partners use blocking send then
 * recv (even iterations) or isend + irecv (odd ones). */
static int pat_plain_peer(rank_ctx *c, size_t n, int iter) {
  int s = c->rank, partner = s ^ 1;
  if (partner >= c->size) return 0;
  fill_send(c->send[0], n, s, partner, s % 2 ? 8 : 10, iter);
  prep_recv(c->recv[0], n);
  if (s % 2 == 0) {
    ddp_p2p_op ops[2] = {op_recv(c->recv[0], n, partner, 8), op_send(c->send[0], n, partner, 10)};
    if (run_batch(c, ops, 2)) return -1;
  } else if (iter % 2 == 0) {
    TRY(c, ddp_send(c->pg, c->send[0], n, DDP_FLOAT16, partner, 8));
    TRY(c, ddp_recv(c->pg, c->recv[0], n, DDP_FLOAT16, partner, 10));
  } else {
    ddp_work *a = NULL, *b = NULL;
    TRY(c, ddp_isend(c->pg, c->send[0], n, DDP_FLOAT16, partner, 8, &a));
    TRY(c, ddp_irecv(c->pg, c->recv[0], n, DDP_FLOAT16, partner, 10, &b));
    ddp_status sa = ddp_work_wait(a, -1), sb = ddp_work_wait(b, -1);
    ddp_work_free(a);
    ddp_work_free(b);
    TRY(c, sa);
    TRY(c, sb);
  }
  return check_recv(c, "(e) batch against plain send/recv", c->recv[0], n, partner, s % 2 ? 10 : 8, iter);
}

typedef int (*pattern_fn)(rank_ctx *, size_t, int);
static const struct {
  const char *name;
  pattern_fn fn;
} PATTERNS[] = {
    {"neighbours", pat_neighbours}, {"ring", pat_ring},         {"gpipe", pat_gpipe},
    {"collective", pat_collective}, {"plain peer", pat_plain_peer},
};
#define N_PATTERNS (sizeof PATTERNS / sizeof PATTERNS[0])

/* Sizes up to $DDP_TEST_MAX_BYTES only (the ThreadSanitizer subset: 1 MiB),
 * said on stdout; all by default. */
static size_t max_bytes(void) {
  const char *e = getenv("DDP_TEST_MAX_BYTES");
  return e && *e ? (size_t)strtoull(e, NULL, 10) : MAX_BYTES;
}

/* Every pattern at every size, twice; then, per process (check_allocs), a
 * steady state of 1F1B-like and GPipe-like steps that allocates nothing. */
static int rank_body(rank_ctx *c, bool check_allocs) {
  if (max_bytes() < MAX_BYTES && c->rank == 0)
    printf("sizes above %zu bytes not run (DDP_TEST_MAX_BYTES)\n", max_bytes());
  for (size_t z = 0; z < N_SIZES && SIZES[z] <= max_bytes(); z++)
    for (size_t p = 0; p < N_PATTERNS; p++)
      /* Two iterations (each pattern orders its operations both ways),
       * one at 16 MiB, which the smaller sizes cover for order. */
      for (int iter = 0; iter < (SIZES[z] < MAX_BYTES ? 2 : 1); iter++)
        if (PATTERNS[p].fn(c, SIZES[z] / 2, iter)) {
          size_t len = strlen(c->err);
          snprintf(c->err + len, sizeof c->err - len, " [pattern %s, %zu bytes, iteration %d]",
                   PATTERNS[p].name, SIZES[z], iter);
          return -1;
        }
  if (!check_allocs) return 0;
  size_t n = (1 << 20) / 2;
  for (int iter = 0; iter < 3; iter++)
    if (pat_neighbours(c, n, iter) || pat_gpipe(c, n, iter) || pat_ring(c, n, iter)) return -1;
  uint64_t before = ddp_alloc_count();
  for (int iter = 3; iter < 8; iter++)
    if (pat_neighbours(c, n, iter) || pat_gpipe(c, n, iter) || pat_ring(c, n, iter)) return -1;
  uint64_t made = ddp_alloc_count() - before;
  if (made) return failf(c, "the steady state allocated %llu times in 5 steps", (unsigned long long)made);
  return 0;
}

static int ctx_init(rank_ctx *c) {
  for (int i = 0; i < 2 * M_BATCHES; i++) {
    c->send[i] = malloc(MAX_BYTES + 2);
    c->recv[i] = malloc(MAX_BYTES + 2);
    if (!c->send[i] || !c->recv[i]) return failf(c, "out of memory");
  }
  return 0;
}

static void ctx_free(rank_ctx *c) {
  for (int i = 0; i < 2 * M_BATCHES; i++) {
    free(c->send[i]);
    free(c->recv[i]);
  }
}

/* ---- Ranks as threads ------------------------------------------------------------ */

typedef struct thread_arg {
  rank_ctx c;
  ddp_store *store;
  int failed;
} thread_arg;

static void *thread_main(void *p) {
  thread_arg *a = p;
  rank_ctx *c = &a->c;
  ddp_process_group_options o = {.timeout_s = 60};
  if (ctx_init(c) == 0) {
    if (ddp_process_group_create(a->store, c->rank, c->size, &o, &c->pg) != DDP_OK) {
      failf(c, "create: %s", ddp_last_error());
    } else {
      const char *t = ddp_process_group_transport(c->pg, (c->rank + 1) % c->size);
      if (strcmp(t, "threads") != 0)
        failf(c, "transport %s, expected threads", t);
      else
        rank_body(c, false);
      ddp_process_group_destroy(c->pg);
    }
  }
  ctx_free(c);
  a->failed = c->err[0] != 0;
  return NULL;
}

static void run_threads(int P) {
  ddp_store_options so = {.timeout_ms = 60000};
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(&so, &store), DDP_OK);
  thread_arg a[4];
  pthread_t t[4];
  for (int r = 0; r < P; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].c.rank = r;
    a[r].c.size = P;
    a[r].store = store;
    pthread_create(&t[r], NULL, thread_main, &a[r]);
  }
  int bad = 0;
  for (int r = 0; r < P; r++) {
    pthread_join(t[r], NULL);
    if (a[r].failed) {
      fprintf(stderr, "%s\n", a[r].c.err);
      bad++;
    }
  }
  ddp_store_destroy(store);
  if (bad) fail_msg("threads, world %d: %d ranks failed (see stderr)", P, bad);
}

static void test_threads_2(void **state) { (void)state; run_threads(2); }
static void test_threads_4(void **state) { (void)state; run_threads(4); }

/* ---- Ranks as processes (shm and tcp) -------------------------------------------- */

typedef struct proc_arg {
  bool no_cma;           /* DDP_LOCAL_NO_CMA: large messages in 4 KiB pieces */
  const char *transport; /* NULL: auto (shm), "tcp" */
  const char *want;      /* the transport the group must use; NULL: hier (below) */
  char prefix[64];
} proc_arg;

/* Hier: ranks 2h and 2h + 1 on host h (DDP_HOST_ID), so a pair of
 * neighbours is alternately on one host (shm) and on two (tcp). */
static int check_transports(rank_ctx *c, const char *want) {
  for (int q = 0; q < c->size; q++) {
    if (q == c->rank) continue;
    const char *w = want ? want : q / 2 == c->rank / 2 ? "shm" : "tcp";
    const char *t = ddp_process_group_transport(c->pg, q);
    if (strcmp(t, w) != 0) return failf(c, "transport to rank %d is %s, expected %s", q, t, w);
  }
  return 0;
}

static ddp_store *child_store(const char *prefix) {
  ddp_store_options o = {.timeout_ms = 60000};
  ddp_store *base = NULL, *store = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", lp_the_server.port, &o, &base) != DDP_OK ||
      ddp_store_prefix(base, prefix, &store) != DDP_OK)
    _exit(10);
  ddp_store_destroy(base);
  return store;
}

static int proc_rank(int rank, int size, void *arg) {
  proc_arg *pa = arg;
  rank_ctx c = {.rank = rank, .size = size};
  if (pa->no_cma) setenv("DDP_LOCAL_NO_CMA", "1", 1);
  if (!pa->want) {
    char host[32];
    snprintf(host, sizeof host, "p2p-host-%d", rank / 2);
    setenv("DDP_HOST_ID", host, 1);
  }
  ddp_store *store = child_store(pa->prefix);
  ddp_process_group_options o = {.timeout_s = 60, .transport = pa->transport};
  if (ctx_init(&c) == 0) {
    if (ddp_process_group_create(store, rank, size, &o, &c.pg) != DDP_OK) {
      failf(&c, "create: %s", ddp_last_error());
    } else {
      if (check_transports(&c, pa->want) == 0) rank_body(&c, true);
      ddp_process_group_destroy(c.pg);
    }
  }
  ctx_free(&c);
  ddp_store_destroy(store);
  if (c.err[0]) fprintf(stderr, "%s\n", c.err);
  return c.err[0] ? 1 : 0;
}

static void run_procs_with(int P, const char *transport, const char *want, bool no_cma) {
  static int runs;
  proc_arg pa = {.transport = transport, .want = want, .no_cma = no_cma};
  snprintf(pa.prefix, sizeof pa.prefix, "run%d/", runs++);
  pid_t pids[4];
  lp_spawn(P, 240, proc_rank, &pa, pids);
  int bad = lp_reap(P, pids);
  if (bad) fail_msg("%s, world %d: %d ranks failed (see stderr)", want ? want : "hier", P, bad);
}

static void run_procs(int P, const char *transport, const char *want) {
  run_procs_with(P, transport, want, false);
}

static void test_procs_shm_2(void **state) { (void)state; run_procs(2, NULL, "shm"); }
static void test_procs_shm_4(void **state) { (void)state; run_procs(4, NULL, "shm"); }
/* Where cross-memory attach is refused: messages above 4 KiB in pieces. */
static void test_procs_shm_nocma_4(void **state) { (void)state; run_procs_with(4, NULL, "shm", true); }
static void test_procs_tcp_2(void **state) { (void)state; run_procs(2, "tcp", "tcp"); }
static void test_procs_tcp_4(void **state) { (void)state; run_procs(4, "tcp", "tcp"); }
/* Hier: 2 hosts x 2 ranks. */
static void test_procs_hier_4(void **state) { (void)state; run_procs(4, NULL, NULL); }

/* ---- A group of one, and argument errors ------------------------------------------ */

static void test_self_and_arguments(void **state) {
  (void)state;
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  rank_ctx c = {.rank = 0, .size = 1};
  assert_int_equal(ctx_init(&c), 0);
  ddp_process_group_options o = {.timeout_s = 60};
  assert_int_equal(ddp_process_group_create(store, 0, 1, &o, &c.pg), DDP_OK);
  for (size_t z = 0; z < N_SIZES; z++) {
    size_t n = SIZES[z] / 2;
    /* Two messages with one tag, received in order, and another tag between. */
    fill_send(c.send[0], n, 0, 0, 1, 0);
    fill_send(c.send[1], n, 0, 0, 1, 1);
    fill_send(c.send[2], n, 0, 0, 2, 0);
    for (int i = 0; i < 3; i++) prep_recv(c.recv[i], n);
    ddp_p2p_op ops[6] = {op_recv(c.recv[0], n, 0, 1), op_recv(c.recv[2], n, 0, 2),
                         op_send(c.send[0], n, 0, 1), op_recv(c.recv[1], n, 0, 1),
                         op_send(c.send[2], n, 0, 2), op_send(c.send[1], n, 0, 1)};
    if (run_batch(&c, ops, 6) || check_recv(&c, "self, first", c.recv[0], n, 0, 1, 0) ||
        check_recv(&c, "self, second", c.recv[1], n, 0, 1, 1) ||
        check_recv(&c, "self, other tag", c.recv[2], n, 0, 2, 0))
      fail_msg("%s", c.err);
  }
  /* n == 0: complete at once. */
  ddp_work *w = NULL;
  assert_int_equal(ddp_batch_isend_irecv(c.pg, NULL, 0, &w), DDP_OK);
  assert_true(ddp_work_test(w, NULL));
  ddp_work_free(w);
  /* Argument errors name the call and the op. */
  ddp_p2p_op bad = op_send(c.send[0], 4, 1, 0);
  assert_int_equal(ddp_batch_isend_irecv(c.pg, &bad, 1, &w), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "batch_isend_irecv: ops[0]: dst 1 is not a rank"));
  bad = op_recv(NULL, 4, 0, 0);
  assert_int_equal(ddp_batch_isend_irecv(c.pg, &bad, 1, &w), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "buf is NULL with count 4"));
  bad.kind = (ddp_p2p_kind)7;
  assert_int_equal(ddp_batch_isend_irecv(c.pg, &bad, 1, &w), DDP_ERR_INVALID);
  assert_int_equal(ddp_batch_isend_irecv(c.pg, &bad, 1, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_batch_isend_irecv(c.pg, NULL, 1, &w), DDP_ERR_INVALID);
  /* A receive from itself with another size than the send fails the group. */
  ddp_p2p_op mism[2] = {op_send(c.send[0], 4, 0, 3), op_recv(c.recv[0], 8, 0, 3)};
  assert_int_equal(ddp_batch_isend_irecv(c.pg, mism, 2, &w), DDP_OK);
  assert_int_equal(ddp_work_wait(w, -1), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "matched a send to itself of 8 bytes"));
  ddp_work_free(w);
  ddp_process_group_destroy(c.pg);
  ctx_free(&c);
  ddp_store_destroy(store);
}

/* ---- A peer that exits ------------------------------------------------------------ */

typedef struct dead_arg {
  const char *transport;
  char prefix[64];
} dead_arg;

/* Rank 1 exchanges once, meets rank 0 in a barrier and exits without
 * destroying its group; rank 0 posts a batch with it (16 MiB both ways, so
 * nothing completes eagerly) and must fail within 5 s of the exit, naming
 * the receive, rank 1 and the tag. */
static int dead_rank(int rank, int size, void *arg) {
  dead_arg *da = arg;
  ddp_store *store = child_store(da->prefix);
  ddp_process_group_options o = {.timeout_s = 60, .transport = da->transport};
  rank_ctx c = {.rank = rank, .size = size};
  if (ctx_init(&c) || ddp_process_group_create(store, rank, size, &o, &c.pg) != DDP_OK) return 10;
  if (pat_neighbours(&c, 1000, 0)) {
    fprintf(stderr, "%s\n", c.err);
    return 11;
  }
  if (ddp_barrier(c.pg) != DDP_OK) return 12;
  if (rank == 1) {
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL);
    _exit(0); /* no destroy: to rank 0 it died */
  }
  int64_t exit_ns = ddp_time_ns() + 200 * 1000000LL;
  size_t n = MAX_BYTES / 2;
  ddp_p2p_op ops[2] = {op_send(c.send[0], n, 1, 5), op_recv(c.recv[0], n, 1, 6)};
  ddp_work *w = NULL;
  if (ddp_batch_isend_irecv(c.pg, ops, 2, &w) != DDP_OK) return 13;
  ddp_status st = ddp_work_wait(w, -1);
  double took = (double)(ddp_time_ns() - exit_ns) / 1e9;
  const char *msg = ddp_last_error();
  int code = 0;
  if (st != DDP_ERR_PEER || !strstr(msg, "rank 1") || !strstr(msg, "batch_isend_irecv") ||
      !(strstr(msg, "recv from rank 1 (tag 6") || strstr(msg, "send to rank 1 (tag 5")))
    code = 14;
  if (took > 5.0) code = 15;
  fprintf(stderr, "%s: the waiting rank failed %.3f s after its peer exited: %s: %s\n",
          da->transport ? da->transport : "shm", took, ddp_status_name(st), msg);
  ddp_work_free(w);
  /* Sticky: a later receive fails the same way at once. */
  if (ddp_recv(c.pg, c.recv[1], 4, DDP_FLOAT16, 1, 0) != st) code = 16;
  ddp_process_group_destroy(c.pg);
  ctx_free(&c);
  ddp_store_destroy(store);
  return code;
}

static void run_dead(const char *transport) {
  static int runs;
  dead_arg da = {.transport = transport};
  snprintf(da.prefix, sizeof da.prefix, "dead%d/", runs++);
  pid_t pids[2];
  lp_spawn(2, 60, dead_rank, &da, pids);
  int bad = lp_reap(2, pids);
  if (bad) fail_msg("%s: the dead-peer test failed (see stderr)", transport ? transport : "shm");
}

static void test_dead_peer_shm(void **state) { (void)state; run_dead(NULL); }
static void test_dead_peer_tcp(void **state) { (void)state; run_dead("tcp"); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_self_and_arguments),
      cmocka_unit_test(test_threads_2),
      cmocka_unit_test(test_threads_4),
      cmocka_unit_test(test_procs_shm_2),
      cmocka_unit_test(test_procs_shm_4),
      cmocka_unit_test(test_procs_shm_nocma_4),
      cmocka_unit_test(test_procs_tcp_2),
      cmocka_unit_test(test_procs_tcp_4),
      cmocka_unit_test(test_procs_hier_4),
      cmocka_unit_test(test_dead_peer_shm),
      cmocka_unit_test(test_dead_peer_tcp),
  };
  /* DDP_TEST_FILTER / DDP_TEST_SKIP: run only the tests matching, or skip
   * those matching, a cmocka pattern (* and ?). */
  if (getenv("DDP_TEST_FILTER")) cmocka_set_test_filter(getenv("DDP_TEST_FILTER"));
  if (getenv("DDP_TEST_SKIP")) cmocka_set_skip_filter(getenv("DDP_TEST_SKIP"));
  return cmocka_run_group_tests(tests, lp_group_setup, lp_group_teardown);
}
