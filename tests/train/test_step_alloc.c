/* The steady-state training step allocates nothing: after warm-up steps, a
 * whole step (next batch, zero_grad, forward, loss, backward, optimizer step)
 * makes no call to the allocator, counted through ddp_alloc_count(), which
 * every ddp allocation passes through (all threads, the loader's too);
 * under autocast too (forward and loss in a bfloat16 region, as the trainer
 * runs them: the cast cache, the rounded copies, conv1 folded into batch
 * norm's backward). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"

typedef struct step_case {
  const char *model;
  const char *activation;
  ddp_optim_kind optimizer;
  int64_t batch;
  ddp_precision precision; /* autocast region around forward and loss (FP32: none) */
} step_case;

static void run_case(const step_case *c) {
  ddp_model *model;
  assert_int_equal(ddp_model_build(c->model, c->activation, 3, &model), DDP_OK);
  ddp_optim_options oo = ddp_optim_defaults(c->optimizer);
  oo.lr = 0.01;
  if (c->optimizer == DDP_OPTIM_SGD) oo.sgd.momentum = 0.9;
  oo.weight_decay = 1e-4;
  ddp_optimizer *opt;
  assert_int_equal(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model),
                                        ddp_model_grads_flat(model),
                                        (size_t)ddp_model_num_param_elements(model)),
                   DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK); /* small: must grow, then settle */

  /* Data shaped for the model: MNIST-like images for the conv nets. */
  int64_t shape[DDP_MAX_DIMS];
  int nd = ddp_model_sample_shape(model, shape);
  assert_true(nd > 0);
  ddp_dataset *ds;
  if (!strcmp(c->model, "toy"))
    assert_int_equal(ddp_dataset_create_regression(&ds, 256, 5), DDP_OK);
  else if (!strcmp(c->model, "headtail"))
    assert_int_equal(ddp_dataset_create_toydata(&ds, 256), DDP_OK);
  else {
    const char *dir = "/usr/share/datasets/fashion-mnist";
    if (ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TEST) != DDP_OK) {
      ddp_tape_destroy(tape);
      ddp_optimizer_destroy(opt);
      ddp_model_destroy(model);
      skip(); /* dataset-fashion-mnist not installed */
    }
  }
  ddp_loader_config lc = ddp_loader_defaults();
  lc.batch_size = c->batch;
  lc.shuffle = true;
  lc.drop_last = true;
  lc.num_workers = 1;
  ddp_loader *loader;
  assert_int_equal(ddp_loader_create(&loader, ds, &lc), DDP_OK);
  assert_int_equal(ddp_loader_start_epoch(loader, 0), DDP_OK);

  uint64_t before = 0;
  for (int step = 0; step < 8; step++) {
    if (step == 3) before = ddp_alloc_count(); /* steps 0-2 warm up the arena */
    ddp_batch b;
    assert_int_equal(ddp_loader_next(loader, &b), DDP_OK);
    assert_int_equal(b.size, c->batch);
    ddp_tensor *out, *loss;
    ddp_tape_reset(tape);
    ddp_model_zero_grad(model);
    if (c->precision) assert_int_equal(ddp_autocast_enter(c->precision), DDP_OK);
    assert_int_equal(ddp_model_forward(model, tape, &b.x, &out), DDP_OK);
    assert_int_equal(ddp_model_loss(model, tape, out, &b.y, &loss), DDP_OK);
    if (c->precision) assert_int_equal(ddp_autocast_exit(), DDP_OK);
    assert_int_equal(ddp_backward(tape, loss), DDP_OK);
    assert_int_equal(ddp_optimizer_step(opt), DDP_OK);
  }
  uint64_t allocations = ddp_alloc_count() - before;
  if (allocations)
    print_error("%s: %llu allocations in 5 steady-state steps\n", c->model,
                (unsigned long long)allocations);
  assert_int_equal(allocations, 0);

  ddp_loader_destroy(loader);
  ddp_dataset_destroy(ds);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
}

static void test_convnet_sgd(void **state) {
  (void)state;
  step_case c = {"convnet", NULL, DDP_OPTIM_SGD, 32, DDP_PRECISION_FP32};
  run_case(&c);
}

static void test_convnet_sgd_bf16(void **state) {
  (void)state;
  step_case c = {"convnet", NULL, DDP_OPTIM_SGD, 32, DDP_PRECISION_BF16};
  run_case(&c);
}

static void test_psnet_adadelta_with_dropout(void **state) {
  (void)state;
  step_case c = {"psnet", NULL, DDP_OPTIM_ADADELTA, 8, DDP_PRECISION_FP32};
  run_case(&c);
}

static void test_convnet3_tanh_adam(void **state) {
  (void)state;
  step_case c = {"convnet-3", "tanh", DDP_OPTIM_ADAM, 8, DDP_PRECISION_FP32};
  run_case(&c);
}

static void test_toy_and_headtail(void **state) {
  (void)state;
  step_case toy = {"toy", NULL, DDP_OPTIM_SGD, 20, DDP_PRECISION_FP32};
  run_case(&toy);
  step_case ht = {"headtail", NULL, DDP_OPTIM_ADAM, 20, DDP_PRECISION_FP32};
  run_case(&ht);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_convnet_sgd),
      cmocka_unit_test(test_convnet_sgd_bf16),
      cmocka_unit_test(test_psnet_adadelta_with_dropout),
      cmocka_unit_test(test_convnet3_tanh_adam),
      cmocka_unit_test(test_toy_and_headtail),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
