/* PowerSGD (ddp_powersgd, src/parallel/powersgd.c) against PyTorch's
 * powerSGD_hook at world 2 (ranks as threads, ddp's own backend), on the
 * gradients, initial Q's and outputs of tests/fixtures/powersgd.bin
 * (scripts/make_powersgd_fixture.py: the model's layout is described there):
 *  - each configuration (rank 1, 2, 4, no error feedback / no warm start)
 *    for 5 iterations, PyTorch's random Q's injected: every bucket's output
 *    and every compressed parameter's Q after each iteration equal PyTorch's
 *    within max|ours - torch| <= 2e-5 * max|torch| (float rounding of
 *    sums of at most 320 products in a different order, through the
 *    Gram-Schmidt normalization; at rank 4 PyTorch orthogonalizes with
 *    QR, so Q's columns are compared up to sign, the outputs as they are);
 *  - rank 1 again with ddp's own generator (no injection): the same bound,
 *    which checks the seeding (numpy's RandomState -> torch.manual_seed ->
 *    torch.randn, both its paths);
 *  - bytes on the wire: the group's counters per step against the closed
 *    form, sum over compressed (n + m) r + the uncompressed n m, and the
 *    plain steps' n m;
 *  - the state saved after iteration 3 and loaded into a fresh hook gives
 *    iteration 4 bit for bit;
 *  - bad options refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "parallel/dp_test_util.h"
#include "support/fixture.h"

static fixture *g_fix;
#define N_PARAMS 9
#define ITERS 5
static const int bucket_params[2][7] = {{2, 3, 4, 5, 6, 7, 8}, {0, 1}};
static const int bucket_len[2] = {7, 2};

static const fixture_tensor *find(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const fixture_tensor *find(const char *fmt, ...) {
  char name[128];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  return fixture_find(g_fix, name);
}

static ddp_status build(ddp_model **out) {
  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  DDP_TRY(ddp_module_add_linear(m, NULL, "big", 20, 16, true, NULL));
  DDP_TRY(ddp_module_add_conv2d(m, NULL, "conv1", 4, 8, 3, 1, 1, true, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "fc", 32, 10, true, NULL));
  DDP_TRY(ddp_module_add_conv2d(m, NULL, "conv2", 4, 8, 3, 1, 1, false, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "small", 4, 3, false, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "thin", 12, 6, false, NULL));
  DDP_TRY(ddp_model_finalize(m, 1));
  *out = m;
  return DDP_OK;
}

typedef struct cfg {
  const char *name;
  int rank;
  int64_t start;
  bool ef_warm;
  bool inject;
} cfg;

typedef struct inject {
  const char *cfg;
  int next;
  bool failed;
} inject;

static ddp_status init_q(void *user, float *q, int64_t rows, int64_t cols) {
  inject *in = user;
  const fixture_tensor *t = find("%s.randn.%d", in->cfg, in->next++);
  if (!t || t->numel != rows * cols)
    return ddp_error(DDP_ERR_INVALID, "fixture %s.randn.%d: missing or not %lld values", in->cfg,
                     in->next - 1, (long long)(rows * cols));
  memcpy(q, t->data, (size_t)t->numel * sizeof(float));
  return DDP_OK;
}

static double max_abs(const float *a, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i]));
  return m;
}

static double g_worst; /* the largest relative difference seen (reported) */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static bool close_to(const float *ours, const float *ref, int64_t n, double *rel) {
  double scale = max_abs(ref, n), diff = 0;
  for (int64_t i = 0; i < n; i++) diff = fmax(diff, fabs((double)ours[i] - ref[i]));
  *rel = scale > 0 ? diff / scale : diff;
  pthread_mutex_lock(&g_mu);
  if (*rel > g_worst) g_worst = *rel;
  pthread_mutex_unlock(&g_mu);
  return *rel <= 2e-5;
}

/* Fills / reads bucket b of the model's gradients in memory order. */
static void put_bucket(ddp_model *m, int b, const float *src) {
  int64_t at = 0;
  for (int i = 0; i < bucket_len[b]; i++) {
    int p = bucket_params[b][i];
    int64_t n = ddp_model_param(m, p)->numel;
    memcpy(ddp_model_grads_flat(m) + ddp_model_param_offset(m, p), src + at,
           (size_t)n * sizeof(float));
    at += n;
  }
}
static void get_bucket(ddp_model *m, int b, float *dst) {
  int64_t at = 0;
  for (int i = 0; i < bucket_len[b]; i++) {
    int p = bucket_params[b][i];
    int64_t n = ddp_model_param(m, p)->numel;
    memcpy(dst + at, ddp_model_grads_flat(m) + ddp_model_param_offset(m, p),
           (size_t)n * sizeof(float));
    at += n;
  }
}

/* Compressed parameters of bucket b, in PyTorch's Q order (grouped by shape). */
static int q_order(const ddp_powersgd *ps, int b, int *out) {
  int n = 0;
  bool used[7] = {0};
  for (int i = 0; i < bucket_len[b]; i++) {
    int64_t r, c;
    if (used[i] || !ddp_powersgd_q(ps, bucket_params[b][i], &r, &c)) continue;
    out[n++] = bucket_params[b][i];
    used[i] = true;
    for (int j = i + 1; j < bucket_len[b]; j++) {
      int64_t r2, c2;
      if (!used[j] && ddp_powersgd_q(ps, bucket_params[b][j], &r2, &c2) && r2 == r && c2 == c) {
        /* the same Q shape; PyTorch groups by the matrix's shape, which
         * differs only in rows here (p2 and p6 are both 8 x 36) */
        out[n++] = bucket_params[b][j];
        used[j] = true;
      }
    }
  }
  return n;
}

static const cfg *g_cfg;

static void body(dpt_rank *self) {
  const cfg *c = g_cfg;
  ddp_model *m = NULL;
  DPT_OK(self, build(&m));
  ddp_dp_options o = ddp_dp_defaults();
  o.first_bucket_mb = (3992.0 - 0.5) / 1048576.0; /* bucket 0: p8 .. p2 (998 floats) */
  ddp_dp *dp = NULL;
  DPT_OK(self, ddp_dp_create(&dp, m, self->pg, &o));
  DPT_CHECK(self, ddp_dp_num_buckets(dp) == 2, "%d buckets, want 2", ddp_dp_num_buckets(dp));
  for (int b = 0; b < 2; b++) {
    const ddp_dp_bucket *bk = ddp_dp_bucket_get(dp, b);
    DPT_CHECK(self, bk->n_params == bucket_len[b], "bucket %d has %d params", b, bk->n_params);
  }
  inject in = {.cfg = c->name};
  ddp_powersgd_options po = ddp_powersgd_defaults();
  po.rank = c->rank;
  po.start_iter = c->start;
  po.use_error_feedback = po.warm_start = c->ef_warm;
  if (c->inject) {
    po.init_q = init_q;
    po.init_q_user = &in;
  }
  ddp_powersgd *ps = NULL;
  DPT_OK(self, ddp_powersgd_create(&ps, dp, &po));
  float buf[1024];
  int next_at_save = 0;
  char state_path[256];
  snprintf(state_path, sizeof state_path, "%s/ddp_test_powersgd_%d_%d.safetensors",
           getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid(), self->rank);
  for (int t = 0; t < ITERS; t++) {
    for (int b = 0; b < 2; b++) {
      const fixture_tensor *x = find("%s.in.r%d.t%d.b%d", c->name, self->rank, t, b);
      DPT_CHECK(self, x, "fixture lacks %s.in.r%d.t%d.b%d", c->name, self->rank, t, b);
      put_bucket(m, b, x->data);
    }
    ddp_comm_counters before, after;
    DPT_OK(self, ddp_process_group_counters(self->pg, &before));
    DPT_OK(self, ddp_dp_reduce_grads(dp));
    DPT_OK(self, ddp_process_group_counters(self->pg, &after));
    for (int b = 0; b < 2; b++) {
      const fixture_tensor *y = find("%s.out.r%d.t%d.b%d", c->name, self->rank, t, b);
      DPT_CHECK(self, y, "fixture lacks an output");
      get_bucket(m, b, buf);
      double rel;
      DPT_CHECK(self, close_to(buf, y->data, y->numel, &rel),
                "%s%s iteration %d bucket %d: output differs from PyTorch's by %.3g of its max",
                c->name, c->inject ? "" : " (own generator)", t, b, rel);
      const fixture_tensor *q = find("%s.q.t%d.b%d", c->name, t, b);
      if (!q || !c->ef_warm) continue;
      int order[7], nq = q_order(ps, b, order);
      int64_t at = 0;
      for (int i = 0; i < nq; i++) {
        int64_t r, cc;
        const float *ours = ddp_powersgd_q(ps, order[i], &r, &cc);
        DPT_CHECK(self, at + r * cc <= q->numel && r * cc <= 1024, "more Q than PyTorch's");
        const float *ref = (const float *)q->data + at;
        float signed_q[1024];
        memcpy(signed_q, ours, (size_t)(r * cc) * sizeof(float));
        if (c->rank > 2) /* PyTorch's QR against our Gram-Schmidt: columns up to sign */
          for (int64_t k = 0; k < cc; k++) {
            double dot = 0;
            for (int64_t j = 0; j < r; j++) dot += (double)signed_q[j * cc + k] * ref[j * cc + k];
            if (dot < 0)
              for (int64_t j = 0; j < r; j++) signed_q[j * cc + k] = -signed_q[j * cc + k];
          }
        DPT_CHECK(self, close_to(signed_q, ref, r * cc, &rel),
                  "%s iteration %d bucket %d: Q of parameter %d differs by %.3g", c->name, t, b,
                  order[i], rel);
        at += r * cc;
      }
      DPT_CHECK(self, at == q->numel, "%s bucket %d: Q's of %lld values, PyTorch's %lld", c->name,
                b, (long long)at, (long long)q->numel);
    }
    /* Bytes: the closed form over the parameters, and the group's counter
     * (an allreduce of n bytes counts 2n on a threads pair). */
    ddp_powersgd_stats st;
    ddp_powersgd_get_stats(ps, &st);
    uint64_t plain = 0, compressed = 0;
    for (int p = 0; p < N_PARAMS; p++) {
      const ddp_tensor *w = ddp_model_param(m, p);
      int64_t n = w->shape[0], mm = w->numel / n, r = n < mm ? n : mm;
      if (r > c->rank) r = c->rank;
      plain += (uint64_t)w->numel;
      compressed += (double)((n + mm) * r) * 2.0 < (double)(n * mm) ? (uint64_t)((n + mm) * r)
                                                                      : (uint64_t)(n * mm);
    }
    const bool comp = t >= c->start;
    const uint64_t want = comp ? compressed : plain;
    DPT_CHECK(self, st.iter == t + 1, "iter %lld after %d steps", (long long)st.iter, t + 1);
    DPT_CHECK(self, st.last_elements_sent == want && st.last_elements_uncompressed == plain,
              "%s step %d: sent %llu of %llu floats; closed form %llu of %llu", c->name, t,
              (unsigned long long)st.last_elements_sent,
              (unsigned long long)st.last_elements_uncompressed, (unsigned long long)want,
              (unsigned long long)plain);
    DPT_CHECK(self, st.elements_per_step == compressed, "elements_per_step %llu, want %llu",
              (unsigned long long)st.elements_per_step, (unsigned long long)compressed);
    uint64_t wire = after.threads_bytes - before.threads_bytes;
    DPT_CHECK(self, wire == 2 * 4 * want, "%s step %d: %llu bytes through the group, want %llu",
              c->name, t, (unsigned long long)wire, (unsigned long long)(2 * 4 * want));
    if (self->rank == 0 && comp && t == ITERS - 1)
      printf("%s: %llu floats a step instead of %llu (factor %.2f)\n", c->name,
             (unsigned long long)want, (unsigned long long)plain, (double)plain / (double)want);
    /* Save after iteration 3; at 4, a fresh hook loaded from it must give
     * iteration 4 bit for bit. */
    if (t == ITERS - 2) {
      DPT_OK(self, ddp_powersgd_save(ps, state_path));
      next_at_save = in.next;
    }
  }
  /* Replay iteration 4 on a fresh wrapper and hook loaded from the file. */
  float first[2][1024];
  for (int b = 0; b < 2; b++) get_bucket(m, b, first[b]);
  ddp_powersgd_destroy(ps);
  ddp_dp_destroy(dp);
  DPT_OK(self, ddp_dp_create(&dp, m, self->pg, &o));
  in.next = next_at_save; /* the draws of iteration 4 (none with warm start) */
  DPT_OK(self, ddp_powersgd_create(&ps, dp, &po));
  DPT_OK(self, ddp_powersgd_load(ps, state_path));
  unlink(state_path);
  for (int b = 0; b < 2; b++)
    put_bucket(m, b, find("%s.in.r%d.t%d.b%d", c->name, self->rank, ITERS - 1, b)->data);
  DPT_OK(self, ddp_dp_reduce_grads(dp));
  for (int b = 0; b < 2; b++) {
    get_bucket(m, b, buf);
    int64_t n = find("%s.in.r%d.t%d.b%d", c->name, self->rank, ITERS - 1, b)->numel;
    DPT_CHECK(self, !memcmp(buf, first[b], (size_t)n * sizeof(float)),
              "%s: iteration 4 after loading the state differs from the uninterrupted run (bucket %d)",
              c->name, b);
  }
  ddp_powersgd_destroy(ps);
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
}

static int bad_options(void) {
  ddp_model *m;
  if (build(&m) != DDP_OK) return 1;
  ddp_process_group *pg = NULL;
  ddp_store *store;
  ddp_store_options so = {.timeout_ms = 10000};
  if (ddp_store_mem_create(&so, &store) != DDP_OK) return 1;
  ddp_process_group_options go = {.timeout_s = 10};
  if (ddp_process_group_create(store, 0, 1, &go, &pg) != DDP_OK) return 1;
  ddp_dp *dp;
  if (ddp_dp_create(&dp, m, pg, NULL) != DDP_OK) return 1;
  int fails = 0;
  ddp_powersgd *ps;
  ddp_powersgd_options po = ddp_powersgd_defaults();
  po.rank = 0;
  if (ddp_powersgd_create(&ps, dp, &po) != DDP_ERR_INVALID) fails++, fprintf(stderr, "rank 0 accepted\n");
  po = ddp_powersgd_defaults();
  po.start_iter = 1;
  if (ddp_powersgd_create(&ps, dp, &po) != DDP_ERR_INVALID || !strstr(ddp_last_error(), "> 1"))
    fails++, fprintf(stderr, "start_iter 1 with error feedback accepted: %s\n", ddp_last_error());
  /* A state file of another world is refused. */
  po = ddp_powersgd_defaults();
  if (ddp_powersgd_create(&ps, dp, &po) != DDP_OK) return 1;
  const char *missing = "/nonexistent/powersgd.safetensors";
  if (ddp_powersgd_load(ps, missing) == DDP_OK) fails++, fprintf(stderr, "missing file loaded\n");
  ddp_powersgd_destroy(ps);
  ddp_dp_destroy(dp);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  ddp_model_destroy(m);
  return fails;
}

int main(void) {
  char path[1024];
  if (fixture_load(fixture_path("powersgd.bin", path, sizeof path), &g_fix) != DDP_OK) {
    fprintf(stderr, "FAILED: %s\n", ddp_last_error());
    return 1;
  }
  static const cfg cfgs[] = {
      {"r1", 1, 2, true, true},
      {"r2", 2, 2, true, true},
      {"r4", 4, 2, true, true},
      {"noef", 1, 0, false, true},
      {"r1", 1, 2, true, false},
  };
  int fails = 0;
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
    g_cfg = &cfgs[i];
    int f = dpt_run(2, 60, body, NULL);
    if (f) fprintf(stderr, "FAILED: %s%s\n", cfgs[i].name, cfgs[i].inject ? "" : " (own generator)");
    fails += f;
  }
  fails += bad_options();
  printf("largest difference from PyTorch: %.3g of the reference's max\n", g_worst);
  fixture_free(g_fix);
  if (fails) return 1;
  printf("PASS\n");
  return 0;
}
