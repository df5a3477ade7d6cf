/* A small-matrix sgemm for the convolution kernels, in AVX-512 intrinsics.
 *
 * Why not OpenBLAS here: the convolutions' gemms are small (conv2 of the
 * ConvNet: 32 x 196 x 400 per sample) and OpenBLAS's generic x86-64 builds
 * pick their AVX2 kernels even on AVX-512 machines (0.3.21 reports "Haswell"
 * on Zen 5), capping them at about half of this core's peak. This kernel
 * needs no packing: A is read in place (row stride lda; each of its MR rows
 * is a stream the L1 cache serves), B rows are contiguous along n, and a tile
 * of MR x (16 * NV) outputs lives in registers for the whole k loop. The
 * last vector of a row uses masked loads and stores, so any n works.
 *
 * Compiled for AVX-512 through target attributes and used only when the CPU
 * has it (ddp__cpu_has_avx512); the build itself stays portable. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define MR 8 /* rows of C per tile */

static bool force_generic;

bool ddp__cpu_has_avx512(void) {
  static int cached = -1;
  if (cached < 0) cached = __builtin_cpu_supports("avx512f") ? 1 : 0;
  return cached && !force_generic;
}

void ddp__cpu_dense_force_generic(bool generic) { force_generic = generic; }

#define AVX512 __attribute__((target("avx512f,fma")))

/* One tile: rows [0, mr) of C, columns [0, 16*nv) with the last vector
 * masked by `tail`. mr and nv are compile-time constants at every call site,
 * so the accumulators stay in registers. */
AVX512 static inline __attribute__((always_inline)) void
tile(const int mr, const int nv, __mmask16 tail, int64_t k, const float *a, int64_t lda,
     const float *b, int64_t ldb, float *c, int64_t ldc, const float *row_bias,
     bool accumulate) {
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
    const float *bk = b + kk * ldb;
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
      const float *b, int64_t ldb, float *c, int64_t ldc, const float *row_bias,
      bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    tile(MR, nv, tail, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
  if (m - i >= 4) {
    tile(4, nv, tail, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
    i += 4;
  }
  if (m - i >= 2) {
    tile(2, nv, tail, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
    i += 2;
  }
  if (m - i >= 1)
    tile(1, nv, tail, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
         row_bias ? row_bias + i : NULL, accumulate);
}

AVX512 void ddp__cpu_gemm_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                                 const float *b, int64_t ldb, float *c, int64_t ldc,
                                 const float *row_bias, bool accumulate) {
  int64_t j = 0;
  for (; j + 48 <= n; j += 48)
    strip(3, 0xffff, m, k, a, lda, b + j, ldb, c + j, ldc, row_bias, accumulate);
  int64_t rest = n - j;
  if (rest == 0) return;
  const int lanes = (int)((rest - 1) % 16 + 1); /* in the last vector: 1..16 */
  __mmask16 tail = (__mmask16)((1u << lanes) - 1);
  if (rest > 32)
    strip(3, tail, m, k, a, lda, b + j, ldb, c + j, ldc, row_bias, accumulate);
  else if (rest > 16)
    strip(2, tail, m, k, a, lda, b + j, ldb, c + j, ldc, row_bias, accumulate);
  else
    strip(1, tail, m, k, a, lda, b + j, ldb, c + j, ldc, row_bias, accumulate);
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
        const float *b, int64_t ldb, float *c, int64_t ldc) {
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
      __m512 bv = _mm512_loadu_ps(b + j * ldb + kk);
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
      __m512 bv = _mm512_maskz_loadu_ps(tail, b + j * ldb + kk);
#pragma GCC unroll 4
      for (int i = 0; i < md; i++) acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < md; i++)
#pragma GCC unroll 6
    for (int j = 0; j < nd; j++) c[i * ldc + j] += _mm512_reduce_add_ps(acc[i][j]);
}

AVX512 void ddp__cpu_gemm_nt_avx512(int64_t m, int64_t n, int64_t k, const float *a,
                                    int64_t lda, const float *b, int64_t ldb, float *c,
                                    int64_t ldc) {
  const __mmask16 tail = (__mmask16)((1u << (k % 16)) - 1);
  int64_t i = 0;
  for (; i + MD <= m; i += MD) {
    int64_t j = 0;
    for (; j + ND <= n; j += ND)
      tile_nt(MD, ND, k, tail, a + i * lda, lda, b + j * ldb, ldb, c + i * ldc + j, ldc);
    for (; j < n; j++)
      tile_nt(MD, 1, k, tail, a + i * lda, lda, b + j * ldb, ldb, c + i * ldc + j, ldc);
  }
  for (; i < m; i++) {
    int64_t j = 0;
    for (; j + ND <= n; j += ND)
      tile_nt(1, ND, k, tail, a + i * lda, lda, b + j * ldb, ldb, c + i * ldc + j, ldc);
    for (; j < n; j++)
      tile_nt(1, 1, k, tail, a + i * lda, lda, b + j * ldb, ldb, c + i * ldc + j, ldc);
  }
}
