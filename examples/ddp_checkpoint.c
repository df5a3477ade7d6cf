/* Seed 001's demo_checkpoint in C: rank 0 saves the wrapped ToyModel's state
 * dict (safetensors, PyTorch's names), every rank waits at a barrier, then
 * every rank loads it, and all take one SGD step (lr 0.001, MSE); rank 0
 * removes the file at the end. Run it under the launcher:
 *
 *   build/bin/ddprun --nproc-per-node 2 build/bin/ddp_checkpoint [--path FILE]
 *
 * The seed's map_location maps rank 0's cuda:0 tensors onto each rank's own
 * device; ddp has CPU tensors, so loading copies the file's tensors into this
 * process's model, which is what map_location achieves. To show that the
 * load does something, every rank scrambles its parameters after the save;
 * it checks and prints that after the load every rank holds exactly the
 * parameters rank 0 saved, and that the replicas are identical after the
 * step. The file name is chosen by rank 0 (unique in $TMPDIR, or --path)
 * and sent to the others. Exit status 1 if a check fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "ddp_checkpoint: %s: %s\n", #expr, ddp_last_error());    \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* The parameters in state-dict order (the flat buffer may be re-laid out). */
static void copy_params(ddp_model *model, float *dst) {
  for (int i = 0; i < ddp_model_state_count(model); i++) {
    ddp_state_entry e;
    CHECK(ddp_model_state_entry(model, i, &e));
    if (!e.is_param) continue;
    memcpy(dst, e.data, (size_t)e.numel * sizeof *dst);
    dst += e.numel;
  }
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - (double)b[i]));
  return m;
}

int main(int argc, char **argv) {
  const char *user_path = argc == 3 && !strcmp(argv[1], "--path") ? argv[2] : NULL;
  if (argc != 1 && !user_path) {
    fprintf(stderr, "usage: ddp_checkpoint [--path FILE]\n");
    return 2;
  }
  ddp_process_group *pg;
  CHECK(ddp_init_process_group("env://", NULL, NULL, &pg));
  int rank = ddp_process_group_rank(pg), world = ddp_process_group_size(pg);
  printf("Running DDP checkpoint example on rank %d.\n", rank);

  ddp_model *model;
  CHECK(ddp_model_build("toy", NULL, 1000 + (uint64_t)rank, &model));
  ddp_dp *dp;
  ddp_dp_options o = ddp_dp_defaults();
  CHECK(ddp_dp_create(&dp, model, pg, &o)); /* rank 0's parameters everywhere */
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = 0.001;
  ddp_optimizer *opt;
  int64_t n = ddp_model_num_param_elements(model);
  CHECK(ddp_optimizer_create(&opt, &sgd, ddp_model_params_flat(model),
                             ddp_model_grads_flat(model), (size_t)n));
  ddp_dp_set_optimizer(dp, opt);

  /* CHECKPOINT_PATH: rank 0 picks it and tells the others. */
  char path[4096];
  void *name = NULL;
  size_t name_bytes = 0;
  if (rank == 0) {
    if (user_path) snprintf(path, sizeof path, "%s", user_path);
    else
      snprintf(path, sizeof path, "%s/ddp_checkpoint.%d.safetensors",
               getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    name = path;
    name_bytes = strlen(path) + 1;
  }
  CHECK(ddp_broadcast_bytes(pg, &name, &name_bytes, 0));
  if (rank != 0) {
    snprintf(path, sizeof path, "%s", (const char *)name);
    ddp_free(name);
  }

  float *saved = malloc((size_t)n * sizeof *saved);
  float *mine = malloc((size_t)n * sizeof *mine);
  float *all = malloc((size_t)(n * world) * sizeof *all);
  if (!saved || !mine || !all) return 1;
  /* if rank == 0: torch.save(ddp_model.state_dict(), CHECKPOINT_PATH) */
  if (rank == 0) {
    CHECK(ddp_model_save(model, path, NULL, 0)); /* temporary file, fsync, rename */
    copy_params(model, saved);
  }
  CHECK(ddp_broadcast(pg, saved, (size_t)n, DDP_FLOAT32, 0)); /* for the check below */
  CHECK(ddp_barrier(pg)); /* dist.barrier(): nobody loads before rank 0 has saved */

  /* Scramble this replica, so that only the load can bring it back. */
  float *p = ddp_model_params_flat(model);
  for (int64_t i = 0; i < n; i++) p[i] = (float)(rank + 1) * 0.5f - p[i];
  /* ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH, map_location=...)) */
  CHECK(ddp_model_load(model, path));
  copy_params(model, mine);
  double load_err = max_abs_diff(mine, saved, n);

  /* One step, as the demo: zero_grad, forward, MSE against random labels,
   * backward, step. Each rank its own batch. */
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 20));
  float inputs[20 * 10], labels[20 * 5];
  ddp_rng rng;
  ddp_rng_seed(&rng, 11 + (uint64_t)rank);
  for (int i = 0; i < 200; i++) inputs[i] = ddp_rng_normal(&rng);
  for (int i = 0; i < 100; i++) labels[i] = ddp_rng_normal(&rng);
  ddp_tensor x, y, *out, *loss;
  CHECK(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, (int64_t[]){20, 10}, inputs));
  CHECK(ddp_tensor_wrap(&y, DDP_FLOAT32, 2, (int64_t[]){20, 5}, labels));
  ddp_model_zero_grad(model);
  ddp_tape_reset(tape);
  CHECK(ddp_dp_forward(dp, tape, &x, &out));
  CHECK(ddp_mse_loss(tape, out, &y, &loss));
  CHECK(ddp_dp_backward(dp, tape, loss));
  CHECK(ddp_optimizer_step(opt));
  copy_params(model, mine);
  CHECK(ddp_allgather(pg, mine, all, (size_t)n, DDP_FLOAT32));
  double spread = 0;
  for (int r = 1; r < world; r++) spread = fmax(spread, max_abs_diff(all, all + r * n, n));

  bool ok = load_err == 0 && spread == 0;
  printf("rank %d: loaded rank 0's checkpoint: parameters %s rank 0's saved ones (max diff %.2g); "
         "after one step (loss %.6f) the replicas are %s: %s\n",
         rank, load_err == 0 ? "equal to" : "DIFFER from", load_err, ddp_tensor_f32(loss)[0],
         spread == 0 ? "identical" : "DIFFERENT", ok ? "ok" : "FAILED");

  CHECK(ddp_barrier(pg)); /* every rank has loaded before the file goes */
  if (rank == 0 && unlink(path) != 0) perror(path); /* os.remove(CHECKPOINT_PATH) */
  free(saved);
  free(mine);
  free(all);
  ddp_tape_destroy(tape);
  ddp_dp_destroy(dp);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  ddp_process_group_destroy(pg);
  return ok ? 0 : 1;
}
