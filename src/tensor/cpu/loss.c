/* CPU log_softmax and loss kernels (see cpu/pointwise.h). */
#include "tensor/cpu/pointwise.h"

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

void ddp__cpu_log_softmax(float *restrict y, const float *restrict x, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * C;
    float *yr = y + r * C;
    float m, log_sum;
    row_softmax_stats(xr, C, &m, &log_sum);
    for (int64_t j = 0; j < C; j++) yr[j] = (xr[j] - m) - log_sum;
  }
}

void ddp__cpu_log_softmax_backward(float *restrict dx, const float *restrict dy,
                                   const float *restrict y, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float *g = dy + r * C, *yr = y + r * C;
    float *d = dx + r * C;
    float s = (float)sum_f32(g, C);
    for (int64_t j = 0; j < C; j++) d[j] += g[j] - exp_f32(yr[j]) * s;
  }
}

void ddp__cpu_mse_loss(float *loss, const float *restrict input, const float *restrict target,
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

void ddp__cpu_mse_loss_backward(float *restrict dinput, float *restrict dtarget, const float *dloss,
                                const float *restrict input, const float *restrict target,
                                int64_t n) {
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

int64_t ddp__cpu_nll_loss(float *loss, const float *restrict logp, const int64_t *restrict target,
                          int64_t N, int64_t C, int64_t *bad_target) {
  int64_t bad = first_bad_target(target, N, C, bad_target);
  if (bad >= 0) return bad;
  double s = 0;
  for (int64_t i = 0; i < N; i++) s += logp[i * C + target[i]];
  *loss = (float)(-s / (double)N);
  return -1;
}

void ddp__cpu_nll_loss_backward(float *restrict dlogp, const float *dloss,
                                const int64_t *restrict target, int64_t N, int64_t C) {
  float g = -*dloss / (float)N;
  for (int64_t i = 0; i < N; i++) dlogp[i * C + target[i]] += g;
}

int64_t ddp__cpu_cross_entropy(float *loss, float *restrict stats, const float *restrict logits,
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

void ddp__cpu_cross_entropy_backward(float *restrict dlogits, const float *dloss,
                                     const float *restrict logits, const float *restrict stats,
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
