/* Seed 001's ToyMpModel with its two halves on two devices in one process:
 * net1 = Linear(10, 10) + ReLU on cuda:0, net2 = Linear(10, 5) on the CPU,
 * the activations crossing with ddp_to (x.to(device) in PyTorch), an SGD
 * optimizer per device over that half's flat buffers, MSE against labels
 * on net2's device. After 10 steps every parameter is compared with the
 * same model trained all on the CPU (ddp's "toy" model, same seed, same
 * data), within max|a - b| <= 1e-5 max|b| + 1e-7 per tensor.
 *
 *   build/bin/toy_mp_devices [steps=10] [device=cuda:0]
 *
 * Exit status: 0 when they agree, 1 when not, 77 without a GPU (nothing
 * to compare). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

#define CHECK(call)                                                                    \
  do {                                                                                 \
    ddp_status s_ = (call);                                                            \
    if (s_ != DDP_OK) {                                                                \
      fprintf(stderr, "toy_mp_devices: %s: %s\n", #call, ddp_last_error());           \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

/* One half of the model on one device: its parameters as views of one flat
 * buffer, their gradients of another, and an SGD optimizer over them. */
typedef struct half {
  ddp_device device;
  ddp_tensor *flat, *flat_grad; /* owners */
  ddp_tensor weight, bias;
  ddp_optimizer *opt;
} half;

/* The half's parameters start as `init`'s weight and bias (CPU tensors). */
static void half_init(half *h, ddp_device device, const ddp_tensor *w0, const ddp_tensor *b0,
                      double lr) {
  h->device = device;
  int64_t n = w0->numel + b0->numel;
  CHECK(ddp_tensor_create_on(&h->flat, DDP_FLOAT32, 1, &n, device));
  CHECK(ddp_tensor_create_on(&h->flat_grad, DDP_FLOAT32, 1, &n, device));
  const ddp_tensor *src[2] = {w0, b0};
  ddp_tensor *dst[2] = {&h->weight, &h->bias};
  int64_t off = 0;
  for (int i = 0; i < 2; i++) {
    CHECK(ddp_tensor_wrap(dst[i], DDP_FLOAT32, src[i]->ndim, src[i]->shape,
                          (float *)h->flat->data + off));
    dst[i]->device = device;
    dst[i]->grad = (float *)h->flat_grad->data + off;
    dst[i]->flags |= DDP_TENSOR_REQUIRES_GRAD;
    CHECK(ddp_tensor_copy(dst[i], src[i]));
    off += src[i]->numel;
  }
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = lr;
  o.device = device;
  CHECK(ddp_optimizer_create(&h->opt, &o, h->flat->data, h->flat_grad->data, (size_t)n));
}

static void half_zero_grad(half *h) {
  /* a zeroed CPU copy over the gradient buffer */
  ddp_tensor *zero;
  CHECK(ddp_tensor_create(&zero, DDP_FLOAT32, 1, &h->flat_grad->numel));
  CHECK(ddp_tensor_copy(h->flat_grad, zero));
  ddp_tensor_destroy(zero);
}

static void half_free(half *h) {
  ddp_optimizer_destroy(h->opt);
  ddp_tensor_destroy(h->flat);
  ddp_tensor_destroy(h->flat_grad);
}

/* Compares a half's parameter with the all-CPU model's; prints the worst
 * difference and returns whether it is within the bound. */
static int agrees(const char *name, const ddp_tensor *t, const ddp_tensor *ref) {
  float *host = malloc((size_t)t->numel * sizeof(float));
  ddp_tensor h;
  CHECK(ddp_tensor_wrap(&h, DDP_FLOAT32, t->ndim, t->shape, host));
  CHECK(ddp_tensor_copy(&h, t));
  const float *r = ref->data;
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < t->numel; i++) {
    worst = fmax(worst, fabs((double)host[i] - r[i]));
    scale = fmax(scale, fabs(r[i]));
  }
  free(host);
  double bound = 1e-5 * scale + 1e-7;
  printf("%-12s max|split - cpu| = %.3g (bound %.3g)%s\n", name, worst, bound,
         worst <= bound ? "" : "  FAIL");
  return worst <= bound;
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 10;
  ddp_device dev;
  CHECK(ddp_device_parse(argc > 2 ? argv[2] : "cuda:0", &dev));
  if (dev.type == DDP_DEVICE_CUDA && ddp_cuda_device_count() == 0) {
    printf("no CUDA device: %s\n", ddp_cuda_unavailable_reason());
    return 77;
  }
  const double lr = 0.001; /* seed 001's optim.SGD(lr=0.001) */

  /* The reference: the whole ToyModel on the CPU (net1, relu, net2). */
  ddp_model *ref;
  CHECK(ddp_model_build("toy", NULL, 1, &ref));
  ddp_tensor *w1 = ddp_model_find_param(ref, "net1.weight"), *b1 = ddp_model_find_param(ref, "net1.bias");
  ddp_tensor *w2 = ddp_model_find_param(ref, "net2.weight"), *b2 = ddp_model_find_param(ref, "net2.bias");
  half h1, h2;
  half_init(&h1, dev, w1, b1, lr);     /* net1 on the GPU */
  half_init(&h2, DDP_CPU, w2, b2, lr); /* net2 on the CPU */
  ddp_optim_options ro = ddp_optim_defaults(DDP_OPTIM_SGD);
  ro.lr = lr;
  ddp_optimizer *ref_opt;
  CHECK(ddp_optimizer_create(&ref_opt, &ro, ddp_model_params_flat(ref), ddp_model_grads_flat(ref),
                             (size_t)ddp_model_num_param_elements(ref)));

  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 16));
  ddp_rng rng;
  ddp_rng_seed(&rng, 1);
  int64_t xs[2] = {20, 10}, ys[2] = {20, 5};
  float xv[200], yv[100];
  ddp_tensor x, y;
  CHECK(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, xs, xv));
  CHECK(ddp_tensor_wrap(&y, DDP_FLOAT32, 2, ys, yv));
  for (int step = 0; step < steps; step++) {
    for (int i = 0; i < 200; i++) xv[i] = ddp_rng_normal(&rng); /* torch.randn(20, 10) */
    for (int i = 0; i < 100; i++) yv[i] = ddp_rng_normal(&rng); /* torch.randn(20, 5) */
    /* split: x.to(dev0) -> net1 -> relu -> .to(dev1) -> net2; labels on dev1 */
    ddp_tape_reset(tape);
    half_zero_grad(&h1);
    half_zero_grad(&h2);
    ddp_tensor *a, *h, *r, *back, *out, *loss;
    CHECK(ddp_to(tape, &x, dev, &a));
    CHECK(ddp_linear(tape, a, &h1.weight, &h1.bias, &h));
    CHECK(ddp_relu(tape, h, &r));
    CHECK(ddp_to(tape, r, DDP_CPU, &back));
    CHECK(ddp_linear(tape, back, &h2.weight, &h2.bias, &out));
    CHECK(ddp_mse_loss(tape, out, &y, &loss));
    CHECK(ddp_backward(tape, loss));
    CHECK(ddp_optimizer_step(h1.opt));
    CHECK(ddp_optimizer_step(h2.opt));
    float split_loss = ((float *)loss->data)[0];
    /* the reference step on the same batch */
    ddp_tape_reset(tape);
    ddp_model_zero_grad(ref);
    ddp_tensor *ro_out, *ro_loss;
    CHECK(ddp_model_forward(ref, tape, &x, &ro_out));
    CHECK(ddp_mse_loss(tape, ro_out, &y, &ro_loss));
    CHECK(ddp_backward(tape, ro_loss));
    CHECK(ddp_optimizer_step(ref_opt));
    printf("step %d: loss split %.7f, cpu %.7f\n", step + 1, split_loss,
           ((float *)ro_loss->data)[0]);
  }
  CHECK(ddp_device_synchronize(dev));
  int ok = agrees("net1.weight", &h1.weight, w1) & agrees("net1.bias", &h1.bias, b1) &
           agrees("net2.weight", &h2.weight, w2) & agrees("net2.bias", &h2.bias, b2);
  printf("ToyMpModel, net1 on %s and net2 on cpu, after %d steps: %s the all-CPU model\n",
         argc > 2 ? argv[2] : "cuda:0", steps, ok ? "equals" : "DIFFERS FROM");
  ddp_tape_destroy(tape);
  half_free(&h1);
  half_free(&h2);
  ddp_optimizer_destroy(ref_opt);
  ddp_model_destroy(ref);
  return ok ? 0 : 1;
}
