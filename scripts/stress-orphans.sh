#!/usr/bin/env bash
# Repeats test_ddprun_orphans under load, the way it once failed (issue 19):
# the ASan build, ctest -j 2 beside another launch test (test_ddprun_signals),
# and a busy loop on every core but one. Stops at the first failure.
#   scripts/stress-orphans.sh [BUILD_DIR (build-asan)] [RUNS (20)]
# Builds only ddprun and launch_worker in BUILD_DIR (configure it first:
# scripts/build.sh sanitize). Each ctest run has a 300 s timeout (each test
# its own 120 s), the busy loops end on their own after RUNS x 300 s and are
# killed when the script exits. Exits 1 on a failed run, 2 on a setup error.
# Logs: $TMPDIR/stress-orphans.*/
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$here/build-asan}" && pwd) || exit 2
runs=${2:-20}
[ -f "$build/CTestTestfile.cmake" ] || { echo "configure $build first (scripts/build.sh sanitize)"; exit 2; }
cmake --build "$build" -j 2 --target ddprun launch_worker >/dev/null || { echo "building ddprun failed"; exit 2; }
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
logs=$(mktemp -d "${TMPDIR:-/tmp}/stress-orphans.XXXXXX")

# One busy loop per core but the first, each pinned to its core where taskset
# exists (on 2 cores: the other core busy while ctest runs two tests).
busy=()
stop_busy() {
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${busy[@]}"; do wait "$p" 2>/dev/null; done
}
trap stop_busy EXIT
cores=$(nproc)
for ((c = 1; c < (cores > 1 ? cores : 2); c++)); do
  pin=()
  command -v taskset >/dev/null && [ "$cores" -gt 1 ] && pin=(taskset -c "$c")
  timeout $((runs * 300)) "${pin[@]}" sh -c 'while :; do :; done' &
  busy+=($!)
done

start=$SECONDS
for i in $(seq "$runs"); do
  t=$SECONDS
  timeout 300 ctest --test-dir "$build" -j 2 -R 'test_ddprun_(orphans|signals)$' --timeout 120 \
    --output-on-failure >"$logs/run.$i" 2>&1
  rc=$?
  # Both tests must have run (a wrong pattern or build dir would pass on nothing).
  [ $rc -eq 0 ] && [ "$(grep -c 'Passed' "$logs/run.$i")" -ne 2 ] && rc=3
  if [ $rc -ne 0 ]; then
    tail -n 40 "$logs/run.$i"
    echo "run $i of $runs failed (rc $rc, $((SECONDS - t)) s; load: $(cut -d' ' -f1-3 /proc/loadavg)); log: $logs/run.$i"
    exit 1
  fi
  echo "run $i of $runs passed ($((SECONDS - t)) s; load: $(cut -d' ' -f1-3 /proc/loadavg))"
done
echo "$runs of $runs runs passed in $((SECONDS - start)) s beside ${#busy[@]} busy loop(s); logs in $logs"
