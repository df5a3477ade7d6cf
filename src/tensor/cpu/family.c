/* Which family of CPU kernels runs: the AVX-512 ones (cpu/gemm.c, conv.c,
 * conv_fold.c, pool.c, norm.c, winograd.c), the AVX2 + FMA ones beside
 * them (the *_avx2 functions of cpu/), or the generic C ones that
 * every x86-64 CPU runs. Chosen once from the CPU and DDP_CPU_KERNELS
 * (auto|generic|avx2|avx512, docs/tensor.md "Kernel families"); tests may
 * force a family to compare them in one process. */
#include <stdatomic.h>
#include <string.h>

#include "tensor/cpu/dense.h"

/* Both are read by every thread that runs a kernel: relaxed atomics, since
 * a lazily filled plain cache is a data race when two threads fill it at
 * once (ThreadSanitizer, ranks as threads of one process). */
static _Atomic int forced = -1; /* -1: none, else the ddp__cpu_family a test forces */
static _Atomic int chosen = -1; /* -1: not yet, else a ddp__cpu_family */

static const char *const names[] = {"generic", "avx2", "avx512"};

/* The best family this CPU can run. AVX2 without FMA (a few early parts)
 * does not count: the AVX2 kernels are built on fused multiply-adds. */
static ddp__cpu_family best(void) {
  if (__builtin_cpu_supports("avx512f")) return DDP__CPU_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return DDP__CPU_AVX2;
  return DDP__CPU_GENERIC;
}

bool ddp__cpu_can_run(ddp__cpu_family f) {
  switch (f) {
  case DDP__CPU_GENERIC: return true;
  case DDP__CPU_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  case DDP__CPU_AVX512: return __builtin_cpu_supports("avx512f");
  }
  return false;
}

/* The family DDP_CPU_KERNELS asks for on this CPU; a request this CPU
 * cannot meet, or a value we do not know, falls back with a warning rather
 * than failing: kernels have no error path, and every family computes the
 * same results to float rounding. An unmet request falls back to auto's
 * choice only when that is no wider than the request (avx2 on an AVX-512
 * CPU is met; avx512 on an AVX2 CPU gets avx2, the best it has). */
static ddp__cpu_family choose(void) {
  const ddp__cpu_family top = best();
  const char *want = ddp_env_str("DDP_CPU_KERNELS", "auto");
  if (!strcmp(want, "auto")) return top;
  for (int f = DDP__CPU_GENERIC; f <= DDP__CPU_AVX512; f++) {
    if (strcmp(want, names[f]) != 0) continue;
    if (ddp__cpu_can_run((ddp__cpu_family)f)) return (ddp__cpu_family)f;
    ddp_log(DDP_LOG_WARN, "DDP_CPU_KERNELS=%s, but this CPU has no %s: using the %s kernels",
            want, f == DDP__CPU_AVX512 ? "AVX-512F" : "AVX2 and FMA", names[top]);
    return top;
  }
  ddp_log(DDP_LOG_WARN,
          "DDP_CPU_KERNELS=\"%s\" is not one of auto, generic, avx2, avx512: using %s (auto)",
          want, names[top]);
  return top;
}

ddp__cpu_family ddp__cpu_family_running(void) {
  const int f = atomic_load_explicit(&forced, memory_order_relaxed);
  if (f >= 0) return (ddp__cpu_family)f;
  int c = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (c < 0) {
    c = (int)choose();
    /* Two first callers may both choose (and both warn); they agree. */
    atomic_store_explicit(&chosen, c, memory_order_relaxed);
  }
  return (ddp__cpu_family)c;
}

bool ddp__cpu_has_avx512(void) { return ddp__cpu_family_running() == DDP__CPU_AVX512; }

bool ddp__cpu_has_avx2(void) { return ddp__cpu_family_running() == DDP__CPU_AVX2; }

bool ddp__cpu_force_family(int family) {
  if (family >= 0 && !ddp__cpu_can_run((ddp__cpu_family)family)) return false;
  atomic_store_explicit(&forced, family < 0 ? -1 : family, memory_order_relaxed);
  return true;
}

void ddp__cpu_dense_force_generic(bool generic) {
  ddp__cpu_force_family(generic ? DDP__CPU_GENERIC : -1);
}

const char *ddp_cpu_kernels(void) { return names[ddp__cpu_family_running()]; }
