/* data: samplers and the loader. Orders against their definitions, batches
 * against the bytes the test wrote (x == byte / 255), the same output for 0,
 * 1 and 3 workers, no allocation per batch, and shutdown in mid-epoch. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/data.h"
#include "data/idx_files.h"

/* The fixture: N images of H x W random bytes and labels, written as IDX. */
enum { N = 103, H = 4, W = 5, PIX = H * W };

typedef struct fixture {
  char dir[256];
  uint8_t pixels[N * PIX];
  uint8_t labels[N];
  ddp_dataset *ds;
} fixture;

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  tmpdir_make(f->dir, sizeof f->dir);
  uint64_t r = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < N * PIX; i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    f->pixels[i] = (uint8_t)(r >> 56);
  }
  for (int i = 0; i < N; i++) f->labels[i] = (uint8_t)((i * 7) % 10);
  char images[512], labels[512];
  snprintf(images, sizeof images, "%s/train-images-idx3-ubyte.gz", f->dir);
  snprintf(labels, sizeof labels, "%s/train-labels-idx1-ubyte", f->dir);
  const uint32_t idims[3] = {N, H, W}, ldims[1] = {N};
  write_idx_u8(images, 3, idims, f->pixels, sizeof f->pixels, 1);
  write_idx_u8(labels, 1, ldims, f->labels, sizeof f->labels, 0);
  if (ddp_dataset_open_idx_dir(&f->ds, f->dir, DDP_SPLIT_TRAIN) != DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    return -1;
  }
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  ddp_dataset_destroy(f->ds);
  tmpdir_remove(f->dir);
  free(f);
  return 0;
}

/* ---- Samplers -------------------------------------------------------------- */

static void test_sequential_sampler(void **state) {
  (void)state;
  ddp_sampler *s;
  assert_int_equal(ddp_sampler_create_sequential(&s, 17), DDP_OK);
  assert_string_equal(s->ops->name, "sequential");
  assert_int_equal(ddp_sampler_length(s), 17);
  int64_t idx[17];
  for (int epoch = 0; epoch < 3; epoch++) {
    ddp_sampler_set_epoch(s, epoch);
    assert_int_equal(ddp_sampler_fill(s, idx), DDP_OK);
    for (int i = 0; i < 17; i++) assert_int_equal(idx[i], i);
  }
  ddp_sampler_destroy(s);
}

static bool is_permutation(const int64_t *idx, int64_t n) {
  char *seen = calloc((size_t)n, 1);
  bool ok = true;
  for (int64_t i = 0; i < n && ok; i++) {
    if (idx[i] < 0 || idx[i] >= n || seen[idx[i]]) ok = false;
    else seen[idx[i]] = 1;
  }
  free(seen);
  return ok;
}

static void test_random_sampler(void **state) {
  (void)state;
  enum { M = 1000 };
  ddp_sampler *a, *b, *c;
  assert_int_equal(ddp_sampler_create_random(&a, M, 7), DDP_OK);
  assert_int_equal(ddp_sampler_create_random(&b, M, 7), DDP_OK);
  assert_int_equal(ddp_sampler_create_random(&c, M, 8), DDP_OK);
  static int64_t ia[M], ib[M], ic[M], identity[M];
  for (int i = 0; i < M; i++) identity[i] = i;
  ddp_sampler_set_epoch(a, 3);
  ddp_sampler_set_epoch(b, 3);
  assert_int_equal(ddp_sampler_fill(a, ia), DDP_OK);
  assert_int_equal(ddp_sampler_fill(b, ib), DDP_OK);
  assert_true(is_permutation(ia, M));
  assert_memory_equal(ia, ib, sizeof ia);           /* same seed + epoch: same order */
  assert_memory_not_equal(ia, identity, sizeof ia); /* actually shuffled */
  ddp_sampler_set_epoch(b, 4);
  assert_int_equal(ddp_sampler_fill(b, ib), DDP_OK);
  assert_true(is_permutation(ib, M));
  assert_memory_not_equal(ia, ib, sizeof ia); /* another epoch: another order */
  ddp_sampler_set_epoch(c, 3);
  assert_int_equal(ddp_sampler_fill(c, ic), DDP_OK);
  assert_memory_not_equal(ia, ic, sizeof ia); /* another seed: another order */
  /* Going back to epoch 3 reproduces it (the state is seed + epoch only). */
  ddp_sampler_set_epoch(b, 3);
  assert_int_equal(ddp_sampler_fill(b, ib), DDP_OK);
  assert_memory_equal(ia, ib, sizeof ia);
  ddp_sampler_destroy(a);
  ddp_sampler_destroy(b);
  ddp_sampler_destroy(c);
}

/* Uniformity: over 20000 epochs of 10 items, each item lands first about
 * 2000 times (binomial sigma 42; 5 sigma = 212). */
static void test_random_sampler_uniform(void **state) {
  (void)state;
  ddp_sampler *s;
  assert_int_equal(ddp_sampler_create_random(&s, 10, 1), DDP_OK);
  int first[10] = {0}, last[10] = {0};
  int64_t idx[10];
  for (int e = 0; e < 20000; e++) {
    ddp_sampler_set_epoch(s, e);
    assert_int_equal(ddp_sampler_fill(s, idx), DDP_OK);
    first[idx[0]]++;
    last[idx[9]]++;
  }
  for (int i = 0; i < 10; i++) {
    assert_true(abs(first[i] - 2000) < 212);
    assert_true(abs(last[i] - 2000) < 212);
  }
  ddp_sampler_destroy(s);
}

/* ---- Loader ---------------------------------------------------------------- */

/* Runs one epoch; checks every batch against the fixture's bytes and counts
 * how often each sample appears. Returns the number of batches. */
static int64_t check_epoch(const fixture *f, ddp_loader *l, int64_t batch_size, int *seen,
                           int64_t *last_size) {
  int64_t batches = 0;
  for (;;) {
    ddp_batch b;
    assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
    if (b.size == 0) break;
    assert_int_equal(b.index, batches);
    assert_true(b.size <= batch_size);
    assert_int_equal(b.x.dtype, DDP_FLOAT32);
    assert_int_equal(b.x.ndim, 4);
    assert_int_equal(b.x.shape[0], b.size);
    assert_int_equal(b.x.shape[1], 1);
    assert_int_equal(b.x.shape[2], H);
    assert_int_equal(b.x.shape[3], W);
    assert_int_equal(b.y.dtype, DDP_INT64);
    assert_int_equal(b.y.ndim, 1);
    assert_int_equal(b.y.shape[0], b.size);
    const float *x = ddp_tensor_f32(&b.x);
    const int64_t *y = ddp_tensor_i64(&b.y);
    for (int64_t s = 0; s < b.size; s++) {
      const int64_t i = b.indices[s];
      assert_true(i >= 0 && i < N);
      seen[i]++;
      assert_int_equal(y[s], f->labels[i]);
      for (int k = 0; k < PIX; k++) assert_true(x[s * PIX + k] == f->pixels[i * PIX + k] / 255.0f);
    }
    *last_size = b.size;
    batches++;
  }
  return batches;
}

static void test_loader_epoch_shuffle(void **state) {
  fixture *f = *state;
  for (int workers = 0; workers <= 2; workers += 2) {
    ddp_loader_config cfg = ddp_loader_defaults();
    cfg.batch_size = 10;
    cfg.shuffle = true;
    cfg.seed = 5;
    cfg.num_workers = workers;
    ddp_loader *l;
    assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
    assert_int_equal(ddp_loader_num_batches(l), 11);
    assert_int_equal(ddp_loader_num_samples(l), N);
    int64_t first_order[N];
    for (int epoch = 0; epoch < 2; epoch++) {
      assert_int_equal(ddp_loader_start_epoch(l, epoch), DDP_OK);
      int seen[N] = {0};
      int64_t last = 0;
      ddp_batch b;
      assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
      if (epoch == 0) memcpy(first_order, b.indices, 10 * sizeof(int64_t));
      else assert_memory_not_equal(first_order, b.indices, 10 * sizeof(int64_t));
      /* Restart: the batch just taken is abandoned, the epoch begins again. */
      assert_int_equal(ddp_loader_start_epoch(l, epoch), DDP_OK);
      assert_int_equal(check_epoch(f, l, 10, seen, &last), 11);
      assert_int_equal(last, 3);
      for (int i = 0; i < N; i++) assert_int_equal(seen[i], 1); /* each exactly once */
      /* After the end the loader keeps saying so. */
      assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
      assert_int_equal(b.size, 0);
    }
    ddp_loader_destroy(l);
  }
}

static void test_loader_drop_last(void **state) {
  fixture *f = *state;
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.batch_size = 10;
  cfg.drop_last = true;
  cfg.num_workers = 1;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_num_batches(l), 10);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  int seen[N] = {0};
  int64_t last = 0;
  assert_int_equal(check_epoch(f, l, 10, seen, &last), 10);
  assert_int_equal(last, 10);
  for (int i = 0; i < N; i++) assert_int_equal(seen[i], i < 100 ? 1 : 0); /* sequential */
  ddp_loader_destroy(l);
  /* A batch size that divides N exactly: no partial batch either way. */
  cfg.batch_size = N;
  cfg.drop_last = false;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_num_batches(l), 1);
  ddp_loader_destroy(l);
  cfg.batch_size = N + 1;
  cfg.drop_last = true;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_num_batches(l), 0);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  ddp_batch b;
  assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
  assert_int_equal(b.size, 0);
  ddp_loader_destroy(l);
}

/* Collects two epochs of output (x and y of every batch, in order). */
static void collect(const fixture *f, int workers, int prefetch, float *xs, int64_t *ys) {
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.batch_size = 8;
  cfg.shuffle = true;
  cfg.seed = 1234;
  cfg.num_workers = workers;
  cfg.prefetch = prefetch;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  for (int epoch = 0; epoch < 2; epoch++) {
    assert_int_equal(ddp_loader_start_epoch(l, epoch), DDP_OK);
    for (;;) {
      ddp_batch b;
      assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
      if (b.size == 0) break;
      memcpy(xs, b.x.data, (size_t)b.x.numel * sizeof(float));
      memcpy(ys, b.y.data, (size_t)b.size * sizeof(int64_t));
      xs += b.x.numel;
      ys += b.size;
    }
  }
  ddp_loader_destroy(l);
}

static void test_loader_workers_identical(void **state) {
  fixture *f = *state;
  static float x0[2 * N * PIX], x1[2 * N * PIX];
  static int64_t y0[2 * N], y1[2 * N];
  collect(f, 0, 0, x0, y0);
  const int workers[3] = {1, 3, 3}, prefetch[3] = {0, 0, 1};
  for (int c = 0; c < 3; c++) {
    memset(x1, 0, sizeof x1);
    memset(y1, 0, sizeof y1);
    collect(f, workers[c], prefetch[c], x1, y1);
    assert_memory_equal(x0, x1, sizeof x0);
    assert_memory_equal(y0, y1, sizeof y0);
  }
}

static void test_loader_normalize(void **state) {
  fixture *f = *state;
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.batch_size = 32;
  cfg.normalize = true;
  cfg.mean = 0.2860f; /* Fashion-MNIST's usual constants */
  cfg.std = 0.3530f;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  ddp_batch b;
  assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
  const float *x = ddp_tensor_f32(&b.x);
  for (int k = 0; k < 32 * PIX; k++) {
    double want = (f->pixels[k] / 255.0 - 0.2860) / 0.3530;
    assert_true(fabs(x[k] - want) < 1e-6);
  }
  ddp_loader_destroy(l);
  cfg.std = 0.0f;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_ERR_INVALID);
  assert_null(l);
}

static void test_loader_synthetic(void **state) {
  (void)state;
  ddp_dataset *toy, *reg;
  assert_int_equal(ddp_dataset_create_toydata(&toy, 1000), DDP_OK);
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.batch_size = 64;
  cfg.shuffle = true;
  cfg.num_workers = 2;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, toy, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  int64_t total = 0;
  for (;;) {
    ddp_batch b;
    assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
    if (b.size == 0) break;
    assert_int_equal(b.x.ndim, 2);
    assert_int_equal(b.x.shape[1], 32);
    for (int64_t s = 0; s < b.size; s++) {
      for (int k = 0; k < 32; k++) assert_true(ddp_tensor_f32(&b.x)[s * 32 + k] == (float)b.indices[s]);
      assert_int_equal(ddp_tensor_i64(&b.y)[s], b.indices[s] % 10);
    }
    total += b.size;
  }
  assert_int_equal(total, 1000);
  ddp_loader_destroy(l);
  ddp_dataset_destroy(toy);

  assert_int_equal(ddp_dataset_create_regression(&reg, 50, 3), DDP_OK);
  cfg.batch_size = 20;
  assert_int_equal(ddp_loader_create(&l, reg, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  ddp_batch b;
  assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
  assert_int_equal(b.x.ndim, 2);
  assert_int_equal(b.x.shape[0], 20);
  assert_int_equal(b.x.shape[1], 10);
  assert_int_equal(b.y.dtype, DDP_FLOAT32);
  assert_int_equal(b.y.ndim, 2);
  assert_int_equal(b.y.shape[1], 5);
  for (int64_t s = 0; s < b.size; s++) {
    float x[10], t[5];
    assert_int_equal(ddp_dataset_get(reg, b.indices[s], x, t), DDP_OK);
    assert_memory_equal(ddp_tensor_f32(&b.x) + s * 10, x, sizeof x);
    assert_memory_equal(ddp_tensor_f32(&b.y) + s * 5, t, sizeof t);
  }
  ddp_loader_destroy(l);
  ddp_dataset_destroy(reg);
}

/* After the first batch, epochs and batches allocate nothing. */
static void test_loader_no_allocation(void **state) {
  fixture *f = *state;
  for (int workers = 0; workers <= 2; workers++) {
    ddp_loader_config cfg = ddp_loader_defaults();
    cfg.batch_size = 7;
    cfg.shuffle = true;
    cfg.num_workers = workers;
    ddp_loader *l;
    assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
    assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
    ddp_batch b;
    assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
    const uint64_t before = ddp_alloc_count();
    int64_t batches = 0;
    for (int epoch = 0; epoch < 3; epoch++) {
      if (epoch) assert_int_equal(ddp_loader_start_epoch(l, epoch), DDP_OK);
      for (;;) {
        assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
        if (b.size == 0) break;
        batches++;
      }
    }
    assert_int_equal(batches, 14 + 15 + 15);
    assert_int_equal(ddp_alloc_count(), before);
    ddp_loader_destroy(l);
  }
}

/* Destroying a loader whose workers are mid-epoch (ring full, consumer gone)
 * stops and joins them; ctest's timeout catches a hang. */
static void test_loader_shutdown_mid_epoch(void **state) {
  fixture *f = *state;
  for (int round = 0; round < 20; round++) {
    ddp_loader_config cfg = ddp_loader_defaults();
    cfg.batch_size = 3;
    cfg.num_workers = 3;
    cfg.prefetch = 4;
    ddp_loader *l;
    assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
    assert_int_equal(ddp_loader_start_epoch(l, round), DDP_OK);
    ddp_batch b;
    for (int i = 0; i < round % 5; i++) {
      assert_int_equal(ddp_loader_next(l, &b), DDP_OK);
      assert_int_equal(b.index, i);
    }
    ddp_loader_destroy(l);
  }
  /* Workers that never saw an epoch stop too. */
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.num_workers = 4;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  ddp_batch b;
  assert_int_equal(ddp_loader_next(l, &b), DDP_ERR_STATE); /* no epoch yet */
  ddp_loader_destroy(l);
}

/* A sampler from outside the library, through the ops table: it returns
 * every sample twice, reversed, then one index out of range on epoch 1. */
typedef struct twice_sampler {
  ddp_sampler base;
  int64_t n, epoch;
} twice_sampler;

static void twice_set_epoch(ddp_sampler *s, int64_t epoch) { ((twice_sampler *)s)->epoch = epoch; }
static int64_t twice_length(const ddp_sampler *s) { return 2 * ((const twice_sampler *)s)->n; }
static ddp_status twice_fill(ddp_sampler *s, int64_t *idx) {
  const twice_sampler *t = (const twice_sampler *)s;
  for (int64_t i = 0; i < 2 * t->n; i++) idx[i] = t->n - 1 - i % t->n;
  if (t->epoch == 1) idx[5] = t->n;
  return DDP_OK;
}
static void twice_destroy(ddp_sampler *s) { free(s); }
static const ddp_sampler_ops twice_ops = {"twice", twice_set_epoch, twice_length, twice_fill,
                                          twice_destroy};

static void test_loader_custom_sampler(void **state) {
  fixture *f = *state;
  twice_sampler *ts = calloc(1, sizeof *ts);
  ts->base.ops = &twice_ops;
  ts->n = N;
  ddp_loader_config cfg = ddp_loader_defaults();
  cfg.batch_size = 50;
  cfg.shuffle = true; /* ignored: the sampler decides */
  cfg.num_workers = 2;
  cfg.sampler = &ts->base;
  ddp_loader *l;
  assert_int_equal(ddp_loader_create(&l, f->ds, &cfg), DDP_OK);
  assert_int_equal(ddp_loader_num_samples(l), 2 * N);
  assert_int_equal(ddp_loader_num_batches(l), 5);
  assert_int_equal(ddp_loader_start_epoch(l, 0), DDP_OK);
  int seen[N] = {0};
  int64_t last = 0;
  assert_int_equal(check_epoch(f, l, 50, seen, &last), 5);
  assert_int_equal(last, 2 * N - 200);
  for (int i = 0; i < N; i++) assert_int_equal(seen[i], 2);
  assert_int_equal(ddp_loader_start_epoch(l, 1), DDP_ERR_RANGE);
  assert_non_null(strstr(ddp_last_error(), "sampler twice gave index 103 at position 5"));
  ddp_batch b;
  assert_int_equal(ddp_loader_next(l, &b), DDP_ERR_STATE);
  ddp_loader_destroy(l);
  ddp_sampler_destroy(&ts->base); /* borrowed: the caller frees it */
}

/* ---- Allocation failures ------------------------------------------------
 * Every allocation in turn fails; each constructor must return
 * DDP_ERR_NOMEM with nothing leaked (AddressSanitizer's leak check in the
 * sanitizer build) and no thread left running. */
static int64_t allocs_left;

static void *failing_alloc(size_t bytes, void *user) {
  (void)user;
  if (allocs_left-- <= 0) return NULL;
  void *p = NULL;
  return posix_memalign(&p, 64, bytes ? (bytes + 63) & ~(size_t)63 : 64) == 0 ? p : NULL;
}

static void plain_free(void *p, void *user) {
  (void)user;
  free(p);
}

static void test_allocation_failures(void **state) {
  fixture *f = *state;
  const ddp_alloc_hooks hooks = {failing_alloc, plain_free, NULL};
  int failures = 0;
  for (int64_t budget = 0;; budget++) {
    allocs_left = budget;
    ddp_set_alloc_hooks(&hooks);
    ddp_dataset *ds = NULL;
    ddp_loader *l = NULL;
    ddp_status s = ddp_dataset_open_idx_dir(&ds, f->dir, DDP_SPLIT_TRAIN);
    if (s == DDP_OK) {
      ddp_loader_config cfg = ddp_loader_defaults();
      cfg.batch_size = 10;
      cfg.shuffle = true;
      cfg.num_workers = 2;
      s = ddp_loader_create(&l, ds, &cfg);
      if (s == DDP_OK) s = ddp_loader_start_epoch(l, 0);
    }
    ddp_set_alloc_hooks(NULL);
    ddp_loader_destroy(l);
    ddp_dataset_destroy(ds);
    if (s == DDP_OK) break;
    assert_int_equal(s, DDP_ERR_NOMEM);
    if (l) fail();
    failures++;
  }
  assert_true(failures >= 8); /* dataset, labels, loader, ring, threads... */
}

/* ddp_dataset_truncate keeps the first n samples: the same samples, fewer
 * of them; more than there are changes nothing; 0 is refused. */
static void test_truncate(void **state) {
  (void)state;
  ddp_dataset *ds;
  assert_int_equal(ddp_dataset_create_regression(&ds, 100, 5), DDP_OK);
  float x0[10], y0[5], x[10], y[5];
  assert_int_equal(ddp_dataset_get(ds, 9, x0, y0), DDP_OK);
  assert_int_equal(ddp_dataset_truncate(ds, 10), DDP_OK);
  assert_int_equal(ddp_dataset_size(ds), 10);
  assert_int_equal(ddp_dataset_get(ds, 9, x, y), DDP_OK);
  assert_memory_equal(x, x0, sizeof x);
  assert_memory_equal(y, y0, sizeof y);
  assert_int_not_equal(ddp_dataset_get(ds, 10, x, y), DDP_OK);
  assert_int_equal(ddp_dataset_truncate(ds, 1000), DDP_OK);
  assert_int_equal(ddp_dataset_size(ds), 10);
  assert_int_equal(ddp_dataset_truncate(ds, 0), DDP_ERR_INVALID);
  ddp_dataset_destroy(ds);
}

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, setup, teardown)
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_truncate),
      cmocka_unit_test(test_sequential_sampler),
      cmocka_unit_test(test_random_sampler),
      cmocka_unit_test(test_random_sampler_uniform),
      T(test_loader_epoch_shuffle),
      T(test_loader_drop_last),
      T(test_loader_workers_identical),
      T(test_loader_normalize),
      cmocka_unit_test(test_loader_synthetic),
      T(test_loader_no_allocation),
      T(test_loader_shutdown_mid_epoch),
      T(test_loader_custom_sampler),
      T(test_allocation_failures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
