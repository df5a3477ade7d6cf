/* The FMA peak of one core (bench/fma_peak.h) for each vector width this CPU
 * has, and the one of the kernel family this process runs
 * (DDP_CPU_KERNELS): what scripts/bench-convnet.sh divides the step's
 * GFLOP/s by. Prints one line a width, then
 *   fma_peak family=F lanes=N gflops=X
 * for the running family. */
#include <stdio.h>

#include "fma_peak.h"
#include "ddp/tensor.h"

int main(void) {
  const double p8 = fma_peak_gflops(8), p16 = fma_peak_gflops(16);
  if (p8 > 0) printf("8 lanes (AVX2 + FMA, ymm):  %.1f GFLOP/s\n", p8);
  if (p16 > 0) printf("16 lanes (AVX-512, zmm):    %.1f GFLOP/s\n", p16);
  const char *family = ddp_cpu_kernels();
  const int lanes = family_lanes(family);
  printf("fma_peak family=%s lanes=%d gflops=%.1f\n", family, lanes, lanes == 16 ? p16 : p8);
  return 0;
}
