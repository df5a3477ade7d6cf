/* Winograd's F(2x2, 3x3) for the AVX2 family: cpu/winograd.c's transforms
 * and schedule, 8 tiles a vector. The AVX-512 kernels take a whole row of
 * tiles (up to 15) in one vector, picking a row's even and odd columns out
 * of 32 floats with one two-source permute; AVX2 has no such permute
 * across 256 bits, so a row of tiles goes in chunks of 8, and each chunk
 * loads its input columns twice, at 2 tx0 and 2 tx0 + 2 (unaligned loads
 * are cheap), so that columns 2l, 2l + 1, 2l + 2 and 2l + 3 of tile l come
 * from two in-lane shuffles each. Lanes past the row of tiles are stored
 * onto the next row of tiles (written next) or the slack after the
 * channel's tiles, as there; the gemms are the AVX2 family's
 * (cpu/gemm_avx2.c). Same transforms, same order of additions, so the same
 * roundings as the AVX-512 path. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define POS 16

AVX2 INLINE __m256i lanes_below(int64_t n) { /* lanes i < n, n any */
  const int c = n < 0 ? 0 : n > 8 ? 8 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Elements 0, 2, .., 14 (odd: 1, 3, .., 15) of a then b. */
AVX2 INLINE __m256 evens(__m256 a, __m256 b) {
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
}
AVX2 INLINE __m256 odds(__m256 a, __m256 b) {
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

/* V for input channel ci (rows of iw floats; nothing past a row is read:
 * x may be the caller's tensor). */
AVX2 INLINE void input_transform(const float *x, int64_t iw, int64_t th, int64_t tw, float *v,
                                 int64_t vk) {
  /* rows of tiles outer: a chunk's lanes past tw land on the next row's
   * first tiles, which must be written after them */
  for (int64_t ty = 0; ty < th; ty++)
    for (int64_t tx0 = 0; tx0 < tw; tx0 += 8) {
      const int64_t c0 = 2 * tx0;
      /* columns c0 + [0, 8), + [8, 16), + [2, 10), + [10, 18) */
      const __m256i ma = lanes_below(iw - c0), mb = lanes_below(iw - c0 - 8);
      const __m256i mc = lanes_below(iw - c0 - 2), md = lanes_below(iw - c0 - 10);
      __m256 a[4], b[4], c[4], d[4];
      for (int r = 0; r < 4; r++) {
        const float *row = x + (2 * ty + r) * iw + c0;
        a[r] = _mm256_maskload_ps(row, ma), b[r] = _mm256_maskload_ps(row + 8, mb);
        c[r] = _mm256_maskload_ps(row + 2, mc), d[r] = _mm256_maskload_ps(row + 10, md);
      }
      /* B^T d over the four rows, each of the four column sets */
      __m256 ta[4], tb[4], tc[4], td[4];
#define BT(t, s)                                                                            \
  t[0] = _mm256_sub_ps(s[0], s[2]), t[1] = _mm256_add_ps(s[1], s[2]),                      \
  t[2] = _mm256_sub_ps(s[2], s[1]), t[3] = _mm256_sub_ps(s[1], s[3])
      BT(ta, a);
      BT(tb, b);
      BT(tc, c);
      BT(td, d);
#undef BT
      float *at = v + ty * tw + tx0;
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        /* (B^T d) B: columns 2l .. 2l+3 of tile tx0 + l, a tile a lane */
        const __m256 e0 = evens(ta[i], tb[i]), o0 = odds(ta[i], tb[i]);
        const __m256 e1 = evens(tc[i], td[i]), o1 = odds(tc[i], td[i]);
        _mm256_storeu_ps(at + (4 * i + 0) * vk, _mm256_sub_ps(e0, e1));
        _mm256_storeu_ps(at + (4 * i + 1) * vk, _mm256_add_ps(o0, e1));
        _mm256_storeu_ps(at + (4 * i + 2) * vk, _mm256_sub_ps(e1, o0));
        _mm256_storeu_ps(at + (4 * i + 3) * vk, _mm256_sub_ps(o0, o1));
      }
    }
}

/* 16 outputs of a row from chunk tiles' even and odd columns. */
AVX2 INLINE void put_row(float *dst, __m256 even, __m256 odd, __m256i m0, __m256i m1, bool full,
                         bool accumulate) {
  const __m256 lo8 = _mm256_unpacklo_ps(even, odd), hi8 = _mm256_unpackhi_ps(even, odd);
  __m256 r0 = _mm256_permute2f128_ps(lo8, hi8, 0x20), r1 = _mm256_permute2f128_ps(lo8, hi8, 0x31);
  if (accumulate) {
    r0 = _mm256_add_ps(r0, _mm256_maskload_ps(dst, m0));
    r1 = _mm256_add_ps(r1, _mm256_maskload_ps(dst + 8, m1));
  }
  if (full) {
    _mm256_storeu_ps(dst, r0), _mm256_storeu_ps(dst + 8, r1);
  } else {
    _mm256_maskstore_ps(dst, m0, r0), _mm256_maskstore_ps(dst + 8, m1, r1);
  }
}

/* Y for output channel o from M (its 16 positions at stride mk). */
AVX2 INLINE void output_transform(const float *mo, int64_t mk, int64_t th, int64_t tw, float *y,
                                  int64_t ow, float bias, bool accumulate) {
  const __m256 b = _mm256_set1_ps(bias);
  for (int64_t tx0 = 0; tx0 < tw; tx0 += 8) {
    const int64_t c0 = 2 * tx0;
    const __m256i m0 = lanes_below(ow - c0), m1 = lanes_below(ow - c0 - 8);
    const bool full = c0 + 16 <= ow;
    for (int64_t ty = 0; ty < th; ty++) {
      const float *at = mo + ty * tw + tx0;
      __m256 s0[4], s1[4]; /* A^T m: rows of the 4x4, per column j */
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256 q0 = _mm256_loadu_ps(at + (0 + j) * mk), q1 = _mm256_loadu_ps(at + (4 + j) * mk);
        const __m256 q2 = _mm256_loadu_ps(at + (8 + j) * mk),
                     q3 = _mm256_loadu_ps(at + (12 + j) * mk);
        s0[j] = _mm256_add_ps(_mm256_add_ps(q0, q1), q2);
        s1[j] = _mm256_sub_ps(_mm256_sub_ps(q1, q2), q3);
      }
      const __m256 y00 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s0[0], s0[1]), s0[2]), b);
      const __m256 y01 = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(s0[1], s0[2]), s0[3]), b);
      const __m256 y10 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s1[0], s1[1]), s1[2]), b);
      const __m256 y11 = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(s1[1], s1[2]), s1[3]), b);
      put_row(y + (2 * ty) * ow + c0, y00, y01, m0, m1, full, accumulate);
      put_row(y + (2 * ty + 1) * ow + c0, y10, y11, m0, m1, full, accumulate);
    }
  }
}

AVX2 void ddp__cpu_winograd_conv3x3_avx2(int64_t m, int64_t c, const float *u, const float *x,
                                         float *y, int64_t oh, int64_t ow, const float *bias,
                                         bool accumulate, float *scratch) {
  const int64_t th = oh / 2, tw = ow / 2, tiles = th * tw, iw = ow + 2;
  const int64_t vk = c * tiles + 16, mk = m * tiles + 16; /* as cpu/winograd.c's scratch */
  float *v = scratch, *mm = scratch + POS * vk;
  for (int64_t ci = 0; ci < c; ci++)
    input_transform(x + ci * (oh + 2) * iw, iw, th, tw, v + ci * tiles, vk);
  for (int k = 0; k < POS; k++) /* M[k] (m, tiles) = U[k] (m, c) @ V[k] (c, tiles) */
    ddp__cpu_gemm_avx2(m, tiles, c, u + (int64_t)k * m * c, c, v + k * vk, tiles, mm + k * mk,
                       tiles, NULL, false);
  for (int64_t o = 0; o < m; o++)
    output_transform(mm + o * tiles, mk, th, tw, y + o * oh * ow, ow, bias ? bias[o] : 0.0f,
                     accumulate);
}

/* dM for output channel o from its gradient dy (cpu/winograd.c's
 * grad_transform, 8 tiles a chunk). */
AVX2 INLINE void grad_transform(const float *dy, int64_t ow, int64_t th, int64_t tw, float *dm,
                                int64_t mk) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t ty = 0; ty < th; ty++) /* rows outer, as in input_transform */
    for (int64_t tx0 = 0; tx0 < tw; tx0 += 8) {
      const int64_t c0 = 2 * tx0;
      const __m256i m0 = lanes_below(ow - c0), m1 = lanes_below(ow - c0 - 8);
      __m256 e[2], o[2];
      for (int r = 0; r < 2; r++) {
        const float *row = dy + (2 * ty + r) * ow + c0;
        const __m256 lo = _mm256_maskload_ps(row, m0), hi = _mm256_maskload_ps(row + 8, m1);
        e[r] = evens(lo, hi), o[r] = odds(lo, hi);
      }
      const __m256 p[4] = {e[0], _mm256_add_ps(e[0], e[1]), _mm256_sub_ps(e[0], e[1]),
                           _mm256_sub_ps(zero, e[1])};
      const __m256 q[4] = {o[0], _mm256_add_ps(o[0], o[1]), _mm256_sub_ps(o[0], o[1]),
                           _mm256_sub_ps(zero, o[1])};
      float *at = dm + ty * tw + tx0;
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(at + (4 * i + 0) * mk, p[i]);
        _mm256_storeu_ps(at + (4 * i + 1) * mk, _mm256_add_ps(p[i], q[i]));
        _mm256_storeu_ps(at + (4 * i + 2) * mk, _mm256_sub_ps(p[i], q[i]));
        _mm256_storeu_ps(at + (4 * i + 3) * mk, _mm256_sub_ps(zero, q[i]));
      }
    }
}

AVX2 void ddp__cpu_winograd_dw_sample_avx2(int64_t m, int64_t c, const float *x, const float *dy,
                                           int64_t oh, int64_t ow, float *du, float *scratch) {
  const int64_t th = oh / 2, tw = ow / 2, tiles = th * tw, iw = ow + 2;
  const int64_t vk = c * tiles + 16, mk = m * tiles + 16;
  float *v = scratch, *dm = scratch + POS * vk;
  for (int64_t ci = 0; ci < c; ci++)
    input_transform(x + ci * (oh + 2) * iw, iw, th, tw, v + ci * tiles, vk);
  for (int64_t o = 0; o < m; o++) grad_transform(dy + o * oh * ow, ow, th, tw, dm + o * tiles, mk);
  for (int k = 0; k < POS; k++) /* du[k] (m, c) += dM[k] (m, tiles) @ V[k] (c, tiles)^T */
    ddp__cpu_gemm_nt_avx2(m, c, tiles, dm + k * mk, tiles, v + k * vk, tiles,
                          du + (int64_t)k * m * c, c);
}
