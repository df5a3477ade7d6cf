/* Autocast's bfloat16 stride-1 convolutions with AVX512_BF16 dot products
 * (vdpbf16ps), for the implicit-im2col paths (the ConvNet's conv1 forward,
 * conv2 forward, dX and dW; docs/tensor.md, "Mixed precision"): the
 * float32 kernels' schemes (cpu/gemm.c: tile_rows, tile_flat, tile_taps)
 * with two taps a lane.
 *
 * vdpbf16ps adds a[2i] b[2i] + a[2i+1] b[2i+1] into float32 lane i, so
 * the reduction pairs two taps per lane. Pairing input channels c and
 * c + 1 at the same (a, b) keeps the float32 kernel's loads: the padded
 * image is stored as (ceil(C/2), HP, WP) 32-bit words, word (q, y, x)
 * holding channels 2q and 2q + 1 at (y, x) as bfloat16 (low half 2q), so
 * 16 outputs of a row read 16 consecutive words at offset
 * (q*HP + a)*WP + b, and the weight of a channel pair at a tap is one
 * broadcast word. Half the taps, the same loads and broadcasts per tap as
 * the float32 kernel: up to twice its products per instruction. An odd
 * channel count pairs the last channel with zeros. One input channel
 * pairs taps (a, 2j) and (a, 2j + 1) instead, over an image of column
 * pairs (colpairs), with the same kernel; an odd kernel width's last tap
 * of a row reads an image of single columns (singles: the upper half
 * zero, so that the zero weight beside it never meets a real input, which
 * could be infinite).
 *
 * The operands must already hold bfloat16 values (autocast rounded them:
 * ddp__conv2d_geom.round), so the words are their upper halves, exact.
 * Products of bfloat16 values are exact in float32 and summed in float32
 * (round to nearest even); vdpbf16ps treats subnormal bfloat16 inputs as
 * zero, as the bfloat16 GEMM does (cpu/gemm_bf16.c). */
#include <immintrin.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/cpu/dense.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define MR 8 /* output channels per tile, as the float32 kernel's */

int64_t ddp__cpu_conv_bf16_pairs_words(int64_t c, int64_t hp, int64_t wp) {
  return (c + 1) / 2 * hp * wp + 16;
}

/* The upper halves of two float32 vectors as pair words: lo's in the low
 * half. */
BF16_TARGET static inline __attribute__((always_inline)) __m512i pair_words_avx512(__m512 lo, __m512 hi) {
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                   _mm512_castps_si512(hi), _mm512_set1_epi32((int)0xffff0000),
                                   0xf8); /* a | (b & c) */
}

/* x rounded to bfloat16 values (nearest even, NaNs quietened), bit for
 * bit convert.c's round_bf16_avx512 (ddp_convert_round_f32): the tiles
 * round their outputs as they store them instead of a pass after. */
BF16_TARGET static inline __attribute__((always_inline)) __m512 round_bf16_avx512(__m512 x) {
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), top);
  const __m512i q = _mm512_ternarylogic_epi32(u, top, _mm512_set1_epi32(0x400000), 0xEA);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, q));
}

BF16_TARGET void ddp__cpu_conv_bf16_pairs_avx512(uint32_t *xp2, const float *x, int64_t c,
                                                  int64_t h, int64_t w, int64_t ph, int64_t pw,
                                                  int64_t hp, int64_t wp) {
  const int64_t hw = h * w;
  for (int64_t q = 0; q < (c + 1) / 2; q++) {
    const float *r0 = x + 2 * q * hw, *r1 = 2 * q + 1 < c ? r0 + hw : NULL;
    for (int64_t y = 0; y < h; y++) {
      uint32_t *dst = xp2 + (q * hp + y + ph) * wp + pw;
      for (int64_t j = 0; j < w; j += 16) {
        const int64_t left = w - j;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 v0 = _mm512_maskz_loadu_ps(m, r0 + y * w + j);
        const __m512 v1 = r1 ? _mm512_maskz_loadu_ps(m, r1 + y * w + j) : _mm512_setzero_ps();
        /* A whole vector: its spare lanes are zeros, landing on padding
         * (zero) or on the rows and channels written after this one, or
         * on the 16 words of slack. */
        _mm512_storeu_si512((void *)(dst + j), pair_words_avx512(v0, v1));
      }
    }
  }
}

int64_t ddp__cpu_conv_bf16_packed_words(int64_t m, int64_t c, int64_t kk) {
  return (m + MR - 1) / MR * MR * ((c + 1) / 2) * kk;
}

/* Upper half of a float32 (a bfloat16 value's bits). */
static uint32_t upper(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u >> 16;
}

void ddp__cpu_conv_bf16_pack(int64_t m, int64_t c, int64_t kk, const float *w,
                             uint32_t *packed) {
  const int64_t taps2 = (c + 1) / 2 * kk;
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    uint32_t *blk = packed + i0 * taps2;
    for (int64_t q = 0; q < (c + 1) / 2; q++)
      for (int64_t t = 0; t < kk; t++)
        for (int64_t r = 0; r < MR; r++) {
          const int64_t o = i0 + r;
          uint32_t word = 0;
          if (o < m) {
            word = upper(w[(o * c + 2 * q) * kk + t]);
            if (2 * q + 1 < c) word |= upper(w[(o * c + 2 * q + 1) * kk + t]) << 16;
          }
          blk[(q * kk + t) * MR + r] = word;
        }
  }
}

void ddp__cpu_conv_bf16_pack_cols(int64_t m, int64_t c, int64_t kh, int64_t kw, const float *w,
                                  uint32_t *packed) {
  const int64_t kb = (kw + 1) / 2, taps2 = c * kh * kb;
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    uint32_t *blk = packed + i0 * taps2;
    for (int64_t t = 0; t < c * kh; t++) /* (channel, kernel row) */
      for (int64_t j = 0; j < kb; j++)
        for (int64_t r = 0; r < MR; r++) {
          const int64_t o = i0 + r;
          uint32_t word = 0;
          if (o < m) {
            const float *row = w + (o * c * kh + t) * kw;
            word = upper(row[2 * j]);
            if (2 * j + 1 < kw) word |= upper(row[2 * j + 1]) << 16;
          }
          blk[(t * kb + j) * MR + r] = word;
        }
  }
}

/* cpu/gemm.c's tile_rows over pair words: y (mr channels, rows oy .. oy +
 * nv - 1) = bias + sum over the taps2 pair taps. Lanes past ow are computed
 * from the row's spill and stored onto the channel's next rows (written
 * again after), as there. */
BF16_TARGET static inline __attribute__((always_inline)) void tile_avx512(
    const int mr, const int nv, int64_t taps2, const uint32_t *wb, const uint32_t *xp,
    const int64_t *off, int64_t wp, float *y, int64_t oh, int64_t ow, int64_t oy,
    const float *bias, bool accumulate, bool round) {
  __m512 acc[MR][3];
  int64_t at[3];
  const __mmask16 lanes = (__mmask16)((1u << ow) - 1);
  bool fits[3];
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
  const uint32_t *xrow = xp + oy * wp;
  for (int64_t t = 0; t < taps2; t++) {
    const uint32_t *src = xrow + off[t];
    __m512bh bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) bv[v] = (__m512bh)_mm512_loadu_si512((const void *)(src + v * wp));
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)wb[t * MR + r]);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      float *dst = y + r * oh * ow + at[v];
      if (round) acc[r][v] = round_bf16_avx512(acc[r][v]);
      if (!fits[v])
        _mm512_mask_storeu_ps(dst, lanes, acc[r][v]);
      else if (accumulate)
        _mm512_storeu_ps(dst, _mm512_mask_mov_ps(_mm512_loadu_ps(dst), lanes, acc[r][v]));
      else
        _mm512_storeu_ps(dst, acc[r][v]);
    }
}

BF16_TARGET static void rows_avx512(int64_t mr, const uint32_t *wb, int64_t taps2,
                                    const uint32_t *xp, const int64_t *off, int64_t wp, float *y,
                                    int64_t oh, int64_t ow, const float *bias, bool accumulate,
                                    bool round) {
  for (int64_t oy = 0; oy < oh; oy += 3) {
    const int nv = oh - oy >= 3 ? 3 : (int)(oh - oy);
    if (mr == MR) {
      if (nv == 3)
        tile_avx512(MR, 3, taps2, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate, round);
      else if (nv == 2)
        tile_avx512(MR, 2, taps2, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate, round);
      else
        tile_avx512(MR, 1, taps2, wb, xp, off, wp, y, oh, ow, oy, bias, accumulate, round);
      continue;
    }
    for (int64_t r = 0; r < mr; r++) {
      float *yr = y + r * oh * ow;
      const float *br = bias ? bias + r : NULL;
      if (nv == 3)
        tile_avx512(1, 3, taps2, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate, round);
      else if (nv == 2)
        tile_avx512(1, 2, taps2, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate, round);
      else
        tile_avx512(1, 1, taps2, wb + r, xp, off, wp, yr, oh, ow, oy, br, accumulate, round);
    }
  }
}

/* Rows wider than 16 (up to 32): cpu/gemm.c's flat tiles over pair words,
 * 48 consecutive outputs of a channel a tile, a vector spanning at most two
 * rows, its lanes on the second row loaded from that row's start under a
 * mask. */
typedef struct flat_tile {
  int64_t at[3], first[3], second[3];
  __mmask16 on_first[3], on_second[3], valid[3];
} flat_tile;

static void flat_tile_at(flat_tile *ft, int64_t p, int64_t plane, int64_t ow, int64_t wp) {
  for (int v = 0; v < 3; v++) {
    const int64_t q = p + 16 * v, oy = q / ow, ox = q % ow;
    const int64_t inside = plane - q <= 0 ? 0 : plane - q < 16 ? plane - q : 16;
    const int64_t a = ow - ox < 16 ? ow - ox : 16;
    const uint32_t valid = (uint32_t)((1u << inside) - 1), first = (uint32_t)((1u << a) - 1);
    ft->at[v] = q;
    ft->first[v] = oy * wp + ox;
    ft->second[v] = (oy + 1) * wp - a;
    ft->valid[v] = (__mmask16)valid;
    ft->on_first[v] = (__mmask16)(valid & first);
    ft->on_second[v] = (__mmask16)(valid & ~first);
  }
}

BF16_TARGET static inline __attribute__((always_inline)) void tile_flat_avx512(
    const int mr, const int nv, const flat_tile *ft, int64_t taps2, const uint32_t *wb,
    const uint32_t *xp, const int64_t *off, float *y, int64_t plane, const float *bias,
    bool accumulate, bool round) {
  __m512 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(ft->valid[v], y + r * plane + ft->at[v])
                  : bias     ? _mm512_set1_ps(bias[r])
                             : _mm512_setzero_ps();
  for (int64_t t = 0; t < taps2; t++) {
    const uint32_t *src = xp + off[t];
    __m512bh bv[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
      bv[v] = (__m512bh)_mm512_mask_loadu_epi32(
          _mm512_maskz_loadu_epi32(ft->on_first[v], src + ft->first[v]), ft->on_second[v],
          src + ft->second[v]);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)wb[t * MR + r]);
#pragma GCC unroll 3
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++) {
      float *dst = y + r * plane + ft->at[v];
      if (round) acc[r][v] = round_bf16_avx512(acc[r][v]);
      if (ft->valid[v] == 0xffff)
        _mm512_storeu_ps(dst, acc[r][v]);
      else
        _mm512_mask_storeu_ps(dst, ft->valid[v], acc[r][v]);
    }
}

BF16_TARGET static void flat_channels_avx512(int nv, int64_t mr, const flat_tile *ft,
                                             const uint32_t *wb, int64_t taps2,
                                             const uint32_t *xp, const int64_t *off, float *y,
                                             int64_t plane, const float *bias, bool accumulate,
                                             bool round) {
  if (mr == MR) {
    if (nv == 3)
      tile_flat_avx512(MR, 3, ft, taps2, wb, xp, off, y, plane, bias, accumulate, round);
    else if (nv == 2)
      tile_flat_avx512(MR, 2, ft, taps2, wb, xp, off, y, plane, bias, accumulate, round);
    else
      tile_flat_avx512(MR, 1, ft, taps2, wb, xp, off, y, plane, bias, accumulate, round);
    return;
  }
  for (int64_t r = 0; r < mr; r++) {
    const float *br = bias ? bias + r : NULL;
    float *yr = y + r * plane;
    if (nv == 3)
      tile_flat_avx512(1, 3, ft, taps2, wb + r, xp, off, yr, plane, br, accumulate, round);
    else if (nv == 2)
      tile_flat_avx512(1, 2, ft, taps2, wb + r, xp, off, yr, plane, br, accumulate, round);
    else
      tile_flat_avx512(1, 1, ft, taps2, wb + r, xp, off, yr, plane, br, accumulate, round);
  }
}

/* A flat tile for every block of channels before the next tile: the
 * tile's window of the image stays in L1 while the weights stream. */
BF16_TARGET static void flat_all_avx512(int64_t m, int64_t taps2, const uint32_t *packed,
                                        const uint32_t *xp, const int64_t *off, int64_t wp,
                                        float *y, int64_t oh, int64_t ow, const float *bias,
                                        bool accumulate, bool round) {
  const int64_t plane = oh * ow;
  flat_tile ft;
  for (int64_t p = 0; p < plane; p += 48) {
    flat_tile_at(&ft, p, plane, ow, wp);
    const int64_t rest = plane - p;
    const int nv = rest > 32 ? 3 : rest > 16 ? 2 : 1;
    for (int64_t i = 0; i < m; i += MR)
      flat_channels_avx512(nv, m - i < MR ? m - i : MR, &ft, packed + i * taps2, taps2, xp, off,
                           y + i * plane, plane, bias ? bias + i : NULL, accumulate, round);
  }
}

BF16_TARGET void ddp__cpu_conv_rows_bf16_avx512(int64_t m, int64_t taps2,
                                                 const uint32_t *packed, const uint32_t *xp2,
                                                 const int64_t *off, int64_t wp, float *y,
                                                 int64_t oh, int64_t ow, const float *bias,
                                                 bool accumulate, bool round) {
  if (ow > 16) {
    flat_all_avx512(m, taps2, packed, xp2, off, wp, y, oh, ow, bias, accumulate, round);
    return;
  }
  for (int64_t i = 0; i < m; i += MR) {
    const int64_t mr = m - i < MR ? m - i : MR;
    rows_avx512(mr, packed + i * taps2, taps2, xp2, off, wp, y + i * oh * ow, oh, ow,
                bias ? bias + i : NULL, accumulate, round);
  }
}

/* ---- the weight gradient ----------------------------------------------
 * dwt (taps, n) += sum over outputs p of col[t][p] dy[j][p], col[t][(y, x)]
 * = xp[off[t] + y*wp + x] (cpu/gemm.c's conv_taps), with the outputs in
 * pairs (x, x + 1) of a row: the broadcast word of tap t is the padded
 * image's column pair (xp[s], xp[s + 1]) at s = off[t] + y*wp + x, and the
 * vector of n's 16 columns is dy's pair words transposed, (p/2, n). Half
 * the steps of the float32 kernel, the same loads and broadcasts a step. */

BF16_TARGET void ddp__cpu_conv_bf16_colpairs_avx512(uint32_t *dst, const float *xp, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_si512((void *)(dst + i),
                        pair_words_avx512(_mm512_loadu_ps(xp + i), _mm512_loadu_ps(xp + i + 1)));
}

BF16_TARGET void ddp__cpu_conv_bf16_singles_avx512(uint32_t *dst, const float *xp, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_si512((void *)(dst + i),
                        pair_words_avx512(_mm512_loadu_ps(xp + i), _mm512_setzero_ps()));
}

BF16_TARGET void ddp__cpu_conv_bf16_rowpairs_avx512(uint32_t *dst, const float *src, int64_t n) {
  /* consecutive floats' upper halves: pairs (2i, 2i + 1) as word i */
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(src + i), b = _mm512_loadu_ps(src + i + 16);
    _mm512_storeu_si512((void *)(dst + i / 2),
                        pair_words_avx512(_mm512_permutex2var_ps(a, even, b),
                                          _mm512_permutex2var_ps(a, odd, b)));
  }
  for (; i + 1 < n; i += 2) dst[i / 2] = upper(src[i]) | upper(src[i + 1]) << 16;
  if (i < n) dst[i / 2] = upper(src[i]);
}

#define MRA 12 /* taps per tile, as the float32 kernel's */
BF16_TARGET static inline __attribute__((always_inline)) void
tile_taps_avx512(const int mr, const int nv, __mmask16 tail, const uint32_t *xp,
                 const int64_t *off, int64_t wp, int64_t oh, int64_t ow, const uint32_t *dyp,
                 int64_t n, float *c) {
  __m512 acc[MRA][2];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++)
      acc[r][v] = _mm512_maskz_loadu_ps(v == nv - 1 ? tail : 0xffff, c + r * n + 16 * v);
  const uint32_t *bk = dyp;
  for (int64_t y = 0; y < oh; y++)
    for (int64_t x = 0; x < ow; x += 2, bk += n) {
      const int64_t at = y * wp + x;
      __m512bh bv[2];
#pragma GCC unroll 2
      for (int v = 0; v < nv; v++)
        bv[v] = (__m512bh)(v == nv - 1 ? _mm512_maskz_loadu_epi32(tail, bk + 16 * v)
                                       : _mm512_loadu_si512((const void *)(bk + 16 * v)));
#pragma GCC unroll 12
      for (int r = 0; r < mr; r++) {
        const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)xp[off[r] + at]);
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
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

BF16_TARGET static inline __attribute__((always_inline)) void
taps_strip_avx512(const int nv, __mmask16 tail, int64_t taps, const uint32_t *xp,
                  const int64_t *off, int64_t wp, int64_t oh, int64_t ow, const uint32_t *dyp,
                  int64_t n, float *c) {
  int64_t t = 0;
  for (; t + MRA <= taps; t += MRA)
    tile_taps_avx512(MRA, nv, tail, xp, off + t, wp, oh, ow, dyp, n, c + t * n);
  for (; t + 4 <= taps; t += 4)
    tile_taps_avx512(4, nv, tail, xp, off + t, wp, oh, ow, dyp, n, c + t * n);
  for (; t < taps; t++) tile_taps_avx512(1, nv, tail, xp, off + t, wp, oh, ow, dyp, n, c + t * n);
}

BF16_TARGET void ddp__cpu_conv_taps_bf16_avx512(int64_t taps, int64_t n, const uint32_t *xp,
                                                 const int64_t *off, int64_t wp, int64_t oh,
                                                 int64_t ow, const uint32_t *dyp, float *dwt) {
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t rest = n - j < 32 ? n - j : 32;
    const int lanes = (int)((rest - 1) % 16 + 1);
    const __mmask16 tail = (__mmask16)((1u << lanes) - 1);
    if (rest > 16)
      taps_strip_avx512(2, tail, taps, xp, off, wp, oh, ow, dyp + j, n, dwt + j);
    else
      taps_strip_avx512(1, tail, taps, xp, off, wp, oh, ow, dyp + j, n, dwt + j);
  }
}
