#!/usr/bin/env bash
# Mixed precision's accuracy against fp32 (issue 42: bf16, and fp16 with the
# gradient scaler, within 0.5 points of fp32's test accuracy, mean of the
# same 3 seeds): the ConvNet on Fashion-MNIST, one process on the CPU, the
# settings of scripts/check-accuracy.sh (batch 100, SGD lr 0.01 momentum
# 0.9), EPOCHS epochs, once per --precision. Prints one row per run and the
# means; exits 1 when a precision's mean is more than 0.5 points below
# fp32's.
#   scripts/check-precision-accuracy.sh [epochs=3] [seeds="2 1 3"] [precisions="bf16 fp16"]
# Accuracies do not depend on the machine's load (only the seconds column
# does); one seed's final accuracy moves by a few tenths between
# neighbouring runs, hence three seeds. Takes about 3 x (1 + #precisions)
# runs of a minute or two. Needs build/bin/ddp-train (DDP_BIN_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-3}
read -r -a seeds <<<"${2:-2 1 3}"
read -r -a precisions <<<"${3:-bf16 fp16}"
data=/usr/share/datasets/fashion-mnist
[ -d "$data" ] || { echo "check-precision-accuracy: SKIP: $data missing"; exit 77; }
bin=${DDP_BIN_DIR:-build/bin}
[ -x "$bin/ddp-train" ] || { echo "build first (scripts/build.sh)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
field() { /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
run() { # SEED PRECISION -> the JSON summary line
  local seed=$1 p=$2
  timeout 3600 "$bin"/ddp-train --model convnet --data "$data" --epochs "$epochs" \
    --batch-size 100 --lr 0.01 --momentum 0.9 --seed "$seed" --threads 1 --precision "$p" \
    --json >"$work/$p.$seed.out" 2>"$work/$p.$seed.err" ||
    { echo "check-precision-accuracy: $p seed $seed failed:" >&2; tail -n 20 "$work/$p.$seed.err" >&2; exit 1; }
  grep '"test_accuracy"' "$work/$p.$seed.out" | tail -n 1
}
printf '%-10s %6s %10s %10s %12s %10s\n' precision seed accuracy test_loss skipped_steps seconds
declare -A sum
for seed in "${seeds[@]}"; do
  for p in fp32 "${precisions[@]}"; do
    t0=$(date +%s)
    line=$(run "$seed" "$p") || exit 1
    t1=$(date +%s)
    a=$(field "$line" test_accuracy)
    l=$(field "$line" test_loss)
    sk=$(/usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("skipped_steps", "-"))' "$line")
    printf '%-10s %6s %9.2f%% %10.4f %12s %10s\n' "$p" "$seed" "$(echo "100*$a" | bc -l)" "$l" "$sk" $((t1 - t0))
    sum[$p]=$(echo "${sum[$p]:-0} + 100*$a" | bc -l)
  done
done
n=${#seeds[@]}
base=$(echo "${sum[fp32]} / $n" | bc -l)
status=0
echo
printf 'mean over %d seed(s): fp32 %.2f%%\n' "$n" "$base"
for p in "${precisions[@]}"; do
  m=$(echo "${sum[$p]} / $n" | bc -l)
  d=$(echo "$m - $base" | bc -l)
  ok=$(echo "$d >= -0.5" | bc -l)
  printf '  %-6s %.2f%%  (%+.2f points; bar: >= -0.50) %s\n' "$p" "$m" "$d" \
    "$([ "$ok" = 1 ] && echo ok || echo FAIL)"
  [ "$ok" = 1 ] || status=1
done
exit $status
