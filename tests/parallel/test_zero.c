/* ZeRO stages 1 and 2 (include/ddp/zero.h) against plain data parallelism
 * (the DDP wrapper with an unsharded optimizer) on the same data, ranks as
 * threads: the parameters of every rank and the whole optimizer state
 * (gathered from the shards) after N steps, bit for bit; for SGD with
 * Nesterov momentum and weight decay, Adam and Adadelta; the ConvNet at 2
 * and 4 ranks, the toy model at 3; with micro-batches; across the
 * wrapper's relayout with optimizer state that has values (a resumed run);
 * with gradient-norm clipping from the shards. Also against one process
 * with the whole batch (the independent reference, within the data-parallel
 * tests' bound), and each rank's optimizer state bytes against 1/W of the
 * unsharded.
 *
 * Why bitwise: stage 1 runs the very allreduce the wrapper runs and the
 * optimizers are elementwise. Stage 2 sums with reduces instead: at two
 * ranks a sum of two is one addition whatever the order; here the
 * threads backend also sums every small reduction in rank order (the
 * slots, docs/comm.md) and a large one from the owner's slice on, the same
 * for a reduce and an allreduce of a range split alike, so these cases are
 * bitwise at three and four ranks as well. Where a backend's orders differ
 * the bound is the gradient's last bit per step (docs/sharding.md).
 * Mutations seen to fail it: the stage-2 finish dividing only the bucket
 * that starts this rank's range (test_convnet_world2: 0.136 off), the state
 * not moved at the relayout (test_relayout_with_state: 0.0048 off). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "dp_test_util.h"

typedef enum { RUN_SINGLE, RUN_DDP, RUN_ZERO } run_kind;

typedef struct zcase {
  const char *model;
  int world, batch, steps, accum;
  int stage; /* RUN_ZERO's */
  ddp_optim_kind kind;
  double cap_mb;       /* 0: the wrapper's default */
  double clip;         /* > 0: clip the gradient norm to this */
  bool preload;        /* optimizer state with values before the first step */
  bool expect_relayout;
  /* Stage 2: the gradient ring must be in use (buckets small enough that
   * two hold less than the buffer), or must not (a graph it cannot hold). */
  bool expect_ring, no_ring;
  /* Results: every rank's parameters and (rank 0) the whole state, in
   * registration order; the clip's norms. */
  run_kind kind_run;
  float *params[DPT_MAX_RANKS];
  float *state;
  float *initial; /* rank 0's parameters before the first step */
  int64_t state_floats;
  double norms[64];
  int clipped;
  double state_ratio; /* ZeRO: this rank's state bytes * W / unsharded (rank 0) */
  int64_t released_pages[DPT_MAX_RANKS]; /* stage 3: pages checked given back after the steps */
  /* Stage 2: the gradient ring's bytes and the pages of the gradient
   * buffer outside the rank's range checked given back, per rank. */
  int64_t ring_bytes[DPT_MAX_RANKS], grad_released_pages[DPT_MAX_RANKS];
} zcase;

static ddp_optim_options optim_of(const zcase *c) {
  ddp_optim_options o = ddp_optim_defaults(c->kind);
  o.weight_decay = 1e-4;
  if (c->kind == DDP_OPTIM_SGD) {
    o.lr = strcmp(c->model, "toy") ? 0.01 : 0.05;
    o.sgd.momentum = 0.9;
    o.sgd.nesterov = true;
  } else if (c->kind == DDP_OPTIM_ADAM) {
    o.lr = 1e-3;
  }
  return o;
}

/* Deterministic state values for a resumed run: the same on every rank,
 * valid for the kind (Adam's second moment and Adadelta's averages >= 0). */
static ddp_status preload_state(ddp_optimizer *opt) {
  size_t n = ddp_optimizer_numel(opt);
  float *v = calloc(n, sizeof(float));
  ddp_rng rng;
  ddp_rng_seed(&rng, 77);
  ddp_status s = DDP_OK;
  for (size_t k = 0; k < ddp_optimizer_state_count(opt) && s == DDP_OK; k++) {
    ddp_optim_state st;
    s = ddp_optimizer_state_get(opt, k, &st);
    if (s != DDP_OK) break;
    if (st.is_scalar) {
      float step = 3;
      s = ddp_optimizer_state_load(opt, st.name, &step, 1);
      continue;
    }
    for (size_t i = 0; i < n; i++) v[i] = 1e-3f * fabsf(ddp_rng_normal(&rng));
    s = ddp_optimizer_state_load(opt, st.name, v, n);
  }
  free(v);
  return s;
}

/* Parameters (or a state buffer laid out like them) in registration order. */
static void by_name(ddp_model *m, const float *flat, float *out) {
  int64_t at = 0;
  for (int i = 0; i < ddp_model_num_params(m); i++) {
    int64_t len = ddp_model_param(m, i)->numel;
    memcpy(out + at, flat + ddp_model_param_offset(m, i), (size_t)len * sizeof(float));
    at += len;
  }
}

static void copy_state(zcase *c, ddp_model *m, ddp_optimizer *full) {
  int64_t n = ddp_model_num_param_elements(m), at = 0;
  size_t count = ddp_optimizer_state_count(full);
  c->state = calloc(count * (size_t)n + count, sizeof(float));
  for (size_t k = 0; k < count; k++) {
    ddp_optim_state st;
    if (ddp_optimizer_state_get(full, k, &st) != DDP_OK) continue;
    if (st.is_scalar) {
      c->state[at++] = st.data[0];
    } else {
      by_name(m, st.data, c->state + at);
      at += n;
    }
  }
  c->state_floats = at;
}

/* Stage 3, after the steps: every page of the parameter buffer that lies
 * wholly outside this rank's range [lo, hi) and inside one top-level
 * module (no module boundary strictly within it; the modules re-derived
 * here from the parameters' names) must not be resident (mincore): its
 * memory was given back. *released: how many such pages. */
static ddp_status check_released(ddp_model *m, int64_t lo, int64_t hi, int64_t *released) {
  const long page = sysconf(_SC_PAGESIZE);
  const int64_t n = ddp_model_num_param_elements(m);
  const uintptr_t base = (uintptr_t)ddp_model_params_flat(m);
  *released = 0;
  for (uintptr_t at = (base + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
       at + (uintptr_t)page <= base + (uintptr_t)n * sizeof(float); at += (uintptr_t)page) {
    const int64_t ps = (int64_t)(at - base) / 4, pe = ps + page / 4;
    if (pe > lo && ps < hi) continue; /* meets the rank's range */
    bool boundary = false;
    for (int i = 0; i < ddp_model_num_params(m) && !boundary; i++) {
      const char *name = ddp_model_param_name(m, i), *prev = i ? ddp_model_param_name(m, i - 1) : "";
      const size_t len = strcspn(name, "."), plen = strcspn(prev, ".");
      const int64_t off = ddp_model_param_offset(m, i);
      if ((i == 0 || len != plen || strncmp(name, prev, len)) && off > ps && off < pe) boundary = true;
    }
    if (boundary) continue;
    unsigned char resident = 0;
    if (mincore((void *)at, (size_t)page, &resident) != 0)
      return ddp_error(DDP_ERR_IO, "mincore failed");
    if (resident & 1)
      return ddp_error(DDP_ERR_STATE, "stage 3: floats [%lld, %lld) of the parameter buffer are "
                       "resident after the step, outside the range [%lld, %lld)",
                       (long long)ps, (long long)pe, (long long)lo, (long long)hi);
    (*released)++;
  }
  return DDP_OK;
}

/* Stage 2's gradient ring, after the steps: every whole page of the
 * gradient buffer outside this rank's range [lo, hi) must not be resident
 * (the ring took backward's writes; the pages were given back).
 * *released: how many such pages. */
static ddp_status check_grads_released(ddp_model *m, int64_t lo, int64_t hi, int64_t *released) {
  const long page = sysconf(_SC_PAGESIZE);
  const int64_t n = ddp_model_num_param_elements(m);
  const uintptr_t base = (uintptr_t)ddp_model_grads_flat(m);
  *released = 0;
  for (uintptr_t at = (base + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
       at + (uintptr_t)page <= base + (uintptr_t)n * sizeof(float); at += (uintptr_t)page) {
    const int64_t ps = (int64_t)(at - base) / 4, pe = ps + page / 4;
    if (pe > lo && ps < hi) continue; /* meets the rank's range */
    unsigned char resident = 0;
    if (mincore((void *)at, (size_t)page, &resident) != 0)
      return ddp_error(DDP_ERR_IO, "mincore failed");
    if (resident & 1)
      return ddp_error(DDP_ERR_STATE, "stage 2: floats [%lld, %lld) of the gradient buffer are "
                       "resident after the steps, outside the range [%lld, %lld)",
                       (long long)ps, (long long)pe, (long long)lo, (long long)hi);
    (*released)++;
  }
  return DDP_OK;
}

static void body(dpt_rank *self) {
  zcase *c = self->world->user;
  const bool single = c->kind_run == RUN_SINGLE;
  const int W = c->world, rank = self->rank;
  ddp_model *m;
  DPT_OK(self, ddp_model_build(c->model, NULL, 100 + (uint64_t)rank, &m));
  const int64_t n = ddp_model_num_param_elements(m);
  ddp_optim_options oo = optim_of(c);
  ddp_optimizer *opt = NULL;
  ddp_dp *dp = NULL;
  ddp_zero *z = NULL;
  ddp_tape *tape = NULL;
  ddp_status s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                                      (size_t)n);
  if (s == DDP_OK && c->preload) s = preload_state(opt);
  ddp_dp_options dpo = ddp_dp_defaults();
  if (c->cap_mb > 0) dpo.bucket_cap_mb = dpo.first_bucket_mb = c->cap_mb;
  if (s == DDP_OK && c->kind_run == RUN_DDP) {
    s = ddp_dp_create(&dp, m, self->pg, &dpo);
    if (s == DDP_OK) ddp_dp_set_optimizer(dp, opt);
  } else if (s == DDP_OK && c->kind_run == RUN_ZERO) {
    ddp_zero_options zo = ddp_zero_defaults(c->stage);
    zo.dp = dpo;
    s = ddp_zero_create(&z, m, self->pg, opt, &zo);
    if (s == DDP_OK) dp = ddp_zero_dp(z);
  }
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 20);
  if (s == DDP_OK && rank == 0) {
    c->initial = calloc((size_t)n, sizeof(float));
    by_name(m, ddp_model_params_flat(m), c->initial);
  }
  const int64_t B = c->batch, A = c->accum, rows = single ? (int64_t)W * B : B;
  const int64_t sn = dpt_sample_numel(c->model);
  float *xbuf = malloc((size_t)(rows * sn) * sizeof(float));
  float *ybuf = malloc((size_t)rows * 8 * 5);
  ddp_model_train(m, true);
  for (int t = 0; t < c->steps && s == DDP_OK; t++) {
    /* Under stage 2's ring, zero_grad is the range's (the rest is not kept). */
    if (z) ddp_zero_zero_grad(z);
    else ddp_model_zero_grad(m);
    for (int k = 0; k < (single ? 1 : A) && s == DDP_OK; k++) {
      ddp_tensor x, y, *out, *loss;
      if (single)
        dpt_batch(c->model, t, 0, 1, rows, xbuf, ybuf, &x, &y);
      else
        dpt_batch(c->model, t, k * W * B + rank, W, B, xbuf, ybuf, &x, &y);
      if (z) ddp_zero_set_no_sync(z, k < A - 1);
      else if (dp) ddp_dp_set_no_sync(dp, k < A - 1);
      ddp_tape_reset(tape);
      s = z ? ddp_zero_forward(z, tape, &x, &out)
            : dp ? ddp_dp_forward(dp, tape, &x, &out) : ddp_model_forward(m, tape, &x, &out);
      if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
      if (s == DDP_OK)
        s = z ? ddp_zero_backward(z, tape, loss)
              : dp ? ddp_dp_backward(dp, tape, loss) : ddp_backward(tape, loss);
    }
    if (s == DDP_OK && A > 1) {
      /* ZeRO: the range the optimizer steps (stage 2's ring keeps no more). */
      int64_t lo = 0, len = n;
      if (z) ddp_zero_range(z, rank, &lo, &len);
      float *g = ddp_model_grads_flat(m);
      for (int64_t i = lo; i < lo + len; i++) g[i] /= (float)A;
    }
    if (s == DDP_OK && c->clip > 0) {
      double norm = 0;
      s = z ? ddp_zero_clip_grad_norm(z, c->clip, &norm) : ddp_model_clip_grad_norm(m, c->clip, &norm);
      if (rank == 0 && t < 64) c->norms[t] = norm;
      if (rank == 0 && norm > c->clip) c->clipped++;
    }
    if (s == DDP_OK) s = z ? ddp_zero_step(z) : ddp_optimizer_step(opt);
  }
  free(xbuf);
  free(ybuf);
  if (s == DDP_OK && z && c->stage == 3) {
    int64_t lo, len;
    ddp_zero_range(z, rank, &lo, &len);
    s = check_released(m, lo, lo + len, &c->released_pages[rank]);
  }
  if (s == DDP_OK && z && c->stage == 2 && W > 1) {
    ddp_zero_memory mem;
    ddp_zero_get_memory(z, &mem);
    int64_t lo, len;
    ddp_zero_range(z, rank, &lo, &len);
    c->ring_bytes[rank] = mem.grad_ring_bytes;
    if (mem.grad_ring_bytes > 0) {
      /* The gradients held: the range and the ring, no more. */
      if (mem.grad_bytes != 4 * len + mem.grad_ring_bytes || mem.grad_owned_bytes != 4 * len)
        s = ddp_error(DDP_ERR_STATE, "stage 2 ring: grad_bytes %lld, owned %lld, ring %lld, range "
                      "%lld floats", (long long)mem.grad_bytes, (long long)mem.grad_owned_bytes,
                      (long long)mem.grad_ring_bytes, (long long)len);
      if (s == DDP_OK) s = check_grads_released(m, lo, lo + len, &c->grad_released_pages[rank]);
    }
  }
  /* Stage 3 holds only its range until asked for the whole model. */
  if (s == DDP_OK && z) s = ddp_zero_sync_params(z);
  if (s == DDP_OK) {
    c->params[rank] = calloc((size_t)n, sizeof(float));
    by_name(m, ddp_model_params_flat(m), c->params[rank]);
  }
  /* The whole state on rank 0: the unsharded optimizer's, or gathered. */
  ddp_optimizer *full = NULL;
  if (s == DDP_OK && z && rank == 0)
    s = ddp_optimizer_create(&full, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m), (size_t)n);
  if (s == DDP_OK && z) s = ddp_zero_gather_state(z, full, 0);
  if (s == DDP_OK && rank == 0) copy_state(c, m, z ? full : opt);
  if (s == DDP_OK && z && rank == 0) {
    ddp_zero_memory mem;
    ddp_zero_get_memory(z, &mem);
    c->state_ratio = (double)mem.optim_state_bytes * W / (double)mem.optim_state_unsharded_bytes;
    int64_t lo, len;
    ddp_zero_range(z, 0, &lo, &len);
    size_t buffers = c->kind == DDP_OPTIM_SGD ? 1 : 2;
    if (mem.optim_state_bytes != (int64_t)buffers * len * 4) s = DDP_ERR_STATE;
  }
  bool relaid = false;
  if (dp) {
    ddp_dp_trace tr;
    ddp_dp_get_trace(dp, &tr);
    relaid = tr.relaid_out;
  }
  ddp_optimizer_destroy(full);
  ddp_tape_destroy(tape);
  if (z) ddp_zero_destroy(z);
  else ddp_dp_destroy(dp);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_OK(self, s);
  if (c->expect_relayout && !single) DPT_CHECK(self, relaid, "no relayout happened");
}

static zcase run(zcase c, run_kind kind) {
  c.kind_run = kind;
  memset(c.params, 0, sizeof c.params);
  c.state = NULL;
  c.initial = NULL;
  if (kind == RUN_SINGLE) {
    /* One process: the body on a thread of a world of one, W * B rows. */
    assert_int_equal(dpt_run(1, 60, body, &c), 0);
  } else {
    assert_int_equal(dpt_run(c.world, 120, body, &c), 0);
  }
  return c;
}

static void free_case(zcase *c) {
  for (int r = 0; r < DPT_MAX_RANKS; r++) free(c->params[r]);
  free(c->state);
  free(c->initial);
}

/* Max |a - b| over n floats, and whether every bit is equal. */
static bool same_bits(const float *a, const float *b, int64_t n, double *maxdiff) {
  *maxdiff = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > *maxdiff || isnan(d)) *maxdiff = isnan(d) ? INFINITY : d;
  }
  return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static int64_t model_floats(const char *model) {
  ddp_model *m;
  assert_int_equal(ddp_model_build(model, NULL, 1, &m), DDP_OK);
  int64_t n = ddp_model_num_param_elements(m);
  ddp_model_destroy(m);
  return n;
}

/* ||a - b|| / ||b - b0||: the difference against what training moved. */
static double off_by(const float *a, const float *b, const float *b0, int64_t n) {
  double err = 0, moved = 0;
  for (int64_t i = 0; i < n; i++) {
    err += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    moved += ((double)b[i] - b0[i]) * ((double)b[i] - b0[i]);
  }
  return moved > 0 ? sqrt(err / moved) : INFINITY;
}

/* ZeRO at c.stage against plain data parallelism: every rank's parameters
 * and rank 0's whole optimizer state. Stage 1, and stage 2 at two ranks,
 * bit for bit. Stage 2 at more ranks: bit for bit where the backend adds
 * the ranks in the same order for the reduce as for the allreduce (small
 * buffers here; processes, whose every reduction is in rank order),
 * otherwise each averaged gradient may differ in its last bit, and the
 * parameters must stay within 1e-3 of what training moved them (measured:
 * 1e-6 to 1e-4; a gradient missing a rank or divided twice is 0.1 and up). */
static void check_equal_to_ddp(zcase c) {
  int64_t n = model_floats(c.model);
  zcase ref = run(c, RUN_DDP), got = run(c, RUN_ZERO);
  /* Stage 2's ring reduces every micro-batch and adds the averages: a
   * different order of the same sums than accumulating, then reducing. */
  const bool exact = (c.stage == 1 || c.world == 2) && !(c.stage == 2 && c.accum > 1);
  bool bitwise = true;
  double d, worst = 0;
  for (int r = 0; r < c.world; r++) {
    bool eq = same_bits(got.params[r], ref.params[0], n, &d);
    bitwise &= eq;
    if (!eq && exact)
      fail_msg("%s, world %d, stage %d, %s: rank %d's parameters differ from DDP's (max |diff| %.3g)",
               c.model, c.world, c.stage, ddp_optim_kind_name(c.kind), r, d);
    /* Every rank holds the same parameters (the gather), whatever the sums. */
    if (!same_bits(got.params[r], got.params[0], n, &d))
      fail_msg("rank %d's parameters differ from rank 0's after the gather (max |diff| %.3g)", r, d);
  }
  assert_int_equal(got.state_floats, ref.state_floats);
  bool state_eq = same_bits(got.state, ref.state, ref.state_floats, &d);
  if (!state_eq && exact)
    fail_msg("%s, world %d, stage %d, %s: the gathered optimizer state differs from DDP's (max "
             "|diff| %.3g)", c.model, c.world, c.stage, ddp_optim_kind_name(c.kind), d);
  if (!bitwise || !state_eq) {
    worst = off_by(got.params[0], ref.params[0], ref.initial, n);
    if (!(worst <= 1e-3))
      fail_msg("%s, world %d, stage %d, %s: ||zero - ddp|| / ||ddp - initial|| = %.3g > 1e-3",
               c.model, c.world, c.stage, ddp_optim_kind_name(c.kind), worst);
  }
  /* State bytes per rank: 1/W of the unsharded, within 5 %. */
  if (!(fabs(got.state_ratio - 1.0) <= 0.05))
    fail_msg("state bytes * W / unsharded = %.4f", got.state_ratio);
  if (c.clip > 0) {
    for (int t = 0; t < c.steps && t < 64; t++)
      if (!(fabs(got.norms[t] - ref.norms[t]) <= 1e-12 * ref.norms[t] || (!exact && fabs(got.norms[t] - ref.norms[t]) <= 1e-5 * ref.norms[t])))
        fail_msg("step %d: norm %.17g from the shards, %.17g whole", t, got.norms[t], ref.norms[t]);
    if (got.clipped == 0) fail_msg("the clip never acted (max_norm %g): the test proves nothing", c.clip);
  }
  char how[96];
  if (bitwise && state_eq)
    snprintf(how, sizeof how, "bitwise equal to DDP");
  else
    snprintf(how, sizeof how, "within %.2g of the update of DDP (reduction order)", worst);
  printf("  %s world %d stage %d %s%s%s: %d steps %s; state bytes x W / unsharded %.4f\n",
         c.model, c.world, c.stage, ddp_optim_kind_name(c.kind), c.accum > 1 ? " micro-batches" : "",
         c.preload ? " relayout with state" : "", c.steps, how, got.state_ratio);
  if (c.stage == 2 && c.world > 1 && c.expect_ring) {
    /* The ring must have been in use on every rank (after the relayout's
     * first step), holding at most two of the largest buckets. */
    for (int r = 0; r < c.world; r++)
      if (got.ring_bytes[r] <= 0 || got.ring_bytes[r] > 2 * 4 * n)
        fail_msg("stage 2: rank %d's gradient ring is %lld bytes (model %lld floats)", r,
                 (long long)got.ring_bytes[r], (long long)n);
    printf("    stage 2 ring: %lld bytes; pages of the gradient buffer given back, per rank:",
           (long long)got.ring_bytes[0]);
    for (int r = 0; r < c.world; r++) printf(" %lld", (long long)got.grad_released_pages[r]);
    printf("\n");
  }
  if (c.stage == 2 && c.no_ring)
    for (int r = 0; r < c.world; r++)
      if (got.ring_bytes[r] != 0) fail_msg("stage 2: rank %d used the ring on a graph it cannot hold", r);
  if (c.stage == 3) {
    /* The check must have had pages to look at: every rank gave some back. */
    for (int r = 0; r < c.world; r++)
      if (got.released_pages[r] <= 0)
        fail_msg("stage 3: rank %d had no page of other ranks' parameters to give back: the "
                 "model is too small for the check", r);
    printf("    stage 3: pages of parameters given back after the steps, per rank:");
    for (int r = 0; r < c.world; r++) printf(" %lld", (long long)got.released_pages[r]);
    printf("\n");
  }
  free_case(&ref);
  free_case(&got);
}

static zcase make(const char *model, int world, int stage, ddp_optim_kind kind, int steps) {
  zcase c = {.model = model, .world = world, .batch = 4, .steps = steps, .accum = 1,
             .stage = stage, .kind = kind, .expect_ring = stage == 2 && world > 1};
  return c;
}

static void test_convnet_world2(void **state) {
  (void)state;
  for (int stage = 1; stage <= 2; stage++) {
    check_equal_to_ddp(make("convnet", 2, stage, DDP_OPTIM_SGD, 20));
    check_equal_to_ddp(make("convnet", 2, stage, DDP_OPTIM_ADAM, 20));
  }
  /* Stage 2's ring with many buckets: each slot reused, waits placed by
   * the plan (the default cap makes the ConvNet one bucket). */
  for (int k = 0; k < 2; k++) {
    zcase c = make("convnet", 2, 2, k ? DDP_OPTIM_ADAM : DDP_OPTIM_SGD, 20);
    c.cap_mb = 0.01;
    check_equal_to_ddp(c);
  }
}

static void test_convnet_world4(void **state) {
  (void)state;
  for (int stage = 1; stage <= 2; stage++) {
    zcase c = make("convnet", 4, stage, stage == 1 ? DDP_OPTIM_SGD : DDP_OPTIM_ADAM, 20);
    c.batch = 2;
    check_equal_to_ddp(c);
  }
}

static void test_toy_world3_every_optimizer(void **state) {
  (void)state;
  for (int stage = 1; stage <= 2; stage++)
    for (int k = 0; k < DDP_OPTIM_KIND_COUNT; k++)
      check_equal_to_ddp(make("toy", 3, stage, (ddp_optim_kind)k, 20));
}

/* Small buckets: many buckets, each meeting one or two ranks' ranges. */
static void test_convnet_world3_small_buckets(void **state) {
  (void)state;
  zcase c = make("convnet", 3, 2, DDP_OPTIM_ADAM, 10);
  c.cap_mb = 0.01;
  check_equal_to_ddp(c);
}

/* Stage 2 with the ring reduces every micro-batch: within the bound of
 * data parallelism's accumulate-then-reduce, not bit for bit. */
static void test_microbatches(void **state) {
  (void)state;
  for (int stage = 1; stage <= 2; stage++) {
    zcase c = make("toy", 2, stage, DDP_OPTIM_SGD, 10);
    c.accum = 3;
    check_equal_to_ddp(c);
  }
  zcase c = make("convnet", 2, 2, DDP_OPTIM_ADAM, 10);
  c.accum = 3;
  c.cap_mb = 0.01;
  check_equal_to_ddp(c);
}

/* A graph the ring cannot hold: module a runs twice (a b a), so backward
 * writes a's gradients first and makes them final last; with a bucket per
 * parameter, a's bucket would be written before the one two earlier has
 * launched. The plan sees it before the first ring backward: the whole
 * buffer is kept, and stage 2 equals data parallelism bit for bit at two
 * ranks (both models built alike on each rank, fed the same batches). */
static ddp_status build_aba(ddp_model **out) {
  ddp_model *m;
  ddp_module *a, *b;
  DDP_TRY(ddp_model_create(&m));
  DDP_TRY(ddp_module_add_linear(m, NULL, "a", 10, 10, true, &a));
  DDP_TRY(ddp_module_add_linear(m, NULL, "b", 10, 10, true, &b));
  DDP_TRY(ddp_model_set_forward_order(m, 3, (ddp_module *const[]){a, b, a}));
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  DDP_TRY(ddp_model_finalize(m, 7));
  *out = m;
  return DDP_OK;
}

static void aba_body(dpt_rank *self) {
  ddp_model *m[2];
  ddp_optimizer *opt[2];
  DPT_OK(self, build_aba(&m[0]));
  DPT_OK(self, build_aba(&m[1]));
  const int64_t n = ddp_model_num_param_elements(m[0]);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_ADAM);
  for (int k = 0; k < 2; k++)
    DPT_OK(self, ddp_optimizer_create(&opt[k], &oo, ddp_model_params_flat(m[k]),
                                      ddp_model_grads_flat(m[k]), (size_t)n));
  ddp_dp_options dpo = ddp_dp_defaults();
  dpo.bucket_cap_mb = dpo.first_bucket_mb = 0.0001; /* a bucket per parameter */
  ddp_dp *dp;
  DPT_OK(self, ddp_dp_create(&dp, m[0], self->pg, &dpo));
  ddp_dp_set_optimizer(dp, opt[0]);
  ddp_zero *z;
  ddp_zero_options zo = ddp_zero_defaults(2);
  zo.dp = dpo;
  DPT_OK(self, ddp_zero_create(&z, m[1], self->pg, opt[1], &zo));
  ddp_tape *tape;
  DPT_OK(self, ddp_tape_create(&tape, 1 << 16));
  float xs[4 * 10], ys[4 * 10];
  ddp_status s = DDP_OK;
  for (int t = 0; t < 6 && s == DDP_OK; t++) {
    for (int i = 0; i < 40; i++) {
      xs[i] = (float)((i * 7 + t * 3 + self->rank * 5) % 11) / 11.0f - 0.5f;
      ys[i] = (float)((i * 5 + t + self->rank) % 7) / 7.0f;
    }
    for (int k = 0; k < 2 && s == DDP_OK; k++) {
      ddp_tensor x, y, *out, *loss;
      DPT_OK(self, ddp_tensor_wrap(&x, DDP_FLOAT32, 2, (int64_t[]){4, 10}, xs));
      DPT_OK(self, ddp_tensor_wrap(&y, DDP_FLOAT32, 2, (int64_t[]){4, 10}, ys));
      if (k == 0) ddp_model_zero_grad(m[0]);
      else s = ddp_zero_zero_grad(z);
      ddp_tape_reset(tape);
      if (s == DDP_OK) s = k == 0 ? ddp_dp_forward(dp, tape, &x, &out) : ddp_zero_forward(z, tape, &x, &out);
      if (s == DDP_OK) s = ddp_model_loss(m[k], tape, out, &y, &loss);
      if (s == DDP_OK) s = k == 0 ? ddp_dp_backward(dp, tape, loss) : ddp_zero_backward(z, tape, loss);
      if (s == DDP_OK) s = k == 0 ? ddp_optimizer_step(opt[0]) : ddp_zero_step(z);
    }
  }
  ddp_zero_memory mem;
  ddp_zero_get_memory(z, &mem);
  ddp_dp_trace tr;
  ddp_dp_get_trace(ddp_zero_dp(z), &tr);
  double d = 0;
  bool eq = s == DDP_OK && same_bits(ddp_model_params_flat(m[1]), ddp_model_params_flat(m[0]), n, &d);
  ddp_tape_destroy(tape);
  ddp_zero_destroy(z);
  ddp_dp_destroy(dp);
  for (int k = 0; k < 2; k++) {
    ddp_optimizer_destroy(opt[k]);
    ddp_model_destroy(m[k]);
  }
  DPT_OK(self, s);
  DPT_CHECK(self, eq, "a b a: stage 2 differs from data parallelism (max |diff| %.3g)", d);
  DPT_CHECK(self, mem.grad_ring_bytes == 0 && mem.grad_bytes == 4 * n,
            "a b a: the ring was used (%lld bytes) on a graph it cannot hold",
            (long long)mem.grad_ring_bytes);
}

static void test_ring_refuses_graph(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, aba_body, NULL), 0);
}

/* convnet-2 registers fc first but its gradient is ready first: the wrapper
 * re-lays out after the first backward, with Adam's state already holding
 * values, which must move to the ranks that own its new places. */
static void test_relayout_with_state(void **state) {
  (void)state;
  for (int world = 2; world <= 3; world++)
    for (int stage = 1; stage <= 2; stage++) {
      zcase c = make("convnet-2", world, stage, DDP_OPTIM_ADAM, 6);
      c.cap_mb = 0.002;
      c.preload = true;
      c.expect_relayout = true;
      check_equal_to_ddp(c);
    }
}

static void test_clip_grad_norm(void **state) {
  (void)state;
  zcase c = make("convnet", 2, 2, DDP_OPTIM_SGD, 10);
  c.clip = 0.5;
  check_equal_to_ddp(c);
  c = make("toy", 3, 2, DDP_OPTIM_ADAM, 10);
  c.clip = 0.3;
  check_equal_to_ddp(c);
}

/* Stage 3 (parameters sharded, gathered per top-level module): equal to
 * data parallelism as stage 2 is (bit for bit at two ranks), with the
 * pages of other ranks' parameters given back after every step. */
static void test_stage3(void **state) {
  (void)state;
  check_equal_to_ddp(make("convnet", 2, 3, DDP_OPTIM_SGD, 20));
  check_equal_to_ddp(make("convnet", 2, 3, DDP_OPTIM_ADAM, 20));
  zcase c = make("convnet", 4, 3, DDP_OPTIM_ADAM, 20);
  c.batch = 2;
  check_equal_to_ddp(c);
  c = make("convnet", 3, 3, DDP_OPTIM_ADADELTA, 10);
  check_equal_to_ddp(c);
  c = make("convnet", 2, 3, DDP_OPTIM_SGD, 10);
  c.accum = 3;
  check_equal_to_ddp(c);
  c = make("convnet", 2, 3, DDP_OPTIM_SGD, 10);
  c.clip = 0.5;
  check_equal_to_ddp(c);
  /* convnet-2 registers fc first and runs it last (a forward order): the
   * units are gathered in the order they run, not as registered. */
  c = make("convnet-2", 2, 3, DDP_OPTIM_ADAM, 10);
  check_equal_to_ddp(c);
}

/* The independent reference: one process with the whole batch of every
 * step, within the data-parallel tests' bound (the sums differ in order). */
static void test_against_one_process(void **state) {
  (void)state;
  for (int stage = 1; stage <= 2; stage++) {
    zcase c = make("toy", 2, stage, DDP_OPTIM_SGD, 10);
    zcase ref = run(c, RUN_SINGLE), got = run(c, RUN_ZERO);
    int64_t n = model_floats("toy");
    double diff = 0, mag = 0;
    for (int64_t i = 0; i < n; i++) {
      diff = fmax(diff, fabs((double)got.params[0][i] - ref.params[0][i]));
      mag = fmax(mag, fabs((double)ref.params[0][i]));
    }
    if (!(diff <= 1e-4 * mag + 1e-6)) fail_msg("stage %d vs one process: max|diff| %.3g, max %.3g", stage, diff, mag);
    free_case(&ref);
    free_case(&got);
  }
}

/* Refusals: a stage that is not there, an optimizer over other buffers. */
static void refuse_body(dpt_rank *self) {
  ddp_model *m;
  DPT_OK(self, ddp_model_build("toy", NULL, 1, &m));
  int64_t n = ddp_model_num_param_elements(m);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_ADAM);
  ddp_optimizer *opt, *half;
  DPT_OK(self, ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m), (size_t)n));
  DPT_OK(self, ddp_optimizer_create(&half, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m), (size_t)n / 2));
  ddp_zero *z = NULL;
  ddp_zero_options zo = ddp_zero_defaults(4);
  ddp_status s3 = ddp_zero_create(&z, m, self->pg, opt, &zo);
  zo.stage = 1;
  ddp_status sh = ddp_zero_create(&z, m, self->pg, half, &zo);
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ddp_last_error());
  ddp_optimizer_destroy(half);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_CHECK(self, s3 == DDP_ERR_INVALID && sh == DDP_ERR_INVALID && !z, "stage 4: %d, half: %d", s3, sh);
  DPT_CHECK(self, strstr(msg, "covers"), "message: %s", msg);
}

/* Stage 3 refuses what its gather-per-module order cannot serve: a
 * top-level module run twice in one forward with another between (A B A:
 * its backward would run with B released), and find_unused_parameters
 * (a parameter marked ready without a gradient never completes its module). */
static void refuse_stage3_body(dpt_rank *self) {
  ddp_model *m;
  ddp_module *a, *b;
  DPT_OK(self, ddp_model_create(&m));
  DPT_OK(self, ddp_module_add_linear(m, NULL, "a", 10, 10, true, &a));
  DPT_OK(self, ddp_module_add_linear(m, NULL, "b", 10, 10, true, &b));
  DPT_OK(self, ddp_model_set_forward_order(m, 3, (ddp_module *const[]){a, b, a}));
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  DPT_OK(self, ddp_model_finalize(m, 7));
  const int64_t n = ddp_model_num_param_elements(m);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  ddp_optimizer *opt;
  DPT_OK(self, ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m), (size_t)n));
  ddp_zero *z = NULL;
  ddp_zero_options zo = ddp_zero_defaults(3);
  zo.dp.find_unused_parameters = true;
  ddp_status su = ddp_zero_create(&z, m, self->pg, opt, &zo);
  char msg_unused[256];
  snprintf(msg_unused, sizeof msg_unused, "%s", ddp_last_error());
  zo.dp.find_unused_parameters = false;
  DPT_OK(self, ddp_zero_create(&z, m, self->pg, opt, &zo));
  ddp_tape *tape;
  DPT_OK(self, ddp_tape_create(&tape, 1 << 16));
  float xs[4 * 10] = {0};
  ddp_tensor x, *out = NULL;
  DPT_OK(self, ddp_tensor_wrap(&x, DDP_FLOAT32, 2, (int64_t[]){4, 10}, xs));
  ddp_status sf = ddp_zero_forward(z, tape, &x, &out);
  char msg_reuse[256];
  snprintf(msg_reuse, sizeof msg_reuse, "%s", ddp_last_error());
  ddp_tape_destroy(tape);
  ddp_zero_destroy(z);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_CHECK(self, su == DDP_ERR_UNSUPPORTED && strstr(msg_unused, "find_unused_parameters"),
            "find_unused_parameters at stage 3: %d, %s", su, msg_unused);
  DPT_CHECK(self, sf == DDP_ERR_UNSUPPORTED && strstr(msg_reuse, "'a' runs a second time"),
            "A B A at stage 3: %d, %s", sf, msg_reuse);
}

static void test_refusals(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 30, refuse_body, NULL), 0);
  assert_int_equal(dpt_run(2, 30, refuse_stage3_body, NULL), 0);
}

int main(void) {
  /* Stage 2's gradient ring wherever the graph fits it, not only where it
   * saves memory: these models' largest bucket is too large a part of
   * them for that, and the ring's equality is what is checked. */
  setenv("DDP_ZERO_GRAD_RING", "always", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_convnet_world2),
      cmocka_unit_test(test_convnet_world4),
      cmocka_unit_test(test_toy_world3_every_optimizer),
      cmocka_unit_test(test_convnet_world3_small_buckets),
      cmocka_unit_test(test_microbatches),
      cmocka_unit_test(test_relayout_with_state),
      cmocka_unit_test(test_clip_grad_norm),
      cmocka_unit_test(test_stage3),
      cmocka_unit_test(test_against_one_process),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_ring_refuses_graph),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
