/* The flight recorder's verdict (src/comm/flight_verdict.c) from dumps made
 * up here, as ranks would have written them: a rank that skipped a
 * collective, ranks that called different collectives as the same number,
 * a rank without a dump (with and without a reason), a send nobody
 * receives, ranks all still in one collective, nothing pending, a subgroup
 * in trouble beside a healthy world, and two dumps of one rank (the newest
 * counts). Each verdict is compared line by line with the expected text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/flight/flight.h"

#define S 1000000000LL /* ns per second */
#define MAX_RANKS 8
#define MAX_GROUPS 2
#define MAX_RECORDS 16

/* A made-up job: per rank one dump with up to two groups. */
typedef struct job {
  ddp__flight_dump dumps[MAX_RANKS];
  ddp__flight_group groups[MAX_RANKS][MAX_GROUPS];
  ddp__flight_record records[MAX_RANKS][MAX_GROUPS][MAX_RECORDS];
} job;

static job *job_new(int ranks, int world_size) {
  job *j = calloc(1, sizeof *j);
  for (int r = 0; r < ranks; r++) {
    ddp__flight_dump *d = &j->dumps[r];
    d->rank = r;
    d->world_size = world_size;
    d->pid = 1000 + r;
    d->dump_ns = 100 * S;
    d->dump_unix_ns = 1790000000 * S + r;
    d->groups = j->groups[r];
  }
  return j;
}

/* Adds group `name` (this rank's rank in it, its size) to rank r's dump. */
static ddp__flight_group *add_group(job *j, int r, const char *name, int rank, int size) {
  ddp__flight_dump *d = &j->dumps[r];
  ddp__flight_group *g = &j->groups[r][d->n_groups];
  g->records = j->records[r][d->n_groups];
  d->n_groups++;
  snprintf(g->name, sizeof g->name, "%s", name);
  g->rank = rank;
  g->size = size;
  g->dump_ns = d->dump_ns;
  return g;
}

/* Appends an operation to g: started at `start` seconds, ended at `end`
 * (< 0: still running); state completed when ended with status 0. */
static ddp__flight_record *add(ddp__flight_group *g, ddp__op_kind kind, uint64_t seq, uint64_t count, double start,
                               double end, ddp_status status) {
  ddp__flight_record *r = &g->records[g->n];
  memset(r, 0, sizeof *r);
  r->id = g->recorded++;
  g->n++;
  r->seq = seq;
  r->kind = kind;
  r->dtype = kind == DDP__OP_BARRIER ? -1 : DDP_FLOAT32;
  r->reduce_op = kind == DDP__OP_ALLREDUCE ? DDP_REDUCE_SUM : -1;
  r->root = kind == DDP__OP_BROADCAST ? 0 : -1;
  r->peer = -1;
  r->count = count;
  r->scheduled_ns = r->started_ns = (int64_t)(start * S);
  r->ended_ns = end < 0 ? -1 : (int64_t)(end * S);
  r->state = end < 0 ? DDP__FLIGHT_STARTED : status ? DDP__FLIGHT_FAILED : DDP__FLIGHT_COMPLETED;
  r->status = status;
  return r;
}

/* allreduces #1..#n of 2 floats, all completed. */
static void history(ddp__flight_group *g, uint64_t n) {
  for (uint64_t s = 1; s <= n; s++) add(g, DDP__OP_ALLREDUCE, s, 2, (double)s, (double)s + 0.001, DDP_OK);
}

static void expect(const job *j, int n, int world_size, const char *const *why, const char *want) {
  char *text = NULL;
  assert_int_equal(ddp__flight_verdict(j->dumps, (size_t)n, world_size, why, &text), DDP_OK);
  if (strcmp(text, want) != 0) fail_msg("verdict:\n%s\nexpected:\n%s", text, want);
  ddp_free(text);
}

static void test_skipped_collective(void **state) {
  (void)state;
  /* Ranks 0-1 wait in #5 (one still, one gave up after 30 s); rank 2
   * completed #4 and never called #5. */
  job *j = job_new(3, 3);
  for (int r = 0; r < 3; r++) history(add_group(j, r, "pg/1/", r, 3), 4);
  add(&j->groups[0][0], DDP__OP_ALLREDUCE, 5, 29696, 70, 100, DDP_ERR_TIMEOUT);
  add(&j->groups[1][0], DDP__OP_ALLREDUCE, 5, 29696, 70, -1, DDP_OK);
  expect(j, 3, 3, NULL,
         "rank 2 never entered allreduce #5 (116 KiB); ranks 0-1 waited 30 s in it\n"
         "  rank 2: last collective allreduce #4 (8 B), completed\n");
  free(j);
}

static void test_mismatched_collective(void **state) {
  (void)state;
  job *j = job_new(4, 4);
  for (int r = 0; r < 4; r++) history(add_group(j, r, "pg/1/", r, 4), 4);
  add(&j->groups[0][0], DDP__OP_ALLREDUCE, 5, 2, 90, -1, DDP_OK);
  add(&j->groups[1][0], DDP__OP_ALLREDUCE, 5, 2, 90, -1, DDP_OK);
  add(&j->groups[2][0], DDP__OP_BROADCAST, 5, 10, 90, -1, DDP_OK);
  add(&j->groups[3][0], DDP__OP_ALLREDUCE, 5, 2, 90, -1, DDP_OK);
  expect(j, 4, 4, NULL,
         "collective #5 mismatch: rank 2 called broadcast(count=10, float32, root=0) but ranks 0-1, 3 called "
         "allreduce(count=2, float32, sum)\n");
  /* The same count and dtype but another reduce op is a mismatch too. */
  j->records[2][0][4].kind = DDP__OP_ALLREDUCE;
  j->records[2][0][4].root = -1;
  j->records[2][0][4].count = 2;
  j->records[2][0][4].reduce_op = DDP_REDUCE_MAX;
  expect(j, 4, 4, NULL,
         "collective #5 mismatch: rank 2 called allreduce(count=2, float32, max) but ranks 0-1, 3 called "
         "allreduce(count=2, float32, sum)\n");
  free(j);
}

static void test_missing_dump(void **state) {
  (void)state;
  /* Rank 2 of 3 left no dump: stopped, so the launcher says why. */
  job *j = job_new(2, 3);
  for (int r = 0; r < 2; r++) {
    ddp__flight_group *g = add_group(j, r, "pg/1/", r, 3);
    history(g, 4);
    add(g, DDP__OP_ALLREDUCE, 5, 2, 98, 100, DDP_ERR_TIMEOUT);
  }
  const char *why[3] = {NULL, NULL, "it is stopped"};
  expect(j, 2, 3, why,
         "no dump from rank 2: it is stopped\n"
         "ranks 0-1 waited 2 s in allreduce #5 (8 B); no dump from rank 2\n");
  /* Without the world's size (ddp-debug on files without WORLD_SIZE), the
   * group's size still shows the missing rank. */
  j->dumps[0].world_size = j->dumps[1].world_size = -1;
  expect(j, 2, -1, NULL, "ranks 0-1 waited 2 s in allreduce #5 (8 B); no dump from rank 2\n");
  /* A rank that never entered, and another without a dump. */
  job *k = job_new(3, 4);
  for (int r = 0; r < 3; r++) history(add_group(k, r, "pg/1/", r, 4), 4);
  add(&k->groups[0][0], DDP__OP_ALLREDUCE, 5, 2, 99, -1, DDP_OK);
  add(&k->groups[2][0], DDP__OP_ALLREDUCE, 5, 2, 99, -1, DDP_OK);
  expect(k, 3, 4, NULL,
         "no dump from rank 3\n"
         "rank 1 never entered allreduce #5 (8 B); ranks 0, 2 waited 1 s in it; no dump from rank 3\n"
         "  rank 1: last collective allreduce #4 (8 B), completed\n");
  free(j);
  free(k);
}

static void test_point_to_point(void **state) {
  (void)state;
  /* Rank 0 sends to rank 1, which is not receiving; rank 2 waits in a recv
   * from rank 3, which left no dump. */
  job *j = job_new(3, 4);
  for (int r = 0; r < 3; r++) history(add_group(j, r, "pg/1/", r, 4), 2);
  ddp__flight_record *s = add(&j->groups[0][0], DDP__OP_SEND, 3, 1024, 95, -1, DDP_OK);
  s->peer = 1;
  s->tag = 7;
  ddp__flight_record *rv = add(&j->groups[2][0], DDP__OP_RECV, 1, 4, 90, 100, DDP_ERR_TIMEOUT);
  rv->peer = 3;
  expect(j, 3, 4, NULL,
         "no dump from rank 3\n"
         "rank 0 waited 5 s in send #3 to rank 1 (4 KiB, tag 7); rank 1 was in no operation of this group\n"
         "rank 2 gave up after 10 s in recv #1 from rank 3 (16 B, tag 0); no dump from rank 3\n");
  /* With rank 1 in a collective instead, the send line says so. */
  add(&j->groups[1][0], DDP__OP_BARRIER, 3, 0, 99, -1, DDP_OK);
  expect(j, 3, 4, NULL,
         "no dump from rank 3\n"
         "ranks 0, 2 never entered barrier #3; rank 1 waited 1 s in it; no dump from rank 3\n"
         "  ranks 0, 2: last collective allreduce #2 (8 B), completed\n"
         "rank 0 waited 5 s in send #3 to rank 1 (4 KiB, tag 7); rank 1 was in barrier #3\n"
         "rank 2 gave up after 10 s in recv #1 from rank 3 (16 B, tag 0); no dump from rank 3\n");
  free(j);
}

static void test_all_inside_or_done(void **state) {
  (void)state;
  /* Every rank entered #5 and none completed it. */
  job *j = job_new(2, 2);
  for (int r = 0; r < 2; r++) {
    ddp__flight_group *g = add_group(j, r, "pg/1/", r, 2);
    history(g, 4);
    add(g, DDP__OP_ALLREDUCE, 5, 2, 40, -1, DDP_OK);
  }
  expect(j, 2, 2, NULL,
         "ranks 0-1 waited 60 s in allreduce #5 (8 B); every rank entered it and none completed it\n");
  /* One completed it (its buffer was delivered) while the other still waits. */
  j->records[1][0][4].state = DDP__FLIGHT_COMPLETED;
  j->records[1][0][4].ended_ns = 41 * S;
  expect(j, 2, 2, NULL, "rank 0 waited 60 s in allreduce #5 (8 B); rank 1 completed it\n");
  /* Nothing pending. */
  j->records[0][0][4].state = DDP__FLIGHT_COMPLETED;
  j->records[0][0][4].ended_ns = 41 * S;
  expect(j, 2, 2, NULL, "no operation was pending: every rank with a dump completed allreduce #5 (8 B)\n");
  /* No records at all. */
  job *e = job_new(2, 2);
  add_group(e, 0, "pg/1/", 0, 2);
  add_group(e, 1, "pg/1/", 1, 2);
  expect(e, 2, 2, NULL, "");
  free(j);
  free(e);
}

static void test_subgroup(void **state) {
  (void)state;
  /* The world completed #3; in the split's pair c1 (world ranks 2 and 3,
   * group ranks 0 and 1) rank 1 never entered #2. Ranks are the group's. */
  job *j = job_new(4, 4);
  for (int r = 0; r < 4; r++) history(add_group(j, r, "pg/1/", r, 4), 3);
  for (int r = 2; r < 4; r++) {
    ddp__flight_group *g = add_group(j, r, "pg/1/sub/1/c1/", r - 2, 2);
    history(g, 1);
    if (r == 2) add(g, DDP__OP_ALLREDUCE, 2, 2, 50, -1, DDP_OK);
  }
  for (int r = 0; r < 2; r++) history(add_group(j, r, "pg/1/sub/1/c0/", r, 2), 2);
  expect(j, 4, 4, NULL,
         "group pg/1/: no operation was pending: every rank with a dump completed allreduce #3 (8 B)\n"
         "group pg/1/sub/1/c1/: rank 1 never entered allreduce #2 (8 B); rank 0 waited 50 s in it\n"
         "group pg/1/sub/1/c1/:   rank 1: last collective allreduce #1 (8 B), completed\n");
  free(j);
}

static void test_newest_dump_counts(void **state) {
  (void)state;
  /* Rank 1 dumped twice (SIGUSR1 earlier, then its timeout): the older dump
   * has it in #4, the newer in #5 with rank 0. */
  job *j = job_new(3, 2);
  history(add_group(j, 0, "pg/1/", 0, 2), 4);
  add(&j->groups[0][0], DDP__OP_ALLREDUCE, 5, 2, 90, -1, DDP_OK);
  ddp__flight_group *old = add_group(j, 1, "pg/1/", 1, 2);
  history(old, 3);
  add(old, DDP__OP_ALLREDUCE, 4, 2, 20, -1, DDP_OK);
  j->dumps[1].dump_unix_ns -= 50 * S;
  j->dumps[2].rank = 1;
  ddp__flight_group *fresh = add_group(j, 2, "pg/1/", 1, 2);
  history(fresh, 4);
  add(fresh, DDP__OP_ALLREDUCE, 5, 2, 90, -1, DDP_OK);
  expect(j, 3, 2, NULL, "ranks 0-1 waited 10 s in allreduce #5 (8 B); every rank entered it and none completed it\n");
  /* In the other order of the files, the same. */
  ddp__flight_dump swap = j->dumps[1];
  j->dumps[1] = j->dumps[2];
  j->dumps[2] = swap;
  expect(j, 3, 2, NULL, "ranks 0-1 waited 10 s in allreduce #5 (8 B); every rank entered it and none completed it\n");
  free(j);
}

/* An NCCL group: collectives are numbered when handed to the GPU's stream
 * (enqueued), several at once; where a rank stands is the oldest it has
 * not completed. */
static void test_device_stream(void **state) {
  (void)state;
  /* Rank 0 handed over #5 and #6; #5 started on its GPU 60 s before the
   * dump and waits; rank 1 is still computing after #4. */
  job *j = job_new(2, 2);
  for (int r = 0; r < 2; r++) history(add_group(j, r, "pg/1/", r, 2), 4);
  add(&j->groups[0][0], DDP__OP_ALLREDUCE, 5, 2, 40, -1, DDP_OK);
  ddp__flight_record *six = add(&j->groups[0][0], DDP__OP_ALLREDUCE, 6, 2, 41, -1, DDP_OK);
  six->state = DDP__FLIGHT_ENQUEUED;
  six->started_ns = -1;
  expect(j, 2, 2, NULL,
         "rank 1 never entered allreduce #5 (8 B); rank 0 waited 60 s in it\n"
         "  rank 1: last collective allreduce #4 (8 B), completed\n");
  /* Both ranks handed #5 over and neither GPU started it (queued behind
   * other work): they waited from the hand-over, 50 s and 30 s. */
  job *k = job_new(2, 2);
  for (int r = 0; r < 2; r++) {
    ddp__flight_group *g = add_group(k, r, "pg/1/", r, 2);
    history(g, 4);
    ddp__flight_record *five = add(g, DDP__OP_ALLREDUCE, 5, 2, r == 0 ? 50 : 70, -1, DDP_OK);
    five->state = DDP__FLIGHT_ENQUEUED;
    five->started_ns = -1;
  }
  expect(k, 2, 2, NULL,
         "ranks 0-1 waited 50 s in allreduce #5 (8 B); every rank entered it and none completed it\n");
  /* A batch of sends and receives still queued on rank 1's GPU. */
  ddp__flight_record *b = add(&k->groups[1][0], DDP__OP_P2P_BATCH, 1, 4, 80, -1, DDP_OK);
  b->state = DDP__FLIGHT_ENQUEUED;
  b->started_ns = -1;
  char what[128];
  ddp__flight_describe(b, what, sizeof what);
  assert_string_equal(what, "batch_isend_irecv #1 (4 operations)");
  free(j);
  free(k);
}

static void test_describe(void **state) {
  (void)state;
  char out[64];
  ddp__flight_format_bytes(0, out, sizeof out);
  assert_string_equal(out, "0 B");
  ddp__flight_format_bytes(1023, out, sizeof out);
  assert_string_equal(out, "1023 B");
  ddp__flight_format_bytes(118784, out, sizeof out);
  assert_string_equal(out, "116 KiB");
  ddp__flight_format_bytes(3u << 20, out, sizeof out);
  assert_string_equal(out, "3 MiB");
  ddp__flight_format_bytes(1536ull << 20, out, sizeof out);
  assert_string_equal(out, "1.5 GiB");
  ddp__flight_record r = {.seq = 7, .kind = DDP__OP_ALLGATHER, .dtype = DDP_FLOAT64, .count = 3};
  assert_int_equal(ddp__flight_bytes(&r), 24);
  ddp__flight_describe(&r, out, sizeof out);
  assert_string_equal(out, "allgather #7 (24 B)");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_skipped_collective), cmocka_unit_test(test_mismatched_collective),
      cmocka_unit_test(test_missing_dump),       cmocka_unit_test(test_point_to_point),
      cmocka_unit_test(test_all_inside_or_done), cmocka_unit_test(test_subgroup),
      cmocka_unit_test(test_newest_dump_counts), cmocka_unit_test(test_describe),
      cmocka_unit_test(test_device_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
