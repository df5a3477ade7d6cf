#!/usr/bin/env bash
# ddp-train --comm-hook (issue 41) as 2 real processes (torchrun's variables
# by hand), the MLP on the synthetic data, SGD with momentum:
#  - powersgd:1 with 4 plain steps first: both ranks end with the same
#    parameters (the approximation is the same everywhere), different from
#    plain allreduce's; with a start beyond the run, equal to plain
#    allreduce's bit for bit;
#  - stopped after 10 steps (--save: the checkpoint and one PowerSGD state
#    file per rank beside it) and resumed to 20: bit-identical to 20 steps
#    straight (error feedback and Q restored); resumed at 3 ranks, PowerSGD
#    starts afresh with a warning;
#  - fp16 and bf16 run and differ from float32;
#  - refused with a clear message: with --zero, as one process, a bad hook,
#    --powersgd-start 1, and a resume whose state files are from another step.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE
export DDP_TIMEOUT=60
. "$here/../support/train_ranks.sh"

base=(--model mlp:32x3 --seed 3 --batch-size 16 --optimizer sgd --lr 0.05 --momentum 0.9)
psgd=(--comm-hook powersgd:1 --powersgd-start 4)

world 2 plain "${base[@]}" --max-steps 20 --dump-state "$tmp/plain.{rank}"
world 2 straight "${base[@]}" "${psgd[@]}" --max-steps 20 --dump-state "$tmp/straight.{rank}"
cmp -s "$tmp/straight.0" "$tmp/straight.1" || fail "powersgd: the ranks' parameters differ"
cmp -s "$tmp/straight.0" "$tmp/plain.0" && fail "powersgd:1 gave plain allreduce's parameters"
echo "ok: powersgd:1 keeps the replicas equal and differs from allreduce"

world 2 late "${base[@]}" --comm-hook powersgd:1 --powersgd-start 100 --max-steps 20 \
  --dump-state "$tmp/late.{rank}"
cmp -s "$tmp/late.0" "$tmp/plain.0" || fail "powersgd before its start differs from allreduce"
echo "ok: before --powersgd-start, bit-identical to allreduce"

world 2 first "${base[@]}" "${psgd[@]}" --max-steps 10 --save "$tmp/ck.safetensors"
for r in 0 1; do
  [ -s "$tmp/ck.safetensors.powersgd-rank$r.safetensors" ] || fail "no PowerSGD state of rank $r"
done
world 2 resumed "${base[@]}" "${psgd[@]}" --max-steps 20 --resume "$tmp/ck.safetensors" \
  --dump-state "$tmp/resumed.{rank}"
for r in 0 1; do
  cmp -s "$tmp/resumed.$r" "$tmp/straight.$r" ||
    fail "rank $r: 10 steps + resume to 20 differ from 20 steps straight"
done
echo "ok: stopped at 10 and resumed: bit-identical to 20 steps straight"

# At another world size (an elastic restart): PowerSGD starts afresh, warned.
world 2 e2 "${base[@]}" "${psgd[@]}" --elastic-batch per-rank --max-steps 10 \
  --save "$tmp/cke.safetensors"
world 3 w3 "${base[@]}" "${psgd[@]}" --elastic-batch per-rank --max-steps 14 \
  --resume "$tmp/cke.safetensors"
grep -q "PowerSGD starts afresh" "$tmp/w3.err.0" || { cat "$tmp/w3.err.0"; fail "no warning at world 3"; }
echo "ok: resumed at 3 ranks from 2: PowerSGD afresh, warned"

for h in fp16 bf16; do
  world 2 $h "${base[@]}" --comm-hook $h --max-steps 20 --dump-state "$tmp/$h.{rank}"
  cmp -s "$tmp/$h.0" "$tmp/$h.1" || fail "--comm-hook $h: the ranks differ"
  cmp -s "$tmp/$h.0" "$tmp/plain.0" && fail "--comm-hook $h gave float32's parameters"
done
echo "ok: --comm-hook fp16 and bf16 run"

refused() { # TAG PATTERN N ARGS...: every rank (N of them) exits non-zero saying PATTERN
  local tag=$1 pat=$2 n=$3; shift 3
  if [ "$n" = 1 ]; then
    timeout 60 "$bin" "$@" >"$tmp/$tag.out.0" 2>"$tmp/$tag.err.0" && fail "$tag: accepted"
  else
    start "$n" "$tag" "$@"
    for p in "${pids[@]}"; do wait "$p" && fail "$tag: a rank exited 0"; done
    pids=()
  fi
  grep -q -- "$pat" "$tmp/$tag.err.0" || { cat "$tmp/$tag.err.0"; fail "$tag: no '$pat'"; }
  echo "ok: $tag refused: $(grep -m1 -- "$pat" "$tmp/$tag.err.0" | cut -c1-150)"
}
refused zero "ZeRO reduce-scatters" 2 "${base[@]}" "${psgd[@]}" --zero 1 --max-steps 2
refused single "one process: nothing to average" 1 "${base[@]}" "${psgd[@]}" --max-steps 2
refused badhook "expects allreduce, fp16, bf16 or powersgd:RANK" 1 "${base[@]}" --comm-hook topk
refused start1 "powersgd-start" 1 "${base[@]}" --comm-hook powersgd:1 --powersgd-start 1
# State files of step 10 beside a checkpoint of step 12: refused, not mixed.
world 2 second "${base[@]}" "${psgd[@]}" --max-steps 12 --save "$tmp/ck2.safetensors"
cp "$tmp/ck.safetensors.powersgd-rank0.safetensors" "$tmp/ck2.safetensors.powersgd-rank0.safetensors"
cp "$tmp/ck.safetensors.powersgd-rank1.safetensors" "$tmp/ck2.safetensors.powersgd-rank1.safetensors"
refused stale "PowerSGD state" 2 "${base[@]}" "${psgd[@]}" --max-steps 20 --resume "$tmp/ck2.safetensors"
echo PASS
