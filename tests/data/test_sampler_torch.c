/* data: the samplers against PyTorch. The distributed and random samplers'
 * index lists must equal those PyTorch 1.13's DistributedSampler and
 * RandomSampler gave for the table of tests/fixtures/sampler_indices.txt
 * (scripts/make_sampler_fixture.py); MT19937 against the C++ standard's
 * value; the evaluation sampler visits every sample exactly once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/data.h"
#include "data/torch_random.h"

/* C++11 [rand.predef]: the 10000th consecutive output of a default-constructed
 * std::mt19937 (seed 5489) is 4123659995; its first is 3499211612. */
static void test_mt19937_standard_values(void **state) {
  (void)state;
  ddp__torch_generator mt, skip;
  ddp__torch_generator_seed(&mt, 5489);
  ddp__torch_generator_seed(&skip, 5489);
  uint32_t first = ddp__torch_generator_next(&mt), v = first;
  for (int i = 1; i < 10000; i++) v = ddp__torch_generator_next(&mt);
  assert_int_equal(first, 3499211612u);
  assert_int_equal(v, 4123659995u);
  /* discard lands on the same output from any starting point. */
  ddp__torch_generator_discard(&skip, 9999);
  assert_int_equal(ddp__torch_generator_next(&skip), 4123659995u);
  uint64_t offsets[] = {0, 1, 622, 623, 624, 625, 1247, 1248, 5000};
  for (size_t k = 0; k < sizeof offsets / sizeof *offsets; k++) {
    ddp__torch_generator a, b;
    ddp__torch_generator_seed(&a, 77);
    ddp__torch_generator_seed(&b, 77);
    for (int i = 0; i < 300; i++) (void)ddp__torch_generator_next(&a); /* start mid-block */
    for (int i = 0; i < 300; i++) (void)ddp__torch_generator_next(&b);
    ddp__torch_generator_discard(&a, offsets[k]);
    for (uint64_t i = 0; i < offsets[k]; i++) (void)ddp__torch_generator_next(&b);
    for (int i = 0; i < 700; i++) assert_int_equal(ddp__torch_generator_next(&a), ddp__torch_generator_next(&b));
  }
}

/* ---- The fixture ------------------------------------------------------------ */

static FILE *open_fixture(void) {
  const char *src = getenv("DDP_SOURCE_DIR");
  char path[1024];
  snprintf(path, sizeof path, "%s/tests/fixtures/sampler_indices.txt", src ? src : ".");
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("cannot open %s (regenerate with scripts/make_sampler_fixture.py)", path);
  return f;
}

static void test_fixture_index_lists(void **state) {
  (void)state;
  FILE *f = open_fixture();
  char kind[32];
  int cases = 0, distributed = 0, random = 0;
  int c;
  while ((c = fgetc(f)) != EOF) {
    if (c == '#') { /* a comment line */
      while ((c = fgetc(f)) != EOF && c != '\n') {}
      continue;
    }
    ungetc(c, f);
    long long n, replicas, rank, epoch, count;
    unsigned long long seed;
    int shuffle, drop_last;
    int got = fscanf(f, "%31s %lld %lld %lld %llu %lld %d %d %lld", kind, &n, &replicas, &rank,
                     &seed, &epoch, &shuffle, &drop_last, &count);
    if (got == EOF) break;
    assert_int_equal(got, 9);
    int64_t *want = malloc((size_t)(count + 1) * sizeof *want);
    for (long long i = 0; i < count; i++) assert_int_equal(fscanf(f, "%lld", (long long *)&want[i]), 1);
    ddp_sampler *s;
    if (!strcmp(kind, "distributed")) {
      ddp_distributed_sampler_options o = ddp_distributed_sampler_defaults(replicas, rank);
      o.shuffle = shuffle;
      o.seed = seed;
      o.drop_last = drop_last;
      assert_int_equal(ddp_sampler_create_distributed(&s, n, &o), DDP_OK);
      distributed++;
    } else {
      assert_string_equal(kind, "random");
      assert_int_equal(ddp_sampler_create_random(&s, n, seed), DDP_OK);
      /* RandomSampler's stream runs through the epochs before this one:
       * visit one of them first so both ways to reach `epoch` are checked. */
      if (epoch > 1) {
        int64_t *scratch = malloc((size_t)(n + 1) * sizeof *scratch);
        ddp_sampler_set_epoch(s, epoch - 1);
        assert_int_equal(ddp_sampler_fill(s, scratch), DDP_OK);
        free(scratch);
      }
      random++;
    }
    if (ddp_sampler_length(s) != count)
      fail_msg("%s N=%lld replicas=%lld rank=%lld drop_last=%d: length %lld, PyTorch %lld", kind,
               n, replicas, rank, drop_last, (long long)ddp_sampler_length(s), count);
    int64_t *got_idx = malloc((size_t)(count + 1) * sizeof *got_idx);
    ddp_sampler_set_epoch(s, epoch);
    uint64_t allocs = ddp_alloc_count();
    assert_int_equal(ddp_sampler_fill(s, got_idx), DDP_OK);
    assert_int_equal(ddp_alloc_count(), allocs); /* filling never allocates */
    for (long long i = 0; i < count; i++)
      if (got_idx[i] != want[i])
        fail_msg("%s N=%lld replicas=%lld rank=%lld seed=%llu epoch=%lld shuffle=%d "
                 "drop_last=%d: index %lld is %lld, PyTorch's is %lld",
                 kind, n, replicas, rank, seed, epoch, shuffle, drop_last, i,
                 (long long)got_idx[i], (long long)want[i]);
    ddp_sampler_destroy(s);
    free(got_idx);
    free(want);
    cases++;
  }
  fclose(f);
  /* The table as generated: a fixture cut short fails here. */
  assert_int_equal(cases, 36);
  assert_true(distributed > 20 && random > 4);
}

/* torch.randperm(10, generator=torch.Generator().manual_seed(0)), typed in
 * from PyTorch 1.13 (beside the fixture, a check readable at a glance). */
static void test_randperm_small(void **state) {
  (void)state;
  int64_t p[10];
  const int64_t want[10] = {4, 1, 7, 5, 3, 9, 0, 8, 6, 2};
  assert_int_equal(ddp_randperm(10, 0, p), DDP_OK);
  assert_memory_equal(p, want, sizeof want);
  assert_int_equal(ddp_randperm(-1, 0, p), DDP_ERR_INVALID);
}

/* ---- Definitions -------------------------------------------------------------- */

/* Padded: the ranks' lists interleaved are the epoch's order repeated from its
 * start; every sample appears at least once, none more than ceil(R / N) + 1
 * times. Evaluation: every sample exactly once across the ranks. */
static void test_cover(void **state) {
  (void)state;
  const int64_t sizes[] = {0, 1, 2, 5, 10, 11, 97};
  const int64_t worlds[] = {1, 2, 3, 4, 7};
  for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++) {
    for (size_t b = 0; b < sizeof worlds / sizeof *worlds; b++) {
      int64_t n = sizes[a], w = worlds[b];
      int *eval_seen = calloc((size_t)n + 1, sizeof *eval_seen);
      int *train_seen = calloc((size_t)n + 1, sizeof *train_seen);
      int64_t eval_total = 0, train_len = -1;
      for (int64_t r = 0; r < w; r++) {
        ddp_sampler *e, *t;
        assert_int_equal(ddp_sampler_create_distributed_eval(&e, n, w, r), DDP_OK);
        ddp_distributed_sampler_options o = ddp_distributed_sampler_defaults(w, r);
        o.seed = 3;
        assert_int_equal(ddp_sampler_create_distributed(&t, n, &o), DDP_OK);
        int64_t idx[128];
        ddp_sampler_set_epoch(e, 2);
        assert_int_equal(ddp_sampler_fill(e, idx), DDP_OK);
        for (int64_t k = 0; k < ddp_sampler_length(e); k++) {
          assert_true(idx[k] >= 0 && idx[k] < n);
          assert_int_equal(idx[k] % w, r); /* strided */
          eval_seen[idx[k]]++;
        }
        eval_total += ddp_sampler_length(e);
        /* Every training rank has the same length. */
        if (train_len < 0) train_len = ddp_sampler_length(t);
        assert_int_equal(ddp_sampler_length(t), train_len);
        ddp_sampler_set_epoch(t, 2);
        assert_int_equal(ddp_sampler_fill(t, idx), DDP_OK);
        for (int64_t k = 0; k < train_len; k++) {
          assert_true(idx[k] >= 0 && idx[k] < n);
          train_seen[idx[k]]++;
        }
        ddp_sampler_destroy(e);
        ddp_sampler_destroy(t);
      }
      assert_int_equal(eval_total, n);
      assert_int_equal(train_len, (n + w - 1) / w);
      for (int64_t i = 0; i < n; i++) {
        assert_int_equal(eval_seen[i], 1);
        assert_true(train_seen[i] >= 1 && train_seen[i] <= (w + n - 1) / n + 1);
      }
      free(eval_seen);
      free(train_seen);
    }
  }
}

/* Indices of rank r of world w in epoch `epoch` (resumed after `consumed`
 * positions when consumed >= 0) into idx; returns how many. */
static int64_t shard(int64_t n, int64_t w, int64_t r, int64_t epoch, int64_t consumed, int64_t *idx) {
  ddp_sampler *t;
  ddp_distributed_sampler_options o = ddp_distributed_sampler_defaults(w, r);
  o.seed = 11;
  assert_int_equal(ddp_sampler_create_distributed(&t, n, &o), DDP_OK);
  if (consumed >= 0) assert_int_equal(ddp_sampler_distributed_resume(t, epoch, consumed), DDP_OK);
  ddp_sampler_set_epoch(t, epoch);
  int64_t len = ddp_sampler_length(t);
  assert_int_equal(ddp_sampler_fill(t, idx), DDP_OK);
  /* Another epoch is whole again. */
  ddp_sampler_set_epoch(t, epoch + 1);
  assert_int_equal(ddp_sampler_length(t), (n + w - 1) / w);
  ddp_sampler_destroy(t);
  return len;
}

/* An epoch begun at world w1 (k steps of batch b per rank) and finished at
 * world w2: every sample of the epoch is seen once across the two runs, but
 * the padding's repeats at its end (each of those a sample seen before);
 * the resumed shards have equal lengths; and at w2 = w1 the resumed shard is
 * exactly the uninterrupted epoch's tail (the same-world resume of before). */
static void test_resume_other_world(void **state) {
  (void)state;
  const int64_t n = 60;
  const int64_t cases[][4] = {{3, 2, 4, 2}, {3, 1, 2, 4}, {2, 3, 7, 3}, {4, 2, 3, 4}, {3, 3, 2, 3}, {2, 2, 12, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    const int64_t w1 = cases[c][0], k = cases[c][1], b = cases[c][2], w2 = cases[c][3];
    const int64_t consumed = w1 * k * b;
    int seen[60] = {0};
    int64_t idx[128];
    for (int64_t r = 0; r < w1; r++) {
      int64_t len = shard(n, w1, r, 1, -1, idx);
      assert_true(len >= k * b);
      for (int64_t i = 0; i < k * b; i++) seen[idx[i]]++;
    }
    int64_t total = consumed, len2 = -1;
    for (int64_t r = 0; r < w2; r++) {
      int64_t len = shard(n, w2, r, 1, consumed, idx);
      if (len2 < 0) len2 = len;
      assert_int_equal(len, len2);
      for (int64_t i = 0; i < len; i++) seen[idx[i]]++;
      total += len;
      if (w2 == w1) { /* the tail of the uninterrupted shard */
        int64_t whole[128];
        int64_t wlen = shard(n, w1, r, 1, -1, whole);
        assert_int_equal(len, wlen - k * b);
        for (int64_t i = 0; i < len; i++) assert_int_equal(idx[i], whole[k * b + i]);
      }
    }
    /* Padding: up to w2 - 1 positions past N, each a repeat. */
    int64_t repeats = total - n;
    assert_true(repeats >= 0 && repeats < w2);
    for (int64_t i = 0; i < n; i++) assert_true(seen[i] == 1 || (seen[i] == 2 && repeats > 0));
  }
  /* Past the end: nothing left; the evaluation sampler does not resume. */
  int64_t idx[128];
  assert_int_equal(shard(n, 2, 0, 1, 70, idx), 0);
  ddp_sampler *e;
  assert_int_equal(ddp_sampler_create_distributed_eval(&e, 10, 2, 0), DDP_OK);
  assert_int_equal(ddp_sampler_distributed_resume(e, 0, 4), DDP_ERR_INVALID);
  ddp_sampler_destroy(e);
}

static void test_bad_options(void **state) {
  (void)state;
  ddp_sampler *s = (ddp_sampler *)1;
  ddp_distributed_sampler_options o = ddp_distributed_sampler_defaults(4, 4);
  assert_int_equal(ddp_sampler_create_distributed(&s, 10, &o), DDP_ERR_INVALID);
  assert_null(s);
  assert_non_null(strstr(ddp_last_error(), "rank 4"));
  o = ddp_distributed_sampler_defaults(0, 0);
  assert_int_equal(ddp_sampler_create_distributed(&s, 10, &o), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "num_replicas 0"));
  o = ddp_distributed_sampler_defaults(2, 0);
  assert_int_equal(ddp_sampler_create_distributed(&s, -1, &o), DDP_ERR_INVALID);
  assert_int_equal(ddp_sampler_create_distributed_eval(&s, 10, 2, -1), DDP_ERR_INVALID);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mt19937_standard_values),
      cmocka_unit_test(test_randperm_small),
      cmocka_unit_test(test_fixture_index_lists),
      cmocka_unit_test(test_cover),
      cmocka_unit_test(test_resume_other_world),
      cmocka_unit_test(test_bad_options),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
