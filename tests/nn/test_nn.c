/* The nn layer without running ops: state-dict names, shapes and order of
 * every builder against the PyTorch fixtures, the flat-buffer layout,
 * PyTorch's initialisation (bounds and distribution), zero_grad,
 * clip_grad_norm against a closed form, train/eval, errors, the fixture
 * reader's validation. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "model_fixture.h"
#include "support/fixture.h"

static const char *const FIXTURE_MODELS[] = {"toy", "headtail", "convnet", "psnet", "convnet-3"};
#define N_FIXTURE_MODELS (int)(sizeof FIXTURE_MODELS / sizeof FIXTURE_MODELS[0])

/* A fixture's state-dict records: everything but the batch, the results,
 * gradients and the after:/eval: records, in file (= state_dict) order. */
static bool is_state_record(const char *name) {
  static const char *const other[] = {"input", "target", "output", "loss"};
  for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
    if (!strcmp(name, other[i])) return false;
  size_t n = strlen(name);
  if (n > 5 && !strcmp(name + n - 5, ".grad")) return false;
  return strchr(name, ':') == NULL;
}

static ddp_model *build(const char *name, const char *act, uint64_t seed) {
  ddp_model *m = NULL;
  ddp_status s = ddp_model_build(name, act, seed, &m);
  if (s != DDP_OK) fprintf(stderr, "%s\n", ddp_last_error());
  assert_int_equal(s, DDP_OK);
  return m;
}

static void test_state_dict_matches_pytorch(void **state) {
  (void)state;
  for (int k = 0; k < N_FIXTURE_MODELS; k++) {
    fixture *f = load_fixture(FIXTURE_MODELS[k]);
    ddp_model *m = build(FIXTURE_MODELS[k], strcmp(FIXTURE_MODELS[k], "convnet-3") ? NULL : "tanh", 1);
    int e = 0, n_params = 0;
    for (int i = 0; i < f->count; i++) {
      const fixture_tensor *t = &f->tensors[i];
      if (!is_state_record(t->name)) continue;
      ddp_state_entry entry;
      assert_int_equal(ddp_model_state_entry(m, e, &entry), DDP_OK);
      if (strcmp(entry.name, t->name) != 0)
        fail_msg("%s: state entry %d is '%s', PyTorch's is '%s'", FIXTURE_MODELS[k], e,
                 entry.name, t->name);
      assert_int_equal(entry.dtype, t->dtype);
      assert_int_equal(entry.ndim, t->ndim);
      for (int d = 0; d < t->ndim; d++) assert_int_equal(entry.shape[d], t->shape[d]);
      assert_int_equal(entry.numel, t->numel);
      /* Parameters are exactly the entries with a gradient in the fixture. */
      char grad[256];
      snprintf(grad, sizeof grad, "%s.grad", t->name);
      assert_int_equal(entry.is_param, fixture_find(f, grad) != NULL);
      if (entry.is_param) {
        assert_int_equal(entry.param_index, n_params);
        assert_string_equal(ddp_model_param_name(m, n_params), t->name);
        n_params++;
      }
      e++;
    }
    assert_int_equal(ddp_model_state_count(m), e);
    assert_int_equal(ddp_model_num_params(m), n_params);
    ddp_model_destroy(m);
    fixture_free(f);
  }
}

static void test_convnet_n_names(void **state) {
  (void)state;
  static const char *const acts[] = {NULL, "relu", "sigmoid", "tanh"};
  for (int n = 2; n <= 10; n++) {
    char name[32];
    snprintf(name, sizeof name, "convnet-%d", n);
    ddp_model *m = build(name, acts[n % 4], 7);
    assert_string_equal(ddp_model_name(m), name);
    assert_int_equal(ddp_model_num_params(m), 2 * n + 2);
    /* Propulate's Net assigns self.fc first: PyTorch's order starts with fc. */
    assert_string_equal(ddp_model_param_name(m, 0), "fc.weight");
    assert_string_equal(ddp_model_param_name(m, 1), "fc.bias");
    for (int i = 0; i < n; i++) {
      char w[64], b[64];
      snprintf(w, sizeof w, "conv_layers.%d.0.weight", i);
      snprintf(b, sizeof b, "conv_layers.%d.0.bias", i);
      assert_string_equal(ddp_model_param_name(m, 2 + 2 * i), w);
      assert_string_equal(ddp_model_param_name(m, 3 + 2 * i), b);
      ddp_tensor *t = ddp_model_param(m, 2 + 2 * i);
      assert_int_equal(t->shape[1], i == 0 ? 1 : 10);
    }
    assert_int_equal(ddp_model_num_param_elements(m),
                     10 * 9 + 10 + (n - 1) * (100 * 9 + 10) + 7840 * 10 + 10);
    assert_int_equal(ddp_model_loss_kind(m), DDP_LOSS_NLL);
    ddp_model_destroy(m);
  }
}

static void test_flat_layout(void **state) {
  (void)state;
  const char *names[] = {"toy", "headtail", "convnet", "psnet", "convnet-4"};
  for (int k = 0; k < 5; k++) {
    ddp_model *m = build(names[k], NULL, 3);
    float *p = ddp_model_params_flat(m), *g = ddp_model_grads_flat(m);
    int64_t off = 0;
    for (int i = 0; i < ddp_model_num_params(m); i++) {
      ddp_tensor *t = ddp_model_param(m, i);
      assert_int_equal(ddp_model_param_offset(m, i), off);
      assert_ptr_equal(t->data, p + off);
      assert_ptr_equal(t->grad, g + off);
      assert_int_equal(t->dtype, DDP_FLOAT32);
      assert_int_equal(t->param_index, i);
      assert_int_equal(t->node, -1);
      assert_true((t->flags & (DDP_TENSOR_PARAM | DDP_TENSOR_REQUIRES_GRAD)) ==
                  (DDP_TENSOR_PARAM | DDP_TENSOR_REQUIRES_GRAD));
      assert_false(t->flags & (DDP_TENSOR_OWNS_DATA | DDP_TENSOR_OWNS_GRAD));
      assert_ptr_equal(ddp_model_find_param(m, ddp_model_param_name(m, i)), t);
      off += t->numel;
    }
    assert_int_equal(ddp_model_num_param_elements(m), off);
    assert_null(ddp_model_find_param(m, "nope.weight"));
    assert_null(ddp_model_param(m, ddp_model_num_params(m)));
    for (int64_t i = 0; i < off; i++) assert_true(g[i] == 0.0f);
    ddp_model_destroy(m);
  }
  /* The convnet's numbers, by hand: conv 16*25+16, bn 16+16, conv 32*16*25+32,
   * bn 32+32, fc 1568*10+10; buffers 2*(16+32); two counters. */
  ddp_model *m = build("convnet", NULL, 3);
  assert_int_equal(ddp_model_num_params(m), 10);
  assert_int_equal(ddp_model_num_param_elements(m),
                   416 + 32 + (12800 + 32) + 64 + 15690);
  assert_int_equal(ddp_model_num_buffer_elements(m), 96);
  assert_int_equal(ddp_model_num_counters(m), 2);
  assert_int_equal(ddp_model_state_count(m), 16);
  /* Buffers view the flat buffer in state order; counters too. */
  ddp_state_entry e;
  assert_int_equal(ddp_model_state_find(m, "layer2.1.running_var", &e), DDP_OK);
  assert_ptr_equal(e.data, ddp_model_buffers_flat(m) + 16 + 16 + 32);
  assert_false(e.is_param);
  assert_int_equal(e.param_index, -1);
  assert_int_equal(ddp_model_state_find(m, "layer2.1.num_batches_tracked", &e), DDP_OK);
  assert_ptr_equal(e.data, ddp_model_counters(m) + 1);
  assert_int_equal(e.dtype, DDP_INT64);
  assert_int_equal(e.ndim, 0);
  assert_int_equal(e.numel, 1);
  assert_int_equal(ddp_model_state_find(m, "layer1.1.bogus", &e), DDP_ERR_NOTFOUND);
  assert_non_null(strstr(ddp_last_error(), "layer1.1.bogus"));
  assert_int_equal(ddp_model_state_entry(m, 16, &e), DDP_ERR_RANGE);
  int64_t shape[DDP_MAX_DIMS];
  assert_int_equal(ddp_model_sample_shape(m, shape), 3);
  assert_int_equal(shape[0], 1);
  assert_int_equal(shape[1], 28);
  assert_int_equal(ddp_model_num_outputs(m), 10);
  ddp_model_destroy(m);
}

/* Uniform(-b, b) checks: bounds, the extremes reached, mean and variance
 * within 5 standard errors, and a 10-bin chi-square (9 dof; 40 is p < 1e-5).
 * The bound is b rounded to float, as in PyTorch: its uniform_ computes
 * from + u * (to - from) in float, so u = 0 gives exactly (float)-b, which
 * may lie a rounding beyond -b. */
static void check_uniform(const char *what, const float *x, int64_t n, double b) {
  double sum = 0, sq = 0, lo = INFINITY, hi = -INFINITY;
  int64_t bins[10] = {0};
  const double b32 = (float)b;
  for (int64_t i = 0; i < n; i++) {
    double v = x[i];
    if (!(fabs(v) <= b32))
      fail_msg("%s[%lld] = %.9g outside +-%.9g", what, (long long)i, v, b32);
    sum += v;
    sq += v * v;
    lo = fmin(lo, v);
    hi = fmax(hi, v);
    int bin = (int)((v + b) / (2 * b) * 10);
    bins[bin > 9 ? 9 : bin]++;
  }
  if (lo == hi) fail_msg("%s: all %lld values equal %g", what, (long long)n, lo);
  if (n < 500) return; /* too few for the statistics below (biases) */
  double mean = sum / (double)n, var = sq / (double)n - mean * mean;
  if (fabs(mean) > 5 * b / sqrt(3.0 * (double)n))
    fail_msg("%s: mean %g is not ~0 (bound %g, n %lld)", what, mean, b, (long long)n);
  if (fabs(var - b * b / 3) > 5 * b * b * sqrt(4.0 / 45.0 / (double)n))
    fail_msg("%s: variance %g, uniform(+-%g) has %g", what, var, b, b * b / 3);
  if (hi < 0.98 * b || lo > -0.98 * b) fail_msg("%s: range [%g, %g] for bound %g", what, lo, hi, b);
  double chi2 = 0, expect = (double)n / 10;
  for (int i = 0; i < 10; i++) chi2 += (bins[i] - expect) * (bins[i] - expect) / expect;
  if (chi2 > 40) fail_msg("%s: chi-square %g over 10 bins (not uniform)", what, chi2);
}

static void test_init_like_pytorch(void **state) {
  (void)state;
  /* fan_in per weight of the convnet: 1*5*5, 16*5*5, 1568. */
  struct { const char *model, *param; double fan_in; } cases[] = {
      {"convnet", "layer1.0.weight", 25},   {"convnet", "layer1.0.bias", 25},
      {"convnet", "layer2.0.weight", 400},  {"convnet", "layer2.0.bias", 400},
      {"convnet", "fc.weight", 1568},       {"convnet", "fc.bias", 1568},
      {"psnet", "conv1.weight", 9},         {"psnet", "conv2.weight", 288},
      {"psnet", "fc1.weight", 9216},        {"psnet", "fc1.bias", 9216},
      {"psnet", "fc2.weight", 128},         {"toy", "net1.weight", 10},
      {"toy", "net2.bias", 10},             {"headtail", "head.weight", 32},
      {"headtail", "tail.weight", 32},      {"convnet-5", "conv_layers.4.0.weight", 90},
      {"convnet-5", "conv_layers.0.0.weight", 9}, {"convnet-5", "fc.weight", 7840},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ddp_model *m = build(cases[i].model, NULL, 11);
    ddp_tensor *t = ddp_model_find_param(m, cases[i].param);
    assert_non_null(t);
    char what[128];
    snprintf(what, sizeof what, "%s %s", cases[i].model, cases[i].param);
    check_uniform(what, t->data, t->numel, 1.0 / sqrt(cases[i].fan_in));
    ddp_model_destroy(m);
  }
  /* BatchNorm: weight 1, bias 0, running_mean 0, running_var 1, counter 0. */
  ddp_model *m = build("convnet", NULL, 11);
  const char *bn[] = {"layer1.1", "layer2.1"};
  for (int k = 0; k < 2; k++) {
    char name[64];
    ddp_state_entry e;
    const char *leaf[] = {"weight", "bias", "running_mean", "running_var"};
    const float want[] = {1, 0, 0, 1};
    for (int j = 0; j < 4; j++) {
      snprintf(name, sizeof name, "%s.%s", bn[k], leaf[j]);
      assert_int_equal(ddp_model_state_find(m, name, &e), DDP_OK);
      for (int64_t i = 0; i < e.numel; i++) assert_true(((float *)e.data)[i] == want[j]);
    }
    snprintf(name, sizeof name, "%s.num_batches_tracked", bn[k]);
    assert_int_equal(ddp_model_state_find(m, name, &e), DDP_OK);
    assert_int_equal(*(int64_t *)e.data, 0);
  }
  /* Same seed, same weights; another seed, other weights. */
  ddp_model *same = build("convnet", NULL, 11), *other = build("convnet", NULL, 12);
  int64_t n = ddp_model_num_param_elements(m);
  assert_memory_equal(ddp_model_params_flat(m), ddp_model_params_flat(same), (size_t)n * 4);
  assert_memory_not_equal(ddp_model_params_flat(m), ddp_model_params_flat(other), (size_t)n * 4);
  ddp_model_destroy(m);
  ddp_model_destroy(same);
  ddp_model_destroy(other);
}

/* Every initialized tensor of every builder at the seeds scripts/check-init.sh
 * trains from (1-24), against what PyTorch's reset_parameters draws: a Linear
 * or Conv2d weight (ndim >= 2) and its bias are uniform(+-1/sqrt(fan_in)),
 * fan_in = numel / out_features taken from the weight's shape (in * kh * kw),
 * not from ddp's code; a BatchNorm has weight 1, bias 0, running_mean 0,
 * running_var 1 and num_batches_tracked 0. Tensors of 500 values or more go
 * through check_uniform one by one; the smaller ones (biases, the toy's and
 * the first convolutions' weights) are scaled by their bound and pooled per
 * model over the seeds, and the pool is checked as uniform(+-1), so that a
 * bias drawn with another bound or left at zero fails too. */
static void test_init_every_layer_every_seed(void **state) {
  (void)state;
  enum { N_SEEDS = 24, POOL_MAX = 16384 };
  const char *models[4 + 9] = {"toy", "headtail", "convnet", "psnet"}; /* + convnet-2..10 */
  char convnet_n[9][24];
  for (int n = 2; n <= 10; n++) {
    snprintf(convnet_n[n - 2], sizeof convnet_n[0], "convnet-%d", n);
    models[4 + n - 2] = convnet_n[n - 2];
  }
  static float pool[POOL_MAX];
  for (size_t k = 0; k < sizeof models / sizeof models[0]; k++) {
    int64_t pooled = 0, layers = 0, batchnorms = 0;
    for (uint64_t seed = 1; seed <= N_SEEDS; seed++) {
      ddp_model *m = build(models[k], NULL, seed);
      for (int i = 0; i < ddp_model_state_count(m); i++) {
        ddp_state_entry w;
        assert_int_equal(ddp_model_state_entry(m, i, &w), DDP_OK);
        size_t len = strlen(w.name);
        if (len < 7 || strcmp(w.name + len - 7, ".weight") != 0) continue;
        char name[256];
        ddp_state_entry b;
        snprintf(name, sizeof name, "%.*s.bias", (int)(len - 7), w.name);
        assert_int_equal(ddp_model_state_find(m, name, &b), DDP_OK);
        if (w.ndim == 1) { /* BatchNorm2d */
          const char *leaf[] = {"weight", "bias", "running_mean", "running_var"};
          const float want[] = {1, 0, 0, 1};
          for (int j = 0; j < 4; j++) {
            ddp_state_entry e;
            snprintf(name, sizeof name, "%.*s.%s", (int)(len - 7), w.name, leaf[j]);
            assert_int_equal(ddp_model_state_find(m, name, &e), DDP_OK);
            assert_int_equal(e.numel, w.numel);
            for (int64_t x = 0; x < e.numel; x++)
              if (((float *)e.data)[x] != want[j])
                fail_msg("%s seed %llu %s[%lld] = %g, PyTorch's is %g", models[k],
                         (unsigned long long)seed, name, (long long)x, ((float *)e.data)[x],
                         want[j]);
          }
          ddp_state_entry e;
          snprintf(name, sizeof name, "%.*s.num_batches_tracked", (int)(len - 7), w.name);
          assert_int_equal(ddp_model_state_find(m, name, &e), DDP_OK);
          assert_int_equal(*(int64_t *)e.data, 0);
          batchnorms++;
          continue;
        }
        double bound = 1.0 / sqrt((double)(w.numel / w.shape[0]));
        assert_int_equal(b.ndim, 1);
        assert_int_equal(b.numel, w.shape[0]);
        const ddp_state_entry *both[2] = {&w, &b};
        for (int j = 0; j < 2; j++) {
          const float *x = both[j]->data;
          char what[320];
          snprintf(what, sizeof what, "%s seed %llu %s", models[k], (unsigned long long)seed,
                   both[j]->name);
          check_uniform(what, x, both[j]->numel, bound);
          if (both[j]->numel >= 500) continue;
          if (pooled + both[j]->numel > POOL_MAX) fail_msg("%s: pool too small", models[k]);
          for (int64_t e = 0; e < both[j]->numel; e++) pool[pooled++] = (float)(x[e] / bound);
        }
        layers++;
      }
      ddp_model_destroy(m);
    }
    /* Every Linear/Conv2d and BatchNorm the builder has, at every seed. */
    const char *name = models[k];
    int64_t want_layers = !strcmp(name, "convnet") ? 3 : !strcmp(name, "psnet") ? 4
                          : strncmp(name, "convnet-", 8) == 0 ? 1 + atoi(name + 8) : 2;
    assert_int_equal(layers, N_SEEDS * want_layers);
    assert_int_equal(batchnorms, N_SEEDS * (strcmp(name, "convnet") ? 0 : 2));
    char what[64];
    snprintf(what, sizeof what, "%s: the small tensors / bound, pooled", name);
    check_uniform(what, pool, pooled, 1.0);
  }
}

/* The bound we use is PyTorch's: its own initial weights (in the fixtures,
 * made by torch.manual_seed and reset_parameters) lie within +-1/sqrt(fan_in)
 * and reach close to it. psnet is left out: its fc1 was rounded to bfloat16. */
static void test_pytorch_init_has_our_bounds(void **state) {
  (void)state;
  const char *models[] = {"toy", "headtail", "convnet", "convnet-3"};
  int checked = 0;
  for (int k = 0; k < 4; k++) {
    fixture *f = load_fixture(models[k]);
    for (int i = 0; i < f->count; i++) {
      const fixture_tensor *w = &f->tensors[i];
      size_t len = strlen(w->name);
      if (!is_state_record(w->name) || w->ndim < 2 || len < 7 ||
          strcmp(w->name + len - 7, ".weight") != 0)
        continue;
      double bound = 1.0 / sqrt((double)(w->numel / w->shape[0]));
      char bias[256];
      snprintf(bias, sizeof bias, "%.*s.bias", (int)(len - 7), w->name);
      const fixture_tensor *b = fixture_find(f, bias);
      assert_non_null(b);
      const fixture_tensor *both[2] = {w, b};
      for (int j = 0; j < 2; j++) {
        const float *x = both[j]->data;
        double hi = 0;
        for (int64_t e = 0; e < both[j]->numel; e++) hi = fmax(hi, fabs((double)x[e]));
        if (hi > bound)
          fail_msg("%s %s: torch's max |x| %g exceeds 1/sqrt(fan_in) = %g", models[k],
                   both[j]->name, hi, bound);
        if (both[j]->numel >= 100 && hi < 0.95 * bound)
          fail_msg("%s %s: torch's max |x| %g is far below %g", models[k], both[j]->name, hi,
                   bound);
        checked++;
      }
    }
    fixture_free(f);
  }
  assert_int_equal(checked, 2 * (2 + 2 + 3 + 4));
}

/* The forward hook: before and after each top-level module, in order,
 * with its name; its error stops the forward; the output is the same with
 * and without it. */
typedef struct hook_log {
  char calls[16][24];
  int n;
  const char *fail_before; /* this child's before-call fails */
} hook_log;

static ddp_status log_hook(ddp_model *model, const char *child, bool after, void *user) {
  (void)model;
  hook_log *log = user;
  if (log->n < 16) snprintf(log->calls[log->n++], sizeof log->calls[0], "%s %s", after ? "after" : "before", child);
  if (!after && log->fail_before && !strcmp(child, log->fail_before))
    return ddp_error(DDP_ERR_IO, "the hook says no");
  return DDP_OK;
}

static void test_forward_hook(void **state) {
  (void)state;
  ddp_model *m = build("toy", NULL, 5);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  float xv[20];
  for (int i = 0; i < 20; i++) xv[i] = 0.1f * (float)i - 1.0f;
  int64_t shape[2] = {2, 10};
  ddp_tensor x, *plain, *hooked;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 2, shape, xv), DDP_OK);
  assert_int_equal(ddp_model_forward(m, tape, &x, &plain), DDP_OK);
  hook_log log = {.n = 0};
  ddp_model_set_forward_hook(m, log_hook, &log);
  assert_int_equal(ddp_model_forward(m, tape, &x, &hooked), DDP_OK);
  assert_memory_equal(ddp_tensor_f32(hooked), ddp_tensor_f32(plain), 10 * sizeof(float));
  const char *want[] = {"before net1", "after net1", "before relu", "after relu", "before net2", "after net2"};
  assert_int_equal(log.n, 6);
  for (int i = 0; i < 6; i++) assert_string_equal(log.calls[i], want[i]);
  log = (hook_log){.fail_before = "net2"};
  assert_int_equal(ddp_model_forward(m, tape, &x, &hooked), DDP_ERR_IO);
  assert_non_null(strstr(ddp_last_error(), "the hook says no"));
  assert_non_null(strstr(ddp_last_error(), "net2"));
  assert_int_equal(log.n, 5); /* nothing ran after the refusal */
  ddp_model_set_forward_hook(m, NULL, &log);
  log.n = 0;
  assert_int_equal(ddp_model_forward(m, tape, &x, &hooked), DDP_OK);
  assert_int_equal(log.n, 0);
  ddp_tape_destroy(tape);
  ddp_model_destroy(m);
}

static void test_zero_grad(void **state) {
  (void)state;
  ddp_model *m = build("convnet", NULL, 5);
  float *g = ddp_model_grads_flat(m);
  int64_t n = ddp_model_num_param_elements(m);
  for (int64_t i = 0; i < n; i++) g[i] = (float)(i % 7) - 3.0f;
  ddp_model_zero_grad(m);
  for (int64_t i = 0; i < n; i++) assert_true(g[i] == 0.0f);
  /* Through the parameter views too. */
  ddp_tensor *fc = ddp_model_find_param(m, "fc.bias");
  fc->grad[3] = 5;
  assert_true(g[ddp_model_param_offset(m, 9) + 3] == 5.0f);
  ddp_model_zero_grad(m);
  assert_true(fc->grad[3] == 0.0f);
  ddp_model_destroy(m);
}

static void test_clip_grad_norm(void **state) {
  (void)state;
  ddp_model *m = build("toy", NULL, 5);
  float *g = ddp_model_grads_flat(m);
  int64_t n = ddp_model_num_param_elements(m); /* 110 + 55 = 165 */
  assert_int_equal(n, 165);
  /* g_i = (i % 5) - 2: sum of squares = 33 * (4+1+0+1+4) = 330. */
  for (int64_t i = 0; i < n; i++) g[i] = (float)(i % 5) - 2.0f;
  double norm = 0, want = sqrt(330.0);
  /* Below the threshold: unchanged. */
  assert_int_equal(ddp_model_clip_grad_norm(m, 100.0, &norm), DDP_OK);
  assert_true(fabs(norm - want) < 1e-9);
  for (int64_t i = 0; i < n; i++) assert_true(g[i] == (float)(i % 5) - 2.0f);
  /* Above: scaled by max_norm / (norm + 1e-6) (within float32's rounding of
   * the three operations PyTorch does in float32), so the new norm is
   * ~max_norm. */
  assert_int_equal(ddp_model_clip_grad_norm(m, 2.0, &norm), DDP_OK);
  assert_true(fabs(norm - want) < 1e-9);
  const double coef = 2.0 / (want + 1e-6);
  for (int64_t i = 0; i < n; i++) {
    const double exact = ((double)(i % 5) - 2.0) * coef;
    assert_true(fabs(g[i] - exact) <= 4 * 0x1p-24 * fabs(exact));
  }
  assert_int_equal(ddp_model_clip_grad_norm(m, 1e9, &norm), DDP_OK);
  assert_true(fabs(norm - 2.0) < 1e-5);
  /* max_norm 0 zeroes; bad max_norm is refused; non-finite norms leave grads. */
  assert_int_equal(ddp_model_clip_grad_norm(m, 0.0, NULL), DDP_OK);
  for (int64_t i = 0; i < n; i++) assert_true(g[i] == 0.0f);
  assert_int_equal(ddp_model_clip_grad_norm(m, -1.0, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_model_clip_grad_norm(m, NAN, NULL), DDP_ERR_INVALID);
  g[7] = INFINITY;
  g[8] = 1.0f;
  assert_int_equal(ddp_model_clip_grad_norm(m, 1.0, &norm), DDP_ERR_RANGE);
  assert_true(isinf(norm));
  assert_true(g[8] == 1.0f);
  /* All-zero gradients: norm 0, nothing scaled, no division trouble. */
  ddp_model_zero_grad(m);
  assert_int_equal(ddp_model_clip_grad_norm(m, 1.0, &norm), DDP_OK);
  assert_true(norm == 0.0);
  ddp_model_destroy(m);
}

/* The coefficient against a float64 reference over a wide range of norms
 * and max_norms: at most three float32 roundings away (the norm's, the
 * denominator's, the reciprocal's and the product's relative errors of at
 * most 2^-24 each, 1e-6 below float32's resolution of most norms), and
 * exactly 1 at and above the threshold. */
static void test_clip_coefficient_float64(void **state) {
  (void)state;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  int scaled = 0;
  for (int k = 0; k < 20000; k++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const double norm = ldexp((double)(x & 0xffffff) / 0x1p24 + 0.5, (int)((x >> 24) % 40) - 20);
    const double max_norm = ldexp((double)((x >> 32) & 0xffffff) / 0x1p24 + 0.5, (int)((x >> 56) % 40) - 20);
    const double exact = max_norm / (norm + 1e-6);
    const float c = ddp_clip_coefficient(norm, max_norm);
    if (exact >= 1.0 + 1e-6) {
      assert_true(c == 1.0f);
    } else if (exact < 1.0 - 1e-6) {
      scaled++;
      if (!(fabs(c - exact) <= 4 * 0x1p-24 * exact))
        fail_msg("norm %.17g max_norm %.17g: coefficient %.9g, float64 %.17g", norm, max_norm, c, exact);
    }
  }
  assert_true(scaled > 5000);
  assert_true(ddp_clip_coefficient(0.0, 1.0) == 1.0f);
  assert_true(ddp_clip_coefficient(1.0, 0.0) == 0.0f);
  assert_true(isnan(ddp_clip_coefficient(NAN, 1.0))); /* torch.clamp keeps NaN */
  assert_true(ddp_clip_coefficient(INFINITY, 1.0) == 0.0f);
}

/* clip_grad_norm_ against PyTorch (scripts/make_clip_fixture.py): the toy
 * model's and the ConvNet's PyTorch gradients (model_<name>.bin) into our
 * gradient buffer, clipped with the fixture's max_norms. The norm is ours
 * in double against a float64 sum of the same floats, and against
 * PyTorch's float32 norm within a few of its last places. The clipped
 * gradients: bit for bit PyTorch's when the two norms round to the same
 * float32 (the coefficient is then PyTorch's, ddp_clip_coefficient's
 * order of operations), else within the norms' relative difference plus
 * one rounding. Unclipped gradients (case 1): unchanged, as PyTorch's
 * multiplication by 1.0 leaves them. */
static void test_clip_grad_norm_pytorch(void **state) {
  (void)state;
  char path[1024];
  fixture *clip = NULL;
  if (fixture_load(fixture_path("clip_grad_norm.bin", path, sizeof path), &clip) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  static const char *const models[] = {"toy", "convnet"};
  for (int k = 0; k < 2; k++) {
    fixture *f = load_fixture(models[k]);
    ddp_model *m = build(models[k], NULL, 1);
    float *g = ddp_model_grads_flat(m);
    const int64_t n = ddp_model_num_param_elements(m);
    for (int c = 0; c < 2; c++) {
      char name[256];
      int64_t filled = 0;
      for (int p = 0; p < ddp_model_num_params(m); p++) {
        snprintf(name, sizeof name, "%s.grad", ddp_model_param_name(m, p));
        const fixture_tensor *t = fixture_find(f, name);
        assert_non_null(t);
        memcpy(g + ddp_model_param_offset(m, p), t->data, (size_t)t->numel * sizeof(float));
        filled += t->numel;
      }
      assert_int_equal(filled, n);
      double ref = 0;
      for (int64_t i = 0; i < n; i++) ref += (double)g[i] * (double)g[i];
      ref = sqrt(ref);
      snprintf(name, sizeof name, "%s:%d:max_norm", models[k], c);
      const double max_norm = *(const double *)fixture_find(clip, name)->data;
      snprintf(name, sizeof name, "%s:%d:total_norm", models[k], c);
      const float torch_norm = *(const float *)fixture_find(clip, name)->data;
      double norm = 0;
      assert_int_equal(ddp_model_clip_grad_norm(m, max_norm, &norm), DDP_OK);
      assert_true(fabs(norm - ref) <= 1e-12 * ref);
      const double norm_diff = fabs((double)(float)norm - torch_norm) / torch_norm;
      if (!(norm_diff <= 8 * 0x1p-24))
        fail_msg("%s: norm %.9g, PyTorch's %.9g", models[k], norm, (double)torch_norm);
      int64_t bitwise = 0;
      for (int p = 0; p < ddp_model_num_params(m); p++) {
        if (c == 0)
          snprintf(name, sizeof name, "%s:0:%s.grad", models[k], ddp_model_param_name(m, p));
        else
          snprintf(name, sizeof name, "%s.grad", ddp_model_param_name(m, p));
        const fixture_tensor *t = fixture_find(c == 0 ? clip : f, name);
        assert_non_null(t);
        const float *want = t->data, *got = g + ddp_model_param_offset(m, p);
        for (int64_t i = 0; i < t->numel; i++) {
          const double bound = fabs(want[i]) * (2 * norm_diff + 0x1p-23);
          if ((float)norm == torch_norm || c == 1) {
            if (got[i] != want[i])
              fail_msg("%s case %d: %s[%lld] %.9g, PyTorch's %.9g (norms equal in float32)",
                       models[k], c, ddp_model_param_name(m, p), (long long)i, got[i], want[i]);
          } else if (!(fabs(got[i] - want[i]) <= bound)) {
            fail_msg("%s case %d: %s[%lld] %.9g, PyTorch's %.9g", models[k], c,
                     ddp_model_param_name(m, p), (long long)i, got[i], want[i]);
          }
          bitwise += got[i] == want[i];
        }
      }
      print_message("clip %s case %d: norm %.9g (PyTorch %.9g), %lld of %lld gradients bitwise\n",
                    models[k], c, norm, (double)torch_norm, (long long)bitwise, (long long)n);
    }
    ddp_model_destroy(m);
    fixture_free(f);
  }
  fixture_free(clip);
}

static void test_train_eval_and_loss_kinds(void **state) {
  (void)state;
  struct { const char *name; ddp_loss_kind loss; int64_t outputs; } cases[] = {
      {"toy", DDP_LOSS_MSE, 5}, {"headtail", DDP_LOSS_CROSS_ENTROPY, 10},
      {"convnet", DDP_LOSS_CROSS_ENTROPY, 10}, {"psnet", DDP_LOSS_NLL, 10},
      {"convnet-2", DDP_LOSS_NLL, 10}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ddp_model *m = build(cases[i].name, NULL, 1);
    assert_true(ddp_model_is_training(m));
    ddp_model_train(m, false);
    assert_false(ddp_model_is_training(m));
    ddp_model_train(m, true);
    assert_true(ddp_model_is_training(m));
    assert_int_equal(ddp_model_loss_kind(m), cases[i].loss);
    assert_int_equal(ddp_model_num_outputs(m), cases[i].outputs);
    ddp_model_destroy(m);
  }
  assert_string_equal(ddp_loss_name(DDP_LOSS_MSE), "mse");
  assert_string_equal(ddp_loss_name(DDP_LOSS_CROSS_ENTROPY), "cross_entropy");
  assert_string_equal(ddp_loss_name(DDP_LOSS_NLL), "nll");
  /* A model without a loss kind refuses ddp_model_loss. */
  ddp_model *m;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  assert_int_equal(ddp_model_finalize(m, 0), DDP_OK);
  ddp_tensor *loss;
  assert_int_equal(ddp_model_loss(m, NULL, NULL, NULL, &loss), DDP_ERR_STATE);
  assert_non_null(strstr(ddp_last_error(), "ddp_model_set_loss"));
  ddp_model_destroy(m);
}

static void expect_build_error(const char *name, const char *act, const char *needle) {
  ddp_model *m = (ddp_model *)&m; /* must be reset to NULL */
  assert_int_equal(ddp_model_build(name, act, 1, &m), DDP_ERR_INVALID);
  assert_null(m);
  if (!strstr(ddp_last_error(), needle))
    fail_msg("building '%s' (%s): message '%s' lacks '%s'", name ? name : "NULL",
             act ? act : "NULL", ddp_last_error(), needle);
}

/* mlp:WxD: D linear layers 10 -> W -> ... -> 5 with PyTorch's shapes. */
static void test_mlp_builder(void **state) {
  (void)state;
  ddp_model *m;
  assert_int_equal(ddp_model_build("mlp:16x4", NULL, 1, &m), DDP_OK);
  assert_int_equal(ddp_model_num_params(m), 8);
  assert_int_equal(ddp_model_num_param_elements(m), (10 * 16 + 16) + 2 * (16 * 16 + 16) + (16 * 5 + 5));
  ddp_tensor *w = ddp_model_find_param(m, "fc3.weight");
  assert_non_null(w);
  assert_int_equal(w->shape[0], 5);
  assert_int_equal(w->shape[1], 16);
  assert_string_equal(ddp_model_name(m), "mlp:16x4");
  ddp_model_destroy(m);
}

static void test_bad_builder_arguments(void **state) {
  (void)state;
  const char *list = "toy, headtail, convnet, psnet, convnet-N (N in 2..10), mlp:WxD";
  expect_build_error("resnet50", NULL, list);
  expect_build_error("mlp:0x3", NULL, "W in 1..65536 and D in 2..64");
  expect_build_error("mlp:8x1", NULL, "W in 1..65536 and D in 2..64");
  expect_build_error("mlp:8x", NULL, list);
  expect_build_error("mlp:8x3y", NULL, list);
  expect_build_error("resnet50", NULL, "unknown model 'resnet50'");
  expect_build_error(NULL, NULL, list);
  expect_build_error("", NULL, list);
  expect_build_error("convnet-", NULL, list);
  expect_build_error("convnet-x", NULL, list);
  expect_build_error("convnet-3x", NULL, list);
  expect_build_error("convnet-03", NULL, list);
  expect_build_error("convnet--3", NULL, list);
  expect_build_error("convnet-0", NULL, list);
  expect_build_error("convnet-1", NULL, "in 2..10");
  expect_build_error("convnet-11", NULL, "in 2..10");
  expect_build_error("convnet-99999999999999999999", NULL, "in 2..10");
  expect_build_error("convnet-3", "gelu", "relu, sigmoid, tanh");
  expect_build_error("convnet-3", "Tanh", "unknown activation 'Tanh'");
  expect_build_error("toy", "tanh", "applies only to convnet-N");
  expect_build_error("convnet", "relu", "applies only to convnet-N");
  /* The valid spellings. */
  ddp_model *m = build("convnet-10", "", 1);
  ddp_model_destroy(m);
  m = build("psnet", "", 1);
  ddp_model_destroy(m);
}

static void test_custom_model_errors(void **state) {
  (void)state;
  ddp_model *m;
  ddp_module *seq, *lin;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  assert_int_equal(ddp_module_add_sequential(m, NULL, "features", &seq), DDP_OK);
  assert_int_equal(ddp_module_add_conv2d(m, seq, NULL, 3, 8, 3, 1, 1, false, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_relu(m, seq, NULL, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_sequential(m, NULL, "features", NULL), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "already has a child named 'features'"));
  assert_int_equal(ddp_module_add_relu(m, seq, "a.b", NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_relu(m, seq, "", NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_linear(m, NULL, "head", 8, 0, true, &lin), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_linear(m, NULL, "head", 8, 4, true, &lin), DDP_OK);
  assert_int_equal(ddp_module_add_relu(m, lin, NULL, NULL), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "not a Sequential"));
  assert_int_equal(ddp_module_add_dropout(m, NULL, NULL, 1.0f, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_dropout2d(m, NULL, NULL, -0.1f, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_maxpool2d(m, NULL, NULL, 0, 0, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_module_add_conv2d(m, NULL, NULL, 3, 8, 3, 0, 1, true, NULL),
                   DDP_ERR_INVALID);
  ddp_module *bn;
  assert_int_equal(ddp_module_add_batchnorm2d(m, seq, NULL, 8, &bn), DDP_OK);
  /* The forward order takes children of the root only. */
  ddp_module *order[2] = {seq, bn};
  assert_int_equal(ddp_model_set_forward_order(m, 2, order), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "features.2"));
  order[1] = lin;
  assert_int_equal(ddp_model_set_forward_order(m, 2, order), DDP_OK);
  assert_int_equal(ddp_model_set_forward_order(m, -1, order), DDP_ERR_INVALID);
  /* Forward before finalize is refused. */
  ddp_tensor *y;
  ddp_tensor x;
  int64_t one = 1;
  float v = 0;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 1, &one, &v), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1024), DDP_OK);
  assert_int_equal(ddp_model_forward(m, tape, &x, &y), DDP_ERR_STATE);
  assert_non_null(strstr(ddp_last_error(), "not finalized"));
  ddp_tape_destroy(tape);
  assert_int_equal(ddp_model_finalize(m, 9), DDP_OK);
  assert_int_equal(ddp_model_finalize(m, 9), DDP_ERR_STATE);
  assert_int_equal(ddp_module_add_relu(m, NULL, NULL, NULL), DDP_ERR_STATE);
  /* Names and order: features.0.weight (no bias), features.2.*, head.*. */
  const char *want[] = {"features.0.weight", "features.2.weight", "features.2.bias",
                        "features.2.running_mean", "features.2.running_var",
                        "features.2.num_batches_tracked", "head.weight", "head.bias"};
  assert_int_equal(ddp_model_state_count(m), 8);
  for (int i = 0; i < 8; i++) {
    ddp_state_entry e;
    assert_int_equal(ddp_model_state_entry(m, i, &e), DDP_OK);
    assert_string_equal(e.name, want[i]);
  }
  assert_int_equal(ddp_model_num_params(m), 5);
  assert_string_equal(ddp_model_name(m), "custom");
  /* load_tensor: by name, shape- and dtype-checked. */
  float w[32];
  for (int i = 0; i < 32; i++) w[i] = (float)i;
  int64_t s84[2] = {8, 4}, s48[2] = {4, 8};
  assert_int_equal(ddp_model_load_tensor(m, "head.weight", DDP_FLOAT32, 2, s48, w), DDP_OK);
  assert_true(ddp_model_find_param(m, "head.weight")->data != NULL);
  assert_true(((float *)ddp_model_find_param(m, "head.weight")->data)[31] == 31.0f);
  assert_int_equal(ddp_model_load_tensor(m, "head.weight", DDP_FLOAT32, 2, s84, w), DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "(8,4)"));
  assert_non_null(strstr(ddp_last_error(), "(4,8)"));
  assert_int_equal(ddp_model_load_tensor(m, "head.weight", DDP_INT64, 2, s48, w), DDP_ERR_INVALID);
  assert_int_equal(ddp_model_load_tensor(m, "head.w", DDP_FLOAT32, 2, s48, w), DDP_ERR_NOTFOUND);
  int64_t nbt = 42;
  assert_int_equal(ddp_model_load_tensor(m, "features.2.num_batches_tracked", DDP_INT64, 0, NULL,
                                         &nbt), DDP_OK);
  assert_int_equal(ddp_model_counters(m)[0], 42);
  /* The description reads like PyTorch's repr. */
  char buf[1024];
  size_t need = ddp_model_describe(m, buf, sizeof buf);
  assert_true(need < sizeof buf);
  assert_non_null(strstr(buf, "(features): Sequential("));
  assert_non_null(strstr(buf, "(0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)"));
  assert_non_null(strstr(buf, "(head): Linear(in_features=8, out_features=4, bias=True)"));
  char tiny[8];
  assert_int_equal(ddp_model_describe(m, tiny, sizeof tiny), need);
  assert_int_equal(strlen(tiny), 7);
  ddp_model_destroy(m);
  ddp_model_destroy(NULL);
}

/* Allocation failures: the Nth allocation fails, for every N a build makes.
 * Each must give DDP_ERR_NOMEM, *out NULL and no leak (ASan checks that). */
static int64_t fail_at, n_allocs;
static void *failing_alloc(size_t bytes, void *user) {
  (void)user;
  if (n_allocs++ == fail_at) return NULL;
  return aligned_alloc(64, (bytes + 63) / 64 * 64);
}
static void plain_free(void *p, void *user) {
  (void)user;
  free(p);
}

static void test_build_survives_allocation_failures(void **state) {
  (void)state;
  const char *names[] = {"convnet", "convnet-3"};
  ddp_alloc_hooks hooks = {failing_alloc, plain_free, NULL};
  for (int k = 0; k < 2; k++) {
    int failures = 0;
    for (fail_at = 0;; fail_at++) {
      n_allocs = 0;
      ddp_model *m = (ddp_model *)&m;
      ddp_set_alloc_hooks(&hooks);
      ddp_status s = ddp_model_build(names[k], NULL, 1, &m);
      ddp_set_alloc_hooks(NULL);
      if (s == DDP_OK) {
        ddp_set_alloc_hooks(&hooks); /* freed through the hooks that allocated it */
        ddp_model_destroy(m);
        ddp_set_alloc_hooks(NULL);
        break;
      }
      assert_int_equal(s, DDP_ERR_NOMEM);
      assert_null(m);
      failures++;
    }
    assert_true(failures > 10);
  }
}

/* Builds a fixture image in memory: one float32 record "w" of shape (2). */
static size_t tiny_fixture(unsigned char *b) {
  size_t n = 0;
  memcpy(b, "DDPFIX01", 8);
  n = 8;
  uint32_t count = 1, reserved = 0;
  memcpy(b + n, &count, 4);
  memcpy(b + n + 4, &reserved, 4);
  n += 8;
  uint16_t len = 1;
  memcpy(b + n, &len, 2);
  n += 2;
  b[n++] = 'w';
  b[n++] = DDP_FLOAT32;
  b[n++] = 1;
  int64_t two = 2;
  memcpy(b + n, &two, 8);
  n += 8;
  float v[2] = {1.5f, -2.0f};
  memcpy(b + n, v, 8);
  return n + 8;
}

static void test_fixture_reader_validates(void **state) {
  (void)state;
  unsigned char b[128];
  size_t n = tiny_fixture(b);
  fixture *f;
  assert_int_equal(fixture_parse(b, n, "tiny", &f), DDP_OK);
  assert_int_equal(f->count, 1);
  assert_true(((float *)fixture_find(f, "w")->data)[1] == -2.0f);
  assert_null(fixture_find(f, "x"));
  fixture_free(f);
  /* Every truncation is an error naming the offset, never a crash. */
  for (size_t cut = 0; cut < n; cut++) {
    assert_int_equal(fixture_parse(b, cut, "tiny", &f), DDP_ERR_FORMAT);
    assert_null(f);
  }
  b[n] = 0;
  assert_int_equal(fixture_parse(b, n + 1, "tiny", &f), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "trailing"));
  unsigned char bad[128];
  memcpy(bad, b, n);
  bad[0] = 'X';
  assert_int_equal(fixture_parse(bad, n, "tiny", &f), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "magic"));
  memcpy(bad, b, n);
  bad[19] = 9; /* dtype */
  assert_int_equal(fixture_parse(bad, n, "tiny", &f), DDP_ERR_FORMAT);
  /* The same 8 data bytes as one float64 (shape (1)): kept as float64. */
  memcpy(bad, b, n);
  bad[19] = DDP_FLOAT64;
  int64_t one = 1;
  double dv = -0.125;
  memcpy(bad + 21, &one, 8);
  memcpy(bad + 29, &dv, 8);
  assert_int_equal(fixture_parse(bad, n, "tiny", &f), DDP_OK);
  assert_int_equal(f->tensors[0].dtype, DDP_FLOAT64);
  assert_true(*(double *)f->tensors[0].data == -0.125);
  fixture_free(f);
  memcpy(bad, b, n);
  bad[20] = 7; /* ndim */
  assert_int_equal(fixture_parse(bad, n, "tiny", &f), DDP_ERR_FORMAT);
  memcpy(bad, b, n);
  int64_t huge = INT64_MAX / 2;
  memcpy(bad + 21, &huge, 8); /* shape far beyond the file */
  assert_int_equal(fixture_parse(bad, n, "tiny", &f), DDP_ERR_FORMAT);
  assert_int_equal(fixture_load("/nonexistent/fixture.bin", &f), DDP_ERR_IO);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_state_dict_matches_pytorch),
      cmocka_unit_test(test_convnet_n_names),
      cmocka_unit_test(test_flat_layout),
      cmocka_unit_test(test_init_like_pytorch),
      cmocka_unit_test(test_init_every_layer_every_seed),
      cmocka_unit_test(test_pytorch_init_has_our_bounds),
      cmocka_unit_test(test_zero_grad),
      cmocka_unit_test(test_forward_hook),
      cmocka_unit_test(test_clip_grad_norm),
      cmocka_unit_test(test_clip_coefficient_float64),
      cmocka_unit_test(test_clip_grad_norm_pytorch),
      cmocka_unit_test(test_train_eval_and_loss_kinds),
      cmocka_unit_test(test_mlp_builder),
      cmocka_unit_test(test_bad_builder_arguments),
      cmocka_unit_test(test_custom_model_errors),
      cmocka_unit_test(test_build_survives_allocation_failures),
      cmocka_unit_test(test_fixture_reader_validates),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
