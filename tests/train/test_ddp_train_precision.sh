#!/usr/bin/env bash
# ddp-train --precision / --grad-scaler (issue 42, gradient scaling;
# docs/mixed-precision.md). The scaler in float32 arithmetic (--precision
# fp32 --grad-scaler on: PyTorch allows a GradScaler without autocast)
# scales by a power of two and unscales exactly, so with no overflow it must
# end bit-identical to the unscaled run (SC below):
#  - one process, plain, with --microbatches 3 (unscaled once per step,
#    after the 1/M scaling), with --clip-grad-norm (clipping after the
#    unscale) and with --replicas 2 (DataParallel);
#  - 2 ranks: data parallel, ZeRO-2 and a 2-stage pipeline (ranks started
#    with torchrun's variables, as the other ddp-train tests);
#  - an inf injected into rank 1's gradients at step 5 (DDP_TEST_INJECT_INF)
#    makes rank 0, whose gradients are finite, skip the step too: both
#    ranks end with the same state, equal to the run where every rank
#    injects it, and the log shows the skip and the halved scale; the
#    same over a 2-stage pipeline (stage 1's overflow skips stage 0);
#  - the scale follows GradScaler's rules in the log: x0.5 at the skip, x2
#    after each --grad-scaler-growth-interval clean steps;
#  - --save mid-run and --resume continue bit-identically (the scaler's
#    state in the .train file under PyTorch's keys), also across a skip,
#    at 2 ranks, under ZeRO-2 and from a sharded checkpoint;
#  - bf16 has no scaler by default (no loss_scale in the log), --grad-scaler
#    on gives it one, fp16 --grad-scaler off has none; tf32 is refused on
#    the CPU saying it is a GPU-only opt-in;
#  - TensorBoard's train/loss_scale follows the scale;
#  - bf16 and fp16 enter autocast's region in every strategy (one process,
#    DataParallel's replica threads, data parallel, pipeline): each run
#    differs from fp32's, follows it, and keeps its ranks equal;
#  - ddp-hpo --objective convnet --precision reaches each individual's trainer.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3 to compare the states"
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE DDP_TEST_INJECT_INF
export DDP_TIMEOUT=60
. "$here/../support/train_ranks.sh"
same() { "$py" "$here/st_compare.py" "$1" "$2" || fail "${3:-$1 and $2 differ}"; }
get() { "$py" "$here/st_compare.py" --get "$1" "$2"; }
# logged FILE STEP KEY: KEY of STEP's record in the JSON-lines log.
logged() {
  "$py" -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["step"] == int(sys.argv[2]) and "loss" in r: print(json.dumps(r.get(sys.argv[3])))' "$@"
}
cd "$tmp"

toy=(--model toy --seed 3 --lr 0.05 --momentum 0.9 --workers 0 --batch-size 16)
SC=(--grad-scaler on) # the scaler without autocast: exact

# --- one process: fp16 (scaled) == fp32, plain and with micro-batches --------
single f32 "${toy[@]}" --epochs 1 --save f32.safetensors
single f16 "${toy[@]}" --epochs 1 "${SC[@]}" --save f16.safetensors --log f16.log --json
same f32.safetensors f16.safetensors "the scaler changed an fp32 run (one process)"
[ "$(logged f16.log 1 loss_scale)" = 65536 ] || fail "the first step's scale is not 2^16"
[ "$(get f16.train.safetensors grad_scaler.scale)" = 65536.0 ] || fail "the saved scale"
grep -q '"loss_scale": 65536, "skipped_steps": 0' f16.out \
  || fail "the --json summary lacks the scaler: $(cat f16.out)"
single p16 "${toy[@]}" --max-steps 2 --precision fp16 --json
grep -q '"precision": "fp16", "loss_scale": 65536, "skipped_steps": 0' p16.out \
  || fail "fp16's --json summary lacks its precision or its scaler: $(cat p16.out)"
single m32 "${toy[@]}" --epochs 1 --microbatches 3 --save m32.safetensors
single m16 "${toy[@]}" --epochs 1 --microbatches 3 "${SC[@]}" --save m16.safetensors
same m32.safetensors m16.safetensors "the scaler with --microbatches 3 changed the run"
# Clipping runs on the unscaled gradients (PyTorch's unscale_, clip, step):
# with the scaler it clips exactly as without (clip 0.05 binds every step).
single c32 "${toy[@]}" --max-steps 20 --clip-grad-norm 0.05 --save c32.safetensors
single c16 "${toy[@]}" --max-steps 20 --clip-grad-norm 0.05 "${SC[@]}" --save c16.safetensors
same c32.safetensors c16.safetensors "the scaler changed a clipped run (clipping before the unscale?)"
single r32 "${toy[@]}" --max-steps 20 --replicas 2 --save r32.safetensors
single r16 "${toy[@]}" --max-steps 20 --replicas 2 "${SC[@]}" --save r16.safetensors
same r32.safetensors r16.safetensors "the scaler with --replicas 2 (DataParallel) changed the run"

# --- 2 ranks: data parallel, ZeRO-2, pipeline ----------------------------------
for mode in dp "zero --zero 2" "pp --pp 2 --split net2 --microbatches 4"; do
  tag=${mode%% *}
  extra=(); [ "$tag" = dp ] || read -r -a extra <<<"${mode#* }"
  world 2 "$tag.32" "${toy[@]}" --max-steps 30 "${extra[@]}" --save "$tag.32.safetensors"
  world 2 "$tag.16" "${toy[@]}" --max-steps 30 "${extra[@]}" "${SC[@]}" \
    --save "$tag.16.safetensors"
  same "$tag.32.safetensors" "$tag.16.safetensors" "$tag: the scaler at world 2 changed the run"
done

# --- a forced overflow on one rank is skipped on every rank --------------------
over=("${toy[@]}" --max-steps 20 --grad-scaler on --grad-scaler-growth-interval 4)
DDP_TEST_INJECT_INF=5:1 world 2 inj1 "${over[@]}" --log inj1.log --dump-state "inj1.{rank}" \
  --save inj1.safetensors
DDP_TEST_INJECT_INF=5 world 2 injall "${over[@]}" --save injall.safetensors
world 2 clean "${over[@]}" --save clean.safetensors
cmp -s inj1.0 inj1.1 || fail "the ranks' states differ after an overflow on rank 1 alone"
same inj1.safetensors injall.safetensors "an inf on rank 1 alone != an inf on every rank"
"$py" "$here/st_compare.py" inj1.safetensors clean.safetensors >/dev/null 2>&1 \
  && fail "the skipped step changed nothing (the injection did not reach the gradients)"
# The pipeline: stage 1's overflow skips stage 0's step too.
pp=(--pp 2 --split net2 --microbatches 4)
DDP_TEST_INJECT_INF=5:1 world 2 pinj1 "${over[@]}" "${pp[@]}" --save pinj1.safetensors
DDP_TEST_INJECT_INF=5 world 2 pinjall "${over[@]}" "${pp[@]}" --save pinjall.safetensors
same pinj1.safetensors pinjall.safetensors "pipeline: an inf on stage 1 alone != an inf on both stages"
[ "$(logged inj1.log 5 skipped)" = true ] || fail "rank 0 did not skip step 5 (rank 1's inf)"
[ "$(logged inj1.log 4 skipped)" = false ] || fail "step 4 was skipped"
# Scale: 2^16, x2 after steps 4 (4 clean), x0.5 at 5, x2 after 9, 13, 17.
for s_v in "3 65536" "4 131072" "5 65536" "8 65536" "9 131072" "13 262144" "17 524288" \
           "20 524288"; do
  set -- $s_v
  [ "$(logged inj1.log "$1" loss_scale)" = "$2" ] \
    || fail "step $1: scale $(logged inj1.log "$1" loss_scale), expected $2"
done
[ "$(logged inj1.log 20 skipped_steps)" = 1 ] || fail "skipped_steps is not 1"
[ "$(get inj1.train.safetensors grad_scaler._growth_tracker)" = 3 ] || fail "saved tracker"
[ "$(get inj1.train.safetensors grad_scaler.growth_interval)" = 4 ] || fail "saved interval"
[ "$(get inj1.train.safetensors grad_scaler.backoff_factor)" = 0.5 ] || fail "saved backoff"
[ "$(get inj1.train.safetensors grad_scaler.growth_factor)" = 2.0 ] || fail "saved growth"

# --- save mid-run, resume: bit-identical to straight, across a skip -----------
res=("${toy[@]}" --epochs 2 --grad-scaler on --grad-scaler-growth-interval 7)
DDP_TEST_INJECT_INF=40 single straight "${res[@]}" --save straight.safetensors
DDP_TEST_INJECT_INF=40 single part "${res[@]}" --max-steps 37 --save part.safetensors
[ "$(get part.train.safetensors grad_scaler._growth_tracker)" = 2 ] || fail "tracker at step 37"
[ "$(get part.train.safetensors grad_scaler.scale)" = 2097152.0 ] || fail "scale at step 37"
DDP_TEST_INJECT_INF=40 single resumed "${res[@]}" --resume part.safetensors --save resumed.safetensors
same straight.safetensors resumed.safetensors "resumed fp16 model != straight"
same straight.train.safetensors resumed.train.safetensors "resumed training state != straight"
# 2 ranks, data parallel: resumed == straight.
world 2 dstraight "${toy[@]}" --max-steps 40 --precision fp16 --grad-scaler-growth-interval 5 \
  --save dstraight.safetensors
world 2 dpart "${toy[@]}" --max-steps 23 --precision fp16 --grad-scaler-growth-interval 5 \
  --save dpart.safetensors
world 2 dres "${toy[@]}" --max-steps 40 --precision fp16 --grad-scaler-growth-interval 5 \
  --resume dpart.safetensors --save dres.safetensors
same dstraight.train.safetensors dres.train.safetensors "2 ranks: resumed training state != straight"
same dstraight.safetensors dres.safetensors "2 ranks: resumed model != straight"
# ZeRO-2 (the state gathered to rank 0's file) and a sharded checkpoint
# (rank 0's metadata file holds the scaler): resumed == straight.
world 2 zpart "${toy[@]}" --max-steps 23 --precision fp16 --grad-scaler-growth-interval 5 \
  --zero 2 --save zpart.safetensors
world 2 zres "${toy[@]}" --max-steps 40 --precision fp16 --grad-scaler-growth-interval 5 \
  --zero 2 --resume zpart.safetensors --save zres.safetensors
same dstraight.train.safetensors zres.train.safetensors "ZeRO-2: resumed training state != straight"
world 2 spart "${toy[@]}" --max-steps 23 --precision fp16 --grad-scaler-growth-interval 5 \
  --sharded-checkpoint --save spart.dir
world 2 sres "${toy[@]}" --max-steps 40 --precision fp16 --grad-scaler-growth-interval 5 \
  --resume spart.dir --save sres.safetensors
same dstraight.train.safetensors sres.train.safetensors "sharded: resumed training state != straight"
same dstraight.safetensors sres.safetensors "sharded: resumed model != straight"

# --- which precisions scale --------------------------------------------------
single b16 "${toy[@]}" --max-steps 3 --precision bf16 --log b16.log --save b16.safetensors
[ "$(logged b16.log 1 loss_scale)" = null ] || fail "bf16 has a scaler by default"
"$py" "$here/st_compare.py" --get b16.train.safetensors grad_scaler.scale >/dev/null 2>&1 \
  && fail "bf16 without a scaler saved a scaler state"
single b16on "${toy[@]}" --max-steps 3 --precision bf16 --grad-scaler on --log b16on.log
[ "$(logged b16on.log 1 loss_scale)" = 65536 ] || fail "bf16 --grad-scaler on has no scaler"
single f16off "${toy[@]}" --max-steps 3 --precision fp16 --grad-scaler off --log f16off.log
[ "$(logged f16off.log 1 loss_scale)" = null ] || fail "fp16 --grad-scaler off has a scaler"
"$bin" "${toy[@]}" --max-steps 3 --precision tf32 >tf32.out 2>&1 && fail "tf32 ran on the CPU"
grep -q "GPU-only opt-in" tf32.out || fail "tf32's refusal does not say why: $(cat tf32.out)"
"$bin" "${toy[@]}" --precision fp8 >fp8.out 2>&1 && fail "--precision fp8 accepted"
grep -q "fp32, bf16, fp16 or tf32" fp8.out || fail "--precision fp8's error: $(cat fp8.out)"
"$bin" "${toy[@]}" --grad-scaler maybe >gs.out 2>&1 && fail "--grad-scaler maybe accepted"

# --- TensorBoard: train/loss_scale per step, as the log has it ----------------
tpy=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
if [ -x "$tpy" ] && "$tpy" -c 'import tensorboard' 2>/dev/null; then
  DDP_TEST_INJECT_INF=3 single tb "${toy[@]}" --max-steps 5 --precision fp16 --tensorboard tbrun
  got=$("$tpy" -c 'import glob
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E
e = E(glob.glob("tbrun/**/events*", recursive=True)[0]); e.Reload()
print(" ".join("%d:%g" % (s.step, s.value) for s in e.Scalars("train/loss_scale")))')
  [ "$got" = "1:65536 2:65536 3:32768 4:32768 5:32768" ] || fail "TensorBoard's train/loss_scale: $got"
else
  echo "(no tensorboard package in $tpy: train/loss_scale's events not checked)"
fi

# --- autocast's region reaches every strategy's forward ------------------------
# bf16 and fp16 round linear's operands (docs/tensor.md, "Mixed precision"),
# so their runs must differ from fp32's, follow them (the 20th step's loss
# within 5 % of fp32's: bf16 rounds each op's result to 8 bits, 0.4 %), and
# keep the ranks equal. DataParallel's replicas run on threads of their
# own: without the region carried to them, --replicas 2 bf16 would equal
# fp32 bit for bit.
differs() { "$py" "$here/st_compare.py" "$1" "$2" >/dev/null 2>&1 && fail "$3"; true; }
tracks() { # LOG REF_LOG
  "$py" -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(not abs(a - b) <= 0.05 * abs(b))' \
    "$(logged "$1" 20 loss)" "$(logged "$2" 20 loss)" \
    || fail "$1: step 20's loss $(logged "$1" 20 loss) is not within 5 % of $2's $(logged "$2" 20 loss)"
}
single a32 "${toy[@]}" --max-steps 20 --save a32.safetensors --log a32.log
for p in bf16 fp16; do
  single "a$p" "${toy[@]}" --max-steps 20 --precision $p --save "a$p.safetensors" --log "a$p.log"
  differs a32.safetensors "a$p.safetensors" "$p: one process trained as fp32 did"
  tracks "a$p.log" a32.log
done
single ar32 "${toy[@]}" --max-steps 20 --replicas 2 --save ar32.safetensors --log ar32.log
single arbf "${toy[@]}" --max-steps 20 --replicas 2 --precision bf16 --save arbf.safetensors \
  --log arbf.log
differs ar32.safetensors arbf.safetensors "bf16 --replicas 2: the replicas computed in fp32"
tracks arbf.log ar32.log
world 2 dpbf "${toy[@]}" --max-steps 30 --precision bf16 --dump-state "dpbf.{rank}" \
  --save dpbf.safetensors
cmp -s dpbf.0 dpbf.1 || fail "bf16 data parallel: the ranks' states differ"
differs dp.32.safetensors dpbf.safetensors "bf16 data parallel trained as fp32 did"
world 2 ppbf "${toy[@]}" --max-steps 30 --pp 2 --split net2 --microbatches 4 --precision bf16 \
  --save ppbf.safetensors
differs pp.32.safetensors ppbf.safetensors "bf16 pipeline trained as fp32 did"

# --- ddp-hpo --objective convnet passes --precision to every individual -------
hpo=${DDP_BIN_DIR}/ddp-hpo
fashion=/usr/share/datasets/fashion-mnist
if [ -e "$fashion/t10k-labels-idx1-ubyte.gz" ]; then
  h=(--objective convnet --data "$fashion" --generations 2 --max-steps 3 --train-samples 64
     --val-samples 64 --json)
  best() { "$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["best_loss"])' "$1"; }
  timeout 180 "$hpo" "${h[@]}" --precision fp16 >h16.out 2>/dev/null || fail "ddp-hpo fp16"
  "$py" -c 'import math,sys; sys.exit(not math.isfinite(float(sys.argv[1])))' "$(best h16.out)" \
    || fail "ddp-hpo fp16's best loss is $(best h16.out)"
  timeout 180 "$hpo" "${h[@]}" --precision tf32 >h_tf32.out 2>h_tf32.err || true
  [ "$(best h_tf32.out)" = None ] && grep -q "GPU-only opt-in" h_tf32.err \
    || fail "ddp-hpo --precision tf32 did not reach the trainer: $(tail -2 h_tf32.err)"
else
  echo "(no Fashion-MNIST at $fashion: ddp-hpo's pass-through not checked)"
fi
echo "PASS"
