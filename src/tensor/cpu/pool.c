/* CPU max pooling (no padding, floor mode) and its backward. The comparison
 * is PyTorch's CPU one, `v > max || isnan(v)`: the first maximum in
 * row-major window order wins a tie, and a NaN propagates. The relu variant
 * pools x and applies relu to each window's max: relu is monotone, so that
 * equals pooling relu(x), with NaN still propagating (relu keeps NaN) and
 * the gradient reaching the same element whenever it is not zero. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "tensor/cpu/dense.h"

/* kernel 2, stride 2 with AVX-512: 16 outputs at a time. Each pair of input
 * rows is loaded as 32 floats and split into even and odd columns; the four
 * candidates are compared in window order with the same rule, so results
 * and argmax equal the scalar loop's. Rows shorter than 16 outputs use
 * masked loads and stores (slow on AMD, but once per row). */
__attribute__((target("avx512f"))) static void
pool2x2_avx512(float *restrict y, int32_t *restrict argmax, const float *restrict x,
               int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow, bool relu,
               const ddp__pool_affine *affine) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lane2 = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                            11, 12, 13, 14, 15), 1);
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    __m512 center = zero, scale = zero, shift = zero;
    if (affine) {
      const int64_t c = p % affine->channels;
      center = _mm512_set1_ps(affine->center[c]);
      scale = _mm512_set1_ps(affine->scale[c]);
      shift = _mm512_set1_ps(affine->shift[c]);
    }
    for (int64_t i = 0; i < oh; i++) {
      const float *r0 = xp + 2 * i * w, *r1 = r0 + w;
      float *yr = y + (p * oh + i) * ow;
      int32_t *ar = argmax ? argmax + (p * oh + i) * ow : NULL;
      for (int64_t j = 0; j < ow; j += 16) {
        const int64_t n = ow - j < 16 ? ow - j : 16; /* outputs in this step */
        const __mmask16 out = (__mmask16)((1u << n) - 1);
        /* inputs 2j .. 2j+2n: first vector min(16, 2n) lanes, second the rest */
        const __mmask16 lo = 2 * n >= 16 ? 0xffff : (__mmask16)((1u << (2 * n)) - 1);
        const __mmask16 hi = 2 * n > 16 ? (__mmask16)((1u << (2 * n - 16)) - 1) : 0;
        __m512 a0 = _mm512_maskz_loadu_ps(lo, r0 + 2 * j);
        __m512 a1 = _mm512_maskz_loadu_ps(hi, r0 + 2 * j + 16);
        __m512 b0 = _mm512_maskz_loadu_ps(lo, r1 + 2 * j);
        __m512 b1 = _mm512_maskz_loadu_ps(hi, r1 + 2 * j + 16);
        if (affine) { /* three roundings, as batch_norm_forward: no fma */
          a0 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(a0, center), scale), shift);
          a1 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(a1, center), scale), shift);
          b0 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(b0, center), scale), shift);
          b1 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(b1, center), scale), shift);
        }
        __m512 m = _mm512_permutex2var_ps(a0, even, a1);
        const __m512 v1 = _mm512_permutex2var_ps(a0, odd, a1);
        const __m512 v2 = _mm512_permutex2var_ps(b0, even, b1);
        const __m512 v3 = _mm512_permutex2var_ps(b0, odd, b1);
        const __m512i base = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(2 * i * w + 2 * j)), lane2);
        __m512i at = base;
        __mmask16 t = _mm512_cmp_ps_mask(v1, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v1);
        at = _mm512_mask_mov_epi32(at, t, _mm512_add_epi32(base, _mm512_set1_epi32(1)));
        t = _mm512_cmp_ps_mask(v2, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v2);
        at = _mm512_mask_mov_epi32(at, t, _mm512_add_epi32(base, _mm512_set1_epi32((int32_t)w)));
        t = _mm512_cmp_ps_mask(v3, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v3);
        at = _mm512_mask_mov_epi32(at, t, _mm512_add_epi32(base, _mm512_set1_epi32((int32_t)w + 1)));
        /* relu: only lanes below zero become 0 (an ordered compare keeps NaN) */
        if (relu) m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, zero, _CMP_LT_OQ), zero);
        if (n == 16) {
          _mm512_storeu_ps(yr + j, m);
          if (ar) _mm512_storeu_si512(ar + j, at);
        } else {
          _mm512_mask_storeu_ps(yr + j, out, m);
          if (ar) _mm512_mask_storeu_epi32(ar + j, out, at);
        }
      }
    }
  }
}

void ddp__cpu_max_pool2d_forward(float *y, int32_t *argmax, const float *x, int64_t planes,
                                 int64_t h, int64_t w, int64_t kernel, int64_t stride,
                                 int64_t oh, int64_t ow, bool relu,
                                 const ddp__pool_affine *affine) {
  if (kernel == 2 && stride == 2 && ddp__cpu_has_avx512()) {
    pool2x2_avx512(y, argmax, x, planes, h, w, oh, ow, relu, affine);
    return;
  }
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    const int64_t c = affine ? p % affine->channels : 0;
    for (int64_t i = 0; i < oh; i++)
      for (int64_t j = 0; j < ow; j++) {
        int64_t top = i * stride, left = j * stride;
        float m = -INFINITY;
        int64_t at = top * w + left;
        for (int64_t a = top; a < top + kernel; a++)
          for (int64_t b = left; b < left + kernel; b++) {
            float v = xp[a * w + b];
            if (affine) v = (v - affine->center[c]) * affine->scale[c] + affine->shift[c];
            if (v > m || isnan(v)) {
              m = v;
              at = a * w + b;
            }
          }
        y[(p * oh + i) * ow + j] = relu && m < 0.0f ? 0.0f : m;
        if (argmax) argmax[(p * oh + i) * ow + j] = (int32_t)at;
      }
  }
}

void ddp__cpu_max_pool2d_backward(float *dx, const float *dy, const int32_t *argmax,
                                  int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                  const float *relu_y, bool accumulate) {
  for (int64_t p = 0; p < planes; p++) {
    float *dxp = dx + p * h * w;
    const float *dyp = dy + p * oh * ow;
    const int32_t *ap = argmax + p * oh * ow;
    /* A fresh gradient is zeroed a plane at a time, right before the
     * scatter, so the plane is still in cache when the scatter writes it;
     * zeroing the whole buffer first sends it to memory and back. */
    if (!accumulate) memset(dxp, 0, (size_t)(h * w) * sizeof(float));
    if (relu_y) {
      const float *yp = relu_y + p * oh * ow;
      for (int64_t i = 0; i < oh * ow; i++) dxp[ap[i]] += yp[i] > 0.0f ? dyp[i] : 0.0f;
    } else {
      for (int64_t i = 0; i < oh * ow; i++) dxp[ap[i]] += dyp[i];
    }
  }
}
