/* float32 <-> bfloat16 / float16 over buffers: the one implementation that
 * the compression hooks (through the basic kernel table) and autocast use.
 * Each path gives the bits of tensor.h's single-value functions (round to
 * nearest even, subnormals kept, overflow to infinity for float16, NaN kept
 * NaN and quieted); tests/tensor/test_convert.c compares every path with
 * them over all 65536 16-bit patterns and edge floats.
 *
 * Paths, chosen by the running CPU kernel family (cpu/family.c):
 *   avx512  16 lanes: bfloat16 by integer rounding (AVX-512F), float16 by
 *           vcvtps2ph / vcvtph2ps on zmm registers;
 *   avx2    float16 by F16C (8 lanes; the *_avx2 functions, which
 *           check_portable_isa.sh allows ymm) where the CPU has it; bfloat16 by
 *           the plain loop, which the compiler vectorises;
 *   generic the plain loops.
 * AVX512_BF16's vcvtneps2bf16 is not used: it flushes subnormal inputs to
 * zero, which is not ddp_float_to_bf16 (nor PyTorch's c10::BFloat16). */
#include <immintrin.h>

#include "ddp/tensor.h"
#include "tensor/cpu/dense.h"

#define AVX512 __attribute__((target("avx512f")))
#define F16C __attribute__((target("avx,f16c")))

/* ---- the plain loops (also every vector path's tail) ---- */

static void to_bf16_plain(uint16_t *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = ddp_float_to_bf16(src[i]);
}

static void from_bf16_plain(float *restrict dst, const uint16_t *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = ddp_bf16_to_float(src[i]);
}

static void to_f16_plain(uint16_t *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = ddp_float_to_half(src[i]);
}

static void from_f16_plain(float *restrict dst, const uint16_t *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = ddp_half_to_float(src[i]);
}

/* ---- AVX-512F ---- */

/* ddp_float_to_bf16 on 16 lanes, the result in the low 16 bits of each. */
AVX512 static inline __m512i bf16_bits_avx512(__m512i u) {
  const __m512i one = _mm512_set1_epi32(1);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  __mmask16 is_nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(rounded, is_nan, nan);
}

AVX512 static void to_bf16_avx512(uint16_t *restrict dst, const float *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i u = _mm512_loadu_si512((const void *)(src + i));
    _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(bf16_bits_avx512(u)));
  }
  to_bf16_plain(dst + i, src + i, n - i);
}

AVX512 static void from_bf16_avx512(float *restrict dst, const uint16_t *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
    _mm512_storeu_si512((void *)(dst + i), _mm512_slli_epi32(h, 16));
  }
  from_bf16_plain(dst + i, src + i, n - i);
}

AVX512 static void to_f16_avx512(uint16_t *restrict dst, const float *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i *)(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  to_f16_plain(dst + i, src + i, n - i);
}

AVX512 static void from_f16_avx512(float *restrict dst, const uint16_t *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
  from_f16_plain(dst + i, src + i, n - i);
}

/* In place or not: round to bfloat16 and widen, 16 lanes: bf16_bits_avx512's
 * bits left where they stand, (u + 0x7fff + odd) with the low half cleared,
 * a NaN's top half quietened instead (u | 0x400000, the low half cleared).
 * Eight vector operations where narrowing and widening again take eleven:
 * autocast rounds every low-precision op's output and gradient with this,
 * a few percent of a CPU step. */
AVX512 static void round_bf16_avx512(float *dst, const float *src, size_t n) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u), quiet = _mm512_set1_epi32(0x400000);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i r =
        _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, bias), odd), top);
    /* (u & top) | quiet: ternary-logic table (A & B) | C */
    const __m512i q = _mm512_ternarylogic_epi32(u, top, quiet, 0xEA);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm512_storeu_si512((void *)(dst + i), _mm512_mask_mov_epi32(r, nan, q));
  }
  for (; i < n; i++) dst[i] = ddp_bf16_to_float(ddp_float_to_bf16(src[i]));
}

AVX512 static void round_f16_avx512(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                              _MM_FROUND_TO_NEAREST_INT)));
  for (; i < n; i++) dst[i] = ddp_half_to_float(ddp_float_to_half(src[i]));
}

/* ---- F16C (the AVX2 family) ---- */

F16C static void to_f16_avx2(uint16_t *restrict dst, const float *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  to_f16_plain(dst + i, src + i, n - i);
}

F16C static void from_f16_avx2(float *restrict dst, const uint16_t *restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  from_f16_plain(dst + i, src + i, n - i);
}

F16C static void round_f16_avx2(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                                              _MM_FROUND_TO_NEAREST_INT)));
  for (; i < n; i++) dst[i] = ddp_half_to_float(ddp_float_to_half(src[i]));
}

/* ---- dispatch ---- */

static bool use_avx512(void) { return ddp__cpu_family_running() == DDP__CPU_AVX512; }

static bool use_f16c(void) {
  return ddp__cpu_family_running() == DDP__CPU_AVX2 && __builtin_cpu_supports("f16c");
}

void ddp_convert_f32_to_bf16(uint16_t *dst, const float *src, size_t n) {
  if (use_avx512())
    to_bf16_avx512(dst, src, n);
  else
    to_bf16_plain(dst, src, n);
}

void ddp_convert_bf16_to_f32(float *dst, const uint16_t *src, size_t n) {
  if (use_avx512())
    from_bf16_avx512(dst, src, n);
  else
    from_bf16_plain(dst, src, n);
}

void ddp_convert_f32_to_f16(uint16_t *dst, const float *src, size_t n) {
  if (use_avx512())
    to_f16_avx512(dst, src, n);
  else if (use_f16c())
    to_f16_avx2(dst, src, n);
  else
    to_f16_plain(dst, src, n);
}

void ddp_convert_f16_to_f32(float *dst, const uint16_t *src, size_t n) {
  if (use_avx512())
    from_f16_avx512(dst, src, n);
  else if (use_f16c())
    from_f16_avx2(dst, src, n);
  else
    from_f16_plain(dst, src, n);
}

void ddp_convert_round_f32(float *dst, const float *src, size_t n, ddp_dtype dtype) {
  if (dtype == DDP_BFLOAT16) {
    if (use_avx512()) {
      round_bf16_avx512(dst, src, n);
      return;
    }
    for (size_t i = 0; i < n; i++) dst[i] = ddp_bf16_to_float(ddp_float_to_bf16(src[i]));
  } else if (dtype == DDP_FLOAT16) {
    if (use_avx512()) {
      round_f16_avx512(dst, src, n);
      return;
    }
    if (use_f16c()) {
      round_f16_avx2(dst, src, n);
      return;
    }
    for (size_t i = 0; i < n; i++) dst[i] = ddp_half_to_float(ddp_float_to_half(src[i]));
  } else if (dst != src) {
    memmove(dst, src, n * sizeof(float));
  }
}
