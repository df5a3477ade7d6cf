/* CUDA graphs on a GPU (src/tensor/cuda/graph.c, the runtime's hooks, the
 * trainer's cuda_graph):
 *  - seed 001's ConvNet: 3 eager steps, the 4th captured (zero_grad,
 *    forward, loss, backward, the loss copied into pinned memory) and
 *    replayed for steps 4..10 with a new batch copied into the fixed
 *    inputs each time, the SGD step eager after each replay; against 10
 *    eager steps from the same start: parameters, running statistics,
 *    num_batches_tracked and every step's loss within 1e-5 max|b| + 1e-7
 *    (and said whether bitwise); no cudaMalloc from the capture on;
 *  - memory: a block freed during the capture is reused by the capture
 *    itself but by no one else while the graph lives, and comes back to
 *    the cache when it is destroyed; likewise a block allocated in the
 *    capture and freed after it; a replay writes only the graph's blocks;
 *  - refusals: a synchronize, a copy to the host, a copy from pageable
 *    memory, pinned allocation, a cudaMalloc (memory not warmed up) and
 *    dropout's host-drawn masks during a capture are refused with errors
 *    saying so, the capture's end fails with the first of them and the
 *    device works on; begin twice, end without begin, the CPU;
 *  - a bad target of cross_entropy / nll_loss is reported at the next
 *    synchronize (sample, value, classes), eagerly and from a replay, the
 *    first one since the last report;
 *  - asynchronous copies need pinned memory; the stage's uploads arrive;
 *  - the trainer: seed 000's head/tail model on toydata, 2 epochs of 20
 *    full batches and a short one, with cuda_graph against without.
 * Skips (77) without a GPU. */
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
#include "ddp/ddp.h"
#include "ddp/train.h"
#include "tensor/cuda/runtime.h"
#include "tensor/kernels.h"

#define GPU DDP_CUDA(0)
#define MiB ((size_t)1 << 20)

static void ok(ddp_status s, const char *what) {
  if (s != DDP_OK) fail_msg("%s: %s (%s)", what, ddp_last_error(), ddp_status_name(s));
}

static void sync_ok(void) { ok(ddp_device_synchronize(GPU), "synchronize"); }

static uint64_t driver_allocs(void) {
  ddp__cuda_mem_stats s;
  ddp__cuda_mem_stats_get(&s);
  return s.driver_allocs;
}

/* `bytes` of device memory at dev, on the host (waits). */
static void *to_host(const void *dev, size_t bytes) {
  void *h = malloc(bytes ? bytes : 1);
  assert_non_null(h);
  ok(ddp__cuda_copy(h, dev, bytes, cudaMemcpyDeviceToHost), "reading back");
  return h;
}

/* Whether the last error mentions `needle`; prints it either way. */
static void expect_error(ddp_status got, ddp_status want, const char *needle) {
  printf("  refused (%s): %s\n", ddp_status_name(got), ddp_last_error());
  if (got != want)
    fail_msg("expected %s, got %s: %s", ddp_status_name(want), ddp_status_name(got),
             ddp_last_error());
  if (!strstr(ddp_last_error(), needle))
    fail_msg("the error does not say \"%s\": %s", needle, ddp_last_error());
}

/* Compares n floats, the CUDA graph run's a against the eager run's b:
 * within the bound (cuda_test_close), and says whether bitwise. */
static bool compare(const char *what, const float *a, const float *b, long n) {
  bool bitwise = memcmp(a, b, (size_t)n * sizeof(float)) == 0;
  double worst = 0;
  for (long i = 0; i < n; i++) {
    double d = a[i] > b[i] ? (double)a[i] - b[i] : (double)b[i] - a[i];
    if (d > worst) worst = d;
  }
  printf("  %-28s %s (max |graph - eager| %.3g over %ld)\n", what,
         bitwise ? "bitwise equal" : "within the bound?", worst, n);
  return cuda_test_close(what, a, b, n);
}

/* ---- The ConvNet step, captured against eager ----------------------------- */

#define CONV_BATCH 100
#define CONV_STEPS 10
#define CONV_WARMUP 3

typedef struct run {
  ddp_model *model;
  ddp_optimizer *opt;
  ddp_tape *tape;
  ddp_tensor *x, *y; /* the batch on the GPU, refilled in place */
  float losses[CONV_STEPS];
} run;

static void run_make(run *r) {
  memset(r, 0, sizeof *r);
  ok(ddp_model_build("convnet", NULL, 1, &r->model), "building the ConvNet");
  ok(ddp_model_to(r->model, GPU), "moving it to cuda:0");
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  oo.device = GPU;
  ok(ddp_optimizer_create(&r->opt, &oo, ddp_model_params_flat(r->model),
                          ddp_model_grads_flat(r->model),
                          (size_t)ddp_model_num_param_elements(r->model)),
     "SGD");
  ok(ddp_tape_create(&r->tape, 1 << 20), "tape");
  int64_t xs[4] = {CONV_BATCH, 1, 28, 28}, ys[1] = {CONV_BATCH};
  ok(ddp_tensor_create_on(&r->x, DDP_FLOAT32, 4, xs, GPU), "x");
  ok(ddp_tensor_create_on(&r->y, DDP_INT64, 1, ys, GPU), "y");
}

static void run_free(run *r) {
  ddp_tensor_destroy(r->x);
  ddp_tensor_destroy(r->y);
  ddp_tape_destroy(r->tape);
  ddp_optimizer_destroy(r->opt);
  ddp_model_destroy(r->model);
}

/* Batch k (the same for both runs), copied into the run's inputs. */
static void load_batch(run *r, int k) {
  static float x[CONV_BATCH * 784];
  static int64_t y[CONV_BATCH];
  ddp_rng g;
  ddp_rng_seed(&g, 1000 + (uint64_t)k);
  for (int i = 0; i < CONV_BATCH * 784; i++) x[i] = ddp_rng_uniform(&g);
  for (int i = 0; i < CONV_BATCH; i++) y[i] = (int64_t)ddp_rng_below(&g, 10);
  ok(ddp__cuda_copy(r->x->data, x, sizeof x, cudaMemcpyHostToDevice), "uploading x");
  ok(ddp__cuda_copy(r->y->data, y, sizeof y, cudaMemcpyHostToDevice), "uploading y");
}

static void eager_step(run *r, int k) {
  ddp_tensor *out, *loss;
  ddp_tape_reset(r->tape);
  ddp_model_zero_grad(r->model);
  ok(ddp_model_forward(r->model, r->tape, r->x, &out), "forward");
  ok(ddp_model_loss(r->model, r->tape, out, r->y, &loss), "loss");
  ok(ddp_backward(r->tape, loss), "backward");
  ok(ddp__cuda_copy(&r->losses[k], loss->data, sizeof(float), cudaMemcpyDeviceToHost), "loss");
  ok(ddp_optimizer_step(r->opt), "SGD step");
}

static void test_convnet_step(void **state) {
  (void)state;
  run eager, graphed;
  run_make(&eager);
  for (int k = 0; k < CONV_STEPS; k++) {
    load_batch(&eager, k);
    eager_step(&eager, k);
  }
  sync_ok();

  run_make(&graphed);
  for (int k = 0; k < CONV_WARMUP; k++) {
    load_batch(&graphed, k);
    eager_step(&graphed, k);
  }
  float *loss_host;
  ok(ddp_pinned_alloc(GPU, sizeof(float), (void **)&loss_host), "pinned loss");
  sync_ok();
  const uint64_t allocs_before = driver_allocs();
  int64_t *counters = ddp_model_counters(graphed.model);
  const int n_counters = ddp_model_num_counters(graphed.model);
  assert_true(n_counters > 0 && n_counters <= 8);
  int64_t before[8], delta[8];
  memcpy(before, counters, sizeof(int64_t) * (size_t)n_counters);

  ddp_tape_reset(graphed.tape);
  ok(ddp_cuda_graph_begin(GPU), "begin");
  ddp_tensor *out, *loss;
  ddp_model_zero_grad(graphed.model);
  ok(ddp_model_forward(graphed.model, graphed.tape, graphed.x, &out), "forward (captured)");
  ok(ddp_model_loss(graphed.model, graphed.tape, out, graphed.y, &loss), "loss (captured)");
  ok(ddp_backward(graphed.tape, loss), "backward (captured)");
  ok(ddp_device_copy_async(DDP_CPU, loss_host, GPU, loss->data, sizeof(float)), "loss out");
  ddp_cuda_graph *graph;
  ok(ddp_cuda_graph_end(GPU, &graph), "capturing the step");
  assert_non_null(graph);
  for (int i = 0; i < n_counters; i++) {
    delta[i] = counters[i] - before[i];
    counters[i] = before[i];
    assert_int_equal(delta[i], 1); /* one BatchNorm forward each */
  }
  for (int k = CONV_WARMUP; k < CONV_STEPS; k++) {
    load_batch(&graphed, k); /* queued before the replay, on the stream */
    ok(ddp_cuda_graph_replay(graph), "replay");
    for (int i = 0; i < n_counters; i++) counters[i] += delta[i];
    ok(ddp_optimizer_step(graphed.opt), "SGD step");
    sync_ok();
    graphed.losses[k] = *loss_host;
  }
  const uint64_t allocs_after = driver_allocs();
  printf("  cudaMalloc calls from the capture to the last replay: %llu\n",
         (unsigned long long)(allocs_after - allocs_before));
  assert_int_equal(allocs_after, allocs_before);

  const long n = (long)ddp_model_num_param_elements(eager.model);
  float *pa = to_host(ddp_model_params_flat(graphed.model), (size_t)n * 4);
  float *pb = to_host(ddp_model_params_flat(eager.model), (size_t)n * 4);
  const long nb = (long)ddp_model_num_buffer_elements(eager.model);
  float *ba = to_host(ddp_model_buffers_flat(graphed.model), (size_t)nb * 4);
  float *bb = to_host(ddp_model_buffers_flat(eager.model), (size_t)nb * 4);
  bool good = compare("parameters after 10 steps", pa, pb, n);
  good &= compare("running statistics", ba, bb, nb);
  good &= compare("losses of the 10 steps", graphed.losses, eager.losses, CONV_STEPS);
  for (int k = 0; k < CONV_STEPS; k++)
    printf("    step %2d loss: graph %.7f eager %.7f%s\n", k + 1, (double)graphed.losses[k],
           (double)eager.losses[k], k < CONV_WARMUP ? " (both eager)" : "");
  for (int i = 0; i < n_counters; i++)
    assert_int_equal(ddp_model_counters(graphed.model)[i], ddp_model_counters(eager.model)[i]);
  assert_int_equal(ddp_model_counters(eager.model)[0], CONV_STEPS);
  if (!good) fail_msg("the replayed ConvNet steps differ from the eager ones");
  free(pa), free(pb), free(ba), free(bb);
  ddp_cuda_graph_destroy(graph);
  ddp_pinned_free(loss_host);
  run_free(&graphed);
  run_free(&eager);
  sync_ok();
}

/* ---- The graph's memory ------------------------------------------------------ */

/* Whether the n floats at dev all equal v. */
static bool all_equal(const void *dev, size_t n, float v) {
  float *h = to_host(dev, n * sizeof(float));
  bool same = true;
  for (size_t i = 0; i < n && same; i++) same = h[i] == v;
  free(h);
  return same;
}

static void test_pool_blocks(void **state) {
  (void)state;
  ok(ddp__cuda_set_device(0), "cuda:0");
  const ddp__kernels *k = ddp__kernels_for(GPU);
  /* The cache emptied, then two size classes cached once each: those
   * blocks are the only ones of their classes. */
  sync_ok();
  ddp__block_cache_empty(ddp__cuda_cache(0));
  const size_t X = 5 * MiB + 123, Y = 7 * MiB + 45;
  const size_t nx = X / 4, ny = Y / 4;
  void *warm_x = ddp__cuda_malloc(X), *warm_y = ddp__cuda_malloc(Y);
  assert_non_null(warm_x);
  assert_non_null(warm_y);
  ddp__cuda_free(warm_x);
  ddp__cuda_free(warm_y);
  sync_ok();
  const uint64_t allocs0 = driver_allocs();

  ok(ddp_cuda_graph_begin(GPU), "begin");
  void *p = ddp__cuda_malloc(X); /* a hit: the block cached above */
  assert_ptr_equal(p, warm_x);
  k->basic->fill(p, 7.0f, (int64_t)nx);
  ddp__cuda_free(p); /* to the capture's pool */
  void *p2 = ddp__cuda_malloc(X);
  assert_ptr_equal(p2, p); /* the capture reuses it, as eager work would */
  k->basic->fill(p2, 9.0f, (int64_t)nx);
  ddp__cuda_free(p2);
  void *h = ddp__cuda_malloc(Y); /* held past the capture */
  assert_ptr_equal(h, warm_y);
  k->basic->fill(h, 5.0f, (int64_t)ny);
  ddp_cuda_graph *graph;
  ok(ddp_cuda_graph_end(GPU, &graph), "end");
  assert_int_equal(driver_allocs(), allocs0);

  /* Outside: p is the graph's, so X comes from the driver. */
  void *q = ddp__cuda_malloc(X);
  assert_non_null(q);
  assert_ptr_not_equal(q, p);
  assert_int_equal(driver_allocs(), allocs0 + 1);
  k->basic->fill(q, 1.0f, (int64_t)nx);
  ddp__cuda_free(h); /* freed while the graph lives: stays the graph's */
  void *h2 = ddp__cuda_malloc(Y);
  assert_ptr_not_equal(h2, h);
  k->basic->fill(h2, 2.0f, (int64_t)ny);
  ok(ddp_cuda_graph_replay(graph), "replay");
  sync_ok();
  assert_true(all_equal(p, nx, 9.0f));  /* the replay wrote the graph's blocks */
  assert_true(all_equal(h, ny, 5.0f));
  assert_true(all_equal(q, nx, 1.0f));  /* and nobody else's */
  assert_true(all_equal(h2, ny, 2.0f));
  printf("  a block freed in the capture (%p) and one freed after it (%p) stayed the graph's\n",
         p, h);

  ddp__cuda_free(q);
  ddp__cuda_free(h2);
  ddp_cuda_graph_destroy(graph);
  /* Back in the cache: both of each class are cached now, and two
   * requests take both without the driver. */
  const uint64_t allocs1 = driver_allocs();
  void *a = ddp__cuda_malloc(X), *b = ddp__cuda_malloc(X);
  void *c = ddp__cuda_malloc(Y), *d = ddp__cuda_malloc(Y);
  assert_int_equal(driver_allocs(), allocs1);
  assert_true((a == p || b == p) && (c == h || d == h));
  ddp__cuda_free(a), ddp__cuda_free(b), ddp__cuda_free(c), ddp__cuda_free(d);
  sync_ok();
}

/* ---- Refusals ----------------------------------------------------------------- */

static void test_refusals(void **state) {
  (void)state;
  ddp_cuda_graph *graph = (ddp_cuda_graph *)1;
  expect_error(ddp_cuda_graph_end(GPU, &graph), DDP_ERR_STATE, "not capturing");
  assert_null(graph);
  expect_error(ddp_cuda_graph_begin(DDP_CPU), DDP_ERR_UNSUPPORTED, "not a GPU");

  int64_t four = 4;
  ddp_tensor *dev, *host;
  ok(ddp_tensor_create_on(&dev, DDP_FLOAT32, 1, &four, GPU), "dev");
  ok(ddp_tensor_create(&host, DDP_FLOAT32, 1, &four), "host");

  ok(ddp_cuda_graph_begin(GPU), "begin");
  expect_error(ddp_cuda_graph_begin(GPU), DDP_ERR_STATE, "captures on cuda:0 already");
  expect_error(ddp_device_synchronize(GPU), DDP_ERR_STATE,
               "synchronize during a CUDA graph capture");
  expect_error(ddp_tensor_copy(host, dev), DDP_ERR_STATE, "device to host during a CUDA graph");
  expect_error(ddp_tensor_copy(dev, host), DDP_ERR_STATE, "pageable");
  void *pinned = NULL;
  expect_error(ddp_pinned_alloc(GPU, 64, &pinned), DDP_ERR_STATE, "cudaMallocHost during");
  assert_null(pinned);
  expect_error(ddp_cuda_graph_end(GPU, &graph), DDP_ERR_STATE,
               "capture failed: cuda:0: synchronize during a CUDA graph capture");
  assert_null(graph);
  /* The device works on. */
  sync_ok();
  ok(ddp_tensor_copy(dev, host), "copy after the failed capture");
  ok(ddp_tensor_copy(host, dev), "copy back");

  /* Memory the cache does not hold: no cudaMalloc in a capture. */
  const size_t fresh = 37 * MiB + 5;
  ok(ddp_cuda_graph_begin(GPU), "begin");
  ok(ddp__cuda_set_device(0), "cuda:0");
  assert_null(ddp__cuda_malloc(fresh));
  printf("  refused: %s\n", ddp_last_error());
  assert_non_null(strstr(ddp_last_error(), "warm-up"));
  expect_error(ddp_cuda_graph_end(GPU, &graph), DDP_ERR_NOMEM, "warm-up");
  assert_null(graph);
  sync_ok();
  void *p = ddp__cuda_malloc(fresh); /* eagerly: fine */
  assert_non_null(p);
  ddp__cuda_free(p);

  /* Dropout draws its masks on the host: its copies are refused. */
  int64_t shape[2] = {64, 128};
  ddp_tensor *x;
  ok(ddp_tensor_create_on(&x, DDP_FLOAT32, 2, shape, GPU), "x");
  ddp_tape *tape;
  ok(ddp_tape_create(&tape, 1 << 20), "tape");
  ddp_tensor *y;
  ddp_rng rng;
  ddp_rng_seed(&rng, 3);
  ok(ddp_dropout(tape, x, 0.5f, true, &rng, &y), "warm-up dropout");
  sync_ok();
  ddp_tape_reset(tape);
  ok(ddp_cuda_graph_begin(GPU), "begin");
  (void)ddp_dropout(tape, x, 0.5f, true, &rng, &y); /* its copy's error goes to the capture */
  expect_error(ddp_cuda_graph_end(GPU, &graph), DDP_ERR_STATE, "pageable");
  assert_null(graph);
  sync_ok();

  /* Asynchronous copies want pinned memory, inside a capture or not. */
  expect_error(ddp_device_copy_async(DDP_CPU, ddp_tensor_f32(host), GPU, dev->data, 16),
               DDP_ERR_INVALID, "not pinned");
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_tensor_destroy(host);
  ddp_tensor_destroy(dev);
  sync_ok();
}

/* ---- Bad targets, reported at the next synchronize ---------------------------- */

static void test_bad_targets(void **state) {
  (void)state;
  const int64_t N = 8, C = 10;
  int64_t ls[2] = {N, C};
  ddp_tensor *logits, *target, *loss;
  ok(ddp_tensor_create_on(&logits, DDP_FLOAT32, 2, ls, GPU), "logits");
  ok(ddp_tensor_create_on(&target, DDP_INT64, 1, &N, GPU), "target");
  int64_t t[8] = {1, 2, 3, 12, 4, 5, 6, 7};
  ok(ddp__cuda_copy(target->data, t, sizeof t, cudaMemcpyHostToDevice), "targets");
  ddp_tape *tape;
  ok(ddp_tape_create(&tape, 1 << 20), "tape");

  /* Eager: the op returns at once, the synchronize says which. */
  ok(ddp_cross_entropy(tape, logits, target, &loss), "cross_entropy with a bad target");
  expect_error(ddp_device_synchronize(GPU), DDP_ERR_RANGE,
               "cross_entropy: target[3] = 12 is out of range for 10 classes");
  sync_ok(); /* reported once */
  float v = 0;
  ok(ddp__cuda_copy(&v, loss->data, sizeof v, cudaMemcpyDeviceToHost), "loss");
  assert_true(isnan(v));
  t[3] = 3, t[5] = -2, t[6] = 11;
  ok(ddp__cuda_copy(target->data, t, sizeof t, cudaMemcpyHostToDevice), "targets");
  ddp_tape_reset(tape);
  ddp_tensor *logp;
  ok(ddp_log_softmax(tape, logits, &logp), "log_softmax");
  ok(ddp_nll_loss(tape, logp, target, &loss), "nll_loss with bad targets");
  expect_error(ddp_device_synchronize(GPU), DDP_ERR_RANGE,
               "nll_loss: target[5] = -2 is out of range for 10 classes");
  sync_ok();

  /* From a replay: good, bad, two bad ones before a synchronize (the
   * first is reported), good again. */
  int64_t good[8] = {0, 1, 2, 3, 4, 5, 6, 9};
  ok(ddp__cuda_copy(target->data, good, sizeof good, cudaMemcpyHostToDevice), "targets");
  ddp_tape_reset(tape);
  ok(ddp_cross_entropy(tape, logits, target, &loss), "warm-up");
  sync_ok();
  ddp_tape_reset(tape);
  ok(ddp_cuda_graph_begin(GPU), "begin");
  ok(ddp_cross_entropy(tape, logits, target, &loss), "cross_entropy (captured)");
  ddp_cuda_graph *graph;
  ok(ddp_cuda_graph_end(GPU, &graph), "end");
  ok(ddp_cuda_graph_replay(graph), "replay");
  sync_ok();
  int64_t bad1[8] = {0, 1, 2, 3, 4, 5, 10, 9}, bad2[8] = {-1, 1, 2, 3, 4, 5, 6, 9};
  ok(ddp__cuda_copy(target->data, bad1, sizeof bad1, cudaMemcpyHostToDevice), "targets");
  ok(ddp_cuda_graph_replay(graph), "replay");
  ok(ddp__cuda_copy(target->data, bad2, sizeof bad2, cudaMemcpyHostToDevice), "targets");
  ok(ddp_cuda_graph_replay(graph), "replay");
  expect_error(ddp_device_synchronize(GPU), DDP_ERR_RANGE,
               "cross_entropy: target[6] = 10 is out of range for 10 classes");
  ok(ddp__cuda_copy(target->data, good, sizeof good, cudaMemcpyHostToDevice), "targets");
  ok(ddp_cuda_graph_replay(graph), "replay");
  sync_ok();
  ok(ddp__cuda_copy(&v, loss->data, sizeof v, cudaMemcpyDeviceToHost), "loss");
  assert_false(isnan(v));
  ddp_cuda_graph_destroy(graph);
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(target);
  ddp_tensor_destroy(logits);
  sync_ok();
}

/* ---- Staging and asynchronous copies ------------------------------------------ */

static void test_stage(void **state) {
  (void)state;
  ddp_device_stage *stage;
  ok(ddp_device_stage_create(GPU, &stage), "stage");
  int64_t n = 100000;
  ddp_tensor *a, *b;
  ok(ddp_tensor_create_on(&a, DDP_FLOAT32, 1, &n, GPU), "a");
  ok(ddp_tensor_create_on(&b, DDP_INT64, 1, &n, GPU), "b");
  float *fa = malloc((size_t)n * 4);
  int64_t *ib = malloc((size_t)n * 8), *back_b = malloc((size_t)n * 8);
  float *pinned;
  ok(ddp_pinned_alloc(GPU, (size_t)n * 4, (void **)&pinned), "pinned");
  for (int round = 0; round < 5; round++) {
    for (int64_t i = 0; i < n; i++) fa[i] = (float)(i * (round + 1)), ib[i] = i - round;
    void *dst[2] = {a->data, b->data};
    const void *src[2] = {fa, ib};
    size_t bytes[2] = {(size_t)n * 4, (size_t)n * 8};
    ok(ddp_device_stage_upload(stage, 2, dst, src, bytes), "upload");
    memset(fa, 0, (size_t)n * 4); /* the sources may be reused at once */
    ok(ddp_device_copy_async(DDP_CPU, pinned, GPU, a->data, (size_t)n * 4), "async copy back");
    sync_ok();
    ok(ddp__cuda_copy(back_b, b->data, (size_t)n * 8, cudaMemcpyDeviceToHost), "b back");
    for (int64_t i = 0; i < n; i++)
      if (pinned[i] != (float)(i * (round + 1)) || back_b[i] != i - round)
        fail_msg("upload %d: element %lld wrong", round, (long long)i);
  }
  printf("  5 uploads through the stage arrived intact\n");
  ddp_pinned_free(pinned);
  ddp_device_stage_destroy(stage);
  ddp_tensor_destroy(a);
  ddp_tensor_destroy(b);
  free(fa), free(ib), free(back_b);
  sync_ok();
}

/* ---- The trainer ---------------------------------------------------------------- */

typedef struct trained {
  ddp_train_result r;
  float *params;
  long n;
} trained;

static trained train(bool cuda_graph) {
  /* seed 001's ToyModel on its regression data (headtail on toydata
   * diverges at any usable learning rate, on the CPU too) */
  ddp_model *model;
  ok(ddp_model_build("toy", NULL, 1, &model), "toy");
  ddp_dataset *tr, *te;
  ok(ddp_dataset_create_regression(&tr, 2048, 1), "regression data");
  ok(ddp_dataset_create_regression(&te, 256, 1000004), "regression test data");
  ddp_train_options o = ddp_train_defaults();
  o.epochs = 2;
  o.batch_size = 100; /* 20 full batches and one of 48 an epoch */
  o.optim.lr = 0.01;
  o.optim.sgd.momentum = 0.9;
  o.workers = 0;
  o.device = GPU;
  o.cuda_graph = cuda_graph;
  ddp_trainer *t;
  ok(ddp_trainer_create(&t, model, tr, te, NULL, &o), "trainer");
  trained out;
  ok(ddp_trainer_run(t, &out.r), cuda_graph ? "training with cuda_graph" : "training");
  out.n = (long)ddp_model_num_param_elements(model);
  out.params = to_host(ddp_model_params_flat(model), (size_t)out.n * 4);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(te);
  ddp_dataset_destroy(tr);
  ddp_model_destroy(model);
  return out;
}

static void test_trainer(void **state) {
  (void)state;
  trained e = train(false), g = train(true);
  printf("  eager:      %lld steps, train loss %.7f, test loss %.7f, accuracy %.4f, %.0f samples/s\n",
         (long long)e.r.steps, e.r.train_loss, e.r.test_loss, e.r.test_accuracy, e.r.samples_per_s);
  printf("  cuda_graph: %lld steps, train loss %.7f, test loss %.7f, accuracy %.4f, %.0f samples/s\n",
         (long long)g.r.steps, g.r.train_loss, g.r.test_loss, g.r.test_accuracy, g.r.samples_per_s);
  assert_int_equal(g.r.steps, 42);
  assert_int_equal(e.r.steps, g.r.steps);
  bool good = compare("trainer: parameters", g.params, e.params, e.n);
  float losses[2][3] = {{(float)g.r.train_loss, (float)g.r.test_loss, (float)g.r.test_accuracy},
                        {(float)e.r.train_loss, (float)e.r.test_loss, (float)e.r.test_accuracy}};
  good &= compare("trainer: losses, accuracy", losses[0], losses[1], 3);
  if (!good) fail_msg("training with cuda_graph differs from training without");
  free(e.params), free(g.params);
  ddp_train_result_free(&e.r);
  ddp_train_result_free(&g.r);
}

int main(void) {
  cuda_test_require_device();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_convnet_step), cmocka_unit_test(test_pool_blocks),
      cmocka_unit_test(test_bad_targets),  cmocka_unit_test(test_stage),
      cmocka_unit_test(test_trainer),      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
