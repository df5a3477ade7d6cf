/* bfloat16 GEMM with AVX512_BF16 dot products (vdpbf16ps), for autocast's
 * linear and matmul on CPUs that have them (docs/tensor.md, "Mixed
 * precision"): c (m, n) = op(a) (m, k) @ op(b) (k, n), the operands rounded
 * to bfloat16 (the cast autocast makes), products accumulated in float32,
 * c written in float32 (the caller rounds it).
 *
 * Layout (the usual one for pairwise dot products): a is converted to rows
 * of bfloat16 pairs, (m, kp) 32-bit words, kp = ceil(k / 2), word p of row
 * i holding a[i, 2p] and a[i, 2p + 1]; b is packed as (kp, np, 2) bfloat16,
 * np = n rounded up to 64, so that one 64-byte load holds 16 columns' pairs.
 * vdpbf16ps then adds a[i,2p] b[2p,j] + a[i,2p+1] b[2p+1,j] into 16
 * float32 lanes with no horizontal sums: a tile is 6 rows x 64 columns (24
 * accumulators), k in blocks of KC pairs so that a block of b stays in L2.
 * Zero padding (odd k, columns past n) adds exact zeros. */
#include <immintrin.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/cpu/dense.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define MR 6
#define NR 64  /* columns per tile: 4 vectors */
#define KC 256 /* pairs per k block: a 64-column block of b is 64 KB */

bool ddp__cpu_has_bf16_dot(void) {
  return ddp__cpu_family_running() == DDP__CPU_AVX512 && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512bw");
}

size_t ddp__cpu_bf16_pack_bytes(int64_t k, int64_t n) {
  const int64_t kp = (k + 1) / 2, np = (n + NR - 1) / NR * NR;
  return (size_t)(kp * np * 2) * sizeof(uint16_t);
}

/* Packing with vcvtneps2bf16 (16 floats to bfloat16, nearest even). It
 * treats subnormal inputs as zero, unlike ddp_float_to_bf16; so does
 * vdpbf16ps, which reads the packed values, so the GEMM's result is the
 * same either way. Pairs (b[2p, j], b[2p+1, j]) are one 32-bit word. */
BF16_TARGET static inline __m512i pair_words_avx512(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

/* b stored (k, n): rows 2p and 2p + 1 interleaved, 16 columns a step. */
BF16_TARGET static void pack_rows_avx512(uint16_t *dst, int64_t k, int64_t n, const float *b,
                                         int64_t ldb) {
  const int64_t kp = (k + 1) / 2, np = (n + NR - 1) / NR * NR;
  for (int64_t p = 0; p < kp; p++) {
    uint32_t *row = (uint32_t *)(dst + p * np * 2);
    const float *r0 = b + 2 * p * ldb, *r1 = 2 * p + 1 < k ? r0 + ldb : NULL;
    for (int64_t j = 0; j < np; j += 16) {
      const int64_t left = n - j;
      const __mmask16 m = left >= 16 ? (__mmask16)0xffff
                          : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
      const __m512 v0 = _mm512_maskz_loadu_ps(m, r0 + j);
      const __m512 v1 = r1 ? _mm512_maskz_loadu_ps(m, r1 + j) : _mm512_setzero_ps();
      _mm512_storeu_si512((void *)(row + j), pair_words_avx512(v0, v1));
    }
  }
}

/* b stored (n, k): each row's consecutive elements are the pairs already,
 * and its bfloat16 words go down column j of the packed matrix. Blocks of
 * 16 rows x 16 pairs: the rows' words into a 16 x 16 block on the stack,
 * then each pair's 16 words (a column of the block, one gather) stored
 * whole, so the packed matrix is written a cache line at a time. */
BF16_TARGET static void pack_cols_avx512(uint16_t *dst, int64_t k, int64_t n, const float *b,
                                         int64_t ldb) {
  const int64_t kp = (k + 1) / 2, np = (n + NR - 1) / NR * NR;
  uint32_t *out = (uint32_t *)dst;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
  uint32_t block[16 * 16] __attribute__((aligned(64)));
  for (int64_t j0 = 0; j0 < np; j0 += 16)
    for (int64_t p0 = 0; p0 < kp; p0 += 16) {
      const int64_t left = k - 2 * p0;
      const __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
      const __mmask16 m1 = left >= 32   ? (__mmask16)0xffff
                           : left > 16 ? (__mmask16)((1u << (left - 16)) - 1)
                                       : (__mmask16)0;
      for (int64_t r = 0; r < 16; r++) {
        __m512i words = _mm512_setzero_si512(); /* rows past n: zero columns */
        if (j0 + r < n) {
          const float *row = b + (j0 + r) * ldb + 2 * p0;
          const __m512 a0 = _mm512_maskz_loadu_ps(m0, row);
          const __m512 a1 = _mm512_maskz_loadu_ps(m1, row + 16);
          words = pair_words_avx512(_mm512_permutex2var_ps(a0, even, a1),
                                    _mm512_permutex2var_ps(a0, odd, a1));
        }
        _mm512_store_si512((void *)(block + 16 * r), words);
      }
      const int64_t count = kp - p0 < 16 ? kp - p0 : 16;
      for (int64_t q = 0; q < count; q++)
        _mm512_storeu_si512((void *)(out + (p0 + q) * np + j0),
                            _mm512_i32gather_epi32(column, (const void *)(block + q), 4));
    }
}

/* op(b) (k, n), b stored (k, n) (row stride ldb) or, with trans_b, (n, k). */
void ddp__cpu_bf16_pack_b(uint16_t *dst, bool trans_b, int64_t k, int64_t n, const float *b,
                          int64_t ldb) {
  if (ddp__cpu_has_bf16_dot()) {
    if (trans_b)
      pack_cols_avx512(dst, k, n, b, ldb);
    else
      pack_rows_avx512(dst, k, n, b, ldb);
    return;
  }
  const int64_t kp = (k + 1) / 2, np = (n + NR - 1) / NR * NR;
  for (int64_t p = 0; p < kp; p++) {
    uint16_t *row = dst + p * np * 2;
    for (int64_t j = 0; j < np; j++)
      for (int64_t h = 0; h < 2; h++) {
        const int64_t kk = 2 * p + h;
        float v = 0.0f;
        if (kk < k && j < n) v = trans_b ? b[j * ldb + kk] : b[kk * ldb + j];
        row[2 * j + h] = ddp_float_to_bf16(v);
      }
  }
}

/* op(a) (m, k) as rows of kp pairs; a stored (m, k) or, with trans_a, (k, m). */
static void convert_a(uint32_t *dst, bool trans_a, int64_t m, int64_t k, const float *a,
                      int64_t lda) {
  const int64_t kp = (k + 1) / 2;
  for (int64_t i = 0; i < m; i++) {
    uint16_t *row = (uint16_t *)(dst + i * kp);
    if (!trans_a) {
      ddp_convert_f32_to_bf16(row, a + i * lda, (size_t)k);
    } else {
      for (int64_t kk = 0; kk < k; kk++) row[kk] = ddp_float_to_bf16(a[kk * lda + i]);
    }
    if (k & 1) row[k] = 0;
  }
}

/* One tile: rows [0, mr) of a (pairs, stride kp) times a 64-column block
 * of packed b (pairs p0 .. p0 + kc), into c (stride ldc, `cols` valid
 * columns); `first` writes, otherwise adds to c. mr is a constant in each
 * instantiation, so the accumulators live in registers. */
BF16_TARGET static inline __attribute__((always_inline)) void
tile_avx512(const int mr, const uint32_t *a, int64_t kp, const uint16_t *b, int64_t np,
            int64_t kc, float *c, int64_t ldc, int64_t cols, bool first) {
  /* The unroll pragmas keep acc in registers: without them GCC kept the
   * row loop and acc on the stack, a load and a store around every
   * vdpbf16ps, which halved the kernel's speed (perf annotate). */
  __m512 acc[MR][4];
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; p++) {
    const uint16_t *bp = b + p * np * 2;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)bp);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(bp + 32));
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512((const void *)(bp + 64));
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512((const void *)(bp + 96));
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * kp + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], av, b3);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const int64_t left = cols - 16 * v;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
      float *cp = c + r * ldc + 16 * v;
      __m512 out = acc[r][v];
      if (!first) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, cp));
      _mm512_mask_storeu_ps(cp, mask, out);
    }
}

BF16_TARGET static void tile_rows_avx512(int mr, const uint32_t *a, int64_t kp,
                                         const uint16_t *b, int64_t np, int64_t kc, float *c,
                                         int64_t ldc, int64_t cols, bool first) {
  switch (mr) {
  case 6: tile_avx512(6, a, kp, b, np, kc, c, ldc, cols, first); break;
  case 5: tile_avx512(5, a, kp, b, np, kc, c, ldc, cols, first); break;
  case 4: tile_avx512(4, a, kp, b, np, kc, c, ldc, cols, first); break;
  case 3: tile_avx512(3, a, kp, b, np, kc, c, ldc, cols, first); break;
  case 2: tile_avx512(2, a, kp, b, np, kc, c, ldc, cols, first); break;
  default: tile_avx512(1, a, kp, b, np, kc, c, ldc, cols, first); break;
  }
}

BF16_TARGET static void gemm_packed_avx512(int64_t m, int64_t n, int64_t k, const uint32_t *a,
                                           const uint16_t *b, float *c, int64_t ldc) {
  const int64_t kp = (k + 1) / 2, np = (n + NR - 1) / NR * NR;
  if (kp == 0) {
    for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, (size_t)n * sizeof(float));
    return;
  }
  for (int64_t p0 = 0; p0 < kp; p0 += KC) {
    const int64_t kc = kp - p0 < KC ? kp - p0 : KC;
    for (int64_t j0 = 0; j0 < n; j0 += NR)
      for (int64_t i0 = 0; i0 < m; i0 += MR)
        tile_rows_avx512((int)(m - i0 < MR ? m - i0 : MR), a + i0 * kp + p0, kp,
                         b + (p0 * np + j0) * 2, np, kc, c + i0 * ldc + j0, ldc,
                         n - j0 < NR ? n - j0 : NR, p0 == 0);
  }
}

bool ddp__cpu_gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                        const float *a, int64_t lda, const float *b, int64_t ldb,
                        const uint16_t *b_packed, float *c, int64_t ldc, ddp_arena *arena) {
  if (!ddp__cpu_has_bf16_dot()) return false;
  const int64_t kp = (k + 1) / 2;
  uint32_t *ap = ddp_arena_alloc(arena, (size_t)(m * kp + 1) * sizeof(uint32_t));
  uint16_t *bp = (uint16_t *)b_packed;
  if (!bp) bp = ddp_arena_alloc(arena, ddp__cpu_bf16_pack_bytes(k, n));
  if (!ap || !bp) return false;
  convert_a(ap, trans_a, m, k, a, lda);
  if (!b_packed) ddp__cpu_bf16_pack_b(bp, trans_b, k, n, b, ldb);
  gemm_packed_avx512(m, n, k, ap, bp, c, ldc);
  return true;
}
