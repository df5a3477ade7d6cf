/* The DDP wrapper's options and failure messages, with ranks as threads:
 * the construction-time shape check (names the parameter and the rank, on
 * every rank), unused parameters (an error naming one; find_unused_parameters
 * and static_graph train like one process; static_graph refuses a changed
 * graph and lets the relayout run with find_unused_parameters), fp16 / bf16 compression within half precision of
 * float32, a user hook, overlap (bucket 0 launched while backward still had
 * gradients to compute), the relayout (convnet-2 registers fc first but its
 * gradient is ready first), join with uneven inputs, and reduce_grads (the
 * accumulated gradients of a pipeline stage, averaged bucket by bucket). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "parallel/dp_test_util.h"

/* ---- Shape check ------------------------------------------------------------ */

/* Rank `odd` gets net2 Linear(10, 6) instead of (10, 5); rank `extra` an
 * added Linear. */
typedef struct shape_case {
  int odd, extra;
  const char *expect[3];
} shape_case;

static ddp_status build_toy_like(int out2, bool extra, ddp_model **out) {
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  ddp_module_add_linear(m, NULL, "net1", 10, 10, true, NULL);
  ddp_module_add_relu(m, NULL, "relu", NULL);
  ddp_module_add_linear(m, NULL, "net2", 10, out2, true, NULL);
  if (extra) ddp_module_add_linear(m, NULL, "net3", out2, 5, true, NULL);
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  ddp_status s = ddp_model_finalize(m, 1);
  if (s != DDP_OK) ddp_model_destroy(m);
  else *out = m;
  return s;
}

static void shape_body(dpt_rank *self) {
  shape_case *c = self->world->user;
  ddp_model *m;
  DPT_OK(self, build_toy_like(self->rank == c->odd ? 6 : 5, self->rank == c->extra, &m));
  ddp_dp *dp = NULL;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, NULL);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ddp_last_error());
  ddp_model_destroy(m);
  DPT_CHECK(self, s == DDP_ERR_SHAPE && dp == NULL, "create gave %s: %s", ddp_status_name(s), msg);
  for (int i = 0; i < 3 && c->expect[i]; i++)
    DPT_CHECK(self, strstr(msg, c->expect[i]), "message lacks '%s': %s", c->expect[i], msg);
  if (self->rank == 0) printf("  rank 0 reports: %s\n", msg);
}

static void test_shape_mismatch_names_param_and_rank(void **state) {
  (void)state;
  shape_case c = {.odd = 2, .extra = -1, .expect = {"'net2.weight'", "(5,10)", "rank 2"}};
  assert_int_equal(dpt_run(3, 30, shape_body, &c), 0);
  shape_case d = {.odd = -1, .extra = 1, .expect = {"rank 1 has 6 parameters", "'net3.weight'"}};
  assert_int_equal(dpt_run(2, 30, shape_body, &d), 0);
}

/* ---- Unused parameters ------------------------------------------------------- */

/* toy plus net3 Linear(10, 5), registered last (so in bucket 0) and never
 * run by forward. mods (or NULL): net1, relu, net2, net3. */
static ddp_status build_with_unused_mods(ddp_model **out, ddp_module **mods) {
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  ddp_module *net1, *relu, *net2, *net3;
  ddp_module_add_linear(m, NULL, "net1", 10, 10, true, &net1);
  ddp_module_add_relu(m, NULL, "relu", &relu);
  ddp_module_add_linear(m, NULL, "net2", 10, 5, true, &net2);
  ddp_module_add_linear(m, NULL, "net3", 10, 5, true, &net3);
  if (mods) {
    mods[0] = net1;
    mods[1] = relu;
    mods[2] = net2;
    mods[3] = net3;
  }
  ddp_module *order[3] = {net1, relu, net2};
  ddp_model_set_forward_order(m, 3, order);
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  ddp_status s = ddp_model_finalize(m, 100);
  if (s != DDP_OK) ddp_model_destroy(m);
  else *out = m;
  return s;
}

static ddp_status build_with_unused(ddp_model **out) { return build_with_unused_mods(out, NULL); }

typedef struct unused_case {
  bool find_unused;
  bool static_graph; /* without find_unused: the first backward finds net3 unused */
  ddp_model *reference;
} unused_case;

static void unused_body(dpt_rank *self) {
  unused_case *c = self->world->user;
  ddp_model *m;
  DPT_OK(self, build_with_unused(&m));
  ddp_dp_options o = ddp_dp_defaults();
  o.find_unused_parameters = c->find_unused;
  o.static_graph = c->static_graph;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  dpt_cfg cfg = dpt_defaults("toy", self->world->size);
  s = dpt_train(&cfg, m, dp, self->rank);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ddp_last_error());
  bool close = s == DDP_OK && c->reference && dpt_params_close(m, c->reference, 1e-4, msg, sizeof msg);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  if (c->find_unused || c->static_graph) {
    DPT_CHECK(self, s == DDP_OK, "training with find_unused_parameters / static_graph: %s", msg);
    DPT_CHECK(self, close, "vs the single run: %s", msg);
  } else {
    DPT_CHECK(self, s == DDP_ERR_STATE, "expected DDP_ERR_STATE, got %s: %s", ddp_status_name(s), msg);
    DPT_CHECK(self, strstr(msg, "'net3.weight'") && strstr(msg, "find_unused_parameters"),
              "message: %s", msg);
    if (self->rank == 0) printf("  rank 0 reports: %s\n", msg);
  }
}

static void test_unused_parameter_error_names_it(void **state) {
  (void)state;
  unused_case c = {.find_unused = false};
  assert_int_equal(dpt_run(2, 30, unused_body, &c), 0);
}

static void test_find_unused_parameters_trains_like_one_process(void **state) {
  (void)state;
  unused_case c = {.find_unused = true};
  assert_int_equal(build_with_unused(&c.reference), DDP_OK);
  dpt_cfg cfg = dpt_defaults("toy", 2);
  assert_int_equal(dpt_train(&cfg, c.reference, NULL, 0), DDP_OK);
  assert_int_equal(dpt_run(2, 30, unused_body, &c), 0);
  /* static_graph finds the unused parameter in the first backward, with or
   * without find_unused_parameters. */
  c.find_unused = false;
  c.static_graph = true;
  assert_int_equal(dpt_run(2, 30, unused_body, &c), 0);
  c.find_unused = true;
  assert_int_equal(dpt_run(2, 30, unused_body, &c), 0);
  ddp_model_destroy(c.reference);
}

/* static_graph: a backward whose parameters in use differ from the first's
 * fails on every rank, naming the first parameter that changed: steps 1-2
 * run net1 -> relu -> net2 (net3 unused), step 3 net1 -> relu -> net3. With
 * find_unused_parameters alone the same change trains on. */
static void static_graph_body(dpt_rank *self) {
  const bool *static_graph = self->world->user;
  ddp_model *m;
  ddp_module *mods[4];
  DPT_OK(self, build_with_unused_mods(&m, mods));
  ddp_dp_options o = ddp_dp_defaults();
  o.find_unused_parameters = true;
  o.static_graph = *static_graph;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  dpt_cfg cfg = dpt_defaults("toy", self->world->size);
  cfg.steps = 2;
  s = dpt_train(&cfg, m, dp, self->rank);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ddp_last_error());
  bool first_ok = s == DDP_OK;
  ddp_module *order[3] = {mods[0], mods[1], mods[3]};
  if (first_ok) {
    s = ddp_model_set_forward_order(m, 3, order);
    cfg.steps = 1;
    if (s == DDP_OK) s = dpt_train(&cfg, m, dp, self->rank);
    snprintf(msg, sizeof msg, "%s", ddp_last_error());
  }
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_CHECK(self, first_ok, "the first two steps failed: %s", msg);
  if (*static_graph) {
    DPT_CHECK(self, s == DDP_ERR_STATE, "expected DDP_ERR_STATE, got %s: %s", ddp_status_name(s), msg);
    DPT_CHECK(self, strstr(msg, "static_graph") &&
                        strstr(msg, "'net2.weight' (index 2) got no gradient in synced backward 3 "
                                    "but got one in the first"),
              "message: %s", msg);
    if (self->rank == 0) printf("  rank 0 reports: %s\n", msg);
  } else {
    DPT_CHECK(self, s == DDP_OK, "find_unused_parameters alone: %s", msg);
  }
}

static void test_static_graph_refuses_a_changed_graph(void **state) {
  (void)state;
  bool static_graph = true;
  assert_int_equal(dpt_run(2, 30, static_graph_body, &static_graph), 0);
  static_graph = false;
  assert_int_equal(dpt_run(2, 30, static_graph_body, &static_graph), 0);
}


/* ---- Compression hooks and a user hook --------------------------------------- */

typedef struct hook_calls {
  atomic_int launches, finishes;
} hook_calls;

static ddp_status user_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *b,
                              ddp_work **work) {
  atomic_fetch_add(&((hook_calls *)state)->launches, 1);
  return ddp_allreduce_async(pg, b->grads, b->numel, DDP_FLOAT32, DDP_REDUCE_SUM, work);
}

static ddp_status user_finish(void *state, ddp_dp_bucket *b) {
  atomic_fetch_add(&((hook_calls *)state)->finishes, 1);
  for (size_t i = 0; i < b->numel; i++) b->grads[i] /= (float)b->divisor;
  return DDP_OK;
}

typedef struct hook_case {
  const char *model;
  float *local_max;         /* per rank: max |local gradient| */
  hook_calls calls;
} hook_case;

/* One backward on this rank's rows; the gradients (reduced or local) in g. */
static ddp_status one_backward(ddp_model *m, ddp_dp *dp, const char *model, int rank, int world,
                               float *g) {
  ddp_tape *tape;
  DDP_TRY(ddp_tape_create(&tape, 1 << 20));
  float *xbuf = malloc(4 * 784 * sizeof(float)), *ybuf = malloc(4 * 5 * 8);
  ddp_tensor x, y, *out, *loss;
  dpt_batch(model, 0, rank, world, 4, xbuf, ybuf, &x, &y);
  ddp_model_zero_grad(m);
  ddp_status s = dp ? ddp_dp_forward(dp, tape, &x, &out) : ddp_model_forward(m, tape, &x, &out);
  if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
  if (s == DDP_OK) s = dp ? ddp_dp_backward(dp, tape, loss) : ddp_backward(tape, loss);
  memcpy(g, ddp_model_grads_flat(m), (size_t)ddp_model_num_param_elements(m) * sizeof(float));
  free(xbuf);
  free(ybuf);
  ddp_tape_destroy(tape);
  return s;
}

static void hook_body(dpt_rank *self) {
  hook_case *c = self->world->user;
  int W = self->world->size;
  ddp_model *m;
  DPT_OK(self, ddp_model_build(c->model, NULL, 7, &m));
  ddp_model_train(m, false);
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = 0.02;
  o.relayout = false; /* the same buckets for every hook */
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  size_t n = (size_t)ddp_model_num_param_elements(m);
  float *local = calloc(n, 4), *f32 = calloc(n, 4), *f16 = calloc(n, 4), *b16 = calloc(n, 4),
        *user = calloc(n, 4);
  ddp_dp_comm_hook uh = {user_launch, user_finish, &c->calls};
  /* This rank's local maximum is published before the reduced backwards:
   * every rank needs every rank's contribution to them, so each write here
   * happens before every rank's reads below. (Written after them, as it
   * once was, a fast rank could read a slow rank's entry before it was set:
   * ThreadSanitizer found that race.) */
  if ((s = one_backward(m, NULL, c->model, self->rank, W, local)) == DDP_OK) {
    float mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmaxf(mx, fabsf(local[i]));
    c->local_max[self->rank] = mx;
  }
  if (s == DDP_OK && (s = one_backward(m, dp, c->model, self->rank, W, f32)) == DDP_OK &&
      (s = ddp_dp_set_comm_hook(dp, DDP_DP_HOOK_FP16)) == DDP_OK &&
      (s = one_backward(m, dp, c->model, self->rank, W, f16)) == DDP_OK &&
      (s = ddp_dp_set_comm_hook(dp, DDP_DP_HOOK_BF16)) == DDP_OK &&
      (s = one_backward(m, dp, c->model, self->rank, W, b16)) == DDP_OK &&
      (s = ddp_dp_set_comm_hook_fn(dp, &uh)) == DDP_OK)
    s = one_backward(m, dp, c->model, self->rank, W, user);
  int buckets = ddp_dp_num_buckets(dp);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  if (s == DDP_OK) {
    /* Every rank's local maximum (all written before the reduced
     * backwards, which every rank needed). */
    float M = 0;
    for (int r = 0; r < W; r++) M = fmaxf(M, c->local_max[r]);
    /* Each rank's g/W rounds once to the half type, the sum once more:
     * |error| <= 2 u M with u = 2^-11 (float16) or 2^-8 (bfloat16), plus
     * float16's subnormal spacing. */
    double e16 = 0, eb16 = 0, euser = 0;
    size_t differ16 = 0;
    for (size_t i = 0; i < n; i++) {
      e16 = fmax(e16, fabs((double)f16[i] - f32[i]));
      eb16 = fmax(eb16, fabs((double)b16[i] - f32[i]));
      euser = fmax(euser, fabs((double)user[i] - f32[i]));
      differ16 += f16[i] != f32[i];
    }
    double tol16 = 2 * ldexp(1, -11) * M + ldexp(1, -24) * W, tolb16 = 2 * ldexp(1, -8) * M;
    if (self->rank == 0)
      printf("  %s, %d buckets: max|fp16 - fp32| = %.3g (bound %.3g), max|bf16 - fp32| = %.3g "
             "(bound %.3g), %zu of %zu fp16 values differ\n",
             c->model, buckets, e16, tol16, eb16, tolb16, differ16, n);
    free(local), free(f32), free(f16), free(b16), free(user);
    DPT_CHECK(self, e16 <= tol16, "fp16: %.3g > %.3g", e16, tol16);
    DPT_CHECK(self, eb16 <= tolb16, "bf16: %.3g > %.3g", eb16, tolb16);
    DPT_CHECK(self, differ16 > 0, "fp16 compression changed nothing: not applied?");
    DPT_CHECK(self, euser == 0, "the user hook (sum, divide) differs from the built-in: %.3g", euser);
    return;
  }
  free(local), free(f32), free(f16), free(b16), free(user);
  DPT_OK(self, s);
}

static void test_fp16_bf16_user_hooks(void **state) {
  (void)state;
  const char *models[2] = {"toy", "convnet"};
  for (int k = 0; k < 2; k++) {
    float local_max[3] = {0};
    hook_case c = {.model = models[k], .local_max = local_max};
    assert_int_equal(dpt_run(3, 30, hook_body, &c), 0);
    /* 3 ranks, one backward with the user hook: launches = finishes = 3 x buckets. */
    assert_true(atomic_load(&c.calls.launches) > 0);
    assert_int_equal(atomic_load(&c.calls.launches), atomic_load(&c.calls.finishes));
    assert_int_equal(atomic_load(&c.calls.launches) % 3, 0);
  }
}

/* ---- Overlap and relayout ---------------------------------------------------- */

typedef struct trace_case {
  const char *model;
  double cap_mb;
  ddp_model *reference; /* for the relayout's equivalence */
  bool find_unused, static_graph;
} trace_case;

static void print_trace(const ddp_dp *dp, ddp_model *m, int iteration) {
  ddp_dp_trace t;
  ddp_dp_get_trace(dp, &t);
  printf("  iteration %d: backward %.1f us, finalize done at +%.1f us; relaid out: %s\n", iteration,
         (t.backward_end_ns - t.backward_start_ns) / 1e3,
         (t.finalize_end_ns - t.backward_start_ns) / 1e3, t.relaid_out ? "yes" : "no");
  for (int b = 0; b < t.n_buckets; b++) {
    printf("    bucket %d (%zu floats, first %s): launched at +%.1f us, %d params not ready, "
           "%d hooks before\n",
           b, t.buckets[b].numel, ddp_model_param_name(m, t.buckets[b].first_param),
           (t.buckets[b].launch_ns - t.backward_start_ns) / 1e3, t.buckets[b].params_not_ready,
           t.buckets[b].hook_calls_before);
  }
}

static void overlap_body(dpt_rank *self) {
  trace_case *c = self->world->user;
  ddp_model *m;
  DPT_OK(self, ddp_model_build(c->model, NULL, 100, &m));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = c->cap_mb;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  dpt_cfg cfg = dpt_defaults(c->model, self->world->size);
  cfg.steps = 1;
  s = dpt_train(&cfg, m, dp, self->rank);
  if (s == DDP_OK && self->rank == 0) print_trace(dp, m, 1);
  cfg.steps = 1;
  if (s == DDP_OK) s = dpt_train(&cfg, m, dp, self->rank);
  if (s == DDP_OK && self->rank == 0) print_trace(dp, m, 2);
  ddp_dp_trace t;
  ddp_dp_get_trace(dp, &t);
  int n_params = ddp_model_num_params(m);
  const ddp_dp_bucket *b0 = ddp_dp_bucket_get(dp, 0);
  char first[64];
  snprintf(first, sizeof first, "%s", b0 ? ddp_model_param_name(m, b0->params[0]) : "");
  ddp_dp_bucket_trace t0 = t.buckets[0];
  int n_buckets = t.n_buckets;
  bool relaid = t.relaid_out;
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_OK(self, s);
  DPT_CHECK(self, n_buckets >= 2, "only %d bucket(s)", n_buckets);
  /* Overlap: bucket 0's allreduce started while backward still had
   * gradients to compute, before the tape's last op ran. */
  DPT_CHECK(self, t0.params_not_ready > 0 && t0.hook_calls_before < n_params,
            "bucket 0 launched with %d parameters not ready", t0.params_not_ready);
  DPT_CHECK(self, t0.launch_ns < t.backward_end_ns, "bucket 0 launched after backward ended");
  if (!strcmp(c->model, "convnet-2")) {
    /* fc is registered first but its gradient is ready first: after the
     * relayout it leads bucket 0, launched right after its own hook. */
    DPT_CHECK(self, relaid, "no relayout");
    DPT_CHECK(self, !strcmp(first, "fc.weight"), "bucket 0 starts with %s", first);
    DPT_CHECK(self, t0.hook_calls_before == 1, "bucket 0 waited for %d hooks",
              t0.hook_calls_before);
  }
}

static void test_overlap_convnet_small_buckets(void **state) {
  (void)state;
  trace_case c = {.model = "convnet", .cap_mb = 0.02};
  assert_int_equal(dpt_run(2, 30, overlap_body, &c), 0);
}

static void test_relayout_convnet2(void **state) {
  (void)state;
  trace_case c = {.model = "convnet-2", .cap_mb = 0.002};
  assert_int_equal(dpt_run(2, 30, overlap_body, &c), 0);
}

/* The relayout moves parameters, gradients and momentum together: 10 steps
 * with momentum across it equal the single run. */
static void relayout_eq_body(dpt_rank *self) {
  trace_case *c = self->world->user;
  ddp_model *m;
  DPT_OK(self, ddp_model_build(c->model, NULL, 100 + (uint64_t)self->rank, &m));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = c->cap_mb;
  o.find_unused_parameters = c->find_unused;
  o.static_graph = c->static_graph;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  dpt_cfg cfg = dpt_defaults(c->model, self->world->size);
  s = dpt_train(&cfg, m, dp, self->rank);
  ddp_dp_trace t;
  ddp_dp_get_trace(dp, &t);
  const ddp_dp_bucket *b0 = ddp_dp_bucket_get(dp, 0);
  char first[64];
  snprintf(first, sizeof first, "%s", b0 ? ddp_model_param_name(m, b0->params[0]) : "");
  char msg[512] = "";
  bool close = s == DDP_OK && dpt_params_close(m, c->reference, 1e-4, msg, sizeof msg);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_OK(self, s);
  DPT_CHECK(self, t.relaid_out, "no relayout happened");
  if (c->static_graph) /* fc is ready first: after the relayout it leads bucket 0 */
    DPT_CHECK(self, !strcmp(first, "fc.weight"), "bucket 0 starts with %s", first);
  DPT_CHECK(self, close, "vs the single run: %s", msg);
}

static void relayout_equivalence(bool find_unused, bool static_graph) {
  trace_case c = {.model = "convnet-2", .cap_mb = 0.002, .find_unused = find_unused,
                  .static_graph = static_graph};
  assert_int_equal(ddp_model_build(c.model, NULL, 100, &c.reference), DDP_OK);
  dpt_cfg cfg = dpt_defaults(c.model, 2);
  assert_int_equal(dpt_train(&cfg, c.reference, NULL, 0), DDP_OK);
  assert_int_equal(dpt_run(2, 60, relayout_eq_body, &c), 0);
  ddp_model_destroy(c.reference);
}

static void test_relayout_keeps_training_equivalent(void **state) {
  (void)state;
  relayout_equivalence(false, false);
}

/* static_graph lets the relayout run with find_unused_parameters (which
 * alone turns it off): convnet-2's fc leads bucket 0 after the first step,
 * and 10 steps still equal the single run. */
static void test_static_graph_relayout_with_find_unused(void **state) {
  (void)state;
  relayout_equivalence(true, true);
}

/* An attached optimizer that does not cover the model's whole flat buffers
 * (here: only the last parameter) cannot follow a relayout. The relayout is
 * refused before anything moves: the error names the sizes, and the
 * model's layout stays the one the buckets were built for. */
static void partial_optimizer_body(dpt_rank *self) {
  ddp_model *m;
  DPT_OK(self, ddp_model_build("convnet-2", NULL, 100, &m));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = 0.002;
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, &o);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  int n = ddp_model_num_params(m);
  int64_t before[64];
  for (int i = 0; i < n && i < 64; i++) before[i] = ddp_model_param_offset(m, i);
  int64_t off = ddp_model_param_offset(m, n - 1), len = ddp_model_param(m, n - 1)->numel;
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m) + off,
                           ddp_model_grads_flat(m) + off, (size_t)len);
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 20);
  if (s == DDP_OK) ddp_dp_set_optimizer(dp, opt);
  float *xbuf = malloc(4 * 784 * sizeof(float)), *ybuf = malloc(4 * 8 * 5);
  ddp_tensor x, y, *out, *loss;
  dpt_batch("convnet-2", 0, self->rank, self->world->size, 4, xbuf, ybuf, &x, &y);
  if (s == DDP_OK) s = ddp_dp_forward(dp, tape, &x, &out);
  if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
  ddp_status bs = s == DDP_OK ? ddp_dp_backward(dp, tape, loss) : s;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ddp_last_error());
  bool unmoved = true;
  for (int i = 0; i < n && i < 64; i++) unmoved &= ddp_model_param_offset(m, i) == before[i];
  ddp_dp_trace t;
  ddp_dp_get_trace(dp, &t);
  free(xbuf);
  free(ybuf);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_OK(self, s);
  DPT_CHECK(self, bs == DDP_ERR_INVALID, "backward gave %s: %s", ddp_status_name(bs), msg);
  DPT_CHECK(self, strstr(msg, "optimizer") && strstr(msg, "relayout"), "message: %s", msg);
  DPT_CHECK(self, unmoved && !t.relaid_out, "the model was relaid out anyway (%s)", msg);
}

static void test_relayout_refuses_partial_optimizer(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, partial_optimizer_body, NULL), 0);
}

/* ddp_model_relayout and ddp_optimizer_relayout on their own: every
 * parameter, gradient and momentum buffer keeps its values by name. */
static void test_model_and_optimizer_relayout(void **state) {
  (void)state;
  ddp_model *m;
  assert_int_equal(ddp_model_build("convnet", NULL, 5, &m), DDP_OK);
  int n = ddp_model_num_params(m);
  int64_t N = ddp_model_num_param_elements(m);
  float *g = ddp_model_grads_flat(m);
  for (int64_t i = 0; i < N; i++) g[i] = (float)i;
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  assert_int_equal(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), g, (size_t)N), DDP_OK);
  ddp_optim_state st;
  assert_int_equal(ddp_optimizer_state_find(opt, "momentum_buffer", &st), DDP_OK);
  for (int64_t i = 0; i < N; i++) st.data[i] = (float)(-i);
  float *before = malloc((size_t)N * sizeof(float));
  memcpy(before, ddp_model_params_flat(m), (size_t)N * sizeof(float));
  int64_t *old_off = malloc((size_t)n * 3 * sizeof(int64_t)), *new_off = old_off + n,
          *len = old_off + 2 * n;
  int *order = malloc((size_t)n * sizeof(int));
  for (int i = 0; i < n; i++) {
    old_off[i] = ddp_model_param_offset(m, i);
    len[i] = ddp_model_param(m, i)->numel;
    order[i] = (i * 3 + 7) % n; /* a permutation: gcd(3, n) = 1 for the convnet's 10 */
  }
  assert_int_equal(n, 10);
  assert_int_equal(ddp_model_relayout(m, order), DDP_OK);
  for (int i = 0; i < n; i++) new_off[i] = ddp_model_param_offset(m, i);
  assert_int_equal(ddp_optimizer_relayout(opt, (size_t)n, old_off, new_off, len), DDP_OK);
  for (int i = 0; i < n; i++) {
    ddp_tensor *t = ddp_model_param(m, i);
    assert_ptr_equal(t->data, ddp_model_params_flat(m) + new_off[i]);
    for (int64_t k = 0; k < t->numel; k++) {
      assert_true(ddp_tensor_f32(t)[k] == before[old_off[i] + k]);
      assert_true(t->grad[k] == (float)(old_off[i] + k));
      assert_true(st.data[new_off[i] + k] == (float)(-(old_off[i] + k)));
    }
  }
  /* Not a permutation: refused, naming it. */
  order[1] = order[0];
  assert_int_equal(ddp_model_relayout(m, order), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "permutation"));
  free(order);
  free(old_off);
  free(before);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
}

/* ---- Join ---------------------------------------------------------------------- */

/* Rank r has 10 - 3r batches of toy rows; in step t the ranks with data are
 * those with t < their count. The reference applies, per step, the single
 * run's gradient on the union of those ranks' rows (mean), scaled by
 * n_active / W when dividing by the initial world size. */
typedef struct join_case {
  bool divide_initial;
  ddp_model *reference;
  float *final[DPT_MAX_RANKS];
} join_case;

static int join_steps(int rank) { return 10 - 3 * rank; }

static ddp_status join_reference(join_case *c, int W) {
  ddp_model *m = c->reference;
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.05;
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt;
  DDP_TRY(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                               (size_t)ddp_model_num_param_elements(m)));
  ddp_tape *tape;
  DDP_TRY(ddp_tape_create(&tape, 1 << 16));
  enum { B = 4 };
  float xbuf[DPT_MAX_RANKS * B * 10], ybuf[DPT_MAX_RANKS * B * 5];
  ddp_status s = DDP_OK;
  for (int t = 0; t < join_steps(0) && s == DDP_OK; t++) {
    int active = 0;
    for (int r = 0; r < W; r++) active += t < join_steps(r);
    /* The active ranks are 0..active-1: their strided rows are the first
     * active*B rows of a batch walked with stride `W`... in rank-major
     * order, which the mean does not care about. */
    for (int r = 0; r < active; r++)
      for (int k = 0; k < B; k++)
        dpt_row("toy", t, r + (int64_t)k * W, xbuf + (r * B + k) * 10, ybuf, r * B + k);
    ddp_tensor x, y, *out, *loss;
    int64_t xs[2] = {active * B, 10}, ys[2] = {active * B, 5};
    ddp_tensor_wrap(&x, DDP_FLOAT32, 2, xs, xbuf);
    ddp_tensor_wrap(&y, DDP_FLOAT32, 2, ys, ybuf);
    ddp_model_zero_grad(m);
    ddp_tape_reset(tape);
    s = ddp_model_forward(m, tape, &x, &out);
    if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
    if (s == DDP_OK) s = ddp_backward(tape, loss);
    if (s == DDP_OK && c->divide_initial) {
      float *g = ddp_model_grads_flat(m);
      for (int64_t i = 0; i < ddp_model_num_param_elements(m); i++) g[i] = g[i] * active / W;
    }
    if (s == DDP_OK) s = ddp_optimizer_step(opt);
  }
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  return s;
}

static void join_body(dpt_rank *self) {
  join_case *c = self->world->user;
  int W = self->world->size;
  ddp_model *m;
  DPT_OK(self, ddp_model_build("toy", NULL, 100 + (uint64_t)self->rank, &m));
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, NULL);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.05;
  oo.sgd.momentum = 0.9;
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                           (size_t)ddp_model_num_param_elements(m));
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 16);
  if (s == DDP_OK) ddp_dp_set_optimizer(dp, opt);
  if (s == DDP_OK) s = ddp_dp_join_enable(dp, c->divide_initial);
  float xbuf[4 * 10], ybuf[4 * 5];
  for (int t = 0; t < join_steps(self->rank) && s == DDP_OK; t++) {
    ddp_tensor x, y, *out, *loss;
    dpt_batch("toy", t, self->rank, W, 4, xbuf, ybuf, &x, &y);
    ddp_model_zero_grad(m);
    ddp_tape_reset(tape);
    s = ddp_dp_forward(dp, tape, &x, &out);
    if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
    if (s == DDP_OK) s = ddp_dp_backward(dp, tape, loss);
    if (s == DDP_OK) s = ddp_optimizer_step(opt);
  }
  if (s == DDP_OK) s = ddp_dp_join(dp);
  char msg[512] = "";
  if (s != DDP_OK) snprintf(msg, sizeof msg, "%s", ddp_last_error());
  bool close = s == DDP_OK && dpt_params_close(m, c->reference, 1e-4, msg, sizeof msg);
  memcpy(c->final[self->rank], ddp_model_params_flat(m),
         (size_t)ddp_model_num_param_elements(m) * sizeof(float));
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_CHECK(self, s == DDP_OK, "%s", msg);
  DPT_CHECK(self, close, "vs the reference: %s", msg);
}

static void run_join(bool divide_initial) {
  enum { W = 3 };
  join_case c = {.divide_initial = divide_initial};
  assert_int_equal(ddp_model_build("toy", NULL, 100, &c.reference), DDP_OK);
  assert_int_equal(join_reference(&c, W), DDP_OK);
  int64_t n = ddp_model_num_param_elements(c.reference);
  for (int r = 0; r < W; r++) c.final[r] = calloc((size_t)n, sizeof(float));
  double t0 = ddp_time_s();
  int rc = dpt_run(W, 20, join_body, &c);
  printf("  join (divide_by_initial_world_size=%d): ranks with 10, 7, 4 batches done in %.3f s\n",
         divide_initial, ddp_time_s() - t0);
  /* Rank 2 stopped updating after 4 steps: the final sync gave it rank 0's model. */
  for (int r = 1; r < W && rc == 0; r++)
    if (memcmp(c.final[r], c.final[0], (size_t)n * sizeof(float))) rc = 1;
  for (int r = 0; r < W; r++) free(c.final[r]);
  ddp_model_destroy(c.reference);
  assert_int_equal(rc, 0);
}

static void test_join_uneven_inputs_divide_by_initial_world_size(void **state) {
  (void)state;
  run_join(true);
}

static void test_join_uneven_inputs_divide_by_active_ranks(void **state) {
  (void)state;
  run_join(false);
}

/* An evaluation forward through ddp_dp_forward with gradients off (the tape's
 * grad mode, PyTorch's torch.no_grad()) is followed by no backward: a rank
 * that has joined must not shadow a gradient allreduce for it. Rank 1 has no
 * data and joins at once; rank 0 trains, evaluates through the wrapper,
 * trains again, then joins. Before the fix rank 1 shadowed the evaluation as
 * a synced iteration and the ranks' collectives no longer matched. Both end
 * with the same model as a single rank doing rank 0's two steps alone
 * (divided by the initial world size, so gradients are halved). */
typedef struct join_eval_case {
  ddp_model *reference;
} join_eval_case;

static ddp_status join_eval_step(ddp_model *m, ddp_dp *dp, ddp_tape *tape, ddp_optimizer *opt,
                                 int t, float *xbuf, float *ybuf) {
  ddp_tensor x, y, *out, *loss;
  dpt_batch("toy", t, 0, 1, 4, xbuf, ybuf, &x, &y);
  ddp_model_zero_grad(m);
  ddp_tape_reset(tape);
  DDP_TRY(dp ? ddp_dp_forward(dp, tape, &x, &out) : ddp_model_forward(m, tape, &x, &out));
  DDP_TRY(ddp_model_loss(m, tape, out, &y, &loss));
  if (dp) {
    DDP_TRY(ddp_dp_backward(dp, tape, loss));
  } else {
    DDP_TRY(ddp_backward(tape, loss));
    float *g = ddp_model_grads_flat(m);
    for (int64_t i = 0; i < ddp_model_num_param_elements(m); i++) g[i] *= 0.5f;
  }
  return ddp_optimizer_step(opt);
}

static void join_eval_body(dpt_rank *self) {
  join_eval_case *c = self->world->user;
  ddp_model *m;
  DPT_OK(self, ddp_model_build("toy", NULL, 100, &m));
  ddp_dp *dp;
  ddp_status s = ddp_dp_create(&dp, m, self->pg, NULL);
  if (s != DDP_OK) ddp_model_destroy(m);
  DPT_OK(self, s);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.05;
  ddp_optimizer *opt = NULL;
  ddp_tape *tape = NULL;
  s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                           (size_t)ddp_model_num_param_elements(m));
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 16);
  if (s == DDP_OK) ddp_dp_set_optimizer(dp, opt);
  if (s == DDP_OK) s = ddp_dp_join_enable(dp, true);
  float xbuf[4 * 10], ybuf[4 * 5];
  if (self->rank == 0) {
    if (s == DDP_OK) s = join_eval_step(m, dp, tape, opt, 0, xbuf, ybuf);
    if (s == DDP_OK) { /* evaluation: no gradients, no backward */
      ddp_tensor x, y, *out;
      dpt_batch("toy", 1, 0, 1, 4, xbuf, ybuf, &x, &y);
      ddp_tape_reset(tape);
      ddp_tape_set_grad_enabled(tape, false);
      s = ddp_dp_forward(dp, tape, &x, &out);
      ddp_tape_set_grad_enabled(tape, true);
    }
    if (s == DDP_OK) s = join_eval_step(m, dp, tape, opt, 2, xbuf, ybuf);
  }
  if (s == DDP_OK) s = ddp_dp_join(dp);
  char msg[512] = "";
  if (s != DDP_OK) snprintf(msg, sizeof msg, "%s", ddp_last_error());
  bool close = s == DDP_OK && dpt_params_close(m, c->reference, 1e-5, msg, sizeof msg);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
  DPT_CHECK(self, s == DDP_OK, "%s", msg);
  DPT_CHECK(self, close, "vs rank 0's steps alone: %s", msg);
}

static void test_join_skips_evaluation_forward(void **state) {
  (void)state;
  join_eval_case c;
  assert_int_equal(ddp_model_build("toy", NULL, 100, &c.reference), DDP_OK);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  oo.lr = 0.05;
  ddp_optimizer *opt;
  ddp_tape *tape;
  ddp_model *m = c.reference;
  assert_int_equal(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m),
                                        ddp_model_grads_flat(m),
                                        (size_t)ddp_model_num_param_elements(m)),
                   DDP_OK);
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  float xbuf[4 * 10], ybuf[4 * 5];
  assert_int_equal(join_eval_step(m, NULL, tape, opt, 0, xbuf, ybuf), DDP_OK);
  assert_int_equal(join_eval_step(m, NULL, tape, opt, 2, xbuf, ybuf), DDP_OK);
  ddp_tape_destroy(tape);
  ddp_optimizer_destroy(opt);
  assert_int_equal(dpt_run(2, 5, join_eval_body, &c), 0);
  ddp_model_destroy(c.reference);
}

/* ---- reduce_grads ------------------------------------------------------------ */

/* Rank r's gradient element j is g(r, j); after reduce_grads every rank
 * holds the mean over ranks, computed here in float64. Buckets of about 8 floats
 * (the cap in MiB) make several launches; the fp16 hook's average is within
 * half precision of it; a call between prepare and finalize is refused. */
static double reduce_g(int r, int64_t j) { return (r + 1) * 0.001 * (double)(j % 97) - 0.01 * r; }

static void reduce_grads_body(dpt_rank *self) {
  const int size = self->world->size;
  ddp_model *m;
  DPT_OK(self, build_toy_like(5, true, &m));
  ddp_dp_options o = ddp_dp_defaults();
  o.bucket_cap_mb = o.first_bucket_mb = 8.0 * sizeof(float) / (1024.0 * 1024.0);
  ddp_dp *dp = NULL;
  DPT_OK(self, ddp_dp_create(&dp, m, self->pg, &o));
  DPT_CHECK(self, ddp_dp_num_buckets(dp) >= 3, "%d buckets", ddp_dp_num_buckets(dp));
  const int64_t n = ddp_model_num_param_elements(m);
  float *g = ddp_model_grads_flat(m);
  for (int hook = 0; hook < 2; hook++) {
    if (hook) DPT_OK(self, ddp_dp_set_comm_hook(dp, DDP_DP_HOOK_FP16));
    for (int64_t j = 0; j < n; j++) g[j] = (float)reduce_g(self->rank, j);
    DPT_OK(self, ddp_dp_reduce_grads(dp));
    double worst = 0;
    for (int64_t j = 0; j < n; j++) {
      double mean = 0;
      for (int r = 0; r < size; r++) mean += (double)(float)reduce_g(r, j);
      mean /= size;
      double err = fabs(g[j] - mean) / (fabs(mean) + 1e-3);
      if (err > worst) worst = err;
    }
    /* float32 sums of 3 terms; fp16 has an 11-bit significand. */
    DPT_CHECK(self, worst <= (hook ? 2e-3 : 1e-6), "hook %d: worst relative error %g", hook, worst);
  }
  ddp_tape *tape;
  DPT_OK(self, ddp_tape_create(&tape, 0));
  DPT_OK(self, ddp_dp_prepare_backward(dp, tape));
  DPT_CHECK(self, ddp_dp_reduce_grads(dp) == DDP_ERR_STATE, "reduce_grads inside a backward: accepted");
  (void)ddp_dp_finalize_backward(dp); /* disarms (no gradient came: an unused-parameter error) */
  ddp_tape_destroy(tape);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
}

static void test_reduce_grads_averages_accumulated_gradients(void **state) {
  (void)state;
  assert_int_equal(dpt_run(3, 30, reduce_grads_body, NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shape_mismatch_names_param_and_rank),
      cmocka_unit_test(test_unused_parameter_error_names_it),
      cmocka_unit_test(test_find_unused_parameters_trains_like_one_process),
      cmocka_unit_test(test_static_graph_refuses_a_changed_graph),
      cmocka_unit_test(test_static_graph_relayout_with_find_unused),
      cmocka_unit_test(test_fp16_bf16_user_hooks),
      cmocka_unit_test(test_overlap_convnet_small_buckets),
      cmocka_unit_test(test_relayout_convnet2),
      cmocka_unit_test(test_relayout_keeps_training_equivalent),
      cmocka_unit_test(test_model_and_optimizer_relayout),
      cmocka_unit_test(test_relayout_refuses_partial_optimizer),
      cmocka_unit_test(test_join_uneven_inputs_divide_by_initial_world_size),
      cmocka_unit_test(test_join_uneven_inputs_divide_by_active_ranks),
      cmocka_unit_test(test_join_skips_evaluation_forward),
      cmocka_unit_test(test_reduce_grads_averages_accumulated_gradients),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
