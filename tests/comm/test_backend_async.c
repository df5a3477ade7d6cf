/* The asynchronous backend interface (src/comm/backend.h) against an engine
 * that completes later, as MPI's requests and NCCL's streams do: the group
 * layer must keep as many operations in flight as the backend declares (and
 * no more), complete them in order, poll a backend without wait and use the
 * wait of one that has it, give up at the deadline and abort the backend,
 * return promptly when aborted from another thread, and refuse what the
 * backend's caps do not list (operation, dtype, reduce op, device,
 * subgroups) with DDP_ERR_UNSUPPORTED naming the backend, and run
 * batch_isend_irecv as one queued op on an engine that groups batches
 * (NCCL's way) with the flight recorder's enqueued state. Results are
 * checked against the closed forms of src/comm/pattern.h.
 *
 * The engine: ranks are threads of this process (comm_test_util.h); each
 * rank's backend queues what it is given; one engine thread runs an
 * operation once every rank has queued it (and the test's gate is open),
 * writes every rank's result and completes their completions. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <cmocka.h>

#include "comm/comm_internal.h"
#include "comm/comm_test_util.h"
#include "comm/flight/flight.h"
#include "comm/staged.h"
#include "comm/pattern.h"

#define QUEUE_CAP 64
#define COUNT 1000

typedef struct pending {
  ddp__op_args op;
  ddp__completion *c;
  /* For caps.device_start: the record to mark started, as NCCL does when
   * its start event passes. */
  struct ddp__flight *flight;
  uint64_t flight_record;
} pending;

typedef struct engine {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int size;
  bool gate_open;            /* the test lets operations complete */
  bool stop;
  bool use_wait;             /* the backend has wait (else the group polls test) */
  ddp__backend_ops ops;      /* the table every rank's backend uses */
  pending q[CT_MAX_RANKS][QUEUE_CAP];
  int head[CT_MAX_RANKS], tail[CT_MAX_RANKS];
  int max_pending[CT_MAX_RANKS]; /* most ops queued at once on each rank */
  int aborts[CT_MAX_RANKS];
  bool aborted[CT_MAX_RANKS];
  int completed;             /* operations the engine ran */
  int ran_kinds[QUEUE_CAP];  /* their kinds, in the order run */
  pthread_t thread;
} engine;

static engine *g_engine;

typedef struct async_backend {
  ddp__backend base;
  engine *e;
  int rank;
} async_backend;

static int queued(const engine *e, int r) { return e->tail[r] - e->head[r]; }

/* Waits on the engine's condition for at most 1 ms (e->mu held). */
static void wait_a_while(engine *e) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 1000000;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_cond_timedwait(&e->cv, &e->mu, &ts);
}

/* Runs the operation at the head of every rank's queue (all ranks have one). */
static void run_one(engine *e) {
  pending *p[CT_MAX_RANKS] = {NULL};
  for (int r = 0; r < e->size; r++) p[r] = &e->q[r][e->head[r] % QUEUE_CAP];
  const ddp__op_args *a = &p[0]->op;
  ddp_status st = DDP_OK;
  for (int r = 1; r < e->size; r++)
    if (p[r]->op.kind != a->kind || p[r]->op.count != a->count) st = DDP_ERR_INTERNAL;
  size_t bytes = a->count * ddp_dtype_size(a->dtype);
  if (st == DDP_OK && a->kind == DDP__OP_ALLREDUCE) {
    unsigned char *acc = malloc(bytes ? bytes : 1);
    memcpy(acc, p[0]->op.buf, bytes);
    for (int r = 1; r < e->size; r++) ddp__reduce_into(acc, p[r]->op.buf, a->count, a->dtype, a->reduce_op);
    if (a->reduce_op == DDP_REDUCE_AVG) ddp__reduce_scale(acc, a->count, a->dtype, e->size);
    for (int r = 0; r < e->size; r++) memcpy(p[r]->op.buf, acc, bytes);
    free(acc);
  } else if (st == DDP_OK && a->kind == DDP__OP_BROADCAST) {
    for (int r = 0; r < e->size; r++)
      if (r != a->root) memcpy(p[r]->op.buf, p[a->root]->op.buf, bytes);
  } else if (st == DDP_OK && a->kind == DDP__OP_ALLGATHER) {
    for (int r = 0; r < e->size; r++)
      for (int q = 0; q < e->size; q++)
        memcpy((unsigned char *)p[r]->op.buf + (size_t)q * bytes, p[q]->op.send, bytes);
  } else if (st == DDP_OK && a->kind == DDP__OP_P2P_BATCH) {
    /* Every receive from q takes q's next send to this rank, in order per
     * pair (NCCL's matching inside one group). */
    for (int r = 0; r < e->size && st == DDP_OK; r++)
      for (size_t i = 0; i < p[r]->op.count && st == DDP_OK; i++) {
        const ddp_p2p_op *rv = &p[r]->op.batch[i];
        if (rv->kind != DDP_P2P_RECV) continue;
        size_t nth = 0;
        for (size_t j = 0; j < i; j++)
          nth += p[r]->op.batch[j].kind == DDP_P2P_RECV && p[r]->op.batch[j].peer == rv->peer;
        const ddp__op_args *from = &p[rv->peer]->op;
        const ddp_p2p_op *sd = NULL;
        for (size_t j = 0; j < from->count && !sd; j++)
          if (from->batch[j].kind == DDP_P2P_SEND && from->batch[j].peer == r && nth-- == 0) sd = &from->batch[j];
        if (!sd || sd->count != rv->count) st = DDP_ERR_INTERNAL;
        else memcpy(rv->buf, sd->buf, rv->count * ddp_dtype_size(rv->dtype));
      }
  } else if (st == DDP_OK && a->kind != DDP__OP_BARRIER) {
    st = DDP_ERR_INTERNAL;
  }
  if (st != DDP_OK) ddp_error(st, "async test engine: ranks disagree or an op it does not run");
  if (e->completed < QUEUE_CAP) e->ran_kinds[e->completed] = a->kind;
  e->completed++;
  for (int r = 0; r < e->size; r++) {
    e->head[r]++;
    if (e->ops.caps.device_start) ddp__flight_mark_started(p[r]->flight, p[r]->flight_record, ddp__now_coarse_ns());
    ddp__completion_finish(p[r]->c, st);
  }
}

static void *engine_main(void *arg) {
  engine *e = arg;
  pthread_mutex_lock(&e->mu);
  while (!e->stop) {
    bool ready = e->gate_open;
    for (int r = 0; r < e->size && ready; r++) ready = queued(e, r) > 0 && !e->aborted[r];
    if (ready) {
      run_one(e);
      pthread_cond_broadcast(&e->cv);
      continue;
    }
    wait_a_while(e);
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

static ddp_status async_enqueue(ddp__backend *b, const ddp__op_ctx *ctx, const ddp__op_args *op,
                                ddp__completion *c) {
  async_backend *ab = (async_backend *)b;
  engine *e = ab->e;
  int r = ab->rank;
  pthread_mutex_lock(&e->mu);
  if (e->aborted[r]) {
    pthread_mutex_unlock(&e->mu);
    return ddp_error(DDP_ERR_ABORTED, "async test engine: rank %d was aborted", r);
  }
  DDP_ASSERT(queued(e, r) < QUEUE_CAP);
  e->q[r][e->tail[r] % QUEUE_CAP] = (pending){*op, c, ctx->flight, ctx->flight_record};
  e->tail[r]++;
  if (queued(e, r) > e->max_pending[r]) e->max_pending[r] = queued(e, r);
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  return DDP_OK;
}

static bool async_test(ddp__backend *b, ddp__completion *c) {
  (void)b;
  return atomic_load_explicit(&c->done, memory_order_acquire);
}

static ddp_status async_wait(ddp__backend *b, const ddp__op_ctx *ctx, ddp__completion *c) {
  engine *e = ((async_backend *)b)->e;
  pthread_mutex_lock(&e->mu);
  ddp_status st = DDP_OK;
  while (!atomic_load(&c->done)) {
    if (atomic_load(ctx->aborted)) {
      st = ddp_error(DDP_ERR_ABORTED, "%s #%llu: aborted", ctx->op, (unsigned long long)ctx->seq);
      break;
    }
    if (ddp_time_ns() >= ctx->deadline_ns) {
      st = ddp_error(DDP_ERR_TIMEOUT, "%s #%llu: the async test engine did not complete it in time",
                     ctx->op, (unsigned long long)ctx->seq);
      break;
    }
    wait_a_while(e);
  }
  pthread_mutex_unlock(&e->mu);
  return st;
}

/* Completes every op this rank queued with DDP_ERR_ABORTED, and refuses
 * later ones: the interface's rule for abort. */
static void async_abort(ddp__backend *b) {
  async_backend *ab = (async_backend *)b;
  engine *e = ab->e;
  int r = ab->rank;
  pthread_mutex_lock(&e->mu);
  e->aborts[r]++;
  e->aborted[r] = true;
  for (; e->head[r] < e->tail[r]; e->head[r]++) {
    ddp_error(DDP_ERR_ABORTED, "async test engine: rank %d aborted", r);
    ddp__completion_finish(e->q[r][e->head[r] % QUEUE_CAP].c, DDP_ERR_ABORTED);
  }
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static void async_destroy(ddp__backend *b) { free(b); }

static ddp_status async_create(const ddp__backend_config *cfg, ddp__backend **out) {
  async_backend *ab = calloc(1, sizeof *ab);
  ab->base.ops = &g_engine->ops;
  ab->e = g_engine;
  ab->rank = cfg->rank;
  *out = &ab->base;
  return DDP_OK;
}

/* Starts the engine for a world of `size` with these caps. */
static engine *engine_start(int size, ddp__backend_caps caps, bool use_wait, bool gate_open) {
  engine *e = calloc(1, sizeof *e);
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->size = size;
  e->gate_open = gate_open;
  e->use_wait = use_wait;
  e->ops = (ddp__backend_ops){
      .name = "async-test",
      .caps = caps,
      .enqueue = async_enqueue,
      .test = async_test,
      .wait = use_wait ? async_wait : NULL,
      .abort = async_abort,
      .destroy = async_destroy,
  };
  g_engine = e;
  ddp__backend_override = async_create;
  pthread_create(&e->thread, NULL, engine_main, e);
  return e;
}

static void engine_stop(engine *e) {
  pthread_mutex_lock(&e->mu);
  e->stop = true;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  pthread_join(e->thread, NULL);
  ddp__backend_override = NULL;
  g_engine = NULL;
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
  free(e);
}

static void open_gate(engine *e) {
  pthread_mutex_lock(&e->mu);
  e->gate_open = true;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static ddp__backend_caps full_caps(int max_in_flight) {
  return (ddp__backend_caps){.ops = DDP__CAPS_ALL_OPS, .dtypes = DDP__CAPS_ALL_DTYPES,
                             .reduce_ops = DDP__CAPS_ALL_REDUCE_OPS, .devices = DDP__CAPS_CPU,
                             .subgroups = false, .max_in_flight = max_in_flight};
}

/* ---- In flight: as many as declared, completed in order ------------------- */

#define IN_FLIGHT_OPS 6

static void check_sum(ct_rank *self, const float *buf, int P, int op_index) {
  for (size_t i = 0; i < COUNT; i++) {
    double want = ddp__pattern_reduced(DDP_REDUCE_SUM, P, i) * (op_index + 1);
    CT_CHECK(self, buf[i] == (float)want, "op %d [%zu] = %g, expected %g", op_index, i, buf[i], want);
  }
}

static void in_flight_body(ct_rank *self) {
  engine *e = g_engine;
  int r = self->rank, P = self->world->size;
  static float bufs[CT_MAX_RANKS][IN_FLIGHT_OPS][COUNT];
  ddp_work *w[IN_FLIGHT_OPS];
  for (int k = 0; k < IN_FLIGHT_OPS; k++) {
    for (size_t i = 0; i < COUNT; i++)
      bufs[r][k][i] = (float)(ddp__pattern_contrib(r, i, DDP_REDUCE_SUM) * (k + 1));
    CT_OK(self, ddp_allreduce_async(self->pg, bufs[r][k], COUNT, DDP_FLOAT32, DDP_REDUCE_SUM, &w[k]));
  }
  /* The gate is closed: nothing may be done yet. */
  for (int k = 0; k < IN_FLIGHT_OPS; k++) {
    ddp_status st;
    CT_CHECK(self, !ddp_work_test(w[k], &st), "op %d done before the engine ran it", k);
  }
  /* Wait until the group layer has handed the engine what it may. */
  int want = e->ops.caps.max_in_flight < IN_FLIGHT_OPS ? e->ops.caps.max_in_flight : IN_FLIGHT_OPS;
  int64_t until = ddp_time_ns() + 5000000000LL;
  for (;;) {
    pthread_mutex_lock(&e->mu);
    int q = queued(e, r);
    pthread_mutex_unlock(&e->mu);
    if (q >= want || ddp_time_ns() > until) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ct_sync(self);
  if (r == 0) open_gate(e);
  for (int k = 0; k < IN_FLIGHT_OPS; k++) {
    CT_OK(self, ddp_work_wait(w[k], 30));
    /* Completed in order: every earlier one is done too. */
    for (int j = 0; j < k; j++) {
      ddp_status st;
      CT_CHECK(self, ddp_work_test(w[j], &st), "op %d done but op %d is not", k, j);
    }
    check_sum(self, bufs[r][k], P, k);
    ddp_work_free(w[k]);
  }
  ct_sync(self);
  pthread_mutex_lock(&e->mu);
  int seen = e->max_pending[r];
  pthread_mutex_unlock(&e->mu);
  CT_CHECK(self, seen == want, "the engine held at most %d ops of rank %d at once, expected %d (max_in_flight %d)",
           seen, r, want, e->ops.caps.max_in_flight);
}

static void run_in_flight(int max_in_flight, bool use_wait) {
  engine *e = engine_start(3, full_caps(max_in_flight), use_wait, false);
  int rc = ct_run(3, 30, in_flight_body, NULL);
  pthread_mutex_lock(&e->mu);
  int completed = e->completed;
  pthread_mutex_unlock(&e->mu);
  assert_int_equal(completed, IN_FLIGHT_OPS);
  engine_stop(e);
  assert_int_equal(rc, 0);
}

static void test_four_in_flight_polled(void **state) {
  (void)state;
  run_in_flight(4, false);
}

static void test_one_in_flight_waited(void **state) {
  (void)state;
  run_in_flight(1, true);
}

/* ---- Blocking calls and every reduce op -------------------------------------- */

static void blocking_body(ct_rank *self) {
  int r = self->rank, P = self->world->size;
  for (int op = 0; op < DDP_REDUCE_OP_COUNT; op++) {
    double d[COUNT];
    for (size_t i = 0; i < COUNT; i++) d[i] = ddp__pattern_contrib(r, i, (ddp_reduce_op)op);
    CT_OK(self, ddp_allreduce(self->pg, d, COUNT, DDP_FLOAT64, (ddp_reduce_op)op));
    for (size_t i = 0; i < COUNT; i++) {
      double want = ddp__pattern_reduced((ddp_reduce_op)op, P, i);
      CT_CHECK(self, d[i] == want, "%s [%zu] = %g, expected %g", ddp_reduce_op_name((ddp_reduce_op)op), i,
               d[i], want);
    }
  }
  int64_t v[COUNT];
  for (size_t i = 0; i < COUNT; i++) v[i] = r == 1 ? (int64_t)(i * 3) : -1;
  CT_OK(self, ddp_broadcast(self->pg, v, COUNT, DDP_INT64, 1));
  for (size_t i = 0; i < COUNT; i++) CT_CHECK(self, v[i] == (int64_t)(i * 3), "broadcast [%zu] = %lld", i, (long long)v[i]);
  CT_OK(self, ddp_barrier(self->pg));
}

static void test_blocking_calls(void **state) {
  (void)state;
  for (int use_wait = 0; use_wait < 2; use_wait++) {
    engine *e = engine_start(3, full_caps(2), use_wait, true);
    int rc = ct_run(3, 30, blocking_body, NULL);
    engine_stop(e);
    assert_int_equal(rc, 0);
  }
}

/* DDP_DEBUG=detail's fingerprint check runs through enqueue too. */
static void test_debug_fingerprints(void **state) {
  (void)state;
  setenv("DDP_DEBUG", "detail", 1);
  engine *e = engine_start(2, full_caps(1), true, true);
  int rc = ct_run(2, 30, blocking_body, NULL);
  engine_stop(e);
  unsetenv("DDP_DEBUG");
  assert_int_equal(rc, 0);
}

/* ---- The deadline, and abort from another thread ------------------------------ */

static void timeout_body(ct_rank *self) {
  float x[4] = {1, 2, 3, 4};
  int64_t t0 = ddp_time_ns();
  ddp_status st = ddp_allreduce(self->pg, x, 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  double took = (double)(ddp_time_ns() - t0) / 1e9;
  CT_CHECK(self, st == DDP_ERR_TIMEOUT, "allreduce on a stalled engine gave %s: %s", ddp_status_name(st),
           ddp_last_error());
  CT_CHECK(self, took >= 0.9 && took < 15, "gave up after %.3f s with a 1 s timeout", took);
  CT_CHECK(self, strstr(ddp_last_error(), "allreduce") != NULL, "message does not name the op: %s",
           ddp_last_error());
  pthread_mutex_lock(&g_engine->mu);
  int aborts = g_engine->aborts[self->rank];
  pthread_mutex_unlock(&g_engine->mu);
  CT_CHECK(self, aborts >= 1, "the backend was not aborted after the timeout");
  /* Sticky: the next call fails the same way without reaching the engine. */
  st = ddp_barrier(self->pg);
  CT_CHECK(self, st == DDP_ERR_TIMEOUT, "after the timeout, barrier gave %s", ddp_status_name(st));
}

static void test_timeout_aborts_backend(void **state) {
  (void)state;
  for (int use_wait = 0; use_wait < 2; use_wait++) {
    engine *e = engine_start(2, full_caps(1), use_wait, false); /* the gate never opens */
    int rc = ct_run(2, 1.0, timeout_body, NULL);
    engine_stop(e);
    assert_int_equal(rc, 0);
  }
}

typedef struct aborter {
  ddp_process_group *pg;
} aborter;

static void *abort_later(void *arg) {
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  ddp_process_group_abort(((aborter *)arg)->pg);
  return NULL;
}

static void abort_body(ct_rank *self) {
  aborter a = {self->pg};
  pthread_t t;
  pthread_create(&t, NULL, abort_later, &a);
  float x[4] = {1, 2, 3, 4};
  int64_t t0 = ddp_time_ns();
  ddp_work *w = NULL;
  CT_OK(self, ddp_allreduce_async(self->pg, x, 4, DDP_FLOAT32, DDP_REDUCE_SUM, &w));
  ddp_status st = ddp_allreduce(self->pg, x, 4, DDP_FLOAT32, DDP_REDUCE_SUM);
  double took = (double)(ddp_time_ns() - t0) / 1e9;
  pthread_join(t, NULL);
  CT_CHECK(self, st == DDP_ERR_ABORTED, "blocking call gave %s: %s", ddp_status_name(st), ddp_last_error());
  st = ddp_work_wait(w, 10);
  CT_CHECK(self, st == DDP_ERR_ABORTED, "queued work gave %s", ddp_status_name(st));
  ddp_work_free(w);
  CT_CHECK(self, took < 10, "abort took %.3f s to reach the waiting caller", took);
}

static void test_abort_from_another_thread(void **state) {
  (void)state;
  for (int use_wait = 0; use_wait < 2; use_wait++) {
    engine *e = engine_start(2, full_caps(2), use_wait, false);
    int rc = ct_run(2, 600, abort_body, NULL); /* only abort can end the wait */
    engine_stop(e);
    assert_int_equal(rc, 0);
  }
}

/* ---- Capabilities ------------------------------------------------------------------ */

static void expect_unsupported(ct_rank *self, ddp_status st, const char *what, const char *needle) {
  CT_CHECK(self, st == DDP_ERR_UNSUPPORTED, "%s gave %s, not DDP_ERR_UNSUPPORTED", what, ddp_status_name(st));
  CT_CHECK(self, strstr(ddp_last_error(), "async-test") && strstr(ddp_last_error(), needle),
           "%s: message names neither the backend nor %s: %s", what, needle, ddp_last_error());
}

static void caps_body(ct_rank *self) {
  ddp_process_group *pg = self->pg;
  float f[8] = {0}, f2[16] = {0};
  int64_t i64[8] = {0};
  expect_unsupported(self, ddp_allreduce(pg, i64, 8, DDP_INT64, DDP_REDUCE_SUM), "int64 allreduce", "int64");
  expect_unsupported(self, ddp_allreduce(pg, f, 8, DDP_FLOAT32, DDP_REDUCE_PRODUCT), "product", "product");
  expect_unsupported(self, ddp_broadcast(pg, f, 8, DDP_FLOAT32, 0), "broadcast", "broadcast");
  ddp_work *w = NULL;
  expect_unsupported(self, ddp_allgather_async(pg, f, f2, 1, DDP_FLOAT32, &w), "allgather_async", "allgather");
  expect_unsupported(self, ddp_send(pg, f, 8, DDP_FLOAT32, 1 - self->rank, 0), "send", "send");
  ddp__op_args a = {.kind = DDP__OP_ALLREDUCE, .buf = f, .count = 8, .dtype = DDP_FLOAT32,
                    .reduce_op = DDP_REDUCE_SUM, .device = DDP_CUDA(0)};
  expect_unsupported(self, ddp__submit(pg, &a, NULL), "an op on cuda:0", "cuda:0");
  int ranks[1] = {0};
  ddp_process_group *sub = NULL;
  expect_unsupported(self, ddp_process_group_new(pg, 1, ranks, &sub), "process_group_new", "subgroups");
  /* Refusals are argument errors, not failures of the group. */
  for (int k = 0; k < 8; k++) f[k] = (float)(self->rank + k);
  CT_OK(self, ddp_allreduce(pg, f, 8, DDP_FLOAT32, DDP_REDUCE_MAX));
  for (int k = 0; k < 8; k++) CT_CHECK(self, f[k] == (float)(1 + k), "max [%d] = %g", k, f[k]);
  CT_OK(self, ddp_barrier(pg));
}

static void test_caps_refused(void **state) {
  (void)state;
  ddp__backend_caps caps = {
      .ops = (1u << DDP__OP_ALLREDUCE) | (1u << DDP__OP_BARRIER),
      .dtypes = 1u << DDP_FLOAT32,
      .reduce_ops = (1u << DDP_REDUCE_SUM) | (1u << DDP_REDUCE_MAX),
      .devices = DDP__CAPS_CPU,
      .subgroups = false,
      .max_in_flight = 1,
  };
  engine *e = engine_start(2, caps, true, true);
  int rc = ct_run(2, 30, caps_body, NULL);
  engine_stop(e);
  assert_int_equal(rc, 0);
}

/* ddp's own backends declare host memory only: an op on a GPU's buffers is
 * refused by the group layer before the backend could touch it. */
static void own_backend_body(ct_rank *self) {
  float f[4] = {0};
  ddp__op_args a = {.kind = DDP__OP_ALLREDUCE, .buf = f, .count = 4, .dtype = DDP_FLOAT32,
                    .reduce_op = DDP_REDUCE_SUM, .device = DDP_CUDA(1)};
  ddp_status st = ddp__submit(self->pg, &a, NULL);
  CT_CHECK(self, st == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(), "cuda:1"),
           "a cuda:1 op on the %s backend gave %s: %s", self->pg->backend->ops->name,
           ddp_status_name(st), ddp_last_error());
  for (int k = 0; k < 4; k++) f[k] = 1;
  CT_OK(self, ddp_allreduce(self->pg, f, 4, DDP_FLOAT32, DDP_REDUCE_SUM));
  CT_CHECK(self, f[0] == (float)self->world->size, "sum %g", f[0]);
}

static void test_own_backends_host_only(void **state) {
  (void)state;
  /* As they are: where this process has a GPU, groups wrap them to stage
   * GPU buffers through host memory (staged.h, test_comm_staged). */
  ddp__staged_mode = -1;
  int rc = ct_run(2, 30, own_backend_body, NULL);
  ddp__staged_mode = 0;
  assert_int_equal(rc, 0);
}

/* ---- An engine that groups batches and starts ops on a device ------------------ */

/* batch_isend_irecv on an engine whose caps name DDP__OP_P2P_BATCH (NCCL's
 * way, ncclGroupStart/End): one op of the queue, after what was submitted
 * before it and before what comes after (program order), its operations
 * copied (the caller's array is scribbled over at once); the flight
 * recorder's states on an engine with device_start: enqueued when handed
 * over, started when the engine says so, completed. */
static void batch_body(ct_rank *self) {
  engine *e = g_engine;
  int r = self->rank, P = self->world->size, next = (r + 1) % P, prev = (r + P - 1) % P;
  static float sendb[CT_MAX_RANKS][COUNT], recvb[CT_MAX_RANKS][COUNT], sum[CT_MAX_RANKS][COUNT];
  for (size_t i = 0; i < COUNT; i++) {
    sendb[r][i] = (float)(r * 1000 + (int)(i % 97));
    recvb[r][i] = -1;
    sum[r][i] = (float)(r + 1);
  }
  ddp_work *w0 = NULL, *wb = NULL, *w1 = NULL;
  CT_OK(self, ddp_allreduce_async(self->pg, sum[r], 1, DDP_FLOAT32, DDP_REDUCE_SUM, &w0));
  {
    ddp_p2p_op ops[2] = {{DDP_P2P_SEND, sendb[r], COUNT, DDP_FLOAT32, next, 7},
                         {DDP_P2P_RECV, recvb[r], COUNT, DDP_FLOAT32, prev, 7}};
    CT_OK(self, ddp_batch_isend_irecv(self->pg, ops, 2, &wb));
    memset(ops, 0xab, sizeof ops); /* the group must have kept its own copy */
  }
  CT_OK(self, ddp_allreduce_async(self->pg, recvb[r], COUNT, DDP_FLOAT32, DDP_REDUCE_SUM, &w1));
  /* The gate is closed: the engine holds them; the batch is enqueued. */
  int64_t until = ddp_time_ns() + 5000000000LL;
  for (;;) {
    pthread_mutex_lock(&e->mu);
    int q = queued(e, r);
    pthread_mutex_unlock(&e->mu);
    if (q >= 3 || ddp_time_ns() > until) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ddp__flight_record rec[8];
  size_t n = ddp__flight_snapshot(self->pg->flight, rec);
  CT_CHECK(self, n == 3, "%zu records, expected 3", n);
  if (n == 3) {
    CT_CHECK(self, rec[1].kind == DDP__OP_P2P_BATCH && rec[1].count == 2 && rec[1].peer == -1,
             "record 1: kind %d count %llu", (int)rec[1].kind, (unsigned long long)rec[1].count);
    for (size_t k = 0; k < n; k++)
      CT_CHECK(self, rec[k].state == DDP__FLIGHT_ENQUEUED && rec[k].started_ns == -1 && rec[k].seq == 1 + (k == 2),
               "record %zu: state %s seq %llu before the engine ran it", k, ddp__flight_state_name(rec[k].state),
               (unsigned long long)rec[k].seq);
  }
  ct_sync(self);
  if (r == 0) open_gate(e);
  CT_OK(self, ddp_work_wait(w1, 30));
  CT_OK(self, ddp_work_wait(wb, 30));
  CT_OK(self, ddp_work_wait(w0, 30));
  ddp_work_free(w0);
  ddp_work_free(wb);
  ddp_work_free(w1);
  /* The allreduce after the batch saw what the batch delivered. */
  for (size_t i = 0; i < COUNT; i++) {
    double want = 0;
    for (int q = 0; q < P; q++) want += q * 1000 + (int)(i % 97);
    CT_CHECK(self, recvb[r][i] == (float)want, "[%zu] = %g, expected %g", i, recvb[r][i], want);
  }
  CT_CHECK(self, sum[r][0] == (float)(P * (P + 1) / 2), "first allreduce %g", sum[r][0]);
  n = ddp__flight_snapshot(self->pg->flight, rec);
  for (size_t k = 0; k < n; k++)
    CT_CHECK(self, rec[k].state == DDP__FLIGHT_COMPLETED && rec[k].started_ns >= rec[k].scheduled_ns &&
                       rec[k].ended_ns >= rec[k].started_ns,
             "record %zu: state %s started %lld", k, ddp__flight_state_name(rec[k].state),
             (long long)rec[k].started_ns);
  /* An empty batch: a handle already complete. */
  ddp_work *we = NULL;
  CT_OK(self, ddp_batch_isend_irecv(self->pg, NULL, 0, &we));
  ddp_status st = DDP_ERR_INTERNAL;
  CT_CHECK(self, ddp_work_test(we, &st) && st == DDP_OK, "empty batch not complete");
  ddp_work_free(we);
}

static void test_engine_batch(void **state) {
  (void)state;
  ddp__backend_caps caps = full_caps(4);
  caps.ops |= 1u << DDP__OP_P2P_BATCH;
  caps.device_start = true;
  engine *e = engine_start(3, caps, false, false);
  int rc = ct_run(3, 30, batch_body, NULL);
  pthread_mutex_lock(&e->mu);
  int completed = e->completed;
  int kinds[3] = {e->ran_kinds[0], e->ran_kinds[1], e->ran_kinds[2]};
  pthread_mutex_unlock(&e->mu);
  engine_stop(e);
  assert_int_equal(rc, 0);
  assert_int_equal(completed, 3);
  /* Program order: allreduce, batch, allreduce. */
  assert_int_equal(kinds[0], DDP__OP_ALLREDUCE);
  assert_int_equal(kinds[1], DDP__OP_P2P_BATCH);
  assert_int_equal(kinds[2], DDP__OP_ALLREDUCE);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_four_in_flight_polled),
      cmocka_unit_test(test_one_in_flight_waited),
      cmocka_unit_test(test_blocking_calls),
      cmocka_unit_test(test_debug_fingerprints),
      cmocka_unit_test(test_timeout_aborts_backend),
      cmocka_unit_test(test_abort_from_another_thread),
      cmocka_unit_test(test_caps_refused),
      cmocka_unit_test(test_own_backends_host_only),
      cmocka_unit_test(test_engine_batch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
