#!/usr/bin/env bash
# Configures and builds ddp. Usage: scripts/build.sh [release|sanitize|tsan]
#   release  -> build/        (default; executables in build/bin/)
#   sanitize -> build-asan/   (AddressSanitizer + UndefinedBehaviorSanitizer)
#   tsan     -> build-tsan/   (ThreadSanitizer)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-release}
case "$kind" in
  release)  dir=build;      flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo) ;;
  sanitize) dir=build-asan; flags=(-DCMAKE_BUILD_TYPE=Debug -DDDP_SANITIZE=ON) ;;
  tsan)     dir=build-tsan; flags=(-DCMAKE_BUILD_TYPE=Debug -DDDP_TSAN=ON) ;;
  *) echo "build.sh: unknown build kind '$kind' (release, sanitize or tsan)" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)"
