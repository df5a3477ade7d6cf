/* ZeRO stage 3's prefetch (docs/sharding.md, "Prefetch"), ranks as
 * threads: that it happens, that it keeps at most two units gathered, and
 * that it changes no result.
 *
 * That it happens is read from the zero's event log of each step (the
 * order in which units' gathers were enqueued, waited for, and their
 * forwards and backwards ended): from the second forward on, the gather of
 * the unit after unit i (in forward order) is enqueued before unit i's
 * forward returns, and in every backward the gather of the unit before
 * unit i is enqueued before unit i's last gradient is final. The same
 * check is run with prefetch off and must find it violated at every unit
 * (there each gather is enqueued when its unit is needed), so the check
 * can fail. Memory: with prefetch at most two units are gathered or in
 * flight at any time, and two are reached; without, one; also when
 * forwards follow each other without a backward (seen at three before the
 * next forward gave back the unit the last one kept).
 *
 * Results: the parameters of every rank after N steps with prefetch equal,
 * bit for bit, those without (a gather only copies floats; it is when it
 * happens that moved), at 2 and 3 ranks, for the ConvNet, the ConvNet-2
 * (registration order differs from the forward order) and a chain of six
 * linear layers with micro-batches. test_zero.c checks stage 3 (prefetch
 * on, the default) against plain data parallelism. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "dp_test_util.h"

#define MAX_EVENTS 512
#define MAX_STEPS 8

typedef struct pcase {
  const char *model; /* a model name, or "chain" (six Linear 10->W->...->5 on the toy data) */
  int world, steps, accum;
  bool prefetch;
  /* Results. */
  float *params[DPT_MAX_RANKS];     /* registration order */
  ddp_zero_event events[MAX_STEPS][MAX_EVENTS]; /* rank 0's, after each step's backward */
  int n_events[MAX_STEPS];
  int max_held[MAX_STEPS];
  ddp_zero_prefetch_stats stats;
} pcase;

static ddp_status build(const char *name, ddp_model **out) {
  if (strcmp(name, "chain")) return ddp_model_build(name, NULL, 5, out);
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  const int width = 200;
  for (int i = 0; i < 6; i++) {
    char layer[16];
    snprintf(layer, sizeof layer, "l%d", i);
    DDP_TRY(ddp_module_add_linear(m, NULL, layer, i ? width : 10, i < 5 ? width : 5, true, NULL));
  }
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  DDP_TRY(ddp_model_finalize(m, 5));
  *out = m;
  return DDP_OK;
}

static const char *data_of(const char *model) { return strcmp(model, "chain") ? model : "toy"; }

static void body(dpt_rank *self) {
  pcase *c = self->world->user;
  const int rank = self->rank, W = c->world;
  ddp_model *m;
  DPT_OK(self, build(c->model, &m));
  const int64_t n = ddp_model_num_param_elements(m);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_ADAM);
  oo.lr = 1e-3;
  ddp_optimizer *opt = NULL;
  ddp_zero *z = NULL;
  ddp_tape *tape = NULL;
  ddp_status s = ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                                      (size_t)n);
  ddp_zero_options zo = ddp_zero_defaults(3);
  zo.no_prefetch = !c->prefetch;
  if (s == DDP_OK) s = ddp_zero_create(&z, m, self->pg, opt, &zo);
  if (s == DDP_OK) s = ddp_tape_create(&tape, 1 << 22);
  const char *data = data_of(c->model);
  const int64_t B = 4, sn = dpt_sample_numel(data);
  float *xbuf = malloc((size_t)(B * sn) * sizeof(float));
  float *ybuf = malloc((size_t)B * 8 * 5);
  ddp_model_train(m, true);
  for (int t = 0; t < c->steps && s == DDP_OK; t++) {
    ddp_model_zero_grad(m);
    for (int k = 0; k < c->accum && s == DDP_OK; k++) {
      ddp_tensor x, y, *out, *loss;
      dpt_batch(data, t, k * W * B + rank, W, B, xbuf, ybuf, &x, &y);
      ddp_zero_set_no_sync(z, k < c->accum - 1);
      ddp_tape_reset(tape);
      s = ddp_zero_forward(z, tape, &x, &out);
      if (s == DDP_OK) s = ddp_model_loss(m, tape, out, &y, &loss);
      if (s == DDP_OK) s = ddp_zero_backward(z, tape, loss);
    }
    if (s == DDP_OK && c->accum > 1) {
      float *g = ddp_model_grads_flat(m);
      for (int64_t i = 0; i < n; i++) g[i] /= (float)c->accum;
    }
    if (rank == 0 && s == DDP_OK && t < MAX_STEPS) {
      c->n_events[t] = ddp_zero_events(z, c->events[t], MAX_EVENTS);
      ddp_zero_prefetch_stats st;
      ddp_zero_get_prefetch_stats(z, &st);
      c->max_held[t] = st.max_units_held;
      DPT_CHECK(self, st.events_lost == 0 && c->n_events[t] <= MAX_EVENTS, "events lost: %d",
                st.events_lost);
    }
    if (s == DDP_OK) s = ddp_zero_step(z);
  }
  free(xbuf);
  free(ybuf);
  if (s == DDP_OK) s = ddp_zero_sync_params(z);
  if (s == DDP_OK) {
    c->params[rank] = calloc((size_t)n, sizeof(float));
    int64_t at = 0;
    for (int i = 0; i < ddp_model_num_params(m); i++) {
      const int64_t len = ddp_model_param(m, i)->numel;
      memcpy(c->params[rank] + at, ddp_model_params_flat(m) + ddp_model_param_offset(m, i),
             (size_t)len * sizeof(float));
      at += len;
    }
  }
  if (rank == 0 && z) ddp_zero_get_prefetch_stats(z, &c->stats);
  /* No barrier before teardown: a rank that is done may leave while a
   * slower one still reads the last gather (test_late_receiver in
   * test_local_threads checks the backend allows it). */
  ddp_tape_destroy(tape);
  ddp_zero_destroy(z);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_OK(self, s);
}

static pcase *run(const char *model, int world, int steps, int accum, bool prefetch) {
  pcase *c = calloc(1, sizeof *c);
  c->model = model;
  c->world = world;
  c->steps = steps;
  c->accum = accum;
  c->prefetch = prefetch;
  assert_int_equal(dpt_run(world, 120, body, c), 0);
  return c;
}

static void free_case(pcase *c) {
  for (int r = 0; r < DPT_MAX_RANKS; r++) free(c->params[r]);
  free(c);
}

/* Index of the first (last when `last`) event of kind for unit, -1 if none. */
static int find(const ddp_zero_event *ev, int n, ddp_zero_event_kind kind, int unit, bool last) {
  int at = -1;
  for (int i = 0; i < n; i++)
    if (ev[i].kind == (int32_t)kind && ev[i].unit == unit) {
      at = i;
      if (!last) break;
    }
  return at;
}

/* Checks one step's log for prefetch. seq: the units in the order their
 * forwards ended (from the log). Returns how many units were not
 * prefetched where they should have been (forward: from the second step;
 * backward: always), describing the first in why. */
static int missed_prefetches(const ddp_zero_event *ev, int n, bool forward_too, int *n_seq,
                             char *why, size_t why_len) {
  int seq[64], ns = 0;
  for (int i = 0; i < n && ns < 64; i++)
    if (ev[i].kind == DDP_ZERO_EVENT_FORWARD_DONE) seq[ns++] = ev[i].unit;
  *n_seq = ns;
  int missed = 0;
  why[0] = '\0';
  for (int i = 0; i + 1 < ns && forward_too; i++) {
    /* While seq[i] computes its forward, seq[i+1]'s gather is enqueued. */
    const int issued = find(ev, n, DDP_ZERO_EVENT_GATHER_ISSUED, seq[i + 1], false);
    const int done = find(ev, n, DDP_ZERO_EVENT_FORWARD_DONE, seq[i], false);
    if (issued < 0 || issued > done) {
      if (!missed++)
        snprintf(why, why_len, "forward: unit %d's gather enqueued at event %d, after unit %d's "
                 "forward ended (event %d)", seq[i + 1], issued, seq[i], done);
    }
  }
  for (int i = ns - 1; i >= 1; i--) {
    /* While seq[i] computes its backward, seq[i-1]'s gather is enqueued:
     * its last gather is enqueued before seq[i]'s last gradient is final. */
    const int issued = find(ev, n, DDP_ZERO_EVENT_GATHER_ISSUED, seq[i - 1], true);
    const int done = find(ev, n, DDP_ZERO_EVENT_BACKWARD_DONE, seq[i], false);
    const int fwd_done = find(ev, n, DDP_ZERO_EVENT_FORWARD_DONE, seq[i - 1], false);
    if (done < 0 || issued < fwd_done || issued > done) {
      if (!missed++)
        snprintf(why, why_len, "backward: unit %d's gather enqueued at event %d, unit %d's "
                 "backward ended at event %d", seq[i - 1], issued, seq[i], done);
    }
  }
  return missed;
}

static void check_order(const char *model, int world) {
  pcase *on = run(model, world, 4, 1, true), *off = run(model, world, 4, 1, false);
  for (int t = 0; t < on->steps; t++) {
    char why[256];
    int ns_on, ns_off;
    const int m_on = missed_prefetches(on->events[t], on->n_events[t], t > 0, &ns_on, why, sizeof why);
    if (ns_on < 2) fail_msg("%s: step %d: %d units ran: nothing to prefetch", model, t, ns_on);
    if (m_on) fail_msg("%s, world %d, prefetch on: step %d: %d units not prefetched; %s", model,
                       world, t, m_on, why);
    /* The same check must fail without prefetch, at every unit. */
    const int m_off = missed_prefetches(off->events[t], off->n_events[t], t > 0, &ns_off, why, sizeof why);
    const int expect_off = (t > 0 ? ns_off - 1 : 0) + ns_off - 1;
    if (m_off != expect_off)
      fail_msg("%s, world %d, prefetch off: step %d: the check found %d of %d gathers early: it "
               "cannot tell prefetch from none", model, world, t, expect_off - m_off, expect_off);
    if (on->max_held[t] != 2 || off->max_held[t] != 1)
      fail_msg("%s: step %d: at most %d units held with prefetch (2 expected), %d without (1)",
               model, t, on->max_held[t], off->max_held[t]);
  }
  char why[8];
  int units;
  (void)missed_prefetches(on->events[0], on->n_events[0], false, &units, why, sizeof why);
  printf("  %s world %d: %d units; every gather after the first forward's enqueued while the "
         "unit before it (forward) or after it (backward) computed; at most 2 units held (1 "
         "without prefetch); gathers %lld, prefetched %lld, complete when needed %lld\n", model,
         world, units, (long long)on->stats.gathers,
         (long long)on->stats.prefetched, (long long)on->stats.ready_when_needed);
  if (!on->stats.enabled || off->stats.enabled || off->stats.prefetched != 0 ||
      on->stats.prefetched <= 0)
    fail_msg("stats: enabled %d/%d, prefetched %lld with, %lld without", on->stats.enabled,
             off->stats.enabled, (long long)on->stats.prefetched, (long long)off->stats.prefetched);
  free_case(on);
  free_case(off);
}

static void test_prefetch_happens(void **state) {
  (void)state;
  check_order("convnet", 2);
  check_order("chain", 3);
  check_order("convnet-2", 2);
}

static void check_unchanged(const char *model, int world, int steps, int accum) {
  ddp_model *m;
  assert_int_equal(build(model, &m), DDP_OK);
  const int64_t n = ddp_model_num_param_elements(m);
  ddp_model_destroy(m);
  pcase *on = run(model, world, steps, accum, true), *off = run(model, world, steps, accum, false);
  for (int r = 0; r < world; r++) {
    if (memcmp(on->params[r], off->params[r], (size_t)n * sizeof(float))) {
      double worst = 0;
      for (int64_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)on->params[r][i] - off->params[r][i]));
      fail_msg("%s world %d: rank %d's parameters with prefetch differ from without (max |diff| "
               "%.3g)", model, world, r, worst);
    }
    if (memcmp(on->params[r], on->params[0], (size_t)n * sizeof(float)))
      fail_msg("%s world %d: rank %d's parameters differ from rank 0's", model, world, r);
  }
  /* The steps moved the parameters: equal results of no training prove nothing. */
  ddp_model *m0;
  assert_int_equal(build(model, &m0), DDP_OK);
  if (!memcmp(on->params[0], ddp_model_params_flat(m0), (size_t)n * sizeof(float)))
    fail_msg("%s: the parameters did not move", model);
  ddp_model_destroy(m0);
  printf("  %s world %d, %d steps%s: parameters with prefetch bit-identical to without\n", model,
         world, steps, accum > 1 ? ", micro-batches" : "");
  free_case(on);
  free_case(off);
}

static void test_results_unchanged(void **state) {
  (void)state;
  check_unchanged("convnet", 2, 10, 1);
  check_unchanged("convnet", 3, 6, 1);
  check_unchanged("convnet-2", 2, 6, 1);
  check_unchanged("chain", 3, 6, 3);
}

/* A forward without a backward (a loss looked at, then dropped) leaves its
 * last unit held; the next forward must give it back before prefetching,
 * or three units would be held. */
static void forward_twice_body(dpt_rank *self) {
  ddp_model *m;
  DPT_OK(self, build("chain", &m));
  const int64_t n = ddp_model_num_param_elements(m);
  ddp_optim_options oo = ddp_optim_defaults(DDP_OPTIM_SGD);
  ddp_optimizer *opt;
  DPT_OK(self, ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(m), ddp_model_grads_flat(m),
                                    (size_t)n));
  ddp_zero *z;
  ddp_zero_options zo = ddp_zero_defaults(3);
  DPT_OK(self, ddp_zero_create(&z, m, self->pg, opt, &zo));
  ddp_tape *tape;
  DPT_OK(self, ddp_tape_create(&tape, 1 << 20));
  float xbuf[4 * 10], ybuf[4 * 5];
  ddp_model_train(m, true);
  ddp_status s = DDP_OK;
  int most = 0;
  for (int t = 0; t < 3 && s == DDP_OK; t++) {
    ddp_tensor x, y, *out;
    dpt_batch("toy", t, self->rank, 2, 4, xbuf, ybuf, &x, &y);
    ddp_tape_reset(tape);
    s = ddp_zero_forward(z, tape, &x, &out);
    ddp_zero_prefetch_stats st;
    ddp_zero_get_prefetch_stats(z, &st);
    if (st.max_units_held > most) most = st.max_units_held;
  }
  ddp_tape_destroy(tape);
  ddp_zero_destroy(z);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(m);
  DPT_OK(self, s);
  DPT_CHECK(self, most == 2, "forwards without backward: at most %d units held (2 expected)", most);
}

static void test_forward_without_backward(void **state) {
  (void)state;
  assert_int_equal(dpt_run(2, 60, forward_twice_body, NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_prefetch_happens),
      cmocka_unit_test(test_results_unchanged),
      cmocka_unit_test(test_forward_without_backward),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
