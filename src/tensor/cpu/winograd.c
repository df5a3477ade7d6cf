/* 3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3)
 * (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
 * 2016): each 2x2 block of outputs comes from a 4x4 block of inputs with 16
 * multiplications per (input channel, output channel) pair instead of 36, so
 * the multiply-adds of a convolution with many channels drop 2.25 times.
 *
 *   U = G g G^T        the weight g (3x3) of each (output, input) pair: 4x4
 *   V = B^T d B        the input tile d (4x4, stride 2) of each input channel
 *   M[k] = U[k] @ V[k] for each of the 16 positions k: (m, c) @ (c, tiles)
 *   Y = A^T M A        2x2 outputs per tile and output channel
 *
 * with B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],
 *      G   = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1],
 *      A^T = [1 1 1 0; 0 1 -1 -1].
 * The 16 products are gemms with k = input channels (cpu/gemm.c's small
 * gemm); the transforms run over a whole row of tiles at once, one tile per
 * vector lane, so a row of outputs up to 30 wide is one vector of tiles.
 *
 * Rounding: the transforms add and subtract at most 9 terms (B, A) and
 * halve (G), so the result differs from the direct sum by a few ulps of the
 * largest partial sums; the tests hold it to the direct convolution's
 * tolerance and against float64 references (tests/tensor/test_dense_ops.c).
 * DDP_CONV_WINOGRAD=0 turns the path off (cpu/conv.c). */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

#define AVX512 __attribute__((target("avx512f,fma")))

/* The 16 transform positions k = 4*i + j of a 4x4 tile. */
#define POS 16

int64_t ddp__cpu_winograd_weights_floats(int64_t m, int64_t c) { return POS * m * c; }

void ddp__cpu_winograd_weights(int64_t m, int64_t c, const float *w, int64_t ldw, float *u) {
  for (int64_t o = 0; o < m; o++)
    for (int64_t ci = 0; ci < c; ci++) {
      const float *g = w + o * ldw + ci * 9;
      float t[4][3]; /* G g */
      for (int b = 0; b < 3; b++) {
        const float g0 = g[b], g1 = g[3 + b], g2 = g[6 + b];
        t[0][b] = g0;
        t[1][b] = 0.5f * (g0 + g1 + g2);
        t[2][b] = 0.5f * (g0 - g1 + g2);
        t[3][b] = g2;
      }
      for (int i = 0; i < 4; i++) { /* (G g) G^T */
        const float a0 = t[i][0], a1 = t[i][1], a2 = t[i][2];
        const float row[4] = {a0, 0.5f * (a0 + a1 + a2), 0.5f * (a0 - a1 + a2), a2};
        for (int j = 0; j < 4; j++) u[((int64_t)(4 * i + j) * m + o) * c + ci] = row[j];
      }
    }
}

/* Per position k: V[k] (c, tiles) then M[k] (m, tiles), each followed by a
 * vector of slack for the whole-vector stores and loads of the last row of
 * tiles. */
static int64_t tiles_of(int64_t oh, int64_t ow) { return (oh / 2) * (ow / 2); }

int64_t ddp__cpu_winograd_scratch_floats(int64_t m, int64_t c, int64_t oh, int64_t ow) {
  const int64_t t = tiles_of(oh, ow);
  return POS * (c * t + 16) + POS * (m * t + 16);
}

bool ddp__cpu_winograd_fits(int64_t m, int64_t c, int64_t oh, int64_t ow) {
  /* Even outputs (whole 2x2 tiles), a row of tiles in one vector and input
   * rows in two (ow + 2 <= 32), and enough channels on both sides for the
   * 16 gemms to outweigh the transforms (measured: psnet's 32 -> 64). */
  return oh >= 2 && ow >= 2 && oh % 2 == 0 && ow % 2 == 0 && ow <= 30 && m >= 16 && c >= 16;
}

/* Lane l of the result holds row[2l + shift] of a row loaded as lo (0..15)
 * and hi (16..31). */
AVX512 static inline __attribute__((always_inline)) __m512 pick(__m512 lo, __m512 hi, int shift) {
  const __m512i idx =
      _mm512_add_epi32(_mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
                       _mm512_set1_epi32(shift));
  return _mm512_permutex2var_ps(lo, idx, hi);
}

/* V for input channel ci: its rows 2ty..2ty+3 for every tile row ty. */
AVX512 static inline __attribute__((always_inline)) void input_transform(const float *x, int64_t iw,
                                                                         int64_t th, int64_t tw,
                                                                         float *v, int64_t vk) {
  /* masked: nothing past the row is read (x may be the caller's tensor) */
  const __mmask16 lo_lanes = (__mmask16)(iw >= 16 ? 0xffffu : (1u << iw) - 1);
  const __mmask16 hi_lanes = (__mmask16)(iw > 16 ? (1u << (iw - 16)) - 1 : 0);
  for (int64_t ty = 0; ty < th; ty++) {
    __m512 lo[4], hi[4];
    for (int r = 0; r < 4; r++) {
      const float *row = x + (2 * ty + r) * iw;
      lo[r] = _mm512_maskz_loadu_ps(lo_lanes, row);
      hi[r] = _mm512_maskz_loadu_ps(hi_lanes, row + 16);
    }
    /* B^T d: over the four rows, whole rows at once */
    __m512 tl[4], thi[4];
    tl[0] = _mm512_sub_ps(lo[0], lo[2]), thi[0] = _mm512_sub_ps(hi[0], hi[2]);
    tl[1] = _mm512_add_ps(lo[1], lo[2]), thi[1] = _mm512_add_ps(hi[1], hi[2]);
    tl[2] = _mm512_sub_ps(lo[2], lo[1]), thi[2] = _mm512_sub_ps(hi[2], hi[1]);
    tl[3] = _mm512_sub_ps(lo[1], lo[3]), thi[3] = _mm512_sub_ps(hi[1], hi[3]);
    float *at = v + ty * tw;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      /* (B^T d) B: columns 2tx..2tx+3 of each tile tx, one tile a lane */
      const __m512 e0 = pick(tl[i], thi[i], 0), o0 = pick(tl[i], thi[i], 1);
      const __m512 e1 = pick(tl[i], thi[i], 2), o1 = pick(tl[i], thi[i], 3);
      /* lanes past tw land on the next row of tiles (written next) or the
       * slack past the channel's tiles */
      _mm512_storeu_ps(at + (4 * i + 0) * vk, _mm512_sub_ps(e0, e1));
      _mm512_storeu_ps(at + (4 * i + 1) * vk, _mm512_add_ps(o0, e1));
      _mm512_storeu_ps(at + (4 * i + 2) * vk, _mm512_sub_ps(e1, o0));
      _mm512_storeu_ps(at + (4 * i + 3) * vk, _mm512_sub_ps(o0, o1));
    }
  }
}

/* Lane l of the result: a[l/2] for even l, b[l/2] for odd l, from lane
 * `from` of a and b on. */
AVX512 static inline __attribute__((always_inline)) __m512 interleave(__m512 a, __m512 b,
                                                                      int from) {
  const __m512i idx =
      _mm512_add_epi32(_mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
                       _mm512_set1_epi32(from));
  return _mm512_permutex2var_ps(a, idx, b);
}

/* One row of ow outputs: even columns from `even`, odd from `odd`. */
AVX512 static inline __attribute__((always_inline)) void put_row(float *dst, __m512 even,
                                                                 __m512 odd, __mmask16 lo_lanes,
                                                                 __mmask16 hi_lanes,
                                                                 bool accumulate) {
  __m512 lo = interleave(even, odd, 0), hi = interleave(even, odd, 8);
  if (accumulate) {
    lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(lo_lanes, dst));
    hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(hi_lanes, dst + 16));
  }
  if (lo_lanes == 0xffff)
    _mm512_storeu_ps(dst, lo);
  else
    _mm512_mask_storeu_ps(dst, lo_lanes, lo);
  if (hi_lanes) _mm512_mask_storeu_ps(dst + 16, hi_lanes, hi);
}

/* Y for output channel o from M (its 16 positions at stride mk). */
AVX512 static inline __attribute__((always_inline)) void output_transform(const float *mo,
                                                                          int64_t mk, int64_t th,
                                                                          int64_t tw, float *y,
                                                                          int64_t ow, float bias,
                                                                          bool accumulate) {
  const __mmask16 lo_lanes = (__mmask16)(ow >= 16 ? 0xffffu : (1u << ow) - 1);
  const __mmask16 hi_lanes = (__mmask16)(ow > 16 ? (1u << (ow - 16)) - 1 : 0);
  const __m512 b = _mm512_set1_ps(bias);
  for (int64_t ty = 0; ty < th; ty++) {
    const float *at = mo + ty * tw;
    __m512 s0[4], s1[4]; /* A^T m: rows of the 4x4, per column j */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const __m512 m0 = _mm512_loadu_ps(at + (0 + j) * mk), m1 = _mm512_loadu_ps(at + (4 + j) * mk);
      const __m512 m2 = _mm512_loadu_ps(at + (8 + j) * mk),
                   m3 = _mm512_loadu_ps(at + (12 + j) * mk);
      s0[j] = _mm512_add_ps(_mm512_add_ps(m0, m1), m2);
      s1[j] = _mm512_sub_ps(_mm512_sub_ps(m1, m2), m3);
    }
    /* (A^T m) A, plus the bias */
    const __m512 y00 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s0[0], s0[1]), s0[2]), b);
    const __m512 y01 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(s0[1], s0[2]), s0[3]), b);
    const __m512 y10 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s1[0], s1[1]), s1[2]), b);
    const __m512 y11 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(s1[1], s1[2]), s1[3]), b);
    put_row(y + (2 * ty) * ow, y00, y01, lo_lanes, hi_lanes, accumulate);
    put_row(y + (2 * ty + 1) * ow, y10, y11, lo_lanes, hi_lanes, accumulate);
  }
}

AVX512 void ddp__cpu_winograd_conv3x3_avx512(int64_t m, int64_t c, const float *u, const float *x,
                                             float *y, int64_t oh, int64_t ow, const float *bias,
                                             bool accumulate, float *scratch) {
  const int64_t th = oh / 2, tw = ow / 2, tiles = th * tw, iw = ow + 2;
  const int64_t vk = c * tiles + 16, mk = m * tiles + 16; /* position strides */
  float *v = scratch, *mm = scratch + POS * vk;
  for (int64_t ci = 0; ci < c; ci++)
    input_transform(x + ci * (oh + 2) * iw, iw, th, tw, v + ci * tiles, vk);
  for (int k = 0; k < POS; k++) /* M[k] (m, tiles) = U[k] (m, c) @ V[k] (c, tiles) */
    ddp__cpu_gemm_avx512(m, tiles, c, u + (int64_t)k * m * c, c, v + k * vk, tiles, mm + k * mk,
                         tiles, NULL, false);
  for (int64_t o = 0; o < m; o++)
    output_transform(mm + o * tiles, mk, th, tw, y + o * oh * ow, ow, bias ? bias[o] : 0.0f,
                     accumulate);
}

/* ---- the weight gradient ---------------------------------------------------
 * Y = A^T (U . V) A summed over input channels is linear in U, so
 *   dL/dU[o][c] = sum over tiles of (A dY A^T) . V[c]   (elementwise, 4x4)
 *   dL/dg[o][c] = G^T dL/dU[o][c] G                     (3x3)
 * with dY the tile's 2x2 block of the output gradient. Per sample: V as in
 * the forward, the 16 positions of A dY A^T per output channel, and 16 gemms
 * du[k] (m, c) += dM[k] (m, tiles) @ V[k]^T; the G^T . G transform runs once,
 * after the last sample (it is linear too). */

/* dM for output channel o: the rows 2ty, 2ty + 1 of its gradient dy. */
AVX512 static inline __attribute__((always_inline)) void
grad_transform(const float *dy, int64_t ow, int64_t th, int64_t tw, float *dm, int64_t mk) {
  const __mmask16 lo_lanes = (__mmask16)(ow >= 16 ? 0xffffu : (1u << ow) - 1);
  const __mmask16 hi_lanes = (__mmask16)(ow > 16 ? (1u << (ow - 16)) - 1 : 0);
  for (int64_t ty = 0; ty < th; ty++) {
    __m512 e[2], o[2]; /* the tile's columns 0 and 1 of rows 0 and 1, a tile a lane */
    for (int r = 0; r < 2; r++) {
      const float *row = dy + (2 * ty + r) * ow;
      const __m512 lo = _mm512_maskz_loadu_ps(lo_lanes, row);
      const __m512 hi = _mm512_maskz_loadu_ps(hi_lanes, row + 16);
      e[r] = pick(lo, hi, 0), o[r] = pick(lo, hi, 1);
    }
    /* A z: the rows z0, z0 + z1, z0 - z1, -z1; then (A z) A^T along each */
    const __m512 zero = _mm512_setzero_ps();
    const __m512 p[4] = {e[0], _mm512_add_ps(e[0], e[1]), _mm512_sub_ps(e[0], e[1]),
                         _mm512_sub_ps(zero, e[1])};
    const __m512 q[4] = {o[0], _mm512_add_ps(o[0], o[1]), _mm512_sub_ps(o[0], o[1]),
                         _mm512_sub_ps(zero, o[1])};
    float *at = dm + ty * tw;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* lanes past tw: as in input_transform */
      _mm512_storeu_ps(at + (4 * i + 0) * mk, p[i]);
      _mm512_storeu_ps(at + (4 * i + 1) * mk, _mm512_add_ps(p[i], q[i]));
      _mm512_storeu_ps(at + (4 * i + 2) * mk, _mm512_sub_ps(p[i], q[i]));
      _mm512_storeu_ps(at + (4 * i + 3) * mk, _mm512_sub_ps(zero, q[i]));
    }
  }
}

AVX512 void ddp__cpu_winograd_dw_sample_avx512(int64_t m, int64_t c, const float *x,
                                               const float *dy, int64_t oh, int64_t ow,
                                               float *du, float *scratch) {
  const int64_t th = oh / 2, tw = ow / 2, tiles = th * tw, iw = ow + 2;
  const int64_t vk = c * tiles + 16, mk = m * tiles + 16;
  float *v = scratch, *dm = scratch + POS * vk;
  for (int64_t ci = 0; ci < c; ci++)
    input_transform(x + ci * (oh + 2) * iw, iw, th, tw, v + ci * tiles, vk);
  for (int64_t o = 0; o < m; o++) grad_transform(dy + o * oh * ow, ow, th, tw, dm + o * tiles, mk);
  for (int k = 0; k < POS; k++) /* du[k] (m, c) += dM[k] (m, tiles) @ V[k] (c, tiles)^T */
    ddp__cpu_gemm_nt_avx512(m, c, tiles, dm + k * mk, tiles, v + k * vk, tiles,
                            du + (int64_t)k * m * c, c);
}

void ddp__cpu_winograd_dw_finish(int64_t m, int64_t c, const float *du, float *dw) {
  for (int64_t o = 0; o < m; o++)
    for (int64_t ci = 0; ci < c; ci++) {
      float d[4][4], t[3][4]; /* dU[o][c], then G^T dU */
      for (int k = 0; k < POS; k++) d[k / 4][k % 4] = du[((int64_t)k * m + o) * c + ci];
      for (int j = 0; j < 4; j++) {
        t[0][j] = d[0][j] + 0.5f * (d[1][j] + d[2][j]);
        t[1][j] = 0.5f * (d[1][j] - d[2][j]);
        t[2][j] = 0.5f * (d[1][j] + d[2][j]) + d[3][j];
      }
      float *g = dw + (o * c + ci) * 9;
      for (int a = 0; a < 3; a++) { /* (G^T dU) G */
        g[3 * a + 0] += t[a][0] + 0.5f * (t[a][1] + t[a][2]);
        g[3 * a + 1] += 0.5f * (t[a][1] - t[a][2]);
        g[3 * a + 2] += 0.5f * (t[a][1] + t[a][2]) + t[a][3];
      }
    }
}
