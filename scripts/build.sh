#!/usr/bin/env bash
# Configures and builds ddp. Usage: scripts/build.sh [release|sanitize|tsan|portable]
#   release  -> build/          (default; executables in build/bin/)
#   sanitize -> build-asan/     (AddressSanitizer + UndefinedBehaviorSanitizer)
#   tsan     -> build-tsan/     (ThreadSanitizer)
#   portable -> build-portable/ (release without -march=native: runs on any
#                                x86-64; with DDP_CPU_KERNELS=generic it runs
#                                what a CPU without AVX-512 runs, docs/tensor.md)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-release}
case "$kind" in
  release)  dir=build;      flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo) ;;
  sanitize) dir=build-asan; flags=(-DCMAKE_BUILD_TYPE=Debug -DDDP_SANITIZE=ON) ;;
  tsan)     dir=build-tsan; flags=(-DCMAKE_BUILD_TYPE=Debug -DDDP_TSAN=ON) ;;
  portable) dir=build-portable; flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDDP_NATIVE=OFF) ;;
  *) echo "build.sh: unknown build kind '$kind' (release, sanitize, tsan or portable)" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)"
