/* Distributed autograd across 3 worker processes: a model whose layers live
 * on different workers (layer1 on w1, layer2 on w2, the head and the loss
 * on w0), run forward through calls within a context and backward with
 * ddp_dist_backward. Every parameter's gradient, read on its owner from
 * the context, and the input's, must equal the same model's gradients in
 * one process on one tape within 1e-6 relative; the parameters' own grad
 * stays untouched; two contexts keep their gradients apart. Both the chain
 * driven from w0 (w0 -> w1, w0 -> w2 with w1's output passed on) and a
 * nested call (w0 -> w1 -> w2) are checked. */
#include "ddp/rpc_autograd.h"
#include "rpc_test_util.h"

#define N 4
#define D_IN 6
#define D_H1 5
#define D_H2 4
#define D_OUT 3

/* Every worker makes every parameter the same way; each uses its own layer
 * in the distributed model, and all of them for the reference. */
typedef struct params {
  ddp_tensor *w1, *b1, *w2, *b2, *w3, *b3;
} params;

static params P;   /* the distributed model's (a worker's own layer) */
static params R;   /* the reference's */
static ddp_rpc_agent *self_agent;

static ddp_tensor *make_param(ddp_rng *rng, int ndim, const int64_t *shape) {
  ddp_tensor *t;
  if (ddp_tensor_create(&t, DDP_FLOAT32, ndim, shape) != DDP_OK) abort();
  for (int64_t i = 0; i < t->numel; i++) ddp_tensor_f32(t)[i] = ddp_rng_uniform_range(rng, -0.8f, 0.8f);
  t->flags |= DDP_TENSOR_REQUIRES_GRAD;
  return t;
}

static void make_params(params *p) {
  ddp_rng rng;
  ddp_rng_seed(&rng, 1234);
  p->w1 = make_param(&rng, 2, (int64_t[]){D_H1, D_IN});
  p->b1 = make_param(&rng, 1, (int64_t[]){D_H1});
  p->w2 = make_param(&rng, 2, (int64_t[]){D_H2, D_H1});
  p->b2 = make_param(&rng, 1, (int64_t[]){D_H2});
  p->w3 = make_param(&rng, 2, (int64_t[]){D_OUT, D_H2});
  p->b3 = make_param(&rng, 1, (int64_t[]){D_OUT});
}

/* The batch of step `step`: x (N, D_IN), y (N). */
static void make_batch(int step, float *x, int64_t *y) {
  ddp_rng rng;
  ddp_rng_seed(&rng, 99 + (uint64_t)step);
  for (int i = 0; i < N * D_IN; i++) x[i] = ddp_rng_uniform_range(&rng, -2, 2);
  for (int i = 0; i < N; i++) y[i] = (int64_t)ddp_rng_below(&rng, D_OUT);
}

static ddp_status layer1(ddp_tape *t, ddp_tensor *x, const params *p, ddp_tensor **out) {
  ddp_tensor *h;
  DDP_TRY(ddp_linear(t, x, p->w1, p->b1, &h));
  return ddp_relu(t, h, out);
}
static ddp_status layer2(ddp_tape *t, ddp_tensor *x, const params *p, ddp_tensor **out) {
  ddp_tensor *h;
  DDP_TRY(ddp_linear(t, x, p->w2, p->b2, &h));
  return ddp_tanh(t, h, out);
}
static ddp_status head(ddp_tape *t, ddp_tensor *h2, ddp_tensor *y, const params *p,
                       ddp_tensor **loss) {
  ddp_tensor *o, *lp;
  DDP_TRY(ddp_linear(t, h2, p->w3, p->b3, &o));
  DDP_TRY(ddp_log_softmax(t, o, &lp));
  return ddp_nll_loss(t, lp, y, loss);
}

/* The reference: the whole model on one tape; gradients in R's grads and
 * x_grad. */
static void reference(int step, float *x_grad) {
  float x[N * D_IN];
  int64_t y[N];
  make_batch(step, x, y);
  ddp_tensor tx, ty;
  ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){N, D_IN}, x);
  ddp_tensor_wrap(&ty, DDP_INT64, 1, (int64_t[]){N}, y);
  tx.flags |= DDP_TENSOR_REQUIRES_GRAD;
  tx.grad = x_grad;
  memset(x_grad, 0, sizeof(float) * N * D_IN);
  ddp_tensor *all[6] = {R.w1, R.b1, R.w2, R.b2, R.w3, R.b3};
  for (int i = 0; i < 6; i++) {
    ddp_tensor_ensure_grad(all[i]);
    memset(all[i]->grad, 0, sizeof(float) * (size_t)all[i]->numel);
  }
  ddp_tape *t;
  ddp_tape_create(&t, 1 << 16);
  ddp_tensor *h1, *h2, *loss;
  if (layer1(t, &tx, &R, &h1) || layer2(t, h1, &R, &h2) || head(t, h2, &ty, &R, &loss) ||
      ddp_backward(t, loss))
    abort();
  ddp_tape_destroy(t);
}

/* max|a - b| <= 1e-6 max|b| (and both finite). */
static bool close_rel(const float *a, const float *b, int64_t n, double *err) {
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - (double)b[i];
    if (d < 0) d = -d;
    if (!(d == d)) return false;
    if (d > worst) worst = d;
    double m = b[i] < 0 ? -b[i] : b[i];
    if (m > scale) scale = m;
  }
  *err = scale > 0 ? worst / scale : worst;
  return scale > 0 && worst <= 1e-6 * scale;
}

/* Compares the context's gradients of this worker's parameters with the
 * reference's, and checks the parameters' own grad untouched. */
static void check_mine(ddp_dist_context *ctx, ddp_tensor *const *mine, ddp_tensor *const *ref,
                       int n, int step, const char *who, rt_result *res) {
  for (int i = 0; i < n; i++) {
    const float *g = ddp_dist_get_gradient(ctx, mine[i]);
    RT_CHECK(res, g != NULL, "%s: no gradient in context for parameter %d (step %d)", who, i,
             step);
    if (!g) continue;
    double err = 0;
    RT_CHECK(res, close_rel(g, ref[i]->grad, mine[i]->numel, &err),
             "%s: parameter %d's gradient differs from one process's by %.3g relative (step %d)",
             who, i, err, step);
    RT_CHECK(res, mine[i]->grad == NULL, "%s: parameter %d's own grad was written", who, i);
  }
}

/* ---- Functions served within a context --------------------------------------- */

static ddp_status f_l1(ddp_dist_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                       void *user) {
  (void)user;
  static _Thread_local ddp_tensor *out[1];
  DDP_TRY(layer1(ddp_dist_call_tape(call), args->tensors[0], &P, &out[0]));
  reply->tensors = out;
  reply->num_tensors = 1;
  return DDP_OK;
}

static ddp_status f_l2(ddp_dist_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                       void *user) {
  (void)user;
  static _Thread_local ddp_tensor *out[1];
  DDP_TRY(layer2(ddp_dist_call_tape(call), args->tensors[0], &P, &out[0]));
  reply->tensors = out;
  reply->num_tensors = 1;
  return DDP_OK;
}

/* layer1 here, then layer2 on w2 from within this call. */
static ddp_status f_l12(ddp_dist_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                        void *user) {
  (void)user;
  ddp_tensor *h1;
  DDP_TRY(layer1(ddp_dist_call_tape(call), args->tensors[0], &P, &h1));
  ddp_tensor *t[1] = {h1};
  ddp_rpc_message m = {.tensors = t, .num_tensors = 1};
  const ddp_rpc_message *r;
  DDP_TRY(ddp_dist_rpc_sync(ddp_dist_call_context(call), "w2", "l2", &m, 30, &r));
  reply->tensors = r->tensors; /* a receive, passed on */
  reply->num_tensors = 1;
  return DDP_OK;
}

/* check (plain rpc): payload = {context id, step}; compares this worker's
 * layer's gradients in that context with the reference's. */
static ddp_status f_check(ddp_rpc_call *call, const ddp_rpc_message *args,
                          ddp_rpc_message *reply, void *user) {
  (void)reply, (void)user;
  int64_t w[2];
  memcpy(w, args->payload, sizeof w);
  ddp_rpc_agent *a = ddp_rpc_call_agent(call);
  ddp_dist_context *ctx;
  DDP_TRY(ddp_dist_context_retrieve(a, w[0], &ctx));
  float xg[N * D_IN];
  reference((int)w[1], xg);
  rt_result r = {0};
  int rank = ddp_rpc_self(a)->rank;
  if (rank == 1)
    check_mine(ctx, (ddp_tensor *[]){P.w1, P.b1}, (ddp_tensor *[]){R.w1, R.b1}, 2, (int)w[1], "w1",
               &r);
  else
    check_mine(ctx, (ddp_tensor *[]){P.w2, P.b2}, (ddp_tensor *[]){R.w2, R.b2}, 2, (int)w[1], "w2",
               &r);
  if (r.failures) return ddp_error(DDP_ERR_INTERNAL, "%s", r.msg);
  return DDP_OK;
}

/* ---- The driver (w0) -------------------------------------------------------------- */

static void one_step(rt_result *res, int step, bool nested, ddp_dist_context **keep) {
  float x[N * D_IN];
  int64_t y[N];
  make_batch(step, x, y);
  ddp_tensor tx, ty;
  ddp_tensor_wrap(&tx, DDP_FLOAT32, 2, (int64_t[]){N, D_IN}, x);
  ddp_tensor_wrap(&ty, DDP_INT64, 1, (int64_t[]){N}, y);
  tx.flags |= DDP_TENSOR_REQUIRES_GRAD; /* the input's gradient is checked too */
  ddp_dist_context *ctx;
  ddp_status s = ddp_dist_context_begin(self_agent, &ctx);
  RT_CHECK(res, s == DDP_OK, "context: %s", ddp_last_error());
  if (s != DDP_OK) return;
  ddp_tensor *t[1] = {&tx};
  ddp_rpc_message m = {.tensors = t, .num_tensors = 1};
  const ddp_rpc_message *r1 = NULL, *r2 = NULL;
  if (nested) {
    s = ddp_dist_rpc_sync(ctx, "w1", "l12", &m, 30, &r2);
  } else {
    s = ddp_dist_rpc_sync(ctx, "w1", "l1", &m, 30, &r1);
    if (s == DDP_OK) {
      ddp_tensor *h1[1] = {r1->tensors[0]};
      RT_CHECK(res, h1[0]->flags & DDP_TENSOR_REQUIRES_GRAD, "w1's output does not require grad");
      ddp_rpc_message m2 = {.tensors = h1, .num_tensors = 1};
      s = ddp_dist_rpc_sync(ctx, "w2", "l2", &m2, 30, &r2);
    }
  }
  RT_CHECK(res, s == DDP_OK, "forward (%s): %s", nested ? "nested" : "chain", ddp_last_error());
  ddp_tensor *loss = NULL;
  if (s == DDP_OK) s = head(ddp_dist_context_tape(ctx), r2->tensors[0], &ty, &P, &loss);
  if (s == DDP_OK) s = ddp_dist_backward(ctx, loss);
  RT_CHECK(res, s == DDP_OK, "backward: %s", ddp_last_error());
  if (s == DDP_OK) {
    float xg[N * D_IN];
    reference(step, xg);
    check_mine(ctx, (ddp_tensor *[]){P.w3, P.b3}, (ddp_tensor *[]){R.w3, R.b3}, 2, step, "w0",
               res);
    const float *g = ddp_dist_get_gradient(ctx, &tx);
    double err = 0;
    RT_CHECK(res, g && close_rel(g, xg, N * D_IN, &err),
             "the input's gradient differs by %.3g relative (step %d)", err, step);
    int64_t w[2] = {ddp_dist_context_id(ctx), step};
    ddp_rpc_message cm = {.payload = w, .payload_bytes = sizeof w};
    for (int k = 1; k <= 2; k++) {
      char name[4];
      snprintf(name, sizeof name, "w%d", k);
      s = ddp_rpc_sync(self_agent, name, "check", &cm, 30, NULL);
      RT_CHECK(res, s == DDP_OK, "%s", ddp_last_error());
    }
  }
  /* A second backward through the same context is refused, named. */
  if (loss && step == 0 && !nested) {
    s = ddp_dist_backward(ctx, loss);
    RT_CHECK(res, s != DDP_OK && strstr(ddp_last_error(), "context"),
             "a second backward: %s", ddp_last_error());
  }
  if (keep) {
    *keep = ctx;
    return;
  }
  s = ddp_dist_context_end(ctx);
  RT_CHECK(res, s == DDP_OK, "end: %s", ddp_last_error());
  /* Ended everywhere: w1 no longer knows it. */
}

static void autograd_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  self_agent = a;
  if (rank != 0) return;
  one_step(res, 0, false, NULL);
  one_step(res, 1, true, NULL);
  /* Two contexts alive at once keep their gradients apart: the first's are
   * still step 2's after step 3 ran in another. */
  ddp_dist_context *first = NULL;
  one_step(res, 2, false, &first);
  one_step(res, 3, true, NULL);
  if (first) {
    float xg[N * D_IN];
    reference(2, xg);
    check_mine(first, (ddp_tensor *[]){P.w3, P.b3}, (ddp_tensor *[]){R.w3, R.b3}, 2, 2,
               "w0 (first of two contexts)", res);
    RT_CHECK(res, ddp_dist_context_end(first) == DDP_OK, "end: %s", ddp_last_error());
  }
}

static void test_three_workers(void **state) {
  (void)state;
  make_params(&P);
  make_params(&R);
  ddp_dist_register("l1", f_l1, NULL);
  ddp_dist_register("l2", f_l2, NULL);
  ddp_dist_register("l12", f_l12, NULL);
  ddp_rpc_register("check", f_check, NULL);
  rt_config cfg = {.threads = 2, .graceful = true};
  rt_run(3, &cfg, autograd_fn, NULL, 90);
}

static int setup(void **state) {
  (void)state;
  return rt_start_store();
}

static int teardown(void **state) {
  (void)state;
  rt_stop_store();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_three_workers),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
