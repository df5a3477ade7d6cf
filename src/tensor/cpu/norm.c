/* CPU batch-norm kernels (see cpu/pointwise.h). */
#include <immintrin.h>
#include <string.h>

#include "tensor/cpu/dense.h"
#include "tensor/cpu/pointwise.h"

/* ---- batch norm ----
 * x is (N, C, HW): channel c is N planes of HW contiguous floats. For HW > 1
 * we go channel by channel (the channel's planes stay in cache between the
 * passes); for HW == 1 ((N, C) input, BatchNorm1d) row by row, vectorising
 * across channels with per-channel double accumulators from the arena. */

/* Asks the cache for the lines of [p, p + bytes). */
static void prefetch_range(const void *p, size_t bytes) {
  const uintptr_t line = 64, end = (uintptr_t)p + bytes;
  for (uintptr_t a = (uintptr_t)p & ~(line - 1); a < end; a += line)
    __builtin_prefetch((const void *)a);
}

static void running_update(float *running_mean, float *running_var, int64_t c, double mean,
                           double var, int64_t count, float momentum) {
  if (!running_mean) return;
  double unbiased = count > 1 ? var * (double)count / (double)(count - 1) : var;
  running_mean[c] = (float)((1.0 - momentum) * running_mean[c] + momentum * mean);
  running_var[c] = (float)((1.0 - momentum) * running_var[c] + momentum * unbiased);
}

ddp_status ddp__cpu_batch_norm_stats(float *restrict mean, float *restrict invstd,
                                     float *running_mean, float *running_var,
                                     const float *restrict x, int64_t N, int64_t C, int64_t HW,
                                     float momentum, float eps, ddp_arena *arena) {
  int64_t count = N * HW;
  if (HW == 1) {
    double *s = ddp_arena_alloc(arena, (size_t)C * 2 * sizeof(double));
    if (!s)
      return ddp_error(DDP_ERR_NOMEM, "batch_norm: no scratch for %lld channels", (long long)C);
    double *s1 = s, *s2 = s + C;
    /* One pass of sums shifted by the first row, in double: with the shift
     * a sample of the channel, var = E[d^2] - E[d]^2 loses nothing that
     * matters in double precision. */
    const float *shift = x;
    for (int64_t c = 0; c < C; c++) s1[c] = 0, s2[c] = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *row = x + n * C;
      for (int64_t c = 0; c < C; c++) {
        double d = (double)row[c] - shift[c];
        s1[c] += d;
        s2[c] += d * d;
      }
    }
    for (int64_t c = 0; c < C; c++) {
      double m = s1[c] / (double)count;
      double var = s2[c] / (double)count - m * m;
      var = var > 0 ? var : 0;
      mean[c] = (float)(shift[c] + m);
      invstd[c] = (float)(1.0 / sqrt(var + eps));
      running_update(running_mean, running_var, c, shift[c] + m, var, count, momentum);
    }
    return DDP_OK;
  }
  /* The mean is summed in double lanes: it decides the sign of every
   * normalised value that sits near it, and images hold many such values
   * at once (a plain background makes one convolution output thousands of
   * times). Float lanes of 784 values put the mean a few units in the last
   * place off, enough to flip all those values' ReLU together against a
   * correctly rounded mean: the plain and the synchronized kernels (whose
   * sums are double) then trained the ConvNet differently from the first
   * step on (issue 19, docs/parallel.md). */
  for (int64_t c = 0; c < C; c++) {
    double s1 = 0;
    for (int64_t n = 0; n < N; n++) {
      /* the next plane of the channel, C planes on (see prefetch_plane) */
      if (n + 1 < N) prefetch_range(x + ((n + 1) * C + c) * HW, (size_t)HW * sizeof(float));
      s1 += sum_f32_in_double(x + (n * C + c) * HW, HW);
    }
    double m = s1 / (double)count;
    float mf = (float)m;
    double s2 = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *plane = x + (n * C + c) * HW;
      float acc[LANES] = {0};
      int64_t i = 0;
      for (; i + LANES <= HW; i += LANES)
        for (int j = 0; j < LANES; j++) {
          float d = plane[i + j] - mf;
          acc[j] += d * d;
        }
      for (; i < HW; i++) {
        float d = plane[i] - mf;
        s2 += d * d;
      }
      for (int j = 0; j < LANES; j++) s2 += acc[j];
    }
    double var = s2 / (double)count;
    mean[c] = mf;
    invstd[c] = (float)(1.0 / sqrt(var + eps));
    running_update(running_mean, running_var, c, m, var, count, momentum);
  }
  return DDP_OK;
}

void ddp__cpu_batch_norm_running(float *restrict mean, float *restrict invstd,
                                 const float *restrict running_mean,
                                 const float *restrict running_var, int64_t C, float eps) {
  for (int64_t c = 0; c < C; c++) {
    mean[c] = running_mean[c];
    invstd[c] = (float)(1.0 / sqrt((double)running_var[c] + eps));
  }
}

/* Normalise and apply the affine transform in one pass:
 * y = (x - mean) * a + bias with a = invstd * weight. (Folding the mean into
 * the bias, x * a + (bias - mean * a), saves nothing and cancels badly when
 * |mean| >> std.) */
void ddp__cpu_batch_norm_forward(float *restrict y, const float *restrict x,
                                 const float *restrict mean, const float *restrict invstd,
                                 const float *restrict weight, const float *restrict bias,
                                 int64_t N, int64_t C, int64_t HW) {
  if (HW == 1) {
    for (int64_t n = 0; n < N; n++) {
      const float *row = x + n * C;
      float *out = y + n * C;
      for (int64_t c = 0; c < C; c++) {
        float a = invstd[c] * (weight ? weight[c] : 1.0f);
        out[c] = (row[c] - mean[c]) * a + (bias ? bias[c] : 0.0f);
      }
    }
    return;
  }
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++) {
      float a = invstd[c] * (weight ? weight[c] : 1.0f);
      float b = bias ? bias[c] : 0.0f, m = mean[c];
      const float *plane = x + (n * C + c) * HW;
      float *out = y + (n * C + c) * HW;
      for (int64_t i = 0; i < HW; i++) out[i] = (plane[i] - m) * a + b;
    }
}

/* With xhat = (x - mean) * invstd, y = weight * xhat + bias, M = N * HW:
 *   dbias = sum(dy), dweight = sum(dy * xhat)
 *   training: dx = weight * invstd * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M)
 *   eval:     dx = weight * invstd * dy
 * The dx loop is one pass: dx += k_dy * dy + k_x * (x - mean) + k_0.
 * The backward is two phases, sums then dx; the plain kernel runs them per
 * channel (a channel's planes stay in cache between the two), the
 * synchronized one runs each over all channels with the cross-rank
 * reduction of the sums between them. A pooled gradient (ddp__bn_grad) is
 * scattered into its plane of scratch again in each phase: remaking a
 * plane in cache costs less than keeping the dense gradient. */
static void bn_dx_coefficients(float *k_dy, float *k_x, float *k_0, double sum_dy,
                               double sum_dy_xmu, float invstd, float weight, double count,
                               bool batch_stats) {
  double a = (double)weight * invstd;
  double kx = 0, k0 = 0;
  if (batch_stats) {
    kx = -a * (double)invstd * invstd * sum_dy_xmu / count;
    k0 = -a * sum_dy / count;
  }
  *k_dy = (float)a;
  *k_x = (float)kx;
  *k_0 = (float)k0;
}

/* Plane (n, c) of the gradient: the dense one's, or the pooled one
 * scattered into dy->scratch by max pooling's own backward (so the values,
 * and the order in which overlapping windows add up, are the composed
 * ops'). Valid until the next call. */
static const float *grad_plane(const ddp__bn_grad *dy, int64_t n, int64_t C, int64_t HW,
                               int64_t c) {
  const int64_t p = n * C + c;
  if (dy->dense) return dy->dense + p * HW;
  const int64_t at = p * dy->oh * dy->ow;
  const char *arg = (const char *)dy->argmax + at * ddp__pool_arg_bytes(dy->kernel);
  ddp__cpu_max_pool2d_backward(dy->scratch, dy->pooled + at, arg, 1, dy->h, dy->w,
                               dy->kernel, dy->stride, dy->oh, dy->ow, false);
  return dy->scratch;
}

/* Starts loading plane (n, c) of x and of the gradient (the dense one, or
 * the pooled one's two arrays). The channel-major walk reads a short
 * chunk of each array and then jumps C planes on, which the hardware
 * prefetchers pick up late; the kernels ask for the next plane while they
 * work on this one. */
static void prefetch_plane(const ddp__bn_grad *dy, const float *x, int64_t n, int64_t C,
                           int64_t HW, int64_t c) {
  const int64_t p = n * C + c;
  prefetch_range(x + p * HW, (size_t)HW * sizeof(float));
  if (dy->dense) {
    prefetch_range(dy->dense + p * HW, (size_t)HW * sizeof(float));
    return;
  }
  const int64_t ohw = dy->oh * dy->ow;
  prefetch_range(dy->pooled + p * ohw, (size_t)ohw * sizeof(float));
  const int64_t arg_bytes = ddp__pool_arg_bytes(dy->kernel);
  prefetch_range((const char *)dy->argmax + p * ohw * arg_bytes, (size_t)(ohw * arg_bytes));
}

/* The whole gradient of an (N, C) input (HW == 1), dense: a pooled one is
 * scattered into dy->scratch (N * C floats; its windows are 1x1). */
static const float *grad_rows(const ddp__bn_grad *dy, int64_t N, int64_t C) {
  if (dy->dense) return dy->dense;
  ddp__cpu_max_pool2d_backward(dy->scratch, dy->pooled, dy->argmax, N * C, 1, 1, dy->kernel,
                               dy->stride, dy->oh, dy->ow, false);
  return dy->scratch;
}

/* (N, C) input: sdy[c] = sum(dy), sdyx[c] = sum(dy * (x - mean)), row by row. */
static void rows_backward_sums(double *restrict sdy, double *restrict sdyx,
                               const float *restrict dy, const float *restrict x,
                               const float *restrict mean, int64_t N, int64_t C) {
  for (int64_t c = 0; c < C; c++) sdy[c] = 0, sdyx[c] = 0;
  for (int64_t n = 0; n < N; n++) {
    const float *g = dy + n * C, *row = x + n * C;
    for (int64_t c = 0; c < C; c++) {
      sdy[c] += g[c];
      sdyx[c] += g[c] * (row[c] - mean[c]);
    }
  }
}

/* (N, C) input: dx += kdy * dy + kx * (x - mean) + k0 with per-channel k (C
 * each); = instead of += when !accumulate. dx may be x itself. */
static void rows_dx(float *dx, const float *restrict dy, const float *x,
                    const float *restrict mean, const float *restrict kdy,
                    const float *restrict kx, const float *restrict k0, int64_t N, int64_t C,
                    bool accumulate) {
  for (int64_t n = 0; n < N; n++) {
    const float *g = dy + n * C, *row = x + n * C;
    float *d = dx + n * C;
    for (int64_t c = 0; c < C; c++)
      d[c] = (accumulate ? d[c] : 0.0f) + kdy[c] * g[c] + kx[c] * (row[c] - mean[c]) + k0[c];
  }
}

/* (N, C, HW) input, channel c: the two sums of rows_backward_sums. */
static void channel_backward_sums(double *sdy_out, double *sdyx_out, const ddp__bn_grad *dy,
                                  const float *restrict x, float m, int64_t N, int64_t C,
                                  int64_t HW, int64_t c) {
  double sdy = 0, sdyx = 0;
  for (int64_t n = 0; n < N; n++) {
    if (n + 1 < N) prefetch_plane(dy, x, n + 1, C, HW, c);
    const float *g = grad_plane(dy, n, C, HW, c), *plane = x + (n * C + c) * HW;
    float a1[LANES] = {0}, a2[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= HW; i += LANES)
      for (int j = 0; j < LANES; j++) {
        a1[j] += g[i + j];
        a2[j] += g[i + j] * (plane[i + j] - m);
      }
    for (; i < HW; i++) {
      sdy += g[i];
      sdyx += g[i] * (plane[i] - m);
    }
    for (int j = 0; j < LANES; j++) sdy += a1[j], sdyx += a2[j];
  }
  *sdy_out = sdy;
  *sdyx_out = sdyx;
}

/* One plane of dx = kdy * dy + kx * (x - m) + k0, assigned; in place when
 * the gradient took over x's data (the same arithmetic: bitwise equal). */
static void plane_dx(float *restrict d, const float *restrict g, const float *restrict x,
                     float m, float kdy, float kx, float k0, int64_t HW) {
  for (int64_t i = 0; i < HW; i++) d[i] = kdy * g[i] + kx * (x[i] - m) + k0;
}

static void plane_dx_in_place(float *restrict xd, const float *restrict g, float m, float kdy,
                              float kx, float k0, int64_t HW) {
  for (int64_t i = 0; i < HW; i++) xd[i] = kdy * g[i] + kx * (xd[i] - m) + k0;
}

/* (N, C, HW) input, channel c: dx += kdy * dy + kx * (x - m) + k0; = instead
 * of += when !accumulate (one loop each, so assigning never reads dx). dx
 * may be x itself (assigned in place). `prefetch` when the channel is not
 * in cache already (the synchronized kernel's dx phase comes after every
 * channel's sums). */
static void channel_dx(float *dx, const ddp__bn_grad *dy, const float *x, float m, float kdy,
                       float kx, float k0, int64_t N, int64_t C, int64_t HW, int64_t c,
                       bool accumulate, bool prefetch) {
  for (int64_t n = 0; n < N; n++) {
    if (prefetch && n + 1 < N) prefetch_plane(dy, x, n + 1, C, HW, c);
    const float *g = grad_plane(dy, n, C, HW, c), *plane = x + (n * C + c) * HW;
    float *d = dx + (n * C + c) * HW;
    if (accumulate)
      for (int64_t i = 0; i < HW; i++) d[i] += kdy * g[i] + kx * (plane[i] - m) + k0;
    else if (d == plane)
      plane_dx_in_place(d, g, m, kdy, kx, k0, HW);
    else
      plane_dx(d, g, plane, m, kdy, kx, k0, HW);
  }
}

/* dbias += sum(dy), dweight += sum(dy * (x - mean)) * invstd from one channel's sums. */
static void add_affine_grads(float *dweight, float *dbias, int64_t c, double sdy, double sdyx,
                             float invstd) {
  if (dbias) dbias[c] += (float)sdy;
  if (dweight) dweight[c] += (float)(sdyx * invstd);
}

/* (N, C, HW) input, channel c, unsynchronized: the sums, weight and bias
 * gradients from them, and the coefficients of channel c's dx. */
static void channel_backward(float *kdy, float *kx, float *k0, float *dweight, float *dbias,
                             const ddp__bn_grad *dy, const float *x, const float *mean,
                             const float *invstd, const float *weight, int64_t N, int64_t C,
                             int64_t HW, int64_t c, bool batch_stats) {
  double sdy, sdyx;
  channel_backward_sums(&sdy, &sdyx, dy, x, mean[c], N, C, HW, c);
  add_affine_grads(dweight, dbias, c, sdy, sdyx, invstd[c]);
  bn_dx_coefficients(kdy, kx, k0, sdy, sdyx, invstd[c], weight ? weight[c] : 1.0f,
                     (double)(N * HW), batch_stats);
}

ddp_status ddp__cpu_batch_norm_backward(float *dx, float *restrict dweight,
                                        float *restrict dbias, const ddp__bn_grad *dy,
                                        const float *x, const float *restrict mean,
                                        const float *restrict invstd, const float *restrict weight,
                                        int64_t N, int64_t C, int64_t HW, bool batch_stats,
                                        bool accumulate, ddp_arena *arena) {
  double count = (double)(N * HW);
  if (HW == 1) {
    double *s = ddp_arena_alloc(arena, (size_t)C * 2 * sizeof(double));
    float *k = ddp_arena_alloc(arena, (size_t)C * 3 * sizeof(float));
    if (!s || !k)
      return ddp_error(DDP_ERR_NOMEM, "batch_norm backward: no scratch for %lld channels",
                       (long long)C);
    double *sdy = s, *sdyx = s + C;
    const float *g = grad_rows(dy, N, C);
    rows_backward_sums(sdy, sdyx, g, x, mean, N, C);
    /* Per-channel coefficients as three unit-stride vectors for the row loop. */
    float *kdy = k, *kx = k + C, *k0 = k + 2 * C;
    for (int64_t c = 0; c < C; c++) {
      add_affine_grads(dweight, dbias, c, sdy[c], sdyx[c], invstd[c]);
      bn_dx_coefficients(&kdy[c], &kx[c], &k0[c], sdy[c], sdyx[c], invstd[c],
                         weight ? weight[c] : 1.0f, count, batch_stats);
    }
    if (dx) rows_dx(dx, g, x, mean, kdy, kx, k0, N, C, accumulate);
    return DDP_OK;
  }
  for (int64_t c = 0; c < C; c++) {
    float kdy, kx, k0;
    channel_backward(&kdy, &kx, &k0, dweight, dbias, dy, x, mean, invstd, weight, N, C, HW, c,
                     batch_stats);
    /* no prefetch: the sums have just brought the channel into cache */
    if (dx) channel_dx(dx, dy, x, mean[c], kdy, kx, k0, N, C, HW, c, accumulate, false);
  }
  return DDP_OK;
}

/* One plane's windows: s1 = sum of g, s2 = sum of g * (v - m), over the
 * windows relu left open (argmax not -1). */
static void window_sums_portable(float *s1, float *s2, const float *restrict g,
                                 const void *argmax, int64_t arg_bytes,
                                 const float *restrict v, float m, int64_t n) {
  float a1 = 0.0f, a2 = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    if (ddp__pool_arg_get(argmax, i, arg_bytes) >= 0) a1 += g[i], a2 += g[i] * (v[i] - m);
  }
  *s1 = a1;
  *s2 = a2;
}

/* The same for one-byte argmax, 16 windows a step: closed windows' lanes
 * load nothing and add nothing. */
__attribute__((target("avx512f"))) static void
window_sums_avx512(float *s1, float *s2, const float *restrict g, const int8_t *argmax,
                   const float *restrict v, float m, int64_t n) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i at = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(argmax + i)));
    const __mmask16 open = _mm512_cmpge_epi32_mask(at, _mm512_setzero_si512());
    const __m512 gv = _mm512_maskz_loadu_ps(open, g + i);
    a1 = _mm512_add_ps(a1, gv);
    a2 = _mm512_fmadd_ps(gv, _mm512_maskz_sub_ps(open, _mm512_maskz_loadu_ps(open, v + i), mv),
                         a2);
  }
  float t1, t2;
  window_sums_portable(&t1, &t2, g + i, argmax + i, 1, v + i, m, n - i);
  *s1 = _mm512_reduce_add_ps(a1) + t1;
  *s2 = _mm512_reduce_add_ps(a2) + t2;
}

/* Plane p's share of its channel's backward sums, from the pooled gradient
 * and x's values at the windows' maxima: *sdy += sum(dy), *sdyx += sum(dy *
 * (x - m)), the sums channel_backward_sums takes over the scattered planes
 * (windows sharing a max each add their own term, which the scatter would
 * have added first). */
static void window_backward_sums(double *sdy, double *sdyx, const ddp__bn_grad *dy,
                                 const float *argval, float m, int64_t p) {
  const int64_t ohw = dy->oh * dy->ow, arg_bytes = ddp__pool_arg_bytes(dy->kernel);
  const void *arg = (const char *)dy->argmax + p * ohw * arg_bytes;
  float s1, s2;
  if (arg_bytes == 1 && ddp__cpu_has_avx512())
    window_sums_avx512(&s1, &s2, dy->pooled + p * ohw, arg, argval + p * ohw, m, ohw);
  else if (arg_bytes == 1 && ddp__cpu_has_avx2())
    ddp__cpu_window_sums_avx2(&s1, &s2, dy->pooled + p * ohw, arg, argval + p * ohw, m, ohw);
  else
    window_sums_portable(&s1, &s2, dy->pooled + p * ohw, arg, arg_bytes, argval + p * ohw, m, ohw);
  *sdy += s1;
  *sdyx += s2;
}

/* Starts loading plane p's windows: gradient, argmax and x's values. */
static void prefetch_windows(const ddp__bn_grad *dy, const float *argval, int64_t p) {
  const int64_t ohw = dy->oh * dy->ow, arg_bytes = ddp__pool_arg_bytes(dy->kernel);
  prefetch_range(dy->pooled + p * ohw, (size_t)ohw * sizeof(float));
  prefetch_range(argval + p * ohw, (size_t)ohw * sizeof(float));
  prefetch_range((const char *)dy->argmax + p * ohw * arg_bytes, (size_t)(ohw * arg_bytes));
}

/* Batch norm's backward with the convolution that made x folded in
 * (kernels_pointwise.h). Per channel c, with dx = kdy dy + kx (x - m) + k0
 * (bn_dx_coefficients, in double) and patch(n, y, x) the convolution's
 * input taps at an output position:
 *   conv_dw[c] += kdy * sum dy patch + kx * sum (x - m) patch + k0 * sum patch
 *   conv_db[c] += kdy * sum dy       + kx * sum (x - m)       + k0 * count
 * The first terms fold the scattered gradient planes (conv_fold.c). x is
 * w[c] . patch + b[c], so sum (x - m) patch = w[c] gram + (b[c] - m) psum
 * and sum (x - m) = w[c] . psum + count (b[c] - m), from the patches' sums
 * (ddp__cpu_conv2d_fold_gram), with no pass over x: the forward has let x
 * go, and batch norm's own sums come from x's values at the windows'
 * maxima, the only places where dy is not 0. */
ddp_status ddp__cpu_batch_norm_backward_conv(float *restrict dweight, float *restrict dbias,
                                             const ddp__bn_grad *dy, const float *argval,
                                             const float *restrict mean,
                                             const float *restrict invstd,
                                             const float *restrict weight, int64_t N, int64_t C,
                                             int64_t HW, bool batch_stats,
                                             const ddp__conv2d_geom *g, const float *conv_x,
                                             const float *conv_w, const float *conv_b,
                                             float *conv_dw, float *conv_db, ddp_arena *arena) {
  ddp__conv2d_fold f;
  DDP_TRY(ddp__cpu_conv2d_fold_init(&f, conv_x, g, arena));
  const int64_t k = f.k;
  float *s1 = ddp_arena_alloc(arena, (size_t)k * sizeof(float));
  double *gram = batch_stats ? ddp_arena_alloc(arena, (size_t)(k * k) * sizeof(double)) : NULL;
  double *psum = batch_stats ? ddp_arena_alloc(arena, (size_t)k * sizeof(double)) : NULL;
  if (!s1 || (batch_stats && (!gram || !psum)))
    return ddp_error(DDP_ERR_NOMEM, "batch_norm backward (convolution folded in): no scratch "
                     "for %lld taps", (long long)k);
  if (batch_stats) DDP_TRY(ddp__cpu_conv2d_fold_gram(&f, gram, psum, arena));
  const double count = (double)(N * HW);
  /* a plane's windows are little work (the ConvNet's: 196), so the loads
   * are asked for several planes ahead */
  enum { AHEAD = 4 };
  for (int64_t c = 0; c < C; c++) {
    /* One pass over the channel's planes: batch norm's sums from the
     * windows, and sum dy patch and sum dy from the scattered planes. */
    double sdy = 0, sdyx = 0;
    for (int64_t n = 0; n < AHEAD && n < N; n++) prefetch_windows(dy, argval, n * C + c);
    for (int64_t n = 0; n < N; n++) {
      if (n + AHEAD < N) prefetch_windows(dy, argval, (n + AHEAD) * C + c);
      window_backward_sums(&sdy, &sdyx, dy, argval, mean[c], n * C + c);
      ddp__cpu_conv2d_fold_plane(&f, grad_plane(dy, n, C, HW, c), n);
    }
    float s1_bias = 0.0f;
    memset(s1, 0, (size_t)k * sizeof(float));
    ddp__cpu_conv2d_fold_channel(&f, s1, &s1_bias);
    add_affine_grads(dweight, dbias, c, sdy, sdyx, invstd[c]);
    const double a = (double)(weight ? weight[c] : 1.0f) * invstd[c];
    const double kx = batch_stats ? -a * (double)invstd[c] * invstd[c] * sdyx / count : 0.0;
    const double k0 = batch_stats ? -a * sdy / count : 0.0;
    const float *wc = conv_w + c * k;
    const double bm = (conv_b ? conv_b[c] : 0.0f) - (double)mean[c];
    if (conv_dw)
      for (int64_t t = 0; t < k; t++) {
        double v = a * s1[t];
        if (batch_stats) {
          double xm = bm * psum[t]; /* sum (x - m) patch[t] */
          for (int64_t u = 0; u < k; u++) xm += (double)wc[u] * gram[u * k + t];
          v += kx * xm + k0 * psum[t];
        }
        conv_dw[c * k + t] += (float)v;
      }
    if (conv_db) {
      double v = a * s1_bias;
      if (batch_stats) {
        double xm = count * bm; /* sum (x - m) */
        for (int64_t u = 0; u < k; u++) xm += (double)wc[u] * psum[u];
        v += kx * xm + k0 * count;
      }
      conv_db[c] += (float)v;
    }
  }
  return DDP_OK;
}

/* ---- synchronized batch norm: the phases apart ---- */

void ddp__cpu_batch_norm_sums(double *restrict sums, const float *restrict x, int64_t N, int64_t C,
                              int64_t HW) {
  double *s1 = sums, *s2 = sums + C;
  if (HW == 1) {
    for (int64_t c = 0; c < C; c++) s1[c] = 0, s2[c] = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *row = x + n * C;
      for (int64_t c = 0; c < C; c++) {
        double v = row[c];
        s1[c] += v;
        s2[c] += v * v;
      }
    }
    return;
  }
  /* Double lanes: x^2 of a float is exact in double, and the sums feed a
   * difference (E[x^2] - E[x]^2) that float lanes would leave too coarse. */
  enum { DLANES = 8 };
  for (int64_t c = 0; c < C; c++) {
    double a1[DLANES] = {0}, a2[DLANES] = {0};
    double t1 = 0, t2 = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *plane = x + (n * C + c) * HW;
      if (n + 1 < N) prefetch_range(plane + C * HW, (size_t)HW * sizeof(float));
      int64_t i = 0;
      for (; i + DLANES <= HW; i += DLANES)
        for (int j = 0; j < DLANES; j++) {
          double v = plane[i + j];
          a1[j] += v;
          a2[j] += v * v;
        }
      for (; i < HW; i++) {
        double v = plane[i];
        t1 += v;
        t2 += v * v;
      }
    }
    for (int j = 0; j < DLANES; j++) t1 += a1[j], t2 += a2[j];
    s1[c] = t1;
    s2[c] = t2;
  }
}

void ddp__cpu_batch_norm_stats_from_sums(float *restrict mean, float *restrict invstd,
                                         float *running_mean, float *running_var,
                                         const double *restrict sums, int64_t count, int64_t C,
                                         float momentum, float eps) {
  for (int64_t c = 0; c < C; c++) {
    double m = sums[c] / (double)count;
    double var = sums[C + c] / (double)count - m * m;
    var = var > 0 ? var : 0;
    mean[c] = (float)m;
    invstd[c] = (float)(1.0 / sqrt(var + eps));
    running_update(running_mean, running_var, c, m, var, count, momentum);
  }
}

void ddp__cpu_batch_norm_backward_reduce(double *restrict sums, float *restrict dweight,
                                         float *restrict dbias, const ddp__bn_grad *dy,
                                         const float *restrict x, const float *restrict mean,
                                         const float *restrict invstd, int64_t N, int64_t C,
                                         int64_t HW) {
  double *sdy = sums, *sdyx = sums + C;
  if (HW == 1)
    rows_backward_sums(sdy, sdyx, grad_rows(dy, N, C), x, mean, N, C);
  else
    for (int64_t c = 0; c < C; c++)
      channel_backward_sums(&sdy[c], &sdyx[c], dy, x, mean[c], N, C, HW, c);
  for (int64_t c = 0; c < C; c++) add_affine_grads(dweight, dbias, c, sdy[c], sdyx[c], invstd[c]);
}

ddp_status ddp__cpu_batch_norm_backward_dx(float *dx, const ddp__bn_grad *dy,
                                           const float *x, const float *restrict mean,
                                           const float *restrict invstd,
                                           const float *restrict weight,
                                           const double *restrict sums, int64_t count, int64_t N,
                                           int64_t C, int64_t HW, bool accumulate,
                                           ddp_arena *arena) {
  float *k = ddp_arena_alloc(arena, (size_t)C * 3 * sizeof(float));
  if (!k)
    return ddp_error(DDP_ERR_NOMEM, "sync_batch_norm backward: no scratch for %lld channels",
                     (long long)C);
  float *kdy = k, *kx = k + C, *k0 = k + 2 * C;
  for (int64_t c = 0; c < C; c++)
    bn_dx_coefficients(&kdy[c], &kx[c], &k0[c], sums[c], sums[C + c], invstd[c],
                       weight ? weight[c] : 1.0f, (double)count, true);
  if (HW == 1) {
    rows_dx(dx, grad_rows(dy, N, C), x, mean, kdy, kx, k0, N, C, accumulate);
    return DDP_OK;
  }
  for (int64_t c = 0; c < C; c++)
    channel_dx(dx, dy, x, mean[c], kdy[c], kx[c], k0[c], N, C, HW, c, accumulate, true);
  return DDP_OK;
}
