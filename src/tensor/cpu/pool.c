/* CPU max pooling (no padding, floor mode) and its backward. The comparison
 * is PyTorch's CPU one, `v > max || isnan(v)`: the first maximum in
 * row-major window order wins a tie, and a NaN propagates. The relu variant
 * pools x and applies relu to each window's max: relu is monotone, so that
 * equals pooling relu(x), with NaN still propagating (relu keeps NaN) and
 * the gradient reaching the same element whenever it is not zero. A window
 * relu closes (y not > 0) gets argmax -1, so the backward blocks its
 * gradient without reading y back. argmax holds the max's place in its
 * window (ddp__pool_arg_bytes wide; int8 for the AVX-512 2x2 kernels);
 * argval, when asked for, x's own value there (before the affine map), which
 * a folded batch norm's backward needs in place of x. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "tensor/cpu/dense.h"

/* kernel 2, stride 2 with AVX-512: 16 outputs at a time. Each pair of input
 * rows is loaded as 32 floats and split into even and odd columns; the four
 * candidates are compared in window order with the same rule, so results
 * and argmax equal the scalar loop's.
 * A row's last step usually has fewer than 16 outputs (every step does in
 * the ConvNet, whose rows are 14 and 7 wide), and masked stores cost ~10
 * cycles each on AMD. Where the buffers go on far enough the kernel loads
 * and stores whole vectors instead: the extra lanes read input further on
 * (the next row's), and their outputs land on later elements of y and
 * argmax, which the walk writes again, with their own values, afterwards.
 * Only the buffers' last steps are masked. */
__attribute__((target("avx512f"))) static void
pool2x2_avx512(float *restrict y, int8_t *restrict argmax, float *restrict argval,
               const float *restrict x, int64_t planes, int64_t h, int64_t w, int64_t oh,
               int64_t ow, bool relu, const ddp__pool_affine *affine) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2),
                three = _mm512_set1_epi32(3);
  const float *const x_end = x + planes * h * w;
  const int64_t outputs = planes * oh * ow;
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
      int8_t *ar = argmax ? argmax + (p * oh + i) * ow : NULL;
      float *vr = argval ? argval + (p * oh + i) * ow : NULL;
      for (int64_t j = 0; j < ow; j += 16) {
        /* outputs in this step; 16 where whole vectors stay in the buffers */
        const bool whole_in = r1 + 2 * j + 32 <= x_end;
        const bool whole_out = (p * oh + i) * ow + j + 16 <= outputs;
        const int64_t n = ow - j < 16 ? ow - j : 16;
        const int64_t nin = whole_in ? 16 : n, nout = whole_out ? 16 : n;
        const __mmask16 out = (__mmask16)((1u << nout) - 1);
        /* inputs 2j .. 2j+2nin: first vector min(16, 2nin) lanes, second the rest */
        const __mmask16 lo = 2 * nin >= 16 ? 0xffff : (__mmask16)((1u << (2 * nin)) - 1);
        const __mmask16 hi = 2 * nin > 16 ? (__mmask16)((1u << (2 * nin - 16)) - 1) : 0;
        __m512 a0, a1, b0, b1;
        if (whole_in) {
          a0 = _mm512_loadu_ps(r0 + 2 * j);
          a1 = _mm512_loadu_ps(r0 + 2 * j + 16);
          b0 = _mm512_loadu_ps(r1 + 2 * j);
          b1 = _mm512_loadu_ps(r1 + 2 * j + 16);
        } else {
          a0 = _mm512_maskz_loadu_ps(lo, r0 + 2 * j);
          a1 = _mm512_maskz_loadu_ps(hi, r0 + 2 * j + 16);
          b0 = _mm512_maskz_loadu_ps(lo, r1 + 2 * j);
          b1 = _mm512_maskz_loadu_ps(hi, r1 + 2 * j + 16);
        }
        /* each window's four candidates, in window order: 0 1 on the top
         * row, 2 3 below (x's own values, kept for argval) */
        const __m512 x0 = _mm512_permutex2var_ps(a0, even, a1);
        const __m512 x1 = _mm512_permutex2var_ps(a0, odd, a1);
        const __m512 x2 = _mm512_permutex2var_ps(b0, even, b1);
        const __m512 x3 = _mm512_permutex2var_ps(b0, odd, b1);
        __m512 m = x0, v1 = x1, v2 = x2, v3 = x3;
        if (affine) { /* three roundings, as batch_norm_forward: no fma */
          m = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(m, center), scale), shift);
          v1 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v1, center), scale), shift);
          v2 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v2, center), scale), shift);
          v3 = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v3, center), scale), shift);
        }
        /* the max's place in its window, and x there */
        __m512i at = _mm512_setzero_si512();
        __m512 val = x0;
        __mmask16 t = _mm512_cmp_ps_mask(v1, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v1);
        at = _mm512_mask_mov_epi32(at, t, one);
        val = _mm512_mask_mov_ps(val, t, x1);
        t = _mm512_cmp_ps_mask(v2, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v2);
        at = _mm512_mask_mov_epi32(at, t, two);
        val = _mm512_mask_mov_ps(val, t, x2);
        t = _mm512_cmp_ps_mask(v3, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
        m = _mm512_mask_mov_ps(m, t, v3);
        at = _mm512_mask_mov_epi32(at, t, three);
        val = _mm512_mask_mov_ps(val, t, x3);
        /* relu: only lanes below zero become 0 (an ordered compare keeps
         * NaN); windows whose y is not > 0 pass no gradient: argmax -1 */
        if (relu) {
          m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, zero, _CMP_LT_OQ), zero);
          at = _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), _mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ),
                                     at);
        }
        if (nout == 16) {
          _mm512_storeu_ps(yr + j, m);
          if (ar) _mm_storeu_si128((__m128i *)(ar + j), _mm512_cvtepi32_epi8(at));
          if (vr) _mm512_storeu_ps(vr + j, val);
        } else {
          _mm512_mask_storeu_ps(yr + j, out, m);
          if (ar) _mm512_mask_cvtepi32_storeu_epi8(ar + j, out, at);
          if (vr) _mm512_mask_storeu_ps(vr + j, out, val);
        }
      }
    }
  }
}

/* argmax[i] := code, one or four bytes wide */
static void arg_put(void *argmax, int64_t i, int64_t bytes, int32_t code) {
  if (bytes == 1)
    ((int8_t *)argmax)[i] = (int8_t)code;
  else
    ((int32_t *)argmax)[i] = code;
}


void ddp__cpu_max_pool2d_forward(float *y, void *argmax, float *argval, const float *x,
                                 int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                 int64_t stride, int64_t oh, int64_t ow, bool relu,
                                 const ddp__pool_affine *affine) {
  if (kernel == 2 && stride == 2 && ddp__cpu_has_avx512()) {
    pool2x2_avx512(y, argmax, argval, x, planes, h, w, oh, ow, relu, affine);
    return;
  }
  if (kernel == 2 && stride == 2 && ddp__cpu_has_avx2()) {
    ddp__cpu_max_pool2x2_avx2(y, argmax, argval, x, planes, h, w, oh, ow, relu, affine);
    return;
  }
  const int64_t bytes = ddp__pool_arg_bytes(kernel);
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    const int64_t c = affine ? p % affine->channels : 0;
    for (int64_t i = 0; i < oh; i++)
      for (int64_t j = 0; j < ow; j++) {
        int64_t top = i * stride, left = j * stride;
        float m = -INFINITY, raw = xp[top * w + left];
        int32_t at = 0; /* the max's place in the window */
        for (int64_t a = 0; a < kernel; a++)
          for (int64_t b = 0; b < kernel; b++) {
            const float xv = xp[(top + a) * w + left + b];
            float v = xv;
            if (affine) v = (v - affine->center[c]) * affine->scale[c] + affine->shift[c];
            if (v > m || isnan(v)) {
              m = v;
              raw = xv;
              at = (int32_t)(a * kernel + b);
            }
          }
        if (relu && m < 0.0f) m = 0.0f;
        if (relu && !(m > 0.0f)) at = -1; /* closed by relu */
        y[(p * oh + i) * ow + j] = m;
        if (argmax) arg_put(argmax, (p * oh + i) * ow + j, bytes, at);
        if (argval) argval[(p * oh + i) * ow + j] = raw;
      }
  }
}

/* Backward of kernel 2, stride 2 into a fresh dx with AVX-512: the windows
 * do not overlap, so each of a window's four elements is written once, 16
 * windows a step, with no zeroing first and no read-modify-write: the
 * window's gradient g at its argmax, 0 at the other three. g is written as
 * 0 + g, what the scalar loop adds into a zeroed buffer (-0.0 becomes
 * +0.0), so both paths give the same bits; a closed window (argmax -1)
 * matches none of its four. Elements no window covers (an odd last row or
 * column) are zeroed.
 * A row of fewer than 16 windows (14 and 7 in the ConvNet) would need
 * masked loads and stores, slow on AMD. Where the buffers go on far enough
 * the kernel loads and stores whole vectors instead: the extra lanes read
 * the next row's windows, and the extra stores land on elements further on
 * in dx (this row's uncovered columns, the next rows), each of which the
 * walk writes again, with its own value, afterwards. */
__attribute__((target("avx512f"))) static void
unpool2x2_avx512(float *restrict dx, const float *restrict dy, const int8_t *restrict argmax,
                 int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow) {
  const __m512 zero = _mm512_setzero_ps();
  /* a and b interleaved: [a0 b0 .. a7 b7], then [a8 b8 .. a15 b15] */
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512i right = _mm512_set1_epi32(1), below = _mm512_set1_epi32(2),
                below_right = _mm512_set1_epi32(3);
  const float *const dx_end = dx + planes * h * w;
  const int64_t windows = planes * oh * ow;
  for (int64_t p = 0; p < planes; p++) {
    float *dxp = dx + p * h * w;
    for (int64_t i = 0; i < oh; i++) {
      float *r0 = dxp + 2 * i * w, *r1 = r0 + w;
      const int64_t row = (p * oh + i) * ow; /* this output row's windows */
      for (int64_t j = 0; j < ow; j += 16) {
        /* only for rows of one step: a second step's extra stores would
         * land on the next row's elements already written */
        const bool whole = ow < 16 && row + 16 <= windows && r1 + 32 <= dx_end;
        /* windows in this step, or 16 when whole vectors are safe */
        const int64_t n = whole || ow - j >= 16 ? 16 : ow - j;
        const __mmask16 out = (__mmask16)((1u << n) - 1);
        const __mmask16 lo = 2 * n >= 16 ? 0xffff : (__mmask16)((1u << (2 * n)) - 1);
        const __mmask16 hi = 2 * n > 16 ? (__mmask16)((1u << (2 * n - 16)) - 1) : 0;
        const __m512 g = _mm512_add_ps(zero, _mm512_maskz_loadu_ps(out, dy + row + j));
        /* each window's max's place: 0 1 on the top row, 2 3 below */
        __m128i codes;
        if (n == 16) {
          codes = _mm_loadu_si128((const __m128i *)(argmax + row + j));
        } else { /* a byte-masked load would need AVX-512BW: copy the n */
          int8_t part[16] = {0};
          memcpy(part, argmax + row + j, (size_t)n);
          codes = _mm_loadu_si128((const __m128i *)part);
        }
        const __m512i at = _mm512_cvtepi8_epi32(codes);
        const __m512 v00 =
            _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(at, _mm512_setzero_si512()), g);
        const __m512 v01 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(at, right), g);
        const __m512 v10 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(at, below), g);
        const __m512 v11 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(at, below_right), g);
        const __m512 t0 = _mm512_permutex2var_ps(v00, first, v01);
        const __m512 t1 = _mm512_permutex2var_ps(v00, second, v01);
        const __m512 b0 = _mm512_permutex2var_ps(v10, first, v11);
        const __m512 b1 = _mm512_permutex2var_ps(v10, second, v11);
        if (n == 16) {
          _mm512_storeu_ps(r0 + 2 * j, t0);
          _mm512_storeu_ps(r0 + 2 * j + 16, t1);
          _mm512_storeu_ps(r1 + 2 * j, b0);
          _mm512_storeu_ps(r1 + 2 * j + 16, b1);
        } else {
          _mm512_mask_storeu_ps(r0 + 2 * j, lo, t0);
          _mm512_mask_storeu_ps(r0 + 2 * j + 16, hi, t1);
          _mm512_mask_storeu_ps(r1 + 2 * j, lo, b0);
          _mm512_mask_storeu_ps(r1 + 2 * j + 16, hi, b1);
        }
      }
      for (int64_t b = 2 * ow; b < w; b++) r0[b] = 0.0f, r1[b] = 0.0f;
    }
    if (2 * oh < h) memset(dxp + 2 * oh * w, 0, (size_t)((h - 2 * oh) * w) * sizeof(float));
  }
}

void ddp__cpu_max_pool2d_backward(float *dx, const float *dy, const void *argmax,
                                  int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                  int64_t stride, int64_t oh, int64_t ow, bool accumulate) {
  if (!accumulate && kernel == 2 && stride == 2 && ddp__cpu_has_avx512()) {
    unpool2x2_avx512(dx, dy, argmax, planes, h, w, oh, ow);
    return;
  }
  if (!accumulate && kernel == 2 && stride == 2 && ddp__cpu_has_avx2()) {
    ddp__cpu_max_unpool2x2_avx2(dx, dy, argmax, planes, h, w, oh, ow);
    return;
  }
  const int64_t bytes = ddp__pool_arg_bytes(kernel);
  for (int64_t p = 0; p < planes; p++) {
    float *dxp = dx + p * h * w;
    const float *dyp = dy + p * oh * ow;
    /* A fresh gradient is zeroed a plane at a time, right before the
     * scatter, so the plane is still in cache when the scatter writes it;
     * zeroing the whole buffer first sends it to memory and back. */
    if (!accumulate) memset(dxp, 0, (size_t)(h * w) * sizeof(float));
    for (int64_t i = 0; i < oh; i++)
      for (int64_t j = 0; j < ow; j++) {
        const int32_t at = ddp__pool_arg_get(argmax, (p * oh + i) * ow + j, bytes);
        if (at >= 0)
          dxp[(i * stride + at / kernel) * w + j * stride + at % kernel] += dyp[i * ow + j];
      }
  }
}
