/* The CUDA pointwise kernel table (src/tensor/cuda/pointwise.cu, norm.cu,
 * loss.cu) against the CPU's (ddp__cpu_pointwise_kernels), kernel by
 * kernel, on random inputs (ddp_rng) of the seeds' shapes: every output
 * within cuda_test_close's bound (max|a - b| <= 1e-5 max|b| + 1e-7), masks,
 * the rng's state after a mask and the first bad target exactly.
 *   - activations on 1e5 elements, backward assigning and accumulating;
 *   - batch norm over the ConvNet's (100, 16, 28, 28) and (100, 32, 14, 14)
 *     and a (100, 128) BatchNorm1d: statistics with and without the running
 *     update, the running (eval) ones, forward with and without affine,
 *     backward for every combination of batch_stats, accumulate, dx in
 *     place and weight/bias gradients wanted, from a dense gradient and from
 *     a pooled one (the fused relu + max_pool's, its argmax from a CPU
 *     max_pool2d_forward with relu and batch norm's affine map: 2x2 stride
 *     2 as the ConvNet, and overlapping 3x3 stride 2, 12x12 windows whose
 *     argmax is int32, 1x1 planes), and the synchronized phases;
 *   - dropout and dropout2d at p = 0.25, 0.5 (and 1) on PSNet's (100, 64,
 *     12, 12) and (100, 128);
 *   - log_softmax + nll over (100, 10), cross_entropy over (100, 10) and
 *     (1024, 10) (also logits near 1e3), mse over (20, 5); bad targets
 *     found at the same sample as the CPU, reported by the next
 *     synchronize on the GPU (its kernels do not wait for the check).
 * Both tables get the same inputs; where a kernel takes another's result
 * (forward takes the statistics), both get the CPU's, so each kernel is
 * compared alone. Prints one line per kernel with the largest relative
 * difference seen (max|a - b| / max|b|). Exits 77 without a GPU. */
#include <math.h>
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
#include "tensor/cuda/kernels_cuda.h"
#include "tensor/cuda/runtime.h"

static const ddp__pointwise_kernels *const cpu = &ddp__cpu_pointwise_kernels;
static const ddp__pointwise_kernels *const gpu = &ddp__cuda_pointwise_kernels;

static ddp_rng rng;
static ddp_arena host_arena, dev_arena;

/* ---- the largest relative difference per kernel, for the closing lines ---- */

#define MAX_KERNELS 48
static struct {
  const char *kernel;
  double worst;
  int tensors;
} seen[MAX_KERNELS];
static int n_seen;

static void note(const char *kernel, double rel) {
  int i = 0;
  while (i < n_seen && strcmp(seen[i].kernel, kernel) != 0) i++;
  if (i == n_seen) {
    assert_true(n_seen < MAX_KERNELS);
    seen[n_seen].kernel = kernel, seen[n_seen].worst = 0, seen[n_seen].tensors = 0;
    n_seen++;
  }
  if (rel > seen[i].worst || isnan(rel)) seen[i].worst = rel;
  seen[i].tensors++;
}

/* ---- host and device buffers ---- */

static void *host_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  assert_non_null(p);
  return p;
}

static float *host_floats(int64_t n) { return host_alloc((size_t)n * sizeof(float)); }

static float *host_copy(const float *x, int64_t n) {
  float *c = host_floats(n);
  memcpy(c, x, (size_t)n * sizeof(float));
  return c;
}

static void fill_uniform(float *x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++) x[i] = ddp_rng_uniform_range(&rng, lo, hi);
}

static void fill_normal(float *x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) x[i] = scale * ddp_rng_normal(&rng);
}

static void synchronize(void) {
  if (ddp_device_synchronize(DDP_CUDA(0)) != DDP_OK)
    fail_msg("synchronize cuda:0: %s", ddp_last_error());
}

static void *dev_alloc(size_t bytes) {
  void *d = ddp__cuda_malloc(bytes);
  if (!d) fail_msg("cuda malloc of %zu bytes: %s", bytes, ddp_last_error());
  return d;
}

static void upload_bytes(void *d, const void *h, size_t bytes) {
  if (ddp__cuda_copy(d, h, bytes, cudaMemcpyHostToDevice) != DDP_OK)
    fail_msg("upload: %s", ddp_last_error());
}

static void download_bytes(void *h, const void *d, size_t bytes) {
  if (ddp__cuda_copy(h, d, bytes, cudaMemcpyDeviceToHost) != DDP_OK)
    fail_msg("download: %s", ddp_last_error());
}

/* A device copy of n host floats (or bytes). */
static float *dev_copy(const float *h, int64_t n) {
  float *d = dev_alloc((size_t)n * sizeof(float));
  upload_bytes(d, h, (size_t)n * sizeof(float));
  return d;
}

static void *dev_copy_bytes(const void *h, size_t bytes) {
  void *d = dev_alloc(bytes);
  upload_bytes(d, h, bytes);
  return d;
}

static void reset_arenas(void) {
  ddp_arena_reset(&host_arena);
  ddp_arena_reset(&dev_arena);
}

/* The GPU's n floats a (brought to the host) against the CPU's h, within
 * the bound; notes the relative difference under `kernel`. */
static void expect_close_host(const char *kernel, const char *what, const float *a,
                              const float *h, int64_t n) {
  double scale = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) {
    scale = fmax(scale, fabs(h[i]));
    worst = fmax(worst, fabs((double)a[i] - h[i]));
  }
  note(kernel, scale > 0 ? worst / scale : worst);
  char label[200];
  snprintf(label, sizeof label, "%s: %s", kernel, what);
  if (!cuda_test_close(label, a, h, (long)n)) fail_msg("%s differs from the CPU's", label);
}

/* The same for n floats at device address d. */
static void expect_close(const char *kernel, const char *what, const float *d, const float *h,
                         int64_t n) {
  synchronize();
  float *a = host_floats(n);
  download_bytes(a, d, (size_t)n * sizeof(float));
  expect_close_host(kernel, what, a, h, n);
  free(a);
}

/* The same for n doubles in host memory (the synchronized sums). */
static void expect_close_doubles(const char *kernel, const char *what, const double *a,
                                 const double *b, int64_t n) {
  double scale = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) {
    scale = fmax(scale, fabs(b[i]));
    worst = fmax(worst, fabs(a[i] - b[i]));
    if (isnan(a[i]) != isnan(b[i])) worst = NAN;
  }
  note(kernel, scale > 0 ? worst / scale : worst);
  if (!(worst <= 1e-5 * scale + 1e-7))
    fail_msg("%s: %s: max|cuda - cpu| = %.3g > bound %.3g", kernel, what, worst,
             1e-5 * scale + 1e-7);
}

/* ---- activations ---- */

static void test_activations(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 1);
  const int64_t n = 100000;
  float *x = host_floats(n), *y = host_floats(n), *dy = host_floats(n), *dx = host_floats(n);
  fill_uniform(x, n, -6.0f, 6.0f);
  for (int64_t i = 0; i < n; i += 97) x[i] = 0.0f; /* relu's kink */
  fill_normal(dy, n, 1.0f);
  float *d_x = dev_copy(x, n), *d_y = dev_alloc((size_t)n * sizeof(float));
  float *d_dy = dev_copy(dy, n), *d_dx = dev_alloc((size_t)n * sizeof(float));

  struct {
    const char *name, *backward;
    void (*cpu_f)(float *, const float *, int64_t), (*gpu_f)(float *, const float *, int64_t);
    void (*cpu_b)(float *, const float *, const float *, int64_t, bool);
    void (*gpu_b)(float *, const float *, const float *, int64_t, bool);
  } acts[] = {
      {"relu", "relu_backward", cpu->relu, gpu->relu, cpu->relu_backward, gpu->relu_backward},
      {"sigmoid", "sigmoid_backward", cpu->sigmoid, gpu->sigmoid, cpu->sigmoid_backward,
       gpu->sigmoid_backward},
      {"tanh", "tanh_backward", cpu->tanh, gpu->tanh, cpu->tanh_backward, gpu->tanh_backward},
  };
  for (size_t a = 0; a < sizeof acts / sizeof acts[0]; a++) {
    acts[a].cpu_f(y, x, n);
    acts[a].gpu_f(d_y, d_x, n);
    expect_close(acts[a].name, "y", d_y, y, n);
    /* backward from the CPU's y on both sides */
    upload_bytes(d_y, y, (size_t)n * sizeof(float));
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
      fill_normal(dx, n, 1.0f);
      upload_bytes(d_dx, dx, (size_t)n * sizeof(float));
      acts[a].cpu_b(dx, dy, y, n, accumulate);
      acts[a].gpu_b(d_dx, d_dy, d_y, n, accumulate);
      expect_close(acts[a].backward, accumulate ? "dx accumulated" : "dx assigned", d_dx, dx, n);
    }
  }
  ddp__cuda_free(d_x), ddp__cuda_free(d_y), ddp__cuda_free(d_dy), ddp__cuda_free(d_dx);
  free(x), free(y), free(dy), free(dx);
}

/* ---- dropout ---- */

static void dropout_case(float p, int64_t groups, int64_t group_size) {
  const int64_t n = groups * group_size;
  char what[96];
  snprintf(what, sizeof what, "p %.2f, %lld groups of %lld", (double)p, (long long)groups,
           (long long)group_size);
  ddp_rng r_cpu, r_gpu;
  ddp_rng_seed(&r_cpu, 1000 + (uint64_t)(p * 100) + (uint64_t)group_size);
  r_gpu = r_cpu;
  uint8_t *mask = host_alloc((size_t)groups), *gmask = host_alloc((size_t)groups);
  uint8_t *d_mask = dev_alloc((size_t)groups);
  cpu->dropout_mask(mask, groups, p, &r_cpu);
  gpu->dropout_mask(d_mask, groups, p, &r_gpu);
  synchronize();
  download_bytes(gmask, d_mask, (size_t)groups);
  if (memcmp(mask, gmask, (size_t)groups) != 0) fail_msg("dropout_mask: %s: masks differ", what);
  if (memcmp(&r_cpu, &r_gpu, sizeof r_cpu) != 0)
    fail_msg("dropout_mask: %s: the rng's state differs after the draws", what);
  note("dropout_mask", 0);

  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  float *x = host_floats(n), *y = host_floats(n), *dy = host_floats(n), *dx = host_floats(n);
  fill_normal(x, n, 2.0f);
  fill_normal(dy, n, 1.0f);
  fill_normal(dx, n, 1.0f);
  float *d_x = dev_copy(x, n), *d_y = dev_alloc((size_t)n * sizeof(float));
  float *d_dy = dev_copy(dy, n), *d_dx = dev_copy(dx, n);
  cpu->dropout_apply(y, x, mask, groups, group_size, scale);
  gpu->dropout_apply(d_y, d_x, d_mask, groups, group_size, scale);
  expect_close("dropout_apply", what, d_y, y, n);
  cpu->dropout_backward(dx, dy, mask, groups, group_size, scale);
  gpu->dropout_backward(d_dx, d_dy, d_mask, groups, group_size, scale);
  expect_close("dropout_backward", what, d_dx, dx, n);
  ddp__cuda_free(d_mask), ddp__cuda_free(d_x), ddp__cuda_free(d_y), ddp__cuda_free(d_dy);
  ddp__cuda_free(d_dx);
  free(mask), free(gmask), free(x), free(y), free(dy), free(dx);
}

static void test_dropout(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 2);
  const float ps[] = {0.25f, 0.5f};
  for (int i = 0; i < 2; i++) {
    dropout_case(ps[i], 100 * 64 * 12 * 12, 1); /* dropout on PSNet's conv features */
    dropout_case(ps[i], 100 * 64, 12 * 12);     /* dropout2d on them */
    dropout_case(ps[i], 100 * 128, 1);          /* dropout on PSNet's fc1 */
  }
  dropout_case(1.0f, 100 * 128, 1); /* draws nothing, drops all */
}

/* ---- batch norm ---- */

/* One batch-norm input on both sides, with the CPU's statistics (which
 * every kernel after batch_norm_stats takes on both sides). */
typedef struct bn_data {
  int64_t N, C, HW, n;
  float *x, *weight, *bias, *mean, *invstd;          /* host */
  float *d_x, *d_weight, *d_bias, *d_mean, *d_invstd; /* device */
} bn_data;

/* x (N, C, HW): channel c uniform around (c - C/2) * 0.3 with spread 0.5 +
 * 0.05 c, every 11th value of a plane equal to the channel's offset (the
 * flat background that made the float mean matter, issue 19). */
static void bn_data_init(bn_data *b, int64_t N, int64_t C, int64_t HW) {
  memset(b, 0, sizeof *b);
  b->N = N, b->C = C, b->HW = HW, b->n = N * C * HW;
  b->x = host_floats(b->n);
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++) {
      float *plane = b->x + (n * C + c) * HW;
      const float offset = (float)(c - C / 2) * 0.3f, spread = 0.5f + 0.05f * (float)c;
      for (int64_t i = 0; i < HW; i++)
        plane[i] = i % 11 == 5 ? offset : offset + spread * ddp_rng_uniform_range(&rng, -1, 1);
    }
  b->weight = host_floats(C), b->bias = host_floats(C);
  fill_uniform(b->weight, C, 0.5f, 1.5f);
  fill_uniform(b->bias, C, -0.5f, 0.5f);
  b->mean = host_floats(C), b->invstd = host_floats(C);
  assert_int_equal(cpu->batch_norm_stats(b->mean, b->invstd, NULL, NULL, b->x, N, C, HW, 0.1f,
                                         1e-5f, &host_arena),
                   DDP_OK);
  reset_arenas();
  b->d_x = dev_copy(b->x, b->n);
  b->d_weight = dev_copy(b->weight, C), b->d_bias = dev_copy(b->bias, C);
  b->d_mean = dev_copy(b->mean, C), b->d_invstd = dev_copy(b->invstd, C);
}

static void bn_data_free(bn_data *b) {
  free(b->x), free(b->weight), free(b->bias), free(b->mean), free(b->invstd);
  ddp__cuda_free(b->d_x), ddp__cuda_free(b->d_weight), ddp__cuda_free(b->d_bias);
  ddp__cuda_free(b->d_mean), ddp__cuda_free(b->d_invstd);
}

static const int64_t bn_shapes[][3] = {{100, 16, 28 * 28}, {100, 32, 14 * 14}, {100, 128, 1}};

static void shape_str(char *buf, size_t bytes, const bn_data *b) {
  snprintf(buf, bytes, "(%lld, %lld, %lld)", (long long)b->N, (long long)b->C, (long long)b->HW);
}

static void test_batch_norm_stats_forward(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 3);
  for (size_t s = 0; s < sizeof bn_shapes / sizeof bn_shapes[0]; s++) {
    bn_data b;
    bn_data_init(&b, bn_shapes[s][0], bn_shapes[s][1], bn_shapes[s][2]);
    const int64_t C = b.C;
    char what[160], shape[64];
    shape_str(shape, sizeof shape, &b);
    float *mean = host_floats(C), *invstd = host_floats(C), *rm = host_floats(C),
          *rv = host_floats(C);
    float *d_mean = dev_alloc((size_t)C * 4), *d_invstd = dev_alloc((size_t)C * 4);
    for (int update = 0; update <= 1; update++) {
      fill_uniform(rm, C, -1.0f, 1.0f);
      fill_uniform(rv, C, 0.5f, 2.0f);
      float *d_rm = dev_copy(rm, C), *d_rv = dev_copy(rv, C);
      assert_int_equal(cpu->batch_norm_stats(mean, invstd, update ? rm : NULL,
                                             update ? rv : NULL, b.x, b.N, C, b.HW, 0.1f, 1e-5f,
                                             &host_arena),
                       DDP_OK);
      assert_int_equal(gpu->batch_norm_stats(d_mean, d_invstd, update ? d_rm : NULL,
                                             update ? d_rv : NULL, b.d_x, b.N, C, b.HW, 0.1f,
                                             1e-5f, &dev_arena),
                       DDP_OK);
      snprintf(what, sizeof what, "%s%s", shape, update ? ", running update" : "");
      expect_close("batch_norm_stats", what, d_mean, mean, C);
      expect_close("batch_norm_stats", what, d_invstd, invstd, C);
      expect_close("batch_norm_stats", what, d_rm, rm, C); /* unchanged without update */
      expect_close("batch_norm_stats", what, d_rv, rv, C);
      reset_arenas();

      cpu->batch_norm_running(mean, invstd, rm, rv, C, 1e-5f);
      gpu->batch_norm_running(d_mean, d_invstd, d_rm, d_rv, C, 1e-5f);
      expect_close("batch_norm_running", shape, d_mean, mean, C);
      expect_close("batch_norm_running", shape, d_invstd, invstd, C);
      ddp__cuda_free(d_rm), ddp__cuda_free(d_rv);
    }

    float *y = host_floats(b.n), *d_y = dev_alloc((size_t)b.n * 4);
    for (int affine = 0; affine < 3; affine++) { /* weight and bias, neither, weight only */
      const bool w = affine != 1, bi = affine == 0;
      cpu->batch_norm_forward(y, b.x, b.mean, b.invstd, w ? b.weight : NULL, bi ? b.bias : NULL,
                              b.N, C, b.HW);
      gpu->batch_norm_forward(d_y, b.d_x, b.d_mean, b.d_invstd, w ? b.d_weight : NULL,
                              bi ? b.d_bias : NULL, b.N, C, b.HW);
      snprintf(what, sizeof what, "%s, weight %s, bias %s", shape, w ? "yes" : "no",
               bi ? "yes" : "no");
      expect_close("batch_norm_forward", what, d_y, y, b.n);
    }
    free(y), ddp__cuda_free(d_y);
    free(mean), free(invstd), free(rm), free(rv);
    ddp__cuda_free(d_mean), ddp__cuda_free(d_invstd);
    bn_data_free(&b);
  }
}

/* The gradient reaching batch norm's output on both sides: dense, or
 * pooled with an argmax from a CPU max_pool2d_forward (relu and batch
 * norm's affine map, as the fused op) over windows of kernel x stride. */
typedef struct bn_dy {
  ddp__bn_grad cpu, gpu;
  float *dense, *pooled, *scratch; /* host */
  void *argmax;                   /* host */
  int64_t windows, closed;        /* windows, and those relu closed */
} bn_dy;

static void bn_dy_dense(bn_dy *g, const bn_data *b) {
  memset(g, 0, sizeof *g);
  g->dense = host_floats(b->n);
  fill_normal(g->dense, b->n, 1.0f);
  g->cpu.dense = g->dense;
  g->gpu.dense = dev_copy(g->dense, b->n);
}

static void bn_dy_pooled(bn_dy *g, const bn_data *b, int64_t h, int64_t w, int64_t kernel,
                         int64_t stride) {
  memset(g, 0, sizeof *g);
  assert_int_equal(h * w, b->HW);
  const int64_t oh = (h - kernel) / stride + 1, ow = (w - kernel) / stride + 1;
  const int64_t planes = b->N * b->C, windows = planes * oh * ow;
  const int64_t arg_bytes = ddp__pool_arg_bytes(kernel);
  /* batch norm's map, odd channels shifted down so that relu closes some
   * large windows too */
  float *scale = host_floats(b->C), *shift = host_floats(b->C), *y = host_floats(windows);
  for (int64_t c = 0; c < b->C; c++) {
    scale[c] = b->invstd[c] * b->weight[c];
    shift[c] = b->bias[c] - (c % 2 ? 2.5f : 0.0f);
  }
  const ddp__pool_affine affine = {b->mean, scale, shift, b->C};
  g->argmax = host_alloc((size_t)(windows * arg_bytes));
  ddp__cpu_dense_kernels.max_pool2d_forward(y, g->argmax, NULL, b->x, planes, h, w, kernel,
                                            stride, oh, ow, true, &affine);
  for (int64_t i = 0; i < windows; i++) g->closed += ddp__pool_arg_get(g->argmax, i, arg_bytes) < 0;
  free(scale), free(shift), free(y);
  g->windows = windows;
  g->pooled = host_floats(windows);
  fill_normal(g->pooled, windows, 1.0f);
  g->scratch = host_floats(b->HW == 1 ? planes : b->HW);
  const ddp__bn_grad geometry = {.h = h, .w = w, .kernel = kernel, .stride = stride, .oh = oh,
                                 .ow = ow};
  g->cpu = geometry, g->gpu = geometry;
  g->cpu.pooled = g->pooled, g->cpu.argmax = g->argmax, g->cpu.scratch = g->scratch;
  g->gpu.pooled = dev_copy(g->pooled, windows);
  g->gpu.argmax = dev_copy_bytes(g->argmax, (size_t)(windows * arg_bytes));
}

static void bn_dy_free(bn_dy *g) {
  free(g->dense), free(g->pooled), free(g->scratch), free(g->argmax);
  ddp__cuda_free((void *)g->gpu.dense), ddp__cuda_free((void *)g->gpu.pooled);
  ddp__cuda_free((void *)g->gpu.argmax);
}

/* batch_norm_backward on both sides for every combination of batch_stats,
 * accumulate, dx in place (when assigning), weight and bias gradients
 * wanted, and weight given; dx, dweight and dbias compared. */
static void bn_backward_cases(const char *kernel, const bn_data *b, const bn_dy *g) {
  const int64_t n = b->n, C = b->C;
  char what[200], shape[64];
  shape_str(shape, sizeof shape, b);
  float *dx = host_floats(n), *dw = host_floats(C), *db = host_floats(C);
  float *d_dx = dev_alloc((size_t)n * 4), *d_dw = dev_alloc((size_t)C * 4),
        *d_db = dev_alloc((size_t)C * 4);
  for (int combo = 0; combo < 24; combo++) {
    const bool batch_stats = combo & 1, accumulate = combo & 2, in_place = combo & 4;
    const bool grads = combo < 16 ? (combo & 8) : true, weight = combo < 16;
    if (in_place && accumulate) continue;
    snprintf(what, sizeof what, "%s, batch_stats %d, accumulate %d, in place %d, dweight/dbias %d, "
             "weight %d", shape, batch_stats, accumulate, in_place, grads, weight);
    if (in_place)
      memcpy(dx, b->x, (size_t)n * 4);
    else
      fill_normal(dx, n, 1.0f);
    fill_normal(dw, C, 1.0f);
    fill_normal(db, C, 1.0f);
    upload_bytes(d_dx, dx, (size_t)n * 4);
    upload_bytes(d_dw, dw, (size_t)C * 4);
    upload_bytes(d_db, db, (size_t)C * 4);
    assert_int_equal(cpu->batch_norm_backward(dx, grads ? dw : NULL, grads ? db : NULL, &g->cpu,
                                              in_place ? dx : b->x, b->mean, b->invstd,
                                              weight ? b->weight : NULL, b->N, C, b->HW,
                                              batch_stats, accumulate, &host_arena),
                     DDP_OK);
    assert_int_equal(gpu->batch_norm_backward(d_dx, grads ? d_dw : NULL, grads ? d_db : NULL,
                                              &g->gpu, in_place ? d_dx : b->d_x, b->d_mean,
                                              b->d_invstd, weight ? b->d_weight : NULL, b->N, C,
                                              b->HW, batch_stats, accumulate, &dev_arena),
                     DDP_OK);
    expect_close(kernel, what, d_dx, dx, n);
    expect_close(kernel, what, d_dw, dw, C); /* unchanged when not wanted */
    expect_close(kernel, what, d_db, db, C);
    reset_arenas();
  }
  free(dx), free(dw), free(db);
  ddp__cuda_free(d_dx), ddp__cuda_free(d_dw), ddp__cuda_free(d_db);
}

/* The synchronized backward's phases on both sides: backward_reduce's sums
 * and affine gradients, then backward_dx from the CPU's sums (as if summed
 * across ranks), assigning (also in place) and accumulating. */
static void bn_sync_backward_cases(const char *reduce_kernel, const char *dx_kernel,
                                   const bn_data *b, const bn_dy *g) {
  const int64_t n = b->n, C = b->C;
  char shape[64], what[160];
  shape_str(shape, sizeof shape, b);
  double *sums = host_alloc((size_t)(2 * C) * sizeof(double));
  double *gsums = host_alloc((size_t)(2 * C) * sizeof(double));
  float *dw = host_floats(C), *db = host_floats(C), *dx = host_floats(n);
  float *d_dw = dev_alloc((size_t)C * 4), *d_db = dev_alloc((size_t)C * 4);
  float *d_dx = dev_alloc((size_t)n * 4);
  for (int grads = 0; grads <= 1; grads++) {
    fill_normal(dw, C, 1.0f);
    fill_normal(db, C, 1.0f);
    upload_bytes(d_dw, dw, (size_t)C * 4);
    upload_bytes(d_db, db, (size_t)C * 4);
    cpu->batch_norm_backward_reduce(sums, grads ? dw : NULL, grads ? db : NULL, &g->cpu, b->x,
                                    b->mean, b->invstd, b->N, C, b->HW);
    gpu->batch_norm_backward_reduce(gsums, grads ? d_dw : NULL, grads ? d_db : NULL, &g->gpu,
                                    b->d_x, b->d_mean, b->d_invstd, b->N, C, b->HW);
    snprintf(what, sizeof what, "%s, dweight/dbias %d", shape, grads);
    expect_close_doubles(reduce_kernel, what, gsums, sums, C);
    expect_close_doubles(reduce_kernel, what, gsums + C, sums + C, C);
    expect_close(reduce_kernel, what, d_dw, dw, C);
    expect_close(reduce_kernel, what, d_db, db, C);
  }
  for (int mode = 0; mode < 3; mode++) { /* accumulate, assign, assign in place */
    const bool accumulate = mode == 0, in_place = mode == 2;
    if (in_place)
      memcpy(dx, b->x, (size_t)n * 4);
    else
      fill_normal(dx, n, 1.0f);
    upload_bytes(d_dx, dx, (size_t)n * 4);
    assert_int_equal(cpu->batch_norm_backward_dx(dx, &g->cpu, in_place ? dx : b->x, b->mean,
                                                 b->invstd, b->weight, sums, b->N * b->HW, b->N,
                                                 C, b->HW, accumulate, &host_arena),
                     DDP_OK);
    assert_int_equal(gpu->batch_norm_backward_dx(d_dx, &g->gpu, in_place ? d_dx : b->d_x,
                                                 b->d_mean, b->d_invstd, b->d_weight, sums,
                                                 b->N * b->HW, b->N, C, b->HW, accumulate,
                                                 &dev_arena),
                     DDP_OK);
    snprintf(what, sizeof what, "%s, accumulate %d, in place %d", shape, accumulate, in_place);
    expect_close(dx_kernel, what, d_dx, dx, n);
    reset_arenas();
  }
  free(sums), free(gsums), free(dw), free(db), free(dx);
  ddp__cuda_free(d_dw), ddp__cuda_free(d_db), ddp__cuda_free(d_dx);
}

static void test_batch_norm_backward_dense(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 4);
  for (size_t s = 0; s < sizeof bn_shapes / sizeof bn_shapes[0]; s++) {
    bn_data b;
    bn_data_init(&b, bn_shapes[s][0], bn_shapes[s][1], bn_shapes[s][2]);
    bn_dy g;
    bn_dy_dense(&g, &b);
    bn_backward_cases("batch_norm_backward (dense dy)", &b, &g);
    bn_sync_backward_cases("batch_norm_backward_reduce (dense dy)",
                           "batch_norm_backward_dx (dense dy)", &b, &g);
    bn_dy_free(&g);
    bn_data_free(&b);
  }
}

static void test_batch_norm_backward_pooled(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 5);
  /* N, C, h, w, kernel, stride */
  static const int64_t cases[][6] = {
      {100, 16, 28, 28, 2, 2}, /* the ConvNet's two fused blocks */
      {100, 32, 14, 14, 2, 2},
      {8, 4, 9, 9, 3, 2},     /* overlapping windows: a position in up to 4 */
      {6, 3, 25, 25, 12, 12}, /* int32 argmax; the last row and column in no window */
      {100, 128, 1, 1, 1, 1}, /* 1x1 planes: batch norm's rows */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const int64_t *cs = cases[i];
    bn_data b;
    bn_data_init(&b, cs[0], cs[1], cs[2] * cs[3]);
    bn_dy g;
    bn_dy_pooled(&g, &b, cs[2], cs[3], cs[4], cs[5]);
    /* relu must have closed some windows and left others open, or the -1
     * argmax or the gather goes untested */
    if (g.closed == 0 || g.closed == g.windows)
      fail_msg("case %zu: relu closed %lld of %lld windows", i, (long long)g.closed,
               (long long)g.windows);
    bn_backward_cases("batch_norm_backward (pooled dy)", &b, &g);
    bn_sync_backward_cases("batch_norm_backward_reduce (pooled dy)",
                           "batch_norm_backward_dx (pooled dy)", &b, &g);
    bn_dy_free(&g);
    bn_data_free(&b);
  }
}

static void test_batch_norm_sync_stats(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 6);
  for (size_t s = 0; s < sizeof bn_shapes / sizeof bn_shapes[0]; s++) {
    bn_data b;
    bn_data_init(&b, bn_shapes[s][0], bn_shapes[s][1], bn_shapes[s][2]);
    const int64_t C = b.C, count = b.N * b.HW;
    char shape[64], what[120];
    shape_str(shape, sizeof shape, &b);
    double *sums = host_alloc((size_t)(2 * C) * sizeof(double));
    double *gsums = host_alloc((size_t)(2 * C) * sizeof(double));
    cpu->batch_norm_sums(sums, b.x, b.N, C, b.HW);
    gpu->batch_norm_sums(gsums, b.d_x, b.N, C, b.HW);
    expect_close_doubles("batch_norm_sums", shape, gsums, sums, C);
    expect_close_doubles("batch_norm_sums", shape, gsums + C, sums + C, C);

    float *mean = host_floats(C), *invstd = host_floats(C), *rm = host_floats(C),
          *rv = host_floats(C);
    float *d_mean = dev_alloc((size_t)C * 4), *d_invstd = dev_alloc((size_t)C * 4);
    for (int update = 0; update <= 1; update++) {
      fill_uniform(rm, C, -1.0f, 1.0f);
      fill_uniform(rv, C, 0.5f, 2.0f);
      float *d_rm = dev_copy(rm, C), *d_rv = dev_copy(rv, C);
      /* both from the CPU's sums: as if summed across ranks */
      cpu->batch_norm_stats_from_sums(mean, invstd, update ? rm : NULL, update ? rv : NULL, sums,
                                      count, C, 0.1f, 1e-5f);
      gpu->batch_norm_stats_from_sums(d_mean, d_invstd, update ? d_rm : NULL,
                                      update ? d_rv : NULL, sums, count, C, 0.1f, 1e-5f);
      snprintf(what, sizeof what, "%s%s", shape, update ? ", running update" : "");
      expect_close("batch_norm_stats_from_sums", what, d_mean, mean, C);
      expect_close("batch_norm_stats_from_sums", what, d_invstd, invstd, C);
      expect_close("batch_norm_stats_from_sums", what, d_rm, rm, C);
      expect_close("batch_norm_stats_from_sums", what, d_rv, rv, C);
      ddp__cuda_free(d_rm), ddp__cuda_free(d_rv);
    }
    free(sums), free(gsums), free(mean), free(invstd), free(rm), free(rv);
    ddp__cuda_free(d_mean), ddp__cuda_free(d_invstd);
    bn_data_free(&b);
  }
}

/* ---- log_softmax and the losses ---- */

/* Targets in [0, C) for N samples. */
static int64_t *random_targets(int64_t N, int64_t C) {
  int64_t *t = host_alloc((size_t)N * sizeof(int64_t));
  for (int64_t i = 0; i < N; i++) t[i] = (int64_t)ddp_rng_below(&rng, (uint64_t)C);
  return t;
}

/* A device scalar holding v. */
static float *dev_scalar(float v) { return dev_copy(&v, 1); }

typedef int64_t (*target_loss)(float *loss, float *stats, const float *scores,
                               const int64_t *target, int64_t N, int64_t C, int64_t *bad_target);

static int64_t cpu_nll(float *loss, float *stats, const float *s, const int64_t *t, int64_t N,
                       int64_t C, int64_t *bad) {
  (void)stats;
  return cpu->nll_loss(loss, s, t, N, C, bad);
}
static int64_t gpu_nll(float *loss, float *stats, const float *s, const int64_t *t, int64_t N,
                       int64_t C, int64_t *bad) {
  (void)stats;
  return gpu->nll_loss(loss, s, t, N, C, bad);
}

/* Bad targets: the first one (by sample) is reported, with its value, by
 * both; several bad ones, one at 0, one last. The CPU's kernel returns it;
 * CUDA's returns -1 and the next synchronize reports it (DDP_ERR_RANGE,
 * the same sample and value), once, with the loss NaN (kernels_pointwise.h). */
static void bad_target_cases(const char *kernel, target_loss cpu_f, target_loss gpu_f,
                             const float *scores, const float *d_scores, int64_t N, int64_t C) {
  int64_t *t = random_targets(N, C);
  float loss, *d_loss = dev_alloc(4), *stats = host_floats(2 * N);
  float *d_stats = dev_alloc((size_t)(2 * N) * 4);
  int64_t *d_t = dev_alloc((size_t)N * sizeof(int64_t));
  struct {
    int64_t at[2], value[2];
  } cases[] = {{{37, 60}, {C, -1}}, {{0, -1}, {-3, 0}}, {{N - 1, -1}, {C + 5, 0}},
               {{N / 2, N / 2 + 1}, {-1, C}}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    int64_t *bt = host_alloc((size_t)N * sizeof(int64_t));
    memcpy(bt, t, (size_t)N * sizeof(int64_t));
    for (int j = 0; j < 2; j++)
      if (cases[k].at[j] >= 0) bt[cases[k].at[j]] = cases[k].value[j];
    upload_bytes(d_t, bt, (size_t)N * sizeof(int64_t));
    int64_t cpu_bad = 12345, gpu_bad = 54321;
    const int64_t cpu_at = cpu_f(&loss, stats, scores, bt, N, C, &cpu_bad);
    const int64_t gpu_at = gpu_f(d_loss, d_stats, d_scores, d_t, N, C, &gpu_bad);
    assert_int_equal(cpu_at, cases[k].at[0]);
    if (gpu_at != -1)
      fail_msg("%s: cuda's kernel returned %lld; it reports at the next synchronize", kernel,
               (long long)gpu_at);
    char want[160];
    snprintf(want, sizeof want, "%s: target[%lld] = %lld is out of range for %lld classes",
             kernel, (long long)cpu_at, (long long)cpu_bad, (long long)C);
    const ddp_status st = ddp_device_synchronize(DDP_CUDA(0));
    if (st != DDP_ERR_RANGE || !strstr(ddp_last_error(), want))
      fail_msg("%s: expected the next synchronize to say \"%s\", got %s: %s", kernel, want,
               ddp_status_name(st), ddp_last_error());
    synchronize(); /* reported once */
    float gpu_loss = 0;
    download_bytes(&gpu_loss, d_loss, sizeof gpu_loss);
    if (!isnan(gpu_loss)) fail_msg("%s: the loss is %g with a bad target, not NaN", kernel,
                                   (double)gpu_loss);
    free(bt);
  }
  free(t), free(stats);
  ddp__cuda_free(d_loss), ddp__cuda_free(d_stats), ddp__cuda_free(d_t);
}

static void test_log_softmax_nll(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 7);
  const int64_t N = 100, C = 10, n = N * C;
  for (int big = 0; big <= 1; big++) { /* logits of a few units, then near 1e3 */
    const char *what = big ? "(100, 10), logits ~1e3" : "(100, 10)";
    float *x = host_floats(n), *y = host_floats(n), *dy = host_floats(n), *dx = host_floats(n);
    fill_normal(x, n, big ? 300.0f : 3.0f);
    if (big)
      for (int64_t i = 0; i < n; i++) x[i] += 1000.0f;
    fill_normal(dy, n, 1.0f);
    fill_normal(dx, n, 1.0f);
    float *d_x = dev_copy(x, n), *d_y = dev_alloc((size_t)n * 4), *d_dy = dev_copy(dy, n),
          *d_dx = dev_copy(dx, n);
    cpu->log_softmax(y, x, N, C);
    gpu->log_softmax(d_y, d_x, N, C);
    expect_close("log_softmax", what, d_y, y, n);
    upload_bytes(d_y, y, (size_t)n * 4);
    cpu->log_softmax_backward(dx, dy, y, N, C);
    gpu->log_softmax_backward(d_dx, d_dy, d_y, N, C);
    expect_close("log_softmax_backward", what, d_dx, dx, n);

    /* nll over the CPU's log-probabilities */
    int64_t *t = random_targets(N, C), *d_t = dev_copy_bytes(t, (size_t)N * sizeof(int64_t));
    float loss, *d_loss = dev_alloc(4);
    int64_t bad = -7, gbad = -7;
    assert_int_equal(cpu->nll_loss(&loss, y, t, N, C, &bad), -1);
    assert_int_equal(gpu->nll_loss(d_loss, d_y, d_t, N, C, &gbad), -1);
    expect_close("nll_loss", what, d_loss, &loss, 1);
    float *d_dloss = dev_scalar(0.7f), dloss = 0.7f;
    fill_normal(dx, n, 1.0f);
    upload_bytes(d_dx, dx, (size_t)n * 4);
    cpu->nll_loss_backward(dx, &dloss, t, N, C);
    gpu->nll_loss_backward(d_dx, d_dloss, d_t, N, C);
    expect_close("nll_loss_backward", what, d_dx, dx, n);
    if (!big) bad_target_cases("nll_loss", cpu_nll, gpu_nll, y, d_y, N, C);
    free(x), free(y), free(dy), free(dx), free(t);
    ddp__cuda_free(d_x), ddp__cuda_free(d_y), ddp__cuda_free(d_dy), ddp__cuda_free(d_dx);
    ddp__cuda_free(d_t), ddp__cuda_free(d_loss), ddp__cuda_free(d_dloss);
  }
}

static void test_cross_entropy(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 8);
  const int64_t shapes[][2] = {{100, 10}, {1024, 10}, {100, 10}};
  for (int s = 0; s < 3; s++) {
    const int64_t N = shapes[s][0], C = shapes[s][1], n = N * C;
    const bool big = s == 2;
    char what[64];
    snprintf(what, sizeof what, "(%lld, %lld)%s", (long long)N, (long long)C,
             big ? ", logits ~1e3" : "");
    float *x = host_floats(n), *stats = host_floats(2 * N), *dx = host_floats(n);
    fill_normal(x, n, big ? 300.0f : 3.0f);
    if (big)
      for (int64_t i = 0; i < n; i++) x[i] += 1000.0f;
    fill_normal(dx, n, 1.0f);
    int64_t *t = random_targets(N, C), *d_t = dev_copy_bytes(t, (size_t)N * sizeof(int64_t));
    float *d_x = dev_copy(x, n), *d_stats = dev_alloc((size_t)(2 * N) * 4),
          *d_dx = dev_copy(dx, n);
    float loss, *d_loss = dev_alloc(4);
    int64_t bad = -7, gbad = -7;
    assert_int_equal(cpu->cross_entropy(&loss, stats, x, t, N, C, &bad), -1);
    assert_int_equal(gpu->cross_entropy(d_loss, d_stats, d_x, d_t, N, C, &gbad), -1);
    expect_close("cross_entropy", what, d_loss, &loss, 1);
    /* the rows' max and log-sum apart: their scales differ */
    float *gstats = host_floats(2 * N), *part = host_floats(4 * N);
    synchronize();
    download_bytes(gstats, d_stats, (size_t)(2 * N) * 4);
    for (int64_t i = 0; i < N; i++)
      for (int k = 0; k < 2; k++)
        part[k * N + i] = gstats[2 * i + k], part[(2 + k) * N + i] = stats[2 * i + k];
    expect_close_host("cross_entropy", "stats: max", part, part + 2 * N, N);
    expect_close_host("cross_entropy", "stats: log_sum", part + N, part + 3 * N, N);
    free(gstats), free(part);

    upload_bytes(d_stats, stats, (size_t)(2 * N) * 4);
    float dloss = 1.3f, *d_dloss = dev_scalar(dloss);
    cpu->cross_entropy_backward(dx, &dloss, x, stats, t, N, C);
    gpu->cross_entropy_backward(d_dx, d_dloss, d_x, d_stats, d_t, N, C);
    expect_close("cross_entropy_backward", what, d_dx, dx, n);
    if (!big)
      bad_target_cases("cross_entropy", cpu->cross_entropy, gpu->cross_entropy, x, d_x, N, C);
    free(x), free(stats), free(dx), free(t);
    ddp__cuda_free(d_t), ddp__cuda_free(d_x), ddp__cuda_free(d_stats), ddp__cuda_free(d_dx);
    ddp__cuda_free(d_loss), ddp__cuda_free(d_dloss);
  }
}

static void test_mse(void **state) {
  (void)state;
  ddp_rng_seed(&rng, 9);
  const int64_t n = 20 * 5;
  float *in = host_floats(n), *tg = host_floats(n), *di = host_floats(n), *dt = host_floats(n);
  fill_normal(in, n, 1.0f);
  fill_normal(tg, n, 1.0f);
  float *d_in = dev_copy(in, n), *d_tg = dev_copy(tg, n);
  float *d_di = dev_alloc((size_t)n * 4), *d_dt = dev_alloc((size_t)n * 4);
  float loss, *d_loss = dev_alloc(4);
  cpu->mse_loss(&loss, in, tg, n);
  gpu->mse_loss(d_loss, d_in, d_tg, n);
  expect_close("mse_loss", "(20, 5)", d_loss, &loss, 1);
  float dloss = 0.9f, *d_dloss = dev_scalar(dloss);
  for (int want = 1; want <= 3; want++) { /* dinput, dtarget, both */
    const bool wi = want & 1, wt = want & 2;
    fill_normal(di, n, 1.0f);
    fill_normal(dt, n, 1.0f);
    upload_bytes(d_di, di, (size_t)n * 4);
    upload_bytes(d_dt, dt, (size_t)n * 4);
    cpu->mse_loss_backward(wi ? di : NULL, wt ? dt : NULL, &dloss, in, tg, n);
    gpu->mse_loss_backward(wi ? d_di : NULL, wt ? d_dt : NULL, d_dloss, d_in, d_tg, n);
    const char *what = wi && wt ? "(20, 5), both" : wi ? "(20, 5), dinput" : "(20, 5), dtarget";
    expect_close("mse_loss_backward", what, d_di, di, n); /* unchanged when NULL */
    expect_close("mse_loss_backward", what, d_dt, dt, n);
  }
  free(in), free(tg), free(di), free(dt);
  ddp__cuda_free(d_in), ddp__cuda_free(d_tg), ddp__cuda_free(d_di), ddp__cuda_free(d_dt);
  ddp__cuda_free(d_loss), ddp__cuda_free(d_dloss);
}

/* The table has every entry but the CPU-only convolution fold. */
static void test_table_complete(void **state) {
  (void)state;
  const void *const *entries = (const void *const *)gpu;
  const size_t count = sizeof *gpu / sizeof(void *);
  const size_t fold = offsetof(ddp__pointwise_kernels, batch_norm_backward_conv) / sizeof(void *);
  for (size_t i = 0; i < count; i++)
    if (i == fold)
      assert_null(entries[i]);
    else if (!entries[i])
      fail_msg("entry %zu of ddp__cuda_pointwise_kernels is NULL", i);
}

int main(void) {
  cuda_test_require_device();
  if (ddp__cuda_set_device(0) != DDP_OK) {
    printf("cuda:0: %s\n", ddp_last_error());
    return 1;
  }
  ddp_arena_init(&host_arena, 0);
  ddp_arena_init_backed(&dev_arena, 0, ddp__cuda_arena_backing());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table_complete),
      cmocka_unit_test(test_activations),
      cmocka_unit_test(test_dropout),
      cmocka_unit_test(test_batch_norm_stats_forward),
      cmocka_unit_test(test_batch_norm_backward_dense),
      cmocka_unit_test(test_batch_norm_backward_pooled),
      cmocka_unit_test(test_batch_norm_sync_stats),
      cmocka_unit_test(test_log_softmax_nll),
      cmocka_unit_test(test_cross_entropy),
      cmocka_unit_test(test_mse),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  for (int i = 0; i < n_seen; i++)
    printf("cuda vs cpu: %-40s max relative difference %.3g over %d tensors\n", seen[i].kernel,
           seen[i].worst, seen[i].tensors);
  ddp_arena_free(&host_arena);
  ddp_arena_free(&dev_arena);
  return failed;
}
