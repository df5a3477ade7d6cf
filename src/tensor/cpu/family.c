/* Which family of CPU kernels runs: the AVX-512 ones (cpu/gemm.c, conv.c,
 * conv_fold.c, pool.c, norm.c) or the generic C ones that every x86-64
 * CPU runs. Chosen once from the CPU and DDP_CPU_KERNELS
 * (auto|generic|avx512, docs/tensor.md "Kernel families"); tests may force
 * the generic family to compare the two in one process. */
#include <stdatomic.h>
#include <string.h>

#include "tensor/cpu/dense.h"

/* Both are read by every thread that runs a kernel: relaxed atomics, since
 * a lazily filled plain cache is a data race when two threads fill it at
 * once (ThreadSanitizer, ranks as threads of one process). */
static atomic_bool force_generic;
static _Atomic int chosen = -1; /* -1 not yet, 0 generic, 1 AVX-512 */

/* The family DDP_CPU_KERNELS asks for on this CPU; a request this CPU
 * cannot meet, or a value we do not know, falls back with a warning rather
 * than failing: kernels have no error path, and either family computes the
 * same results to float rounding. */
static int choose(void) {
  const bool cpu_has = __builtin_cpu_supports("avx512f");
  const char *want = ddp_env_str("DDP_CPU_KERNELS", "auto");
  if (!strcmp(want, "auto")) return cpu_has;
  if (!strcmp(want, "generic")) return 0;
  if (!strcmp(want, "avx512")) {
    if (!cpu_has)
      ddp_log(DDP_LOG_WARN, "DDP_CPU_KERNELS=avx512, but this CPU has no AVX-512F: using the "
                            "generic kernels");
    return cpu_has;
  }
  ddp_log(DDP_LOG_WARN, "DDP_CPU_KERNELS=\"%s\" is not one of auto, generic, avx512: using %s",
          want, cpu_has ? "avx512 (auto)" : "generic (auto)");
  return cpu_has;
}

bool ddp__cpu_has_avx512(void) {
  int c = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (c < 0) {
    c = choose();
    /* Two first callers may both choose (and both warn); they agree. */
    atomic_store_explicit(&chosen, c, memory_order_relaxed);
  }
  return c && !atomic_load_explicit(&force_generic, memory_order_relaxed);
}

void ddp__cpu_dense_force_generic(bool generic) {
  atomic_store_explicit(&force_generic, generic, memory_order_relaxed);
}

const char *ddp_cpu_kernels(void) { return ddp__cpu_has_avx512() ? "avx512" : "generic"; }
