/* The CUDA runtime on a GPU (src/tensor/cuda/runtime.c, src/tensor/device.c,
 * device tensors in src/tensor/tensor.c): the caching allocator reuses
 * blocks (no cudaMalloc in a steady cycle), copies are bitwise, new device
 * memory is zeroed (checked on blocks dirtied first), the arena runs on
 * device memory, the cuBLAS handle is set up as documented, and errors
 * come back as statuses naming the device. Skips (77) without a GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "cuda/cuda_test.h"
#include "tensor/cuda/runtime.h"

#define GPU DDP_CUDA(0)
#define MiB ((size_t)1 << 20)

static ddp_rng rng;

static void fill_random(void *p, size_t bytes) {
  unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++) b[i] = (unsigned char)ddp_rng_next(&rng);
}

static ddp__cuda_mem_stats mem_stats(void) {
  ddp__cuda_mem_stats s;
  ddp__cuda_mem_stats_get(&s);
  return s;
}

static void sync_ok(void) {
  ddp_status st = ddp_device_synchronize(GPU);
  if (st != DDP_OK) fail_msg("synchronize: %s", ddp_last_error());
}

/* Device bytes at p, read back to the host. */
static void read_back(void *host, const void *dev, size_t bytes) {
  if (ddp__cuda_copy(host, dev, bytes, cudaMemcpyDeviceToHost) != DDP_OK)
    fail_msg("read back: %s", ddp_last_error());
}

/* Frees a block after filling it with 0xff: the next request of its class
 * gets it back dirty, so a zeroing that does not happen shows. */
static void free_dirty(size_t bytes) {
  void *p = ddp__cuda_malloc(bytes);
  assert_non_null(p);
  assert_int_equal(ddp__cuda_check(cudaMemsetAsync(p, 0xff, bytes, ddp__cuda_stream()), "dirty"),
                   DDP_OK);
  ddp__cuda_free(p);
}

static bool all_zero(const void *p, size_t bytes) {
  const unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i]) return false;
  return true;
}

/* A training step's requests, freed at its end: only the first step
 * reaches cudaMalloc. The memory is the device's own, not managed. */
static void test_malloc_reuse(void **state) {
  (void)state;
  assert_int_equal(ddp__cuda_set_device(0), DDP_OK);
  static const size_t sizes[] = {4, 1000, 65536, 3 * MiB, 0, 777777};
  enum { N = sizeof sizes / sizeof sizes[0] };
  ddp__cuda_mem_stats base = mem_stats();
  uint64_t after_first = 0;
  void *p[N];
  for (int step = 0; step < 10; step++) {
    for (int i = 0; i < N; i++) {
      p[i] = ddp__cuda_malloc(sizes[i]);
      if (!p[i]) fail_msg("ddp__cuda_malloc(%zu): %s", sizes[i], ddp_last_error());
      assert_int_equal((uintptr_t)p[i] % 256, 0);
      for (int j = 0; j < i; j++) assert_ptr_not_equal(p[i], p[j]);
    }
    if (step == 0) {
      struct cudaPointerAttributes attr;
      assert_int_equal(cudaPointerGetAttributes(&attr, p[3]), cudaSuccess);
      assert_int_equal(attr.type, cudaMemoryTypeDevice);
      assert_int_equal(attr.device, 0);
      assert_true(mem_stats().bytes_in_use >= base.bytes_in_use + 3 * MiB);
    }
    for (int i = 0; i < N; i++) ddp__cuda_free(p[i]);
    if (step == 0) after_first = mem_stats().driver_allocs;
    if (mem_stats().driver_allocs != after_first)
      fail_msg("step %d: cudaMalloc called %llu times, %llu after the first step", step,
               (unsigned long long)mem_stats().driver_allocs, (unsigned long long)after_first);
  }
  assert_true(after_first <= base.driver_allocs + N);
  assert_int_equal(mem_stats().bytes_in_use, base.bytes_in_use);
  sync_ok();
}

/* Host -> device -> device -> host, bitwise; pageable and pinned. */
static void test_copy_round_trip(void **state) {
  (void)state;
  const size_t bytes = MiB + 3;
  unsigned char *src = malloc(bytes), *dst = malloc(bytes);
  assert_non_null(src);
  assert_non_null(dst);
  fill_random(src, bytes);
  memset(dst, 0, bytes);
  void *a = ddp__cuda_malloc(bytes), *b = ddp__cuda_malloc(bytes);
  assert_non_null(a);
  assert_non_null(b);
  assert_int_equal(ddp__cuda_copy(a, src, bytes, cudaMemcpyHostToDevice), DDP_OK);
  assert_int_equal(ddp__cuda_copy(b, a, bytes, cudaMemcpyDeviceToDevice), DDP_OK);
  assert_int_equal(ddp__cuda_copy(dst, b, bytes, cudaMemcpyDeviceToHost), DDP_OK);
  assert_memory_equal(src, dst, bytes);

  unsigned char *pin_src = ddp__cuda_malloc_host(bytes), *pin_dst = ddp__cuda_malloc_host(bytes);
  assert_non_null(pin_src);
  assert_non_null(pin_dst);
  struct cudaPointerAttributes attr;
  assert_int_equal(cudaPointerGetAttributes(&attr, pin_src), cudaSuccess);
  assert_int_equal(attr.type, cudaMemoryTypeHost);
  fill_random(pin_src, bytes);
  memset(pin_dst, 0, bytes);
  assert_int_equal(ddp__cuda_copy(a, pin_src, bytes, cudaMemcpyHostToDevice), DDP_OK);
  assert_int_equal(ddp__cuda_copy(pin_dst, a, bytes, cudaMemcpyDeviceToHost), DDP_OK);
  assert_memory_equal(pin_src, pin_dst, bytes);
  assert_int_equal(ddp__cuda_copy(a, src, 0, cudaMemcpyHostToDevice), DDP_OK);
  ddp__cuda_free_host(pin_src);
  ddp__cuda_free_host(pin_dst);
  ddp__cuda_free(a);
  ddp__cuda_free(b);
  free(src);
  free(dst);
  sync_ok();
}

/* ddp_tensor_create_on and ensure_grad zero their device memory, even a
 * block that comes back dirty from the cache. */
static void test_create_on_zeroed(void **state) {
  (void)state;
  ddp__cuda_mem_stats base = mem_stats();
  const int64_t shape[2] = {1024, 4};
  const size_t bytes = 1024 * 4 * sizeof(float);
  free_dirty(bytes);
  ddp_tensor *t = NULL;
  if (ddp_tensor_create_on(&t, DDP_FLOAT32, 2, shape, GPU) != DDP_OK)
    fail_msg("create_on: %s", ddp_last_error());
  assert_true(ddp_device_equal(t->device, GPU));
  assert_true(t->flags & DDP_TENSOR_OWNS_DATA);
  assert_int_equal(t->numel, 4096);
  float *host = malloc(bytes);
  assert_non_null(host);
  memset(host, 0x7f, bytes);
  read_back(host, t->data, bytes);
  assert_true(all_zero(host, bytes));

  free_dirty(bytes);
  assert_int_equal(ddp_tensor_ensure_grad(t), DDP_OK);
  assert_non_null(t->grad);
  assert_true(t->flags & DDP_TENSOR_OWNS_GRAD);
  assert_int_equal(cudaPointerGetAttributes(&(struct cudaPointerAttributes){0}, t->grad),
                   cudaSuccess);
  memset(host, 0x7f, bytes);
  read_back(host, t->grad, bytes);
  assert_true(all_zero(host, bytes));
  ddp_tensor_free_grad(t);
  assert_null(t->grad);
  ddp_tensor_destroy(t);

  /* An empty tensor is a real allocation too, and int64 works alike. */
  const int64_t none[1] = {0}, labels[1] = {100};
  assert_int_equal(ddp_tensor_create_on(&t, DDP_FLOAT32, 1, none, GPU), DDP_OK);
  assert_non_null(t->data);
  ddp_tensor_destroy(t);
  assert_int_equal(ddp_tensor_create_on(&t, DDP_INT64, 1, labels, GPU), DDP_OK);
  int64_t back[100];
  read_back(back, t->data, sizeof back);
  assert_true(all_zero(back, sizeof back));
  ddp_tensor_destroy(t);
  free(host);
  assert_int_equal(mem_stats().bytes_in_use, base.bytes_in_use);
  sync_ok();
}

/* The tape's arena on device memory: chunks from the cache, calloc
 * zeroes on the device, reset keeps the memory (no cudaMalloc after the
 * first cycles). */
static void test_arena_on_device(void **state) {
  (void)state;
  ddp__cuda_mem_stats base = mem_stats();
  ddp_arena a;
  ddp_arena_init_backed(&a, MiB, ddp__cuda_arena_backing());
  unsigned char *pattern = malloc(8000), *back = malloc(8000);
  assert_non_null(pattern);
  assert_non_null(back);
  memset(pattern, 0xab, 8000);
  uint64_t allocs_after_warmup = 0;
  for (int cycle = 0; cycle < 6; cycle++) {
    /* Bump allocation starts at the chunk's start each cycle: the calloc
     * lands where the previous cycle left 0xab. */
    unsigned char *z = ddp_arena_calloc(&a, 8000);
    assert_non_null(z);
    assert_int_equal((uintptr_t)z % 64, 0);
    read_back(back, z, 8000);
    if (!all_zero(back, 8000)) fail_msg("cycle %d: arena calloc left non-zero bytes", cycle);
    assert_int_equal(ddp__cuda_copy(z, pattern, 8000, cudaMemcpyHostToDevice), DDP_OK);
    void *big = ddp_arena_alloc(&a, 3 * MiB); /* past the first chunk: a second one */
    assert_non_null(big);
    void *small = ddp_arena_alloc(&a, 100);
    assert_non_null(small);
    assert_int_equal(ddp__cuda_copy(back, z, 8000, cudaMemcpyDeviceToHost), DDP_OK);
    assert_memory_equal(back, pattern, 8000);
    ddp_arena_reset(&a);
    if (cycle == 1) allocs_after_warmup = mem_stats().driver_allocs;
    if (cycle > 1 && mem_stats().driver_allocs != allocs_after_warmup)
      fail_msg("cycle %d: the arena made cudaMalloc calls after its warm-up", cycle);
  }
  ddp_arena_free(&a);
  assert_int_equal(mem_stats().bytes_in_use, base.bytes_in_use);
  free(pattern);
  free(back);
  sync_ok();
}

/* ddp_tensor_copy between the CPU and the GPU (and between GPUs when there
 * are two): bitwise, shapes may differ, any dtype. */
static void test_tensor_copy_across_devices(void **state) {
  (void)state;
  const int64_t shape[2] = {7, 13}, flat[1] = {91};
  ddp_tensor *cpu = NULL, *gpu_a = NULL, *gpu_b = NULL, *out = NULL;
  assert_int_equal(ddp_tensor_create(&cpu, DDP_FLOAT32, 2, shape), DDP_OK);
  assert_int_equal(ddp_tensor_create(&out, DDP_FLOAT32, 2, shape), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&gpu_a, DDP_FLOAT32, 1, flat, GPU), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&gpu_b, DDP_FLOAT32, 2, shape, GPU), DDP_OK);
  fill_random(cpu->data, 91 * sizeof(float)); /* any bits, NaNs included */
  assert_int_equal(ddp_tensor_copy(gpu_a, cpu), DDP_OK);
  assert_int_equal(ddp_tensor_copy(gpu_b, gpu_a), DDP_OK);
  assert_int_equal(ddp_tensor_copy(out, gpu_b), DDP_OK);
  assert_memory_equal(out->data, cpu->data, 91 * sizeof(float));

  if (ddp_cuda_device_count() >= 2) {
    ddp_tensor *other = NULL;
    assert_int_equal(ddp_tensor_create_on(&other, DDP_FLOAT32, 2, shape, DDP_CUDA(1)), DDP_OK);
    assert_int_equal(ddp_tensor_copy(other, gpu_b), DDP_OK);
    /* The source may go at once: the peer copy is ordered on its stream. */
    ddp_tensor_destroy(gpu_b);
    gpu_b = NULL;
    memset(out->data, 0, 91 * sizeof(float));
    assert_int_equal(ddp_tensor_copy(out, other), DDP_OK);
    assert_memory_equal(out->data, cpu->data, 91 * sizeof(float));
    ddp_tensor_destroy(other);
    assert_int_equal(ddp_device_synchronize(DDP_CUDA(1)), DDP_OK);
  } else {
    printf("one GPU: the copy between two GPUs is not exercised\n");
  }

  ddp_tensor *labels = NULL, *dev_labels = NULL, *labels_back = NULL;
  const int64_t n[1] = {33};
  assert_int_equal(ddp_tensor_create(&labels, DDP_INT64, 1, n), DDP_OK);
  assert_int_equal(ddp_tensor_create(&labels_back, DDP_INT64, 1, n), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&dev_labels, DDP_INT64, 1, n, GPU), DDP_OK);
  for (int i = 0; i < 33; i++) ddp_tensor_i64(labels)[i] = (int64_t)i * 1000003 - 7;
  assert_int_equal(ddp_tensor_copy(dev_labels, labels), DDP_OK);
  assert_int_equal(ddp_tensor_copy(labels_back, dev_labels), DDP_OK);
  assert_memory_equal(labels_back->data, labels->data, 33 * sizeof(int64_t));

  ddp_tensor_destroy(cpu);
  ddp_tensor_destroy(out);
  ddp_tensor_destroy(gpu_a);
  ddp_tensor_destroy(gpu_b);
  ddp_tensor_destroy(labels);
  ddp_tensor_destroy(labels_back);
  ddp_tensor_destroy(dev_labels);
  sync_ok();
}

/* The handle is bound to the stream, in FMA float32 math without atomics,
 * and computes. */
static void test_cublas_handle(void **state) {
  (void)state;
  cublasHandle_t h = ddp__cuda_cublas();
  assert_non_null(h);
  assert_ptr_equal(ddp__cuda_cublas(), h);
  cudaStream_t s = NULL;
  assert_int_equal(cublasGetStream(h, &s), CUBLAS_STATUS_SUCCESS);
  assert_ptr_equal(s, ddp__cuda_stream());
  cublasMath_t math;
  assert_int_equal(cublasGetMathMode(h, &math), CUBLAS_STATUS_SUCCESS);
  assert_int_equal((int)math,
                   (int)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  cublasAtomicsMode_t atomics;
  assert_int_equal(cublasGetAtomicsMode(h, &atomics), CUBLAS_STATUS_SUCCESS);
  assert_int_equal(atomics, CUBLAS_ATOMICS_NOT_ALLOWED);
  /* C = A B, column-major 2x2 of small integers: exact. */
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  const float want[4] = {1 * 5 + 3 * 6, 2 * 5 + 4 * 6, 1 * 7 + 3 * 8, 2 * 7 + 4 * 8};
  float *da = ddp__cuda_malloc(sizeof a), *db = ddp__cuda_malloc(sizeof b),
        *dc = ddp__cuda_malloc(sizeof want);
  assert_int_equal(ddp__cuda_copy(da, a, sizeof a, cudaMemcpyHostToDevice), DDP_OK);
  assert_int_equal(ddp__cuda_copy(db, b, sizeof b, cudaMemcpyHostToDevice), DDP_OK);
  const float one = 1, zero = 0;
  assert_int_equal(ddp__cublas_check(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, da,
                                                 2, db, 2, &zero, dc, 2),
                                     "sgemm"),
                   DDP_OK);
  float c[4];
  read_back(c, dc, sizeof c);
  assert_memory_equal(c, want, sizeof want);
  ddp__cuda_free(da);
  ddp__cuda_free(db);
  ddp__cuda_free(dc);
  sync_ok();
}

/* Mistakes come back as statuses naming the device; a non-sticky error
 * leaves the device usable, and what a void function found is reported
 * by the next synchronize, once. */
static void test_errors(void **state) {
  (void)state;
  int n = ddp_cuda_device_count();
  char want[32];
  snprintf(want, sizeof want, "cuda:%d", n);
  assert_int_equal(ddp_device_check(DDP_CUDA(n)), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), want));
  assert_int_equal(ddp__cuda_set_device(n), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), want));
  assert_int_equal(ddp__cuda_set_device(0), DDP_OK);

  /* A copy between tensors of different sizes names both. */
  const int64_t six[1] = {6}, five[1] = {5};
  ddp_tensor *host = NULL, *dev = NULL;
  assert_int_equal(ddp_tensor_create(&host, DDP_FLOAT32, 1, six), DDP_OK);
  assert_int_equal(ddp_tensor_create_on(&dev, DDP_FLOAT32, 1, five, GPU), DDP_OK);
  assert_int_equal(ddp_tensor_copy(dev, host), DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "float32 (6) on cpu"));
  assert_non_null(strstr(ddp_last_error(), "float32 (5) on cuda:0"));

  /* CUDA refuses the copy: the message has the device and CUDA's name. */
  float x[4] = {0};
  ddp_status st = ddp__cuda_copy(dev->data, x, sizeof x, (enum cudaMemcpyKind)42);
  assert_int_not_equal(st, DDP_OK);
  printf("invalid copy: %s\n", ddp_last_error());
  assert_non_null(strstr(ddp_last_error(), "cuda:0: copy of 16 bytes"));
  assert_non_null(strstr(ddp_last_error(), "cudaError"));
  sync_ok(); /* not sticky, and not reported twice */

  /* A free of a foreign pointer, and a double free: pending errors. */
  ddp__cuda_free(x);
  st = ddp_device_synchronize(GPU);
  assert_int_equal(st, DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "not a block from ddp__cuda_malloc"));
  void *p = ddp__cuda_malloc(100);
  ddp__cuda_free(p);
  ddp__cuda_free(p);
  st = ddp_device_synchronize(GPU);
  assert_int_equal(st, DDP_ERR_STATE);
  assert_non_null(strstr(ddp_last_error(), "double free"));
  sync_ok();

  /* More than the device has: NULL and DDP_ERR_NOMEM after the cache was
   * emptied; the device stays usable. */
  assert_null(ddp__cuda_malloc((size_t)1 << 50));
  printf("too large: %s\n", ddp_last_error());
  assert_non_null(strstr(ddp_last_error(), "cuda:0: cannot allocate"));
  assert_non_null(strstr(ddp_last_error(), "cudaErrorMemoryAllocation"));
  ddp_tensor *after = NULL;
  assert_int_equal(ddp_tensor_create_on(&after, DDP_FLOAT32, 1, six, GPU), DDP_OK);
  assert_int_equal(ddp_tensor_copy(after, host), DDP_OK);
  ddp_tensor_destroy(after);
  ddp_tensor_destroy(host);
  ddp_tensor_destroy(dev);
  sync_ok();
}

int main(void) {
  cuda_test_require_device();
  ddp_rng_seed(&rng, 26);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_malloc_reuse),
      cmocka_unit_test(test_copy_round_trip),
      cmocka_unit_test(test_create_on_zeroed),
      cmocka_unit_test(test_arena_on_device),
      cmocka_unit_test(test_tensor_copy_across_devices),
      cmocka_unit_test(test_cublas_handle),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
