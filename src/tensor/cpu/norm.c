/* CPU batch-norm kernels (see cpu/pointwise.h). */
#include "tensor/cpu/pointwise.h"

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

ddp_status ddp__cpu_batch_norm_backward(float *restrict dx, float *restrict dweight,
                                        float *restrict dbias, const float *restrict dy,
                                        const float *restrict x, const float *restrict mean,
                                        const float *restrict invstd, const float *restrict weight,
                                        int64_t N, int64_t C, int64_t HW, bool batch_stats,
                                        ddp_arena *arena) {
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
