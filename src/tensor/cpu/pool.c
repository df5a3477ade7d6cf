/* CPU max pooling (no padding, floor mode) and its backward. The comparison
 * is PyTorch's CPU one, `v > max || isnan(v)`: the first maximum in
 * row-major window order wins a tie, and a NaN propagates. */
#include <math.h>

#include "tensor/cpu/dense.h"

/* kernel 2, stride 2: the ConvNet's pooling, unrolled. */
static void pool2x2(float *restrict y, int32_t *restrict argmax, const float *restrict x,
                    int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow) {
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    float *yp = y + p * oh * ow;
    int32_t *ap = argmax ? argmax + p * oh * ow : NULL;
    for (int64_t i = 0; i < oh; i++) {
      const float *r0 = xp + 2 * i * w, *r1 = r0 + w;
      for (int64_t j = 0; j < ow; j++) {
        float m = -INFINITY, v = r0[2 * j];
        int32_t at = (int32_t)(2 * i * w + 2 * j);
        if (v > m || isnan(v)) m = v;
        v = r0[2 * j + 1];
        if (v > m || isnan(v)) { m = v; at = (int32_t)(2 * i * w + 2 * j + 1); }
        v = r1[2 * j];
        if (v > m || isnan(v)) { m = v; at = (int32_t)((2 * i + 1) * w + 2 * j); }
        v = r1[2 * j + 1];
        if (v > m || isnan(v)) { m = v; at = (int32_t)((2 * i + 1) * w + 2 * j + 1); }
        yp[i * ow + j] = m;
        if (ap) ap[i * ow + j] = at;
      }
    }
  }
}

void ddp__cpu_max_pool2d_forward(float *y, int32_t *argmax, const float *x, int64_t planes,
                                 int64_t h, int64_t w, int64_t kernel, int64_t stride,
                                 int64_t oh, int64_t ow) {
  if (kernel == 2 && stride == 2) {
    pool2x2(y, argmax, x, planes, h, w, oh, ow);
    return;
  }
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    for (int64_t i = 0; i < oh; i++)
      for (int64_t j = 0; j < ow; j++) {
        int64_t top = i * stride, left = j * stride;
        float m = -INFINITY;
        int64_t at = top * w + left;
        for (int64_t a = top; a < top + kernel; a++)
          for (int64_t b = left; b < left + kernel; b++) {
            float v = xp[a * w + b];
            if (v > m || isnan(v)) {
              m = v;
              at = a * w + b;
            }
          }
        y[(p * oh + i) * ow + j] = m;
        if (argmax) argmax[(p * oh + i) * ow + j] = (int32_t)at;
      }
  }
}

void ddp__cpu_max_pool2d_backward(float *dx, const float *dy, const int32_t *argmax,
                                  int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow) {
  for (int64_t p = 0; p < planes; p++) {
    float *dxp = dx + p * h * w;
    const float *dyp = dy + p * oh * ow;
    const int32_t *ap = argmax + p * oh * ow;
    for (int64_t i = 0; i < oh * ow; i++) dxp[ap[i]] += dyp[i];
  }
}
