/* One training step of seed 001's ConvNet (forward, backward, SGD with
 * momentum) at batch 100 on one thread, in samples per second: the figure
 * ../shared/refs/torch_ddp_convnet.py --world 1 prints for PyTorch.
 * Batches come from Fashion-MNIST through the loader (as PyTorch's DataLoader
 * feeds the reference), or from random data with --data synthetic.
 * With --device cuda[:N] the model, the optimizer's state and one synthetic
 * batch live on the GPU (scripts/torch/gpu_convnet_step.py measures
 * PyTorch the same way): the figure is the step itself, timed between
 * device synchronizations, the loss read back once per repeat.
 * With --cuda-graph as well (a GPU only), the step's zero_grad, forward,
 * loss and backward are captured once as a CUDA graph after the warm-up
 * steps (at least 3, eager) and replayed, the optimizer launched eagerly
 * after each replay (its step count and lr are kernel arguments that
 * change); BatchNorm's num_batches_tracked, a host counter the capture
 * moved once, is put back and advanced by that much after each replay.
 *
 *   bench_convnet [--batch 100] [--steps 150] [--warmup 10] [--repeats 3]
 *                 [--threads 1] [--data DIR|synthetic] [--device cpu|cuda[:N]]
 *                 [--cuda-graph] [--json] [--precision fp32|bf16|fp16|tf32]
 *                 [--model convnet|mlp:WxD]
 *
 * --precision bf16|fp16 runs forward and loss in an autocast region (as
 * torch.autocast around them; backward outside it, no gradient scaler:
 * the step's speed, not its training), tf32 allows TF32 (GPU only).
 * --model mlp:WxD (synthetic data only) times the MLP of that width and
 * depth instead (10 -> W -> ... -> 5, MSE), with its matmul TFLOPS in the
 * JSON (6 flops per weight per sample: forward 2, backward 4).
 * scripts/gpu-amp-steps.sh runs both on the GPU (issue 42).
 *
 * scripts/bench-convnet.sh runs it beside PyTorch and prints the ratio. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "tensor/autocast.h" /* the low-precision path's instructions */
#ifdef DDP_HAVE_CUDA
#include "tensor/cuda/cudnn.h" /* which convolution the backend runs */
#endif

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void die(const char *what, ddp_status s) {
  fprintf(stderr, "bench_convnet: %s: %s (%s)\n", what, ddp_last_error(), ddp_strerror(s));
  exit(1);
}

#define CHECK(expr, what)                 \
  do {                                    \
    ddp_status s_ = (expr);               \
    if (s_ != DDP_OK) die(what, s_);      \
  } while (0)

static ddp_precision precision = DDP_PRECISION_FP32;

/* Forward and loss, in an autocast region under --precision bf16/fp16. */
static void forward_loss(ddp_model *model, ddp_tape *tape, ddp_tensor *x, ddp_tensor *y,
                         ddp_tensor **loss) {
  ddp_tensor *out;
  const bool region = precision == DDP_PRECISION_BF16 || precision == DDP_PRECISION_FP16;
  if (region) CHECK(ddp_autocast_enter(precision), "entering autocast");
  CHECK(ddp_model_forward(model, tape, x, &out), "forward");
  CHECK(ddp_model_loss(model, tape, out, y, loss), "loss");
  if (region) CHECK(ddp_autocast_exit(), "leaving autocast");
}

/* One eager step: zero_grad, forward, loss (*loss, on the tape), backward,
 * SGD. */
static void eager_step(ddp_model *model, ddp_tape *tape, ddp_optimizer *opt, ddp_tensor *x,
                       ddp_tensor *y, ddp_tensor **loss) {
  ddp_tape_reset(tape);
  ddp_model_zero_grad(model);
  forward_loss(model, tape, x, y, loss);
  CHECK(ddp_backward(tape, *loss), "backward");
  CHECK(ddp_optimizer_step(opt), "SGD step");
}

int main(int argc, char **argv) {
  int64_t batch = 100, steps = 150, warmup = 10, repeats = 3;
  int threads = 1;
  bool json = false, cuda_graph = false;
  const char *data = "/usr/share/datasets/fashion-mnist";
  const char *model_name = "convnet";
  long mlp_w = 0, mlp_d = 0;
  ddp_device device = DDP_CPU;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--batch") && v) batch = atoll(argv[++i]);
    else if (!strcmp(a, "--steps") && v) steps = atoll(argv[++i]);
    else if (!strcmp(a, "--warmup") && v) warmup = atoll(argv[++i]);
    else if (!strcmp(a, "--repeats") && v) repeats = atoll(argv[++i]);
    else if (!strcmp(a, "--threads") && v) threads = atoi(argv[++i]);
    else if (!strcmp(a, "--data") && v) data = argv[++i];
    else if (!strcmp(a, "--json")) json = true;
    else if (!strcmp(a, "--cuda-graph")) cuda_graph = true;
    else if (!strcmp(a, "--device") && v) CHECK(ddp_device_parse(argv[++i], &device), "--device");
    else if (!strcmp(a, "--model") && v) model_name = argv[++i];
    else if (!strcmp(a, "--precision") && v) {
      const char *p = argv[++i];
      if (!strcmp(p, "fp32")) precision = DDP_PRECISION_FP32;
      else if (!strcmp(p, "bf16")) precision = DDP_PRECISION_BF16;
      else if (!strcmp(p, "fp16")) precision = DDP_PRECISION_FP16;
      else if (!strcmp(p, "tf32")) precision = DDP_PRECISION_TF32;
      else {
        fprintf(stderr, "bench_convnet: --precision %s: expected fp32, bf16, fp16 or tf32\n", p);
        return 2;
      }
    } else {
      fprintf(!strcmp(a, "--help") ? stdout : stderr,
              "usage: bench_convnet [--batch 100] [--steps 150] [--warmup 10] [--repeats 3]\n"
              "                     [--threads 1] [--data DIR|synthetic] [--device cpu|cuda[:N]]\n"
              "                     [--cuda-graph] [--json] [--precision fp32|bf16|fp16|tf32]\n"
              "                     [--model convnet|mlp:WxD]\n");
      return !strcmp(a, "--help") ? 0 : 2;
    }
  }
  if (batch <= 0 || steps <= 0 || repeats <= 0 || repeats > 64 || threads <= 0) {
    fprintf(stderr, "bench_convnet: batch, steps, threads and repeats (<= 64) must be positive\n");
    return 2;
  }
  openblas_set_num_threads(threads);
  const bool is_mlp = sscanf(model_name, "mlp:%ldx%ld", &mlp_w, &mlp_d) == 2;
  if (!is_mlp && strcmp(model_name, "convnet") != 0) {
    fprintf(stderr, "bench_convnet: --model %s: expected convnet or mlp:WxD\n", model_name);
    return 2;
  }
  if (is_mlp) data = "synthetic";

  const bool on_gpu = device.type != DDP_DEVICE_CPU;
  if (cuda_graph && !on_gpu) {
    fprintf(stderr, "bench_convnet: --cuda-graph needs --device cuda[:N]\n");
    return 2;
  }
  if (on_gpu) {
    ddp_status s = ddp_device_check(device);
    if (s != DDP_OK) {
      printf("bench_convnet: skipped: %s\n", ddp_last_error());
      return 77;
    }
    data = "synthetic"; /* the step alone, as the reference measures it */
  }
  if (precision == DDP_PRECISION_TF32) {
    if (!on_gpu) {
      fprintf(stderr, "bench_convnet: --precision tf32 needs --device cuda[:N]\n");
      return 2;
    }
    CHECK(ddp_cuda_allow_tf32(true), "allowing TF32");
  }
  ddp_dataset *ds;
  if (!strcmp(data, "synthetic")) {
    /* Random pixels and labels with the MNIST shapes, via the idx path would
     * need files; the toy generator has the wrong shape, so build batches by
     * hand below instead. */
    ds = NULL;
  } else {
    CHECK(ddp_dataset_open_idx_dir(&ds, data, DDP_SPLIT_TRAIN), "opening the dataset");
  }

  ddp_model *model;
  CHECK(ddp_model_build(model_name, NULL, 1, &model), "building the model");
  CHECK(ddp_model_to(model, device), "moving the model");
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.01;
  oo.sgd.momentum = 0.9;
  oo.device = device;
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model), ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)),
        "creating SGD");
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 64 << 20), "creating the tape");

  ddp_loader *loader = NULL;
  float *sx = NULL;
  int64_t *sy = NULL;
  ddp_tensor tx, ty;
  if (ds) {
    ddp_loader_config lc = ddp_loader_defaults();
    lc.batch_size = batch;
    lc.shuffle = true;
    lc.drop_last = true;
    lc.num_workers = 1;
    lc.seed = 1;
    CHECK(ddp_loader_create(&loader, ds, &lc), "creating the loader");
  } else if (is_mlp) { /* (batch, 10) inputs, (batch, 5) regression targets */
    sx = ddp_alloc((size_t)batch * 10 * sizeof(float));
    float *fy = ddp_alloc((size_t)batch * 5 * sizeof(float));
    sy = (int64_t *)fy; /* freed with sx below */
    ddp_rng rng;
    ddp_rng_seed(&rng, 7);
    for (int64_t i = 0; i < batch * 10; i++) sx[i] = ddp_rng_uniform(&rng);
    for (int64_t i = 0; i < batch * 5; i++) fy[i] = ddp_rng_uniform(&rng);
    ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){batch, 10}, sx);
    ddp_tensor_wrap(&ty, DDP_FLOAT32, 2, (int64_t[]){batch, 5}, fy);
  } else {
    sx = ddp_alloc((size_t)batch * 784 * sizeof(float));
    sy = ddp_alloc((size_t)batch * sizeof(int64_t));
    ddp_rng rng;
    ddp_rng_seed(&rng, 7);
    for (int64_t i = 0; i < batch * 784; i++) sx[i] = ddp_rng_uniform(&rng);
    for (int64_t i = 0; i < batch; i++) sy[i] = (int64_t)ddp_rng_below(&rng, 10);
    int64_t xs[4] = {batch, 1, 28, 28}, ys[1] = {batch};
    ddp_tensor_wrap(&tx, DDP_FLOAT32, 4, xs, sx);
    ddp_tensor_wrap(&ty, DDP_INT64, 1, ys, sy);
  }
  ddp_tensor *gx = NULL, *gy = NULL; /* the batch on the GPU */
  if (on_gpu) {
    CHECK(ddp_tensor_create_on(&gx, DDP_FLOAT32, tx.ndim, tx.shape, device), "batch on the GPU");
    CHECK(ddp_tensor_create_on(&gy, ty.dtype, ty.ndim, ty.shape, device), "labels on the GPU");
    CHECK(ddp_tensor_copy(gx, &tx), "copying the batch");
    CHECK(ddp_tensor_copy(gy, &ty), "copying the labels");
  }

  /* --cuda-graph: eager warm-up steps (the tape's arena and the caches
   * reach their steady state, so the capture allocates nothing), then the
   * capture of one step without the optimizer. */
  ddp_cuda_graph *graph = NULL;
  ddp_tensor *graph_loss = NULL;
  int n_counters = ddp_model_num_counters(model);
  int64_t *counters = ddp_model_counters(model);
  int64_t counter_delta[64] = {0};
  if (n_counters > 64) {
    fprintf(stderr, "bench_convnet: more than 64 BatchNorm counters\n");
    return 2;
  }
  if (cuda_graph) {
    ddp_tensor *loss;
    for (int64_t step = 0; step < (warmup > 3 ? warmup : 3); step++)
      eager_step(model, tape, opt, gx, gy, &loss);
    CHECK(ddp_device_synchronize(device), "warming up");
    int64_t before[64];
    memcpy(before, counters, sizeof(int64_t) * (size_t)n_counters);
    ddp_tape_reset(tape); /* outside: a reset may merge the arena's chunks */
    CHECK(ddp_cuda_graph_begin(device), "beginning the capture");
    ddp_model_zero_grad(model);
    forward_loss(model, tape, gx, gy, &graph_loss);
    CHECK(ddp_backward(tape, graph_loss), "backward (captured)");
    CHECK(ddp_cuda_graph_end(device, &graph), "capturing the step");
    for (int i = 0; i < n_counters; i++) {
      counter_delta[i] = counters[i] - before[i];
      counters[i] = before[i]; /* the capture ran nothing */
    }
  }

  double rates[64];
  float last_loss = 0;
  int64_t epoch = 0;
  if (loader) CHECK(ddp_loader_start_epoch(loader, epoch), "starting an epoch");
  for (int64_t r = 0; r < repeats; r++) {
    double t0 = 0;
    ddp_tensor *loss = graph_loss;
    for (int64_t step = 0; step < warmup + steps; step++) {
      if (step == warmup) {
        CHECK(ddp_device_synchronize(device), "synchronizing");
        t0 = ddp_time_s();
      }
      if (graph) { /* the inputs stay in gx, gy: a synthetic batch */
        CHECK(ddp_cuda_graph_replay(graph), "replaying the step");
        for (int i = 0; i < n_counters; i++) counters[i] += counter_delta[i];
        CHECK(ddp_optimizer_step(opt), "SGD step");
        continue;
      }
      ddp_tensor *x = on_gpu ? gx : &tx, *y = on_gpu ? gy : &ty;
      ddp_batch b;
      if (loader) {
        CHECK(ddp_loader_next(loader, &b), "loading a batch");
        if (b.size == 0) {
          CHECK(ddp_loader_start_epoch(loader, ++epoch), "starting an epoch");
          CHECK(ddp_loader_next(loader, &b), "loading a batch");
        }
        x = &b.x;
        y = &b.y;
      }
      eager_step(model, tape, opt, x, y, &loss);
      if (!on_gpu) last_loss = ddp_tensor_f32(loss)[0];
    }
    CHECK(ddp_device_synchronize(device), "synchronizing");
    rates[r] = (double)(steps * batch) / (ddp_time_s() - t0);
    if (on_gpu) { /* the last step's loss, once the timing is done */
      int64_t one = 1;
      ddp_tensor h, d;
      ddp_tensor_wrap(&h, DDP_FLOAT32, 1, &one, &last_loss);
      ddp_tensor_wrap(&d, DDP_FLOAT32, 1, &one, loss->data);
      d.device = device;
      CHECK(ddp_tensor_copy(&h, &d), "reading the loss");
    }
  }
  double sorted[64];
  memcpy(sorted, rates, sizeof(double) * (size_t)repeats);
  qsort(sorted, (size_t)repeats, sizeof(double), cmp_double);
  double median = sorted[repeats / 2];
  char dev[DDP_DEVICE_STR_BYTES];
  ddp_device_str(device, dev, sizeof dev);
  /* The convolution the CUDA backend was asked for (its switch), as given. */
  const char *conv = on_gpu ? getenv("DDP_CUDA_CONV") : NULL;
  if (json) {
    printf("{\"bench\": \"convnet\", \"device\": \"%s\", \"threads\": %d, \"batch\": %lld, "
           "\"steps\": %lld, \"repeats\": %lld, \"samples_per_s\": %.1f, \"samples_per_s_rounds\": [",
           dev, threads, (long long)batch, (long long)steps, (long long)repeats, median);
    for (int64_t r = 0; r < repeats; r++) printf("%s%.1f", r ? ", " : "", rates[r]);
    printf("], \"step_us\": %.2f, \"final_loss\": %.4f", 1e6 * (double)batch / median,
           last_loss);
    static const char *const pnames[] = {"fp32", "bf16", "fp16", "tf32"};
    printf(", \"model\": \"%s\", \"precision\": \"%s\"", model_name, pnames[precision]);
    if (is_mlp) { /* 6 flops per weight per sample: forward 2, backward 4 */
      const double weights = 10.0 * mlp_w + (double)(mlp_d - 2) * mlp_w * mlp_w + 5.0 * mlp_w;
      printf(", \"tflops\": %.2f", 6.0 * weights * median / 1e12);
    }
    if (on_gpu) {
      printf(", \"cuda_graph\": %s, \"DDP_CUDA_CONV\": ", cuda_graph ? "true" : "false");
      printf(conv ? "\"%s\"" : "null", conv ? conv : "");
#ifdef DDP_HAVE_CUDA
      printf(", \"conv\": \"%s\"", ddp__cuda_conv_impl());
#endif
    }
    if (!on_gpu) /* the instruction set each precision's step used */
      printf(", \"cpu_kernels\": \"%s\", \"low_precision_path\": \"%s\"", ddp_cpu_kernels(),
             precision == DDP_PRECISION_FP32 ? "none" : ddp__autocast_kernels());
    printf("}\n");
  }
  else {
    printf("ddp convnet threads=%d batch=%lld steps=%lld samples_per_s=%.1f (median of %lld) "
           "final_loss=%.4f%s\n",
           threads, (long long)batch, (long long)steps, median, (long long)repeats, last_loss,
           cuda_graph ? " cuda_graph" : "");
    if (!on_gpu)
      printf("CPU kernel family: %s; low-precision path: %s\n", ddp_cpu_kernels(),
             precision == DDP_PRECISION_FP32 ? "none (fp32)" : ddp__autocast_kernels());
  }

  ddp_cuda_graph_destroy(graph);
  ddp_tensor_destroy(gx);
  ddp_tensor_destroy(gy);
  ddp_loader_destroy(loader);
  ddp_dataset_destroy(ds);
  ddp_free(sx);
  ddp_free(sy);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  return 0;
}
