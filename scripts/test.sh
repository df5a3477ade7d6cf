#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what it needs,
# builds the release and the sanitizer (ASan + UBSan) builds, and runs every
# test in both. Tests labelled "slow" (long training runs) run in the release
# build only. Exits non-zero when anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh build data test mpi slurm

scripts/build.sh release
scripts/build.sh sanitize

jobs=$(nproc)
echo "== release build: all tests =="
(cd build && ctest --output-on-failure -j "$jobs")
echo "== sanitizer build (ASan + UBSan): all tests but the slow ones =="
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
(cd build-asan && ctest --output-on-failure -j "$jobs" -LE slow)
