/* The device API without a GPU (src/tensor/device.c): names parsed and
 * printed as torch.device does, devices checked with a reason, the rank
 * placement rule, and device tensors failing cleanly where CUDA is
 * unavailable. Runs in every build; where a GPU is present (the GPU
 * machine runs the whole suite too) the CUDA cases check the other
 * answer. The GPU side itself is tests/cuda/test_cuda_runtime.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/device_internal.h"

static void test_parse_and_str(void **state) {
  (void)state;
  static const struct {
    const char *text, *canonical;
    ddp_device_type type;
    int index;
  } good[] = {
      {"cpu", "cpu", DDP_DEVICE_CPU, 0},
      {"cuda", "cuda:0", DDP_DEVICE_CUDA, 0},
      {"cuda:0", "cuda:0", DDP_DEVICE_CUDA, 0},
      {"cuda:7", "cuda:7", DDP_DEVICE_CUDA, 7},
      {"cuda:123", "cuda:123", DDP_DEVICE_CUDA, 123},
      {"cuda:2147483647", "cuda:2147483647", DDP_DEVICE_CUDA, 2147483647},
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    ddp_device d = {DDP_DEVICE_TYPE_COUNT, -5};
    if (ddp_device_parse(good[i].text, &d) != DDP_OK)
      fail_msg("\"%s\": %s", good[i].text, ddp_last_error());
    assert_int_equal(d.type, good[i].type);
    assert_int_equal(d.index, good[i].index);
    char buf[DDP_DEVICE_STR_BYTES];
    assert_string_equal(ddp_device_str(d, buf, sizeof buf), good[i].canonical);
    /* The printed name parses back to the same device. */
    ddp_device again;
    assert_int_equal(ddp_device_parse(buf, &again), DDP_OK);
    assert_true(ddp_device_equal(d, again));
  }
  static const char *bad[] = {"",        "gpu",        "CPU",    " cpu",     "cpu ",
                              "cuda:",   "cuda:-1",    "cuda:01", "cuda:x",  "cuda:1x",
                              "cuda:+1", "cuda:2147483648", "cuda:99999999999", "cuda0",
                              "cuda::1", "cpu:0",      "cudaa"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ddp_device d = DDP_CUDA(42);
    if (ddp_device_parse(bad[i], &d) != DDP_ERR_INVALID) fail_msg("\"%s\" parsed", bad[i]);
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\"", bad[i]);
    if (!strstr(ddp_last_error(), quoted))
      fail_msg("the error for %s does not name it: %s", quoted, ddp_last_error());
    assert_true(ddp_device_equal(d, DDP_CUDA(42))); /* untouched */
  }
  ddp_device d;
  assert_int_equal(ddp_device_parse(NULL, &d), DDP_ERR_INVALID);
  char buf[DDP_DEVICE_STR_BYTES];
  assert_string_equal(ddp_device_str(DDP_CPU, buf, sizeof buf), "cpu");
  assert_string_equal(ddp_device_str(DDP_CUDA(3), buf, sizeof buf), "cuda:3");
  assert_true(ddp_device_equal(DDP_CUDA(1), DDP_CUDA(1)));
  assert_false(ddp_device_equal(DDP_CUDA(1), DDP_CUDA(0)));
  assert_false(ddp_device_equal(DDP_CPU, DDP_CUDA(0)));
}

static void test_build_and_count(void **state) {
  (void)state;
#ifdef DDP_HAVE_CUDA
  assert_true(ddp_cuda_built());
#else
  assert_false(ddp_cuda_built());
  assert_string_equal(ddp_cuda_unavailable_reason(), "this build has no CUDA backend");
#endif
  int n = ddp_cuda_device_count();
  assert_true(n >= 0);
  assert_int_equal(ddp_cuda_device_count(), n); /* found once */
  if (n == 0) {
    const char *why = ddp_cuda_unavailable_reason();
    assert_non_null(why);
    assert_true(strlen(why) > 0);
    printf("no CUDA device here: %s\n", why);
  } else {
    assert_null(ddp_cuda_unavailable_reason());
  }
}

static void test_check(void **state) {
  (void)state;
  assert_int_equal(ddp_device_check(DDP_CPU), DDP_OK);
  assert_int_equal(ddp_device_check((ddp_device){DDP_DEVICE_CPU, 1}), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "cpu:1"));
  assert_int_equal(ddp_device_check((ddp_device){DDP_DEVICE_TYPE_COUNT, 0}), DDP_ERR_INVALID);
  int n = ddp_cuda_device_count();
  if (n == 0) {
    /* No GPU: a clean error naming the device and why. */
    assert_int_equal(ddp_device_check(DDP_CUDA(0)), DDP_ERR_UNSUPPORTED);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
    assert_non_null(strstr(msg, "cuda:0"));
    assert_non_null(strstr(msg, ddp_cuda_unavailable_reason()));
    assert_int_equal(ddp_device_check(DDP_CUDA(3)), DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), "cuda:3"));
  } else {
    assert_int_equal(ddp_device_check(DDP_CUDA(0)), DDP_OK);
    assert_int_equal(ddp_device_check(DDP_CUDA(n - 1)), DDP_OK);
    assert_int_equal(ddp_device_check(DDP_CUDA(n)), DDP_ERR_INVALID);
    char want[32];
    snprintf(want, sizeof want, "cuda:%d: no such device", n);
    assert_non_null(strstr(ddp_last_error(), want));
  }
  assert_int_equal(ddp_device_check(DDP_CUDA(-1)), n ? DDP_ERR_INVALID : DDP_ERR_UNSUPPORTED);
}

static void test_synchronize(void **state) {
  (void)state;
  assert_int_equal(ddp_device_synchronize(DDP_CPU), DDP_OK);
  if (ddp_cuda_device_count() == 0) {
    assert_int_equal(ddp_device_synchronize(DDP_CUDA(0)), DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), "cuda:0"));
  } else {
    assert_int_equal(ddp_device_synchronize(DDP_CUDA(0)), DDP_OK);
  }
}

/* cuda:(local_rank % count); ranks share when there are more of them. */
static void test_placement_rule(void **state) {
  (void)state;
  static const struct {
    int local_rank, local_world, count, index;
    bool shared;
  } cases[] = {
      {0, 1, 1, 0, false}, {0, 1, 8, 0, false}, {1, 2, 8, 1, false}, {5, 8, 8, 5, false},
      {7, 8, 8, 7, false}, {3, 4, 2, 1, true},  {2, 4, 2, 0, true},  {1, 2, 1, 0, true},
      {8, 9, 8, 0, true},  {0, 3, 2, 0, true},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int index = -1;
    bool shared = !cases[i].shared;
    assert_int_equal(ddp__device_placement(cases[i].local_rank, cases[i].local_world,
                                           cases[i].count, &index, &shared),
                     DDP_OK);
    if (index != cases[i].index || shared != cases[i].shared)
      fail_msg("rank %d of %d, %d devices: cuda:%d shared %d, expected cuda:%d shared %d",
               cases[i].local_rank, cases[i].local_world, cases[i].count, index, shared,
               cases[i].index, cases[i].shared);
  }
  static const int bad[][3] = {{0, 1, 0}, {0, 0, 1}, {-1, 2, 1}, {2, 2, 1}, {0, -1, 4}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int index = 77;
    bool shared = false;
    assert_int_equal(ddp__device_placement(bad[i][0], bad[i][1], bad[i][2], &index, &shared),
                     DDP_ERR_INVALID);
    assert_int_equal(index, 77);
  }
  assert_non_null(strstr(ddp_last_error(), "local rank 0 is not one of -1 local ranks"));

  ddp_device d = DDP_CPU;
  if (ddp_cuda_device_count() == 0) {
    assert_int_equal(ddp_default_cuda_device(0, 1, &d), DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), ddp_cuda_unavailable_reason()));
    assert_true(ddp_device_equal(d, DDP_CPU));
  } else {
    assert_int_equal(ddp_default_cuda_device(0, 1, &d), DDP_OK);
    assert_true(ddp_device_equal(d, DDP_CUDA(0)));
  }
}

static void test_tensors_without_a_gpu(void **state) {
  (void)state;
  const int64_t shape[2] = {3, 5};
  /* On the CPU: ddp_tensor_create's zeroed heap tensor. */
  ddp_tensor *t = NULL;
  assert_int_equal(ddp_tensor_create_on(&t, DDP_FLOAT32, 2, shape, DDP_CPU), DDP_OK);
  assert_non_null(t);
  assert_true(ddp_device_equal(t->device, DDP_CPU));
  for (int i = 0; i < 15; i++) assert_true(ddp_tensor_f32(t)[i] == 0.0f);
  assert_int_equal(ddp_tensor_ensure_grad(t), DDP_OK);
  ddp_tensor_destroy(t);

  /* CPU to CPU copies, and their shape errors. */
  ddp_tensor *a = NULL, *b = NULL, *c = NULL;
  const int64_t flat[1] = {15}, other[1] = {14};
  assert_int_equal(ddp_tensor_create(&a, DDP_FLOAT32, 2, shape), DDP_OK);
  assert_int_equal(ddp_tensor_create(&b, DDP_FLOAT32, 1, flat), DDP_OK);
  assert_int_equal(ddp_tensor_create(&c, DDP_FLOAT32, 1, other), DDP_OK);
  for (int i = 0; i < 15; i++) ddp_tensor_f32(a)[i] = (float)i * 0.5f - 3.0f;
  assert_int_equal(ddp_tensor_copy(b, a), DDP_OK);
  assert_memory_equal(b->data, a->data, 15 * sizeof(float));
  assert_int_equal(ddp_tensor_copy(c, a), DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "float32 (3,5) on cpu"));
  assert_non_null(strstr(ddp_last_error(), "float32 (14) on cpu"));
  ddp_tensor *i64 = NULL;
  assert_int_equal(ddp_tensor_create(&i64, DDP_INT64, 1, flat), DDP_OK);
  assert_int_equal(ddp_tensor_copy(i64, a), DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "int64 (15) on cpu"));
  assert_non_null(strstr(ddp_last_error(), "different dtypes"));
  /* Raw bytes between host buffers (ddp_device_copy), and a NULL end. */
  float raw[15];
  assert_int_equal(ddp_device_copy(DDP_CPU, raw, DDP_CPU, a->data, sizeof raw), DDP_OK);
  assert_memory_equal(raw, a->data, sizeof raw);
  assert_int_equal(ddp_device_copy(DDP_CPU, NULL, DDP_CPU, a->data, sizeof raw), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "the destination is NULL"));

  if (ddp_cuda_device_count() == 0) {
    /* A CUDA tensor where there is none: a clean error, nothing made. */
    t = (ddp_tensor *)&t;
    ddp_status st = ddp_tensor_create_on(&t, DDP_FLOAT32, 2, shape, DDP_CUDA(0));
    assert_int_equal(st, DDP_ERR_UNSUPPORTED);
    assert_null(t);
    assert_non_null(strstr(ddp_last_error(), "cuda:0"));
    assert_non_null(strstr(ddp_last_error(), ddp_cuda_unavailable_reason()));
    /* A copy to a device that is not there names both ends. */
    ddp_tensor fake;
    float nowhere[15];
    assert_int_equal(ddp_tensor_wrap(&fake, DDP_FLOAT32, 1, flat, nowhere), DDP_OK);
    fake.device = DDP_CUDA(1);
    assert_int_equal(ddp_tensor_copy(&fake, a), DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), "to float32 (15) on cuda:1"));
    assert_non_null(strstr(ddp_last_error(), "from float32 (3,5) on cpu"));
    assert_int_equal(ddp_tensor_copy(a, &fake), DDP_ERR_UNSUPPORTED);
    /* Raw copies (ddp_device_copy) likewise: nothing written, both ends named. */
    float host[15] = {0};
    assert_int_equal(ddp_device_copy(DDP_CPU, host, DDP_CUDA(1), nowhere, sizeof host),
                     DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), "from cuda:1 to cpu"));
    for (int i = 0; i < 15; i++) assert_true(host[i] == 0.0f);
    /* Nor a gradient there. */
    assert_int_equal(ddp_tensor_ensure_grad(&fake), DDP_ERR_UNSUPPORTED);
    assert_null(fake.grad);
    assert_false(fake.flags & DDP_TENSOR_OWNS_GRAD);
    assert_non_null(strstr(ddp_last_error(), "gradient of 15 elements on cuda:1"));
  }
  /* A bad shape is refused before any device is asked. */
  const int64_t negative[1] = {-2};
  t = NULL;
  assert_int_equal(ddp_tensor_create_on(&t, DDP_FLOAT32, 1, negative, DDP_CUDA(0)),
                   DDP_ERR_INVALID);
  assert_null(t);
  ddp_tensor_destroy(a);
  ddp_tensor_destroy(b);
  ddp_tensor_destroy(c);
  ddp_tensor_destroy(i64);
}

/* TF32 (--precision tf32): off by default; a CUDA build turns it on and
 * off (process-wide), a build without CUDA refuses to turn it on. */
static void test_tf32_switch(void **state) {
  (void)state;
  assert_false(ddp_cuda_tf32_allowed());
  if (ddp_cuda_built()) {
    assert_int_equal(ddp_cuda_allow_tf32(true), DDP_OK);
    assert_true(ddp_cuda_tf32_allowed());
  } else {
    assert_int_equal(ddp_cuda_allow_tf32(true), DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(ddp_last_error(), "no CUDA backend"));
    assert_false(ddp_cuda_tf32_allowed());
  }
  assert_int_equal(ddp_cuda_allow_tf32(false), DDP_OK);
  assert_false(ddp_cuda_tf32_allowed());
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tf32_switch),
      cmocka_unit_test(test_parse_and_str),       cmocka_unit_test(test_build_and_count),
      cmocka_unit_test(test_check),               cmocka_unit_test(test_synchronize),
      cmocka_unit_test(test_placement_rule),      cmocka_unit_test(test_tensors_without_a_gpu),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
