#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for a
# bounded time. Usage: scripts/fuzz.sh [seconds per target, default 30] [target]
# Seeds come from fuzz/corpus/<name>/ (read only); inputs libFuzzer finds go
# to build-fuzz/corpus/<name>/, crashes to build-fuzz/artifacts/. Exits
# non-zero when a target crashes. Needs clang: scripts/install-deps.sh fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
only=${2:-}
command -v clang >/dev/null || { echo "fuzz.sh: clang not found (scripts/install-deps.sh fuzz)" >&2; exit 2; }
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DDDP_FUZZ=ON -DDDP_NATIVE=OFF \
  -DCMAKE_BUILD_TYPE=Debug >/dev/null
status=0
for src in fuzz/*_fuzz.c; do
  name=$(basename "$src" .c)
  [ -n "$only" ] && [ "$only" != "$name" ] && continue
  cmake --build build-fuzz --target "$name" -j 2 >/dev/null
  seeds=fuzz/corpus/${name%_fuzz}
  mkdir -p "build-fuzz/corpus/$name" build-fuzz/artifacts
  echo "== $name for ${seconds}s (seeds: $seeds) =="
  if ! "build-fuzz/bin/$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/ \
      "build-fuzz/corpus/$name" "$seeds"; then
    echo "fuzz.sh: $name crashed; reproducer in build-fuzz/artifacts/" >&2
    status=1
  fi
done
exit $status
