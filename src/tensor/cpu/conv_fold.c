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
  const int64_t sample = g->c * hp * wp;
  *f = (ddp__conv2d_fold){.g = g, .hp = hp, .wp = wp, .k = k, .sample = sample};
  f->avx512 = ddp__cpu_has_avx512() && g->ow <= 2 * LANES;
  /* No slack needed: rows are read with masked loads, which touch no
   * element past the row's last. */
  const size_t floats = (size_t)(g->n * sample);
  f->xp = ddp_arena_alloc(arena, floats * sizeof(float));
  f->off = ddp_arena_alloc(arena, (size_t)k * sizeof(int64_t));
  f->acc = ddp_arena_alloc(arena, (size_t)(k + 1) * LANES * sizeof(float));
  if (!f->xp || !f->off || !f->acc)
    return ddp_error(DDP_ERR_NOMEM, "conv2d (folded into batch norm): cannot allocate the padded "
                     "input (%lld samples of %lld floats)", (long long)g->n, (long long)sample);
  memset(f->xp, 0, floats * sizeof(float));
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
