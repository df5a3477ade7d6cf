/* AVX2 + FMA kernels for the convolutions (cpu/conv.c): the same four
 * gemms and two implicit-im2col kernels as cpu/gemm.c's AVX-512 ones, for
 * CPUs without AVX-512 (AMD Zen 2 and 3, many Intel parts). Same schemes,
 * same sums in the same order per output; what differs is the vector (8
 * floats in a __m256) and the register file (16 ymm registers instead of 32
 * zmm), so the tiles are smaller: 4 rows x 3 vectors of C (12 accumulators,
 * 3 loads of B and a broadcast of A beside them) where AVX-512 holds 8 x 3.
 * AVX2 has no mask registers: tails load and store under an integer lane
 * mask (vmaskmovps), which reads and writes nothing in the lanes it leaves
 * out; masked stores are slow on AMD (microcoded), so only true tails use
 * them.
 *
 * Compiled for AVX2 and FMA through target attributes and used only when
 * the AVX2 family runs (ddp__cpu_has_avx2, cpu/family.c); the build stays
 * portable. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define MR 4    /* rows of C per tile */
#define PACK 8  /* channels a tap in conv_rows_pack's layout (cpu/gemm.c's MR) */

/* Lanes [0, n) on, n in 0..8. */
AVX2 INLINE __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

AVX2 INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* One tile: rows [0, mr) of C, columns [0, 8*nv); when !full the last
 * vector is masked by `tail`. mr, nv and full are compile-time constants at
 * every call site, so the accumulators stay in registers. */
AVX2 INLINE void tile(const int mr, const int nv, const bool full, __m256i tail, int64_t k,
                      const float *a, int64_t lda, const float *b, int64_t ldb,
                      const int64_t *boff, float *c, int64_t ldc, const float *row_bias,
                      bool accumulate) {
  __m256 acc[MR][3];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      const bool masked = !full && v == nv - 1;
      if (accumulate)
        acc[r][v] = masked ? _mm256_maskload_ps(c + r * ldc + 8 * v, tail)
                           : _mm256_loadu_ps(c + r * ldc + 8 * v);
      else if (row_bias)
        acc[r][v] = _mm256_set1_ps(row_bias[r]);
      else
        acc[r][v] = _mm256_setzero_ps();
    }
  for (int64_t kk = 0; kk < k; kk++) {
    const float *bk = boff ? b + boff[kk] : b + kk * ldb;
    __m256 bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      bv[v] = !full && v == nv - 1 ? _mm256_maskload_ps(bk + 8 * v, tail)
                                   : _mm256_loadu_ps(bk + 8 * v);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      const __m256 ar = _mm256_broadcast_ss(a + r * lda + kk);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      if (!full && v == nv - 1)
        _mm256_maskstore_ps(c + r * ldc + 8 * v, tail, acc[r][v]);
      else
        _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
    }
}

/* All rows of one column strip of width 8*nv. */
AVX2 INLINE void strip(const int nv, const bool full, __m256i tail, int64_t m, int64_t k,
                       const float *a, int64_t lda, const float *b, int64_t ldb,
                       const int64_t *boff, float *c, int64_t ldc, const float *row_bias,
                       bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    tile(MR, nv, full, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
  if (m - i >= 2) {
    tile(2, nv, full, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
    i += 2;
  }
  if (m - i >= 1)
    tile(1, nv, full, tail, k, a + i * lda, lda, b, ldb, boff, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
}

/* Strips of 24 columns, then the rest as one strip of 1-3 vectors. */
AVX2 INLINE void gemm_strips(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                             const float *b, int64_t ldb, const int64_t *boff, float *c,
                             int64_t ldc, const float *row_bias, bool accumulate) {
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t j = 0;
  for (; j + 24 <= n; j += 24)
    strip(3, true, all, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias, accumulate);
  const int64_t rest = n - j;
  if (rest == 0) return;
  const int64_t lanes = (rest - 1) % 8 + 1; /* in the last vector: 1..8 */
  const __m256i tail = first_lanes(lanes);
  const int nv = rest > 16 ? 3 : rest > 8 ? 2 : 1;
#define REST(NV)                                                                               \
  (lanes == 8 ? strip(NV, true, all, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias,      \
                      accumulate)                                                              \
              : strip(NV, false, tail, m, k, a, lda, b + j, ldb, boff, c + j, ldc, row_bias,    \
                      accumulate))
  if (nv == 3)
    REST(3);
  else if (nv == 2)
    REST(2);
  else
    REST(1);
#undef REST
}

AVX2 void ddp__cpu_gemm_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                             const float *b, int64_t ldb, float *c, int64_t ldc,
                             const float *row_bias, bool accumulate) {
  gemm_strips(m, n, k, a, lda, b, ldb, NULL, c, ldc, row_bias, accumulate);
}

AVX2 void ddp__cpu_gemm_off_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                                 const float *b, const int64_t *boff, float *c, int64_t ldc,
                                 const float *row_bias, bool accumulate) {
  gemm_strips(m, n, k, a, lda, b, 0, boff, c, ldc, row_bias, accumulate);
}

/* ---- c (m, n) += a (m, k) @ b (n, k)^T: dot products along k ------------
 * Tiles of MD x ND outputs, each an 8-lane vector of partial sums reduced
 * at the end: 12 accumulators, MD loads of a and one of b beside them. */
#define MD 3
#define ND 4

AVX2 INLINE void tile_nt(const int md, const int nd, int64_t k, __m256i tail, const float *a,
                         int64_t lda, const float *b, int64_t ldb, const int64_t *boff, float *c,
                         int64_t ldc) {
  const float *brow[ND];
#pragma GCC unroll 4
  for (int j = 0; j < nd; j++) brow[j] = boff ? b + boff[j] : b + j * ldb;
  __m256 acc[MD][ND];
#pragma GCC unroll 3
  for (int i = 0; i < md; i++)
#pragma GCC unroll 4
    for (int j = 0; j < nd; j++) acc[i][j] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 av[MD];
#pragma GCC unroll 3
    for (int i = 0; i < md; i++) av[i] = _mm256_loadu_ps(a + i * lda + kk);
#pragma GCC unroll 4
    for (int j = 0; j < nd; j++) {
      __m256 bv = _mm256_loadu_ps(brow[j] + kk);
      /* In a register: one load shared by the md FMAs (as in cpu/gemm.c). */
      __asm__("" : "+x"(bv));
#pragma GCC unroll 3
      for (int i = 0; i < md; i++) acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  if (kk < k) {
    __m256 av[MD];
#pragma GCC unroll 3
    for (int i = 0; i < md; i++) av[i] = _mm256_maskload_ps(a + i * lda + kk, tail);
#pragma GCC unroll 4
    for (int j = 0; j < nd; j++) {
      const __m256 bv = _mm256_maskload_ps(brow[j] + kk, tail);
#pragma GCC unroll 3
      for (int i = 0; i < md; i++) acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
#pragma GCC unroll 3
  for (int i = 0; i < md; i++)
#pragma GCC unroll 4
    for (int j = 0; j < nd; j++) c[i * ldc + j] += hsum(acc[i][j]);
}

AVX2 INLINE void gemm_nt_tiles(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                               const float *b, int64_t ldb, const int64_t *boff, float *c,
                               int64_t ldc) {
  const __m256i tail = first_lanes(k % 8);
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
  for (; i + 2 <= m; i += 2) NT_ROWS(2);
  for (; i < m; i++) NT_ROWS(1);
#undef NT_ROWS
}

AVX2 void ddp__cpu_gemm_nt_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                                const float *b, int64_t ldb, float *c, int64_t ldc) {
  gemm_nt_tiles(m, n, k, a, lda, b, ldb, NULL, c, ldc);
}

AVX2 void ddp__cpu_gemm_nt_off_avx2(int64_t m, int64_t n, int64_t k, const float *a,
                                    int64_t lda, const float *b, const int64_t *boff, float *c,
                                    int64_t ldc) {
  gemm_nt_tiles(m, n, k, a, lda, b, 0, boff, c, ldc);
}

/* ---- implicit-im2col gemms for stride-1 convolutions --------------------
 * As in cpu/gemm.c: a zero-padded image xp (C, HP, WP) read through per-tap
 * offsets, weights packed PACK channels a tap (ddp__cpu_conv_rows_pack);
 * a tile takes MR of a block's PACK channels (wb[t*PACK + r]). */


/* Each output row as ceil(ow / 8) vectors, the last one's lanes past ow
 * computed and dropped: rows of 28 (the ConvNet's conv1) and 14 (conv2,
 * its dX) use 7/8 of the lanes. A vector of outputs that spans two rows,
 * as cpu/gemm.c's flat AVX-512 tiles take them, needs two masked loads and
 * their merge per tap, and the masks in registers: with 12 accumulators
 * that spilled the accumulators to the stack. Here every load is whole and
 * plain (xp's rows go on past ow into the padding, and its slack covers the
 * last). A tile is MR channels x 3 consecutive vectors of the channel, in
 * (row, vector) order. A row's last vector stores its spare lanes onto the
 * next row's start, which a later vector (or the same tile's next) writes
 * again; accumulating, they write back what is there. Only a vector whose
 * spare lanes would leave the channel stores under a mask. */
typedef struct {
  int64_t in[3];  /* xp offset of lane 0, before the tap's offset */
  int64_t out[3]; /* the vector's first output within the channel */
  bool full[3];  /* all 8 lanes are outputs of the row */
  bool fits[3];  /* all 8 lanes stay inside the channel */
} row_vectors;

static void row_vectors_at(row_vectors *rv, int64_t v0, int64_t nv, int64_t per_row,
                           int64_t ow, int64_t wp, int64_t plane) {
  for (int64_t v = 0; v < nv; v++) {
    const int64_t y = (v0 + v) / per_row, x = 8 * ((v0 + v) % per_row);
    const int64_t n = ow - x < 8 ? ow - x : 8;
    rv->in[v] = y * wp + x;
    rv->out[v] = y * ow + x;
    rv->full[v] = n == 8;
    rv->fits[v] = rv->out[v] + 8 <= plane;
  }
}

AVX2 INLINE void tile_rows(const int mr, const int nv, const row_vectors *rv, __m256i lanes,
                           int64_t taps, const float *wb, const float *xp, const int64_t *off,
                           float *y, int64_t plane, const float *bias, bool accumulate) {
  __m256 acc[MR][3];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      const float *src = y + r * plane + rv->out[v];
      acc[r][v] = !accumulate ? (bias ? _mm256_set1_ps(bias[r]) : _mm256_setzero_ps())
                  : rv->fits[v] ? _mm256_loadu_ps(src)
                                : _mm256_maskload_ps(src, lanes);
    }
  const int64_t in0 = rv->in[0], in1 = rv->in[nv > 1 ? 1 : 0], in2 = rv->in[nv > 2 ? 2 : 0];
  for (int64_t t = 0; t < taps; t++) {
    const float *src = xp + off[t];
    __m256 bv[3];
    bv[0] = _mm256_loadu_ps(src + in0);
    if (nv > 1) bv[1] = _mm256_loadu_ps(src + in1);
    if (nv > 2) bv[2] = _mm256_loadu_ps(src + in2);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      const __m256 ar = _mm256_broadcast_ss(wb + t * PACK + r);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      float *dst = y + r * plane + rv->out[v];
      if (!rv->fits[v])
        _mm256_maskstore_ps(dst, lanes, acc[r][v]);
      else if (accumulate && !rv->full[v]) /* the spare lanes write back what is there */
        _mm256_storeu_ps(dst, _mm256_blendv_ps(_mm256_loadu_ps(dst), acc[r][v],
                                               _mm256_castsi256_ps(lanes)));
      else
        _mm256_storeu_ps(dst, acc[r][v]);
    }
}

/* The channels [0, mr) of one packed block (mr <= PACK) at one group of
 * vectors: MR at a time, then one at a time. */
AVX2 INLINE void row_channels(const int nv, int64_t mr, const row_vectors *rv, __m256i lanes,
                              const float *wb, int64_t taps, const float *xp, const int64_t *off,
                              float *y, int64_t plane, const float *bias, bool accumulate) {
  int64_t r = 0;
  for (; r + MR <= mr; r += MR)
    tile_rows(MR, nv, rv, lanes, taps, wb + r, xp, off, y + r * plane, plane,
              bias ? bias + r : NULL, accumulate);
  for (; r < mr; r++)
    tile_rows(1, nv, rv, lanes, taps, wb + r, xp, off, y + r * plane, plane,
              bias ? bias + r : NULL, accumulate);
}

/* A group of 3 vectors for every block of channels before the next group:
 * the group's window of xp stays in L1 while the weights stream from L2. */
AVX2 void ddp__cpu_conv_rows_avx2(int64_t m, int64_t taps, const float *packed, const float *xp,
                                  const int64_t *off, int64_t wp, float *y, int64_t oh,
                                  int64_t ow, const float *bias, bool accumulate) {
  const int64_t per_row = (ow + 7) / 8, vectors = oh * per_row, plane = oh * ow;
  /* the lanes of a row's last vector that are outputs */
  const __m256i lanes = first_lanes(ow - 8 * (per_row - 1));
  row_vectors rv;
  for (int64_t v0 = 0; v0 < vectors; v0 += 3) {
    const int nv = vectors - v0 >= 3 ? 3 : (int)(vectors - v0);
    row_vectors_at(&rv, v0, nv, per_row, ow, wp, plane);
    for (int64_t i = 0; i < m; i += PACK) {
      const int64_t mr = m - i < PACK ? m - i : PACK;
      const float *wb = packed + i * taps, *bi = bias ? bias + i : NULL;
      float *yi = y + i * plane;
      if (nv == 3)
        row_channels(3, mr, &rv, lanes, wb, taps, xp, off, yi, plane, bi, accumulate);
      else if (nv == 2)
        row_channels(2, mr, &rv, lanes, wb, taps, xp, off, yi, plane, bi, accumulate);
      else
        row_channels(1, mr, &rv, lanes, wb, taps, xp, off, yi, plane, bi, accumulate);
    }
  }
}

/* dwt (taps, n) += A @ dyt, A[t][(y, x)] = xp[off[t] + y*WP + x]: as
 * cpu/gemm.c's conv_taps, in tiles of 6 taps x 8*nv (nv <= 2). */
#define MRA 6
AVX2 INLINE void tile_taps(const int mr, const int nv, const bool full, __m256i tail,
                           const float *xp, const int64_t *off, int64_t wp, int64_t oh,
                           int64_t ow, const float *dyt, int64_t n, float *c) {
  __m256 acc[MRA][2];
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++)
      acc[r][v] = !full && v == nv - 1 ? _mm256_maskload_ps(c + r * n + 8 * v, tail)
                                       : _mm256_loadu_ps(c + r * n + 8 * v);
  const float *bk = dyt;
  for (int64_t y = 0; y < oh; y++)
    for (int64_t x = 0; x < ow; x++, bk += n) {
      const int64_t at = y * wp + x;
      __m256 bv[2];
#pragma GCC unroll 2
      for (int v = 0; v < nv; v++)
        bv[v] = !full && v == nv - 1 ? _mm256_maskload_ps(bk + 8 * v, tail)
                                     : _mm256_loadu_ps(bk + 8 * v);
#pragma GCC unroll 6
      for (int r = 0; r < mr; r++) {
        const __m256 ar = _mm256_broadcast_ss(xp + off[r] + at);
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
      }
    }
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) {
      if (!full && v == nv - 1)
        _mm256_maskstore_ps(c + r * n + 8 * v, tail, acc[r][v]);
      else
        _mm256_storeu_ps(c + r * n + 8 * v, acc[r][v]);
    }
}

AVX2 INLINE void taps_strip(const int nv, const bool full, __m256i tail, int64_t taps,
                            const float *xp, const int64_t *off, int64_t wp, int64_t oh,
                            int64_t ow, const float *dyt, int64_t n, float *c) {
  int64_t t = 0;
  for (; t + MRA <= taps; t += MRA)
    tile_taps(MRA, nv, full, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
  for (; t + 2 <= taps; t += 2)
    tile_taps(2, nv, full, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
  for (; t < taps; t++) tile_taps(1, nv, full, tail, xp, off + t, wp, oh, ow, dyt, n, c + t * n);
}

AVX2 void ddp__cpu_conv_taps_avx2(int64_t taps, int64_t n, const float *xp, const int64_t *off,
                                  int64_t wp, int64_t oh, int64_t ow, const float *dyt,
                                  float *dwt) {
  const __m256i all = _mm256_set1_epi32(-1);
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t rest = n - j < 16 ? n - j : 16;
    const int64_t lanes = (rest - 1) % 8 + 1;
    const __m256i tail = first_lanes(lanes);
    if (rest == 16)
      taps_strip(2, true, all, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
    else if (rest > 8)
      taps_strip(2, false, tail, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
    else if (rest == 8)
      taps_strip(1, true, all, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
    else
      taps_strip(1, false, tail, taps, xp, off, wp, oh, ow, dyt + j, n, dwt + j);
  }
}
