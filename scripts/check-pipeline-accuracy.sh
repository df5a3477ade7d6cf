#!/usr/bin/env bash
# Issue 23's ConvNet bar: a 2-stage pipeline (ddprun --nproc-per-node 2
# ddp-train --pp 2 --microbatches 4) reaches the test accuracy of one rank
# with the same batch and --microbatches 4 within 0.5 points, mean over
# three seeds. Both runs see the same initial weights (ddp's, from --seed),
# the same sample order (one replica either way) and the same micro-batches
# (BatchNorm normalises each micro-batch alone in both), so what is left to
# differ is float rounding and the ConvNet's routing decisions that rounding
# can flip (docs/parallel.md, "How close is equal"). Fashion-MNIST, SGD lr
# 0.01, momentum 0.9, batch 100, 3 epochs. Not CI: minutes; the figures go
# to docs/training.md.
# Usage: scripts/check-pipeline-accuracy.sh [epochs=3] [seeds="1 2 3"] [split=layer2] [schedule=1f1b]
set -euo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-3}
read -r -a seeds <<<"${2:-1 2 3}"
split=${3:-layer2}
schedule=${4:-1f1b}
data=/usr/share/datasets/fashion-mnist
[ -d "$data" ] || { echo "check-pipeline-accuracy: SKIP: $data missing"; exit 77; }
bin=${DDP_BIN_DIR:-build/bin}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
field() { /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
settings() { echo --model convnet --data "$data" --epochs "$epochs" --batch-size 100 --lr 0.01 \
  --momentum 0.9 --microbatches 4 --seed "$1" --json; }
run() { # TAG CMD...: the --json line; on failure, the stderr's tail and exit
  local tag=$1; shift
  timeout 1800 "$@" >"$work/$tag.out" 2>"$work/$tag.err" ||
    { echo "check-pipeline-accuracy: $tag failed:" >&2; tail -n 20 "$work/$tag.err" >&2; exit 1; }
  grep '^{' "$work/$tag.out" | tail -n 1
}
single_sum=0 pipe_sum=0
# samples/s: a side figure, not a benchmark (one run each, on whatever load
# the machine has; the pipeline's speed is measured in BENCHMARKS.md).
printf '%-6s %-10s %-10s %-8s %s\n' seed single pipeline diff "pipeline samples/s (single)"
for seed in "${seeds[@]}"; do
  one=$(run single$seed "$bin/ddp-train" $(settings "$seed"))
  two=$(run pipe$seed "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-train" $(settings "$seed") \
    --pp 2 --split "$split" --schedule "$schedule")
  a=$(field "$one" test_accuracy) b=$(field "$two" test_accuracy)
  printf '%-6s %-10.4f %-10.4f %+-8.2f %.0f (%.0f)\n' "$seed" "$a" "$b" \
    "$(/usr/bin/python3 -c 'import sys; print(100 * (float(sys.argv[2]) - float(sys.argv[1])))' "$a" "$b")" \
    "$(field "$two" samples_per_s)" "$(field "$one" samples_per_s)"
  single_sum=$(/usr/bin/python3 -c "print($single_sum + $a)")
  pipe_sum=$(/usr/bin/python3 -c "print($pipe_sum + $b)")
done
/usr/bin/python3 - "$single_sum" "$pipe_sum" "${#seeds[@]}" <<'PY'
import sys
s, p, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
d = 100 * (p - s) / n
ok = abs(d) <= 0.5
print(f"mean over {n} seeds: one rank {100 * s / n:.2f}%, 2-stage pipeline {100 * p / n:.2f}%, "
      f"difference {d:+.2f} points (bound 0.5): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
