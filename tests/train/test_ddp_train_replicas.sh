#!/usr/bin/env bash
# ddp-train --replicas (DataParallel: one process, replicas as threads):
#  - 2 replicas with --sync-bn over batch 100 end with the parameters and
#    running statistics of the model alone on batch 100, 10 ConvNet steps,
#    within 1e-2 of each tensor's update (docs/parallel.md, "How close is
#    equal"); without --sync-bn (PyTorch's DataParallel rule: batch norm
#    over each replica's half, the first replica's statistics kept) the
#    same comparison fails;
#  - two runs with 2 replicas dump the same bytes (gradients summed in
#    replica order);
#  - the test metrics are the model's, so they match the single run's.
# Each run under `timeout`.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3 to compare the dumps"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE
fashion=/usr/share/datasets/fashion-mnist
data=$tmp/fashion-small
[ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] || skip "$fashion is not installed (install-deps.sh data)"
"$py" "$here/../support/fashion_small.py" "$fashion" "$data" 1000 || fail "making the small test set"
run() { # OUT ARGS...
  local out=$1; shift
  timeout 300 "$bin" --model convnet --data "$data" --seed 2 --lr 0.01 --max-steps 10 \
    --batch-size 100 --workers 0 --json "$@" >"$tmp/$out.out" 2>"$tmp/$out.err" \
    || { cat "$tmp/$out.err"; fail "ddp-train $* exited $?"; }
}
run init --epochs 0 --dump-state "$tmp/init"
run single --dump-state "$tmp/single"
run synced --replicas 2 --sync-bn --dump-state "$tmp/synced"
"$py" "$here/compare_state.py" "$tmp/synced" "$tmp/single" --init "$tmp/init" \
  || fail "2 replicas with --sync-bn vs the model alone"
run rule --replicas 2 --dump-state "$tmp/rule"
if "$py" "$here/compare_state.py" "$tmp/rule" "$tmp/single" --init "$tmp/init" >/dev/null; then
  fail "2 replicas without --sync-bn matched the model alone: the comparison cannot tell"
fi
run again --replicas 2 --dump-state "$tmp/again"
cmp -s "$tmp/rule" "$tmp/again" || fail "two runs with 2 replicas dumped different states"
"$py" - "$tmp/synced.out" "$tmp/single.out" <<'PY' || fail "test metrics"
import json, sys
a, b = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
assert a["world_size"] == 1 and a["steps"] == b["steps"] == 10, (a, b)
for k in ("test_loss", "test_accuracy"):
    assert abs(a[k] - b[k]) <= 1e-2 * abs(b[k]) + 1e-4, (k, a[k], b[k])
PY
echo "ok: --replicas 2 --sync-bn == the model alone over 10 steps; the default rule differs; runs bitwise equal"
