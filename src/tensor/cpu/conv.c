/* CPU 2-D convolution (NCHW, zero padding, dilation 1, groups 1), forward and
 * backward, as one gemm per sample over an im2col matrix.
 *
 * Why per sample: the column matrix of one sample, col (C*KH*KW, OH*OW), is
 * small enough to stay in L2 (the ConvNet's conv2: 400 x 196 floats, 313 KB),
 * and the gemm W (O, C*KH*KW) @ col writes (O, OH*OW), which is exactly the
 * sample's slice of the NCHW output: no transpose afterwards. Backward
 * rebuilds col instead of saving it from forward (saving would cost N times
 * that memory and a trip through DRAM; rebuilding is a few stores per 50
 * flops), accumulates dW over samples with beta = 1, and forms dX through
 * dcol = W^T @ dY followed by col2im. */
#include <string.h>

#include "tensor/cpu/dense.h"

/* The output columns [*lo, *hi) whose input column ow*stride - pad + kw lies
 * inside [0, w); the others read zero padding. */
static void valid_range(const ddp__conv2d_geom *g, int64_t kw, int64_t *lo, int64_t *hi) {
  int64_t first = g->pad - kw; /* smallest ow*stride that is in range */
  int64_t l = first > 0 ? (first + g->stride - 1) / g->stride : 0;
  int64_t last = g->w - 1 + g->pad - kw; /* largest ow*stride in range */
  int64_t h = last >= 0 ? last / g->stride + 1 : 0;
  if (h > g->ow) h = g->ow;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* col (C*KH*KW, OH*OW) from one sample x (C, H, W). */
static void im2col(float *restrict col, const float *restrict x, const ddp__conv2d_geom *g) {
  const int64_t ohw = g->oh * g->ow, s = g->stride;
  for (int64_t c = 0; c < g->c; c++) {
    const float *xc = x + c * g->h * g->w;
    for (int64_t kh = 0; kh < g->kh; kh++)
      for (int64_t kw = 0; kw < g->kw; kw++) {
        float *row = col + ((c * g->kh + kh) * g->kw + kw) * ohw;
        int64_t lo, hi;
        valid_range(g, kw, &lo, &hi);
        for (int64_t oh = 0; oh < g->oh; oh++) {
          float *dst = row + oh * g->ow;
          int64_t ih = oh * s - g->pad + kh;
          if (ih < 0 || ih >= g->h) {
            memset(dst, 0, (size_t)g->ow * sizeof(float));
            continue;
          }
          const int64_t off = ih * g->w - g->pad + kw; /* x column of ow is off + ow*s */
          for (int64_t j = 0; j < lo; j++) dst[j] = 0.0f;
          if (s == 1)
            memcpy(dst + lo, xc + off + lo, (size_t)(hi - lo) * sizeof(float));
          else
            for (int64_t j = lo; j < hi; j++) dst[j] = xc[off + j * s];
          for (int64_t j = hi; j < g->ow; j++) dst[j] = 0.0f;
        }
      }
  }
}

/* dx (C, H, W) += the transpose of im2col applied to dcol (C*KH*KW, OH*OW). */
static void col2im_add(float *restrict dx, const float *restrict dcol,
                       const ddp__conv2d_geom *g) {
  const int64_t ohw = g->oh * g->ow, s = g->stride;
  for (int64_t c = 0; c < g->c; c++) {
    float *dxc = dx + c * g->h * g->w;
    for (int64_t kh = 0; kh < g->kh; kh++)
      for (int64_t kw = 0; kw < g->kw; kw++) {
        const float *row = dcol + ((c * g->kh + kh) * g->kw + kw) * ohw;
        int64_t lo, hi;
        valid_range(g, kw, &lo, &hi);
        for (int64_t oh = 0; oh < g->oh; oh++) {
          int64_t ih = oh * s - g->pad + kh;
          if (ih < 0 || ih >= g->h) continue;
          const float *src = row + oh * g->ow;
          const int64_t off = ih * g->w - g->pad + kw;
          for (int64_t j = lo; j < hi; j++) dxc[off + j * s] += src[j];
        }
      }
  }
}

/* A 1x1 kernel with stride 1 and no padding needs no im2col: col is x. */
static bool is_pointwise(const ddp__conv2d_geom *g) {
  return g->kh == 1 && g->kw == 1 && g->stride == 1 && g->pad == 0;
}

static float *scratch(ddp_arena *arena, int64_t floats, ddp_status *status) {
  float *p = ddp_arena_alloc(arena, (size_t)floats * sizeof(float));
  if (!p)
    *status = ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate %lld floats of scratch",
                        (long long)floats);
  return p;
}

ddp_status ddp__cpu_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                   const ddp__conv2d_geom *g, ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  ddp_status status = DDP_OK;
  float *col = NULL;
  if (!is_pointwise(g) && !(col = scratch(arena, k * ohw, &status))) return status;
  for (int64_t n = 0; n < g->n; n++) {
    const float *xn = x + n * chw;
    float *yn = y + n * g->o * ohw; /* (O, OH*OW) */
    if (col) im2col(col, xn, g);
    if (b)
      for (int64_t o = 0; o < g->o; o++) {
        float *row = yn + o * ohw;
        for (int64_t i = 0; i < ohw; i++) row[i] = b[o];
      }
    /* yn (O, OH*OW) (+)= w (O, K) @ col (K, OH*OW) */
    ddp__cpu_gemm(false, false, g->o, ohw, k, 1.0f, w, k, col ? col : xn, ohw, b ? 1.0f : 0.0f,
                  yn, ohw);
  }
  return DDP_OK;
}

ddp_status ddp__cpu_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                    const float *x, const float *w, const ddp__conv2d_geom *g,
                                    ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  const bool pointwise = is_pointwise(g);
  ddp_status status = DDP_OK;
  float *col = NULL, *dcol = NULL;
  if (dw && !pointwise && !(col = scratch(arena, k * ohw, &status))) return status;
  if (dx && !pointwise && !(dcol = scratch(arena, k * ohw, &status))) return status;
  for (int64_t n = 0; n < g->n; n++) {
    const float *xn = x + n * chw;
    const float *dyn = dy + n * g->o * ohw; /* (O, OH*OW) */
    if (db)
      for (int64_t o = 0; o < g->o; o++) {
        const float *row = dyn + o * ohw;
        float sum = 0.0f;
        for (int64_t i = 0; i < ohw; i++) sum += row[i];
        db[o] += sum;
      }
    if (dw) {
      if (col) im2col(col, xn, g);
      /* dw (O, K) += dy (O, OH*OW) @ col^T (OH*OW, K) */
      ddp__cpu_gemm(false, true, g->o, k, ohw, 1.0f, dyn, ohw, col ? col : xn, ohw, 1.0f, dw, k);
    }
    if (dx) {
      float *dxn = dx + n * chw;
      if (pointwise) {
        /* dx (C, H*W) += w^T (C, O) @ dy (O, H*W) */
        ddp__cpu_gemm(true, false, k, ohw, g->o, 1.0f, w, k, dyn, ohw, 1.0f, dxn, ohw);
      } else {
        /* dcol (K, OH*OW) = w^T (K, O) @ dy (O, OH*OW), then scatter-add. */
        ddp__cpu_gemm(true, false, k, ohw, g->o, 1.0f, w, k, dyn, ohw, 0.0f, dcol, ohw);
        col2im_add(dxn, dcol, g);
      }
    }
  }
  return DDP_OK;
}
