#!/usr/bin/env bash
# Repeats the fork-heavy launch tests in parallel loops, to catch hangs that
# need an unlucky fork (a worker forked while another thread holds a lock):
# example_spawn_demo's script and test_launch, LOOPS loops x RUNS runs each.
#   scripts/stress-launch.sh [BUILD_DIR (build-asan)] [LOOPS (4)] [RUNS (10)]
# Each run has a timeout (spawn demo 70 s, test_launch 120 s); a hang shows as
# rc 124. Exits 1 if any run failed. Logs: $TMPDIR/stress-launch.*/
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$here/build-asan}" && pwd) || exit 2
loops=${2:-4}
runs=${3:-10}
[ -x "$build/bin/spawn_demo" ] && [ -x "$build/tests/test_launch" ] || { echo "build $build first"; exit 2; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/stress-launch.XXXXXX")
loop() {
  local l=$1 fails=0 rc
  for i in $(seq "$runs"); do
    DDP_BIN_DIR=$build/bin timeout 70 bash "$here/tests/launch/test_spawn_demo.sh" >"$logs/$l.$i.demo" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { fails=$((fails + 1)); echo "loop $l run $i: spawn_demo test rc=$rc ($logs/$l.$i.demo)"; }
    timeout 120 "$build/tests/test_launch" >"$logs/$l.$i.launch" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { fails=$((fails + 1)); echo "loop $l run $i: test_launch rc=$rc ($logs/$l.$i.launch)"; }
  done
  echo "$fails" >"$logs/fails.$l"
}
start=$SECONDS
for l in $(seq "$loops"); do loop "$l" & done
wait
total=0
for f in "$logs"/fails.*; do total=$((total + $(cat "$f"))); done
echo "$((loops * runs * 2)) runs in $((SECONDS - start)) s, $total failed (load: $(cut -d' ' -f1-3 /proc/loadavg)); logs in $logs"
[ "$total" -eq 0 ]
