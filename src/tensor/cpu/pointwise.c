/* CPU pointwise kernels: activations, dropout, batch norm, log_softmax and
 * the losses. Plain loops over restrict pointers that GCC vectorises at -O2;
 * reductions keep 16 independent float lanes (so they vectorise without
 * -ffast-math) and add the lanes up in double. exp and tanh are our own
 * branch-free versions (Cephes polynomials) so that they vectorise too. */
/* GCC 12 at -O2 uses the "very-cheap" vectoriser cost model, which leaves
 * any loop whose trip count is not a known multiple of the vector width
 * scalar (all of ours). The dynamic model vectorises them with an epilogue. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic")
#endif

#include <math.h>
#include <string.h>

#include "tensor/kernels_pointwise.h"

#define LANES 16

/* ---- vectorisable exp / tanh ---------------------------------------------
 * exp_f32: Cephes expf, relative error about 1 ulp on [-87.3, 88]. Below
 * -87.3 it returns 0 (the true value is subnormal or 0); above 88 it returns
 * exp(88) (about 1.65e38), which the callers (sigmoid, tanh) only ever add 1
 * to and divide by. */
static inline float exp_f32(float x) {
  /* Comparisons, not fminf/floorf: GCC vectorises selects but not those calls. */
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  xc = xc != xc ? 0.0f : xc;
  /* n = round(xc / ln 2): adding 1.5 * 2^23 rounds to an integer. */
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  /* 2^n through the exponent bits; n is in [-126, 127] here. */
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  float y = x < -87.3f ? 0.0f : p * scale;
  return x != x ? x : y; /* NaN in, NaN out */
}

/* Cephes tanhf: an odd polynomial for |x| < 0.625, 1 - 2 / (exp(2|x|) + 1)
 * above it; both computed, one selected, so the loop stays branch-free. */
static inline float tanh_f32(float x) {
  float a = x < 0 ? -x : x;
  float e = exp_f32(a + a);
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = x < 0 ? -big : big;
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * x + x;
  return a < 0.625f ? small : big;
}

/* sum(x) over n contiguous floats, lane-parallel, returned in double. */
static inline double sum_f32(const float *restrict x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
  double s = 0;
  for (; i < n; i++) s += x[i];
  for (int j = 0; j < LANES; j++) s += acc[j];
  return s;
}

/* ---- activations ---- */

static void cpu_relu(float *restrict y, const float *restrict x, int64_t n) {
  /* NaN propagates, as torch.relu does. */
  for (int64_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

static void cpu_relu_backward(float *restrict dx, const float *restrict dy,
                              const float *restrict y, int64_t n) {
  /* y > 0 exactly where x > 0: the gradient is 0 at x <= 0. */
  for (int64_t i = 0; i < n; i++) {
    float g = dy[i]; /* loaded unconditionally: a select, not a masked load */
    dx[i] += y[i] > 0.0f ? g : 0.0f;
  }
}

static void cpu_sigmoid(float *restrict y, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + exp_f32(-x[i]));
}

static void cpu_sigmoid_backward(float *restrict dx, const float *restrict dy,
                                 const float *restrict y, int64_t n) {
  for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * y[i] * (1.0f - y[i]);
}

static void cpu_tanh(float *restrict y, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = tanh_f32(x[i]);
}

static void cpu_tanh_backward(float *restrict dx, const float *restrict dy,
                              const float *restrict y, int64_t n) {
  for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * (1.0f - y[i] * y[i]);
}

/* ---- dropout ---- */

static void cpu_dropout_mask(uint8_t *restrict mask, int64_t groups, float p, ddp_rng *rng) {
  if (p >= 1.0f) {
    memset(mask, 0, (size_t)groups);
    return;
  }
  /* ddp_rng_uniform(rng) is k * 2^-24 with k = ddp_rng_next(rng) >> 40, and
   * k * 2^-24 < p exactly when k < ceil(p * 2^24): the same mask as comparing
   * uniforms, without the float conversion or the second call. */
  uint64_t threshold = (uint64_t)ceilf(p * 16777216.0f);
  for (int64_t i = 0; i < groups; i++) mask[i] = (ddp_rng_next(rng) >> 40) >= threshold;
}

static void cpu_dropout_apply(float *restrict y, const float *restrict x,
                              const uint8_t *restrict mask, int64_t groups, int64_t group_size,
                              float scale) {
  if (group_size == 1) {
    for (int64_t i = 0; i < groups; i++) y[i] = x[i] * ((float)mask[i] * scale);
    return;
  }
  for (int64_t g = 0; g < groups; g++) {
    /* A multiply, not a store of 0: NaN and inf stay NaN, as in PyTorch. */
    float s = (float)mask[g] * scale;
    const float *xg = x + g * group_size;
    float *yg = y + g * group_size;
    for (int64_t i = 0; i < group_size; i++) yg[i] = xg[i] * s;
  }
}

static void cpu_dropout_backward(float *restrict dx, const float *restrict dy,
                                 const uint8_t *restrict mask, int64_t groups,
                                 int64_t group_size, float scale) {
  if (group_size == 1) {
    for (int64_t i = 0; i < groups; i++) dx[i] += dy[i] * ((float)mask[i] * scale);
    return;
  }
  for (int64_t g = 0; g < groups; g++) {
    if (!mask[g]) continue;
    const float *dyg = dy + g * group_size;
    float *dxg = dx + g * group_size;
    for (int64_t i = 0; i < group_size; i++) dxg[i] += dyg[i] * scale;
  }
}

/* ---- batch norm ----
 * x is (N, C, HW): channel c is N planes of HW contiguous floats. For HW > 1
 * we go channel by channel (the channel's planes stay in cache between the
 * passes); for HW == 1 ((N, C) input, BatchNorm1d) row by row, vectorising
 * across channels with per-channel double accumulators from the arena. */

static void running_update(float *running_mean, float *running_var, int64_t c, double mean,
                           double var, int64_t count, float momentum) {
  if (!running_mean) return;
  double unbiased = count > 1 ? var * (double)count / (double)(count - 1) : var;
  running_mean[c] = (float)((1.0 - momentum) * running_mean[c] + momentum * mean);
  running_var[c] = (float)((1.0 - momentum) * running_var[c] + momentum * unbiased);
}

static ddp_status cpu_batch_norm_stats(float *restrict mean, float *restrict invstd,
                                       float *running_mean, float *running_var,
                                       const float *restrict x, int64_t N, int64_t C,
                                       int64_t HW, float momentum, float eps,
                                       ddp_arena *arena) {
  int64_t count = N * HW;
  if (HW == 1) {
    double *s = ddp_arena_alloc(arena, (size_t)C * 2 * sizeof(double));
    if (!s) return ddp_error(DDP_ERR_NOMEM, "batch_norm: no scratch for %lld channels",
                             (long long)C);
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
  for (int64_t c = 0; c < C; c++) {
    double s1 = 0;
    for (int64_t n = 0; n < N; n++) s1 += sum_f32(x + (n * C + c) * HW, HW);
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

static void cpu_batch_norm_running(float *restrict mean, float *restrict invstd,
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
static void cpu_batch_norm_forward(float *restrict y, const float *restrict x,
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
 * The dx loop is one pass: dx += k_dy * dy + k_x * (x - mean) + k_0. */
static void bn_dx_coefficients(float *k_dy, float *k_x, float *k_0, double sum_dy,
                               double sum_dy_xmu, float invstd, float weight, int64_t count,
                               bool batch_stats) {
  double a = (double)weight * invstd;
  double kx = 0, k0 = 0;
  if (batch_stats) {
    kx = -a * (double)invstd * invstd * sum_dy_xmu / (double)count;
    k0 = -a * sum_dy / (double)count;
  }
  *k_dy = (float)a;
  *k_x = (float)kx;
  *k_0 = (float)k0;
}

static ddp_status cpu_batch_norm_backward(float *restrict dx, float *restrict dweight,
                                          float *restrict dbias, const float *restrict dy,
                                          const float *restrict x, const float *restrict mean,
                                          const float *restrict invstd,
                                          const float *restrict weight, int64_t N, int64_t C,
                                          int64_t HW, bool batch_stats, ddp_arena *arena) {
  int64_t count = N * HW;
  if (HW == 1) {
    double *s = ddp_arena_alloc(arena, (size_t)C * 2 * sizeof(double));
    float *k = ddp_arena_alloc(arena, (size_t)C * 3 * sizeof(float));
    if (!s || !k)
      return ddp_error(DDP_ERR_NOMEM, "batch_norm backward: no scratch for %lld channels",
                       (long long)C);
    double *sdy = s, *sdyx = s + C;
    for (int64_t c = 0; c < C; c++) sdy[c] = 0, sdyx[c] = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *g = dy + n * C, *row = x + n * C;
      for (int64_t c = 0; c < C; c++) {
        sdy[c] += g[c];
        sdyx[c] += g[c] * (row[c] - mean[c]);
      }
    }
    /* Per-channel coefficients as three unit-stride vectors for the row loop. */
    float *kdy = k, *kx = k + C, *k0 = k + 2 * C;
    for (int64_t c = 0; c < C; c++) {
      if (dbias) dbias[c] += (float)sdy[c];
      if (dweight) dweight[c] += (float)(sdyx[c] * invstd[c]);
      bn_dx_coefficients(&kdy[c], &kx[c], &k0[c], sdy[c], sdyx[c], invstd[c],
                         weight ? weight[c] : 1.0f, count, batch_stats);
    }
    if (!dx) return DDP_OK;
    for (int64_t n = 0; n < N; n++) {
      const float *g = dy + n * C, *row = x + n * C;
      float *d = dx + n * C;
      for (int64_t c = 0; c < C; c++) d[c] += kdy[c] * g[c] + kx[c] * (row[c] - mean[c]) + k0[c];
    }
    return DDP_OK;
  }
  for (int64_t c = 0; c < C; c++) {
    float m = mean[c];
    double sdy = 0, sdyx = 0;
    for (int64_t n = 0; n < N; n++) {
      const float *g = dy + (n * C + c) * HW, *plane = x + (n * C + c) * HW;
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
    if (dbias) dbias[c] += (float)sdy;
    if (dweight) dweight[c] += (float)(sdyx * invstd[c]);
    if (!dx) continue;
    float kdy, kx, k0;
    bn_dx_coefficients(&kdy, &kx, &k0, sdy, sdyx, invstd[c], weight ? weight[c] : 1.0f, count,
                       batch_stats);
    for (int64_t n = 0; n < N; n++) {
      const float *g = dy + (n * C + c) * HW, *plane = x + (n * C + c) * HW;
      float *d = dx + (n * C + c) * HW;
      for (int64_t i = 0; i < HW; i++) d[i] += kdy * g[i] + kx * (plane[i] - m) + k0;
    }
  }
  return DDP_OK;
}

/* ---- log_softmax and the losses ---- */

static float row_max(const float *restrict x, int64_t C) {
  float acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
  int64_t j = 0;
  for (; j + LANES <= C; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] = x[j + l] > acc[l] ? x[j + l] : acc[l];
  float m = -INFINITY;
  for (; j < C; j++) m = x[j] > m ? x[j] : m;
  for (int l = 0; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
  return m;
}

/* One row's softmax statistics: its max m and log_sum = log sum_j exp(x[j] - m).
 * Callers form log-probabilities as (x - m) - log_sum, which keeps float
 * precision even for logits near 1e3 (x - (m + log_sum) would not). An
 * infinite max gives log_sum 0, so the row comes out NaN / -inf as in PyTorch. */
static void row_softmax_stats(const float *restrict x, int64_t C, float *max, float *log_sum) {
  float m = row_max(x, C);
  *max = m;
  *log_sum = 0.0f;
  if (m == -INFINITY || m == INFINITY) return;
  float acc[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= C; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += exp_f32(x[j + l] - m);
  double s = 0;
  for (; j < C; j++) s += exp_f32(x[j] - m);
  for (int l = 0; l < LANES; l++) s += acc[l];
  *log_sum = (float)log(s);
}

static void cpu_log_softmax(float *restrict y, const float *restrict x, int64_t rows,
                            int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * C;
    float *yr = y + r * C;
    float m, log_sum;
    row_softmax_stats(xr, C, &m, &log_sum);
    for (int64_t j = 0; j < C; j++) yr[j] = (xr[j] - m) - log_sum;
  }
}

static void cpu_log_softmax_backward(float *restrict dx, const float *restrict dy,
                                     const float *restrict y, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float *g = dy + r * C, *yr = y + r * C;
    float *d = dx + r * C;
    float s = (float)sum_f32(g, C);
    for (int64_t j = 0; j < C; j++) d[j] += g[j] - exp_f32(yr[j]) * s;
  }
}

static void cpu_mse_loss(float *loss, const float *restrict input, const float *restrict target,
                         int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) {
      float d = input[i + j] - target[i + j];
      acc[j] += d * d;
    }
  double s = 0;
  for (; i < n; i++) {
    float d = input[i] - target[i];
    s += d * d;
  }
  for (int j = 0; j < LANES; j++) s += acc[j];
  *loss = (float)(s / (double)n);
}

static void cpu_mse_loss_backward(float *restrict dinput, float *restrict dtarget,
                                  const float *dloss, const float *restrict input,
                                  const float *restrict target, int64_t n) {
  float k = 2.0f * *dloss / (float)n;
  if (dinput)
    for (int64_t i = 0; i < n; i++) dinput[i] += k * (input[i] - target[i]);
  if (dtarget)
    for (int64_t i = 0; i < n; i++) dtarget[i] -= k * (input[i] - target[i]);
}

/* The first sample whose target is outside [0, C), or -1. */
static int64_t first_bad_target(const int64_t *restrict target, int64_t N, int64_t C,
                                int64_t *bad_target) {
  for (int64_t i = 0; i < N; i++)
    if (target[i] < 0 || target[i] >= C) {
      *bad_target = target[i];
      return i;
    }
  return -1;
}

static int64_t cpu_nll_loss(float *loss, const float *restrict logp,
                            const int64_t *restrict target, int64_t N, int64_t C,
                            int64_t *bad_target) {
  int64_t bad = first_bad_target(target, N, C, bad_target);
  if (bad >= 0) return bad;
  double s = 0;
  for (int64_t i = 0; i < N; i++) s += logp[i * C + target[i]];
  *loss = (float)(-s / (double)N);
  return -1;
}

static void cpu_nll_loss_backward(float *restrict dlogp, const float *dloss,
                                  const int64_t *restrict target, int64_t N, int64_t C) {
  float g = -*dloss / (float)N;
  for (int64_t i = 0; i < N; i++) dlogp[i * C + target[i]] += g;
}

static int64_t cpu_cross_entropy(float *loss, float *restrict stats, const float *restrict logits,
                                 const int64_t *restrict target, int64_t N, int64_t C,
                                 int64_t *bad_target) {
  int64_t bad = first_bad_target(target, N, C, bad_target);
  if (bad >= 0) return bad;
  double s = 0;
  for (int64_t i = 0; i < N; i++) {
    const float *xr = logits + i * C;
    row_softmax_stats(xr, C, &stats[2 * i], &stats[2 * i + 1]);
    s += (double)stats[2 * i + 1] - (xr[target[i]] - stats[2 * i]);
  }
  *loss = (float)(s / (double)N);
  return -1;
}

static void cpu_cross_entropy_backward(float *restrict dlogits, const float *dloss,
                                       const float *restrict logits,
                                       const float *restrict stats,
                                       const int64_t *restrict target, int64_t N, int64_t C) {
  float g = *dloss / (float)N;
  for (int64_t i = 0; i < N; i++) {
    const float *xr = logits + i * C;
    float *d = dlogits + i * C;
    float m = stats[2 * i], log_sum = stats[2 * i + 1];
    for (int64_t j = 0; j < C; j++) d[j] += g * exp_f32((xr[j] - m) - log_sum);
    d[target[i]] -= g;
  }
}

const ddp__pointwise_kernels ddp__cpu_pointwise_kernels = {
    .relu = cpu_relu,
    .relu_backward = cpu_relu_backward,
    .sigmoid = cpu_sigmoid,
    .sigmoid_backward = cpu_sigmoid_backward,
    .tanh = cpu_tanh,
    .tanh_backward = cpu_tanh_backward,
    .dropout_mask = cpu_dropout_mask,
    .dropout_apply = cpu_dropout_apply,
    .dropout_backward = cpu_dropout_backward,
    .batch_norm_stats = cpu_batch_norm_stats,
    .batch_norm_running = cpu_batch_norm_running,
    .batch_norm_forward = cpu_batch_norm_forward,
    .batch_norm_backward = cpu_batch_norm_backward,
    .log_softmax = cpu_log_softmax,
    .log_softmax_backward = cpu_log_softmax_backward,
    .mse_loss = cpu_mse_loss,
    .mse_loss_backward = cpu_mse_loss_backward,
    .nll_loss = cpu_nll_loss,
    .nll_loss_backward = cpu_nll_loss_backward,
    .cross_entropy = cpu_cross_entropy,
    .cross_entropy_backward = cpu_cross_entropy_backward,
};
