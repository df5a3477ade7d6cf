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
 * dcol = W^T @ dY followed by col2im, or, for stride 1, as a convolution of
 * dY with the flipped weight (one gemm accumulating straight into dX).
 * Stride-1 column matrices are copied from a zero-padded copy of the sample,
 * with no bounds tests.
 *
 * Two implementations: the generic one (OpenBLAS, any CPU) first, then the
 * vector one, run by the AVX-512 or the AVX2 family's kernels (whichever
 * runs, cpu/family.c), which keeps the per-sample scheme but mostly does
 * without the column matrix (see its comment below). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/cpu/dense.h"

#define AVX512 __attribute__((target("avx512f,fma")))

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

/* db (O) += row sums of dy (O, OH*OW). Eight partial sums: a single running
 * sum is a chain of dependent adds (4 cycles each), which made this loop
 * cost as much as conv1's whole weight gradient. */
static void bias_grad(float *db, const float *dy, int64_t o, int64_t ohw) {
  for (int64_t i = 0; i < o; i++) {
    const float *row = dy + i * ohw;
    float part[8] = {0};
    int64_t p = 0;
    for (; p + 8 <= ohw; p += 8)
      for (int l = 0; l < 8; l++) part[l] += row[p + l];
    float sum = 0.0f;
    for (; p < ohw; p++) sum += row[p];
    for (int l = 0; l < 8; l++) sum += part[l];
    db[i] += sum;
  }
}

static float *scratch(ddp_arena *arena, int64_t floats, ddp_status *status) {
  float *p = ddp_arena_alloc(arena, (size_t)floats * sizeof(float));
  if (!p)
    *status = ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate %lld floats of scratch",
                        (long long)floats);
  return p;
}

/* Autocast's rounding of n floats of one sample in place (g->round). */
static void round_sample(float *p, int64_t n, const ddp__conv2d_geom *g) {
  if (g->round != DDP_FLOAT32) ddp_convert_round_f32(p, p, (size_t)n, (ddp_dtype)g->round);
}

/* dy of sample n as the backward reads it: rounded into dyr (o*ohw floats)
 * when g->round asks for it, else in place. */
static const float *dy_sample(const float *dy, float *dyr, int64_t n,
                              const ddp__conv2d_geom *g) {
  const int64_t len = g->o * g->oh * g->ow;
  if (g->round == DDP_FLOAT32) return dy + n * len;
  /* The rounding pass reads dy from memory (the layer above wrote it a
   * channel at a time, long ago), where the float32 kernels' reads overlap
   * their arithmetic: the next sample's is asked for into L2 now, to be
   * there when its pass comes. */
  if (n + 1 < g->n) {
    const char *next = (const char *)(dy + (n + 1) * len);
    for (size_t off = 0; off < (size_t)len * sizeof(float); off += 64)
      __builtin_prefetch(next + off, 0, 2);
  }
  ddp_convert_round_f32(dyr, dy + n * len, (size_t)len, (ddp_dtype)g->round);
  return dyr;
}

/* Floats of room past the end of padded copies and column matrices, for
 * the AVX-512 path's whole-vector reads and writes (see there). */
#define SLACK 16

/* A zero-padded copy of one sample, (C, H+2ph, W+2pw), with per-tap offsets
 * off[(c*KH + a)*KW + b] = (c*HP + a)*WP + b. The border is zeroed once and
 * pad_copy rewrites only the interior for each sample. */
typedef struct padded {
  float *xp;
  int64_t *off;
  int64_t c, h, w, ph, pw, hp, wp;
} padded;

static ddp_status padded_init(padded *p, int64_t c, int64_t h, int64_t w, int64_t ph,
                              int64_t pw, int64_t kh, int64_t kw, ddp_arena *arena) {
  ddp_status status = DDP_OK;
  *p = (padded){.c = c, .h = h, .w = w, .ph = ph, .pw = pw, .hp = h + 2 * ph, .wp = w + 2 * pw};
  const int64_t floats = c * p->hp * p->wp + SLACK;
  if (!(p->xp = scratch(arena, floats, &status))) return status;
  memset(p->xp, 0, (size_t)floats * sizeof(float));
  p->off = ddp_arena_alloc(arena, (size_t)(c * kh * kw) * sizeof(int64_t));
  if (!p->off) return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate tap offsets");
  for (int64_t ci = 0; ci < c; ci++)
    for (int64_t a = 0; a < kh; a++)
      for (int64_t b = 0; b < kw; b++)
        p->off[(ci * kh + a) * kw + b] = (ci * p->hp + a) * p->wp + b;
  return DDP_OK;
}

static void pad_copy(padded *p, const float *restrict x) {
  for (int64_t ci = 0; ci < p->c; ci++)
    for (int64_t y = 0; y < p->h; y++)
      memcpy(p->xp + (ci * p->hp + y + p->ph) * p->wp + p->pw, x + (ci * p->h + y) * p->w,
             (size_t)p->w * sizeof(float));
}

/* col (C*KH*KW, OH*OW) from a padded sample, stride 1, in plain loops. */
static void im2col_padded_portable(float *restrict col, const padded *p, int64_t kh, int64_t kw,
                                   int64_t oh, int64_t ow) {
  for (int64_t t = 0; t < p->c * kh * kw; t++) {
    float *dst = col + t * oh * ow;
    const float *src = p->xp + p->off[t];
    for (int64_t oy = 0; oy < oh; oy++, dst += ow, src += p->wp)
      for (int64_t ox = 0; ox < ow; ox++) dst[ox] = src[ox];
  }
}

AVX512 static void im2col_padded(float *restrict col, const padded *p, int64_t kh, int64_t kw,
                                 int64_t oh, int64_t ow);

typedef void im2col_padded_fn(float *restrict col, const padded *p, int64_t kh, int64_t kw,
                              int64_t oh, int64_t ow);

/* Fills col for sample x: from the padded copy (stride 1; by `copy`, the
 * vector families' whole-vector copies, which leave SLACK room for them, or
 * plain loops when NULL) or directly. */
static void col_fill(float *col, padded *p, const float *x, const ddp__conv2d_geom *g,
                     im2col_padded_fn *copy) {
  if (g->stride != 1) {
    im2col(col, x, g);
    return;
  }
  pad_copy(p, x);
  if (copy)
    copy(col, p, g->kh, g->kw, g->oh, g->ow);
  else
    im2col_padded_portable(col, p, g->kh, g->kw, g->oh, g->ow);
}

/* For stride 1 and padding <= K-1, dX is a stride-1 convolution of dy with
 * the flipped, transposed weight and padding K-1-pad (>= 0):
 * dx[c][i][j] = sum over o, a, b of wflip[c][o][a][b] * dyp[o][i+a][j+b]. */
static bool dx_is_conv(const ddp__conv2d_geom *g) {
  return g->stride == 1 && g->pad <= g->kh - 1 && g->pad <= g->kw - 1;
}

/* wflip (C, O, KH, KW)[c][o][a][b] = w (O, C, KH, KW)[o][c][KH-1-a][KW-1-b],
 * and, unless dyp is NULL, a padded buffer for dy (O, OH, OW) with padding
 * K-1-pad. */
static ddp_status dx_conv_init(float **wflip, padded *dyp, const float *w,
                               const ddp__conv2d_geom *g, ddp_arena *arena) {
  ddp_status status = DDP_OK;
  const int64_t kk = g->kh * g->kw;
  float *f = scratch(arena, g->c * g->o * kk, &status);
  if (!f) return status;
  for (int64_t c = 0; c < g->c; c++)
    for (int64_t o = 0; o < g->o; o++)
      for (int64_t t = 0; t < kk; t++)
        f[(c * g->o + o) * kk + t] = w[(o * g->c + c) * kk + (kk - 1 - t)];
  *wflip = f;
  if (!dyp) return DDP_OK;
  return padded_init(dyp, g->o, g->oh, g->ow, g->kh - 1 - g->pad, g->kw - 1 - g->pad, g->kh,
                     g->kw, arena);
}

static ddp_status forward_generic(float *y, const float *x, const float *w, const float *b,
                                  const ddp__conv2d_geom *g, ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  ddp_status status = DDP_OK;
  float *col = NULL;
  padded xp = {0};
  if (!is_pointwise(g) && !(col = scratch(arena, k * ohw, &status))) return status;
  if (col && g->stride == 1)
    DDP_TRY(padded_init(&xp, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
  for (int64_t n = 0; n < g->n; n++) {
    const float *xn = x + n * chw;
    float *yn = y + n * g->o * ohw; /* (O, OH*OW) */
    if (col) col_fill(col, &xp, xn, g, NULL);
    if (b)
      for (int64_t o = 0; o < g->o; o++) {
        float *row = yn + o * ohw;
        for (int64_t i = 0; i < ohw; i++) row[i] = b[o];
      }
    /* yn (O, OH*OW) (+)= w (O, K) @ col (K, OH*OW) */
    ddp__cpu_gemm(false, false, g->o, ohw, k, 1.0f, w, k, col ? col : xn, ohw, b ? 1.0f : 0.0f,
                  yn, ohw);
    round_sample(yn, g->o * ohw, g);
  }
  return DDP_OK;
}

static ddp_status backward_generic(float *dx, float *dw, float *db, const float *dy,
                                   const float *x, const float *w, const ddp__conv2d_geom *g,
                                   bool dx_accumulate, ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  const bool pointwise = is_pointwise(g);
  const bool dx_as_conv = !pointwise && dx_is_conv(g);
  const int64_t kk = g->kh * g->kw, hw = g->h * g->w;
  ddp_status status = DDP_OK;
  float *col = NULL, *dcol = NULL, *wflip = NULL;
  padded xp = {0}, dyp = {0};
  if (dw && !pointwise) {
    if (!(col = scratch(arena, k * ohw, &status))) return status;
    if (g->stride == 1)
      DDP_TRY(padded_init(&xp, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
  }
  if (dx && dx_as_conv) {
    DDP_TRY(dx_conv_init(&wflip, &dyp, w, g, arena));
    if (!(dcol = scratch(arena, g->o * kk * hw, &status))) return status;
  } else if (dx && !pointwise && !(dcol = scratch(arena, k * ohw, &status))) {
    return status;
  }
  float *dyr = NULL;
  if (g->round != DDP_FLOAT32 && !(dyr = scratch(arena, g->o * ohw, &status))) return status;
  for (int64_t n = 0; n < g->n; n++) {
    const float *xn = x + n * chw;
    const float *dyn = dy_sample(dy, dyr, n, g); /* (O, OH*OW) */
    if (db) bias_grad(db, dyn, g->o, ohw);
    if (dw) {
      if (col) col_fill(col, &xp, xn, g, NULL);
      /* dw (O, K) += dy (O, OH*OW) @ col^T (OH*OW, K) */
      ddp__cpu_gemm(false, true, g->o, k, ohw, 1.0f, dyn, ohw, col ? col : xn, ohw, 1.0f, dw, k);
    }
    if (dx) {
      float *dxn = dx + n * chw;
      const float beta = dx_accumulate ? 1.0f : 0.0f;
      if (pointwise) {
        /* dx (C, H*W) += w^T (C, O) @ dy (O, H*W) */
        ddp__cpu_gemm(true, false, k, ohw, g->o, 1.0f, w, k, dyn, ohw, beta, dxn, ohw);
      } else if (dx_as_conv) {
        /* dx (C, H*W) += wflip (C, O*KH*KW) @ im2col(dy padded by K-1-pad) */
        pad_copy(&dyp, dyn);
        im2col_padded_portable(dcol, &dyp, g->kh, g->kw, g->h, g->w);
        ddp__cpu_gemm(false, false, g->c, hw, g->o * kk, 1.0f, wflip, g->o * kk, dcol, hw, beta,
                      dxn, hw);
      } else {
        /* dcol (K, OH*OW) = w^T (K, O) @ dy (O, OH*OW), then scatter-add. */
        ddp__cpu_gemm(true, false, k, ohw, g->o, 1.0f, w, k, dyn, ohw, 0.0f, dcol, ohw);
        if (!dx_accumulate) memset(dxn, 0, (size_t)chw * sizeof(float));
        col2im_add(dxn, dcol, g);
      }
      round_sample(dxn, chw, g);
    }
  }
  return DDP_OK;
}

/* ---- the vector path (AVX-512 or AVX2) -----------------------------------
 * The gemms run on ddp__cpu_gemm*_avx512 (cpu/gemm.c) or *_avx2
 * (cpu/gemm_avx2.c), and the layout work
 * around them is cut down, which matters as much at the ConvNet's shapes:
 *   - stride 1 needs no column matrix at all: the forward and dX read a
 *     zero-padded copy of the sample through per-tap offsets, one or two
 *     vectors per output row (rows up to 32 wide), and dW^T (K, O) accumulates
 *     sum_p xp[off[t] + p] * dy^T[p] the same way; dW += its transpose once
 *     at the end of the batch. Otherwise a column matrix as above.
 *   - dX for stride 1 is itself a stride-1 convolution of dy, with the
 *     flipped, transposed weight (C, O, KH, KW) and padding K-1-pad: one
 *     gemm with k = O*KH*KW accumulating straight into dx, instead of a
 *     gemm with k = O and a scatter-add (col2im).
 *   - with few output channels (conv1: 16), dW is a set of dot products of
 *     dy rows with column-matrix rows, needing no transposed copy of dy.
 *   - "same" convolutions with few channels (convnet-N's 10) read shifted
 *     copies of the sample as flat rows instead (see `shifted` below).
 * Masked stores cost ~10 cycles each on AMD (Zen 5): copies use whole
 * vectors and let a row's spare lanes spill onto the next row, which is
 * written afterwards; buffers carry SLACK floats past their end for that. */
/* col (C*KH*KW, OH*OW) from a padded sample, stride 1: whole-vector copies. */
AVX512 static void im2col_padded(float *restrict col, const padded *p, int64_t kh, int64_t kw,
                                 int64_t oh, int64_t ow) {
  for (int64_t t = 0; t < p->c * kh * kw; t++) {
    float *dst = col + t * oh * ow;
    const float *src = p->xp + p->off[t];
    for (int64_t oy = 0; oy < oh; oy++, dst += ow, src += p->wp)
      for (int64_t ox = 0; ox < ow; ox += 16)
        _mm512_storeu_ps(dst + ox, _mm512_loadu_ps(src + ox));
  }
}

/* dst (cols, rows) = src (rows, cols)^T. Blocks of 16 x 16 are transposed
 * in registers (four rounds of unpack/shuffle); the edges go element by
 * element. dy^T for conv2's dW (32 x 196) is 0.19 ms a batch element-wise. */
AVX512 static void transpose(float *restrict dst, const float *restrict src, int64_t rows,
                             int64_t cols) {
  const int64_t rows16 = rows - rows % 16, cols16 = cols - cols % 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < cols16; j0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + (i0 + i) * cols + j0);
      for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
        __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
      }
      /* r[4q + k] holds, in each 128-bit lane l, column 4l + k of rows
       * 4q .. 4q+3; gather the lanes: first pairs of rows-groups, then pairs. */
      for (int k = 0; k < 4; k++) {
        __m512 a0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);      /* lanes 0,2 | 0,2 */
        __m512 a1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);      /* lanes 1,3 | 1,3 */
        __m512 b0 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        __m512 b1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
        t[k] = _mm512_shuffle_f32x4(a0, b0, 0x88);      /* column k */
        t[8 + k] = _mm512_shuffle_f32x4(a0, b0, 0xdd);  /* column 8 + k */
        t[4 + k] = _mm512_shuffle_f32x4(a1, b1, 0x88);  /* column 4 + k */
        t[12 + k] = _mm512_shuffle_f32x4(a1, b1, 0xdd); /* column 12 + k */
      }
      for (int j = 0; j < 16; j++) _mm512_storeu_ps(dst + (j0 + j) * rows + i0, t[j]);
    }
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; j++) dst[j * rows + i] = src[i * cols + j];
}

/* "Same" convolutions (stride 1, K = 2*pad + 1, output as large as the
 * input) with few channels: the output's H*W positions run as one flat
 * row, and the column matrix's row for tap (c, a, b) is a slice of one of KW
 * shifted copies of channel c: copy_b[r][x] = x[r - pad][x + b - pad] (zero
 * outside), with pad zero rows above and below, so that row (c, a, b) is
 * copy_b + a*W, H*W floats long. The gemms read it through per-tap offsets
 * (cpu/gemm.c, *_off). Against the padded rows of conv_rows: no lanes lost
 * to rows narrower than their vectors (28 of 32 on MNIST) and no tiles of
 * one channel (10 channels were a tile of 8 and two of 1), and the weight
 * gradient needs no column matrix (im2col was a tenth of a convnet-10 step).
 * Each output adds the same products in the same order as the other paths,
 * so the results are the same bits. */
typedef struct shifted {
  float *buf;   /* (C, KW, H + 2*pad, W), zero where no input falls */
  int64_t *off; /* off[(c*KH + a)*KW + b] = ((c*KW + b)*(H + 2*pad) + a)*W */
  int64_t c, h, w, kw, pad;
} shifted;

static bool is_same(const ddp__conv2d_geom *g) {
  return g->stride == 1 && g->kh == g->kw && g->kh == 2 * g->pad + 1 && g->oh == g->h &&
         g->ow == g->w;
}

/* Below this many output channels (of the forward or of dX), the shifted
 * copies; from it on, the ConvNet's paths (conv_rows, tuned at 16 and 32). */
#define SHIFTED_MAX_CHANNELS 16

static ddp_status shifted_init(shifted *s, int64_t c, int64_t h, int64_t w, int64_t k,
                               int64_t pad, ddp_arena *arena) {
  ddp_status status = DDP_OK;
  const int64_t hp = h + 2 * pad, floats = c * k * hp * w + SLACK;
  *s = (shifted){.c = c, .h = h, .w = w, .kw = k, .pad = pad};
  if (!(s->buf = scratch(arena, floats, &status))) return status;
  memset(s->buf, 0, (size_t)floats * sizeof(float));
  s->off = ddp_arena_alloc(arena, (size_t)(c * k * k) * sizeof(int64_t));
  if (!s->off) return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate tap offsets");
  for (int64_t ci = 0; ci < c; ci++)
    for (int64_t a = 0; a < k; a++)
      for (int64_t b = 0; b < k; b++) s->off[(ci * k + a) * k + b] = ((ci * k + b) * hp + a) * w;
  return DDP_OK;
}

/* The copies of one sample x (C, H, W); the zeros stay from shifted_init.
 * Rows up to 32 wide go as two whole vectors each, loaded under a mask
 * (masked-off lanes read nothing, so x - 1 is never touched) with zeros in
 * the lanes past the row: those land on the next row's start, which is
 * written next, or on the zero rows below (SLACK covers the last plane).
 * A memcpy per row of 27 floats cost as much as the weight gradient's
 * gemm's tenth. */
AVX512 static void shifted_copy_avx512(shifted *s, const float *restrict x) {
  const int64_t hp = s->h + 2 * s->pad, w = s->w;
  for (int64_t ci = 0; ci < s->c; ci++)
    for (int64_t b = 0; b < s->kw; b++) {
      const int64_t shift = b - s->pad; /* copy column j holds input column j + shift */
      const int64_t dst0 = shift < 0 ? -shift : 0, src0 = shift > 0 ? shift : 0;
      const int64_t n = w - (shift < 0 ? -shift : shift);
      float *dst = s->buf + ((ci * s->kw + b) * hp + s->pad) * w;
      const float *src = x + ci * s->h * w;
      if (w > 32) {
        for (int64_t r = 0; r < s->h; r++, dst += w, src += w)
          memcpy(dst + dst0, src + src0, (size_t)n * sizeof(float));
        continue;
      }
      /* lanes [dst0, dst0 + n) of the 32 hold src[j + shift] */
      const uint32_t valid = (uint32_t)(((uint64_t)1 << n) - 1) << dst0;
      const __mmask16 lo = (__mmask16)valid, hi = (__mmask16)(valid >> 16);
      for (int64_t r = 0; r < s->h; r++, dst += w, src += w) {
        __m512 v0 = _mm512_maskz_loadu_ps(lo, src + shift);
        __m512 v1 = _mm512_maskz_loadu_ps(hi, src + shift + 16);
        _mm512_storeu_ps(dst, v0);
        if (w > 16) _mm512_storeu_ps(dst + 16, v1);
      }
    }
}

/* The kernels of one vector family (AVX-512 or AVX2): the per-geometry
 * scheme below is the same for both, the kernels under it differ. A
 * family without Winograd kernels (NULL) would run its 3x3 convolutions
 * with many channels on the direct kernels. */
typedef struct vec_family {
  void (*gemm)(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
               int64_t ldb, float *c, int64_t ldc, const float *row_bias, bool accumulate);
  void (*gemm_off)(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                   const float *b, const int64_t *boff, float *c, int64_t ldc,
                   const float *row_bias, bool accumulate);
  void (*gemm_nt)(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                  int64_t ldb, float *c, int64_t ldc);
  void (*gemm_nt_off)(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                      const float *b, const int64_t *boff, float *c, int64_t ldc);
  void (*conv_rows)(int64_t m, int64_t taps, const float *packed, const float *xp,
                    const int64_t *off, int64_t wp, float *y, int64_t oh, int64_t ow,
                    const float *bias, bool accumulate);
  void (*conv_taps)(int64_t taps, int64_t n, const float *xp, const int64_t *off, int64_t wp,
                    int64_t oh, int64_t ow, const float *dyt, float *dwt);
  void (*winograd_conv3x3)(int64_t m, int64_t c, const float *u, const float *x, float *y,
                           int64_t oh, int64_t ow, const float *bias, bool accumulate,
                           float *scratch);
  void (*winograd_dw_sample)(int64_t m, int64_t c, const float *x, const float *dy, int64_t oh,
                             int64_t ow, float *du, float *scratch);
  im2col_padded_fn *im2col_padded;
  void (*transpose)(float *restrict dst, const float *restrict src, int64_t rows, int64_t cols);
  void (*shifted_copy)(shifted *s, const float *restrict x);
} vec_family;

/* The AVX2 family's layout helpers (cpu/conv_avx2.c) take plain arrays. */
static void im2col_padded_avx2(float *restrict col, const padded *p, int64_t kh, int64_t kw,
                               int64_t oh, int64_t ow) {
  ddp__cpu_copy_taps_avx2(col, p->xp, p->off, p->c * kh * kw, p->wp, oh, ow);
}

static void shifted_copy_avx2(shifted *s, const float *restrict x) {
  ddp__cpu_shifted_copy_avx2(s->buf, x, s->c, s->h, s->w, s->kw, s->pad);
}

static const vec_family family_avx512 = {
    .gemm = ddp__cpu_gemm_avx512,
    .gemm_off = ddp__cpu_gemm_off_avx512,
    .gemm_nt = ddp__cpu_gemm_nt_avx512,
    .gemm_nt_off = ddp__cpu_gemm_nt_off_avx512,
    .conv_rows = ddp__cpu_conv_rows_avx512,
    .conv_taps = ddp__cpu_conv_taps_avx512,
    .winograd_conv3x3 = ddp__cpu_winograd_conv3x3_avx512,
    .winograd_dw_sample = ddp__cpu_winograd_dw_sample_avx512,
    .im2col_padded = im2col_padded,
    .transpose = transpose,
    .shifted_copy = shifted_copy_avx512,
};

static const vec_family family_avx2 = {
    .gemm = ddp__cpu_gemm_avx2,
    .gemm_off = ddp__cpu_gemm_off_avx2,
    .gemm_nt = ddp__cpu_gemm_nt_avx2,
    .gemm_nt_off = ddp__cpu_gemm_nt_off_avx2,
    .conv_rows = ddp__cpu_conv_rows_avx2,
    .conv_taps = ddp__cpu_conv_taps_avx2,
    .winograd_conv3x3 = ddp__cpu_winograd_conv3x3_avx2,
    .winograd_dw_sample = ddp__cpu_winograd_dw_sample_avx2,
    .im2col_padded = im2col_padded_avx2,
    .transpose = ddp__cpu_transpose_avx2,
    .shifted_copy = shifted_copy_avx2,
};

/* Winograd's F(2x2, 3x3) (cpu/winograd.c) for a stride-1 3x3 convolution
 * from c to m channels with (oh, ow) outputs: 2.25x fewer multiply-adds
 * where the channels are many (psnet's conv2, its dX). DDP_CONV_WINOGRAD=0
 * keeps the direct kernels (to compare, or to rule the path out). */
static bool use_winograd(const vec_family *v, const ddp__conv2d_geom *g, int64_t m, int64_t c,
                         int64_t oh, int64_t ow) {
  if (!v->winograd_conv3x3 || g->stride != 1 || g->kh != 3 || g->kw != 3 ||
      !ddp__cpu_winograd_fits(m, c, oh, ow))
    return false;
  const char *env = getenv("DDP_CONV_WINOGRAD");
  return !env || strcmp(env, "0") != 0;
}

/* The transformed weight and the scratch of a Winograd convolution. */
static ddp_status winograd_init(float **u, float **ws, const float *w, int64_t ldw, int64_t m,
                                int64_t c, int64_t oh, int64_t ow, ddp_arena *arena) {
  ddp_status status = DDP_OK;
  if (!(*u = scratch(arena, ddp__cpu_winograd_weights_floats(m, c), &status))) return status;
  if (!(*ws = scratch(arena, ddp__cpu_winograd_scratch_floats(m, c, oh, ow), &status)))
    return status;
  ddp__cpu_winograd_weights(m, c, w, ldw, *u);
  return DDP_OK;
}

/* Autocast's bfloat16 convolutions with vdpbf16ps (cpu/conv_bf16.c):
 * stride 1, under a bfloat16 region (g->round: the operands hold bfloat16
 * values), with the AVX-512 family on a CPU with AVX512_BF16. They replace
 * conv_rows and conv_taps where those run (the ConvNet's conv1 forward and
 * conv2); Winograd, the shifted copies and the other geometries keep their
 * float32 kernels. DDP_CONV_BF16=0 keeps the float32 kernels everywhere
 * (to compare, or to rule the path out). */
static bool bf16_convs(const vec_family *v, const ddp__conv2d_geom *g) {
  if (v != &family_avx512 || g->round != DDP_BFLOAT16 || g->stride != 1 ||
      !ddp__cpu_has_bf16_dot())
    return false;
  const char *env = getenv("DDP_CONV_BF16");
  return !env || strcmp(env, "0") != 0;
}

/* Forward or dX from cin >= 2 channels, taken in pairs, onto rows up to
 * 32 wide. */
static bool use_bf16_rows(const vec_family *v, const ddp__conv2d_geom *g, int64_t cin,
                          int64_t ow) {
  return cin >= 2 && ow <= 32 && bf16_convs(v, g);
}

/* The forward from one input channel (conv1), the taps paired along
 * kernel rows over the padded image's column pairs: 15 pair taps for a
 * 5x5 kernel instead of 25 taps. Rows up to 32 wide. With an odd kernel
 * width the last pair of a kernel row has one tap: it reads a second
 * image of single columns (the upper half zero), since a zero weight on
 * the next column would meet real inputs (0 times an infinite input is
 * NaN, where the output's window does not hold it). */
static bool use_bf16_cols(const vec_family *v, const ddp__conv2d_geom *g) {
  return g->c == 1 && g->ow <= 32 && bf16_convs(v, g);
}

/* A zero-padded image of channel pairs for conv_rows_bf16, with its pair
 * taps' offsets off[(q*KH + a)*KW + b] = (q*HP + a)*WP + b. */
typedef struct pairs {
  uint32_t *xp;
  int64_t *off;
  int64_t c, h, w, ph, pw, hp, wp, taps;
} pairs;

static ddp_status pairs_init(pairs *p, int64_t c, int64_t h, int64_t w, int64_t ph, int64_t pw,
                             int64_t kh, int64_t kw, ddp_arena *arena) {
  *p = (pairs){.c = c, .h = h, .w = w, .ph = ph, .pw = pw, .hp = h + 2 * ph, .wp = w + 2 * pw,
               .taps = (c + 1) / 2 * kh * kw};
  const size_t bytes = (size_t)ddp__cpu_conv_bf16_pairs_words(c, p->hp, p->wp) * sizeof(uint32_t);
  p->xp = ddp_arena_alloc(arena, bytes);
  p->off = ddp_arena_alloc(arena, (size_t)p->taps * sizeof(int64_t));
  if (!p->xp || !p->off)
    return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate a bfloat16 pair image of %zu bytes",
                     bytes);
  memset(p->xp, 0, bytes);
  for (int64_t q = 0; q < (c + 1) / 2; q++)
    for (int64_t a = 0; a < kh; a++)
      for (int64_t b = 0; b < kw; b++) p->off[(q * kh + a) * kw + b] = (q * p->hp + a) * p->wp + b;
  return DDP_OK;
}

static void pairs_copy(pairs *p, const float *x) {
  ddp__cpu_conv_bf16_pairs_avx512(p->xp, x, p->c, p->h, p->w, p->ph, p->pw, p->hp, p->wp);
}

/* w (m, cin, kk) packed for conv_rows_bf16, in scratch. */
static uint32_t *bf16_weights(const float *w, int64_t m, int64_t cin, int64_t kk,
                              ddp_arena *arena, ddp_status *status) {
  const size_t bytes = (size_t)ddp__cpu_conv_bf16_packed_words(m, cin, kk) * sizeof(uint32_t);
  uint32_t *packed = ddp_arena_alloc(arena, bytes);
  if (!packed) {
    *status = ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate %zu bytes of packed bfloat16 "
                        "weights", bytes);
    return NULL;
  }
  ddp__cpu_conv_bf16_pack(m, cin, kk, w, packed);
  return packed;
}

static ddp_status forward_vec(const vec_family *v, float *y, const float *x, const float *w, const float *b,
                                 const ddp__conv2d_geom *g, ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  ddp_status status = DDP_OK;
  if (is_pointwise(g)) {
    for (int64_t n = 0; n < g->n; n++) {
      v->gemm(g->o, ohw, k, w, k, x + n * chw, ohw, y + n * g->o * ohw, ohw, b, false);
      round_sample(y + n * g->o * ohw, g->o * ohw, g);
    }
    return DDP_OK;
  }
  if (use_winograd(v, g, g->o, g->c, g->oh, g->ow)) {
    float *u, *ws;
    DDP_TRY(winograd_init(&u, &ws, w, k, g->o, g->c, g->oh, g->ow, arena));
    padded p = {0};
    if (g->pad) DDP_TRY(padded_init(&p, g->c, g->h, g->w, g->pad, g->pad, 3, 3, arena));
    for (int64_t n = 0; n < g->n; n++) {
      const float *xn = x + n * chw;
      if (g->pad) pad_copy(&p, xn), xn = p.xp; /* without padding: the sample in place */
      v->winograd_conv3x3(g->o, g->c, u, xn, y + n * g->o * ohw, g->oh, g->ow, b,
                                       false, ws);
      round_sample(y + n * g->o * ohw, g->o * ohw, g);
    }
    return DDP_OK;
  }
  if (is_same(g) && g->o < SHIFTED_MAX_CHANNELS) {
    shifted sx;
    DDP_TRY(shifted_init(&sx, g->c, g->h, g->w, g->kw, g->pad, arena));
    for (int64_t n = 0; n < g->n; n++) {
      v->shifted_copy(&sx, x + n * chw);
      /* y_n (O, H*W) = b + w (O, K) @ rows of the copies (K, H*W) */
      v->gemm_off(g->o, ohw, k, w, k, sx.buf, sx.off, y + n * g->o * ohw, ohw, b,
                               false);
      round_sample(y + n * g->o * ohw, g->o * ohw, g);
    }
    return DDP_OK;
  }
  if (use_bf16_rows(v, g, g->c, g->ow)) {
    pairs p;
    DDP_TRY(pairs_init(&p, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
    const uint32_t *wpk = bf16_weights(w, g->o, g->c, g->kh * g->kw, arena, &status);
    if (!wpk) return status;
    for (int64_t n = 0; n < g->n; n++) {
      pairs_copy(&p, x + n * chw);
      /* y rounded as the tiles store it */
      ddp__cpu_conv_rows_bf16_avx512(g->o, p.taps, wpk, p.xp, p.off, p.wp, y + n * g->o * ohw,
                                     g->oh, g->ow, b, false, true);
    }
    return DDP_OK;
  }
  if (use_bf16_cols(v, g)) {
    padded p;
    DDP_TRY(padded_init(&p, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
    const int64_t kb = (g->kw + 1) / 2, taps = g->c * g->kh * kb, n_img = g->c * p.hp * p.wp;
    const size_t wbytes =
        (size_t)ddp__cpu_conv_bf16_packed_words(g->o, 2 * g->c, g->kh * kb) * sizeof(uint32_t);
    /* The column pairs, then (odd kernel widths) the single columns at
     * n16: colpairs and singles write whole vectors up to n_img rounded to
     * 16; the rows tiles (rows up to 16 wide) read 16 words from each row's
     * start, up to 15 - ow words past an image: 16 words of slack, zeroed. */
    const bool odd = g->kw % 2 != 0;
    const int64_t n16 = (n_img + 15) / 16 * 16, img_words = (odd ? 2 * n16 : n16) + 16;
    uint32_t *img = ddp_arena_alloc(arena, (size_t)img_words * sizeof(uint32_t));
    uint32_t *wpk = ddp_arena_alloc(arena, wbytes);
    int64_t *off = ddp_arena_alloc(arena, (size_t)taps * sizeof(int64_t));
    if (!img || !wpk || !off)
      return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate the bfloat16 column-pair image");
    memset(img + img_words - 16, 0, 16 * sizeof(uint32_t));
    ddp__cpu_conv_bf16_pack_cols(g->o, g->c, g->kh, g->kw, w, wpk);
    for (int64_t c = 0; c < g->c; c++)
      for (int64_t a = 0; a < g->kh; a++)
        for (int64_t j = 0; j < kb; j++)
          off[(c * g->kh + a) * kb + j] =
              (odd && j == kb - 1 ? n16 : 0) + (c * p.hp + a) * p.wp + 2 * j;
    for (int64_t n = 0; n < g->n; n++) {
      pad_copy(&p, x + n * chw);
      ddp__cpu_conv_bf16_colpairs_avx512(img, p.xp, n_img);
      if (odd) ddp__cpu_conv_bf16_singles_avx512(img + n16, p.xp, n_img);
      /* y rounded as the tiles store it */
      ddp__cpu_conv_rows_bf16_avx512(g->o, taps, wpk, img, off, p.wp, y + n * g->o * ohw, g->oh,
                                     g->ow, b, false, true);
    }
    return DDP_OK;
  }
  padded p = {0};
  if (g->stride == 1) DDP_TRY(padded_init(&p, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
  if (g->stride == 1 && g->ow <= 32) {
    float *wpk = scratch(arena, ddp__cpu_conv_rows_packed_floats(g->o, k), &status);
    if (!wpk) return status;
    ddp__cpu_conv_rows_pack(g->o, k, w, k, wpk);
    for (int64_t n = 0; n < g->n; n++) {
      pad_copy(&p, x + n * chw);
      /* y_n (O, OH, OW) = b + w (O, K) @ implicit col (K, OH*OW) */
      v->conv_rows(g->o, k, wpk, p.xp, p.off, p.wp, y + n * g->o * ohw, g->oh,
                                g->ow, b, false);
      round_sample(y + n * g->o * ohw, g->o * ohw, g);
    }
    return DDP_OK;
  }
  float *col = scratch(arena, k * ohw + SLACK, &status);
  if (!col) return status;
  for (int64_t n = 0; n < g->n; n++) {
    col_fill(col, &p, x + n * chw, g, v->im2col_padded);
    /* y_n (O, OH*OW) = b + w (O, K) @ col (K, OH*OW) */
    v->gemm(g->o, ohw, k, w, k, col, ohw, y + n * g->o * ohw, ohw, b, false);
    round_sample(y + n * g->o * ohw, g->o * ohw, g);
  }
  return DDP_OK;
}

static ddp_status backward_vec(const vec_family *v, float *dx, float *dw, float *db, const float *dy,
                                  const float *x, const float *w, const ddp__conv2d_geom *g,
                                  bool dx_accumulate, ddp_arena *arena) {
  const int64_t k = g->c * g->kh * g->kw, ohw = g->oh * g->ow, chw = g->c * g->h * g->w;
  const int64_t hw = g->h * g->w, kk = g->kh * g->kw;
  const bool pointwise = is_pointwise(g);
  ddp_status status = DDP_OK;

  /* dW: dot products (few output channels), implicit (stride 1), or col. */
  const bool dw_dot = g->o < 32;
  const bool dw_implicit = !dw_dot && g->stride == 1 && !pointwise;
  const bool dw_shifted = dw_dot && is_same(g) && !pointwise;
  const bool dw_winograd = use_winograd(v, g, g->o, g->c, g->oh, g->ow);
  /* dW by vdpbf16ps with the outputs in pairs along rows (even ow) */
  const bool dw_bf16 = dw && dw_implicit && !dw_winograd && g->ow % 2 == 0 && bf16_convs(v, g);
  uint32_t *xcp = NULL, *dyw = NULL, *dywt = NULL;
  padded xp = {0};
  shifted sx = {0};
  float *col = NULL, *dyt = NULL, *dwt = NULL;
  float *wino_du = NULL, *wino_dws = NULL; /* dW by Winograd: dU, scratch */
  if (dw && dw_winograd) {
    const int64_t du_floats = ddp__cpu_winograd_weights_floats(g->o, g->c);
    if (!(wino_du = scratch(arena, du_floats, &status))) return status;
    memset(wino_du, 0, (size_t)du_floats * sizeof(float));
    wino_dws = scratch(arena, ddp__cpu_winograd_scratch_floats(g->o, g->c, g->oh, g->ow), &status);
    if (!wino_dws) return status;
    if (g->pad) DDP_TRY(padded_init(&xp, g->c, g->h, g->w, g->pad, g->pad, 3, 3, arena));
  } else if (dw && dw_shifted) {
    DDP_TRY(shifted_init(&sx, g->c, g->h, g->w, g->kw, g->pad, arena));
  } else if (dw) {
    if (g->stride == 1 && !pointwise)
      DDP_TRY(padded_init(&xp, g->c, g->h, g->w, g->pad, g->pad, g->kh, g->kw, arena));
    if (!dw_implicit && !pointwise && !(col = scratch(arena, k * ohw + SLACK, &status)))
      return status;
    if (!dw_dot) {
      if (!dw_bf16 && !(dyt = scratch(arena, ohw * g->o, &status))) return status;
      if (!(dwt = scratch(arena, k * g->o, &status))) return status;
      memset(dwt, 0, (size_t)(k * g->o) * sizeof(float));
    }
    if (dw_bf16) {
      /* the padded image's column pairs; dy's pair words and their transpose */
      const int64_t words = (g->c * xp.hp * xp.wp + 15) / 16 * 16;
      xcp = ddp_arena_alloc(arena, (size_t)words * sizeof(uint32_t));
      dyw = ddp_arena_alloc(arena, (size_t)(g->o * ohw / 2) * sizeof(uint32_t));
      dywt = ddp_arena_alloc(arena, (size_t)(g->o * ohw / 2) * sizeof(uint32_t));
      if (!xcp || !dyw || !dywt)
        return ddp_error(DDP_ERR_NOMEM, "conv2d: cannot allocate the bfloat16 weight "
                         "gradient's operands (%lld words)", (long long)words);
    }
  }

  /* dX: a convolution of dy with the flipped weight (implicit when rows fit
   * two vectors, else through a column matrix), or gemm + col2im. */
  const bool dx_as_conv = dx_is_conv(g);
  const bool dx_shifted = is_same(g) && g->c < SHIFTED_MAX_CHANNELS;
  const bool dx_winograd = dx_as_conv && !dx_shifted && use_winograd(v, g, g->c, g->o, g->h, g->w);
  const bool dx_implicit = dx_as_conv && g->w <= 32;
  const bool dx_bf16 = dx && dx_implicit && !dx_shifted && !dx_winograd &&
                       use_bf16_rows(v, g, g->o, g->w);
  pairs dyq = {0};
  uint32_t *wflip_bf16 = NULL;
  padded dyp = {0};
  shifted sdy = {0};
  float *wflip = NULL, *wt = NULL, *dcol = NULL, *wino_u = NULL, *wino_s = NULL;
  if (dx && dx_winograd) {
    /* the same convolution of padded dy with the flipped weight (C, O, 3, 3) */
    DDP_TRY(dx_conv_init(&wflip, &dyp, w, g, arena));
    DDP_TRY(winograd_init(&wino_u, &wino_s, wflip, g->o * kk, g->c, g->o, g->h, g->w, arena));
  } else if (dx && dx_shifted) {
    /* dX of a same convolution is a same convolution of dy (padding
     * K-1-pad = pad) with the flipped weight (C, O*KH*KW). */
    DDP_TRY(dx_conv_init(&wflip, NULL, w, g, arena));
    DDP_TRY(shifted_init(&sdy, g->o, g->h, g->w, g->kw, g->pad, arena));
  } else if (dx_bf16) {
    /* dy's channel pairs padded by K-1-pad, the flipped weight packed */
    DDP_TRY(dx_conv_init(&wflip, NULL, w, g, arena));
    DDP_TRY(pairs_init(&dyq, g->o, g->oh, g->ow, g->kh - 1 - g->pad, g->kw - 1 - g->pad, g->kh,
                       g->kw, arena));
    if (!(wflip_bf16 = bf16_weights(wflip, g->c, g->o, kk, arena, &status))) return status;
  } else if (dx && dx_as_conv) {
    DDP_TRY(dx_conv_init(&wflip, &dyp, w, g, arena));
    if (dx_implicit) { /* conv_rows reads the flipped weight packed */
      const int64_t taps = g->o * kk;
      float *wpk = scratch(arena, ddp__cpu_conv_rows_packed_floats(g->c, taps), &status);
      if (!wpk) return status;
      ddp__cpu_conv_rows_pack(g->c, taps, wflip, taps, wpk);
      wflip = wpk;
    }
    if (!dx_implicit && !(dcol = scratch(arena, g->o * kk * hw + SLACK, &status))) return status;
  } else if (dx) {
    if (!(wt = scratch(arena, k * g->o, &status))) return status;
    if (!(dcol = scratch(arena, k * ohw, &status))) return status;
    v->transpose(wt, w, g->o, k);
  }
  float *dyr = NULL;
  if (g->round != DDP_FLOAT32 && !(dyr = scratch(arena, g->o * ohw, &status))) return status;

  for (int64_t n = 0; n < g->n; n++) {
    const float *xn = x + n * chw;
    const float *dyn = dy_sample(dy, dyr, n, g); /* (O, OH*OW) */
    if (db) bias_grad(db, dyn, g->o, ohw);
    if (dw && dw_winograd) {
      const float *xin = xn; /* without padding: the sample in place */
      if (g->pad) pad_copy(&xp, xn), xin = xp.xp;
      v->winograd_dw_sample(g->o, g->c, xin, dyn, g->oh, g->ow, wino_du, wino_dws);
    } else if (dw && dw_shifted) {
      v->shifted_copy(&sx, xn);
      /* dw (O, K) += dy (O, H*W) @ (rows of the copies (K, H*W))^T */
      v->gemm_nt_off(g->o, k, ohw, dyn, ohw, sx.buf, sx.off, dw, k);
    } else if (dw_bf16) {
      pad_copy(&xp, xn);
      ddp__cpu_conv_bf16_colpairs_avx512(xcp, xp.xp, g->c * xp.hp * xp.wp);
      ddp__cpu_conv_bf16_rowpairs_avx512(dyw, dyn, g->o * ohw);
      v->transpose((float *)dywt, (const float *)dyw, g->o, ohw / 2);
      /* dwt (K, O) += implicit col (K, OH*OW) @ dy^T (OH*OW, O), in pairs */
      ddp__cpu_conv_taps_bf16_avx512(k, g->o, xcp, xp.off, xp.wp, g->oh, g->ow, dywt, dwt);
    } else if (dw && dw_implicit) {
      pad_copy(&xp, xn);
      v->transpose(dyt, dyn, g->o, ohw);
      /* dwt (K, O) += implicit col (K, OH*OW) @ dy^T (OH*OW, O) */
      v->conv_taps(k, g->o, xp.xp, xp.off, xp.wp, g->oh, g->ow, dyt, dwt);
    } else if (dw) {
      if (col) col_fill(col, &xp, xn, g, v->im2col_padded);
      const float *cn = col ? col : xn; /* (K, OH*OW) */
      if (dw_dot) {
        /* dw (O, K) += dy (O, OH*OW) @ col^T */
        v->gemm_nt(g->o, k, ohw, dyn, ohw, cn, ohw, dw, k);
      } else {
        v->transpose(dyt, dyn, g->o, ohw);
        /* dwt (K, O) += col (K, OH*OW) @ dy^T (OH*OW, O) */
        v->gemm(k, g->o, ohw, cn, ohw, dyt, g->o, dwt, g->o, NULL, true);
      }
    }
    if (dx_bf16) {
      pairs_copy(&dyq, dyn);
      /* dx_n (C, H, W) (+)= wflip (C, O*KH*KW) @ implicit col of dy's pairs */
      ddp__cpu_conv_rows_bf16_avx512(g->c, dyq.taps, wflip_bf16, dyq.xp, dyq.off, dyq.wp,
                                     dx + n * chw, g->h, g->w, NULL, dx_accumulate, true);
    } else if (dx && dx_winograd) {
      pad_copy(&dyp, dyn);
      v->winograd_conv3x3(g->c, g->o, wino_u, dyp.xp, dx + n * chw, g->h, g->w,
                                       NULL, dx_accumulate, wino_s);
    } else if (dx && dx_shifted) {
      v->shifted_copy(&sdy, dyn);
      /* dx_n (C, H*W) (+)= wflip (C, O*KH*KW) @ rows of dy's copies */
      v->gemm_off(g->c, hw, g->o * kk, wflip, g->o * kk, sdy.buf, sdy.off,
                               dx + n * chw, hw, NULL, dx_accumulate);
    } else if (dx && dx_as_conv) {
      pad_copy(&dyp, dyn);
      if (dx_implicit) {
        /* dx_n (C, H, W) += wflip (C, O*KH*KW) @ implicit col of padded dy */
        v->conv_rows(g->c, g->o * kk, wflip, dyp.xp, dyp.off, dyp.wp, dx + n * chw,
                                  g->h, g->w, NULL, dx_accumulate);
      } else {
        v->im2col_padded(dcol, &dyp, g->kh, g->kw, g->h, g->w);
        v->gemm(g->c, hw, g->o * kk, wflip, g->o * kk, dcol, hw, dx + n * chw, hw,
                             NULL, dx_accumulate);
      }
    } else if (dx) {
      /* dcol (K, OH*OW) = w^T (K, O) @ dy (O, OH*OW), then scatter-add */
      v->gemm(k, ohw, g->o, wt, g->o, dyn, ohw, dcol, ohw, NULL, false);
      if (!dx_accumulate) memset(dx + n * chw, 0, (size_t)chw * sizeof(float));
      col2im_add(dx + n * chw, dcol, g);
    }
    if (dx && !dx_bf16) round_sample(dx + n * chw, chw, g); /* dx_bf16: rounded in the store */
  }
  if (dw && dw_winograd)
    ddp__cpu_winograd_dw_finish(g->o, g->c, wino_du, dw);
  else if (dw && !dw_dot)
    for (int64_t o = 0; o < g->o; o++)
      for (int64_t t = 0; t < k; t++) dw[o * k + t] += dwt[t * g->o + o];
  return DDP_OK;
}

ddp_status ddp__cpu_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                   const ddp__conv2d_geom *g, ddp_arena *arena) {
  switch (ddp__cpu_family_running()) {
  case DDP__CPU_AVX512: return forward_vec(&family_avx512, y, x, w, b, g, arena);
  case DDP__CPU_AVX2: return forward_vec(&family_avx2, y, x, w, b, g, arena);
  case DDP__CPU_GENERIC: break;
  }
  return forward_generic(y, x, w, b, g, arena);
}

ddp_status ddp__cpu_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                    const float *x, const float *w, const ddp__conv2d_geom *g,
                                    bool dx_accumulate, ddp_arena *arena) {
  switch (ddp__cpu_family_running()) {
  case DDP__CPU_AVX512:
    return backward_vec(&family_avx512, dx, dw, db, dy, x, w, g, dx_accumulate, arena);
  case DDP__CPU_AVX2:
    return backward_vec(&family_avx2, dx, dw, db, dy, x, w, g, dx_accumulate, arena);
  case DDP__CPU_GENERIC: break;
  }
  return backward_generic(dx, dw, db, dy, x, w, g, dx_accumulate, arena);
}
