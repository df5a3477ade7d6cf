/* The AVX2 family's part of batch norm (cpu/norm.c): the window sums of a
 * folded batch norm + relu + max pool backward, 8 windows a step. */
#include <immintrin.h>

#include "tensor/cpu/dense.h"

/* *s1 = sum of g[i], *s2 = sum of g[i] * (v[i] - m), over the windows i < n
 * whose one-byte argmax is open (>= 0): closed windows' lanes load nothing
 * and add nothing, as in cpu/norm.c's window_sums_avx512. */
__attribute__((target("avx2,fma"))) void
ddp__cpu_window_sums_avx2(float *s1, float *s2, const float *restrict g, const int8_t *argmax,
                          const float *restrict v, float m, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m);
  const __m256i closed = _mm256_set1_epi32(-1);
  __m256 a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i at = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(argmax + i)));
    const __m256i open = _mm256_cmpgt_epi32(at, closed);
    const __m256 gv = _mm256_maskload_ps(g + i, open);
    a1 = _mm256_add_ps(a1, gv);
    const __m256 d = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(v + i, open), mv),
                                   _mm256_castsi256_ps(open));
    a2 = _mm256_fmadd_ps(gv, d, a2);
  }
  float t1 = 0.0f, t2 = 0.0f; /* the last windows, one at a time */
  for (; i < n; i++)
    if (argmax[i] >= 0) t1 += g[i], t2 += g[i] * (v[i] - m);
  float l1[8], l2[8];
  _mm256_storeu_ps(l1, a1);
  _mm256_storeu_ps(l2, a2);
  for (int l = 0; l < 8; l++) t1 += l1[l], t2 += l2[l];
  *s1 = t1;
  *s2 = t2;
}
