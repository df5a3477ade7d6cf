/* The AVX2 family's max pooling with kernel 2, stride 2 (cpu/pool.c): 8
 * windows a step, the same rule and order as the scalar loop and the
 * AVX-512 kernels, so results and argmax (one byte a window) equal theirs.
 * As there, where the buffers go on far enough whole vectors are loaded and
 * stored instead of masked ones (masked stores are microcoded on AMD): the
 * extra lanes read input further on, and their outputs land on later
 * elements, which the walk writes again, with their own values, afterwards.
 * Only the buffers' last steps are masked. */
#include <immintrin.h>
#include <string.h>

#include "tensor/cpu/dense.h"

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __attribute__((always_inline)) __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The even (0) or odd (1) elements of a (8 floats) then b (8 floats). */
AVX2 static inline __attribute__((always_inline)) __m256 pick(__m256 a, __m256 b, int odd) {
  const __m256 t = odd ? _mm256_shuffle_ps(a, b, 0xdd) : _mm256_shuffle_ps(a, b, 0x88);
  /* t: a0 a2 b0 b2 | a4 a6 b4 b6 (per 128-bit half); order the 64-bit pairs */
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), 0xd8));
}

/* v replaces m (and its place and value) where v > m or v is NaN. */
#define TAKE(v, x, code)                                                                   \
  do {                                                                                     \
    const __m256 t = _mm256_or_ps(_mm256_cmp_ps(v, m, _CMP_GT_OQ),                         \
                                  _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                      \
    m = _mm256_blendv_ps(m, v, t);                                                         \
    at = _mm256_blendv_ps(at, _mm256_castsi256_ps(_mm256_set1_epi32(code)), t);            \
    val = _mm256_blendv_ps(val, x, t);                                                     \
  } while (0)

AVX2 void ddp__cpu_max_pool2x2_avx2(float *restrict y, int8_t *restrict argmax,
                                    float *restrict argval, const float *restrict x,
                                    int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                    bool relu, const ddp__pool_affine *affine) {
  const __m256 zero = _mm256_setzero_ps();
  const float *const x_end = x + planes * h * w;
  const int64_t outputs = planes * oh * ow;
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    __m256 center = zero, scale = zero, shift = zero;
    if (affine) {
      const int64_t c = p % affine->channels;
      center = _mm256_set1_ps(affine->center[c]);
      scale = _mm256_set1_ps(affine->scale[c]);
      shift = _mm256_set1_ps(affine->shift[c]);
    }
    for (int64_t i = 0; i < oh; i++) {
      const float *r0 = xp + 2 * i * w, *r1 = r0 + w;
      float *yr = y + (p * oh + i) * ow;
      int8_t *ar = argmax ? argmax + (p * oh + i) * ow : NULL;
      float *vr = argval ? argval + (p * oh + i) * ow : NULL;
      for (int64_t j = 0; j < ow; j += 8) {
        const bool whole_in = r1 + 2 * j + 16 <= x_end;
        const bool whole_out = (p * oh + i) * ow + j + 8 <= outputs;
        const int64_t n = ow - j < 8 ? ow - j : 8;
        const int64_t nin = whole_in ? 8 : n, nout = whole_out ? 8 : n;
        __m256 a0, a1, b0, b1;
        if (whole_in) {
          a0 = _mm256_loadu_ps(r0 + 2 * j), a1 = _mm256_loadu_ps(r0 + 2 * j + 8);
          b0 = _mm256_loadu_ps(r1 + 2 * j), b1 = _mm256_loadu_ps(r1 + 2 * j + 8);
        } else { /* inputs 2j .. 2j + 2 nin */
          const __m256i lo = first_lanes(2 * nin < 8 ? 2 * nin : 8);
          const __m256i hi = first_lanes(2 * nin > 8 ? 2 * nin - 8 : 0);
          a0 = _mm256_maskload_ps(r0 + 2 * j, lo), a1 = _mm256_maskload_ps(r0 + 2 * j + 8, hi);
          b0 = _mm256_maskload_ps(r1 + 2 * j, lo), b1 = _mm256_maskload_ps(r1 + 2 * j + 8, hi);
        }
        /* each window's four candidates in window order: 0 1 on top, 2 3 below */
        const __m256 x0 = pick(a0, a1, 0), x1 = pick(a0, a1, 1);
        const __m256 x2 = pick(b0, b1, 0), x3 = pick(b0, b1, 1);
        __m256 m = x0, v1 = x1, v2 = x2, v3 = x3;
        if (affine) { /* three roundings, as batch_norm_forward: no fma */
          m = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(m, center), scale), shift);
          v1 = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v1, center), scale), shift);
          v2 = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v2, center), scale), shift);
          v3 = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v3, center), scale), shift);
        }
        __m256 at = zero, val = x0; /* the max's place (int32 lanes), and x there */
        TAKE(v1, x1, 1);
        TAKE(v2, x2, 2);
        TAKE(v3, x3, 3);
        /* relu: only lanes below zero become 0 (an ordered compare keeps
         * NaN); windows whose y is not > 0 pass no gradient: argmax -1 */
        if (relu) {
          m = _mm256_blendv_ps(m, zero, _mm256_cmp_ps(m, zero, _CMP_LT_OQ));
          at = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(-1)), at,
                                _mm256_cmp_ps(m, zero, _CMP_GT_OQ));
        }
        const __m256i ati = _mm256_castps_si256(at);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(ati),
                                            _mm256_extracti128_si256(ati, 1));
        const __m128i codes = _mm_packs_epi16(w16, w16); /* bytes 0..7 */
        if (nout == 8) {
          _mm256_storeu_ps(yr + j, m);
          if (ar) _mm_storel_epi64((__m128i *)(ar + j), codes);
          if (vr) _mm256_storeu_ps(vr + j, val);
        } else {
          const __m256i out = first_lanes(nout);
          _mm256_maskstore_ps(yr + j, out, m);
          if (ar) {
            int8_t part[16];
            _mm_storeu_si128((__m128i *)part, codes);
            memcpy(ar + j, part, (size_t)nout);
          }
          if (vr) _mm256_maskstore_ps(vr + j, out, val);
        }
      }
    }
  }
}

/* The backward into a fresh dx (cpu/pool.c's unpool2x2_avx512, 8 windows a
 * step): each window's four elements written once, g = 0 + dy at its
 * argmax (as the scalar loop's add into zeros: -0.0 becomes +0.0), 0 at the
 * other three; elements no window covers are zeroed. */
AVX2 void ddp__cpu_max_unpool2x2_avx2(float *restrict dx, const float *restrict dy,
                                      const int8_t *restrict argmax, int64_t planes, int64_t h,
                                      int64_t w, int64_t oh, int64_t ow) {
  const __m256 zero = _mm256_setzero_ps();
  const float *const dx_end = dx + planes * h * w;
  const int64_t windows = planes * oh * ow;
  for (int64_t p = 0; p < planes; p++) {
    float *dxp = dx + p * h * w;
    for (int64_t i = 0; i < oh; i++) {
      float *r0 = dxp + 2 * i * w, *r1 = r0 + w;
      const int64_t row = (p * oh + i) * ow;
      for (int64_t j = 0; j < ow; j += 8) {
        /* only for rows of one step: a second step's extra stores would
         * land on the next row's elements already written */
        const bool whole = ow < 8 && row + 8 <= windows && r1 + 16 <= dx_end;
        const int64_t n = whole || ow - j >= 8 ? 8 : ow - j;
        const __m256i out = first_lanes(n);
        const __m256 g = _mm256_add_ps(zero, _mm256_maskload_ps(dy + row + j, out));
        int8_t part[16] = {0};
        memcpy(part, argmax + row + j, (size_t)n);
        const __m256i at = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)part));
        const __m256 v00 = _mm256_and_ps(g, _mm256_castsi256_ps(
                                                _mm256_cmpeq_epi32(at, _mm256_setzero_si256())));
        const __m256 v01 = _mm256_and_ps(g, _mm256_castsi256_ps(
                                                _mm256_cmpeq_epi32(at, _mm256_set1_epi32(1))));
        const __m256 v10 = _mm256_and_ps(g, _mm256_castsi256_ps(
                                                _mm256_cmpeq_epi32(at, _mm256_set1_epi32(2))));
        const __m256 v11 = _mm256_and_ps(g, _mm256_castsi256_ps(
                                                _mm256_cmpeq_epi32(at, _mm256_set1_epi32(3))));
        /* interleave: [a0 b0 a1 b1 a2 b2 a3 b3], [a4 b4 .. a7 b7] */
        const __m256 tl = _mm256_unpacklo_ps(v00, v01), th = _mm256_unpackhi_ps(v00, v01);
        const __m256 bl = _mm256_unpacklo_ps(v10, v11), bh = _mm256_unpackhi_ps(v10, v11);
        const __m256 t0 = _mm256_permute2f128_ps(tl, th, 0x20);
        const __m256 t1 = _mm256_permute2f128_ps(tl, th, 0x31);
        const __m256 b0 = _mm256_permute2f128_ps(bl, bh, 0x20);
        const __m256 b1 = _mm256_permute2f128_ps(bl, bh, 0x31);
        if (n == 8) {
          _mm256_storeu_ps(r0 + 2 * j, t0), _mm256_storeu_ps(r0 + 2 * j + 8, t1);
          _mm256_storeu_ps(r1 + 2 * j, b0), _mm256_storeu_ps(r1 + 2 * j + 8, b1);
        } else {
          const __m256i lo = first_lanes(2 * n < 8 ? 2 * n : 8);
          const __m256i hi = first_lanes(2 * n > 8 ? 2 * n - 8 : 0);
          _mm256_maskstore_ps(r0 + 2 * j, lo, t0), _mm256_maskstore_ps(r0 + 2 * j + 8, hi, t1);
          _mm256_maskstore_ps(r1 + 2 * j, lo, b0), _mm256_maskstore_ps(r1 + 2 * j + 8, hi, b1);
        }
      }
      for (int64_t b = 2 * ow; b < w; b++) r0[b] = 0.0f, r1[b] = 0.0f;
    }
    if (2 * oh < h) memset(dxp + 2 * oh * w, 0, (size_t)((h - 2 * oh) * w) * sizeof(float));
  }
}
