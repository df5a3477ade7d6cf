/* Seed 003's one-line change: a single-process training loop (seed 001's
 * ConvNet, cross-entropy, SGD with momentum, on a fixed set of random
 * 28x28 images, labelled by their brightest band) in which
 *
 *   model = torch.nn.DataParallel(model, device_ids=[0, 1, 2, 3])
 *
 * becomes ddp_data_parallel_create, and the forward goes through the
 * wrapper. Everything else (zero_grad, loss, backward, step) is the loop
 * of one model, and the optimizer steps the one model. With --replicas 0
 * the line is left out: the same loop on the model alone.
 *   build/bin/data_parallel [--replicas N] [--sync-bn] [--steps 40] [--batch 32] [--lr 0.002]
 * Prints the loss every 5 steps and at the end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

#define CHECK(expr)                                                           \
  do {                                                                        \
    ddp_status s_ = (expr);                                                   \
    if (s_ != DDP_OK) {                                                       \
      fprintf(stderr, "data_parallel: %s: %s\n", #expr, ddp_last_error());    \
      return 1;                                                               \
    }                                                                         \
  } while (0)

#define SAMPLES 256

int main(int argc, char **argv) {
  int replicas = 2, steps = 40, batch = 32;
  double lr = 0.002;
  bool sync_bn = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--sync-bn")) sync_bn = true;
    else if (!strcmp(argv[i], "--replicas") && i + 1 < argc) replicas = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--lr") && i + 1 < argc) lr = atof(argv[++i]);
    else {
      fprintf(stderr, "usage: data_parallel [--replicas N] [--sync-bn] [--steps S] [--batch B] "
                      "[--lr X]\n");
      return 2;
    }
  }
  if (batch < 1 || batch > SAMPLES) {
    fprintf(stderr, "data_parallel: --batch must be 1..%d\n", SAMPLES);
    return 2;
  }

  /* A fixed data set a ConvNet can learn: random images, each labelled
   * with the brightest of ten horizontal bands. */
  static float images[SAMPLES * 784];
  static int64_t labels[SAMPLES];
  ddp_rng rng;
  ddp_rng_seed(&rng, 3);
  for (int i = 0; i < SAMPLES * 784; i++) images[i] = ddp_rng_normal(&rng);
  for (int i = 0; i < SAMPLES; i++) {
    float best = -1e30f;
    for (int band = 0; band < 10; band++) {
      float sum = 0;
      for (int p = band * 78; p < (band + 1) * 78; p++) sum += images[i * 784 + p];
      if (sum > best) best = sum, labels[i] = band;
    }
  }

  ddp_model *model;
  CHECK(ddp_model_build("convnet", NULL, 42, &model));
  ddp_data_parallel *dp = NULL;
  if (replicas > 0) { /* the one line: model = DataParallel(model) */
    ddp_data_parallel_options o = ddp_data_parallel_defaults();
    o.replicas = replicas;
    o.sync_batch_norm = sync_bn;
    CHECK(ddp_data_parallel_create(&dp, model, &o));
  }
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = lr;
  sgd.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &sgd, ddp_model_params_flat(model), ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)));
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 20));

  float loss_value = 0;
  for (int step = 0; step < steps; step++) {
    int first = (step * batch) % (SAMPLES - batch + 1);
    ddp_tensor x, y, *out, *loss;
    CHECK(ddp_tensor_wrap(&x, DDP_FLOAT32, 4, (int64_t[]){batch, 1, 28, 28},
                          images + (size_t)first * 784));
    CHECK(ddp_tensor_wrap(&y, DDP_INT64, 1, (int64_t[]){batch}, labels + first));
    ddp_model_zero_grad(model);                     /* optimizer.zero_grad() */
    ddp_tape_reset(tape);
    if (dp)                                          /* outputs = model(x) */
      CHECK(ddp_data_parallel_forward(dp, tape, &x, &out));
    else
      CHECK(ddp_model_forward(model, tape, &x, &out));
    CHECK(ddp_model_loss(model, tape, out, &y, &loss)); /* criterion(outputs, y) */
    CHECK(ddp_backward(tape, loss));                    /* loss.backward() */
    CHECK(ddp_optimizer_step(opt));                     /* optimizer.step() */
    loss_value = ddp_tensor_f32(loss)[0];
    if ((step + 1) % 5 == 0) printf("step %d: loss %.6f\n", step + 1, loss_value);
  }
  printf("%d replica(s)%s: final loss %.6f\n", dp ? ddp_data_parallel_num_replicas(dp) : 0,
         sync_bn ? " with SyncBatchNorm" : "", loss_value);

  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_data_parallel_destroy(dp);
  ddp_model_destroy(model);
  return 0;
}
