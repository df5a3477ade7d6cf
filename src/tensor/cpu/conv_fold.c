/* The weight and bias gradient of a stride-1 convolution, accumulated one
 * output channel's gradient plane at a time: what batch norm's backward
 * folds in when its input is such a convolution's output and nothing needs
 * that output's gradient otherwise (a first layer, whose input is data:
 * the ConvNet's conv1). The gradient planes then exist only one at a time,
 * in cache, instead of as a 5 MB tensor written by batch norm and read
 * back by the convolution's backward.
 *
 * For output channel o and tap t = (c, a, b):
 *   dw[o][t] += sum over n, y, x of dy_n[y][x] * xp_n[c][y + a][x + b]
 *   db[o]    += sum over n, y, x of dy_n[y][x]
 * with xp the zero-padded input. Partial sums are kept per lane (16 per tap)
 * over all the planes of a channel and reduced when the channel ends, so a
 * plane costs no horizontal additions. */
#include <immintrin.h>
#include <string.h>

#include "tensor/cpu/dense.h"

#define AVX512 __attribute__((target("avx512f,fma")))
#define LANES 16
/* Taps per pass over a plane: their partial sums stay in registers, the
 * plane's rows are re-read (from L1) once per block. */
#define TAP_BLOCK 8

ddp_status ddp__cpu_conv2d_fold_init(ddp__conv2d_fold *f, const float *x,
                                     const ddp__conv2d_geom *g, ddp_arena *arena) {
  const int64_t hp = g->h + 2 * g->pad, wp = g->w + 2 * g->pad, k = g->c * g->kh * g->kw;
  /* Samples one cache line apart beyond whole vectors: the correlations
   * read the same element of many samples in turn, which at a stride of a
   * power of two (4 KB for 32x32 planes) would all fall in one L1 set. */
  const int64_t sample = (g->c * hp * wp + LANES - 1) / LANES * LANES + LANES;
  *f = (ddp__conv2d_fold){.g = g, .hp = hp, .wp = wp, .k = k, .sample = sample};
  f->avx512 = ddp__cpu_has_avx512() && g->ow <= 2 * LANES;
  f->avx2 = ddp__cpu_has_avx2(); /* any width: a column of 8 at a time */
  /* The planes' rows are read with masked loads, which touch no element
   * past the row's last; the patches' correlations (fold_gram) read each
   * plane at offsets of up to (KH - 1) WP + KW - 1 floats either way, and
   * two vectors past that: zeros past both ends (whole vectors, so that xp
   * stays 64-byte aligned). */
  f->slack = ((g->kh - 1) * wp + g->kw - 1 + 2 * LANES - 1) / LANES * LANES;
  const size_t floats = (size_t)(g->n * sample + 2 * f->slack);
  float *base = ddp_arena_alloc(arena, floats * sizeof(float));
  f->off = ddp_arena_alloc(arena, (size_t)k * sizeof(int64_t));
  f->acc = ddp_arena_alloc(arena, (size_t)(k + 1) * LANES * sizeof(float));
  if (!base || !f->off || !f->acc)
    return ddp_error(DDP_ERR_NOMEM, "conv2d (folded into batch norm): cannot allocate the padded "
                     "input (%lld samples of %lld floats)", (long long)g->n, (long long)sample);
  memset(base, 0, floats * sizeof(float));
  f->xp = base + f->slack;
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t c = 0; c < g->c; c++)
      for (int64_t y = 0; y < g->h; y++)
        memcpy(f->xp + n * sample + (c * hp + y + g->pad) * wp + g->pad,
               x + ((n * g->c + c) * g->h + y) * g->w, (size_t)g->w * sizeof(float));
  for (int64_t c = 0; c < g->c; c++)
    for (int64_t a = 0; a < g->kh; a++)
      for (int64_t b = 0; b < g->kw; b++) f->off[(c * g->kh + a) * g->kw + b] = (c * hp + a) * wp + b;
  memset(f->acc, 0, (size_t)(k + 1) * LANES * sizeof(float));
  return DDP_OK;
}

/* Rows of up to two vectors (ow <= 32): masked loads of dy and of the
 * shifted input rows (masked loads are cheap on AMD, unlike masked
 * stores); lanes past ow load nothing and add nothing. TAPS taps at a
 * time, their partial sums in registers (a fixed-size array, fully
 * unrolled), the plane's rows re-read from L1 for each group. Used for
 * kernels taller than the sliding window below takes. */
#define FOLD_TAPS(TAPS)                                                                       \
  AVX512 static void fold_taps##TAPS(float *acc, const float *dy, const float *xs,            \
                                     const int64_t *off, int64_t oh, int64_t ow, int64_t wp,  \
                                     __mmask16 m0, __mmask16 m1) {                            \
    __m512 a[TAPS];                                                                           \
    const float *src[TAPS];                                                                   \
    _Pragma("GCC unroll 8") for (int t = 0; t < TAPS; t++) {                                  \
      a[t] = _mm512_loadu_ps(acc + t * LANES);                                                \
      src[t] = xs + off[t];                                                                   \
    }                                                                                         \
    for (int64_t y = 0; y < oh; y++) {                                                        \
      const __m512 d0 = _mm512_maskz_loadu_ps(m0, dy + y * ow);                               \
      _Pragma("GCC unroll 8") for (int t = 0; t < TAPS; t++)                                  \
        a[t] = _mm512_fmadd_ps(d0, _mm512_maskz_loadu_ps(m0, src[t] + y * wp), a[t]);         \
      if (m1) {                                                                               \
        const __m512 d1 = _mm512_maskz_loadu_ps(m1, dy + y * ow + LANES);                     \
        _Pragma("GCC unroll 8") for (int t = 0; t < TAPS; t++)                                \
          a[t] = _mm512_fmadd_ps(d1, _mm512_maskz_loadu_ps(m1, src[t] + y * wp + LANES), a[t]); \
      }                                                                                       \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int t = 0; t < TAPS; t++)                                    \
      _mm512_storeu_ps(acc + t * LANES, a[t]);                                                \
  }
FOLD_TAPS(8)
FOLD_TAPS(1)

/* Kernel heights up to WINDOW_MAX: one pass per (input channel, kernel
 * column b) over the padded input rows. Input row r serves tap (a, b) of
 * output row r - a for every a, so each input vector is loaded once and
 * multiplied by the KH gradient rows r, r-1, ..., r-KH+1, kept in
 * registers as a sliding window (zero past either edge): 2 loads per KH
 * fmas instead of one per fma, which loads across cache lines held back.
 * The two halves of a row accumulate apart, so that no fma waits for
 * another's result within a row. */
#define WINDOW_MAX 7
#define FOLD_WINDOW(KH)                                                                       \
  AVX512 static void fold_window##KH(float *acc, const float *dy, const float *xs,           \
                                     const ddp__conv2d_fold *f, int64_t ci, int64_t b,        \
                                     __mmask16 m0, __mmask16 m1) {                            \
    const int64_t oh = f->g->oh, ow = f->g->ow, wp = f->wp, kw = f->g->kw;                   \
    __m512 s0[KH], s1[KH], w0[KH], w1[KH];                                                    \
    float *at[KH];                                                                            \
    _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++) {                                    \
      at[a] = acc + ((ci * KH + a) * kw + b) * LANES;                                         \
      s0[a] = _mm512_loadu_ps(at[a]);                                                         \
      s1[a] = _mm512_setzero_ps();                                                            \
      w0[a] = _mm512_setzero_ps();                                                            \
      w1[a] = _mm512_setzero_ps();                                                            \
    }                                                                                         \
    const float *row = xs + ci * f->hp * wp + b;                                              \
    for (int64_t r = 0; r < oh + KH - 1; r++, row += wp) {                                    \
      _Pragma("GCC unroll 8") for (int a = KH - 1; a > 0; a--) {                              \
        w0[a] = w0[a - 1];                                                                    \
        w1[a] = w1[a - 1];                                                                    \
      }                                                                                       \
      w0[0] = r < oh ? _mm512_maskz_loadu_ps(m0, dy + r * ow) : _mm512_setzero_ps();          \
      w1[0] = r < oh ? _mm512_maskz_loadu_ps(m1, dy + r * ow + LANES) : _mm512_setzero_ps();  \
      const __m512 x0 = _mm512_maskz_loadu_ps(m0, row);                                       \
      const __m512 x1 = _mm512_maskz_loadu_ps(m1, row + LANES);                               \
      _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++) {                                  \
        s0[a] = _mm512_fmadd_ps(w0[a], x0, s0[a]);                                            \
        s1[a] = _mm512_fmadd_ps(w1[a], x1, s1[a]);                                            \
      }                                                                                       \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int a = 0; a < KH; a++)                                      \
      _mm512_storeu_ps(at[a], _mm512_add_ps(s0[a], s1[a]));                                   \
  }
FOLD_WINDOW(1)
FOLD_WINDOW(2)
FOLD_WINDOW(3)
FOLD_WINDOW(4)
FOLD_WINDOW(5)
FOLD_WINDOW(6)
FOLD_WINDOW(7)

AVX512 static void fold_plane_avx512(ddp__conv2d_fold *f, const float *dy, const float *xs) {
  const int64_t oh = f->g->oh, ow = f->g->ow, wp = f->wp, k = f->k;
  const __mmask16 m0 = ow >= LANES ? 0xffff : (__mmask16)((1u << ow) - 1);
  const __mmask16 m1 = ow > LANES ? (__mmask16)((1u << (ow - LANES)) - 1) : 0;
  if (f->g->kh <= WINDOW_MAX) {
    typedef void (*window_fn)(float *, const float *, const float *, const ddp__conv2d_fold *,
                              int64_t, int64_t, __mmask16, __mmask16);
    static const window_fn by_height[WINDOW_MAX + 1] = {
        NULL, fold_window1, fold_window2, fold_window3, fold_window4,
        fold_window5, fold_window6, fold_window7};
    for (int64_t ci = 0; ci < f->g->c; ci++)
      for (int64_t b = 0; b < f->g->kw; b++)
        by_height[f->g->kh](f->acc, dy, xs, f, ci, b, m0, m1);
  } else {
    int64_t t = 0;
    for (; t + TAP_BLOCK <= k; t += TAP_BLOCK)
      fold_taps8(f->acc + t * LANES, dy, xs, f->off + t, oh, ow, wp, m0, m1);
    for (; t < k; t++) fold_taps1(f->acc + t * LANES, dy, xs, f->off + t, oh, ow, wp, m0, m1);
  }
  __m512 s = _mm512_loadu_ps(f->acc + k * LANES);
  for (int64_t y = 0; y < oh; y++) {
    s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m0, dy + y * ow));
    if (m1) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m1, dy + y * ow + LANES));
  }
  _mm512_storeu_ps(f->acc + k * LANES, s);
}

/* Any width: the same sums in plain loops, into lane 0 of each tap. */
static void fold_plane_portable(ddp__conv2d_fold *f, const float *dy, const float *xs) {
  const int64_t oh = f->g->oh, ow = f->g->ow, wp = f->wp, k = f->k;
  for (int64_t t = 0; t < k; t++) {
    const float *src = xs + f->off[t];
    float s = 0.0f;
    for (int64_t y = 0; y < oh; y++)
      for (int64_t x = 0; x < ow; x++) s += dy[y * ow + x] * src[y * wp + x];
    f->acc[t * LANES] += s;
  }
  float s = 0.0f;
  for (int64_t i = 0; i < oh * ow; i++) s += dy[i];
  f->acc[k * LANES] += s;
}

void ddp__cpu_conv2d_fold_plane(ddp__conv2d_fold *f, const float *dy, int64_t n) {
  const float *xs = f->xp + n * f->sample;
  if (f->avx512)
    fold_plane_avx512(f, dy, xs);
  else if (f->avx2)
    ddp__cpu_conv2d_fold_plane_avx2(f, dy, xs);
  else
    fold_plane_portable(f, dy, xs);
}

void ddp__cpu_conv2d_fold_channel(ddp__conv2d_fold *f, float *dw, float *db) {
  for (int64_t t = 0; t <= f->k; t++) {
    float *lanes = f->acc + t * LANES;
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += lanes[l], lanes[l] = 0.0f;
    if (t < f->k) {
      if (dw) dw[t] += s;
    } else if (db) {
      *db += s;
    }
  }
}

/* ---- The patches' sums and Gram matrix (ddp__cpu_conv2d_fold_gram) ----
 * Tap t = (c, a, b) at output position (y, x) reads xp[c][y + a][x + b], so
 * for taps t and u = (c2, a2, b2) the product sums to
 *   gram[t][u] = sum over q in the window [a, a + oh) x [b, b + ow) of
 *                R[q],  R[q] = sum over n of xp_n[c][q] * xp_n[c2][q + d]
 * with d = (a2 - a, b2 - b): one correlation R per channel pair and offset
 * d serves every tap pair with that offset, through 2-D prefix sums of R.
 * That is (2 KH - 1)(2 KW - 1) products per padded element and sample
 * (about 41 for a 5x5 kernel, counting each symmetric pair once) instead
 * of K(K + 1)/2 per output element (325): a small fraction of the
 * convolution itself. R is summed over blocks of SAMPLE_BLOCK samples in
 * float registers, and the blocks, the prefix sums and everything after
 * in double. */
#define SAMPLE_BLOCK 32
/* Column offsets correlated per pass (up to 9, the unrolled kernels): a
 * 5x5 kernel's nine share the loads of the first plane. */
#define SHIFTS_MAX 9

/* r[d][i] += sum over n of p_n[i] * q_n[i + shift + d], for d < ND and i <
 * plane, where p_n = p + n * sample and likewise q: the sums over each
 * block of samples in registers (float), added to r (double) per block.
 * q_n is loaded as two vectors from i + shift on, and offset d is their
 * concatenation shifted by d lanes (a shuffle, instead of a load that
 * splits across cache lines). Reads up to |shift| + 2 LANES floats past
 * either end of a plane. */
#define SHIFTED(d) _mm512_castsi512_ps(_mm512_alignr_epi32(q1, q0, d))
#define ADD_SHIFTED(ND, d)                                                                    \
  if (ND > d) acc[d] = _mm512_fmadd_ps(pv, SHIFTED(d), acc[d])
#define CORRELATE(ND)                                                                         \
  AVX512 static void correlate##ND(double *r, const float *p, const float *q, int64_t shift,  \
                                   int64_t n_samples, int64_t sample, int64_t plane) {        \
    for (int64_t i = 0; i < plane; i += LANES) {                                              \
      const __mmask16 m = plane - i >= LANES ? 0xffff : (__mmask16)((1u << (plane - i)) - 1); \
      for (int64_t n0 = 0; n0 < n_samples; n0 += SAMPLE_BLOCK) {                              \
        const int64_t n1 = n0 + SAMPLE_BLOCK < n_samples ? n0 + SAMPLE_BLOCK : n_samples;     \
        __m512 acc[SHIFTS_MAX];                                                               \
        _Pragma("GCC unroll 9") for (int d = 0; d < ND; d++) acc[d] = _mm512_setzero_ps();    \
        for (int64_t n = n0; n < n1; n++) {                                                   \
          const __m512 pv = _mm512_maskz_loadu_ps(m, p + n * sample + i);                     \
          const float *qn = q + n * sample + i + shift;                                       \
          const __m512i q0 = _mm512_castps_si512(_mm512_loadu_ps(qn));                        \
          const __m512i q1 = _mm512_castps_si512(_mm512_loadu_ps(qn + LANES));                \
          acc[0] = _mm512_fmadd_ps(pv, _mm512_castsi512_ps(q0), acc[0]);                      \
          ADD_SHIFTED(ND, 1);                                                                 \
          ADD_SHIFTED(ND, 2);                                                                 \
          ADD_SHIFTED(ND, 3);                                                                 \
          ADD_SHIFTED(ND, 4);                                                                 \
          ADD_SHIFTED(ND, 5);                                                                 \
          ADD_SHIFTED(ND, 6);                                                                 \
          ADD_SHIFTED(ND, 7);                                                                 \
          ADD_SHIFTED(ND, 8);                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 9") for (int d = 0; d < ND; d++) {                                \
          double *rd = r + d * plane + i;                                                     \
          const __mmask8 lo = (__mmask8)m, hi = (__mmask8)(m >> 8);                           \
          const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(acc[d]));                  \
          const __m512d b = _mm512_cvtps_pd(                                                  \
              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[d]), 1)));         \
          _mm512_mask_storeu_pd(rd, lo, _mm512_add_pd(_mm512_maskz_loadu_pd(lo, rd), a));     \
          _mm512_mask_storeu_pd(rd + 8, hi, _mm512_add_pd(_mm512_maskz_loadu_pd(hi, rd + 8), b)); \
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

static void correlate_portable(double *r, const float *p, const float *q, int64_t shift, int nd,
                               int64_t n_samples, int64_t sample, int64_t plane) {
  for (int d = 0; d < nd; d++)
    for (int64_t n0 = 0; n0 < n_samples; n0 += SAMPLE_BLOCK) {
      const int64_t n1 = n0 + SAMPLE_BLOCK < n_samples ? n0 + SAMPLE_BLOCK : n_samples;
      for (int64_t i = 0; i < plane; i++) {
        float s = 0.0f;
        for (int64_t n = n0; n < n1; n++) s += p[n * sample + i] * q[n * sample + i + shift + d];
        r[d * plane + i] += s;
      }
    }
}

/* r[d] (nd planes of HP x WP) = sum over samples of xp_n[c][q] *
 * xp_n[c2][q + (da, db0 + d)], zero where the partner falls outside the
 * plane. Flat offsets pair some elements across a row's end or a plane's;
 * those are zeroed afterwards (no window of the taps served reaches
 * them, but their values would round the prefix sums). */
static void correlate(double *r, const ddp__conv2d_fold *f, int64_t c, int64_t c2, int64_t da,
                      int64_t db0, int nd) {
  const int64_t hp = f->hp, wp = f->wp, plane = hp * wp;
  const int64_t shift = da * wp + db0;
  for (int64_t i = 0; i < nd * plane; i++) r[i] = 0.0;
  const float *p = f->xp + c * plane, *q = f->xp + c2 * plane;
  typedef void (*correlate_fn)(double *, const float *, const float *, int64_t, int64_t,
                               int64_t, int64_t);
  static const correlate_fn by_count[SHIFTS_MAX + 1] = {
      NULL, correlate1, correlate2, correlate3, correlate4, correlate5,
      correlate6, correlate7, correlate8, correlate9};
  if (ddp__cpu_has_avx512())
    by_count[nd](r, p, q, shift, f->g->n, f->sample, plane);
  else if (ddp__cpu_has_avx2())
    ddp__cpu_fold_correlate_avx2(r, p, q, shift, nd, f->g->n, f->sample, plane);
  else
    correlate_portable(r, p, q, shift, nd, f->g->n, f->sample, plane);
  /* rows y + da and columns x + db outside the plane */
  const int64_t y0 = da < 0 ? -da : 0, y1 = da > 0 ? hp - da : hp;
  for (int d = 0; d < nd; d++) {
    const int64_t db = db0 + d, x0 = db < 0 ? -db : 0, x1 = db > 0 ? wp - db : wp;
    double *rd = r + d * plane;
    memset(rd, 0, (size_t)(y0 * wp) * sizeof(double));
    memset(rd + y1 * wp, 0, (size_t)((hp - y1) * wp) * sizeof(double));
    for (int64_t y = y0; y < y1; y++) {
      for (int64_t x = 0; x < x0; x++) rd[y * wp + x] = 0.0;
      for (int64_t x = x1; x < wp; x++) rd[y * wp + x] = 0.0;
    }
  }
}

/* s ((HP + 1) x (WP + 1)): s[i][j] = sum of r over rows < i, columns < j. */
static void prefix_sums(double *s, const double *r, int64_t hp, int64_t wp) {
  const int64_t w1 = wp + 1;
  for (int64_t j = 0; j <= wp; j++) s[j] = 0.0;
  for (int64_t i = 0; i < hp; i++) {
    double row = 0.0;
    s[(i + 1) * w1] = 0.0;
    for (int64_t j = 0; j < wp; j++) {
      row += r[i * wp + j];
      s[(i + 1) * w1 + j + 1] = s[i * w1 + j + 1] + row;
    }
  }
}

/* The sum of r over rows [a, a + oh), columns [b, b + ow), from its prefix sums. */
static double window_sum(const double *s, int64_t wp, int64_t a, int64_t b, int64_t oh,
                         int64_t ow) {
  const int64_t w1 = wp + 1;
  return s[(a + oh) * w1 + b + ow] - s[a * w1 + b + ow] - s[(a + oh) * w1 + b] + s[a * w1 + b];
}

ddp_status ddp__cpu_conv2d_fold_gram(const ddp__conv2d_fold *f, double *gram, double *psum,
                                     ddp_arena *arena) {
  const ddp__conv2d_geom *g = f->g;
  const int64_t hp = f->hp, wp = f->wp, kh = g->kh, kw = g->kw, k = f->k;
  const int64_t plane = hp * wp;
  double *r = ddp_arena_alloc(arena, (size_t)(SHIFTS_MAX * plane) * sizeof(double));
  double *s = ddp_arena_alloc(arena, (size_t)((hp + 1) * (wp + 1)) * sizeof(double));
  if (!r || !s)
    return ddp_error(DDP_ERR_NOMEM, "conv2d (folded into batch norm): no scratch for the "
                     "patches' sums of a %lldx%lld padded plane", (long long)hp, (long long)wp);
  for (int64_t c = 0; c < g->c; c++) {
    for (int64_t i = 0; i < plane; i++) r[i] = 0.0;
    for (int64_t n = 0; n < g->n; n++) {
      const float *p = f->xp + n * f->sample + c * plane;
      for (int64_t i = 0; i < plane; i++) r[i] += p[i];
    }
    prefix_sums(s, r, hp, wp);
    for (int64_t a = 0; a < kh; a++)
      for (int64_t b = 0; b < kw; b++)
        psum[(c * kh + a) * kw + b] = window_sum(s, wp, a, b, g->oh, g->ow);
  }
  /* Each pair of taps once, the other half by symmetry: for c2 == c the
   * offsets (da, db) with da > 0, or da == 0 and db >= 0. */
  for (int64_t c = 0; c < g->c; c++)
    for (int64_t c2 = c; c2 < g->c; c2++)
      for (int64_t da = c2 == c ? 0 : 1 - kh; da < kh; da++)
        for (int64_t db0 = da == 0 && c2 == c ? 0 : 1 - kw; db0 < kw; db0 += SHIFTS_MAX) {
          const int nd = (int)(kw - db0 < SHIFTS_MAX ? kw - db0 : SHIFTS_MAX);
          correlate(r, f, c, c2, da, db0, nd);
          for (int d = 0; d < nd; d++) {
            const int64_t db = db0 + d;
            prefix_sums(s, r + d * plane, hp, wp);
            for (int64_t a = da < 0 ? -da : 0; a < kh && a + da < kh; a++)
              for (int64_t b = db < 0 ? -db : 0; b < kw && b + db < kw; b++) {
                const int64_t t = (c * kh + a) * kw + b, u = (c2 * kh + a + da) * kw + b + db;
                gram[t * k + u] = gram[u * k + t] = window_sum(s, wp, a, b, g->oh, g->ow);
              }
          }
        }
  return DDP_OK;
}
