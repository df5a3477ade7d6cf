#!/usr/bin/env bash
# examples/spawn_demo end to end: 4 forked workers each get the sum 10 and the
# program exits 0; with --fail 2 it exits 1, the summary on stderr names rank 2
# first, and the error names it with its exit code.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
demo=${DDP_BIN_DIR:?set DDP_BIN_DIR}/spawn_demo
out=$(timeout 30 "$demo" 4 2>&1) || { echo "$out"; fail "spawn_demo 4 exited $?"; }
[ "$(grep -c 'sum of rank+1 = 10 (want 10)' <<<"$out")" -eq 4 ] || { echo "$out"; fail "not 4 workers with the right sum"; }
out=$(timeout 30 "$demo" 3 --fail 2 2>&1)
rc=$?
[ $rc -eq 1 ] || { echo "$out"; fail "spawn_demo 3 --fail 2 exited $rc (expected 1)"; }
grep -q 'ddp_spawn: first failure: rank 2 (local rank 2) on host .*: exited with code 3' <<<"$out" ||
  { echo "$out"; fail "no summary naming rank 2"; }
grep -q 'spawn_demo: ddp_spawn: rank 2 (local rank 2, pid [0-9]*) on host .*: exited with code 3' <<<"$out" ||
  { echo "$out"; fail "the error does not name rank 2"; }
echo PASS
