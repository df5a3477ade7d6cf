/* The data-parallel training step of ddp-train allocates nothing in its steady
 * state: two ranks (threads of this process, one group over an in-process
 * store) each run ddp-train's step -- next batch from a loader over their
 * DistributedSampler shard, zero_grad, the wrapper's forward (buffer
 * broadcast), loss, the loss's async allreduce overlapping the wrapper's
 * backward (bucketed allreduces), the optimizer step, the wait -- and
 * ddp_alloc_count(), which every ddp allocation of every thread passes
 * through (the groups' progress threads and the loaders' too), does not move
 * over 5 steps after 3 warm-up steps (the first synced step re-lays out the
 * buffers). Cases: headtail on ToyData with Adam and a loader thread; the
 * ConvNet with SyncBatchNorm and momentum SGD on Fashion-MNIST (skipped, with
 * a message, when the data set is not installed); ZeRO stages 2 and 3
 * (include/ddp/zero.h: per-module gathers and releases at 3) with
 * gradient-norm clipping from the shards, on headtail; at 2 with the
 * gradient ring (small buckets, each slot reused; the ring is made at its
 * first backward, in the warm-up). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "parallel/dp_test_util.h"

#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"
#include "ddp/zero.h"

#define WARMUP 3
#define MEASURED 5
#define FASHION "/usr/share/datasets/fashion-mnist"

typedef struct alloc_case {
  const char *model;
  bool sync_bn;
  int workers;
  int zero_stage;    /* > 0: through ddp_zero at this stage */
  double clip;       /* > 0: clip_grad_norm to this */
  pthread_barrier_t barrier;
  uint64_t before, after;
} alloc_case;

static void rank_body(dpt_rank *self) {
  alloc_case *c = self->world->user;
  int world = self->world->size;
  ddp_model *model;
  DPT_OK(self, ddp_model_build(c->model, NULL, 3, &model));
  ddp_dataset *ds;
  if (!strcmp(c->model, "headtail")) DPT_OK(self, ddp_dataset_create_toydata(&ds, 4096));
  else DPT_OK(self, ddp_dataset_open_idx_dir(&ds, FASHION, DDP_SPLIT_TEST));
  if (c->sync_bn) DPT_OK(self, ddp_model_convert_sync_batchnorm(model, self->pg));
  ddp_optim_kind kind = c->sync_bn ? DDP_OPTIM_SGD : DDP_OPTIM_ADAM;
  ddp_optim_options oo = ddp_optim_defaults(kind);
  oo.lr = 0.01;
  if (kind == DDP_OPTIM_SGD) oo.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  DPT_OK(self, ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model),
                                    ddp_model_grads_flat(model),
                                    (size_t)ddp_model_num_param_elements(model)));
  ddp_dp *dp = NULL;
  ddp_zero *z = NULL;
  ddp_dp_options dpo = ddp_dp_defaults();
  if (c->zero_stage) {
    ddp_zero_options zo = ddp_zero_defaults(c->zero_stage);
    if (c->zero_stage == 2) zo.dp.bucket_cap_mb = zo.dp.first_bucket_mb = 0.001;
    DPT_OK(self, ddp_zero_create(&z, model, self->pg, opt, &zo));
  } else {
    DPT_OK(self, ddp_dp_create(&dp, model, self->pg, &dpo));
    ddp_dp_set_optimizer(dp, opt);
  }
  ddp_sampler *sampler;
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(world, self->rank);
  DPT_OK(self, ddp_sampler_create_distributed(&sampler, ddp_dataset_size(ds), &so));
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = 16;
  lc.sampler = sampler;
  lc.num_workers = c->workers;
  ddp_loader *loader;
  DPT_OK(self, ddp_loader_create(&loader, ds, &lc));
  ddp_tape *tape;
  DPT_OK(self, ddp_tape_create(&tape, 1 << 16)); /* small: grows in warm-up, then settles */
  DPT_OK(self, ddp_loader_start_epoch(loader, 0));

  for (int step = 0; step < WARMUP + MEASURED; step++) {
    if (step == WARMUP) {
      pthread_barrier_wait(&c->barrier);
      if (self->rank == 0) c->before = ddp_alloc_count();
      pthread_barrier_wait(&c->barrier);
    }
    ddp_batch b;
    DPT_OK(self, ddp_loader_next(loader, &b));
    DPT_CHECK(self, b.size == 16, "batch of %lld", (long long)b.size);
    ddp_tensor *out, *loss;
    ddp_tape_reset(tape);
    if (z) DPT_OK(self, ddp_zero_zero_grad(z));
    else ddp_model_zero_grad(model);
    DPT_OK(self, z ? ddp_zero_forward(z, tape, &b.x, &out) : ddp_dp_forward(dp, tape, &b.x, &out));
    DPT_OK(self, ddp_model_loss(model, tape, out, &b.y, &loss));
    double sums[2] = {(double)ddp_tensor_f32(loss)[0] * (double)b.size, (double)b.size};
    ddp_work *work;
    DPT_OK(self, ddp_allreduce_async(self->pg, sums, 2, DDP_FLOAT64, DDP_REDUCE_SUM, &work));
    DPT_OK(self, z ? ddp_zero_backward(z, tape, loss) : ddp_dp_backward(dp, tape, loss));
    if (c->clip > 0)
      DPT_OK(self, z ? ddp_zero_clip_grad_norm(z, c->clip, NULL)
                     : ddp_model_clip_grad_norm(model, c->clip, NULL));
    DPT_OK(self, z ? ddp_zero_step(z) : ddp_optimizer_step(opt));
    DPT_OK(self, ddp_work_wait(work, -1));
    ddp_work_free(work);
    DPT_CHECK(self, sums[1] == 16.0 * world, "the reduced count is %g", sums[1]);
  }
  pthread_barrier_wait(&c->barrier);
  if (self->rank == 0) c->after = ddp_alloc_count();
  pthread_barrier_wait(&c->barrier);
  if (z && c->zero_stage == 2) {
    ddp_zero_memory mem;
    ddp_zero_get_memory(z, &mem);
    DPT_CHECK(self, mem.grad_ring_bytes > 0, "stage 2: the gradient ring was not in use");
  }

  ddp_tape_destroy(tape);
  ddp_loader_destroy(loader);
  ddp_sampler_destroy(sampler);
  ddp_dp_destroy(dp);
  ddp_zero_destroy(z);
  ddp_optimizer_destroy(opt);
  ddp_dataset_destroy(ds);
  ddp_model_destroy(model);
}

static void run(alloc_case *c) {
  pthread_barrier_init(&c->barrier, NULL, 2);
  int failed = dpt_run(2, 30, rank_body, c);
  pthread_barrier_destroy(&c->barrier);
  assert_int_equal(failed, 0);
  uint64_t allocations = c->after - c->before;
  if (allocations)
    print_error("%s: %llu allocations in %d steady-state data-parallel steps\n", c->model,
                (unsigned long long)allocations, MEASURED);
  assert_int_equal(allocations, 0);
}

static void test_headtail_adam_loader_thread(void **state) {
  (void)state;
  alloc_case c = {.model = "headtail", .workers = 1};
  run(&c);
}

static void test_convnet_sync_bn(void **state) {
  (void)state;
  ddp_dataset *probe;
  if (ddp_dataset_open_idx_dir(&probe, FASHION, DDP_SPLIT_TEST) != DDP_OK) {
    print_message("SKIP: %s is not installed (scripts/install-deps.sh data)\n", FASHION);
    skip();
  }
  ddp_dataset_destroy(probe);
  alloc_case c = {.model = "convnet", .sync_bn = true, .workers = 0};
  run(&c);
}

static void test_zero_with_clipping(void **state) {
  (void)state;
  alloc_case dp = {.model = "headtail", .clip = 0.1};
  run(&dp);
  for (int stage = 2; stage <= 3; stage++) {
    alloc_case c = {.model = "headtail", .zero_stage = stage, .clip = 0.1};
    run(&c);
  }
}

int main(void) {
  /* Stage 2's ring wherever the graph fits it (headtail is too small for
   * the default rule to choose it). */
  setenv("DDP_ZERO_GRAD_RING", "always", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_headtail_adam_loader_thread),
      cmocka_unit_test(test_convnet_sync_bn),
      cmocka_unit_test(test_zero_with_clipping),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
