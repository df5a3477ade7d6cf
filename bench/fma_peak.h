/* The machine's limit: single-precision FMA throughput of one core, measured
 * with independent chains of fused multiply-adds that never wait on each
 * other (more chains than FMA latency x FMA ports on any x86 core here), for
 * each vector width: 8 lanes (AVX2 + FMA, ymm) and 16 (AVX-512, zmm). A
 * dense op's GFLOP/s over this figure is how much of the core it uses.
 * The best of 15 short timed runs: on a shared machine, the least disturbed
 * run is the closest to the core's own figure. Header-only, for the
 * benchmarks (bench_ops, bench_fma_peak). */
#ifndef DDP_BENCH_FMA_PEAK_H
#define DDP_BENCH_FMA_PEAK_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "ddp/ddp.h"

#define FMA_PEAK_CHAINS 12 /* 12 accumulators + 2 operands: AVX2's 16 registers */

__attribute__((target("avx2,fma"), noinline)) static float fma_chains_avx2(int64_t iters) {
  __m256 acc[FMA_PEAK_CHAINS];
  for (int i = 0; i < FMA_PEAK_CHAINS; i++) acc[i] = _mm256_set1_ps((float)i);
  __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  __asm__("" : "+x"(a), "+x"(b)); /* not constants the compiler could fold */
  for (int64_t n = 0; n < iters; n++)
#pragma GCC unroll 12
    for (int i = 0; i < FMA_PEAK_CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < FMA_PEAK_CHAINS; i++) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

#define FMA_PEAK_CHAINS512 24

__attribute__((target("avx512f"), noinline)) static float fma_chains_avx512(int64_t iters) {
  __m512 acc[FMA_PEAK_CHAINS512];
  for (int i = 0; i < FMA_PEAK_CHAINS512; i++) acc[i] = _mm512_set1_ps((float)i);
  __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  __asm__("" : "+v"(a), "+v"(b));
  for (int64_t n = 0; n < iters; n++)
#pragma GCC unroll 24
    for (int i = 0; i < FMA_PEAK_CHAINS512; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < FMA_PEAK_CHAINS512; i++) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

/* GFLOP/s (2 per lane per FMA) at `lanes` 8 or 16; 0 when the CPU lacks
 * the instructions. */
static inline double fma_peak_gflops(int lanes) {
  if (lanes == 16 ? !__builtin_cpu_supports("avx512f")
                  : !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
    return 0.0;
  const int chains = lanes == 16 ? FMA_PEAK_CHAINS512 : FMA_PEAK_CHAINS;
  const int64_t iters = 1000000; /* 3-6 ms a run: short enough to fit between preemptions */
  volatile float sink = 0.0f;
  double best = 0.0;
  for (int run = 0; run < 15; run++) {
    const double t0 = ddp_time_s();
    sink += lanes == 16 ? fma_chains_avx512(iters) : fma_chains_avx2(iters);
    const double s = ddp_time_s() - t0;
    const double g = 2.0 * lanes * chains * (double)iters / s / 1e9;
    if (g > best) best = g;
  }
  (void)sink;
  return best;
}

/* The vector width of a kernel family ("avx512", "avx2", "generic"): the
 * generic family's gemms run in OpenBLAS, whose x86-64 builds take their
 * AVX2 kernels, so its limit is the 8-lane one. */
static inline int family_lanes(const char *family) { return strcmp(family, "avx512") == 0 ? 16 : 8; }

#endif
