/* The flight recorder (src/comm/flight*.c): the ring (the last N records,
 * wraparound at N and not at the power of two behind it, states, a record
 * overwritten before its op ends), writers on several threads against a
 * reader, the JSON round trip through launch/flight_read.c (and what it
 * refuses), what a process group records, and dumps on a timeout and on
 * SIGUSR1 (to DDP_DEBUG_DIR, judged from the file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/comm_test_util.h"
#include "comm/flight/flight.h"
#include "launch/launch_internal.h"

static char debug_dir[256];

static ddp__op_args op(ddp__op_kind kind, size_t count, int root, int tag) {
  ddp__op_args a;
  memset(&a, 0, sizeof a);
  a.kind = kind;
  a.count = count;
  a.dtype = DDP_FLOAT32;
  a.reduce_op = DDP_REDUCE_SUM;
  a.root = root;
  a.tag = tag;
  return a;
}

/* Records one operation start to end, numbered seq, at times seq, seq + 1. */
static void record_one(ddp__flight *f, uint64_t seq, ddp_status status) {
  ddp__op_args a = op(DDP__OP_ALLREDUCE, seq * 10, 0, 0);
  a.seq = seq;
  ddp__flight_start(f, &a, (int64_t)seq * 100);
  ddp__flight_end(f, &a, status, (int64_t)seq * 100 + 1);
}

static void test_ring_keeps_the_last_n(void **state) {
  (void)state;
  /* N = 5 lives in 8 slots: a dump still holds exactly the last 5. */
  ddp__flight *f = NULL;
  assert_int_equal(ddp__flight_open(5, "pg/test/", 0, 1, "self", &f), DDP_OK);
  assert_non_null(f);
  ddp__flight_record out[8];
  assert_int_equal(ddp__flight_snapshot(f, out), 0);
  for (uint64_t s = 1; s <= 3; s++) record_one(f, s, DDP_OK);
  assert_int_equal(ddp__flight_snapshot(f, out), 3);
  for (uint64_t s = 4; s <= 13; s++) record_one(f, s, s == 13 ? DDP_ERR_TIMEOUT : DDP_OK);
  size_t n = ddp__flight_snapshot(f, out);
  assert_int_equal(n, 5);
  for (size_t i = 0; i < n; i++) {
    uint64_t seq = 9 + i;
    assert_int_equal(out[i].id, seq - 1);
    assert_int_equal(out[i].seq, seq);
    assert_int_equal(out[i].kind, DDP__OP_ALLREDUCE);
    assert_int_equal(out[i].count, seq * 10);
    assert_int_equal(out[i].dtype, DDP_FLOAT32);
    assert_int_equal(out[i].reduce_op, DDP_REDUCE_SUM);
    assert_int_equal(out[i].root, -1); /* allreduce has none */
    assert_int_equal(out[i].peer, -1);
    assert_int_equal(out[i].started_ns, (int64_t)seq * 100);
    assert_int_equal(out[i].scheduled_ns, (int64_t)seq * 100);
    assert_int_equal(out[i].ended_ns, (int64_t)seq * 100 + 1);
    assert_int_equal(out[i].state, seq == 13 ? DDP__FLIGHT_FAILED : DDP__FLIGHT_COMPLETED);
    assert_int_equal(out[i].status, seq == 13 ? DDP_ERR_TIMEOUT : DDP_OK);
  }
  ddp__flight_close(f);
}

static void test_ring_states(void **state) {
  (void)state;
  ddp__flight *f = NULL;
  assert_int_equal(ddp__flight_open(4, "pg/test/", 1, 3, "local", &f), DDP_OK);
  ddp__flight_record out[4];
  /* Queued: scheduled, unnumbered; then started (numbered), then done. */
  ddp__op_args a = op(DDP__OP_BROADCAST, 7, 2, 0);
  ddp__flight_new(f, &a, DDP__FLIGHT_SCHEDULED, 1000);
  assert_int_equal(a.flight, 1);
  assert_int_equal(ddp__flight_snapshot(f, out), 1);
  assert_int_equal(out[0].state, DDP__FLIGHT_SCHEDULED);
  assert_int_equal(out[0].seq, 0);
  assert_int_equal(out[0].root, 2);
  assert_int_equal(out[0].started_ns, -1);
  assert_int_equal(out[0].ended_ns, -1);
  a.seq = 4;
  ddp__flight_start(f, &a, 2000);
  assert_int_equal(ddp__flight_snapshot(f, out), 1); /* the same record, not a new one */
  assert_int_equal(out[0].state, DDP__FLIGHT_STARTED);
  assert_int_equal(out[0].seq, 4);
  assert_int_equal(out[0].scheduled_ns, 1000);
  assert_int_equal(out[0].started_ns, 2000);
  ddp__flight_end(f, &a, DDP_OK, 3000);
  ddp__flight_snapshot(f, out);
  assert_int_equal(out[0].state, DDP__FLIGHT_COMPLETED);
  assert_int_equal(out[0].ended_ns, 3000);
  /* Point to point: the peer and tag, no root; barrier: no dtype. */
  ddp__op_args s = op(DDP__OP_SEND, 3, 2, 77);
  s.seq = 1;
  ddp__flight_start(f, &s, 4000);
  ddp__op_args b = op(DDP__OP_BARRIER, 0, 0, 0);
  b.seq = 5;
  ddp__flight_start(f, &b, 5000);
  assert_int_equal(ddp__flight_snapshot(f, out), 3);
  assert_int_equal(out[1].kind, DDP__OP_SEND);
  assert_int_equal(out[1].peer, 2);
  assert_int_equal(out[1].tag, 77);
  assert_int_equal(out[1].root, -1);
  assert_int_equal(out[1].reduce_op, -1);
  assert_int_equal(out[2].dtype, -1);
  assert_int_equal(out[2].state, DDP__FLIGHT_STARTED);
  /* A record overwritten while its op runs (N below the ops in flight):
   * the op's end leaves the newer record alone. */
  ddp__op_args queued = op(DDP__OP_ALLREDUCE, 1, 0, 0);
  ddp__flight_new(f, &queued, DDP__FLIGHT_SCHEDULED, 6000);
  for (int i = 0; i < 4; i++) record_one(f, 100 + (uint64_t)i, DDP_OK);
  queued.seq = 6;
  ddp__flight_end(f, &queued, DDP_ERR_PEER, 7000);
  assert_int_equal(ddp__flight_snapshot(f, out), 4);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(out[i].seq, 100 + (uint64_t)i);
    assert_int_equal(out[i].state, DDP__FLIGHT_COMPLETED);
  }
  /* Its start makes a fresh record instead. */
  ddp__flight_start(f, &queued, 8000);
  assert_int_equal(ddp__flight_snapshot(f, out), 4);
  assert_int_equal(out[3].seq, 6);
  assert_int_equal(out[3].state, DDP__FLIGHT_STARTED);
  assert_int_equal(out[3].id, 8);
  ddp__flight_close(f);
}

/* An engine on a device stream (NCCL): the group layer records the op
 * enqueued (numbered, no start time), the backend marks it started when its
 * start event passes, the group layer ends it. Queued first, inline, and
 * a mark that comes too late (already ended, or the slot reused) changes
 * nothing. */
static void test_ring_device_states(void **state) {
  (void)state;
  ddp__flight *f = NULL;
  assert_int_equal(ddp__flight_open(4, "pg/test/", 0, 2, "nccl", &f), DDP_OK);
  ddp__flight_record out[4];
  assert_string_equal(ddp__flight_state_name(DDP__FLIGHT_ENQUEUED), "enqueued");
  assert_int_equal(ddp__flight_state_of("enqueued"), DDP__FLIGHT_ENQUEUED);
  /* Queued behind others: scheduled, enqueued, started, completed: four
   * writes of one record. */
  ddp__op_args a = op(DDP__OP_ALLREDUCE, 5, 0, 0);
  ddp__flight_new(f, &a, DDP__FLIGHT_SCHEDULED, 1000);
  a.seq = 3;
  ddp__flight_enqueue(f, &a, 2000);
  assert_int_equal(ddp__flight_snapshot(f, out), 1);
  assert_int_equal(out[0].state, DDP__FLIGHT_ENQUEUED);
  assert_int_equal(out[0].seq, 3);
  assert_int_equal(out[0].scheduled_ns, 1000);
  assert_int_equal(out[0].started_ns, -1);
  ddp__flight_mark_started(f, a.flight, 2500);
  ddp__flight_snapshot(f, out);
  assert_int_equal(out[0].state, DDP__FLIGHT_STARTED);
  assert_int_equal(out[0].started_ns, 2500);
  assert_int_equal(out[0].kind, DDP__OP_ALLREDUCE); /* the rest of the word kept */
  assert_int_equal(out[0].reduce_op, DDP_REDUCE_SUM);
  assert_int_equal(out[0].count, 5);
  ddp__flight_mark_started(f, a.flight, 2600); /* a second mark: no change */
  ddp__flight_snapshot(f, out);
  assert_int_equal(out[0].started_ns, 2500);
  ddp__flight_end(f, &a, DDP_OK, 3000);
  ddp__flight_snapshot(f, out);
  assert_int_equal(out[0].state, DDP__FLIGHT_COMPLETED);
  assert_int_equal(out[0].started_ns, 2500);
  assert_int_equal(out[0].ended_ns, 3000);
  /* Inline (a blocking call): a new record, enqueued at once; it fails
   * before its start event passed: never started. A late mark is ignored. */
  ddp__op_args b = op(DDP__OP_P2P_BATCH, 4, -1, 0);
  b.seq = 1;
  ddp__flight_enqueue(f, &b, 4000);
  assert_int_equal(b.flight, 2);
  assert_int_equal(ddp__flight_snapshot(f, out), 2);
  assert_int_equal(out[1].state, DDP__FLIGHT_ENQUEUED);
  assert_int_equal(out[1].scheduled_ns, 4000);
  assert_int_equal(out[1].started_ns, -1);
  ddp__flight_end(f, &b, DDP_ERR_TIMEOUT, 5000);
  ddp__flight_mark_started(f, b.flight, 5500);
  ddp__flight_snapshot(f, out);
  assert_int_equal(out[1].state, DDP__FLIGHT_FAILED);
  assert_int_equal(out[1].started_ns, -1);
  assert_int_equal(out[1].kind, DDP__OP_P2P_BATCH);
  assert_int_equal(out[1].peer, -1);
  /* Its slot taken by newer records: the mark leaves them alone. */
  ddp__op_args c = op(DDP__OP_BROADCAST, 1, 1, 0);
  c.seq = 4;
  ddp__flight_enqueue(f, &c, 6000);
  for (int i = 0; i < 4; i++) record_one(f, 200 + (uint64_t)i, DDP_OK);
  ddp__flight_mark_started(f, c.flight, 7000);
  ddp__flight_mark_started(f, 0, 7000); /* no record */
  ddp__flight_mark_started(NULL, c.flight, 7000); /* recorder off */
  assert_int_equal(ddp__flight_snapshot(f, out), 4);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(out[i].seq, 200 + (uint64_t)i);
    assert_int_equal(out[i].state, DDP__FLIGHT_COMPLETED);
    assert_int_equal(out[i].started_ns, (int64_t)(200 + i) * 100);
  }
  ddp__flight_close(f);
}

/* ---- Writers on several threads, a reader copying meanwhile ------------- */

#define WRITERS 4
#define PER_WRITER 20000

typedef struct race {
  ddp__flight *f;
  int writer;
  atomic_int *stop;
  atomic_int *reading; /* the reader is copying: the writers may go */
  int torn;
  size_t snapshots;
} race;

/* Every record's fields are a function of (writer, i), so a torn copy shows. */
static void *writer_main(void *arg) {
  race *r = arg;
  while (!atomic_load(r->reading)) sched_yield();
  for (int i = 1; i <= PER_WRITER; i++) {
    ddp__op_args a = op((ddp__op_kind)(r->writer % 4), (size_t)i * 3, 0, r->writer);
    a.seq = (uint64_t)i;
    a.dtype = (ddp_dtype)(r->writer % 4);
    ddp__flight_new(r->f, &a, DDP__FLIGHT_STARTED, i);
    ddp__flight_end(r->f, &a, DDP_OK, (int64_t)i + 1);
  }
  return NULL;
}

static void *reader_main(void *arg) {
  race *r = arg;
  ddp__flight_record *out = calloc((size_t)r->f->capacity, sizeof *out);
  atomic_store(r->reading, 1);
  while (!atomic_load(r->stop)) {
    size_t n = ddp__flight_snapshot(r->f, out);
    r->snapshots++;
    for (size_t k = 0; k < n; k++) {
      const ddp__flight_record *x = &out[k];
      int w = x->kind; /* allreduce, broadcast, reduce, allgather = writers 0-3 */
      bool ok = x->count == x->seq * 3 && x->dtype == w && x->started_ns == (int64_t)x->seq &&
                (x->state == DDP__FLIGHT_STARTED ? x->ended_ns == -1
                                                 : x->state == DDP__FLIGHT_COMPLETED && x->ended_ns == x->started_ns + 1);
      if (k > 0 && x->id <= out[k - 1].id) ok = false;
      if (!ok) r->torn++;
    }
  }
  free(out);
  return NULL;
}

static void test_ring_concurrent_writers(void **state) {
  (void)state;
  /* Room for every record: what is raced here is the record numbers and
   * the seqlock against a reader (two writers on one slot need the ring to
   * wrap around while one of them is preempted mid-record; docs/comm.md). */
  ddp__flight *f = NULL;
  assert_int_equal(ddp__flight_open(WRITERS * PER_WRITER, "pg/race/", 0, 1, "self", &f), DDP_OK);
  atomic_int stop = 0, reading = 0;
  race w[WRITERS], rd = {.f = f, .stop = &stop, .reading = &reading};
  pthread_t tw[WRITERS], tr;
  pthread_create(&tr, NULL, reader_main, &rd);
  for (int i = 0; i < WRITERS; i++) {
    w[i] = (race){.f = f, .writer = i, .stop = &stop, .reading = &reading};
    pthread_create(&tw[i], NULL, writer_main, &w[i]);
  }
  for (int i = 0; i < WRITERS; i++) pthread_join(tw[i], NULL);
  atomic_store(&stop, 1);
  pthread_join(tr, NULL);
  assert_int_equal(rd.torn, 0);
  assert_true(rd.snapshots > 0);
  ddp__flight_record *out = calloc(WRITERS * PER_WRITER, sizeof *out);
  size_t n = ddp__flight_snapshot(f, out);
  assert_int_equal(n, WRITERS * PER_WRITER);
  int per[WRITERS] = {0};
  for (size_t k = 0; k < n; k++) {
    assert_int_equal(out[k].id, k);
    assert_int_equal(out[k].state, DDP__FLIGHT_COMPLETED);
    per[out[k].kind]++;
  }
  for (int i = 0; i < WRITERS; i++) assert_int_equal(per[i], PER_WRITER);
  free(out);
  ddp__flight_close(f);
}

/* ---- The owner's plain claims against the lane's (flight.h) ----------------
 * Each round a fresh ring: the owner thread makes records with
 * ddp__flight_new_owned (the direct path's, a plain load and store of the
 * record number while the claim is biased), noting their numbers, until
 * the main thread says stop (or OWNED_MAX); it yields every 1024 records,
 * so that on one CPU the main thread runs meanwhile too. The main thread,
 * once the owner has made a number of records that varies with the round,
 * calls ddp__flight_share, makes SHARED_N records with ddp__flight_new
 * (the point-to-point lane's) at once, waits for the owner to make one
 * more, then says stop. Every number must be
 * claimed once: a plain claim beside an atomic one loses an update (two
 * records with one number, the ring one record short). Fails with a
 * ddp__flight_share that only clears the flag; the revoker's wait and
 * membarrier alone are test_comm_bias's. */
enum { OWN_ROUNDS = 300, OWNED_MAX = 8192, SHARED_N = 500 };

typedef struct owned_side {
  ddp__flight *f;
  atomic_int made; /* records the owner made so far */
  atomic_int stop;
  uint64_t ids[OWNED_MAX];
} owned_side;

static void *owned_main(void *arg) {
  owned_side *o = arg;
  for (int i = 0; i < OWNED_MAX && !atomic_load_explicit(&o->stop, memory_order_relaxed); i++) {
    ddp__op_args a = op(DDP__OP_ALLREDUCE, 2, 0, 0);
    a.seq = (uint64_t)i + 1;
    ddp__flight_new_owned(o->f, &a, DDP__FLIGHT_STARTED, i);
    ddp__flight_end_started(o->f, &a, DDP_OK, i);
    o->ids[i] = a.flight - 1;
    atomic_store_explicit(&o->made, i + 1, memory_order_release);
    if (i % 1024 == 1023) sched_yield();
  }
  return NULL;
}

static void test_ring_owned_claims(void **state) {
  (void)state;
  bool biased_here = ddp__bias_available() && !DDP__BIAS_TSAN && !getenv("DDP_INLINE_BIAS");
  if (!biased_here)
    print_message("(membarrier unavailable, ThreadSanitizer or DDP_INLINE_BIAS set: the claims may all be "
                  "atomic adds here)\n");
  static owned_side o;
  static uint8_t seen[OWNED_MAX + SHARED_N];
  static ddp__flight_record out[OWNED_MAX + SHARED_N];
  int transitions = 0;
  for (int round = 0; round < OWN_ROUNDS; round++) {
    ddp__flight *f = NULL;
    assert_int_equal(ddp__flight_open(OWNED_MAX + SHARED_N, "pg/owned/", 0, 2, "mpi", &f), DDP_OK);
    bool biased = atomic_load(&f->claim.biased);
    if (biased_here) assert_true(biased);
    o.f = f;
    atomic_store(&o.made, 0);
    atomic_store(&o.stop, 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, owned_main, &o), 0);
    int at = round * 7 % 1400;
    while (atomic_load_explicit(&o.made, memory_order_acquire) < at) sched_yield();
    assert_int_equal(ddp__flight_share(f, 10 * 1000000000LL), DDP_OK);
    int made_at_share = atomic_load_explicit(&o.made, memory_order_acquire);
    uint64_t shared_ids[SHARED_N];
    for (int i = 0; i < SHARED_N; i++) {
      ddp__op_args a = op(DDP__OP_SEND, 3, 1, 7);
      a.seq = (uint64_t)i + 1;
      ddp__flight_new(f, &a, DDP__FLIGHT_STARTED, i);
      ddp__flight_end(f, &a, DDP_OK, i);
      shared_ids[i] = a.flight - 1;
    }
    /* The owner goes on past the share (its claims atomic now) before it
     * is stopped: what was revoked was in use. */
    int64_t until = ddp_time_ns() + 10 * 1000000000LL;
    while (atomic_load_explicit(&o.made, memory_order_acquire) == made_at_share && made_at_share < OWNED_MAX &&
           ddp_time_ns() < until)
      sched_yield();
    atomic_store(&o.stop, 1);
    pthread_join(t, NULL);
    int owned = atomic_load(&o.made);
    if (biased && made_at_share < owned) transitions++; /* the owner went on claiming past the share */
    assert_true(atomic_load(&f->claim.revoked));
    uint64_t total = (uint64_t)owned + SHARED_N;
    assert_int_equal(atomic_load(&f->next_id), total);
    memset(seen, 0, sizeof seen);
    for (uint64_t i = 0; i < total; i++) {
      uint64_t id = i < (uint64_t)owned ? o.ids[i] : shared_ids[i - (uint64_t)owned];
      assert_true(id < total);
      if (seen[id]) fail_msg("round %d: record number %llu claimed twice", round, (unsigned long long)id);
      seen[id] = 1;
    }
    size_t n = ddp__flight_snapshot(f, out);
    assert_int_equal(n, total);
    for (size_t k = 0; k < n; k++) assert_int_equal(out[k].state, DDP__FLIGHT_COMPLETED);
    ddp__flight_close(f);
  }
  if (biased_here) assert_true(transitions > OWN_ROUNDS / 2); /* the share came while the owner was claiming */
  print_message("(%d of %d rounds revoked the claims while the owner was claiming)\n", transitions, OWN_ROUNDS);
}

/* ---- JSON round trip ------------------------------------------------------- */

static void fill_dump(ddp__flight_dump *d) {
  memset(d, 0, sizeof *d);
  d->rank = 2;
  d->world_size = 4;
  d->pid = 4711;
  d->attempt = 1;
  d->dump_number = 3;
  d->capacity = 2000;
  d->dump_ns = 123456789012;
  d->dump_unix_ns = 1790000000123456789;
  snprintf(d->host, sizeof d->host, "node\"7\"\\x");
  snprintf(d->run_id, sizeof d->run_id, "job-42");
  snprintf(d->reason, sizeof d->reason, "timeout");
  snprintf(d->detail, sizeof d->detail, "allreduce #5: timed out waiting for rank 3 (\"h\")\twith a tab");
  d->n_groups = 2;
  d->groups = calloc(2, sizeof *d->groups);
  ddp__flight_group *g = &d->groups[0];
  snprintf(g->name, sizeof g->name, "pg/1/");
  snprintf(g->backend, sizeof g->backend, "local");
  g->rank = 2;
  g->size = 4;
  g->recorded = 2005;
  g->n = 5;
  g->records = calloc(5, sizeof *g->records);
  ddp__flight_record r[5] = {
      {.id = 2000, .seq = 5, .kind = DDP__OP_ALLREDUCE, .dtype = DDP_BFLOAT16, .reduce_op = DDP_REDUCE_AVG,
       .root = -1, .peer = -1, .count = 29696, .state = DDP__FLIGHT_FAILED, .status = DDP_ERR_TIMEOUT,
       .scheduled_ns = 10, .started_ns = 11, .ended_ns = 30000000011},
      {.id = 2001, .seq = 6, .kind = DDP__OP_BROADCAST, .dtype = DDP_INT64, .reduce_op = -1, .root = 3,
       .peer = -1, .count = 1, .state = DDP__FLIGHT_STARTED, .scheduled_ns = 12, .started_ns = 13, .ended_ns = -1},
      {.id = 2002, .seq = 0, .kind = DDP__OP_BARRIER, .dtype = -1, .reduce_op = -1, .root = -1, .peer = -1,
       .state = DDP__FLIGHT_SCHEDULED, .scheduled_ns = 14, .started_ns = -1, .ended_ns = -1},
      {.id = 2003, .seq = 9, .kind = DDP__OP_SEND, .dtype = DDP_FLOAT16, .reduce_op = -1, .root = -1, .peer = 1,
       .tag = -5, .count = 4096, .state = DDP__FLIGHT_COMPLETED, .scheduled_ns = 15, .started_ns = 16, .ended_ns = 17},
      {.id = 2004, .seq = 10, .kind = DDP__OP_RECV, .dtype = DDP_FLOAT64, .reduce_op = -1, .root = -1, .peer = 0,
       .tag = 1, .count = 3, .state = DDP__FLIGHT_FAILED, .status = DDP_ERR_PEER, .scheduled_ns = 18,
       .started_ns = 19, .ended_ns = 20},
  };
  memcpy(g->records, r, sizeof r);
  g = &d->groups[1];
  snprintf(g->name, sizeof g->name, "pg/1/sub/1/c0/");
  snprintf(g->backend, sizeof g->backend, "tcp");
  g->rank = 0;
  g->size = 2;
  /* An NCCL group's ring: a batch still queued on the GPU (enqueued). */
  g->recorded = 1;
  g->n = 1;
  g->records = calloc(1, sizeof *g->records);
  g->records[0] = (ddp__flight_record){.id = 0, .seq = 2, .kind = DDP__OP_P2P_BATCH, .dtype = DDP_FLOAT32,
                                       .reduce_op = -1, .root = -1, .peer = -1, .count = 4,
                                       .state = DDP__FLIGHT_ENQUEUED, .scheduled_ns = 21, .started_ns = -1,
                                       .ended_ns = -1};
}

static void assert_same_dump(const ddp__flight_dump *a, const ddp__flight_dump *b) {
  assert_int_equal(a->rank, b->rank);
  assert_int_equal(a->world_size, b->world_size);
  assert_int_equal(a->pid, b->pid);
  assert_int_equal(a->attempt, b->attempt);
  assert_int_equal(a->dump_number, b->dump_number);
  assert_int_equal(a->capacity, b->capacity);
  assert_int_equal(a->dump_ns, b->dump_ns);
  assert_int_equal(a->dump_unix_ns, b->dump_unix_ns);
  assert_string_equal(a->host, b->host);
  assert_string_equal(a->run_id, b->run_id);
  assert_string_equal(a->reason, b->reason);
  assert_string_equal(a->detail, b->detail);
  assert_int_equal(a->n_groups, b->n_groups);
  for (size_t g = 0; g < a->n_groups; g++) {
    const ddp__flight_group *x = &a->groups[g], *y = &b->groups[g];
    assert_string_equal(x->name, y->name);
    assert_string_equal(x->backend, y->backend);
    assert_int_equal(x->rank, y->rank);
    assert_int_equal(x->size, y->size);
    assert_int_equal(x->recorded, y->recorded);
    assert_int_equal(x->n, y->n);
    assert_int_equal(y->dump_ns, b->dump_ns);
    for (size_t i = 0; i < x->n; i++) assert_memory_equal(&x->records[i], &y->records[i], sizeof x->records[i]);
  }
}

static void free_filled(ddp__flight_dump *d) {
  for (size_t g = 0; g < d->n_groups; g++) free(d->groups[g].records);
  free(d->groups);
}

static void test_json_round_trip(void **state) {
  (void)state;
  ddp__flight_dump d, back;
  fill_dump(&d);
  char *text = NULL;
  size_t len = 0;
  assert_int_equal(ddp__flight_to_json(&d, &text, &len), DDP_OK);
  assert_int_equal(strlen(text), len);
  assert_int_equal(ddp__flight_parse(text, len, "test", &back), DDP_OK);
  for (size_t g = 0; g < d.n_groups; g++) d.groups[g].dump_ns = d.dump_ns; /* the reader fills it in */
  assert_same_dump(&d, &back);
  ddp__flight_dump_free(&back);

  /* What the reader refuses, naming the field. */
  struct {
    const char *from, *to, *want;
  } bad[] = {
      {"\"ddp-flight-recorder\"", "\"something-else\"", "format"},
      {"\"version\": 1", "\"version\": 2", "version"},
      {"\"op\": \"allreduce\"", "\"op\": \"allreduce2\"", "op names nothing known"},
      {"\"dtype\": \"int64\"", "\"dtype\": 8", "dtype has the wrong type"},
      {"\"state\": \"started\"", "\"state\": \"running\"", "state"},
      {"\"rank\": 2, \"size\": 4", "\"rank\": 4, \"size\": 4", "rank is out of range"},
      {"\"count\": 29696", "\"count\": -1", "count is out of range"},
      {"\"seq\": 5", "\"seq\": 5.5", "seq is not an integer"},
      {"\"recorded\": 2005, ", "", "recorded is missing"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    const char *at = strstr(text, bad[k].from);
    assert_non_null(at);
    size_t head = (size_t)(at - text), from = strlen(bad[k].from), to = strlen(bad[k].to);
    char *mutated = malloc(len + to + 1);
    memcpy(mutated, text, head);
    memcpy(mutated + head, bad[k].to, to);
    memcpy(mutated + head + to, at + from, len - head - from + 1);
    ddp_status st = ddp__flight_parse(mutated, strlen(mutated), "mutated", &back);
    if (st != DDP_ERR_FORMAT || !strstr(ddp_last_error(), bad[k].want))
      fail_msg("%s -> %s: %s (%s)", bad[k].from, bad[k].to, ddp_status_name(st), ddp_last_error());
    assert_int_equal(back.n_groups, 0);
    free(mutated);
  }
  assert_int_equal(ddp__flight_parse(text, len / 2, "half", &back), DDP_ERR_FORMAT);
  ddp_free(text);
  free_filled(&d);
}

/* ---- What a group records ------------------------------------------------- */

static void body_records(ct_rank *self) {
  ddp_process_group *pg = self->pg;
  CT_CHECK(self, pg->flight != NULL, "the group has no flight recorder");
  float x[3] = {1, 2, 3};
  for (int i = 0; i < 3; i++) CT_OK(self, ddp_allreduce(pg, x, 3, DDP_FLOAT32, DDP_REDUCE_SUM));
  CT_OK(self, ddp_barrier(pg));
  CT_OK(self, ddp_broadcast(pg, x, 2, DDP_FLOAT32, 1));
  /* Two async ops: the second waits behind the first (scheduled first). */
  ddp_work *w1 = NULL, *w2 = NULL;
  CT_OK(self, ddp_allreduce_async(pg, x, 1, DDP_FLOAT32, DDP_REDUCE_MAX, &w1));
  CT_OK(self, ddp_allreduce_async(pg, x, 2, DDP_FLOAT32, DDP_REDUCE_MIN, &w2));
  CT_OK(self, ddp_work_wait(w1, -1));
  CT_OK(self, ddp_work_wait(w2, -1));
  ddp_work_free(w1);
  ddp_work_free(w2);
  if (self->rank == 0) CT_OK(self, ddp_send(pg, x, 1, DDP_FLOAT32, 1, 9));
  if (self->rank == 1) CT_OK(self, ddp_recv(pg, x, 1, DDP_FLOAT32, 0, 9));
  ddp__flight_record out[16];
  size_t n = ddp__flight_snapshot(pg->flight, out);
  size_t want = self->rank < 2 ? 8 : 7;
  CT_CHECK(self, n == want, "%zu records, expected %zu", n, want);
  const int kinds[] = {DDP__OP_ALLREDUCE, DDP__OP_ALLREDUCE, DDP__OP_ALLREDUCE, DDP__OP_BARRIER,
                       DDP__OP_BROADCAST, DDP__OP_ALLREDUCE, DDP__OP_ALLREDUCE};
  for (size_t i = 0; i < 7; i++) {
    CT_CHECK(self, out[i].kind == kinds[i] && out[i].seq == i + 1, "record %zu: %s #%llu", i,
             ddp__op_kind_name((ddp__op_kind)out[i].kind), (unsigned long long)out[i].seq);
    CT_CHECK(self, out[i].state == DDP__FLIGHT_COMPLETED, "record %zu is %s", i,
             ddp__flight_state_name(out[i].state));
    CT_CHECK(self, out[i].scheduled_ns <= out[i].started_ns && out[i].started_ns <= out[i].ended_ns,
             "record %zu's times are out of order", i);
  }
  CT_CHECK(self, out[4].root == 1 && out[4].count == 2, "broadcast's root or count");
  CT_CHECK(self, out[5].reduce_op == DDP_REDUCE_MAX && out[6].reduce_op == DDP_REDUCE_MIN, "async reduce ops");
  if (self->rank < 2) {
    CT_CHECK(self, out[7].kind == (self->rank == 0 ? DDP__OP_SEND : DDP__OP_RECV) && out[7].seq == 1 &&
                       out[7].peer == 1 - self->rank && out[7].tag == 9,
             "the point-to-point record");
  }
}

static void test_group_records(void **state) {
  (void)state;
  unsetenv("DDP_FLIGHT_RECORDER_SIZE");
  int rc = ct_run(3, 30, body_records, NULL);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
}

static void body_off(ct_rank *self) {
  CT_CHECK(self, self->pg->flight == NULL, "DDP_FLIGHT_RECORDER_SIZE=0 left a recorder");
  CT_OK(self, ddp_barrier(self->pg));
}

static void test_group_recorder_off(void **state) {
  (void)state;
  setenv("DDP_FLIGHT_RECORDER_SIZE", "0", 1);
  int rc = ct_run(2, 30, body_off, NULL);
  unsetenv("DDP_FLIGHT_RECORDER_SIZE");
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
}

/* ---- Dumps ---------------------------------------------------------------------- */

static void dump_path(char *out, size_t bytes) {
  ddp__flight_dump_path(debug_dir, -1, (int64_t)getpid(), out, bytes);
}

/* Rank 1 skips allreduce #2: rank 0 times out there and dumps. */
static void body_timeout(ct_rank *self) {
  float x = 1;
  CT_OK(self, ddp_allreduce(self->pg, &x, 1, DDP_FLOAT32, DDP_REDUCE_SUM));
  if (self->rank == 0) {
    ddp_status st = ddp_allreduce(self->pg, &x, 1, DDP_FLOAT32, DDP_REDUCE_SUM);
    CT_CHECK(self, st == DDP_ERR_TIMEOUT, "allreduce #2 -> %s: %s", ddp_status_name(st), ddp_last_error());
    /* The failure's message survives the dump. */
    CT_CHECK(self, strstr(ddp_last_error(), "allreduce #2") != NULL, "last error: %s", ddp_last_error());
  }
  ct_sync(self);
}

static void test_dump_on_timeout(void **state) {
  (void)state;
  char path[512];
  dump_path(path, sizeof path);
  unlink(path);
  int rc = ct_run(2, 0.3, body_timeout, NULL);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
  ddp__flight_dump d;
  if (ddp__flight_read_file(path, &d) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_string_equal(d.reason, "timeout");
  assert_non_null(strstr(d.detail, "allreduce #2"));
  assert_int_equal(d.pid, getpid());
  assert_int_equal(d.rank, -1); /* RANK is not set here */
  /* Both ranks' views of the group, each rank's last record #2 or #1. */
  char *verdict = NULL;
  assert_int_equal(ddp__flight_verdict(&d, 1, -1, NULL, &verdict), DDP_OK);
  if (!strstr(verdict, "rank 1 never entered allreduce #2 (4 B); rank 0 waited "))
    fail_msg("verdict:\n%s", verdict);
  ddp_free(verdict);
  ddp__flight_dump_free(&d);
  /* No temporary file is left behind. */
  char tmp[600];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  assert_int_not_equal(access(tmp, F_OK), 0);
}

static void body_idle(ct_rank *self) {
  float x = 1;
  CT_OK(self, ddp_allreduce(self->pg, &x, 1, DDP_FLOAT32, DDP_REDUCE_SUM));
  ct_sync(self);
  if (self->rank == 0) {
    char path[512];
    dump_path(path, sizeof path);
    raise(SIGUSR1);
    /* The dump thread writes it: wait (bounded) for a newer file. */
    for (int i = 0; i < 500; i++) {
      ddp__flight_dump d;
      if (ddp__flight_read_file(path, &d) == DDP_OK) {
        bool fresh = strcmp(d.reason, "signal") == 0;
        ddp__flight_dump_free(&d);
        if (fresh) break;
      }
      usleep(10000);
    }
  }
  ct_sync(self);
}

static void test_dump_on_sigusr1(void **state) {
  (void)state;
  char path[512];
  dump_path(path, sizeof path);
  unlink(path);
  int rc = ct_run(2, 30, body_idle, NULL);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
  ddp__flight_dump d;
  if (ddp__flight_read_file(path, &d) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_string_equal(d.reason, "signal");
  assert_string_equal(d.detail, "SIGUSR1");
  /* Rank 0's and rank 1's group (and no other, unless a failed test above
   * left a ring open). */
  int seen = 0;
  for (size_t g = 0; g < d.n_groups; g++) {
    if (strcmp(d.groups[g].name, "pg/1/") != 0) continue;
    seen |= 1 << d.groups[g].rank;
    assert_int_equal(d.groups[g].n, 1);
    assert_int_equal(d.groups[g].records[0].state, DDP__FLIGHT_COMPLETED);
  }
  assert_int_equal(seen, 3);
  ddp__flight_dump_free(&d);
}

int main(void) {
  /* Dumps go to a directory of this test's own. */
  snprintf(debug_dir, sizeof debug_dir, "/tmp/ddp-test-flight-%ld", (long)getpid());
  setenv("DDP_DEBUG_DIR", debug_dir, 1);
  unsetenv("RANK");
  unsetenv("DDP_STORE_ADDR");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ring_keeps_the_last_n),
      cmocka_unit_test(test_ring_states),
      cmocka_unit_test(test_ring_device_states),
      cmocka_unit_test(test_ring_concurrent_writers),
      cmocka_unit_test(test_ring_owned_claims),
      cmocka_unit_test(test_json_round_trip),
      cmocka_unit_test(test_group_records),
      cmocka_unit_test(test_group_recorder_off),
      cmocka_unit_test(test_dump_on_timeout),
      cmocka_unit_test(test_dump_on_sigusr1),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", debug_dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", debug_dir);
  return failed;
}
