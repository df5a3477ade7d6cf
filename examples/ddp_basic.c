/* Seed 001's demo_basic in C: every rank builds the ToyModel (Linear 10->10,
 * ReLU, Linear 10->5), wraps it for data parallelism, and takes one SGD step
 * (lr 0.001, MSE) on its own random batch of 20. Run it under the launcher:
 *
 *   build/bin/ddprun --nproc-per-node 2 build/bin/ddp_basic
 *
 * It checks what DistributedDataParallel promises and prints it: the gradient
 * after backward is the mean of every rank's own gradient (each rank also
 * computes its local gradient under no_sync, and the ranks gather them), and
 * after the step every replica holds the same parameters, which differ from
 * the ones before. Exit status 1 if a check fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "ddp_basic: %s: %s\n", #expr, ddp_last_error());         \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

static double max_abs_diff(const float *a, const float *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - (double)b[i]));
  return m;
}

/* Copies the model's parameters (or gradients, `grads`) into dst in state-dict
 * order. The wrapper may re-lay out the flat buffers after the first synced
 * backward (parameters in gradient-ready order), so copies taken at different
 * times are compared in this fixed order, never by flat offset. */
static void copy_canonical(ddp_model *model, bool grads, float *dst) {
  const float *params = ddp_model_params_flat(model);
  const float *src = grads ? ddp_model_grads_flat(model) : params;
  for (int i = 0; i < ddp_model_state_count(model); i++) {
    ddp_state_entry e;
    CHECK(ddp_model_state_entry(model, i, &e));
    if (!e.is_param) continue;
    memcpy(dst, src + ((const float *)e.data - params), (size_t)e.numel * sizeof *dst);
    dst += e.numel;
  }
}

int main(void) {
  ddp_process_group *pg; /* dist.init_process_group: RANK, WORLD_SIZE, ... from ddprun */
  CHECK(ddp_init_process_group("env://", NULL, NULL, &pg));
  int rank = ddp_process_group_rank(pg), world = ddp_process_group_size(pg);
  printf("Running basic DDP example on rank %d of %d.\n", rank, world);

  /* The seed seeds nothing: each rank's model starts differently, and the
   * wrapper broadcasts rank 0's parameters. A per-rank seed shows that. */
  ddp_model *model;
  CHECK(ddp_model_build("toy", NULL, 1000 + (uint64_t)rank, &model));
  ddp_dp *dp; /* ddp_model = DDP(model) */
  ddp_dp_options o = ddp_dp_defaults();
  CHECK(ddp_dp_create(&dp, model, pg, &o));
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = 0.001;
  ddp_optimizer *opt;
  int64_t n = ddp_model_num_param_elements(model);
  CHECK(ddp_optimizer_create(&opt, &sgd, ddp_model_params_flat(model),
                             ddp_model_grads_flat(model), (size_t)n));
  ddp_dp_set_optimizer(dp, opt);
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 20));

  /* torch.randn(20, 10) and torch.randn(20, 5): a different batch per rank. */
  float inputs[20 * 10], labels[20 * 5];
  ddp_rng rng;
  ddp_rng_seed(&rng, 7 + (uint64_t)rank);
  for (int i = 0; i < 200; i++) inputs[i] = ddp_rng_normal(&rng);
  for (int i = 0; i < 100; i++) labels[i] = ddp_rng_normal(&rng);
  ddp_tensor x, y, *out, *loss;
  CHECK(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, (int64_t[]){20, 10}, inputs));
  CHECK(ddp_tensor_wrap(&y, DDP_FLOAT32, 2, (int64_t[]){20, 5}, labels));

  float *before = malloc((size_t)n * sizeof *before);
  float *local = malloc((size_t)n * sizeof *local);
  float *all = malloc((size_t)(n * world) * sizeof *all);
  float *expect = calloc((size_t)n, sizeof *expect);
  if (!before || !local || !all || !expect) return 1;
  copy_canonical(model, false, before);

  /* This rank's own gradient (no_sync: backward without communication). */
  ddp_dp_set_no_sync(dp, true);
  ddp_model_zero_grad(model);
  ddp_tape_reset(tape);
  CHECK(ddp_dp_forward(dp, tape, &x, &out));
  CHECK(ddp_mse_loss(tape, out, &y, &loss));
  CHECK(ddp_dp_backward(dp, tape, loss));
  copy_canonical(model, true, local);
  CHECK(ddp_allgather(pg, local, all, (size_t)n, DDP_FLOAT32));
  for (int r = 0; r < world; r++)
    for (int64_t i = 0; i < n; i++) expect[i] += all[r * n + i] / (float)world;
  ddp_dp_set_no_sync(dp, false);

  /* The demo's step: optimizer.zero_grad(); loss_fn(ddp_model(x), y).backward(); step(). */
  ddp_model_zero_grad(model);
  ddp_tape_reset(tape);
  CHECK(ddp_dp_forward(dp, tape, &x, &out));
  CHECK(ddp_mse_loss(tape, out, &y, &loss));
  CHECK(ddp_dp_backward(dp, tape, loss));
  copy_canonical(model, true, local);
  double grad_err = max_abs_diff(local, expect, n);
  float step_loss = ddp_tensor_f32(loss)[0];
  CHECK(ddp_optimizer_step(opt));

  /* Every replica the same after the step: gather the parameters. */
  float *params = local;
  copy_canonical(model, false, params);
  CHECK(ddp_allgather(pg, params, all, (size_t)n, DDP_FLOAT32));
  double spread = 0;
  for (int r = 1; r < world; r++) spread = fmax(spread, max_abs_diff(all, all + r * n, n));
  double moved = max_abs_diff(params, before, n);

  bool ok = grad_err <= 1e-6 && spread == 0 && moved > 0;
  printf("rank %d: loss %.6f; gradient = mean of the %d ranks' gradients (max diff %.2g); "
         "replicas after the step: %s (max spread %.2g), parameters moved by up to %.3g: %s\n",
         rank, step_loss, world, grad_err, spread == 0 ? "identical" : "DIFFERENT", spread, moved,
         ok ? "ok" : "FAILED");

  free(before);
  free(local);
  free(all);
  free(expect);
  ddp_tape_destroy(tape);
  ddp_dp_destroy(dp);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  CHECK(ddp_barrier(pg)); /* cleanup(): leave together */
  ddp_process_group_destroy(pg);
  return ok ? 0 : 1;
}
