#!/usr/bin/env bash
# ddp-train --microbatches M (gradient accumulation, issue 23): the baseline
# every pipeline check compares with.
#  - one rank, toy model (a mean loss, no BatchNorm), 10 steps of SGD with
#    momentum: --microbatches 4 ends with the full batch's parameters, per
#    tensor max|a-b| <= 1e-5 max|b| + 1e-7; so does --microbatches 4 under
#    data parallelism (2 ranks x 8, each rank's batch in 4, the gradients
#    reduced once per step after the last micro-batch) against one rank's
#    batch of 16 whole, within issue 7's bound (1e-4 max|b| + 1e-6);
#  - --microbatches 3 on a batch of 16 (6, 5, 5) is not the full batch's
#    step (micro-batch means weigh rows unequally): the check tells them apart;
#  - refused: --microbatches 0, --schedule without --pp.
# Every rank runs under `timeout`; DDP_TIMEOUT bounds every collective.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3 to compare the dumps"
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE
export DDP_TIMEOUT=60
. "$here/../support/train_ranks.sh"

within() { "$py" "$here/compare_state.py" "$@" --tol 1e-5 1e-7; } # issue 23's bound

toy=(--model toy --max-steps 10 --seed 3 --lr 0.05 --momentum 0.9 --workers 0 --json)
single full "${toy[@]}" --batch-size 16 --dump-state "$tmp/full"
single m4 "${toy[@]}" --batch-size 16 --microbatches 4 --dump-state "$tmp/m4"
within "$tmp/m4" "$tmp/full" || fail "--microbatches 4 differs from the full batch"
echo "ok: --microbatches 4 == the full batch of 16 after 10 steps"

single m3 "${toy[@]}" --batch-size 16 --microbatches 3 --dump-state "$tmp/m3"
if within "$tmp/m3" "$tmp/full" >/dev/null; then
  fail "--microbatches 3 (6, 5, 5) matched the full batch: the split did not happen"
fi
echo "ok: --microbatches 3 (uneven) is told apart from the full batch"

world 2 dp "${toy[@]}" --batch-size 8 --microbatches 4 --dump-state "$tmp/dp.{rank}"
cmp -s "$tmp/dp.0" "$tmp/dp.1" || fail "2 ranks with --microbatches 4: the replicas differ"
"$py" "$here/compare_state.py" "$tmp/dp.0" "$tmp/full" || fail "2 x 8 with --microbatches 4 differs from 1 x 16"
[ "$("$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["steps"])' "$tmp/dp.out.0")" = 10 ] \
  || fail "the data-parallel run did not take 10 steps"
echo "ok: 2 ranks x 8 with --microbatches 4 == 1 rank x 16 (issue 7's bound), replicas identical"

"$bin" --model toy --microbatches 0 >/dev/null 2>"$tmp/bad0" && fail "--microbatches 0 accepted"
grep -q -- "--microbatches expects an integer >= 1" "$tmp/bad0" || { cat "$tmp/bad0"; fail "--microbatches 0: message"; }
"$bin" --model toy --schedule gpipe >/dev/null 2>"$tmp/bad1" && fail "--schedule without --pp accepted"
grep -q -- "need --pp P" "$tmp/bad1" || { cat "$tmp/bad1"; fail "--schedule without --pp: message"; }
echo "ok: bad options refused"
