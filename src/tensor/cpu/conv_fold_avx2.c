/* The AVX2 family's fold kernel (cpu/conv_fold.c's fold_plane): one output
 * channel's gradient plane dy (oh, ow) of one sample added into the
 * partial sums of every tap and of the bias, 8 lanes a vector.
 *
 * The AVX-512 kernel keeps a whole row (up to 2 x 16 lanes) in registers
 * with a sliding window of KH gradient rows per half: 4 KH registers, too
 * many for AVX2's 16 at a 5x5 kernel. Here a pass takes one column of 8
 * outputs [x0, x0 + 8) down the plane, with its window of KH gradient rows
 * and KH sums (2 KH + 1 registers), and a row takes ceil(ow / 8) passes.
 * Each tap's 16 partial-sum lanes (fold_channel sums them all) take even
 * columns in lanes 0-7 and odd ones in 8-15. Loads under a lane mask read
 * nothing past a row's last element, as the AVX-512 kernel's do. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define LANES 16 /* partial sums per tap in f->acc (cpu/conv_fold.c) */
#define WINDOW_MAX 7

#define FOLD_WINDOW(KH)                                                                       \
  AVX2 static void fold_window##KH##_avx2(float *acc, const float *dy, const float *xs,             \
                                   const ddp__conv2d_fold *f, int64_t ci, int64_t b,          \
                                   int64_t x0, __m256i m, int half) {                         \
    const int64_t oh = f->g->oh, ow = f->g->ow, wp = f->wp, kw = f->g->kw;                   \
    __m256 s[KH], w[KH];                                                                      \
    float *at[KH];                                                                            \
    _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++) {                                    \
      at[a] = acc + ((ci * KH + a) * kw + b) * LANES + 8 * half;                              \
      s[a] = _mm256_loadu_ps(at[a]);                                                          \
      w[a] = _mm256_setzero_ps();                                                             \
    }                                                                                         \
    const float *row = xs + ci * f->hp * wp + b + x0;                                         \
    for (int64_t r = 0; r < oh + KH - 1; r++, row += wp) {                                    \
      _Pragma("GCC unroll 8") for (int a = KH - 1; a > 0; a--) w[a] = w[a - 1];               \
      w[0] = r < oh ? _mm256_maskload_ps(dy + r * ow + x0, m) : _mm256_setzero_ps();          \
      const __m256 xv = _mm256_maskload_ps(row, m);                                           \
      _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++) s[a] =                             \
          _mm256_fmadd_ps(w[a], xv, s[a]);                                                    \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++) _mm256_storeu_ps(at[a], s[a]);       \
  }
FOLD_WINDOW(1)
FOLD_WINDOW(2)
FOLD_WINDOW(3)
FOLD_WINDOW(4)
FOLD_WINDOW(5)
FOLD_WINDOW(6)
FOLD_WINDOW(7)

/* Kernels taller than the window: one tap at a time, the same columns. */
AVX2 static void fold_tap_avx2(float *acc, const float *dy, const float *src, int64_t oh, int64_t ow,
                          int64_t wp, int64_t x0, __m256i m) {
  __m256 s0 = _mm256_loadu_ps(acc), s1 = _mm256_setzero_ps();
  int64_t y = 0;
  for (; y + 2 <= oh; y += 2) { /* two chains: no fma waits on the one before */
    s0 = _mm256_fmadd_ps(_mm256_maskload_ps(dy + y * ow + x0, m),
                         _mm256_maskload_ps(src + y * wp + x0, m), s0);
    s1 = _mm256_fmadd_ps(_mm256_maskload_ps(dy + (y + 1) * ow + x0, m),
                         _mm256_maskload_ps(src + (y + 1) * wp + x0, m), s1);
  }
  if (y < oh)
    s0 = _mm256_fmadd_ps(_mm256_maskload_ps(dy + y * ow + x0, m),
                         _mm256_maskload_ps(src + y * wp + x0, m), s0);
  _mm256_storeu_ps(acc, _mm256_add_ps(s0, s1));
}

AVX2 void ddp__cpu_conv2d_fold_plane_avx2(ddp__conv2d_fold *f, const float *dy, const float *xs) {
  typedef void (*window_fn)(float *, const float *, const float *, const ddp__conv2d_fold *,
                            int64_t, int64_t, int64_t, __m256i, int);
  static const window_fn by_height[WINDOW_MAX + 1] = {
      NULL, fold_window1_avx2, fold_window2_avx2, fold_window3_avx2, fold_window4_avx2,
      fold_window5_avx2, fold_window6_avx2, fold_window7_avx2};
  const int64_t oh = f->g->oh, ow = f->g->ow, wp = f->wp, k = f->k;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 bias0 = _mm256_loadu_ps(f->acc + k * LANES), bias1 = _mm256_loadu_ps(f->acc + k * LANES + 8);
  for (int64_t x0 = 0, j = 0; x0 < ow; x0 += 8, j++) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(ow - x0)), lane);
    const int half = (int)(j & 1);
    if (f->g->kh <= WINDOW_MAX) {
      for (int64_t ci = 0; ci < f->g->c; ci++)
        for (int64_t b = 0; b < f->g->kw; b++)
          by_height[f->g->kh](f->acc, dy, xs, f, ci, b, x0, m, half);
    } else {
      for (int64_t t = 0; t < k; t++)
        fold_tap_avx2(f->acc + t * LANES + 8 * half, dy, xs + f->off[t], oh, ow, wp, x0, m);
    }
    for (int64_t y = 0; y < oh; y++) {
      const __m256 d = _mm256_maskload_ps(dy + y * ow + x0, m);
      if (half)
        bias1 = _mm256_add_ps(bias1, d);
      else
        bias0 = _mm256_add_ps(bias0, d);
    }
  }
  _mm256_storeu_ps(f->acc + k * LANES, bias0);
  _mm256_storeu_ps(f->acc + k * LANES + 8, bias1);
}

/* fold_gram's correlations (cpu/conv_fold.c's correlate<ND>, 8 lanes):
 * r[d][i] += sum over n of p_n[i] * q_n[i + shift + d] for d < ND, summed
 * over blocks of SAMPLE_BLOCK samples in float registers and added to r
 * (double) per block. Offset d is loaded where it starts (AVX2 has no
 * cross-lane alignr for the AVX-512 kernel's shuffle of two loads). Reads
 * up to |shift| + 16 floats past either end of a plane, inside the slack
 * fold_init leaves. */
#define SAMPLE_BLOCK 32
#define CORRELATE(ND)                                                                         \
  AVX2 static void correlate##ND##_avx2(double *r, const float *p, const float *q,            \
                                        int64_t shift, int64_t n_samples, int64_t sample,     \
                                        int64_t plane) {                                      \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                           \
    for (int64_t i = 0; i < plane; i += 8) {                                                  \
      const int64_t cnt = plane - i < 8 ? plane - i : 8;                                      \
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), lane);               \
      for (int64_t n0 = 0; n0 < n_samples; n0 += SAMPLE_BLOCK) {                              \
        const int64_t n1 = n0 + SAMPLE_BLOCK < n_samples ? n0 + SAMPLE_BLOCK : n_samples;     \
        __m256 acc[ND];                                                                       \
        _Pragma("GCC unroll 9") for (int d = 0; d < ND; d++) acc[d] = _mm256_setzero_ps();    \
        for (int64_t n = n0; n < n1; n++) {                                                   \
          const __m256 pv = _mm256_maskload_ps(p + n * sample + i, m);                        \
          const float *qn = q + n * sample + i + shift;                                       \
          _Pragma("GCC unroll 9") for (int d = 0; d < ND; d++) acc[d] =                       \
              _mm256_fmadd_ps(pv, _mm256_loadu_ps(qn + d), acc[d]);                           \
        }                                                                                     \
        _Pragma("GCC unroll 9") for (int d = 0; d < ND; d++) {                                \
          double *rd = r + d * plane + i;                                                     \
          if (cnt == 8) {                                                                     \
            const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(acc[d]));                \
            const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(acc[d], 1));              \
            _mm256_storeu_pd(rd, _mm256_add_pd(_mm256_loadu_pd(rd), a));                      \
            _mm256_storeu_pd(rd + 4, _mm256_add_pd(_mm256_loadu_pd(rd + 4), b));              \
          } else {                                                                            \
            float part[8];                                                                    \
            _mm256_storeu_ps(part, acc[d]);                                                   \
            for (int64_t j = 0; j < cnt; j++) rd[j] += (double)part[j];                       \
          }                                                                                   \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }
CORRELATE(1)
CORRELATE(2)
CORRELATE(3)
CORRELATE(4)
CORRELATE(5)
CORRELATE(6)
CORRELATE(7)
CORRELATE(8)
CORRELATE(9)

void ddp__cpu_fold_correlate_avx2(double *r, const float *p, const float *q, int64_t shift, int nd,
                                  int64_t n_samples, int64_t sample, int64_t plane) {
  typedef void (*correlate_fn)(double *, const float *, const float *, int64_t, int64_t, int64_t,
                               int64_t);
  static const correlate_fn by_count[10] = {
      NULL,               correlate1_avx2, correlate2_avx2, correlate3_avx2, correlate4_avx2,
      correlate5_avx2,    correlate6_avx2, correlate7_avx2, correlate8_avx2, correlate9_avx2};
  by_count[nd](r, p, q, shift, n_samples, sample, plane);
}
