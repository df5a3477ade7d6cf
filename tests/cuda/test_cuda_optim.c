/* The optimizers on a GPU against the same optimizers on the CPU (issue 26):
 * SGD (plain, momentum, nesterov, weight decay, dampening, maximize), Adam
 * (defaults, weight decay, amsgrad, maximize) and Adadelta (defaults, weight
 * decay) take 10 steps from the same random params with new grads each step
 * and the lr changed twice in between, at n = 26154 (the ConvNet's
 * parameters), 1027 and 37 (odd: a partial block, a single one); after
 * every step the params and every state entry agree within cuda_test_close's
 * bound. The kernels round each operation as the CPU loops do, so the
 * results are expected equal to the bit; the test prints whether they are.
 * Also: a CPU optimizer's state loaded into a GPU one continues as the CPU
 * does (a checkpoint's resume), relayout moves the device state as the CPU
 * moves its own, a step allocates nothing on the host or the device, and
 * host buffers are refused. Exits 77 without a GPU. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "cuda/cuda_test.h"
#include "ddp/optim.h"
#include "ddp/tensor.h"
#include "tensor/cuda/runtime.h"

#define STEPS 10

static const size_t sizes[] = {26154, 1027, 37};

/* Largest |gpu - cpu| seen over every comparison, for the closing line. */
static double worst_abs;

/* ---- Inputs --------------------------------------------------------------------- */

static uint64_t rng_state;

static double uniform(void) { /* [-1, 1), xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static void fill_params(float *p, size_t n, uint64_t seed) {
  rng_state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (size_t i = 0; i < n; i++) p[i] = (float)(0.5 * uniform());
}

/* Step `step`'s gradient: magnitudes from 1e-7 to 1e3 that move with the
 * step (as the PyTorch fixtures'), signs mixed, every 13th exactly zero. */
static void fill_grads(float *g, size_t n, int step) {
  rng_state = 0xC0FFEEULL + (uint64_t)step * 7919;
  for (size_t i = 0; i < n; i++) {
    int decade = (int)((i + (size_t)step * 3) % 11) - 7;
    g[i] = (i + (size_t)step) % 13 == 0 ? 0.0f : (float)(uniform() * pow(10.0, decade));
  }
}

/* ---- Device buffers -------------------------------------------------------------- */

static float *device_floats(size_t n) {
  float *d = ddp__cuda_malloc(n * sizeof(float));
  if (!d) fail_msg("cuda malloc of %zu floats: %s", n, ddp_last_error());
  return d;
}

static void upload(float *d, const float *h, size_t n) {
  if (ddp__cuda_copy(d, h, n * sizeof(float), cudaMemcpyHostToDevice) != DDP_OK)
    fail_msg("upload: %s", ddp_last_error());
}

static void download(float *h, const float *d, size_t n) {
  if (ddp__cuda_copy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost) != DDP_OK)
    fail_msg("download: %s", ddp_last_error());
}

static void synchronize(void) {
  ddp_status st = ddp_device_synchronize(DDP_CUDA(0));
  if (st != DDP_OK) fail_msg("synchronize cuda:0: %s", ddp_last_error());
}

/* ---- One pair: the same optimizer on the CPU and on cuda:0 ----------------------- */

typedef struct pair {
  size_t n;
  float *params, *grads;   /* (n,) host, the CPU optimizer's */
  float *d_params, *d_grads; /* (n,) cuda:0, the GPU optimizer's */
  float *scratch;          /* (n,) host, GPU params brought back */
  ddp_optimizer *cpu, *gpu;
  int64_t gpu_steps_behind; /* steps the CPU took before a load into the GPU
                               (only Adam's "step" carries the count over) */
} pair;

static void pair_init(pair *pr, const ddp_optim_options *options, size_t n, uint64_t seed) {
  memset(pr, 0, sizeof *pr);
  pr->n = n;
  pr->params = malloc(n * sizeof(float));
  pr->grads = calloc(n, sizeof(float));
  pr->scratch = malloc(n * sizeof(float));
  assert_non_null(pr->params);
  assert_non_null(pr->grads);
  assert_non_null(pr->scratch);
  fill_params(pr->params, n, seed);
  pr->d_params = device_floats(n);
  pr->d_grads = device_floats(n);
  upload(pr->d_params, pr->params, n);
  upload(pr->d_grads, pr->grads, n);

  ddp_optim_options o = *options;
  o.device = DDP_CPU;
  if (ddp_optimizer_create(&pr->cpu, &o, pr->params, pr->grads, n) != DDP_OK)
    fail_msg("cpu create: %s", ddp_last_error());
  o.device = DDP_CUDA(0);
  if (ddp_optimizer_create(&pr->gpu, &o, pr->d_params, pr->d_grads, n) != DDP_OK)
    fail_msg("cuda create: %s", ddp_last_error());
}

static void pair_free(pair *pr) {
  ddp_optimizer_destroy(pr->cpu);
  ddp_optimizer_destroy(pr->gpu);
  ddp__cuda_free(pr->d_params);
  ddp__cuda_free(pr->d_grads);
  free(pr->params);
  free(pr->grads);
  free(pr->scratch);
}

/* New grads on both sides, then one step of each. The upload is queued on
 * the stream after the previous step's kernel, which read the old grads. */
static void pair_step(pair *pr, int step) {
  fill_grads(pr->grads, pr->n, step);
  upload(pr->d_grads, pr->grads, pr->n);
  assert_int_equal(ddp_optimizer_step(pr->cpu), DDP_OK);
  assert_int_equal(ddp_optimizer_step(pr->gpu), DDP_OK);
}

static void pair_set_lr(pair *pr, double lr) {
  assert_int_equal(ddp_optimizer_set_lr(pr->cpu, lr), DDP_OK);
  assert_int_equal(ddp_optimizer_set_lr(pr->gpu, lr), DDP_OK);
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
  double d = 0;
  for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
  return d;
}

/* Params and every state entry of the GPU optimizer against the CPU's; the
 * GPU's state comes through ddp_optimizer_state_get's host copy. */
static void pair_compare(pair *pr, const char *what) {
  char label[320];
  synchronize();
  download(pr->scratch, pr->d_params, pr->n);
  snprintf(label, sizeof label, "%s: params", what);
  assert_true(cuda_test_close(label, pr->scratch, pr->params, (long)pr->n));
  worst_abs = fmax(worst_abs, max_abs_diff(pr->scratch, pr->params, pr->n));

  assert_int_equal(ddp_optimizer_state_count(pr->gpu), ddp_optimizer_state_count(pr->cpu));
  assert_int_equal(ddp_optimizer_step_count(pr->gpu) + pr->gpu_steps_behind,
                   ddp_optimizer_step_count(pr->cpu));
  assert_int_equal(ddp_optimizer_has_state(pr->gpu), ddp_optimizer_has_state(pr->cpu));
  for (size_t k = 0; k < ddp_optimizer_state_count(pr->cpu); k++) {
    ddp_optim_state c, g;
    assert_int_equal(ddp_optimizer_state_get(pr->cpu, k, &c), DDP_OK);
    if (ddp_optimizer_state_get(pr->gpu, k, &g) != DDP_OK)
      fail_msg("%s: state_get %zu on cuda: %s", what, k, ddp_last_error());
    assert_string_equal(g.name, c.name);
    assert_int_equal(g.numel, c.numel);
    assert_int_equal(g.is_scalar, c.is_scalar);
    snprintf(label, sizeof label, "%s: %s", what, c.name);
    if (c.is_scalar) {
      assert_true(g.data[0] == c.data[0]); /* Adam's step: exact */
      continue;
    }
    assert_true(cuda_test_close(label, g.data, c.data, (long)c.numel));
    worst_abs = fmax(worst_abs, max_abs_diff(g.data, c.data, c.numel));
  }
}

/* Steps first_step.. of STEPS with new grads, the lr times 0.3 before step
 * 3 and times 2.5 before step 6, everything compared after each step. */
static void run_steps(pair *pr, const char *what, int first_step, int steps) {
  const double lr0 = ddp_optimizer_get_lr(pr->cpu);
  char label[160];
  for (int s = first_step; s < first_step + steps; s++) {
    if (s == 3) pair_set_lr(pr, lr0 * 0.3);
    if (s == 6) pair_set_lr(pr, ddp_optimizer_get_lr(pr->cpu) * 2.5);
    pair_step(pr, s);
    snprintf(label, sizeof label, "%s step %d", what, s + 1);
    pair_compare(pr, label);
  }
}

/* ---- Configurations ----------------------------------------------------------- */

typedef struct config {
  const char *name;
  ddp_optim_options options;
} config;

static ddp_optim_options sgd(double lr, double momentum, double dampening, double wd,
                             bool nesterov, bool maximize) {
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = lr;
  o.sgd.momentum = momentum;
  o.sgd.dampening = dampening;
  o.weight_decay = wd;
  o.sgd.nesterov = nesterov;
  o.maximize = maximize;
  return o;
}

static ddp_optim_options adam(double wd, bool amsgrad, bool maximize) {
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.weight_decay = wd;
  o.adam.amsgrad = amsgrad;
  o.maximize = maximize;
  return o;
}

static ddp_optim_options adadelta(double wd) {
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  o.weight_decay = wd;
  return o;
}

static size_t configs(config *c) {
  size_t k = 0;
  c[k++] = (config){"sgd plain", sgd(0.05, 0, 0, 0, false, false)};
  c[k++] = (config){"sgd momentum 0.9", sgd(0.05, 0.9, 0, 0, false, false)};
  c[k++] = (config){"sgd nesterov", sgd(0.05, 0.9, 0, 0, true, false)};
  c[k++] = (config){"sgd weight decay", sgd(0.05, 0, 0, 5e-4, false, false)};
  c[k++] = (config){"sgd momentum dampening wd", sgd(0.05, 0.9, 0.1, 5e-4, false, false)};
  c[k++] = (config){"sgd nesterov wd maximize", sgd(0.05, 0.9, 0, 1e-2, true, true)};
  c[k++] = (config){"adam", adam(0, false, false)};
  c[k++] = (config){"adam weight decay", adam(1e-2, false, false)};
  c[k++] = (config){"adam amsgrad wd", adam(1e-2, true, false)};
  c[k++] = (config){"adam maximize", adam(0, false, true)};
  c[k++] = (config){"adadelta", adadelta(0)};
  c[k++] = (config){"adadelta weight decay", adadelta(1e-2)};
  return k;
}

#define MAX_CONFIGS 16

/* ---- Tests -------------------------------------------------------------------- */

static void test_matches_cpu(void **state) {
  (void)state;
  config c[MAX_CONFIGS];
  size_t count = configs(c);
  for (size_t k = 0; k < count; k++)
    for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
      char what[96];
      snprintf(what, sizeof what, "%s n=%zu", c[k].name, sizes[z]);
      pair pr;
      pair_init(&pr, &c[k].options, sizes[z], k * 10 + z);
      run_steps(&pr, what, 0, STEPS);
      pair_free(&pr);
    }
}

/* A checkpoint's resume onto a GPU: the CPU optimizer steps 5 times, its
 * state and params go into a fresh GPU optimizer through state_load (as
 * io/checkpoint.c loads them), then both step 5 more times. For SGD this
 * also checks that a loaded momentum buffer is decayed, not replaced. */
static void test_load_then_continue(void **state) {
  (void)state;
  config c[MAX_CONFIGS];
  size_t count = configs(c);
  const size_t n = sizes[0];
  for (size_t k = 0; k < count; k++) {
    char what[96];
    snprintf(what, sizeof what, "%s resumed", c[k].name);
    if (c[k].options.kind == DDP_OPTIM_SGD && c[k].options.sgd.momentum == 0.0)
      continue; /* no state to load */
    pair pr;
    pair_init(&pr, &c[k].options, n, 100 + k);
    for (int s = 0; s < 5; s++) {
      fill_grads(pr.grads, n, s);
      assert_int_equal(ddp_optimizer_step(pr.cpu), DDP_OK);
    }
    upload(pr.d_params, pr.params, n);
    for (size_t i = 0; i < ddp_optimizer_state_count(pr.cpu); i++) {
      ddp_optim_state st;
      assert_int_equal(ddp_optimizer_state_get(pr.cpu, i, &st), DDP_OK);
      if (ddp_optimizer_state_load(pr.gpu, st.name, st.data, st.numel) != DDP_OK)
        fail_msg("%s: load %s: %s", what, st.name, ddp_last_error());
    }
    assert_int_equal(ddp_optimizer_set_lr(pr.gpu, ddp_optimizer_get_lr(pr.cpu)), DDP_OK);
    if (c[k].options.kind == DDP_OPTIM_ADAM)
      assert_int_equal(ddp_optimizer_step_count(pr.gpu), 5);
    assert_true(ddp_optimizer_has_state(pr.gpu));
    /* The state went up and comes back down unchanged. */
    synchronize();
    for (size_t i = 0; i < ddp_optimizer_state_count(pr.cpu); i++) {
      ddp_optim_state a, b;
      assert_int_equal(ddp_optimizer_state_get(pr.cpu, i, &a), DDP_OK);
      assert_int_equal(ddp_optimizer_state_get(pr.gpu, i, &b), DDP_OK);
      assert_memory_equal(b.data, a.data, a.numel * sizeof(float));
    }
    pr.gpu_steps_behind = ddp_optimizer_step_count(pr.cpu) - ddp_optimizer_step_count(pr.gpu);
    run_steps(&pr, what, 5, 5);
    pair_free(&pr);
  }
}

/* ddp_optimizer_relayout on a GPU optimizer moves its state as the CPU
 * optimizer moves its own: the first and last segments swap, the two
 * between stay in place (the GPU path skips those). */
static void test_relayout(void **state) {
  (void)state;
  const size_t n = sizes[0];
  const int64_t lengths[4] = {1000, 7, 24147, 1000};
  const int64_t old_off[4] = {0, 1000, 1007, 25154};
  const int64_t new_off[4] = {25154, 1000, 1007, 0};
  assert_int_equal(lengths[0] + lengths[1] + lengths[2] + lengths[3], (int64_t)n);
  config c[MAX_CONFIGS];
  size_t count = configs(c);
  for (size_t k = 0; k < count; k++) {
    pair pr;
    pair_init(&pr, &c[k].options, n, 200 + k);
    for (int s = 0; s < 3; s++) pair_step(&pr, s);
    assert_int_equal(ddp_optimizer_relayout(pr.cpu, 4, old_off, new_off, lengths), DDP_OK);
    if (ddp_optimizer_relayout(pr.gpu, 4, old_off, new_off, lengths) != DDP_OK)
      fail_msg("%s: relayout on cuda: %s", c[k].name, ddp_last_error());
    for (size_t i = 0; i < ddp_optimizer_state_count(pr.cpu); i++) {
      ddp_optim_state a, b;
      assert_int_equal(ddp_optimizer_state_get(pr.cpu, i, &a), DDP_OK);
      assert_int_equal(ddp_optimizer_state_get(pr.gpu, i, &b), DDP_OK);
      char label[128];
      snprintf(label, sizeof label, "%s relayout %s", c[k].name, a.name);
      assert_true(cuda_test_close(label, b.data, a.data, (long)a.numel));
    }
    pair_free(&pr);
  }
}

/* After create, a step allocates nothing: no host allocation, no device
 * memory from the cache or the driver. */
static void test_step_allocates_nothing(void **state) {
  (void)state;
  config c[MAX_CONFIGS];
  size_t count = configs(c);
  for (size_t k = 0; k < count; k++) {
    pair pr;
    pair_init(&pr, &c[k].options, sizes[0], 300 + k);
    synchronize();
    ddp__cuda_mem_stats before, after;
    ddp__cuda_mem_stats_get(&before);
    uint64_t host_before = ddp_alloc_count();
    for (int s = 0; s < 5; s++) assert_int_equal(ddp_optimizer_step(pr.gpu), DDP_OK);
    synchronize();
    ddp__cuda_mem_stats_get(&after);
    assert_int_equal(ddp_alloc_count(), host_before);
    assert_int_equal(after.driver_allocs, before.driver_allocs);
    assert_int_equal(after.bytes_in_use, before.bytes_in_use);
    pair_free(&pr);
  }
}

/* Host buffers given for a GPU optimizer are refused at create (a kernel
 * reading them would fault and take the context down), as is a device the
 * process does not have. */
static void test_refuses_host_memory(void **state) {
  (void)state;
  float p[8] = {0}, g[8] = {0};
  float *d = device_floats(8);
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.device = DDP_CUDA(0);
  ddp_optimizer *opt = (ddp_optimizer *)&opt;
  assert_int_equal(ddp_optimizer_create(&opt, &o, p, d, 8), DDP_ERR_INVALID);
  assert_null(opt);
  print_message("%s\n", ddp_last_error());
  assert_non_null(strstr(ddp_last_error(), "adam on cuda:0: params ("));
  assert_non_null(strstr(ddp_last_error(), "is host memory"));
  assert_int_equal(ddp_optimizer_create(&opt, &o, d, g, 8), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "adam on cuda:0: grads ("));
  o.device = DDP_CUDA(ddp_cuda_device_count());
  assert_int_not_equal(ddp_optimizer_create(&opt, &o, d, d, 8), DDP_OK);
  assert_null(opt);
  print_message("%s\n", ddp_last_error());
  ddp__cuda_free(d);
  synchronize();
}

static int report_worst(void **state) {
  (void)state;
  print_message("largest |cuda - cpu| over every comparison: %.3g (%s)\n", worst_abs,
                worst_abs == 0 ? "bit-identical" : "within the bound, not bit-identical");
  return 0;
}

int main(void) {
  cuda_test_require_device();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_cpu),
      cmocka_unit_test(test_load_then_continue),
      cmocka_unit_test(test_relayout),
      cmocka_unit_test(test_step_allocates_nothing),
      cmocka_unit_test(test_refuses_host_memory),
  };
  return cmocka_run_group_tests(tests, NULL, report_worst);
}
