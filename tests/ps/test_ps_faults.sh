#!/usr/bin/env bash
# Faults of ddp-train --param-servers under ddprun (issue 25). A test model
# whose step is mostly a sleep (toy, --step-sleep-ms) keeps each run a few
# seconds long, so a kill lands mid-epoch (after trainer 0 logged 20 steps):
#  - async and ssp:2: trainer1 (rank 2) SIGKILLed; the server names it and
#    drops it, the others finish every step, the job exits 0 (--may-fail);
#  - sync: the same kill stops the run: the server and every other trainer
#    fail naming trainer1, the job exits non-zero;
#  - the server SIGKILLed: every trainer exits within 5 s naming 'ps0';
#  - a sync run with --save-every 10 killed mid-run, resumed from its last
#    checkpoint: it continues from a step that is a multiple of 10 and ends
#    bit-identical to a run that was never killed.
# Every run under `timeout`, every wait polled with a deadline.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3"
tmp=$(mktemp -d)
job=
cleanup() { [ -n "$job" ] && kill "$job" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
export DDP_TIMEOUT=60

# 9600 samples over 3 trainers, batch 16: 200 steps an epoch, each >= 4 ms.
base=(--model toy --samples 9600 --batch-size 16 --epochs 2 --step-sleep-ms 4 --json)

# start TAG ARGS...: ddprun in the background (world 4: 1 server, 3 trainers).
start() {
  local tag=$1; shift
  timeout 120 "$bin/ddprun" --nproc-per-node 4 "$@" >"$tmp/$tag.out" 2>"$tmp/$tag.err" &
  job=$!
}
# pid_of RANK TAG: the worker of that rank in the job whose log is TAG.log.
pid_of() {
  local p
  for p in $(pgrep -f "ddp-train .*$tmp/$2.log"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return 0; }
  done
  return 1
}
# wait_steps TAG N: until trainer 0 logged N steps (30 s at most).
wait_steps() {
  local deadline=$((SECONDS + 30))
  local n
  while n=$(grep -c '"loss"' "$tmp/$1.log" 2>/dev/null); [ "${n:-0}" -lt "$2" ]; do
    [ $SECONDS -lt $deadline ] || { cat "$tmp/$1.err"; fail "$1: trainer 0 did not reach step $2"; }
    sleep 0.05
  done
}
finish() { local rc=0; wait "$job" || rc=$?; job=; return $rc; }
errs() { grep -v '^ddprun:   |' "$tmp/$1.err"; }

# --- async and ssp:2: a trainer dies, the rest finish -----------------------------
for mode in async ssp:2; do
  tag=${mode%%:*}
  start "$tag" --may-fail 1-3 "$bin/ddp-train" "${base[@]}" --param-servers 1 --ps-mode "$mode" \
    --log "$tmp/$tag.log"
  wait_steps "$tag" 20
  victim=$(pid_of 2 "$tag") || fail "$mode: no rank 2"
  kill -9 "$victim"
  finish || { errs "$tag" | tail; fail "$mode: the job failed after a trainer's death"; }
  errs "$tag" | grep -q "trainer 'trainer1' (rank 2) died after finishing step [0-9]* (.*); dropped, going on with 2 trainers" \
    || { errs "$tag"; fail "$mode: the server did not name the dead trainer"; }
  errs "$tag" | grep -q "server ps0 ($tag): .* 2 trainers finished, 1 dropped" \
    || { errs "$tag"; fail "$mode: the server's report"; }
  errs "$tag" | grep "died" | head -2
  steps=$("$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["steps"])' "$tmp/$tag.out")
  [ "$steps" = 400 ] || fail "$mode: trainer 0 took $steps steps, not 400"
done

# --- sync: a trainer's death stops the run, named ------------------------------
start sync --may-fail 1-3 "$bin/ddp-train" "${base[@]}" --param-servers 1 --ps-mode sync \
  --log "$tmp/sync.log"
wait_steps sync 20
victim=$(pid_of 2 sync) || fail "sync: no rank 2"
kill -9 "$victim"
finish && { errs sync | tail; fail "sync: the job succeeded without trainer1"; }
for r in 0 1 3; do
  errs sync | grep -q "rank $r: error: .*trainer 'trainer1' (rank 2) died .*sync training cannot go on" \
    || { errs sync; fail "sync: rank $r did not fail naming trainer1"; }
done

# --- the server dies: every trainer exits within 5 s naming it -------------------
start server --may-fail all "$bin/ddp-train" "${base[@]}" --param-servers 1 --ps-mode async \
  --log "$tmp/server.log"
wait_steps server 20
victim=$(pid_of 0 server) || fail "server: no rank 0"
trainers=$(for r in 1 2 3; do pid_of $r server; done)
kill -9 "$victim"
t0=$("$py" -c 'import time; print(time.monotonic())')
deadline=$((SECONDS + 20))
for p in $trainers; do
  while kill -0 "$p" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "server: trainer pid $p still runs 20 s after the kill"
    sleep 0.02
  done
done
elapsed=$("$py" -c "import time; print(time.monotonic() - $t0)")
finish || true
"$py" -c "import sys; sys.exit(0 if $elapsed <= 5 else 1)" \
  || fail "server: the trainers took ${elapsed} s to exit (> 5 s)"
for r in 1 2 3; do
  errs server | grep -q "rank $r: error: .*'ps0' (rank 0)" \
    || { errs server; fail "server: rank $r did not name ps0"; }
done
echo "server killed: every trainer gone after ${elapsed} s"
errs server | grep "error" | head -3

# --- killed, then resumed from the last checkpoint == never killed ----------------
sync_args=(--model toy --samples 9600 --batch-size 16 --epochs 2 --param-servers 1 --ps-mode sync
           --momentum 0.9)
timeout 120 "$bin/ddprun" --nproc-per-node 4 "$bin/ddp-train" "${sync_args[@]}" \
  --dump-state "$tmp/straight.{rank}" >/dev/null 2>"$tmp/straight.err" \
  || { errs straight | tail; fail "the straight run"; }
start killed --may-fail 1-3 "$bin/ddp-train" "${sync_args[@]}" --step-sleep-ms 4 \
  --save "$tmp/ck.safetensors" --save-every 10 --log "$tmp/killed.log"
wait_steps killed 35
victim=$(pid_of 3 killed) || fail "resume: no rank 3"
kill -9 "$victim"
finish && fail "resume: the killed run succeeded"
timeout 120 "$bin/ddprun" --nproc-per-node 4 "$bin/ddp-train" "${sync_args[@]}" \
  --resume "$tmp/ck.safetensors" --dump-state "$tmp/resumed.{rank}" >/dev/null 2>"$tmp/resumed.err" \
  || { errs resumed | tail; fail "the resumed run"; }
at=$(sed -n 's/^resuming .* at step \([0-9]*\) .*/\1/p' "$tmp/resumed.err")
[ -n "$at" ] && [ "$at" -ge 30 ] && [ $((at % 10)) = 0 ] || fail "resumed at step '$at'"
for r in 1 2 3; do
  "$py" "$here/../train/compare_state.py" "$tmp/resumed.$r" "$tmp/straight.$r" --exact \
    || fail "resume: rank $r differs from the straight run"
done
echo "PASS (resumed at step $at)"
