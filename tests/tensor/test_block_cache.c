/* The caching allocator's bookkeeping (src/tensor/block_cache.c), on the
 * CPU with a counting malloc backend that can be given a capacity, so the
 * out-of-memory path runs too. The CUDA runtime puts cudaMalloc behind the
 * same code (tests/cuda/test_cuda_runtime.c checks it on a GPU). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/block_cache.h"

/* ---- A counting backend ---------------------------------------------------- */

#define FAKE_MAX_LIVE 8192

typedef struct fake_backend {
  size_t capacity; /* bytes it may hold at once; 0: unlimited */
  size_t held;
  uint64_t allocs, frees, failures;
  void *live[FAKE_MAX_LIVE];
  size_t live_size[FAKE_MAX_LIVE];
  int n_live;
} fake_backend;

static void *fake_alloc(void *ctx, size_t bytes) {
  fake_backend *f = ctx;
  if ((f->capacity && f->held + bytes > f->capacity) || f->n_live == FAKE_MAX_LIVE) {
    f->failures++;
    ddp_error(DDP_ERR_NOMEM, "fake: over capacity (%zu held, %zu asked)", f->held, bytes);
    return NULL;
  }
  void *p = aligned_alloc(512, bytes);
  if (!p) {
    ddp_error(DDP_ERR_NOMEM, "fake: malloc failed");
    return NULL;
  }
  f->live[f->n_live] = p;
  f->live_size[f->n_live++] = bytes;
  f->held += bytes;
  f->allocs++;
  return p;
}

static void fake_free(void *ctx, void *ptr) {
  fake_backend *f = ctx;
  for (int i = 0; i < f->n_live; i++) {
    if (f->live[i] != ptr) continue;
    f->held -= f->live_size[i];
    f->live[i] = f->live[f->n_live - 1];
    f->live_size[i] = f->live_size[f->n_live - 1];
    f->n_live--;
    f->frees++;
    free(ptr);
    return;
  }
  fail_msg("fake: the cache freed %p, which the backend never gave", ptr);
}

static ddp__block_cache *cache_over(fake_backend *f) {
  ddp__block_backend backend = {"fake:0", fake_alloc, fake_free, f};
  ddp__block_cache *c = NULL;
  assert_int_equal(ddp__block_cache_create(&backend, &c), DDP_OK);
  assert_non_null(c);
  return c;
}

static ddp__block_stats stats_of(ddp__block_cache *c) {
  ddp__block_stats s;
  ddp__block_cache_stats(c, &s);
  return s;
}

#define MiB ((size_t)1 << 20)

/* ---- Tests ------------------------------------------------------------------ */

static void test_rounding(void **state) {
  (void)state;
  assert_int_equal(ddp__block_round(0), 512);
  assert_int_equal(ddp__block_round(1), 512);
  assert_int_equal(ddp__block_round(512), 512);
  assert_int_equal(ddp__block_round(513), 1024);
  assert_int_equal(ddp__block_round(MiB - 1), MiB);
  assert_int_equal(ddp__block_round(MiB), MiB);
  assert_int_equal(ddp__block_round(MiB + 1), 2 * MiB);
  assert_int_equal(ddp__block_round(3 * MiB), 4 * MiB);
  assert_int_equal(ddp__block_round(4 * MiB), 4 * MiB);
  assert_int_equal(ddp__block_round(SIZE_MAX), 0);
  assert_int_equal(ddp__block_round(SIZE_MAX - MiB), 0);

  /* The backend is asked for the class, and the cache reports it. */
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  void *p = ddp__block_cache_alloc(c, 700);
  void *q = ddp__block_cache_alloc(c, 3 * MiB + 5);
  assert_non_null(p);
  assert_non_null(q);
  assert_int_equal(f.held, 1024 + 4 * MiB);
  assert_int_equal(ddp__block_cache_size(c, p), 1024);
  assert_int_equal(ddp__block_cache_size(c, q), 4 * MiB);
  assert_int_equal(ddp__block_cache_size(c, (char *)p + 512), 0);
  /* 0 bytes is a real, distinct block. */
  void *z0 = ddp__block_cache_alloc(c, 0), *z1 = ddp__block_cache_alloc(c, 0);
  assert_non_null(z0);
  assert_non_null(z1);
  assert_ptr_not_equal(z0, z1);
  /* Too large to round: an error, not a wrapped tiny block. */
  assert_null(ddp__block_cache_alloc(c, SIZE_MAX - 3));
  assert_non_null(strstr(ddp_last_error(), "fake:0: cannot allocate"));
  assert_int_equal(f.allocs, 4);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

/* A training step's pattern: the same requests every step, freed at its
 * end. Only the first step reaches the backend. */
static void test_steady_cycle_reuses(void **state) {
  (void)state;
  static const size_t sizes[] = {100, 4000, 4000, 70000, 3 * MiB, 0, 513, 9 * MiB + 1};
  enum { N = sizeof sizes / sizeof sizes[0] };
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  void *first[N], *p[N];
  for (int step = 0; step < 20; step++) {
    for (int i = 0; i < N; i++) {
      p[i] = ddp__block_cache_alloc(c, sizes[i]);
      assert_non_null(p[i]);
      memset(p[i], step, sizes[i]); /* the whole request is usable */
      if (step == 0) first[i] = p[i];
    }
    for (int i = 0; i < N; i++) {
      bool known = false;
      for (int j = 0; j < N; j++) known |= p[i] == first[j];
      if (!known) fail_msg("step %d: request %d got a block step 0 did not have", step, i);
    }
    /* Free in another order than allocated: the cache does not care. */
    for (int i = N - 1; i >= 0; i--) assert_int_equal(ddp__block_cache_free(c, p[i]), DDP_OK);
    assert_int_equal(f.allocs, N);
  }
  ddp__block_stats s = stats_of(c);
  assert_int_equal(s.driver_allocs, N);
  assert_int_equal(s.requests, 20 * N);
  assert_int_equal(s.hits, 19 * N);
  assert_int_equal(f.frees, 0);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

static void test_stats(void **state) {
  (void)state;
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  void *a = ddp__block_cache_alloc(c, 1000);    /* 1024 */
  void *b = ddp__block_cache_alloc(c, 5 * MiB); /* 6 MiB */
  ddp__block_stats s = stats_of(c);
  assert_int_equal(s.bytes_in_use, 1024 + 6 * MiB);
  assert_int_equal(s.bytes_reserved, 1024 + 6 * MiB);
  assert_int_equal(s.blocks_in_use, 2);
  assert_int_equal(s.blocks_cached, 0);
  assert_int_equal(s.driver_allocs, 2);
  assert_int_equal(ddp__block_cache_free(c, b), DDP_OK);
  s = stats_of(c);
  assert_int_equal(s.bytes_in_use, 1024);
  assert_int_equal(s.bytes_reserved, 1024 + 6 * MiB);
  assert_int_equal(s.blocks_cached, 1);
  /* Emptying gives back the cached block, not the one in use. */
  ddp__block_cache_empty(c);
  s = stats_of(c);
  assert_int_equal(s.bytes_reserved, 1024);
  assert_int_equal(s.blocks_cached, 0);
  assert_int_equal(s.driver_frees, 1);
  assert_int_equal(s.flushes, 1);
  assert_int_equal(f.held, 1024);
  assert_true(ddp__block_cache_contains(c, a));
  assert_false(ddp__block_cache_contains(c, b));
  assert_int_equal(ddp__block_cache_free(c, a), DDP_OK);
  s = stats_of(c);
  assert_int_equal(s.bytes_in_use, 0);
  assert_int_equal(s.blocks_in_use, 0);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

/* A cached block serves a smaller class when it wastes at most 1/8 of the
 * request, the smallest such block first; a bigger waste goes to the
 * backend. */
static void test_best_fit_bounded_waste(void **state) {
  (void)state;
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  void *b18 = ddp__block_cache_alloc(c, 18 * MiB);
  void *b20 = ddp__block_cache_alloc(c, 20 * MiB);
  void *s9 = ddp__block_cache_alloc(c, 9 * 512);
  assert_int_equal(ddp__block_cache_free(c, b20), DDP_OK);
  assert_int_equal(ddp__block_cache_free(c, b18), DDP_OK);
  assert_int_equal(ddp__block_cache_free(c, s9), DDP_OK);
  assert_int_equal(f.allocs, 3);
  /* 16 MiB: 18 wastes 2 MiB = 16/8 (taken, before 20); 14 MiB: 18 would
   * waste 4 MiB > 1.75 (a new block). */
  void *p16 = ddp__block_cache_alloc(c, 16 * MiB);
  assert_ptr_equal(p16, b18);
  void *p14 = ddp__block_cache_alloc(c, 14 * MiB);
  assert_ptr_not_equal(p14, b20);
  assert_int_equal(f.allocs, 4);
  /* 18 MiB again: the 20 MiB block (2 <= 18/8). */
  assert_ptr_equal(ddp__block_cache_alloc(c, 18 * MiB), b20);
  /* 4096: the 4608 block (512 <= 4096/8); 3584: 1024 > 448, a new one. */
  assert_ptr_equal(ddp__block_cache_alloc(c, 4096), s9);
  assert_int_equal(ddp__block_cache_free(c, s9), DDP_OK);
  assert_ptr_not_equal(ddp__block_cache_alloc(c, 3584), s9);
  assert_int_equal(f.allocs, 5);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

/* The backend fails: the cache gives back its free blocks and asks again;
 * blocks in use are untouched. When nothing helps, NULL and a message. */
static void test_out_of_memory_empties_and_retries(void **state) {
  (void)state;
  fake_backend f = {.capacity = 8 * MiB};
  ddp__block_cache *c = cache_over(&f);
  char *keep = ddp__block_cache_alloc(c, 2 * MiB);
  void *a = ddp__block_cache_alloc(c, 2 * MiB + 1); /* 4 MiB */
  void *small = ddp__block_cache_alloc(c, 100);
  assert_non_null(keep);
  assert_non_null(a);
  assert_non_null(small);
  memset(keep, 0x5a, 2 * MiB);
  assert_int_equal(ddp__block_cache_free(c, a), DDP_OK);
  assert_int_equal(ddp__block_cache_free(c, small), DDP_OK);
  /* 6 MiB fits only once the cached 4 MiB (and 512) are given back. */
  void *big = ddp__block_cache_alloc(c, 6 * MiB);
  assert_non_null(big);
  ddp__block_stats s = stats_of(c);
  assert_int_equal(s.driver_failures, 1);
  assert_int_equal(s.flushes, 1);
  assert_int_equal(s.driver_frees, 2);
  assert_int_equal(s.blocks_cached, 0);
  assert_int_equal(s.bytes_reserved, 8 * MiB);
  assert_int_equal(f.held, 8 * MiB);
  for (size_t i = 0; i < 2 * MiB; i++)
    if ((unsigned char)keep[i] != 0x5a) fail_msg("byte %zu of a block in use changed", i);
  assert_true(ddp__block_cache_contains(c, keep));

  /* Full and nothing cached: one failure, no pointless retry, an error
   * naming the cache, the request and the backend's reason. */
  ddp_clear_error();
  assert_null(ddp__block_cache_alloc(c, 1000));
  s = stats_of(c);
  assert_int_equal(s.driver_failures, 2);
  assert_int_equal(s.flushes, 1);
  const char *msg = ddp_last_error();
  assert_non_null(strstr(msg, "fake:0: cannot allocate 1000 bytes"));
  assert_non_null(strstr(msg, "8388608 in use"));
  assert_non_null(strstr(msg, "fake: over capacity"));

  /* Full with cached blocks that do not help: emptied, retried, NULL. */
  assert_int_equal(ddp__block_cache_free(c, keep), DDP_OK);
  assert_null(ddp__block_cache_alloc(c, 4 * MiB));
  s = stats_of(c);
  assert_int_equal(s.driver_failures, 4);
  assert_int_equal(s.flushes, 2);
  assert_int_equal(s.bytes_reserved, 6 * MiB);
  assert_int_equal(s.bytes_in_use, 6 * MiB);
  assert_int_equal(ddp__block_cache_free(c, big), DDP_OK);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

static void test_bad_free_is_an_error(void **state) {
  (void)state;
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  int on_stack;
  /* An empty cache (no table yet) answers too. */
  assert_int_equal(ddp__block_cache_free(c, &on_stack), DDP_ERR_NOTFOUND);
  assert_int_equal(ddp__block_cache_free(c, NULL), DDP_OK);
  char *p = ddp__block_cache_alloc(c, 5000);
  assert_non_null(p);
  ddp__block_stats before = stats_of(c);
  assert_int_equal(ddp__block_cache_free(c, &on_stack), DDP_ERR_NOTFOUND);
  assert_non_null(strstr(ddp_last_error(), "fake:0: free of"));
  assert_non_null(strstr(ddp_last_error(), "did not hand out"));
  assert_int_equal(ddp__block_cache_free(c, p + 512), DDP_ERR_NOTFOUND);
  ddp__block_stats after = stats_of(c);
  assert_memory_equal(&before, &after, sizeof before);
  assert_int_equal(ddp__block_cache_free(c, p), DDP_OK);
  after = stats_of(c);
  assert_int_equal(ddp__block_cache_free(c, p), DDP_ERR_STATE);
  assert_non_null(strstr(ddp_last_error(), "double free"));
  assert_non_null(strstr(ddp_last_error(), "5120 bytes"));
  ddp__block_stats again = stats_of(c);
  assert_memory_equal(&after, &again, sizeof after);
  /* The block is still handed out once, not twice. */
  void *x = ddp__block_cache_alloc(c, 5000), *y = ddp__block_cache_alloc(c, 5000);
  assert_ptr_equal(x, p);
  assert_ptr_not_equal(y, p);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

/* Thousands of blocks of random sizes, freed in random order: distinct,
 * non-overlapping memory that keeps its contents, stats as a model says,
 * and the table and bins growing and shrinking through it all. Then the
 * same sizes again in another order all come from the cache: each request
 * finds a free block of exactly its class (there are as many as requests
 * of that class), so best fit never takes a bigger one. */
/* The first and last bytes of a block carry its index: an overlap shows. */
static void mark(void *p, int i, size_t bytes) {
  unsigned char *b = p;
  if (bytes >= 1) b[0] = (unsigned char)i;
  if (bytes >= 2) b[bytes - 1] = (unsigned char)(i >> 8);
}

static bool marked(const void *p, int i, size_t bytes) {
  const unsigned char *b = p;
  return (bytes < 1 || b[0] == (unsigned char)i) &&
         (bytes < 2 || b[bytes - 1] == (unsigned char)(i >> 8));
}

static void test_many_sizes(void **state) {
  (void)state;
  enum { N = 2000 };
  static void *ptrs[N];
  static size_t sizes[N];
  static int order[N];
  fake_backend *f = calloc(1, sizeof *f);
  assert_non_null(f);
  ddp__block_cache *c = cache_over(f);
  ddp_rng rng;
  ddp_rng_seed(&rng, 26);
  for (int i = 0; i < N; i++) {
    /* Mostly below 1 MiB (512-byte classes), 1 in 20 up to 6 MiB (2 MiB
     * classes; the fake's memory is barely touched, so cheap). */
    sizes[i] = ddp_rng_below(&rng, 20) ? (size_t)ddp_rng_below(&rng, 96 * 1024)
                                       : (size_t)ddp_rng_below(&rng, 6 * MiB);
    order[i] = i;
  }
  uint64_t model_in_use = 0;
  for (int round = 0; round < 2; round++) {
    uint64_t allocs_before = f->allocs;
    for (int k = 0; k < N; k++) {
      int i = order[k];
      ptrs[i] = ddp__block_cache_alloc(c, sizes[i]);
      assert_non_null(ptrs[i]);
      mark(ptrs[i], i, sizes[i]);
      model_in_use += ddp__block_round(sizes[i]);
      /* Free a random live one now and then, and allocate it again. */
      if (k % 7 == 6) {
        int j = order[ddp_rng_below(&rng, (uint64_t)k + 1)];
        assert_int_equal(ddp__block_cache_free(c, ptrs[j]), DDP_OK);
        model_in_use -= ddp__block_round(sizes[j]);
        ptrs[j] = ddp__block_cache_alloc(c, sizes[j]);
        assert_non_null(ptrs[j]);
        mark(ptrs[j], j, sizes[j]);
        model_in_use += ddp__block_round(sizes[j]);
      }
    }
    ddp__block_stats s = stats_of(c);
    assert_int_equal(s.bytes_in_use, model_in_use);
    assert_int_equal(s.blocks_in_use, N);
    assert_int_equal(s.bytes_reserved, f->held);
    assert_true(s.bytes_reserved >= s.bytes_in_use);
    if (round == 1) assert_int_equal(f->allocs, allocs_before);
    for (int i = 0; i < N; i++)
      if (!marked(ptrs[i], i, sizes[i]))
        fail_msg("round %d: block %d (%zu bytes) was overwritten", round, i, sizes[i]);
    /* Free in a random order; next round allocates in another. */
    for (int k = N - 1; k > 0; k--) {
      int j = (int)ddp_rng_below(&rng, (uint64_t)k + 1), t = order[k];
      order[k] = order[j];
      order[j] = t;
    }
    for (int k = 0; k < N; k++) {
      assert_int_equal(ddp__block_cache_free(c, ptrs[order[k]]), DDP_OK);
      model_in_use -= ddp__block_round(sizes[order[k]]);
    }
    s = stats_of(c);
    assert_int_equal(s.bytes_in_use, 0);
    assert_int_equal(s.blocks_cached, f->allocs - f->frees);
  }
  ddp__block_cache_empty(c);
  assert_int_equal(f->n_live, 0);
  assert_int_equal(stats_of(c).bytes_reserved, 0);
  ddp__block_cache_destroy(c);
  free(f);
}

/* Emptying the cache removes half of a big table's entries: every block
 * left is still found (the table's deletions keep its probe runs whole)
 * and every block given back is not. */
static void test_empty_keeps_the_rest(void **state) {
  (void)state;
  enum { N = 1500 };
  static void *ptrs[N];
  fake_backend *f = calloc(1, sizeof *f);
  assert_non_null(f);
  ddp__block_cache *c = cache_over(f);
  ddp_rng rng;
  ddp_rng_seed(&rng, 7);
  for (int i = 0; i < N; i++) {
    ptrs[i] = ddp__block_cache_alloc(c, (size_t)ddp_rng_below(&rng, 200000));
    assert_non_null(ptrs[i]);
  }
  for (int i = 0; i < N; i++)
    if (ddp_rng_below(&rng, 2)) {
      assert_int_equal(ddp__block_cache_free(c, ptrs[i]), DDP_OK);
      ptrs[i] = NULL;
    }
  uint64_t cached = stats_of(c).blocks_cached;
  ddp__block_cache_empty(c);
  assert_int_equal(f->frees, cached);
  for (int i = 0; i < N; i++) {
    if (!ptrs[i]) continue;
    if (!ddp__block_cache_contains(c, ptrs[i])) fail_msg("block %d lost by the emptying", i);
    assert_int_equal(ddp__block_cache_free(c, ptrs[i]), DDP_OK);
  }
  assert_int_equal(stats_of(c).bytes_in_use, 0);
  ddp__block_cache_empty(c);
  assert_int_equal(f->n_live, 0);
  assert_int_equal(stats_of(c).bytes_reserved, 0);
  ddp__block_cache_destroy(c);
  free(f);
}

/* Several threads allocating and freeing through one cache: the mutex keeps
 * the bookkeeping whole (and TSan quiet). */
typedef struct worker_arg {
  ddp__block_cache *cache;
  int id;
  int bad;
} worker_arg;

static void *worker(void *p) {
  worker_arg *a = p;
  void *mine[16];
  for (int round = 0; round < 200; round++) {
    for (int i = 0; i < 16; i++) {
      mine[i] = ddp__block_cache_alloc(a->cache, (size_t)(i + 1) * 700);
      if (!mine[i]) {
        a->bad++;
        continue;
      }
      memset(mine[i], a->id, (size_t)(i + 1) * 700);
    }
    for (int i = 0; i < 16; i++) {
      if (!mine[i]) continue;
      const unsigned char *b = mine[i];
      for (size_t k = 0; k < (size_t)(i + 1) * 700; k++)
        if (b[k] != (unsigned char)a->id) {
          a->bad++;
          break;
        }
      if (ddp__block_cache_free(a->cache, mine[i]) != DDP_OK) a->bad++;
    }
  }
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  fake_backend f = {0};
  ddp__block_cache *c = cache_over(&f);
  pthread_t threads[4];
  worker_arg args[4];
  for (int t = 0; t < 4; t++) {
    args[t] = (worker_arg){c, t + 1, 0};
    assert_int_equal(pthread_create(&threads[t], NULL, worker, &args[t]), 0);
  }
  for (int t = 0; t < 4; t++) {
    assert_int_equal(pthread_join(threads[t], NULL), 0);
    assert_int_equal(args[t].bad, 0);
  }
  ddp__block_stats s = stats_of(c);
  assert_int_equal(s.requests, 4 * 200 * 16);
  assert_int_equal(s.bytes_in_use, 0);
  /* Most requests came from the cache. */
  assert_true(s.driver_allocs < 200);
  ddp__block_cache_destroy(c);
  assert_int_equal(f.n_live, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rounding),
      cmocka_unit_test(test_steady_cycle_reuses),
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_best_fit_bounded_waste),
      cmocka_unit_test(test_out_of_memory_empties_and_retries),
      cmocka_unit_test(test_bad_free_is_an_error),
      cmocka_unit_test(test_many_sizes),
      cmocka_unit_test(test_empty_keeps_the_rest),
      cmocka_unit_test(test_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
