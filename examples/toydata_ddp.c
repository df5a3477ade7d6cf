/* Seed 000's data-parallel example in C: the head/tail ToyModel (Linear 32->32,
 * Linear 32->10) on ToyData (sample i is 32 copies of i, label i mod 10),
 * wrapped for data parallelism, fed by a DistributedSampler (shuffled, seeded,
 * set_epoch each epoch), Adam lr 1e-4 and cross-entropy, batch 1024 per rank:
 *
 *   build/bin/ddprun --nproc-per-node 2 build/bin/toydata_ddp [--samples N]
 *       [--epochs E] [--batch-size B] [--lr X]
 *
 * It checks and prints two things: the ranks' shards of each epoch are
 * disjoint and together cover the dataset (the ranks gather their index
 * lists), and the loss reduced over the ranks falls from the first steps of
 * training to the last. Exit status 1 if either fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "toydata_ddp: %s: %s\n", #expr, ddp_last_error());       \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

typedef struct options {
  int64_t samples, epochs, batch_size;
  double lr;
} options;

static options parse(int argc, char **argv) {
  options o = {.samples = (int64_t)1 << 20, .epochs = 1, .batch_size = 1024, .lr = 1e-4};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--samples")) o.samples = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--epochs")) o.epochs = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--batch-size")) o.batch_size = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--lr")) o.lr = atof(argv[i + 1]);
    else break;
  }
  if (argc % 2 == 0 || o.samples < 1 || o.epochs < 1 || o.batch_size < 1 || !(o.lr > 0)) {
    fprintf(stderr, "usage: toydata_ddp [--samples N] [--epochs E] [--batch-size B] [--lr X]\n");
    exit(2);
  }
  return o;
}

/* Gathers every rank's epoch indices and checks that each sample appears
 * exactly as often as DistributedSampler promises: once, plus the padding
 * (the first total - N samples of the shuffled order once more). */
static bool shards_cover(ddp_process_group *pg, ddp_sampler *sampler, int64_t n) {
  int world = ddp_process_group_size(pg);
  int64_t len = ddp_sampler_length(sampler);
  int64_t *mine = malloc((size_t)len * sizeof *mine);
  int64_t *all = malloc((size_t)(len * world) * sizeof *all);
  int32_t *seen = calloc((size_t)n, sizeof *seen);
  if (!mine || !all || !seen) exit(1);
  CHECK(ddp_sampler_fill(sampler, mine));
  CHECK(ddp_allgather(pg, mine, all, (size_t)len, DDP_INT64));
  for (int64_t i = 0; i < len * world; i++) seen[all[i]]++;
  int64_t once = 0, twice = 0;
  for (int64_t i = 0; i < n; i++) {
    once += seen[i] == 1;
    twice += seen[i] == 2;
  }
  free(mine);
  free(all);
  free(seen);
  return once + twice == n && twice == len * world - n;
}

int main(int argc, char **argv) {
  options o = parse(argc, argv);
  ddp_process_group *pg;
  CHECK(ddp_init_process_group("env://", NULL, NULL, &pg));
  int rank = ddp_process_group_rank(pg), world = ddp_process_group_size(pg);

  ddp_model *model; /* ToyModel: head, tail */
  CHECK(ddp_model_build("headtail", NULL, 0, &model));
  ddp_dp *dp;
  ddp_dp_options dpo = ddp_dp_defaults();
  CHECK(ddp_dp_create(&dp, model, pg, &dpo)); /* model = DDP(model) */
  ddp_optim_options adam = ddp_optim_defaults(DDP_OPTIM_ADAM);
  adam.lr = o.lr;
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &adam, ddp_model_params_flat(model),
                             ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)));
  ddp_dp_set_optimizer(dp, opt);

  ddp_dataset *ds; /* dataset = ToyData() */
  CHECK(ddp_dataset_create_toydata(&ds, o.samples));
  ddp_sampler *sampler; /* DistributedSampler(dataset): shuffles by default */
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(world, rank);
  CHECK(ddp_sampler_create_distributed(&sampler, o.samples, &so));
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = o.batch_size;
  lc.sampler = sampler;
  ddp_loader *loader; /* DataLoader(dataset, batch_size=bsz, sampler=sampler) */
  CHECK(ddp_loader_create(&loader, ds, &lc));
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 1 << 20));

  bool shards_ok = true;
  double first = 0, last = 0; /* mean reduced loss of the first / last `window` steps */
  int64_t steps_per_epoch = ddp_loader_num_batches(loader);
  int64_t total = steps_per_epoch * o.epochs, step = 0;
  int64_t window = total / 10 > 0 ? (total / 10 < 20 ? total / 10 : 20) : 1;
  for (int64_t epoch = 0; epoch < o.epochs; epoch++) {
    ddp_sampler_set_epoch(sampler, epoch); /* sampler.set_epoch(epoch) */
    shards_ok &= shards_cover(pg, sampler, o.samples);
    CHECK(ddp_loader_start_epoch(loader, epoch));
    for (;;) {
      ddp_batch b;
      CHECK(ddp_loader_next(loader, &b));
      if (b.size == 0) break;
      ddp_tensor *out, *loss;
      ddp_model_zero_grad(model);                         /* optimizer.zero_grad() */
      ddp_tape_reset(tape);
      CHECK(ddp_dp_forward(dp, tape, &b.x, &out));        /* o = model(x) */
      CHECK(ddp_model_loss(model, tape, out, &b.y, &loss)); /* l = loss(o, y) */
      CHECK(ddp_dp_backward(dp, tape, loss));             /* l.backward() */
      CHECK(ddp_optimizer_step(opt));                     /* optimizer.step() */
      double l = ddp_tensor_f32(loss)[0];
      CHECK(ddp_allreduce(pg, &l, 1, DDP_FLOAT64, DDP_REDUCE_AVG));
      if (step < window) first += l / (double)window;
      if (step >= total - window) last += l / (double)window;
      if (rank == 0 && (step + 1) % 100 == 0)
        printf("epoch %lld step %lld/%lld: loss %.4f\n", (long long)epoch + 1,
               (long long)(step % steps_per_epoch) + 1, (long long)steps_per_epoch, l);
      step++;
    }
  }
  bool ok = shards_ok && isfinite(last) && last < first;
  if (rank == 0) {
    int64_t padding = ddp_sampler_length(sampler) * world - o.samples;
    printf("sampler: the %d ranks' shards of every epoch hold each of the %lld samples once "
           "(plus %lld padding repeats): %s\n", world, (long long)o.samples, (long long)padding,
           shards_ok ? "yes" : "NO");
    printf("loss over all ranks: first %lld steps %.4f, last %lld steps %.4f: %s\n",
           (long long)window, first, (long long)window, last, ok ? "ok" : "FAILED");
  }
  ddp_tape_destroy(tape);
  ddp_loader_destroy(loader);
  ddp_sampler_destroy(sampler);
  ddp_dataset_destroy(ds);
  ddp_dp_destroy(dp);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  CHECK(ddp_barrier(pg));
  ddp_process_group_destroy(pg);
  return ok ? 0 : 1;
}
