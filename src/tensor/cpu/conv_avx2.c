/* The AVX2 family's layout work around the convolutions' gemms (cpu/conv.c):
 * the same copies and transpose as the AVX-512 ones there, 8 floats a
 * vector. Whole-vector copies let a row's spare lanes spill onto the next
 * row, which is written afterwards (masked stores are microcoded on AMD);
 * the buffers carry slack past their ends for that (cpu/conv.c's SLACK). */
#include <immintrin.h>
#include <string.h>

#include "tensor/cpu/dense.h"

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 void ddp__cpu_copy_taps_avx2(float *restrict col, const float *xp, const int64_t *off,
                                  int64_t taps, int64_t wp, int64_t oh, int64_t ow) {
  for (int64_t t = 0; t < taps; t++) {
    float *dst = col + t * oh * ow;
    const float *src = xp + off[t];
    for (int64_t oy = 0; oy < oh; oy++, dst += ow, src += wp)
      for (int64_t ox = 0; ox < ow; ox += 8) _mm256_storeu_ps(dst + ox, _mm256_loadu_ps(src + ox));
  }
}

/* Blocks of 8 x 8 in registers (unpack, shuffle, then swap 128-bit
 * halves); the edges element by element. */
AVX2 void ddp__cpu_transpose_avx2(float *restrict dst, const float *restrict src, int64_t rows,
                                  int64_t cols) {
  const int64_t rows8 = rows - rows % 8, cols8 = cols - cols % 8;
  for (int64_t i0 = 0; i0 < rows8; i0 += 8)
    for (int64_t j0 = 0; j0 < cols8; j0 += 8) {
      __m256 r[8], t[8], s[8];
      for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (i0 + i) * cols + j0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
      }
      /* s[k] (k < 4) holds, per 128-bit half h, column 4h + k of rows
       * 0..3; s[4 + k] the same of rows 4..7. */
      for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x31);
      }
      for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (j0 + j) * rows + i0, r[j]);
    }
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = i < rows8 ? cols8 : 0; j < cols; j++) dst[j * rows + i] = src[i * cols + j];
}

/* Rows up to 32 wide go as four whole vectors, loaded under a lane mask
 * (the masked-off lanes read nothing, so x - 1 is never touched) with zeros
 * past the row, which land on the next row's start (written next) or the
 * zero rows below; wider rows by memcpy. */
AVX2 void ddp__cpu_shifted_copy_avx2(float *buf, const float *restrict x, int64_t c, int64_t h,
                                     int64_t w, int64_t kw, int64_t pad) {
  const int64_t hp = h + 2 * pad;
  for (int64_t ci = 0; ci < c; ci++)
    for (int64_t b = 0; b < kw; b++) {
      const int64_t shift = b - pad; /* copy column j holds input column j + shift */
      const int64_t dst0 = shift < 0 ? -shift : 0, src0 = shift > 0 ? shift : 0;
      const int64_t n = w - (shift < 0 ? -shift : shift);
      float *dst = buf + ((ci * kw + b) * hp + pad) * w;
      const float *src = x + ci * h * w;
      if (w > 32) {
        for (int64_t r = 0; r < h; r++, dst += w, src += w)
          memcpy(dst + dst0, src + src0, (size_t)n * sizeof(float));
        continue;
      }
      /* lane j of vector v (j + 8v in [dst0, dst0 + n)) holds src[j + 8v + shift] */
      __m256i mask[4];
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int v = 0; v < 4; v++) {
        const __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v));
        mask[v] = _mm256_and_si256(_mm256_cmpgt_epi32(at, _mm256_set1_epi32((int)dst0 - 1)),
                                   _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(dst0 + n)), at));
      }
      const int nv = (int)((w + 7) / 8);
      for (int64_t r = 0; r < h; r++, dst += w, src += w)
        for (int v = 0; v < nv; v++)
          _mm256_storeu_ps(dst + 8 * v, _mm256_maskload_ps(src + shift + 8 * v, mask[v]));
    }
}
