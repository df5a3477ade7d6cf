#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what it needs,
# checks which headers each layer includes (scripts/check-layers.sh, a
# second) and that every allocation in src/ goes through core's hooks
# (scripts/check-alloc.sh, a second), builds the release and the sanitizer
# (ASan + UBSan) builds, and runs every test in both. Tests labelled "slow"
# (long training runs) run in the release build only. Then a
# ThreadSanitizer build runs the tests labelled "tsan":
# the threaded ones, with small sizes (about a minute on 2 cores; see
# docs/comm.md, "ThreadSanitizer"); any report fails the test that caused it.
# Last, a portable build (no -march=native) runs the tests labelled "numeric"
# with the generic kernels (DDP_CPU_KERNELS=generic): what a CPU without
# AVX-512 or AVX2 computes; then, where the CPU has AVX2 and FMA (any x86
# machine here), those but the slow ones with the AVX2 family
# (DDP_CPU_KERNELS=avx2, about a minute on 2 cores): what an AVX2 CPU
# without AVX-512 computes (docs/tensor.md, "Kernel families").
# Exits non-zero when anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh build data test mpi slurm
echo "== layers: who may include what (scripts/check-layers.sh) =="
scripts/check-layers.sh
echo "== allocation: every one through core's hooks (scripts/check-alloc.sh) =="
scripts/check-alloc.sh
scripts/install-deps.sh refs || echo "test.sh: no reference environment (PyTorch 2.x in /opt/torch-venv); its tests will skip" >&2

scripts/build.sh release
scripts/build.sh sanitize
scripts/build.sh tsan
scripts/build.sh portable

jobs=$(nproc)
echo "== release build: all tests =="
(cd build && ctest --output-on-failure -j "$jobs")
echo "== sanitizer build (ASan + UBSan): all tests but the slow ones =="
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
(cd build-asan && ctest --output-on-failure -j "$jobs" -LE slow)
echo "== ThreadSanitizer build: the tests labelled tsan =="
# halt_on_error: a report ends the process at once with exit code 66, so a
# forked rank that would leave through _exit (skipping TSan's exit check)
# still fails its test.
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
# OpenBLAS single-threaded: its thread pool is not instrumented, so TSan
# cannot see the pool's hand-offs and reports its workers' writes into a
# buffer the caller wrote just before (sgemm_beta zeroing linear's fresh
# dx) as races. Our own threads stay checked.
(cd build-tsan && OPENBLAS_NUM_THREADS=1 ctest --output-on-failure -j "$jobs" -L tsan)
echo "== portable build, generic kernels: the tests labelled numeric =="
(cd build-portable && DDP_CPU_KERNELS=generic ctest --output-on-failure -j "$jobs" -L numeric)
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  echo "== portable build, AVX2 kernels: the tests labelled numeric, but the slow ones =="
  (cd build-portable && DDP_CPU_KERNELS=avx2 ctest --output-on-failure -j "$jobs" -L numeric -LE slow)
else
  echo "== portable build, AVX2 kernels: SKIP (this CPU has no AVX2 and FMA) =="
fi
