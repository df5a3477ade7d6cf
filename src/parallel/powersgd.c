/* PowerSGD as a DDP communication hook: PyTorch's powerSGD_hook
 * (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, 2.x) on the
 * wrapper's launch / finish interface.
 *
 * PyTorch's future chain per bucket is allreduce(uncompressed) ->
 * allreduce(P) -> allreduce(Q). Here launch does the work up to P and starts
 * one allreduce of [uncompressed | P's] (elementwise the same sums; one
 * message fewer), and finish does the rest: the uncompressed average, P's
 * orthogonalization, Q = M^T P and its (blocking) allreduce, and M ~ P Q^T.
 * Finish runs bucket by bucket in index order on every rank, so the Q
 * allreduces are issued in the same order everywhere.
 *
 * State per parameter rather than per bucket (PyTorch keys error_dict and
 * q_memory_dict by bucket index): the buckets no longer change once PowerSGD
 * starts (start_iter > 1, after the wrapper's relayout), so the two are the
 * same values; per parameter they are sized once at create, and the saved
 * state does not depend on the bucketing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_internal.h" /* MT19937: numpy's RandomState and torch's CPU generator */
#include "parallel/dp_internal.h"

struct ddp_powersgd {
  ddp_dp *dp;
  ddp_model *model;
  ddp_powersgd_options o;
  int n_params;
  int64_t n_elems;
  int64_t iter;

  /* Per parameter: the matrix view n x m, its rank r = min(n, m, rank),
   * whether it is compressed, and where its error and Q live. */
  int64_t *rows, *cols;
  int *prank;
  bool *compress;
  int64_t *eoff; /* (n_params) in error: the parameter-index order */
  int64_t *qoff; /* (n_params) in q; -1 when not compressed */
  float *error;  /* (n_elems) the error feedback; during an iteration, the input copy */
  float *q;      /* (q_total) each compressed parameter's Q, m x r row-major */
  int64_t q_total;
  bool error_valid, q_valid;
  bool q_made; /* a compressing iteration has completed (ddp_powersgd_q) */

  /* Per-iteration scratch: the packed [uncompressed | P's] of every bucket
   * (all may be in flight at once), one bucket's Q's being reduced, and
   * the plan of a bucket. */
  float *pack;       /* (n_elems + p_total) */
  float *qpack;      /* (q_total) */
  int64_t pack_next; /* where the next launched bucket's region starts */
  int64_t *bucket_pack_off; /* (n_params) per bucket */
  bool *bucket_compressed;  /* (n_params) this iteration's bucket ran PowerSGD */
  int *plan_sorted;         /* (n_params) a bucket's parameters by offset */
  bool *plan_taken;         /* (n_params) */
  int *plan_unc, *plan_cmp; /* (n_params) a bucket's tensors, see plan() */
  int n_unc, n_cmp;
  int64_t *plan_poff, *plan_qoff; /* (n_params) P and packed-Q offsets per plan_cmp entry */
  int64_t plan_unc_numel, plan_p_total, plan_q_total;

  /* numpy.random.RandomState(random_seed): the seeds of torch.manual_seed. */
  uint32_t np_state[DDP__MT19937_N];
  int np_index;
  /* torch's CPU generator after manual_seed (one per randomization). */
  uint32_t t_state[DDP__MT19937_N];
  int t_index;
  bool t_has_normal;
  double t_next_normal;

  uint64_t cur_sent, cur_plain, last_sent, last_plain;
};

ddp_powersgd_options ddp_powersgd_defaults(void) {
  ddp_powersgd_options o;
  memset(&o, 0, sizeof o);
  o.rank = 1;
  o.start_iter = 1000;
  o.min_compression_rate = 2.0;
  o.use_error_feedback = true;
  o.warm_start = true;
  return o;
}

/* ---- PyTorch's random Q ------------------------------------------------------ */

/* RandomState.randint(1_000_000_000) (numpy's legacy bounded draw: 32-bit
 * words masked to 30 bits, rejected above 999999999). */
static uint32_t numpy_randint_1e9(ddp_powersgd *ps) {
  const uint32_t max = 999999999u, mask = (1u << 30) - 1;
  uint32_t v;
  do v = ddp__mt19937_next(ps->np_state, &ps->np_index) & mask;
  while (v > max);
  return v;
}

static uint32_t torch_next(ddp_powersgd *ps) { return ddp__mt19937_next(ps->t_state, &ps->t_index); }

/* at::normal_distribution<double> with PyTorch's cached second sample
 * (torch.randn of fewer than 16 elements). */
static double torch_normal_double(ddp_powersgd *ps) {
  if (ps->t_has_normal) {
    ps->t_has_normal = false;
    return ps->t_next_normal;
  }
  uint64_t a = torch_next(ps), b = torch_next(ps);
  double u1 = (double)(((a << 32) | b) & ((1ull << 53) - 1)) * 0x1p-53;
  a = torch_next(ps), b = torch_next(ps);
  double u2 = (double)(((a << 32) | b) & ((1ull << 53) - 1)) * 0x1p-53;
  double r = sqrt(-2.0 * log1p(-u2));
  double theta = 2.0 * M_PI * u1;
  ps->t_has_normal = true;
  ps->t_next_normal = r * sin(theta);
  return r * cos(theta);
}

static float torch_uniform_float(ddp_powersgd *ps) {
  return (float)(torch_next(ps) & ((1u << 24) - 1)) * 0x1p-24f;
}

/* normal_fill_16 (ATen's scalar Box-Muller over 16 uniforms). */
static void torch_normal_fill_16(float *d) {
  for (int j = 0; j < 8; j++) {
    const float u1 = 1 - d[j], u2 = d[j + 8];
    const float radius = sqrtf(-2 * logf(u1));
    const float theta = (float)(2.0f * M_PI * u2);
    d[j] = radius * cosf(theta);
    d[j + 8] = radius * sinf(theta);
  }
}

/* torch.randn(n) on the CPU in float32: ATen's normal_fill for n >= 16
 * (its scalar kernel; the AVX2 one rounds logf/cosf differently in the last
 * bits), the double path below that. */
static void torch_randn(ddp_powersgd *ps, float *d, int64_t n) {
  if (n < 16) {
    for (int64_t i = 0; i < n; i++) d[i] = (float)torch_normal_double(ps);
    return;
  }
  for (int64_t i = 0; i < n; i++) d[i] = torch_uniform_float(ps);
  for (int64_t i = 0; i + 16 <= n; i += 16) torch_normal_fill_16(d + i);
  if (n % 16) {
    float *t = d + n - 16;
    for (int i = 0; i < 16; i++) t[i] = torch_uniform_float(ps);
    torch_normal_fill_16(t);
  }
}

/* ---- The math ------------------------------------------------------------------ */

/* _orthogonalize_gram_schmidt on one n x r row-major matrix: each column
 * normalized, then projected out of the columns after it. A zero column
 * (epsilon 0) becomes zeros (PyTorch's code means to, in its except branch;
 * its division yields NaN instead). */
static void orthogonalize(float *a, int64_t n, int r, float eps) {
  for (int i = 0; i < r; i++) {
    float ss = 0;
    for (int64_t k = 0; k < n; k++) ss += a[k * r + i] * a[k * r + i];
    float norm = sqrtf(ss) + eps;
    if (norm == 0) {
      for (int64_t k = 0; k < n; k++) a[k * r + i] = 0;
    } else {
      for (int64_t k = 0; k < n; k++) a[k * r + i] /= norm;
    }
    for (int j = i + 1; j < r; j++) {
      float dot = 0;
      for (int64_t k = 0; k < n; k++) dot += a[k * r + i] * a[k * r + j];
      for (int64_t k = 0; k < n; k++) a[k * r + j] -= dot * a[k * r + i];
    }
  }
}

/* p (n x r) = m (n x c) q (c x r). */
static void mat_mq(float *restrict p, const float *restrict m, const float *restrict q, int64_t n,
                   int64_t c, int r) {
  for (int64_t i = 0; i < n; i++) {
    float *restrict pi = p + i * r;
    for (int k = 0; k < r; k++) pi[k] = 0;
    const float *restrict mi = m + i * c;
    for (int64_t j = 0; j < c; j++) {
      const float a = mi[j];
      const float *restrict qj = q + j * r;
      for (int k = 0; k < r; k++) pi[k] += a * qj[k];
    }
  }
}

/* q (c x r) = m^T (c x n) p (n x r). */
static void mat_mtp(float *restrict q, const float *restrict m, const float *restrict p, int64_t n,
                    int64_t c, int r) {
  memset(q, 0, (size_t)(c * r) * sizeof(float));
  for (int64_t i = 0; i < n; i++) {
    const float *restrict mi = m + i * c;
    const float *restrict pi = p + i * r;
    for (int64_t j = 0; j < c; j++) {
      float *restrict qj = q + j * r;
      for (int k = 0; k < r; k++) qj[k] += mi[j] * pi[k];
    }
  }
}

/* m (n x c) = p (n x r) q^T (r x c). */
static void mat_pqt(float *restrict m, const float *restrict p, const float *restrict q, int64_t n,
                    int64_t c, int r) {
  for (int64_t i = 0; i < n; i++) {
    const float *restrict pi = p + i * r;
    float *restrict mi = m + i * c;
    for (int64_t j = 0; j < c; j++) {
      const float *restrict qj = q + j * r;
      float s = 0;
      for (int k = 0; k < r; k++) s += pi[k] * qj[k];
      mi[j] = s;
    }
  }
}

/* ---- A bucket's plan ------------------------------------------------------------ */

static float *grad_of(ddp_powersgd *ps, int param) {
  return ddp_model_grads_flat(ps->model) + ddp_model_param_offset(ps->model, param);
}

/* bucket.gradients() order (the tensors as they lie in the bucket, by
 * offset), split into the uncompressed ones and the compressed ones grouped
 * by matrix shape in order of each shape's first appearance (PyTorch's
 * shape_to_tensors), with each compressed tensor's P offset (after the
 * uncompressed floats) and packed-Q offset. */
static void plan(ddp_powersgd *ps, const ddp_dp_bucket *bucket) {
  const int n = bucket->n_params;
  int *sorted = ps->plan_sorted;
  for (int i = 0; i < n; i++) { /* insertion sort by offset: buckets hold few parameters */
    int p = bucket->params[i];
    int64_t off = ddp_model_param_offset(ps->model, p);
    int k = i;
    for (; k > 0 && ddp_model_param_offset(ps->model, sorted[k - 1]) > off; k--)
      sorted[k] = sorted[k - 1];
    sorted[k] = p;
  }
  int nu = 0, nc = 0;
  ps->plan_unc_numel = 0;
  for (int i = 0; i < n; i++) {
    int p = sorted[i];
    ps->plan_taken[i] = !ps->compress[p];
    if (!ps->compress[p]) {
      ps->plan_unc[nu++] = p;
      ps->plan_unc_numel += ps->rows[p] * ps->cols[p];
    }
  }
  int64_t poff = ps->plan_unc_numel, qoff = 0;
  for (int i = 0; i < n; i++) {
    if (ps->plan_taken[i]) continue;
    const int a = sorted[i];
    for (int j = i; j < n; j++) {
      const int c = sorted[j];
      if (ps->plan_taken[j] || ps->rows[c] != ps->rows[a] || ps->cols[c] != ps->cols[a]) continue;
      ps->plan_taken[j] = true;
      ps->plan_cmp[nc] = c;
      ps->plan_poff[nc] = poff;
      ps->plan_qoff[nc] = qoff;
      poff += ps->rows[c] * ps->prank[c];
      qoff += ps->cols[c] * ps->prank[c];
      nc++;
    }
  }
  ps->n_unc = nu;
  ps->n_cmp = nc;
  ps->plan_p_total = poff - ps->plan_unc_numel;
  ps->plan_q_total = qoff;
}

/* ---- The hook ---------------------------------------------------------------------- */

static bool compressing(const ddp_powersgd *ps) { return ps->iter >= ps->o.start_iter; }

static ddp_status reduce(ddp_process_group *pg, const ddp_dp_bucket *bucket, float *buf,
                         int64_t count, ddp_work **work) {
  *work = NULL;
  if (count == 0) return DDP_OK;
  if (bucket->last) return ddp_allreduce(pg, buf, (size_t)count, DDP_FLOAT32, DDP_REDUCE_SUM);
  return ddp_allreduce_async(pg, buf, (size_t)count, DDP_FLOAT32, DDP_REDUCE_SUM, work);
}

static ddp_status psgd_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                              ddp_work **work) {
  ddp_powersgd *ps = state;
  const int b = bucket->index;
  if (b == 0) ps->pack_next = 0, ps->cur_sent = 0, ps->cur_plain = 0;
  ps->cur_plain += bucket->numel;
  ps->bucket_compressed[b] = compressing(ps);
  if (!ps->bucket_compressed[b]) {
    ps->cur_sent += bucket->numel;
    return reduce(pg, bucket, bucket->grads, (int64_t)bucket->numel, work);
  }
  /* Error feedback: add the last error, keep the input. */
  if (ps->o.use_error_feedback) {
    for (int i = 0; i < bucket->n_params; i++) {
      int p = bucket->params[i];
      float *g = grad_of(ps, p), *e = ps->error + ps->eoff[p];
      const int64_t n = ps->rows[p] * ps->cols[p];
      if (ps->error_valid)
        for (int64_t k = 0; k < n; k++) g[k] += e[k];
      memcpy(e, g, (size_t)n * sizeof(float));
    }
  }
  plan(ps, bucket);
  const int64_t base = ps->pack_next;
  ps->bucket_pack_off[b] = base;
  ps->pack_next += ps->plan_unc_numel + ps->plan_p_total;
  float *pack = ps->pack + base;
  int64_t at = 0;
  for (int i = 0; i < ps->n_unc; i++) {
    int p = ps->plan_unc[i];
    const int64_t n = ps->rows[p] * ps->cols[p];
    memcpy(pack + at, grad_of(ps, p), (size_t)n * sizeof(float));
    at += n;
  }
  /* Q: kept (warm start, orthogonalized again) or drawn. */
  const float eps = (float)ps->o.orthogonalization_epsilon;
  const bool randomize = !ps->o.warm_start || !ps->q_valid;
  /* PyTorch draws the seed whenever it randomizes, even for a bucket with
   * nothing to compress: skipping the draw there would shift every later
   * seed, and so every later Q, from PyTorch's. */
  if (randomize) {
    uint32_t seed = numpy_randint_1e9(ps);
    ddp__mt19937_init_genrand(ps->t_state, &ps->t_index, seed);
    ps->t_has_normal = false;
  }
  for (int i = 0; i < ps->n_cmp; i++) {
    int p = ps->plan_cmp[i];
    float *q = ps->q + ps->qoff[p];
    if (randomize) {
      if (ps->o.init_q) {
        ddp_status s = ps->o.init_q(ps->o.init_q_user, q, ps->cols[p], ps->prank[p]);
        if (s != DDP_OK) return ddp_error_wrap(s, "powersgd: init_q of parameter %d", p);
      } else {
        torch_randn(ps, q, ps->cols[p] * ps->prank[p]);
      }
    }
    orthogonalize(q, ps->cols[p], ps->prank[p], eps);
    mat_mq(pack + ps->plan_poff[i], grad_of(ps, p), q, ps->rows[p], ps->cols[p], ps->prank[p]);
  }
  const int64_t count = ps->plan_unc_numel + ps->plan_p_total;
  ps->cur_sent += (uint64_t)count;
  return reduce(pg, bucket, pack, count, work);
}

static void end_of_iteration(ddp_powersgd *ps, const ddp_dp_bucket *bucket) {
  if (bucket->index != ps->dp->n_buckets - 1) return;
  ps->iter++;
  ps->last_sent = ps->cur_sent;
  ps->last_plain = ps->cur_plain;
}

static ddp_status psgd_finish(void *state, ddp_dp_bucket *bucket) {
  ddp_powersgd *ps = state;
  const int b = bucket->index;
  const float d = (float)bucket->divisor;
  if (!ps->bucket_compressed[b]) {
    float *restrict g = bucket->grads;
    const size_t n = bucket->numel;
    if (d != 1.0f)
      for (size_t i = 0; i < n; i++) g[i] /= d;
    end_of_iteration(ps, bucket);
    return DDP_OK;
  }
  plan(ps, bucket); /* the same as at launch: the bucket has not changed */
  float *pack = ps->pack + ps->bucket_pack_off[b];
  int64_t at = 0;
  for (int i = 0; i < ps->n_unc; i++) {
    int p = ps->plan_unc[i];
    const int64_t n = ps->rows[p] * ps->cols[p];
    float *g = grad_of(ps, p);
    for (int64_t k = 0; k < n; k++) g[k] = pack[at + k] / d;
    at += n;
  }
  const float eps = (float)ps->o.orthogonalization_epsilon;
  for (int i = 0; i < ps->n_cmp; i++) {
    int p = ps->plan_cmp[i];
    float *pm = pack + ps->plan_poff[i];
    orthogonalize(pm, ps->rows[p], ps->prank[p], eps);
    mat_mtp(ps->qpack + ps->plan_qoff[i], grad_of(ps, p), pm, ps->rows[p], ps->cols[p],
            ps->prank[p]);
  }
  if (ps->plan_q_total > 0) {
    ddp_status s = ddp_allreduce(ps->dp->pg, ps->qpack, (size_t)ps->plan_q_total, DDP_FLOAT32,
                                 DDP_REDUCE_SUM);
    if (s != DDP_OK) return ddp_error_wrap(s, "powersgd: allreduce of bucket %d's Q", b);
    ps->cur_sent += (uint64_t)ps->plan_q_total;
  }
  for (int i = 0; i < ps->n_cmp; i++) {
    int p = ps->plan_cmp[i];
    float *q = ps->q + ps->qoff[p];
    const float *qp = ps->qpack + ps->plan_qoff[i];
    const int64_t nq = ps->cols[p] * ps->prank[p];
    for (int64_t k = 0; k < nq; k++) q[k] = qp[k] / d;
    mat_pqt(grad_of(ps, p), pack + ps->plan_poff[i], q, ps->rows[p], ps->cols[p], ps->prank[p]);
  }
  if (ps->o.use_error_feedback) {
    for (int i = 0; i < bucket->n_params; i++) {
      int p = bucket->params[i];
      const float *g = grad_of(ps, p);
      float *e = ps->error + ps->eoff[p];
      const int64_t n = ps->rows[p] * ps->cols[p];
      for (int64_t k = 0; k < n; k++) e[k] -= g[k];
    }
  }
  end_of_iteration(ps, bucket);
  if (bucket->index == ps->dp->n_buckets - 1) {
    ps->error_valid = ps->o.use_error_feedback;
    ps->q_valid = ps->o.warm_start;
    ps->q_made = true;
  }
  return DDP_OK;
}

/* ---- Life ------------------------------------------------------------------------ */

ddp_status ddp_powersgd_create(ddp_powersgd **out, ddp_dp *dp, const ddp_powersgd_options *options) {
  *out = NULL;
  ddp_powersgd_options o = options ? *options : ddp_powersgd_defaults();
  if (o.rank < 1) return ddp_error(DDP_ERR_INVALID, "powersgd: rank is %d (>= 1)", (int)o.rank);
  if (o.start_iter < 0)
    return ddp_error(DDP_ERR_INVALID, "powersgd: start_iter is %lld (>= 0)", (long long)o.start_iter);
  if ((o.use_error_feedback || o.warm_start) && o.start_iter <= 1)
    return ddp_error(DDP_ERR_INVALID,
                     "powersgd: start_iter is %lld; error feedback and warm start need > 1 (as "
                     "PyTorch: the buckets are final only after the first iteration's relayout)",
                     (long long)o.start_iter);
  if (!(o.min_compression_rate >= 0) || !(o.orthogonalization_epsilon >= 0))
    return ddp_error(DDP_ERR_INVALID, "powersgd: min_compression_rate %g and "
                     "orthogonalization_epsilon %g must be >= 0",
                     o.min_compression_rate, o.orthogonalization_epsilon);
  if (dp->kernels)
    return ddp_error(DDP_ERR_UNSUPPORTED, "powersgd: the model's gradients are on a GPU; the "
                     "PowerSGD hook runs on host buffers only (use --comm-hook fp16/bf16 there)");
  ddp_powersgd *ps = ddp_calloc(1, sizeof *ps);
  if (!ps) return ddp_error(DDP_ERR_NOMEM, "powersgd: out of memory");
  ps->dp = dp;
  ps->model = dp->model;
  ps->o = o;
  const int np = ps->n_params = ddp_model_num_params(dp->model);
  size_t npz = (size_t)np + 1;
  ps->rows = ddp_calloc(npz, sizeof(int64_t));
  ps->cols = ddp_calloc(npz, sizeof(int64_t));
  ps->prank = ddp_calloc(npz, sizeof(int));
  ps->compress = ddp_calloc(npz, sizeof(bool));
  ps->eoff = ddp_calloc(npz, sizeof(int64_t));
  ps->qoff = ddp_calloc(npz, sizeof(int64_t));
  ps->bucket_pack_off = ddp_calloc(npz, sizeof(int64_t));
  ps->bucket_compressed = ddp_calloc(npz, sizeof(bool));
  ps->plan_sorted = ddp_calloc(npz, sizeof(int));
  ps->plan_taken = ddp_calloc(npz, sizeof(bool));
  ps->plan_unc = ddp_calloc(npz, sizeof(int));
  ps->plan_cmp = ddp_calloc(npz, sizeof(int));
  ps->plan_poff = ddp_calloc(npz, sizeof(int64_t));
  ps->plan_qoff = ddp_calloc(npz, sizeof(int64_t));
  bool ok = ps->rows && ps->cols && ps->prank && ps->compress && ps->eoff && ps->qoff &&
            ps->bucket_pack_off && ps->bucket_compressed && ps->plan_sorted && ps->plan_taken && ps->plan_unc && ps->plan_cmp &&
            ps->plan_poff && ps->plan_qoff;
  int64_t p_total = 0;
  for (int i = 0; ok && i < np; i++) {
    const ddp_tensor *t = ddp_model_param(dp->model, i);
    int64_t n = t->ndim > 0 ? t->shape[0] : 1;
    int64_t m = n > 0 ? t->numel / n : 0;
    int64_t r = n < m ? n : m;
    if (r > o.rank) r = o.rank;
    ps->rows[i] = n;
    ps->cols[i] = m;
    ps->prank[i] = (int)r;
    ps->eoff[i] = ps->n_elems;
    ps->n_elems += t->numel;
    /* _should_compress: compressed size * rate < uncompressed size. */
    ps->compress[i] = r > 0 && (double)((n + m) * r) * o.min_compression_rate < (double)(n * m);
    ps->qoff[i] = -1;
    if (ps->compress[i]) {
      ps->qoff[i] = ps->q_total;
      ps->q_total += m * r;
      p_total += n * r;
    }
  }
  if (ok) {
    ps->error = ddp_calloc((size_t)ps->n_elems + 1, sizeof(float));
    ps->q = ddp_calloc((size_t)ps->q_total + 1, sizeof(float));
    ps->qpack = ddp_calloc((size_t)ps->q_total + 1, sizeof(float));
    ps->pack = ddp_calloc((size_t)(ps->n_elems + p_total) + 1, sizeof(float));
    ok = ps->error && ps->q && ps->qpack && ps->pack;
  }
  if (!ok) {
    ddp_powersgd_destroy(ps);
    return ddp_error(DDP_ERR_NOMEM, "powersgd: out of memory");
  }
  ddp__mt19937_init_genrand(ps->np_state, &ps->np_index, (uint32_t)o.random_seed);
  ddp_dp_comm_hook h = {psgd_launch, psgd_finish, ps};
  ddp_status s = ddp_dp_set_comm_hook_fn(dp, &h);
  if (s != DDP_OK) {
    ddp_powersgd_destroy(ps);
    return s;
  }
  *out = ps;
  return DDP_OK;
}

void ddp_powersgd_destroy(ddp_powersgd *ps) {
  if (!ps) return;
  ddp_free(ps->rows);
  ddp_free(ps->cols);
  ddp_free(ps->prank);
  ddp_free(ps->compress);
  ddp_free(ps->eoff);
  ddp_free(ps->qoff);
  ddp_free(ps->bucket_pack_off);
  ddp_free(ps->bucket_compressed);
  ddp_free(ps->plan_sorted);
  ddp_free(ps->plan_taken);
  ddp_free(ps->plan_unc);
  ddp_free(ps->plan_cmp);
  ddp_free(ps->plan_poff);
  ddp_free(ps->plan_qoff);
  ddp_free(ps->error);
  ddp_free(ps->q);
  ddp_free(ps->qpack);
  ddp_free(ps->pack);
  ddp_free(ps);
}

void ddp_powersgd_get_stats(const ddp_powersgd *ps, ddp_powersgd_stats *out) {
  memset(out, 0, sizeof *out);
  out->iter = ps->iter;
  out->last_elements_sent = ps->last_sent;
  out->last_elements_uncompressed = ps->last_plain;
  for (int i = 0; i < ps->n_params; i++) {
    if (ps->compress[i]) {
      out->elements_per_step += (uint64_t)((ps->rows[i] + ps->cols[i]) * ps->prank[i]);
      out->compressed_params++;
    } else {
      out->elements_per_step += (uint64_t)(ps->rows[i] * ps->cols[i]);
    }
  }
}

const float *ddp_powersgd_q(const ddp_powersgd *ps, int param, int64_t *rows, int64_t *cols) {
  if (param < 0 || param >= ps->n_params || !ps->compress[param] || !ps->q_made) return NULL;
  *rows = ps->cols[param];
  *cols = ps->prank[param];
  return ps->q + ps->qoff[param];
}

/* ---- State files --------------------------------------------------------------------- */

ddp_status ddp_powersgd_save(const ddp_powersgd *ps, const char *path) {
  int64_t flags[3] = {ps->error_valid, ps->q_valid, ps->q_made};
  int64_t iter = ps->iter;
  int64_t rng[DDP__MT19937_N + 1];
  for (int i = 0; i < DDP__MT19937_N; i++) rng[i] = ps->np_state[i];
  rng[DDP__MT19937_N] = ps->np_index;
  int64_t *shapes = ddp_calloc((size_t)ps->n_params * 3 + 1, sizeof(int64_t));
  if (!shapes) return ddp_error(DDP_ERR_NOMEM, "powersgd: saving %s: out of memory", path);
  for (int i = 0; i < ps->n_params; i++) {
    shapes[3 * i] = ps->rows[i];
    shapes[3 * i + 1] = ps->cols[i];
    shapes[3 * i + 2] = ps->compress[i] ? ps->prank[i] : 0;
  }
  ddp_safetensors_entry e[] = {
      {.name = "iter", .dtype = DDP_INT64, .ndim = 0, .data = &iter},
      {.name = "flags", .dtype = DDP_INT64, .ndim = 1, .shape = {3}, .data = flags},
      {.name = "numpy_rng", .dtype = DDP_INT64, .ndim = 1, .shape = {DDP__MT19937_N + 1}, .data = rng},
      {.name = "shapes", .dtype = DDP_INT64, .ndim = 2, .shape = {ps->n_params, 3}, .data = shapes},
      {.name = "error", .dtype = DDP_FLOAT32, .ndim = 1, .shape = {ps->n_elems}, .data = ps->error},
      {.name = "q", .dtype = DDP_FLOAT32, .ndim = 1, .shape = {ps->q_total}, .data = ps->q},
  };
  char rank_s[16], world_s[16];
  snprintf(rank_s, sizeof rank_s, "%d", ps->dp->rank);
  snprintf(world_s, sizeof world_s, "%d", ps->dp->world);
  ddp_kv meta[] = {{"format", "ddp.powersgd"}, {"rank", rank_s}, {"world", world_s}};
  ddp_status s = ddp_safetensors_write(path, e, sizeof e / sizeof e[0], meta, 3);
  ddp_free(shapes);
  if (s != DDP_OK) return ddp_error_wrap(s, "powersgd: saving the state of rank %d", ps->dp->rank);
  return DDP_OK;
}

/* Copies tensor `name` of `numel` elements of `dtype` into dst. */
static ddp_status load_tensor(const ddp_safetensors *st, const char *path, const char *name,
                              ddp_dtype dtype, int64_t numel, void *dst) {
  ddp_safetensors_tensor t;
  DDP_TRY(ddp_safetensors_find(st, name, &t));
  if (t.dtype != dtype || t.numel != numel)
    return ddp_error(DDP_ERR_INVALID, "powersgd: %s: tensor %s has %lld elements of %s; this "
                     "model and options need %lld of %s (another model, rank or options?)",
                     path, name, (long long)t.numel, ddp_safetensors_dtype_name(t.dtype),
                     (long long)numel, ddp_safetensors_dtype_name(dtype));
  if (numel) memcpy(dst, t.data, t.bytes);
  return DDP_OK;
}

ddp_status ddp_powersgd_load(ddp_powersgd *ps, const char *path) {
  ddp_safetensors *st;
  ddp_status s = ddp_safetensors_read(path, &st);
  if (s != DDP_OK) return ddp_error_wrap(s, "powersgd: loading the state of rank %d", ps->dp->rank);
  const char *fmt = ddp_safetensors_metadata(st, "format");
  const char *rank_s = ddp_safetensors_metadata(st, "rank");
  const char *world_s = ddp_safetensors_metadata(st, "world");
  int64_t flags[3], iter, rng[DDP__MT19937_N + 1];
  int64_t *shapes = ddp_calloc((size_t)ps->n_params * 3 + 1, sizeof(int64_t));
  if (!fmt || strcmp(fmt, "ddp.powersgd") || !rank_s || !world_s) {
    s = ddp_error(DDP_ERR_FORMAT, "powersgd: %s is not a PowerSGD state file", path);
  } else if (atoi(rank_s) != ps->dp->rank || atoi(world_s) != ps->dp->world) {
    s = ddp_error(DDP_ERR_INVALID, "powersgd: %s holds rank %s of a world of %s; this is rank %d "
                  "of %d (error feedback is per rank: resume at the same world size)",
                  path, rank_s, world_s, ps->dp->rank, ps->dp->world);
  } else if (!shapes) {
    s = ddp_error(DDP_ERR_NOMEM, "powersgd: loading %s: out of memory", path);
  } else {
    s = load_tensor(st, path, "shapes", DDP_INT64, (int64_t)ps->n_params * 3, shapes);
    for (int i = 0; s == DDP_OK && i < ps->n_params; i++)
      if (shapes[3 * i] != ps->rows[i] || shapes[3 * i + 1] != ps->cols[i] ||
          shapes[3 * i + 2] != (ps->compress[i] ? ps->prank[i] : 0))
        s = ddp_error(DDP_ERR_INVALID, "powersgd: %s: parameter %d was %lld x %lld at rank %lld; "
                      "here %lld x %lld at rank %d (another model or --comm-hook rank?)",
                      path, i, (long long)shapes[3 * i], (long long)shapes[3 * i + 1],
                      (long long)shapes[3 * i + 2], (long long)ps->rows[i],
                      (long long)ps->cols[i], ps->compress[i] ? ps->prank[i] : 0);
    if (s == DDP_OK) s = load_tensor(st, path, "iter", DDP_INT64, 1, &iter);
    if (s == DDP_OK) s = load_tensor(st, path, "flags", DDP_INT64, 3, flags);
    if (s == DDP_OK) s = load_tensor(st, path, "numpy_rng", DDP_INT64, DDP__MT19937_N + 1, rng);
    if (s == DDP_OK) s = load_tensor(st, path, "error", DDP_FLOAT32, ps->n_elems, ps->error);
    if (s == DDP_OK) s = load_tensor(st, path, "q", DDP_FLOAT32, ps->q_total, ps->q);
  }
  ddp_free(shapes);
  ddp_safetensors_free(st);
  if (s != DDP_OK) return s;
  ps->iter = iter;
  ps->error_valid = flags[0] != 0;
  ps->q_valid = flags[1] != 0;
  ps->q_made = flags[2] != 0;
  for (int i = 0; i < DDP__MT19937_N; i++) ps->np_state[i] = (uint32_t)rng[i];
  ps->np_index = (int)rng[DDP__MT19937_N];
  return DDP_OK;
}
