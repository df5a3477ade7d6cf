/* SyncBatchNorm against its definition: W ranks (threads of this process,
 * each with its own process group) that each hold a slice of one batch must
 * compute what a single batch norm computes on the concatenated batch: the
 * same outputs and input gradients per slice, the same weight and bias
 * gradients once summed over the ranks, the same running statistics and
 * num_batches_tracked on every rank. The single batch norm is the reference
 * (it is itself checked against PyTorch in tests/nn); the input gradient is
 * also checked against central finite differences of the synchronized
 * forward. Then the ConvNet converted to SyncBatchNorm: W slices give the
 * full batch's parameter gradients (summed over ranks / W, DDP's averaging of
 * per-rank mean losses), its evaluation mode is BatchNorm's, and its
 * steady-state step allocates nothing. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "comm/comm_test_util.h"
#include "ddp/ddp.h"
#include "support/gradcheck.h"
#include "tensor/tape.h"

#define TIMEOUT_S 30.0
#define MAX_W 4
#define MOMENTUM 0.1f
#define EPS 1e-5f
#define STEPS 2

/* ---- one batch norm over W slices --------------------------------------- */

typedef struct bn_case {
  const char *name;
  int world;
  int64_t n[MAX_W]; /* rows per rank (may differ, may be 0) */
  int ndim;         /* 4: (N, C, H, W); 2: (N, C) */
  int64_t C, H, W;
  float shift; /* added to x: a mean far from 0 relative to the spread */

  /* Filled by bn_setup: the concatenated batch and the reference's inputs. */
  int64_t ntot, sample; /* rows in all; floats per row */
  float *x[STEPS], *dy[STEPS];
  float weight_init[8], bias_init[8], rm_init[8], rv_init[8];

  /* Written by the ranks: their slice of the last step's y and dx, and their own state. */
  float *y, *dx;
  float dweight[MAX_W][8], dbias[MAX_W][8], rm[MAX_W][8], rv[MAX_W][8];
  int64_t nbt[MAX_W];

  /* Finite differences: for every element j of the concatenated batch, each
   * rank's share of the projected loss with x[j] moved by +h and -h. */
  bool finite_differences;
  double *loss_plus, *loss_minus; /* (ntot * sample, world) */
} bn_case;

static int64_t row_offset(const bn_case *c, int rank) {
  int64_t off = 0;
  for (int r = 0; r < rank; r++) off += c->n[r];
  return off;
}

static void fill_uniform(float *x, int64_t n, float lo, float hi, uint64_t seed) {
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = 0; i < n; i++) x[i] = ddp_rng_uniform_range(&rng, lo, hi);
}

static void bn_setup(bn_case *c) {
  assert_true(c->C <= 8 && c->world <= MAX_W);
  c->ntot = row_offset(c, c->world);
  c->sample = c->C * (c->ndim == 4 ? c->H * c->W : 1);
  int64_t n = c->ntot * c->sample;
  for (int s = 0; s < STEPS; s++) {
    c->x[s] = malloc((size_t)n * sizeof(float));
    c->dy[s] = malloc((size_t)n * sizeof(float));
    /* An offset mean, so that the statistics are not those of centred data. */
    fill_uniform(c->x[s], n, 0.5f + c->shift, 3.0f + c->shift, 100 + (uint64_t)s);
    fill_uniform(c->dy[s], n, -1.0f, 1.0f, 200 + (uint64_t)s);
  }
  fill_uniform(c->weight_init, c->C, 0.5f, 1.5f, 300);
  fill_uniform(c->bias_init, c->C, -0.5f, 0.5f, 301);
  fill_uniform(c->rm_init, c->C, -0.2f, 0.2f, 302);
  fill_uniform(c->rv_init, c->C, 0.8f, 1.2f, 303);
  c->y = calloc((size_t)n, sizeof(float));
  c->dx = calloc((size_t)n, sizeof(float));
  if (c->finite_differences) {
    c->loss_plus = calloc((size_t)(n * c->world), sizeof(double));
    c->loss_minus = calloc((size_t)(n * c->world), sizeof(double));
  }
}

static void bn_teardown(bn_case *c) {
  for (int s = 0; s < STEPS; s++) free(c->x[s]), free(c->dy[s]);
  free(c->y);
  free(c->dx);
  free(c->loss_plus);
  free(c->loss_minus);
}

static void make_shape(const bn_case *c, int64_t rows, int64_t shape[4]) {
  shape[0] = rows;
  shape[1] = c->C;
  shape[2] = c->H;
  shape[3] = c->W;
}

static double dot(const float *a, const float *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
  return s;
}

/* One rank: STEPS synchronized forward+backward passes on its slice, then
 * (optionally) the finite-difference sweep over every element of the batch. */
static void bn_rank(ct_rank *self) {
  bn_case *c = self->world->user;
  int r = self->rank;
  int64_t off = row_offset(c, r) * c->sample, rows = c->n[r], len = rows * c->sample;
  float *xbuf = calloc((size_t)len + 1, sizeof(float));
  float *dxbuf = calloc((size_t)len + 1, sizeof(float));
  int64_t shape[4], cshape = c->C;
  make_shape(c, rows, shape);
  ddp_tensor x, w, b, rm, rv;
  CT_OK(self, ddp_tensor_wrap(&x, DDP_FLOAT32, c->ndim, shape, xbuf));
  CT_OK(self, ddp_tensor_wrap(&w, DDP_FLOAT32, 1, &cshape, c->weight_init));
  CT_OK(self, ddp_tensor_wrap(&b, DDP_FLOAT32, 1, &cshape, c->bias_init));
  CT_OK(self, ddp_tensor_wrap(&rm, DDP_FLOAT32, 1, &cshape, c->rm[r]));
  CT_OK(self, ddp_tensor_wrap(&rv, DDP_FLOAT32, 1, &cshape, c->rv[r]));
  memcpy(c->rm[r], c->rm_init, sizeof c->rm_init);
  memcpy(c->rv[r], c->rv_init, sizeof c->rv_init);
  x.flags = w.flags = b.flags = DDP_TENSOR_REQUIRES_GRAD;
  x.grad = dxbuf;
  w.grad = c->dweight[r];
  b.grad = c->dbias[r];
  ddp_tape *tape;
  CT_OK(self, ddp_tape_create(&tape, 1 << 16));
  ddp_batch_norm_sync sync = ddp_batch_norm_sync_for_group(self->pg);

  ddp_tensor *y = NULL;
  for (int s = 0; s < STEPS; s++) {
    memcpy(xbuf, c->x[s] + off, (size_t)len * sizeof(float));
    memset(dxbuf, 0, (size_t)len * sizeof(float));
    ddp_tape_reset(tape);
    CT_OK(self, ddp_sync_batch_norm(tape, &x, &w, &b, &rm, &rv, &c->nbt[r], true, MOMENTUM, EPS,
                                    &sync, &y));
    CT_OK(self, ddp__backward_from(tape, y, c->dy[s] + off));
  }
  memcpy(c->y + off, y->data, (size_t)len * sizeof(float));
  memcpy(c->dx + off, dxbuf, (size_t)len * sizeof(float));

  if (c->finite_differences) {
    /* L = sum over ranks of dot(dy, y) with the last step's x and dy. The
     * running stats are left out (NULL), so the sweep does not move them.
     * Every forward is a collective, so the ranks walk j in lockstep. */
    const double h = 1e-2;
    const float *proj = c->dy[STEPS - 1] + off;
    ddp_tape_set_grad_enabled(tape, false);
    int64_t total = c->ntot * c->sample;
    for (int64_t j = 0; j < total; j++) {
      bool mine = j >= off && j < off + len;
      float keep = mine ? xbuf[j - off] : 0;
      for (int sign = 0; sign < 2; sign++) {
        if (mine) xbuf[j - off] = (float)(keep + (sign ? -h : h));
        ddp_tape_reset(tape);
        CT_OK(self, ddp_sync_batch_norm(tape, &x, &w, &b, NULL, NULL, NULL, true, MOMENTUM, EPS,
                                        &sync, &y));
        double l = dot(proj, y->data, len);
        (sign ? c->loss_minus : c->loss_plus)[j * c->world + r] = l;
      }
      if (mine) xbuf[j - off] = keep;
    }
  }
  ddp_tape_destroy(tape);
  free(xbuf);
  free(dxbuf);
}

/* The reference: one plain batch norm on the concatenated batch, the same steps. */
typedef struct bn_reference {
  float *y, *dx;
  float dweight[8], dbias[8], rm[8], rv[8];
  int64_t nbt;
} bn_reference;

static void bn_reference_run(const bn_case *c, bn_reference *ref) {
  int64_t n = c->ntot * c->sample, shape[4], cshape = c->C;
  make_shape(c, c->ntot, shape);
  ref->y = calloc((size_t)n, sizeof(float));
  ref->dx = calloc((size_t)n, sizeof(float));
  float *xbuf = calloc((size_t)n, sizeof(float));
  memset(ref->dweight, 0, sizeof ref->dweight);
  memset(ref->dbias, 0, sizeof ref->dbias);
  memcpy(ref->rm, c->rm_init, sizeof ref->rm);
  memcpy(ref->rv, c->rv_init, sizeof ref->rv);
  ref->nbt = 0;
  ddp_tensor x, w, b, rm, rv;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, c->ndim, shape, xbuf), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&w, DDP_FLOAT32, 1, &cshape, (void *)c->weight_init), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&b, DDP_FLOAT32, 1, &cshape, (void *)c->bias_init), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&rm, DDP_FLOAT32, 1, &cshape, ref->rm), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&rv, DDP_FLOAT32, 1, &cshape, ref->rv), DDP_OK);
  x.flags = w.flags = b.flags = DDP_TENSOR_REQUIRES_GRAD;
  x.grad = ref->dx;
  w.grad = ref->dweight;
  b.grad = ref->dbias;
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  ddp_tensor *y = NULL;
  for (int s = 0; s < STEPS; s++) {
    memcpy(xbuf, c->x[s], (size_t)n * sizeof(float));
    memset(ref->dx, 0, (size_t)n * sizeof(float));
    ddp_tape_reset(tape);
    assert_int_equal(ddp_batch_norm(tape, &x, &w, &b, &rm, &rv, &ref->nbt, true, MOMENTUM, EPS,
                                    &y),
                     DDP_OK);
    assert_int_equal(ddp__backward_from(tape, y, c->dy[s]), DDP_OK);
  }
  memcpy(ref->y, y->data, (size_t)n * sizeof(float));
  ddp_tape_destroy(tape);
  free(xbuf);
}

static void run_bn_case(bn_case *c) {
  bn_setup(c);
  bn_reference ref;
  bn_reference_run(c, &ref);
  int rc = ct_run(c->world, TIMEOUT_S, bn_rank, c);
  if (rc == 2) {
    bn_teardown(c);
    free(ref.y);
    free(ref.dx);
    fprintf(stderr, "SKIP %s: no process-group backend for threads here\n", c->name);
    skip();
  }
  assert_int_equal(rc, 0);

  int64_t n = c->ntot * c->sample;
  char what[128];
  snprintf(what, sizeof what, "%s: y", c->name);
  assert_int_equal(allclose(what, c->y, ref.y, n, 1e-5, 1e-6), 0);
  snprintf(what, sizeof what, "%s: dx", c->name);
  assert_int_equal(allclose(what, c->dx, ref.dx, n, 1e-5, 1e-6), 0);
  /* Each rank holds its share of dweight/dbias; the sum is the batch's. */
  float dw[8] = {0}, db[8] = {0};
  for (int r = 0; r < c->world; r++)
    for (int64_t k = 0; k < c->C; k++) dw[k] += c->dweight[r][k], db[k] += c->dbias[r][k];
  snprintf(what, sizeof what, "%s: sum of dweight", c->name);
  assert_int_equal(allclose(what, dw, ref.dweight, c->C, 1e-5, 1e-6), 0);
  snprintf(what, sizeof what, "%s: sum of dbias", c->name);
  assert_int_equal(allclose(what, db, ref.dbias, c->C, 1e-5, 1e-6), 0);
  for (int r = 0; r < c->world; r++) {
    snprintf(what, sizeof what, "%s: rank %d running_mean", c->name, r);
    assert_int_equal(allclose(what, c->rm[r], ref.rm, c->C, 1e-6, 1e-7), 0);
    snprintf(what, sizeof what, "%s: rank %d running_var", c->name, r);
    assert_int_equal(allclose(what, c->rv[r], ref.rv, c->C, 1e-6, 1e-7), 0);
    assert_int_equal(c->nbt[r], ref.nbt);
    /* Identical on every rank, not only close to the reference. */
    assert_memory_equal(c->rm[r], c->rm[0], (size_t)c->C * sizeof(float));
    assert_memory_equal(c->rv[r], c->rv[0], (size_t)c->C * sizeof(float));
  }
  assert_int_equal(ref.nbt, STEPS);

  if (c->finite_differences) {
    /* dx of the last step from the ranks vs (L(x + h e_j) - L(x - h e_j)) / 2h. */
    float *fd = malloc((size_t)n * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
      double d = 0;
      for (int r = 0; r < c->world; r++)
        d += c->loss_plus[j * c->world + r] - c->loss_minus[j * c->world + r];
      fd[j] = (float)(d / 2e-2);
    }
    snprintf(what, sizeof what, "%s: dx vs finite differences", c->name);
    assert_int_equal(allclose(what, c->dx, fd, n, 5e-3, 1e-3), 0);
    free(fd);
  }
  free(ref.y);
  free(ref.dx);
  bn_teardown(c);
}

static void test_two_ranks_equal(void **state) {
  (void)state;
  bn_case c = {.name = "W=2 (4,4) 4-D", .world = 2, .n = {4, 4}, .ndim = 4, .C = 3, .H = 5, .W = 7};
  run_bn_case(&c);
}

static void test_three_ranks_equal(void **state) {
  (void)state;
  bn_case c = {.name = "W=3 (3,3,3) 4-D", .world = 3, .n = {3, 3, 3}, .ndim = 4, .C = 5, .H = 4,
               .W = 4};
  run_bn_case(&c);
}

/* Unequal slices, one of a single row and one empty: the counts decide the
 * weights of each rank's statistics. */
static void test_three_ranks_unequal(void **state) {
  (void)state;
  bn_case c = {.name = "W=3 (5,1,2) 4-D", .world = 3, .n = {5, 1, 2}, .ndim = 4, .C = 4, .H = 3,
               .W = 6};
  run_bn_case(&c);
  /* Statistics keep their precision with a mean 1000 times the spread
   * (the sums are double; docs/nn.md says where the rounding is). */
  bn_case f = {.name = "W=2 (3,2) 4-D near 1000", .world = 2, .n = {3, 2}, .ndim = 4, .C = 3,
               .H = 4, .W = 5, .shift = 1000.0f};
  run_bn_case(&f);
  bn_case e = {.name = "W=3 (4,0,3) 4-D", .world = 3, .n = {4, 0, 3}, .ndim = 4, .C = 2, .H = 3,
               .W = 3};
  run_bn_case(&e);
}

/* (N, C) input takes the kernels' row-wise path; one rank holds one row. */
static void test_two_ranks_rows(void **state) {
  (void)state;
  bn_case c = {.name = "W=2 (1,6) 2-D", .world = 2, .n = {1, 6}, .ndim = 2, .C = 7};
  run_bn_case(&c);
}

static void test_finite_differences(void **state) {
  (void)state;
  bn_case c = {.name = "W=2 (2,3) finite differences", .world = 2, .n = {2, 3}, .ndim = 4, .C = 3,
               .H = 2, .W = 2, .finite_differences = true};
  run_bn_case(&c);
  bn_case d = {.name = "W=3 (1,2,2) 2-D finite differences", .world = 3, .n = {1, 2, 2},
               .ndim = 2, .C = 4, .finite_differences = true};
  run_bn_case(&d);
}

/* ---- the sync interface on one thread --------------------------------------
 * A sync whose "other ranks" are simulated: it adds `extra` (what the other
 * ranks would contribute) and counts its calls, or fails. */
typedef struct fake_sync {
  int calls;
  ddp_status fail_with;
} fake_sync;

static ddp_status fake_allreduce(void *user, double *buf, size_t count) {
  fake_sync *f = user;
  (void)buf;
  (void)count;
  f->calls++;
  if (f->fail_with != DDP_OK) return ddp_error(f->fail_with, "fake peer failure");
  return DDP_OK; /* a world of one: the sum is this rank's own */
}

/* Evaluation is plain batch norm with running stats and never communicates;
 * a world of one is plain batch norm in training too. */
static void test_eval_and_world_of_one(void **state) {
  (void)state;
  int64_t shape[4] = {3, 2, 2, 2}, cs = 2;
  ddp_tensor *x = gradcheck_random(4, shape, -1, 2, 5, false);
  float wv[2] = {1.2f, 0.7f}, bv[2] = {0.1f, -0.3f};
  float rm_a[2] = {0.3f, -0.1f}, rv_a[2] = {1.5f, 0.6f}, rm_b[2], rv_b[2];
  memcpy(rm_b, rm_a, sizeof rm_a);
  memcpy(rv_b, rv_a, sizeof rv_a);
  ddp_tensor w, b, rma, rva, rmb, rvb;
  ddp_tensor_wrap(&w, DDP_FLOAT32, 1, &cs, wv);
  ddp_tensor_wrap(&b, DDP_FLOAT32, 1, &cs, bv);
  ddp_tensor_wrap(&rma, DDP_FLOAT32, 1, &cs, rm_a);
  ddp_tensor_wrap(&rva, DDP_FLOAT32, 1, &cs, rv_a);
  ddp_tensor_wrap(&rmb, DDP_FLOAT32, 1, &cs, rm_b);
  ddp_tensor_wrap(&rvb, DDP_FLOAT32, 1, &cs, rv_b);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 14), DDP_OK);
  fake_sync f = {0};
  ddp_batch_norm_sync sync = {.allreduce_sum = fake_allreduce, .user = &f};
  for (int training = 0; training < 2; training++) {
    int64_t nbt_a = 0, nbt_b = 0;
    ddp_tensor *ya, *yb;
    ddp_tape_reset(tape);
    assert_int_equal(ddp_sync_batch_norm(tape, x, &w, &b, &rma, &rva, &nbt_a, training, MOMENTUM,
                                         EPS, &sync, &ya),
                     DDP_OK);
    assert_int_equal(f.calls, training ? 1 : 0);
    assert_int_equal(ddp_batch_norm(tape, x, &w, &b, &rmb, &rvb, &nbt_b, training, MOMENTUM, EPS,
                                    &yb),
                     DDP_OK);
    assert_int_equal(allclose("world of one: y", ya->data, yb->data, x->numel, 1e-6, 1e-7), 0);
    assert_int_equal(allclose("world of one: running_var", rv_a, rv_b, 2, 1e-6, 1e-7), 0);
    assert_int_equal(nbt_a, nbt_b);
  }
  ddp_tape_destroy(tape);
  ddp_tensor_destroy(x);
}

/* The callback's failure is the op's (forward and backward), wrapped with
 * what was being reduced; too few values across all ranks is an error too. */
static void test_errors(void **state) {
  (void)state;
  int64_t shape[4] = {2, 3, 2, 2};
  ddp_tensor *x = gradcheck_random(4, shape, -1, 1, 6, true);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 14), DDP_OK);
  fake_sync f = {.fail_with = DDP_ERR_PEER};
  ddp_batch_norm_sync sync = {.allreduce_sum = fake_allreduce, .user = &f};
  ddp_tensor *y;
  assert_int_equal(ddp_sync_batch_norm(tape, x, NULL, NULL, NULL, NULL, NULL, true, MOMENTUM, EPS,
                                       &sync, &y),
                   DDP_ERR_PEER);
  assert_non_null(strstr(ddp_last_error(), "sync_batch_norm"));
  assert_non_null(strstr(ddp_last_error(), "fake peer failure"));

  /* Forward succeeds, backward's reduction fails. */
  f.fail_with = DDP_OK;
  ddp_tape_reset(tape);
  assert_int_equal(ddp_sync_batch_norm(tape, x, NULL, NULL, NULL, NULL, NULL, true, MOMENTUM, EPS,
                                       &sync, &y),
                   DDP_OK);
  f.fail_with = DDP_ERR_TIMEOUT;
  float *seed = calloc((size_t)y->numel, sizeof(float));
  assert_int_equal(ddp__backward_from(tape, y, seed), DDP_ERR_TIMEOUT);
  assert_non_null(strstr(ddp_last_error(), "backward of sync_batch_norm"));
  free(seed);

  /* One value per channel in all (a world of one with one row of (N, C)). */
  int64_t one_row[2] = {1, 3};
  ddp_tensor *x1 = gradcheck_random(2, one_row, -1, 1, 7, false);
  f.fail_with = DDP_OK;
  ddp_tape_reset(tape);
  assert_int_equal(ddp_sync_batch_norm(tape, x1, NULL, NULL, NULL, NULL, NULL, true, MOMENTUM,
                                       EPS, &sync, &y),
                   DDP_ERR_SHAPE);
  assert_non_null(strstr(ddp_last_error(), "more than 1 value per channel across all ranks"));
  /* A sync without a function is a caller's mistake. */
  ddp_batch_norm_sync empty = {0};
  assert_int_equal(ddp_sync_batch_norm(tape, x, NULL, NULL, NULL, NULL, NULL, true, MOMENTUM, EPS,
                                       &empty, &y),
                   DDP_ERR_INVALID);
  ddp_tensor_destroy(x1);
  ddp_tensor_destroy(x);
  ddp_tape_destroy(tape);
}

/* ---- the ConvNet converted to SyncBatchNorm ------------------------------- */

#define NET_SEED 11
#define NET_B 6 /* rows per rank */

typedef struct net_case {
  int world;
  float *x;       /* (world * NET_B, 1, 28, 28) */
  int64_t *labels; /* (world * NET_B) */
  float *grads[MAX_W], *buffers[MAX_W];
  int64_t nbt[MAX_W][2];
  float loss[MAX_W];
  /* The allocation test: calls to the allocator during the measured steps. */
  bool count_allocations;
  uint64_t allocations;
} net_case;

static int64_t sample_floats(void) { return 28 * 28; }

static void net_step(ct_rank *self, ddp_model *model, ddp_tape *tape, ddp_tensor *x,
                     ddp_tensor *labels, float *loss_out) {
  ddp_tensor *out, *loss;
  ddp_tape_reset(tape);
  ddp_model_zero_grad(model);
  CT_OK(self, ddp_model_forward(model, tape, x, &out));
  CT_OK(self, ddp_model_loss(model, tape, out, labels, &loss));
  CT_OK(self, ddp_backward(tape, loss));
  *loss_out = ddp_tensor_f32(loss)[0];
}

static void net_rank(ct_rank *self) {
  net_case *c = self->world->user;
  int r = self->rank;
  ddp_model *model;
  CT_OK(self, ddp_model_build("convnet", NULL, NET_SEED, &model));
  CT_OK(self, ddp_model_convert_sync_batchnorm(model, self->pg));
  CT_CHECK(self, ddp_model_batch_norm_synced(model), "convert did not sync the model");
  ddp_tape *tape;
  CT_OK(self, ddp_tape_create(&tape, 1 << 16));
  int64_t xs[4] = {NET_B, 1, 28, 28}, ys = NET_B;
  ddp_tensor x, labels;
  CT_OK(self, ddp_tensor_wrap(&x, DDP_FLOAT32, 4, xs, c->x + r * NET_B * sample_floats()));
  CT_OK(self, ddp_tensor_wrap(&labels, DDP_INT64, 1, &ys, c->labels + r * NET_B));
  if (c->count_allocations) {
    /* Warm up (the arena grows, the group's work pool fills), then count
     * the allocator calls of every thread during three more steps. */
    float loss;
    for (int s = 0; s < 3; s++) net_step(self, model, tape, &x, &labels, &loss);
    ct_sync(self);
    uint64_t before = ddp_alloc_count();
    ct_sync(self);
    for (int s = 0; s < 3; s++) net_step(self, model, tape, &x, &labels, &loss);
    ct_sync(self);
    if (r == 0) c->allocations = ddp_alloc_count() - before;
  } else {
    net_step(self, model, tape, &x, &labels, &c->loss[r]);
    int64_t n = ddp_model_num_param_elements(model), nb = ddp_model_num_buffer_elements(model);
    memcpy(c->grads[r], ddp_model_grads_flat(model), (size_t)n * sizeof(float));
    memcpy(c->buffers[r], ddp_model_buffers_flat(model), (size_t)nb * sizeof(float));
    memcpy(c->nbt[r], ddp_model_counters(model), 2 * sizeof(int64_t));
  }
  ddp_tape_destroy(tape);
  ddp_model_destroy(model);
}

static void net_data(net_case *c) {
  int64_t rows = c->world * NET_B;
  c->x = malloc((size_t)(rows * sample_floats()) * sizeof(float));
  c->labels = malloc((size_t)rows * sizeof(int64_t));
  fill_uniform(c->x, rows * sample_floats(), 0.0f, 1.0f, 400);
  for (int64_t i = 0; i < rows; i++) c->labels[i] = (i * 7 + 3) % 10;
}

/* The comparison: max|a - b| <= 1e-4 * max|b| + 1e-6 per tensor. */
static void run_convnet_case(int world) {
  net_case c = {.world = world};
  net_data(&c);
  ddp_model *ref;
  assert_int_equal(ddp_model_build("convnet", NULL, NET_SEED, &ref), DDP_OK);
  int64_t n = ddp_model_num_param_elements(ref), nb = ddp_model_num_buffer_elements(ref);
  for (int r = 0; r < world; r++) {
    c.grads[r] = malloc((size_t)n * sizeof(float));
    c.buffers[r] = malloc((size_t)nb * sizeof(float));
  }
  int rc = ct_run(world, TIMEOUT_S, net_rank, &c);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);

  /* The single run on the full batch. */
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  int64_t xs[4] = {world * NET_B, 1, 28, 28}, ys = world * NET_B;
  ddp_tensor x, labels, *out, *loss;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 4, xs, c.x), DDP_OK);
  assert_int_equal(ddp_tensor_wrap(&labels, DDP_INT64, 1, &ys, c.labels), DDP_OK);
  assert_int_equal(ddp_model_forward(ref, tape, &x, &out), DDP_OK);
  assert_int_equal(ddp_model_loss(ref, tape, out, &labels, &loss), DDP_OK);
  assert_int_equal(ddp_backward(tape, loss), DDP_OK);

  /* DDP averages per-rank gradients of per-rank mean losses: (sum_r g_r) / W. */
  float *avg = calloc((size_t)n, sizeof(float));
  for (int r = 0; r < world; r++)
    for (int64_t i = 0; i < n; i++) avg[i] += c.grads[r][i];
  for (int64_t i = 0; i < n; i++) avg[i] /= (float)world;
  for (int p = 0; p < ddp_model_num_params(ref); p++) {
    int64_t off = ddp_model_param_offset(ref, p), len = ddp_model_param(ref, p)->numel;
    char what[128];
    snprintf(what, sizeof what, "W=%d convnet grad %s", world, ddp_model_param_name(ref, p));
    assert_int_equal(allclose(what, avg + off, ddp_model_grads_flat(ref) + off, len, 1e-4, 1e-6),
                     0);
  }
  for (int r = 0; r < world; r++) {
    char what[128];
    snprintf(what, sizeof what, "W=%d convnet running stats, rank %d", world, r);
    assert_int_equal(allclose(what, c.buffers[r], ddp_model_buffers_flat(ref), nb, 1e-5, 1e-7), 0);
    assert_memory_equal(c.nbt[r], ddp_model_counters(ref), 2 * sizeof(int64_t));
  }
  double mean_loss = 0;
  for (int r = 0; r < world; r++) mean_loss += c.loss[r] / world;
  assert_true(fabs(mean_loss - ddp_tensor_f32(loss)[0]) <= 1e-5 * fabs(ddp_tensor_f32(loss)[0]));

  free(avg);
  for (int r = 0; r < world; r++) free(c.grads[r]), free(c.buffers[r]);
  ddp_tape_destroy(tape);
  ddp_model_destroy(ref);
  free(c.x);
  free(c.labels);
}

static void test_convnet_two_ranks(void **state) {
  (void)state;
  run_convnet_case(2);
}

static void test_convnet_three_ranks(void **state) {
  (void)state;
  run_convnet_case(3);
}

/* Converting changes no name and no value; describe says SyncBatchNorm;
 * evaluation of the converted model is the plain model's, with no
 * communication (a world of one over a group would hide that, so the model
 * is synced through a sync that counts its calls). */
static void test_convert_keeps_state_and_eval(void **state) {
  (void)state;
  ddp_model *a, *b;
  assert_int_equal(ddp_model_build("convnet", NULL, 3, &a), DDP_OK);
  assert_int_equal(ddp_model_build("convnet", NULL, 3, &b), DDP_OK);
  fake_sync f = {0};
  ddp_batch_norm_sync sync = {.allreduce_sum = fake_allreduce, .user = &f};
  ddp_model_set_batch_norm_sync(b, &sync);
  assert_true(ddp_model_batch_norm_synced(b));
  assert_int_equal(ddp_model_state_count(a), ddp_model_state_count(b));
  for (int i = 0; i < ddp_model_state_count(a); i++) {
    ddp_state_entry ea, eb;
    assert_int_equal(ddp_model_state_entry(a, i, &ea), DDP_OK);
    assert_int_equal(ddp_model_state_entry(b, i, &eb), DDP_OK);
    assert_string_equal(ea.name, eb.name);
    assert_int_equal(ea.numel, eb.numel);
  }
  char text[2048];
  ddp_model_describe(b, text, sizeof text);
  assert_non_null(strstr(text, "(1): SyncBatchNorm(16, eps=1e-05, momentum=0.1"));
  ddp_model_describe(a, text, sizeof text);
  assert_null(strstr(text, "SyncBatchNorm"));

  /* Give the running stats something to say, then evaluate both. */
  float *bufs = ddp_model_buffers_flat(a);
  fill_uniform(bufs, ddp_model_num_buffer_elements(a), 0.2f, 1.5f, 9);
  memcpy(ddp_model_buffers_flat(b), bufs,
         (size_t)ddp_model_num_buffer_elements(a) * sizeof(float));
  ddp_model_train(a, false);
  ddp_model_train(b, false);
  float xv[4 * 28 * 28];
  fill_uniform(xv, 4 * 28 * 28, 0, 1, 10);
  int64_t xs[4] = {4, 1, 28, 28};
  ddp_tensor x, *ya, *yb;
  assert_int_equal(ddp_tensor_wrap(&x, DDP_FLOAT32, 4, xs, xv), DDP_OK);
  ddp_tape *tape;
  assert_int_equal(ddp_tape_create(&tape, 1 << 16), DDP_OK);
  assert_int_equal(ddp_model_forward(a, tape, &x, &ya), DDP_OK);
  assert_int_equal(ddp_model_forward(b, tape, &x, &yb), DDP_OK);
  assert_memory_equal(ya->data, yb->data, (size_t)ya->numel * sizeof(float));
  assert_int_equal(f.calls, 0);
  /* In training it communicates once per BatchNorm forward... */
  ddp_model_train(b, true);
  ddp_tape_reset(tape);
  assert_int_equal(ddp_model_forward(b, tape, &x, &yb), DDP_OK);
  assert_int_equal(f.calls, 2);
  /* ...and unsynced it does not. */
  ddp_model_set_batch_norm_sync(b, NULL);
  assert_false(ddp_model_batch_norm_synced(b));
  ddp_tape_reset(tape);
  assert_int_equal(ddp_model_forward(b, tape, &x, &yb), DDP_OK);
  assert_int_equal(f.calls, 2);
  ddp_tape_destroy(tape);
  ddp_model_destroy(a);
  ddp_model_destroy(b);
}

/* A synchronized training step allocates nothing once warm: the reductions'
 * buffers come from the tape's arena, the group's work handles from its pool. */
static void test_step_allocates_nothing(void **state) {
  (void)state;
  net_case c = {.world = 2, .count_allocations = true};
  net_data(&c);
  int rc = ct_run(2, TIMEOUT_S, net_rank, &c);
  free(c.x);
  free(c.labels);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
  if (c.allocations) fprintf(stderr, "%llu allocations in 3 synced steps\n",
                             (unsigned long long)c.allocations);
  assert_int_equal(c.allocations, 0);
}

/* Join (uneven inputs) cannot shadow SyncBatchNorm's collectives: both
 * join calls refuse a synced model with an error that says what to do. */
static void join_rank(ct_rank *self) {
  ddp_model *model;
  CT_OK(self, ddp_model_build("convnet", NULL, 1, &model));
  ddp_dp_options o = ddp_dp_defaults();
  ddp_dp *dp;
  CT_OK(self, ddp_dp_create(&dp, model, self->pg, &o));
  CT_OK(self, ddp_model_convert_sync_batchnorm(model, self->pg));
  ddp_status s = ddp_dp_join_enable(dp, true);
  CT_CHECK(self, s == DDP_ERR_UNSUPPORTED, "join_enable on a synced model: %s",
           ddp_status_name(s));
  CT_CHECK(self, strstr(ddp_last_error(), "SyncBatchNorm"), "message: %s", ddp_last_error());
  /* Unsynced it is accepted; synced again, join itself refuses. */
  CT_OK(self, ddp_model_convert_sync_batchnorm(model, NULL));
  CT_OK(self, ddp_dp_join_enable(dp, true));
  CT_OK(self, ddp_model_convert_sync_batchnorm(model, self->pg));
  s = ddp_dp_join(dp);
  CT_CHECK(self, s == DDP_ERR_UNSUPPORTED, "join on a synced model: %s", ddp_status_name(s));
  ddp_dp_destroy(dp);
  ddp_model_destroy(model);
}

static void test_join_refuses_sync_batchnorm(void **state) {
  (void)state;
  int rc = ct_run(2, TIMEOUT_S, join_rank, NULL);
  if (rc == 2) skip();
  assert_int_equal(rc, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_ranks_equal),
      cmocka_unit_test(test_three_ranks_equal),
      cmocka_unit_test(test_three_ranks_unequal),
      cmocka_unit_test(test_two_ranks_rows),
      cmocka_unit_test(test_finite_differences),
      cmocka_unit_test(test_eval_and_world_of_one),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_convert_keeps_state_and_eval),
      cmocka_unit_test(test_convnet_two_ranks),
      cmocka_unit_test(test_convnet_three_ranks),
      cmocka_unit_test(test_step_allocates_nothing),
      cmocka_unit_test(test_join_refuses_sync_batchnorm),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
