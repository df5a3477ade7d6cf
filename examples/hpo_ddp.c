/* Seed 002's tutorial in C: "Using Propulate with PyTorch
 * DistributedDataParallel". An evolutionary search over a convnet-N's
 * hyperparameters in which every individual is trained data-parallel on
 * its worker's ranks (include/ddp/hpo.h, include/ddp/train.h).
 *
 *   build/bin/ddprun --nproc-per-node 4 build/bin/hpo_ddp [generations=4] [ranks/worker=2]
 *
 * The tutorial's ind_loss is `loss` below: build the network, train it with
 * Adadelta and StepLR on the worker's group, return the best validation
 * loss (reduced over the group, unlike the tutorial's, which reports about
 * 1/ranks of it). Rank 0 prints the island's best individuals. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"

#define DATA "/usr/share/datasets/fashion-mnist"

typedef struct job {
  ddp_dataset *train, *test;
  int64_t evaluations;
} job;

static bool keep_best(const ddp_train_eval_info *info, void *user) {
  double *best = user;
  if (info->test_loss < *best) *best = info->test_loss;
  return false;
}

/* One individual: conv_layers, activation, lr, gamma (the space's order). */
static double loss(const ddp_hpo_space *space, const double *v, ddp_process_group *worker,
                   void *user) {
  job *j = user;
  char name[32];
  snprintf(name, sizeof name, "convnet-%d", (int)v[0]);
  const char *activation = ddp_hpo_space_trait(space, 1)->choices[(int)v[1]];
  ddp_model *model;
  if (ddp_model_build(name, activation, (uint64_t)j->evaluations++, &model) != DDP_OK)
    return INFINITY;
  ddp_train_options o = ddp_train_defaults();
  o.optim = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  o.optim.lr = v[2];
  o.step_lr_size = 1;
  o.step_lr_gamma = v[3];
  o.batch_size = 8;
  o.epochs = 2;
  o.max_steps = 100; /* a short run per individual: this is a demonstration */
  o.workers = 0;
  double best = INFINITY;
  o.callbacks.on_eval = keep_best;
  o.callbacks.user = &best;
  ddp_trainer *t;
  ddp_train_result r;
  if (ddp_trainer_create(&t, model, j->train, j->test, worker, &o) == DDP_OK) {
    if (ddp_trainer_run(t, &r) == DDP_OK) ddp_train_result_free(&r);
    else best = INFINITY;
    ddp_trainer_destroy(t);
  }
  ddp_model_destroy(model);
  return best;
}

int main(int argc, char **argv) {
  int generations = argc > 1 ? atoi(argv[1]) : 4;
  int ranks_per_worker = argc > 2 ? atoi(argv[2]) : 2;
  /* The job: its store carries the workers' exchange, the world its splits. */
  ddp_rendezvous_info info = {0};
  ddp_process_group *world = NULL;
  if (ddp_rendezvous_requested() &&
      (ddp_rendezvous("env://", NULL, &info) != DDP_OK ||
       ddp_process_group_create(info.store, info.rank, info.world_size, NULL, &world) != DDP_OK))
    goto fail;
  job j = {0};
  if (ddp_dataset_open_idx_dir(&j.train, DATA, DDP_SPLIT_TRAIN) != DDP_OK ||
      ddp_dataset_open_idx_dir(&j.test, DATA, DDP_SPLIT_TEST) != DDP_OK ||
      ddp_dataset_truncate(j.test, 1000) != DDP_OK)
    goto fail;
  ddp_hpo_space *space;
  if (ddp_hpo_space_parse("conv_layers=int:2:10,activation=cat:relu|sigmoid|tanh,"
                          "lr=logfloat:0.0001:0.01,gamma=float:0.5:0.999",
                          &space) != DDP_OK)
    goto fail;
  ddp_hpo_options o = ddp_hpo_defaults();
  o.generations = generations;
  o.ranks_per_worker = world ? ranks_per_worker : 1;
  o.pop_size = 2 * (world ? ddp_process_group_size(world) / o.ranks_per_worker : 1);
  ddp_hpo_result r;
  if (ddp_hpo_search_world(space, &o, loss, &j, world, info.store, &r) != DDP_OK) goto fail;
  if (info.rank == 0 && r.count > 0) {
    char buf[256];
    ddp_hpo_format(space, r.individuals[r.best].values, buf, sizeof buf);
    printf("%lld individuals on island 0; best: %s, loss %.4f (worker %d, generation %lld)\n",
           (long long)r.count, buf, r.individuals[r.best].loss, r.individuals[r.best].worker,
           (long long)r.individuals[r.best].generation);
  }
  ddp_hpo_result_free(&r);
  ddp_hpo_space_destroy(space);
  ddp_dataset_destroy(j.test);
  ddp_dataset_destroy(j.train);
  if (world) {
    ddp_barrier(world); /* rank 0 may host the store: leave together */
    ddp_process_group_destroy(world);
  }
  ddp_rendezvous_info_destroy(&info);
  return 0;
fail:
  fprintf(stderr, "hpo_ddp: %s\n", ddp_last_error());
  return 1;
}
