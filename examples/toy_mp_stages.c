/* Seed 001's demo_model_parallel in C: ToyMpModel's net1 (Linear 10->10,
 * ReLU) and net2 (Linear 10->5) on two devices, the whole wrapped in data
 * parallelism, one SGD step (lr 0.001, MSE) on each replica's random batch
 * of 20. Here the devices are ranks: ranks 2k and 2k + 1 are replica k's two
 * stages (a pipeline, include/ddp/pipeline.h, split at net2, the batch in 2
 * micro-batches of 10), and each stage's gradients are averaged over the
 * ranks holding the same stage once the step's last backward is done (what
 * DDP(mp_model) does in the seed). Run it with an even number of ranks:
 *
 *   build/bin/ddprun --nproc-per-node 2 build/bin/toy_mp_stages   # 1 replica
 *   build/bin/ddprun --nproc-per-node 4 build/bin/toy_mp_stages   # 2 replicas
 *
 * It checks what it demonstrates and prints it: each rank holds its stage's
 * parameters only, and after the step they equal the unsplit model's after
 * one SGD step on every replica's samples together (each rank computes that
 * reference itself: the same seed, the same batches), per tensor within
 * 1e-5 * max|ref| + 1e-7. Exit status 1 if a check fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/pipeline.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "toy_mp_stages: %s: %s\n", #expr, ddp_last_error());     \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

enum { BATCH = 20, IN = 10, OUT = 5, MICROBATCHES = 2 };
#define LR 0.001 /* the seed's optim.SGD(lr=0.001) */

/* Replica k's batch, torch.randn(20, 10) and torch.randn(20, 5): the same
 * on every rank that asks for it. */
static void replica_batch(int k, float *x, float *y) {
  ddp_rng rng;
  ddp_rng_seed(&rng, 1000 + (uint64_t)k);
  for (int i = 0; i < BATCH * IN; i++) x[i] = ddp_rng_normal(&rng);
  for (int i = 0; i < BATCH * OUT; i++) y[i] = ddp_rng_normal(&rng);
}

int main(void) {
  ddp_process_group *world;
  CHECK(ddp_init_process_group("env://", NULL, NULL, &world));
  const int rank = ddp_process_group_rank(world), size = ddp_process_group_size(world);
  if (size % 2) {
    fprintf(stderr, "toy_mp_stages: %d ranks: run an even number (2 stages x replicas)\n", size);
    return 1;
  }
  const int replicas = size / 2, replica = rank / 2, stage = rank % 2;
  /* The mesh: replica k's pipeline group {2k, 2k + 1}, and stage s's
   * data-parallel group {s, s + 2, ...}. */
  ddp_process_group *pipe, *dp;
  CHECK(ddp_process_group_split(world, replica, stage, &pipe));
  CHECK(ddp_process_group_split(world, stage, replica, &dp));

  /* ToyMpModel: "toy" is net1, relu, net2 with PyTorch's names. Every rank
   * builds it from the same seed and keeps its own stage's modules. */
  ddp_model *full;
  CHECK(ddp_model_build("toy", NULL, 1, &full));
  ddp_pipeline_options po = ddp_pipeline_defaults();
  po.schedule = DDP_PIPELINE_1F1B;
  po.n_microbatches = MICROBATCHES;
  po.split = "net2"; /* stage 1 begins at net2: net1 and relu on stage 0 */
  po.max_batch = BATCH;
  ddp_pipeline *pp;
  CHECK(ddp_pipeline_create(&pp, full, pipe, &po));
  ddp_model *mine = ddp_pipeline_model(pp);
  if (replicas > 1) ddp_pipeline_set_grad_sync(pp, ddp_pipeline_allreduce_grads, dp);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = LR;
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(mine), ddp_model_grads_flat(mine),
                             (size_t)ddp_model_num_param_elements(mine)));

  /* One step: inputs on the first stage, labels on the last. */
  float x[BATCH * IN], y[BATCH * OUT];
  replica_batch(replica, x, y);
  ddp_tensor xt, yt;
  CHECK(ddp_tensor_wrap(&xt, DDP_FLOAT32, 2, (int64_t[]){BATCH, IN}, x));
  CHECK(ddp_tensor_wrap(&yt, DDP_FLOAT32, 2, (int64_t[]){BATCH, OUT}, y));
  ddp_model_zero_grad(mine);
  double loss = NAN;
  CHECK(ddp_pipeline_step(pp, ddp_pipeline_is_first(pp) ? &xt : NULL,
                          ddp_pipeline_is_last(pp) ? &yt : NULL, &loss));
  CHECK(ddp_optimizer_step(opt));

  /* The reference: the unsplit model, one SGD step on all replicas'
   * samples at once (equal micro-batches of a mean loss, averaged over
   * replicas: the mean over every sample). */
  ddp_model *ref;
  CHECK(ddp_model_build("toy", NULL, 1, &ref));
  const int n = BATCH * replicas;
  float *ax = malloc(sizeof(float) * (size_t)n * IN), *ay = malloc(sizeof(float) * (size_t)n * OUT);
  if (!ax || !ay) return 1;
  for (int k = 0; k < replicas; k++) replica_batch(k, ax + k * BATCH * IN, ay + k * BATCH * OUT);
  ddp_tensor rx, ry, *out, *rloss;
  CHECK(ddp_tensor_wrap(&rx, DDP_FLOAT32, 2, (int64_t[]){n, IN}, ax));
  CHECK(ddp_tensor_wrap(&ry, DDP_FLOAT32, 2, (int64_t[]){n, OUT}, ay));
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 20));
  ddp_model_zero_grad(ref);
  CHECK(ddp_model_forward(ref, tape, &rx, &out));
  CHECK(ddp_model_loss(ref, tape, out, &ry, &rloss));
  CHECK(ddp_backward(tape, rloss));
  ddp_optimizer *ref_opt;
  CHECK(ddp_optimizer_create(&ref_opt, &oo, ddp_model_params_flat(ref), ddp_model_grads_flat(ref),
                             (size_t)ddp_model_num_param_elements(ref)));
  CHECK(ddp_optimizer_step(ref_opt));

  /* This rank's parameters against the reference's of the same name. */
  bool ok = ddp_model_num_params(mine) > 0 &&
            ddp_model_num_params(mine) < ddp_model_num_params(ref);
  double worst = 0;
  char names[128] = "";
  for (int i = 0; i < ddp_model_num_params(mine); i++) {
    const ddp_tensor *a = ddp_model_param(mine, i);
    const char *name = ddp_model_param_name(mine, i);
    const ddp_tensor *b = ddp_model_find_param(ref, name);
    if (!b || b->numel != a->numel) {
      ok = false;
      continue;
    }
    double err = 0, scale = 0;
    for (int64_t j = 0; j < a->numel; j++) {
      err = fmax(err, fabs((double)ddp_tensor_f32(a)[j] - ddp_tensor_f32(b)[j]));
      scale = fmax(scale, fabs(ddp_tensor_f32(b)[j]));
    }
    ok &= err <= 1e-5 * scale + 1e-7;
    worst = fmax(worst, err);
    snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", name);
  }
  printf("rank %d: stage %d of 2 (%s), replica %d of %d: after the step, parameters equal the "
         "unsplit model's step on all %d samples (max diff %.3g): %s\n",
         rank, stage, names, replica, replicas, n, worst, ok ? "ok" : "FAIL");
  if (ddp_pipeline_is_last(pp))
    printf("rank %d: replica %d's loss %.6f over %d micro-batches\n", rank, replica, loss,
           MICROBATCHES);

  free(ax);
  free(ay);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(ref_opt);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(ref);
  ddp_pipeline_destroy(pp);
  ddp_model_destroy(full);
  ddp_process_group_destroy(dp);
  ddp_process_group_destroy(pipe);
  ddp_process_group_destroy(world);
  return ok ? 0 : 1;
}
