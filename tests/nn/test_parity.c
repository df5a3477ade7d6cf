/* PyTorch parity of the seeds' models: load the fixture's weights into our
 * model by name, run one training step (forward, loss, backward) and compare
 * every tensor with what PyTorch 1.13 computed (scripts/make_fixtures.py):
 * output, loss, every gradient, BatchNorm's running stats and
 * num_batches_tracked after the step, and the eval-mode output after it.
 * Tolerance per tensor: max|ours - torch| <= 1e-4 * max|torch| + 1e-6.
 * Also: grad hooks fire once per parameter, a second identical step allocates
 * nothing, dropout follows the mode and the seed, errors name the layer. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "model_fixture.h"
#include "support/fixture.h"
#include "support/gradcheck.h"

#define RTOL 1e-4
#define ATOL 1e-6

static const fixture_tensor *need(const fixture *f, const char *name) {
  const fixture_tensor *t = fixture_find(f, name);
  if (!t) fail_msg("fixture has no record '%s'", name);
  return t;
}

static void check_ok(ddp_status s, const char *what) {
  if (s != DDP_OK) fail_msg("%s: %s: %s", what, ddp_status_name(s), ddp_last_error());
}

/* Compares our float32 tensor with the fixture's record (shape and values). */
static int compare(const char *model, const char *name, const float *ours, int64_t numel,
                   const fixture *f) {
  const fixture_tensor *t = need(f, name);
  char what[256];
  snprintf(what, sizeof what, "%s %s", model, name);
  if (t->numel != numel) {
    fprintf(stderr, "%s: %lld elements, torch has %lld\n", what, (long long)numel,
            (long long)t->numel);
    return 1;
  }
  return allclose(what, ours, t->data, numel, RTOL, ATOL);
}

/* A model built by our builder with every state entry copied from the fixture. */
static ddp_model *model_from_fixture(const char *model, const char *act, const fixture *f) {
  ddp_model *m;
  check_ok(ddp_model_build(model, act, 99, &m), model);
  for (int i = 0; i < ddp_model_state_count(m); i++) {
    ddp_state_entry e;
    check_ok(ddp_model_state_entry(m, i, &e), "state entry");
    const fixture_tensor *t = need(f, e.name);
    check_ok(ddp_model_load_tensor(m, e.name, t->dtype, t->ndim, t->shape, t->data), e.name);
  }
  return m;
}

/* The fixture's batch as caller-owned views (the fixture keeps the memory). */
static void wrap_batch(const fixture *f, ddp_tensor *x, ddp_tensor *y) {
  const fixture_tensor *in = need(f, "input"), *target = need(f, "target");
  check_ok(ddp_tensor_wrap(x, DDP_FLOAT32, in->ndim, in->shape, in->data), "input");
  check_ok(ddp_tensor_wrap(y, target->dtype, target->ndim, target->shape, target->data), "target");
}

static int hook_count[64];
static void count_hook(ddp_tensor *param, void *user) {
  (void)user;
  hook_count[param->param_index]++;
}

/* One full step: the fixture's comparison for model `name`. */
static void parity(const char *name, const char *act, bool training) {
  fixture *f = load_fixture(name);
  ddp_model *m = model_from_fixture(name, act, f);
  ddp_model_train(m, training);
  ddp_model_zero_grad(m);
  ddp_tensor x, y, *out, *loss;
  wrap_batch(f, &x, &y);
  ddp_tape *tape;
  check_ok(ddp_tape_create(&tape, 1 << 20), "tape");
  memset(hook_count, 0, sizeof hook_count);
  ddp_tape_set_grad_hook(tape, count_hook, NULL);

  int bad = 0;
  check_ok(ddp_model_forward(m, tape, &x, &out), "forward");
  bad += compare(name, "output", out->data, out->numel, f);
  check_ok(ddp_model_loss(m, tape, out, &y, &loss), "loss");
  bad += compare(name, "loss", loss->data, loss->numel, f);
  check_ok(ddp_backward(tape, loss), "backward");
  for (int i = 0; i < ddp_model_num_params(m); i++) {
    char grad[256];
    ddp_tensor *p = ddp_model_param(m, i);
    snprintf(grad, sizeof grad, "%s.grad", ddp_model_param_name(m, i));
    bad += compare(name, grad, p->grad, p->numel, f);
    if (hook_count[i] != 1) {
      fprintf(stderr, "%s: the grad hook fired %d times for %s\n", name, hook_count[i],
              ddp_model_param_name(m, i));
      bad++;
    }
  }
  /* Buffers after the step: running stats close, counters exact. */
  for (int i = 0; i < ddp_model_state_count(m); i++) {
    ddp_state_entry e;
    check_ok(ddp_model_state_entry(m, i, &e), "state entry");
    if (e.is_param) continue;
    char after[256];
    snprintf(after, sizeof after, "after:%s", e.name);
    if (e.dtype == DDP_INT64) {
      int64_t want = *(int64_t *)need(f, after)->data, got = *(int64_t *)e.data;
      if (got != want) {
        fprintf(stderr, "%s %s: %lld, torch %lld\n", name, after, (long long)got, (long long)want);
        bad++;
      }
    } else {
      bad += compare(name, after, e.data, e.numel, f);
    }
  }
  /* Eval mode after the step: BN normalises with the updated running stats. */
  ddp_model_train(m, false);
  ddp_tape_reset(tape);
  ddp_tape_set_grad_enabled(tape, false);
  check_ok(ddp_model_forward(m, tape, &x, &out), "eval forward");
  bad += compare(name, "eval:output", out->data, out->numel, f);
  assert_int_equal(ddp_tape_num_nodes(tape), 0);

  ddp_tape_destroy(tape);
  ddp_model_destroy(m);
  fixture_free(f);
  if (bad) fail_msg("%s: %d tensors differ from PyTorch", name, bad);
}

static void test_parity_toy(void **state) { (void)state; parity("toy", NULL, true); }
static void test_parity_headtail(void **state) { (void)state; parity("headtail", NULL, true); }
static void test_parity_convnet(void **state) { (void)state; parity("convnet", NULL, true); }
/* psnet's fixture is computed in eval mode: without BN that only turns its
 * Dropout2d layers into the identity (scripts/make_fixtures.py). */
static void test_parity_psnet(void **state) { (void)state; parity("psnet", NULL, false); }
static void test_parity_convnet3_tanh(void **state) {
  (void)state;
  parity("convnet-3", "tanh", true);
}

/* After a first step has sized the tape's arena, an identical step (reset,
 * zero_grad, forward, loss, backward) allocates nothing. */
static void test_steady_state_step_allocates_nothing(void **state) {
  (void)state;
  fixture *f = load_fixture("convnet");
  ddp_model *m = model_from_fixture("convnet", NULL, f);
  ddp_tensor x, y, *out, *loss;
  wrap_batch(f, &x, &y);
  ddp_tape *tape;
  check_ok(ddp_tape_create(&tape, 4096), "tape");
  uint64_t before = 0;
  for (int step = 0; step < 3; step++) {
    if (step == 2) before = ddp_alloc_count();
    ddp_tape_reset(tape);
    ddp_model_zero_grad(m);
    check_ok(ddp_model_forward(m, tape, &x, &out), "forward");
    check_ok(ddp_model_loss(m, tape, out, &y, &loss), "loss");
    check_ok(ddp_backward(tape, loss), "backward");
  }
  assert_int_equal(ddp_alloc_count() - before, 0);
  /* Three steps: the counter says so, and the loss is still finite. */
  ddp_state_entry e;
  check_ok(ddp_model_state_find(m, "layer1.1.num_batches_tracked", &e), "find");
  assert_int_equal(*(int64_t *)e.data, 3 + 3);
  assert_true(isfinite(ddp_tensor_f32(loss)[0]));
  ddp_tape_destroy(tape);
  ddp_model_destroy(m);
  fixture_free(f);
}

static bool same_floats(const ddp_tensor *a, const ddp_tensor *b) {
  return a->numel == b->numel && memcmp(a->data, b->data, (size_t)a->numel * 4) == 0;
}

/* psnet in training mode: dropout draws from the model's generator, so two
 * forwards differ, reseeding repeats them, and eval mode is deterministic. */
static void test_dropout_follows_mode_and_seed(void **state) {
  (void)state;
  fixture *f = load_fixture("psnet");
  ddp_model *m = model_from_fixture("psnet", NULL, f);
  ddp_tensor x, y, *a, *b;
  wrap_batch(f, &x, &y);
  ddp_tape *ta, *tb;
  check_ok(ddp_tape_create(&ta, 1 << 20), "tape");
  check_ok(ddp_tape_create(&tb, 1 << 20), "tape");
  ddp_tape_set_grad_enabled(ta, false);
  ddp_tape_set_grad_enabled(tb, false);

  ddp_model_seed_dropout(m, 5);
  check_ok(ddp_model_forward(m, ta, &x, &a), "forward");
  check_ok(ddp_model_forward(m, tb, &x, &b), "forward");
  assert_false(same_floats(a, b));
  ddp_tape_reset(tb);
  ddp_model_seed_dropout(m, 5);
  check_ok(ddp_model_forward(m, tb, &x, &b), "forward");
  assert_true(same_floats(a, b));

  ddp_model_train(m, false);
  ddp_tape_reset(ta);
  ddp_tape_reset(tb);
  check_ok(ddp_model_forward(m, ta, &x, &a), "forward");
  check_ok(ddp_model_forward(m, tb, &x, &b), "forward");
  assert_true(same_floats(a, b));
  assert_int_equal(compare("psnet", "output", a->data, a->numel, f), 0);
  ddp_tape_destroy(ta);
  ddp_tape_destroy(tb);
  ddp_model_destroy(m);
  fixture_free(f);
}

/* A wrong input shape is an error that names the model and the layer. */
static void test_forward_errors_name_the_layer(void **state) {
  (void)state;
  ddp_model *m;
  check_ok(ddp_model_build("convnet", NULL, 1, &m), "build");
  int64_t shape[4] = {2, 3, 28, 28};
  ddp_tensor *x = gradcheck_random(4, shape, -1, 1, 1, false);
  ddp_tape *tape;
  check_ok(ddp_tape_create(&tape, 1 << 16), "tape");
  ddp_tensor *out;
  assert_int_not_equal(ddp_model_forward(m, tape, x, &out), DDP_OK);
  const char *msg = ddp_last_error();
  if (!strstr(msg, "convnet forward") || !strstr(msg, "layer1.0 (Conv2d)"))
    fail_msg("message does not name the layer: '%s'", msg);
  /* A 28x28 image into toy's Linear(10, 10). */
  ddp_model *toy;
  check_ok(ddp_model_build("toy", NULL, 1, &toy), "build");
  ddp_tape_reset(tape);
  assert_int_not_equal(ddp_model_forward(toy, tape, x, &out), DDP_OK);
  if (!strstr(ddp_last_error(), "net1 (Linear)"))
    fail_msg("message does not name the layer: '%s'", ddp_last_error());
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
  ddp_model_destroy(m);
  ddp_model_destroy(toy);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity_toy),
      cmocka_unit_test(test_parity_headtail),
      cmocka_unit_test(test_parity_convnet),
      cmocka_unit_test(test_parity_psnet),
      cmocka_unit_test(test_parity_convnet3_tanh),
      cmocka_unit_test(test_steady_state_step_allocates_nothing),
      cmocka_unit_test(test_dropout_follows_mode_and_seed),
      cmocka_unit_test(test_forward_errors_name_the_layer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
