#!/usr/bin/env bash
# The flight recorder under ddprun, one case per CTest test (issue 27's
# Must-show). 3 workers (tests/launch/flight_worker.c) run allreduces of
# 116 KiB with DDP_TIMEOUT=2; at allreduce #5 rank 2 breaks the job:
#   skip     rank 2 skips allreduce #5 and stays busy elsewhere: ranks 0-1
#            time out and dump, ddprun asks rank 2 for its dump (SIGUSR1) and
#            prints "rank 2 never entered allreduce #5 (116 KiB); ranks 0-1
#            waited 2 s in it", with rank 2's last collective (#4)
#   sigstop  rank 2 stops itself (SIGSTOP) before allreduce #5: ddprun says
#            "no dump from rank 2: it is stopped ..." and that ranks 0-1 waited
#            in allreduce #5
# In both: the verdict reaches ddprun's stderr within DDP_TIMEOUT + 5 s of
# rank 0 entering allreduce #5, ddprun exits 1, the dumps in DDP_DEBUG_DIR
# parse as JSON (Python's json module) with the expected last records, and
# `ddp-debug flight DIR` gives the same verdict (and answers --help,
# --version, no command: 2, a missing path: 1).
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

case_name=${1:?usage: test_flight.sh skip|sigstop}
bin=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}
worker=${DDP_TEST_BIN_DIR:-$bin/../tests}/flight_worker
ddprun=$bin/ddprun
debug=$bin/ddp-debug
for x in "$ddprun" "$debug" "$worker"; do [ -x "$x" ] || fail "$x is not built"; done
tmp=$(mktemp -d)
ddprun_pid=
cleanup() {
  [ -n "$ddprun_pid" ] && kill -KILL "$ddprun_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

timeout_s=2
case "$case_name" in
skip) breaks=(--skip-rank 2 --sleep 60) ;;
sigstop) breaks=(--stop-rank 2) ;;
*) fail "unknown case $case_name" ;;
esac

# ddprun's stderr, each line stamped with the time it arrived (bash's
# clock: no process per line); the subshell ends when both have.
(
  DDP_TIMEOUT=$timeout_s DDP_DEBUG_DIR="$tmp/dumps" timeout 60 "$ddprun" --nproc-per-node 3 \
    "$worker" --steps 8 --at 5 --count 29696 "${breaks[@]}" 2>&1 >"$tmp/out" |
    while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done >"$tmp/err"
  exit "${PIPESTATUS[0]}"
) &
ddprun_pid=$!
wait $ddprun_pid
rc=$?
ddprun_pid=
show() { echo "--- stdout"; cat "$tmp/out"; echo "--- stderr"; cut -d' ' -f2- "$tmp/err"; }
[ $rc -eq 1 ] || { show; fail "ddprun exited $rc (expected 1)"; }

entered=$(sed -n 's/^flight_worker: entering allreduce #5 at \([0-9.]*\)$/\1/p' "$tmp/out")
[ -n "$entered" ] || { show; fail "rank 0 did not reach allreduce #5"; }
# The line that must name the culprit, and when it arrived.
case "$case_name" in
skip) want='rank 2 never entered allreduce #5 (116 KiB); ranks 0-1 waited [0-9.]* s in it' ;;
sigstop) want='no dump from rank 2: it is stopped' ;;
esac
line=$(grep -m1 "ddprun:   $want" "$tmp/err")
[ -n "$line" ] || { show; fail "ddprun's verdict does not say: $want"; }
at=${line%% *}
awk -v a="$at" -v e="$entered" -v t=$timeout_s 'BEGIN { d = a - e; printf "verdict %.2f s after rank 0 entered allreduce #5\n", d; exit !(d <= t + 5) }' ||
  { show; fail "the verdict came later than DDP_TIMEOUT + 5 s"; }
case "$case_name" in
skip)
  grep -q 'ddprun:     rank 2: last collective allreduce #4 (116 KiB), completed' "$tmp/err" ||
    { show; fail "the verdict does not give rank 2's last collective"; }
  dumps="0 1 2" ;;
sigstop)
  grep -q 'ddprun:   ranks 0-1 waited [0-9.]* s in allreduce #5 (116 KiB); no dump from rank 2' "$tmp/err" ||
    { show; fail "the verdict does not say where ranks 0-1 waited"; }
  dumps="0 1"
  [ -e "$tmp/dumps/ddp-flight-rank2.json" ] && fail "a stopped rank 2 left a dump" ;;
esac

# The files: JSON, this format, the expected last record per rank.
for r in $dumps; do
  f="$tmp/dumps/ddp-flight-rank$r.json"
  [ -f "$f" ] || { ls -l "$tmp/dumps"; fail "no dump file for rank $r"; }
done
ls "$tmp/dumps" | grep -q '\.tmp\.' && fail "a temporary dump file was left in DDP_DEBUG_DIR"
py=/usr/bin/python3
[ -x $py ] || py=$(command -v python3)
if [ -n "$py" ]; then
  "$py" - "$tmp/dumps" $dumps <<'PY' || fail "the dumps are not what the ranks did"
import json, sys
d = sys.argv[1]
timed_out = False
for r in map(int, sys.argv[2:]):
    dump = json.load(open(f"{d}/ddp-flight-rank{r}.json"))
    assert dump["format"] == "ddp-flight-recorder" and dump["version"] == 1, dump["format"]
    assert dump["rank"] == r and dump["world_size"] == 3, (dump["rank"], dump["world_size"])
    (g,) = dump["groups"]
    assert g["name"] == "pg/1/" and g["rank"] == r and g["size"] == 3, g
    last = g["entries"][-1]
    assert last["op"] == "allreduce" and last["count"] == 29696 and last["dtype"] == "float32", last
    assert last["bytes"] == 29696 * 4, last
    if r < 2:  # gave up in #5: timed out, or told by the rank that timed out first
        assert dump["reason"] in ("timeout", "peer"), dump["reason"]
        assert last["seq"] == 5 and last["state"] == "failed", last
        assert last["status"] == {"timeout": "DDP_ERR_TIMEOUT", "peer": "DDP_ERR_PEER"}[dump["reason"]], last
        assert last["ended_ns"] - last["started_ns"] >= 1.9e9, last
        timed_out = timed_out or dump["reason"] == "timeout"
    else:      # asked by ddprun, last completed #4
        assert dump["reason"] == "signal", dump["reason"]
        assert last["seq"] == 4 and last["state"] == "completed", last
    assert [e["seq"] for e in g["entries"]] == list(range(1, len(g["entries"]) + 1))
assert timed_out, "neither rank 0 nor rank 1 dumped on its timeout"
print("dumps ok:", sys.argv[2:])
PY
fi

# After the fact, from the files alone; the tool's own manners first.
"$debug" --help | grep -q '^usage: ddp-debug flight' || fail "ddp-debug --help"
"$debug" --version | grep -q '^ddp-debug (ddp) [0-9]' || fail "ddp-debug --version"
"$debug" >/dev/null 2>&1; [ $? -eq 2 ] || fail "ddp-debug without a command should exit 2"
"$debug" flight "$tmp/nothing-here" >/dev/null 2>&1; [ $? -eq 1 ] || fail "ddp-debug on a missing path should exit 1"
"$debug" flight "$tmp/dumps" --world-size 3 >"$tmp/debug" 2>&1 || { cat "$tmp/debug"; fail "ddp-debug flight failed"; }
case "$case_name" in
skip) grep -q "  $want" "$tmp/debug" || { cat "$tmp/debug"; fail "ddp-debug's verdict differs"; } ;;
sigstop) grep -q '  no dump from rank 2$' "$tmp/debug" && grep -q 'ranks 0-1 waited [0-9.]* s in allreduce #5' "$tmp/debug" ||
  { cat "$tmp/debug"; fail "ddp-debug's verdict differs"; } ;;
esac
echo "PASS: $case_name"
