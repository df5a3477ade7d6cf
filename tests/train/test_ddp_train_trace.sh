#!/usr/bin/env bash
# The timeline (issue 27): a 2-rank ConvNet training (20 steps, 6 under a
# sanitizer; a 200-image test set) under ddprun with
# --bucket-cap-mb 0.02 (three buckets on its 113 KiB of gradients) and
# --trace DIR. trace_check.py reads the merged DIR/trace.json: it parses as
# JSON, has both ranks and every step, each step's phases (load, forward,
# backward, optimizer, loss allreduce) add up to the step's wall time within
# 0.05 ms + 2 %, and every bucket the wrapper's own launch record says was
# launched while gradients were pending (params_not_ready > 0) starts before
# that step's autograd ends (at least one per step). Also: the rank files
# are there and no temporary file is left, a failed merge (a broken rank
# file) is told without failing the job, and --bucket-cap-mb 0 is refused.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3 to read the trace"
fashion=/usr/share/datasets/fashion-mnist
[ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] || skip "$fashion not installed (install-deps.sh data)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A test set of 200 images: the final evaluations stay short under ASan.
data=$tmp/fashion-small
"$py" "$here/../support/fashion_small.py" "$fashion" "$data" 200 || fail "making the small test set"
# Under a sanitizer fewer steps: the checks are the same, each step slower.
steps=20
[ -n "${DDP_SANITIZER:-}" ] && steps=6
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  DDP_TRACE_FILE SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE
export DDP_TIMEOUT=60

timeout 180 "$bin/ddprun" --nproc-per-node 2 --trace "$tmp/trace" "$bin/ddp-train" \
  --data "$data" --model convnet --max-steps $steps --bucket-cap-mb 0.02 --workers 0 \
  >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/err"; fail "ddprun --trace exited $?"; }
grep -q "the timeline of 2 ranks is in $tmp/trace/trace.json" "$tmp/err" ||
  { cat "$tmp/err"; fail "ddprun did not say where the merged trace is"; }
for f in rank0.json rank1.json trace.json; do
  [ -s "$tmp/trace/$f" ] || fail "$f missing"
done
ls "$tmp/trace" | grep -q tmp && fail "a temporary file is left: $(ls "$tmp/trace")"
"$py" "$here/trace_check.py" "$tmp/trace/trace.json" 2 $steps 3 || fail "the merged trace"
# One rank alone (no launcher): --trace writes the file, every step in it
# (no buckets: nothing is reduced in a world of one).
timeout 120 "$bin/ddp-train" --data "$data" --model convnet --max-steps 5 --trace "$tmp/one.json" \
  >/dev/null 2>"$tmp/err1" || { cat "$tmp/err1"; fail "ddp-train --trace alone"; }
"$py" - "$tmp/one.json" <<'PY' || fail "the single-process trace"
import json, sys
d = json.load(open(sys.argv[1]))
steps = sorted(e["args"]["step"] for e in d["traceEvents"] if e.get("name") == "step")
assert steps == [1, 2, 3, 4, 5], steps
assert d["otherData"]["dropped_events"] == 0
PY
# A broken rank file: the merge names it, the job's status stays 0.
mkdir -p "$tmp/bad" && echo '{"traceEvents":[' >"$tmp/bad/rank7.json"
timeout 120 "$bin/ddprun" --nproc-per-node 1 --trace "$tmp/bad" "$bin/ddp-train" \
  --data "$data" --model convnet --max-steps 2 >/dev/null 2>"$tmp/err2" ||
  fail "a broken rank file failed the job"
grep -q "rank7.json" "$tmp/err2" || { cat "$tmp/err2"; fail "the broken rank file was not named"; }
if "$bin/ddp-train" --bucket-cap-mb 0 --max-steps 1 >/dev/null 2>&1; then
  fail "--bucket-cap-mb 0 was accepted"
fi
echo "ok"
