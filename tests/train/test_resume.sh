#!/usr/bin/env bash
# ddp-train --save / --resume: a run stopped and resumed ends with parameters
# and training state bit-identical to the run that never stopped.
#  - toy (SGD momentum, StepLR): 2 epochs straight vs 1 epoch + resume for 1;
#    vs stopped mid-epoch (--max-steps 37) + resume; vs killed (-9) at an
#    arbitrary moment of a --save-every 7 run + resume from whatever it left;
#  - psnet (dropout, Adam) on a 100-image Fashion-MNIST subset: stopped
#    mid-epoch + resume (the dropout generator and Adam's step are restored);
#  - 2 ranks (rank 0 saves, both load): stopped mid-epoch + resume = straight;
#  - early stopping (--patience) goes on from the saved position;
#  - a resume with another --lr or from a corrupted checkpoint fails clearly.
# Compares the saved safetensors files' tensors byte for byte (st_compare.py).
set -euo pipefail
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
py=/usr/bin/python3
[ -x "$py" ] || py=python3
tmp=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
pass=0 fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }
same() { "$py" "$here/st_compare.py" "$1" "$2"; }
both_same() { same "$1.safetensors" "$2.safetensors" && same "$1.train.safetensors" "$2.train.safetensors"; }
get() { "$py" "$here/st_compare.py" --get "$1" "$2"; }

# killed_at_random PREFIX ARGS...: runs ddp-train ARGS --save PREFIX.safetensors
# until its first checkpoint exists, then SIGKILLs it at an arbitrary moment
# (no clean-up runs) and waits for it.
killed_at_random() {
  local prefix=$1; shift
  rm -f "$prefix".*
  "$bin" "$@" --save "$prefix.safetensors" 2>/dev/null &
  pids+=($!)
  for _ in $(seq 1 500); do [ -e "$prefix.train.safetensors" ] && break; sleep 0.01; done
  sleep 0.0$((RANDOM % 10))
  kill -9 "${pids[-1]}" 2>/dev/null || true
  wait "${pids[-1]}" 2>/dev/null || true
}

toy=(--model toy --batch-size 16 --lr 0.05 --momentum 0.9 --scheduler step --gamma 0.5
     --seed 3 --workers 1)
cd "$tmp"
"$bin" "${toy[@]}" --epochs 2 --save a.safetensors 2>/dev/null
check "the straight run saved step 128, position epoch 2 batch 0" \
  '[ "$(get a.train.safetensors train.step)" = 128 ] && [ "$(get a.train.safetensors train.epoch)" = 2 ]'

"$bin" "${toy[@]}" --epochs 1 --save b1.safetensors 2>/dev/null
out=$("$bin" "${toy[@]}" --epochs 2 --resume b1.safetensors --save b2.safetensors --json 2>&1)
check "resume announces where it continues" 'grep -q "resuming b1.safetensors at step 64 (epoch 2, batch 0 of 64)" <<<"$out"'
check "the step count continues (steps = 128)" 'grep -q "\"steps\": 128," <<<"$out"'
check "1 epoch + resume 1 epoch = 2 epochs straight (model and training state)" 'both_same a b2'

"$bin" "${toy[@]}" --epochs 2 --max-steps 37 --save c1.safetensors 2>/dev/null
check "stopped mid-epoch saves batch 37 of epoch 1" \
  '[ "$(get c1.train.safetensors train.epoch)" = 0 ] && [ "$(get c1.train.safetensors train.epoch_batches)" = 37 ]'
"$bin" "${toy[@]}" --epochs 2 --resume c1.safetensors --save c2.safetensors 2>/dev/null
check "stopped mid-epoch + resume = straight" 'both_same a c2'
# --max-steps counts from the start of training: resuming c1 with --max-steps 50 runs 13 steps.
"$bin" "${toy[@]}" --epochs 2 --max-steps 50 --resume c1.safetensors --save c3.safetensors 2>/dev/null
"$bin" "${toy[@]}" --epochs 2 --max-steps 50 --save c4.safetensors 2>/dev/null
check "--max-steps counts from the start (resumed 37 -> 50 = straight 50)" \
  '[ "$(get c3.train.safetensors train.step)" = 50 ] && both_same c3 c4'

# Killed at an arbitrary moment (-9, so no clean-up runs): whatever is on
# disk resumes, and gives the straight run's result. Saves take most of this
# run's time, so kills often land inside one; one landing between the pair's
# renames is rolled forward from the model's temporary file. Three tries.
for attempt in 1 2 3; do
  rm -f k2.* k3.*
  killed_at_random k "${toy[@]}" --epochs 200 --save-every 7
  k_step=$(get k.train.safetensors train.step)
  "$bin" "${toy[@]}" --epochs 200 --max-steps $((k_step + 40)) --save k2.safetensors \
    --resume k.safetensors 2>/dev/null
  "$bin" "${toy[@]}" --epochs 200 --max-steps $((k_step + 40)) --save k3.safetensors 2>/dev/null
  check "checkpoint every 7 steps survives kill -9 (try $attempt, step $k_step)" '[ $((k_step % 7)) -eq 0 ]'
  check "killed + resumed = straight, 40 steps after the kill (try $attempt)" 'both_same k2 k3'
done
# Early stopping goes on from where it was: with lr 0 the test loss never
# improves after the first evaluation, so --patience 3 --eval-every 2 stops
# at step 8, also when stopped at step 5 (two evaluations, one without
# improvement) and resumed. A checkpoint taken by --save-every counts the
# evaluation of its own step, which the resumed run does not repeat
# (killed + resumed = straight, training state byte for byte).
es=(--model headtail --data toydata --samples 2000 --batch-size 100 --lr 0 --eval-every 2
    --workers 0)
"$bin" "${es[@]}" --epochs 50 --patience 3 --save e.safetensors 2>/dev/null
"$bin" "${es[@]}" --epochs 50 --patience 3 --max-steps 5 --save e1.safetensors 2>/dev/null
check "stopped at step 5: 1 evaluation without improvement saved" \
  '[ "$(get e1.train.safetensors train.evals_without_better)" = 1 ]'
out=$("$bin" "${es[@]}" --epochs 50 --patience 3 --resume e1.safetensors --save e2.safetensors \
      --json 2>/dev/null | tail -n 1)
check "--patience: stopped + resumed stops at step 8, as straight" \
  'grep -q "\"steps\": 8," <<<"$out" && both_same e e2'
killed_at_random ke "${es[@]}" --epochs 500 --patience 1000 --save-every 4
ke_step=$(get ke.train.safetensors train.step)
"$bin" "${es[@]}" --epochs 500 --patience 1000 --max-steps $((ke_step + 6)) --save ke2.safetensors \
  --resume ke.safetensors 2>/dev/null
"$bin" "${es[@]}" --epochs 500 --patience 1000 --max-steps $((ke_step + 6)) --save ke3.safetensors \
  2>/dev/null
check "--save-every with evaluations: killed (step $ke_step) + resumed = straight" 'both_same ke2 ke3'
# Evaluations at the ends of epochs (20 steps) and a checkpoint every 20
# steps: each checkpoint is an epoch's last step, taken before that epoch's
# evaluation, which the resumed run must make as the saving run did.
eo=(--model headtail --data toydata --samples 2000 --batch-size 100 --lr 0 --workers 0
    --patience 1000 --epochs 500)
killed_at_random ko "${eo[@]}" --save-every 20
ko_step=$(get ko.train.safetensors train.step)
"$bin" "${eo[@]}" --max-steps $((ko_step + 30)) --save ko2.safetensors --resume ko.safetensors \
  2>/dev/null
"$bin" "${eo[@]}" --max-steps $((ko_step + 30)) --save ko3.safetensors 2>/dev/null
check "epoch-end evaluations: killed (step $ko_step, an epoch's end) + resumed = straight" \
  '[ $((ko_step % 20)) -eq 0 ] && both_same ko2 ko3'

# kill -9 can leave the killed save's temporary files (PATH.tmp.<its pid>);
# nothing else may be left behind.
check "no temporary files but the killed saves'" \
  '! ls "$tmp" | grep "\.tmp\." | grep -v "^k[eo]\?\.\(train\.\)\?safetensors\.tmp\.[0-9]*$"'

# Refusals.
set +e
out=$("$bin" "${toy[@]}" --lr 0.1 --epochs 2 --resume c1.safetensors 2>&1); rc=$?
check "a resume with another --lr is refused naming it" \
  '[ $rc -eq 1 ] && grep -q "saved with ddp-train.lr = 0.050000000000000003; this run has ddp-train.lr = 0.10000000000000001" <<<"$out"'
cp c1.safetensors bad.safetensors; cp c1.train.safetensors bad.train.safetensors
truncate -s 900 bad.safetensors
out=$("$bin" "${toy[@]}" --epochs 2 --resume bad.safetensors 2>&1); rc=$?
check "a truncated checkpoint is refused with the file and offset" \
  '[ $rc -eq 1 ] && grep -q "bad.safetensors: .*truncated" <<<"$out"'
out=$("$bin" "${toy[@]}" --epochs 2 --resume none.safetensors 2>&1); rc=$?
check "a missing checkpoint is refused" '[ $rc -eq 1 ] && grep -q "none.safetensors: cannot open" <<<"$out"'
out=$("$bin" --save-every 3 2>&1); rc=$?
check "--save-every without --save is a usage error" '[ $rc -eq 2 ]'
set -e

# Data parallel: 2 ranks (torchrun's variables by hand); rank 0 saves, both
# resume. Stopped mid-epoch + resumed = straight; a 1-rank resume of a
# mid-epoch 2-rank checkpoint deals out the rest of the epoch.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR
export DDP_TIMEOUT=60
. "$here/../support/free_port.sh"
world2() {
  local port r rc=0 wp=()
  port=$(ddp_free_port) || { echo "FAIL: no free port"; exit 1; }
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \
      LOCAL_WORLD_SIZE=2 timeout 60 "$bin" "$@" 2>"dp.err.$r" >/dev/null &
    wp+=($!); pids+=($!)
  done
  for r in "${wp[@]}"; do wait "$r" || rc=$?; done
  [ $rc -eq 0 ] || tail -n 3 dp.err.*
  return $rc
}
dp=(--model toy --batch-size 8 --lr 0.05 --momentum 0.9 --seed 3 --epochs 2 --workers 0)
if world2 "${dp[@]}" --save d.safetensors && world2 "${dp[@]}" --max-steps 37 --save d1.safetensors &&
   world2 "${dp[@]}" --resume d1.safetensors --save d2.safetensors; then
  check "2 ranks: saved world size 2" '[ "$(get d1.train.safetensors train.world_size)" = 2 ]'
  check "2 ranks: stopped mid-epoch + resumed = straight" 'both_same d d2'
else
  check "2-rank runs" 'false'
fi
# At another world (elastic training): the rest of the epoch from its
# position in samples. d1 is 37 steps x 2 ranks x 8 = 592 samples into
# epoch 1; at 1 rank the global batch of 16 is kept (16 per rank), so 3 more
# steps take 48, and the run that goes on to the end finishes both epochs.
check "2 ranks: the position in samples is saved" '[ "$(get d1.train.safetensors train.epoch_samples)" = 592 ]'
out=$("$bin" "${dp[@]}" --resume d1.safetensors --max-steps 40 --save d3.safetensors 2>&1 >/dev/null)
check "a 1-rank resume of a mid-epoch 2-rank checkpoint goes on from sample 592 with the global batch" \
  '[ "$(get d3.train.safetensors train.epoch_samples)" = 640 ] && [ "$(get d3.train.safetensors train.epoch)" = 0 ] &&
   [ "$(get d3.train.safetensors train.world_size)" = 1 ] &&
   grep -q "resuming d1.safetensors: 16 per replica (not --batch-size 8) keeps its global batch of 16 at 1 replicas" <<<"$out"'
"$bin" "${dp[@]}" --resume d3.safetensors --save d4.safetensors >/dev/null 2>&1
check "and finishes the run at 1 rank" \
  '[ "$(get d4.train.safetensors train.epoch)" = 2 ] && [ "$(get d4.train.safetensors train.epoch_samples)" = 0 ]'

# psnet: dropout and Adam, on a small subset of Fashion-MNIST.
fm=/usr/share/datasets/fashion-mnist
if [ -e "$fm/train-images-idx3-ubyte.gz" ]; then
  mkdir sub
  "$py" - "$fm" sub <<'EOF'
import gzip, struct, sys
src, dst = sys.argv[1], sys.argv[2]
for split, n in (("train", 100), ("t10k", 50)):
    for kind, item, hdr in (("images-idx3-ubyte", 784, 16), ("labels-idx1-ubyte", 1, 8)):
        raw = gzip.open("%s/%s-%s.gz" % (src, split, kind)).read()
        head = bytearray(raw[:hdr]); head[4:8] = struct.pack(">I", n)
        with gzip.open("%s/%s-%s.gz" % (dst, split, kind), "wb") as f:
            f.write(bytes(head) + raw[hdr:hdr + n * item])
EOF
  ps=(--model psnet --data sub --batch-size 20 --optimizer adam --seed 4)
  "$bin" "${ps[@]}" --epochs 2 --save p.safetensors 2>/dev/null
  "$bin" "${ps[@]}" --epochs 2 --max-steps 7 --save p1.safetensors 2>/dev/null
  "$bin" "${ps[@]}" --epochs 2 --resume p1.safetensors --save p2.safetensors 2>/dev/null
  check "psnet (dropout, Adam) stopped mid-epoch + resume = straight" 'both_same p p2'
  check "the dropout generator's state moves with training (saved at step 7 vs 10 differ)" \
    '[ "$(get p1.train.safetensors rng.dropout)" != "$(get p.train.safetensors rng.dropout)" ]'
else
  echo "SKIP psnet part: no Fashion-MNIST at $fm"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
