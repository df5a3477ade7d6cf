/* AVX-512 kernels for the convolutions (cpu/conv.c): a small-matrix sgemm,
 * its dot-product form for thin weight gradients, and two implicit-im2col
 * variants that read a padded image through tap offsets.
 *
 * Why not OpenBLAS here: the convolutions' gemms are small (conv2 of the
 * ConvNet: 32 x 196 x 400 per sample) and OpenBLAS's generic x86-64 builds
 * pick their AVX2 kernels even on AVX-512 machines (0.3.21 reports "Haswell"
 * on Zen 5), capping them at about half of this core's peak. This kernel
 * needs no packing: A is read in place (row stride lda; each of its MR rows
 * is a stream the L1 cache serves), B rows are contiguous along n, and a tile
 * of MR x (16 * NV) outputs lives in registers for the whole k loop. The
 * last vector of a row uses masked loads and stores, so any n works (masked
 * stores are slow on AMD, ~10 cycles, so only a true tail uses one).
 *
 * Compiled for AVX-512 through target attributes and used only when the CPU
 * has it and DDP_CPU_KERNELS allows it (ddp__cpu_has_avx512, cpu/family.c);
 * the build itself stays portable. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define MR 8 /* rows of C per tile */

#define AVX512 __attribute__((target("avx512f,fma")))

/* One tile: rows [0, mr) of C, columns [0, 16*nv) with the last vector
 * masked by `tail`. mr and nv are compile-time constants at every call site,
 * so the accumulators stay in registers. */
AVX512 static inline __attribute__((always_inline)) void
tile(const int mr, const int nv, __mmask16 tail, int64_t k, const float *a, int64_t lda,
     const float *b, int64_t ldb, const int64_t *boff, float *c, int64_t ldc,
     const float *row_bias, bool accumulate) {
  __m512 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      __mmask16 m = v == nv - 1 ? tail : (__mmask16)0xffff;
      if (accumulate)
        acc[r][v] = _mm512_maskz_loadu_ps(m, c + r * ldc + 16 * v);
      else if (row_bias)
        acc[r][v] = _mm512_set1_ps(row_bias[r]);
      else
        acc[r][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; kk++) {
    const float *bk = boff ? b + boff[kk] : b + kk * ldb;
    __m512 bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      bv[v] = v == nv - 1 ? _mm512_maskz_loadu_ps(tail, bk + 16 * v) : _mm512_loadu_ps(bk + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      __m512 ar = _mm512_set1_ps(a[r * lda + kk]);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      /* Masked stores are slow on AMD (about 10 cycles on Zen 5): only the
       * true tail pays for one. */
      if (v == nv - 1 && tail != 0xffff)
        _mm512_mask_storeu_ps(c + r * ldc + 16 * v, tail, acc[r][v]);
      else
        _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
    }
  }
}

/* All rows of one column strip of width 16*nv (last vector masked). */
AVX512 static inline __attribute__((always_inline)) void
strip(const int nv, __mmask16 tail, int64_t m, int64_t k, const float *a, int64_t lda,
      const float *b, int64_t ldb, const int64_t *boff, float *c, int64_t ldc,
      const float *row_bias, bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    tile(MR, nv, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
  if (m - i >= 4) {
    tile(4, nv, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
    i += 4;
  }
  if (m - i >= 2) {
    tile(2, nv, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
    i += 2;
  }
  if (m - i >= 1)
    tile(1, nv, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
}

/* Strips of 48 columns, then the rest as one strip of 1-3 vectors. */
AVX512 static inline __attribute__((always_inline)) void
gemm_strips(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
            int64_t ldb, const int64_t *boff, float *c, int64_t ldc, const float *row_bias,
            bool accumulate) {
  int64_t j = 0;
  for (; j + 48 <= n; j += 48)
    strip(3, 0xffff, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias, accumulate);
  int64_t rest = n - j;
  if (rest == 0) return;
  const int lanes = (int)((rest - 1) % 16 + 1); /* in the last vector: 1..16 */
  __mmask16 tail = (__mmask16)((1u << lanes) - 1);
  if (rest > 32)
    strip(3, tail, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias, accumulate);
  else if (rest > 16)
    strip(2, tail, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias, accumulate);
  else
    strip(1, tail, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias, accumulate);
}

AVX512 void ddp__cpu_gemm_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                                 const float *b, int64_t ldb, float *c, int64_t ldc,
                                 const float *row_bias, bool accumulate) {
  gemm_strips(m, n, k, a, lda, b, ldb, NULL, c, ldc, row_bias, accumulate);
}

/* The same with row kk of b at b + boff[kk]: the shifted-copy convolution
 * (cpu/conv.c), whose "column matrix" rows are slices of a few shifted
 * copies of the image. */
AVX512 void ddp__cpu_gemm_off_avx512(int64_t m, int64_t n, int64_t k, const float *a,
                                     int64_t lda, const float *b, const int64_t *boff, float *c,
                                     int64_t ldc, const float *row_bias, bool accumulate) {
  gemm_strips(m, n, k, a, lda, b, 0, boff, c, ldc, row_bias, accumulate);
}

/* ---- c (m, n) += a (m, k) @ b (n, k)^T: both operands run along k -------
 * For weight gradients with few output channels (conv1: dW (16, 25) from
 * dy (16, 784) and col (25, 784)), where the form above would need a
 * transposed copy of dy and a 16-wide n. Each of the MD x ND outputs of a
 * tile is a 16-lane vector of partial sums over k, reduced once at the end. */
#define MD 4
#define ND 6

AVX512 static inline __attribute__((always_inline)) void
tile_nt(const int md, const int nd, int64_t k, __mmask16 tail, const float *a, int64_t lda,
        const float *b, int64_t ldb, const int64_t *boff, float *c, int64_t ldc) {
  const float *brow[ND];
#pragma GCC unroll 6
  for (int j = 0; j < nd; j++) brow[j] = boff ? b + boff[j] : b + j * ldb;
  __m512 acc[MD][ND];
#pragma GCC unroll 4
  for (int i = 0; i < md; i++)
#pragma GCC unroll 6
    for (int j = 0; j < nd; j++) acc[i][j] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 av[MD];
#pragma GCC unroll 4
    for (int i = 0; i < md; i++) av[i] = _mm512_loadu_ps(a + i * lda + kk);
#pragma GCC unroll 6
    for (int j = 0; j < nd; j++) {
      __m512 bv = _mm512_loadu_ps(brow[j] + kk);
      /* In a register: GCC would otherwise fold the load into each of the
       * md FMAs, md loads where one does (the loads then bound the tile). */
      __asm__("" : "+v"(bv));
#pragma GCC unroll 4
      for (int i = 0; i < md; i++) acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  if (kk < k) {
    __m512 av[MD];
#pragma GCC unroll 4
    for (int i = 0; i < md; i++) av[i] = _mm512_maskz_loadu_ps(tail, a + i * lda + kk);
#pragma GCC unroll 6
    for (int j = 0; j < nd; j++) {
      __m512 bv = _mm512_maskz_loadu_ps(tail, brow[j] + kk);
#pragma GCC unroll 4
      for (int i = 0; i < md; i++) acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < md; i++)
#pragma GCC unroll 6
    for (int j = 0; j < nd; j++) c[i * ldc + j] += _mm512_reduce_add_ps(acc[i][j]);
}

/* Rows of c in tiles of MD, then 2 and 1; columns in tiles of ND, then 1. */
AVX512 static inline __attribute__((always_inline)) void
gemm_nt_tiles(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
              int64_t ldb, const int64_t *boff, float *c, int64_t ldc) {
  const __mmask16 tail = (__mmask16)((1u << (k % 16)) - 1);
  int64_t i = 0;
#define NT_ROWS(md)                                                                        \
  do {                                                                                     \
    int64_t j = 0;                                                                         \
    for (; j + ND <= n; j += ND)                                                           \
      tile_nt(md, ND, k, tail, a + i * lda, lda, boff ? b : b + j * ldb, ldb,               \
              boff ? boff + j : NULL, c + i * ldc + j, ldc);                               \
    for (; j < n; j++)                                                                     \
      tile_nt(md, 1, k, tail, a + i * lda, lda, boff ? b : b + j * ldb, ldb,                \
              boff ? boff + j : NULL, c + i * ldc + j, ldc);                               \
  } while (0)
  for (; i + MD <= m; i += MD) NT_ROWS(MD);
  /* Two rows share each load of b (one row alone is bound by its loads). */
  for (; i + 2 <= m; i += 2) NT_ROWS(2);
  for (; i < m; i++) NT_ROWS(1);
#undef NT_ROWS
}

AVX512 void ddp__cpu_gemm_nt_avx512(int64_t m, int64_t n, int64_t k, const float *a,
                                    int64_t lda, const float *b, int64_t ldb, float *c,
                                    int64_t ldc) {
  gemm_nt_tiles(m, n, k, a, lda, b, ldb, NULL, c, ldc);
}

/* The same with row j of b (n, k) at b + boff[j]. */
AVX512 void ddp__cpu_gemm_nt_off_avx512(int64_t m, int64_t n, int64_t k, const float *a,
                                        int64_t lda, const float *b, const int64_t *boff,
                                        float *c, int64_t ldc) {
  gemm_nt_tiles(m, n, k, a, lda, b, 0, boff, c, ldc);
}

/* ---- implicit-im2col gemms for stride-1 convolutions --------------------
 * Both read a zero-padded image xp (C, HP, WP) in place through per-tap
 * offsets off[t] = (c*HP + a)*WP + b, t = (c, a, b), instead of a column
 * matrix: im2col's ~80,000 stores per sample of conv2 cost a quarter of the
 * gemm's time. */

/* conv_rows reads its weights packed MR channels a tap: the MR broadcasts of
 * a tap then come from one line through one base register. Read in place
 * (row stride ldw), the eight rows' pointers did not fit the registers beside
 * the loads' offsets: the loop reloaded them from the stack every tap. */
int64_t ddp__cpu_conv_rows_packed_floats(int64_t m, int64_t taps) {
  return (m + MR - 1) / MR * MR * taps;
}

void ddp__cpu_conv_rows_pack(int64_t m, int64_t taps, const float *w, int64_t ldw, float *packed) {
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    float *blk = packed + i0 * taps;
    for (int64_t t = 0; t < taps; t++)
      for (int64_t r = 0; r < MR; r++) blk[t * MR + r] = i0 + r < m ? w[(i0 + r) * ldw + t] : 0.0f;
  }
}

/* Rows up to one vector wide (ow <= 16): y (m, oh, ow) = bias + w @ B,
 * B[t][(y, x)] = xp[off[t] + y*WP + x]. A row is one vector (lanes past ow
 * computed and dropped); a tile is MR channels x nv rows (nv <= 3). Lanes
 * past a row's end are stored onto the channel's next rows: garbage that
 * those rows overwrite later, or (accumulating) the values already there.
 * Only vectors whose spill would leave the channel pay for masked stores.
 * wb: the packed block of the tile's channels, read at wb[t*MR + r]. */
AVX512 static inline __attribute__((always_inline)) void tile_rows(
    const int mr, const int nv, int64_t taps, const float *wb, const float *xp, const int64_t *off,
    int64_t wp, float *y, int64_t oh, int64_t ow, int64_t oy, const float *bias, bool accumulate) {
  __m512 acc[MR][3];
  int64_t at[3]; /* vector v covers row oy + v */
  __mmask16 lanes = (__mmask16)((1u << ow) - 1);
  bool fits[3]; /* its 16 lanes stay inside the channel: read and write whole */
#pragma GCC unroll 3
  for (int v = 0; v < nv; v++) {
    at[v] = (oy + v) * ow;
    fits[v] = at[v] + 16 <= oh * ow;
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      const float *src = y + r * oh * ow + at[v];
      acc[r][v] = !accumulate ? (bias ? _mm512_set1_ps(bias[r]) : _mm512_setzero_ps())
                  : fits[v]   ? _mm512_loadu_ps(src)
                              : _mm512_maskz_loadu_ps(lanes, src);
    }
  const float *xrow = xp + oy * wp;
  for (int64_t t = 0; t < taps; t++) {
    const float *src = xrow + off[t];
    __m512 bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) bv[v] = _mm512_loadu_ps(src + v * wp);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      __m512 ar = _mm512_set1_ps(wb[t * MR + r]);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      float *dst = y + r * oh * ow + at[v];
      if (!fits[v])
        _mm512_mask_storeu_ps(dst, lanes, acc[r][v]);
      else if (accumulate) /* the spare lanes write back what is there */
        _mm512_storeu_ps(dst, _mm512_mask_mov_ps(_mm512_loadu_ps(dst), lanes, acc[r][v]));
      else /* the spare lanes' garbage is overwritten by the later rows */
        _mm512_storeu_ps(dst, acc[r][v]);
    }
}

/* Rows wider than one vector (ow > 16): the channel's outputs taken flat,
 * 48 at a time (3 vectors x MR channels). A vector of 16 consecutive outputs
 * spans at most two rows; the lanes on the second row come from that row's
 * start through a second load that merges under a mask. Rows in whole
 * vectors wasted the lanes past ow: a row of 24 (psnet's conv2) used 3/4 of
 * its FMAs, 26 (its dX) 13/16. Lane i of a vector starting at flat output p
 * = (oy, ox) reads xp[off[t] + oy*WP + ox + i] while ox + i < ow, else
 * xp[off[t] + (oy+1)*WP + (ox + i - ow)]. */
typedef struct {
  int64_t at[3];         /* the vector's first flat output */
  int64_t first[3];      /* xp offset of lane 0 on the first row */
  int64_t second[3];     /* xp offset that lane i reads as base + i on the second row */
  __mmask16 on_first[3]; /* lanes on the first row */
  __mmask16 on_second[3];
  __mmask16 valid[3]; /* lanes inside the channel */
} flat_tile;

static void flat_tile_at(flat_tile *ft, int64_t p, int64_t plane, int64_t ow, int64_t wp) {
  for (int v = 0; v < 3; v++) {
    const int64_t q = p + 16 * v, oy = q / ow, ox = q % ow;
    const int64_t inside = plane - q <= 0 ? 0 : plane - q < 16 ? plane - q : 16;
    const int64_t a = ow - ox < 16 ? ow - ox : 16; /* lanes on the first row */
    const uint32_t valid = (uint32_t)((1u << inside) - 1), first = (uint32_t)((1u << a) - 1);
    ft->at[v] = q;
    ft->first[v] = oy * wp + ox;
    ft->second[v] = (oy + 1) * wp - a;
    ft->valid[v] = (__mmask16)valid;
    ft->on_first[v] = (__mmask16)(valid & first);
    ft->on_second[v] = (__mmask16)(valid & ~first);
  }
}

AVX512 static inline __attribute__((always_inline)) void tile_flat(
    const int mr, const int nv, const flat_tile *ft, int64_t taps, const float *wb, const float *xp,
    const int64_t *off, float *y, int64_t plane, const float *bias, bool accumulate) {
  __m512 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(ft->valid[v], y + r * plane + ft->at[v])
                  : bias     ? _mm512_set1_ps(bias[r])
                             : _mm512_setzero_ps();
  for (int64_t t = 0; t < taps; t++) {
    const float *src = xp + off[t];
    __m512 bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      bv[v] = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(ft->on_first[v], src + ft->first[v]),
                                   ft->on_second[v], src + ft->second[v]);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      __m512 ar = _mm512_set1_ps(wb[t * MR + r]);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      float *dst = y + r * plane + ft->at[v];
      if (ft->valid[v] == 0xffff)
        _mm512_storeu_ps(dst, acc[r][v]);
      else
        _mm512_mask_storeu_ps(dst, ft->valid[v], acc[r][v]);
    }
}

/* MR channels (or the last mr < MR, one at a time) of one packed block at
 * one flat tile. */
AVX512 static inline __attribute__((always_inline)) void flat_channels(
    const int nv, int64_t mr, const flat_tile *ft, const float *wb, int64_t taps, const float *xp,
    const int64_t *off, float *y, int64_t plane, const float *bias, bool accumulate) {
  if (mr == MR) {
    tile_flat(MR, nv, ft, taps, wb, xp, off, y, plane, bias, accumulate);
    return;
  }
  for (int64_t r = 0; r < mr; r++) /* wb + r: channel r's weight at [t*MR] */
    tile_flat(1, nv, ft, taps, wb + r, xp, off, y + r * plane, plane, bias ? bias + r : NULL,
              accumulate);
}

/* A flat tile for every block of channels before the next tile: the tile's
 * window of xp stays in L1 while the weights stream from L2. */
AVX512 static inline __attribute__((always_inline)) void flat_all(
    int64_t m, int64_t taps, const float *packed, const float *xp, const int64_t *off, int64_t wp,
    float *y, int64_t oh, int64_t ow, const float *bias, bool accumulate) {
  const int64_t plane = oh * ow;
  flat_tile ft;
  for (int64_t p = 0; p < plane; p += 48) {
    flat_tile_at(&ft, p, plane, ow, wp);
    const int64_t rest = plane - p;
    for (int64_t i = 0; i < m; i += MR) {
      const int64_t mr = m - i < MR ? m - i : MR;
      const float *wb = packed + i * taps, *bi = bias ? bias + i : NULL;
      float *yi = y + i * plane;
      if (rest > 32)
        flat_channels(3, mr, &ft, wb, taps, xp, off, yi, plane, bi, accumulate);
      else if (rest > 16)
        flat_channels(2, mr, &ft, wb, taps, xp, off, yi, plane, bi, accumulate);
      else
        flat_channels(1, mr, &ft, wb, taps, xp, off, yi, plane, bi, accumulate);
    }
  }
}

AVX512 static inline __attribute__((always_inline)) void row_channels(
    int64_t mr, const float *wb, int64_t taps, const float *xp, const int64_t *off, int64_t wp,
    float *y, int64_t oh, int64_t ow, const float *bias, bool accumulate) {
  for (int64_t oy = 0; oy < oh; oy += 3) {
    const int nv = oh - oy >= 3 ? 3 : (int)(oh - oy);
    if (mr == MR) {
      if (nv == 3)
        tile_rows(MR, 3, taps, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate);
      else if (nv == 2)
        tile_rows(MR, 2, taps, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate);
      else
        tile_rows(MR, 1, taps, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate);
      continue;
    }
    for (int64_t r = 0; r < mr; r++) {
      float *yr = y + r * oh * ow;
      const float *br = bias ? bias + r : NULL;
      if (nv == 3)
        tile_rows(1, 3, taps, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate);
      else if (nv == 2)
        tile_rows(1, 2, taps, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate);
      else
        tile_rows(1, 1, taps, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate);
    }
  }
}

AVX512 void ddp__cpu_conv_rows_avx512(int64_t m, int64_t taps, const float *packed, const float *xp,
                                      const int64_t *off, int64_t wp, float *y, int64_t oh,
                                      int64_t ow, const float *bias, bool accumulate) {
  if (ow > 16) {
    flat_all(m, taps, packed, xp, off, wp, y, oh, ow, bias, accumulate);
    return;
  }
  for (int64_t i = 0; i < m; i += MR) {
    const int64_t mr = m - i < MR ? m - i : MR;
    row_channels(mr, packed + i * taps, taps, xp, off, wp, y + i * oh * ow, oh, ow,
                 bias ? bias + i : NULL, accumulate);
  }
}

/* dwt (taps, n) += A @ dyt, A[t][(y, x)] = xp[off[t] + y*WP + x] for (y, x)
 * in (oh, ow), dyt ((oh*ow), n) with row stride n: the weight gradient
 * (transposed) without a column matrix. Tiles of 12 taps x 16*nv. */
#define MRA 12
AVX512 static inline __attribute__((always_inline)) void
tile_taps(const int mr, const int nv, __mmask16 tail, const float *xp, const int64_t *off,
          int64_t wp, int64_t oh, int64_t ow, const float *dyt, int64_t n, float *c) {
  __m512 acc[MRA][2];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++)
      acc[r][v] = _mm512_maskz_loadu_ps(v == nv - 1 ? tail : 0xffff, c + r * n + 16 * v);
  const float *bk = dyt;
  for (int64_t y = 0; y < oh; y++)
    for (int64_t x = 0; x < ow; x++, bk += n) {
      const int64_t at = y * wp + x;
      __m512 bv[2];
#pragma GCC unroll 2
      for (int v = 0; v < nv; v++)
        bv[v] = v == nv - 1 ? _mm512_maskz_loadu_ps(tail, bk + 16 * v) : _mm512_loadu_ps(bk + 16 * v);
#pragma GCC unroll 12
      for (int r = 0; r < mr; r++) {
        __m512 ar = _mm512_set1_ps(xp[off[r] + at]);
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
      }
    }
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) {
      if (v == nv - 1 && tail != 0xffff)
        _mm512_mask_storeu_ps(c + r * n + 16 * v, tail, acc[r][v]);
      else
        _mm512_storeu_ps(c + r * n + 16 * v, acc[r][v]);
    }
}

AVX512 static inline __attribute__((always_inline)) void
taps_strip(const int nv, __mmask16 tail, int64_t taps, const float *xp, const int64_t *off,
           int64_t wp, int64_t oh, int64_t ow, const float *dyt, int64_t n, float *c) {
  int64_t t = 0;
  for (; t + MRA <= taps; t += MRA)
    tile_taps(MRA, nv, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
  for (; t + 4 <= taps; t += 4)
    tile_taps(4, nv, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
  for (; t < taps; t++) tile_taps(1, nv, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
}

AVX512 void ddp__cpu_conv_taps_avx512(int64_t taps, int64_t n, const float *xp,
                                      const int64_t *off, int64_t wp, int64_t oh, int64_t ow,
                                      const float *dyt, float *dwt) {
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t rest = n - j < 32 ? n - j : 32;
    const int lanes = (int)((rest - 1) % 16 + 1);
    const __mmask16 tail = (__mmask16)((1u << lanes) - 1);
    if (rest > 16)
      taps_strip(2, tail, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
    else
      taps_strip(1, tail, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
  }
}
