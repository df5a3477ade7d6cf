/* core_latency: the round trip of one cache line between two CPUs, the
 * floor under every shared-memory collective between ranks on them. Two
 * threads pinned to CPU A and CPU B take turns incrementing a counter in a
 * shared 64-byte line; the figure is the median over 15 batches of 20,000
 * round trips, in nanoseconds. scripts/bench-placement.sh runs it beside
 * each measurement: on a VM the hypervisor may place the two vCPUs on
 * cores that share a cache or on cores that do not (another CCD on AMD
 * EPYC), which changes this figure, and every allreduce's, by a factor of
 * two or more whatever program runs (docs/comm.md, "Where the ranks run").
 *   core_latency [CPU_A (0)] [CPU_B (1)]    prints "core_latency A B NS" */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { BATCHES = 15, TRIPS = 20000 };

static _Alignas(64) atomic_uint_fast64_t g_line;
static int g_cpu[2];

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The responder: turns odd values into even ones until told to stop (the
 * value UINT64_MAX). A bounded spin: the pinger's deadline ends the run. */
static void *responder(void *arg) {
  (void)arg;
  if (pin(g_cpu[1]) != 0) return (void *)1;
  for (;;) {
    uint_fast64_t v = atomic_load_explicit(&g_line, memory_order_acquire);
    if (v == UINT64_MAX) return NULL;
    if (v & 1) atomic_store_explicit(&g_line, v + 1, memory_order_release);
  }
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
    puts("usage: core_latency [CPU_A (0)] [CPU_B (1)]\n"
         "The median round trip of a cache line between the two CPUs, in ns.");
    return 0;
  }
  g_cpu[0] = argc > 1 ? atoi(argv[1]) : 0;
  g_cpu[1] = argc > 2 ? atoi(argv[2]) : 1;
  if (pin(g_cpu[0]) != 0) {
    fprintf(stderr, "core_latency: cannot run on CPU %d\n", g_cpu[0]);
    return 2;
  }
  pthread_t t;
  if (pthread_create(&t, NULL, responder, NULL) != 0) return 2;
  double batch[BATCHES];
  const double deadline = now_ns() + 10e9; /* never spin past 10 s */
  int done = 0;
  for (int b = 0; b < BATCHES && now_ns() < deadline; b++) {
    double start = now_ns();
    for (int i = 0; i < TRIPS; i++) {
      uint_fast64_t v = atomic_load_explicit(&g_line, memory_order_relaxed);
      atomic_store_explicit(&g_line, v + 1, memory_order_release);
      for (unsigned spins = 1; atomic_load_explicit(&g_line, memory_order_acquire) != v + 2; spins++)
        if ((spins & 4095) == 0 && now_ns() > deadline) goto out; /* the responder is gone */
    }
    batch[done++] = (now_ns() - start) / TRIPS;
  }
out:
  atomic_store(&g_line, UINT64_MAX);
  void *rc;
  pthread_join(t, &rc);
  if (rc || done == 0) {
    fprintf(stderr, "core_latency: cannot run on CPU %d (or no round trip within 10 s)\n", g_cpu[1]);
    return 2;
  }
  qsort(batch, (size_t)done, sizeof batch[0], cmp_double);
  printf("core_latency %d %d %.1f\n", g_cpu[0], g_cpu[1], batch[done / 2]);
  return 0;
}
