/* Seed 001's basic demo on one process: the ToyModel (Linear 10->10, ReLU,
 * Linear 10->5), MSE loss, SGD lr 0.001, on random inputs and targets, through
 * ddp's C API. Data parallelism wraps this same loop in a later issue.
 *   build/bin/basic_training [steps=5] */
#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"
#include "ddp/nn.h"
#include "ddp/optim.h"

#define CHECK(expr)                                                              \
  do {                                                                           \
    ddp_status s_ = (expr);                                                      \
    if (s_ != DDP_OK) {                                                          \
      fprintf(stderr, "basic_training: %s: %s\n", #expr, ddp_last_error());      \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 5;

  ddp_model *model; /* net1, relu, net2 with PyTorch's names and init */
  CHECK(ddp_model_build("toy", NULL, 42, &model));
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = 0.001;
  ddp_optimizer *opt; /* one loop over the model's flat parameter buffer */
  CHECK(ddp_optimizer_create(&opt, &sgd, ddp_model_params_flat(model),
                             ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)));
  ddp_tape *tape; /* records the forward; its arena holds the step's tensors */
  CHECK(ddp_tape_create(&tape, 1 << 20));

  /* torch.randn(20, 10) and torch.randn(20, 5) */
  float inputs[20 * 10], labels[20 * 5];
  ddp_rng rng;
  ddp_rng_seed(&rng, 0);
  for (int i = 0; i < 200; i++) inputs[i] = ddp_rng_normal(&rng);
  for (int i = 0; i < 100; i++) labels[i] = ddp_rng_normal(&rng);
  ddp_tensor x, y;
  CHECK(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, (int64_t[]){20, 10}, inputs));
  CHECK(ddp_tensor_wrap(&y, DDP_FLOAT32, 2, (int64_t[]){20, 5}, labels));

  for (int step = 0; step < steps; step++) {
    ddp_tensor *out, *loss;
    ddp_tape_reset(tape);                           /* new step, no allocation */
    ddp_model_zero_grad(model);                     /* optimizer.zero_grad() */
    CHECK(ddp_model_forward(model, tape, &x, &out)); /* outputs = model(x) */
    CHECK(ddp_mse_loss(tape, out, &y, &loss));       /* loss_fn(outputs, labels) */
    CHECK(ddp_backward(tape, loss));                 /* .backward() */
    CHECK(ddp_optimizer_step(opt));                  /* optimizer.step() */
    printf("step %d: loss %.6f\n", step + 1, ddp_tensor_f32(loss)[0]);
  }

  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  return 0;
}
