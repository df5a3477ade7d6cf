/* The trainer from C: seed 001's ConvNet on Fashion-MNIST in a few lines,
 * one process or, under a launcher, data-parallel over all of them
 * (include/ddp/train.h, docs/train.md).
 *
 *   build/bin/train_api [steps=200] [data dir]
 *   build/bin/ddprun --nproc-per-node 2 build/bin/train_api 200
 *
 * Prints the loss every 50 steps (rank 0) and the test accuracy at the end;
 * the step callback also shows how a run stops early: it asks to stop after
 * `steps` steps, and every rank stops there. */
#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"

typedef struct view {
  int rank;
  int64_t stop_after;
} view;

static bool on_step(const ddp_train_step_info *s, void *user) {
  const view *v = user;
  if (v->rank == 0 && s->step % 50 == 0)
    printf("step %lld: loss %.4f, %.0f samples/s\n", (long long)s->step, s->loss,
           s->samples_per_s);
  return s->step >= v->stop_after; /* true: stop here, on every rank */
}

int main(int argc, char **argv) {
  int64_t steps = argc > 1 ? atoll(argv[1]) : 200;
  const char *data = argc > 2 ? argv[2] : "/usr/share/datasets/fashion-mnist";

  /* A launcher's variables (ddprun, torchrun, srun, mpirun) mean: join them. */
  ddp_process_group *pg = NULL;
  if (ddp_rendezvous_requested() && ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK)
    goto fail;
  view v = {.rank = pg ? ddp_process_group_rank(pg) : 0, .stop_after = steps};

  ddp_model *model = NULL;
  ddp_dataset *train = NULL, *test = NULL;
  ddp_trainer *trainer = NULL;
  if (ddp_model_build("convnet", NULL, /*seed*/ 2, &model) != DDP_OK ||
      ddp_dataset_open_idx_dir(&train, data, DDP_SPLIT_TRAIN) != DDP_OK ||
      ddp_dataset_open_idx_dir(&test, data, DDP_SPLIT_TEST) != DDP_OK)
    goto fail;

  ddp_train_options o = ddp_train_defaults(); /* SGD lr 0.01, batch 100 per rank, 1 epoch */
  o.optim.sgd.momentum = 0.9;
  o.seed = 2;
  o.callbacks.on_step = on_step;
  o.callbacks.user = &v;
  ddp_train_result r;
  if (ddp_trainer_create(&trainer, model, train, test, pg, &o) != DDP_OK ||
      ddp_trainer_run(trainer, &r) != DDP_OK)
    goto fail;
  if (v.rank == 0)
    printf("trained %lld steps on %d rank(s), stopped by %s: test accuracy %.2f%%, test loss "
           "%.4f\n", (long long)r.steps, r.world_size, ddp_train_stop_name(r.stopped),
           100 * r.test_accuracy, r.test_loss);
  ddp_train_result_free(&r);
  ddp_trainer_destroy(trainer);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(model);
  if (pg) {
    ddp_barrier(pg); /* rank 0 may host the store: leave together */
    ddp_process_group_destroy(pg);
  }
  return 0;
fail:
  fprintf(stderr, "train_api: %s\n", ddp_last_error());
  return 1;
}
